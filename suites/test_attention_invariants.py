"""Sparse-MLA invariants: properties every implementation must have, checked against itself.

Each claim below compares two results of the selected implementation that are equal in exact
arithmetic. Implementations whose profile has ``bitwise_invariants`` (compute mode ``"exact"``,
the bundled reference) must give the same bits where the claim holds by construction (a fixed-order
fp32 pipeline); kernels (``"bf16"``, ``"fp8"``) may differ by their own rounding twice
(``sparse_mla_tolerances.check_invariant``: ``|A - B| <= bound(A) + bound(B)`` with the oracle's
scales). Both formats unless the claim is DSV4-only (the dual cache).

* **Padding width**: a row's result does not depend on how many ``-1`` lanes follow its valid
  prefix, nor on the index width it is padded to (SGLang pads non-instantiated widths with ``-1``,
  sgl-project/sglang #33407, #34717); ``[T, 1, topk]`` indices equal ``[T, topk]`` ones, and a
  row-pitched index view equals a dense one.
* **Head independence**: a head's result does not depend on the other heads or their count
  (sgl-project/sglang #35104, #39235 drop the TP head pad on prefill).
* **Batch independence**: a token's result does not depend on the other tokens (T = 64 vs 65 vs 130,
  across FlashInfer's decode/prefill cutoff).
* **Layout**: a cache as a per-layer view (non-zero storage offset, wide page stride) or with a tight
  or padded page stride gives the result of the plain cache.
* **Main/extra symmetry**: moving candidates between the main and the extra cache (same rows in
  both) does not change the result; the dual cache equals one cache over the concatenated table
  (FlashInfer's dual-cache test reference).
* **Never-read rows**: NaN/Inf bytes in every row no valid lane references (slot 0 and the last row of
  each cache included), in page padding and in the footer pad byte, and stale indices past
  ``topk_length``, never reach the output (sgl-project/sglang #39288: the slot-0 NaN).
* **Sink algebra**: ``attn_sink = -inf`` equals no sink; a finite sink is an extra logit of value
  zero; a zero sink equals a zero-row candidate; a duplicated candidate weighs double.
* **BF16 output rounding**: round to nearest even, checked statistically (the mean signed error in
  units of the last place, oriented by the sign of the value, is near 0; truncation gives -0.5).
* **Page split**: attention over a 256-token pool split to 64-token pages (the implementation's
  split, else the bundled one) equals attention over a native 64-token cache (SGLang PR #27455).
* **Strided queries**: a query that is a view into a wider tensor (a slice of a fused QKV
  projection, heads of a larger batch) gives the result of its contiguous copy.

Every case is fitted to the implementation's envelope (``sparse_mla_inputs``): head counts, widths
and page sizes the kernel takes; a claim that cannot be built inside it is skipped as not
applicable. The padding, head, batch and layout claims are bit for bit where the envelope claims
them (``Envelope.bitwise_invariance``), within two roundings otherwise.
"""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from pytest_sparse_mla import data, formats
from pytest_sparse_mla.attention import oracle_forward
from pytest_sparse_mla.attention.cases import (
    AttentionCase,
    AttentionInputs,
    CacheCase,
    Conventions,
    Values,
    fit_case,
    make_inputs,
)
from pytest_sparse_mla.envelope import ALL_FORMATS, Envelope, NotApplicable
from pytest_sparse_mla.implementations import skip_reason_for

pytestmark = pytest.mark.sparse_mla_needs("sparse_mla_forward")

DUAL_C4 = CacheCase(128, page_block_size=64, num_pages=8)
DUAL_C128 = CacheCase(128, page_block_size=2, num_pages=128)
FORMATS = list(ALL_FORMATS)  # every call format an envelope may name (formats.CALL_FORMATS)


def _pad(indices: torch.Tensor, width: int, value: int = -1) -> torch.Tensor:
    pad = torch.full((indices.shape[0], width), value, dtype=indices.dtype, device=indices.device)
    return torch.cat([indices, pad], dim=1)


#: Why a DSV3.2 parametrisation that needs an extra cache skips (``docs/contract.md``, "An extra
#: cache in DSV3.2 calls": the protocol takes one; this file's DSV3.2 cases do not build one).
NO_DSV32_EXTRA = (
    "not applicable: this test's DSV3.2 cases have no extra cache (DeepSeek-V3.2 deployments use none); a DSV3.2 "
    "call with an extra cache is judged against the oracle by cf-peaked-dsv32-dual-c4"
)


def _dual(fmt: str, extra: CacheCase = DUAL_C4) -> CacheCase | None:
    return None if fmt == "dsv3_2" else extra  # DSV3.2 deployments have no extra cache: NO_DSV32_EXTRA


def _case(
    name: str, fmt: str, num_tokens: int, num_heads: int, main: CacheCase, *, extra: CacheCase | None = None,
    sink_kind: str = "randn", with_sink: bool = True, requires: tuple[str, ...] = (),
) -> AttentionCase:  # fmt: skip
    """A peaked case of format ``fmt``; the tests parametrised over both formats require theirs."""
    return AttentionCase(name, num_tokens, num_heads, main, extra=extra, values=Values("peaked", sink_kind=sink_kind),
                         conventions=Conventions(fmt, with_sink=with_sink), requires=(*requires, "format"))  # fmt: skip


def _na(why: str) -> None:
    pytest.skip(f"not applicable to this envelope: {why}")


