"""One search test's run: the covering calls, then rounds of random draws, every distinct bug.

A search that stops at its first failure reports one bug per kernel: the frequent one, again and
again, in every shard. :class:`SearchRun` (the ``sparse_mla_search`` fixture) instead runs a
property (a function that judges one ``search.DrawnCall`` and raises on a discrepancy) as follows:

1. **The covering calls** of this shard (``pytest_sparse_mla.covering.schedule``: every end of every
   dimension's legal range the envelope admits; shard ``k`` of ``n`` takes calls ``k, k + n, ...``).
2. **Rounds of random draws** (Hypothesis, ``search.calls``): ``examples`` calls in all, the covering
   calls of step 1 counted among them (they are drawn instead of random calls, not beside them: the
   default budget of 8 is then spent on the covering calls of the oracle property, and the other
   properties, which take no covering calls, draw at random). Each property draws its own calls
   (``shards.hypothesis_seed`` of the property's name). A round ends at its first failure, which
   Hypothesis shrinks; the next round draws outside every region found so far.
3. **The region of each failure** (``pytest_sparse_mla.regions``): each dimension of the failing call
   is moved to its other classes, one at a time (:func:`moves`; the simplest class first, and a move
   under which the failure stays is kept, so this also simplifies a covering call, which Hypothesis
   did not draw and cannot shrink). A dimension whose every move makes the failure go away is one
   the failure needs alone (``query_layout=strided``, ``sm_scale=0``): the region is those
   dimensions, each at its class. When no dimension is needed alone (the failure needs one of
   several things), the region constrains each dimension some move of which made the failure go
   away, leaving out the classes under which it went away. A failure met again whose region pins
   a dimension to the same single class as an earlier one is the same cause: the earlier region
   grows to hold both. Calls drawn inside a region later are not made.
4. **Known regions** (``# [KEY] region: ...`` beside the xfail entries; ``regions.read_regions``):
   calls inside one are not made, except, in a test the xfail file lists, up to
   ``regions.CONFIRM_CALLS`` until one fails, which confirms the discrepancy under its key. The
   region search never moves a call into a known region. A region that names a dimension only a
   built call has (``regions.BUILT``: the largest query element, the heaviest slot's weight, the
   weight masked lanes scored at logit 0 would take) is
   decided once the call is built (:meth:`SearchRun.note`): a call built inside it is not made, or
   made to confirm it, the same way. A property that judges a derived call (rows padded with ``-1``
   lanes) gives its classes (``judged_as`` of :meth:`SearchRun.check`); every region is decided on
   those.

At the end the run raises one :class:`~pytest_sparse_mla.errors.NewDiscrepancy` listing every
distinct discrepancy (its key, region, check, likely cause, smallest call), or a
:class:`~pytest_sparse_mla.errors.KnownDiscrepancy` when every one lies in a known region. With
``--sparse-mla-repro-dir`` each gets its reproducer (the recorded call of its smallest call).

A test expected to fail (an xfail mark) whose xfail file names no region, and a run whose
Hypothesis profile has no shrink phase (the wrong-kernel gate's inner runs, which read only the
verdict), stop at their first failing call and raise it as it is.

**Compiling is not judged time** (CUDA). The first call of each new shape (every tensor argument's
shape, strides, dtype and alignment, which keywords are given: :meth:`SearchRun._shape`) is preceded by a warm-up
(:meth:`SearchRun.warm`, ``search_speed.warm``) inside ``untimed``: the test's time limit stops while
a Triton autotuner or JIT compiles (``device_health.untimed``). A kernel that autotunes per shape
can spend minutes this way, so a run's warm-ups have a budget (``warm_seconds``, default the test's
own limit): once it is spent, a drawn call of a shape not yet warm is judged on the shape of a call
this process has warmed (its values kept: seed, logit regime, ``sm_scale``, sink, masks, index
pattern, stale lanes, value exponents, scale ends; ``search.with_shape_of``; the warm call picked
by the drawn seed; ``spent["warm-twin"]`` counts them), so the budget of judged calls is still
spent on a kernel that autotunes per shape. A call for which no warm shape fits the envelope, a
region search's move to a new shape and a shape that still turns out cold are not made
(``spent["cold-shape"]``).

**A run ends inside its time limit.** A kernel with several distinct bugs costs a region search
each (dozens of calls) and Hypothesis's shrinking; on a shared GPU that can outlast the test's limit,
and pytest-timeout would then end the test with nothing reported. So a run has a share of the limit
for judged time (``judged_seconds``: the fixture gives :data:`TIME_SHARE` of the test's ``timeout``;
seconds outside the warm-ups): once it is spent, the run stops refining: no further region-search
move and no further shrinking step is made (``spent["time-limit"]`` counts the moves not made and
each shrinking phase cut, once), and a failure met after that keeps the call as drawn. The covering
calls, the random draws (bounded by the budget) and the confirmations of known regions are still
made, so an expected failure is still met, and every discrepancy is still reported with its
diagnosis. The region of a cut search keeps, for each dimension not fully moved, the call's own
class (never wider than the evidence), and the report says "region search cut by the time limit".

**Out of device memory is not a discrepancy.** A call that runs out of device memory (the guard's
tries, ``device_health.with_memory_retries``, all failed, or the inputs or the oracle could not be
allocated) is not made: ``spent["out-of-memory"]`` counts it, and the run goes on. Nor is it a pass:
a run that found nothing but left calls unjudged this way ends with ``OutOfDeviceMemory`` (an
environment failure, never xfailed), and a run that found discrepancies says how many calls it could
not judge.

What the run did goes to the test's ``user_properties`` (``summary``): calls made, the dimensions
and ends drawn, the discrepancies, and where the calls went (``"spent"``: covering, random draws
outside every region, confirmations inside known regions, region searches, draws not made).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pytest_sparse_mla import coverage, covering, recording, regions, search
from pytest_sparse_mla.covering import with_main
from pytest_sparse_mla.envelope import Envelope
from pytest_sparse_mla.errors import KnownDiscrepancy, NewDiscrepancy

__all__ = [
    "ColdShape", "NotMade", "OutOfMemory", "OutOfTime", "Discrepancy", "MAX_DISCREPANCIES", "SearchError", "TIME_SHARE",
    "SearchRun", "moves",
]  # fmt: skip

#: A run stops looking once it holds this many distinct discrepancies.
MAX_DISCREPANCIES = 8
#: The share of a search test's time limit (judged time) after which its run stops refining: no
#: region-search move or shrinking step is made past it (module docstring, "A run ends inside its
#: time limit"); the rest is for the draws still due and each reported discrepancy's diagnosis.
TIME_SHARE = 0.5
#: Seed offset between two rounds of one run (far above any shard index).
ROUND_STRIDE = 1_000_003


class NotMade(Exception):  # noqa: N818 - a call not made, not an error
    """A drawn call that is not judged; ``spent[counter]`` counts it."""

    counter = "not-made"


class ColdShape(NotMade):
    """A call of a shape the kernel has not been warmed on, met after the run's warm-up budget is
    spent: the call is not made (module docstring, "Compiling is not judged time")."""

    counter = "cold-shape"


class OutOfTime(NotMade):
    """A region-search move met after the run's share of the time limit (``judged_seconds``) is
    spent: not made (module docstring, "A run ends inside its time limit")."""

    counter = "time-limit"


class InRegion(NotMade):
    """A call that lies in a region: a found one, a known one already confirmed (or not to be
    confirmed in this test), or, for a call that lies there by a dimension only a built call has
    (``regions.BUILT``), any known one during a region search: not made. ``key``: the region's
    cause."""

    counter = "not-made-in-region"

    def __init__(self, text: str, key: str) -> None:
        super().__init__(text)
        self.key = key


class SearchError(BaseException):
    """An error of the search's own code inside the property: classing or recording a call, or any
    exception raised before the property called the kernel (:attr:`SearchRun.last_kernel_call`).
    A ``BaseException``, as pytest's outcomes are, so neither the run nor Hypothesis takes it for a
    failure of the kernel; the test fails with it and its cause."""


class OutOfMemory(NotMade):
    """A call that ran out of device memory (``device_health.is_out_of_memory``: the guard's tries
    all failed, or the inputs or the oracle could not be allocated): an environment condition, not
    a discrepancy of the kernel; counted, not judged."""

    counter = "out-of-memory"


@dataclass
class Discrepancy:
    """One distinct discrepancy of a run.

    Attributes:
        region: where it lives (its ``key`` is the xfail file's for a known one, ``new-N`` else).
        call: its smallest call (shrunk by Hypothesis and by the region search).
        message: the failure's text on that call (the check, the likely cause, the call in words).
        recorded: the recorded calls of that call (``--sparse-mla-repro-dir``).
        count: calls that failed inside its region (the first included).
        cut: its region search was cut by the run's time share (the region holds the moves made).
    """

    region: regions.Region
    call: Any
    message: str
    recorded: list[Any] = field(default_factory=list)
    count: int = 1
    cut: bool = False

    def as_dict(self) -> dict[str, Any]:
        """JSON form (the run's summary): ``key`` is the cause, the same in every test and shard that
        finds it (a known region's key; ``new: <region>`` for one found in this run), ``name`` the
        run's own name for it."""
        first = next((line for line in self.message.splitlines() if line.strip()), "")
        cause = _cause(self.region)
        out = {**self.region.as_dict(), "key": cause, "name": self.region.key, "check": first[:300],
               "call": self.call.describe(), "count": self.count}  # fmt: skip
        return {**out, "region_search": "cut by the time limit"} if self.cut else out

    def text(self) -> str:
        """The block of the failure message for this discrepancy."""
        kind = "known" if self.region.known else "new"
        cut = "; region search cut by the time limit" if self.cut else ""
        return (f"[{self.region.key}] ({kind}; region: {self.region.text()}{cut}; {self.count} failing call(s))\n"
                + "\n".join("    " + line for line in self.message.strip().splitlines()))  # fmt: skip


def moves(call: Any, envelope: Envelope) -> list[tuple[str | None, list[Any]]]:
    """Per dimension of ``regions.FEATURES`` (``None``: a simplification that no region names), the
    calls that differ from ``call`` in that dimension's class only, the simplest first (the region
    search keeps the first move when the failure stays under it, so the reported call only gets
    simpler)."""
    m = call.main
    out: list[tuple[str | None, list[Any]]] = []
    rep = dataclasses.replace

    def add(dim: str | None, alts: Sequence[Any]) -> None:
        feats = regions.features(call)
        keep = [a for a in alts if a != call and (dim is None or regions.features(a)[dim] != feats[dim])]
        if keep:
            out.append((dim, keep))

    add("fmt", [rep(call, fmt=f) for f in envelope.formats])
    add("num_tokens", [rep(call, num_tokens=t) for t in (1, 8, 65, 300)])
    add("num_heads", [rep(call, num_heads=h) for h in (envelope.num_heads or (1, 8, 64, 192))])
    lo = -(-max(envelope.topk.min, envelope.topk.multiple) // envelope.topk.multiple) * envelope.topk.multiple
    add("topk", [with_main(call, width=w) for w in sorted({lo, max(lo, 64), max(lo, 640)})])
    add("topk_length", [with_main(call, lengths=None)]
        + [with_main(call, lengths=(0, m.width))] * (m.lengths is not None))  # fmt: skip
    add("masked_lanes", [with_main(call, masked_fraction=0.0), with_main(call, masked_fraction=0.5, mask_value=-1)])
    add("mask_placement", [with_main(call, scattered=not m.scattered)] * (0 < m.masked_fraction < 1))
    add("empty_rows", [rep(call, empty_fraction=0.0)])
    add("index_pattern", [with_main(call, pattern=p) for p in ("uniform", "few", "ends", "one-page")])
    add("stale_lanes", [with_main(call, stale=s) for s in ("-1", "1<<30", "poisoned-slot")])
    sizes = envelope.page_block_sizes or (64, 1, 16, 128, 256)
    add("page_block_size", [with_main(call, page_block_size=p) for p in sizes])
    add("extra_cache", [rep(call, extra=None)])
    add("value_exponent", [with_main(call, value_exponent=0)])
    add("rope_exponent", [with_main(call, rope_exponent=0)])
    add("value_spread", [with_main(call, wide=False)])
    add("scale_end", [with_main(call, scale_end="none")])
    add("score_spread", [rep(call, score_spread=s) for s in (0.3, 0.0, 8.0)])
    add("score_offset", [rep(call, score_offset=0.0)])
    add("peak", [rep(call, peak=0.0)])
    add("sm_scale", [rep(call, sm_scale=(name, value)) for name, value in
                     (("512**-0.5", 512**-0.5), ("1", 1.0), ("0", 0.0), ("-512**-0.5", -(512**-0.5)))])  # fmt: skip
    add("attn_sink", [rep(call, sink=None), rep(call, sink=(0.0,)), rep(call, sink=(float("-inf"),))])
    add("lse_convention", [rep(call, lse_convention=c) for c in envelope.lse_conventions])
    add("cache_form", [with_main(call, form=f) for f in ("nhd", "2d", "3d", "hnd")])
    add("page_stride", [with_main(call, stride=s) for s in ("padded", "tight", 256)])
    add("storage_offset", [with_main(call, layer=0, num_layers=1, canary=0), with_main(call, layer=0),
                           with_main(call, layer=1, num_layers=max(2, m.num_layers))])  # fmt: skip
    if call.extra is not None:
        add("extra_storage_offset", [rep(call, extra=dataclasses.replace(call.extra, layer=0, num_layers=1, canary=0))])
        add("extra_stale_lanes", [rep(call, extra=dataclasses.replace(call.extra, stale=s))
                                  for s in ("-1", "1<<30", "poisoned-slot")])  # fmt: skip
        add("extra_scale_end", [rep(call, extra=dataclasses.replace(call.extra, scale_end="none"))])
        add("extra_value_exponent", [rep(call, extra=dataclasses.replace(call.extra, value_exponent=0))])
        add("extra_rope_exponent", [rep(call, extra=dataclasses.replace(call.extra, rope_exponent=0))])
        add("extra_value_spread", [rep(call, extra=dataclasses.replace(call.extra, wide=False))])
        unmasked = dataclasses.replace(call.extra, masked_fraction=0.0)
        add("extra_masked_lanes", [rep(call, extra=unmasked),
                                   rep(call, extra=dataclasses.replace(unmasked, masked_fraction=0.5, mask_value=-1))])
    add("query_layout", [rep(call, strided_query=not call.strided_query)])
    add(None, [rep(call, seed=0)])
    return out


class SearchRun:
    """The search run of one test (the ``sparse_mla_search`` fixture; module docstring).

    Args:
        examples: calls to judge: this shard's covering calls, then random draws up to this
            count (``max_examples`` over all rounds; none when the covering calls reach it). The
            region searches and shrinking come on top.
        seed: ``None``: derandomized, no example database; else the seed of this shard (``seed +
            shard``).
        shard, shards: this test's shard index and the number of shards of the search (the
            covering calls are dealt over the shards).
        keep: called as ``keep(coverage.SEARCH, summary)`` when the run ends, pass or fail.
        shrink: ``False`` for a test expected to fail: see the module docstring.
        known: the known regions (from the session's xfail file).
        confirm: make up to ``regions.CONFIRM_CALLS`` calls inside each known region, to report it
            under its key (a test the xfail file lists: it expects the discrepancy); ``False`` (a test
            not listed): calls inside a known region are never made.
        untimed: a context manager factory under which a warm-up runs outside the test's time
            limit (``device_health.untimed`` of the test's item); ``None``: warm-ups are timed.
        warm_seconds: the run's warm-up budget in seconds (module docstring, "Compiling is not
            judged time"); ``None``: unlimited.
        judged_seconds: the run's share of the time limit in seconds, warm-ups not counted (module
            docstring, "A run ends inside its time limit"); ``None``: unlimited.
    """

    def __init__(
        self, examples: int, seed: int | None, shard: int, keep: Any, shrink: bool = True, shards: int = 1,
        known: Sequence[regions.Region] = (), confirm: bool = True, untimed: Callable[[], Any] | None = None,
        warm_seconds: float | None = None, judged_seconds: float | None = None,
    ) -> None:  # fmt: skip
        self.examples, self.seed, self.shard, self.shards = examples, seed, shard, max(1, shards)
        self.keep, self.shrink, self.known = keep, shrink, list(known)
        self.drawn: list[dict[str, Any]] = []
        self.ends: dict[str, Counter[str]] = {}
        self.spent: Counter[str] = Counter()
        #: Draws not made because they lie in a region, per cause (a known region's key, ``new: <region>``
        #: for one found in this run, as :meth:`Discrepancy.as_dict` names it): where
        #: ``spent["not-made-in-region"]`` went.
        self.in_regions: Counter[str] = Counter()
        self.found: list[Discrepancy] = []
        self.failed = False
        self._confirm_left = {r.key: regions.CONFIRM_CALLS if confirm else 0 for r in self.known}
        #: A call of each shape this process has warmed (``search_speed.shape_key`` -> the call):
        #: the shapes a drawn call of a cold shape is judged on once the warm-up budget is spent.
        self._warm_calls: dict[tuple[Any, ...], Any] = {}
        self._noted: tuple[Any, Any] = (None, None)  # the shape key and call :meth:`note` saw last
        #: The known region the call being judged confirms by a dimension only its build has
        #: (:meth:`note`), or ``None``; ``_built_open``: whether the next note is a judged call's first.
        self.built_region: regions.Region | None = None
        self._built_open = False
        self._round_shapes: list[Any] | None = None  # inside a round: its warm calls (once a twin was made)
        self._envelope: Envelope | None = None
        self._judged_as: Callable[[Any, dict[str, str]], dict[str, str]] | None = None
        self._device = "cpu"
        #: The call :meth:`_judge` made last: the drawn one, or its warm twin.
        self.judged: Any = None
        self._phase = "random"
        self._untimed, self.warm_seconds, self.warm_spent = untimed, warm_seconds, 0.0
        self.judged_seconds: float | None = judged_seconds
        self._started: float | None = None  # the clock at the first check
        #: The clock of the time share (seconds; a self-test replaces it).
        self.clock: Callable[[], float] = time.monotonic
        #: Whether the property should explain a failure (``search.diagnose``: several more oracle
        #: calls): only for the call a discrepancy is reported with, not for each call Hypothesis
        #: shrinks through or the region search moves.
        self.hints = True
        #: The guard's last kernel call of the test (``device_health.last_call``; the fixture sets it):
        #: a property that raises before the kernel is called again fails on the search's own fault
        #: (:class:`SearchError`), never as a discrepancy. ``None``: every failure is the kernel's
        #: (a self-test's property that stands in for a kernel).
        self.last_kernel_call: Callable[[], Any] | None = None

    # --- what the property reports ---------------------------------------------------------------

    def note(self, call: Any, inputs: Any = None, judged: Any = None) -> None:
        """Record one built call (every call made: covering, drawn, shrunk, region searches):
        ``inputs`` are its built tensors (``search.build``), ``judged`` the tensors the property
        passes to the kernel when they differ from ``inputs`` (rows permuted and padded: another
        shape): the shape warmed and looked up is theirs.

        Raises:
            ColdShape: on CUDA, the judged inputs have a shape not yet warmed and the warm-up budget
                is spent (the call is not recorded and must not be made).
            InRegion: the built call lies in a region by its :data:`regions.BUILT` dimensions.
            SearchError: classing the built call failed (a fault of the search, not the kernel's).
        """
        key = self._shape(judged if judged is not None else inputs)
        if key is not None and not self._is_warm(key) and self._warm_budget_spent():
            raise ColdShape(call.describe())
        if self._built_open and inputs is not None:  # the judged call's own build (not a derived call's)
            self._built_open = False
            try:
                self._classify_built(call, inputs, judged if judged is not None else inputs)
            except NotMade:
                raise
            except Exception as exc:
                raise SearchError(f"classing the built call failed: {exc!r}; call: {call.describe()}") from exc
        if key is not None and self._is_warm(key):
            self._warm_calls.setdefault(key, call)
        self._noted = (key, call)
        self.drawn.append(search.record(call, inputs))
        for dim, labels in covering.ends_of(call).items():
            self.ends.setdefault(dim, Counter()).update(labels)

    def _classify_built(self, call: Any, inputs: Any, judged: Any) -> None:
        """The region ``call`` lies in by its :data:`regions.BUILT` dimensions (of its built
        ``inputs``; the masked lanes those of ``judged``, the tensors the kernel gets, whose rows a
        property may permute, which moves no row's sums, and pad with ``-1`` lanes, which count), where its
        drawn values alone put it in none: a known region still to be confirmed is kept in
        :attr:`built_region` (the call is made and confirms it, as a drawn call inside it would);
        any other region raises :class:`InRegion`, and so does every region during a region search
        (which never moves into a known region)."""
        if self._inside(call) is not None or not any(set(r.conditions) & set(regions.BUILT) for r in self.known):
            return
        built = regions.built_features(inputs.q, inputs.scores, _slots(inputs), search.masked_lanes(judged))
        region = self._inside(call, built)
        if region is None:
            return
        confirming = region.known and self._confirm_left.get(region.key, 0) > 0
        if confirming and self._phase != "region-search":
            self.built_region = region
            return
        raise InRegion(call.describe(), _cause(region))

    @staticmethod
    def _shape(inputs: Any) -> tuple[Any, ...] | None:
        """``search_speed.shape_key`` of the built call (``None`` on the CPU)."""
        from pytest_sparse_mla import search_speed

        if inputs is None:
            return None
        return search_speed.shape_key(inputs.q, inputs.kv_cache, inputs.indices, inputs.kwargs)

    @staticmethod
    def _is_warm(key: tuple[Any, ...]) -> bool:
        """Whether this process has warmed a kernel on ``key`` (``search_speed.WARMED``: this run, an
        earlier run or the guard's warm-up of a fixed case)."""
        from pytest_sparse_mla import search_speed

        return key in search_speed.WARMED

    def _not_made(self, exc: NotMade) -> None:
        """Count a call not made (``spent[exc.counter]``; per region for :class:`InRegion`)."""
        self.spent[exc.counter] += 1
        if isinstance(exc, InRegion):
            self.in_regions[exc.key] += 1

    def _warm_budget_spent(self) -> bool:
        return self.warm_seconds is not None and self.warm_spent >= self.warm_seconds

    def warm(self, impl: Any, inputs: Any) -> None:
        """On CUDA, run ``impl`` once on copies of ``inputs`` when this run meets their shape for the
        first time (``search_speed.warm``), outside the test's time limit (``untimed``): a Triton
        kernel's compile or autotune for a new shape then happens outside the judged call
        (``spent["warm-up"]`` counts them, ``warm_spent`` their seconds). Nothing on the CPU."""
        key = self._shape(inputs)
        if key is None or self._is_warm(key):
            return
        import contextlib
        import time

        from pytest_sparse_mla import search_speed

        search_speed.WARMED.add(key)  # the guard (guard.GuardedImplementation) then does not warm it again
        if self._noted[0] == key:  # the call noted last has this shape (not a property's derived call)
            self._warm_calls.setdefault(key, self._noted[1])
        self.spent["warm-up"] += 1
        start = time.perf_counter()
        with self._untimed() if self._untimed is not None else contextlib.nullcontext():
            search_speed.warm(impl, inputs)
        self.warm_spent += time.perf_counter() - start
        recording.begin_test()  # the warm-up is not a call of the test: no reproducer replays it

    def summary(self) -> dict[str, Any]:
        """``{"calls", "failed", "seed", "dims", "ends", "spent", "in_regions", "seconds",
        "discrepancies"}`` (``in_regions``: draws not made per region key; ``seconds``: whole seconds
        spent warming, outside the time limit; dicts of counts, so ``shards.merge_summaries`` sums
        them)."""
        return {
            "calls": len(self.drawn), "failed": int(self.failed), "seed": self.seed,
            "dims": coverage.merge_dims(self.drawn),
            "ends": {dim: dict(c) for dim, c in sorted(self.ends.items())},
            "spent": dict(self.spent), "in_regions": dict(self.in_regions),
            "seconds": {"warm-up": round(self.warm_spent)},
            "discrepancies": [d.as_dict() for d in self.found],
        }  # fmt: skip

    # --- the run -----------------------------------------------------------------------------------

    def settings(self, max_examples: int | None = None) -> Any:
        """The Hypothesis ``settings`` of a round (the loaded profile's phases, without shrinking
        for a test expected to fail)."""
        from hypothesis import HealthCheck, settings

        extra: dict[str, Any] = {"database": None} if self.seed is None else {}
        if not self.shrink and not self.known:  # with known regions, a failure that reaches Hypothesis is new
            extra["phases"] = search.unshrunk_phases()
        return settings(
            max_examples=self.examples if max_examples is None else max_examples, derandomize=self.seed is None,
            deadline=None, print_blob=True, report_multiple_bugs=False, suppress_health_check=list(HealthCheck),
            **extra,
        )  # fmt: skip

    def _seeded(self, test: Any, round_: int = 0, prop: Any = None) -> Any:
        """``test`` under this shard's seed (``shards.hypothesis_seed``: ``seed + shard``;
        derandomized, a distinct one per shard, and per property ``prop`` when ``test`` is the
        rounds' shared body: each property draws its own calls); round ``r > 0`` of a run draws from
        that seed plus ``r * ROUND_STRIDE`` (a fresh stream, not the first round's replayed with its
        region left out)."""
        import hypothesis

        from pytest_sparse_mla.shards import hypothesis_seed

        shard_seed = hypothesis_seed(self.seed, self.shard, prop, named=True) if prop is not None \
            else hypothesis_seed(self.seed, self.shard, test)  # fmt: skip
        if round_:
            shard_seed = (shard_seed or 0) + round_ * ROUND_STRIDE
        return test if shard_seed is None else hypothesis.seed(shard_seed)(test)

    def _verdict_only(self) -> bool:
        """Stop at the first failure: an expected failure with no known region, or a profile
        without shrinking (a self-test that reads the verdict only)."""
        from hypothesis import Phase, settings

        return not self.known and (not self.shrink or Phase.shrink not in settings.default.phases)

    def run(self, test: Any) -> None:
        """Run a ``@given`` function ``test`` under this run's settings and seed, as one round (the
        interface of earlier releases: no covering calls, no regions)."""
        test = self._seeded(self.settings()(test))
        try:
            test()
        except BaseException:
            self.failed = True
            raise
        finally:
            self.keep(coverage.SEARCH, self.summary())

    def check(
        self, prop: Callable[[Any], None], envelope: Envelope, device: str = "cpu", *, covering: bool = True,
        examples: int | None = None, judged_as: Callable[[Any, dict[str, str]], dict[str, str]] | None = None,
    ) -> None:  # fmt: skip
        """Run ``prop`` (judges one ``search.DrawnCall``, raises on a discrepancy) over this shard's
        covering calls (unless ``covering`` is false: a property that derives several calls from
        each drawn one, whose ends another property of the run covers) and random draws inside
        ``envelope`` up to ``examples`` calls in all, the covering calls counted (``examples``
        instead, for a property that makes several calls per draw), in rounds (module docstring).
        ``judged_as(call, classes)``: for a property that judges a call derived from the drawn one
        (rows permuted and padded), the classes of the call it judges, from the drawn call and its
        ``regions.features`` (e.g. ``regions.permuted_and_padded``): regions, known and found, are
        decided on these.

        Raises:
            NewDiscrepancy, KnownDiscrepancy: the discrepancies found (module docstring).
            Exception: the first failure as it is, for a verdict-only run.
        """
        if self._started is None:
            self._started = self.clock()
        self._judged_as = judged_as
        try:
            self._check(prop, envelope, device, covering, self.examples if examples is None else examples)
        except BaseException:
            self.failed = True
            raise
        finally:
            self.keep(coverage.SEARCH, self.summary())

    def _check(self, prop: Callable[[Any], None], envelope: Envelope, device: str, cover: bool, budget: int) -> None:
        self._envelope, self._device = envelope, device
        verdict_only = self._verdict_only()
        self.hints = verdict_only  # a verdict-only run raises its first failure as it is
        self._phase = "covering"
        covered = 0
        for i, call in enumerate(covering.schedule(envelope, device) if cover else []):
            if i % self.shards != self.shard or len(self.found) >= MAX_DISCREPANCIES:
                continue
            covered += 1
            call = self._outside(call, envelope, device)
            exc = self._try(prop, call)
            if exc is not None:
                if verdict_only:
                    raise exc
                self._discover(prop, self.judged, exc, envelope, device)
        self._phase = "random"
        self._rounds = 0
        left = budget - covered  # the covering calls are drawn instead of random ones, not beside them
        while left > 0 and len(self.found) < MAX_DISCREPANCIES:
            made, failure = self._round(prop, envelope, device, left)
            left -= max(made, 1)
            if failure is None:
                break
            call, exc = failure
            if verdict_only:
                raise exc
            self._discover(prop, call, exc, envelope, device)
        self._raise()

    def _outside(self, call: Any, envelope: Envelope, device: str) -> Any:
        """A covering call moved out of the regions found so far (and of known ones already
        confirmed), when one move of a dimension the region constrains does it (its other ends are
        still judged); else the call itself."""
        region = self._inside(call)
        if region is None or (region.known and self._confirm_left.get(region.key, 0) > 0):
            return call  # outside every region, or the confirmation of a known one
        for dim, alts in moves(call, envelope):
            if dim in region.conditions:
                for alt in alts:
                    if self._inside(alt) is None and covering.fits(alt, envelope, device):
                        return alt
        return call

    def _features(self, call: Any) -> dict[str, str]:
        """The classes of the call the property judges for drawn ``call``: ``regions.features``,
        changed by the property's ``judged_as`` (:meth:`check`) where it judges a derived call."""
        feats = regions.features(call)
        return feats if self._judged_as is None else self._judged_as(call, feats)

    def _inside(self, call: Any, built: dict[str, str] | None = None) -> regions.Region | None:
        """The region ``call`` lies in (found ones first), with its :data:`regions.BUILT` classes
        ``built`` once built; ``None`` outside every region."""
        feats = {**self._features(call), **(built or {})}
        for d in self.found:
            if d.region.contains(feats):
                return d.region
        for r in self.known:
            if r.contains(feats):
                return r
        return None

    def out_of_time(self) -> bool:
        """Whether the run's share of the time limit (``judged_seconds``) is spent: seconds since the
        first ``check``, less those spent warming."""
        if self.judged_seconds is None or self._started is None:
            return False
        return self.clock() - self._started - self.warm_spent >= self.judged_seconds

    def _judge(
        self, prop: Callable[[Any], None], call: Any, timed: bool = False, twin: bool = False
    ) -> Exception | None:  # fmt: skip
        """``prop(call)``'s failure, or ``None``; with ``twin``, a call of a cold shape met once the
        warm-up budget is spent is judged on a warm shape instead (:meth:`_warm_twin`).
        :attr:`judged` is the call made.

        Raises:
            OutOfTime: ``timed`` (a region-search move) and the run's time share is spent (the call
                is not made).
            OutOfMemory, ColdShape: the call was not made (:class:`NotMade`)."""
        if timed and self.out_of_time():
            raise OutOfTime(call.describe())
        self.judged = call
        try:
            return self._judge_once(prop, call)
        except ColdShape:
            other = self._warm_twin(call) if twin else None
            if other is None:
                raise
        self.judged = other
        verdict = self._judge_once(prop, other)
        self.spent["warm-twin"] += 1
        return verdict

    def _warm_twin(self, call: Any) -> Any:
        """``call``'s values on the shape of a warm call (``search.with_shape_of``; the warm calls
        tried from the one ``call.seed`` picks; inside a Hypothesis round, the warm calls of the
        round's first twin, so that shrinking and Hypothesis's replay see the same twin), or ``None``
        when none fits the envelope outside every region."""
        shapes = self._round_shapes or list(self._warm_calls.values())
        if self._round_shapes is not None:  # inside a round: the first twin fixes the round's warm calls
            self._round_shapes = shapes
        if not shapes or self._envelope is None:
            return None
        for i in range(len(shapes)):  # from the one the seed picks, the first that fits
            shape = shapes[(call.seed + i) % len(shapes)]
            for shape_lengths in (False, True):
                other = search.with_shape_of(call, shape, shape_lengths=shape_lengths)
                if covering.fits(other, self._envelope, self._device) and self._inside(other) is None:
                    return other
        return None

    def _judge_once(self, prop: Callable[[Any], None], call: Any) -> Exception | None:
        recording.begin_test()  # the recording then holds this call only
        from pytest_sparse_mla import device_health

        self.built_region, self._built_open = None, True
        seen = self.last_kernel_call() if self.last_kernel_call is not None else None

        try:
            prop(call)
        except NotMade:  # not made: the caller counts it
            raise
        except BaseException as exc:
            if device_health.is_out_of_memory(exc):
                device_health.release_device_memory()
                raise OutOfMemory(str(exc)) from exc
            before_kernel = self.last_kernel_call is not None and self.last_kernel_call() is seen
            # a dead CUDA context met before the call is an earlier kernel's fault, not the search's
            if before_kernel and isinstance(exc, Exception) and not device_health.is_context_error(f"{exc!r}"):
                raise SearchError(f"the property failed before it called the kernel: {exc!r}; "
                                  f"call: {call.describe()}") from exc  # fmt: skip
            if isinstance(exc, Exception):  # a failure of the kernel
                return exc
            if _failed_call(exc):  # pytest's outcomes: a refusal of the guard (pytest.fail) is a failure
                return exc  # type: ignore[return-value]  # of this call; a skip, an exit or the time limit ends the run
            raise
        return None

    def _try(self, prop: Callable[[Any], None], call: Any) -> Exception | None:
        """Judge ``call`` unless it lies in a region: a found one (not made), a known one (made
        only to confirm it). Returns a failure outside every region, or ``None``."""
        region = self._inside(call)
        confirming = region is not None and region.known and self._confirm_left.get(region.key, 0) > 0
        if region is not None and not confirming:
            self._not_made(InRegion(call.describe(), _cause(region)))
            for d in self.found:
                if d.region is region:
                    d.count += 1
            return None
        hints, self.hints = self.hints, self.hints or confirming
        try:
            exc = self._judge(prop, call, twin=not confirming)
        except NotMade as not_made:
            self._not_made(not_made)
            return None
        finally:
            self.hints = hints
        if region is None and self.built_region is None:
            self.spent[self._phase] += 1
            return exc
        self._confirmed(prop, region or self.built_region, exc)
        return None

    def _confirmed(self, prop: Callable[[Any], None], region: regions.Region, exc: Exception | None) -> None:
        """Count the call just judged (:attr:`judged`) as a confirmation of the known ``region``; its
        failure is the discrepancy's, reported under the region's key (a call found inside the region
        only once built is judged again with its diagnosis, the call it is reported with)."""
        self.spent["confirming-known"] += 1
        if exc is None:
            self._confirm_left[region.key] -= 1
            return
        call = self.judged
        if not self.hints:  # judged without its diagnosis: once more with it
            self.hints = True
            try:
                exc = self._judge(prop, call) or exc
            except NotMade as not_made:
                self._not_made(not_made)
            finally:
                self.hints = False
        self._confirm_left[region.key] = 0
        self.found.append(Discrepancy(region, call, _text(exc), recording.recorded_calls()))

    def _round(
        self, prop: Callable[[Any], None], envelope: Envelope, device: str, budget: int
    ) -> tuple[int, tuple[Any, Exception] | None]:  # fmt: skip
        """One Hypothesis run of at most ``budget`` calls outside every region. Returns the calls
        it made before its first failure, and the shrunk failing call with its failure (or ``None``)."""
        from hypothesis import given, reject
        from hypothesis.errors import Unsatisfiable

        state: dict[str, Any] = {"made": 0, "failed": False, "last": None, "drawn": None}

        @given(call=search.calls(envelope, device))
        def body(call: Any) -> None:
            if state["failed"] and self.out_of_time():  # shrinking stops (counted once per round)
                state["late"] = True
                if call == state["drawn"]:  # Hypothesis's replay of its smallest failing call: the same failure
                    raise state["last"][1]
                reject()
            if self._inside(call) is not None:
                if self._try(prop, call) is None:
                    reject()
            try:
                exc = self._judge(prop, call, twin=True)
            except NotMade as not_made:
                self._not_made(not_made)
                reject()
            if self.built_region is not None:  # inside a known region once built: it confirms it, never fails
                self._confirmed(prop, self.built_region, exc)
                reject()
            if not state["failed"]:
                state["made"] += 1
                self.spent["random"] += 1
            else:
                self.spent["shrinking"] += 1
            if exc is not None:
                state["failed"] = True
                state["last"], state["drawn"] = (self.judged, exc), call
                raise exc

        test = self._seeded(self.settings(budget)(body), self._rounds, prop)
        self._rounds += 1
        self._round_shapes = []  # fixed at the round's first twin (_warm_twin)
        try:
            try:
                test()
            finally:
                self._round_shapes = None
                if state.get("late"):
                    self.spent["time-limit"] += 1
        except Unsatisfiable:  # every draw lay inside a region
            return state["made"], None
        except BaseException as exc:
            if state["last"] is None or not (isinstance(exc, Exception) or _failed_call(exc)):
                raise
            call, _ = state["last"]
            return state["made"], (call, exc)  # type: ignore[return-value]
        return state["made"], None

    def _discover(
        self, prop: Callable[[Any], None], call: Any, exc: Exception, envelope: Envelope, device: str
    ) -> None:  # fmt: skip
        """The region of a failure (module docstring, 3), then its smallest call's record."""
        phase, self._phase = self._phase, "region-search"
        cut_before = self.spent["time-limit"]
        original = self._features(call)
        conditions: dict[str, set[str]] = {}
        core: dict[str, set[str]] = {}
        unmoved: set[str] = set()  # dimensions a move of which the time share left unmade
        current = call
        for dim, alts in moves(call, envelope):
            fits = [a for a in alts if covering.fits(a, envelope, device)]
            failing, passing = [], set()
            for alt in fits:
                try:
                    verdict = self._judge(prop, alt, timed=True)
                except NotMade as not_made:  # not made: neither keeps nor loses the failure
                    self._not_made(not_made)
                    if isinstance(not_made, OutOfTime) and dim is not None:
                        unmoved.add(dim)
                    continue
                self.spent["region-search"] += 1
                if verdict is None:
                    passing.add(self._features(alt)[dim] if dim is not None else "")
                else:
                    failing.append(alt)
            if dim is not None and passing:  # needed: the region leaves out the classes that passed
                conditions[dim] = set(regions.FEATURES[dim]) - (passing - {original[dim]})
                if not failing:  # needed alone: every other class tried made the failure go away
                    core[dim] = {original[dim]}
            simplest = fits[0] if fits and (dim != "query_layout" or call.strided_query) else None
            merged = _merge(current, simplest, call) if simplest is not None and simplest in failing else current
            if covering.fits(merged, envelope, device) and self._inside(merged) is None:  # never into a known region
                current = merged
        cut = self.spent["time-limit"] > cut_before
        self.hints = True  # the call the discrepancy is reported with: explained (made after the time share too)
        try:
            final = self._judge(prop, current, timed=False)
        except NotMade as not_made:
            self._not_made(not_made)
            final = None
        if final is None:  # the moves' merge lost the failure (or is a shape not warm): keep the call as found
            try:
                current, final = call, self._judge(prop, call, timed=False) or exc
            except NotMade as not_made:
                self._not_made(not_made)
                current, final = call, exc
        self.hints = False
        self._phase = phase
        if cut:  # what was not moved stays at the call's own class: never wider than the evidence
            conditions = {**conditions, **{k: {original[k]} for k in unmoved}}
        else:
            conditions = core or conditions  # the dimensions the failure needs alone, when there are some
        exact = not conditions
        if exact:  # no move made it go away: the region is the call's own classes, never everything
            conditions = {k: {v} for k, v in self._features(current).items()}
        for d in self.found:  # the same cause met again: one class both need alone (a narrow first region)
            if not exact and not cut and not d.region.known and _same_cause(d.region.conditions, conditions):
                d.region = regions.Region(d.region.key, _widened(d.region.conditions, conditions))
                d.count += 1
                return
        region = regions.Region(f"new-{sum(not d.region.known for d in self.found) + 1}",
                                {k: frozenset(v) for k, v in conditions.items()})  # fmt: skip
        self.found.append(Discrepancy(region, current, _text(final), recording.recorded_calls(), cut=cut))

    def _raise(self) -> None:
        short = self.spent.get("out-of-memory", 0)
        unjudged = (
            f"{short} drawn call{'' if short == 1 else 's'} ran out of device memory on every try and "
            f"{'was' if short == 1 else 'were'} not judged (an environment condition, not a verdict on the kernel; "
            "rerun with fewer workers per GPU)"
        )
        if not self.found:
            if short:  # a run whose calls were not made passes nothing: it fails as the environment's
                from pytest_sparse_mla import device_health

                raise device_health.OutOfDeviceMemory(f"no discrepancy in {len(self.drawn)} calls, but {unjudged}")
            return
        recording.restore_calls([c for d in self.found for c in d.recorded])
        new = [d for d in self.found if not d.region.known]
        late = self.spent.get("time-limit", 0)
        stopped = (f"; the run's share of the time limit ({self.judged_seconds:g} s of judged time) ran out: "
                   f"{late} region-search move(s) or shrinking phase(s) not made") if late else ""
        head = (f"{len(self.found)} distinct discrepanc{'y' if len(self.found) == 1 else 'ies'} "
                f"({len(new)} new, {len(self.found) - len(new)} in known regions) "
                f"in {len(self.drawn)} calls{f'; {unjudged}' if short else ''}{stopped}:")  # fmt: skip
        text = "\n".join([head, *(d.text() for d in self.found)])
        raise (NewDiscrepancy if new else KnownDiscrepancy)(text)


def _cause(region: regions.Region) -> str:
    """A region's cause, the same in every test and shard: a known region's key, ``new: <region>``
    for one found in this run."""
    return region.key if region.known else f"new: {region.text()}"


def _slots(inputs: Any) -> Any:
    """``[T, topk + extra_topk]`` int64: the cache slot each lane of a built call names, the extra
    cache's offset by ``2**40`` (``regions.built_features``'s ``slots``)."""
    import torch

    main = inputs.indices.long().flatten(1)  # [T, topk] (a [T, 1, topk] view too; T may be 0)
    extra = inputs.kwargs.get("extra_indices")
    return main if extra is None else torch.cat([main, extra.long().flatten(1) + (1 << 40)], 1)


def _failed_call(exc: BaseException) -> bool:
    """Whether ``exc`` is ``pytest.fail`` about one call (the guard's refusal of an input the peer would
    mishandle: a discrepancy of that call), not pytest-timeout's limit (which ends the test)."""
    import pytest

    return isinstance(exc, pytest.fail.Exception) and "from pytest-timeout" not in str(exc)


def _same_cause(a: Any, b: Any) -> bool:
    """Two regions of one cause: some dimension is pinned to the same single class in both (the
    dimension each failure needed alone, e.g. ``query_layout=strided``)."""
    return any(len(a[k]) == 1 and set(a[k]) == set(b[k]) for k in set(a) & set(b))


def _widened(a: Any, b: Any) -> dict[str, frozenset[str]]:
    """The smallest region holding both: the dimensions both constrain, each with both's classes."""
    return {k: frozenset(a[k]) | frozenset(b[k]) for k in set(a) & set(b)}


def _merge(current: Any, alt: Any, base: Any) -> Any:
    """``current`` with the fields in which ``alt`` differs from ``base`` (a kept move), so that
    moves found from one call accumulate."""
    def diff(a: Any, b: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
        return {f.name: getattr(a, f.name) for f in dataclasses.fields(a)
                if f.name not in skip and getattr(a, f.name) != getattr(b, f.name)}  # fmt: skip

    out = dataclasses.replace(current, **diff(alt, base, ("main", "extra")))
    if alt.main != base.main:
        out = dataclasses.replace(out, main=dataclasses.replace(out.main, **diff(alt.main, base.main)))
    if alt.extra != base.extra:
        out = dataclasses.replace(out, extra=alt.extra)
    return out


def _text(exc: BaseException) -> str:
    """A failure's message, with Hypothesis's notes (the ``@reproduce_failure`` line); other
    exception types than ``AssertionError`` are named."""
    notes = "\n".join(getattr(exc, "__notes__", None) or [])
    body = str(exc) if isinstance(exc, AssertionError) else f"{type(exc).__name__}: {exc}"
    return body + (f"\n{notes}" if notes else "")
