"""Exception types and the exact unsupported-configuration texts of each FlashInfer release.

Pure Python (no torch, no flashinfer). The classes mirror the types FlashInfer raises, so serving
code written as ``except RuntimeError`` / ``except ValueError`` behaves the same against
:func:`pytest_sparse_mla.dispatch.enforce_grid` as against the real SM120 sparse-MLA backend:

* :class:`InternalError` (a ``RuntimeError``) mirrors a failed C++ ``TVM_FFI_ICHECK*``, tvm-ffi
  error kind ``InternalError`` (apache-tvm-ffi ``include/tvm/ffi/error.h``); ``str(error)`` is the
  check text.
* :class:`UnsupportedShapeError` (a ``ValueError``) mirrors the builtin ``ValueError`` of
  FlashInfer's Python layer (``flashinfer/mla/_sparse_mla_sm120.py`` in 0.6.18 and 0.7.0,
  ``flashinfer/mla/_sparse_mla_sm120/_prepared.py`` from 0.7.1).

Both derive from :class:`SparseMlaGridError`, whose ``release`` and ``config`` carry the context.
:class:`UnsupportedReleaseError` (a ``ValueError``) is this package's own: the release has no SM120
sparse-MLA grid here. The warnings flag calls a release accepts but mishandles.

:data:`ERROR_TEMPLATES` lists every text per release family; the functions below build them, each
naming its upstream statement. Source of every text: the flashinfer-python wheels; the 0.6.18 and
0.7.x Python texts were also produced by running those releases' own code on CPU
(``scripts/flashinfer_introspect.py``). Which release prints which text, and why a C++ check
surfaces as a ``RuntimeError``: ``docs/design/flashinfer-dispatch.md``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "SparseMlaGridError",
    "InternalError",
    "UnsupportedShapeError",
    "UnsupportedReleaseError",
    "UncheckedPageSizeWarning",
    "IgnoredExtraCacheWarning",
    "FooterRecordsWarning",
    "ERROR_TEMPLATES",
    "MISMATCH_FALLBACK",
    "tvm_check_failed",
    "tvm_check_binary_failed",
    "orchestrator_decode_message",
    "orchestrator_num_heads_message",
    "prefill_unsupported_message",
    "no_decode_kernel_message",
    "no_decode_kernel_mismatch_message",
    "page_mismatch_reason",
    "num_heads_mismatch_reason",
    "metadata_tokens_heads_message",
    "public_wrapper_num_heads_message",
]


class SparseMlaGridError(Exception):
    """Base of the errors :func:`~pytest_sparse_mla.dispatch.enforce_grid` raises.

    Attributes:
        release: the FlashInfer version whose grid rejected the call (``"0.6.17"``), or ``None``.
        config: the rejected :class:`~pytest_sparse_mla.dispatch.SparseMlaConfig`, or ``None``.

    ``str(error)`` is exactly the upstream text; the attributes carry the context.
    """

    def __init__(self, message: str, release: str | None = None, config: Any = None) -> None:
        super().__init__(message)
        self.release = release
        self.config = config

    def __reduce__(self) -> tuple[Any, ...]:  # keep context across pickling (pytest-xdist)
        return (type(self), (str(self), self.release, self.config))


class InternalError(SparseMlaGridError, RuntimeError):
    """Mirror of a FlashInfer C++ ``TVM_FFI_ICHECK`` failure (tvm-ffi error kind ``InternalError``).

    Upstream Python type: ``tvm.error.InternalError`` when apache-tvm is importable, else a plain
    ``RuntimeError`` (apache-tvm-ffi maps unregistered kinds to ``RuntimeError``). Subclassing
    ``RuntimeError`` keeps ``except RuntimeError`` handlers equivalent for both.
    """

    #: tvm-ffi error kind (``TVM_FFI_ICHECK`` → ``TVM_FFI_THROW(InternalError)``).
    kind = "InternalError"


class UnsupportedShapeError(SparseMlaGridError, ValueError):
    """Mirror of the builtin ``ValueError`` FlashInfer's Python dispatch raises for a shape it
    cannot serve (0.6.18 decode-sized misses; every miss from 0.7.0 on)."""


class UnsupportedReleaseError(ValueError):
    """The FlashInfer version has no SM120 sparse-MLA grid here (before 0.6.14, a pre-release,
    or not a version at all). This package's own error, not a mirror of an upstream one."""


