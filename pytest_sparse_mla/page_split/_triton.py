"""Triton kernels of the page split: touched-page mark and the sub-page copy (one launch each).

Import this module through ``pytest_sparse_mla.page_split`` (``backend="triton"``), which sets
``TRITON_INTERPRET=1`` first when no CUDA device exists; Triton decides at decoration time whether
a kernel is compiled or interpreted (triton ``runtime/jit.py`` ``jit``; ``knobs.runtime.interpret``).

Copy kernel (grid = ``(num_dst_pages,)``, one program per destination sub-page, like SGLang's
``_page_split_kernel``, PR #27455): program ``pid`` copies source page ``pid // ratio``, sub-page
``pid % ratio``. Bytes move as 8-byte lanes (int64 views of the uint8 buffers, SGLang PR #29927):
4,608 data lanes in 9 unrolled blocks of 512 and 64 footer lanes. All offsets are int64: ``pid`` is
widened before any multiplication (SGLang issue #34025, PR #34027: with int32 byte offsets the
destination wraps at page 57,359; with int32 lane offsets at source page 114,717). Page strides
are passed in 16-byte units and doubled in the kernel, which tells the compiler every page start
is 16-byte aligned, so lanes move as 128-bit vectors. With ``HAS_MASK`` a program reads one mask
byte and returns when its source page is unmarked; the grid never depends on index values and
nothing reads device memory on the host, so both launches can be captured in a CUDA graph.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from pytest_sparse_mla.page_split.geometry import (
    DST_PAGE_BLOCK_SIZE,
    SUB_PAGE_DATA_BYTES,
    SUB_PAGE_SCALE_BYTES,
    SplitSource,
)

__all__ = ["INTERPRETED", "mark_touched_pages", "copy_sub_pages", "probe_offsets"]

#: True when this module's kernels were decorated under ``TRITON_INTERPRET=1`` (CPU tensors).
INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"

_LANE = 8  # bytes per int64 lane
_DATA_LANES = SUB_PAGE_DATA_BYTES // _LANE  # 4,608
_SCALE_LANES = SUB_PAGE_SCALE_BYTES // _LANE  # 64
_COPY_BLOCK = 512  # lanes per unrolled step; 4,608 = 9 * 512, so no masked lanes
_MARK_BLOCK = 1024  # indices per mark program (SGLang FM-c blocked mark kernel)
_NUM_WARPS = 4


@triton.jit
def _sub_page_offsets(
    pid,
    src_stride16,
    dst_stride16,
    RATIO: tl.constexpr,
    FOOTER_LANES: tl.constexpr,
    DATA_LANES: tl.constexpr,
    SCALE_LANES: tl.constexpr,
):
    """Lane offsets (int64) of destination sub-page ``pid``: (src page, src data, src footer, dst)."""
    p = pid.to(tl.int64)  # widen first: every product below is int64
    src_page = p // RATIO
    sub = p % RATIO
    src_base = src_page * (src_stride16 * 2)
    src_data = src_base + sub * DATA_LANES
    src_scale = src_base + FOOTER_LANES + sub * SCALE_LANES
    dst = p * (dst_stride16 * 2)
    return src_page, src_data, src_scale, dst


@triton.jit
def _copy_one_sub_page(
    src_ptr,
    dst_ptr,
    src_data,
    src_scale,
    dst,
    DATA_LANES: tl.constexpr,
    SCALE_LANES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    for i in tl.static_range(DATA_LANES // BLOCK):
        lanes = tl.load(src_ptr + src_data + i * BLOCK + offs)
        tl.store(dst_ptr + dst + i * BLOCK + offs, lanes)
    soffs = tl.arange(0, SCALE_LANES)
    scales = tl.load(src_ptr + src_scale + soffs)
    tl.store(dst_ptr + dst + DATA_LANES + soffs, scales)


@triton.jit
def _page_split_kernel(
    src_ptr,
    dst_ptr,
    mask_ptr,
    src_stride16,
    dst_stride16,
    RATIO: tl.constexpr,
    FOOTER_LANES: tl.constexpr,
    DATA_LANES: tl.constexpr,
    SCALE_LANES: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    pid = tl.program_id(0)
    src_page, src_data, src_scale, dst = _sub_page_offsets(
        pid, src_stride16, dst_stride16, RATIO, FOOTER_LANES, DATA_LANES, SCALE_LANES
    )
    if HAS_MASK:
        if tl.load(mask_ptr + src_page) != 0:
            _copy_one_sub_page(src_ptr, dst_ptr, src_data, src_scale, dst, DATA_LANES, SCALE_LANES, BLOCK)
    else:
        _copy_one_sub_page(src_ptr, dst_ptr, src_data, src_scale, dst, DATA_LANES, SCALE_LANES, BLOCK)


@triton.jit
def _mark_kernel(idx_ptr, mask_ptr, numel, num_src_pages, SRC_PBS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inside = offs < numel
    idx = tl.load(idx_ptr + offs, mask=inside, other=-1).to(tl.int64)
    page = idx // SRC_PBS
    hit = inside & (idx >= 0) & (page < num_src_pages)
    # Identical concurrent stores of 1 need no atomics (SGLang PR #32320).
    tl.store(mask_ptr + page, tl.full([BLOCK], 1, tl.int8), mask=hit)


@triton.jit
def _offsets_probe_kernel(
    pid_ptr,
    out_ptr,
    n,
    src_stride16,
    dst_stride16,
    RATIO: tl.constexpr,
    FOOTER_LANES: tl.constexpr,
    DATA_LANES: tl.constexpr,
    SCALE_LANES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    inside = offs < n
    pid = tl.load(pid_ptr + offs, mask=inside, other=0)  # int32, like tl.program_id
    src_page, src_data, src_scale, dst = _sub_page_offsets(
        pid, src_stride16, dst_stride16, RATIO, FOOTER_LANES, DATA_LANES, SCALE_LANES
    )
    tl.store(out_ptr + offs * 4, src_page, mask=inside)
    tl.store(out_ptr + offs * 4 + 1, src_data, mask=inside)
    tl.store(out_ptr + offs * 4 + 2, src_scale, mask=inside)
    tl.store(out_ptr + offs * 4 + 3, dst, mask=inside)


def _check_runnable(device: torch.device) -> None:
    if device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(
            "backend='triton' on CPU tensors needs interpreted kernels, but this module was "
            "imported with TRITON_INTERPRET unset; set TRITON_INTERPRET=1 before the first "
            "triton page split (or use --sparse-mla-device=cpu, which sets it)"
        )


def _device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def mark_touched_pages(indices: torch.Tensor, mask: torch.Tensor, src_page_block_size: int) -> None:
    """Zero ``mask`` ([P] int8) and mark ``mask[t // ps] = 1`` for ``0 <= t < P*ps`` (one launch).

    ``indices``: contiguous 1-D int32/int64 on ``mask``'s device, ``numel > 0``. The grid is
    ``ceil(numel / 1024)``: shape-dependent only.
    """
    _check_runnable(mask.device)
    mask.zero_()
    numel = indices.numel()
    with _device_guard(mask.device):
        _mark_kernel[(triton.cdiv(numel, _MARK_BLOCK),)](
            indices,
            mask,
            numel,
            mask.shape[0],
            SRC_PBS=src_page_block_size,
            BLOCK=_MARK_BLOCK,
            num_warps=_NUM_WARPS,
        )


def _lanes(t: torch.Tensor) -> torch.Tensor:
    """int64 view of a 2-D uint8 page view (row stride and width multiples of 8 bytes)."""
    return t.view(torch.int64)


def copy_sub_pages(source: SplitSource, dst: torch.Tensor, mask: torch.Tensor | None) -> None:
    """Launch the copy kernel: ``dst`` ``[P*ratio, dst_stride]`` uint8, ``mask`` ``[P]`` int8 or None."""
    _check_runnable(dst.device)
    ps = source.src_page_block_size
    src = _lanes(source.pages)  # [P, ps*73] int64, row stride = src page stride / 8
    out = _lanes(dst)
    with _device_guard(dst.device):
        _page_split_kernel[(source.num_dst_pages,)](
            src,
            out,
            mask if mask is not None else src,
            source.src_page_stride // 16,
            dst.stride(0) // 16,
            RATIO=source.ratio,
            FOOTER_LANES=ps * 576 // _LANE,
            DATA_LANES=_DATA_LANES,
            SCALE_LANES=_SCALE_LANES,
            BLOCK=_COPY_BLOCK,
            HAS_MASK=mask is not None,
            num_warps=_NUM_WARPS,
        )


def probe_offsets(
    pids: torch.Tensor,
    *,
    src_page_block_size: int,
    src_page_stride: int,
    dst_page_stride: int,
) -> torch.Tensor:
    """Run the copy kernel's own offset function on program ids ``pids`` (int32, any device).

    Returns ``[len(pids), 4]`` int64 **byte** offsets ``(src_page, src_data, src_scale, dst_data)``
    (lane offsets times 8; column 0 is the source page index, not a byte offset). This lets a CPU
    test check the kernel's arithmetic at program ids past the int32 wrap without allocating the
    pool (compare with :func:`pytest_sparse_mla.page_split.split_offsets`).
    """
    if pids.dtype != torch.int32 or pids.dim() != 1:
        raise ValueError(f"pids: expected a 1-D int32 tensor, got {pids.dtype} {tuple(pids.shape)}")
    if src_page_stride % 16 or dst_page_stride % 16:
        raise ValueError(
            f"src_page_stride={src_page_stride}, dst_page_stride={dst_page_stride}: expected multiples of 16 bytes"
        )
    _check_runnable(pids.device)
    n = pids.numel()
    out = torch.zeros((n, 4), dtype=torch.int64, device=pids.device)
    block = max(16, triton.next_power_of_2(n))
    with _device_guard(pids.device):
        _offsets_probe_kernel[(1,)](
            pids.contiguous(),
            out,
            n,
            src_page_stride // 16,
            dst_page_stride // 16,
            RATIO=src_page_block_size // DST_PAGE_BLOCK_SIZE,
            FOOTER_LANES=src_page_block_size * 576 // _LANE,
            DATA_LANES=_DATA_LANES,
            SCALE_LANES=_SCALE_LANES,
            BLOCK=block,
        )
    out[:, 1:] *= _LANE
    return out
