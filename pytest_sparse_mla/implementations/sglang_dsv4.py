"""Built-ins ``sglang-dsv4-triton`` and ``sglang-dsv4-tilelang``: adapters over the DeepSeek-V4 FP8
sparse decode kernels SGLang 0.5.23 serves V4 with where FlashMLA's CUDA kernels are not used,
executed from the installed ``sglang`` wheel (``pip install --no-deps sglang==0.5.23``).

What runs (sgl-project/sglang, files of the installed package, ``sglang/kernels/ops/attention/``):

* ``sglang-dsv4-triton``: ``triton_fp8_attention_fwd`` of ``dsv4/triton_sparse_decode/__init__.py``
  (-> ``triton_sparse_attn_decode`` of ``triton_mla_kernels_decode_optimized.py`` -> the fused
  gather + dequantize + attention kernels of ``triton_mla_kernels_decode_fused.py``: one cache,
  ``fused_gather_attn_decode_dsv4``, split-K from top-k 8192; two caches, split-K
  (``..._dual_scope_low_overhead``) or not (``..._dual_scope``) by ``_should_use_fused_splitk``;
  every kernel ``@triton.autotune``'d).
* ``sglang-dsv4-tilelang``: ``dpsk_v4_fp8_attention_fwd`` of ``dsv4/tilelang_fp8_attention.py``
  (a TileLang partial kernel over 32-lane blocks and a combine kernel; SGLang 0.5.23 pins ``tilelang``
  0.1.12; under that pin and under 0.1.15 the kernel does not compile for sm_90, so the adapter skips
  there, :func:`_tilelang_reason`; SGLang calls it from its ROCm backend).

The caller, and how the adapters copy it. Both are the ``"triton"`` / ``"tilelang"`` branches of
``flash_mla_with_kvcache_entrypoint`` (``sglang/srt/layers/attention/hip_flash_mla.py``, lines
199-235), which ``DeepseekV4HipRadixBackend.forward``
(``sglang/srt/layers/attention/deepseek_v4_backend_hip_radix.py``, lines 3348-3464) calls with
keyword arguments only: ``q`` ``[T, 1, H, 512]`` BF16 (``q.unsqueeze(1)`` of ``[T, H, 512]``),
``k_cache`` ``[P, ps, 1, 584]`` uint8 (a view of the 2-D pool ``[P, >= ps*584]``: page stride the
pool's row, token stride 584, line 3356), ``head_dim_v=512``, ``block_table=None``,
``cache_seqlens=None``, ``tile_scheduler_metadata`` (FlashMLA's; neither kernel reads it: the adapters
pass ``None``), ``softmax_scale``, ``is_fp8_kvcache=True``, ``indices`` ``[T, 1, topk]`` int32,
``topk_length`` ``[T]`` int32, ``attn_sink`` ``[H]`` fp32, ``extra_k_cache`` (same view, or
``None``), ``extra_indices_in_kvcache`` ``[T, 1, extra_topk]``, ``extra_topk_length`` ``[T]``;
``o = entrypoint(...)[0]`` ``[T, 1, H, 512]`` BF16, ``.squeeze(1)``. The adapters pass the read
call's tensors as they are, with the same unsqueezes (``_peer.nhd_view`` gives the cache its
``[P, ps, 1, 584]`` shape over the same bytes, storage offset and page stride; nothing is converted,
copied or made contiguous). Both kernels also return an LSE ``[T, 1, H]`` fp32 in FlashMLA's
convention (natural log, sink *excluded*: the sink only scales the output; ``+inf`` for a row with no
valid lane), which the caller drops; the adapters convert it to the asked convention
(``_peer.lse_to_convention``).

Masking: the Triton kernels mask a lane whose index is ``-1`` or that lies past ``topk_length``
(``is_invalid = indices == -1``, then ``tl.maximum(indices, 0)``: another negative index reads token
0; ``triton_mla_kernels_decode_fused.py`` line 441), FlashMLA's decode convention, declared
``masked_indices="minus_one"``; the TileLang kernel masks every negative index
(``valid = (idx >= 0) & (pos < tk_len)``, ``tilelang_fp8_attention.py`` line 234).

What the caller guarantees and the kernels do not check (the envelopes hold the caller's contract;
``docs/conformance.md``'s peer notes name each difference):

* index rows a multiple of 64 lanes (``assert swa_page_indices.shape[-1] % 64 == 0`` and the same for
  the extra indices, lines 3393-3400): the Triton kernels mask lanes past the row with
  ``offs < topk``; the TileLang kernel computes ``ni = topk // 32`` blocks and drops the rest;
* an ``attn_sink`` (``assert attn_sink is not None``, line 3390): both kernels take ``None`` (the
  TileLang one substitutes ``-inf``), so the envelopes take calls without one too;
* for TileLang, the head count padded to a multiple of 64 (``hip_attention_needs_head_pad``,
  ``hip_flash_mla.py`` line 191: the kernel "builds only for 64-padded widths"); the Triton kernels
  take the real per-rank head count.

How the peer is loaded without SGLang's server stack: as the ``sglang-triton`` adapter does, the
files are found with ``importlib.util.find_spec`` (``sglang`` is not imported) and executed
(``_source.exec_source``) under private names, with the stand-ins of ``_source.stubs_for(
"sglang-kernels")``: the kernel files import each other by absolute ``sglang.kernels.ops.attention``
names, which resolve to the wheel's own files through stand-in packages (their ``__init__.py`` never
runs), and they read four platform queries, answered as SGLang answers them on a CUDA build
(``is_gfx942_supported``, ``is_gfx95_supported``, ``is_hip``, ``is_fp8_fnuz``: ``False``); nothing
else of SGLang is stubbed. The TileLang file imports ``dsa/tilelang_kernel.py`` (its dtype names,
``_pick_inner_iter`` and its patch of TileLang's ``_legalize_result_idx``), which runs as it is.
"""

