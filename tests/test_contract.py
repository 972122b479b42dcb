"""``docs/contract.md`` is the code's contract: its tables are parsed and held to the code.

* The argument tables of ``sparse_mla_forward``, ``pack`` and ``page_split`` list exactly the
  parameters of the protocol signatures (``implementations.protocol``), in order, with their
  defaults; the forward's keywords are also ``attention.call.CALL_ARGUMENTS`` and those of
  ``SparseMlaCall.read``. The dtypes the forward's table states are accepted by the bundled
  reference's checks, and another dtype is refused with a ``TypeError`` naming the argument.
* The format tables state the bytes per token, ``d_qk`` and ``d_v`` of ``formats``; the bytes per
  token also agree with a count of each record's fields written out here; the call formats pair
  the record formats of ``formats.cache_formats``; the tensor forms have the shapes
  ``formats.as_form`` builds; the padded strides are ``formats.page_stride_bytes``; the split's
  byte counts are the constants of ``page_split.geometry``.
* Every ``num_tokens <= N`` of the document is the decode cutoff ``conventions.DECODE_MAX_TOKENS``.
* The LSE table lists ``conventions.LSE_CONVENTIONS``; its log bases, sink handling, ``lse_scale``
  rule and empty-row sentinels are what the bundled reference returns for zero queries (every
  score 0, so the LSE of ``n`` lanes is ``ln n`` by hand).
* The bad-input table is the suite's ``BAD_INPUTS``; the bundled reference raises the stated error
  type, naming the stated argument, for each.
* The ``Envelope`` table lists exactly ``dataclasses.fields(Envelope)`` with their defaults, and for
  a field with a closed set of values exactly that set (its ``Literal`` type,
  ``INVARIANCE_CLAIMS``, or ``ALL_FORMATS`` for the format tuples ``Envelope`` validates); every
  documented value is accepted and an unknown one refused. Likewise ``Widths``.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import typing
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_sparse_mla import envelope, formats, page_split
from pytest_sparse_mla.attention import conventions, sparse_mla_forward
from pytest_sparse_mla.attention.call import CALL_ARGUMENTS, SparseMlaCall
from pytest_sparse_mla.attention.cases import make_inputs
from pytest_sparse_mla.implementations import protocol
from pytest_sparse_mla.suites import test_attention_inputs as inputs_suite

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "contract.md"

Table = list[dict[str, str]]


def _cells(line: str) -> list[str]:
    """The cells of a Markdown table row (``\\|`` is a pipe inside a cell)."""
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def _tables() -> dict[str, Table]:
    """Every table of the document, keyed by the heading right above it (backticks dropped)."""
    tables: dict[str, Table] = {}
    heading, fenced = "", False
    lines = DOC.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            heading = line.lstrip("#").strip().replace("`", "")
        elif not fenced and line.startswith("|") and i + 1 < len(lines) and set(lines[i + 1]) <= set("|-: "):
            header = _cells(line)
            rows: Table = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                cells = _cells(lines[i])
                assert len(cells) == len(header), f"{heading!r}: row {cells} has not {len(header)} cells"
                rows.append(dict(zip(header, cells, strict=True)))
                i += 1
            assert heading not in tables, f"two tables under the heading {heading!r}"
            tables[heading] = rows
            continue
        i += 1
    return tables


TABLES = _tables()


def _table(heading: str) -> Table:
    assert heading in TABLES, f"docs/contract.md has no table under {heading!r}: {sorted(TABLES)}"
    return TABLES[heading]


def _code(cell: str) -> str:
    """The text of a cell that is one code span."""
    match = re.fullmatch(r"`([^`]*)`", cell)
    assert match, f"expected one `code` span, got {cell!r}"
    return match.group(1)


def _spans(cell: str) -> list[str]:
    """Every code span of a cell."""
    return re.findall(r"`([^`]+)`", cell)


def _by_first_column(heading: str) -> dict[str, dict[str, str]]:
    rows = _table(heading)
    first = next(iter(rows[0]))
    return {_code(row[first]): row for row in rows}


# --- the protocol's methods -------------------------------------------------------------------------


def _parameters(method: Any) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(method).parameters.values() if p.name != "self"]


@pytest.mark.parametrize(
    ("method", "heading"),
    [
        (protocol.SparseMlaForward.sparse_mla_forward, "Arguments of sparse_mla_forward"),
        (protocol.Packer.pack, "Arguments of pack"),
        (protocol.PageSplitter.page_split, "Arguments of page_split"),
    ],
    ids=["sparse_mla_forward", "pack", "page_split"],
)
def test_each_argument_table_is_the_protocol_signature_with_its_defaults(method: Any, heading: str) -> None:
    rows = _table(heading)
    params = _parameters(method)
    assert [_code(r["argument"]) for r in rows] == [p.name for p in params]
    for row, param in zip(rows, params, strict=True):
        want = "required" if param.default is inspect.Parameter.empty else f"`{param.default!r}`"
        assert row["default"] == want, f"{param.name}: the table says {row['default']}, the protocol {want}"


def test_the_forward_table_lists_the_arguments_the_call_reads() -> None:
    names = [_code(r["argument"]) for r in _table("Arguments of sparse_mla_forward")]
    assert names == ["q", "kv_cache", "indices", *CALL_ARGUMENTS]
    read = [p.name for p in _parameters(SparseMlaCall.read) if p.name not in ("cls", "validate")]
    assert names == read
    keyword_only = [
        p.name
        for p in _parameters(protocol.SparseMlaForward.sparse_mla_forward)
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    assert keyword_only == list(CALL_ARGUMENTS)


DTYPES = {"BF16": torch.bfloat16, "fp32": torch.float32, "int32": torch.int32, "uint8": torch.uint8}


def test_the_stated_dtypes_are_the_ones_the_reference_accepts() -> None:
    """A call built from the table's dtypes passes the bundled reference's checks; each tensor in
    another dtype is a ``TypeError`` naming it."""
    rows = _by_first_column("Arguments of sparse_mla_forward")
    dtype = {name: DTYPES[row["dtype"]] for name, row in rows.items() if row["dtype"] in DTYPES}
    tensors = {"q", "kv_cache", "indices", "topk_length", "attn_sink", "extra_kv_cache", "extra_indices",
               "extra_topk_length"}  # fmt: skip
    assert set(dtype) == tensors, f"a tensor argument without a dtype of {sorted(DTYPES)}: {tensors - set(dtype)}"
    g = torch.Generator().manual_seed(3)
    source = (torch.randn((2, 4, 512), generator=g) / 10).to(torch.bfloat16)
    packed = formats.quantize_pack(source, "dsv4")
    t, h = 3, 2
    call: dict[str, Any] = {
        "q": torch.zeros((t, h, 512), dtype=dtype["q"]),
        "kv_cache": packed.view(dtype["kv_cache"]),
        "indices": torch.tensor([[0, 5, -1]] * t).to(dtype["indices"]),
        "topk_length": torch.full((t,), 2).to(dtype["topk_length"]),
        "attn_sink": torch.zeros(h, dtype=dtype["attn_sink"]),
        "extra_kv_cache": packed.view(dtype["extra_kv_cache"]),
        "extra_indices": torch.tensor([[7, 1]] * t).to(dtype["extra_indices"]),
        "extra_topk_length": torch.full((t,), 1).to(dtype["extra_topk_length"]),
    }

    def read(**over: Any) -> SparseMlaCall:
        kw = {**call, **over}
        q, kv_cache, indices = kw.pop("q"), kw.pop("kv_cache"), kw.pop("indices")
        return SparseMlaCall.read(q, kv_cache, indices, sm_scale=512**-0.5, fmt="dsv4", validate=True, **kw)

    read()
    for name in sorted(tensors):
        other = call[name].view(torch.int8) if call[name].element_size() == 1 else call[name].to(torch.float64)
        with pytest.raises(TypeError) as excinfo:
            read(**{name: other})
        assert re.search(rf"\b{name}\b", str(excinfo.value)), str(excinfo.value)


# --- formats ----------------------------------------------------------------------------------------

#: Bytes per token, counted by hand from each record's fields.
HAND_COUNTED = {
    "dsv4": 448 + 64 * 2 + 7 + 1,  # E4M3 NoPE codes, BF16 RoPE, 7 UE8M0 scales + 1 pad byte
    "dsv3_2": 512 + 4 * 4 + 64 * 2,  # E4M3 NoPE codes, 4 fp32 scales, BF16 RoPE
    "dsv4_1_swa": 512 + 16,  # E4M3 codes, 16 UE8M0 scales
    "dsv4_1_indexed": 512 // 2 + 32,  # E2M1 codes two per byte, 32 E4M3 scales
}


def test_record_formats_are_the_code_s() -> None:
    rows = _by_first_column("Record formats")
    assert set(rows) == set(formats.FORMATS) == set(HAND_COUNTED)
    for name, row in rows.items():
        f = formats.FORMATS[name]
        assert int(row["bytes per token"]) == f.bytes_per_token == HAND_COUNTED[name], name
        assert (int(row["d_qk"]), int(row["d_v"]), row["layout"]) == (f.d_qk, f.d_v, f.layout), name


def test_call_formats_pair_the_record_formats_and_fix_the_query_width() -> None:
    rows = _by_first_column("Call formats")
    assert set(rows) == set(formats.CALL_FORMATS)
    for name, row in rows.items():
        main, extra = formats.cache_formats(name)
        assert (_code(row["kv_cache records"]), _code(row["extra_kv_cache records"])) == (main.name, extra.name)
        assert int(row["q width (d_qk)"]) == main.d_qk, name


@pytest.mark.parametrize("heading", ["Arguments of sparse_mla_forward", "Arguments of pack"])
def test_every_stated_query_width_is_the_format_s(heading: str) -> None:
    """``512 for `dsv4` and `dsv4_1`, 576 for `dsv3_2``` in the ``q`` / ``source`` rows."""
    row = _table(heading)[0]
    pairs = re.findall(r"(\d+) for ((?:`[a-z0-9_]+`(?: and )?)+)", row["units and values"])
    named = {fmt: int(width) for width, group in pairs for fmt in _spans(group)}
    assert {"dsv4", "dsv3_2"} <= set(named), row["units and values"]
    for fmt, width in named.items():
        assert formats.cache_formats(fmt)[0].d_qk == width, fmt


def test_the_output_width_is_every_format_s_d_v() -> None:
    shape = _by_first_column("Result")["output"]["shape"]
    width = int(re.fullmatch(r"`\[T, H, (\d+)\]`", shape).group(1))
    assert {f.d_v for f in formats.FORMATS.values()} == {width}


def test_tensor_forms_have_the_shapes_the_code_builds() -> None:
    rows = _by_first_column("Tensor forms")
    assert list(rows) == list(formats.FORMS)
    sizes = {"P": 3, "ps": 4, "B": formats.DSV4.bytes_per_token, "1": 1}
    buffer = torch.zeros((3, 4 * 584), dtype=torch.uint8)
    for form, row in rows.items():
        terms = [t.strip() for t in _code(row["shape"]).strip("[]").split(",")]
        shape = tuple(math.prod(sizes[f] for f in term.split("*")) for term in terms)
        assert tuple(formats.as_form(buffer, "dsv4", 4, form).shape) == shape, form


def test_padded_strides_are_the_code_s() -> None:
    rows = _table("Page strides")
    assert rows
    for row in rows:
        fmt, ps = _code(row["format"]), int(row["page_block_size"])
        assert formats.page_stride_bytes(fmt, ps, "padded") == int(row["padded page stride (bytes)"]), (fmt, ps)


def test_the_split_geometry_is_the_code_s() -> None:
    rows = _table("Split geometry")
    hand = {
        "SUB_PAGE_DATA_BYTES": 64 * 576,
        "SUB_PAGE_SCALE_BYTES": 64 * 8,
        "DST_PAGE_BYTES": 64 * 584,
        "DST_PAGE_STRIDE": -(-64 * 584 // 576) * 576,
    }
    assert {_code(r["constant"]) for r in rows} == set(hand)
    for row in rows:
        name = _code(row["constant"])
        assert int(row["bytes"]) == getattr(page_split, name) == hand[name], name


# --- routes and LSE ----------------------------------------------------------------------------------


def test_the_decode_cutoff_is_the_code_s() -> None:
    rows = _by_first_column("Routes")
    assert set(rows) == {"decode", "prefill"}
    decode = int(re.fullmatch(r"`num_tokens <= (\d+)`", rows["decode"]["num_tokens"]).group(1))
    prefill = int(re.fullmatch(r"`num_tokens > (\d+)`", rows["prefill"]["num_tokens"]).group(1))
    assert decode == prefill == conventions.DECODE_MAX_TOKENS == envelope.DECODE_MAX_TOKENS
    assert conventions.route_for(decode) == envelope.route_of(decode) == "decode"
    assert conventions.route_for(decode + 1) == envelope.route_of(decode + 1) == "prefill"
    stated = re.findall(r"(?:num_tokens|\bT) <= (\d+)", DOC.read_text())
    assert stated and {int(n) for n in stated} == {conventions.DECODE_MAX_TOKENS}


def _lse_call(convention: str, sink: float | None, lse_scale: float) -> Any:
    """Token 0 reads 3 lanes (slot 1 twice), token 1 none; zero queries make every score 0, so token
    0's natural-log LSE without sink is ``ln 3``."""
    g = torch.Generator().manual_seed(5)
    packed = formats.quantize_pack((torch.randn((1, 2, 512), generator=g) / 10).to(torch.bfloat16), "dsv4")
    q = torch.zeros((2, 1, 512), dtype=torch.bfloat16)
    indices = torch.tensor([[0, 1, 1], [-1, -1, -1]], dtype=torch.int32)
    attn_sink = None if sink is None else torch.tensor([sink], dtype=torch.float32)
    return sparse_mla_forward(
        q, packed, indices, sm_scale=512**-0.5, attn_sink=attn_sink, lse_convention=convention, lse_scale=lse_scale
    )


