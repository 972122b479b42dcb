"""Envelopes: the public type, the fitting of cases inside one, the guard around the implementation
under test and the error-class coverage table.

Expected values are written out by hand (head counts, widths, lane contents, messages); the suite
runs use small kernels whose behaviour is known: the bundled reference behind an envelope, an
output-only wrapper, a wrapper that zeroes the output, and the example project's 64/128-head kernel.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import inner_session
import pytest
import torch

from pytest_sparse_mla import Envelope, Widths
from pytest_sparse_mla.attention.cases import (
    AttentionCase,
    CacheCase,
    Conventions,
    Values,
    case_classes,
    fit_case,
    make_inputs,
)
from pytest_sparse_mla.envelope import UNIVERSAL, NotApplicable
from pytest_sparse_mla.implementations.flashmla import ENVELOPE as FLASHMLA

ROOT = Path(__file__).resolve().parents[1]


# --- the type ---------------------------------------------------------------------------------------


def test_widths_fit_rounds_up_to_the_multiple_and_caps_at_the_maximum() -> None:
    assert Widths(multiple=64).fit(500) == (500, 512)  # 500 drawn, 12 lanes of -1 padding
    assert Widths(multiple=64).fit(1) == (1, 64)
    assert Widths(multiple=64).fit(128) == (128, 128)
    assert Widths(multiple=64, max=128).fit(500) == (128, 128)
    assert Widths(multiple=16, min=32).fit(8) == (8, 32)
    assert Widths(multiple=64).reason("topk", 100) == "topk=100 is not a multiple of 64"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"formats": ("dsv5",)}, "formats=('dsv5',)"),
        ({"num_heads": ()}, "num_heads=()"),
        ({"topk": 64}, "topk=64): expected a Widths"),
        ({"masked_indices": "all"}, "masked_indices='all'"),
        ({"lse_conventions": ("natural",)}, "lse_conventions=('natural',)"),
        ({"bitwise_invariance": frozenset({"speed"})}, "bitwise_invariance=['speed']"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens=5, max_tokens=2"),
    ],
)
def test_a_bad_envelope_names_the_field_and_the_value(kwargs: dict, message: str) -> None:
    with pytest.raises((TypeError, ValueError)) as excinfo:
        Envelope(**kwargs)
    assert message in str(excinfo.value)
    with pytest.raises(ValueError, match=r"Widths\(multiple=0, min=1\)"):
        Widths(multiple=0)


def test_call_reason_names_what_lies_outside() -> None:
    shape = {"fmt": "dsv4", "num_tokens": 4, "num_heads": 64, "topk": 128}
    assert FLASHMLA.call_reason(**shape) is None
    assert FLASHMLA.call_reason(**{**shape, "num_heads": 8}) == "num_heads=8 is not in num_heads=(64, 128)"
    assert FLASHMLA.call_reason(**{**shape, "topk": 192, "extra_topk": 100}) == "extra_topk=100 is not a multiple of 64"
    assert FLASHMLA.call_reason(**{**shape, "num_tokens": 0}) == "num_tokens=0 is outside [1, None]"
    assert "an extra cache for 'dsv3_2'" in FLASHMLA.call_reason(**{**shape, "fmt": "dsv3_2", "extra_topk": 64})
    only = Envelope(lse_conventions=("flashmla",))
    assert "lse_convention='flashinfer'" in only.call_reason(**shape, lse_convention="flashinfer")
    assert UNIVERSAL.call_reason(**{**shape, "num_heads": 7, "topk": 3}) is None
    assert (FLASHMLA.lse_convention, only.lse_convention, Envelope(lse_conventions=()).lse_convention) == (
        "flashinfer", "flashmla", None)  # fmt: skip


def test_the_package_exports_the_envelope_without_importing_torch() -> None:
    code = "import sys, pytest_sparse_mla as p; p.Envelope(); p.Widths(); p.Unsupported; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# --- fitting cases --------------------------------------------------------------------------------


def test_fit_moves_heads_and_pads_widths_and_keeps_the_name() -> None:
    extra = CacheCase(100, page_block_size=2, num_pages=64)
    case = AttentionCase("fi-decode-h12-k500", 16, 12, CacheCase(500), extra=extra)
    fitted = fit_case(case, FLASHMLA)
    assert fitted.extra is not None
    assert (fitted.name, fitted.num_heads) == ("fi-decode-h12-k500", 64)
    assert (fitted.main.topk, fitted.main.index_width) == (500, 512)
    assert (fitted.extra.topk, fitted.extra.index_width) == (100, 128)
    assert fitted.fitted == (
        "num_heads 12->64",
        "topk 500->500 drawn in rows of 512",
        "extra_topk 100->100 drawn in rows of 128",
    )
    assert fit_case(AttentionCase("h80", 4, 80, CacheCase(64)), FLASHMLA).num_heads == 128
    assert fit_case(AttentionCase("h200", 4, 200, CacheCase(64)), FLASHMLA).num_heads == 128
    assert fit_case(case, UNIVERSAL) is case


def test_padding_lanes_are_minus_one_after_the_drawn_lanes() -> None:
    """topk 100 with half the lanes masked (``data.sparse_indices``: lanes 50..99 are -1), in rows of
    128: lanes 0..49 hold cache slots, 50..127 are -1; the cache is drawn as for the unfitted case."""
    case = AttentionCase("pad", 4, 12, CacheCase(100, num_pages=4))
    plain = make_inputs(case, torch.Generator().manual_seed(3))
    padded = make_inputs(fit_case(case, FLASHMLA), torch.Generator().manual_seed(3))
    assert tuple(padded.indices.shape) == (4, 128)
    assert bool((padded.indices[:, :50] >= 0).all()) and bool((padded.indices[:, :50] < 256).all())
    assert bool((padded.indices[:, 50:] == -1).all())
    assert torch.equal(plain.cache.packed, padded.cache.packed)


def test_an_unknown_requirement_is_refused() -> None:
    with pytest.raises(ValueError, match=r"requires=\('head',\): expected names from"):
        fit_case(AttentionCase("typo", 4, 64, CacheCase(64), requires=("head",)), FLASHMLA)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        (AttentionCase("heads-5", 4, 5, CacheCase(128), requires=("heads",)),
         "num_heads=5 is not in num_heads=(64, 128)"),
        (AttentionCase("k500", 4, 64, CacheCase(500), requires=("width",)), "topk=500 is not a multiple of 64"),
        (AttentionCase("T0", 0, 64, CacheCase(64), requires=("tokens",)), "num_tokens=0 is outside [1, None]"),
        (AttentionCase("dsv32-dual", 4, 64, CacheCase(64), extra=CacheCase(64, page_block_size=64, num_pages=2),
                       conventions=Conventions("dsv3_2"), requires=("extra",)), "an extra cache for 'dsv3_2'"),
        (AttentionCase("beyond", 4, 64, CacheCase(64, topk_length=100), requires=("topk_length",)),
         "topk_length=100 outside [0, 64]"),
    ],
)  # fmt: skip
def test_what_a_case_requires_is_never_changed(case: AttentionCase, message: str) -> None:
    with pytest.raises(NotApplicable, match="not applicable to this envelope") as excinfo:
        fit_case(case, FLASHMLA)
    assert message in str(excinfo.value)


def test_what_a_case_does_not_require_is_dropped_or_clamped() -> None:
    case = AttentionCase("incidental", 4, 64, CacheCase(64, topk_length=100),
                         extra=CacheCase(64, page_block_size=64, num_pages=2),
                         conventions=Conventions("dsv3_2"))  # fmt: skip
    fitted = fit_case(case, FLASHMLA)
    assert (fitted.extra, fitted.main.topk_length) == (None, None)
    assert fitted.fitted == ("extra cache dropped", "topk_length dropped")
    clamped = fit_case(AttentionCase("len", 4, 64, CacheCase(64, topk_length=-3)), FLASHMLA)
    assert clamped.main.topk_length == 0
    p64 = AttentionCase("p", 4, 64, CacheCase(64, page_block_size=64, num_pages=4))
    pages = fit_case(p64, Envelope(page_block_sizes=(256,)))
    assert (pages.main.page_block_size, pages.main.num_pages) == (256, 1)  # 256 tokens either way


def test_case_classes_follow_the_construction() -> None:
    case = AttentionCase("x", 65, 64, CacheCase(128, layer=1, num_layers=2),
                         extra=CacheCase(64, page_block_size=2, num_pages=64, topk_length=0),
                         values=Values("peaked", sink_kind="mixed-inf"))  # fmt: skip
    assert case_classes(case) == (
        "prefill", "T-64-65", "peaked-main", "peaked-extra", "minus-inf-sink", "extra-page-2", "extra-length-0",
        "per-layer-views",
    )  # fmt: skip


# --- the guard and the coverage table, in sessions --------------------------------------------------

KERNELS = """
import torch
from pytest_sparse_mla import Envelope, Unsupported, Widths
from pytest_sparse_mla.attention import sparse_mla_forward as _reference

