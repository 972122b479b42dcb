"""Self-tests of the search's rounds, regions and covering schedule (``pytest_sparse_mla.search_run``,
``pytest_sparse_mla.regions``, ``pytest_sparse_mla.covering``).

* One default-budget run against a kernel with two independent bugs (one drawn far more often than
  the other: ``kernel_catalogue.two_bugs_strided_q_and_partial_head_tile``) reports both, each with a
  region that names its cause.
* A default run's coverage record holds every end of every dimension the envelope admits.
* A known region (an xfail file's ``# [KEY] region:`` line) is confirmed once and reported under its
  key (xfailed); a discrepancy outside it fails the test even though the test is listed.
* Region lines are checked: a bad dimension or class is a usage error naming the file and line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# Imported up front: this module's inner sessions (``_run``) restore sys.modules afterwards, so a
# torch first imported inside one would be unloaded and imported again by a later test (a crash).
import torch

pytest.importorskip("hypothesis")

from pytest_sparse_mla import covering, regions  # noqa: E402
from pytest_sparse_mla.implementations.builtin import ReferenceImplementation  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SEARCH = str(ROOT / "suites" / "test_attention_search.py")
ORACLE_TEST = "suites/test_attention_search.py::test_a_drawn_call_matches_the_oracle[shard0]"


def _run(args, tmp_path, monkeypatch, capsys):
    import inner_session

    return inner_session.run(
        ["-p", "sparse_mla", SEARCH, "--sparse-mla-device", "cpu", "-p", "no:cacheprovider", "-p", "no:xdist",
         "--rootdir", str(ROOT), *args], cwd=ROOT, monkeypatch=monkeypatch, capsys=capsys,
    )  # fmt: skip


@pytest.mark.full_tier  # a search run of a wrong kernel, shrunk and reported (CONTRIBUTING.md)
def test_one_default_run_reports_both_bugs_of_a_kernel_with_two(tmp_path, monkeypatch, capsys) -> None:
    report = tmp_path / "run.json"
    impl = "kernel_catalogue:two_bugs_strided_q_and_partial_head_tile"
    code, output = _run(["-k", "matches_the", "--sparse-mla-impl", impl, f"--sparse-mla-report-json={report}"],
                        tmp_path, monkeypatch, capsys)  # fmt: skip
    assert code == 1, output[-3000:]
    found = json.loads(report.read_text())["search"]["discrepancies"]
    texts = [d["region"] for d in found]
    assert any("query_layout=strided" in t for t in texts), texts
    assert any("num_heads=" in t and "query_layout" not in t for t in texts), texts


def test_a_default_run_draws_every_end_of_every_dimension(tmp_path, monkeypatch, capsys) -> None:
    """The reference's default run (``-k matches``): the coverage record's ``ends`` hold every label
    of ``covering.required_ends`` for its envelope, listed by hand for the sizes."""
    report = tmp_path / "run.json"
    code, output = _run(["-k", "matches_the", f"--sparse-mla-report-json={report}"], tmp_path, monkeypatch, capsys)
    assert code == 0, output[-3000:]
    search = json.loads(report.read_text())["search"]
    ends = search["ends"]
    dims = search["dims"]  # the calls' own values (search.record), not covering.ends_of's labels
    for name, low, high in (("num_tokens", 0, 512), ("num_heads", 1, 256), ("topk", 1, 2048),
                            ("value_exponent", -40, 100), ("score_offset", -3000, 3000), ("score_spread", 0, 40)):
        assert (dims[name]["min"], dims[name]["max"]) == (low, high), (name, dims[name])
    assert {"smallest", "largest"} <= {v.split("/")[0] for v in dims["scale_bytes"]["values"]}, dims["scale_bytes"]
    assert {"0", "-512**-0.5"} <= set(dims["sm_scale"]["values"]), dims["sm_scale"]
    required = covering.required_ends(ReferenceImplementation.envelope, "cpu")
    assert required["num_tokens"] == {"0", "1", "64", "65", "512"}
    assert required["topk_length"] == {"0", "topk", str(-(2**31)), str(2**31 - 1)}
    assert required["scale_bytes"] >= {"dsv4:smallest", "dsv4:largest", "dsv3_2:smallest", "dsv4_1_indexed:largest"}
    missing = {dim: sorted(labels - set(ends.get(dim, {}))) for dim, labels in required.items()}
    assert not any(missing.values()), missing
    spent = search["spent"]  # the covering calls count inside the default budget of 8: no random draw beside them
    assert spent["covering"] == len(covering.schedule(ReferenceImplementation.envelope, "cpu")) >= 8, spent
    assert spent.get("random", 0) == 0 and search["calls"] == spent["covering"], search


def test_each_property_of_a_derandomized_run_draws_its_own_calls() -> None:
    """Two properties run by ``SearchRun`` (one shared ``@given`` body) draw different calls, and the
    same property draws the same calls again (derandomized)."""
    from pytest_sparse_mla import search_run

    envelope = ReferenceImplementation.envelope

    def seeds_of(prop_name: str) -> list[int]:
        seen: list[int] = []

        def prop(call) -> None:
            seen.append(call.seed)

        prop.__qualname__ = prop_name
        run = search_run.SearchRun(4, None, 0, lambda key, value: None)
        run.check(prop, envelope, "cpu", covering=False)
        return seen

    first, second = seeds_of("test_one.<locals>.drawn"), seeds_of("test_two.<locals>.drawn")
    assert len(first) == len(second) == 4
    assert first[1:] != second[1:], (first, second)  # the first draw of each is Hypothesis's simplest call
    assert seeds_of("test_one.<locals>.drawn") == first


@pytest.mark.full_tier  # a search run of a wrong kernel, shrunk and reported (CONTRIBUTING.md)
def test_a_known_region_is_reported_under_its_key_and_a_new_bug_fails(tmp_path, monkeypatch, capsys) -> None:
    xfail = tmp_path / "xfail.txt"
    xfail.write_text(
        "# [strided-q] bug: the queries are read as if contiguous\n"
        "# [strided-q] region: query_layout=strided\n"
        f"{ORACLE_TEST}  # strided-q\n"
    )
    report = tmp_path / "run.json"
    args = ["-k", "matches_the", "--sparse-mla-xfail-file", str(xfail), f"--sparse-mla-report-json={report}"]
    code, output = _run([*args, "--sparse-mla-impl", "test_search:StridedQueryBug"], tmp_path, monkeypatch, capsys)
    assert code == 0 and "1 xfailed" in output, output[-3000:]
    found = json.loads(report.read_text())["search"]["discrepancies"]
    assert [(d["key"], d["known"]) for d in found] == [("strided-q", True)], found
    spent = json.loads(report.read_text())["search"]["spent"]
    assert spent.get("confirming-known", 0) <= regions.CONFIRM_CALLS, spent
    code, output = _run([*args, "--sparse-mla-impl", "kernel_catalogue:two_bugs_strided_q_and_partial_head_tile"],
                        tmp_path, monkeypatch, capsys)  # fmt: skip
    assert code == 1 and "1 failed" in output and "NewDiscrepancy" in output, output[-3000:]
    found = json.loads(report.read_text())["search"]["discrepancies"]
    assert {d["known"] for d in found} == {True, False}, found
    assert any(d["key"] == "strided-q" for d in found) and any("num_heads=" in d["region"] for d in found), found


def test_a_region_line_names_its_file_line_and_the_classes_expected(tmp_path: Path) -> None:
    bad = tmp_path / "x.txt"
    bad.write_text("# [k] bug: text\n# [k] region: sm_scale=2\n")
    with pytest.raises(ValueError, match=r"x\.txt:2: sm_scale=2 is not a class of sm_scale"):
        regions.read_regions(bad)
    bad.write_text("# [k] region: colour=red\n")
    with pytest.raises(ValueError, match=r"unknown dimension 'colour'"):
        regions.read_regions(bad)
    good = tmp_path / "y.txt"
    good.write_text("# [sm-scale-zero] region: sm_scale=0 fmt=dsv4,dsv3_2\n")
    (region,) = regions.read_regions(good)
    assert region.key == "sm-scale-zero" and region.known
    assert region.conditions == {"sm_scale": frozenset({"0"}), "fmt": frozenset({"dsv4", "dsv3_2"})}
    assert region.contains({"sm_scale": "0", "fmt": "dsv4", "num_tokens": "1"})
    assert not region.contains({"sm_scale": "1", "fmt": "dsv4"})


@pytest.mark.parametrize("name", ["reference", "flashmla-like"])
def test_every_covering_call_lies_inside_its_envelope(name: str) -> None:
    from test_search import FLASHMLA_LIKE

    from pytest_sparse_mla import search
    from pytest_sparse_mla.attention.call import SparseMlaCall

    envelope = ReferenceImplementation.envelope if name == "reference" else FLASHMLA_LIKE
    for call in covering.schedule(envelope, "cpu"):
        inputs = search.build(call)
        read = SparseMlaCall.read(inputs.q, inputs.kv_cache, inputs.indices, **inputs.kwargs, validate=True)
        assert read.envelope_reason(envelope) is None, call.describe()


def test_empty_first_tile_names_the_caches_whose_rows_start_with_no_valid_lane() -> None:
    """``empty_first_tile`` (a row whose first lanes hold nothing: an online softmax's first tile
    empty) is read from each cache's lengths and mask alone; an empty row counts for both caches."""
    from dataclasses import replace

    base = next(c for c in covering.schedule(ReferenceImplementation.envelope, "cpu") if c.extra is not None)
    full = replace(base, empty_fraction=0.0, main=replace(base.main, lengths=None, masked_fraction=0.0),
                   extra=replace(base.extra, lengths=None, masked_fraction=0.0))  # fmt: skip
    assert regions.features(full)["empty_first_tile"] == "none"
    zero_length = replace(full, main=replace(full.main, lengths=(0, 5)))
    assert regions.features(zero_length)["empty_first_tile"] == "main"
    all_masked = replace(full, extra=replace(full.extra, masked_fraction=1.0))
    assert regions.features(all_masked)["empty_first_tile"] == "extra"
    assert regions.features(replace(full, empty_fraction=0.5))["empty_first_tile"] == "both"
    assert regions.features(replace(zero_length, extra=None))["empty_first_tile"] == "main"
    assert regions.features(replace(full, main=replace(full.main, lengths=(1, 5))))["empty_first_tile"] == "none"


