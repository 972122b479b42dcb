"""A kernel that kills the CUDA context, or never returns, costs one test (the logic behind the hooks
in :mod:`pytest_sparse_mla.plugin`).

**The kernel call in flight.** The guard (:mod:`pytest_sparse_mla.guard`) records each call it makes
to the implementation under test (:func:`begin_call` / :func:`end_call`): the implementation's name,
the capability and a one-line summary of the arguments (shapes, dtypes, devices, scalar keywords;
nothing is read from a device). Failure messages name that call: the one that did not return, or
the last one of the test (CUDA runs kernels asynchronously: a kernel that faults or spins usually
shows at a later synchronisation, after its launch returned to Python).

**A dead CUDA context.** A kernel that reads or writes out of bounds (an illegal memory access, a
device-side assert, an unspecified launch failure) leaves the process's CUDA context unusable:
every later CUDA call of that process fails with the same error. After the call phase of every
test (and after a failed setup), in a process where torch is imported and CUDA is already
initialised, :func:`context_fault` synchronises the device; an error that says the context is dead
makes :func:`judge_report` fail that test (an xfailed one too) with a message that names the CUDA
error, the test and the kernel call. Then:

* under pytest-xdist the worker ends itself (:func:`exit_if_dead`: ``os._exit`` at the start of the
  test's teardown, after its setup and call reports went to the controller and before xdist's
  ``runtest_protocol_complete``). xdist sees a crashed worker whose running test is that test,
  reschedules the rest of the worker's queue and starts a fresh worker; on the controller
  :func:`absorb_crash_report` turns xdist's "worker crashed while running" report into that test's
  missing (empty) teardown report, so the terminal totals, JUnit XML and
  ``--sparse-mla-report-json`` count the test once, as failed. xdist replaces at most
  ``--max-worker-restart`` crashed workers (its default: 4 x the number of workers); when that option
  is not given, each of these deliberate exits raises the limit by one, so only real crashes use it.
* without xdist the session stops after that test (``session.shouldstop``); the terminal summary
  ("sparse-mla device faults") and the JSON report say which test broke the context and how many
  of the collected tests ran.

**Hangs.** With pytest-timeout installed and no ``--timeout`` (nor ini ``timeout``,
``PYTEST_TIMEOUT``), :func:`apply_timeouts` gives every item of the shipped suites and every item
that uses the ``sparse_mla_impl`` fixture a ``timeout`` marker: ``--sparse-mla-timeout SECONDS``
(``0``: none), or :func:`default_timeout` (scaled to the device and the case). On CUDA the marker
asks for pytest-timeout's ``thread`` method (unless ``--timeout-method`` or the ini says otherwise):
a kernel that never finishes holds the main thread inside a CUDA synchronisation, where a SIGALRM
handler never runs. That method ends the process; :func:`start_thread_timer` (the
``pytest_timeout_set_timer`` hook) first reports the test as failed with the call that did not
return and the main thread's stack (under xdist, to the controller, which then treats the exit as
above; without xdist, on the terminal, before pytest-timeout ends the session). With the ``signal``
method (the CPU), pytest-timeout fails the test in place and :func:`note_timeout` adds the call to
its message. A limit that ends while the stack is inside a just-in-time build (Triton's compiler or
autotuner, ``ptxas`` started by Triton's backend, TileLang's JIT, ``torch.utils.cpp_extension``;
:func:`compiling_in`) says so instead ("the time limit ended inside Triton's autotuner compiling for
a new shape: ..."): that time is compilation, not the kernel's run; a caller warms the kernel on a
new shape outside the limited call (:func:`pytest_sparse_mla.search_speed.warm`).

**Out of device memory.** An allocation the GPU cannot satisfy (``torch.OutOfMemoryError``, a CUDA
runtime or Triton "out of memory") says nothing about the kernel's numbers: on a GPU that several
xdist workers (or other jobs) share, it is usually another process's cached memory. The guard makes
each kernel call through :func:`with_memory_retries`: on such an error it releases this process's
cached blocks (``gc``, ``torch.cuda.empty_cache``) and makes the call again, after
:data:`MEMORY_RETRY_DELAYS`; when every try fails it raises :class:`OutOfDeviceMemory`, whose message
names the device's free and total memory and says that this is an environment condition.
:func:`judge_report` then keeps the test failed, never xfailed (an xfail entry is a claim about the
kernel), with a fault record of kind ``"out-of-memory"`` in the session summary and the JSON report;
the search (:mod:`pytest_sparse_mla.search_run`) counts such a call as not made instead of as a
discrepancy.

State is per process (one test at a time per process, as in :mod:`pytest_sparse_mla.recording`). Nothing
here imports torch; :func:`context_fault` uses torch only when the process already imported it and
initialised CUDA.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import pytest

from pytest_sparse_mla import sanitizer

__all__ = [
    "BASE_SECONDS",
    "FAULT_KEY",
    "KernelCall",
    "MEMORY_RETRY_DELAYS",
    "OutOfDeviceMemory",
    "absorb_crash_report",
    "COMPILE_SECONDS",
    "apply_timeouts",
    "begin_call",
    "begin_test",
    "call_summary",
    "compiling_in",
    "context_error_of",
    "context_fault",
    "controller_start",
    "default_timeout",
    "end_call",
    "exit_if_dead",
    "fault_entries",
    "is_context_error",
    "is_out_of_memory",
    "says_out_of_memory",
    "judge_report",
    "last_call",
    "note_timeout",
    "untimed",
    "observe",
    "release_device_memory",
    "start_thread_timer",
    "summary_lines",
    "with_memory_retries",
]

#: ``user_properties`` key of a report whose test broke the CUDA context or timed out: a dict with
#: ``kind`` (``"dead-cuda-context"`` / ``"timeout"`` / ``"sanitizer"``: an access compute-sanitizer
#: reported, the context still usable / ``"out-of-memory"``: an environment condition), ``headline``,
#: ``message``, ``exits`` (the process ends after this report) and ``call`` (the kernel call, or ``None``).
FAULT_KEY = "sparse_mla_device_fault"
#: Exit status of a worker that ends itself after a dead CUDA context.
WORKER_EXIT_STATUS = 70
#: The default time limit per test, in seconds, by device: a CUDA test may JIT-compile several
#: Triton kernels on first use (tens of seconds each on a cold cache); the CPU interprets Triton.
BASE_SECONDS = {"cuda": 120.0, "cpu": 600.0}
#: Factors of :func:`default_timeout`: a ``large`` attention case (CUDA-sized); a Hypothesis test
#: (the suites run 40 examples).
LARGE_CASE_FACTOR = 3.0
HYPOTHESIS_FACTOR = 3.0
#: The limit of one warm-up inside :func:`untimed`, in seconds: a Triton autotuner benchmarking
#: every configuration of several kernels for one new shape (ptxas for each) takes tens of seconds on
#: an H200; ten minutes is a hang.
COMPILE_SECONDS = 600.0

#: Text of a CUDA error after which the context is unusable (torch.AcceleratorError / RuntimeError).
_DEAD_CONTEXT = re.compile(
    r"illegal memory access|device-side assert|unspecified launch failure|misaligned address|"
    r"illegal instruction|an illegal|launch timed out|CUDA error|CUDA driver error|cudaError|CUresult",
    re.IGNORECASE,
)
#: pytest-timeout's failure message (``PYTEST_FAILURE_MESSAGE``: "Timeout (>%ss) from pytest-timeout.").
_TIMEOUT_MESSAGE = re.compile(r"Timeout \(>[0-9.e+-]+s\) from pytest-timeout\.")
_POSITIONAL = {"sparse_mla_forward": ("q", "kv_cache", "indices"), "page_split": ("kv_cache",)}


#: An allocation the device could not satisfy: torch's ``OutOfMemoryError`` ("CUDA out of memory"),
#: the runtime's ``cudaErrorMemoryAllocation`` ("CUDA error: out of memory", raised as
#: ``torch.AcceleratorError``), the driver's ``CUDA_ERROR_OUT_OF_MEMORY`` (Triton: "Triton Error [CUDA]:
#: out of memory").
_OUT_OF_MEMORY = re.compile(r"out of memory|cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY", re.IGNORECASE)
#: Seconds waited before each further try of a call that ran out of device memory (two more tries).
MEMORY_RETRY_DELAYS = (1.0, 4.0)


class OutOfDeviceMemory(pytest.fail.Exception):  # type: ignore[misc,name-defined]
    """A kernel call that ran out of device memory on every try (:func:`with_memory_retries`): an
    environment condition, not a verdict on the kernel (module docstring)."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg, pytrace=False)


