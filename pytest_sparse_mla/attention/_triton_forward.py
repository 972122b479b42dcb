"""Triton kernels of the bundled reference sparse-MLA forward (``backend="triton"``): two launches.

Import this module through ``attention.reference.triton_forward_module`` (``sparse_mla_forward``
does), which sets ``TRITON_INTERPRET=1`` first when no CUDA device exists (``INTERPRETED``).

:func:`sparse_mla` (shapes, dtypes and units in its docstring) runs the forward in two launches,
with no host synchronisation and no host decision on device values, so a call can be captured in a
CUDA graph:

1. ``_table_kernel`` dequantizes both packed caches exactly as ``formats.unpack_dequantize`` into one
   BF16 table (:func:`dequantize_table`: main rows, extra rows, then one zero row that every invalid
   lane reads); a DSV4 value is one BF16 piece, a DSV3.2 value three (``hi + mid + lo``, exact).
2. ``_attention_kernel``: one program per (token, group of 16 heads) walks the main then the extra
   index row in tiles of :data:`LANE_TILE` lanes, decides each lane's validity (index ``>= 0``,
   position ``< clamp(topk_length, 0, topk)``, index below the cache's token count; an index past
   the cache is counted in ``out_of_range`` and skipped), runs the online softmax in natural-log
   units and finalises (sink, FlashInfer or FlashMLA LSE).

Arithmetic: BF16 tensor-core products that are exact (probabilities split into three BF16 pieces)
and fp32 accumulation, so results stay within the 1e-5 target of the float64 oracle. Padding an
index row with ``-1`` changes nothing bit for bit, a head's arithmetic does not depend on
``num_heads`` (fixed :data:`DEFAULT_CONFIG`), and ``output == output_fp32.to(torch.bfloat16)``.
Derivations, the online-softmax steps and H200 measurements: ``docs/design/reference-kernel.md``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = [
    "INTERPRETED",
    "DEFAULT_CONFIG",
    "LANE_TILE",
    "CacheGeometry",
    "cache_geometry",
    "dequantize_table",
    "sparse_mla",
]

#: True when this module's kernel was decorated under ``TRITON_INTERPRET=1`` (CPU tensors).
INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"
#: ``(head_group, dv_block, num_warps, num_stages)`` of the attention kernel, fixed for every shape
#: (the bitwise invariants compare calls of different shapes). ``_SPARSE_MLA_ATTN_CONFIG`` (four
#: comma-separated ints, read at import) overrides it for tuning runs only
#: (``benchmarks/tune_attention.py``).
_h, _dv, _w, _s = (int(v) for v in os.environ.get("_SPARSE_MLA_ATTN_CONFIG", "16,512,4,2").split(","))
DEFAULT_CONFIG: tuple[int, int, int, int] = (_h, _dv, _w, _s)
#: Candidate lanes per tile (FlashInfer's DSV4 candidate tile ``BI``).
LANE_TILE = 64
#: Dims per score chunk of the unfused (DSV3.2) path (divides 512 and 576).
_D_CHUNK = 64
#: Cache rows per program of the table kernel.
_TABLE_ROWS = 64
_FP32_LOWEST = float(torch.finfo(torch.float32).min)
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class CacheGeometry:
    """Where a token's bytes sit in a packed cache (all offsets in bytes).

    Token ``i`` (flat index) is slot ``i % page_block_size`` of page ``i // page_block_size``; its
    NoPE codes start at ``page * page_stride + slot * row_stride``, its RoPE values ``rope_offset``
    bytes later, its scales at ``page * page_stride + scale_base + slot * scale_stride``.
    """

    num_tokens: int
    page_block_size: int
    page_stride: int
    row_stride: int
    rope_offset: int
    scale_base: int
    scale_stride: int


def cache_geometry(layout: object) -> CacheGeometry:
    """The :class:`CacheGeometry` of a ``formats.CacheLayout`` (DSV4 footer or DSV3.2 inline)."""
    f = layout.fmt  # type: ignore[attr-defined]
    ps = int(layout.page_block_size)  # type: ignore[attr-defined]
    if f.layout == "footer":  # data rows of d_nope + 2 * d_rope bytes, then the scale footer
        row, scale_base, scale_stride = f.data_bytes_per_token, ps * f.data_bytes_per_token, f.scale_bytes_per_token
        rope = f.d_nope
    else:  # inline: codes, fp32 scales, RoPE in one row
        row = int(layout.token_stride)  # type: ignore[attr-defined]
        scale_base, scale_stride, rope = f.d_nope, row, f.d_nope + f.scale_bytes_per_token
    return CacheGeometry(
        num_tokens=min(int(layout.num_tokens), _INT32_MAX),  # type: ignore[attr-defined]
        page_block_size=ps,
        page_stride=int(layout.page_stride),  # type: ignore[attr-defined]
        row_stride=row,
        rope_offset=rope,
        scale_base=scale_base,
        scale_stride=scale_stride,
    )


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b`` on BF16 tensor cores; with ``UPCAST`` (the CPU interpreter, whose BF16 dot
    is not IEEE) the same products in fp32 (BF16 x BF16 products are exact in fp32)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _e4m3_to_f32(code, HW: tl.constexpr):
    """E4M3 (``float8_e4m3fn``) bytes to fp32, exactly: the hardware conversion, or (``HW`` off,
    the interpreter) integer operations: exponent field ``e``, mantissa ``m``: ``e > 0``:
    ``(1 + m/8) * 2**(e - 7)``; ``e == 0``: ``m * 2**-9``; ``0x7F``/``0xFF``: NaN."""
    if HW:
        return code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    c = code.to(tl.int32)
    sign = (c & 0x80) << 24
    e = (c >> 3) & 15
    m = c & 7
    normal = (sign | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # 2**-9
    sub = tl.where(sign != 0, -sub, sub)
    value = tl.where(e == 0, sub, normal)
    return tl.where((c & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def _hi_bf16(x):
    """``x`` with its low 16 bits cleared (an exact BF16 value), as fp32."""
    return (x.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _round_bf16_bits(x):
    """fp32 -> BF16 bits, round to nearest even, NaN -> 0x7FC0 (torch's ``.to(torch.bfloat16)``)."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where(x != x, 0x7FC0, r)
    return r.to(tl.int16)


@triton.jit
def _table_kernel(
    table_ptr, kv_ptr, num_rows, out_offset, zero_after, piece_stride,
    ps, page_stride, row_stride, rope_offset, scale_base, scale_stride,
    D_QK: tl.constexpr, NG: tl.constexpr, GS: tl.constexpr, D_NOPE: tl.constexpr, D_ROPE: tl.constexpr,
    PIECES: tl.constexpr, UE8M0: tl.constexpr, HW_FP8: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """Dequantize ``BLOCK_R`` tokens of one cache into table rows ``out_offset + token``, one scale
    group (or, for ``program_id(1) == NG``, the RoPE values) per program. With ``zero_after`` the
    row after the last token (``out_offset + num_rows``: the zero row) is written as zeros."""
    g = tl.program_id(1)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    inside = r < num_rows
    store = r < num_rows + zero_after  # zero_after (0 or 1): also the zero row after the last token
    flat = tl.where(inside, r, 0).to(tl.int64)
    page = flat // ps
    slot = flat - page * ps
    row = kv_ptr + page * page_stride + slot * row_stride
    out_row = table_ptr + (r + out_offset).to(tl.int64)[:, None] * D_QK
    if g < NG:
        c = tl.arange(0, GS)
        codes = tl.load(row[:, None] + g * GS + c[None, :], mask=inside[:, None], other=0)
        srow = kv_ptr + page * page_stride + scale_base + slot * scale_stride
        if UE8M0:  # 2**(byte - 127); byte 0 is the fp32 subnormal 2**-127
            sb = tl.load(srow + g, mask=inside, other=127).to(tl.int32)
            scale = tl.where(sb == 0, 5.877471754111438e-39, (sb << 23).to(tl.float32, bitcast=True))
        else:
            scale = tl.load((srow + g * 4).to(tl.pointer_type(tl.float32)), mask=inside, other=0.0)
        v = _e4m3_to_f32(codes, HW_FP8) * scale[:, None]
        v = tl.where(inside[:, None], v, 0.0)
        dst = out_row + g * GS + c[None, :]
        if PIECES == 1:  # exact: a BF16 number
            tl.store(dst, v.to(tl.bfloat16), mask=store[:, None])
        else:  # hi + mid + lo by masking the low 16 bits (exact; non-finite values keep hi only)
            h1 = _hi_bf16(v)
            rem = tl.where((v == v) & (tl.abs(v) != float("inf")), v - h1, 0.0)
            h2 = _hi_bf16(rem)
            tl.store(dst, h1.to(tl.bfloat16), mask=store[:, None])
            tl.store(dst + piece_stride, h2.to(tl.bfloat16), mask=store[:, None])
            tl.store(dst + 2 * piece_stride, (rem - h2).to(tl.bfloat16), mask=store[:, None])
    else:  # (names unlike the other branch's: a runtime if merges names defined in both)
        rc = tl.arange(0, D_ROPE)
        rope_ptr = (row + rope_offset).to(tl.pointer_type(tl.bfloat16))
        rope = tl.load(rope_ptr[:, None] + rc[None, :], mask=inside[:, None], other=0.0)
        rdst = out_row + D_NOPE + rc[None, :]
        tl.store(rdst, rope, mask=store[:, None])
        for piece in tl.static_range(1, PIECES):
            tl.store(rdst + piece * piece_stride, tl.zeros([BLOCK_R, D_ROPE], tl.bfloat16), mask=store[:, None])


@triton.jit
def _walk(
    q_all, q_rows, hmask, m_i, l_i, acc, bad,
    k_ptr, idx_row, stride_lane, num_lanes, length, num_rows, row_offset, zero_row, piece_stride, sm_scale,
    dv0, D_QK: tl.constexpr, DV_BLOCK: tl.constexpr, LANES: tl.constexpr, D_CHUNK: tl.constexpr,
    PIECES: tl.constexpr, FUSED: tl.constexpr, UPCAST: tl.constexpr, LOWEST: tl.constexpr,
):  # fmt: skip
    """The online softmax over one index row (main or extra cache), tile by tile."""
    lanes = tl.arange(0, LANES)
    dvs = dv0 + tl.arange(0, DV_BLOCK)
    dchunk = tl.arange(0, D_CHUNK)
    for start in range(0, num_lanes, LANES):
        lane = start + lanes
        idx = tl.load(idx_row + lane * stride_lane, mask=lane < num_lanes, other=-1)
        listed = (lane < length) & (idx >= 0)
        valid = listed & (idx < num_rows)
        bad += tl.sum((listed & (idx >= num_rows)).to(tl.int32), axis=0)
        r = tl.where(valid, idx + row_offset, zero_row)
        base = k_ptr + r.to(tl.int64) * D_QK
        s = tl.zeros([q_all.shape[0], LANES], tl.float32)
        if FUSED:
            k_tile = tl.load(base[:, None] + dvs[None, :])  # [LANES, D_QK] bf16
            s = _dot(q_all, tl.trans(k_tile), s, UPCAST)
        else:
            for d in tl.static_range(0, D_QK, D_CHUNK):
                qc = tl.load(q_rows + d + dchunk[None, :], mask=hmask[:, None], other=0.0)
                for piece in tl.static_range(PIECES):
                    kc = tl.load(base[:, None] + piece * piece_stride + d + dchunk[None, :])
                    s = _dot(qc, tl.trans(kc), s, UPCAST)
        s = tl.where(valid[None, :], s * sm_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        shift = tl.maximum(m_new, LOWEST)
        alpha = tl.exp(m_i - shift)
        p = tl.exp(s - shift[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # p = p1 + p2 + p3 exactly: each piece is the next 8 significant bits, cut with a mask of
        # the fp32 bits, so every conversion below is exact (whatever its rounding mode: the CPU
        # interpreter's fp32 -> bf16 truncates).
        p1f = _hi_bf16(p)
        prem = p - p1f
        p2f = _hi_bf16(prem)
        p1 = p1f.to(tl.bfloat16)
        p2 = p2f.to(tl.bfloat16)
        p3 = (prem - p2f).to(tl.bfloat16)
        acc = acc * alpha[:, None]
        if FUSED:
            v_tile = k_tile
        else:
            v_tile = tl.load(base[:, None] + dvs[None, :])
        acc = _dot(p1, v_tile, acc, UPCAST)
        acc = _dot(p2, v_tile, acc, UPCAST)
        acc = _dot(p3, v_tile, acc, UPCAST)
        if PIECES == 3:  # the piece products of total order <= 2: p1 v2, p2 v2, p1 v3
            v_tile = tl.load(base[:, None] + piece_stride + dvs[None, :])
            acc = _dot(p1, v_tile, acc, UPCAST)
            acc = _dot(p2, v_tile, acc, UPCAST)
            v_tile = tl.load(base[:, None] + 2 * piece_stride + dvs[None, :])
            acc = _dot(p1, v_tile, acc, UPCAST)
        m_i = m_new
    return m_i, l_i, acc, bad


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, idx_ptr, len_ptr, xidx_ptr, xlen_ptr, sink_ptr, out_ptr, out32_ptr, lse_ptr, bad_ptr,
    num_heads, per_token, topk, extra_topk, num_main, num_extra, zero_row, piece_stride,
    has_len, has_xlen, has_sink, write_fp32, flashmla, lse_mult, sm_scale,
    stride_qt, stride_qh, stride_it, stride_il, stride_xt, stride_xl, stride_len, stride_xlen, stride_sink,
    stride_ot, stride_oh, stride_ft, stride_fh, stride_lt,
    D_QK: tl.constexpr, D_V: tl.constexpr, DV_BLOCK: tl.constexpr, BLOCK_H: tl.constexpr,
    LANES: tl.constexpr, D_CHUNK: tl.constexpr, PIECES: tl.constexpr, UPCAST: tl.constexpr,
    LOWEST: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)  # head group and value slice vary fastest: neighbours share rows in L2
    t = (pid // per_token).to(tl.int64)
    j = pid % per_token
    num_slices: tl.constexpr = D_V // DV_BLOCK
    # DSV4 (one piece, V = the whole row): each key tile is loaded once, whole, and is the value
    # tile too. Otherwise (DSV3.2: RoPE dims past d_v, or three pieces) the scores are summed over
    # 64-dim chunks and the value pieces are loaded one at a time (bounded shared memory).
    FUSED: tl.constexpr = (D_QK == D_V) and (PIECES == 1) and (DV_BLOCK == D_V)
    group = j // num_slices
    dv0 = (j % num_slices) * DV_BLOCK
    heads = group * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    dvs = dv0 + tl.arange(0, DV_BLOCK)
    q_rows = q_ptr + t * stride_qt + heads.to(tl.int64)[:, None] * stride_qh
    q_all = tl.load(q_rows + dvs[None, :], mask=hmask[:, None], other=0.0)  # [BLOCK_H, DV_BLOCK] bf16

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DV_BLOCK], tl.float32)
    bad = tl.zeros([], tl.int32)
    length = tl.load(len_ptr + t * stride_len, mask=has_len != 0, other=topk)
    m_i, l_i, acc, bad = _walk(
        q_all, q_rows, hmask, m_i, l_i, acc, bad,
        k_ptr, idx_ptr + t * stride_it, stride_il, topk, length, num_main, 0, zero_row, piece_stride, sm_scale,
        dv0, D_QK, DV_BLOCK, LANES, D_CHUNK, PIECES, FUSED, UPCAST, LOWEST,
    )  # fmt: skip
    xlength = tl.load(xlen_ptr + t * stride_xlen, mask=has_xlen != 0, other=extra_topk)
    m_i, l_i, acc, bad = _walk(
        q_all, q_rows, hmask, m_i, l_i, acc, bad,
        k_ptr, xidx_ptr + t * stride_xt, stride_xl, extra_topk, xlength, num_extra, num_main, zero_row,
        piece_stride, sm_scale, dv0, D_QK, DV_BLOCK, LANES, D_CHUNK, PIECES, FUSED, UPCAST, LOWEST,
    )  # fmt: skip

    # Finalise (natural log): out = acc / l times sigmoid(lse - sink); LSE per convention.
    nonempty = l_i > 0
    lse_e = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    sink = tl.load(sink_ptr + heads * stride_sink, mask=hmask, other=float("-inf"))
    sink = tl.where(has_sink != 0, sink, float("-inf"))  # no sink: any fp32 [H] buffer, unused
    factor = tl.where(nonempty, 1.0 / (1.0 + tl.exp(sink - tl.where(nonempty, lse_e, 0.0))), 0.0)
    factor = factor / tl.where(nonempty, l_i, 1.0)
    out = acc * factor[:, None]
    o_row = t * stride_ot + heads.to(tl.int64)[:, None] * stride_oh
    tl.store(out_ptr + o_row + dvs[None, :], _round_bf16_bits(out), mask=hmask[:, None])
    if write_fp32 != 0:
        f_row = t * stride_ft + heads.to(tl.int64)[:, None] * stride_fh
        tl.store(out32_ptr + f_row + dvs[None, :], out, mask=hmask[:, None])
    if dv0 == 0:
        top = tl.maximum(lse_e, sink)
        finite_top = (top != float("-inf")) & (top != float("inf"))
        safe_top = tl.where(finite_top, top, 0.0)
        mass = tl.where(finite_top, tl.exp(lse_e - safe_top) + tl.exp(sink - safe_top), 1.0)  # in [1, 2]
        lse_full = tl.where(sink == float("-inf"), lse_e, tl.where(finite_top, safe_top + tl.log(mass), top))
        lse_out = tl.where(flashmla != 0, tl.where(nonempty, lse_e, float("inf")), lse_full * lse_mult)
        tl.store(lse_ptr + t * stride_lt + heads, lse_out, mask=hmask)
        if group == 0:
            tl.store(bad_ptr + t, bad)


_NO_CACHE = CacheGeometry(0, 1, 16, 0, 0, 0, 0)


def dequantize_table(
    kv_cache: torch.Tensor,
    geometry: CacheGeometry,
    extra_kv_cache: torch.Tensor | None,
    extra_geometry: CacheGeometry | None,
    dsv4: bool,
) -> torch.Tensor:
    """Both caches dequantized into one BF16 table (one launch of ``_table_kernel`` per cache).

    Returns:
        ``[pieces, N + X + 1, d_qk]`` BF16, contiguous (``pieces`` 1 for DSV4, 3 for DSV3.2, whose
        pieces sum exactly to the fp32 value): rows ``0..N-1`` are the main cache's tokens by flat
        index, rows ``N..N+X-1`` the extra cache's, row ``N + X`` is zero. Every value equals
        ``formats.unpack_dequantize`` of its token.
    """
    x = extra_geometry if extra_kv_cache is not None and extra_geometry is not None else _NO_CACHE
    if dsv4:
        pieces, ng, gs, d_nope, d_qk = 1, 7, 64, 448, 512
    else:
        pieces, ng, gs, d_nope, d_qk = 3, 4, 128, 512, 576
    table = torch.empty(
        (pieces, geometry.num_tokens + x.num_tokens + 1, d_qk), dtype=torch.bfloat16, device=kv_cache.device
    )
    parts = [(kv_cache, geometry, 0)]
    if extra_kv_cache is not None and x is not _NO_CACHE:
        parts.append((extra_kv_cache, x, geometry.num_tokens))
    for i, (cache, g, offset) in enumerate(parts):
        last = i == len(parts) - 1  # the last part also writes the zero row after its tokens
        grid = (triton.cdiv(g.num_tokens + int(last), _TABLE_ROWS), ng + 1)
        _table_kernel[grid](
            table, cache, g.num_tokens, offset, int(last), table.stride(0),
            g.page_block_size, g.page_stride, g.row_stride, g.rope_offset, g.scale_base, g.scale_stride,
            D_QK=d_qk, NG=ng, GS=gs, D_NOPE=d_nope, D_ROPE=64, PIECES=pieces, UE8M0=dsv4,
            HW_FP8=not INTERPRETED, BLOCK_R=_TABLE_ROWS,
        )  # fmt: skip
    return table


def sparse_mla(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    geometry: CacheGeometry,
    indices: torch.Tensor,
    topk_length: torch.Tensor | None,
    extra_kv_cache: torch.Tensor | None,
    extra_geometry: CacheGeometry | None,
    extra_indices: torch.Tensor | None,
    extra_topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
    *,
    sm_scale: float,
    dsv4: bool,
    flashmla_lse: bool,
    lse_multiplier: float,
    output: torch.Tensor,
    lse: torch.Tensor,
    output_fp32: torch.Tensor | None,
    out_of_range: torch.Tensor,
    config: tuple[int, int, int, int] | None = None,
) -> None:
    """Run the forward in two launches (table, attention), writing ``output``, ``lse``,
    ``output_fp32`` (if given) and ``out_of_range``. No host synchronisation; every argument is
    trusted (the caller, ``attention.reference.sparse_mla_forward``, has validated them).

    Args:
        q: ``[T, H, d_qk]`` BF16 with unit last-dim stride (``d_qk`` 512 DSV4, 576 DSV3.2).
        kv_cache, extra_kv_cache: the packed uint8 caches (any accepted form; only their data
            pointers are used, with ``geometry`` / ``extra_geometry`` from :func:`cache_geometry`).
        indices, extra_indices: ``[T, topk]`` int32 flat token indices (any strides).
        topk_length, extra_topk_length: ``[T]`` int32 or ``None``.
        attn_sink: ``[H]`` fp32 natural-log logits or ``None``.
        sm_scale: score scale.
        dsv4: DSV4 footer layout (UE8M0 scales, ``V`` = the whole 512-dim row) or DSV3.2 inline
            (fp32 scales, ``V`` = the 512 NoPE dims).
        flashmla_lse: natural-log LSE without the sink (``+inf`` when empty), else FlashInfer's
            ``logaddexp(lse, sink) * lse_multiplier`` (``lse_multiplier = log2(e) * lse_scale``).
        output: ``[T, H, 512]`` BF16; lse: ``[T, H]`` fp32; output_fp32: ``[T, H, 512]`` fp32 or
            ``None``; each with unit last-dim stride.
        out_of_range: ``[T]`` int32, contiguous: per token, the number of lanes inside the valid
            prefix whose index is past its cache (those lanes are skipped).
        config: ``(head_group, dv_block, num_warps, num_stages)`` of the attention kernel; default
            :data:`DEFAULT_CONFIG`.
    """
    block_h, dv_block, num_warps, num_stages = config or DEFAULT_CONFIG
    num_tokens, num_heads, d_qk = (int(v) for v in q.shape)
    if num_tokens == 0:
        return
    d_v = int(output.shape[2])
    pieces = 1 if dsv4 else 3
    if not dsv4:
        num_stages = 1  # the unfused loop: software pipelining would multi-buffer all its loads
    g = geometry
    if extra_kv_cache is None or extra_geometry is None or extra_indices is None:
        extra_kv_cache, extra_indices, extra_topk, x = kv_cache, indices, 0, _NO_CACHE
    else:
        extra_topk = int(extra_indices.shape[1])
        x = extra_geometry
    table = dequantize_table(kv_cache, g, extra_kv_cache if extra_topk else None, x, dsv4)
    zero_row = g.num_tokens + x.num_tokens
    per_token = -(-num_heads // block_h) * (d_v // dv_block)
    out16 = output.view(torch.int16)
    fp32 = output_fp32 if output_fp32 is not None else lse  # fp32 either way: one compiled variant
    dummy = out_of_range
    _attention_kernel[(num_tokens * per_token,)](
        q, table, indices, topk_length if topk_length is not None else dummy,
        extra_indices, extra_topk_length if extra_topk_length is not None else dummy,
        attn_sink if attn_sink is not None else lse, out16, fp32, lse, out_of_range,
        num_heads, per_token, int(indices.shape[1]), extra_topk, g.num_tokens, x.num_tokens, zero_row,
        table.stride(0), int(topk_length is not None), int(extra_topk_length is not None),
        int(attn_sink is not None), int(output_fp32 is not None), int(flashmla_lse), float(lse_multiplier),
        float(sm_scale),
        q.stride(0), q.stride(1), indices.stride(0), indices.stride(1),
        extra_indices.stride(0), extra_indices.stride(1),
        topk_length.stride(0) if topk_length is not None else 0,
        extra_topk_length.stride(0) if extra_topk_length is not None else 0,
        attn_sink.stride(0) if attn_sink is not None else 0,
        out16.stride(0), out16.stride(1), fp32.stride(0), fp32.stride(1), lse.stride(0),
        D_QK=d_qk, D_V=d_v, DV_BLOCK=dv_block, BLOCK_H=block_h, LANES=LANE_TILE, D_CHUNK=_D_CHUNK,
        PIECES=pieces, UPCAST=INTERPRETED, LOWEST=_FP32_LOWEST, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
