"""Built-in ``sglang-q8kv8-sm90``: an adapter over SGLang 0.5.23's FP8-query, FP8-cache sparse MLA
prefill kernel for SM90 (``flashmla_sparse_q8``), executed from the installed ``sglang`` wheel
(``pip install --no-deps sglang==0.5.23``) and JIT-compiled by the wheel's own build code.

What runs (sgl-project/sglang, files of the installed package): ``sparse_mla_q8kv8_prefill_fwd`` of
``kernels/ops/attention/sparse_mla_q8kv8_prefill_sm90.py`` (its argument checks, lines 274-420),
whose CUDA kernel ``kernels/jit/csrc/sparse_mla_q8kv8_prefill_sm90/`` (``entry.cuh``, ``kernel.cuh``)
is built on first use by ``load_jit`` of ``kernels/jit/utils/compile/loader.py``: SGLang writes its
own ``build.ninja`` (``compile/ninja.py``; not ``tvm_ffi.cpp``) and runs ``ninja``, ``nvcc`` from
``CUDA_HOME`` (``compile/toolchain.py``) with ``-gencode=arch=compute_90a,code=sm_90a``, ``-std=c++20
-O3 --expt-relaxed-constexpr -DNDEBUG -DCUTE_USE_PACKED_TUPLE=1 -DCUTLASS_ENABLE_TENSOR_CORE_MMA=1
--use_fast_math``, tvm-ffi's headers and ``libtvm_ffi`` (``apache-tvm-ffi``, SGLang pins 0.1.11),
``msgspec`` (its build spec) and CUTLASS from the registered dependency ``"cutlass"``
(``kernels/jit/utils/deps.py``: FlashInfer's ``data/cutlass/include`` or DeepGEMM's ``include``; no
path or variable of its own; FlashInfer 0.7.2.post1 ships CUTLASS 4.5.0). The module is loaded with
``tvm_ffi.load_module`` and cached under ``SGLANG_JIT_CACHE_DIR`` (default ``~/.cache/sglang/jit``).
Built here with nvcc 13.0 against FlashMLA 9241ae3's CUTLASS (147f5673, 4.3.5) and FlashInfer's
4.5.0 alike (one translation unit, about 70 s on two cores); a device run points the build at
FlashMLA's (``SPARSE_MLA_SGLANG_CUTLASS``, ``scripts/peers_env.sh`` ``peers_sglang_jit``).

The caller, and how the adapter copies it. SGLang runs the kernel for DeepSeek-V4 in
``DeepseekV4Backend._forward_prefill_sparse_q8kv8`` (``sglang/srt/layers/attention/
deepseek_v4_backend.py`` lines 4564-4681, chosen for every extend batch on SM90 with
``--dsv4-prefill-backend flashmla_sparse_q8``: ``_use_sparse_prefill`` lines 2917-2933, with
``SGLANG_OPT_FLASHMLA_SPARSE_PREFILL`` true by default, ``environ.py`` line 1838; the backend refuses
another GPU than SM90 and ``d_v != 512``, lines 1324-1333):

* the query: ``_prepare_q8kv8_q_and_sink`` (lines 4507-4562) casts the BF16 ``q [T, H, 512]`` to E4M3
  at scale 1 (``cast_q_fp8_for_q8kv8_prefill`` of the kernel file, lines 548-600: ``q_fp8[:, :H].copy_(q)``,
  torch's cast, into an ``empty`` buffer of ``q8kv8_padded_num_heads(H)`` = 64 or 128 heads whose pad
  heads it zeroes), pads the sink to those heads with zeros, and passes a scalar fp32 ``1.0`` as
  ``q_scale`` and ``kv_scale``; the output is ``o[:, :H]`` (line 4681);
* the caches: ``gather_dequant_requant_fp8_paged_dsv4`` (``kernels/ops/attention/dsv4/dequant_k_cache.py``
  lines 172-231, a Triton kernel) gathers the token rows of the DSV4 584 B/token pool (2-D ``[P,
  page bytes]``, contiguous) into one E4M3 workspace ``[N, 1, 512]``: NoPE times its UE8M0 scale then
  cast to E4M3 at scale 1 (saturating, the docstring of lines 3028-3033 of ``dsa_backend.py``), the
  BF16 RoPE cast to E4M3; first the extra (compressed) cache's rows, then the main (SWA) cache's
  with one zero row appended (``extra_rows=1``, lines 4640-4660);
* the index rows: one combined row per token, ``[extra indices up to their length | main indices up
  to their length | -1 up to a multiple of 128]`` with every negative index ``-1`` and the rest rebased
  into the workspace, length ``extra_len + main_len`` (``combine_topk_swa_indices``,
  ``kernels/ops/attention/dsv4/sparse_prefill_kernels.py`` lines 114-150 and 153-156, its explicit-SWA
  form), then every ``-1`` replaced by the zero row's index (``torch.where``, lines 4662-4667);
* the call (lines 4669-4679): ``q=q_fp8, kv=workspace, indices=rows.unsqueeze(1), sm_scale, q_scale,
  kv_scale, d_v=512, attn_sink=sink_pad, topk_length=lengths``.

The adapter does these steps with the wheel's own helpers (``cast_q_fp8_for_q8kv8_prefill``,
``q8kv8_padded_num_heads``, ``gather_dequant_requant_fp8_paged_dsv4``); the rows and the padded sink
are built in torch as the combine kernel and ``_prepare_q8kv8_q_and_sink`` define them. It gathers
every token of each cache (token ids ``0 .. N-1``), where the caller gathers the tokens its rows
address: only the rebasing of the indices differs. The kernel returns ``(out [T, Hp, 512] BF16,
max_logits, lse [T, Hp] fp32)``; its LSE is FlashMLA's (natural log, sink excluded, ``+inf`` for a row
with no valid lane, ``kernel.cuh`` line 755), converted to the asked convention
(``_peer.lse_to_convention``).

Masking, and what that makes of ``-1``: with ``topk_length`` the kernel masks a lane whose index is
negative, ``>= s_kv`` or past the length (``kernel.cuh`` line 826), but the caller has already turned
every ``-1`` into the zero row's index, a valid lane: a masked lane inside the length is scored as a
logit of 0 with a zero value (it adds ``exp(-max)`` to the softmax denominator). The envelope declares
what the caller means (``masked_indices="negative"``: "-1 entries inside the top-k span stay -1
(attention skips them)", ``sparse_prefill_kernels.py`` line 105), so the suites judge that.

What the caller guarantees and the kernel does not check (the envelope holds the caller's contract):
DSV4 only (``assert token_to_kv_pool.get_swa_key_layout() is KVLayout.V4``, line 4645); an
``attn_sink`` (``assert attn_sink is not None``, line 4242: the kernel takes ``None``, so calls
without one are judged too, through its ``topk_length`` entry); at most 128 heads per rank, padded
(``q8kv8_padded_num_heads``). DSV3.2's caller (``dsa_backend.py`` ``_forward_flashmla_sparse_q8kv8``,
lines 3011-3243, 656 B pool, no sink, no lengths) is another mapping, not taken here.

Loading: as ``sglang_dsv4`` but with ``_source.stubs_for("sglang-q8kv8")``: the kernel file and
``dequant_k_cache.py`` run from the wheel, and so do the JIT build code (``kernels/jit/utils/``)
and ``kernels/kernel_api_logging.py``; stand-ins: the ``"sglang-kernels"`` ones,
``srt.environ.envs`` (the JIT's environment variables, read with SGLang's defaults),
``srt.utils.common.is_cuda``, ``srt.utils.custom_op.register_custom_op`` as the identity decorator
(SGLang's wraps the function in a ``torch.library`` op whose CUDA implementation is the function
itself, for ``torch.compile``), and the ``"cutlass"`` entry of ``deps.py``'s table when
``SPARSE_MLA_SGLANG_CUTLASS`` names CUTLASS's include directory.
"""

