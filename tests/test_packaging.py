"""Packaging fit for the index: build pins, license, one version, dependencies where they install,
a complete sdist, a typed package, and the Triton paths skipping where triton is absent."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

import pytest_sparse_mla

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict[str, Any]:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    data: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return data


@pytest.fixture(scope="module")
def pyproject() -> dict[str, Any]:
    return _pyproject()


@pytest.fixture(scope="module")
def project(pyproject: dict[str, Any]) -> dict[str, Any]:
    data: dict[str, Any] = pyproject["project"]
    return data

#: Build outputs, caches and local environments a source copy leaves out.
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", ".tox", ".whl", ".peers", ".wt*", "__pycache__", "*.pyc", "*.egg-info", "build", "dist",
    ".pytest_cache", ".hypothesis", ".benchmarks", ".ruff_cache", ".mypy_cache",
)  # fmt: skip


def _requirements(names: list[str]) -> dict[str, Requirement]:
    return {Requirement(text).name: Requirement(text) for text in names}


def test_build_backend_pin_reads_the_license_expression(pyproject: dict[str, Any], project: dict[str, Any]) -> None:
    """setuptools reads the PEP 639 ``license = "Apache-2.0"`` string (and ``license-files``) from
    77.0 on; an older pin fails on ``project.license``."""
    (setuptools,) = [Requirement(r) for r in pyproject["build-system"]["requires"] if r.startswith("setuptools")]
    assert "76.9" not in setuptools.specifier and "77.0" in setuptools.specifier
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]


def test_the_license_file_is_the_apache_2_0_text() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert text.rstrip().endswith("END OF TERMS AND CONDITIONS")


def test_the_version_has_one_source(pyproject: dict[str, Any], project: dict[str, Any]) -> None:
    assert "version" not in project and "version" in project["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "pytest_sparse_mla.__version__"}
    assert importlib.metadata.version("pytest-sparse-mla") == pytest_sparse_mla.__version__


def test_dependencies_install_where_they_exist(project: dict[str, Any]) -> None:
    """triton publishes Linux wheels only; pytest-benchmark serves the checkout's benchmarks/."""
    deps = _requirements(project["dependencies"])
    assert deps["triton"].marker is not None
    assert deps["triton"].marker.evaluate({"platform_system": "Linux"})
    assert not deps["triton"].marker.evaluate({"platform_system": "Darwin"})
    assert not deps["triton"].marker.evaluate({"platform_system": "Windows"})
    assert "pytest-benchmark" not in deps
    assert "pytest-benchmark" in _requirements(project["optional-dependencies"]["bench"])
    installed = _requirements(importlib.metadata.requires("pytest-sparse-mla") or [])
    assert str(installed["triton"].marker) == str(deps["triton"].marker)  # the installed metadata agrees


def test_the_package_is_typed(pyproject: dict[str, Any], project: dict[str, Any]) -> None:
    assert (Path(pytest_sparse_mla.__file__).parent / "py.typed").is_file()
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["pytest_sparse_mla"]
    assert "Typing :: Typed" in project["classifiers"]


def test_no_dependency_pytest_plugin_is_forced_on_other_projects(project: dict[str, Any]) -> None:
    """pytest-benchmark adds a header line to every session; as a hard dependency it reached
    projects that never benchmark. The hard dependencies that are pytest plugins: xdist and syrupy."""
    plugins = {
        ep.dist.name.lower() for ep in importlib.metadata.entry_points(group="pytest11") if ep.dist is not None
    }
    hard = {name.lower() for name in _requirements(project["dependencies"])}
    assert hard & plugins <= {"pytest-xdist", "syrupy"}


@pytest.mark.full_tier
@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="needs setuptools to build the sdist")
def test_the_sdist_holds_the_tests_and_everything_they_need(tmp_path: Path) -> None:
    """Build the sdist (setuptools' PEP 517 backend, no network) from a copy of the source and
    check it holds every test module, the root conftest, the suites, goldens, example and license."""
    import setuptools

    if tuple(int(p) for p in setuptools.__version__.split(".")[:1]) < (77,):
        pytest.skip(f"setuptools {setuptools.__version__} < 77 cannot build this project")
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCE)
    out = tmp_path / "out"
    code = f"from setuptools import build_meta as b; print(b.build_sdist({str(out)!r}))"
    built = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    (sdist,) = out.glob("pytest_sparse_mla-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    expected = {
        "LICENSE", "README.md", "CONTRIBUTING.md", "pyproject.toml", "conftest.py", "tox.ini", ".ci/run",
        "pytest_sparse_mla/py.typed", "examples/downstream/pyproject.toml",
        "scripts/flashinfer_introspect.py",  # a CI tool the tests load (tests/scripts_loader.py)
    }  # fmt: skip
    expected |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("*.py")}
    expected |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "suites").glob("*.py")}
    expected |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "golden").rglob("*.tensor.json")}
    assert expected <= names, sorted(expected - names)
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)


