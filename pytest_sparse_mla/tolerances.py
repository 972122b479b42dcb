"""Scale-aware comparison of a sparse-MLA result with the float64 oracle, and its tolerance profiles.

A fixed ``atol`` cannot judge attention: outputs of FlashInfer's test distribution are about
0.01 to 0.05, so ``atol = 5e-2`` passes an all-zero output. Every bound here is instead scaled by
what the oracle knows about the row (``attention.oracle.ErrorScales``), and derived from the
rounding a correct kernel of the declared *compute mode* performs.

Metrics (all reported in a failure message, each with its bound)
================================================================

With ``A`` the result under test, ``E`` the oracle's float64 output, and per (token, head) row
``M = sum_j w_j |V_j|`` (elementwise), ``R = sqrt(sum_j w_j**2 ||V_j||**2)`` and
``S = max_j sm_scale * sum_d |q_d K_jd|`` (``ErrorScales``):

* **elementwise**: ``|A - E| <= (k_p u_p + N u32 + 2 ds) M + u_o |E| + tiny`` for every element.
  A rigorous worst-case bound (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.,
  section 3.1, applied to ``O = sum_j w_j V_j``):

  - ``k_p u_p M``: each probability (and each split-K partial output) is rounded to a format of
    unit roundoff ``u_p`` before ``P V``, i.e. ``w_j (1 + d_j)`` with ``|d_j| <= u_p``, ``k_p``
    times on the path (P, the partial outputs, the normaliser);
  - ``N u32 M``: fp32 accumulation of ``N`` candidates (``u32 = 2**-24``);
  - ``2 ds M`` with ``ds = (u_s + d_qk u32) S``: logit errors ``|e_j| <= ds`` move each weight to
    ``w_j e^{e_j} / sum_k w_k e^{e_k}``, within a factor ``e^{+-2 ds}`` of ``w_j``, so
    ``|dO| <= (e^{2 ds} - 1) M``, which is ``2 ds M`` for small ``ds`` (the exact form is used: FP8
    queries on wide-scale data give logit errors of several units); ``u_s`` is the relative
    rounding of the score inputs (keys dequantized to BF16 when the cache values are not exactly
    BF16 numbers, queries quantized to E4M3 in FP8 compute); ``ds`` also holds the oracle's
    ``flush_magnitude``: the products whose query or key element is a subnormal, which a
    flush-to-zero kernel drops (keys dequantized with the smallest encodable scales are such);
  - ``u_o |E|``: rounding of the result to its dtype (BF16 ``2**-8``, fp32 ``2**-24``).
    ``tiny = (N + 2) * 2**-126`` lets a kernel flush subnormals to 0 (GPU fp32 arithmetic under
    flush-to-zero): each of the ``N`` products ``w_j V_j`` below ``2**-126`` may vanish, and so may
    the result (seen on FlashMLA's SM90 decode at 64 heads on the ``wide`` distribution: an
    output of ``-5.4e-38`` returned as 0). Empty rows are held to exactly 0 by their own tests.

* **per row, normwise**: ``||A_r - E_r|| <= c_row sigma_r + ||(N u32 + e^{2 ds} - 1) M_r||`` with
  ``sigma_r**2 = (k_p (u_p R_r)**2 + (u_o ||E_r||)**2) / 3``. The statistical counterpart of the
  elementwise bound: each rounding is modelled as an independent relative error of zero mean and
  RMS at most ``u/sqrt(3)`` (uniform on ``[-u, u]``), so ``k_p`` roundings of the weights give a
  row error of RMS ``sqrt(k_p) u_p R_r / sqrt(3)`` and the output rounding ``u_o ||E_r|| / sqrt(3)``.
  ``c_row = 4`` standard deviations. It stays meaningful under cancellation
  (``||E_r|| << ||M_r||``), where a relative bound would not.
* **overall, normwise**: ``||A - E||_F <= c_all sqrt(sum_r sigma_r**2) + (worst-case terms)``,
  ``c_all = 2`` (a sum over many rows concentrates); reported as the normwise relative error
  ``||A - E|| / ||E||`` with the bound divided by ``||E||``. For a BF16 kernel this is about
  ``2 sqrt(4/3) 2**-8 ~ 9e-3``; a correct BF16 split-K kernel model measures 2.4-2.9e-3 on
  FlashInfer's test distribution and FlashMLA 2.0-2.1e-3.
* **cosine similarity** of ``A`` and ``E``: implied by the normwise bound ``e`` (the angle's sine
  is at most ``e``, so ``1 - cos <= 1 - sqrt(1 - e**2)``); reported because kernel engineers read it
  (FlashMLA's tests bound ``1 - cos`` by ``5e-6``).

The LSE is compared in **absolute natural-log units** whatever convention it is returned in
(``"flashinfer"``: ``log2 * lse_scale`` is converted with ``ln 2 / lse_scale``):
``|dlse| <= lse_abs + ds + 2**-23 |lse|`` (the last term: fp32 representation of the returned
value). ``+-inf`` (an empty row) must match exactly; NaN never passes.

Profiles and their derivation
=============================

* ``"tight"`` (compute mode ``"exact"``: pure fp32 references such as the bundled one):
  ``u_p = 2**-24``, ``k_p = 4``, ``u_s = 0``; ``lse_abs = 1e-6``. The only visible error of a BF16
  output is its final rounding. Invariants that hold bit for bit by construction are checked bit for
  bit.
* ``"kernel"`` (compute mode ``"bf16"``, production kernels such as FlashMLA's SM90 sparse decode):
  probabilities rounded to BF16 before ``P V`` (``u_p = 2**-8``), BF16 split-K partials merged in
  fp32 and one more rounding for the normaliser (``k_p = 3``), keys dequantized to BF16 before the
  dot (``u_s = 2**-8``; zero error for DSV4, whose E4M3 x UE8M0 values are exactly BF16, so
  ``u_s`` applies to DSV3.2's fp32-scaled values only). ``lse_abs = 2**-10``: the row sum is
  accumulated in fp32 by every production kernel; ``2**-10`` (0.1% of the softmax sum) is far above
  FlashMLA's measured 1.4e-6 and far below a dropped sink's ``log(1 + e**sink / Z)``. For scale:
  FlashMLA differs from the bundled reference by 2.0-2.1e-3 normwise relative (DSV4 and DSV3.2,
  T=64, H=64/128 on an H200); an all-zero output is 1.0.
* ``"kernel-fp8"`` (compute mode ``"fp8"``, FlashInfer's SM120 prefill ``FP8`` and
  ``QkBF16PvFP8`` modes): queries and probabilities quantized to E4M3 (``u_p = u_s = 2**-4``,
  applied to every format), ``k_p = 3``, ``lse_abs = 2**-10``.

Invariance checks (the same quantity computed two ways by one implementation) use the same model for
both results: ``|A - B| <= bound(A) + bound(B)``; profiles with ``bitwise_invariants`` demand bit
equality instead where the claim holds by construction.

Selection, last wins: the implementation's ``compute_mode`` (``"exact"`` -> ``tight``, ``"bf16"``
-> ``kernel``, ``"fp8"`` -> ``kernel-fp8``; default ``kernel``), its ``tolerance_profile`` attribute,
the ``profile=`` of a ``sparse_mla_tolerance`` marker, per-parameter values from the
``sparse_mla_tolerances`` ini option, then per-parameter values of the marker. Ini lines read
``PROFILE.PARAMETER = VALUE``, e.g.::

    [pytest]
    sparse_mla_tolerances =
        kernel.row_sigmas = 6
        mykernel.lse_abs = 1e-3

A profile named only in the ini starts from ``"kernel"``. Parameters: the fields of
:class:`Profile`. The marker takes ``@pytest.mark.sparse_mla_tolerance(profile="kernel", lse_abs=1e-3)``.

This module imports torch only inside functions and never imports pytest: a malformed setting raises
:class:`~pytest_sparse_mla.errors.ToleranceSpecError` (a ``ValueError``), which the plugin reports as
``pytest.UsageError`` with the same message.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from pytest_sparse_mla.errors import ToleranceSpecError

__all__ = [
    "CAUSE_KEYS",
    "COMPUTE_MODES",
    "DEFAULT_PROFILES",
    "PARAMETERS",
    "Profile",
    "SparseMlaTolerances",
    "ToleranceSpecError",
    "assert_equal",
    "compare_lse",
    "compare_output",
    "parse_ini_lines",
    "profile_for",
    "resolve",
]

INI_NAME = "sparse_mla_tolerances"
MARKER = "sparse_mla_tolerance"

#: unit roundoffs (round to nearest): BF16 has 8 significand bits, E4M3 4, fp32 24.
U_BF16 = 2.0**-8
U_E4M3 = 2.0**-4
U_FP32 = 2.0**-24
#: smallest normal fp32/BF16 magnitude doubled: a kernel may flush a subnormal result to zero.
TINY = 2.0**-125
#: smallest normal fp32/BF16 magnitude: what one flush-to-zero of a subnormal product can lose.
FTZ = 2.0**-126

#: ``compute_mode`` an implementation may declare -> the profile it is judged by.
COMPUTE_MODES: dict[str, str] = {"exact": "tight", "bf16": "kernel", "fp8": "kernel-fp8"}


@dataclass(frozen=True)
class Profile:
    """The rounding model of one compute mode (see the module docstring for the derivation).

    Attributes:
        name: profile name.
        p_unit_roundoff: ``u_p``, unit roundoff of the probabilities / partial outputs fed to ``P V``.
        p_roundings: ``k_p``, how many such roundings a result carries.
        score_unit_roundoff: ``u_s``, relative rounding of each product of the score's dot product.
        score_rounding_on_bf16_exact: whether ``u_s`` also applies to formats whose cache values
            are exactly BF16 (DSV4): true when queries are quantized (FP8 compute).
        row_sigmas: ``c_row``, standard deviations allowed per (token, head) row.
        overall_sigmas: ``c_all``, standard deviations allowed over the whole tensor (the sum of
            many independent rows concentrates, so fewer are needed).
        lse_abs: absolute LSE bound in natural-log units (before the score-error term).
        bitwise_invariants: whether by-construction invariants must hold bit for bit.
        query_abs_floor: ``a``, the absolute rounding error of a NoPE query element where the
            compute mode quantizes queries with a scale floor (FP8: FlashInfer's ``quantize_q_to_smem``
            floors the group amax at ``1e-4``, so the E4M3 scale is at least ``2**-21`` and a query
            element is off by up to half a subnormal step, ``2**-31``); the logit error gains
            ``a * max_j |sm_scale| sum_d |K_jd|``. 0 for compute modes that keep BF16 queries.
    """

    name: str
    p_unit_roundoff: float
    p_roundings: float
    score_unit_roundoff: float
    score_rounding_on_bf16_exact: bool
    row_sigmas: float
    overall_sigmas: float
    lse_abs: float
    bitwise_invariants: bool = False
    query_abs_floor: float = 0.0


#: the tunable parameters (ini / marker keys).
PARAMETERS: tuple[str, ...] = tuple(f.name for f in fields(Profile) if f.name != "name")

DEFAULT_PROFILES: dict[str, Profile] = {
    "tight": Profile("tight", U_FP32, 4, 0.0, False, 4.0, 2.0, 1e-6, bitwise_invariants=True),
    "kernel": Profile("kernel", U_BF16, 3, U_BF16, False, 4.0, 2.0, 2.0**-10),
    "kernel-fp8": Profile("kernel-fp8", U_E4M3, 3, U_E4M3, True, 4.0, 2.0, 2.0**-10, query_abs_floor=2.0**-31),
}


def profile_for(impl: Any) -> str:
    """The profile ``impl`` is judged by: its ``tolerance_profile`` if set, else the profile of its
    ``compute_mode`` (:data:`COMPUTE_MODES`), else ``"kernel"``.

    Raises:
        ToleranceSpecError: an unknown ``compute_mode``.
    """
    explicit = getattr(impl, "tolerance_profile", None)
    if isinstance(explicit, str) and explicit:
        return explicit
    mode = getattr(impl, "compute_mode", None)
    if mode is None:
        return "kernel"
    if mode not in COMPUTE_MODES:
        raise ToleranceSpecError(f"implementation compute_mode={mode!r}: expected one of {', '.join(COMPUTE_MODES)}")
    return COMPUTE_MODES[mode]


# --- comparison -----------------------------------------------------------------------------------


def _unit_roundoff(dtype: Any) -> float:
    import torch

    return {torch.bfloat16: U_BF16, torch.float16: 2.0**-11, torch.float32: U_FP32}.get(dtype, 0.0)


def _fmt_bf16_exact(fmt: Any) -> bool:
    from pytest_sparse_mla import formats

    return bool(formats.get_format(fmt).bf16_exact)


def _d_qk(fmt: Any) -> int:
    from pytest_sparse_mla import formats

    return int(formats.get_format(fmt).d_qk)


def _score_error(
    profile: Profile, fmt: Any, score_magnitude: Any, key_magnitude: Any = None, flush_magnitude: Any = None
) -> Any:  # fmt: skip
    """``ds`` per row: the worst-case logit error in natural-log units (relative rounding of each
    product, plus the query quantization floor times the key magnitude where the profile has one,
    plus the products of subnormal operands a flush-to-zero kernel drops: the oracle's
    ``flush_magnitude``)."""
    u_s = profile.score_unit_roundoff
    if _fmt_bf16_exact(fmt) and not profile.score_rounding_on_bf16_exact:
        u_s = 0.0
    ds = (u_s + _d_qk(fmt) * U_FP32) * score_magnitude
    if profile.query_abs_floor and key_magnitude is not None:
        ds = ds + profile.query_abs_floor * key_magnitude
    if flush_magnitude is not None:
        ds = ds + flush_magnitude
    return ds


@dataclass(frozen=True)
class _Scales:
    abs_weighted: Any  # [T, H, D]
    rms_weighted: Any  # [T, H]
    score_magnitude: Any  # [T, H]
    max_candidates: int
    from_oracle: bool
    key_magnitude: Any = None  # [T, H] or None
    value_max: Any = None  # [T, H] or None
    flush_magnitude: Any = None  # [T, H] or None


def _check_shape(what: str, name: str, got: Any, want: tuple[int, ...]) -> None:
    """Raise a :class:`ValueError` naming ``what``'s ``name`` and both shapes unless ``got`` has ``want``."""
    if tuple(got) != tuple(want):
        raise ValueError(
            f"{what}: {name} has shape {list(got)}, expected {list(want)} (the shapes of the compared tensors and of "
            "the oracle's ErrorScales must agree: output [num_tokens, num_heads, d_v], LSE [num_tokens, num_heads])"
        )