@pytest.mark.sparse_mla_error_class("padding-width")
@pytest.mark.parametrize("fmt", FORMATS)
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
def test_padding_with_minus_one_is_neutral(
    fmt, which, topk, length, pad, num_tokens, sparse_mla_impl, sparse_mla_tolerances, sparse_mla_inputs,
    sparse_mla_envelope,
):  # fmt: skip
    if fmt == "dsv3_2" and which != "main":
        pytest.skip(NO_DSV32_EXTRA)
    heads = 64 if num_tokens <= 64 else 16  # 64: what head-specialised decode kernels take
    need = ("tokens", "extra") if which != "main" else ("tokens",)
    case = _case("pad", fmt, num_tokens, heads, CacheCase(topk, topk_length=length), extra=_dual(fmt), requires=need)
    inputs = sparse_mla_inputs(case)
    base = inputs.run(sparse_mla_impl.sparse_mla_forward)
    over: dict[str, object] = {}
    env = sparse_mla_envelope
    if which in ("main", "both"):
        width = inputs.indices.shape[1] + pad
        over["indices"] = _pad(inputs.indices, env.topk.fit(width)[1] - inputs.indices.shape[1])
    if which in ("extra", "both"):
        width = inputs.extra_indices.shape[1] + pad
        over["extra_indices"] = _pad(inputs.extra_indices, env.extra_topk.fit(width)[1] - inputs.extra_indices.shape[1])
    widened = [("indices", inputs.indices), ("extra_indices", inputs.extra_indices)]
    if all(over[k].shape[1] == v.shape[1] for k, v in widened if k in over):
        _na(f"no wider row within the envelope's widths ({env.topk}, {env.extra_topk})")
    widths = ", ".join(f"{k} to {int(v.shape[1])} lanes" for k, v in over.items())  # before `indices` leaves `over`
    padded = sparse_mla_impl.sparse_mla_forward(
        inputs.q, inputs.cache.packed, over.pop("indices", inputs.indices), **inputs.kwargs(**over)
    )
    sparse_mla_tolerances.check_invariant(
        padded, base, oracle=inputs.run(oracle_forward), fmt=fmt, claim="padding",
        what=f"index rows padded with -1: {widths}",
    )  # fmt: skip


@pytest.mark.sparse_mla_error_class("index-forms")
def test_index_forms_are_equal(sparse_mla_impl, sparse_mla_tolerances, sparse_mla_inputs):
    case = _case("forms", "dsv4", 16, 8, CacheCase(128), extra=DUAL_C128)
    inputs = sparse_mla_inputs(case)
    base = inputs.run(sparse_mla_impl.sparse_mla_forward)
    oracle = inputs.run(oracle_forward)
    extra3 = {"extra_indices": inputs.extra_indices.unsqueeze(1)} if inputs.extra_indices is not None else {}
    three_d = sparse_mla_impl.sparse_mla_forward(
        inputs.q, inputs.cache.packed, inputs.indices.unsqueeze(1), **inputs.kwargs(**extra3)
    )
    sparse_mla_tolerances.check_invariant(three_d, base, oracle=oracle, what="[T, 1, topk] indices")
    width = inputs.indices.shape[1]
    wide = _pad(inputs.indices, width, value=12345)  # row pitch 2 x width, view of the first width lanes
    pitched = sparse_mla_impl.sparse_mla_forward(inputs.q, inputs.cache.packed, wide[:, :width], **inputs.kwargs())
    sparse_mla_tolerances.check_invariant(pitched, base, oracle=oracle, what="row-pitched indices")
    if inputs.extra_indices is not None:  # the extra row pitched the same way (a slice of a wider index buffer)
        extra_width = inputs.extra_indices.shape[1]
        extra_wide = _pad(inputs.extra_indices, extra_width, value=12345)
        pitched = sparse_mla_impl.sparse_mla_forward(
            inputs.q, inputs.cache.packed, inputs.indices, **inputs.kwargs(extra_indices=extra_wide[:, :extra_width])
        )
        sparse_mla_tolerances.check_invariant(pitched, base, oracle=oracle, what="row-pitched extra_indices")


def _every_other(x: torch.Tensor, other: float) -> torch.Tensor:
    """``x`` as a stride-2 view: column 0 of ``[..., 2]``, whose column 1 holds ``other``."""
    return torch.stack([x, torch.full_like(x, other)], dim=-1)[..., 0]


@pytest.mark.sparse_mla_error_class("strided-arguments")
@pytest.mark.parametrize("which", ["attn_sink", "lengths"])
def test_strided_sink_and_lengths_equal_contiguous_ones(
    which, sparse_mla_impl, sparse_mla_tolerances, sparse_mla_inputs
):
    """``attn_sink`` as a stride-2 view (a column of a ``[H, 2]`` parameter; its neighbours NaN), or
    ``topk_length`` and ``extra_topk_length`` as stride-2 views (columns of ``[T, 2]`` metadata; the
    neighbours 0), give the contiguous arguments' result, or are refused with an error naming the
    argument (FlashMLA: ``attn_sink must be contiguous``). A kernel that reads ``data_ptr()`` as if
    contiguous reads the neighbours."""
    case = _case("strided-args", "dsv4", 8, 16, CacheCase(128, topk_length=100, masked_fraction=0.0),
                 extra=replace(DUAL_C128, topk_length=70), sink_kind="large")  # fmt: skip
    inputs = sparse_mla_inputs(case)
    rows: dict[str, torch.Tensor] = {}  # lanes past the lengths hold -1 here (stale padding is another test's)
    for key, length in (("indices", "topk_length"), ("extra_indices", "extra_topk_length")):
        row, n = getattr(inputs, key), getattr(inputs, length)
        if row is not None and n is not None:
            lanes = torch.arange(row.shape[1], device=row.device)
            rows[key] = row.masked_fill(lanes[None, :] >= n[:, None].to(row.device), -1)
    main_row = rows.pop("indices", inputs.indices)
    names = ["attn_sink"] if which == "attn_sink" else ["topk_length", "extra_topk_length"]
    over = {k: _every_other(getattr(inputs, k), math.nan if k == "attn_sink" else 0)
            for k in names if getattr(inputs, k) is not None}  # fmt: skip
    if not over:
        _na(f"no {which} in this envelope")
    base = sparse_mla_impl.sparse_mla_forward(inputs.q, inputs.cache.packed, main_row, **inputs.kwargs(**rows))
    try:
        strided = sparse_mla_impl.sparse_mla_forward(
            inputs.q, inputs.cache.packed, main_row, **inputs.kwargs(**rows, **over)
        )
    except (ValueError, TypeError, RuntimeError) as exc:  # a refusal must name what it refuses
        assert any(k in str(exc) for k in over), f"a refusal of stride-2 {', '.join(over)} must name it: {exc}"
        return
    oracle = oracle_forward(inputs.q, inputs.cache.packed, main_row, **inputs.kwargs(**rows))
    sparse_mla_tolerances.check_invariant(strided, base, oracle=oracle, what=f"stride-2 views of {', '.join(over)}")


