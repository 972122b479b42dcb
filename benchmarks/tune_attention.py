"""Config sweep of the Triton attention kernel (``attention._triton_forward``) on CUDA.

For each ``(head_group, dv_block, num_warps, num_stages)`` it times the kernel alone and the whole forward
(``sparse_mla_forward(..., backend="triton")`` with the config patched in) at the benchmark shape
(T=4096, H=64, topk 128 + extra 512, page 64, sink), median of CUDA-event timings after warm-up,
and the error of the fp32 output / LSE against the float64 oracle on 8 tokens. Prints one table
row per config; ``--out`` writes JSON. Used to choose ``_triton_forward.DEFAULT_CONFIG``
(``docs/benchmarks.md``). Usage: ``python benchmarks/tune_attention.py [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import cuda_median_ms  # noqa: E402
from test_bench_attention import CHECK_TOKENS, _inputs, _slice  # noqa: E402

from pytest_sparse_mla.attention import oracle_forward, sparse_mla_forward  # noqa: E402
from pytest_sparse_mla.attention import reference as ref  # noqa: E402

CONFIGS = [(16, 512, 8, 1), (16, 512, 16, 1), (32, 512, 16, 1), (32, 256, 8, 1), (64, 256, 16, 1), (64, 512, 16, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--configs", default=None, help="';'-separated h,dv,warps,stages tuples")
    args = parser.parse_args()
    configs = CONFIGS
    if args.configs:
        configs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";")]
    dev = torch.device("cuda")
    module = ref.triton_forward_module()
    kwargs = _inputs(dev, args.tokens)
    check = _slice(kwargs, CHECK_TOKENS, dev)
    oracle = oracle_forward(**_slice(kwargs, CHECK_TOKENS, "cpu"))
    shipped = module.DEFAULT_CONFIG
    results = []
    for config in configs:
        module.DEFAULT_CONFIG = config
        try:
            res = sparse_mla_forward(**check, backend="triton", return_fp32=True)
            out_err = (res.output_fp32.cpu().double() - oracle.output).abs()
            rel = float(out_err.norm() / oracle.output.norm())
            lse_rel = float(((res.lse.cpu().double() - oracle.lse).abs() / oracle.lse.abs()).max())
            ms = cuda_median_ms(lambda: sparse_mla_forward(**kwargs, backend="triton"), warmup=2, reps=10)
        except Exception as exc:  # a config that does not compile (registers, shared memory)
            print(f"{config}: failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            results.append({"config": config, "error": str(exc)[:500]})
            continue
        row = {"config": config, "forward_ms": ms, "out_rel_norm": rel, "out_max_abs": float(out_err.max()),
               "lse_max_rel": lse_rel}  # fmt: skip
        results.append(row)
        print(f"{config}: forward {ms:.3f} ms, out rel {rel:.2e} (max abs {row['out_max_abs']:.1e}), "
              f"lse rel {lse_rel:.1e}", flush=True)  # fmt: skip
    module.DEFAULT_CONFIG = shipped
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    ok = [r for r in results if "forward_ms" in r and r["out_rel_norm"] < 1e-5]
    if ok:
        best = min(ok, key=lambda r: r["forward_ms"])
        print("best:", ",".join(str(v) for v in best["config"]))


if __name__ == "__main__":
    main()