def _check_scales(what: str, expected_shape: tuple[int, ...], given: Any) -> None:
    """The oracle's ``ErrorScales`` describe the rows of ``expected_shape`` (``[T, H, d_v]``):
    ``abs_weighted`` of that shape, the per-row scales ``[T, H]``.

    Raises:
        ValueError: a scale of another shape (names it and both shapes).
    """
    if given is None:
        return
    rows = tuple(expected_shape[:-1])
    _check_shape(what, "scales.abs_weighted", given.abs_weighted.shape, tuple(expected_shape))
    if getattr(given, "slot0_output", None) is not None:
        _check_shape(what, "scales.slot0_output", given.slot0_output.shape, tuple(expected_shape))
    for name in ("rms_weighted", "score_magnitude", "key_magnitude", "value_max", "slot0_weight"):
        value = getattr(given, name, None)
        if value is not None:
            _check_shape(what, f"scales.{name}", value.shape, rows)


def _scales_of(expected: Any, given: Any, what: str = "output") -> _Scales:
    """The oracle's error scales, or, for a bare expected tensor, the row's own magnitude
    (``M = max_d |E_rd|`` broadcast, ``R = ||E_r||``; no score term).

    Raises:
        ValueError: scales whose shapes are not those of ``expected``'s rows (:func:`_check_scales`).
    """
    import torch

    _check_scales(what, tuple(expected.shape), given)
    if given is not None:
        return _Scales(
            given.abs_weighted.to(torch.float64), given.rms_weighted.to(torch.float64),
            given.score_magnitude.to(torch.float64), int(given.max_candidates), True,
            None if getattr(given, "key_magnitude", None) is None else given.key_magnitude.to(torch.float64),
            None if getattr(given, "value_max", None) is None else given.value_max.to(torch.float64),
            None if getattr(given, "flush_magnitude", None) is None else given.flush_magnitude.to(torch.float64),
        )  # fmt: skip
    e = expected
    row_max = e.abs().amax(dim=-1, keepdim=True).expand_as(e)
    return _Scales(row_max, torch.linalg.vector_norm(e, dim=-1), torch.zeros(e.shape[:-1], dtype=e.dtype,
                   device=e.device), 4096, False)  # fmt: skip