def is_out_of_memory(exc: BaseException | None) -> bool:
    """Whether ``exc`` (any exception, or ``None``) says the device ran out of memory
    (:data:`_OUT_OF_MEMORY`, or :class:`OutOfDeviceMemory`)."""
    if exc is None:
        return False
    if isinstance(exc, OutOfDeviceMemory) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, Exception) and says_out_of_memory(f"{type(exc).__name__}: {exc}")


def says_out_of_memory(text: str) -> bool:
    """Whether ``text`` (an error message, or a process's output) says the device ran out of memory
    (:data:`_OUT_OF_MEMORY`): torch's, the CUDA runtime's or Triton's words for it."""
    return bool(_OUT_OF_MEMORY.search(text))


def release_device_memory() -> str:
    """Free what this process holds but no longer uses (``gc.collect()``, ``torch.cuda.empty_cache()``)
    and describe the device's memory: ``"12.3 GiB free of 79.2 GiB on cuda:0"``, or ``"device memory
    unknown"`` when torch or CUDA is not initialised in this process. Never raises."""
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    cuda: Any = getattr(torch, "cuda", None)
    try:
        if cuda is None or not cuda.is_initialized():
            return "device memory unknown"
        cuda.empty_cache()
        free, total = cuda.mem_get_info()
        return f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB on cuda:{cuda.current_device()}"
    except Exception:  # noqa: BLE001 - a description only
        return "device memory unknown"


