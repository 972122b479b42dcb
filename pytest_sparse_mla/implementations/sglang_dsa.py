"""Built-ins ``sglang-dsa-triton`` and ``sglang-dsa-tilelang``: adapters over the sparse-MLA kernels
SGLang 0.5.23 serves DeepSeek-V3.2 (DSA) with through its ``triton`` and ``tilelang`` DSA
implementations, executed from the installed ``sglang`` wheel (``pip install --no-deps
sglang==0.5.23``).

What runs (sgl-project/sglang, files of the installed package,
``sglang/kernels/ops/attention/dsa/``):

* ``sglang-dsa-triton``: for a decode call (``num_tokens <= 64``)
``triton_sparse_mla_decode_splitk``
  of ``triton_sparse_mla_decode.py``, as ``DSABackend._forward_triton_decode`` calls it
  (``sglang/srt/layers/attention/dsa_backend.py`` lines 3474-3496, from ``forward_decode`` line
2689);
  for a prefill call ``triton_sparse_mla_fwd`` of ``triton_sparse_mla.py``, as ``forward_extend``
  calls it for ``dsa_impl == "triton"`` (lines 2361-2379). Both are Triton kernels (a fused
  single-pass kernel, or split-K partials + a reduce kernel) over BF16 (or FP8 per-tensor) latents.
* ``sglang-dsa-tilelang``: ``tilelang_sparse_fwd`` of ``tilelang_kernel.py``, as
  ``DSABackend._forward_tilelang`` calls it (lines 3440-3471, from ``forward_decode`` line 2682 and
  ``forward_extend`` line 2354); with a BF16 cache on CUDA it runs
  ``sparse_attention_fwd_kernel_v2`` (a TileLang kernel over blocks of 64 lanes; needs ``tilelang``:
  SGLang 0.5.23 pins 0.1.12; judged on the H200 with 0.1.15 and with 0.1.12).

What the caller passes, and how the adapters copy it. SGLang's DSA backend runs these kernels over
the token pool's key buffer ``kv_cache`` ``[N, 1, 576]`` (``get_key_buffer``: one latent per token
slot, BF16 for a BF16 KV cache) and index rows ``page_table_1`` ``[T, topk]`` int32 of token slots
(``transform_index_page_table_decode`` / ``_prefill`` with ``page_size=1``; ``-1`` pads a row), no
``topk_length`` (``topk_length=None``), no sink, no extra cache. The project's calls hold packed
DSV3.2 caches (656 B/token): the adapters hand the kernels the BF16 table a BF16 KV cache would
hold,
``_peer.virtual_table`` (the packed cache dequantized, exact: an E4M3 code times a power of two is a
BF16 number), with lanes past ``topk_length`` turned into ``-1`` (the caller's rows carry their
length that way) and rows padded with ``-1`` to a multiple of 64 (``_forward_tilelang``'s padding,
line 3450; the Triton kernels take any width). The queries are passed as the caller passes them:
``q_nope = q[..., :512]`` and ``q_rope = q[..., 512:]``, two strided views of one ``[T, H, 576]``
tensor (lines 2601-2618: ``q_all = q.contiguous().view(...)``; the kernels read row strides,
``_row_strides``), or the whole contiguous ``q`` for TileLang (``concat_mla_absorb_q_general``'s
output); ``indices`` is ``rows.unsqueeze(1)`` ``[T, 1, topk]``; ``sm_scale``; ``d_v=512``; the
decode kernel gets the backend's grow-only split-K
``workspace`` (a list the adapter keeps per instance, as the backend keeps one per stream), the
prefill kernel ``topk_length=None`` and ``max_topk_length=min(max_seq_len_k, topk)`` (the table's
token count for ``max_seq_len_k``; it is read only on AMD gfx950). Each kernel returns
``[1, T, H, 512]`` BF16, ``.squeeze(0)`` as the caller does; none returns an LSE
(``lse_conventions=()``).

What the caller guarantees and the kernels do not check (the envelopes hold the caller's contract;
``docs/conformance.md``'s peer notes name each difference): DeepSeek-V3.2's per-rank head counts
(128 heads over tensor-parallel ranks: 128, 64, 32, 16). The Triton prefill kernel asserts a
power-of-two head count above 16 (``triton_sparse_mla.py`` line 480); TileLang's kernel asserts a
multiple of 64 above 64 heads and pads smaller counts to a power of two (``tilelang_kernel.py``
lines 305-316). TileLang's kernel also asserts that the row holds an even number of 64-lane blocks
(``assert NI % 2 == 0``, line 311: a multiple of 128 lanes) while the caller pads rows to a
multiple of 64 only: a row of 64 * odd lanes from the caller fails that assert (the DSA top-k of
2048 never does). The TileLang envelope takes widths that are multiples of 128 (the kernel's limit).

Loading: as ``sglang_dsv4`` (``_source.stubs_for("sglang-kernels")``):
``triton_sparse_mla_decode.py``
imports ``triton_sparse_mla.py``, which imports ``kernels/ops/attention/metadata.py`` (both run from
the wheel) and reads ``is_fp8_fnuz``, ``is_gfx95_supported`` and ``get_device_core_count``
(answered as on a CUDA build).
"""

