"""Self-test of the float64 oracle against a computation written out by hand.

The suites judge every implementation by ``attention.oracle.oracle_forward``; this test judges the
oracle itself on a tiny dual-cache case whose softmax is spelled out term by term (one softmax
over main and extra candidates plus the sink, flashinfer-ai/flashinfer
``tests/attention/sparse_mla_test_utils.py`` ``_ref_sparse_attn``): candidates main ``[a, a, -1,
b | past the length]`` and extra ``[c, -1]``, sink ``s``:
``Z = 2 e^{s_a} + e^{s_b} + e^{s_c} + e^{sink}``, ``out = (2 e^{s_a} V_a + e^{s_b} V_b + e^{s_c} V_c) / Z``.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from pytest_sparse_mla import data
from pytest_sparse_mla.attention import oracle_forward


def test_oracle_matches_a_hand_written_softmax() -> None:
    g = torch.Generator().manual_seed(3)
    main = data.make_packed_cache(g, num_pages=2, page_block_size=64)
    extra = data.make_packed_cache(g, num_pages=8, page_block_size=2)
    q = data.latent((2, 3, 512), g)
    sink = torch.tensor([0.5, -1.0, 2.0])
    a, b, c, stale = 7, 100, 9, 1 << 30
    indices = torch.tensor([[a, a, -1, b, stale]] * 2, dtype=torch.int32)
    lengths = torch.tensor([4, 4], dtype=torch.int32)
    extra_indices = torch.tensor([[c, -1], [-1, -1]], dtype=torch.int32)
    sm_scale = 512**-0.5
    kw = dict(sm_scale=sm_scale, topk_length=lengths, attn_sink=sink, extra_kv_cache=extra.packed,
              extra_indices=extra_indices)  # fmt: skip
    res = oracle_forward(q, main.packed, indices, **kw)
    natural = oracle_forward(q, main.packed, indices, lse_convention="flashmla", **kw)

    rows = main.flat_dequantized().double()
    rows_c = extra.flat_dequantized().double()[c]
    for t in range(2):
        qt = q[t].double()  # [H, 512]
        e_a = torch.exp(sm_scale * qt @ rows[a])
        e_b = torch.exp(sm_scale * qt @ rows[b])
        e_c = torch.exp(sm_scale * qt @ rows_c) if t == 0 else torch.zeros(3, dtype=torch.float64)
        num = 2 * e_a[:, None] * rows[a] + e_b[:, None] * rows[b] + e_c[:, None] * rows_c
        candidates = 2 * e_a + e_b + e_c
        z = candidates + torch.exp(sink.double())
        torch.testing.assert_close(res.output[t], num / z[:, None], atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(res.lse[t], torch.log(z) / math.log(2), atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(natural.lse[t], torch.log(candidates), atol=1e-12, rtol=1e-12)


def test_oracle_empty_rows() -> None:
    g = torch.Generator().manual_seed(4)
    main = data.make_packed_cache(g, num_pages=1, page_block_size=64)
    q = data.latent((2, 2, 512), g)
    indices = torch.tensor([[-1, -3], [5, 6]], dtype=torch.int32)
    lengths = torch.tensor([2, 0], dtype=torch.int32)  # row 0: all negative; row 1: length 0
    sink = torch.tensor([1.5, -2.0])
    plain = oracle_forward(q, main.packed, indices, sm_scale=0.1, topk_length=lengths)
    assert bool((plain.output == 0).all()) and bool(torch.isneginf(plain.lse).all())
    sunk = oracle_forward(q, main.packed, indices, sm_scale=0.1, topk_length=lengths, attn_sink=sink, lse_scale=0.5)
    assert bool((sunk.output == 0).all())
    torch.testing.assert_close(sunk.lse, (sink.double() / math.log(2) * 0.5).expand(2, 2))
    lonely = oracle_forward(q, main.packed, indices, sm_scale=0.1, topk_length=lengths, lse_convention="flashmla")
    assert bool(torch.isposinf(lonely.lse).all())


def test_memoized_oracle_answers_by_the_bytes_of_its_arguments() -> None:
    """A stored result is returned for equal arguments only: a changed byte of q or a changed
    sm_scale is computed afresh (compared with runs outside the memo), and a caller that writes
    into a returned result does not change what the store answers next."""
    from pytest_sparse_mla.attention.oracle import memoized

    g = torch.Generator().manual_seed(5)
    cache = data.make_packed_cache(g, num_pages=1, page_block_size=64)
    q = data.latent((2, 4, 512), g)
    changed = q.clone()
    changed[1, 2, 3] = -changed[1, 2, 3] + 1.0
    indices = torch.randint(0, 64, (2, 16), generator=g, dtype=torch.int32)
    expected = {
        "plain": oracle_forward(q, cache.packed, indices, sm_scale=0.05),
        "scale": oracle_forward(q, cache.packed, indices, sm_scale=0.06),
        "q": oracle_forward(changed, cache.packed, indices, sm_scale=0.05),
    }
    assert not torch.equal(expected["q"].output, expected["plain"].output)
    store: dict[bytes, object] = {}
    with memoized(store):  # type: ignore[arg-type]
        first = oracle_forward(q, cache.packed, indices, sm_scale=0.05)
        first.output.fill_(7.0)  # the caller's copy only
        got = {
            "plain": oracle_forward(q, cache.packed, indices, sm_scale=0.05),
            "scale": oracle_forward(q, cache.packed, indices, sm_scale=0.06),
        }
        q.copy_(changed)  # written in place: the same tensor object, other bytes
        got["q"] = oracle_forward(q, cache.packed, indices, sm_scale=0.05)
    assert len(store) == 3
    for name, want in expected.items():
        assert torch.equal(got[name].output, want.output) and torch.equal(got[name].lse, want.lse), name


def test_oracle_results_do_not_depend_on_how_tokens_are_blocked(monkeypatch) -> None:
    """The oracle computes blocks of query tokens at once (``oracle.BLOCK_BYTES``); each token's
    result must come from its own lanes alone. A dual-cache case with masked lanes, partial
    lengths and a sink, computed one token per block and all tokens in one block: the same
    results to float64 rounding (the padding lanes of a wide block add exact zeros), valid counts
    that differ from token to token and empty tokens included."""
    from pytest_sparse_mla.attention import oracle
    from pytest_sparse_mla.attention.cases import AttentionCase, CacheCase, make_inputs

    case = AttentionCase("blocks", 24, 4, CacheCase(128, masked_fraction=0.3, topk_length=100),
                         extra=CacheCase(64, page_block_size=2, num_pages=64, topk_length=40))  # fmt: skip
    g = torch.Generator().manual_seed(11)
    inputs = make_inputs(case, g)
    lengths = torch.randint(0, 101, (24,), generator=g, dtype=torch.int32)  # within the case's 100 (stale past it)
    extra_lengths = torch.randint(0, 41, (24,), generator=g, dtype=torch.int32)
    lengths[[3, 17]] = 0
    extra_lengths[[3, 17]] = 0  # two tokens without a valid lane, between others that have some
    inputs = dataclasses.replace(inputs, topk_length=lengths, extra_topk_length=extra_lengths)
    results = []
    for budget in (1, 1 << 40):  # one token per block; every token in one block
        monkeypatch.setattr(oracle, "BLOCK_BYTES", {"cpu": budget, "other": budget})
        results.append(inputs.run(oracle_forward))
    one, all_ = results
    for name in ("output", "lse"):
        torch.testing.assert_close(getattr(one, name), getattr(all_, name), rtol=1e-12, atol=1e-300)
    for name in ("abs_weighted", "rms_weighted", "score_magnitude"):
        torch.testing.assert_close(getattr(one.scales, name), getattr(all_.scales, name), rtol=1e-12, atol=1e-300)
    assert one.scales.max_candidates == all_.scales.max_candidates
