"""Where the time of the reference attention goes, on CUDA (decode T=64 and prefill T=4096).

Inputs: the benchmark shape of ``test_bench_attention.py`` (DSV4, H=64, topk 128 + extra 512 on
64-token pages, sink, every index valid). For each forward it measures, CUDA-event medians after
warm-up:

* ``eager_ms``: one call timed from an idle GPU (host work included, as a caller sees it);
* ``host_ms``: wall time until the call returns (host work; a host sync inside it waits for the
  GPU work queued before it);
* ``graph_ms``: the replay of a CUDA graph holding one call, where the call can be captured;
* ``kernels``: the device time of each kernel of one call (``torch.profiler``).

With ``--baseline DIR`` (a folder holding ``baseline_reference.py`` and
``baseline_triton_forward.py``, the previous reference with its Triton module renamed) it also
splits the previous forward into its stages (validation, dequantization of both caches into the
fp32 table, the lane table and its out-of-range host check, the BF16 key pieces, the kernel, the
finalisation), timing each alone (host and device). ``--configs`` sweeps the Triton kernel's
``DEFAULT_CONFIG``. Results: ``--out DIR`` gets ``profile.json``; a summary is printed.
Usage: ``python benchmarks/profile_attention.py --out DIR [--baseline DIR] [--configs "h,w,s,c;..."] [--skip-dsv32]``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import bf16_matmul_tflops, capture_graph, cuda_median_ms, machine_summary  # noqa: E402
from test_bench_attention import CHECK_TOKENS, H, _bytes_moved, _inputs, _slice  # noqa: E402

from pytest_sparse_mla import formats  # noqa: E402
from pytest_sparse_mla.attention import oracle_forward, sparse_mla_forward  # noqa: E402
from pytest_sparse_mla.attention import reference as ref  # noqa: E402


def host_ms(fn: Callable[[], object], reps: int = 20) -> float:
    """Median wall time (ms) until ``fn()`` returns, each call started on an idle GPU."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def stage(fn: Callable[[], Any], reps: int = 10) -> tuple[dict[str, float], Any]:
    """Host and device time (ms, medians) of ``fn`` run alone on an idle GPU; returns its result."""
    hosts, devices, out = [], [], None
    for _ in range(reps + 2):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        out = fn()
        end.record()
        t1 = time.perf_counter()
        end.synchronize()
        hosts.append((t1 - t0) * 1e3)
        devices.append(start.elapsed_time(end))
    return {"host_ms": statistics.median(hosts[2:]), "span_ms": statistics.median(devices[2:])}, out


