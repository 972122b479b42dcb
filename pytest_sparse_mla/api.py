"""Typed public helpers for other plugins and downstream ``conftest.py`` files.

Everything here is stable API: the functions take the ``pytest.Config`` of the running session
and read what pytest-sparse-mla parsed or resolved for it (the pytest-xdist model of small typed
helpers such as ``is_xdist_worker``; pytest-dev/pytest-xdist ``src/xdist/plugin.py``). Importing
this module is light (no torch, triton, flashinfer or syrupy); each helper imports what it needs.

Example, a downstream plugin adding its kernel's name to the report header::

    from pytest_sparse_mla import api

    def pytest_report_header(config):
        if api.is_active(config):
            return [f"mykernel under test: {api.implementation_name(config)}"]
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_sparse_mla import options
from pytest_sparse_mla.entry_points import ENTRY_POINT_GROUP, entry_point_specs
from pytest_sparse_mla.options import SparseMlaOptions, get_options
from pytest_sparse_mla.shipped import SUITES_PACKAGE, package_dir

if TYPE_CHECKING:
    import pytest

__all__ = [
    "ENTRY_POINT_GROUP",
    "SUITES_PACKAGE",
    "SparseMlaOptions",
    "entry_point_specs",
    "get_implementation",
    "get_options",
    "golden_dir",
    "grid_release",
    "implementation_name",
    "is_active",
    "is_enforcing_grid",
    "package_dir",
    "suites_dir",
]

def is_active(config: pytest.Config) -> bool:
    """Whether pytest-sparse-mla is active in this session.

    Active when the session uses it: ``-p sparse_mla`` (also through ``PYTEST_ADDOPTS`` or the ini
    ``addopts``), any ``--sparse-mla-*`` option, or any ``sparse_mla_*`` ini key
    (``pytest_sparse_mla.options.activation``). ``False`` when the plugin is installed but not used,
    disabled (``-p no:sparse_mla``), or not configured yet (before ``pytest_configure``).
    """
    return options.is_active(config)


def implementation_name(config: pytest.Config) -> str:
    """Display name of the implementation under test: its ``name`` attribute, else the
    ``--sparse-mla-impl`` value (``"reference"`` by default).

    Raises:
        pytest.UsageError: the implementation cannot be resolved (see :func:`get_implementation`).
    """
    from pytest_sparse_mla import implementations

    return implementations.implementation_name(get_implementation(config), get_options(config).impl)


def get_implementation(config: pytest.Config) -> Any:
    """The session's implementation under test (``--sparse-mla-impl``), resolved once and cached.

    An object following the protocol of ``pytest_sparse_mla.implementations`` (optional ``pack``,
    ``page_split``, ``sparse_mla_forward``; ``name``; ``compute_mode``); type it with the
    ``typing.Protocol`` classes of ``pytest_sparse_mla.implementations.protocol``.

    Raises:
        pytest.UsageError: unknown name (the message lists the valid ones), an import string that
            does not import, or an object providing none of the capabilities.
    """
    from pytest_sparse_mla import implementations

    return implementations.get_implementation(config)


def golden_dir(config: pytest.Config) -> Path:
    """Absolute root of the golden snapshots of this session.

    ``--sparse-mla-golden-dir``, else the ini key ``sparse_mla_golden_dir``, else the packaged
    goldens (``golden/`` of a checkout, ``pytest_sparse_mla/golden`` of an installed wheel;
    ``pytest_sparse_mla.snapshot.location.default_golden_dir``). Files are
    ``<root>/<suite>/<module>/<test>[<name>].tensor.json``.
    """
    from pytest_sparse_mla.snapshot.session import golden_root

    return golden_root(config)


def grid_release(config: pytest.Config) -> str | None:
    """The FlashInfer release whose dispatch grid the reference enforces (``--sparse-mla-grid``),
    e.g. ``"0.6.17"``, or ``None``."""
    return get_options(config).grid


def is_enforcing_grid(config: pytest.Config) -> bool:
    """Whether ``--sparse-mla-grid`` makes the reference raise each release's exact
    "unsupported configuration" error (``pytest_sparse_mla.dispatch``)."""
    return grid_release(config) is not None


def suites_dir() -> Path:
    """Directory of the shipped suites, the package ``pytest_sparse_mla.suites``
    (``pytest_sparse_mla/suites`` of an installed wheel; the checkout's ``suites/`` under an editable
    install).

    Raises:
        FileNotFoundError: the package was installed without its suites.
    """
    path = package_dir(SUITES_PACKAGE)
    if path is None or not (path / "__init__.py").is_file():
        raise FileNotFoundError(f"{SUITES_PACKAGE}: the suites are missing from this installation ({path})")
    return path
