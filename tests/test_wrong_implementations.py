"""The wrong-kernel gate: the whole conformance suite must fail every wrong kernel of the catalogue
and pass every approximate one (``tests/kernel_catalogue.py``).

Each catalogue kernel gets one fresh pytest session running ``suites`` whole
(``-p sparse_mla suites --sparse-mla-impl kernel_catalogue:<name> --sparse-mla-device cpu``),
started in-process with ``pytest.main`` (``tests/inner_session.py``: its own config, plugins and
collection), so torch, the plugin and the suite modules are imported once per worker, not once per
kernel; the outcome of every suite item is read from that session's JUnit XML.

* A **wrong** kernel passes the gate when at least one item fails. It **survives** (the gate test
  fails) when none does; the message names the rule it breaks.
* An **approximate** kernel passes the gate when no item fails or errors; the message lists the
  failing items and their first lines.
* Either way the run itself must be sound: exit status 0 or 1, no suite file that fails to import,
  at least one item run. A kernel that breaks the harness is not counted as caught.

Cost (the 2-core CPU machine). The float64 oracle's results and the drawn inputs are shared by a
worker's inner runs (``inner_session``: keyed by the bytes of the oracle's arguments, and by the
case and the generator's state: each test draws the same inputs for every kernel). An approximate
kernel's run is the whole suite, every time. A wrong kernel's run stops at its first failure
(``--maxfail=1``) and runs breadth-first over the suite's test functions (``tests/gate_order.py``),
so a kernel caught by one rule only is reached after one case of every test function, not after
every case of the functions before it; a kernel that only a late case catches gets that case first
(``kernel_catalogue.FIRST_TESTS``, where its kill was found: an order, never a selection). The run
is the whole suite only when the kernel survives. The kill table therefore gives, per wrong kernel,
the first failing test and how many items ran before it (``ran``); ``failed`` reads ``1+`` (stopped
at the first). ``SPARSE_MLA_GATE_MAXFAIL=0`` runs every wrong kernel whole for exact failure counts
(``=N`` stops after N). ``SPARSE_MLA_GATE_PYTEST_ARGS`` passes extra arguments to every inner run
(e.g. an ``--ignore`` of a suite file being rewritten). Under ``-n 2`` two kernels run at a time.

The kill table (kernel, outcome, failing count, items run, seconds, first failing test, rule, the
first line of the first failure) is printed at the end of the session by ``tests/conftest.py`` from
each gate test's ``user_properties``, which pytest-xdist carries from the workers.
"""

from __future__ import annotations

import os
import shlex
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import adversary_kernels as adversary
import gate_order
import inner_session
import kernel_catalogue as catalogue
import pytest

ROOT = Path(__file__).resolve().parents[1]
SUITES = ROOT / "suites"
TESTS = Path(__file__).resolve().parent

#: Environment variable: ``--maxfail`` of a wrong kernel's run (default 1: the first failure kills
#: it; ``0`` runs the suite whole and gives exact failure counts, at the price of a full run each).
MAXFAIL_ENV = "SPARSE_MLA_GATE_MAXFAIL"
#: user_properties key of a kill-table row.
ROW_KEY = "sparse_mla_kill_row"
#: Environment variable with extra arguments for every inner run (split with ``shlex``), e.g.
#: ``--ignore=suites/test_golden.py`` while a suite file is being rewritten; unset in CI.
EXTRA_ARGS_ENV = "SPARSE_MLA_GATE_PYTEST_ARGS"


@dataclass(frozen=True)
class SuiteRun:
    """Outcome of one suite run against a catalogue kernel.

    Attributes:
        returncode: pytest's exit status.
        passed, failed, skipped: item counts (``failed`` counts errors too).
        failures: ``(test id, first line of the message)`` of each failed item, in run order.
        seconds: wall-clock time of the run.
        capped: the run stopped at ``--maxfail``.
        collection_errors: suite files that failed to import (a harness error, not a kill).
        output: the tail of the run's terminal output.
    """

    returncode: int
    passed: int
    failed: int
    skipped: int
    failures: tuple[tuple[str, str], ...]
    seconds: float
    capped: bool
    collection_errors: tuple[str, ...]
    output: str


