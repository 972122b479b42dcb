"""Specification of an implementation's ``pack`` and ``page_split`` (the implementation under test).

``test_formats.py``, ``test_page_split.py`` and ``test_split_buffers.py`` specify the bundled
packer and page split module by module; this file holds any implementation selected with
``--sparse-mla-impl`` that provides ``pack`` / ``page_split`` (protocol:
``pytest_sparse_mla.implementations``) to the same rules, through its own entry points:

* ``pack``: the UE8M0 scale byte of a group follows the requested ``scale_rule`` (bytes computed by
  hand below: FlashMLA ``2**ceil(log2(max(amax / 448, 1e-4)))``, deepseek-ai/FlashMLA
  ``tests/quant.py``; SGLang ``2**ceil(log2(max(amax, 1e-8) / 448))``, sgl-project/sglang
  ``python/sglang/kernels/ops/attention/dsv4/quant_k_cache.py``; byte = exponent + 127), and whole
  caches are byte-identical to the specified packer (``formats.quantize_pack``, itself specified
  with hand-computed bytes in ``test_formats.py``) on distributions whose group maxima cross the
  ``1e-4`` floor.
* ``page_split``: every 64-token page holds the source's rows (read back with
  ``formats.unpack_dequantize``, never with a split); a touched split into freshly allocated
  scratch leaves the pages it does not copy zero, because FlashInfer gathers slot 0 for masked
  candidates (SGLang PR #39288); and splits under different ``key_suffix`` values coexist, so a
  DeepSeek-V4.1 extra cache split after the SWA pool does not overwrite it
  (``shared/reference/page-split-and-history.md`` section 1.7).

The implementation receives this test's ``registry=`` (``split_buffer_registry``); one that keeps its
own buffers instead is still held to the same rules (fresh scratch is requested under a key suffix
no other test uses).
"""

from __future__ import annotations

import pytest
import torch

from pytest_sparse_mla import data, formats

# --- pack -----------------------------------------------------------------------------------------


def _one_group_row(amax: float, device: torch.device) -> torch.Tensor:
    """One DSV4 token (a ``[1, 1, 512]`` BF16 page) whose first 64-value group has maximum ``amax``."""
    row = torch.zeros(1, 1, 512)
    row[0, 0, 0] = amax
    row[0, 0, 1:64] = amax / 4
    return row.to(torch.bfloat16).to(device)


# (amax, rule, UE8M0 byte of group 0) by hand; amax values are exact in BF16.
#   flashmla: max(amax/448, 1e-4); 1e-4 lies in (2**-14, 2**-13], so the floor byte is 127-13 = 114.
#   sglang:   max(amax, 1e-8)/448; 2**-7/448 = 2**-7/(1.75*2**8) lies in (2**-16, 2**-15] -> 112;
#             0.0 -> 1e-8/448 ~ 2.2e-11 in (2**-36, 2**-35] -> 92.
KNOWN_SCALE_BYTES = [
    (0.0, "flashmla", 114),
    (2.0**-7, "flashmla", 114),  # under the floor: 2**-7/448 ~ 1.7e-5 < 1e-4
    (448.0 * 2.0**-13, "flashmla", 114),  # exactly the floor's power of two
    (1.0, "flashmla", 127 - 8),  # 1/448 in (2**-9, 2**-8]
    (448.0, "flashmla", 127),
    (0.0, "sglang", 92),
    (2.0**-7, "sglang", 112),
    (1.0, "sglang", 127 - 8),
    (448.0, "sglang", 127),
]


@pytest.mark.sparse_mla_needs("pack")
@pytest.mark.parametrize(("amax", "rule", "byte"), KNOWN_SCALE_BYTES, ids=lambda v: f"{v}")
def test_pack_writes_the_scale_byte_of_the_requested_rule(amax, rule, byte, sparse_mla_impl, sparse_mla_device):
    packed = sparse_mla_impl.pack(
        _one_group_row(amax, sparse_mla_device), "dsv4", scale_rule=rule, form="2d", page_stride="padded"
    )
    # DSV4 footer: a 1-token page holds 576 data bytes, then that token's 8 scale bytes.
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (1, 584)
    assert int(packed.reshape(-1)[576]) == byte


