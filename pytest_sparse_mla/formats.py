"""Packed FP8 (and FP4) paged KV-cache formats: byte geometry, quantize + pack, unpack + dequantize,
tensor forms.

Record formats (:data:`FORMATS`; sizes in bytes per token; a page holds ``ps`` = ``page_block_size``):

* ``dsv4`` (DeepSeek-V4), 584, *footer* layout: ``[0, ps*576)`` token data (slot ``t``: 448 E4M3 NoPE
  codes, 64 BF16 RoPE values), ``[ps*576, ps*584)`` scales (slot ``t``: 7 UE8M0 bytes, one per 64
  NoPE values, + 1 pad byte), then optional padding. Row ``t`` of a ``[.., ps, 584]`` view is *not*
  token ``t``'s record.
* ``dsv3_2`` (DeepSeek-V3.2), 656, *inline*: 512 E4M3 NoPE codes, 4 fp32 scales (per 128), 64 BF16 RoPE.
* ``dsv4_1_swa`` (528: 512 E4M3 codes, 16 UE8M0 scales per 32) and ``dsv4_1_indexed`` (288: 512 E2M1
  codes two per byte, 32 E4M3 scales per 16), DeepSeek-V4.1 inline records; an attention call's
  ``fmt="dsv4_1"`` reads SWA records in the main cache, indexed in the extra.

Call formats (:data:`CALL_FORMATS`, one :class:`CallFormat` each): the ``fmt`` of an attention call,
its record formats and everything else asked of it (whether an envelope may name it, the default
envelope's, the bundled reference's Triton kernel, FlashInfer's grid model). Every list of call
formats in the package and its suites reads this table: adding a format is adding an entry.

Scales are powers of two (``scale_rule`` ``"flashmla"``, ``"sglang"``, ``"dsv4_1"``; UE8M0 byte
``127 + log2(s)``), codes ``float8_e4m3fn(clamp(x/s, -448, 448))``. Page strides: ``"tight"``
(``ps*B``), ``"padded"`` (FlashMLA/SGLang) or bytes. Tensor forms (:data:`FORMS`, uint8): ``"2d"``
``[P, ps*B]``, ``"3d"`` ``[P, ps, B]``, ``"hnd"`` ``[P, 1, ps, B]``, ``"nhd"`` ``[P, ps, 1, B]``
(rules: :func:`parse_cache`); flat token index ``page * ps + slot``. :func:`quantize_pack` raises
``ValueError`` on non-finite input; :func:`unpack_dequantize` decodes any bytes.

Importing this module does not import torch (the functions that compute import it), so the envelope
and the dispatch grid, which never import torch, read its tables.

Sources: deepseek-ai/FlashMLA ``tests/quant.py`` and README; flashinfer-ai/flashinfer
``include/flashinfer/attention/sparse_mla_sm120/model/kv_cache_traits.cuh``, ``common/kv_cache_io.cuh``,
``csrc/sparse_mla_sm120/attention_validation.h``; flashinfer-python 0.7.2.post1
``compressed_reference.py`` (V4.1); sgl-project/sglang ``deepseek_v4_memory_pool.py``,
``quant_k_cache.py``. Byte offsets, scale formulas, strides: ``docs/design/cache-formats.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

__all__ = [
    "NOPE_OVERFLOW",
    "token_byte_ranges",
    "PackedFormat",
    "DSV4",
    "DSV3_2",
    "DSV4_1_SWA",
    "DSV4_1_INDEXED",
    "FORMATS",
    "CallFormat",
    "CALL_FORMATS",
    "call_format",
    "cache_formats",
    "call_format_name",
    "record_format",
    "E2M1_VALUES",
    "FORMS",
    "E4M3_MAX",
    "CacheLayout",
    "get_format",
    "page_stride_bytes",
    "parse_cache",
    "page_bytes_view",
    "allocate_pages",
    "as_form",
    "scale_exponents",
    "quantize_pack",
    "unpack_dequantize",
    "unpack_fields",
    "check_scales",
    "flat_token_index",
]

E4M3_MAX = 448.0
Form = Literal["2d", "3d", "hnd", "nhd"]
FORMS: tuple[str, ...] = ("2d", "3d", "hnd", "nhd")
StrideSpec = Literal["tight", "padded"] | int
ScaleRule = Literal["flashmla", "sglang", "dsv4_1"]

#: The magnitudes of the E2M1 (FP4) codes 0..7; bit 3 is the sign (OCP Microscaling Formats (MX)
#: v1.0, section 5.3.3; flashinfer-python 0.7.2.post1 ``compressed_reference.py`` decoder table).
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass(frozen=True)
class PackedFormat:
    """Byte geometry of one packed FP8 KV-cache format (all sizes in bytes unless named ``d_*``).

    Attributes:
        name: ``"dsv4"``, ``"dsv3_2"``, ``"dsv4_1_swa"`` or ``"dsv4_1_indexed"``.
        bytes_per_token: 584 (DSV4), 656 (DSV3.2), 528 (V4.1 SWA), 288 (V4.1 indexed).
        d_qk: query/key width: 512 (DSV4: 448 NoPE + 64 RoPE) or 576 (DSV3.2: 512 + 64).
        d_v: value width, 512 for both (DSV4: the whole latent row; DSV3.2: the NoPE part).
        d_nope: FP8-quantized elements per token: 448 or 512.
        d_rope: BF16 elements per token: 64.
        group_size: elements per scale: 64 (UE8M0, DSV4), 128 (fp32, DSV3.2), 32 (UE8M0, V4.1 SWA),
            16 (E4M3, V4.1 indexed).
        layout: ``"footer"`` (scales after all token data of a page) or ``"inline"`` (one record
            per token: codes, scales, RoPE).
        code: ``"e4m3"`` (one FP8 byte per value) or ``"e2m1"`` (FP4, two values per byte).
        scale_kind: ``"ue8m0"`` (a biased power-of-two exponent byte), ``"fp32"`` or ``"e4m3"``.
        pad_row_alignment: the padded page stride is rounded up to a multiple of this (DSV4: 576,
            FlashMLA's TMA row; DSV3.2: not used, one extra row is added instead).
    """

    name: str
    bytes_per_token: int
    d_qk: int
    d_v: int
    d_nope: int
    d_rope: int
    group_size: int
    layout: str
    code: str = "e4m3"
    scale_kind: str = "ue8m0"

    @property
    def num_scales(self) -> int:
        """Scales per token: 7 (DSV4), 4 (DSV3.2), 16 (V4.1 SWA), 32 (V4.1 indexed)."""
        return self.d_nope // self.group_size

    @property
    def code_bytes_per_token(self) -> int:
        """Bytes of quantized codes per token: ``d_nope`` E4M3 bytes, or ``d_nope / 2`` for E2M1
        (two 4-bit codes per byte)."""
        return self.d_nope // 2 if self.code == "e2m1" else self.d_nope

    @property
    def data_bytes_per_token(self) -> int:
        """Token data bytes (codes + RoPE): 576 for DSV4; the whole record for inline formats."""
        if self.layout == "footer":
            return self.d_nope + 2 * self.d_rope
        return self.bytes_per_token

    @property
    def bf16_exact(self) -> bool:
        """Whether every dequantized value is exactly a BF16 number: DSV4 and V4.1 SWA (E4M3 codes,
        4 significant bits, times UE8M0 power-of-two scales; BF16 RoPE) and V4.1 indexed (E2M1
        values, at most 2 significant bits, times E4M3 scales, 4 bits) yes, except products below
        BF16's smallest subnormal step 2**-133 (which no packer rule writes); DSV3.2 no (its fp32
        scales may be any float)."""
        return self.scale_kind != "fp32"

    @property
    def bf16_rows(self) -> bool:
        """Whether a token's dequantized row is 512 exact BF16 values with no separate RoPE part,
        one record per token (the DeepSeek-V4.1 records, inline): the bundled reference's Triton
        forward gathers such candidates with torch operations into BF16 rows and attends them like
        DSV4 rows (``V = K``)."""
        return self.layout == "inline" and self.d_rope == 0 and self.d_qk == 512 and self.bf16_exact

    @property
    def scale_bytes_per_token(self) -> int:
        """Scale bytes per token: 8 for DSV4 (7 UE8M0 + 1 pad), 16 for DSV3.2 (4 fp32), 16 for V4.1
        SWA (16 UE8M0), 32 for V4.1 indexed (32 E4M3)."""
        if self.layout == "footer":
            return self.bytes_per_token - self.data_bytes_per_token
        return (4 if self.scale_kind == "fp32" else 1) * self.num_scales


DSV4 = PackedFormat("dsv4", 584, 512, 512, 448, 64, 64, "footer")
DSV3_2 = PackedFormat("dsv3_2", 656, 576, 512, 512, 64, 128, "inline", scale_kind="fp32")
#: DeepSeek-V4.1 SWA record: 512 E4M3 codes, then 16 UE8M0 scales (groups of 32).
DSV4_1_SWA = PackedFormat("dsv4_1_swa", 528, 512, 512, 512, 0, 32, "inline")
#: DeepSeek-V4.1 indexed record: 512 E2M1 codes, two per byte (low nibble first), then 32 E4M3
#: scales (groups of 16).
DSV4_1_INDEXED = PackedFormat(
    "dsv4_1_indexed", 288, 512, 512, 512, 0, 16, "inline", code="e2m1", scale_kind="e4m3"
)
FORMATS: dict[str, PackedFormat] = {
    f.name: f for f in (DSV4, DSV3_2, DSV4_1_SWA, DSV4_1_INDEXED)
}


@dataclass(frozen=True)
class CallFormat:
    """One attention call format: what an attention call's ``fmt`` names, and everything the rest of
    the package asks about it (one entry of :data:`CALL_FORMATS`, the one table every list of call
    formats reads: ``envelope.ALL_FORMATS`` and the default envelope, the bundled reference's
    backends, the FlashInfer grid's model, the suites' parametrisations).

    Attributes:
        name: the ``fmt`` value: ``"dsv4"``, ``"dsv3_2"``, ``"dsv4_1"``, or a record format used for
            both caches.
        main: record format of the main cache (``kv_cache``).
        extra: record format of the extra cache (``extra_kv_cache``).
        envelope: whether an ``Envelope`` may name it (``envelope.ALL_FORMATS``), and so the shipped
            suites run it: the call formats of DeepSeek's models. A V4.1 record format used for both
            caches (``"dsv4_1_swa"``, ``"dsv4_1_indexed"``) is a call of the bundled reference only.
        default_envelope: whether the default envelope (``envelope.UNIVERSAL``, that of an
            implementation declaring none) takes it. V4.1 is left out: a kernel that reads its
            records declares it.
        triton: whether the bundled reference's Triton kernel reads its records in place (the DSV4
            footer and DSV3.2 inline layouts). On CUDA the V4.1 records also run on the Triton
            kernel, their candidate rows gathered and dequantized by batched torch ops first
            (``attention._triton_forward.gather_records``); any other format runs on the torch backend.
        grid_model: the FlashInfer dispatch grid's model (``dispatch.grid.MODELS``) that judges the
            call: ``"DSV4"``, ``"DSV3_2"`` or ``"DSV4_1"`` (``ModelType::DSV4_1``; ``dispatch.format_model``
            picks ``"DSV4_1_INLINE"`` where the release reads inline records); ``None``: FlashInfer
            takes no such call, for the reason ``no_grid``.
        no_grid: why FlashInfer takes no call of this format (``grid_model`` ``None``).
    """

    name: str
    main: PackedFormat
    extra: PackedFormat
    envelope: bool = False
    default_envelope: bool = False
    triton: bool = False
    grid_model: str | None = None
    no_grid: str = ""

    @property
    def d_qk(self) -> int:
        """Query/key width of the call: the main record format's (512 DSV4 and V4.1, 576 DSV3.2)."""
        return self.main.d_qk

    @property
    def d_v(self) -> int:
        """Output (value) width of the call: the main record format's (512 for every format)."""
        return self.main.d_v


