"""Sparse-MLA attention accuracy: the implementation under test against the float64 oracle.

Specification (every comparison through the ``sparse_mla_tolerances`` fixture: elementwise bound
scaled by ``sum_j w_j |V_j|``, per-row and overall normwise error, cosine, LSE in natural-log units,
with the rounding model of the implementation's compute mode; ``pytest_sparse_mla.tolerances``):

* On FlashInfer's SM120 test configurations and data distribution (``attention.cases.
  FLASHINFER_CASES``) and on every DeepSeek-V4 deployment shape (``attention.cases.
  deployment_cases``), output and LSE match the oracle.
* On data that makes each error class visible (``attention.cases.CONFORMANCE_CASES``): queries
  aligned with chosen candidates in each cache (a wrong score scale or a wrong row moves the softmax),
  one dominant key, near-uniform scores, large and ``-inf`` sinks, mixed magnitudes across the main
  and extra caches, 1, 5, 17 and 33 heads, per-layer views with non-zero storage offsets and padded
  or tight page strides chosen independently for each cache, both formats.
* Around FlashInfer's decode/prefill cutoff (``num_tokens`` 1, 63, 64, 65, 128) results stay
  accurate and, where the implementation reports one, the route is ``decode`` iff ``T <= 64``.
* LSE conventions, both formats: FlashInfer (log2, sink included, times ``lse_scale``) and
  FlashMLA (natural log, sink excluded).
* A row without a valid candidate gives output exactly 0 and LSE ``-inf`` (no sink, or a ``-inf``
  sink), ``sink * log2(e) * lse_scale`` (finite sink) or ``+inf`` (FlashMLA convention).
* Inputs from public bug reports: 32 heads read their own token's index row (not a 16-head group's
  neighbour); each of four per-layer views of one pool reads its own layer.

Every case is fitted to the implementation's envelope (``sparse_mla_inputs``,
``attention.cases.fit_case``): the same construction at head counts, widths and page sizes the
kernel takes; a case that cannot exist inside the envelope is skipped as not applicable. Large
cases (``large=True``) run only on CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch

from pytest_sparse_mla.attention import oracle_forward
from pytest_sparse_mla.attention.cases import (
    CONFORMANCE_CASES,
    FLASHINFER_CASES,
    AttentionCase,
    AttentionInputs,
    CacheCase,
    Conventions,
    Values,
    deployment_cases,
)
from pytest_sparse_mla.envelope import ALL_FORMATS
from pytest_sparse_mla.guard import check_result_shapes
from pytest_sparse_mla.parametrize import case_params

pytestmark = pytest.mark.sparse_mla_needs("sparse_mla_forward")

LOG2E = 1.0 / math.log(2.0)
DUAL_C4 = CacheCase(128, page_block_size=64, num_pages=4)


def _what(inputs: AttentionInputs) -> str:
    case = inputs.case
    return f"{case.name} (fitted: {', '.join(case.fitted)})" if case.fitted else case.name


def _matches_oracle(impl: object, inputs: AttentionInputs, tol: object, **overrides: object) -> object:
    res = inputs.run(impl.sparse_mla_forward, **overrides)
    expected = inputs.run(oracle_forward, **overrides)
    check_result_shapes(res, inputs.q.shape[0], inputs.q.shape[1])
    tol.check_result(res, expected, fmt=inputs.case.conventions.fmt, what=_what(inputs))
    return res


@pytest.mark.sparse_mla_error_class("flashinfer-configurations")
@pytest.mark.parametrize("case", case_params(FLASHINFER_CASES))
def test_flashinfer_configurations_match_oracle(case, sparse_mla_impl, sparse_mla_tolerances, sparse_mla_inputs):
    _matches_oracle(sparse_mla_impl, sparse_mla_inputs(case), sparse_mla_tolerances)


@pytest.mark.sparse_mla_error_class("deployment-shapes")
@pytest.mark.parametrize("case", case_params(deployment_cases()))
def test_deepseek_v4_deployments_match_oracle(case, sparse_mla_impl, sparse_mla_tolerances, sparse_mla_inputs):
    _matches_oracle(sparse_mla_impl, sparse_mla_inputs(case), sparse_mla_tolerances)


@pytest.mark.parametrize("case", case_params(CONFORMANCE_CASES))
def test_error_classes_are_visible(case, sparse_mla_impl, sparse_mla_tolerances, sparse_mla_inputs):
    _matches_oracle(sparse_mla_impl, sparse_mla_inputs(case), sparse_mla_tolerances)


@pytest.mark.sparse_mla_error_class("decode-prefill-boundary")
@pytest.mark.parametrize("num_tokens", [1, 63, 64, 65, 128])
def test_decode_prefill_boundary(num_tokens, sparse_mla_impl, sparse_mla_tolerances, sparse_mla_inputs):
    case = AttentionCase(f"boundary-T{num_tokens}", num_tokens, 16, CacheCase(128),
                         extra=CacheCase(128, page_block_size=2, num_pages=256),
                         values=Values("peaked", sink_kind="large"), requires=("tokens",))  # fmt: skip
    inputs = sparse_mla_inputs(case)
    res = _matches_oracle(sparse_mla_impl, inputs, sparse_mla_tolerances)
    if res.route is not None:  # FlashInfer's _DECODE_MAX_TOKENS = 64
        assert res.route == ("decode" if num_tokens <= 64 else "prefill"), f"route {res.route!r} for T={num_tokens}"


def _lse_or_not_applicable(envelope: object, convention: str) -> None:
    if convention not in envelope.lse_conventions:
        pytest.skip(f"not applicable to this envelope: lse_convention={convention!r} is not in "
                    f"lse_conventions={envelope.lse_conventions}")  # fmt: skip


def _lse(convention: str, scale: float) -> object:
    return pytest.param(convention, scale, marks=pytest.mark.sparse_mla_error_class(f"lse-{convention}"))


@pytest.mark.parametrize(
    ("lse_convention", "lse_scale"),
    [_lse("flashinfer", 1.0), _lse("flashinfer", math.log(2.0)), _lse("flashinfer", 0.5), _lse("flashmla", 1.0)],
)
@pytest.mark.parametrize("with_sink", [False, True], ids=["no-sink", "sink"])
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_lse_conventions(
    fmt, lse_convention, lse_scale, with_sink, sparse_mla_impl, sparse_mla_tolerances, sparse_mla_inputs,
    sparse_mla_envelope,
):  # fmt: skip
    _lse_or_not_applicable(sparse_mla_envelope, lse_convention)
    case = AttentionCase("lse-conventions", 8, 16, CacheCase(128), extra=None if fmt == "dsv3_2" else DUAL_C4,
                         values=Values("peaked", sink_kind="large"), conventions=Conventions(fmt, with_sink=with_sink),
                         requires=("sink", "format") if with_sink else ("format",))  # fmt: skip
    inputs = sparse_mla_inputs(case)
    inputs.indices[0] = -1  # token 0: no main candidate ...
    if inputs.extra_indices is not None:
        inputs.extra_indices[0] = -1  # ... and no extra one: an empty row
    _matches_oracle(
        sparse_mla_impl, inputs, sparse_mla_tolerances,
        lse_convention=lse_convention, lse_scale=lse_scale,
    )  # fmt: skip


@pytest.mark.sparse_mla_error_class("empty-rows")
@pytest.mark.parametrize("sink", ["no-sink", "sink", "minus-inf-sink"])
@pytest.mark.parametrize("how", ["all-minus-one", "topk_length-0", "negative-lengths"])
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_empty_rows_give_zero_output_and_sentinel_lse(
    fmt, how, sink, sparse_mla_impl, sparse_mla_tolerances, sparse_mla_inputs, sparse_mla_envelope, sparse_mla_device
):
    env = sparse_mla_envelope
    if how != "all-minus-one" and not env.takes_lengths(fmt):
        pytest.skip(f"not applicable to this envelope: {env.lengths_reason(fmt)}")
    if how == "negative-lengths" and env.topk_length_range != "clamped":
        pytest.skip("not applicable to this envelope: negative topk_length (topk_length_range='row')")
    extra = None if fmt == "dsv3_2" else CacheCase(128, page_block_size=2, num_pages=128)
    case = AttentionCase("empty", 4, 8, CacheCase(128), extra=extra,
                         conventions=Conventions(fmt, with_sink=sink != "no-sink"),
                         requires=("sink", "format") if sink != "no-sink" else ("format",))  # fmt: skip
    inputs = sparse_mla_inputs(case)
    num_tokens, width = inputs.indices.shape
    if sink == "minus-inf-sink":  # -inf on even heads, finite on odd heads
        inputs.attn_sink[0::2] = -math.inf
    empty = (torch.arange(num_tokens) % 2 == 0).to(sparse_mla_device)
    overrides: dict[str, object] = {}
    if how == "all-minus-one":
        inputs.indices[empty] = -1
        if inputs.extra_indices is not None:
            inputs.extra_indices[empty] = -1
    else:
        value = 0 if how == "topk_length-0" else -5  # negative lengths clamp to 0
        lengths = torch.where(empty, value, width).to(torch.int32)
        overrides = {"topk_length": lengths}
        if inputs.extra is not None:
            overrides["extra_topk_length"] = torch.where(empty, value, inputs.extra_indices.shape[1]).to(torch.int32)
    convention = inputs.lse_convention
    scale = 0.5 if convention == "flashinfer" else 1.0
    res = inputs.run(sparse_mla_impl.sparse_mla_forward, lse_scale=scale, **overrides)
    assert bool((res.output[empty] == 0).all()), (
        f"an empty row must output exactly 0; got max |output| {float(res.output[empty].abs().max()):.3g} "
        f"(NaN: {bool(res.output[empty].isnan().any())})"
    )
    rows = int(empty.sum())
    if convention == "flashinfer" and sink != "no-sink":  # the sink alone: log2(exp(sink)) * lse_scale
        expected = (inputs.attn_sink.double() * LOG2E * scale).expand(rows, -1)
        finite = torch.isfinite(expected)
        assert bool((torch.isneginf(res.lse[empty]) == ~finite).all()), (
            "an empty row's LSE is the sink's alone: -inf exactly where the sink is -inf "
            f"({int((~finite).sum())} of {finite.numel()} here), finite elsewhere; got {res.lse[empty]}"
        )
        torch.testing.assert_close(
            res.lse[empty][finite].double(), expected[finite], atol=1e-6, rtol=1e-6,
            msg=lambda m: f"an empty row's LSE with a finite sink is sink * log2(e) * lse_scale ({scale}): {m}",
        )  # fmt: skip
    elif convention == "flashinfer":
        _assert_empty_rows_lse(res.lse, empty, -math.inf, "FlashInfer convention, no sink")
    # The non-empty rows are still right.
    oracle = inputs.run(oracle_forward, lse_scale=scale, **overrides)
    sparse_mla_tolerances.check_result(res, oracle, fmt=fmt, what="empty-row case")
    if "flashmla" in env.lse_conventions:
        flashmla = inputs.run(sparse_mla_impl.sparse_mla_forward, lse_convention="flashmla", **overrides)
        _assert_empty_rows_lse(flashmla.lse, empty, math.inf, "FlashMLA convention (lse_convention='flashmla')")


def _assert_empty_rows_lse(lse: torch.Tensor, empty: torch.Tensor, expected: float, convention: str) -> None:
    """Every head of every empty row (``empty``: a ``[T]`` bool mask) has the LSE ``expected``
    (``+inf`` or ``-inf``); the message names the first token and head that do not."""
    got = lse[empty]
    bad = got != expected
    if bool(bad.any()):
        token = int(empty.nonzero()[int(bad.nonzero()[0, 0]), 0])
        head = int(bad.nonzero()[0, 1])
        raise AssertionError(
            f"{convention}: an empty row's LSE must be {expected}; token {token} (no valid lane), head {head}: "
            f"{float(lse[token, head])} ({int(bad.sum())} of {bad.numel()} empty-row LSE values differ)"
        )


@pytest.mark.sparse_mla_error_class("empty-rows", "minus-inf-sink")
def test_empty_row_on_a_minus_inf_sink_head_is_zero_with_the_documented_lse(
    sparse_mla_impl, sparse_mla_inputs, sparse_mla_envelope, sparse_mla_device
):
    """T=2, H=2 (or the envelope's nearest head count), one 64-token page, token 0 all -1,
    ``attn_sink = [-inf, 0.5, -inf, 0.5, ...]``: token 0's output is exactly 0 on every head; its
    LSE is ``-inf`` on the ``-inf`` heads (no mass at all) and ``0.5 * log2(e)`` on the others
    (FlashInfer convention), ``+inf`` on every head (FlashMLA convention)."""
    case = AttentionCase("empty-inf-sink", 2, 2, CacheCase(64, num_pages=1, masked_fraction=0.5),
                         requires=("sink", "tokens"))  # fmt: skip
    inputs = sparse_mla_inputs(case)
    inputs.indices[0] = -1
    heads = inputs.q.shape[1]
    sink = torch.tensor([-math.inf, 0.5] * (heads // 2) + [-math.inf] * (heads % 2), device=sparse_mla_device)
    res = inputs.run(sparse_mla_impl.sparse_mla_forward, attn_sink=sink)
    nan = bool(res.output[0].isnan().any())
    assert bool((res.output[0] == 0).all()), f"token 0 output must be exactly 0 (NaN present: {nan})"
    assert bool(torch.isfinite(res.output[1]).all())
    if inputs.lse_convention == "flashinfer":
        assert bool(torch.isneginf(res.lse[0, 0::2]).all()), f"-inf sink heads: LSE {res.lse[0, 0::2]}"
        finite = (res.lse[0, 1::2].double() - 0.5 * LOG2E).abs()
        assert bool((finite <= 1e-6).all()), f"0.5 sink heads: LSE {res.lse[0, 1::2]} != {0.5 * LOG2E}"
    if "flashmla" in sparse_mla_envelope.lse_conventions:
        flashmla = inputs.run(sparse_mla_impl.sparse_mla_forward, attn_sink=sink, lse_convention="flashmla")
        assert bool(torch.isposinf(flashmla.lse[0]).all()), f"FlashMLA convention: +inf, got {flashmla.lse[0]}"


@pytest.mark.sparse_mla_error_class("head-groups")
@pytest.mark.parametrize("fmt", ["dsv3_2", "dsv4"])
def test_32_heads_read_their_own_token_row(fmt, sparse_mla_impl, sparse_mla_tolerances, sparse_mla_inputs):
    """T=2, H=32, topk 128 with 64 valid lanes: a kernel that runs 32 heads as two 16-head groups and
    lets the second group read the next token's index row is wrong on heads 16-31."""
    case = AttentionCase("heads-32", 2, 32, CacheCase(128, num_pages=8, masked_fraction=0.5),
                         conventions=Conventions(fmt), requires=("format",))  # fmt: skip
    _matches_oracle(sparse_mla_impl, sparse_mla_inputs(case), sparse_mla_tolerances)


@pytest.mark.sparse_mla_error_class("per-layer-views")
@pytest.mark.parametrize("layer", [0, 1, 2, 3])
def test_per_layer_views_of_one_pool(layer, sparse_mla_impl, sparse_mla_tolerances, sparse_mla_inputs):
    """Four per-layer ``[P, 64, 1, 584]`` views of one pool: layer ``l`` starts ``l * 37,440`` bytes
    into each 149,760-byte page (DSV4 padded page of 64 tokens: ``ceil(64*584/576)*576 = 37,440``).
    A kernel that ignores ``storage_offset()`` reads layer 0 for every layer."""
    case = AttentionCase(f"layer-{layer}", 8, 16, CacheCase(128, num_pages=4, layer=layer, num_layers=4),
                         values=Values("peaked"), requires=("page", "format"))  # fmt: skip
    inputs = sparse_mla_inputs(case)
    packed = inputs.cache.packed
    assert packed.storage_offset() == layer * 37_440 and packed.stride(0) == 149_760
    _matches_oracle(sparse_mla_impl, inputs, sparse_mla_tolerances)
