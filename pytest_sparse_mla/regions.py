"""Regions of the input space: where a discrepancy lives, so the search can look elsewhere.

A search that stops at a kernel's first bug re-finds that bug in every shard: a bug drawn in one
call out of three is met in each shard's first calls, and the rest of the budget goes to shrinking
it again. The search (``pytest_sparse_mla.search_run.SearchRun``) therefore runs in rounds: once a
failure is shrunk, it finds the **region** the failure needs and spends the rest of the budget
outside it.

* :func:`features` maps a drawn call (``search.DrawnCall``, plain values) to one coarse class per
  dimension (``{"sm_scale": "0", "num_tokens": "prefill", ...}``): the classes a region is made of.
* A :class:`Region` constrains some dimensions to sets of classes; a call lies inside it when each
  constrained dimension's class is in its set. The search finds a region by moving one dimension of
  the shrunk call at a time to another class (``search_run.moves``): a dimension whose move makes
  the failure go away is one the failure needs; the region holds the classes under which the
  failure stayed.
* A peer's known discrepancy names its region beside its xfail entry, in the xfail file::

      # [sm-scale-zero] bug: with sm_scale=0 the decode returns NaN ...
      # [sm-scale-zero] region: sm_scale=0
      # [masked-lanes] region: fmt=dsv3_2 masked_lanes=-1,other-negative

  (:func:`read_regions`; ``dimension=class[,class...]`` words, classes as :func:`features` names
  them). The search spends nothing inside a known region beyond confirming it once per test
  (:data:`CONFIRM_CALLS` calls at most), reports a failure inside it under its key
  (:class:`~pytest_sparse_mla.errors.KnownDiscrepancy`) and one outside every known region as new.
* A few dimensions exist only once a call is built (:data:`BUILT`, :func:`built_features`: the
  largest query element, the heaviest cache slot's share of a row's softmax weight, and the share
  its masked lanes would take if scored as logit 0, which ``search.build`` derives from the drawn
  keys and logit regime). A drawn call has no class in
  them, so a region naming one holds no call until it is built: the search builds such a call, then
  skips it or confirms the known discrepancy with it (``search_run.SearchRun.note``). Only known
  regions name them; a region the search finds moves the drawn values only.
* A property that judges a call derived from the drawn one (the lane-order property permutes each
  row and pads it with ``-1`` lanes) gives the search the derived call's classes
  (:func:`permuted_and_padded`), so a known region of ``-1`` lanes holds its padded calls.

Pure data and text: imports neither torch, pytest nor hypothesis (:func:`built_features`, given
tensors, imports torch when called).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_sparse_mla.envelope import ALL_FORMATS

__all__ = ["BUILT", "CONFIRM_CALLS", "E4M3_MAX", "FEATURES", "MASKED_LANE_WEIGHT", "Region",
           "TOP_SLOT_WEIGHT", "built_features", "features",
           "parse_region", "permuted_and_padded", "read_regions", "zero_lane_share"]

#: Calls the search makes inside a known region per test to confirm the discrepancy still shows
#: (a strict xfail then reports a fix); every later call drawn inside it is not made.
CONFIRM_CALLS = 3

#: The dimensions :func:`features` classifies, and their classes (a region names these).
FEATURES: dict[str, tuple[str, ...]] = {
    "fmt": ALL_FORMATS,
    "num_tokens": ("0", "1", "decode", "prefill", "prefill-large"),
    "num_heads": ("1", "2-63", "64-128", "129+"),
    "topk": ("1-63", "64-512", "513+"),
    "topk_length": ("none", "in-row", "negative", "beyond", "int32-end"),
    "masked_lanes": ("none", "-1", "other-negative", "all"),
    "mask_placement": ("none", "trailing", "scattered"),
    "extra_masked_lanes": ("none", "-1", "other-negative", "all"),
    "empty_rows": ("none", "some", "all"),
    "empty_first_tile": ("none", "main", "extra", "both"),
    "index_pattern": ("uniform", "few", "ends", "one-page"),
    "stale_lanes": ("no-lengths", "1<<30", "poisoned-slot", "-1"),
    "extra_stale_lanes": ("none", "no-lengths", "1<<30", "poisoned-slot", "-1"),
    "page_block_size": ("1-3", "4-63", "64", "65-255", "256+"),
    "extra_cache": ("none", "present"),
    "value_exponent": ("below-2**-20", "2**-20..2**20", "above-2**20"),
    "rope_exponent": ("below-2**-20", "2**-20..2**20", "above-2**20"),
    "value_spread": ("none", "wide"),
    "extra_value_exponent": ("none", "below-2**-20", "2**-20..2**20", "above-2**20"),
    "extra_rope_exponent": ("none", "below-2**-20", "2**-20..2**20", "above-2**20"),
    "extra_value_spread": ("none", "wide"),
    "scale_end": ("none", "smallest", "largest"),
    "extra_scale_end": ("none", "smallest", "largest"),
    "score_spread": ("0", "small", "large"),
    "score_offset": ("far-negative", "near-zero", "far-positive"),
    "peak": ("none", "peaked"),
    "sm_scale": ("512**-0.5", "576**-0.5", "yarn-0.1353", "192**-0.5", "1", "0", "-512**-0.5", "log-uniform"),
    "attn_sink": ("none", "-inf", "finite"),
    "lse_convention": ("none", "flashinfer", "flashmla"),
    "cache_form": ("2d", "3d", "hnd", "nhd"),
    "page_stride": ("tight", "padded", "padded+"),
    "storage_offset": ("alone", "layer0-of-pool", "layer1+"),
    "extra_storage_offset": ("none", "alone", "layer0-of-pool", "layer1+"),
    "query_layout": ("contiguous", "strided"),
    "query_peak": ("e4m3-range", "beyond-e4m3"),
    "top_slot_weight": ("below-0.99", "0.99+"),
    "masked_lane_weight": ("none", "below-2**-12", "2**-12+"),
}

#: The dimensions of :data:`FEATURES` only a built call has (:func:`built_features`).
BUILT = ("query_peak", "top_slot_weight", "masked_lane_weight")

#: The share of a row's softmax weight (its lanes', the sink left out) on its heaviest cache slot from
#: which ``top_slot_weight`` is ``"0.99+"``: the row's output is then that slot's value row to within
#: 1%, so an error in a single value element is no longer averaged away by the other slots.
TOP_SLOT_WEIGHT = 0.99

#: The share of a row's softmax weight its masked lanes would take if each were scored as a lane of
#: logit 0 from which ``masked_lane_weight`` is ``"2**-12+"``: a kernel (or its caller) that gathers a
#: zero row for a masked lane moves such a row's LSE by ``-ln(1 - share)``, about the share, and
#: scales its output by at most ``1 - share``; below ``2**-12`` (a quarter of the LSE bound
#: ``2**-10`` of the ``kernel`` and ``kernel-fp8`` profiles, ``pytest_sparse_mla.tolerances``) that
#: cannot show under those profiles (it can under ``tight``'s ``1e-6``).
MASKED_LANE_WEIGHT = 2.0**-12

#: E4M3's largest finite magnitude (OCP 8-bit Floating Point Specification (OFP8) v1.0, 2023:
#: S.1111.110 = 448; ``torch.finfo(torch.float8_e4m3fn).max``).
E4M3_MAX = 448.0


def _bucket(value: int, edges: Iterable[tuple[int, str]], top: str) -> str:
    for bound, name in edges:
        if value <= bound:
            return name
    return top


def _lengths(c: Any) -> str:
    if c.lengths is None:
        return "none"
    lo, hi = c.lengths
    if min(lo, -hi) <= -(2**30) or max(hi, lo) >= 2**30:
        return "int32-end"
    if lo < 0:
        return "negative"
    if hi > c.width:
        return "beyond"
    return "in-row"


def _first_tile_empty(c: Any) -> bool:
    """Whether some row of cache ``c`` (a ``search.DrawnCache`` or ``None``) has no valid lane among
    its first lanes: a length of 0 or less, or every lane masked."""
    return c is not None and ((c.lengths is not None and c.lengths[0] <= 0) or c.masked_fraction >= 1.0)


def _masks(c: Any) -> str:
    """The ``masked_lanes`` class of cache ``c`` (a ``search.DrawnCache`` or ``None``)."""
    if c is None or c.masked_fraction <= 0:
        return "none"
    if c.masked_fraction >= 1.0:
        return "all"
    return "-1" if c.mask_value == -1 else "other-negative"


def _exponent(e: int) -> str:
    return "below-2**-20" if e < -20 else ("above-2**20" if e > 20 else "2**-20..2**20")


def features(call: Any) -> dict[str, str]:
    """The class of each dimension of ``call`` (a ``search.DrawnCall``): ``{name: class}`` with the
    names and classes of :data:`FEATURES` (the main cache's for per-cache dimensions; the ``extra_``
    ones the extra cache's, ``"none"`` without one), but for the :data:`BUILT` ones, which only
    :func:`built_features` of the built call has.

    Token counts: ``"decode"`` is 2..64, ``"prefill"`` 65..256, ``"prefill-large"`` above 256
    (FlashInfer's decode cutoff, ``envelope.DECODE_MAX_TOKENS``). Score offsets: ``"near-zero"`` is
    ``|offset| <= 30``; spreads: ``"small"`` is ``<= 2``.
    """
    def _offset(c: Any) -> str:
        return "layer1+" if c.layer else ("alone" if c.num_layers == 1 else "layer0-of-pool")

    m = call.main
    T = call.num_tokens
    stride = m.stride if isinstance(m.stride, str) else "padded+"
    masked = _masks(m)
    return {
        "fmt": call.fmt,
        "num_tokens": str(T) if T <= 1 else ("decode" if T <= 64 else "prefill" if T <= 256 else "prefill-large"),
        "num_heads": _bucket(call.num_heads, ((1, "1"), (63, "2-63"), (128, "64-128")), "129+"),
        "topk": _bucket(m.width, ((63, "1-63"), (512, "64-512")), "513+"),
        "topk_length": _lengths(m),
        "masked_lanes": masked,
        "mask_placement": "none" if masked == "none" else ("scattered" if m.scattered else "trailing"),
        "extra_masked_lanes": _masks(call.extra),
        "empty_rows": "none" if call.empty_fraction <= 0 else ("all" if call.empty_fraction >= 1 else "some"),
        "empty_first_tile": _empty_first_tile(call),
        "index_pattern": m.pattern,
        "stale_lanes": m.stale if m.lengths is not None else "no-lengths",
        "page_block_size": _bucket(m.page_block_size, ((3, "1-3"), (63, "4-63"), (64, "64"), (255, "65-255")), "256+"),
        "extra_cache": "none" if call.extra is None else "present",
        "extra_stale_lanes": "none" if call.extra is None
        else (call.extra.stale if call.extra.lengths is not None else "no-lengths"),
        "value_exponent": _exponent(m.value_exponent),
        "rope_exponent": _exponent(m.rope_exponent),
        "value_spread": "wide" if m.wide else "none",
        "extra_value_exponent": "none" if call.extra is None else _exponent(call.extra.value_exponent),
        "extra_rope_exponent": "none" if call.extra is None else _exponent(call.extra.rope_exponent),
        "extra_value_spread": "wide" if call.extra is not None and call.extra.wide else "none",
        "scale_end": getattr(m, "scale_end", "none"),
        "extra_scale_end": "none" if call.extra is None else getattr(call.extra, "scale_end", "none"),
        "score_spread": "0" if call.score_spread == 0 else ("small" if call.score_spread <= 2 else "large"),
        "score_offset": "near-zero"
        if abs(call.score_offset) <= 30
        else ("far-negative" if call.score_offset < 0 else "far-positive"),
        "peak": "peaked" if call.peak else "none",
        "sm_scale": call.sm_scale[0],
        "attn_sink": "none"
        if call.sink is None
        else ("-inf" if all(math.isinf(s) and s < 0 for s in call.sink) else "finite"),
        "lse_convention": call.lse_convention or "none",
        "cache_form": m.form,
        "page_stride": stride,
        "storage_offset": _offset(m),
        "extra_storage_offset": "none" if call.extra is None else _offset(call.extra),
        "query_layout": "strided" if call.strided_query else "contiguous",
    }


def built_features(q: Any, scores: Any, slots: Any, masked: Any = None) -> dict[str, str]:
    """The classes of the :data:`BUILT` dimensions of a built call whose query is ``q`` (a tensor
    ``[num_tokens, num_heads, d_qk]``, any float dtype), whose logits are ``scores`` (float64
    ``[num_tokens, num_heads, topk + extra_topk]``, ``-inf`` on lanes that do not attend:
    ``search.SearchInputs.scores``) and whose lanes name the cache slots ``slots`` (int64
    ``[num_tokens, topk + extra_topk]``, one number per distinct slot of either cache, any value on
    a lane that does not attend; lanes naming one slot have one logit per head, as in every built
    call) and whose rows hold ``masked`` masked lanes (int ``[num_tokens]``: lanes inside the row's
    length, either cache, whose index is negative; ``None``: none); any device.

    ``query_peak``: ``"e4m3-range"`` when every ``|q|`` element is at most :data:`E4M3_MAX` (448),
    else ``"beyond-e4m3"``: a query a kernel casts to E4M3 without a scale loses it (saturates, or
    becomes NaN where the cast does not saturate). An empty query is ``"e4m3-range"``.

    ``top_slot_weight``: ``"0.99+"`` when some (token, head) row with a valid lane puts at least
    :data:`TOP_SLOT_WEIGHT` of its lanes' softmax weight (the sink left out) on one cache slot (a row
    of one valid lane, lanes that all name one slot, a peaked or widely spread row; duplicate lanes'
    weights summed), else ``"below-0.99"``: where one slot carries the row, an element of its value
    row a kernel loses (an FP8 cast that flushes it to 0) shows in the output as itself, where many
    slots of comparable weight average it away.

    ``masked_lane_weight``: ``"none"`` when no row has a masked lane; else the largest share, over
    the (token, head) rows, of the row's softmax weight (the sink left out) its ``m`` masked lanes
    would take if each were scored as a lane of logit 0 with a zero value, ``m / (m + sum_j
    exp(s_j))`` (1 for a row of masked lanes only), is ``"2**-12+"`` from
    :data:`MASKED_LANE_WEIGHT`, else ``"below-2**-12"``: a kernel or caller that gathers a zero row
    for a masked lane (SGLang's ``_forward_prefill_sparse_q8kv8``, ``deepseek_v4_backend.py``,
    replaces every ``-1`` with the index of a zero workspace row) is wrong by about that share,
    which next to far larger logits (a far-positive offset, a peaked row) is below every bound.
    """
    import torch  # called with tensors: torch is loaded already

    peak = float(q.detach().float().abs().amax()) if q.numel() else 0.0
    top = 0.0
    if scores.numel():
        s = scores.detach()
        live = s.amax(-1, keepdim=True)
        finite = live.isfinite()
        w = (s - live.where(finite, live.new_zeros(()))).exp()  # [T, H, N]; 0 where a lane does not attend
        # Lanes naming one slot share its logit (per head), so a slot's weight is a lane's times the
        # valid lanes naming it; a lane that does not attend gets a slot of its own (negative).
        pos = torch.arange(slots.shape[-1], device=s.device)
        ids = slots.to(s.device).where(s.isfinite().any(1), -1 - pos)
        srt = ids.sort(dim=-1).values
        lanes = torch.searchsorted(srt, ids, right=True) - torch.searchsorted(srt, ids)  # [T, N]: lanes per slot
        share = (w * lanes.unsqueeze(1)).amax(-1) / w.sum(-1).clamp_min(1e-300)
        top = float(share.where(finite.squeeze(-1), share.new_zeros(())).amax())
    zero = "none"
    if masked is not None and bool((masked > 0).any()):
        share = zero_lane_share(scores, masked)
        zero = "2**-12+" if float(share.amax()) >= MASKED_LANE_WEIGHT else "below-2**-12"
    return {"query_peak": "e4m3-range" if peak <= E4M3_MAX else "beyond-e4m3",
            "top_slot_weight": "0.99+" if top >= TOP_SLOT_WEIGHT else "below-0.99",
            "masked_lane_weight": zero}


def zero_lane_share(scores: Any, masked: Any, sink: Any = None) -> Any:
    """``[T, H]`` float64: the share of each (token, head) row's softmax weight its masked lanes
    would take if each were scored as a lane of logit 0 (as where a zero row is gathered for a
    ``-1`` lane), ``m / (m + Z)``: ``scores`` ``[T, H, N]`` float64 natural-log logits (``-inf`` on
    lanes that do not attend), ``masked`` ``[T]`` the masked lanes per row (``m``; any integer
    dtype), ``sink`` ``[H]`` natural-log logits added to ``Z = sum_j exp(s_j)`` when given (a
    ``-inf`` one adds nothing). 1 for a row of masked lanes only, 0 for a row with none; computed
    against ``max(0, the row's largest logit)``, so no logit overflows. On ``scores``' device."""
    s = scores.detach() if sink is None else _with_sink(scores.detach(), sink)
    m = masked.to(device=s.device, dtype=s.dtype).unsqueeze(1)  # [T, 1]
    high = s.amax(-1).clamp_min(0.0)  # [T, H]
    rest = (s - high.unsqueeze(-1)).exp().sum(-1)  # sum_j exp(s_j - high); 0 for a row of no valid lane
    held = m * (-high).exp()
    return held / (held + rest).clamp_min(1e-300)


def _with_sink(scores: Any, sink: Any) -> Any:
    """``scores`` ``[T, H, N]`` with each head's ``sink`` (``[H]``) as one more lane."""
    import torch

    column = sink.to(scores.device, scores.dtype).reshape(1, -1, 1).expand(scores.shape[0], -1, 1)
    return torch.cat([scores, column], -1)


def permuted_and_padded(feats: Mapping[str, str], *, main_padded: bool, extra_padded: bool) -> dict[str, str]:
    """The classes of a call whose rows a property permutes within their lengths and pads with
    trailing ``-1`` lanes (the lane-order property, ``suites/test_attention_search.py``), from
    ``feats``, the drawn call's (:func:`features`): ``main_padded`` / ``extra_padded`` say which
    caches' rows got ``-1`` lanes. A cache with no masked lane gets ``-1`` ones (trailing, as the
    padding sits past the row's lanes); the main cache's masked lanes, permuted with the others,
    are ``scattered``. Every other class is the drawn call's."""
    out = dict(feats)
    if out["masked_lanes"] in ("-1", "other-negative"):
        out["mask_placement"] = "scattered"
    if main_padded and out["masked_lanes"] == "none":
        out["masked_lanes"], out["mask_placement"] = "-1", "trailing"
    if extra_padded and out["extra_masked_lanes"] == "none":
        out["extra_masked_lanes"] = "-1"
    return out


def _empty_first_tile(call: Any) -> str:
    """Which caches have a row whose first lanes hold no valid lane (an online softmax's first tile
    with nothing in it): ``"none"``, ``"main"``, ``"extra"`` or ``"both"``; an empty row (no valid
    lane in either cache) counts for both."""
    empty_row = call.empty_fraction > 0
    main = empty_row or _first_tile_empty(call.main)
    extra = call.extra is not None and (empty_row or _first_tile_empty(call.extra))
    return "both" if main and extra else "main" if main else "extra" if extra else "none"


@dataclass(frozen=True)
class Region:
    """A set of calls: each constrained dimension's class lies in its set.

    Attributes:
        key: the discrepancy's name (an xfail file's ``[KEY]``; ``"new-N"`` for one the search
            found in this run).
        conditions: ``{dimension: classes}``; an empty mapping is the whole input space.
        known: declared beside an xfail entry (``True``) or found by this run.
    """

    key: str
    conditions: Mapping[str, frozenset[str]] = field(default_factory=dict)
    known: bool = False

    def contains(self, feats: Mapping[str, str]) -> bool:
        """Whether a call with classes ``feats`` (:func:`features`) lies inside."""
        return all(feats.get(name) in classes for name, classes in self.conditions.items())

    def text(self) -> str:
        """``dim=class,class dim2=class`` (the xfail file's syntax; ``"anywhere"`` when unconstrained)."""
        words = [f"{name}={','.join(sorted(classes))}" for name, classes in sorted(self.conditions.items())]
        return " ".join(words) or "anywhere"

    def as_dict(self) -> dict[str, Any]:
        """JSON form (the search's coverage record)."""
        return {"key": self.key, "known": self.known, "region": self.text()}


_WORD = re.compile(r"^([a-z_]+)=([^\s=]+)$")


def parse_region(key: str, text: str, *, known: bool = True, where: str = "region") -> Region:
    """A :class:`Region` from ``dim=class[,class...]`` words separated by blanks.

    Raises:
        ValueError: a word that is not ``dim=classes``, an unknown dimension or class (the message
            names ``where``, the word and the names expected).
    """
    conditions: dict[str, frozenset[str]] = {}
    for word in text.split():
        match = _WORD.match(word)
        if match is None:
            raise ValueError(f"{where}: {word!r} is not 'dimension=class[,class...]'")
        name, classes = match.group(1), frozenset(match.group(2).split(","))
        if name not in FEATURES:
            raise ValueError(f"{where}: unknown dimension {name!r}; expected one of {sorted(FEATURES)}")
        unknown = sorted(classes - set(FEATURES[name]))
        if unknown:
            raise ValueError(f"{where}: {name}={','.join(unknown)} is not a class of {name}; expected {FEATURES[name]}")
        conditions[name] = classes
    if not conditions:
        raise ValueError(f"{where}: a region names at least one 'dimension=class' word")
    return Region(key, conditions, known)


_LINE = re.compile(r"^#\s*\[([^\]]+)\]\s*region:\s*(.*)$")


def read_regions(path: str | Path) -> list[Region]:
    """The known regions of an xfail file: its ``# [KEY] region: dim=class ...`` lines.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a region line :func:`parse_region` refuses (naming the file and line).
    """
    path = Path(path)
    out: list[Region] = []
    for lineno, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        match = _LINE.match(raw.strip())
        if match is not None:
            out.append(parse_region(match.group(1).strip(), match.group(2), where=f"{path}:{lineno}"))
    return out