#: Every attention call format, by ``fmt``: one record format for both caches, or ``"dsv4_1"``:
#: DeepSeek-V4.1's SWA records in the main cache and its indexed records in the extra cache
#: (flashinfer-python 0.7.2.post1 ``compressed_reference.py``
#: ``compressed_sparse_mla_reference(..., cache_format="deepseek_v41")``). FlashInfer's models (its
#: ``ModelType``): ``dispatch.grid.MODELS``.
CALL_FORMATS: dict[str, CallFormat] = {
    c.name: c
    for c in (
        CallFormat("dsv4", DSV4, DSV4, envelope=True, default_envelope=True, triton=True, grid_model="DSV4"),
        CallFormat("dsv3_2", DSV3_2, DSV3_2, envelope=True, default_envelope=True, triton=True, grid_model="DSV3_2"),
        CallFormat("dsv4_1_swa", DSV4_1_SWA, DSV4_1_SWA, grid_model="DSV4_1"),
        CallFormat(
            "dsv4_1_indexed", DSV4_1_INDEXED, DSV4_1_INDEXED,
            no_grid="FlashInfer reads DeepSeek-V4.1 FP4 indexed records only in the extra cache "
            "(extra_kv_fp4=True); expected a main cache of SWA records (fmt='dsv4_1' or 'dsv4_1_swa')",
        ),
        CallFormat("dsv4_1", DSV4_1_SWA, DSV4_1_INDEXED, envelope=True, grid_model="DSV4_1"),
    )
}  # fmt: skip


