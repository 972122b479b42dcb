"""The search's checked calls per second with 1, 2 and every GPU of the host (one xdist worker per GPU).

Users run the search in GPU CI with one pytest-xdist worker per GPU (``pytest_sparse_mla.xdist_gpu``
pins worker ``gwK`` to GPU ``K mod N``). This benchmark runs the search suite
(``suites/test_attention_search.py``, its three properties) as that CI would, in a fresh pytest
process per worker count, with the same seed and the same number of shards every time (so every
run draws the same calls, whoever runs them), and reports for each worker count:

* checked calls per second: the calls the runs made (the JSON report's ``"search"`` → ``"calls"``,
  warm-ups not counted) over the session's wall time (process start to exit, collection and worker
  start-up included: what CI waits for);
* the GPU of every worker (the JSON report's ``"workers"``), and how many distinct GPUs ran tests;
* the discrepancy keys found, which must be the same for every worker count (a shard's draws
  depend on its seed and shard index only).

Worker counts: ``1, 2, ..., N`` GPUs, one worker each, on a host with ``N > 1`` GPUs; on one GPU,
``1, 2, 4`` workers sharing it (what a one-GPU CI gains from ``-n``); on a CPU, ``1, 2`` with a
small budget. ``SPARSE_MLA_BENCH_WORKERS`` (comma-separated) overrides the list.

Rows: the bundled reference, and FlashMLA where it is importable (``scripts/peers_env.sh``)::

    pytest -p sparse_mla benchmarks/test_bench_search_workers.py --benchmark-only -p no:xdist
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from bench_utils import record

ROOT = Path(__file__).resolve().parents[1]
#: The search budget of every run: draws per property and shards (fixed, so each worker count
#: judges the same calls), and the seed.
CUDA_BUDGET, CPU_BUDGET, SEED = ("6", "8"), ("1", "2"), "11"


def _worker_counts(device: str) -> list[int]:
    override = os.environ.get("SPARSE_MLA_BENCH_WORKERS")
    if override:
        return sorted({int(w) for w in override.split(",") if w.strip()})
    if device != "cuda":
        return [1, 2]
    import torch

    gpus = torch.cuda.device_count()
    return list(range(1, gpus + 1)) if gpus > 1 else [1, 2, 4]


def _run(name: str, workers: int, out: Path, device: str) -> dict[str, Any]:
    """One search session with ``workers`` xdist workers; its wall seconds and JSON report."""
    examples, shards = CUDA_BUDGET if device == "cuda" else CPU_BUDGET
    report = out / f"search-{name}-{workers}.json"
    xfail = ROOT / "pytest_sparse_mla" / "xfail" / f"{name}.txt"
    cmd = [sys.executable, "-m", "pytest", "-p", "sparse_mla", str(ROOT / "suites" / "test_attention_search.py"),
           "--sparse-mla-impl", name, "--sparse-mla-device", device, "-n", str(workers),
           "--sparse-mla-search-examples", examples, "--sparse-mla-search-shards", shards,
           "--sparse-mla-search-seed", SEED, "--sparse-mla-report-json", str(report),
           "-p", "no:cacheprovider", "-p", "no:randomly", "-q"]  # fmt: skip
    if xfail.exists():
        cmd += ["--sparse-mla-xfail-file", str(xfail)]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - start
    if not report.exists():
        pytest.fail(f"{name} with -n {workers} wrote no report (exit {done.returncode}):\n{done.stdout[-3000:]}")
    data = json.loads(report.read_text())
    return {"seconds": seconds, "exit": done.returncode, "report": data}


@pytest.mark.parametrize("name", ["reference", "flashmla"])
def test_search_calls_per_second_by_workers(benchmark, bench_results, sparse_mla_device, name, request, tmp_path):
    device = sparse_mla_device.type
    if name == "flashmla":
        if device != "cuda":
            pytest.skip("flashmla: CUDA only")
        pytest.importorskip("flash_mla", reason="flashmla: not importable (scripts/peers_env.sh builds it)")
    runs = {w: _run(name, w, tmp_path, device) for w in _worker_counts(device)[:-1]}
    last = _worker_counts(device)[-1]
    runs[last] = benchmark.pedantic(lambda: _run(name, last, tmp_path, device), rounds=1, iterations=1)
    one = runs[min(runs)]
    rate_one = one["report"]["search"]["calls"] / one["seconds"]
    keys = {
        w: sorted(d.get("key", "") for d in r["report"]["search"].get("discrepancies", [])) for w, r in runs.items()
    }
    for w, r in sorted(runs.items()):
        search = r["report"]["search"]
        gpus = sorted({str(v.get("CUDA_VISIBLE_DEVICES")) for v in r["report"].get("workers", {}).values()})
        rate = search["calls"] / r["seconds"]
        record(benchmark, bench_results, {
            "name": f"search {name} ({device}) -n {w}",
            "ms": 1e3 * r["seconds"] / max(1, search["calls"]),
            "calls_per_s": rate,
            "speedup_vs_one_worker": rate / rate_one,
            "calls": search["calls"],
            "seconds": r["seconds"],
            "worker_devices": gpus,
            "discrepancies": keys[w],
            "same_discrepancies_as_one_worker": keys[w] == keys[min(runs)],
            "notes": f"{search['calls']} calls in {r['seconds']:.1f} s with {w} worker(s) on CUDA_VISIBLE_DEVICES "
                     f"{','.join(gpus)}: {rate:.1f} calls/s (x{rate / rate_one:.2f} of one worker)",
        })  # fmt: skip
    assert all(k == keys[min(runs)] for k in keys.values()), f"the discrepancies differ by worker count: {keys}"
