"""Self-tests of downstream reuse: the example project, the shipped suites, entry points, id files.

What a kernel library does with pytest-sparse-mla, each run in a fresh pytest session: in this
process (``inner_session.runpytest``: a fresh config, plugin manager and collection, the project's
folder first on ``sys.path`` as a subprocess gets it on ``PYTHONPATH``) where what is tested is the
session (the hook, an entry point, an import string), in a fresh process where it is the install
(the wheel) or a run's own warnings (id files):

* ``examples/downstream`` runs its own tests (its conftest registers implementations through the
  ``pytest_sparse_mla_implementations`` hook and builds inputs from the plugin's fixtures);
* the suites, imported as the package ``pytest_sparse_mla.suites`` (``--pyargs``), run against the
  example's kernel selected by import string, by an installed entry point, and by the hook;
* ``--sparse-mla-xfail-file`` / ``--sparse-mla-skip-file`` excuse listed ids of the installed suites
  and warn about ids that match nothing;
* the built wheel holds the suites and the goldens, and the suites run from it.

Selections are small (``-k``) to keep each run to a few seconds.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import inner_session
import pytest

# Imported up front: pytester's in-process runs restore sys.modules afterwards, so a torch first
# imported inside one would be unloaded and imported again by the next.
import torch  # noqa: F401

import pytest_sparse_mla.attention  # noqa: F401
from pytest_sparse_mla import api, entry_points, selection

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "downstream"
TESTS = Path(__file__).resolve().parent
#: A fast slice of the attention-accuracy suite: one case without and one with a sink.
LSE_PAIR = "lse_conventions and dsv4 and not dsv4_1 and flashinfer-1.0"
ACCURACY = "pytest_sparse_mla.suites.test_attention_accuracy"


def _copy_example(dest: Path) -> None:
    for item in EXAMPLE.iterdir():
        if item.name in ("__pycache__", ".pytest_cache") or item.name.endswith(".egg-info"):
            continue
        target = dest / item.name
        if item.is_dir():
            shutil.copytree(item, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(item, target)


def _fake_install(site: Path) -> None:
    """What ``pip install examples/downstream`` leaves in site-packages, minus the wheel build:
    the ``chunked_mla`` package and a dist-info whose ``entry_points.txt`` declares ``chunked``
    (importlib.metadata finds distributions on ``sys.path`` by their dist-info directories)."""
    shutil.copytree(EXAMPLE / "chunked_mla", site / "chunked_mla", ignore=shutil.ignore_patterns("__pycache__"))
    info = site / "sparse_mla_chunked_example-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sparse-mla-chunked-example\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(
        f"[{entry_points.ENTRY_POINT_GROUP}]\nchunked = chunked_mla:ChunkedSparseMla\n"
    )


def _pythonpath(first: Path) -> str:
    """``PYTHONPATH`` for a subprocess with ``first`` in front (pytester adds its own directory)."""
    return os.pathsep.join(filter(None, [str(first), os.environ.get("PYTHONPATH")]))


def _outcomes(result: pytest.RunResult) -> dict[str, int]:
    try:
        return result.parseoutcomes()
    except ValueError:  # no summary line: show what happened
        raise AssertionError(result.stdout.str()[-3000:] + result.stderr.str()[-3000:]) from None


def _assert_clean_pass(result: pytest.RunResult, at_least: int) -> dict[str, int]:
    outcomes = _outcomes(result)
    assert outcomes.get("passed", 0) >= at_least, result.stdout.str()[-4000:]
    for bad in ("failed", "error", "errors", "xpassed"):
        assert bad not in outcomes, result.stdout.str()[-4000:]
    return outcomes


# --- the example project ---------------------------------------------------------------------


@pytest.mark.full_tier
def test_example_project_passes_its_own_tests(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _copy_example(pytester.path)
    result = inner_session.runpytest(pytester, "-p", "no:cacheprovider", "-rs", monkeypatch=monkeypatch, capsys=capsys)
    # Its default implementation is chunked-96, registered by its conftest through the hook.
    result.stdout.fnmatch_lines(["sparse-mla: device=* impl=chunked-96 *"])
    outcomes = _assert_clean_pass(result, at_least=8)
    assert "skipped" not in outcomes


# --- the shipped suites against the example's kernel -------------------------------------------


@pytest.mark.full_tier
def test_installed_suites_run_against_the_example_by_import_string(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _copy_example(pytester.path)
    result = inner_session.runpytest(
        pytester, "--pyargs", ACCURACY, "pytest_sparse_mla.suites.test_attention_inputs",
        "--sparse-mla-impl", "chunked_mla:ChunkedSparseMla",
        "-k", f"({LSE_PAIR}) or zero_tokens or attn_sink or extra_indices", "-p", "no:cacheprovider", "-v",
        monkeypatch=monkeypatch, capsys=capsys,
    )  # fmt: skip
    result.stdout.fnmatch_lines(["*impl=chunked_mla:ChunkedSparseMla*"])
    _assert_clean_pass(result, at_least=8)
    # The modules came from the package, not from a checkout path given on the command line.
    assert "test_lse_conventions[dsv4-sink-flashinfer-1.0] PASSED" in result.stdout.str()


@pytest.mark.full_tier
def test_installed_suites_run_against_an_entry_point_implementation(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    site = pytester.mkdir("site")
    _fake_install(site)
    monkeypatch.syspath_prepend(str(site))  # as site-packages: importlib.metadata reads sys.path
    # No conftest and no import string: the name comes from the installed entry point.
    result = inner_session.runpytest(
        pytester, "-p", "sparse_mla", "--pyargs", ACCURACY, "--sparse-mla-impl", "chunked",
        "-k", LSE_PAIR, "-p", "no:cacheprovider", monkeypatch=monkeypatch, capsys=capsys,
    )  # fmt: skip
    result.stdout.fnmatch_lines(["*impl=chunked *"])
    _assert_clean_pass(result, at_least=2)


@pytest.mark.full_tier
def test_installed_suites_run_against_a_hook_implementation(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _copy_example(pytester.path)  # its conftest.py registers chunked-odd (7-lane chunks)
    result = inner_session.runpytest(
        pytester, "--pyargs", ACCURACY, "--sparse-mla-impl", "chunked-odd", "-k", LSE_PAIR, "-p", "no:cacheprovider",
        monkeypatch=monkeypatch, capsys=capsys,
    )  # fmt: skip
    result.stdout.fnmatch_lines(["*impl=chunked-odd *"])
    _assert_clean_pass(result, at_least=2)


def test_entry_points_are_listed_lazily_and_hook_names_win(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process: the group's names are valid ``--sparse-mla-impl`` values; the hook returns the
    ``module:attribute`` strings (nothing imported), and a conftest's name beats an entry point's."""
    site = pytester.mkdir("site")
    _fake_install(site)
    monkeypatch.syspath_prepend(site)
    assert entry_points.entry_point_specs() == {"chunked": "chunked_mla:ChunkedSparseMla"}
    assert "chunked_mla" not in sys.modules
    loaded = entry_points.entry_point_implementations()
    assert type(loaded["chunked"]).__name__ == "type"  # the class itself; resolution instantiates it
    pytester.makeconftest(
        """
        import pytest
        from types import SimpleNamespace

        @pytest.hookimpl(optionalhook=True)
        def pytest_sparse_mla_implementations(config):
            return {"chunked": SimpleNamespace(name="conftest-wins", sparse_mla_forward=print)}
        """
    )
    pytester.makepyfile("def test_name(sparse_mla_impl):\n    print('IMPL', sparse_mla_impl.name)\n")
    result = pytester.runpytest("-p", "sparse_mla", "--sparse-mla-impl", "chunked", "-s")
    result.stdout.fnmatch_lines(["*IMPL conftest-wins*"])
    result = pytester.runpytest("-p", "sparse_mla", "--sparse-mla-impl", "nosuch")
    result.stderr.fnmatch_lines(
        [
            "*expected one of chunked, flaggems, flashinfer, *reference, *triton*",
            "*an entry-point name (group *: chunked",
        ]
    )