def call_format(fmt: PackedFormat | str) -> CallFormat:
    """The :data:`CALL_FORMATS` entry of an attention call's ``fmt`` (a :class:`PackedFormat`: the
    entry of its name).

    Raises:
        ValueError: unknown name.
    """
    name = fmt.name if isinstance(fmt, PackedFormat) else fmt
    if name in CALL_FORMATS:
        return CALL_FORMATS[name]
    raise ValueError(f"fmt={fmt!r}: expected one of {sorted(CALL_FORMATS)}")


def get_format(fmt: PackedFormat | str) -> PackedFormat:
    """Resolve a format name (or a :class:`PackedFormat`) to a format; an attention call format
    (:data:`CALL_FORMATS`, e.g. ``"dsv4_1"``) resolves to the format of its main cache.

    Raises:
        ValueError: unknown name.
    """
    if isinstance(fmt, PackedFormat):
        return fmt
    if fmt in FORMATS:
        return FORMATS[fmt]
    if fmt in CALL_FORMATS:
        return CALL_FORMATS[fmt].main
    raise ValueError(f"fmt={fmt!r}: expected one of {sorted(CALL_FORMATS)}")


def call_format_name(fmt: PackedFormat | str) -> str:
    """The :data:`CALL_FORMATS` name of an attention call's ``fmt`` (``"dsv4"``, ``"dsv3_2"``,
    ``"dsv4_1"``, or a record format used for both caches).

    Raises:
        ValueError: unknown name.
    """
    if isinstance(fmt, PackedFormat):
        return fmt.name
    cache_formats(fmt)  # validates
    return fmt


def record_format(fmt: PackedFormat | str, name: str = "fmt") -> PackedFormat:
    """The record format of one cache: a :data:`FORMATS` name or a :class:`PackedFormat`.

    Raises:
        ValueError: an attention call format naming two record formats (``"dsv4_1"``: say which
            cache, ``"dsv4_1_swa"`` or ``"dsv4_1_indexed"``), or an unknown name.
    """
    if isinstance(fmt, str) and fmt not in FORMATS and fmt in CALL_FORMATS:
        main, extra = CALL_FORMATS[fmt].main, CALL_FORMATS[fmt].extra
        raise ValueError(
            f"{name}={fmt!r} is an attention call format (main cache {main.name!r}, extra cache {extra.name!r}); "
            f"one cache has one record format: expected {main.name!r} or {extra.name!r}"
        )
    return get_format(fmt)


def cache_formats(fmt: PackedFormat | str) -> tuple[PackedFormat, PackedFormat]:
    """``(main cache format, extra cache format)`` of an attention call's ``fmt``
    (:data:`CALL_FORMATS`; a :class:`PackedFormat` is both).

    Raises:
        ValueError: unknown name.
    """
    if isinstance(fmt, PackedFormat):
        return fmt, fmt
    entry = call_format(fmt)
    return entry.main, entry.extra


def _check_page_block_size(page_block_size: object, name: str = "page_block_size") -> int:
    if isinstance(page_block_size, bool) or not isinstance(page_block_size, int):
        raise TypeError(f"{name}={page_block_size!r}: expected a positive int (tokens per page)")
    if page_block_size <= 0:
        raise ValueError(f"{name}={page_block_size}: expected a positive number of tokens per page")
    return page_block_size


