"""Implementations registered by installed packages: the ``pytest_sparse_mla.implementations`` group.

A kernel library makes its implementation selectable by name, without a ``conftest.py`` and
without ``--sparse-mla-impl package.module:attribute``, by declaring an entry point in its own
``pyproject.toml`` (the pattern of pytest-randomly's ``pytest_randomly.random_seeder`` group,
pytest-dev/pytest-randomly ``src/pytest_randomly/__init__.py``)::

    [project.entry-points."pytest_sparse_mla.implementations"]
    mykernel = "mykernel.sparse_mla:implementation"

The entry point's name (``mykernel``) becomes a valid ``--sparse-mla-impl`` value; its value is
loaded like ``--sparse-mla-impl mykernel.sparse_mla:implementation`` (an object or module following
the protocol of ``pytest_sparse_mla.implementations``). Nothing is imported until that name is
selected, so an installed kernel library costs nothing in sessions that do not use it.

The hooks module (``pytest_sparse_mla.plugin``) implements the ``pytest_sparse_mla_implementations``
hook (``hookspecs.py``) with :func:`entry_point_specs`, so ``implementations.available_implementations``
sees the group's names. The hook returns each entry point's *value* (the ``"module:attribute"``
string), which ``implementations.resolve_implementation`` imports only for the selected name: a
broken or heavy kernel library is never imported in a session that does not select it. The hookimpl
is ``trylast``: ``available_implementations`` lets the hook result called first win, so a name
defined in a ``conftest.py`` or a plugin overrides the same name declared by an installed package.
"""

from __future__ import annotations

import warnings
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import pytest

__all__ = [
    "ENTRY_POINT_GROUP",
    "SparseMlaEntryPointWarning",
    "entry_point_implementations",
    "entry_point_specs",
]

#: The entry-point group downstream packages declare their implementations in.
ENTRY_POINT_GROUP = "pytest_sparse_mla.implementations"


class SparseMlaEntryPointWarning(pytest.PytestWarning):
    """An entry point of the ``pytest_sparse_mla.implementations`` group failed to load."""


def _describe(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    owner = f" (distribution {dist.name} {dist.version})" if dist is not None else ""
    return f"entry point {ep.name} = {ep.value!r} in group {ep.group!r}{owner}"


def entry_point_implementations(
    group: str = ENTRY_POINT_GROUP, *, strict: bool = False
) -> dict[str, Any]:
    """Load the entry points of ``group``: ``{entry point name: loaded object}``, sorted by name.

    For tools that want the objects themselves (a report listing every installed kernel); the
    plugin's own resolution stays lazy (see :func:`entry_point_specs`).

    Args:
        group: the entry-point group (default :data:`ENTRY_POINT_GROUP`).
        strict: raise on an entry point that fails to import instead of skipping it with a
            :class:`SparseMlaEntryPointWarning` naming the package and the error.

    Raises:
        ImportError: with ``strict=True``, an entry point failed to load (the message names the
            entry point, its value and its distribution; the original error is chained).
    """
    chosen = entry_point_specs(group)
    found: dict[str, Any] = {}
    for ep in sorted(entry_points(group=group), key=lambda e: (e.name, e.value)):
        if chosen.get(ep.name) != ep.value or ep.name in found:
            continue
        try:
            found[ep.name] = ep.load()
        except Exception as exc:
            message = f"{_describe(ep)} failed to load: {type(exc).__name__}: {exc}"
            if strict:
                raise ImportError(message) from exc
            warnings.warn(SparseMlaEntryPointWarning(message), stacklevel=2)
    return found


def entry_point_specs(group: str = ENTRY_POINT_GROUP) -> dict[str, str]:
    """The entry points of ``group`` without importing them: ``{name: "module:attribute"}``.

    When two installed distributions declare one name, the value sorting last wins and a
    :class:`SparseMlaEntryPointWarning` names both.
    """
    specs: dict[str, str] = {}
    origin: dict[str, EntryPoint] = {}
    for ep in sorted(entry_points(group=group), key=lambda e: (e.name, e.value)):
        if ep.name in origin and origin[ep.name].value != ep.value:
            warnings.warn(
                SparseMlaEntryPointWarning(
                    f"two {group!r} entry points are named {ep.name!r}: {_describe(origin[ep.name])} "
                    f"and {_describe(ep)}; using the latter"
                ),
                stacklevel=2,
            )
        specs[ep.name] = ep.value
        origin[ep.name] = ep
    return specs
