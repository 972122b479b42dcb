"""Split DSV4 packed KV caches into 64-token pages (the SGLang -> FlashInfer SM120 bridge).

Design note
===========

Why. FlashInfer's SM120 sparse-MLA kernels read DSV4 caches in 64-token pages, while serving pools
use 256-token (SWA) or 128-token pages; SGLang splits the pool right before every call
(sgl-project/sglang ``python/sglang/kernels/ops/attention/flash_mla_sm120.py``
``_split_kv_pages_to_64``, PR #27455; later fixes: PRs #32320, #35116, #35833, #39288).

Algorithm. A DSV4 page of ``ps`` tokens holds all data rows (``ps*576`` bytes) then all 8-byte
scale records (``ps*8``) then padding (``formats`` module docstring). With ``ratio = ps/64``,
source page ``p``, sub-page ``s`` becomes destination page ``p*ratio + s``: its data bytes
``[s*36864, +36864)`` go to ``[0, 36864)`` and its footer bytes ``[ps*576 + s*512, +512)`` go to
``[36864, 37376)``; the destination alignment tail ``[37376, dst_page_stride)`` is never written.
Flat token ``t`` sits in page ``t // ps`` slot ``t % ps`` before and in page
``(t//ps)*ratio + (t%ps)//64`` slot ``t % 64`` after, whose flat index is ``t`` again: indices need
no remapping (SGLang PR #27455). The result is a ``[P*ratio, 64, 1, 584]`` NHD view with strides
``(dst_page_stride, 584, 584, 1)``; 584 is only a shape carrier (``formats``: the row ``t`` of that
view is not token ``t``'s record). ``ps == 64`` returns the input object and allocates nothing.

Touched-page mask (SGLang PR #32320). With ``touched_indices`` (int32/int64, any shape, non-empty),
the mask (int8, one byte per source page) is rewritten on every call: every index
``0 <= t < P*ps`` sets ``mask[t // ps]``, negative indices mark nothing, all other bytes are 0,
and only marked pages are copied; other destination pages keep their bytes. ``None`` or an empty
tensor means a full split. Grids depend on shapes only and nothing syncs to the host, so the
Triton path can be graph-captured and replayed with new index values.

Buffers. Destination and mask live in a :class:`BufferRegistry` (grow-only, per device, zero-
filled on (re)allocation because FlashInfer gathers slot 0 for masked candidates, SGLang PR
#39288; allocated outside inference mode, PR #35116) under ``f"{name}{key_suffix}:{device}"``:
``flash_mla_sm120_split:{dev}`` / ``flash_mla_sm120_mask:{dev}`` for ``key_suffix=""`` (SGLang's
historic keys), the suffix placed before the colon like a downstream ``buf_tag`` patch (the
DeepSeek-V4.1 shim of flashinfer-ai/flashinfer #5095 splits a second cache). A second split in
one call (e.g. a 128-token extra cache) needs its
own suffix, or it overwrites the first split's pages (the aliasing bug).

Backends. ``"torch"`` (:mod:`._torch`): readable strided-view copies. ``"triton"``
(:mod:`._triton`), interpreted (``TRITON_INTERPRET=1``) on machines without CUDA:

* full split: one launch, one program per destination sub-page, int64 offsets, 8-byte lanes;
  97% of a device-to-device copy on an H200 (1.07 GB pool);
* touched split: a worklist instead of a program per sub-page, two launches, no memset. The mark
  kernel claims each touched page with an int32 atomic exchange and appends first claims to a
  device-side worklist (one atomic add per mark program on a device counter); its last program
  publishes the count. The copy kernel (a programmatic dependent launch on sm_90+) runs a fixed
  grid (``min(P*ratio, programs_per_sm * SMs)``, ``_triton.WORKLIST_CONFIG``), reads the count on
  the device and loops over the (page, sub-page) items, then rewrites the int8 mask from the
  claims and resets them. Why: with one program per sub-page, 28,672 programs that mostly exit
  cost 18.9 us on an H200, and a 1% split took 5.2x its ideal time. Measured on an H200
  (2026-11-30, ``docs/benchmarks.md``, beside SGLang's split in the same run): 1% of pages 2.42x
  ideal (target 3x met), 10% 1.25x (target 1.2x missed), a full split at 97.8% of a device copy's
  bandwidth (the tuning sweeps behind these configurations are in the git history). The scratch
  (int32 ``[P + 2, 2]``) is ``registry.backend_scratch``'s
  ``flash_mla_sm120_worklist{key_suffix}:{dev}``; the registry's int8 mask stays the public artefact.

Both backends are byte-identical (``tests/test_page_split_bundled.py``); the conformance suite
``suites/test_page_split.py`` specifies any implementation's split.

Public API
==========

``page_split``, ``merge_pages``, ``touched_page_mask``, ``split_offsets`` / ``SplitOffsets``,
``parse_split_source`` / ``SplitSource``, ``BufferRegistry`` (``backend_scratch``), ``default_registry``,
``split_buffer_key``, ``mask_buffer_key``, ``triton_backend``, ``triton_unavailable_reason``,
constants ``SPLIT_BUFFER_NAME``, ``MASK_BUFFER_NAME``, ``WORKLIST_BUFFER_NAME``, ``DST_PAGE_BLOCK_SIZE``
(64), ``DST_PAGE_STRIDE`` (37,440), ``DST_PAGE_BYTES`` (37,376), ``SUB_PAGE_DATA_BYTES`` (36,864),
``SUB_PAGE_SCALE_BYTES`` (512), ``BACKENDS``.
"""

