"""Self-test of the bundled FlashInfer SM120 sparse-MLA dispatch grids, per release (``pytest_sparse_mla.dispatch``).

These check the bundled tables, error texts, deployments report and the reference's enforcement
helpers; ``suites/test_dispatch_grid.py`` holds the selected implementation to them when it declares
``flashinfer_release`` (its own runs under declared releases are at the end of this file).

Expectations here are written independently of the shipped ``grids.json``: hand-transcribed
tables of the instantiated sets and rules per release family (read from the flashinfer-python
wheels' ``flashinfer/mla/_sparse_mla_sm120*.py`` and ``data/csrc/sparse_mla_sm120*``), message templates typed from the
release sources, and literal error strings as published in public tracebacks (sgl-project/sglang
#33134, #33985; flashinfer-ai/flashinfer #3828, PRs #3817 and #3896) or printed by the
releases' own Python code run on CPU (0.6.18, 0.7.0, 0.7.4; see ``scripts/flashinfer_introspect.py``).
The regressions this guards: extra_page_block_size=128 rejected by dual-cache prefill, the head
envelope changing between releases (8 heads at TP8), topk 256 missing from prefill, topk 192
missing from decode.
"""

from __future__ import annotations

import json
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path

import inner_session
import pytest

from pytest_sparse_mla import deployments
from pytest_sparse_mla.dispatch import (
    InternalError,
    SparseMlaConfig,
    SparseMlaGridError,
    UncheckedPageSizeWarning,
    UnsupportedReleaseError,
    UnsupportedShapeError,
    enforce_grid,
    release_family,
    supports,
)
from pytest_sparse_mla.dispatch import report as report_module

# ----------------------------------------------------------------------------------------------
# Hand-written tables, one per release family (read from the wheels' sources).

HEADS = (8, 16, 32, 64, 128)

#: release -> family (the first release of the family): releases whose SM120 sources are identical.
FAMILY_OF = {
    "0.6.14": "0.6.14",
    "0.6.15": "0.6.14",
    "0.6.16": "0.6.14",
    "0.6.17": "0.6.14",
    "0.6.18": "0.6.18",
    "0.6.18.post1": "0.6.18",
    "0.7.0": "0.7.0",
    "0.7.0.post1": "0.7.0",
    "0.7.1": "0.7.1",
    "0.7.2": "0.7.1",
    "0.7.2.post1": "0.7.1",
    "0.7.4": "0.7.1",
}
FAMILY_LABEL = {
    "0.6.14": "0.6.14-0.6.17",
    "0.6.18": "0.6.18(.post1)",
    "0.7.0": "0.7.0(.post1)",
    "0.7.1": "0.7.1+",
}

#: DSV4 decode pairs (exact sets before 0.7.0): 15 pairs, then 25 pairs (PR #4380).
DECODE_DSV4 = {
    "0.6.14": {(h, k) for h in HEADS for k in (128, 512, 1024)},
    "0.6.18": {(h, k) for h in HEADS for k in (128, 192, 256, 512, 1024)},
}
#: DSV3.2 decode pairs, unchanged until 0.7.0: 20 pairs.
DECODE_DSV3_2 = {(h, k) for h in HEADS for k in (128, 512, 1024, 2048)}
#: DSV4 single-cache prefill before 0.7.0: heads, topk -> numeric route.
PREFILL_SINGLE_DSV4 = {
    "0.6.14": ({16, 32, 64, 128}, {128: "BF16", 512: "FP8", 1024: "FP8", 2048: "FP8"}),
    "0.6.18": (
        set(HEADS),
        {128: "BF16", 192: "BF16", 256: "BF16", 512: "FP8", 1024: "FP8", 2048: "FP8"},
    ),
}
#: DSV4 dual-cache prefill heads before 0.7.0 (topk 128 only, BF16, extra page 2 or 64).
PREFILL_DUAL_DSV4_HEADS = {"0.6.14": {16, 32, 64, 128}, "0.6.18": set(HEADS)}


def cpp_prefill(model, h, k, p, e, ep, variant=None):  # type: ignore[no-untyped-def]
    """C++ prefill miss, 0.6.14-0.7.0 (csrc/sparse_mla_sm120.cu, TVM_FFI_ICHECK(ok))."""
    text = (
        "Check failed: (ok) is false: Unsupported sparse-MLA prefill configuration: "
        f"model={model} num_heads={h} topk={k} page_block_size={p} topk_extra={e} "
        f"extra_page_block_size={ep}"
    )
    return text if variant is None else f"{text} variant={variant}"


def cpp_decode(t):  # type: ignore[no-untyped-def]
    """0.6.14-0.6.17 decode-sized call reaching the prefill-only orchestrator."""
    return (
        f"Check failed: num_tokens > 64 ({t} vs. 64) : Decode (num_tokens <= 64) must go through "
        f"sparse_mla_sm120_decode_dsv3_2 or sparse_mla_sm120_decode_dsv4; got num_tokens={t}"
    )


def cpp_heads(h):  # type: ignore[no-untyped-def]
    """0.6.x orchestrator TVM_FFI_ICHECK_LE(num_heads, 128) (no message after the colon)."""
    return f"Check failed: num_heads <= 128 ({h} vs. 128) : "