def test_past_its_time_share_a_run_stops_refining_but_still_draws_and_reports() -> None:
    """``judged_seconds`` (the fixture's ``TIME_SHARE`` of the test's limit): once spent, no region-search
    move and no shrinking step is made, so a kernel with many bugs is reported inside the limit
    instead of being ended by pytest-timeout with nothing said. The draws are still made (so an
    expected failure is still met) and each discrepancy is still reported with its diagnosis, its
    region the call's own classes where the search was cut (never wider than the evidence), its
    Hypothesis replay the failure itself (no FlakyFailure). The run's clock advances one second per
    call made (a kernel call of a second; nothing else counts)."""
    from pytest_sparse_mla import search_run
    from pytest_sparse_mla.errors import NewDiscrepancy

    made: list[object] = []

    def prop(call) -> None:
        made.append(call)
        raise AssertionError("wrong output")

    run = search_run.SearchRun(2, None, 0, lambda key, value: None, judged_seconds=0.5)  # two rounds
    run.clock = lambda: float(len(made))
    with pytest.raises(NewDiscrepancy, match=r"ran out: \d+ region-search move\(s\) or shrinking phase") as info:
        run.check(prop, ReferenceImplementation.envelope, "cpu", covering=False)
    assert "Flaky" not in str(info.value), str(info.value)
    assert run.found and all(d.cut for d in run.found), [d.region.text() for d in run.found]
    assert "region search cut by the time limit" in str(info.value)
    assert run.found[0].as_dict()["region_search"] == "cut by the time limit"
    envelope = ReferenceImplementation.envelope
    for d in run.found:  # every dimension a move was not made for: pinned at the call's own class
        own = regions.features(d.call)
        movable = {dim for dim, alts in search_run.moves(d.call, envelope)
                   if dim is not None and any(covering.fits(a, envelope, "cpu") for a in alts)}  # fmt: skip
        assert movable and {k: set(v) for k, v in d.region.conditions.items() if k in movable} == {
            k: {own[k]} for k in movable
        }, d.region.text()
    assert "region-search" not in run.spent and "shrinking" not in run.spent, run.spent
    assert len(made) == 2 * len(run.found) and run.spent["random"] == len(run.found), (len(made), run.spent)


