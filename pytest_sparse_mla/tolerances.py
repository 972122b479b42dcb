"""Tolerance profiles for comparing sparse-MLA results, configurable per suite.

A profile maps comparison *keys* to ``(atol, rtol)`` pairs used with
``torch.testing.assert_close`` (``|actual - expected| <= atol + rtol * |expected|``):

================  =========================================================================
key               compares
================  =========================================================================
``output``        an implementation's BF16 output with the float64 oracle
``output_fp32``   an fp32 output (before BF16 rounding) with the float64 oracle
``lse``           an implementation's fp32 LSE with the oracle's
``self_output``   two BF16 outputs of one implementation that are mathematically equal but
                  computed in a different order (candidate permutation, dual vs one cache)
``self_lse``      the LSEs of such a pair
================  =========================================================================

Built-in profiles:

* ``"tight"`` (pure-PyTorch fp32 references, e.g. the bundled one): fp32 results within
  ``1e-5`` relative of the oracle (``atol`` 1e-6 for values near 0); a BF16 output may in addition
  carry its own rounding, half a BF16 ulp = ``2**-8`` relative, and two BF16 outputs of one
  implementation may differ by one ulp (``2**-7``) when a rounding boundary falls between them.
* ``"kernel"`` (GPU kernels): ``atol = rtol = 5e-2`` everywhere, FlashInfer's own tolerance for its
  SM120 FP8 kernels, which quantize Q and P to FP8 (flashinfer-ai/flashinfer
  ``tests/attention/test_sparse_mla_sm120.py``; ``shared/reference/dsv4-format-and-math.md`` 3.2).

Selection, last wins: the implementation's ``tolerance_profile`` attribute (default
``"kernel"``), then the ``profile=`` of a ``sparse_mla_tolerance`` marker (module, class or test:
per suite), then per-key values from the ``sparse_mla_tolerances`` ini option, then per-key values
of the marker. Ini lines read ``PROFILE.KEY = ATOL RTOL``, e.g.::

    [pytest]
    sparse_mla_tolerances =
        kernel.output = 2e-2 2e-2
        mykernel.lse = 1e-3 1e-3

A profile named only in the ini starts from ``"kernel"``. The marker takes
``@pytest.mark.sparse_mla_tolerance(profile="kernel", output=(2e-2, 2e-2))``.

This module is registered as a plugin module (``plugin._PLUGIN_MODULES``): it adds the ini key and
the marker. It imports torch only inside :meth:`SparseMlaTolerances.assert_close`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

__all__ = [
    "KEYS",
    "DEFAULT_PROFILES",
    "Tolerance",
    "SparseMlaTolerances",
    "assert_equal",
    "parse_ini_lines",
    "resolve",
]

KEYS: tuple[str, ...] = ("output", "output_fp32", "lse", "self_output", "self_lse")
INI_NAME = "sparse_mla_tolerances"
MARKER = "sparse_mla_tolerance"


@dataclass(frozen=True)
class Tolerance:
    """An ``(atol, rtol)`` pair for ``torch.testing.assert_close``."""

    atol: float
    rtol: float


_KERNEL = Tolerance(5e-2, 5e-2)
DEFAULT_PROFILES: dict[str, dict[str, Tolerance]] = {
    "tight": {
        "output": Tolerance(1e-6, 2.0**-8 + 1e-5),
        "output_fp32": Tolerance(1e-6, 1e-5),
        "lse": Tolerance(1e-6, 1e-5),
        "self_output": Tolerance(1e-6, 2.0**-7 + 1e-5),
        "self_lse": Tolerance(1e-6, 1e-5),
    },
    "kernel": {key: _KERNEL for key in KEYS},
}

_INI_KEY = pytest.StashKey[dict[str, dict[str, Tolerance]]]()


@dataclass(frozen=True)
class SparseMlaTolerances:
    """The tolerances in force for one test (the ``sparse_mla_tolerances`` fixture).

    Attributes:
        profile: the profile name the values started from.
        values: key -> :class:`Tolerance` for every key of :data:`KEYS`.
    """

    profile: str
    values: Mapping[str, Tolerance] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Tolerance:
        """The tolerance of ``key``.

        Raises:
            KeyError: ``key`` is not one of :data:`KEYS`.
        """
        if key not in self.values:
            raise KeyError(f"tolerance key {key!r}: expected one of {KEYS}")
        return self.values[key]

    def assert_close(self, actual: Any, expected: Any, key: str, *, what: str = "") -> None:
        """``torch.testing.assert_close`` in float64 with the tolerance of ``key``.

        Infinities must match exactly (an empty row's ``-inf`` LSE); NaN never passes.

        Raises:
            AssertionError: the tensors differ by more than the tolerance (the message names
                ``what``, the profile and the key).
        """
        import torch

        tol = self[key]
        label = f"{what}: " if what else ""
        torch.testing.assert_close(
            actual.to(torch.float64),
            expected.to(torch.float64),
            atol=tol.atol,
            rtol=tol.rtol,
            msg=lambda m: (
                f"{label}{m}\n(tolerance profile {self.profile!r}, key {key!r}: atol={tol.atol:g}, rtol={tol.rtol:g})"
            ),
        )


def assert_equal(actual: Any, expected: Any, *, what: str = "") -> None:
    """Exact equality (``torch.equal``: same shape, dtype and values; ``-0.0 == 0.0``, NaN never
    equal), for claims that hold bit for bit (index padding, head count, page split).

    Raises:
        AssertionError: the tensors differ; the message gives the count and the largest difference.
    """
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


def _parse_pair(text: str, where: str) -> Tolerance:
    parts = text.replace(",", " ").split()
    try:
        atol, rtol = (float(p) for p in parts)
    except ValueError:
        raise pytest.UsageError(f"{where}: expected 'ATOL RTOL' (two numbers), got {text!r}") from None
    if not (math.isfinite(atol) and math.isfinite(rtol)) or atol < 0 or rtol < 0:
        raise pytest.UsageError(f"{where}: expected non-negative finite tolerances, got {text!r}")
    return Tolerance(atol, rtol)


def parse_ini_lines(lines: list[str]) -> dict[str, dict[str, Tolerance]]:
    """Parse ``sparse_mla_tolerances`` ini lines (``PROFILE.KEY = ATOL RTOL``; ``#`` comments).

    Raises:
        pytest.UsageError: a malformed line, an unknown key or a negative/non-finite tolerance.
    """
    out: dict[str, dict[str, Tolerance]] = {}
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"ini {INI_NAME} line {raw.strip()!r}"
        name, sep, value = line.partition("=")
        profile, dot, key = name.strip().rpartition(".")
        if not sep or not dot or not profile:
            raise pytest.UsageError(f"{where}: expected 'PROFILE.KEY = ATOL RTOL'")
        if key not in KEYS:
            raise pytest.UsageError(f"{where}: unknown key {key!r}; expected one of {KEYS}")
        out.setdefault(profile, {})[key] = _parse_pair(value, where)
    return out


def _marker_pair(value: Any, where: str) -> Tolerance:
    if isinstance(value, Tolerance):
        return value
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return _parse_pair(f"{value[0]} {value[1]}", where)
    raise pytest.UsageError(f"{where}: expected an (atol, rtol) pair, got {value!r}")


def resolve(
    impl_profile: str | None,
    ini: Mapping[str, Mapping[str, Tolerance]],
    marks: list[Any],
) -> SparseMlaTolerances:
    """Combine the implementation's profile, ini values and markers (closest marker wins).

    Args:
        impl_profile: the implementation's ``tolerance_profile`` (``None`` -> ``"kernel"``).
        ini: parsed ini values (:func:`parse_ini_lines`).
        marks: ``sparse_mla_tolerance`` marks, closest first (``item.iter_markers`` order).

    Raises:
        pytest.UsageError: a marker with an unknown key or a malformed pair.
    """
    profile = impl_profile or "kernel"
    for mark in reversed(marks):
        if mark.kwargs.get("profile"):
            profile = str(mark.kwargs["profile"])
        if mark.args:
            profile = str(mark.args[0])
    values = dict(DEFAULT_PROFILES.get(profile, DEFAULT_PROFILES["kernel"]))
    values.update(ini.get(profile, {}))
    for mark in reversed(marks):
        for key, value in mark.kwargs.items():
            if key == "profile":
                continue
            if key not in KEYS:
                raise pytest.UsageError(f"@pytest.mark.{MARKER}: unknown key {key!r}; expected one of {KEYS}")
            values[key] = _marker_pair(value, f"@pytest.mark.{MARKER}({key}=...)")
    return SparseMlaTolerances(profile, values)


def ini_tolerances(config: pytest.Config) -> dict[str, dict[str, Tolerance]]:
    """The parsed ini values of this session (parsed once in ``pytest_configure``)."""
    return config.stash.get(_INI_KEY, {})


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register the ``sparse_mla_tolerances`` ini key (a historic hook: runs on late registration)."""
    parser.addini(
        INI_NAME,
        "Per-profile comparison tolerances, one 'PROFILE.KEY = ATOL RTOL' per line "
        f"(keys: {', '.join(KEYS)}; profiles: tight, kernel or your own)",
        type="linelist",
        default=[],
    )


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``sparse_mla_tolerance`` marker and parse the ini lines (errors are usage
    errors)."""
    config.addinivalue_line(
        "markers",
        f"{MARKER}(profile=None, **key_pairs): tolerance profile and (atol, rtol) overrides for "
        f"the sparse_mla_tolerances fixture; keys: {', '.join(KEYS)}",
    )
    config.stash[_INI_KEY] = parse_ini_lines(list(config.getini(INI_NAME)))
