"""Readable torch reference of the page split, the touched-page mark and the inverse merge.

Views only: every function works on strided uint8 views of the caller's buffers and never reads a
tensor value on the host, so it runs on CPU and CUDA without a device-to-host sync.
"""

from __future__ import annotations

import torch

from pytest_sparse_mla.page_split.geometry import (
    DST_PAGE_BYTES,
    SUB_PAGE_DATA_BYTES,
    SplitSource,
)

__all__ = ["source_sub_pages", "dest_sub_pages", "mark_touched_pages", "copy_sub_pages"]


def source_sub_pages(pages: torch.Tensor, src_page_block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(data [P, ratio, 36864], scales [P, ratio, 512])`` of ``[P, ps*584]`` source pages.

    Sub-page ``s`` of page ``p`` owns data bytes ``[s*36864, (s+1)*36864)`` and footer bytes
    ``[ps*576 + s*512, +512)`` of that page (``formats`` module docstring: footer at ``ps*576``).
    """
    ratio = src_page_block_size // 64
    footer = src_page_block_size * 576
    data = torch.unflatten(pages[:, :footer], 1, (ratio, SUB_PAGE_DATA_BYTES))
    scales = torch.unflatten(pages[:, footer : src_page_block_size * 584], 1, (ratio, -1))
    return data, scales


def dest_sub_pages(dst: torch.Tensor, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(data [P, ratio, 36864], scales [P, ratio, 512])`` of ``[P*ratio, stride]`` pages.

    Destination page ``p*ratio + s`` holds data at bytes ``[0, 36864)`` and the footer at
    ``[36864, 37376)``; bytes ``[37376, stride)`` (the alignment tail) are not part of either view.
    """
    data = torch.unflatten(dst[:, :SUB_PAGE_DATA_BYTES], 0, (-1, ratio))
    scales = torch.unflatten(dst[:, SUB_PAGE_DATA_BYTES:DST_PAGE_BYTES], 0, (-1, ratio))
    return data, scales


def mark_touched_pages(indices: torch.Tensor, mask: torch.Tensor, src_page_block_size: int) -> None:
    """Zero ``mask`` ([P] int8), then set ``mask[t // ps] = 1`` for every index ``0 <= t < P*ps``.

    Negative indices and indices past the pool mark nothing. Sync-free: invalid entries are
    routed to a spare slot ``P`` of a temporary instead of being filtered on the host.
    """
    num_pages = mask.shape[0]
    idx = indices.reshape(-1).to(torch.int64)
    valid = (idx >= 0) & (idx < num_pages * src_page_block_size)
    page = torch.where(valid, torch.div(idx, src_page_block_size, rounding_mode="floor"), num_pages)
    hits = torch.zeros(num_pages + 1, dtype=mask.dtype, device=mask.device)
    hits.index_fill_(0, page, 1)
    mask.zero_()
    mask.copy_(hits[:num_pages])


def copy_sub_pages(source: SplitSource, dst: torch.Tensor, mask: torch.Tensor | None) -> None:
    """Copy every (marked) sub-page's data and footer bytes of ``source`` into ``dst``.

    Args:
        source: the validated source.
        dst: ``[P*ratio, dst_page_stride]`` uint8 destination rows (alignment tails not written).
        mask: ``[P]`` int8 (non-zero = copy that source page's sub-pages) or ``None`` (all).
    """
    src_data, src_scales = source_sub_pages(source.pages, source.src_page_block_size)
    dst_data, dst_scales = dest_sub_pages(dst, source.ratio)
    if mask is None:
        dst_data.copy_(src_data)
        dst_scales.copy_(src_scales)
        return
    keep = (mask != 0).view(-1, 1, 1)
    dst_data.copy_(torch.where(keep, src_data, dst_data))
    dst_scales.copy_(torch.where(keep, src_scales, dst_scales))


def merge_sub_pages(split_pages: torch.Tensor, out_pages: torch.Tensor, src_page_block_size: int) -> None:
    """Inverse copy: ``[P*ratio, 37376]`` 64-token page bytes into ``[P, ps*584]`` source pages."""
    ratio = src_page_block_size // 64
    out_data, out_scales = source_sub_pages(out_pages, src_page_block_size)
    in_data, in_scales = dest_sub_pages(split_pages, ratio)
    out_data.copy_(in_data)
    out_scales.copy_(in_scales)
