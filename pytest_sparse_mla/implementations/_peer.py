"""What the peer adapters (``sglang.py``, ``flashmla.py``) share: the errors they raise for inputs
the peer cannot take, the cache view they hand to a peer, index checks, the shape check against
their envelope and the LSE conversion.

Two kinds of refusal, so a suite can tell "the peer lacks this" from "the peer gets this wrong":

* :class:`pytest_sparse_mla.Unsupported`: the call lies outside the adapter's ``envelope`` (a
  head count, a format, a top-k width, an extra cache, ...), or on a device the peer does not run
  on; the text names the peer's limit. The suites never make such a call (they fit every case to
  the envelope); a direct caller gets a skip under pytest with the plugin active.
* :class:`UnsafeForPeer` (a ``RuntimeError``): the inputs are valid for this project, but the peer's
  kernel would read or write out of bounds on them (for instance FlashMLA's decode masks only ``-1``
  and turns ``-2`` into a page index of about 67 million). Running it would kill the CUDA context of
  the whole test session, so the adapter refuses, and the test fails with the peer's limit in the
  message (``guard``: never a pass, never a skip): that is a real discrepancy (a convention or a
  bug), listed in the peer's xfail file.

An adapter maps arguments and layouts; it never answers for its peer. The peer is run through
:func:`call_peer`, which marks what the peer raises (:func:`raised_by_peer`); a ``TypeError`` /
``ValueError`` an adapter raises itself (the call could not be mapped) is not the peer's verdict,
and ``guard`` reports the test as not asked instead of letting a bad-input test pass on it.

Everything here imports torch lazily, inside functions: the adapters' modules are imported when
the plugin resolves ``--sparse-mla-impl`` and must stay light.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pytest_sparse_mla.envelope import Envelope, Unsupported

if TYPE_CHECKING:  # torch is imported lazily: the adapters' modules must stay light
    from pytest_sparse_mla import formats
    from pytest_sparse_mla.attention.call import Candidates, SparseMlaCall

__all__ = [
    "UnsafeForPeer",
    "PeerResult",
    "nhd_view",
    "refuse_lanes_past_cache",
    "raised_by_peer",
    "lse_to_convention",
    "shape_reason",
    "PeerCall",
    "IGNORED_ARGUMENTS",
    "takes_read_call",
    "PeerAdapter",
    "virtual_table",
    "call_peer",
    "check_folded_lengths",
    "source_skip_reason",
]


class UnsafeForPeer(RuntimeError):
    """Valid project input that the peer's kernel would mishandle out of bounds (so it is not run).

    The message names the peer's convention or bug, the argument and the offending value.
    """


@dataclass(frozen=True)
class PeerResult:
    """Result of a peer adapter's ``sparse_mla_forward``.

    Attributes:
        output: ``[T, H, 512]`` BF16 output, as the peer wrote it.
        lse: ``[T, H]`` fp32 LSE in the requested convention (converted from the peer's own,
            :func:`lse_to_convention`).
        route: ``"decode"`` / ``"prefill"`` where the adapter picks a kernel by ``num_tokens`` like
            FlashInfer (``T <= 64`` decode), else ``None`` (one kernel for every ``T``).
        entry: the peer function that ran, e.g. ``"flash_mla.flash_mla_with_kvcache"``.
    """

    output: Any
    lse: Any
    route: str | None = None
    entry: str = ""


def nhd_view(cache: Any, layout: Any) -> Any:
    """The ``[P, ps, 1, B]`` NHD view of a packed cache whose ``formats.CacheLayout`` is ``layout``
    (same bytes, storage offset and page stride).

    SGLang and FlashMLA read ``k_cache.shape[1]`` as the page size and ``stride(0)`` as the page
    stride of a 4-D ``[num_blocks, page_block_size, 1, bytes_per_token]`` tensor; the project's
    2-D, 3-D and HND forms describe the same bytes, so this only changes the shape metadata.
    """
    import torch

    bpt = layout.fmt.bytes_per_token
    return torch.as_strided(
        cache,
        (layout.num_pages, layout.page_block_size, 1, bpt),
        (layout.page_stride, layout.token_stride, layout.token_stride, 1),
        cache.storage_offset(),
    )


def refuse_lanes_past_cache(adapter: str, source: Candidates, why: str) -> None:
    """Refuse (:class:`UnsafeForPeer`) a valid lane of ``source`` whose index is past its cache
    (``>= source.num_slots``), for a peer measured to corrupt the process on one (one host sync).
    Peers that mask such a lane or return garbage are run: their behaviour is the verdict
    (``Envelope.index_past_cache``).

    Args:
        adapter: the adapter's name.
        source: the main or the extra ``attention.call.Candidates`` of the read call.
        why: what the peer does with such a lane, and where.

    Raises:
        UnsafeForPeer: naming the index argument, the first offending token, lane and value, and ``why``.
    """
    indices, num_slots = source.indices, source.num_slots
    bad = source.valid_lanes() & (indices >= num_slots)
    if bool(bad.any()):
        t, j = (int(v) for v in bad.nonzero()[0])
        raise UnsafeForPeer(
            f"{adapter}: {source.names[1]}[{t}, {j}]={int(indices[t, j])} is a valid lane past the cache "
            f"({num_slots} slots); {why}"
        )


#: attribute :func:`call_peer` sets on an exception the peer raised (the peer function's name).
_PEER_MARK = "_sparse_mla_raised_by_peer"


def raised_by_peer(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) came out of a peer call made through
    :func:`call_peer`: the peer's own verdict, not the adapter's."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if getattr(current, _PEER_MARK, None):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def lse_to_convention(
    lse: Any,
    *,
    sink_included: bool,
    attn_sink: Any | None,
    lse_convention: str,
    lse_scale: float,
) -> Any:
    """Convert a peer's natural-log LSE ``[T, H]`` to the project's ``lse_convention``.

    Args:
        lse: the peer's natural-log LSE. Without the sink (``sink_included=False``: FlashMLA,
            SGLang's torch path) an empty row may be ``+inf`` (FlashMLA's "lonely query") or
            ``-inf`` (SGLang's ``logsumexp`` of nothing): both mean "no candidate". With the sink
            (``sink_included=True``: SGLang's Triton path, ``logaddexp(lse, sink)``) an empty row
            equals the sink.
        sink_included: whether ``lse`` already holds the sink.
        attn_sink: ``[H]`` fp32 sink logits or ``None``.
        lse_convention: ``"flashinfer"`` (base 2, sink included, times ``lse_scale``; empty
            row ``-inf`` or ``sink * log2(e)``) or ``"flashmla"`` (natural log, sink excluded,
            empty row ``+inf``); ``attention.conventions``.
        lse_scale: the FlashInfer convention's factor.

    Returns:
        fp32 ``[T, H]``. Computed in float64. Removing the sink from a sink-including LSE,
        ``ln(e**lse - e**sink)``, loses digits when the sink dominates (the peer rounded ``lse``
        to fp32 first); a row whose ``lse`` rounded to the sink is reported as empty.
    """
    import torch

    x = lse.to(torch.float64)
    sink = None if attn_sink is None else attn_sink.to(device=x.device, dtype=torch.float64).unsqueeze(0)
    if sink_included:
        total = x
        if sink is None:
            excluded = x
        else:
            gap = torch.clamp(sink - total, max=0.0)  # rounding can put the sink a hair above total
            excluded = torch.where(torch.isneginf(total), total, total + torch.log(-torch.expm1(gap)))
    else:
        excluded = torch.where(torch.isposinf(x), torch.full_like(x, -math.inf), x)
        total = excluded if sink is None else torch.logaddexp(excluded, sink.expand_as(excluded))
    if lse_convention == "flashinfer":
        out = total / math.log(2.0) * lse_scale
    else:
        out = torch.where(torch.isneginf(excluded) | torch.isnan(excluded), math.inf, excluded)
    return out.to(torch.float32)


def shape_reason(
    peer: str,
    devices: tuple[str, ...],
    q: Any,
    kv_cache: Any,
    fmt: formats.PackedFormat | str,
    outside: str | None,
    *,
    exact_token_stride: bool = False,
) -> str | None:
    """Why a peer cannot take a forward call, from its device, its envelope's verdict and its cache
    strides (no host sync): what the envelope does not say (the device, the token stride) is judged
    here, the envelope's rules only by the envelope (``SparseMlaCall.envelope_reason`` /
    ``Envelope.call_reason``, whose reason the caller passes as ``outside``).

    Args:
        peer: the peer's entry point, in words (prefix of the reason).
        devices: device types the peer runs on.
        q: the queries (their ``device.type`` is read; no device: ``"cpu"``).
        kv_cache: the main cache (its strides are read with ``exact_token_stride``).
        fmt: the call format (``formats.get_format``: its ``bytes_per_token``).
        outside: why the call lies outside the peer's envelope, or ``None``.
        exact_token_stride: also require token rows of exactly ``bytes_per_token`` bytes.

    Returns:
        The reason (the device, ``outside``, or the token stride, in this order), or ``None``.

    Raises:
        ValueError: unknown ``fmt`` (``formats.get_format``).
    """
    from pytest_sparse_mla import formats

    f = formats.get_format(fmt)
    device = str(getattr(getattr(q, "device", None), "type", "cpu"))
    if device not in devices:
        return f"{peer} runs on {'/'.join(devices)}, not on {device}"
    if outside is not None:
        return f"{peer}: outside its envelope: {outside}"
    strided = isinstance(getattr(kv_cache, "shape", None), tuple) and kv_cache.dim() >= 3
    if exact_token_stride and strided:
        token_axis = 2 if kv_cache.dim() == 4 and kv_cache.shape[1] == 1 else 1
        if kv_cache.shape[token_axis] > 1 and kv_cache.stride(token_axis) != f.bytes_per_token:
            return (
                f"{peer} needs token rows of exactly {f.bytes_per_token} bytes "
                f"(stride(1) == bytes_per_token); kv_cache.stride({token_axis})={kv_cache.stride(token_axis)}"
            )
    return None


def _argument_shapes(q: Any, kv_cache: Any, indices: Any, **arguments: Any) -> dict[str, Any]:
    """The shapes ``Envelope.call_reason`` judges, read from a forward call's arguments as given (shape
    metadata only: stand-ins with ``shape`` and ``device`` do; a missing dim reads as 0).

    Raises:
        ValueError: unknown ``fmt`` (``formats.call_format_name``).
    """
    from pytest_sparse_mla import formats

    shape = tuple(getattr(q, "shape", ()))
    idx_shape = tuple(getattr(indices, "shape", ()))
    extra_indices = arguments.get("extra_indices")
    extra_shape = tuple(getattr(extra_indices, "shape", ())) if extra_indices is not None else None
    return {
        "fmt": formats.call_format_name(arguments.get("fmt", "dsv4")),
        "num_tokens": int(shape[0]) if shape else 0,
        "num_heads": int(shape[1]) if len(shape) > 1 else 0,
        "topk": int(idx_shape[-1]) if idx_shape else 0,
        "extra_topk": int(extra_shape[-1]) if extra_shape else None,
        "has_topk_length": any(arguments.get(name) is not None for name in ("topk_length", "extra_topk_length")),
        "has_sink": arguments.get("attn_sink") is not None,
    }


@dataclass(frozen=True)
class PeerCall:
    """A read forward call with the cache views the peers read (:meth:`PeerAdapter.forward_call`).

    Attributes:
        call: the call (``attention.call.SparseMlaCall``: queries, candidate sources, sink, scale,
            LSE convention), read once.
        kv4: the main cache's ``[P, ps, 1, B]`` NHD view (:func:`nhd_view`).
        extra4: the extra cache's view, or ``None``.
    """

    call: SparseMlaCall
    kv4: Any
    extra4: Any | None


#: Keywords of the bundled reference's forward that the peer adapters accept and ignore.
IGNORED_ARGUMENTS: tuple[str, ...] = ("grid_release", "chunk_tokens", "backend")


def takes_read_call(impl: Any, keywords: Iterable[str]) -> bool:
    """Whether handing ``impl`` a read call (:meth:`PeerAdapter.forward_call`) is the same as calling
    ``impl.sparse_mla_forward(q, kv_cache, indices, **kwargs)`` with these ``keywords``: ``impl`` is a
    :class:`PeerAdapter` whose ``sparse_mla_forward`` is the base class's (it reads the call and
    hands it to ``forward_call``; a subclass that overrides it is called as it is), and every keyword
    is one that method reads (``attention.call.CALL_ARGUMENTS``, ``return_fp32``) or ignores
    (:data:`IGNORED_ARGUMENTS`)."""
    from pytest_sparse_mla.attention.call import CALL_ARGUMENTS

    if not isinstance(impl, PeerAdapter) or type(impl).sparse_mla_forward is not PeerAdapter.sparse_mla_forward:
        return False
    return set(keywords) <= {*CALL_ARGUMENTS, *IGNORED_ARGUMENTS, "return_fp32"}


class PeerAdapter:
    """Base of the built-in peer adapters: the protocol's ``sparse_mla_forward``, written once.

    A subclass sets ``name``, ``peer`` (the peer's entry point, in words), ``envelope`` and
    ``devices``, and implements :meth:`forward`; it may refuse lane values its peer cannot survive
    in :meth:`refuse_lanes`.
    """

    name = "peer"
    peer = ""
    envelope = Envelope()
    devices: tuple[str, ...] = ("cuda",)
    #: the peer needs token rows of exactly ``bytes_per_token`` bytes (:func:`shape_reason`).
    exact_token_stride = False
    #: the peer can return an fp32 output (``return_fp32=True``).
    returns_fp32 = False

    def unsupported_reason(self, capability: str, *args: Any, **kwargs: Any) -> str | None:
        """Why the peer cannot take this call (same arguments as the call, before it is made), or ``None``.

        Only shapes, formats and devices are read (no host sync; stand-ins with ``shape`` and
        ``device`` do): the device and the token stride (:func:`shape_reason`), the envelope's rules
        (``Envelope.call_reason``). The call raises :class:`pytest_sparse_mla.Unsupported` with the
        same text (:meth:`forward_call`, on the read call).
        """
        if capability != "sparse_mla_forward":
            return f"{self.name} provides no {capability!r}"
        return self._arguments_reason(*args, **kwargs)

    def _arguments_reason(self, q: Any, kv_cache: Any, indices: Any, **arguments: Any) -> str | None:
        outside = self.envelope.call_reason(**_argument_shapes(q, kv_cache, indices, **arguments))
        fmt = arguments.get("fmt", "dsv4")
        return shape_reason(
            self.peer, self.devices, q, kv_cache, fmt, outside, exact_token_stride=self.exact_token_stride
        )

    def call_reason(self, call: SparseMlaCall, *, envelope_checked: bool = False) -> str | None:
        """Why the peer cannot take a read call, or ``None``: its device, the envelope's verdict
        (``SparseMlaCall.envelope_reason``; left out with ``envelope_checked``: the caller has judged
        the call against this envelope) and the token stride (:func:`shape_reason`)."""
        outside = None if envelope_checked else call.envelope_reason(self.envelope, page_sizes=False, lse=False)
        return shape_reason(
            self.peer, self.devices, call.q, call.main.cache, call.fmt, outside,
            exact_token_stride=self.exact_token_stride,
        )  # fmt: skip

    def refuse_lanes(self, source: Candidates) -> None:
        """Raise :class:`UnsafeForPeer` for index lanes of ``source`` (the main or the extra
        ``attention.call.Candidates``) the peer would mishandle (none by default)."""

    def sparse_mla_forward(self, q: Any, kv_cache: Any, indices: Any, **arguments: Any) -> PeerResult:
        """The protocol's ``sparse_mla_forward`` (``implementations.protocol.SparseMlaForward``).

        The call is read once (``attention.call.SparseMlaCall.read``: the LSE convention, the extra
        cache and its indices together, each cache, the index rows' shape; no more, so the peer
        is judged on its own validation) and handed to :meth:`forward_call`. ``grid_release``,
        ``chunk_tokens`` and ``backend`` (the bundled reference's) are ignored.

        Raises:
            ValueError, TypeError: as ``SparseMlaCall.read``; as :meth:`forward_call`.
            pytest_sparse_mla.Unsupported, UnsafeForPeer: as :meth:`forward_call`.
            Whatever the peer raises.
        """
        from pytest_sparse_mla.attention.call import SparseMlaCall

        for name in IGNORED_ARGUMENTS:
            arguments.pop(name, None)
        return_fp32 = bool(arguments.pop("return_fp32", False))
        call = SparseMlaCall.read(q, kv_cache, indices, **arguments)
        return self.forward_call(call, return_fp32=return_fp32)

    def forward_call(
        self, call: SparseMlaCall, *, return_fp32: bool = False, envelope_checked: bool = False
    ) -> PeerResult:
        """Run the peer on a read call (what :meth:`sparse_mla_forward` does after reading it; the
        envelope guard hands a suite's call here, read and judged once).

        :meth:`call_reason` refuses a call the peer cannot take, :meth:`refuse_lanes` refuses lanes
        the peer would mishandle out of bounds, and :meth:`forward` runs the peer (a valid lane past
        its cache reaches the peer unless ``refuse_lanes`` refuses it: ``Envelope.index_past_cache``).

        Args:
            call: the call, as ``attention.call.SparseMlaCall.read`` reads it (not validating).
            return_fp32: ask for the fp32 output (only where ``returns_fp32``).
            envelope_checked: the caller has held the call to this adapter's envelope.

        Raises:
            ValueError: ``return_fp32=True`` for a peer with a BF16 output only.
            pytest_sparse_mla.Unsupported: as :meth:`call_reason`.
            UnsafeForPeer: as :meth:`refuse_lanes`.
            Whatever the peer raises.
        """
        if return_fp32 and not self.returns_fp32:
            raise ValueError(f"return_fp32=True: {self.name} returns a BF16 output only (expected return_fp32=False)")
        reason = self.call_reason(call, envelope_checked=envelope_checked)
        if reason is not None:
            raise Unsupported(f"{self.name}: {reason}")
        views = []
        for source in call.sources:
            views.append(nhd_view(source.cache, source.layout))
            if source.topk_length is not None and tuple(getattr(source.topk_length, "shape", ())) != (call.num_tokens,):
                continue  # a malformed length: the peer's own check answers for it
            self.refuse_lanes(source)
        return self.forward(PeerCall(call, views[0], views[1] if len(views) > 1 else None), return_fp32)

    def forward(self, call: PeerCall, return_fp32: bool) -> PeerResult:
        """Run the peer on a read call (:meth:`forward_call`)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def virtual_table(call: SparseMlaCall, *, row_multiple: int, fold_lengths: bool = False) -> tuple[Any, Any, Any]:
    """The BF16 latent table and index rows a prefill-style peer reads instead of packed caches.

    The packed caches are dequantized with ``formats.unpack_dequantize`` on the layouts the call
    parsed (exact: an E4M3 code times a power of two is a BF16 number). With an extra cache, its
    table is appended after the main one and its valid lanes are shifted by the main cache's token
    count (FlashInfer's test reference builds the same "virtual table",
    ``tests/attention/test_sparse_mla_sm120.py``); the two rows are joined and lanes past
    ``topk_length`` / ``extra_topk_length`` become ``-1`` (one row has one prefix length). Rows are
    padded with ``-1`` to a multiple of ``row_multiple``.

    Args:
        call: the read call (``attention.call.SparseMlaCall``): its caches, layouts, index rows and
            lengths.
        row_multiple: the peer's index-row multiple (lanes).
        fold_lengths: fold ``topk_length`` into the rows without an extra cache too (for a peer that
            takes no lengths): every invalid lane becomes ``-1``.

    Returns:
        ``(kv, rows, length)``: ``kv`` ``[N, 1, d_qk]`` BF16 (``N`` = main tokens + extra tokens),
        ``rows`` ``[T, width]`` int32 (``width`` a multiple of ``row_multiple``), ``length`` the
        ``topk_length`` to hand the peer (``None`` where folded into ``rows``: with an extra cache
        or ``fold_lengths``).
    """
    import torch

    from pytest_sparse_mla import formats

    main, extra = call.main, call.extra
    d_qk = main.layout.fmt.d_qk
    tables = [
        formats.unpack_dequantize(source.cache, layout=source.layout, dtype=torch.bfloat16).reshape(-1, d_qk)
        for source in call.sources
    ]
    rows, length = main.indices, main.topk_length
    if extra is not None or (fold_lengths and length is not None):
        rows, length = torch.where(main.valid_lanes(), main.indices, torch.full_like(main.indices, -1)), None
    if extra is not None:
        extra_rows = torch.where(extra.valid_lanes(), extra.indices + main.num_slots, -1)
        rows = torch.cat([rows, extra_rows.to(main.indices.dtype)], dim=1)
    width = -(-rows.shape[1] // row_multiple) * row_multiple
    padded = torch.full((rows.shape[0], width), -1, dtype=torch.int32, device=rows.device)
    padded[:, : rows.shape[1]] = rows
    kv = torch.cat(tables, dim=0) if len(tables) > 1 else tables[0]
    return kv.unsqueeze(1), padded, length


def call_peer(
    source: dict[str, Any],
    function: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    script_args: tuple[Any, ...] | None = None,
) -> Any:
    """``fn(*args, **kwargs)``, the peer call of an adapter, reported to ``--sparse-mla-repro-dir``
    (:func:`pytest_sparse_mla.recording.record_native`) so a reproducer can make the same call. An
    exception ``fn`` raises is marked as the peer's (:func:`raised_by_peer`) and passes through.

    Args:
        source: how a standalone script finds the peer: ``{"kind": "import", "module": ...}`` or
            ``{"kind": "file", "package": ..., "path": ..., "stubs": None | "flaggems" | "vllm"}``
            (``implementations._source``).
        function: ``fn``'s name in that module.
        script_args: ``args`` as the script should rebuild them (``recording.METADATA`` in place of an
            object it recreates), when they differ.
    """
    from pytest_sparse_mla import recording

    if recording.enabled():
        recording.record_native(source, function, script_args if script_args is not None else args, kwargs)
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        try:
            setattr(exc, _PEER_MARK, function)
        except (AttributeError, TypeError):  # an exception type without a __dict__: wrap it
            raise RuntimeError(f"{function} raised {type(exc).__name__}: {exc}") from exc
        raise


def check_folded_lengths(call: SparseMlaCall) -> None:
    """Refuse the lengths of a read call that an adapter folds into the index rows itself (its peer
    takes none) and cannot map as they are: not ``[T]`` int32 on ``q``'s device, or
    ``extra_topk_length`` without an extra cache (the bundled reference's checks). The peer never
    sees such lengths, so its handling of them is not measured: the call is ``Unsupported`` (a bad
    input test then skips with this reason), never a contract error raised by adapter code.

    Raises:
        pytest_sparse_mla.Unsupported: lengths the adapter cannot fold, with the reference's reason.
    """
    import torch

    from pytest_sparse_mla.attention.call import check_vector

    try:
        if call.extra_topk_length is not None and call.extra is None:
            raise ValueError("extra_topk_length requires extra_kv_cache and extra_indices")
        for name, value in (("topk_length", call.main.topk_length), ("extra_topk_length", call.extra_topk_length)):
            if value is not None:
                check_vector(value, name, torch.int32, call.num_tokens, "one length per token", call.q)
    except (TypeError, ValueError) as exc:
        raise Unsupported(
            f"the adapter folds the lengths into the index rows and cannot map these ({exc}); the peer never "
            "sees them, so its own handling is not measured"
        ) from None


def source_skip_reason(
    adapter: str,
    capability: str,
    device: str,
    *,
    missing: str | None,
    devices: tuple[str, ...],
    load: Callable[[], Any],
    needs_triton: bool = True,
) -> str | None:
    """Why a peer executed from its source files cannot run ``capability`` on ``device``: its source
    is missing (``missing``: the text saying what to install), Triton is not installed, the device is
    not one it runs on, or executing the source fails (``load``). ``None`` for another capability.
    """
    import importlib.util

    if capability != "sparse_mla_forward":
        return None
    if missing is not None:
        return f"{adapter} adapter: {missing}"
    if needs_triton and importlib.util.find_spec("triton") is None:
        return f"{adapter} adapter: the peer's kernels need Triton, which is not installed"
    if device not in devices:
        return f"{adapter} adapter: runs on {'/'.join(devices)}, not on {device}"
    try:
        load()
    except Exception as exc:  # noqa: BLE001 - any failure of the peer's source is a skip reason
        return f"{adapter} adapter: executing the peer's source failed ({type(exc).__name__}: {exc})"
    return None
