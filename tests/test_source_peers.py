"""The peers executed from their source files: ``flaggems``, ``vllm-triton``, ``flashinfer-reference``.

Their kernels need a GPU (FlagGems, vLLM) or a wheel (FlashInfer), so the mapping each adapter makes
is checked here against stand-ins that answer with the float64 oracle in the peer's own conventions
(the same way ``test_peer_adapters.py`` checks the FlashMLA adapter); FlashInfer's references run for
real where the wheel is installed (the README's test command installs it). The loader
(``implementations._source``) is checked for what it promises: the package is never imported, the
stand-ins leave ``sys.modules`` as they found it.
"""

from __future__ import annotations

import math
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from test_peer_adapters import FakeFlashMla, _assert_matches_oracle, _inputs, _kw  # noqa: I001

from pytest_sparse_mla import Unsupported
from pytest_sparse_mla.attention import oracle_forward
from pytest_sparse_mla.implementations import BUILTINS, _source, flaggems, vllm_triton

NEW_PEERS = ("flaggems", "vllm-triton", "flashinfer-reference")


def test_importing_the_new_adapters_imports_neither_torch_nor_the_peers() -> None:
    code = (
        "import sys; from pytest_sparse_mla.implementations import BUILTINS;"
        f"[BUILTINS[n](None) for n in {NEW_PEERS!r}];"
        "bad = [m for m in ('torch', 'triton', 'flag_gems', 'vllm', 'flashinfer') if m in sys.modules];"
        "sys.exit(repr(bad) if bad else 0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_exec_source_leaves_sys_modules_as_it_found_them(tmp_path: Path) -> None:
    pkg = tmp_path / "somepeer" / "ops"
    pkg.mkdir(parents=True)
    (tmp_path / "somepeer" / "__init__.py").write_text("raise RuntimeError('the package must not be imported')\n")
    (pkg / "kernel.py").write_text(
        "from flag_gems.utils.triton_version_utils import has_triton_tle\nFAST = has_triton_tle(3, 6, 0)\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        path = _source.find_source("somepeer", "ops/kernel.py")
        assert path == pkg / "kernel.py" and "somepeer" not in sys.modules
        module = _source.exec_source("_test_somepeer_kernel", path, _source.stubs_for("flaggems"))
        assert module.FAST is False
        assert not any(name.startswith("flag_gems") for name in sys.modules)
        assert sys.modules["_test_somepeer_kernel"] is module
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("_test_somepeer_kernel", None)
    assert _source.find_source("somepeer_that_does_not_exist", "x.py") is None
    with pytest.raises(ValueError, match="stubs_for"):
        _source.stubs_for("nope")


@pytest.mark.parametrize("name", NEW_PEERS)
def test_skip_reasons_say_what_to_install(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_source, "find_source", lambda package, path: None)
    monkeypatch.setattr(flaggems, "flaggems_source", lambda: None)
    reason = BUILTINS[name](None).skip_reason("sparse_mla_forward", "cuda")
    assert reason is not None and ("PYTHONPATH" in reason or "pip install" in reason), reason
    assert BUILTINS[name](None).skip_reason("pack", "cuda") is None


# ------------------------------------------------------------------------------------------- FlagGems


@pytest.fixture
def fake_flaggems(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(flaggems.FlagGemsImplementation, "devices", ("cuda", "cpu"))

    def install(fmt: str) -> FakeFlashMla:
        fake = FakeFlashMla(fmt)
        monkeypatch.setattr(flaggems.FlagGemsImplementation, "module", lambda self: fake)
        return fake

    return install


@pytest.mark.parametrize("num_tokens", [4, 66], ids=["decode", "prefill"])
def test_flaggems_maps_like_flashmla_and_keeps_negative_lanes(fake_flaggems, num_tokens: int) -> None:
    fake = fake_flaggems("dsv4")
    call = _inputs(num_tokens, 64, seed=5)
    call["indices"][1, 3] = -2  # FlashMLA's decode would be refused here; FlagGems masks every negative
    impl = flaggems.FlagGemsImplementation()
    res = impl.sparse_mla_forward(call["q"], call["kv_cache"], call["indices"], **_kw(call))
    assert res.entry.startswith("flag_gems.fused.") and res.route == ("decode" if num_tokens <= 64 else "prefill")
    assert [kind for kind, _ in fake.calls] == [res.route]
    _assert_matches_oracle(res, call, "flashinfer")


# ------------------------------------------------------------------------------------------- vLLM


class FakeVllm(types.SimpleNamespace):
    """``triton_bf16_mla_sparse_interface`` in float64, with the kernel's conventions: every negative
    index and every index >= N masked, natural-log LSE, an empty row's LSE the finite sentinel."""

    def __init__(self) -> None:
        super().__init__(calls=[])

    def triton_bf16_mla_sparse_interface(self, q, kv, indices, sm_scale, d_v=512, block_dpe=64):
        self.calls.append({"q": q, "kv": kv, "indices": indices, "sm_scale": sm_scale, "block_dpe": block_dpe})
        assert indices.shape[-1] % 16 == 0 and kv.dtype == torch.bfloat16 and q.shape[-1] - block_dpe in (448, 512)
        table = kv[:, 0].double()
        rows = indices[:, 0].long()
        valid = (rows >= 0) & (rows < table.shape[0])
        keys = table[rows.clamp(0, table.shape[0] - 1)]
        scores = torch.einsum("thd,tkd->thk", q.double(), keys) * sm_scale
        scores = scores.masked_fill(~valid.unsqueeze(1), -math.inf)
        lse = torch.logsumexp(scores, -1)
        probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
        out = torch.einsum("thk,tkd->thd", probs, keys[..., :d_v])
        sentinel = -1.0e30 * math.log(2.0) + math.log(indices.shape[-1])
        return out.to(torch.bfloat16), None, torch.where(torch.isneginf(lse), sentinel, lse).float()


@pytest.mark.parametrize("fmt, extra", [("dsv4", True), ("dsv3_2", False)])
def test_vllm_gets_the_virtual_table_and_its_empty_rows_read_as_empty(
    monkeypatch: pytest.MonkeyPatch, fmt: str, extra: bool
) -> None:
    fake = FakeVllm()
    monkeypatch.setattr(vllm_triton, "vllm_module", lambda: fake)
    monkeypatch.setattr(vllm_triton.VllmTritonImplementation, "devices", ("cuda", "cpu"))
    call = _inputs(4, 8, fmt=fmt, extra=extra, seed=7)
    call.pop("attn_sink")
    call["indices"][2] = -1  # an empty main row
    if extra:
        call["extra_indices"][2] = -1  # ... and an empty extra row: no candidate at all
    res = vllm_triton.VllmTritonImplementation().sparse_mla_forward(
        call["q"], call["kv_cache"], call["indices"], **_kw(call)
    )
    (args,) = fake.calls
    assert args["block_dpe"] == (0 if fmt == "dsv4" else 64) and args["indices"].shape[-1] % 16 == 0
    _assert_matches_oracle(res, call, "flashinfer")
    assert bool(torch.isneginf(res.lse[2]).all())


def test_vllm_refuses_lengths_it_cannot_fold(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lengths the adapter would fold into the rows but cannot map are ``Unsupported`` (the peer never
    sees them: a bad-input test skips), not a contract error raised by the adapter itself."""
    monkeypatch.setattr(vllm_triton, "vllm_module", lambda: FakeVllm())
    monkeypatch.setattr(vllm_triton.VllmTritonImplementation, "devices", ("cuda", "cpu"))
    call = _inputs(4, 8, extra=False)
    call.pop("attn_sink")
    impl = vllm_triton.VllmTritonImplementation()
    with pytest.raises(Unsupported, match=r"cannot map these \(topk_length\b"):
        impl.sparse_mla_forward(call["q"], call["kv_cache"], call["indices"], **_kw(call),
                                topk_length=torch.zeros(5, dtype=torch.int32))  # fmt: skip
    with pytest.raises(Unsupported, match=r"\bextra_topk_length\b"):
        impl.sparse_mla_forward(call["q"], call["kv_cache"], call["indices"], **_kw(call),
                                extra_topk_length=torch.zeros(4, dtype=torch.int32))  # fmt: skip


# ------------------------------------------------------------------------------ FlashInfer references


@pytest.mark.parametrize("convention", ["flashinfer", "flashmla"])
def test_flashinfer_reference_dsv4_dual_cache_with_sink(fi_reference, convention: str) -> None:
    call = _inputs(4, 8, seed=11)
    for row in (call["indices"], call["extra_indices"]):  # FlashInfer's reference ends a row at its first -1
        row.copy_(torch.where(row < 0, row.abs() % 64, row))
    res = fi_reference.sparse_mla_forward(call["q"], call["kv_cache"], call["indices"], **_kw(call),
                                          lse_convention=convention)  # fmt: skip
    expected = oracle_forward(call["q"], call["kv_cache"], call["indices"], **_kw(call), lse_convention=convention)
    torch.testing.assert_close(res.output.double(), expected.output, atol=2e-2, rtol=2e-2)
    finite = torch.isfinite(expected.lse)
    assert torch.equal(torch.isfinite(res.lse), finite)
    torch.testing.assert_close(res.lse[finite].double(), expected.lse[finite], atol=1e-4, rtol=0)


def test_flashinfer_reference_dsv3_2_and_its_base_2_lse(fi_reference) -> None:
    call = _inputs(4, 8, fmt="dsv3_2", extra=False, seed=13)
    call.pop("attn_sink")
    call["indices"][0] = torch.where(call["indices"][0] < 0, 7, call["indices"][0])
    res = fi_reference.sparse_mla_forward(call["q"], call["kv_cache"], call["indices"], **_kw(call))
    expected = oracle_forward(call["q"], call["kv_cache"], call["indices"], **_kw(call))
    torch.testing.assert_close(res.output.double(), expected.output, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(res.lse.double(), expected.lse, atol=1e-4, rtol=0)
