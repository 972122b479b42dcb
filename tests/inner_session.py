"""In-process pytest sessions for the self-tests that run a whole suite: the wrong-kernel gate
(``test_wrong_implementations.py``), the CPU peers with their xfail files (``test_peer_lanes.py``)
and the example project's kernel (``test_envelope.py``).

:func:`run` starts ``pytest.main`` in this process (a fresh config, plugin manager and collection;
modules already imported, torch and the suite modules included, are reused, which saves seconds
per run). ``pytester``'s in-process runs are not used: they drop modules imported during a run, and
re-importing torch's operator libraries fails.

What the runs of one worker share, each keyed by everything its result depends on, so a shared
result is the result the run would have computed:

* the float64 oracle's results (``oracle.memoized``, keyed by the bytes of every argument: every
  run draws a test's inputs from the same seed, so the oracle of a test is computed once per
  worker, not once per run);
* the drawn inputs of a case (``attention.cases.make_inputs``, keyed by the case, the generator's
  state and the device; a hit restores the generator's state after the draw and hands out a deep
  copy, so a kernel that writes into its inputs never reaches the store).

The inner session ends with full garbage collections (pytest's unraisable-exception cleanup):
this process's own objects are frozen (``gc.freeze``) while it runs, so those collections scan
only the inner run's objects (about half a second per run).
"""

from __future__ import annotations

import copy
import gc
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from _pytest.pathlib import make_numbered_dir

from pytest_sparse_mla import formats
from pytest_sparse_mla.attention import cases
from pytest_sparse_mla.attention.oracle import memoized

#: The long-test marker (``tests/conftest.py``) of an in-process run of the whole suite with its own
#: cases (the gate's kernels, the CPU peers): a worker's runs share the oracle's results and the
#: drawn inputs, so they are dealt to one worker; ``seconds``: a warm run's rough cost.
WHOLE_SUITE_RUN = pytest.mark.sparse_mla_selftest_long(share="whole-suite", seconds=12)
#: The same for runs whose cases are fitted to a 64/128-head envelope (the gate's FlashMLA-envelope
#: run, the example project's head64 kernel): most of their fitted cases are the same.
HEAD64_ENVELOPE_RUN = pytest.mark.sparse_mla_selftest_long(share="head64-envelope", seconds=30)

#: What marks a process as an xdist worker, or passes options to it: the inner session is neither.
XDIST_ENV = ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID", "PYTEST_ADDOPTS")


def _tensor_bytes(value: Any) -> int:
    seen: set[int] = set()
    total = 0

    def walk(obj: Any) -> None:
        nonlocal total
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            for v in vars(obj).values():
                walk(v)

    walk(value)
    return total


