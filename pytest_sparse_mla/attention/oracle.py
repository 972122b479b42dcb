"""Float64 oracle for sparse MLA: the plainest correct computation, used only to judge others.

It shares no code with ``attention/reference.py`` (a test that compared the reference with
itself would prove nothing). It reads the caches through ``formats.unpack_dequantize`` (the byte
rules are specified and tested there) and then, for a block of query tokens at a time, in float64:

1. marks each token's valid lanes: main lanes with index ``>= 0`` before
   ``clamp(topk_length, 0, topk)``, then extra lanes likewise (shifted past the main table);
2. gathers every lane's table row, zeroing the rows of invalid lanes (a duplicate index is two
   lanes, so it counts twice);
3. forms the score matrix ``sm_scale * q @ rows.T`` over the lanes and a softmax masked to the
   valid lanes, with ``exp(attn_sink[h])`` added to the denominator;
4. returns ``sum_j w_j V_j`` (``V`` = the first 512 dims of a row) and the LSE in the requested
   convention (``attention.conventions``).

Only rows a token validly references reach the arithmetic (an invalid lane's row is replaced by
zeros before any product and its score by ``-inf``), so bytes of unreferenced or masked slots
(NaN, 0xFF) cannot reach the result. Semantics: FlashMLA's ``tests/ref.py`` (deepseek-ai/FlashMLA)
and FlashInfer's ``tests/attention/test_sparse_mla_sm120.py`` reference (flashinfer-ai/flashinfer).
Blocks of tokens (at most :data:`BLOCK_BYTES` of gathered float64 rows each) are a matter of speed
only: every token's result is computed from its own lanes alone.

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
from pytest_sparse_mla.attention.call import CALL_ARGUMENTS, Candidates, SparseMlaCall

__all__ = ["ErrorScales", "OracleOutput", "memoized", "oracle_forward"]

#: The smallest normal fp32 (and BF16) magnitude: nonzero magnitudes below it are subnormals, which
#: a flush-to-zero kernel reads or produces as 0 (``ErrorScales.flush_magnitude``).
FP32_MIN_NORMAL = 2.0**-126


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
        key_magnitude: ``[T, H]`` float64, ``max_j |sm_scale| * sum_d |K_jd|`` over the NoPE part
            (0 for an empty row): an absolute error ``a`` in every NoPE query element (a
            quantization floor) moves a logit by at most ``a`` times this.
        value_max: ``[T, H]`` float64, ``max_j max_d |V_jd|`` over the valid lanes (0 for an empty
            row): a weight that flushes to zero in fp32 (``2**-126``) moves an output element by
            at most ``2**-126`` times this.
        flush_magnitude: ``[T, H]`` float64, ``max_j |sm_scale| * sum_d |q_d| |K_jd|`` over the
            dimensions where ``q_d`` or ``K_jd`` is an fp32/BF16 subnormal (nonzero, below
            ``2**-126``), plus ``d_qk * 2**-126 * |sm_scale|`` (0 for an empty row): a kernel that
            flushes subnormal operands to zero (GPU fp32 arithmetic and tensor-core inputs under
            flush-to-zero, PTX ISA ``.ftz``) loses those products, so a logit moves by at most this.
            The smallest encodable scales make such keys (an E4M3 code times ``2**-126`` or
            ``2**-127``).
        slot0_weight: ``[T, H]`` float64, ``sum_j w_j`` over the valid lanes whose index value is 0
            (row 0 of the main or of the extra cache; 0 for a row that reads no index 0): which rows
            a kernel that takes index 0 for the mask sentinel gets wrong
            (``tolerances`` names that cause when exactly those rows are wrong).
        slot0_output: ``[T, H, d_v]`` float64, ``sum_j w_j V_j`` over the same lanes: with it the
            output of the call with those lanes masked is ``(output - slot0_output) / (1 - slot0_weight)``
            (the counterfactual ``tolerances`` compares a wrong result with).
    """

    abs_weighted: torch.Tensor
    rms_weighted: torch.Tensor
    score_magnitude: torch.Tensor
    max_candidates: int
    key_magnitude: torch.Tensor | None = None
    value_max: torch.Tensor | None = None
    flush_magnitude: torch.Tensor | None = None
    slot0_weight: torch.Tensor | None = None
    slot0_output: torch.Tensor | None = None


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
            s.max_candidates, None if s.key_magnitude is None else s.key_magnitude[tokens, heads],
            None if s.value_max is None else s.value_max[tokens, heads],
            None if s.flush_magnitude is None else s.flush_magnitude[tokens, heads],
            None if s.slot0_weight is None else s.slot0_weight[tokens, heads],
            None if s.slot0_output is None else s.slot0_output[tokens, heads],
        )  # fmt: skip
        return OracleOutput(self.output[tokens, heads], self.lse[tokens, heads], self.lse_convention,
                            self.lse_scale, scales)  # fmt: skip


