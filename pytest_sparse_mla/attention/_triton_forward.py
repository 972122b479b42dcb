"""Triton inner loop of the bundled reference sparse-MLA forward (``backend="triton"``).

Import this module through ``attention.reference.triton_forward_module`` (``sparse_mla_forward``
does), which sets ``TRITON_INTERPRET=1`` first when no CUDA device exists; Triton decides at
decoration time whether a kernel is compiled or interpreted (triton ``runtime/jit.py`` ``jit``).

Only the online-softmax loop lives here. ``attention.reference`` prepares everything else and
shares it with the torch path: the dequantized fp32 table with its shared all-zero row, the table
row of every candidate lane (invalid lanes name the zero row; the main row and the extra row each
padded to a multiple of :data:`LANE_TILE` = 64), and the finalisation (divide, sink, LSE).

Arithmetic: fp32 results from BF16 tensor cores with exact products (:func:`bf16_pieces`).

* Queries are BF16. A DSV4 key/value element is an E4M3 code (4 significant bits) times a UE8M0
  power-of-two scale, or a BF16 RoPE value, so every table value is exactly a BF16 number (8
  significant bits, the fp32 exponent range) and :func:`bf16_pieces` returns the table as one BF16
  piece; a DSV3.2 NoPE value (E4M3 times an arbitrary fp32 scale) is split into three BF16 pieces
  ``hi + mid + lo`` (24 significant bits: the fp32 value, within 2**-24 relative).
* Scores ``s = sm_scale * sum_pieces q @ K_piece^T``: BF16 x BF16 products are exact; the tensor
  cores accumulate them in fp32.
* The fp32 probabilities are split into three BF16 pieces, ``p = p1 + p2 + p3`` exactly: ``p1`` is
  ``p`` with its low 16 bits cleared, ``p2`` the same cut of ``p - p1``, ``p3`` the rest (8
  significant bits each; below 2**-126 the last piece drops bits under 2**-133), and
  ``acc += p1 @ V + p2 @ V + p3 @ V`` (DSV3.2: the six piece products of total order <= 2).
  So every product computed is exact and only the fp32 accumulation rounds (the DSV3.2 pieces and
  products left out are below 2**-24 relative): measured on an H200 at
  T=4096/H=64/topk 128+512, the fp32 output is within 4.2e-8 absolute and 2.0e-6 relative (norm)
  of the float64 oracle and the LSE within 1.5e-7 relative (``docs/benchmarks.md``), against the
  1e-5 target; on ``distribution="wide"`` data 1.2e-6 relative (norm), against 7.6e-7 for the
  torch backend. The one-chain fp32 accumulation of 512-term dots costs a factor 1-2 over the
  torch backend's fp32 GEMMs on the GPU (and 3-5 in the CPU interpreter, whose float32 matmul
  sums 512 terms in one chain). DSV4 values off BF16's subnormal grid (steps of 2**-133; only from UE8M0 scale
  bytes 0-2, scales under 2**-124, which no packer rule writes) are rounded to it.

Kernel (:func:`online_softmax`): one program per (token, group of :data:`HEAD_GROUP` = 16 heads,
output slice of ``dv_block`` value dims). Heads past ``num_heads`` load zero queries and are never
stored. The program walks the token's lanes in tiles of 64 (fixed, independent of topk). DSV4
(one piece, ``d_qk == d_v``): it holds its queries, and each gathered 64 x 512 key tile is loaded
once and is the value tile too (``V = K``). DSV3.2 (RoPE dims past ``d_v``, or three pieces): the
scores are summed over 64-dim chunks and the value pieces are loaded one at a time, so shared
memory stays bounded (and the loop is not software-pipelined). In both:

* a lane is valid iff its table row is not the zero row; masked lanes get score ``-inf``;
* fp32 online softmax in natural-log units: ``m' = max(m, max s)``, shift ``max(m', fp32 lowest)``
  (so a row with no valid lane yet never computes ``-inf - -inf``), ``alpha = exp(m - shift)``,
  ``p = exp(s - shift)``, ``l = alpha l + sum p``, ``acc = alpha acc + p @ V``;
* a tile with no valid lane gives ``m' = m``, ``alpha = exp(0) = 1`` and ``p = 0`` exactly (all
  pieces zero) and reads only zero rows, so it adds exact zeros: ``m``, ``l`` and ``acc`` stay
  bit-for-bit unchanged and padding an index row with ``-1`` changes nothing;
* every block shape is a constant, so a head's arithmetic is the same whatever ``num_heads`` is
  (head-count independence holds by construction: each output row of a tensor-core product reads
  only its own query row and ``p`` row).

It writes ``run_max``/``run_sum`` ``[T, H]`` and the unnormalised ``acc`` ``[T, H, d_v]`` (fp32).
With ``dv_block < d_v`` the scores are recomputed per slice (same order, same bits).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["HEAD_GROUP", "LANE_TILE", "INTERPRETED", "DEFAULT_CONFIG", "bf16_pieces", "online_softmax"]

#: Heads per program of the shipped kernel (a constant: never derived from ``num_heads``).
HEAD_GROUP = 16
#: Candidate lanes per tile (FlashInfer's DSV4 candidate tile ``BI``).
LANE_TILE = 64
#: Dims per score chunk of the unfused (DSV3.2) path (divides 512 and 576).
_D_CHUNK = 64
#: True when this module's kernel was decorated under ``TRITON_INTERPRET=1`` (CPU tensors).
INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"
#: ``(head_group, dv_block, num_warps, num_stages)`` of the shipped kernel; fixed for every shape,
#: since the bitwise invariants compare calls of different shapes. ``_SPARSE_MLA_ATTN_CONFIG``
#: (four comma-separated ints, read at import) overrides it for tuning runs only
#: (``benchmarks/tune_attention.py``).
_h, _dv, _w, _s = (int(v) for v in os.environ.get("_SPARSE_MLA_ATTN_CONFIG", f"{HEAD_GROUP},512,4,2").split(","))
DEFAULT_CONFIG: tuple[int, int, int, int] = (_h, _dv, _w, _s)
_FP32_LOWEST = float(torch.finfo(torch.float32).min)


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b`` on bf16 tensor cores; with ``UPCAST`` (the CPU interpreter, whose bf16 dot is
    wrong) the same products in fp32 (bf16 x bf16 products are exact in fp32)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _online_softmax_kernel(
    q_ptr,
    k_ptr,
    rows_ptr,
    acc_ptr,
    max_ptr,
    sum_ptr,
    num_heads,
    num_lanes,
    zero_row,
    piece_stride,
    sm_scale,
    stride_qt,
    stride_qh,
    stride_rt,
    stride_at,
    stride_ah,
    stride_mt,
    D_QK: tl.constexpr,
    D_V: tl.constexpr,
    DV_BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    LANES: tl.constexpr,
    D_CHUNK: tl.constexpr,
    PIECES: tl.constexpr,
    UPCAST: tl.constexpr,
    LOWEST: tl.constexpr,
):
    pid = tl.program_id(0)  # head group and value slice vary fastest: neighbours share rows in L2
    t = tl.program_id(1).to(tl.int64)
    num_slices: tl.constexpr = D_V // DV_BLOCK
    # DSV4 (one piece, V = the whole row): each key tile is loaded once, whole, and is the value
    # tile too. Otherwise (DSV3.2: RoPE dims past d_v, or three pieces) the scores are summed over
    # 64-dim chunks and the value pieces are loaded one at a time (bounded shared memory).
    FUSED: tl.constexpr = (D_QK == D_V) and (PIECES == 1) and (DV_BLOCK == D_V)
    group = pid // num_slices
    dv0 = (pid % num_slices) * DV_BLOCK
    heads = group * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    dvs = dv0 + tl.arange(0, DV_BLOCK)
    dchunk = tl.arange(0, D_CHUNK)
    lanes = tl.arange(0, LANES)
    q_rows = q_ptr + t * stride_qt + heads.to(tl.int64)[:, None] * stride_qh
    if FUSED:
        q_all = tl.load(q_rows + dvs[None, :], mask=hmask[:, None], other=0.0)  # [BLOCK_H, D_QK] bf16

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DV_BLOCK], tl.float32)
    for start in range(0, num_lanes, LANES):
        r = tl.load(rows_ptr + t * stride_rt + start + lanes)
        valid = r != zero_row
        base = k_ptr + r.to(tl.int64) * D_QK
        s = tl.zeros([BLOCK_H, LANES], tl.float32)
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
        p1f = (p.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)
        rem = p - p1f
        p2f = (rem.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)
        p1 = p1f.to(tl.bfloat16)
        p2 = p2f.to(tl.bfloat16)
        p3 = (rem - p2f).to(tl.bfloat16)
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
    out = acc_ptr + t * stride_at + heads.to(tl.int64)[:, None] * stride_ah + dvs[None, :]
    tl.store(out, acc, mask=hmask[:, None])
    if dv0 == 0:
        tl.store(max_ptr + t * stride_mt + heads, m_i, mask=hmask)
        tl.store(sum_ptr + t * stride_mt + heads, l_i, mask=hmask)


def bf16_pieces(table: torch.Tensor, exact: bool) -> torch.Tensor:
    """The fp32 table as a sum of BF16 pieces, stacked: ``[pieces, R, d_qk]`` BF16, contiguous.

    Args:
        table: ``[R, d_qk]`` fp32 dequantized rows (may hold inf/NaN in rows no lane names).
        exact: the table's values are BF16 numbers (DSV4: ``formats.PackedFormat.bf16_exact``):
            one piece, ``bf16(table)``. Otherwise three: ``hi = bf16(x)``, ``mid = bf16(x - hi)``,
            ``lo = bf16(x - hi - mid)`` (non-finite values keep ``hi`` and get zero ``mid``/``lo``).

    Returns:
        ``[1 or 3, R, d_qk]`` BF16 with ``sum(pieces) == table`` within 2**-24 relative (with
        ``exact=True`` on values that are not BF16 numbers: rounded to BF16, the caller's promise).

    Raises:
        ValueError: ``table`` is not a 2-D fp32 tensor.
    """
    if not isinstance(table, torch.Tensor) or table.dtype != torch.float32 or table.dim() != 2:
        got = f"{table.dtype} {tuple(table.shape)}" if isinstance(table, torch.Tensor) else type(table).__name__
        raise ValueError(f"bf16_pieces: table: expected a 2-D torch.float32 tensor, got {got}")
    hi = table.to(torch.bfloat16).contiguous()
    if exact:
        return hi.unsqueeze(0)
    rem = torch.where(torch.isfinite(table), table - hi.float(), 0.0)
    mid = rem.to(torch.bfloat16)
    lo = (rem - mid.float()).to(torch.bfloat16)
    return torch.stack([hi, mid, lo])


def online_softmax(
    q: torch.Tensor,
    pieces: torch.Tensor,
    rows: torch.Tensor,
    zero_row: int,
    sm_scale: float,
    d_v: int,
    config: tuple[int, int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the online softmax of every (token, head) over its candidate lanes.

    Args:
        q: ``[T, H, d_qk]`` BF16 queries (any strides with unit last-dim stride).
        pieces: ``[1 or 3, R, d_qk]`` contiguous BF16 table pieces (:func:`bf16_pieces`); row
            ``zero_row`` is all zero.
        rows: ``[T, L]`` int32 table row per lane, ``L`` a multiple of 64, unit lane stride;
            invalid lanes hold ``zero_row``; every value must be a row of ``pieces`` (not checked:
            that would need a host sync; ``sparse_mla_forward`` builds them in range).
        zero_row: index of the shared zero row (every other entry of ``rows`` is a valid lane).
        sm_scale: score scale (natural-log units).
        d_v: value dims (512, a power of two): the first ``d_v`` dims of each row; ``d_qk - d_v``
            must be 0 or a power of two (DSV3.2: 64 RoPE dims).
        config: ``(head_group, dv_block, num_warps, num_stages)``; default :data:`DEFAULT_CONFIG`.

    Returns:
        ``(run_max [T, H], run_sum [T, H], acc [T, H, d_v])`` fp32: the running max (``-inf`` for a
        row without valid lanes), the sum of ``exp(s - run_max)`` and the unnormalised output.

    Raises:
        ValueError: shapes that do not agree (``rows`` not ``T`` long, ``pieces`` not ``d_qk``
            wide, ``d_v > d_qk``), ``L`` not a multiple of 64, ``d_v`` not a multiple of
            ``dv_block``, a dtype, piece count, config or stride the kernel does not take.
    """
    block_h, dv_block, num_warps, num_stages = config or DEFAULT_CONFIG
    if q.dim() != 3 or pieces.dim() != 3 or rows.dim() != 2:
        raise ValueError(
            f"online_softmax: expected q [T, H, d_qk], pieces [1 or 3, R, d_qk] and rows [T, L]; got "
            f"q.shape={tuple(q.shape)}, pieces.shape={tuple(pieces.shape)}, rows.shape={tuple(rows.shape)}"
        )
    num_tokens, num_heads, d_qk = (int(v) for v in q.shape)
    num_lanes = int(rows.shape[1])
    if int(rows.shape[0]) != num_tokens or int(pieces.shape[2]) != d_qk or not 0 < d_v <= d_qk:
        raise ValueError(
            f"online_softmax: rows.shape[0]={int(rows.shape[0])} must be T={num_tokens}, "
            f"pieces.shape[2]={int(pieces.shape[2])} must be d_qk={d_qk}, and 0 < d_v={d_v} <= d_qk"
        )
    if rows.dtype != torch.int32 or not 0 <= zero_row < int(pieces.shape[1]):
        raise ValueError(
            f"online_softmax: rows.dtype={rows.dtype} must be torch.int32 and zero_row={zero_row} a row "
            f"of the {int(pieces.shape[1])}-row table (row values are not checked: no host sync)"
        )
    for name, value in (("head_group", block_h), ("dv_block", dv_block)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"online_softmax: config {name}={value}: expected a power of two >= 16")
    if num_lanes % LANE_TILE or d_v % dv_block or d_qk % _D_CHUNK:
        raise ValueError(
            f"online_softmax: lanes={num_lanes} must be a multiple of {LANE_TILE}, d_v={d_v} of "
            f"dv_block={dv_block}, d_qk={d_qk} of {_D_CHUNK}"
        )
    if q.dtype != torch.bfloat16 or pieces.dtype != torch.bfloat16 or int(pieces.shape[0]) not in (1, 3):
        raise ValueError(
            f"online_softmax: q.dtype={q.dtype} and pieces.dtype={pieces.dtype} must be torch.bfloat16 "
            f"with 1 or 3 pieces (pieces.shape={tuple(pieces.shape)})"
        )
    if q.stride(2) != 1 or rows.stride(1) != 1 or not pieces.is_contiguous():
        raise ValueError("online_softmax: q and rows need a unit last stride and pieces must be contiguous")
    device = q.device
    acc = torch.empty((num_tokens, num_heads, d_v), dtype=torch.float32, device=device)
    run_max = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=device)
    run_sum = torch.empty_like(run_max)
    if num_tokens == 0:
        return run_max, run_sum, acc
    num_pieces = int(pieces.shape[0])
    if num_pieces > 1 or d_qk != d_v:
        num_stages = 1  # the unfused (DSV3.2) loop: software pipelining would multi-buffer all its loads
    groups = -(-num_heads // block_h)
    grid = (groups * (d_v // dv_block), num_tokens)
    _online_softmax_kernel[grid](
        q, pieces, rows, acc, run_max, run_sum,
        num_heads, num_lanes, zero_row, pieces.stride(0), float(sm_scale),
        q.stride(0), q.stride(1), rows.stride(0), acc.stride(0), acc.stride(1), run_max.stride(0),
        D_QK=d_qk, D_V=d_v, DV_BLOCK=dv_block, BLOCK_H=block_h, LANES=LANE_TILE, D_CHUNK=_D_CHUNK,
        PIECES=num_pieces, UPCAST=INTERPRETED, LOWEST=_FP32_LOWEST,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return run_max, run_sum, acc
