"""The search's checked calls per second by call format, for the bundled reference.

The same decode calls as ``test_bench_search.py`` (``search_harness.decode_calls``, derandomized: 40
on CUDA) judged with this checkout's modules (``search_harness.Judge``): a first pass compiles the
kernels for each shape; then ``--rounds`` passes, nothing wrapped (the rate: the median pass);
then one pass with each call, and the guarded forward inside it, bracketed by device
synchronisations (ms per call and per forward, by ``fmt``). Run it in two checkouts to compare
them (it reads the ``pytest_sparse_mla`` on ``sys.path``).

Usage: ``python benchmarks/bench_search_formats.py [--device cuda] [--calls 40] [--rounds 3] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import machine_summary  # noqa: E402
from search_harness import Judge, current_modules, decode_calls  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()

    import torch

    import pytest_sparse_mla
    from pytest_sparse_mla import guard
    from pytest_sparse_mla.implementations.builtin import ReferenceImplementation

    cuda = torch.device(args.device).type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    impl = ReferenceImplementation()
    calls = decode_calls(impl.envelope, torch.device(args.device).type, args.calls)
    judge = Judge(current_modules(), impl, args.device)
    t0 = time.perf_counter()
    for call in calls:
        judge(call)
    sync()
    first = time.perf_counter() - t0
    passes = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        for call in calls:
            judge(call)
        sync()
        passes.append(time.perf_counter() - t0)

    forward = guard.GuardedImplementation.sparse_mla_forward
    kernel = [0.0]

    def timed(*a: Any, **k: Any) -> Any:
        sync()
        start = time.perf_counter()
        try:
            return forward(*a, **k)
        finally:
            sync()
            kernel[0] += time.perf_counter() - start

    guard.GuardedImplementation.sparse_mla_forward = timed  # type: ignore[method-assign]
    by_fmt: dict[str, dict[str, list[float]]] = defaultdict(lambda: {"judged_ms": [], "forward_ms": []})
    per_call = []
    for call in calls:
        kernel[0] = 0.0
        sync()
        start = time.perf_counter()
        judge(call)
        sync()
        ms, fwd = 1e3 * (time.perf_counter() - start), 1e3 * kernel[0]
        by_fmt[call.fmt]["judged_ms"].append(ms)
        by_fmt[call.fmt]["forward_ms"].append(fwd)
        per_call.append(
            {"fmt": call.fmt, "T": call.num_tokens, "H": call.num_heads, "judged_ms": ms, "forward_ms": fwd}
        )
    guard.GuardedImplementation.sparse_mla_forward = forward  # type: ignore[method-assign]

    n = len(calls)
    doc = {
        "machine": machine_summary(), "package": str(Path(pytest_sparse_mla.__file__).parent), "device": args.device,
        "calls": n, "calls_per_s": n / statistics.median(passes), "passes_s": passes,
        "calls_per_s_first_pass": n / first,
        "by_fmt": {
            fmt: {"calls": len(v["judged_ms"]), "judged_ms_mean": statistics.fmean(v["judged_ms"]),
                  "forward_ms_mean": statistics.fmean(v["forward_ms"]), "forward_ms_max": max(v["forward_ms"]),
                  "judged_ms_sum": sum(v["judged_ms"])}
            for fmt, v in sorted(by_fmt.items())
        },
        "per_call": per_call,
    }  # fmt: skip
    print(f"{doc['package']} on {args.device}: {n} calls, {doc['calls_per_s']:.1f} calls/s "
          f"(median of {args.rounds}; first pass {doc['calls_per_s_first_pass']:.1f})")  # fmt: skip
    for fmt, row in doc["by_fmt"].items():
        print(f"  {fmt:8s} {row['calls']:3d} calls  judged {row['judged_ms_mean']:7.2f} ms/call  "
              f"forward {row['forward_ms_mean']:7.2f} ms (max {row['forward_ms_max']:.2f})")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
