"""Decode replay against replay: the bundled reference and FlashMLA timed the same way.

Each kernel is captured once in a CUDA graph holding one call (FlashMLA's scheduler metadata
computed by the warm-up call before the capture and reused by every replay, as a serving engine
does) and the two graphs are replayed alternately on the same inputs (50 reps after 3 warm-ups,
median CUDA-event time). ``T = 64`` query tokens (the decode cutoff), every index valid and drawn
uniformly over its cache, ``attn_sink`` on, caches of production size (:data:`SHAPES`):

* ``dsv4-h64``: DSV4 584 B/token caches, 64 heads, main ``page_block_size`` 256 with ``topk`` 128,
  extra cache of 64-token pages with ``extra_topk`` 512 (FlashMLA's MODEL1 dual-cache decode).
* ``dsv4-h128``: 128 heads, main as above, extra cache of 2-token pages with ``extra_topk`` 1024.
* ``dsv32-h64`` / ``dsv32-h128``: DSV3.2 656 B/token cache of 64-token pages, ``topk`` 2048
  (FlashMLA's V32 decode; no extra cache).

Each row gives both medians, the ratio reference / FlashMLA, the byte bound (packed rows of every
valid lane, queries, BF16 output, at the device-copy bandwidth of this run) and the FLOP bound
(``2 T H lanes (d_qk + d_v)`` at the BF16 ``torch.mm`` rate of this run), and the error of the
reference's fp32 output (normwise relative and max absolute, 8 tokens) and FlashMLA's BF16 output
(normwise relative) against the float64 oracle.

``benchmarks/tune_attention.py`` sweeps the reference's kernel configs over the same shapes.
Skipped without CUDA; FlashMLA's rows say why when it is not importable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from bench_utils import bf16_matmul_tflops, capture_graph, interleaved_median_ms, record, synced

from pytest_sparse_mla import data, formats
from pytest_sparse_mla.attention import oracle_forward, sparse_mla_forward

pytestmark = pytest.mark.sparse_mla_requires_cuda

TOKENS = 64
CHECK_TOKENS = 8


@dataclass(frozen=True)
class ReplayShape:
    """One decode shape: format, heads, main cache (pages x ``page_block_size``, ``topk``) and the
    optional extra cache (``extra_topk`` 0: none)."""

    name: str
    fmt: str
    num_heads: int
    page_block_size: int
    num_pages: int
    topk: int
    extra_page_block_size: int = 0
    extra_num_pages: int = 0
    extra_topk: int = 0

    @property
    def lanes(self) -> int:
        return self.topk + self.extra_topk


SHAPES = [
    ReplayShape("dsv4-h64", "dsv4", 64, 256, 1024, 128, 64, 2048, 512),
    ReplayShape("dsv4-h128", "dsv4", 128, 256, 1024, 128, 2, 8192, 1024),
    ReplayShape("dsv32-h64", "dsv3_2", 64, 64, 4096, 2048),
    ReplayShape("dsv32-h128", "dsv3_2", 128, 64, 4096, 2048),
]


def build_inputs(shape: ReplayShape, tokens: int = TOKENS, seed: int = 2026) -> dict[str, Any]:
    """``sparse_mla_forward`` keyword arguments of ``shape`` on CUDA (``fmt`` included)."""
    gen = torch.Generator().manual_seed(seed)
    f = formats.get_format(shape.fmt)
    main = data.make_packed_cache(gen, fmt=shape.fmt, num_pages=shape.num_pages,
                                  page_block_size=shape.page_block_size, device="cuda")  # fmt: skip
    n = shape.num_pages * shape.page_block_size
    kwargs: dict[str, Any] = {
        "q": data.latent((tokens, shape.num_heads, f.d_qk), gen, device="cuda"),
        "kv_cache": main.packed,
        "indices": torch.randint(0, n, (tokens, shape.topk), generator=gen, dtype=torch.int32).cuda(),
        "attn_sink": data.attn_sink(shape.num_heads, gen, device="cuda"),
        "sm_scale": f.d_qk**-0.5,
        "fmt": shape.fmt,
    }
    if shape.extra_topk:
        extra = data.make_packed_cache(gen, fmt=shape.fmt, num_pages=shape.extra_num_pages,
                                       page_block_size=shape.extra_page_block_size, device="cuda")  # fmt: skip
        xn = shape.extra_num_pages * shape.extra_page_block_size
        kwargs["extra_kv_cache"] = extra.packed
        kwargs["extra_indices"] = torch.randint(0, xn, (tokens, shape.extra_topk), generator=gen,
                                                dtype=torch.int32).cuda()  # fmt: skip
    return kwargs


def reference_graph(kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The reference's call captured in a CUDA graph; returns ``(graph, holder)`` where
    ``holder["result"]`` is the output every replay writes."""
    holder: dict[str, Any] = {}

    def call() -> None:
        holder["result"] = sparse_mla_forward(**kwargs, backend="triton", check_indices=False, return_fp32=True)

    return capture_graph([call]), holder