class UncheckedPageSizeWarning(UserWarning):
    """0.6.14-0.6.18 prefill accepts any main ``page_block_size`` without checking it although
    every prefill kernel is compiled for 64 (INFERRED: another size is silently mis-addressed)."""


class IgnoredExtraCacheWarning(UserWarning):
    """0.6.14-0.6.18 accept a DSV3.2 decode call with an extra cache and run the DSV3.2 decode
    kernel, which takes no extra cache: the extra cache is silently dropped (flashinfer
    ``mla/_sparse_mla_sm120.py`` lines 360-365 in 0.6.17, 369-374 in 0.6.18; rejected from 0.7.0)."""


class FooterRecordsWarning(UserWarning):
    """The bundled reference, under a grid of 0.7.1-0.7.2.post1, ran a DeepSeek-V4.1 call whose caches
    hold inline records (codes then scales per token); those releases read V4.1 pages in footer
    layout only (flashinfer ``include/flashinfer/attention/sparse_mla_sm120/model/dsv41_layout.cuh``:
    every token's codes, then every token's scales), so they would misread such a cache unless every
    page holds one token. 0.7.4 reads inline records (``kv_scale_format="ue8m0_g32_inline"``)."""


#: The 0.7.0+ Python ValueError (``_decode_dispatch_error_message``), the same in every 0.7.x family.
_MISMATCH_TEMPLATE = (
    "SM120 sparse-MLA has no decode kernel for this shape: num_tokens={num_tokens}, "
    "num_heads={num_heads}, topk={topk}, d_qk={d_qk}, page_block_size={page_block_size}, "
    "model_type={family}, extra_topk={topk_extra}. Mismatch: {mismatch}. The decode "
    "instantiations (num_tokens <= 64) and the prefill envelope both reject it. Query "
    "supported shapes at init time with flashinfer.mla.supported_sparse_mla_sm120_configs()."
)

#: The unsupported-configuration texts per release family: family -> ((path, upstream type, text)).
ERROR_TEMPLATES: dict[str, tuple[tuple[str, str, str], ...]] = {
    "0.6.14": (
        (
            "decode-sized miss (C++ orchestrator)",
            "tvm InternalError (RuntimeError)",
            "Check failed: num_tokens > 64 ({num_tokens} vs. 64) : Decode (num_tokens <= 64) must "
            "go through sparse_mla_sm120_decode_dsv3_2 or sparse_mla_sm120_decode_dsv4; "
            "got num_tokens={num_tokens}",
        ),
        (
            "prefill miss (C++)",
            "tvm InternalError (RuntimeError)",
            "Check failed: (ok) is false: Unsupported sparse-MLA prefill configuration: "
            "model={model} num_heads={num_heads} topk={topk} page_block_size={page_block_size} "
            "topk_extra={topk_extra} extra_page_block_size={extra_page_block_size}",
        ),
        (
            "num_heads > 128 (C++ orchestrator)",
            "tvm InternalError (RuntimeError)",
            "Check failed: num_heads <= 128 ({num_heads} vs. 128) : ",
        ),
    ),
    "0.6.18": (
        (
            "decode-sized miss (Python)",
            "ValueError",
            "SM120 sparse-MLA has no decode kernel for this shape: num_tokens={num_tokens}, "
            "num_heads={num_heads}, topk={topk}, d_qk={d_qk}, page_block_size={page_block_size}, "
            "model_type={model_type_int}, extra_topk={topk_extra}. Supported decode shapes are "
            "enumerated in _DECODE_DSV4_DISPATCH and _DECODE_DSV3_2_DISPATCH.",
        ),
        (
            "prefill miss (C++)",
            "tvm InternalError (RuntimeError)",
            "Check failed: (ok) is false: Unsupported sparse-MLA prefill configuration: "
            "model={model} num_heads={num_heads} topk={topk} page_block_size={page_block_size} "
            "topk_extra={topk_extra} extra_page_block_size={extra_page_block_size}",
        ),
        (
            "num_heads > 128, prefill-sized (C++ orchestrator)",
            "tvm InternalError (RuntimeError)",
            "Check failed: num_heads <= 128 ({num_heads} vs. 128) : ",
        ),
    ),
    "0.7.0": (
        (
            "any miss (Python planner)",
            "ValueError",
            _MISMATCH_TEMPLATE,
        ),
        (
            "dual-cache prefill with extra_page_block_size not in {2, 64} (C++)",
            "tvm InternalError (RuntimeError)",
            "Check failed: (ok) is false: Unsupported sparse-MLA prefill configuration: "
            "model={model} num_heads={num_heads} topk={topk} page_block_size={page_block_size} "
            "topk_extra={topk_extra} extra_page_block_size={extra_page_block_size} "
            "variant={variant}",
        ),
    ),
    "0.7.1": (
        (
            "any miss (Python resolver)",
            "ValueError",
            _MISMATCH_TEMPLATE,
        ),
        (
            "num_heads > 128 (C++ metadata check, re-raised by Python)",
            "ValueError",
            "Check failed: (t > 0 && h > 0 && h <= execution::DecodeMaxHeads) is false: "
            "unsupported tokens/heads",
        ),
    ),
}

