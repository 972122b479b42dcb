"""Conformance of an implementation's ``pack``: the packed FP8 KV-cache bytes (DSV4 584 B/token with a
scale footer, DSV3.2 656 B/token inline).

Every test calls the selected implementation's ``pack(source, fmt, *, page_stride, form, scale_rule,
pad_fill)`` (protocol: ``pytest_sparse_mla.implementations``) and is skipped when it has none.
Expected byte offsets and byte values are computed by hand in this file from the layout in
flashinfer-ai/flashinfer ``include/flashinfer/attention/sparse_mla_sm120/model/kv_cache_traits.cuh``
(DSV4 comment block) and the FlashMLA README (DSV3.2), never read back from a packer; value checks
decode with ``formats.unpack_dequantize`` (itself checked on hand-written bytes in
``tests/test_formats_bytes.py``) and bound the error in float64 from the source.

Scale rules (UE8M0 byte = exponent + 127): FlashMLA ``2**ceil(log2(max(amax / 448, 1e-4)))``
(deepseek-ai/FlashMLA ``tests/quant.py``); SGLang ``2**ceil(log2(max(amax, 1e-8) / 448))``
(sgl-project/sglang ``python/sglang/kernels/ops/attention/dsv4/quant_k_cache.py``).
DeepSeek-V4 geometry: page sizes 256 (SWA pool), 64 (C4), 2 (C128) and 128 (extra caches of
DeepSeek-V4.1 pools).
"""

from __future__ import annotations

import struct

import pytest
import torch

from pytest_sparse_mla import data, formats

pytestmark = pytest.mark.sparse_mla_needs("pack")

DSV4_PAGE_SIZES = [2, 64, 128, 256]

# E4M3 (float8_e4m3fn) bit patterns, by hand: sign | 4 exponent bits (bias 7) | 3 mantissa bits.
E4M3_BITS = {
    448.0: 0b0_1111_110,  # 1.75 * 2**8
    1.0: 0b0_0111_000,
    -2.0: 0b1_1000_000,
    0.5: 0b0_0110_000,
    0.0: 0b0_0000_000,
    -0.375: 0b1_0101_100,  # -1.5 * 2**-2
    2**-9: 0b0_0000_001,  # smallest subnormal
}
# BF16 bit patterns of RoPE values, by hand.
BF16_BITS = {1.0: 0x3F80, -2.5: 0xC020, 0.15625: 0x3E20, 0.0: 0x0000}


def _raw_pages(packed: torch.Tensor) -> torch.Tensor:
    """The full page buffer ``[P, stride(0)]`` behind ``packed``, on the CPU (test-side, no package code)."""
    stride = packed.stride(0)
    return torch.as_strided(packed, (packed.shape[0], stride), (stride, 1), packed.storage_offset()).cpu()