@pytest.mark.sparse_mla_error_class("permutation")
@pytest.mark.parametrize("fmt", FORMATS)
def test_candidate_permutation_invariance(
    fmt, sparse_mla_impl, sparse_mla_tolerances, sparse_mla_generator, sparse_mla_inputs
):
    case = _case("perm", fmt, 16, 16, CacheCase(128, masked_fraction=0.25), extra=_dual(fmt, DUAL_C128))
    inputs = sparse_mla_inputs(case)
    base = inputs.run(sparse_mla_impl.sparse_mla_forward)

    def shuffle(idx: torch.Tensor) -> torch.Tensor:
        order = torch.rand(idx.shape, generator=sparse_mla_generator).argsort(dim=1)
        return idx.gather(1, order.to(idx.device))

    over = {"extra_indices": shuffle(inputs.extra_indices)} if inputs.extra_indices is not None else {}
    shuffled = sparse_mla_impl.sparse_mla_forward(
        inputs.q, inputs.cache.packed, shuffle(inputs.indices), **inputs.kwargs(**over)
    )
    sparse_mla_tolerances.check_invariant(
        shuffled, base, oracle=inputs.run(oracle_forward), fmt=fmt, what="candidates permuted", bitwise=False
    )


@pytest.mark.sparse_mla_error_class("duplicate-candidate")
@pytest.mark.parametrize("fmt", FORMATS)
def test_duplicated_candidate_weighs_double(fmt, sparse_mla_impl, sparse_mla_tolerances, sparse_mla_inputs):
    """Indices ``[a, a, b, -1, ...]``: weights ``2 e^{s_a}`` and ``e^{s_b}``, computed here."""
    case = AttentionCase("dup", 4, 8, CacheCase(64, num_pages=2), conventions=Conventions(fmt, with_sink=False))
    inputs = sparse_mla_inputs(case)
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
    expected = (w_a[..., None] * rows[a, :512] + w_b[..., None] * rows[b, :512]) / total[..., None]
    sparse_mla_tolerances.check_output(res.output, expected, fmt=fmt, what="duplicated candidate: output")
    if inputs.lse_convention == "flashinfer":
        sparse_mla_tolerances.check_lse(res.lse, torch.log2(total), fmt=fmt, what="duplicated candidate: lse")
    elif inputs.lse_convention == "flashmla":
        sparse_mla_tolerances.check_lse(res.lse, torch.log(total), fmt=fmt, lse_convention="flashmla",
                                        what="duplicated candidate: lse")  # fmt: skip


@pytest.mark.sparse_mla_error_class("minus-inf-sink", "sink-algebra")
@pytest.mark.parametrize("fmt", FORMATS)
def test_sink_minus_inf_equals_no_sink(
    fmt, sparse_mla_impl, sparse_mla_tolerances, sparse_mla_inputs, sparse_mla_envelope, sparse_mla_device
):
    case = _case("sink-inf", fmt, 16, 16, CacheCase(128), extra=_dual(fmt), with_sink=False)
    inputs = sparse_mla_inputs(case)
    if not sparse_mla_envelope.takes_sink(inputs.case.conventions.fmt):
        _na(sparse_mla_envelope.sink_reason(inputs.case.conventions.fmt))
    base = inputs.run(sparse_mla_impl.sparse_mla_forward)
    sink = torch.full((inputs.q.shape[1],), -math.inf, dtype=torch.float32, device=sparse_mla_device)
    res = inputs.run(sparse_mla_impl.sparse_mla_forward, attn_sink=sink)
    sparse_mla_tolerances.check_invariant(res, base, oracle=inputs.run(oracle_forward), fmt=fmt,
                                          what="attn_sink=-inf vs no sink", bitwise=False)  # fmt: skip


@pytest.mark.sparse_mla_error_class("large-sink", "sink-algebra")
@pytest.mark.parametrize("fmt", FORMATS)
def test_finite_sink_is_an_extra_logit_with_zero_value(fmt, sparse_mla_impl, sparse_mla_tolerances, sparse_mla_inputs):
    """``Z' = Z + e^sink`` and ``out' = out * Z / Z'``, from the implementation's no-sink run."""
    case = _case("sink", fmt, 16, 16, CacheCase(128), extra=_dual(fmt, DUAL_C128), sink_kind="large",
                 requires=("sink",))  # fmt: skip
    inputs = sparse_mla_inputs(case)
    if inputs.lse_convention is None:
        _na("the claim is stated through the LSE (lse_conventions=())")
    without = inputs.run(sparse_mla_impl.sparse_mla_forward, attn_sink=None)
    with_sink = inputs.run(sparse_mla_impl.sparse_mla_forward)
    to_natural = math.log(2.0) if inputs.lse_convention == "flashinfer" else 1.0
    lse_e = without.lse.double() * to_natural  # natural log of Z
    sink = inputs.attn_sink.double().unsqueeze(0)
    expected_out = without.output.double() * torch.sigmoid(lse_e - sink).unsqueeze(-1)
    # FlashInfer's LSE includes the sink, FlashMLA's leaves it out; both compared in log2 units
    total = torch.logaddexp(lse_e, sink) if inputs.lse_convention == "flashinfer" else lse_e
    expected_lse = total / math.log(2.0)
    sparse_mla_tolerances.assert_close(with_sink.output, expected_out, "self_output", fmt=fmt,
                                       what="sink as an extra logit: output")  # fmt: skip
    lse_log2 = with_sink.lse.double() * to_natural / math.log(2.0)
    sparse_mla_tolerances.assert_close(lse_log2, expected_lse, "self_lse", fmt=fmt,
                                       what=f"sink as an extra logit: lse ({inputs.lse_convention})")  # fmt: skip


