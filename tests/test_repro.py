"""``--sparse-mla-repro-dir``: the scripts fail on a wrong kernel, pass on the reference, and need
neither pytest nor this package when a peer adapter made the call.

Each test runs a small slice of the suites in a fresh pytest session (in this process:
``tests/inner_session.py``), then runs the written ``repro.py`` files in subprocesses, as a
maintainer would.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import inner_session
import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
REFERENCE = "pytest_sparse_mla.implementations:ReferenceImplementation"
ACCURACY = "suites/test_attention_accuracy.py"

#: Runs a script with ``pytest_sparse_mla`` and ``pytest`` made unimportable (the way
#: ``scripts/check_repros.py`` runs the scripts that call a peer directly).
ISOLATED = runpy.run_path(str(ROOT / "scripts" / "check_repros.py"))["ISOLATED"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


@dataclass(frozen=True)
class Run:
    """A suite session's exit status and terminal output."""

    returncode: int
    stdout: str


@pytest.fixture
def _suite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Callable[..., tuple[Run, Path]]:
    """``_suite(impl, *selection)``: the selected suite items against ``impl``, reproducers to
    ``tmp_path / "repro"``; a fresh pytest session in this process (``tests/inner_session.py``)."""

    def run(impl: str, *selection: str) -> tuple[Run, Path]:
        out = tmp_path / "repro"
        args = ["-p", "sparse_mla", *selection, "--sparse-mla-impl", impl,
                "--sparse-mla-device", "cpu", "--sparse-mla-repro-dir", str(out), "-p", "no:xdist",
                "-p", "no:cacheprovider", "-q", "--basetemp", str(tmp_path / "base")]  # fmt: skip
        returncode, output = inner_session.run(args, cwd=ROOT, monkeypatch=monkeypatch, capsys=capsys)
        return Run(returncode, output), out

    return run


def _script(path: Path, *args: str, isolated: bool = False) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-c", ISOLATED, str(path), *args] if isolated else [sys.executable, str(path), *args]
    return subprocess.run(cmd, cwd=path.parent, env=_env(), capture_output=True, text=True, timeout=600)


