"""The example project's own tests: its kernel against pytest-sparse-mla's float64 oracle.

They use the plugin's fixtures (``sparse_mla_impl``, ``sparse_mla_tolerances``,
``packed_kv_cache_factory`` through ``decode_inputs`` in conftest.py) and its oracle; run them with
``pytest`` from this directory (``-p sparse_mla`` comes from ``addopts``).
"""

from __future__ import annotations

import pytest
import torch
from chunked_mla import ChunkedSparseMla

from pytest_sparse_mla.attention import oracle_forward, sparse_mla_forward


def test_selected_kernel_matches_the_oracle(decode_inputs, sparse_mla_impl, sparse_mla_tolerances):
    """Whatever ``--sparse-mla-impl`` selects (``chunked-96`` by default here)."""
    res = sparse_mla_impl.sparse_mla_forward(decode_inputs.q, decode_inputs.kv_cache, decode_inputs.indices,
                                             **decode_inputs.kwargs())  # fmt: skip
    oracle = oracle_forward(decode_inputs.q, decode_inputs.kv_cache, decode_inputs.indices, **decode_inputs.kwargs())
    sparse_mla_tolerances.check_result(res, oracle)


@pytest.mark.parametrize("chunk_lanes", [7, 64, 200])
@pytest.mark.parametrize("lse_convention", ["flashinfer", "flashmla"])
def test_every_chunking_matches_the_oracle(chunk_lanes, lse_convention, decode_inputs, sparse_mla_tolerances):
    kernel = ChunkedSparseMla(chunk_lanes=chunk_lanes)
    args = (decode_inputs.q, decode_inputs.kv_cache, decode_inputs.indices)
    res = kernel.sparse_mla_forward(*args, lse_convention=lse_convention, **decode_inputs.kwargs())
    oracle = oracle_forward(*args, lse_convention=lse_convention, **decode_inputs.kwargs())
    sparse_mla_tolerances.check_result(res, oracle)
    # Token 3 has topk_length 0 but 40 extra lanes: its LSE is finite under both conventions.
    assert bool(torch.isfinite(res.lse[3]).all())


def test_agrees_with_the_bundled_reference(decode_inputs, sparse_mla_tolerances):
    args = (decode_inputs.q, decode_inputs.kv_cache, decode_inputs.indices)
    ours = ChunkedSparseMla(chunk_lanes=16).sparse_mla_forward(*args, **decode_inputs.kwargs())
    reference = sparse_mla_forward(*args, **decode_inputs.kwargs())
    oracle = oracle_forward(*args, **decode_inputs.kwargs())
    sparse_mla_tolerances.check_invariant(ours, reference, oracle=oracle, bitwise=False)


def test_rejects_bad_chunk_size():
    with pytest.raises(ValueError, match="chunk_lanes=0"):
        ChunkedSparseMla(chunk_lanes=0)
