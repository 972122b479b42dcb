"""Hooks that downstream projects implement (added by the plugin through ``pytest_addhooks``).

Implement them in a ``conftest.py`` or in a plugin module registered under the ``pytest11`` entry
point group; pytest-sparse-mla may be absent, so guard with ``pytest.hookimpl(optionalhook=True)``
(the pytest-xdist convention: pytest-dev/pytest-xdist src/xdist/newhooks.py).
"""

from __future__ import annotations

from typing import Any

import pytest


@pytest.hookspec
def pytest_sparse_mla_implementations(config: pytest.Config) -> dict[str, Any] | None:
    """Return ``{name: implementation}`` to make named implementations selectable.

    Each value is an object (or module) following the protocol in
    ``pytest_sparse_mla.implementations`` (optional ``pack``, ``page_split``,
    ``sparse_mla_forward`` ...; typed in ``pytest_sparse_mla.implementations.protocol``), or a
    ``"module:attribute"`` string imported only when the name is selected. The names become valid
    values of ``--sparse-mla-impl``.
    Called once per session; results of all implementers are merged (later names win).
    """
