"""Built-in ``flaggems``: adapter over FlagGems' Triton implementation of FlashMLA's interface
(flagos-ai/FlagGems, ``src/flag_gems/fused/flash_mla_with_kvcache.py``: ``get_mla_metadata``,
``flash_mla_with_kvcache``, sparse FP8 decode for both cache formats; ``src/flag_gems/fused/flashmla_sparse.py``:
``flash_mla_sparse_fwd``, sparse BF16 prefill).

FlagGems reimplements FlashMLA's Python interface in Triton, so this adapter is the ``flashmla``
adapter (``implementations.flashmla``: the same routes, cache views, virtual prefill table and LSE
conversion) over a different module. Only the two source files run: they are executed from the
FlagGems source tree (``flag_gems`` found on ``sys.path``, e.g. ``PYTHONPATH=FlagGems/src``, or an
installed FlagGems; the ``flag-gems`` wheel on the package index predates these files) without
importing the ``flag_gems`` package, whose import registers its operators with torch. Their one
FlagGems import, ``flag_gems.utils.triton_version_utils.has_triton_tle``, is answered ``False``
while they execute, so the FlagTree-only warp-specialised paths stay off and stock Triton runs the
portable kernels (``_sparse_decode_kernel``, ``_sparse_decode_model1_kernel``,
``triton_flash_mla_sparse_fwd``).

What differs from FlashMLA (read from the kernels above): every negative index masks its lane in
the decode (``kv_ids >= 0``) and an index past the cache is masked (``block_ids < NUM_BLOCKS``,
``kv_ids < SKV``), no ``int2`` index loads; like FlashMLA, ``topk_length`` is read raw (the number
of tiles is ``cdiv(topk_length, BK)``, lanes past ``topk`` would be read), so a length outside
``[0, topk]`` is refused as unsafe. The LSE is FlashMLA's (natural log, sink excluded, ``+inf``
for an empty row); the sink enters the output as ``exp(lse) / (exp(lse) + exp(sink))``, computed
in fp32 as written.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from pathlib import Path
from typing import Any

from pytest_sparse_mla.implementations._peer import source_skip_reason
from pytest_sparse_mla.implementations.flashmla import ENVELOPE as FLASHMLA_ENVELOPE
from pytest_sparse_mla.implementations.flashmla import PREFILL_ROW_MULTIPLE, FlashMlaImplementation

__all__ = ["FlagGemsImplementation", "ENVELOPE", "flaggems_module", "flaggems_source"]

_HINT = (
    "put FlagGems' src directory on PYTHONPATH (git clone flagos-ai/FlagGems; README, 'Run the suites against a peer')"
)
_FILES = ("fused/flash_mla_with_kvcache.py", "fused/flashmla_sparse.py")

#: The peer's entry points, in words (prefix of refusals).
PEER = (
    "FlagGems flash_mla_with_kvcache (Triton sparse FP8 decode, T <= 64) / flash_mla_sparse_fwd "
    "(Triton sparse BF16 prefill)"
)

#: FlashMLA's envelope (FlagGems asserts the same: ``flash_mla_with_kvcache``: h_q 64 or 128, topk
#: % 64, V32 without extra cache or topk_length; ``flash_mla_sparse_fwd``: h_q 64 or 128), except
#: that every negative index masks its lane.
ENVELOPE = dataclasses.replace(
    FLASHMLA_ENVELOPE,
    masked_indices="negative",
    index_past_cache="masked",
    notes=(
        "num_tokens <= 64: flash_mla_with_kvcache (FlagGems' Triton decode), one batch entry per token; "
        "d_qk 512 = DSV4 584 B cache (_sparse_decode_model1_kernel), 576 = DSV3.2 656 B cache "
        "(_sparse_decode_kernel, no extra cache, no topk_length)",
        f"num_tokens > 64: flash_mla_sparse_fwd over a BF16 table the adapter dequantizes (exact); an extra "
        f"cache is appended to the table, index rows padded with -1 to a multiple of {PREFILL_ROW_MULTIPLE}",
        "every negative index masks its lane; topk_length must lie in [0, topk] (read raw)",
        "a valid lane past the cache is masked like -1: the DSV4 decode kernel keeps a lane only while its "
        "page is < NUM_BLOCKS (flash_mla_with_kvcache.py: valid_ids = t_msk & (kv_ids >= 0) & (block_ids < "
        "NUM_BLOCKS)); measured on the H200 for the main and the extra cache with num_tokens 4 (decode); "
        "the prefill route (flash_mla_sparse_fwd) was not measured",
        "its own LSE: natural log, sink excluded, empty row +inf; converted to the asked convention",
        "FlagTree-only paths off (has_triton_tle answered False): stock Triton's portable kernels",
    ),
)


def flaggems_source() -> Path | None:
    """The ``flag_gems`` package directory on ``sys.path`` (not imported), or ``None``."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("flag_gems")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        root = Path(location)
        if all((root / f).is_file() for f in _FILES):
            return root
    return None


@functools.lru_cache(maxsize=1)
def flaggems_module() -> Any:
    """FlagGems' two source files executed with ``has_triton_tle`` answering ``False``.

    Returns:
        A namespace with ``get_mla_metadata``, ``flash_mla_with_kvcache`` and ``flash_mla_sparse_fwd``.

    Raises:
        ImportError: FlagGems' source is not on ``sys.path``, or lacks the two files.
    """
    from pytest_sparse_mla.implementations._source import exec_source, stubs_for

    root = flaggems_source()
    if root is None:
        raise ImportError(f"flag_gems with {', '.join(_FILES)} is not on sys.path ({_HINT})")
    decode = exec_source("_sparse_mla_peer_flaggems_decode", root / _FILES[0], stubs_for("flaggems"))
    prefill = exec_source("_sparse_mla_peer_flaggems_prefill", root / _FILES[1], stubs_for("flaggems"))
    return types.SimpleNamespace(
        get_mla_metadata=decode.get_mla_metadata,
        flash_mla_with_kvcache=decode.flash_mla_with_kvcache,
        flash_mla_sparse_fwd=prefill.flash_mla_sparse_fwd,
    )


class FlagGemsImplementation(FlashMlaImplementation):
    """Built-in ``flaggems`` (see the module docstring)."""

    name = "flaggems"
    compute_mode = "bf16"
    envelope = ENVELOPE
    peer = PEER
    decode_entry = "flag_gems.fused.flash_mla_with_kvcache.flash_mla_with_kvcache"
    prefill_entry = "flag_gems.fused.flashmla_sparse.flash_mla_sparse_fwd"
    decode_masks_only_minus_one = False
    decode_source = {"kind": "file", "package": "flag_gems", "path": _FILES[0], "stubs": "flaggems"}
    prefill_source = {"kind": "file", "package": "flag_gems", "path": _FILES[1], "stubs": "flaggems"}

    def module(self) -> Any:
        """:func:`flaggems_module`."""
        return flaggems_module()

    def skip_reason(self, capability: str, device: str) -> str | None:
        """Why FlagGems cannot run here: its source is not on ``sys.path``, Triton is missing, or not CUDA."""
        missing = f"flag_gems with {', '.join(_FILES)} is not on sys.path ({_HINT})"
        return source_skip_reason(
            self.name, capability, device, missing=None if flaggems_source() else missing, devices=self.devices,
            load=self.module,
        )  # fmt: skip
