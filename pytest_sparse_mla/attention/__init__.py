"""Sparse-MLA attention over packed FP8 paged KV caches: the bundled reference and the oracle.

* :func:`sparse_mla_forward` / :class:`SparseMlaOutput` (``attention.reference``): the bundled
  reference forward (fp32, chunked, bitwise-invariant to index padding and head count); backends
  ``"torch"`` and ``"triton"`` (``attention._triton_forward``, the CUDA default).
* :func:`oracle_forward` (``attention.oracle``): the independent float64 oracle tests judge with.
* ``attention.conventions``: LSE conventions and FlashInfer's decode/prefill cutoff.
* ``attention.cases``: named DeepSeek-V4 / FlashInfer-test input cases for the suites.
"""

from pytest_sparse_mla.attention.conventions import DECODE_MAX_TOKENS, LSE_CONVENTIONS, route_for
from pytest_sparse_mla.attention.oracle import OracleOutput, oracle_forward
from pytest_sparse_mla.attention.reference import SparseMlaOutput, sparse_mla_forward

__all__ = [
    "DECODE_MAX_TOKENS",
    "LSE_CONVENTIONS",
    "OracleOutput",
    "SparseMlaOutput",
    "oracle_forward",
    "route_for",
    "sparse_mla_forward",
]
