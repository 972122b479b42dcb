"""One GPU per pytest-xdist worker, and the record of which worker ran on which GPU.

Logic only: the hooks live in ``pytest_sparse_mla.plugin`` and call these functions only in
sessions that use the plugin (``options.activation``); a foreign project's xdist workers keep the
caller's ``CUDA_VISIBLE_DEVICES`` and ``OMP_NUM_THREADS``.

The controller decides and the worker applies (the pytest-randomly ``workerinput`` pattern,
pytest-dev/pytest-randomly; NVIDIA/cuml PR #7948):

* controller, ``pytest_configure_node``: worker ``gwN`` gets entry ``N mod len(visible)`` of the
  caller's visible GPUs, i.e. of ``CUDA_VISIBLE_DEVICES`` when it is set (indices or UUIDs, kept
  as written), else ``0 .. device_count-1``. Indexing into the caller's list, not physical ids, is
  the fix of triton-lang/triton PR #11831 (workers landed on physical GPU 0 when the caller had
  already narrowed ``CUDA_VISIBLE_DEVICES``);
* worker, :func:`configure_worker` from ``pytest_configure`` (tryfirst, before any test or
  fixture can initialise CUDA):
  ``CUDA_VISIBLE_DEVICES`` is set to that one entry, so ``cuda:0`` inside the worker is its GPU.

Workers report the device they really saw (``workeroutput``); the controller prints one line per
worker in the terminal summary and adds it to ``--sparse-mla-report-json``.

CPU threads: N workers on a machine of C cores each get ``max(1, C // N)`` intra-op threads
(``OMP_NUM_THREADS`` for workers that have not imported torch yet, ``torch.set_num_threads`` for
those that have), unless the caller set ``OMP_NUM_THREADS``. Without it every worker runs
``C`` OpenMP threads and the attention suites run about 4x slower on 2 cores with ``-n 2``
(measured here); SciPy's conftest limits BLAS threads the same way (scipy/scipy ``scipy/conftest.py``).

Nothing here imports torch at module import; the controller counts GPUs lazily, and only when
xdist distributes to more than zero workers and no ``CUDA_VISIBLE_DEVICES`` list is given.
"""

from __future__ import annotations

import glob
import os
import sys
from typing import Any

import pytest

from pytest_sparse_mla import options

__all__ = [
    "WORKER_KEY",
    "assign_gpu",
    "configure_node",
    "configure_worker",
    "finish",
    "record_node",
    "summary_lines",
    "visible_gpus",
    "worker_cpu_threads",
    "worker_gpu",
]

WORKER_KEY = "sparse_mla_gpu"
_RECORDS = pytest.StashKey[dict[str, dict[str, Any]]]()
_GPUS = pytest.StashKey[list[str]]()


def visible_gpus(environ: dict[str, str] | None = None, count: int | None = None) -> list[str]:
    """The caller's visible GPUs as ``CUDA_VISIBLE_DEVICES`` entries.

    Args:
        environ: environment to read (default ``os.environ``).
        count: number of CUDA devices if already known; otherwise torch is asked lazily.

    Returns:
        The comma-separated entries of ``CUDA_VISIBLE_DEVICES`` when it is set (an empty list when
        it is set to ``""``, which hides every GPU), else ``["0", ..., str(count-1)]``.
    """
    env = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in env:
        return [part.strip() for part in env["CUDA_VISIBLE_DEVICES"].split(",") if part.strip()]
    if count is None and not _gpu_device_nodes():
        count = 0  # no GPU device nodes: no CUDA device to count, and no torch import (about 1 s)
    if count is None:
        try:
            import torch

            count = int(torch.cuda.device_count())
        except Exception:  # pragma: no cover - no torch / broken driver: nothing to pin
            count = 0
    return [str(i) for i in range(count)]


def _gpu_device_nodes() -> bool:
    """Whether this machine may have a GPU torch can see: on Linux, an NVIDIA device node
    (``/dev/nvidia0``, ...; the driver creates one per GPU, and a container sees a GPU only through
    it) or AMD's ``/dev/kfd`` (ROCm); elsewhere always (torch is asked)."""
    if not sys.platform.startswith("linux"):
        return True
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd")


