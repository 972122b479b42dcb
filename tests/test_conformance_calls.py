"""Self-test: every test of the shipped conformance suites calls the selected implementation.

The suites under ``suites/`` (``pytest_sparse_mla.suites``) judge whatever ``--sparse-mla-impl``
names, the way array-api-tests runs every test through ``xp``; a test that exercised bundled code
instead would judge nothing of a user's kernel. This runs the suites in a fresh pytest session (in
this process: ``tests/inner_session.py``) with ``tests/recording_impl.py`` (the bundled reference,
logging each ``pack`` / ``page_split`` / ``sparse_mla_forward`` call with the node id of the test
that made it) and requires at least one call from every test that passed. The dispatch-grid suite
runs a second time with a declared FlashInfer release (without one it skips by design).

Cost: the suites whole take minutes on a 2-core CPU, so by default one item per test function is
run (its first parametrization that is not skipped at collection: the call-or-not property belongs
to the function's body). ``SPARSE_MLA_CONFORMANCE_FULL=1`` runs every item.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import inner_session
import pytest

ROOT = Path(__file__).resolve().parents[1]
SUITES = ROOT / "suites"
TESTS = Path(__file__).resolve().parent
DISPATCH = "test_dispatch_grid.py"
RELEASE = "0.7.0"  # rejects shapes in C++ and in Python, serves the rest
IMPL = "recording_impl:RecordingImplementation"
#: Suite test functions known not to call the implementation (owned by another module; each must be
#: converted or removed, then deleted from here: a listed function that does call fails this test).
FULL = os.environ.get("SPARSE_MLA_CONFORMANCE_FULL") == "1"


@dataclass
class Recording:
    """What a recorded run of a suite directory saw.

    Attributes:
        collected: ``(node id, "run" | "skip")`` of every item collected from the suite directory.
        nodes: the items that were run (collected by the recorded runs).
        outcomes: node id -> ``passed`` / ``failed`` / ``skipped`` / ``error``.
        calls: node id -> the capabilities it called.
    """

    collected: list[tuple[str, str]]
    nodes: list[str]
    outcomes: dict[str, str]
    calls: dict[str, set[str]] = field(default_factory=dict)

    def with_outcome(self, *wanted: str) -> list[str]:
        return sorted(n for n, o in self.outcomes.items() if o in wanted)

    def silent(self) -> list[str]:
        """Tests that passed without one call of the implementation."""
        return [n for n in self.with_outcome("passed") if not self.calls.get(n)]


def _pytest(
    args: list[str], env: dict[str, str], rootdir: Path, cwd: Path, session: Session
) -> tuple[int, str]:
    """``pytest -p sparse_mla -p recording_impl <args>`` on the CPU, a fresh session in this process
    (``tests/inner_session.py``); the modules of a suite outside this checkout are unloaded after it."""
    command = [
        "-p", "sparse_mla", "-p", "recording_impl",
        "--sparse-mla-impl", IMPL, "--sparse-mla-device", "cpu",
        "-p", "no:cacheprovider", "-p", "no:xdist", "-q", "--rootdir", str(rootdir), *args,
    ]  # fmt: skip
    unload = [] if rootdir == ROOT else [rootdir]
    return inner_session.run(
        command, cwd=cwd, monkeypatch=session.monkeypatch, capsys=session.capsys, env=env, unload=unload
    )


@dataclass
class Session:
    """What an inner session needs from the test that starts it."""

    monkeypatch: pytest.MonkeyPatch
    capsys: pytest.CaptureFixture[str]


@pytest.fixture
def session(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Session:
    return Session(monkeypatch, capsys)


def _read(path: Path) -> list[tuple[str, str]]:
    if not path.is_file():
        return []
    return [tuple(line.split("\t", 1)) for line in path.read_text().splitlines() if "\t" in line]  # type: ignore[misc]


def _one_item_per_function(collected: list[tuple[str, str]]) -> list[str]:
    """The first item of each test function that is not skipped at collection (else its first)."""
    by_function: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for node, state in collected:
        by_function[node.split("[", 1)[0]].append((node, state))
    chosen = []
    for items in by_function.values():
        runnable = [node for node, state in items if state == "run"]
        chosen.append(runnable[0] if runnable else items[0][0])
    return chosen


def record_suites(suites: Path, rootdir: Path, logs: Path, session: Session, *, full: bool) -> Recording:
    """Collect ``suites`` (a directory under ``rootdir``), run every item (``full``) or one per
    function with the recording implementation, the dispatch-grid module a second time with a
    declared release, and read back what was called."""
    files = {name: logs / f"{name}.log" for name in ("collected", "calls", "outcomes")}
    env = {
        "SPARSE_MLA_COLLECT_LOG": str(files["collected"]),
        "SPARSE_MLA_CALL_LOG": str(files["calls"]),
        "SPARSE_MLA_OUTCOME_LOG": str(files["outcomes"]),
    }

    dispatch_module = suites / DISPATCH
    if full:  # each run collects what it runs: no separate collection
        others = [str(suites), f"--ignore={dispatch_module}"]
        dispatch = [str(dispatch_module)] if dispatch_module.is_file() else []
    else:
        ret, output = _pytest([str(suites), "--collect-only"], env, rootdir, logs, session)
        assert ret == 0, output[-3000:]
        chosen = _one_item_per_function(_read(files["collected"]))
        files["collected"].rename(logs / "listing.log")
        # Node ids are relative to the rootdir, so they are valid arguments from it.
        dispatch = [str(rootdir / n) for n in chosen if n.split("::")[0].endswith(DISPATCH)]
        others = [str(rootdir / n) for n in chosen if not n.split("::")[0].endswith(DISPATCH)]
    runs = [_pytest(others, env, rootdir, logs, session)] if others else []
    if dispatch:
        runs.append(_pytest(dispatch, {**env, "SPARSE_MLA_RECORD_RELEASE": RELEASE}, rootdir, logs, session))
    for ret, output in runs:
        assert ret in (0, 1), output[-3000:]  # tests ran (1: some failed)
    nodes = [node for node, _ in _read(files["collected"])]
    collected = _read(logs / "listing.log") if not full else _read(files["collected"])
    assert collected, "nothing was collected"

    calls: dict[str, set[str]] = defaultdict(set)
    for node, capability in _read(files["calls"]):
        calls[node].add(capability)
    return Recording(collected, nodes, dict(_read(files["outcomes"])), dict(calls))


def test_every_suite_test_calls_the_selected_implementation(tmp_path: Path, session: Session, record_property) -> None:  # type: ignore[no-untyped-def]
    rec = record_suites(SUITES, ROOT, tmp_path, session, full=FULL)
    passed = rec.with_outcome("passed")
    failed = rec.with_outcome("failed", "error")
    silent = rec.silent()
    summary = (
        f"{len(rec.collected)} items collected from suites/, {len(rec.nodes)} run "
        f"({'all' if FULL else 'one per function'}): {len(passed)} passed, "
        f"{sum(1 for n in passed if rec.calls.get(n))} of them called the implementation, "
        f"{len(rec.with_outcome('skipped'))} skipped, {len(failed)} failed"
    )
    record_property("conformance_calls", summary)
    missing = sorted(set(rec.nodes) - set(rec.outcomes))
    assert not missing, f"{summary}; no outcome for {missing[:5]}"
    assert not silent, f"{summary}\npassed without calling the implementation:\n  " + "\n  ".join(silent)
    assert not failed, f"{summary}\nfailed against the recording reference:\n  " + "\n  ".join(failed)
    assert len(passed) >= 0.8 * len(rec.nodes), f"{summary}: too few ran to prove anything"


FAKE_SUITE = """
import pytest