def test_past_its_time_share_a_run_still_confirms_a_known_region() -> None:
    """A test the xfail file lists under a known region expects its ``KnownDiscrepancy``: the time
    share never stops the covering calls or the draws that meet the region, so the expected failure
    is still raised (a run that stopped drawing would pass, and a strict xfail would then fail)."""
    from pytest_sparse_mla import covering, search_run
    from pytest_sparse_mla.errors import KnownDiscrepancy

    envelope = ReferenceImplementation.envelope
    first = next(i for i, c in enumerate(covering.schedule(envelope, "cpu")) if c.strided_query)
    assert first >= 1  # a share that runs out before the first strided covering call
    known = [regions.Region("strided-q", {"query_layout": frozenset({"strided"})}, known=True)]
    made: list[object] = []

    def prop(call) -> None:
        made.append(call)
        if call.strided_query:
            raise AssertionError("strided queries read as contiguous")

    run = search_run.SearchRun(8, None, 0, lambda *a: None, shrink=False, known=known, confirm=True,
                               judged_seconds=first - 0.5)  # fmt: skip
    run.clock = lambda: float(len(made))
    with pytest.raises(KnownDiscrepancy, match="strided-q"):
        run.check(prop, envelope, "cpu")


def test_the_search_table_says_which_draws_were_not_made() -> None:
    """The terminal table's second line counts the draws not made, by reason (``coverage.NOT_MADE``):
    a search that made few calls says why instead of looking thorough."""
    from pytest_sparse_mla import coverage

    cov = coverage.Coverage()
    summary = {"calls": 17, "failed": 0, "seed": None, "dims": {}, "ends": {}, "seconds": {"warm-up": 247},
               "spent": {"covering": 9, "cold-shape": 659, "time-limit": 2}, "discrepancies": []}  # fmt: skip
    cov.search.append(summary)
    lines = cov.search_lines()
    assert lines[1] == ("calls not made: shape not warm, warm-up budget spent 659, refinement past the time share "
                        "(region moves, shrinking phases) 2"), lines


