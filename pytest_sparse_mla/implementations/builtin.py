"""The bundled implementations: ``reference`` (pack, torch page split, the reference attention)
and ``triton`` (the Triton page split, the rest the reference's). Pytest-free."""

from __future__ import annotations

from typing import Any

from pytest_sparse_mla.envelope import ALL_FORMATS, INVARIANCE_CLAIMS, Envelope

__all__ = ["ReferenceImplementation", "TritonImplementation"]


class ReferenceImplementation:
    """The bundled pure-PyTorch implementation (built-in name ``reference``).

    Args:
        grid_release: FlashInfer release whose dispatch grid ``sparse_mla_forward`` enforces
            (``--sparse-mla-grid``), or ``None``. A caller's explicit ``grid_release=`` wins.
    """

    name = "reference"
    compute_mode = "exact"
    split_backend = "torch"
    #: Every call, and every invariance bit for bit (a fixed-order fp32 pipeline per token and head).
    envelope = Envelope(
        formats=ALL_FORMATS,
        extra_cache_formats=ALL_FORMATS,
        topk_length_formats=ALL_FORMATS,
        sink_formats=ALL_FORMATS,
        bitwise_invariance=frozenset(INVARIANCE_CLAIMS),
    )

    def __init__(self, grid_release: str | None = None) -> None:
        self.grid_release = grid_release

    @property
    def flashinfer_release(self) -> str | None:
        """Protocol attribute: the release whose grid ``sparse_mla_forward`` enforces (``grid_release``)."""
        return self.grid_release

    def pack(self, source: Any, fmt: Any = "dsv4", **kwargs: Any) -> Any:
        """``formats.quantize_pack`` (BF16 ``[P, ps, d_qk]`` -> packed uint8 cache)."""
        from pytest_sparse_mla import formats

        return formats.quantize_pack(source, fmt, **kwargs)

    def page_split(self, kv_cache: Any, **kwargs: Any) -> Any:
        """``page_split.page_split`` with this implementation's backend (a ``backend=`` wins)."""
        from pytest_sparse_mla.page_split import page_split

        kwargs.setdefault("backend", self.split_backend)
        return page_split(kv_cache, **kwargs)

    def sparse_mla_forward(self, q: Any, kv_cache: Any, indices: Any, **kwargs: Any) -> Any:
        """``attention.sparse_mla_forward`` (grid enforcement from ``--sparse-mla-grid``)."""
        from pytest_sparse_mla.attention import sparse_mla_forward

        kwargs.setdefault("grid_release", self.grid_release)
        return sparse_mla_forward(q, kv_cache, indices, **kwargs)

    def skip_reason(self, capability: str, device: str) -> str | None:
        """Every capability runs everywhere (``None``)."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} grid={self.grid_release}>"


class TritonImplementation(ReferenceImplementation):
    """Built-in ``triton``: the Triton page split; ``pack`` and attention from the reference."""

    name = "triton"
    split_backend = "triton"

    def skip_reason(self, capability: str, device: str) -> str | None:
        """Why the Triton split cannot run on ``device`` (``page_split.triton_unavailable_reason``)."""
        if capability != "page_split":
            return None
        from pytest_sparse_mla.page_split import triton_unavailable_reason

        return triton_unavailable_reason(device)