def with_memory_retries(make_call: Any, what: str) -> Any:
    """``make_call()``, made again after :func:`release_device_memory` and each delay of
    :data:`MEMORY_RETRY_DELAYS` while it raises an out-of-memory error (:func:`is_out_of_memory`).

    Args:
        make_call: a function of no arguments (the kernel call).
        what: the call, for the message (``"flashmla.sparse_mla_forward"``).

    Raises:
        OutOfDeviceMemory: every try ran out of device memory; the message names ``what``, the tries,
            the last error and the device's memory after releasing this process's cache.
        Exception: any other error of ``make_call``, unchanged.
    """
    tries = len(MEMORY_RETRY_DELAYS) + 1
    for attempt in range(tries):
        try:
            return make_call()
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            memory = release_device_memory()
            if attempt == tries - 1:
                error = _first_line(f"{type(exc).__name__}: {exc}")
                raise OutOfDeviceMemory(
                    f"out of device memory: {what} failed on all {tries} tries ({error}); "
                    f"after releasing this process's cache: {memory}. An environment condition, not a verdict on the "
                    "kernel: other processes (xdist workers sharing the GPU, other jobs) held the memory, or the call "
                    "needs more than the device has; rerun with fewer workers per GPU"
                ) from exc
            time.sleep(MEMORY_RETRY_DELAYS[attempt])
    raise AssertionError("unreachable")


def _is_timeout(exc: BaseException | None) -> TypeGuard[pytest.fail.Exception]:  # type: ignore[name-defined]
    """Whether ``exc`` is pytest-timeout's failure (its ``signal`` method's ``pytest.fail``)."""
    return isinstance(exc, pytest.fail.Exception) and bool(_TIMEOUT_MESSAGE.match(str(exc.msg)))


def _failure(msg: str) -> pytest.fail.Exception:  # type: ignore[name-defined]
    """The failure the plugin states itself (no traceback: ``pytest.fail(msg, pytrace=False)``)."""
    return pytest.fail.Exception(msg, pytrace=False)


@dataclass
class KernelCall:
    """One call of the implementation under test, as the guard made it.

    Attributes:
        impl: the implementation's name.
        capability: ``"sparse_mla_forward"`` or ``"page_split"``.
        summary: the arguments in one line (:func:`call_summary`).
        cuda_devices: indices of the CUDA devices its tensors live on.
        started: ``time.monotonic()`` at the call, in seconds.
        returned: the call came back to Python (with a result or an exception).
    """

    impl: str
    capability: str
    summary: str
    cuda_devices: tuple[int, ...] = ()
    started: float = field(default_factory=time.monotonic)
    returned: bool = False

    def describe(self) -> str:
        """``impl.capability(arguments)`` and whether it returned (one line)."""
        head = f"{self.impl}.{self.capability}({self.summary})"
        if not self.returned:
            return f"{head}, not returned after {time.monotonic() - self.started:.1f} s"
        return f"{head}, returned to Python (CUDA reports a kernel's fault or hang at a later synchronisation)"


_LAST: KernelCall | None = None
_LAST_PHASE: str | None = None  # the phase of the current test whose report was made last


def begin_test() -> None:
    """Forget the previous test's kernel call and mark where the sanitizer log ends (called when a
    test's setup starts)."""
    global _LAST, _LAST_PHASE
    _LAST, _LAST_PHASE = None, None
    sanitizer.begin_test()


def last_call() -> KernelCall | None:
    """The current test's last (or running) call of the implementation, or ``None``."""
    return _LAST


def _describe_value(value: Any) -> str:
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{list(shape)} {str(dtype).removeprefix('torch.')} {getattr(value, 'device', '')}".rstrip()
    if value is None or isinstance(value, (bool, int, float, str)):
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__


def call_summary(capability: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The arguments of a call in one line: each tensor as ``name=[shape] dtype device``, scalars by
    ``repr`` (cut at 40 characters), ``None`` keywords left out. Reads only attributes (no device
    access, no synchronisation)."""
    names = _POSITIONAL.get(capability, ())
    parts = [f"{names[i] if i < len(names) else f'arg{i}'}={_describe_value(v)}" for i, v in enumerate(args)]
    parts += [f"{k}={_describe_value(v)}" for k, v in kwargs.items() if v is not None]
    return ", ".join(parts)


def _cuda_devices(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...]:
    found: set[int] = set()
    for value in (*args, *kwargs.values()):
        device = getattr(value, "device", None)
        index = getattr(device, "index", None)
        if getattr(device, "type", None) == "cuda" and index is not None:
            found.add(int(index))
    return tuple(sorted(found))


def begin_call(impl: str, capability: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> KernelCall:
    """Record that the guard is about to call ``impl``'s ``capability`` with these arguments (the
    call in flight until :func:`end_call`)."""
    global _LAST
    _LAST = KernelCall(impl, capability, call_summary(capability, args, kwargs), _cuda_devices(args, kwargs))
    return _LAST


def end_call(call: KernelCall) -> None:
    """Record that ``call`` came back to Python (with a result or an exception). Called from the
    guard's ``finally``: pytest-timeout's failure raised inside the call (its ``signal`` method)
    leaves the call in flight, since the kernel never returned by itself."""
    exc = sys.exc_info()[1]
    if _is_timeout(exc):
        return
    call.returned = True


# --- the CUDA context ---------------------------------------------------------------------------


def is_context_error(text: str) -> bool:
    """Whether an error's text (``"Type: message"``) says the CUDA context is unusable (an illegal
    memory access, a device-side assert, an unspecified launch failure, any ``CUDA error``)."""
    return bool(_DEAD_CONTEXT.search(text))


def context_fault(devices: tuple[int, ...] = ()) -> str | None:
    """The error (``"Type: message"``) that synchronising the CUDA devices raises when this
    process's CUDA context is dead, else ``None``.

    ``None`` at once, touching nothing, when torch is not imported or CUDA is not initialised in
    this process (``torch.cuda.is_initialized()``). Otherwise synchronises the current device and
    ``devices`` (indices; those the last kernel call used). Errors whose text does not say the
    context is dead (:func:`is_context_error`), and errors that a second synchronisation no longer
    raises (not sticky: the context still works), are not faults and yield ``None``. Never raises.
    """
    torch = sys.modules.get("torch")
    cuda: Any = getattr(torch, "cuda", None)
    try:
        if cuda is None or not cuda.is_initialized():
            return None
        cuda.synchronize()
        for index in devices:
            cuda.synchronize(index)
    except Exception as exc:  # noqa: BLE001 - torch.AcceleratorError (a RuntimeError) and kin
        text = f"{type(exc).__name__}: {exc}".strip()
        if not is_context_error(text):
            return None
        try:  # a dead context fails every call alike; an error reported once (not sticky) is gone now
            cuda.synchronize()
        except Exception:  # noqa: BLE001
            return text
    return None


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def _failure_text(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    return str(getattr(crash, "message", None) or report.longrepr or "")


def _is_worker(config: pytest.Config) -> bool:
    return getattr(config, "workerinput", None) is not None


def _repr(item: pytest.Item, exc: pytest.fail.Exception) -> Any:  # type: ignore[name-defined]
    """``item``'s failure representation of ``exc`` (raised here, so that it has a traceback)."""
    try:
        raise exc
    except pytest.fail.Exception:
        excinfo = pytest.ExceptionInfo.from_current()
    try:
        return item.repr_failure(excinfo)
    except Exception:  # noqa: BLE001 - an item type with its own repr_failure: the text itself
        return str(exc.msg)


