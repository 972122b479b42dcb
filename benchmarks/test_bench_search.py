"""The search's oracle-checked calls per second at decode shapes, this checkout beside the baseline.

A fixed list of decode calls (``num_tokens <= 64``) drawn by the search's own strategy for the
implementation's envelope on the device (``search_harness.decode_calls``: derandomized, the same list
every run; :data:`CALLS` on CUDA, :data:`CPU_CALLS` on a CPU) is judged exactly as the suite's
``_judge`` does (``search_harness.Judge``: build, the guarded forward, the input-write check, the
result shapes, the float64 oracle, the empty rows, the tolerance check), once with this checkout's
``search``, ``attention.oracle`` and ``tolerances`` and once with those of
``search_harness.BASELINE_COMMIT`` (loaded beside them under other names; on a machine without the
git history, from ``$SPARSE_MLA_SEARCH_BASELINE``). A first pass over the list compiles the
kernels for each shape (its rate is reported apart: compile time is not judged time); then
:data:`ROUNDS` timed passes of each, alternating, and the median rate of each is reported with
the ratio. Hypothesis's own drawing is not in the timed passes (``profile_search.py`` measures it).

Rows: the bundled reference, and FlashMLA where it is importable (its row says why not). Runs on a
CPU too (small list): ``pytest -p sparse_mla benchmarks/test_bench_search.py --benchmark-only -p no:xdist``.

:func:`test_default_cpu_search_beside_the_baseline` times what a user waits for: the default search
on a CPU (``suites/test_attention_search.py`` against the bundled reference, default budget, one
pytest process: ``search_harness.default_search``) of this checkout and of the whole package at
``BASELINE_COMMIT`` (``search_harness.baseline_tree``), alternating, :data:`SEARCH_ROUNDS` runs
each after one untimed run of each (bytecode, file cache); the median process wall time and the
median of the search tests' own time, with the ratio, and the load average before each run (the
machine is shared: a loaded core changes the numbers far more than the code does).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from bench_utils import record
from search_harness import (
    BASELINE_COMMIT,
    ROOT,
    Judge,
    baseline_modules,
    baseline_tree,
    current_modules,
    decode_calls,
    default_search,
)

from pytest_sparse_mla.implementations import BUILTINS

#: Calls in the list on CUDA and on a CPU; timed passes of each side.
CALLS, CPU_CALLS, ROUNDS = 40, 6, 3
#: Timed runs of each side of the default CPU search.
SEARCH_ROUNDS = 3
T = TypeVar("T")


def _impl(name: str, device: str, config: pytest.Config) -> Any:
    impl = BUILTINS[name](config)
    reason = impl.skip_reason("sparse_mla_forward", device)
    if reason:
        pytest.skip(f"{name}: {reason}")
    return impl


def _alternated(
    benchmark: Any, current: Callable[[], T], baseline: Callable[[], T], rounds: int
) -> tuple[dict[str, T], dict[str, list[T]]]:  # fmt: skip
    """One untimed run of each side (compiles, caches: returned apart as ``first``), then ``rounds``
    runs of each, alternating (baseline first; ``current``'s last through pytest-benchmark).
    Returns ``(first, runs)``, each keyed ``"current"`` / ``"baseline"``."""
    first = {"current": current(), "baseline": baseline()}
    runs: dict[str, list[T]] = {"current": [], "baseline": []}
    for _ in range(rounds - 1):
        runs["baseline"].append(baseline())
        runs["current"].append(current())
    runs["current"].append(benchmark.pedantic(current, rounds=1, iterations=1))
    runs["baseline"].append(baseline())
    return first, runs


def _pass(judge: Judge, calls: list[Any]) -> float:
    start = time.perf_counter()
    for call in calls:
        judge(call)
    return time.perf_counter() - start


@pytest.mark.parametrize("name", ["reference", "flashmla"])
def test_search_checked_calls_per_second(benchmark, bench_results, sparse_mla_device, name, request):
    device = str(sparse_mla_device)
    if name == "flashmla" and sparse_mla_device.type != "cuda":
        pytest.skip("flashmla: CUDA only")
    impl = _impl(name, sparse_mla_device.type, request.config)
    count = CALLS if sparse_mla_device.type == "cuda" else CPU_CALLS
    calls = decode_calls(impl.envelope, sparse_mla_device.type, count)
    try:
        baseline = Judge(baseline_modules(), impl, device)
    except RuntimeError as exc:
        pytest.skip(str(exc))
    current = Judge(current_modules(), impl, device)
    first, times = _alternated(benchmark, lambda: _pass(current, calls), lambda: _pass(baseline, calls), ROUNDS)
    rate = {k: len(calls) / statistics.median(v) for k, v in times.items()}
    tokens = sorted(c.num_tokens for c in calls)
    row = {
        "name": f"search judge {name} ({device}, {len(calls)} decode calls)",
        "ms": 1e3 * statistics.median(times["current"]) / len(calls),
        "calls_per_s": rate["current"],
        "baseline_calls_per_s": rate["baseline"],
        "speedup": rate["current"] / rate["baseline"],
        "first_pass_calls_per_s": {k: len(calls) / v for k, v in first.items()},
        "tokens_median": tokens[len(tokens) // 2],
        "notes": f"{rate['current']:.1f} calls/s vs {rate['baseline']:.1f} at {BASELINE_COMMIT} "
        f"(x{rate['current'] / rate['baseline']:.1f}); ms is per call",
    }
    record(benchmark, bench_results, row)


def test_default_cpu_search_beside_the_baseline(benchmark, bench_results, tmp_path):
    """The default CPU search, this checkout beside ``BASELINE_COMMIT`` (module docstring)."""
    try:
        tree = baseline_tree(tmp_path / "baseline")
    except RuntimeError as exc:
        pytest.skip(str(exc))
    count = iter(range(1000))

    def side(root: Any) -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            load = os.getloadavg()[0]
            return {**default_search(root, tmp_path / f"run{next(count)}"), "load1": load}

        return run

    first, runs = _alternated(benchmark, side(ROOT), side(tree), SEARCH_ROUNDS)
    wall = {k: statistics.median(r["wall_s"] for r in v) for k, v in runs.items()}
    tests = {k: statistics.median(r["tests_s"] for r in v) for k, v in runs.items()}
    calls = {k: v[0]["calls"] for k, v in runs.items()}
    row = {
        "name": f"default CPU search (reference, {SEARCH_ROUNDS} runs each, alternating)",
        "ms": 1e3 * wall["current"],
        "wall_s": {k: [round(r["wall_s"], 2) for r in v] for k, v in runs.items()},
        "tests_s": {k: [round(r["tests_s"], 2) for r in v] for k, v in runs.items()},
        "load1": {k: [round(r["load1"], 2) for r in v] for k, v in runs.items()},
        "per_test_s": {k: v[-1]["tests"] for k, v in runs.items()},
        "calls": calls,
        "first_run_wall_s": {k: round(v["wall_s"], 2) for k, v in first.items()},
        "wall_ratio": wall["current"] / wall["baseline"],
        "tests_ratio": tests["current"] / tests["baseline"],
        "notes": f"wall {wall['current']:.2f} s vs {wall['baseline']:.2f} s at {BASELINE_COMMIT} "
        f"(x{wall['current'] / wall['baseline']:.2f}); search tests {tests['current']:.2f} s vs "
        f"{tests['baseline']:.2f} s; {calls['current']} calls vs {calls['baseline']}; ms is the median wall",
    }
    record(benchmark, bench_results, row)
