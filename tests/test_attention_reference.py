"""The bundled reference forward's own contract (``pytest_sparse_mla.attention.sparse_mla_forward``).

Self-tests of the bundled reference (they call it directly, whatever ``--sparse-mla-impl``
selects; the conformance suites under ``suites/`` judge the selected implementation):

* its fp32 output (before BF16 rounding) and LSE are within 1e-5 relative of the float64 oracle at
  DeepSeek-V4 shapes, and its BF16 output is that fp32 output rounded once;
* it rejects a positive index past its cache inside the valid prefix (the SM120 kernels do not
  bounds-check: undefined behaviour, flashinfer-python 0.7.4 ``kernels/fp8_decode/decode.cuh``);
* chunking over tokens (the memory bound) does not change the result;
* with a FlashInfer release (``grid_release=`` / ``--sparse-mla-grid``) it raises that release's
  exact error for a shape the release cannot run, with the published text, and records the
  release's verdict otherwise (``suites/test_dispatch_grid.py`` holds any implementation that
  declares ``flashinfer_release`` to the same rule).
"""

from __future__ import annotations

import pytest
import torch

from pytest_sparse_mla import formats
from pytest_sparse_mla.attention import oracle_forward, sparse_mla_forward
from pytest_sparse_mla.attention.cases import AttentionCase, CacheCase, Conventions
from pytest_sparse_mla.envelope import ALL_FORMATS
from pytest_sparse_mla.parametrize import case_params, inputs_on

_FP32_CASES = (
    AttentionCase("Flash-C4-TP1-T65", 65, 64, CacheCase(128, masked_fraction=0.0),
                  extra=CacheCase(512, page_block_size=64, num_pages=16, masked_fraction=0.25)),
    AttentionCase("Pro-C128-TP1-T2", 2, 128, CacheCase(128, masked_fraction=0.0),
                  extra=CacheCase(512, page_block_size=2, num_pages=512, masked_fraction=0.25)),
    AttentionCase("Flash-DSpark-TP2-T6", 6, 32, CacheCase(192, masked_fraction=0.0, topk_length=133)),
    AttentionCase("dsv32-h16-k256-T8", 8, 16, CacheCase(256), conventions=Conventions("dsv3_2")),
    AttentionCase("Flash-C4-TP1-T4096", 4096, 64, CacheCase(128, num_pages=64, masked_fraction=0.0),
                  extra=CacheCase(512, page_block_size=64, num_pages=64, masked_fraction=0.25), large=True),
    AttentionCase("Pro-C4-TP1-T1024", 1024, 128, CacheCase(128, num_pages=64, masked_fraction=0.0),
                  extra=CacheCase(512, page_block_size=64, num_pages=64, masked_fraction=0.25), large=True),
)  # fmt: skip


@pytest.mark.sparse_mla_tolerance(profile="tight")
@pytest.mark.parametrize("case", case_params(_FP32_CASES))
def test_fp32_within_1e5_of_oracle(
    case, sparse_mla_tolerances, sparse_mla_generator, sparse_mla_device, record_property
):
    inputs = inputs_on(case, sparse_mla_generator, sparse_mla_device)
    res = inputs.run(sparse_mla_forward, return_fp32=True)
    expected = inputs.run(oracle_forward)
    out_err = (res.output_fp32.double() - expected.output).abs()
    finite = torch.isfinite(expected.lse)
    lse_rel = ((res.lse.double() - expected.lse).abs() / expected.lse.abs())[finite]
    record_property("max_abs_err_output_fp32", float(out_err.max()))
    record_property("max_rel_err_lse", float(lse_rel.max()))
    sparse_mla_tolerances.check_output(res.output_fp32, expected, what="fp32 output")
    sparse_mla_tolerances.check_lse(res.lse, expected)
    assert torch.equal(res.output, res.output_fp32.to(torch.bfloat16))


@pytest.mark.parametrize("which", ["indices", "extra_indices"])
def test_rejects_out_of_range_indices(which, sparse_mla_generator, sparse_mla_device):
    case = AttentionCase("oob", 4, 8, CacheCase(64, topk_length=32),
                         extra=CacheCase(64, page_block_size=2, num_pages=64, topk_length=32))  # fmt: skip
    inputs = inputs_on(case, sparse_mla_generator, sparse_mla_device)
    target = inputs.indices if which == "indices" else inputs.extra_indices
    limit = inputs.cache.num_tokens if which == "indices" else inputs.extra.num_tokens
    inputs.run(sparse_mla_forward)  # past the valid prefix, stale 1 << 30 entries are ignored
    target[2, 5] = limit
    with pytest.raises(ValueError, match=rf"{which}\[2, 5\]={limit} is out of range"):
        inputs.run(sparse_mla_forward)


