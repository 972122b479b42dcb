"""The DeepSeek-V4.1 cache records (``formats.DSV4_1_SWA``, ``formats.DSV4_1_INDEXED``).

Byte identity with FlashInfer's independent reference encoder on a million random rows of each kind
(where the flashinfer-python 0.7.2.post1 wheel is installed: the README's test command installs it),
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

MILLION = 1 << 20


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


#: The million rows come in parts of 2**18 (two xdist workers share them); each part draws its rows
#: from its own seed and packs them as both records, so each row is drawn once for both kinds.
PARTS = 4


@pytest.mark.sparse_mla_selftest_long(seconds=21)  # collected first (tests/conftest.py)
@pytest.mark.parametrize("part", range(PARTS), ids=[f"rows-{p}-of-{PARTS}" for p in range(PARTS)])
def test_a_million_rows_pack_and_unpack_byte_for_byte_as_flashinfers_reference(part: int) -> None:
    """Rows ``part * 2**18`` to ``(part + 1) * 2**18`` of the million (2**20) random rows, packed as
    SWA and as indexed records by FlashInfer's reference encoder and by ``formats.quantize_pack``:
    the same bytes; FlashInfer's decoder and ``formats.unpack_dequantize`` read the same values."""
    from pytest_sparse_mla.implementations.flashinfer_reference import flashinfer_source, references

    if flashinfer_source() is None:
        pytest.skip("flashinfer-python is not installed (pip install --no-deps flashinfer-python==0.7.2.post1)")
    reference, _ = references()
    generator = torch.Generator().manual_seed(41 + part)
    chunk, page, rows_per_part = 1 << 16, 64, MILLION // PARTS
    for start in range(part * rows_per_part, (part + 1) * rows_per_part, chunk):
        rows = _random_rows(chunk, generator)
        if start == 0:  # exact E2M1 midpoints, saturation and signed zeros in every group
            ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -6.0, 5.5, -0.0, 0.4, 2.9, 1.0]
            rows[:64] = torch.tensor(ties * 32, dtype=torch.bfloat16)
        for kind in ("swa", "indexed"):
            fmt = f"dsv4_1_{kind}"
            theirs = reference.pack_deepseek_v41_cache_reference(rows, page_size=page, cache_kind=kind)
            ours = formats.quantize_pack(rows.reshape(chunk // page, page, 512), fmt, form="2d")
            if not torch.equal(theirs, ours):
                mismatch = (theirs != ours).nonzero()
                pytest.fail(f"{kind}, rows {start}+: first differing byte at [page, byte] = {mismatch[0].tolist()}")
            decoded = reference.unpack_deepseek_v41_cache_reference(theirs, page_size=page, cache_kind=kind)
            assert torch.equal(formats.unpack_dequantize(ours, fmt).reshape(-1, 512), decoded), f"{kind}, rows {start}+"


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