def _lane_mask(source: Candidates, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(flat [T, topk] int64, valid [T, topk] bool)`` of one candidate source, on ``device``:
    its index rows, and whether lane ``j`` of token ``t`` is valid (index ``>= 0`` and
    ``j < clamp(topk_length[t], 0, topk)``)."""
    flat = source.indices.to(device, torch.int64)
    valid = flat >= 0
    if source.topk_length is not None:
        lanes = torch.arange(flat.shape[1], device=device)
        valid &= lanes < source.topk_length.to(device, torch.int64).clamp(min=0)[:, None]
    return flat, valid


def _check_in_range(flat: torch.Tensor, valid: torch.Tensor, rows: int, message: str) -> None:
    """Raise ``ValueError(message.format(t))`` for the first token ``t`` with a valid lane at or past ``rows``."""
    bad = (valid & (flat >= rows)).any(dim=1)
    if bool(bad.any()):
        raise ValueError(message.format(int(bad.nonzero()[0, 0])))


#: Bytes of gathered float64 rows per block of query tokens, by device type (a token alone may
#: exceed it): on a CPU, blocks that stay in cache are fastest; on a GPU, large ones.
BLOCK_BYTES = {"cpu": 1 << 20, "other": 256 << 20}


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
            accepted and ignored: the oracle computes the math only.

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
    f = call.main.layout.fmt
    q, sm_scale, attn_sink = call.q, call.sm_scale, call.attn_sink
    lse_convention, lse_scale = call.lse_convention, call.lse_scale
    device = q.device
    tables = [
        formats.unpack_dequantize(source.cache, layout=source.layout, dtype=torch.float64).reshape(
            -1, source.layout.fmt.d_qk
        )
        for source in call.sources
    ]
    main = tables[0]
    table = torch.cat(tables).to(device)

    num_tokens, num_heads = q.shape[0], q.shape[1]
    flat, valid = _lane_mask(call.main, device)
    zero = flat == 0  # lanes whose index value is 0 (row 0 of their own cache)
    past_main = f"indices: token {{}} references a row past the {main.shape[0]}-token cache"
    _check_in_range(flat, valid, main.shape[0], past_main)
    if call.extra is not None:
        extra_flat, extra_valid = _lane_mask(call.extra, device)
        _check_in_range(extra_flat, extra_valid, table.shape[0] - main.shape[0],
                        "extra_indices: token {} references a row past the extra cache")  # fmt: skip
        flat = torch.cat([flat, extra_flat + main.shape[0]], dim=1)
        valid = torch.cat([valid, extra_valid], dim=1)
        zero = torch.cat([zero, extra_flat == 0], dim=1)
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)  # each row's valid lanes first
    valid = valid.gather(1, order)
    zero = zero.gather(1, order) & valid
    flat = torch.where(valid, flat.gather(1, order), 0)  # an invalid lane reads row 0, then zeroed below
    counts = valid.sum(dim=1)
    q64 = q.to(torch.float64)
    sink = attn_sink.to(device, torch.float64) if attn_sink is not None else None
    output = torch.zeros((num_tokens, num_heads, f.d_v), dtype=torch.float64, device=device)
    lse_e = torch.empty((num_tokens, num_heads), dtype=torch.float64, device=device)
    abs_weighted = torch.zeros_like(output)
    rms_weighted = torch.zeros((num_tokens, num_heads), dtype=torch.float64, device=device)
    score_magnitude = torch.zeros((num_tokens, num_heads), dtype=torch.float64, device=device)
    key_magnitude = torch.zeros((num_tokens, num_heads), dtype=torch.float64, device=device)
    value_max = torch.zeros((num_tokens, num_heads), dtype=torch.float64, device=device)
    flush_magnitude = torch.zeros((num_tokens, num_heads), dtype=torch.float64, device=device)
    q_abs = q64.abs()
    q_tiny = q_abs * (q_abs < FP32_MIN_NORMAL)  # [T, H, d_qk]: subnormal query elements (else 0)
    subnormals = bool(q_tiny.any()) or bool(((table != 0) & (table.abs() < FP32_MIN_NORMAL)).any())
    slot0_weight = torch.zeros((num_tokens, num_heads), dtype=torch.float64, device=device)
    slot0_output = torch.zeros_like(output)
    max_candidates = int(counts.max()) if num_tokens else 0
    budget = BLOCK_BYTES["cpu" if device.type == "cpu" else "other"]
    block = max(1, budget // max(1, max_candidates * table.shape[1] * 8))
    for start in range(0, num_tokens, block):
        tokens = slice(start, min(start + block, num_tokens))
        width = max(1, int(counts[tokens].max()))  # lanes past every token's valid ones are dropped
        lane_ok = valid[tokens, :width]  # [B, L]
        has = lane_ok.any(dim=1)[:, None]  # [B, 1]: the token has a valid lane
        rows = table[flat[tokens, :width]].masked_fill(~lane_ok[..., None], 0.0)  # [B, L, d_qk]
        scores = torch.bmm(q64[tokens], rows.transpose(1, 2)) * sm_scale  # [B, H, L]
        scores = scores.masked_fill(~lane_ok[:, None, :], -math.inf)
        top = scores.amax(dim=2)  # [B, H]; -inf for a token without valid lanes
        shift = torch.where(torch.isfinite(top), top, 0.0)
        weights = torch.exp(scores - shift[..., None])  # [B, H, L]; invalid lanes 0
        total = weights.sum(dim=2)  # sum_j exp(s_j - top)
        denominator = total + (torch.exp(sink - shift) if sink is not None else 0.0)
        denominator = torch.where(has, denominator, 1.0)  # an empty row: weights 0, output 0
        w = weights / denominator[..., None]  # [B, H, L]
        values = rows[..., : f.d_v]
        output[tokens] = torch.bmm(w, values)
        lse_e[tokens] = torch.where(has, shift + torch.log(total), -math.inf)
        rows_abs = rows.abs()
        abs_weighted[tokens] = torch.bmm(w, rows_abs[..., : f.d_v])
        rms_weighted[tokens] = torch.bmm(w * w, (values * values).sum(dim=2, keepdim=True))[..., 0].sqrt()
        magnitude = torch.bmm(q_abs[tokens], rows_abs.transpose(1, 2)) * abs(sm_scale)  # invalid lanes 0
        score_magnitude[tokens] = magnitude.amax(dim=2)
        keys = rows_abs[..., : f.d_nope].sum(dim=2).amax(dim=1) * abs(sm_scale)  # [B]
        key_magnitude[tokens] = keys[:, None].expand(-1, num_heads)
        value_max[tokens] = rows_abs[..., : f.d_v].amax(dim=(1, 2))[:, None].expand(-1, num_heads)
        flushed = table.shape[1] * FP32_MIN_NORMAL  # products of two normal numbers below 2**-126
        if subnormals:  # the products with a subnormal operand (keys below 2**-126 too, else 0)
            tiny = rows_abs * (rows_abs < FP32_MIN_NORMAL)
            flushed = flushed + (torch.bmm(q_tiny[tokens], rows_abs.transpose(1, 2))
                                 + torch.bmm(q_abs[tokens], tiny.transpose(1, 2))).amax(dim=2)  # fmt: skip
        flush_magnitude[tokens] = torch.where(has, flushed * abs(sm_scale), 0.0)
        zero_lanes = zero[tokens, :width]
        if bool(zero_lanes.any()):  # most blocks read no index 0: nothing to add
            w0 = w * zero_lanes[:, None, :]
            slot0_weight[tokens] = w0.sum(dim=2)
            slot0_output[tokens] = torch.bmm(w0, values)
    if lse_convention == "flashmla":
        lse = torch.where(torch.isinf(lse_e) & (lse_e < 0), math.inf, lse_e)
    else:
        lse_full = torch.logaddexp(lse_e, sink) if sink is not None else lse_e
        lse = lse_full / math.log(2.0) * lse_scale
    scales = ErrorScales(
        abs_weighted, rms_weighted, score_magnitude, max_candidates, key_magnitude, value_max,
        flush_magnitude=flush_magnitude, slot0_weight=slot0_weight, slot0_output=slot0_output,
    )  # fmt: skip
    return OracleOutput(output, lse, lse_convention, lse_scale, scales)