def _test_id(case: ET.Element) -> str:
    """``suites/test_x.py::test_name[params]`` from a JUnit ``testcase``."""
    module = (case.get("classname") or "").replace(".", "/")
    return f"{module}.py::{case.get('name')}"


def _first_line(case: ET.Element) -> str:
    for tag in ("failure", "error"):
        node = case.find(tag)
        if node is not None:
            text = (node.get("message") or node.text or "").strip()
            return text.splitlines()[0] if text else tag
    return ""


def suite_args(name: str, report: Path, maxfail: int, suite: Path = SUITES) -> list[str]:
    """Arguments of one inner run: the whole suite against ``kernel_catalogue:<name>`` (or ``name``
    itself when it is an import string, ``module:attribute``) on the CPU, breadth-first over test
    functions (``gate_order``: the search last), results to ``report`` (JUnit XML), stopping after
    ``maxfail`` failures (``0``: never)."""
    spec = name if ":" in name else f"kernel_catalogue:{name}"
    args = [
        "-p", "sparse_mla", str(suite), "--sparse-mla-impl", spec,
        "--sparse-mla-device", "cpu", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "gate_order",
        "-qq", "--no-header", "-rN", "--tb=no", f"--junitxml={report}", "-o", "junit_family=xunit1",
    ]  # fmt: skip
    if maxfail:
        args.append(f"--maxfail={maxfail}")
    return args + shlex.split(os.environ.get(EXTRA_ARGS_ENV, ""))


def _message(case: ET.Element, lines: int = 2) -> str:
    """The first ``lines`` non-empty lines of a failed item's message, joined with `` | ``."""
    for tag in ("failure", "error"):
        node = case.find(tag)
        if node is not None:
            text = (node.get("message") or node.text or "").strip()
            return " | ".join([ln.strip() for ln in text.splitlines() if ln.strip()][:lines]) or tag
    return ""


def run_suite(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], maxfail: int,
    suite: Path = SUITES,
) -> SuiteRun:
    """Run the suite against ``kernel_catalogue:<name>`` in this process (``inner_session.run``: the
    oracle's results and the drawn inputs are shared with this worker's other runs) and read the
    outcome of every item from its JUnit XML. A failing search test is not shrunk
    (``inner_session.unshrunk``): the gate reads whether a test failed and its first line, never the
    smallest failing call (shrinking and reproducers: ``tests/test_search.py``)."""
    report = tmp_path / "junit.xml"
    first = {gate_order.FIRST_ENV: "\n".join(catalogue.first_tests(name) if ":" not in name else ())}
    start = time.perf_counter()
    args = [*suite_args(name, report, maxfail, suite), "--basetemp", str(tmp_path / "basetemp")]
    with inner_session.unshrunk():
        returncode, output = inner_session.run(args, cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys, env=first)
    seconds = time.perf_counter() - start
    output = output[-4000:]
    if not report.exists():
        return SuiteRun(returncode, 0, 0, 0, (), seconds, False, (), output)
    cases = list(ET.parse(report).getroot().iter("testcase"))
    broken = tuple(c.get("name") or "?" for c in cases if _first_line(c) == "collection failure")
    cases = [c for c in cases if _first_line(c) != "collection failure"]
    failures = tuple(
        (_test_id(c), _message(c)) for c in cases if c.find("failure") is not None or c.find("error") is not None
    )
    skipped = sum(1 for c in cases if c.find("skipped") is not None)
    passed = len(cases) - skipped - len(failures)
    capped = bool(maxfail) and len(failures) >= maxfail
    return SuiteRun(returncode, passed, len(failures), skipped, failures, seconds, capped, broken, output)


def _row(entry: catalogue.Entry, run: SuiteRun, outcome: str) -> dict[str, str]:
    first = run.failures[0][0] if run.failures else "-"
    count = f"{run.failed}+" if run.capped else str(run.failed)
    return {
        "kernel": entry.name,
        "kind": entry.kind,
        "outcome": outcome,
        "failed": count,
        "ran": str(run.passed + run.failed),
        "first_failure": first,
        "first_message": run.failures[0][1] if run.failures else "",
        "seconds": f"{run.seconds:.1f}",
        "rule": entry.rule,
    }