def _padded_stride(ps: int, row_bytes: int = 584) -> int:
    """FlashMLA/SGLang's padded DSV4 page stride, by hand: ``ceil(ps*584/576)*576``."""
    return -(-ps * row_bytes // 576) * 576


def _known_source(num_pages: int, ps: int) -> tuple[torch.Tensor, list[int]]:
    """DSV4 rows whose group g of token (p, t) is ``pattern * 2**k`` with amax exactly ``448 * 2**k``.

    Returns the BF16 source and, per token, the list of exponents k for the 7 groups.
    """
    pattern = torch.tensor(list(E4M3_BITS)).repeat(10)[:64]  # 448 first: amax of every group
    src = torch.zeros(num_pages, ps, 512)
    exps = []
    for p in range(num_pages):
        for t in range(ps):
            token_exps = [((p * 7 + t * 3 + g) % 11) - 5 for g in range(7)]  # -5 .. 5
            for g, k in enumerate(token_exps):
                src[p, t, 64 * g : 64 * g + 64] = pattern * 2.0**k
            src[p, t, 448:] = torch.tensor(list(BF16_BITS)).repeat(16)
            exps.append(token_exps)
    return src.to(torch.bfloat16), exps


@pytest.mark.parametrize("stride", ["tight", "padded"])
@pytest.mark.parametrize("ps", DSV4_PAGE_SIZES)
def test_dsv4_known_vector_lands_on_hand_computed_bytes(ps, stride, sparse_mla_impl, sparse_mla_device) -> None:
    """Data, RoPE and scale bytes of every token sit where the footer layout puts them; the page
    stride is ``ps*584`` (tight) or ``ceil(ps*584/576)*576`` (padded: 1,728 / 37,440 / 74,880 /
    149,760 bytes at 2 / 64 / 128 / 256 tokens, FlashMLA ``tests/quant.py`` MODEL1 branch)."""
    num_pages = 3 if ps <= 64 else 2
    src, exps = _known_source(num_pages, ps)
    packed = sparse_mla_impl.pack(src.to(sparse_mla_device), "dsv4", page_stride=stride, form="nhd")
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (num_pages, ps, 1, 584)
    page_stride = ps * 584 if stride == "tight" else _padded_stride(ps)
    assert packed.stride(0) == page_stride
    flat = _raw_pages(packed).reshape(-1)
    code_bits = torch.tensor(list(E4M3_BITS.values()), dtype=torch.uint8).repeat(10)[:64]
    rope_bytes = torch.tensor([b for v in BF16_BITS.values() for b in (v & 0xFF, v >> 8)], dtype=torch.uint8).repeat(16)
    slots = [(p, t) for p in range(num_pages) for t in range(ps)]
    for (p, t), token_exps in zip(slots, exps, strict=True):
        data_at = p * page_stride + t * 576
        scale_at = p * page_stride + ps * 576 + t * 8
        where = f"page {p}, slot {t}"
        for g in range(7):
            got = flat[data_at + 64 * g : data_at + 64 * g + 64]
            assert torch.equal(got, code_bits), (
                f"{where}, NoPE group {g}: E4M3 codes at bytes {data_at + 64 * g}.. differ from the hand-computed "
                f"ones (first got {got[:4].tolist()}, expected {code_bits[:4].tolist()})"
            )
        got_rope = flat[data_at + 448 : data_at + 576]
        assert torch.equal(got_rope, rope_bytes), (
            f"{where}: BF16 RoPE bytes at {data_at + 448}.. differ (first got {got_rope[:4].tolist()}, "
            f"expected {rope_bytes[:4].tolist()}; little-endian BF16 bits)"
        )
        expected_scales = [127 + k for k in token_exps]
        got_scales = flat[scale_at : scale_at + 7].tolist()
        off = {g - e for g, e in zip(got_scales, expected_scales, strict=True)}
        hint = f"; every byte off by {off.pop():+d}: the UE8M0 bias (127) wrong?" if len(off) == 1 else ""
        assert got_scales == expected_scales, (
            f"{where}: UE8M0 scale bytes at {scale_at}..{scale_at + 6} are {got_scales}, expected "
            f"{expected_scales} (byte = exponent + 127, footer after the page's {ps} x 576 data bytes){hint}"
        )
        assert flat[scale_at + 7].item() == 0, f"{where}: the scale record's pad byte {scale_at + 7} must be 0"


@pytest.mark.parametrize("ps", [1, 65])
def test_padded_stride_of_an_odd_page_size(ps, sparse_mla_impl, sparse_mla_device) -> None:
    """``ps*584`` is not a multiple of 16 for odd ``ps`` (584 = 8 * 73); the padded stride is."""
    packed = sparse_mla_impl.pack(
        torch.zeros(1, ps, 512, dtype=torch.bfloat16, device=sparse_mla_device), "dsv4", page_stride="padded"
    )
    assert packed.stride(0) == _padded_stride(ps) == {1: 1152, 65: 38016}[ps]


def _one_group_row(amax: float, device: torch.device) -> torch.Tensor:
    """One DSV4 token (a ``[1, 1, 512]`` BF16 page) whose first 64-value group has maximum ``amax``."""
    row = torch.zeros(1, 1, 512)
    row[0, 0, 0] = amax
    row[0, 0, 1:64] = amax / 4
    return row.to(torch.bfloat16).to(device)


# (amax, rule, UE8M0 byte of group 0) by hand; amax values are exact in BF16 (1e-6 rounds to a
# BF16 number near 1e-6, which does not move the byte).
#   flashmla: max(amax/448, 1e-4); 1e-4 lies in (2**-14, 2**-13], so the floor byte is 127-13 = 114.
#   sglang:   max(amax, 1e-8)/448; 2**-7/448 = 2**-7/(1.75*2**8) lies in (2**-16, 2**-15] -> 112;
#             0.0 -> 1e-8/448 ~ 2.2e-11 in (2**-36, 2**-35] -> 92; 1e-6/448 in (2**-29, 2**-28] -> 99.
KNOWN_SCALE_BYTES = [
    (0.0, "flashmla", 114),
    (2.0**-7, "flashmla", 114),  # under the floor: 2**-7/448 ~ 1.7e-5 < 1e-4
    (1e-6, "flashmla", 114),
    (448.0 * 2.0**-13, "flashmla", 114),  # exactly the floor's power of two
    (1.0, "flashmla", 127 - 8),  # 1/448 in (2**-9, 2**-8]
    (448.0, "flashmla", 127),  # scale exactly 1
    (448.0 * 8, "flashmla", 130),  # exactly a power of two times 448
    (448.0 * 8 * (1 - 2**-8), "flashmla", 130),  # just below -> 2**3
    (448.0 * 8 * (1 + 2**-7), "flashmla", 131),  # just above 2**3 * 448 -> 2**4
    (0.0, "sglang", 92),
    (1e-6, "sglang", 99),
    (2.0**-7, "sglang", 112),
    (1.0, "sglang", 127 - 8),
    (448.0, "sglang", 127),
]


@pytest.mark.parametrize(("amax", "rule", "byte"), KNOWN_SCALE_BYTES, ids=lambda v: f"{v}")
def test_pack_writes_the_scale_byte_of_the_requested_rule(amax, rule, byte, sparse_mla_impl, sparse_mla_device):
    packed = sparse_mla_impl.pack(
        _one_group_row(amax, sparse_mla_device), "dsv4", scale_rule=rule, form="2d", page_stride="padded"
    )
    # DSV4 footer: a 1-token page holds 576 data bytes, then that token's 8 scale bytes.
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (1, 584), (packed.dtype, tuple(packed.shape))
    got = int(packed.reshape(-1)[576])
    assert got == byte, (
        f"amax={amax!r}, scale_rule={rule!r}: UE8M0 byte {got} (scale 2**{got - 127}), expected {byte} "
        f"(scale 2**{byte - 127}); byte 114 is FlashMLA's 1e-4 floor, SGLang's rule has no floor"
    )


def test_pack_scale_byte_is_the_smallest_power_of_two_covering_amax_over_448(sparse_mla_impl, sparse_mla_device):
    """Property over BF16 group maxima from 0 to 240 * 2**120 (hypothesis): the FlashMLA byte
    ``e + 127`` satisfies ``2**(e-1) < max(amax/448, 1e-4) <= 2**e``, evaluated in float64 (the
    quotient of a BF16 value by 448 never lies within fp32 rounding of a power of two unless it
    is one)."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    top = 240.0 * 2.0**120  # the largest E4M3 code times the largest scale that stays finite

    @hypothesis.settings(max_examples=60)
    @hypothesis.example(amax=0.0)
    @hypothesis.example(amax=448.0 * 2.0**-13)
    @hypothesis.example(amax=top)
    @hypothesis.given(st.floats(min_value=0.0, max_value=top, allow_nan=False, width=32))
    def check(amax: float) -> None:
        amax = float(torch.tensor(amax).to(torch.bfloat16))  # a BF16 number
        packed = sparse_mla_impl.pack(
            _one_group_row(amax, sparse_mla_device), "dsv4", scale_rule="flashmla", form="2d", page_stride="padded"
        )
        e = int(packed.reshape(-1)[576]) - 127
        x = max(amax / 448.0, 1e-4)
        assert 2.0 ** (e - 1) < x <= 2.0**e, f"amax={amax!r}: byte {e + 127}"

    check()


def _e4m3_half_step_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest error bound of E4M3 at ``x`` with group scale ``scale`` (both fp64).

    Normal E4M3 numbers have 3 mantissa bits, so the spacing in the binade of ``|x/s|`` is
    ``2**(floor(log2|x/s|) - 3)`` and half of it is at most ``|x/s| * 2**-4``; subnormals are spaced
    ``2**-9`` apart (half: ``2**-10``).
    """
    return torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)


