"""Self-tests of ``pytest_sparse_mla.tolerances`` (the comparison model) and of the conformance data.

Every expected number is derived here by hand from the module's documented formulas, never read
back from the code under test.
"""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch

from pytest_sparse_mla import tolerances
from pytest_sparse_mla.attention import oracle_forward, sparse_mla_forward
from pytest_sparse_mla.attention.cases import (
    FLASHINFER_CASES,
    AttentionCase,
    CacheCase,
    Conventions,
    Values,
    make_inputs,
)
from pytest_sparse_mla.fixtures import seed_id

KERNEL = tolerances.DEFAULT_PROFILES["kernel"]
TIGHT = tolerances.DEFAULT_PROFILES["tight"]


def _scales(abs_weighted: torch.Tensor, rms: torch.Tensor, n: int = 1) -> SimpleNamespace:
    return SimpleNamespace(abs_weighted=abs_weighted, rms_weighted=rms,
                           score_magnitude=torch.zeros(rms.shape, dtype=torch.float64), max_candidates=n)  # fmt: skip


def test_profiles_are_the_documented_rounding_models() -> None:
    assert (KERNEL.p_unit_roundoff, KERNEL.p_roundings, KERNEL.score_unit_roundoff) == (2.0**-8, 3, 2.0**-8)
    assert not KERNEL.score_rounding_on_bf16_exact and not KERNEL.bitwise_invariants
    fp8 = tolerances.DEFAULT_PROFILES["kernel-fp8"]
    assert (fp8.p_unit_roundoff, fp8.score_unit_roundoff, fp8.score_rounding_on_bf16_exact) == (2.0**-4, 2.0**-4, True)
    assert TIGHT.bitwise_invariants and TIGHT.p_unit_roundoff == 2.0**-24


@pytest.mark.parametrize(
    ("attrs", "profile"),
    [({}, "kernel"), ({"compute_mode": "exact"}, "tight"), ({"compute_mode": "bf16"}, "kernel"),
     ({"compute_mode": "fp8"}, "kernel-fp8"), ({"compute_mode": "fp8", "tolerance_profile": "tight"}, "tight")],
)  # fmt: skip
def test_profile_follows_the_compute_mode(attrs: dict[str, str], profile: str) -> None:
    assert tolerances.profile_for(SimpleNamespace(**attrs)) == profile


def test_unknown_compute_mode_is_a_usage_error() -> None:
    with pytest.raises(tolerances.ToleranceSpecError, match="compute_mode='bf8'"):
        tolerances.profile_for(SimpleNamespace(compute_mode="bf8"))


def test_elementwise_bound_by_hand() -> None:
    """One row, BF16 output, kernel profile on DSV4 (no score term): bound at element d is
    ``(3 * 2**-8 + N * 2**-24) * M_d + 2**-8 * |E_d| + 2**-125``."""
    e = torch.tensor([[[0.5, -0.25, 0.0, 1.0]]], dtype=torch.float64)
    m = torch.tensor([[[1.0, 1.0, 0.0, 1.0]]], dtype=torch.float64)
    n = 4
    bound = (3 * 2.0**-8 + n * 2.0**-24) * m + 2.0**-8 * e.abs() + 2.0**-125
    scales = _scales(m, torch.tensor([[1.0]], dtype=torch.float64), n)
    inside = (e + 0.99 * bound).to(torch.float32)
    # stay inside the statistical row bound too: only element 0 moves
    inside[..., 1:] = e[..., 1:].float()
    inside[..., 0] = float(e[0, 0, 0] + 0.5 * bound[0, 0, 0])
    assert tolerances.compare_output(inside, e, profile=KERNEL, scales=scales).ok
    outside = e.clone().float()
    outside[..., 3] = float(e[0, 0, 3] + 1.01 * bound[0, 0, 3])
    report = tolerances.compare_output(outside, e, profile=KERNEL, scales=scales)
    assert not report.ok and any("elementwise: 1 of 4" in v for v in report.violations), report.message()
    empty = torch.zeros_like(e)
    nonzero = empty.clone().float()
    nonzero[..., 2] = 1e-30  # element 2 has M = E = 0: only a flushed subnormal may appear there
    report = tolerances.compare_output(nonzero, e * 0, profile=KERNEL, scales=_scales(m * 0, torch.zeros(1, 1)))
    assert not report.ok


