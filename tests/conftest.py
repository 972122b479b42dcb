"""Self-test settings: ``tests/`` is importable as a directory of helper modules, the checkout's
two test tiers are told apart by a marker, the
wrong-kernel gate's kill table is printed at the end of the session, and the longest self-tests
(marked ``sparse_mla_selftest_long``: whole-suite runs of about 10 to 25 s each on the 2-core CPU
machine) are collected first and ``-n`` distributes by work
stealing, so they start early and ``-n 2`` does not end with one worker running a long test while
the other idles.

The marker takes two optional keywords: ``seconds``, a rough cost on the 2-core CPU machine (one
thread per worker; default 20), and ``share``, a name for long tests whose in-process suite runs
share a worker's stored oracle results and drawn inputs (``tests/inner_session.py``): the tests of
one ``share`` group run on one worker, one after the other, so only the first pays for the draws
and the oracle (about 10 s per whole-suite run that a second worker would repeat).

The tiers (README, "Set up and go"): a test marked ``full_tier`` runs in the full tier (the README's
full-test command, ``-m full_tier``), every other test of ``suites/`` and ``tests/`` in the fast tier
(the README's test command, ``-m "not full_tier"``). The marker is this checkout's own: registered
here, never by the plugin, so another project's session never sees it. CONTRIBUTING.md says which
tests carry it; ``tests/test_tiers.py`` checks that the two commands select every test exactly once.

The gate (``test_wrong_implementations.py``) stores one row per catalogue kernel in the test's
``user_properties`` under ``sparse_mla_kill_row``; pytest-xdist carries ``user_properties`` from
the workers to the controller, so the table is complete under ``-n 2`` too.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import pytest

_ROW_KEY = "sparse_mla_kill_row"
_LONG = "sparse_mla_selftest_long"
#: The marker of the full tier's tests (README's ``<!-- full-test-command -->``: ``-m full_tier``).
FULL_TIER = "full_tier"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{_LONG}: a self-test that runs a whole suite (collected first)")
    config.addinivalue_line(
        "markers",
        f"{FULL_TIER}: a test of the full tier (whole-suite runs, the example project, the CPU peer lanes, "
        "wheel/sdist builds, pytest processes with xdist workers): README's full-test command, -m full_tier",
    )


def _long_marker_kwargs(item: pytest.Item) -> tuple[str | None, float]:
    """``(share, seconds)`` of a long item's marker (the closest one)."""
    mark = item.get_closest_marker(_LONG)
    assert mark is not None
    return mark.kwargs.get("share"), float(mark.kwargs.get("seconds", 20.0))


