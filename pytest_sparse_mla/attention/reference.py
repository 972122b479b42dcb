"""Bundled reference sparse-MLA forward over packed FP8 paged KV caches (DSV4 and DSV3.2).

Math (flashinfer-ai/flashinfer ``tests/attention/sparse_mla_test_utils.py`` ``_ref_sparse_attn``
and the ``_sparse_mla_sm120_paged_attention`` docstring in ``flashinfer/mla/_sparse_mla_sm120/_api.py``):
for query token ``t`` and head ``h``, the candidates are the valid lanes of the main index row
followed by the valid lanes of the extra index row; candidate ``j`` is the dequantized latent row
``K_j`` of its cache (``formats``). Scores ``s_j = sm_scale * <q[t, h], K_j>`` over all ``d_qk`` dims; one softmax over
main and extra candidates together, plus ``exp(attn_sink[h])`` in the denominator (the sink has no
value); output ``sum_j softmax_j * V_j`` where ``V_j = K_j`` (DSV4, 512 dims) or the first 512 dims
of ``K_j`` (DSV3.2, ``d_qk`` 576).

Index rules: a lane is valid iff its index is ``>= 0`` and its position is ``<
clamp(topk_length, 0, topk)``; duplicates count once per occurrence; a flat index is ``page *
page_block_size + slot``. Positive indices ``>=`` the cache's token count inside the valid prefix are
undefined behaviour in the SM120 kernels (no bounds check), so the reference rejects them.

How it computes (the properties the invariant suites check hold *by construction*):

* Each cache is dequantized once per call into fp32 rows, plus one shared all-zero row; every
  invalid lane (negative, past ``topk_length``, padding) gathers the zero row, so bytes of masked or
  unreferenced slots (NaN, 0xFF scales) never enter any arithmetic (the kernels' "shared zero row",
  FlashInfer ``common/zero_row.cuh``).
* Lanes are processed in tiles of :data:`LANE_TILE` (64, FlashInfer's candidate tile ``BI``) with an
  fp32 online softmax; the main row and the extra row are tiled separately (each padded to a
  multiple of 64 with invalid lanes). A tile with no valid lane leaves the running max, sum and
  output bit-for-bit unchanged, so padding an index row with ``-1`` changes nothing.
* Heads are processed in fixed groups of :data:`HEAD_GROUP` (8; torch backend): every matrix product and every
  order-dependent sum runs per group on one fixed shape, so a head's result does not depend on how
  many heads the query has (BLAS kernels choose different reduction orders for different matrix
  sizes, a measured fact for MKL on CPU; CUDA reductions pick block shapes from the row count).
  Elementwise steps and the (exact) running max run on all groups at once.
* Tokens are processed in chunks (``chunk_tokens``; default 64 on CPU, 512 on CUDA), so memory is
  bounded by the chunk, not by ``num_tokens``: DeepSeek-V4 prefill shapes (4096 tokens, 64 heads,
  128 + 512 candidates) run in well under 100 MiB of working memory besides the dequantized caches.
  Off the CPU every chunk runs at the full chunk size (the last padded with masked tokens), so the
  GEMM shapes, and with them cuBLAS's algorithm, do not depend on ``num_tokens``: a token's bits do
  not depend on the call's size.
* A positive index past its cache inside the valid prefix is counted per token on the device
  (``SparseMlaOutput.out_of_range``; the lane is skipped, never read). The one host
  synchronisation of a call is the check of those counts after the computation, which raises
  ``ValueError``; ``check_indices=False`` leaves it out, and it is left out by default while the
  current CUDA stream is capturing a graph (see "CUDA graphs" below).

Backends (``backend=``, :func:`resolve_backend`). ``"torch"`` (CPU default) is the loop described
above: the caches dequantized into one fp32 table with its zero row, the table row of every lane,
then the finalisation (divide, sink as ``sigmoid(lse - sink)``, LSE convention) on the chunk's
state. ``"triton"`` (CUDA default when triton imports; interpreted on the CPU under
``TRITON_INTERPRET=1``) runs the whole forward in Triton kernels (``attention._triton_forward``):
one gathers each valid candidate lane's token, dequantized exactly, as a BF16 row (only the
candidates are read, never a whole cache); in the other each program (a token and a group of heads)
decides the validity of its lanes from the index rows and lengths, runs the online softmax in
64-lane tiles on BF16 tensor cores with exact products and fp32 accumulation (probabilities split
into BF16 pieces), folds its chunks of lanes and finalises; a decode call with few programs splits
its chunks over programs and folds them in a third launch, with the same bits. The DeepSeek-V4.1
formats (``dsv4_1``, ``dsv4_1_swa``, ``dsv4_1_indexed``) run it too: their candidates are gathered
and dequantized by batched torch operations (``_triton_forward.gather_records``; every value is a
BF16 number, so the rows are exact) into the same BF16 rows, which the DSV4 attention kernel reads
(512 dims, ``V = K``). Why it stays within 1e-5 of the oracle and why the same invariants hold:
``docs/design/reference-kernel.md``.
H200 timings of both: ``docs/benchmarks.md``.

CUDA graphs: a call makes no host synchronisation and no host decision on device values except
the out-of-range check, and allocates its outputs with the caching allocator, so it can be
captured in ``torch.cuda.graph`` (the outputs allocated during capture are the ones every replay
writes). Warm the call up once outside the capture (Triton compiles on first use), update the
captured input tensors in place between replays, and read ``SparseMlaOutput.out_of_range`` after
a replay to see indices past a cache (the capture skips the host check).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from pytest_sparse_mla import capabilities, formats
from pytest_sparse_mla.attention.call import Candidates, SparseMlaCall
from pytest_sparse_mla.attention.conventions import route_for

_TRITON_MODULE = "pytest_sparse_mla.attention._triton_forward"

__all__ = [
    "SparseMlaOutput",
    "sparse_mla_forward",
    "LANE_TILE",
    "HEAD_GROUP",
    "default_chunk_tokens",
    "BACKENDS",
    "resolve_backend",
    "triton_forward_module",
    "triton_unavailable_reason",
]

#: Candidate lanes per tile (FlashInfer's DSV4 candidate tile ``BI`` = 64).
LANE_TILE = 64
#: Heads per fixed-shape matrix product (divides every DeepSeek-V4 per-rank head count).
HEAD_GROUP = 8
#: Backends selectable with ``backend=``.
BACKENDS: tuple[str, ...] = ("torch", "triton")
_CHUNK_TOKENS_CPU = 64
_CHUNK_TOKENS_OTHER = 512
_LOG2E = 1.0 / math.log(2.0)
_FP32_LOWEST = torch.finfo(torch.float32).min


@dataclass(frozen=True)
class SparseMlaOutput:
    """Result of :func:`sparse_mla_forward`.

    Attributes:
        output: ``[num_tokens, num_heads, 512]`` BF16 attention output (rounded from fp32).
        lse: ``[num_tokens, num_heads]`` fp32 LSE in the requested convention
            (``attention.conventions``).
        route: ``"decode"`` if ``num_tokens <= 64`` else ``"prefill"`` (FlashInfer's default route).
        output_fp32: the fp32 output before BF16 rounding when ``return_fp32=True``, else ``None``.
        grid: what ``dispatch.enforce_grid`` returned when a FlashInfer release was enforced
            (``grid_release``), else ``None``.
        out_of_range: ``[num_tokens]`` int32 on the query's device: per token, the number of lanes
            inside the valid prefix (main and extra together) whose index is at or past its
            cache's token count; those lanes were skipped. All zero unless the host check was
            left out (``check_indices=False``, or a CUDA graph capture), since the check raises.
    """

    output: torch.Tensor
    lse: torch.Tensor
    route: str
    output_fp32: torch.Tensor | None = None
    grid: Any = None
    out_of_range: torch.Tensor | None = None


def default_chunk_tokens(device: torch.device) -> int:
    """Default tokens per chunk: 64 on CPU (the gathered tile stays in cache), 512 elsewhere."""
    return _CHUNK_TOKENS_CPU if device.type == "cpu" else _CHUNK_TOKENS_OTHER


#: The Triton forward's kernels: ``triton_forward_module()`` imports them (interpreted without a CUDA
#: device), ``triton_unavailable_reason(device)`` says why ``backend="triton"`` cannot run there.
_TRITON = capabilities.TritonKernels(_TRITON_MODULE)
triton_forward_module = _TRITON.load
triton_unavailable_reason = _TRITON.unavailable_reason


def resolve_backend(backend: str | None, device: torch.device | str) -> str:
    """The backend a call runs: ``backend`` itself, or for ``None`` ``"triton"`` on CUDA when
    :func:`triton_unavailable_reason` has no objection, else ``"torch"``.

    Raises:
        ValueError: ``backend`` is not ``None``, ``"torch"`` or ``"triton"``, or is ``"triton"``
            where it cannot run (the message gives the reason).
    """
    if backend is None:
        if torch.device(device).type == "cuda" and triton_unavailable_reason(device) is None:
            return "triton"
        return "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected None or one of {BACKENDS}")
    if backend == "triton":
        reason = triton_unavailable_reason(device)
        if reason is not None:
            raise ValueError(f"backend='triton' cannot run on {torch.device(device)}: {reason}")
    return backend


def _candidate_lanes(source: Candidates, offset: int, zero_row: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Table rows of every lane of ``source`` (its index ``+ offset``; invalid lanes ->
    ``zero_row``), padded to a multiple of the tile.

    Returns ``(rows [T, Kp] int64, valid [T, Kp] bool, out_of_range [T, K] bool)``; lanes past the
    cache (``source.num_slots``) are invalid (they name the zero row) and flagged in ``out_of_range``.
    """
    num_tokens, topk = source.indices.shape
    idx = source.indices.to(torch.int64)
    valid = source.valid_lanes()
    out_of_range = valid & (idx >= source.num_slots)
    valid &= ~out_of_range  # skipped, never read (counted in SparseMlaOutput.out_of_range)
    rows = torch.where(valid, idx + offset, zero_row)
    pad = (-topk) % LANE_TILE
    if pad:
        rows = torch.cat([rows, rows.new_full((num_tokens, pad), zero_row)], dim=1)
        valid = torch.cat([valid, valid.new_zeros((num_tokens, pad))], dim=1)
    return rows, valid, out_of_range


def _raise_out_of_range(source: Candidates, bad: torch.Tensor) -> None:
    token, lane = (int(v) for v in bad.nonzero()[0].tolist())
    value = int(source.indices[token, lane])
    cache, name, _ = source.names
    num_rows = source.num_slots
    raise ValueError(
        f"{name}[{token}, {lane}]={value} is out of range: {cache} holds {num_rows} tokens "
        f"(num_pages * page_block_size), so valid flat indices are 0..{num_rows - 1} (negative = "
        "masked). The SM120 kernels do not bounds-check indices (undefined behaviour); the "
        "reference rejects them"
    )


@torch.no_grad()
def sparse_mla_forward(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    *,
    sm_scale: float,
    fmt: formats.PackedFormat | str = "dsv4",
    page_block_size: int | None = None,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    extra_page_block_size: int | None = None,
    lse_convention: str = "flashinfer",
    lse_scale: float = 1.0,
    grid_release: str | None = None,
    chunk_tokens: int | None = None,
    return_fp32: bool = False,
    backend: str | None = None,
    check_indices: bool | None = None,
) -> SparseMlaOutput:
    """Sparse MLA attention over a packed FP8 paged KV cache (optionally a second, extra cache).

    Args:
        q: ``[T, H, d_qk]`` BF16 queries (``d_qk`` 512 for DSV4, 576 for DSV3.2); any ``H >= 1``.
        kv_cache: packed uint8 main cache in any form ``formats.parse_cache`` accepts (2-D, 3-D,
            HND, NHD; tight or padded page stride).
        indices: ``[T, topk]`` or ``[T, 1, topk]`` int32 flat token indices into ``kv_cache``
            (``page * page_block_size + slot``); negative = masked; row-pitched views allowed.
        sm_scale: score scale (finite float), applied to the full ``d_qk`` dot product; DeepSeek-V4
            uses ``512 ** -0.5``.
        fmt: the call format (``formats.CALL_FORMATS``): ``"dsv4"`` (584 B/token) or ``"dsv3_2"``
            (656 B/token) for both caches, ``"dsv4_1"`` (528 B SWA main cache, 288 B FP4 extra cache).
        page_block_size: tokens per main page, only needed to disambiguate a 2-D cache.
        topk_length: optional ``[T]`` int32 valid prefix length per token, clamped to ``[0, topk]``.
        attn_sink: optional ``[H]`` fp32 per-head logit (natural-log units) that adds
            ``exp(attn_sink[h])`` to the denominator and has no value. ``-inf`` means no sink.
        extra_kv_cache: optional second packed cache (same format, its own page size), e.g. the
            DeepSeek-V4 C4 (page 64) or C128 (page 2) compressed cache.
        extra_indices: ``[T, extra_topk]`` or ``[T, 1, extra_topk]`` int32; required iff
            ``extra_kv_cache`` is given. Its candidates follow the main ones in one softmax.
        extra_topk_length: optional ``[T]`` int32, clamped to ``[0, extra_topk]``.
        extra_page_block_size: tokens per extra page, only for a 2-D extra cache.
        lse_convention: ``"flashinfer"`` (log2, sink included, times ``lse_scale``) or
            ``"flashmla"`` (natural log, sink excluded, empty row ``+inf``); see
            ``attention.conventions``.
        lse_scale: positive factor on the final FlashInfer LSE (``math.log(2)`` = natural log).
        grid_release: a FlashInfer release (``"0.6.17"``): before computing, the call is checked
            against that release's SM120 dispatch grid by ``pytest_sparse_mla.dispatch.enforce_grid``,
            which raises the release's exact error for a shape it cannot run (a DeepSeek-V4.1 call
            is judged as FlashInfer's ``DSV4_1_INLINE`` from 0.7.4, as ``DSV4_1`` in 0.7.1-0.7.2.post1
            with a ``FooterRecordsWarning`` where a page holds more than one token: those releases read
            footer pages, not the inline records this package writes).
        chunk_tokens: tokens per chunk of ``backend="torch"`` (memory bound); default
            :func:`default_chunk_tokens`. ``backend="triton"`` keeps no per-token state in memory
            and ignores it.
        return_fp32: also return the fp32 output before BF16 rounding (``output_fp32``).
        backend: ``"torch"`` (the batched-GEMM loop below) or ``"triton"`` (the whole forward in
            two Triton kernels, ``attention._triton_forward``); ``None`` picks ``"triton"`` for
            CUDA tensors when triton imports, else ``"torch"`` (see :func:`resolve_backend`).
            Both compute the same math to fp32 accuracy with the same invariants; their
            bits differ (different summation orders).
        check_indices: raise ``ValueError`` for a positive index past its cache inside the valid
            prefix, after the computation (one host synchronisation: the device-side counts in
            ``out_of_range`` are copied to the host). ``None`` (default): check unless the current
            CUDA stream is capturing a graph; ``True``: always (refused during a capture, which
            cannot synchronise); ``False``: never (read ``out_of_range`` yourself).

    Returns:
        :class:`SparseMlaOutput`: BF16 output ``[T, H, 512]``, fp32 LSE ``[T, H]``, the route.
        A row with no valid candidate gets output 0 and LSE ``-inf`` (FlashInfer convention without
        sink), ``sink * log2(e) * lse_scale`` (with a sink) or ``+inf`` (FlashMLA convention).
        ``T == 0`` returns empty tensors.

    Raises:
        TypeError: a tensor argument is not a tensor or has the wrong dtype (q BF16, indices and
            lengths int32, attn_sink fp32, caches uint8); a scalar is not a number.
        ValueError: wrong shapes (q not 3-D with ``d_qk`` of ``fmt``; index rows not ``T`` long;
            ``topk_length`` not ``[T]``; ``attn_sink`` not ``[H]``); an invalid cache
            (``formats.parse_cache``); ``extra_kv_cache`` without ``extra_indices`` or the reverse;
            ``extra_topk_length``/``extra_page_block_size`` without an extra cache; tensors on
            different devices; a positive index ``>=`` the cache's token count inside the valid
            prefix; a non-finite ``sm_scale``; bad ``lse_convention``/``lse_scale``/``chunk_tokens``;
            an unknown ``backend`` or ``"triton"`` where it cannot run (:func:`resolve_backend`).
        Whatever ``dispatch.enforce_grid`` raises for a release that cannot run the shape.
        ValueError: ``grid_release`` with a main cache of V4.1 indexed (FP4) records, which no
            FlashInfer release reads as the main cache.
        ValueError: ``check_indices=True`` while the current CUDA stream is capturing a graph.
    """
    call = SparseMlaCall.read(
        q, kv_cache, indices, sm_scale=sm_scale, fmt=fmt, page_block_size=page_block_size, topk_length=topk_length,
        attn_sink=attn_sink, extra_kv_cache=extra_kv_cache, extra_indices=extra_indices,
        extra_topk_length=extra_topk_length, extra_page_block_size=extra_page_block_size,
        lse_convention=lse_convention, lse_scale=lse_scale, validate=True,
    )  # fmt: skip
    if chunk_tokens is not None and (
        isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1
    ):
        raise ValueError(f"chunk_tokens={chunk_tokens!r}: expected a positive int or None")
    if check_indices not in (None, True, False):
        raise ValueError(f"check_indices={check_indices!r}: expected None, True or False")
    return _forward(call, grid_release, chunk_tokens, return_fp32, backend, check_indices)


def _forward(
    call: SparseMlaCall,
    grid_release: str | None,
    chunk_tokens: int | None,
    return_fp32: bool,
    backend: str | None,
    check_indices: bool | None,
) -> SparseMlaOutput:
    """The forward of a checked call (:func:`sparse_mla_forward`)."""
    q, f, fmt = call.q, call.main.layout.fmt, call.fmt
    num_tokens, num_heads = call.num_tokens, call.num_heads
    main, extra = call.main, call.extra

    grid = None
    # FlashInfer returns before any dispatch when q.shape[0] == 0 (flashinfer/mla/_sparse_mla_sm120/
    # _api.py custom op), so an empty batch never meets the grid.
    if grid_release is not None and num_tokens > 0:
        from pytest_sparse_mla.dispatch import FooterRecordsWarning, enforce_grid, format_model

        model, footer_note = format_model(fmt, grid_release)  # the call format's grid model
        pages = [source.layout.page_block_size for source in call.sources]
        if footer_note is not None and max(pages) > 1:
            warnings.warn(FooterRecordsWarning(footer_note), stacklevel=2)
        grid = enforce_grid(
            grid_release,
            model=model,
            num_tokens=num_tokens,
            num_heads=num_heads,
            topk=main.topk,
            page_block_size=main.layout.page_block_size,
            topk_extra=extra.topk if extra is not None else 0,
            extra_page_block_size=extra.layout.page_block_size if extra is not None else 0,
        )

    if not _triton_reads(fmt) and backend is None:
        backend = "torch"  # the Triton forward reads the formats of _triton_reads only
    if not _triton_reads(fmt) and backend == "triton":
        read = [name for name, entry in formats.CALL_FORMATS.items() if entry.triton]
        v41 = [name for name, entry in formats.CALL_FORMATS.items() if not entry.triton and _triton_reads(name)]
        raise ValueError(
            f"backend='triton' with fmt={fmt!r}: the Triton forward reads fmt in {read} and the "
            f"DeepSeek-V4.1 record formats {v41} only"
        )
    backend = resolve_backend(backend, q.device)
    route = route_for(num_tokens)
    device = q.device
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if check_indices and capturing:
        raise ValueError(
            "check_indices=True: the out-of-range index check copies device values to the host, "
            "which a CUDA graph capture cannot do; pass check_indices=None or False and read "
            "SparseMlaOutput.out_of_range after a replay"
        )
    d_v = f.d_v
    output = torch.empty((num_tokens, num_heads, d_v), dtype=torch.bfloat16, device=device)
    lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=device)
    output_fp32 = torch.empty((num_tokens, num_heads, d_v), dtype=torch.float32, device=device) if return_fp32 else None
    # Zeroed for both backends (the torch loop adds to it; the Triton kernel stores each token's
    # count), so a count never depends on which program happens to store it.
    out_of_range = torch.zeros((num_tokens,), dtype=torch.int32, device=device)
    if num_tokens == 0:
        return SparseMlaOutput(output, lse, route, output_fp32, grid, out_of_range)

    if backend == "triton":
        triton_forward_module().sparse_mla(
            call, output=output, lse=lse, output_fp32=output_fp32, out_of_range=out_of_range
        )
    else:
        table, rows, valid = _prepare_candidates(call, out_of_range)
        _torch_loop(call, table, rows, valid, chunk_tokens, output, lse, output_fp32)
    if check_indices or (check_indices is None and not capturing):
        _check_out_of_range(call, out_of_range)
    return SparseMlaOutput(output, lse, route, output_fp32, grid, out_of_range)