@pytest.mark.sparse_mla_needs("pack")
@pytest.mark.parametrize("rule", ["flashmla", "sglang"])
@pytest.mark.parametrize(
    ("fmt", "page_block_size", "stride", "form"),
    [("dsv4", 64, "padded", "nhd"), ("dsv4", 2, "tight", "3d"), ("dsv3_2", 64, "padded", "nhd")],
    ids=["dsv4-ps64-padded-nhd", "dsv4-ps2-tight-3d", "dsv3_2-ps64-padded-nhd"],
)
def test_pack_is_byte_identical_to_the_specified_packer(
    fmt, page_block_size, stride, form, rule, sparse_mla_impl, sparse_mla_generator, sparse_mla_device
):
    f = formats.get_format(fmt)
    # "wide": group maxima from 2**-24 to 2**8, across the 1e-4 floor (pytest_sparse_mla.data).
    source = data.latent((3, page_block_size, f.d_qk), sparse_mla_generator, distribution="wide",
                         device=sparse_mla_device)  # fmt: skip
    got = sparse_mla_impl.pack(source, fmt, page_stride=stride, form=form, scale_rule=rule)
    want = formats.quantize_pack(source, fmt, page_stride=stride, form=form, scale_rule=rule)
    assert got.dtype == torch.uint8 and tuple(got.shape) == tuple(want.shape)
    assert got.stride() == want.stride(), "page stride / form differ"
    layout = formats.parse_cache(want, fmt, page_block_size=page_block_size)
    got_pages = formats.page_bytes_view(got, layout)
    want_pages = formats.page_bytes_view(want, layout)
    differ = (got_pages != want_pages).nonzero()
    assert differ.numel() == 0, f"{differ.shape[0]} bytes differ, first at [page, byte] {differ[0].tolist()}"


# --- page_split -----------------------------------------------------------------------------------


def _split(impl, cache: torch.Tensor, registry, **kwargs) -> torch.Tensor:
    return impl.page_split(cache, registry=registry, **kwargs)


def _rows_of_split(out: torch.Tensor) -> torch.Tensor:
    """Dequantized rows ``[num_tokens, 512]`` of a 64-token split (flat token order)."""
    return formats.unpack_dequantize(out, "dsv4", page_block_size=64).reshape(-1, 512)


@pytest.mark.sparse_mla_needs("page_split")
@pytest.mark.parametrize("page_block_size", [128, 256])
def test_split_pages_hold_the_source_rows(
    page_block_size, sparse_mla_impl, split_buffer_registry, packed_kv_cache_factory
):
    cache = packed_kv_cache_factory(num_pages=2, page_block_size=page_block_size)
    out = _split(sparse_mla_impl, cache.packed, split_buffer_registry)
    ratio = page_block_size // 64
    assert out.dtype == torch.uint8 and tuple(out.shape) == (2 * ratio, 64, 1, 584)
    assert torch.equal(_rows_of_split(out), cache.flat_dequantized())


@pytest.mark.sparse_mla_needs("page_split")
def test_touched_split_into_fresh_scratch_leaves_untouched_pages_zero(
    sparse_mla_impl, split_buffer_registry, packed_kv_cache_factory, sparse_mla_device
):
    """Only source page 1 is touched: destination pages 0-1 (source page 0) were never written
    and must read as zero bytes, since masked candidates gather slot 0 (SGLang PR #39288)."""
    cache = packed_kv_cache_factory(num_pages=2, page_block_size=128)
    touched = torch.tensor([128 + 5, -1], dtype=torch.int32, device=sparse_mla_device)
    out = _split(sparse_mla_impl, cache.packed, split_buffer_registry,
                 touched_indices=touched, key_suffix="_fresh_zero_fill")  # fmt: skip
    untouched = out[:2]
    assert int((untouched != 0).sum()) == 0, "bytes of pages no index touched are not zero"
    assert torch.equal(_rows_of_split(out)[128:], cache.flat_dequantized()[128:])


@pytest.mark.sparse_mla_needs("page_split")
def test_splits_under_different_key_suffixes_coexist(sparse_mla_impl, split_buffer_registry, packed_kv_cache_factory):
    """DeepSeek-V4.1: the 256-token SWA pool and the 128-token extra cache are split in one call."""
    main = packed_kv_cache_factory(num_pages=1, page_block_size=256)
    extra = packed_kv_cache_factory(num_pages=1, page_block_size=128)
    out_main = _split(sparse_mla_impl, main.packed, split_buffer_registry)
    out_extra = _split(sparse_mla_impl, extra.packed, split_buffer_registry, key_suffix="_extra")
    assert torch.equal(_rows_of_split(out_main), main.flat_dequantized()), "the second split overwrote the first"
    assert torch.equal(_rows_of_split(out_extra), extra.flat_dequantized())
