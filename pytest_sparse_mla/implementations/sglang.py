"""Built-ins ``sglang-triton`` and ``sglang-torch``: adapters over SGLang's DeepSeek-V4 sparse-MLA
fallbacks, loaded from the installed ``sglang`` wheel (``pip install --no-deps sglang==0.5.23``).

What runs (sgl-project/sglang, files of the installed package):

* ``sglang-triton``: ``flash_mla_sparse_decode_triton`` of
  ``sglang/kernels/ops/attention/flash_mla_sm120_triton.py``: a tiled Triton decode kernel, grid
  ``(T, H)``, fp32 math on the 584 B footer cache; the main and the extra cache run as two launches
  whose BF16 outputs are merged by LSE, then the sink scales the merged output (its LSE: natural
  log, sink *included*, ``[T, H, 1]``).
* ``sglang-torch``: ``_sm120_sparse_decode_fwd`` of ``sglang/kernels/ops/attention/flash_mla_sm120.py``:
  gather + dequantize (NoPE to BF16) + fp32 einsum over main and extra candidates in one softmax
  (its LSE: natural log, sink *excluded*, ``-inf`` for an empty row, ``[T, H, 1]``).
* ``page_split`` (both adapters): ``_split_kv_pages_to_64`` of ``flash_mla_sm120.py`` with its
  ``_page_mark_kernel`` (touched pages) and ``_page_split_kernel`` (8-byte lanes), the split SGLang
  runs before FlashInfer's SM120 kernels (PR #27455, #32320), byte for byte as installed.

Both paths are the bodies ``flash_mla_with_kvcache_sm120`` dispatches to
(``SGLANG_SM120_FLASHMLA_BACKEND=triton|torch``); the adapters call them with the arguments that
dispatcher passes: ``q [T, 1, H, 512]``, ``k_cache [P, ps, 1, 584]`` (page size ``shape[1]``, page
stride ``stride(0)``), ``indices [T, 1, topk]``, ``topk_length [T]``, ``attn_sink [H]``,
``head_dim_v=512``, ``softmax_scale``, then the extra cache, indices and length.

How the peer is loaded without SGLang's server stack. ``import sglang`` runs its ``__init__``, which
pulls the whole serving runtime (transformers patches, msgspec, the language frontend, ...). The
adapters never import ``sglang``: :func:`sglang_root` finds the installed package directory with
``importlib.util.find_spec("sglang")`` (which does not execute it), and :func:`load_module` executes
the two files with ``importlib.util.spec_from_file_location`` under private names
(``_sparse_mla_peer_sglang.<file>``). ``flash_mla_sm120_triton.py`` imports only torch and triton.
``flash_mla_sm120.py`` also imports ``sglang.srt.environ.envs``, ``sglang.srt.utils.is_hip`` at
import time and ``sglang.srt.runtime_context.get_resources`` inside the split; while it is executed
and while the split runs, :func:`_sglang_stubs` puts small stand-ins for exactly those three modules
(and empty parent packages) into ``sys.modules``, only under names not already imported, and removes
them afterwards: ``envs.SGLANG_SM120_FLASHMLA_BACKEND.get()`` returns ``"torch"`` (the dispatcher is
not used), ``is_hip()`` is ``False`` and ``get_resources().buffers`` is a dict view of the caller's
``page_split.BufferRegistry`` (SGLang's keys ``flash_mla_sm120_split:{dev}`` and
``flash_mla_sm120_mask:{dev}`` are the project's keys for ``key_suffix=""``). This is the way
SGLang's own CPU unit test of the split scratch loads the module (sgl-project/sglang PR #39288,
``test_sm120_split_scratch.py``: module loaded by path with stubbed ``sglang`` packages).

Triton decides at decoration time whether kernels are compiled or interpreted; like
``capabilities.load_triton_kernels``, the loader sets ``TRITON_INTERPRET=1`` before executing the
files when it is unset and torch sees no CUDA device, so both adapters also run on a CPU.

Mapping and refusals (each adapter's ``envelope`` and ``unsupported_reason``): DSV4 only (the
kernels hard-code 448 + 64 dims and the footer layout); any head count, top-k width and page size.
The adapter reads the cache geometry through ``formats.parse_cache`` (the project's 2-D, 3-D and HND
forms become the NHD view SGLang reads, same bytes, storage offset and page stride). A valid lane
past the cache reaches SGLang (no bound check: the Triton path reads a wrong row) except on the torch
path on CUDA, where it, and a lane *past* ``topk_length`` holding an out-of-range index, are refused
(:class:`UnsafeForPeer`: the torch path gathers every lane with torch indexing, a device-side assert
that ends the test session; measured on the H200). The split refuses ``key_suffix`` on pools it
would split (SGLang has one scratch per device), another ``dst_page_stride`` than 37,440, and touched
indices past the pool (SGLang's mark kernel stores ``mask[t // ps]`` without a bound; the check is
one host sync, left out under CUDA-graph capture and under torch's sync debug mode). Everything else
is SGLang's own behaviour, judged by the suites.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
import sys
import types
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_sparse_mla import capabilities
from pytest_sparse_mla.envelope import Envelope, Unsupported
from pytest_sparse_mla.implementations import _peer

if TYPE_CHECKING:
    from pytest_sparse_mla.attention.call import Candidates

__all__ = [
    "SGLANG_FILES",
    "SglangTritonImplementation",
    "SglangTorchImplementation",
    "sglang_root",
    "sglang_version",
    "load_module",
    "TRITON_ENVELOPE",
    "TORCH_ENVELOPE",
    "SPLIT_DECLARATION",
]

#: Files of the installed ``sglang`` package the adapters execute (relative to its directory).
SGLANG_FILES: dict[str, str] = {
    "flash_mla_sm120_triton": "kernels/ops/attention/flash_mla_sm120_triton.py",
    "flash_mla_sm120": "kernels/ops/attention/flash_mla_sm120.py",
}
_PRIVATE_PREFIX = "_sparse_mla_peer_sglang."
#: SGLang's split destination page stride (``_BYTES_PER_DST_PAGE_PADDED``), fixed.
_SGLANG_DST_PAGE_STRIDE = 37_440
_INSTALL_HINT = "pip install --no-deps sglang==0.5.23"

SPLIT_DECLARATION = (
    "SGLang _split_kv_pages_to_64 (flash_mla_sm120.py): uint8 DSV4 cache of 128/256-token pages "
    "(any page stride that is a multiple of 8) -> [P*ps/64, 64, 1, 584] views of one grow-only "
    "torch.empty scratch per device (destination stride 37,440, no key_suffix); touched pages from "
    "int32/int64 indices through _page_mark_kernel (indices must stay below num_pages*ps)"
)

_COMMON_NOTES = (
    "DSV4 (584 B footer layout) only: the kernels hard-code 448 NoPE + 64 RoPE dims",
    "no argument validation of its own (internal SGLang functions); the adapter checks only what "
    "it reads to map the call (cache geometry, index rows)",
    "no bound check of indices: a valid lane past the cache is read from past it (the Triton path: "
    "a wrong row, no error, measured on the H200) or gathered with torch indexing (the torch path: an "
    "IndexError on a CPU, a device-side assert on CUDA that the adapter refuses as UnsafeForPeer)",
)

TRITON_ENVELOPE = Envelope(
    formats=("dsv4",),
    extra_cache_formats=("dsv4",),
    topk_length_formats=("dsv4",),
    masked_indices="negative",
    index_past_cache="refused",
    notes=_COMMON_NOTES
    + (
        "SGLang flash_mla_sparse_decode_triton: fp32 math; main and extra cache attended by two launches, "
        "each output rounded to BF16, merged by LSE (rounded again), then scaled by the sink (rounded again)",
        "its own LSE: natural log, sink included (logaddexp(lse, sink)), empty row -inf without a sink, "
        "[T, H, 1]; converted to the asked convention",
        "CUDA only: _tiled_sparse_decode_kernel is @triton.autotune'd and Triton's autotuner needs a "
        "GPU driver even under TRITON_INTERPRET=1 (the page split runs interpreted on a CPU)",
    ),
)

TORCH_ENVELOPE = dataclasses.replace(
    TRITON_ENVELOPE,
    notes=_COMMON_NOTES
    + (
        "SGLang _sm120_sparse_decode_fwd: NoPE dequantized to BF16 (exact), fp32 einsum over main + extra in "
        "one softmax, output rounded to BF16 once",
        "its own LSE: natural log, sink excluded, empty row -inf, [T, H, 1]; converted to the asked convention",
        "gathers every lane (negatives clamped to 0, lanes past topk_length too) before masking: "
        "those lanes must hold indices inside the cache (refused as unsafe otherwise)",
    ),
)

#: The peers' entry points, in words, and where they run.
TRITON_PEER, TORCH_PEER = "SGLang flash_mla_sparse_decode_triton", "SGLang _sm120_sparse_decode_fwd"
TRITON_DEVICES, TORCH_DEVICES = ("cuda",), ("cuda", "cpu")


# --------------------------------------------------------------------------- loading the peer


def sglang_root() -> Path:
    """Directory of the installed ``sglang`` package, found without importing it.

    Raises:
        ImportError: sglang is not installed (or is not a regular package).
    """
    module = sys.modules.get("sglang")
    spec = getattr(module, "__spec__", None) if module is not None else None
    if spec is None:
        try:
            spec = importlib.util.find_spec("sglang")
        except (ImportError, ValueError):
            spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ImportError(f"sglang is not installed ({_INSTALL_HINT})")
    return Path(locations[0])


def sglang_version() -> str | None:
    """The installed sglang distribution's version (package metadata), or ``None``."""
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


