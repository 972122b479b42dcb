"""The search: sparse-MLA calls drawn by Hypothesis over the input space, inside an envelope.

The fixed cases (``attention.cases``) draw inputs someone chose; a kernel wrong only at a magnitude,
a page size, a score regime or a sink nobody chose passes them. This module draws whole calls from
the input-space model (``pytest_sparse_mla.input_space``: every dimension, its legal range and the
values drawn) restricted to what the implementation's :class:`~pytest_sparse_mla.envelope.Envelope`
declares, and builds their tensors so that every drawn call also checks what the fixed suites check
one case at a time:

* **unreferenced bytes are poison**: every cache byte no valid lane reads (other tokens' records,
  page padding, other layers of the pool) is an E4M3/UE8M0 NaN pattern, and lanes past
  ``topk_length`` name poisoned slots (or FlashInfer's stale ``1 << 30``, or ``-1``);
* **nothing is written outside the outputs**: each cache lies inside a larger allocation with
  random canary bytes before and after it; every input tensor's whole storage is compared byte
  for byte after the call;
* **scores are placed, not hoped for**: queries are scaled per (token, head) so that the row's
  logits (with the call's ``sm_scale``) have the drawn spread and common offset, optionally one
  dominant candidate, using a key component shared by every cache row; the sink is drawn relative
  to each head's LSE.

:func:`calls` is the Hypothesis strategy of :class:`DrawnCall` (plain values: Hypothesis shrinks
them to a minimal call); :func:`build` turns one into :class:`SearchInputs` on a device;
:func:`diagnose` names the likely cause of a failure from the evidence (which counterfactual call
the kernel's output matches; where the bad rows are); :func:`record` is what the coverage report
keeps of a drawn call, keyed by the model's dimension names.

Imports torch and hypothesis (a ``test`` extra): only the search suite imports it.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

from pytest_sparse_mla import formats, input_space, regions
from pytest_sparse_mla.diagnosis import LANE_KEYS, MATCHED, cause_keys, cause_line
from pytest_sparse_mla.envelope import Envelope

__all__ = [
    "DrawnCache", "DrawnCall", "LARGEST_SCALE_LANES", "SCALE_ENDS", "SearchInputs", "build", "calls", "diagnose",
    "next_step", "pool_class", "record", "rewritten_in_place", "unshrunk_phases", "with_shape_of",
]  # fmt: skip

INT32_MIN = -(2**31)
#: The byte of a canary region before and after each cache is drawn per call; these are the bytes
#: that poison never-read cache bytes (E4M3 NaN ``0x7f`` / ``0xff``; as a UE8M0 scale ``0xff`` is NaN).
POISON_BYTES: tuple[int, ...] = (0x7F, 0xFF)
_STALE = 1 << 30
#: The smallest and largest scale each scale encoding holds, as the bytes the builder writes
#: (``DrawnCache.scale_end``): UE8M0 byte 0 (``2**-127``, a subnormal in fp32) and 254
#: (``2**127``; 255 is NaN, OCP MX spec); fp32 ``2**-126`` (the smallest normal) and ``2**127``;
#: E4M3 byte ``0x01`` (``2**-9``, its smallest subnormal) and ``0x7E`` (448, its largest finite).
#: The most lanes (main + extra) a row may have when a cache holds the largest scales: with
#: values up to ``1.5 * 2**119`` the unnormalised fp32 sum of 256 lanes stays below ``2**128``.
LARGEST_SCALE_LANES = 256
#: What the search draws for ``DrawnCache.scale_end`` (mostly the packer's own scales).
_SCALE_DRAWS = ("none", "none", "none", "none", "smallest", "largest")
SCALE_ENDS: dict[str, dict[str, bytes]] = {
    "ue8m0": {"smallest": bytes([0]), "largest": bytes([254])},
    "fp32": {"smallest": struct.pack("<f", 2.0**-126), "largest": struct.pack("<f", 2.0**127)},
    "e4m3": {"smallest": bytes([0x01]), "largest": bytes([0x7E])},
}


@dataclass(frozen=True)
class DrawnCache:
    """One cache of a drawn call, as plain values (what Hypothesis draws and shrinks).

    Attributes:
        width: index lanes per token (``topk``; a multiple the envelope takes).
        page_block_size, num_pages: tokens per page, pages.
        lengths: ``None`` (no length tensor) or ``(low, high)``: per-token lengths uniform in it.
        masked_fraction: fraction of lanes set to the mask value; ``scattered`` places them
            anywhere in the row, else at its end.
        mask_value: ``-1``, ``-2`` or ``INT32_MIN`` (the latter two only where every negative masks).
        pattern: valid lanes' slots: ``"uniform"``, ``"few"`` (at most 3 distinct slots: duplicates),
            ``"ends"`` (slot 0 and the last slot included), ``"one-page"``.
        stale: what lanes past ``topk_length`` hold (``input_space.STALE_VALUES``).
        value_exponent, rope_exponent: powers of two scaling the NoPE and the RoPE part.
        wide: per-64-group magnitudes spread over ``2**-24 .. 2**8``.
        form, stride: tensor form; ``"tight"``, ``"padded"`` or extra bytes (an int) over padded.
        layer, num_layers: the cache is layer ``layer`` of a pool of ``num_layers`` (the others poison).
        canary: canary bytes before the cache in its allocation (the same count follows it).
        scale_end: ``"none"`` (the scales the packer writes), or every scale of every stored record
            rewritten to the format's ``"smallest"`` or ``"largest"`` encodable scale
            (:data:`SCALE_ENDS`; with the largest, the E4M3 codes are redrawn among the three
            smallest subnormals, and the call has at most :data:`LARGEST_SCALE_LANES` lanes, so an
            fp32 accumulation of a row stays finite).
    """

    width: int
    page_block_size: int
    num_pages: int
    lengths: tuple[int, int] | None
    masked_fraction: float
    scattered: bool
    mask_value: int
    pattern: str
    stale: str
    value_exponent: int
    rope_exponent: int
    wide: bool
    form: str
    stride: str | int
    layer: int
    num_layers: int
    canary: int
    scale_end: str = "none"


@dataclass(frozen=True)
class DrawnCall:
    """A drawn ``sparse_mla_forward`` call, as plain values.

    Attributes:
        fmt, num_tokens, num_heads: call format, ``T``, ``H``.
        main, extra: the caches (``extra`` ``None``: one cache).
        empty_fraction: fraction of tokens whose every lane (both caches) is masked.
        sm_scale: ``(name, value)``; the name is one of ``input_space.SM_SCALES`` or ``"log-uniform"``.
        score_spread, score_offset, peak: the logit regime (``input_space``; ``peak`` 0: none).
        sink: ``None`` (no ``attn_sink``) or one offset per head cycle (``-inf`` allowed).
        lse_convention, lse_scale: ``None`` when the implementation returns no LSE.
        strided_query: the queries are a view with padded head and token strides.
        poison: the byte of never-read cache bytes.
        seed: seed of the tensors' generator.
    """

    fmt: str
    num_tokens: int
    num_heads: int
    main: DrawnCache
    extra: DrawnCache | None
    empty_fraction: float
    sm_scale: tuple[str, float]
    score_spread: float
    score_offset: float
    peak: float
    sink: tuple[float, ...] | None
    lse_convention: str | None
    lse_scale: float
    strided_query: bool
    poison: int
    seed: int

    def describe(self) -> str:
        """One line: the call's shape and regime (failure messages, notes)."""
        parts = [f"{self.fmt} T={self.num_tokens} H={self.num_heads}", _cache_words("main", self.main)]
        if self.extra is not None:
            parts.append(_cache_words("extra", self.extra))
        sink = "none" if self.sink is None else "[" + ", ".join(f"{s:g}" for s in self.sink) + "]+LSE"
        parts.append(
            f"sm_scale={self.sm_scale[0]} spread={self.score_spread:g} offset={self.score_offset:g} "
            f"peak={self.peak:g} sink={sink} lse={self.lse_convention}x{self.lse_scale:.3g} "
            f"empty={self.empty_fraction:g} strided_q={self.strided_query} poison=0x{self.poison:02x} seed={self.seed}"
        )
        return "; ".join(parts)


