"""Conformance: an implementation that declares a FlashInfer release follows that release's dispatch grid.

An implementation may declare ``flashinfer_release`` (protocol table in
``pytest_sparse_mla.implementations``): the bundled reference declares the release of
``--sparse-mla-grid``, the ``flashinfer`` adapter the installed flashinfer-python. Serving code
reacts to a release's edges: it catches the release's error to fall back (pad the heads, route to
another backend, refuse a deployment at start-up), so an implementation that claims a release must,
through its own ``sparse_mla_forward``:

* raise, for a shape the release has no kernel for, the release's upstream error type
  (``RuntimeError`` for a C++ ``TVM_FFI_ICHECK`` failure, ``ValueError`` for FlashInfer's Python
  dispatch) whose ``str()`` is exactly the release's text, and
* run a shape the release serves: BF16 output ``[T, H, 512]`` and fp32 LSE ``[T, H]``, finite, and
  the route ``decode`` iff ``T <= 64`` where the implementation reports one.

The expected verdict and text of each shape come from the bundled per-release tables
(``pytest_sparse_mla.dispatch.supports``), which ``tests/test_dispatch_tables.py`` checks against
hand-transcribed tables and published tracebacks, and ``tests/test_flashinfer_introspection.py``
against the releases' own code. Without a declared release every test here skips with that reason.

The shapes are the public regressions of the grid (sgl-project/sglang #33134, #33985;
flashinfer-ai/flashinfer #3828, PRs #3817, #3896, #4380): 8 local heads at TP8, DSpark's topk 192,
topk 256, an extra cache of 128-token pages in dual-cache prefill, head counts outside
{8, 16, 32, 64, 128}, more than 128 heads, a main page of 128 tokens in decode, a ragged topk in
prefill, and DSV3.2 prefill, plus shapes every release serves; and DeepSeek-V4.1 calls (``fmt="dsv4_1"``:
SWA records in the main cache, FP4 indexed records in the extra cache), which FlashInfer serves from
0.7.1 (``ModelType::DSV4_1``; its prefill has no 128-head kernel). This package's V4.1 caches hold
inline records, so they are judged as ``DSV4_1_INLINE`` where the release reads those (0.7.4) and as
``DSV4_1`` before (``dispatch.inline_v41_model``); before 0.7.1 the V4.1 shapes skip.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pytest_sparse_mla import data, formats
from pytest_sparse_mla.dispatch import SparseMlaConfig, UnsupportedReleaseError, inline_v41_model, supports

pytestmark = pytest.mark.sparse_mla_needs("sparse_mla_forward")

SM_SCALE = 512**-0.5


@dataclass(frozen=True)
class GridShape:
    """One call shape (tokens, heads, index widths, page sizes) of the dispatch grid; ``model``
    ``"DSV4_1"`` is a ``fmt="dsv4_1"`` call (inline V4.1 records)."""

    name: str
    model: str
    num_tokens: int
    num_heads: int
    topk: int
    page_block_size: int = 64
    extra_topk: int = 0
    extra_page_block_size: int = 0

    def config(self, release: str) -> SparseMlaConfig:
        """The shape as ``release`` sees it; skips a V4.1 shape on a release without V4.1 formats."""
        model = self.model
        if model == "DSV4_1":
            try:
                model = inline_v41_model(release)[0]
            except UnsupportedReleaseError as exc:
                pytest.skip(str(exc))
        return SparseMlaConfig(
            model, self.num_tokens, self.num_heads, self.topk, self.page_block_size,
            topk_extra=self.extra_topk, extra_page_block_size=self.extra_page_block_size,
        )  # fmt: skip


SHAPES = [
    # V4-Flash TP8 prefill, 8 local heads: no NH=8 prefill kernel before 0.6.18 (PR #4380).
    GridShape("flash-tp8-prefill-h8", "DSV4", 65, 8, 128),
    GridShape("flash-tp8-prefill-h8-c128", "DSV4", 65, 8, 128, extra_topk=512, extra_page_block_size=2),
    # DSpark draft: topk 192 in decode (sglang #33985) and prefill (sglang #33134).
    GridShape("dspark-decode-topk192", "DSV4", 5, 32, 192),
    GridShape("dspark-prefill-topk192", "DSV4", 65, 64, 192),
    # topk 256: decode (flashinfer PR #3817) and prefill (flashinfer #3828).
    GridShape("decode-topk256", "DSV4", 1, 16, 256),
    GridShape("prefill-topk256", "DSV4", 65, 32, 256),
    # C4 layer with an extra cache of 128-token pages: dual prefill rejects it until 0.7.1,
    # decode takes the extra page size at run time in every release.
    GridShape("c4-extra-page128-prefill", "DSV4", 65, 16, 128, extra_topk=512, extra_page_block_size=128),
    GridShape("c4-extra-page128-decode", "DSV4", 1, 16, 128, extra_topk=512, extra_page_block_size=128),
    # Head envelope: 24 heads has no prefill kernel; 256 heads exceeds every release's limit.
    GridShape("prefill-h24", "DSV4", 65, 24, 128),
    GridShape("decode-h256", "DSV4", 1, 256, 128),
    # Decode with a main page of 128 tokens: compiled for 64 until 0.7.1.
    GridShape("decode-page128", "DSV4", 5, 32, 128, page_block_size=128),
    # Prefill with a topk that is not a multiple of 64.
    GridShape("prefill-topk100", "DSV4", 65, 16, 100),
    # DSV3.2 prefill: topk 2048 only before 0.7.0.
    GridShape("dsv32-prefill-topk128", "DSV3_2", 65, 16, 128),
    # Served by every release.
    GridShape("dsv32-decode-h16-topk128", "DSV3_2", 2, 16, 128),
    GridShape("decode-h8-topk128", "DSV4", 2, 8, 128),
    GridShape("c4-prefill-h16-extra-page64", "DSV4", 65, 16, 128, extra_topk=512, extra_page_block_size=64),
    # DeepSeek-V4.1 (from 0.7.1): decode at the indexer's topk 512 with an FP4 extra cache; prefill has
    # single-group kernels for 8-64 heads only, so 128 heads is rejected in prefill and served in decode.
    GridShape("v41-decode-h128-topk512-fp4-extra", "DSV4_1", 4, 128, 512, extra_topk=512, extra_page_block_size=64),
    GridShape("v41-prefill-h128", "DSV4_1", 65, 128, 512),
    GridShape("v41-prefill-h16-fp4-extra", "DSV4_1", 65, 16, 128, extra_topk=512, extra_page_block_size=2),
    GridShape("v41-prefill-topk100", "DSV4_1", 65, 16, 100),
]  # fmt: skip


@pytest.fixture
def declared_release(sparse_mla_impl) -> str:  # type: ignore[no-untyped-def]
    """The implementation's ``flashinfer_release``; skips the test when it declares none."""
    release = getattr(sparse_mla_impl, "flashinfer_release", None)
    if not release:
        name = getattr(sparse_mla_impl, "name", repr(sparse_mla_impl))
        pytest.skip(
            f"implementation {name!r} declares no flashinfer_release (the reference declares one with "
            "--sparse-mla-grid flashinfer==X): no dispatch grid to hold it to"
        )
    return str(release)


