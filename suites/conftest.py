"""Settings the suites need wherever they run: from a checkout (``pytest -p sparse_mla suites``) or
from the installed package (``pytest -p sparse_mla --pyargs pytest_sparse_mla.suites``), where the
checkout's root ``conftest.py`` is absent.

Hypothesis profile ``sparse_mla``: derandomized, so CI runs and xdist workers draw the same
examples; no deadline (CPU timings vary and tensors are slow); 40 examples; the
``function_scoped_fixture`` health check off because the property tests take fixtures that do not
need resetting between examples (``page_split_backend``). It is loaded unless
``--hypothesis-profile`` names another profile.
"""

from __future__ import annotations

import pytest

try:  # hypothesis is a test extra; the suites that use it import it with importorskip.
    from hypothesis import HealthCheck, settings
except ImportError:  # pragma: no cover
    settings = None
else:
    settings.register_profile(  # on Hypothesis's default profile, not on whatever is loaded at import
        "sparse_mla",
        parent=settings.get_profile("default"),
        derandomize=True,
        deadline=None,
        max_examples=40,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


def pytest_configure(config: pytest.Config) -> None:
    """Stop with a usage error when ``-p no:sparse_mla`` turned the plugin off (the suites' fixtures
    and markers are the plugin's); load the ``sparse_mla`` Hypothesis profile unless the command
    line chose one.

    Raises:
        pytest.UsageError: the plugin is blocked.
    """
    if config.pluginmanager.is_blocked("sparse_mla"):
        raise pytest.UsageError(
            "the pytest-sparse-mla suites need the plugin, which -p no:sparse_mla turned off: "
            "drop -p no:sparse_mla and run with -p sparse_mla"
        )
    if settings is not None and not config.getoption("hypothesis_profile", None):
        settings.load_profile("sparse_mla")