class _Resources:
    def __init__(self, buffers: MutableMapping[str, Any]) -> None:
        self.buffers = buffers


class _RegistryBuffers(MutableMapping[str, Any]):
    """SGLang's ``get_resources().buffers`` dict, backed by a ``page_split.BufferRegistry``.

    A key ``"<name>:<device>"`` is ``registry.lookup(name, device)``; storing a tensor installs it
    and records it in ``registry.allocation_log`` (SGLang allocates it, with ``torch.empty``).
    """

    def __init__(self, registry: Any) -> None:
        self.registry = registry

    @staticmethod
    def _split(key: str) -> tuple[str, str]:
        name, _, device = key.partition(":")
        return name, device

    def __getitem__(self, key: str) -> Any:
        buf = self.registry.lookup(*self._split(key))
        if buf is None:
            raise KeyError(key)
        return buf

    def __setitem__(self, key: str, value: Any) -> None:
        name, device = self._split(key)
        self.registry.install(name, device, value)
        self.registry.allocation_log.append((key, tuple(value.shape), value.dtype))

    def __delitem__(self, key: str) -> None:
        self.registry.discard(*self._split(key))

    def __iter__(self) -> Iterator[str]:
        return iter(self.registry.keys())

    def __len__(self) -> int:
        return len(self.registry.keys())