pytestmark = pytest.mark.sparse_mla_needs("pack")


@pytest.mark.parametrize("n", [1, 2])
def test_calls(n, sparse_mla_impl, sparse_mla_device):
    import torch

    sparse_mla_impl.pack(torch.zeros(1, 2, 512, dtype=torch.bfloat16, device=sparse_mla_device))


@pytest.fixture
def packed(sparse_mla_impl):
    import torch

    return sparse_mla_impl.pack(torch.zeros(1, 2, 512, dtype=torch.bfloat16))


def test_calls_through_a_fixture(packed):
    assert packed.numel() == 2 * 584


@pytest.mark.parametrize("n", [1, 2])
def test_judges_bundled_code(n):
    from pytest_sparse_mla import formats

    formats.quantize_pack(__import__("torch").zeros(1, 2, 512, dtype=__import__("torch").bfloat16))
"""


def test_a_suite_test_that_bypasses_the_implementation_is_found(tmp_path: Path, session: Session) -> None:
    """A fake suite, every item run: calls made in the test and in its fixture count; both items of
    a test that calls the bundled packer instead are reported."""
    suite = tmp_path / "fake_suites"
    suite.mkdir()
    (suite / "test_fake.py").write_text(FAKE_SUITE)
    logs = tmp_path / "logs"
    logs.mkdir()
    rec = record_suites(suite, tmp_path, logs, session, full=True)
    assert len(rec.collected) == 5 and len(rec.with_outcome("passed")) == 5
    assert rec.silent() == [f"fake_suites/test_fake.py::test_judges_bundled_code[{n}]" for n in (1, 2)]
    assert rec.calls["fake_suites/test_fake.py::test_calls_through_a_fixture"] == {"pack"}


def test_one_item_per_function_prefers_items_not_skipped_at_collection() -> None:
    collected = [
        ("s/test_a.py::test_x[big]", "skip"), ("s/test_a.py::test_x[small]", "run"),
        ("s/test_a.py::test_x[other]", "run"), ("s/test_a.py::test_y", "run"),
        ("s/test_b.py::test_x[gpu]", "skip"), ("s/test_b.py::test_x[gpu2]", "skip"),
    ]  # fmt: skip
    assert _one_item_per_function(collected) == [
        "s/test_a.py::test_x[small]", "s/test_a.py::test_y", "s/test_b.py::test_x[gpu]"
    ]  # fmt: skip