@pytest.mark.parametrize("distribution", data.DISTRIBUTIONS)
@pytest.mark.parametrize("ps", DSV4_PAGE_SIZES)
def test_dsv4_round_trip_error_within_one_half_e4m3_step(
    ps, distribution, sparse_mla_impl, sparse_mla_generator, sparse_mla_device
) -> None:
    num_pages = 4 if ps <= 64 else 2
    src = data.latent((num_pages, ps, 512), sparse_mla_generator, distribution=distribution)
    packed = sparse_mla_impl.pack(src.to(sparse_mla_device), "dsv4", page_stride="padded")
    out = formats.unpack_dequantize(packed, "dsv4", page_block_size=ps).cpu().double()
    x = src.double()
    groups = x[..., :448].reshape(num_pages, ps, 7, 64)
    amax = groups.abs().amax(-1, keepdim=True)
    # The scale rule, evaluated independently in float64: smallest power of two >= max(amax/448, 1e-4).
    scale = torch.exp2(torch.ceil(torch.log2(torch.clamp(amax / 448, min=1e-4))))
    err = (out[..., :448].reshape(num_pages, ps, 7, 64) - groups).abs()
    bound = _e4m3_half_step_bound(groups, scale)
    over = err > bound
    if bool(over.any()):
        p, t, g, i = (int(v) for v in over.nonzero()[0])
        raise AssertionError(
            f"{int(over.sum())} NoPE values round-trip outside half an E4M3 step of their group's scale; first at "
            f"page {p}, slot {t}, group {g}, element {i}: source {float(groups[p, t, g, i]):.6g}, read back "
            f"{float(out[p, t, 64 * g + i]):.6g}, |error| {float(err[p, t, g, i]):.3g} > "
            f"{float(bound[p, t, g, i]):.3g} (scale {float(scale[p, t, g, 0]):.3g})"
        )
    assert torch.equal(out[..., 448:], x[..., 448:]), "RoPE must be stored exactly (BF16 bits)"


