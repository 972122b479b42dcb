"""``flashinfer-reference`` with ``lse_convention="flashmla"`` and a sink: the sink-excluded LSE is the
reference's own (a call without the sink), not the sink removed from its fp32 sink-included LSE.

FlashInfer's DSV4 reference (``compressed_sparse_mla_reference``) returns ``row_m + log(denom)`` with
the sink inside ``denom``, in fp32. ``ln(e**lse - e**sink)`` (``_peer.lse_to_convention``) cannot
recover the candidates' LSE from that once the sink dominates: one candidate of logit 0 beside a sink
of 20 gives ``lse = 20 + 2e-9``, which rounds to ``20.0`` in fp32, and the conversion reports the row
as empty (``+inf``) where the answer is ``0``. The search met it as a "new" discrepancy
(``attn_sink=finite lse_convention=flashmla``; smallest call: 64 lanes of logit 0, sink 1000).
"""

from __future__ import annotations

import math

import pytest
import torch

from pytest_sparse_mla import data
from pytest_sparse_mla.attention import oracle_forward
from pytest_sparse_mla.implementations import flashinfer_reference
from pytest_sparse_mla.implementations._peer import lse_to_convention


def _call(sink: float) -> dict:
    """One token, one head, q = 0 (every logit 0), one valid lane of a 64-token DSV4 page."""
    gen = torch.Generator().manual_seed(5)
    cache = data.make_packed_cache(gen, fmt="dsv4", num_pages=1, page_block_size=64, page_stride="tight", form="3d")
    return {
        "q": torch.zeros((1, 1, 512), dtype=torch.bfloat16),
        "kv_cache": cache.packed,
        "indices": torch.tensor([[3, -1]], dtype=torch.int32),
        "topk_length": torch.tensor([1], dtype=torch.int32),
        "attn_sink": torch.tensor([sink], dtype=torch.float32),
        "sm_scale": 512**-0.5,
        "fmt": "dsv4",
    }


def _forward(fn, call: dict, convention: str):
    kw = {k: v for k, v in call.items() if k not in ("q", "kv_cache", "indices")}
    return fn(call["q"], call["kv_cache"], call["indices"], **kw, lse_convention=convention)


def test_removing_a_dominant_sink_from_the_fp32_lse_is_lossy(fi_reference) -> None:
    call = _call(20.0)
    compressed, _ = flashinfer_reference.references()
    page_nbytes = compressed.compressed_sparse_mla_page_nbytes(64)
    flat = torch.zeros((1, page_nbytes), dtype=torch.uint8)
    flat[0, : 64 * 584] = call["kv_cache"].reshape(-1)[: 64 * 584]
    _, lse = compressed.compressed_sparse_mla_reference(
        call["q"], flat, call["indices"], call["topk_length"], sm_scale=call["sm_scale"],
        attn_sink=call["attn_sink"], swa_page_size=64, return_lse=True,
    )  # fmt: skip
    assert lse.dtype == torch.float32 and float(lse) == 20.0  # ln(1 + e**20) rounded: the candidate is lost
    converted = lse_to_convention(lse, sink_included=True, attn_sink=call["attn_sink"], lse_convention="flashmla",
                                  lse_scale=1.0)  # fmt: skip
    assert math.isinf(float(converted))  # read as an empty row; the candidates' LSE is 0


@pytest.mark.parametrize("sink", [20.0, 1000.0, 0.0, -5.0, float("-inf")])
@pytest.mark.parametrize("convention", ["flashmla", "flashinfer"])
def test_the_lse_matches_the_oracle_whatever_the_sink(fi_reference, sink: float, convention: str) -> None:
    call = _call(sink)
    res = _forward(fi_reference.sparse_mla_forward, call, convention)
    expected = _forward(oracle_forward, call, convention)
    torch.testing.assert_close(res.output.double(), expected.output.to(torch.bfloat16).double(), atol=0, rtol=0)
    torch.testing.assert_close(res.lse.double(), expected.lse, atol=2e-6, rtol=2e-7)
    if convention == "flashmla":
        assert float(res.lse) == pytest.approx(0.0, abs=1e-6)  # one candidate of logit 0, the sink left out


def test_an_empty_row_with_a_sink_reads_as_empty_in_the_flashmla_convention(fi_reference) -> None:
    call = _call(20.0) | {"topk_length": torch.tensor([0], dtype=torch.int32)}
    res = _forward(fi_reference.sparse_mla_forward, call, "flashmla")
    assert float(res.lse) == math.inf and bool((res.output == 0).all())