def test_broken_entry_point_warns_instead_of_breaking_every_session(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = pytester.mkdir("site")
    info = site / "broken_kernels-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-kernels\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{entry_points.ENTRY_POINT_GROUP}]\nbroken = no_such_module:impl\n")
    monkeypatch.syspath_prepend(site)
    with pytest.warns(entry_points.SparseMlaEntryPointWarning, match="broken = 'no_such_module:impl'.*broken-kernels"):
        assert entry_points.entry_point_implementations() == {}
    with pytest.raises(ImportError, match="no_such_module"):
        entry_points.entry_point_implementations(strict=True)


# --- xfail and skip files ----------------------------------------------------------------------


def test_id_files_excuse_installed_suite_ids_and_warn_on_unmatched(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against a kernel that ignores the sink, [sink-...] fails: the xfail file excuses it by its
    checkout-style id, the skip file skips the other case, a stale id is reported."""
    xfails = pytester.path / "xfails.txt"
    xfails.write_text(
        "# known failures of kernel_catalogue:drops_sink\n"
        "\n"
        "suites/test_attention_accuracy.py::test_lse_conventions[dsv4-sink-flashinfer-1.0]  # sink ignored\n"
        "suites/test_attention_accuracy.py::test_renamed_long_ago\n"
        "test_attention_accuracy.py::test_gone_too\n"
    )
    skips = pytester.path / "skips.txt"  # the id as a --pyargs run rooted in the package prints it
    skips.write_text("test_attention_accuracy.py::test_lse_conventions[dsv4-no-sink\n")
    monkeypatch.setenv("PYTHONPATH", _pythonpath(TESTS))
    # A fresh process: the warning count is the run's own (in this process, pytest would add its
    # "already imported, cannot be rewritten" warnings for the plugin).
    result = pytester.runpytest_subprocess(
        "-p", "sparse_mla", "--pyargs", ACCURACY, "--sparse-mla-impl", "kernel_catalogue:drops_sink",
        "--sparse-mla-xfail-file", str(xfails), "--sparse-mla-skip-file", str(skips),
        "-k", LSE_PAIR, "-p", "no:cacheprovider", "-rxs",
    )  # fmt: skip
    result.assert_outcomes(xfailed=1, skipped=1, warnings=2)
    result.stdout.fnmatch_lines(
        [
            "sparse-mla: xfail file: *xfails.txt (3 ids)",
            "*SparseMlaSelectionWarning: --sparse-mla-xfail-file: "
            "'suites/test_attention_accuracy.py::test_renamed_long_ago' (*xfails.txt:4) matches no collected test",
            "*SparseMlaSelectionWarning: --sparse-mla-xfail-file: 'test_attention_accuracy.py::test_gone_too' "
            "(*xfails.txt:5) matches no collected test (a shipped suite's test is listed as 'suites/<file>::<test>'*",
            "*XFAIL*test_lse_conventions[[]dsv4-sink-flashinfer-1.0[]] - listed in "
            "--sparse-mla-xfail-file (*xfails.txt:3)",
            "*SKIPPED*listed in --sparse-mla-skip-file (*skips.txt:1)",
        ]
    )


PLAIN_TESTS = """
import pytest

def test_alpha():
    assert False

def test_alpha_beta():
    pass

@pytest.mark.parametrize("x", ["a#b", "c"])
def test_param(x):
    assert x == "c"
"""


def test_id_file_syntax_prefixes_and_comments(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_ids=PLAIN_TESTS)
    xfails = pytester.path / "x.txt"
    xfails.write_text(
        "   # an indented comment\n\n"
        "test_ids.py::test_alpha\t# prefix: test_alpha_beta too\n"
        "test_ids.py::test_param[a#b]\n"  # '#' without whitespace before it is part of the id
    )
    entries = selection.read_id_file(xfails)
    assert [(e.prefix, e.lineno) for e in entries] == [
        ("test_ids.py::test_alpha", 3),
        ("test_ids.py::test_param[a#b]", 4),
    ]
    result = pytester.runpytest("-p", "sparse_mla", "--sparse-mla-xfail-file", str(xfails), "-rxX")
    # test_alpha xfails; test_alpha_beta passes although listed (non-strict here); test_param[a#b] xfails.
    result.assert_outcomes(xfailed=2, xpassed=1, passed=1)
    result.stdout.fnmatch_lines(["XPASS test_ids.py::test_alpha_beta - listed in --sparse-mla-xfail-file (*x.txt:3)"])
    result.stdout.no_fnmatch_line("*matches no collected test*")


def test_unmatched_ids_of_both_files_warn_and_options_validate(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_ids=PLAIN_TESTS)
    (pytester.path / "s.txt").write_text("test_ids.py::test_gone\ntest_ids.py::test_alpha\n")
    result = pytester.runpytest("-p", "sparse_mla", "--sparse-mla-skip-file", "s.txt", "-k", "not alpha")
    # test_alpha is deselected by -k but still counts as matched (files apply before deselection).
    result.assert_outcomes(passed=1, failed=1, deselected=2)
    assert result.stdout.str().count("matches no collected test") == 1
    result.stdout.fnmatch_lines(
        ["*--sparse-mla-skip-file: 'test_ids.py::test_gone' (*s.txt:1) matches no collected test"]
    )
    result = pytester.runpytest("-p", "sparse_mla", "--sparse-mla-xfail-file", "missing.txt")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--sparse-mla-xfail-file='missing.txt': no such file*"])


# --- public helpers and fixture documentation --------------------------------------------------


def test_public_helpers_read_the_session(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        from pytest_sparse_mla import api

        def pytest_report_header(config):
            return [f"api: active={api.is_active(config)} impl={api.implementation_name(config)} "
                    f"grid={api.grid_release(config)} enforcing={api.is_enforcing_grid(config)} "
                    f"golden={api.golden_dir(config)}"]
        """
    )
    pytester.makepyfile("def test_ok():\n    pass\n")
    (pytester.path / "gold").mkdir()
    result = pytester.runpytest(
        "-p", "sparse_mla", "--sparse-mla-grid", "flashinfer==0.6.17", "--sparse-mla-golden-dir", "gold"
    )
    result.stdout.fnmatch_lines(
        [f"api: active=True impl=reference grid=0.6.17 enforcing=True golden={pytester.path / 'gold'}"]
    )
    assert (api.suites_dir() / "test_attention_accuracy.py").is_file()


