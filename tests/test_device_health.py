"""A kernel that kills the CUDA context, or never returns, costs one test (``pytest_sparse_mla.device_health``).

This machine has no GPU, so a dead context is simulated: the project's ``conftest.py`` replaces
``device_health.context_fault`` (the check that synchronises CUDA) with one that reports
``CUDA error: an illegal memory access was encountered`` once the fake kernel ran in "crash" mode in
this process, and for every later test of the same process, as a real dead context does. A hang is
a kernel that sleeps past a 1 s limit. ``tests/crash_kernels.py`` holds the real CUDA kernels (an
out-of-bounds read, a spin) that the same runs take on a GPU.

Runs without xdist are in-process (``tests/inner_session.py``); the one ``-n 2`` run is a
subprocess (a worker must really exit).
"""

from __future__ import annotations

import json
import sys
import threading
import types
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import inner_session
import pytest
import torch

from pytest_sparse_mla import device_health, options, recording, repro

FAKE_KERNEL = '''
"""A kernel under test that, on request, "kills the CUDA context" (DEAD, read by the session's fake
health check) or never returns."""
import time

import torch

name = "fake-kernel"
DEAD = False
MODE = {"mode": "ok"}


def sparse_mla_forward(q, kv_cache, indices, **kwargs):
    global DEAD
    if MODE["mode"] == "crash":
        DEAD = True
    elif MODE["mode"] == "hang":
        time.sleep(60)
    return torch.zeros(q.shape[0], q.shape[1], 512, dtype=torch.bfloat16), torch.zeros(q.shape[:2])
'''

CONFTEST = """
import pytest

import fake_kernel
from pytest_sparse_mla import device_health

ILLEGAL = "AcceleratorError: CUDA error: an illegal memory access was encountered"
_saved = []


def pytest_configure(config):
    _saved.append(device_health.context_fault)
    device_health.context_fault = lambda devices=(): ILLEGAL if fake_kernel.DEAD else None


def pytest_unconfigure(config):
    device_health.context_fault = _saved.pop()


@pytest.fixture
def cuda_buffer():
    yield
    if fake_kernel.DEAD:  # a fixture's teardown on the dead context fails too
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
"""

TESTS = """
import pytest
import torch

import fake_kernel


def _call(impl, mode):
    fake_kernel.MODE["mode"] = mode
    q = torch.zeros(2, 4, 576, dtype=torch.bfloat16)
    kv = torch.zeros(3, 64, 584, dtype=torch.uint8)
    idx = torch.zeros(2, 128, dtype=torch.int32)
    return impl.sparse_mla_forward(q, kv, idx, fmt="dsv4", page_block_size=64)


def test_marker(request, sparse_mla_impl, tmp_path_factory):
    mark = request.node.get_closest_marker("timeout")
    text = "none" if mark is None else repr((mark.args, mark.kwargs))
    (tmp_path_factory.getbasetemp().parent / "marker.txt").write_text(text)


@pytest.mark.parametrize("k", range(2))
def test_before(sparse_mla_impl, k):
    _call(sparse_mla_impl, "ok")


def test_crash(sparse_mla_impl, cuda_buffer):
    _call(sparse_mla_impl, "crash")


def test_hang(sparse_mla_impl):
    _call(sparse_mla_impl, "hang")


@pytest.mark.parametrize("k", range(4))
def test_after(sparse_mla_impl, k):
    _call(sparse_mla_impl, "ok")
"""


def _glob(text: str) -> str:
    """``text`` as an ``fnmatch`` pattern that matches it literally (``[``, ``]``, ``*``, ``?``)."""
    return "".join(f"[{c}]" if c in "[]*?" else c for c in text)


CALL = (
    "fake-kernel.sparse_mla_forward(q=[2, 4, 576] bfloat16 cpu, kv_cache=[3, 64, 584] uint8 cpu, "
    "indices=[2, 128] int32 cpu"
)
BASE = ["-p", "sparse_mla", "--sparse-mla-impl", "fake_kernel", "--sparse-mla-device", "cpu", "-p", "no:cacheprovider"]


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(fake_kernel=FAKE_KERNEL, conftest=CONFTEST, test_kernels=TESTS)
    return pytester


