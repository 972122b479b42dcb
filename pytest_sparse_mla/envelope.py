"""What a sparse-MLA forward serves and how it behaves: its envelope.

Production kernels take a narrow set of shapes (FlashMLA's SM90 sparse decode: 64 or 128 heads,
top-k widths that are multiples of 64; deepseek-ai/FlashMLA ``csrc/api/sparse_decode.h``). An
implementation says so with an ``envelope`` attribute, an :class:`Envelope`; the suites then build
every error class at shapes inside it (``attention.cases.fit_case``) and never call the kernel
outside it. An implementation without one is taken to serve everything (:data:`UNIVERSAL`).

Declaring one, in a few lines::

    from pytest_sparse_mla import Envelope, Widths

    envelope = Envelope(
        num_heads=(64, 128),
        topk=Widths(multiple=64),
        extra_topk=Widths(multiple=64),
        topk_length_formats=("dsv4",),
        masked_indices="minus_one",
    )

Devices stay with the protocol's ``skip_reason(capability, device)``. A call the kernel refuses at
run time raises :class:`Unsupported` (reported as a skip when the implementation declares no
envelope; a failure when the call lies inside the envelope it declared).

This module imports neither torch nor pytest.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pytest_sparse_mla.formats import CALL_FORMATS

__all__ = [
    "ALL_FORMATS",
    "DECODE_MAX_TOKENS",
    "DEFAULT_FORMATS",
    "INVARIANCE_CLAIMS",
    "Envelope",
    "NotApplicable",
    "UNIVERSAL",
    "Unsupported",
    "Widths",
    "route_of",
]

#: FlashInfer's decode cutoff in tokens (``_DECODE_MAX_TOKENS = 64`` in flashinfer-ai/flashinfer
#: ``flashinfer/mla/_sparse_mla_sm120/_policy.py``): ``num_tokens <= 64`` is the decode route. The one
#: definition: ``attention.conventions`` imports it.
DECODE_MAX_TOKENS = 64
#: Every attention call format an envelope may name: the entries of ``formats.CALL_FORMATS`` with
#: ``envelope=True`` (``"dsv4"``, ``"dsv3_2"``, ``"dsv4_1"``), in the table's order.
ALL_FORMATS: tuple[str, ...] = tuple(name for name, entry in CALL_FORMATS.items() if entry.envelope)
#: The formats of the default envelope (:data:`UNIVERSAL`, and every format field's default): the
#: entries with ``default_envelope=True`` (``"dsv4"``, ``"dsv3_2"``; V4.1 is declared by the kernel
#: that reads its records).
DEFAULT_FORMATS: tuple[str, ...] = tuple(name for name, entry in CALL_FORMATS.items() if entry.default_envelope)
#: Invariance claims an envelope may make bit for bit (``Envelope.bitwise_invariance``).
INVARIANCE_CLAIMS: tuple[str, ...] = ("padding", "heads", "batch", "layout")

LseConvention = Literal["flashinfer", "flashmla"]


class Unsupported(NotImplementedError):
    """Raised by a kernel for a call it refuses at run time; ``str(error)`` says why.

    Without a declared envelope the test is reported as skipped with this reason. With one, a
    refusal of a call inside the envelope is a failure (the envelope promised it).
    """


class NotApplicable(Exception):
    """An error class that cannot exist inside an envelope (e.g. an extra cache for a kernel that
    takes none); ``str(error)`` names the envelope field and the value that rules it out."""


def route_of(num_tokens: int) -> str:
    """``"decode"`` for ``num_tokens <= 64`` (:data:`DECODE_MAX_TOKENS`), else ``"prefill"``."""
    return "decode" if num_tokens <= DECODE_MAX_TOKENS else "prefill"


@dataclass(frozen=True)
class Widths:
    """Index-row widths (lanes per token) a kernel takes.

    Attributes:
        multiple: the width must be a multiple of this (FlashMLA: 64, its top-k tile).
        min: smallest width (>= 1).
        max: largest width, or ``None`` for no bound.

    Raises:
        ValueError: ``multiple`` or ``min`` below 1, or ``max`` below ``min`` or not a multiple.
    """

    multiple: int = 1
    min: int = 1
    max: int | None = None

    def __post_init__(self) -> None:
        if self.multiple < 1 or self.min < 1:
            raise ValueError(f"Widths(multiple={self.multiple}, min={self.min}): expected both >= 1")
        if self.max is not None and (self.max < self.min or self.max % self.multiple):
            raise ValueError(f"Widths(max={self.max}): expected >= min={self.min} and a multiple of {self.multiple}")

    def reason(self, name: str, width: int) -> str | None:
        """Why ``width`` lanes are not taken (naming ``name``), or ``None``."""
        if width % self.multiple:
            return f"{name}={width} is not a multiple of {self.multiple}"
        if width < self.min:
            return f"{name}={width} is below the smallest width {self.min}"
        if self.max is not None and width > self.max:
            return f"{name}={width} is above the largest width {self.max}"
        return None

    def fit(self, width: int) -> tuple[int, int]:
        """``(drawn, row)``: how many of ``width`` lanes to draw and the row width to pass, the
        row rounded up to the multiple (extra lanes are masked padding), capped at ``max``."""
        drawn = width if self.max is None else min(width, self.max)
        row = max(self.min, -(-drawn // self.multiple) * self.multiple)
        if self.max is not None:
            row = min(row, self.max)
        return min(drawn, row), row


def _expected_tuple(name: str, value: Any, expected: str, example: Any) -> str:
    """The message of a tuple field of :class:`Envelope` given a wrong value: the field, the value,
    what was expected, and for a lone value (a str or a number, not a tuple) how to write a tuple."""
    shown = sorted(value, key=str) if isinstance(value, (set, frozenset)) else value
    text = f"Envelope({name}={shown!r}): expected {expected}"
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        text += f", got a {type(value).__name__} (a tuple of one is written with a trailing comma: ({example!r},))"
    elif not isinstance(value, (tuple, frozenset, set)) and value is not None:
        text += f", got a {type(value).__name__}"
    return text


@dataclass(frozen=True)
class Envelope:
    """The calls a ``sparse_mla_forward`` serves and the conventions it follows.

    Every field has the permissive default, so ``Envelope()`` is :data:`UNIVERSAL` and a
    declaration names only what the kernel restricts.

    Attributes:
        formats: packed cache formats taken: ``"dsv4"`` (584 B/token), ``"dsv3_2"`` (656 B/token),
            ``"dsv4_1"`` (DeepSeek-V4.1: 528 B SWA records in the main cache, 288 B indexed FP4
            records in the extra cache): :data:`ALL_FORMATS`, from ``formats.CALL_FORMATS``. The
            default (:data:`DEFAULT_FORMATS`) leaves V4.1 out: a kernel that reads its records declares it.
        num_heads: head counts taken, or ``None`` for any ``H >= 1``.
        topk, extra_topk: main / extra index-row widths (:class:`Widths`).
        extra_cache_formats: formats for which an ``extra_kv_cache`` is taken (``()``: none).
        page_block_sizes, extra_page_block_sizes: tokens per page of the main / extra cache
            taken, or ``None`` for any.
        topk_length_formats: formats for which ``topk_length`` / ``extra_topk_length`` are taken.
        topk_length_range: ``"clamped"`` (any int32 is clamped to ``[0, width]``: negative means
            0, longer than the row means all of it) or ``"row"`` (values must lie in
            ``[0, width]``; FlashMLA sizes its work from the raw value).
        min_tokens, max_tokens: ``num_tokens`` taken (``max_tokens`` ``None``: no bound). The
            decode route is ``num_tokens <= 64``, prefill above (:func:`route_of`).
        attn_sink: whether an ``attn_sink`` is taken.
        sink_formats: formats for which an ``attn_sink`` is taken (with ``attn_sink=True``).
        masked_indices: ``"negative"`` (every negative index masks its lane) or ``"minus_one"``
            (only ``-1``; FlashMLA's decode reads other negatives as huge page numbers).
        index_past_cache: what a valid lane whose index is ``>= num_pages * page_block_size``
            does: ``"masked"`` (like ``-1``), ``"refused"`` (an error naming the argument) or
            ``"undefined"`` (the suites never pass one).
        lse_conventions: the ``lse_convention`` values the forward honours (``"flashinfer"``:
            log2, sink included, times ``lse_scale``; ``"flashmla"``: natural log, sink excluded;
            ``attention.conventions``). ``()``: it returns no LSE (a bare output tensor, or a
            result whose ``lse`` is ``None``); the output is still judged in full.
        bitwise_invariance: claims (:data:`INVARIANCE_CLAIMS`) that hold bit for bit: index
            padding width, head independence, batch independence, cache layout. Unclaimed ones
            are judged within the tolerance of two roundings.
        notes: further facts, each with its public source.
    """

    formats: tuple[str, ...] = DEFAULT_FORMATS
    num_heads: tuple[int, ...] | None = None
    topk: Widths = Widths()
    extra_topk: Widths = Widths()
    extra_cache_formats: tuple[str, ...] = DEFAULT_FORMATS
    page_block_sizes: tuple[int, ...] | None = None
    extra_page_block_sizes: tuple[int, ...] | None = None
    topk_length_formats: tuple[str, ...] = DEFAULT_FORMATS
    topk_length_range: Literal["clamped", "row"] = "clamped"
    min_tokens: int = 0
    max_tokens: int | None = None
    attn_sink: bool = True
    sink_formats: tuple[str, ...] = DEFAULT_FORMATS
    masked_indices: Literal["negative", "minus_one"] = "negative"
    index_past_cache: Literal["masked", "refused", "undefined"] = "refused"
    lse_conventions: tuple[LseConvention, ...] = ("flashinfer", "flashmla")
    bitwise_invariance: frozenset[str] = frozenset()
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("formats", "extra_cache_formats", "topk_length_formats", "sink_formats"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not set(value) <= set(ALL_FORMATS):
                raise ValueError(_expected_tuple(name, value, f"a tuple of {sorted(ALL_FORMATS)}", "dsv4"))
        if not self.formats:
            raise ValueError("Envelope(formats=()): expected at least one format")
        for name in ("num_heads", "page_block_sizes", "extra_page_block_sizes"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, tuple) or not value or not all(isinstance(v, int) and v >= 1 for v in value)
            ):
                raise ValueError(_expected_tuple(name, value, "None or a tuple of positive ints", 64))
        for name in ("topk", "extra_topk"):
            if not isinstance(getattr(self, name), Widths):
                raise TypeError(f"Envelope({name}={getattr(self, name)!r}): expected a Widths")
        choices: dict[str, tuple[str, ...]] = {
            "topk_length_range": ("clamped", "row"),
            "masked_indices": ("negative", "minus_one"),
            "index_past_cache": ("masked", "refused", "undefined"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"Envelope({name}={getattr(self, name)!r}): expected one of {allowed}")
        if not isinstance(self.lse_conventions, tuple) or not set(self.lse_conventions) <= {"flashinfer", "flashmla"}:
            raise ValueError(
                _expected_tuple(
                    "lse_conventions", self.lse_conventions, "a tuple of 'flashinfer'/'flashmla'", "flashmla"
                )
            )
        claims = self.bitwise_invariance
        if not isinstance(claims, (frozenset, set, tuple)) or not set(claims) <= set(INVARIANCE_CLAIMS):
            raise ValueError(
                _expected_tuple(
                    "bitwise_invariance", claims, f"a frozenset (or tuple) of {INVARIANCE_CLAIMS}", "padding"
                )
            )
        if not isinstance(self.notes, tuple) or not all(isinstance(n, str) for n in self.notes):
            raise ValueError(_expected_tuple("notes", self.notes, "a tuple of str", "a fact, with its source"))
        if self.min_tokens < 0 or (self.max_tokens is not None and self.max_tokens < max(self.min_tokens, 1)):
            raise ValueError(f"Envelope(min_tokens={self.min_tokens}, max_tokens={self.max_tokens}): bad range")

    # ---- questions the case fitting and the guard ask

    @property
    def returns_lse(self) -> bool:
        """Whether the forward returns an LSE (``lse_conventions`` is not empty)."""
        return bool(self.lse_conventions)

    @property
    def lse_convention(self) -> str | None:
        """The convention the suites ask for: ``"flashinfer"`` when honoured, else the first one
        declared, else ``None`` (no LSE)."""
        return "flashinfer" if "flashinfer" in self.lse_conventions else next(iter(self.lse_conventions), None)

    def takes_extra(self, fmt: str) -> bool:
        """Whether an extra cache is taken for ``fmt``."""
        return fmt in self.extra_cache_formats

    def takes_lengths(self, fmt: str) -> bool:
        """Whether ``topk_length`` / ``extra_topk_length`` are taken for ``fmt``."""
        return fmt in self.topk_length_formats

    def takes_sink(self, fmt: str) -> bool:
        """Whether an ``attn_sink`` is taken for ``fmt``."""
        return self.attn_sink and fmt in self.sink_formats

    def heads_for(self, num_heads: int) -> int:
        """``num_heads`` if taken, else the smallest taken count above it, else the largest."""
        if self.num_heads is None or num_heads in self.num_heads:
            return num_heads
        above = [h for h in self.num_heads if h >= num_heads]
        return min(above) if above else max(self.num_heads)

    def tokens_for(self, num_tokens: int) -> int:
        """``num_tokens`` moved into ``[min_tokens, max_tokens]``."""
        hi = num_tokens if self.max_tokens is None else min(num_tokens, self.max_tokens)
        return max(self.min_tokens, hi)

    @staticmethod
    def page_for(page_block_size: int, taken: tuple[int, ...] | None) -> int:
        """``page_block_size`` if in ``taken`` (``None``: any), else the nearest taken size."""
        if taken is None or page_block_size in taken:
            return page_block_size
        return min(taken, key=lambda p: (abs(p - page_block_size), p))

    # ---- the envelope's rules: one reason each (``None``: the call is inside on that rule)

    def format_reason(self, fmt: str) -> str | None:
        """Why call format ``fmt`` is not taken, or ``None``."""
        return None if fmt in self.formats else f"format {fmt!r} is not in formats={self.formats}"

    def tokens_reason(self, num_tokens: int) -> str | None:
        """Why ``num_tokens`` is not taken, or ``None``."""
        if num_tokens < self.min_tokens or (self.max_tokens is not None and num_tokens > self.max_tokens):
            return f"num_tokens={num_tokens} is outside [{self.min_tokens}, {self.max_tokens}]"
        return None

    def heads_reason(self, num_heads: int) -> str | None:
        """Why ``num_heads`` is not taken, or ``None``."""
        if self.num_heads is not None and num_heads not in self.num_heads:
            return f"num_heads={num_heads} is not in num_heads={self.num_heads}"
        return None

    def extra_reason(self, fmt: str) -> str | None:
        """Why an extra cache is not taken for ``fmt``, or ``None``."""
        if self.takes_extra(fmt):
            return None
        return f"an extra cache for {fmt!r} (extra_cache_formats={self.extra_cache_formats})"

    def page_reason(self, name: str, page_block_size: int) -> str | None:
        """Why ``page_block_size`` is not taken for the cache ``name`` names (``"page_block_size"``:
        the main cache, ``"extra_page_block_size"``: the extra cache), or ``None``."""
        taken = self.extra_page_block_sizes if name.startswith("extra") else self.page_block_sizes
        if taken is not None and page_block_size not in taken:
            return f"{name}={page_block_size} is not in {taken}"
        return None

    def lengths_reason(self, fmt: str) -> str | None:
        """Why ``topk_length`` / ``extra_topk_length`` are not taken for ``fmt``, or ``None``."""
        if self.takes_lengths(fmt):
            return None
        return f"topk_length for {fmt!r} (topk_length_formats={self.topk_length_formats})"

    def length_value_reason(self, name: str, value: int, width: int) -> str | None:
        """Why one ``topk_length`` value ``value`` of a ``width``-lane row (argument ``name``) is not
        taken (``topk_length_range="row"``: outside ``[0, width]``), or ``None``."""
        if self.topk_length_range == "row" and not 0 <= value <= width:
            return f"{name}={value} outside [0, {width}] (topk_length_range='row')"
        return None

    def sink_reason(self, fmt: str) -> str | None:
        """Why an ``attn_sink`` is not taken for ``fmt``, or ``None``."""
        if self.takes_sink(fmt):
            return None
        return f"an attn_sink for {fmt!r} (attn_sink={self.attn_sink}, sink_formats={self.sink_formats})"

    def lse_reason(self, lse_convention: str) -> str | None:
        """Why ``lse_convention`` is not honoured, or ``None`` (also for a forward without an LSE:
        its output is judged whatever convention is asked)."""
        if self.returns_lse and lse_convention not in self.lse_conventions:
            return f"lse_convention={lse_convention!r} is not in lse_conventions={self.lse_conventions}"
        return None

    # ---- a call against every rule

    def call_reason(
        self,
        *,
        fmt: str,
        num_tokens: int,
        num_heads: int,
        topk: int,
        extra_topk: int | None = None,
        page_block_size: int | None = None,
        extra_page_block_size: int | None = None,
        has_topk_length: bool = False,
        has_sink: bool = False,
        lse_convention: str | None = None,
    ) -> str | None:
        """Why a call of this shape lies outside the envelope, or ``None`` (shapes only, no values):
        the first reason of the rules above, in this order: format, ``num_tokens``, ``num_heads``,
        ``topk``, the extra cache and ``extra_topk``, page sizes, lengths, sink, LSE convention
        (``None`` arguments are not judged)."""
        return (
            self.format_reason(fmt)
            or self.tokens_reason(num_tokens)
            or self.heads_reason(num_heads)
            or self.topk.reason("topk", topk)
            or (
                None
                if extra_topk is None
                else self.extra_reason(fmt) or self.extra_topk.reason("extra_topk", extra_topk)
            )
            or (None if page_block_size is None else self.page_reason("page_block_size", page_block_size))
            or (
                None
                if extra_page_block_size is None
                else self.page_reason("extra_page_block_size", extra_page_block_size)
            )
            or (self.lengths_reason(fmt) if has_topk_length else None)
            or (self.sink_reason(fmt) if has_sink else None)
            or (None if lse_convention is None else self.lse_reason(lse_convention))
        )

    def as_dict(self) -> dict[str, Any]:
        """The envelope as a JSON-ready dict (reports, ``docs/conformance.json``)."""
        out = asdict(self)
        out["bitwise_invariance"] = sorted(self.bitwise_invariance)
        for key, value in out.items():
            if isinstance(value, tuple):
                out[key] = list(value)
        return out


#: The envelope of an implementation that declares none: every call in the :data:`DEFAULT_FORMATS`
#: (DSV4 and DSV3.2).
UNIVERSAL = Envelope()