def page_stride_bytes(fmt: PackedFormat | str, page_block_size: int, stride: StrideSpec = "tight") -> int:
    """Page stride in bytes for ``stride`` = ``"tight"``, ``"padded"`` or an explicit byte count.

    DSV4 padded: ``ceil(ps*584/576)*576`` (1,728 / 37,440 / 74,880 / 149,760 bytes for ps 2 / 64 /
    128 / 256). DSV3.2 padded: ``(ps+1)*656``. V4.1 records: padded is tight, ``ps * 528`` /
    ``ps * 288`` (flashinfer-python 0.7.2.post1 ``pack_deepseek_v41_cache_reference``: pages are
    ``page_size * record_bytes``). Sources: ``docs/design/cache-formats.md``.

    Raises:
        ValueError: an explicit stride smaller than ``ps*bytes_per_token`` or not a multiple of 16,
            or an unknown stride name.
    """
    f = record_format(fmt)
    ps = _check_page_block_size(page_block_size)
    logical = ps * f.bytes_per_token
    if stride == "tight":
        if logical % 16:
            raise ValueError(
                f"page_stride='tight' with page_block_size={ps}: {ps}*{f.bytes_per_token} = {logical} "
                "bytes is not a multiple of 16, which FlashInfer requires of a page stride; use "
                "page_stride='padded' or an explicit multiple of 16"
            )
        return logical
    if stride == "padded":
        if f.layout == "footer":
            row = f.data_bytes_per_token
            return -(-logical // row) * row
        if f.scale_kind == "fp32":
            return (ps + 1) * f.bytes_per_token
        return logical  # V4.1 pages are page_size * record bytes, nothing more
    if isinstance(stride, bool) or not isinstance(stride, int):
        raise ValueError(f"page_stride={stride!r}: expected 'tight', 'padded' or a byte count")
    if stride < logical or stride % 16:
        raise ValueError(
            f"page_stride={stride}: expected a multiple of 16 bytes that is >= "
            f"page_block_size*{f.bytes_per_token} = {logical}"
        )
    return stride


@dataclass(frozen=True)
class CacheLayout:
    """Geometry of a packed cache tensor, as parsed by :func:`parse_cache`.

    Attributes:
        fmt: the packed format.
        form: ``"2d"``, ``"3d"``, ``"hnd"`` or ``"nhd"``.
        num_pages: number of pages (``shape[0]``).
        page_block_size: tokens per page.
        page_stride: ``stride(0)`` in bytes.
        token_stride: bytes between consecutive token rows (``bytes_per_token`` except for padded
            DSV3.2 rows; 2-D tensors report ``bytes_per_token``).
    """

    fmt: PackedFormat
    form: str
    num_pages: int
    page_block_size: int
    page_stride: int
    token_stride: int

    @property
    def num_tokens(self) -> int:
        """``num_pages * page_block_size``: the number of flat token indices."""
        return self.num_pages * self.page_block_size

    @property
    def page_bytes(self) -> int:
        """Bytes of a page that hold data: ``page_block_size * token_stride``."""
        return self.page_block_size * self.token_stride


def parse_cache(
    cache: torch.Tensor,
    fmt: PackedFormat | str = DSV4,
    *,
    page_block_size: int | None = None,
    name: str = "kv_cache",
) -> CacheLayout:
    """Validate a packed cache tensor and return its :class:`CacheLayout`.

    Args:
        cache: uint8 tensor in one of the forms ``[P, ps*B]``, ``[P, ps, B]``, ``[P, 1, ps, B]``
            (HND) or ``[P, ps, 1, B]`` (NHD).
        fmt: the packed format.
        page_block_size: for 2-D tensors, the tokens per page if the caller knows it (it must
            agree with ``shape[1] / B``); for other forms, if given, it must equal the shape's.
        name: argument name used in error messages (``"kv_cache"``, ``"extra_kv_cache"``).

    Raises:
        TypeError: not a tensor, or dtype is not ``torch.uint8`` (view FP8 caches with
            ``.view(torch.uint8)`` first).
        ValueError: ndim not in 2..4; last dim not contiguous; wrong last dim; token-axis stride
            not exactly B (DSV4); page stride smaller than ``ps*B`` or not a multiple of 16; data
            pointer not 16-byte aligned; 4-D without a singleton head axis; zero pages or tokens;
            ``page_block_size`` disagreeing with the shape.
    """
    import torch

    f = record_format(fmt)
    bpt = f.bytes_per_token
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(cache).__name__}")
    if cache.dtype != torch.uint8:
        raise TypeError(
            f"{name}.dtype={cache.dtype}: expected torch.uint8 (a packed {f.name} byte cache; "
            "view FP8 tensors with .view(torch.uint8))"
        )
    if cache.dim() not in (2, 3, 4):
        raise ValueError(
            f"{name}.ndim={cache.dim()} (shape {tuple(cache.shape)}): expected a 2-D, 3-D or 4-D "
            "packed cache ([P, ps*B], [P, ps, B], [P, 1, ps, B] HND or [P, ps, 1, B] NHD)"
        )
    if cache.shape[-1] > 0 and cache.stride(-1) != 1:
        raise ValueError(f"{name}.stride(-1)={cache.stride(-1)}: the last dim must be contiguous")
    num_pages = int(cache.shape[0])
    if num_pages == 0:
        raise ValueError(f"{name}.shape={tuple(cache.shape)}: expected at least one page")
    if cache.dim() == 2:
        width = int(cache.shape[1])
        if width == 0 or width % bpt:
            raise ValueError(
                f"{name}.shape[1]={width}: a 2-D {f.name} cache must be [num_pages, ps*{bpt}] with "
                f"a whole number of {bpt}-byte tokens per page (slice padded pages to [:, :ps*{bpt}])"
            )
        ps = width // bpt
        form = "2d"
        token_stride = bpt
    else:
        if cache.shape[-1] != bpt:
            other = [g.name for g in FORMATS.values() if g.bytes_per_token == cache.shape[-1]]
            hint = f" (a {other[0]} cache? pass fmt={other[0]!r}, or 'dsv4_1' for a V4.1 call)" if other else ""
            raise ValueError(
                f"{name}.shape[-1]={cache.shape[-1]}: expected {bpt} bytes per {f.name} token{hint}"
            )
        if cache.dim() == 3:
            ps, token_axis, form = int(cache.shape[1]), 1, "3d"
        elif cache.shape[1] == 1:
            ps, token_axis, form = int(cache.shape[2]), 2, "hnd"
        elif cache.shape[2] == 1:
            ps, token_axis, form = int(cache.shape[1]), 1, "nhd"
        else:
            raise ValueError(
                f"{name}.shape={tuple(cache.shape)}: a 4-D cache needs a singleton KV-head axis "
                f"([P, 1, ps, {bpt}] HND or [P, ps, 1, {bpt}] NHD)"
            )
        if ps == 0:
            raise ValueError(f"{name}.shape={tuple(cache.shape)}: page capacity must be positive")
        token_stride = int(cache.stride(token_axis)) if ps > 1 else bpt
        if f.layout == "footer" and token_stride != bpt:
            raise ValueError(
                f"{name}.stride({token_axis})={token_stride}: footer-scale {f.name} rows must stay "
                f"tightly packed; expected a token-axis stride of exactly {bpt} bytes"
            )
        if f.layout == "inline" and (token_stride < bpt or token_stride % 16):
            raise ValueError(
                f"{name}.stride({token_axis})={token_stride}: expected a token-axis stride >= {bpt} "
                "bytes and a multiple of 16"
            )
    if page_block_size is not None:
        _check_page_block_size(page_block_size)
        if page_block_size != ps:
            raise ValueError(
                f"page_block_size={page_block_size} disagrees with {name}.shape={tuple(cache.shape)}, "
                f"which holds {ps} tokens per page"
            )
    page_stride = int(cache.stride(0))
    if page_stride < ps * token_stride:
        raise ValueError(
            f"{name}.stride(0)={page_stride}: the page stride must be >= page_block_size*"
            f"{token_stride} = {ps * token_stride} bytes"
        )
    if page_stride % 16:
        raise ValueError(
            f"{name}.stride(0)={page_stride}: the page stride must be a multiple of 16 bytes"
        )
    if cache.data_ptr() % 16:
        raise ValueError(
            f"{name}.data_ptr()={cache.data_ptr():#x}: the data pointer must be 16-byte aligned"
        )
    return CacheLayout(f, form, num_pages, ps, page_stride, token_stride)


def page_bytes_view(cache: torch.Tensor, layout: CacheLayout) -> torch.Tensor:
    """A ``[num_pages, page_bytes]`` uint8 view of the bytes of each page that hold data.

    The view shares storage with ``cache`` and keeps its page stride, so it is the one "raw page"
    accessor both unpacking and the page split use. Padding past ``page_bytes`` is not included.
    """
    import torch

    return torch.as_strided(
        cache,
        (layout.num_pages, layout.page_bytes),
        (layout.page_stride, 1),
        cache.storage_offset(),
    )