def _run(project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, capsys: Any, *args: str) -> pytest.RunResult:
    return inner_session.runpytest(project, *BASE, *args, monkeypatch=monkeypatch, capsys=capsys)


def _junit(path: Path) -> tuple[dict[str, str], list[tuple[str, list[str]]]]:
    root = ET.parse(path).getroot()
    suite = root.find("testsuite") if root.tag == "testsuites" else root
    assert suite is not None
    return dict(suite.attrib), [(tc.get("name", ""), [c.tag for c in tc]) for tc in suite.iter("testcase")]


# --- in process, no xdist --------------------------------------------------------------------------


def test_without_xdist_the_session_stops_at_the_test_that_killed_the_context(project, monkeypatch, capsys):
    out = project.path / "report.json"
    result = _run(project, monkeypatch, capsys, "-k", "not hang", "--junitxml", "junit.xml",
                  "--sparse-mla-report-json", str(out))  # fmt: skip
    result.assert_outcomes(passed=3, failed=1)  # the teardown on the dead context is no second failure
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines([
        "*_ test_crash _*",
        "dead CUDA context after this test: AcceleratorError: CUDA error: an illegal memory access was "
        f"encountered; last kernel call: {_glob(CALL)}, fmt='dsv4', page_block_size=64)",
        "test: test_kernels.py::test_crash",
        "the session stops after this test: every later CUDA call of this process would fail alike",
        "*- teardown after the dead CUDA context -*",
        "*sparse-mla device faults*",
        "test_kernels.py::test_crash: dead CUDA context after this test:*",
        "    the session stopped after this test: 4 of 8 collected tests ran",
        "FAILED test_kernels.py::test_crash - Failed: dead CUDA context*",
        "*Interrupted: sparse-mla: dead CUDA context after this test*",
    ])  # fmt: skip
    assert "INTERNALERROR" not in result.stdout.str()
    attrs, cases = _junit(project.path / "junit.xml")
    assert (attrs["tests"], attrs["failures"], attrs["errors"]) == ("4", "1", "0")
    assert [name for name, tags in cases if tags] == ["test_crash"]
    faults = json.loads(out.read_text())["device_faults"]
    assert [(f["nodeid"], f["kind"], f["worker"]) for f in faults] == [
        ("test_kernels.py::test_crash", "dead-cuda-context", None)
    ]
    assert faults[0]["call"].startswith(CALL) and "4 of 8" in faults[0]["action"]
    # the default limit, scaled to the case: no --timeout, pytest-timeout installed, CPU
    assert (project.path / "marker.txt").read_text() == repr(((device_health.BASE_SECONDS["cpu"],), {}))


def test_a_reproducer_write_that_fails_is_a_warning_not_an_internal_error(project, monkeypatch, capsys):
    def on_the_dead_device(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")  # what the oracle met before

    monkeypatch.setattr(repro, "_expectation", on_the_dead_device)
    result = _run(project, monkeypatch, capsys, "-k", "crash", "--sparse-mla-repro-dir", str(project.path / "r"))
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*- sparse-mla reproducers -*",
        "not written: RuntimeError: CUDA error: an illegal memory access was encountered",
        "*ReproWriteWarning: test_kernels.py::test_crash: no reproducer written (RuntimeError: CUDA error*",
    ])  # fmt: skip
    assert "INTERNALERROR" not in result.stdout.str()


def test_the_reproducer_of_a_dead_context_is_written_from_host_copies(project, monkeypatch, capsys):
    result = _run(project, monkeypatch, capsys, "-k", "crash", "--sparse-mla-repro-dir", str(project.path / "r"))
    result.assert_outcomes(failed=1)
    data = torch.load(project.path / "r" / "test_crash" / "call0" / "inputs.pt", weights_only=True)
    assert data["recorded"] == [
        "raised AcceleratorError: CUDA error: an illegal memory access was encountered (the CUDA context was dead "
        "after this call); the call lies inside the envelope and must succeed"
    ]
    assert data["device"] == "cpu" and all(t.device.type == "cpu" for t in data["args"])


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="SIGALRM needs the main thread")
def test_a_hang_costs_one_test_and_names_the_call_that_did_not_return(project, monkeypatch, capsys):
    result = _run(project, monkeypatch, capsys, "-k", "not crash", "--sparse-mla-timeout", "1",
                  "--timeout-method", "signal")  # fmt: skip
    result.assert_outcomes(passed=7, failed=1)
    result.stdout.fnmatch_lines([
        "E *Failed: Timeout (>1.0s) from pytest-timeout. The kernel call that did not return: "
        f"{_glob(CALL)}, fmt='dsv4', page_block_size=64), not returned after 1.* s",
        "test_kernels.py::test_hang: Timeout (>1.0s) from pytest-timeout.*",
        "    the test failed in place (pytest-timeout, signal method)",
    ])  # fmt: skip
    assert (project.path / "marker.txt").read_text() == repr(((1.0,), {}))


