"""The implementation protocol as ``typing.Protocol`` classes (``implementations.protocol``): checked
at run time by the resolution, and statically by a type checker for downstream adapters."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

# Imported up front: pytester's in-process runs restore sys.modules afterwards (see test_plugin).
import torch

from pytest_sparse_mla import implementations
from pytest_sparse_mla.implementations import registry
from pytest_sparse_mla.implementations.protocol import (
    CAPABILITY_PROTOCOLS,
    Packer,
    SparseMlaForward,
    SparseMlaImplementation,
    SparseMlaResult,
)

PACKAGE_PARENT = Path(implementations.__file__).resolve().parents[2]


def test_the_builtins_follow_the_protocol() -> None:
    reference = implementations.ReferenceImplementation()
    assert isinstance(reference, SparseMlaImplementation)
    assert isinstance(implementations.FlashInferImplementation(), SparseMlaForward)
    assert not isinstance(implementations.FlashInferImplementation(), Packer)
    assert set(CAPABILITY_PROTOCOLS) == set(implementations.CAPABILITIES)


def test_the_reference_result_is_a_protocol_result() -> None:
    from pytest_sparse_mla import data, formats

    g = torch.Generator().manual_seed(1)
    cache = formats.quantize_pack(data.latent((1, 64, 512), g), "dsv4", page_stride="padded")
    res = implementations.ReferenceImplementation().sparse_mla_forward(
        data.latent((2, 4, 512), g), cache, data.sparse_indices(2, 64, 64, g), sm_scale=512**-0.5
    )
    assert isinstance(res, SparseMlaResult)
    assert res.output.shape == (2, 4, 512) and res.lse.shape == (2, 4)


@pytest.mark.parametrize(
    ("obj", "provides"),
    [
        (SimpleNamespace(pack=print), ["pack"]),
        (SimpleNamespace(page_split=print, sparse_mla_forward=print), ["page_split", "sparse_mla_forward"]),
        (SimpleNamespace(pack="not callable"), []),
    ],
)
def test_capabilities_are_read_through_the_protocols(obj: object, provides: list[str]) -> None:
    found = [
        cap for cap, proto in CAPABILITY_PROTOCOLS.items() if isinstance(obj, proto) and callable(getattr(obj, cap))
    ]
    assert found == provides
    if not provides:
        with pytest.raises(pytest.UsageError, match="provides none of pack, page_split, sparse_mla_forward"):
            registry._check_provides_something(obj, "x")  # noqa: SLF001


GOOD = """
from __future__ import annotations

from typing import Any

from pytest_sparse_mla.implementations.protocol import PageSplitter, SparseMlaForward, SparseMlaResult


class Kernel:
    name = "k"

    def sparse_mla_forward(
        self, q: Any, kv_cache: Any, indices: Any, *, sm_scale: float, **kwargs: Any
    ) -> SparseMlaResult:
        raise NotImplementedError

    def page_split(self, kv_cache: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


forward: SparseMlaForward = Kernel()
split: PageSplitter = Kernel()
"""

BAD = """
from __future__ import annotations

from typing import Any

from pytest_sparse_mla.implementations.protocol import SparseMlaForward


class Kernel:
    def sparse_mla_forward(self, q: Any, kv_cache: Any, indices: Any, scale: float) -> Any:
        raise NotImplementedError


forward: SparseMlaForward = Kernel()
"""


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="needs mypy (the dev extra)")
def test_a_type_checker_checks_a_downstream_adapter_against_the_protocol(tmp_path: Path) -> None:
    """An adapter whose forward takes ``(q, kv_cache, indices, *, sm_scale, **kwargs)`` fits; one
    that takes a positional ``scale`` instead does not, and mypy says which member conflicts."""
    (tmp_path / "good.py").write_text(GOOD)
    (tmp_path / "bad.py").write_text(BAD)
    # MYPYPATH: an editable install is found through an import hook, which mypy does not run.
    env = {"MYPYPATH": str(PACKAGE_PARENT), "PATH": "/usr/bin:/bin"}
    args = [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--cache-dir", str(tmp_path / "c")]
    good = subprocess.run([*args, "good.py"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert good.returncode == 0, good.stdout
    bad = subprocess.run([*args, "bad.py"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert bad.returncode == 1
    assert 'expression has type "Kernel", variable has type "SparseMlaForward"' in bad.stdout
    assert "sparse_mla_forward" in bad.stdout
