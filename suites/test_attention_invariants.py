"""Sparse-MLA invariants: properties every implementation must have, checked against itself.

Specification (``shared/reference/dsv4-format-and-math.md`` section 2; serving claims from
``shared/reference/page-split-and-history.md``):

* **Bit for bit** (``tolerances.assert_equal``):

  - padding an index row with ``-1`` to a wider topk (main or extra) changes nothing (SGLang pads
    non-instantiated widths with ``-1``, sgl-project/sglang #33407, #34717);
  - ``[T, 1, topk]`` indices equal ``[T, topk]`` ones, and a row-pitched index view equals a dense
    one (FlashInfer's own bitwise checks);
  - NaN/garbage bytes in masked or unreferenced cache slots (slot 0 included), in page padding and
    in the footer pad byte, and stale indices in lanes past ``topk_length``, never reach the output
    (FlashInfer's shared zero row; the slot-0 NaN of sgl-project/sglang #39288);
  - head independence: ``H`` real heads run inside a 64-head (V4-Pro: 128-head) padded query give
    the same bits for those heads (the claim behind dropping SGLang's TP head pad on prefill,
    sgl-project/sglang #35104, #39235);
  - attention over a 256-token cache split to 64-token pages equals attention over a native
    64-token cache (the claim behind SGLang's page split, PR #27455).

* **Within the implementation's self tolerance** (mathematically equal, computed in another order):
  candidate permutation; dual cache vs one cache over the concatenated table; ``attn_sink = -inf``
  vs no sink; a finite sink vs an extra logit column whose value is zero.

* **Against a hand computation**: a duplicated candidate weighs double.
"""

from __future__ import annotations

import math

import pytest
import torch

from pytest_sparse_mla import data, formats
from pytest_sparse_mla.attention.cases import AttentionCase, AttentionInputs, inputs_on
from pytest_sparse_mla.implementations import skip_reason_for
from pytest_sparse_mla.tolerances import assert_equal

pytestmark = pytest.mark.sparse_mla_needs("sparse_mla_forward")

DUAL_C4 = {"topk_extra": 128, "extra_page_block_size": 64, "extra_num_pages": 8}
DUAL_C128 = {"topk_extra": 128, "extra_page_block_size": 2, "extra_num_pages": 128}


def _pad(indices: torch.Tensor, width: int, value: int = -1) -> torch.Tensor:
    pad = torch.full((indices.shape[0], width), value, dtype=indices.dtype, device=indices.device)
    return torch.cat([indices, pad], dim=1)


def _same(a: object, b: object, what: str) -> None:
    assert_equal(a.output, b.output, what=f"{what}: output")
    assert_equal(a.lse, b.lse, what=f"{what}: lse")


@pytest.mark.parametrize("num_tokens", [16, 80], ids=["decode", "prefill"])
@pytest.mark.parametrize(
    ("which", "topk", "length", "pad"),
    [
        ("main", 128, None, 64),  # 128 -> 192
        ("main", 128, None, 128),  # 128 -> 256
        ("main", 192, 133, 64),  # DSpark 133 active of 192 -> 256
        ("extra", 128, None, 384),  # C4 128 -> 512
        ("both", 128, None, 64),
    ],
)
def test_padding_with_minus_one_is_bitwise_neutral(
    which, topk, length, pad, num_tokens, sparse_mla_impl, sparse_mla_generator, sparse_mla_device
):
    case = AttentionCase("pad", num_tokens, 16, topk, topk_length=length, **DUAL_C4)
    inputs = inputs_on(case, sparse_mla_generator, sparse_mla_device)
    base = inputs.run(sparse_mla_impl.sparse_mla_forward)
    over: dict[str, object] = {}
    if which in ("main", "both"):
        over["indices"] = _pad(inputs.indices, pad)
    if which in ("extra", "both"):
        over["extra_indices"] = _pad(inputs.extra_indices, pad)
    padded = sparse_mla_impl.sparse_mla_forward(
        inputs.q, inputs.cache.packed, over.pop("indices", inputs.indices), **inputs.kwargs(**over)
    )
    _same(padded, base, f"{which} row padded by {pad}")


