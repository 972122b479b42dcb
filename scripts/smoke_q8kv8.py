"""Build SGLang's SM90 Q8KV8 sparse prefill kernel (``sglang-q8kv8-sm90``) with SGLang's own JIT, timed,
and say clearly what failed when it does not build.

    python3 scripts/smoke_q8kv8.py --log DIR/q8kv8-build.log --json DIR/q8kv8-build.json

Run from the repository root with the peers set up (``scripts/peers_env.sh``: the carried SGLang
files, apache-tvm-ffi, msgspec, ``peers_sglang_jit`` for CUTLASS); ``scripts/smoke_q8kv8.sh`` does all
of it. It prints the toolchain the build sees (nvcc, ninja, tvm_ffi, msgspec, CUTLASS and its
``version.h``, the GPU), loads the kernel file as the adapter does (``implementations.sglang_q8kv8``),
calls its module loader ``_jit_sparse_mla_q8kv8_prefill_module`` (SGLang's ``load_jit``: the build, or
the cached module under ``SGLANG_JIT_CACHE_DIR``), and writes the compiler's output to ``--log``
(``SGLANG_JIT_LOG_RESOURCE_USAGE=1``, set unless given: ptxas's register and spill report of each
kernel; the flag is part of SGLang's build key, so later runs must set it too to reuse the module; on a failure,
SGLang's message with ninja's stdout and stderr). A failure is summarized as ``BUILD FAILED:`` and the
first lines naming a missing header or an nvcc error. Exit status 0 when the module loaded, 1 when not.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _toolchain() -> dict[str, Any]:
    """What the JIT build will use, read the way SGLang reads it (``compile/toolchain.py``)."""
    import importlib.metadata as md

    import torch

    info: dict[str, Any] = {}
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = os.path.join(home, "bin", "nvcc") if home else shutil.which("nvcc")
    info["nvcc"] = nvcc
    try:
        info["nvcc_version"] = (
            subprocess.run([nvcc or "nvcc", "--version"], capture_output=True, text=True)
            .stdout.strip()
            .splitlines()[-1]
        )
    except OSError as exc:
        info["nvcc_version"] = f"not runnable: {exc}"
    info["ninja"] = shutil.which("ninja")
    for dist in ("apache-tvm-ffi", "msgspec", "sglang"):
        try:
            info[dist] = md.version(dist)
        except md.PackageNotFoundError:
            info[dist] = None
    cutlass = os.environ.get("SPARSE_MLA_SGLANG_CUTLASS")
    info["SPARSE_MLA_SGLANG_CUTLASS"] = cutlass
    if cutlass:
        version_h = Path(cutlass.split(os.pathsep)[0]) / "cutlass" / "version.h"
        text = version_h.read_text() if version_h.is_file() else ""
        parts = [re.search(rf"#define CUTLASS_{k} (\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
        info["cutlass_version"] = ".".join(m.group(1) for m in parts if m) or f"no {version_h}"
    info["SGLANG_JIT_CACHE_DIR"] = os.environ.get("SGLANG_JIT_CACHE_DIR", "~/.cache/sglang/jit (SGLang's default)")
    info["torch"] = torch.__version__
    if torch.cuda.is_available():
        info["gpu"] = f"{torch.cuda.get_device_name()} sm_{''.join(map(str, torch.cuda.get_device_capability()))}"
    return info


def _why(text: str) -> list[str]:
    """The lines of a failed build's output that say what failed: a missing header, an nvcc or
    ptxas error, a linker error (at most 12)."""
    keys = ("fatal error", "No such file or directory", "error:", "error :", "undefined reference", "ld:", "Error")
    lines = [line.strip() for line in text.splitlines() if any(k in line for k in keys)]
    return lines[:12]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", default="q8kv8-build.log", help="the build's log (compiler output)")
    parser.add_argument("--json", default="q8kv8-build.json", help="toolchain, outcome and seconds")
    args = parser.parse_args()
    os.environ.setdefault("SGLANG_JIT_LOG_RESOURCE_USAGE", "1")
    log_path = Path(args.log)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_path, mode="w")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)

    report: dict[str, Any] = {"toolchain": _toolchain()}
    for key, value in report["toolchain"].items():
        print(f"smoke_q8kv8: {key}: {value}")
    from pytest_sparse_mla.implementations import sglang_q8kv8

    status = 1
    t0 = time.monotonic()
    try:
        sglang_q8kv8.load("kernel")
        sglang_q8kv8.load("gather")
        module = sys.modules["_sparse_mla_peer_sglang_q8kv8_kernel"]
        built = module._jit_sparse_mla_q8kv8_prefill_module()
        report["outcome"] = f"loaded {built}"
        status = 0
    except Exception as exc:  # noqa: BLE001 - every failure is reported, with its text
        text = f"{type(exc).__name__}: {exc}"
        report["outcome"] = "failed"
        report["error"] = text[:20000]
        report["why"] = _why(text) or [text.splitlines()[0][:400]]
        with log_path.open("a") as log:
            log.write("\n==== BUILD FAILED ====\n" + text + "\n")
    report["seconds"] = round(time.monotonic() - t0, 1)
    report["skip_reason"] = sglang_q8kv8.SglangQ8Kv8Implementation().skip_reason("sparse_mla_forward", "cuda")
    Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    if status == 0:
        print(f"smoke_q8kv8: BUILD OK in {report['seconds']} s ({report['outcome']}); log {log_path}")
    else:
        print(f"smoke_q8kv8: BUILD FAILED after {report['seconds']} s; log {log_path}")
        for line in report["why"]:
            print(f"smoke_q8kv8:   {line}")
    print(f"smoke_q8kv8: adapter skip reason: {report['skip_reason']}")
    return status


if __name__ == "__main__":
    sys.exit(main())