from __future__ import annotations

import functools
from typing import Any

from pytest_sparse_mla.envelope import Envelope, Unsupported, Widths
from pytest_sparse_mla.implementations import _sglang_kernels
from pytest_sparse_mla.implementations._peer import (
    PeerAdapter,
    PeerCall,
    PeerResult,
    call_peer,
    check_folded_lengths,
    lse_to_convention,
    source_skip_reason,
)

__all__ = ["SglangQ8Kv8Implementation", "ENVELOPE", "FILES", "ROW_MULTIPLE", "STUBS", "load"]

_ATTENTION = "kernels/ops/attention"
_KERNEL = f"{_ATTENTION}/sparse_mla_q8kv8_prefill_sm90.py"
#: ``(file, function)`` of each piece of the wheel the adapter calls (relative to ``sglang``).
FILES: dict[str, tuple[str, str]] = {
    "kernel": (_KERNEL, "sparse_mla_q8kv8_prefill_fwd"),
    "cast_q": (_KERNEL, "cast_q_fp8_for_q8kv8_prefill"),
    "padded_heads": (_KERNEL, "q8kv8_padded_num_heads"),
    "gather": (f"{_ATTENTION}/dsv4/dequant_k_cache.py", "gather_dequant_requant_fp8_paged_dsv4"),
}
#: The kernel's CUDA sources (relative to ``sglang``), built on first use.
CSRC = "kernels/jit/csrc/sparse_mla_q8kv8_prefill_sm90"
#: ``_source.stubs_for`` kind the files run with (module docstring).
STUBS = "sglang-q8kv8"
#: Combined rows are padded with -1 to a multiple of 128 (``SPARSE_PREFILL_TOPK_ALIGNMENT``,
#: sparse_prefill_kernels.py line 16; the kernel's check, sparse_mla_q8kv8_prefill_sm90.py line 376).
ROW_MULTIPLE = 128
#: The largest per-rank head count the caller pads (``q8kv8_padded_num_heads``, lines 534-545).
MAX_HEADS = 128

