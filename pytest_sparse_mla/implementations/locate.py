"""Find the module an ``--sparse-mla-impl`` value names, including one that only sits beside the tests.

Plain ``pytest`` does not put the rootdir on ``sys.path`` (only the ``prepend`` import mode adds the
folders of the test modules and ``conftest.py`` files it imports, and only once it imports them), so
``--sparse-mla-impl mykernel`` for a ``mykernel.py`` beside the tests would not import at
``pytest_configure``. :func:`import_module` therefore looks, after ``sys.path``, in the folders a
user would expect (:func:`search_dirs`): the rootdir, the ini file's folder, the invocation folder,
the folders of the command-line test paths and of every loaded ``conftest.py``. The folder where
the module is found is put in front of ``sys.path`` (what the ``prepend`` import mode does for a
test folder; pytest docs, "pytest import mechanisms and sys.path/PYTHONPATH"), so the module's own
absolute imports of its siblings work.

:func:`miss_message` is the error for a value that matches nothing: it lists every form that would
have worked, with the names and folders actually available.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: this module does not import pytest at run time
    import pytest

__all__ = [
    "ModuleMissing",
    "close_module_names",
    "file_name_hint",
    "import_module",
    "is_module_path",
    "miss_message",
    "search_dirs",
]


class ModuleMissing(ImportError):
    """No module of that name exists on ``sys.path`` or in any searched folder."""


def _file_module(text: str) -> tuple[str, str] | None:
    """``(module name, folder)`` for a file path given where a module is expected (``mykernel.py``,
    ``./mykernel.py``, ``/abs/dir/mykernel.py``: folder ``""`` for a bare file name), else ``None``."""
    path = Path(text)
    if path.suffix != ".py" or not is_module_path(path.stem):
        return None
    folder = "" if text == path.name else str(path.parent)
    return path.stem, folder


def file_name_hint(module: str) -> str | None:
    """For ``mykernel.py`` or a path to it (a file given where a module is expected): the module name
    to give and, for a path, the folder to put on ``PYTHONPATH``."""
    found = _file_module(module)
    if found is None:
        return None
    stem, folder = found
    if not folder or folder == ".":
        return f"for the file {module!r}, give the module name {stem!r}"
    return (
        f"for the file {module!r}, give the module name {stem!r} with its folder on the import path "
        f"(PYTHONPATH={folder} pytest ... --sparse-mla-impl {stem}, or run pytest from {folder})"
    )


def close_module_names(module: str, dirs: Sequence[Path]) -> list[str]:
    """Names of modules (``*.py`` files and packages) in ``dirs`` close to ``module``'s top-level name
    (``difflib``), for a misspelled ``--sparse-mla-impl``."""
    import difflib

    top = module.split(".", 1)[0]
    names: set[str] = set()
    for folder in dirs:
        try:
            entries = list(folder.iterdir())
        except OSError:
            continue
        for entry in entries:
            if entry.suffix == ".py" and entry.stem.isidentifier():
                names.add(entry.stem)
            elif entry.is_dir() and entry.name.isidentifier() and (entry / "__init__.py").is_file():
                names.add(entry.name)
    names.discard("conftest")
    return difflib.get_close_matches(top, sorted(names), n=3, cutoff=0.75)


def is_module_path(text: str) -> bool:
    """Whether ``text`` is a dotted module path (``mykernel``, ``mypkg.kern``)."""
    return bool(text) and all(part.isidentifier() for part in text.split("."))


def search_dirs(config: pytest.Config) -> list[Path]:
    """Folders searched for a local module, in order, without duplicates: the rootdir, the ini
    file's folder, the invocation folder, each command-line test path's folder (a file's parent),
    and the folder of every ``conftest.py`` loaded so far."""
    found: list[Path] = [config.rootpath]
    if config.inipath is not None:
        found.append(config.inipath.parent)
    found.append(config.invocation_params.dir)
    for arg in config.args:
        path = Path(arg.split("::", 1)[0])
        if not path.is_absolute():
            path = config.invocation_params.dir / path
        if path.is_file():
            found.append(path.parent)
        elif path.is_dir():
            found.append(path)
    for plugin in config.pluginmanager.get_plugins():
        file = getattr(plugin, "__file__", None)
        if isinstance(file, str) and Path(file).name == "conftest.py":
            found.append(Path(file).parent)
    return list(dict.fromkeys(p.resolve() for p in found))


def _top_level_missing(module_name: str, exc: ModuleNotFoundError) -> bool:
    """Whether ``exc`` says ``module_name`` itself (or a parent package) is missing, rather than
    something the module imports."""
    missing = exc.name or ""
    parts = module_name.split(".")
    return missing in {".".join(parts[: i + 1]) for i in range(len(parts))}


def _found_in(module_name: str, folder: Path) -> bool:
    top = module_name.split(".", 1)[0]
    return (folder / f"{top}.py").is_file() or (folder / top / "__init__.py").is_file()


def import_module(module_name: str, dirs: Sequence[Path]) -> ModuleType:
    """Import ``module_name`` from ``sys.path``, else from the first of ``dirs`` holding it.

    Raises:
        ModuleMissing: it exists in neither place.
        ImportError: it exists but failed to import (the module's own error, chained).
    """
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if not _top_level_missing(module_name, exc):
            raise
    for folder in dirs:
        if _found_in(module_name, folder):
            if str(folder) not in sys.path:
                sys.path.insert(0, str(folder))
            importlib.invalidate_caches()
            return importlib.import_module(module_name)
    raise ModuleMissing(f"No module named {module_name!r}", name=module_name)


def _listed(names: Iterable[str]) -> str:
    ordered = sorted(names)
    return ", ".join(ordered) if ordered else "(none)"


def miss_message(
    spec: str,
    *,
    builtins: Iterable[str],
    entry_points: Iterable[str],
    hook_names: Iterable[str],
    dirs: Sequence[Path],
) -> str:
    """The usage error for a ``--sparse-mla-impl`` value that matched nothing: every form that
    would have worked, with what is available in this session."""
    import difflib

    all_names = {*builtins, *entry_points, *hook_names}
    module = spec.partition(":")[0] or spec
    file_module = _file_module(module)
    if file_module is not None:  # the examples below name the module, not the file
        module = file_module[0]
    top = module.split(".", 1)[0]
    folders = "\n".join(f"      {d}" for d in dirs)
    close = difflib.get_close_matches(spec, sorted(all_names), n=3, cutoff=0.6)
    if file_module is None and is_module_path(module):
        close += [m for m in close_module_names(module, dirs) if m != module]
    hints = [f"did you mean {' or '.join(repr(n) for n in close)}?"] if close else []
    file_hint = file_name_hint(spec.partition(":")[0] or spec)
    if file_hint:
        hints.append(file_hint)
    hint = f" ({'; '.join(hints)})" if hints else ""
    return (
        f"--sparse-mla-impl={spec!r}: unknown implementation{hint}; expected one of {_listed(all_names)}, "
        "or a module. Forms that work:\n"
        f"  * a built-in name: {_listed(builtins)}\n"
        f"  * an entry-point name (group 'pytest_sparse_mla.implementations' of an installed "
        f"package): {_listed(entry_points)}\n"
        f"  * a name returned by a pytest_sparse_mla_implementations(config) hook in a plugin or an "
        f"initial conftest.py: {_listed(hook_names)}\n"
        f"  * MODULE or PACKAGE.MODULE (the module itself), importable from sys.path (PYTHONPATH) or found as "
        f"{top}.py or {top}/__init__.py in one of:\n{folders}\n"
        f"  * MODULE:ATTRIBUTE, e.g. '{module}:implementation' (a class is instantiated without "
        "arguments)"
    )
