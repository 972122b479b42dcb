"""Self-tests of the search (``pytest_sparse_mla.search``) and its input-space model.

* ``docs/input-space.md`` is the model's table, and every dimension of the model is one the search
  records (and the reverse), so neither can drift from the other.
* Every drawn call lies inside the envelope it was drawn for (FlashMLA's, a tight one, the
  universal one): the guard would otherwise fail the test as a fitting bug.
* The tensors are what the model says: never-read cache bytes are poison, by hand from the byte
  layout; the drawn score regime is realised (logits placed, not hoped for); canaries catch a
  write outside the outputs.
* A failure's hint names the cause from the evidence: the output of a kernel that ignores
  ``sm_scale`` matches the counterfactual oracle with ``d_qk ** -0.5``.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402

from pytest_sparse_mla import formats, input_space, search  # noqa: E402
from pytest_sparse_mla.attention import oracle_forward, sparse_mla_forward  # noqa: E402
from pytest_sparse_mla.attention.call import SparseMlaCall  # noqa: E402
from pytest_sparse_mla.envelope import UNIVERSAL, Envelope, Widths  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FLASHMLA_LIKE = Envelope(
    num_heads=(64, 128), topk=Widths(multiple=64), extra_topk=Widths(multiple=64), topk_length_formats=("dsv4",),
    extra_cache_formats=("dsv4",), masked_indices="minus_one", topk_length_range="row", lse_conventions=("flashmla",),
    page_block_sizes=(64,), max_tokens=64,
)  # fmt: skip
NO_LSE = Envelope(formats=("dsv4_1",), lse_conventions=(), attn_sink=False, num_heads=(3, 8))
QUICK = settings(
    max_examples=10, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck)
)


def test_the_input_space_document_is_the_model() -> None:
    text = (ROOT / "docs" / "input-space.md").read_text()
    assert text == input_space.markdown(), (
        "docs/input-space.md differs from the model: regenerate it with "
        "`python -m pytest_sparse_mla.input_space > docs/input-space.md`"
    )


def test_every_dimension_of_the_model_is_recorded_by_the_search() -> None:
    @QUICK
    @given(call=search.calls(UNIVERSAL))
    def drawn(call: search.DrawnCall) -> None:
        names = {d.name for d in input_space.DIMENSIONS}
        recorded = set(search.record(call)) - {"realized_max_logit"}
        assert recorded == names, (
            f"recorded but not modelled: {recorded - names}; modelled, not recorded: {names - recorded}"
        )

    drawn()


@pytest.mark.parametrize("envelope", [FLASHMLA_LIKE, NO_LSE, UNIVERSAL], ids=["flashmla-like", "no-lse", "universal"])
def test_every_drawn_call_lies_inside_its_envelope(envelope: Envelope) -> None:
    @QUICK
    @given(call=search.calls(envelope))
    def drawn(call: search.DrawnCall) -> None:
        inputs = search.build(call)
        read = SparseMlaCall.read(inputs.q, inputs.kv_cache, inputs.indices, **inputs.kwargs, validate=True)
        assert read.envelope_reason(envelope) is None, call.describe()
        if envelope.masked_indices == "minus_one":
            for name, lanes in (("indices", inputs.indices), ("extra_indices", inputs.kwargs.get("extra_indices"))):
                if lanes is not None:
                    assert not bool(((lanes < 0) & (lanes != -1)).any()), f"{name}: a negative other than -1"
        if envelope.topk_length_range == "row":
            for name, width in (("topk_length", inputs.indices.shape[1]),
                                ("extra_topk_length", None if call.extra is None else call.extra.width)):  # fmt: skip
                if name in inputs.kwargs:
                    lengths = inputs.kwargs[name]
                    assert bool(((lengths >= 0) & (lengths <= width)).all()), f"{name} outside [0, {width}]"

    drawn()


def _call(**over: object) -> search.DrawnCall:
    main = search.DrawnCache(
        width=64, page_block_size=16, num_pages=6, lengths=(10, 40), masked_fraction=0.25, scattered=True,
        mask_value=-1, pattern="uniform", stale="poisoned-slot", value_exponent=3, rope_exponent=-2, wide=False,
        form="nhd", stride=16, layer=1, num_layers=3, canary=256,
    )  # fmt: skip
    call = search.DrawnCall(
        fmt="dsv4", num_tokens=5, num_heads=4, main=main, extra=None, empty_fraction=0.0, sm_scale=("yarn-0.1353",
        input_space.YARN_SM_SCALE), score_spread=2.0, score_offset=200.0, peak=0.0, sink=(3.0,),
        lse_convention="flashinfer", lse_scale=1.0, strided_query=True, poison=0x7F, seed=7,
    )  # fmt: skip
    return dataclasses.replace(call, **over)


def test_never_read_bytes_are_poison_and_read_ones_are_not() -> None:
    """By hand from the DSV4 footer layout (a 16-token page: ``16 * 576`` data bytes, then ``16 * 8``
    scale bytes): a token a valid lane names keeps its 576 data bytes and 7 scale bytes; every other
    byte of the page (other tokens, the 8th scale byte, the page padding) is ``0x7f``."""
    inputs = search.build(_call())
    ps, stride = 16, inputs.kv_cache.stride(0)
    raw = inputs.kv_cache.as_strided((6, 16 * 584), (stride, 1), inputs.kv_cache.storage_offset())
    lanes = torch.arange(64).unsqueeze(0)
    lengths = inputs.kwargs["topk_length"].long().clamp(0, 64).unsqueeze(1)
    valid = (inputs.indices >= 0) & (lanes < lengths)
    read = set(inputs.indices[valid].tolist())
    for slot in range(6 * ps):
        page, t = divmod(slot, ps)
        data = raw[page, t * 576 : (t + 1) * 576]
        scales = raw[page, ps * 576 + t * 8 : ps * 576 + t * 8 + 7]
        pad = raw[page, ps * 576 + t * 8 + 7]
        assert int(pad) == 0x7F
        if slot in read:
            assert not bool((data == 0x7F).all()) and not bool((scales == 0x7F).all()), slot
        else:
            assert bool((data == 0x7F).all()) and bool((scales == 0x7F).all()), slot
    past = ~(lanes < lengths) & (inputs.indices >= 0)
    assert not (set(inputs.indices[past].tolist()) & read), "a stale lane names a slot a valid lane reads"


@pytest.mark.parametrize(("spread", "offset"), [(2.0, 200.0), (0.3, -3000.0), (40.0, 0.0)])
def test_the_drawn_score_regime_is_realised(spread: float, offset: float) -> None:
    """The logits (``sm_scale * q.k`` in float64 from the packed cache, independently of the
    builder's own scores) have about the drawn mean and spread per (token, head)."""
    inputs = search.build(_call(score_spread=spread, score_offset=offset, strided_query=False))
    table = formats.unpack_dequantize(inputs.kv_cache, "dsv4").reshape(-1, 512).double()
    logits = input_space.YARN_SM_SCALE * torch.einsum("thd,tnd->thn", inputs.q.double(),
                                                      table[inputs.indices.long().clamp(min=0)])  # fmt: skip
    mask = inputs.valid.unsqueeze(1).expand_as(logits)
    for t in range(logits.shape[0]):
        row = logits[t][mask[t]].reshape(logits.shape[1], -1)
        assert torch.allclose(row.mean(-1), torch.full((row.shape[0],), offset, dtype=torch.float64),
                              atol=0.05 * abs(offset) + 2 * spread)  # fmt: skip
        assert bool(((row.std(-1, correction=0) - spread).abs() <= 0.5 * spread + 0.05).all()), row.std(-1)


def test_a_write_outside_the_outputs_is_named() -> None:
    inputs = search.build(_call())
    assert inputs.changed_inputs() == []
    storage = inputs.storages["kv_cache"]
    storage[3] ^= 0xFF  # a canary byte before the cache
    changed = inputs.changed_inputs()
    assert len(changed) == 1 and changed[0].startswith("kv_cache (byte 3 of its allocation")


def test_the_hint_names_an_ignored_sm_scale() -> None:
    inputs = search.build(_call(sink=None))
    oracle = oracle_forward(inputs.q, inputs.kv_cache, inputs.indices, **inputs.kwargs)
    kw = {**inputs.kwargs, "sm_scale": 512**-0.5}  # the kernel's bug: d_qk ** -0.5 whatever it is given
    wrong = sparse_mla_forward(inputs.q, inputs.kv_cache, inputs.indices, **kw)
    hints = search.diagnose(wrong.output, inputs, oracle, oracle_forward)
    assert any(h.startswith("likely cause [sm_scale-ignored]: sm_scale ignored (d_qk ** -0.5") for h in hints), hints
    right = sparse_mla_forward(inputs.q, inputs.kv_cache, inputs.indices, **inputs.kwargs)
    assert not any(h.startswith("likely cause") for h in search.diagnose(right.output, inputs, oracle, oracle_forward))


def test_a_sink_dominated_row_is_named() -> None:
    inputs = search.build(_call(sink=(1000.0,)))
    oracle = oracle_forward(inputs.q, inputs.kv_cache, inputs.indices, **inputs.kwargs)
    wrong = oracle_forward(inputs.q, inputs.kv_cache, inputs.indices,
                           **{k: v for k, v in inputs.kwargs.items() if k != "attn_sink"})  # fmt: skip
    hints = search.diagnose(wrong.output, inputs, oracle, oracle_forward)
    assert any("attn_sink ignored" in h for h in hints), hints
    assert math.isfinite(float(inputs.kwargs["attn_sink"][0]))


def test_token_byte_ranges_by_hand() -> None:
    """DSV4, 16-token page, slot 3: codes + RoPE at ``3 * 576 = 1728 .. 2304``, scales at
    ``16 * 576 + 3 * 8 = 9240 .. 9247`` (the 8th byte is padding); DSV3.2 slot 1: ``656 .. 1312``;
    V4.1 indexed slot 1: ``288 .. 576``."""
    assert formats.token_byte_ranges("dsv4", 16, 3) == [(1728, 2304), (9240, 9247)]
    assert formats.token_byte_ranges("dsv3_2", 4, 1) == [(656, 1312)]
    assert formats.token_byte_ranges("dsv4_1_indexed", 4, 1) == [(288, 576)]
    with pytest.raises(ValueError, match="slot=4"):
        formats.token_byte_ranges("dsv4", 4, 4)


@pytest.mark.full_tier  # a search run of a wrong kernel, shrunk and reported (CONTRIBUTING.md)
def test_a_shrunk_search_failure_gets_a_standalone_reproducer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The search against a kernel that never writes heads past 128 (``adversary_kernels``) with
    ``--sparse-mla-repro-dir``: the shrunk call's ``repro.py`` exits 1 on that kernel (expected: the
    float64 oracle) and 0 on the bundled reference."""
    import os
    import subprocess
    import sys

    import inner_session

    repro_dir = tmp_path / "repro"
    args = ["-p", "sparse_mla", str(ROOT / "suites" / "test_attention_search.py"), "-k", "drawn_call_matches",
            "--sparse-mla-impl", "adversary_kernels:heads_over_128_unwritten", "--sparse-mla-device", "cpu",
            "--sparse-mla-repro-dir", str(repro_dir), "-p", "no:cacheprovider", "-p", "no:xdist", "-q"]  # fmt: skip
    code, output = inner_session.run(args, cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 1, output[-3000:]
    scripts = sorted(repro_dir.glob("*/call*/repro.py"))
    assert len(scripts) == 1, (scripts, output[-3000:])
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    wrong = subprocess.run([sys.executable, str(scripts[0])], capture_output=True, text=True, env=env, timeout=300)
    assert wrong.returncode == 1 and "head 128" in wrong.stdout, wrong.stdout + wrong.stderr
    right = subprocess.run([sys.executable, str(scripts[0]), "--impl",
                            "pytest_sparse_mla.implementations:ReferenceImplementation"],
                           capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert right.returncode == 0, right.stdout + right.stderr


class RowEndsAtFirstMinusOne:
    """A wrong kernel of the lane-order property's kind: each index row ends at its first negative
    lane (the valid count is the position of the first ``-1``, as FlashInfer's pure-torch
    ``compressed_sparse_mla_reference`` counts it), otherwise the bundled reference."""

    name = "row-ends-at-first-minus-one"
    compute_mode = "bf16"

    @staticmethod
    def _truncated(rows: torch.Tensor) -> torch.Tensor:
        ended = (rows < 0).to(torch.int32).cumsum(dim=1) > 0
        return torch.where(ended, torch.full_like(rows, -1), rows)

    def sparse_mla_forward(self, q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, **kw: object):
        if isinstance(kw.get("extra_indices"), torch.Tensor):
            kw["extra_indices"] = self._truncated(kw["extra_indices"])  # type: ignore[arg-type]
        return sparse_mla_forward(q, kv_cache, self._truncated(indices), **kw)


def test_the_lane_order_property_fails_a_kernel_that_ends_a_row_at_its_first_minus_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import inner_session

    args = ["-p", "sparse_mla", str(ROOT / "suites" / "test_attention_search.py"), "-k", "lane_order",
            "--sparse-mla-impl", "test_search:RowEndsAtFirstMinusOne", "--sparse-mla-device", "cpu",
            "-p", "no:cacheprovider", "-p", "no:xdist", "-q"]  # fmt: skip
    with inner_session.unshrunk():  # the verdict is the test; the smallest failing call is not
        code, output = inner_session.run(args, cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 1 and "1 failed" in output, output[-3000:]


@pytest.mark.full_tier  # a search run of a wrong kernel, shrunk and reported (CONTRIBUTING.md)
def test_an_expected_search_failure_is_not_shrunk_and_an_unexpected_one_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The lane-order property against :class:`RowEndsAtFirstMinusOne`, listed in an xfail file:
    xfailed after at most the budget's 8 calls (no shrink phase); the same run under ``--runxfail``
    fails and shrinks (more calls than the budget)."""
    import re

    import inner_session

    xfail = tmp_path / "xfail.txt"
    test_id = "suites/test_attention_search.py::test_a_drawn_call_does_not_depend_on_lane_order_or_padding[shard0]"
    xfail.write_text(f"# [row-end] bug: a row ends at its first -1\n{test_id}  # row-end\n")
    args = ["-p", "sparse_mla", str(ROOT / "suites" / "test_attention_search.py"), "-k", "lane_order",
            "--sparse-mla-impl", "test_search:RowEndsAtFirstMinusOne", "--sparse-mla-device", "cpu",
            "--sparse-mla-xfail-file", str(xfail), "--rootdir", str(ROOT), "-p", "no:cacheprovider",
            "-p", "no:xdist"]  # fmt: skip
    calls = []
    for extra, outcome in (([], "1 xfailed"), (["--runxfail"], "1 failed")):
        code, output = inner_session.run([*args, *extra], cwd=ROOT, monkeypatch=monkeypatch, capsys=capsys)
        assert outcome in output, output[-3000:]
        drawn = re.search(r"(\d+) calls drawn", output)
        assert drawn is not None, output[-3000:]
        calls.append(int(drawn.group(1)))
    assert calls[0] <= 8 < calls[1], calls


