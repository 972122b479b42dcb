"""``--sparse-mla-xfail-draft PATH``: a draft xfail file written from a run's failures (the logic
behind the hooks in :mod:`pytest_sparse_mla.plugin`).

A kernel with known discrepancies gets a green run from an xfail file (``--sparse-mla-xfail-file``,
:mod:`pytest_sparse_mla.selection`) in the format of the shipped ones (``pytest_sparse_mla/xfail/*.txt``)::

    # [KEY] kind: what differs, where in the kernel, the smallest input
    suites/test_attention_inputs.py::test_bad_input_raises_a_clear_error[q-float32]     # KEY

This module writes a first version of that file from a run: one discrepancy per likely cause,
since one bug met by many tests is one discrepancy. A failure's cause is read from its message
(:mod:`pytest_sparse_mla.diagnosis`: the ``likely cause [KEY]: ...`` lines the comparisons and the
search print, the same ``KEY`` for the same cause in every test), and the key is that cause's
``KEY``. Only a failure that names no cause falls back to its test group: the first error class the
failing test exists for (its ``sparse_mla_error_class`` marker or its case's classes,
``coverage.INTENDED``; the test function's name for a test without one). Each discrepancy is
defined with kind ``bug`` and, as its text, ``DRAFT (N test(s)):``, the likely cause and the
evidence of its first failure (the first measured violation and the other hints, as the console
printed them), or the first line of its first failure when no cause is known; then every failing
test id of the discrepancy with ``# KEY``. Ids are the checkout-style ids of the shipped suites
(``suites/<file>::<test>``, which match in a checkout and in an installed package;
``selection.report_id``) and node ids otherwise. Failures of the setup or call phase
count; an XPASS of a test already in an xfail file does not (it is a fix, not a discrepancy), nor
does a teardown error.

The draft is for review: rename each key, set the kind (``convention`` or ``bug``) and write the
text the shipped files have (what differs, where, the smallest input). A run with the draft is
green; fixing one discrepancy makes the run fail on the XPASS when ``xfail_strict`` is on (as in
this project's own ``pyproject.toml``).

Collected on the controller from the reports (pytest-xdist carries ``user_properties``); this
module imports neither torch nor triton.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pytest_sparse_mla import coverage, diagnosis, selection

__all__ = ["Draft", "get", "render", "write"]
_STASH = pytest.StashKey["Draft"]()
_KEY_CHARS = re.compile(r"[^A-Za-z0-9_-]+")


@dataclass
class Draft:
    """The failures of a session, grouped by key (controller side): ``{key: [(test id, text)]}``,
    the text of a test its likely cause and evidence (module docstring)."""

    groups: dict[str, list[tuple[str, str]]] = field(default_factory=dict)

    def add(self, report: pytest.TestReport) -> None:
        """Count a failed setup or call report (not an XPASS(strict): a fix, not a discrepancy)."""
        if not report.failed or report.when not in ("setup", "call"):
            return
        text = str(report.longrepr or "")
        if "[XPASS(strict)]" in text:
            return
        props = dict(report.user_properties)
        test = str(getattr(report, selection.REPORT_ID_ATTR, None) or report.nodeid)
        message = _message(report)
        found = diagnosis.read(message)
        if found.key is not None and found.cause is not None:
            key = found.key
            text = f"likely cause: {found.cause}" + (f" | evidence: {found.evidence}" if found.evidence else "")
        else:
            intended = props.get(coverage.INTENDED)
            classes: tuple[str, ...] = tuple(intended) if isinstance(intended, (tuple, list)) else ()
            key = classes[0] if classes else report.nodeid.split("::")[-1].split("[")[0]
            text = next((ln.strip() for ln in message.splitlines() if ln.strip()), "failed")
            if found.evidence:
                text += f" | evidence: {found.evidence}"
        key = _KEY_CHARS.sub("-", str(key)).strip("-") or "failure"
        entries = self.groups.setdefault(key, [])
        if all(t != test for t, _ in entries):
            entries.append((test, text))


def _message(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return str(crash.message)
    return str(report.longrepr or "")


def render(draft: Draft, impl: str) -> str:
    """The draft file's text (module docstring)."""
    total = sum(len(v) for v in draft.groups.values())
    out = [
        f"# DRAFT xfail file for --sparse-mla-impl {impl}, written by --sparse-mla-xfail-draft on "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC from {total} failing test(s).",
        "# Review before use: rename each [KEY], set its kind (convention or bug) and replace its text with what",
        "# differs, where in the kernel, and the smallest input. Use it with --sparse-mla-xfail-file PATH.",
        "",
    ]
    if any("test_attention_search.py::" in t for entries in draft.groups.values() for t, _ in entries):
        out += [
            "# Note: a search test listed here is xfailed for every call it draws, so the property stops judging",
            "# this kernel; keep it only for a discrepancy the fixed cases list too, or narrow the kernel's envelope.",
            "",
        ]
    for key, entries in draft.groups.items():
        text = entries[0][1].replace("\n", " ")[:600]
        out.append(f"# [{key}] bug: DRAFT ({len(entries)} test(s)): {text}")
    width = max((len(t) for entries in draft.groups.values() for t, _ in entries), default=0)
    for key, entries in draft.groups.items():
        out.append("")
        for test, _ in entries:
            out.append(f"{test.ljust(width)}     # {key}")
    return "\n".join(out) + "\n"


def get(config: pytest.Config) -> Draft:
    """The session's draft (one per config)."""
    draft = config.stash.get(_STASH, None)
    if draft is None:
        draft = config.stash[_STASH] = Draft()
    return draft


def write(config: pytest.Config, path: Path, impl: str) -> None:
    """Write the draft to ``path`` (also with no failure: a file with the header only)."""
    path.write_text(render(get(config), impl))
