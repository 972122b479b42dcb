"""Self-tests of the golden snapshots (``pytest_sparse_mla.snapshot``, through ``pytest_sparse_mla.snapshots``).

Throwaway projects run through pytester write goldens with ``--snapshot-update`` into their own
golden directory, then change one byte or one float and read the failure. Expected hashes and
base64 payloads are computed here with ``hashlib``/``struct``/``base64`` from bytes written out by
hand, never read back from the extension.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from packaging.version import Version

from pytest_sparse_mla import snapshots
from pytest_sparse_mla.snapshot import session as snapshot_session
from pytest_sparse_mla.snapshots import close, exact

GOLDEN = "golden"
SYRUPY = Version(importlib.metadata.version("syrupy"))


def needs_syrupy(minimum: str, what: str) -> pytest.MarkDecorator:
    """Skip a test of a syrupy feature older releases lack (the goldens themselves need 4.6)."""
    return pytest.mark.skipif(SYRUPY < Version(minimum), reason=f"{what} needs syrupy>={minimum}")


# pytester's inline runs drop the modules they imported afterwards; torch.testing.assert_close
# imports torch.distributed lazily, and importing that twice in one process fails (TORCH_LIBRARY
# registered twice). Import it here, outside any inline run.
torch.testing.assert_close(torch.zeros(1), torch.zeros(1))


@pytest.fixture
def project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A pytester project whose inline runs behave like a top-level run, even on an xdist worker.

    syrupy decides "am I an xdist worker?" from ``PYTEST_XDIST_WORKER`` and keeps its session in a
    module global; both leak into an inline run nested in a worker, so they are isolated here.
    """
    import syrupy

    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    if hasattr(syrupy, "_syrupy"):
        monkeypatch.setattr(syrupy, "_syrupy", syrupy._syrupy)
    return pytester


def run(project: pytest.Pytester, *args: str, golden: str = GOLDEN) -> pytest.RunResult:
    return project.runpytest("-p", "sparse_mla", "--sparse-mla-golden-dir", golden, "-vv", *args)


PACKED_TEST = """
    import os
    import torch
    from pytest_sparse_mla import data
    from pytest_sparse_mla.snapshots import exact

    def test_packed(tensor_snapshot):
        cache = data.make_packed_cache(
            torch.Generator().manual_seed(7), num_pages=4, page_block_size=64, page_stride="padded"
        )
        packed = cache.packed
        if os.environ.get("FLIP_BYTE"):
            # page 2, byte 5*576 + 50: token 5's NoPE code 50, one E4M3 step up (+1 on the code)
            packed[2].view(-1)[5 * 576 + 50] += 1
        torch.save(packed.contiguous(), "packed.pt")
        assert tensor_snapshot(name="packed") == exact(packed)
"""


def test_exact_snapshot_file_holds_shape_dtype_strides_and_hashes(project: pytest.Pytester) -> None:
    project.makepyfile(test_pack=PACKED_TEST)
    run(project, "--snapshot-update").assert_outcomes(passed=1)
    path = project.path / GOLDEN / project.path.name / "test_pack" / "test_packed[packed].tensor.json"
    assert path == snapshots.golden_file(project.path / GOLDEN, project.path / "test_pack.py",
                                         "test_packed", "packed")
    fields = json.loads(path.read_text())
    raw = bytes(torch.load(project.path / "packed.pt").view(-1).tolist())
    assert len(raw) == 4 * 64 * 584
    assert fields["compare"] == "exact"
    assert fields["dtype"] == "torch.uint8"
    assert fields["shape"] == [4, 64, 1, 584]
    assert fields["strides"] == [37_440, 584, 584, 1]  # FlashMLA padded stride at ps=64
    assert fields["nbytes"] == 4 * 64 * 584
    assert fields["sha256"] == hashlib.sha256(raw).hexdigest()
    page = 64 * 584
    assert fields["sha256_dim0"] == [
        hashlib.sha256(raw[i * page : (i + 1) * page]).hexdigest()[:16] for i in range(4)
    ]
    # Every field on its own line, so a diff of the file names the field that changed.
    assert '  "sha256": "' + fields["sha256"] + '",' in path.read_text().splitlines()


