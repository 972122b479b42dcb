"""The suites against every peer adapter, each with its shipped xfail file: tox's ``peers-gpu`` lane.

The peers, their xfail files and the wheels they run from are the entries of
``pytest_sparse_mla.catalogue`` (a new peer joins the lane with its entry):

    python scripts/peer_suites.py --install            # pip install --no-deps the peers' wheels
    python scripts/peer_suites.py --check cuda         # exit 1 naming each peer that cannot run on cuda
    python scripts/peer_suites.py --list               # the peers, one a line
    python scripts/peer_suites.py [--repro-dir DIR] -- PYTEST_ARGS...

The last form runs, per peer, ``python -m pytest -p sparse_mla suites --sparse-mla-impl NAME
--sparse-mla-xfail-file pytest_sparse_mla/xfail/NAME.txt [--sparse-mla-repro-dir DIR/repro-NAME]
PYTEST_ARGS...`` from the repository root, every peer even after one fails, and exits with the first
non-zero status (0 when every run passed).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from pytest_sparse_mla import catalogue

ROOT = Path(__file__).resolve().parents[1]


def commands(repro_dir: Path | None, pytest_args: list[str]) -> list[list[str]]:
    """The pytest command of each peer, in catalogue order."""
    out = []
    for entry in catalogue.BUILTINS:
        if entry.xfail_file is None:
            continue
        command = [sys.executable, "-m", "pytest", "-p", "sparse_mla", "suites", "--sparse-mla-impl", entry.name,
                   "--sparse-mla-xfail-file", str(ROOT / "pytest_sparse_mla" / entry.xfail_file)]  # fmt: skip
        if repro_dir is not None:
            command += ["--sparse-mla-repro-dir", str(repro_dir / f"repro-{entry.name}")]
        out.append(command + pytest_args)
    return out


def not_ready(device: str) -> list[str]:
    """``"NAME: reason"`` for each peer whose ``sparse_mla_forward`` cannot run on ``device`` here."""
    from pytest_sparse_mla.implementations import BUILTINS

    reasons = []
    for name in catalogue.peer_names():
        reason = BUILTINS[name](None).skip_reason("sparse_mla_forward", device)
        print(f"peer_suites: {name}: {reason or 'ready'}", file=sys.stderr)
        if reason:
            reasons.append(f"{name}: {reason}")
    return reasons


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--list", action="store_true", help="print the peers and exit")
    mode.add_argument("--install", action="store_true", help="pip install --no-deps the peers' wheels and exit")
    mode.add_argument("--check", metavar="DEVICE", help="exit 1 unless every peer can run on DEVICE (cpu, cuda)")
    parser.add_argument("--repro-dir", type=Path, help="write each peer's reproducers to DIR/repro-NAME")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(catalogue.peer_names()))
        return 0
    if args.install:
        wheels = list(dict.fromkeys(entry.wheel for entry in catalogue.BUILTINS if entry.wheel))
        return subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", *wheels], check=False).returncode
    if args.check:
        reasons = not_ready(args.check)
        if reasons:
            print("peer_suites: " + "; ".join(reasons), file=sys.stderr)
        return 1 if reasons else 0
    status = 0
    for command in commands(args.repro_dir, args.pytest_args):
        print("peer_suites: " + " ".join(command[1:]), flush=True)
        rc = subprocess.run(command, cwd=ROOT, check=False).returncode
        status = status or rc
    return status


if __name__ == "__main__":
    sys.exit(main())