from __future__ import annotations

import functools
from typing import Any

from pytest_sparse_mla.envelope import Envelope, Unsupported, Widths, route_of
from pytest_sparse_mla.implementations import _sglang_kernels
from pytest_sparse_mla.implementations._peer import (
    PeerAdapter,
    PeerCall,
    PeerResult,
    call_peer,
    check_folded_lengths,
    source_skip_reason,
    virtual_table,
)

__all__ = [
    "SglangDsaTritonImplementation",
    "SglangDsaTileLangImplementation",
    "TRITON_ENVELOPE",
    "TILELANG_ENVELOPE",
    "load",
]

_DSA = "kernels/ops/attention/dsa"
#: ``(file, entry point)`` of each kernel the adapters call (relative to the installed ``sglang``).
FILES: dict[str, tuple[str, str]] = {
    "triton-decode": (f"{_DSA}/triton_sparse_mla_decode.py", "triton_sparse_mla_decode_splitk"),
    "triton-prefill": (f"{_DSA}/triton_sparse_mla.py", "triton_sparse_mla_fwd"),
    "tilelang": (f"{_DSA}/tilelang_kernel.py", "tilelang_sparse_fwd"),
}
#: ``_forward_tilelang`` pads index rows with -1 to a multiple of 64 (dsa_backend.py line 3450).
ROW_MULTIPLE = 64
#: DeepSeek-V3.2's 128 query heads over 1, 2, 4 and 8 tensor-parallel ranks.
V32_HEADS = (16, 32, 64, 128)

_COMMON_NOTES = (
    "DSV3.2 (656 B inline layout) only: the caller is SGLang's DSA backend, whose kernels read the BF16 "
    "latent table [N, 1, 576] of a BF16 KV cache; the adapter dequantizes the packed cache to it (exact)",
    "no topk_length argument (the caller passes None): lanes past topk_length become -1 in the rows; rows "
    "padded with -1 to a multiple of 64 (dsa_backend.py _forward_tilelang)",
    "no attn_sink, no extra cache, no LSE (output only)",
    "head counts: DeepSeek-V3.2's per-rank counts 128/TP (16, 32, 64, 128), the caller's contract",
    "every negative index masks its lane; no bound check of indices (a lane past the table reads past it)",
)

TRITON_ENVELOPE = Envelope(
    formats=("dsv3_2",),
    num_heads=V32_HEADS,
    topk=Widths(),
    extra_cache_formats=(),
    topk_length_formats=("dsv3_2",),
    attn_sink=False,
    masked_indices="negative",
    index_past_cache="refused",
    lse_conventions=(),
    notes=_COMMON_NOTES
    + (
        "decode (num_tokens <= 64): triton_sparse_mla_decode_splitk (dsa_backend.py _forward_triton_decode); "
        "prefill: triton_sparse_mla_fwd (forward_extend, dsa_impl 'triton'), whose single-pass kernel asserts "
        "a power-of-two head count above 16 (triton_sparse_mla.py line 480)",
        "BF16 dot products, fp32 online softmax in base 2; split-K partials rounded to BF16 before the reduce",
    ),
)

TILELANG_ENVELOPE = Envelope(
    formats=("dsv3_2",),
    num_heads=V32_HEADS,
    topk=Widths(multiple=128),
    extra_cache_formats=(),
    topk_length_formats=("dsv3_2",),
    attn_sink=False,
    masked_indices="negative",
    index_past_cache="refused",
    lse_conventions=(),
    notes=_COMMON_NOTES
    + (
        "tilelang_sparse_fwd -> sparse_attention_fwd_kernel_v2 on a BF16 table (tilelang_kernel.py)",
        "index rows a multiple of 128 lanes: the kernel asserts NI % 2 == 0 over 64-lane blocks "
        "(tilelang_kernel.py line 311); the caller pads to a multiple of 64 only (dsa_backend.py line 3450)",
    ),
)


def load(which: str) -> Any:
    """The entry point of ``FILES[which]``, its file executed with the ``"sglang-kernels"``
    stand-ins (``_sglang_kernels.load_entry``; module docstring).

    Raises:
        ImportError: sglang (or triton, or tilelang) is not installed, or the file is missing.
        KeyError: another ``which``.
    """
    return _sglang_kernels.load_entry(f"_sparse_mla_peer_sglang_dsa_{which.replace('-', '_')}", *FILES[which])