def _inputs(shape: GridShape, generator: torch.Generator, device: torch.device) -> dict:
    """Keyword arguments of ``sparse_mla_forward`` for ``shape``: random queries and rows, half of
    each index row valid (FlashInfer's test draw), caches with enough tokens for every lane."""
    fmt = next(n for n, c in formats.CALL_FORMATS.items() if c.envelope and c.grid_model == shape.model)
    main_fmt, extra_fmt = formats.cache_formats(fmt)
    f = main_fmt
    pages = -(-shape.topk // shape.page_block_size) + 1
    main = data.make_packed_cache(
        generator, fmt=main_fmt, num_pages=pages, page_block_size=shape.page_block_size, device=device
    )
    q = data.latent((shape.num_tokens, shape.num_heads, f.d_qk), generator, device=device)
    kwargs: dict = {
        "q": q,
        "kv_cache": main.packed,
        "indices": data.sparse_indices(shape.num_tokens, shape.topk, main.num_tokens, generator, device=device),
        "sm_scale": SM_SCALE,
        "fmt": fmt,
    }
    if shape.extra_topk:
        extra_pages = -(-shape.extra_topk // shape.extra_page_block_size) + 1
        extra = data.make_packed_cache(
            generator, fmt=extra_fmt, num_pages=extra_pages, page_block_size=shape.extra_page_block_size, device=device
        )
        kwargs["extra_kv_cache"] = extra.packed
        kwargs["extra_indices"] = data.sparse_indices(
            shape.num_tokens, shape.extra_topk, extra.num_tokens, generator, device=device
        )
    return kwargs


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_declared_release_errors_and_runs_like_the_release(
    shape: GridShape, declared_release: str, sparse_mla_impl, sparse_mla_generator, sparse_mla_device
) -> None:  # type: ignore[no-untyped-def]
    config = shape.config(declared_release)
    verdict = supports(config, declared_release)
    inputs = _inputs(shape, sparse_mla_generator, sparse_mla_device)
    where = f"flashinfer-python {declared_release} on {config.describe()}"
    if not verdict.supported:
        assert verdict.error_type is not None and verdict.error_message is not None
        base = RuntimeError if issubclass(verdict.error_type, RuntimeError) else ValueError
        try:
            sparse_mla_impl.sparse_mla_forward(**inputs)
        except Exception as exc:  # noqa: BLE001 - any type is judged below
            error = exc
        else:
            pytest.fail(
                f"{where}: ran, but the release has no kernel for it and raises "
                f"{base.__name__}: {verdict.error_message}",
                pytrace=False,
            )
        assert isinstance(error, base), (
            f"{where}: raised {type(error).__name__}({error}), expected a {base.__name__} "
            f"(upstream {verdict.error_type.__name__})"
        )
        assert str(error) == verdict.error_message, (
            f"{where}: error text differs from the release's\n  got:      {error}\n  expected: {verdict.error_message}"
        )
        return
    res = sparse_mla_impl.sparse_mla_forward(**inputs)
    t, h = shape.num_tokens, shape.num_heads
    assert res.output.dtype == torch.bfloat16 and tuple(res.output.shape) == (t, h, 512), where
    assert res.lse.dtype == torch.float32 and tuple(res.lse.shape) == (t, h), where
    assert bool(torch.isfinite(res.output).all()) and bool(torch.isfinite(res.lse).all()), where
    route = getattr(res, "route", None)
    if route is not None:
        assert route == ("decode" if t <= 64 else "prefill"), f"{where}: route {route!r}"


def test_declared_release_serves_an_empty_batch(
    declared_release: str, sparse_mla_impl, sparse_mla_generator, sparse_mla_device
) -> None:  # type: ignore[no-untyped-def]
    """FlashInfer's entry returns before dispatching when ``q.shape[0] == 0``, so no release
    rejects an empty batch (an idle data-parallel rank), even with 8 heads and a 512-wide extra
    cache: the result is a ``[0, H, 512]`` output and a ``[0, H]`` LSE."""
    shape = GridShape("empty", "DSV4", 0, 8, 128, extra_topk=512, extra_page_block_size=2)
    res = sparse_mla_impl.sparse_mla_forward(**_inputs(shape, sparse_mla_generator, sparse_mla_device))
    assert tuple(res.output.shape) == (0, 8, 512) and tuple(res.lse.shape) == (0, 8), declared_release
