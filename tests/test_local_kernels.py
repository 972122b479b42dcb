"""``--sparse-mla-impl`` finds a kernel module that sits beside the tests, the obvious way.

Each project is run with the virtual environment's ``pytest`` script from the project folder, as a
user runs plain ``pytest``: unlike ``python -m pytest`` or pytester's subprocess runs (which put the
working directory on ``PYTHONPATH``), the script does not make the rootdir importable.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PYTEST = Path(sys.executable).with_name("pytest")

KERNEL = """
from pytest_sparse_mla.attention import sparse_mla_forward as _forward

name = "{name}"


def sparse_mla_forward(q, kv_cache, indices, **kwargs):
    return _forward(q, kv_cache, indices, **kwargs)
"""

TEST = """
def test_selected(sparse_mla_impl):
    print("SELECTED", sparse_mla_impl.name)
"""


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    return subprocess.run(
        [str(PYTEST), "-p", "sparse_mla", "-p", "no:cacheprovider", "-s", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project with its own ini file and its tests in ``tests/`` (no conftest, no package)."""
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\ntestpaths = ['tests']\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_kernel.py").write_text(TEST)
    return tmp_path


def test_a_module_in_the_rootdir_is_found_by_its_name(project: Path) -> None:
    (project / "mykernel.py").write_text(KERNEL.format(name="rootdir-kernel"))
    result = _run(project, "--sparse-mla-impl", "mykernel")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "SELECTED rootdir-kernel" in result.stdout


def test_a_package_module_in_the_rootdir_is_found_by_its_dotted_name(project: Path) -> None:
    (project / "mypkg").mkdir()
    (project / "mypkg" / "__init__.py").write_text("")
    (project / "mypkg" / "kern.py").write_text(KERNEL.format(name="package-kernel"))
    result = _run(project, "--sparse-mla-impl", "mypkg.kern")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "SELECTED package-kernel" in result.stdout
    result = _run(project, "--sparse-mla-impl", "mypkg.kern:sparse_mla_forward")  # a bare function is
    assert result.returncode == 4 and "provides none of" in result.stderr  # not an implementation


def test_a_module_beside_a_conftest_is_found(project: Path) -> None:
    suite = project / "kernels_suite"
    suite.mkdir()
    (suite / "conftest.py").write_text("")
    (suite / "localkern.py").write_text(KERNEL.format(name="beside-conftest"))
    (suite / "test_local.py").write_text(TEST)
    result = _run(project, "kernels_suite", "--sparse-mla-impl", "localkern")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "SELECTED beside-conftest" in result.stdout


def test_a_miss_lists_every_form_that_would_have_worked(project: Path) -> None:
    (project / "mykernel.py").write_text(KERNEL.format(name="rootdir-kernel"))
    result = _run(project, "--sparse-mla-impl", "my_kernel")
    assert result.returncode == pytest.ExitCode.USAGE_ERROR
    for needle in (
        "--sparse-mla-impl='my_kernel': unknown implementation (did you mean 'mykernel'?)",
        "a built-in name: flaggems, flashinfer,",
        "an entry-point name (group 'pytest_sparse_mla.implementations'",
        "pytest_sparse_mla_implementations(config) hook",
        "MODULE or PACKAGE.MODULE (the module itself), importable from sys.path (PYTHONPATH) or found as my_kernel.py",
        f"      {project.resolve()}",
        "MODULE:ATTRIBUTE, e.g. 'my_kernel:implementation'",
    ):
        assert needle in result.stderr, result.stderr


def test_help_documents_every_form() -> None:
    result = subprocess.run([str(PYTEST), "-p", "sparse_mla", "--help"], capture_output=True, text=True, check=True)
    text = " ".join(result.stdout.split())
    for needle in (
        "--sparse-mla-impl=IMPL",
        "a built-in name (reference, triton, flashinfer,",
        "'pytest_sparse_mla.implementations' entry point",
        "pytest_sparse_mla_implementations(config) hook",
        "MODULE or PACKAGE.MODULE",
        "beside a conftest.py",
        "MODULE:ATTRIBUTE",
    ):
        assert needle in text, needle


def test_a_misspelled_name_or_a_file_name_gets_a_hint(project: Path) -> None:
    (project / "mykernel.py").write_text(KERNEL.format(name="rootdir-kernel"))
    typo = _run(project, "--sparse-mla-impl", "refrence")
    assert typo.returncode == 4 and "(did you mean 'reference'?)" in typo.stderr, typo.stderr[-2000:]
    file_name = _run(project, "--sparse-mla-impl", "mykernel.py")
    assert "for the file 'mykernel.py', give the module name 'mykernel'" in file_name.stderr, file_name.stderr[-2000:]
    (project / "mykernel.py").unlink()  # no such module at all: the miss message says the same
    missing = _run(project, "--sparse-mla-impl", "mykernel.py")
    assert "for the file 'mykernel.py', give the module name 'mykernel'" in missing.stderr, missing.stderr[-2000:]


def test_a_module_without_a_forward_names_the_class_inside_it(project: Path) -> None:
    (project / "mykernel.py").write_text(
        "class MyKernel:\n    def sparse_mla_forward(self, q, kv_cache, indices, **kw):\n        raise AssertionError\n"
    )
    result = _run(project, "--sparse-mla-impl", "mykernel")
    assert result.returncode == 4, result.stderr[-2000:]
    assert "did you mean --sparse-mla-impl=mykernel:MyKernel?" in result.stderr, result.stderr[-2000:]


def test_a_path_a_misspelling_or_a_failing_module_gets_an_error_that_names_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A path to the kernel's file (``./mykernel.py``, an absolute path) is answered with the module
    name and the folder to put on ``PYTHONPATH``; a misspelled module name with the close module
    files of the searched folders; a module whose own code raises while it is imported with the
    exception and the line that raised it (a usage error, not pytest's internal error)."""
    from pytest_sparse_mla.implementations import locate, registry

    (tmp_path / "mykernel.py").write_text(KERNEL.format(name="k"))
    (tmp_path / "mk_broken.py").write_text("import math\nrows = [1][3]\n")
    (tmp_path / "mk_dep.py").write_text("import my_cuda_ext_that_is_not_built\n")
    assert locate.file_name_hint("./mykernel.py") == "for the file './mykernel.py', give the module name 'mykernel'"
    absolute = locate.file_name_hint(str(tmp_path / "mykernel.py"))
    assert absolute is not None and f"PYTHONPATH={tmp_path} pytest ... --sparse-mla-impl mykernel" in absolute
    miss = locate.miss_message("./mykernel.py", builtins=["reference"], entry_points=[], hook_names=[], dirs=[tmp_path])
    assert "found as mykernel.py or mykernel/__init__.py" in miss and "e.g. 'mykernel:implementation'" in miss, miss
    assert locate.close_module_names("mykernal", [tmp_path]) == ["mykernel"]
    assert "(did you mean 'mykernel'?)" in locate.miss_message(
        "mykernal", builtins=["reference"], entry_points=[], hook_names=[], dirs=[tmp_path]
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(pytest.UsageError, match=r"importing module 'mk_broken' raised IndexError: list index out of "
                       rf"range, at {tmp_path}/mk_broken.py:2$"):  # fmt: skip
        registry._import_object("mk_broken")
    dep = rf"No module named 'my_cuda_ext_that_is_not_built', at {tmp_path}/mk_dep.py:1"
    with pytest.raises(pytest.UsageError, match=dep):
        registry._import_object("mk_dep")
