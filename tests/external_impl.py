"""A "downstream" sparse-MLA package, defined outside pytest_sparse_mla, for the self-tests.

``tests/test_implementations.py`` copies this file into a throwaway project as
``downstream_kernels/impl.py`` and runs the suites with
``--sparse-mla-impl downstream_kernels.impl:impl`` (and the other objects below).

* ``impl``: a module-like object with ``name`` and ``sparse_mla_forward`` only; it delegates to the
  bundled reference (it stands for a downstream kernel) and appends one line per call to
  ``downstream_calls.log`` in the working directory, so a test can see it was really called.
* ``NoSinkImpl``: a class (instantiated by the import string) whose forward silently drops
  ``attn_sink``: a realistic bug the accuracy suite must catch.
* ``pack_only``: provides ``pack`` only, so attention suites must skip with the reason.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from pytest_sparse_mla import formats
from pytest_sparse_mla.attention import sparse_mla_forward


def _forward(q: Any, kv_cache: Any, indices: Any, **kwargs: Any) -> Any:
    with open("downstream_calls.log", "a") as log:
        log.write(f"{tuple(q.shape)}\n")
    return sparse_mla_forward(q, kv_cache, indices, **kwargs)


impl = SimpleNamespace(name="downstream", sparse_mla_forward=_forward, tolerance_profile="tight")


class NoSinkImpl:
    """Forgets the sink (the output then lacks the sink's denominator mass)."""

    name = "downstream-no-sink"
    tolerance_profile = "tight"

    def sparse_mla_forward(self, q: Any, kv_cache: Any, indices: Any, **kwargs: Any) -> Any:
        kwargs.pop("attn_sink", None)
        return sparse_mla_forward(q, kv_cache, indices, **kwargs)


pack_only = SimpleNamespace(name="downstream-pack-only", pack=formats.quantize_pack)