_CURRENT_BUFFERS: list[MutableMapping[str, Any]] = []


def _get_resources() -> _Resources:
    if not _CURRENT_BUFFERS:
        raise RuntimeError("SGLang's split ran outside the adapter (no buffer registry bound)")
    return _Resources(_CURRENT_BUFFERS[-1])


def _stub_modules() -> dict[str, types.ModuleType]:
    """The stand-ins of ``_source.stubs_for("sglang")`` as modules, ``get_resources`` bound to the
    registry of the split in progress."""
    from pytest_sparse_mla.implementations._source import stubs_for

    modules = {}
    for name, attrs in stubs_for("sglang").items():
        mod = types.ModuleType(name, "pytest-sparse-mla stand-in (see pytest_sparse_mla.implementations.sglang)")
        mod.__dict__.update(attrs)
        mod.__path__ = []  # type: ignore[attr-defined]
        modules[name] = mod
    modules["sglang.srt.runtime_context"].get_resources = _get_resources  # type: ignore[attr-defined]
    return modules


@contextlib.contextmanager
def _sglang_stubs(buffers: MutableMapping[str, Any] | None = None) -> Iterator[None]:
    """Put the stand-in modules under names not yet in ``sys.modules``; bind ``buffers`` as
    ``get_resources().buffers``; undo both on exit."""
    added = []
    for name, module in _stub_modules().items():
        if name not in sys.modules:
            sys.modules[name] = module
            added.append(name)
    if buffers is not None:
        _CURRENT_BUFFERS.append(buffers)
    try:
        yield
    finally:
        if buffers is not None:
            _CURRENT_BUFFERS.pop()
        for name in added:
            sys.modules.pop(name, None)


