"""Float64 oracle for sparse MLA: the plainest correct computation, used only to judge others.

It shares no code with ``attention/reference.py`` (a test that compared the reference with
itself would prove nothing). It reads the caches through ``formats.unpack_dequantize`` (the byte
rules are specified and tested there) and then, one query token at a time, in float64:

1. lists the token's valid candidates: main lanes with index ``>= 0`` before
   ``clamp(topk_length, 0, topk)``, then extra lanes likewise (shifted past the main table);
2. counts how often each distinct table row occurs among them (a duplicate counts twice);
3. forms the dense score matrix ``sm_scale * q @ rows.T`` over those distinct rows and a masked
   softmax weighted by the counts, with ``exp(attn_sink[h])`` added to the denominator;
4. returns ``sum_j w_j V_j`` (``V`` = the first 512 dims of a row) and the LSE in the requested
   convention (``attention.conventions``).

Only rows a token validly references are read, so bytes of unreferenced or masked slots (NaN,
0xFF) cannot reach the result. Semantics: FlashMLA's ``tests/ref.py`` (deepseek-ai/FlashMLA) and
FlashInfer's ``tests/attention/test_sparse_mla_sm120.py`` reference (flashinfer-ai/flashinfer).
The loop over tokens is deliberate: simple beats fast here.

Beside the result the oracle returns each row's *sensitivity* to rounding (:class:`ErrorScales`),
which ``pytest_sparse_mla.tolerances`` turns into scale-aware bounds: the absolute-weighted value
``sum_j w_j |V_j|`` (the classic forward-error scale of a dot product, Higham, *Accuracy and
Stability of Numerical Algorithms*, 2nd ed., section 3.1), its RMS counterpart
``sqrt(sum_j w_j**2 |V_j|**2)``, and the largest absolute score ``sm_scale * sum_d |q_d k_d|``.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from pytest_sparse_mla import formats
from pytest_sparse_mla.attention.call import CALL_ARGUMENTS, SparseMlaCall

__all__ = ["ErrorScales", "OracleOutput", "memoized", "oracle_forward"]


@dataclass(frozen=True)
class ErrorScales:
    """How sensitive each output row is to rounding, computed by the oracle in float64.

    With ``w_j`` the softmax weight of candidate ``j`` (the sink included in the denominator, so
    ``sum_j w_j <= 1``) and ``V_j`` its value row:

    Attributes:
        abs_weighted: ``[T, H, d_v]`` float64, ``sum_j w_j |V_j|`` elementwise: a relative error
            ``u`` in every ``w_j`` moves an output element by at most ``u`` times this.
        rms_weighted: ``[T, H]`` float64, ``sqrt(sum_j w_j**2 ||V_j||**2)`` (l2 over ``d_v``):
            the typical size of the same error when the per-candidate errors are independent.
        score_magnitude: ``[T, H]`` float64, ``max_j sm_scale * sum_d |q_d| |K_jd|`` in natural-log
            units (0 for an empty row): a relative error ``u`` in every product of the score
            moves a logit by at most ``u`` times this.
        max_candidates: the largest number of valid lanes of any row (the accumulation length).
    """

    abs_weighted: torch.Tensor
    rms_weighted: torch.Tensor
    score_magnitude: torch.Tensor
    max_candidates: int


@dataclass(frozen=True)
class OracleOutput:
    """Float64 results of :func:`oracle_forward`.

    Attributes:
        output: ``[num_tokens, num_heads, 512]`` float64.
        lse: ``[num_tokens, num_heads]`` float64 in the requested convention.
        lse_convention, lse_scale: the convention ``lse`` is in (``attention.conventions``).
        scales: the rows' :class:`ErrorScales`.
    """

    output: torch.Tensor
    lse: torch.Tensor
    lse_convention: str = "flashinfer"
    lse_scale: float = 1.0
    scales: ErrorScales | None = None

    def select(self, tokens: slice = slice(None), heads: slice = slice(None)) -> OracleOutput:
        """The results of a block of tokens and heads (``[tokens, heads]`` of every field)."""
        s = self.scales
        scales = None if s is None else ErrorScales(
            s.abs_weighted[tokens, heads], s.rms_weighted[tokens, heads], s.score_magnitude[tokens, heads],
            s.max_candidates,
        )  # fmt: skip
        return OracleOutput(self.output[tokens, heads], self.lse[tokens, heads], self.lse_convention,
                            self.lse_scale, scales)  # fmt: skip


def _valid_lanes(indices: torch.Tensor, length: torch.Tensor | None, token: int) -> torch.Tensor:
    """The valid flat indices of one token's index row (int64, in lane order)."""
    row = indices[token].to(torch.int64)
    if length is not None:
        n = max(0, min(int(length[token]), row.shape[0]))
        row = row[:n]
    return row[row >= 0]