@pytest.mark.sparse_mla_error_class("sink-algebra")
def test_zero_sink_equals_a_zero_row_candidate(
    sparse_mla_impl, sparse_mla_tolerances, sparse_mla_generator, sparse_mla_device, sparse_mla_envelope
):
    """A zero latent row scores exactly 0 and carries value 0: it is a sink of logit 0."""
    env = sparse_mla_envelope
    if not env.attn_sink:
        _na("attn_sink (attn_sink=False)")
    try:
        zero_sink = AttentionCase("zero-sink", 16, 16, CacheCase(128, num_pages=4), requires=("page", "format"))
        fitted = fit_case(zero_sink, env)
    except NotApplicable as exc:
        pytest.skip(str(exc))
    num_pages, ps, heads, width = 4, 64, fitted.num_heads, fitted.main.index_width or fitted.main.topk
    source = data.latent((num_pages, ps, 512), sparse_mla_generator)
    source[-1, -1] = 0  # the last slot holds an all-zero row (E4M3 0 at the 2**-13 floor scale)
    cache = data.pack_to_device(source, device=sparse_mla_device)
    q = data.latent((fitted.num_tokens, heads, 512), sparse_mla_generator).to(sparse_mla_device)
    indices = data.sparse_indices(fitted.num_tokens, width, num_pages * ps - 1, sparse_mla_generator)
    indices = indices.to(sparse_mla_device)
    zero_slot = num_pages * ps - 1
    with_column = indices.clone()
    with_column[:, width - 28] = zero_slot  # a masked lane (second half) becomes the zero-value candidate
    convention = env.lse_convention
    kw: dict[str, object] = {"sm_scale": 512**-0.5, **({"lse_convention": convention} if convention else {})}
    zero_sink = torch.zeros(heads, dtype=torch.float32, device=sparse_mla_device)
    a = sparse_mla_impl.sparse_mla_forward(q, cache, indices, attn_sink=zero_sink, **kw)
    b = sparse_mla_impl.sparse_mla_forward(q, cache, with_column, **kw)
    oracle = oracle_forward(q, cache, with_column, **kw)
    if convention != "flashinfer":  # FlashMLA's LSE leaves the sink out: only the outputs are equal
        a, b = SimpleNamespace(output=a.output, lse=None), SimpleNamespace(output=b.output, lse=None)
    sparse_mla_tolerances.check_invariant(a, b, oracle=oracle, what="zero sink vs zero-row candidate", bitwise=False)


# --- rows that must never be read --------------------------------------------------------------------


def _poison(cache: data.PackedKVCache, keep: torch.Tensor, byte: int) -> torch.Tensor:
    """A copy of ``cache.packed`` whose every byte not read for the tokens in ``keep`` is ``byte``
    (page padding included)."""
    packed = cache.packed
    ps, pages, stride = cache.page_block_size, cache.layout.num_pages, packed.stride(0)
    raw = packed.as_strided((pages, stride), (stride, 1), packed.storage_offset()).cpu()
    out = torch.full_like(raw, byte)
    for flat in keep.tolist():
        p, t = divmod(flat, ps)
        for lo, hi in formats.token_byte_ranges(cache.fmt, ps, t):
            out[p, lo:hi] = raw[p, lo:hi]
    return formats.as_form(out.to(packed.device), cache.fmt, ps, cache.layout.form)


def _referenced(indices: torch.Tensor, length: torch.Tensor | None) -> torch.Tensor:
    lanes = torch.arange(indices.shape[1], device=indices.device)
    valid = indices >= 0
    if length is not None:
        valid &= lanes < length.clamp(0, indices.shape[1]).unsqueeze(1)
    return torch.unique(indices[valid].long()).cpu()


def _avoid_ends(indices: torch.Tensor, num_rows: int) -> None:
    """Slot 0 and the last row of the cache are never referenced (in place)."""
    indices[indices == 0] = 1
    indices[indices == num_rows - 1] = num_rows - 2