from __future__ import annotations

from typing import Any

from pytest_sparse_mla.envelope import Envelope, Widths
from pytest_sparse_mla.implementations import _sglang_kernels
from pytest_sparse_mla.implementations._peer import (
    PeerAdapter,
    PeerCall,
    PeerResult,
    call_peer,
    lse_to_convention,
    source_skip_reason,
)

__all__ = [
    "SglangDsv4TritonImplementation",
    "SglangDsv4TileLangImplementation",
    "TRITON_ENVELOPE",
    "TILELANG_ENVELOPE",
    "load",
]

_ATTENTION = "kernels/ops/attention"
#: The file of each peer (relative to the installed ``sglang`` package) and its entry point.
FILES: dict[str, tuple[str, str]] = {
    "triton": (f"{_ATTENTION}/dsv4/triton_sparse_decode/__init__.py", "triton_fp8_attention_fwd"),
    "tilelang": (f"{_ATTENTION}/dsv4/tilelang_fp8_attention.py", "dpsk_v4_fp8_attention_fwd"),
}

_CALLER = "SGLang's caller (deepseek_v4_backend_hip_radix.py lines 3393-3400)"
_COMMON_NOTES = (
    "DSV4 (584 B footer layout) only: the kernels hard-code 448 NoPE + 64 RoPE dims, 7 UE8M0 scales "
    "per token and the ps*576 + ps*8 page layout",
    "no argument validation (SGLang-internal kernels): shapes, dtypes and lengths are not checked",
    f"index rows a multiple of 64 lanes: {_CALLER} asserts it for indices and extra_indices; the kernels "
    "do not check it (the caller's contract)",
    "attn_sink: the caller asserts it is given (line 3390); the kernels take None, so calls without one are judged too",
    "its own LSE: FlashMLA's (natural log, sink excluded, +inf for a row with no valid lane), [T, 1, H]; "
    "converted to the asked convention",
)

