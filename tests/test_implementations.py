"""Self-tests of the implementation-under-test machinery and the tolerance profiles.

Covers ``pytest_sparse_mla.implementations`` (built-ins, import strings, the
``pytest_sparse_mla_implementations`` hook, usage errors, capability skips) and
``pytest_sparse_mla.tolerances`` (ini lines, marker, resolution order), and shows that
``pytest -p sparse_mla suites --sparse-mla-impl package.module:attribute`` runs the suites against
an implementation defined outside the package (and fails a broken one).
"""

from __future__ import annotations

from pathlib import Path

import inner_session
import pytest

# Imported up front on purpose: pytester's in-process runs restore sys.modules afterwards, so a
# torch module first imported inside one would be unloaded and imported again by the next (a crash,
# or "Only a single TORCH_LIBRARY can be used"); assert_close imports more of torch lazily.
import torch

import pytest_sparse_mla.attention  # noqa: F401
from pytest_sparse_mla import implementations

torch.testing.assert_close(torch.zeros(1), torch.zeros(1))

ROOT = Path(__file__).resolve().parents[1]
SUITES = ROOT / "suites"
EXTERNAL = Path(__file__).with_name("external_impl.py")


def _downstream_package(pytester: pytest.Pytester) -> None:
    """``downstream_kernels/impl.py`` = ``tests/external_impl.py`` in the throwaway project."""
    package = pytester.mkpydir("downstream_kernels")
    (package / "impl.py").write_text(EXTERNAL.read_text())


# --- the suites against an implementation defined elsewhere (a fresh session, as a user runs them) ---


def test_suites_run_against_an_external_implementation(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _downstream_package(pytester)
    result = inner_session.runpytest(
        pytester, "-p", "sparse_mla",
        str(SUITES / "test_attention_accuracy.py"), str(SUITES / "test_attention_invariants.py"),
        "--sparse-mla-impl", "downstream_kernels.impl:impl", "--sparse-mla-device", "cpu",
        "-k", "boundary or padding_with or (heads and decode) or lse_conventions",
        "-p", "no:cacheprovider", monkeypatch=monkeypatch, capsys=capsys,
    )  # fmt: skip
    result.stdout.fnmatch_lines(["*impl=downstream_kernels.impl:impl*"])
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) >= 20, result.stdout.str()[-3000:]
    assert "failed" not in outcomes and "error" not in outcomes and "errors" not in outcomes
    calls = (pytester.path / "downstream_calls.log").read_text().splitlines()
    assert len(calls) >= outcomes["passed"]  # every test ran the downstream forward


