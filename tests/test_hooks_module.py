"""One module holds every pytest hook of the plugin; one module registers and parses every option.

``pytest_sparse_mla.plugin`` implements the hooks and delegates to the logic modules;
``pytest_sparse_mla.hookspecs`` declares the hooks downstream projects implement;
``pytest_sparse_mla.options`` registers every ``--sparse-mla-*`` option and ``sparse_mla_*`` ini key
and parses them into one typed object. The shipped suites (``pytest_sparse_mla/suites``) are test
code with their own ``conftest.py``, not plugin code, and are not scanned.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

# Imported up front: pytester's in-process runs restore sys.modules afterwards, so a torch first
# imported inside one (the report header probes it) would be unloaded and imported again by the next.
import torch  # noqa: F401

from pytest_sparse_mla import options, plugin

PACKAGE = Path(plugin.__file__).resolve().parent
HOOKS_MODULE = PACKAGE / "plugin.py"
#: ``alias.py`` (the entry point ``sparse-mla``) has one hook, ``pytest_addhooks``, that only loads the
#: plugin under its own name: ``-p sparse-mla`` works like ``-p sparse_mla``.
ALLOWED = {HOOKS_MODULE, PACKAGE / "hookspecs.py", PACKAGE / "alias.py"}


def _package_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "suites" not in p.relative_to(PACKAGE).parts)


def _hook_functions(path: Path) -> list[str]:
    """Names of functions (module level or in a class) named ``pytest_*`` in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("pytest_")
    ]


def test_no_hook_implementation_outside_the_hooks_module() -> None:
    modules = _package_modules()
    assert HOOKS_MODULE in modules and len(modules) > 20
    strays = [hook for path in modules if path not in ALLOWED for hook in _hook_functions(path)]
    assert strays == [], "pytest hooks outside pytest_sparse_mla/plugin.py:\n" + "\n".join(strays)


def test_the_scan_finds_a_stray_hook(tmp_path: Path) -> None:
    """The scanner itself: a ``pytest_configure`` in a class or at module level is found."""
    stray = tmp_path / "pkg" / "stray.py"
    stray.parent.mkdir()
    stray.write_text(
        "class Hooks:\n    def pytest_configure(self, config):\n        pass\n\ndef pytest_addoption(p):\n    pass\n"
    )
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path / "pkg"
    try:
        assert sorted(h.split()[-1] for h in _hook_functions(stray)) == ["pytest_addoption", "pytest_configure"]
    finally:
        PACKAGE = saved


_CONSTANT = re.compile(r"_?[A-Z][A-Z0-9_]*")


def _not_hooks_only(tree: ast.Module) -> list[str]:
    """What a module's top level holds besides what :func:`test_the_hooks_module_holds_hooks_only`
    allows, as ``"line: what"``."""
    found: list[str] = []

    def check_hook(node: ast.FunctionDef | ast.AsyncFunctionDef, where: str) -> None:
        inner = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
        nested = [n for n in ast.walk(node) if n is not node and isinstance(n, inner)]
        found.extend(f"{n.lineno}: {type(n).__name__} inside hook {where}{node.name}" for n in nested)

    for index, node in enumerate(tree.body):
        if index == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the module docstring
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("pytest_"):
            check_hook(node, "")
            continue
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if len(names) == len(targets) and all(_CONSTANT.fullmatch(n) for n in names):
                continue
            found.append(f"{node.lineno}: an assignment that is not a constant ({ast.unparse(node)[:60]})")
            continue
        if isinstance(node, ast.ClassDef):
            methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            others = [n for n in node.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]  # fmt: skip
            found += [f"{n.lineno}: {type(n).__name__} in class {node.name}" for n in others]
            for method in methods:
                if method.name.startswith("pytest_"):
                    check_hook(method, f"{node.name}.")
                elif method.name != "__init__":
                    found.append(f"{method.lineno}: method {node.name}.{method.name} is not a hook")
            continue
        kind = node.name if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else type(node).__name__
        found.append(f"{node.lineno}: {kind} (not a hook, an import or a constant)")
    return found


