"""Self-tests of the bundled format helpers (``pytest_sparse_mla.formats``): page strides, cache
parsing, the unpacker, scale exponents and the packer's input checks.

What any implementation's ``pack`` must write (bytes by hand, round-trip bounds) is the
conformance suite ``suites/test_formats.py``; these tests call the bundled code directly. Expected
values are written by hand here (layout: flashinfer-ai/flashinfer
``include/flashinfer/attention/sparse_mla_sm120/model/kv_cache_traits.cuh``, FlashMLA README), never
read back from the code under test.
"""

from __future__ import annotations

import pytest
import torch

from pytest_sparse_mla import data, formats


def _raw_pages(packed: torch.Tensor) -> torch.Tensor:
    """The full page buffer ``[P, stride(0)]`` behind ``packed`` (test-side, no package code)."""
    stride = packed.stride(0)
    return torch.as_strided(packed, (packed.shape[0], stride), (stride, 1), packed.storage_offset())


@pytest.mark.parametrize("ps, expected", [(2, 1728), (64, 37440), (128, 74880), (256, 149760)])
def test_dsv4_padded_page_stride_matches_flashmla_and_sglang(ps: int, expected: int) -> None:
    """``ceil(ps*584/576)*576``: the published strides (FlashMLA tests/quant.py MODEL1 branch)."""
    assert formats.page_stride_bytes("dsv4", ps, "padded") == expected
    assert formats.page_stride_bytes("dsv4", ps, "tight") == ps * 584


def test_dsv3_2_padded_page_stride_adds_one_row() -> None:
    assert formats.page_stride_bytes("dsv3_2", 64, "padded") == 65 * 656
    assert formats.page_stride_bytes("dsv3_2", 64, "tight") == 64 * 656


def test_flat_token_index_is_page_times_page_size_plus_slot() -> None:
    assert formats.flat_token_index(3, 5, 64) == 197
    assert formats.flat_token_index(0, 255, 256) == 255
    with pytest.raises(ValueError, match="slot=64"):
        formats.flat_token_index(1, 64, 64)


def test_unpack_never_reads_the_pad_byte_or_the_page_padding(sparse_mla_generator: torch.Generator) -> None:
    """0xFF written by hand into each token's pad byte (``64*576 + t*8 + 7``) and the page padding
    ``[37376, 37440)`` changes no unpacked value."""
    src = data.latent((2, 64, 512), sparse_mla_generator, distribution="wide")
    clean = formats.quantize_pack(src, "dsv4", page_stride="padded")
    dirty = formats.quantize_pack(src, "dsv4", page_stride="padded")
    raw = _raw_pages(dirty)
    raw[:, 64 * 576 + 7 : 64 * 584 : 8] = 0xFF
    raw[:, 37_376:] = 0xFF
    assert not torch.equal(_raw_pages(clean), raw)
    assert torch.equal(formats.unpack_dequantize(clean), formats.unpack_dequantize(dirty))


# --- bad input: every error names the argument, the value and what was expected -------------------


def _buffer(num_pages: int = 2, stride: int = 37440) -> torch.Tensor:
    return torch.zeros(num_pages, stride, dtype=torch.uint8)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: _buffer().view(torch.int8), TypeError, r"kv_cache\.dtype=torch\.int8: expected torch\.uint8"),
        (lambda: torch.zeros(2, 64, 1, 584, dtype=torch.bfloat16), TypeError, "expected torch.uint8"),
        (lambda: torch.zeros(37376, dtype=torch.uint8), ValueError, r"kv_cache\.ndim=1"),
        (lambda: torch.zeros(2, 1, 64, 1, 584, dtype=torch.uint8), ValueError, r"kv_cache\.ndim=5"),
        (lambda: torch.zeros(2, 64, 576, dtype=torch.uint8), ValueError, r"shape\[-1\]=576: expected 584"),
        (lambda: torch.zeros(2, 37440, dtype=torch.uint8), ValueError, r"shape\[1\]=37440"),
        (
            lambda: torch.as_strided(_buffer(2, 64 * 592), (2, 64, 584), (64 * 592, 592, 1)),
            ValueError,
            r"stride\(1\)=592: footer-scale dsv4 rows must stay tightly packed",
        ),
        (
            lambda: torch.as_strided(_buffer(2, 37392), (2, 64, 584), (37384, 584, 1)),
            ValueError,
            r"stride\(0\)=37384: the page stride must be a multiple of 16",
        ),
        (
            lambda: torch.as_strided(_buffer(2, 37440), (2, 64, 584), (37360, 584, 1)),
            ValueError,
            r"stride\(0\)=37360: the page stride must be >= page_block_size\*584 = 37376",
        ),
        (
            lambda: torch.as_strided(_buffer(3), (2, 64, 584), (37440, 584, 1), 1),
            ValueError,
            "must be 16-byte aligned",
        ),
        (lambda: torch.zeros(2, 8, 8, 584, dtype=torch.uint8), ValueError, "singleton KV-head axis"),
        (
            lambda: torch.as_strided(_buffer(2, 2 * 64 * 584), (2, 64, 584), (64 * 584, 584, 2)),
            ValueError,
            r"stride\(-1\)=2: the last dim must be contiguous",
        ),
    ],
    ids=[
        "int8-cache", "bf16-cache", "1-d", "5-d", "last-dim-576", "2d-width-37440",
        "token-stride-592", "page-stride-not-16", "page-stride-too-small", "misaligned-pointer",
        "4d-no-singleton-head", "last-dim-not-contiguous",
    ],
)
def test_bad_cache_is_rejected_with_a_clear_error(make, error, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=match):
        formats.parse_cache(make(), "dsv4")


