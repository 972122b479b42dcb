"""Adversary kernels: plausible wrong ``sparse_mla_forward`` kernels of classes the catalogue lacks.

Written by an adversary that read only the README, the protocol table, the envelope and call
docstrings and the public bundled API (``attention.sparse_mla_forward``, ``attention.oracle_forward``,
``formats``, ``data``); never the suites, ``tests/kernel_catalogue.py`` or the self-tests.

Each kernel is a module-level object (``--sparse-mla-impl adversary_kernels:<name>`` with ``tests/``
on ``PYTHONPATH``) that declares ``compute_mode = "bf16"`` and a ``name``. Each is wrong only on
some admitted inputs and correct (to fp32 accuracy) on typical ones. :data:`ADVERSARY` maps each
name to an :class:`Adversary` entry: the bug in one sentence, its plausible real-world origin and
``demonstrate()``, which builds one input of its own and returns ``(kernel_result,
oracle_result)`` showing the discrepancy (``tests/test_adversary_demonstrations.py`` asserts it).

Most kernels wrap the bundled reference and corrupt one argument, one byte class or one result the
way the bug would; the arithmetic ones run :func:`_own_forward`, a small fp32 torch kernel
(dequantize with ``formats.unpack_dequantize``, gather, softmax) whose combine step carries the
bug. Every kernel first calls the reference on the unmodified call, so argument validation and
the errors for bad inputs are the reference's (the bugs are in the arithmetic, not the checks).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from pytest_sparse_mla import data, formats
from pytest_sparse_mla.attention import oracle_forward, sparse_mla_forward
from pytest_sparse_mla.attention.call import CALL_ARGUMENTS, SparseMlaCall

LOG2E = 1.0 / math.log(2.0)
NEG_INF = float("-inf")


# --------------------------------------------------------------------------------------------
# plumbing


class KernelResult(NamedTuple):
    output: torch.Tensor
    lse: torch.Tensor


class _AdversaryKernel:
    """One wrong kernel: ``sparse_mla_forward`` delegates to ``forward``."""

    compute_mode = "bf16"

    def __init__(self, name: str, forward: Callable[..., Any]) -> None:
        self.name = name
        self._forward = forward

    def sparse_mla_forward(self, q, kv_cache, indices, **kwargs):
        return self._forward(q, kv_cache, indices, **kwargs)

    def __repr__(self) -> str:  # pragma: no cover - cosmetic
        return f"<adversary kernel {self.name}>"


@dataclass(frozen=True)
class Adversary:
    name: str
    bug: str
    origin: str
    kernel: _AdversaryKernel
    demonstrate: Callable[[], tuple[Any, Any]]
    demonstrated_on: str


def _call_kwargs(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if k in CALL_ARGUMENTS}


def _reference(q, kv_cache, indices, **kwargs):
    return sparse_mla_forward(q, kv_cache, indices, **kwargs)


def _clone_cache(cache: torch.Tensor) -> torch.Tensor:
    """A copy with the same shape and strides (so the same page stride and form)."""
    out = torch.empty_strided(cache.size(), cache.stride(), dtype=cache.dtype, device=cache.device)
    out.copy_(cache)
    return out


def _dsv4_fields(cache: torch.Tensor, page_block_size: int | None):
    """``(clone, codes [P, ps, 448], scales [P, ps, 7])`` views of a copied DSV4 cache."""
    clone = _clone_cache(cache)
    layout = formats.parse_cache(clone, formats.DSV4, page_block_size=page_block_size)
    pages = formats.page_bytes_view(clone, layout)
    ps = layout.page_block_size
    records = pages[:, : ps * 576].unflatten(1, (ps, 576))
    footer = pages[:, ps * 576 : ps * 584].unflatten(1, (ps, 8))
    return clone, records[:, :, :448], footer[:, :, :7]


def _is_dsv4(fmt) -> bool:
    main, extra = formats.cache_formats(fmt)
    return main.name == "dsv4"


# ----- own fp32 kernel with a pluggable combine step ---------------------------------------


@dataclass
class _Part:
    dots: torch.Tensor  # [t, H, K] raw q.k in fp32 (masked lanes arbitrary)
    scores: torch.Tensor  # [t, H, K] dots * sm_scale, masked lanes -inf
    values: torch.Tensor  # [t, K, d_v] fp32
    valid: torch.Tensor  # [t, K] bool


def _softmax_combine(parts, sink, *, score_fn=None, running_max_floor=None, sink_term_dtype=None,
                     lse_without_max=False, max_override=None, true_max=None):
    """Correct single-pass softmax over every part's lanes, with optional bug switches.

    Returns ``(out [t,H,dv] fp32, lse_all [t,H] natural incl. sink, lse_ns [t,H] natural excl. sink,
    empty [t,H] bool)``.
    """
    s = torch.cat([score_fn(p) if score_fn else p.scores for p in parts], dim=-1)
    v = torch.cat([p.values for p in parts], dim=1)
    valid = torch.cat([p.valid for p in parts], dim=1)  # [t, K]
    empty = ~valid.any(dim=1, keepdim=True).expand(s.shape[0], s.shape[1])
    m = s.amax(dim=-1) if max_override is None else max_override
    if running_max_floor is not None:
        m = torch.clamp(m, min=running_max_floor)
    m_all = m if (sink is None or sink_term_dtype is not None) else torch.maximum(m, sink[None, :])
    m_safe = torch.where(torch.isfinite(m_all), m_all, torch.zeros_like(m_all))
    p = torch.exp(s - m_safe[..., None])
    l_scores = p.sum(dim=-1)
    sink_term = torch.zeros_like(l_scores)
    if sink is not None:
        sink_term = torch.exp(sink[None, :] - m_safe)
        if sink_term_dtype is not None:
            sink_term = sink_term.to(sink_term_dtype).float()
    denom = l_scores + sink_term
    num = torch.einsum("thk,tkd->thd", p, v)
    safe_l = torch.where(denom == 0, torch.ones_like(denom), denom)  # the usual "empty row" guard
    out = num / safe_l[..., None]
    lse_all = m_safe + torch.log(denom)
    lse_ns = m_safe + torch.log(l_scores)
    if lse_without_max:
        lse_all = torch.log(torch.exp(s).sum(-1) + (torch.exp(sink)[None, :] if sink is not None else 0.0))
        lse_ns = torch.log(torch.exp(s).sum(-1))
    # rows without a candidate: output 0, LSE of the sink alone (a kernel early-exits for them)
    out = torch.where(empty[..., None], torch.zeros_like(out), out)
    sink_only = sink[None, :].expand_as(lse_all) if sink is not None else torch.full_like(lse_all, NEG_INF)
    lse_all = torch.where(empty, sink_only, lse_all)
    lse_ns = torch.where(empty, torch.full_like(lse_ns, NEG_INF), lse_ns)
    return out, lse_all, lse_ns, empty


def _own_forward(q, kv_cache, indices, *, combine=_softmax_combine, q_transform=None, **kwargs):
    """A plain fp32 sparse-MLA kernel; ``combine(parts, sink)`` turns lanes into output and LSEs."""
    ref = _reference(q, kv_cache, indices, **kwargs)  # validation and bad-input errors
    call = SparseMlaCall.read(q, kv_cache, indices, validate=True, **_call_kwargs(kwargs))
    T, H = call.num_tokens, call.num_heads
    if T == 0:
        return ref
    qf = q.float() if q_transform is None else q_transform(q)
    sources = []
    for src, rec in zip(call.sources, call.record_formats, strict=False):  # record_formats: (main, extra) always
        flat = formats.unpack_dequantize(src.cache, rec, page_block_size=src.layout.page_block_size)
        flat = flat.reshape(-1, rec.d_qk).to(q.device)
        idx = src.indices.long()
        valid = src.valid_lanes() & (idx < src.num_slots)
        sources.append((flat, idx, valid, rec.d_v))
    sink = None if call.attn_sink is None else call.attn_sink.float()
    total_lanes = sum(s[1].shape[1] for s in sources)
    chunk = max(1, 16384 // max(1, total_lanes))
    out = torch.empty(T, H, 512, dtype=torch.float32, device=q.device)
    lse_all = torch.empty(T, H, dtype=torch.float32, device=q.device)
    lse_ns = torch.empty_like(lse_all)
    empty = torch.empty(T, H, dtype=torch.bool, device=q.device)
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        parts = []
        for flat, idx, valid, dv in sources:
            vmask = valid[t0:t1]
            keys = flat[torch.where(vmask, idx[t0:t1], 0)]  # [t, K, d_qk]; lanes not read: slot 0
            keys = keys.masked_fill(~vmask[..., None], 0.0)  # a lane not read contributes nothing
            dots = torch.einsum("thd,tkd->thk", qf[t0:t1], keys)
            scores = (dots * call.sm_scale).masked_fill(~vmask[:, None, :], NEG_INF)
            parts.append(_Part(dots, scores, keys[..., :dv], vmask))
        o, la, ln, e = combine(parts, sink)
        out[t0:t1], lse_all[t0:t1], lse_ns[t0:t1], empty[t0:t1] = o, la, ln, e
    if call.lse_convention == "flashinfer":
        lse = lse_all * (LOG2E * call.lse_scale)
    else:
        lse = torch.where(empty, torch.full_like(lse_ns, float("inf")), lse_ns)
    return KernelResult(out.to(torch.bfloat16), lse.float())


# --------------------------------------------------------------------------------------------
# the wrong kernels


def _reference_on_misread_dsv4(q, kv_cache, indices, kw, misread):
    """The reference on copies of the DSV4 caches (main and extra) whose codes and scale bytes
    ``misread(codes, scales)`` changed in place: a kernel that decodes those bytes wrongly. The call
    is checked by the reference first; other formats are read right."""
    _reference(q, kv_cache, indices, **kw)
    if not _is_dsv4(kw.get("fmt", "dsv4")):
        return _reference(q, kv_cache, indices, **kw)

    def copy(cache, ps):
        clone, codes, scales = _dsv4_fields(cache, ps)
        misread(codes, scales)
        return clone

    kw = dict(kw)
    kv_cache = copy(kv_cache, kw.get("page_block_size"))
    if kw.get("extra_kv_cache") is not None:
        kw["extra_kv_cache"] = copy(kw["extra_kv_cache"], kw.get("extra_page_block_size"))
    return _reference(q, kv_cache, indices, **kw)


def _fwd_ue8m0_signed(q, kv_cache, indices, **kw):
    def misread(codes, scales):  # int8 read of the byte: e = (int8)b - 127 <= -255 flushes 2**e to zero
        scales.masked_fill_(scales >= 128, 0)

    return _reference_on_misread_dsv4(q, kv_cache, indices, kw, misread)


def _fwd_e4m3_subnormal_flush(q, kv_cache, indices, **kw):
    def misread(codes, scales):
        subnormal = ((codes & 0x78) == 0) & ((codes & 0x07) != 0)
        codes.copy_(torch.where(subnormal, codes & 0x80, codes))

    return _reference_on_misread_dsv4(q, kv_cache, indices, kw, misread)


def _fwd_running_max_zero_init(q, kv_cache, indices, **kw):
    def combine(parts, sink):
        # m starts at 0 instead of -inf, so exp(s - m) underflows when every score is below ~-88
        return _softmax_combine(parts, sink, running_max_floor=0.0)

    return _own_forward(q, kv_cache, indices, combine=combine, **kw)


def _fwd_qk_fp16_overflow(q, kv_cache, indices, **kw):
    sm_scale = float(kw["sm_scale"])

    def combine(parts, sink):
        def score(p):
            s = p.dots.to(torch.float16).float() * sm_scale  # q.k rounded to fp16, then scaled
            return s.masked_fill(~p.valid[:, None, :], NEG_INF)

        return _softmax_combine(parts, sink, score_fn=score)

    return _own_forward(q, kv_cache, indices, combine=combine, **kw)


def _fwd_score_clamp_80(q, kv_cache, indices, **kw):
    def combine(parts, sink):
        def score(p):
            return p.scores.clamp(min=-80.0, max=80.0).masked_fill(~p.valid[:, None, :], NEG_INF)

        return _softmax_combine(parts, sink, score_fn=score)

    return _own_forward(q, kv_cache, indices, combine=combine, **kw)


def _fwd_sink_fp16_overflow(q, kv_cache, indices, **kw):
    def combine(parts, sink):
        return _softmax_combine(parts, sink, sink_term_dtype=torch.float16)

    return _own_forward(q, kv_cache, indices, combine=combine, **kw)


def _fwd_lse_without_max(q, kv_cache, indices, **kw):
    def combine(parts, sink):
        return _softmax_combine(parts, sink, lse_without_max=True)

    return _own_forward(q, kv_cache, indices, combine=combine, **kw)


def _fwd_empty_partial_lse_zero(q, kv_cache, indices, **kw):
    def combine(parts, sink):
        if len(parts) == 1:
            return _softmax_combine(parts, sink)
        outs, lses, empties = [], [], []
        for p in parts:
            o, _, ln, e = _softmax_combine([p], None)
            outs.append(o)
            lses.append(torch.where(e, torch.zeros_like(ln), ln))  # bug: an empty partial has LSE 0
            empties.append(e)
        row_empty = torch.stack(empties).all(0)
        lse_stack = torch.stack(lses)  # [n, t, H]
        m = lse_stack.amax(0)
        if sink is not None:
            m = torch.maximum(m, sink[None, :])
        w = torch.exp(lse_stack - m)
        denom_ns = w.sum(0)
        denom = denom_ns + (torch.exp(sink[None, :] - m) if sink is not None else 0.0)
        out = sum(wi[..., None] * oi for wi, oi in zip(w, outs, strict=True)) / denom[..., None]
        lse_all = m + torch.log(denom)
        lse_ns = m + torch.log(denom_ns)
        out = torch.where(row_empty[..., None], torch.zeros_like(out), out)
        sink_only = sink[None, :].expand_as(lse_all) if sink is not None else torch.full_like(lse_all, NEG_INF)
        lse_all = torch.where(row_empty, sink_only, lse_all)
        lse_ns = torch.where(row_empty, torch.full_like(lse_ns, NEG_INF), lse_ns)
        return out, lse_all, lse_ns, row_empty

    return _own_forward(q, kv_cache, indices, combine=combine, **kw)


def _dedup_rows(idx: torch.Tensor, length: torch.Tensor | None) -> torch.Tensor:
    idx = idx.reshape(idx.shape[0], idx.shape[-1]).to(torch.int64)
    T, K = idx.shape
    lane = torch.arange(K, device=idx.device)
    valid = idx >= 0
    if length is not None:
        valid &= lane[None, :] < length.to(torch.int64).clamp(0, K)[:, None]
    key = torch.where(valid, idx, -1 - lane[None, :])  # invalid lanes get unique keys
    sorted_key, order = torch.sort(key, dim=1, stable=True)
    dup_sorted = torch.zeros_like(sorted_key, dtype=torch.bool)
    dup_sorted[:, 1:] = sorted_key[:, 1:] == sorted_key[:, :-1]
    dup = torch.zeros_like(dup_sorted).scatter(1, order, dup_sorted)
    return torch.where(dup, torch.full_like(idx, -1), idx).to(torch.int32)


def _fwd_dedup_indices(q, kv_cache, indices, **kw):
    _reference(q, kv_cache, indices, **kw)
    kw = dict(kw)
    indices = _dedup_rows(indices, kw.get("topk_length"))
    if kw.get("extra_indices") is not None:
        kw["extra_indices"] = _dedup_rows(kw["extra_indices"], kw.get("extra_topk_length"))
    return _reference(q, kv_cache, indices, **kw)


def _pow2_remap(idx: torch.Tensor, layout) -> torch.Tensor:
    ps = layout.page_block_size
    idx = idx.reshape(idx.shape[0], idx.shape[-1]).to(torch.int64)
    if ps & (ps - 1) == 0:
        return idx.to(torch.int32)
    shift = ps.bit_length() - 1  # log2 rounded down: the kernel was written for 64/128/256/2
    page = (idx >> shift) % layout.num_pages
    slot = idx & ((1 << shift) - 1)
    return torch.where(idx >= 0, page * ps + slot, idx).to(torch.int32)


def _fwd_pow2_page_shift(q, kv_cache, indices, **kw):
    _reference(q, kv_cache, indices, **kw)
    kw = dict(kw)
    call = SparseMlaCall.read(q, kv_cache, indices, validate=True, **_call_kwargs(kw))
    indices = _pow2_remap(indices, call.main.layout)
    if call.extra is not None:
        kw["extra_indices"] = _pow2_remap(kw["extra_indices"], call.extra.layout)
    return _reference(q, kv_cache, indices, **kw)


def _fwd_sink_head_tile_64(q, kv_cache, indices, **kw):
    _reference(q, kv_cache, indices, **kw)
    sink = kw.get("attn_sink")
    H = q.shape[1]
    if sink is not None and H > 64:
        kw = dict(kw)
        kw["attn_sink"] = sink[torch.arange(H, device=sink.device) % 64].contiguous()
    return _reference(q, kv_cache, indices, **kw)


def _fwd_prefill_ignores_extra_lengths(q, kv_cache, indices, **kw):
    _reference(q, kv_cache, indices, **kw)
    if q.shape[0] > 64 and kw.get("extra_kv_cache") is not None:
        kw = dict(kw)
        kw["extra_topk_length"] = None
    return _reference(q, kv_cache, indices, **kw)


def _fwd_sink_per_partial(q, kv_cache, indices, **kw):
    _reference(q, kv_cache, indices, **kw)
    if kw.get("extra_kv_cache") is not None and kw.get("attn_sink") is not None:
        kw = dict(kw)
        kw["attn_sink"] = kw["attn_sink"] + math.log(2.0)  # exp(sink) added once per partial
    return _reference(q, kv_cache, indices, **kw)


def _wrap_negative(length: torch.Tensor, width: int) -> torch.Tensor:
    return torch.where(length < 0, (length + width).clamp(min=0), length).to(torch.int32)


def _fwd_negative_length_wraps(q, kv_cache, indices, **kw):
    _reference(q, kv_cache, indices, **kw)
    kw = dict(kw)
    if kw.get("topk_length") is not None:
        kw["topk_length"] = _wrap_negative(kw["topk_length"], indices.shape[-1])
    if kw.get("extra_topk_length") is not None and kw.get("extra_indices") is not None:
        kw["extra_topk_length"] = _wrap_negative(kw["extra_topk_length"], kw["extra_indices"].shape[-1])
    return _reference(q, kv_cache, indices, **kw)


def _fwd_fp16_epilogue(q, kv_cache, indices, **kw):
    ref = _reference(q, kv_cache, indices, return_fp32=True, **kw)
    if ref.output_fp32 is None:
        return ref
    return KernelResult(ref.output_fp32.to(torch.float16).to(torch.bfloat16), ref.lse)


def _fwd_lse_scale_dropped_with_sink(q, kv_cache, indices, **kw):
    ref = _reference(q, kv_cache, indices, **kw)
    if kw.get("attn_sink") is None or kw.get("lse_convention", "flashinfer") != "flashinfer":
        return ref
    return KernelResult(ref.output, ref.lse / float(kw.get("lse_scale", 1.0)))


def _fwd_q_fp16_cast(q, kv_cache, indices, **kw):
    # the BF16 queries are converted to fp16 for an fp16 MMA (E4M3 keys convert to fp16 exactly)
    return _own_forward(q, kv_cache, indices, q_transform=lambda x: x.to(torch.float16).float(), **kw)


def _fwd_max_before_scale(q, kv_cache, indices, **kw):
    sm_scale = float(kw["sm_scale"])

    def combine(parts, sink):
        # the row max is taken over the raw q.k and then scaled: it is the max of the scores only
        # while sm_scale > 0 (for sm_scale < 0 it is their min, and exp(s - m) overflows once the
        # row's scores spread over more than ~88)
        dots = torch.cat([p.dots.masked_fill(~p.valid[:, None, :], NEG_INF) for p in parts], dim=-1)
        m = torch.nan_to_num(dots.amax(-1) * sm_scale, nan=NEG_INF)
        return _softmax_combine(parts, sink, max_override=m)

    return _own_forward(q, kv_cache, indices, combine=combine, **kw)


def _fwd_heads_over_128_unwritten(q, kv_cache, indices, **kw):
    ref = _reference(q, kv_cache, indices, **kw)
    if q.shape[1] <= 128:
        return ref
    out = ref.output.clone()
    lse = ref.lse.clone()
    out[:, 128:] = 0  # grid sized for at most 128 heads; the buffers come from torch.zeros
    lse[:, 128:] = 0
    return KernelResult(out, lse)


def _repitch_dsv3_2(cache: torch.Tensor, ps: int | None) -> torch.Tensor:
    layout = formats.parse_cache(cache, formats.DSV3_2, page_block_size=ps)
    if layout.token_stride == formats.DSV3_2.bytes_per_token:
        return cache
    pages = formats.page_bytes_view(cache, layout)
    n = layout.page_block_size * formats.DSV3_2.bytes_per_token
    # what a kernel addressing slot t at t * 656 reads
    return pages[:, :n].contiguous().view(layout.num_pages, layout.page_block_size, -1)


def _fwd_dsv3_2_token_pitch_assumed(q, kv_cache, indices, **kw):
    _reference(q, kv_cache, indices, **kw)
    main_fmt, _ = formats.cache_formats(kw.get("fmt", "dsv4"))
    if main_fmt.name != "dsv3_2":
        return _reference(q, kv_cache, indices, **kw)
    kw = dict(kw)
    kv_cache = _repitch_dsv3_2(kv_cache, kw.get("page_block_size"))
    if kw.get("extra_kv_cache") is not None:
        kw["extra_kv_cache"] = _repitch_dsv3_2(kw["extra_kv_cache"], kw.get("extra_page_block_size"))
    return _reference(q, kv_cache, indices, **kw)


# --------------------------------------------------------------------------------------------
# the kernel objects (--sparse-mla-impl adversary_kernels:<name>)

ue8m0_signed_scale = _AdversaryKernel("ue8m0_signed_scale", _fwd_ue8m0_signed)
e4m3_subnormal_flush = _AdversaryKernel("e4m3_subnormal_flush", _fwd_e4m3_subnormal_flush)
running_max_zero_init = _AdversaryKernel("running_max_zero_init", _fwd_running_max_zero_init)
qk_fp16_overflow = _AdversaryKernel("qk_fp16_overflow", _fwd_qk_fp16_overflow)
score_clamp_80 = _AdversaryKernel("score_clamp_80", _fwd_score_clamp_80)
sink_fp16_overflow = _AdversaryKernel("sink_fp16_overflow", _fwd_sink_fp16_overflow)
lse_without_max = _AdversaryKernel("lse_without_max", _fwd_lse_without_max)
empty_partial_lse_zero = _AdversaryKernel("empty_partial_lse_zero", _fwd_empty_partial_lse_zero)
dedup_indices = _AdversaryKernel("dedup_indices", _fwd_dedup_indices)
pow2_page_shift = _AdversaryKernel("pow2_page_shift", _fwd_pow2_page_shift)
sink_head_tile_64 = _AdversaryKernel("sink_head_tile_64", _fwd_sink_head_tile_64)
prefill_ignores_extra_lengths = _AdversaryKernel("prefill_ignores_extra_lengths", _fwd_prefill_ignores_extra_lengths)
sink_per_partial = _AdversaryKernel("sink_per_partial", _fwd_sink_per_partial)
negative_length_wraps = _AdversaryKernel("negative_length_wraps", _fwd_negative_length_wraps)
fp16_epilogue = _AdversaryKernel("fp16_epilogue", _fwd_fp16_epilogue)
lse_scale_dropped_with_sink = _AdversaryKernel("lse_scale_dropped_with_sink", _fwd_lse_scale_dropped_with_sink)
q_fp16_cast = _AdversaryKernel("q_fp16_cast", _fwd_q_fp16_cast)
max_before_scale = _AdversaryKernel("max_before_scale", _fwd_max_before_scale)
heads_over_128_unwritten = _AdversaryKernel("heads_over_128_unwritten", _fwd_heads_over_128_unwritten)
dsv3_2_token_pitch_assumed = _AdversaryKernel("dsv3_2_token_pitch_assumed", _fwd_dsv3_2_token_pitch_assumed)

# --------------------------------------------------------------------------------------------
# demonstrations (CPU, one input each)

SM = 512 ** -0.5


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pack(source: torch.Tensor, **kw) -> torch.Tensor:
    return formats.quantize_pack(source.to(torch.bfloat16), "dsv4", **kw)


def _run(kernel: _AdversaryKernel, q, cache, indices, **kw):
    got = kernel.sparse_mla_forward(q, cache, indices, sm_scale=kw.pop("sm_scale", SM), **kw)
    if not isinstance(got, KernelResult):
        got = KernelResult(got.output, got.lse)
    return got


def _demo(kernel, q, cache, indices, **kw):
    kw.setdefault("sm_scale", SM)
    got = _run(kernel, q, cache, indices, **dict(kw))
    want = oracle_forward(q, cache, indices, **kw)
    return got, want


def _demo_ue8m0_signed():
    g = _gen(1)
    src = data.latent((1, 64, 512), g)
    src[0, 5, :448] *= 4000.0  # this token's NoPE groups have maxima > 448: scale bytes >= 128
    cache = _pack(src)
    q = data.latent((2, 16, 512), g) * 0.01
    idx = torch.arange(16, dtype=torch.int32).repeat(2, 1)
    return _demo(ue8m0_signed_scale, q, cache, idx)


def _demo_e4m3_subnormal_flush():
    g = _gen(2)
    src = data.latent((1, 64, 512), g) * 1e-5  # group maxima below the 1e-4 floor: codes subnormal
    cache = _pack(src)
    q = data.latent((2, 16, 512), g)
    idx = torch.arange(32, dtype=torch.int32).repeat(2, 1)
    return _demo(e4m3_subnormal_flush, q, cache, idx)


def _demo_running_max_zero_init():
    g = _gen(3)
    src = 1.0 + 0.05 * torch.randn(1, 64, 512, generator=g)  # keys share a direction
    cache = _pack(src)
    q = torch.full((1, 8, 512), -8.0, dtype=torch.bfloat16)  # every score near -181
    idx = torch.arange(32, dtype=torch.int32)[None]
    return _demo(running_max_zero_init, q, cache, idx)


def _demo_qk_fp16_overflow():
    g = _gen(4)
    src = 8.0 + 0.5 * torch.randn(1, 64, 512, generator=g)
    cache = _pack(src)
    q = torch.full((1, 8, 512), 20.0, dtype=torch.bfloat16)  # q.k ~ 82k > 65504
    idx = torch.arange(16, dtype=torch.int32)[None]
    return _demo(qk_fp16_overflow, q, cache, idx)


def _demo_score_clamp_80():
    g = _gen(5)
    src = data.latent((1, 64, 512), g)
    cache = _pack(src)
    k = formats.unpack_dequantize(cache, "dsv4")[0]
    q = (60.0 * torch.sign(k[0]) + 30.0 * torch.sign(k[1]))[None, None].expand(1, 4, 512)
    q = q.to(torch.bfloat16).contiguous()  # scores of lanes 0 and 1 above 80, unequal
    idx = torch.arange(16, dtype=torch.int32)[None]
    return _demo(score_clamp_80, q, cache, idx, lse_convention="flashmla")


def _demo_sink_fp16_overflow():
    g = _gen(6)
    cache = _pack(data.latent((1, 64, 512), g))
    q = data.latent((2, 8, 512), g)
    idx = torch.arange(32, dtype=torch.int32).repeat(2, 1)
    sink = torch.full((8,), 15.0)  # exp(15 - max score) > 65504
    return _demo(sink_fp16_overflow, q, cache, idx, attn_sink=sink)


def _demo_lse_without_max():
    g = _gen(7)
    src = data.latent((1, 64, 512), g)
    cache = _pack(src)
    k = formats.unpack_dequantize(cache, "dsv4")[0]
    q = (80.0 * torch.sign(k[3]))[None, None].expand(1, 4, 512).to(torch.bfloat16).contiguous()
    idx = torch.arange(16, dtype=torch.int32)[None]
    return _demo(lse_without_max, q, cache, idx, lse_convention="flashmla")


def _demo_empty_partial_lse_zero():
    g = _gen(8)
    main = _pack(data.latent((2, 64, 512), g))
    extra = _pack(data.latent((4, 2, 512), g))  # C128-style 2-token pages
    q = data.latent((2, 8, 512), g)
    idx = torch.tensor([[3, 9, -1, -1], [4, -1, -1, -1]], dtype=torch.int32)
    ext = torch.tensor([[-1, -1], [1, 5]], dtype=torch.int32)  # token 0: no extra candidate
    ext_len = torch.tensor([2, 0], dtype=torch.int32)  # token 1: extra length 0
    return _demo(empty_partial_lse_zero, q, main, idx, extra_kv_cache=extra, extra_indices=ext,
                 extra_topk_length=ext_len)


def _demo_dedup_indices():
    g = _gen(9)
    cache = _pack(data.latent((1, 64, 512), g))
    q = data.latent((1, 8, 512), g)
    idx = torch.tensor([[3, 3, 3, 3, 3, 3, 7, -1]], dtype=torch.int32)
    return _demo(dedup_indices, q, cache, idx)


def _demo_pow2_page_shift():
    g = _gen(10)
    cache = _pack(data.latent((4, 48, 512), g), page_stride="tight")  # 48-token pages
    q = data.latent((2, 8, 512), g)
    idx = torch.tensor([[50, 100, 150, 60], [47, 95, 140, 190]], dtype=torch.int32)
    return _demo(pow2_page_shift, q, cache, idx)


def _demo_sink_head_tile_64():
    g = _gen(11)
    cache = _pack(data.latent((1, 64, 512), g))
    q = data.latent((1, 128, 512), g)
    idx = torch.arange(32, dtype=torch.int32)[None]
    sink = torch.cat([torch.full((64,), -4.0), torch.full((64,), 5.0)])
    return _demo(sink_head_tile_64, q, cache, idx, attn_sink=sink)


def _demo_prefill_ignores_extra_lengths():
    g = _gen(12)
    main = _pack(data.latent((1, 64, 512), g))
    extra_src = data.latent((8, 2, 512), g)
    extra_src[:, :, :] += torch.linspace(-1, 1, 16).reshape(8, 2, 1)  # extra tokens differ
    extra = _pack(extra_src)
    T = 65  # prefill route
    q = data.latent((T, 4, 512), g)
    idx = torch.arange(4, dtype=torch.int32).repeat(T, 1)
    ext = torch.arange(16, dtype=torch.int32).repeat(T, 1)
    ext_len = torch.ones(T, dtype=torch.int32)
    return _demo(prefill_ignores_extra_lengths, q, main, idx, extra_kv_cache=extra,
                 extra_indices=ext, extra_topk_length=ext_len)


def _demo_sink_per_partial():
    g = _gen(13)
    main = _pack(data.latent((1, 64, 512), g))
    extra = _pack(data.latent((4, 2, 512), g))
    q = data.latent((1, 8, 512), g) * 0.01
    idx = torch.arange(16, dtype=torch.int32)[None]
    ext = torch.arange(8, dtype=torch.int32)[None]
    sink = torch.full((8,), math.log(24.0))  # sink mass equal to the 24 lanes' mass
    return _demo(sink_per_partial, q, main, idx, extra_kv_cache=extra, extra_indices=ext, attn_sink=sink)


def _demo_negative_length_wraps():
    g = _gen(14)
    cache = _pack(data.latent((1, 64, 512), g))
    q = data.latent((2, 8, 512), g)
    idx = torch.arange(16, dtype=torch.int32).repeat(2, 1)
    length = torch.tensor([5, -3], dtype=torch.int32)  # -3 means "no candidates"
    return _demo(negative_length_wraps, q, cache, idx, topk_length=length)


def _demo_fp16_epilogue():
    g = _gen(15)
    cache = _pack(data.latent((1, 64, 512), g) * 1.0e6)  # values ~1e5, finite in BF16
    q = data.latent((1, 8, 512), g) * 1e-7
    idx = torch.arange(16, dtype=torch.int32)[None]
    return _demo(fp16_epilogue, q, cache, idx)


def _demo_lse_scale_dropped_with_sink():
    g = _gen(16)
    cache = _pack(data.latent((1, 64, 512), g))
    q = data.latent((1, 8, 512), g)
    idx = torch.arange(64, dtype=torch.int32)[None]
    sink = data.attn_sink(8, g)
    return _demo(lse_scale_dropped_with_sink, q, cache, idx, attn_sink=sink, lse_scale=math.log(2.0))


def _demo_q_fp16_cast():
    g = _gen(17)
    cache = _pack(data.latent((1, 64, 512), g))
    q = data.latent((1, 8, 512), g)
    q[:, :, 7] = 1.0e5  # finite in BF16, inf in fp16
    idx = torch.arange(32, dtype=torch.int32)[None]
    return _demo(q_fp16_cast, q, cache, idx)


def _demo_max_before_scale():
    g = _gen(18)
    cache = _pack(data.latent((1, 64, 512), g))
    k = formats.unpack_dequantize(cache, "dsv4")[0]
    q = (80.0 * torch.sign(k[3]))[None, None].expand(1, 4, 512).to(torch.bfloat16).contiguous()
    idx = torch.arange(16, dtype=torch.int32)[None]
    return _demo(max_before_scale, q, cache, idx, sm_scale=-(512 ** -0.5))


def _demo_heads_over_128_unwritten():
    g = _gen(19)
    cache = _pack(data.latent((1, 64, 512), g))
    q = data.latent((1, 136, 512), g)
    idx = torch.arange(32, dtype=torch.int32)[None]
    return _demo(heads_over_128_unwritten, q, cache, idx)


def _demo_dsv3_2_token_pitch_assumed():
    g = _gen(20)
    tight = formats.quantize_pack(data.latent((2, 16, 576), g), "dsv3_2", form="3d")
    rows = torch.zeros(2, 16, 672, dtype=torch.uint8)
    rows[..., :656] = tight
    cache = rows[..., :656]  # 3-D view, token pitch 672
    q = data.latent((2, 8, 576), g)
    idx = torch.tensor([[1, 5, 9, 17, 30], [3, 12, 20, 25, 31]], dtype=torch.int32)
    return _demo(dsv3_2_token_pitch_assumed, q, cache, idx, fmt="dsv3_2")


# --------------------------------------------------------------------------------------------
# registry

_SPECS = [
    ("ue8m0_signed_scale", ue8m0_signed_scale, _demo_ue8m0_signed,
     "The DSV4 UE8M0 scale byte is loaded as int8, so every group whose scale byte is >= 128 "
     "(group max above 448, i.e. scale >= 2) dequantizes to ~0.",
     "A `(int)(int8_t)byte - 127` (or a plain `char`, signed on x86) in a hand-written dequant; "
     "randn/10 test data never exceeds 448, so its scale bytes stay <= 127.",
     "one token's NoPE x4000 (group max ~1e3), 16 lanes"),
    ("e4m3_subnormal_flush", e4m3_subnormal_flush, _demo_e4m3_subnormal_flush,
     "E4M3 codes with a zero exponent field (subnormals) are decoded as 0.",
     "A bit-trick E4M3->fp16/bf16 converter (shift the exponent, add a bias) that drops the "
     "subnormal branch, or FTZ on the convert instruction.",
     "latent rows x1e-5 (below the 1e-4 scale floor: all codes subnormal)"),
    ("running_max_zero_init", running_max_zero_init, _demo_running_max_zero_init,
     "The online-softmax running max starts at 0 instead of -inf, so a row whose scores are all "
     "below about -88 underflows to a zero denominator and is written as an empty row.",
     "`float m = 0.f;` (or a zero-initialised shared-memory max) in a kernel tuned on "
     "randn queries, where some score is always above 0.",
     "keys ~1+noise, query -8 everywhere (all scores ~-181)"),
    ("qk_fp16_overflow", qk_fp16_overflow, _demo_qk_fp16_overflow,
     "The raw q.k dot product is kept in fp16 before sm_scale is applied, so a q.k beyond 65504 in magnitude "
     "becomes inf (and inf - inf = NaN in the softmax).",
     "An fp16-accumulate MMA (or an fp16 S tile) with the softmax scale folded in afterwards; "
     "fine while q and k are ~0.1 in size.",
     "keys ~8, query 20 everywhere (q.k ~ 8e4)"),
    ("score_clamp_80", score_clamp_80, _demo_score_clamp_80,
     "Scaled scores are clamped to [-80, 80] before the softmax (an exp-overflow guard), so rows "
     "with scores above 80 get a wrong LSE and, with two such lanes, wrong weights.",
     "A defensive `min(max(s, -80), 80)` added after an fp32 exp overflow on some model.",
     "query ~ 60 sign(k0) + 30 sign(k1): two scores above 80"),
    ("sink_fp16_overflow", sink_fp16_overflow, _demo_sink_fp16_overflow,
     "The sink's denominator term exp(sink - rowmax) is computed in fp16 and overflows to inf "
     "once sink exceeds the row's max score by ~11, zeroing the output and making the LSE inf.",
     "The sink folded into the fp16 P tile's row sum; randn*2 sinks never exceed the max by 11.",
     "sink +15 on every head, flashinfer-distributed data"),
    ("lse_without_max", lse_without_max, _demo_lse_without_max,
     "The LSE is computed as log(sum exp(s)) without subtracting the row max (the output path "
     "is stable), so it is inf for scores above ~88 and -inf when all are below ~-103.",
     "The LSE written by a separate epilogue that re-derives it from an unshifted sum.",
     "query 80 sign(k3): one score ~hundreds"),
    ("empty_partial_lse_zero", empty_partial_lse_zero, _demo_empty_partial_lse_zero,
     "In the split-K merge of the main and extra partials, a partial with no candidate gets "
     "LSE 0 (log 1) instead of -inf, adding a phantom weight exp(0) to the merge.",
     "The partial's LSE buffer zero-initialised (`torch.zeros`) instead of filled with -inf; "
     "only visible when one cache is empty for a row and the other's LSE is not >> 0.",
     "main + 2-token-page extra; one row with no extra lane, one with extra length 0"),
    ("dedup_indices", dedup_indices, _demo_dedup_indices,
     "Duplicate indices in a row are loaded once (deduplicated), so a token listed k times "
     "gets weight 1 instead of k.",
     "A gather optimisation (unique() before the page loads) assuming top-k indices are distinct.",
     "a row [3,3,3,3,3,3,7,-1]"),
    ("pow2_page_shift", pow2_page_shift, _demo_pow2_page_shift,
     "page/slot are computed with a shift and mask of floor(log2(page_block_size)), which is "
     "right only for power-of-two page sizes.",
     "`page = idx >> log2_ps; slot = idx & (ps - 1)` written for the 64/128/256/2-token pages "
     "of DeepSeek-V4 deployments.",
     "a 48-token-page main cache, indices in pages 1-3"),
    ("sink_head_tile_64", sink_head_tile_64, _demo_sink_head_tile_64,
     "Heads >= 64 read the sink of head h % 64 (the sink is loaded per 64-head tile with the "
     "tile-local head index).",
     "A second 64-head CTA indexing attn_sink with threadIdx-based head ids.",
     "128 heads, sinks -4 on heads 0-63 and +5 on 64-127"),
    ("prefill_ignores_extra_lengths", prefill_ignores_extra_lengths,
     _demo_prefill_ignores_extra_lengths,
     "On the prefill route (T > 64) extra_topk_length is not passed on, so every extra lane "
     "past the length is read.",
     "The prefill kernel's wrapper forwarding topk_length but not extra_topk_length.",
     "65 tokens, extra length 1 of 16 valid extra lanes"),
    ("sink_per_partial", sink_per_partial, _demo_sink_per_partial,
     "With an extra cache, exp(sink) is added to the denominator of both the main and the "
     "extra partial, so the merged sink mass is doubled.",
     "Each split-K partial applying the sink before the merge.",
     "16 main + 8 extra lanes, sink = log(24)"),
    ("negative_length_wraps", negative_length_wraps, _demo_negative_length_wraps,
     "A negative topk_length is taken Python-style (topk + length lanes) instead of being "
     "clamped to 0.",
     "`indices[:, :length]`-style slicing in a torch wrapper, or `length % topk`.",
     "lengths [5, -3] over 16 valid lanes"),
    ("fp16_epilogue", fp16_epilogue, _demo_fp16_epilogue,
     "The fp32 output is staged through fp16 before BF16, so outputs above 65504 become inf "
     "(and values below fp16's normal range lose bits).",
     "An epilogue reusing an fp16 shared-memory staging buffer from the fp16 variant of the kernel.",
     "latent rows x1e6 (outputs ~1e5)"),
    ("lse_scale_dropped_with_sink", lse_scale_dropped_with_sink,
     _demo_lse_scale_dropped_with_sink,
     "With an attn_sink, the FlashInfer LSE is returned in log2 without the lse_scale factor.",
     "The sink branch of the epilogue writing its own LSE and forgetting the final multiply.",
     "sink randn*2, lse_scale = ln 2"),
    ("q_fp16_cast", q_fp16_cast, _demo_q_fp16_cast,
     "The BF16 queries are converted to fp16 for an fp16 MMA, so a query element above 65504 "
     "becomes inf (NaN scores) and ones below 6e-5 lose bits.",
     "An fp16 tensor-core path over E4M3 keys (E4M3 converts to fp16 exactly, so the key side is "
     "right); real queries stay far below 65504.",
     "one query element of 1e5 per head"),
    ("max_before_scale", max_before_scale, _demo_max_before_scale,
     "The softmax row max is taken over the raw q.k and multiplied by sm_scale afterwards, which "
     "is the min of the scores for a negative sm_scale: exp(s - m) overflows once the scores "
     "spread over more than ~88.",
     "FlashAttention-style `m = max(S) * scale_log2`, correct for every positive softmax scale.",
     "sm_scale = -512**-0.5, a query peaked on one key (score spread ~120)"),
    ("heads_over_128_unwritten", heads_over_128_unwritten, _demo_heads_over_128_unwritten,
     "Heads past 128 are never computed (the launch grid is sized for at most 128 heads); their "
     "output and LSE stay 0.",
     "A grid of `min(num_heads, 128) / heads_per_cta` blocks written for DeepSeek-V4-Pro TP1 "
     "(128 heads), the largest deployment.",
     "136 heads"),
    ("dsv3_2_token_pitch_assumed", dsv3_2_token_pitch_assumed, _demo_dsv3_2_token_pitch_assumed,
     "DSV3.2 token records are addressed at slot * 656 inside a page, ignoring a padded token "
     "pitch (a [P, ps, 656] view over wider rows).",
     "A kernel taking only the page stride from the tensor and hard-coding the record size, "
     "tested only on tight DSV3.2 caches.",
     "a DSV3.2 3-D view with a 672-byte token pitch"),
]

ADVERSARY: dict[str, Adversary] = {
    name: Adversary(name, bug, origin, kernel, demo, on) for name, kernel, demo, bug, origin, on in _SPECS
}

def natural_lse(lse: torch.Tensor, convention: str, scale: float) -> torch.Tensor:
    lse = lse.double()
    return lse / (LOG2E * scale) if convention == "flashinfer" else lse


def discrepancy(kernel_result, oracle) -> dict:
    """``rel_err`` (normwise, output), ``lse_err`` (natural log, max), ``nonfinite`` (kernel
    non-finite where the oracle is finite)."""
    got_o = kernel_result.output.double()
    want_o = oracle.output.double()
    nonfinite = bool((~torch.isfinite(got_o) & torch.isfinite(want_o)).any())
    diff = torch.nan_to_num(got_o - want_o, nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))
    rel = float(diff.norm() / want_o.norm().clamp_min(1e-300))
    lse_err = 0.0
    if kernel_result.lse is not None:
        g = natural_lse(kernel_result.lse, oracle.lse_convention, oracle.lse_scale)
        w = natural_lse(oracle.lse, oracle.lse_convention, oracle.lse_scale)
        same_inf = (g == w)  # equal infinities count as agreement
        d = torch.where(same_inf, torch.zeros_like(g), (g - w).abs())
        d = torch.nan_to_num(d, nan=float("inf"), posinf=float("inf"))
        lse_err = float(d.max()) if d.numel() else 0.0
    return {"rel_err": rel, "lse_err": lse_err, "nonfinite": nonfinite}


# A control, not an adversary: the own fp32 kernel with no bug. It must pass every suite, so
# that a suite failure of an ``_own_forward`` kernel is the bug's, not the harness's.
control_own_engine = _AdversaryKernel("control_own_engine", _own_forward)


#: The kernels every fixed case of the suites passes and the search (default budget) catches
#: (``docs/adversary.md``); the wrong-kernel gate keeps each caught, first by a search test.
SEARCH_ONLY: tuple[str, ...] = (
    "ue8m0_signed_scale", "running_max_zero_init", "pow2_page_shift", "q_fp16_cast", "max_before_scale",
    "heads_over_128_unwritten",
)  # fmt: skip
