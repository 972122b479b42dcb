"""Deliberately wrong implementations: each breaks one rule the suites specify.

``tests/test_wrong_implementations.py`` runs the relevant suite against each of them
(``--sparse-mla-impl wrong_impls:<name>``, this directory on ``PYTHONPATH``) and asserts that it
fails, while the bundled reference passes the same selection. Each one wraps the bundled code and
changes exactly one thing, the way a real kernel bug would:

* :data:`ignores_sink`: drops ``attn_sink`` (the sink's ``exp(attn_sink[h])`` never reaches the
  softmax denominator).
* :data:`past_topk_length`: drops ``topk_length`` / ``extra_topk_length``, so lanes past each
  token's valid prefix are gathered (the kernels read only ``clamp(topk_length, 0, topk)`` lanes).
* :data:`sglang_floor`: packs with SGLang's scale rule (``2**ceil(log2(max(amax, 1e-8) / 448))``)
  while claiming FlashMLA's (``2**ceil(log2(max(amax / 448, 1e-4)))``): a 64-value group whose
  maximum is under ``448e-4`` gets a smaller UE8M0 exponent (``formats.scale_exponents``).
* :data:`uninitialised_scratch`: its page split fills newly allocated scratch with ``0xA5`` bytes,
  standing in for ``torch.empty``'s arbitrary contents (a real ``torch.empty`` is often zero on a
  fresh page, which would make this self-test flaky); the reference zero-fills (SGLang PR #39288).
* :data:`shared_split_buffer`: its page split ignores ``key_suffix``, so a second split in one call
  (the DeepSeek-V4.1 extra cache) overwrites the first split's pages.

None of them declares ``tolerance_profile``: they are judged with the loose ``"kernel"`` tolerances
(``atol = rtol = 5e-2``), so being caught does not depend on tight tolerances.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "ignores_sink",
    "past_topk_length",
    "sglang_floor",
    "uninitialised_scratch",
    "shared_split_buffer",
]

#: Byte written into freshly allocated scratch by :data:`uninitialised_scratch`.
GARBAGE_BYTE = 0xA5


class IgnoresSink:
    """``sparse_mla_forward`` without the attention sink."""

    name = "wrong-ignores-sink"

    def sparse_mla_forward(self, q: Any, kv_cache: Any, indices: Any, **kwargs: Any) -> Any:
        from pytest_sparse_mla.attention import sparse_mla_forward

        kwargs.pop("attn_sink", None)
        return sparse_mla_forward(q, kv_cache, indices, **kwargs)


class PastTopkLength:
    """``sparse_mla_forward`` that gathers every non-negative lane, ignoring ``topk_length``."""

    name = "wrong-past-topk-length"

    def sparse_mla_forward(self, q: Any, kv_cache: Any, indices: Any, **kwargs: Any) -> Any:
        from pytest_sparse_mla.attention import sparse_mla_forward

        kwargs.pop("topk_length", None)
        kwargs.pop("extra_topk_length", None)
        return sparse_mla_forward(q, kv_cache, indices, **kwargs)


class SglangFloor:
    """``pack`` that applies SGLang's scale rule whatever ``scale_rule`` it is asked for."""

    name = "wrong-sglang-floor"

    def pack(self, source: Any, fmt: Any = "dsv4", **kwargs: Any) -> Any:
        from pytest_sparse_mla import formats

        kwargs["scale_rule"] = "sglang"
        return formats.quantize_pack(source, fmt, **kwargs)


class UninitialisedScratch:
    """``page_split`` whose newly allocated scratch holds garbage instead of zeros."""

    name = "wrong-uninitialised-scratch"

    def page_split(self, kv_cache: Any, *, registry: Any = None, **kwargs: Any) -> Any:
        from pytest_sparse_mla.page_split import default_registry, page_split

        registry = registry if registry is not None else default_registry()
        allocate = registry.get

        def get_garbage(name: str, device: Any, shape: Any, *args: Any, **kw: Any) -> torch.Tensor:
            made = len(registry.allocation_log)
            buf = allocate(name, device, shape, *args, **kw)
            if len(registry.allocation_log) > made:  # freshly allocated: not zero-filled here
                whole = registry.lookup(name, device, key_suffix=kw.get("key_suffix", ""))
                whole.view(torch.uint8).fill_(GARBAGE_BYTE)
            return buf

        registry.get = get_garbage  # this call only
        try:
            return page_split(kv_cache, registry=registry, **kwargs)
        finally:
            del registry.get


class SharedSplitBuffer:
    """``page_split`` that ignores ``key_suffix``: every split lands in the same scratch."""

    name = "wrong-shared-split-buffer"

    def page_split(self, kv_cache: Any, **kwargs: Any) -> Any:
        from pytest_sparse_mla.page_split import page_split

        kwargs.pop("key_suffix", None)
        return page_split(kv_cache, **kwargs)


ignores_sink = IgnoresSink()
past_topk_length = PastTopkLength()
sglang_floor = SglangFloor()
uninitialised_scratch = UninitialisedScratch()
shared_split_buffer = SharedSplitBuffer()
