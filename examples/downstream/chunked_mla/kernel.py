"""A split-K sparse-MLA "kernel": partial softmaxes over chunks of candidates, merged by their LSEs.

This is how split-K decode kernels work (FlashInfer's SM120 decode writes one partial output and
LSE per 64-candidate split, then merges them): the candidate lanes of each query token are cut
into chunks of ``chunk_lanes`` lanes (the main cache's lanes, then the extra cache's), each chunk's
attention is computed on its own, and the partial results are combined exactly:

    m      = max(max_c lse_c, sink)                   (natural-log LSEs of the chunks, no sink)
    w_c    = exp(lse_c - m)
    out    = sum_c w_c * out_c / (sum_c w_c + exp(sink - m))
    lse    = m + log(sum_c w_c + exp(sink - m))       (sink included: FlashInfer's convention)

Each chunk is computed by the bundled reference (``pytest_sparse_mla.attention.sparse_mla_forward``
with ``lse_convention="flashmla"``: natural log, no sink, ``+inf`` for an empty chunk), so the
example stays small; a real library would call its own kernel there. The chunking differs from the
reference's 64-lane tiles, so the suites check the merge, the masking across chunk boundaries
(``topk_length``, ``-1`` lanes), the sink and the LSE conventions of this code, not the reference's.

Only ``sparse_mla_forward`` is provided (no ``pack`` or ``page_split``): suites that need those
capabilities skip, with the reason, when this implementation is selected.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ChunkedResult", "ChunkedSparseMla"]


@dataclass(frozen=True)
class ChunkedResult:
    """What :meth:`ChunkedSparseMla.sparse_mla_forward` returns.

    Attributes:
        output: ``[T, H, 512]`` BF16.
        lse: ``[T, H]`` fp32 in the requested convention.
        route: ``"decode"`` if ``T <= 64`` else ``"prefill"`` (FlashInfer's cutoff).
        output_fp32: the merged fp32 output when ``return_fp32=True``, else ``None``.
    """

    output: torch.Tensor
    lse: torch.Tensor
    route: str
    output_fp32: torch.Tensor | None = None


def _chunk_lengths(length: torch.Tensor | None, start: int, width: int) -> torch.Tensor | None:
    """Valid lanes of the chunk ``[start, start + width)`` given the row's ``topk_length``."""
    if length is None:
        return None
    return (length.to(torch.int64) - start).clamp(0, width).to(length.dtype)


def _check_call(
    q: torch.Tensor, attn_sink: Any, extra_indices: Any, extra_topk_length: Any
) -> None:
    """What the per-chunk reference calls cannot check: the sink is merged here, and the extra
    cache's arguments reach the reference under the main cache's names."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        return  # the reference names q
    num_tokens, num_heads = int(q.shape[0]), int(q.shape[1])
    if attn_sink is not None:
        if not isinstance(attn_sink, torch.Tensor) or attn_sink.dtype != torch.float32:
            raise TypeError(f"attn_sink: expected a float32 tensor, got {getattr(attn_sink, 'dtype', attn_sink)!r}")
        if tuple(attn_sink.shape) != (num_heads,):
            raise ValueError(f"attn_sink.shape={tuple(attn_sink.shape)}: expected ({num_heads},), one logit per head")
        if attn_sink.device != q.device:
            raise ValueError(f"attn_sink.device={attn_sink.device}: expected q's device {q.device}")
    for name, tensor in (("extra_indices", extra_indices), ("extra_topk_length", extra_topk_length)):
        if isinstance(tensor, torch.Tensor) and (tensor.dim() == 0 or int(tensor.shape[0]) != num_tokens):
            raise ValueError(f"{name}.shape={tuple(tensor.shape)}: the leading dim must equal num_tokens={num_tokens}")


class ChunkedSparseMla:
    """Split-K sparse MLA over packed DSV4 / DSV3.2 caches (the example's implementation).

    Args:
        chunk_lanes: candidate lanes per chunk (a positive int; 48 by default, deliberately not a
            multiple of the reference's 64-lane tile).

    Raises:
        ValueError: ``chunk_lanes`` is not a positive int.
    """

    name = "chunked"
    #: Exact merges in fp32: hold this kernel to the reference's tight tolerances.
    tolerance_profile = "tight"

    def __init__(self, chunk_lanes: int = 48) -> None:
        if isinstance(chunk_lanes, bool) or not isinstance(chunk_lanes, int) or chunk_lanes < 1:
            raise ValueError(f"chunk_lanes={chunk_lanes!r}: expected a positive int")
        self.chunk_lanes = chunk_lanes

    def __repr__(self) -> str:
        return f"ChunkedSparseMla(chunk_lanes={self.chunk_lanes})"

    @torch.no_grad()
    def sparse_mla_forward(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        indices: torch.Tensor,
        *,
        sm_scale: float,
        fmt: Any = "dsv4",
        page_block_size: int | None = None,
        topk_length: torch.Tensor | None = None,
        attn_sink: torch.Tensor | None = None,
        extra_kv_cache: torch.Tensor | None = None,
        extra_indices: torch.Tensor | None = None,
        extra_topk_length: torch.Tensor | None = None,
        extra_page_block_size: int | None = None,
        lse_convention: str = "flashinfer",
        lse_scale: float = 1.0,
        return_fp32: bool = False,
        **unused: Any,
    ) -> ChunkedResult:
        """Sparse MLA attention with the keyword names of ``pytest_sparse_mla.attention.sparse_mla_forward``.

        Args:
            q: ``[T, H, d_qk]`` BF16 queries.
            kv_cache, extra_kv_cache: packed uint8 caches.
            indices, extra_indices: ``[T, topk]`` or ``[T, 1, topk]`` int32 flat token indices
                (``-1`` = masked).
            topk_length, extra_topk_length: optional ``[T]`` int32 valid-prefix lengths.
            attn_sink: optional ``[H]`` fp32 sink logits (natural log).
            lse_convention: ``"flashinfer"`` (log2, sink included, times ``lse_scale``) or
                ``"flashmla"`` (natural log, sink excluded, ``+inf`` for an empty row).
            unused: ``grid_release``, ``chunk_tokens`` and other reference-only knobs (ignored).

        Raises:
            ValueError, TypeError: what the wrapped reference raises for bad inputs (messages name
                the argument); an unknown ``lse_convention`` or bad ``lse_scale``; an extra cache
                without extra indices or the reverse.
        """
        from pytest_sparse_mla.attention import sparse_mla_forward
        from pytest_sparse_mla.attention.conventions import check_lse_convention

        lse_convention, lse_scale = check_lse_convention(lse_convention, lse_scale)
        if (extra_kv_cache is None) != (extra_indices is None):
            raise ValueError("extra_kv_cache and extra_indices must be provided together")
        if extra_kv_cache is None and (extra_topk_length is not None or extra_page_block_size is not None):
            raise ValueError("extra_topk_length / extra_page_block_size require extra_kv_cache")
        _check_call(q, attn_sink, extra_indices, extra_topk_length)
        sources = [(kv_cache, indices, topk_length, page_block_size)]
        if extra_kv_cache is not None:
            sources.append((extra_kv_cache, extra_indices, extra_topk_length, extra_page_block_size))
        outs, lses = [], []
        for source, (cache, idx, length, ps) in enumerate(sources):
            rows = idx[:, 0] if isinstance(idx, torch.Tensor) and idx.dim() == 3 else idx
            if isinstance(rows, torch.Tensor) and rows.dim() == 2:
                topk = int(rows.shape[1])
                starts = range(0, max(topk, 1), self.chunk_lanes)
                chunks = [
                    (rows[:, s : s + self.chunk_lanes], _chunk_lengths(length, s, min(self.chunk_lanes, topk - s)))
                    for s in starts
                ]
            else:  # not an index matrix: let the reference name the bad argument
                chunks = [(rows, length)]
            for chunk, chunk_length in chunks:
                try:
                    part = sparse_mla_forward(
                        q, cache, chunk, sm_scale=sm_scale, fmt=fmt, page_block_size=ps,
                        topk_length=chunk_length, lse_convention="flashmla", return_fp32=True,
                    )  # fmt: skip
                except (TypeError, ValueError) as exc:
                    if source == 0:
                        raise
                    # each chunk of the extra cache is a main-cache call of the reference: name the
                    # arguments the caller gave (extra_indices, not indices)
                    raise type(exc)(re.sub(r"\b(kv_cache|indices|topk_length|page_block_size)\b", r"extra_\1",
                                           str(exc))) from exc  # fmt: skip
                outs.append(part.output_fp32)
                lses.append(torch.where(torch.isposinf(part.lse), -math.inf, part.lse))  # empty: -inf

        m = torch.stack(lses).amax(dim=0)  # [T, H]
        if attn_sink is not None:
            m = torch.maximum(m, attn_sink.unsqueeze(0))
        m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # nothing at all: any finite shift
        # Merge one chunk after the other, as a kernel's merge loop does: an empty chunk adds exact
        # zeros, so padding an index row with -1 lanes leaves every bit of the result unchanged.
        candidates = torch.zeros_like(m)
        merged = torch.zeros_like(outs[0])
        for lse_i, out_i in zip(lses, outs, strict=True):
            w = torch.exp(lse_i - m)  # exp(-inf) = 0 for an empty chunk
            candidates += w
            merged += w.unsqueeze(-1) * out_i
        denominator = candidates.clone()
        if attn_sink is not None:
            denominator += torch.exp(attn_sink.unsqueeze(0) - m)
        safe = torch.where(denominator == 0, torch.ones_like(denominator), denominator)
        out_fp32 = merged / safe.unsqueeze(-1)
        if lse_convention == "flashinfer":
            lse = (m + torch.log(denominator)) * (lse_scale / math.log(2.0))
        else:  # the sink is not in this LSE: shift by the chunks' own max, or a dominant sink underflows them
            m_c = torch.stack(lses).amax(dim=0)
            m_c = torch.where(torch.isneginf(m_c), torch.zeros_like(m_c), m_c)
            lse = m_c + torch.log(sum(torch.exp(lse_i - m_c) for lse_i in lses))
            lse = torch.where(torch.isneginf(lse), math.inf, lse)
        route = "decode" if q.shape[0] <= 64 else "prefill"
        return ChunkedResult(
            out_fp32.to(torch.bfloat16), lse.to(torch.float32), route, out_fp32 if return_fp32 else None
        )