def py_v1(t, h, k, d, p, model_type, e):  # type: ignore[no-untyped-def]
    """0.6.18 Python ValueError (model_type printed as the integer, DSV3_2=0, DSV4=1)."""
    return (
        f"SM120 sparse-MLA has no decode kernel for this shape: num_tokens={t}, num_heads={h}, "
        f"topk={k}, d_qk={d}, page_block_size={p}, model_type={model_type}, extra_topk={e}. "
        "Supported decode shapes are enumerated in _DECODE_DSV4_DISPATCH and "
        "_DECODE_DSV3_2_DISPATCH."
    )


def py_v2(t, h, k, d, p, family, e, mismatch):  # type: ignore[no-untyped-def]
    """0.7.0+ Python ValueError with the Mismatch part."""
    return (
        f"SM120 sparse-MLA has no decode kernel for this shape: num_tokens={t}, num_heads={h}, "
        f"topk={k}, d_qk={d}, page_block_size={p}, model_type={family}, extra_topk={e}. "
        f"Mismatch: {mismatch}. The decode instantiations (num_tokens <= 64) and the prefill "
        "envelope both reject it. Query supported shapes at init time with "
        "flashinfer.mla.supported_sparse_mla_sm120_configs()."
    )


META_HEADS = (
    "Check failed: (t > 0 && h > 0 && h <= execution::DecodeMaxHeads) is false: "
    "unsupported tokens/heads"
)


def expected(family, model, t, h, k, p, e=0, ep=0):  # type: ignore[no-untyped-def]
    """The release family's behaviour, written from the release sources' control flow.

    Returns ("ok", route, numeric_route, unchecked_page) or ("error", builtin base, message).
    """
    d, mt, fam_name, cpp = (512, 1, "dsv4", "DSV4") if model == "DSV4" else (576, 0, "dsv3_2", "DSV3_2")
    dual = e > 0
    if family in ("0.6.14", "0.6.18"):
        pairs = DECODE_DSV4[family] if model == "DSV4" else DECODE_DSV3_2
        if t <= 64 and p == 64 and (h, k) in pairs:
            return ("ok", "decode", None, False)
        if t <= 64 and family == "0.6.18":
            return ("error", ValueError, py_v1(t, h, k, d, p, mt, e))
        if h > 128:
            return ("error", RuntimeError, cpp_heads(h))
        if t <= 64:
            return ("error", RuntimeError, cpp_decode(t))
        unchecked = p != 64  # the prefill kernels never test the main page size
        if model == "DSV4" and dual:
            if h in PREFILL_DUAL_DSV4_HEADS[family] and k == 128 and ep in (2, 64):
                return ("ok", "prefill_dual", "BF16", unchecked)
        elif model == "DSV4":
            heads, modes = PREFILL_SINGLE_DSV4[family]
            if h in heads and k in modes:
                return ("ok", "prefill_single", modes[k], unchecked)
        elif k == 2048 and h in HEADS:
            return ("ok", "prefill_single", "FP8", unchecked)
        return ("error", RuntimeError, cpp_prefill(cpp, h, k, p, e, ep))
    if family == "0.7.0":
        decode_ok = t <= 64 and p == 64 and 1 <= h <= 128
        prefill_ok = p == 64 and k % 64 == 0 and h in HEADS
        if decode_ok:
            return ("ok", "decode", None, False)
        if prefill_ok:
            if dual and ep not in (2, 64):
                return ("error", RuntimeError, cpp_prefill(cpp, h, k, p, e, ep, variant=3))
            if model == "DSV3_2":
                return ("ok", "prefill_single", "FP8", False)
            if dual:
                return ("ok", "prefill_dual", "BF16", False)
            return ("ok", "prefill_single", "BF16" if k <= 256 else "FP8", False)
        reasons = []
        if p != 64:
            reasons.append(
                f"page_block_size={p} is unsupported; decode kernels are instantiated only for "
                "page_block_size=64"
            )
        if h > 128:
            reasons.append(f"num_heads={h} exceeds the decode envelope [1, 128]")
        mismatch = "; ".join(reasons) or "no matching decode instantiation"
        return ("error", ValueError, py_v2(t, h, k, d, p, fam_name, e, mismatch))
    assert family == "0.7.1"
    if h > 128:
        return ("error", ValueError, META_HEADS)
    if t <= 64:
        return ("ok", "decode", None, False)
    if k % 64 == 0 and h in HEADS:
        if model == "DSV3_2":
            return ("ok", "prefill_single", "FP8", False)
        if dual:
            return ("ok", "prefill_dual", "QkBF16PvFP8", False)
        return ("ok", "prefill_single", "QkBF16PvFP8" if k <= 256 else "FP8", False)
    return (
        "error",
        ValueError,
        py_v2(t, h, k, d, p, fam_name, e, "no matching decode instantiation"),
    )


def cross_product(model: str) -> Iterator[tuple[int, ...]]:
    """heads x topk x num_tokens {1, 64, 65} x page sizes x extra cache."""
    extras = ((0, 0), (512, 64), (512, 2), (512, 128), (100, 64)) if model == "DSV4" else ((0, 0),)
    for h in (8, 16, 24, 32, 64, 128, 256):
        for k in (100, 128, 192, 256, 512, 1024, 2048):
            for t in (1, 64, 65):
                for p in (32, 64, 128):
                    for e, ep in extras:
                        yield (t, h, k, p, e, ep)