def allocate_pages(
    num_pages: int,
    page_stride: int,
    *,
    device: torch.device | str = "cpu",
    fill: int = 0,
) -> torch.Tensor:
    """Allocate a ``[num_pages, page_stride]`` uint8 page buffer filled with ``fill`` (bytes).

    Raises:
        ValueError: ``num_pages`` < 1, ``page_stride`` < 1 or ``fill`` outside 0..255.
    """
    import torch

    if num_pages < 1 or page_stride < 1:
        raise ValueError(f"num_pages={num_pages}, page_stride={page_stride}: expected positive ints")
    if isinstance(fill, bool) or not isinstance(fill, int) or not 0 <= fill <= 255:
        raise ValueError(f"fill={fill}: expected a byte value 0..255")
    return torch.full((num_pages, page_stride), fill, dtype=torch.uint8, device=device)


def as_form(
    buffer: torch.Tensor,
    fmt: PackedFormat | str,
    page_block_size: int,
    form: str = "nhd",
) -> torch.Tensor:
    """View a ``[num_pages, page_stride]`` uint8 page buffer as a packed cache of ``form``.

    The returned view keeps the buffer's page stride. The 2-D form is ``[P, ps*B]`` (a padded
    buffer stays padded through ``stride(0)``), the others as in the module docstring; a
    contiguous HND view has a head-axis stride of ``ps*B`` as in FlashInfer's tests
    (``kv_packed.transpose(1, 2).contiguous()``).

    Raises:
        ValueError: unknown ``form``, a non-2-D or non-uint8 buffer, or a buffer whose rows are
            shorter than ``ps*B``.
    """
    import torch

    f = get_format(fmt)
    ps = _check_page_block_size(page_block_size)
    bpt = f.bytes_per_token
    if buffer.dtype != torch.uint8 or buffer.dim() != 2:
        raise ValueError(
            f"buffer: expected a 2-D uint8 page buffer, got {buffer.dtype} {tuple(buffer.shape)}"
        )
    if buffer.shape[1] < ps * bpt:
        raise ValueError(f"buffer.shape[1]={buffer.shape[1]}: expected >= ps*{bpt} = {ps * bpt}")
    p, s0, off = int(buffer.shape[0]), int(buffer.stride(0)), buffer.storage_offset()
    if form == "2d":
        return torch.as_strided(buffer, (p, ps * bpt), (s0, 1), off)
    if form == "3d":
        return torch.as_strided(buffer, (p, ps, bpt), (s0, bpt, 1), off)
    if form == "nhd":
        return torch.as_strided(buffer, (p, ps, 1, bpt), (s0, bpt, bpt, 1), off)
    if form == "hnd":
        return torch.as_strided(buffer, (p, 1, ps, bpt), (s0, ps * bpt, bpt, 1), off)
    raise ValueError(f"form={form!r}: expected one of {FORMS}")


def _pow2_exponent_ceil(x: torch.Tensor) -> torch.Tensor:
    """Exact ``ceil(log2(x))`` for positive finite fp32 ``x`` (int32), via ``frexp``."""
    import torch

    mantissa, exponent = torch.frexp(x)
    # x = m * 2**e with m in [0.5, 1): x is a power of two iff m == 0.5, then log2(x) = e - 1.
    return torch.where(mantissa == 0.5, exponent - 1, exponent).to(torch.int32)


def scale_exponents(amax: torch.Tensor, rule: ScaleRule = "flashmla") -> torch.Tensor:
    """Power-of-two scale exponents ``e`` (scale ``s = 2**e``) for group maxima ``amax``.

    Args:
        amax: fp32 tensor of non-negative group maxima ``max |x|``.
        rule: ``"flashmla"``: ``e = ceil(log2(max(amax/448, 1e-4)))`` (smallest ``e`` is -13, UE8M0
            byte 114); ``"sglang"``: ``e = ceil(log2(max(amax, 1e-8)/448))``; ``"dsv4_1"`` (the V4.1
            SWA record): ``e = ceil(log2(max(amax, 1e-4)/448))`` (flashinfer-python 0.7.2.post1
            ``compressed_reference.py`` ``pack_deepseek_v41_cache_reference``). Sources:
            ``docs/design/cache-formats.md``. ``amax/448`` and the floors are evaluated in fp32, as the
            writers do.

    Returns:
        int32 tensor of exponents, same shape; the UE8M0 byte is ``127 + e``.

    Raises:
        ValueError: unknown rule, or a negative or non-finite ``amax``.
    """
    import torch

    a = amax.to(torch.float32)
    if a.numel() and not bool((torch.isfinite(a) & (a >= 0)).all()):
        raise ValueError("amax: expected finite, non-negative group maxima (max |x| of finite values)")
    if rule == "flashmla":
        x = torch.clamp(a / E4M3_MAX, min=1e-4)
    elif rule == "sglang":
        x = torch.clamp(a, min=1e-8) / E4M3_MAX
    elif rule == "dsv4_1":
        x = torch.clamp(a, min=1e-4) / E4M3_MAX
    else:
        raise ValueError(f"scale_rule={rule!r}: expected 'flashmla', 'sglang' or 'dsv4_1'")
    return _pow2_exponent_ceil(x)


#: The smallest NoPE magnitude whose quantized value overflows fp32 on dequantization: with the
#: scale 2**120 (either rule) the E4M3 rounding of 248 is 256 (a tie, to even), and 256 * 2**120
#: = 2**128 is inf; :func:`quantize_pack` refuses such sources (BF16 0x7F78 and above).
NOPE_OVERFLOW = 248.0 * 2.0**120


def _source_is_clean(source: torch.Tensor, f: PackedFormat) -> bool:
    """Whether every value of BF16 ``source`` ``[..., d_qk]`` is finite and every NoPE value is
    below :data:`NOPE_OVERFLOW` in magnitude, from the extremes (``torch.aminmax`` propagates NaN and
    reads BF16 in one pass: several times faster than an elementwise ``isfinite`` over a million
    rows); :func:`_check_source` looks for the first bad value only when this says no."""
    import torch

    parts = [(source[..., : f.d_nope], NOPE_OVERFLOW)]
    if f.d_rope:
        parts.append((source[..., f.d_nope :], math.inf))
    for part, bound in parts:
        low, high = (float(v) for v in torch.aminmax(part))
        if not (-bound < low and high < bound):  # False for NaN
            return False
    return True


