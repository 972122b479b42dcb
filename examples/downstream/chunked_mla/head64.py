"""A head-specialised sparse-MLA kernel with FlashMLA's shapes, and its envelope.

Production kernels take a narrow set of shapes. This one, like FlashMLA's SM90 sparse decode
(deepseek-ai/FlashMLA ``csrc/api/sparse_decode.h``), takes 64 or 128 heads and index rows whose
width is a multiple of 64; it masks only ``-1`` lanes, takes ``topk_length`` in ``[0, topk]`` and
an extra cache for the DSV4 layout only, and returns FlashMLA's ``(output, lse)`` pair with a
natural-log LSE without the sink (``+inf`` for a row without candidates). It computes like a
BF16 kernel: fp32 scores, probabilities rounded to BF16 before the value product, BF16 output.

Its ``envelope`` says all of that in a few lines, so pytest-sparse-mla's suites build every error
class at 64 and 128 heads with widths rounded up to 64 (``-1`` padding) and never call it with
anything else; the kernel refuses anything else with a ``ValueError``, as a real kernel's argument
checks would.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pytest_sparse_mla import Envelope, Widths, formats

__all__ = ["ENVELOPE", "Head64SparseMla"]

ENVELOPE = Envelope(
    num_heads=(64, 128),
    topk=Widths(multiple=64),
    extra_topk=Widths(multiple=64),
    extra_cache_formats=("dsv4",),
    topk_length_formats=("dsv4",),
    topk_length_range="row",
    min_tokens=1,
    masked_indices="minus_one",
    lse_conventions=("flashmla",),
)


def _vector(value: Any, name: str, dtype: torch.dtype, length: int, q: torch.Tensor) -> None:
    if not isinstance(value, torch.Tensor) or value.dtype != dtype or tuple(value.shape) != (length,):
        got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{name}: expected {dtype} [{length}], got {got}")
    if value.device != q.device:
        raise ValueError(f"{name} is on {value.device}, q on {q.device}")


def _rows(value: Any, name: str, num_tokens: int, q: torch.Tensor) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int32:
        raise TypeError(f"{name}: expected an int32 tensor, got {getattr(value, 'dtype', type(value).__name__)}")
    rows = value[:, 0] if value.dim() == 3 and value.shape[1] == 1 else value
    if rows.dim() != 2 or rows.shape[0] != num_tokens:
        raise ValueError(f"{name}.shape={tuple(value.shape)}: expected [num_tokens={num_tokens}, topk]")
    if rows.device != q.device:
        raise ValueError(f"{name} is on {rows.device}, q on {q.device}")
    if rows.shape[1] % 64:
        raise ValueError(f"{name}: topk={rows.shape[1]} is not a multiple of 64")
    return rows


class Head64SparseMla:
    """The kernel (module docstring); ``--sparse-mla-impl chunked_mla.head64:Head64SparseMla``."""

    name = "head64"
    compute_mode = "bf16"
    envelope = ENVELOPE

    def sparse_mla_forward(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        indices: torch.Tensor,
        *,
        sm_scale: float,
        fmt: str = "dsv4",
        page_block_size: int | None = None,
        topk_length: torch.Tensor | None = None,
        attn_sink: torch.Tensor | None = None,
        extra_kv_cache: torch.Tensor | None = None,
        extra_indices: torch.Tensor | None = None,
        extra_topk_length: torch.Tensor | None = None,
        extra_page_block_size: int | None = None,
        lse_convention: str = "flashmla",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output [T, H, 512] BF16, lse [T, H] fp32 natural log, sink excluded)``.

        Raises:
            TypeError, ValueError: a bad argument (named), or a shape outside :data:`ENVELOPE`.
        """
        f = formats.get_format(fmt)
        if not isinstance(q, torch.Tensor) or q.dtype != torch.bfloat16 or q.dim() != 3 or q.shape[2] != f.d_qk:
            raise ValueError(
                f"q: expected BF16 [T, H, {f.d_qk}], got {getattr(q, 'dtype', q)} {tuple(getattr(q, 'shape', ()))}"
            )
        num_tokens, num_heads = int(q.shape[0]), int(q.shape[1])
        if num_heads not in (64, 128) or num_tokens < 1:
            raise ValueError(
                f"q: num_heads={num_heads}, num_tokens={num_tokens}: this kernel takes 64 or 128 heads, T >= 1"
            )
        if lse_convention != "flashmla":
            raise ValueError(f"lse_convention={lse_convention!r}: this kernel returns FlashMLA's LSE only")
        if (extra_kv_cache is None) != (extra_indices is None):
            missing = "extra_indices" if extra_indices is None else "extra_kv_cache"
            raise ValueError(f"{missing}: extra_kv_cache and extra_indices go together")
        if extra_topk_length is not None and extra_kv_cache is None:
            raise ValueError("extra_topk_length given without an extra_kv_cache")
        if attn_sink is not None:
            _vector(attn_sink, "attn_sink", torch.float32, num_heads, q)
        sources = [(kv_cache, indices, topk_length, page_block_size, ("kv_cache", "indices", "topk_length"))]
        if extra_kv_cache is not None:
            if f.name != "dsv4":
                raise ValueError("extra_kv_cache: taken for the DSV4 layout only")
            names = ("extra_kv_cache", "extra_indices", "extra_topk_length")
            sources.append((extra_kv_cache, extra_indices, extra_topk_length, extra_page_block_size, names))
        keys, lanes = [], []
        for cache, idx, length, ps, (cache_name, idx_name, length_name) in sources:
            layout = formats.parse_cache(cache, f, page_block_size=ps, name=cache_name)
            table = formats.unpack_dequantize(cache, f, page_block_size=layout.page_block_size).reshape(-1, f.d_qk)
            rows = _rows(idx, idx_name, num_tokens, q)
            valid = rows != -1  # only -1 masks a lane (FlashMLA's decode convention)
            if length is not None:
                if f.name != "dsv4":
                    raise ValueError(f"{length_name}: taken for the DSV4 layout only")
                _vector(length, length_name, torch.int32, num_tokens, q)
                valid &= torch.arange(rows.shape[1], device=q.device) < length.long().unsqueeze(1)
            if bool(((rows < 0) & valid).any()) or bool(((rows >= table.shape[0]) & valid).any()):
                raise ValueError(f"{idx_name}: a valid lane outside [0, {table.shape[0]})")
            gathered = table[rows.masked_fill(~valid, 0).long()]  # [T, topk, d_qk] fp32
            keys.append(gathered.masked_fill(~valid.unsqueeze(-1), 0.0))  # a masked lane never carries row 0's bytes
            lanes.append(valid)
        k = torch.cat(keys, dim=1)
        valid = torch.cat(lanes, dim=1)
        scores = torch.einsum("thd,tkd->thk", q.float(), k) * sm_scale
        scores = scores.masked_fill(~valid.unsqueeze(1), -math.inf)
        peak = scores.amax(dim=-1, keepdim=True)
        if attn_sink is not None:
            peak = torch.maximum(peak, attn_sink.view(1, -1, 1))
        peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
        p = torch.exp(scores - peak)
        denom = p.sum(dim=-1)
        # without the sink, shifted by the scores' own max: a sink that dominates the scores by more than
        # 87 log units would underflow every exp(score - peak) to 0 (found by the search)
        top = scores.amax(dim=-1)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        lse = torch.log(torch.exp(scores - top.unsqueeze(-1)).sum(dim=-1)) + top
        if attn_sink is not None:
            denom = denom + torch.exp(attn_sink.view(1, -1) - peak[..., 0])
        p_bf16 = p.to(torch.bfloat16).float()  # BF16 probabilities, as the tensor-core product takes them
        out = torch.einsum("thk,tkd->thd", p_bf16, k[..., : f.d_v]) / denom.clamp(min=1e-30).unsqueeze(-1)
        empty = ~valid.any(dim=1)
        out = torch.where(empty.view(-1, 1, 1), torch.zeros_like(out), out)
        lse = torch.where(empty.view(-1, 1), torch.full_like(lse, math.inf), lse)
        return out.to(torch.bfloat16), lse.to(torch.float32)