@pytest.mark.sparse_mla_error_class("poisoned-rows")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("num_tokens", [16, 80], ids=["decode", "prefill"])
@pytest.mark.parametrize("byte", [0x7F, 0xFF], ids=["nan-e4m3-0x7f", "nan-inf-0xff"])
def test_poisoned_rows_never_reach_the_output(
    fmt, byte, num_tokens, sparse_mla_impl, sparse_mla_tolerances, sparse_mla_generator, sparse_mla_device,
    sparse_mla_inputs, sparse_mla_envelope,
):  # fmt: skip
    """Every byte no valid candidate reads (slot 0 and the last row of each cache included) is NaN/Inf
    garbage; index draws are sparse (32 valid lanes over 512 or more rows) so most rows are
    unreferenced; lanes past ``topk_length`` point at poisoned slots; -1 lanes elsewhere."""
    heads = 64 if num_tokens <= 64 else 16  # 64: what head-specialised decode kernels take
    case = _case("poison", fmt, num_tokens, heads, CacheCase(192, num_pages=8, masked_fraction=0.75),
                 extra=_dual(fmt, DUAL_C128))  # fmt: skip
    inputs = sparse_mla_inputs(case)
    num_tokens, width = inputs.indices.shape
    _avoid_ends(inputs.indices, inputs.cache.num_tokens)
    # Lengths (where the envelope takes them) leave stale lanes that must not be read either.
    with_lengths = sparse_mla_envelope.takes_lengths(fmt)
    lengths = data.topk_lengths(num_tokens, width, sparse_mla_generator, low=20).to(sparse_mla_device)
    over: dict[str, object] = {"topk_length": lengths} if with_lengths else {}
    if inputs.extra is not None:
        _avoid_ends(inputs.extra_indices, inputs.extra.num_tokens)
        extra_lengths = data.topk_lengths(num_tokens, inputs.extra_indices.shape[1], sparse_mla_generator, low=0)
        if with_lengths:
            over["extra_topk_length"] = extra_lengths.to(sparse_mla_device)
    if not with_lengths:
        lengths = torch.full((num_tokens,), width, dtype=torch.int32, device=sparse_mla_device)
    clean = inputs.run(sparse_mla_impl.sparse_mla_forward, **over)
    dirty_main = _poison(inputs.cache, _referenced(inputs.indices, lengths), byte)
    if inputs.extra is not None:
        keep_extra = _referenced(inputs.extra_indices, over.get("extra_topk_length"))
        over["extra_kv_cache"] = _poison(inputs.extra, keep_extra, byte)
    # Lanes past the lengths now name poisoned slots (0, the last row and unreferenced ones).
    lanes = torch.arange(width, device=sparse_mla_device)
    past = lanes >= lengths.unsqueeze(1)
    last = inputs.cache.num_tokens - 1
    stale = torch.where(lanes % 2 == 0, 0, last).expand_as(inputs.indices)
    indices = torch.where(past, stale, inputs.indices).to(torch.int32)
    dirty = sparse_mla_impl.sparse_mla_forward(inputs.q, dirty_main, indices, **inputs.kwargs(**over))
    assert bool(torch.isfinite(dirty.output).all()), (
        f"{int((~torch.isfinite(dirty.output)).sum())} non-finite output elements: a never-read row was read"
    )
    oracle = inputs.run(oracle_forward, **{k: v for k, v in over.items() if k != "extra_kv_cache"})
    sparse_mla_tolerances.check_invariant(dirty, clean, oracle=oracle, fmt=fmt, what="poisoned cache vs clean cache")


# --- main / extra ---------------------------------------------------------------------------------


def _fitted(case: AttentionCase, envelope: object) -> AttentionCase:
    """``fit_case``, skipping the test as not applicable when the envelope rules the case out."""
    try:
        return fit_case(case, envelope)
    except NotApplicable as exc:
        pytest.skip(f"{case.name}: {exc}")


@pytest.mark.sparse_mla_error_class("dual-cache")
@pytest.mark.parametrize("extra_ps", [64, 2], ids=["C4-page64", "C128-page2"])
def test_dual_cache_equals_one_cache_over_the_concatenated_table(
    extra_ps, sparse_mla_impl, sparse_mla_tolerances, sparse_mla_inputs, sparse_mla_envelope, sparse_mla_device
):
    """Main + extra in one softmax == one cache holding main's then extra's rows (page 64),
    indexed by ``[main | extra + main_tokens]`` (FlashInfer's dual-cache test reference)."""
    extra_pages = 512 // extra_ps
    case = AttentionCase("dual", 16, 16, CacheCase(128),
                         extra=CacheCase(256, page_block_size=extra_ps, num_pages=extra_pages), values=Values("peaked"),
                         requires=("extra", "extra_page", "page", "format"))  # fmt: skip
    inputs = sparse_mla_inputs(case)
    dual = inputs.run(sparse_mla_impl.sparse_mla_forward)
    rows = torch.cat(
        [inputs.cache.source.reshape(-1, 512), inputs.extra.source.reshape(-1, 512)]
    ).cpu()  # same BF16 rows -> same quantization, token by token
    joined = data.pack_to_device(rows.view(-1, 64, 512), device=sparse_mla_device)
    n_main = inputs.cache.num_tokens
    extra = torch.where(inputs.extra_indices >= 0, inputs.extra_indices + n_main, -1)
    row = torch.cat([inputs.indices, extra.to(torch.int32)], dim=1)
    width = sparse_mla_envelope.topk.fit(row.shape[1])[1]
    if width < row.shape[1]:
        _na(f"a joined row of {row.shape[1]} lanes ({sparse_mla_envelope.topk})")
    single = sparse_mla_impl.sparse_mla_forward(
        inputs.q, joined, _pad(row, width - row.shape[1]), sm_scale=inputs.sm_scale, attn_sink=inputs.attn_sink,
        **({"lse_convention": inputs.lse_convention} if inputs.lse_convention else {}),
    )  # fmt: skip
    what = ("dual cache vs one concatenated cache (the same candidates in one cache: a difference is the extra "
            "cache's own treatment, e.g. its sm_scale, dequantization or page addressing)")  # fmt: skip
    sparse_mla_tolerances.check_invariant(single, dual, oracle=inputs.run(oracle_forward), what=what,
                                          bitwise=False)  # fmt: skip