ENVELOPE = Envelope(
    formats=("dsv4",),
    num_heads=tuple(range(1, MAX_HEADS + 1)),
    topk=Widths(),
    extra_topk=Widths(),
    extra_cache_formats=("dsv4",),
    topk_length_formats=("dsv4",),
    sink_formats=("dsv4",),
    masked_indices="negative",
    index_past_cache="refused",
    notes=(
        "SGLang sparse_mla_q8kv8_prefill_fwd (kernels/ops/attention/sparse_mla_q8kv8_prefill_sm90.py), a "
        "JIT-built CUDA kernel for SM90 only (E4M3 x E4M3 GMMA for QK and PV, P cast to E4M3 before PV), "
        "called as DeepseekV4Backend._forward_prefill_sparse_q8kv8 calls it (deepseek_v4_backend.py lines "
        "4564-4681)",
        "DSV4 (584 B footer layout) only: the caller asserts KVLayout.V4 (line 4645) and gathers both caches "
        "into one E4M3 workspace at scale 1 (gather_dequant_requant_fp8_paged_dsv4, dequant_k_cache.py "
        "lines 172-231): NoPE times its UE8M0 scale, RoPE BF16, both re-cast to E4M3",
        "the query is cast from BF16 to E4M3 at scale 1 by torch (cast_q_fp8_for_q8kv8_prefill): values past "
        "448 are not representable",
        "head counts 1-128: the caller pads them to 64 or 128 (q8kv8_padded_num_heads) and keeps o[:, :H]",
        "any index-row width: the caller joins extra and main rows and pads with -1 to a multiple of 128 "
        "(combine_topk_swa_indices); lengths are the sum of the two spans",
        "every -1 inside a length becomes the index of a zero workspace row (lines 4662-4667), which the "
        "kernel scores as a valid lane of logit 0 (kernel.cuh line 826); masked_indices declares the "
        "caller's intent (-1 entries 'stay -1 (attention skips them)')",
        "attn_sink: the caller asserts it is given (line 4242); the kernel takes None (its topk_length "
        "entry), so calls without one are judged too",
        "no bound check of the project's indices: the kernel masks a workspace index >= s_kv; an extra "
        "index past its cache reads a main-cache row of the workspace",
        "its own LSE: FlashMLA's (natural log, sink excluded, +inf for a row with no valid lane, "
        "kernel.cuh line 755), [T, Hp]; converted to the asked convention",
    ),
)