class BoundedStore(dict[Any, Any]):
    """Results up to ``limit`` bytes of tensors; later results are not kept."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit, self.size = limit, 0

    def __setitem__(self, key: Any, value: Any) -> None:
        size = _tensor_bytes(value)
        if self.size + size <= self.limit:
            self.size += size
            super().__setitem__(key, value)


#: The oracle's results, shared by this worker's inner runs (``oracle.memoized``).
ORACLE_RESULTS: BoundedStore = BoundedStore(2 << 30)
#: The drawn inputs, shared by this worker's inner runs (:func:`memoized_inputs`).
INPUTS: BoundedStore = BoundedStore(3 << 29)


def memoized_inputs(
    make: Callable[..., cases.AttentionInputs], store: BoundedStore
) -> Callable[..., cases.AttentionInputs]:
    """``make`` (``cases.make_inputs``) answered from ``store``: keyed by the case (its ``repr``:
    every field), the generator's state before the draw and the device; a hit sets the generator
    to its state after the draw and returns a deep copy (views, strides and storage offsets kept)."""

    def answer(case: cases.AttentionCase, generator: torch.Generator, *, device: Any = "cpu") -> cases.AttentionInputs:
        key = (repr(case), generator.get_state().numpy().tobytes(), str(device))
        hit = store.get(key)
        if hit is not None:
            inputs, state = hit
            generator.set_state(state)
            return _copy(inputs)
        inputs = make(case, generator, device=device)
        store[key] = (_copy(inputs), generator.get_state())
        return inputs

    return answer


def _copy(inputs: cases.AttentionInputs) -> cases.AttentionInputs:
    """A deep copy of the tensors (views of one storage stay views of one copy); the case and the
    format objects are shared, as a fresh draw shares them."""
    memo: dict[int, Any] = {id(f): f for f in formats.FORMATS.values()}
    memo[id(inputs.case)] = inputs.case
    return copy.deepcopy(inputs, memo)


@contextmanager
def _frozen() -> Iterator[None]:
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _modules_under(paths: list[Path]) -> list[str]:
    """Names of the imported modules whose files lie under one of ``paths``."""
    roots = [str(p.resolve()) + os.sep for p in paths]
    names = []
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and any(os.path.realpath(file).startswith(root) for root in roots):
            names.append(name)
    return names


#: The Hypothesis profile of :func:`unshrunk`.
UNSHRUNK_PROFILE = "sparse-mla-gate-unshrunk"


@contextmanager
def unshrunk() -> Iterator[None]:
    """Hypothesis's loaded profile without the shrink and explain phases while the block runs: the
    search's settings inherit the phases of the loaded profile, so a failing search test of an
    inner run reports its first failing call (for a test that reads only whether it failed)."""
    from hypothesis import settings

    from pytest_sparse_mla.search import unshrunk_phases

    previous = getattr(settings, "get_current_profile_name", lambda: "default")()
    parent = settings.get_profile(previous)
    # Derandomized like the suites' own profile (suites/conftest.py), which an inner session loads unless
    # its command line names a profile: run() names this one while it is loaded.
    settings.register_profile(UNSHRUNK_PROFILE, parent=parent, phases=unshrunk_phases(), derandomize=True,
                              deadline=None)  # fmt: skip
    settings.load_profile(UNSHRUNK_PROFILE)
    try:
        yield
    finally:
        settings.load_profile(previous)


def run(
    args: list[str],
    *,
    cwd: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    plugins: list[Any] | None = None,
    syspath: Sequence[Path] = (),
    env: dict[str, str] | None = None,
    unload: Sequence[Path] = (),
) -> tuple[int, str]:
    """``pytest.main(args)`` in this process, from ``cwd``, not as an xdist worker, with the
    oracle's results and the drawn inputs shared with this worker's other inner runs. Returns the
    exit status and the run's terminal output (stdout + stderr).

    ``syspath``: folders put first on ``sys.path`` for the run (a ``PYTHONPATH``); the modules
    imported from them are unloaded afterwards, so the next run (or test) imports its own.
    ``env``: environment variables set for the run only. ``unload``: more folders whose modules
    are unloaded after the run (test modules of a throwaway project, imported by their basename).
    """
    capsys.readouterr()  # what the test printed before belongs to the test
    with monkeypatch.context() as patch, _frozen(), memoized(ORACLE_RESULTS):
        patch.chdir(cwd)
        for key in XDIST_ENV:  # the inner session is not an xdist worker
            patch.delenv(key, raising=False)
        for key, value in (env or {}).items():
            patch.setenv(key, value)
        for folder in reversed(list(syspath)):
            patch.syspath_prepend(str(folder))
        patch.setattr(cases, "make_inputs", memoized_inputs(cases.make_inputs, INPUTS))
        from hypothesis import settings

        if settings.get_current_profile_name() == UNSHRUNK_PROFILE:  # the suites' conftest loads its own else
            args = [*args, "--hypothesis-profile", UNSHRUNK_PROFILE]
        try:
            ret = pytest.main(args, plugins=plugins)
        finally:
            for name in _modules_under([*syspath, *unload]):
                del sys.modules[name]
    captured = capsys.readouterr()
    return int(ret), captured.out + captured.err


def runpytest(
    pytester: pytest.Pytester,
    *args: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    plugins: list[Any] | None = None,
    env: dict[str, str] | None = None,
) -> pytest.RunResult:
    """What ``pytester.runpytest_subprocess(*args)`` does, in this process through :func:`run`:
    from ``pytester.path``, which is also first on ``sys.path`` (a subprocess gets it on
    ``PYTHONPATH``), with a fresh ``--basetemp`` under it. The result takes pytester's assertions
    (``assert_outcomes``, ``stdout.fnmatch_lines``, ...)."""
    basetemp = make_numbered_dir(root=pytester.path, prefix="runpytest-", mode=0o700)
    start = time.perf_counter()
    ret, output = run(
        [f"--basetemp={basetemp}", *args], cwd=pytester.path, monkeypatch=monkeypatch, capsys=capsys,
        plugins=plugins, syspath=[pytester.path], env=env,
    )  # fmt: skip
    return pytest.RunResult(ret, output.splitlines(), [], time.perf_counter() - start)


__all__ = [
    "HEAD64_ENVELOPE_RUN", "WHOLE_SUITE_RUN", "ORACLE_RESULTS", "INPUTS", "BoundedStore", "XDIST_ENV",
    "memoized_inputs", "run", "runpytest", "unshrunk",
]  # fmt: skip