def _where(index: tuple[int, ...], num_tokens: int) -> str:
    t, h = index[0], index[1]
    route = "decode" if num_tokens <= 64 else "prefill"
    return f"token {t}, head {h} ({route} call, T={num_tokens})"


@dataclass
class ComparisonReport:
    """The metrics of one comparison and the violations found (``ok`` when there are none).

    Attributes:
        what: the quantity's label.
        lines: the metrics in force.
        violations: each violated metric with its bound.
        causes: ``(key, text)`` of each likely cause (``diagnosis.cause_line``: the key is stable
            across calls, the text carries this call's numbers), most specific first.
    """

    what: str
    lines: list[str]
    violations: list[str]
    causes: list[tuple[str, str]]

    @property
    def ok(self) -> bool:
        """No violation."""
        return not self.violations

    def message(self) -> str:
        """The failure text: the quantity, each violated metric with its bound, the metrics in
        force, and one ``likely cause [KEY]: ...`` line per likely cause."""
        from pytest_sparse_mla.diagnosis import cause_line

        text = [f"{self.what}: {len(self.violations)} check(s) failed"]
        text += [f"  FAIL {v}" for v in self.violations]
        text += [f"  {line}" for line in self.lines]
        text += [f"  {cause_line(key, words)}" for key, words in self.causes]
        return "\n".join(text)


#: The cause keys this module names (``diagnosis``): each, the bug it points to.
CAUSE_KEYS: dict[str, str] = {
    "nan-or-inf-read": "non-finite values: NaN/Inf read from masked or unreferenced rows, or an overflow",
    "output-not-written": "the output is all zero where the oracle's is not",
    "index-0-treated-as-invalid": "exactly the rows that read index value 0 are wrong: 0 taken for the mask sentinel",
    "sink-or-normaliser": "a per-head factor (output) or offset (LSE): the sink or the softmax normaliser",
    "prefill-path": "only tokens past 64 are wrong: the prefill route or its token tiling",
    "head-grouping": "only a trailing group of heads is wrong: head grouping or the index row a group reads",
    "token-tiling-or-batch-stride": "only a trailing run of tokens is wrong, after a right one",
    "lse-natural-log-for-log2": "the LSE is off by ln 2: natural log returned where log2 is the convention",
    "lse-log2-for-natural-log": "the LSE is off by 1/ln 2: log2 returned where natural log is the convention",
    "lse_scale-applied-wrongly": "the LSE is off by lse_scale or its inverse",
    "empty-row-sentinel": "infinite where finite, or the reverse: the empty-row LSE sentinel",
}


def _slot0_rows(scales: Any, shape: tuple[int, ...]) -> Any:
    """``[T, H]`` bool: the rows whose valid lanes include index value 0 with a nonzero weight (the
    oracle's ``ErrorScales.slot0_weight``), or ``None`` when the scales do not say."""
    weight = getattr(scales, "slot0_weight", None)
    if weight is None or tuple(weight.shape) != tuple(shape):
        return None
    return weight > 0


_SLOT0_WORDS = (
    "index 0 taken for the mask sentinel (a validity test `index > 0` where `index >= 0` is meant, or 0 used as "
    "the 'no candidate' value)?"
)


def _slot0_cause(bad: Any, reads0: Any, nonzero: Any, matches: Any = None) -> tuple[str, str] | None:
    """The index-0 cause when every wrong row reads index value 0 and either the wrong rows match the
    oracle's output with those lanes masked (``matches``: ``[T, H]`` bool or ``None``), or a row with a
    nonzero expectation that reads no index 0 came out right (the rows are told apart by index 0)."""
    if reads0 is None or not bool(bad.any()) or not bool(reads0[bad].all()):
        return None
    n_bad, n_reads = int(bad.sum()), int((reads0 & nonzero).sum())
    if matches is not None and bool(matches[bad].all()):
        return (
            "index-0-treated-as-invalid",
            f"the {n_bad} wrong (token, head) rows all read index value 0 and match the oracle's output with every "
            f"lane of index 0 masked: {_SLOT0_WORDS}",
        )
    if not bool((~reads0 & nonzero & ~bad).any()):
        return None
    return (
        "index-0-treated-as-invalid",
        f"every wrong row reads index value 0 ({n_bad} wrong of {n_reads} (token, head) rows that read it; every "
        f"row that reads no index 0 is right): {_SLOT0_WORDS}",
    )


def _slot0_matches(a: Any, e: Any, scales: Any, row_bound: Any) -> Any:
    """``[T, H]`` bool: rows where ``a`` lies within ``row_bound`` and within half its error against
    ``e`` (a row index 0 barely moves matches neither way) of the oracle's output with every lane of
    index value 0 masked,
    ``(E - slot0_output) / (1 - slot0_weight)`` (0 where those were all the row's weight); ``None``
    when the scales do not carry it."""
    import torch

    w0 = getattr(scales, "slot0_weight", None)
    s0 = getattr(scales, "slot0_output", None)
    if w0 is None or s0 is None or tuple(s0.shape) != tuple(e.shape):
        return None
    w0 = w0.to(torch.float64)
    rest = (1.0 - w0).unsqueeze(-1)
    masked = torch.where(rest > 1e-12, (e - s0.to(torch.float64)) / rest.clamp_min(1e-12), torch.zeros_like(e))
    off = torch.linalg.vector_norm(a - masked, dim=-1)
    return off <= torch.minimum(row_bound, 0.5 * torch.linalg.vector_norm(a - e, dim=-1))


