"""The calls of each test to the implementation under test, recorded for ``--sparse-mla-repro-dir``.

The guard (:mod:`pytest_sparse_mla.guard`) wraps each call of the implementation in
:func:`judged_call`: its arguments are copied to the host before the kernel runs (a kernel that
kills the CUDA context cannot take them with it), its result or error after. A built-in peer adapter
reports the peer function it calls for that call through :func:`record_native` (from
``implementations._peer.call_peer``), so a reproducer can call the peer itself. The plugin turns
recording on per test (:func:`enable`, :func:`begin_test`) only when ``--sparse-mla-repro-dir`` is
given; :mod:`pytest_sparse_mla.repro` writes the standalone reproducers from :func:`recorded_calls`.

State is per process (one test at a time per xdist worker). Imports nothing of the package, and
torch only inside functions, so the adapters may import it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "METADATA",
    "NativeCall",
    "RecordedCall",
    "begin_test",
    "enable",
    "enabled",
    "judged_call",
    "record_native",
    "recorded_calls",
    "note_error",
    "restore_calls",
    "set_result",
]

#: An argument a script computes instead of loading: ``<module>.get_mla_metadata()[0]`` (FlashMLA's
#: scheduler metadata object, which ``torch.save`` with ``weights_only`` cannot hold).
METADATA = {"__module_call__": "get_mla_metadata", "index": 0}


@dataclass
class NativeCall:
    """A peer function call an adapter made (``source`` as ``implementations._peer.call_peer`` takes it,
    arguments snapshotted)."""

    source: dict[str, Any]
    function: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass
class RecordedCall:
    """One call of the implementation under test during a test.

    Attributes:
        args, kwargs: the call's arguments (snapshotted before the call; a ``page_split``'s
            ``registry`` is left out: a reproducer starts from empty buffers).
        expect_error: the argument a deliberately bad call must name (``""``: any; ``None``: a
            judged call).
        capability: ``"sparse_mla_forward"`` or ``"page_split"``.
        output, lse: the result (CPU snapshots), or ``None``.
        error: ``"Type: message"`` of an exception the call raised, or ``None``.
        native: the peer calls the adapter made for it.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    expect_error: str | None = None
    output: Any = None
    lse: Any = None
    error: str | None = None
    native: list[NativeCall] = field(default_factory=list)
    devices: Any = None
    capability: str = "sparse_mla_forward"


_ENABLED = False
_CALLS: list[RecordedCall] = []
_NATIVE: list[NativeCall] | None = None


def enable(flag: bool) -> None:
    """Turn recording on (``--sparse-mla-repro-dir`` given) or off."""
    global _ENABLED
    _ENABLED = bool(flag)


def enabled() -> bool:
    """Whether calls are being recorded."""
    return _ENABLED


def begin_test() -> None:
    """Forget the previous test's calls."""
    _CALLS.clear()


def recorded_calls() -> list[RecordedCall]:
    """The calls of the current test, in order."""
    return list(_CALLS)


def _snapshot(value: Any) -> Any:
    """A copy of ``value`` made now, on the host: tensors keep their whole storage, size, stride
    and offset (a view of a pool stays a view of a copy of that pool); their devices are recorded
    apart (:func:`_devices`). Nothing computes on a device afterwards: the arguments are taken before
    the kernel runs, and a kernel that kills the CUDA context cannot take them with it (the oracle
    of a reproducer runs on these copies). The copy does not trip torch's sync debug mode
    (:func:`_without_sync_check`); inside a CUDA-graph capture the tensor itself is kept."""
    import torch

    if isinstance(value, torch.Tensor):
        if value.device.type == "meta":
            return value
        storage = value.detach().untyped_storage()
        if value.device.type == "cpu":
            host = storage.clone()
        elif value.is_cuda and torch.cuda.is_current_stream_capturing():
            return value  # no copy to the host inside a CUDA-graph capture: the reproducer reads it later
        else:
            host = _without_sync_check(storage.cpu)  # type: ignore[no-untyped-call]
        copy = torch.empty(0, dtype=value.dtype, device="cpu")
        copy.set_(host, value.storage_offset(), value.size(), value.stride())
        return copy
    if isinstance(value, tuple):
        return tuple(_snapshot(v) for v in value)
    if isinstance(value, list):
        return [_snapshot(v) for v in value]
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    return value


def _without_sync_check(copy: Any) -> Any:
    """``copy()`` with torch's sync debug mode off: the recorder's own device-to-host copy is not
    the kernel's synchronisation (a test that sets ``torch.cuda.set_sync_debug_mode("error")``
    judges the kernel's calls, and the mode is back on before the kernel runs)."""
    import torch

    mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_initialized() else 0
    if not mode:
        return copy()
    torch.cuda.set_sync_debug_mode(0)
    try:
        return copy()
    finally:
        torch.cuda.set_sync_debug_mode(mode)


def _devices(value: Any) -> Any:
    """``value``'s structure with each tensor replaced by its device string (``None`` elsewhere)."""
    import torch

    if isinstance(value, torch.Tensor):
        return str(value.device)
    if isinstance(value, (tuple, list)):
        return [_devices(v) for v in value]
    if isinstance(value, dict):
        return {k: _devices(v) for k, v in value.items()}
    return None


def record_native(source: dict[str, Any], function: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Called by a peer adapter just before it calls ``function`` of ``source`` (no-op unless a
    judged call is being recorded). ``args`` may hold :data:`METADATA` in place of an object the
    script rebuilds."""
    if _NATIVE is not None:
        _NATIVE.append(NativeCall(dict(source), function, _snapshot(tuple(args)), _snapshot(dict(kwargs))))


@contextlib.contextmanager
def judged_call(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    expect_error: str | None = None,
    capability: str = "sparse_mla_forward",
) -> Iterator[Any]:
    """Record one call of the implementation (yields the :class:`RecordedCall`, or ``None`` when
    recording is off); an exception leaving the block is recorded and re-raised."""
    global _NATIVE
    if not _ENABLED:
        yield None
        return
    kept = {k: v for k, v in kwargs.items() if k != "registry"}
    rec = RecordedCall(_snapshot(tuple(args)), _snapshot(kept), expect_error=expect_error,
                       devices=_devices({"args": tuple(args), "kwargs": kept}), capability=capability)  # fmt: skip
    _NATIVE = rec.native
    try:
        yield rec
    except BaseException as exc:
        if rec.error is None:  # the implementation's own error, when note_error kept it, stays
            rec.error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        _NATIVE = None
        _CALLS.append(rec)


def note_error(rec: Any, exc: BaseException) -> None:
    """Record the error the implementation raised (``"Type: message"``; no-op for ``None``), before
    the guard turns it into the test's outcome (a peer adapter's ``UnsafeForPeer`` refusal becomes
    a ``pytest.fail``): the reproducer then judges the implementation's error, not pytest's."""
    if rec is not None:
        rec.error = f"{type(exc).__name__}: {exc}"


def set_result(rec: Any, output: Any, lse: Any) -> None:
    """Store a judged call's result in its record (no-op for ``None``)."""
    if rec is not None:
        rec.output, rec.lse = _snapshot(output), _snapshot(lse)


def restore_calls(calls: list[RecordedCall]) -> None:
    """Make ``calls`` the current test's recorded calls (a search run keeps the smallest call of
    each distinct discrepancy it found, and hands them all to the reproducer writer)."""
    _CALLS[:] = list(calls)