def test_the_search_table_says_which_regions_took_the_draws_not_made() -> None:
    """Draws not made inside regions are counted per cause (``in_regions`` of the summary, summed over
    shards): a search whose known regions hold most of the input space says which ones, most first."""
    from pytest_sparse_mla import coverage

    cov = coverage.Coverage()
    for in_regions in ({"masked-lane-scored": 700, "new: topk=1-63": 3}, {"masked-lane-scored": 100, "empty-batch": 5}):
        cov.search.append({"calls": 5, "failed": 1, "seed": None, "dims": {}, "ends": {}, "discrepancies": [],
                           "spent": {"random": 2, "not-made-in-region": sum(in_regions.values())},
                           "in_regions": in_regions})  # fmt: skip
    assert cov.search_lines()[1] == ("calls not made: inside a region (found or known) 808 ([masked-lane-scored] 800, "
                                     "[empty-batch] 5, [new: topk=1-63] 3)"), cov.search_lines()


def test_a_known_region_of_a_built_dimension_is_confirmed_and_the_search_goes_past_it() -> None:
    """A known region may name a dimension only a built call has (``regions.BUILT``: ``query_peak``,
    the largest ``|q|`` against E4M3's 448, which ``search.build`` derives from the drawn keys and
    logits). The property fails a call whose built query holds an element beyond 448 (as a kernel
    that casts the query to E4M3 unscaled: NaN) and a strided query (read as contiguous). Without
    the region the first is reported as new; with it, it is confirmed under its key, the calls built
    inside it afterwards are not made, and the search goes past it to the strided bug."""
    from pytest_sparse_mla import search, search_run
    from pytest_sparse_mla.errors import KnownDiscrepancy, NewDiscrepancy

    def search_with(known: list[regions.Region]) -> tuple[search_run.SearchRun, list[bool], BaseException]:
        run = search_run.SearchRun(8, None, 0, lambda *a: None, known=known, confirm=True)
        beyond_made: list[bool] = []

        def prop(call) -> None:
            inputs = search.build(call, "cpu")
            run.note(call, inputs)
            beyond = bool((inputs.q.float().abs() > 448).any())
            beyond_made.append(beyond)
            if beyond:
                raise AssertionError("non-finite output: a query element beyond E4M3's range")
            if call.strided_query:
                raise AssertionError("strided queries read as contiguous")

        with pytest.raises((NewDiscrepancy, KnownDiscrepancy)) as info:
            run.check(prop, ReferenceImplementation.envelope, "cpu")
        return run, beyond_made, info.value

    run, beyond_made, raised = search_with([])
    assert isinstance(raised, NewDiscrepancy) and any("beyond E4M3" in d.message for d in run.found), raised
    assert sum(beyond_made) > regions.CONFIRM_CALLS  # the bug is met again and again: found, moved, shrunk

    known = [regions.parse_region("e4m3-query", "query_peak=beyond-e4m3")]
    run, beyond_made, raised = search_with(known)
    assert isinstance(raised, NewDiscrepancy), raised
    found = [(d.region.key, d.region.known) for d in run.found]
    assert ("e4m3-query", True) in found, found
    new = [d for d in run.found if not d.region.known]
    assert new and all("beyond E4M3" not in d.message for d in new), [d.message for d in new]
    assert any(d.region.conditions.get("query_layout") == {"strided"} for d in new), [d.region.text() for d in new]
    assert sum(beyond_made) <= 2, beyond_made  # the confirming call, then once more with its diagnosis
    assert run.spent["not-made-in-region"] >= 1, run.spent
    assert run.summary()["in_regions"].get("e4m3-query", 0) >= 1, run.summary()["in_regions"]  # built, not made