def _output_causes(
    a: Any,
    e: Any,
    row_err: Any,
    row_bound: Any,
    num_tokens: int,
    elem_rows: Any = None,
    reads0: Any = None,
    slot0_matches: Any = None,
) -> list[tuple[str, str]]:
    """Heuristics naming the likely bug behind an output mismatch (``(key, text)``, ``CAUSE_KEYS``).

    Args:
        a, e: ``[T, H, D]`` float64 result and expectation.
        row_err, row_bound: ``[T, H]`` each row's normwise error and bound.
        elem_rows: ``[T, H]`` rows with an element past its elementwise bound (or ``None``): wrong
            rows too, when no row's norm is past its bound.
        reads0: ``[T, H]`` rows that read index value 0 (:func:`_slot0_rows`), or ``None``.
        slot0_matches: ``[T, H]`` rows that match the oracle with index 0 masked (:func:`_slot0_matches`).
    """
    import torch

    causes: list[tuple[str, str]] = []
    if not bool(torch.isfinite(a).all()):
        causes.append(("nan-or-inf-read", "non-finite values in the output (NaN/Inf read from masked or "
                       "unreferenced rows?)"))  # fmt: skip
        return causes
    bad = row_err > row_bound  # [T, H]
    if elem_rows is not None:
        bad = bad | elem_rows
    nonzero = e.abs().amax(dim=-1) > 0  # [T, H]
    slot0 = _slot0_cause(bad, reads0, nonzero, slot0_matches)
    if slot0 is not None:  # the rows are told apart by their index values: the other patterns would mislead
        return [slot0]
    if float(a.abs().max()) == 0.0 and float(e.abs().max()) > 0.0:
        causes.append(("output-not-written", "the output is all zero"))
        return causes
    if bool(bad.any()):
        # A per-head constant factor: A ~= c_h E with c_h != 1, the fit explaining the error (each
        # head's rows parallel to the oracle's: cosine above 0.9999).
        num = (a * e).sum(dim=(0, 2))
        den = (e * e).sum(dim=(0, 2)).clamp_min(1e-300)
        c = num / den
        norms = (torch.linalg.vector_norm(a, dim=(0, 2)) * den.sqrt()).clamp_min(1e-300)
        cos_h = num / norms
        heads_bad = bad.any(dim=0)
        if bool((cos_h[heads_bad] > 0.9999).all()):
            off = [(h, float(c[h])) for h in range(c.numel()) if bool(heads_bad[h]) and abs(float(c[h]) - 1.0) > 1e-3]
            if off:
                causes.append((
                    "sink-or-normaliser",
                    "the output is off by a per-head constant factor ("
                    + ", ".join(f"head {h}: x{v:.4g}" for h, v in off[:6])
                    + "): a sink or normaliser applied wrongly, or a scale applied to one cache's candidates "
                    "(the invariance tests that move candidates between the caches tell which)?",
                ))  # fmt: skip
        if not causes:
            # Each wrong row the oracle's row times its own factor (cosine above 0.9999 row by row, the
            # factor varying with the token): the candidates' relative weights are right, their sum is not.
            rows = bad & nonzero
            num_r = (a * e).sum(dim=-1)[rows]
            den_r = (e * e).sum(dim=-1)[rows]
            cos_r = num_r / (torch.linalg.vector_norm(a, dim=-1)[rows] * den_r.sqrt()).clamp_min(1e-300)
            factors = num_r / den_r.clamp_min(1e-300)
            if bool(rows.any()) and bool((cos_r > 0.9999).all()) and bool(((factors - 1.0).abs() > 1e-3).all()):
                causes.append((
                    "sink-or-normaliser",
                    f"each wrong row is the oracle's row times a factor of its own (x{float(factors.min()):.4g} to "
                    f"x{float(factors.max()):.4g} over {int(rows.sum())} (token, head) rows): the candidates' relative "
                    "weights are right and their normaliser is not (a sink dropped or applied wrongly, or a wrong "
                    "softmax denominator)?",
                ))  # fmt: skip
        token_bad = bad.any(dim=1)
        tokens = token_bad.nonzero().flatten().tolist()
        heads = heads_bad.nonzero().flatten().tolist()
        num_heads = int(a.shape[1])
        # A token whose expected output is zero (an empty row) cannot show a bug: "only tokens from k
        # on are wrong" needs a token before k with a nonzero expected output that came out right.
        right = (e.abs().amax(dim=(1, 2)) > 0) & ~token_bad

        def right_before(k: int) -> bool:
            return bool(right[:k].any())

        if tokens and min(tokens) >= 64 and num_tokens > 64 and right_before(64):
            causes.append(("prefill-path", f"only tokens past 64 are wrong (first {min(tokens)}): the prefill "
                           "path / token tiling?"))  # fmt: skip
        contiguous = heads and heads == list(range(heads[0], heads[-1] + 1))
        if contiguous and heads[0] > 0 and heads[0] % 8 == 0 and heads[-1] == num_heads - 1:
            causes.append((
                "head-grouping",
                f"only heads {heads[0]}..{heads[-1]} of {num_heads} are wrong: head grouping, or the index row "
                "a head group reads?",
            ))  # fmt: skip
        if tokens and tokens == list(range(tokens[0], num_tokens)) and tokens[0] > 0 and right_before(tokens[0]):
            causes.append(("token-tiling-or-batch-stride", f"tokens {tokens[0]}..{num_tokens - 1} are wrong: token "
                           "tiling or batch stride?"))  # fmt: skip
    return causes


def output_bound(
    expected: Any,
    *,
    profile: Profile,
    fmt: Any = "dsv4",
    scales: Any = None,
    output_dtype: Any = None,
    other_dtype: Any = None,
) -> Any:
    """The elementwise bound of :func:`compare_output`: ``[T, H, D]`` float64.

    ``factor * ((p_roundings*u_p + N*2**-24 + e^(2 ds) - 1) * sum_j w_j|V_j| + u_o*|E| + (N+2)*2**-126)``
    with ``factor`` 2 when ``other_dtype`` is given (two results of one implementation compared),
    ``u_o`` the unit roundoff of ``output_dtype`` (of the wider of the two with ``other_dtype``).

    Args:
        expected: ``[T, H, D]`` (or ``[T, D]``) the oracle's float64 output.
        profile, fmt, scales: as :func:`compare_output`.
        output_dtype: the dtype of the result judged (``None``: BF16).

    Raises:
        ValueError: ``scales`` describe other rows than ``expected`` (names the scale and both shapes).
    """
    import torch

    e = expected.to(torch.float64)
    if e.dim() == 2:
        e = e.unsqueeze(1)
    sc = _scales_of(e, scales)
    u_o = _unit_roundoff(output_dtype if output_dtype is not None else torch.bfloat16)
    if other_dtype is not None:
        u_o = max(u_o, _unit_roundoff(other_dtype))
    ds = (_score_error(profile, fmt, sc.score_magnitude, sc.key_magnitude, sc.flush_magnitude) if sc.from_oracle
          else torch.zeros_like(sc.rms_weighted))  # fmt: skip
    factor = 2.0 if other_dtype is not None else 1.0
    m_coef = profile.p_roundings * profile.p_unit_roundoff + sc.max_candidates * U_FP32  # scalar
    worst = (m_coef + torch.expm1(2.0 * ds)).unsqueeze(-1) * sc.abs_weighted  # [T, H, D]
    flushed = _flushed(sc)  # every product w_j V_j and the result may flush to zero, every weight too
    return factor * (worst + u_o * e.abs() + flushed)


