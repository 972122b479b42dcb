"""The DeepSeek-V4.1 cache records (``formats.DSV4_1_SWA``, ``formats.DSV4_1_INDEXED``).

Byte identity with FlashInfer's independent reference encoder, for each record kind, on every
BF16 value packing accepts (as a scale group's largest magnitude and below larger ones) and on
65,536 random rows (where the flashinfer-python 0.7.2.post1 wheel is installed: the README's test command installs it),
the geometry, and the errors for bad records. The hand-computed bytes of a few rows (the frozen
goldens CI judges without any wheel) are in the pack suite, ``suites/test_formats.py``, where they
judge every implementation's ``pack``.

Sources: flashinfer-python 0.7.2.post1 ``flashinfer/experimental/b12x/attention/_shared/mla/
compressed_reference.py`` (``pack_deepseek_v41_cache_reference``: SWA = 512 E4M3 + 16 UE8M0, one
per 32 values, 528 bytes; indexed = 512 E2M1 two per byte + 32 E4M3 scales, one per 16, 288 bytes);
OCP Microscaling Formats (MX) v1.0 for E2M1 (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; sign bit 3) and
E4M3 (bias 7; subnormals m * 2**-9).
"""

from __future__ import annotations

import pytest
import torch

from pytest_sparse_mla import formats

# ------------------------------------------------------------------------------------- geometry


def test_record_geometry() -> None:
    swa, indexed = formats.DSV4_1_SWA, formats.DSV4_1_INDEXED
    assert (swa.bytes_per_token, swa.code_bytes_per_token, swa.scale_bytes_per_token, swa.num_scales) == (
        528, 512, 16, 16
    )
    assert (indexed.bytes_per_token, indexed.code_bytes_per_token, indexed.scale_bytes_per_token) == (
        288, 256, 32
    )
    assert swa.d_qk == indexed.d_qk == 512 and swa.bf16_exact and indexed.bf16_exact
    for f in (swa, indexed):  # FlashInfer's pages are page_size * record bytes, without padding
        tight = formats.page_stride_bytes(f, 64, "tight")
        assert formats.page_stride_bytes(f, 64, "padded") == tight == 64 * f.bytes_per_token
    assert formats.cache_formats("dsv4_1") == (swa, indexed)
    assert formats.get_format("dsv4_1") is swa and formats.call_format_name("dsv4_1") == "dsv4_1"


# -------------------------------------------------------------------- FlashInfer's reference encoder

def _random_rows(n: int, generator: torch.Generator) -> torch.Tensor:
    """Normal values with a random power-of-two scale per 16 values (2**-30 .. 2**29), 2% zeros
    and 2% negative zeros, in BF16 (one uniform draw places both kinds of zero)."""
    x = torch.randn(n, 32, 16, generator=generator)
    x *= torch.exp2(torch.randint(-30, 30, (n, 32, 1), generator=generator, dtype=torch.float32))
    x = x.view(n, 512)
    u = torch.rand(n, 512, generator=generator)
    x.masked_fill_(u < 0.02, 0.0)
    x.masked_fill_((u >= 0.02) & (u < 0.04), -0.0)
    return x.to(torch.bfloat16)


def _packable_bf16_values() -> torch.Tensor:
    """Every BF16 value packing accepts, by bit pattern: the finite ones below
    ``formats.NOPE_OVERFLOW`` (``248 * 2**120``, where an E4M3 code under the largest UE8M0 scale
    would dequantize to inf) in magnitude; both zeros and the subnormals included."""
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return every[every.float().abs() < formats.NOPE_OVERFLOW]


#: Factors ``2**k`` between a block's largest magnitude and the 31 values under it, ``k = 1..20``:
#: past ``2**18`` an E4M3 code under a UE8M0 scale (``amax / 448`` rounded up to a power of two;
#: subnormals down to ``2**-9``) is zero, past ``2**5`` so is an E2M1 code under its E4M3 scale
#: (``amax / 6``).
ABOVE = range(1, 21)


def _every_value_rows(generator: torch.Generator) -> torch.Tensor:
    """BF16 rows ``[n, 512]`` (``n`` a multiple of 64, zero-padded) in 32-value blocks, aligned to
    both records' scale groups (32 values per UE8M0 scale, 16 per E4M3 scale):

    * every packable BF16 value (:func:`_packable_bf16_values`) as the largest magnitude of its
      block (lane 0; the other 31 lanes are it times uniform factors in ``(-1, 1)``), so every
      scale a record computes from a BF16 group maximum is computed;
    * every packable BF16 value as one of 31 lanes (sorted by magnitude) under a lane-0 maximum
      ``2**k`` times their largest magnitude, for each ``k`` in :data:`ABOVE` where that is
      packable: every value is coded at every scale offset that leaves it a non-zero code, and
      past it.
    """
    f32 = _packable_bf16_values().float()
    others = f32.unsqueeze(1) * (torch.rand(len(f32), 31, generator=generator) * 2 - 1)
    blocks = [torch.cat([f32.unsqueeze(1), others], 1)]
    by_magnitude = f32[f32.abs().argsort(stable=True)]
    lanes = torch.cat([by_magnitude, by_magnitude.new_zeros((-len(by_magnitude)) % 31)]).view(-1, 31)
    top = lanes.abs().amax(dim=1, keepdim=True)
    for k in ABOVE:
        head = top * 2.0**k
        keep = (head < formats.NOPE_OVERFLOW).squeeze(1)
        blocks.append(torch.cat([head[keep], lanes[keep]], 1))
    flat = torch.cat(blocks).to(torch.bfloat16).reshape(-1)
    flat = torch.cat([flat, flat.new_zeros((-flat.numel()) % (64 * 512))])
    return flat.view(-1, 512)


