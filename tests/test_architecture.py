"""The package's import structure: no import cycles, between modules or between the package's
top-level units, and a domain core that never imports pytest.

Both checks read the sources with :mod:`ast` (nothing is imported to build the graph), so an
import inside a function counts as much as one at the top of a module, and so does one under
``if TYPE_CHECKING:``. An edge ``a -> b`` means module ``a`` names module ``b`` in an ``import``
statement: ``from p import name`` is an edge to the submodule ``p.name`` where that module exists,
else to ``p`` (the package's ``__init__``). Imports through ``importlib.import_module`` strings are
not edges.

A *unit* is a top-level piece of the package: a subpackage (``implementations``, ``dispatch``,
``attention``, ...) with all its modules, or a top-level module (``repro``, ``guard``, ...); the
package's ``__init__`` is a unit of its own. The units must form layers: no unit imports, at any
depth, a unit that imports it back (:func:`test_the_units_form_layers`).

The core (:data:`CORE`) computes, parses and checks without pytest: it raises the package's own
exceptions (``pytest_sparse_mla.errors``), which the plugin layer (``options``, ``plugin``,
``fixtures``, ``selection``, ...) turns into ``pytest.UsageError``. A core module may import
nothing that imports pytest, directly or through other modules of the package.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest_sparse_mla
from pytest_sparse_mla import catalogue

PACKAGE = "pytest_sparse_mla"
PACKAGE_DIR = Path(pytest_sparse_mla.__file__).resolve().parent

#: Modules (and packages, with every submodule) that must work without pytest.
CORE = (
    "attention",
    "capabilities",
    "data",
    "deployments",
    "diagnosis",
    "dispatch",
    "envelope",
    "errors",
    "formats",
    *dict.fromkeys(entry.module.removeprefix(f"{PACKAGE}.") for entry in catalogue.BUILTINS),  # every adapter
    "implementations._peer",
    "implementations._source",
    "catalogue",
    "implementations.protocol",
    "page_split",
    "recording",
    "shards",
    "shipped",
    "snapshot.file_format",
    "snapshot.location",
    "tolerances",
)


def _modules() -> dict[str, tuple[Path, bool]]:
    """``{dotted name: (source file, is a package)}`` of every module under the package directory
    (the shipped suites and goldens live elsewhere in a checkout and are not part of the graph)."""
    found: dict[str, tuple[Path, bool]] = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = [PACKAGE, *path.relative_to(PACKAGE_DIR).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        found[".".join(parts)] = (path, is_package)
    return found


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The module of the package that ``name`` (a module or a name inside one) belongs to."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imported_names(module: str) -> list[tuple[str, int]]:
    """``(absolute dotted name, line)`` of everything ``module`` imports, anywhere in its source."""
    path, is_package = MODULES[module]
    base = module.split(".") if is_package else module.split(".")[:-1]
    names: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                head = base[: len(base) - node.level + 1]
                source = ".".join(head + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                names.append((sub if sub in MODULES else source, node.lineno))
    return names


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module in MODULES:
        for name, _ in _imported_names(module):
            target = _owner(name) if name.split(".")[0] == PACKAGE else None
            if target is not None and target != module:
                graph[module].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _unit(module: str) -> str:
    """The top-level unit ``module`` belongs to: ``pytest_sparse_mla.implementations._peer`` ->
    ``implementations``, ``pytest_sparse_mla.repro`` -> ``repro``; the package's ``__init__`` ->
    ``pytest_sparse_mla``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _unit_imports() -> dict[tuple[str, str], list[str]]:
    """``{(unit, unit it imports): ["module:line imports name", ...]}`` over every import of the
    package's modules (function-level ones included), for two different units."""
    found: dict[tuple[str, str], list[str]] = {}
    for module in MODULES:
        for name, line in _imported_names(module):
            target = _owner(name) if name.split(".")[0] == PACKAGE else None
            if target is None or _unit(target) == _unit(module):
                continue
            path = MODULES[module][0].relative_to(PACKAGE_DIR.parent).as_posix()
            where = found.setdefault((_unit(module), _unit(target)), [])
            if f"{path}:{line} imports {name}" not in where:  # ``from m import a, b``: one line
                where.append(f"{path}:{line} imports {name}")
    return found


