"""Named, deterministic sparse-MLA input cases for the attention suites.

Two families:

* :data:`FLASHINFER_CASES`: the configurations and data distribution of FlashInfer's SM120 tests
  (flashinfer-ai/flashinfer ``tests/attention/test_sparse_mla_sm120.py``; summarised in
  ``shared/reference/dsv4-format-and-math.md`` sections 3.1, 3.3 and 3.4): latent rows and queries
  ``(randn / 10).clamp(-1, 1)``, indices uniform over the cache with the second half ``-1``,
  ``sink = randn(H) * 2``, ``sm_scale = 512 ** -0.5``, page size 64; decode, prefill, runtime
  head counts and topk, ``topk_length`` truncation with stale padding, dual caches (extra page 64
  and 2), DSV3.2.
* :func:`deployment_cases`: every DeepSeek-V4 deployment of :mod:`pytest_sparse_mla.deployments`
  (V4-Flash 64 heads, V4-Pro 128 heads, per rank at TP 1/2/4/8; SWA topk 128; C4 extra 512 at page
  64; C128 extra 512 at page 2; DSpark topk 192 with 133 active entries), one decode-sized case
  each, plus prefill-sized cases (``large=True``: run on CUDA only), including the 4096-token
  V4-Flash C4 prefill.

Cases are plain frozen data; :func:`make_inputs` draws the tensors from a CPU generator and moves
them to the device, so a seed gives the same inputs on CPU and CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch

from pytest_sparse_mla import data, deployments, formats

__all__ = [
    "AttentionCase",
    "AttentionInputs",
    "FLASHINFER_CASES",
    "STALE_INDEX",
    "case_params",
    "deployment_cases",
    "inputs_on",
    "make_inputs",
]

#: What lanes past ``topk_length`` hold in the truncation cases: FlashInfer's stale padding
#: (``1 << 30``, far out of range; ``..._bounds_stale_padding`` in the FlashInfer tests).
STALE_INDEX = 1 << 30


@dataclass(frozen=True)
class AttentionCase:
    """One sparse-MLA call shape and how to fill it.

    Attributes:
        name: stable id used as the pytest parameter id.
        num_tokens, num_heads, topk: ``T``, ``H`` and the main index width.
        page_block_size, num_pages: main cache geometry (tokens per page, pages).
        topk_extra, extra_page_block_size, extra_num_pages: the extra cache (0 = none).
        with_sink: draw an ``attn_sink``.
        masked_fraction, extra_masked_fraction: trailing fraction of each index row set to ``-1``.
        topk_length, extra_topk_length: one valid length for every token (``None`` = no length
            tensor); lanes past it are overwritten with :data:`STALE_INDEX`.
        fmt, page_stride, form, distribution: cache format and layout (see ``formats``, ``data``).
        large: too big for CPU in a suite; run only on CUDA.
    """

    name: str
    num_tokens: int
    num_heads: int
    topk: int
    page_block_size: int = 64
    num_pages: int = 16
    topk_extra: int = 0
    extra_page_block_size: int = 0
    extra_num_pages: int = 0
    with_sink: bool = True
    masked_fraction: float = 0.5
    extra_masked_fraction: float = 0.5
    topk_length: int | None = None
    extra_topk_length: int | None = None
    fmt: str = "dsv4"
    page_stride: formats.StrideSpec = "padded"
    form: str = "nhd"
    distribution: str = "flashinfer"
    large: bool = False

    @property
    def dual(self) -> bool:
        """Whether the case has an extra cache."""
        return self.topk_extra > 0

    def with_tokens(self, num_tokens: int) -> AttentionCase:
        """The same case with another ``num_tokens`` (name suffixed ``-T{num_tokens}``)."""
        return replace(self, name=f"{self.name}-T{num_tokens}", num_tokens=num_tokens)


@dataclass(frozen=True)
class AttentionInputs:
    """Tensors of one case, on one device.

    Attributes:
        case: the :class:`AttentionCase`.
        q: ``[T, H, d_qk]`` BF16.
        cache, extra: :class:`pytest_sparse_mla.data.PackedKVCache` (``extra`` may be ``None``).
        indices, extra_indices: ``[T, topk]`` / ``[T, topk_extra]`` int32.
        topk_length, extra_topk_length: ``[T]`` int32 or ``None``.
        attn_sink: ``[H]`` fp32 or ``None``.
        sm_scale: ``d_qk ** -0.5`` (``512 ** -0.5`` for DSV4, as FlashInfer's and FlashMLA's tests).
    """

    case: AttentionCase
    q: torch.Tensor
    cache: data.PackedKVCache
    indices: torch.Tensor
    sm_scale: float
    topk_length: torch.Tensor | None = None
    attn_sink: torch.Tensor | None = None
    extra: data.PackedKVCache | None = None
    extra_indices: torch.Tensor | None = None
    extra_topk_length: torch.Tensor | None = None

    def kwargs(self, **overrides: Any) -> dict[str, Any]:
        """Keyword arguments of ``sparse_mla_forward`` for this case (``None`` values omitted),
        updated with ``overrides``."""
        kw: dict[str, Any] = {
            "sm_scale": self.sm_scale,
            "fmt": self.case.fmt,
            "topk_length": self.topk_length,
            "attn_sink": self.attn_sink,
            "extra_kv_cache": self.extra.packed if self.extra is not None else None,
            "extra_indices": self.extra_indices,
            "extra_topk_length": self.extra_topk_length,
        }
        kw.update(overrides)
        return {k: v for k, v in kw.items() if v is not None}

    def run(self, forward: Callable[..., Any], **overrides: Any) -> Any:
        """``forward(q, cache.packed, indices, **kwargs(**overrides))``."""
        return forward(self.q, self.cache.packed, self.indices, **self.kwargs(**overrides))


def _lengths_and_stale(indices: torch.Tensor, length: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    if length is None:
        return indices, None
    num_tokens, topk = indices.shape
    out = indices.clone()
    out[:, max(0, min(length, topk)) :] = STALE_INDEX
    return out, torch.full((num_tokens,), length, dtype=torch.int32)


def make_inputs(
    case: AttentionCase, generator: torch.Generator, *, device: torch.device | str = "cpu"
) -> AttentionInputs:
    """Draw the tensors of ``case`` from ``generator`` (CPU) and move them to ``device``.

    Raises:
        ValueError, TypeError: as ``data.make_packed_cache`` / ``data.sparse_indices``.
    """
    f = formats.get_format(case.fmt)
    cache = data.make_packed_cache(
        generator,
        fmt=f,
        num_pages=case.num_pages,
        page_block_size=case.page_block_size,
        page_stride=case.page_stride,
        form=case.form,
        distribution=case.distribution,
        device=device,
    )
    q = data.latent((case.num_tokens, case.num_heads, f.d_qk), generator, distribution=case.distribution)
    indices = data.sparse_indices(
        case.num_tokens, case.topk, cache.num_tokens, generator, masked_fraction=case.masked_fraction
    )
    indices, lengths = _lengths_and_stale(indices, case.topk_length)
    sink = data.attn_sink(case.num_heads, generator) if case.with_sink else None
    extra = extra_indices = extra_lengths = None
    if case.dual:
        extra = data.make_packed_cache(
            generator,
            fmt=f,
            num_pages=case.extra_num_pages,
            page_block_size=case.extra_page_block_size,
            page_stride=case.page_stride,
            form=case.form,
            distribution=case.distribution,
            device=device,
        )
        extra_indices = data.sparse_indices(
            case.num_tokens, case.topk_extra, extra.num_tokens, generator,
            masked_fraction=case.extra_masked_fraction,
        )  # fmt: skip
        extra_indices, extra_lengths = _lengths_and_stale(extra_indices, case.extra_topk_length)

    def dev(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    return AttentionInputs(
        case=case,
        q=q.to(device),
        cache=cache,
        indices=indices.to(device),
        sm_scale=f.d_qk**-0.5,
        topk_length=dev(lengths),
        attn_sink=dev(sink),
        extra=extra,
        extra_indices=dev(extra_indices),
        extra_topk_length=dev(extra_lengths),
    )


def _fi(name: str, num_tokens: int, num_heads: int, topk: int, **kw: Any) -> AttentionCase:
    return AttentionCase(f"fi-{name}", num_tokens, num_heads, topk, **kw)


#: FlashInfer SM120 test configurations (small token counts on CPU; ``large`` ones need CUDA).
FLASHINFER_CASES: tuple[AttentionCase, ...] = (
    # decode, dedicated heads (T <= 64)
    _fi("decode-h8-k128", 16, 8, 128),
    _fi("decode-h8-k1024", 1, 8, 1024, with_sink=False),
    _fi("decode-h16-k192", 16, 16, 192),
    _fi("decode-h32-k512", 16, 32, 512, with_sink=False),
    _fi("decode-h64-k256", 16, 64, 256),
    _fi("decode-h128-k1024", 1, 128, 1024),
    _fi("decode-h64-k1024", 64, 64, 1024, large=True),
    # decode, runtime heads / runtime topk (500 = partial final tile)
    _fi("decode-h12-k512", 16, 12, 512),
    _fi("decode-h24-k256", 16, 24, 256, with_sink=False),
    _fi("decode-h80-k128", 16, 80, 128),
    _fi("decode-h64-k384", 16, 64, 384),
    _fi("decode-h64-k500", 16, 64, 500),
    # topk_length truncation, stale padding past the length
    _fi("trunc-h8-k192-len133", 16, 8, 192, topk_length=133),
    _fi("trunc-h32-k256-len133", 16, 32, 256, topk_length=133),
    _fi("trunc-h8-k512-len128", 16, 8, 512, topk_length=128, with_sink=False),
    _fi("trunc-h64-k1024-len992", 128, 64, 1024, topk_length=992, masked_fraction=0.0, large=True),
    # prefill (T > 64)
    _fi("prefill-h8-k128", 65, 8, 128),
    _fi("prefill-h16-k256", 128, 16, 256, with_sink=False),
    _fi("prefill-h64-k1024", 128, 64, 1024, large=True),
    _fi("prefill-h128-k2048", 256, 128, 2048, num_pages=64, large=True),
    # dual cache (main topk 128 at page 64 + extra), one softmax over both
    _fi("dual-h8-e128p64", 16, 8, 128, topk_extra=128, extra_page_block_size=64, extra_num_pages=16),
    _fi("dual-h16-e512p64", 16, 16, 128, topk_extra=512, extra_page_block_size=64, extra_num_pages=16),
    _fi("dual-h32-e512p2", 16, 32, 128, topk_extra=512, extra_page_block_size=2, extra_num_pages=512),
    _fi("dual-h16-e2176p2", 1, 16, 128, topk_extra=2176, extra_page_block_size=2, extra_num_pages=1024),
    _fi("dual-h8-elen0", 16, 8, 128, topk_extra=512, extra_page_block_size=64, extra_num_pages=16,
        extra_topk_length=0),
    _fi("dual-h8-elen768", 16, 8, 128, topk_extra=512, extra_page_block_size=64, extra_num_pages=16,
        extra_topk_length=768),
    _fi("dual-h8-main-len0", 16, 8, 128, topk_extra=128, extra_page_block_size=2, extra_num_pages=128,
        topk_length=0, masked_fraction=0.0),
    _fi("dual-prefill-h64-e512p64", 128, 64, 128, topk_extra=512, extra_page_block_size=64,
        extra_num_pages=16, large=True),
    _fi("dual-prefill-h128-e512p2", 128, 128, 128, topk_extra=512, extra_page_block_size=2,
        extra_num_pages=512, large=True),
    # cache forms and page strides (FlashInfer accepts all of them)
    _fi("form-hnd-tight", 8, 8, 128, form="hnd", page_stride="tight"),
    _fi("form-3d-padded", 8, 8, 128, form="3d"),
    _fi("form-2d-tight", 8, 8, 128, form="2d", page_stride="tight"),
    _fi("wide-scales", 8, 16, 256, distribution="wide"),
    # DSV3.2 (d_qk 576, inline scales, V = first 512 dims)
    _fi("dsv32-h16-k128", 4, 16, 128, fmt="dsv3_2"),
    _fi("dsv32-h64-k2048", 64, 64, 2048, fmt="dsv3_2", num_pages=64, large=True),
)  # fmt: skip


def deployment_cases() -> tuple[AttentionCase, ...]:
    """One decode-sized case per DeepSeek-V4 deployment, then prefill-sized (CUDA-only) ones.

    Geometry from :data:`pytest_sparse_mla.deployments.DEPLOYMENTS` (main cache after the 256 -> 64
    split; extra C4 at page 64, C128 at page 2). The SWA window is full (no ``-1``), a quarter of
    each extra row is ``-1``; DSpark drafts have 133 active entries in their 192-wide rows
    (window 128 + 5-token block; flashinfer-ai/flashinfer PR #4380).
    """
    out: list[AttentionCase] = []
    for dep in deployments.DEPLOYMENTS:
        key = dep.key.replace("DeepSeek-V4-", "").replace(" ", "-").replace("/", "-")
        key = key.replace("(", "").replace(")", "").replace("-draft", "")
        kw: dict[str, Any] = {"masked_fraction": 0.0, "page_block_size": dep.page_block_size}
        if dep.topk_extra:
            extra_tokens = max(1024, dep.topk_extra * 2)
            kw.update(
                topk_extra=dep.topk_extra,
                extra_page_block_size=dep.extra_page_block_size,
                extra_num_pages=extra_tokens // dep.extra_page_block_size,
                extra_masked_fraction=0.25,
            )
        if dep.topk == deployments.DSPARK_TOPK:
            kw["topk_length"] = 133
        out.append(AttentionCase(f"{key}-decode", dep.decode_num_tokens, dep.num_heads, dep.topk, **kw))
        out.append(AttentionCase(f"{key}-prefill", 512, dep.num_heads, dep.topk, large=True, **kw))
    out.append(
        AttentionCase(
            "Flash-C4-TP1-prefill-4096", 4096, 64, deployments.SWA_TOPK, num_pages=64,
            topk_extra=deployments.C4_TOPK, extra_page_block_size=64, extra_num_pages=64,
            masked_fraction=0.0, extra_masked_fraction=0.25, large=True,
        )
    )  # fmt: skip
    return tuple(out)


def case_params(cases: tuple[AttentionCase, ...]) -> list[Any]:
    """``pytest.param`` per case, id = ``case.name``; large cases carry ``sparse_mla_requires_cuda``."""
    return [pytest.param(c, id=c.name, marks=[pytest.mark.sparse_mla_requires_cuda] if c.large else []) for c in cases]


def inputs_on(case: AttentionCase, generator: torch.Generator, device: torch.device) -> AttentionInputs:
    """:func:`make_inputs` on ``device``; skips a large case unless ``device`` is CUDA (a CUDA
    machine run with ``--sparse-mla-device=cpu`` keeps its CPU suite small)."""
    if case.large and device.type != "cuda":
        pytest.skip(f"{case.name}: large case, run on CUDA only")
    return make_inputs(case, generator, device=device)