class _DsaBase(PeerAdapter):
    """The mapping both DSA adapters share (module docstring)."""

    compute_mode = "bf16"
    devices: tuple[str, ...] = ("cuda",)
    _files: tuple[str, ...] = ("triton-decode", "triton-prefill")

    def skip_reason(self, capability: str, device: str) -> str | None:
        """Why the kernels cannot run here: sglang (or a kernel file) missing, Triton or TileLang
        missing, not CUDA, or executing a file fails."""
        import importlib.util

        if (
            capability == "sparse_mla_forward"
            and "tilelang" in self._files
            and importlib.util.find_spec("tilelang") is None
        ):
            return (
                f"{self.name} adapter: needs tilelang (sglang 0.5.23 pins 0.1.12, judged with it; "
                "scripts/peers_env.sh)"
            )
        for which in self._files:
            reason = source_skip_reason(
                self.name, capability, device, missing=_sglang_kernels.missing(FILES[which][0]), devices=self.devices,
                load=functools.partial(load, which),
            )  # fmt: skip
            if reason is not None:
                return reason
        return None

    def _table(self, call: PeerCall) -> tuple[Any, Any, Any, Any]:
        """``(q, kv, indices)`` as the caller passes them, plus the table's token count.

        Raises:
            pytest_sparse_mla.Unsupported: index rows that are not int32 (the adapter rebuilds the rows
                as int32 and does not convert another dtype: the kernel's own handling of them is not
                measured), or lengths the adapter cannot fold (``_peer.check_folded_lengths``).
        """
        import torch

        c = call.call
        check_folded_lengths(c)
        for source in c.sources:  # the rows are rebuilt as int32 (virtual_table): another dtype is not mapped
            if source.indices.dtype != torch.int32:
                _, name, _ = source.names
                raise Unsupported(
                    f"{self.name}: {name}.dtype={source.indices.dtype}: SGLang's DSA backend passes int32 "
                    "page_table_1 rows; the adapter rebuilds the rows and does not convert another dtype, so "
                    "the kernel's own handling of it is not measured"
                )
        kv, rows, _ = virtual_table(c, row_multiple=ROW_MULTIPLE, fold_lengths=True)
        # the caller's q_all is contiguous (q.contiguous().view(...), or concat_mla_absorb_q_general's output)
        return c.q.contiguous(), kv, rows.unsqueeze(1), int(kv.shape[0])


class SglangDsaTritonImplementation(_DsaBase):
    """Built-in ``sglang-dsa-triton``: SGLang's Triton DSA sparse MLA (decode and prefill)."""

    name = "sglang-dsa-triton"
    peer = "SGLang triton_sparse_mla_decode_splitk / triton_sparse_mla_fwd (dsa/)"
    envelope = TRITON_ENVELOPE

    def __init__(self) -> None:
        #: the decode kernel's grow-only split-K buffers (``DSABackend._triton_sparse_mla_workspaces``).
        self._workspace: list[Any] = []

    def forward(self, call: PeerCall, return_fp32: bool) -> PeerResult:
        """Run the decode or the prefill kernel, picked by ``num_tokens`` (module docstring).

        Returns:
            :class:`PeerResult`: the BF16 output ``[T, H, 512]``, ``lse=None``, the route.

        Raises:
            pytest_sparse_mla.Unsupported: lengths the adapter cannot fold (``_peer.check_folded_lengths``).
            Whatever the kernel raises (``ValueError`` for dtypes, ``AssertionError`` for shapes).
        """
        q, kv, indices, num_slots = self._table(call)
        sm_scale = float(call.call.sm_scale)
        route = route_of(call.call.num_tokens)
        kwargs: dict[str, Any] = {
            "q_nope": q[..., :512], "q_rope": q[..., 512:], "kv": kv, "indices": indices,
            "sm_scale": sm_scale, "d_v": 512,
        }  # fmt: skip
        if route == "decode":
            which = "triton-decode"
            kwargs["workspace"] = self._workspace
        else:
            which = "triton-prefill"
            kwargs |= {"topk_length": None, "max_topk_length": min(num_slots, int(indices.shape[-1]))}
        out = call_peer(_sglang_kernels.source_of(FILES[which][0]), FILES[which][1], load(which), (), kwargs)
        return PeerResult(out.squeeze(0), None, route, f"sglang {FILES[which][1]}")


class SglangDsaTileLangImplementation(_DsaBase):
    """Built-in ``sglang-dsa-tilelang``: SGLang's TileLang DSA sparse MLA."""

    name = "sglang-dsa-tilelang"
    peer = "SGLang tilelang_sparse_fwd (dsa/tilelang_kernel.py)"
    envelope = TILELANG_ENVELOPE
    _files = ("tilelang",)

    def forward(self, call: PeerCall, return_fp32: bool) -> PeerResult:
        """Run ``tilelang_sparse_fwd`` as ``_forward_tilelang`` does (module docstring).

        Returns:
            :class:`PeerResult`: the BF16 output ``[T, H, 512]``, ``lse=None``, ``route=None``.

        Raises:
            pytest_sparse_mla.Unsupported: lengths the adapter cannot fold (``_peer.check_folded_lengths``).
            Whatever the kernel raises (``AssertionError`` for shapes).
        """
        q, kv, indices, _ = self._table(call)
        kwargs = {"q": q, "kv": kv, "indices": indices, "sm_scale": float(call.call.sm_scale), "d_v": 512}
        path, function = FILES["tilelang"]
        out = call_peer(_sglang_kernels.source_of(path), function, load("tilelang"), (), kwargs)
        return PeerResult(out.squeeze(0), None, None, f"sglang {function}")