def test_a_property_that_fails_before_it_calls_the_kernel_fails_on_the_search_not_the_kernel() -> None:
    """With the guard's last kernel call to go by (``SearchRun.last_kernel_call``, which the fixture
    sets to ``device_health.last_call``), an exception the property raises before the kernel is
    called (here a ``TypeError`` of the property's own code, as a wrapper of ``note`` with an old
    signature raised on an H100) fails the test as ``SearchError``; one raised once the kernel was
    called is the kernel's discrepancy, and so is a dead CUDA context met before the call (an earlier
    kernel's fault)."""
    from pytest_sparse_mla import search_run
    from pytest_sparse_mla.errors import NewDiscrepancy

    calls: list[object] = []

    def kernel() -> None:  # stands in for the guard's call: a new KernelCall each time
        calls.append(object())
        raise AssertionError("output: 512 of 512 elements exceed their bound")

    def harness_fault(call) -> None:
        raise TypeError("note() got an unexpected keyword argument 'judged'")

    def dead_context(call) -> None:  # an earlier kernel's illegal access, met at the next allocation
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    outcomes = {}
    for name, prop in (("before", harness_fault), ("after", lambda call: kernel()), ("dead", dead_context)):
        run = search_run.SearchRun(4, None, 0, lambda *a: None, shrink=False)  # the verdict is the test
        run.last_kernel_call = lambda: calls[-1] if calls else None
        try:
            run.check(prop, ReferenceImplementation.envelope, "cpu", covering=False)
        except BaseException as exc:  # noqa: BLE001 - the outcome is what is tested
            outcomes[name] = exc
    assert isinstance(outcomes["before"], search_run.SearchError), outcomes
    assert "before it called the kernel: TypeError" in str(outcomes["before"]), outcomes
    assert isinstance(outcomes["after"], (NewDiscrepancy, AssertionError)), outcomes
    assert "exceed their bound" in str(outcomes["after"]), outcomes
    assert not isinstance(outcomes["dead"], search_run.SearchError) and "illegal memory access" in str(outcomes["dead"])