def judge_report(item: pytest.Item, call: pytest.CallInfo[Any], report: pytest.TestReport) -> None:
    """After a phase's report is made (``pytest_runtest_makereport``): check the CUDA context after
    the call phase and after a failed setup; a dead one fails the test (xfail or not) with a
    message that names the CUDA error, the test and the kernel call (the test's own failure kept as
    a report section) and, without xdist, stops the session. A pytest-timeout failure gets the
    fault record of a timeout. A teardown that fails with a CUDA error after the context died is
    not a second failure: its text becomes a section of a passed teardown report."""
    global _LAST_PHASE
    _LAST_PHASE = report.when
    record = item.stash.get(_FAULT, None)
    if report.when == "teardown":
        if record is not None and report.failed and is_context_error(_failure_text(report)):
            report.sections.append(("teardown after the dead CUDA context", str(report.longrepr)))
            report.outcome, report.longrepr = "passed", None
        return
    if record is not None or (report.when == "setup" and not report.failed):
        return
    exc = call.excinfo.value if call.excinfo is not None else None
    if _is_timeout(exc):
        report.user_properties.append((FAULT_KEY, _record("timeout", _first_line(str(exc.msg)), str(exc.msg), False)))
    elif report.when == "call" and is_out_of_memory(exc):  # an environment condition: never the expected failure
        headline = _first_line(f"{type(exc).__name__}: {exc}")
        if not isinstance(exc, OutOfDeviceMemory):
            headline = f"out of device memory in the test's own CUDA work: {headline}"
        report.user_properties.append((FAULT_KEY, _record("out-of-memory", headline, str(exc), False)))
        if hasattr(report, "wasxfail"):
            del report.wasxfail
            report.outcome = "failed"
    error = context_fault(_LAST.cuda_devices if _LAST is not None else ())
    access = sanitizer.first_error()
    if error is None and access is None:
        return
    kernel = _LAST.describe() if _LAST is not None else None
    last = f"; last kernel call: {_LAST.impl}.{_LAST.capability}({_LAST.summary})" if _LAST is not None else ""
    worker = _is_worker(item.config)
    if error is None:
        kind, exits = "sanitizer", False
        headline = f"compute-sanitizer memcheck: {_first_line(access or '')}{last}"
        then = "the CUDA context is still usable: the run goes on in this process"
    else:
        kind, exits = "dead-cuda-context", worker
        headline = f"dead CUDA context after this test: {_first_line(error)}{last}"
        then = (
            "this xdist worker exits now and pytest-xdist starts a fresh one for the remaining tests"
            if worker
            else "the session stops after this test: every later CUDA call of this process would fail alike"
        )
    lines = [headline, f"test: {item.nodeid}"]
    if error is not None:
        lines.append(f"error: {error.strip()}")
    if access is not None:
        lines.append("first access compute-sanitizer reported in this test:\n  " + access.replace("\n", "\n  "))
    lines += [
        f"kernel call: {kernel}"
        if kernel
        else "kernel call: none through the guard in this test (the fault came from the test's own CUDA work, "
        "or from asynchronous work an earlier call left running)",
        then,
    ]
    if report.failed:
        lines.append(f"the test's own failure (full text in the section below): {_first_line(_failure_text(report))}")
        report.sections.append(("the test's own failure before the device check", str(report.longrepr)))
    message = "\n".join(lines)
    record = {**_record(kind, headline, message, exits, kernel), "error": _first_line(error or access or "")}
    item.stash[_FAULT] = record
    report.outcome = "failed"
    if hasattr(report, "wasxfail"):
        del report.wasxfail  # a crash or an out-of-bounds access is never the expected failure
    report.longrepr = _repr(item, _failure(message))
    report.user_properties.append((FAULT_KEY, record))
    if error is not None and not worker:
        item.session.shouldstop = f"sparse-mla: {headline} ({item.nodeid})"