def test_one_ulp_change_in_a_packed_byte_fails_with_a_readable_diff(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    project.makepyfile(test_pack=PACKED_TEST)
    run(project, "--snapshot-update").assert_outcomes(passed=1)
    golden_hash = hashlib.sha256(bytes(torch.load(project.path / "packed.pt").view(-1).tolist()))
    monkeypatch.setenv("FLIP_BYTE", "1")
    result = run(project)
    result.assert_outcomes(failed=1)
    flipped = hashlib.sha256(bytes(torch.load(project.path / "packed.pt").view(-1).tolist()))
    result.stdout.fnmatch_lines(
        [
            "*bytes differ in 1 of 4 slices along dim 0 (index 2)",
            f'*-   "sha256": "{golden_hash.hexdigest()}",',
            f'*+   "sha256": "{flipped.hexdigest()}",',
            "*1 snapshot failed.*",
        ]
    )
    assert "values" not in result.stdout.str()  # the diff carries no base64 noise


FLOAT_TEST = """
    import os
    import torch
    from pytest_sparse_mla.snapshots import close

    def test_output(tensor_snapshot):
        out = torch.full((2, 3, 4), 0.25, dtype=torch.float32)
        out[1, 2, 3] += float(os.environ.get("DELTA", "0"))
        assert tensor_snapshot(name="output") == close(out, atol=1e-3, rtol=1e-2)
"""


def test_float_snapshot_stores_values_as_base64_of_raw_bytes(project: pytest.Pytester) -> None:
    project.makepyfile(test_float=FLOAT_TEST)
    run(project, "--snapshot-update").assert_outcomes(passed=1)
    path = snapshots.golden_file(project.path / GOLDEN, project.path / "test_float.py",
                                 "test_output", "output")
    fields = json.loads(path.read_text())
    raw = struct.pack("<24f", *([0.25] * 24))
    assert fields["compare"] == "close"
    assert (fields["dtype"], fields["shape"], fields["strides"]) == ("torch.float32", [2, 3, 4], [12, 4, 1])
    assert base64.b64decode("".join(fields["values"])) == raw
    assert fields["sha256"] == hashlib.sha256(raw).hexdigest()
    assert fields["stats"] == {"min": 0.25, "max": 0.25, "mean": 0.25, "rms": 0.25,
                               "nan": 0, "posinf": 0, "neginf": 0}
    record = snapshots.read_tensor_snapshot(path)
    assert record.values.dtype == torch.float32
    assert torch.equal(record.values, torch.full((2, 3, 4), 0.25))


@pytest.mark.parametrize("delta", ["0.003", "-0.003"])  # |delta| <= 1e-3 + 1e-2 * 0.25 = 3.5e-3
def test_float_change_within_tolerance_passes_and_keeps_the_golden(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, delta: str
) -> None:
    project.makepyfile(test_float=FLOAT_TEST)
    run(project, "--snapshot-update").assert_outcomes(passed=1)
    path = snapshots.golden_file(project.path / GOLDEN, project.path / "test_float.py",
                                 "test_output", "output")
    before = path.read_bytes()
    monkeypatch.setenv("DELTA", delta)
    run(project).assert_outcomes(passed=1)
    run(project, "--snapshot-update").assert_outcomes(passed=1)
    assert path.read_bytes() == before  # within tolerance: --snapshot-update does not churn it


def test_float_change_outside_tolerance_fails_with_max_errors_and_where(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    project.makepyfile(test_float=FLOAT_TEST)
    run(project, "--snapshot-update").assert_outcomes(passed=1)
    monkeypatch.setenv("DELTA", "0.25")  # 0.25 -> 0.5 at [1, 2, 3]
    result = run(project)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*tensor values differ from the golden beyond atol=0.001, rtol=0.01:",
            "*Mismatched elements: 1 / 24 *",
            "*Greatest absolute difference: 0.25 at index (1, 2, 3) (up to 0.001 allowed)",
            "*Greatest relative difference: 1.0 at index (1, 2, 3) (up to 0.01 allowed)",
            "*at index (1, 2, 3) (greatest absolute difference): golden 0.25, received 0.5",
        ]
    )


