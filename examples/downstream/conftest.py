"""conftest of the example downstream project: registers configurations of its kernel and builds
attention inputs from pytest-sparse-mla's fixtures.

The plugin itself is loaded with ``-p sparse_mla`` (``addopts`` in pyproject.toml), never through
``pytest_plugins`` (registering one plugin under two names fails).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from chunked_mla import ChunkedSparseMla


@pytest.hookimpl(optionalhook=True)  # optional: the hook exists only when pytest-sparse-mla is loaded
def pytest_sparse_mla_implementations(config: pytest.Config) -> dict[str, object]:
    """Make ``--sparse-mla-impl chunked-96`` (96-lane chunks) and ``chunked-odd`` (7) selectable.

    The installed project also declares ``chunked`` (48-lane chunks) as an entry point, valid
    wherever it is installed; these two names exist only where this conftest is loaded.
    """
    return {"chunked-96": ChunkedSparseMla(chunk_lanes=96), "chunked-odd": ChunkedSparseMla(chunk_lanes=7)}


@dataclass
class DecodeInputs:
    """One decode call: queries, a main (SWA-like) cache, an extra (C4-like) cache, indices."""

    q: torch.Tensor
    kv_cache: torch.Tensor
    indices: torch.Tensor
    topk_length: torch.Tensor
    extra_kv_cache: torch.Tensor
    extra_indices: torch.Tensor
    attn_sink: torch.Tensor

    def kwargs(self) -> dict[str, object]:
        """Keyword arguments shared by every ``sparse_mla_forward`` of the protocol."""
        return {
            "sm_scale": 512**-0.5,
            "topk_length": self.topk_length,
            "attn_sink": self.attn_sink,
            "extra_kv_cache": self.extra_kv_cache,
            "extra_indices": self.extra_indices,
        }


@pytest.fixture
def decode_inputs(packed_kv_cache_factory, sparse_mla_generator, sparse_mla_device) -> DecodeInputs:
    """4 query tokens x 8 heads over a 2-page main cache (page 128, topk 96, ragged ``topk_length``,
    ``-1`` tail lanes) and a 4-page extra cache (page 64, 40 lanes); a per-head sink.

    Built only from pytest-sparse-mla's fixtures and ``pytest_sparse_mla.data`` helpers, so the data
    is reproducible per test (``--sparse-mla-seed``) and lands on ``--sparse-mla-device``.
    """
    from pytest_sparse_mla import data

    main = packed_kv_cache_factory(num_pages=2, page_block_size=128)
    extra = packed_kv_cache_factory(num_pages=4, page_block_size=64)
    gen, dev = sparse_mla_generator, sparse_mla_device
    return DecodeInputs(
        q=data.latent((4, 8, 512), gen, device=dev),
        kv_cache=main.packed,
        indices=data.sparse_indices(4, 96, main.num_tokens, gen, masked_fraction=0.25, device=dev),
        topk_length=torch.tensor([96, 50, 17, 0], dtype=torch.int32, device=dev),
        extra_kv_cache=extra.packed,
        extra_indices=data.sparse_indices(4, 40, extra.num_tokens, gen, masked_fraction=0.0, device=dev),
        attn_sink=data.attn_sink(8, gen, device=dev),
    )
