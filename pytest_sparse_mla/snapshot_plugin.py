"""Golden snapshots: the ``tensor_snapshot`` fixture and the hooks around syrupy.

Registered by ``pytest_sparse_mla.plugin`` (``_PLUGIN_MODULES``). Importing it imports neither
syrupy nor torch: the GPU image may run without syrupy, and then only the golden tests skip.

* ``--snapshot-update`` is refused with a ``UsageError`` when more than one pytest-xdist worker
  would run: syrupy's writes are not coordinated between workers (syrupy-project/syrupy #1237,
  data loss under ``--snapshot-update -n N``); the guard follows daaain/claude-code-log PR #304.
  Regenerate goldens with one process: ``pytest -p sparse_mla suites/test_golden.py
  --snapshot-update``.
* The session's golden root (``--sparse-mla-golden-dir``) is handed to
  ``pytest_sparse_mla.snapshots`` for test locations that carry no config (xdist controller).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from syrupy.assertion import SnapshotAssertion

__all__ = ["tensor_snapshot", "xdist_worker_count"]


#: Set when this session pushed its golden root onto ``snapshots``' stack (popped at unconfigure).
_ROOT_PUSHED = pytest.StashKey[bool]()


def _tx_count(spec: str) -> int:
    """Workers of one ``--tx`` spec: ``"3*popen"`` -> 3, ``"popen"`` -> 1."""
    head, sep, _ = spec.partition("*")
    return int(head) if sep and head.strip().isdigit() else 1


def xdist_worker_count(config: pytest.Config) -> int:
    """How many pytest-xdist workers this session runs with (1 without xdist or with ``-n 0``).

    On a worker: ``workerinput["workercount"]`` (also exported as ``PYTEST_XDIST_WORKER_COUNT``;
    pytest-dev/pytest-xdist ``src/xdist/remote.py``). On the controller: the ``--tx`` specs xdist
    derives from ``-n``/``--numprocesses`` in its ``pytest_cmdline_main`` (``src/xdist/plugin.py``),
    which runs before ``pytest_configure``; an unresolved ``auto``/``logical`` counts as 2.
    """
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        count = workerinput.get("workercount") or os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1)
        return int(count)
    option = config.option
    numprocesses = getattr(option, "numprocesses", None)
    if isinstance(numprocesses, str):
        return 2
    if getattr(option, "dist", "no") == "no" and not numprocesses:
        return 1
    specs = getattr(option, "tx", None) or []
    total = sum(_tx_count(spec) for spec in specs)
    return max(total, int(numprocesses or 0), 1)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Refuse ``--snapshot-update`` with several xdist workers; publish the golden root."""
    if getattr(config.option, "update_snapshots", False):
        workers = xdist_worker_count(config)
        if workers > 1:
            raise pytest.UsageError(
                f"--snapshot-update with {workers} pytest-xdist workers: syrupy does not coordinate "
                "snapshot writes between workers (syrupy #1237). Update goldens in one process, "
                "e.g. `pytest -p sparse_mla suites/test_golden.py --snapshot-update -n 0`."
            )
    try:
        from pytest_sparse_mla import snapshots
    except ImportError:  # syrupy is not installed: the golden tests skip
        return
    snapshots.push_session_root(snapshots.golden_root(config))
    config.stash[_ROOT_PUSHED] = True


def pytest_unconfigure(config: pytest.Config) -> None:
    """Forget this session's golden root (pytester runs nest sessions in one process)."""
    if config.stash.get(_ROOT_PUSHED, False):
        from pytest_sparse_mla import snapshots

        snapshots.pop_session_root()


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Say where goldens are read from (and whether syrupy is there to read them)."""
    try:
        from pytest_sparse_mla import snapshots
    except ImportError:
        return ["sparse-mla: goldens: syrupy not installed, golden tests skip"]
    return [f"sparse-mla: goldens: {snapshots.golden_root(config)}"]


@pytest.fixture
def tensor_snapshot(request: pytest.FixtureRequest) -> SnapshotAssertion:
    """syrupy's ``snapshot`` using :class:`pytest_sparse_mla.snapshots.TensorSnapshotExtension`.

    Compare a tensor with its golden file, naming each snapshot of a test::

        from pytest_sparse_mla.snapshots import close, exact

        assert tensor_snapshot(name="packed") == exact(cache.packed)
        assert tensor_snapshot(name="output") == close(res.output, atol=2e-3, rtol=1e-2)

    ``exact`` compares shape, dtype, strides and the SHA-256 of the raw bytes; ``close`` compares
    shape, dtype and values within ``atol + rtol * |golden|``. Files:
    ``<golden root>/<suite>/<module>/<test>[<name>].tensor.json``; the root is
    ``--sparse-mla-golden-dir`` / ini ``sparse_mla_golden_dir`` or
    ``snapshots.default_golden_dir()``. Write or refresh goldens with ``--snapshot-update`` (one
    process only).

    Skips the test when syrupy is not installed or its plugin is disabled (``-p no:syrupy``).
    """
    try:
        from pytest_sparse_mla.snapshots import TensorSnapshotExtension
    except ImportError as exc:
        pytest.skip(f"golden snapshots need syrupy>=4.6 (pip install syrupy): {exc}")
    if not request.config.pluginmanager.hasplugin("syrupy"):
        pytest.skip("golden snapshots need the syrupy pytest plugin (disabled with -p no:syrupy?)")
    snapshot: Any = request.getfixturevalue("snapshot")
    return snapshot.use_extension(TensorSnapshotExtension)