def test_wrong_values_are_hard_errors() -> None:
    with pytest.raises(TypeError, match=r"close\(tensor\): dtype torch.int32 is not floating point"):
        close(torch.zeros(2, dtype=torch.int32), atol=0.0, rtol=0.0)
    with pytest.raises(ValueError, match=r"close\(atol=-1.0\): expected a finite value >= 0"):
        close(torch.zeros(2), atol=-1.0, rtol=0.0)
    with pytest.raises(ValueError, match=r"close\(rtol=nan\)"):
        close(torch.zeros(2), atol=0.0, rtol=float("nan"))
    with pytest.raises(TypeError, match=r"exact\(tensor=list\): expected a torch.Tensor"):
        exact([1, 2])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected exact.tensor. or close"):
        snapshots.TensorSnapshotExtension().serialize(torch.zeros(2))


def test_a_bare_tensor_or_a_switched_mode_fails_the_assertion(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    project.makepyfile(
        """
        import os, torch
        from pytest_sparse_mla.snapshots import close, exact

        def test_bare(tensor_snapshot):
            assert tensor_snapshot == torch.zeros(3)

        def test_mode(tensor_snapshot):
            x = torch.zeros(3)
            assert tensor_snapshot == (close(x, atol=0.0, rtol=0.0) if os.environ.get("CLOSE") else exact(x))
        """
    )
    result = run(project, "--snapshot-update")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["*expected exact(tensor) or close(tensor, atol=..., rtol=...)*"])
    monkeypatch.setenv("CLOSE", "1")
    result = run(project, "-k", "test_mode")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*compare mode differs: golden 'exact', received 'close'*"])


def test_snapshot_update_is_refused_with_several_xdist_workers(project: pytest.Pytester) -> None:
    project.makepyfile(test_float=FLOAT_TEST)
    result = run(project, "-n", "2", "--snapshot-update")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*--snapshot-update with 2 pytest-xdist workers: syrupy does not coordinate snapshot "
         "writes between workers (syrupy #1237)*"]
    )
    assert not (project.path / GOLDEN).exists()


@pytest.mark.parametrize(
    "config, expected",
    [
        (SimpleNamespace(workerinput={"workercount": 3}, option=SimpleNamespace()), 3),
        (SimpleNamespace(option=SimpleNamespace(numprocesses=4, dist="load", tx=["popen"] * 4)), 4),
        (SimpleNamespace(option=SimpleNamespace(numprocesses=None, dist="load", tx=["2*popen"])), 2),
        (SimpleNamespace(option=SimpleNamespace(numprocesses="auto", dist="no", tx=[])), 2),
        (SimpleNamespace(option=SimpleNamespace(numprocesses=0, dist="no", tx=[])), 1),
        (SimpleNamespace(option=SimpleNamespace(numprocesses=1, dist="load", tx=["popen"])), 1),
        (SimpleNamespace(option=SimpleNamespace()), 1),  # xdist not installed
    ],
)
def test_xdist_worker_count(config: SimpleNamespace, expected: int) -> None:
    assert snapshot_session.xdist_worker_count(config) == expected  # type: ignore[arg-type]


def test_snapshot_update_is_refused_on_a_worker_of_several() -> None:
    worker = SimpleNamespace(
        workerinput={"workercount": 2}, option=SimpleNamespace(update_snapshots=True)
    )
    with pytest.raises(pytest.UsageError, match="--snapshot-update with 2 pytest-xdist workers"):
        snapshot_session.configure(worker)  # type: ignore[arg-type]


TWO_TESTS = """
    import torch
    from pytest_sparse_mla.snapshots import exact

    def test_kept(tensor_snapshot):
        assert tensor_snapshot == exact(torch.arange(6, dtype=torch.int32))

    def test_dropped(tensor_snapshot):
        assert tensor_snapshot == exact(torch.arange(3, dtype=torch.int32))
"""


