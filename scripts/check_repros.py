#!/usr/bin/env python3
"""Run every reproducer ``--sparse-mla-repro-dir`` wrote, on its implementation and on the bundled
reference, and check the xfail files against them.

    python scripts/check_repros.py ROOT [--jobs 8] [--json out.json] [--xfail-dir pytest_sparse_mla/xfail]

``ROOT`` is one ``--sparse-mla-repro-dir``, or holds one per implementation named ``repro-<impl>``
(as ``scripts/device_conformance.sh`` writes them with ``REPRO=1``); no script found is a failure.
Each ``repro.py`` runs twice: as written (a script that calls a peer directly runs with
``pytest`` and ``pytest_sparse_mla`` made unimportable, proving it needs neither) and with
``--impl`` the bundled reference. A reproducer holds when the first run exits 1 (the discrepancy
is there) and the second exits 0.
A run that says the device ran out of memory (``pytest_sparse_mla.device_health.says_out_of_memory``:
its verdict line, or the output of a run that crashed) says nothing about the kernel: on a GPU that
other jobs share it is usually their memory. It is made again after each of
``device_health.MEMORY_RETRY_DELAYS``; if every try runs out, the script is ``"inconclusive"`` (counted
in the summary, never as holding, and its test is not reported as lacking a holding script).
Then each test id listed in ``<xfail-dir>/<impl>.txt`` without a reproducer that holds is listed
(a test whose failure is only a relation between calls has none). Exit 1 when a script does not
hold (or, with ``--every-line``, a listed test has none); the JSON has one record per script.

Scripts run breadth first: the first call of every test before any test's second call, so a check
cut short still covers as many tests as it can. Interrupted (SIGINT: ``timeout -s INT``, as
``scripts/device_conformance.sh`` runs it with ``REPRO_TIMEOUT``), it writes what it checked so far,
with ``"interrupted": true`` and the number of scripts ``not_run`` in the summary, and exits 124.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from pytest_sparse_mla import device_health

REFERENCE = "pytest_sparse_mla.implementations:ReferenceImplementation"
ISOLATED = (
    "import runpy, sys; sys.modules['pytest_sparse_mla'] = None; sys.modules['pytest'] = None; "
    "script = sys.argv[1]; sys.argv = sys.argv[1:]; runpy.run_path(script, run_name='__main__')"
)


#: The scripts running now (killed when the check is interrupted).
RUNNING: set[subprocess.Popen[str]] = set()


def _run_once(cmd: list[str], cwd: Path, timeout: float) -> tuple[int, str, bool]:
    """``(exit status, first line of the output, whether the run ran out of device memory)``."""
    with subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        RUNNING.add(proc)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return 124, "timeout", False
        finally:
            RUNNING.discard(proc)
    text = (stdout.strip() or stderr.strip()).splitlines()
    line = (text[0] if text else "")[:400]
    crashed = proc.returncode not in (0, 1)
    out_of_memory = device_health.says_out_of_memory(line) or (crashed and device_health.says_out_of_memory(stderr))
    return proc.returncode, line, out_of_memory


def _run(cmd: list[str], cwd: Path, timeout: float) -> tuple[int, str, bool]:
    """:func:`_run_once`, made again after each of ``MEMORY_RETRY_DELAYS`` while it runs out of
    device memory; the third item says whether the last try did too."""
    for delay in device_health.MEMORY_RETRY_DELAYS:
        rc, line, out_of_memory = _run_once(cmd, cwd, timeout)
        if not out_of_memory:
            return rc, line, False
        time.sleep(delay)
    return _run_once(cmd, cwd, timeout)


def check(script: Path, timeout: float) -> dict[str, object]:
    native = "directly" in script.read_text(encoding="utf-8").split('"""', 2)[1]
    first = [sys.executable, "-c", ISOLATED, str(script)] if native else [sys.executable, str(script)]
    peer_rc, peer_out, peer_oom = _run(first, script.parent, timeout)
    ref_rc, ref_out, ref_oom = _run([sys.executable, str(script), "--impl", REFERENCE], script.parent, timeout)
    record: dict[str, object] = {
        "script": str(script), "native": native, "peer_exit": peer_rc, "peer_says": peer_out,
        "reference_exit": ref_rc, "reference_says": ref_out,
        "holds": peer_rc == 1 and ref_rc == 0 and not (peer_oom or ref_oom),
    }  # fmt: skip
    if peer_oom or ref_oom:
        sides = " and ".join(side for side, oom in (("peer", peer_oom), ("reference", ref_oom)) if oom)
        record["inconclusive"] = f"out of device memory on every try ({sides}): an environment condition"
    return record


def _xfail_ids(path: Path) -> list[str]:
    ids = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            ids.append(line)
    return ids


def _impl_folders(root: Path) -> list[tuple[str, Path]]:
    """``(implementation, folder)`` pairs: ``root`` itself when it is one ``--sparse-mla-repro-dir``
    (it holds ``index.jsonl``), else its ``repro-<impl>`` folders."""
    if (root / "index.jsonl").exists():
        first = (root / "index.jsonl").read_text(encoding="utf-8").splitlines()[:1]
        return [(json.loads(first[0]).get("impl") or root.name if first else root.name, root)]
    return [(d.name[len("repro-"):], d) for d in sorted(root.glob("repro-*")) if d.is_dir()]