def _flushed(sc: _Scales) -> Any:
    """``(N+2) * 2**-126 * (1 + max_j |V_j|)`` per row, ``[T, H, 1]``: products ``w_j V_j`` and the
    result flushing to zero, and each weight ``w_j`` itself (a row whose sink or top candidate
    dominates the others by more than 87 natural-log units: ``exp`` underflows in fp32)."""
    import torch

    if sc.value_max is None:
        return torch.full_like(sc.rms_weighted, (sc.max_candidates + 2) * FTZ).unsqueeze(-1)
    return ((sc.max_candidates + 2) * FTZ * (1.0 + sc.value_max)).unsqueeze(-1)


def compare_output(
    actual: Any,
    expected: Any,
    *,
    profile: Profile,
    fmt: Any = "dsv4",
    scales: Any = None,
    pair: bool = False,
    what: str = "output",
) -> ComparisonReport:
    """Compare an output with the oracle's (or, ``pair=True``, with another result of one
    implementation) under ``profile``'s rounding model.

    Args:
        actual: ``[T, H, d_v]`` BF16 or fp32 result under test.
        expected: ``[T, H, d_v]`` the oracle's float64 output (or the other result when ``pair``).
        profile: the :class:`Profile` in force.
        fmt: the cache format (``"dsv4"`` / ``"dsv3_2"``): whether keys are exactly BF16.
        scales: the oracle's ``ErrorScales`` for these rows (``None``: the row magnitudes stand in).
        pair: both sides carry the implementation's error, so every bound is doubled.
        what: the label naming the quantity in the message.

    Returns:
        a :class:`ComparisonReport` (``.ok``, ``.message()``).

    Raises:
        ValueError: before any arithmetic, the result's shape is not the expected one, or the
            oracle's scales describe other rows (the message names the tensor and both shapes).
    """
    import torch

    _check_shape(what, "the result", actual.shape, tuple(expected.shape))
    if actual.numel() == 0:  # num_tokens = 0: nothing to compare, nothing wrong
        return ComparisonReport(what, [f"{what}: no elements (num_tokens = 0)"], [], [])
    _check_scales(what, tuple(expected.shape) if expected.dim() == 3 else (expected.shape[0], 1, expected.shape[-1]),
                  scales)  # fmt: skip
    a = actual.to(torch.float64)
    e = expected.to(torch.float64)
    if a.dim() == 2:  # [T, D] -> one head
        a, e = a.unsqueeze(1), e.unsqueeze(1)
    sc = _scales_of(e, scales)
    u_o = _unit_roundoff(actual.dtype)
    if pair:
        u_o = max(u_o, _unit_roundoff(expected.dtype))
    ds = (_score_error(profile, fmt, sc.score_magnitude, sc.key_magnitude, sc.flush_magnitude) if sc.from_oracle
          else torch.zeros_like(sc.rms_weighted))  # fmt: skip
    factor = 2.0 if pair else 1.0
    score_term = torch.expm1(2.0 * ds)  # (e^{2 ds} - 1): the weights' worst relative change
    elem_bound = output_bound(e, profile=profile, fmt=fmt, scales=scales, output_dtype=actual.dtype,
                              other_dtype=expected.dtype if pair else None)  # fmt: skip
    diff = (a - e).abs()
    finite = torch.isfinite(a)
    diff = torch.where(finite, diff, torch.full_like(diff, math.inf))
    num_tokens = int(a.shape[0])
    violations: list[str] = []
    lines: list[str] = []

    nonfinite = int((~finite).sum())
    if nonfinite:
        first = tuple((~finite).nonzero()[0].tolist())
        violations.append(f"{nonfinite} non-finite element(s); first at {_where(first, num_tokens)}, dim {first[2]}")

    over = diff > elem_bound
    n_over = int(over.sum())
    lines.append(
        f"elementwise: |A - E| <= {factor:g} * (({profile.p_roundings:g}*u_p + N*2**-24 + e^(2ds)-1) * sum_j w_j|V_j| "
        f"+ u_o*|E|), u_p={profile.p_unit_roundoff:.3g}, u_o={u_o:.3g}, N={sc.max_candidates}"
        + ("" if sc.from_oracle else " (no oracle scales: the row's max |E| stands in for sum_j w_j|V_j|)")
    )
    if n_over and not nonfinite:
        ratio = torch.where(over, diff / elem_bound, torch.zeros_like(diff))
        idx = tuple(int(i) for i in torch.unravel_index(ratio.argmax(), ratio.shape))
        violations.append(
            f"elementwise: {n_over} of {diff.numel()} elements exceed their bound; worst at "
            f"{_where(idx, num_tokens)}, dim {idx[2]}: actual {float(a[idx]):.6g}, expected {float(e[idx]):.6g}, "
            f"|diff| {float(diff[idx]):.3g} > bound {float(elem_bound[idx]):.3g}"
        )

    # Per row (statistical model) and overall.
    err2 = ((a - e) ** 2).sum(dim=-1)
    row_err = err2.sqrt()
    e_norm = torch.linalg.vector_norm(e, dim=-1)
    # RMS of the rounding errors of a row: independent roundings of RMS u/sqrt(3) each.
    rms2 = (profile.p_roundings * (profile.p_unit_roundoff * sc.rms_weighted) ** 2 + (u_o * e_norm) ** 2) / 3.0
    worst_row = torch.linalg.vector_norm(
        (sc.max_candidates * U_FP32 + score_term).unsqueeze(-1) * sc.abs_weighted, dim=-1
    )
    flushed_row = _flushed(sc)[..., 0] * math.sqrt(e.shape[-1])
    row_bound = factor * (profile.row_sigmas * rms2.sqrt() + worst_row + flushed_row) + TINY
    row_rel = row_err / e_norm.clamp_min(1e-300)
    bad_rows = row_err > row_bound
    if not nonfinite:
        n_bad = int(bad_rows.sum())
        lines.append(
            f"per row: ||A_r - E_r|| <= {factor:g} * ({profile.row_sigmas:g} * sqrt(({profile.p_roundings:g}*"
            f"(u_p*sqrt(sum_j w_j^2 ||V_j||^2))^2 + (u_o*||E_r||)^2)/3) + worst-case score/accumulation terms); "
            f"largest normwise relative error {float(row_rel.max()):.3g}"
        )
        if n_bad:  # the worst row's index only here: torch.unravel_index imports sympy on its first call (0.2 s)
            ratio = torch.where(bad_rows, row_err / row_bound, torch.zeros_like(row_err))
            idx = tuple(int(i) for i in torch.unravel_index(ratio.argmax(), ratio.shape))
            violations.append(
                f"per-row normwise: {n_bad} of {bad_rows.numel()} (token, head) rows exceed their bound; worst at "
                f"{_where(idx, num_tokens)}: ||A_r - E_r|| = {float(row_err[idx]):.3g} > {float(row_bound[idx]):.3g} "
                f"(normwise relative {float(row_rel[idx]):.3g}, ||E_r|| = {float(e_norm[idx]):.3g})"
            )
        total_err = float(err2.sum().sqrt())
        total_norm = float(e_norm.pow(2).sum().sqrt())
        worst_total = float(worst_row.pow(2).sum().sqrt())
        flushed_total = float(flushed_row.pow(2).sum().sqrt())  # the rows' flush terms, as the per-row bound has them
        total_bound = factor * (profile.overall_sigmas * float(rms2.sum().sqrt()) + worst_total + flushed_total) + TINY
        if total_norm > 0:
            rel, rel_bound = total_err / total_norm, total_bound / total_norm
            cos = float((a * e).sum() / (torch.linalg.vector_norm(a) * total_norm).clamp_min(1e-300))
            cos_bound = 1.0 - math.sqrt(max(0.0, 1.0 - min(rel_bound, 1.0) ** 2))
            lines.append(
                f"overall: normwise relative error {rel:.3g} (bound {rel_bound:.3g}); cosine similarity "
                f"{cos:.8f} (1 - cos = {1.0 - cos:.3g}, bound {cos_bound:.3g})"
            )
            if total_err > total_bound:
                violations.append(f"overall normwise relative error {rel:.3g} > {rel_bound:.3g}")
            if 1.0 - cos > cos_bound:
                violations.append(f"cosine similarity {cos:.8f}: 1 - cos = {1.0 - cos:.3g} > {cos_bound:.3g}")
    causes: list[tuple[str, str]] = []
    if violations:
        reads0 = _slot0_rows(scales, tuple(e.shape[:2]))
        matches = _slot0_matches(a, e, scales, row_bound)  # against the other result when ``pair``
        causes = _output_causes(a, e, row_err, row_bound, num_tokens, over.any(dim=-1), reads0, matches)
    return ComparisonReport(what, lines, violations, causes)