_FAULT = pytest.StashKey[dict[str, Any]]()


def _record(kind: str, headline: str, message: str, exits: bool, call: str | None = None) -> dict[str, Any]:
    if call is None and _LAST is not None:
        call = _LAST.describe()
    return {"kind": kind, "headline": headline, "message": message, "exits": exits, "call": call}


def context_error_of(report: pytest.TestReport) -> str | None:
    """The CUDA error (first line) of a report whose test left the context dead, else ``None``."""
    for key, value in report.user_properties:
        if key == FAULT_KEY and isinstance(value, dict) and value.get("kind") == "dead-cuda-context":
            return str(value.get("error") or "CUDA context dead")
    return None


def exit_if_dead(item: pytest.Item) -> None:
    """At the start of a test's teardown: an xdist worker whose CUDA context this test killed
    ends itself now (``os._exit``), before the fixtures are torn down and before xdist marks the test
    complete, so the controller reschedules the rest of its queue on a fresh worker (module
    docstring). Nothing happens outside xdist or after a healthy test."""
    record = item.stash.get(_FAULT, None)
    if record is None or not record.get("exits") or not _is_worker(item.config):
        return
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001, S110 - a closed or captured stream: nothing to keep
            pass
    os._exit(WORKER_EXIT_STATUS)


# --- hangs: pytest-timeout ------------------------------------------------------------------------


def note_timeout(call: pytest.CallInfo[Any]) -> None:
    """Before a phase's report is made: a pytest-timeout failure (its ``signal`` method raises
    ``pytest.fail("Timeout (>Ns) from pytest-timeout.")`` inside the test) gets the kernel call that
    did not return (or the test's last one) appended to its first line."""
    exc = call.excinfo.value if call.excinfo is not None else None
    if not _is_timeout(exc):
        return
    if "kernel call" in str(exc.msg) or "the time limit ended inside" in str(exc.msg):
        return
    compiling = compiling_in(_traceback_frames(call.excinfo.tb if call.excinfo is not None else None))
    note = _kernel_words(compiling)
    exc.msg = f"{exc.msg} {note[0].upper()}{note[1:]}"


# --- a limit that ends inside a compiler -----------------------------------------------------------

#: ``(path fragment, function names or None for any, words)``, checked innermost frame first: the
#: frames of a just-in-time build. A limit that ends inside one ended while a kernel was being
#: compiled or tuned for a new shape, not while it ran. Paths use ``/`` (a backslash is replaced first).
_COMPILERS: tuple[tuple[str, tuple[str, ...] | None, str], ...] = (
    ("torch/utils/cpp_extension.py", None, "a torch.utils.cpp_extension JIT build (a C++/CUDA extension compiling)"),
    ("/tilelang/", ("compile", "lower", "build", "jit", "_compile", "compile_and_load"), "TileLang's JIT build"),
    ("/tilelang/jit/", None, "TileLang's JIT build"),
    ("/tilelang/engine/", None, "TileLang's JIT build"),
    ("triton/backends/", ("make_cubin", "make_ptx", "make_llir", "make_ttgir", "make_ttir", "make_amdgcn",
                          "make_hsaco"), "Triton's compiler"),  # fmt: skip
    ("triton/compiler/", None, "Triton's compiler"),
    ("triton/runtime/jit.py", ("_do_compile", "compile", "warmup"), "Triton's compiler"),
    ("triton/runtime/build.py", None, "Triton's compiler (building its launcher)"),
)


