"""Empty rows of the bundled reference with a ``-inf`` sink: output 0 and the documented LSE.

A row with no valid candidate (every lane -1, or ``topk_length`` 0, in both caches) has an empty
softmax numerator. Its output is 0 whatever the sink; its LSE is, by the conventions of
``attention.conventions``: FlashInfer ``log2(exp(sink)) * lse_scale = sink * log2(e) * lse_scale``
(``-inf`` for a ``-inf`` sink, which means "no sink"), FlashMLA ``+inf`` (sink excluded). These
values are written out here by hand, not read from any implementation. A reference that computes
the sink factor as ``sigmoid(lse - sink)`` gives ``sigmoid(-inf - -inf) = NaN`` for such a row;
this test fails for it. The non-empty token of each case is judged against the float64 oracle.
"""

from __future__ import annotations

import math

import pytest
import torch

from pytest_sparse_mla import data
from pytest_sparse_mla.attention import oracle_forward, sparse_mla_forward
from pytest_sparse_mla.attention.reference import triton_unavailable_reason

_LOG2E = 1.0 / math.log(2.0)
_SINK = (-math.inf, 0.5)


def _backends() -> list:
    reason = triton_unavailable_reason("cpu")
    return ["torch", pytest.param("triton", marks=pytest.mark.skipif(reason is not None, reason=str(reason)))]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("fmt", ["dsv4", "dsv3_2"])
@pytest.mark.parametrize("how", ["all-minus-one", "topk-length-0"])
def test_empty_row_with_minus_inf_sink_gives_zero_output_and_documented_lse(backend, fmt, how) -> None:
    g = torch.Generator().manual_seed(12)
    main = data.make_packed_cache(g, fmt=fmt, num_pages=1, page_block_size=64)
    extra = data.make_packed_cache(g, fmt=fmt, num_pages=1, page_block_size=64)
    d_qk = main.fmt.d_qk
    q = data.latent((2, 2, d_qk), g)
    sink = torch.tensor(_SINK, dtype=torch.float32)
    if how == "all-minus-one":  # token 0: every lane -1 in both caches
        indices = torch.tensor([[-1, -1, -1], [3, 17, 40]], dtype=torch.int32)
        extra_indices = torch.tensor([[-1, -1], [5, 63]], dtype=torch.int32)
        lengths = extra_lengths = None
    else:  # token 0: valid indices, but topk_length 0 in both caches
        indices = torch.tensor([[1, 2, 3], [3, 17, 40]], dtype=torch.int32)
        extra_indices = torch.tensor([[4, 5], [5, 63]], dtype=torch.int32)
        lengths = torch.tensor([0, 3], dtype=torch.int32)
        extra_lengths = torch.tensor([0, 2], dtype=torch.int32)
    kw = dict(
        sm_scale=d_qk**-0.5, fmt=fmt, topk_length=lengths, attn_sink=sink, extra_kv_cache=extra.packed,
        extra_indices=extra_indices, extra_topk_length=extra_lengths,
    )  # fmt: skip
    for convention, scale in (("flashinfer", 1.0), ("flashinfer", math.log(2.0)), ("flashmla", 1.0)):
        res = sparse_mla_forward(
            q, main.packed, indices, lse_convention=convention, lse_scale=scale, return_fp32=True,
            backend=backend, **kw,
        )  # fmt: skip
        # Token 0 (empty): output exactly 0 on both heads, LSE by hand.
        assert res.output_fp32 is not None
        assert bool((res.output_fp32[0] == 0).all()), res.output_fp32[0].abs().max()
        assert bool((res.output[0] == 0).all())
        if convention == "flashinfer":
            assert res.lse[0, 0].item() == -math.inf
            assert res.lse[0, 1].item() == pytest.approx(0.5 * _LOG2E * scale, rel=1e-6)
        else:
            assert res.lse[0].tolist() == [math.inf, math.inf]
        # Token 1 (two valid candidate sets): the float64 oracle.
        ref = oracle_forward(q, main.packed, indices, lse_convention=convention, lse_scale=scale, **kw)
        torch.testing.assert_close(res.output_fp32[1].double(), ref.output[1], atol=1e-5, rtol=0)
        torch.testing.assert_close(res.lse[1].double(), ref.lse[1], atol=1e-5, rtol=1e-6)