TRITON_ABSENT = """
import pytest

def test_split_backends(page_split_backend):
    pass

@pytest.mark.sparse_mla_needs("page_split")
def test_triton_split(sparse_mla_impl):
    pass
"""


def test_triton_paths_skip_with_a_reason_where_triton_is_absent(pytester: pytest.Pytester) -> None:
    """Where triton does not install (macOS, Windows), ``import triton`` fails: the Triton split
    backend and the ``triton`` implementation skip and say why; the torch paths run."""
    shim = pytester.mkdir("no_triton")
    (shim / "triton").mkdir()
    (shim / "triton" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'triton' (simulated)\", name='triton')\n"
    )
    pytester.makepyfile(test_triton_absent=TRITON_ABSENT)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")]))}
    pytester._monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    result = pytester.runpytest_subprocess(
        "-p", "sparse_mla", "--sparse-mla-impl", "triton", "--sparse-mla-device", "cpu", "-p", "no:cacheprovider", "-rs"
    )  # fmt: skip
    result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines_random(
        [
            "SKIPPED *backend 'triton': triton is not importable (No module named 'triton' (simulated))*",
            "SKIPPED *implementation 'triton' cannot run 'page_split': triton is not importable*",
        ]
    )


def test_readme_installs_cpu_torch_before_the_package() -> None:
    """On a CPU machine the package's ``torch>=2.4`` must already be met by a CPU build, or pip
    resolves PyPI's CUDA torch (about 15 nvidia-* packages)."""
    readme = (ROOT / "README.md").read_text()
    step = readme[readme.index("**1. Install.**") : readme.index("**2. ")]
    cpu = step.index("pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu")
    assert cpu < step.index("'pytest-sparse-mla[test]'")
    for marker in ("<!-- main-command -->", "<!-- test-command -->"):
        block = readme[readme.index(marker) :].split("```")[1]
        command = block.removeprefix("bash").strip()
        assert command.startswith("python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e '.[test]' && ")


def test_suites_and_goldens_are_real_folders_mapped_into_the_package(pyproject: dict[str, Any]) -> None:
    """No symlinks: the build maps the top-level suites/ and golden/ into the package, and every
    package folder on disk is listed for the build."""
    package = ROOT / "pytest_sparse_mla"
    assert not [p for p in package.rglob("*") if p.is_symlink()]
    assert (ROOT / "suites").is_dir() and not (ROOT / "suites").is_symlink()
    setuptools_cfg = pyproject["tool"]["setuptools"]
    mapped = {"pytest_sparse_mla.suites": "suites", "pytest_sparse_mla.golden": "golden"}
    assert setuptools_cfg["package-dir"] == mapped
    on_disk = {
        ".".join(p.relative_to(ROOT).parts)
        for p in package.rglob("*")
        if p.is_dir() and p.name != "__pycache__" and any(f.suffix in (".py", ".txt") for f in p.iterdir())
    } | {"pytest_sparse_mla"}
    listed = set(setuptools_cfg["packages"])
    assert on_disk <= listed, f"package folders missing from [tool.setuptools] packages: {sorted(on_disk - listed)}"
    assert {"pytest_sparse_mla.suites", "pytest_sparse_mla.golden"} <= listed


def test_the_installed_package_provides_the_suites_and_goldens() -> None:
    """Whatever the install (editable here from a checkout, a wheel or an sdist elsewhere), the
    import system finds ``pytest_sparse_mla.suites`` and the goldens without importing them."""
    from pytest_sparse_mla import api, snapshots

    suites = api.suites_dir()
    assert (suites / "conftest.py").is_file() and (suites / "test_golden.py").is_file()
    golden = snapshots.default_golden_dir()
    assert any(golden.rglob("*.tensor.json"))
    from_checkout = Path(pytest_sparse_mla.__file__).resolve().parent == ROOT / "pytest_sparse_mla"
    if from_checkout and (ROOT / "pyproject.toml").is_file():
        assert suites == ROOT / "suites" and golden == ROOT / "golden"  # a checkout: the real folders