def test_index_forms_are_bitwise_equal(sparse_mla_impl, sparse_mla_generator, sparse_mla_device):
    case = AttentionCase("forms", 16, 8, 128, **DUAL_C128)
    inputs = inputs_on(case, sparse_mla_generator, sparse_mla_device)
    base = inputs.run(sparse_mla_impl.sparse_mla_forward)
    three_d = sparse_mla_impl.sparse_mla_forward(
        inputs.q, inputs.cache.packed, inputs.indices.unsqueeze(1),
        **inputs.kwargs(extra_indices=inputs.extra_indices.unsqueeze(1)),
    )  # fmt: skip
    _same(three_d, base, "[T, 1, topk] indices")
    wide = _pad(inputs.indices, 128, value=12345)  # row pitch 256, view of the first 128 lanes
    pitched = sparse_mla_impl.sparse_mla_forward(inputs.q, inputs.cache.packed, wide[:, :128], **inputs.kwargs())
    _same(pitched, base, "row-pitched indices")


@pytest.mark.parametrize("case_kw", [{}, DUAL_C128], ids=["single", "dual"])
def test_candidate_permutation_invariance(
    case_kw, sparse_mla_impl, sparse_mla_tolerances, sparse_mla_generator, sparse_mla_device
):
    case = AttentionCase("perm", 16, 16, 128, masked_fraction=0.25, **case_kw)
    inputs = inputs_on(case, sparse_mla_generator, sparse_mla_device)
    base = inputs.run(sparse_mla_impl.sparse_mla_forward)

    def shuffle(idx: torch.Tensor) -> torch.Tensor:
        order = torch.rand(idx.shape, generator=sparse_mla_generator).argsort(dim=1)
        return idx.gather(1, order.to(idx.device))

    over = {"extra_indices": shuffle(inputs.extra_indices)} if case.dual else {}
    shuffled = sparse_mla_impl.sparse_mla_forward(
        inputs.q, inputs.cache.packed, shuffle(inputs.indices), **inputs.kwargs(**over)
    )
    sparse_mla_tolerances.assert_close(shuffled.output, base.output, "self_output", what="output")
    sparse_mla_tolerances.assert_close(shuffled.lse, base.lse, "self_lse", what="lse")


def test_duplicated_candidate_weighs_double(
    sparse_mla_impl, sparse_mla_tolerances, sparse_mla_generator, sparse_mla_device
):
    """Indices ``[a, a, b, -1, ...]``: weights ``2 e^{s_a}`` and ``e^{s_b}``, computed here."""
    case = AttentionCase("dup", 4, 8, 64, with_sink=False, num_pages=2)
    inputs = inputs_on(case, sparse_mla_generator, sparse_mla_device)
    a, b = 5, 77
    inputs.indices.fill_(-1)
    inputs.indices[:, 0:2] = a
    inputs.indices[:, 2] = b
    res = inputs.run(sparse_mla_impl.sparse_mla_forward)
    rows = inputs.cache.flat_dequantized().double()  # exact values the cache holds
    q = inputs.q.double()
    s_a = inputs.sm_scale * (q @ rows[a])  # [T, H]
    s_b = inputs.sm_scale * (q @ rows[b])
    w_a, w_b = 2 * torch.exp(s_a), torch.exp(s_b)
    total = w_a + w_b
    expected = (w_a[..., None] * rows[a] + w_b[..., None] * rows[b]) / total[..., None]
    sparse_mla_tolerances.assert_close(res.output, expected, "output", what="output")
    sparse_mla_tolerances.assert_close(res.lse, torch.log2(total), "lse", what="lse (log2)")


