"""Triton kernels of the bundled reference sparse-MLA forward (``backend="triton"``).

Import this module through ``attention.reference.triton_forward_module`` (``sparse_mla_forward``
does), which sets ``TRITON_INTERPRET=1`` first when no CUDA device exists (``INTERPRETED``).

:func:`sparse_mla` (shapes, dtypes and units in its docstring) runs the forward with no host
synchronisation and no host decision on device values, so a call can be captured in a CUDA graph.
Per block of tokens (all of a decode call):

1. ``_gather_kernel`` writes each valid candidate lane's token, dequantized exactly as
   ``formats.unpack_dequantize``, as a BF16 row (DSV4: the 512 values, each an E4M3 code times a
   power of two or a RoPE value, so a BF16 number; DSV3.2: the 512 codes as BF16 and the 64 RoPE
   values, with the four fp32 scales beside). Only valid lanes are read and written: the work is
   proportional to the candidates, not to the caches. DeepSeek-V4.1 records
   (:func:`reads_records_in_torch`) are gathered by :func:`gather_records` instead (batched torch
   operations: each lane's record, dequantized, as a BF16 row, exact) and attended as DSV4 rows.
2. ``_attention_kernel``: one program per (token, group of heads) walks the token's candidates in
   chunks of ``chunk`` lanes (main row, then extra row), each chunk from an empty state in tiles
   of :data:`LANE_TILE`; it decides each lane's validity itself (index ``>= 0``, position ``<
   clamp(topk_length, 0, topk)``, index below the cache's token count; an index past the cache is
   counted in ``out_of_range`` and skipped), runs the online softmax in natural-log units, folds the
   chunk states in order and finalises (sink, FlashInfer or FlashMLA LSE). When that launch would
   leave most of the GPU idle (:func:`split_chunks`), each chunk gets its own program and
   ``_combine_kernel`` folds the stored chunk states with the same arithmetic: the same bits.

Arithmetic: BF16 tensor-core products that are exact (probabilities split into three BF16 pieces;
DSV3.2 scores as exact code products scaled per 128-dim group) and fp32 accumulation, so results
stay within the 1e-5 target of the float64 oracle. Padding an index row with ``-1`` changes nothing
bit for bit (an empty chunk or tile leaves the state unchanged), a head's arithmetic does not depend
on ``num_heads`` (one :data:`DEFAULT_CONFIG` per format), and ``output == output_fp32.to(torch.bfloat16)``.
Derivations, the online-softmax steps and H200 measurements: ``docs/design/reference-kernel.md``.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from pytest_sparse_mla.attention.call import SparseMlaCall

__all__ = [
    "INTERPRETED",
    "DEFAULT_CONFIG",
    "LANE_TILE",
    "SPLIT_BELOW_WAVES",
    "CacheGeometry",
    "cache_geometry",
    "gather_records",
    "gather_rows",
    "reads_records_in_torch",
    "sparse_mla",
    "split_chunks",
]

#: True when this module's kernel was decorated under ``TRITON_INTERPRET=1`` (CPU tensors).
INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"
#: ``(head_group, num_warps, num_stages, chunk)`` of the attention kernel per format (key: DSV4),
#: fixed for every shape (the bitwise invariants compare calls of different shapes): heads per
#: program, and candidate lanes per chunk (a multiple of :data:`LANE_TILE`). ``_SPARSE_MLA_ATTN_CONFIG``
#: (four comma-separated ints, read at import) overrides both for tuning runs only
#: (``benchmarks/tune_attention.py``).
_ENV_CONFIG = os.environ.get("_SPARSE_MLA_ATTN_CONFIG")
DEFAULT_CONFIG: dict[bool, tuple[int, int, int, int]] = {True: (32, 8, 2, 512), False: (32, 8, 2, 512)}
if _ENV_CONFIG:
    _h, _w, _s, _c = (int(v) for v in _ENV_CONFIG.split(","))
    DEFAULT_CONFIG = {True: (_h, _w, _s, _c), False: (_h, _w, _s, _c)}
#: A call splits its chunks over programs when its unsplit launch would have fewer programs than
#: this many times the device's multiprocessors (:func:`split_chunks`; on an H200 at T=64 the
#: unsplit launch of 128 or 256 programs was faster than the split one).
SPLIT_BELOW_WAVES = 0.5
#: Candidate lanes per tile (FlashInfer's DSV4 candidate tile ``BI``).
LANE_TILE = 64
#: Rows per program of the gather kernel.
_GATHER_ROWS = 32
#: Bytes of gathered rows per launch pair: a call's tokens are processed in blocks that fit.
_GATHER_BYTES = 256 * 2**20
_FP32_LOWEST = float(torch.finfo(torch.float32).min)
_LOG2E = 1.0 / math.log(2.0)
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
def _ue8m0_to_f32(byte):
    """A UE8M0 scale byte to ``2**(byte - 127)`` in fp32 (byte 0: the subnormal ``2**-127``)."""
    b = byte.to(tl.int32)
    return tl.where(b == 0, 5.877471754111438e-39, (b << 23).to(tl.float32, bitcast=True))


@triton.jit
def _hi_bf16(x):
    """``x`` with its low 16 bits cleared (an exact BF16 value), as fp32."""
    return (x.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _pieces(p):
    """``p = p1 + p2 + p3`` exactly, three BF16 tensors: each piece is the next 8 significant bits of
    the fp32 ``p``, cut with a mask of its bits, so every conversion is exact whatever its rounding
    mode (the CPU interpreter's fp32 -> BF16 truncates)."""
    p1 = _hi_bf16(p)
    rest = p - p1
    p2 = _hi_bf16(rest)
    return p1.to(tl.bfloat16), p2.to(tl.bfloat16), (rest - p2).to(tl.bfloat16)


@triton.jit
def _round_bf16_bits(x):
    """fp32 -> BF16 bits, round to nearest even, NaN -> 0x7FC0 (torch's ``.to(torch.bfloat16)``)."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where(x != x, 0x7FC0, r)
    return r.to(tl.int16)


@triton.jit
def _lanes(idx_row, stride_lane, start, end, num_rows, LANES: tl.constexpr):
    """One tile of an index row: lanes ``start + [0, LANES)``, of which those ``< end`` (the chunk's
    end, clamped to the row's valid prefix) are listed when their index is ``>= 0``. Returns
    ``(valid, bad)``: valid lanes (listed, index below ``num_rows``) and the number of listed lanes
    whose index is past the cache."""
    lane = start + tl.arange(0, LANES)
    idx = tl.load(idx_row + lane * stride_lane, mask=lane < end, other=-1)
    listed = idx >= 0
    valid = listed & (idx < num_rows)
    return valid, tl.sum((listed & (idx >= num_rows)).to(tl.int32), axis=0)


@triton.jit
def _row_offsets(flat, ps, page_stride, row_stride, scale_base, scale_stride):
    """Byte offsets of tokens ``flat`` in a packed cache: their data rows and their scale records."""
    page = flat // ps
    slot = flat - page * ps
    first = page * page_stride
    return first + slot * row_stride, first + scale_base + slot * scale_stride


@triton.jit
def _dsv4_rows(row_ptr, scale_ptr, valid, rope_offset, HW_FP8: tl.constexpr):
    """``[LANES, 8, 64]`` BF16: each valid lane's DSV4 token in its eight 64-dim groups, exactly
    ``formats.unpack_dequantize`` (groups 0-6: E4M3 codes times ``2**(scale - 127)``, BF16 numbers;
    group 7: the RoPE BF16 bits); invalid lanes read nothing and are 0. Group 7 of the code load and
    scale byte 7 (the pad) are bytes of the same token's record that the select drops."""
    grp = tl.arange(0, 8)
    c = tl.arange(0, 64)
    m = valid[:, None, None]
    code = tl.load(row_ptr[:, None, None] + (grp * 64)[None, :, None] + c[None, None, :], mask=m, other=0)
    sb = tl.load(scale_ptr[:, None] + grp[None, :], mask=valid[:, None], other=127)
    nope = _e4m3_to_f32(code, HW_FP8) * _ue8m0_to_f32(sb)[:, :, None]
    rope_ptr = (row_ptr + rope_offset).to(tl.pointer_type(tl.bfloat16))
    last = (grp == 7)[None, :, None]
    rope = tl.load(rope_ptr[:, None, None] + c[None, None, :] + 0 * grp[None, :, None], mask=m & last, other=0.0)
    return tl.where(last, rope.to(tl.float32), nope).to(tl.bfloat16)


@triton.jit
def _dsv32_group(row_ptr, scale_ptr, valid, g: tl.constexpr, HW_FP8: tl.constexpr):
    """Scale group ``g`` (dims ``128 g .. 128 g + 127``) of each valid lane's DSV3.2 token: the E4M3
    codes as BF16 (exact) ``[LANES, 128]`` and the fp32 scale ``[LANES]``; invalid lanes 0."""
    c = tl.arange(0, 128)
    code = tl.load(row_ptr[:, None] + g * 128 + c[None, :], mask=valid[:, None], other=0)
    scale = tl.load((scale_ptr + 4 * g).to(tl.pointer_type(tl.float32)), mask=valid, other=0.0)
    return _e4m3_to_f32(code, HW_FP8).to(tl.bfloat16), scale


@triton.jit
def _softmax_step(s, valid, m_i, l_i, sm_scale, LOWEST: tl.constexpr):
    """One tile of the online softmax (natural log): returns ``(m', l', alpha, p)``. Invalid lanes
    get score ``-inf``; the shift ``max(m', fp32 lowest)`` keeps a row with no valid lane yet from
    computing ``-inf - -inf``, so a tile with no valid lane gives ``alpha = 1`` (or 0 on an all-zero
    state) and ``p = 0`` exactly."""
    s = tl.where(valid[None, :], s * sm_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    shift = tl.maximum(m_new, LOWEST)
    alpha = tl.exp(m_i - shift)
    p = tl.exp(s - shift[:, None])
    return m_new, l_i * alpha + tl.sum(p, axis=1), alpha, p


@triton.jit
def _pv(p, v, acc, UPCAST: tl.constexpr):
    """``acc + p @ v`` with every product exact: ``p`` (fp32) in three BF16 pieces, ``v`` BF16."""
    p1, p2, p3 = _pieces(p)
    acc = _dot(p1, v, acc, UPCAST)
    acc = _dot(p2, v, acc, UPCAST)
    return _dot(p3, v, acc, UPCAST)


@triton.jit
def _chunk_dsv4(
    q, rows_ptr, lane_base, idx_row, stride_lane, lo, hi, num_rows, sm_scale,
    BLOCK_H: tl.constexpr, LANES: tl.constexpr, UPCAST: tl.constexpr, LOWEST: tl.constexpr,
):  # fmt: skip
    """The online softmax of lanes ``[lo, hi)`` of one DSV4 index row, from an empty state: returns
    ``(m, l, acc [BLOCK_H, 512], bad)``. Lane ``j``'s key is row ``lane_base + j`` of the token's
    gathered rows (``rows_ptr``, 512 BF16 each), read only for a valid lane; it is the value too."""
    cols = tl.arange(0, 512)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, 512], tl.float32)
    bad = tl.zeros([], tl.int32)
    for start in range(lo, hi, LANES):
        valid, b = _lanes(idx_row, stride_lane, start, hi, num_rows, LANES)
        bad += b
        row = (lane_base + start + tl.arange(0, LANES)).to(tl.int64)
        k = tl.load(rows_ptr + row[:, None] * 512 + cols[None, :], mask=valid[:, None], other=0.0)
        s = _dot(q, tl.trans(k), tl.zeros([BLOCK_H, LANES], tl.float32), UPCAST)
        m_i, l_i, alpha, p = _softmax_step(s, valid, m_i, l_i, sm_scale, LOWEST)
        acc = _pv(p, k, acc * alpha[:, None], UPCAST)
    return m_i, l_i, acc, bad


@triton.jit
def _pv_group(p, alpha, acc, rows_ptr, scales_ptr, row, valid, g: tl.constexpr, UPCAST: tl.constexpr):
    """``alpha * acc + (p * scale_g) @ code_g`` for scale group ``g`` of the gathered DSV3.2 rows."""
    c = tl.arange(0, 128)
    code = tl.load(rows_ptr + row[:, None] * 576 + g * 128 + c[None, :], mask=valid[:, None], other=0.0)
    scale = tl.load(scales_ptr + row * 4 + g, mask=valid, other=0.0)
    return _pv(p * scale[None, :], code, acc * alpha[:, None], UPCAST)


@triton.jit
def _chunk_dsv32(
    q_rows, hmask, rows_ptr, scales_ptr, lane_base, idx_row, stride_lane, lo, hi, num_rows, sm_scale,
    BLOCK_H: tl.constexpr, LANES: tl.constexpr, UPCAST: tl.constexpr, LOWEST: tl.constexpr,
):  # fmt: skip
    """The online softmax of lanes ``[lo, hi)`` of one DSV3.2 index row, from an empty state: returns
    ``(m, l, acc0, acc1, acc2, acc3, bad)``, one ``[BLOCK_H, 128]`` accumulator per scale group.

    Lane ``j`` reads row ``lane_base + j`` of the token's gathered rows: 512 E4M3 codes as BF16
    (exact) and the 64 RoPE values (``rows_ptr``, 576 BF16 each), four fp32 scales
    (``scales_ptr``). A key is ``code * scale`` per 128-dim group plus the RoPE dims, so a score is
    ``sum_g scale_g * (q_g . code_g) + q_rope . rope``: the code products are exact BF16 products
    accumulated in fp32, then scaled. ``P V`` per group is ``(p * scale_g) @ code_g`` with
    ``p * scale_g`` (one fp32 rounding) in three BF16 pieces."""
    c = tl.arange(0, 128)
    r = tl.arange(0, 64)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc1 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc2 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc3 = tl.zeros([BLOCK_H, 128], tl.float32)
    bad = tl.zeros([], tl.int32)
    for start in range(lo, hi, LANES):
        valid, b = _lanes(idx_row, stride_lane, start, hi, num_rows, LANES)
        bad += b
        row = (lane_base + start + tl.arange(0, LANES)).to(tl.int64)
        rope = tl.load(rows_ptr + row[:, None] * 576 + 512 + r[None, :], mask=valid[:, None], other=0.0)
        q_rope = tl.load(q_rows + 512 + r[None, :], mask=hmask[:, None], other=0.0)
        s = _dot(q_rope, tl.trans(rope), tl.zeros([BLOCK_H, LANES], tl.float32), UPCAST)
        for g in tl.static_range(4):
            code = tl.load(rows_ptr + row[:, None] * 576 + g * 128 + c[None, :], mask=valid[:, None], other=0.0)
            scale = tl.load(scales_ptr + row * 4 + g, mask=valid, other=0.0)
            q_g = tl.load(q_rows + g * 128 + c[None, :], mask=hmask[:, None], other=0.0)
            s += _dot(q_g, tl.trans(code), tl.zeros([BLOCK_H, LANES], tl.float32), UPCAST) * scale[None, :]
        m_i, l_i, alpha, p = _softmax_step(s, valid, m_i, l_i, sm_scale, LOWEST)
        acc0 = _pv_group(p, alpha, acc0, rows_ptr, scales_ptr, row, valid, 0, UPCAST)
        acc1 = _pv_group(p, alpha, acc1, rows_ptr, scales_ptr, row, valid, 1, UPCAST)
        acc2 = _pv_group(p, alpha, acc2, rows_ptr, scales_ptr, row, valid, 2, UPCAST)
        acc3 = _pv_group(p, alpha, acc3, rows_ptr, scales_ptr, row, valid, 3, UPCAST)
    return m_i, l_i, acc0, acc1, acc2, acc3, bad


@triton.jit
def _merge_weights(m_run, l_run, m_c, l_c, LOWEST: tl.constexpr):
    """Fold a chunk's state ``(m_c, l_c)`` into the running ``(m_run, l_run)``: returns ``(m', l', wa,
    wb)``, the running accumulator to be scaled by ``wa`` and the chunk's by ``wb``. An empty chunk
    (``m_c = -inf``, ``l_c = 0``, accumulator 0) gives ``wb = 0`` and ``wa = 1`` (or 0 on an empty
    running state), so it changes nothing bit for bit."""
    m_new = tl.maximum(m_run, m_c)
    shift = tl.maximum(m_new, LOWEST)
    wa = tl.exp(m_run - shift)
    wb = tl.exp(m_c - shift)
    return m_new, tl.fma(l_run, wa, l_c * wb), wa, wb


@triton.jit
def _fold(acc_run, wa, acc_c, wb):
    """``acc_run * wa + acc_c * wb`` per row as one explicit ``fma(acc_run, wa, acc_c * wb)``, so the
    compiler cannot contract the expression one way in the unsplit kernel and another way in the
    combine kernel: both give the same bits."""
    return tl.fma(acc_run, wa[:, None], acc_c * wb[:, None])


@triton.jit
def _finish(m_i, l_i, sink):
    """``(factor, lse_e, nonempty)``: the output is ``acc * factor`` (``acc / l`` times
    ``sigmoid(lse - sink)``; 0 for an empty row), ``lse_e = m + log(l)`` (``-inf`` when empty)."""
    nonempty = l_i > 0
    lse_e = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    factor = tl.where(nonempty, 1.0 / (1.0 + tl.exp(sink - tl.where(nonempty, lse_e, 0.0))), 0.0)
    return factor / tl.where(nonempty, l_i, 1.0), lse_e, nonempty


@triton.jit
def _store_out(acc, factor, out_ptr, out32_ptr, o_row, f_row, col0, hmask, write_fp32, WIDTH: tl.constexpr):
    """Store ``acc * factor`` into output columns ``col0 .. col0 + WIDTH - 1``: BF16 bits rounded to
    nearest even, and the fp32 values when ``write_fp32``."""
    cols = col0 + tl.arange(0, WIDTH)
    out = acc * factor[:, None]
    tl.store(out_ptr + o_row + cols[None, :], _round_bf16_bits(out), mask=hmask[:, None])
    if write_fp32 != 0:
        tl.store(out32_ptr + f_row + cols[None, :], out, mask=hmask[:, None])


@triton.jit
def _store_lse(lse_ptr, lse_e, nonempty, sink, flashmla, lse_mult, heads, hmask):
    """FlashMLA LSE: ``lse_e`` (``+inf`` when empty); else FlashInfer's
    ``logaddexp(lse_e, sink) * lse_mult`` (``lse_mult = log2(e) * lse_scale``)."""
    top = tl.maximum(lse_e, sink)
    finite_top = (top != float("-inf")) & (top != float("inf"))
    safe_top = tl.where(finite_top, top, 0.0)
    mass = tl.where(finite_top, tl.exp(lse_e - safe_top) + tl.exp(sink - safe_top), 1.0)  # in [1, 2]
    lse_full = tl.where(sink == float("-inf"), lse_e, tl.where(finite_top, safe_top + tl.log(mass), top))
    lse_out = tl.where(flashmla != 0, tl.where(nonempty, lse_e, float("inf")), lse_full * lse_mult)
    tl.store(lse_ptr + heads, lse_out, mask=hmask)


@triton.jit
def _chunk_at(
    c, q, q_rows, hmask, t, main_chunks, length, xlength, rows_ptr, scales_ptr, lanes_total,
    idx_ptr, stride_it, stride_il, topk, num_main, xidx_ptr, stride_xt, stride_xl, num_extra, sm_scale,
    DSV4: tl.constexpr, BLOCK_H: tl.constexpr, LANES: tl.constexpr, CHUNK: tl.constexpr,
    UPCAST: tl.constexpr, LOWEST: tl.constexpr,
):  # fmt: skip
    """Chunk ``c`` of token ``t``'s candidates: chunks ``0 .. main_chunks - 1`` are ``CHUNK``-lane spans
    of the main index row, the rest of the extra row (gathered after the main lanes); lanes at or
    past the row's valid length are left out. DSV4: ``(m, l, acc, acc, acc, acc, bad)`` (the
    accumulator repeated); DSV3.2: ``(m, l, acc0, acc1, acc2, acc3, bad)``."""
    main = c < main_chunks
    lo = tl.where(main, c, c - main_chunks) * CHUNK
    hi = tl.minimum(lo + CHUNK, tl.where(main, length, xlength))
    idx_row = tl.where(main, idx_ptr + t * stride_it, xidx_ptr + t * stride_xt)
    stride_lane = tl.where(main, stride_il, stride_xl)
    num_rows = tl.where(main, num_main, num_extra)
    lane_base = t * lanes_total + tl.where(main, 0, topk)
    if DSV4:
        m_i, l_i, acc, bad = _chunk_dsv4(
            q, rows_ptr, lane_base, idx_row, stride_lane, lo, hi, num_rows, sm_scale, BLOCK_H, LANES, UPCAST, LOWEST
        )
        return m_i, l_i, acc, acc, acc, acc, bad
    else:
        return _chunk_dsv32(
            q_rows, hmask, rows_ptr, scales_ptr, lane_base, idx_row, stride_lane, lo, hi, num_rows, sm_scale,
            BLOCK_H, LANES, UPCAST, LOWEST,
        )  # fmt: skip


#: Scalar arguments whose values Triton must not specialize on (divisible by 16, equal to 1): counts,
#: flags and row strides that change from call to call; each specialization is one more compile
#: (the strides of the query and output rows stay specialized: they let loads and stores vectorize).
_COUNTS = ("num_heads", "head_groups", "topk", "extra_topk", "main_chunks", "num_chunks", "num_main", "num_extra",
           "has_len", "has_xlen", "has_sink", "write_fp32", "flashmla", "stride_it", "stride_xt", "stride_len",
           "stride_xlen", "stride_sink", "stride_lt", "num_out", "lanes_total")  # fmt: skip


def _jit(fn):  # type: ignore[no-untyped-def]
    """``triton.jit`` without specialization on the :data:`_COUNTS` arguments ``fn`` takes."""
    names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    return triton.jit(do_not_specialize=[n for n in _COUNTS if n in names])(fn)


@_jit
def _attention_kernel(
    q_ptr, rows_ptr, scales_ptr, idx_ptr, len_ptr, xidx_ptr, xlen_ptr, sink_ptr,
    out_ptr, out32_ptr, lse_ptr, bad_ptr, part_ptr, part_ml_ptr, part_bad_ptr,
    num_heads, head_groups, topk, extra_topk, main_chunks, num_chunks, num_main, num_extra,
    has_len, has_xlen, has_sink, write_fp32, flashmla, lse_mult, sm_scale,
    stride_qt, stride_qh, stride_it, stride_il, stride_xt, stride_xl, stride_len, stride_xlen, stride_sink,
    stride_ot, stride_oh, stride_ft, stride_fh, stride_lt,
    DSV4: tl.constexpr, BLOCK_H: tl.constexpr, LANES: tl.constexpr, CHUNK: tl.constexpr, SPLIT: tl.constexpr,
    UPCAST: tl.constexpr, LOWEST: tl.constexpr,
):  # fmt: skip
    """One program per (token, head group), or with ``SPLIT`` per (token, chunk, head group), head
    group fastest (neighbours share their rows in L2). Unsplit: every chunk from an empty state,
    folded in order into the running state (:func:`_merge_weights`), then finalised. Split: the
    chunk's state stored into the partial buffers for :func:`_combine_kernel`, which folds them the
    same way."""
    pid = tl.program_id(0)
    hg = pid % head_groups
    rest = pid // head_groups
    if SPLIT:
        t = (rest // num_chunks).to(tl.int64)
    else:
        t = rest.to(tl.int64)
    heads = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    q_rows = q_ptr + t * stride_qt + heads.to(tl.int64)[:, None] * stride_qh
    if DSV4:
        q = tl.load(q_rows + tl.arange(0, 512)[None, :], mask=hmask[:, None], other=0.0)
    else:
        q = tl.zeros([BLOCK_H, 16], tl.bfloat16)  # unused: DSV3.2 reads its query chunks per tile
    length = tl.load(len_ptr + t * stride_len, mask=has_len != 0, other=topk)
    length = tl.minimum(tl.maximum(length, 0), topk)
    xlength = tl.load(xlen_ptr + t * stride_xlen, mask=has_xlen != 0, other=extra_topk)
    xlength = tl.minimum(tl.maximum(xlength, 0), extra_topk)
    if SPLIT:
        c = rest % num_chunks
        m_i, l_i, a0, a1, a2, a3, bad = _chunk_at(
            c, q, q_rows, hmask, t, main_chunks, length, xlength, rows_ptr, scales_ptr, topk + extra_topk,
            idx_ptr, stride_it, stride_il, topk, num_main, xidx_ptr, stride_xt, stride_xl, num_extra, sm_scale,
            DSV4, BLOCK_H, LANES, CHUNK, UPCAST, LOWEST,
        )  # fmt: skip
        slot = t * num_chunks + c
        p_row = part_ptr + (slot * num_heads + heads.to(tl.int64))[:, None] * 512
        if DSV4:
            tl.store(p_row + tl.arange(0, 512)[None, :], a0, mask=hmask[:, None])
        else:
            cols = tl.arange(0, 128)[None, :]
            tl.store(p_row + cols, a0, mask=hmask[:, None])
            tl.store(p_row + 128 + cols, a1, mask=hmask[:, None])
            tl.store(p_row + 256 + cols, a2, mask=hmask[:, None])
            tl.store(p_row + 384 + cols, a3, mask=hmask[:, None])
        tl.store(part_ml_ptr + slot * 2 * num_heads + heads, m_i, mask=hmask)
        tl.store(part_ml_ptr + (slot * 2 + 1) * num_heads + heads, l_i, mask=hmask)
        if hg == 0:
            tl.store(part_bad_ptr + slot, bad)
    else:
        m_run = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_run = tl.zeros([BLOCK_H], tl.float32)
        bad_run = tl.zeros([], tl.int32)
        if DSV4:
            r0 = tl.zeros([BLOCK_H, 512], tl.float32)
            r1 = r0
            r2 = r0
            r3 = r0
        else:
            r0 = tl.zeros([BLOCK_H, 128], tl.float32)
            r1 = r0
            r2 = r0
            r3 = r0
        for c in range(0, num_chunks):
            m_i, l_i, a0, a1, a2, a3, bad = _chunk_at(
                c, q, q_rows, hmask, t, main_chunks, length, xlength, rows_ptr, scales_ptr, topk + extra_topk,
                idx_ptr, stride_it, stride_il, topk, num_main, xidx_ptr, stride_xt, stride_xl, num_extra, sm_scale,
                DSV4, BLOCK_H, LANES, CHUNK, UPCAST, LOWEST,
            )  # fmt: skip
            m_run, l_run, wa, wb = _merge_weights(m_run, l_run, m_i, l_i, LOWEST)
            r0 = _fold(r0, wa, a0, wb)
            if not DSV4:
                r1 = _fold(r1, wa, a1, wb)
                r2 = _fold(r2, wa, a2, wb)
                r3 = _fold(r3, wa, a3, wb)
            bad_run += bad
        sink = tl.load(sink_ptr + heads * stride_sink, mask=hmask, other=float("-inf"))
        sink = tl.where(has_sink != 0, sink, float("-inf"))  # no sink: any fp32 [H] buffer, unused
        factor, lse_e, nonempty = _finish(m_run, l_run, sink)
        o_row = t * stride_ot + heads.to(tl.int64)[:, None] * stride_oh
        f_row = t * stride_ft + heads.to(tl.int64)[:, None] * stride_fh
        if DSV4:
            _store_out(r0, factor, out_ptr, out32_ptr, o_row, f_row, 0, hmask, write_fp32, 512)
        else:
            _store_out(r0, factor, out_ptr, out32_ptr, o_row, f_row, 0, hmask, write_fp32, 128)
            _store_out(r1, factor, out_ptr, out32_ptr, o_row, f_row, 128, hmask, write_fp32, 128)
            _store_out(r2, factor, out_ptr, out32_ptr, o_row, f_row, 256, hmask, write_fp32, 128)
            _store_out(r3, factor, out_ptr, out32_ptr, o_row, f_row, 384, hmask, write_fp32, 128)
        _store_lse(lse_ptr + t * stride_lt, lse_e, nonempty, sink, flashmla, lse_mult, heads, hmask)
        if hg == 0:
            tl.store(bad_ptr + t, bad_run)


@_jit
def _combine_kernel(
    sink_ptr, out_ptr, out32_ptr, lse_ptr, bad_ptr, part_ptr, part_ml_ptr, part_bad_ptr,
    num_heads, head_groups, num_chunks, has_sink, write_fp32, flashmla, lse_mult,
    stride_sink, stride_ot, stride_oh, stride_ft, stride_fh, stride_lt,
    BLOCK_H: tl.constexpr, LOWEST: tl.constexpr,
):  # fmt: skip
    """The split forward's second launch: one program per (token, head group) folds the token's
    chunk states in chunk order with the unsplit kernel's arithmetic and finalises."""
    pid = tl.program_id(0)
    hg = pid % head_groups
    t = (pid // head_groups).to(tl.int64)
    heads = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    cols = tl.arange(0, 512)
    m_run = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_H], tl.float32)
    r0 = tl.zeros([BLOCK_H, 512], tl.float32)
    bad_run = tl.zeros([], tl.int32)
    for c in range(0, num_chunks):
        slot = t * num_chunks + c
        m_i = tl.load(part_ml_ptr + slot * 2 * num_heads + heads, mask=hmask, other=float("-inf"))
        l_i = tl.load(part_ml_ptr + (slot * 2 + 1) * num_heads + heads, mask=hmask, other=0.0)
        a0 = tl.load(part_ptr + (slot * num_heads + heads.to(tl.int64))[:, None] * 512 + cols[None, :],
                     mask=hmask[:, None], other=0.0)  # fmt: skip
        m_run, l_run, wa, wb = _merge_weights(m_run, l_run, m_i, l_i, LOWEST)
        r0 = _fold(r0, wa, a0, wb)
        bad_run += tl.load(part_bad_ptr + slot)
    sink = tl.load(sink_ptr + heads * stride_sink, mask=hmask, other=float("-inf"))
    sink = tl.where(has_sink != 0, sink, float("-inf"))  # no sink: any fp32 [H] buffer, unused
    factor, lse_e, nonempty = _finish(m_run, l_run, sink)
    o_row = t * stride_ot + heads.to(tl.int64)[:, None] * stride_oh
    f_row = t * stride_ft + heads.to(tl.int64)[:, None] * stride_fh
    _store_out(r0, factor, out_ptr, out32_ptr, o_row, f_row, 0, hmask, write_fp32, 512)
    _store_lse(lse_ptr + t * stride_lt, lse_e, nonempty, sink, flashmla, lse_mult, heads, hmask)
    if hg == 0:
        tl.store(bad_ptr + t, bad_run)


_NO_CACHE = CacheGeometry(0, 1, 16, 0, 0, 0, 0)


@_jit
def _gather_kernel(
    rows_ptr, scales_ptr, num_out, lanes_total, topk, rope_offset,
    kv_ptr, idx_ptr, len_ptr, num_main, ps, page_stride, row_stride, scale_base, scale_stride,
    xkv_ptr, xidx_ptr, xlen_ptr, num_extra, xps, xpage_stride, xrow_stride, xscale_base, xscale_stride,
    has_len, has_xlen, extra_topk, stride_it, stride_il, stride_xt, stride_xl, stride_len, stride_xlen,
    DSV4: tl.constexpr, ROWS: tl.constexpr, HW_FP8: tl.constexpr,
):  # fmt: skip
    """Gather the candidates of a block of tokens, dequantized, into rows of BF16 (exactly
    ``formats.unpack_dequantize``): output row ``t * lanes_total + j`` is lane ``j`` of token ``t``
    (main lanes ``0 .. topk - 1``, then the extra lanes). DSV4: the 512 values; DSV3.2: the 512
    E4M3 codes as BF16 and the 64 RoPE values, with the four fp32 scales in ``scales_ptr``. Only
    valid lanes (index ``>= 0`` and below the cache's token count, position before the row's
    length) are read and written; the attention kernel reads only those."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    inside = r < num_out
    t = r // lanes_total
    j = r - t * lanes_total
    main = j < topk
    xj = j - topk
    idx = tl.load(idx_ptr + t * stride_it + j * stride_il, mask=inside & main, other=-1)
    xidx = tl.load(xidx_ptr + t * stride_xt + xj * stride_xl, mask=inside & (xj >= 0), other=-1)
    length = tl.load(len_ptr + t * stride_len, mask=inside, other=0)
    length = tl.where(has_len != 0, length, topk)
    xlength = tl.load(xlen_ptr + t * stride_xlen, mask=inside, other=0)
    xlength = tl.where(has_xlen != 0, xlength, extra_topk)
    main_ok = (idx >= 0) & (idx < num_main) & (j < length)
    valid = tl.where(main, main_ok, (xidx >= 0) & (xidx < num_extra) & (xj < xlength)) & inside
    flat = tl.where(valid, tl.where(main, idx, xidx), 0).to(tl.int64)
    m_off, m_soff = _row_offsets(flat, ps, page_stride, row_stride, scale_base, scale_stride)
    x_off, x_soff = _row_offsets(flat, xps, xpage_stride, xrow_stride, xscale_base, xscale_stride)
    row_ptr = tl.where(main, kv_ptr + m_off, xkv_ptr + x_off)
    scale_ptr = tl.where(main, kv_ptr + m_soff, xkv_ptr + x_soff)
    out = r.to(tl.int64)
    if DSV4:
        k = _dsv4_rows(row_ptr, scale_ptr, valid, rope_offset, HW_FP8)
        dims = (tl.arange(0, 8) * 64)[:, None] + tl.arange(0, 64)[None, :]
        tl.store(rows_ptr + out[:, None, None] * 512 + dims[None, :, :], k, mask=valid[:, None, None])
    else:
        dst = rows_ptr + out[:, None] * 576
        for g in tl.static_range(4):
            code, scale = _dsv32_group(row_ptr, scale_ptr, valid, g, HW_FP8)
            tl.store(dst + g * 128 + tl.arange(0, 128)[None, :], code, mask=valid[:, None])
            tl.store(scales_ptr + out * 4 + g, scale, mask=valid)
        c = tl.arange(0, 64)
        rope = tl.load((row_ptr + rope_offset).to(tl.pointer_type(tl.bfloat16))[:, None] + c[None, :],
                       mask=valid[:, None], other=0.0)  # fmt: skip
        tl.store(dst + 512 + c[None, :], rope, mask=valid[:, None])


def _gather(
    kv_cache: torch.Tensor, g: CacheGeometry, indices: torch.Tensor, topk_length: torch.Tensor | None,
    extra_kv_cache: torch.Tensor, x: CacheGeometry, extra_indices: torch.Tensor,
    extra_topk_length: torch.Tensor | None, extra_topk: int, dsv4: bool, rows: torch.Tensor, scales: torch.Tensor,
) -> None:  # fmt: skip
    """One launch of :func:`_gather_kernel` for the tokens of ``indices`` into ``rows`` / ``scales``."""
    num_tokens, topk = int(indices.shape[0]), int(indices.shape[1])
    num_out = num_tokens * (topk + extra_topk)
    dummy = indices
    _gather_kernel[(triton.cdiv(num_out, _GATHER_ROWS),)](
        rows, scales, num_out, topk + extra_topk, topk, g.rope_offset,
        kv_cache, indices, topk_length if topk_length is not None else dummy, g.num_tokens, g.page_block_size,
        g.page_stride, g.row_stride, g.scale_base, g.scale_stride,
        extra_kv_cache, extra_indices, extra_topk_length if extra_topk_length is not None else dummy, x.num_tokens,
        x.page_block_size, x.page_stride, x.row_stride, x.scale_base, x.scale_stride,
        int(topk_length is not None), int(extra_topk_length is not None), extra_topk,
        indices.stride(0), indices.stride(1), extra_indices.stride(0), extra_indices.stride(1),
        topk_length.stride(0) if topk_length is not None else 0,
        extra_topk_length.stride(0) if extra_topk_length is not None else 0,
        DSV4=dsv4, ROWS=_GATHER_ROWS, HW_FP8=not INTERPRETED, num_warps=8,
    )  # fmt: skip


def reads_records_in_torch(f: object) -> bool:
    """Whether the candidates of a cache of record format ``f`` (a ``formats.PackedFormat``) are
    gathered by :func:`gather_records` (torch operations) rather than :func:`_gather_kernel`:
    ``formats.PackedFormat.bf16_rows`` (the DeepSeek-V4.1 records)."""
    return bool(f.bf16_rows)  # type: ignore[attr-defined]


#: Lanes a step of :func:`gather_records` dequantizes at once (its fp32 temporaries, about 6 KiB a
#: lane, stay below 200 MiB).
_RECORD_LANES = 32768


def _dequantize_records(records: torch.Tensor, f: object) -> torch.Tensor:
    """``[n, 512]`` fp32: the records ``[n, bytes_per_token]`` (uint8) of a V4.1 record format
    dequantized, the same values as ``formats.unpack_dequantize``: ``e4m3(code) * 2**(byte - 127)``
    (SWA) or ``e2m1(code) * e4m3(scale)`` (indexed; E2M1 decoded arithmetically, exactly the values
    of ``formats.E2M1_VALUES`` with code 8 as ``-0.0``, so nothing is copied from the host and the
    call stays capturable in a CUDA graph)."""
    n = int(records.shape[0])
    code_end = f.code_bytes_per_token  # type: ignore[attr-defined]
    num_scales, group = f.num_scales, f.group_size  # type: ignore[attr-defined]
    codes = records[:, :code_end]
    scale_bytes = records[:, code_end : code_end + f.scale_bytes_per_token]  # type: ignore[attr-defined]
    if f.code == "e2m1":  # type: ignore[attr-defined]
        nibbles = torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(n, 512)
        mag = (nibbles & 7).to(torch.float32)  # 0..7 -> 0, .5, 1, 1.5 | 2, 3 | 4, 6 (exact)
        value = torch.where(mag < 4, mag * 0.5, torch.where(mag < 6, mag - 2, (mag - 4) * 2))
        value = torch.where(nibbles >= 8, -value, value)
    else:
        value = codes.contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    if f.scale_kind == "ue8m0":  # type: ignore[attr-defined]
        exponents = scale_bytes[:, :num_scales].to(torch.int32) - 127
        scale = torch.ldexp(torch.ones_like(exponents, dtype=torch.float32), exponents)
    else:  # e4m3
        scale = scale_bytes.contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    return (value.reshape(n, num_scales, group) * scale.unsqueeze(-1)).reshape(n, 512)


def gather_records(
    cache: torch.Tensor, layout: object, indices: torch.Tensor, out: torch.Tensor
) -> None:
    """Write lane ``j`` of token ``t`` of ``indices`` (``[n, topk]``), dequantized, into ``out[t, j]``
    (``[n, topk, 512]`` BF16, exact: :func:`reads_records_in_torch`), for a cache of V4.1 records
    with its ``formats.CacheLayout``. A lane whose index is negative or past the cache gets a zero
    row (no byte of it is read); the lengths are not looked at (the attention kernel decides
    validity itself and reads only valid lanes). Batched torch operations, in steps of at most
    :data:`_RECORD_LANES` lanes; no host synchronisation."""
    from pytest_sparse_mla import formats

    f = layout.fmt  # type: ignore[attr-defined]
    ps = int(layout.page_block_size)  # type: ignore[attr-defined]
    num_slots = int(layout.num_tokens)  # type: ignore[attr-defined]
    pages = formats.page_bytes_view(cache, layout)  # type: ignore[arg-type]
    tokens = pages.reshape(pages.shape[0], ps, int(layout.token_stride))[..., : f.bytes_per_token]  # type: ignore[attr-defined]
    n, topk = int(indices.shape[0]), int(indices.shape[1])
    if n == 0 or topk == 0:
        return
    step = max(1, _RECORD_LANES // topk)
    for t0 in range(0, n, step):
        t1 = min(n, t0 + step)
        idx = indices[t0:t1].to(torch.int64)
        ok = (idx >= 0) & (idx < num_slots)
        flat = torch.where(ok, idx, 0).reshape(-1)
        records = tokens[flat // ps, flat % ps]  # [lanes, bytes_per_token]
        values = _dequantize_records(records, f).masked_fill_(~ok.reshape(-1, 1), 0.0)
        out[t0:t1].copy_(values.view(t1 - t0, topk, 512))


def gather_rows(kv_cache: torch.Tensor, geometry: CacheGeometry, rows: torch.Tensor, dsv4: bool) -> torch.Tensor:
    """Tokens of a packed cache dequantized by the forward's own gather kernel (for self-tests).

    Args:
        kv_cache: the packed uint8 cache (any accepted form; its data pointer and ``geometry``).
        geometry: :func:`cache_geometry` of its layout.
        rows: ``[n]`` int32 flat token indices; a negative index or one past the cache is an
            invalid lane (nothing read, a zero row).
        dsv4: DSV4 footer layout (``[n, 512]``) or DSV3.2 inline (``[n, 576]``: the gathered codes
            times their fp32 scale per 128-dim group, rounded once in fp32, then the RoPE values).

    Returns:
        ``[n, d_qk]`` fp32; each valid row equals ``formats.unpack_dequantize`` of its token.
    """
    n = int(rows.numel())
    d_qk = 512 if dsv4 else 576
    out = torch.zeros((n, d_qk), dtype=torch.bfloat16, device=kv_cache.device)
    scales = torch.zeros((n, 4), dtype=torch.float32, device=kv_cache.device)
    idx = rows.to(torch.int32).reshape(1, n)
    _gather(kv_cache, geometry, idx, None, kv_cache, _NO_CACHE, idx, None, 0, dsv4, out, scales)
    values = out.float()
    if not dsv4:
        values[:, :512] = (values[:, :512].view(n, 4, 128) * scales[:, :, None]).view(n, 512)
    return values


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (0 elsewhere: the interpreter never splits)."""
    if device.type != "cuda" or INTERPRETED:
        return 0
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def split_chunks(num_tokens: int, head_groups: int, num_chunks: int, device: torch.device) -> bool:
    """Whether a call runs split (one program per chunk, then :func:`_combine_kernel`): when it has
    more than one chunk and fewer than :data:`SPLIT_BELOW_WAVES` waves of unsplit programs. A shape
    decision only (a call can be captured in a CUDA graph), and either way gives the same bits."""
    return num_chunks > 1 and num_tokens * head_groups < SPLIT_BELOW_WAVES * _sm_count(device)


def sparse_mla(
    call: SparseMlaCall,
    *,
    output: torch.Tensor,
    lse: torch.Tensor,
    output_fp32: torch.Tensor | None,
    out_of_range: torch.Tensor,
    config: tuple[int, int, int, int] | None = None,
    split: bool | None = None,
) -> None:
    """Run the forward of a read call (one launch, or two when split), writing ``output``, ``lse``,
    ``output_fp32`` (if given) and ``out_of_range``. No host synchronisation; the call is trusted
    (the caller, ``attention.reference.sparse_mla_forward``, has read it with ``validate=True``).

    Args:
        call: the ``attention.call.SparseMlaCall``, DSV4 (footer layout: UE8M0 scales, ``V`` = the
            whole 512-dim row) or DSV3.2 (inline: fp32 scales, ``V`` = the 512 NoPE dims): ``q``
            ``[T, H, d_qk]`` BF16 (copied when its last dim is strided); each cache's data pointer
            with its layout (:func:`cache_geometry`); ``[T, topk]`` int32 index rows (any strides);
            ``[T]`` int32 lengths or ``None``; ``[H]`` fp32 sink or ``None``; ``sm_scale``; the LSE
            convention: ``"flashmla"`` (natural log without the sink, ``+inf`` when empty) or
            ``"flashinfer"`` (``logaddexp(lse, sink) * log2(e) * lse_scale``).
        output: ``[T, H, 512]`` BF16; lse: ``[T, H]`` fp32; output_fp32: ``[T, H, 512]`` fp32 or
            ``None``; each with unit last-dim stride.
        out_of_range: ``[T]`` int32, contiguous: per token, the number of lanes inside the valid
            prefix whose index is past its cache (those lanes are skipped).
        config: ``(head_group, num_warps, num_stages, chunk)``; default :data:`DEFAULT_CONFIG` of the
            format. Every shape of one format runs one config (the bitwise invariants compare calls
            of different shapes).
        split: force the split (``True``) or the unsplit (``False``) launch; default
            :func:`split_chunks`. Both give the same bits.
    """
    main, extra = call.main, call.extra
    # DSV4 footer records and V4.1 records (gathered by torch operations) are attended alike: rows
    # of 512 BF16 values, V = K.
    records = reads_records_in_torch(main.layout.fmt)
    dsv4 = main.layout.fmt.layout == "footer" or records
    flashmla_lse = call.lse_convention == "flashmla"
    lse_multiplier = _LOG2E * call.lse_scale
    sm_scale, attn_sink = call.sm_scale, call.attn_sink
    q = call.q if call.q.stride(2) == 1 else call.q.contiguous()  # query rows are read with unit stride
    block_h, num_warps, num_stages, chunk = config or DEFAULT_CONFIG[dsv4]
    num_tokens, num_heads, _ = (int(v) for v in q.shape)
    if num_tokens == 0:
        return
    g = _NO_CACHE if records else cache_geometry(main.layout)
    kv_cache, indices, topk = main.cache, main.indices, main.topk
    if extra is None:
        extra_kv_cache, extra_indices, extra_topk, x = kv_cache, indices, 0, _NO_CACHE
    else:
        extra_kv_cache, extra_indices, extra_topk = extra.cache, extra.indices, extra.topk
        x = _NO_CACHE if records else cache_geometry(extra.layout)
    num_main = min(int(main.layout.num_tokens), _INT32_MAX)
    num_extra = min(int(extra.layout.num_tokens), _INT32_MAX) if extra is not None else 0
    lanes_total = topk + extra_topk
    main_chunks = triton.cdiv(topk, chunk)
    num_chunks = main_chunks + triton.cdiv(extra_topk, chunk)
    head_groups = triton.cdiv(num_heads, block_h)
    d_row = 512 if dsv4 else 576
    block = max(1, min(num_tokens, _GATHER_BYTES // max(1, lanes_total * (2 * d_row + 16))))
    rows = torch.empty((block * lanes_total, d_row), dtype=torch.bfloat16, device=q.device)
    scales = rows if dsv4 else torch.empty((block * lanes_total, 4), dtype=torch.float32, device=q.device)
    out16 = output.view(torch.int16)
    fp32 = output_fp32 if output_fp32 is not None else lse  # fp32 either way: one compiled variant
    sink = attn_sink if attn_sink is not None else lse  # no sink: any fp32 buffer, never read
    for t0 in range(0, num_tokens, block):
        t1 = min(num_tokens, t0 + block)
        n = t1 - t0
        length = main.topk_length[t0:t1] if main.topk_length is not None else None
        xlength = extra.topk_length[t0:t1] if extra is not None and extra.topk_length is not None else None
        if records:  # V4.1: torch operations, the same rows as the gather kernel would write
            lanes = rows[: n * lanes_total].view(n, lanes_total, 512)
            gather_records(kv_cache, main.layout, indices[t0:t1], lanes[:, :topk])
            if extra is not None:
                gather_records(extra_kv_cache, extra.layout, extra_indices[t0:t1], lanes[:, topk:])
        else:
            _gather(kv_cache, g, indices[t0:t1], length, extra_kv_cache, x, extra_indices[t0:t1], xlength,
                    extra_topk, dsv4, rows, scales)  # fmt: skip
        _attend(
            q[t0:t1], rows, scales, indices[t0:t1], length, extra_indices[t0:t1], xlength, sink,
            attn_sink is not None, out16[t0:t1], fp32[t0:t1], lse[t0:t1], out_of_range[t0:t1],
            output_fp32 is not None, n, num_heads, head_groups, topk, extra_topk, main_chunks, num_chunks,
            num_main, num_extra, flashmla_lse, lse_multiplier, sm_scale, dsv4, block_h, num_warps, num_stages,
            chunk, split,
        )  # fmt: skip


def _attend(
    q, rows, scales, indices, length, extra_indices, xlength, sink, has_sink, out16, fp32, lse, out_of_range,
    write_fp32, num_tokens, num_heads, head_groups, topk, extra_topk, main_chunks, num_chunks, num_main,
    num_extra, flashmla_lse, lse_multiplier, sm_scale, dsv4, block_h, num_warps, num_stages, chunk, split,
):  # type: ignore[no-untyped-def]  # fmt: skip
    """The attention launch (and the combine launch when split) for one block of tokens."""
    if split is None:
        split = split_chunks(num_tokens, head_groups, num_chunks, q.device)
    if split:
        part = torch.empty((num_tokens, num_chunks, num_heads, 512), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((num_tokens, num_chunks, 2, num_heads), dtype=torch.float32, device=q.device)
        part_bad = torch.empty((num_tokens, num_chunks), dtype=torch.int32, device=q.device)
    else:
        part, part_ml, part_bad = lse, lse, out_of_range  # unused
    dummy = out_of_range
    _attention_kernel[(num_tokens * head_groups * (num_chunks if split else 1),)](
        q, rows, scales, indices, length if length is not None else dummy,
        extra_indices, xlength if xlength is not None else dummy, sink,
        out16, fp32, lse, out_of_range, part, part_ml, part_bad,
        num_heads, head_groups, topk, extra_topk, main_chunks, num_chunks, num_main, num_extra,
        int(length is not None), int(xlength is not None), int(has_sink), int(write_fp32), int(flashmla_lse),
        float(lse_multiplier), float(sm_scale),
        q.stride(0), q.stride(1), indices.stride(0), indices.stride(1),
        extra_indices.stride(0), extra_indices.stride(1),
        length.stride(0) if length is not None else 0, xlength.stride(0) if xlength is not None else 0,
        sink.stride(0) if has_sink else 0,
        out16.stride(0), out16.stride(1), fp32.stride(0), fp32.stride(1), lse.stride(0),
        DSV4=dsv4, BLOCK_H=block_h, LANES=LANE_TILE, CHUNK=chunk, SPLIT=split, UPCAST=INTERPRETED,
        LOWEST=_FP32_LOWEST, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if split:
        _combine_kernel[(num_tokens * head_groups,)](
            sink, out16, fp32, lse, out_of_range, part, part_ml, part_bad,
            num_heads, head_groups, num_chunks, int(has_sink), int(write_fp32), int(flashmla_lse),
            float(lse_multiplier), sink.stride(0) if has_sink else 0,
            out16.stride(0), out16.stride(1), fp32.stride(0), fp32.stride(1), lse.stride(0),
            BLOCK_H=block_h, LOWEST=_FP32_LOWEST, num_warps=num_warps,
        )  # fmt: skip
