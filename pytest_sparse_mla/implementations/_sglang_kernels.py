"""Loading the files of SGLang's ``kernels/ops/attention`` package that the ``sglang_dsv4`` and
``sglang_dsa`` adapters execute, from the installed wheel (``pip install --no-deps sglang==0.5.23``)
or a carried copy of its files (``scripts/carry_sglang.py``), without importing ``sglang``.

Each file runs through ``_source.exec_source`` under a private module name with the stand-ins of
``_source.stubs_for("sglang-kernels")`` (the kernel files import each other by absolute
``sglang.kernels.ops.attention`` names, answered by the wheel's own files; four platform queries are
answered as on a CUDA build), so a standalone reproducer loads it the same way
(``_peer.call_peer``'s ``source``).
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["HINT", "source_of", "missing", "load_entry"]

#: What to install when a file is missing.
HINT = "pip install --no-deps sglang==0.5.23"


def source_of(path: str, stubs: str = "sglang-kernels") -> dict[str, Any]:
    """How a reproducer finds the file ``path`` (relative to the ``sglang`` package) and which
    stand-ins it runs with (``_source.stubs_for(stubs)``): ``_peer.call_peer``'s ``source``."""
    return {"kind": "file", "package": "sglang", "path": path, "stubs": stubs}


def missing(path: str) -> str | None:
    """What to install when ``sglang/<path>`` is not on ``sys.path``, or ``None`` when it is."""
    from pytest_sparse_mla.implementations._source import find_source

    if find_source("sglang", path) is None:
        return f"the installed sglang has no {path} ({HINT})"
    return None


@functools.cache
def load_entry(name: str, path: str, function: str, stubs: str = "sglang-kernels") -> Any:
    """``function`` of ``sglang/<path>``, the file executed as module ``name`` with the stand-ins
    ``_source.stubs_for(stubs)`` (``"sglang-kernels"``, module docstring; ``"sglang-q8kv8"`` for the
    JIT-built kernel of ``implementations.sglang_q8kv8``).

    Raises:
        ImportError: sglang (or triton, or tilelang) is not installed, or the file is missing.
        AttributeError: the file has no ``function``.
    """
    from pytest_sparse_mla.implementations._source import exec_source, find_source, stubs_for

    found = find_source("sglang", path)
    if found is None:
        raise ImportError(f"the installed sglang has no {path} ({HINT})")
    return getattr(exec_source(name, found, stubs_for(stubs)), function)