def _check_source(source: torch.Tensor, f: PackedFormat) -> None:
    import torch

    if not isinstance(source, torch.Tensor):
        raise TypeError(f"source: expected a torch.Tensor, got {type(source).__name__}")
    if source.dtype != torch.bfloat16:
        raise TypeError(f"source.dtype={source.dtype}: expected torch.bfloat16 latent rows")
    if source.dim() != 3 or source.shape[-1] != f.d_qk:
        raise ValueError(
            f"source.shape={tuple(source.shape)}: expected [num_pages, page_block_size, {f.d_qk}] "
            f"for {f.name}"
        )
    if source.shape[0] < 1 or source.shape[1] < 1:
        raise ValueError(f"source.shape={tuple(source.shape)}: expected at least one page and token")
    if _source_is_clean(source, f):
        return
    finite = torch.isfinite(source)
    if not bool(finite.all()):
        bad = (~finite).nonzero()[0].tolist()
        count = int((~finite).sum())
        raise ValueError(
            f"source holds {count} non-finite value(s) (first at [page, slot, dim] = {bad}); "
            "NaN/inf have no specified FP8 encoding, so packing refuses them"
        )
    big = source[..., : f.d_nope].abs() >= NOPE_OVERFLOW
    if bool(big.any()):
        bad = big.nonzero()[0].tolist()
        raise ValueError(
            f"source holds {int(big.sum())} NoPE value(s) with |x| >= 248 * 2**120 = {NOPE_OVERFLOW:.6g} "
            f"(first at [page, slot, dim] = {bad}): the scale is 2**120 and x / 2**120 rounds to the "
            "E4M3 code 256, which dequantizes to 2**128 = inf in fp32; expected |x| < 248 * 2**120"
        )


