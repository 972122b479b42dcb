"""Copy the files of the installed ``sglang`` wheel that the SGLang adapters execute into a small
directory a device run can carry instead of the 39 MB wheel.

    python scripts/carry_sglang.py [DEST]        # DEST default: .peers/sglang (git-ignored)

DEST then holds ``sglang/<the files>`` and ``sglang-<version>.dist-info/METADATA`` (so
``importlib.metadata.version("sglang")`` answers); ``scripts/peers_env.sh`` puts it on ``PYTHONPATH``
(``pytest_sparse_mla/catalogue.py``: the SGLang source's ``carried`` directory) when no wheel is
installed. The files are the adapters' own tables (``SGLANG_FILES`` of ``implementations.sglang``,
``FILES`` of ``implementations.sglang_dsv4``, ``implementations.sglang_dsa`` and
``implementations.sglang_q8kv8``) and what those files import from the wheel (:data:`IMPORTED`), plus
the directories the q8kv8 kernel's JIT build reads (:data:`DIRECTORIES`: SGLang's build code, its
include directory and the kernel's CUDA sources, about 1 MB). Nothing is edited; ``sglang/__init__.py``
is left out (the adapters never import the package).
"""

from __future__ import annotations

import shutil
import sys
from importlib import metadata
from pathlib import Path

#: Files of the wheel the adapters' files import (read from their import lines).
IMPORTED = (
    "kernels/ops/attention/dsv4/triton_sparse_decode/triton_mla_kernels_decode_optimized.py",
    "kernels/ops/attention/dsv4/triton_sparse_decode/triton_mla_kernels_decode_fused.py",
    "kernels/ops/attention/dsa/triton_sparse_mla.py",
    "kernels/ops/attention/dsa/tilelang_kernel.py",
    "kernels/ops/attention/metadata.py",
    "kernels/ops/attention/dsv4/kv_layout.py",
    "kernels/kernel_api_logging.py",
    "kernels/jit/__init__.py",
)
#: Directories of the wheel copied whole (``__pycache__`` left out): ``load_jit`` and its build code,
#: the include directory it passes to nvcc (``compile/paths.py`` requires it), the kernel's sources.
DIRECTORIES = ("kernels/jit/utils", "kernels/jit/include")


def main(argv: list[str]) -> int:
    from pytest_sparse_mla.implementations import sglang, sglang_dsa, sglang_dsv4, sglang_q8kv8
    from pytest_sparse_mla.implementations.sglang import sglang_root

    dest = Path(argv[0] if argv else ".peers/sglang")
    root = sglang_root()
    files = {*sglang.SGLANG_FILES.values(), *(f for f, _ in sglang_dsv4.FILES.values()),
             *(f for f, _ in sglang_dsa.FILES.values()), *(f for f, _ in sglang_q8kv8.FILES.values()),
             *IMPORTED}  # fmt: skip
    for directory in (*DIRECTORIES, sglang_q8kv8.CSRC):
        files |= {str(p.relative_to(root)) for p in (root / directory).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts}  # fmt: skip
    if dest.exists():
        shutil.rmtree(dest)
    for rel in sorted(files):
        target = dest / "sglang" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)
    dist = metadata.distribution("sglang")
    info = dest / f"sglang-{dist.version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(dist.read_text("METADATA") or "")
    print(f"{dest}: {len(files)} files of sglang {dist.version}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