def test_a_fault_of_the_search_while_classing_a_call_is_not_reported_as_the_kernels(monkeypatch) -> None:
    """Classing a built call is the search's own code, run inside the property: where it raises (here
    a stand-in of a shape mismatch, as judged inputs padded past their logits gave), the test fails
    with ``search_run.SearchError`` naming the cause, never with a discrepancy of a kernel that was
    not even called."""
    from pytest_sparse_mla import search, search_run

    def broken(inputs):
        raise RuntimeError("The size of tensor a (128) must match the size of tensor b (129)")

    monkeypatch.setattr(search_run, "_slots", broken)
    known = [regions.parse_region("e4m3-query", "query_peak=beyond-e4m3")]
    run = search_run.SearchRun(4, None, 0, lambda *a: None, known=known, confirm=True)
    called = []

    def prop(call) -> None:
        run.note(call, search.build(call, "cpu"))
        called.append(call)

    with pytest.raises(search_run.SearchError, match=r"classing the built call failed: RuntimeError\('The size"):
        run.check(prop, ReferenceImplementation.envelope, "cpu", covering=False)
    assert not called and not run.found


@pytest.mark.parametrize(
    ("scores", "slots", "expected"),
    [
        ([[0.0, float("-inf")]], [[3, 4]], "0.99+"),  # one valid lane: all its row's weight
        ([[0.0, 0.0]], [[3, 4]], "below-0.99"),  # two equal lanes on two slots: 1/2 each
        ([[0.0, 0.0]], [[4, 4]], "0.99+"),  # two lanes naming one slot: its weight is both's
        ([[0.0, 0.0, 0.0]], [[4, 7, 4]], "below-0.99"),  # slot 4 holds 2/3
        ([[0.0, -5.0]], [[3, 4]], "0.99+"),  # 1 / (1 + e**-5) = 0.99331
        ([[0.0, -4.0]], [[3, 4]], "below-0.99"),  # 1 / (1 + e**-4) = 0.98201
        ([[0.0, -4.0, 0.0]], [[3, 4, 3]], "0.99+"),  # slot 3: 2 / (2 + e**-4) = 0.99093 (each lane 0.495)
        ([[float("-inf"), float("-inf")], [0.0, 0.0]], [[1, 1], [1, 2]], "below-0.99"),  # an empty row: no slot
        ([[1000.0, 0.0]], [[3, 4]], "0.99+"),  # large logits: shifted by the row's largest, no overflow
    ],
)
def test_top_slot_weight_is_the_heaviest_slots_share_of_its_row(scores, slots, expected) -> None:
    """``regions.built_features``'s ``top_slot_weight`` against shares computed by hand (softmax over a
    row's valid lanes, ``-inf`` where a lane does not attend, lanes naming one slot summed; threshold
    ``regions.TOP_SLOT_WEIGHT``)."""
    s = torch.tensor(scores, dtype=torch.float64).unsqueeze(1)  # [T, H=1, N]
    q = torch.zeros(s.shape[0], 1, 8, dtype=torch.bfloat16)
    got = regions.built_features(q, s, torch.tensor(slots, dtype=torch.int64))
    assert got == {"query_peak": "e4m3-range", "top_slot_weight": expected, "masked_lane_weight": "none"}


