"""Self-test of the DeepSeek-V4.1 dispatch grid (``DSV4_1`` from flashinfer-python 0.7.1,
``DSV4_1_INLINE`` from 0.7.4) and of the reference's enforcement of it.

The expectations are written here from the release sources, independently of ``grids.json``:

* ``data/include/flashinfer/attention/sparse_mla_sm120/execution/attention_plan.h``: every
  DeepSeek-V4.1 page size is a runtime value (``runtime_page``); ``visit_prefill_heads`` gives the
  single-group prefill (variant 1) heads 8, 16, 32, 64 and the multi-group (2, 3) and swapAB (4)
  variants none; ``visit_decode_heads`` falls back to the generic kernel for any head count.
* ``data/csrc/sparse_mla_sm120/attention_resolve.cu`` ``resolve_attention``: at most 128 heads
  (``DecodeMaxHeads``), a dual cache allowed for DSV4 and DeepSeek-V4.1, prefill needs
  ``topk % 64 == 0``, the single-group route serves a V4.1 dual cache, numeric route FP8.
* ``flashinfer/mla/_sparse_mla_sm120/_prepared.py``: decode first (``num_tokens <= 64``), else the
  prefill variant, else the Python ``ValueError`` of ``_api._decode_dispatch_error_message`` whose
  ``model_type=`` is the family name (``_execution.MODEL_FAMILIES``: 5 ``dsv4_1``, 6
  ``dsv4_1_inline``).
* ``model_type.h``: ``DSV4_1`` first in 0.7.1 (0.7.0 has no V4.1 format), ``DSV4_1_INLINE`` in 0.7.4;
  ``dsv41_layout.cuh``: 0.7.1-0.7.2.post1 read V4.1 pages in footer layout only.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from pytest_sparse_mla import data
from pytest_sparse_mla.attention import sparse_mla_forward
from pytest_sparse_mla.dispatch import (
    FooterRecordsWarning,
    SparseMlaConfig,
    UnsupportedReleaseError,
    UnsupportedShapeError,
    enforce_grid,
    inline_v41_model,
    supports,
)

V41_RELEASES = ("0.7.1", "0.7.2", "0.7.2.post1", "0.7.4")
FAMILY_NAME = {"DSV4_1": "dsv4_1", "DSV4_1_INLINE": "dsv4_1_inline"}
META_HEADS = (
    "Check failed: (t > 0 && h > 0 && h <= execution::DecodeMaxHeads) is false: "
    "unsupported tokens/heads"
)


def no_kernel(t: int, h: int, k: int, p: int, family: str, e: int) -> str:
    return (
        f"SM120 sparse-MLA has no decode kernel for this shape: num_tokens={t}, num_heads={h}, "
        f"topk={k}, d_qk=512, page_block_size={p}, model_type={family}, extra_topk={e}. "
        "Mismatch: no matching decode instantiation. The decode instantiations (num_tokens <= 64) "
        "and the prefill envelope both reject it. Query supported shapes at init time with "
        "flashinfer.mla.supported_sparse_mla_sm120_configs()."
    )


def expected(model: str, t: int, h: int, k: int, p: int, e: int) -> tuple:
    if h > 128:
        return ("error", ValueError, META_HEADS)
    if t <= 64:
        return ("ok", "decode", None)
    if h in (8, 16, 32, 64) and k % 64 == 0:
        return ("ok", "prefill_dual" if e else "prefill_single", "FP8")
    return ("error", ValueError, no_kernel(t, h, k, p, FAMILY_NAME[model], e))


@pytest.mark.parametrize("release", V41_RELEASES)
def test_v41_cross_product_matches_the_release_rules(release: str) -> None:
    models = ["DSV4_1"] + (["DSV4_1_INLINE"] if release == "0.7.4" else [])
    disagreements, checked = [], 0
    for model in models:
        for h in (8, 16, 24, 32, 64, 128, 256):
            for k in (100, 128, 512, 2048):
                for t in (1, 64, 65):
                    for p in (1, 64, 256):
                        for e, ep in ((0, 0), (512, 2), (512, 64), (100, 128)):
                            checked += 1
                            v = supports(SparseMlaConfig(model, t, h, k, p, e, ep), release)
                            want = expected(model, t, h, k, p, e)
                            if want[0] == "ok":
                                got: tuple = ("ok", v.route, v.numeric_route)
                                ok = v.supported and got == want
                            else:
                                got = ("error", v.error_type, v.error_message)
                                ok = (not v.supported and v.error_type is not None
                                      and issubclass(v.error_type, want[1]) and v.error_message == want[2])
                            if not ok:
                                disagreements.append(f"{model} T={t} H={h} topk={k} page={p} extra={e}@{ep}: "
                                                     f"want {want}, got {got}")  # fmt: skip
    assert checked == len(models) * 7 * 4 * 3 * 3 * 4
    assert not disagreements, f"{len(disagreements)} of {checked} disagree:\n" + "\n".join(disagreements[:20])


@pytest.mark.parametrize(
    ("model", "release"),
    [("DSV4_1", "0.6.17"), ("DSV4_1", "0.7.0.post1"), ("DSV4_1_INLINE", "0.7.2.post1"), ("DSV4_1_INLINE", "0.7.1")],
)
def test_a_v41_model_before_its_first_release_is_refused(model: str, release: str) -> None:
    with pytest.raises(UnsupportedReleaseError, match=rf"has no {model} cache format"):
        supports(SparseMlaConfig(model, 1, 64, 512, 64), release)


def test_inline_records_are_judged_by_the_release_that_reads_them() -> None:
    assert inline_v41_model("0.7.4") == ("DSV4_1_INLINE", None)
    model, note = inline_v41_model("flashinfer==0.7.2.post1")
    assert model == "DSV4_1" and note is not None and "footer layout only" in note and "0.7.4" in note
    with pytest.raises(UnsupportedReleaseError):
        inline_v41_model("0.7.0")


def _v41_call(num_tokens: int, num_heads: int, page_block_size: int = 64) -> dict:
    g = torch.Generator().manual_seed(0)
    main = data.make_packed_cache(g, fmt="dsv4_1_swa", num_pages=3, page_block_size=page_block_size)
    extra = data.make_packed_cache(g, fmt="dsv4_1_indexed", num_pages=2, page_block_size=page_block_size)
    return {
        "q": data.latent((num_tokens, num_heads, 512), g),
        "kv_cache": main.packed,
        "indices": data.sparse_indices(num_tokens, 64, main.num_tokens, g),
        "extra_kv_cache": extra.packed,
        "extra_indices": data.sparse_indices(num_tokens, 64, extra.num_tokens, g),
        "sm_scale": 512**-0.5,
        "fmt": "dsv4_1",
    }


def test_the_reference_raises_the_release_text_for_a_v41_prefill_with_128_heads() -> None:
    call = _v41_call(65, 128)
    for release, family in (("0.7.2.post1", "dsv4_1"), ("0.7.4", "dsv4_1_inline")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FooterRecordsWarning)
            with pytest.raises(UnsupportedShapeError) as info:
                sparse_mla_forward(**call, grid_release=release)
        assert str(info.value) == no_kernel(65, 128, 64, 64, family, 64)


def test_the_reference_warns_where_the_release_reads_footer_pages_only() -> None:
    with pytest.warns(FooterRecordsWarning, match="footer layout only"):
        res = sparse_mla_forward(**_v41_call(2, 16), grid_release="0.7.2.post1")
    assert res.route == "decode"
    with warnings.catch_warnings():
        warnings.simplefilter("error", FooterRecordsWarning)
        sparse_mla_forward(**_v41_call(2, 16), grid_release="0.7.4")  # reads inline records
        sparse_mla_forward(**_v41_call(2, 16, page_block_size=1), grid_release="0.7.2.post1")  # same bytes


def test_the_reference_refuses_v41_under_a_release_without_it_and_fp4_as_the_main_cache() -> None:
    with pytest.raises(UnsupportedReleaseError, match="has no DSV4_1 cache format"):
        sparse_mla_forward(**_v41_call(2, 16), grid_release="0.7.0")
    call = _v41_call(2, 16)
    g = torch.Generator().manual_seed(1)
    fp4 = data.make_packed_cache(g, fmt="dsv4_1_indexed", num_pages=3, page_block_size=64)
    call.update(kv_cache=fp4.packed, extra_kv_cache=fp4.packed, fmt="dsv4_1_indexed")
    with pytest.raises(ValueError, match=r"fmt='dsv4_1_indexed'.*only in the extra cache"):
        sparse_mla_forward(**call, grid_release="0.7.4")


def test_enforce_grid_accepts_the_v41_models() -> None:
    verdict = enforce_grid("0.7.4", model="DSV4_1_INLINE", num_tokens=65, num_heads=64, topk=512,
                           page_block_size=64, topk_extra=512, extra_page_block_size=2)  # fmt: skip
    assert (verdict.route, verdict.numeric_route) == ("prefill_dual", "FP8")
