"""The search across a CI matrix of machines (``pytest_sparse_mla.shards``; README, "A CI matrix of
machines"): ``--sparse-mla-search-shard-group I/N`` (``SPARSE_MLA_SEARCH_SHARD_GROUP``, ini
``sparse_mla_search_shard_group``) and the merge of the machines' reports (``sparse-mla-report``).

* Two machines' shard groups are disjoint and their union is one machine's ``N*K`` shards: the test
  ids of the shipped search suite (collected in this process), and the calls each shard draws (a
  throwaway project whose search test records the integers Hypothesis drew), seeded and derandomized.
* The seeds: shard ``g`` of seed ``S`` draws what shard 0 of seed ``S+g`` draws; derandomized,
  every shard draws its own calls, the same in every run.
* Bad groups stop the session with a usage error naming where the value came from.
* ``sparse-mla-report`` merges two machines' JSON reports (hand-written, with hand-computed sums)
  into one run, and refuses two reports of one shard group.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import inner_session
import pytest

from pytest_sparse_mla import conformance, shards
from pytest_sparse_mla.errors import SparseMlaUsageError

ROOT = Path(__file__).resolve().parents[1]
SEARCH_SUITE = ROOT / "suites" / "test_attention_search.py"
PROPERTIES = (
    "test_a_call_sequence_on_the_same_buffers_matches_fresh_calls",
    "test_a_drawn_call_matches_the_oracle",
    "test_a_drawn_call_does_not_depend_on_lane_order_or_padding",
)

#: A search test that records, per shard, its seed and shard and the integers Hypothesis drew.
RECORDING_TEST = """
import json, os

from hypothesis import given, strategies as st


def test_draws(sparse_mla_search, request):
    seen = []

    @given(st.integers(0, 2**40))
    def inner(x):
        seen.append(x)

    sparse_mla_search.run(inner)
    row = {"id": request.node.callspec.id, "seed": sparse_mla_search.seed, "shard": sparse_mla_search.shard,
           "draws": seen}
    with open(os.environ["DRAWS"], "a") as out:
        out.write(json.dumps(row) + "\\n")