def test_the_lse_conventions_are_what_the_reference_returns() -> None:
    rows = _by_first_column("LSE conventions")
    assert list(rows) == list(conventions.LSE_CONVENTIONS)
    for convention, row in rows.items():
        base = {"2": 2.0, "e": math.e}[row["log base"]]
        included = {"included": True, "excluded": False}[row["sink"]]
        if row["lse_scale"] == "multiplies the LSE":
            scale = 0.5
        else:
            assert row["lse_scale"] == "must be 1", row["lse_scale"]
            scale = 1.0
            with pytest.raises(ValueError, match="lse_scale"):
                _lse_call(convention, None, 0.5)
        for sink in (None, -math.inf, 0.5):
            res = _lse_call(convention, sink, scale)
            mass = 3.0 + (math.exp(sink) if sink is not None and included else 0.0)
            assert float(res.lse[0, 0]) == pytest.approx(math.log(mass) / math.log(base) * scale, rel=1e-6)
            assert bool((res.output[1] == 0).all()), f"{convention}, sink {sink}: an empty row's output is not 0"
            cell = row["empty row, finite sink"] if sink not in (None, -math.inf) else row[
                "empty row, no sink or a -inf sink"
            ]  # fmt: skip
            names = {"sink": sink, "lse_scale": scale, "log2": math.log2, "e": math.e, "inf": math.inf}
            want = eval(_code(cell), {"__builtins__": {}}, names)  # a formula of the document, e.g. `-inf`
            assert float(res.lse[1, 0]) == pytest.approx(want, rel=1e-6), (convention, sink, cell)


