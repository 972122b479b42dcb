"""The SGLang kernel peers executed from the wheel's ``kernels/ops/attention`` files:
``sglang-dsv4-triton``, ``sglang-dsv4-tilelang``, ``sglang-dsa-triton``, ``sglang-dsa-tilelang``.

Their kernels need a GPU (and TileLang), so the mapping each adapter makes is checked here against
stand-ins that answer with the float64 oracle in the kernel's own conventions (FlashMLA's LSE for the
DSV4 kernels, no LSE for the DSA kernels), as ``test_source_peers.py`` does for the other source
peers; the loader's ``"sglang-kernels"`` stand-ins are checked on the installed wheel's files (the
README's test command installs it): ``sglang`` is not imported and ``sys.modules`` is left as found.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from test_peer_adapters import _assert_matches_oracle, _inputs, _kw  # noqa: I001

from pytest_sparse_mla import Unsupported
from pytest_sparse_mla.attention import oracle_forward
from pytest_sparse_mla.implementations import BUILTINS, _source, sglang_dsa, sglang_dsv4

NEW_PEERS = ("sglang-dsv4-triton", "sglang-dsv4-tilelang", "sglang-dsa-triton", "sglang-dsa-tilelang")
_DECODE = "kernels/ops/attention/dsa/triton_sparse_mla_decode.py"


def test_the_sglang_kernel_files_load_without_sglang_and_leave_sys_modules_as_found() -> None:
    pytest.importorskip("triton")
    if _source.find_source("sglang", _DECODE) is None:
        pytest.skip("sglang 0.5.23 is not installed (README's test command installs it)")
    before = {name for name in sys.modules if name == "sglang" or name.startswith("sglang.")}
    stubs = _source.stubs_for("sglang-kernels")
    assert (
        stubs["sglang.srt.utils"]["is_hip"]() is False
        and stubs["sglang.srt.utils.common"]["is_gfx942_supported"]() is False
    )
    module = _source.exec_source("_test_sglang_dsa_decode", _source.find_source("sglang", _DECODE), stubs)
    try:
        assert callable(module.triton_sparse_mla_decode_splitk)
        # the kernel file's own import, resolved to the wheel's file through the stand-in package's __path__
        assert module._validate_input_dtypes.__module__ == "sglang.kernels.ops.attention.dsa.triton_sparse_mla"
        after = {name for name in sys.modules if name == "sglang" or name.startswith("sglang.")}
        assert after == before
    finally:
        sys.modules.pop("_test_sglang_dsa_decode", None)


@pytest.mark.parametrize("name", NEW_PEERS)
def test_skip_reasons_say_what_to_install(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_source, "find_source", lambda package, path: None)
    reason = BUILTINS[name](None).skip_reason("sparse_mla_forward", "cuda")
    assert reason is not None and ("sglang" in reason or "tilelang" in reason), reason


@pytest.mark.parametrize("version", ["0.1.12", "0.1.15"])
def test_the_dsv4_tilelang_peer_skips_under_releases_that_do_not_build_it(
    monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    from importlib import metadata

    monkeypatch.setattr(metadata, "version", lambda dist: version if dist == "tilelang" else "0")
    reason = BUILTINS["sglang-dsv4-tilelang"](None).skip_reason("sparse_mla_forward", "cuda")
    assert reason is not None and f"tilelang {version} does not compile" in reason and "sm_90" in reason


def test_the_dsv4_tilelang_peer_names_sglangs_pin_when_tilelang_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    def version(dist: str) -> str:
        raise metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(metadata, "version", version)
    reason = BUILTINS["sglang-dsv4-tilelang"](None).skip_reason("sparse_mla_forward", "cuda")
    assert reason is not None and "needs tilelang" in reason and "0.1.12" in reason


# ------------------------------------------------------------------------------------------- DSV4


class FakeDsv4:
    """``triton_fp8_attention_fwd`` / ``dpsk_v4_fp8_attention_fwd`` in float64 with their conventions:
    keyword arguments only, ``q [T, 1, H, 512]``, ``indices [T, 1, topk]``, output ``[T, 1, H, 512]``,
    LSE ``[T, 1, H]`` natural log, sink excluded, ``+inf`` for a row with no valid lane."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, **kw):
        self.calls.append(kw)
        q, idx = kw["q"], kw["indices"]
        assert q.dim() == 4 and q.shape[1] == 1 and idx.dim() == 3 and idx.shape[1] == 1
        assert kw["k_cache"].dim() == 4 and kw["k_cache"].shape[2] == 1 and kw["k_cache"].shape[3] == 584
        assert kw["head_dim_v"] == 512 and kw["is_fp8_kvcache"] is True and kw["block_table"] is None
        extra = {}
        if kw["extra_k_cache"] is not None:
            extra = {"extra_kv_cache": kw["extra_k_cache"], "extra_indices": kw["extra_indices_in_kvcache"][:, 0],
                     "extra_topk_length": kw["extra_topk_length"]}  # fmt: skip
        res = oracle_forward(
            q[:, 0], kw["k_cache"], idx[:, 0], sm_scale=kw["softmax_scale"], topk_length=kw["topk_length"],
            attn_sink=kw["attn_sink"], lse_convention="flashmla", **extra,
        )  # fmt: skip
        return res.output.to(torch.bfloat16).unsqueeze(1), res.lse.to(torch.float32).unsqueeze(1)