"""


def _collected(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str,
               env: dict[str, str] | None = None) -> list[str]:  # fmt: skip
    """The test ids of the shipped search suite that a session with ``args`` collects."""
    code, out = inner_session.run(
        ["-p", "sparse_mla", str(SEARCH_SUITE), "--collect-only", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "--rootdir", str(ROOT), *args],
        cwd=ROOT, monkeypatch=monkeypatch, capsys=capsys, env=env,
    )  # fmt: skip
    assert code == 0, out[-3000:]
    return [line.split("::", 1)[1] for line in out.splitlines() if line.startswith("suites/test_attention_search.py::")]


def _ids(*shard_indices: int) -> list[str]:
    return [f"{name}[shard{k}]" for name in PROPERTIES for k in shard_indices]


def test_two_machines_collect_disjoint_shards_whose_union_is_one_machines_shards(monkeypatch, capsys):
    one = _collected(monkeypatch, capsys, "--sparse-mla-search-shards", "6")
    first = _collected(monkeypatch, capsys, "--sparse-mla-search-shards", "3", "--sparse-mla-search-shard-group", "0/2")
    second = _collected(monkeypatch, capsys, "--sparse-mla-search-shards", "3",
                        env={"SPARSE_MLA_SEARCH_SHARD_GROUP": "1/2"})  # fmt: skip
    assert sorted(one) == sorted(_ids(0, 1, 2, 3, 4, 5))
    assert sorted(first) == sorted(_ids(0, 1, 2))
    assert sorted(second) == sorted(_ids(3, 4, 5))
    assert not set(first) & set(second)
    assert sorted(first + second) == sorted(one)
    # Without --sparse-mla-search-shards, machine I of N runs the one global shard I.
    assert sorted(_collected(monkeypatch, capsys, "-o", "sparse_mla_search_shard_group=2/3")) == sorted(_ids(2))


def test_the_option_wins_over_the_variable_which_wins_over_the_ini_key(monkeypatch, capsys):
    ini = ("-o", "sparse_mla_search_shard_group=1/4")
    assert sorted(_collected(monkeypatch, capsys, *ini)) == sorted(_ids(1))
    env = {"SPARSE_MLA_SEARCH_SHARD_GROUP": "2/4"}
    assert sorted(_collected(monkeypatch, capsys, *ini, env=env)) == sorted(_ids(2))
    cli = ("--sparse-mla-search-shard-group", "3/4")
    assert sorted(_collected(monkeypatch, capsys, *ini, *cli, env=env)) == sorted(_ids(3))
    assert sorted(_collected(monkeypatch, capsys, *ini, *cli, env={"SPARSE_MLA_SEARCH_SHARD_GROUP": ""})) == sorted(
        _ids(3)
    )


def _draws(pytester: pytest.Pytester, monkeypatch, capsys, name: str, *args: str,
           env: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:  # fmt: skip
    """``{shard id: row}`` of a run of :data:`RECORDING_TEST` (5 calls per shard) with ``args``; its
    JSON report is ``<name>.json``."""
    out = pytester.path / f"{name}.jsonl"
    result = inner_session.runpytest(
        pytester, "-p", "sparse_mla", "-p", "no:xdist", "-p", "no:cacheprovider", "--sparse-mla-device", "cpu",
        "--sparse-mla-search-examples", "5", "--sparse-mla-report-json", str(pytester.path / f"{name}.json"), *args,
        monkeypatch=monkeypatch, capsys=capsys, env={"DRAWS": str(out), **(env or {})},
    )  # fmt: skip
    assert result.ret == 0, result.stdout.str()[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return {row["id"]: row for row in rows}


@pytest.mark.parametrize("seed", [None, 11], ids=["derandomized", "seeded"])
def test_the_machines_of_a_matrix_draw_what_one_machine_draws(pytester, monkeypatch, capsys, seed):
    pytest.importorskip("hypothesis")
    pytester.makepyfile(test_draws=RECORDING_TEST)
    seeded = ("--sparse-mla-search-seed", str(seed)) if seed is not None else ()
    one = _draws(pytester, monkeypatch, capsys, "one", "--sparse-mla-search-shards", "4", *seeded)
    machines = [
        _draws(pytester, monkeypatch, capsys, f"m{i}", "--sparse-mla-search-shards", "2",
               "--sparse-mla-search-shard-group", f"{i}/2", *seeded)
        for i in range(2)
    ]  # fmt: skip
    assert sorted(machines[0]) == ["shard0", "shard1"] and sorted(machines[1]) == ["shard2", "shard3"]
    assert {**machines[0], **machines[1]} == one  # the same ids, seeds, global shards and calls
    assert [one[f"shard{k}"]["shard"] for k in range(4)] == [0, 1, 2, 3]
    assert {row["seed"] for row in one.values()} == {seed}
    # Every shard draws its own calls (beyond the simplest call, which Hypothesis tries first everywhere).
    calls = [tuple(one[f"shard{k}"]["draws"]) for k in range(4)]
    assert all(len(c) == 5 for c in calls)
    assert len(set(calls)) == 4
    # A run is reproducible: the same shard draws the same calls again.
    again = _draws(pytester, monkeypatch, capsys, "again", "--sparse-mla-search-shards", "4", *seeded)
    assert again == one
    # The machines' reports merge into the one machine's tests.
    assert conformance.main([str(pytester.path / "m0.json"), str(pytester.path / "m1.json"),
                             "--md", str(pytester.path / "merged.md"),
                             "--json", str(pytester.path / "merged.json")]) == 0  # fmt: skip
    merged = json.loads((pytester.path / "merged.json").read_text())
    single = json.loads((pytester.path / "one.json").read_text())
    assert list(merged["implementations"]) == ["reference"]
    entry = merged["implementations"]["reference"]
    assert entry["totals"]["passed"] == 4 and entry["tests"] == 4
    assert entry["search"]["tests"] == single["search"]["tests"] == 4
    assert [(g["group"], g["global_shards"]) for g in entry["shard_groups"]] == [("0/2", [0, 1]), ("1/2", [2, 3])]
    assert entry["missing_shard_groups"] == []


def test_shard_g_of_seed_s_draws_what_shard_0_of_seed_s_plus_g_draws(pytester, monkeypatch, capsys):
    pytest.importorskip("hypothesis")
    pytester.makepyfile(test_draws=RECORDING_TEST)
    late = _draws(pytester, monkeypatch, capsys, "late", "--sparse-mla-search-seed", "5",
                  "--sparse-mla-search-shards", "2", "--sparse-mla-search-shard-group", "1/2")  # fmt: skip
    early = _draws(pytester, monkeypatch, capsys, "early", "--sparse-mla-search-seed", "8")
    assert sorted(late) == ["shard2", "shard3"]
    assert late["shard3"]["draws"] == early["shard0"]["draws"]  # 5 + 3 == 8 + 0


def test_derandomized_seeds_are_fixed_and_distinct_per_shard() -> None:
    def inner() -> None: ...

    assert shards.hypothesis_seed(7, 3, inner) == 10
    assert shards.hypothesis_seed(None, 0, inner) is None  # Hypothesis's own derandomization
    derived = [shards.hypothesis_seed(None, k, inner) for k in range(1, 6)]
    assert len(set(derived)) == 5 and all(isinstance(s, int) for s in derived)
    assert derived == [shards.hypothesis_seed(None, k, inner) for k in range(1, 6)]

    def other() -> None: ...

    named = shards.hypothesis_seed(None, 0, inner, named=True)  # a property under a shared @given body
    assert isinstance(named, int) and named != shards.hypothesis_seed(None, 0, other, named=True)
    assert shards.hypothesis_seed(7, 3, inner, named=True) == 10  # a given seed is the shard's, as before


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0/1", (0, 1)), ("3/4", (3, 4)), (" 1 / 2 ", (1, 2))],
)
def test_a_group_parses(text: str, expected: tuple[int, int]) -> None:
    group = shards.parse_group(text)
    assert (group.index, group.count) == expected and str(group) == f"{expected[0]}/{expected[1]}"


def test_a_groups_shards() -> None:
    assert list(shards.session_shards(3, None)) == [0, 1, 2]
    assert list(shards.session_shards(3, shards.ShardGroup(2, 4))) == [6, 7, 8]
    assert list(shards.session_shards(1, shards.ShardGroup(3, 4))) == [3]
    assert shards.header_lines(4, shards.ShardGroup(1, 3), 100) == [
        "sparse-mla: search shard group 1/3: global shards 4..7 of 0..11 (seeds 104..107)"
    ]
    assert shards.header_lines(2, shards.ShardGroup(0, 2), None) == [
        "sparse-mla: search shard group 0/2: global shards 0..1 of 0..3 (derandomized)"
    ]
    assert shards.header_lines(4, None, 100) == []


@pytest.mark.parametrize(
    ("where", "value", "message"),
    [
        ("cli", "2/2", "--sparse-mla-search-shard-group='2/2': machine 2 is not below the number of machines 2"),
        ("cli", "5/2", "--sparse-mla-search-shard-group='5/2': machine 5 is not below the number of machines 2"),
        ("cli", "0/0", "--sparse-mla-search-shard-group='0/0': the number of machines N must be >= 1"),
        ("cli", "1-2", "--sparse-mla-search-shard-group='1-2': expected I/N, machine I of a matrix of N machines"),
        ("cli", "-1/2", "--sparse-mla-search-shard-group='-1/2': expected I/N"),
        ("cli", "", "--sparse-mla-search-shard-group='': expected I/N"),
        ("env", "1/1", "SPARSE_MLA_SEARCH_SHARD_GROUP='1/1': machine 1 is not below the number of machines 1"),
        ("ini", "a/b", "ini sparse_mla_search_shard_group='a/b': expected I/N"),
    ],
)
def test_a_bad_group_is_a_usage_error_naming_where_it_came_from(pytester, monkeypatch, capsys, where, value, message):
    pytester.makepyfile("def test_x():\n    pass\n")
    args = {"cli": (f"--sparse-mla-search-shard-group={value}",),  # "=": "-1/2" is a value, not an option
            "ini": ("-o", f"sparse_mla_search_shard_group={value}")}  # fmt: skip
    env = {"SPARSE_MLA_SEARCH_SHARD_GROUP": value} if where == "env" else None
    result = inner_session.runpytest(pytester, "-p", "sparse_mla", "-p", "no:cacheprovider", *args.get(where, ()),
                                     monkeypatch=monkeypatch, capsys=capsys, env=env)  # fmt: skip
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert f"ERROR: {message}" in result.stdout.str()
    with pytest.raises(SparseMlaUsageError, match="0 <= I < N"):
        shards.parse_group(value, "x")


def test_the_variable_alone_does_not_activate_the_plugin(pytester, monkeypatch, capsys):
    """A machine whose CI sets the variable for every job leaves other projects' sessions alone: a
    session that does not use the plugin neither reads nor checks it."""
    pytester.makepyfile("def test_x(pytestconfig):\n    from pytest_sparse_mla import api\n"
                        "    assert not api.is_active(pytestconfig)\n")  # fmt: skip
    result = inner_session.runpytest(pytester, "-p", "no:cacheprovider", monkeypatch=monkeypatch, capsys=capsys,
                                     env={"SPARSE_MLA_SEARCH_SHARD_GROUP": "not a group"})  # fmt: skip
    result.assert_outcomes(passed=1)


# --- merging the search summaries and the machines' reports ---------------------------------------


def test_search_summaries_merge_known_and_unknown_keys() -> None:
    a = {"calls": 10, "failed": 1, "seed": 4, "dims": {"heads": {"min": 1, "max": 8}, "fmt": {"values": {"dsv4": 6}}},
         "discrepancies": [{"key": "sink-dropped", "region": "sink", "count": 2}, {"key": "lse-base", "region": "lse"}],
         "spent": {"examples": 10, "shrinks": 3}, "note": "x"}  # fmt: skip
    b = {"calls": 7, "failed": 0, "seed": 4, "dims": {"heads": {"min": 2, "max": 16}, "fmt": {"values": {"dsv4": 1,
         "dsv3_2": 6}}}, "discrepancies": [{"key": "sink-dropped", "region": "other", "count": 1}],
         "spent": {"examples": 7, "rounds": 2}, "note": "y"}  # fmt: skip
    merged = shards.merge_summaries([a, b])
    assert merged == {
        "tests": 2, "calls": 17, "failed": 1, "seed": 4,
        "dims": {"heads": {"min": 1, "max": 16}, "fmt": {"values": {"dsv4": 7, "dsv3_2": 6}}},
        "discrepancies": [{"key": "sink-dropped", "region": "sink", "count": 3}, {"key": "lse-base", "region": "lse"}],
        "spent": {"examples": 17, "shrinks": 3, "rounds": 2},
        "note": None,  # disagreeing scalars
    }  # fmt: skip
    # Merged summaries merge again (machines): their "tests" count, not 1 each.
    again = shards.merge_summaries([merged, {"tests": 3, "calls": 1, "failed": 0, "seed": 4, "dims": {}}])
    assert (again["tests"], again["calls"], again["seed"]) == (5, 18, 4)
    # Discrepancies without counts are listed once, the first one's region kept; with a count on one
    # side, one without counts 1.
    plain = shards.merge_summaries([{"discrepancies": [{"key": "k", "region": 1}]},
                                    {"discrepancies": [{"key": "k", "region": 2}, {"key": "j"}]}])  # fmt: skip
    assert plain["discrepancies"] == [{"key": "k", "region": 1}, {"key": "j"}]
    mixed = shards.merge_summaries([{"discrepancies": [{"key": "k"}]}, {"discrepancies": [{"key": "k", "count": 4}]}])
    assert mixed["discrepancies"] == [{"key": "k", "count": 5}]


def _machine_report(group: str | None, tests: list[tuple[str, str]], search: dict[str, Any] | None,
                    **extra: Any) -> dict[str, Any]:  # fmt: skip
    index, _, count = (group or "0/1").partition("/")
    per = 2
    return {
        "options": {"impl": "mykernel", "device": "cuda", "seed": 0, "grid": None, "xfail_file": None,
                    "search_examples": 200, "search_seed": 9, "search_shards": per, "search_shard_group": group,
                    "search_global_shards": list(range(int(index) * per, int(index) * per + per))},
        "capabilities": {"device_name": "H200", "device_count": 8},
        "workers": {"gw0": {"device_name": "H200"}},
        "envelope": {},
        "coverage": [{"class": "sink", "ran": 2, "passed": 1, "failed": 1, "not_run": 1,
                      "why_not": ["1 x not applicable"]}],
        "device_faults": [],
        "search": search,
        "tests": [{"file": i.split("::")[0], "id": i, "outcome": o, "message": "", "seconds": 1.0} for i, o in tests],
        "exit": extra.get("exit", 0),
        "seconds": extra.get("seconds", 10.0),
        "command": "pytest", "python": "3.11", "cpu_count": 16, "date_utc": "2026-12-03 00:00:00",
    }  # fmt: skip


def test_sparse_mla_report_merges_two_machines_of_a_search_matrix(tmp_path: Path) -> None:
    s = "suites/test_attention_search.py::test_oracle"
    f = "suites/test_formats.py::test_known_vector"
    m0 = _machine_report(
        "0/2", [(f"{s}[shard0]", "passed"), (f"{s}[shard1]", "failed"), (f, "passed")],
        {"tests": 2, "calls": 400, "failed": 1, "seed": 9, "dims": {"heads": {"min": 1, "max": 64}},
         "discrepancies": [{"key": "sink-dropped", "region": "sink", "count": 1}], "spent": {"examples": 400}},
        exit=1, seconds=30.0,
    )  # fmt: skip
    m1 = _machine_report(
        "1/2", [(f"{s}[shard2]", "passed"), (f"{s}[shard3]", "xfailed"), (f, "failed")],
        {"tests": 2, "calls": 350, "failed": 0, "seed": 9, "dims": {"heads": {"min": 2, "max": 128}},
         "discrepancies": [{"key": "sink-dropped", "region": "sink", "count": 2}, {"key": "nan-lane", "region": "pad"}],
         "spent": {"examples": 350, "shrinks": 5}},
        seconds=45.5,
    )  # fmt: skip
    other = _machine_report(None, [(f, "passed")], None)
    other["options"]["impl"] = "reference"
    paths = []
    for name, doc in (("m1", m1), ("ref", other), ("m0", m0)):  # out of order: the merge sorts the machines
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(doc))
    md, out = tmp_path / "merged.md", tmp_path / "merged.json"
    assert conformance.main([*map(str, paths), "--md", str(md), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert list(doc["implementations"]) == ["mykernel", "reference"]
    entry = doc["implementations"]["mykernel"]
    # 4 search shards + the fixed test once (failed on machine 1: a failure anywhere is a failure).
    assert entry["tests"] == 5
    assert entry["totals"] == {"passed": 2, "failed": 2, "error": 0, "skipped": 0, "xfailed": 1, "xpassed": 0}
    assert (entry["exit"], entry["seconds"]) == (1, 45.5)
    assert entry["search"] == {
        "tests": 4, "calls": 750, "failed": 1, "seed": 9, "dims": {"heads": {"min": 1, "max": 128}},
        "discrepancies": [{"key": "sink-dropped", "region": "sink", "count": 3}, {"key": "nan-lane", "region": "pad"}],
        "spent": {"examples": 750, "shrinks": 5},
    }  # fmt: skip
    assert entry["coverage"] == [{"class": "sink", "ran": 4, "passed": 2, "failed": 2, "not_run": 2,
                                  "why_not": ["2 x not applicable"]}]  # fmt: skip
    groups = [(g["group"], g["report"], g["global_shards"], g["tests"], g["exit"], g["search"])
              for g in entry["shard_groups"]]  # fmt: skip
    assert groups == [
        ("0/2", str(paths[2]), [0, 1], 3, 1, {"tests": 2, "calls": 400, "failed": 1}),
        ("1/2", str(paths[0]), [2, 3], 3, 0, {"tests": 2, "calls": 350, "failed": 0}),
    ]
    assert entry["missing_shard_groups"] == []
    assert doc["implementations"]["reference"]["shard_groups"] == []
    text = md.read_text()
    assert "## Search (the property tests' drawn calls)" in text
    assert "* `mykernel`: 4 search test shards, 750 calls drawn (shrinking included), 1 failed; seed 9." in text
    assert f"  * machine 0/2 ({paths[2]}): shards 0..1, 3 tests, exit 1, 400 calls drawn, 1 failed." in text
    assert "  * discrepancy `sink-dropped` (3 x): sink" in text


def test_a_missing_machine_is_reported_and_a_repeated_one_refused(tmp_path: Path, capsys) -> None:
    s = "suites/test_attention_search.py::test_oracle"
    search = {"tests": 2, "calls": 4, "failed": 0, "seed": 9, "dims": {}}
    first = tmp_path / "a.json"
    first.write_text(json.dumps(_machine_report("0/3", [(f"{s}[shard0]", "passed")], search)))
    last = tmp_path / "c.json"
    last.write_text(json.dumps(_machine_report("2/3", [(f"{s}[shard4]", "passed")], search)))
    md, out = tmp_path / "m.md", tmp_path / "m.json"
    assert conformance.main([str(first), str(last), "--md", str(md), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["implementations"]["mykernel"]["missing_shard_groups"] == ["1/3"]
    assert "**missing machines** (no report): 1/3." in md.read_text()
    with pytest.raises(SystemExit) as stop:
        conformance.main([str(first), str(first), "--md", str(md)])
    assert stop.value.code == 2
    assert f"{first}: shard group 0/3 of 'mykernel' is also in {first}" in capsys.readouterr().err
