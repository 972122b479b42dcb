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
                           failure inside a declared one). Anything else is a usage error
                           when the session configures (:func:`declared_envelope`)
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

* the peers: adapters over other projects' kernels, one module each, whose docstring says what it
  runs, from where, and how it maps the call. Their names, adapter classes and what each needs are
  the entries of ``catalogue`` (``python -m pytest_sparse_mla.catalogue
  peers`` lists them; README, "Run the suites against a peer"). Each declares what its peer takes as an
  ``envelope`` and answers ``unsupported_reason(capability, *args, **kwargs)`` (a reason, or
  ``None``) before a call; the call raises :class:`pytest_sparse_mla.Unsupported` with the same
  text, and ``_peer.UnsafeForPeer`` for valid inputs the peer would mishandle out of bounds.

The hooks module (``pytest_sparse_mla.plugin``) calls :func:`configure` from ``pytest_configure``
(the implementation is resolved once, so a bad ``--sparse-mla-impl`` is a usage error before any
test runs; hook implementations therefore belong in a plugin or an initial ``conftest.py``) and
:func:`skip_unservable` from ``pytest_collection_modifyitems`` (``sparse_mla_needs`` markers become
skips). This module imports torch only inside functions (an import string may import whatever its
module imports).
"""

from __future__ import annotations

import importlib
from typing import Any

#: where each public name lives (imported on first use, so importing an adapter module, which
#: imports this package first, imports neither pytest nor the registry).
_HOMES = {
    "ReferenceImplementation": "builtin",
    "TritonImplementation": "builtin",
    "FlashInferImplementation": "flashinfer",
    **dict.fromkeys(
        ("CAPABILITIES", "BUILTINS", "available_implementations", "resolve_implementation", "get_implementation",
         "implementation_name", "declared_envelope", "needs_of", "skip_reason_for", "session_device", "configure",
         "skip_unservable"),
        "registry",
    ),
}  # fmt: skip
__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