def deal_long(long: list[pytest.Item], workers: int) -> list[list[pytest.Item]]:
    """The long items of each of ``workers`` workers: a ``share`` group (or an item without one)
    goes whole to the least loaded worker, the costliest groups first (ties: collection order);
    each worker's items keep the collection order of their groups."""
    groups: dict[Any, list[pytest.Item]] = {}
    cost: dict[Any, float] = {}
    for index, item in enumerate(long):
        share, seconds = _long_marker_kwargs(item)
        key = ("share", share) if share is not None else ("item", index)
        groups.setdefault(key, []).append(item)
        cost[key] = cost.get(key, 0.0) + seconds
    first = {key: rank for rank, key in enumerate(groups)}
    load = [0.0] * workers
    owned: list[list[Any]] = [[] for _ in range(workers)]
    for key in sorted(groups, key=lambda k: (-cost[k], first[k])):
        k = min(range(workers), key=lambda w: (load[w], w))
        load[k] += cost[key]
        owned[k].append(key)
    return [[item for key in sorted(keys, key=first.__getitem__) for item in groups[key]] for keys in owned]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Long self-tests first (the order within each group is kept). Under ``-n N``, work stealing
    starts worker ``k`` on the ``k``-th of ``N`` consecutive blocks of items and later takes tests
    from the end of a busy worker's queue: the long tests are dealt to the front of the blocks
    (:func:`deal_long`: a ``share`` group on one worker, the load balanced by the markers'
    ``seconds``), so every worker starts on its share of them and what is left to steal is short."""
    long = [item for item in items if item.get_closest_marker(_LONG) is not None]
    short = [item for item in items if item.get_closest_marker(_LONG) is None]
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1 or not long:
        items[:] = long + short
        return
    rest = iter(short)
    ordered: list[pytest.Item] = []
    remaining = len(items)
    for k, dealt in enumerate(deal_long(long, workers)):  # blocks sized as WorkStealingScheduling's first split
        size = remaining // (workers - k)
        remaining -= size
        ordered += dealt + list(itertools.islice(rest, max(0, size - len(dealt))))
    items[:] = ordered + list(rest)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: a session may run with -p no:xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Work stealing where ``-n`` would use ``load``: ``load`` hands each worker a first block of
    consecutive items (a quarter of its share), so one worker would get every long test; work
    stealing splits the items in two halves and an idle worker takes half of the other's queue."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import WorkStealingScheduling

    return WorkStealingScheduling(config, log)


_COLUMNS = (("kernel", "kernel"), ("outcome", "outcome"), ("failed", "failed"), ("ran", "ran"),
            ("seconds", "s"), ("first_failure", "first failing test"))  # fmt: skip


def _rows(terminalreporter: Any) -> list[dict[str, str]]:
    rows: dict[str, dict[str, str]] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) != "call":
                continue
            for key, value in getattr(report, "user_properties", ()):
                if key == _ROW_KEY and isinstance(value, dict):
                    rows[value["kernel"]] = value
    try:
        import kernel_catalogue

        order = {name: i for i, name in enumerate(kernel_catalogue.CATALOGUE)}
    except ImportError:  # pragma: no cover
        order = {}
    return sorted(rows.values(), key=lambda r: (r["kind"] != "wrong", order.get(r["kernel"], 0)))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Print the kill table of the wrong-kernel gate, if the gate ran."""
    rows = _rows(terminalreporter)
    if not rows:
        return
    tr = terminalreporter
    tr.section("wrong-kernel gate: kill table")
    for kind, title in (
        ("wrong", "wrong kernels (must be killed)"),
        ("approximate", "approximate kernels (must pass)"),
    ):
        part = [r for r in rows if r["kind"] == kind]
        if not part:
            continue
        tr.write_line(f"{title}:")
        widths = [max(len(head), *(len(r[key]) for r in part)) for key, head in _COLUMNS]
        cells = list(zip(_COLUMNS, widths, strict=True))
        tr.write_line("  " + "  ".join(head.ljust(w) for (_, head), w in cells))
        for r in part:
            tr.write_line(("  " + "  ".join(r[key].ljust(w) for (key, _), w in cells)).rstrip())
            tr.write_line(f"      rule: {r['rule']}")
            if r["first_message"]:
                tr.write_line(f"      first failure says: {r['first_message'][:300]}")
    parts = []
    wrong = [r for r in rows if r["kind"] == "wrong"]
    if wrong:
        parts.append(f"{sum(r['outcome'] == 'killed' for r in wrong)} of {len(wrong)} wrong kernels killed")
    approx = [r for r in rows if r["kind"] == "approximate"]
    if approx:
        parts.append(f"{sum(r['outcome'] == 'passed' for r in approx)} of {len(approx)} approximate kernels passed")
    seconds = sum(float(r["seconds"]) for r in rows)
    tr.write_line(f"{'; '.join(parts)}; {seconds:.0f} s of suite runs over {len(rows)} kernels")


@pytest.fixture
def fi_reference() -> Any:
    """The ``flashinfer-reference`` peer adapter on the CPU (FlashInfer's pure-torch references from
    the flashinfer-python wheel); skips where the wheel's reference files are not importable."""
    from pytest_sparse_mla.implementations import flashinfer_reference

    impl = flashinfer_reference.FlashInferReferenceImplementation()
    reason = impl.skip_reason("sparse_mla_forward", "cpu")
    if reason is not None:
        pytest.skip(reason)
    return impl