#: The 0.7.x ``Mismatch:`` text when no specific reason applies.
MISMATCH_FALLBACK = "no matching decode instantiation"


def tvm_check_failed(condition: str, message: str) -> str:
    """Text of a failed ``TVM_FFI_ICHECK(condition) << message`` (apache-tvm-ffi
    ``include/tvm/ffi/error.h``, ``TVM_FFI_CHECK``): ``Check failed: (cond) is false: msg``."""
    return f"Check failed: ({condition}) is false: {message}"


def tvm_check_binary_failed(
    lhs: str, op: str, rhs: str, lhs_value: object, rhs_value: object, message: str = ""
) -> str:
    """Text of a failed ``TVM_FFI_ICHECK_<OP>(lhs, rhs) << message`` (apache-tvm-ffi
    ``TVM_FFI_CHECK_BINARY_OP``): ``Check failed: lhs op rhs (lv vs. rv) : msg``."""
    return f"Check failed: {lhs} {op} {rhs} ({lhs_value} vs. {rhs_value}) : {message}"


def orchestrator_decode_message(num_tokens: int) -> str:
    """0.6.14-0.6.17: a decode-sized call (``num_tokens <= 64``) that reached the prefill-only
    orchestrator (``TVM_FFI_ICHECK_GT(num_tokens, 64)`` in ``csrc/sparse_mla_sm120.cu``)."""
    return tvm_check_binary_failed(
        "num_tokens",
        ">",
        "64",
        num_tokens,
        64,
        "Decode (num_tokens <= 64) must go through sparse_mla_sm120_decode_dsv3_2 or "
        f"sparse_mla_sm120_decode_dsv4; got num_tokens={num_tokens}",
    )


def orchestrator_num_heads_message(num_heads: int) -> str:
    """0.6.x orchestrator ``TVM_FFI_ICHECK_LE(num_heads, 128)`` (no streamed message)."""
    return tvm_check_binary_failed("num_heads", "<=", "128", num_heads, 128)


