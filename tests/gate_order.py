"""Inner-run plugin of the wrong-kernel gate (``-p gate_order``): run the suite breadth-first over
its test functions.

Collected order puts every parametrization of a test function together, so a wrong kernel that only
one test function catches (a sink rule, an LSE base, a poisoned slot) is reached only after every
case of the functions before it. The gate stops a wrong kernel's run at its first failure
(``--maxfail``), so the order decides what a kill costs. Round ``r`` runs the ``r``-th case of
every test function, in file order: each distinct rule is checked within the first rounds. The
suite's tests are order-independent (pytest-xdist already runs them in any order); the set of items
run is unchanged.
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Reorder ``items`` round-robin over test functions (node id without the parameters)."""
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        groups.setdefault(item.nodeid.split("[", 1)[0], []).append(item)
    rounds = max((len(g) for g in groups.values()), default=0)
    items[:] = [g[r] for r in range(rounds) for g in groups.values() if r < len(g)]