def kernel_table(fn: Callable[[], object]) -> list[dict[str, Any]]:
    """Device time (us) and count of each kernel of one ``fn()`` (``torch.profiler``)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue  # CPU-side ops; their kernels are listed on their own
        dev = getattr(e, "self_device_time_total", None) or getattr(e, "device_time_total", 0)
        rows.append({"name": e.key[:90], "count": e.count, "device_us": dev})
    rows.sort(key=lambda r: -r["device_us"])
    return rows[:20]


def accuracy(forward: Callable[..., Any], kwargs: dict, **extra: Any) -> dict[str, float]:
    """fp32 output and LSE of ``CHECK_TOKENS`` tokens against the float64 oracle."""
    dev = kwargs["q"].device
    res = forward(**_slice(kwargs, CHECK_TOKENS, dev), return_fp32=True, **extra)
    oracle = oracle_forward(**_slice(kwargs, CHECK_TOKENS, "cpu"))
    diff = res.output_fp32.cpu().double() - oracle.output
    return {
        "out_max_abs": float(diff.abs().max()),
        "out_rel_norm": float(diff.norm() / oracle.output.norm()),
        "lse_max_abs": float((res.lse.cpu().double() - oracle.lse).abs().max()),
    }


def _baseline_stages(base: Any, module: Any, kw: dict) -> dict[str, Any]:
    """Each stage of the previous forward at T=64, timed alone (host and device)."""
    f = formats.get_format("dsv4")
    q, kv, idx = kw["q"], kw["kv_cache"], kw["indices"]
    xkv, xidx, sink = kw["extra_kv_cache"], kw["extra_indices"], kw["attn_sink"]
    stages: dict[str, Any] = {}

    def validate() -> tuple:
        layout = formats.parse_cache(kv, f)
        xlayout = formats.parse_cache(xkv, f)
        base._check_index_tensor(idx, "indices", 64, q)
        base._check_index_tensor(xidx, "extra_indices", 64, q)
        base._check_vector(sink, "attn_sink", torch.float32, H, "", q)
        return layout, xlayout

    stages["validate"], (layout, xlayout) = stage(validate)
    stages["dequantize main (8,192 rows)"], _ = stage(lambda: formats.unpack_dequantize(kv, f))
    stages["dequantize extra (16,384 rows)"], _ = stage(lambda: formats.unpack_dequantize(xkv, f))
    stages["lanes (main + extra)"], _ = stage(
        lambda: (
            base._candidate_lanes(idx, None, 8192, 0, 24576),
            base._candidate_lanes(xidx, None, 16384, 8192, 24576),
        )
    )
    lanes = base._candidate_lanes(idx, None, 8192, 0, 24576)
    stages["out-of-range host check"], _ = stage(lambda: bool(lanes[2].any()))
    stages["prepare (all of the above but validate)"], prep = stage(
        lambda: base._prepare_candidates(f, kv, idx, None, None, layout, xkv, xidx, None, None, xlayout)
    )  # fmt: skip
    table, rows, _valid, zero_row = prep
    stages["bf16 pieces of the table"], pieces = stage(lambda: module.bf16_pieces(table, True))
    rows32 = rows.to(torch.int32)
    stages["kernel (online softmax)"], state = stage(
        lambda: module.online_softmax(q, pieces, rows32, zero_row, kw["sm_scale"], 512)
    )  # fmt: skip
    finish = base._Finaliser(sink, "flashinfer", 1.0)
    output = torch.empty((64, H, 512), dtype=torch.bfloat16, device=q.device)
    lse = torch.empty((64, H), dtype=torch.float32, device=q.device)

    def finalise() -> None:
        o, l_ = finish(state[0].unsqueeze(-1), state[1].unsqueeze(-1), state[2], sink.view(1, -1, 1))
        output.copy_(o)
        lse.copy_(l_.squeeze(-1))

    stages["finalise"], _ = stage(finalise)
    return stages


def profile_baseline(directory: Path, data: dict[int, dict]) -> dict[str, Any]:
    """Stages of the previous reference (Triton backend)."""
    sys.path.insert(0, str(directory))
    base = importlib.import_module("baseline_reference")
    module = base.triton_forward_module()
    out: dict[str, Any] = {}
    for num_tokens, kwargs in data.items():
        kw = dict(kwargs)

        def call(kw: dict = kw) -> object:
            return base.sparse_mla_forward(**kw, backend="triton")

        row: dict[str, Any] = {"eager_ms": cuda_median_ms(call, warmup=2, reps=20), "host_ms": host_ms(call)}
        row["kernels"] = kernel_table(call)
        if num_tokens == 64:
            row["stages"] = _baseline_stages(base, module, kw)
        out[f"T{num_tokens}"] = row
        print(f"baseline T={num_tokens}: eager {row['eager_ms']:.3f} ms, host {row['host_ms']:.3f} ms")
        for name, st in row.get("stages", {}).items():
            print(f"    {name:42s} host {st['host_ms']:.3f} ms  device span {st['span_ms']:.3f} ms")
        for k in row["kernels"][:10]:
            print(f"    kernel {k['name'][:60]:60s} x{k['count']}  {k['device_us']:.1f} us")
    return out


def baseline_capture(data: dict[int, dict]) -> str:
    """Try to capture the previous forward in a CUDA graph (run last: a failed capture can leave
    the process's CUDA state unusable)."""
    base = importlib.import_module("baseline_reference")
    kw = data[64]
    try:
        capture_graph([lambda: base.sparse_mla_forward(**kw, backend="triton")])
    except Exception as exc:  # the out-of-range check synchronises the host
        return f"capture fails: {type(exc).__name__}: {str(exc)[:200]}"
    return "captured"


def profile_new(data: dict[int, dict], configs: list[tuple[int, ...]]) -> dict[str, Any]:
    module = ref.triton_forward_module()
    shipped_table = dict(module.DEFAULT_CONFIG)
    shipped = shipped_table[True]
    out: dict[str, Any] = {"shipped_config": shipped, "configs": []}
    for config in [shipped] + [c for c in configs if c != shipped]:
        module.DEFAULT_CONFIG = {True: config, False: config}
        row: dict[str, Any] = {"config": config}
        try:
            for num_tokens, kwargs in data.items():
                kw = dict(kwargs)

                def call(kw: dict = kw, **extra: Any) -> object:
                    return sparse_mla_forward(**kw, backend="triton", **extra)

                acc = accuracy(sparse_mla_forward, kw, backend="triton")
                graph = capture_graph([call])
                r = {
                    "eager_ms": cuda_median_ms(call, warmup=2, reps=20),
                    "eager_unchecked_ms": cuda_median_ms(lambda: call(check_indices=False), warmup=2, reps=20),
                    "host_ms": host_ms(call),
                    "host_unchecked_ms": host_ms(lambda: call(check_indices=False)),
                    "graph_ms": cuda_median_ms(graph.replay, warmup=3, reps=50),
                    **acc,
                }
                if config == shipped:
                    r["kernels"] = kernel_table(call)
                row[f"T{num_tokens}"] = r
                print(
                    f"new {config} T={num_tokens}: eager {r['eager_ms']:.3f} ms "
                    f"(unchecked {r['eager_unchecked_ms']:.3f}), host {r['host_ms']:.3f} ms "
                    f"(unchecked {r['host_unchecked_ms']:.3f}), graph {r['graph_ms'] * 1e3:.1f} us, "
                    f"out abs {acc['out_max_abs']:.1e} rel {acc['out_rel_norm']:.1e}, lse {acc['lse_max_abs']:.1e}",
                    flush=True,
                )
                for k in r.get("kernels", [])[:6]:
                    print(f"    kernel {k['name'][:60]:60s} x{k['count']}  {k['device_us']:.1f} us")
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
            print(f"new {config}: FAILED {row['error']}", flush=True)
            traceback.print_exc(limit=3)
        out["configs"].append(row)
    module.DEFAULT_CONFIG = shipped_table
    return out


def profile_dsv32() -> dict[str, Any]:
    """DSV3.2 (three key pieces): accuracy at T=8 and the times at T=64, H=64, topk 128 + 512."""
    from pytest_sparse_mla import data as gen_data

    g = torch.Generator().manual_seed(32)
    dev = torch.device("cuda")
    main = gen_data.make_packed_cache(g, fmt="dsv3_2", num_pages=128, page_block_size=64, device=dev)
    extra = gen_data.make_packed_cache(g, fmt="dsv3_2", num_pages=256, page_block_size=64, device=dev)
    kw = {
        "q": gen_data.latent((64, H, 576), g, device=dev),
        "kv_cache": main.packed,
        "indices": torch.randint(0, 8192, (64, 128), generator=g, dtype=torch.int32).to(dev),
        "extra_kv_cache": extra.packed,
        "extra_indices": torch.randint(0, 16384, (64, 512), generator=g, dtype=torch.int32).to(dev),
        "attn_sink": gen_data.attn_sink(H, g, device=dev),
        "sm_scale": 576**-0.5,
        "fmt": "dsv3_2",
    }
    row: dict[str, Any] = accuracy(sparse_mla_forward, kw, backend="triton")

    def call() -> object:
        return sparse_mla_forward(**kw, backend="triton")

    row["eager_ms"] = cuda_median_ms(call, warmup=2, reps=20)
    row["graph_ms"] = cuda_median_ms(capture_graph([call]).replay, warmup=3, reps=50)
    print(f"dsv3_2 T=64: {row}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--baseline", type=Path, default=None)
    parser.add_argument("--configs", default="", help="';'-separated head_group,warps,stages,chunk tuples")
    parser.add_argument("--skip-dsv32", action="store_true", help="leave out the DSV3.2 section")
    args = parser.parse_args()
    configs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";") if c]
    dev = torch.device("cuda")
    result: dict[str, Any] = {"machine": machine_summary()}
    src = torch.randint(0, 256, (1 << 30,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_ms = cuda_median_ms(lambda: dst.copy_(src), warmup=20, reps=20)
    result["copy_GBps"] = 2 * (1 << 30) / copy_ms / 1e6
    result["bf16_TFLOPs"] = bf16_matmul_tflops()
    print(f"copy {result['copy_GBps']:.0f} GB/s, bf16 mm {result['bf16_TFLOPs']:.0f} TFLOP/s", flush=True)
    data = {t: _inputs(dev, t) for t in (64, 4096)}
    for t in data:
        moved = _bytes_moved(t)
        flops = 2 * t * H * 640 * 512 * 2
        result[f"bounds_T{t}"] = {
            "bytes": moved,
            "bytes_us": moved / result["copy_GBps"] / 1e3,
            "flops": flops,
            "flops_us": flops / result["bf16_TFLOPs"] / 1e6,
        }
        print(f"T={t}: bound {result[f'bounds_T{t}']}")
    sections: list[tuple[str, Callable[[], Any]]] = []
    if args.baseline is not None:
        sections.append(("baseline", lambda: profile_baseline(args.baseline, data)))
    sections.append(("new", lambda: profile_new(data, configs)))
    if not args.skip_dsv32:
        sections.append(("dsv3_2", profile_dsv32))
    if args.baseline is not None:
        sections.append(("baseline_capture", lambda: baseline_capture(data)))
    for name, fn in sections:
        try:
            result[name] = fn()
        except Exception as exc:
            result[name] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            print(f"{name}: FAILED {result[name]['error']}", flush=True)
            traceback.print_exc(limit=4)
        if name == "baseline_capture":
            print(f"baseline capture: {result[name]}")
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile.json").write_text(json.dumps(result, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