def _traceback_frames(tb: Any) -> list[Any]:
    """The frames of a traceback, outermost first."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def compiling_in(frames: list[Any]) -> str | None:
    """Whether a stack (frame objects or ``traceback.FrameSummary`` s, outermost first) is inside a
    just-in-time build, and which, in words: ``"Triton's autotuner compiling for a new shape"``
    (frames under ``triton/runtime/autotuner.py`` with a compiler frame inside),
    ``"Triton's autotuner benchmarking configurations for a new shape"`` (the autotuner without one),
    ``"Triton's compiler compiling a kernel for a new shape"`` (``triton/compiler``, the backends'
    ``make_*`` stages, ``triton/runtime/jit.py``'s compile), with ``", waiting for ptxas"`` when the
    innermost frames are a subprocess started from the backend, ``"TileLang's JIT build"``,
    ``"a torch.utils.cpp_extension JIT build ..."``; ``None`` otherwise.
    """
    paths: list[tuple[str, str]] = []
    for f in frames:
        if isinstance(f, traceback.FrameSummary):
            paths.append((f.filename.replace("\\", "/"), f.name))
        else:
            paths.append((f.f_code.co_filename.replace("\\", "/"), f.f_code.co_name))
    found: str | None = None
    at = -1
    for i in range(len(paths) - 1, -1, -1):  # innermost first
        path, name = paths[i]
        for fragment, names, words in _COMPILERS:
            if fragment in path and (names is None or name in names):
                found, at = words, i
                break
        if found:
            break
    tuner = any("triton/runtime/autotuner.py" in path for path, _ in paths)
    if found is None:
        return "Triton's autotuner benchmarking configurations for a new shape" if tuner else None
    if not found.startswith("Triton"):
        return found
    inner = paths[at + 1 :]
    ptxas = any(path.endswith("subprocess.py") for path, _ in inner)
    what = "Triton's autotuner compiling for a new shape"
    if not tuner:
        what = "Triton's compiler compiling a kernel for a new shape"
    if found != "Triton's compiler":
        what += f" ({found.split('(', 1)[1]}" if "(" in found else ""
    return what + (", waiting for ptxas (a subprocess)" if ptxas else "")


def _kernel_words(compiling: str | None) -> str:
    """What a timeout message says of the kernel call: the call that did not return, the test's
    last call, or that the limit ended inside a compiler (``compiling``, :func:`compiling_in`)."""
    if compiling is not None:
        call = (f"the kernel call in flight: {_LAST.describe()}" if _LAST is not None and not _LAST.returned
                else "no kernel call through the guard in flight")  # fmt: skip
        return (f"the time limit ended inside {compiling}: compile and autotune time is not the kernel's run "
                f"time (warm the kernel on this shape before the limited call: "
                f"pytest_sparse_mla.search_speed.warm); {call}")  # fmt: skip
    if _LAST is None:
        return "no kernel call through the guard in this test"
    what = "the kernel call that did not return" if not _LAST.returned else "last kernel call"
    return f"{what}: {_LAST.describe()}"


def _main_stack(limit: int = 12) -> str:
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    return "".join(traceback.format_stack(frame, limit=limit)) if frame is not None else ""


def _main_frames() -> list[Any]:
    """The main thread's frames, outermost first."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    return [f for f, _ in traceback.walk_stack(frame)][::-1] if frame is not None else []


def _timeout_message(item: pytest.Item, seconds: float) -> str:
    kernel = _kernel_words(compiling_in(_main_frames()))
    if getattr(item, "_sparse_mla_warming", False):
        kernel = f"while warming the kernel on a new shape (a limit of its own, not the test's): {kernel}"
    worker = _is_worker(item.config)
    then = (
        "this xdist worker exits (pytest-timeout, thread method) and pytest-xdist starts a fresh one"
        if worker
        else "pytest-timeout (thread method) ends this pytest process now: run under pytest-xdist (-n) so a "
        "hang costs one test"
    )
    stack = _main_stack()
    return "\n".join(
        [f"Timeout (>{seconds:g}s) from pytest-timeout: {kernel}", f"test: {item.nodeid}", then]
        + ([f"main thread's stack when the time ran out (innermost last):\n{stack.rstrip()}"] if stack else [])
    )


def _on_thread_timeout(item: pytest.Item, settings: Any) -> None:
    """The timer of :func:`start_thread_timer`: report the test as failed, then let pytest-timeout
    dump the stacks and end the process (``pytest_timeout.timeout_timer``)."""
    import pytest_timeout

    if not settings.disable_debugger_detection and pytest_timeout.is_debugging():
        return
    try:
        message = _timeout_message(item, settings.timeout)
        if _is_worker(item.config):
            when = {None: "setup", "setup": "call"}.get(_LAST_PHASE)
            if when is not None:  # a hang in teardown is left to xdist's own crash report
                report = pytest.TestReport(
                    nodeid=item.nodeid,
                    location=item.location,
                    keywords=dict.fromkeys(item.keywords, 1),
                    outcome="failed",
                    longrepr=_repr(item, _failure(message)),
                    when=when,  # type: ignore[arg-type]
                    duration=float(settings.timeout),
                    user_properties=[
                        *item.user_properties,
                        (FAULT_KEY, _record("timeout", _first_line(message), message, True)),
                    ],
                )
                item.ihook.pytest_runtest_logreport(report=report)
        else:
            writer = item.config.get_terminal_writer()
            writer.line("")
            writer.sep("!", "sparse-mla: a test timed out", red=True)
            writer.line(message)
            writer.flush()
    except Exception:  # noqa: BLE001 - pytest-timeout must still end the hang
        traceback.print_exc()
    pytest_timeout.timeout_timer(item, settings)


@dataclass
class _TimerState:
    """The thread timer of the test running in this process: its settings (``timeout``: the whole
    limit), the seconds it had left when it was (re)started, and when."""

    settings: Any
    left: float
    started: float = field(default_factory=time.monotonic)


def _arm(item: pytest.Item, settings: Any, seconds: float, warming: bool = False) -> None:
    """Start a timer of ``seconds`` that reports ``item`` as timed out (:func:`_on_thread_timeout`,
    with ``settings``) and set ``item.cancel_timeout``, which pytest-timeout's cancel hook calls."""
    timer = threading.Timer(seconds, _on_thread_timeout, (item, settings))
    timer.name = f"pytest_timeout {item.nodeid}"
    timer.daemon = True

    def cancel() -> None:
        timer.cancel()
        if timer is not threading.current_thread():
            timer.join()

    item.cancel_timeout = cancel  # type: ignore[attr-defined]  # pytest-timeout's cancel hook calls it
    item._sparse_mla_warming = warming  # type: ignore[attr-defined]
    if not warming:
        item._sparse_mla_timer = _TimerState(settings, seconds)  # type: ignore[attr-defined]
    timer.start()


def start_thread_timer(item: pytest.Item, settings: Any) -> bool | None:
    """``pytest_timeout_set_timer`` for the ``thread`` method (also the ``signal`` method outside
    the main thread, where pytest-timeout uses a thread too): pytest-timeout's timer with
    :func:`_on_thread_timeout` in front of its own ``timeout_timer``; ``item.cancel_timeout``
    cancels it as pytest-timeout's does. Returns ``True`` (the timer is set) or ``None`` for the
    ``signal`` method in the main thread (pytest-timeout's own SIGALRM timer then runs)."""
    if settings.method == "signal" and threading.current_thread() is threading.main_thread():
        return None
    _arm(item, settings, settings.timeout)
    return True


def is_timed(item: pytest.Item) -> bool:
    """Whether ``item`` runs under this module's thread timer (:func:`start_thread_timer`): only then
    does :func:`untimed` keep time out of its limit."""
    return getattr(item, "_sparse_mla_timer", None) is not None and getattr(item, "cancel_timeout", None) is not None


@contextmanager
def untimed(item: pytest.Item, limit: float | None = None) -> Iterator[None]:
    """Time spent inside is not ``item``'s: its thread timer (:func:`start_thread_timer`) stops, a
    limit of ``limit`` seconds (default :data:`COMPILE_SECONDS`, times ``sanitizer.TIMEOUT_FACTOR``
    under compute-sanitizer) runs instead, and on leaving the test's timer resumes with the seconds
    it had left (module docstring). A no-op when the test has no thread timer (the ``signal``
    method, no pytest-timeout, no limit).

    A warm-up that runs past ``limit`` is reported as a timeout "while warming", with what the main
    thread was compiling (:func:`compiling_in`)."""
    state = getattr(item, "_sparse_mla_timer", None)
    cancel = getattr(item, "cancel_timeout", None)
    if state is None or cancel is None or getattr(item, "_sparse_mla_warming", False):
        yield
        return
    cancel()
    left = max(state.left - (time.monotonic() - state.started), 0.0)
    if limit is None:
        limit = COMPILE_SECONDS * (sanitizer.TIMEOUT_FACTOR if sanitizer.active() else 1.0)
    _arm(item, state.settings._replace(timeout=limit), limit, warming=True)
    try:
        yield
    finally:
        item.cancel_timeout()  # type: ignore[attr-defined]
        _arm(item, state.settings, max(left, 0.001))


def _case_of(item: pytest.Item) -> Any:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("case") if callspec is not None else None


def default_timeout(item: pytest.Item, device: str) -> float:
    """The default time limit of ``item`` in seconds: :data:`BASE_SECONDS` of ``device`` (``"cuda"``
    or ``"cpu"``), times :data:`LARGE_CASE_FACTOR` for a ``large`` attention case and
    :data:`HYPOTHESIS_FACTOR` for a Hypothesis test, times ``sanitizer.TIMEOUT_FACTOR`` under
    compute-sanitizer."""
    seconds = BASE_SECONDS["cuda" if device == "cuda" else "cpu"]
    if getattr(_case_of(item), "large", False):
        seconds *= LARGE_CASE_FACTOR
    if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
        seconds *= HYPOTHESIS_FACTOR
    if sanitizer.active():
        seconds *= sanitizer.TIMEOUT_FACTOR
    return seconds


def _user_timeout(config: pytest.Config) -> bool:
    """Whether the session set pytest-timeout's limit itself (``--timeout``, ``PYTEST_TIMEOUT``, ini)."""
    if config.getoption("timeout", None) is not None or os.environ.get("PYTEST_TIMEOUT"):
        return True
    try:
        return bool(config.getini("timeout"))
    except ValueError:
        return False


def _user_method(config: pytest.Config) -> bool:
    if config.getoption("timeout_method", None) is not None:
        return True
    try:
        return bool(config.getini("timeout_method"))
    except ValueError:
        return False


def apply_timeouts(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give each item of the shipped suites, and each item using the ``sparse_mla_impl`` fixture,
    pytest-timeout's ``timeout`` marker (module docstring): ``--sparse-mla-timeout`` seconds, or
    :func:`default_timeout`; ``method="thread"`` on CUDA unless the session chose a method. Nothing
    when the session set ``--timeout`` (or ini ``timeout``, ``PYTEST_TIMEOUT``), when
    ``--sparse-mla-timeout 0``, or when pytest-timeout is not loaded; an item's own ``timeout``
    marker is kept.

    Raises:
        pytest.UsageError: ``--sparse-mla-timeout`` given while pytest-timeout is not loaded.
    """
    from pytest_sparse_mla import options, selection

    opts = options.get_options(config)
    if not config.pluginmanager.hasplugin("timeout"):
        if opts.timeout_given:
            raise pytest.UsageError(
                "--sparse-mla-timeout needs pytest-timeout (pip install pytest-timeout; it is in the test extra), "
                "which is not installed or was turned off with -p no:timeout"
            )
        return
    if opts.timeout == 0 or _user_timeout(config):
        return
    suite = {id(item) for item in selection.shipped_suite_items(items)}
    chosen = [
        item
        for item in items
        if (id(item) in suite or "sparse_mla_impl" in getattr(item, "fixturenames", ()))
        and item.get_closest_marker("timeout") is None
    ]
    if not chosen:
        return
    from pytest_sparse_mla import capabilities

    device = opts.device
    if device == "auto":
        device = "cuda" if capabilities.probe().cuda_available else "cpu"
    method = {} if _user_method(config) or device != "cuda" else {"method": "thread"}
    for item in chosen:
        seconds = opts.timeout if opts.timeout is not None else default_timeout(item, device)
        item.add_marker(pytest.mark.timeout(seconds, **method))


# --- the controller: faults, xdist's crash reports, the summary -----------------------------------


@dataclass
class _Faults:
    session: pytest.Session | None = None
    entries: list[dict[str, Any]] = field(default_factory=list)
    exiting: dict[str, dict[str, Any]] = field(default_factory=dict)  # worker id -> its fault
    seen: set[str] = field(default_factory=set)


_CONTROLLER = pytest.StashKey[_Faults]()


def _faults(config: pytest.Config) -> _Faults:
    if _CONTROLLER not in config.stash:
        config.stash[_CONTROLLER] = _Faults()
    return config.stash[_CONTROLLER]


def controller_start(config: pytest.Config, session: pytest.Session) -> None:
    """Controller (or a run without xdist), at session start: keep the session (its counts)."""
    _faults(config).session = session


def _worker_of(report: Any) -> str | None:
    node = getattr(report, "node", None)
    gateway_id = getattr(getattr(node, "gateway", None), "id", None)
    return str(gateway_id) if gateway_id is not None else getattr(report, "worker_id", None)


def observe(config: pytest.Config, report: pytest.TestReport) -> None:
    """Controller, every test report: keep the faults (:data:`FAULT_KEY`), and note the worker that
    is about to exit after one."""
    state = _faults(config)
    state.seen.add(report.nodeid)
    for key, value in report.user_properties:
        if key != FAULT_KEY or not isinstance(value, dict):
            continue
        worker = _worker_of(report)
        entry = {
            "nodeid": report.nodeid,
            "kind": value.get("kind"),
            "headline": value.get("headline"),
            "message": value.get("message"),
            "call": value.get("call"),
            "worker": worker,
            "action": None,
        }
        state.entries.append(entry)
        if value.get("exits") and worker is not None:
            props = [(k, v) for k, v in report.user_properties if k != FAULT_KEY]
            state.exiting[worker] = {"entry": entry, "user_properties": props}
        elif not value.get("exits") and value.get("kind") == "timeout":
            entry["action"] = "the test failed in place (pytest-timeout, signal method)"
        elif value.get("kind") == "out-of-memory":
            entry["action"] = (
                "the test failed in place: out of device memory, an environment condition (not a verdict on the "
                "kernel); rerun it with fewer workers per GPU"
            )
        elif value.get("kind") == "sanitizer":
            entry["action"] = "the test failed in place (compute-sanitizer memcheck; the CUDA context stayed usable)"


def absorb_crash_report(config: pytest.Config, crashitem: str, report: pytest.TestReport) -> bool:
    """Controller (``pytest_handlecrashitem``): when the crashed worker is one that ended itself
    after reporting ``crashitem`` as broken, turn xdist's "worker crashed" report into that test's
    teardown report (passed, empty: the failure was already reported, so totals, JUnit and the
    JSON report count the test once) and, when ``--max-worker-restart`` was not given, raise
    xdist's restart limit by one (this exit is not a crash). Returns whether it did."""
    state = _faults(config)
    worker = _worker_of(report)
    pending = state.exiting.get(worker) if worker is not None else None
    if worker is None or pending is None or pending["entry"]["nodeid"] != crashitem:
        return False
    del state.exiting[worker]
    report.outcome = "passed"
    report.when = "teardown"
    report.longrepr = None
    report.sections = []
    report.user_properties = list(pending["user_properties"])
    pending["entry"]["action"] = f"worker {worker} exited; pytest-xdist rescheduled its queue on a fresh worker"
    dsession = config.pluginmanager.getplugin("dsession")
    limit = getattr(dsession, "_max_worker_restart", None)
    if config.getoption("maxworkerrestart", None) is None and isinstance(limit, int):
        dsession._max_worker_restart = limit + 1
    return True


def fault_entries(config: pytest.Config) -> list[dict[str, Any]]:
    """The session's faults, one dict each: ``nodeid``, ``kind`` (``"dead-cuda-context"`` /
    ``"timeout"`` / ``"sanitizer"`` / ``"out-of-memory"``), ``headline``, ``message``, ``call`` (the
    kernel call), ``worker`` (xdist worker id or ``None``), ``action`` (what followed: a worker
    replaced, the session stopped)."""
    state = _faults(config)
    session = state.session
    for entry in state.entries:
        if entry["action"] is None and entry["kind"] == "dead-cuda-context" and entry["worker"] is None:
            collected = getattr(session, "testscollected", None)
            ran = len(state.seen)
            entry["action"] = f"the session stopped after this test: {ran} of {collected} collected tests ran"
        elif entry["action"] is None:
            entry["action"] = "the process ended (see the test's failure)"
    return [dict(entry) for entry in state.entries]


def summary_lines(config: pytest.Config) -> list[str]:
    """The terminal summary's lines: per fault, the test and its headline, then what followed."""
    lines = []
    for entry in fault_entries(config):
        lines.append(f"{entry['nodeid']}: {entry['headline']}")
        lines.append(f"    {entry['action']}")
    return lines