# ----------------------------------------------------------------------------------------------
# The cross product agrees with the data.


@pytest.mark.parametrize("release", [*FAMILY_OF, "0.6.15.post1", "0.9.0"])
def test_cross_product_matches_the_release_rules(release: str) -> None:
    """Every config of the cross product gets the route/mode or the exact error of its release."""
    family = FAMILY_OF.get(release) or ("0.6.14" if release.startswith("0.6.15") else "0.7.1")
    disagreements = []
    checked = 0
    for model in ("DSV4", "DSV3_2"):
        for t, h, k, p, e, ep in cross_product(model):
            checked += 1
            verdict = supports(SparseMlaConfig(model, t, h, k, p, e, ep), release)
            want = expected(family, model, t, h, k, p, e, ep)
            if want[0] == "ok":
                got = ("ok", verdict.route, verdict.numeric_route, verdict.unchecked_page_size)
                ok = verdict.supported and got == want and verdict.error_type is None
            else:
                got = ("error", verdict.error_type, verdict.error_message)
                ok = (
                    not verdict.supported
                    and verdict.error_type is not None
                    and issubclass(verdict.error_type, want[1])
                    and verdict.error_message == want[2]
                    and verdict.reason
                )
            if not ok:
                disagreements.append(f"{model} T={t} H={h} topk={k} page={p} extra={e}@{ep}: "
                                     f"want {want}, got {got}")  # fmt: skip
    assert checked == 7 * 7 * 3 * 3 * 5 + 7 * 7 * 3 * 3
    assert not disagreements, f"{len(disagreements)} of {checked} disagree:\n" + "\n".join(
        disagreements[:20]
    )


def test_release_families() -> None:
    """Each examined release maps to its family; specifiers and prefixes are honoured."""
    for release, family in FAMILY_OF.items():
        assert release_family(release).name == family
        assert release_family(release).label == FAMILY_LABEL[family]
        assert release_family(f"flashinfer=={release}").name == family
    assert release_family("0.6.16.post4").name == "0.6.14"  # not examined: range decides
    assert release_family("0.8.0").name == "0.7.1"


@pytest.mark.parametrize(
    ("release", "needle"),
    [
        ("0.6.13", "first release with it is 0.6.14"),
        ("0.5.3", "has no SM120 sparse-MLA backend"),
        ("0.6.18rc2", "pre-releases are not covered"),
        ("0.7.0.dev1", "pre-releases are not covered"),
        ("banana", "expected a flashinfer-python version"),
    ],
)
def test_releases_without_a_grid_raise_a_clear_error(release: str, needle: str) -> None:
    with pytest.raises(UnsupportedReleaseError, match=needle) as info:
        supports(SparseMlaConfig("DSV4", 1, 64, 128, 64), release)
    assert isinstance(info.value, ValueError)
    assert repr(release) in str(info.value)


def test_unexamined_release_is_flagged_in_the_notes() -> None:
    verdict = supports(SparseMlaConfig("DSV4", 1, 64, 128, 64), "0.6.15.post1")
    assert verdict.supported
    assert any("0.6.15.post1 was not examined" in note for note in verdict.notes)
    verdict = supports(SparseMlaConfig("DSV4", 1, 64, 128, 64), "0.6.17")
    assert not any("not examined" in note for note in verdict.notes)


# ----------------------------------------------------------------------------------------------
# Named regressions.

TP8_SWA = {"model": "DSV4", "num_tokens": 65, "num_heads": 8, "topk": 128, "page_block_size": 64}


@pytest.mark.parametrize("release", ["0.6.14", "0.6.17"])
def test_tp8_prefill_with_8_local_heads_fails_before_0_6_18(release: str) -> None:
    """V4-Flash TP8 (64 / 8 heads) prefill: no NH=8 prefill kernel before PR #4380."""
    with pytest.raises(RuntimeError) as info:
        enforce_grid(release, **TP8_SWA)
    assert type(info.value) is InternalError
    assert str(info.value) == (
        "Check failed: (ok) is false: Unsupported sparse-MLA prefill configuration: model=DSV4 "
        "num_heads=8 topk=128 page_block_size=64 topk_extra=0 extra_page_block_size=0"
    )
    assert info.value.release == release
    with pytest.raises(RuntimeError, match="topk_extra=512 extra_page_block_size=2$"):
        enforce_grid(release, **TP8_SWA, topk_extra=512, extra_page_block_size=2)  # C128 layer


@pytest.mark.parametrize(
    ("release", "mode"),
    [("0.6.18", "BF16"), ("0.6.18.post1", "BF16"), ("0.7.0", "BF16"), ("0.7.4", "QkBF16PvFP8")],
)
def test_tp8_prefill_with_8_local_heads_works_from_0_6_18(release: str, mode: str) -> None:
    verdict = enforce_grid(release, **TP8_SWA)
    assert (verdict.supported, verdict.route, verdict.numeric_route) == (True, "prefill_single", mode)
    dual = enforce_grid(release, **TP8_SWA, topk_extra=512, extra_page_block_size=64)
    assert (dual.route, dual.numeric_route) == ("prefill_dual", mode)


