"""Names and constants the reference forward and the float64 oracle share (no math here).

* LSE conventions (``lse_convention=``):

  - ``"flashinfer"``: base-2 LSE of the full softmax denominator, the sink **included**, then
    multiplied by ``lse_scale`` (``math.log(2)`` gives natural log). An empty row without a sink is
    ``-inf``; with a finite sink it is ``sink * log2(e) * lse_scale``. Source: flashinfer-ai/flashinfer
    ``flashinfer/mla/_sparse_mla_sm120/_api.py`` (``run`` docstring "Final LSE uses base 2 by
    default"), ``include/.../sparse_mla_sm120/common/lse.cuh`` ``scale_output_lse``.
  - ``"flashmla"``: natural-log LSE of the candidates only, the sink **excluded**; an empty row is
    ``+inf`` ("lonely" query). ``lse_scale`` must be 1. Source: deepseek-ai/FlashMLA ``tests/ref.py``
    and ``flash_mla/flash_mla_interface.py`` (the sink has "no affect on the returned softmax_lse");
    SGLang's torch reference uses the same natural-log, sink-free LSE.

  The *output* is the same under both conventions: the sink always adds denominator mass.
* Routing: FlashInfer's SM120 planner offers decode kernels only when ``num_tokens <= 64``
  (``_DECODE_MAX_TOKENS`` in flashinfer ``mla/_sparse_mla_sm120/_policy.py``) and, without a
  calibration profile, picks decode whenever it is legal ("decode first"). The cutoff is defined
  once, in ``envelope`` (which imports neither torch nor pytest, so it cannot import this package);
  this module re-exports it (:data:`DECODE_MAX_TOKENS`, :func:`route_for`).
"""

from __future__ import annotations

import math

from pytest_sparse_mla.envelope import DECODE_MAX_TOKENS, route_of

__all__ = ["LSE_CONVENTIONS", "DECODE_MAX_TOKENS", "route_for", "check_lse_convention"]

LSE_CONVENTIONS: tuple[str, ...] = ("flashinfer", "flashmla")

#: FlashInfer's default route for ``num_tokens`` query tokens: ``"decode"`` iff ``<= 64``
#: (:data:`DECODE_MAX_TOKENS`); the envelope's :func:`~pytest_sparse_mla.envelope.route_of`.
route_for = route_of


def check_lse_convention(lse_convention: object, lse_scale: object) -> tuple[str, float]:
    """Validate ``lse_convention`` and ``lse_scale``; return them as ``(str, float)``.

    Raises:
        ValueError: unknown convention; ``lse_scale`` not a positive finite number; ``lse_scale``
            other than 1 with the ``"flashmla"`` convention (FlashMLA has no LSE scale).
        TypeError: ``lse_scale`` is not a real number.
    """
    if lse_convention not in LSE_CONVENTIONS:
        raise ValueError(
            f"lse_convention={lse_convention!r}: expected one of {LSE_CONVENTIONS} "
            "(flashinfer: log2 with the sink included; flashmla: natural log without the sink)"
        )
    if isinstance(lse_scale, bool) or not isinstance(lse_scale, (int, float)):
        raise TypeError(f"lse_scale={lse_scale!r}: expected a real number")
    scale = float(lse_scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"lse_scale={lse_scale!r}: expected a positive finite number")
    if lse_convention == "flashmla" and scale != 1.0:
        raise ValueError(
            f"lse_scale={lse_scale!r} with lse_convention='flashmla': FlashMLA's natural-log LSE "
            "has no scale; pass lse_scale=1.0"
        )
    return str(lse_convention), scale