# --- refusals ----------------------------------------------------------------------------------------


def test_the_bad_input_table_is_the_suite_s_and_the_reference_raises_what_it_says() -> None:
    rows = _by_first_column("Bad input")
    assert list(rows) == list(inputs_suite.BAD_INPUTS)
    inputs = make_inputs(inputs_suite.CASE, torch.Generator().manual_seed(0))
    for name, row in rows.items():
        argument, _, mutate = inputs_suite.BAD_INPUTS[name]
        assert _code(row["the message names"]) == argument, name
        args: list[Any] = [inputs.q, inputs.cache.packed, inputs.indices]
        kwargs = inputs.kwargs()
        mutate(inputs, args, kwargs)
        with pytest.raises((TypeError, ValueError)) as excinfo:
            sparse_mla_forward(*args, **kwargs)
        assert type(excinfo.value).__name__ == _code(row["error"]), f"{name}: {excinfo.value!r}"
        assert re.search(rf"\b{argument}\b", str(excinfo.value)), f"{name}: {excinfo.value}"


# --- the Envelope ------------------------------------------------------------------------------------

FORMAT_TUPLES = tuple[str, ...]


def _literals(hint: Any) -> tuple[str, ...]:
    """The values of the ``Literal`` inside ``hint`` (``Literal[...]`` or ``tuple[Literal[...], ...]``)."""
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    return tuple(v for arg in typing.get_args(hint) for v in _literals(arg))


