"""Built-in ``vllm-triton``: adapter over vLLM's Triton BF16 sparse MLA (vllm-project/vllm,
``vllm/v1/attention/ops/xpu_mla_sparse.py``, ``triton_bf16_mla_sparse_interface``; PR #33230).

``triton_bf16_mla_sparse_interface(q [T, H, d_qk] BF16, kv [N, 1, d_qk] BF16, indices [T, 1, topk]
int32, sm_scale, d_v=512, block_dpe) -> (out [T, H, 512] BF16, max_logits [T, H], lse [T, H])``:
one Triton kernel for every ``T`` (no decode/prefill split), over a BF16 latent table rather than
a packed cache. The adapter gives it the table the ``flashmla`` adapter gives FlashMLA's prefill
(``_peer.virtual_table``): the packed caches dequantized exactly to BF16, an extra cache appended
with its valid lanes shifted, lanes past ``topk_length`` / ``extra_topk_length`` turned into
``-1``, rows padded with ``-1`` to a multiple of 16 (the kernel asserts ``index_topk % BLOCK_N ==
0``, ``BLOCK_N = 16``). ``block_dpe`` is 0 for DSV4 (``d_qk = 512``: the RoPE lanes sit inside the
512 values, which are also V; the function's docstring names this case) and 64 for DSV3.2
(``d_qk = 576``).

Only the source file runs: the module is executed from a vLLM source tree or installation found on
``sys.path`` (``vllm`` need not import), with its one vLLM import, ``vllm.triton_utils`` (re-exports
of ``triton``, ``triton.language`` and the constants ``LOG2E``, ``LOGE2``), answered by Triton
itself while it executes.

Conventions (read from ``_bf16_mla_sparse_kernel``): every negative index and every index ``>=
N`` masks its lane; no ``attn_sink`` argument; the LSE is natural log (``max_logits + log2(e_sum)
* ln 2``). An empty row keeps the kernel's finite running-max sentinel ``-1e30`` (in log2 units),
so its LSE is about ``-6.9e29`` instead of ``-inf`` and its output ``0``: the adapter reads an LSE
below ``-1e29`` as "no candidate" (a convention, documented in the kernel's comment on the
sentinel). A valid lane past the cache reaches the kernel, which masks ids at or past the table's
length (``kv_ids < SKV``; declared ``index_past_cache="masked"``, measured on the H200).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

from pytest_sparse_mla.envelope import Envelope, Widths
from pytest_sparse_mla.implementations._peer import (
    PeerAdapter,
    PeerCall,
    PeerResult,
    call_peer,
    check_folded_lengths,
    lse_to_convention,
    source_skip_reason,
    virtual_table,
)

__all__ = ["VllmTritonImplementation", "ENVELOPE", "vllm_module", "vllm_source"]

_FILE = "v1/attention/ops/xpu_mla_sparse.py"
_HINT = (
    "install vLLM, or put a directory holding vllm/v1/attention/ops/xpu_mla_sparse.py on PYTHONPATH "
    "(README, 'Run the suites against a peer')"
)
#: ``BLOCK_N`` of ``triton_bf16_mla_sparse_interface``: index rows are a multiple of it.
ROW_MULTIPLE = 16
#: The kernel's running-max sentinel (``-1.0e30``, log2 units) times ``ln 2``, halved: an LSE below
#: it means the row had no valid lane.
EMPTY_LSE_BELOW = -1.0e30 * math.log(2.0) / 2

#: Where a standalone reproducer finds the function (``_peer.call_peer``).
SOURCE = {"kind": "file", "package": "vllm", "path": _FILE, "stubs": "vllm"}
PEER = "vLLM triton_bf16_mla_sparse_interface (Triton BF16 sparse MLA over a dequantized table)"
DEVICES = ("cuda",)

ENVELOPE = Envelope(
    formats=("dsv4", "dsv3_2"),
    num_heads=None,
    topk=Widths(),
    extra_topk=Widths(),
    extra_cache_formats=("dsv4", "dsv3_2"),
    topk_length_formats=("dsv4", "dsv3_2"),
    topk_length_range="clamped",
    attn_sink=False,
    min_tokens=1,
    index_past_cache="masked",
    notes=(
        "one kernel for every num_tokens over a BF16 table the adapter dequantizes (exact); an extra cache "
        "is appended to the table; lanes past topk_length become -1; rows padded with -1 to a multiple of 16",
        "block_dpe 0 for DSV4 (d_qk 512), 64 for DSV3.2 (d_qk 576); no attn_sink argument",
        "its own LSE: natural log; an empty row's LSE is the finite sentinel -1e30 * ln 2 (read as empty)",
        "a valid lane past the cache is masked like -1: the kernel keeps kv_ids < SKV, the table's length "
        "(xpu_mla_sparse.py: mask_ids = (kv_ids < SKV) & (kv_ids >= 0)); measured on the H200 for the main and "
        "the extra cache; with both caches a main lane past the main cache would name the extra cache's "
        "first tokens in the adapter's joined table (the suites pass such a lane without an extra cache)",
        "BF16 products (tl.dot), fp32 online softmax in base 2",
    ),
)


def vllm_source() -> Path | None:
    """``vllm/v1/attention/ops/xpu_mla_sparse.py`` on ``sys.path`` (``vllm`` not imported), or ``None``."""
    from pytest_sparse_mla.implementations._source import find_source

    return find_source("vllm", _FILE)  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=1)
def vllm_module() -> Any:
    """vLLM's ``xpu_mla_sparse.py`` executed with ``vllm.triton_utils`` answered by Triton.

    Raises:
        ImportError: the file is not found on ``sys.path``; Triton is not installed.
    """
    from pytest_sparse_mla.implementations._source import exec_source, stubs_for

    path = vllm_source()
    if path is None:
        raise ImportError(f"vllm/{_FILE} is not on sys.path ({_HINT})")
    return exec_source("_sparse_mla_peer_vllm_xpu_mla_sparse", path, stubs_for("vllm"))


class VllmTritonImplementation(PeerAdapter):
    """Built-in ``vllm-triton`` (see the module docstring)."""

    name = "vllm-triton"
    compute_mode = "bf16"
    envelope = ENVELOPE
    peer = PEER
    devices = DEVICES

    def skip_reason(self, capability: str, device: str) -> str | None:
        """Why vLLM's kernel cannot run here: its source is not on ``sys.path``, no Triton, or not CUDA."""
        missing = None if vllm_source() is not None else f"vllm/{_FILE} is not on sys.path ({_HINT})"
        return source_skip_reason(self.name, capability, device, missing=missing, devices=DEVICES, load=vllm_module)

    def forward(self, call: PeerCall, return_fp32: bool) -> PeerResult:
        """Run vLLM's kernel (mapping in the module docstring) on the dequantized virtual table.

        Returns:
            :class:`PeerResult`: the BF16 output ``[T, H, 512]``, the LSE converted to
            ``lse_convention``, ``route=None``.

        Raises:
            pytest_sparse_mla.Unsupported: lengths the adapter cannot fold into the rows
                (:func:`_peer.check_folded_lengths`).
            ImportError: the source is not found.
            Whatever the kernel raises (``AssertionError`` from the interface's asserts).
        """
        import torch

        c = call.call
        check_folded_lengths(c)
        kv, rows, _ = virtual_table(c, row_multiple=ROW_MULTIPLE, fold_lengths=True)  # the kernel takes no lengths
        d_qk = c.main.layout.fmt.d_qk
        out, _max_logits, lse = call_peer(
            SOURCE, "triton_bf16_mla_sparse_interface", vllm_module().triton_bf16_mla_sparse_interface,
            (c.q, kv, rows.unsqueeze(1), float(c.sm_scale)), {"d_v": 512, "block_dpe": d_qk - 512},
        )  # fmt: skip
        lse = torch.where(lse < EMPTY_LSE_BELOW, torch.full_like(lse, -math.inf), lse)
        lse = lse_to_convention(
            lse, sink_included=False, attn_sink=None, lse_convention=c.lse_convention, lse_scale=c.lse_scale
        )
        return PeerResult(out, lse, None, "vllm.v1.attention.ops.xpu_mla_sparse.triton_bf16_mla_sparse_interface")
