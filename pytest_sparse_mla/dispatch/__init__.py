"""FlashInfer SM120 sparse-MLA dispatch grids, per release, testable without SM120 hardware.

Public API (pure Python; nothing here imports torch or flashinfer)::

    from pytest_sparse_mla.dispatch import SparseMlaConfig, supports, enforce_grid

    verdict = supports(SparseMlaConfig("DSV4", num_tokens=65, num_heads=8, topk=128,
                                       page_block_size=64), "0.6.17")
    verdict.supported, verdict.route, verdict.numeric_route, verdict.reason
    verdict.error_type, verdict.error_message          # exact upstream type and text

    enforce_grid("0.6.17", model="DSV4", num_tokens=65, num_heads=8, topk=128,
                 page_block_size=64)                   # raises InternalError (a RuntimeError)

Modules: ``grid`` (config, verdicts, the per-release control flow over ``grids.json``),
``errors`` (mirrored exception types and the exact texts per release), ``report`` (DeepSeek-V4
deployment coverage; console script ``sparse-mla-deployments`` and ``--sparse-mla-deployment-report``).
Comparing an installed FlashInfer with the bundled grids is a CI tool of the checkout, not part of
this package: ``scripts/flashinfer_introspect.py``.

``numeric_route`` (:data:`NUMERIC_ROUTES`) is FlashInfer's prefill ``NumericRoute``, not an
implementation's ``compute_mode`` (a tolerance profile); ``Verdict.compute_mode`` and
``COMPUTE_MODES`` are its deprecated aliases. Design notes: ``docs/design/flashinfer-dispatch.md``.
"""

from pytest_sparse_mla.dispatch.errors import (
    FooterRecordsWarning,
    IgnoredExtraCacheWarning,
    InternalError,
    SparseMlaGridError,
    UncheckedPageSizeWarning,
    UnsupportedReleaseError,
    UnsupportedShapeError,
)
from pytest_sparse_mla.dispatch.grid import (
    COMPUTE_MODES,
    NUMERIC_ROUTES,
    ROUTES,
    GridFamily,
    SparseMlaConfig,
    Verdict,
    check_known_release,
    enforce_grid,
    families,
    format_model,
    inline_v41_model,
    parse_release,
    release_family,
    supports,
)

__all__ = [
    "COMPUTE_MODES",
    "NUMERIC_ROUTES",
    "ROUTES",
    "GridFamily",
    "IgnoredExtraCacheWarning",
    "FooterRecordsWarning",
    "InternalError",
    "SparseMlaConfig",
    "SparseMlaGridError",
    "UncheckedPageSizeWarning",
    "UnsupportedReleaseError",
    "UnsupportedShapeError",
    "Verdict",
    "check_known_release",
    "enforce_grid",
    "format_model",
    "inline_v41_model",
    "families",
    "parse_release",
    "release_family",
    "supports",
]
