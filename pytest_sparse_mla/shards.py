"""The search's shards: which shards a session runs, the seed each shard draws from, and the merge
of search summaries from several shards, workers and machines.

A search test (one that uses the ``sparse_mla_search`` fixture) is parametrised over *shards*
(``--sparse-mla-search-shards K``, ids ``shard0`` ... ``shard{K-1}``); pytest-xdist spreads them
over the workers of one machine. A CI matrix of ``N`` machines splits the same search further:
``--sparse-mla-search-shard-group I/N`` (machine ``I`` of ``N``, counted from 0) makes the session
run the *global* shards ``I*K .. I*K+K-1`` instead (:func:`session_shards`; ids ``shard{global}``),
so the ``N`` machines together run exactly the shards ``0 .. N*K-1`` that one machine would run with
``--sparse-mla-search-shards N*K``, test id for test id and seed for seed.

Each shard draws its own calls (:func:`hypothesis_seed`): with ``--sparse-mla-search-seed S``,
shard ``g`` draws from seed ``S + g``; without one (derandomized), shard 0 draws Hypothesis's own
derandomized calls (a hash of the test function) and shard ``g > 0`` from a fixed seed derived from
the test function's name and ``g``, the same in every run and every process.

:func:`merge_summaries` merges the search summaries (``search_run.SearchRun.summary``: one per test
shard) of a session, and the merged summaries of several sessions (``--sparse-mla-report-json``'s
``"search"``, ``sparse-mla-report``), keeping keys it does not know by their shape.

Nothing here imports pytest, torch or hypothesis.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pytest_sparse_mla.errors import SparseMlaUsageError

__all__ = [
    "ENV",
    "INI",
    "OPTION",
    "ShardGroup",
    "header_lines",
    "hypothesis_seed",
    "merge_slot",
    "merge_summaries",
    "parse_group",
    "session_shards",
    "shard_id",
]

#: The command-line option, the environment variable and the ini key of a machine's shard group, in
#: the order they are read (the first one set wins; ``pytest_sparse_mla.options``).
OPTION = "--sparse-mla-search-shard-group"
ENV = "SPARSE_MLA_SEARCH_SHARD_GROUP"
INI = "sparse_mla_search_shard_group"

_GROUP = re.compile(r"^\s*(?P<index>[0-9]+)\s*/\s*(?P<count>[0-9]+)\s*$")


@dataclass(frozen=True)
class ShardGroup:
    """Machine ``index`` of a CI matrix of ``count`` machines (``0 <= index < count``).

    ``str()`` is the ``I/N`` form the option takes and the JSON report records.
    """

    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def shards(self, per_machine: int) -> range:
        """The global shard indices this machine runs: ``index*per_machine .. index*per_machine +
        per_machine - 1`` (``per_machine``: ``--sparse-mla-search-shards``, >= 1)."""
        return range(self.index * per_machine, (self.index + 1) * per_machine)


def parse_group(text: str, source: str = OPTION) -> ShardGroup:
    """Parse a shard group ``I/N``: machine ``I`` (counted from 0) of ``N`` machines.

    Args:
        text: the value as given (spaces around the numbers are allowed).
        source: where it came from, named in the error (``--sparse-mla-search-shard-group``,
            ``SPARSE_MLA_SEARCH_SHARD_GROUP``, ``ini sparse_mla_search_shard_group``).

    Raises:
        SparseMlaUsageError: not two non-negative integers ``I/N``; ``N`` is 0; ``I >= N``.
    """
    expected = "expected I/N, machine I of a matrix of N machines, counted from 0 (0 <= I < N), e.g. 0/4 .. 3/4"
    match = _GROUP.match(text)
    if match is None:
        raise SparseMlaUsageError(f"{source}={text!r}: {expected}")
    index, count = int(match["index"]), int(match["count"])
    if count < 1:
        raise SparseMlaUsageError(f"{source}={text!r}: the number of machines N must be >= 1; {expected}")
    if index >= count:
        raise SparseMlaUsageError(
            f"{source}={text!r}: machine {index} is not below the number of machines {count}; {expected}"
        )
    return ShardGroup(index, count)


def session_shards(per_machine: int, group: ShardGroup | None) -> range:
    """The global shard indices a session runs: ``0 .. per_machine-1`` without a group, else the
    group's share (:meth:`ShardGroup.shards`).

    Raises:
        SparseMlaUsageError: ``per_machine`` < 1.
    """
    if per_machine < 1:
        raise SparseMlaUsageError(f"--sparse-mla-search-shards={per_machine!r}: expected an integer >= 1")
    return range(per_machine) if group is None else group.shards(per_machine)


def header_lines(per_machine: int, group: ShardGroup | None, seed: int | None) -> list[str]:
    """The report header's line of a machine of a search matrix (none without a group): its group,
    its global shards, the matrix's shards and the seed they draw from."""
    if group is None:
        return []
    mine = group.shards(per_machine)
    draws = "derandomized" if seed is None else f"seeds {seed + mine[0]}..{seed + mine[-1]}"
    every = group.count * per_machine - 1
    return [f"sparse-mla: search shard group {group}: global shards {mine[0]}..{mine[-1]} of 0..{every} ({draws})"]


def shard_id(shard: int) -> str:
    """The test-id part of a global shard: ``shard{shard}``."""
    return f"shard{shard}"


