"""Inner-run plugin of the wrong-kernel gate (``-p gate_order``): run the suite breadth-first over
its test functions, after the tests named for the kernel under test.

Collected order puts every parametrization of a test function together, so a wrong kernel that only
one test function catches (a sink rule, an LSE base, a poisoned slot) is reached only after every
case of the functions before it. The gate stops a wrong kernel's run at its first failure
(``--maxfail``), so the order decides what a kill costs. Round ``r`` runs the ``r``-th case of
every test function, in file order: each distinct rule is checked within the first rounds. A kernel
that only one late case catches (``kernel_catalogue.FIRST_TESTS``: where its kill was found) gets
that case first: the gate names it, one node id a line, in ``SPARSE_MLA_GATE_FIRST``. The suite's
tests are order-independent (pytest-xdist already runs them in any order); the set of items run is
unchanged. The search (``suites/test_attention_search.py``) runs last: a wrong kernel reaches it
only when no fixed case caught it, so a kill there is one that only the search makes (and the
shrinking of a search failure is paid only by those kernels).
"""

from __future__ import annotations

import os

import pytest

#: Environment variable: node ids (one a line) run first, in this order; the rest follow breadth-first.
FIRST_ENV = "SPARSE_MLA_GATE_FIRST"
#: The search's suite file: its items run after every fixed case.
SEARCH_FILE = "test_attention_search.py"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Reorder ``items`` round-robin over test functions (node id without the parameters), the
    items named in :data:`FIRST_ENV` first."""
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        groups.setdefault(item.nodeid.split("[", 1)[0], []).append(item)
    rounds = max((len(g) for g in groups.values()), default=0)
    items[:] = [g[r] for r in range(rounds) for g in groups.values() if r < len(g)]
    items.sort(key=lambda item: SEARCH_FILE in item.nodeid)  # stable: the search last
    first = {node: rank for rank, node in enumerate(filter(None, os.environ.get(FIRST_ENV, "").splitlines()))}
    if first:
        items.sort(key=lambda item: first.get(item.nodeid, len(first)))  # stable: the rest keep their order
