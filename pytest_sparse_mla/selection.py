"""Expected-failure and skip files: ``--sparse-mla-xfail-file`` and ``--sparse-mla-skip-file``.

A kernel library that runs the suites against its own implementation lists the tests it knows it
fails (or cannot run) in plain text files, one test id per line, the way array-api-tests does with
``--xfails-file`` / ``--skips-file`` (data-apis/array-api-tests ``conftest.py``)::

    # known failures of mykernel 0.3 (a '#' line is a comment; blank lines are ignored)
    suites/test_attention.py::test_sink_changes_the_output     # whole test, every parameter
    suites/test_attention.py::test_matches_oracle[prefill-     # one parameter prefix
    suites/test_page_split.py                                  # a whole module

Matching. An entry selects every collected test whose id *starts with* it (a prefix, as in
array-api-tests): ``...::test_split`` also selects ``...::test_split_twice``; end an entry with
``[`` or give the full id to be exact. Each test is compared under two ids: its pytest node id
(relative to the rootdir) and, for the shipped suites, the checkout-style id ``suites/<file>::<name>``,
so one file serves both a checkout (``pytest suites``) and the installed package
(``pytest --pyargs pytest_sparse_mla.suites``, whose node ids depend on where site-packages is).
Text after ``" #"`` (whitespace, then ``#``) on a line is a comment; a ``#`` with no whitespace
before it stays part of the id.

Marks. A listed test gets ``pytest.mark.xfail(reason=...)`` (strictness follows the ini option
``xfail_strict``, so a test that starts passing is reported) or ``pytest.mark.skip(reason=...)``;
the reason names the file and line. Both files are applied before ``-k`` / ``-m`` deselection, so an
id deselected on the command line still counts as matched.

Unmatched entries. An entry that matches no collected test is most likely a typo or a renamed
test: it is reported once per session with :class:`SparseMlaSelectionWarning` (a
``pytest.PytestWarning``, shown in the warnings summary; ``-W error::pytest.PytestWarning`` turns it
into an error). Under pytest-xdist each worker collects, so each worker warns.

Capability markers. :func:`skip_unmet` turns the ``sparse_mla_requires_*`` markers this machine
does not meet (``pytest_sparse_mla.capabilities.unmet_markers``, which is pytest-free) into skips,
or into setup failures under ``--sparse-mla-require-gpu``.

The hooks module (``pytest_sparse_mla.plugin``) calls :func:`skip_unmet`, :func:`apply_files` and
:func:`header_lines`; this module imports neither torch nor triton.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from pytest_sparse_mla import options
from pytest_sparse_mla.regions import read_regions

__all__ = [
    "SelectionEntry",
    "SparseMlaSelectionWarning",
    "candidate_ids",
    "shipped_suite_items",
    "read_id_file",
    "apply_selection",
    "apply_files",
    "header_lines",
    "skip_unmet",
    "SUITES_ID_PREFIX",
    "REPORT_ID_ATTR",
    "report_id",
]

#: Prefix of the checkout-style ids of the shipped suites (``suites/test_formats.py::...``).
SUITES_ID_PREFIX = "suites/"


class SparseMlaSelectionWarning(pytest.PytestWarning):
    """An entry of ``--sparse-mla-xfail-file`` / ``--sparse-mla-skip-file`` matched no test."""


@dataclass(frozen=True)
class SelectionEntry:
    """One test-id prefix read from an xfail or skip file.

    Attributes:
        prefix: the id prefix (stripped, comment removed), e.g. ``"suites/test_formats.py::test_x"``.
        path: the file it was read from.
        lineno: its 1-based line number in that file.
    """

    prefix: str
    path: Path
    lineno: int

    @property
    def where(self) -> str:
        """``"<file>:<line>"``, for reasons and warnings."""
        return f"{self.path}:{self.lineno}"


def read_id_file(path: str | Path) -> list[SelectionEntry]:
    """Read a file of test-id prefixes, one per line.

    Blank lines and lines whose first non-blank character is ``#`` are ignored; text after
    whitespace followed by ``#`` is a trailing comment. Duplicate entries are kept (each is
    reported if unmatched, so a copy-paste slip shows).

    Args:
        path: a UTF-8 text file.

    Returns:
        The entries in file order.

    Raises:
        FileNotFoundError: no such file.
        UnicodeDecodeError: the file is not UTF-8 text.
    """
    path = Path(path)
    entries: list[SelectionEntry] = []
    for lineno, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        for sep in (" #", "\t#"):
            cut = line.find(sep)
            if cut != -1:
                line = line[:cut].rstrip()
        if line:
            entries.append(SelectionEntry(prefix=line, path=path, lineno=lineno))
    return entries


def _suites_dirs() -> tuple[Path, ...]:
    """Directories holding the shipped suites: the package ``pytest_sparse_mla.suites`` wherever it
    is installed (a wheel's ``pytest_sparse_mla/suites``, a checkout's ``suites/`` under an editable
    install) and, from a checkout, its top-level ``suites/``."""
    from pytest_sparse_mla import api

    dirs = [api.package_dir(api.SUITES_PACKAGE), Path(__file__).resolve().parent.parent / "suites"]
    return tuple(dict.fromkeys(d for d in dirs if d is not None and (d / "__init__.py").is_file()))


def names_shipped_suites(config: pytest.Config) -> bool:
    """Whether a command-line argument names the shipped suites, a path inside them (a file, a test
    id; ``--pyargs pytest_sparse_mla.suites...``) or a directory holding them that pytest will
    recurse into (not ``--ignore``-d), read before collection."""
    dirs = _suites_dirs()
    pyargs = bool(getattr(config.option, "pyargs", False))
    base = Path(config.invocation_params.dir)
    ignored = [(base / p).resolve() for p in (config.getoption("ignore", None) or [])]
    reachable = [d for d in dirs if not any(d == i or d.is_relative_to(i) for i in ignored)]
    for arg in config.args:
        target = str(arg).split("::", 1)[0]
        if pyargs and (target == "pytest_sparse_mla.suites" or target.startswith("pytest_sparse_mla.suites.")):
            return True
        path = (base / target).resolve()
        if not path.exists():
            continue
        if any(path == d or path.is_relative_to(d) for d in dirs):
            return True
        if path.is_dir() and "::" not in str(arg) and any(d.is_relative_to(path) for d in reachable):
            return True
    return False


def shipped_suite_items(items: list[pytest.Item]) -> list[pytest.Item]:
    """The items collected from the shipped suites (``pytest_sparse_mla.suites``, wherever installed)."""
    dirs = _suites_dirs()
    shipped: dict[Path, bool] = {}  # per file: the items of one module share it
    for item in items:
        if item.path not in shipped:
            path = Path(item.path).resolve()
            shipped[item.path] = any(path.is_relative_to(d) for d in dirs)
    return [item for item in items if shipped[item.path]]


def candidate_ids(item: pytest.Item) -> list[str]:
    """The ids an entry may match for ``item``: its node id and, when the item comes from the
    shipped suites (wherever installed), ``suites/<path in the suites package>::<rest>`` and the
    same without ``suites/`` (the node id a ``--pyargs pytest_sparse_mla.suites`` run prints when
    its rootdir is the suites package)."""
    ids = [item.nodeid]
    path = Path(item.path).resolve()
    for suites in _suites_dirs():
        try:
            rel = path.relative_to(suites)
        except ValueError:
            continue
        _, sep, rest = item.nodeid.partition("::")
        in_package = rel.as_posix() + (f"::{rest}" if sep else "")
        for candidate in (f"{SUITES_ID_PREFIX}{in_package}", in_package):
            if candidate not in ids:
                ids.append(candidate)
        break
    return ids


#: Attribute of a test report holding :func:`report_id` (set when a report or a draft is written;
#: pytest-xdist carries a report's attributes to the controller, JUnit XML does not write them).
REPORT_ID_ATTR = "sparse_mla_report_id"


def report_id(item: pytest.Item) -> str:
    """The id the reports list for ``item`` (``--sparse-mla-report-json`` / ``-md``,
    ``--sparse-mla-xfail-draft``): the ``suites/...`` id of a shipped-suite test (it matches in a
    checkout and in an installed package), else its node id."""
    shipped = [i for i in candidate_ids(item) if i.startswith(SUITES_ID_PREFIX)]
    return shipped[0] if shipped else item.nodeid


def apply_selection(
    items: list[pytest.Item],
    *,
    xfail: Sequence[SelectionEntry] = (),
    skip: Sequence[SelectionEntry] = (),
    regions: bool = False,
) -> list[SelectionEntry]:
    """Mark the items listed in ``xfail`` / ``skip``; return the entries that matched nothing.

    The first matching entry of each list gives the reason (file and line). Items are marked in
    place (``item.add_marker``). With ``regions`` (the xfail file declares known regions,
    ``pytest_sparse_mla.regions``), a listed search test (one using the ``sparse_mla_search``
    fixture) expects only :class:`~pytest_sparse_mla.errors.KnownDiscrepancy`: a discrepancy
    outside every known region fails it.
    """
    from pytest_sparse_mla.errors import KnownDiscrepancy

    matched: set[int] = set()
    groups = (("xfail", list(xfail)), ("skip", list(skip)))
    for item in items:
        ids = candidate_ids(item)
        for kind, entries in groups:
            for entry in entries:
                if any(test_id.startswith(entry.prefix) for test_id in ids):
                    matched.add(id(entry))
                    reason = f"listed in --sparse-mla-{kind}-file ({entry.where})"
                    if kind == "xfail" and regions and "sparse_mla_search" in getattr(item, "fixturenames", ()):
                        item.add_marker(pytest.mark.xfail(reason=reason, raises=KnownDiscrepancy))
                    elif kind == "xfail":
                        item.add_marker(pytest.mark.xfail(reason=reason))
                    else:
                        item.add_marker(pytest.mark.skip(reason=reason))
                    break
    return [entry for _, entries in groups for entry in entries if id(entry) not in matched]


def apply_files(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Apply the session's xfail and skip files (called from ``pytest_collection_modifyitems``,
    before ``-k``/``-m`` deselect); warn with :class:`SparseMlaSelectionWarning` on unmatched ids."""
    opts = options.get_options(config)
    if opts.xfail_file is None and opts.skip_file is None:
        return
    xfail = read_id_file(opts.xfail_file) if opts.xfail_file is not None else []
    skip = read_id_file(opts.skip_file) if opts.skip_file is not None else []
    with options.usage_errors():  # a malformed region line
        regions = bool(opts.xfail_file is not None and read_regions(opts.xfail_file))
    unmatched = apply_selection(items, xfail=xfail, skip=skip, regions=regions)
    shipped = bool(unmatched) and bool(shipped_suite_items(items))
    for entry in unmatched:
        kind = "xfail" if any(entry is e for e in xfail) else "skip"
        hint = "" if not shipped or entry.prefix.startswith(SUITES_ID_PREFIX) else (
            f" (a shipped suite's test is listed as '{SUITES_ID_PREFIX}<file>::<test>', e.g. "
            f"'{SUITES_ID_PREFIX}test_formats.py::test_padded_stride_of_an_odd_page_size', wherever the suites "
            "are installed)"
        )  # fmt: skip
        warnings.warn(
            SparseMlaSelectionWarning(
                f"--sparse-mla-{kind}-file: {entry.prefix!r} ({entry.where}) matches no collected test{hint}"
            ),
            stacklevel=1,
        )