def test_page_block_size_disagreeing_with_shape_is_rejected() -> None:
    with pytest.raises(ValueError, match="page_block_size=128 disagrees"):
        formats.parse_cache(torch.zeros(2, 64, 584, dtype=torch.uint8), "dsv4", page_block_size=128)


@pytest.mark.parametrize("ps", [0, -64])
def test_non_positive_page_size_is_rejected(ps: int) -> None:
    with pytest.raises(ValueError, match=f"page_block_size={ps}: expected a positive"):
        formats.page_stride_bytes("dsv4", ps, "padded")


@pytest.mark.parametrize("stride", [37376 + 8, 37360])
def test_bad_explicit_stride_is_rejected(stride: int) -> None:
    with pytest.raises(ValueError, match=f"page_stride={stride}: expected a multiple of 16"):
        formats.page_stride_bytes("dsv4", 64, stride)


def test_non_bf16_source_is_rejected() -> None:
    with pytest.raises(TypeError, match=r"source\.dtype=torch\.float32: expected torch\.bfloat16"):
        formats.quantize_pack(torch.zeros(1, 64, 512), "dsv4")


def test_wrong_source_width_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"expected \[num_pages, page_block_size, 576\] for dsv3_2"):
        formats.quantize_pack(torch.zeros(1, 64, 512, dtype=torch.bfloat16), "dsv3_2")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_source_is_rejected(bad: float) -> None:
    src = torch.zeros(2, 64, 512, dtype=torch.bfloat16)
    src[1, 5, 7] = bad
    with pytest.raises(ValueError, match=r"1 non-finite value\(s\) \(first at \[page, slot, dim\] = \[1, 5, 7\]\)"):
        formats.quantize_pack(src, "dsv4")


def test_unknown_form_and_rule_are_rejected() -> None:
    src = torch.zeros(1, 64, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="form='row'"):
        formats.quantize_pack(src, "dsv4", form="row")
    with pytest.raises(ValueError, match="scale_rule='ocp'"):
        formats.quantize_pack(src, "dsv4", scale_rule="ocp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fmt='dsv5'"):
        formats.quantize_pack(src, "dsv5")