@pytest.mark.sparse_mla_error_class("main-extra-symmetry")
@pytest.mark.parametrize("split", ["all-main", "all-extra", "halves", "alternate"])
def test_moving_candidates_between_the_caches_changes_nothing(
    split, sparse_mla_impl, sparse_mla_tolerances, sparse_mla_inputs, sparse_mla_envelope, sparse_mla_device
):
    """The extra cache holds the same rows as the main cache (both page 64): a token's candidates
    may sit in either, and the result is the main-only one. A kernel that drops the extra cache,
    reads it with the main cache's page size or stride, or reads extra lanes from the main cache
    fails."""
    env = sparse_mla_envelope
    if not env.takes_extra("dsv4") or Envelope.page_for(64, env.extra_page_block_sizes) != 64:
        _na("an extra cache of 64-token pages for 'dsv4'")
    case = AttentionCase("sym", 16, 16, CacheCase(128, num_pages=4, masked_fraction=0.25), values=Values("peaked"),
                         requires=("page", "format"))  # fmt: skip
    inputs = sparse_mla_inputs(case)
    width = inputs.indices.shape[1]
    if env.extra_topk.reason("extra_topk", width) is not None:
        _na(env.extra_topk.reason("extra_topk", width) or "")
    same = data.pack_to_device(inputs.cache.source.cpu(), page_stride="tight", device=sparse_mla_device)
    reference = inputs.run(sparse_mla_impl.sparse_mla_forward)
    lanes = torch.arange(width, device=sparse_mla_device)
    in_extra = {
        "all-main": lanes < 0, "all-extra": lanes >= 0, "halves": lanes >= width // 2, "alternate": lanes % 2 == 1,
    }  # fmt: skip
    to_extra = in_extra[split].expand_as(inputs.indices)
    main_idx = torch.where(to_extra, -1, inputs.indices).to(torch.int32)
    extra_idx = torch.where(to_extra, inputs.indices, -1).to(torch.int32)
    moved = sparse_mla_impl.sparse_mla_forward(
        inputs.q, inputs.cache.packed, main_idx, **inputs.kwargs(extra_kv_cache=same, extra_indices=extra_idx)
    )
    what = (f"candidates moved to the extra cache ({split}; only their cache changed: a difference is the "
            "extra cache's own treatment, e.g. its sm_scale, dequantization or page addressing)")  # fmt: skip
    oracle = inputs.run(oracle_forward)
    sparse_mla_tolerances.check_invariant(moved, reference, oracle=oracle, what=what, bitwise=False)


# --- heads, tokens, layout ------------------------------------------------------------------------


@pytest.mark.sparse_mla_error_class("head-independence")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("num_tokens", [16, 80], ids=["decode", "prefill"])
@pytest.mark.parametrize(("lo", "hi", "total"), [(0, 1, 33), (16, 33, 33), (0, 32, 64), (5, 21, 64), (64, 128, 128)])
def test_a_heads_result_does_not_depend_on_the_other_heads(
    fmt, lo, hi, total, num_tokens, sparse_mla_impl, sparse_mla_tolerances, sparse_mla_generator, sparse_mla_device,
    sparse_mla_inputs, sparse_mla_envelope,
):  # fmt: skip
    """Heads ``[lo, hi)`` run alone (with their own sinks) equal the same heads inside a
    ``total``-head call whose other heads hold arbitrary queries and sinks. Where the envelope
    takes ``total`` heads but not ``hi - lo``, the heads run inside a second ``total``-head call
    whose other heads hold other queries and sinks."""
    if total == 128 and num_tokens == 80 and sparse_mla_device.type == "cpu":
        pytest.skip("128 heads x 80 tokens: CUDA only, to keep the CPU suite small")
    case = _case("heads", fmt, num_tokens, total, CacheCase(128), extra=_dual(fmt), sink_kind="mixed-inf",
                 requires=("tokens",))  # fmt: skip
    inputs: AttentionInputs = sparse_mla_inputs(case)
    heads = inputs.q.shape[1]
    if lo >= heads:
        _na(f"heads {lo}..{hi - 1} of a {heads}-head call")
    hi = min(hi, heads)
    sink = inputs.attn_sink
    full = inputs.run(sparse_mla_impl.sparse_mla_forward)
    env = sparse_mla_envelope
    if env.num_heads is None or (hi - lo) in env.num_heads:
        part_sink = {"attn_sink": sink[lo:hi].contiguous()} if sink is not None else {}
        part = sparse_mla_impl.sparse_mla_forward(
            inputs.q[:, lo:hi].contiguous(), inputs.cache.packed, inputs.indices, **inputs.kwargs(**part_sink)
        )
        what = f"heads {lo}..{hi - 1} alone vs inside {heads} heads"
    else:
        others = torch.ones(heads, dtype=torch.bool)
        others[lo:hi] = False
        q2 = inputs.q.clone()
        q2[:, others.to(q2.device)] = data.latent((inputs.q.shape[0], int(others.sum()), inputs.q.shape[2]),
                                                  sparse_mla_generator).to(q2.device)  # fmt: skip
        over = {}
        if sink is not None:
            over["attn_sink"] = torch.where(others.to(sink.device), sink.flip(0), sink)
        whole = sparse_mla_impl.sparse_mla_forward(q2, inputs.cache.packed, inputs.indices, **inputs.kwargs(**over))
        part = SimpleNamespace(output=whole.output[:, lo:hi], lse=None if whole.lse is None else whole.lse[:, lo:hi])
        what = f"heads {lo}..{hi - 1} of {heads} with the other heads' queries and sinks changed"
    sliced = inputs.run(oracle_forward).select(heads=slice(lo, hi))
    full_part = SimpleNamespace(output=full.output[:, lo:hi], lse=None if full.lse is None else full.lse[:, lo:hi])
    sparse_mla_tolerances.check_invariant(full_part, part, oracle=sliced, fmt=fmt, claim="heads", what=what)


