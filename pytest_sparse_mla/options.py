"""Typed, validated values of the ``--sparse-mla-*`` command-line options.

The plugin registers the options (``plugin.py``); this module parses them once in
``pytest_configure`` into a frozen :class:`SparseMlaOptions` kept in ``config.stash``. Parse
functions raise :class:`pytest.UsageError` naming the option, the value and what was expected
(the pytest-xdist convention: pytest-dev/pytest-xdist src/xdist/plugin.py ``parse_numprocesses``).
Every value is a plain string/int/bool so xdist can ship the command line to workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = ["SparseMlaOptions", "OPTIONS_KEY", "get_options", "parse_device", "parse_grid"]

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class SparseMlaOptions:
    """Parsed ``--sparse-mla-*`` options.

    Attributes:
        device: ``"auto"`` (CUDA when available), ``"cpu"`` or ``"cuda"``.
        seed: base seed of every generator fixture (per-test seeds derive from it and the node id).
        impl: implementation under test: a built-in name or ``package.module:attribute``.
        grid: FlashInfer release whose dispatch grid the reference enforces (``"0.6.17"``), or
            ``None`` for no enforcement.
        require_gpu: turn "no GPU" skips into errors (GPU CI lanes).
        golden_dir: root of the golden snapshots, or ``None`` for the built-in ``golden/``.
        xfail_file / skip_file: files of test ids to mark xfail / skip.
        deployment_report: ``None``, ``"text"`` or ``"json"``.
        gpu_per_worker: pin each xdist worker to one visible GPU.
    """

    device: str = "auto"
    seed: int = 0
    impl: str = "reference"
    grid: str | None = None
    require_gpu: bool = False
    golden_dir: Path | None = None
    xfail_file: Path | None = None
    skip_file: Path | None = None
    deployment_report: str | None = None
    gpu_per_worker: bool = True


OPTIONS_KEY = pytest.StashKey[SparseMlaOptions]()


def parse_device(value: str) -> str:
    """Validate ``--sparse-mla-device``: one of ``auto``, ``cpu``, ``cuda``.

    Raises:
        pytest.UsageError: any other value.
    """
    if value not in DEVICES:
        raise pytest.UsageError(
            f"--sparse-mla-device={value!r}: expected one of {', '.join(DEVICES)}"
        )
    return value


def parse_grid(value: str | None) -> str | None:
    """Validate ``--sparse-mla-grid``: ``none``, ``flashinfer==X.Y.Z`` or a bare ``X.Y.Z``.

    Returns:
        The release version string, or ``None``.

    Raises:
        pytest.UsageError: not a version.
    """
    from packaging.version import InvalidVersion, Version

    if value is None or value.lower() in ("", "none"):
        return None
    text = value.split("==", 1)[1] if value.startswith("flashinfer==") else value
    try:
        Version(text)
    except InvalidVersion:
        raise pytest.UsageError(
            f"--sparse-mla-grid={value!r}: expected 'flashinfer==X.Y.Z' (e.g. flashinfer==0.6.17) "
            "or 'none'"
        ) from None
    from pytest_sparse_mla.dispatch import UnsupportedReleaseError, parse_release

    try:
        parse_release(text)  # a release with SM120 sparse MLA that the bundled grids can place
    except UnsupportedReleaseError as exc:
        raise pytest.UsageError(f"--sparse-mla-grid={value!r}: {exc}") from None
    return text


def _existing_file(option: str, value: str | None, rootpath: Path) -> Path | None:
    if not value:
        return None
    path = Path(value)
    if not path.is_absolute():
        path = rootpath / path if not path.exists() else path.resolve()
    if not path.is_file():
        raise pytest.UsageError(f"{option}={value!r}: no such file")
    return path


def _golden_dir(config: pytest.Config) -> Path | None:
    """CLI paths are relative to the working directory, ini paths to the ini file (pytest's rule
    for ``paths`` ini values)."""
    cli = config.getoption("sparse_mla_golden_dir")
    value = cli or config.getini("sparse_mla_golden_dir")
    if not value:
        return None
    path = Path(value)
    if not cli and not path.is_absolute():
        path = (config.inipath.parent if config.inipath else config.rootpath) / path
    path = path.resolve()
    if not path.is_dir() and not config.getoption("update_snapshots", default=False):
        name = "--sparse-mla-golden-dir" if cli else "ini sparse_mla_golden_dir"
        raise pytest.UsageError(
            f"{name}={value!r}: no such directory ({path}); expected an existing golden root, "
            "or --snapshot-update to write goldens there"
        )
    return path


def _check_report_json(config: pytest.Config) -> None:
    value = config.getoption("sparse_mla_report_json", None)
    if value and not Path(value).resolve().parent.is_dir():
        raise pytest.UsageError(
            f"--sparse-mla-report-json={value!r}: no such directory {Path(value).resolve().parent}; "
            "expected a file path in an existing directory"
        )


def from_config(config: pytest.Config) -> SparseMlaOptions:
    """Parse every option from ``config`` (command line first, then ini values).

    Raises:
        pytest.UsageError: a bad device, grid release or seed, a missing xfail/skip file, a
            report path in a missing directory, or a golden directory that does not exist (unless
            ``--snapshot-update`` will create it).
    """
    report = config.getoption("sparse_mla_deployment_report")
    _check_report_json(config)
    seed_text = config.getoption("sparse_mla_seed")
    try:
        seed = int(seed_text)
    except (TypeError, ValueError):
        raise pytest.UsageError(f"--sparse-mla-seed={seed_text!r}: expected an integer") from None
    return SparseMlaOptions(
        device=parse_device(config.getoption("sparse_mla_device")),
        seed=seed,
        impl=config.getoption("sparse_mla_impl") or config.getini("sparse_mla_impl") or "reference",
        grid=parse_grid(config.getoption("sparse_mla_grid")),
        require_gpu=bool(config.getoption("sparse_mla_require_gpu")),
        golden_dir=_golden_dir(config),
        xfail_file=_existing_file(
            "--sparse-mla-xfail-file", config.getoption("sparse_mla_xfail_file"), config.rootpath
        ),
        skip_file=_existing_file(
            "--sparse-mla-skip-file", config.getoption("sparse_mla_skip_file"), config.rootpath
        ),
        deployment_report=report,
        gpu_per_worker=not config.getoption("sparse_mla_no_gpu_pinning"),
    )


def get_options(config: pytest.Config) -> SparseMlaOptions:
    """The parsed options of this session (defaults if the plugin did not configure them)."""
    return config.stash.get(OPTIONS_KEY, SparseMlaOptions())
