"""Fixtures of the pytest-benchmark suite: CUDA-event timing, the copy baseline, the results table.

Run explicitly, never by default (``testpaths`` excludes this folder and ``addopts`` has
``--benchmark-skip``)::

    pytest -p sparse_mla benchmarks --benchmark-only -p no:xdist --sparse-mla-require-gpu

pytest-benchmark disables itself under xdist (pytest-benchmark ``session.py``), hence
``-p no:xdist``. Every item collected here gets the ``sparse_mla_benchmark`` marker.

Timing (pentschev/pybench ``pybench/pybench.py`` ``run_sync``; pytorch/pytorch PR #75393): kernels
launch asynchronously,
so each timed callable ends with ``torch.cuda.synchronize()`` for pytest-benchmark's own wall-clock
statistics, and the numbers we report (``benchmark.extra_info``, the results table) are medians of
CUDA-event times taken after warm-up (the flashinfer ``bench_gpu_time`` approach). Bandwidths count
bytes read plus bytes written; ratios are against a device-to-device copy of the same byte count
measured in the same process (:func:`copy_baseline`).

Results: every benchmark appends one row to :func:`bench_results`; at session end the rows are
written as ``results.json`` and ``results.md`` into ``$SPARSE_MLA_BENCH_DIR`` (default
``.benchmarks/sparse-mla``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from bench_utils import SPLIT_ONE_WAY_BYTES, CopyBaseline, cuda_median_ms, machine_summary, results_table


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every benchmark collected from this folder ``sparse_mla_benchmark``."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.sparse_mla_benchmark)


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict[str, Any]) -> None:
    """Add the GPU, driver and versions to pytest-benchmark's machine info (saved with --benchmark-json)."""
    machine_info["sparse_mla"] = machine_summary()


@pytest.fixture(scope="session")
def copy_baseline() -> CopyBaseline:
    """Median of a ``torch`` device-to-device copy of 1,071,644,672 random bytes (the split's size),
    after one second of copies to raise the clocks; keeps its buffers for interleaved timing."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("the copy baseline needs a CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randint(0, 256, (SPLIT_ONE_WAY_BYTES,), dtype=torch.uint8, device="cuda", generator=gen)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)

    start = time.perf_counter()
    while time.perf_counter() - start < 1.0:  # let the clocks rise before the first measurement
        for _ in range(20):
            copy()
        torch.cuda.synchronize()
    ms = cuda_median_ms(copy, reps=30)
    assert torch.equal(dst, src)
    return CopyBaseline(SPLIT_ONE_WAY_BYTES, ms, copy)


@pytest.fixture(scope="session")
def bench_results() -> Any:
    """A list that benchmarks append result rows to; written out at session end (module docstring)."""
    rows: list[dict[str, Any]] = []
    yield rows
    if not rows:
        return
    out = Path(os.environ.get("SPARSE_MLA_BENCH_DIR", ".benchmarks/sparse-mla"))
    out.mkdir(parents=True, exist_ok=True)
    doc = {"machine": machine_summary(), "results": rows}
    (out / "results.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    header = "\n".join(f"- {k}: {v}" for k, v in doc["machine"].items())
    (out / "results.md").write_text(f"{header}\n\n{results_table(rows)}")
