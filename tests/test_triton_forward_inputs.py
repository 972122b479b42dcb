"""Self-tests of the Triton attention kernel's building blocks (``attention._triton_forward``).

* :func:`cache_geometry`: the byte offsets the kernel reads, written out by hand from the layouts
  in ``formats`` (DSV4 footer: slot ``t`` of a page owns data ``[t*576, t*576+576)`` and scales at
  ``ps*576 + t*8``; DSV3.2 inline: row ``t`` at ``t*token_stride``, scales at +512, RoPE at +528).
* The in-kernel E4M3 decode (all 256 code bytes; the hardware conversion on CUDA, integer
  operations in the interpreter) times every UE8M0 scale byte the packers write (3 to 254),
  against torch's ``float8_e4m3fn`` conversion and ``ldexp``: the kernel's dequantization
  must equal ``formats.unpack_dequantize`` exactly.
* The attention kernel's loaders (``gather_rows``): packed bytes to the values of
  ``formats.unpack_dequantize``, and nothing read for invalid lanes.
* The in-kernel fp32 -> BF16 rounding against torch's ``.to(torch.bfloat16)`` (round to nearest
  even) on ties, NaN, infinities, the largest finite values and random bits: the reference
  promises ``output == output_fp32.to(torch.bfloat16)`` bit for bit.

The kernels here run compiled on CUDA and interpreted on the CPU (small shapes).
"""

from __future__ import annotations

import pytest
import torch

from pytest_sparse_mla import data, formats
from pytest_sparse_mla.attention.reference import triton_forward_module, triton_unavailable_reason

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if triton_unavailable_reason(DEVICE) is not None:  # pragma: no cover - triton missing
    pytest.skip(f"triton: {triton_unavailable_reason(DEVICE)}", allow_module_level=True)

tf = triton_forward_module()
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def _decode_kernel(code_ptr, scale_ptr, out_ptr, n, HW: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    code = tl.load(code_ptr + i, mask=i < n, other=0)
    sb = tl.load(scale_ptr + i, mask=i < n, other=127).to(tl.int32)
    scale = (sb << 23).to(tl.float32, bitcast=True)
    tl.store(out_ptr + i, tf._e4m3_to_f32(code, HW) * scale, mask=i < n)


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tf._round_bf16_bits(tl.load(x_ptr + i, mask=i < n, other=0.0)), mask=i < n)


@pytest.mark.parametrize(
    ("fmt", "ps", "stride", "form", "expected"),
    [
        # DSV4, 64-token pages, padded stride ceil(64*584/576)*576 = 37,440.
        ("dsv4", 64, "padded", "nhd", (64 * 64, 64, 37_440, 576, 448, 64 * 576, 8)),
        # DSV4 C128 pool: 2-token pages, tight stride 2*584.
        ("dsv4", 2, "tight", "3d", (64 * 2, 2, 1_168, 576, 448, 2 * 576, 8)),
        # DSV3.2: inline rows of 656 bytes, padded stride (ps+1)*656.
        ("dsv3_2", 64, "padded", "hnd", (64 * 64, 64, 65 * 656, 656, 528, 512, 656)),
    ],
)
def test_cache_geometry_by_hand(fmt, ps, stride, form, expected) -> None:
    cache = data.make_packed_cache(torch.Generator().manual_seed(0), fmt=fmt, num_pages=64, page_block_size=ps,
                                   page_stride=stride, form=form)  # fmt: skip
    g = tf.cache_geometry(formats.parse_cache(cache.packed, fmt))
    got = (g.num_tokens, g.page_block_size, g.page_stride, g.row_stride, g.rope_offset, g.scale_base, g.scale_stride)
    assert got == expected


