"""The shipped conformance report: ``--sparse-mla-report-md``, the per-test rows of
``--sparse-mla-report-json`` and ``sparse-mla-report`` (``pytest_sparse_mla.conformance``), judged
against pytest's own summary of the same run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import inner_session

from pytest_sparse_mla import conformance

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
SUITE = ROOT / "suites" / "test_attention_inputs.py"
WRONG = "kernel_catalogue:drops_sink"  # ignores attn_sink: its bad-input tests fail
LABEL = "wrong:drops_sink"  # its name: the reports' one label for it (conformance.label_of)
LISTED = "suites/test_attention_inputs.py::test_bad_input_raises_a_clear_error[attn_sink-bf16]"


def _run(tmp_path: Path, monkeypatch, capsys, impl: str, name: str, *extra: str) -> dict[str, int]:
    args = ["-p", "sparse_mla", str(SUITE), "--sparse-mla-impl", impl, "--sparse-mla-device", "cpu",
            "-p", "no:cacheprovider", "-p", "no:xdist", "-o", "xfail_strict=true", "-q", "--tb=no", "-rN",
            "--basetemp", str(tmp_path / f"base-{name}"), "--sparse-mla-report-json", str(tmp_path / f"{name}.json"),
            *extra]  # fmt: skip
    _, out = inner_session.run(args, cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys, syspath=[TESTS])
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|xfailed|xpassed|skipped|error)", out)}


def test_the_markdown_report_of_a_run_says_what_pytest_said(tmp_path, monkeypatch, capsys):
    xfail = tmp_path / "known.txt"
    xfail.write_text(f"# [sink-dtype] bug: a BF16 attn_sink is taken\n{LISTED}     # sink-dtype\n")
    md = tmp_path / "wrong.md"
    said = _run(tmp_path, monkeypatch, capsys, WRONG, "wrong", "--sparse-mla-report-md", str(md),
                "--sparse-mla-xfail-file", str(xfail))  # fmt: skip
    assert said.get("failed", 0) >= 2 and said.get("xfailed") == 1, said
    doc = json.loads((tmp_path / "wrong.json").read_text())
    rows = doc["tests"]
    counted = {k: sum(1 for r in rows if r["outcome"] == k) for k in conformance.OUTCOMES}
    assert {k: v for k, v in counted.items() if v} == said
    assert all(r["id"].startswith("suites/test_attention_inputs.py::") for r in rows)
    assert doc["exit"] == 1 and doc["options"]["xfail_file"] == str(xfail)
    text = md.read_text()
    total = sum(said.values())
    passed, skipped = said.get("passed", 0), said.get("skipped", 0)
    row = f"| `{LABEL}` | {total} | {passed} | {said['failed']} | 0 | {skipped} | 1 | 0 | 1 |"
    assert row in text, text[:3000]
    assert "* **`wrong:drops_sink` [sink-dtype] bug** (1 xfailed tests): a BF16 attn_sink is taken" in text
    failing = [r["id"] for r in rows if r["outcome"] == "failed"]
    assert all(f"`{i}`" in text for i in failing)  # listed under "Failures not listed in an xfail file"


def test_sparse_mla_report_merges_runs(tmp_path, monkeypatch, capsys):
    wrong = _run(tmp_path, monkeypatch, capsys, WRONG, "a")
    right = _run(tmp_path, monkeypatch, capsys, "reference", "b")
    md, out = tmp_path / "merged.md", tmp_path / "merged.json"
    assert conformance.main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--md", str(md),
                             "--json", str(out)]) == 0  # fmt: skip
    doc = json.loads(out.read_text())
    assert list(doc["implementations"]) == [LABEL, "reference"]
    for name, said in ((LABEL, wrong), ("reference", right)):
        totals = {k: v for k, v in doc["implementations"][name]["totals"].items() if v}
        assert totals == said, (name, totals, said)
    text = md.read_text()
    assert f"| `{LABEL}` |" in text and "| `reference` |" in text


def test_the_console_script_is_declared() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert 'sparse-mla-report = "pytest_sparse_mla.conformance:main"' in text


def test_a_failure_an_older_xfail_file_missed_is_reported_failed_and_said_to_be_listed_now(tmp_path) -> None:
    """A run made with an older xfail file fails a test the current file lists: the report keeps
    pytest's outcome (failed) and says the test is listed now, under which key; a failure the file
    does not list stays unexplained; a run made without any xfail file counts the listed failure as
    xfailed (``listed_after_run``). (sglang-dsv4-triton's 12 bad-input failures of 2026-12-07.)"""
    listed = {"file": "suites/test_attention_inputs.py", "id": LISTED, "outcome": "failed", "message": "DID NOT RAISE",
              "seconds": 0.1}  # fmt: skip
    other = dict(listed, id=LISTED.replace("attn_sink-bf16", "q-float32"))
    path = tmp_path / "k.txt"
    path.write_text(f"# [no-validation] convention: accepts it.\n{LISTED}  # no-validation\n")
    xfail = conformance.read_xfail_file(path)
    older = conformance.summarize("k", [dict(listed), dict(other)], exit_info={"xfail_file": "k.txt"}, xfail=xfail)
    by_id = {f["id"]: f for f in older["failures"]}
    assert older["totals"]["failed"] == 2
    said = "listed after this run, under [no-validation] of the implementation's xfail file"
    assert by_id[LISTED]["explanation"] == said
    assert by_id[other["id"]]["explanation"] == ""
    without = conformance.summarize("k", [dict(listed), dict(other)], exit_info={"xfail_file": None}, xfail=xfail)
    assert without["totals"]["failed"] == 1
    assert without["xfailed"] == [{"id": LISTED, "key": "no-validation", "listed_after_run": True}]