_store: MutableMapping[bytes, OracleOutput] | None = None


@contextmanager
def memoized(store: MutableMapping[bytes, OracleOutput]) -> Iterator[MutableMapping[bytes, OracleOutput]]:
    """Within the block, :func:`oracle_forward` keeps its results in ``store``, keyed by a BLAKE2b
    digest of every argument (each tensor's dtype, shape, strides, alignment, device and the bytes
    of its elements; every other argument's ``repr``), and returns a copy of a stored result for
    equal arguments (a call that raises stores nothing).

    For a harness that runs the same suite many times in one process against different kernels
    (this package's wrong-kernel gate): the inputs of a test are drawn from the same seed every
    time, so their oracle is the same. The result is a pure function of the bytes, so a kernel that
    writes into its inputs changes the key, never the answer; callers get copies, so nothing they
    do changes ``store``. ``store`` may refuse entries (a bounded mapping). Not thread-safe.
    """
    global _store
    previous, _store = _store, store
    try:
        yield store
    finally:
        _store = previous


def _digest(arguments: dict[str, Any]) -> bytes:
    h = hashlib.blake2b(digest_size=32)
    for name, value in arguments.items():
        h.update(name.encode())
        if isinstance(value, torch.Tensor):
            layout = (value.dtype, tuple(value.shape), value.stride(), value.data_ptr() % 16, value.device)
            h.update(repr(layout).encode())  # what the cache checks read, besides the elements
            flat = value.detach().cpu().contiguous().reshape(-1)
            h.update(flat.view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(value).encode())
    return h.digest()


#: arguments of the bundled reference's ``sparse_mla_forward`` that are not the call's (ignored here).
_REFERENCE_ONLY = ("grid_release", "chunk_tokens", "return_fp32", "backend", "check_indices")


def oracle_forward(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, **arguments: Any) -> OracleOutput:
    """Sparse MLA in float64 (the keyword names and defaults of ``attention.sparse_mla_forward``).

    Args:
        q: ``[T, H, d_qk]`` queries (any float dtype; BF16 in the suites).
        kv_cache: the packed uint8 main cache (see ``formats.parse_cache``).
        indices: ``[T, topk]`` or ``[T, 1, topk]`` integer flat token indices.
        arguments: the call's keywords (``attention.call.CALL_ARGUMENTS``: ``sm_scale``, ``fmt``,
            ``page_block_size``, ``topk_length``, ``attn_sink`` (per-head natural-log logit:
            denominator mass, no value), ``extra_kv_cache``, ``extra_indices``, ``extra_topk_length``,
            ``extra_page_block_size``, ``lse_convention``, ``lse_scale``); the bundled reference's own
            (``grid_release``, ``chunk_tokens``, ``return_fp32``, ``backend``, ``check_indices``) are
            accepted and ignored: the oracle computes the math only, one token at a time.

    Returns:
        :class:`OracleOutput` (float64 output ``[T, H, 512]``, LSE ``[T, H]``, its convention and
        the rows' :class:`ErrorScales`). Inside :func:`memoized`, a copy of the stored result for a
        call with the same bytes.

    Raises:
        TypeError: an unknown keyword; as ``SparseMlaCall.read``.
        ValueError: as ``SparseMlaCall.read`` (``extra_kv_cache`` without ``extra_indices`` or the
            reverse, a bad cache or index rows); a valid index at or past its cache's token count.
    """
    unknown = sorted(set(arguments) - set(CALL_ARGUMENTS) - set(_REFERENCE_ONLY))
    if unknown:
        raise TypeError(f"oracle_forward: unexpected keyword argument(s) {unknown}; expected {CALL_ARGUMENTS}")
    call = SparseMlaCall.read(q, kv_cache, indices, **{k: v for k, v in arguments.items() if k in CALL_ARGUMENTS})
    if _store is None:
        return _oracle(call)
    key = _digest({"q": call.q, "kv_cache": call.main.cache, "indices": call.main.indices, **call.kwargs()})
    result = _store.get(key)
    if result is None:
        result = _oracle(call)
        _store[key] = result
    return copy.deepcopy(result)  # the caller's own tensors: its writes never reach the store