@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")  # 448 * 2**127 = inf
def test_e4m3_decode_times_ue8m0_scale_is_exact() -> None:
    """The decode the attention kernel uses here: the hardware conversion on CUDA, integer operations
    in the CPU interpreter."""
    hw = not tf.INTERPRETED
    codes = torch.arange(256, dtype=torch.int32).repeat_interleave(252).to(torch.uint8)
    scales = torch.arange(3, 255, dtype=torch.int32).repeat(256).to(torch.uint8)
    expected = codes.view(torch.float8_e4m3fn).float() * torch.ldexp(torch.ones(codes.numel()), scales.int() - 127)
    out = torch.empty(codes.numel(), dtype=torch.float32, device=DEVICE)
    n = codes.numel()
    _decode_kernel[(triton.cdiv(n, 1024),)](codes.to(DEVICE), scales.to(DEVICE), out, n, HW=hw, BLOCK=1024)
    got = out.cpu()
    nan = torch.isnan(expected)
    assert bool(torch.equal(torch.isnan(got), nan)) and int(nan.sum()) == 2 * 252  # 0x7F and 0xFF
    assert torch.equal(got[~nan], expected[~nan])
    assert torch.equal(torch.signbit(got[~nan]), torch.signbit(expected[~nan]))  # -0.0 from 0x80


def test_bf16_rounding_matches_torch() -> None:
    g = torch.Generator().manual_seed(5)
    random_bits = torch.randint(-(2**31), 2**31 - 1, (4096,), generator=g, dtype=torch.int32).view(torch.float32)
    edges = torch.tensor(
        [0.0, -0.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20, -(1.0 + 2**-8), float("inf"),
         float("-inf"), float("nan"), 3.4028234663852886e38, 3.3895313892515355e38, 1e-40, -1e-45],
        dtype=torch.float32,
    )  # fmt: skip
    x = torch.cat([edges, random_bits])
    out = torch.empty(x.numel(), dtype=torch.int16, device=DEVICE)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x.to(DEVICE), out, x.numel(), BLOCK=1024)
    expected = x.to(torch.bfloat16)
    got = out.cpu().view(torch.bfloat16)
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int16), expected[~nan].view(torch.int16))


@pytest.mark.parametrize("fmt", ["dsv4", "dsv3_2"])
def test_kernel_loaders_equal_unpack_dequantize(fmt) -> None:
    """The attention kernel's own loaders (``gather_rows``) on two caches of different page sizes,
    strides and forms: every token exactly ``formats.unpack_dequantize`` (DSV3.2 with arbitrary
    fp32 scales: ``code * scale`` rounded once in fp32, as the packer's spec), and a zero row for a
    ``-1`` lane and for an index past the cache."""
    g = torch.Generator().manual_seed(9)
    main = data.make_packed_cache(g, fmt=fmt, num_pages=3, page_block_size=64, page_stride="padded", device=DEVICE)
    extra = data.make_packed_cache(g, fmt=fmt, num_pages=40, page_block_size=2, page_stride="tight", form="3d",
                                   device=DEVICE)  # fmt: skip
    if fmt == "dsv3_2":  # scales times (1 + u): the dequantized values are not BF16 numbers
        packed = main.packed
        rows = packed.as_strided((3, 64, 656), (packed.stride(0), 656, 1), packed.storage_offset())
        scales = rows[..., 512:528].contiguous().view(torch.float32)
        factor = 1 + torch.rand(scales.shape, generator=g).to(DEVICE)
        rows[..., 512:528] = (scales * factor).view(torch.uint8)  # DSV3.2 row: scales at bytes 512-527
    f = formats.get_format(fmt)
    for cache, n in ((main, 3 * 64), (extra, 40 * 2)):
        expected = formats.unpack_dequantize(cache.packed, f).reshape(-1, f.d_qk).cpu()
        rows = torch.cat([torch.arange(n), torch.tensor([-1, n, n + 7])]).to(torch.int32)
        got = tf.gather_rows(cache.packed, tf.cache_geometry(formats.parse_cache(cache.packed, f)), rows.to(DEVICE),
                             fmt == "dsv4").cpu()  # fmt: skip
        assert got.shape == (n + 3, f.d_qk)
        assert torch.equal(got[:n], expected)
        assert torch.equal(got[n:], torch.zeros(3, f.d_qk))
        if fmt == "dsv3_2" and cache is main:
            assert not torch.equal(expected.to(torch.bfloat16).float(), expected)  # not BF16 numbers
