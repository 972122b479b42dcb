"""One table of call formats: adding an attention call format is adding one entry to
``formats.CALL_FORMATS``, and every list of call formats (the envelope's, the bundled reference's
backend choice, the FlashInfer grid's model, the shipped suites' parametrisations, the input space)
sees it without any other edit.

The new entry (``"dsv9"``: DSV4 records in both caches under another name, in every envelope, read
by the reference's torch backend only, judged as FlashInfer's DSV4) goes into a copy of the table
(``monkeypatch``); the modules that build their lists when imported are executed afresh over it.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from pytest_sparse_mla import data, envelope, formats
from pytest_sparse_mla.attention import sparse_mla_forward
from pytest_sparse_mla.dispatch import format_model, grid

ROOT = Path(__file__).resolve().parents[1]

NEW = formats.CallFormat(
    "dsv9", formats.DSV4, formats.DSV4, envelope=True, default_envelope=True, triton=False, grid_model="DSV4"
)
#: The call formats an envelope may name today, in the table's order, written out by hand.
KNOWN = ("dsv4", "dsv3_2", "dsv4_1")


@pytest.fixture
def new_format(monkeypatch: pytest.MonkeyPatch) -> None:
    """``formats.CALL_FORMATS`` with the ``"dsv9"`` entry added (a copy; the table is restored after)."""
    monkeypatch.setattr(formats, "CALL_FORMATS", {**formats.CALL_FORMATS, NEW.name: NEW})


def _fresh(monkeypatch: pytest.MonkeyPatch, name: str, path: Path | None = None) -> ModuleType:
    """Execute a module afresh (it reads the table as it is now); a package module stands in
    ``sys.modules`` for the rest of the test, so that what imports it next gets this copy."""
    spec = importlib.util.spec_from_file_location(name, path) if path is not None else importlib.util.find_spec(name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def _call(fmt: str) -> dict:
    g = torch.Generator().manual_seed(3)
    cache = data.make_packed_cache(g, fmt="dsv4", num_pages=3, page_block_size=64)
    return {
        "q": data.latent((4, 8, 512), g),
        "kv_cache": cache.packed,
        "indices": data.sparse_indices(4, 64, cache.num_tokens, g),
        "sm_scale": 512**-0.5,
        "fmt": fmt,
    }


def test_without_the_entry_no_list_takes_the_new_format() -> None:
    assert "dsv9" not in envelope.ALL_FORMATS
    with pytest.raises(ValueError, match=r"Envelope\(formats=\('dsv9',\)\)"):
        envelope.Envelope(formats=("dsv9",))
    with pytest.raises(ValueError, match="fmt='dsv9'"):
        sparse_mla_forward(**_call("dsv9"))
    with pytest.raises(ValueError, match="fmt='dsv9'"):
        format_model("dsv9", "0.7.4")


@pytest.mark.usefixtures("new_format")
def test_the_envelope_and_the_input_space_read_the_new_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    env = _fresh(monkeypatch, "pytest_sparse_mla.envelope")
    assert env.ALL_FORMATS == (*KNOWN, "dsv9")
    assert env.DEFAULT_FORMATS == ("dsv4", "dsv3_2", "dsv9")  # V4.1 stays out of the default
    assert env.UNIVERSAL.formats == env.DEFAULT_FORMATS and env.UNIVERSAL.takes_sink("dsv9")
    assert env.Envelope(formats=("dsv9",)).call_reason(fmt="dsv9", num_tokens=1, num_heads=8, topk=64) is None
    with pytest.raises(ValueError, match="dsv4_1_swa"):  # a reference-only entry stays out of envelopes
        env.Envelope(formats=("dsv4_1_swa",))
    space = _fresh(monkeypatch, "pytest_sparse_mla.input_space")
    assert space.DIMENSIONS[0].name == "fmt" and space.DIMENSIONS[0].legal.endswith("`dsv4_1`, `dsv9`")


@pytest.mark.usefixtures("new_format")
def test_the_reference_takes_the_new_format_on_the_backends_its_entry_names() -> None:
    expected = sparse_mla_forward(**_call("dsv4"), backend="torch")
    result = sparse_mla_forward(**_call("dsv9"))  # triton=False: the torch backend, even where CUDA runs
    assert torch.equal(result.output, expected.output) and torch.equal(result.lse, expected.lse)
    with pytest.raises(ValueError, match=r"backend='triton' with fmt='dsv9'.*\['dsv4', 'dsv3_2'\]"):
        sparse_mla_forward(**_call("dsv9"), backend="triton")
    judged = sparse_mla_forward(**_call("dsv9"), grid_release="0.7.4")
    assert judged.grid is not None and judged.grid.config.model == "DSV4" and judged.route == "decode"


@pytest.mark.usefixtures("new_format")
def test_the_grid_maps_the_new_format_to_its_model() -> None:
    assert format_model("dsv9", "0.7.4") == ("DSV4", None)
    assert format_model("dsv4_1", "0.7.4") == ("DSV4_1_INLINE", None)  # the release picks V4.1's reader


@pytest.mark.usefixtures("new_format")
def test_the_suites_parametrise_over_the_new_format(monkeypatch: pytest.MonkeyPatch) -> None:
    _fresh(monkeypatch, "pytest_sparse_mla.envelope")
    invariants = _fresh(monkeypatch, "fresh_invariants", ROOT / "suites" / "test_attention_invariants.py")
    assert invariants.FORMATS == [*KNOWN, "dsv9"]
    accuracy = _fresh(monkeypatch, "fresh_accuracy", ROOT / "suites" / "test_attention_accuracy.py")
    for test in (accuracy.test_lse_conventions, accuracy.test_empty_rows_give_zero_output_and_sentinel_lse):
        (fmts,) = [m.args[1] for m in test.pytestmark if m.name == "parametrize" and m.args[0] == "fmt"]
        assert list(fmts) == [*KNOWN, "dsv9"]


def test_every_grid_model_of_the_table_is_a_flashinfer_model_of_the_same_width() -> None:
    for entry in formats.CALL_FORMATS.values():
        if entry.grid_model is None:
            assert entry.no_grid, entry.name
        else:
            assert grid.MODELS[entry.grid_model].d_qk == entry.d_qk, entry.name


def test_no_module_writes_out_the_list_of_every_call_format() -> None:
    """No list, tuple or set literal of the package, the suites or the self-tests names exactly the
    call formats an envelope may name (the table in ``formats.py`` is the one place; this file's
    :data:`KNOWN` is the hand-written expectation)."""
    every = set(envelope.ALL_FORMATS)
    hits = []
    for folder in ("pytest_sparse_mla", "suites", "tests", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.resolve() == Path(__file__).resolve():
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.List, ast.Tuple, ast.Set)) and node.elts:
                    values = [e.value for e in node.elts if isinstance(e, ast.Constant)]
                    if len(values) == len(node.elts) and set(values) == every:
                        hits.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert hits == [], "hand-written lists of every call format (read envelope.ALL_FORMATS):\n" + "\n".join(hits)