@functools.cache
def load_module(which: str) -> types.ModuleType:
    """Execute the installed SGLang file ``SGLANG_FILES[which]`` under a private module name.

    Sets ``TRITON_INTERPRET=1`` first when it is unset and torch sees no CUDA device (module
    docstring). Records ``INTERPRETED`` on the module.

    Raises:
        ImportError: sglang (or triton) is not installed, or the file is missing from it.
        KeyError: ``which`` is not a key of :data:`SGLANG_FILES`.
    """
    path = sglang_root() / SGLANG_FILES[which]
    if not path.is_file():
        raise ImportError(f"the installed sglang has no {SGLANG_FILES[which]} (looked at {path})")
    if "TRITON_INTERPRET" not in os.environ and not capabilities.probe().cuda_available:
        os.environ["TRITON_INTERPRET"] = "1"
    name = _PRIVATE_PREFIX + which
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:  # pragma: no cover - a .py path always has a loader
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        with _sglang_stubs():
            spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    module.INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # type: ignore[attr-defined]
    return module


# --------------------------------------------------------------------------- the adapters


class _SglangBase(_peer.PeerAdapter):
    """Shared mapping of both SGLang adapters (see the module docstring)."""

    name = "sglang"
    compute_mode = "bf16"
    envelope: Envelope = TRITON_ENVELOPE
    peer: str = TRITON_PEER
    devices: tuple[str, ...] = TRITON_DEVICES
    #: key of :data:`SGLANG_FILES` holding the forward, its function name, whether its LSE has the sink.
    _forward_file = "flash_mla_sm120_triton"
    _forward_function = "flash_mla_sparse_decode_triton"
    _lse_has_sink = True
    _device_note = (
        "its decode kernel is @triton.autotune'd, and the autotuner times configs on a GPU driver "
        "even under TRITON_INTERPRET=1"
    )

    # ---- capability checks

    def _load_reason(self, which: str) -> str | None:
        try:
            load_module(which)
        except ImportError as exc:
            return f"{self.name} adapter: {exc}"
        return None

    def _triton_reason(self, device: str) -> str | None:
        module = load_module("flash_mla_sm120")
        if device == "cpu" and not module.INTERPRETED:
            return "SGLang's Triton kernels on CPU tensors need TRITON_INTERPRET=1 before the first call"
        if device == "cuda" and module.INTERPRETED:
            return "SGLang's Triton kernels were decorated under TRITON_INTERPRET=1 (CPU tensors only)"
        return None

    def skip_reason(self, capability: str, device: str) -> str | None:
        """Why ``capability`` cannot run on ``device`` here: sglang missing, a device the path does
        not run on, or Triton kernels compiled vs interpreted not matching the device."""
        if capability == "page_split":
            return self._load_reason("flash_mla_sm120") or self._triton_reason(device)
        if capability != "sparse_mla_forward":
            return None
        reason = self._load_reason("flash_mla_sm120") or self._load_reason(self._forward_file)
        if reason is not None:
            return reason
        if device not in self.devices:
            return f"{self.peer} runs on {'/'.join(self.devices)} only ({self._device_note})"
        return self._triton_reason(device) if self._forward_file.endswith("triton") else None

    def unsupported_reason(self, capability: str, *args: Any, **kwargs: Any) -> str | None:
        """Why the peer cannot take this call of ``capability`` (same arguments as the call), or ``None``.

        The call itself raises :class:`pytest_sparse_mla.Unsupported` with the same text. Value
        checks that make an input *unsafe* are not reasons (the call raises).
        """
        if capability == "page_split":
            return self._split_reason(*args, **kwargs)
        return super().unsupported_reason(capability, *args, **kwargs)

    @staticmethod
    def _src_pbs(kv_cache: Any, src_page_block_size: int | None) -> int:
        """``src_pbs`` as SGLang's caller derives it: the given size, else ``shape[1]`` (``shape[2]``
        of an HND cache), else 256 for a 2-D pool."""
        if src_page_block_size is not None:
            return int(src_page_block_size)
        shape = tuple(getattr(kv_cache, "shape", ()))
        if len(shape) == 4 and shape[1] == 1:
            return int(shape[2])
        return int(shape[1]) if len(shape) >= 3 else 256

    def _split_reason(
        self,
        kv_cache: Any,
        *,
        src_page_block_size: int | None = None,
        key_suffix: str = "",
        dst_page_stride: int = _SGLANG_DST_PAGE_STRIDE,
        **_: Any,
    ) -> str | None:
        if self._src_pbs(kv_cache, src_page_block_size) == 64:
            return None  # SGLang returns a 64-token pool as it is: no scratch, nothing to key
        if key_suffix != "":
            return (
                f"SGLang's _split_kv_pages_to_64 keeps one scratch per device (key "
                f"flash_mla_sm120_split:{{dev}}); it takes no key_suffix (got {key_suffix!r})"
            )
        if dst_page_stride != _SGLANG_DST_PAGE_STRIDE:
            return (
                f"SGLang's split writes 64-token pages at a fixed stride of {_SGLANG_DST_PAGE_STRIDE} "
                f"bytes (_BYTES_PER_DST_PAGE_PADDED); dst_page_stride={dst_page_stride!r}"
            )
        return None

    # ---- the forward

    def _forward_callable(self) -> Any:
        return getattr(load_module(self._forward_file), self._forward_function)

    def forward(self, call: _peer.PeerCall, return_fp32: bool) -> _peer.PeerResult:
        """Run the SGLang path (see the module docstring).

        Returns:
            :class:`PeerResult`: SGLang's BF16 output ``[T, H, 512]``, its LSE converted to
            ``lse_convention``, ``route=None``.

        Raises:
            _peer.UnsafeForPeer: ``sglang-torch`` with an out-of-range index past ``topk_length``.
            Whatever SGLang raises.
        """
        c = call.call
        extra_idx3 = c.extra.indices.unsqueeze(1) if c.extra is not None else None
        source = {"kind": "file", "package": "sglang", "path": SGLANG_FILES[self._forward_file], "stubs": "sglang"}
        out, lse = _peer.call_peer(
            source, self._forward_function, self._forward_callable(),
            (c.q.unsqueeze(1), call.kv4, c.main.indices.unsqueeze(1), c.main.topk_length, c.attn_sink, 512,
             float(c.sm_scale), call.extra4, extra_idx3, c.extra_topk_length), {},
        )  # fmt: skip
        lse = _peer.lse_to_convention(
            lse[:, :, 0],
            sink_included=self._lse_has_sink and c.attn_sink is not None,
            attn_sink=c.attn_sink,
            lse_convention=c.lse_convention,
            lse_scale=c.lse_scale,
        )
        return _peer.PeerResult(out[:, 0], lse, None, f"sglang {self._forward_function}")

    # ---- the page split

    def page_split(
        self,
        kv_cache: Any,
        *,
        src_page_block_size: int | None = None,
        touched_indices: Any = None,
        key_suffix: str = "",
        registry: Any = None,
        backend: str | None = None,
        dst_page_stride: int = _SGLANG_DST_PAGE_STRIDE,
    ) -> Any:
        """SGLang's ``_split_kv_pages_to_64(kv_cache, src_pbs, touched_indices)``, byte for byte.

        ``src_pbs`` is ``src_page_block_size`` when given, else read from the shape the way SGLang's
        caller does (``shape[1]`` of a 3-D or NHD cache; ``shape[2]`` of an HND cache; 256 for 2-D).
        ``key_suffix`` is refused unless ``src_pbs`` is 64 (then SGLang returns the input and no
        scratch exists to key).
        ``kv_cache`` is passed as it is (SGLang checks neither dtype nor geometry). ``registry``
        (default ``page_split.default_registry()``) serves as ``get_resources().buffers``.
        ``backend`` is ignored (SGLang has one split).

        Raises:
            pytest_sparse_mla.Unsupported: ``key_suffix`` or ``dst_page_stride`` (see :meth:`unsupported_reason`).
            _peer.UnsafeForPeer: a touched index ``>= num_pages * src_pbs`` (checked with one host sync,
                left out under CUDA-graph capture and under torch's sync debug mode).
            Whatever SGLang raises (``AssertionError`` for a page size that is not a multiple of 64).
        """

        from pytest_sparse_mla.page_split import default_registry

        del backend
        reason = self._split_reason(
            kv_cache, src_page_block_size=src_page_block_size, key_suffix=key_suffix, dst_page_stride=dst_page_stride
        )
        if reason is not None:
            raise Unsupported(f"{self.name}: {reason}")
        src_pbs = self._src_pbs(kv_cache, src_page_block_size)
        if touched_indices is not None and touched_indices.numel() > 0 and self._may_sync(kv_cache):
            limit = int(kv_cache.shape[0]) * int(src_pbs)
            too_far = touched_indices >= limit
            if bool(too_far.any()):
                value = int(touched_indices[too_far].reshape(-1)[0])
                raise _peer.UnsafeForPeer(
                    f"{self.name}: touched_indices holds {value} >= num_pages*src_pbs = {limit}; SGLang's "
                    "_page_mark_kernel stores mask[t // src_pbs] = 1 for every t >= 0 without a bound, "
                    "an out-of-bounds store (the project's split marks nothing for such an index)"
                )
        buffers = _RegistryBuffers(default_registry() if registry is None else registry)
        split = load_module("flash_mla_sm120")._split_kv_pages_to_64
        source = {"kind": "file", "package": "sglang", "path": SGLANG_FILES["flash_mla_sm120"], "stubs": "sglang"}
        with _sglang_stubs(buffers):
            return _peer.call_peer(
                source, "_split_kv_pages_to_64", split, (kv_cache, int(src_pbs)), {"touched_indices": touched_indices}
            )

    @staticmethod
    def _may_sync(kv_cache: Any) -> bool:
        """Whether the touched-index guard may read the indices on the host: not under CUDA-graph
        capture and not when the caller set torch's sync debug mode (it forbids host syncs; SGLang's
        split itself never syncs)."""
        import torch

        if not kv_cache.is_cuda:
            return True
        return not torch.cuda.is_current_stream_capturing() and torch.cuda.get_sync_debug_mode() == 0

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} sglang={sglang_version()}>"