def test_sparse_mla_timeout_needs_pytest_timeout(project, monkeypatch, capsys):
    result = _run(project, monkeypatch, capsys, "-p", "no:timeout", "--sparse-mla-timeout", "5", "-k", "marker")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "--sparse-mla-timeout needs pytest-timeout" in result.stdout.str() + result.stderr.str()


# --- a subprocess under pytest-xdist -----------------------------------------------------------------


@pytest.mark.full_tier
@pytest.mark.sparse_mla_selftest_long(seconds=20)
def test_under_xdist_a_crash_and_a_hang_each_cost_one_test_and_a_worker(project):
    report = project.path / "report.json"
    result = project.runpytest_subprocess(
        *BASE, "-n", "2", "--sparse-mla-timeout", "1", "--timeout-method", "thread", "--junitxml", "junit.xml",
        "--sparse-mla-report-json", str(report),
    )  # fmt: skip
    result.assert_outcomes(passed=7, failed=2)
    text = result.stdout.str()
    assert text.count("replacing crashed worker") == 2 and "INTERNALERROR" not in text
    result.stdout.fnmatch_lines_random([
        "this xdist worker exits now and pytest-xdist starts a fresh one for the remaining tests",
        "Timeout (>1s) from pytest-timeout: the kernel call that did not return: "
        f"{_glob(CALL)}*not returned after 1.* s",
        "this xdist worker exits (pytest-timeout, thread method) and pytest-xdist starts a fresh one",
        "main thread's stack when the time ran out (innermost last):",
        "FAILED test_kernels.py::test_crash - Failed: dead CUDA context*",
        "FAILED test_kernels.py::test_hang - Failed: Timeout (>1s)*",
    ])  # fmt: skip
    attrs, cases = _junit(project.path / "junit.xml")
    assert (attrs["tests"], attrs["failures"], attrs["errors"]) == ("9", "2", "0")
    assert len({name for name, _ in cases}) == len(cases) == 9  # each test once
    assert sorted(name for name, tags in cases if tags) == ["test_crash", "test_hang"]
    faults = json.loads(report.read_text())["device_faults"]
    assert sorted((f["nodeid"].split("::")[1], f["kind"]) for f in faults) == [
        ("test_crash", "dead-cuda-context"), ("test_hang", "timeout")
    ]  # fmt: skip
    assert all(f["action"].startswith(f"worker {f['worker']} exited") for f in faults)


# --- the pieces -------------------------------------------------------------------------------------------


def test_the_call_summary_reads_shapes_dtypes_devices_and_scalars_only() -> None:
    q = torch.zeros(2, 4, 576, dtype=torch.bfloat16)
    idx = torch.zeros(2, 8, dtype=torch.int32)
    text = device_health.call_summary(
        "sparse_mla_forward", (q, q, idx), {"fmt": "dsv4", "attn_sink": None, "topk_length": [1, 2], "x": "y" * 50}
    )
    assert text == (
        "q=[2, 4, 576] bfloat16 cpu, kv_cache=[2, 4, 576] bfloat16 cpu, indices=[2, 8] int32 cpu, fmt='dsv4', "
        f"topk_length=list of 2, x={repr('y' * 50)[:37]}..."
    )
    call = device_health.begin_call("k", "page_split", (q,), {})
    assert device_health.last_call() is call and "not returned" in call.describe()
    device_health.end_call(call)
    assert call.describe().startswith("k.page_split(kv_cache=[2, 4, 576] bfloat16 cpu), returned to Python")
    device_health.begin_test()
    assert device_health.last_call() is None


