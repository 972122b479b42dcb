"""Which error classes ran for the implementation under test, and why the others did not.

Each suite test names the error classes it exists for: the marker
``sparse_mla_error_class("name", ...)`` and, for a test parametrised over an
``attention.cases.AttentionCase``, the classes of that case (``attention.cases.case_classes``).
At run time the ``sparse_mla_inputs`` fixture records the classes of the case *after* fitting it to
the implementation's envelope (a dropped extra cache no longer counts as ``peaked-extra``), and what
the fitting changed. The controller (pytest-xdist carries ``user_properties`` from the workers)
gathers every report into one table: per class, the tests that ran it, passed and failed, and the
reasons of those that did not (not applicable to the envelope, a missing capability, a device).
The terminal summary prints it; ``--sparse-mla-report-json`` stores it under ``"coverage"``.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import pytest

from pytest_sparse_mla.shards import merge_slot, merge_summaries

__all__ = [
    "MARKER", "INTENDED", "RAN", "FITTED", "SEARCH", "Coverage", "mark_intended", "get", "merge_dims",
    "merge_summaries",
]  # fmt: skip

MARKER = "sparse_mla_error_class"
#: ``user_properties`` keys: classes a test exists for, classes it ran, what fitting changed.
INTENDED = "sparse_mla_intended"
RAN = "sparse_mla_ran"
FITTED = "sparse_mla_fitted"
#: ``user_properties`` key of a search test's summary (``search_run.SearchRun.summary``).
SEARCH = "sparse_mla_search"
#: The search's counters of draws not made (``search_run``'s ``NotMade`` kinds and regions), as the
#: terminal table names them.
NOT_MADE = {
    "cold-shape": "shape not warm, warm-up budget spent",
    "time-limit": "refinement past the time share (region moves, shrinking phases)",
    "out-of-memory": "out of device memory",
    "not-made-in-region": "inside a region (found or known)",
}
_KEY = pytest.StashKey["Coverage"]()


def _case_classes(item: pytest.Item) -> tuple[str, ...]:
    callspec = getattr(item, "callspec", None)
    case = callspec.params.get("case") if callspec is not None else None
    if case is None or not hasattr(case, "requires") or not hasattr(case, "values"):
        return ()
    from pytest_sparse_mla.attention.cases import case_classes

    return case_classes(case)


def mark_intended(items: list[pytest.Item]) -> None:
    """At collection: store the intended classes of each item that judges the implementation under
    test (uses ``sparse_mla_impl``) in its ``user_properties``."""
    for item in items:
        if "sparse_mla_impl" not in getattr(item, "fixturenames", ()):
            continue
        names: list[str] = []
        for mark in item.iter_markers(MARKER):
            names += [str(n) for n in mark.args]
        names += _case_classes(item)
        if names:
            item.user_properties.append((INTENDED, tuple(dict.fromkeys(names))))


class Coverage:
    """Per-class counts gathered from test reports (controller side)."""

    def __init__(self) -> None:
        self.ran: Counter[str] = Counter()
        self.passed: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self.not_run: dict[str, Counter[str]] = defaultdict(Counter)
        self.intended: Counter[str] = Counter()
        self.search: list[dict[str, Any]] = []

    def add(self, report: pytest.TestReport) -> None:
        """Count one report: the ``call`` phase, or a ``setup`` phase that skipped or failed."""
        if report.when == "teardown" or (report.when == "setup" and report.passed):
            return
        props: dict[str, Any] = dict(report.user_properties)
        if report.when == "call" and SEARCH in props:
            self.search.append(props[SEARCH])
        intended: tuple[str, ...] = tuple(props.get(INTENDED, ()))
        if not intended:
            return
        recorded: list[tuple[str, ...]] = [tuple(v) for k, v in report.user_properties if k == RAN]  # type: ignore[arg-type]
        ran = tuple(dict.fromkeys(name for names in recorded for name in names)) if recorded else intended
        for name in intended:
            self.intended[name] += 1
        if report.skipped and not hasattr(report, "wasxfail"):
            reason = _skip_reason(report)
            for name in intended:
                self.not_run[name][reason] += 1
            return
        for name in dict.fromkeys(intended + ran):
            if name not in ran:
                self.not_run[name]["fitting dropped it: " + "; ".join(props.get(FITTED, ()))] += 1
                continue
            self.ran[name] += 1
            if report.failed:
                self.failed[name] += 1
            elif report.passed or hasattr(report, "wasxfail"):
                self.passed[name] += 1

    def rows(self) -> list[dict[str, Any]]:
        """One dict per class: ``class``, ``ran``, ``passed``, ``failed``, ``not_run`` (count),
        ``why_not`` (the commonest reason, with its count)."""
        out = []
        for name in sorted(set(self.intended) | set(self.ran)):
            reasons = self.not_run.get(name, Counter())
            why = [f"{count} x {reason}" for reason, count in reasons.most_common(3)]
            out.append({
                "class": name, "ran": self.ran[name], "passed": self.passed[name], "failed": self.failed[name],
                "not_run": sum(reasons.values()), "why_not": why,
            })  # fmt: skip
        return out

    def lines(self, stopped_early: bool = False) -> list[str]:
        """The terminal table; ``stopped_early``: the session stopped before every collected test ran
        (a usage error, ``-x``, a dead CUDA context without xdist), so the classes of the tests it did
        not reach are not in the table, and the last line says so."""
        rows = self.rows()
        if not rows:
            return []
        width = max(len(r["class"]) for r in rows)
        lines = [f"{'error class':<{width}}  ran  pass  fail  not-run  why not (commonest)"]
        for r in rows:
            why = r["why_not"][0] if r["why_not"] else ""
            lines.append(
                f"{r['class']:<{width}}  {r['ran']:>3}  {r['passed']:>4}  {r['failed']:>4}  "
                f"{r['not_run']:>7}  {why[:110]}"
            )
        never = [r["class"] for r in rows if not r["ran"]]
        tail = ""
        if stopped_early:
            tail = " (the run stopped early: the classes of the tests it did not reach are not counted)"
        lines.append(f"classes that never ran: {', '.join(never) if never else 'none'}{tail}")
        return lines

    def search_report(self) -> dict[str, Any] | None:
        """What the search drew over the session (``merge_summaries``), or ``None`` when no search ran."""
        return merge_summaries(self.search) if self.search else None

    def search_lines(self) -> list[str]:
        """The terminal table of the search: per input-space dimension, the range or the categories drawn."""
        report = self.search_report()
        if report is None:
            return []
        from pytest_sparse_mla import input_space

        lines = [f"{report['tests']} search tests, {report['calls']} calls drawn (shrinking included), "
                 f"{report['failed']} failed"]  # fmt: skip
        spent = report.get("spent", {})
        by_region = sorted(report.get("in_regions", {}).items(), key=lambda kv: (-kv[1], kv[0]))
        held = f" ({', '.join(f'[{k}] {n}' for k, n in by_region)})" if by_region else ""  # most first
        not_made = [f"{NOT_MADE[k]} {spent[k]}{held if k == 'not-made-in-region' else ''}"
                    for k in NOT_MADE if spent.get(k)]  # fmt: skip
        if not_made:
            lines.append(f"calls not made: {', '.join(not_made)}")
        names = [d.name for d in input_space.DIMENSIONS]
        names += sorted(set(report["dims"]) - set(names))
        width = max(len(n) for n in names)
        for name in names:
            slot = report["dims"].get(name)
            if slot is None:
                lines.append(f"{name:<{width}}  (not drawn)")
            elif "min" in slot:
                lines.append(f"{name:<{width}}  {slot['min']:g} .. {slot['max']:g}")
            else:
                values = sorted(slot["values"].items(), key=lambda kv: -kv[1])
                text = ", ".join(f"{v} ({n})" for v, n in values)
                lines.append(f"{name:<{width}}  {text[:150]}{'...' if len(text) > 150 else ''}")
        return lines


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


def get(config: pytest.Config) -> Coverage:
    """The session's :class:`Coverage` (created on first use)."""
    cov = config.stash.get(_KEY, None)
    if cov is None:
        cov = config.stash[_KEY] = Coverage()
    return cov


def merge_dims(drawn: list[dict[str, Any]]) -> dict[str, Any]:
    """Per dimension of the drawn calls' records: the range of the numbers drawn (``{"min", "max"}``)
    or the count of each category (``{"values": {value: count}}``)."""
    out: dict[str, Any] = {}
    for row in drawn:
        for name, value in row.items():
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            slot = {"min": value, "max": value} if number else {"values": {str(value): 1}}
            merge_slot(out.setdefault(name, {}), slot)
    return out