HEAD64 = Envelope(num_heads=(64, 128), topk=Widths(multiple=64), extra_topk=Widths(multiple=64),
                  extra_cache_formats=("dsv4",), topk_length_formats=("dsv4",), topk_length_range="row",
                  min_tokens=1, masked_indices="minus_one")


class Strict:
    '''The reference behind FlashMLA's envelope; a call outside it is a ValueError.'''
    name, compute_mode, envelope = "strict", "bf16", HEAD64

    def sparse_mla_forward(self, q, kv_cache, indices, **kw):
        if q.shape[1] not in (64, 128) or indices.shape[-1] % 64:
            raise ValueError(f"q: outside the kernel's shapes {tuple(q.shape)} {tuple(indices.shape)}")
        res = _reference(q, kv_cache, indices, **kw)
        return res.output, res.lse  # FlashMLA's pair


class OutputOnly:
    '''Returns the output tensor alone and declares no LSE.'''
    name, compute_mode = "output-only", "bf16"
    envelope = Envelope(lse_conventions=())

    def sparse_mla_forward(self, q, kv_cache, indices, **kw):
        assert "lse_convention" not in kw and "lse_scale" not in kw
        return _reference(q, kv_cache, indices, **kw).output


class OutputOnlyZero(OutputOnly):
    name = "output-only-zero"

    def sparse_mla_forward(self, q, kv_cache, indices, **kw):
        return torch.zeros_like(super().sparse_mla_forward(q, kv_cache, indices, **kw))


