"""Tuning sweep of the page-split copy kernel on a CUDA GPU (not a test; run it directly).

    python benchmarks/tune_split.py --out results/tune_split.json

Measures, in one process and against one device-to-device copy of the same byte count:

* full split of a 7,168 x 149,760 B pool (1.07 GB, 256-token pages -> 28,672 64-token pages) for
  every :class:`~pytest_sparse_mla.page_split._triton.CopyConfig` of a small grid, and the torch
  backend;
* the touched split at 0%, 1%, 10% and 100% of source pages touched ([64, 512] int32 indices):
  the first design (mask zero + int8 mark + one program per destination sub-page, with
  ``MASKED_CONFIG``) against the worklist design (:func:`split_touched_pages`: claim/append mark +
  fixed-grid worklist copy) under several ``WorklistConfig`` values, and the worklist design with
  an extra memset of its scratch (the price of one more graph node).

Every variant is checked byte for byte against the torch backend before it is timed (destination,
int8 mask, and the worklist scratch's counters and claims back at zero). Touched runs are CUDA-graph
replays of 8 splits over 8 different page sets (so the touched pages of one replay are not in the
L2 from the previous one); times are per split. Medians of CUDA-event times.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton

from pytest_sparse_mla.page_split import _torch, parse_split_source, triton_backend

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import capture_graph, cuda_median_ms, interleaved_median_ms  # noqa: E402

T = triton_backend()
PS, SRC_STRIDE, DST_STRIDE, DST_BYTES = 256, 149_760, 37_440, 37_376
ROTATE = 8


def copy_time_ms(nbytes: int, dev: torch.device, gen: torch.Generator) -> float:
    """Median time of one device-to-device copy of ``nbytes`` random bytes (torch ``copy_``)."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev, generator=gen)
    dst = torch.empty_like(src)
    return cuda_median_ms(lambda: dst.copy_(src), reps=25)


def kernel_registers(fn) -> list[dict]:
    """Registers and spills of every compiled variant of a Triton kernel (best effort)."""
    rows = []
    try:
        for cache in fn.device_caches.values():
            for kernel in cache[0].values():
                rows.append(
                    {
                        "num_warps": kernel.metadata.num_warps,
                        "regs": getattr(kernel, "n_regs", None),
                        "spills": getattr(kernel, "n_spills", None),
                    }
                )
    except Exception as exc:  # noqa: BLE001 - introspection differs between Triton versions
        rows.append({"error": f"{type(exc).__name__}: {exc}"})
    return rows