@pytest.mark.sparse_mla_error_class("batch-independence", "T-64-65")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("num_tokens", [65, 130])
def test_a_tokens_result_does_not_depend_on_the_other_tokens(
    fmt, num_tokens, sparse_mla_impl, sparse_mla_tolerances, sparse_mla_inputs, sparse_mla_envelope
):
    """The first 64 tokens of a ``num_tokens``-token call (prefill) equal the 64-token call
    (decode) over the same rows (for a kernel that takes no 64-token call: its smallest call), and
    the other tokens equal a call over them alone (where the envelope takes that many tokens): a
    prefill kernel that reads token ``t % 128``'s rows past token 127 fails the second."""
    case = _case("batch", fmt, num_tokens, 64, CacheCase(128), extra=_dual(fmt, DUAL_C128), requires=("tokens",))
    inputs = sparse_mla_inputs(case)
    part = sparse_mla_envelope.tokens_for(64)
    if part >= num_tokens:
        _na(f"a call of fewer than {num_tokens} tokens (min_tokens={sparse_mla_envelope.min_tokens})")
    full = inputs.run(sparse_mla_impl.sparse_mla_forward)
    spans = [(0, part)]
    if sparse_mla_envelope.tokens_for(num_tokens - part) == num_tokens - part:
        spans.append((part, num_tokens))
    for lo, hi in spans:
        kw = inputs.kwargs()
        for key in ("indices", "extra_indices", "topk_length", "extra_topk_length"):
            if kw.get(key) is not None:
                kw[key] = kw[key][lo:hi]
        alone = sparse_mla_impl.sparse_mla_forward(inputs.q[lo:hi], inputs.cache.packed, inputs.indices[lo:hi], **kw)
        oracle = oracle_forward(inputs.q[lo:hi], inputs.cache.packed, inputs.indices[lo:hi], **kw)
        rows = SimpleNamespace(output=full.output[lo:hi], lse=None if full.lse is None else full.lse[lo:hi])
        what = f"tokens {lo}..{hi - 1} of a {num_tokens}-token call vs a {hi - lo}-token call of them alone"
        sparse_mla_tolerances.check_invariant(rows, alone, oracle=oracle, fmt=fmt, claim="batch", what=what)


@pytest.mark.sparse_mla_error_class("per-layer-views", "layout")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    ("layout", "spec"),
    [
        ("main-layer2of3", {"main": {"layer": 2, "num_layers": 3}}),
        ("main-tight", {"main": {"page_stride": "tight"}}),
        ("extra-layer1of2-tight", {"extra": {"layer": 1, "num_layers": 2, "page_stride": "tight"}}),
        ("both-layers", {"main": {"layer": 1, "num_layers": 2}, "extra": {"layer": 1, "num_layers": 3}}),
    ],
)
def test_layout_does_not_change_the_result(
    fmt, layout, spec, sparse_mla_impl, sparse_mla_tolerances, sparse_mla_generator, sparse_mla_device,
    sparse_mla_envelope,
):  # fmt: skip
    """The same rows as a plain padded cache and as a per-layer view / tight-stride cache give the
    same result (the generator state is replayed, so the rows are identical)."""
    if fmt == "dsv3_2" and layout.startswith(("extra", "both")):
        pytest.skip(NO_DSV32_EXTRA)
    if fmt == "dsv3_2" and spec.get("main", {}).get("page_stride") == "tight":
        spec = {"main": {"layer": 1, "num_layers": 2, "page_stride": "tight"}}
    need = ("extra",) if layout.startswith(("extra", "both")) else ()
    base_case = _case("layout", fmt, 8, 64, CacheCase(128), extra=_dual(fmt, DUAL_C128), requires=need)
    base_case = _fitted(base_case, sparse_mla_envelope)
    state = sparse_mla_generator.get_state()
    plain = make_inputs(base_case, sparse_mla_generator, device=sparse_mla_device)
    sparse_mla_generator.set_state(state)
    extra = None if base_case.extra is None else replace(base_case.extra, **spec.get("extra", {}))
    relaid = replace(base_case, main=replace(base_case.main, **spec.get("main", {})), extra=extra)
    other_case = _fitted(relaid, sparse_mla_envelope)  # a tight page must stay packable
    other = make_inputs(other_case, sparse_mla_generator, device=sparse_mla_device)
    assert torch.equal(plain.cache.dequantized, other.cache.dequantized) and torch.equal(plain.q, other.q)
    convention = sparse_mla_envelope.lse_convention
    plain, other = replace(plain, lse_convention=convention), replace(other, lse_convention=convention)
    a = plain.run(sparse_mla_impl.sparse_mla_forward)
    b = other.run(sparse_mla_impl.sparse_mla_forward)
    sparse_mla_tolerances.check_invariant(b, a, oracle=plain.run(oracle_forward), fmt=fmt, claim="layout",
                                          what=f"{layout} vs plain padded cache")  # fmt: skip