def _index(folder: Path) -> dict[str, dict[str, str]]:
    """script path -> its ``index.jsonl`` entry (node id, outcome)."""
    out: dict[str, dict[str, str]] = {}
    index = folder / "index.jsonl"
    for line in index.read_text(encoding="utf-8").splitlines() if index.exists() else []:
        entry = json.loads(line)
        for script in entry["scripts"]:
            out[str(Path(script))] = entry
    return out


def breadth_first(jobs: list[tuple[str, Path]]) -> list[tuple[str, Path]]:
    """``(impl, script)`` jobs ordered by the script's call number within its test (``.../callK/repro.py``:
    every test's ``call0`` first), then by path."""

    def call_number(script: Path) -> int:
        name = script.parent.name
        return int(name[4:]) if name.startswith("call") and name[4:].isdigit() else 0

    return sorted(jobs, key=lambda job: (call_number(job[1]), str(job[1])))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path)
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--xfail-dir", type=Path, default=Path("pytest_sparse_mla/xfail"))
    parser.add_argument("--every-line", action="store_true",
                        help="also fail when an xfail line has no holding script")
    opts = parser.parse_args()
    # SIGINT ends the check (the interface above) even where it was started with SIGINT ignored (a
    # command a non-interactive shell ran in the background: Python then keeps ignoring it).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    folders = _impl_folders(opts.root)
    jobs = breadth_first([(impl, script) for impl, folder in folders for script in folder.glob("**/repro.py")])
    if not jobs:
        print(f"no repro.py under {opts.root}: expected a --sparse-mla-repro-dir, or repro-<impl> folders of them")
        return 1
    done: dict[int, dict[str, object]] = {}
    interrupted = False
    pool = ThreadPoolExecutor(opts.jobs)
    futures: dict[Any, int] = {}
    try:  # an interrupt while the jobs are submitted too: threads may run already
        for k, (_, script) in enumerate(jobs):
            futures[pool.submit(check, script, opts.timeout)] = k
        for future in as_completed(futures):
            done[futures[future]] = future.result()
    except KeyboardInterrupt:
        interrupted = True
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in list(RUNNING):
            proc.kill()
    else:
        pool.shutdown()
    checked = [(jobs[k], done[k]) for k in sorted(done)]
    records = [rec for _, rec in checked]
    by_impl: dict[str, dict[str, list[dict[str, object]]]] = {}
    entries = {impl: _index(folder) for impl, folder in folders}
    for (impl, _), rec in checked:
        rec["impl"] = impl
        entry = entries[impl].get(str(rec["script"]), {})
        rec["nodeid"], rec["outcome"] = entry.get("nodeid", ""), entry.get("outcome", "")
        by_impl.setdefault(impl, {}).setdefault(str(rec["nodeid"]), []).append(rec)
    not_run: dict[str, set[str]] = {}
    for k, (impl, script) in enumerate(jobs):
        if k not in done:
            not_run.setdefault(impl, set()).add(entries[impl].get(str(script), {}).get("nodeid", ""))
    missing: dict[str, list[str]] = {}
    for impl, _ in folders:
        xfail = opts.xfail_dir / f"{impl}.txt"
        if not xfail.exists():
            continue
        runs = by_impl.get(impl, {})
        for test_id in _xfail_ids(xfail):
            matches = [r for nodeid, recs in runs.items() if nodeid.endswith(test_id) or nodeid.startswith(test_id)
                       for r in recs]  # fmt: skip
            unrun = any(n.endswith(test_id) or n.startswith(test_id) for n in not_run.get(impl, ()))
            unjudged = unrun or any("inconclusive" in r for r in matches)  # a script not run, or out of memory
            if not any(r["holds"] for r in matches) and not unjudged:
                missing.setdefault(impl, []).append(test_id)
    summary: dict[str, object] = {
        "scripts": len(records),
        "hold": sum(1 for r in records if r["holds"]),
        "inconclusive": sum(1 for r in records if "inconclusive" in r),
        "xfail_lines_without_a_holding_script": missing,
    }
    if interrupted:
        summary.update(interrupted=True, not_run=len(jobs) - len(records))
    if opts.json:
        opts.json.write_text(json.dumps({"summary": summary, "records": records}, indent=1), encoding="utf-8")
    print(json.dumps(summary, indent=1))
    for rec in records:
        if not rec["holds"]:
            verdict = "INCONCLUSIVE" if "inconclusive" in rec else "NOT HOLDING"
            print(f"{verdict} peer={rec['peer_exit']} ref={rec['reference_exit']} {rec['script']}: "
                  f"{rec['peer_says']} | {rec['reference_says']}")  # fmt: skip
    if interrupted:  # the scripts still running belong to threads that would be waited for at exit
        sys.stdout.flush()
        os._exit(124)
    return 0 if summary["hold"] == summary["scripts"] and not (missing and opts.every_line) else 1


if __name__ == "__main__":
    sys.exit(main())