from __future__ import annotations

from types import ModuleType

import torch

from pytest_sparse_mla import capabilities, formats
from pytest_sparse_mla.page_split import _torch
from pytest_sparse_mla.page_split.buffers import (
    MASK_BUFFER_NAME,
    SPLIT_BUFFER_NAME,
    WORKLIST_BUFFER_NAME,
    BufferRegistry,
    buffer_key,
    default_registry,
    mask_buffer_key,
    split_buffer_key,
)
from pytest_sparse_mla.page_split.geometry import (
    DST_PAGE_BLOCK_SIZE,
    DST_PAGE_BYTES,
    DST_PAGE_STRIDE,
    SUB_PAGE_DATA_BYTES,
    SUB_PAGE_SCALE_BYTES,
    SplitOffsets,
    SplitSource,
    check_dst_page_stride,
    check_src_page_block_size,
    parse_split_source,
    split_offsets,
)

_TRITON_MODULE = "pytest_sparse_mla.page_split._triton"

__all__ = [
    "BACKENDS",
    "DST_PAGE_BLOCK_SIZE",
    "DST_PAGE_BYTES",
    "DST_PAGE_STRIDE",
    "SUB_PAGE_DATA_BYTES",
    "SUB_PAGE_SCALE_BYTES",
    "SPLIT_BUFFER_NAME",
    "MASK_BUFFER_NAME",
    "WORKLIST_BUFFER_NAME",
    "BufferRegistry",
    "SplitOffsets",
    "SplitSource",
    "buffer_key",
    "default_registry",
    "mask_buffer_key",
    "merge_pages",
    "page_split",
    "parse_split_source",
    "split_buffer_key",
    "split_offsets",
    "touched_page_mask",
    "triton_backend",
    "triton_unavailable_reason",
]

#: Implementations selectable with ``backend=``.
BACKENDS: tuple[str, ...] = ("torch", "triton")


#: The Triton split's kernels: ``triton_backend()`` imports them (interpreted without a CUDA device),
#: ``triton_unavailable_reason(device)`` says why ``backend="triton"`` cannot run there.
_TRITON = capabilities.TritonKernels(_TRITON_MODULE)
triton_backend = _TRITON.load
triton_unavailable_reason = _TRITON.unavailable_reason


def _backend_module(backend: object) -> ModuleType:
    if backend == "torch":
        return _torch
    if backend == "triton":
        return triton_backend()
    raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")


def _check_indices(touched_indices: object, device: torch.device) -> torch.Tensor | None:
    """Flat contiguous indices, or None for "full split" (None or an empty tensor)."""
    if touched_indices is None:
        return None
    if not isinstance(touched_indices, torch.Tensor):
        raise TypeError(
            f"touched_indices: expected a torch.Tensor of token indices or None, got {type(touched_indices).__name__}"
        )
    if touched_indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"touched_indices.dtype={touched_indices.dtype}: expected torch.int32 or torch.int64 "
            "flat token indices (-1 marks nothing)"
        )
    if touched_indices.device != device:
        raise ValueError(f"touched_indices.device={touched_indices.device}: expected the kv_cache's device {device}")
    if touched_indices.numel() == 0:
        return None
    return touched_indices.contiguous().view(-1)


