"""The search's checked calls outside pytest: draw, build, call, oracle, check (``benchmarks/``).

Shared by ``test_bench_search.py`` (calls per second, this checkout beside a baseline commit) and
``profile_search.py`` (where one call's time goes).

* :func:`decode_calls`: ``n`` calls drawn by the search's own strategy (``search.calls``) for an
  envelope and device, derandomized, keeping decode shapes (``num_tokens <= 64``).
* :class:`Judge`: the suite's ``_judge`` (``suites/test_attention_search.py``) for one set of
  modules: ``build``, the implementation's forward, ``changed_inputs``, ``check_result_shapes``,
  the oracle, the empty-row check, ``check_result``; one synchronisation at the end on CUDA.
* :func:`baseline_modules`: the modules the speed work changed (``search``,
  ``attention.oracle``, ``tolerances``) as they were at a baseline commit, loaded under other
  names beside this checkout's (their imports reach only modules the work did not change). The
  files come from ``git show COMMIT:PATH`` of this checkout, or from ``$SPARSE_MLA_SEARCH_BASELINE``
  (a folder holding ``search.py``, ``oracle.py``, ``tolerances.py``) where the checkout has no
  history (a copy sent to a device machine).
* :func:`baseline_tree`: the whole checkout at the baseline commit (``git archive``), or
  ``$SPARSE_MLA_SEARCH_BASELINE_TREE`` (a folder holding it), for what only a whole package can
  time: :func:`default_search`, the default CPU search of one package tree in its own pytest process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: The commit the speed work started from (``speed`` branched from ``main`` here).
BASELINE_COMMIT = "fce8086"
#: Module name -> path in the checkout, of the modules whose previous version is the baseline.
BASELINE_FILES = {
    "search": "pytest_sparse_mla/search.py",
    "oracle": "pytest_sparse_mla/attention/oracle.py",
    "tolerances": "pytest_sparse_mla/tolerances.py",
}


#: The search suite, relative to a checkout's root.
SEARCH_SUITE = "suites/test_attention_search.py"


def baseline_tree(dest: Path, commit: str = BASELINE_COMMIT) -> Path:
    """A folder holding the whole checkout at ``commit``: ``$SPARSE_MLA_SEARCH_BASELINE_TREE`` when
    set, else ``git archive commit`` of this checkout unpacked under ``dest``.

    Raises:
        RuntimeError: neither gives a tree holding ``SEARCH_SUITE``.
    """
    folder = os.environ.get("SPARSE_MLA_SEARCH_BASELINE_TREE")
    tree = Path(folder) if folder else dest / commit
    if not folder and not (tree / SEARCH_SUITE).is_file():
        tree.mkdir(parents=True, exist_ok=True)
        try:
            archive = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, capture_output=True, check=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            raise RuntimeError(f"no baseline tree: set SPARSE_MLA_SEARCH_BASELINE_TREE or run in a git checkout "
                               f"holding {commit} ({exc})") from exc  # fmt: skip
    if not (tree / SEARCH_SUITE).is_file():
        raise RuntimeError(f"{tree} holds no {SEARCH_SUITE}: not a checkout of the project")
    return tree


def default_search(tree: Path, out: Path) -> dict[str, Any]:
    """Run the default search of the package in ``tree`` on the CPU, as a user does: ``SEARCH_SUITE``
    against the bundled reference (``--sparse-mla-impl reference --sparse-mla-device cpu``, default
    budget and seed), one pytest process without xdist, ``tree`` first on ``PYTHONPATH`` (so its
    ``pytest_sparse_mla`` is the one the ``sparse_mla`` entry point loads), ``tree`` as rootdir.

    Returns:
        ``{"wall_s"``: the process, start to exit (interpreter, imports, collection included);
        ``"tests_s"``: the search tests' call phases (junit ``time``, ``junit_duration_report=call``);
        ``"tests"``: per test id, seconds; ``"calls"``: the calls the search judged (the JSON
        report's ``search.calls``); ``"passed"``: tests passed``}``.

    Raises:
        RuntimeError: the run did not pass (the output's tail in the message).
    """
    out.mkdir(parents=True, exist_ok=True)
    junit, report = out / "junit.xml", out / "report.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("PYTEST_ADDOPTS", None)
    args = [sys.executable, "-m", "pytest", "-p", "sparse_mla", SEARCH_SUITE, "--sparse-mla-impl", "reference",
            "--sparse-mla-device", "cpu", "-p", "no:xdist", "-p", "no:cacheprovider", "-q", "--rootdir", str(tree),
            "-o", "junit_duration_report=call", f"--junitxml={junit}",
            f"--sparse-mla-report-json={report}"]  # fmt: skip
    start = time.perf_counter()
    run = subprocess.run(args, cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if run.returncode != 0:
        tail = (run.stdout + run.stderr)[-3000:]
        raise RuntimeError(f"the default search in {tree} exited {run.returncode}:\n{tail}")
    cases = list(ET.parse(junit).getroot().iter("testcase"))
    tests = {f"{c.get('classname')}::{c.get('name')}": float(c.get("time") or 0.0) for c in cases}
    passed = sum(not any(e.tag in ("skipped", "failure", "error") for e in c) for c in cases)
    search = json.loads(report.read_text()).get("search") or {}
    return {"wall_s": wall, "tests_s": sum(tests.values()), "tests": tests, "calls": search.get("calls"),
            "passed": passed}  # fmt: skip


def decode_calls(envelope: Any, device: str, n: int, max_tokens: int = 64) -> list[Any]:
    """``n`` :class:`~pytest_sparse_mla.search.DrawnCall` s drawn by ``search.calls(envelope, device)``
    (derandomized: the same list every run), only those with ``num_tokens <= max_tokens``."""
    from hypothesis import HealthCheck, Phase, given, settings

    from pytest_sparse_mla import search

    out: list[Any] = []

    @settings(max_examples=50 * n, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(call=search.calls(envelope, device))
    def draw(call: Any) -> None:
        if call.num_tokens <= max_tokens and len(out) < n and call not in out:
            out.append(call)

    draw()
    return out


def _load(name: str, source: str, filename: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__file__ = filename
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    exec(compile(source, filename, "exec"), module.__dict__)
    return module


def baseline_modules(commit: str = BASELINE_COMMIT) -> dict[str, types.ModuleType]:
    """``{"search", "oracle", "tolerances"}`` as at ``commit`` (module docstring), named
    ``_baseline_<name>``.

    Raises:
        RuntimeError: neither ``$SPARSE_MLA_SEARCH_BASELINE`` nor ``git show`` gives the files.
    """
    folder = os.environ.get("SPARSE_MLA_SEARCH_BASELINE")
    out = {}
    for name, path in BASELINE_FILES.items():
        if folder:
            source = (Path(folder) / Path(path).name).read_text()
        else:
            try:
                source = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True,
                                        text=True, check=True).stdout  # fmt: skip
            except (OSError, subprocess.CalledProcessError) as exc:
                raise RuntimeError(f"no baseline {path}: set SPARSE_MLA_SEARCH_BASELINE or run in a git checkout "
                                   f"holding {commit} ({exc})") from exc  # fmt: skip
        out[name] = _load(f"_baseline_{name}", source, f"{commit}:{path}")
    return out


def current_modules() -> dict[str, types.ModuleType]:
    """This checkout's ``{"search", "oracle", "tolerances"}``."""
    from pytest_sparse_mla import search, tolerances
    from pytest_sparse_mla.attention import oracle

    return {"search": search, "oracle": oracle, "tolerances": tolerances}


@dataclass
class Judge:
    """The suite's ``_judge`` with one set of modules (:func:`current_modules` or
    :func:`baseline_modules`) and one implementation (behind the envelope guard, as the suite's)."""

    modules: dict[str, types.ModuleType]
    impl: Any
    device: str

    def __post_init__(self) -> None:
        from pytest_sparse_mla.guard import GuardedImplementation

        tol = self.modules["tolerances"]
        self.tol = tol.resolve(tol.profile_for(self.impl), {}, [])
        self.guarded = GuardedImplementation(self.impl, self.impl.envelope, declared=True)

    def __call__(self, call: Any) -> None:
        """Build ``call``'s inputs and judge the implementation on them (raises as the suite)."""
        import torch

        from pytest_sparse_mla.guard import check_result_shapes

        inputs = self.modules["search"].build(call, self.device)
        res = self.guarded.sparse_mla_forward(inputs.q, inputs.kv_cache, inputs.indices, **inputs.kwargs)
        changed = inputs.changed_inputs()
        assert not changed, changed
        check_result_shapes(res, call.num_tokens, call.num_heads)
        oracle = self.modules["oracle"].oracle_forward(inputs.q, inputs.kv_cache, inputs.indices, **inputs.kwargs)
        empty = ~inputs.valid.any(-1).to(res.output.device)
        if bool(empty.any()):
            assert bool((res.output[empty] == 0).all())
        self.tol.check_result(res, oracle, fmt=call.fmt, what="drawn call")
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