def _quantize_groups(
    nope: torch.Tensor, group_size: int, rule: ScaleRule
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``[..., n]`` fp32 NoPE values in groups: (E4M3 code bytes, int32 exponents)."""
    import torch

    shape = nope.shape
    groups = nope.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    exponents = scale_exponents(groups.abs().amax(dim=-1), rule)
    scaled = torch.ldexp(groups, (-exponents).unsqueeze(-1).to(groups.dtype))
    codes = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes.reshape(shape), exponents


#: The midpoints between neighbouring E2M1 magnitudes, and whether a value exactly on one rounds up:
#: ties go to the even code, so a midpoint above an odd code (0.75, 1.75, 3.5) rounds up.
_E2M1_MIDPOINTS: tuple[tuple[float, bool], ...] = (
    (0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False),
)  # fmt: skip


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """E2M1 (FP4) codes of fp32 ``x`` (uint8 0..15: bit 3 the sign, bits 0-2 the index into
    :data:`E2M1_VALUES`): round to nearest, ties to the even code, magnitudes above 6 saturate to 6,
    the sign of a zero is kept (-0.0 is code 8). The index is the number of midpoints the magnitude
    passes (every midpoint is an exact fp32 number, so the comparisons are exact)."""
    import torch

    magnitude = x.abs()
    index = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for midpoint, tie_up in _E2M1_MIDPOINTS:
        index += (magnitude >= midpoint if tie_up else magnitude > midpoint).to(torch.uint8)
    return index | (torch.signbit(x).to(torch.uint8) << 3)


def _quantize_e2m1(values: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``[..., n]`` fp32 values to packed E2M1 bytes ``[..., n/2]`` (low nibble = even
    element) and E4M3 group scales (bytes ``[..., n/group_size]``).

    The scale of a group is the E4M3 rounding (to nearest even) of ``min(max(amax, 6 * 2**-9) / 6,
    448)`` and the codes are those of ``x / scale`` (a true division), as flashinfer-python
    0.7.2.post1 ``pack_deepseek_v41_cache_reference`` writes them (its comment: DeepSeek-V4.1's
    ``fp4_quant_kernel`` divides).
    """
    import torch

    shape = values.shape
    groups = values.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    amax = groups.abs().amax(dim=-1)
    scale = (torch.clamp(amax, min=6.0 * 2.0**-9) / 6.0).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    codes = _e2m1_codes(groups / scale.to(torch.float32).unsqueeze(-1)).reshape(*shape[:-1], shape[-1] // 2, 2)
    return codes[..., 0] | (codes[..., 1] << 4), scale.view(torch.uint8)


def _default_rule(f: PackedFormat, rule: ScaleRule | None) -> ScaleRule | None:
    """The scale rule for ``f``: ``rule`` if given, else the format's writer rule (``"flashmla"``
    for DSV4 and DSV3.2, ``"dsv4_1"`` for the V4.1 SWA record); the V4.1 indexed record's E4M3
    scales follow their one rule (``None``).

    Raises:
        ValueError: a rule for the indexed record other than ``None`` / ``"dsv4_1"``.
    """
    if f.code == "e2m1":
        if rule not in (None, "dsv4_1"):
            raise ValueError(
                f"scale_rule={rule!r} with fmt={f.name!r}: its E4M3 group scales follow one rule "
                "(min(max(amax, 6*2**-9)/6, 448) rounded to E4M3); expected scale_rule=None"
            )
        return None
    if rule is None:
        return "dsv4_1" if f.name.startswith("dsv4_1") else "flashmla"
    return rule


def quantize_pack(
    source: torch.Tensor,
    fmt: PackedFormat | str = DSV4,
    *,
    page_stride: StrideSpec = "tight",
    form: str = "nhd",
    scale_rule: ScaleRule | None = None,
    pad_fill: int = 0,
) -> torch.Tensor:
    """Quantize BF16 latent rows and pack them into a paged FP8 (or FP4) cache.

    Args:
        source: ``[num_pages, page_block_size, d_qk]`` BF16 (d_qk 512 for DSV4 and V4.1, 576 for
            DSV3.2), finite, on any device; the cache is built on the same device.
        fmt: a format of :data:`FORMATS` (``"dsv4"``, ``"dsv3_2"``, ``"dsv4_1_swa"``,
            ``"dsv4_1_indexed"``) or a :class:`PackedFormat`.
        page_stride: ``"tight"``, ``"padded"`` or an explicit byte count (see :func:`page_stride_bytes`).
        form: tensor form of the result: ``"2d"``, ``"3d"``, ``"hnd"`` or ``"nhd"``.
        scale_rule: ``"flashmla"``, ``"sglang"`` or ``"dsv4_1"`` (see :func:`scale_exponents`);
            ``None`` (default): the format's writer rule (``"flashmla"`` for DSV4 and DSV3.2,
            ``"dsv4_1"`` for V4.1 SWA; the V4.1 indexed record takes ``None`` or ``"dsv4_1"``, its own).
        pad_fill: byte written to the DSV4 scale pad byte and to page padding (0 like FlashInfer's
            and SGLang's writers; tests use other values to prove nothing reads them).

    Returns:
        A uint8 view in ``form`` over a ``[num_pages, page_stride]`` buffer.

    Raises:
        TypeError: ``source`` is not a BF16 tensor.
        ValueError: wrong shape, non-finite values, NoPE values ``>=`` :data:`NOPE_OVERFLOW` in
            magnitude (they would dequantize to inf), bad stride, form or scale rule.
    """
    import torch

    f = record_format(fmt)
    rule = _default_rule(f, scale_rule)
    _check_source(source, f)
    num_pages, ps, _ = (int(v) for v in source.shape)
    stride = page_stride_bytes(f, ps, page_stride)
    buffer = allocate_pages(num_pages, stride, device=source.device, fill=pad_fill)
    x = source.to(torch.float32)
    if f.code == "e2m1":
        packed, scale_bytes = _quantize_e2m1(x, f.group_size)
        buffer[:, : ps * f.bytes_per_token] = torch.cat([packed, scale_bytes], dim=-1).reshape(num_pages, -1)
        return as_form(buffer, f, ps, form)
    assert rule is not None
    codes, exponents = _quantize_groups(x[..., : f.d_nope], f.group_size, rule)
    rope = source[..., f.d_nope :].contiguous().view(torch.uint8)  # [P, ps, 2 * d_rope]
    if f.scale_kind == "ue8m0" and f.layout == "inline":
        rows = torch.cat([codes, (exponents + 127).to(torch.uint8), rope], dim=-1).reshape(num_pages, -1)
        buffer[:, : rows.shape[1]] = rows
        return as_form(buffer, f, ps, form)
    if f.layout == "footer":
        data = torch.cat([codes, rope], dim=-1).reshape(num_pages, ps * f.data_bytes_per_token)
        scales = torch.full(
            (num_pages, ps, f.scale_bytes_per_token), pad_fill, dtype=torch.uint8, device=x.device
        )
        scales[..., : f.num_scales] = (exponents + 127).to(torch.uint8)
        buffer[:, : data.shape[1]] = data
        buffer[:, data.shape[1] : data.shape[1] + ps * f.scale_bytes_per_token] = scales.reshape(
            num_pages, -1
        )
    else:
        scale_values = torch.ldexp(torch.ones_like(exponents, dtype=torch.float32), exponents)
        scale_bytes = scale_values.contiguous().view(torch.uint8)  # [P, ps, 16] little-endian fp32
        rows = torch.cat([codes, scale_bytes, rope], dim=-1).reshape(num_pages, -1)
        buffer[:, : rows.shape[1]] = rows
    return as_form(buffer, f, ps, form)


@dataclass(frozen=True)
class PackedFields:
    """Raw fields of every token of a packed cache (see :func:`unpack_fields`).

    Attributes:
        codes: ``[P, ps, d_nope]`` uint8: E4M3 code bytes, or one E2M1 code (0..15) per value for
            the V4.1 indexed record (the packed nibbles, low nibble first, unpacked).
        scale_bytes: DSV4: ``[P, ps, 8]`` uint8 footer records (7 UE8M0 bytes + pad);
            DSV3.2: ``[P, ps, 16]`` uint8 (4 little-endian fp32 scales); V4.1 SWA: ``[P, ps, 16]``
            UE8M0 bytes; V4.1 indexed: ``[P, ps, 32]`` E4M3 bytes.
        rope: ``[P, ps, 64]`` BF16 RoPE values (``[P, ps, 0]`` for V4.1: its RoPE values are codes).
    """

    codes: torch.Tensor
    scale_bytes: torch.Tensor
    rope: torch.Tensor


def unpack_fields(
    cache: torch.Tensor,
    fmt: PackedFormat | str = DSV4,
    *,
    page_block_size: int | None = None,
    layout: CacheLayout | None = None,
) -> PackedFields:
    """Split a packed cache into its raw fields by page and slot (never by 584-byte rows).

    Args:
        layout: the cache's :class:`CacheLayout` as :func:`parse_cache` returned it for this
            tensor (e.g. ``attention.call.Candidates.layout``): the cache is not parsed again, and
            ``fmt`` / ``page_block_size`` are not read (the layout's format is the record format).

    Raises:
        TypeError, ValueError: as :func:`parse_cache` (without ``layout``).
    """
    import torch

    if layout is None:
        layout = parse_cache(cache, record_format(fmt), page_block_size=page_block_size)
    f = layout.fmt
    pages = page_bytes_view(cache, layout)
    p, ps = layout.num_pages, layout.page_block_size
    if f.layout == "footer":
        data = pages[:, : ps * f.data_bytes_per_token].reshape(p, ps, f.data_bytes_per_token)
        footer_start = ps * f.data_bytes_per_token
        scale_bytes = pages[:, footer_start : footer_start + ps * f.scale_bytes_per_token]
        scale_bytes = scale_bytes.reshape(p, ps, f.scale_bytes_per_token)
        codes = data[..., : f.d_nope]
        rope_bytes = data[..., f.d_nope :]
    else:
        rows = pages.reshape(p, ps, layout.token_stride)[..., : f.bytes_per_token]
        code_end = f.code_bytes_per_token
        codes = rows[..., :code_end]
        scale_bytes = rows[..., code_end : code_end + f.scale_bytes_per_token]
        rope_bytes = rows[..., code_end + f.scale_bytes_per_token :]
        if f.code == "e2m1":
            codes = torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(p, ps, f.d_nope)
    rope = rope_bytes.contiguous().view(torch.bfloat16)
    return PackedFields(codes.contiguous(), scale_bytes.contiguous(), rope)


def check_scales(cache: torch.Tensor, fmt: PackedFormat | str = DSV4, *, page_block_size: int | None = None) -> None:
    """Refuse a cache holding a record whose scale is not a finite positive number: a UE8M0 byte
    0xFF (2**128, infinite in fp32), an E4M3 scale byte 0x7F / 0xFF (NaN) or a negative one, an
    fp32 scale that is NaN, infinite or not positive. :func:`quantize_pack` never writes one; a
    reader that meets one decodes garbage (:func:`unpack_dequantize` decodes it as it is).

    Raises:
        TypeError, ValueError: as :func:`parse_cache`.
        ValueError: the first bad record, by page, slot and scale group, with its byte(s).
    """
    import torch

    f = record_format(fmt)
    fields = unpack_fields(cache, f, page_block_size=page_block_size)
    raw = fields.scale_bytes[..., : f.num_scales * (4 if f.scale_kind == "fp32" else 1)]
    if f.scale_kind == "ue8m0":
        bad = raw == 0xFF
    elif f.scale_kind == "e4m3":
        value = raw.view(torch.float8_e4m3fn).to(torch.float32)
        bad = ~torch.isfinite(value) | (value < 0)
    else:
        value = raw.contiguous().view(torch.float32)
        bad = ~torch.isfinite(value) | (value <= 0)
    if bool(bad.any()):
        page, slot, group = (int(v) for v in bad.nonzero()[0])
        width = 4 if f.scale_kind == "fp32" else 1
        shown = raw[page, slot, group * width : group * width + width].tolist()
        raise ValueError(
            f"{f.name} cache: page {page}, slot {slot}, scale group {group} holds byte(s) "
            f"{[hex(b) for b in shown]}, not a finite positive {f.scale_kind} scale "
            f"({int(bad.sum())} bad scale(s) in all)"
        )


def unpack_dequantize(
    cache: torch.Tensor,
    fmt: PackedFormat | str = DSV4,
    *,
    page_block_size: int | None = None,
    dtype: torch.dtype | None = None,
    layout: CacheLayout | None = None,
) -> torch.Tensor:
    """Dequantize a packed cache to ``[num_pages, page_block_size, d_qk]`` latent rows.

    NoPE element ``i`` of a token is ``e4m3(code[i]) * 2**(byte[i // 64] - 127)`` for DSV4 (the
    pad byte is never read), ``e4m3(code[i]) * scale[i // 128]`` for DSV3.2, ``e4m3(code[i]) *
    2**(byte[i // 32] - 127)`` for the V4.1 SWA record and ``e2m1(code[i]) *
    e4m3(scale[i // 16])`` for the V4.1 indexed record (flashinfer-python 0.7.2.post1
    ``compressed_reference.py`` ``unpack_deepseek_v41_cache_reference``); RoPE values are the
    stored BF16 bits (FlashInfer ``tests/attention/sparse_mla_test_utils.py``
    ``_dequantize_kv_footer``; FlashMLA ``tests/quant.py`` ``dequantize_k_cache``). The products
    are exact in fp32 and BF16.

    Args:
        cache: packed uint8 cache in any accepted form.
        fmt: the packed format.
        page_block_size: see :func:`parse_cache`.
        dtype: result dtype (``torch.float32``, ``torch.bfloat16`` or ``torch.float64``; ``None``, the
            default: ``torch.float32``).
        layout: the cache's :class:`CacheLayout` as :func:`parse_cache` returned it for this
            tensor (e.g. ``attention.call.Candidates.layout``, what ``SparseMlaCall.read`` parsed):
            the cache is not parsed again, and ``fmt`` / ``page_block_size`` are not read.

    Raises:
        TypeError: ``dtype`` is not a floating dtype; as :func:`parse_cache` (without ``layout``).
        ValueError: as :func:`parse_cache` (without ``layout``).
    """
    import torch

    f = record_format(fmt) if layout is None else layout.fmt
    dtype = torch.float32 if dtype is None else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype={dtype!r}: expected a floating torch.dtype (torch.float32, torch.bfloat16, ...)")
    fields = unpack_fields(cache, f, page_block_size=page_block_size, layout=layout)
    p, ps, _ = fields.codes.shape
    if f.code == "e2m1":  # codes 0..7 the magnitudes, 8..15 the same negated (-0.0 for code 8)
        table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=fields.codes.device)
        values = table[fields.codes.to(torch.int32)]
    else:
        values = fields.codes.view(torch.float8_e4m3fn).to(torch.float32)
    groups = values.reshape(p, ps, f.num_scales, f.group_size)
    if f.scale_kind == "ue8m0":
        exponents = fields.scale_bytes[..., : f.num_scales].to(torch.int32) - 127
        scale = torch.ldexp(torch.ones_like(exponents, dtype=torch.float32), exponents)
    elif f.scale_kind == "e4m3":
        scale = fields.scale_bytes.view(torch.float8_e4m3fn).to(torch.float32)
    else:
        scale = fields.scale_bytes.view(torch.float32)
    nope = (groups * scale.unsqueeze(-1)).reshape(p, ps, f.d_nope)
    out = torch.cat([nope, fields.rope.to(torch.float32)], dim=-1) if f.d_rope else nope
    return out.to(dtype)


def token_byte_ranges(fmt: PackedFormat | str, page_block_size: int, slot: int) -> list[tuple[int, int]]:
    """The byte ranges ``[lo, hi)`` within its page that a reader uses for token ``slot``.

    DSV4 footer layout: the codes and the RoPE part ``[slot*576, slot*576 + 576)`` and the 7 UE8M0
    scales ``[ps*576 + slot*8, ps*576 + slot*8 + 7)`` (byte 7 of the 8-byte scale record is padding
    nobody reads); inline records (DSV3.2 656 B, V4.1 SWA 528 B, V4.1 indexed 288 B):
    ``[slot*B, slot*B + B)``. Byte geometry: ``docs/design/cache-formats.md``.

    Raises:
        ValueError: ``slot`` outside ``[0, page_block_size)``.
    """
    f = record_format(fmt)
    ps = _check_page_block_size(page_block_size)
    if not 0 <= slot < ps:
        raise ValueError(f"slot={slot}: expected 0 <= slot < page_block_size={ps}")
    if f.layout == "footer":
        row = f.data_bytes_per_token
        return [(slot * row, (slot + 1) * row), (ps * row + slot * 8, ps * row + slot * 8 + f.num_scales)]
    return [(slot * f.bytes_per_token, (slot + 1) * f.bytes_per_token)]


def flat_token_index(page: int, slot: int, page_block_size: int) -> int:
    """Flat token index ``page * page_block_size + slot`` (FlashInfer ``kv_cache_io.cuh`` ``page_divmod``).

    Raises:
        ValueError: negative page, or slot outside ``[0, page_block_size)``.
    """
    ps = _check_page_block_size(page_block_size)
    if page < 0 or not 0 <= slot < ps:
        raise ValueError(f"page={page}, slot={slot}: expected page >= 0 and 0 <= slot < {ps}")
    return page * ps + slot