def _to_natural(lse: Any, convention: str, lse_scale: float) -> Any:
    """An LSE in ``convention`` units -> natural-log units (float64)."""
    import torch

    x = lse.to(torch.float64)
    return x if convention == "flashmla" else x * (math.log(2.0) / lse_scale)


def _lse_causes(
    a: Any,
    e: Any,
    bad: Any,
    convention: str,
    lse_scale: float,
    num_tokens: int,
    reads0: Any = None,
    slot0_matches: Any = None,
) -> list[tuple[str, str]]:
    """Heuristics naming the likely bug behind an LSE mismatch (``(key, text)``, ``CAUSE_KEYS``);
    ``reads0``: ``[T, H]`` rows that read index value 0 (:func:`_slot0_rows`), or ``None``;
    ``slot0_matches``: rows that match the LSE with those lanes masked (:func:`_slot0_lse_matches`)."""
    import torch

    causes: list[tuple[str, str]] = []
    slot0 = _slot0_cause(bad, reads0, torch.isfinite(e), slot0_matches) if bool(bad.any()) else None
    if slot0 is not None:  # the rows are told apart by their index values: the other patterns would mislead
        return [slot0]
    both = torch.isfinite(a) & torch.isfinite(e) & (e.abs() > 1e-3)
    if bool(both.any()):
        ratio = (a[both] / e[both]).median()
        for value, key, text in (
            (math.log(2.0), "lse-natural-log-for-log2",
             "the LSE is in natural-log units where log2 was expected (or the reverse): off by ln 2"),
            (1.0 / math.log(2.0), "lse-log2-for-natural-log",
             "the LSE is in log2 units where natural log was expected: off by 1/ln 2"),
        ):  # fmt: skip
            if abs(float(ratio) - value) < 1e-2 * value:
                causes.append((key, text))
        if convention == "flashinfer" and lse_scale != 1.0:
            for value in (lse_scale, 1.0 / lse_scale):
                if abs(float(ratio) - value) < 1e-2 * value:
                    words = f"lse_scale={lse_scale:g} applied wrongly (off by a factor {value:.4g})"
                    causes.append(("lse_scale-applied-wrongly", words))
    if bool(bad.any()):
        d = torch.where(torch.isfinite(a) & torch.isfinite(e), a - e, torch.zeros_like(a))
        per_head = d.median(dim=0).values
        resid = (d - per_head).abs()
        if num_tokens >= 2 and float(resid[bad].max()) < 1e-3 and float(per_head.abs().max()) > 1e-3:
            causes.append(("sink-or-normaliser", "a per-head constant offset (the sink included or excluded wrongly?)"))
        tokens = bad.any(dim=1).nonzero().flatten().tolist()
        if tokens and min(tokens) >= 64 and num_tokens > 64:
            causes.append(("prefill-path", "only tokens past 64 are wrong: the prefill path?"))
        flipped = torch.isinf(a) != torch.isinf(e)
        lost = flipped & torch.isneginf(a) & torch.isfinite(e)  # -inf returned where the oracle's LSE is finite
        if convention == "flashinfer" and bool(lost[bad].any()) and not bool((flipped & ~lost)[bad].any()):
            causes.append((
                "sink-or-normaliser",
                f"the LSE is -inf where the oracle's is finite ({int((lost & bad).sum())} rows): in the FlashInfer "
                "convention the sink is part of the LSE, and a row without a valid lane has the sink as its LSE, so "
                "the sink is missing from those rows (dropped, or an empty-row -inf written over it)?",
            ))  # fmt: skip
        elif bool(flipped[bad].any()):
            causes.append(("empty-row-sentinel", "infinite where finite (or the reverse): the empty-row sentinel "
                           "(-inf, +inf or the sink)?"))  # fmt: skip
    return causes


def _slot0_lse_matches(a: Any, e: Any, scales: Any, bound: Any, convention: str) -> Any:
    """``[T, H]`` bool: rows where the natural-log LSE ``a`` lies within ``bound`` of the LSE with every
    lane of index value 0 masked, ``e + log(1 - slot0_weight)`` (the FlashInfer convention only: its
    denominator holds the sink, as ``slot0_weight``'s does); ``None`` otherwise."""
    import torch

    w0 = getattr(scales, "slot0_weight", None)
    if convention != "flashinfer" or w0 is None or math.prod(w0.shape) != math.prod(a.shape):
        return None
    rest = (1.0 - w0.to(torch.float64).reshape(a.shape)).clamp_min(0.0)
    masked = e + torch.log(rest)  # -inf where index 0 held the whole row
    same_inf = torch.isinf(a) & torch.isinf(masked) & (torch.sign(a) == torch.sign(masked))
    return same_inf | ((a - masked).abs() <= bound)


def _check_lse_scales(what: str, lse_shape: tuple[int, ...], scales: Any) -> None:
    """The oracle's per-row scales cover the LSE's rows (``[T, H]``, or ``[T]`` for one head).

    Raises:
        ValueError: a per-row scale with another number of rows (names it and both shapes).
    """
    if scales is None:
        return
    rows = math.prod(lse_shape)
    for name in ("score_magnitude", "key_magnitude"):
        value = getattr(scales, name, None)
        if value is not None and math.prod(value.shape) != rows:
            _check_shape(what, f"scales.{name}", value.shape, lse_shape)


def lse_bound(natural: Any, *, profile: Profile, fmt: Any = "dsv4", scales: Any = None, pair: bool = False) -> Any:
    """The bound of :func:`compare_lse` for an oracle LSE ``natural`` (``[T, H]``, natural-log units):
    ``factor * (lse_abs + ds + 2**-23 |lse|)`` natural-log units, ``factor`` 2 with ``pair``.

    Raises:
        ValueError: ``scales`` describe another number of rows (names the scale and both shapes).
    """
    import torch

    e = natural.to(torch.float64)
    ds = torch.zeros_like(e)
    _check_lse_scales("lse", tuple(e.shape), scales)
    if scales is not None:
        keys = getattr(scales, "key_magnitude", None)
        keys = None if keys is None else keys.to(torch.float64).reshape(e.shape)
        flush = getattr(scales, "flush_magnitude", None)
        flush = None if flush is None else flush.to(torch.float64).reshape(e.shape)
        ds = _score_error(profile, fmt, scales.score_magnitude.to(torch.float64).reshape(e.shape), keys, flush)
    factor = 2.0 if pair else 1.0
    return factor * (profile.lse_abs + ds + 2.0**-23 * e.abs().nan_to_num(posinf=0.0, neginf=0.0))