def _triton_reads(fmt: formats.PackedFormat | str) -> bool:
    """Whether ``backend="triton"`` runs call format ``fmt``: the formats whose entry says so
    (``CallFormat.triton``: DSV4, DSV3.2; the gather kernel reads their layouts) and the formats
    of V4.1 records in both caches (``dsv4_1``, ``dsv4_1_swa``, ``dsv4_1_indexed``: the candidates
    gathered and dequantized by torch operations, then the same attention kernel as DSV4)."""
    entry = formats.call_format(fmt)
    return entry.triton or (entry.main.bf16_rows and entry.extra.bf16_rows)


def _check_out_of_range(call: SparseMlaCall, out_of_range: torch.Tensor) -> None:
    """The host check of a call (its one synchronisation): raise for the first lane past its cache."""
    if not bool(out_of_range.cpu().any()):
        return
    for source in call.sources:
        _, _, bad = _candidate_lanes(source, 0, 0)
        if bool(bad.any()):
            _raise_out_of_range(source, bad)


def _prepare_candidates(
    call: SparseMlaCall, out_of_range: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The preparation of the torch backend: candidate table and the row of every lane.

    Returns ``(table [R, d_qk] fp32, rows [T, Lp] int64, valid [T, Lp] bool)``: the table holds
    the main rows, then the extra rows, then one all-zero row (``R - 1``) that every invalid lane
    names; ``Lp`` is the main row padded to a multiple of :data:`LANE_TILE` plus the extra row
    padded likewise. Lanes past their cache are invalid and counted per token into
    ``out_of_range`` (``[T]`` int32, zeros on entry).
    """
    sources = call.sources
    zero_row = sum(source.num_slots for source in sources)
    device = call.main.indices.device
    table = torch.empty((zero_row + 1, call.main.layout.fmt.d_qk), dtype=torch.float32, device=device)
    lanes = []
    offset = 0
    for source in sources:
        rows = formats.unpack_dequantize(source.cache, layout=source.layout)
        table[offset : offset + source.num_slots] = rows.view(source.num_slots, source.layout.fmt.d_qk)
        lanes.append(_candidate_lanes(source, offset, zero_row))
        offset += source.num_slots
    table[zero_row] = 0.0
    for _, _, bad in lanes:
        out_of_range += bad.sum(dim=1, dtype=torch.int32)
    rows = torch.cat([lane_rows for lane_rows, _, _ in lanes], dim=1) if len(lanes) > 1 else lanes[0][0]
    valid = torch.cat([lane_valid for _, lane_valid, _ in lanes], dim=1) if len(lanes) > 1 else lanes[0][1]
    return table, rows, valid


class _Finaliser:
    """Turns a chunk's online-softmax state into outputs, elementwise, for both backends.

    ``out = acc / sum`` (``sum == 0``: divide by 1, so empty rows give 0), times
    ``sigmoid(lse_e - sink)`` with a sink (0 for an empty row, so a ``-inf`` sink gives 0, not
    NaN), where ``lse_e = max + log(sum)`` (natural log, ``-inf`` for an empty row); LSE per
    ``attention.conventions``. Every step is elementwise, so the result of
    one head does not depend on the other heads or on the tensor layout.
    """

    def __init__(self, call: SparseMlaCall) -> None:
        self.lse_convention = call.lse_convention
        self.lse_scale = call.lse_scale

    def __call__(
        self, run_max: torch.Tensor, run_sum: torch.Tensor, acc: torch.Tensor, sink: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``run_max``/``run_sum`` ``[..., 1]``, ``acc`` ``[..., d_v]``, ``sink`` broadcastable to
        ``run_max`` (or ``None``); returns ``(out [..., d_v], lse [..., 1])`` fp32."""
        empty = run_sum == 0
        out = acc / torch.where(empty, torch.ones_like(run_sum), run_sum)
        lse_e = run_max + run_sum.log()  # -inf for empty rows
        if sink is not None:
            # An empty row's output is 0 whatever the sink; with a -inf sink, sigmoid(-inf - -inf)
            # would be NaN, so the factor of an empty row is 0 instead.
            out.mul_(torch.where(empty, torch.zeros_like(lse_e), torch.sigmoid(lse_e - sink)))
            lse_full = torch.logaddexp(lse_e, sink.expand_as(lse_e))
        else:
            lse_full = lse_e
        if self.lse_convention == "flashinfer":
            lse_out = lse_full * (_LOG2E * self.lse_scale)
        else:
            lse_out = lse_e.masked_fill(lse_e == float("-inf"), float("inf"))
        return out, lse_out


def _torch_loop(
    call: SparseMlaCall,
    table: torch.Tensor,
    rows: torch.Tensor,
    valid: torch.Tensor,
    chunk_tokens: int | None,
    output: torch.Tensor,
    lse: torch.Tensor,
    output_fp32: torch.Tensor | None,
) -> None:
    """``backend="torch"``: fixed-shape batched GEMMs per head group of :data:`HEAD_GROUP`, over
    the candidate ``table`` and lane ``rows`` / ``valid`` of :func:`_prepare_candidates`.

    Off the CPU every chunk runs at the full chunk size (the last one padded with masked tokens):
    cuBLAS picks its algorithm by shape, so a 1-token call and a 65-token call would otherwise
    round one token's sums differently (seen on an H200: one element in 32,768 one unit in the
    last place apart), and a token's bits would depend on the call's size."""
    q, sm_scale, attn_sink = call.q, call.sm_scale, call.attn_sink
    num_tokens, num_heads, d_qk = (int(v) for v in q.shape)
    d_v = call.main.layout.fmt.d_v
    finish = _Finaliser(call)
    device = q.device
    fixed = device.type != "cpu"
    tc = chunk_tokens or default_chunk_tokens(device)
    if not fixed:
        tc = min(num_tokens, tc)
    padded = -(-num_tokens // tc) * tc if fixed else num_tokens
    if padded != num_tokens:  # masked tokens (bias -inf on every lane) up to whole chunks
        extra = padded - num_tokens
        rows = torch.cat([rows, rows.new_zeros((extra, rows.shape[1]))])
        valid = torch.cat([valid, valid.new_zeros((extra, valid.shape[1]))])
    num_tiles = rows.shape[1] // LANE_TILE
    # [tiles, T, L] so each (tile, chunk) slice is contiguous; bias is 0 (valid) or -inf (masked).
    lane_rows = rows.view(padded, num_tiles, LANE_TILE).transpose(0, 1).contiguous()
    lane_bias = torch.zeros((num_tiles, padded, 1, LANE_TILE), dtype=torch.float32, device=device)
    lane_bias.masked_fill_(~valid.view(padded, num_tiles, 1, LANE_TILE).transpose(0, 1), float("-inf"))

    num_groups = -(-num_heads // HEAD_GROUP)
    sink = None
    if attn_sink is not None:
        sink = torch.zeros(num_groups * HEAD_GROUP, dtype=torch.float32, device=device)
        sink[:num_heads] = attn_sink
        sink = sink.view(num_groups, 1, HEAD_GROUP, 1)

    g = HEAD_GROUP
    q_buf = torch.zeros((num_groups, tc, g, d_qk), dtype=torch.float32, device=device)
    row_buf = torch.empty((tc * LANE_TILE, d_qk), dtype=torch.float32, device=device)
    score_buf = torch.empty((num_groups, tc, g, LANE_TILE), dtype=torch.float32, device=device)
    run_max = torch.empty((num_groups, tc, g, 1), dtype=torch.float32, device=device)
    run_sum = torch.empty_like(run_max)
    acc = torch.empty((num_groups, tc, g, d_v), dtype=torch.float32, device=device)

    for start in range(0, num_tokens, tc):
        n = min(tc, num_tokens - start)
        span = tc if fixed else n  # the rows every step computes: n, or the whole (padded) chunk
        q_chunk = q[start : start + n]
        if span > n:
            q_buf[:, n:span].zero_()
        for gi in range(num_groups):
            h0 = gi * g
            width = min(g, num_heads - h0)
            q_buf[gi, :n, :width].copy_(q_chunk[:, h0 : h0 + width])
        run_max[:, :span].fill_(float("-inf"))
        run_sum[:, :span].zero_()
        acc[:, :span].zero_()
        scores = score_buf[:, :span]  # [groups, span, G, L]
        m_old = run_max[:, :span]
        for tile in range(num_tiles):
            flat = row_buf[: span * LANE_TILE]
            torch.index_select(table, 0, lane_rows[tile, start : start + span].view(-1), out=flat)
            keys = flat.view(span, LANE_TILE, d_qk)
            keys_t = keys.transpose(1, 2)
            values = keys[..., :d_v]
            bias = lane_bias[tile, start : start + span]
            for gi in range(num_groups):  # scores = bias + sm_scale * q @ K^T (bias -inf: masked)
                torch.baddbmm(bias, q_buf[gi, :span], keys_t, alpha=sm_scale, out=score_buf[gi, :span])
            # Elementwise steps and the (exact) max run on all groups at once; the order-dependent
            # sums run per group on fixed shapes.
            m_new = torch.maximum(m_old, scores.amax(dim=-1, keepdim=True))
            # A row with no valid lane so far keeps max -inf; shift by a finite value instead.
            m_use = m_new.clamp(min=_FP32_LOWEST)
            alpha = (m_old - m_use).exp_()
            scores.sub_(m_use).exp_()
            run_sum[:, :span].mul_(alpha)
            acc[:, :span].mul_(alpha)
            for gi in range(num_groups):
                p = score_buf[gi, :span]
                run_sum[gi, :span].add_(p.sum(dim=-1, keepdim=True))
                acc[gi, :span].baddbmm_(p, values)
            m_old.copy_(m_new)
        # Finalise: out = acc / sum, times sigmoid(lse - sink); LSE per convention.
        out, lse_out = finish(run_max[:, :span], run_sum[:, :span], acc[:, :span], sink)
        # [groups, span, G, ...] -> [n, H, ...]
        out = out.transpose(0, 1).reshape(span, num_groups * g, d_v)[:n, :num_heads]
        output[start : start + n] = out
        if output_fp32 is not None:
            output_fp32[start : start + n] = out
        lse[start : start + n] = lse_out.transpose(0, 1).reshape(span, num_groups * g)[:n, :num_heads]
