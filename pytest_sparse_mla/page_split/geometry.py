"""Byte geometry of the 64-token page split: constants, validated source description, offsets.

Everything here is plain Python/torch metadata work: nothing allocates a page buffer, nothing
reads tensor values, so nothing synchronises with a GPU. The byte rules of a DSV4 page come from
:mod:`pytest_sparse_mla.formats` (data rows ``[0, ps*576)``, scale footer ``[ps*576, ps*584)``);
this module only derives the split's sub-page arithmetic from them
(sgl-project/sglang ``python/sglang/kernels/ops/attention/flash_mla_sm120.py``
``_split_kv_pages_to_64``, PR #27455).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from pytest_sparse_mla import formats

__all__ = [
    "DST_PAGE_BLOCK_SIZE",
    "SUB_PAGE_DATA_BYTES",
    "SUB_PAGE_SCALE_BYTES",
    "DST_PAGE_BYTES",
    "DST_PAGE_STRIDE",
    "SplitSource",
    "SplitOffsets",
    "parse_split_source",
    "check_dst_page_stride",
    "check_src_page_block_size",
    "split_offsets",
]

_F = formats.DSV4

#: Tokens per destination page: the page size FlashInfer's SM120 DSV4 kernels are built for.
DST_PAGE_BLOCK_SIZE: int = 64
#: Data bytes of one 64-token sub-page: 64 * 576 = 36,864.
SUB_PAGE_DATA_BYTES: int = DST_PAGE_BLOCK_SIZE * _F.data_bytes_per_token
#: Scale-footer bytes of one 64-token sub-page: 64 * 8 = 512.
SUB_PAGE_SCALE_BYTES: int = DST_PAGE_BLOCK_SIZE * _F.scale_bytes_per_token
#: Bytes of a destination page that the split writes: 36,864 + 512 = 37,376 (= 64 * 584).
DST_PAGE_BYTES: int = SUB_PAGE_DATA_BYTES + SUB_PAGE_SCALE_BYTES
#: Default destination page stride: the FlashMLA/SGLang padded stride, ceil(37,376/576)*576 = 37,440.
DST_PAGE_STRIDE: int = formats.page_stride_bytes(_F, DST_PAGE_BLOCK_SIZE, "padded")


@dataclass(frozen=True)
class SplitSource:
    """A validated DSV4 source cache, as :func:`parse_split_source` describes it.

    Attributes:
        layout: the :class:`formats.CacheLayout` of the (possibly re-viewed) source.
        pages: ``[num_src_pages, src_page_block_size*584]`` uint8 view of the bytes of every source
            page that hold data (shares storage with the cache, keeps its page stride).
        ratio: ``src_page_block_size // 64`` destination pages per source page.
    """

    layout: formats.CacheLayout
    pages: torch.Tensor
    ratio: int

    @property
    def num_src_pages(self) -> int:
        """Source pages ``P``."""
        return self.layout.num_pages

    @property
    def src_page_block_size(self) -> int:
        """Tokens per source page (a multiple of 64)."""
        return self.layout.page_block_size

    @property
    def src_page_stride(self) -> int:
        """Bytes between consecutive source pages (``stride(0)``)."""
        return self.layout.page_stride

    @property
    def num_dst_pages(self) -> int:
        """Destination pages ``P * ratio``."""
        return self.layout.num_pages * self.ratio

    @property
    def device(self) -> torch.device:
        """Device of the source bytes."""
        return self.pages.device


def check_src_page_block_size(value: object) -> int:
    """Validate tokens per source page: a positive multiple of 64; return it.

    Raises:
        TypeError: not an int. ValueError: not a positive multiple of 64.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"src_page_block_size={value!r}: expected a positive int multiple of "
            f"{DST_PAGE_BLOCK_SIZE} (tokens per source page)"
        )
    if value <= 0 or value % DST_PAGE_BLOCK_SIZE:
        raise ValueError(
            f"src_page_block_size={value}: expected a positive multiple of {DST_PAGE_BLOCK_SIZE} "
            f"tokens (the split cuts source pages into {DST_PAGE_BLOCK_SIZE}-token pages)"
        )
    return value