def test_topk_256_prefill_regression() -> None:
    """flashinfer-ai/flashinfer #3828 / PR #3896: 32 heads, topk 256, prefill (published text)."""
    published = (
        "Check failed: (ok) is false: Unsupported sparse-MLA prefill configuration: "
        "model=DSV4 num_heads=32 topk=256 page_block_size=64 topk_extra=0 extra_page_block_size=0"
    )
    with pytest.raises(RuntimeError) as info:
        enforce_grid("0.6.17", model="DSV4", num_tokens=1024, num_heads=32, topk=256,
                     page_block_size=64)  # fmt: skip
    assert str(info.value) == published
    # PR #3834 measured BF16 faster than FP8 at topk 256; PR #4380 shipped it in BF16.
    verdict = enforce_grid("0.6.18", model="DSV4", num_tokens=1024, num_heads=32, topk=256,
                           page_block_size=64)  # fmt: skip
    assert (verdict.route, verdict.numeric_route) == ("prefill_single", "BF16")


def test_dspark_topk_192_prefill_regression() -> None:
    """sgl-project/sglang #33134 (DSpark draft, TP2, 64 padded heads): published text."""
    with pytest.raises(RuntimeError) as info:
        enforce_grid("0.6.17", model="DSV4", num_tokens=512, num_heads=64, topk=192,
                     page_block_size=64)  # fmt: skip
    assert str(info.value) == (
        "Check failed: (ok) is false: Unsupported sparse-MLA prefill configuration: "
        "model=DSV4 num_heads=64 topk=192 page_block_size=64 topk_extra=0 extra_page_block_size=0"
    )
    verdict = supports(SparseMlaConfig("DSV4", 512, 64, 192, 64), "0.6.18")
    assert (verdict.route, verdict.numeric_route) == ("prefill_single", "BF16")


@pytest.mark.parametrize(
    ("num_tokens", "num_heads", "topk"),
    [(50, 64, 192), (5, 32, 192), (5, 32, 256), (7, 32, 256)],
    ids=["sglang-33985", "sglang-33943", "flashinfer-pr-3817", "flashinfer-3828"],
)
def test_dspark_decode_topk_192_256_regression(num_tokens: int, num_heads: int, topk: int) -> None:
    """A decode-sized call with a non-instantiated topk aborts in the prefill-only orchestrator
    on 0.6.17 (published: "Check failed: num_tokens > 64 (50 vs. 64) : Decode ..."), and is
    served by decode from 0.6.18 (PR #4380)."""
    with pytest.raises(RuntimeError) as info:
        enforce_grid("0.6.17", model="DSV4", num_tokens=num_tokens, num_heads=num_heads,
                     topk=topk, page_block_size=64)  # fmt: skip
    assert type(info.value) is InternalError
    assert str(info.value) == (
        f"Check failed: num_tokens > 64 ({num_tokens} vs. 64) : Decode (num_tokens <= 64) must go "
        "through sparse_mla_sm120_decode_dsv3_2 or sparse_mla_sm120_decode_dsv4; "
        f"got num_tokens={num_tokens}"
    )
    for release in ("0.6.18", "0.7.0", "0.7.4"):
        assert enforce_grid(release, model="DSV4", num_tokens=num_tokens, num_heads=num_heads,
                            topk=topk, page_block_size=64).route == "decode"  # fmt: skip


C4_EXTRA_128 = {"model": "DSV4", "num_tokens": 65, "num_heads": 64, "topk": 128,
                "page_block_size": 64, "topk_extra": 512, "extra_page_block_size": 128}  # fmt: skip


@pytest.mark.parametrize(
    ("release", "message"),
    [
        ("0.6.17", cpp_prefill("DSV4", 64, 128, 64, 512, 128)),
        ("0.6.18", cpp_prefill("DSV4", 64, 128, 64, 512, 128)),
        ("0.7.0", cpp_prefill("DSV4", 64, 128, 64, 512, 128, variant=3)),
        ("0.7.0.post1", cpp_prefill("DSV4", 64, 128, 64, 512, 128, variant=3)),
    ],
)
def test_extra_page_128_dual_prefill_is_rejected_until_0_7_1(release: str, message: str) -> None:
    """Dual-cache prefill instantiates extra pages 2 and 64 only; 0.7.0 checks it only in C++
    (the planner still picks MG_DUAL = variant 3)."""
    with pytest.raises(RuntimeError) as info:
        enforce_grid(release, **C4_EXTRA_128)
    assert type(info.value) is InternalError
    assert str(info.value) == message


@pytest.mark.parametrize("release", ["0.7.1", "0.7.2", "0.7.2.post1", "0.7.4"])
def test_extra_page_128_dual_prefill_works_from_0_7_1(release: str) -> None:
    verdict = enforce_grid(release, **C4_EXTRA_128)
    assert (verdict.route, verdict.numeric_route) == ("prefill_dual", "QkBF16PvFP8")


@pytest.mark.parametrize("release", ["0.6.17", "0.6.18", "0.7.0", "0.7.4"])
def test_extra_page_size_is_runtime_in_decode(release: str) -> None:
    """The decode kernels take the extra page size as a runtime divisor in every release."""
    verdict = enforce_grid(release, **{**C4_EXTRA_128, "num_tokens": 1})
    assert verdict.route == "decode"