def _refused(**kwargs: Any) -> bool:
    try:
        envelope.Envelope(**kwargs)
    except (TypeError, ValueError):
        return True
    return False


def _as_field_value(hint: Any, value: str) -> Any:
    origin = typing.get_origin(hint)
    return (value,) if origin is tuple else frozenset({value}) if origin is frozenset else value


def _closed_values(name: str, hint: Any) -> tuple[str, ...] | None:
    """The closed set of values of an ``Envelope`` field, from the code; ``None`` for an open one."""
    literal = _literals(hint)
    if literal:
        return literal
    if hint == frozenset[str]:
        return envelope.INVARIANCE_CLAIMS
    if hint == FORMAT_TUPLES and _refused(**{name: ("no-such-format",)}):
        return envelope.ALL_FORMATS
    return None


@pytest.mark.parametrize(
    ("cls", "heading"), [(envelope.Envelope, "Envelope fields"), (envelope.Widths, "Widths fields")]
)
def test_the_field_tables_list_exactly_the_fields_and_their_defaults(cls: type, heading: str) -> None:
    rows = _table(heading)
    fields = dataclasses.fields(cls)
    assert [_code(r["field"]) for r in rows] == [f.name for f in fields]
    for row, f in zip(rows, fields, strict=True):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert row["default"] == f"`{default!r}`", f"{f.name}: the table says {row['default']}, the code {default!r}"


