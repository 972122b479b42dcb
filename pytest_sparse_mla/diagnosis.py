"""A failure's likely cause and its evidence, as the console prints them and as the artefacts carry
them (the Markdown and JSON reports, the draft xfail file).

The comparisons (:mod:`pytest_sparse_mla.tolerances`) and the search (:func:`pytest_sparse_mla.search.diagnose`)
name what a wrong result points to in lines of one form, written by :func:`cause_line`::

    likely cause [sink-or-normaliser]: the output is off by a per-head constant factor (head 32: x1.05, ...): ...

``KEY`` is stable across tests, shapes and runs (it names the cause, never a number of the call),
so the same bug met by many tests is one cause; the text after it carries the call's numbers. A
failure's *evidence* is the first measured violation its message states (its first ``FAIL`` line:
the quantity, how many elements or rows, where, the bound) and the failure's other hint lines.

:func:`read` recovers a failure's :class:`Diagnosis` from its text (a test report's message, a JUnit
message): the first cause line whose counterfactual call the result matches (:data:`MATCHED`, the
search's strongest evidence) or else the first cause line; ``None`` fields when the text has none.
Pure string handling: this module imports neither torch nor pytest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Diagnosis", "LANE_KEYS", "MATCHED", "cause_keys", "cause_line", "read"]

#: Words of a search hint whose counterfactual call's oracle the result matches (``search.diagnose``).
MATCHED = "the output matches that call's oracle"

#: Causes about which lanes a kernel reads (indices, their masking, ``topk_length``): a failure
#: with one of them shows the call's index values (``search.describe_call``).
LANE_KEYS: frozenset[str] = frozenset(
    {"index-0-treated-as-invalid", "topk_length-ignored", "masked-or-stale-lane-read", "empty-row-not-zero",
     "masked-lane-scored"}
)  # fmt: skip

_CAUSE = re.compile(r"^\s*(?:E\s+)?likely cause(?: \[(?P<key>[A-Za-z0-9_.=-]+)\])?: (?P<text>.*\S)\s*$")
_FAIL = re.compile(r"^\s*(?:E\s+)?FAIL (?P<text>.*\S)\s*$")
_HINT = re.compile(r"^\s*(?:E\s+)?(?P<text>only heads .*|wrong tokens start .*|the wrong rows are mostly .*)$")


def cause_line(key: str, text: str) -> str:
    """``"likely cause [KEY]: TEXT"``, the one form every hint is printed in (module docstring).

    Raises:
        ValueError: ``key`` holds characters other than letters, digits, ``_ . = -`` (it must be
            usable as an xfail file's ``[KEY]``).
    """
    if not re.fullmatch(r"[A-Za-z0-9_.=-]+", key):
        raise ValueError(f"cause key {key!r}: expected letters, digits and '_.=-' only")
    return f"likely cause [{key}]: {text}"


def cause_keys(message: str) -> list[str]:
    """The keys of every ``likely cause [KEY]:`` line of ``message``, in order."""
    return [m.group("key") for line in message.splitlines() if (m := _CAUSE.match(line)) and m.group("key")]


@dataclass(frozen=True)
class Diagnosis:
    """What a failure's text says about its cause.

    Attributes:
        key: the cause's stable key (``None``: the text names no cause).
        cause: the cause's text, the call's numbers included (``None`` with ``key``).
        evidence: the first measured violation (``FAIL`` line) and the other hint lines, joined
            with ``"; "`` (``None``: the text states none).
    """

    key: str | None = None
    cause: str | None = None
    evidence: str | None = None

    def as_dict(self) -> dict[str, str | None]:
        """``{"cause_key", "cause", "evidence"}`` (the JSON report's fields of a test)."""
        return {"cause_key": self.key, "cause": self.cause, "evidence": self.evidence}


def read(message: str) -> Diagnosis:
    """The :class:`Diagnosis` of a failure's text (module docstring)."""
    causes: list[tuple[str | None, str]] = []
    fails: list[str] = []
    hints: list[str] = []
    for line in message.splitlines():
        m = _CAUSE.match(line)
        if m:
            causes.append((m.group("key"), m.group("text")))
            continue
        m = _FAIL.match(line)
        if m:
            fails.append(m.group("text"))
            continue
        m = _HINT.match(line)
        if m:
            hints.append(m.group("text"))
    chosen = next((c for c in causes if MATCHED in c[1]), causes[0] if causes else None)
    others = [f"likely cause: {text}" for c in causes if c is not chosen for text in (c[1],)]
    evidence = [*fails[:1], *hints, *others[:2]]
    joined = "; ".join(dict.fromkeys(evidence)) or None
    if chosen is None:
        return Diagnosis(None, None, joined)
    return Diagnosis(chosen[0], chosen[1], joined)