@pytest.mark.full_tier
@pytest.mark.parametrize(
    "name",
    [  # an approximate kernel runs the whole suite (about 12 s, the first of a worker 20 s): collected first,
        # on the worker of the other whole-suite runs, whose oracle results and inputs it shares (tests/conftest.py)
        pytest.param(name, marks=[inner_session.WHOLE_SUITE_RUN] if entry.kind == "approximate" else [])
        for name, entry in catalogue.CATALOGUE.items()
    ],
)
def test_catalogue_kernel_against_the_whole_suite(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], record_property
) -> None:
    entry = catalogue.CATALOGUE[name]
    wrong = entry.kind == "wrong"
    run = run_suite(name, tmp_path, monkeypatch, capsys, int(os.environ.get(MAXFAIL_ENV, "1")) if wrong else 0)
    sound = run.returncode in (0, 1) and run.passed + run.failed > 0 and not run.collection_errors
    if not sound:
        outcome = "HARNESS ERROR"
    elif wrong:
        outcome = "killed" if run.failed else "SURVIVED"
    else:
        outcome = "passed" if not run.failed else "FAILED"
    record_property(ROW_KEY, _row(entry, run, outcome))
    if not sound:
        pytest.fail(
            f"suite run against kernel_catalogue:{name} did not complete (exit status {run.returncode}; "
            f"{run.passed} passed, {run.failed} failed; suite files that failed to import: "
            f"{', '.join(run.collection_errors) or 'none'}):\n{run.output}",
            pytrace=False,
        )
    if wrong and not run.failed:
        pytest.fail(
            f"wrong kernel {name!r} SURVIVED the whole conformance suite ({run.passed} passed, "
            f"{run.skipped} skipped). It breaks: {entry.rule}",
            pytrace=False,
        )
    if not wrong and run.failed:
        listing = "\n".join(f"  {tid}: {msg}" for tid, msg in run.failures[:20])
        pytest.fail(
            f"approximate (correct) kernel {name!r} FAILED {run.failed} suite items; it computes: "
            f"{entry.rule}\n{listing}",
            pytrace=False,
        )


def _forward_kernels(kind: str) -> list[str]:
    return [n for n, e in catalogue.CATALOGUE.items() if e.kind == kind and "sparse_mla_forward" in e.capabilities]


@pytest.mark.full_tier
@pytest.mark.parametrize(
    "name",
    [n for n in _forward_kernels("wrong") if n not in catalogue.OUTSIDE_FLASHMLA]
    + [pytest.param("approx_bf16_production", marks=[inner_session.HEAD64_ENVELOPE_RUN.with_args(seconds=20)])],
)
def test_catalogue_kernel_inside_flashmla_envelope(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], record_property
) -> None:
    """The same kernels restricted to FlashMLA's envelope (64 or 128 heads, widths multiples of 64,
    only -1 masked, lengths within the row, no DSV3.2 extra cache or lengths): every wrong forward
    whose error can occur there is still caught, by cases fitted to the envelope; a correct BF16
    kernel still passes. ``catalogue.OUTSIDE_FLASHMLA`` lists the exceptions and why."""
    entry = catalogue.CATALOGUE[name]
    wrong = entry.kind == "wrong"
    spec = f"{name}{catalogue.FLASHMLA_SUFFIX}"
    run = run_suite(spec, tmp_path, monkeypatch, capsys, int(os.environ.get(MAXFAIL_ENV, "1")) if wrong else 0)
    sound = run.returncode in (0, 1) and run.passed + run.failed > 0 and not run.collection_errors
    outcome = "HARNESS ERROR" if not sound else ("killed" if run.failed else "SURVIVED") if wrong else (
        "passed" if not run.failed else "FAILED")  # fmt: skip
    record_property(ROW_KEY, {**_row(entry, run, outcome), "kernel": spec})
    assert sound, f"suite run against kernel_catalogue:{spec} did not complete (exit {run.returncode}):\n{run.output}"
    if wrong:
        assert run.failed, (
            f"wrong kernel {spec!r} SURVIVED the suite inside FlashMLA's envelope ({run.passed} passed, "
            f"{run.skipped} skipped). It breaks: {entry.rule}"
        )
    else:
        listing = "\n".join(f"  {tid}: {msg}" for tid, msg in run.failures[:20])
        assert not run.failed, f"approximate kernel {spec!r} FAILED {run.failed} items inside the envelope:\n{listing}"