def prefill_unsupported_message(
    model: str,
    num_heads: int,
    topk: int,
    page_block_size: int,
    topk_extra: int,
    extra_page_block_size: int,
    variant: int | None = None,
) -> str:
    """0.6.14-0.7.0 C++ prefill miss (``TVM_FFI_ICHECK(ok)`` in ``csrc/sparse_mla_sm120.cu``).

    Args:
        model: C++ model name, ``"DSV4"`` or ``"DSV3_2"``.
        variant: the planner's prefill variant (0.7.0 only: 1=SG, 2=MG, 3=MG_DUAL, 4=SWAPAB);
            ``None`` for 0.6.x, whose text has no ``variant=`` field.
    """
    text = (
        "Unsupported sparse-MLA prefill configuration: "
        f"model={model} num_heads={num_heads} topk={topk} page_block_size={page_block_size} "
        f"topk_extra={topk_extra} extra_page_block_size={extra_page_block_size}"
    )
    if variant is not None:
        text += f" variant={variant}"
    return tvm_check_failed("ok", text)


def no_decode_kernel_message(
    num_tokens: int,
    num_heads: int,
    topk: int,
    d_qk: int,
    page_block_size: int,
    model_type: int,
    topk_extra: int,
) -> str:
    """0.6.18 Python ``ValueError`` for a decode-sized miss; ``model_type`` is the integer
    (DSV3_2=0, DSV4=1), ``extra_topk`` the extra index width (0 without an extra cache)."""
    return (
        "SM120 sparse-MLA has no decode kernel for this shape: "
        f"num_tokens={num_tokens}, num_heads={num_heads}, topk={topk}, "
        f"d_qk={d_qk}, page_block_size={page_block_size}, model_type={model_type}, "
        f"extra_topk={topk_extra}. Supported decode shapes are enumerated "
        "in _DECODE_DSV4_DISPATCH and _DECODE_DSV3_2_DISPATCH."
    )


def no_decode_kernel_mismatch_message(
    num_tokens: int,
    num_heads: int,
    topk: int,
    d_qk: int,
    page_block_size: int,
    family: str,
    topk_extra: int,
    reasons: list[str] | tuple[str, ...],
) -> str:
    """0.7.0+ Python ``ValueError`` (``_decode_dispatch_error_message``): ``family`` is the name
    (``"dsv4"``, ``"dsv3_2"``); ``reasons`` are joined by ``"; "`` (empty: the fallback)."""
    detail = "; ".join(reasons) or MISMATCH_FALLBACK
    return (
        "SM120 sparse-MLA has no decode kernel for this shape: "
        f"num_tokens={num_tokens}, num_heads={num_heads}, topk={topk}, "
        f"d_qk={d_qk}, page_block_size={page_block_size}, "
        f"model_type={family}, extra_topk={topk_extra}. "
        f"Mismatch: {detail}. "
        "The decode instantiations (num_tokens <= 64) and "
        "the prefill envelope both reject it. "
        "Query supported shapes at init time with "
        "flashinfer.mla.supported_sparse_mla_sm120_configs()."
    )


def page_mismatch_reason(page_block_size: int, instantiated: int = 64) -> str:
    """0.7.0 ``Mismatch`` reason for a main page size the decode kernels lack."""
    return (
        f"page_block_size={page_block_size} is unsupported; decode kernels "
        f"are instantiated only for page_block_size={instantiated}"
    )


def num_heads_mismatch_reason(num_heads: int, max_num_heads: int = 128) -> str:
    """0.7.0+ ``Mismatch`` reason for ``num_heads`` outside ``[1, max_num_heads]``."""
    return f"num_heads={num_heads} exceeds the decode envelope [1, {max_num_heads}]"


def metadata_tokens_heads_message() -> str:
    """0.7.1+ C++ metadata check for ``num_heads > 128`` (``attention_validation.h``)."""
    return tvm_check_failed(
        "t > 0 && h > 0 && h <= execution::DecodeMaxHeads", "unsupported tokens/heads"
    )


def public_wrapper_num_heads_message(num_heads: int) -> str:
    """``flashinfer.mla.trtllm_batch_decode_sparse_mla_dsv4`` head check (every release,
    ``flashinfer/mla/_core.py``): raised as ``ValueError`` before the SM120 backend runs."""
    return (
        "Expected 8, 16, 32, 64, or 128 query heads for SM120 DSv4 sparse MLA, "
        f"got {num_heads}"
    )
