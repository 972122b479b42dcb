"""The deployment report, release validation, ``--help``, skip reasons and CI entry point as a user
meets them."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_sparse_mla import options
from pytest_sparse_mla.dispatch import UnsupportedReleaseError, check_known_release, report

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "downstream"


# --- --sparse-mla-deployment-report ------------------------------------------------------------


def test_deployment_report_json_is_printed_alone_and_exits_0_in_an_empty_folder(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("-p", "sparse_mla", "--sparse-mla-deployment-report", "json")
    assert result.ret == pytest.ExitCode.OK
    document = json.loads(result.stdout.str())  # nothing but the JSON document on stdout
    assert [r["release"] for r in document["releases"]] == list(report.DEFAULT_RELEASES)
    assert document["summary"]["0.6.17"] == {"served": 45, "total": 64}


def test_deployment_report_text_runs_no_tests_and_adds_the_grid_release(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_must_not_run():\n    raise AssertionError\n")
    result = pytester.runpytest_subprocess(
        "-p", "sparse_mla", "--sparse-mla-deployment-report=text", "--sparse-mla-grid=flashinfer==0.6.16"
    )
    assert result.ret == pytest.ExitCode.OK
    out = result.stdout.str()
    assert "0.6.16 [0.6.14-0.6.17]: serves 45 of 64 deployment calls" in out
    assert "test session starts" not in out and "must_not_run" not in out


def test_deployment_report_refuses_a_bad_grid_release(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess(
        "-p", "sparse_mla", "--sparse-mla-deployment-report=text", "--sparse-mla-grid=flashinfer==9.9"
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--sparse-mla-grid='flashinfer==9.9': *newer than the last release*0.7.4*"])


# --- releases that do not exist are refused ------------------------------------------------------


@pytest.mark.parametrize("release", ["9.9", "0.8.0", "0.7.5"])
def test_a_release_newer_than_the_last_examined_one_is_refused(
    release: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert report.main(["--release", release]) == 2
    err = capsys.readouterr().err
    assert f"release='{release}'" in err
    assert "newer than the last release the bundled grids were read from (0.7.4)" in err
    with pytest.raises(UnsupportedReleaseError, match="expected a release from 0.6.14 to 0.7.4"):
        check_known_release(release)
    with pytest.raises(pytest.UsageError, match=re.escape(f"--sparse-mla-grid='flashinfer=={release}'")):
        options.parse_grid(f"flashinfer=={release}")


@pytest.mark.parametrize("release", ["0.6.14", "0.6.15.post1", "0.7.2.post1", "0.7.4", "flashinfer==0.7.4"])
def test_known_releases_are_accepted(release: str) -> None:
    assert check_known_release(release) is not None


def test_console_script_refuses_9_9() -> None:
    script = Path(sys.executable).with_name("sparse-mla-deployments")
    if not script.exists():
        pytest.skip(f"{script} is not installed (pip install -e . installs it)")
    result = subprocess.run([str(script), "--release", "9.9"], capture_output=True, text=True)
    assert result.returncode == 2 and result.stdout == ""
    assert "flashinfer-python 9.9 is newer than the last release" in result.stderr


# --- --help agrees with the README -----------------------------------------------------------------


def test_help_group_title_is_the_one_the_readme_names() -> None:
    readme = (ROOT / "README.md").read_text()
    assert f'(`pytest --help`, section "{options.HELP_GROUP_TITLE}")' in readme
    help_text = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "sparse_mla", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert f"\n{options.HELP_GROUP_TITLE}:\n" in help_text


# --- skip reasons are shown in a downstream run ----------------------------------------------------


def test_a_downstream_run_shows_why_suites_skipped(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The example kernel has no ``pack``: a run of the shipped suites against it, with no ``-r``
    option, still says why the pack suites skipped (runs in this process: ``tests/inner_session.py``)."""
    import inner_session

    for item in ("chunked_mla", "conftest.py", "pyproject.toml"):
        source = EXAMPLE / item
        if source.is_dir():
            shutil.copytree(source, pytester.path / item, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, pytester.path / item)
    result = inner_session.runpytest(
        pytester, "--pyargs", "pytest_sparse_mla.suites.test_formats", "-k", "known_vector", "-p", "no:cacheprovider",
        monkeypatch=monkeypatch, capsys=capsys,
    )  # fmt: skip
    result.stdout.fnmatch_lines(["SKIPPED *implementation 'chunked' does not provide 'pack'*"])
    # A user's own -r choice is kept (-rN: no short summary).
    quiet = inner_session.runpytest(
        pytester, "--pyargs", "pytest_sparse_mla.suites.test_formats", "-k", "known_vector", "-p", "no:cacheprovider",
        "-rN", monkeypatch=monkeypatch, capsys=capsys,
    )  # fmt: skip
    assert "does not provide 'pack'" not in quiet.stdout.str()


def test_pytester_hints_name_the_setting_that_enables_it() -> None:
    """A test that skips without ``pytester`` must say how this project enables it: the root
    ``conftest.py`` (``pytest_plugins = ["pytester"]``), or ``-p pytester``; ``addopts`` does not."""
    conftest = (ROOT / "conftest.py").read_text()
    assert 'pytest_plugins = ["pytester"]' in conftest
    hints = [
        f"{path.relative_to(ROOT)}: {line.strip()}"
        for folder in ("tests", "suites")
        for path in sorted((ROOT / folder).glob("*.py"))
        for line in path.read_text().splitlines()
        if line.strip().startswith("pytest.skip(") and "pytester" in line
    ]
    wrong = [hint for hint in hints if "addopts" in hint or not ("conftest.py" in hint or "-p pytester" in hint)]
    assert wrong == []


