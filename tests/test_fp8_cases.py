"""The hand-built FP8 cases (``attention.cases``: query kinds ``"long-tail"`` and ``"skewed-query"``)
build what their docstrings claim: rows exact in E4M3, the stated logits, and oracle outputs equal to
closed forms computed here from those logits (not read back from the code under test); and each
case, DSV3.2 variant included, fails the wrong FP8 kernels of its kind under the ``kernel-fp8``
profile and passes ``approx_fp8`` (the gate stops at a kernel's first failing test, so it shows one
case per kernel)."""

from __future__ import annotations

import math

import kernel_catalogue as kc
import pytest
import torch

from pytest_sparse_mla import formats, tolerances
from pytest_sparse_mla.attention import cases, oracle_forward


def _inputs(name: str) -> cases.AttentionInputs:
    case = next(c for c in cases.CONFORMANCE_CASES if c.name == name)
    return cases.make_inputs(case, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", ["cf-long-tail", "cf-long-tail-dsv32"])
def test_long_tail_rows_logits_and_output(name: str) -> None:
    inputs = _inputs(name)
    f = formats.cache_formats(inputs.case.conventions.fmt)[0]
    T, H = inputs.case.num_tokens, inputs.case.num_heads
    ps = inputs.cache.page_block_size
    table = inputs.cache.flat_dequantized().double()
    idx = inputs.indices.long()
    # lane 0: slot t % ps of page 0; the 63 others: distinct slots past page 0
    assert idx[:, 0].tolist() == [t % ps for t in range(T)]
    assert bool((idx[:, 1:] >= ps).all()) and all(len(set(row.tolist())) == idx.shape[1] for row in idx)
    signs = torch.tensor([(-1.0) ** h for h in range(H)], dtype=torch.float64)  # odd heads negated
    top = torch.zeros(f.d_qk, dtype=torch.float64)
    top[:H] = 4.0 * signs
    tail = torch.zeros(f.d_qk, dtype=torch.float64)
    tail[:H] = -4.0 * signs
    tail[H : f.d_nope] = 1.0
    assert torch.equal(table[:ps], top.expand(ps, -1))  # exact in E4M3
    assert torch.equal(table[ps:], tail.expand(table.shape[0] - ps, -1))
    out = inputs.run(oracle_forward).output.double()
    n = idx.shape[1] - 1
    for h in range(H):
        a = float(inputs.q[0, h, h])
        assert (a > 0) == (h % 2 == 0), (h, a)
        gap = 2.0 * inputs.sm_scale * a * float(top[h])  # +gap/2 on the top key, -gap/2 on each tail key
        assert 7.0 < gap and math.exp(-gap) < 2.0**-10, (h, gap)
        tail_weight = n * math.exp(-gap) / (1.0 + n * math.exp(-gap))
        torch.testing.assert_close(out[:, h, H : f.d_nope], torch.full((T, f.d_nope - H), tail_weight,
                                   dtype=torch.float64), rtol=1e-12, atol=0.0)  # fmt: skip


@pytest.mark.parametrize("name", ["cf-skewed-query", "cf-skewed-query-dsv32"])
def test_skewed_query_flushes_under_one_scale_and_matches_its_closed_form(name: str) -> None:
    inputs = _inputs(name)
    H = inputs.case.num_heads
    q = inputs.q.double()
    a = q[0, :, 256 : 256 + H].diagonal()
    big = q[0, :, :H].diagonal()
    assert torch.equal(big, a * 2.0**20)
    assert bool((a[0::2] > 0).all()) and bool((a[1::2] < 0).all())  # odd heads' groups negative
    # one power-of-two E4M3 scale over the head (amax = big): a lands below 2**-10, half of E4M3's
    # smallest subnormal 2**-9, so it rounds to 0; a scale of its own 64-dim group keeps it
    scale = 2.0 ** torch.ceil(torch.log2(big.abs() / 448.0))
    assert bool((a.abs() / scale < 2.0**-10).all())
    table = inputs.cache.flat_dequantized().double()
    slots = torch.arange(table.shape[0])
    sign = torch.where(slots % 2 == 0, 1.0, -1.0).double()
    assert torch.equal(table[:, 256 : 256 + H], (2048.0 * sign).unsqueeze(1).expand(-1, H))
    assert int(table[:, :256].count_nonzero()) == 0 and int(table[:, 256 + H :].count_nonzero()) == 0
    out = inputs.run(oracle_forward).output.double()
    for t, row in enumerate(inputs.indices.long()):
        even = int((row % 2 == 0).sum())
        odd = row.numel() - even
        for h in range(H):
            logit = inputs.sm_scale * float(a[h]) * 2048.0
            expected = 2048.0 * (even * math.exp(logit) - odd * math.exp(-logit)) / (
                even * math.exp(logit) + odd * math.exp(-logit))  # fmt: skip
            assert math.isclose(float(out[t, h, 256 + h]), expected, rel_tol=1e-12), (t, h)


@pytest.mark.parametrize(
    ("name", "wrong"),
    [
        ("cf-long-tail", ("fp8_p_unscaled",)),
        ("cf-long-tail-dsv32", ("fp8_p_unscaled",)),
        ("cf-skewed-query", ("fp8_q_one_scale_per_head", "fp8_q_signed_amax")),
        ("cf-skewed-query-dsv32", ("fp8_q_one_scale_per_head", "fp8_q_signed_amax")),
    ],
)
def test_each_case_fails_its_wrong_fp8_kernels_and_passes_approx_fp8(name: str, wrong: tuple[str, ...]) -> None:
    inputs = _inputs(name)
    oracle = inputs.run(oracle_forward)

    def ok(kernel: str) -> bool:
        impl = getattr(kc, kernel)
        profile = tolerances.DEFAULT_PROFILES[tolerances.profile_for(impl)]
        result = inputs.run(impl.sparse_mla_forward)
        return tolerances.compare_output(result.output, oracle.output, profile=profile,
                                         fmt=inputs.case.conventions.fmt, scales=oracle.scales).ok  # fmt: skip

    assert ok("approx_fp8")
    assert not any(ok(k) for k in wrong), [k for k in wrong if ok(k)]