def load(which: str) -> Any:
    """The function ``FILES[which]`` of the wheel, its file executed with the ``"sglang-q8kv8"``
    stand-ins (``_sglang_kernels.load_entry``; module docstring). The kernel's CUDA code is built
    on its first call, not here.

    Raises:
        ImportError: sglang (or triton, or msgspec) is not installed, or the file is missing.
        KeyError: another ``which``.
    """
    path, function = FILES[which]
    name = "_sparse_mla_peer_sglang_q8kv8_" + ("gather" if which == "gather" else "kernel")
    return _sglang_kernels.load_entry(name, path, function, STUBS)


def build_reason() -> str | None:
    """What the kernel's first call (the JIT build) lacks here, or ``None``: ``tvm_ffi``
    (``apache-tvm-ffi``), ``ninja``, ``nvcc`` (``CUDA_HOME``/``CUDA_PATH``/``PATH``, as SGLang's
    ``toolchain.cuda_home``), the CUDA sources in the wheel, or an SM90 GPU (the kernel body is SM90
    only, ``kernel.cuh``; the caller raises for other GPUs, ``deepseek_v4_backend.py`` lines 1324-1328)."""
    import importlib.util
    import os
    import shutil

    if importlib.util.find_spec("tvm_ffi") is None:
        return "needs apache-tvm-ffi (sglang 0.5.23 pins 0.1.11) for the JIT build and load"
    if importlib.util.find_spec("msgspec") is None:
        return "needs msgspec (SGLang's JIT build spec, kernels/jit/utils/compile/spec.py)"
    if shutil.which("ninja") is None:
        return "needs ninja on PATH (SGLang's JIT runs build.ninja)"
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = os.path.join(home, "bin", "nvcc") if home else shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        return "needs nvcc (CUDA_HOME, CUDA_PATH or PATH) for the JIT build"
    if _sglang_kernels.missing(f"{CSRC}/kernel.cuh") is not None:
        return f"the installed sglang has no {CSRC}/ ({_sglang_kernels.HINT})"
    import torch

    if torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0):
        major, minor = torch.cuda.get_device_capability()
        return f"the kernel is SM90 only; this GPU is SM{major}{minor}"
    return None


def _pool(source: Any) -> Any:
    """The 2-D ``[P, page_stride]`` byte view of a DSV4 cache that the gather reads as SGLang's pool
    (contiguous; the same bytes and storage offset). Where the last page's stride runs past the
    tensor's storage (a per-layer view of a pool shared by layers: SGLang's DSV4 pool is one tensor
    per layer), the pages' ``page_block_size * 584`` record bytes are copied into a contiguous
    ``[P, ps * 584]`` pool instead: the gather reads only those bytes of each page, so the workspace
    the kernel reads is the same either way.
    """
    import torch

    layout, cache = source.layout, source.cache
    offset = cache.storage_offset()
    if offset + layout.num_pages * layout.page_stride <= cache.untyped_storage().nbytes():
        return torch.as_strided(cache, (layout.num_pages, layout.page_stride), (layout.page_stride, 1), offset)
    record_bytes = layout.page_block_size * layout.fmt.bytes_per_token
    return torch.as_strided(cache, (layout.num_pages, record_bytes), (layout.page_stride, 1), offset).contiguous()


