"""Self-tests of the bundled page split's persistent buffers (``pytest_sparse_mla.page_split.buffers``).

They call the bundled split (both backends, ``split_pages``) and inspect its registry: keys
``flash_mla_sm120_split{key_suffix}:{device}`` / ``flash_mla_sm120_mask{key_suffix}:{device}``
(SGLang's historic keys for ``key_suffix=""``, sgl-project/sglang
``python/sglang/kernels/ops/attention/flash_mla_sm120.py``), grow-only buffers zero-filled when
(re)allocated (SGLang PR #39288) and never inference tensors (SGLang PR #35116). What any
implementation's split must do with its scratch (``key_suffix`` isolation, zeros where nothing was
copied, usable after inference mode) is the conformance suite ``suites/test_split_buffers.py``.
"""

from __future__ import annotations

import pytest
import torch

from pytest_sparse_mla import formats
from pytest_sparse_mla.page_split import (
    MASK_BUFFER_NAME,
    SPLIT_BUFFER_NAME,
    BufferRegistry,
    buffer_key,
    default_registry,
    mask_buffer_key,
    page_split,
    split_buffer_key,
)

DST_STRIDE = 37_440


def zero_pool(num_pages: int, ps: int, device: torch.device) -> torch.Tensor:
    stride = formats.page_stride_bytes("dsv4", ps, "padded")
    return torch.zeros((num_pages, stride), dtype=torch.uint8, device=device)


def split_rows(out: torch.Tensor) -> torch.Tensor:
    """Dequantized flat rows [num_tokens, 512] of a 64-token split."""
    return formats.unpack_dequantize(out, page_block_size=64).reshape(-1, 512)


# --- keys -----------------------------------------------------------------------------------------


def test_key_strings():
    assert split_buffer_key("cpu") == "flash_mla_sm120_split:cpu"
    assert mask_buffer_key("cpu") == "flash_mla_sm120_mask:cpu"
    assert split_buffer_key(torch.device("cuda", 1)) == "flash_mla_sm120_split:cuda:1"
    assert mask_buffer_key(torch.device("cuda", 0), "_extra") == "flash_mla_sm120_mask_extra:cuda:0"
    assert buffer_key("scratch", "cpu", "_v41") == "scratch_v41:cpu"


@pytest.mark.parametrize(
    "key_suffix, expected",
    [
        ("", ("flash_mla_sm120_mask:{dev}", "flash_mla_sm120_split:{dev}")),
        ("_extra", ("flash_mla_sm120_mask_extra:{dev}", "flash_mla_sm120_split_extra:{dev}")),
    ],
    ids=["default", "extra"],
)
def test_split_uses_the_historic_keys(key_suffix, expected, split_pages, split_buffer_registry, sparse_mla_device):
    pool = zero_pool(1, 128, sparse_mla_device)
    idx = torch.tensor([0], dtype=torch.int32, device=sparse_mla_device)
    split_pages(formats.as_form(pool, "dsv4", 128, "nhd"), touched_indices=idx, key_suffix=key_suffix)
    dev = str(pool.device)  # "cpu" or "cuda:<index>"
    assert split_buffer_registry.keys() == [e.format(dev=dev) for e in expected]


# --- key_suffix isolation -------------------------------------------------------------------------


@pytest.fixture
def main_and_extra(packed_kv_cache_factory):
    """A 1-page 256-token main (SWA) cache and a 1-page 128-token extra cache (DeepSeek-V4.1)."""
    return (
        packed_kv_cache_factory(num_pages=1, page_block_size=256),
        packed_kv_cache_factory(num_pages=1, page_block_size=128),
    )


def test_second_split_under_the_same_key_clobbers_the_first(main_and_extra, split_pages):
    """Why the suffix exists: without one, the extra cache's split lands on the main split's pages."""
    main, extra = main_and_extra
    out_main = split_pages(main.packed)  # 4 destination pages = 256 tokens
    assert torch.equal(split_rows(out_main), main.flat_dequantized())

    out_extra = split_pages(extra.packed)  # same key: a prefix of the same buffer, 2 pages

    assert out_extra.data_ptr() == out_main.data_ptr()
    changed = (split_rows(out_main) != main.flat_dequantized()).any(dim=-1)
    # Independent count: the extra split's 128 tokens land on main's destination pages 0-1, i.e.
    # main tokens 0..127; such a token changes iff its row differs from the extra token's row.
    expected = (main.flat_dequantized()[:128] != extra.flat_dequantized()).any(dim=-1)
    assert int(expected.sum()) == 128  # random rows never coincide
    assert int(changed.sum()) == int(expected.sum())
    assert torch.equal(changed[:128], expected)
    assert not bool(changed[128:].any())


# --- allocation rules -----------------------------------------------------------------------------


def test_buffers_are_grow_only_and_reused(split_pages, split_buffer_registry, sparse_mla_device):
    key = split_buffer_key(sparse_mla_device)
    pool = zero_pool(4, 128, sparse_mla_device)
    view = lambda n: formats.as_form(pool[:n], "dsv4", 128, "nhd")  # noqa: E731

    first = split_pages(view(3))
    smaller = split_pages(view(2))
    assert smaller.data_ptr() == first.data_ptr()
    assert smaller.shape[0] == 4
    grown = split_pages(view(4))
    assert grown.shape[0] == 8
    assert [(k, s) for k, s, _ in split_buffer_registry.allocation_log] == [
        (key, (6, DST_STRIDE)),
        (key, (8, DST_STRIDE)),
    ]
    assert split_buffer_registry.lookup(SPLIT_BUFFER_NAME, pool.device).shape == (8, DST_STRIDE)