def test_suites_catch_a_broken_external_implementation(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _downstream_package(pytester)
    result = inner_session.runpytest(
        pytester, "-p", "sparse_mla", str(SUITES / "test_attention_accuracy.py"),
        "--sparse-mla-impl", "downstream_kernels.impl:NoSinkImpl", "--sparse-mla-device", "cpu",
        "-k", "lse_conventions and flashinfer-1.0 and not dsv4_1", "-p", "no:cacheprovider", "-q",
        monkeypatch=monkeypatch, capsys=capsys,
    )  # fmt: skip
    # lse_conventions[<fmt>-no-sink-flashinfer-1.0] pass, [<fmt>-sink-flashinfer-1.0] must fail.
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(["*FAILED*test_lse_conventions[[]dsv4-sink-flashinfer-1.0[]]*"])


# --- selection, hooks, usage errors, capability skips (in-process) ----------------------------

USES_IMPL = """
import pytest

@pytest.mark.sparse_mla_needs("sparse_mla_forward")
def test_forward(sparse_mla_impl):
    assert callable(sparse_mla_impl.sparse_mla_forward)

@pytest.mark.sparse_mla_needs("pack")
def test_pack(sparse_mla_impl):
    assert callable(sparse_mla_impl.pack)

def test_name(sparse_mla_impl):
    print("IMPL-NAME", getattr(sparse_mla_impl, "name", None))
"""


def test_default_is_the_bundled_reference(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(USES_IMPL)
    result = pytester.runpytest("-p", "sparse_mla", "-s")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*IMPL-NAME reference*"])


def test_unknown_name_is_a_usage_error_listing_every_form(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(USES_IMPL)
    result = pytester.runpytest("-p", "sparse_mla", "--sparse-mla-impl", "nosuch")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "*--sparse-mla-impl='nosuch': unknown implementation; "
            "expected one of flaggems, flashinfer, *reference, *triton*",
            "*a built-in name: flaggems, flashinfer, *reference, *triton*",
            "*an entry-point name (group 'pytest_sparse_mla.implementations'*",
            "*pytest_sparse_mla_implementations(config) hook*",
            "*MODULE or PACKAGE.MODULE*found as nosuch.py or nosuch/__init__.py in one of:",
            f"*{pytester.path}",
            "*MODULE:ATTRIBUTE, e.g. 'nosuch:implementation'*",
        ]
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module:impl", "*'no_such_module:impl': unknown implementation; expected one of*"),
        ("downstream_kernels.impl:nothing", "*has no attribute 'nothing'*"),
        ("downstream_kernels.impl:SimpleNamespace", "*provides none of pack, page_split, sparse_mla_forward*"),
        ("downstream_kernels.broken", "*cannot import module 'downstream_kernels.broken' (No module named 'not_th*"),
    ],
)  # fmt: skip
def test_bad_import_strings_are_usage_errors(pytester: pytest.Pytester, spec: str, message: str) -> None:
    _downstream_package(pytester)
    (pytester.path / "downstream_kernels" / "broken.py").write_text("import not_there\n")
    pytester.makepyfile(USES_IMPL)
    result = pytester.runpytest("-p", "sparse_mla", "--sparse-mla-impl", spec)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_missing_capability_skips_with_the_reason(pytester: pytest.Pytester) -> None:
    _downstream_package(pytester)
    pytester.makepyfile(USES_IMPL)
    result = pytester.runpytest("-p", "sparse_mla", "--sparse-mla-impl", "downstream_kernels.impl:pack_only", "-rs")
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines(["*implementation 'downstream-pack-only' does not provide 'sparse_mla_forward'*"])


def test_hook_registers_a_named_implementation(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        import pytest
        from types import SimpleNamespace

        @pytest.hookimpl(optionalhook=True)
        def pytest_sparse_mla_implementations(config):
            return {"mine": SimpleNamespace(name="mine", sparse_mla_forward=lambda *a, **k: None),
                    "as-string": "downstream_kernels.impl:impl"}
        """
    )
    _downstream_package(pytester)
    pytester.makepyfile(USES_IMPL)
    result = pytester.runpytest("-p", "sparse_mla", "--sparse-mla-impl", "mine", "-s", "-rs")
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines(["*IMPL-NAME mine*"])
    result = pytester.runpytest("-p", "sparse_mla", "--sparse-mla-impl", "as-string", "-s")
    result.stdout.fnmatch_lines(["*IMPL-NAME downstream*"])
    result = pytester.runpytest("-p", "sparse_mla", "--sparse-mla-impl", "nosuch")
    result.stderr.fnmatch_lines(
        [
            "*expected one of as-string, flaggems, flashinfer, *mine, reference, *",
            "*initial conftest.py: as-string, mine",
        ]
    )


def test_flashinfer_adapter_skips_with_a_clear_reason_without_sm12x(pytester: pytest.Pytester) -> None:
    from pytest_sparse_mla import capabilities

    caps = capabilities.probe()
    if caps.compute_capability is not None and caps.compute_capability[0] == 12 and caps.flashinfer_version:
        pytest.skip("an SM12x GPU with FlashInfer is present: the adapter runs here")
    pytester.makepyfile(USES_IMPL)
    result = pytester.runpytest("-p", "sparse_mla", "--sparse-mla-impl", "flashinfer", "-rs")
    result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines(["*implementation 'flashinfer' cannot run 'sparse_mla_forward': flashinfer adapter: *"])
    result.stdout.fnmatch_lines(["*implementation 'flashinfer' does not provide 'pack'*"])


def test_unknown_capability_in_marker_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.sparse_mla_needs("teleport")
        def test_x(sparse_mla_impl):
            pass
        """
    )
    result = pytester.runpytest("-p", "sparse_mla")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*sparse_mla_needs('teleport'): unknown capability*"])


