"""The package's own exception types, raised by the modules that never import pytest.

The domain core (``formats``, ``page_split``, ``attention``, ``tolerances``, ``capabilities``,
``envelope``, ``data``, ``dispatch``, the golden file format) is usable without pytest. Where a
value that comes from the user's setup is wrong (an ini line, a marker's arguments, an
implementation's ``compute_mode``), it raises :class:`SparseMlaUsageError` with a message naming
the value and what was expected. The plugin layer, where pytest's config is parsed (``options``,
``plugin``, ``fixtures``, ``selection``, ``xdist_gpu``), re-raises it as ``pytest.UsageError``
with the same message (:func:`pytest_sparse_mla.options.usage_errors`), so a bad setting still
stops the session with pytest's usage-error exit code 4 when it is found while configuring it.

This module imports nothing.
"""

from __future__ import annotations

__all__ = [
    "CapabilityMarkerError", "Discrepancies", "KnownDiscrepancy", "NewDiscrepancy", "SparseMlaUsageError",
    "ToleranceSpecError",
]  # fmt: skip


class SparseMlaUsageError(ValueError):
    """A wrong setting of the user's session (not a failure of the kernel under test).

    A ``ValueError``; the plugin reports it as ``pytest.UsageError`` with the same message.
    """


class ToleranceSpecError(SparseMlaUsageError):
    """A malformed tolerance setting: a ``sparse_mla_tolerances`` ini line, a parameter of the
    ``sparse_mla_tolerance`` marker, or an implementation's unknown ``compute_mode``
    (``pytest_sparse_mla.tolerances``)."""


class CapabilityMarkerError(SparseMlaUsageError):
    """A capability marker (``sparse_mla_requires_*``) whose spec does not parse; the message starts
    with the test's node id (``pytest_sparse_mla.capabilities.unmet_markers``)."""


class Discrepancies(AssertionError):
    """A search test found discrepancies between the kernel and the oracle: the message lists each
    distinct one (its key, its region, its shrunk call, the failed check and the likely cause).
    Raised as one of its two subclasses (``pytest_sparse_mla.search_run.SearchRun``)."""


class KnownDiscrepancy(Discrepancies):
    """Every discrepancy the search found lies inside a region the xfail file declares
    (``# [KEY] region: ...``, ``pytest_sparse_mla.regions``): an xfail entry of a search test
    whose file declares regions expects this type (``pytest.mark.xfail(raises=...)``)."""


class NewDiscrepancy(Discrepancies):
    """At least one discrepancy the search found lies outside every known region: a failure even
    where the test is listed in an xfail file that declares regions."""