TRITON_ENVELOPE = Envelope(
    formats=("dsv4",),
    topk=Widths(multiple=64),
    extra_topk=Widths(multiple=64),
    extra_cache_formats=("dsv4",),
    topk_length_formats=("dsv4",),
    masked_indices="minus_one",
    index_past_cache="refused",
    notes=_COMMON_NOTES
    + (
        "masks -1 and lanes past topk_length only; another negative index is clamped to token 0 and read "
        "(triton_mla_kernels_decode_fused.py line 441: is_invalid = indices == -1)",
        "SGLang triton_fp8_attention_fwd (dsv4/triton_sparse_decode): any head count (hip_flash_mla.py "
        "_HIP_BACKENDS_ANY_HEAD_COUNT); fused gather + dequantize + attention, fp32 accumulation, split-K "
        "with combine kernels chosen by token count, head count and width; @triton.autotune'd per shape",
        "no bound check of indices: a valid lane past the cache is read from past it",
    ),
)

TILELANG_ENVELOPE = Envelope(
    formats=("dsv4",),
    num_heads=(64, 128),
    topk=Widths(multiple=64),
    extra_topk=Widths(multiple=64),
    extra_cache_formats=("dsv4",),
    topk_length_formats=("dsv4",),
    masked_indices="negative",
    index_past_cache="refused",
    notes=_COMMON_NOTES
    + (
        "SGLang dpsk_v4_fp8_attention_fwd (dsv4/tilelang_fp8_attention.py): head counts padded to a "
        "multiple of 64 by the caller (hip_attention_needs_head_pad, hip_flash_mla.py line 191); 64 and "
        "128 judged (DeepSeek-V4's 128 heads at TP 1 and 2)",
        "TileLang partial kernel over blocks of 32 lanes (block_I=32 on CUDA) + combine kernel; "
        "the cache is re-viewed as uint32 rows of the page stride from storage offset 0 "
        "(_build_fp8_combined_view)",
        "no bound check of indices: a valid lane past the cache is read from past it",
    ),
)


def load(which: str) -> Any:
    """The entry point of ``FILES[which]`` (``"triton"`` or ``"tilelang"``), its file executed with
    the ``"sglang-kernels"`` stand-ins (``_sglang_kernels.load_entry``; module docstring).

    Raises:
        ImportError: sglang (or triton, or tilelang) is not installed, or the file is missing.
        KeyError: another ``which``.
    """
    return _sglang_kernels.load_entry(f"_sparse_mla_peer_sglang_dsv4_{which}", *FILES[which])


#: The TileLang release SGLang 0.5.23 requires (its METADATA: ``Requires-Dist: tilelang==0.1.12``).
TILELANG_PIN = "0.1.12"


#: TileLang releases under which ``dpsk_v4_fp8_partial_kernel`` was measured not to compile for the
#: H200 (sm_90, CUDA 13.0, 2026-12-03): SGLang's pin and the release after it.
TILELANG_NO_SM90_BUILD = ("0.1.12", "0.1.15")


def _tilelang_reason() -> str | None:
    """Why the TileLang DSV4 kernel cannot be judged here: TileLang missing, or a release under which
    the kernel was measured not to compile (:data:`TILELANG_NO_SM90_BUILD`). On the H200 (sm_90,
    CUDA 13.0, torch 2.11) every call fails while TileLang compiles ``dpsk_v4_fp8_partial_kernel``
    (``tvm.error.InternalError``: "two statements with buffer access dependency in the same stage of
    the software pipeline cannot be reordered", ``tilelang_fp8_attention.py`` lines 238 and 580),
    under 0.1.15 and under SGLang's own pin 0.1.12 alike: the kernel's compile, not its numbers.
    SGLang calls it from ``srt/layers/attention/hip_flash_mla.py`` (line 224, the ``"tilelang"``
    backend of ``flash_mla_with_kvcache_entrypoint``), its ROCm path; another TileLang release is
    tried."""
    from importlib import metadata

    try:
        version = metadata.version("tilelang")
    except metadata.PackageNotFoundError:
        return f"needs tilelang ({TILELANG_PIN} is the release sglang 0.5.23 pins; scripts/peers_env.sh)"
    if version in TILELANG_NO_SM90_BUILD:
        return (
            f"tilelang {version} does not compile SGLang's DSV4 TileLang kernel for sm_90 (measured on the H200 under "
            "0.1.12, SGLang's pin, and 0.1.15: InternalError 'two statements with buffer access dependency in the "
            "same stage of the software pipeline cannot be reordered'); SGLang calls it from its ROCm backend"
        )
    return None