def index_sets(P: int, frac: float, gen: torch.Generator, dev: torch.device):
    """ROTATE (masks, [64, 512] int32 index tensors) covering round(P*frac) random pages each."""
    k = round(P * frac)
    masks, idx_sets = [], []
    n = 64 * 512
    for _ in range(ROTATE):
        pages = torch.randperm(P, generator=gen)[:k]
        m = torch.zeros(P, dtype=torch.int8)
        m[pages] = 1
        masks.append(m.to(dev))
        if k:
            pick = torch.cat([pages, pages[torch.randint(0, k, (n - k,), generator=gen)]])
            idx = pick * PS + torch.randint(0, PS, (n,), generator=gen)
        else:
            idx = torch.full((n,), -1, dtype=torch.int64)
        idx_sets.append(idx.to(torch.int32).to(dev))
    return k, masks, idx_sets


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="tune_split.json")
    parser.add_argument("--pages", type=int, default=7168)
    parser.add_argument("--skip-masked", action="store_true", help="only the full-split sweep")
    parser.add_argument("--skip-full", action="store_true", help="only the touched-split sweep")
    opts = parser.parse_args()
    dev = torch.device("cuda", 0)
    P = opts.pages
    D = P * 4
    gen = torch.Generator(device=dev).manual_seed(8)
    pool = torch.randint(0, 256, (P, SRC_STRIDE), dtype=torch.uint8, device=dev, generator=gen)
    source = parse_split_source(pool, PS)
    ref = torch.full((D, DST_STRIDE), 0xA5, dtype=torch.uint8, device=dev)
    out = torch.full_like(ref, 0xA5)
    moved = 2 * DST_BYTES * D
    res: dict = {
        "gpu": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "src_pages": P,
        "dst_pages": D,
        "pool_bytes": P * SRC_STRIDE,
        "moved_bytes": moved,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    a = torch.randint(0, 256, (DST_BYTES * D,), dtype=torch.uint8, device=dev, generator=gen)
    b = torch.empty_like(a)

    def copy() -> None:
        b.copy_(a)

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 1.0:  # raise the clocks before measuring
        for _ in range(50):
            copy()
        torch.cuda.synchronize()
    _torch.copy_sub_pages(source, ref, None)

    res["full"] = []
    configs = [
        T.CopyConfig(512, 4, False),
        T.CopyConfig(1024, 8, False),
        T.CopyConfig(4096, 8, False),
        T.CopyConfig(4096, 16, False),
        T.CopyConfig(4096, 16, True),
        T.CopyConfig(4096, 32, False),
        T.CopyConfig(4096, 32, True),
    ]
    copy_graph = capture_graph([copy] * ROTATE)
    for rep in () if opts.skip_full else range(2):
        for c in configs:
            try:
                out.fill_(0xA5)
                T.copy_sub_pages(source, out, None, config=c)
                ok = torch.equal(out, ref)
                g = capture_graph([lambda c=c: T.copy_sub_pages(source, out, None, config=c)] * ROTATE)
                copy_ms, ms = interleaved_median_ms(copy_graph.replay, g.replay, reps=15)
                copy_ms, ms = copy_ms / ROTATE, ms / ROTATE
                e_copy, e_ms = interleaved_median_ms(
                    copy, lambda c=c: T.copy_sub_pages(source, out, None, config=c), reps=15
                )
                row = {
                    "pass": rep,
                    "config": c.__dict__,
                    "ms": ms,
                    "copy_ms": copy_ms,
                    "ratio": copy_ms / ms,
                    "eager_ms": e_ms,
                    "eager_copy_ms": e_copy,
                    "eager_ratio": e_copy / e_ms,
                    "identical": ok,
                }
                res["full"].append(row)
                print(
                    f"full pass{rep} {c}: graph {ms:.4f} ms copy {copy_ms:.4f} ms ratio {copy_ms / ms:.3f} | "
                    f"eager {e_ms:.4f} ms copy {e_copy:.4f} ratio {e_copy / e_ms:.3f} identical={ok}",
                    flush=True,
                )
            except Exception as exc:  # noqa: BLE001 - keep sweeping
                print(f"full {c}: FAILED {type(exc).__name__}: {exc}"[:400], flush=True)
    if not opts.skip_full:
        copy_ms, ms = interleaved_median_ms(copy, lambda: _torch.copy_sub_pages(source, out, None), reps=10)
        res["full_torch"] = {"ms": ms, "copy_ms": copy_ms, "ratio": copy_ms / ms}
        print(f"full torch: {ms:.4f} ms ratio {copy_ms / ms:.3f}", flush=True)
    copy_ms = interleaved_median_ms(copy, copy, reps=30)[0]
    copy_bw = moved / copy_ms / 1e6
    res["copy_ms"], res["copy_GBps"] = copy_ms, copy_bw
    print(f"copy {copy_ms:.4f} ms {copy_bw:.0f} GB/s", flush=True)

    cpu_gen = torch.Generator().manual_seed(32_320)
    res["masked"] = []
    mreg = torch.zeros(P, dtype=torch.int8, device=dev)
    scratch = torch.zeros(T.worklist_scratch_shape(P), dtype=torch.int32, device=dev)
    W, C = T.WorklistConfig, T.CopyConfig
    worklist_configs = [
        T.WORKLIST_CONFIG,  # 16 programs of 16 warps per SM, mark block 256, dependent launch
        W(C(4096, 16, False), 4, pdl=False),  # the earlier default
        W(C(4096, 16, False), 4, pdl=True),
        W(C(4096, 16, False), 8, pdl=True),
        W(C(4096, 16, False), 16, pdl=False),
        W(C(4096, 32, False), 8, pdl=True),
    ]

    def label(c) -> str:
        return (
            f"worklist {c.copy.block}/{c.copy.num_warps}w/{'ev' if c.copy.evict else '-'} "
            f"{c.programs_per_sm}/SM mark{c.mark_block}{'+check' if c.check_first else ''}{' pdl' if c.pdl else ''}"
        )

    variants = {
        "first design (grid per sub-page)": lambda i: (
            T.mark_touched_pages(i, mreg, PS),
            T.copy_sub_pages(source, out, mreg),
        )
    }
    for c in worklist_configs:
        variants[label(c)] = lambda i, c=c: T.split_touched_pages(source, out, i, mreg, scratch, config=c)
    variants["worklist default + memset of the scratch"] = lambda i: (
        scratch.zero_(),
        T.split_touched_pages(source, out, i, mreg, scratch),
    )
    summary = []
    for frac in () if opts.skip_masked else (0.0, 0.01, 0.10, 1.0):
        k, masks, idx_sets = index_sets(P, frac, cpu_gen, dev)
        ideal_ms = 2 * DST_BYTES * k * 4 / copy_bw / 1e6
        refm = torch.full_like(ref, 0xA5)
        _torch.copy_sub_pages(source, refm, masks[0])
        for name, fn in variants.items():
            try:
                out.fill_(0xA5)
                fn(idx_sets[0])
                ok = torch.equal(out, refm) and torch.equal(mreg, masks[0])
                ok = ok and bool((scratch[:, 0] == 0).all()) and scratch[0].tolist() == [0, 0]
                g = capture_graph([lambda i=i, fn=fn: fn(i) for i in idx_sets])
                ms = cuda_median_ms(g.replay, reps=20) / ROTATE
                x = ms / ideal_ms if ideal_ms else float("nan")
                row = {"variant": name, "frac": frac, "pages": k, "split_ms": ms, "ideal_ms": ideal_ms, "x_ideal": x}
                row["identical"] = ok
                res["masked"].append(row)
                summary.append(row)
                print(f"touched {frac:4.2f} {name:64s} {ms * 1e3:8.2f} us x{x:5.2f} identical={ok}", flush=True)
            except Exception as exc:  # noqa: BLE001 - keep sweeping
                print(f"touched {frac:4.2f} {name}: FAILED {type(exc).__name__}: {exc}"[:400], flush=True)
    res["registers"] = {
        "worklist_copy": kernel_registers(T._worklist_copy_kernel),
        "mark_worklist": kernel_registers(T._mark_worklist_kernel),
    }
    print("registers:", json.dumps(res["registers"]), flush=True)
    if summary:
        print("\nvariant | " + " | ".join(f"{f:.0%}" for f in (0.0, 0.01, 0.10, 1.0)))
        for name in variants:
            cells = []
            for f in (0.0, 0.01, 0.10, 1.0):
                r = [x for x in summary if x["variant"] == name and x["frac"] == f]
                cells.append(
                    f"{r[0]['split_ms'] * 1e3:.1f}us"
                    + (f" {r[0]['x_ideal']:.2f}x" if r and r[0]["ideal_ms"] else "")
                    + ("" if r and r[0]["identical"] else " BAD")
                    if r
                    else "-"
                )
            print(f"{name} | " + " | ".join(cells), flush=True)
    with open(opts.out, "w") as fh:
        json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