def _oracle(call: SparseMlaCall) -> OracleOutput:
    """The float64 computation of :func:`oracle_forward`."""
    f, ef = call.record_formats
    q, sm_scale, attn_sink = call.q, call.sm_scale, call.attn_sink
    lse_convention, lse_scale = call.lse_convention, call.lse_scale
    indices, topk_length = call.main.indices, call.main.topk_length
    device = q.device
    main = formats.unpack_dequantize(
        call.main.cache, f, page_block_size=call.main.layout.page_block_size, dtype=torch.float64
    ).reshape(-1, f.d_qk)
    tables = [main]
    extra_indices = extra_topk_length = None
    if call.extra is not None:
        extra_indices, extra_topk_length = call.extra.indices, call.extra.topk_length
        extra = formats.unpack_dequantize(
            call.extra.cache, ef, page_block_size=call.extra.layout.page_block_size, dtype=torch.float64
        ).reshape(-1, ef.d_qk)
        tables.append(extra)
    table = torch.cat(tables).to(device)

    num_tokens, num_heads = q.shape[0], q.shape[1]
    q64 = q.to(torch.float64)
    sink = attn_sink.to(torch.float64) if attn_sink is not None else None
    output = torch.zeros((num_tokens, num_heads, f.d_v), dtype=torch.float64, device=device)
    lse = torch.empty((num_tokens, num_heads), dtype=torch.float64, device=device)
    abs_weighted = torch.zeros_like(output)
    rms_weighted = torch.zeros((num_tokens, num_heads), dtype=torch.float64, device=device)
    score_magnitude = torch.zeros((num_tokens, num_heads), dtype=torch.float64, device=device)
    max_candidates = 0
    for t in range(num_tokens):
        candidates = _valid_lanes(indices, topk_length, t)
        if candidates.numel() and int(candidates.max()) >= main.shape[0]:
            raise ValueError(f"indices: token {t} references a row past the {main.shape[0]}-token cache")
        if extra_indices is not None:
            extra_candidates = _valid_lanes(extra_indices, extra_topk_length, t)
            num_extra = table.shape[0] - main.shape[0]
            if extra_candidates.numel() and int(extra_candidates.max()) >= num_extra:
                raise ValueError(f"extra_indices: token {t} references a row past the extra cache")
            candidates = torch.cat([candidates, extra_candidates + main.shape[0]])
        max_candidates = max(max_candidates, int(candidates.numel()))
        if candidates.numel() == 0:
            lse_e = torch.full((num_heads,), -math.inf, dtype=torch.float64, device=device)
        else:
            distinct, counts = torch.unique(candidates, return_counts=True)
            rows = table[distinct]  # [U, d_qk]
            scores = (q64[t] @ rows.T) * sm_scale  # [H, U], dense over the distinct rows
            top = scores.max(dim=1, keepdim=True).values
            weights = counts.to(torch.float64) * torch.exp(scores - top)  # [H, U]
            total = weights.sum(dim=1)  # sum_j exp(s_j - top)
            denominator = total + (torch.exp(sink - top[:, 0]) if sink is not None else 0.0)
            values = rows[:, : f.d_v]
            output[t] = (weights @ values) / denominator.unsqueeze(1)
            lse_e = top[:, 0] + torch.log(total)
            w = weights / denominator.unsqueeze(1)  # [H, U], a duplicate's lanes share its weight
            abs_weighted[t] = w @ values.abs()
            rms_weighted[t] = ((w * w / counts) @ (values * values).sum(dim=1)).sqrt()
            score_magnitude[t] = ((q64[t].abs() @ rows.abs().T) * abs(sm_scale)).max(dim=1).values
        if lse_convention == "flashmla":
            lse[t] = torch.where(torch.isinf(lse_e) & (lse_e < 0), math.inf, lse_e)
            continue
        lse_full = torch.logaddexp(lse_e, sink) if sink is not None else lse_e
        lse[t] = lse_full / math.log(2.0) * lse_scale
    scales = ErrorScales(abs_weighted, rms_weighted, score_magnitude, max_candidates)
    return OracleOutput(output, lse, lse_convention, lse_scale, scales)