@pytest.mark.sparse_mla_error_class("strided-query")
@pytest.mark.parametrize("view", ["head-pitch", "token-pitch"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_strided_query_view_equals_its_contiguous_copy(
    fmt, view, sparse_mla_impl, sparse_mla_tolerances, sparse_mla_inputs
):
    """A valid query that is a view into a wider tensor: ``head-pitch`` slices the first ``d_qk``
    columns of a ``[T, H, d_qk + 64]`` tensor (a fused projection's output; head stride
    ``d_qk + 64``), ``token-pitch`` takes every second token of a ``[2T, H, d_qk]`` tensor (token
    stride ``2 H d_qk``). The other elements hold NaN: a kernel that reads ``q`` as if it were
    contiguous reads them."""
    case = _case("strided-q", fmt, 8, 16, CacheCase(128), extra=_dual(fmt), sink_kind="large")
    inputs = sparse_mla_inputs(case)
    q = inputs.q
    t, h, d = q.shape
    if view == "head-pitch":
        wide = torch.full((t, h, d + 64), math.nan, dtype=q.dtype, device=q.device)
        wide[..., :d] = q
        strided = wide[..., :d]
    else:
        wide = torch.full((2 * t, h, d), math.nan, dtype=q.dtype, device=q.device)
        wide[0::2] = q
        strided = wide[0::2]
    if strided.is_contiguous():  # one token, or one head
        _na(f"a {view} view of q {tuple(q.shape)} is contiguous")
    assert torch.equal(strided, q)
    base = inputs.run(sparse_mla_impl.sparse_mla_forward)
    res = sparse_mla_impl.sparse_mla_forward(strided, inputs.cache.packed, inputs.indices, **inputs.kwargs())
    sparse_mla_tolerances.check_invariant(res, base, oracle=inputs.run(oracle_forward), fmt=fmt, claim="layout",
                                          what=f"q as a {view} view vs its contiguous copy")  # fmt: skip


# --- BF16 rounding --------------------------------------------------------------------------------


@pytest.mark.sparse_mla_error_class("bf16-rounding")
def test_bf16_output_is_rounded_to_nearest(sparse_mla_impl, sparse_mla_tolerances, sparse_mla_inputs):
    """Mean of ``sign(E) * (A - E) / ulp(E)`` over 2**19 elements: about 0 for round-to-nearest-even
    (the kernel's own rounding noise is zero-mean), -0.5 for truncation toward zero, +0.5 for
    rounding away. Bound 0.2 ulp (the noise of a BF16-P kernel is about 1 ulp per element, so the
    mean's standard deviation is about 0.0014 ulp). Not judged for FP8 compute (``u_p`` above
    ``2**-8``): E4M3 probabilities scaled to the format's top are rounded with a bias of several
    output ulps, which hides the output's own rounding."""
    if sparse_mla_tolerances.model.p_unit_roundoff > 2.0**-8:
        pytest.skip(
            f"profile {sparse_mla_tolerances.profile!r}: probabilities rounded with u_p = "
            f"{sparse_mla_tolerances.model.p_unit_roundoff:g} > 2**-8 hide the BF16 output rounding"
        )
    case = AttentionCase("rounding", 64, 16, CacheCase(128), extra=CacheCase(64, page_block_size=64, num_pages=4))
    inputs = sparse_mla_inputs(case)
    res = inputs.run(sparse_mla_impl.sparse_mla_forward)
    e = inputs.run(oracle_forward).output
    a = res.output.double()
    nonzero = e != 0
    exponent = torch.floor(torch.log2(e[nonzero].abs()))
    ulp = torch.exp2(exponent - 7)  # BF16: 8 significant bits
    signed = (torch.sign(e[nonzero]) * (a[nonzero] - e[nonzero]) / ulp).clamp(-64, 64)
    mean = float(signed.mean())
    # no rounding mode is off by more than half an ulp on average: a larger bias is a wrong value
    wrong = "; above 1 ulp it is a wrong value, not a rounding mode: see the accuracy tests" if abs(mean) > 1 else ""
    assert abs(mean) < 0.2, (
        f"BF16 output rounding: mean signed error {mean:+.3f} ulp over {signed.numel()} elements "
        f"(round-to-nearest-even gives about 0; truncation toward zero gives -0.5){wrong}"
    )


# --- page split -----------------------------------------------------------------------------------


@pytest.mark.sparse_mla_error_class("page-split")
@pytest.mark.parametrize("touched", [False, True], ids=["full-split", "touched-pages"])
@pytest.mark.parametrize("num_tokens", [16, 80], ids=["decode", "prefill"])
def test_split_cache_equals_native_64_token_cache(
    touched, num_tokens, sparse_mla_impl, sparse_mla_tolerances, sparse_mla_generator, sparse_mla_device,
    split_buffer_registry, sparse_mla_envelope,
):  # fmt: skip
    """A 256-token SWA pool split to 64-token pages == the same rows packed natively at 64."""
    page_split_module = pytest.importorskip("pytest_sparse_mla.page_split")
    split = page_split_module.page_split  # the bundled torch split, unless the impl has its own
    if skip_reason_for(sparse_mla_impl, ("page_split",), sparse_mla_device.type) is None:
        split = sparse_mla_impl.page_split
    split_case = AttentionCase("split", num_tokens, 16, CacheCase(128), requires=("page", "tokens", "format"))
    fitted = _fitted(split_case, sparse_mla_envelope)
    heads, width = fitted.num_heads, fitted.main.index_width or fitted.main.topk
    pool_pages = 4
    source = data.latent((pool_pages, 256, 512), sparse_mla_generator)
    pool = data.pack_to_device(source, device=sparse_mla_device)  # SGLang pool: 149,760 B pages
    native = data.pack_to_device(source.view(-1, 64, 512), device=sparse_mla_device)
    q = data.latent((num_tokens, heads, 512), sparse_mla_generator).to(sparse_mla_device)
    indices = data.sparse_indices(num_tokens, width, 2 * 256, sparse_mla_generator).to(
        sparse_mla_device
    )  # pool pages 0-1 only: with a touched mask pages 2-3 stay unsplit
    split_cache = split(pool, touched_indices=indices if touched else None, registry=split_buffer_registry)
    assert tuple(split_cache.shape) == (pool_pages * 4, 64, 1, 584)
    kw = {"sm_scale": 512**-0.5}
    if fitted.conventions.with_sink:
        kw["attn_sink"] = data.attn_sink(heads, sparse_mla_generator).to(sparse_mla_device)
    a = sparse_mla_impl.sparse_mla_forward(q, split_cache, indices, **kw)
    b = sparse_mla_impl.sparse_mla_forward(q, native, indices, **kw)
    sparse_mla_tolerances.check_invariant(a, b, oracle=oracle_forward(q, native, indices, **kw),
                                          what="split vs native 64-token cache")  # fmt: skip
