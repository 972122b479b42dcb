"""The implementation under test: protocol, built-ins, registry and ``--sparse-mla-impl`` resolution.

Protocol
========

An implementation is any object (an instance, a class instance, a module) with a subset of these
attributes; every capability is optional, a suite needing one the implementation lacks is skipped
with that reason (marker ``sparse_mla_needs("sparse_mla_forward", ...)``):

=========================  ======================================================================
attribute                  meaning
=========================  ======================================================================
``name``                   display name (defaults to the registry name or import string)
``pack``                   ``pack(source, fmt="dsv4", *, page_stride="tight", form="nhd",
                           scale_rule="flashmla", pad_fill=0) -> uint8 cache``, the signature of
                           ``formats.quantize_pack``
``page_split``             ``page_split(kv_cache, *, src_page_block_size=None,
                           touched_indices=None, key_suffix="", registry=None, ...) -> uint8
                           [P*ratio, 64, 1, 584]``, the signature of
                           ``pytest_sparse_mla.page_split.page_split``
``sparse_mla_forward``     ``sparse_mla_forward(q, kv_cache, indices, *, sm_scale, fmt="dsv4",
                           page_block_size=None, topk_length=None, attn_sink=None,
                           extra_kv_cache=None, extra_indices=None, extra_topk_length=None,
                           extra_page_block_size=None, lse_convention="flashinfer",
                           lse_scale=1.0, ...) -> result`` with ``result.output`` ``[T, H, 512]``
                           BF16 and ``result.lse`` ``[T, H]`` fp32 (``result.route`` optional;
                           an ``(output, lse)`` pair and, with ``lse_conventions=()`` in the
                           envelope, a bare output tensor are accepted too), the signature of
                           ``pytest_sparse_mla.attention.sparse_mla_forward``
``compute_mode``           ``"exact"`` (fp32 throughout), ``"bf16"`` (default: BF16 P and
                           partials, like FlashMLA) or ``"fp8"`` (E4M3 Q and P, like FlashInfer's
                           SM120 kernels): selects the tolerance profile (``tight``, ``kernel``,
                           ``kernel-fp8``); see ``pytest_sparse_mla.tolerances``
``tolerance_profile``      a profile name that overrides ``compute_mode``
``envelope``               a :class:`pytest_sparse_mla.Envelope`: the calls ``sparse_mla_forward``
                           serves (formats, head counts, widths, extra cache, lengths, token
                           counts, masking, LSE conventions or none, bitwise invariance
                           claims); the suites fit every case inside it and never call outside
                           it. Absent: every call. A call refused at run time raises
                           :class:`pytest_sparse_mla.Unsupported` (a skip without an envelope, a
                           failure inside a declared one)
``skip_reason``            ``skip_reason(capability: str, device: str) -> str | None``: why a
                           capability cannot run on ``device`` (``"cpu"``/``"cuda"``) here
``flashinfer_release``     ``str | None``: the FlashInfer release (``"0.6.17"``) whose SM120
                           dispatch grid ``sparse_mla_forward`` follows. Declared, a shape that
                           release lacks must raise its upstream error type and exact text, and
                           a shape it serves must run (``suites/test_dispatch_grid.py``, tables
                           in ``pytest_sparse_mla.dispatch``); ``None``/absent: that suite skips
=========================  ======================================================================

The same protocol as ``typing.Protocol`` classes (``Packer``, ``PageSplitter``,
``SparseMlaForward``, the result type ``SparseMlaResult``) is in
:mod:`pytest_sparse_mla.implementations.protocol`, for downstream type checking; the capability
check below uses them.

Selecting one: ``--sparse-mla-impl NAME`` (or the ``sparse_mla_impl`` ini key), where NAME is, in
this order: a built-in; a name registered through the ``pytest_sparse_mla_implementations(config)``
hook (``hookspecs.py``; hook names may replace built-ins) or an installed package's entry point;
``module`` or ``package.module`` (the module object), importable from ``sys.path`` or found in the
rootdir, the ini file's folder, the current folder, a test path's folder or beside a loaded
``conftest.py`` (``implementations.locate``); or ``module:attribute`` (a dotted attribute path; a
class found there is instantiated without arguments). A miss raises ``pytest.UsageError`` listing
every form that would have worked. The pattern is array-api-tests' (data-apis/array-api-tests: one
suite, the implementation chosen at run time).

Built-ins
=========

* ``reference``: ``formats.quantize_pack``, the torch page split, the bundled reference attention
  (``attention.sparse_mla_forward``; under ``--sparse-mla-grid X`` it enforces release X's dispatch
  grid). Compute mode ``"exact"`` (profile ``tight``).
* ``triton``: the Triton page split (skipped where ``page_split.triton_unavailable_reason`` says
  it cannot run: no triton, or CPU tensors without ``TRITON_INTERPRET=1``); ``pack`` and attention
  are the reference's, so suites that split and then attend test the Triton split end to end.
  Compute mode ``"exact"``.
* ``flashinfer``: an adapter over FlashInfer's SM120 sparse-MLA entry
  ``_sparse_mla_sm120_paged_attention`` (module ``flashinfer.mla._sparse_mla_sm120._api`` from
  0.7.1, ``flashinfer.mla._sparse_mla_sm120`` before; signature and checks in its docstring and
  body, ``flashinfer/mla/_sparse_mla_sm120/_api.py`` of 0.7.4). It provides ``sparse_mla_forward``
  only (FlashInfer ships no DSV4-584 writer and no page split) and is skipped unless
  flashinfer-python is installed, the suites run on CUDA and the GPU is SM12x (FlashInfer's gate:
  ``flashinfer/utils.py`` ``is_sm12x_supported``). Compute mode ``"fp8"`` (its kernels quantize
  Q and P to E4M3; profile ``kernel-fp8``).

* ``sglang-triton``, ``sglang-torch`` (``implementations.sglang``): SGLang's Triton and PyTorch
  DeepSeek-V4 sparse decode and its page split, executed from the installed ``sglang`` wheel
  without importing its server stack. ``flashmla`` (``implementations.flashmla``): FlashMLA's
  SM90/SM100 sparse decode (``T <= 64``) and sparse prefill, from a built ``flash_mla``.
  ``flaggems`` (``implementations.flaggems``): FlagGems' Triton implementation of FlashMLA's
  interface, executed from its source files. ``vllm-triton`` (``implementations.vllm_triton``):
  vLLM's Triton BF16 sparse MLA over a dequantized table. ``flashinfer-reference``
  (``implementations.flashinfer_reference``): the pure-torch references in the flashinfer-python
  wheel, on any device (CPU included). Each declares what its peer takes as an ``envelope`` and answers
  ``unsupported_reason(capability, *args, **kwargs)`` (a reason, or ``None``) before a call; the
  call raises :class:`pytest_sparse_mla.Unsupported` with the same text, and
  ``_peer.UnsafeForPeer`` for valid inputs the peer would mishandle out of bounds.

The hooks module (``pytest_sparse_mla.plugin``) calls :func:`configure` from ``pytest_configure``
(the implementation is resolved once, so a bad ``--sparse-mla-impl`` is a usage error before any
test runs; hook implementations therefore belong in a plugin or an initial ``conftest.py``) and
:func:`skip_unservable` from ``pytest_collection_modifyitems`` (``sparse_mla_needs`` markers become
skips). This module imports torch only inside functions (an import string may import whatever its
module imports).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from pytest_sparse_mla import capabilities, options
from pytest_sparse_mla.envelope import ALL_FORMATS, INVARIANCE_CLAIMS, Envelope

__all__ = [
    "CAPABILITIES",
    "BUILTINS",
    "ReferenceImplementation",
    "TritonImplementation",
    "FlashInferImplementation",
    "available_implementations",
    "resolve_implementation",
    "get_implementation",
    "implementation_name",
    "needs_of",
    "skip_reason_for",
    "session_device",
    "configure",
    "skip_unservable",
]

#: capabilities an implementation may provide.
CAPABILITIES: tuple[str, ...] = ("pack", "page_split", "sparse_mla_forward")
NEEDS_MARKER = "sparse_mla_needs"
_IMPL_KEY = pytest.StashKey[Any]()


class ReferenceImplementation:
    """The bundled pure-PyTorch implementation (built-in name ``reference``).

    Args:
        grid_release: FlashInfer release whose dispatch grid ``sparse_mla_forward`` enforces
            (``--sparse-mla-grid``), or ``None``. A caller's explicit ``grid_release=`` wins.
    """

    name = "reference"
    compute_mode = "exact"
    split_backend = "torch"
    #: Every call, and every invariance bit for bit (a fixed-order fp32 pipeline per token and head).
    envelope = Envelope(
        formats=ALL_FORMATS,
        extra_cache_formats=ALL_FORMATS,
        topk_length_formats=ALL_FORMATS,
        sink_formats=ALL_FORMATS,
        bitwise_invariance=frozenset(INVARIANCE_CLAIMS),
    )

    def __init__(self, grid_release: str | None = None) -> None:
        self.grid_release = grid_release

    @property
    def flashinfer_release(self) -> str | None:
        """Protocol attribute: the release whose grid ``sparse_mla_forward`` enforces (``grid_release``)."""
        return self.grid_release

    def pack(self, source: Any, fmt: Any = "dsv4", **kwargs: Any) -> Any:
        """``formats.quantize_pack`` (BF16 ``[P, ps, d_qk]`` -> packed uint8 cache)."""
        from pytest_sparse_mla import formats

        return formats.quantize_pack(source, fmt, **kwargs)

    def page_split(self, kv_cache: Any, **kwargs: Any) -> Any:
        """``page_split.page_split`` with this implementation's backend (a ``backend=`` wins)."""
        from pytest_sparse_mla.page_split import page_split

        kwargs.setdefault("backend", self.split_backend)
        return page_split(kv_cache, **kwargs)

    def sparse_mla_forward(self, q: Any, kv_cache: Any, indices: Any, **kwargs: Any) -> Any:
        """``attention.sparse_mla_forward`` (grid enforcement from ``--sparse-mla-grid``)."""
        from pytest_sparse_mla.attention import sparse_mla_forward

        kwargs.setdefault("grid_release", self.grid_release)
        return sparse_mla_forward(q, kv_cache, indices, **kwargs)

    def skip_reason(self, capability: str, device: str) -> str | None:
        """Every capability runs everywhere (``None``)."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} grid={self.grid_release}>"


class TritonImplementation(ReferenceImplementation):
    """Built-in ``triton``: the Triton page split; ``pack`` and attention from the reference."""

    name = "triton"
    split_backend = "triton"

    def skip_reason(self, capability: str, device: str) -> str | None:
        """Why the Triton split cannot run on ``device`` (``page_split.triton_unavailable_reason``)."""
        if capability != "page_split":
            return None
        from pytest_sparse_mla.page_split import triton_unavailable_reason

        return triton_unavailable_reason(device)


def _flashinfer_entry() -> Callable[..., None]:
    """FlashInfer's internal SM120 entry ``_sparse_mla_sm120_paged_attention`` (0.6.14 .. 0.7.4)."""
    for module_name in (
        "flashinfer.mla._sparse_mla_sm120._api",  # 0.7.1+: package split
        "flashinfer.mla._sparse_mla_sm120",  # 0.6.14 - 0.7.0: one module
    ):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        entry: Callable[..., None] | None = getattr(module, "_sparse_mla_sm120_paged_attention", None)
        if entry is not None:
            return entry
    raise ImportError(
        "flashinfer.mla has no _sparse_mla_sm120_paged_attention (looked in "
        "flashinfer.mla._sparse_mla_sm120._api and flashinfer.mla._sparse_mla_sm120)"
    )


