"""The built-in implementations as data: one :class:`Builtin` entry per ``--sparse-mla-impl`` name.

Every place that lists the built-ins or the peers reads :data:`BUILTINS` (nothing else enumerates
them): ``implementations.registry.BUILTINS`` (the factories), ``options.BUILTIN_NAMES`` (``--help``),
``tests/test_architecture.py`` (every adapter module is core: it must not import pytest),
``scripts/device_conformance.sh`` (its default implementations), ``scripts/peers_env.sh`` (the carried
source directories, the peers' status), ``scripts/peer_suites.py`` (tox's ``peers-gpu`` lane),
``scripts/conformance_report.py`` (the peers, their version labels), ``pytest_sparse_mla.conformance``
(the report's line of peer sources) and ``tests/test_peer_lanes.py`` (the CPU lanes). Adding a peer
is an adapter module, its xfail file and one entry here (CONTRIBUTING.md, "Add a peer";
``tests/test_catalogue.py`` adds one and checks that every consumer sees it).

Standard library only: ``options`` reads the names while pytest registers the options, which must
import neither torch nor the adapters (``tests/test_papercuts.py``), and the shell scripts read the
lists through ``python3 -m pytest_sparse_mla.catalogue LIST`` (:func:`main`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

__all__ = ["BUILTINS", "Builtin", "NAMES", "Source", "by_name", "conformance_names", "main", "peer_names", "sources"]


@dataclass(frozen=True)
class Source:
    """Where a peer's code comes from on a conformance run, as ``machine.json`` records it and the
    report names it.

    Attributes:
        key: the ``machine.json`` key holding it (``"vllm_source"``; a list of lines, or a version).
        label: the project's name in the report (``"vLLM"``).
        line: the report's words for it, ``{}`` standing for the recorded value
            (``"vLLM {}"``; ``pytest_sparse_mla.conformance``).
        missing: the words when nothing was recorded (``"not carried"``).
        dist: an installed distribution whose version is recorded (``"sglang"``), or ``None``.
        file: a file naming the source (repository, commit, files), read into ``key``: a path
            relative to the checkout, or under ``{PEERS_DIR}`` (``scripts/peers_env.sh``), or ``None``.
        carried: a directory of the checkout that ``scripts/peers_env.sh`` puts on ``PYTHONPATH``
            when it exists (the peer's source files carried to a machine without network), or ``None``.
    """

    key: str
    label: str
    line: str
    missing: str = "not carried"
    dist: str | None = None
    file: str | None = None
    carried: str | None = None


@dataclass(frozen=True)
class Builtin:
    """One built-in implementation.

    Attributes:
        name: the ``--sparse-mla-impl`` name (``"vllm-triton"``).
        adapter: ``"module:Class"`` of its adapter; the class is instantiated without arguments, or
            with the session's ``--sparse-mla-grid`` release when ``takes_grid``.
        takes_grid: the class takes ``grid`` (the bundled reference and the Triton split).
        source: a peer's :class:`Source` (a kernel of another project, judged by the conformance
            run with its xfail file ``pytest_sparse_mla/xfail/<name>.txt``); ``None`` for this
            project's own implementations.
        conformance: judged by a conformance run although not a peer (the reference, the run's
            baseline); every peer is (:func:`conformance_names`).
        wheel: the pip requirement a lane installs, ``--no-deps``, for it (``"sglang==0.5.23"``), or ``None``.
        cpu_lane: it runs on a CPU: the self-tests judge it by the whole suite with its xfail file
            (``tests/test_peer_lanes.py``), and README's test command installs its ``wheel``.
    """

    name: str
    adapter: str
    takes_grid: bool = False
    source: Source | None = None
    conformance: bool = False
    wheel: str | None = None
    cpu_lane: bool = False

    @property
    def module(self) -> str:
        """The adapter's module (``"pytest_sparse_mla.implementations.vllm_triton"``)."""
        return self.adapter.partition(":")[0]

    @property
    def attribute(self) -> str:
        """The adapter class's name in :attr:`module`."""
        return self.adapter.partition(":")[2]

    @property
    def is_peer(self) -> bool:
        """A peer's adapter (it has a :attr:`source`, and an xfail file)."""
        return self.source is not None

    @property
    def xfail_file(self) -> str | None:
        """A peer's shipped xfail file, relative to the package (``"xfail/vllm-triton.txt"``), or ``None``."""
        return f"xfail/{self.name}.txt" if self.is_peer else None


_HERE = "pytest_sparse_mla.implementations"
_SGLANG = Source(
    key="sglang", label="SGLang", line="SGLang {} (wheel from PyPI, installed --no-deps)", missing="not installed",
    dist="sglang", carried=".peers/sglang",
)  # fmt: skip