def test_row_and_overall_bounds_by_hand() -> None:
    """A float64 result carries no output rounding (``u_o = 0``), so ``sigma_r = sqrt(3 (2**-8 R)**2 / 3)
    = 2**-8 R``; the row bound is ``4 sigma_r`` (no worst-case terms with N = 0 and no score term),
    the overall bound ``2 sqrt(sum sigma_r**2)``."""
    d = 512
    e = torch.full((1, 2, d), 0.125, dtype=torch.float64)
    r = torch.full((1, 2), 0.125 * math.sqrt(d), dtype=torch.float64)  # R = ||E_r||
    scales = _scales(torch.full_like(e, 1.0), r, 0)
    sigma = 2.0**-8 * float(r[0, 0])
    # a uniform relative error eps on every element of row 0 only: ||A_r - E_r|| = eps ||E_r||
    for eps, ok in ((0.95 * 4 * sigma / float(r[0, 0]), True), (1.05 * 4 * sigma / float(r[0, 0]), False)):
        a = e.clone()
        a[0, 0] *= 1 + eps
        report = tolerances.compare_output(a, e, profile=KERNEL, scales=scales)
        assert any("per-row" in v for v in report.violations) != ok, report.message()
    overall = 2 * math.sqrt(2 * sigma**2) / float(torch.linalg.vector_norm(e))
    a = e * (1 + 1.05 * overall)  # every row off by the same relative error: overall fails first
    report = tolerances.compare_output(a, e, profile=KERNEL, scales=scales)
    assert any("overall normwise relative error" in v for v in report.violations), report.message()


