"""Citations resolve for every reader: the package, suites, tests, examples, benchmarks and docs cite
public sources (repository + path, PR or issue number with its repository, paper), never notes that
do not ship with the project or the project's own tracker numbers."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("pytest_sparse_mla", "suites", "tests", "benchmarks", "examples", "docs", "scripts")
FILES = ("README.md", "tox.ini", "pyproject.toml", "conftest.py")
SUFFIXES = {".py", ".md", ".ini", ".toml", ".sh", ".txt"}

#: Files outside this repository (the team's research notes) and bare tracker numbers ("issue 4";
#: a public one reads "sgl-project/sglang #33134" or "issue #34025").
UNRESOLVABLE = re.compile(
    r"shared/reference|\.\./shared|"
    r"\b(?:dispatch-grid|dsv4-format-and-math|page-split-and-history|pytest-plugin-anchors|DESIGN)\.md\b|"
    r"\breference notes\b|"
    r"\b[Ii]ssues? \d+\b"
)


def _sources() -> list[Path]:
    paths = [ROOT / name for name in FILES]
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*"):
            rel = path.relative_to(ROOT).parts
            if path.is_symlink() or any(p.is_symlink() for p in path.parents if ROOT in p.parents):
                continue  # the package's links to suites/ and golden/ are scanned once, at the target
            if "__pycache__" in rel or path.suffix not in SUFFIXES or not path.is_file():
                continue
            paths.append(path)
    return [p for p in paths if p.is_file() and p != Path(__file__).resolve()]


def test_the_pattern_catches_what_it_must_and_spares_public_references() -> None:
    for bad in ("see shared/reference/dispatch-grid.md", "(issue 4)", "Issue 14: packaging", "reference notes 1.7"):
        assert UNRESOLVABLE.search(bad), bad
    for good in ("sgl-project/sglang #33134", "SGLang issue #34025 / PR #34027", "flashinfer-ai/flashinfer PR #4380"):
        assert not UNRESOLVABLE.search(good), good


def test_no_citation_points_outside_the_repository() -> None:
    sources = _sources()
    assert len(sources) > 50
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}"
        for path in sources
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1)
        if UNRESOLVABLE.search(line)
    ]
    assert hits == [], "citations that do not resolve outside this team:\n" + "\n".join(hits)
