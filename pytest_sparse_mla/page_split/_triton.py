"""Triton kernels of the page split: the full copy, the touched split (mark + worklist copy).

Import this module through ``pytest_sparse_mla.page_split`` (``backend="triton"``), which sets
``TRITON_INTERPRET=1`` first when no CUDA device exists; Triton decides at decoration time whether
a kernel is compiled or interpreted (triton ``runtime/jit.py`` ``jit``; ``knobs.runtime.interpret``).

* Full split (:func:`copy_sub_pages` without a mask): one program per destination sub-page, like
  SGLang's ``_page_split_kernel`` (sgl-project/sglang PR #27455); bytes move as 8-byte lanes (PR
  #29927) with int64 offsets (SGLang issue #34025, PR #34027: int32 offsets wrap on large pools).
  Configuration :data:`FULL_CONFIG`.
* Touched split (:func:`split_touched_pages`): two launches, no memset. A mark kernel claims each
  touched page with an atomic exchange and appends first claims to a device-side worklist; a copy
  kernel of fixed grid (:data:`WORKLIST_CONFIG`; a programmatic dependent launch on sm_90+) copies
  the listed sub-pages, rewrites the int8 mask and resets the claims. Scratch: the registry's
  ``backend_scratch`` buffer ``flash_mla_sm120_worklist{key_suffix}:{dev}``, int32 ``[P + 2, 2]``
  (:func:`worklist_scratch_shape`), zeroed again if the copy launch raises.
* :func:`mark_touched_pages` and :func:`copy_sub_pages` with a mask: the first design, kept for
  ``touched_page_mask`` and as the tuning baseline (``benchmarks/tune_split.py``).

Grids depend on shapes only and nothing reads device memory on the host, so every split can be
captured in a CUDA graph. Kernel design, the scratch layout and the H200 measurements behind the
configurations: ``docs/design/page-split.md``.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

try:  # programmatic dependent launch (sm_90+): WorklistConfig.pdl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAS_GDC = True
except ImportError:  # pragma: no cover - older triton: an ordinary launch (same bytes)
    gdc_launch_dependents = gdc_wait = None
    _HAS_GDC = False

from pytest_sparse_mla.page_split.geometry import (
    DST_PAGE_BLOCK_SIZE,
    SUB_PAGE_DATA_BYTES,
    SUB_PAGE_SCALE_BYTES,
    SplitSource,
)

__all__ = [
    "INTERPRETED",
    "CopyConfig",
    "FULL_CONFIG",
    "MASKED_CONFIG",
    "WorklistConfig",
    "WORKLIST_CONFIG",
    "mark_touched_pages",
    "copy_sub_pages",
    "split_touched_pages",
    "worklist_scratch_shape",
    "probe_offsets",
]

#: True when this module's kernels were decorated under ``TRITON_INTERPRET=1`` (CPU tensors).
INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"

_LANE = 8  # bytes per int64 lane
#: int64 lanes of a 64-token sub-page's data (64 * 576 B) and of its scales (64 * 8 B); a source
#: page of ``RATIO`` sub-pages holds ``RATIO * DATA_LANES`` data lanes before its scale footer.
DATA_LANES: tl.constexpr = tl.constexpr(SUB_PAGE_DATA_BYTES // _LANE)  # 4,608
SCALE_LANES: tl.constexpr = tl.constexpr(SUB_PAGE_SCALE_BYTES // _LANE)  # 64
_MARK_BLOCK = 1024  # indices per mark program (SGLang FM-c blocked mark kernel)
_NUM_WARPS = 4
_MASK_BLOCK = 512  # pages per step of the worklist copy's mask pass
_INTERPRETED_PROGRAMS = 3  # worklist copy grid when interpreted (small, but loops run)


@dataclass(frozen=True)
class CopyConfig:
    """Launch parameters of the copy kernel (performance only: every config is byte-identical).

    Attributes:
        block: int64 lanes per unrolled step, one of 512, 1024, 2048, 4096 (4,608 data lanes =
            ``k * block`` plus a 512-lane remainder when ``block`` does not divide 4,608).
        num_warps: warps per program (1, 2, 4, 8, 16 or 32).
        evict: stream the bytes: loads with ``eviction_policy="evict_first"``, stores with the
            ``.cs`` (streaming) cache modifier, so a split does not flush the L2 for its reader.
    """

    block: int = 512
    num_warps: int = 4
    evict: bool = False

    def __post_init__(self) -> None:
        if self.block not in (512, 1024, 2048, 4096):
            raise ValueError(f"block={self.block}: expected 512, 1024, 2048 or 4096 lanes")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"num_warps={self.num_warps}: expected 1, 2, 4, 8, 16 or 32")

    def kernel_args(self) -> dict[str, object]:
        """The constexpr and launch keyword arguments of ``_page_split_kernel``."""
        steps = DATA_LANES // self.block
        return {
            "BLOCK": self.block,
            "STEPS": steps,
            "REM": DATA_LANES - steps * self.block,
            "LOAD_EVICT": "evict_first" if self.evict else "",
            "STORE_CACHE": ".cs" if self.evict else "",
            "num_warps": self.num_warps,
        }


#: Config of full splits (no mask) and of the mask-per-program copy; tuned on an H200, see docs/benchmarks.md.
FULL_CONFIG = CopyConfig(block=4096, num_warps=32, evict=False)
MASKED_CONFIG = CopyConfig(block=4096, num_warps=8, evict=True)


@dataclass(frozen=True)
class WorklistConfig:
    """Launch parameters of the touched split (performance only: every config is byte-identical).

    Attributes:
        copy: lanes, warps and cache hints of each sub-page copy (:class:`CopyConfig`).
        programs_per_sm: the copy grid is ``min(P*ratio, programs_per_sm * SM count)`` on CUDA.
        mark_block: indices per mark program (256, 512, 1024, 2048 or 4096).
        check_first: the mark reads a page's claim from L2 and skips the atomic exchange when the
            page is already claimed (measured slower on decode-sized index tensors; see
            docs/benchmarks.md).
        pdl: launch the copy as a programmatic dependent launch of the mark (sm_90+ and a Triton
            with ``triton.language.extra.cuda.gdc_wait``; elsewhere, and when interpreted, an
            ordinary launch: same bytes).
    """

    copy: CopyConfig = CopyConfig(block=4096, num_warps=16, evict=False)
    programs_per_sm: int = 16
    mark_block: int = 256
    check_first: bool = False
    pdl: bool = True

    def __post_init__(self) -> None:
        pps = self.programs_per_sm
        if isinstance(pps, bool) or not isinstance(pps, int) or not 1 <= pps <= 64:
            raise ValueError(f"programs_per_sm={pps!r}: expected an int in [1, 64]")
        if self.mark_block not in (256, 512, 1024, 2048, 4096):
            raise ValueError(f"mark_block={self.mark_block!r}: expected 256, 512, 1024, 2048 or 4096 indices")


#: Config of touched splits (:func:`split_touched_pages`); tuned on an H200, see docs/benchmarks.md.
WORKLIST_CONFIG = WorklistConfig()


@triton.jit
def _sub_page_offsets(
    pid,
    src_stride16,
    dst_stride16,
    RATIO: tl.constexpr,
):
    """Lane offsets (int64) of destination sub-page ``pid``: (src page, src data, src footer, dst)."""
    p = pid.to(tl.int64)  # widen first: every product below is int64
    src_page = p // RATIO
    sub = p % RATIO
    src_base = src_page * (src_stride16 * 2)
    src_data = src_base + sub * DATA_LANES
    src_scale = src_base + RATIO * DATA_LANES + sub * SCALE_LANES
    dst = p * (dst_stride16 * 2)
    return src_page, src_data, src_scale, dst


@triton.jit
def _copy_one_sub_page(
    src_ptr,
    dst_ptr,
    src_data,
    src_scale,
    dst,
    BLOCK: tl.constexpr,
    STEPS: tl.constexpr,
    REM: tl.constexpr,
    LOAD_EVICT: tl.constexpr,
    STORE_CACHE: tl.constexpr,
):
    # Footer and remainder loads are issued first, so with STEPS == 1 every load of the sub-page
    # is in flight before the first store (the compiler cannot hoist loads over stores that may
    # alias them).
    soffs = tl.arange(0, SCALE_LANES)
    scales = tl.load(src_ptr + src_scale + soffs, eviction_policy=LOAD_EVICT)
    if REM > 0:
        roffs = tl.arange(0, REM)
        rest = tl.load(src_ptr + src_data + STEPS * BLOCK + roffs, eviction_policy=LOAD_EVICT)
    offs = tl.arange(0, BLOCK)
    for i in tl.static_range(STEPS):
        lanes = tl.load(src_ptr + src_data + i * BLOCK + offs, eviction_policy=LOAD_EVICT)
        tl.store(dst_ptr + dst + i * BLOCK + offs, lanes, cache_modifier=STORE_CACHE)
    if REM > 0:
        tl.store(dst_ptr + dst + STEPS * BLOCK + roffs, rest, cache_modifier=STORE_CACHE)
    tl.store(dst_ptr + dst + DATA_LANES + soffs, scales, cache_modifier=STORE_CACHE)


@triton.jit
def _page_split_kernel(
    src_ptr, dst_ptr, mask_ptr, src_stride16, dst_stride16, RATIO: tl.constexpr,
    BLOCK: tl.constexpr, STEPS: tl.constexpr, REM: tl.constexpr, LOAD_EVICT: tl.constexpr, STORE_CACHE: tl.constexpr,
    HAS_MASK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    src_page, src_data, src_scale, dst = _sub_page_offsets(pid, src_stride16, dst_stride16, RATIO)
    if HAS_MASK:
        if tl.load(mask_ptr + src_page) != 0:
            _copy_one_sub_page(
                src_ptr, dst_ptr, src_data, src_scale, dst,
                BLOCK, STEPS, REM, LOAD_EVICT, STORE_CACHE,
            )
    else:
        _copy_one_sub_page(
            src_ptr, dst_ptr, src_data, src_scale, dst,
            BLOCK, STEPS, REM, LOAD_EVICT, STORE_CACHE,
        )


@triton.jit
def _touched_pages(idx_ptr, numel, num_src_pages, SRC_PBS: tl.constexpr, BLOCK: tl.constexpr):
    """The source page of each of this program's ``BLOCK`` indices (int64), and whether it marks one
    (inside ``numel``, ``index >= 0``, page ``< num_src_pages``)."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inside = offs < numel
    idx = tl.load(idx_ptr + offs, mask=inside, other=-1).to(tl.int64)
    page = idx // SRC_PBS
    return page, inside & (idx >= 0) & (page < num_src_pages)