def flashmla_graph(kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]] | str:
    """FlashMLA's ``flash_mla_with_kvcache`` on the same inputs captured in a CUDA graph (scheduler
    metadata from the warm-up call, reused), or why it cannot run."""
    from pytest_sparse_mla.implementations import BUILTINS
    from pytest_sparse_mla.implementations._peer import nhd_view

    reason = BUILTINS["flashmla"](None).skip_reason("sparse_mla_forward", "cuda")
    if reason is not None:
        return reason
    import flash_mla

    fmt = kwargs["fmt"]
    kv4 = nhd_view(kwargs["kv_cache"], formats.parse_cache(kwargs["kv_cache"], fmt))
    extra = kwargs.get("extra_kv_cache")
    extra4 = None if extra is None else nhd_view(extra, formats.parse_cache(extra, fmt))
    extra_idx = kwargs.get("extra_indices")
    sched, _ = flash_mla.get_mla_metadata()
    holder: dict[str, Any] = {}

    def call() -> None:
        holder["result"] = flash_mla.flash_mla_with_kvcache(
            kwargs["q"].unsqueeze(1), kv4, None, None, 512, sched, None, softmax_scale=kwargs["sm_scale"],
            is_fp8_kvcache=True, indices=kwargs["indices"].unsqueeze(1), attn_sink=kwargs["attn_sink"],
            extra_k_cache=extra4, extra_indices_in_kvcache=None if extra_idx is None else extra_idx.unsqueeze(1),
        )  # fmt: skip

    return capture_graph([call]), holder


def bounds(shape: ReplayShape, tokens: int = TOKENS) -> tuple[int, int]:
    """``(bytes, flops)`` of one call: packed rows of every valid lane, the BF16 queries and the
    BF16 output; ``2 T H lanes (d_qk + d_v)``."""
    f = formats.get_format(shape.fmt)
    moved = tokens * shape.lanes * f.bytes_per_token + tokens * shape.num_heads * (f.d_qk + f.d_v) * 2
    return moved, 2 * tokens * shape.num_heads * shape.lanes * (f.d_qk + f.d_v)


def oracle_errors(kwargs: dict[str, Any], output: torch.Tensor) -> tuple[float, float]:
    """Normwise relative and max absolute error of ``output`` (first :data:`CHECK_TOKENS` tokens)
    against the float64 oracle."""
    part = {k: (v[:CHECK_TOKENS] if k in ("q", "indices", "extra_indices") else v) for k, v in kwargs.items()}
    want = oracle_forward(**part).output
    diff = output[:CHECK_TOKENS].double() - want.to(output.device)
    return (diff.norm() / want.norm()).item(), diff.abs().max().item()


@pytest.fixture(scope="module")
def bf16_rate() -> float:
    """This run's BF16 ``torch.mm`` rate (TFLOP/s), for the FLOP bound."""
    return bf16_matmul_tflops()


@pytest.mark.parametrize("shape", SHAPES, ids=[s.name for s in SHAPES])
def test_decode_replay_against_flashmla(benchmark, bench_results, copy_baseline, bf16_rate, shape):
    kwargs = build_inputs(shape)
    ours, ours_out = reference_graph(kwargs)
    theirs = flashmla_graph(kwargs)
    moved, flops = bounds(shape)
    byte_ms, flop_ms = copy_baseline.ideal_ms(moved), flops / bf16_rate / 1e9
    label = f"replay {shape.name} T={TOKENS} H={shape.num_heads} topk {shape.topk}" + (
        f"+{shape.extra_topk}" if shape.extra_topk else ""
    )
    if isinstance(theirs, str):
        ours_ms = interleaved_median_ms(ours.replay, ours.replay, reps=50)[0]
        row = {"name": f"{label} reference", "ms": ours_ms, "notes": f"flashmla skipped: {theirs}"}
    else:
        graph, holder = theirs
        ours_ms, theirs_ms = interleaved_median_ms(ours.replay, graph.replay, reps=50)
        fm_rel = oracle_errors(kwargs, holder["result"][0][:, 0])[0]
        row = {"name": f"{label} reference", "ms": ours_ms, "flashmla_ms": theirs_ms,
               "x_flashmla": ours_ms / theirs_ms, "flashmla_rel_err": fm_rel,
               "notes": f"{ours_ms / theirs_ms:.2f}x FlashMLA ({1e3 * theirs_ms:.1f} us; its output {fm_rel:.1e} "
               "normwise vs oracle)"}  # fmt: skip
    # the captured outputs hold values only once a replay has run: read them after the timing
    rel, abs_err = oracle_errors(kwargs, ours_out["result"].output_fp32)
    row.update(
        TFLOPs=flops / ours_ms / 1e9, byte_bound_ms=byte_ms, flop_bound_ms=flop_ms, rel_err_output_fp32=rel,
        max_abs_err_output_fp32=abs_err,
    )  # fmt: skip
    row["notes"] += (
        f"; bounds: bytes {1e3 * byte_ms:.1f} us, FLOPs {1e3 * flop_ms:.1f} us; fp32 output {rel:.1e} normwise, "
        f"{abs_err:.1e} max abs vs oracle"
    )
    record(benchmark, bench_results, row)
    assert math.isfinite(rel) and abs_err <= 1e-5, f"reference fp32 output {abs_err:.2e} from the oracle"
    benchmark.pedantic(synced(ours.replay), rounds=5, warmup_rounds=1)
