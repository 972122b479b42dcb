"""Conformance of an implementation's page-split scratch: what its persistent destination must hold.

Every test calls the selected implementation's ``page_split`` (protocol:
``pytest_sparse_mla.implementations``) with this test's fresh ``registry=`` and is skipped when it
has none. The rules, each from a serving bug:

* Splits under different ``key_suffix`` values coexist: DeepSeek-V4.1 splits the 128-token extra
  cache right after the 256-token SWA pool for one attention call, and a shared destination makes
  the second split overwrite the first (the downstream ``buf_tag`` patch of SGLang's
  ``flash_mla_sm120.py``, sgl-project/sglang ``python/sglang/kernels/ops/attention/flash_mla_sm120.py``).
* Destination pages no split has written read as zero bytes, on the first call and after the
  destination grows: FlashInfer gathers slot 0 for masked (-1) candidates and multiplies it by a zero
  probability, so uninitialised bytes (NaN codes or scales) would turn into NaN outputs (SGLang PR
  #39288).
* A destination first made under ``torch.inference_mode()`` (a serving warm-up) still works outside
  it: an inference tensor refuses in-place updates there (SGLang PR #35116).

Expected rows are read from the source with ``formats.unpack_dequantize`` (never from a split).
"""

from __future__ import annotations

import pytest
import torch

from pytest_sparse_mla import formats

pytestmark = pytest.mark.sparse_mla_needs("page_split")

DATA_AND_FOOTER = 37_376  # bytes of one 64-token destination page (data, then the scale footer)


def split_rows(out: torch.Tensor) -> torch.Tensor:
    """Dequantized flat rows [num_tokens, 512] of a 64-token split."""
    return formats.unpack_dequantize(out, page_block_size=64).reshape(-1, 512)


def page_bytes(out: torch.Tensor) -> torch.Tensor:
    """``[num_pages, 37376]`` bytes of a ``[N, 64, 1, 584]`` split, read through the view."""
    return out.reshape(out.shape[0], DATA_AND_FOOTER)


@pytest.fixture
def main_and_extra(packed_kv_cache_factory):  # type: ignore[no-untyped-def]
    """A 1-page 256-token main (SWA) cache and a 1-page 128-token extra cache (DeepSeek-V4.1)."""
    return (
        packed_kv_cache_factory(num_pages=1, page_block_size=256),
        packed_kv_cache_factory(num_pages=1, page_block_size=128),
    )


@pytest.mark.parametrize("touched", [False, True], ids=["full", "touched"])
def test_splits_under_different_key_suffixes_coexist(touched, main_and_extra, sparse_mla_impl, split_buffer_registry):
    main, extra = main_and_extra
    device = main.packed.device
    main_idx = extra_idx = None
    if touched:
        main_idx = torch.tensor([3], dtype=torch.int32, device=device)
        extra_idx = torch.tensor([100], dtype=torch.int32, device=device)
    out_main = sparse_mla_impl.page_split(main.packed, touched_indices=main_idx, registry=split_buffer_registry)
    before = out_main.clone()

    out_extra = sparse_mla_impl.page_split(
        extra.packed, key_suffix="_extra", touched_indices=extra_idx, registry=split_buffer_registry
    )

    assert torch.equal(out_main, before), "the split under key_suffix='_extra' overwrote the first split"
    assert torch.equal(split_rows(out_main), main.flat_dequantized())
    assert torch.equal(split_rows(out_extra), extra.flat_dequantized())


def test_touched_split_into_fresh_scratch_leaves_untouched_pages_zero(
    sparse_mla_impl, split_buffer_registry, packed_kv_cache_factory, sparse_mla_device
):
    """Only source page 1 of 2 is touched: destination pages 0-1 (source page 0) were never
    written and must read as zero bytes."""
    cache = packed_kv_cache_factory(num_pages=2, page_block_size=128)
    touched = torch.tensor([128 + 5, -1], dtype=torch.int32, device=sparse_mla_device)
    out = sparse_mla_impl.page_split(
        cache.packed, touched_indices=touched, key_suffix="_fresh_zero_fill", registry=split_buffer_registry
    )
    assert int((page_bytes(out)[:2] != 0).sum()) == 0, "bytes of pages no index touched are not zero"
    assert torch.equal(split_rows(out)[128:], cache.flat_dequantized()[128:])


def test_grown_destination_is_zero_where_no_split_wrote(
    sparse_mla_impl, split_buffer_registry, packed_kv_cache_factory, sparse_mla_device
):
    """A 1-page split writes destination pages 0-1; a touched split of a 3-page pool then copies
    source page 2 (pages 4-5). Pages 2-3 were never written by any split and must be zero; pages
    0-1 may hold zeros or the first split's bytes (both are finite cache rows)."""
    small = packed_kv_cache_factory(num_pages=1, page_block_size=128)
    out_small = sparse_mla_impl.page_split(small.packed, registry=split_buffer_registry)
    first_bytes = page_bytes(out_small).clone()

    pool = packed_kv_cache_factory(num_pages=3, page_block_size=128)
    idx = torch.tensor([2 * 128 + 1, -1], dtype=torch.int64, device=sparse_mla_device)
    out = sparse_mla_impl.page_split(pool.packed, touched_indices=idx, registry=split_buffer_registry)

    got = page_bytes(out)
    assert tuple(out.shape) == (6, 64, 1, 584)
    assert int((got[2:4] != 0).sum()) == 0, "pages no split ever wrote are not zero after the destination grew"
    for page in (0, 1):
        assert bool((got[page] == 0).all()) or torch.equal(got[page], first_bytes[page]), (
            f"destination page {page} holds neither zeros nor the previous split's bytes"
        )
    assert torch.equal(split_rows(out)[256:], pool.flat_dequantized()[256:])


def test_destination_made_under_inference_mode_works_outside_it(
    sparse_mla_impl, split_buffer_registry, packed_kv_cache_factory, sparse_mla_device
):
    cache = packed_kv_cache_factory(num_pages=2, page_block_size=128)
    idx = torch.tensor([5], dtype=torch.int32, device=sparse_mla_device)
    with torch.inference_mode():
        warm = sparse_mla_impl.page_split(cache.packed, touched_indices=idx, registry=split_buffer_registry)
    assert not warm.is_inference(), "the persistent destination is an inference tensor"
    # Outside inference mode the next split updates the same scratch in place.
    out = sparse_mla_impl.page_split(cache.packed, touched_indices=idx + 128, registry=split_buffer_registry)
    assert torch.equal(split_rows(out)[128:], cache.flat_dequantized()[128:])
    out = sparse_mla_impl.page_split(cache.packed, registry=split_buffer_registry)
    assert torch.equal(split_rows(out), cache.flat_dequantized())
