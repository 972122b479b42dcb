"""A DeepSeek-V3.2 call that also passes an extra cache: silently dropped by FlashInfer 0.6.14-0.6.18,
rejected from 0.7.0 (flashinfer ``mla/_sparse_mla_sm120.py`` lines 360-365 in 0.6.17 and 369-374 in
0.6.18: the DSV3.2 decode branch calls ``sparse_mla_sm120_decode_dsv3_2`` without the extra cache).

Expected texts are written out here from the releases' sources, not read back from the grid.
The ``flashinfer-*`` tox lanes additionally run each release's own routing on the CPU with stubbed
kernels (``compare_python_routing`` of ``scripts/flashinfer_introspect.py``), which records whether
the extra cache reached the kernel.
"""

from __future__ import annotations

import json
import warnings

import pytest

from pytest_sparse_mla.dispatch import (
    IgnoredExtraCacheWarning,
    InternalError,
    SparseMlaConfig,
    UnsupportedShapeError,
    enforce_grid,
    supports,
)

# DSV3.2 decode table (0.6.x): heads {8,...,128} x topk {128, 512, 1024, 2048}, page 64.
DECODE = {"model": "DSV3_2", "num_tokens": 4, "num_heads": 64, "topk": 2048, "page_block_size": 64}
EXTRA = {"topk_extra": 512, "extra_page_block_size": 2}


@pytest.mark.parametrize("release", ["0.6.14", "0.6.17", "0.6.18", "0.6.18.post1"])
def test_0_6_decode_accepts_the_extra_cache_and_drops_it(release: str) -> None:
    verdict = supports(SparseMlaConfig(**DECODE, **EXTRA), release)
    assert verdict.supported and verdict.route == "decode" and verdict.extra_cache_ignored
    assert any("silently ignored" in note and "_sparse_mla_sm120.py lines" in note for note in verdict.notes)
    assert json.loads(json.dumps(verdict.to_dict()))["extra_cache_ignored"] is True
    with pytest.warns(IgnoredExtraCacheWarning, match=r"DSV3_2 T=4 H=64 topk=2048 page=64 extra=512@2: .*ignored"):
        enforce_grid(release, **DECODE, **EXTRA)


@pytest.mark.parametrize(
    "config",
    [
        SparseMlaConfig(**DECODE),  # DSV3.2 without an extra cache: nothing is dropped
        SparseMlaConfig("DSV4", 4, 64, 128, 64, 512, 2),  # the DSV4 decode kernel takes the extra cache
    ],
)
def test_nothing_is_flagged_where_nothing_is_dropped(config: SparseMlaConfig) -> None:
    verdict = supports(config, "0.6.17")
    assert verdict.supported and verdict.route == "decode" and not verdict.extra_cache_ignored
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        enforce_grid("0.6.17", **{k: getattr(config, k) for k in (*DECODE, "topk_extra", "extra_page_block_size")})


@pytest.mark.parametrize("release", ["0.7.0", "0.7.0.post1", "0.7.1", "0.7.4"])
def test_from_0_7_0_the_call_is_rejected_with_the_value_error(release: str) -> None:
    expected = (
        "SM120 sparse-MLA has no decode kernel for this shape: num_tokens=4, num_heads=64, topk=2048, "
        "d_qk=576, page_block_size=64, model_type=dsv3_2, extra_topk=512. Mismatch: no matching decode "
        "instantiation. The decode instantiations (num_tokens <= 64) and the prefill envelope both reject "
        "it. Query supported shapes at init time with flashinfer.mla.supported_sparse_mla_sm120_configs()."
    )
    verdict = supports(SparseMlaConfig(**DECODE, **EXTRA), release)
    assert not verdict.supported and not verdict.extra_cache_ignored
    with pytest.raises(UnsupportedShapeError) as info:
        enforce_grid(release, **DECODE, **EXTRA)
    assert str(info.value) == expected and isinstance(info.value, ValueError)


@pytest.mark.parametrize("release", ["0.6.17", "0.6.18"])
def test_0_6_prefill_with_an_extra_cache_fails_in_cpp(release: str) -> None:
    """num_tokens > 64 goes to the C++ orchestrator, whose prefill dispatch returns false for an
    extra cache on anything but DSV4 (``sparse_mla_sm120_prefill.cu``)."""
    with pytest.raises(InternalError) as info:
        enforce_grid(release, **{**DECODE, "num_tokens": 65}, topk_extra=512, extra_page_block_size=64)
    assert str(info.value) == (
        "Check failed: (ok) is false: Unsupported sparse-MLA prefill configuration: model=DSV3_2 "
        "num_heads=64 topk=2048 page_block_size=64 topk_extra=512 extra_page_block_size=64"
    )


def test_0_6_17_decode_miss_with_an_extra_cache_still_aborts_in_the_orchestrator() -> None:
    """(64, 256) is not a DSV3.2 decode pair: the call falls through to the C++ orchestrator."""
    verdict = supports(SparseMlaConfig(**{**DECODE, "topk": 256}, **EXTRA), "0.6.17")
    assert not verdict.supported and verdict.error_type is InternalError
    assert verdict.error_message == (
        "Check failed: num_tokens > 64 (4 vs. 64) : Decode (num_tokens <= 64) must go through "
        "sparse_mla_sm120_decode_dsv3_2 or sparse_mla_sm120_decode_dsv4; got num_tokens=4"
    )


def test_the_reference_under_the_grid_warns(recwarn: pytest.WarningsRecorder) -> None:
    """``--sparse-mla-grid flashinfer==0.6.17``: the bundled reference sees the silent drop."""
    import torch

    from pytest_sparse_mla import data, formats
    from pytest_sparse_mla.attention import sparse_mla_forward

    g = torch.Generator().manual_seed(0)
    cache = formats.quantize_pack(data.latent((2, 64, 576), g), "dsv3_2", page_stride="padded")
    q = data.latent((1, 8, 576), g)
    idx = data.sparse_indices(1, 128, 128, g)
    res = sparse_mla_forward(
        q, cache, idx, sm_scale=576**-0.5, fmt="dsv3_2", extra_kv_cache=cache, extra_indices=idx,
        grid_release="0.6.17",
    )  # fmt: skip
    assert res.grid is not None and res.grid.extra_cache_ignored
    assert [w.category for w in recwarn.list] == [IgnoredExtraCacheWarning]
