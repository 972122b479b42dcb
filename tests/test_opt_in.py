"""Installing pytest-sparse-mla changes nothing in a session that does not use it.

The activation rule (``pytest_sparse_mla.options.activation``, README "Set up and go"): the plugin
is active when it is loaded by name (``-p sparse_mla``, also through ``PYTEST_ADDOPTS`` or the ini
``addopts``), when any ``--sparse-mla-*`` option is given, or when any ``sparse_mla_*`` ini key is
set. Otherwise its entry point is loaded but every hook returns at once. ``-p no:sparse_mla`` keeps
it from loading at all, which is what a session sees without the package.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

# Imported up front: pytester's in-process runs restore sys.modules afterwards, so a torch first
# imported inside one (the report header probes it) would be unloaded and imported again by the next.
import torch  # noqa: F401

FOREIGN_CONFTEST = '''
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "requires_torch(text): this project's own marker, any text")
'''

FOREIGN_TEST = '''
import json
import os

import pytest

KEYS = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "TRITON_INTERPRET")


@pytest.mark.requires_torch("any version please")
@pytest.mark.parametrize("i", range(4))
def test_sees_the_environment(i, worker_id):
    seen = {key: os.environ.get(key) for key in KEYS}
    print("ENV", worker_id, json.dumps(seen))
    out = os.environ["FOREIGN_OUT"]
    with open(os.path.join(out, f"{worker_id}-{i}.json"), "w") as f:
        json.dump(seen, f)
'''

_DURATION = re.compile(r" in [0-9.]+s( \([0-9:]+\))?")


def _without_plugins_line(lines: list[str], *, installed: bool = False) -> list[str]:
    """The lines without pytest's own ``plugins:`` line, which names every installed plugin
    distribution: the one line that says the package is installed (true, and nothing is loaded
    for it). With ``installed``, check the line lists ``sparse-mla`` and otherwise the others."""
    kept, plugins = [], []
    for line in lines:
        if line.startswith("plugins: "):
            listed = line.removeprefix("plugins: ").split(", ")
            plugins = [p for p in listed if not p.startswith("sparse-mla-")]
            assert installed == (len(plugins) == len(listed) - 1), line
            kept.append(f"plugins: {', '.join(plugins)}")
        else:  # pytest pads a summary line with "=" to the terminal width around its text, durations included
            kept.append(_DURATION.sub("", line).strip("= "))
    return kept


def _foreign_project(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(FOREIGN_CONFTEST)
    pytester.makepyfile(test_foreign=FOREIGN_TEST)
    pytester.makeini("[pytest]\naddopts = --strict-markers\n")


def _run(pytester: pytest.Pytester, out: Path, *args: str) -> tuple[list[str], dict[str, dict[str, str | None]]]:
    out.mkdir()
    pytester._monkeypatch.setenv("FOREIGN_OUT", str(out))
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider", *args)
    result.assert_outcomes(passed=4)
    seen = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}
    lines = [_DURATION.sub("", line) for line in result.stdout.lines if not line.startswith("[gw")]
    return lines, seen


def _by_case(seen: dict[str, dict[str, str | None]]) -> dict[str, dict[str, str | None]]:
    """``{"gw0-2": env}`` -> ``{"2": env}``."""
    return {name.rsplit("-", 1)[1]: env for name, env in seen.items()}


@pytest.mark.full_tier  # pytest processes with xdist workers
def test_a_foreign_project_sees_what_it_sees_without_the_package(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its own ``requires_torch`` marker, ``-n 2``, and a test printing CUDA_VISIBLE_DEVICES,
    OMP_NUM_THREADS and TRITON_INTERPRET: with the package installed (entry point loaded) the run
    is line for line the run with the plugin absent (``-p no:sparse_mla``)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    for name in ("OMP_NUM_THREADS", "TRITON_INTERPRET", "PYTEST_ADDOPTS", "PYTEST_PLUGINS"):
        monkeypatch.delenv(name, raising=False)
    _foreign_project(pytester)
    installed_lines, installed_env = _run(pytester, pytester.path / "installed")
    # absent: neither the plugin nor the alias entry point behind ``-p sparse-mla`` (alias.py) is loaded
    absent_lines, absent_env = _run(pytester, pytester.path / "absent", "-p", "no:sparse_mla", "-p", "no:sparse-mla")

    expected = {"CUDA_VISIBLE_DEVICES": "0,1", "OMP_NUM_THREADS": None, "TRITON_INTERPRET": None}
    # Which worker ran which case is xdist's choice and differs between runs: compare by case.
    assert _by_case(installed_env) == _by_case(absent_env)
    assert all(env == expected for env in installed_env.values()), installed_env
    assert all(env == expected for env in absent_env.values()), absent_env
    assert {name.split("-")[0] for name in installed_env} == {"gw0", "gw1"}
    assert _without_plugins_line(installed_lines, installed=True) == _without_plugins_line(absent_lines)
    assert not any(line.startswith("sparse-mla") for line in installed_lines)

    for listing in ("--markers", "--fixtures"):
        installed = pytester.runpytest_subprocess(listing, "-p", "no:cacheprovider").stdout.lines
        absent = pytester.runpytest_subprocess(
            listing, "-p", "no:cacheprovider", "-p", "no:sparse_mla", "-p", "no:sparse-mla"
        ).stdout.lines
        assert _without_plugins_line(installed, installed=True) == _without_plugins_line(absent), listing


@pytest.mark.full_tier  # pytest processes with xdist workers
def test_the_same_project_with_the_plugin_loaded_is_pinned_and_capped(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The contrast: with ``-p sparse_mla`` the workers are pinned (one GPU each) and share the
    CPU cores, and the project's own marker is still its own (no usage error)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    _foreign_project(pytester)
    lines, seen = _run(pytester, pytester.path / "used", "-p", "sparse_mla")
    assert {name.split("-")[0]: env["CUDA_VISIBLE_DEVICES"] for name, env in seen.items()} == {"gw0": "0", "gw1": "1"}
    assert {env["OMP_NUM_THREADS"] for env in seen.values()} != {None}
    assert any(line.startswith("sparse-mla: device=") for line in lines)


@pytest.mark.parametrize(
    ("args", "ini", "active"),
    [
        ((), "", None),
        (("-p", "sparse_mla"), "", "-p sparse_mla"),
        (("--disable-plugin-autoload", "-p", "pytest_sparse_mla.plugin"), "", "-p pytest_sparse_mla.plugin"),
        # the name pytest's plugins: header line shows (entry point sparse-mla -> pytest_sparse_mla.alias)
        (("-p", "sparse-mla"), "", "-p sparse-mla"),
        (("--disable-plugin-autoload", "-p", "sparse-mla"), "", "-p sparse-mla"),
        (("--sparse-mla-seed", "3"), "", "--sparse-mla-seed"),
        (("--sparse-mla-device", "auto"), "", "--sparse-mla-device"),  # given, even if the default
        ((), "addopts = -p sparse_mla\n", "-p sparse_mla in the ini addopts"),
        ((), "sparse_mla_impl = reference\n", "ini sparse_mla_impl"),
        ((), "sparse_mla_tolerances =\n    tight.row_sigmas = 5\n", "ini sparse_mla_tolerances"),
        ((), "sparse_mla_search_shard_group = 1/2\n", "ini sparse_mla_search_shard_group"),
        (("--sparse-mla-search-shard-group", "0/2"), "", "--sparse-mla-search-shard-group"),
    ],
)
def test_activation_rule(pytester: pytest.Pytester, args: tuple[str, ...], ini: str, active: str | None) -> None:
    pytester.makeini("[pytest]\n" + ini)
    pytester.makepyfile(
        """
        from pytest_sparse_mla import api

        def test_active(pytestconfig):
            print("ACTIVE", api.is_active(pytestconfig), api.get_options(pytestconfig).activated_by or None)
        """
    )
    result = pytester.runpytest("-s", *args)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"*ACTIVE {active is not None} {active}*"])
    header = [line for line in result.stdout.lines if line.startswith("sparse-mla:")]
    assert bool(header) == (active is not None)


def test_dash_p_no_sparse_mla_turns_it_off(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\naddopts = -p sparse_mla\n")
    pytester.makepyfile("def test_uses_a_fixture(sparse_mla_device):\n    pass\n")
    assert pytester.runpytest().ret == pytest.ExitCode.OK
    result = pytester.runpytest("-p", "no:sparse_mla")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'sparse_mla_device' not found*"])
    assert not any(line.startswith("sparse-mla:") for line in result.stdout.lines)


def test_the_shipped_suites_with_the_plugin_turned_off_are_one_usage_error(pytester: pytest.Pytester) -> None:
    """``-p no:sparse_mla`` blocks the plugin itself, so the suites' own ``conftest.py`` says it: one
    usage error naming the option, instead of a "fixture not found" error per test."""
    from pytest_sparse_mla.selection import _suites_dirs

    suites = _suites_dirs()[0]
    result = pytester.runpytest_subprocess(
        str(suites / "test_formats.py"), "-p", "no:sparse_mla", "-p", "no:cacheprovider"
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()[-2000:]
    result.stderr.fnmatch_lines(["*suites need the plugin, which -p no:sparse_mla turned off: drop -p no:sparse_mla*"])
    assert "fixture" not in result.stdout.str()


@pytest.mark.full_tier  # pytest processes with xdist workers
def test_an_inactive_session_gets_no_fixtures_markers_or_snapshot_guard(pytester: pytest.Pytester) -> None:
    """Not active: the plugin's fixtures and markers are not registered, and a syrupy user's
    ``--snapshot-update -n 2`` is syrupy's business, not refused by this plugin."""
    pytester.makepyfile("def test_ok():\n    pass\n")
    fixtures = pytester.runpytest("--fixtures").stdout.str()
    assert "packed_kv_cache_factory" not in fixtures and "sparse_mla_impl" not in fixtures
    markers = pytester.runpytest("--markers").stdout.str()
    assert "sparse_mla" not in markers
    result = pytester.runpytest_subprocess("--snapshot-update", "-n", "2", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_collecting_the_shipped_suites_without_the_plugin_says_how_to_load_it(pytester: pytest.Pytester) -> None:
    """Not active, the plugin does nothing, but a session that collects its shipped suites would
    only see "fixture not found": it stops with a usage error, once (under xdist too, when the
    command line names the suites; collected through a parent folder, each test fails)."""
    suite = ("--pyargs", "pytest_sparse_mla.suites.test_formats", "-p", "no:cacheprovider")
    needs = "*the pytest-sparse-mla suites need the plugin, which is opt-in: run with -p sparse_mla *"
    result = pytester.runpytest_subprocess(*suite)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([needs])
    under_xdist = pytester.runpytest_subprocess(*suite, "-n", "2", "-k", "known_vector")
    assert under_xdist.ret == pytest.ExitCode.USAGE_ERROR, under_xdist.stdout.str()[-2000:]
    under_xdist.stderr.fnmatch_lines([needs])  # once, before any worker starts
    assert under_xdist.stdout.str().count("suites need the plugin") == 0


def test_a_misspelled_ini_key_is_named_where_the_suites_need_the_plugin(pytester: pytest.Pytester) -> None:
    """A misspelled ``sparse_mla_*`` ini key activates nothing: the usage error names it and the
    closest key of the plugin."""
    pytester.makeini("[pytest]\nsparse_mla_implementation = mykernel\n")
    result = pytester.runpytest_subprocess(
        "--pyargs", "pytest_sparse_mla.suites.test_formats", "-p", "no:cacheprovider"
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*suites need the plugin*; the ini file sets 'sparse_mla_implementation' (did you mean 'sparse_mla_impl'?)*"]
    )


def test_a_folder_holding_the_shipped_suites_under_xdist_without_the_plugin_is_one_usage_error(
    pytester: pytest.Pytester,
) -> None:
    """Collected through a parent folder (``pytest -n 2 <folder holding suites/>``), the suites would
    fail test by test in every worker: the usage error comes once, before the workers start; a
    folder that ``--ignore``s them is left alone."""
    from pytest_sparse_mla.selection import _suites_dirs

    parent = _suites_dirs()[0].parent
    empty_ini = pytester.makeini("[pytest]\n")
    args = (str(parent), "-c", str(empty_ini), "-n", "2", "-p", "no:cacheprovider", "-k", "known_vector")
    result = pytester.runpytest_subprocess(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()[-2000:]
    result.stderr.fnmatch_lines(["*the pytest-sparse-mla suites need the plugin, which is opt-in: run with -p *"])
    assert result.stdout.str().count("suites need the plugin") == 0
    from pytest_sparse_mla import selection

    class _Config:  # what names_shipped_suites reads, with the suites --ignore-d
        args = [str(parent)]
        option = type("O", (), {"pyargs": False})()
        invocation_params = type("I", (), {"dir": str(parent)})()

        @staticmethod
        def getoption(name, default=None):
            return [str(d) for d in _suites_dirs()] if name == "ignore" else default

    assert not selection.names_shipped_suites(_Config())  # type: ignore[arg-type]