def touched_page_mask(
    touched_indices: torch.Tensor,
    *,
    src_page_block_size: int,
    num_src_pages: int,
    out: torch.Tensor | None = None,
    backend: str = "torch",
) -> torch.Tensor:
    """The touched-page mask: ``mask[p] = 1`` iff some index ``t`` in ``[0, P*ps)`` has ``t // ps == p``.

    Args:
        touched_indices: int32/int64 flat token indices, any shape, non-empty; negative entries
            (``-1`` padding) and entries ``>= P*ps`` mark nothing (no host check, no sync).
        src_page_block_size: tokens per source page ``ps``.
        num_src_pages: ``P``.
        out: optional ``[P]`` int8 tensor to fill (it is zeroed first), e.g. the registry's mask.
        backend: ``"torch"`` or ``"triton"``.

    Returns:
        ``[P]`` int8 mask on the indices' device (``out`` when given).

    Raises:
        TypeError: bad index dtype. ValueError: empty indices, bad ``out``, bad backend, a page
            size that is not a positive multiple of 64, a non-positive ``num_src_pages``.
    """
    module = _backend_module(backend)
    check_src_page_block_size(src_page_block_size)
    if isinstance(num_src_pages, bool) or not isinstance(num_src_pages, int) or num_src_pages < 1:
        raise ValueError(f"num_src_pages={num_src_pages!r}: expected a positive int")
    if not isinstance(touched_indices, torch.Tensor):
        raise TypeError(f"touched_indices: expected a torch.Tensor, got {type(touched_indices).__name__}")
    idx = _check_indices(touched_indices, touched_indices.device)
    if idx is None:
        raise ValueError("touched_indices: expected a non-empty tensor (empty means a full split)")
    if out is None:
        out = torch.zeros(num_src_pages, dtype=torch.int8, device=idx.device)
    elif out.dtype != torch.int8 or tuple(out.shape) != (num_src_pages,) or out.device != idx.device:
        raise ValueError(
            f"out: expected a [{num_src_pages}] int8 tensor on {idx.device}, got "
            f"{out.dtype} {tuple(out.shape)} on {out.device}"
        )
    module.mark_touched_pages(idx, out, src_page_block_size)
    return out