def test_fixtures_listing_documents_every_plugin_fixture(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("-p", "sparse_mla", "--fixtures", "-v")
    text = result.stdout.str()
    sections = text.split("fixtures defined from ")
    ours = [s for s in sections if s.startswith("pytest_sparse_mla")]
    assert ours, text
    body = "".join(ours)
    for name in (
        "sparse_mla_options", "sparse_mla_capabilities", "sparse_mla_device", "sparse_mla_seed",
        "sparse_mla_generator", "packed_kv_cache_factory", "split_buffer_registry", "page_split_backend",
        "split_pages", "sparse_mla_impl", "sparse_mla_tolerances", "tensor_snapshot",
    ):  # fmt: skip
        assert f"\n{name} " in body, f"{name} missing from pytest --fixtures"
    assert "no docstring available" not in body


# --- the wheel ---------------------------------------------------------------------------------


@pytest.mark.full_tier
def test_wheel_ships_suites_and_goldens_and_runs_them(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Build the wheel (pip, isolated build), install it with --target, run suites from it."""
    src = tmp_path / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("pytest_sparse_mla", "suites", "golden"):
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):
        shutil.copy(ROOT / name, src / name)
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    build = subprocess.run([*pip, "wheel", "--no-deps", "-w", str(wheels), str(src)], capture_output=True)
    if build.returncode != 0 and importlib.util.find_spec("setuptools") is not None:
        # An offline machine cannot fetch the isolated build's setuptools: build with the installed one.
        build = subprocess.run(
            [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)], capture_output=True
        )
    assert build.returncode == 0, build.stderr.decode()[-2000:]
    (wheel,) = wheels.glob("pytest_sparse_mla-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    suites = sorted(p.name for p in (ROOT / "suites").glob("*.py"))
    goldens = sorted(p.relative_to(ROOT / "golden").as_posix() for p in (ROOT / "golden").rglob("*.tensor.json"))
    assert suites and goldens
    assert {f"pytest_sparse_mla/suites/{n}" for n in suites} <= names
    assert {f"pytest_sparse_mla/golden/{g}" for g in goldens} <= names
    assert "pytest_sparse_mla/py.typed" in names  # PEP 561: downstream type checkers read the annotations
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not any("__pycache__" in n or n.startswith(("suites/", "golden/", "tests/")) for n in names)

    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, capture_output=True)
    monkeypatch.setenv("PYTHONPATH", _pythonpath(site))
    result = pytester.runpytest_subprocess(
        "-p", "sparse_mla", "--pyargs", "pytest_sparse_mla.suites.test_golden",
        "-k", "packed_cache_golden or page_split_golden", "-p", "no:cacheprovider",
    )  # fmt: skip
    # A golden that is missing fails under syrupy, so passing means they were read from the wheel.
    result.stdout.fnmatch_lines([f"sparse-mla: goldens: {site / 'pytest_sparse_mla' / 'golden'}"])
    _assert_clean_pass(result, at_least=4)


# --- the README's example commands and counts --------------------------------------------------


def _readme() -> str:
    return (ROOT / "README.md").read_text()


@pytest.mark.full_tier
@inner_session.WHOLE_SUITE_RUN
def test_the_readme_example_run_of_every_suite_against_chunked_passes(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's fifth example command, taken from the README itself (every shipped suite against
    the installed entry point ``chunked``, from a directory outside the checkout), passes: no
    failure, no error, no XPASS, and as many passed tests as the README states. It runs in this
    process (``tests/inner_session.py``) without the command's ``-n 2``: how xdist distributes the
    suites, pins workers and carries reports is tested in ``test_xdist_gpu.py``, ``test_snapshots.py``
    and ``test_exit_codes.py``."""
    import re
    import shlex

    (line,) = [ln for ln in _readme().splitlines() if "--sparse-mla-impl chunked -n 2" in ln]
    args = shlex.split(line.split("/bin/pytest", 1)[1])
    assert args[:3] == ["-p", "sparse_mla", "--pyargs"] and args[-2:] == ["-n", "2"], line
    site = pytester.mkdir("site")
    _fake_install(site)
    monkeypatch.syspath_prepend(str(site))  # as site-packages: importlib.metadata reads sys.path
    result = inner_session.runpytest(
        pytester, *args[:-2], "-p", "no:cacheprovider", monkeypatch=monkeypatch, capsys=capsys
    )
    result.stdout.fnmatch_lines(["*impl=chunked *"])
    passed = _assert_clean_pass(result, at_least=200)["passed"]
    stated = re.search(r"runs every shipped suite against `chunked` \(on a CPU: (\d+) passed", _readme())
    assert stated is not None and int(stated.group(1)) == passed, (stated and stated.group(1), passed)


def test_the_counts_the_readme_states_are_the_counts() -> None:
    """The README's numbers of wrong kernels in the gate and in the adversary's set are the catalogues'."""
    import re

    import adversary_kernels
    import kernel_catalogue

    readme = _readme()
    gate = re.search(r"`tests/kernel_catalogue.py`: (\d+) wrong kernels", readme)
    assert gate is not None and int(gate.group(1)) == len(kernel_catalogue.wrong_kernels())
    stated = {int(n) for n in re.findall(r"(\d+) wrong kernels and which of them", readme)}
    stated |= {int(n) for n in re.findall(r"a blind adversary's (\d+) wrong kernels", readme)}
    assert stated == {len(adversary_kernels.ADVERSARY)}, stated