def test_sink_minus_inf_equals_no_sink(sparse_mla_impl, sparse_mla_tolerances, sparse_mla_generator, sparse_mla_device):
    case = AttentionCase("sink-inf", 16, 16, 128, with_sink=False, **DUAL_C4)
    inputs = inputs_on(case, sparse_mla_generator, sparse_mla_device)
    base = inputs.run(sparse_mla_impl.sparse_mla_forward)
    sink = torch.full((16,), -math.inf, dtype=torch.float32, device=sparse_mla_device)
    res = inputs.run(sparse_mla_impl.sparse_mla_forward, attn_sink=sink)
    sparse_mla_tolerances.assert_close(res.output, base.output, "self_output", what="output")
    sparse_mla_tolerances.assert_close(res.lse, base.lse, "self_lse", what="lse")


def test_finite_sink_is_an_extra_logit_with_zero_value(
    sparse_mla_impl, sparse_mla_tolerances, sparse_mla_generator, sparse_mla_device
):
    """``Z' = Z + e^sink`` and ``out' = out * Z / Z'``, from the implementation's no-sink run."""
    case = AttentionCase("sink", 16, 16, 128, **DUAL_C128)
    inputs = inputs_on(case, sparse_mla_generator, sparse_mla_device)
    without = inputs.run(sparse_mla_impl.sparse_mla_forward, attn_sink=None)
    with_sink = inputs.run(sparse_mla_impl.sparse_mla_forward)
    lse_e = without.lse.double() * math.log(2.0)  # natural log of Z
    sink = inputs.attn_sink.double().unsqueeze(0)
    expected_out = without.output.double() * torch.sigmoid(lse_e - sink).unsqueeze(-1)
    expected_lse = torch.logaddexp(lse_e, sink) / math.log(2.0)
    sparse_mla_tolerances.assert_close(with_sink.output, expected_out, "self_output", what="output")
    sparse_mla_tolerances.assert_close(with_sink.lse, expected_lse, "self_lse", what="lse")


def test_zero_sink_equals_a_zero_row_candidate(
    sparse_mla_impl, sparse_mla_tolerances, sparse_mla_generator, sparse_mla_device
):
    """A zero latent row scores exactly 0 and carries value 0: it is a sink of logit 0."""
    num_pages, ps = 4, 64
    source = data.latent((num_pages, ps, 512), sparse_mla_generator)
    source[-1, -1] = 0  # the last slot holds an all-zero row (E4M3 0 at the 2**-13 floor scale)
    cache = data.pack_to_device(source, device=sparse_mla_device)
    q = data.latent((16, 16, 512), sparse_mla_generator).to(sparse_mla_device)
    indices = data.sparse_indices(16, 128, num_pages * ps - 1, sparse_mla_generator).to(sparse_mla_device)
    zero_slot = num_pages * ps - 1
    with_column = indices.clone()
    with_column[:, 100] = zero_slot  # a masked lane becomes the zero-value candidate
    kw = {"sm_scale": 512**-0.5}
    zero_sink = torch.zeros(16, dtype=torch.float32, device=sparse_mla_device)
    a = sparse_mla_impl.sparse_mla_forward(q, cache, indices, attn_sink=zero_sink, **kw)
    b = sparse_mla_impl.sparse_mla_forward(q, cache, with_column, **kw)
    sparse_mla_tolerances.assert_close(a.output, b.output, "self_output", what="output")
    sparse_mla_tolerances.assert_close(a.lse, b.lse, "self_lse", what="lse")


def _poison(cache: data.PackedKVCache, keep: torch.Tensor, byte: int) -> torch.Tensor:
    """A copy of ``cache.packed`` whose every byte not read for the tokens in ``keep`` is ``byte``.

    Offsets by hand, DSV4 footer layout: token ``t`` of page ``p`` owns data bytes
    ``[t*576, t*576 + 576)`` and scale bytes ``[ps*576 + t*8, ps*576 + t*8 + 7)``; byte
    ``ps*576 + t*8 + 7`` (pad) and page padding ``[ps*584, stride)`` are read by nobody.
    """
    packed = cache.packed
    ps, pages, stride = cache.page_block_size, cache.layout.num_pages, packed.stride(0)
    raw = packed.as_strided((pages, stride), (stride, 1)).cpu()
    out = torch.full_like(raw, byte)
    for flat in keep.tolist():
        p, t = divmod(flat, ps)
        out[p, t * 576 : t * 576 + 576] = raw[p, t * 576 : t * 576 + 576]
        out[p, ps * 576 + t * 8 : ps * 576 + t * 8 + 7] = raw[p, ps * 576 + t * 8 : ps * 576 + t * 8 + 7]
    out = out.to(packed.device)
    return formats.as_form(out, "dsv4", ps, cache.layout.form)