def test_registry_zero_fills_new_and_grown_buffers(split_buffer_registry, sparse_mla_device):
    reg = split_buffer_registry
    buf = reg.get("scratch", sparse_mla_device, (2, 16), torch.uint8)
    assert bool((buf == 0).all())
    buf.fill_(0xFF)
    reused = reg.get("scratch", sparse_mla_device, (1, 16), torch.uint8)
    assert bool((reused == 0xFF).all())  # reuse keeps contents: only allocation zero-fills
    grown = reg.get("scratch", sparse_mla_device, (3, 16), torch.uint8)
    assert grown.shape == (3, 16) and bool((grown == 0).all())
    reshaped = reg.get("scratch", sparse_mla_device, (3, 8), torch.uint8)
    assert bool((reshaped == 0).all())


def test_grown_split_buffer_is_zero_where_the_mask_copies_nothing(
    split_pages, split_buffer_registry, sparse_mla_generator, sparse_mla_device
):
    """FlashInfer gathers slot 0 (destination page 0) for -1 candidates: it must hold zeros, not
    stale or uninitialised bytes, when page 0 is not marked (SGLang PR #39288)."""
    small = zero_pool(1, 128, sparse_mla_device)
    split_pages(formats.as_form(small, "dsv4", 128, "nhd"))
    split_buffer_registry.lookup(SPLIT_BUFFER_NAME, small.device).fill_(0xFF)

    pool = torch.randint(1, 256, (3, 74_880), generator=sparse_mla_generator, dtype=torch.uint8).to(sparse_mla_device)
    idx = torch.tensor([2 * 128 + 1, -1], dtype=torch.int64, device=sparse_mla_device)
    out = split_pages(formats.as_form(pool, "dsv4", 128, "nhd"), touched_indices=idx)

    dst = split_buffer_registry.lookup(SPLIT_BUFFER_NAME, pool.device)
    assert dst.shape == (6, DST_STRIDE) and out.data_ptr() == dst.data_ptr()
    assert bool((dst[:4] == 0).all())  # pages of source pages 0 and 1: untouched zeros
    assert bool((dst[4:, :36_864] != 0).all())  # page 2 copied (source bytes are 1..255)


def test_buffers_made_under_inference_mode_are_normal_tensors(split_pages, split_buffer_registry, sparse_mla_device):
    pool = zero_pool(2, 128, sparse_mla_device)
    cache = formats.as_form(pool, "dsv4", 128, "nhd")
    idx = torch.tensor([5], dtype=torch.int32, device=sparse_mla_device)
    with torch.inference_mode():
        split_pages(cache, touched_indices=idx)
    buffers = [split_buffer_registry.lookup(n, pool.device) for n in (SPLIT_BUFFER_NAME, MASK_BUFFER_NAME)]
    assert [b.is_inference() for b in buffers] == [False, False]
    # Outside inference mode the in-place mask zeroing and copies must work (they raise
    # "Inplace update to inference tensor outside InferenceMode" on an inference tensor).
    split_pages(cache, touched_indices=idx + 128)
    assert buffers[1].tolist() == [0, 1]
    buffers[0].zero_()


@pytest.mark.parametrize("run", [0, 1])
def test_each_test_gets_a_fresh_registry(run, split_buffer_registry, split_pages, sparse_mla_device):
    assert len(split_buffer_registry) == 0 and split_buffer_registry.allocation_log == []
    split_pages(formats.as_form(zero_pool(1, 256, sparse_mla_device), "dsv4", 256, "nhd"))
    assert len(split_buffer_registry) == 1


def test_registry_none_uses_the_process_default(sparse_mla_device):
    suffix = "_default_registry_probe"
    pool = zero_pool(1, 128, sparse_mla_device)
    try:
        out = page_split(formats.as_form(pool, "dsv4", 128, "nhd"), key_suffix=suffix)
        buf = default_registry().lookup(SPLIT_BUFFER_NAME, pool.device, key_suffix=suffix)
        assert buf is not None and buf.data_ptr() == out.data_ptr()
    finally:
        default_registry().discard(SPLIT_BUFFER_NAME, pool.device, key_suffix=suffix)
    assert default_registry().lookup(SPLIT_BUFFER_NAME, pool.device, key_suffix=suffix) is None


def test_registry_rejects_bad_buffers_and_keys(sparse_mla_device):
    reg = BufferRegistry()
    with pytest.raises(ValueError, match=r"key_suffix='x:y': must not contain ':'"):
        reg.get(SPLIT_BUFFER_NAME, sparse_mla_device, (1, 8), key_suffix="x:y")
    with pytest.raises(ValueError, match=r"name='a:b': must not contain ':'"):
        buffer_key("a:b", "cpu")
    with pytest.raises(ValueError, match=r"shape=\(\): expected \(rows, \*row_shape\)"):
        reg.get(SPLIT_BUFFER_NAME, sparse_mla_device, ())
    with pytest.raises(ValueError, match=r"buffer\.stride\(\)=\(1, 4\): expected contiguous rows"):
        reg.install("x", sparse_mla_device, torch.zeros(4, 4, device=sparse_mla_device).t())
    with torch.inference_mode():
        frozen = torch.zeros(4, device=sparse_mla_device)
    with pytest.raises(ValueError, match=r"inference tensor"):
        reg.install("x", sparse_mla_device, frozen)
    with pytest.raises(ValueError, match=r"buffer\.device=meta: expected"):
        reg.install("x", sparse_mla_device, torch.zeros(4, device="meta"))
    assert len(reg) == 0
