"""The checkout's two test tiers (README, "Set up and go") select every test exactly once.

The fast tier is the README's test command (``<!-- test-command -->``), the full tier its
full-test command (``<!-- full-test-command -->``); ``.ci/run`` runs both. Each command's pytest
arguments are read from the README and collected (``--collect-only``, in this process:
``tests/inner_session.py``), and so is the same command without its ``-m`` selection: the two
selections must be disjoint and their union must be that whole collection, so no test leaves CI
when a marker or a command changes. The tier of a test is its ``full_tier`` marker
(``tests/conftest.py``); the whole-suite self-tests (marked ``sparse_mla_selftest_long``) and the
suites' own tests are checked to land where CONTRIBUTING.md says.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import inner_session
import pytest

ROOT = Path(__file__).resolve().parents[1]
FULL, LONG = "full_tier", "sparse_mla_selftest_long"


def readme_pytest_args(marker: str) -> list[str]:
    """The arguments after ``.venv/bin/pytest`` in the README's code block after ``<!-- marker -->``
    (the last command of an ``&&`` chain), without ``-n N``: the collection runs in one process."""
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index(f"<!-- {marker} -->") :].split("```")[1].removeprefix("bash").strip()
    command = block.split("&&")[-1]
    words = shlex.split(command)
    assert words[0] == ".venv/bin/pytest", command
    args = words[1:]
    if "-n" in args:
        i = args.index("-n")
        del args[i : i + 2]
    return args


def _without_selection(args: list[str]) -> list[str]:
    """``args`` without its ``-m EXPR``."""
    i = args.index("-m")
    return args[:i] + args[i + 2 :]


def _collect(args: list[str], tmp_path: Path, monkeypatch, capsys) -> dict[str, tuple[bool, bool]]:
    """``{node id: (marked full_tier, marked sparse_mla_selftest_long)}`` of what ``pytest args
    --collect-only`` selects from the checkout's root."""
    selected: dict[str, tuple[bool, bool]] = {}

    class Listing:
        def pytest_collection_finish(self, session: pytest.Session) -> None:
            for item in session.items:
                full, long = (item.get_closest_marker(name) is not None for name in (FULL, LONG))
                selected[item.nodeid] = (full, long)

    command = [*args, "--collect-only", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
               "--basetemp", str(tmp_path / f"base{len(list(tmp_path.iterdir()))}")]  # fmt: skip
    ret, output = inner_session.run(command, cwd=ROOT, monkeypatch=monkeypatch, capsys=capsys, plugins=[Listing()])
    assert ret == 0, output[-3000:]
    return selected


def test_the_fast_and_the_full_tier_select_every_test_exactly_once(tmp_path, monkeypatch, capsys):
    fast_args, full_args = readme_pytest_args("test-command"), readme_pytest_args("full-test-command")
    assert _without_selection(fast_args) == _without_selection(full_args), (fast_args, full_args)
    every = _collect(_without_selection(fast_args), tmp_path, monkeypatch, capsys)
    fast = _collect(fast_args, tmp_path, monkeypatch, capsys)
    full = _collect(full_args, tmp_path, monkeypatch, capsys)
    assert fast and full
    assert not set(fast) & set(full), sorted(set(fast) & set(full))[:20]
    assert set(fast) | set(full) == set(every), sorted(set(every) - set(fast) - set(full))[:20]
    assert all(marked for marked, _ in full.values()) and not any(marked for marked, _ in fast.values())
    assert any(node.startswith("suites/") for node in every)
    suites_in_full = [node for node in full if node.startswith("suites/")]
    assert suites_in_full == [], suites_in_full[:20]  # the suites on the reference are the fast tier's
    # A whole-suite self-test (10 to 60 s each on 2 cores) would break the fast tier's time.
    long_in_fast = [node for node, (_, long) in fast.items() if long]
    assert long_in_fast == [], f"whole-suite self-tests without the full_tier marker: {long_in_fast}"


def test_the_tox_lanes_select_the_tiers_as_the_readme_does() -> None:
    """``tox -e cpu`` runs the fast tier and ``tox -e cpu-full`` the full one, with the README's
    ``-m`` expressions and the same peer wheels as its test command (a new CPU lane's wheel goes
    into both: CONTRIBUTING.md, "Add a peer")."""
    import configparser

    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    readme = (ROOT / "README.md").read_text()
    fast_setup = readme[readme.index("<!-- test-command -->") :].split("```")[1]
    for lane, marker in (("testenv:cpu", "test-command"), ("testenv:cpu-full", "full-test-command")):
        args = readme_pytest_args(marker)
        expression = args[args.index("-m") + 1]
        command = shlex.split(tox[lane]["commands"])
        assert command[command.index("-m") + 1] == expression, (lane, command)
    tox_wheels = tox["cpu"]["commands_pre"].split("--no-deps", 1)[1].split()
    readme_wheels = fast_setup.split("pip install --no-deps", 1)[1].split("&&", 1)[0].split()
    assert tox_wheels and sorted(tox_wheels) == sorted(readme_wheels), (tox_wheels, readme_wheels)
