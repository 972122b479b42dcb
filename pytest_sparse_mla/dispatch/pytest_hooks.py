"""pytest hooks of the dispatch package: ``--sparse-mla-deployment-report {text,json}``.

Registered by the plugin through ``plugin._PLUGIN_MODULES``. With the option, the DeepSeek-V4
deployment coverage report (:mod:`pytest_sparse_mla.dispatch.report`) is printed in the report
header, before the tests run; the releases are one per grid family plus the
``--sparse-mla-grid`` release when it is another one. Under pytest-xdist only the controller
prints headers. Imports neither torch nor flashinfer.
"""

from __future__ import annotations

import pytest

from pytest_sparse_mla import options


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    """The deployment coverage report (text table or JSON document), when requested."""
    opts = options.get_options(config)
    if opts.deployment_report is None:
        return None
    from pytest_sparse_mla.dispatch import grid, report

    releases = list(report.DEFAULT_RELEASES)
    if opts.grid is not None:
        try:
            grid.parse_release(opts.grid)
        except grid.errors.UnsupportedReleaseError as exc:
            raise pytest.UsageError(f"--sparse-mla-grid={opts.grid}: {exc}") from None
        if opts.grid not in releases:
            releases.append(opts.grid)
    return report.render(opts.deployment_report, releases).splitlines()
