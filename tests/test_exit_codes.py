"""Exit codes a CI reads: a run stopped by ``-x`` under xdist exits 2 (interrupted), never 3; a
kernel whose results have the wrong form ends the run in one usage error (4).

pytest's 3 means an internal error. syrupy adds its unused-snapshot status (1) to the session's
status, so a golden suite stopped early (its goldens unused) used to exit 2 | 1 = 3; the plugin
maps that back (``plugin.pytest_sessionfinish``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

#: Whole pytest processes (xdist workers among them), as a CI runs them: the full tier (tests/conftest.py).
pytestmark = pytest.mark.full_tier

ROOT = Path(__file__).resolve().parents[1]


def test_a_run_stopped_by_x_under_xdist_exits_2_whatever_goldens_went_unused(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests"))
    cmd = [sys.executable, "-m", "pytest", "-p", "sparse_mla", "suites/test_golden.py", "-x", "-n", "2",
           "--sparse-mla-impl", "kernel_catalogue:zero_output", "--sparse-mla-device", "cpu",
           "-p", "no:cacheprovider", "-q", "--basetemp", str(tmp_path / "base")]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert "stopping after" in run.stdout, run.stdout[-2000:]
    assert run.returncode == 2, f"exit {run.returncode}\n{run.stdout[-2000:]}"


_WRONG_FORMS = '''
from pytest_sparse_mla.attention import sparse_mla_forward as _reference


class Fp32Output:
    """Returns its output in fp32 (the protocol's output is BF16)."""

    name = "fp32-output"

    def sparse_mla_forward(self, *args, **kwargs):
        res = _reference(*args, **kwargs, return_fp32=True)
        return res.output_fp32, res.lse


class FlatOutput:
    """Returns its output as [T, H*512] (the protocol's output is [T, H, 512])."""

    name = "flat-output"

    def sparse_mla_forward(self, *args, **kwargs):
        res = _reference(*args, **kwargs)
        return res.output.reshape(res.output.shape[0], -1), res.lse


class DictResult:
    """Returns a dict (the protocol's result has .output, or is a pair or a tensor)."""

    name = "dict-result"

    def sparse_mla_forward(self, *args, **kwargs):
        res = _reference(*args, **kwargs)
        return {"out": res.output, "lse": res.lse}
'''


@pytest.mark.parametrize(
    ("kernel", "says", "workers"),
    [
        ("Fp32Output", "returned a torch.float32 output of shape", "2"),
        ("DictResult", "returned a dict;", "0"),
        ("FlatOutput", "returned an output of shape [", "0"),
        ("FlatOutput", "for a call that needs [", "2"),
    ],
)
def test_results_of_the_wrong_form_end_the_run_in_one_usage_error(tmp_path, workers, kernel, says):
    """Every test would fail alike, so the run stops at the first such result (one per xdist worker
    at most) and exits 4 with the fix said once."""
    (tmp_path / "wrong_forms.py").write_text(_WRONG_FORMS)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    cmd = [sys.executable, "-m", "pytest", "-p", "sparse_mla", "suites/test_attention_accuracy.py", "-n", workers,
           "--sparse-mla-impl", f"wrong_forms:{kernel}", "--sparse-mla-device", "cpu", "-p", "no:cacheprovider",
           "-q", "--basetemp", str(tmp_path / "base")]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = run.stdout
    assert run.returncode == 4, f"exit {run.returncode}\n{out[-3000:]}"
    assert out.count("= sparse-mla usage error =") == 1, out[-3000:]
    summary = out.split("= sparse-mla usage error =")[1]
    assert says in summary and "BF16 tensor [num_tokens, num_heads, d_v]" in summary, summary[:1000]
    assert out.count("BF16 tensor [num_tokens, num_heads, d_v]") == 1, out[-3000:]  # not once per failed test
    failed = int(re.findall(r"(\d+) failed", out)[-1])
    assert 1 <= failed <= max(1, int(workers)), out[-2000:]
    if workers == "0":  # the coverage table counts only the tests that ran, and says so
        assert "classes that never ran: " in out and "(the run stopped early:" in out, out[-3000:]


def _result_form_error(res: object) -> str:
    from pytest_sparse_mla import guard
    from pytest_sparse_mla.envelope import UNIVERSAL

    with pytest.raises(guard.ResultFormError) as info:
        guard.result_of(res, UNIVERSAL, "k")
    assert "an (output, lse) pair" in info.value.msg
    return info.value.msg


def test_a_triple_or_a_swapped_pair_is_refused_by_name():
    """FlashMLA's ``flash_mla_sparse_fwd`` returns ``(output, max_logits, lse)``: taken as a pair,
    ``max_logits`` would be judged as the LSE. A pair in the order ``(lse, output)`` is named as
    swapped. A well-formed pair is read as ``(output, lse)``."""
    import torch

    from pytest_sparse_mla import guard
    from pytest_sparse_mla.envelope import UNIVERSAL

    out, lse = torch.zeros(2, 4, 512, dtype=torch.bfloat16), torch.zeros(2, 4)
    msg = _result_form_error((out, lse.clone(), lse))
    assert "returned a tuple of 3 items; FlashMLA's flash_mla_sparse_fwd" in msg and "(output, max_logits, lse)" in msg
    assert "returned a list of 1 item;" in _result_form_error([out])
    assert "(lse, output), the pair swapped" in _result_form_error((lse, out))
    shapes = ((2, 4, 512), (2, 4))
    with pytest.raises(
        guard.ResultFormError, match=r"an output of shape \[2, 2048\] for a call that needs \[2, 4, 512\]"
    ):
        guard.result_of((out.reshape(2, -1), lse), UNIVERSAL, "k", shapes)
    with pytest.raises(guard.ResultFormError, match=r"an LSE of shape \[4, 2\] for a call that needs \[2, 4\]"):
        guard.result_of((out, lse.t()), UNIVERSAL, "k", shapes)
    res = guard.result_of([out, lse], UNIVERSAL, "k")
    assert res.output is out and res.lse is lse