def test_scale_is_the_smallest_power_of_two_covering_amax_over_448() -> None:
    """Property: ``2**(e-1) < max(amax/448, 1e-4) <= 2**e`` for every finite fp32 amax (hypothesis)."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(derandomize=True, deadline=None, max_examples=100)
    @hypothesis.given(st.floats(min_value=0.0, max_value=3.0000000054977558e38, allow_nan=False, width=32))
    def check(amax: float) -> None:
        a = torch.tensor([amax], dtype=torch.float32)
        x = max((a / 448).item(), torch.tensor(1e-4, dtype=torch.float32).item())
        e = int(formats.scale_exponents(a, "flashmla").item())
        assert 2.0 ** (e - 1) < x <= 2.0**e

    check()


@pytest.mark.parametrize("ps", [1, 65])
def test_tight_stride_of_an_odd_page_size_is_rejected_up_front(ps: int) -> None:
    """ps*584 is a multiple of 16 only for even ps (584 = 8 * 73); FlashInfer needs 16-byte strides."""
    expected = f"page_block_size={ps}: {ps}\\*584 = {ps * 584} bytes is not a multiple of 16"
    with pytest.raises(ValueError, match=expected):
        formats.quantize_pack(torch.zeros(1, ps, 512, dtype=torch.bfloat16), "dsv4")
    padded = formats.quantize_pack(torch.zeros(1, ps, 512, dtype=torch.bfloat16), "dsv4", page_stride="padded")
    assert padded.stride(0) == -(-ps * 584 // 576) * 576


def test_unpack_dtype_must_be_floating() -> None:
    packed = formats.quantize_pack(torch.zeros(1, 64, 512, dtype=torch.bfloat16), "dsv4")
    with pytest.raises(TypeError, match=r"dtype=torch\.int32: expected a floating torch\.dtype"):
        formats.unpack_dequantize(packed, dtype=torch.int32)


@pytest.mark.parametrize("amax", [-1.0, float("nan"), float("inf")])
def test_scale_exponents_reject_impossible_group_maxima(amax: float) -> None:
    with pytest.raises(ValueError, match="amax: expected finite, non-negative"):
        formats.scale_exponents(torch.tensor([amax]))


def test_pad_fill_must_be_a_byte() -> None:
    with pytest.raises(ValueError, match=r"fill=1\.5: expected a byte value"):
        formats.quantize_pack(torch.zeros(1, 64, 512, dtype=torch.bfloat16), "dsv4", pad_fill=1.5)  # type: ignore[arg-type]


def test_dsv4_values_are_bf16_numbers_and_dsv3_2_need_not_be(sparse_mla_generator: torch.Generator) -> None:
    """``PackedFormat.bf16_exact`` (what the Triton attention relies on): every DSV4 value is an
    E4M3 code (4 significant bits) times a power of two, or a BF16 RoPE value, so rounding it to
    BF16 changes nothing, for every finite E4M3 code under every scale byte from 3 (2**-124) to
    254 (bytes written by hand here, not by the packer); a DSV3.2 fp32 scale of 0.1 breaks it."""
    assert formats.DSV4.bf16_exact and not formats.DSV3_2.bf16_exact
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[~torch.isnan(codes.view(torch.float8_e4m3fn).float())]  # 254 finite codes
    pages, ps = 63, 4  # 252 tokens: scale bytes 3..254, one per token
    source = torch.zeros(pages, ps, 512, dtype=torch.bfloat16)
    source[..., 448:] = torch.randn(pages, ps, 64, generator=sparse_mla_generator)
    packed = formats.quantize_pack(source, "dsv4")
    raw = packed.view(pages, -1)
    raw[:, : ps * 576].reshape(pages, ps, 576)[..., :448] = codes[torch.arange(448) % codes.numel()]
    footer = raw[:, ps * 576 : ps * 584].reshape(pages, ps, 8)
    footer[..., :7] = torch.arange(3, 255, dtype=torch.int32).to(torch.uint8).view(pages, ps, 1)
    values = formats.unpack_dequantize(packed, "dsv4")
    nope = values[..., :448].abs()
    assert float(nope[nope > 0].min()) == 2.0**-133  # code 0x01 (2**-9) under byte 3
    assert bool(torch.isinf(nope).any())  # 448 * 2**127 overflows fp32 (and BF16) to inf
    assert torch.equal(values.to(torch.bfloat16).float(), values)
    packed32 = formats.quantize_pack(torch.zeros(1, 2, 576, dtype=torch.bfloat16), "dsv3_2")
    rows32 = packed32.view(1, 2, 656)
    rows32[..., :512] = 0x38  # E4M3 1.0
    rows32[..., 512:528] = torch.tensor([0.1] * 4, dtype=torch.float32).view(torch.uint8)
    values32 = formats.unpack_dequantize(packed32, "dsv3_2")
    assert not torch.equal(values32.to(torch.bfloat16).float(), values32)


@pytest.mark.parametrize("fmt", ["dsv4", "dsv3_2"])
@pytest.mark.parametrize("rule", ["flashmla", "sglang"])
def test_nope_values_that_would_dequantize_to_inf_are_rejected(fmt: str, rule: str) -> None:
    """By hand: for amax in [240 * 2**120, 448 * 2**120) both rules pick the scale 2**120; x / 2**120
    = 248 is the E4M3 tie between 240 and 256 and rounds to even (256), and 256 * 2**120 = 2**128 is
    inf in fp32. BF16 0x7F78 is 248 * 2**120 (refused); 0x7F77 is 247 * 2**120 (packs, rounds to 240)."""
    f = formats.FORMATS[fmt]
    assert formats.NOPE_OVERFLOW == float(torch.tensor(0x7F78, dtype=torch.int16).view(torch.bfloat16))
    source = torch.zeros(1, 2, f.d_qk, dtype=torch.bfloat16)
    source.view(torch.int16)[0, 1, 5] = 0x7F78
    with pytest.raises(ValueError, match=r"1 NoPE value\(s\) with \|x\| >= 248 \* 2\*\*120 .*\[0, 1, 5\]"):
        formats.quantize_pack(source, fmt, scale_rule=rule)
    source.view(torch.int16)[0, 1, 5] = 0x7F77
    values = formats.unpack_dequantize(formats.quantize_pack(source, fmt, scale_rule=rule), fmt)
    assert float(values[0, 1, 5]) == 240.0 * 2.0**120
    source.view(torch.int16)[0, 1, 5] = 0
    source.view(torch.int16)[0, 1, f.d_nope] = 0x7F78  # a RoPE value is stored as BF16: fine
    values = formats.unpack_dequantize(formats.quantize_pack(source, fmt, scale_rule=rule), fmt)
    assert float(values[0, 1, f.d_nope]) == 248.0 * 2.0**120