class _Dsv4Base(PeerAdapter):
    """The mapping both DSV4 adapters share (module docstring)."""

    compute_mode = "fp8"
    devices: tuple[str, ...] = ("cuda",)
    _which = "triton"

    def skip_reason(self, capability: str, device: str) -> str | None:
        """Why the kernel cannot run here: sglang (or its kernel file) missing, Triton missing, for
        TileLang another release than SGLang's pin (:func:`_tilelang_reason`), not CUDA, or executing
        the file fails."""
        if capability == "sparse_mla_forward" and self._which == "tilelang":
            reason = _tilelang_reason()
            if reason is not None:
                return f"{self.name} adapter: {reason}"
        return source_skip_reason(
            self.name, capability, device, missing=_sglang_kernels.missing(FILES[self._which][0]), devices=self.devices,
            load=lambda: load(self._which),
        )  # fmt: skip

    def forward(self, call: PeerCall, return_fp32: bool) -> PeerResult:
        """Run the kernel with the caller's keyword arguments (module docstring).

        Returns:
            :class:`PeerResult`: the BF16 output ``[T, H, 512]`` (``[:, 0]`` of the kernel's
            ``[T, 1, H, 512]``), its LSE converted to ``lse_convention``, ``route=None``.

        Raises:
            ImportError: the file is not found.
            Whatever the kernel raises.
        """
        c = call.call
        extra = c.extra
        kwargs = {
            "q": c.q.unsqueeze(1),
            "k_cache": call.kv4,
            "head_dim_v": 512,
            "block_table": None,
            "cache_seqlens": None,
            "tile_scheduler_metadata": None,
            "softmax_scale": float(c.sm_scale),
            "is_fp8_kvcache": True,
            "indices": c.main.indices.unsqueeze(1),
            "topk_length": c.main.topk_length,
            "attn_sink": c.attn_sink,
            "extra_k_cache": call.extra4,
            "extra_indices_in_kvcache": extra.indices.unsqueeze(1) if extra is not None else None,
            "extra_topk_length": c.extra_topk_length,
        }
        function = FILES[self._which][1]
        out, lse = call_peer(_sglang_kernels.source_of(FILES[self._which][0]), function, load(self._which), (), kwargs)
        lse = lse_to_convention(
            lse[:, 0],
            sink_included=False,
            attn_sink=c.attn_sink,
            lse_convention=c.lse_convention,
            lse_scale=c.lse_scale,
        )
        return PeerResult(out[:, 0], lse, None, f"sglang {function}")


class SglangDsv4TritonImplementation(_Dsv4Base):
    """Built-in ``sglang-dsv4-triton``: SGLang's Triton DSV4 FP8 sparse decode."""

    name = "sglang-dsv4-triton"
    peer = "SGLang triton_fp8_attention_fwd (dsv4/triton_sparse_decode)"
    envelope = TRITON_ENVELOPE
    _which = "triton"


class SglangDsv4TileLangImplementation(_Dsv4Base):
    """Built-in ``sglang-dsv4-tilelang``: SGLang's TileLang DSV4 FP8 sparse decode."""

    name = "sglang-dsv4-tilelang"
    peer = "SGLang dpsk_v4_fp8_attention_fwd (dsv4/tilelang_fp8_attention.py)"
    envelope = TILELANG_ENVELOPE
    _which = "tilelang"