@pytest.mark.parametrize("stride", ["tight", "padded", 37376 + 64 * 16])
def test_all_tensor_forms_hold_the_same_bytes_and_values(
    stride, sparse_mla_impl, sparse_mla_generator, sparse_mla_device
) -> None:
    src = data.latent((3, 64, 512), sparse_mla_generator).to(sparse_mla_device)
    page_stride = {"tight": 64 * 584, "padded": 37_440}.get(stride, stride)
    forms = {form: sparse_mla_impl.pack(src, "dsv4", page_stride=stride, form=form) for form in formats.FORMS}
    expected_shapes = {
        "2d": (3, 64 * 584),
        "3d": (3, 64, 584),
        "hnd": (3, 1, 64, 584),
        "nhd": (3, 64, 1, 584),
    }
    # Expected bytes and values from the specified packer (itself pinned to hand-computed bytes in
    # tests/test_formats_bytes.py), never from the implementation's own other forms.
    want = formats.quantize_pack(src.cpu(), "dsv4", page_stride=stride, form="3d")
    want_raw = _raw_pages(want)[:, : 64 * 584]
    want_values = formats.unpack_dequantize(want, "dsv4")
    for form, packed in forms.items():
        assert tuple(packed.shape) == expected_shapes[form], form
        assert packed.stride(0) == page_stride, form
        raw = _raw_pages(packed)[:, : 64 * 584].cpu()
        assert torch.equal(raw, want_raw), f"form {form!r}: packed bytes differ from the specified packer's"
        values = formats.unpack_dequantize(packed, "dsv4", page_block_size=64).cpu()
        assert torch.equal(values, want_values), f"form {form!r}: dequantized values differ"