class RefusesDeclared:
    '''Declares every call, then refuses 16 heads.'''
    name, compute_mode, envelope = "refuses-declared", "bf16", Envelope()

    def sparse_mla_forward(self, q, kv_cache, indices, **kw):
        if q.shape[1] == 16:
            raise Unsupported("16 heads are not compiled in")
        return _reference(q, kv_cache, indices, **kw)


class RefusesUndeclared(RefusesDeclared):
    name = "refuses-undeclared"
    envelope = None
"""


@dataclass(frozen=True)
class Run:
    """An inner pytest session's exit status and terminal output."""

    returncode: int
    stdout: str


@pytest.fixture
def run_pytest(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Callable[..., Run]:
    """``run_pytest(project, *args, pythonpath=project)``: a downstream project's session (its own
    rootdir, no ini file) in this process (``tests/inner_session.py``), ``pythonpath`` first on
    ``sys.path`` as ``PYTHONPATH`` would put it."""

    def run(project: Path, *args: str, pythonpath: Path | None = None) -> Run:
        command = ["-p", "sparse_mla", "-p", "no:cacheprovider", "-p", "no:xdist", "-q", "--tb=line", "-rs",
                   "--rootdir", str(project), "-c", os.devnull, "--sparse-mla-device", "cpu", *args]  # fmt: skip
        returncode, output = inner_session.run(
            command, cwd=project, monkeypatch=monkeypatch, capsys=capsys, syspath=[pythonpath or project]
        )
        return Run(returncode, output)

    return run


@pytest.fixture
def _run(tmp_path: Path, run_pytest: Callable[..., Run]) -> Callable[..., Run]:
    """The suites against a kernel of ``KERNELS`` (module ``envelope_kernels`` in ``tmp_path``)."""
    (tmp_path / "envelope_kernels.py").write_text(KERNELS)
    return functools.partial(run_pytest, tmp_path)


def _counts(stdout: str) -> str:
    return stdout.strip().splitlines()[-1]


def test_a_kernel_is_only_called_inside_its_envelope(_run: Callable[..., Run]) -> None:
    """FlashMLA's envelope around the reference: the accuracy suite passes although the kernel raises
    for every shape outside it; the fitted cases say what changed; the coverage table is printed."""
    suite = ROOT / "suites" / "test_attention_accuracy.py"
    result = _run(str(suite), "--sparse-mla-impl", "envelope_kernels:Strict", "-k", "error_classes or lse")
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    assert "failed" not in _counts(out) and "passed" in _counts(out)
    assert "cf-heads-5: not applicable to this envelope: num_heads=5 is not in num_heads=(64, 128)" in out
    assert "sparse-mla error-class coverage (envelope_kernels:Strict)" in out
    assert "classes that never ran:" in out


def test_an_output_only_kernel_is_judged_on_its_output(_run: Callable[..., Run]) -> None:
    suite = ROOT / "suites" / "test_attention_accuracy.py"
    good = _run(str(suite), "--sparse-mla-impl", "envelope_kernels:OutputOnly", "-k", "error_classes")
    assert good.returncode == 0 and "failed" not in _counts(good.stdout), good.stdout[-4000:]
    bad = _run(str(suite), "--sparse-mla-impl", "envelope_kernels:OutputOnlyZero", "-k", "error_classes")
    assert bad.returncode == 1 and "failed" in _counts(bad.stdout), bad.stdout[-4000:]


def test_a_refusal_inside_a_declared_envelope_fails_and_without_one_skips(_run: Callable[..., Run]) -> None:
    suite = ROOT / "suites" / "test_attention_accuracy.py"
    select = ("-k", "cf-peaked-dual-c4 or cf-heads-5")  # 16 heads, then 5
    declared = _run(str(suite), "--sparse-mla-impl", "envelope_kernels:RefusesDeclared", *select)
    refused = "refuses-declared refused a call inside its declared envelope: 16 heads are not compiled in"
    assert refused in declared.stdout
    assert "1 failed, 1 passed" in _counts(declared.stdout), declared.stdout[-3000:]
    undeclared = _run(str(suite), "--sparse-mla-impl", "envelope_kernels:RefusesUndeclared", *select)
    assert "refuses-undeclared refused the call: 16 heads are not compiled in" in undeclared.stdout
    assert "1 passed, 1 skipped" in _counts(undeclared.stdout), undeclared.stdout[-3000:]


@pytest.mark.full_tier
@inner_session.HEAD64_ENVELOPE_RUN  # on the worker of the gate's FlashMLA-envelope run, which shares its fitted cases
def test_the_example_head64_kernel_runs_every_class_its_envelope_admits(
    tmp_path: Path, run_pytest: Callable[..., Run]
) -> None:
    """The example project's 64/128-head kernel (``examples/downstream/chunked_mla/head64.py``), run
    as its README says: no failure, at least 200 tests, and every class that did not run is ruled
    out by a field of its envelope (no LSE in the FlashInfer convention, lengths within the row,
    ``num_tokens >= 1``, only ``-1`` masked)."""
    report = tmp_path / "report.json"
    result = run_pytest(
        tmp_path, str(ROOT / "suites"), "--sparse-mla-impl", "chunked_mla.head64:Head64SparseMla",
        "--sparse-mla-report-json", str(report), pythonpath=ROOT / "examples" / "downstream",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:]
    passed = int(_counts(result.stdout).split(" passed")[0].split()[-1])
    assert passed >= 200, _counts(result.stdout)
    stated = re.search(r"on the CPU it runs (\d+) tests of the suites", (ROOT / "README.md").read_text())
    assert stated is not None and int(stated.group(1)) == passed, (
        f"README.md states {stated and stated.group(1)} tests for head64; the run passed {passed}"
    )
    doc = json.loads(report.read_text())
    assert doc["envelope"]["declared"] and doc["envelope"]["num_heads"] == [64, 128]
    never = {row["class"]: row["why_not"] for row in doc["coverage"] if not row["ran"]}
    assert set(never) == {
        "lse-flashinfer", "length-beyond-row", "extra-length-beyond-row", "zero-tokens", "negative-indices"
    }, never
    assert all("not applicable to this envelope" in why[0] for why in never.values()), never


def test_the_guard_runs_page_split_with_uninitialised_memory_poisoned() -> None:
    """A destination made with ``torch.empty`` inside the implementation's ``page_split`` holds 0xFF
    bytes (and fp32 scratch NaN), whatever the allocator's history; torch's settings are restored."""
    from pytest_sparse_mla.guard import GuardedImplementation

    class EmptySplit:
        name = "empty-split"

        def page_split(self, kv_cache, **kw):
            return torch.empty(1 << 20, dtype=torch.uint8), torch.empty(8, dtype=torch.float32)

    before = (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory)
    out, scratch = GuardedImplementation(EmptySplit(), UNIVERSAL, declared=False).page_split(torch.zeros(1))
    assert int((out != 0xFF).sum()) == 0 and bool(scratch.isnan().all())
    assert (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory) == before