def _referenced(indices: torch.Tensor, length: torch.Tensor | None) -> torch.Tensor:
    lanes = torch.arange(indices.shape[1], device=indices.device)
    valid = indices >= 0
    if length is not None:
        valid &= lanes < length.clamp(0, indices.shape[1]).unsqueeze(1)
    return torch.unique(indices[valid].long()).cpu()


@pytest.mark.parametrize("num_tokens", [16, 80], ids=["decode", "prefill"])
@pytest.mark.parametrize("byte", [0x7F, 0xFF], ids=["nan-e4m3-0x7f", "nan-inf-0xff"])
def test_poisoned_bytes_never_reach_the_output(
    byte, num_tokens, sparse_mla_impl, sparse_mla_generator, sparse_mla_device
):
    """Every byte no valid candidate reads (slot 0 included) is NaN/inf garbage; lanes past
    ``topk_length`` point at poisoned slots; -1 lanes are everywhere else."""
    case = AttentionCase("poison", num_tokens, 16, 192, masked_fraction=0.25, num_pages=8, **DUAL_C128)
    inputs = inputs_on(case, sparse_mla_generator, sparse_mla_device)
    for idx in (inputs.indices, inputs.extra_indices):
        idx[idx == 0] = 1  # slot 0 is never referenced, like SGLang's reserved page 0
    lengths = data.topk_lengths(num_tokens, 192, sparse_mla_generator, low=100).to(sparse_mla_device)
    extra_lengths = data.topk_lengths(num_tokens, 128, sparse_mla_generator, low=0).to(sparse_mla_device)
    clean = inputs.run(sparse_mla_impl.sparse_mla_forward, topk_length=lengths, extra_topk_length=extra_lengths)
    keep_main = _referenced(inputs.indices, lengths)
    keep_extra = _referenced(inputs.extra_indices, extra_lengths)
    dirty_main = _poison(inputs.cache, keep_main, byte)
    dirty_extra = _poison(inputs.extra, keep_extra, byte)
    # Lanes past the lengths now name poisoned slots (0 and unreferenced ones).
    lanes = torch.arange(192, device=sparse_mla_device)
    past = lanes >= lengths.unsqueeze(1)
    indices = torch.where(past, (lanes % 3) * 7, inputs.indices).to(torch.int32)
    assert not bool(torch.isin(indices[past].long().cpu(), keep_main).all())
    dirty = sparse_mla_impl.sparse_mla_forward(
        inputs.q, dirty_main, indices,
        **inputs.kwargs(extra_kv_cache=dirty_extra, topk_length=lengths,
                        extra_topk_length=extra_lengths),
    )  # fmt: skip
    assert bool(torch.isfinite(dirty.output).all())
    _same(dirty, clean, "poisoned cache")


@pytest.mark.parametrize("extra_ps", [64, 2], ids=["C4-page64", "C128-page2"])
def test_dual_cache_equals_one_cache_over_the_concatenated_table(
    extra_ps, sparse_mla_impl, sparse_mla_tolerances, sparse_mla_generator, sparse_mla_device
):
    """Main + extra in one softmax == one cache holding main's then extra's rows (page 64),
    indexed by ``[main | extra + main_tokens]`` (FlashInfer's dual-cache test reference)."""
    extra_pages = 512 // extra_ps
    case = AttentionCase("dual", 16, 16, 128, topk_extra=256, extra_page_block_size=extra_ps,
                         extra_num_pages=extra_pages)  # fmt: skip
    inputs = inputs_on(case, sparse_mla_generator, sparse_mla_device)
    dual = inputs.run(sparse_mla_impl.sparse_mla_forward)
    rows = torch.cat(
        [inputs.cache.source.reshape(-1, 512), inputs.extra.source.reshape(-1, 512)]
    ).cpu()  # same BF16 rows -> same quantization, token by token
    joined = data.pack_to_device(rows.view(-1, 64, 512), device=sparse_mla_device)
    n_main = inputs.cache.num_tokens
    extra = torch.where(inputs.extra_indices >= 0, inputs.extra_indices + n_main, -1)
    single = sparse_mla_impl.sparse_mla_forward(
        inputs.q, joined, torch.cat([inputs.indices, extra.to(torch.int32)], dim=1),
        sm_scale=inputs.sm_scale, attn_sink=inputs.attn_sink,
    )  # fmt: skip
    sparse_mla_tolerances.assert_close(single.output, dual.output, "self_output", what="output")
    sparse_mla_tolerances.assert_close(single.lse, dual.lse, "self_lse", what="lse")


