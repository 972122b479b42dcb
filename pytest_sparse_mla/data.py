"""Deterministic test data: latent rows, queries, sinks and packed caches.

Everything is drawn on the CPU from an explicit ``torch.Generator`` and then moved to the target
device, so a seed gives bit-identical inputs on CPU and CUDA (goldens depend on it).

Distributions (``distribution=``):

* ``"flashinfer"``: ``(randn / 10).clamp(-1, 1)``, the distribution of every DSV4 test in
  flashinfer-ai/flashinfer ``tests/attention/test_sparse_mla_sm120.py`` (queries and latent rows).
* ``"uniform"``: uniform on ``[-1, 1)``.
* ``"wide"``: ``flashinfer`` values times a per-(token, 64-wide group) power of two drawn from
  ``2**-24 .. 2**8``, so group maxima cross the ``1e-4`` scale floor (UE8M0 byte 114) and span
  many exponents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pytest_sparse_mla import formats

__all__ = [
    "DISTRIBUTIONS",
    "PackedKVCache",
    "latent",
    "make_packed_cache",
    "attn_sink",
    "sparse_indices",
    "topk_lengths",
    "pack_to_device",
]

DISTRIBUTIONS: tuple[str, ...] = ("flashinfer", "uniform", "wide")


def latent(
    shape: tuple[int, ...],
    generator: torch.Generator,
    *,
    distribution: str = "flashinfer",
    device: torch.device | str = "cpu",
    group_size: int = 64,
) -> torch.Tensor:
    """Draw a BF16 tensor of ``shape`` (last dim a multiple of ``group_size`` for ``"wide"``).

    Args:
        shape: e.g. ``(num_pages, page_block_size, 512)`` or ``(num_tokens, num_heads, 512)``.
        generator: a CPU ``torch.Generator``; the draw is reproducible from its state.
        distribution: one of :data:`DISTRIBUTIONS`.
        device: where the result goes (values are drawn on the CPU first).
        group_size: width of the groups that share a magnitude under ``"wide"``.

    Raises:
        ValueError: unknown distribution, or a ``"wide"`` last dim not divisible by ``group_size``.
    """
    if distribution == "flashinfer":
        x = (torch.randn(shape, generator=generator) / 10).clamp(-1, 1)
    elif distribution == "uniform":
        x = torch.rand(shape, generator=generator) * 2 - 1
    elif distribution == "wide":
        if shape[-1] % group_size:
            raise ValueError(f"shape[-1]={shape[-1]}: expected a multiple of {group_size} for 'wide'")
        x = (torch.randn(shape, generator=generator) / 10).clamp(-1, 1)
        groups = (*shape[:-1], shape[-1] // group_size, 1)
        exps = torch.randint(-24, 9, groups, generator=generator).to(torch.float32)
        x = (x.reshape(*shape[:-1], shape[-1] // group_size, group_size) * torch.exp2(exps))
        x = x.reshape(shape)
    else:
        raise ValueError(f"distribution={distribution!r}: expected one of {DISTRIBUTIONS}")
    return x.to(torch.bfloat16).to(device)


def attn_sink(num_heads: int, generator: torch.Generator, *, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[num_heads]`` fp32 sink logits (natural-log units): ``randn(H) * 2`` as FlashInfer's tests draw."""
    return (torch.randn(num_heads, generator=generator) * 2).to(torch.float32).to(device)


@dataclass(frozen=True)
class PackedKVCache:
    """A packed cache with the values it was built from.

    Attributes:
        fmt: the packed format (``formats.DSV4`` or ``formats.DSV3_2``).
        packed: the packed uint8 tensor in the requested form (a view over a page buffer).
        source: ``[num_pages, page_block_size, d_qk]`` BF16 rows that were quantized.
        dequantized: ``[num_pages, page_block_size, d_qk]`` fp32 values the cache holds (exact).
        layout: the parsed :class:`formats.CacheLayout` of ``packed``.
    """

    fmt: formats.PackedFormat
    packed: torch.Tensor
    source: torch.Tensor
    dequantized: torch.Tensor
    layout: formats.CacheLayout

    @property
    def page_block_size(self) -> int:
        """Tokens per page."""
        return self.layout.page_block_size

    @property
    def num_tokens(self) -> int:
        """``num_pages * page_block_size``: valid flat indices are ``0 .. num_tokens-1``."""
        return self.layout.num_tokens

    def flat_dequantized(self) -> torch.Tensor:
        """``[num_pages * page_block_size, d_qk]`` fp32 rows indexed by flat token index."""
        return self.dequantized.reshape(self.num_tokens, self.fmt.d_qk)


