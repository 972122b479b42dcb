"""The peers that run on a CPU, judged by the whole suite with their shipped xfail files, strictly.

SGLang's PyTorch decode (``sglang-torch``, the sglang 0.5.23 wheel) and FlashInfer's pure-torch
references (``flashinfer-reference``, the flashinfer-python 0.7.2.post1 wheel) need no GPU, so the
README's test command installs both (``--no-deps``) and this module (the full tier) runs the suites against each
with the command the xfail file's header gives, in-process (``tests/inner_session.py``: a fresh
pytest session whose oracle results and drawn inputs are shared with the worker's other whole-suite
runs), with ``--tb=line`` (a listed xfail's traceback is not rendered with its source, which cost
seconds per run; a failure still shows its file, line and message). Under ``xfail_strict`` an
adapter or suite change that makes a listed discrepancy pass, or a new one appear, fails here the
same day instead of on the next GPU run. Skipped (saying what to install) where the peer's wheel is missing.
"""

from __future__ import annotations

from pathlib import Path

import inner_session
import pytest

from pytest_sparse_mla import catalogue

#: Whole-suite runs: the full tier (tests/conftest.py).
pytestmark = pytest.mark.full_tier

ROOT = Path(__file__).resolve().parents[1]
XFAIL = ROOT / "pytest_sparse_mla" / "xfail"

#: The peers that run on a CPU (``cpu_lane`` in ``catalogue``) -> how to install their wheel.
LANES = {entry.name: f"pip install --no-deps {entry.wheel}" for entry in catalogue.BUILTINS if entry.cpu_lane}
#: Where each lane runs among the self-tests: FlashInfer's with the gate's whole-suite runs (shared oracle and
#: inputs: tests/conftest.py); SGLang's apart, to balance the two workers; a new lane runs apart too.
_SCHEDULE = {
    "flashinfer-reference": inner_session.WHOLE_SUITE_RUN.with_args(seconds=14),
    "sglang-torch": pytest.mark.sparse_mla_selftest_long(seconds=20),
}


def _missing(name: str) -> str | None:
    from pytest_sparse_mla.implementations import BUILTINS

    impl = BUILTINS[name](None)
    return impl.skip_reason("sparse_mla_forward", "cpu")


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=_SCHEDULE.get(name, pytest.mark.sparse_mla_selftest_long(seconds=20)))
        for name in [*(n for n in _SCHEDULE if n in LANES), *(n for n in LANES if n not in _SCHEDULE)]
    ],
)
def test_peer_meets_the_suite_with_its_xfail_file(name, tmp_path, monkeypatch, capsys):
    reason = _missing(name)
    if reason is not None:
        pytest.skip(f"{reason}; install it with: {LANES[name]}")
    args = [
        "-p", "sparse_mla", str(ROOT / "suites"), "--sparse-mla-impl", name,
        "--sparse-mla-device", "cpu", "--sparse-mla-xfail-file", str(XFAIL / f"{name}.txt"),
        "-o", "xfail_strict=true", "-p", "no:xdist", "-p", "no:cacheprovider", "-q", "-rfE", "--tb=line",
        "--basetemp", str(tmp_path / "base"),
    ]  # fmt: skip
    returncode, output = inner_session.run(args, cwd=ROOT, monkeypatch=monkeypatch, capsys=capsys)
    lines = output.splitlines()
    tail = "\n".join(lines[-40:])
    wrong = "\n".join(line for line in lines if line.startswith(("FAILED", "ERROR", "XPASS")))
    assert returncode == 0, f"{name}: the suite against its xfail file exited {returncode}\n{wrong}\n...\n{tail}"
    assert " passed" in tail and "xfailed" in tail, f"{name}: expected passes and listed xfails\n{tail}"