def test_pad_fill_goes_to_the_pad_bytes_and_the_page_padding_only(
    sparse_mla_impl, sparse_mla_generator, sparse_mla_device
) -> None:
    """``pad_fill`` is written into each token's 8th footer byte (bytes ``64*576 + t*8 + 7``) and
    into the page padding ``[37376, 37440)``; every other byte is the same as with ``pad_fill=0``."""
    src = data.latent((2, 64, 512), sparse_mla_generator, distribution="wide").to(sparse_mla_device)
    clean = _raw_pages(sparse_mla_impl.pack(src, "dsv4", page_stride="padded", pad_fill=0))
    dirty = _raw_pages(sparse_mla_impl.pack(src, "dsv4", page_stride="padded", pad_fill=0xFF))
    pad = torch.zeros(37_440, dtype=torch.bool)
    pad[64 * 576 + 7 : 64 * 584 : 8] = True
    pad[37_376:] = True
    assert int(pad.sum()) == 64 + 64
    assert bool((dirty[:, pad] == 0xFF).all()) and bool((clean[:, pad] == 0).all())
    assert torch.equal(dirty[:, ~pad], clean[:, ~pad])


@pytest.mark.parametrize("stride", ["tight", "padded"])
def test_dsv3_2_inline_bytes_and_round_trip(stride, sparse_mla_impl, sparse_mla_generator, sparse_mla_device) -> None:
    ps = 64
    src = torch.zeros(2, ps, 576)
    src[..., :512] = torch.tensor(list(E4M3_BITS)).repeat(80)[:512]  # amax 448 per 128-group
    src[1, 3, 128:256] *= 2.0**-6
    src[..., 512:] = torch.tensor(list(BF16_BITS)).repeat(16)
    packed = sparse_mla_impl.pack(src.to(torch.bfloat16).to(sparse_mla_device), "dsv3_2", page_stride=stride, form="3d")
    row_stride = 656
    page_stride = ps * 656 if stride == "tight" else (ps + 1) * 656
    assert packed.stride() == (page_stride, row_stride, 1)
    flat = _raw_pages(packed).reshape(-1)
    at = 1 * page_stride + 3 * row_stride  # page 1, slot 3
    scales = struct.unpack("<4f", bytes(flat[at + 512 : at + 528].tolist()))
    assert scales == (1.0, 2.0**-6, 1.0, 1.0)
    assert flat[at].item() == E4M3_BITS[448.0]
    rope = struct.unpack("<64H", bytes(flat[at + 528 : at + 656].tolist()))
    assert list(rope[:4]) == list(BF16_BITS.values())
    values = formats.unpack_dequantize(packed, "dsv3_2").cpu()
    assert torch.equal(values, src.to(torch.bfloat16).float())
    # random data round trip, bound as for DSV4 with 128-wide groups
    rnd = data.latent((2, ps, 576), sparse_mla_generator)
    packed = sparse_mla_impl.pack(rnd.to(sparse_mla_device), "dsv3_2", page_stride=stride)
    out = formats.unpack_dequantize(packed, "dsv3_2").cpu()
    groups = rnd.double()[..., :512].reshape(2, ps, 4, 128)
    scale = torch.exp2(torch.ceil(torch.log2(torch.clamp(groups.abs().amax(-1, keepdim=True) / 448, min=1e-4))))
    err = (out.double()[..., :512].reshape(2, ps, 4, 128) - groups).abs()
    assert bool((err <= _e4m3_half_step_bound(groups, scale)).all())