def compare_lse(
    actual: Any,
    expected: Any,
    *,
    profile: Profile,
    fmt: Any = "dsv4",
    scales: Any = None,
    lse_convention: str = "flashinfer",
    lse_scale: float = 1.0,
    pair: bool = False,
    what: str = "lse",
) -> ComparisonReport:
    """Compare an LSE with the oracle's in absolute natural-log units.

    Args:
        actual, expected: ``[T, H]`` LSEs in ``lse_convention`` (``"flashinfer"``: log2 of the
            denominator with the sink, times ``lse_scale``; ``"flashmla"``: natural log without
            the sink; ``attention.conventions``).
        profile, fmt, scales, pair, what: as :func:`compare_output`.

    Returns:
        a :class:`ComparisonReport`.

    Raises:
        ValueError: before any arithmetic, the result's shape is not the expected one, or the
            oracle's scales describe other rows (the message names the tensor and both shapes).
    """
    import torch

    _check_shape(what, "the result", actual.shape, tuple(expected.shape))
    if actual.numel() == 0:  # num_tokens = 0: nothing to compare, nothing wrong
        return ComparisonReport(what, [f"{what}: no elements (num_tokens = 0)"], [], [])
    _check_lse_scales(what, tuple(expected.shape), scales)
    a = _to_natural(actual, lse_convention, lse_scale)
    e = _to_natural(expected, lse_convention, lse_scale)
    if a.dim() == 1:
        a, e = a.unsqueeze(1), e.unsqueeze(1)
    base = (
        "natural log, sink excluded"
        if lse_convention == "flashmla"
        else (f"log2 x lse_scale={lse_scale:g}, sink included; compared after conversion to natural log")
    )
    factor = 2.0 if pair else 1.0
    bound = lse_bound(e, profile=profile, fmt=fmt, scales=scales, pair=pair)
    finite = torch.isfinite(a) & torch.isfinite(e)
    same_inf = torch.isinf(a) & torch.isinf(e) & (torch.sign(a) == torch.sign(e))
    diff = torch.where(finite, (a - e).abs(), torch.where(same_inf, torch.zeros_like(a), torch.full_like(a, math.inf)))
    bad = diff > bound
    num_tokens = int(a.shape[0])
    lines = [
        f"LSE ({base}): |dlse| <= {factor:g} * (lse_abs={profile.lse_abs:.3g} + ds + 2**-23|lse|) natural-log units; "
        f"largest finite difference {float(diff[finite].max()) if bool(finite.any()) else 0.0:.3g}"
    ]
    violations: list[str] = []
    if bool(bad.any()):
        ratio = torch.where(bad, diff / bound, torch.zeros_like(diff)).nan_to_num(posinf=1e300)
        idx = tuple(int(i) for i in torch.unravel_index(ratio.argmax(), ratio.shape))
        conv = 1.0 if lse_convention == "flashmla" else lse_scale / math.log(2.0)
        violations.append(
            f"{int(bad.sum())} of {bad.numel()} LSE values differ; worst at {_where(idx, num_tokens)}: "
            f"actual {float(actual.reshape(a.shape)[idx]):.7g}, expected {float(e[idx] * conv):.7g} (returned units); "
            f"{float(diff[idx]):.3g} > {float(bound[idx]):.3g} natural-log units"
        )
    causes: list[tuple[str, str]] = []
    if violations:
        reads0 = _slot0_rows(scales, tuple(a.shape))
        matches = _slot0_lse_matches(a, e, scales, bound, lse_convention)
        causes = _lse_causes(a, e, bad, lse_convention, lse_scale, num_tokens, reads0, matches)
    return ComparisonReport(what, lines, violations, causes)


# --- the fixture's object ------------------------------------------------------------------------

_OUTPUT_KEYS = ("output", "output_fp32", "self_output")
_LSE_KEYS = ("lse", "self_lse")
KEYS: tuple[str, ...] = _OUTPUT_KEYS + _LSE_KEYS


@dataclass(frozen=True)
class SparseMlaTolerances:
    """The comparison model in force for one test (the ``sparse_mla_tolerances`` fixture).

    Attributes:
        profile: the profile name.
        model: the :class:`Profile` (after ini and marker overrides).
    """

    profile: str
    model: Profile
    bitwise_claims: frozenset[str] = frozenset()

    def check_output(self, actual: Any, expected: Any, *, fmt: Any = "dsv4", what: str = "output") -> None:
        """Assert ``actual`` (``[T, H, d_v]``) matches ``expected``: an ``OracleOutput`` (its
        ``output`` and ``scales`` are used) or a float tensor (row magnitudes stand in for the scales).

        Raises:
            AssertionError: a metric exceeds its bound; the message names the quantity, the metric,
                the bound, where, and the likely cause.
        """
        __tracebackhide__ = True  # a failure shows the test's line and this message, not this code
        expected_tensor, scales = _unpack_expected(expected, "output")
        report = compare_output(actual, expected_tensor, profile=self.model, fmt=fmt, scales=scales, what=what)
        if not report.ok:
            raise AssertionError(self._label(report.message()))

    def check_lse(
        self,
        actual: Any,
        expected: Any,
        *,
        fmt: Any = "dsv4",
        lse_convention: str | None = None,
        lse_scale: float | None = None,
        what: str = "lse",
    ) -> None:
        """Assert an LSE matches: ``expected`` an ``OracleOutput`` (its convention is used unless
        given) or a tensor in ``lse_convention`` (default ``"flashinfer"``, ``lse_scale`` 1).

        Raises:
            AssertionError: as :meth:`check_output`.
        """
        __tracebackhide__ = True  # a failure shows the test's line and this message, not this code
        expected_tensor, scales = _unpack_expected(expected, "lse")
        convention = str(lse_convention or getattr(expected, "lse_convention", "flashinfer"))
        scale = lse_scale if lse_scale is not None else float(getattr(expected, "lse_scale", 1.0))
        report = compare_lse(actual, expected_tensor, profile=self.model, fmt=fmt, scales=scales,
                             lse_convention=convention, lse_scale=scale, what=what)  # fmt: skip
        if not report.ok:
            raise AssertionError(self._label(report.message()))

    def check_result(self, result: Any, oracle: Any, *, fmt: Any = "dsv4", what: str = "") -> None:
        """:meth:`check_output` and :meth:`check_lse` of a forward result against an ``OracleOutput``,
        both checked before raising (one message lists every failed quantity).

        Raises:
            AssertionError: as :meth:`check_output`.
        """
        __tracebackhide__ = True  # a failure shows the test's line and this message, not this code
        prefix = f"{what}: " if what else ""
        reports = [
            compare_output(result.output, oracle.output, profile=self.model, fmt=fmt, scales=oracle.scales,
                           what=f"{prefix}output"),
        ]  # fmt: skip
        if getattr(result, "lse", None) is not None:  # None: a kernel whose envelope declares no LSE
            reports.append(compare_lse(result.lse, oracle.lse, profile=self.model, fmt=fmt, scales=oracle.scales,
                                       lse_convention=oracle.lse_convention, lse_scale=oracle.lse_scale,
                                       what=f"{prefix}lse"))  # fmt: skip
        failed = [r.message() for r in reports if not r.ok]
        if failed:
            raise AssertionError(self._label("\n".join(failed)))

    def check_invariant(
        self,
        a: Any,
        b: Any,
        *,
        oracle: Any = None,
        fmt: Any = "dsv4",
        what: str = "",
        bitwise: bool = True,
        claim: str | None = None,
    ) -> None:
        """Two results of one implementation that are mathematically equal (an invariance claim).

        Bit for bit when ``claim`` (``"padding"``, ``"heads"``, ``"batch"``, ``"layout"``) is one of
        the implementation's ``bitwise_claims`` (its envelope's ``bitwise_invariance``), or, for an
        unnamed claim, when the profile has ``bitwise_invariants`` and ``bitwise`` (the claim holds
        by construction for a fixed-order fp32 reference); otherwise each result may carry its own
        rounding error, so ``|A - B| <= bound(A) + bound(B)``, with the oracle's scales for
        ``oracle`` (an ``OracleOutput`` of the same rows) when given. LSEs are compared when both
        results have one.

        Raises:
            AssertionError: the results differ by more than allowed.
        """
        __tracebackhide__ = True  # a failure shows the test's line and this message, not this code
        prefix = f"{what}: " if what else ""
        has_lse = getattr(a, "lse", None) is not None and getattr(b, "lse", None) is not None
        exact = claim in self.bitwise_claims if claim is not None else self.model.bitwise_invariants and bitwise
        if exact:
            label = f"{prefix}bitwise {claim} invariance claimed; " if claim else prefix
            assert_equal(a.output, b.output, what=f"{label}output")
            if has_lse:
                assert_equal(a.lse, b.lse, what=f"{label}lse")
            return
        scales = getattr(oracle, "scales", None)
        convention = getattr(oracle, "lse_convention", "flashinfer")
        scale = float(getattr(oracle, "lse_scale", 1.0))
        reports = [
            compare_output(a.output, b.output, profile=self.model, fmt=fmt, scales=scales, pair=True,
                           what=f"{prefix}output"),
        ]  # fmt: skip
        if has_lse:
            reports.append(compare_lse(a.lse, b.lse, profile=self.model, fmt=fmt, scales=scales, pair=True,
                                       lse_convention=convention, lse_scale=scale, what=f"{prefix}lse"))
        failed = [r.message() for r in reports if not r.ok]
        if failed:
            raise AssertionError(self._label("\n".join(failed)))

    def assert_close(self, actual: Any, expected: Any, key: str, *, what: str = "", fmt: Any = "dsv4") -> None:
        """Compatibility form: ``key`` ``"output"``/``"output_fp32"`` -> :meth:`check_output`,
        ``"lse"`` -> :meth:`check_lse`, ``"self_output"``/``"self_lse"`` -> a pair comparison.

        Raises:
            KeyError: an unknown key. AssertionError: as :meth:`check_output`.
        """
        __tracebackhide__ = True  # a failure shows the test's line and this message, not this code
        if key not in KEYS:
            raise KeyError(f"tolerance key {key!r}: expected one of {KEYS}")
        label = what or key
        if key in ("output", "output_fp32"):
            self.check_output(actual, expected, fmt=fmt, what=label)
        elif key == "lse":
            self.check_lse(actual, expected, fmt=fmt, what=label)
        else:
            compare = compare_output if key == "self_output" else compare_lse
            report = compare(actual, _unpack_expected(expected, key.split("_", 1)[1])[0], profile=self.model,
                             fmt=fmt, pair=True, what=label)  # fmt: skip
            if not report.ok:
                raise AssertionError(self._label(report.message()))

    def _label(self, text: str) -> str:
        return f"{text}\n(tolerance profile {self.profile!r})"