@triton.jit
def _mark_kernel(idx_ptr, mask_ptr, numel, num_src_pages, SRC_PBS: tl.constexpr, BLOCK: tl.constexpr):
    page, hit = _touched_pages(idx_ptr, numel, num_src_pages, SRC_PBS, BLOCK)
    # Identical concurrent stores of 1 need no atomics (SGLang PR #32320).
    tl.store(mask_ptr + page, tl.full([BLOCK], 1, tl.int8), mask=hit)


@triton.jit
def _mark_worklist_kernel(
    idx_ptr,
    ws_ptr,
    numel,
    num_src_pages,
    num_programs,
    SRC_PBS: tl.constexpr,
    BLOCK: tl.constexpr,
    CHECK_FIRST: tl.constexpr,
    GDC: tl.constexpr,
):
    # ws: int32 [P + 2, 2]; row 0 = (count, done), row 1 + p = (claim of page p, worklist slot p),
    # row P + 1 column 1 = the count published for the copy launch.
    if GDC:
        gdc_launch_dependents()  # the copy grid may be scheduled now; it waits for this grid's end
    page, hit = _touched_pages(idx_ptr, numel, num_src_pages, SRC_PBS, BLOCK)
    claim = ws_ptr + 2 + page * 2
    if CHECK_FIRST:
        seen = tl.load(claim, mask=hit, other=1, cache_modifier=".cg")
        hit = hit & (seen == 0)
    old = tl.atomic_xchg(claim, tl.full([BLOCK], 1, tl.int32), mask=hit, sem="relaxed")
    first = (hit & (old == 0)).to(tl.int32)
    n_first = tl.sum(first, axis=0)
    if n_first > 0:
        base = tl.atomic_add(ws_ptr, n_first, sem="relaxed")
        slot = (base + tl.cumsum(first, axis=0) - 1).to(tl.int64)
        tl.store(ws_ptr + 3 + slot * 2, page.to(tl.int32), mask=first != 0)
    # The last mark program to finish (acq_rel "done" counter) sees every reservation: it publishes
    # the count for the copy launch and resets both counters, so the copy needs no atomics.
    done = tl.atomic_add(ws_ptr + 1, 1, sem="acq_rel")
    if done == num_programs - 1:
        count = tl.atomic_xchg(ws_ptr, 0, sem="acq_rel")
        tl.store(ws_ptr + (num_src_pages + 1) * 2 + 1, count)
        tl.store(ws_ptr + 1, 0)