def test_0_7_0_decode_note_warns_about_the_crossover_hazard() -> None:
    verdict = supports(SparseMlaConfig("DSV4", 1, 64, 128, 64, 512, 128), "0.7.0")
    assert any("crossover" in n and "extra_page_block_size=128" in n for n in verdict.notes)


# ----------------------------------------------------------------------------------------------
# Routing uses the primary index width (topk), never topk_extra.


def test_routing_uses_the_primary_topk_not_the_extra_width() -> None:
    # topk_extra=2048 is not a DSV4 decode width; topk=128 is: decode serves it.
    assert supports(SparseMlaConfig("DSV4", 1, 64, 128, 64, 2048, 2), "0.6.17").route == "decode"
    # dual prefill needs topk == 128; topk_extra=512 would have meant FP8 single-cache.
    verdict = supports(SparseMlaConfig("DSV4", 65, 64, 128, 64, 512, 64), "0.6.17")
    assert (verdict.route, verdict.numeric_route) == ("prefill_dual", "BF16")
    # topk=512 with an extra width of 128: rejected although 128 is the instantiated width.
    verdict = supports(SparseMlaConfig("DSV4", 65, 64, 512, 64, 128, 64), "0.6.17")
    assert verdict.error_message == cpp_prefill("DSV4", 64, 512, 64, 128, 64)
    # decode: topk=192 misses although the extra width 128 is a decode width.
    verdict = supports(SparseMlaConfig("DSV4", 1, 64, 192, 64, 128, 64), "0.6.17")
    assert verdict.error_message == cpp_decode(1)
    # 0.7.x prefill: topk % 64 decides; a ragged extra width (100) does not matter.
    verdict = supports(SparseMlaConfig("DSV4", 65, 64, 128, 64, 100, 64), "0.7.4")
    assert verdict.route == "prefill_dual"


# ----------------------------------------------------------------------------------------------
# Texts printed by the releases' own Python code (run on CPU; see scripts/flashinfer_introspect.py).


def test_0_6_18_decode_miss_text() -> None:
    verdict = supports(SparseMlaConfig("DSV4", 5, 32, 128, 128), "0.6.18")
    assert verdict.error_type is UnsupportedShapeError
    assert verdict.error_message == (
        "SM120 sparse-MLA has no decode kernel for this shape: num_tokens=5, num_heads=32, "
        "topk=128, d_qk=512, page_block_size=128, model_type=1, extra_topk=0. Supported decode "
        "shapes are enumerated in _DECODE_DSV4_DISPATCH and _DECODE_DSV3_2_DISPATCH."
    )


@pytest.mark.parametrize(
    ("release", "config", "mismatch"),
    [
        ("0.7.0", ("DSV4", 65, 24, 128, 64), "no matching decode instantiation"),
        ("0.7.4", ("DSV4", 65, 24, 128, 64), "no matching decode instantiation"),
        (
            "0.7.0",
            ("DSV4", 5, 32, 128, 128),
            "page_block_size=128 is unsupported; decode kernels are instantiated only for "
            "page_block_size=64",
        ),
        ("0.7.0", ("DSV4", 65, 200, 128, 64), "num_heads=200 exceeds the decode envelope [1, 128]"),
        ("0.7.4", ("DSV4", 65, 64, 100, 64), "no matching decode instantiation"),
    ],
)
def test_0_7_value_error_text(release: str, config: tuple, mismatch: str) -> None:
    cfg = SparseMlaConfig(*config)
    with pytest.raises(ValueError) as info:
        enforce_grid(release, **{f: getattr(cfg, f) for f in (
            "model", "num_tokens", "num_heads", "topk", "page_block_size")})  # fmt: skip
    assert type(info.value) is UnsupportedShapeError
    assert str(info.value) == (
        f"SM120 sparse-MLA has no decode kernel for this shape: num_tokens={cfg.num_tokens}, "
        f"num_heads={cfg.num_heads}, topk={cfg.topk}, d_qk=512, "
        f"page_block_size={cfg.page_block_size}, model_type=dsv4, extra_topk=0. Mismatch: "
        f"{mismatch}. The decode instantiations (num_tokens <= 64) and the prefill envelope both "
        "reject it. Query supported shapes at init time with "
        "flashinfer.mla.supported_sparse_mla_sm120_configs()."
    )


def test_head_envelope_changes_between_releases() -> None:
    """24 heads: no decode pair before 0.7.0; a runtime-H decode instantiation from 0.7.0 (the
    public wrapper still rejects it); never a prefill kernel."""
    cfg = SparseMlaConfig("DSV4", 1, 24, 128, 64)
    assert supports(cfg, "0.6.17").error_message == cpp_decode(1)
    verdict = supports(cfg, "0.7.0")
    assert verdict.route == "decode"
    assert any(
        "Expected 8, 16, 32, 64, or 128 query heads for SM120 DSv4 sparse MLA, got 24" in note
        for note in verdict.notes
    )
    assert not supports(SparseMlaConfig("DSV4", 65, 24, 128, 64), "0.7.4").supported


