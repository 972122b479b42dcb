"""pytest hooks of pytest-sparse-mla (entry point ``pytest11: sparse_mla``; load with ``-p sparse_mla``).

This module holds hooks only: options (one ``sparse-mla`` group), markers, the report header,
collection-time skips and the xdist GPU pinning. It imports neither torch, triton nor flashinfer
and never touches CUDA at import time; the capability probe (``capabilities.probe``) runs lazily,
once, at collection time. Models followed: pytest-randomly (header that makes CI logs reproducible,
controller-to-worker data through ``workerinput``) and pytest-xdist (option parse functions
raising ``UsageError``, hookspecs added through ``pytest_addhooks``); see
``shared/reference/pytest-plugin-anchors.md`` sections 1.1 and 1.6.
"""

from __future__ import annotations

import importlib
import os

import pytest

from pytest_sparse_mla import capabilities, options

#: Modules whose fixtures and hooks the plugin registers in ``pytest_configure``.
_PLUGIN_MODULES = (
    "pytest_sparse_mla.fixtures",
    "pytest_sparse_mla.xdist_gpu",
    "pytest_sparse_mla.snapshot_plugin",
    "pytest_sparse_mla.dispatch.pytest_hooks",
    "pytest_sparse_mla.selection",
    "pytest_sparse_mla.entry_points",
    "pytest_sparse_mla.implementations",
    "pytest_sparse_mla.tolerances",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register the ``--sparse-mla-*`` options and ini keys."""
    group = parser.getgroup("sparse-mla", "sparse MLA kernel regression suites (pytest-sparse-mla)")
    group.addoption(
        "--sparse-mla-device",
        default="auto",
        choices=options.DEVICES,
        help="Device the suites run on: auto (CUDA when available), cpu or cuda",
    )
    group.addoption(
        "--sparse-mla-seed",
        default="0",
        help="Base seed of every generator fixture; per-test seeds derive from it and the test id",
    )
    group.addoption(
        "--sparse-mla-impl",
        default=None,
        help="Implementation under test: a built-in name (reference, triton, flashinfer) "
        "or package.module:attribute",
    )
    group.addoption(
        "--sparse-mla-grid",
        default=None,
        help="Make the reference enforce a FlashInfer release's dispatch grid, "
        "e.g. flashinfer==0.6.17 (default: none)",
    )
    group.addoption(
        "--sparse-mla-require-gpu",
        action="store_true",
        default=False,
        help="Turn 'no GPU' skips into errors, so a GPU CI lane where everything skipped fails",
    )
    group.addoption(
        "--sparse-mla-golden-dir",
        default=None,
        help="Root directory of golden snapshots (default: the package's golden/)",
    )
    group.addoption(
        "--sparse-mla-xfail-file",
        default=None,
        help="File of test ids (one per line, # comments) to mark as expected failures",
    )
    group.addoption(
        "--sparse-mla-skip-file",
        default=None,
        help="File of test ids (one per line, # comments) to skip",
    )
    group.addoption(
        "--sparse-mla-deployment-report",
        default=None,
        choices=("text", "json"),
        help="Print which DeepSeek-V4 deployments each FlashInfer release serves, then run",
    )
    group.addoption(
        "--sparse-mla-no-gpu-pinning",
        action="store_true",
        default=False,
        help="Do not pin each xdist worker to one visible GPU",
    )
    group.addoption(
        "--sparse-mla-report-json",
        default=None,
        metavar="PATH",
        help="Write versions, device, options and the GPU of every xdist worker to PATH as JSON",
    )
    parser.addini("sparse_mla_golden_dir", "Root directory of golden snapshots", default="")
    parser.addini("sparse_mla_impl", "Default implementation under test", default="")


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    """Add the hooks downstream projects implement (``pytest_sparse_mla.hookspecs``)."""
    from pytest_sparse_mla import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Parse options, register markers and the fixture modules, pin xdist workers to GPUs."""
    for line in capabilities.MARKERS.values():
        config.addinivalue_line("markers", line)
    config.addinivalue_line(
        "markers", "sparse_mla_gpu_required(reason): internal; set by --sparse-mla-require-gpu"
    )
    parsed = options.from_config(config)
    config.stash[options.OPTIONS_KEY] = parsed
    if parsed.device == "cpu":
        # Triton decides at decoration time whether a kernel is interpreted; set it before any
        # kernel module is imported (triton-lang/triton docs/programming-guide/chapter-3/debugging.rst).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    for name in _PLUGIN_MODULES:
        module = importlib.import_module(name)
        if not config.pluginmanager.is_registered(module):
            config.pluginmanager.register(module, f"sparse_mla:{name.rsplit('.', 1)[-1]}")


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Say what ran where: versions, device, compute capability, seed, implementation, grid."""
    opts = options.get_options(config)
    caps = capabilities.probe()
    lines = [f"sparse-mla: {caps.summary()}"]
    lines.append(
        f"sparse-mla: device={opts.device} seed={opts.seed} impl={opts.impl} "
        f"grid={'flashinfer==' + opts.grid if opts.grid else 'none'} "
        f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', 'auto (1 without CUDA)')}"
    )
    for err in caps.errors:
        lines.append(f"sparse-mla: probe error: {err}")
    return lines


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Turn capability markers into skips (or errors under ``--sparse-mla-require-gpu``)."""
    opts = options.get_options(config)
    caps: capabilities.Capabilities | None = None
    for item in items:
        for name in capabilities.MARKERS:
            for mark in item.iter_markers(name=name):
                if caps is None:
                    caps = capabilities.probe()
                try:
                    reason = capabilities.evaluate_marker(name, mark, caps)
                except ValueError as exc:
                    raise pytest.UsageError(f"{item.nodeid}: {exc}") from None
                if reason is None:
                    continue
                if opts.require_gpu and capabilities.is_gpu_marker(name):
                    item.add_marker(pytest.mark.sparse_mla_gpu_required(reason=reason))
                else:
                    item.add_marker(pytest.mark.skip(reason=f"{name}: {reason}"))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Fail (not skip) a GPU test that cannot run when ``--sparse-mla-require-gpu`` is given."""
    mark = item.get_closest_marker("sparse_mla_gpu_required")
    if mark is not None:
        pytest.fail(f"--sparse-mla-require-gpu: {mark.kwargs['reason']}", pytrace=False)
