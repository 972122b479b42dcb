"""Sparse-MLA attention accuracy: the implementation under test against the float64 oracle.

Specification (``shared/reference/dsv4-format-and-math.md`` sections 2 to 5):

* On FlashInfer's SM120 test configurations and data distribution (``attention.cases.
  FLASHINFER_CASES``) and on every DeepSeek-V4 deployment shape (V4-Flash 64 / V4-Pro 128 heads per
  rank at TP 1/2/4/8; SWA topk 128; C4 extra 512 at page 64; C128 extra at page 2; DSpark topk 192;
  ``attention.cases.deployment_cases``), output and LSE match the float64 oracle within the
  ``sparse_mla_tolerances`` fixture (bundled reference: 1e-5 relative in fp32 plus BF16 rounding;
  kernels: ``atol = rtol = 5e-2`` like FlashInfer's tests).
* Around FlashInfer's decode/prefill cutoff (``num_tokens`` 1, 63, 64, 65, 128) results stay
  accurate and, where the implementation reports one, the route is ``decode`` iff ``T <= 64``.
* LSE conventions: FlashInfer (log2, sink included, times ``lse_scale``) and FlashMLA (natural
  log, sink excluded).
* A row without a valid candidate gives output exactly 0 and LSE ``-inf`` (no sink),
  ``sink * log2(e) * lse_scale`` (sink) or ``+inf`` (FlashMLA convention).

Large cases (``large=True``) run only on CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch

from pytest_sparse_mla.attention import oracle_forward
from pytest_sparse_mla.attention.cases import (
    FLASHINFER_CASES,
    AttentionCase,
    AttentionInputs,
    case_params,
    deployment_cases,
    inputs_on,
)

pytestmark = pytest.mark.sparse_mla_needs("sparse_mla_forward")

LOG2E = 1.0 / math.log(2.0)


def _check_shapes(res: object, inputs: AttentionInputs) -> None:
    t, h = inputs.q.shape[0], inputs.q.shape[1]
    assert res.output.dtype == torch.bfloat16 and tuple(res.output.shape) == (t, h, 512)
    assert res.lse.dtype == torch.float32 and tuple(res.lse.shape) == (t, h)


def _matches_oracle(impl: object, inputs: AttentionInputs, tol: object, **overrides: object) -> None:
    res = inputs.run(impl.sparse_mla_forward, **overrides)
    expected = inputs.run(oracle_forward, **overrides)
    _check_shapes(res, inputs)
    tol.assert_close(res.output, expected.output, "output", what=f"{inputs.case.name} output")
    tol.assert_close(res.lse, expected.lse, "lse", what=f"{inputs.case.name} lse")


@pytest.mark.parametrize("case", case_params(FLASHINFER_CASES))
def test_flashinfer_configurations_match_oracle(
    case, sparse_mla_impl, sparse_mla_tolerances, sparse_mla_generator, sparse_mla_device
):
    inputs = inputs_on(case, sparse_mla_generator, sparse_mla_device)
    _matches_oracle(sparse_mla_impl, inputs, sparse_mla_tolerances)


@pytest.mark.parametrize("case", case_params(deployment_cases()))
def test_deepseek_v4_deployments_match_oracle(
    case, sparse_mla_impl, sparse_mla_tolerances, sparse_mla_generator, sparse_mla_device
):
    inputs = inputs_on(case, sparse_mla_generator, sparse_mla_device)
    _matches_oracle(sparse_mla_impl, inputs, sparse_mla_tolerances)


@pytest.mark.parametrize("num_tokens", [1, 63, 64, 65, 128])
def test_decode_prefill_boundary(
    num_tokens, sparse_mla_impl, sparse_mla_tolerances, sparse_mla_generator, sparse_mla_device
):
    case = AttentionCase(f"boundary-T{num_tokens}", num_tokens, 16, 128, topk_extra=128,
                         extra_page_block_size=2, extra_num_pages=256)  # fmt: skip
    inputs = inputs_on(case, sparse_mla_generator, sparse_mla_device)
    res = inputs.run(sparse_mla_impl.sparse_mla_forward)
    expected = inputs.run(oracle_forward)
    sparse_mla_tolerances.assert_close(res.output, expected.output, "output", what="output")
    sparse_mla_tolerances.assert_close(res.lse, expected.lse, "lse", what="lse")
    route = getattr(res, "route", None)
    if route is not None:  # FlashInfer's _DECODE_MAX_TOKENS = 64
        assert route == ("decode" if num_tokens <= 64 else "prefill")


@pytest.mark.parametrize(
    ("lse_convention", "lse_scale"),
    [("flashinfer", 1.0), ("flashinfer", math.log(2.0)), ("flashinfer", 0.5), ("flashmla", 1.0)],
)
@pytest.mark.parametrize("with_sink", [False, True], ids=["no-sink", "sink"])
def test_lse_conventions(
    lse_convention, lse_scale, with_sink, sparse_mla_impl, sparse_mla_tolerances,
    sparse_mla_generator, sparse_mla_device,
):  # fmt: skip
    case = AttentionCase("lse", 8, 16, 128, with_sink=with_sink, topk_extra=64,
                         extra_page_block_size=64, extra_num_pages=4)  # fmt: skip
    inputs = inputs_on(case, sparse_mla_generator, sparse_mla_device)
    inputs.indices[0] = -1  # token 0: no main candidate ...
    inputs.extra_indices[0] = -1  # ... and no extra one: an empty row
    _matches_oracle(
        sparse_mla_impl, inputs, sparse_mla_tolerances,
        lse_convention=lse_convention, lse_scale=lse_scale,
    )  # fmt: skip


@pytest.mark.parametrize("with_sink", [False, True], ids=["no-sink", "sink"])
@pytest.mark.parametrize("how", ["all-minus-one", "topk_length-0", "negative-lengths"])
def test_empty_rows_give_zero_output_and_sentinel_lse(
    how, with_sink, sparse_mla_impl, sparse_mla_tolerances, sparse_mla_generator, sparse_mla_device
):
    case = AttentionCase("empty", 4, 8, 128, with_sink=with_sink, topk_extra=128,
                         extra_page_block_size=2, extra_num_pages=128)  # fmt: skip
    inputs = inputs_on(case, sparse_mla_generator, sparse_mla_device)
    empty = torch.tensor([True, False, True, False], device=sparse_mla_device)
    overrides: dict[str, object] = {}
    if how == "all-minus-one":
        inputs.indices[empty] = -1
        inputs.extra_indices[empty] = -1
    else:
        value = 0 if how == "topk_length-0" else -5  # negative lengths clamp to 0
        lengths = torch.where(empty, value, 128).to(torch.int32)
        overrides = {"topk_length": lengths, "extra_topk_length": lengths.clone()}
    scale = 0.5
    res = inputs.run(sparse_mla_impl.sparse_mla_forward, lse_scale=scale, **overrides)
    assert bool((res.output[empty] == 0).all()), "an empty row must output exactly 0"
    if with_sink:  # the sink alone makes up the denominator: log2(exp(sink)) * lse_scale
        expected = (inputs.attn_sink.double() * LOG2E * scale).expand(2, -1)
        sparse_mla_tolerances.assert_close(res.lse[empty], expected, "lse", what="empty-row lse")
    else:
        assert bool(torch.isneginf(res.lse[empty]).all()), res.lse[empty]
    # The non-empty rows are still right.
    oracle = inputs.run(oracle_forward, lse_scale=scale, **overrides)
    sparse_mla_tolerances.assert_close(res.output, oracle.output, "output", what="output")
    sparse_mla_tolerances.assert_close(res.lse, oracle.lse, "lse", what="lse")
    flashmla = inputs.run(sparse_mla_impl.sparse_mla_forward, lse_convention="flashmla", **overrides)
    assert bool(torch.isposinf(flashmla.lse[empty]).all()), flashmla.lse[empty]  # FlashMLA "lonely"
