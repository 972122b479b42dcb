"""One table of built-ins (``catalogue``), and a peer added the way a contributor adds one.

The first tests check the table against what it names: each adapter class exists and carries the
entry's name, each peer ships its xfail file and no xfail file is left without a peer, a CPU lane's
peer runs on a CPU and README's test command installs its wheel.

The last test copies the package, the scripts and ``tests/test_architecture.py`` to a temporary
checkout and makes there exactly the edits CONTRIBUTING.md's "Add a peer" lists: an adapter module,
its xfail file and one entry in ``catalogue.py`` (nothing else differs from this
checkout: the test compares the two trees). A fresh Python process on that copy then sees the peer in
``registry.BUILTINS``, ``options.BUILTIN_NAMES`` and the ``--help`` text, the architecture test's core
(whose pytest check then catches the adapter importing pytest), ``scripts/device_conformance.sh``'s
default list (``LIST=1``), tox's ``peers-gpu`` lane (``scripts/peer_suites.py``), the conformance
report's peers, labels and source line (``scripts/conformance_report.py``, ``conformance``), and
``--sparse-mla-impl`` resolves it in a pytest session.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_sparse_mla import catalogue

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = ROOT / "pytest_sparse_mla"


def test_every_entry_names_an_adapter_class_that_carries_its_name() -> None:
    assert len(set(catalogue.NAMES)) == len(catalogue.NAMES)
    for entry in catalogue.BUILTINS:
        cls = getattr(importlib.import_module(entry.module), entry.attribute)
        assert isinstance(cls, type), entry
        assert cls.name == entry.name, (entry.name, cls.name)


def test_every_peer_ships_its_xfail_file_and_every_xfail_file_has_a_peer() -> None:
    shipped = {p.name for p in (PACKAGE_DIR / "xfail").glob("*.txt")}
    listed = {Path(e.xfail_file).name for e in catalogue.BUILTINS if e.xfail_file is not None}
    assert listed == shipped
    assert set(catalogue.peer_names()) == {Path(name).stem for name in shipped}


def test_a_cpu_lane_runs_on_a_cpu_and_the_test_command_installs_it() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    command = readme[readme.index("<!-- test-command -->") :].split("```")[1]
    lanes = [entry for entry in catalogue.BUILTINS if entry.cpu_lane]
    assert lanes
    for entry in lanes:
        cls = getattr(importlib.import_module(entry.module), entry.attribute)
        assert "cpu" in cls.devices, (entry.name, cls.devices)
        assert entry.wheel is not None and f" {entry.wheel}" in command, (entry.name, entry.wheel)


ADAPTER = '''"""Built-in ``toy-peer``: the bundled reference attention behind a peer's adapter (a test's stand-in)."""

from __future__ import annotations

from typing import Any

from pytest_sparse_mla.envelope import Envelope

__all__ = ["ToyPeerImplementation"]


class ToyPeerImplementation:
    """Built-in ``toy-peer``."""

    name = "toy-peer"
    peer = "the bundled reference, standing in for a new peer's kernel"
    compute_mode = "exact"
    envelope = Envelope()
    devices = ("cpu", "cuda")

    def sparse_mla_forward(self, *args: Any, **kwargs: Any) -> Any:
        from pytest_sparse_mla.attention import sparse_mla_forward

        return sparse_mla_forward(*args, **kwargs)
'''

XFAIL = """# Known discrepancies of toy-peer (none listed yet):
# pytest -p sparse_mla suites --sparse-mla-impl toy-peer --sparse-mla-xfail-file pytest_sparse_mla/xfail/toy-peer.txt
# [toy-lse] convention: a definition without entries
"""

ENTRY = """    Builtin(
        "toy-peer", f"{_HERE}.toy_peer:ToyPeerImplementation", wheel="toy-kernels==1.0",
        source=Source(key="toy_source", label="Toy", line="Toy {}", file=".peers/toy/SOURCE", carried=".peers/toy"),
    ),
"""
ANCHOR = "    # A new built-in is one entry here"

#: Run on the copy: every consumer of the table sees the new peer.
CHECK = r"""
import io, runpy, sys
from contextlib import redirect_stdout
from pathlib import Path

root = Path.cwd()
sys.path[:0] = [str(root), str(root / "tests")]
import pytest_sparse_mla
assert Path(pytest_sparse_mla.__file__).resolve().is_relative_to(root), pytest_sparse_mla.__file__

from pytest_sparse_mla import conformance, options
from pytest_sparse_mla.implementations import BUILTINS, registry