@pytest.mark.parametrize("fmt", ["dsv4", "dsv3_2"])
@pytest.mark.parametrize("rule", ["flashmla", "sglang"])
def test_largest_nope_values_and_rope_values_survive(fmt, rule, sparse_mla_impl, sparse_mla_device) -> None:
    """By hand: for amax in [240 * 2**120, 448 * 2**120) both rules pick the scale 2**120. BF16
    0x7F77 is 247 * 2**120: 247 rounds to the E4M3 code 240, so it reads back as 240 * 2**120 (not
    inf). A RoPE value is stored as BF16, so 0x7F78 = 248 * 2**120 reads back exactly."""
    f = formats.get_format(fmt)
    source = torch.zeros(1, 2, f.d_qk, dtype=torch.bfloat16)
    source.view(torch.int16)[0, 1, 5] = 0x7F77
    source.view(torch.int16)[0, 1, f.d_nope] = 0x7F78
    packed = sparse_mla_impl.pack(source.to(sparse_mla_device), fmt, scale_rule=rule)
    values = formats.unpack_dequantize(packed, fmt).cpu()
    assert float(values[0, 1, 5]) == 240.0 * 2.0**120
    assert float(values[0, 1, f.d_nope]) == 248.0 * 2.0**120


@pytest.mark.parametrize("rule", ["flashmla", "sglang", None], ids=["flashmla", "sglang", "writer-rule"])
@pytest.mark.parametrize(
    ("fmt", "page_block_size", "stride", "form"),
    [("dsv4", 64, "padded", "nhd"), ("dsv4", 2, "tight", "3d"), ("dsv3_2", 64, "padded", "nhd"),
     ("dsv4_1_swa", 64, "tight", "nhd"), ("dsv4_1_indexed", 64, "tight", "2d")],
    ids=["dsv4-ps64-padded-nhd", "dsv4-ps2-tight-3d", "dsv3_2-ps64-padded-nhd", "dsv4_1_swa-ps64-tight-nhd",
         "dsv4_1_indexed-ps64-tight-2d"],
)  # fmt: skip
def test_pack_is_byte_identical_to_the_specified_packer(
    fmt, page_block_size, stride, form, rule, sparse_mla_impl, sparse_mla_generator, sparse_mla_device
):
    """Whole caches on distributions whose group maxima cross the ``1e-4`` floor ("wide": 2**-24
    to 2**8) equal ``formats.quantize_pack``, the packer the hand-computed bytes above specify
    (the round-trip bound allows either neighbour on an E4M3 tie; this pins round-to-nearest-even).
    ``None``: the format's own writer rule (the only one the V4.1 indexed record has)."""
    f = formats.get_format(fmt)
    if f.code == "e2m1" and rule is not None:
        pytest.skip(f"not applicable: {fmt} has one scale rule (its E4M3 scales), asked with scale_rule=None")
    source = data.latent((3, page_block_size, f.d_qk), sparse_mla_generator, distribution="wide")
    got = sparse_mla_impl.pack(source.to(sparse_mla_device), fmt, page_stride=stride, form=form, scale_rule=rule)
    want = formats.quantize_pack(source, fmt, page_stride=stride, form=form, scale_rule=rule)
    assert got.dtype == torch.uint8 and tuple(got.shape) == tuple(want.shape)
    assert got.stride() == want.stride(), "page stride / form differ"
    logical = page_block_size * f.bytes_per_token  # the page's bytes before its padding
    differ = (_raw_pages(got)[:, :logical] != _raw_pages(want)[:, :logical]).nonzero()
    assert differ.numel() == 0, f"{differ.shape[0]} bytes differ, first at [page, byte] {differ[0].tolist()}"


# --- DeepSeek-V4.1 records: hand-computed bytes ------------------------------------------------------


def _swa_row() -> tuple[torch.Tensor, list[int]]:
    """One SWA token: group g (32 values) = [448, 1, -2, 0.5, 0, ...] * 2**(g - 8), the last group
    all zeros. Scale: 2**ceil(log2(max(amax, 1e-4) / 448)) = 2**(g - 8), UE8M0 byte 119 + g; the
    zero group: max(0, 1e-4) / 448 = 2.23e-7 lies in (2**-23, 2**-22], byte 127 - 22 = 105. Codes:
    448 -> 0x7E, 1 -> 0x38, -2 -> 0xC0, 0.5 -> 0x30, 0 -> 0x00 (E4M3, bias 7)."""
    values, codes, scales = [], [], []
    for g in range(16):
        group = [0.0] * 32
        if g < 15:
            group[:4] = [448.0, 1.0, -2.0, 0.5]
            codes += [0x7E, 0x38, 0xC0, 0x30] + [0] * 28
            scales.append(119 + g)
        else:
            codes += [0] * 32
            scales.append(105)
        values += [v * 2.0 ** (g - 8) for v in group]
    return torch.tensor(values, dtype=torch.bfloat16), codes + scales


