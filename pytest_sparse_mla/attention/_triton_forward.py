"""Triton inner loop of the bundled reference sparse-MLA forward (``backend="triton"``).

Import this module through ``attention.reference.triton_forward_module`` (``sparse_mla_forward``
does), which sets ``TRITON_INTERPRET=1`` first when no CUDA device exists; Triton decides at
decoration time whether a kernel is compiled or interpreted (triton ``runtime/jit.py`` ``jit``).

Only the online-softmax loop lives here. ``attention.reference`` prepares everything else and
shares it with the torch path: the dequantized fp32 table with its shared all-zero row, the table
row of every candidate lane (invalid lanes name the zero row; the main row and the extra row each
padded to a multiple of :data:`LANE_TILE` = 64), and the finalisation (divide, sink, LSE).

Kernel (:func:`online_softmax`): one program per (token, group of :data:`HEAD_GROUP` = 16 heads,
output slice of ``dv_block`` value dims). Heads past ``num_heads`` load zero queries and are never
stored. The program walks the token's lanes in tiles of 64 (fixed, independent of topk):

* scores ``s = sm_scale * q @ K^T`` as fp32 IEEE dots (``tl.dot(..., input_precision="ieee")``:
  FMA products, no TF32) over ``d_qk`` in chunks of 64 dims, one accumulation order for every call;
* a lane is valid iff its table row is not the zero row; masked lanes get score ``-inf``;
* fp32 online softmax in natural-log units: ``m' = max(m, max s)``, shift ``max(m', fp32 lowest)``
  (so a row with no valid lane yet never computes ``-inf - -inf``), ``alpha = exp(m - shift)``,
  ``p = exp(s - shift)``, ``l = alpha l + sum p``, ``acc = alpha acc + p @ V`` (IEEE dot);
* a tile with no valid lane gives ``m' = m``, ``alpha = exp(0) = 1`` and ``p = 0`` exactly and reads
  only zero rows, so it leaves ``m``, ``l`` and ``acc`` bit-for-bit unchanged: padding an index row
  with ``-1`` changes nothing;
* every block shape is a constant, so a head's arithmetic is the same whatever ``num_heads`` is
  (head-count independence holds by construction; rows of an FMA dot do not interact).

It writes ``run_max``/``run_sum`` ``[T, H]`` and the unnormalised ``acc`` ``[T, H, d_v]`` (fp32).
With ``dv_block < d_v`` the scores are recomputed per slice (same order, same bits).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["HEAD_GROUP", "LANE_TILE", "INTERPRETED", "DEFAULT_CONFIG", "online_softmax"]

#: Heads per program of the shipped kernel (a constant: never derived from ``num_heads``).
HEAD_GROUP = 16
#: Candidate lanes per tile (FlashInfer's DSV4 candidate tile ``BI``).
LANE_TILE = 64
#: Dims per QK dot chunk (divides 512 and 576).
_D_CHUNK = 64
#: True when this module's kernel was decorated under ``TRITON_INTERPRET=1`` (CPU tensors).
INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"
#: ``(head_group, dv_block, num_warps, num_stages)`` of the shipped kernel; fixed for every shape,
#: since the bitwise invariants compare calls of different shapes. ``_SPARSE_MLA_ATTN_CONFIG``
#: (four comma-separated ints, read at import) overrides it for tuning runs only
#: (``benchmarks/tune_attention.py``).
_h, _dv, _w, _s = (int(v) for v in os.environ.get("_SPARSE_MLA_ATTN_CONFIG", f"{HEAD_GROUP},512,8,1").split(","))
DEFAULT_CONFIG: tuple[int, int, int, int] = (_h, _dv, _w, _s)
_FP32_LOWEST = float(torch.finfo(torch.float32).min)


@triton.jit
def _online_softmax_kernel(
    q_ptr,
    table_ptr,
    rows_ptr,
    acc_ptr,
    max_ptr,
    sum_ptr,
    num_heads,
    num_lanes,
    zero_row,
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
    LOWEST: tl.constexpr,
):
    pid = tl.program_id(0)  # head group and value slice vary fastest: neighbours share rows in L2
    t = tl.program_id(1).to(tl.int64)
    num_slices: tl.constexpr = D_V // DV_BLOCK
    group = pid // num_slices
    dv0 = (pid % num_slices) * DV_BLOCK
    heads = group * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    dchunk = tl.arange(0, D_CHUNK)
    dvs = dv0 + tl.arange(0, DV_BLOCK)
    lanes = tl.arange(0, LANES)
    q_rows = q_ptr + t * stride_qt + heads.to(tl.int64)[:, None] * stride_qh

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DV_BLOCK], tl.float32)
    for start in range(0, num_lanes, LANES):
        r = tl.load(rows_ptr + t * stride_rt + start + lanes)
        valid = r != zero_row
        base = table_ptr + r.to(tl.int64) * D_QK
        s = tl.zeros([BLOCK_H, LANES], tl.float32)
        for d in tl.static_range(0, D_QK, D_CHUNK):
            qc = tl.load(q_rows + d + dchunk[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
            kc = tl.load(base[:, None] + d + dchunk[None, :])  # [LANES, D_CHUNK]
            s = tl.dot(qc, tl.trans(kc), s, input_precision="ieee")
        s = tl.where(valid[None, :], s * sm_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        shift = tl.maximum(m_new, LOWEST)
        alpha = tl.exp(m_i - shift)
        p = tl.exp(s - shift[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(base[:, None] + dvs[None, :])  # [LANES, DV_BLOCK]
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
        m_i = m_new
    out = acc_ptr + t * stride_at + heads.to(tl.int64)[:, None] * stride_ah + dvs[None, :]
    tl.store(out, acc, mask=hmask[:, None])
    if dv0 == 0:
        tl.store(max_ptr + t * stride_mt + heads, m_i, mask=hmask)
        tl.store(sum_ptr + t * stride_mt + heads, l_i, mask=hmask)


def online_softmax(
    q: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    zero_row: int,
    sm_scale: float,
    d_v: int,
    config: tuple[int, int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the online softmax of every (token, head) over its candidate lanes.

    Args:
        q: ``[T, H, d_qk]`` BF16 queries (any strides with unit last-dim stride).
        table: ``[R, d_qk]`` contiguous fp32 dequantized rows; row ``zero_row`` is all zero.
        rows: ``[T, L]`` int32 table row per lane, ``L`` a multiple of 64, unit lane stride;
            invalid lanes hold ``zero_row``.
        zero_row: index of the shared zero row (every other entry of ``rows`` is a valid lane).
        sm_scale: score scale (natural-log units).
        d_v: value dims (512): the first ``d_v`` dims of each row.
        config: ``(head_group, dv_block, num_warps, num_stages)``; default :data:`DEFAULT_CONFIG`.

    Returns:
        ``(run_max [T, H], run_sum [T, H], acc [T, H, d_v])`` fp32: the running max (``-inf`` for a
        row without valid lanes), the sum of ``exp(s - run_max)`` and the unnormalised output.

    Raises:
        ValueError: ``L`` not a multiple of 64, or ``d_v``/``d_qk`` not multiples of the blocks.
    """
    block_h, dv_block, num_warps, num_stages = config or DEFAULT_CONFIG
    num_tokens, num_heads, d_qk = (int(v) for v in q.shape)
    num_lanes = int(rows.shape[1])
    if num_lanes % LANE_TILE or d_qk % _D_CHUNK or d_v % dv_block:
        raise ValueError(
            f"online_softmax: lanes={num_lanes} must be a multiple of {LANE_TILE}, d_qk={d_qk} of "
            f"{_D_CHUNK}, d_v={d_v} of dv_block={dv_block}"
        )
    if q.stride(2) != 1 or rows.stride(1) != 1 or not table.is_contiguous():
        raise ValueError("online_softmax: q and rows need a unit last stride and table must be contiguous")
    device = q.device
    acc = torch.empty((num_tokens, num_heads, d_v), dtype=torch.float32, device=device)
    run_max = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=device)
    run_sum = torch.empty_like(run_max)
    if num_tokens == 0:
        return run_max, run_sum, acc
    groups = -(-num_heads // block_h)
    grid = (groups * (d_v // dv_block), num_tokens)
    _online_softmax_kernel[grid](
        q, table, rows, acc, run_max, run_sum,
        num_heads, num_lanes, zero_row, float(sm_scale),
        q.stride(0), q.stride(1), rows.stride(0), acc.stride(0), acc.stride(1), run_max.stride(0),
        D_QK=d_qk, D_V=d_v, DV_BLOCK=dv_block, BLOCK_H=block_h, LANES=LANE_TILE,
        D_CHUNK=_D_CHUNK, LOWEST=_FP32_LOWEST, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return run_max, run_sum, acc
