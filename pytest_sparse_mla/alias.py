"""``-p sparse-mla``: the name pytest's ``plugins:`` header line shows for this distribution.

pytest loads a ``-p NAME`` plugin before it autoloads the installed ones, trying the ``pytest11``
entry point called ``NAME`` first (``_pytest/config/__init__.py`` ``import_plugin(...,
consider_entry_points=True)``). This module is the entry point ``sparse-mla``: registered, it loads
the plugin itself under its own name ``sparse_mla`` (entry point ``sparse_mla`` ->
``pytest_sparse_mla.plugin``), so ``-p sparse-mla`` and ``-p sparse_mla`` are the same, the
autoload finds both names taken, and ``-p no:sparse_mla`` still keeps the plugin out. It imports
nothing else.
"""

from __future__ import annotations

from typing import Any


def pytest_addhooks(pluginmanager: Any) -> None:
    """Load the plugin under its name ``sparse_mla`` (a no-op when it is loaded already or blocked)."""
    pluginmanager.import_plugin("sparse_mla", consider_entry_points=True)
