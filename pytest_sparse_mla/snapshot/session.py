"""The goldens' session plumbing: the session's golden root, the ``--snapshot-update`` guard, and
what to say when syrupy is missing.

Logic only: the hooks module (``pytest_sparse_mla.plugin``) calls :func:`configure`,
:func:`unconfigure` and :func:`header_lines` in sessions that use the plugin; the fixture
``tensor_snapshot`` lives in ``pytest_sparse_mla.fixtures``. Importing this module imports neither
syrupy nor torch: where syrupy is not installed (a GPU image without it), only the golden tests
skip, with :func:`syrupy_missing_reason`.

* :func:`golden_root`: ``--sparse-mla-golden-dir`` (CLI), else the ini key
  ``sparse_mla_golden_dir`` (both parsed by ``pytest_sparse_mla.options``), else
  ``snapshot.location.default_golden_dir``.
* ``--snapshot-update`` is refused with a ``UsageError`` when more than one pytest-xdist worker
  would run: syrupy's writes are not coordinated between workers (syrupy-project/syrupy #1237,
  data loss under ``--snapshot-update -n N``); the guard follows daaain/claude-code-log PR #304.
  Regenerate goldens with one process: ``pytest -p sparse_mla suites/test_golden.py
  --snapshot-update -n 0``.
* The session's golden root is recorded in ``snapshot.location`` (:func:`configure`) for the test
  locations syrupy builds without a config (the xdist controller).
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import pytest

from pytest_sparse_mla import options
from pytest_sparse_mla.snapshot import location

__all__ = [
    "configure",
    "golden_root",
    "header_lines",
    "syrupy_missing_reason",
    "syrupy_requirement",
    "unconfigure",
    "xdist_worker_count",
]

#: Distribution name of this package (its metadata holds the syrupy pin).
DISTRIBUTION = "pytest-sparse-mla"

#: Set when this session pushed its golden root onto ``location``'s stack (popped at unconfigure).
_ROOT_PUSHED = pytest.StashKey[bool]()


def golden_root(config: pytest.Config) -> Path:
    """The golden root of a session: ``--sparse-mla-golden-dir`` (CLI), else the ini key
    ``sparse_mla_golden_dir``, else ``snapshot.location.default_golden_dir()`` (an absolute path)."""
    return location.resolve_root(options.get_options(config).golden_dir)


def syrupy_requirement() -> str:
    """The syrupy requirement of the installed distribution's metadata, e.g. ``"syrupy>=5.5"``
    (the one version source: ``pyproject.toml``); ``"syrupy"`` when the metadata is unavailable."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        requires = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return "syrupy"
    for line in requires:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if requirement.name == "syrupy":
            return f"syrupy{requirement.specifier}"
    return "syrupy"


def syrupy_missing_reason(exc: BaseException) -> str:
    """Skip reason of a golden test where syrupy cannot be imported (names the pinned version)."""
    wanted = syrupy_requirement()
    return f"golden snapshots need {wanted} (pip install '{wanted}'): {exc}"


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


def configure(config: pytest.Config) -> None:
    """Refuse ``--snapshot-update`` with several xdist workers; publish the golden root.

    Raises:
        pytest.UsageError: ``--snapshot-update`` with more than one xdist worker.
    """
    if getattr(config.option, "update_snapshots", False):
        workers = xdist_worker_count(config)
        if workers > 1:
            raise pytest.UsageError(
                f"--snapshot-update with {workers} pytest-xdist workers: syrupy does not coordinate "
                "snapshot writes between workers (syrupy #1237). Update goldens in one process, "
                "e.g. `pytest -p sparse_mla suites/test_golden.py --snapshot-update -n 0`."
            )
    location.push_session_root(golden_root(config))
    config.stash[_ROOT_PUSHED] = True


def unconfigure(config: pytest.Config) -> None:
    """Forget this session's golden root (pytester runs nest sessions in one process)."""
    if config.stash.get(_ROOT_PUSHED, False):
        location.pop_session_root()


def header_lines(config: pytest.Config) -> list[str]:
    """Say where goldens are read from (and whether syrupy is there to read them)."""
    root = golden_root(config)
    try:
        import syrupy  # noqa: F401
    except ImportError:
        return [f"sparse-mla: goldens: {root} (syrupy not installed: golden tests skip; need {syrupy_requirement()})"]
    return [f"sparse-mla: goldens: {root}"]