def test_the_context_check_touches_cuda_only_where_the_process_initialised_it(monkeypatch) -> None:
    assert device_health.context_fault() is None  # torch imported, CUDA never initialised here
    assert not torch.cuda.is_initialized()

    class AcceleratorError(RuntimeError):
        pass

    calls: list[Any] = []

    def synchronize(device: Any = None) -> None:
        calls.append(device)
        raise state["error"]

    state: dict[str, Exception] = {}
    cuda = types.SimpleNamespace(is_initialized=lambda: True, synchronize=synchronize)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    state["error"] = AcceleratorError("CUDA error: an illegal memory access was encountered\nSearch for ...")
    assert device_health.context_fault((1,)) == (
        "AcceleratorError: CUDA error: an illegal memory access was encountered\nSearch for ..."
    )
    state["error"] = RuntimeError("something else")
    assert device_health.context_fault() is None

    def once(device: Any = None) -> None:  # an error reported once, not sticky: the context works
        calls.append(device)
        if len(calls) == 1:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    calls.clear()
    cuda.synchronize = once
    assert device_health.context_fault() is None and len(calls) == 2
    cuda.is_initialized = lambda: False
    calls.clear()
    assert device_health.context_fault() is None and calls == []


@pytest.mark.parametrize(
    "text, dead",
    [
        ("AcceleratorError: CUDA error: an illegal memory access was encountered", True),
        ("RuntimeError: CUDA error: device-side assert triggered", True),
        ("RuntimeError: CUDA error: unspecified launch failure", True),
        ("RuntimeError: Triton Error [CUDA]: an illegal memory access was encountered", True),
        ("ValueError: indices out of range", False),
    ],
)
def test_which_errors_mean_a_dead_context(text: str, dead: bool) -> None:
    assert device_health.is_context_error(text) is dead


def test_the_default_limit_scales_with_the_device_and_the_case() -> None:
    def item(large: bool = False, hypothesis: bool = False) -> Any:
        case = types.SimpleNamespace(large=large)
        return types.SimpleNamespace(callspec=types.SimpleNamespace(params={"case": case}),
                                     obj=types.SimpleNamespace(is_hypothesis_test=hypothesis))  # fmt: skip

    cuda, cpu = device_health.BASE_SECONDS["cuda"], device_health.BASE_SECONDS["cpu"]
    assert device_health.default_timeout(item(), "cuda") == cuda
    assert device_health.default_timeout(item(), "cpu") == cpu
    assert device_health.default_timeout(item(large=True), "cuda") == cuda * device_health.LARGE_CASE_FACTOR
    assert device_health.default_timeout(item(hypothesis=True), "cuda") == cuda * device_health.HYPOTHESIS_FACTOR


@pytest.mark.parametrize("value, expected", [(None, None), ("auto", None), ("0", 0.0), ("2.5", 2.5)])
def test_parse_timeout(value: str | None, expected: float | None) -> None:
    assert options.parse_timeout(value) == expected


@pytest.mark.parametrize("value", ["-1", "soon", "nan"])
def test_parse_timeout_refuses(value: str) -> None:
    with pytest.raises(pytest.UsageError, match="--sparse-mla-timeout"):
        options.parse_timeout(value)