class SglangTritonImplementation(_SglangBase):
    """Built-in ``sglang-triton``: SGLang's tiled Triton sparse decode + its page split."""

    name = "sglang-triton"


class SglangTorchImplementation(_SglangBase):
    """Built-in ``sglang-torch``: SGLang's pure-PyTorch sparse decode + its (Triton) page split."""

    name = "sglang-torch"
    envelope = TORCH_ENVELOPE
    peer = TORCH_PEER
    devices = TORCH_DEVICES
    _forward_file = "flash_mla_sm120"
    _forward_function = "_sm120_sparse_decode_fwd"
    _lse_has_sink = False

    def refuse_lanes(self, source: Candidates) -> None:
        """The torch path gathers every lane with torch indexing: on CUDA a valid lane past the
        cache is a device-side assert (measured on the H200), and a lane past ``topk_length`` is
        gathered too (only negatives are clamped)."""
        idx, num_slots = source.indices, source.num_slots
        if idx.is_cuda:
            _peer.refuse_lanes_past_cache(
                self.name, source,
                "SGLang's _sm120_sparse_decode_fwd gathers it with torch indexing, a device-side assert "
                "(index out of bounds) that ends the process's CUDA context; on a CPU an IndexError",
            )  # fmt: skip
        if source.topk_length is None:
            return
        bad = ~source.valid_lanes() & (idx >= num_slots)
        if bool(bad.any()):
            t, j = (int(v) for v in bad.nonzero()[0])
            _, name, length_name = source.names
            raise _peer.UnsafeForPeer(
                f"{self.name}: {name}[{t}, {j}]={int(idx[t, j])} lies past {length_name} but outside the "
                f"cache ({num_slots} slots); SGLang's _sm120_sparse_decode_fwd gathers every lane "
                "(indices.clamp(min=0)) before masking, an out-of-bounds gather (the project's rule: "
                "lanes past topk_length are never read)"
            )
