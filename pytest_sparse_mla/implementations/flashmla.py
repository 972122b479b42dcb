"""Built-in ``flashmla``: adapter over DeepSeek's FlashMLA sparse kernels (deepseek-ai/FlashMLA),
imported from the built package (``import flash_mla``, its ``flash_mla.cuda`` extension).

FlashMLA is not on a package index: build it from its source with CUTLASS at the commit it pins,
e.g. for an H100/H200 ``FLASH_MLA_DISABLE_SM100=1 python setup.py build_ext --inplace`` (CUDA 13
also needs ``$CUDA_HOME/include/cccl`` on ``CPLUS_INCLUDE_PATH``), then put the source directory on
``PYTHONPATH`` (README, "Run the suites against a peer"; ``scripts/device_conformance.sh``).

Routes (``route`` of the result), split at FlashInfer's decode cutoff like the bundled reference:

* ``T <= 64``: **sparse decode**, ``flash_mla.flash_mla_with_kvcache(q [T, 1, H, d_qk], k_cache
  [P, ps, 1, B], None, None, 512, get_mla_metadata()[0], None, softmax_scale, False,
  is_fp8_kvcache=True, indices [T, 1, topk], attn_sink, extra_k_cache, extra_indices_in_kvcache,
  topk_length, extra_topk_length)``: one "batch" per query token with ``s_q = 1``, so every token
  has its own index row and ``topk_length``. The model type follows ``d_qk``: 512 = ``MODEL1`` (the
  DSV4 584 B footer cache), 576 = ``V32`` (the DSV3.2 656 B inline cache). SM90 kernel
  ``csrc/sm90/decode/sparse_fp8``: dequantizes to BF16, BF16 matrix products, fp32 split-K
  partials combined by ``csrc/smxx/decode/combine``.
* ``T > 64``: **sparse prefill**, ``flash_mla.flash_mla_sparse_fwd(q [T, H, d_qk], kv [N, 1, d_qk]
  BF16, indices [T, 1, topk'], sm_scale, 512, attn_sink, topk_length)``. It reads a BF16 latent
  table, not a packed cache, so the adapter dequantizes the packed caches with
  ``formats.unpack_dequantize`` (exact: an E4M3 code times a power of two is a BF16 number) and,
  with an extra cache, appends the extra table after the main one and shifts valid extra indices
  by the main token count (FlashMLA's prefill has no extra cache; this is the "virtual table" of
  FlashInfer's test reference). Index rows are padded with ``-1`` to a multiple of 128 (the kernel
  asserts ``topk % (2*B_TOPK) == 0``); with an extra cache the two rows are joined and lanes past
  ``topk_length`` / ``extra_topk_length`` become ``-1`` (one row has one prefix length), else
  ``topk_length`` goes to the kernel.

LSE: FlashMLA returns natural log without the sink, ``+inf`` for a row with no valid candidate
(``(batch, heads, s_q)`` from decode, ``[s_q, heads]`` from prefill); :func:`_peer.lse_to_convention`
converts it to the requested convention.

What the adapter declares (``ENVELOPE``, the calls both routes take; source files above and
``csrc/api/sparse_decode.h``, ``csrc/api/sparse_fwd.h``, ``flash_mla/flash_mla_interface.py``):
``num_heads`` 64 or 128; ``topk`` and ``extra_topk`` multiples of 64; ``num_tokens >= 1``; the decode
of DSV3.2 (V32) takes neither an extra cache nor ``topk_length`` (so neither route is asked for
them); ``topk_length`` within ``[0, topk]``; only ``-1`` masks a lane; the token stride must be
exactly the format's bytes; CUDA on SM90 (this build) or SM100. It refuses with :class:`UnsafeForPeer` what
the kernels would turn into out-of-bounds accesses instead of masking: a negative index other than
``-1`` inside the valid prefix of a decode row (the decode kernel masks only ``-1``; README "Set
invalid indices to -1"), a ``topk_length`` outside ``[0, topk]`` (FlashMLA does not clamp it: it
sizes the work from the raw value), and decode index rows that do not start on an 8-byte boundary
(the kernel reads index pairs as ``int2``). A valid lane past the cache reaches the kernels (FlashMLA
does not bound-check indices; on the H200 the decode returns a wrong row for it, where the contract
says ``ValueError``: an xfail entry, ``past-cache``).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from pytest_sparse_mla import capabilities
from pytest_sparse_mla.envelope import Envelope, Widths
from pytest_sparse_mla.implementations import _peer
from pytest_sparse_mla.recording import METADATA

if TYPE_CHECKING:
    from pytest_sparse_mla.attention.call import Candidates

__all__ = [
    "FlashMlaImplementation",
    "ENVELOPE",
    "flash_mla_module",
]

#: FlashMLA's top-k tile (``TOPK_BLOCK_SIZE`` of the decode, ``B_TOPK`` of the prefill).
TOPK_TILE = 64
#: The prefill kernel's index-row multiple (``topk % (2*B_TOPK) == 0``).
PREFILL_ROW_MULTIPLE = 128
_HINT = "build deepseek-ai/FlashMLA and put it on PYTHONPATH (README, 'Run the suites against a peer')"

#: The peer's entry points, in words (prefix of refusals).
PEER = "FlashMLA flash_mla_with_kvcache (sparse FP8 decode, T <= 64) / flash_mla_sparse_fwd (sparse BF16 prefill)"
#: Where FlashMLA's sparse kernels run.
DEVICES = ("cuda",)

#: What both routes take (the decode route is the narrower one: DSV3.2 decode has no extra cache
#: and no ``topk_length``; it masks only ``-1``).
ENVELOPE = Envelope(
    formats=("dsv4", "dsv3_2"),
    num_heads=(64, 128),
    topk=Widths(multiple=TOPK_TILE),
    extra_topk=Widths(multiple=TOPK_TILE),
    extra_cache_formats=("dsv4",),
    topk_length_formats=("dsv4",),
    topk_length_range="row",
    min_tokens=1,
    masked_indices="minus_one",
    notes=(
        "num_tokens <= 64: flash_mla_with_kvcache, one batch entry per token (s_q = 1); MODEL1 (d_qk 512) = "
        "DSV4 584 B cache, V32 (d_qk 576) = DSV3.2 656 B cache with no extra cache and no topk_length "
        "(KU_ASSERT in csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh)",
        "num_tokens > 64: flash_mla_sparse_fwd over a BF16 table the adapter dequantizes (exact); an extra "
        "cache is appended to the table, index rows padded with -1 to a multiple of 128",
        "only -1 masks a decode lane (README 'Set invalid indices to -1'); other negatives are refused as "
        "unsafe; topk_length must lie in [0, topk]; decode index rows must start on 8-byte boundaries",
        "no bound check of indices: a valid lane past the cache is read from past it (a wrong row on the "
        "H200, no error; the suites' past-cache test is an xfail entry)",
        "its own LSE: natural log, sink excluded, empty row +inf; converted to the asked convention",
        "BF16 dequantization and matrix products, fp32 split-K partials",
    ),
)


def flash_mla_module() -> Any:
    """``import flash_mla`` (the built package with its ``flash_mla.cuda`` extension).

    Raises:
        ImportError: FlashMLA is not on the path, or its extension does not load (e.g. built for
            another torch).
    """
    return importlib.import_module("flash_mla")


def _find_flash_mla() -> bool:
    try:
        return importlib.util.find_spec("flash_mla") is not None
    except (ImportError, ValueError):
        return False


class FlashMlaImplementation(_peer.PeerAdapter):
    """Built-in ``flashmla`` (see the module docstring for the routes, mapping and refusals).

    The adapter is written against FlashMLA's Python interface, so another implementation of that
    interface (``implementations.flaggems``) subclasses it and changes only the class attributes
    below and :meth:`module`.
    """

    name = "flashmla"
    compute_mode = "bf16"
    envelope = ENVELOPE
    #: The peer's entry points, in words (prefix of refusals); the devices it runs on.
    peer = PEER
    devices = DEVICES
    #: ``PeerResult.entry`` of each route.
    decode_entry = "flash_mla.flash_mla_with_kvcache"
    prefill_entry = "flash_mla.flash_mla_sparse_fwd"
    #: Where a standalone reproducer finds each route's function (``_peer.call_peer``).
    decode_source: dict[str, Any] = {"kind": "import", "module": "flash_mla"}
    prefill_source: dict[str, Any] = {"kind": "import", "module": "flash_mla"}
    #: The decode masks only ``-1`` and reads index pairs as ``int2`` (refused otherwise).
    decode_masks_only_minus_one = True
    exact_token_stride = True

    def module(self) -> Any:
        """The object holding ``get_mla_metadata``, ``flash_mla_with_kvcache`` and ``flash_mla_sparse_fwd``.

        Raises:
            ImportError: as :func:`flash_mla_module`.
        """
        return flash_mla_module()

    # ---- capability checks

    def skip_reason(self, capability: str, device: str) -> str | None:
        """Why FlashMLA cannot run here: not built/importable, not CUDA, or a GPU it has no kernels for."""
        if capability != "sparse_mla_forward":
            return None
        if not _find_flash_mla():
            return f"flashmla adapter: flash_mla is not importable ({_HINT})"
        if device != "cuda":
            return f"flashmla adapter: FlashMLA's kernels need CUDA tensors; the suites run on {device}"
        caps = capabilities.probe()
        if caps.compute_capability is None or caps.compute_capability[0] not in (9, 10):
            return f"flashmla adapter: the sparse kernels need SM90a or SM100f; found {caps.sm} ({caps.device_name})"
        try:
            flash_mla_module()
        except ImportError as exc:
            return f"flashmla adapter: import flash_mla failed ({exc})"
        return None

    @staticmethod
    def route(num_tokens: int) -> str:
        """``"decode"`` (``flash_mla_with_kvcache``) iff ``num_tokens <= 64``, else ``"prefill"``."""
        from pytest_sparse_mla.attention.conventions import route_for

        return route_for(num_tokens)

    # ---- the forward

    def refuse_lanes(self, source: Candidates) -> None:
        """FlashMLA does not clamp ``topk_length`` (:meth:`_check_lengths`)."""
        self._check_lengths(source)

    def forward(self, call: _peer.PeerCall, return_fp32: bool) -> _peer.PeerResult:
        """Run FlashMLA's route for the call (routes in the module docstring).

        Returns:
            :class:`PeerResult` with FlashMLA's BF16 output ``[T, H, 512]``, its LSE converted to
            ``lse_convention``, ``route`` ``"decode"`` or ``"prefill"``.

        Raises:
            _peer.UnsafeForPeer: the inputs the module docstring lists.
            ImportError: flash_mla does not import.
            Whatever FlashMLA raises (``RuntimeError`` from its ``TORCH_CHECK`` / ``KU_ASSERT``).
        """
        route = self.route(call.call.num_tokens)
        out, lse, entry = self._decode(call) if route == "decode" else self._prefill(call)
        c = call.call
        lse = _peer.lse_to_convention(
            lse, sink_included=False, attn_sink=c.attn_sink, lse_convention=c.lse_convention, lse_scale=c.lse_scale
        )
        return _peer.PeerResult(out, lse, route, entry)

    def _check_lengths(self, source: Candidates) -> None:
        """Refuse a ``topk_length`` of ``source`` outside ``[0, topk]`` (:class:`_peer.UnsafeForPeer`)."""
        length, topk = source.topk_length, source.topk
        if length is None:
            return
        bad = (length < 0) | (length > topk)
        if bool(bad.any()):
            t = int(bad.nonzero()[0, 0])
            raise _peer.UnsafeForPeer(
                f"{self.name}: {source.names[2]}[{t}]={int(length[t])} outside [0, {topk}]; the kernels do not clamp "
                "it (FlashMLA's flash_mla_interface.py: 'only the leftmost topk_length indices will be "
                "processed'), they size the work and read index lanes from the raw value"
            )

    def _check_decode_rows(self, source: Candidates) -> None:
        """Refuse decode index rows of ``source`` FlashMLA's decode would read out of bounds."""
        if not self.decode_masks_only_minus_one:
            return
        idx, name = source.indices, source.names[1]
        if idx.stride(0) % 2 or idx.data_ptr() % 8:
            raise _peer.UnsafeForPeer(
                f"flashmla: {name} rows start at {idx.data_ptr()} with row stride {idx.stride(0)}; "
                "FlashMLA's decode reads index pairs as int2, so every row must start on an 8-byte boundary"
            )
        from pytest_sparse_mla.attention.call import valid_lanes

        prefix = valid_lanes(idx.clamp(min=0), source.topk_length)  # lanes inside the valid prefix
        bad = prefix & (idx < -1)
        if bool(bad.any()):
            t, j = (int(v) for v in bad.nonzero()[0])
            raise _peer.UnsafeForPeer(
                f"flashmla: {name}[{t}, {j}]={int(idx[t, j])}; FlashMLA's sparse decode masks only -1 "
                "(README: 'Set invalid indices to -1'; csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh "
                "token_index == -1) and reads any other negative value as page (uint32)index/page_size, "
                "out of bounds (the project masks every negative index)"
            )

    def _decode(self, call: _peer.PeerCall) -> tuple[Any, Any, str]:
        """``flash_mla_with_kvcache`` on the packed caches, one batch entry per token."""
        c = call.call
        flash_mla = self.module()
        for source in c.sources:
            self._check_decode_rows(source)
        sched, _ = flash_mla.get_mla_metadata()
        args = (c.q.unsqueeze(1), call.kv4, None, None, 512, sched, None)
        kwargs = {
            "softmax_scale": c.sm_scale,
            "causal": False,
            "is_fp8_kvcache": True,
            "indices": c.main.indices.unsqueeze(1),
            "attn_sink": c.attn_sink,
            "extra_k_cache": call.extra4,
            "extra_indices_in_kvcache": c.extra.indices.unsqueeze(1) if c.extra is not None else None,
            "topk_length": None if c.main.topk_length is None else c.main.topk_length.contiguous(),
            "extra_topk_length": None if c.extra_topk_length is None else c.extra_topk_length.contiguous(),
        }
        out, lse = _peer.call_peer(
            self.decode_source, "flash_mla_with_kvcache", flash_mla.flash_mla_with_kvcache, args, kwargs,
            script_args=(*args[:5], METADATA, None),
        )  # fmt: skip
        return out[:, 0], lse[:, :, 0], self.decode_entry

    def _prefill(self, call: _peer.PeerCall) -> tuple[Any, Any, str]:
        """``flash_mla_sparse_fwd`` on the dequantized virtual table (:func:`_peer.virtual_table`)."""
        c = call.call
        flash_mla = self.module()
        kv, rows, length = _peer.virtual_table(c, row_multiple=PREFILL_ROW_MULTIPLE)
        length = None if length is None else length.contiguous()
        args = (c.q, kv, rows.unsqueeze(1), c.sm_scale, 512, c.attn_sink, length)
        out, _max_logits, lse = _peer.call_peer(
            self.prefill_source, "flash_mla_sparse_fwd", flash_mla.flash_mla_sparse_fwd, args, {}
        )
        return out, lse, self.prefill_entry