def combined_rows(call: Any, n_extra: int, sentinel: int) -> tuple[Any, Any]:
    """The caller's combined index rows and lengths (module docstring), on ``call.q``'s device.

    Args:
        call: the read call (``attention.call.SparseMlaCall``).
        n_extra: workspace rows of the extra cache (0 without one): the main cache's rebasing.
        sentinel: the zero row's index, which replaces every ``-1``.

    Returns:
        ``(rows [T, width] int32, lengths [T] int32)``, ``width`` the joined width rounded up to
        :data:`ROW_MULTIPLE`.
    """
    import torch

    spans = []
    if call.extra is not None:
        spans.append((call.extra, 0))
    spans.append((call.main, n_extra))
    num_tokens = call.num_tokens
    width = sum(source.topk for source, _ in spans)
    width = max(ROW_MULTIPLE, -(-width // ROW_MULTIPLE) * ROW_MULTIPLE)
    device = call.q.device
    rows = torch.full((num_tokens, width), -1, dtype=torch.int32, device=device)
    lengths = torch.zeros(num_tokens, dtype=torch.int32, device=device)
    lane = torch.arange(width, device=device)
    for source, base in spans:
        topk = source.topk
        length = source.topk_length
        length = (
            torch.full((num_tokens,), topk, dtype=torch.int64, device=device)
            if length is None
            else length.to(device=device, dtype=torch.int64).clamp(0, topk)
        )
        values = source.indices.to(device=device, dtype=torch.int64)
        values = torch.where(values >= 0, values + base, torch.full_like(values, -1))
        padded = torch.full((num_tokens, width), -1, dtype=torch.int64, device=device)
        padded[:, :topk] = values
        start = lengths.to(torch.int64)
        # lane j of this span lands at start + j for j < length (the combine kernel's in_topk / in_swa)
        src = (lane.unsqueeze(0) - start.unsqueeze(1)).clamp(0, width - 1)
        inside = (lane.unsqueeze(0) >= start.unsqueeze(1)) & (lane.unsqueeze(0) < (start + length).unsqueeze(1))
        rows = torch.where(inside, torch.gather(padded, 1, src).to(torch.int32), rows)
        lengths = (start + length).to(torch.int32)
    rows = torch.where(rows < 0, torch.full_like(rows, sentinel), rows)
    return rows, lengths


class SglangQ8Kv8Implementation(PeerAdapter):
    """Built-in ``sglang-q8kv8-sm90``: SGLang's SM90 FP8-query FP8-cache sparse MLA prefill."""

    name = "sglang-q8kv8-sm90"
    peer = "SGLang sparse_mla_q8kv8_prefill_fwd (sparse_mla_q8kv8_prefill_sm90.py, JIT)"
    envelope = ENVELOPE
    compute_mode = "fp8"
    devices: tuple[str, ...] = ("cuda",)

    def skip_reason(self, capability: str, device: str) -> str | None:
        """Why the kernel cannot run here: sglang (or a file) missing, Triton missing, not CUDA,
        executing the files fails (msgspec missing, ...), or the JIT build lacks something
        (:func:`build_reason`)."""
        for which in ("kernel", "gather"):
            reason = source_skip_reason(
                self.name, capability, device, missing=_sglang_kernels.missing(FILES[which][0]), devices=self.devices,
                load=functools.partial(load, which),
            )  # fmt: skip
            if reason is not None:
                return reason
        if capability != "sparse_mla_forward":
            return None
        reason = build_reason()
        return None if reason is None else f"{self.name} adapter: {reason}"

    def forward(self, call: PeerCall, return_fp32: bool) -> PeerResult:
        """Prepare the query, the workspace and the rows as the caller does, then run the kernel
        (module docstring).

        Returns:
            :class:`PeerResult`: the BF16 output ``[T, H, 512]`` (``o[:, :H]``), its LSE converted to
            ``lse_convention``, ``route=None``.

        Raises:
            pytest_sparse_mla.Unsupported: index rows that are not int32, or lengths that cannot be joined
                (``_peer.check_folded_lengths``):
                the adapter rebuilds both, so the kernel's own handling of them is not measured.
            ValueError: index rows or lengths on another device than ``q`` (the caller's combine kernel
                runs on the query's device; the adapter refuses rather than moves them: a bad-input test
                is then "not asked").
            Whatever the wheel's helpers or the kernel raise (``ValueError`` for arguments,
            ``RuntimeError`` for a failed JIT build).
        """
        import torch

        c = call.call
        check_folded_lengths(c)
        for source in c.sources:  # the caller's rows come from a Triton kernel on the query's device
            for tensor, name in ((source.indices, source.names[1]), (source.topk_length, source.names[2])):
                if tensor is not None and tensor.device != c.q.device:
                    raise ValueError(
                        f"{self.name} adapter: {name} is on {tensor.device}, q on {c.q.device}: SGLang's caller builds "
                        "the combined index rows with a Triton kernel on the query's device (combine_topk_swa_indices, "
                        "kernels/ops/attention/dsv4/sparse_prefill_kernels.py); the adapter does not move them"
                    )
        for source in c.sources:  # the rows are rebuilt as int32 (combined_rows): another dtype is not mapped
            if source.indices.dtype != torch.int32:
                raise Unsupported(
                    f"{self.name}: {source.names[1]}.dtype={source.indices.dtype}: SGLang's caller builds int32 "
                    "combined rows; the adapter rebuilds the rows and does not convert another dtype, so the "
                    "kernel's own handling of it is not measured"
                )
        q = c.q
        num_tokens, num_heads = int(q.shape[0]), int(q.shape[1])
        gather = load("gather")
        padded_heads = load("padded_heads")(num_heads)
        qpad = torch.empty((num_tokens, padded_heads, q.shape[2]), dtype=torch.float8_e4m3fn, device=q.device)
        q_fp8, _ = load("cast_q")(q, padded_num_heads=padded_heads, out=qpad)
        sink = None
        if c.attn_sink is not None:
            sink = torch.zeros(padded_heads, dtype=torch.float32, device=q.device)
            sink[:num_heads].copy_(c.attn_sink.reshape(-1)[:num_heads])
        identity = torch.ones((), dtype=torch.float32, device=q.device)

        n_extra = c.extra.num_slots if c.extra is not None else 0
        n_main = c.main.num_slots
        workspace = torch.empty((n_extra + n_main + 1, 1, 512), dtype=torch.float8_e4m3fn, device=q.device)
        if c.extra is not None:
            ids = torch.arange(n_extra, dtype=torch.int32, device=q.device)
            gather(_pool(c.extra), ids, page_size=c.extra.layout.page_block_size, out=workspace[:n_extra])
        ids = torch.arange(n_main, dtype=torch.int32, device=q.device)
        gather(_pool(c.main), ids, page_size=c.main.layout.page_block_size, extra_rows=1, out=workspace[n_extra:])
        rows, lengths = combined_rows(c, n_extra, workspace.shape[0] - 1)

        kwargs = {
            "q": q_fp8, "kv": workspace, "indices": rows.unsqueeze(1), "sm_scale": float(c.sm_scale),
            "q_scale": identity, "kv_scale": identity, "d_v": 512, "attn_sink": sink, "topk_length": lengths,
        }  # fmt: skip
        path, function = FILES["kernel"]
        out, _, lse = call_peer(_sglang_kernels.source_of(path, STUBS), function, load("kernel"), (), kwargs)
        lse = lse_to_convention(
            lse[:, :num_heads],
            sink_included=False,
            attn_sink=c.attn_sink,
            lse_convention=c.lse_convention,
            lse_scale=c.lse_scale,
        )
        return PeerResult(out[:, :num_heads], lse, None, f"sglang {function}")