@needs_syrupy("4.7.2", "unused detection outside __snapshots__ directories")
def test_unused_snapshots_are_reported_and_deleted_on_update(project: pytest.Pytester) -> None:
    project.makepyfile(test_two=TWO_TESTS)
    run(project, "--snapshot-update").assert_outcomes(passed=2)
    module_dir = project.path / GOLDEN / project.path.name / "test_two"
    assert sorted(p.name for p in module_dir.iterdir()) == [
        "test_dropped.tensor.json", "test_kept.tensor.json"
    ]
    project.makepyfile(test_two=TWO_TESTS.split("    def test_dropped")[0])
    result = run(project)
    assert result.ret == 1  # syrupy fails a run that leaves snapshots unused
    result.stdout.fnmatch_lines(["*1 snapshot passed. 1 snapshot unused.*"])
    result = run(project, "--snapshot-update")
    result.stdout.fnmatch_lines(["*1 unused snapshot deleted.*", "*Deleted test_dropped (*)"])
    assert [p.name for p in module_dir.iterdir()] == ["test_kept.tensor.json"]


SAME_NAME = """\
import pytest, torch
from pytest_sparse_mla.snapshots import exact

def test_x(tensor_snapshot):
    if {skip}:
        pytest.skip("deselected in this run")
    assert tensor_snapshot == exact(torch.full((2,), {value}, dtype=torch.int32))
"""


@needs_syrupy("7.0", "asking the extension which files a test owns (matches_test_location)")
def test_same_named_modules_of_two_suites_never_claim_each_others_files(project: pytest.Pytester) -> None:
    for suite, value in (("suite_a", 1), ("suite_b", 2)):
        project.mkpydir(suite)
        (project.path / suite / "test_same.py").write_text(
            SAME_NAME.replace("{skip}", "False").replace("{value}", str(value))
        )
    run(project, "--snapshot-update").assert_outcomes(passed=2)
    file_a = project.path / GOLDEN / "suite_a" / "test_same" / "test_x.tensor.json"
    file_b = project.path / GOLDEN / "suite_b" / "test_same" / "test_x.tensor.json"
    assert json.loads(file_a.read_text())["sha256"] == hashlib.sha256(struct.pack("<2i", 1, 1)).hexdigest()
    assert json.loads(file_b.read_text())["sha256"] == hashlib.sha256(struct.pack("<2i", 2, 2)).hexdigest()
    # suite_a drops test_x; suite_b's test_x (same module name, same test name) is skipped. A
    # skipped test protects its own golden, never suite_a's orphan.
    (project.path / "suite_a" / "test_same.py").write_text("def test_other():\n    pass\n")
    (project.path / "suite_b" / "test_same.py").write_text(
        SAME_NAME.replace("{skip}", "True").replace("{value}", "2")
    )
    result = run(project, "--snapshot-update")
    result.stdout.fnmatch_lines(["*1 unused snapshot deleted.*", "*Deleted test_x (golden/suite_a/test_same/*"])
    assert not file_a.exists() and file_b.exists()


def test_golden_dir_option_and_ini_point_elsewhere(project: pytest.Pytester) -> None:
    project.makepyfile(test_float=FLOAT_TEST)
    run(project, "--snapshot-update", golden="first").assert_outcomes(passed=1)
    result = run(project, golden="second")  # no such directory: refused before any test runs
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--sparse-mla-golden-dir='second': no such directory*--snapshot-update*"])
    (project.path / "second").mkdir()
    result = run(project, golden="second")  # an empty golden root
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*Snapshot 'test_output[[]output[]]' does not exist!*"])
    shutil.copytree(project.path / "first", project.path / "second", dirs_exist_ok=True)
    result = run(project, golden="second")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"sparse-mla: goldens: {project.path / 'second'}"])
    project.makeini("[pytest]\nsparse_mla_golden_dir = first\n")
    result = project.runpytest("-p", "sparse_mla")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"sparse-mla: goldens: {project.path / 'first'}"])
    # An ini path is relative to the ini file, wherever pytest is started (pytest's rule).
    (project.path / "elsewhere").mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(project.path / "elsewhere")
        result = project.runpytest("-p", "sparse_mla", str(project.path / "test_float.py"))
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"sparse-mla: goldens: {project.path / 'first'}"])


