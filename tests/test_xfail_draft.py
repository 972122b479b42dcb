"""``--sparse-mla-xfail-draft``: a run's failures become a draft xfail file that turns the same run
green and fails once a listed discrepancy is fixed (``pytest_sparse_mla.xfail_draft``)."""

from __future__ import annotations

import re
from pathlib import Path

import inner_session

from pytest_sparse_mla.selection import read_id_file

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
SUITE = ROOT / "suites" / "test_attention_inputs.py"


def _run(tmp_path: Path, monkeypatch, capsys, impl: str, *extra: str) -> tuple[int, str]:
    args = ["-p", "sparse_mla", str(SUITE), "--sparse-mla-impl", impl, "--sparse-mla-device", "cpu",
            "-p", "no:cacheprovider", "-p", "no:xdist", "-o", "xfail_strict=true", "-q", "--tb=no", "-rN",
            "--basetemp", str(tmp_path / f"b{len(list(tmp_path.iterdir()))}"), *extra]  # fmt: skip
    return inner_session.run(args, cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys, syspath=[TESTS])


def _counts(output: str) -> dict[str, int]:
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|xfailed|xpassed|skipped)", output)}


def test_a_draft_turns_the_run_green_and_a_fix_fails_it(tmp_path, monkeypatch, capsys):
    draft = tmp_path / "draft.txt"
    wrong = "kernel_catalogue:drops_sink"  # ignores attn_sink: the sink's bad-input tests fail
    code, out = _run(tmp_path, monkeypatch, capsys, wrong, "--sparse-mla-xfail-draft", str(draft))
    failed = _counts(out).get("failed", 0)
    assert code == 1 and failed >= 3, out[-3000:]
    text = draft.read_text()
    definitions = re.findall(r"^# \[([A-Za-z0-9_-]+)\] bug: DRAFT \((\d+) test\(s\)\): (.+)$", text, re.M)
    entries = read_id_file(draft)
    assert sum(int(n) for _, n, _ in definitions) == len(entries) == failed, text
    keys = {k for k, _, _ in definitions}
    assert keys == {"bad-input"}, text  # grouped by the error class the failing tests exist for
    for line in text.splitlines():
        if line and not line.startswith("#"):
            test, key = line.split("     # ")
            assert test.startswith("suites/test_attention_inputs.py::") and key.strip() in keys, line
    # the draft turns the same run green ...
    code, out = _run(tmp_path, monkeypatch, capsys, wrong, "--sparse-mla-xfail-file", str(draft))
    assert code == 0 and _counts(out).get("xfailed") == failed and "failed" not in _counts(out), out[-3000:]
    # ... and a kernel without the bug fails on every listed test (strict XPASS)
    code, out = _run(tmp_path, monkeypatch, capsys, "reference", "--sparse-mla-xfail-file", str(draft))
    assert code == 1 and _counts(out).get("failed") == failed, out[-3000:]


def test_a_clean_run_writes_a_draft_with_no_entry(tmp_path, monkeypatch, capsys):
    draft = tmp_path / "draft.txt"
    code, out = _run(tmp_path, monkeypatch, capsys, "reference", "--sparse-mla-xfail-draft", str(draft), "-k", "zero")
    assert code == 0, out[-2000:]
    assert read_id_file(draft) == []
    assert draft.read_text().startswith("# DRAFT xfail file for --sparse-mla-impl reference")


def test_one_bug_is_one_key_named_after_its_cause_in_every_artefact(tmp_path, monkeypatch, capsys):
    """A kernel with one bug (the sink dropped: ``kernel_catalogue.drops_sink``) fails many tests of
    several groups; the draft makes one discrepancy of them, keyed by the cause the comparisons
    print (``[sink-or-normaliser]``), its text the likely cause and the evidence the console shows;
    the JSON report's failed tests carry that cause and evidence, and the Markdown report names it
    per failure and in its "Failures by likely cause" section."""
    import json

    draft, report, md = tmp_path / "draft.txt", tmp_path / "run.json", tmp_path / "run.md"
    args = ["-p", "sparse_mla", str(ROOT / "suites" / "test_attention_accuracy.py"), "--sparse-mla-impl",
            "kernel_catalogue:drops_sink", "--sparse-mla-device", "cpu", "-p", "no:cacheprovider", "-p", "no:xdist",
            "-q", "--tb=no", "-rN", "-k", "flashinfer_configurations or deepseek_v4_deployments",
            "--basetemp", str(tmp_path / "b"), "--sparse-mla-xfail-draft", str(draft),
            "--sparse-mla-report-json", str(report), "--sparse-mla-report-md", str(md)]  # fmt: skip
    code, out = inner_session.run(args, cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys, syspath=[TESTS])
    failed = _counts(out).get("failed", 0)
    assert code == 1 and failed >= 5, out[-3000:]
    text = draft.read_text()
    definitions = re.findall(r"^# \[([A-Za-z0-9_.=-]+)\] bug: DRAFT \((\d+) test\(s\)\): (.+)$", text, re.M)
    assert [(k, int(n)) for k, n, _ in definitions] == [("sink-or-normaliser", failed)], text
    assert definitions[0][2].startswith("likely cause: ") and " | evidence: " in definitions[0][2], text
    assert "sink" in definitions[0][2], text
    rows = [r for r in json.loads(report.read_text())["tests"] if r["outcome"] == "failed"]
    assert len(rows) == failed and all(r["cause_key"] == "sink-or-normaliser" for r in rows), rows[:2]
    assert all(r["cause"] and r["evidence"] for r in rows), rows[:2]
    page = md.read_text()
    assert f"`[sink-or-normaliser]` ({failed} test(s))" in page, page
    assert page.count("**Likely cause** `[sink-or-normaliser]`") == failed and "Not yet explained" not in page
