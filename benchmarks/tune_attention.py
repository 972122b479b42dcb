"""Config sweep of the reference's Triton attention kernel (``attention._triton_forward``) on CUDA.

For each ``(head_group, num_warps, num_stages, chunk)`` and split threshold it replays the
reference's CUDA graph at every decode shape of ``test_bench_replay.SHAPES`` (median CUDA-event
time, 30 reps after warm-up; FlashMLA's replay once per shape beside it when importable) and
checks the fp32 output of 8 tokens against the float64 oracle. Prints one line per config and
shape; ``--out`` writes JSON. Used to choose ``_triton_forward.DEFAULT_CONFIG``
(``docs/benchmarks.md``). Usage::

    python benchmarks/tune_attention.py [--out FILE] [--configs 'h,w,s,c;...'] [--waves 0,2,8]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import interleaved_median_ms  # noqa: E402
from test_bench_replay import SHAPES, build_inputs, flashmla_graph, oracle_errors, reference_graph  # noqa: E402

from pytest_sparse_mla.attention import reference as ref  # noqa: E402

CONFIGS = [(16, 4, 1, 512), (16, 8, 1, 512), (32, 4, 1, 512), (32, 8, 1, 512), (64, 4, 1, 512), (64, 8, 1, 512)]


def _gather_ms(module, kwargs: dict) -> float:  # type: ignore[no-untyped-def]
    """Replay time (ms) of the forward's gather launch alone on ``kwargs`` (all tokens in one block)."""
    import torch
    from bench_utils import capture_graph

    from pytest_sparse_mla import formats

    fmt, q = kwargs["fmt"], kwargs["q"]
    geo = module.cache_geometry(formats.parse_cache(kwargs["kv_cache"], fmt))
    extra = kwargs.get("extra_kv_cache")
    xgeo = module.cache_geometry(formats.parse_cache(extra, fmt)) if extra is not None else module._NO_CACHE
    xidx = kwargs.get("extra_indices", kwargs["indices"])
    extra_topk = int(xidx.shape[1]) if extra is not None else 0
    lanes = int(kwargs["indices"].shape[1]) + extra_topk
    d = 512 if fmt == "dsv4" else 576
    rows = torch.empty((q.shape[0] * lanes, d), dtype=torch.bfloat16, device=q.device)
    scales = torch.empty((q.shape[0] * lanes, 4), dtype=torch.float32, device=q.device)
    graph = capture_graph([lambda: module._gather(
        kwargs["kv_cache"], geo, kwargs["indices"], None, extra if extra is not None else kwargs["kv_cache"], xgeo,
        xidx, None, extra_topk, fmt == "dsv4", rows, scales)])  # fmt: skip
    return interleaved_median_ms(graph.replay, graph.replay, reps=30)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--configs", default=None, help="';'-separated h,warps,stages,chunk tuples")
    parser.add_argument("--waves", default="0.5", help="comma-separated SPLIT_BELOW_WAVES values")
    parser.add_argument("--shapes", default=None, help="comma-separated shape names")
    args = parser.parse_args()
    configs = CONFIGS
    if args.configs:
        configs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";")]
    shapes = [s for s in SHAPES if args.shapes is None or s.name in args.shapes.split(",")]
    module = ref.triton_forward_module()
    shipped, shipped_waves = dict(module.DEFAULT_CONFIG), module.SPLIT_BELOW_WAVES
    results = []
    for shape in shapes:
        kwargs = build_inputs(shape)
        theirs = flashmla_graph(kwargs)
        fm_ms = None
        if not isinstance(theirs, str):
            fm_ms = interleaved_median_ms(theirs[0].replay, theirs[0].replay, reps=30)[0]
        gather_us = 1e3 * _gather_ms(module, kwargs)
        print(f"{shape.name}: flashmla {fm_ms if fm_ms is None else round(1e3 * fm_ms, 1)} us; gather launch alone "
              f"{gather_us:.1f} us", flush=True)  # fmt: skip
        fm_us = None if fm_ms is None else 1e3 * fm_ms
        results.append({"shape": shape.name, "gather_us": gather_us, "flashmla_us": fm_us})
        for config in configs:
            for waves in (float(w) for w in args.waves.split(",")):
                module.DEFAULT_CONFIG = {True: config, False: config}
                module.SPLIT_BELOW_WAVES = waves
                t0 = time.perf_counter()
                try:
                    graph, holder = reference_graph(kwargs)
                    compile_s = time.perf_counter() - t0
                    ms = interleaved_median_ms(graph.replay, graph.replay, reps=30)[0]
                    rel, abs_err = oracle_errors(kwargs, holder["result"].output_fp32)
                except Exception as exc:  # a config that does not compile (registers, shared memory)
                    print(f"  {config} waves {waves}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    results.append({"shape": shape.name, "config": config, "waves": waves, "error": str(exc)[:500]})
                    continue
                row = {"shape": shape.name, "config": config, "waves": waves, "us": 1e3 * ms,
                       "flashmla_us": None if fm_ms is None else 1e3 * fm_ms,
                       "x_flashmla": None if fm_ms is None else ms / fm_ms, "rel": rel, "max_abs": abs_err,
                       "setup_s": compile_s}  # fmt: skip
                results.append(row)
                ratio = "" if fm_ms is None else f" = {ms / fm_ms:.2f}x flashmla"
                print(f"  {config} waves {waves}: {1e3 * ms:.1f} us{ratio}; err {rel:.1e} rel, {abs_err:.1e} abs; "
                      f"setup {compile_s:.1f} s", flush=True)  # fmt: skip
                if args.out:
                    args.out.write_text(json.dumps(results, indent=1))
        del kwargs, theirs
    module.DEFAULT_CONFIG, module.SPLIT_BELOW_WAVES = shipped, shipped_waves


if __name__ == "__main__":
    main()
