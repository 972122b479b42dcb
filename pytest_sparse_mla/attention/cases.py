"""Named, deterministic sparse-MLA input cases for the attention suites.

Two families:

* :data:`FLASHINFER_CASES`: the configurations and data distribution of FlashInfer's SM120 tests
  (flashinfer-ai/flashinfer ``tests/attention/test_sparse_mla_sm120.py``, ``_DSV4_DECODE_CONFIGS``
  and the prefill configs; reference ``tests/attention/sparse_mla_test_utils.py``): latent rows and queries
  ``(randn / 10).clamp(-1, 1)``, indices uniform over the cache with the second half ``-1``,
  ``sink = randn(H) * 2``, ``sm_scale = 512 ** -0.5``, page size 64; decode, prefill, runtime
  head counts and topk, ``topk_length`` truncation with stale padding, dual caches (extra page 64
  and 2), DSV3.2.
* :func:`deployment_cases`: every DeepSeek-V4 deployment of :mod:`pytest_sparse_mla.deployments`
  (V4-Flash 64 heads, V4-Pro 128 heads, per rank at TP 1/2/4/8; SWA topk 128; C4 extra 512 at page
  64; C128 extra 512 at page 2; DSpark topk 192 with 133 active entries), one decode-sized case
  each, plus prefill-sized cases (``large=True``: run on CUDA only), including the 4096-token
  V4-Flash C4 prefill.

Cases are plain frozen data; :func:`make_inputs` draws the tensors from a CPU generator and moves
them to the device, so a seed gives the same inputs on CPU and CUDA. This module does not import
pytest: the suites parametrise over the cases with ``pytest_sparse_mla.parametrize.case_params``
(ids ``case.name``) and draw inputs with ``pytest_sparse_mla.parametrize.inputs_on``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from pytest_sparse_mla import data, deployments, formats
from pytest_sparse_mla.attention.call import valid_lanes
from pytest_sparse_mla.envelope import Envelope, NotApplicable, route_of

__all__ = [
    "AttentionCase",
    "AttentionInputs",
    "CacheCase",
    "CONFORMANCE_CASES",
    "FLASHINFER_CASES",
    "STALE_INDEX",
    "REQUIREMENTS",
    "Conventions",
    "Values",
    "case_classes",
    "fit_case",
    "deployment_cases",
    "make_inputs",
]

#: What lanes past ``topk_length`` hold in the truncation cases: FlashInfer's stale padding
#: (``1 << 30``, far out of range; ``..._bounds_stale_padding`` in the FlashInfer tests).
STALE_INDEX = 1 << 30


@dataclass(frozen=True)
class CacheCase:
    """One cache of a case and the index rows into it: the main cache, or the extra cache.

    Attributes:
        topk: index lanes drawn per token (``topk`` of the main cache, ``extra_topk`` of the extra one).
        page_block_size, num_pages: the cache's geometry (tokens per page, pages).
        masked_fraction: trailing fraction of each index row set to ``-1``.
        topk_length: one valid length for every token (``topk_length`` / ``extra_topk_length``;
            ``None`` = no length tensor); lanes past it are overwritten with :data:`STALE_INDEX`.
        page_stride: ``formats.StrideSpec`` (``"padded"``, ``"tight"`` or bytes); ``None`` = the
            main cache's (for the main cache: ``"padded"``).
        layer, num_layers: the cache is layer ``layer`` of a pool of ``num_layers`` per-layer
            caches sharing each page (a ``[P, ps, ...]`` view with storage offset
            ``layer * page_stride`` bytes and page stride ``num_layers * page_stride``; the other
            layers hold other valid data), as serving engines lay out per-layer pools.
        index_width: the index-row width passed to the kernel when wider than ``topk`` (the lanes
            past it are ``-1``: masked padding up to an envelope's width multiple); ``None`` = ``topk``.
        value_scale: a power of two multiplying the cache's source rows (mixed magnitudes across
            the caches).
    """

    topk: int
    page_block_size: int = 64
    num_pages: int = 16
    masked_fraction: float = 0.5
    topk_length: int | None = None
    page_stride: formats.StrideSpec | None = None
    layer: int = 0
    num_layers: int = 1
    index_width: int | None = None
    value_scale: float = 1.0


@dataclass(frozen=True)
class Values:
    """What the drawn tensors hold.

    Attributes:
        query: ``"random"`` (the distribution's queries: logits around 0.01, a nearly uniform
            softmax), ``"peaked"`` (each (token, head) query aligned with one chosen valid
            candidate, alternating between the main and the extra cache by head, so that candidate
            scores ``peak`` natural-log units while the others score about ``N(0, 0.35)``) or
            ``"flat"`` (queries scaled by ``2**-10``: every logit within about ``1e-4`` of 0) or
            ``"long-tail"`` (hand-built rows, :func:`_long_tail_rows`: per token one top key from the
            main cache's page 0 and every other lane a tail key scoring :data:`TAIL_GAP`
            natural-log units below it, a probability ``exp(-gap)`` below ``2**-10`` where an
            unscaled E4M3 cast of P rounds to 0; only the tail keys have values in the NoPE dims
            past ``num_heads``, so those outputs are the tail's weight alone; with small logits, so
            the FP8 profile's score term stays small; main cache only, no sink) or
            ``"skewed-query"`` (hand-built rows, :func:`_skewed_rows`: each query's logit signal,
            ``+-SKEW_LOGIT``, in one dim and ``2**SKEW_LOG2`` times that element in a dim where
            every key is 0, so the logits stay small; one E4M3 scale per (token, head) flushes the
            signal, one per 64 dims keeps it; main cache only, no sink).
        peak: the chosen candidate's logit for ``query="peaked"`` (8: about 95% of the weight over
            128 candidates; 30: one dominant key).
        sink_kind: the ``attn_sink`` drawn (when the case passes one): ``"randn"`` (``randn(H) * 2``,
            FlashInfer's draw), ``"large"`` (per head, the median over tokens of the row's
            natural-log LSE plus a uniform offset in ``[-1, 1]``: the sink carries about as much
            mass as the candidates) or ``"mixed-inf"`` (``"large"`` on odd heads, ``-inf`` on even
            heads).
        distribution: the latent rows' and queries' distribution (``data.latent``).
    """

    query: str = "random"
    peak: float = 8.0
    sink_kind: str = "randn"
    distribution: str = "flashinfer"


@dataclass(frozen=True)
class Conventions:
    """How the call is spelled.

    Attributes:
        fmt: the call format (``formats.CALL_FORMATS``: ``"dsv4"``, ``"dsv3_2"``, ``"dsv4_1"``, ...).
        with_sink: pass an ``attn_sink``.
        form: the caches' tensor form (``formats.as_form``: ``"nhd"``, ``"hnd"``, ``"3d"``, ``"2d"``).
    """

    fmt: str = "dsv4"
    with_sink: bool = True
    form: str = "nhd"


@dataclass(frozen=True)
class AttentionCase:
    """One sparse-MLA call shape and how to fill it.

    Attributes:
        name: stable id used as the pytest parameter id.
        num_tokens, num_heads: ``T`` and ``H``.
        main: the main cache and its index rows.
        extra: the extra cache and its index rows (``None`` = no extra cache).
        values: what the tensors hold (queries, sink, distribution).
        conventions: the call format, the sink argument and the caches' form.
        large: too big for CPU in a suite; run only on CUDA.
        requires: what the case exists to exercise, so that :func:`fit_case` declares it not
            applicable instead of changing it (:data:`REQUIREMENTS`).
        fitted: what :func:`fit_case` changed to bring the case inside an envelope, in words.
    """

    name: str
    num_tokens: int
    num_heads: int
    main: CacheCase
    extra: CacheCase | None = None
    values: Values = Values()
    conventions: Conventions = Conventions()
    large: bool = False
    requires: tuple[str, ...] = ()
    fitted: tuple[str, ...] = ()

    def with_tokens(self, num_tokens: int) -> AttentionCase:
        """The same case with another ``num_tokens`` (name suffixed ``-T{num_tokens}``)."""
        return replace(self, name=f"{self.name}-T{num_tokens}", num_tokens=num_tokens)


@dataclass(frozen=True)
class AttentionInputs:
    """Tensors of one case, on one device.

    Attributes:
        case: the :class:`AttentionCase`.
        q: ``[T, H, d_qk]`` BF16.
        cache, extra: :class:`pytest_sparse_mla.data.PackedKVCache` (``extra`` may be ``None``).
        indices, extra_indices: ``[T, topk]`` / ``[T, extra_topk]`` int32.
        topk_length, extra_topk_length: ``[T]`` int32 or ``None``.
        attn_sink: ``[H]`` fp32 or ``None``.
        sm_scale: ``d_qk ** -0.5`` (``512 ** -0.5`` for DSV4, as FlashInfer's and FlashMLA's tests).
        lse_convention: passed to the forward and the oracle when set (the convention the
            implementation's envelope honours; ``None``: the forward's default).
    """

    case: AttentionCase
    q: torch.Tensor
    cache: data.PackedKVCache
    indices: torch.Tensor
    sm_scale: float
    topk_length: torch.Tensor | None = None
    attn_sink: torch.Tensor | None = None
    extra: data.PackedKVCache | None = None
    extra_indices: torch.Tensor | None = None
    extra_topk_length: torch.Tensor | None = None
    lse_convention: str | None = None

    def kwargs(self, **overrides: Any) -> dict[str, Any]:
        """Keyword arguments of ``sparse_mla_forward`` for this case (``None`` values omitted),
        updated with ``overrides``."""
        kw: dict[str, Any] = {
            "sm_scale": self.sm_scale,
            "fmt": self.case.conventions.fmt,
            "topk_length": self.topk_length,
            "attn_sink": self.attn_sink,
            "extra_kv_cache": self.extra.packed if self.extra is not None else None,
            "extra_indices": self.extra_indices,
            "extra_topk_length": self.extra_topk_length,
            "lse_convention": self.lse_convention,
        }
        kw.update(overrides)
        return {k: v for k, v in kw.items() if v is not None}

    def run(self, forward: Callable[..., Any], **overrides: Any) -> Any:
        """``forward(q, cache.packed, indices, **kwargs(**overrides))``."""
        return forward(self.q, self.cache.packed, self.indices, **self.kwargs(**overrides))


def _lengths_and_stale(indices: torch.Tensor, length: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    if length is None:
        return indices, None
    num_tokens, topk = indices.shape
    out = indices.clone()
    out[:, max(0, min(length, topk)) :] = STALE_INDEX
    return out, torch.full((num_tokens,), length, dtype=torch.int32)


def _pad_row(indices: torch.Tensor, width: int | None) -> torch.Tensor:
    """``indices`` followed by ``-1`` lanes up to ``width`` (masked padding)."""
    if width is None or width <= indices.shape[1]:
        return indices
    pad = torch.full((indices.shape[0], width - indices.shape[1]), -1, dtype=indices.dtype)
    return torch.cat([indices, pad], dim=1)


QUERIES: tuple[str, ...] = ("random", "peaked", "flat", "long-tail", "skewed-query")
SINK_KINDS: tuple[str, ...] = ("randn", "large", "mixed-inf")


def _cache(
    generator: torch.Generator,
    f: formats.PackedFormat,
    *,
    num_pages: int,
    page_block_size: int,
    page_stride: formats.StrideSpec,
    form: str,
    distribution: str,
    value_scale: float,
    layer: int,
    num_layers: int,
    device: torch.device | str,
    rows: Callable[[int, int, formats.PackedFormat], torch.Tensor] | None = None,
) -> data.PackedKVCache:
    """A packed cache, optionally with scaled rows, with the hand-built rows ``rows(num_pages,
    page_block_size, f)`` in place of the drawn ones (:func:`_long_tail_rows`, :func:`_skewed_rows`)
    and as one layer of a multi-layer page pool."""
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer={layer}: expected 0 <= layer < num_layers={num_layers}")
    source = data.latent((num_pages, page_block_size, f.d_qk), generator, distribution=distribution)
    if value_scale != 1.0:
        source = (source.float() * value_scale).to(torch.bfloat16)  # a power of two: exact
    if rows is not None:  # drawn first all the same: the case's later draws keep their generator stream
        source = rows(num_pages, page_block_size, f)
    layers = []
    for index in range(num_layers):
        # Other layers come from their own generator, so the case's other draws do not depend on
        # the layer count (the same rows, queries and indices as a one-layer cache).
        other = torch.Generator().manual_seed(0x5A17 + index)
        rows = source if index == layer else data.latent(source.shape, other, distribution=distribution)
        packed = formats.quantize_pack(rows, f, page_stride=page_stride, form="2d")
        stride = packed.stride(0)
        layers.append(packed.as_strided((num_pages, stride), (stride, 1), packed.storage_offset()))
    pool = torch.cat(layers, dim=1).to(device)  # page p: layer 0's bytes, layer 1's, ...
    width = layers[0].shape[1]
    packed = formats.as_form(pool[:, layer * width : (layer + 1) * width], f, page_block_size, form)
    dequantized = formats.unpack_dequantize(
        formats.as_form(layers[layer], f, page_block_size, form), f, page_block_size=page_block_size
    )
    layout = formats.parse_cache(packed, f, page_block_size=page_block_size)
    return data.PackedKVCache(f, packed, source.to(device), dequantized.to(device), layout)


def _peaked_queries(
    q: torch.Tensor,
    caches: list[tuple[data.PackedKVCache, torch.Tensor, torch.Tensor | None]],
    sm_scale: float,
    peak: float,
) -> torch.Tensor:
    """Queries aligned with one valid candidate per (token, head): head ``h`` picks cache
    ``h % len(caches)`` (falling back to the others, in order, when its row has no valid lane) and
    that row's ``(h // len(caches)) % n``-th valid lane; ``q += peak / (sm_scale * ||k||) * k / ||k||``."""
    num_tokens, num_heads = q.shape[0], q.shape[1]
    heads = torch.arange(num_heads)
    own = heads % len(caches)
    tables = [cache.flat_dequantized().cpu().double() for cache, _, _ in caches]
    offsets = [0]
    for table in tables[:-1]:
        offsets.append(offsets[-1] + table.shape[0])
    picked = torch.zeros((num_tokens, num_heads), dtype=torch.long)  # row of the concatenated tables
    taken = torch.zeros((num_tokens, num_heads), dtype=torch.bool)
    for fallback in (False, True):
        for c, (_cache, indices, lengths) in enumerate(caches):
            prefers = (own != c) if fallback else (own == c)
            row = indices.cpu().long()
            valid = valid_lanes(row, lengths)
            count = valid.sum(dim=1, keepdim=True)  # [T, 1]
            in_order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)  # valid lanes first
            lane = (heads // len(caches)).unsqueeze(0) % count.clamp(min=1)  # [T, H]
            use = prefers.unsqueeze(0) & (count > 0) & ~taken
            picked = torch.where(use, row.gather(1, in_order.gather(1, lane)) + offsets[c], picked)
            taken |= use
    k = torch.cat(tables)[picked]  # [T, H, d_qk]
    norm = k.norm(dim=-1, keepdim=True)
    base = q.float()
    bumped = base + (peak / (sm_scale * norm) * k / norm).float()
    return torch.where(taken.unsqueeze(-1) & (norm > 0), bumped, base).to(torch.bfloat16)


def _head_signs(num_heads: int) -> torch.Tensor:
    """``[H]`` float: ``+1`` for even heads, ``-1`` for odd ones (the hand-built cases' signs)."""
    return 1.0 - 2.0 * (torch.arange(num_heads) % 2).float()


#: ``"long-tail"`` rows: the logit gap between the top key and every tail key (natural-log units;
#: the top scores ``+gap/2``, the tail ``-gap/2``). ``exp(-7.2)`` is ``7.5e-4``, below ``2**-10``
#: (``9.8e-4``, half of E4M3's smallest subnormal ``2**-9``), where an unscaled E4M3 cast rounds to 0.
TAIL_GAP = 7.2
#: ``"long-tail"`` rows: the key element that carries the logit (``+x`` in the top rows, ``-x`` in
#: the tail rows) and the tail rows' value in every other NoPE dim (the top rows hold 0 there).
TAIL_KEY = 4.0
TAIL_VALUE = 1.0


def _long_tail_rows(num_pages: int, page_block_size: int, num_heads: int, f: formats.PackedFormat) -> torch.Tensor:
    """``[P, ps, d_qk]`` BF16 rows of a ``"long-tail"`` cache, exact in E4M3 with power-of-two scales:
    head ``h``'s key dim is ``h``; page 0's rows (the top keys) hold ``+TAIL_KEY`` in dims
    ``0..H-1`` and 0 elsewhere, every other row (a tail key) ``-TAIL_KEY`` there and ``TAIL_VALUE`` in
    the other NoPE dims (RoPE dims 0); odd dims ``h`` (and odd heads' queries) negated
    (:func:`_head_signs`), so a kernel that takes a signed max for an absolute one meets a negative
    group.

    Raises:
        ValueError: more heads than NoPE dims.
    """
    if num_heads > f.d_nope:
        raise ValueError(f"num_heads={num_heads}: a long-tail case needs num_heads <= d_nope={f.d_nope}")
    rows = torch.zeros((num_pages, page_block_size, f.d_qk))
    rows[0, :, :num_heads] = TAIL_KEY * _head_signs(num_heads)
    rows[1:, :, :num_heads] = -TAIL_KEY * _head_signs(num_heads)
    rows[1:, :, num_heads : f.d_nope] = TAIL_VALUE
    return rows.to(torch.bfloat16)


def _long_tail_indices(
    num_tokens: int, topk: int, cache: data.PackedKVCache, generator: torch.Generator
) -> torch.Tensor:
    """``[T, topk]`` int32 rows, all lanes valid: lane 0 is token ``t``'s top key, slot
    ``t % page_block_size`` of page 0; lanes ``1..topk-1`` distinct slots of pages ``1..``.

    Raises:
        ValueError: the pages past page 0 hold fewer than ``topk - 1`` slots.
    """
    ps = cache.page_block_size
    others = cache.num_tokens - ps
    if others < topk - 1:
        raise ValueError(f"topk={topk}: a long-tail row needs topk - 1 <= {others} slots outside page 0")
    rows = [torch.randperm(others, generator=generator)[: topk - 1] + ps for _ in range(num_tokens)]
    top = (torch.arange(num_tokens) % ps).unsqueeze(1)
    return torch.cat([top, torch.stack(rows)], dim=1).to(torch.int32)


def _long_tail_queries(num_tokens: int, num_heads: int, d_qk: int, sm_scale: float) -> torch.Tensor:
    """BF16 ``[T, H, d_qk]``: head ``h``'s query is ``(-1)**h * TAIL_GAP / (2 * sm_scale * TAIL_KEY)``
    in dim ``h`` and 0 elsewhere, so it scores ``+TAIL_GAP/2`` on a top key and ``-TAIL_GAP/2`` on a
    tail key (before the BF16 rounding of the query)."""
    q = torch.zeros((num_tokens, num_heads, d_qk))
    heads = torch.arange(num_heads)
    q[:, heads, heads] = TAIL_GAP / (2.0 * sm_scale * TAIL_KEY) * _head_signs(num_heads)
    return q.to(torch.bfloat16)


#: ``"skewed-query"`` rows: head ``h``'s query holds ``a`` in dim ``SKEW_DIM + h``, where the keys hold
#: ``+-SKEW_KEY`` by slot parity (logits ``+-SKEW_LOGIT``), and ``a * 2**SKEW_LOG2`` in dim ``h``, where
#: every key holds 0: one E4M3 scale over a (token, head)'s whole query flushes ``a`` to 0 (below
#: ``2**-10`` of the scale's ``448``: ``2**-18.8``), a scale per 64 dims keeps it.
SKEW_DIM = 256
SKEW_KEY = 2048.0
SKEW_LOGIT = 2.0
SKEW_LOG2 = 20


def _skewed_rows(num_pages: int, page_block_size: int, num_heads: int, f: formats.PackedFormat) -> torch.Tensor:
    """``[P, ps, d_qk]`` BF16 rows of a ``"skewed-query"`` cache, exact in E4M3 with power-of-two
    scales: ``+SKEW_KEY`` (even slots) or ``-SKEW_KEY`` (odd slots) in dims
    ``SKEW_DIM..SKEW_DIM+H-1``, 0 elsewhere.

    Raises:
        ValueError: ``SKEW_DIM + num_heads`` past the NoPE dims, or ``num_heads > SKEW_DIM``.
    """
    if num_heads > SKEW_DIM or SKEW_DIM + num_heads > f.d_nope:
        most = min(SKEW_DIM, f.d_nope - SKEW_DIM)
        raise ValueError(f"num_heads={num_heads}: a skewed-query case needs num_heads <= {most}")
    slots = torch.arange(num_pages * page_block_size).reshape(num_pages, page_block_size)
    sign = 1.0 - 2.0 * (slots % 2).float()
    rows = torch.zeros((num_pages, page_block_size, f.d_qk))
    rows[..., SKEW_DIM : SKEW_DIM + num_heads] = (SKEW_KEY * sign).unsqueeze(-1)
    return rows.to(torch.bfloat16)


def _skewed_queries(num_tokens: int, num_heads: int, d_qk: int, sm_scale: float) -> torch.Tensor:
    """BF16 ``[T, H, d_qk]``: head ``h``'s query is ``a = (-1)**h * SKEW_LOGIT / (sm_scale * SKEW_KEY)``
    in dim ``SKEW_DIM + h`` and ``a * 2**SKEW_LOG2`` in dim ``h`` (where every key is 0), 0 elsewhere:
    odd heads' groups are negative, so a kernel that takes a signed max for an absolute one meets
    them."""
    q = torch.zeros((num_tokens, num_heads, d_qk))
    heads = torch.arange(num_heads)
    a = SKEW_LOGIT / (sm_scale * SKEW_KEY) * _head_signs(num_heads)
    q[:, heads, SKEW_DIM + heads] = a
    q[:, heads, heads] = a * 2.0**SKEW_LOG2
    return q.to(torch.bfloat16)


#: The hand-built query kinds: ``kind -> (rows(num_pages, page_block_size, num_heads, f),
#: queries(num_tokens, num_heads, d_qk, sm_scale))``.
_HAND_BUILT: dict[str, tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]] = {
    "long-tail": (_long_tail_rows, _long_tail_queries),
    "skewed-query": (_skewed_rows, _skewed_queries),
}


