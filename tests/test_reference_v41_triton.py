"""The bundled reference's Triton forward on DeepSeek-V4.1 records (``fmt="dsv4_1"``, ``"dsv4_1_swa"``,
``"dsv4_1_indexed"``): the candidates gathered and dequantized by torch operations
(``_triton_forward.gather_records``), then the DSV4 attention kernel (CUDA; interpreted on the CPU).

* the gathered rows are ``formats.unpack_dequantize`` of their tokens, bit for bit, for every byte
  value of the codes and scales (E2M1 decoded arithmetically, so nothing is copied from the host);
* the batch (a token alone against the same token in a batch) and the caches' tensor form give the
  same bits (the oracle, ``-1`` padding, head count and split launches: ``test_attention_reference.py``,
  whose Triton tests take the V4.1 formats too);
* ``backend=None`` picks it on CUDA (the torch loop stays the CPU default: the golden snapshots).
"""

from __future__ import annotations

import pytest
import torch
from test_attention_reference import _triton_or_skip  # within tight of the oracle: _TRITON_CASES there

from pytest_sparse_mla import formats
from pytest_sparse_mla.attention import sparse_mla_forward
from pytest_sparse_mla.attention.cases import AttentionCase, CacheCase, Conventions
from pytest_sparse_mla.parametrize import inputs_on


def _pages(cache: torch.Tensor) -> torch.Tensor:
    """The ``[num_pages, page_stride]`` page buffer under a packed cache (``formats.as_form``'s input)."""
    return torch.as_strided(cache, (int(cache.shape[0]), cache.stride(0)), (cache.stride(0), 1), cache.storage_offset())


@pytest.mark.parametrize("fmt", ["dsv4_1_swa", "dsv4_1_indexed"])
def test_gathered_records_are_unpack_dequantize_bit_for_bit(fmt, sparse_mla_generator, sparse_mla_device):
    from pytest_sparse_mla.attention.reference import triton_forward_module

    _triton_or_skip(sparse_mla_device)
    module = triton_forward_module()
    f = formats.get_format(fmt)
    ps, pages = 4, 96
    # Every byte value in the codes; scales drawn among finite positive values (the packers' range).
    cache = torch.randint(0, 256, (pages, ps, f.bytes_per_token), generator=sparse_mla_generator, dtype=torch.uint8)
    cache[0, 0, :256] = torch.arange(256, dtype=torch.uint8)  # codes of token 0 (both formats: >= 256 code bytes)
    scales = cache[..., f.code_bytes_per_token : f.code_bytes_per_token + f.scale_bytes_per_token]
    if f.scale_kind == "ue8m0":
        scales.copy_(scales.clamp(100, 150))
    else:
        scales.copy_(scales % 0x70 + 0x08)  # E4M3 0x08..0x77: positive normals
    cache = cache.to(sparse_mla_device)
    layout = formats.parse_cache(cache, f)
    table = formats.unpack_dequantize(cache, layout=layout).reshape(pages * ps, 512)
    indices = torch.randint(-2, pages * ps + 3, (5, 77), generator=sparse_mla_generator, dtype=torch.int32)
    indices = indices.to(sparse_mla_device)
    out = torch.full((5, 77, 512), float("nan"), dtype=torch.bfloat16, device=sparse_mla_device)
    module.gather_records(cache, layout, indices, out)
    ok = (indices >= 0) & (indices < pages * ps)
    expected = torch.where(ok[..., None], table[indices.clamp(0, pages * ps - 1).long()], 0.0)
    nan = torch.isnan(expected)  # E4M3 codes 0x7F / 0xFF (the SWA codes): NaN, as unpack_dequantize
    assert bool(nan.any()) == (fmt == "dsv4_1_swa")
    finite = expected.masked_fill(nan, 0.0)
    assert torch.equal(finite.to(torch.bfloat16).float(), finite)  # BF16 numbers
    assert torch.equal(torch.isnan(out.float()), nan) and torch.equal(out.float().masked_fill(nan, 0.0), finite)
    signs = torch.signbit(out.float()) == torch.signbit(expected)  # -0.0 (E2M1 code 8) kept
    assert bool((signs | nan).all())


def test_triton_v41_batch_and_layout_are_bitwise_neutral(sparse_mla_generator, sparse_mla_device):
    """A token alone and the caches in other forms give the same bits (padding and head count:
    ``test_attention_reference.py::test_triton_backend_padding_and_head_count_are_bitwise_neutral``)."""
    _triton_or_skip(sparse_mla_device)
    case = AttentionCase("v41-inv", 3, 24, CacheCase(64, masked_fraction=0.25),
                         extra=CacheCase(64, page_block_size=2, num_pages=64),
                         conventions=Conventions("dsv4_1"))  # fmt: skip
    inputs = inputs_on(case, sparse_mla_generator, sparse_mla_device)
    base = inputs.run(sparse_mla_forward, backend="triton")
    one = sparse_mla_forward(
        inputs.q[1:2], inputs.cache.packed, inputs.indices[1:2],
        **inputs.kwargs(extra_indices=inputs.extra_indices[1:2]), backend="triton",
    )  # fmt: skip
    assert torch.equal(one.output, base.output[1:2]) and torch.equal(one.lse, base.lse[1:2])
    main = formats.as_form(_pages(inputs.cache.packed), "dsv4_1_swa", inputs.cache.page_block_size, "2d")
    extra = formats.as_form(_pages(inputs.extra.packed), "dsv4_1_indexed", 2, "hnd")
    other = sparse_mla_forward(
        inputs.q, main, inputs.indices, **inputs.kwargs(extra_kv_cache=extra), backend="triton"
    )
    assert torch.equal(other.output, base.output) and torch.equal(other.lse, base.lse)


def test_v41_backend_default(sparse_mla_generator, sparse_mla_device):
    """``backend=None``: the Triton forward on CUDA, the torch loop on the CPU (bit for bit the
    explicit backend either way)."""
    from pytest_sparse_mla.attention.reference import resolve_backend

    case = AttentionCase("v41-default", 2, 8, CacheCase(64), conventions=Conventions("dsv4_1"))
    inputs = inputs_on(case, sparse_mla_generator, sparse_mla_device)
    res = inputs.run(sparse_mla_forward)
    same = inputs.run(sparse_mla_forward, backend=resolve_backend(None, sparse_mla_device))
    assert torch.equal(res.output, same.output) and torch.equal(res.lse, same.lse)


def test_v41_rejects_out_of_range_indices_on_triton(sparse_mla_generator, sparse_mla_device):
    _triton_or_skip(sparse_mla_device)
    case = AttentionCase("v41-oob", 2, 8, CacheCase(64, topk_length=32),
                         extra=CacheCase(64, page_block_size=2, num_pages=64, topk_length=32),
                         conventions=Conventions("dsv4_1"))  # fmt: skip
    inputs = inputs_on(case, sparse_mla_generator, sparse_mla_device)
    inputs.extra_indices[1, 5] = inputs.extra.num_tokens
    res = inputs.run(sparse_mla_forward, backend="triton", check_indices=False)
    assert res.out_of_range.tolist() == [0, 1]
    with pytest.raises(ValueError, match=r"extra_indices\[1, 5\]=.* is out of range"):
        inputs.run(sparse_mla_forward, backend="triton")