def _a_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One shortest cycle through the first unit of a strongly connected ``component``, as the
    units in order, the first repeated at the end (breadth-first inside the component)."""
    start, inside = component[0], set(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for unit in frontier:
            for nxt in sorted(graph[unit] & inside):
                if nxt == start:
                    path = [unit]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if nxt not in came_from:
                    came_from[nxt] = unit
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{component} is not strongly connected")


def _unit_cycle_report(imports: dict[tuple[str, str], list[str]]) -> tuple[list[list[str]], str]:
    """The unit graph's cycles (one per strongly connected component) and a message naming, for
    each component, one cycle through it and every arrow between its units with the import lines
    that make it (any of them may be the one to turn around)."""
    graph: dict[str, set[str]] = {_unit(m): set() for m in MODULES}
    for a, b in imports:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    components = _cycles(graph)
    cycles = [_a_cycle(graph, component) for component in components]
    lines: list[str] = []
    for cycle, component in zip(cycles, components, strict=True):
        lines.append(f"cycle: {' -> '.join(cycle)} (units that import each other: {', '.join(component)})")
        for a, b in sorted(pair for pair in imports if set(pair) <= set(component)):
            lines.append(f"  {a} -> {b}:")
            lines += [f"    {where}" for where in imports[(a, b)]]
    return cycles, "\n".join(lines)


def _layers(imports: dict[tuple[str, str], list[str]]) -> dict[str, int]:
    """Each unit's layer in an acyclic unit graph: 0 for a unit that imports no other, else one
    above the highest unit it imports."""
    graph: dict[str, set[str]] = {_unit(m): set() for m in MODULES}
    for a, b in imports:
        graph[a].add(b)
    layer: dict[str, int] = {}

    def of(unit: str) -> int:
        if unit not in layer:
            layer[unit] = 1 + max((of(b) for b in graph[unit]), default=-1)
        return layer[unit]

    for unit in graph:
        of(unit)
    return layer


def _core_modules() -> list[str]:
    return sorted(
        m for m in MODULES if any(m == f"{PACKAGE}.{c}" or m.startswith(f"{PACKAGE}.{c}.") for c in CORE)
    )


def _pytest_imports(module: str) -> list[str]:
    return [
        f"{name} (line {line})" for name, line in _imported_names(module) if name.split(".")[0] in ("pytest", "_pytest")
    ]


def test_the_graph_sees_function_level_imports() -> None:
    """Sanity: the parser finds the lazy imports (``tolerances`` imports ``formats`` in functions)."""
    graph = _graph()
    assert f"{PACKAGE}.formats" in graph[f"{PACKAGE}.tolerances"]
    assert len(_core_modules()) > len(CORE)  # packages contribute their submodules


def test_no_import_cycles() -> None:
    graph = _graph()
    cycles = _cycles(graph)
    detail = [
        "; ".join(f"{m} -> {', '.join(sorted(graph[m] & set(c)))}" for m in c) for c in cycles
    ]
    assert not cycles, "import cycles among the package's modules:\n" + "\n".join(detail)


def test_the_units_form_layers() -> None:
    """The package's top-level units (module docstring) form layers: each imports only units on
    layers below its own. Equivalently, the unit graph has no cycle: ``implementations`` may import
    ``recording`` (the adapters record the peer calls they make), never ``repro`` (which imports
    ``implementations._source``); ``dispatch`` may import ``deployments``, not the reverse."""
    imports = _unit_imports()
    cycles, message = _unit_cycle_report(imports)
    assert not cycles, "the package's units import each other in a cycle:\n" + message
    layer = _layers(imports)
    upward = [f"{a} (layer {layer[a]}) -> {b} (layer {layer[b]})" for a, b in imports if layer[b] >= layer[a]]
    assert not upward, "\n".join(upward)
    assert layer["recording"] < layer["implementations"] < min(layer["repro"], layer["guard"])
    assert max(layer["repro"], layer["guard"]) < layer["plugin"]
    assert layer["deployments"] < layer["dispatch"]


def test_the_unit_check_names_a_cycle_and_its_import_lines() -> None:
    """The check itself: a planted ``a -> b -> c -> a`` (beside an acyclic ``c -> d``) is reported
    as that cycle, each arrow with its import lines."""
    global MODULES
    planted = {
        ("a", "b"): ["pytest_sparse_mla/a.py:3 imports pytest_sparse_mla.b"],
        ("b", "c"): ["pytest_sparse_mla/b/x.py:7 imports pytest_sparse_mla.c.y"],
        ("c", "a"): ["pytest_sparse_mla/c/y.py:9 imports pytest_sparse_mla.a",
                     "pytest_sparse_mla/c/z.py:2 imports pytest_sparse_mla.a"],
        ("c", "d"): ["pytest_sparse_mla/c/y.py:1 imports pytest_sparse_mla.d"],
    }  # fmt: skip
    saved, MODULES = MODULES, {f"{PACKAGE}.{u}": (PACKAGE_DIR / f"{u}.py", False) for u in "abcd"}
    try:
        cycles, message = _unit_cycle_report(planted)
    finally:
        MODULES = saved
    assert cycles == [["a", "b", "c", "a"]]
    assert message.splitlines() == [
        "cycle: a -> b -> c -> a (units that import each other: a, b, c)",
        "  a -> b:",
        "    pytest_sparse_mla/a.py:3 imports pytest_sparse_mla.b",
        "  b -> c:",
        "    pytest_sparse_mla/b/x.py:7 imports pytest_sparse_mla.c.y",
        "  c -> a:",
        "    pytest_sparse_mla/c/y.py:9 imports pytest_sparse_mla.a",
        "    pytest_sparse_mla/c/z.py:2 imports pytest_sparse_mla.a",
    ]


def test_core_modules_name_no_pytest() -> None:
    """No core module imports pytest, nor any module of the package that does (at any depth)."""
    graph = _graph()
    problems: list[str] = []
    for module in _core_modules():
        direct = _pytest_imports(module)
        if direct:
            problems.append(f"{module} imports {', '.join(direct)}")
        seen: set[str] = set()
        todo = [module]
        while todo:
            current = todo.pop()
            if current not in seen:
                seen.add(current)
                todo += graph[current]
        through = sorted(m for m in seen - {module} if _pytest_imports(m))
        if through:
            problems.append(f"{module} imports pytest through {', '.join(through)}")
    assert not problems, "\n".join(problems)


_BLOCKED = """
import importlib, sys
sys.modules["pytest"] = None  # any `import pytest` now raises ImportError
sys.modules["_pytest"] = None
for name in sys.argv[1:]:
    importlib.import_module(name)
from pytest_sparse_mla import errors, tolerances
try:
    tolerances.parse_ini_lines(["kernel.nope = 1"])
except errors.ToleranceSpecError as exc:
    assert "unknown parameter 'nope'" in str(exc), exc
else:
    raise AssertionError("a bad ini line was accepted")
import torch
from pytest_sparse_mla.snapshot import file_format, location
file_format.close(torch.zeros(2), atol=0.0, rtol=0.0)
assert location.golden_file("g", "suites/test_x.py", "test_y[a]").as_posix() == "g/suites/test_x/test_y[a].tensor.json"
print("imported", len(sys.argv) - 1)
"""


def test_core_modules_import_and_work_with_pytest_blocked() -> None:
    modules = _core_modules()
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCKED, *modules], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"imported {len(modules)}" in proc.stdout