def _large_sink(inputs: AttentionInputs, generator: torch.Generator, kind: str) -> torch.Tensor:
    """Per-head sinks comparable to the candidates' mass: median over tokens of the natural-log LSE
    (from the float64 oracle, without a sink) plus ``U(-1, 1)``; ``-inf`` on even heads for
    ``"mixed-inf"``. Heads whose every row is empty get 0."""
    from pytest_sparse_mla.attention.oracle import oracle_forward

    res = inputs.run(oracle_forward, attn_sink=None, lse_convention="flashmla")
    lse = res.lse.cpu()
    lse = torch.where(torch.isinf(lse), torch.nan, lse)
    median = lse.nanmedian(dim=0).values.nan_to_num(nan=0.0)
    sink = (median + torch.rand(median.shape, generator=generator, dtype=torch.float64) * 2 - 1).to(torch.float32)
    if kind == "mixed-inf":
        sink[0::2] = -math.inf
    return sink


def make_inputs(
    case: AttentionCase, generator: torch.Generator, *, device: torch.device | str = "cpu"
) -> AttentionInputs:
    """Draw the tensors of ``case`` from ``generator`` (CPU) and move them to ``device``.

    Raises:
        ValueError, TypeError: as ``data.make_packed_cache`` / ``data.sparse_indices``; an unknown
            ``query`` or ``sink_kind``.
    """
    main, values, conventions = case.main, case.values, case.conventions
    if values.query not in QUERIES:
        raise ValueError(f"query={values.query!r}: expected one of {QUERIES}")
    if values.sink_kind not in SINK_KINDS:
        raise ValueError(f"sink_kind={values.sink_kind!r}: expected one of {SINK_KINDS}")
    hand_built = _HAND_BUILT.get(values.query)
    if hand_built is not None and (case.extra is not None or conventions.with_sink or main.topk_length is not None):
        raise ValueError(
            f"{case.name}: query={values.query!r} takes a main cache only, no sink and no topk_length "
            f"(extra={case.extra}, with_sink={conventions.with_sink}, topk_length={main.topk_length})"
        )
    f, ef = formats.cache_formats(conventions.fmt)
    main_stride = main.page_stride if main.page_stride is not None else "padded"
    cache = _cache(
        generator, f, num_pages=main.num_pages, page_block_size=main.page_block_size,
        page_stride=main_stride, form=conventions.form, distribution=values.distribution,
        value_scale=main.value_scale, layer=main.layer, num_layers=main.num_layers, device=device,
        rows=None if hand_built is None else (lambda p, ps, fmt_: hand_built[0](p, ps, case.num_heads, fmt_)),
    )  # fmt: skip
    q = data.latent((case.num_tokens, case.num_heads, f.d_qk), generator, distribution=values.distribution)
    if values.query == "long-tail":
        indices = _long_tail_indices(case.num_tokens, main.topk, cache, generator)
    else:
        indices = data.sparse_indices(
            case.num_tokens, main.topk, cache.num_tokens, generator, masked_fraction=main.masked_fraction
        )
    indices, lengths = _lengths_and_stale(indices, main.topk_length)
    indices = _pad_row(indices, main.index_width)
    sink = data.attn_sink(case.num_heads, generator) if conventions.with_sink else None
    extra = extra_indices = extra_lengths = None
    if case.extra is not None:
        ec = case.extra
        extra = _cache(
            generator, ef, num_pages=ec.num_pages, page_block_size=ec.page_block_size,
            page_stride=ec.page_stride if ec.page_stride is not None else main_stride,
            form=conventions.form, distribution=values.distribution, value_scale=ec.value_scale,
            layer=ec.layer, num_layers=ec.num_layers, device=device,
        )  # fmt: skip
        extra_indices = data.sparse_indices(
            case.num_tokens, ec.topk, extra.num_tokens, generator, masked_fraction=ec.masked_fraction,
        )  # fmt: skip
        extra_indices, extra_lengths = _lengths_and_stale(extra_indices, ec.topk_length)
        extra_indices = _pad_row(extra_indices, ec.index_width)

    def dev(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    sm_scale = f.d_qk**-0.5
    if values.query == "peaked":
        sources = [(cache, indices, lengths)]
        if extra is not None and extra_indices is not None:
            sources.append((extra, extra_indices, extra_lengths))
        q = _peaked_queries(q, sources, sm_scale, values.peak)
    elif values.query == "flat":
        q = (q.float() * 2.0**-10).to(torch.bfloat16)
    elif hand_built is not None:
        q = hand_built[1](case.num_tokens, case.num_heads, f.d_qk, sm_scale)
    inputs = AttentionInputs(
        case=case,
        q=q.to(device),
        cache=cache,
        indices=indices.to(device),
        sm_scale=sm_scale,
        topk_length=dev(lengths),
        attn_sink=dev(sink),
        extra=extra,
        extra_indices=dev(extra_indices),
        extra_topk_length=dev(extra_lengths),
    )
    if conventions.with_sink and values.sink_kind != "randn":
        inputs = replace(inputs, attn_sink=_large_sink(inputs, generator, values.sink_kind).to(device))
    return inputs


def _named_format(kw: dict[str, Any]) -> dict[str, Any]:
    """A case written for a format other than the default DSV4 (DSV3.2, DeepSeek-V4.1) exists for that
    format: it requires it (``fit_case`` never moves it)."""
    if kw.get("conventions", Conventions()).fmt != Conventions().fmt:
        kw["requires"] = (*kw.get("requires", ()), "format")
    return kw


def _fi(name: str, num_tokens: int, num_heads: int, main: CacheCase, **kw: Any) -> AttentionCase:
    return AttentionCase(f"fi-{name}", num_tokens, num_heads, main, **_named_format(kw))


_NO_SINK = Conventions(with_sink=False)
_DSV32 = Conventions("dsv3_2")
_V41 = Conventions("dsv4_1")
_PEAKED = Values("peaked")
_LARGE_SINK = Values("peaked", sink_kind="large")

#: FlashInfer SM120 test configurations (small token counts on CPU; ``large`` ones need CUDA).
FLASHINFER_CASES: tuple[AttentionCase, ...] = (
    # decode, dedicated heads (T <= 64)
    _fi("decode-h8-k128", 16, 8, CacheCase(128)),
    _fi("decode-h8-k1024", 1, 8, CacheCase(1024), conventions=_NO_SINK),
    _fi("decode-h16-k192", 16, 16, CacheCase(192)),
    _fi("decode-h32-k512", 16, 32, CacheCase(512), conventions=_NO_SINK),
    _fi("decode-h64-k256", 16, 64, CacheCase(256)),
    _fi("decode-h128-k1024", 1, 128, CacheCase(1024)),
    _fi("decode-h64-k1024", 64, 64, CacheCase(1024), large=True),
    # decode, runtime heads / runtime topk (500 = partial final tile)
    _fi("decode-h12-k512", 16, 12, CacheCase(512)),
    _fi("decode-h24-k256", 16, 24, CacheCase(256), conventions=_NO_SINK),
    _fi("decode-h80-k128", 16, 80, CacheCase(128)),
    _fi("decode-h64-k384", 16, 64, CacheCase(384)),
    _fi("decode-h64-k500", 16, 64, CacheCase(500), requires=('width',)),
    # topk_length truncation, stale padding past the length
    _fi("trunc-h8-k192-len133", 16, 8, CacheCase(192, topk_length=133), requires=('topk_length',)),
    _fi("trunc-h32-k256-len133", 16, 32, CacheCase(256, topk_length=133), requires=('topk_length',)),
    _fi("trunc-h8-k512-len128", 16, 8, CacheCase(512, topk_length=128), conventions=_NO_SINK,
        requires=('topk_length',)),
    _fi("trunc-h64-k1024-len992", 128, 64, CacheCase(1024, topk_length=992, masked_fraction=0.0), large=True,
        requires=('topk_length',)),
    # prefill (T > 64)
    _fi("prefill-h8-k128", 65, 8, CacheCase(128), requires=('tokens',)),
    _fi("prefill-h16-k256", 128, 16, CacheCase(256), conventions=_NO_SINK, requires=('tokens',)),
    _fi("prefill-h64-k1024", 128, 64, CacheCase(1024), large=True, requires=('tokens',)),
    _fi("prefill-h128-k2048", 256, 128, CacheCase(2048, num_pages=64), large=True, requires=('tokens',)),
    # dual cache (main topk 128 at page 64 + extra), one softmax over both
    _fi("dual-h8-e128p64", 16, 8, CacheCase(128), extra=CacheCase(128, page_block_size=64, num_pages=16),
        requires=('extra', 'extra_page')),
    _fi("dual-h16-e512p64", 16, 16, CacheCase(128), extra=CacheCase(512, page_block_size=64, num_pages=16),
        requires=('extra', 'extra_page')),
    _fi("dual-h32-e512p2", 16, 32, CacheCase(128), extra=CacheCase(512, page_block_size=2, num_pages=512),
        requires=('extra', 'extra_page')),
    _fi("dual-h16-e2176p2", 1, 16, CacheCase(128), extra=CacheCase(2176, page_block_size=2, num_pages=1024),
        requires=('extra', 'extra_page')),
    _fi("dual-h8-elen0", 16, 8, CacheCase(128),
        extra=CacheCase(512, page_block_size=64, num_pages=16, topk_length=0), requires=('extra', 'topk_length')),
    _fi("dual-h8-elen768", 16, 8, CacheCase(128),
        extra=CacheCase(512, page_block_size=64, num_pages=16, topk_length=768), requires=('extra', 'topk_length')),
    _fi("dual-h8-main-len0", 16, 8, CacheCase(128, topk_length=0, masked_fraction=0.0),
        extra=CacheCase(128, page_block_size=2, num_pages=128), requires=('extra', 'topk_length')),
    _fi("dual-prefill-h64-e512p64", 128, 64, CacheCase(128), extra=CacheCase(512, page_block_size=64, num_pages=16),
        large=True, requires=('extra', 'extra_page')),
    _fi("dual-prefill-h128-e512p2", 128, 128, CacheCase(128), extra=CacheCase(512, page_block_size=2, num_pages=512),
        large=True, requires=('extra', 'extra_page')),
    # cache forms and page strides (FlashInfer accepts all of them)
    _fi("form-hnd-tight", 8, 8, CacheCase(128, page_stride="tight"), conventions=Conventions(form="hnd")),
    _fi("form-3d-padded", 8, 8, CacheCase(128), conventions=Conventions(form="3d")),
    _fi("form-2d-tight", 8, 8, CacheCase(128, page_stride="tight"), conventions=Conventions(form="2d")),
    _fi("wide-scales", 8, 16, CacheCase(256), values=Values(distribution="wide")),
    # DSV3.2 (d_qk 576, inline scales, V = first 512 dims)
    _fi("dsv32-h16-k128", 4, 16, CacheCase(128), conventions=_DSV32),
    _fi("dsv32-h64-k2048", 64, 64, CacheCase(2048, num_pages=64), conventions=_DSV32, large=True),
)  # fmt: skip


def _cf(name: str, num_tokens: int, num_heads: int, main: CacheCase, **kw: Any) -> AttentionCase:
    return AttentionCase(f"cf-{name}", num_tokens, num_heads, main, **_named_format(kw))


_C4 = CacheCase(128, page_block_size=64, num_pages=4)
_C128 = CacheCase(128, page_block_size=2, num_pages=128)
_TAIL = CacheCase(64, num_pages=4, masked_fraction=0.0)

#: Data that makes each error class visible (the FlashInfer distribution's logits are about 0.01,
#: a nearly uniform softmax under which a wrong score scale, a dropped sink or a wrong row hides).
CONFORMANCE_CASES: tuple[AttentionCase, ...] = (
    # queries aligned with chosen candidates in each cache: wrong scale / wrong row moves the softmax
    _cf("peaked-dual-c4", 8, 16, CacheCase(128), extra=_C4, values=_PEAKED),
    # DeepSeek-V4.1: SWA records (E4M3, UE8M0 per 32) in the main cache, indexed FP4 records (E2M1,
    # E4M3 per 16) in the extra cache, as flashinfer-python 0.7.2.post1's reference pairs them
    # (early in the list: the wrong-kernel gate runs cases round-robin and stops at the first failure)
    _cf("v41-peaked-dual-c4", 8, 16, CacheCase(128), extra=_C4, values=_PEAKED, conventions=_V41),
    _cf("peaked-dual-c128-large-sink", 8, 16, CacheCase(128), extra=_C128, values=_LARGE_SINK, requires=('sink',)),
    _cf("peaked-dsv32", 8, 16, CacheCase(128), values=_LARGE_SINK, conventions=_DSV32, requires=('sink',)),
    _cf("dominant-key", 8, 16, CacheCase(128), extra=_C4, values=Values("peaked", peak=30.0)),
    _cf("dominant-key-dsv32", 8, 16, CacheCase(128), values=Values("peaked", peak=30.0), conventions=_DSV32),
    _cf("near-uniform", 8, 16, CacheCase(128), extra=_C4, values=Values("flat", sink_kind="large")),
    # sinks
    _cf("mixed-inf-sink", 8, 16, CacheCase(128), extra=_C4, values=Values("peaked", sink_kind="mixed-inf"),
        requires=('sink',)),
    _cf("mixed-inf-sink-dsv32", 8, 16, CacheCase(128), values=Values("peaked", sink_kind="mixed-inf"),
        conventions=_DSV32, requires=('sink',)),
    # mixed magnitudes across the caches (powers of two: exact in BF16)
    _cf("extra-x64", 8, 16, CacheCase(128), extra=replace(_C4, value_scale=64.0), values=_LARGE_SINK,
        requires=('extra',)),
    _cf("extra-x1/64", 8, 16, CacheCase(128), extra=replace(_C128, value_scale=2.0**-6), values=_PEAKED,
        requires=('extra',)),
    # head counts: 1 and non-multiples of 16
    _cf("heads-1", 8, 1, CacheCase(128), extra=_C4, values=_PEAKED, requires=('heads',)),
    _cf("heads-5", 8, 5, CacheCase(128), extra=_C128, values=_PEAKED, requires=('heads',)),
    _cf("heads-17", 4, 17, CacheCase(128), values=_PEAKED, conventions=_DSV32, requires=('heads',)),
    _cf("heads-33", 4, 33, CacheCase(128), extra=_C4, values=_PEAKED, requires=('heads',)),
    # per-layer views (non-zero storage offsets) and page strides, chosen per cache
    _cf("main-layer1of2-padded-extra-layer2of3-tight", 8, 16, CacheCase(128, layer=1, num_layers=2),
        extra=replace(_C4, layer=2, num_layers=3, page_stride="tight"), values=_PEAKED),
    _cf("main-tight-extra-layer1of2-padded", 8, 16, CacheCase(128, page_stride="tight"),
        extra=replace(_C128, layer=1, num_layers=2, page_stride="padded"), values=_PEAKED),
    _cf("dsv32-layer1of3", 8, 16, CacheCase(128, layer=1, num_layers=3), values=_PEAKED, conventions=_DSV32),
    # topk_length truncation with stale padding, on peaked data
    _cf("peaked-trunc-len100", 8, 16, CacheCase(192, topk_length=100, masked_fraction=0.0),
        extra=replace(_C4, topk_length=50), values=_PEAKED, requires=('topk_length',)),
    # both sides of the decode/prefill boundary
    _cf("peaked-T64", 64, 8, CacheCase(128), extra=_C128, values=_LARGE_SINK, requires=('tokens',)),
    _cf("peaked-T65", 65, 8, CacheCase(128), extra=_C128, values=_LARGE_SINK, requires=('tokens',)),
    _cf("peaked-T65-dsv32", 65, 8, CacheCase(128), values=_PEAKED, conventions=_DSV32, requires=('tokens',)),
    # 64 heads (what head-specialised kernels such as FlashMLA's SM90 sparse decode take)
    _cf("h64-peaked-dual-c4-large-sink", 4, 64, CacheCase(128, masked_fraction=0.25), extra=_C4, values=_LARGE_SINK,
        requires=('sink',)),
    _cf("h64-mixed-inf-sink-c128", 4, 64, CacheCase(128), extra=_C128, values=Values("peaked", sink_kind="mixed-inf"),
        requires=('sink',)),
    _cf("h64-dominant-key-dsv32", 4, 64, CacheCase(128), values=Values("peaked", peak=30.0), conventions=_DSV32),
    _cf("h64-peaked-dsv32-large-sink", 4, 64, CacheCase(192), values=_LARGE_SINK, conventions=_DSV32),
    _cf("h64-near-uniform", 4, 64, CacheCase(128), extra=_C4, values=Values("flat", sink_kind="large")),
    _cf("h64-extra-x64-layers", 4, 64, CacheCase(128, layer=1, num_layers=2),
        extra=replace(_C4, value_scale=64.0, layer=2, num_layers=3, page_stride="tight"), values=_PEAKED,
        requires=('extra',)),
    _cf("h64-trunc", 4, 64, CacheCase(192, topk_length=100, masked_fraction=0.0), extra=replace(_C4, topk_length=50),
        values=_PEAKED, requires=('topk_length',)),
    _cf("h64-peaked-T65", 65, 64, CacheCase(128), extra=_C4, values=_LARGE_SINK, requires=('tokens',)),
    # 128 heads on both routes and both formats (FlashMLA's other head count)
    _cf("h128-peaked-T65-c4", 65, 128, CacheCase(128), extra=_C4, values=_LARGE_SINK),
    _cf("h128-peaked-dsv32", 4, 128, CacheCase(128, masked_fraction=0.25), values=_LARGE_SINK,
        conventions=_DSV32),  # 96 valid lanes: heads h and h + 64 peak on different candidates
    # DSV3.2 with an extra cache (FlashInfer 0.6.14-0.6.18 silently dropped it)
    _cf("peaked-dsv32-dual-c4", 8, 16, CacheCase(128), extra=_C4, values=_PEAKED, conventions=_DSV32,
        requires=("extra",)),
    # valid lanes past 512 in one row (DSV3.2 serves topk 2048; DSpark rows are 192 wide)
    _cf("wide-row-k1024", 2, 16, CacheCase(1024, num_pages=32, masked_fraction=0.25), values=_PEAKED),
    # every lane valid up to DSV3.2's production width (a kernel whose lane buffer holds DSV4's 1024 drops the rest)
    _cf("dsv32-k2048-all-valid", 2, 16, CacheCase(2048, num_pages=64, masked_fraction=0.0), conventions=_DSV32,
        requires=("width",)),
    # rows whose last tile is partial and valid (a tile count of topk // 64 never reads lanes 192..199, 64..99)
    _cf("tail-lanes-k200-e100", 4, 16, CacheCase(200, masked_fraction=0.0),
        extra=CacheCase(100, page_block_size=64, num_pages=4, masked_fraction=0.0), requires=("width",)),
    # main caches of 256- and 128-token pages (DeepSeek-V4 serves 256; a kernel addressing idx >> 6 reads
    # another token)
    _cf("main-page256-dual-c4", 8, 16, CacheCase(128, page_block_size=256, num_pages=4), extra=_C4, values=_PEAKED,
        requires=("page",)),
    _cf("dsv32-main-page128", 8, 16, CacheCase(128, page_block_size=128, num_pages=8), values=_PEAKED,
        conventions=_DSV32, requires=("page",)),
    # a main topk_length beyond its row (clamped to the row: lanes past it are the next token's row in memory)
    _cf("peaked-main-len-beyond-row", 8, 16, CacheCase(128, topk_length=200, masked_fraction=0.0), extra=_C4,
        values=_PEAKED, requires=("topk_length",)),
    # more DeepSeek-V4.1 calls (records, sink, lengths, prefill)
    _cf("v41-peaked-dual-c128-large-sink", 8, 16, CacheCase(128), extra=_C128, values=_LARGE_SINK, conventions=_V41,
        requires=("sink",)),
    _cf("v41-swa-only", 8, 16, CacheCase(128), values=_PEAKED, conventions=_V41),
    _cf("v41-extra-x64", 8, 16, CacheCase(128), extra=replace(_C4, value_scale=64.0), values=_PEAKED, conventions=_V41,
        requires=("extra",)),
    _cf("v41-trunc-len100", 8, 16, CacheCase(192, topk_length=100, masked_fraction=0.0),
        extra=replace(_C4, topk_length=50), values=_PEAKED, conventions=_V41, requires=("topk_length",)),
    _cf("v41-h64-peaked-T65", 65, 64, CacheCase(128), extra=_C4, values=_LARGE_SINK, conventions=_V41,
        requires=("tokens",)),
    # one top key and 63 keys each below 2**-10 of its weight whose values fill NoPE dims the top key
    # leaves at 0: a kernel that casts P to E4M3 without a scale drops the tail's weight from the output
    _cf("long-tail", 4, 16, _TAIL, values=Values("long-tail"), conventions=Conventions(with_sink=False)),
    _cf("long-tail-dsv32", 4, 16, _TAIL, values=Values("long-tail"),
        conventions=Conventions("dsv3_2", with_sink=False)),
    # each query's logit signal 2**20 times smaller than an element where every key is 0: one E4M3 scale
    # per (token, head) flushes the signal (a scale per 64 dims keeps it)
    _cf("skewed-query", 4, 16, _TAIL, values=Values("skewed-query"), conventions=Conventions(with_sink=False)),
    _cf("skewed-query-dsv32", 4, 16, _TAIL, values=Values("skewed-query"),
        conventions=Conventions("dsv3_2", with_sink=False)),
)  # fmt: skip


def deployment_cases() -> tuple[AttentionCase, ...]:
    """One decode-sized case per DeepSeek-V4 deployment, then prefill-sized (CUDA-only) ones.

    Geometry from :data:`pytest_sparse_mla.deployments.DEPLOYMENTS` (main cache after the 256 -> 64
    split; extra C4 at page 64, C128 at page 2). The SWA window is full (no ``-1``), a quarter of
    each extra row is ``-1``; DSpark drafts have 133 active entries in their 192-wide rows
    (window 128 + 5-token block; flashinfer-ai/flashinfer PR #4380).
    """
    out: list[AttentionCase] = []
    for dep in deployments.DEPLOYMENTS:
        key = dep.key.replace("DeepSeek-V4-", "").replace(" ", "-").replace("/", "-")
        key = key.replace("(", "").replace(")", "").replace("-draft", "")
        length = 133 if dep.topk == deployments.DSPARK_TOPK else None
        main = CacheCase(dep.topk, page_block_size=dep.page_block_size, masked_fraction=0.0, topk_length=length)
        extra = None
        if dep.extra_topk:
            extra_tokens = max(1024, dep.extra_topk * 2)
            extra = CacheCase(
                dep.extra_topk, page_block_size=dep.extra_page_block_size,
                num_pages=extra_tokens // dep.extra_page_block_size, masked_fraction=0.25,
            )  # fmt: skip
        out.append(AttentionCase(f"{key}-decode", dep.decode_num_tokens, dep.num_heads, main, extra=extra))
        out.append(AttentionCase(f"{key}-prefill", 512, dep.num_heads, main, extra=extra, large=True))
    out.append(
        AttentionCase(
            "Flash-C4-TP1-prefill-4096", 4096, 64,
            CacheCase(deployments.SWA_TOPK, num_pages=64, masked_fraction=0.0),
            extra=CacheCase(deployments.C4_TOPK, page_block_size=64, num_pages=64, masked_fraction=0.25), large=True,
        )
    )  # fmt: skip
    return tuple(out)


# --- envelopes ------------------------------------------------------------------------------------

#: What a case may require (``AttentionCase.requires``); :func:`fit_case` never changes these, it
#: declares the case not applicable instead: ``"format"`` (its cache format), ``"heads"`` (its head
#: count), ``"tokens"`` (its ``num_tokens``), ``"width"`` (its index-row widths), ``"extra"`` (an
#: extra cache), ``"sink"``, ``"topk_length"`` (its lengths, values included), ``"page"`` /
#: ``"extra_page"`` (page sizes).
REQUIREMENTS: tuple[str, ...] = (
    "format", "heads", "tokens", "width", "extra", "sink", "topk_length", "page", "extra_page",
)  # fmt: skip


def fit_case(case: AttentionCase, envelope: Envelope) -> AttentionCase:
    """``case`` brought inside ``envelope``: the same construction at shapes the kernel takes.

    A format the envelope does not take moves to the first one it takes (unless the case requires
    its format: every case written for DSV3.2 does). Head counts move to the nearest head count
    taken (the smallest above, else the largest); ``num_tokens`` into ``[min_tokens,
    max_tokens]``; index rows are drawn at ``topk`` (capped at the largest width) and padded with
    ``-1`` lanes up to the width multiple; page sizes move to the nearest taken (same number of
    cache tokens; a tight page stride becomes padded where ``ps * bytes_per_token`` is not a
    multiple of 16); an extra cache, lengths or a sink the envelope does not take are dropped, and
    lengths outside ``[0, width]`` clamped for a ``topk_length_range="row"`` kernel. What changed
    is listed in ``fitted``; the name (the test id) stays.

    Raises:
        NotApplicable: a change would touch what the case ``requires`` (the message names the
            envelope field and the value).
        ValueError: ``requires`` names something not in :data:`REQUIREMENTS`.
    """
    notes: list[str] = []
    change: dict[str, Any] = {}
    req = set(case.requires)
    if not req <= set(REQUIREMENTS):
        raise ValueError(f"{case.name}: requires={case.requires!r}: expected names from {REQUIREMENTS}")

    def adjust(requirement: str, why: str | None, note: str, **changes: Any) -> None:
        """Record ``changes`` (``note`` in ``fitted``), or refuse when the case requires ``requirement``."""
        if requirement in req:
            raise NotApplicable(f"not applicable to this envelope: {why}")
        change.update(changes)
        notes.append(note)

    why = envelope.format_reason(case.conventions.fmt)
    if why is not None:
        first = envelope.formats[0]
        adjust("format", why, f"fmt {case.conventions.fmt}->{first}", fmt=first)
        case = _changed(case, {"fmt": first})
    tokens = envelope.tokens_for(case.num_tokens)
    if tokens != case.num_tokens:
        adjust("tokens", envelope.tokens_reason(case.num_tokens), f"num_tokens {case.num_tokens}->{tokens}",
               num_tokens=tokens)  # fmt: skip
    heads = envelope.heads_for(case.num_heads)
    if heads != case.num_heads:
        adjust("heads", envelope.heads_reason(case.num_heads), f"num_heads {case.num_heads}->{heads}",
               num_heads=heads)  # fmt: skip
    if case.conventions.with_sink and not envelope.takes_sink(case.conventions.fmt):
        adjust("sink", envelope.sink_reason(case.conventions.fmt), "attn_sink dropped", with_sink=False)
    dual = case.extra is not None
    if dual and not envelope.takes_extra(case.conventions.fmt):
        adjust("extra", envelope.extra_reason(case.conventions.fmt), "extra cache dropped", extra=None)
        dual = False
    lengths = [("topk_length", case.main.topk_length, case.main.topk)]
    if dual and case.extra is not None:
        lengths.append(("extra_topk_length", case.extra.topk_length, case.extra.topk))
    if any(value is not None for _, value, _ in lengths) and not envelope.takes_lengths(case.conventions.fmt):
        adjust("topk_length", envelope.lengths_reason(case.conventions.fmt),
               "topk_length dropped", topk_length=None, extra_topk_length=None)  # fmt: skip
        lengths = []
    for key, width_key, widths in (("topk", "index_width", envelope.topk),
                                   ("extra_topk", "extra_index_width", envelope.extra_topk)):  # fmt: skip
        if key == "extra_topk" and not dual:
            continue
        width = _field(case, key)
        drawn, row = widths.fit(width)
        if (drawn, row) != (width, width):
            adjust("width", widths.reason(key, width) or f"{key}={width}",
                   f"{key} {width}->{drawn} drawn in rows of {row}", **{key: drawn, width_key: row})  # fmt: skip
    for name, value, width in lengths:
        drawn = change.get("topk" if name == "topk_length" else "extra_topk", width)
        why = None if value is None else envelope.length_value_reason(name, value, drawn)
        if value is not None and why is not None:
            clamped = min(max(value, 0), drawn)
            adjust("topk_length", why, f"{name} {value}->{clamped}", **{name: clamped})
    for ps_key, pages_key, taken, need in (
        ("page_block_size", "num_pages", envelope.page_block_sizes, "page"),
        ("extra_page_block_size", "extra_num_pages", envelope.extra_page_block_sizes, "extra_page"),
    ):
        if ps_key.startswith("extra") and not dual:
            continue
        ps = _field(case, ps_key)
        fitted = Envelope.page_for(ps, taken)
        if fitted != ps:
            adjust(need, envelope.page_reason(ps_key, ps), f"{ps_key} {ps}->{fitted}",
                   **{ps_key: fitted, pages_key: -(-_field(case, pages_key) * ps // fitted)})  # fmt: skip
    bpt = formats.get_format(case.conventions.fmt).bytes_per_token
    for stride_key, ps_key in (("page_stride", "page_block_size"), ("extra_page_stride", "extra_page_block_size")):
        if stride_key.startswith("extra") and not dual:
            continue
        ps = change.get(ps_key, _field(case, ps_key))
        if _field(case, stride_key) == "tight" and ps and (ps * bpt) % 16:
            change[stride_key] = "padded"  # a tight page of ps * bpt bytes must be a multiple of 16
            notes.append(f"{stride_key} tight->padded")
    if not change:
        return case
    return _changed(replace(case, fitted=case.fitted + tuple(notes)), change)


def _field(case: AttentionCase, key: str) -> Any:
    """A cache field of ``case`` by its field term: ``topk``, ``page_block_size``, ... (the main
    cache) or ``extra_topk``, ``extra_page_block_size``, ... (the extra cache, which must exist)."""
    if key.startswith("extra_"):
        if case.extra is None:
            raise ValueError(f"{case.name}: {key}: the case has no extra cache")
        return getattr(case.extra, key.removeprefix("extra_"))
    return getattr(case.main, key)


def _changed(case: AttentionCase, change: dict[str, Any]) -> AttentionCase:
    """``case`` with ``change`` applied; its keys are field terms: ``num_tokens``, ``num_heads``,
    ``extra`` (``None``: drop the extra cache), the :class:`Conventions` fields, the main cache's
    :class:`CacheCase` fields (``topk``, ``page_block_size``, ...) and the extra cache's prefixed
    ``extra_`` (``extra_topk``, ``extra_page_block_size``, ...; dropped with the extra cache)."""
    groups: dict[str, dict[str, Any]] = {"case": {}, "main": {}, "extra": {}, "conventions": {}}
    cache_fields = {f.name for f in fields(CacheCase)}
    for key, value in change.items():
        if key in ("num_tokens", "num_heads", "extra"):
            groups["case"][key] = value
        elif key in {f.name for f in fields(Conventions)}:
            groups["conventions"][key] = value
        elif key in cache_fields:
            groups["main"][key] = value
        elif key.startswith("extra_") and key.removeprefix("extra_") in cache_fields:
            groups["extra"][key.removeprefix("extra_")] = value
        else:
            raise ValueError(f"{case.name}: cannot change {key}={value!r}: not a case field")
    case = replace(case, **groups["case"])
    extra = case.extra if case.extra is None else replace(case.extra, **groups["extra"])
    return replace(case, main=replace(case.main, **groups["main"]), extra=extra,
                   conventions=replace(case.conventions, **groups["conventions"]))  # fmt: skip


def _length_classes(value: int | None, width: int, prefix: str) -> list[str]:
    if value is None:
        return []
    if value <= 0:
        return [f"{prefix}length-0"]
    kind = "partial" if value < width else "beyond-row" if value > width else "full"
    return [f"{prefix}length-{kind}"]


def case_classes(case: AttentionCase) -> tuple[str, ...]:
    """The error classes a (fitted) case exercises, from its construction: ``peaked-main`` /
    ``peaked-extra`` (queries aligned with candidates of that cache), ``dominant-key``,
    ``near-uniform``, ``long-tail``, ``skewed-query`` (the hand-built FP8 cases), ``sink`` /
    ``large-sink`` / ``minus-inf-sink``, ``dsv3_2``, ``extra-page-64`` / ``extra-page-2`` (other
    sizes: ``extra-page-N``), ``length-0`` / ``length-partial`` / ``length-beyond-row`` (``extra-``
    prefixed for the extra cache), ``T-64-65`` (either side of the decode/prefill cutoff), ``decode``
    / ``prefill``, ``per-layer-views``, ``mixed-magnitudes``, ``padded-width``."""
    out: list[str] = [route_of(case.num_tokens)]
    main, extra, values, fmt = case.main, case.extra, case.values, case.conventions.fmt
    if case.num_tokens in (64, 65):
        out.append("T-64-65")
    if values.query == "peaked":
        out.append("peaked-main")
        if extra is not None:
            out.append("peaked-extra")
        if values.peak >= 30:
            out.append("dominant-key")
    elif values.query == "flat":
        out.append("near-uniform")
    elif values.query in _HAND_BUILT:
        out.append(values.query)
    if case.conventions.with_sink:
        out.append({"randn": "sink", "large": "large-sink", "mixed-inf": "minus-inf-sink"}[values.sink_kind])
    if fmt == "dsv3_2":
        out.append("dsv3_2")
    if extra is not None:
        out.append(f"extra-page-{extra.page_block_size}")
        out += _length_classes(extra.topk_length, extra.topk, "extra-")
    out += _length_classes(main.topk_length, main.topk, "")
    if main.layer or (extra is not None and extra.layer):
        out.append("per-layer-views")
    if extra is not None and extra.value_scale != main.value_scale:
        out.append("mixed-magnitudes")
    if (main.index_width or 0) > main.topk or (extra is not None and (extra.index_width or 0) > extra.topk):
        out.append("padded-width")
    return tuple(out)