def test_a_worker_that_ended_itself_is_not_a_crash_and_does_not_use_up_restarts() -> None:
    dsession = types.SimpleNamespace(_max_worker_restart=8)
    config: Any = types.SimpleNamespace(
        stash=pytest.Stash(),
        pluginmanager=types.SimpleNamespace(getplugin=lambda name: dsession if name == "dsession" else None),
        getoption=lambda name, default=None: default,
    )
    node = types.SimpleNamespace(gateway=types.SimpleNamespace(id="gw1"))
    fault = {"kind": "dead-cuda-context", "headline": "h", "message": "m", "exits": True, "call": "c"}
    call = pytest.TestReport("t.py::a", ("t.py", 0, "a"), {}, "failed", "m", "call",
                             user_properties=[("keep", 1), (device_health.FAULT_KEY, fault)])  # fmt: skip
    call.node = node  # type: ignore[attr-defined]
    device_health.observe(config, call)
    crash = pytest.TestReport("t.py::a", ("t.py", None, "t.py"), {}, "failed", "worker 'gw1' crashed", "???")
    crash.node = node  # type: ignore[attr-defined]
    other = pytest.TestReport("t.py::b", ("t.py", None, "t.py"), {}, "failed", "worker 'gw1' crashed", "???")
    other.node = node  # type: ignore[attr-defined]
    assert not device_health.absorb_crash_report(config, "t.py::b", other)  # another test: a real crash
    assert device_health.absorb_crash_report(config, "t.py::a", crash)
    assert (crash.outcome, crash.when, crash.longrepr, crash.user_properties) == ("passed", "teardown", None,
                                                                                 [("keep", 1)])  # fmt: skip
    assert dsession._max_worker_restart == 9
    assert not device_health.absorb_crash_report(config, "t.py::a", crash)  # once
    assert device_health.fault_entries(config)[0]["action"].startswith("worker gw1 exited")


def test_recorded_arguments_are_host_copies_taken_before_the_kernel_runs() -> None:
    x = torch.arange(6.0).reshape(2, 3)[:, 1:]  # a view: storage, offset and strides are kept
    recording.enable(True)
    recording.begin_test()
    try:
        with recording.judged_call((x,), {"y": torch.ones(2)}) as rec:
            x.add_(100)  # the kernel writes into its input
            recording.set_result(rec, x * 2, None)
        (recorded,) = recording.recorded_calls()
    finally:
        recording.enable(False)
        recording.begin_test()
    arg = recorded.args[0]
    assert arg.device.type == "cpu" and arg.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert (arg.storage_offset(), arg.stride(), arg.tolist()) == (1, (3, 1), [[1.0, 2.0], [4.0, 5.0]])
    assert recorded.devices == {"args": ["cpu"], "kwargs": {"y": "cpu"}}
    assert recorded.output.tolist() == [[202.0, 204.0], [208.0, 210.0]]


def test_the_gpu_verification_kernels_break_nothing_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import crash_kernels

    q = torch.zeros(1, 1, 8)
    assert not crash_kernels.triggered(q, {"topk_length": torch.ones(1)})  # CUDA only
    names = {cls.name for cls in (crash_kernels.OutOfBounds, crash_kernels.DeviceAssert, crash_kernels.NeverReturns)}
    assert len(names) == 3
    monkeypatch.setenv(crash_kernels.WHEN, "bogus")
    with pytest.raises(ValueError, match="SPARSE_MLA_CRASH_WHEN"):
        crash_kernels.triggered(q, {})


# --- compute-sanitizer memcheck (pytest_sparse_mla.sanitizer) ---------------------------------------

OOB_TESTS = '''
import os

import pytest
import torch

from pytest_sparse_mla import sanitizer

REPORT = """========= Invalid __global__ read of size 2 bytes
=========     at _tiled_sparse_decode_kernel+0x1c0
=========     by thread (0,0,0) in block (3,0,0)
=========     Address 0x7f0000100000 is out of bounds
=========     and is 1,048,576 bytes after the nearest allocation at 0x7f0000000000 of size 1,048,576 bytes
=========
"""


def _call(impl, oob):
    if oob:  # what compute-sanitizer's frontend writes to this process's log during the kernel
        with open(sanitizer.log_path(), "a") as f:
            f.write(REPORT)
    q = torch.zeros(2, 4, 576, dtype=torch.bfloat16)
    kv = torch.zeros(3, 64, 584, dtype=torch.uint8)
    idx = torch.zeros(2, 128, dtype=torch.int32)
    return impl.sparse_mla_forward(q, kv, idx, fmt="dsv4", page_block_size=64)


def test_clean_before(sparse_mla_impl):
    _call(sparse_mla_impl, False)


def test_reads_out_of_bounds(sparse_mla_impl):
    _call(sparse_mla_impl, True)


@pytest.mark.xfail(reason="a known wrong result, not an out-of-bounds access")
def test_xfailed_and_out_of_bounds(sparse_mla_impl):
    _call(sparse_mla_impl, True)
    raise AssertionError("wrong result")


@pytest.mark.parametrize("k", range(2))
def test_clean_after(sparse_mla_impl, k):
    _call(sparse_mla_impl, False)
'''