def hypothesis_seed(seed: int | None, shard: int, test: Any, *, named: bool = False) -> int | None:
    """The seed global shard ``shard`` of a search test draws from (for ``hypothesis.seed``), or
    ``None`` to leave Hypothesis's own derandomization in place.

    Args:
        seed: ``--sparse-mla-search-seed`` (shard 0's seed), or ``None`` (derandomized).
        shard: the global shard index (>= 0).
        test: the ``@given`` function the shard runs, or with ``named`` the property it judges (its
            ``__module__`` and ``__qualname__``).
        named: ``test`` is not the function Hypothesis runs: the search run's rounds run one
            ``@given`` body for every property (``search_run.SearchRun``), whose hash every property
            would share, so derandomized shard 0 gets a seed from ``test``'s name too.

    Returns:
        ``seed + shard`` with a seed. Derandomized: ``None`` for shard 0 (Hypothesis derives the
        calls from a hash of the test function, as for any derandomized test) unless ``named``;
        for shard ``> 0`` (and shard 0 when ``named``) the first 8 bytes of the SHA-256 of
        ``"<module>:<qualname>:shard<k>"`` as an integer: the shard functions of one test share
        their source, so Hypothesis's own hash would draw the same calls in every shard.
    """
    if seed is not None:
        return seed + shard
    if shard == 0 and not named:
        return None
    name = f"{getattr(test, '__module__', '')}:{getattr(test, '__qualname__', type(test).__qualname__)}:shard{shard}"
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")


def merge_slot(target: dict[str, Any], slot: Mapping[str, Any]) -> None:
    """Merge one dimension's summary ``slot`` (``{"min", "max"}`` or ``{"values": {v: n}}``) into
    ``target`` (the range widened, the counts summed)."""
    if "min" in slot:
        target["min"] = min(target.get("min", slot["min"]), slot["min"])
        target["max"] = max(target.get("max", slot["max"]), slot["max"])
    for value, count in slot.get("values", {}).items():
        values = target.setdefault("values", {})
        values[value] = values.get(value, 0) + count


#: The keys :func:`merge_summaries` knows: summed counts, and the per-dimension table.
_COUNTS = ("calls", "failed")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_counts(value: Any) -> bool:
    """A dict of counts, or of dicts of counts (the search's ``spent`` and ``ends``)."""
    return isinstance(value, dict) and all(_is_count(v) or _is_counts(v) for v in value.values())


def _add_counts(target: dict[str, Any], counts: Mapping[str, Any]) -> None:
    for name, n in counts.items():
        if isinstance(n, Mapping):
            _add_counts(target.setdefault(name, {}), n)
        else:
            target[name] = target.get(name, 0) + n


def _merge_list(values: Iterable[list[Any]]) -> list[Any]:
    """Concatenated; a dict with a ``"key"`` string that an earlier dict has is folded into it (the
    earlier one's other fields kept; when either has a ``"count"``, the counts added, a dict without
    one counting 1)."""
    out: list[Any] = []
    keyed: dict[Any, dict[str, Any]] = {}
    for value in values:
        for item in value:
            key = item.get("key") if isinstance(item, dict) else None
            if key is None or not isinstance(key, str):
                out.append(item)
            elif key in keyed:
                first = keyed[key]
                if "count" in first or "count" in item:
                    first["count"] = int(first.get("count", 1)) + int(item.get("count", 1))
            else:
                keyed[key] = dict(item)
                out.append(keyed[key])
    return out


def merge_summaries(summaries: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """One search summary of several: the summaries of single test shards
    (``search_run.SearchRun.summary``: ``calls``, ``failed``, ``seed``, ``dims``) or summaries already
    merged (a run report's ``"search"``, which adds ``tests``), from one session or several machines.

    Returns:
        ``tests`` (the test shards summarised: a merged summary counts its ``tests``, a single one
        1), ``calls`` and ``failed`` summed, ``dims`` merged per dimension (:func:`merge_slot`),
        ``seed`` and every key the merge does not know by its shape: a list is concatenated (its
        dicts with a ``"key"`` string deduplicated by that key, their ``"count"`` summed: a
        discrepancy found by several shards is listed once, its first ``region`` kept; a dict without
        a ``"count"`` counts 1 where the other has one); a dict of integers (or of such dicts) is summed per key
        (counts); anything else is kept when every summary that has it agrees, else ``None`` (a
        count meant to be summed belongs in a dict of counts).
    """
    summaries = list(summaries)
    out: dict[str, Any] = {
        "tests": sum(int(s.get("tests", 1)) for s in summaries),
        **{key: sum(int(s.get(key, 0)) for s in summaries) for key in _COUNTS},
    }
    dims: dict[str, Any] = {}
    for s in summaries:
        for name, slot in s.get("dims", {}).items():
            merge_slot(dims.setdefault(name, {}), slot)
    out["dims"] = dims
    extra = dict.fromkeys(k for s in summaries for k in s if k not in ("tests", "dims", *_COUNTS))
    for key in extra:
        values = [s[key] for s in summaries if key in s]
        if all(isinstance(v, list) for v in values):
            out[key] = _merge_list(values)
        elif all(_is_counts(v) for v in values):
            counts: dict[str, Any] = {}
            for v in values:
                _add_counts(counts, v)
            out[key] = counts
        else:
            out[key] = values[0] if all(v == values[0] for v in values) else None
    return out