@pytest.mark.sparse_mla_tolerance(profile="tight")
@pytest.mark.parametrize("chunk_tokens", [1, 7, 1000])
def test_chunking_over_tokens_keeps_results(
    chunk_tokens, sparse_mla_tolerances, sparse_mla_generator, sparse_mla_device
):
    case = AttentionCase("chunks", 20, 12, CacheCase(128), extra=CacheCase(64, page_block_size=2, num_pages=64))
    inputs = inputs_on(case, sparse_mla_generator, sparse_mla_device)
    res = inputs.run(sparse_mla_forward, chunk_tokens=chunk_tokens)
    expected = inputs.run(oracle_forward)
    sparse_mla_tolerances.check_result(res, expected)


def test_zero_tokens_returns_empty(sparse_mla_device):
    case = AttentionCase("t0", 0, 8, CacheCase(64))
    inputs = inputs_on(case, torch.Generator().manual_seed(0), sparse_mla_device)
    res = inputs.run(sparse_mla_forward)
    assert tuple(res.output.shape) == (0, 8, 512) and tuple(res.lse.shape) == (0, 8)
    assert res.route == "decode"


@pytest.mark.parametrize(
    ("num_tokens", "num_heads", "topk", "message"),
    [
        # 0.6.14-0.6.17: no NH=8 prefill kernel (C++ prefill orchestrator).
        (65, 8, 128, "Check failed: (ok) is false: Unsupported sparse-MLA prefill configuration: "
         "model=DSV4 num_heads=8 topk=128 page_block_size=64 topk_extra=0 extra_page_block_size=0"),
        # 0.6.14-0.6.17: decode has no topk 256; the miss falls into the prefill orchestrator.
        (1, 16, 256, "Decode (num_tokens <= 64) must go through sparse_mla_sm120_decode_dsv3_2 or "
         "sparse_mla_sm120_decode_dsv4; got num_tokens=1"),
    ],
)  # fmt: skip
def test_grid_release_raises_the_release_error(
    num_tokens, num_heads, topk, message, sparse_mla_generator, sparse_mla_device
):
    from pytest_sparse_mla.dispatch import SparseMlaGridError

    case = AttentionCase("grid", num_tokens, num_heads, CacheCase(topk, num_pages=4))
    inputs = inputs_on(case, sparse_mla_generator, sparse_mla_device)
    with pytest.raises(SparseMlaGridError) as excinfo:
        inputs.run(sparse_mla_forward, grid_release="0.6.17")
    assert message in str(excinfo.value)
    assert inputs.run(sparse_mla_forward).grid is None  # no release: no enforcement


def test_grid_release_supported_shape_records_the_verdict(sparse_mla_generator, sparse_mla_device):
    case = AttentionCase("grid-ok", 65, 16, CacheCase(128, num_pages=4),
                         extra=CacheCase(128, page_block_size=2, num_pages=64))  # fmt: skip
    inputs = inputs_on(case, sparse_mla_generator, sparse_mla_device)
    res = inputs.run(sparse_mla_forward, grid_release="flashinfer==0.6.17")
    plain = inputs.run(sparse_mla_forward)
    assert res.grid is not None and res.grid.supported
    assert res.route == "prefill"
    assert torch.equal(res.output, plain.output) and torch.equal(res.lse, plain.lse)


# --- backends: the Triton inner loop (CUDA; interpreted on the CPU) against the oracle ----------

_TRITON_CASES = (
    AttentionCase("dual-C128-len", 3, 20, CacheCase(100, topk_length=70),
                  extra=CacheCase(64, page_block_size=2, num_pages=64, masked_fraction=0.25)),
    AttentionCase("dsv32-h8-k64", 2, 8, CacheCase(64), conventions=Conventions("dsv3_2")),
    # DeepSeek-V4.1 records: candidates gathered by torch operations (_triton_forward.gather_records)
    AttentionCase("v41-dual-len", 3, 20, CacheCase(100, topk_length=70, masked_fraction=0.25),
                  extra=CacheCase(64, page_block_size=2, num_pages=64, masked_fraction=0.25),
                  conventions=Conventions("dsv4_1")),
    AttentionCase("v41-swa-only-hnd", 2, 8, CacheCase(64), conventions=Conventions("dsv4_1", form="hnd")),
    AttentionCase("v41-swa-both", 2, 8, CacheCase(64), extra=CacheCase(64, page_block_size=2, num_pages=64),
                  conventions=Conventions("dsv4_1_swa", with_sink=False)),
    AttentionCase("v41-indexed-both", 2, 8, CacheCase(64), extra=CacheCase(64, page_block_size=2, num_pages=64),
                  conventions=Conventions("dsv4_1_indexed")),
)  # fmt: skip