def test_zero_output_and_per_head_factor_are_named() -> None:
    e = torch.randn((4, 3, 512), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    report = tolerances.compare_output(torch.zeros_like(e).to(torch.bfloat16), e, profile=KERNEL)
    assert not report.ok and "all zero" in report.message()
    scaled = e.clone()
    scaled[:, 1] *= 0.75
    report = tolerances.compare_output(scaled.to(torch.bfloat16), e, profile=KERNEL)
    assert "head 1: x0.75" in report.message(), report.message()
    assert report.message().count("output") <= 2  # no doubled labels


def test_a_token_suffix_is_named_only_after_a_token_that_came_out_right() -> None:
    """Tokens 2..5 wrong after two right ones: token tiling is named. Tokens 2..5 wrong after two
    empty rows (expected output zero, which any kernel that drops candidates also gets right): it
    is not, since nothing shows that the tokens before 2 are handled differently."""
    e = torch.randn((6, 3, 512), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    wrong = e.clone()
    wrong[2:] = torch.randn((4, 3, 512), generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    named = tolerances.compare_output(wrong.to(torch.bfloat16), e, profile=KERNEL).message()
    assert "tokens 2..5 are wrong: token tiling or batch stride?" in named, named
    e[:2] = 0.0
    wrong[:2] = 0.0
    silent = tolerances.compare_output(wrong.to(torch.bfloat16), e, profile=KERNEL).message()
    assert "FAIL" in silent and "token tiling" not in silent, silent


def test_lse_in_natural_log_units_and_causes() -> None:
    """FlashInfer convention with ``lse_scale`` 0.5: a returned difference ``x`` is
    ``x * ln 2 / 0.5`` natural-log units; the kernel profile allows ``2**-10`` (+ ``2**-23 |lse|``)."""
    e = torch.tensor([[4.0, 8.0]], dtype=torch.float64)
    allowed = 2.0**-10 * 0.5 / math.log(2.0)  # in returned units, before the representation term
    ok = tolerances.compare_lse(e + 0.9 * allowed, e, profile=KERNEL, lse_convention="flashinfer", lse_scale=0.5)
    assert ok.ok, ok.message()
    bad = tolerances.compare_lse(e + 1.5 * allowed, e, profile=KERNEL, lse_convention="flashinfer", lse_scale=0.5)
    assert not bad.ok and "natural-log units" in bad.message()
    natural = tolerances.compare_lse(e * math.log(2.0), e, profile=KERNEL)
    assert "off by ln 2" in natural.message(), natural.message()
    inf = tolerances.compare_lse(torch.tensor([[-math.inf]]), torch.tensor([[math.inf]]), profile=KERNEL)
    assert not inf.ok
    same = tolerances.compare_lse(torch.tensor([[-math.inf]]), torch.tensor([[-math.inf]]), profile=KERNEL)
    assert same.ok


def test_ini_lines_parse_and_reject_garbage() -> None:
    parsed = tolerances.parse_ini_lines(["kernel.row_sigmas = 6", "  # comment", "mine.lse_abs=1e-3", ""])
    assert parsed == {"kernel": {"row_sigmas": 6.0}, "mine": {"lse_abs": 1e-3}}
    bad_lines = {
        "row_sigmas = 1": "expected 'PROFILE.PARAMETER = VALUE'",
        "kernel.nope = 1": "unknown parameter 'nope'",
        "kernel.lse_abs = lots": "expected a number, got 'lots'",
        "kernel.lse_abs = -1": "expected a non-negative finite number, got '-1'",
        "kernel.bitwise_invariants = maybe": "expected true or false, got 'maybe'",
    }
    for bad, message in bad_lines.items():
        with pytest.raises(tolerances.ToleranceSpecError, match=re.escape(f"line {bad!r}: {message}")):
            tolerances.parse_ini_lines([bad])


def test_a_bad_ini_line_stops_the_session_with_a_usage_error(pytester: pytest.Pytester) -> None:
    """The pytest-free parser's error reaches the user as pytest's usage error (exit code 4)."""
    pytester.makeini("[pytest]\nsparse_mla_tolerances =\n    kernel.nope = 1\n")
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest("-p", "sparse_mla")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: ini sparse_mla_tolerances line 'kernel.nope = 1': unknown parameter 'nope'*"])


def test_a_bad_marker_parameter_errors_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.sparse_mla_tolerance(rowsigmas=1)
        def test_x(sparse_mla_tolerances):
            pass
        """
    )
    result = pytester.runpytest("-p", "sparse_mla")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*UsageError: @pytest.mark.sparse_mla_tolerance: unknown parameter 'rowsigmas'*"])


def test_resolution_order_impl_then_marker_profile_then_ini_then_marker_values() -> None:
    ini = {"kernel": {"lse_abs": 1e-3}}
    mark = SimpleNamespace
    assert tolerances.resolve(None, {}, []).profile == "kernel"
    tight = tolerances.resolve("tight", ini, [])
    assert tight.model.lse_abs == 1e-6  # ini of another profile ignored
    forced = tolerances.resolve("tight", ini, [mark(args=(), kwargs={"profile": "kernel"})])
    assert forced.profile == "kernel" and forced.model.lse_abs == 1e-3
    keyed = tolerances.resolve("tight", ini, [mark(args=(), kwargs={"row_sigmas": 8})])
    assert keyed.model.row_sigmas == 8.0 and keyed.profile == "tight"
    custom = tolerances.resolve("mine", {"mine": {"lse_abs": 0.5}}, [])
    assert custom.model.lse_abs == 0.5 and custom.model.p_unit_roundoff == 2.0**-8  # starts at kernel
    with pytest.raises(tolerances.ToleranceSpecError, match="unknown parameter 'rowsigmas'"):
        tolerances.resolve("tight", {}, [mark(args=(), kwargs={"rowsigmas": 1})])


def test_tolerance_fixture_reads_ini_and_marker(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nsparse_mla_tolerances =\n    tight.lse_abs = 0.125\n")
    pytester.makepyfile(
        """
        import pytest
        import torch

        def test_ini(sparse_mla_tolerances):
            assert sparse_mla_tolerances.profile == "tight"
            assert sparse_mla_tolerances.model.lse_abs == 0.125

        @pytest.mark.sparse_mla_tolerance(profile="kernel", row_sigmas=2)
        def test_marker(sparse_mla_tolerances):
            assert sparse_mla_tolerances.model.row_sigmas == 2
            assert sparse_mla_tolerances.model.p_unit_roundoff == 2.0 ** -8

        def test_failure_names_the_profile(sparse_mla_tolerances):
            with pytest.raises(AssertionError, match="tolerance profile 'tight'"):
                sparse_mla_tolerances.check_output(torch.ones(1, 1, 4), torch.zeros(1, 1, 4))
        """
    )
    result = pytester.runpytest("-p", "sparse_mla", "--strict-markers")
    result.assert_outcomes(passed=3)


def test_assert_equal_reports_the_difference() -> None:
    tolerances.assert_equal(torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0]))
    with pytest.raises(AssertionError, match="1 of 2 elements differ"):
        tolerances.assert_equal(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 2.0]), what="x")


# --- conformance data --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "nodeid",
    ["suites/test_attention_accuracy.py::test_x[fi-wide-scales]",
     "/tmp/run/venv/lib/python3.12/site-packages/pytest_sparse_mla/suites/test_attention_accuracy.py::test_x[fi-wide-scales]",
     "test_attention_accuracy.py::test_x[fi-wide-scales]"],
)  # fmt: skip
def test_seed_id_does_not_depend_on_the_install_or_run_path(nodeid: str) -> None:
    assert seed_id(SimpleNamespace(nodeid=nodeid)) == "test_attention_accuracy.py::test_x[fi-wide-scales]"


@pytest.mark.parametrize("seed", range(8))
def test_wide_scales_case_passes_tight_on_many_seeds(seed: int) -> None:
    """The bundled reference passes ``tight`` on the wide-scale case whatever the seed (a seed
    that happened to put an element near a cancellation failed the old relative bound)."""
    case = next(c for c in FLASHINFER_CASES if c.name == "fi-wide-scales")
    inputs = make_inputs(case, torch.Generator().manual_seed(seed))
    res = inputs.run(sparse_mla_forward)
    tolerances.resolve("tight", {}, []).check_result(res, inputs.run(oracle_forward))


def test_peaked_queries_put_the_chosen_logit_near_peak() -> None:
    """Head 0 picks the main cache's first valid lane, head 1 the extra cache's: their logits are
    ``peak`` plus the random query's own small score (here under 1.5)."""
    case = AttentionCase("p", 2, 2, CacheCase(64), extra=CacheCase(64, page_block_size=64, num_pages=2),
                         values=Values("peaked", peak=8.0), conventions=Conventions(with_sink=False))  # fmt: skip
    inputs = make_inputs(case, torch.Generator().manual_seed(3))
    q = inputs.q.double()
    k_main = inputs.cache.flat_dequantized().double()[int(inputs.indices[0, 0])]
    k_extra = inputs.extra.flat_dequantized().double()[int(inputs.extra_indices[0, 0])]
    assert abs(float(q[0, 0] @ k_main) * inputs.sm_scale - 8.0) < 1.5
    assert abs(float(q[0, 1] @ k_extra) * inputs.sm_scale - 8.0) < 1.5


def test_layer_views_sit_at_the_hand_computed_offsets() -> None:
    """Layer 3 of 4 DSV4 page-64 caches: offset ``3 * 37,440`` bytes, page stride ``4 * 37,440``."""
    case = AttentionCase("l", 1, 1, CacheCase(64, layer=3, num_layers=4))
    inputs = make_inputs(case, torch.Generator().manual_seed(0))
    assert inputs.cache.packed.storage_offset() == 112_320 and inputs.cache.packed.stride(0) == 149_760


def _placed_call(fmt: str, scale_end: str, value_exponent: int) -> object:
    """A decode call whose stored scales are ``scale_end`` (``DrawnCache.scale_end``) and whose NoPE
    values are about ``2**value_exponent``; the search places the queries so that the logits keep
    their spread (large queries for small keys)."""
    from pytest_sparse_mla import search

    main = search.DrawnCache(width=128, page_block_size=64, num_pages=2, lengths=None, masked_fraction=0.0,
                             mask_value=-1, scattered=False, pattern="uniform", stale="-1",
                             value_exponent=value_exponent, rope_exponent=0, wide=False, form="3d", stride="tight",
                             layer=0, num_layers=1, canary=0, scale_end=scale_end)  # fmt: skip
    return search.DrawnCall(fmt=fmt, num_tokens=4, num_heads=8, main=main, extra=None, sm_scale=("1", 1.0),
                            score_spread=0.3, score_offset=0.0, peak=0.0, sink=None, lse_convention="flashinfer",
                            lse_scale=1.0, empty_fraction=0.0, strided_query=False, poison=0x7F, seed=0)  # fmt: skip


def _values_below_zeroed(inputs: object, cut: float, monkeypatch: pytest.MonkeyPatch) -> object:
    """The float64 oracle's result over ``inputs`` with every dequantized cache value below ``cut``
    in magnitude read as 0 (a simulated kernel), rounded as a kernel returns it."""
    from pytest_sparse_mla import formats

    dequantize = formats.unpack_dequantize

    def zeroed(*args, **kwargs):  # type: ignore[no-untyped-def]
        values = dequantize(*args, **kwargs)
        return values.masked_fill(values.abs() < cut, 0.0)

    with monkeypatch.context() as m:
        m.setattr(formats, "unpack_dequantize", zeroed)
        out = oracle_forward(inputs.q, inputs.kv_cache, inputs.indices, **inputs.kwargs)
    return SimpleNamespace(output=out.output.to(torch.bfloat16), lse=out.lse.to(torch.float32))


def test_a_kernel_that_flushes_subnormal_keys_is_within_bound_and_one_that_drops_normal_ones_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Flush-to-zero (GPU fp32 arithmetic and tensor-core inputs, PTX ``.ftz``) reads a subnormal key
    element as 0. With V4.1's smallest scales (UE8M0 byte 0, ``2**-127``) every NoPE key is a
    subnormal and the placed queries are about ``2**120``: the flushed logits differ by up to 0.035
    natural-log units in LSE, which the oracle's ``flush_magnitude`` admits (and nothing else would:
    without it the same kernel fails). A kernel that zeroes normal keys (below ``2**-8`` on a call
    whose values are about ``2**-6``) is still caught."""
    import dataclasses

    from pytest_sparse_mla import search
    from pytest_sparse_mla.attention import oracle_forward

    tol = tolerances.resolve("tight", {}, [])  # the reference's profile
    inputs = search.build(_placed_call("dsv4_1", "smallest", -20), "cpu")
    exact = oracle_forward(inputs.q, inputs.kv_cache, inputs.indices, **inputs.kwargs)
    flushing = _values_below_zeroed(inputs, 2.0**-126, monkeypatch)
    assert float((flushing.lse - exact.lse).abs().max()) > 1e-2  # the flush is visible
    tol.check_result(flushing, exact, fmt="dsv4_1", what="flushing kernel")
    without = dataclasses.replace(exact, scales=dataclasses.replace(exact.scales, flush_magnitude=None))
    with pytest.raises(AssertionError, match="LSE"):
        tol.check_result(flushing, without, fmt="dsv4_1", what="flushing kernel, no flush term")

    small = search.build(_placed_call("dsv4_1", "none", -6), "cpu")
    small_exact = oracle_forward(small.q, small.kv_cache, small.indices, **small.kwargs)
    tol.check_result(_values_below_zeroed(small, 2.0**-126, monkeypatch), small_exact, fmt="dsv4_1")
    with pytest.raises(AssertionError):
        tol.check_result(_values_below_zeroed(small, 2.0**-8, monkeypatch), small_exact, fmt="dsv4_1")


def test_a_shape_mismatch_is_a_clear_error_before_any_arithmetic() -> None:
    """A result ``[T, H*512]`` for ``[T, H, 512]``, and a pair of such results compared with the
    oracle's scales of ``[T, H, 512]`` rows (an invariance check: both sides share the wrong shape),
    raise a ``ValueError`` naming the tensor and both shapes, never torch's broadcasting error."""
    e = torch.randn((2, 4, 512), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    rms = torch.ones((2, 4), dtype=torch.float64)
    scales = _scales(e.abs(), rms)
    flat = e.reshape(2, -1).to(torch.bfloat16)
    with pytest.raises(ValueError, match=re.escape("output: the result has shape [2, 2048], expected [2, 4, 512]")):
        tolerances.compare_output(flat, e, profile=KERNEL, scales=scales)
    with pytest.raises(
        ValueError, match=re.escape("output: scales.abs_weighted has shape [2, 4, 512], expected [2, 1, 2048]")
    ):
        tolerances.compare_output(flat, flat, profile=KERNEL, scales=scales, pair=True)
    with pytest.raises(ValueError, match=re.escape("scales.abs_weighted has shape [2, 4, 512], expected [2, 1, 2048]")):
        tolerances.output_bound(flat, profile=KERNEL, scales=scales)
    lse = torch.zeros((2, 4), dtype=torch.float32)
    with pytest.raises(ValueError, match=re.escape("lse: the result has shape [4, 2], expected [2, 4]")):
        tolerances.compare_lse(lse.t(), lse, profile=KERNEL, scales=scales)
    with pytest.raises(ValueError, match=re.escape("lse: scales.score_magnitude has shape [2, 4], expected [2, 2]")):
        tolerances.compare_lse(lse[:, :2], lse[:, :2], profile=KERNEL, scales=scales, pair=True)
    with pytest.raises(ValueError, match=re.escape("scales.score_magnitude has shape [2, 4], expected [2, 2]")):
        tolerances.lse_bound(lse[:, :2], profile=KERNEL, scales=scales)


def _slot0_case() -> tuple[object, object]:
    """A DSV4 case of 6 tokens and 4 heads whose tokens 2 and 4 read slot 0 (index value 0) among
    their valid lanes; the others read no index 0; no sink."""
    inputs = make_inputs(AttentionCase("slot0", 6, 4, CacheCase(64, num_pages=4)), torch.Generator().manual_seed(5))
    rows = inputs.indices.clone()
    rows[rows == 0] = 1
    rows[2, 3] = 0
    rows[4, 0] = 0
    return inputs, rows


def test_a_kernel_that_masks_index_0_gets_that_cause_and_no_other() -> None:
    """``kernel_catalogue.index0_masked`` (every lane of index value 0 masked): exactly the rows that
    read slot 0 are wrong; the comparison names that cause, from the oracle's ``slot0_weight`` and
    ``slot0_output``, not "token tiling or batch stride", "the output is all zero" or "a per-head
    constant offset" (the hints this kernel used to get); the LSE too. The bundled reference and a
    kernel that drops the sink get no such hint."""
    from kernel_catalogue import drops_sink, index0_masked

    inputs, rows = _slot0_case()
    kw = inputs.kwargs()
    oracle = oracle_forward(inputs.q, inputs.cache.packed, rows, **kw)
    assert oracle.scales.slot0_weight[[2, 4]].gt(0).all() and oracle.scales.slot0_weight[[0, 1, 3, 5]].eq(0).all()
    wrong = index0_masked.sparse_mla_forward(inputs.q, inputs.cache.packed, rows, **kw)
    out = tolerances.compare_output(wrong.output, oracle.output, profile=KERNEL, scales=oracle.scales)
    text = out.message()
    assert not out.ok and [k for k, _ in out.causes] == ["index-0-treated-as-invalid"], text
    assert (
        "likely cause [index-0-treated-as-invalid]: the 8 wrong (token, head) rows all read index value 0 and "
        "match the oracle's output with every lane of index 0 masked: index 0 taken for the mask sentinel" in text
    )
    lse = tolerances.compare_lse(wrong.lse, oracle.lse, profile=KERNEL, scales=oracle.scales)
    assert [k for k, _ in lse.causes] == ["index-0-treated-as-invalid"], lse.message()
    for bystander in (drops_sink, None):
        kw_s = {**kw, "attn_sink": torch.linspace(-1.0, 2.0, 4)}
        ref = oracle_forward(inputs.q, inputs.cache.packed, rows, **kw_s)
        res = (bystander.sparse_mla_forward if bystander else sparse_mla_forward)(inputs.q, inputs.cache.packed, rows,
                                                                                   **kw_s)  # fmt: skip
        report = tolerances.compare_output(res.output, ref.output, profile=KERNEL, scales=ref.scales)
        assert "index-0" not in report.message(), report.message()


def test_an_lse_of_minus_inf_where_the_sink_is_expected_names_the_sink() -> None:
    """FlashInfer convention: a row without a valid lane has its sink as LSE (log2 units here); a
    kernel that drops the sink returns -inf there: the sink is named, not the empty-row sentinel.
    FlashMLA convention (sink excluded): such a row's LSE is +inf, and a finite 0 there is the sentinel."""
    sink_lse = torch.tensor([[1.5, 0.25], [1.5, 0.25]], dtype=torch.float64) / math.log(2.0)
    dropped = torch.tensor([[1.5 / math.log(2.0), -math.inf], [1.5 / math.log(2.0), -math.inf]])
    report = tolerances.compare_lse(dropped, sink_lse, profile=KERNEL, lse_convention="flashinfer")
    assert [k for k, _ in report.causes] == ["sink-or-normaliser"], report.message()
    assert "the LSE is -inf where the oracle's is finite (2 rows)" in report.message()
    empty = torch.full((2, 2), math.inf, dtype=torch.float64)
    sentinel = tolerances.compare_lse(torch.zeros(2, 2), empty, profile=KERNEL, lse_convention="flashmla")
    assert [k for k, _ in sentinel.causes] == ["empty-row-sentinel"], sentinel.message()
