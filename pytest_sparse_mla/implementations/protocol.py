"""The implementation protocol as ``typing.Protocol`` classes: what the suites call, typed.

An implementation under test (``--sparse-mla-impl``) is any object with a subset of three
capabilities; each is one protocol here, and :class:`SparseMlaImplementation` is all three. Type a
downstream adapter against them and let a type checker (``mypy --strict``) check the signatures::

    from pytest_sparse_mla.implementations.protocol import SparseMlaForward

    class MyKernel:
        name = "mykernel"

        def sparse_mla_forward(self, q, kv_cache, indices, *, sm_scale, fmt="dsv4", ...) -> MyResult:
            ...

    _check: SparseMlaForward = MyKernel()   # a type error if the signature does not fit

The protocols are ``runtime_checkable``: ``isinstance(obj, Packer)`` is true when ``obj`` has a
``pack`` attribute (Python checks presence, not signatures); :mod:`pytest_sparse_mla.implementations`
uses them to list what an object provides.

Every keyword a suite passes is in the protocol signature, with the default the suites rely on
when they leave it out. An implementation may accept more keywords (add ``**kwargs: Any``); it must
accept these. Shapes, dtypes and units follow the bundled functions each capability replaces:
:func:`pytest_sparse_mla.formats.quantize_pack`, :func:`pytest_sparse_mla.page_split.page_split` and
:func:`pytest_sparse_mla.attention.sparse_mla_forward` (whose docstrings give the public sources of
each convention: FlashMLA's DSV4 584-byte and DSV3.2 656-byte token layouts, deepseek-ai/FlashMLA
``README.md``; FlashInfer's SM120 sparse-MLA entry, flashinfer-ai/flashinfer
``flashinfer/mla/_sparse_mla_sm120.py``).

What the forward serves is declared apart from its signature, as an optional ``envelope``
attribute (:class:`pytest_sparse_mla.Envelope`): the suites then call it only with shapes inside
the envelope. Besides :class:`SparseMlaResult`, the suites accept FlashMLA's ``(output, lse)``
pair and, from a kernel whose envelope declares ``lse_conventions=()``, a bare output tensor
(``pytest_sparse_mla.guard``).

Importing this module does not import torch at run time (the annotations name ``torch.Tensor``
for type checkers only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from pytest_sparse_mla.page_split.buffers import BufferRegistry

__all__ = [
    "SparseMlaResult",
    "Packer",
    "PageSplitter",
    "SparseMlaForward",
    "SkipReason",
    "SparseMlaImplementation",
    "CAPABILITY_PROTOCOLS",
]


@runtime_checkable
class SparseMlaResult(Protocol):
    """What ``sparse_mla_forward`` returns (the bundled ``attention.SparseMlaOutput`` is one).

    Attributes:
        output: ``[num_tokens, num_heads, 512]`` BF16 attention output.
        lse: ``[num_tokens, num_heads]`` fp32 log-sum-exp in the requested convention:
            ``"flashinfer"`` (base 2, sink included, times ``lse_scale``) or ``"flashmla"``
            (natural log, sink excluded; ``+inf`` for an empty row). See
            ``pytest_sparse_mla.attention.conventions``.
    """

    @property
    def output(self) -> torch.Tensor: ...

    @property
    def lse(self) -> torch.Tensor: ...


@runtime_checkable
class Packer(Protocol):
    """Capability ``pack``: quantize BF16 latent rows and pack them into a paged FP8 cache."""

    def pack(
        self,
        source: torch.Tensor,
        fmt: Any = "dsv4",
        *,
        page_stride: int | str = "tight",
        form: str = "nhd",
        scale_rule: str = "flashmla",
        pad_fill: int = 0,
    ) -> torch.Tensor:
        """Pack ``source``.

        Args:
            source: ``[num_pages, page_block_size, d_qk]`` BF16 (``d_qk`` 512 DSV4, 576 DSV3.2).
            fmt: ``"dsv4"`` (584 B/token, scales in a per-page footer) or ``"dsv3_2"`` (656 B/token,
                inline scales), or a ``formats.PackedFormat``.
            page_stride: bytes between pages: ``"tight"`` (``page_block_size * bytes_per_token``),
                ``"padded"`` (FlashMLA/SGLang: 37,440 B at 64 tokens) or a byte count.
            form: ``"2d"``, ``"3d"``, ``"hnd"`` or ``"nhd"`` tensor form of the result.
            scale_rule: ``"flashmla"`` (scale floor ``1e-4``) or ``"sglang"`` (``eps = 1e-8``).
            pad_fill: the byte written into bytes no reader uses (each DSV4 scale record's 8th byte
                and the page padding); the suites poison them with ``0xFF`` to prove they are unread.

        Returns:
            The packed uint8 cache on ``source``'s device.
        """
        ...


@runtime_checkable
class PageSplitter(Protocol):
    """Capability ``page_split``: split 128/256-token DSV4 pages into 64-token pages."""

    def page_split(
        self,
        kv_cache: torch.Tensor,
        *,
        src_page_block_size: int | None = None,
        touched_indices: torch.Tensor | None = None,
        key_suffix: str = "",
        registry: BufferRegistry | None = None,
    ) -> torch.Tensor:
        """Split ``kv_cache``.

        Args:
            kv_cache: uint8 DSV4 cache (2-D ``[P, W]`` needs ``src_page_block_size``; 3-D, HND, NHD).
            src_page_block_size: tokens per source page (a multiple of 64).
            touched_indices: int32 flat token indices; only pages they touch must be split.
            key_suffix: isolates the persistent split buffers of one caller from another's.
            registry: where the persistent buffers live (the ``split_buffer_registry`` fixture).

        Returns:
            ``[P * ratio, 64, 1, 584]`` uint8 (the input itself for 64-token pages).
        """
        ...


@runtime_checkable
class SparseMlaForward(Protocol):
    """Capability ``sparse_mla_forward``: sparse MLA attention over a packed FP8 paged cache."""

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
    ) -> SparseMlaResult:
        """Attend. ``attention.call.SparseMlaCall.read`` reads these arguments into one object (the
        bundled reference, the oracle, the built-in adapters and the envelope check all use it).

        Args:
            q: ``[T, H, d_qk]`` BF16 queries; ``T <= 64`` is decode, larger is prefill.
            kv_cache: packed uint8 main cache (any form ``formats.parse_cache`` accepts).
            indices: ``[T, topk]`` int32 flat token indices into ``kv_cache``; ``-1`` skips a lane.
            sm_scale: softmax scale (``d_qk ** -0.5`` typically).
            fmt: ``"dsv4"``, ``"dsv3_2"`` or ``"dsv4_1"`` (``formats.CALL_FORMATS``).
            page_block_size: tokens per page, only needed for a 2-D cache.
            topk_length: ``[T]`` int32 valid prefix of each index row, or ``None`` (all lanes).
            attn_sink: ``[H]`` fp32 per-head sink logit (natural-log units), or ``None``.
            extra_kv_cache / extra_indices / extra_topk_length / extra_page_block_size: the second
                (compressed) cache of DeepSeek-V4 C4/C128 layers, merged into the same softmax.
            lse_convention: ``"flashinfer"`` or ``"flashmla"`` (see :class:`SparseMlaResult`).
            lse_scale: factor applied to a ``"flashinfer"`` LSE.
        """
        ...


@runtime_checkable
class SkipReason(Protocol):
    """Optional: say why a capability cannot run on a device here (``None`` when it can)."""

    def skip_reason(self, capability: str, device: str) -> str | None:
        """``capability`` is ``"pack"``, ``"page_split"`` or ``"sparse_mla_forward"``; ``device``
        is ``"cpu"`` or ``"cuda"``."""
        ...


@runtime_checkable
class SparseMlaImplementation(Packer, PageSplitter, SparseMlaForward, Protocol):
    """All three capabilities. The ``sparse_mla_impl`` fixture is typed with it: a test gets the
    capabilities its ``sparse_mla_needs(...)`` markers name (it is skipped otherwise); the others
    may be missing on a given implementation."""


#: capability name -> its protocol.
CAPABILITY_PROTOCOLS: dict[str, type[Any]] = {
    "pack": Packer,
    "page_split": PageSplitter,
    "sparse_mla_forward": SparseMlaForward,
}
