"""One sparse-MLA call, read once: :class:`SparseMlaCall`.

The arguments of ``sparse_mla_forward`` (the protocol in ``implementations.protocol``) are read
here into one typed object that the bundled reference, the float64 oracle, the peers' adapters and
the envelope check all take: the queries, the main and the extra candidate sources
(:class:`Candidates`: cache, its layout, index rows, valid-prefix lengths), the sink, the score
scale and the LSE convention. Each argument is checked in one place:

* :meth:`SparseMlaCall.read` checks what anyone needs to read the call: the LSE convention, the
  extra cache and its indices given together, each cache (``formats.parse_cache``) and the index
  rows' shape. The peers' adapters read a call this way, so a peer is still judged on the input
  validation it does itself.
* ``validate=True`` (the bundled reference) adds the contract of a well-formed call: BF16 queries
  ``[T, H, d_qk]``, a finite ``sm_scale``, int32 index rows with ``topk >= 1``, ``[T]`` int32
  lengths, an ``[H]`` fp32 sink, every tensor on the queries' device, and no extra-cache argument
  without the extra cache.

Pure torch: no pytest. Errors are ``TypeError`` / ``ValueError`` naming the argument, its value and
what was expected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from pytest_sparse_mla import formats
from pytest_sparse_mla.attention.conventions import check_lse_convention, route_for
from pytest_sparse_mla.envelope import Envelope

__all__ = ["CALL_ARGUMENTS", "Candidates", "SparseMlaCall", "valid_lanes"]

#: The keyword arguments of a call (after ``q, kv_cache, indices``) that :class:`SparseMlaCall` reads.
CALL_ARGUMENTS: tuple[str, ...] = (
    "sm_scale",
    "fmt",
    "page_block_size",
    "topk_length",
    "attn_sink",
    "extra_kv_cache",
    "extra_indices",
    "extra_topk_length",
    "extra_page_block_size",
    "lse_convention",
    "lse_scale",
)


def valid_lanes(indices: torch.Tensor, topk_length: torch.Tensor | None) -> torch.Tensor:
    """The valid-lane rule, the one the bundled reference, the cases and the peers' adapters use:
    ``[T, topk]`` bool, lane ``j`` of token ``t`` is a candidate iff ``indices[t, j] >= 0`` and
    ``j < clamp(topk_length[t], 0, topk)`` (no ``topk_length``: every non-negative lane). Indices
    past the cache are not excluded here. The float64 oracle keeps an independent copy of the
    rule on purpose (``attention.oracle``).

    Args:
        indices: ``[T, topk]`` integer index rows (any integer dtype, any device).
        topk_length: ``[T]`` integer valid-prefix lengths (moved to ``indices``' device), or ``None``.

    Sources: flashinfer-ai/flashinfer ``flashinfer/mla/_sparse_mla_sm120/_api.py`` (``topk_length``:
    the valid prefix of each row; negative indices are masked); deepseek-ai/FlashMLA
    ``flash_mla/flash_mla_interface.py`` (``topk_length``; ``-1`` marks an invalid index).
    """
    valid = indices >= 0
    if topk_length is not None:
        lanes = torch.arange(indices.shape[-1], device=indices.device)
        length = topk_length.to(indices.device).long().clamp(min=0)
        valid &= lanes.unsqueeze(0) < length.unsqueeze(1)
    return valid


@dataclass(frozen=True)
class Candidates:
    """One cache's candidates of a call (the main cache, or the extra cache).

    Attributes:
        cache: the packed uint8 cache as given (any form ``formats.parse_cache`` accepts).
        layout: its ``formats.CacheLayout`` (record format, pages, strides; ``num_tokens`` slots).
        indices: ``[T, topk]`` flat token indices (``page * page_block_size + slot``; negative =
            masked); a ``[T, 1, topk]`` argument is viewed as ``[T, topk]``.
        topk_length: ``[T]`` valid prefix lengths (clamped to ``[0, topk]`` by every consumer), or ``None``.
        page_block_size: the ``page_block_size`` argument as given (``None``: read from the cache's shape).
        names: the argument names of the cache, its indices and its lengths, for messages.
    """

    cache: torch.Tensor
    layout: formats.CacheLayout
    indices: torch.Tensor
    topk_length: torch.Tensor | None
    page_block_size: int | None
    names: tuple[str, str, str]

    @property
    def topk(self) -> int:
        """Index lanes per token (``indices.shape[-1]``)."""
        return int(self.indices.shape[1])

    @property
    def num_slots(self) -> int:
        """Token slots of the cache (``num_pages * page_block_size``): valid indices are below it."""
        return int(self.layout.num_tokens)

    def valid_lanes(self) -> torch.Tensor:
        """``[T, topk]`` bool: this source's candidates (:func:`valid_lanes`); indices past the cache
        are not excluded here."""
        return valid_lanes(self.indices, self.topk_length)


@dataclass(frozen=True)
class SparseMlaCall:
    """A sparse-MLA forward call, read and checked once (module docstring).

    Attributes:
        q: ``[T, H, d_qk]`` queries as given.
        main: the main cache's :class:`Candidates`.
        extra: the extra cache's :class:`Candidates`, or ``None`` (single cache).
        sm_scale: score scale (applied to the full ``d_qk`` dot product).
        attn_sink: ``[H]`` per-head natural-log logit, or ``None``.
        fmt: the call format's name (``formats.CALL_FORMATS``: ``"dsv4"``, ``"dsv3_2"``,
            ``"dsv4_1"``, ...).
        lse_convention, lse_scale: as ``attention.conventions.check_lse_convention`` returns them.
        unpaired: ``extra_topk_length`` / ``extra_page_block_size`` given without an extra cache
            (only when not validating: a peer's adapter passes them on, so the peer's own check is
            judged).
    """

    q: torch.Tensor
    main: Candidates
    extra: Candidates | None
    sm_scale: float
    attn_sink: torch.Tensor | None
    fmt: str
    lse_convention: str
    lse_scale: float
    unpaired: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def read(
        cls,
        q: Any,
        kv_cache: Any,
        indices: Any,
        *,
        sm_scale: Any,
        fmt: formats.PackedFormat | str = "dsv4",
        page_block_size: int | None = None,
        topk_length: Any = None,
        attn_sink: Any = None,
        extra_kv_cache: Any = None,
        extra_indices: Any = None,
        extra_topk_length: Any = None,
        extra_page_block_size: int | None = None,
        lse_convention: str = "flashinfer",
        lse_scale: float = 1.0,
        validate: bool = False,
    ) -> SparseMlaCall:
        """Read the arguments of a ``sparse_mla_forward`` call (the protocol's names and defaults).

        Args:
            validate: also check the contract of a well-formed call (module docstring).

        Raises:
            TypeError: a tensor argument is not a tensor (or, validating, has the wrong dtype: q
                BF16, indices and lengths int32, attn_sink fp32); ``sm_scale``/``lse_scale`` not a
                real number.
            ValueError: an unknown ``fmt`` or LSE convention; ``extra_kv_cache`` without
                ``extra_indices`` or the reverse; a cache ``formats.parse_cache`` refuses; index rows
                not ``[T, topk]`` / ``[T, 1, topk]``; validating: wrong shapes of q, lengths or
                sink, ``topk < 1``, a non-finite ``sm_scale``, tensors on different devices,
                ``extra_topk_length`` / ``extra_page_block_size`` without an extra cache.
        """
        main_fmt, extra_fmt = formats.cache_formats(fmt)
        fmt_name = formats.call_format_name(fmt)
        if validate:
            _check_queries(q, main_fmt)
            sm_scale = _check_scalar(sm_scale, "sm_scale")
        elif not isinstance(q, torch.Tensor):
            raise TypeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
        lse_convention, lse_scale = check_lse_convention(lse_convention, lse_scale)
        if (extra_kv_cache is None) != (extra_indices is None):
            given, missing = ("extra_kv_cache", "extra_indices")[:: 1 if extra_indices is None else -1]
            raise ValueError(
                f"{missing}=None with {given} given: extra_kv_cache and extra_indices must be provided together"
            )
        if validate and extra_kv_cache is None:
            if extra_topk_length is not None:
                raise ValueError("extra_topk_length requires extra_kv_cache and extra_indices")
            if extra_page_block_size is not None:
                raise ValueError("extra_page_block_size requires extra_kv_cache")
        main = _candidates(
            q, kv_cache, indices, topk_length, page_block_size, main_fmt, ("kv_cache", "indices", "topk_length"),
            validate,
        )  # fmt: skip
        if validate and attn_sink is not None:
            check_vector(attn_sink, "attn_sink", torch.float32, int(q.shape[1]), "one logit per head", q)
        extra = None
        if extra_kv_cache is not None:
            extra = _candidates(
                q, extra_kv_cache, extra_indices, extra_topk_length, extra_page_block_size, extra_fmt,
                ("extra_kv_cache", "extra_indices", "extra_topk_length"), validate,
            )  # fmt: skip
        unpaired: tuple[tuple[str, Any], ...] = ()
        if extra_kv_cache is None:
            stray = (("extra_topk_length", extra_topk_length), ("extra_page_block_size", extra_page_block_size))
            unpaired = tuple((name, value) for name, value in stray if value is not None)
        return cls(q, main, extra, sm_scale, attn_sink, fmt_name, lse_convention, lse_scale, unpaired)

    # ---- what the call is

    @property
    def num_tokens(self) -> int:
        """``T``, the query rows."""
        return int(self.q.shape[0])

    @property
    def num_heads(self) -> int:
        """``H``, the query heads."""
        return int(self.q.shape[1])

    @property
    def extra_topk_length(self) -> torch.Tensor | None:
        """The ``extra_topk_length`` argument: the extra cache's lengths, or one given without it."""
        return self.extra.topk_length if self.extra is not None else dict(self.unpaired).get("extra_topk_length")

    @property
    def route(self) -> str:
        """FlashInfer's default route: ``"decode"`` iff ``T <= 64`` (``attention.conventions``)."""
        return route_for(self.num_tokens)

    @property
    def record_formats(self) -> tuple[formats.PackedFormat, formats.PackedFormat]:
        """The record formats of the main and the extra cache (``formats.cache_formats``)."""
        return formats.cache_formats(self.fmt)

    @property
    def sources(self) -> tuple[Candidates, ...]:
        """The main and (when given) the extra :class:`Candidates`, in softmax order."""
        return (self.main,) if self.extra is None else (self.main, self.extra)

    def envelope_reason(self, envelope: Envelope, *, page_sizes: bool = True, lse: bool = True) -> str | None:
        """Why this call lies outside ``envelope``, or ``None``: ``Envelope.call_reason`` (where every
        rule of the envelope lives) asked about this call's shapes (no values, no host
        synchronisation). The guard and the peers' adapters judge every call with this.

        Args:
            envelope: a ``pytest_sparse_mla.Envelope``.
            page_sizes: hold the caches' page sizes to the envelope's.
            lse: hold the call's LSE convention to the envelope's.
        """
        shape = tuple(self.q.shape)
        extra = self.extra
        return envelope.call_reason(
            fmt=self.fmt,
            num_tokens=int(shape[0]) if shape else 0,
            num_heads=int(shape[1]) if len(shape) > 1 else 0,
            topk=self.main.topk,
            extra_topk=extra.topk if extra is not None else None,
            page_block_size=self.main.layout.page_block_size if page_sizes else None,
            extra_page_block_size=extra.layout.page_block_size if extra is not None and page_sizes else None,
            has_topk_length=self.main.topk_length is not None or self.extra_topk_length is not None,
            has_sink=self.attn_sink is not None,
            lse_convention=self.lse_convention if lse else None,
        )

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments (after ``q, kv_cache, indices``) that make this call again."""
        extra, stray = self.extra, dict(self.unpaired)
        return {
            "sm_scale": self.sm_scale,
            "fmt": self.fmt,
            "page_block_size": self.main.page_block_size,
            "topk_length": self.main.topk_length,
            "attn_sink": self.attn_sink,
            "extra_kv_cache": extra.cache if extra else None,
            "extra_indices": extra.indices if extra else None,
            "extra_topk_length": self.extra_topk_length,
            "extra_page_block_size": extra.page_block_size if extra else stray.get("extra_page_block_size"),
            "lse_convention": self.lse_convention,
            "lse_scale": self.lse_scale,
        }


def _candidates(
    q: torch.Tensor,
    cache: Any,
    indices: Any,
    topk_length: Any,
    page_block_size: int | None,
    fmt: formats.PackedFormat,
    names: tuple[str, str, str],
    validate: bool,
) -> Candidates:
    layout = formats.parse_cache(cache, fmt, page_block_size=page_block_size, name=names[0])
    num_tokens = int(q.shape[0])
    if validate:
        _check_same_device(cache, names[0], q)
    rows = _index_rows(indices, names[1], num_tokens, q if validate else None)
    if validate and topk_length is not None:
        check_vector(topk_length, names[2], torch.int32, num_tokens, "one length per token", q)
    return Candidates(cache, layout, rows, topk_length, page_block_size, names)


def _check_queries(q: Any, f: formats.PackedFormat) -> None:
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    if q.dtype != torch.bfloat16:
        raise TypeError(f"q.dtype={q.dtype}: expected torch.bfloat16")
    if q.dim() != 3 or q.shape[2] != f.d_qk:
        raise ValueError(f"q.shape={tuple(q.shape)}: expected [num_tokens, num_heads, {f.d_qk}] for {f.name}")
    if q.shape[1] < 1:
        raise ValueError(f"q.shape={tuple(q.shape)}: expected at least one head")


def _check_same_device(tensor: torch.Tensor, name: str, q: torch.Tensor) -> None:
    if tensor.device != q.device:
        raise ValueError(f"{name} is on {tensor.device}, but q is on {q.device}; expected one device")


def _index_rows(indices: Any, name: str, num_tokens: int, q: torch.Tensor | None) -> torch.Tensor:
    """``indices`` as a ``[T, topk]`` view; with ``q`` (validating) also int32, ``topk >= 1``, q's device."""
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(indices).__name__}")
    if q is not None:
        if indices.dtype != torch.int32:
            raise TypeError(f"{name}.dtype={indices.dtype}: expected torch.int32 flat token indices")
        _check_same_device(indices, name, q)
    if indices.dim() == 3 and indices.shape[1] == 1:
        indices = indices[:, 0]
    if indices.dim() != 2 or indices.shape[0] != num_tokens:
        raise ValueError(
            f"{name}.shape={tuple(indices.shape)}: expected [num_tokens={num_tokens}, topk] or [num_tokens, 1, topk]"
        )
    if q is not None and indices.shape[1] < 1:
        raise ValueError(f"{name}.shape={tuple(indices.shape)}: expected topk >= 1")
    return indices


def check_vector(value: Any, name: str, dtype: torch.dtype, length: int, what: str, q: torch.Tensor) -> None:
    """Refuse ``value`` unless it is a ``[length]`` tensor of ``dtype`` on ``q``'s device (``what``:
    the words for one element, e.g. ``"one length per token"``).

    Raises:
        TypeError: not a tensor, or another dtype. ValueError: another shape, or another device.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if value.dtype != dtype:
        raise TypeError(f"{name}.dtype={value.dtype}: expected {dtype}")
    _check_same_device(value, name, q)
    if value.dim() != 1 or value.shape[0] != length:
        raise ValueError(f"{name}.shape={tuple(value.shape)}: expected [{length}] ({what})")


def _check_scalar(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}={value!r}: expected a real number")
    if not math.isfinite(float(value)):
        raise ValueError(f"{name}={value!r}: expected a finite number")
    return float(value)
