"""A recording implementation for ``tests/test_conformance_calls.py``: the bundled reference, logging
every protocol call together with the test that made it. Not shipped.

* ``--sparse-mla-impl recording_impl:RecordingImplementation`` (this directory on ``PYTHONPATH``):
  ``pack``, ``page_split`` and ``sparse_mla_forward`` of
  :class:`~pytest_sparse_mla.implementations.ReferenceImplementation`, each call appended as
  ``<test node id>\\t<capability>`` to the file named by ``$SPARSE_MLA_CALL_LOG``. The node id is
  read from ``$PYTEST_CURRENT_TEST``, which pytest sets for the test being set up, run or torn
  down (fixtures that call the implementation count for their test). ``$SPARSE_MLA_RECORD_RELEASE``
  makes it declare (and enforce) that FlashInfer release, for the dispatch-grid suite.
* ``-p recording_impl``: also a pytest plugin that appends ``<node id>\\t<outcome>`` of every test to
  ``$SPARSE_MLA_OUTCOME_LOG`` (``passed``/``failed`` from the call phase, ``skipped``/``error`` from
  the phase that ended the test) and, after collection, ``<node id>\\t<run|skip>`` of every item to
  ``$SPARSE_MLA_COLLECT_LOG`` (``skip``: a skip marker was added at collection, e.g. a capability
  the machine lacks).
"""

from __future__ import annotations

import os
from typing import Any

from pytest_sparse_mla.implementations import ReferenceImplementation

CALL_LOG = "SPARSE_MLA_CALL_LOG"
OUTCOME_LOG = "SPARSE_MLA_OUTCOME_LOG"
COLLECT_LOG = "SPARSE_MLA_COLLECT_LOG"
RELEASE = "SPARSE_MLA_RECORD_RELEASE"


def _append(variable: str, line: str) -> None:
    path = os.environ.get(variable)
    if path:
        with open(path, "a", encoding="utf-8") as log:  # one short write per line: safe across processes
            log.write(line + "\n")


def _current_test() -> str:
    """The node id pytest is running now (``PYTEST_CURRENT_TEST`` without its `` (phase)`` suffix)."""
    return os.environ.get("PYTEST_CURRENT_TEST", "<outside a test>").rsplit(" (", 1)[0]


class RecordingImplementation(ReferenceImplementation):
    """The bundled reference, recording each ``pack`` / ``page_split`` / ``sparse_mla_forward`` call."""

    name = "recording-reference"

    def __init__(self) -> None:
        super().__init__(os.environ.get(RELEASE) or None)

    def pack(self, source: Any, fmt: Any = "dsv4", **kwargs: Any) -> Any:
        _append(CALL_LOG, f"{_current_test()}\tpack")
        return super().pack(source, fmt, **kwargs)

    def page_split(self, kv_cache: Any, **kwargs: Any) -> Any:
        _append(CALL_LOG, f"{_current_test()}\tpage_split")
        return super().page_split(kv_cache, **kwargs)

    def sparse_mla_forward(self, q: Any, kv_cache: Any, indices: Any, **kwargs: Any) -> Any:
        _append(CALL_LOG, f"{_current_test()}\tsparse_mla_forward")
        return super().sparse_mla_forward(q, kv_cache, indices, **kwargs)


def pytest_runtest_logreport(report: Any) -> None:
    """Record the outcome of each test (plugin hook, active with ``-p recording_impl``)."""
    if report.when == "call":
        _append(OUTCOME_LOG, f"{report.nodeid}\t{report.outcome}")
    elif report.outcome == "skipped":
        _append(OUTCOME_LOG, f"{report.nodeid}\tskipped")
    elif report.outcome == "failed":
        _append(OUTCOME_LOG, f"{report.nodeid}\terror")


def pytest_collection_finish(session: Any) -> None:
    """Record every collected item and whether it is already marked to skip (plugin hook)."""
    for item in session.items:
        state = "skip" if item.get_closest_marker("skip") is not None else "run"
        _append(COLLECT_LOG, f"{item.nodeid}\t{state}")