def header_lines(config: pytest.Config) -> list[str]:
    """Report-header lines naming the xfail and skip files in use, so a CI log shows what was
    excused."""
    opts = options.get_options(config)
    lines: list[str] = []
    for kind, path in (("xfail", opts.xfail_file), ("skip", opts.skip_file)):
        if path is not None:
            lines.append(f"sparse-mla: {kind} file: {path} ({len(read_id_file(path))} ids)")
    return lines


def skip_unmet(items: list[pytest.Item], gpu_required_marker: str | None = None) -> None:
    """Mark each item whose capability markers this machine does not meet: ``skip`` with the
    reason (``"<marker>: requires ...; found ..."``), or, for a GPU marker when
    ``gpu_required_marker`` is given (``--sparse-mla-require-gpu``), that marker with the reason
    (the test then fails at setup). Probes the machine only when an item carries a marker.

    Raises:
        pytest.UsageError: a marker's spec is malformed (naming the test).
    """
    from pytest_sparse_mla import capabilities

    with options.usage_errors():
        unmet = capabilities.unmet_markers(items)
    for item, name, reason in unmet:
        if gpu_required_marker is not None and capabilities.is_gpu_marker(name):
            item.add_marker(getattr(pytest.mark, gpu_required_marker)(reason=reason))
        else:
            item.add_marker(pytest.mark.skip(reason=f"{name}: {reason}"))
