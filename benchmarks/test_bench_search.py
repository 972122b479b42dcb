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
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import pytest
from bench_utils import record
from search_harness import BASELINE_COMMIT, Judge, baseline_modules, current_modules, decode_calls

from pytest_sparse_mla.implementations import BUILTINS

#: Calls in the list on CUDA and on a CPU; timed passes of each side.
CALLS, CPU_CALLS, ROUNDS = 40, 6, 3


def _impl(name: str, device: str, config: pytest.Config) -> Any:
    impl = BUILTINS[name](config)
    reason = impl.skip_reason("sparse_mla_forward", device)
    if reason:
        pytest.skip(f"{name}: {reason}")
    return impl


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
    first = {"current": _pass(current, calls), "baseline": _pass(baseline, calls)}  # compiles each shape
    times: dict[str, list[float]] = {"current": [], "baseline": []}
    for _ in range(ROUNDS - 1):
        times["baseline"].append(_pass(baseline, calls))
        times["current"].append(_pass(current, calls))
    times["current"].append(benchmark.pedantic(lambda: _pass(current, calls), rounds=1, iterations=1))
    times["baseline"].append(_pass(baseline, calls))
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
