"""Built-in ``flashinfer``: an adapter over FlashInfer's SM120 sparse-MLA entry
``_sparse_mla_sm120_paged_attention`` (module ``flashinfer.mla._sparse_mla_sm120._api`` from 0.7.1,
``flashinfer.mla._sparse_mla_sm120`` before; signature and checks in flashinfer-ai/flashinfer
``flashinfer/mla/_sparse_mla_sm120/_api.py`` of 0.7.4). It provides ``sparse_mla_forward`` only
(FlashInfer ships no DSV4-584 writer and no page split) and is skipped unless flashinfer-python is
installed and the suites run on an SM12x GPU. Pytest-free.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any

from pytest_sparse_mla import capabilities
from pytest_sparse_mla.envelope import Envelope
from pytest_sparse_mla.implementations._peer import PeerAdapter, PeerCall, PeerResult, call_peer, lse_to_convention

__all__ = ["FlashInferImplementation"]


def _flashinfer_entry() -> Callable[..., None]:
    """FlashInfer's internal SM120 entry ``_sparse_mla_sm120_paged_attention`` (0.6.14 .. 0.7.4)."""
    for module_name in (
        "flashinfer.mla._sparse_mla_sm120._api",  # 0.7.1+: package split
        "flashinfer.mla._sparse_mla_sm120",  # 0.6.14 - 0.7.0: one module
    ):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        entry: Callable[..., None] | None = getattr(module, "_sparse_mla_sm120_paged_attention", None)
        if entry is not None:
            return entry
    raise ImportError(
        "flashinfer.mla has no _sparse_mla_sm120_paged_attention (looked in "
        "flashinfer.mla._sparse_mla_sm120._api and flashinfer.mla._sparse_mla_sm120)"
    )


class FlashInferImplementation(PeerAdapter):
    """Built-in ``flashinfer``: adapter over FlashInfer's SM120 sparse-MLA kernels (CUDA, SM12x).

    Best effort: written against the 0.6.14 - 0.7.4 sources (``flashinfer/mla/_sparse_mla_sm120.py``,
    ``flashinfer/mla/_sparse_mla_sm120/_api.py``), not run on SM12x hardware by this project. It
    allocates ``output``/``out_lse`` (and the split-K decode scratch for ``num_tokens <= 64``:
    ``[T, heads, splits, 512]`` BF16 and ``[T, heads, splits]`` fp32 with ``splits =
    ceil(topk/64) + ceil(extra_topk/64)`` and ``heads`` = 8 if H == 8 else ``ceil(H/16)*16`` from
    0.7.0, H before), calls the entry, and converts FlashInfer's base-2, sink-including LSE to the
    requested convention.
    """

    name = "flashinfer"
    compute_mode = "fp8"
    peer = "FlashInfer _sparse_mla_sm120_paged_attention"
    devices = ("cuda",)
    #: FlashInfer's SM120 entry takes any head count and width its grid serves (the grid itself is
    #: judged by ``suites/test_dispatch_grid.py``); from 0.7.0 it rejects a DSV3.2 extra cache.
    envelope = Envelope(
        extra_cache_formats=("dsv4",),
        notes=("its own LSE: base 2, sink included; converted to the asked convention",),
    )

    @property
    def flashinfer_release(self) -> str | None:
        """Protocol attribute: the installed flashinfer-python version (its grid is the one that runs)."""
        return capabilities.probe().flashinfer_version

    def skip_reason(self, capability: str, device: str) -> str | None:
        """Why FlashInfer cannot run here: not installed, not on CUDA, or not an SM12x GPU."""
        caps = capabilities.probe()
        if caps.flashinfer_version is None:
            return "flashinfer adapter: flashinfer-python is not installed"
        if device != "cuda" or not caps.cuda_available:
            return (
                "flashinfer adapter: FlashInfer's SM120 sparse-MLA kernels need CUDA tensors; "
                f"the suites run on {device} (CUDA available: {caps.cuda_available})"
            )
        if caps.compute_capability is None or caps.compute_capability[0] != 12:
            return (
                "flashinfer adapter: requires an SM12x GPU (compute capability 12.x); found "
                f"{caps.sm} ({caps.device_name})"
            )
        return None

    def forward(self, call: PeerCall, return_fp32: bool) -> PeerResult:
        """Run FlashInfer's kernel; FlashInfer reads the page sizes from the caches' shapes.

        Raises:
            ImportError: the installed flashinfer has no SM120 sparse-MLA entry.
            Whatever FlashInfer raises for the inputs.
        """
        import torch
        from packaging.version import Version

        c = call.call
        device = c.q.device
        entry = _flashinfer_entry()
        num_tokens, num_heads = c.num_tokens, c.num_heads
        output = torch.zeros((num_tokens, num_heads, 512), dtype=torch.bfloat16, device=device)
        out_lse = torch.zeros((num_tokens, num_heads), dtype=torch.float32, device=device)
        kwargs: dict[str, Any] = {
            "topk_length": c.main.topk_length,
            "attn_sink": c.attn_sink,
            "extra_kv_cache": c.extra.cache if c.extra else None,
            "extra_indices": c.extra.indices if c.extra else None,
            "extra_topk_length": c.extra_topk_length,
        }
        if 0 < num_tokens <= 64:
            splits = -(-c.main.topk // 64) + (-(-c.extra.topk // 64) if c.extra else 0)
            version = Version(capabilities.probe().flashinfer_version or "0")
            heads = (8 if num_heads == 8 else -(-num_heads // 16) * 16) if version >= Version("0.7.0") else num_heads
            kwargs["mid_out"] = torch.empty((num_tokens, heads, splits, 512), dtype=torch.bfloat16, device=device)
            kwargs["mid_lse"] = torch.empty((num_tokens, heads, splits), dtype=torch.float32, device=device)
        source = {"kind": "import", "module": entry.__module__}
        args = (c.q, c.main.cache, c.main.indices, output, out_lse, float(c.sm_scale))
        call_peer(source, "_sparse_mla_sm120_paged_attention", entry, args, kwargs)
        # FlashInfer's out_lse: base 2, sink included -> natural log for the shared conversion
        lse = lse_to_convention(
            out_lse.to(torch.float64) * math.log(2.0),
            sink_included=True,
            attn_sink=c.attn_sink,
            lse_convention=c.lse_convention,
            lse_scale=c.lse_scale,
        )
        return PeerResult(output, lse, c.route, "flashinfer _sparse_mla_sm120_paged_attention")