_NO = float("-inf")


@pytest.mark.parametrize(
    ("scores", "masked", "expected"),
    [
        ([[0.0, 0.0]], [0], "none"),  # no masked lane
        ([[0.0, _NO]], [1], "2**-12+"),  # 1 / (1 + 1) = 1/2
        ([[_NO, _NO]], [2], "2**-12+"),  # a row of masked lanes only: all of it
        ([[_NO, _NO]], [0], "none"),  # an empty row by its length: nothing scored
        ([[8.0, _NO]], [1], "2**-12+"),  # e**-8 / (1 + e**-8) = 3.35e-4 >= 2**-12 = 2.44e-4
        ([[9.0, _NO]], [1], "below-2**-12"),  # e**-9 / (1 + e**-9) = 1.23e-4
        ([[9.0, _NO]], [2], "2**-12+"),  # 2 e**-9 / (1 + 2 e**-9) = 2.47e-4
        ([[1000.0, _NO]], [1], "below-2**-12"),  # e**-1000: no overflow, no NaN
        ([[-1000.0, _NO]], [1], "2**-12+"),  # far-negative logits: the zero lane takes all
        ([[9.0, _NO], [0.0, 0.0]], [1, 0], "below-2**-12"),  # the second row has no masked lane
        ([[9.0, _NO], [0.0, 0.0]], [1, 1], "2**-12+"),  # its 1 / (1 + 2) decides
        ([[0.0] * 4095], [1], "2**-12+"),  # 1 / 4096 = 2**-12 exactly
        ([[0.0] * 4096], [1], "below-2**-12"),  # 1 / 4097
    ],
)
def test_masked_lane_weight_is_the_share_zero_logit_lanes_would_take(scores, masked, expected) -> None:
    """``regions.built_features``'s ``masked_lane_weight`` against shares computed by hand: a row's
    ``m`` masked lanes scored as logit 0 take ``m / (m + sum_j exp(s_j))`` of its weight (``-inf``
    where a lane does not attend); the largest over the rows against ``regions.MASKED_LANE_WEIGHT``."""
    s = torch.tensor(scores, dtype=torch.float64).unsqueeze(1)  # [T, H=1, N]
    q = torch.zeros(s.shape[0], 1, 8, dtype=torch.bfloat16)
    slots = torch.arange(s.shape[-1]).expand(s.shape[0], -1)
    got = regions.built_features(q, s, slots, torch.tensor(masked))
    assert got["masked_lane_weight"] == expected, got


def test_a_built_calls_masked_lanes_are_the_negative_lanes_inside_each_rows_length() -> None:
    """``search.masked_lanes`` on hand-made rows: a negative lane counts inside its row's length (the
    whole row without one; a negative length holds none, a length past the row all), in either cache,
    a ``[T, 1, topk]`` view too."""
    from types import SimpleNamespace

    from pytest_sparse_mla import search

    idx = torch.tensor([[-1, 5, -1, 7], [-1, -2, 3, 4], [-1, -1, -1, -1]], dtype=torch.int32)
    plain = SimpleNamespace(indices=idx, kwargs={})
    assert search.masked_lanes(plain).tolist() == [2, 2, 4]
    main_len = torch.tensor([2, -3, 9], dtype=torch.int32)
    lengths = SimpleNamespace(indices=idx.unsqueeze(1), kwargs={"topk_length": main_len})
    assert search.masked_lanes(lengths).tolist() == [1, 0, 4]
    extra = torch.tensor([[-1, 0], [2, -1], [-1, -1]], dtype=torch.int32)
    both = SimpleNamespace(indices=idx, kwargs={"topk_length": main_len,
                                                "extra_indices": extra, "extra_topk_length": torch.tensor([1, 2, 0])})
    assert search.masked_lanes(both).tolist() == [2, 1, 4]