def test_tensor_snapshot_skips_without_syrupy(project: pytest.Pytester) -> None:
    project.makepyfile("def test_x(tensor_snapshot):\n    raise AssertionError('must not run')\n")
    result = project.runpytest("-p", "sparse_mla", "-p", "no:syrupy", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*golden snapshots need the syrupy pytest plugin*"])


def test_default_golden_dir_is_the_checkouts_golden() -> None:
    checkout = Path(snapshots.__file__).resolve().parents[1]
    if (checkout / "pyproject.toml").is_file() and (checkout / "golden").is_dir():
        assert snapshots.default_golden_dir() == checkout / "golden"
    else:  # an installed package: the packaged copy
        assert snapshots.default_golden_dir() == checkout / "pytest_sparse_mla" / "golden"


@needs_syrupy("5.5", "unused detection under pytest-xdist (syrupy PR #1132)")
@pytest.mark.full_tier
def test_goldens_under_xdist_are_checked_and_unused_ones_reported(project: pytest.Pytester) -> None:
    project.makepyfile(test_two=TWO_TESTS)
    run(project, "--snapshot-update").assert_outcomes(passed=2)
    project.makepyfile(test_two=TWO_TESTS.split("    def test_dropped")[0])
    result = project.runpytest_subprocess(
        "-p", "sparse_mla", "--sparse-mla-golden-dir", GOLDEN, "-n", "2", "-p", "no:randomly"
    )
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*1 snapshot passed. 1 snapshot unused.*"])


def _no_syrupy(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import syrupy`` fail in subprocess runs, as on an image without syrupy (its pytest
    plugin is blocked with ``-p no:syrupy`` by the callers)."""
    shim = pytester.mkdir("no_syrupy")
    (shim / "syrupy").mkdir()
    (shim / "syrupy" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'syrupy' (simulated)\", name='syrupy')\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(shim))


def test_syrupy_skip_message_names_the_metadata_pin() -> None:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    (pin,) = [d for d in pyproject["project"]["dependencies"] if d.startswith("syrupy")]
    assert snapshot_session.syrupy_requirement() == pin.replace(" ", "")
    reason = snapshot_session.syrupy_missing_reason(ImportError("x"))
    assert reason.startswith(f"golden snapshots need {pin} (pip install '{pin}')")


def test_without_syrupy_golden_tests_skip_with_the_pinned_version(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an image without syrupy: no collection error; the golden suite and any test using
    ``tensor_snapshot`` skip, saying which syrupy to install; the header says so too."""
    _no_syrupy(pytester, monkeypatch)
    pytester.makepyfile(test_x="def test_x(tensor_snapshot):\n    raise AssertionError('must not run')\n")
    pin = snapshot_session.syrupy_requirement()
    # importlib import mode: an installed suite must not put site-packages (the real syrupy) first.
    blocked = ("-p", "sparse_mla", "-p", "no:syrupy", "-p", "no:cacheprovider", "-rs", "--import-mode=importlib")
    suite = pytester.runpytest_subprocess(*blocked, "--pyargs", "pytest_sparse_mla.suites.test_golden")
    suite.assert_outcomes(skipped=1)  # the module itself: no collection error
    suite.stdout.fnmatch_lines(["SKIPPED *test_golden.py*: *syrupy*"])
    result = pytester.runpytest_subprocess(*blocked, "test_x.py")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(
        [f"sparse-mla: goldens: * (syrupy not installed: golden tests skip; need {pin})",
         f"SKIPPED *golden snapshots need {pin} (pip install '{pin}'): *simulated*"]
    )  # fmt: skip