def test_builtins_and_import_strings_resolve(pytester: pytest.Pytester) -> None:
    config = pytester.parseconfigure("-p", "sparse_mla", "--sparse-mla-grid", "flashinfer==0.6.17")
    ref = implementations.resolve_implementation("reference", config)
    assert isinstance(ref, implementations.ReferenceImplementation)
    assert ref.grid_release == "0.6.17" and ref.compute_mode == "exact"
    triton = implementations.resolve_implementation("triton", config)
    assert triton.split_backend == "triton" and triton.skip_reason("sparse_mla_forward", "cpu") is None
    fi = implementations.resolve_implementation("flashinfer", config)
    assert fi.compute_mode == "fp8" and not hasattr(fi, "pack")
    cls = implementations.resolve_implementation("pytest_sparse_mla.implementations:ReferenceImplementation", config)
    assert isinstance(cls, implementations.ReferenceImplementation)  # classes are instantiated
    module = implementations.resolve_implementation("pytest_sparse_mla.attention", config)
    assert implementations.skip_reason_for(module, ("sparse_mla_forward",), "cpu") is None
    assert "does not provide 'page_split'" in implementations.skip_reason_for(module, ("page_split",), "cpu")


@pytest.mark.parametrize(("version", "scratch_heads"), [("0.7.4", 16), ("0.6.17", 12)])
def test_flashinfer_adapter_call_with_a_fake_entry(monkeypatch, version: str, scratch_heads: int) -> None:
    """The adapter's buffers, decode scratch and LSE conversion, with FlashInfer's entry faked."""
    import math

    from pytest_sparse_mla import capabilities

    seen: dict[str, object] = {}

    def fake_entry(q, kv_cache, indices, output, out_lse, sm_scale, **kwargs):  # type: ignore[no-untyped-def]
        seen.update(kwargs, sm_scale=sm_scale, output=output, out_lse=out_lse)
        output.fill_(0.25)
        out_lse.fill_(3.0)  # base-2 LSE, sink included

    from pytest_sparse_mla.implementations import flashinfer

    monkeypatch.setattr(flashinfer, "_flashinfer_entry", lambda: fake_entry)
    monkeypatch.setattr(flashinfer.FlashInferImplementation, "devices", ("cuda", "cpu"))  # CPU tensors here
    monkeypatch.setattr(capabilities, "probe", lambda: capabilities.Capabilities(flashinfer_version=version))
    impl = implementations.FlashInferImplementation()
    q = torch.zeros((2, 12, 512), dtype=torch.bfloat16)
    cache = torch.zeros((4, 64, 1, 584), dtype=torch.uint8)
    indices = torch.zeros((2, 128), dtype=torch.int32)
    extra = torch.zeros((2, 70), dtype=torch.int32)
    sink = torch.linspace(-1.0, 1.0, 12)
    kw = dict(sm_scale=0.125, attn_sink=sink, extra_kv_cache=cache, extra_indices=extra)
    res = impl.sparse_mla_forward(q, cache, indices, lse_scale=0.5, **kw)
    assert seen["sm_scale"] == 0.125 and seen["attn_sink"] is sink and seen["extra_indices"] is extra
    assert tuple(seen["mid_out"].shape) == (2, scratch_heads, 2 + 2, 512)  # ceil(128/64) + ceil(70/64)
    assert tuple(seen["mid_lse"].shape) == (2, scratch_heads, 4)
    assert res.route == "decode" and bool((res.output == 0.25).all()) and bool((res.lse == 1.5).all())
    natural = impl.sparse_mla_forward(q, cache, indices, lse_convention="flashmla", **kw)
    expected = torch.log(2.0**3 - torch.exp(sink.double()))  # ln(Z - e^sink)
    torch.testing.assert_close(natural.lse, expected.float().expand(2, 12))
    assert math.isclose(float(natural.lse[0, 0]), math.log(8 - math.exp(-1.0)), rel_tol=1e-6)
    seen.clear()
    prefill = impl.sparse_mla_forward(
        torch.zeros((65, 12, 512), dtype=torch.bfloat16), cache, torch.zeros((65, 128), dtype=torch.int32),
        **{**kw, "extra_indices": torch.zeros((65, 70), dtype=torch.int32)},
    )  # fmt: skip
    assert prefill.route == "prefill" and "mid_out" not in seen  # no split-K scratch for prefill
