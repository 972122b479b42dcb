"""No suite test passes on a refusal raised in this package's adapter code (``guard.peer_was_not_asked``).

The three adapters of ``adapter_verdicts.py`` run the same reference checks. Through ``call_peer``
(the peer's own verdict) every input test passes as it does for the bundled reference; raised by the
adapter itself, no test that expects an error passes: each is skipped as not asked, and an
``UnsafeForPeer`` refusal fails the test even where the test accepts a refusal naming its argument.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import inner_session

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def _outcomes(name: str, suite: str, tmp_path: Path, monkeypatch, capsys, *extra: str) -> dict[str, tuple[str, str]]:
    """``{test id: (outcome, message)}`` of ``suite`` against ``adapter_verdicts:<name>`` on the CPU."""
    report = tmp_path / f"{name}.xml"
    args = ["-p", "sparse_mla", str(ROOT / suite), "--sparse-mla-impl", f"adapter_verdicts:{name}",
            "--sparse-mla-device", "cpu", "-p", "no:cacheprovider", "-p", "no:xdist", "-q", "--tb=no",
            f"--junitxml={report}", "--basetemp", str(tmp_path / name), *extra]  # fmt: skip
    inner_session.run(args, cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys, syspath=[TESTS])
    out = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome, message = tag, node.get("message") or ""
        out[case.get("name") or "?"] = (outcome, message)
    return out


def test_a_refusal_from_adapter_code_never_passes_a_test(tmp_path, monkeypatch, capsys):
    suite = "suites/test_attention_inputs.py"
    asked = _outcomes("AskedPeer", suite, tmp_path, monkeypatch, capsys)
    answered = _outcomes("AdapterAnswers", suite, tmp_path, monkeypatch, capsys)
    assert set(asked) == set(answered) and len(asked) > 20
    assert {k: v for k, v in asked.items() if v[0] != "passed"} == {}  # the peer's own errors pass as they should
    expects_error = [k for k in asked if k.startswith(("test_bad_input_raises", "test_a_valid_lane_past_the_cache"))]
    assert len(expects_error) >= 15
    for test in expects_error:
        outcome, message = answered[test]
        assert outcome == "skipped" and "not asked: adapter-answers's adapter refused this input itself" in message, (
            test, outcome, message)
    assert all(answered[k][0] == "passed" for k in asked if k not in expects_error)


def test_an_unsafe_for_peer_refusal_fails_even_where_a_named_refusal_would_pass(tmp_path, monkeypatch, capsys):
    suite = "suites/test_attention_invariants.py"
    k = ["-k", "strided_sink_and_lengths"]
    asked = _outcomes("AskedPeer", suite, tmp_path, monkeypatch, capsys, *k)
    unsafe = _outcomes("UnsafeLengths", suite, tmp_path, monkeypatch, capsys, *k)
    assert asked["test_strided_sink_and_lengths_equal_contiguous_ones[lengths]"][0] == "passed"
    outcome, message = unsafe["test_strided_sink_and_lengths_equal_contiguous_ones[lengths]"]
    assert outcome == "failure" and "was not run: unsafe-lengths: topk_length has stride" in message, message
    assert unsafe["test_strided_sink_and_lengths_equal_contiguous_ones[attn_sink]"][0] == "passed"