def parse_split_source(kv_cache: torch.Tensor, src_page_block_size: int | None = None) -> SplitSource:
    """Validate a DSV4 packed cache for the split and describe it.

    Accepted forms (page size read as FlashInfer reads it, ``formats.parse_cache``):

    * 2-D ``[P, W]`` uint8 page buffer: ``src_page_block_size`` is **required** (SGLang passes it
      explicitly for 2-D buffers). ``W`` must be ``ps*584`` (FlashInfer's 2-D form) or the padded
      page stride ``ceil(ps*584/576)*576`` (an SGLang raw page buffer, e.g. ``[P, 149760]`` for
      ps 256; amdpilot-org/sglang ``test_flash_mla_sm120_page_split.py``).
    * 3-D ``[P, ps, 584]``, NHD ``[P, ps, 1, 584]`` (ps = ``shape[1]``) and HND ``[P, 1, ps, 584]``
      (ps = ``shape[2]``): ``src_page_block_size`` is optional and must agree with the shape. An HND
      view read SGLang's way (``shape[1]``) gives 1 and is rejected by that agreement check; a 4-D
      tensor without a singleton KV-head axis is rejected because its page size is undescribable.

    Args:
        kv_cache: the source cache (uint8; view FP8 caches with ``.view(torch.uint8)`` first).
        src_page_block_size: tokens per source page, a multiple of 64.

    Returns:
        A :class:`SplitSource`.

    Raises:
        TypeError: ``kv_cache`` not a uint8 tensor; ``src_page_block_size`` not an int.
        ValueError: page size not a positive multiple of 64, missing for 2-D, disagreeing with the
            shape; a 2-D width other than ``ps*584`` or the padded stride; any layout error of
            ``formats.parse_cache`` (strides, alignment, 4-D without a singleton head axis).
    """
    if src_page_block_size is not None:
        check_src_page_block_size(src_page_block_size)
    cache = kv_cache
    if isinstance(kv_cache, torch.Tensor) and kv_cache.dtype == torch.uint8 and kv_cache.dim() == 2:
        if src_page_block_size is None:
            raise ValueError(
                f"src_page_block_size=None: required for a 2-D kv_cache "
                f"(shape {tuple(kv_cache.shape)}); pass the tokens per source page, e.g. 256"
            )
        ps = src_page_block_size
        logical = ps * _F.bytes_per_token
        padded = formats.page_stride_bytes(_F, ps, "padded")
        width = int(kv_cache.shape[1])
        if width not in (logical, padded):
            raise ValueError(
                f"kv_cache.shape[1]={width}: a 2-D DSV4 cache of src_page_block_size={ps} must be "
                f"{logical} bytes wide (ps*584) or {padded} (the padded page stride)"
            )
        if width != logical:
            if kv_cache.stride(1) != 1:
                raise ValueError(f"kv_cache.stride(1)={kv_cache.stride(1)}: the last dim must be contiguous")
            cache = torch.as_strided(
                kv_cache,
                (kv_cache.shape[0], logical),
                (kv_cache.stride(0), 1),
                kv_cache.storage_offset(),
            )
    layout = formats.parse_cache(cache, _F, page_block_size=src_page_block_size)
    check_src_page_block_size(layout.page_block_size)
    pages = formats.page_bytes_view(cache, layout)
    return SplitSource(layout, pages, layout.page_block_size // DST_PAGE_BLOCK_SIZE)


def check_dst_page_stride(dst_page_stride: object) -> int:
    """Validate a destination page stride in bytes (default :data:`DST_PAGE_STRIDE` = 37,440).

    FlashInfer SM120 needs ``stride(0) >= 64*584 = 37,376`` and a multiple of 16
    (``csrc/sparse_mla_sm120/attention_validation.h`` ``parse_paged_kv_layout``).

    Raises:
        TypeError: not an int. ValueError: below 37,376 or not a multiple of 16.
    """
    if isinstance(dst_page_stride, bool) or not isinstance(dst_page_stride, int):
        raise TypeError(f"dst_page_stride={dst_page_stride!r}: expected an int byte count")
    try:  # the stride rule itself lives in formats (one rule for every DSV4 page stride)
        return formats.page_stride_bytes(formats.DSV4, DST_PAGE_BLOCK_SIZE, dst_page_stride)
    except ValueError:
        raise ValueError(
            f"dst_page_stride={dst_page_stride}: expected a multiple of 16 bytes that is >= "
            f"{DST_PAGE_BYTES} (64 tokens * 584 bytes)"
        ) from None


class SplitOffsets(NamedTuple):
    """Byte offsets of one (source page, sub-page) copy, as Python ints (no overflow).

    Attributes:
        dst_page: destination page index ``src_page * ratio + sub``.
        src_data: first byte of the sub-page's 36,864 data bytes, from the source base pointer.
        src_scale: first byte of its 512 scale-footer bytes, from the source base pointer.
        dst_data: first byte of the destination page (its data rows), from the destination base.
        dst_scale: first byte of the destination footer (``dst_data + 36,864``).
    """

    dst_page: int
    src_data: int
    src_scale: int
    dst_data: int
    dst_scale: int


def split_offsets(
    src_page: int,
    sub: int,
    *,
    src_page_block_size: int,
    src_page_stride: int,
    dst_page_stride: int = DST_PAGE_STRIDE,
) -> SplitOffsets:
    """The byte offsets the split copies for source page ``src_page``, sub-page ``sub``.

    ``ratio = src_page_block_size // 64``; ``dst_page = src_page*ratio + sub``;
    ``src_data = src_page*src_page_stride + sub*36,864``;
    ``src_scale = src_page*src_page_stride + src_page_block_size*576 + sub*512``;
    ``dst_data = dst_page*dst_page_stride``; ``dst_scale = dst_data + 36,864``.
    Both kernels compute exactly these offsets (the Triton kernel in 8-byte lanes with int64
    arithmetic: :func:`pytest_sparse_mla.page_split._triton.probe_offsets` runs the kernel's own
    offset function). Python ints never wrap, so this is the oracle for pools past ``2**31`` bytes
    (SGLang issue #34025 / PR #34027).

    Raises:
        TypeError, ValueError: bad page size; ``src_page`` < 0; ``sub`` outside ``[0, ratio)``;
            a stride that is not a positive int.
    """
    ps = check_src_page_block_size(src_page_block_size)
    ratio = ps // DST_PAGE_BLOCK_SIZE
    for name, value in (("src_page_stride", src_page_stride), ("dst_page_stride", dst_page_stride)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r}: expected a positive int byte count")
    if isinstance(src_page, bool) or not isinstance(src_page, int) or src_page < 0:
        raise ValueError(f"src_page={src_page!r}: expected a non-negative int")
    if isinstance(sub, bool) or not isinstance(sub, int) or not 0 <= sub < ratio:
        raise ValueError(f"sub={sub!r}: expected an int in [0, {ratio}) for ratio {ratio}")
    dst_page = src_page * ratio + sub
    src_base = src_page * src_page_stride
    dst_data = dst_page * dst_page_stride
    return SplitOffsets(
        dst_page=dst_page,
        src_data=src_base + sub * SUB_PAGE_DATA_BYTES,
        src_scale=src_base + ps * _F.data_bytes_per_token + sub * SUB_PAGE_SCALE_BYTES,
        dst_data=dst_data,
        dst_scale=dst_data + SUB_PAGE_DATA_BYTES,
    )
