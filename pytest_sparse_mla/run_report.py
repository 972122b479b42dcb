"""The run's reports: ``--sparse-mla-report-json PATH`` and ``--sparse-mla-report-md PATH`` (the
logic behind the hooks in :mod:`pytest_sparse_mla.plugin`; controller side, or a run without xdist).

The JSON document holds versions (``capabilities``), the implementation's label
(``implementation``: ``name``, the one label the reports use, and ``spec``, the
``--sparse-mla-impl`` value), the options (the search's budget among them:
``search_examples``, ``search_seed``, ``search_shards``, the machine's ``search_shard_group`` ``"I/N"``
or ``null`` and the ``search_global_shards`` it ran), the device of every xdist worker
(``workers``, from ``xdist_gpu``), the declared ``envelope``, the error-class ``coverage``, the
``device_faults``, what the ``search`` drew, the session's ``exit`` status and wall ``seconds``,
and every test's outcome under ``tests`` (one row per test: ``file``, ``id`` (checkout-style for the
shipped suites), ``outcome``, ``message``, ``seconds``; :class:`pytest_sparse_mla.conformance.Rows`).
The Markdown report is :func:`pytest_sparse_mla.conformance.markdown` of that document, the
report ``docs/conformance.md`` shows for this project's peers; ``sparse-mla-report`` merges several
JSON documents into one.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from typing import Any

import pytest

from pytest_sparse_mla import options, shards

__all__ = ["add", "document", "report_ids_wanted", "start", "wanted", "write"]

_ROWS = pytest.StashKey[Any]()
_START = pytest.StashKey[float]()


def wanted(config: pytest.Config) -> bool:
    """Whether the session writes a JSON or a Markdown report."""
    opts = options.get_options(config)
    return opts.report_json is not None or opts.report_md is not None


def report_ids_wanted(config: pytest.Config) -> bool:
    """Whether the session's test reports carry their report ids (``selection.REPORT_ID_ATTR``, set
    by the plugin's ``pytest_runtest_makereport``): the run report (:func:`wanted`) and the draft xfail
    file (``--sparse-mla-xfail-draft``) name each test by it."""
    return options.get_options(config).xfail_draft is not None or wanted(config)


def start(config: pytest.Config) -> None:
    """At session start: the clock of the report's ``seconds``."""
    config.stash[_START] = time.time()


def add(config: pytest.Config, report: pytest.TestReport) -> None:
    """Count one phase report in the session's rows (``conformance.Rows``)."""
    from pytest_sparse_mla import conformance, selection

    rows = config.stash.get(_ROWS, None)
    if rows is None:
        rows = config.stash[_ROWS] = conformance.Rows()
    test_id = str(getattr(report, selection.REPORT_ID_ATTR, None) or report.nodeid)
    if report.skipped and isinstance(report.longrepr, tuple):
        message = str(report.longrepr[2])
    else:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = str(getattr(crash, "message", None) or report.longrepr or "")
    rows.add(
        test_id, report.when, report.outcome, message=message, wasxfail=hasattr(report, "wasxfail"),
        seconds=float(getattr(report, "duration", 0.0) or 0.0),
    )  # fmt: skip


def document(config: pytest.Config, session: pytest.Session, workers: dict[str, Any]) -> dict[str, Any]:
    """The JSON run report (module docstring)."""
    from dataclasses import asdict

    from pytest_sparse_mla import capabilities, coverage, device_health, guard, implementations

    opts = options.get_options(config)
    impl = implementations.get_implementation(config)
    with options.usage_errors():  # an unknown compute_mode (tolerances.profile_for)
        envelope = guard.envelope_of(impl)
    rows = config.stash.get(_ROWS, None)
    start = config.stash.get(_START, None)
    return {
        "capabilities": asdict(capabilities.probe()),
        "options": {
            "device": opts.device, "seed": opts.seed, "impl": opts.impl, "grid": opts.grid,
            "xfail_file": str(opts.xfail_file) if opts.xfail_file else None,
            "search_examples": opts.search_examples, "search_seed": opts.search_seed,
            "search_shards": opts.search_shards,
            "search_shard_group": str(opts.search_shard_group) if opts.search_shard_group else None,
            "search_global_shards": list(shards.session_shards(opts.search_shards, opts.search_shard_group)),
        },  # fmt: skip
        "workers": workers,
        # the implementation's one label (its name, as its skips and failures say it) and how it was selected
        "implementation": {"name": implementations.implementation_name(impl, opts.impl), "spec": opts.impl},
        "envelope": {"declared": implementations.declared_envelope(impl) is not None, **envelope.as_dict()},
        "coverage": coverage.get(config).rows(),
        "device_faults": device_health.fault_entries(config),
        "search": coverage.get(config).search_report(),
        "tests": rows.rows() if rows is not None else [],
        "exit": int(session.exitstatus),
        "seconds": round(time.time() - start, 1) if start is not None else None,
        "command": " ".join(["pytest", *sys.argv[1:]]),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }


def write(config: pytest.Config, session: pytest.Session, workers: dict[str, Any]) -> None:
    """Write ``--sparse-mla-report-json`` and ``--sparse-mla-report-md``, those given."""
    opts = options.get_options(config)
    doc = document(config, session, workers)
    if opts.report_json is not None:
        opts.report_json.write_text(json.dumps(doc, indent=2, sort_keys=True, default=str) + "\n")
    if opts.report_md is not None:
        from pytest_sparse_mla import conformance

        report = conformance.build(
            [conformance.row_of(doc)], machine=conformance.machine_of(doc), command=doc["command"],
            title=f"Conformance of {conformance.label_of(doc)}", generated_by="--sparse-mla-report-md",
        )  # fmt: skip
        opts.report_md.write_text(conformance.markdown(report))