class FlashInferImplementation:
    """Built-in ``flashinfer``: adapter over FlashInfer's SM120 sparse-MLA kernels (CUDA, SM12x).

    Best effort: written against the 0.6.14 - 0.7.4 sources (``flashinfer/mla/_sparse_mla_sm120.py``,
    ``flashinfer/mla/_sparse_mla_sm120/_api.py``), not run on SM12x hardware by this project. It
    allocates ``output``/``out_lse`` (and the
    split-K decode scratch for ``num_tokens <= 64``: ``[T, heads, splits, 512]`` BF16 and
    ``[T, heads, splits]`` fp32 with ``splits = ceil(topk/64) + ceil(extra_topk/64)`` and
    ``heads`` = 8 if H == 8 else ``ceil(H/16)*16`` from 0.7.0, H before), calls the entry, and
    converts FlashInfer's base-2, sink-including LSE to the requested convention.
    """

    name = "flashinfer"
    compute_mode = "fp8"
    #: FlashInfer's SM120 entry takes any head count and width its grid serves (the grid itself is
    #: judged by ``suites/test_dispatch_grid.py``); from 0.7.0 it rejects a DSV3.2 extra cache.
    envelope = Envelope(
        extra_cache_formats=("dsv4",),
        notes=("its own LSE: base 2, sink included; converted to the asked convention",),
    )

    @property
    def flashinfer_release(self) -> str | None:
        """Protocol attribute: the installed flashinfer-python version (its grid is the one that runs)."""
        return capabilities.probe().flashinfer_version

    def skip_reason(self, capability: str, device: str) -> str | None:
        """Why FlashInfer cannot run here: not installed, not on CUDA, or not an SM12x GPU."""
        caps = capabilities.probe()
        if caps.flashinfer_version is None:
            return "flashinfer adapter: flashinfer-python is not installed"
        if device != "cuda" or not caps.cuda_available:
            return (
                "flashinfer adapter: FlashInfer's SM120 sparse-MLA kernels need CUDA tensors; "
                f"the suites run on {device} (CUDA available: {caps.cuda_available})"
            )
        if caps.compute_capability is None or caps.compute_capability[0] != 12:
            return (
                "flashinfer adapter: requires an SM12x GPU (compute capability 12.x); found "
                f"{caps.sm} ({caps.device_name})"
            )
        return None

    def sparse_mla_forward(
        self,
        q: Any,
        kv_cache: Any,
        indices: Any,
        *,
        sm_scale: float,
        fmt: str = "dsv4",
        page_block_size: int | None = None,
        topk_length: Any = None,
        attn_sink: Any = None,
        extra_kv_cache: Any = None,
        extra_indices: Any = None,
        extra_topk_length: Any = None,
        extra_page_block_size: int | None = None,
        lse_convention: str = "flashinfer",
        lse_scale: float = 1.0,
        grid_release: str | None = None,
        chunk_tokens: int | None = None,
        return_fp32: bool = False,
    ) -> Any:
        """Run FlashInfer's kernel with the reference forward's signature.

        ``page_block_size``/``extra_page_block_size`` are read from the cache shapes by FlashInfer;
        ``grid_release`` and ``chunk_tokens`` are ignored (the installed release *is* the grid).

        Raises:
            ValueError: ``return_fp32=True`` (the kernels produce BF16 only), bad LSE convention.
            ImportError: the installed flashinfer has no SM120 sparse-MLA entry.
            Whatever FlashInfer raises for the inputs.
        """
        import torch
        from packaging.version import Version

        from pytest_sparse_mla import formats
        from pytest_sparse_mla.attention import SparseMlaOutput, route_for
        from pytest_sparse_mla.attention.conventions import check_lse_convention

        del page_block_size, extra_page_block_size, grid_release, chunk_tokens
        lse_convention, lse_scale = check_lse_convention(lse_convention, lse_scale)
        if return_fp32:
            raise ValueError("return_fp32=True: FlashInfer's kernels produce a BF16 output only")
        entry = _flashinfer_entry()
        f = formats.get_format(fmt)
        num_tokens, num_heads = int(q.shape[0]), int(q.shape[1])
        output = torch.zeros((num_tokens, num_heads, f.d_v), dtype=torch.bfloat16, device=q.device)
        out_lse = torch.zeros((num_tokens, num_heads), dtype=torch.float32, device=q.device)
        kwargs: dict[str, Any] = {
            "topk_length": topk_length,
            "attn_sink": attn_sink,
            "extra_kv_cache": extra_kv_cache,
            "extra_indices": extra_indices,
            "extra_topk_length": extra_topk_length,
        }
        if num_tokens <= 64 and num_tokens > 0:
            topk = int(indices.shape[-1])
            extra_topk = int(extra_indices.shape[-1]) if extra_indices is not None else 0
            splits = -(-topk // 64) + -(-extra_topk // 64)
            version = Version(capabilities.probe().flashinfer_version or "0")
            if version >= Version("0.7.0"):
                heads = 8 if num_heads == 8 else -(-num_heads // 16) * 16
            else:
                heads = num_heads
            kwargs["mid_out"] = torch.empty((num_tokens, heads, splits, f.d_v), dtype=torch.bfloat16, device=q.device)
            kwargs["mid_lse"] = torch.empty((num_tokens, heads, splits), dtype=torch.float32, device=q.device)
        entry(q, kv_cache, indices, output, out_lse, float(sm_scale), **kwargs)
        from pytest_sparse_mla.implementations._peer import lse_to_convention

        # FlashInfer's out_lse: base 2, sink included -> natural log for the shared conversion
        lse = lse_to_convention(
            out_lse.to(torch.float64) * math.log(2.0),
            sink_included=True,
            attn_sink=attn_sink,
            lse_convention=lse_convention,
            lse_scale=lse_scale,
        )
        return SparseMlaOutput(output, lse, route_for(num_tokens))


def _peer_adapter(module: str, cls: str) -> Callable[[pytest.Config], Any]:
    """Factory of a peer adapter class in ``implementations.<module>`` (imported on first use)."""
    return lambda config: getattr(importlib.import_module(f"{__name__}.{module}"), cls)()


#: built-in name -> factory(config).
BUILTINS: dict[str, Callable[[pytest.Config], Any]] = {
    "reference": lambda config: ReferenceImplementation(options.get_options(config).grid),
    "triton": lambda config: TritonImplementation(options.get_options(config).grid),
    "flashinfer": lambda config: FlashInferImplementation(),
    "sglang-triton": _peer_adapter("sglang", "SglangTritonImplementation"),
    "sglang-torch": _peer_adapter("sglang", "SglangTorchImplementation"),
    "flashmla": _peer_adapter("flashmla", "FlashMlaImplementation"),
    "flaggems": _peer_adapter("flaggems", "FlagGemsImplementation"),
    "vllm-triton": _peer_adapter("vllm_triton", "VllmTritonImplementation"),
    "flashinfer-reference": _peer_adapter("flashinfer_reference", "FlashInferReferenceImplementation"),
}


if TYPE_CHECKING:  # the built-ins type-check against the protocol (mypy --strict, lint lane)
    from pytest_sparse_mla.implementations.protocol import SparseMlaForward, SparseMlaImplementation

    _REFERENCE: SparseMlaImplementation = ReferenceImplementation()
    _TRITON: SparseMlaImplementation = TritonImplementation()
    _FLASHINFER: SparseMlaForward = FlashInferImplementation()


def available_implementations(config: pytest.Config) -> dict[str, Any]:
    """Selectable names -> built-in factory or registered object (hook names override built-ins).

    Raises:
        pytest.UsageError: a hook returned something other than a dict with str keys.
    """
    names: dict[str, Any] = dict(BUILTINS)
    hook = getattr(config.hook, "pytest_sparse_mla_implementations", None)
    if hook is None:
        return names
    for result in reversed(hook(config=config)):
        if result is None:
            continue
        if not isinstance(result, dict) or not all(isinstance(k, str) for k in result):
            raise pytest.UsageError(
                f"pytest_sparse_mla_implementations returned {type(result).__name__}: expected a "
                "dict {name: implementation}"
            )
        names.update(result)
    return names


def _import_object(spec: str, config: pytest.Config | None = None) -> Any:
    """Import ``module[:attribute]`` (from ``sys.path``, else from ``locate.search_dirs``).

    Raises:
        locate.ModuleMissing: the module exists nowhere (the caller lists every form).
        pytest.UsageError: it failed to import, or has no such attribute.
    """
    from pytest_sparse_mla.implementations import locate

    module_name, _, attribute = spec.partition(":")
    if not locate.is_module_path(module_name):
        raise locate.ModuleMissing(f"{module_name!r} is not a module path", name=module_name)
    try:
        obj: Any = locate.import_module(module_name, locate.search_dirs(config) if config is not None else [])
    except locate.ModuleMissing:
        raise
    except ImportError as exc:
        file_hint = locate.file_name_hint(module_name)
        hint = f"; {file_hint}" if file_hint else ""
        raise pytest.UsageError(
            f"--sparse-mla-impl={spec!r}: cannot import module {module_name!r} ({exc}){hint}"
        ) from None
    for part in attribute.split(".") if attribute else ():
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise pytest.UsageError(
                f"--sparse-mla-impl={spec!r}: module {module_name!r} has no attribute {attribute!r}"
            ) from None
    if isinstance(obj, type):
        obj = obj()
    return obj


def implementation_name(impl: Any, default: str = "") -> str:
    """``impl.name`` if it is a string, else ``default``."""
    name = getattr(impl, "name", None)
    return name if isinstance(name, str) and name else default


def _check_provides_something(impl: Any, spec: str) -> None:
    from pytest_sparse_mla.implementations.protocol import CAPABILITY_PROTOCOLS

    provided = [
        cap for cap, proto in CAPABILITY_PROTOCOLS.items() if isinstance(impl, proto) and callable(getattr(impl, cap))
    ]
    if not provided:
        import types

        hint = ""
        if isinstance(impl, types.ModuleType):  # the module itself was selected: name what is in it
            found = [
                name for name, obj in vars(impl).items()
                if not name.startswith("_") and any(callable(getattr(obj, cap, None)) for cap in CAPABILITIES)
            ]  # fmt: skip
            if found:
                hint = "; did you mean " + " or ".join(f"--sparse-mla-impl={spec}:{name}" for name in found[:3]) + "?"
        raise pytest.UsageError(
            f"--sparse-mla-impl={spec!r}: {impl!r} provides none of {', '.join(CAPABILITIES)} "
            f"(see pytest_sparse_mla.implementations for the protocol){hint}"
        )


def resolve_implementation(spec: str, config: pytest.Config) -> Any:
    """The implementation named by ``spec`` (a registered name or an import string).

    Raises:
        pytest.UsageError: unknown name (the message lists the valid ones), an import string that
            does not import, or an object that provides no capability.
    """
    from pytest_sparse_mla import entry_points
    from pytest_sparse_mla.implementations import locate

    names = available_implementations(config)
    if spec in names:
        entry = names[spec]
        impl = entry(config) if spec in BUILTINS and entry is BUILTINS[spec] else entry
        if isinstance(impl, str):
            try:
                impl = _import_object(impl)
            except locate.ModuleMissing as exc:
                raise pytest.UsageError(f"--sparse-mla-impl={spec!r}: {impl!r} does not import ({exc})") from None
    else:
        try:
            impl = _import_object(spec, config)
        except locate.ModuleMissing:
            declared = set(entry_points.entry_point_specs())
            raise pytest.UsageError(
                locate.miss_message(
                    spec,
                    builtins=BUILTINS,
                    entry_points=declared,
                    hook_names=set(names) - set(BUILTINS) - declared,
                    dirs=locate.search_dirs(config),
                )
            ) from None
    _check_provides_something(impl, spec)
    return impl


def get_implementation(config: pytest.Config) -> Any:
    """The session's implementation under test (``--sparse-mla-impl``), resolved once and cached.

    Raises:
        pytest.UsageError: as :func:`resolve_implementation`.
    """
    impl = config.stash.get(_IMPL_KEY, None)
    if impl is None:
        impl = resolve_implementation(options.get_options(config).impl, config)
        config.stash[_IMPL_KEY] = impl
    return impl


def needs_of(node: Any) -> tuple[str, ...]:
    """Capabilities named by every ``sparse_mla_needs`` marker on ``node`` (in order, unique).

    Raises:
        pytest.UsageError: a marker names an unknown capability.
    """
    needs: list[str] = []
    for mark in node.iter_markers(NEEDS_MARKER):
        for cap in mark.args:
            if cap not in CAPABILITIES:
                raise pytest.UsageError(
                    f"{node.nodeid}: sparse_mla_needs({cap!r}): unknown capability; expected "
                    f"one of {', '.join(CAPABILITIES)}"
                )
            if cap not in needs:
                needs.append(cap)
    return tuple(needs)


def skip_reason_for(impl: Any, needs: tuple[str, ...], device: str) -> str | None:
    """Why ``impl`` cannot serve ``needs`` on ``device``, or ``None``.

    A capability is missing when the attribute is absent or not callable; otherwise the
    implementation's optional ``skip_reason(capability, device)`` is asked.
    """
    name = implementation_name(impl, repr(impl))
    for cap in needs:
        if not callable(getattr(impl, cap, None)):
            return f"implementation {name!r} does not provide {cap!r} (sparse_mla_needs)"
        ask = getattr(impl, "skip_reason", None)
        if callable(ask):
            reason = ask(cap, device)
            if reason:
                return f"implementation {name!r} cannot run {cap!r}: {reason}"
    return None


def session_device(config: pytest.Config) -> str:
    """``"cuda"`` or ``"cpu"``: where the suites run (``--sparse-mla-device``, ``auto`` = CUDA
    when torch sees one), as the ``sparse_mla_device`` fixture decides."""
    wanted = options.get_options(config).device
    if wanted == "cpu":
        return "cpu"
    if wanted == "cuda":
        return "cuda"
    return "cuda" if capabilities.probe().cuda_available else "cpu"


def configure(config: pytest.Config) -> None:
    """Resolve ``--sparse-mla-impl`` now (from ``pytest_configure``), so a bad value is a usage
    error before any test runs and before pytest-xdist starts workers. Hook implementations must
    therefore live in a plugin or an initial (rootdir / test-path) ``conftest.py``; a local module
    is looked for in the folders of ``locate.search_dirs``."""
    get_implementation(config)


def skip_unservable(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip items whose ``sparse_mla_needs`` the implementation cannot serve (from
    ``pytest_collection_modifyitems``)."""
    needing = [
        item
        for item in items
        if item.get_closest_marker(NEEDS_MARKER) is not None or "sparse_mla_impl" in getattr(item, "fixturenames", ())
    ]
    if not needing and not options.get_options(config).impl_given:
        return
    impl = get_implementation(config)
    device = session_device(config)
    for item in needing:
        reason = skip_reason_for(impl, needs_of(item), device)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
