"""Kernels that break their process, to check on a GPU that a crash or a hang costs one test (
``pytest_sparse_mla.device_health``). Not shipped; this machine class (no GPU) only imports it.

Each is the bundled reference (``ReferenceImplementation``: right on every call the suites make),
plus one deliberate fault on the calls that :func:`triggered` selects (``$SPARSE_MLA_CRASH_WHEN``:
``lengths``, the default, the calls that pass ``topk_length``; ``sink``; ``extra``; ``always``), on
CUDA only:

* ``crash_kernels:OutOfBounds``: a Triton kernel that loads every index lane without a mask, 2**36
  elements past the key buffer (the way a kernel that ignores ``topk_length`` reads stale lanes,
  made certain to leave every allocation): CUDA reports an illegal memory access and the process's
  context is dead.
* ``crash_kernels:DeviceAssert``: ``torch.empty(1, device="cuda")[torch.tensor([1 << 40], device="cuda")]``,
  PyTorch's index kernel, whose bound check is a device-side assert (also a dead context).
* ``crash_kernels:ReadsJustPast``: a Triton kernel that loads 1 KiB past the end of the key buffer's storage
  (a row-stride or last-page bound off by a little): no fault, no wrong result (the loaded bytes are
  thrown away), so the suites pass it; only compute-sanitizer memcheck sees the read (the tox lane
  ``sanitizer``; run with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` so that each tensor is its own
  allocation).
* ``crash_kernels:NeverReturns``: a Triton kernel that spins until a flag in device memory turns
  non-zero (nothing ever writes it), then a ``torch.cuda.synchronize()``: the call never returns.

``$SPARSE_MLA_CRASH_LOG``: a file that gets ``<test id>\\t<kernel name>`` for every triggered call
(``PYTEST_CURRENT_TEST``), so the failed tests of a run can be compared with the tests that met the
fault. Run from the repository root, with ``tests`` on ``PYTHONPATH``::

    PYTHONPATH=tests SPARSE_MLA_CRASH_LOG=/tmp/oob.log pytest -p sparse_mla suites -n 4 \\
        --sparse-mla-impl crash_kernels:OutOfBounds --sparse-mla-require-gpu --junitxml /tmp/oob.xml
"""

from __future__ import annotations

import os
from typing import Any

import torch

from pytest_sparse_mla.implementations import ReferenceImplementation

WHEN = "SPARSE_MLA_CRASH_WHEN"
LOG = "SPARSE_MLA_CRASH_LOG"
_WHEN = {
    "lengths": lambda kw: kw.get("topk_length") is not None,
    "sink": lambda kw: kw.get("attn_sink") is not None,
    "extra": lambda kw: kw.get("extra_kv_cache") is not None,
    "always": lambda kw: True,
}


def triggered(q: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """Whether a call breaks the process: on CUDA, when ``$SPARSE_MLA_CRASH_WHEN`` (default
    ``lengths``) selects it.

    Raises:
        ValueError: an unknown ``$SPARSE_MLA_CRASH_WHEN``.
    """
    when = os.environ.get(WHEN, "lengths")
    if when not in _WHEN:
        raise ValueError(f"${WHEN}={when!r}: expected one of {', '.join(_WHEN)}")
    return q.is_cuda and bool(_WHEN[when](kwargs))


def _log(name: str) -> None:
    path = os.environ.get(LOG)
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "<outside a test>").rsplit(" (", 1)[0]
        with open(path, "a", encoding="utf-8") as fh:  # one short write per line: safe across workers
            fh.write(f"{test}\t{name}\n")


_KERNELS: dict[str, Any] = {}


def _triton_kernels() -> dict[str, Any]:
    """The two Triton kernels, compiled on first use (so that importing this module needs no GPU)."""
    if _KERNELS:
        return _KERNELS
    import triton
    import triton.language as tl

    @triton.jit
    def gather_unmasked(src_ptr, idx_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        inside = offs < n
        idx = tl.load(idx_ptr + offs, mask=inside, other=0).to(tl.int64)
        value = tl.load(src_ptr + (idx + (1 << 36)))  # no mask, no bound: far outside the buffer
        tl.store(out_ptr + offs, value, mask=inside)

    @triton.jit
    def spin(flag_ptr, out_ptr):
        value = tl.load(flag_ptr, volatile=True)
        turns = 0
        while value == 0:  # nothing ever writes the flag
            value = tl.load(flag_ptr, volatile=True)
            turns += 1
        tl.store(out_ptr, turns)

    @triton.jit
    def read_past(src_ptr, n, out_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        value = tl.load(src_ptr + n + 1024 + offs)  # 1 KiB past the last byte: no mask
        tl.store(out_ptr + offs, value)

    _KERNELS.update(gather_unmasked=gather_unmasked, spin=spin, read_past=read_past)
    return _KERNELS


class _Breaking(ReferenceImplementation):
    """The bundled reference, with :meth:`_break` after the calls :func:`triggered` selects."""

    name = "crash-kernel"

    def __init__(self) -> None:
        super().__init__(None)

    def sparse_mla_forward(self, q: Any, kv_cache: Any, indices: Any, **kwargs: Any) -> Any:
        result = super().sparse_mla_forward(q, kv_cache, indices, **kwargs)
        if triggered(q, kwargs):
            _log(self.name)
            self._break(q, kv_cache, indices)
        return result

    def _break(self, q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor) -> None:
        raise NotImplementedError


class OutOfBounds(_Breaking):
    """An unmasked Triton load far past the key buffer: an illegal memory access (a dead context)."""

    name = "crash-out-of-bounds"

    def _break(self, q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor) -> None:
        flat = indices.reshape(-1)[:128].contiguous()
        src = kv_cache.reshape(-1)
        out = torch.empty(flat.numel(), dtype=src.dtype, device=src.device)
        _triton_kernels()["gather_unmasked"][(1,)](src, flat, out, flat.numel(), BLOCK=128)


class ReadsJustPast(_Breaking):
    """An unmasked Triton load 1 KiB past the key buffer, its result unused: invisible without a sanitizer."""

    name = "reads-just-past"

    def _break(self, q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor) -> None:
        src = kv_cache.view(torch.uint8)  # a view (a layer of a pool, canaries around): its storage's end
        end = src.untyped_storage().nbytes() - src.storage_offset()
        out = torch.empty(16, dtype=torch.uint8, device=src.device)
        _triton_kernels()["read_past"][(1,)](src, end, out, BLOCK=16)


class DeviceAssert(_Breaking):
    """PyTorch's index kernel on an index 2**40 past a one-element tensor: a device-side assert."""

    name = "crash-device-assert"

    def _break(self, q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor) -> None:
        torch.empty(1, device=q.device)[torch.tensor([1 << 40], device=q.device)]


class NeverReturns(_Breaking):
    """A Triton kernel that spins forever, then a synchronisation: the call never returns."""

    name = "hang-spin"

    def _break(self, q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor) -> None:
        flag = torch.zeros(1, dtype=torch.int32, device=q.device)
        out = torch.zeros(1, dtype=torch.int32, device=q.device)
        _triton_kernels()["spin"][(1,)](flag, out)
        torch.cuda.synchronize(q.device)


__all__ = ["DeviceAssert", "NeverReturns", "OutOfBounds", "ReadsJustPast", "triggered"]