@pytest.mark.parametrize(
    ("release", "config", "error_type", "message"),
    [
        ("0.6.17", ("DSV4", 1, 256, 128, 64), InternalError, cpp_heads(256)),
        ("0.6.18", ("DSV4", 65, 256, 128, 64), InternalError, cpp_heads(256)),
        ("0.6.18", ("DSV4", 1, 256, 128, 64), UnsupportedShapeError,
         py_v1(1, 256, 128, 512, 64, 1, 0)),
        ("0.7.1", ("DSV4", 1, 256, 128, 64), UnsupportedShapeError, META_HEADS),
    ],
)  # fmt: skip
def test_more_than_128_heads(release: str, config: tuple, error_type: type, message: str) -> None:
    verdict = supports(SparseMlaConfig(*config), release)
    assert (verdict.error_type, verdict.error_message) == (error_type, message)


# ----------------------------------------------------------------------------------------------
# Main prefill page size: unchecked in 0.6.x, checked in 0.7.0, runtime from 0.7.1.


@pytest.mark.parametrize("release", ["0.6.17", "0.6.18"])
def test_0_6_prefill_page_size_is_unchecked_not_rejected(release: str) -> None:
    with pytest.warns(UncheckedPageSizeWarning, match="page_block_size=128 is not checked"):
        verdict = enforce_grid(release, model="DSV4", num_tokens=65, num_heads=64, topk=128,
                               page_block_size=128)  # fmt: skip
    assert verdict.supported and verdict.unchecked_page_size
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not enforce_grid(release, model="DSV4", num_tokens=65, num_heads=64, topk=128,
                                page_block_size=64).unchecked_page_size  # fmt: skip


def test_page_size_after_0_6() -> None:
    cfg = SparseMlaConfig("DSV4", 65, 64, 128, 128)
    assert supports(cfg, "0.7.0").error_type is UnsupportedShapeError
    verdict = supports(cfg, "0.7.1")
    assert verdict.supported and not verdict.unchecked_page_size
    odd = supports(SparseMlaConfig("DSV4", 1, 64, 128, 33), "0.7.4")
    assert odd.supported and any("padded page stride" in n for n in odd.notes)


# ----------------------------------------------------------------------------------------------
# API contract: config validation, error types, verdict serialisation.


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"model": "DSV5"}, "model='DSV5'"),
        ({"num_heads": 0}, "num_heads=0"),
        ({"topk": True}, "topk=True"),
        ({"num_tokens": 2.0}, "num_tokens=2.0"),
        ({"topk_extra": 512}, "topk_extra=512, extra_page_block_size=0"),
        ({"model": "DSV3_2", "extra_page_block_size": 2}, "topk_extra=0, extra_page_block_size=2"),
    ],
)
def test_bad_config_names_the_argument(kwargs: dict, needle: str) -> None:
    base = {"model": "DSV4", "num_tokens": 1, "num_heads": 64, "topk": 128, "page_block_size": 64}
    with pytest.raises(ValueError) as info:
        SparseMlaConfig(**{**base, **kwargs})
    assert needle in str(info.value)


def test_model_aliases_normalise() -> None:
    assert SparseMlaConfig("dsv3.2", 1, 8, 128, 64).model == "DSV3_2"
    assert SparseMlaConfig("dsv4", 1, 8, 128, 64) == SparseMlaConfig("DSV4", 1, 8, 128, 64)
    with pytest.raises(TypeError, match="expected a SparseMlaConfig"):
        supports({"model": "DSV4"}, "0.7.4")  # type: ignore[arg-type]


def test_error_classes_mirror_the_upstream_types() -> None:
    assert issubclass(InternalError, RuntimeError) and issubclass(InternalError, SparseMlaGridError)
    assert InternalError.kind == "InternalError"
    assert issubclass(UnsupportedShapeError, ValueError)
    assert issubclass(UnsupportedShapeError, SparseMlaGridError)
    assert not issubclass(UnsupportedReleaseError, SparseMlaGridError)
    error = supports(SparseMlaConfig("DSV4", 65, 8, 128, 64), "0.6.17").error
    clone = pickle.loads(pickle.dumps(error))  # pytest-xdist ships exceptions between processes
    assert type(clone) is InternalError and str(clone) == str(error)
    assert clone.release == "0.6.17" and clone.config == error.config


def test_verdict_to_dict_is_json() -> None:
    verdict = supports(SparseMlaConfig("DSV4", 65, 8, 128, 64), "0.6.17")
    data = json.loads(json.dumps(verdict.to_dict()))
    assert data["supported"] is False
    assert (data["error_type"], data["error_base"]) == ("InternalError", "RuntimeError")
    assert data["config"]["num_heads"] == 8
    assert "compute_mode" not in data and data["numeric_route"] is None
    served = supports(SparseMlaConfig("DSV4", 65, 16, 128, 64), "0.6.17").to_dict()
    assert (served["route"], served["numeric_route"]) == ("prefill_single", "BF16")


