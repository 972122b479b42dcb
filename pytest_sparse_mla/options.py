"""Every ``--sparse-mla-*`` option and ``sparse_mla_*`` ini key: registered, parsed and typed here.

The hooks module (``pytest_sparse_mla.plugin``) calls :func:`add_options` from
``pytest_addoption`` and :func:`from_config` from ``pytest_configure``; the result, a frozen
:class:`SparseMlaOptions`, is kept in ``config.stash`` and read everywhere else through
:func:`get_options`. Parse functions raise :class:`pytest.UsageError` naming the option, the value
and what was expected (the pytest-xdist convention: pytest-dev/pytest-xdist ``src/xdist/plugin.py``
``parse_numprocesses``).

Activation (:func:`activation`). Installing the package registers the options (so they parse) but
changes nothing else in a session until the plugin is *used*: it is loaded by name
(``-p sparse_mla`` or ``-p pytest_sparse_mla.plugin``, on the command line, in ``PYTEST_ADDOPTS``
or in the ini ``addopts``; or listed in ``PYTEST_PLUGINS``), or any ``--sparse-mla-*`` option is
given, or any ``sparse_mla_*`` ini key is set. ``-p no:sparse_mla`` keeps it from loading at all.
Every option therefore defaults to ``None`` (or ``False``) on the command line, so "given" can be
told from "default"; the defaults of the typed object are filled in here.

One option also reads an environment variable: ``--sparse-mla-search-shard-group`` (a machine's
share of the search in a CI matrix, where each machine's job sets ``SPARSE_MLA_SEARCH_SHARD_GROUP``;
the command line wins, then the variable, then the ini key). The variable is read only in a session
that uses the plugin: it activates nothing by itself.

Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pytest_sparse_mla import shards
from pytest_sparse_mla.catalogue import NAMES
from pytest_sparse_mla.errors import SparseMlaUsageError

__all__ = [
    "DEVICES",
    "HELP_GROUP",
    "HELP_GROUP_TITLE",
    "IMPL_FORMS",
    "INI_KEYS",
    "OPTIONS_KEY",
    "PLUGIN_NAMES",
    "SparseMlaOptions",
    "activation",
    "add_options",
    "deployment_report_request",
    "from_config",
    "get_options",
    "is_active",
    "marker_lines",
    "parse_device",
    "parse_grid",
    "parse_timeout",
    "unknown_ini_key_hint",
    "usage_errors",
]

DEVICES = ("auto", "cpu", "cuda")
#: The option group's name and its title in ``pytest --help`` (README, "Options").
HELP_GROUP = "sparse-mla"
HELP_GROUP_TITLE = "sparse-mla: sparse MLA kernel regression suites (pytest-sparse-mla)"
#: Names that load the plugin with ``-p`` (the entry-point name and the module).
PLUGIN_NAMES = ("sparse_mla", "pytest_sparse_mla.plugin", "sparse-mla")
#: The built-in implementations' names, in order: ``catalogue.NAMES``, the table that
#: ``implementations.registry.BUILTINS`` is built from (that module imports pytest and the adapters'
#: factories; ``--help`` lists these without importing it).
BUILTIN_NAMES: tuple[str, ...] = NAMES
#: The forms ``--sparse-mla-impl`` accepts, in resolution order (``--help`` and miss errors).
IMPL_FORMS = (
    f"a built-in name ({', '.join(BUILTIN_NAMES)})",
    "a name from an installed package's 'pytest_sparse_mla.implementations' entry point",
    "a name returned by a pytest_sparse_mla_implementations(config) hook in a plugin or conftest.py",
    "MODULE or PACKAGE.MODULE: the module object itself, importable from sys.path or found in the "
    "rootdir, the ini file's folder, the current folder, a test path's folder or beside a conftest.py",
    "MODULE:ATTRIBUTE (dotted attribute path; a class is instantiated without arguments)",
)

#: Internal marker: a GPU test that cannot run under ``--sparse-mla-require-gpu``.
GPU_REQUIRED_MARKER = "sparse_mla_gpu_required"

#: ini key -> (help, type, default).
INI_KEYS: dict[str, tuple[str, Any, Any]] = {
    "sparse_mla_golden_dir": (
        "Root directory of golden snapshots, relative to the ini file (default: the package's goldens)",
        "string",
        "",
    ),
    "sparse_mla_impl": ("Default implementation under test (forms: see --sparse-mla-impl)", "string", ""),
    "sparse_mla_tolerances": (
        "Per-profile comparison tolerances, one 'PROFILE.PARAMETER = VALUE' per line "
        "(see pytest_sparse_mla.tolerances)",
        "linelist",
        [],
    ),
    shards.INI: (
        "This machine's share of the search in a CI matrix, I/N (see --sparse-mla-search-shard-group; "
        "the option and SPARSE_MLA_SEARCH_SHARD_GROUP take precedence)",
        "string",
        "",
    ),
}


@dataclass(frozen=True)
class SparseMlaOptions:
    """Parsed ``--sparse-mla-*`` options and ``sparse_mla_*`` ini keys of one session.

    Attributes:
        device: ``"auto"`` (CUDA when available), ``"cpu"`` or ``"cuda"``.
        seed: base seed of every generator fixture (per-test seeds derive from it and the test id).
        impl: implementation under test (forms: :data:`IMPL_FORMS`); ``"reference"`` by default.
        impl_given: ``impl`` came from ``--sparse-mla-impl`` or the ini key, not the default.
        grid: FlashInfer release whose dispatch grid the reference enforces (``"0.6.17"``), or
            ``None`` for no enforcement.
        require_gpu: turn "no GPU" skips into errors (GPU CI lanes).
        golden_dir: absolute root of the golden snapshots, or ``None`` for the packaged goldens.
        xfail_file / skip_file: absolute paths of the files of test ids to mark xfail / skip.
        gpu_per_worker: pin each xdist worker to one visible GPU.
        timeout: ``--sparse-mla-timeout``: seconds per test through pytest-timeout (``0``: no limit),
            or ``None`` for the default scaled to the device and the case
            (``pytest_sparse_mla.device_health.default_timeout``).
        timeout_given: ``--sparse-mla-timeout`` was given (``auto`` too): it then needs pytest-timeout.
        report_json: absolute path of the JSON run report, or ``None``.
        report_md: absolute path of the Markdown conformance report (``pytest_sparse_mla.run_report``),
            or ``None``.
        xfail_draft: absolute path of the draft xfail file to write from the run's failures
            (``pytest_sparse_mla.xfail_draft``), or ``None``.
        repro_dir: absolute directory for standalone reproducers of failing calls
            (``pytest_sparse_mla.repro``), or ``None``.
        tolerances: parsed ``sparse_mla_tolerances`` ini lines,
            ``{profile: {parameter: value}}`` (``pytest_sparse_mla.tolerances.parse_ini_lines``).
        activated_by: why the plugin is active in this session (e.g. ``"-p sparse_mla"``).
        search_examples: calls the search judges per property test and shard, its covering calls
            counted (``0``: the search tests skip); default 8, derandomized.
        search_seed: ``None`` (derandomized: every run draws the same calls; no example database)
            or the seed of shard 0 (shard ``k`` uses ``seed + k``; failures are saved in
            Hypothesis's example database and replayed first on the next run).
        search_shards: the search tests are parametrised over this many shards per machine
            (``shard0`` ...), which pytest-xdist spreads over workers and GPUs.
        search_shard_group: ``--sparse-mla-search-shard-group I/N`` (else
            ``SPARSE_MLA_SEARCH_SHARD_GROUP``, else ini ``sparse_mla_search_shard_group``): this
            session is machine ``I`` of a CI matrix of ``N`` and runs the global shards
            ``I*K .. I*K+K-1`` (``K``: ``search_shards``; ids ``shard{global}``, seeds
            ``search_seed + global``; ``pytest_sparse_mla.shards``), or ``None``: shards ``0 .. K-1``.
    """

    device: str = "auto"
    seed: int = 0
    impl: str = "reference"
    impl_given: bool = False
    grid: str | None = None
    require_gpu: bool = False
    golden_dir: Path | None = None
    xfail_file: Path | None = None
    skip_file: Path | None = None
    gpu_per_worker: bool = True
    timeout: float | None = None
    timeout_given: bool = False
    report_json: Path | None = None
    report_md: Path | None = None
    xfail_draft: Path | None = None
    repro_dir: Path | None = None
    tolerances: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    activated_by: str = ""
    search_examples: int = 8
    search_seed: int | None = None
    search_shards: int = 1
    search_shard_group: shards.ShardGroup | None = None


OPTIONS_KEY = pytest.StashKey[SparseMlaOptions]()


def add_options(parser: pytest.Parser) -> None:
    """Register every ``--sparse-mla-*`` option (group :data:`HELP_GROUP`) and ini key.

    Command-line defaults are ``None``/``False`` so :func:`activation` can tell a given option from
    a default; :func:`from_config` supplies the real defaults.
    """
    group = parser.getgroup(HELP_GROUP, HELP_GROUP_TITLE)
    group.addoption(
        "--sparse-mla-device",
        default=None,
        choices=DEVICES,
        help="Device the suites run on: auto (CUDA when available; the default), cpu or cuda",
    )
    group.addoption(
        "--sparse-mla-seed",
        default=None,
        help="Base seed of every generator fixture (default 0); per-test seeds derive from it and the test id",
    )
    group.addoption(
        "--sparse-mla-impl",
        default=None,
        metavar="IMPL",
        help="Implementation under test (default: reference), tried in this order: "
        + "; ".join(IMPL_FORMS)
        + ". Example: --sparse-mla-impl mykernel (mykernel.py in the rootdir)",
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
        help="Root directory of golden snapshots (default: the package's goldens)",
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
        help="Print which DeepSeek-V4 deployments each FlashInfer release serves, then exit "
        "(the console script sparse-mla-deployments prints the same)",
    )
    group.addoption(
        "--sparse-mla-no-gpu-pinning",
        action="store_true",
        default=False,
        help="Do not pin each xdist worker to one visible GPU",
    )
    group.addoption(
        "--sparse-mla-timeout",
        default=None,
        metavar="SECONDS",
        help="Time limit per suite test through pytest-timeout (needs it installed): SECONDS, 0 for none, or "
        "auto (the default when pytest-timeout is installed and no --timeout is given: 120 s on CUDA, 600 s "
        "on the CPU, x3 for a large case and for a Hypothesis test); the failure names the kernel call that "
        "did not return",
    )
    group.addoption(
        "--sparse-mla-report-json",
        default=None,
        metavar="PATH",
        help="Write versions, device, options and the GPU of every xdist worker to PATH as JSON",
    )
    group.addoption(
        "--sparse-mla-report-md",
        default=None,
        metavar="PATH",
        help="Write the conformance report of this run to PATH as Markdown: totals, per suite, failures not in "
        "the xfail file, skip reasons, error-class coverage, the xfail file's discrepancies, the envelope "
        "(sparse-mla-report merges several --sparse-mla-report-json files into one)",
    )
    group.addoption(
        "--sparse-mla-xfail-draft",
        default=None,
        metavar="PATH",
        help="Write a draft --sparse-mla-xfail-file to PATH from this run's failures: one discrepancy key per "
        "error class, its first failure line as the text, every failing test id under it (review and rename "
        "before use)",
    )
    group.addoption(
        "--sparse-mla-repro-dir",
        default=None,
        metavar="DIR",
        help="For every wrong call of a failing or xfailed test, write a standalone reproducer "
        "(repro.py + inputs.pt: needs only torch and the implementation) under DIR",
    )
    group.addoption(
        "--sparse-mla-search-examples",
        default=None,
        metavar="N",
        help="Calls the search judges per property test and shard, its covering calls counted (default 8; "
        "0 skips the search). "
        "A nightly or GPU budget: e.g. 500 with --sparse-mla-search-seed and --sparse-mla-search-shards",
    )
    group.addoption(
        "--sparse-mla-search-seed",
        default=None,
        metavar="N",
        help="Draw at random from seed N (shard k: N+k) with Hypothesis's example database, instead of "
        "the derandomized default",
    )
    group.addoption(
        "--sparse-mla-search-shards",
        default=None,
        metavar="K",
        help="Split each search test into K shards with distinct seeds (spread over xdist workers; default 1); "
        "with --sparse-mla-search-shard-group, K shards on each machine of a CI matrix",
    )
    group.addoption(
        "--sparse-mla-search-shard-group",
        default=None,
        metavar="I/N",
        help="Machine I of a CI matrix of N machines (I counted from 0): run the global search shards "
        "I*K .. I*K+K-1 (ids shard<global>, seeds S+global with --sparse-mla-search-seed S) of "
        "K = --sparse-mla-search-shards, so the N machines together run the shards of one machine with "
        f"--sparse-mla-search-shards N*K; also {shards.ENV}=I/N or ini {shards.INI} "
        "(default: the whole search, shards 0 .. K-1)",
    )
    from pytest_sparse_mla import tolerances

    for name, (text, kind, default) in INI_KEYS.items():
        if name == "sparse_mla_tolerances":
            text += f"; parameters: {', '.join(tolerances.PARAMETERS)}; profiles: "
            text += f"{', '.join(tolerances.DEFAULT_PROFILES)} or your own"
        parser.addini(name, text, type=kind, default=default)


def marker_lines() -> list[str]:
    """Every marker the plugin registers when active (``config.addinivalue_line("markers", ...)``)."""
    from pytest_sparse_mla import capabilities, tolerances

    return [
        *capabilities.MARKERS.values(),
        f"{tolerances.MARKER}(profile=None, **parameters): tolerance profile and rounding-model "
        f"overrides for the sparse_mla_tolerances fixture; parameters: {', '.join(tolerances.PARAMETERS)}",
        f"{GPU_REQUIRED_MARKER}(reason): internal; set by --sparse-mla-require-gpu",
        "sparse_mla_error_class(*names): the error classes a suite test exists for (the coverage "
        "table of the terminal summary and --sparse-mla-report-json)",
    ]


#: command-line option dests (``--sparse-mla-x-y`` -> ``sparse_mla_x_y``).
_DESTS = (
    "sparse_mla_device",
    "sparse_mla_seed",
    "sparse_mla_impl",
    "sparse_mla_grid",
    "sparse_mla_require_gpu",
    "sparse_mla_golden_dir",
    "sparse_mla_xfail_file",
    "sparse_mla_skip_file",
    "sparse_mla_deployment_report",
    "sparse_mla_no_gpu_pinning",
    "sparse_mla_timeout",
    "sparse_mla_report_json",
    "sparse_mla_report_md",
    "sparse_mla_xfail_draft",
    "sparse_mla_repro_dir",
    "sparse_mla_search_examples",
    "sparse_mla_search_seed",
    "sparse_mla_search_shards",
    "sparse_mla_search_shard_group",
)


def _named_with_p(config: pytest.Config) -> str | None:
    """``-p NAME``, with where it came from when not the command line (``PYTEST_ADDOPTS``, ini
    ``addopts``), or ``PYTEST_PLUGINS``; ``None`` when the plugin was not named."""
    import shlex

    def names(args: list[str], value: str) -> bool:  # "-p value" or "-pvalue" (pytest's only forms)
        pairs = zip(args, [*args[1:], ""] if args else [], strict=True)  # (argument, the one after it)
        return any((a == "-p" and b == value) or a == f"-p{value}" for a, b in pairs)

    for value in getattr(config.option, "plugins", None) or ():
        if value in PLUGIN_NAMES:
            if names([str(a) for a in config.invocation_params.args], value):
                return f"-p {value}"
            if names(shlex.split(os.environ.get("PYTEST_ADDOPTS", "")), value):
                return f"-p {value} in PYTEST_ADDOPTS"
            return f"-p {value} in the ini addopts"
    env = os.environ.get("PYTEST_PLUGINS", "")
    if any(part.strip() == "pytest_sparse_mla.plugin" for part in env.split(",")):
        return "PYTEST_PLUGINS"
    return None


def _ini_keys_set(config: pytest.Config) -> set[str]:
    """Every key the session's configuration file sets (in the sections pytest reads from it) and
    every key given with ``-o``/``--override-ini``, registered or not. Read from ``config.inipath``:
    ``config.getini`` answers only registered keys, and ``config.inicfg`` is deprecated from pytest 9
    (``PytestRemovedIn10Warning``)."""
    keys = {str(item).partition("=")[0].strip() for item in getattr(config.option, "override_ini", None) or ()}
    path = config.inipath
    if path is None:
        return keys
    try:
        if path.suffix == ".toml":  # pyproject.toml, pytest.toml, .pytest.toml, a -c TOML file
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # pragma: no cover - pytest depends on tomli before 3.11
                import tomli as tomllib
            document = tomllib.loads(path.read_text(encoding="utf-8"))
            tool = document.get("tool", {}).get("pytest", {})
            for table in (document.get("pytest"), tool, tool.get("ini_options") if isinstance(tool, dict) else None):
                if isinstance(table, dict):
                    keys.update(str(key) for key in table)
        else:  # pytest.ini, .pytest.ini, tox.ini ([pytest]), setup.cfg ([tool:pytest]): pytest's own parser
            import iniconfig

            sections = iniconfig.IniConfig(str(path)).sections
            for section in ("pytest", "tool:pytest"):
                keys.update(sections.get(section, {}))
    except Exception:  # pytest read the file already; one that changed since only loses the hint
        pass
    return keys


def unknown_ini_key_hint(config: pytest.Config) -> str:
    """``"; ..."`` naming the ini keys that look like the plugin's (``sparse_mla...``) but are not one
    of :data:`INI_KEYS`, each with the closest known key (``difflib``), or ``""``. A misspelled key
    activates nothing, so a session that needs the plugin says why it is not active."""
    import difflib

    unknown = sorted(
        k for k in _ini_keys_set(config) if k.replace("-", "_").startswith("sparse_mla") and k not in INI_KEYS
    )
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(key, list(INI_KEYS), n=1, cutoff=0.5)
        parts.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    if not parts:
        return ""
    return f"; the ini file sets {', '.join(parts)}, not a key of the plugin (known: {', '.join(INI_KEYS)})"


def activation(config: pytest.Config) -> str | None:
    """Why the plugin is active in this session, or ``None`` when it must stay out of the way.

    Active when the plugin is loaded by name (``-p sparse_mla`` / ``-p pytest_sparse_mla.plugin``
    from the command line, ``PYTEST_ADDOPTS`` or ini ``addopts``; ``PYTEST_PLUGINS``), when any
    ``--sparse-mla-*`` option is given, or when any ``sparse_mla_*`` ini key is set.
    """
    named = _named_with_p(config)
    if named is not None:
        return named
    for dest in _DESTS:
        value = config.getoption(dest, None)
        if value is not None and value is not False:
            return "--" + dest.replace("_", "-")
    for name in INI_KEYS:
        if config.getini(name):
            return f"ini {name}"
    return None


@contextlib.contextmanager
def usage_errors() -> Iterator[None]:
    """Re-raise the core's :class:`~pytest_sparse_mla.errors.SparseMlaUsageError` (a bad ini line,
    marker or ``compute_mode``) as ``pytest.UsageError`` with the same message: the one place the
    pytest-free modules' setting errors become pytest's (exit code 4 while the session configures).

    Raises:
        pytest.UsageError: the block raised a ``SparseMlaUsageError``.
    """
    try:
        yield
    except SparseMlaUsageError as exc:
        raise pytest.UsageError(str(exc)) from None


def parse_device(value: str) -> str:
    """Validate ``--sparse-mla-device``: one of ``auto``, ``cpu``, ``cuda``.

    Raises:
        pytest.UsageError: any other value.
    """
    if value not in DEVICES:
        raise pytest.UsageError(f"--sparse-mla-device={value!r}: expected one of {', '.join(DEVICES)}")
    return value


def parse_timeout(value: str | None) -> float | None:
    """Validate ``--sparse-mla-timeout``: ``auto`` (or not given) is ``None`` (the default scaled to
    the case), else a number of seconds, ``0`` for no limit.

    Raises:
        pytest.UsageError: not ``auto`` and not a number >= 0.
    """
    if value is None or str(value).strip().lower() == "auto":
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if not seconds >= 0:
        raise pytest.UsageError(f"--sparse-mla-timeout={value!r}: expected a number of seconds >= 0, 0 (none) or auto")
    return seconds


def parse_grid(value: str | None) -> str | None:
    """Validate ``--sparse-mla-grid``: ``none``, ``flashinfer==X.Y.Z`` or a bare ``X.Y.Z``.

    The release must be one the bundled grids describe: from the first release with SM120 sparse
    MLA up to the last examined release (``pytest_sparse_mla.dispatch.check_known_release``).

    Returns:
        The release version string, or ``None``.

    Raises:
        pytest.UsageError: not a version, or a release the grids do not cover.
    """
    if value is None or value.lower() in ("", "none"):
        return None
    from pytest_sparse_mla.dispatch import UnsupportedReleaseError, check_known_release

    try:
        return str(check_known_release(value))  # accepts X.Y.Z and flashinfer(-python)==X.Y.Z
    except UnsupportedReleaseError as exc:
        raise pytest.UsageError(f"--sparse-mla-grid={value!r}: {exc}") from None


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
    cli = config.getoption("sparse_mla_golden_dir", None)
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


def _output_path(config: pytest.Config, option: str) -> Path | None:
    """The resolved path of an output option (``--sparse-mla-report-json`` / ``-md``, ``--sparse-mla-xfail-draft``:
    a file in an existing directory; ``--sparse-mla-repro-dir``: a directory), or ``None`` when not given.

    Raises:
        pytest.UsageError: the report's folder does not exist; a file stands where the repro dir
            or one of its parents should be.
    """
    value = config.getoption(option.lstrip("-").replace("-", "_"), None)
    if not value:
        return None
    path = Path(value).resolve()
    if option in ("--sparse-mla-report-json", "--sparse-mla-report-md", "--sparse-mla-xfail-draft"):
        if not path.parent.is_dir():
            raise pytest.UsageError(
                f"{option}={value!r}: no such directory {path.parent}; expected a file path in an existing directory"
            )
        return path
    blocking = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise pytest.UsageError(
            f"{option}={value!r}: {blocking} exists and is not a directory; expected a directory "
            "(created with its parents when a reproducer is written; use a fresh one per run: a run adds to "
            "its index.jsonl)"
        )
    return path


def _seed(config: pytest.Config) -> int:
    text = config.getoption("sparse_mla_seed", None)
    if text is None:
        return 0
    try:
        return int(text)
    except (TypeError, ValueError):
        raise pytest.UsageError(f"--sparse-mla-seed={text!r}: expected an integer") from None


def _int_option(config: pytest.Config, name: str, default: int | None, low: int) -> int | None:
    """``--sparse-mla-<name>`` as an int ``>= low`` (``default`` when not given)."""
    text = config.getoption(name.replace("-", "_"), None)
    if text is None:
        return default
    try:
        value = int(text)
    except (TypeError, ValueError):
        value = low - 1
    if value < low:
        raise pytest.UsageError(f"--{name}={text!r}: expected an integer >= {low}")
    return value


def _shard_group(config: pytest.Config) -> shards.ShardGroup | None:
    """The session's shard group: ``--sparse-mla-search-shard-group``, else a non-empty
    ``SPARSE_MLA_SEARCH_SHARD_GROUP``, else ini ``sparse_mla_search_shard_group``, else ``None``.

    Raises:
        pytest.UsageError: the first one set is not ``I/N`` with ``0 <= I < N`` (the message names it).
    """
    given = (
        (shards.OPTION, config.getoption("sparse_mla_search_shard_group", None)),
        (shards.ENV, os.environ.get(shards.ENV) or None),
        (f"ini {shards.INI}", config.getini(shards.INI) or None),
    )
    for source, value in given:
        if value is not None:
            with usage_errors():
                return shards.parse_group(str(value), source)
    return None


def _tolerances(config: pytest.Config) -> dict[str, dict[str, Any]]:
    from pytest_sparse_mla import tolerances

    with usage_errors():
        parsed = tolerances.parse_ini_lines(list(config.getini("sparse_mla_tolerances")))
    return parsed


def from_config(config: pytest.Config, activated_by: str = "") -> SparseMlaOptions:
    """Parse every option and ini key of ``config`` (command line first, then ini values).

    Raises:
        pytest.UsageError: a bad device, grid release or seed, a missing xfail/skip file, a
            report path in a missing directory, a golden directory that does not exist (unless
            ``--snapshot-update`` will create it), a malformed ``sparse_mla_tolerances`` line, or a
            search shard group that is not ``I/N`` with ``0 <= I < N``.
    """
    impl_option = config.getoption("sparse_mla_impl", None) or config.getini("sparse_mla_impl")
    return SparseMlaOptions(
        device=parse_device(config.getoption("sparse_mla_device", None) or "auto"),
        seed=_seed(config),
        impl=impl_option or "reference",
        impl_given=bool(impl_option),
        grid=parse_grid(config.getoption("sparse_mla_grid", None)),
        require_gpu=bool(config.getoption("sparse_mla_require_gpu", False)),
        golden_dir=_golden_dir(config),
        xfail_file=_existing_file(
            "--sparse-mla-xfail-file", config.getoption("sparse_mla_xfail_file", None), config.rootpath
        ),
        skip_file=_existing_file(
            "--sparse-mla-skip-file", config.getoption("sparse_mla_skip_file", None), config.rootpath
        ),
        gpu_per_worker=not config.getoption("sparse_mla_no_gpu_pinning", False),
        timeout=parse_timeout(config.getoption("sparse_mla_timeout", None)),
        timeout_given=config.getoption("sparse_mla_timeout", None) is not None,
        report_json=_output_path(config, "--sparse-mla-report-json"),
        report_md=_output_path(config, "--sparse-mla-report-md"),
        xfail_draft=_output_path(config, "--sparse-mla-xfail-draft"),
        repro_dir=_output_path(config, "--sparse-mla-repro-dir"),
        tolerances=_tolerances(config),
        activated_by=activated_by,
        search_examples=_int_option(config, "sparse-mla-search-examples", 8, 0) or 0,
        search_seed=_int_option(config, "sparse-mla-search-seed", None, 0),
        search_shards=_int_option(config, "sparse-mla-search-shards", 1, 1) or 1,
        search_shard_group=_shard_group(config),
    )


def deployment_report_request(config: pytest.Config) -> tuple[str, str | None] | None:
    """``(format, grid release)`` when ``--sparse-mla-deployment-report`` is given, else ``None``
    (read in ``pytest_cmdline_main``, before the other options are parsed).

    Raises:
        pytest.UsageError: a bad ``--sparse-mla-grid``.
    """
    fmt = config.getoption("sparse_mla_deployment_report", None)
    if fmt is None:
        return None
    return str(fmt), parse_grid(config.getoption("sparse_mla_grid", None))


def is_active(config: pytest.Config) -> bool:
    """Whether the plugin is active in this session (configured by ``pytest_configure``)."""
    return OPTIONS_KEY in config.stash


def get_options(config: pytest.Config) -> SparseMlaOptions:
    """The parsed options of this session (defaults when the plugin is not active)."""
    return config.stash.get(OPTIONS_KEY, SparseMlaOptions())
