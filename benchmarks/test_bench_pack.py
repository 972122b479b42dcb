"""Quantize + pack throughput (``formats.quantize_pack``) on the GPU.

262,144 tokens (4,096 pages of 64) of BF16 latent rows are quantized to E4M3 with UE8M0 (DSV4) or
fp32 (DSV3.2) power-of-two scales and packed with the padded page stride. Bytes counted: the BF16
source read (``tokens * d_qk * 2``) plus the packed pages written (``pages * page_stride``). The
ratio is against the device-to-device copy bandwidth of the same run. ``quantize_pack`` is the
readable torch reference (several elementwise passes and one host check for non-finite input), so
the ratio says how far it is from one pass over the bytes, not a target.

Before timing, the first 8 GPU pages are checked byte for byte against the CPU pack of the same rows.
"""

from __future__ import annotations

import pytest
import torch
from bench_utils import cuda_median_ms, record, synced

from pytest_sparse_mla import data, formats

pytestmark = pytest.mark.sparse_mla_requires_cuda

PAGES, PS = 4_096, 64


@pytest.mark.parametrize("fmt", [formats.DSV4, formats.DSV3_2], ids=["dsv4", "dsv3_2"])
def test_quantize_pack(benchmark, bench_results, copy_baseline, fmt):
    gen = torch.Generator().manual_seed(464)
    source = data.latent((PAGES, PS, fmt.d_qk), gen, device="cuda")
    packed = formats.quantize_pack(source, fmt, page_stride="padded", form="2d")
    cpu = formats.quantize_pack(source[:8].cpu(), fmt, page_stride="padded", form="2d")
    assert torch.equal(packed[:8].cpu(), cpu)

    def run() -> torch.Tensor:
        return formats.quantize_pack(source, fmt, page_stride="padded", form="2d")

    ms = cuda_median_ms(run, warmup=2, reps=15)
    stride = formats.page_stride_bytes(fmt, PS, "padded")
    moved = source.numel() * 2 + PAGES * stride
    gbps = moved / ms / 1e6
    record(
        benchmark,
        bench_results,
        {
            "name": f"quantize_pack {fmt.name} ({PAGES * PS} tokens)",
            "ms": ms,
            "GBps": gbps,
            "copy_ratio": gbps / copy_baseline.gbps,
            "tokens_per_s": PAGES * PS / ms * 1e3,
            "moved_bytes": moved,
            "notes": "torch reference; includes its host non-finite check",
        },
    )
    benchmark.pedantic(synced(run), rounds=5, warmup_rounds=1)
