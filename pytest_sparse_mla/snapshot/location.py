"""Where tensor goldens live: the golden root, and the file of each snapshot under it.

Files live at ``<golden root>/<suite>/<test module>/<test name>[<name>].tensor.json``: the root is
``--sparse-mla-golden-dir`` / ini ``sparse_mla_golden_dir`` (parsed by ``pytest_sparse_mla.options``;
a session's root is ``pytest_sparse_mla.snapshot.session.golden_root``) or
:func:`default_golden_dir`; the suite is the name of the directory holding the test module. The
extra ``<suite>`` level keeps two test modules of the same name in different suites from claiming
each other's files.

The rules are here, in one place, as pure functions of paths; this module imports neither pytest,
syrupy nor torch.
"""

from __future__ import annotations

import unicodedata
from pathlib import Path

from pytest_sparse_mla.shipped import GOLDEN_PACKAGE, package_dir
from pytest_sparse_mla.snapshot.file_format import FILE_EXTENSION

__all__ = [
    "default_golden_dir",
    "golden_file",
    "pop_session_root",
    "push_session_root",
    "resolve_root",
    "session_roots",
    "suite_name",
]


def default_golden_dir() -> Path:
    """The golden root used when neither ``--sparse-mla-golden-dir`` nor the ini key is given.

    The package data ``pytest_sparse_mla/golden`` wherever the import system finds it (a wheel's
    copy; the checkout's top-level ``golden/`` under an editable install, which the build maps
    there); from a bare checkout (the package directory's parent holds ``pyproject.toml``), its
    ``golden/``.
    """
    package = Path(__file__).resolve().parent.parent
    checkout = package.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / "golden").is_dir():
        return checkout / "golden"
    found = package_dir(GOLDEN_PACKAGE)
    return found if found is not None else package / "golden"


def resolve_root(chosen: str | Path | None) -> Path:
    """The golden root: ``chosen`` (the parsed ``--sparse-mla-golden-dir`` / ini value, already
    absolute) when given, else :func:`default_golden_dir`."""
    return Path(chosen) if chosen is not None else default_golden_dir()


# Roots of the sessions configured in this process (innermost last). Read only where syrupy hands
# the extension a test location without a pytest config: the pytest-xdist controller rebuilds
# test locations from the workers' reports (syrupy >= 5.5 ``session._ReconstructedItem``).
_SESSION_ROOTS: list[Path] = []


def push_session_root(root: Path) -> None:
    """Record the golden root of a session being configured (``snapshot.session.configure``)."""
    _SESSION_ROOTS.append(Path(root))


def session_roots() -> tuple[Path, ...]:
    """The golden roots of the sessions configured in this process, innermost last."""
    return tuple(_SESSION_ROOTS)


def pop_session_root() -> None:
    """Forget the innermost session root (``snapshot.session.unconfigure``)."""
    if _SESSION_ROOTS:
        _SESSION_ROOTS.pop()


def suite_name(test_file: str | Path) -> str:
    """The suite a test module belongs to: the name of the directory that holds it
    (``suites/test_golden.py`` -> ``"suites"``, the same for a checkout and an installed package)."""
    return Path(test_file).parent.name


def _sanitize(name: str) -> str:
    # The characters syrupy's single-file extension drops from file names (single_file.py,
    # ``_sanitize_filename``/``__clean_filename``), so golden_file() names files as syrupy does.
    kept = (c for c in name if c not in '\\/?*:|"<>' and not unicodedata.category(c).startswith("C"))
    return "".join(kept)[: 255 - len(FILE_EXTENSION) - 1]


def golden_file(root: str | Path, test_file: str | Path, test_name: str, name: str | None = None) -> Path:
    """Path of the snapshot that test ``test_name`` of module ``test_file`` writes under ``root``.

    Args:
        root: the golden root (``snapshot.session.golden_root`` of a session, or :func:`resolve_root`).
        test_file: path of the test module (only its parent directory name and stem are used).
        test_name: the test's name with its parameter id, e.g. ``"test_attention[decode-h8]"``
            (``"TestClass.test_x[id]"`` for a method).
        name: the ``name=`` given to ``tensor_snapshot(name=...)``, or ``None`` for the first
            unnamed assertion of the test.
    """
    test_file = Path(test_file)
    stem = test_name if name is None else f"{test_name}[{name}]"
    return Path(root) / suite_name(test_file) / test_file.stem / f"{_sanitize(stem)}.{FILE_EXTENSION}"