def page_split(
    kv_cache: torch.Tensor,
    *,
    src_page_block_size: int | None = None,
    touched_indices: torch.Tensor | None = None,
    key_suffix: str = "",
    registry: BufferRegistry | None = None,
    backend: str = "torch",
    dst_page_stride: int = DST_PAGE_STRIDE,
) -> torch.Tensor:
    """Split a DSV4 packed cache into 64-token pages (see the module docstring).

    Args:
        kv_cache: uint8 DSV4 cache: 2-D ``[P, W]`` (``W`` = ``ps*584`` or the padded stride; needs
            ``src_page_block_size``), 3-D ``[P, ps, 584]``, HND ``[P, 1, ps, 584]`` or NHD
            ``[P, ps, 1, 584]`` with any valid page stride (``formats.parse_cache`` rules).
        src_page_block_size: tokens per source page, a multiple of 64; required for 2-D, else
            optional and checked against the shape.
        touched_indices: optional int32/int64 flat token indices (any shape) on the cache's device;
            only source pages they reference are copied. ``None`` or empty: full split.
        key_suffix: selects the scratch buffers ``flash_mla_sm120_split{key_suffix}:{dev}`` and
            ``flash_mla_sm120_mask{key_suffix}:{dev}`` (and, for a touched Triton split,
            ``registry.backend_scratch``'s ``flash_mla_sm120_worklist{key_suffix}:{dev}``); use a
            distinct suffix for a second split whose result must coexist with the first.
        registry: buffer registry; ``None`` uses :func:`default_registry`.
        backend: ``"torch"`` (reference) or ``"triton"`` (kernel).
        dst_page_stride: destination page stride in bytes (default 37,440; >= 37,376, multiple of 16).

    Returns:
        ``kv_cache`` itself when ``ps == 64``; else a uint8 view ``[P*ps/64, 64, 1, 584]`` with
        strides ``(dst_page_stride, 584, 584, 1)`` into the registry's split buffer. It is
        overwritten by the next split under the same key and device.

    Raises:
        TypeError: non-uint8 cache, non-int page size, non-integer indices, bad registry.
        ValueError: page size not a multiple of 64 or disagreeing with the shape, missing for 2-D,
            bad 2-D width, undescribable 4-D form, indices on another device, bad
            ``dst_page_stride``, ``key_suffix`` or ``backend``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
    if registry is not None and not isinstance(registry, BufferRegistry):
        raise TypeError(f"registry: expected a BufferRegistry or None, got {type(registry).__name__}")
    source = parse_split_source(kv_cache, src_page_block_size)
    indices = _check_indices(touched_indices, source.device)
    dst_stride = check_dst_page_stride(dst_page_stride)
    buffer_key(SPLIT_BUFFER_NAME, source.device, key_suffix)  # validates key_suffix
    if source.ratio == 1:
        return kv_cache
    module = _backend_module(backend)
    reg = default_registry() if registry is None else registry
    dst = reg.get(
        SPLIT_BUFFER_NAME,
        source.device,
        (source.num_dst_pages, dst_stride),
        torch.uint8,
        key_suffix=key_suffix,
    )
    if indices is None:
        module.copy_sub_pages(source, dst, None)
    else:
        mask = reg.get(
            MASK_BUFFER_NAME,
            source.device,
            (source.num_src_pages,),
            torch.int8,
            key_suffix=key_suffix,
        )
        if module is _torch:
            _torch.mark_touched_pages(indices, mask, source.src_page_block_size)
            _torch.copy_sub_pages(source, dst, mask)
        else:
            scratch = reg.backend_scratch.get(
                WORKLIST_BUFFER_NAME,
                source.device,
                module.worklist_scratch_shape(source.num_src_pages),
                torch.int32,
                key_suffix=key_suffix,
            )
            module.split_touched_pages(source, dst, indices, mask, scratch)
    bpt = formats.DSV4.bytes_per_token
    return torch.as_strided(
        dst,
        (source.num_dst_pages, DST_PAGE_BLOCK_SIZE, 1, bpt),
        (dst_stride, bpt, bpt, 1),
        dst.storage_offset(),
    )


def merge_pages(
    split_cache: torch.Tensor,
    *,
    src_page_block_size: int,
    out: torch.Tensor | None = None,
    page_stride: formats.StrideSpec = "padded",
) -> torch.Tensor:
    """Inverse of :func:`page_split` (torch): merge 64-token pages back into ``ps``-token pages.

    Destination page ``p*ratio + s`` of ``split_cache`` goes back to sub-page ``s`` of page ``p``:
    data to ``[s*36864, +36864)``, footer to ``[ps*576 + s*512, +512)``. Bytes past ``ps*584`` of
    each merged page (padding) are not written.

    Args:
        split_cache: a 64-token DSV4 cache in any form (``formats.parse_cache``) with a page count
            divisible by ``ratio = src_page_block_size/64``.
        src_page_block_size: tokens per merged page, a multiple of 64.
        out: optional cache of ``P = pages/ratio`` pages of ``src_page_block_size`` tokens (any
            form) to write into; otherwise a zero-filled buffer with ``page_stride`` is allocated.
        page_stride: page stride of the allocated result (``"padded"``, ``"tight"`` or bytes).

    Returns:
        ``out``, or a new NHD ``[P, ps, 1, 584]`` uint8 view.

    Raises:
        TypeError, ValueError: as :func:`formats.parse_cache` / :func:`parse_split_source`; a page
            count not divisible by ``ratio``; ``out`` with the wrong page count or page size.
    """
    layout = formats.parse_cache(split_cache, formats.DSV4, page_block_size=DST_PAGE_BLOCK_SIZE)
    if layout.page_block_size != DST_PAGE_BLOCK_SIZE:
        raise ValueError(f"split_cache holds {layout.page_block_size}-token pages: expected {DST_PAGE_BLOCK_SIZE}")
    if out is None:
        ps = check_src_page_block_size(src_page_block_size)
        if layout.num_pages % (ps // DST_PAGE_BLOCK_SIZE):
            raise ValueError(
                f"split_cache.shape[0]={layout.num_pages}: expected a multiple of ratio "
                f"{ps // DST_PAGE_BLOCK_SIZE} (src_page_block_size={ps})"
            )
        num_pages = layout.num_pages // (ps // DST_PAGE_BLOCK_SIZE)
        stride = formats.page_stride_bytes(formats.DSV4, ps, page_stride)
        buffer = formats.allocate_pages(num_pages, stride, device=split_cache.device)
        out = formats.as_form(buffer, formats.DSV4, ps, "nhd")
    target = parse_split_source(out, src_page_block_size)
    if target.num_dst_pages != layout.num_pages:
        raise ValueError(
            f"out holds {target.num_src_pages} pages of {target.src_page_block_size} tokens "
            f"= {target.num_dst_pages} 64-token pages; split_cache has {layout.num_pages}"
        )
    _torch.merge_sub_pages(formats.page_bytes_view(split_cache, layout), target.pages, target.src_page_block_size)
    return out
