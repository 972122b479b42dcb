"""Out of device memory is an environment condition, not a verdict (``device_health.with_memory_retries``,
``OutOfDeviceMemory``, the search's ``spent["out-of-memory"]``).

On a GPU that several xdist workers share, one worker's allocation can fail because the others hold
cached memory: on the H100 of 2026-12-07 four parallel conformance runs (16 workers) made 121 tests of
four implementations fail with "CUDA out of memory" and the search report those errors as discrepancies. This
machine has no GPU: the kernels here raise ``torch.OutOfMemoryError`` (and the runtime's and Triton's
texts) themselves.
"""

from __future__ import annotations

import json
from typing import Any

import inner_session
import pytest
import torch

from pytest_sparse_mla import device_health


@pytest.fixture(autouse=True)
def _no_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_health, "MEMORY_RETRY_DELAYS", (0.0, 0.0))


@pytest.mark.parametrize(
    ("exc", "oom"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.12 GiB."), True),
        (RuntimeError("CUDA error: out of memory\nSearch for `cudaErrorMemoryAllocation'"), True),
        (RuntimeError("Triton Error [CUDA]: out of memory"), True),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
        (ValueError("indices: expected int32, got int64"), False),
        (None, False),
    ],
)
def test_which_errors_mean_out_of_device_memory(exc: BaseException | None, oom: bool) -> None:
    assert device_health.is_out_of_memory(exc) is oom


def test_a_call_that_ran_out_of_memory_once_is_made_again() -> None:
    tries: list[int] = []

    def call() -> str:
        tries.append(1)
        if len(tries) < 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB.")
        return "result"

    assert device_health.with_memory_retries(call, "k.sparse_mla_forward") == "result" and len(tries) == 3


def test_a_call_out_of_memory_on_every_try_is_an_environment_failure_and_other_errors_pass_unchanged() -> None:
    def oom() -> None:
        raise RuntimeError("CUDA error: out of memory")

    with pytest.raises(device_health.OutOfDeviceMemory, match=r"k\.sparse_mla_forward failed on all 3 tries") as info:
        device_health.with_memory_retries(oom, "k.sparse_mla_forward")
    assert "not a verdict on the kernel" in str(info.value) and "device memory unknown" in str(info.value)

    def wrong() -> None:
        raise ValueError("q: expected bfloat16")

    with pytest.raises(ValueError, match="q: expected bfloat16"):
        device_health.with_memory_retries(wrong, "k.sparse_mla_forward")


KERNEL = '''
import torch

name = "oom-kernel"
LEFT = {"transient": 0}


def sparse_mla_forward(q, kv_cache, indices, **kwargs):
    if kwargs.get("sm_scale") == 0.5:  # always out of memory
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 750.00 MiB.")
    if LEFT["transient"] > 0:
        LEFT["transient"] -= 1
        raise RuntimeError("Triton Error [CUDA]: out of memory")
    return torch.zeros(q.shape[0], q.shape[1], 512, dtype=torch.bfloat16), torch.zeros(q.shape[:2])
'''

TESTS = '''
import torch

import oom_kernel


def _call(impl, sm_scale):
    q = torch.zeros(2, 4, 576, dtype=torch.bfloat16)
    kv = torch.zeros(3, 64, 584, dtype=torch.uint8)
    idx = torch.zeros(2, 128, dtype=torch.int32)
    return impl.sparse_mla_forward(q, kv, idx, fmt="dsv4", page_block_size=64, sm_scale=sm_scale)


def test_transient(sparse_mla_impl):
    oom_kernel.LEFT["transient"] = 2
    _call(sparse_mla_impl, 0.1)


def test_always(sparse_mla_impl):
    _call(sparse_mla_impl, 0.5)
'''


def test_a_test_out_of_memory_fails_as_an_environment_fault_never_as_an_expected_failure(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    pytester.makepyfile(oom_kernel=KERNEL, test_oom=TESTS)
    xfail = pytester.path / "xfail.txt"
    xfail.write_text("# [k] bug: a listed test\ntest_oom.py::test_always  # k\n")
    report = pytester.path / "report.json"
    result = inner_session.runpytest(
        pytester, "-p", "sparse_mla", "--sparse-mla-impl", "oom_kernel", "--sparse-mla-device", "cpu",
        "-p", "no:cacheprovider", "--sparse-mla-xfail-file", str(xfail), "--sparse-mla-report-json", str(report),
        monkeypatch=monkeypatch, capsys=capsys,
    )  # fmt: skip
    result.assert_outcomes(passed=1, failed=1)  # the listed test is not xfailed: the kernel was never judged
    result.stdout.fnmatch_lines(["*out of device memory: oom-kernel.sparse_mla_forward failed on all 3 tries*"])
    faults = json.loads(report.read_text())["device_faults"]
    assert [(f["nodeid"], f["kind"]) for f in faults] == [("test_oom.py::test_always", "out-of-memory")]
    assert "environment condition" in faults[0]["action"]


def test_the_search_counts_a_call_out_of_memory_as_not_made() -> None:
    from pytest_sparse_mla import search_run

    run = search_run.SearchRun(4, None, 0, lambda *a: None)

    def prop(call: Any) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 18.00 MiB.")

    from pytest_sparse_mla import covering
    from pytest_sparse_mla.implementations.builtin import ReferenceImplementation

    call = next(iter(covering.schedule(ReferenceImplementation.envelope, "cpu")))
    assert run._try(prop, call) is None  # no failure to shrink or report
    assert run.spent["out-of-memory"] == 1 and not run.found


def test_a_search_whose_calls_all_ran_out_of_memory_fails_as_the_environment_never_passes(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """A kernel that raises out of memory on every call must not pass the search by having no call
    judged: the run ends with ``OutOfDeviceMemory`` naming the calls it could not judge."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "oom_always.py").write_text(
        "import torch\n\nname = 'oom-always'\n\n\ndef sparse_mla_forward(q, kv_cache, indices, **kwargs):\n"
        "    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB.')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code, output = inner_session.run(
        ["-p", "sparse_mla", str(root / "suites" / "test_attention_search.py"), "-k", "matches_the_oracle",
         "--sparse-mla-impl", "oom_always", "--sparse-mla-device", "cpu", "-p", "no:cacheprovider", "-p", "no:xdist",
         "--rootdir", str(root)], cwd=root, monkeypatch=monkeypatch, capsys=capsys,
    )  # fmt: skip
    assert code == 1 and "1 failed" in output, output[-3000:]
    assert "ran out of device memory on every try and were not judged" in output, output[-3000:]
    assert "NewDiscrepancy" not in output
