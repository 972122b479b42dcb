"""Split DSV4 packed KV caches into 64-token pages (the SGLang -> FlashInfer SM120 bridge).

FlashInfer's SM120 sparse-MLA kernels read DSV4 caches in 64-token pages; serving pools use 128- or
256-token pages, which SGLang splits right before every call (sgl-project/sglang
``python/sglang/kernels/ops/attention/flash_mla_sm120.py`` ``_split_kv_pages_to_64``, PR #27455).

:func:`page_split` takes a uint8 DSV4 cache of ``P`` pages of ``ps`` tokens (``ps`` a multiple of 64,
``ratio = ps/64``; any form of :func:`pytest_sparse_mla.formats.parse_cache`):

* source page ``p``, sub-page ``s`` becomes destination page ``p*ratio + s`` (its data bytes
  ``[s*36864, +36864)`` and footer bytes ``[ps*576 + s*512, +512)``; offsets in :mod:`.geometry`);
  flat token indices need no remapping. It returns a ``[P*ratio, 64, 1, 584]`` NHD view with strides
  ``(dst_page_stride, 584, 584, 1)`` into the registry's split buffer; ``ps == 64`` returns the input.
* ``touched_indices`` (int32/int64, any shape): only the source pages they reference are copied and
  the int8 mask is rewritten on every call (SGLang PR #32320); ``None`` or empty means a full split.
  Nothing syncs to the host, so the Triton path can be captured in a CUDA graph.
* Scratch lives in a :class:`BufferRegistry` under ``f"{name}{key_suffix}:{device}"`` (SGLang's keys
  for ``key_suffix=""``); a second split in one call needs its own ``key_suffix``.

Backends (:data:`BACKENDS`, byte-identical, ``tests/test_page_split_bundled.py``): ``"torch"``
(:mod:`._torch`, strided-view copies) and ``"triton"`` (:mod:`._triton`, interpreted with
``TRITON_INTERPRET=1`` where there is no CUDA). ``suites/test_page_split.py`` specifies any
implementation's split. Algorithm, buffer rules and their history, kernel design and H200
measurements: ``docs/design/page-split.md``.
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
    """Split a DSV4 packed cache into 64-token pages (module docstring; ``docs/design/page-split.md``).

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