def test_the_hooks_module_holds_hooks_only() -> None:
    """``plugin.py`` holds pytest hooks only; what they do is in the logic modules.

    "Hooks only", precisely: the module's top level holds nothing but its docstring; imports;
    constants (assignments to ``UPPER_CASE`` names, with or without one leading underscore: the
    fixture modules to register, the "needs the plugin" message, a stash key); functions named
    ``pytest_*`` (hook implementations, decorated or not); and classes of hooks (plugin objects
    ``pytest_configure`` registers for hooks that need the session's config but receive none),
    whose methods are ``pytest_*`` hooks and ``__init__`` only. No hook defines a function, class or
    lambda inside it. So a helper function, a policy written as a private function or a class of
    logic has no place here: it goes to the module of its concept (e.g. the reproducers' policy
    is ``repro.write_for_report``), which the hook calls."""
    tree = ast.parse(HOOKS_MODULE.read_text(), filename=str(HOOKS_MODULE))
    found = _not_hooks_only(tree)
    assert found == [], "pytest_sparse_mla/plugin.py holds more than hooks:\n" + "\n".join(found)


def test_the_hooks_only_scan_finds_a_helper() -> None:
    """The scanner itself: a helper function, a non-hook method, a lowercase module variable and a
    function inside a hook are each found; hooks, constants, imports and ``__init__`` are not."""
    source = (
        '"""doc"""\nimport os\nfrom x import y\nLIMIT = 3\n_KEY: int = 4\ncache = {}\n'
        "def pytest_configure(config):\n    def inner():\n        pass\n"
        "def _helper():\n    pass\n"
        "class Hooks:\n    def __init__(self):\n        pass\n    def pytest_sessionstart(self, session):\n"
        "        pass\n    def policy(self):\n        pass\n"
    )
    assert _not_hooks_only(ast.parse(source)) == [
        "6: an assignment that is not a constant (cache = {})",
        "8: FunctionDef inside hook pytest_configure",
        "10: _helper (not a hook, an import or a constant)",
        "17: method Hooks.policy is not a hook",
    ]


def test_every_plugin_hook_is_a_known_pytest_or_xdist_hook(pytester: pytest.Pytester) -> None:
    """pluggy validates the hooks module against the specs of pytest, xdist and ours."""
    config = pytester.parseconfigure("-p", "sparse_mla")
    names = [name for name in dir(plugin) if name.startswith("pytest_")]
    assert len(names) >= 12
    for name in names:
        caller = getattr(config.hook, name, None)
        assert caller is not None and caller.has_spec(), f"{name}: no pytest, xdist or sparse-mla hook spec"


_OPTION_READ = re.compile(r"""(getoption|getini)\(\s*["'](sparse_mla\w*)""")


def test_options_and_ini_keys_are_read_only_in_the_options_module() -> None:
    reads = [
        f"{path.relative_to(PACKAGE.parent)}: {match.group(0)}"
        for path in _package_modules()
        if path != PACKAGE / "options.py"
        for match in _OPTION_READ.finditer(path.read_text())
    ]
    assert reads == [], "raw option reads outside pytest_sparse_mla/options.py:\n" + "\n".join(reads)


def test_every_option_lands_in_the_typed_options_object(pytester: pytest.Pytester) -> None:
    tmp_path = pytester.path  # paths given as option values take part in the rootdir search
    (tmp_path / "xfails.txt").write_text("x\n")
    (tmp_path / "gold").mkdir()
    pytester.makeini("[pytest]\nsparse_mla_tolerances =\n    kernel.row_sigmas = 5\n")
    config = pytester.parseconfigure(
        "-p", "sparse_mla", "--sparse-mla-device", "cpu", "--sparse-mla-seed", "7", "--sparse-mla-impl", "triton",
        "--sparse-mla-grid", "flashinfer==0.6.17", "--sparse-mla-require-gpu", "--sparse-mla-golden-dir",
        str(tmp_path / "gold"), "--sparse-mla-xfail-file", str(tmp_path / "xfails.txt"),
        "--sparse-mla-no-gpu-pinning", "--sparse-mla-report-json", str(tmp_path / "r.json"),
    )  # fmt: skip
    opts = options.get_options(config)
    assert opts == options.SparseMlaOptions(
        device="cpu", seed=7, impl="triton", impl_given=True, grid="0.6.17", require_gpu=True,
        golden_dir=tmp_path / "gold", xfail_file=tmp_path / "xfails.txt", skip_file=None,
        gpu_per_worker=False, report_json=tmp_path / "r.json",
        tolerances=opts.tolerances, activated_by="-p sparse_mla",
    )  # fmt: skip
    assert opts.tolerances == {"kernel": {"row_sigmas": 5.0}}
    dests = {action.dest for action in config._parser._anonymous.options}  # noqa: SLF001
    for group in config._parser._groups:  # noqa: SLF001
        if group.name == options.HELP_GROUP:
            dests = {o.dest for o in group.options}
    assert dests == set(options._DESTS)  # noqa: SLF001