def make_packed_cache(
    generator: torch.Generator,
    *,
    fmt: formats.PackedFormat | str = formats.DSV4,
    num_pages: int = 4,
    page_block_size: int = 64,
    page_stride: formats.StrideSpec = "padded",
    form: str = "nhd",
    distribution: str = "flashinfer",
    scale_rule: formats.ScaleRule | None = None,
    device: torch.device | str = "cpu",
) -> PackedKVCache:
    """Draw latent rows and pack them (see :func:`formats.quantize_pack` for the arguments).

    The dequantized values are computed on the CPU by :func:`formats.unpack_dequantize` and moved
    to ``device``.

    Raises:
        TypeError, ValueError: as :func:`latent` and :func:`formats.quantize_pack`.
    """
    f = formats.record_format(fmt)
    if num_pages < 1:
        raise ValueError(f"num_pages={num_pages}: expected at least one page")
    source = latent((num_pages, page_block_size, f.d_qk), generator, distribution=distribution)
    packed_cpu = formats.quantize_pack(
        source, f, page_stride=page_stride, form=form, scale_rule=scale_rule
    )
    dequantized = formats.unpack_dequantize(packed_cpu, f, page_block_size=page_block_size)
    packed = packed_cpu
    if torch.device(device).type != "cpu":
        # Move the whole page buffer so the page stride (and padding) survive the copy.
        base = packed_cpu.as_strided(
            (num_pages, packed_cpu.stride(0)), (packed_cpu.stride(0), 1), packed_cpu.storage_offset()
        )
        packed = formats.as_form(base.to(device), f, page_block_size, form)
    layout = formats.parse_cache(packed, f, page_block_size=page_block_size)
    return PackedKVCache(f, packed, source.to(device), dequantized.to(device), layout)


def sparse_indices(
    num_tokens: int,
    topk: int,
    num_candidates: int,
    generator: torch.Generator,
    *,
    masked_fraction: float = 0.5,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``[num_tokens, topk]`` int32 flat token indices, drawn as FlashInfer's DSV4 tests draw them.

    Lanes ``[0, int(topk * (1 - masked_fraction)))`` are uniform in ``[0, num_candidates)``
    (duplicates possible); the remaining tail lanes are ``-1`` (flashinfer-ai/flashinfer
    ``tests/attention/test_sparse_mla_sm120.py``: ``randint(0, s_kv)`` then
    ``indices[:, topk // 2:] = -1``, i.e. ``masked_fraction=0.5``).

    Raises:
        ValueError: ``topk < 1``, ``num_candidates < 1`` or ``masked_fraction`` outside ``[0, 1]``.
    """
    if topk < 1 or num_candidates < 1:
        raise ValueError(f"topk={topk}, num_candidates={num_candidates}: expected positive ints")
    if not 0.0 <= masked_fraction <= 1.0:
        raise ValueError(f"masked_fraction={masked_fraction}: expected a fraction in [0, 1]")
    idx = torch.randint(0, num_candidates, (num_tokens, topk), generator=generator, dtype=torch.int64)
    idx[:, int(topk * (1.0 - masked_fraction)) :] = -1
    return idx.to(torch.int32).to(device)


def topk_lengths(
    num_tokens: int,
    topk: int,
    generator: torch.Generator,
    *,
    low: int = 0,
    high: int | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``[num_tokens]`` int32 valid-prefix lengths, uniform in ``[low, high]`` (default ``[0, topk]``).

    Values outside ``[0, topk]`` are legal input (the kernels clamp them), so ``low`` may be
    negative and ``high`` may exceed ``topk``.

    Raises:
        ValueError: ``high < low``.
    """
    high = topk if high is None else high
    if high < low:
        raise ValueError(f"low={low}, high={high}: expected low <= high")
    lengths = torch.randint(low, high + 1, (num_tokens,), generator=generator, dtype=torch.int64)
    return lengths.to(torch.int32).to(device)


def pack_to_device(
    source: torch.Tensor,
    fmt: formats.PackedFormat | str = formats.DSV4,
    *,
    page_stride: formats.StrideSpec = "padded",
    form: str = "nhd",
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``formats.quantize_pack`` of a BF16 ``[P, ps, d_qk]`` source, on ``device``.

    Packs on the CPU and moves the whole ``[P, page_stride]`` page buffer, so the page stride (and
    its padding) survives the copy (a plain ``.to(device)`` of a padded view would compact it).

    Raises:
        TypeError, ValueError: as :func:`formats.quantize_pack`.
    """
    f = formats.get_format(fmt)
    packed = formats.quantize_pack(source.cpu(), f, page_stride=page_stride, form=form)
    stride = packed.stride(0)
    base = packed.as_strided((int(source.shape[0]), stride), (stride, 1), packed.storage_offset())
    return formats.as_form(base.to(device), f, int(source.shape[1]), form)