@triton.jit
def _worklist_copy_kernel(
    src_ptr, dst_ptr, mask_ptr, ws_ptr, num_src_pages, num_programs, src_stride16, dst_stride16, RATIO: tl.constexpr,
    BLOCK: tl.constexpr, STEPS: tl.constexpr, REM: tl.constexpr, LOAD_EVICT: tl.constexpr, STORE_CACHE: tl.constexpr,
    MASK_BLOCK: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    if GDC:
        gdc_wait()  # the mark grid has completed and its writes are visible
    g = tl.program_id(0)
    n = tl.load(ws_ptr + (num_src_pages + 1) * 2 + 1) * RATIO  # worklist items (page, sub) of this call
    # Program g copies items g, g+G, g+2G, ... < n, prefetching the next item's page. The first
    # slot load is bounded by P, not by the count, so it does not wait for it; slots past the
    # count are never used.
    page = tl.load(ws_ptr + 3 + (g // RATIO).to(tl.int64) * 2)  # g < P*ratio: in bounds
    for item in range(g, n, num_programs):
        nxt = item + num_programs
        nxt_page = tl.load(ws_ptr + 3 + (nxt // RATIO).to(tl.int64) * 2, mask=nxt < n, other=0)
        _, src_data, src_scale, dst = _sub_page_offsets(
            page.to(tl.int64) * RATIO + item % RATIO, src_stride16, dst_stride16, RATIO
        )
        _copy_one_sub_page(
            src_ptr, dst_ptr, src_data, src_scale, dst,
            BLOCK, STEPS, REM, LOAD_EVICT, STORE_CACHE,
        )
        page = nxt_page
    # Public mask from the claims, and claims back to 0. Blocks go to the last programs first:
    # they hold the fewest items.
    moffs = tl.arange(0, MASK_BLOCK)
    for start in range((num_programs - 1 - g) * MASK_BLOCK, num_src_pages, num_programs * MASK_BLOCK):
        pages = start + moffs.to(tl.int64)
        ok = pages < num_src_pages
        claimed = tl.load(ws_ptr + 2 + pages * 2, mask=ok, other=0)
        tl.store(mask_ptr + pages, (claimed != 0).to(tl.int8), mask=ok)
        tl.store(ws_ptr + 2 + pages * 2, tl.zeros([MASK_BLOCK], tl.int32), mask=ok & (claimed != 0))


@triton.jit
def _offsets_probe_kernel(
    pid_ptr,
    out_ptr,
    n,
    src_stride16,
    dst_stride16,
    RATIO: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    inside = offs < n
    pid = tl.load(pid_ptr + offs, mask=inside, other=0)  # int32, like tl.program_id
    src_page, src_data, src_scale, dst = _sub_page_offsets(
        pid, src_stride16, dst_stride16, RATIO
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


def _device_guard(device: torch.device) -> contextlib.AbstractContextManager[object]:
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


def copy_sub_pages(
    source: SplitSource, dst: torch.Tensor, mask: torch.Tensor | None, *, config: CopyConfig | None = None
) -> None:
    """Launch the copy kernel: ``dst`` ``[P*ratio, dst_stride]`` uint8, ``mask`` ``[P]`` int8 or None.

    ``config`` overrides the launch parameters (default :data:`FULL_CONFIG` without a mask,
    :data:`MASKED_CONFIG` with one); the grid is always ``(P*ratio,)``. ``page_split`` uses it for
    full splits only; with a mask it is the first touched-split design, kept as the benchmark's
    baseline (touched splits run :func:`split_touched_pages`).
    """
    _check_runnable(dst.device)
    if config is None:
        config = FULL_CONFIG if mask is None else MASKED_CONFIG
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
            HAS_MASK=mask is not None,
            **config.kernel_args(),
        )


def worklist_scratch_shape(num_src_pages: int) -> tuple[int, int]:
    """Shape of the int32 scratch of :func:`split_touched_pages`: ``(num_src_pages + 2, 2)``."""
    return (num_src_pages + 2, 2)


_DEVICE_PROPERTIES: dict[int, object] = {}


def _cuda_properties(device: torch.device) -> object:
    """``torch.cuda.get_device_properties`` of a CUDA ``device``, read once per device index."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _DEVICE_PROPERTIES:
        _DEVICE_PROPERTIES[index] = torch.cuda.get_device_properties(index)
    return _DEVICE_PROPERTIES[index]


def _copy_programs(device: torch.device, num_dst_pages: int, programs_per_sm: int) -> int:
    """Grid of the worklist copy: ``min(num_dst_pages, programs_per_sm * SMs)`` (shapes only)."""
    if device.type != "cuda":
        return min(num_dst_pages, _INTERPRETED_PROGRAMS)
    sms = int(_cuda_properties(device).multi_processor_count)  # type: ignore[attr-defined]
    return min(num_dst_pages, programs_per_sm * sms)


def split_touched_pages(
    source: SplitSource,
    dst: torch.Tensor,
    indices: torch.Tensor,
    mask: torch.Tensor,
    scratch: torch.Tensor,
    *,
    config: WorklistConfig | None = None,
) -> None:
    """Touched split in two launches (mark + worklist copy; ``docs/design/page-split.md``), no memset, no sync.

    Args:
        source: the validated source (``P`` pages, ``ratio`` sub-pages each).
        dst: ``[P*ratio, dst_stride]`` uint8 destination rows; only sub-pages of touched source
            pages are written (their data and footer bytes), every other byte keeps its value.
        indices: contiguous 1-D int32/int64 flat token indices on ``dst``'s device, ``numel > 0``;
            negative entries and entries ``>= P*ps`` mark nothing.
        mask: ``[P]`` int8, rewritten with ``1`` for touched pages and ``0`` for the others.
        scratch: int32 of shape :func:`worklist_scratch_shape` (or more rows) whose row 0 (counter,
            done counter) and column 0 (claims) are zero before the call (registry buffers are
            zero-filled); every call leaves them zero again. Column 1 of rows ``1..P`` holds the
            worklist slots, never read past the counter.
        config: launch parameters (default :data:`WORKLIST_CONFIG`).

    Raises:
        ValueError: ``scratch`` of the wrong dtype, shape or device.
    """
    _check_runnable(dst.device)
    if config is None:
        config = WORKLIST_CONFIG
    num_src = source.num_src_pages
    rows = worklist_scratch_shape(num_src)[0]
    if (
        scratch.dtype != torch.int32
        or scratch.dim() != 2
        or scratch.shape[0] < rows
        or scratch.shape[1] != 2
        or not scratch.is_contiguous()
        or scratch.device != dst.device
    ):
        raise ValueError(
            f"scratch: expected a contiguous int32 [>= {rows}, 2] tensor on {dst.device}, got "
            f"{scratch.dtype} {tuple(scratch.shape)} on {scratch.device}"
        )
    ps = source.src_page_block_size
    numel = indices.numel()
    programs = _copy_programs(dst.device, source.num_dst_pages, config.programs_per_sm)
    copy_args = config.copy.kernel_args()
    gdc = config.pdl and _HAS_GDC and not INTERPRETED and _cuda_properties(dst.device).major >= 9  # type: ignore[attr-defined]
    mark_programs = triton.cdiv(numel, config.mark_block)
    with _device_guard(dst.device):
        _mark_worklist_kernel[(mark_programs,)](
            indices,
            scratch,
            numel,
            num_src,
            mark_programs,
            SRC_PBS=ps,
            BLOCK=config.mark_block,
            CHECK_FIRST=config.check_first,
            GDC=gdc,
            num_warps=_NUM_WARPS,
        )
        try:
            _worklist_copy_kernel[(programs,)](
                _lanes(source.pages),
                _lanes(dst),
                mask,
                scratch,
                num_src,
                programs,
                source.src_page_stride // 16,
                dst.stride(0) // 16,
                RATIO=source.ratio,
                MASK_BLOCK=_MASK_BLOCK,
                GDC=gdc,
                **({"launch_pdl": True} if gdc else {}),
                **copy_args,
            )
        except BaseException:
            scratch.zero_()  # the mark ran but the copy did not: leave no claims behind
            raise


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
            BLOCK=block,
        )
    out[:, 1:] *= _LANE
    return out