@pytest.mark.parametrize("num_tokens", [16, 80], ids=["decode", "prefill"])
@pytest.mark.parametrize(("real", "padded"), [(32, 64), (16, 64), (8, 64), (64, 128)])
def test_real_heads_inside_a_padded_query_are_bitwise_identical(
    real, padded, num_tokens, sparse_mla_impl, sparse_mla_generator, sparse_mla_device
):
    case = AttentionCase("heads", num_tokens, padded, 128, **DUAL_C4)
    inputs: AttentionInputs = inputs_on(case, sparse_mla_generator, sparse_mla_device)
    # The padded heads hold arbitrary queries and sinks; they must not matter.
    full = inputs.run(sparse_mla_impl.sparse_mla_forward)
    exact = sparse_mla_impl.sparse_mla_forward(
        inputs.q[:, :real].contiguous(), inputs.cache.packed, inputs.indices,
        **inputs.kwargs(attn_sink=inputs.attn_sink[:real].contiguous()),
    )  # fmt: skip
    assert_equal(full.output[:, :real], exact.output, what=f"{real} of {padded} heads: output")
    assert_equal(full.lse[:, :real], exact.lse, what=f"{real} of {padded} heads: lse")


@pytest.mark.parametrize("touched", [False, True], ids=["full-split", "touched-pages"])
@pytest.mark.parametrize("num_tokens", [16, 80], ids=["decode", "prefill"])
def test_split_cache_equals_native_64_token_cache(
    touched, num_tokens, sparse_mla_impl, sparse_mla_generator, sparse_mla_device,
    split_buffer_registry,
):  # fmt: skip
    """A 256-token SWA pool split to 64-token pages == the same rows packed natively at 64."""
    page_split_module = pytest.importorskip("pytest_sparse_mla.page_split")
    split = page_split_module.page_split  # the bundled torch split, unless the impl has its own
    if skip_reason_for(sparse_mla_impl, ("page_split",), sparse_mla_device.type) is None:
        split = sparse_mla_impl.page_split
    pool_pages = 4
    source = data.latent((pool_pages, 256, 512), sparse_mla_generator)
    pool = data.pack_to_device(source, device=sparse_mla_device)  # SGLang pool: 149,760 B pages
    native = data.pack_to_device(source.view(-1, 64, 512), device=sparse_mla_device)
    q = data.latent((num_tokens, 16, 512), sparse_mla_generator).to(sparse_mla_device)
    indices = data.sparse_indices(num_tokens, 128, 2 * 256, sparse_mla_generator).to(
        sparse_mla_device
    )  # pool pages 0-1 only: with a touched mask pages 2-3 stay unsplit
    split_cache = split(pool, touched_indices=indices if touched else None, registry=split_buffer_registry)
    assert tuple(split_cache.shape) == (pool_pages * 4, 64, 1, 584)
    kw = {"sm_scale": 512**-0.5, "attn_sink": data.attn_sink(16, sparse_mla_generator).to(sparse_mla_device)}
    a = sparse_mla_impl.sparse_mla_forward(q, split_cache, indices, **kw)
    b = sparse_mla_impl.sparse_mla_forward(q, native, indices, **kw)
    _same(a, b, "split vs native 64-token cache")