def test_the_envelope_table_gives_exactly_the_allowed_values_of_every_closed_field() -> None:
    hints = typing.get_type_hints(envelope.Envelope)
    rows = _by_first_column("Envelope fields")
    closed = {name: _closed_values(name, hints[name]) for name in rows}
    closed = {name: values for name, values in closed.items() if values is not None}
    assert {"topk_length_range", "masked_indices", "index_past_cache", "lse_conventions", "formats"} <= set(closed)
    for name, values in closed.items():
        stated = _spans(rows[name]["allowed values"])
        assert sorted(stated) == sorted(values), f"{name}: the table says {stated}, the code {values}"
        for value in stated:
            assert not _refused(**{name: _as_field_value(hints[name], value)}), f"{name}={value!r} refused"
        assert _refused(**{name: _as_field_value(hints[name], "no-such-value")}), name


# --- the cache helpers a kernel author uses ---------------------------------------------------------


def _signature_text(name: str) -> str:
    """``formats.NAME(...)`` as the document writes it, built from the code's signature: a default
    that is a record format is named by its ``formats`` constant, a string in double quotes."""
    parts, star = [], False
    for p in inspect.signature(getattr(formats, name)).parameters.values():
        if p.kind is inspect.Parameter.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if p.default is inspect.Parameter.empty:
            parts.append(p.name)
        elif isinstance(p.default, formats.PackedFormat):
            constant = next(k for k, v in vars(formats).items() if v is p.default and k.isupper())
            parts.append(f"{p.name}=formats.{constant}")
        else:
            parts.append(f"{p.name}={json_repr(p.default)}")
    return f"formats.{name}({', '.join(parts)})"


