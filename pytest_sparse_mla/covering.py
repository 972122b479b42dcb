"""The covering schedule: every end of every dimension's legal range, drawn in every search run.

Random draws from a wide space almost never land on the ends of a range: a token count that is a
large power of two on the prefill route, a ``topk_length`` of ``2**31 - 1``, a scale byte of 0. A
kernel wrong only there passes any budget of random calls. Before its random draws, every search
test (``pytest_sparse_mla.search_run.SearchRun``) therefore judges a short list of calls that together
hit each **end** of each dimension of ``pytest_sparse_mla.input_space`` that the implementation's
envelope admits:

* :func:`required_ends` names them: ``{dimension: {label, ...}}`` (``"num_tokens": {"1", "64",
  "65", "512"}``, ``"scale_bytes": {"dsv4:smallest", ...}``, ...) for an envelope and a device;
* :func:`ends_of` reads the labels a drawn call hits, from its plain values (the coverage record
  keeps them under ``"ends"``, so a test can show each end was drawn);
* :func:`schedule` packs the ends into few calls: each call carries one end of many dimensions,
  large sizes are kept apart (a call's ``T * H * lanes`` is bounded), and every call lies inside the
  envelope.

The ends (legal ranges and their sources: ``docs/input-space.md``): token counts 0 or 1, 64 (the
decode route's largest power of two), 65 and :data:`BIG_TOKENS` (prefill); the fewest and most
heads; the narrowest and widest rows (up to :data:`WIDEST`); ``topk_length`` 0, the row width and,
where any int32 is clamped, ``-2**31`` and ``2**31 - 1``; whole rows masked, ``-1`` and ``-2**31``
masks; the first and last slot, duplicates; every stale-lane filler; the smallest and largest page
size of each cache; each record format's smallest and largest encodable scale
(``search.SCALE_ENDS``); value exponents ``2**-40`` and ``2**100`` (NoPE and RoPE); score spreads 0
and 40, offsets -3000 and 3000, a peak of 100; ``sm_scale`` 0, negative (with the widest spread
where the call allows: the sign turns the largest ``q.k`` into the smallest score), ``2**-12`` and ``2**4``;
sinks ``-inf`` and the row LSE -1000 / +1000; each LSE convention on both routes; every cache form,
tight, padded and padded + 256 B page strides, the last layer of a 4-layer pool; strided queries;
on CUDA, a 60-layer pool whose last read page starts past ``2**31`` bytes (int32 page offsets).

Imports torch only through ``pytest_sparse_mla.search`` (a ``test`` extra).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from pytest_sparse_mla import formats, input_space
from pytest_sparse_mla.envelope import Envelope

__all__ = [
    "BIG_TOKENS", "PARTIAL_HEAD_TILE", "WIDEST", "ends_of", "fits", "required_ends", "schedule", "with_main",
]  # fmt: skip

#: The largest power-of-two token count on the prefill route the schedule draws, per device.
BIG_TOKENS: dict[str, int] = {"cpu": 512, "cuda": 4096}
#: A head count one past a full tile of 16 heads (a partial head tile), drawn beside the ends where
#: the envelope takes any head count: kernels tile heads by 16 or 64.
PARTIAL_HEAD_TILE = 17
#: The widest index row the schedule draws (DeepSeek-V3.2's ``topk`` 2048), capped by the envelope.
WIDEST = 2048
#: The most ``T * H * (topk + extra_topk)`` a covering call may have, per device.
_COST: dict[str, int] = {"cpu": 1 << 15, "cuda": 1 << 21}
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_SM_SCALE_ENDS: dict[str, float] = {"0": 0.0, "negative": -(512**-0.5), "2**-12": 2.0**-12, "2**4": 16.0}
_SINK_ENDS: dict[str, float] = {"-inf": -math.inf, "LSE-1000": -1000.0, "LSE+1000": 1000.0}


def _device(device: str) -> str:
    return "cuda" if str(device).startswith("cuda") else "cpu"


def _widths(spec: Any) -> tuple[int, int]:
    """The narrowest and widest rows ``spec`` (an ``envelope.Widths``) takes, the widest at most :data:`WIDEST`."""
    lo = -(-max(spec.min, spec.multiple) // spec.multiple) * spec.multiple
    hi = WIDEST if spec.max is None else min(WIDEST, spec.max)
    return lo, max(lo, hi - hi % spec.multiple)


def _tokens(envelope: Envelope, device: str) -> list[int]:
    lo = envelope.min_tokens
    hi = envelope.max_tokens if envelope.max_tokens is not None else 1 << 30
    wanted = [lo, 1, 64, 65, BIG_TOKENS[_device(device)]]
    return sorted({t for t in wanted if lo <= t <= hi})


def _pages(sizes: tuple[int, ...] | None, default: tuple[int, int]) -> tuple[int, int]:
    return (min(sizes), max(sizes)) if sizes is not None else default


def required_ends(envelope: Envelope, device: str = "cpu") -> dict[str, set[str]]:
    """The end labels a default search run draws for ``envelope`` on ``device``: ``{dimension
    name: labels}`` (names of ``input_space.DIMENSIONS``; what :func:`ends_of` reports).
    A dimension the envelope does not let vary (one format's lengths, a sink) has only the ends it admits."""
    fmts = envelope.formats
    heads = envelope.num_heads
    w_lo, w_hi = _widths(envelope.topk)
    ends: dict[str, set[str]] = {
        "fmt": set(fmts),
        "num_tokens": {str(t) for t in _tokens(envelope, device)},
        "num_heads": {str(min(heads)), str(max(heads))} if heads else {"1", str(PARTIAL_HEAD_TILE), "256"},
        "topk": {str(w_lo), str(w_hi)},
        "masked_lanes": {"all", "-1"} | ({str(_INT32_MIN)} if envelope.masked_indices == "negative" else set()),
        "index_pattern": {"ends", "few"},
        "value_exponent": {f"nope:{e}" for e in input_space.VALUE_EXPONENTS}
        | {f"rope:{e}" for e in input_space.VALUE_EXPONENTS},
        "score_spread": {"0", "40"},
        "score_offset": {"-3000", "3000"},
        "peak": {"100"},
        "sm_scale": set(_SM_SCALE_ENDS),
        "cache_form": set(formats.FORMS),
        "page_stride": {"tight", "padded", "padded+256"},
        "storage_offset": {"layer3/4"},
        "query_layout": {"contiguous", "strided"},
    }
    lo, hi = _pages(envelope.page_block_sizes, (1, 256))
    ends["page_block_size"] = {f"main:{lo}", f"main:{hi}"}
    ends["scale_bytes"] = {f"{formats.cache_formats(f)[0].name}:{e}" for f in fmts for e in ("smallest", "largest")}
    extra = [f for f in fmts if envelope.takes_extra(f)]
    if extra:
        lo, hi = _pages(envelope.extra_page_block_sizes, (1, 256))
        ends["page_block_size"] |= {f"extra:{lo}", f"extra:{hi}"}
        ends["extra_cache"] = {"none", "present"}
        ends["scale_bytes"] |= {
            f"{formats.cache_formats(f)[1].name}:{e}" for f in extra for e in ("smallest", "largest")
        }
    if any(envelope.takes_lengths(f) for f in fmts):
        ends["topk_length"] = {"0", "topk"} | (
            {str(_INT32_MIN), str(_INT32_MAX)} if envelope.topk_length_range == "clamped" else set()
        )
        ends["stale_lanes"] = set(input_space.STALE_VALUES)
    if any(envelope.takes_sink(f) for f in fmts):
        ends["attn_sink"] = set(_SINK_ENDS)
    if _device(device) == "cuda":  # a 2 GiB pool per call: on the GPU only
        ends["pool_bytes"] = {"past-2**31"}
    routes = {"decode" if t <= 64 else "prefill" for t in _tokens(envelope, device) if t > 0}
    if envelope.returns_lse:
        ends["lse_convention"] = {f"{c}/{r}" for c in envelope.lse_conventions for r in routes}
    return ends


def ends_of(call: Any) -> dict[str, set[str]]:
    """The end labels (:func:`required_ends`) a drawn call (``search.DrawnCall``) hits."""
    m, e = call.main, call.extra
    main_fmt, extra_fmt = formats.cache_formats(call.fmt)
    if call.num_tokens == 0:  # nothing else of a call without tokens is exercised
        return {"fmt": {call.fmt}, "num_tokens": {"0"}}
    reads = {id(c): c is not None and _reads(call, c) for c in (m, e)}
    sizes = any(reads.values())  # a size is exercised only where some lane is valid
    out: dict[str, set[str]] = {
        "fmt": {call.fmt},
        "num_tokens": {str(call.num_tokens)} if sizes else set(),
        "num_heads": {str(call.num_heads)} if sizes else set(),
        "topk": {str(m.width)} if sizes else set(),
        "query_layout": {"strided" if call.strided_query else "contiguous"} if sizes else set(),
        "extra_cache": {"none" if e is None else "present"},
        "masked_lanes": set(),
        "scale_bytes": set(),
        "sm_scale": set(),
        "attn_sink": set(),
    }
    if reads[id(m)]:
        out.update(_read_ends(call))

    if m.masked_fraction >= 1.0 or call.empty_fraction >= 1.0:
        out["masked_lanes"].add("all")
    if m.masked_fraction > 0:
        out["masked_lanes"].add(str(m.mask_value))
    for c, f in ((m, main_fmt), (e, extra_fmt)):
        if c is not None and c.scale_end != "none" and reads[id(c)]:
            out["scale_bytes"].add(f"{f.name}:{c.scale_end}")
    if e is not None and reads[id(e)]:
        out.setdefault("page_block_size", set()).add(f"extra:{e.page_block_size}")
    if m.lengths is not None:
        lo, hi = m.lengths
        out["topk_length"] = {str(lo)} if lo == hi and (lo <= 0 or reads[id(m)]) else set()  # a length
        # that admits lanes: some valid
        out["topk_length"] |= {"topk"} if lo == hi == m.width and reads[id(m)] else set()
        out["stale_lanes"] = {m.stale}
    name, scale = call.sm_scale
    for label, value in _SM_SCALE_ENDS.items():
        if scale == value and (label != "negative" or name == "-512**-0.5"):
            out["sm_scale"].add(label)
    if call.sink is not None:
        out["attn_sink"] = {label for label, value in _SINK_ENDS.items() if value in call.sink}
    if call.lse_convention is not None and call.num_tokens > 0:
        out["lse_convention"] = {f"{call.lse_convention}/{'decode' if call.num_tokens <= 64 else 'prefill'}"}
    return out


def _reads(call: Any, c: Any) -> bool:
    """Whether some lane of cache ``c`` of ``call`` is valid and its value reaches the output (not
    when every head's sink lies 1000 above the scores: the output is then ``e**-1000`` of them)."""
    if call.empty_fraction >= 1.0 or c.masked_fraction >= 1.0:
        return False
    if call.sink is not None and min(call.sink) >= _SINK_ENDS["LSE+1000"]:
        return False
    return c.lengths is None or c.lengths[1] > 0


def _read_ends(call: Any) -> dict[str, set[str]]:
    """The ends of a call that some valid lane of its main cache exercises."""
    from pytest_sparse_mla import search

    m = call.main
    return {
        "index_pattern": {m.pattern},
        "value_exponent": {f"nope:{m.value_exponent}", f"rope:{m.rope_exponent}"},
        "score_spread": {f"{call.score_spread:g}"},
        "score_offset": {f"{call.score_offset:g}"},
        "peak": {f"{call.peak:g}"},
        "cache_form": {m.form},
        "page_stride": {m.stride if isinstance(m.stride, str) else f"padded+{m.stride}"},
        "storage_offset": {f"layer{m.layer}/{m.num_layers}"},
        "page_block_size": {f"main:{m.page_block_size}"},
        "pool_bytes": {search.pool_class(call)},
    }


# --- the schedule ----------------------------------------------------------------------------------


def fits(call: Any, envelope: Envelope, device: str) -> bool:
    """Whether ``call`` lies inside ``envelope`` and its size bound (from its plain values)."""
    from pytest_sparse_mla.search import LARGEST_SCALE_LANES

    f = call.fmt
    m, e = call.main, call.extra
    if f not in envelope.formats or envelope.tokens_reason(call.num_tokens) or envelope.heads_reason(call.num_heads):
        return False
    if envelope.topk.reason("topk", m.width) or envelope.page_reason("page_block_size", m.page_block_size):
        return False
    lanes = m.width + (0 if e is None else e.width)
    if e is not None and (
        not envelope.takes_extra(f)
        or envelope.extra_topk.reason("extra_topk", e.width)
        or envelope.page_reason("extra_page_block_size", e.page_block_size)
    ):
        return False
    for c in (m, e):
        if c is None:
            continue
        if c.lengths is not None and not envelope.takes_lengths(f):
            return False
        row = envelope.topk_length_range == "row"
        if c.lengths is not None and row and not 0 <= c.lengths[0] <= c.lengths[1] <= c.width:
            return False
        if c.mask_value != -1 and envelope.masked_indices != "negative":
            return False
        if c.scale_end == "largest" and lanes > LARGEST_SCALE_LANES:
            return False
        record = formats.cache_formats(f)[0 if c is m else 1]
        if c.stride == "tight" and (c.page_block_size * record.bytes_per_token) % 16:
            return False
        if c.num_pages * c.page_block_size < min(c.width, 64):
            return False
    if call.sink is not None and not envelope.takes_sink(f):
        return False
    if (call.lse_convention is None) != (not envelope.returns_lse):
        return False
    if call.lse_convention is not None and call.lse_convention not in envelope.lse_conventions:
        return False
    return call.num_tokens * call.num_heads * lanes <= _cost_bound(envelope, device)


def _cost(call: Any) -> int:
    """``T * H * lanes`` of a call (the schedule places an end in the cheapest call that takes it)."""
    return call.num_tokens * call.num_heads * (call.main.width + (0 if call.extra is None else call.extra.width))


def _cost_bound(envelope: Envelope, device: str) -> int:
    """The size bound of a covering call: :data:`_COST`, or what the envelope's smallest heads and
    widths need at the largest token count of the schedule (a 64/128-head kernel)."""
    heads = min(envelope.num_heads or (1,))
    width = _widths(envelope.topk)[0] + _widths(envelope.extra_topk)[0]
    return max(_COST[_device(device)], max(_tokens(envelope, device)) * heads * width)


def _base(envelope: Envelope, index: int) -> Any:
    from pytest_sparse_mla import search

    lo, _ = _widths(envelope.topk)
    ps = _pages(envelope.page_block_sizes, (64, 64))[0]
    main = search.DrawnCache(
        width=lo, page_block_size=ps, num_pages=max(1, -(-min(lo, 64) // ps)) + 1, lengths=None,
        masked_fraction=0.0, scattered=False, mask_value=-1, pattern="uniform", stale="-1", value_exponent=0,
        rope_exponent=0, wide=False, form="nhd", stride="padded", layer=0, num_layers=1, canary=0,
    )  # fmt: skip
    return search.DrawnCall(
        fmt=envelope.formats[0], num_tokens=max(1, envelope.min_tokens), num_heads=min(envelope.num_heads or (1,)),
        main=main, extra=None, empty_fraction=0.0, sm_scale=("512**-0.5", 512**-0.5), score_spread=0.3,
        score_offset=0.0, peak=0.0, sink=None,
        lse_convention=envelope.lse_conventions[0] if envelope.returns_lse else None, lse_scale=1.0,
        strided_query=False, poison=0x7F, seed=9000 + index,
    )  # fmt: skip


def with_main(call: Any, **over: Any) -> Any:
    """``call`` with its main cache's fields ``over`` changed (and enough pages for its lanes)."""
    main = dataclasses.replace(call.main, **over)
    pages = max(main.num_pages, -(-min(main.width, 64) // main.page_block_size))
    return dataclasses.replace(call, main=dataclasses.replace(main, num_pages=pages))


def _with_extra(call: Any, envelope: Envelope, **over: Any) -> Any:
    extra = call.extra
    if extra is None:
        lo, _ = _widths(envelope.extra_topk)
        ps = _pages(envelope.extra_page_block_sizes, (64, 64))[0]
        extra = dataclasses.replace(call.main, width=lo, page_block_size=ps, lengths=None, scale_end="none",
                                    num_pages=max(1, -(-min(lo, 64) // ps)) + 1)  # fmt: skip
    extra = dataclasses.replace(extra, **over)
    pages = max(extra.num_pages, -(-min(extra.width, 64) // extra.page_block_size))
    return dataclasses.replace(call, extra=dataclasses.replace(extra, num_pages=pages))


def _setter(dim: str, label: str, envelope: Envelope) -> Callable[[Any], list[Any]]:
    """Candidate ways of making a call hit ``dim:label`` (each a changed call; the first that fits wins)."""
    rec = {f.name: f for f in formats.FORMATS.values()}

    def one(fn: Callable[[Any], Any]) -> Callable[[Any], list[Any]]:
        return lambda call: [fn(call)]

    if dim == "fmt":
        return one(lambda c: dataclasses.replace(c, fmt=label))
    if dim == "num_tokens":
        return one(lambda c: dataclasses.replace(c, num_tokens=int(label)))
    if dim == "num_heads":
        return one(lambda c: dataclasses.replace(c, num_heads=int(label)))
    if dim == "topk":
        return one(lambda c: with_main(c, width=int(label)))
    if dim == "topk_length":
        def lengths(c: Any) -> list[Any]:
            v = c.main.width if label == "topk" else int(label)
            return [with_main(c, lengths=(v, v))]
        return lengths
    if dim == "stale_lanes":
        def stale(c: Any) -> list[Any]:
            lengths = c.main.lengths if c.main.lengths is not None else (c.main.width // 2, c.main.width // 2)
            return [with_main(c, lengths=lengths, stale=label)]
        return stale
    if dim == "masked_lanes":
        if label == "all":
            return one(lambda c: with_main(c, masked_fraction=1.0))
        return one(lambda c: with_main(c, masked_fraction=0.5, scattered=True, mask_value=int(label)))
    if dim == "index_pattern":
        return one(lambda c: with_main(c, pattern=label))
    if dim == "page_block_size":
        which, size = label.split(":")
        if which == "main":
            return one(lambda c: with_main(c, page_block_size=int(size), num_pages=1))
        return one(lambda c: _with_extra(c, envelope, page_block_size=int(size), num_pages=1))
    if dim == "extra_cache":
        return one(lambda c: dataclasses.replace(c, extra=None) if label == "none" else _with_extra(c, envelope))
    if dim == "value_exponent":
        part, value = label.split(":")
        key = "value_exponent" if part == "nope" else "rope_exponent"
        return one(lambda c: with_main(c, **{key: int(value)}))
    if dim == "scale_bytes":
        name, end = label.split(":")

        def scales(c: Any) -> list[Any]:
            out = []
            for f in envelope.formats:
                main_fmt, extra_fmt = formats.cache_formats(f)
                if main_fmt is rec[name]:
                    out.append(with_main(dataclasses.replace(c, fmt=f), scale_end=end))
                if extra_fmt is rec[name] and envelope.takes_extra(f):
                    out.append(_with_extra(dataclasses.replace(c, fmt=f), envelope, scale_end=end))
            return out
        return scales
    if dim in ("score_spread", "score_offset", "peak"):
        return one(lambda c: dataclasses.replace(c, **{dim: float(label)}))
    if dim == "sm_scale":
        name = "-512**-0.5" if label == "negative" else ("0" if label == "0" else "log-uniform")
        if label == "negative":  # a negative scale turns the largest q.k into the smallest score: with
            # the widest spread, a max taken before the scale makes exp overflow
            return lambda c: [
                with_main(dataclasses.replace(c, sm_scale=(name, _SM_SCALE_ENDS[label]), score_spread=40.0),
                           width=max(c.main.width, 64)),
                dataclasses.replace(c, sm_scale=(name, _SM_SCALE_ENDS[label])),
            ]  # fmt: skip
        return one(lambda c: dataclasses.replace(c, sm_scale=(name, _SM_SCALE_ENDS[label])))
    if dim == "attn_sink":
        return one(lambda c: dataclasses.replace(c, sink=(_SINK_ENDS[label],)))
    if dim == "lse_convention":
        conv, route = label.split("/")

        def lse(c: Any) -> list[Any]:
            changed = dataclasses.replace(c, lse_convention=conv)
            if (c.num_tokens <= 64) == (route == "decode") and c.num_tokens > 0:
                return [changed]
            return [dataclasses.replace(changed, num_tokens=t) for t in ((8, 64) if route == "decode" else (65, 80))]
        return lse
    if dim == "cache_form":
        return one(lambda c: with_main(c, form=label))
    if dim == "page_stride":
        return one(lambda c: with_main(c, stride=256 if label == "padded+256" else label))
    if dim == "storage_offset":
        return one(lambda c: with_main(c, layer=3, num_layers=4, canary=256))
    if dim == "pool_bytes":  # layer 59 of a 60-layer pool whose last page starts past 2**31 bytes:
        def pool(c: Any) -> list[Any]:  # the first and last slot read
            stride = formats.page_stride_bytes(formats.cache_formats(c.fmt)[0], c.main.page_block_size, "padded")
            pages = 2 + 2**31 // (60 * stride)
            return [with_main(c, num_pages=pages, layer=59, num_layers=60, pattern="ends")]
        return pool
    if dim == "query_layout":
        return one(lambda c: dataclasses.replace(c, strided_query=label == "strided"))
    raise ValueError(f"no setter for the end {dim}:{label}")


def _masks(call: Any) -> bool:
    """Whether two ends of ``call`` would hide each other: a scale end beside an extreme value
    exponent of the same cache (the other part's magnitude then dwarfs the scaled values)."""
    return any(c is not None and c.scale_end != "none" and (c.value_exponent or c.rope_exponent)
               for c in (call.main, call.extra))  # fmt: skip


#: The dimensions a size end pins first (each large size in a call of its own).
_SIZE_DIMS = ("num_tokens", "num_heads", "topk")


def schedule(envelope: Envelope, device: str = "cpu") -> list[Any]:
    """The covering calls (``search.DrawnCall``) for ``envelope`` on ``device``: together they hit
    every label of :func:`required_ends`; each lies inside the envelope and the size bound.

    Greedy: the ends are placed in order (sizes first), each into the call it makes least costlier
    (:func:`_cost`; the cheaper call on a tie) without moving an end already placed there, else into
    a new call; where an end has several ways (a negative ``sm_scale`` with the widest spread first),
    the first way any call takes wins. An end that needs no size then never rides on the largest
    call. Deterministic.

    Raises:
        ValueError: an end no call inside the envelope can hit (a bug of this module).
    """
    needed = required_ends(envelope, device)
    order = [d for d in _SIZE_DIMS if d in needed] + [d for d in needed if d not in _SIZE_DIMS]
    rows: list[tuple[Any, dict[str, str]]] = []  # (call, pinned {dim: label})
    for dim in order:
        labels = sorted(needed[dim], key=lambda v: -int(v)) if dim in _SIZE_DIMS else sorted(needed[dim])
        for label in labels:  # sizes: the largest first, into the cheapest call
            setter = _setter(dim, label, envelope)
            placed = False
            best: tuple[int, int, int, int, Any] | None = None  # (setter's choice, cost added, cost, row, call)
            for i, (call, pinned) in enumerate(rows):
                if dim in pinned and pinned[dim] != label:
                    continue
                for k, candidate in enumerate(setter(call)):
                    hits = ends_of(candidate)
                    if label in hits.get(dim, set()) and all(v in hits.get(d, set()) for d, v in pinned.items()) \
                            and fits(candidate, envelope, device) and not _masks(candidate):  # fmt: skip
                        key = (k, _cost(candidate) - _cost(call), _cost(call), i, candidate)
                        best = key if best is None or key[:4] < best[:4] else best
                        break
            if best is not None:
                *_, i, candidate = best
                rows[i] = (candidate, {**rows[i][1], dim: label})
                placed = True
            if not placed:
                for candidate in setter(_base(envelope, len(rows))):
                    if label in ends_of(candidate).get(dim, set()) and fits(candidate, envelope, device):
                        rows.append((candidate, {dim: label}))
                        placed = True
                        break
            if not placed:
                raise ValueError(f"covering schedule: no call inside the envelope hits {dim}={label}")
    return [call for call, _ in rows]