def test_verdict_compute_mode_is_a_deprecated_alias_of_numeric_route() -> None:
    """``Verdict.compute_mode`` and ``COMPUTE_MODES`` keep working (the grid's word is now
    ``numeric_route``: an implementation's ``compute_mode`` is a tolerance profile)."""
    from pytest_sparse_mla import dispatch

    verdict = supports(SparseMlaConfig("DSV4", 65, 16, 2048, 64), "0.6.17")
    with pytest.warns(DeprecationWarning, match="Verdict.numeric_route"):
        assert verdict.compute_mode == verdict.numeric_route == "FP8"
    assert dispatch.COMPUTE_MODES is dispatch.NUMERIC_ROUTES == ("BF16", "FP8", "QkBF16PvFP8")


def test_grid_package_imports_no_torch() -> None:
    """The grid is pure Python: importing it in a fresh interpreter pulls in no torch. The CI tool
    ``scripts/flashinfer_introspect.py`` imports none either, and the package neither ships it nor
    imports it."""
    import subprocess
    import sys
    from pathlib import Path

    tool = Path(__file__).resolve().parents[1] / "scripts" / "flashinfer_introspect.py"
    code = (
        "import importlib.util, sys, pytest_sparse_mla.dispatch, pytest_sparse_mla.dispatch.report, "
        "pytest_sparse_mla.deployments; "
        "shipped = importlib.util.find_spec('pytest_sparse_mla.dispatch.introspect') is not None; "
        "loaded = any('introspect' in name for name in sys.modules); "
        f"spec = importlib.util.spec_from_file_location('flashinfer_introspect', {str(tool)!r}); "
        "module = importlib.util.module_from_spec(spec); sys.modules['flashinfer_introspect'] = module; "
        "spec.loader.exec_module(module); "
        "print('torch' in sys.modules, 'flashinfer' in sys.modules, shipped, loaded)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "False", "False"]


# ----------------------------------------------------------------------------------------------
# Deployments and the coverage report.


def test_deployment_shapes() -> None:
    """Per-rank heads = total / TP (V4-Flash 64, V4-Pro 128); SWA topk 128 at page 64; C4 extra
    512 at page 256 / 4; C128 at page 256 / 128; DSpark topk 192 (SGLang pads to 64 heads)."""
    by_key = {d.key: d for d in deployments.DEPLOYMENTS}
    assert len(by_key) == 2 * 3 * 4 + 2 * 4
    for tp, flash, pro in ((1, 64, 128), (2, 32, 64), (4, 16, 32), (8, 8, 16)):
        assert by_key[f"DeepSeek-V4-Flash/SWA/TP{tp}"].num_heads == flash
        assert by_key[f"DeepSeek-V4-Pro/C4/TP{tp}"].num_heads == pro
        assert by_key[f"DeepSeek-V4-Flash/DSpark draft/TP{tp}"].num_heads == flash
        assert by_key[f"DeepSeek-V4-Flash/DSpark draft (SGLang 64-head pad)/TP{tp}"].num_heads == 64
    c4, c128 = by_key["DeepSeek-V4-Pro/C4/TP2"], by_key["DeepSeek-V4-Pro/C128/TP2"]
    assert (c4.topk, c4.page_block_size, c4.extra_topk, c4.extra_page_block_size) == (128, 64, 512, 64)
    assert (c128.topk, c128.page_block_size, c128.extra_page_block_size) == (128, 64, 2)
    draft = by_key["DeepSeek-V4-Flash/DSpark draft/TP2"]
    assert (draft.topk, draft.extra_topk, draft.decode_num_tokens) == (192, 0, 6)
    assert report_module.deployment_config(draft, "prefill") == SparseMlaConfig("DSV4", 65, 32, 192, 64)
    with pytest.raises(ValueError, match="phase='verify'"):
        report_module.deployment_config(draft, "verify")


def test_report_text_lists_the_gaps() -> None:
    """0.6.17 misses: V4-Flash TP8 prefill of SWA/C4/C128 (3) and every DSpark call (2 variants x
    4 TP x 2 phases = 16): 64 - 19 = 45 served. Later releases serve all 64."""
    text = report_module.render("text")
    assert "0.6.17 [0.6.14-0.6.17]: serves 45 of 64 deployment calls" in text
    for release in ("0.6.18.post1 [0.6.18(.post1)]", "0.7.0.post1 [0.7.0(.post1)]", "0.7.4 [0.7.1+]"):
        assert f"{release}: serves 64 of 64 deployment calls" in text
    assert "on 0.6.17: prefill_single: DSV4 single-cache prefill has no kernel for num_heads=8" in text
    assert cpp_prefill("DSV4", 64, 192, 64, 0, 0) in text  # sglang #33134
    assert cpp_decode(6) in text  # DSpark verify (gamma 5 + 1)


def test_report_json_and_console_script(capsys: pytest.CaptureFixture[str]) -> None:
    assert report_module.main(["--format", "json", "--release", "0.6.17", "--release", "0.7.0"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert [r["release"] for r in document["releases"]] == ["0.6.17", "0.7.0"]
    assert len(document["rows"]) == 64
    row = next(r for r in document["rows"]
               if r["deployment"]["key"] == "DeepSeek-V4-Flash/SWA/TP8" and r["phase"] == "prefill")  # fmt: skip
    assert row["verdicts"]["0.6.17"]["error_base"] == "RuntimeError"
    assert row["verdicts"]["0.7.0"]["route"] == "prefill_single"
    assert document["summary"]["0.6.17"] == {"served": 45, "total": 64}
    assert report_module.main(["--release", "0.6.13"]) == 2
    assert "first release with it is 0.6.14" in capsys.readouterr().err


def test_error_templates_document_the_texts() -> None:
    """``errors.ERROR_TEMPLATES`` (the per-release documentation) formats to the same texts."""
    from pytest_sparse_mla.dispatch.errors import ERROR_TEMPLATES

    fields = {"model": "DSV4", "num_tokens": 5, "num_heads": 32, "topk": 256, "d_qk": 512,
              "page_block_size": 64, "topk_extra": 0, "extra_page_block_size": 0,
              "model_type_int": 1, "family": "dsv4", "variant": 2,
              "mismatch": "no matching decode instantiation"}  # fmt: skip
    texts = {family: [t.format(**fields) for _, _, t in entries]
             for family, entries in ERROR_TEMPLATES.items()}  # fmt: skip
    assert set(texts) == {"0.6.14", "0.6.18", "0.7.0", "0.7.1"}
    assert texts["0.6.14"] == [cpp_decode(5), cpp_prefill("DSV4", 32, 256, 64, 0, 0), cpp_heads(32)]
    assert texts["0.6.18"] == [
        py_v1(5, 32, 256, 512, 64, 1, 0), cpp_prefill("DSV4", 32, 256, 64, 0, 0), cpp_heads(32)
    ]
    v2 = py_v2(5, 32, 256, 512, 64, "dsv4", 0, "no matching decode instantiation")
    assert texts["0.7.0"] == [v2, cpp_prefill("DSV4", 32, 256, 64, 0, 0, variant=2)]
    assert texts["0.7.1"] == [v2, META_HEADS]


# ----------------------------------------------------------------------------------------------
# The conformance suite (suites/test_dispatch_grid.py) under a declared release.

SUITE = Path(__file__).resolve().parents[1] / "suites" / "test_dispatch_grid.py"

CLAIMS_AN_OLDER_RELEASE = """
from pytest_sparse_mla.implementations import ReferenceImplementation


class ClaimsOldRelease(ReferenceImplementation):
    \"\"\"Declares 0.6.17 but dispatches like 0.7.4 (a kernel built from newer sources).\"\"\"

    name = "claims-0.6.17"

    def __init__(self):
        super().__init__("0.7.4")

    @property
    def flashinfer_release(self):
        return "0.6.17"
"""


def test_suite_holds_the_reference_to_the_release_it_enforces(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """0.7.0 rejects shapes both in C++ (RuntimeError) and in Python (ValueError), serves 11 and the empty
    batch, and has no DeepSeek-V4.1 format (its 4 shapes skip); 0.7.4 serves two V4.1 shapes and rejects two
    (128-head and ragged-topk prefill)."""
    result = inner_session.runpytest(
        pytester,
        "-p", "sparse_mla", str(SUITE), "--sparse-mla-grid", "flashinfer==0.7.0",
        "--sparse-mla-device", "cpu", "-p", "no:cacheprovider", "-q", monkeypatch=monkeypatch, capsys=capsys,
    )  # fmt: skip
    result.assert_outcomes(passed=17, skipped=4)
    result = inner_session.runpytest(
        pytester,
        "-p", "sparse_mla", str(SUITE), "--sparse-mla-grid", "flashinfer==0.7.4",
        "--sparse-mla-device", "cpu", "-p", "no:cacheprovider", "-q", "-k", "v41", monkeypatch=monkeypatch,
        capsys=capsys,
    )  # fmt: skip
    result.assert_outcomes(passed=4)


def test_suite_skips_an_implementation_without_a_release(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    result = inner_session.runpytest(
        pytester,
        "-p", "sparse_mla", str(SUITE), "--sparse-mla-device", "cpu", "-p", "no:cacheprovider", "-rs",
        monkeypatch=monkeypatch, capsys=capsys,
    )  # fmt: skip
    result.assert_outcomes(skipped=21)
    result.stdout.fnmatch_lines(["*declares no flashinfer_release*"])


def test_suite_fails_an_implementation_that_claims_another_release(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """8-head prefill must raise 0.6.17's C++ error (0.7.4 serves it); 256 heads must raise
    0.6.17's orchestrator check, not 0.7.4's ValueError; 16-head decode runs in both."""
    pytester.makepyfile(claims_old=CLAIMS_AN_OLDER_RELEASE)
    result = inner_session.runpytest(
        pytester,
        "-p", "sparse_mla", str(SUITE), "--sparse-mla-impl", "claims_old:ClaimsOldRelease",
        "--sparse-mla-device", "cpu", "-p", "no:cacheprovider", "-q",
        "-k", "flash-tp8-prefill-h8] or decode-h256 or decode-h8-topk128", monkeypatch=monkeypatch, capsys=capsys,
    )  # fmt: skip
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines_random([
        "FAILED *[[]flash-tp8-prefill-h8[]]*",
        "FAILED *[[]decode-h256[]]*",
        "*T=65 H=8 topk=128 page=64: ran, but the release has no kernel for it and raises RuntimeError*",
        "*T=1 H=256 topk=128 page=64: raised UnsupportedShapeError*expected a RuntimeError*",
    ])  # fmt: skip