class StridedQueryBug:
    """A wrong kernel with one bug: the queries are read as if contiguous (a strided view reads its
    neighbours' elements), otherwise the bundled reference."""

    name = "strided-query-bug"
    compute_mode = "bf16"

    def sparse_mla_forward(self, q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, **kw: object):
        flat = torch.as_strided(q, q.shape, torch.empty(q.shape).stride(), q.storage_offset())
        return sparse_mla_forward(flat, kv_cache, indices, **kw)


def test_the_hint_names_index_0_taken_for_the_mask_and_shows_the_index_values() -> None:
    """A kernel that masks every lane of index value 0 (``kernel_catalogue.index0_masked``): the
    search's counterfactual (the oracle with those lanes masked) names it, and the call's one-line
    description shows the index values, the tokens that read index 0 first."""
    from kernel_catalogue import index0_masked

    seed = next(s for s in range(7, 200) if ((search.build(_call(sink=None, seed=s)).indices == 0)
                                             & search.build(_call(sink=None, seed=s)).valid).any())  # fmt: skip
    inputs = search.build(_call(sink=None, seed=seed))  # a drawn call that reads slot 0 (never poisoned then)
    zero_tokens = ((inputs.indices == 0) & inputs.valid).any(dim=1).nonzero().flatten().tolist()
    oracle = oracle_forward(inputs.q, inputs.kv_cache, inputs.indices, **inputs.kwargs)
    wrong = index0_masked.sparse_mla_forward(inputs.q, inputs.kv_cache, inputs.indices, **inputs.kwargs)
    hints = search.diagnose(wrong.output, inputs, oracle, oracle_forward)
    named = "likely cause [index-0-treated-as-invalid]: index value 0 taken for the mask sentinel"
    assert any(h.startswith(named) for h in hints), hints
    line = search.describe_call(inputs, "\n".join(hints))
    first = zero_tokens[0]
    row = ", ".join(str(int(v)) for v in inputs.indices[first, :16].tolist())
    assert f"indices=[t{first}:[{row}, ...]" in line, line
    assert "indices=" not in search.describe_call(inputs, "likely cause [sm_scale-ignored]: x")