def test_an_access_the_sanitizer_reports_fails_its_own_test_and_the_run_goes_on(pytester, monkeypatch, capsys):
    from pytest_sparse_mla import sanitizer

    pytester.makepyfile(fake_kernel=FAKE_KERNEL, test_oob=OOB_TESTS)
    log = pytester.path / "sanitizer.log"
    monkeypatch.setenv(sanitizer.ENV, str(log))
    log.write_text("========= COMPUTE-SANITIZER\n")
    out = pytester.path / "report.json"
    result = inner_session.runpytest(pytester, *BASE, "--sparse-mla-report-json", str(out),
                                     monkeypatch=monkeypatch, capsys=capsys)  # fmt: skip
    result.assert_outcomes(passed=3, failed=2)
    result.stdout.fnmatch_lines([
        "*_ test_reads_out_of_bounds _*",
        f"compute-sanitizer memcheck: Invalid __global__ read of size 2 bytes; last kernel call: {_glob(CALL)}*",
        "test: test_oob.py::test_reads_out_of_bounds",
        "first access compute-sanitizer reported in this test:",
        "  Invalid __global__ read of size 2 bytes",
        "  at _tiled_sparse_decode_kernel+0x1c0",
        "  by thread (0,0,0) in block (3,0,0)",
        "  Address 0x7f0000100000 is out of bounds",
        "*the CUDA context is still usable: the run goes on in this process",
    ])  # fmt: skip
    faults = json.loads(out.read_text())["device_faults"]
    assert [(f["nodeid"], f["kind"]) for f in faults] == [
        ("test_oob.py::test_reads_out_of_bounds", "sanitizer"),
        ("test_oob.py::test_xfailed_and_out_of_bounds", "sanitizer"),  # never the expected failure
    ]
    # the default per-test limit is scaled for memcheck's slowdown
    assert device_health.default_timeout(types.SimpleNamespace(obj=None), "cuda") == (
        device_health.BASE_SECONDS["cuda"] * sanitizer.TIMEOUT_FACTOR
    )


SANITIZER_LOG = """========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 2 bytes
=========     at _tiled_sparse_decode_kernel+0x1c0
=========     by thread (0,0,0) in block (3,0,0)
=========
========= Invalid __global__ read of size 2 bytes
=========     at _tiled_sparse_decode_kernel+0x1c0
=========     by thread (1,0,0) in block (3,0,0)
=========
========= ERROR SUMMARY: 2 errors
"""


def test_the_conformance_report_says_what_each_sanitizer_log_holds(tmp_path: Path) -> None:
    """``sanitizer.summarize_log`` counts a whole log's memcheck reports and reads its ERROR SUMMARY
    line (hand-written logs of compute-sanitizer's format: two reports; a clean run; a run cut before
    the summary), and ``scripts/conformance_report.py`` puts one row per log in the report."""
    import runpy

    from pytest_sparse_mla import conformance, sanitizer

    got = sanitizer.summarize_log(SANITIZER_LOG)
    assert got["reports"] == 2 and got["error_summary"] == 2, got
    assert str(got["first"]).splitlines()[:2] == ["Invalid __global__ read of size 2 bytes",
                                                  "at _tiled_sparse_decode_kernel+0x1c0"], got  # fmt: skip
    clean = "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n"
    assert sanitizer.summarize_log(clean) == {"reports": 0, "error_summary": 0, "first": None}
    assert sanitizer.summarize_log("========= COMPUTE-SANITIZER\n")["error_summary"] is None
    (tmp_path / "sanitizer-wrong.log").write_text(SANITIZER_LOG)
    (tmp_path / "sanitizer-clean.log").write_text(clean)
    report = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "conformance_report.py"),
                            run_name="conformance_report")  # fmt: skip
    doc = report["build"](tmp_path, notes_path=tmp_path / "no-notes.json")
    text = conformance.markdown(doc)
    assert "| `clean` | 0 | 0 | none |" in text, text
    assert "| `wrong` | 2 | 2 | Invalid __global__ read of size 2 bytes; at _tiled_sparse_decode_kernel+0x1c0;" in text