def test_first_tests_are_suite_tests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every test the gate runs first for a kernel (``kernel_catalogue.FIRST_TESTS``) is an item the
    suite collects, for a kernel of the catalogue: a renamed case would make a hint silently miss."""
    collected: list[str] = []

    class Listing:
        def pytest_collection_finish(self, session: pytest.Session) -> None:
            collected.extend(item.nodeid for item in session.items)

    args = ["-p", "sparse_mla", str(SUITES), "--co", "-qq", "-p", "no:cacheprovider", "-p", "no:xdist",
            "--rootdir", str(ROOT), "--sparse-mla-device", "cpu"]  # fmt: skip
    ret, _ = inner_session.run(args, cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys, plugins=[Listing()])
    assert ret == 0 and collected
    for spec, nodes in catalogue.FIRST_TESTS.items():
        assert spec.removesuffix(catalogue.FLASHMLA_SUFFIX) in catalogue.CATALOGUE, spec
        missing = sorted(set(nodes) - set(collected))
        assert not missing, f"FIRST_TESTS[{spec!r}] names tests the suite does not collect: {missing}"


def test_catalogue_has_the_promised_breadth() -> None:
    """At least 20 wrong kernels and 4 approximate ones; every entry states its rule and provides a
    protocol capability."""
    assert len(catalogue.wrong_kernels()) >= 20
    assert len(catalogue.approximate_kernels()) >= 4
    for entry in catalogue.CATALOGUE.values():
        assert entry.rule and entry.capabilities, entry
        assert getattr(catalogue, entry.name).compute_mode in ("bf16", "fp8"), entry


@pytest.mark.full_tier
@pytest.mark.parametrize("name", adversary.SEARCH_ONLY)
def test_a_kernel_only_the_search_catches_is_caught_by_it(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], record_property
) -> None:
    """The adversary's kernels (``tests/adversary_kernels.py``) that every fixed case of the suites
    passes (measured: ``docs/adversary.md``, the "fixed suites" column) are caught by the search at
    its default budget, so the search cannot silently narrow to what the fixed cases already see.
    Only the search file runs here (a whole-suite run per kernel would add a minute to the test
    command); ``SPARSE_MLA_GATE_SEARCH_WHOLE=1`` runs the whole suite and also requires the first
    failure to be a search test (the gate orders the search after every fixed case)."""
    entry = adversary.ADVERSARY[name]
    whole = os.environ.get("SPARSE_MLA_GATE_SEARCH_WHOLE") == "1"
    suite = SUITES if whole else SUITES / gate_order.SEARCH_FILE
    run = run_suite(f"adversary_kernels:{name}", tmp_path, monkeypatch, capsys, 1, suite)
    sound = run.returncode in (0, 1) and run.passed + run.failed > 0 and not run.collection_errors
    outcome = "HARNESS ERROR" if not sound else ("killed" if run.failed else "SURVIVED")
    record_property(ROW_KEY, {**_row(catalogue.Entry(name, "wrong", entry.bug, entry.origin, ("sparse_mla_forward",)),
                                     run, outcome), "kernel": f"adversary:{name}"})  # fmt: skip
    assert sound, f"search run against adversary_kernels:{name} did not complete (exit {run.returncode}):\n{run.output}"
    assert run.failed, f"adversary kernel {name!r} SURVIVED the search ({run.passed} passed). It breaks: {entry.bug}"
    if whole:
        first = run.failures[0][0]
        assert gate_order.SEARCH_FILE in first, f"{name!r} was caught by a fixed case ({first}): not search-only"