def _compare(rows: torch.Tensor, what: str) -> None:
    """``rows`` ``[n, 512]`` BF16 (``n`` a multiple of 64) packed as SWA and as indexed records by
    FlashInfer's reference encoder and by ``formats.quantize_pack``: the same bytes; FlashInfer's
    decoder and ``formats.unpack_dequantize`` read the same values."""
    from pytest_sparse_mla.implementations.flashinfer_reference import flashinfer_source, references

    if flashinfer_source() is None:
        pytest.skip("flashinfer-python is not installed (pip install --no-deps flashinfer-python==0.7.2.post1)")
    reference, _ = references()
    page = 64
    for kind in ("swa", "indexed"):
        fmt = f"dsv4_1_{kind}"
        theirs = reference.pack_deepseek_v41_cache_reference(rows, page_size=page, cache_kind=kind)
        ours = formats.quantize_pack(rows.reshape(-1, page, 512), fmt, form="2d")
        if not torch.equal(theirs, ours):
            mismatch = (theirs != ours).nonzero()
            pytest.fail(f"{kind}, {what}: first differing byte at [page, byte] = {mismatch[0].tolist()}")
        decoded = reference.unpack_deepseek_v41_cache_reference(theirs, page_size=page, cache_kind=kind)
        assert torch.equal(formats.unpack_dequantize(ours, fmt).reshape(-1, 512), decoded), f"{kind}, {what}"


def test_every_bf16_value_packs_and_unpacks_byte_for_byte_as_flashinfers_reference() -> None:
    """Every packable BF16 value as a scale group's largest magnitude and under larger ones
    (:func:`_every_value_rows`), packed as both records: FlashInfer's bytes and values."""
    rows = _every_value_rows(torch.Generator().manual_seed(41))
    _compare(rows, f"every-value rows ({rows.shape[0]} rows)")


def test_random_rows_pack_and_unpack_byte_for_byte_as_flashinfers_reference() -> None:
    """65,536 random rows (:func:`_random_rows`; the first 64 hold exact E2M1 midpoints,
    saturation and signed zeros in every group), packed as both records: FlashInfer's bytes and values."""
    generator = torch.Generator().manual_seed(41)
    chunk = 1 << 14
    for start in range(0, 1 << 16, chunk):
        rows = _random_rows(chunk, generator)
        if start == 0:
            ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -6.0, 5.5, -0.0, 0.4, 2.9, 1.0]
            rows[:64] = torch.tensor(ties * 32, dtype=torch.bfloat16)
        _compare(rows, f"random rows {start}+")


# ----------------------------------------------------------------------------------- bad records


@pytest.mark.parametrize("fmt", ["dsv4_1_swa", "dsv4_1_indexed"])
def test_a_cache_of_the_wrong_record_width_is_refused(fmt: str) -> None:
    other = "dsv4_1_indexed" if fmt == "dsv4_1_swa" else "dsv4_1_swa"
    packed = formats.quantize_pack(torch.ones(1, 4, 512, dtype=torch.bfloat16), other, form="3d")
    width = formats.get_format(fmt).bytes_per_token
    with pytest.raises(ValueError, match=rf"kv_cache.shape\[-1\]=\d+: expected {width} bytes"):
        formats.unpack_dequantize(packed, fmt)


@pytest.mark.parametrize(
    "fmt, offset, byte",
    [("dsv4_1_swa", 512 + 3, 0xFF), ("dsv4_1_indexed", 256 + 5, 0x7F), ("dsv4_1_indexed", 256, 0xFF)],
    ids=["swa-ue8m0-0xff", "indexed-e4m3-nan", "indexed-e4m3-negative-nan"],
)
def test_a_non_finite_scale_is_a_clear_error(fmt: str, offset: int, byte: int) -> None:
    packed = formats.quantize_pack(torch.ones(2, 4, 512, dtype=torch.bfloat16), fmt, form="2d")
    formats.check_scales(packed, fmt)  # a packed cache is clean
    record = formats.get_format(fmt).bytes_per_token
    packed[1, 2 * record + offset] = byte
    group = offset - formats.get_format(fmt).code_bytes_per_token
    with pytest.raises(ValueError, match=rf"page 1, slot 2, scale group {group} holds byte\(s\) \['{hex(byte)}'\]"):
        formats.check_scales(packed, fmt)


def test_the_indexed_record_takes_no_power_of_two_scale_rule() -> None:
    with pytest.raises(ValueError, match="scale_rule='flashmla' with fmt='dsv4_1_indexed'"):
        formats.quantize_pack(torch.ones(1, 1, 512, dtype=torch.bfloat16), "dsv4_1_indexed", scale_rule="flashmla")