# --- .ci/run --------------------------------------------------------------------------------------


def _readme(fast: str, full: str | None) -> str:
    """A README with the fast tier's command and, unless ``None``, the full tier's after it."""
    text = f"# x\n\n<!-- test-command -->\n```bash\n{fast}\n```\n"
    return text if full is None else text + f"\nThen:\n\n<!-- full-test-command -->\n```bash\n{full}\n```\n"


def _ci_repo(tmp_path: Path, command: str, full: str | None = "true") -> Path:
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", repo / ".ci" / "run")
    (repo / "README.md").write_text(_readme(command, full))
    (repo / ".gitignore").write_text(".venv/\n")
    (repo / "tracked.txt").write_text("tracked\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    (repo / "untracked.txt").write_text("new\n")
    (repo / ".venv" / "bin").mkdir(parents=True)
    (repo / ".venv" / "stale").write_text("an old environment\n")
    return repo


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_ci_run_never_reuses_an_existing_venv(tmp_path: Path) -> None:
    """The README command starts with ``python3 -m venv .venv``, which keeps an existing ``.venv``
    and its packages; ``.ci/run`` runs it in a fresh copy of the checkout instead."""
    command = "test ! -e .venv && test -f tracked.txt && test -f untracked.txt && pwd > \"$CI_PROBE\""
    repo = _ci_repo(tmp_path, command)
    probe = tmp_path / "probe"
    env = {**os.environ, "CI_PROBE": str(probe)}
    result = subprocess.run([str(repo / ".ci" / "run")], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    ran_in = Path(probe.read_text().strip())
    assert ran_in != repo and not ran_in.exists()  # a temporary copy, removed afterwards
    assert (repo / ".venv" / "stale").read_text() == "an old environment\n"  # the user's .venv untouched


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_ci_run_fails_on_exit_5(tmp_path: Path) -> None:
    repo = _ci_repo(tmp_path, "exit 5")
    result = subprocess.run([str(repo / ".ci" / "run")], capture_output=True, text=True)
    assert result.returncode == 5 and "collected no tests in the fast tier (exit 5)" in result.stderr
    repo = _ci_repo(tmp_path / "full", "true", full="exit 5")
    result = subprocess.run([str(repo / ".ci" / "run")], capture_output=True, text=True)
    assert result.returncode == 5 and "collected no tests in the full tier (exit 5)" in result.stderr


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_ci_run_runs_both_tiers_in_one_copy_and_fails_when_either_fails(tmp_path: Path) -> None:
    """The full tier runs after the fast one in the same fresh copy (it uses the ``.venv`` the
    first command made), even when the fast tier failed; the status is the first non-zero one."""
    log = tmp_path / "log"
    fast = 'mkdir .venv && echo "fast $PWD" >> "$CI_LOG"'
    full = 'test -d .venv && echo "full $PWD" >> "$CI_LOG"'
    env = {**os.environ, "CI_LOG": str(log)}
    result = subprocess.run([str(_ci_repo(tmp_path, fast, full) / ".ci" / "run")], capture_output=True, text=True,
                            env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr
    (fast_line, full_line) = log.read_text().splitlines()
    assert fast_line.startswith("fast ") and full_line == "full " + fast_line.removeprefix("fast ")
    for fast_status, full_status, expected in ((3, 0, 3), (0, 7, 7), (3, 7, 3)):
        log.unlink()
        repo = _ci_repo(tmp_path / f"{fast_status}-{full_status}", f'echo fast >> "$CI_LOG"; exit {fast_status}',
                        f'echo full >> "$CI_LOG"; exit {full_status}')  # fmt: skip
        result = subprocess.run([str(repo / ".ci" / "run")], capture_output=True, text=True, env=env)
        assert result.returncode == expected and log.read_text().split() == ["fast", "full"], result.stderr


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_ci_run_refuses_a_readme_without_the_full_tier(tmp_path: Path) -> None:
    repo = _ci_repo(tmp_path, "true", full=None)
    result = subprocess.run([str(repo / ".ci" / "run")], capture_output=True, text=True)
    assert result.returncode == 2 and "no test command found after <!-- full-test-command -->" in result.stderr


def test_the_readme_gives_both_tiers_and_their_time_on_2_cores() -> None:
    """The README's two commands are what ``.ci/run`` reads, and each says how long it takes."""
    readme = (ROOT / "README.md").read_text()
    for marker in ("<!-- test-command -->", "<!-- full-test-command -->"):
        assert readme.count(marker) == 1, marker
        before = readme[: readme.index(marker)].rstrip().rsplit("\n\n", 1)[-1]  # the paragraph that introduces it
        assert re.search(r"about \d+ minutes?\s+of\s+pytest\s+on\s+2\s+cores", before), (marker, before)


def test_ci_run_outside_git_copies_all_but_the_venv(tmp_path: Path) -> None:
    """From an unpacked sdist (no .git): the copy still leaves .venv behind."""
    repo = tmp_path / "unpacked"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", repo / ".ci" / "run")
    (repo / "README.md").write_text(_readme("test ! -e .venv && test -f kept.txt", "test -f kept.txt"))
    (repo / "kept.txt").write_text("x\n")
    (repo / ".venv").mkdir()
    result = subprocess.run([str(repo / ".ci" / "run")], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