impl = BUILTINS["toy-peer"](None)
assert type(impl).__module__ == "pytest_sparse_mla.implementations.toy_peer", type(impl)
assert list(registry.BUILTINS)[-1] == "toy-peer" and options.BUILTIN_NAMES[-1] == "toy-peer"
assert "toy-peer)" in options.IMPL_FORMS[0], options.IMPL_FORMS[0]

import test_architecture
assert "pytest_sparse_mla.implementations.toy_peer" in test_architecture._core_modules()
assert not test_architecture._pytest_imports("pytest_sparse_mla.implementations.toy_peer")
adapter = root / "pytest_sparse_mla" / "implementations" / "toy_peer.py"
text = adapter.read_text()
adapter.write_text(text + "\nimport pytest\n")
try:
    test_architecture.test_core_modules_name_no_pytest()
except AssertionError as exc:
    assert "pytest_sparse_mla.implementations.toy_peer imports pytest" in str(exc), exc
else:
    raise AssertionError("the architecture test did not check the new adapter")
finally:
    adapter.write_text(text)

report = runpy.run_path(str(root / "scripts" / "conformance_report.py"), run_name="conformance_report")
assert report["PEERS"][-1] == "toy-peer", report["PEERS"]
assert report["declarations"]()["toy-peer"]["peer"] == impl.peer
assert report["_VERSIONS"]["toy-peer"] == ("Toy", "toy_source")
(line,) = conformance._peers_line({"toy_source": ["toy/kernels 0123abc"]})
assert line.endswith("; Toy toy/kernels 0123abc."), line

lane = runpy.run_path(str(root / "scripts" / "peer_suites.py"), run_name="peer_suites")
(command,) = [c for c in lane["commands"](None, []) if "toy-peer" in c]
assert Path(command[command.index("--sparse-mla-xfail-file") + 1]).is_file(), command
out = io.StringIO()
with redirect_stdout(out):
    from pytest_sparse_mla import catalogue
    catalogue.main(["carried"]); catalogue.main(["wheels"])
assert {".peers/toy", "toy-kernels==1.0"} <= set(out.getvalue().split()), out.getvalue()

import pytest
test = root / "test_toy.py"
test.write_text(
    "def test_the_session_runs_the_new_peer(sparse_mla_impl):\n"
    "    assert sparse_mla_impl.name == 'toy-peer'\n"
    "    assert 'pytest_sparse_mla.implementations.toy_peer.ToyPeerImplementation' in repr(sparse_mla_impl)\n"
)
code = pytest.main([str(test), "-p", "sparse_mla", "--sparse-mla-impl", "toy-peer", "-p", "no:cacheprovider",
                    "-p", "no:xdist", "-p", "no:randomly", "-q"])
assert code == 0, code
print("toy-peer seen everywhere")
"""


def _tree(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


@pytest.mark.full_tier
@pytest.mark.sparse_mla_selftest_long(seconds=15)
def test_a_new_peer_is_an_adapter_its_xfail_file_and_one_entry(tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(PACKAGE_DIR, checkout / "pytest_sparse_mla", ignore=ignore)
    shutil.copytree(ROOT / "scripts", checkout / "scripts", ignore=ignore)
    (checkout / "tests").mkdir()
    shutil.copy2(ROOT / "tests" / "test_architecture.py", checkout / "tests")
    before = _tree(checkout)

    # the contributor's three edits (CONTRIBUTING.md, "Add a peer")
    (checkout / "pytest_sparse_mla" / "implementations" / "toy_peer.py").write_text(ADAPTER)
    (checkout / "pytest_sparse_mla" / "xfail" / "toy-peer.txt").write_text(XFAIL)
    table = checkout / "pytest_sparse_mla" / "catalogue.py"
    text = table.read_text()
    assert text.count(ANCHOR) == 1
    table.write_text(text.replace(ANCHOR, ENTRY + ANCHOR))

    after = _tree(checkout)
    assert {k for k in after if before.get(k) != after[k]} | (set(before) - set(after)) == {
        "pytest_sparse_mla/implementations/toy_peer.py",
        "pytest_sparse_mla/xfail/toy-peer.txt",
        "pytest_sparse_mla/catalogue.py",
    }

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")])),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTEST_XDIST_WORKER", None)
    listed = subprocess.run(
        ["bash", "scripts/device_conformance.sh"], cwd=checkout, env={**env, "LIST": "1"},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split() == ["reference", *catalogue.peer_names(), "toy-peer"], listed.stdout
    run = subprocess.run(
        [sys.executable, "-c", CHECK], cwd=checkout, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "toy-peer seen everywhere" in run.stdout
