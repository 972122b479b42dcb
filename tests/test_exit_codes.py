"""Exit codes a CI reads: a run stopped by ``-x`` under xdist exits 2 (interrupted), never 3.

pytest's 3 means an internal error. syrupy adds its unused-snapshot status (1) to the session's
status, so a golden suite stopped early (its goldens unused) used to exit 2 | 1 = 3; the plugin
maps that back (``plugin.pytest_sessionfinish``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_run_stopped_by_x_under_xdist_exits_2_whatever_goldens_went_unused(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests"))
    cmd = [sys.executable, "-m", "pytest", "-p", "sparse_mla", "suites/test_golden.py", "-x", "-n", "2",
           "--sparse-mla-impl", "kernel_catalogue:zero_output", "--sparse-mla-device", "cpu",
           "-p", "no:cacheprovider", "-q", "--basetemp", str(tmp_path / "base")]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert "stopping after" in run.stdout, run.stdout[-2000:]
    assert run.returncode == 2, f"exit {run.returncode}\n{run.stdout[-2000:]}"