def test_the_lane_order_property_s_padding_lies_in_a_known_region_of_minus_one_lanes() -> None:
    """A property that judges a call derived from the drawn one (rows padded with ``-1`` lanes, here
    rows of odd width, as an envelope of even widths pads them) and a kernel that scores a ``-1`` lane
    (FlashMLA's contract masks it) and reads strided queries as contiguous. The padded calls' drawn
    classes say ``masked_lanes=none``: without ``judged_as`` the known region ``masked_lanes=-1,...``
    does not hold them and the scored padding is reported as new; with the classes of the judged call
    (``regions.permuted_and_padded``) it is confirmed under its key and the search goes on to the
    strided bug."""
    from pytest_sparse_mla import search_run
    from pytest_sparse_mla.errors import KnownDiscrepancy, NewDiscrepancy

    def padded(call) -> bool:
        return call.main.width % 2 == 1

    def prop(call) -> None:
        run.note(call)
        if padded(call) or (0 < call.main.masked_fraction and call.main.mask_value == -1):
            raise AssertionError("a -1 lane scored with logit 0")
        if call.strided_query:
            raise AssertionError("strided queries read as contiguous")

    def judged_as(call, classes):
        return regions.permuted_and_padded(classes, main_padded=padded(call), extra_padded=False)

    known = [regions.parse_region("masked-lane-scored", "masked_lanes=-1,other-negative,all")]
    outcomes, outcomes_in = {}, {}
    for name, how in (("drawn", None), ("judged", judged_as)):
        run = search_run.SearchRun(4, None, 0, lambda *a: None, known=known, confirm=True)
        with pytest.raises((NewDiscrepancy, KnownDiscrepancy)):
            run.check(prop, ReferenceImplementation.envelope, "cpu", covering=False, judged_as=how)
        outcomes[name], outcomes_in[name] = run.found, run.summary()["in_regions"]
    assert any(not d.region.known and "-1 lane scored" in d.message for d in outcomes["drawn"]), \
        [(d.region.text(), d.message[:60]) for d in outcomes["drawn"]]  # fmt: skip
    found = outcomes["judged"]
    keys = [(d.region.key, d.region.known) for d in found]
    assert ("masked-lane-scored", True) in keys, [d.region.text() for d in found]
    new = [d for d in found if not d.region.known]
    assert new and all("-1 lane scored" not in d.message for d in new), [d.message[:60] for d in new]
    assert any(d.region.conditions.get("query_layout") == {"strided"} for d in new), [d.region.text() for d in new]
    assert outcomes_in["judged"].get("masked-lane-scored", 0) >= 1, outcomes_in  # drawn there, not made


@pytest.mark.parametrize("extra", [False, True], ids=["main", "with-extra"])
@pytest.mark.parametrize("num_tokens", [0, 3])
def test_a_built_call_of_any_token_count_is_classed_by_its_built_dimensions(num_tokens, extra) -> None:
    """A known region naming a built dimension classes every built call, one of zero tokens included
    (no row: ``top_slot_weight`` is ``below-0.99``): the classification never fails a call the kernel
    has not been given yet. The slots of both caches line up with the lanes of ``scores``."""
    import dataclasses

    from pytest_sparse_mla import search, search_run

    calls = covering.schedule(ReferenceImplementation.envelope)
    call = next(c for c in calls if c.fmt == "dsv4" and (c.extra is not None) == extra)
    inputs = search.build(dataclasses.replace(call, num_tokens=num_tokens, empty_fraction=0.0), "cpu")
    slots = search_run._slots(inputs)
    assert tuple(slots.shape) == (num_tokens, inputs.scores.shape[-1])
    feats = regions.built_features(inputs.q, inputs.scores, slots, search.masked_lanes(inputs))
    assert set(feats) == set(regions.BUILT)
    if num_tokens == 0:
        assert feats == {"query_peak": "e4m3-range", "top_slot_weight": "below-0.99", "masked_lane_weight": "none"}