def assign_gpu(worker_id: str, gpus: list[str]) -> str | None:
    """Round-robin: worker ``gwN`` gets ``gpus[N % len(gpus)]``; ``None`` without GPUs.

    Raises:
        ValueError: ``worker_id`` is not of the form ``gw<N>``.
    """
    if not gpus:
        return None
    if not worker_id.startswith("gw") or not worker_id[2:].isdigit():
        raise ValueError(f"worker_id={worker_id!r}: expected an xdist worker id like 'gw0'")
    return gpus[int(worker_id[2:]) % len(gpus)]


def worker_gpu(config: pytest.Config) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` entry this xdist worker was pinned to (``None`` if not pinned)."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return None
    value = workerinput.get(WORKER_KEY)
    return str(value) if value is not None else None


def worker_cpu_threads(num_workers: int, cpu_count: int | None = None) -> int:
    """Intra-op CPU threads for one of ``num_workers`` workers: ``max(1, cpu_count // num_workers)``."""
    cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    return max(1, cores // max(1, num_workers))


def _limit_cpu_threads(num_workers: int) -> None:
    if "OMP_NUM_THREADS" in os.environ:
        return
    threads = worker_cpu_threads(num_workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch = sys.modules.get("torch")
    if torch is not None:  # already imported (e.g. by a conftest): OMP_NUM_THREADS came too late
        torch.set_num_threads(threads)


def configure_worker(config: pytest.Config) -> None:
    """On an xdist worker (called first thing in ``pytest_configure``, before any test or fixture
    can initialise CUDA): set ``CUDA_VISIBLE_DEVICES`` to the GPU the controller assigned and cap
    the CPU threads. Does nothing on the controller or without xdist."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return
    gpu = worker_gpu(config)
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    _limit_cpu_threads(int(workerinput.get("workercount", 1) or 1))


def configure_node(config: pytest.Config, node: Any) -> None:
    """On the controller (``pytest_configure_node``): assign worker ``node`` its GPU in
    ``node.workerinput`` (round robin over :func:`visible_gpus`, counted once per session)."""
    if not options.get_options(config).gpu_per_worker:
        return
    gpus = config.stash.get(_GPUS, None)
    if gpus is None:
        gpus = visible_gpus()
        config.stash[_GPUS] = gpus
    gpu = assign_gpu(node.workerinput["workerid"], gpus)
    if gpu is not None:
        node.workerinput[WORKER_KEY] = gpu


def record_node(config: pytest.Config, node: Any) -> None:
    """On the controller (``pytest_testnodedown``): keep the device record the worker sent."""
    record = getattr(node, "workeroutput", {}).get(WORKER_KEY)
    if record is not None:
        config.stash.setdefault(_RECORDS, {})[node.workerinput["workerid"]] = record


def _device_record(config: pytest.Config) -> dict[str, Any]:
    """The device this process saw: probed when it imported torch; a process that never imported
    torch (its tests needed none) ran nothing on a GPU and is not made to import it now."""
    from pytest_sparse_mla import capabilities

    caps = capabilities.probe() if "torch" in sys.modules else capabilities.Capabilities()
    return {
        "worker": getattr(config, "workerinput", {}).get("workerid", "controller"),
        "pid": os.getpid(),
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "device_name": caps.device_name,
        "compute_capability": caps.sm,
        "device_count": caps.device_count,
    }


def finish(config: pytest.Config, session: pytest.Session) -> None:
    """At session finish. Worker: send the device it saw to the controller (``workeroutput``).
    Controller (or a run without xdist): write ``--sparse-mla-report-json`` / ``--sparse-mla-report-md``
    (``run_report``) with every worker's device."""
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput[WORKER_KEY] = _device_record(config)
        return
    from pytest_sparse_mla import run_report

    if not run_report.wanted(config):
        return
    records = config.stash.get(_RECORDS, {}) or {"controller": _device_record(config)}
    run_report.write(config, session, records)


def summary_lines(config: pytest.Config) -> list[str]:
    """One line per worker that reported, ``gwN: CUDA_VISIBLE_DEVICES=... -> <device>``."""
    records = config.stash.get(_RECORDS, {})
    lines = []
    for worker in sorted(records, key=lambda w: int(w[2:]) if w[2:].isdigit() else -1):
        r = records[worker]
        lines.append(
            f"{worker}: CUDA_VISIBLE_DEVICES={r['CUDA_VISIBLE_DEVICES']} -> "
            f"{r['device_name'] or 'no CUDA device'} (sm {r['compute_capability']}), pid {r['pid']}"
        )
    return lines