#: One indexed group of 16 in units of its scale: ties (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0) go to
#: the even code, -0.25 rounds to -0 (code 8: the sign is kept), 5.5 and 6 to 6, 0.4 (BF16
#: 0.40039) to 0.5, 2.9 (BF16 2.90625) to 3.
_GROUP = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -6.0, 5.5, -0.0, 0.4, 2.9, 1.0]
_CODES = [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 15, 7, 8, 1, 5, 2]


def _e4m3_byte_of_power_of_two(k: int) -> int:
    """E4M3 byte of 2**k: normal (k >= -6) exponent field k + 7, mantissa 0; subnormal 2**k =
    2**(k + 9) * 2**-9, mantissa 2**(k + 9)."""
    return (k + 7) << 3 if k >= -6 else 1 << (k + 9)


def _indexed_row() -> tuple[torch.Tensor, list[int]]:
    """One indexed token: group g = _GROUP * 2**k with k = (g % 16) - 8, so amax = 6 * 2**k and the
    scale is E4M3(6 * 2**k / 6) = 2**k exactly (subnormal for k < -6). Codes pair up low nibble
    first: (7, 0) -> 0x07, (2, 2) -> 0x22, ..."""
    values, packed, scales = [], [], []
    nibbles = [lo | hi << 4 for lo, hi in zip(_CODES[0::2], _CODES[1::2], strict=True)]
    for g in range(32):
        k = g % 16 - 8
        values += [v * 2.0**k for v in _GROUP]
        packed += nibbles
        scales.append(_e4m3_byte_of_power_of_two(k))
    return torch.tensor(values, dtype=torch.bfloat16), packed + scales


@pytest.mark.parametrize(
    "fmt, row", [("dsv4_1_swa", _swa_row), ("dsv4_1_indexed", _indexed_row)], ids=["swa", "indexed"]
)
def test_dsv4_1_known_rows_land_on_hand_computed_bytes(fmt, row, sparse_mla_impl, sparse_mla_device) -> None:
    """Records of flashinfer-python 0.7.2.post1 ``pack_deepseek_v41_cache_reference``: SWA 512 E4M3
    codes + 16 UE8M0 scales (one per 32, ``2**ceil(log2(max(amax, 1e-4) / 448))``); indexed 512 E2M1
    codes two per byte, low nibble first (round to nearest, ties to even, sign of zero kept) + 32 E4M3
    scales (one per 16, ``e4m3(min(max(amax, 6 * 2**-9) / 6, 448))``)."""
    values, expected = row()
    source = torch.stack([values, -values]).reshape(1, 2, 512)  # a second token: every sign flipped
    packed = sparse_mla_impl.pack(source.to(sparse_mla_device), fmt, form="2d").cpu()
    f = formats.get_format(fmt)
    got = packed[0, : f.bytes_per_token].tolist()
    assert got == expected
    assert packed.shape == (1, 2 * f.bytes_per_token)
    decoded = formats.unpack_dequantize(packed, fmt)[0]  # the decoder the attention suites trust
    if fmt == "dsv4_1_swa":
        torch.testing.assert_close(decoded[0], values.float(), rtol=0, atol=0)  # every value is an E4M3 code
    else:
        table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
        want = torch.tensor(
            [(-1.0 if c & 8 else 1.0) * table[c & 7] * 2.0 ** (g % 16 - 8) for g in range(32) for c in _CODES]
        )
        assert torch.equal(decoded[0], want)
    assert torch.equal(torch.signbit(decoded[1][values != 0]), ~torch.signbit(decoded[0][values != 0]))