def _triton_or_skip(device: torch.device) -> None:
    from pytest_sparse_mla.attention.reference import triton_unavailable_reason

    reason = triton_unavailable_reason(device)
    if reason is not None:
        pytest.skip(f"backend='triton': {reason}")


@pytest.mark.sparse_mla_tolerance(profile="tight")
@pytest.mark.parametrize("case", case_params(_TRITON_CASES))
def test_triton_backend_within_1e5_of_oracle(case, sparse_mla_tolerances, sparse_mla_generator, sparse_mla_device):
    _triton_or_skip(sparse_mla_device)
    inputs = inputs_on(case, sparse_mla_generator, sparse_mla_device)
    res = inputs.run(sparse_mla_forward, backend="triton", return_fp32=True)
    expected = inputs.run(oracle_forward)
    sparse_mla_tolerances.check_output(res.output_fp32, expected, what="fp32 output")
    sparse_mla_tolerances.check_lse(res.lse, expected)
    assert torch.equal(res.output, res.output_fp32.to(torch.bfloat16))


@pytest.mark.sparse_mla_tolerance(profile="tight")
def test_triton_backend_dsv32_with_arbitrary_fp32_scales(
    sparse_mla_tolerances, sparse_mla_generator, sparse_mla_device
):
    """DSV3.2 scales are any fp32 (the packers write powers of two): with scales times ``1 + u``
    the dequantized values are no longer BF16 numbers, so the kernel runs on three BF16 pieces per
    value: scores scale each group's exact code products, ``P V`` splits ``p * scale`` in three BF16
    pieces (``_triton_forward._chunk_dsv32``); still within 1e-5 of the float64 oracle. Scale bytes
    by hand: DSV3.2 row ``t`` of a page holds its four little-endian fp32 scales at bytes
    ``[t*656 + 512, t*656 + 528)``."""
    _triton_or_skip(sparse_mla_device)
    case = AttentionCase("dsv32-any-scale", 2, 8, CacheCase(64), conventions=Conventions("dsv3_2"))
    inputs = inputs_on(case, sparse_mla_generator, sparse_mla_device)
    packed = inputs.cache.packed
    ps, pages, stride = inputs.cache.page_block_size, inputs.cache.layout.num_pages, packed.stride(0)
    raw = packed.as_strided((pages, stride), (stride, 1))
    scale_bytes = raw[:, : ps * 656].reshape(pages, ps, 656)[..., 512:528]
    scales = scale_bytes.contiguous().view(torch.float32)  # [pages, ps, 4]
    factor = 1 + torch.rand(scales.shape, generator=sparse_mla_generator).to(sparse_mla_device)
    scale_bytes.copy_((scales * factor).view(torch.uint8))
    table = formats.unpack_dequantize(packed, "dsv3_2", page_block_size=ps)
    assert not torch.equal(table.to(torch.bfloat16).float(), table)  # values that are not BF16 numbers
    res = inputs.run(sparse_mla_forward, backend="triton", return_fp32=True)
    expected = inputs.run(oracle_forward)
    sparse_mla_tolerances.check_output(res.output_fp32, expected, what="fp32 output")
    sparse_mla_tolerances.check_lse(res.lse, expected)


def test_triton_backend_takes_a_query_view_with_a_strided_last_dim(sparse_mla_generator, sparse_mla_device):
    """A ``q`` view whose last dim is not contiguous (legal for the torch backend) gives the same
    bits on the Triton backend as its contiguous copy."""
    _triton_or_skip(sparse_mla_device)
    inputs = inputs_on(AttentionCase("tri-view", 2, 8, CacheCase(64)), sparse_mla_generator, sparse_mla_device)
    view = inputs.q.permute(2, 0, 1).contiguous().permute(1, 2, 0)
    assert view.stride(2) != 1 and torch.equal(view, inputs.q)
    base = inputs.run(sparse_mla_forward, backend="triton")
    res = sparse_mla_forward(view, inputs.cache.packed, inputs.indices, **inputs.kwargs(), backend="triton")
    assert torch.equal(res.output, base.output) and torch.equal(res.lse, base.lse)