def json_repr(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


@pytest.mark.parametrize("name", ["parse_cache", "unpack_dequantize"])
def test_the_cache_helpers_are_named_with_their_signatures(name: str) -> None:
    """The contract names ``formats.parse_cache`` and ``formats.unpack_dequantize`` with the code's
    signatures (keywords and defaults), and its table lists their keyword-only arguments."""
    text = DOC.read_text()
    assert _signature_text(name) in " ".join(text.split()), _signature_text(name)
    row = _by_first_column("Reading a cache")[name]
    keywords = [
        p.name
        for p in inspect.signature(getattr(formats, name)).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    assert _spans(row["keyword-only arguments"]) == keywords


@pytest.mark.parametrize("fmt", ["dsv4", "dsv3_2", "dsv4_1_swa", "dsv4_1_indexed"])
@pytest.mark.parametrize("form", ["2d", "3d", "hnd", "nhd"])
def test_the_cache_helpers_return_what_the_contract_says(fmt: str, form: str) -> None:
    """``parse_cache`` returns a ``CacheLayout`` with the fields and properties the contract names
    (``num_tokens`` = pages x page size); ``unpack_dequantize`` returns ``[num_pages, page_block_size,
    d_qk]`` fp32 by default, the given ``dtype`` otherwise, the same values from a given ``layout``."""
    from pytest_sparse_mla import data

    cache = data.make_packed_cache(torch.Generator().manual_seed(1), fmt=fmt, num_pages=3, page_block_size=16,
                                   page_stride="tight", form=form)  # fmt: skip
    layout = formats.parse_cache(cache.packed, fmt)
    f = formats.record_format(fmt)
    assert (layout.fmt, layout.form, layout.num_pages, layout.page_block_size) == (f, form, 3, 16)
    assert layout.num_tokens == 48 and layout.page_bytes == 16 * layout.token_stride
    rows = formats.unpack_dequantize(cache.packed, fmt)
    assert rows.shape == (3, 16, f.d_qk) and rows.dtype == torch.float32
    assert torch.equal(formats.unpack_dequantize(cache.packed, layout=layout, dtype=torch.float64), rows.double())
    assert "`num_tokens`" in DOC.read_text() and "`page_bytes`" in DOC.read_text()


def test_the_dsv32_extra_cache_skip_and_the_contract_agree() -> None:
    """The contract's call formats give ``dsv3_2`` an extra cache; the invariance suite's DSV3.2 skip
    says its own cases build none (not that DSV3.2 has none), the contract quotes that text, and
    the accuracy case it names calls DSV3.2 with an extra cache."""
    from pytest_sparse_mla.attention.cases import CONFORMANCE_CASES
    from pytest_sparse_mla.suites import test_attention_invariants as invariants

    row = _by_first_column("Call formats")["dsv3_2"]
    assert _code(row["extra_kv_cache records"]) == "dsv3_2"
    assert "DSV3.2 has no extra cache" not in invariants.NO_DSV32_EXTRA
    assert f'"{invariants.NO_DSV32_EXTRA}"' in " ".join(DOC.read_text().split())
    named = re.search(r"by (cf-[\w-]+)$", invariants.NO_DSV32_EXTRA).group(1)
    case = next(c for c in CONFORMANCE_CASES if c.name == named)
    assert case.conventions.fmt == "dsv3_2" and case.extra is not None