def _unpack_expected(expected: Any, field_name: str) -> tuple[Any, Any]:
    """``(tensor, scales)`` from an ``OracleOutput`` or a bare tensor."""
    if hasattr(expected, field_name) and hasattr(expected, "scales"):
        return getattr(expected, field_name), expected.scales
    return expected, None


def assert_equal(actual: Any, expected: Any, *, what: str = "") -> None:
    """Exact equality (``torch.equal``: same shape, dtype and values; ``-0.0 == 0.0``, NaN never
    equal), for claims that hold bit for bit (index padding, head count, page split).

    Raises:
        AssertionError: the tensors differ; the message gives the count and the largest difference.
    """
    __tracebackhide__ = True  # a failure shows the test's line and this message, not this code
    import torch

    if torch.equal(actual, expected):
        return
    label = f"{what}: " if what else ""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(
            f"{label}not bitwise equal: {actual.dtype} {tuple(actual.shape)} vs "
            f"{expected.dtype} {tuple(expected.shape)}"
        )
    a, b = actual.to(torch.float64), expected.to(torch.float64)
    differ = ~(a == b)
    diff = (a - b).abs()[differ]
    raise AssertionError(
        f"{label}not bitwise equal: {int(differ.sum())} of {differ.numel()} elements differ "
        f"(largest difference {float(diff.nan_to_num(nan=float('inf')).max()):.3g}; first at "
        f"{differ.nonzero()[0].tolist()})"
    )


# --- configuration ---------------------------------------------------------------------------------


def _parse_value(param: str, text: Any, where: str) -> Any:
    kind = type(getattr(DEFAULT_PROFILES["kernel"], param))
    if kind is bool:
        lowered = str(text).strip().lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise ToleranceSpecError(f"{where}: expected true or false, got {text!r}")
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ToleranceSpecError(f"{where}: expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ToleranceSpecError(f"{where}: expected a non-negative finite number, got {text!r}")
    return value


def parse_ini_lines(lines: list[str]) -> dict[str, dict[str, Any]]:
    """Parse ``sparse_mla_tolerances`` ini lines (``PROFILE.PARAMETER = VALUE``; ``#`` comments).

    Raises:
        ToleranceSpecError: a malformed line, an unknown parameter, or a bad value.
    """
    out: dict[str, dict[str, Any]] = {}
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"ini {INI_NAME} line {raw.strip()!r}"
        name, sep, value = line.partition("=")
        profile, dot, param = name.strip().rpartition(".")
        if not sep or not dot or not profile:
            raise ToleranceSpecError(f"{where}: expected 'PROFILE.PARAMETER = VALUE'")
        if param not in PARAMETERS:
            raise ToleranceSpecError(f"{where}: unknown parameter {param!r}; expected one of {', '.join(PARAMETERS)}")
        out.setdefault(profile, {})[param] = _parse_value(param, value.strip(), where)
    return out


def resolve(
    impl_profile: str | None,
    ini: Mapping[str, Mapping[str, Any]],
    marks: list[Any],
) -> SparseMlaTolerances:
    """Combine the implementation's profile, ini values and markers (closest marker wins).

    Args:
        impl_profile: the implementation's profile (:func:`profile_for`; ``None`` -> ``"kernel"``).
        ini: parsed ini values (:func:`parse_ini_lines`).
        marks: ``sparse_mla_tolerance`` marks, closest first (``item.iter_markers`` order).

    Raises:
        ToleranceSpecError: a marker with an unknown parameter or a bad value.
    """
    profile = impl_profile or "kernel"
    for mark in reversed(marks):
        if mark.kwargs.get("profile"):
            profile = str(mark.kwargs["profile"])
        if mark.args:
            profile = str(mark.args[0])
    model = replace(DEFAULT_PROFILES.get(profile, DEFAULT_PROFILES["kernel"]), name=profile)
    updates: dict[str, Any] = dict(ini.get(profile, {}))
    for mark in reversed(marks):
        for key, value in mark.kwargs.items():
            if key == "profile":
                continue
            if key not in PARAMETERS:
                raise ToleranceSpecError(
                    f"@pytest.mark.{MARKER}: unknown parameter {key!r}; expected one of {', '.join(PARAMETERS)}"
                )
            updates[key] = _parse_value(key, value, f"@pytest.mark.{MARKER}({key}=...)")
    return SparseMlaTolerances(profile, replace(model, **updates))

