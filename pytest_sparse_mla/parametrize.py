"""The pytest side of the attention cases: parameters for ``@pytest.mark.parametrize`` and the
large-case skip.

``pytest_sparse_mla.attention.cases`` holds the cases as plain frozen data and draws their inputs
without pytest; the suites parametrise over them with :func:`case_params` and draw inputs with
:func:`inputs_on`::

    from pytest_sparse_mla.attention.cases import FLASHINFER_CASES
    from pytest_sparse_mla.parametrize import case_params, inputs_on

    @pytest.mark.parametrize("case", case_params(FLASHINFER_CASES))
    def test_x(case, sparse_mla_generator, sparse_mla_device):
        inputs = inputs_on(case, sparse_mla_generator, sparse_mla_device)

Importing this module imports pytest, and torch only through ``attention.cases`` when
:func:`inputs_on` is first called.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import torch

    from pytest_sparse_mla.attention.cases import AttentionCase, AttentionInputs

__all__ = ["case_params", "inputs_on"]


def case_params(cases: Iterable[AttentionCase]) -> list[Any]:
    """One ``pytest.param`` per case, id ``case.name`` (the test ids the xfail files name); a
    ``large`` case carries the ``sparse_mla_requires_cuda`` marker (skipped without a CUDA device)."""
    return [pytest.param(c, id=c.name, marks=[pytest.mark.sparse_mla_requires_cuda] if c.large else []) for c in cases]


def inputs_on(case: AttentionCase, generator: torch.Generator, device: torch.device) -> AttentionInputs:
    """``attention.cases.make_inputs(case, generator, device=device)``; skips the test for a
    ``large`` case unless ``device`` is CUDA (a CUDA machine run with ``--sparse-mla-device=cpu``
    keeps its CPU suite small).

    Raises:
        as ``attention.cases.make_inputs``.
    """
    from pytest_sparse_mla.attention.cases import make_inputs

    if case.large and device.type != "cuda":
        pytest.skip(f"{case.name}: large case, run on CUDA only")
    return make_inputs(case, generator, device=device)