def test_a_wrong_kernel_gets_a_script_that_fails_on_it_and_passes_on_the_reference(_suite):
    run, out = _suite(
        "kernel_catalogue:sm_scale_x2",
        "suites/test_attention_accuracy.py::test_flashinfer_configurations_match_oracle[fi-decode-h8-k1024]",
    )  # fmt: skip
    assert run.returncode == 1, run.stdout[-3000:]
    index = [json.loads(line) for line in (out / "index.jsonl").read_text().splitlines()]
    assert [e["outcome"] for e in index] == ["failed"]
    scripts = [Path(p) for p in index[0]["scripts"]]
    assert scripts, "a wrong result must give a script"
    assert "sparse-mla reproducers" in run.stdout and str(scripts[0]) in run.stdout  # named in the report
    got = _script(scripts[0])
    assert got.returncode == 1, got.stdout + got.stderr
    assert "DISCREPANCY" in got.stdout and "expected" in got.stdout and "got" in got.stdout
    # Without tests/ on PYTHONPATH the script still finds the kernel where it was recorded.
    bare = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    moved = subprocess.run([sys.executable, str(scripts[0])], cwd=scripts[0].parent, env=bare,
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    assert moved.returncode == 1 and "DISCREPANCY" in moved.stdout, moved.stdout + moved.stderr
    ref = _script(scripts[0], "--impl", REFERENCE)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    assert "OK" in ref.stdout


_SINKLESS_MODULE = '''"""A module selected as the implementation (no class): it drops the sink."""
from pytest_sparse_mla.attention import sparse_mla_forward as _reference


def sparse_mla_forward(q, kv_cache, indices, **kwargs):
    kwargs.pop("attn_sink", None)
    return _reference(q, kv_cache, indices, **kwargs)
'''


def test_a_module_implementation_gets_a_script_that_imports_the_module(_suite, tmp_path, monkeypatch):
    """``--sparse-mla-impl mymodule`` (a module with a module-level ``sparse_mla_forward``): the
    script imports the module by its name, not ``builtins:module``, and names it in its header."""
    (tmp_path / "sinkless_module.py").write_text(_SINKLESS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    run, out = _suite("sinkless_module", f"{ACCURACY}::test_lse_conventions[dsv4-sink-flashinfer-1.0]")
    assert run.returncode == 1, run.stdout[-3000:]
    script = Path(json.loads((out / "index.jsonl").read_text().splitlines()[0])["scripts"][0])
    header = "Implementation: sinkless_module (sinkless_module); this script imports sinkless_module"
    assert header in script.read_text()
    got = _script(script)  # its PYTHONPATH lacks tmp_path: the script finds the module where it was recorded
    assert got.returncode == 1 and "DISCREPANCY" in got.stdout, got.stdout + got.stderr


def test_a_bad_input_the_kernel_accepts_gets_a_script(_suite):
    run, out = _suite(
        "kernel_catalogue:accepts_fp32_q",
        "suites/test_attention_inputs.py::test_bad_input_raises_a_clear_error[q-float32]",
    )  # fmt: skip
    assert run.returncode == 1, run.stdout[-3000:]
    index = [json.loads(line) for line in (out / "index.jsonl").read_text().splitlines()]
    script = Path(index[0]["scripts"][0])
    got = _script(script)
    assert got.returncode == 1 and "expected a TypeError or ValueError naming 'q'" in got.stdout, got.stdout
    ref = _script(script, "--impl", REFERENCE)
    assert ref.returncode == 0 and ref.stdout.startswith("OK: raised TypeError"), ref.stdout


def test_a_passing_test_writes_nothing(_suite):
    run, out = _suite(
        "reference",
        "suites/test_attention_accuracy.py::test_flashinfer_configurations_match_oracle[fi-decode-h8-k1024]",
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:]
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.full_tier  # a CPU peer lane: a pytest process on a peer, then its scripts (about 10 s)
def test_a_peer_script_calls_the_peer_without_pytest_or_this_package(_suite):
    from pytest_sparse_mla.implementations import BUILTINS

    reason = BUILTINS["flashinfer-reference"](None).skip_reason("sparse_mla_forward", "cpu")
    if reason is not None:
        pytest.skip(reason)
    run, out = _suite(
        "flashinfer-reference",
        "suites/test_attention_invariants.py::test_poisoned_rows_never_reach_the_output[nan-e4m3-0x7f-decode-dsv3_2]",
        "suites/test_attention_invariants.py::test_candidate_permutation_invariance[dsv4]",
    )  # fmt: skip
    assert run.returncode == 1, run.stdout[-3000:]
    scripts = [Path(p) for line in (out / "index.jsonl").read_text().splitlines() for p in json.loads(line)["scripts"]]
    assert len(scripts) == 2
    for script in scripts:
        assert "calls flashinfer's" in script.read_text()
        got = _script(script, isolated=True)
        assert got.returncode == 1, got.stdout + got.stderr
        assert "DISCREPANCY" in got.stdout
        ref = _script(script, "--impl", REFERENCE)
        assert ref.returncode == 0, ref.stdout + ref.stderr


@pytest.mark.full_tier  # a CPU peer lane: a pytest process on a peer, then its scripts (about 10 s)
def test_page_split_scripts_call_sglangs_split_and_start_from_poisoned_memory(_suite):
    from pytest_sparse_mla.implementations import BUILTINS

    reason = BUILTINS["sglang-torch"](None).skip_reason("page_split", "cpu")
    if reason is not None:
        pytest.skip(reason)
    run, out = _suite(
        "sglang-torch",
        "suites/test_page_split.py::test_refuses_a_pool_it_cannot_split[page-96]",
        "suites/test_split_buffers.py::test_grown_destination_is_zero_where_no_split_wrote",
    )  # fmt: skip
    assert run.returncode == 1, run.stdout[-3000:]
    scripts = [Path(p) for line in (out / "index.jsonl").read_text().splitlines() for p in json.loads(line)["scripts"]]
    assert len(scripts) >= 2
    for script in scripts:
        assert "_split_kv_pages_to_64 directly" in script.read_text()
        got = _script(script, isolated=True)
        assert got.returncode == 1 and "DISCREPANCY" in got.stdout, got.stdout + got.stderr
        ref = _script(script, "--impl", REFERENCE)
        assert ref.returncode == 0, ref.stdout + ref.stderr


def test_a_repro_dir_below_a_file_is_one_usage_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "sparse_mla", "--sparse-mla-repro-dir", str(blocker / "sub"),
         "--co", "-q", "suites/test_formats.py"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 4, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"{blocker} exists and is not a directory" in run.stderr and "INTERNALERROR" not in run.stdout


def test_a_golden_test_whose_call_is_wrong_gets_a_script_not_a_no_repro(_suite):
    """The golden suite calls ``sparse_mla_forward(**inputs)``: q, kv_cache and indices come as
    keywords. Its wrong call (the sink dropped: 32 of 64 LSE values differ) is judged against the
    oracle like a positional one, and gets a script that fails on the kernel and passes on the
    reference, never a ``NO-REPRO.txt`` that contradicts the test's own failure."""
    run, out = _suite(
        "kernel_catalogue:drops_sink", "suites/test_golden.py::test_attention_golden[decode-c4-flash-tp1-sink]"
    )
    assert run.returncode == 1, run.stdout[-3000:]
    assert not list(out.rglob("NO-REPRO.txt")), [p.read_text() for p in out.rglob("NO-REPRO.txt")]
    scripts = [Path(p) for line in (out / "index.jsonl").read_text().splitlines() for p in json.loads(line)["scripts"]]
    assert len(scripts) == 1, scripts
    got = _script(scripts[0])
    assert got.returncode == 1 and "DISCREPANCY" in got.stdout, got.stdout + got.stderr
    assert _script(scripts[0], "--impl", REFERENCE).returncode == 0


def _reference_call(**changes: object) -> object:
    """One recorded call of the bundled reference on a small DSV4 case, its own result recorded."""
    import dataclasses

    import torch

    from pytest_sparse_mla.attention import sparse_mla_forward
    from pytest_sparse_mla.attention.cases import AttentionCase, CacheCase, make_inputs
    from pytest_sparse_mla.recording import RecordedCall

    inputs = make_inputs(AttentionCase("no-repro", 2, 8, CacheCase(64)), torch.Generator().manual_seed(0))
    kwargs = {"q": inputs.q, "kv_cache": inputs.cache.packed, "indices": inputs.indices, **inputs.kwargs()}
    res = sparse_mla_forward(**kwargs)
    rec = RecordedCall((), kwargs, output=res.output, lse=res.lse)
    return dataclasses.replace(rec, **changes)


def test_no_repro_names_the_failed_comparison_and_how_to_rerun_it(tmp_path):
    """A test none of whose calls is wrong alone (an invariance between two calls): NO-REPRO.txt
    quotes the comparison that failed, says why each call gets no script, gives the rerun command,
    and saves the calls; a call a peer adapter refused (the peer never ran) is said to be that, not
    "within the bound"."""
    import torch

    from pytest_sparse_mla import repro, tolerances

    refused = _reference_call(
        output=None, lse=None, error="Failed: sglang.decode was not run: a lane past topk_length holds 1 << 30"
    )
    failure = "AssertionError: padded vs unpadded: output: not bitwise equal: 3 of 8192 elements differ"
    rerun = "pytest -p sparse_mla 'suites/x.py::test_y' --sparse-mla-impl k --sparse-mla-device cpu"
    kernel = tolerances.DEFAULT_PROFILES["kernel"]
    calls = [_reference_call(), refused]
    written = repro.write_reproducers(
        tmp_path, "suites/x.py::test_y", object(), kernel, "failed", calls=calls, failure=failure, rerun=rerun
    )
    assert written == []
    text = (tmp_path / "test_y" / "NO-REPRO.txt").read_text()
    assert "call 0: its output and LSE lie within the bound of the float64 oracle" in text, text
    assert "call 1: the implementation's own function was never called" in text and "was not run" in text, text
    assert "The comparison that failed (the test's failure):\n  " + failure in text, text
    assert rerun in text and "no call is wrong by itself" not in text, text
    calls = torch.load(tmp_path / "test_y" / "calls.pt", weights_only=False)
    assert [c["error"] is None for c in calls] == [True, False] and calls[0]["output"].shape == (2, 8, 512)


LSE_OFF = """from pytest_sparse_mla.implementations import ReferenceImplementation


class LseOff(ReferenceImplementation):
    \"\"\"The reference with every LSE one natural-log unit too large (outputs right).\"\"\"

    def sparse_mla_forward(self, *args, **kwargs):
        res = super().sparse_mla_forward(*args, **kwargs)
        return res.output, res.lse + 1.0
"""


def test_a_peer_call_wrong_only_in_its_lse_gets_a_script_that_judges_the_lse(tmp_path, monkeypatch):
    """A native script judges a peer's output only (its LSE is in the peer's own convention), so a
    call whose only wrong value is its LSE gets a script that calls the implementation and judges the
    LSE in the protocol's convention: it fails on a kernel whose LSE is off and passes on the
    reference. (On the H100 run of 2026-12-07, 14 such native scripts passed on their peer: 13 of
    sglang-q8kv8-sm90's deployment cases, LSE off by ln 1.25 with outputs within bound, and
    sglang-dsv4-triton's strided-lengths call, 53 of 128 LSE values off.)"""
    import torch

    from pytest_sparse_mla import repro, tolerances
    from pytest_sparse_mla.recording import NativeCall

    (tmp_path / "lse_off_impl.py").write_text(LSE_OFF)
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__("lse_off_impl")  # the writer records where the implementation was imported from
    right = _reference_call()
    peer = NativeCall(source={"module": "lse_off_impl"}, function="LseOff", args=(), kwargs={})
    wrong = _reference_call(lse=right.lse + 1.0, native=[peer])
    written = repro.write_reproducers(
        tmp_path / "repro", "suites/x.py::test_lse", object(), tolerances.DEFAULT_PROFILES["kernel"], "xfailed",
        calls=[wrong], impl_spec="lse_off_impl:LseOff",
    )  # fmt: skip
    assert len(written) == 1
    data = torch.load(written[0] / "inputs.pt", weights_only=False)
    assert "native" not in data and "LseOff directly" not in (written[0] / "repro.py").read_text()
    got = _script(written[0] / "repro.py")
    assert got.returncode == 1 and "lse (natural log)" in got.stdout, got.stdout + got.stderr
    ref = _script(written[0] / "repro.py", "--impl", REFERENCE)
    assert ref.returncode == 0, ref.stdout + ref.stderr


def test_a_call_the_adapter_refused_gets_a_script_not_a_no_repro(_suite):
    """SGLang's PyTorch decode gathers every lane before masking, so the adapter refuses a call whose
    stale lanes hold ``1 << 30`` (``UnsafeForPeer``: the test fails, listed as ``stale-lanes`` in
    ``sglang-torch.txt``). The recorded error is the adapter's refusal, not pytest's ``Failed``: the
    call gets a script (it imports the adapter and exits 1 while the refusal stands, 0 on the
    reference), as the README says, never a ``NO-REPRO.txt`` claiming the call is within the bound
    (26 xfailed ``sglang-torch`` tests of the 2026-12-03 H200 run wrote one)."""
    from pytest_sparse_mla.implementations import BUILTINS

    reason = BUILTINS["sglang-torch"](None).skip_reason("sparse_mla_forward", "cpu")
    if reason is not None:
        pytest.skip(reason)
    run, out = _suite("sglang-torch", f"{ACCURACY}::test_error_classes_are_visible[cf-h64-trunc]")
    assert run.returncode == 1 and "was not run" in run.stdout, run.stdout[-3000:]
    assert not list(out.rglob("NO-REPRO.txt")), [p.read_text() for p in out.rglob("NO-REPRO.txt")]
    scripts = [Path(p) for line in (out / "index.jsonl").read_text().splitlines() for p in json.loads(line)["scripts"]]
    assert len(scripts) == 1, scripts
    got = _script(scripts[0])
    assert got.returncode == 1 and "UnsafeForPeer" in got.stdout, got.stdout + got.stderr
    assert _script(scripts[0], "--impl", REFERENCE).returncode == 0


CHECK_REPROS = ROOT / "scripts" / "check_repros.py"
SCRIPT = '''"""A reproducer stand-in: fails as written, passes with --impl (the reference); {kind}."""
import sys, time
{body}
sys.exit(0 if "--impl" in sys.argv else 1)
'''


def _repro_root(tmp_path: Path) -> Path:
    """``repro-fake/`` with two tests: ``test_fast`` (call0 and call1, each done at once) and
    ``test_slow`` (call0 sleeps a minute)."""
    folder = tmp_path / "repro" / "repro-fake"
    entries = []
    for test, calls in (("test_fast", ("", "")), ("test_slow", ("time.sleep(60)",))):
        scripts = []
        for k, body in enumerate(calls):
            script = folder / test / f"call{k}" / "repro.py"
            script.parent.mkdir(parents=True)
            script.write_text(SCRIPT.format(kind=test, body=body))
            scripts.append(str(script))
        entries.append({"impl": "fake", "nodeid": f"suites/t.py::{test}", "outcome": "xfailed", "scripts": scripts})
    (folder / "index.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
    return folder.parent


def test_the_reproducer_check_runs_every_tests_first_call_first() -> None:
    check_repros = runpy.run_path(str(CHECK_REPROS))
    jobs = [("a", Path("r/t1/call1/repro.py")), ("a", Path("r/t2/call0/repro.py")), ("a", Path("r/t1/call0/repro.py"))]
    assert [str(p) for _, p in check_repros["breadth_first"](jobs)] == [
        "r/t1/call0/repro.py", "r/t2/call0/repro.py", "r/t1/call1/repro.py"
    ]  # fmt: skip


def test_an_interrupted_reproducer_check_writes_what_it_checked(tmp_path: Path) -> None:
    """``timeout -s INT`` ends a long check (``scripts/device_conformance.sh``'s ``REPRO_TIMEOUT``): the
    scripts done are written, the rest counted as not run, and a test with a script not run is not
    reported as lacking a holding one."""
    import signal
    import subprocess
    import time

    root = _repro_root(tmp_path)
    xfail = tmp_path / "xfail"
    xfail.mkdir()
    (xfail / "fake.txt").write_text("suites/t.py::test_fast  # k\nsuites/t.py::test_slow  # k\n")
    out = tmp_path / "check.json"
    proc = subprocess.Popen([sys.executable, str(CHECK_REPROS), str(root), "--jobs", "2", "--json", str(out),
                             "--xfail-dir", str(xfail)], stdout=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 60
    time.sleep(3)  # both fast scripts (two runs each) are done well before this; the slow one sleeps
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    assert proc.returncode == 124
    summary = json.loads(out.read_text())["summary"]
    assert summary["interrupted"] is True and summary["not_run"] == 1, summary
    assert summary["scripts"] == 2 and summary["hold"] == 2
    assert summary["xfail_lines_without_a_holding_script"] == {}, summary


OUT_OF_MEMORY_SCRIPT = '''"""A reproducer stand-in: its peer run says out of memory on its first {n} runs."""
import sys
from pathlib import Path
if "--impl" in sys.argv:
    sys.exit(0)
runs = Path(__file__).with_name("runs")
k = int(runs.read_text()) if runs.exists() else 0
runs.write_text(str(k + 1))
if k < {n}:
    print("DISCREPANCY: raised RuntimeError: Triton Error [CUDA]: out of memory")
else:
    print("DISCREPANCY: no error raised; expected a TypeError or ValueError naming 'q'")
sys.exit(1)
'''


@pytest.mark.parametrize("oom_runs", [1, 3])
def test_a_reproducer_that_runs_out_of_device_memory_is_retried_then_inconclusive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], oom_runs: int
) -> None:
    """Out of device memory is an environment condition (another job's memory on a shared GPU), not the
    discrepancy a reproducer exists to show: the check makes the run again (after
    ``device_health.MEMORY_RETRY_DELAYS``, three tries in all) and holds on the real verdict; when every
    try runs out, the script is inconclusive, never holding, and its xfail line is not reported as
    lacking a holding script."""
    from pytest_sparse_mla import device_health

    folder = tmp_path / "repro" / "repro-fake"
    script = folder / "test_q" / "call0" / "repro.py"
    script.parent.mkdir(parents=True)
    script.write_text(OUT_OF_MEMORY_SCRIPT.format(n=oom_runs))
    entry = {"impl": "fake", "nodeid": "suites/t.py::test_q", "outcome": "xfailed", "scripts": [str(script)]}
    (folder / "index.jsonl").write_text(json.dumps(entry) + "\n")
    xfail = tmp_path / "xfail"
    xfail.mkdir()
    (xfail / "fake.txt").write_text("suites/t.py::test_q  # k\n")
    out = tmp_path / "check.json"
    monkeypatch.setattr(device_health, "MEMORY_RETRY_DELAYS", (0.0, 0.0))
    monkeypatch.setattr(sys, "argv", ["check_repros.py", str(tmp_path / "repro"), "--json", str(out),
                                      "--xfail-dir", str(xfail)])  # fmt: skip
    rc = runpy.run_path(str(CHECK_REPROS))["main"]()
    capsys.readouterr()
    got = json.loads(out.read_text())
    (record,) = got["records"]
    assert (script.parent / "runs").read_text() == str(min(oom_runs + 1, 3))
    if oom_runs == 1:
        assert rc == 0 and record["holds"] and "inconclusive" not in record, record
        assert "naming 'q'" in str(record["peer_says"])
    else:
        assert rc == 1 and not record["holds"] and "peer" in str(record["inconclusive"]), record
        assert got["summary"]["inconclusive"] == 1 and got["summary"]["hold"] == 0
    assert got["summary"]["xfail_lines_without_a_holding_script"] == {}, got["summary"]