def test_the_hint_names_masked_lanes_scored_as_lanes_of_a_zero_row() -> None:
    """A kernel fed by a caller that gathers a zero row for every masked lane inside a row's length
    (SGLang's ``_forward_prefill_sparse_q8kv8``; here the bundled reference over the cache with one
    all-zero page appended, each such ``-1`` lane sent to its first slot): the search's
    counterfactual (each row's oracle output times ``Z / (Z + m)``, the sink in ``Z``) names it.
    The same call judged on a kernel of another bug (index value 0 masked) is not given that hint."""
    from kernel_catalogue import index0_masked

    main = dataclasses.replace(_call().main, form="2d", stride="tight", layer=0, num_layers=1, lengths=(30, 64))
    call = _call(main=main, strided_query=False, score_offset=0.0, score_spread=1.0, sink=(1.0,))
    inputs = search.build(call)
    lanes = torch.arange(inputs.indices.shape[1])
    inside = lanes < inputs.kwargs["topk_length"].long().unsqueeze(1)
    scored = (inputs.indices < 0) & inside
    assert bool(scored.any())
    cache = inputs.kv_cache
    zero_slot = cache.shape[0] * main.page_block_size
    padded = torch.cat([cache, torch.zeros(1, cache.shape[1], dtype=cache.dtype)])
    rows = torch.where(scored, zero_slot, inputs.indices)
    wrong = sparse_mla_forward(inputs.q, padded, rows, **inputs.kwargs)
    oracle = oracle_forward(inputs.q, inputs.kv_cache, inputs.indices, **inputs.kwargs)
    hints = search.diagnose(wrong.output, inputs, oracle, oracle_forward)
    named = "likely cause [masked-lane-scored]: masked lanes (negative indices inside the length) scored"
    assert any(h.startswith(named) for h in hints), hints
    other = index0_masked.sparse_mla_forward(inputs.q, inputs.kv_cache, inputs.indices, **inputs.kwargs)
    assert not any("[masked-lane-scored]" in h for h in search.diagnose(other.output, inputs, oracle, oracle_forward))