#: The built-ins, in ``--help`` and report order.
BUILTINS: tuple[Builtin, ...] = (
    Builtin("reference", f"{_HERE}.builtin:ReferenceImplementation", takes_grid=True, conformance=True),
    Builtin("triton", f"{_HERE}.builtin:TritonImplementation", takes_grid=True),
    Builtin("flashinfer", f"{_HERE}.flashinfer:FlashInferImplementation"),
    Builtin("sglang-triton", f"{_HERE}.sglang:SglangTritonImplementation", source=_SGLANG, wheel="sglang==0.5.23"),
    Builtin(
        "sglang-torch", f"{_HERE}.sglang:SglangTorchImplementation", source=_SGLANG,
        wheel="sglang==0.5.23", cpu_lane=True,
    ),
    Builtin(
        "flashmla", f"{_HERE}.flashmla:FlashMlaImplementation",
        source=Source(
            key="flashmla_source", label="FlashMLA", line="FlashMLA {}, built with FLASH_MLA_DISABLE_SM100=1",
            missing="not built", file="{PEERS_DIR}/flashmla/PEER_SOURCE.txt",
        ),
    ),
    Builtin(
        "flaggems", f"{_HERE}.flaggems:FlagGemsImplementation",
        source=Source(
            key="flaggems_source", label="FlagGems", line="FlagGems {} (source files)",
            file=".peers/flaggems/SOURCE", carried=".peers/flaggems/src",
        ),
    ),
    Builtin(
        "vllm-triton", f"{_HERE}.vllm_triton:VllmTritonImplementation",
        source=Source(
            key="vllm_source", label="vLLM", line="vLLM {}", file=".peers/vllm/SOURCE", carried=".peers/vllm",
        ),
    ),
    Builtin(
        "flashinfer-reference", f"{_HERE}.flashinfer_reference:FlashInferReferenceImplementation",
        wheel="flashinfer-python==0.7.2.post1", cpu_lane=True,
        source=Source(
            key="flashinfer_reference_source", label="FlashInfer", line="FlashInfer references: {}",
            file=".peers/flashinfer/SOURCE", carried=".peers/flashinfer",
        ),
    ),
    Builtin(
        "sglang-dsv4-triton", f"{_HERE}.sglang_dsv4:SglangDsv4TritonImplementation", source=_SGLANG,
        wheel="sglang==0.5.23",
    ),
    Builtin(
        "sglang-dsv4-tilelang", f"{_HERE}.sglang_dsv4:SglangDsv4TileLangImplementation", source=_SGLANG,
        wheel="sglang==0.5.23",
    ),
    Builtin(
        "sglang-dsa-triton", f"{_HERE}.sglang_dsa:SglangDsaTritonImplementation", source=_SGLANG,
        wheel="sglang==0.5.23",
    ),
    Builtin(
        "sglang-dsa-tilelang", f"{_HERE}.sglang_dsa:SglangDsaTileLangImplementation", source=_SGLANG,
        wheel="sglang==0.5.23",
    ),
    Builtin(
        "sglang-q8kv8-sm90", f"{_HERE}.sglang_q8kv8:SglangQ8Kv8Implementation", source=_SGLANG,
        wheel="sglang==0.5.23",
    ),
    # A new built-in is one entry here (CONTRIBUTING.md, "Add a peer").
)  # fmt: skip

#: The built-ins' names, in order.
NAMES: tuple[str, ...] = tuple(entry.name for entry in BUILTINS)


def by_name(name: str) -> Builtin:
    """The entry of ``name``.

    Raises:
        KeyError: no built-in is called ``name`` (the message lists them).
    """
    for entry in BUILTINS:
        if entry.name == name:
            return entry
    raise KeyError(f"{name!r} is not a built-in implementation: expected one of {', '.join(NAMES)}")


def peer_names() -> tuple[str, ...]:
    """The peers' names (the built-ins with a :class:`Source`), in order."""
    return tuple(entry.name for entry in BUILTINS if entry.is_peer)


def conformance_names() -> tuple[str, ...]:
    """The implementations a conformance run judges by default (``scripts/device_conformance.sh``),
    in report order (``scripts/conformance_report.py``): the entries marked ``conformance`` and every peer."""
    return tuple(entry.name for entry in BUILTINS if entry.conformance or entry.is_peer)


def sources() -> tuple[Source, ...]:
    """The peers' sources, each once (peers may share one: SGLang's two adapters), in order."""
    found: list[Source] = []
    for entry in BUILTINS:
        if entry.source is not None and entry.source not in found:
            found.append(entry.source)
    return tuple(found)


_LISTS = {
    "names": lambda: NAMES,
    "peers": peer_names,
    "conformance": conformance_names,
    "carried": lambda: tuple(s.carried for s in sources() if s.carried),
    "wheels": lambda: tuple(dict.fromkeys(entry.wheel for entry in BUILTINS if entry.wheel)),
}


def main(argv: list[str] | None = None) -> int:
    """``python -m pytest_sparse_mla.catalogue LIST``: one item per line, for shell
    scripts. ``LIST``: ``names`` (every built-in), ``peers``, ``conformance`` (a conformance run's
    default implementations), ``carried`` (the peers' carried source directories), ``wheels`` (the
    pip requirements of the peers installed from a wheel). Returns the exit status (2: another ``LIST``)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in _LISTS:
        print(f"usage: python -m {_HERE}.catalogue {{{','.join(_LISTS)}}} (got {args!r})", file=sys.stderr)
        return 2
    for item in _LISTS[args[0]]():
        print(item)
    return 0


if __name__ == "__main__":
    sys.exit(main())