@pytest.mark.parametrize("which", ["triton", "tilelang"])
@pytest.mark.parametrize("convention", ["flashinfer", "flashmla"])
def test_the_dsv4_adapters_pass_the_callers_views_and_convert_the_lse(
    which: str, convention: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeDsv4()
    monkeypatch.setattr(sglang_dsv4, "load", lambda w: fake)
    name = f"sglang-dsv4-{which}"
    cls = type(BUILTINS[name](None))
    monkeypatch.setattr(cls, "devices", ("cuda", "cpu"))
    call = _inputs(3, 64, seed=7)
    call["indices"][1, :] = -1  # a row with no main candidate
    res = cls().sparse_mla_forward(call["q"], call["kv_cache"], call["indices"], **_kw(call), lse_convention=convention)
    _assert_matches_oracle(res, call, convention)
    (kw,) = fake.calls
    assert kw["q"].data_ptr() == call["q"].data_ptr() and kw["indices"].data_ptr() == call["indices"].data_ptr()
    assert kw["k_cache"].data_ptr() == call["kv_cache"].data_ptr()  # the same bytes, nothing copied
    assert kw["tile_scheduler_metadata"] is None and kw["cache_seqlens"] is None


# ------------------------------------------------------------------------------------------- DSA


def _table_attention(q, kv, rows, sm_scale):
    """Sparse MLA over a BF16 latent table in float64: every negative index masks its lane; an
    empty row outputs 0."""
    table = kv[:, 0].double()
    valid = rows >= 0
    keys = table[rows.clamp(min=0).long()]
    scores = torch.einsum("thd,tkd->thk", q.double(), keys) * sm_scale
    scores = scores.masked_fill(~valid.unsqueeze(1), -math.inf)
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return torch.einsum("thk,tkd->thd", probs, keys[..., :512]).to(torch.bfloat16)


class FakeDsaTriton:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def decode(self, *, q_nope, q_rope, kv, indices, sm_scale, d_v, workspace):
        self.calls.append(("decode", {"q_nope": q_nope, "q_rope": q_rope, "workspace": workspace}))
        return self._run(q_nope, q_rope, kv, indices, sm_scale)

    def prefill(self, *, q_nope, q_rope, kv, indices, sm_scale, d_v, topk_length, max_topk_length):
        self.calls.append(("prefill", {"topk_length": topk_length, "max_topk_length": max_topk_length}))
        return self._run(q_nope, q_rope, kv, indices, sm_scale)

    @staticmethod
    def _run(q_nope, q_rope, kv, indices, sm_scale):
        assert q_nope.shape[-1] == 512 and q_rope.shape[-1] == 64 and kv.dtype == torch.bfloat16
        assert q_nope.data_ptr() + 512 * q_nope.element_size() == q_rope.data_ptr()  # two views of one q
        q = torch.cat([q_nope, q_rope], -1)
        return _table_attention(q, kv, indices[:, 0], sm_scale).unsqueeze(0)


@pytest.mark.parametrize("num_tokens", [4, 66], ids=["decode", "prefill"])
def test_the_dsa_triton_adapter_routes_like_the_backend_over_the_dequantized_table(
    num_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeDsaTriton()
    monkeypatch.setattr(sglang_dsa, "load", lambda which: fake.decode if which == "triton-decode" else fake.prefill)
    monkeypatch.setattr(sglang_dsa.SglangDsaTritonImplementation, "devices", ("cuda", "cpu"))
    call = _inputs(num_tokens, 16, fmt="dsv3_2", extra=False, seed=3)
    del call["attn_sink"]  # the DSA kernels take none
    call["topk_length"] = torch.full((num_tokens,), 40, dtype=torch.int32)
    call["topk_length"][0] = 0
    impl = sglang_dsa.SglangDsaTritonImplementation()
    res = impl.sparse_mla_forward(call["q"], call["kv_cache"], call["indices"], **_kw(call))
    expected = oracle_forward(call["q"], call["kv_cache"], call["indices"], **_kw(call))
    torch.testing.assert_close(res.output.double(), expected.output.to(torch.bfloat16).double(), atol=0, rtol=0)
    assert res.lse is None and res.route == ("decode" if num_tokens <= 64 else "prefill")
    ((kind, kw),) = fake.calls
    assert kind == res.route
    if kind == "decode":
        assert kw["workspace"] is impl._workspace
    else:
        assert kw["topk_length"] is None and kw["max_topk_length"] == 64


def test_the_dsa_adapters_do_not_convert_index_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sglang_dsa.SglangDsaTritonImplementation, "devices", ("cuda", "cpu"))
    monkeypatch.setattr(sglang_dsa, "load", lambda which: pytest.fail("the kernel must not be called"))
    call = _inputs(4, 16, fmt="dsv3_2", extra=False)
    del call["attn_sink"]
    with pytest.raises(Unsupported, match=r"indices\.dtype=torch\.int64: .* does not convert"):
        sglang_dsa.SglangDsaTritonImplementation().sparse_mla_forward(
            call["q"], call["kv_cache"], call["indices"].long(), **_kw(call)
        )


def test_the_dsa_tilelang_adapter_hands_over_the_table_and_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    def fake(*, q, kv, indices, sm_scale, d_v):
        seen.append(indices.shape)
        assert q.is_contiguous() and q.shape[-1] == 576
        return _table_attention(q, kv, indices[:, 0], sm_scale).unsqueeze(0)

    monkeypatch.setattr(sglang_dsa, "load", lambda which: fake)
    monkeypatch.setattr(sglang_dsa.SglangDsaTileLangImplementation, "devices", ("cuda", "cpu"))
    call = _inputs(4, 32, fmt="dsv3_2", extra=False, seed=11)
    del call["attn_sink"]
    call["indices"] = torch.cat([call["indices"], torch.full_like(call["indices"], -1)], 1)  # 128 lanes
    res = sglang_dsa.SglangDsaTileLangImplementation().sparse_mla_forward(
        call["q"], call["kv_cache"], call["indices"], **_kw(call)
    )
    expected = oracle_forward(call["q"], call["kv_cache"], call["indices"], **_kw(call))
    torch.testing.assert_close(res.output.double(), expected.output.to(torch.bfloat16).double(), atol=0, rtol=0)
    assert seen == [torch.Size([4, 1, 128])]