def _cache_words(name: str, c: DrawnCache) -> str:
    lengths = "none" if c.lengths is None else f"{c.lengths[0]}..{c.lengths[1]}"
    return (
        f"{name}: topk={c.width} ps={c.page_block_size} pages={c.num_pages} lengths={lengths} "
        f"masked={c.masked_fraction:g}{'/scattered' if c.scattered else ''} ({c.mask_value}) {c.pattern} "
        f"stale={c.stale} 2**{c.value_exponent} rope 2**{c.rope_exponent}{' wide' if c.wide else ''} "
        f"{c.form}/{c.stride} layer {c.layer}/{c.num_layers} canary {c.canary}"
        + ("" if c.scale_end == "none" else f" scales={c.scale_end}")
    )


# --- strategies ------------------------------------------------------------------------------------


def _widths(widths: Any, cap: int) -> st.SearchStrategy[int]:
    """Index-row widths taken by ``widths`` (an ``envelope.Widths``) up to ``cap``."""
    lo = max(widths.min, widths.multiple)
    lo = -(-lo // widths.multiple) * widths.multiple
    hi = cap if widths.max is None else min(cap, widths.max)
    hi = max(lo, hi - hi % widths.multiple)
    steps = st.integers(lo // widths.multiple, hi // widths.multiple).map(lambda k: k * widths.multiple)
    return st.one_of(st.sampled_from(sorted({lo, min(hi, 128 - 128 % widths.multiple or lo)})), steps)


def _pages(taken: tuple[int, ...] | None, sizes: tuple[int, ...]) -> st.SearchStrategy[int]:
    return st.sampled_from(list(taken) if taken is not None else list(sizes))


@st.composite
def _cache(
    draw: Any, envelope: Envelope, fmt: formats.PackedFormat, width_spec: Any, pages: tuple[int, ...] | None,
    sizes: tuple[int, ...], cap: int, max_pages: int, with_lengths: bool,
) -> DrawnCache:  # fmt: skip
    width = draw(_widths(width_spec, cap))
    ps = draw(_pages(pages, sizes))
    min_pages = max(1, -(-min(width, 64) // ps))
    num_pages = draw(st.integers(min_pages, max(min_pages, max_pages // max(1, ps // 16))))
    lengths = None
    if with_lengths and draw(st.booleans()):
        row = envelope.topk_length_range == "row"
        lo = draw(st.integers(0 if row else -3, width))
        hi = draw(st.integers(lo, width if row else width + 3))
        lengths = (lo, hi)
    negative = envelope.masked_indices == "negative"
    bpt = fmt.bytes_per_token
    strides: list[str | int] = ["padded", 16, 256]
    if (ps * bpt) % 16 == 0:
        strides.insert(0, "tight")
    num_layers = draw(st.integers(1, 4))
    return DrawnCache(
        width=width,
        page_block_size=ps,
        num_pages=num_pages,
        lengths=lengths,
        masked_fraction=draw(st.sampled_from([0.5, 0.0, 0.25, 0.9, 1.0])),
        scattered=draw(st.booleans()),
        mask_value=draw(st.sampled_from([-1, -2, INT32_MIN] if negative else [-1])),
        pattern=draw(st.sampled_from(["uniform", "few", "ends", "one-page"])),
        stale=draw(st.sampled_from(input_space.STALE_VALUES)),
        value_exponent=draw(
            st.one_of(st.just(0), st.sampled_from([12, -20, 60]), st.integers(*input_space.VALUE_EXPONENTS))
        ),
        rope_exponent=draw(st.one_of(st.just(0), st.integers(*input_space.VALUE_EXPONENTS))),
        wide=draw(st.booleans()),
        form=draw(st.sampled_from(list(formats.FORMS)[::-1])),  # nhd first: the common form
        stride=draw(st.sampled_from(strides)),
        layer=draw(st.integers(0, num_layers - 1)),
        num_layers=num_layers,
        canary=draw(st.sampled_from([0, 256, 4096])),
        scale_end=draw(st.sampled_from(_SCALE_DRAWS if width <= LARGEST_SCALE_LANES // 2 else _SCALE_DRAWS[:-1])),
    )


@st.composite
def calls(draw: Any, envelope: Envelope, device: str = "cpu") -> DrawnCall:
    """Hypothesis strategy of :class:`DrawnCall` inside ``envelope``; ``device`` ``"cuda"`` draws
    larger calls (more tokens and lanes).

    Every drawn call is one the envelope takes (formats, tokens, heads, widths, page sizes, extra
    cache, lengths and their range, sink, masking, LSE conventions), so the guard never refuses it.
    """
    cuda = device == "cuda"
    fmt_name = draw(st.sampled_from(list(envelope.formats)))
    main_fmt, extra_fmt = formats.cache_formats(fmt_name)
    top = 300 if cuda else 96
    lo_t = max(1, envelope.min_tokens)
    hi_t = top if envelope.max_tokens is None else max(lo_t, min(top, envelope.max_tokens))
    special = [t for t in (lo_t, 64, 65, hi_t) if lo_t <= t <= hi_t]
    num_tokens = draw(st.one_of(st.sampled_from(special), st.integers(lo_t, hi_t)))
    heads = list(envelope.num_heads) if envelope.num_heads is not None else None
    num_heads = draw(
        st.sampled_from(heads) if heads else st.one_of(st.integers(1, 40), st.sampled_from([64, 128, 192, 256]))
    )
    if num_tokens * num_heads > (4096 if not cuda else 65536):  # keep a CPU example cheap
        num_tokens = max(lo_t, min(num_tokens, (4096 if not cuda else 65536) // num_heads))
    lengths_ok = envelope.takes_lengths(fmt_name)
    cap = 1100 if cuda else 320
    main_sizes = (64, 1, 2, 16, 128, 256, 3, 48, 96)
    main = draw(_cache(envelope, main_fmt, envelope.topk, envelope.page_block_sizes, main_sizes,
                       cap, 12, lengths_ok))  # fmt: skip
    extra = None
    if envelope.takes_extra(fmt_name) and draw(st.booleans()):
        extra = draw(_cache(envelope, extra_fmt, envelope.extra_topk, envelope.extra_page_block_sizes,
                            (64, 2, 1, 4, 3, 48), cap, 64, lengths_ok))  # fmt: skip
    name = draw(st.sampled_from([*input_space.SM_SCALES, "log-uniform"]))
    if name == "log-uniform":
        scale = 2.0 ** draw(st.floats(-12.0, 4.0, allow_nan=False))
    else:
        scale = input_space.SM_SCALES[name]
    sink = None
    if envelope.takes_sink(fmt_name) and draw(st.booleans()):
        kinds = st.one_of(st.sampled_from(input_space.SINK_OFFSETS), st.just(-math.inf))
        sink = tuple(draw(st.lists(kinds, min_size=1, max_size=4)))
    convention = draw(st.sampled_from(list(envelope.lse_conventions))) if envelope.returns_lse else None
    lse_scale = draw(st.sampled_from([1.0, math.log(2.0), 0.5])) if convention == "flashinfer" else 1.0
    return DrawnCall(
        fmt=fmt_name,
        num_tokens=num_tokens,
        num_heads=num_heads,
        main=main,
        extra=extra,
        empty_fraction=draw(st.sampled_from([0.0, 0.25, 1.0])),
        sm_scale=(name, scale),
        score_spread=draw(st.sampled_from(input_space.SCORE_SPREADS[2:] + input_space.SCORE_SPREADS[:2])),
        score_offset=draw(st.sampled_from(sorted(input_space.SCORE_OFFSETS, key=abs))),
        peak=draw(st.sampled_from((0.0, *input_space.PEAKS))),
        sink=sink,
        lse_convention=convention,
        lse_scale=lse_scale,
        strided_query=draw(st.booleans()),
        poison=draw(st.sampled_from(POISON_BYTES)),
        seed=draw(st.integers(0, 2**16)),
    )


# --- building the tensors --------------------------------------------------------------------------


@dataclass
class SearchInputs:
    """The tensors of a :class:`DrawnCall` on one device.

    Attributes:
        call: the drawn call.
        q: ``[T, H, d_qk]`` BF16 (a strided view when ``call.strided_query``).
        kv_cache, indices: the main cache (a view inside a canaried allocation) and ``[T, topk]`` int32.
        kwargs: the other keyword arguments of ``sparse_mla_forward``.
        valid: ``[T, topk + extra_topk]`` bool, the lanes that attend (both caches), on the device.
        storages: every input's whole allocation, as flat uint8 tensors (compared after the call).
        before: copies of ``storages`` taken before the call, on the same device as each storage.
        scores: ``[T, H, topk + extra_topk]`` float64 logits of the valid lanes (``-inf`` elsewhere),
            on the device.
    """

    call: DrawnCall
    q: torch.Tensor
    kv_cache: torch.Tensor
    indices: torch.Tensor
    kwargs: dict[str, Any]
    valid: torch.Tensor
    storages: dict[str, torch.Tensor]
    before: dict[str, torch.Tensor]
    scores: torch.Tensor

    def changed_inputs(self) -> list[str]:
        """The inputs whose allocation (canaries, poison and other layers included) changed since
        :func:`build`, with the first changed byte offset.

        Compared where the storages live (no copy to the host); one host synchronisation when
        nothing changed (the count of changed bytes of every input, read at once)."""
        names = list(self.storages)
        counts = [(self.storages[n] != self.before[n]).sum() for n in names]
        if not counts:
            return []
        devices = {c.device for c in counts}
        changed = (torch.stack(counts).tolist() if len(devices) == 1
                   else [int(c) for c in counts])  # fmt: skip
        out = []
        for name, n in zip(names, changed, strict=True):
            if n:
                first = int((self.storages[name] != self.before[name]).nonzero()[0, 0])
                out.append(f"{name} (byte {first} of its allocation, {n} bytes changed)")
        return out


def _page_byte_masks(f: formats.PackedFormat, ps: int, page_bytes: int, slots: torch.Tensor) -> torch.Tensor:
    """``[P, page_bytes]`` bool: the bytes of each page a reader uses for the slots ``slots``
    (``[P, ps]`` bool), by ``formats.token_byte_ranges``; on ``slots``' device.

    Vectorised form of those ranges: the footer layout (DSV4) keeps token ``t``'s data row
    ``[t*row, (t+1)*row)`` and its ``num_scales`` scale bytes ``[ps*row + 8t, ps*row + 8t + num_scales)``;
    an inline layout keeps ``[t*B, (t+1)*B)``; every other byte (page padding, the scale records'
    unread bytes) is ``False``."""
    P = slots.shape[0]
    mask = torch.zeros((P, page_bytes), dtype=torch.bool, device=slots.device)
    if f.layout == "footer":
        row = f.data_bytes_per_token
        mask[:, : ps * row] = slots.unsqueeze(-1).expand(P, ps, row).reshape(P, ps * row)
        scales = torch.zeros((P, ps, 8), dtype=torch.bool, device=slots.device)
        scales[..., : f.num_scales] = slots.unsqueeze(-1)
        mask[:, ps * row : ps * row + ps * 8] = scales.reshape(P, ps * 8)
    else:
        b = f.bytes_per_token
        mask[:, : ps * b] = slots.unsqueeze(-1).expand(P, ps, b).reshape(P, ps * b)
    return mask


def _token_byte_mask(f: formats.PackedFormat, ps: int, page_bytes: int, slots: torch.Tensor) -> torch.Tensor:
    """``[page_bytes]`` bool: the bytes of one page a reader uses for the slots ``slots`` (``[ps]``
    bool), by ``formats.token_byte_ranges`` (one page of :func:`_page_byte_masks`)."""
    return _page_byte_masks(f, ps, page_bytes, slots.reshape(1, ps))[0]


def _source(c: DrawnCache, f: formats.PackedFormat, g: torch.Generator, bias: torch.Tensor | None) -> torch.Tensor:
    """BF16 ``[P, ps, d_qk]`` latent rows of one cache, on ``g``'s device: ``randn / 10`` (+ the shared
    key component), NoPE times ``2**value_exponent`` (and per-group ``wide`` magnitudes), RoPE times
    ``2**rope_exponent``."""
    shape = (c.num_pages, c.page_block_size, f.d_qk)
    dev = g.device
    x = (torch.randn(shape, generator=g, dtype=torch.float64, device=dev) / 10).clamp(-1, 1)
    if c.wide:
        groups = torch.randint(-24, 9, (*shape[:-1], f.d_qk // 64, 1), generator=g, device=dev).to(torch.float64)
        x = (x.reshape(*shape[:-1], f.d_qk // 64, 64) * torch.exp2(groups)).reshape(shape)
    exponent = c.value_exponent
    if f.code == "e2m1":  # E2M1 with E4M3 group scales holds magnitudes 2**-10 .. 6 * 448 only
        exponent = max(-8, min(exponent, 11))
    x[..., : f.d_nope] *= 2.0**exponent
    x[..., f.d_nope :] *= 2.0**c.rope_exponent
    if bias is not None:  # the last 64 dims, the same in every row (exact in every format's code)
        x[..., -bias.shape[0] :] = bias * 2.0 ** (c.rope_exponent if f.d_rope else exponent)
    limit = formats.NOPE_OVERFLOW / 2
    x[..., : f.d_nope] = x[..., : f.d_nope].clamp(-limit, limit)
    return x.to(torch.bfloat16)


def _rewrite_scales(packed: torch.Tensor, f: formats.PackedFormat, c: DrawnCache, g: torch.Generator) -> None:
    """Set every scale of every record of ``packed`` (the ``[P, stride]`` 2-D form, in place) to the
    format's ``c.scale_end`` scale (:data:`SCALE_ENDS`). With ``"largest"`` and E4M3 codes, the codes
    are redrawn among E4M3's three smallest subnormals (``1..3 * 2**-9``, either sign): a value is
    then at most ``1.5 * 2**119``, so a row of at most :data:`LARGEST_SCALE_LANES` lanes sums to a
    finite fp32 number before the softmax's normalisation, as every split-K kernel accumulates it."""
    P, ps = c.num_pages, c.page_block_size
    value = torch.tensor(list(SCALE_ENDS[f.scale_kind][c.scale_end]), dtype=torch.uint8, device=packed.device)
    width = value.numel()
    pages = packed.as_strided((P, ps * f.bytes_per_token), (packed.stride(0), 1), packed.storage_offset())
    if f.layout == "footer":
        start = ps * f.data_bytes_per_token
        records = pages[:, start : start + ps * f.scale_bytes_per_token].reshape(P, ps, f.scale_bytes_per_token)
        scales = records[..., : f.num_scales * width]
        codes = pages[:, :start].reshape(P, ps, f.data_bytes_per_token)[..., : f.code_bytes_per_token]
    else:
        rows = pages.reshape(P, ps, f.bytes_per_token)
        scales = rows[..., f.code_bytes_per_token : f.code_bytes_per_token + f.num_scales * width]
        codes = rows[..., : f.code_bytes_per_token]
    scales.copy_(value.repeat(f.num_scales).expand_as(scales))
    if c.scale_end == "largest" and f.code == "e4m3" and f.scale_kind != "e4m3":
        drawn = torch.randint(0, 6, tuple(codes.shape), generator=g, dtype=torch.int32, device=g.device)
        codes.copy_(((drawn % 2) * 0x80 | (drawn // 2 + 1)).to(torch.uint8))


def _indices(
    c: DrawnCache, T: int, slots: int, g: torch.Generator, empty: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(indices, lengths, valid)`` of one cache before stale lanes are filled (they hold ``-1``),
    on ``g``'s device."""
    W = c.width
    dev = g.device
    if c.pattern == "few":
        pool = torch.randint(0, slots, (3,), generator=g, device=dev)
        idx = pool[torch.randint(0, 3, (T, W), generator=g, device=dev)]
    elif c.pattern == "one-page":
        page = int(torch.randint(0, max(1, slots // c.page_block_size), (1,), generator=g, device=dev))
        idx = page * c.page_block_size + torch.randint(0, min(c.page_block_size, slots), (T, W), generator=g,
                                                       device=dev)  # fmt: skip
    else:
        idx = torch.randint(0, slots, (T, W), generator=g, device=dev)
        if c.pattern == "ends":
            idx[:, 0::3] = 0
            idx[:, 1::3] = slots - 1
    masked = int(round(W * c.masked_fraction))
    if c.scattered:
        order = torch.argsort(torch.rand((T, W), generator=g, device=dev), dim=1)
        mask = order < masked
    else:
        mask = torch.zeros((T, W), dtype=torch.bool, device=dev)
        mask[:, W - masked :] = masked > 0
    mask |= empty.unsqueeze(1)
    idx = torch.where(mask, torch.full_like(idx, c.mask_value), idx)
    valid = ~mask
    lengths = None
    if c.lengths is not None:
        lo, hi = c.lengths
        lengths = torch.randint(lo, hi + 1, (T,), generator=g, device=dev)
        lengths = torch.where(empty, torch.zeros_like(lengths), lengths)
        past = torch.arange(W, device=dev).unsqueeze(0) >= lengths.clamp(0, W).unsqueeze(1)
        valid &= ~past
        idx = torch.where(past, torch.full_like(idx, -1), idx)
    return idx.to(torch.int64), lengths, valid


def _place(
    packed: torch.Tensor, c: DrawnCache, f: formats.PackedFormat, keep: torch.Tensor, poison: int,
    g: torch.Generator, device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The packed cache (``[P, stride]`` pages, on ``g``'s device) with every byte not read for the
    slots in ``keep`` (``[P * ps]`` bool) poisoned, as layer ``c.layer`` of a pool of ``c.num_layers``
    (other layers poison) inside one allocation with ``c.canary`` random bytes before and after it,
    on ``device``. Returns ``(view in c.form, the whole allocation)``."""
    P, stride = int(packed.shape[0]), int(packed.stride(0))
    pages = packed.as_strided((P, stride), (stride, 1), packed.storage_offset())
    ps = c.page_block_size
    used = _page_byte_masks(f, ps, stride, keep.reshape(P, ps))
    pages = pages.masked_fill(~used, poison)
    pool = torch.full((P, c.num_layers * stride), poison, dtype=torch.uint8, device=pages.device)
    pool[:, c.layer * stride : (c.layer + 1) * stride] = pages
    pre = torch.randint(0, 256, (c.canary,), generator=g, dtype=torch.uint8, device=g.device)
    post = torch.randint(0, 256, (c.canary,), generator=g, dtype=torch.uint8, device=g.device)
    flat = torch.cat([pre, pool.flatten(), post]).to(device)
    view = flat.as_strided((P, stride), (c.num_layers * stride, 1), c.canary + c.layer * stride)
    return formats.as_form(view, f, ps, c.form), flat


def _stale(
    c: DrawnCache, idx: torch.Tensor, lengths: torch.Tensor | None, keep: torch.Tensor, g: torch.Generator
) -> torch.Tensor:
    """Lanes past ``topk_length`` filled with ``c.stale``: ``1 << 30``, a poisoned slot, or ``-1``."""
    if lengths is None:
        return idx
    W = idx.shape[1]
    past = torch.arange(W, device=idx.device).unsqueeze(0) >= lengths.clamp(0, W).unsqueeze(1)
    if c.stale == "1<<30":
        fill = torch.full_like(idx, _STALE)
    elif c.stale == "poisoned-slot" and bool((~keep).any()):
        free = (~keep).nonzero().flatten()
        fill = free[torch.randint(0, free.numel(), idx.shape, generator=g, device=g.device)]
    else:
        fill = torch.full_like(idx, -1)
    return torch.where(past, fill, idx)


def _generator(call: DrawnCall, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator :func:`build` draws ``call``'s tensors from: seeded with ``call.seed``, on the
    CPU for a CPU build and on the CUDA device for a CUDA build (the same call gives the same bytes
    on one device type every time; a CUDA build's bytes differ from a CPU build's)."""
    device = torch.device(device)
    return torch.Generator(device=device if device.type == "cuda" else "cpu").manual_seed(call.seed)


def build(call: DrawnCall, device: torch.device | str = "cpu") -> SearchInputs:
    """The tensors of ``call`` on ``device``, drawn from ``call.seed`` by :func:`_generator` (on the
    CPU for a CPU build, on the GPU for a CUDA build: there the tensors are drawn and placed where
    they are used, with a few host synchronisations).

    Raises:
        ValueError: as ``formats.quantize_pack`` (never for a call :func:`calls` drew).
    """
    device = torch.device(device)
    g = _generator(call, device)
    dev = g.device  # where the tensors are drawn and computed
    main_fmt, extra_fmt = formats.cache_formats(call.fmt)
    T, H = call.num_tokens, call.num_heads
    d = main_fmt.d_qk
    bias = None
    if call.score_offset:  # a key component every cache row shares: the queries' offset direction
        bias = torch.randn(64, generator=g, dtype=torch.float64, device=dev).sign() * 8
    empty = torch.rand(T, generator=g, device=dev) < call.empty_fraction
    parts = []
    for c, f in ((call.main, main_fmt), (call.extra, extra_fmt)):
        if c is None:
            continue
        source = _source(c, f, g, bias)
        stride_spec: formats.StrideSpec = (
            ("tight" if c.stride == "tight" else "padded") if isinstance(c.stride, str)
            else formats.page_stride_bytes(f, c.page_block_size, "padded") + c.stride
        )  # fmt: skip
        packed = formats.quantize_pack(source, f, page_stride=stride_spec, form="2d")
        if c.scale_end != "none":
            _rewrite_scales(packed, f, c, g)
        table = (
            formats.unpack_dequantize(
                formats.as_form(packed, f, c.page_block_size, "nhd"), f, page_block_size=c.page_block_size
            )
            .reshape(-1, f.d_qk)
            .double()
        )
        slots = c.num_pages * c.page_block_size
        idx, lengths, valid = _indices(c, T, slots, g, empty)
        keep = torch.zeros(slots + 1, dtype=torch.bool, device=dev)  # the last entry takes invalid lanes
        keep.index_fill_(0, torch.where(valid, idx, slots).flatten(), True)
        keep = keep[:slots]
        idx = _stale(c, idx, lengths, keep, g)
        cache, flat = _place(packed, c, f, keep, call.poison, g, device)
        parts.append((c, f, cache, flat, idx, lengths, valid, table))
    keys = torch.cat([table[idx.clamp(0, table.shape[0] - 1)] for (_, _, _, _, idx, _, _, table) in parts], dim=1)
    valid = torch.cat([v for (*_, v, _) in parts], dim=1)  # [T, N]
    q = _queries(call, keys, valid, g, d, bias)
    scores = call.sm_scale[1] * torch.einsum("thd,tnd->thn", q.double(), keys)
    scores = scores.masked_fill(~valid.unsqueeze(1), -math.inf)
    storages: dict[str, torch.Tensor] = {}
    if call.strided_query:
        wide = torch.full((T + 1, H + 3, d + 64), float("nan"), dtype=torch.bfloat16, device=dev)
        wide[:T, :H, :d] = q
        wide = wide.to(device)
        q_dev = wide[:T, :H, :d]
        storages["q"] = wide.view(torch.uint8).flatten()
    else:
        q_dev = q.to(device)
        storages["q"] = q_dev.view(torch.uint8).flatten()
    (mc, _, main_cache, main_flat, main_idx, main_len, _, _) = parts[0]
    storages["kv_cache"] = main_flat
    kwargs: dict[str, Any] = {"sm_scale": call.sm_scale[1], "fmt": call.fmt}
    indices = main_idx.to(torch.int32).to(device)
    storages["indices"] = indices.view(torch.uint8).flatten()
    if main_len is not None:
        kwargs["topk_length"] = main_len.to(torch.int32).to(device)
    if len(parts) > 1:
        (_, _, extra_cache, extra_flat, extra_idx, extra_len, _, _) = parts[1]
        kwargs["extra_kv_cache"] = extra_cache
        kwargs["extra_indices"] = extra_idx.to(torch.int32).to(device)
        storages["extra_kv_cache"] = extra_flat
        storages["extra_indices"] = kwargs["extra_indices"].view(torch.uint8).flatten()
        if extra_len is not None:
            kwargs["extra_topk_length"] = extra_len.to(torch.int32).to(device)
    if call.sink is not None:
        kwargs["attn_sink"] = _sink(call, scores).to(device)
    if call.lse_convention is not None:
        kwargs["lse_convention"] = call.lse_convention
        if call.lse_convention == "flashinfer":
            kwargs["lse_scale"] = call.lse_scale
    for name in ("topk_length", "extra_topk_length", "attn_sink"):
        if name in kwargs:
            storages[name] = kwargs[name].view(torch.uint8).flatten()
    before = {name: s.clone() for name, s in storages.items()}
    return SearchInputs(call, q_dev, main_cache, indices, kwargs, valid, storages, before, scores)


def next_step(call: DrawnCall, step: int) -> DrawnCall:
    """The call a serving engine makes ``step`` steps after ``call`` on the same buffers: the same
    shapes, scalars and layout, new contents (queries, cache bytes, indices, lengths, sink), drawn
    from another seed."""
    return dataclasses.replace(call, seed=(call.seed + 7919 * step) % (2**31))


#: The fields of a call and of a cache that set its tensors' shapes, strides, alignment and which
#: keywords it passes (what ``search_speed.shape_key`` sees, and what a JIT kernel compiles or
#: autotunes for); every other field is a value: contents, masks, scales, the logit regime.
CALL_SHAPE_FIELDS = ("fmt", "num_tokens", "num_heads", "lse_convention", "strided_query")
CACHE_SHAPE_FIELDS = ("width", "page_block_size", "num_pages", "form", "stride", "layer", "num_layers", "canary")


def with_shape_of(call: DrawnCall, shape: DrawnCall, *, shape_lengths: bool = False) -> DrawnCall:
    """``call``'s values on ``shape``'s tensor shapes: the fields of :data:`CALL_SHAPE_FIELDS` and,
    per cache, :data:`CACHE_SHAPE_FIELDS` from ``shape``, and which optional tensors are passed
    (``extra`` cache, ``topk_length`` per cache, ``attn_sink``) as ``shape`` passes them; the rest
    (seed, logit regime, ``sm_scale``, sink offsets, masks, index pattern, stale lanes, value
    exponents, scale ends, poison) from ``call`` where ``shape`` passes the tensor too. Length
    bounds are ``call``'s unless ``shape_lengths`` (then ``shape``'s: for a row narrower than
    ``call``'s lengths). The search judges a drawn call this way once its warm-up budget is spent
    and the call's own shape was never compiled (``search_run``, "Compiling is not judged time")."""

    def cache(values: DrawnCache | None, on: DrawnCache | None) -> DrawnCache | None:
        if on is None:
            return None
        if values is None:
            return on
        lengths = on.lengths if on.lengths is None or values.lengths is None or shape_lengths else values.lengths
        return dataclasses.replace(values, lengths=lengths, **{f: getattr(on, f) for f in CACHE_SHAPE_FIELDS})

    main = cache(call.main, shape.main)
    assert main is not None  # every call has a main cache
    sink = None if shape.sink is None else (call.sink if call.sink is not None else shape.sink)
    lse_scale = call.lse_scale if call.lse_convention == shape.lse_convention else shape.lse_scale
    return dataclasses.replace(
        call, main=main, extra=cache(call.extra, shape.extra), sink=sink, lse_scale=lse_scale,
        **{f: getattr(shape, f) for f in CALL_SHAPE_FIELDS},
    )  # fmt: skip


def rewritten_in_place(target: SearchInputs, source: SearchInputs) -> SearchInputs:
    """``target``'s buffers holding ``source``'s contents: every allocation of ``source`` (queries,
    caches with their canaries and other layers, indices, lengths, sink) copied byte for byte into
    ``target``'s, in place, as a serving engine rewrites its persistent buffers between two calls
    (the next decode step, a CUDA-graph replay). Both must come from calls of the same shapes
    (:func:`next_step`).

    Returns:
        The inputs of the next call: ``target``'s tensors, ``source``'s call, valid lanes, scores
        and pre-call bytes.

    Raises:
        ValueError: an allocation of another size (the calls' shapes differ).
    """
    for name, storage in target.storages.items():
        other = source.storages[name]
        if other.numel() != storage.numel():
            raise ValueError(f"{name}: {other.numel()} bytes cannot be written into {storage.numel()}")
        storage.copy_(other)
    kwargs = {k: (target.kwargs[k] if isinstance(v, torch.Tensor) else v) for k, v in source.kwargs.items()}
    return dataclasses.replace(
        source, q=target.q, kv_cache=target.kv_cache, indices=target.indices, kwargs=kwargs,
        storages=target.storages, before={n: b.clone() for n, b in source.before.items()},
    )  # fmt: skip


def _queries(
    call: DrawnCall, keys: torch.Tensor, valid: torch.Tensor, g: torch.Generator, d: int,
    direction: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """BF16 ``[T, H, d]`` queries whose logits over the valid lanes have the drawn spread, offset and
    peak (per token and head; exact before the BF16 rounding of the queries), on ``keys``' device."""
    T, H = call.num_tokens, call.num_heads
    dev = keys.device
    base = torch.randn((T, H, d), generator=g, dtype=torch.float64, device=dev)
    base = base / base.norm(dim=-1, keepdim=True)
    # From here in place where a [T, H, d] float64 result replaces its operand (the same values as out
    # of place; a fresh tensor of that size is page faults on a CPU, T * H * d up to millions).
    scale = call.sm_scale[1]
    if scale == 0.0 or not bool(valid.any()):
        return (base * 8).to(torch.bfloat16)
    w = valid.double().unsqueeze(1)  # [T, 1, N]
    n = w.sum(-1).clamp(min=1)  # [T, 1]
    unit = torch.zeros(d, dtype=torch.float64, device=dev)
    unit[-64:] = direction if direction is not None else 0.0
    unit = unit / unit.norm().clamp(min=1e-300)
    if direction is not None:  # the spread comes from the other dims: the BF16 rounding of the queries
        base[..., -64:] = 0.0  # then leaves the shared component's huge dot products out of the spread
        base.div_(base.norm(dim=-1, keepdim=True).clamp(min=1e-300))
    raw = scale * torch.einsum("thd,tnd->thn", base, keys)
    mean = (raw * w).sum(-1) / n
    std = (((raw - mean.unsqueeze(-1)) ** 2 * w).sum(-1) / n).sqrt()
    alpha = torch.where(std > 0, call.score_spread / std.clamp(min=1e-300), torch.zeros_like(std))
    q = base.mul_(alpha.unsqueeze(-1))  # base is not read again
    if direction is not None:  # the offset: along the key component every row shares
        along = ((scale * keys @ unit) * w.squeeze(1)).sum(-1, keepdim=True) / n  # [T, 1] mean logit of the unit
        safe = along.where(along.abs() > 0, 1.0)
        beta = torch.where(along.abs() > 0, (call.score_offset - alpha * mean) / safe, 0.0)  # [T, H]
        q.add_(beta.unsqueeze(-1) * unit)
    if call.peak:
        lanes = valid.double() + torch.rand(valid.shape, generator=g, dtype=torch.float64, device=dev) * 0.5
        pick = lanes.argmax(-1)  # a valid lane per token (the same for every head of the token)
        pick = (pick.unsqueeze(1) + torch.arange(H, device=dev).unsqueeze(0)) % valid.shape[1]
        k = keys.gather(1, pick.unsqueeze(-1).expand(-1, -1, d))  # [T, H, d]
        norm2 = (k * k).sum(-1, keepdim=True)
        bump = torch.where(norm2 > 0, call.peak / (scale * norm2.clamp(min=1e-300)), torch.zeros_like(norm2))
        q.add_(bump * k)
    top = 2.0**120
    q.nan_to_num_(nan=0.0, posinf=top, neginf=-top).clamp_(-top, top)
    # Mixed magnitudes across caches and groups can push some logits far past the drawn regime: shrink
    # such a (token, head) query until its largest logit is within the regime's reach.
    reach = abs(call.score_offset) + 8 * call.score_spread + call.peak + 10
    logits = (scale * torch.einsum("thd,tnd->thn", q, keys)).abs().masked_fill(~valid.unsqueeze(1), 0).amax(-1)
    q.mul_(torch.where(logits > reach, reach / logits.clamp(min=1e-300), torch.ones_like(logits)).unsqueeze(-1))
    return q.to(torch.bfloat16)


def _sink(call: DrawnCall, scores: torch.Tensor) -> torch.Tensor:
    """``[H]`` fp32 on ``scores``' device: head ``h`` gets ``call.sink[h % len]`` plus the median over
    tokens of its LSE without sink (natural log; 0 where every row of the head is empty)."""
    lse = torch.logsumexp(scores, dim=-1)  # [T, H]
    lse = torch.where(torch.isfinite(lse), lse, torch.nan)
    median = (lse.nanmedian(dim=0).values.nan_to_num(nan=0.0) if lse.shape[0]
              else torch.zeros(call.num_heads, dtype=torch.float64, device=scores.device))  # fmt: skip
    sink = call.sink or (0.0,)
    offsets = torch.tensor([sink[h % len(sink)] for h in range(call.num_heads)], dtype=torch.float64,
                           device=scores.device)  # fmt: skip
    return (median + offsets).to(torch.float32)


# --- what a failure says and what a run covered ------------------------------------------------------


def record(call: DrawnCall, inputs: SearchInputs | None = None) -> dict[str, Any]:
    """What the coverage report keeps of one drawn call: ``{dimension name: value}``, with the
    names of ``input_space.DIMENSIONS`` (numbers for ranges, strings for categories)."""
    m, e = call.main, call.extra
    out: dict[str, Any] = {
        "fmt": call.fmt,
        "num_tokens": call.num_tokens,
        "num_heads": call.num_heads,
        "topk": m.width,
        "topk_length": "none"
        if m.lengths is None
        else f"{'negative' if m.lengths[0] < 0 else 'in-row'}{'+beyond' if m.lengths[1] > m.width else ''}",
        "masked_lanes": f"{m.masked_fraction:g}{'/scattered' if m.scattered else ''}/{m.mask_value}",
        "index_pattern": m.pattern,
        "stale_lanes": m.stale if m.lengths is not None else "no-lengths",
        "page_block_size": m.page_block_size,
        "num_pages": m.num_pages,
        "extra_cache": "none" if e is None else f"ps{e.page_block_size}",
        "value_exponent": m.value_exponent,
        "score_spread": call.score_spread,
        "score_offset": call.score_offset,
        "peak": call.peak,
        "sm_scale": call.sm_scale[0],
        "attn_sink": "none" if call.sink is None else ("-inf" if all(math.isinf(s) for s in call.sink) else "finite"),
        "lse_convention": f"{call.lse_convention}/{'decode' if call.num_tokens <= 64 else 'prefill'}",
        "cache_form": m.form,
        "page_stride": str(m.stride),
        "storage_offset": f"layer{m.layer}/{m.num_layers}",
        "query_layout": "strided" if call.strided_query else "contiguous",
        "scale_bytes": m.scale_end if e is None else f"{m.scale_end}/{e.scale_end}",
        "pool_bytes": pool_class(call),
    }
    if inputs is not None:
        finite = inputs.scores[torch.isfinite(inputs.scores)]
        if finite.numel():
            out["realized_max_logit"] = float(finite.abs().max())
    return out


def pool_class(call: DrawnCall) -> str:
    """``"past-2**31"`` when a page of the main cache starts ``2**31`` bytes or more after the view's
    first byte (a pool of many layers: page ``p`` lies ``p * num_layers * page_stride`` bytes in), else
    ``"small"``: the offsets an int32 page address overflows on."""
    m = call.main
    f = formats.cache_formats(call.fmt)[0]
    stride = formats.page_stride_bytes(f, m.page_block_size, "padded")
    return "past-2**31" if (m.num_pages - 1) * m.num_layers * stride >= 2**31 else "small"


def masked_lanes(inputs: SearchInputs) -> torch.Tensor:
    """``[T]`` int64: the masked lanes of each row of a built call, either cache: lanes inside the
    row's length (``topk_length`` / ``extra_topk_length`` clamped to ``[0, topk]``; the whole row
    without one) whose index is negative (``regions.built_features``'s ``masked``); on the
    indices' device. ``inputs`` may be a call a property derived (rows permuted and padded)."""
    count = None
    for idx, length in ((inputs.indices, inputs.kwargs.get("topk_length")),
                        (inputs.kwargs.get("extra_indices"), inputs.kwargs.get("extra_topk_length"))):  # fmt: skip
        if idx is None:
            continue
        idx = idx.flatten(1)  # [T, topk] (a [T, 1, topk] view too; T may be 0)
        masked = idx < 0
        if length is not None:
            masked &= torch.arange(idx.shape[1], device=idx.device) < length.to(idx.device).long().reshape(-1, 1)
        rows = masked.sum(1)
        count = rows if count is None else count + rows.to(count.device)
    assert count is not None  # the main cache's indices are always there
    return count


def _zero_lanes_scored(inputs: SearchInputs, oracle: Any) -> Any:
    """The oracle's result as a kernel gives it that scores each masked lane (:func:`masked_lanes`) as
    a lane of logit 0 and value 0 (it gathers a zero row for ``-1``): each (token, head) row's output
    times ``Z / (Z + m)``, ``Z`` the row's ``sum_j exp(s_j)`` plus the sink's ``exp(attn_sink)``,
    ``m`` its masked lanes (``oracle``: an ``attention.oracle.OracleOutput``, its scales kept); ``None``
    when no row has a masked lane."""
    m = masked_lanes(inputs)
    if not bool((m > 0).any()):
        return None
    sink = inputs.kwargs.get("attn_sink")
    share = regions.zero_lane_share(inputs.scores, m, sink if isinstance(sink, torch.Tensor) else None)
    factor = (1.0 - share).cpu()  # Z / (Z + m)
    return dataclasses.replace(oracle, output=oracle.output.double().cpu() * factor.unsqueeze(-1))


def _errors(a: torch.Tensor, b: Any) -> torch.Tensor:
    """``[T, H, D]``: the elementwise error of output ``a`` against an oracle result ``b``, in units of
    the oracle's ``sum_j w_j |V_j|`` (the scale of the suites' elementwise bound; at least ``2**-126``,
    BF16's smallest normal, so an output that underflows is not an error); NaN where ``b`` is
    finite counts as infinitely wrong."""
    a = a.double().cpu()
    expected = b.output.double().cpu()
    scale = b.scales.abs_weighted.double().cpu() if b.scales is not None else expected.abs()
    err = (a - expected).abs() / scale.clamp(min=2.0**-126)  # below BF16's smallest normal: underflow
    return torch.nan_to_num(err, nan=math.inf)


def _relative(a: torch.Tensor, b: Any, rows: torch.Tensor | None = None) -> float:
    """The median of :func:`_errors` over the ``[T, H]`` ``rows`` (all rows when ``None`` or none)."""
    err = _errors(a, b)
    if rows is not None and bool(rows.any()):
        err = err[rows]
    return float(err.flatten().median()) if err.numel() else 0.0


def diagnose(
    output: torch.Tensor, inputs: SearchInputs, oracle: Any, oracle_forward: Any, tolerance: float = 0.03
) -> list[str]:
    """Likely causes of a wrong ``output`` (``[T, H, 512]``), from the evidence.

    Counterfactuals: the oracle of the same call with one rule broken (``sm_scale`` of ``d_qk **
    -0.5`` or ``512 ** -0.5``, squared, or times ``log2(e)``; no sink, the sink in log2 units; no
    extra cache; no ``topk_length``; masked lanes scored as lanes of logit 0 and value 0, as SGLang's
    ``_forward_prefill_sparse_q8kv8`` makes its kernel do by gathering a zero row for ``-1``,
    ``deepseek_v4_backend.py``); a counterfactual whose output the kernel's matches (median
    elementwise error below ``tolerance`` in units of ``sum_j w_j |V_j|``, and four times closer
    than the true oracle) is named. Then where the wrong rows are (non-finite values, empty rows,
    the prefill route, a subset of heads, rows whose sink dominates).

    Returns:
        Lines of text (empty when nothing stands out).
    """
    call = inputs.call
    f = formats.cache_formats(call.fmt)[0]
    kw = dict(inputs.kwargs)
    # Judged on the rows the kernel gets wrong (an element off by more than 1% of its scale): a bug
    # of a few rows (those that read one slot) leaves the median of every row at 0 either way.
    wrong_rows = (_errors(output, oracle) > 0.01).any(dim=-1)
    truth = _relative(output, oracle, wrong_rows)
    candidates: dict[str, tuple[str, dict[str, Any]]] = {}
    if call.sm_scale[1] != f.d_qk**-0.5:
        candidates[f"sm_scale ignored (d_qk ** -0.5 = {f.d_qk**-0.5:.4g} used instead of {call.sm_scale[1]:.4g})"] = (
            "sm_scale-ignored", {**kw, "sm_scale": f.d_qk**-0.5})  # fmt: skip
    if call.sm_scale[1] != 512**-0.5 and f.d_qk != 512:
        candidates["sm_scale ignored (512 ** -0.5 used)"] = ("sm_scale-ignored", {**kw, "sm_scale": 512**-0.5})
    if "attn_sink" in kw:
        candidates["attn_sink ignored"] = ("sink-or-normaliser", {k: v for k, v in kw.items() if k != "attn_sink"})
        candidates["attn_sink taken as a log2 logit (times ln 2)"] = (
            "sink-or-normaliser", {**kw, "attn_sink": kw["attn_sink"] * math.log(2)})  # fmt: skip
        candidates["attn_sink taken as a natural logit scaled by log2(e)"] = (
            "sink-or-normaliser", {**kw, "attn_sink": kw["attn_sink"] / math.log(2)})  # fmt: skip
    if "extra_kv_cache" in kw:
        candidates["extra cache ignored"] = ("extra-cache-ignored", {
            k: v for k, v in kw.items() if k not in ("extra_kv_cache", "extra_indices", "extra_topk_length")
        })  # fmt: skip
    if "topk_length" in kw or "extra_topk_length" in kw:
        full = {k: v for k, v in kw.items() if k not in ("topk_length", "extra_topk_length")}
        if call.main.stale == "-1" and (call.extra is None or call.extra.stale == "-1"):
            candidates["topk_length ignored (lanes past it read)"] = ("topk_length-ignored", full)
    zero_main = bool((inputs.indices == 0).any())
    zero_extra = "extra_indices" in kw and bool((kw["extra_indices"] == 0).any())
    if zero_main or zero_extra:
        sentinel = {**kw}
        if zero_extra:
            sentinel["extra_indices"] = torch.where(kw["extra_indices"] == 0, -1, kw["extra_indices"])
        candidates["index value 0 taken for the mask sentinel (lanes of index 0 masked)"] = (
            "index-0-treated-as-invalid", {**sentinel, "indices": torch.where(inputs.indices == 0, -1, inputs.indices)},
        )  # fmt: skip
    if call.sm_scale[1] != 0.0:
        candidates["scores scaled twice by sm_scale"] = (
            "sm_scale-applied-twice",
            {**kw, "sm_scale": call.sm_scale[1] ** 2},
        )
        candidates["sm_scale applied in base 2 (times log2 e)"] = (
            "sm_scale-in-base-2", {**kw, "sm_scale": call.sm_scale[1] / math.log(2)})  # fmt: skip
    lines: list[str] = []
    for words, (key, args) in candidates.items():
        indices = args.pop("indices", inputs.indices)
        try:
            alt = oracle_forward(inputs.q, inputs.kv_cache, indices, **args)
        except (ValueError, TypeError):
            continue
        err = _relative(output, alt, wrong_rows)
        if err < tolerance and err < truth / 4:
            lines.append(cause_line(key, f"{words} ({MATCHED}: relative error {err:.2e}, {truth:.2e} against "
                                         "the true oracle)"))  # fmt: skip
    zero_lanes = _zero_lanes_scored(inputs, oracle)
    if zero_lanes is not None:
        err = _relative(output, zero_lanes, wrong_rows)
        if err < tolerance and err < truth / 4:
            lines.append(cause_line("masked-lane-scored", (
                "masked lanes (negative indices inside the length) scored as lanes of logit 0 and value 0, as "
                f"where a zero row is gathered for -1 ({MATCHED}: relative error {err:.2e}, {truth:.2e} against "
                "the true oracle)")))  # fmt: skip
    lines += _where(output, inputs, oracle)
    return lines


def describe_call(inputs: SearchInputs, failure: str) -> str:
    """The drawn call in one line (``DrawnCall.describe``), with its index values
    (:func:`index_words`) when a likely cause named in ``failure`` is about lanes
    (``diagnosis.LANE_KEYS``: which lanes a kernel reads is what tells it); for the index-0 cause,
    the tokens that read index value 0 first."""
    line = inputs.call.describe()
    keys = set(cause_keys(failure))
    if keys & LANE_KEYS:
        first = None
        if "index-0-treated-as-invalid" in keys:
            first = (inputs.indices.reshape(inputs.indices.shape[0], -1) == 0).any(dim=1).cpu()
            extra = inputs.kwargs.get("extra_indices")
            if isinstance(extra, torch.Tensor):
                first |= (extra.reshape(extra.shape[0], -1) == 0).any(dim=1).cpu()
        line += "; " + index_words(inputs, first=first)
    return line


def index_words(inputs: SearchInputs, tokens: int = 4, lanes: int = 16, first: torch.Tensor | None = None) -> str:
    """The call's index values: ``indices`` (and ``topk_length``, ``extra_indices``,
    ``extra_topk_length`` when given) of ``tokens`` tokens, ``lanes`` lanes each (``...`` marks what
    is left out), each row named by its token (``t5:[...]``): the tokens ``first`` marks (``[T]``
    bool) before the others, in token order."""
    num_tokens = int(inputs.indices.shape[0])
    order = list(range(num_tokens))
    if first is not None:
        marked = first.flatten().tolist()
        order = [t for t in order if marked[t]] + [t for t in order if not marked[t]]
    shown = order[:tokens]
    more = ", ..." if num_tokens > tokens else ""

    def rows(t: torch.Tensor) -> str:
        flat = t.reshape(t.shape[0], -1).cpu()
        out = []
        for k in shown:
            row = flat[k].tolist()
            cut = ", ..." if len(row) > lanes else ""
            out.append(f"t{k}:[" + ", ".join(str(int(v)) for v in row[:lanes]) + cut + "]")
        return "[" + ", ".join(out) + more + "]"

    def vector(t: torch.Tensor) -> str:
        flat = t.flatten().cpu().tolist()
        return "[" + ", ".join(f"t{k}:{int(flat[k])}" for k in shown) + more + "]"

    parts = [f"indices={rows(inputs.indices)}"]
    kw = inputs.kwargs
    for name in ("topk_length", "extra_indices", "extra_topk_length"):
        value = kw.get(name)
        if isinstance(value, torch.Tensor):
            parts.append(f"{name}={rows(value) if name == 'extra_indices' else vector(value)}")
    return " ".join(parts)


def _where(output: torch.Tensor, inputs: SearchInputs, oracle: Any) -> list[str]:
    """Where the bad rows are: non-finite values, empty rows, route, heads."""
    call = inputs.call
    out = output.double().cpu()
    exp = oracle.output.double().cpu()
    scale = exp.abs().amax(-1).clamp(min=1e-300)  # [T, H]
    err = torch.nan_to_num((out - exp).abs().amax(-1) / scale, nan=math.inf)
    bad = err > 0.05
    lines: list[str] = []
    if not bool(bad.any()):
        return lines
    empty = ~inputs.valid.any(-1).cpu()  # [T]
    nonfinite = ~torch.isfinite(out).all(-1)
    if bool(nonfinite.any()):
        finite = inputs.scores[torch.isfinite(inputs.scores)].cpu()
        largest = float(finite.abs().max()) if finite.numel() else 0.0
        lines.append(cause_line("masked-or-stale-lane-read", f"{int(nonfinite.sum())} rows hold NaN/Inf: a "
                                "poisoned byte (an unreferenced slot, page padding, another layer, a stale lane "
                                "past topk_length) or a masked lane was read, or exp overflowed (largest |logit| "
                                f"{largest:.3g})"))  # fmt: skip
    if bool(empty.any()) and bool(bad[empty].any()):
        lines.append(
            cause_line("empty-row-not-zero", "rows without a valid lane are wrong (expected output exactly 0)")
        )
    tokens = bad.any(-1).nonzero().flatten().tolist()
    heads = bad.any(0).nonzero().flatten().tolist()
    if call.num_tokens > 64 and tokens and min(tokens) > 0:
        lines.append(f"wrong tokens start at token {min(tokens)} (T={call.num_tokens}: prefill route)")
    if heads and len(heads) < call.num_heads:
        lines.append(f"only heads {heads[:8]}{'...' if len(heads) > 8 else ''} of {call.num_heads} are wrong")
    if "attn_sink" in inputs.kwargs:
        sink = inputs.kwargs["attn_sink"].double().cpu()
        lse = torch.logsumexp(inputs.scores.cpu(), -1)
        dominated = (sink.unsqueeze(0) > lse + 5) & torch.isfinite(sink).unsqueeze(0)
        if bool(dominated.any()) and bool((bad & dominated).sum() * 2 >= bad.sum()):
            lines.append("the wrong rows are mostly those whose sink dominates the scores (sink > LSE + 5)")
    return lines


# --- one property test's run: budget, seed, what it drew ---------------------------------------------

def unshrunk_phases() -> list[Any]:
    """Hypothesis's phases without ``shrink`` and ``explain``: a failing run reports its first
    failing call as drawn."""
    from hypothesis import Phase

    return [p for p in Phase if p not in (Phase.shrink, Phase.explain)]
