"""Root conftest of the pytest-sparse-mla checkout (self-tests and suites run from a clone).

The plugin itself is loaded by ``-p sparse_mla`` (or its ``pytest11`` entry point), never from
here: registering one plugin under two names fails (pytest PR #13253 discussion).
"""

from __future__ import annotations

try:  # hypothesis is a test extra; the suites run without it.
    from hypothesis import HealthCheck, settings
except ImportError:  # pragma: no cover
    pass
else:
    # Derandomized so CI and xdist workers agree; no deadline (CPU timings vary, tensors are slow).
    settings.register_profile(
        "sparse_mla",
        derandomize=True,
        deadline=None,
        max_examples=40,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    settings.load_profile("sparse_mla")