@pytest.mark.parametrize("fmt", ["dsv4", "dsv4_1"])
def test_triton_backend_padding_and_head_count_are_bitwise_neutral(fmt, sparse_mla_generator, sparse_mla_device):
    """-1 padding of both rows and 8 real heads inside a 24-head query: same bits (tiny shapes, so
    the interpreted kernel runs on the CPU too); DSV4 rows read by the gather kernel, V4.1 records
    gathered by torch operations (``_triton_forward.gather_records``)."""
    _triton_or_skip(sparse_mla_device)
    extra = CacheCase(64, page_block_size=2, num_pages=64)
    main = CacheCase(64, masked_fraction=0.25)
    case = AttentionCase("tri-inv", 2, 24, main, extra=extra, conventions=Conventions(fmt))
    inputs = inputs_on(case, sparse_mla_generator, sparse_mla_device)
    base = inputs.run(sparse_mla_forward, backend="triton")
    pad = torch.full((2, 64), -1, dtype=torch.int32, device=sparse_mla_device)
    padded = sparse_mla_forward(
        inputs.q, inputs.cache.packed, torch.cat([inputs.indices, pad], dim=1),
        **inputs.kwargs(extra_indices=torch.cat([inputs.extra_indices, pad], dim=1)), backend="triton",
    )  # fmt: skip
    assert torch.equal(padded.output, base.output) and torch.equal(padded.lse, base.lse)
    few = sparse_mla_forward(
        inputs.q[:, :8].contiguous(), inputs.cache.packed, inputs.indices,
        **inputs.kwargs(attn_sink=inputs.attn_sink[:8].contiguous()), backend="triton",
    )  # fmt: skip
    assert torch.equal(few.output, base.output[:, :8]) and torch.equal(few.lse, base.lse[:, :8])


@pytest.mark.parametrize("config", [(16, 4, 1, 64), None], ids=["chunk-64", "shipped"])
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_triton_split_and_unsplit_launches_give_the_same_bits(
    fmt, config, sparse_mla_generator, sparse_mla_device, monkeypatch
):
    """The kernel splits a call's chunks over programs when the unsplit launch would leave the GPU
    idle (decode) and folds the chunk states in one combine launch; the unsplit launch folds the
    same chunk states in registers. Both give the same bits, at a chunk of 64 lanes (five chunks,
    one past ``topk_length``, two of the extra row) and at the shipped configuration: a token's
    result does not depend on the batch size that picks the launch. (The fold is one explicit
    ``fma`` in both kernels, so the compiler cannot contract it one way in one kernel and another
    way in the other.)"""
    from pytest_sparse_mla.attention.reference import triton_forward_module

    _triton_or_skip(sparse_mla_device)
    if config is None and sparse_mla_device.type != "cuda":
        pytest.skip("the shipped configuration's compiled code: CUDA only (the interpreter runs it in NumPy)")
    module = triton_forward_module()
    case = AttentionCase("tri-split", 3, 20, CacheCase(192, masked_fraction=0.25, topk_length=70),
                         extra=CacheCase(128, page_block_size=2, num_pages=64),
                         conventions=Conventions(fmt))  # fmt: skip
    inputs = inputs_on(case, sparse_mla_generator, sparse_mla_device)
    launch = module.sparse_mla
    results = []
    for split in (False, True):
        monkeypatch.setattr(module, "sparse_mla", lambda *a, split=split, **k: launch(*a, **k, split=split,
                                                                                        config=config))
        results.append(inputs.run(sparse_mla_forward, backend="triton", return_fp32=True))
    unsplit, split = results
    assert torch.equal(split.output_fp32, unsplit.output_fp32) and torch.equal(split.lse, unsplit.lse)
    assert torch.equal(split.output, unsplit.output) and torch.equal(split.out_of_range, unsplit.out_of_range)
    expected = inputs.run(oracle_forward)
    assert (split.output_fp32.double() - expected.output.to(split.output_fp32.device)).abs().max() < 1e-5


def test_backend_argument(sparse_mla_generator, sparse_mla_device):
    from pytest_sparse_mla.attention.reference import resolve_backend, triton_unavailable_reason

    case = AttentionCase("backend", 2, 8, CacheCase(64, num_pages=2))
    inputs = inputs_on(case, sparse_mla_generator, sparse_mla_device)
    with pytest.raises(ValueError, match=r"backend='cuda': expected None or one of \('torch', 'triton'\)"):
        inputs.run(sparse_mla_forward, backend="cuda")
    expected = "torch"
    if sparse_mla_device.type == "cuda" and triton_unavailable_reason(sparse_mla_device) is None:
        expected = "triton"
    assert resolve_backend(None, sparse_mla_device) == expected
    default = inputs.run(sparse_mla_forward)
    chosen = inputs.run(sparse_mla_forward, backend=expected)
    assert torch.equal(default.output, chosen.output) and torch.equal(default.lse, chosen.lse)
