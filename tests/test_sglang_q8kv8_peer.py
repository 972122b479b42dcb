"""The ``sglang-q8kv8-sm90`` peer: SGLang's SM90 Q8KV8 sparse prefill, JIT-built from the wheel.

Its kernel needs an SM90 GPU and a CUDA build, so the mapping the adapter makes (the caller's query
cast and head padding, the workspace of both caches, the combined index rows and lengths, the
zero-row substitution of ``-1``, the sink padding, the LSE conversion) is checked here against
stand-ins of the wheel's helpers and of the kernel that answer in float64 with the kernel's
conventions, and the expected result is computed independently from the call's own indices and
lengths. The ``"sglang-q8kv8"`` stand-ins are checked on the installed wheel's files where the
README's test command installed it (``msgspec`` too: else skipped).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from test_peer_adapters import SM_SCALE, _inputs, _kw  # noqa: I001

from pytest_sparse_mla import formats
from pytest_sparse_mla.implementations import BUILTINS, _source, sglang_q8kv8

E4M3 = torch.float8_e4m3fn
NAME = "sglang-q8kv8-sm90"


def _table(cache: torch.Tensor, page_block_size: int) -> torch.Tensor:
    """The cache's dequantized rows ``[N, 512]`` rounded to E4M3 (what the caller's workspace holds)."""
    rows = formats.unpack_dequantize(cache, "dsv4", page_block_size=page_block_size, dtype=torch.float32)
    return rows.reshape(-1, 512).to(E4M3).double()


class FakeWheel:
    """The wheel's helpers and kernel in float64 with their conventions (module docstring)."""

    def __init__(self) -> None:
        self.kernel_calls: list[dict] = []

    @staticmethod
    def padded_heads(num_heads: int) -> int:
        return 64 if num_heads <= 64 else 128

    @staticmethod
    def cast_q(q, padded_num_heads, out):
        out[:, q.shape[1] :].zero_()
        out[:, : q.shape[1]].copy_(q)
        return out, torch.ones((), dtype=torch.float32)

    @staticmethod
    def gather(quant_k_cache, page_table_1_flattened, page_size, extra_rows=0, out=None):
        assert quant_k_cache.dim() == 2 and quant_k_cache.is_contiguous() and quant_k_cache.dtype == torch.uint8
        n = page_table_1_flattened.shape[0]
        assert out.shape == (n + extra_rows, 1, 512) and out.dtype == E4M3
        rows = _table(quant_k_cache[:, : page_size * 584], page_size)[page_table_1_flattened.long()]
        out[:n, 0] = rows.to(E4M3)
        out[n:].zero_()
        return out

    def kernel(self, *, q, kv, indices, sm_scale, q_scale, kv_scale, d_v, attn_sink, topk_length):
        """``sparse_mla_q8kv8_prefill_fwd`` through its ``topk_length`` entries: a lane is valid when
        ``0 <= index < s_kv`` and inside the length (kernel.cuh line 826); natural-log LSE without the
        sink, ``+inf`` for a row with no valid lane."""
        self.kernel_calls.append({"q": q, "kv": kv, "indices": indices, "attn_sink": attn_sink, "len": topk_length})
        assert q.dtype == E4M3 and kv.dtype == E4M3 and q.shape[1] % 64 == 0 and indices.shape[-1] % 128 == 0
        assert float(q_scale) == 1.0 and float(kv_scale) == 1.0 and d_v == 512
        rows = indices[:, 0].long()
        table = kv[:, 0].double()
        lane = torch.arange(rows.shape[1])
        valid = (rows >= 0) & (rows < table.shape[0]) & (lane[None] < topk_length[:, None].long())
        keys = table[rows.clamp(0, table.shape[0] - 1)]
        scores = torch.einsum("thd,tkd->thk", q.double(), keys) * sm_scale
        scores = scores.masked_fill(~valid[:, None], -math.inf)
        lse = torch.logsumexp(scores, -1)
        total = lse if attn_sink is None else torch.logaddexp(lse, attn_sink.double()[None])
        probs = torch.exp(scores - total[..., None]).nan_to_num(0.0)
        out = torch.einsum("thk,tkd->thd", probs, keys[..., :512]).to(torch.bfloat16)
        lse = torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse).float()
        return out, torch.zeros_like(lse), lse


def _install(monkeypatch: pytest.MonkeyPatch) -> FakeWheel:
    fake = FakeWheel()
    table = {"kernel": fake.kernel, "cast_q": fake.cast_q, "padded_heads": fake.padded_heads, "gather": fake.gather}
    monkeypatch.setattr(sglang_q8kv8, "load", lambda which: table[which])
    monkeypatch.setattr(sglang_q8kv8.SglangQ8Kv8Implementation, "devices", ("cuda", "cpu"))
    return fake


def _expected(call: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and natural-log LSE (sink excluded) in float64 from the call's own lanes: its extra
    lanes up to their length, then its main lanes up to theirs, negative lanes skipped, keys the
    caches' rows rounded to E4M3, the query rounded to E4M3."""
    main = _table(call["kv_cache"], 64)
    extra = _table(call["extra_kv_cache"], 2)
    q = call["q"].to(E4M3).double()
    sink = call["attn_sink"].double()
    outs, lses = [], []
    for t in range(q.shape[0]):
        m_len = int(call["topk_length"][t])
        keys = [extra[int(e)] for e in call["extra_indices"][t] if e >= 0]
        keys += [main[int(i)] for i in call["indices"][t, :m_len] if i >= 0]
        if not keys:
            outs.append(torch.zeros(q.shape[1], 512, dtype=torch.float64))
            lses.append(torch.full((q.shape[1],), math.inf, dtype=torch.float64))
            continue
        k = torch.stack(keys)
        s = q[t] @ k.T * SM_SCALE
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.logaddexp(lse, sink)[:, None])
        outs.append(p @ k[:, :512])
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("num_heads", [5, 64, 128])
def test_the_adapter_prepares_the_call_as_sglangs_dsv4_backend_does(
    num_heads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _install(monkeypatch)
    call = _inputs(3, num_heads, seed=5)
    call["indices"][0, 5:] = torch.arange(59, dtype=torch.int32)  # no -1 inside a length (test below)
    call["indices"][1, 50:] = -1  # past its length 40: never read
    res = BUILTINS[NAME](None).sparse_mla_forward(call["q"], call["kv_cache"], call["indices"], **_kw(call),
                                                  lse_convention="flashmla")  # fmt: skip
    out, lse = _expected(call)
    torch.testing.assert_close(res.output.double(), out.to(torch.bfloat16).double(), atol=1e-6, rtol=2**-8)
    assert torch.equal(torch.isinf(res.lse), torch.isinf(lse))
    torch.testing.assert_close(res.lse.double()[torch.isfinite(lse)], lse[torch.isfinite(lse)], atol=2e-6, rtol=0)
    (kw,) = fake.kernel_calls
    padded = 64 if num_heads <= 64 else 128
    assert kw["q"].shape == (3, padded, 512) and not kw["q"][:, num_heads:].float().any()
    assert kw["attn_sink"].shape == (padded,) and not kw["attn_sink"][num_heads:].any()
    # the workspace: 32 pages x 2 extra rows, 4 pages x 64 main rows, one zero row
    assert kw["kv"].shape == (64 + 256 + 1, 1, 512) and not kw["kv"][-1].float().any()


def test_the_rows_join_extra_and_main_spans_and_send_every_minus_one_to_the_zero_row() -> None:
    """The combined rows, written out by hand for a two-token call: extra lanes up to their length,
    then main lanes rebased by the extra cache's rows, -1 padding to 128, then -1 -> the zero row."""
    from pytest_sparse_mla.attention.call import SparseMlaCall

    gen = torch.Generator().manual_seed(0)
    main = formats.quantize_pack(torch.randn(2, 64, 512, generator=gen).to(torch.bfloat16), "dsv4")
    extra = formats.quantize_pack(torch.randn(4, 2, 512, generator=gen).to(torch.bfloat16), "dsv4")
    q = torch.randn(2, 4, 512, generator=gen).to(torch.bfloat16)
    indices = torch.tensor([[3, -1, 7], [0, 1, 2]], dtype=torch.int32)
    extra_indices = torch.tensor([[5, -2], [6, 7]], dtype=torch.int32)
    call = SparseMlaCall.read(
        q, main, indices, sm_scale=0.1, topk_length=torch.tensor([3, 1], dtype=torch.int32),
        extra_kv_cache=extra, extra_indices=extra_indices, extra_page_block_size=2,
        extra_topk_length=torch.tensor([2, 0], dtype=torch.int32),
    )  # fmt: skip
    sentinel = 8 + 128  # 4 extra pages of 2 tokens, 2 main pages of 64 tokens
    rows, lengths = sglang_q8kv8.combined_rows(call, n_extra=8, sentinel=sentinel)
    assert rows.shape == (2, 128) and rows.dtype == torch.int32
    assert lengths.tolist() == [5, 1]
    assert rows[0, :5].tolist() == [5, sentinel, 8 + 3, sentinel, 8 + 7]
    assert rows[1, :1].tolist() == [8 + 0]
    assert bool((rows[0, 5:] == sentinel).all()) and bool((rows[1, 1:] == sentinel).all())


def test_the_skip_reason_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_source, "find_source", lambda package, path: None)
    reason = BUILTINS[NAME](None).skip_reason("sparse_mla_forward", "cuda")
    assert reason is not None and "sglang" in reason, reason


def test_the_build_reason_names_the_missing_tool(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tvm_ffi" else real(name, *a))
    assert "apache-tvm-ffi" in (sglang_q8kv8.build_reason() or "")


def test_the_q8kv8_stand_ins_load_the_wheels_files_without_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gather helper loads from the wheel with the ``"sglang-q8kv8"`` stand-ins (its import chain is
    SGLang's JIT build code), ``sys.modules`` is left as found, and ``SPARSE_MLA_SGLANG_CUTLASS``
    is what the ``"cutlass"`` dependency answers."""
    pytest.importorskip("triton")
    pytest.importorskip("msgspec", reason="SGLang's JIT build code needs msgspec (not in README's test command)")
    path = sglang_q8kv8.FILES["gather"][0]
    if _source.find_source("sglang", path) is None:
        pytest.skip("sglang 0.5.23 is not installed (README's test command installs it)")
    monkeypatch.setenv("SPARSE_MLA_SGLANG_CUTLASS", "/nowhere/cutlass/include")
    before = {name for name in sys.modules if name == "sglang" or name.startswith("sglang.")}
    stubs = _source.stubs_for("sglang-q8kv8")
    assert stubs["sglang.kernels.jit.utils.deps"]["REGISTERED_DEPENDENCIES"]["cutlass"]() == [
        "/nowhere/cutlass/include"
    ]
    assert stubs["sglang.srt.environ"]["envs"].SGLANG_JIT_CACHE_DIR.get() is None
    module = _source.exec_source("_test_sglang_q8kv8_gather", _source.find_source("sglang", path), stubs)
    try:
        assert callable(module.gather_dequant_requant_fp8_paged_dsv4)
        assert module.DIM_NOPE == 448 and module.DIM_ROPE == 64
        after = {name for name in sys.modules if name == "sglang" or name.startswith("sglang.")}
        assert after == before
    finally:
        sys.modules.pop("_test_sglang_q8kv8_gather", None)


def test_a_per_layer_view_of_a_shared_pool_reaches_the_gather_with_its_own_bytes() -> None:
    """Layer 1 of a two-layer pool (page stride twice the page's records, its last page's stride past
    the storage): the gather gets a contiguous pool whose every page holds that layer's records."""
    import types

    ps, pages, record = 2, 3, 2 * 584
    pool = torch.randint(0, 256, (pages, 2 * record), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    layer1 = pool[:, record:]
    source = types.SimpleNamespace(cache=layer1, layout=formats.parse_cache(layer1, "dsv4", page_block_size=ps))
    got = sglang_q8kv8._pool(source)
    assert got.is_contiguous() and got.dim() == 2 and got.shape[0] == pages
    for p in range(pages):
        assert torch.equal(got[p, :record], pool[p, record:])
    layer0 = pool[:, :record]  # its strides fit the storage: the same bytes, no copy
    source0 = types.SimpleNamespace(cache=layer0, layout=formats.parse_cache(layer0, "dsv4", page_block_size=ps))
    view = sglang_q8kv8._pool(source0)
    assert view.data_ptr() == pool.data_ptr() and view.shape == (pages, 2 * record) and view.is_contiguous()


def test_index_rows_on_another_device_are_refused_by_the_adapter_not_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's caller builds the combined rows with a Triton kernel on the query's device; the
    adapter does not move rows from elsewhere (a bad-input test is then "not asked", never passed)."""
    _install(monkeypatch)
    call = _inputs(2, 64, seed=3)
    elsewhere = call["indices"].to("meta")
    with pytest.raises(ValueError, match=r"indices is on meta, q on cpu"):
        BUILTINS[NAME](None).sparse_mla_forward(call["q"], call["kv_cache"], elsewhere, **_kw(call),
                                                lse_convention="flashmla")  # fmt: skip


@pytest.mark.full_tier
@pytest.mark.sparse_mla_selftest_long(seconds=25)
def test_the_search_finds_the_stand_ins_masked_lane_bug_only_inside_its_region(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The search suite against the adapter's whole pipeline on the CPU (the caller's casts at scale 1
    and its ``-1`` -> zero-row substitution, the kernel exact in float64: :class:`FakeWheel`) with the
    shipped xfail file: the stand-in shares the real kernel's ``[masked-lane-scored]`` (from the
    adapter's own rows), which the search meets, and no discrepancy it reports as new is that bug
    (the search's counterfactual names it, ``search.diagnose``): the region
    ``masked_lane_weight=2**-12+`` holds every call it shows in. Other new discrepancies are not this
    test's claim: in some draws the stand-in's E4M3 casts move an LSE outside the file's regions
    (the draws depend on the modules a process has loaded: Hypothesis draws constants from them)."""
    import re

    import inner_session

    _install(monkeypatch)  # the stand-ins need no wheel, no build and no GPU
    monkeypatch.setattr(sglang_q8kv8.SglangQ8Kv8Implementation, "skip_reason", lambda self, capability, device: None)
    root = Path(__file__).resolve().parents[1]
    xfail = root / "pytest_sparse_mla" / "xfail" / f"{NAME}.txt"
    args = [
        "-p", "sparse_mla", str(root / "suites" / "test_attention_search.py"), "--sparse-mla-impl", NAME,
        "--sparse-mla-device", "cpu", "--sparse-mla-xfail-file", str(xfail),
        "-o", "xfail_strict=true", "-p", "no:xdist", "-p", "no:cacheprovider", "-q", "-rfEX", "--tb=short",
        "--basetemp", str(tmp_path / "base"),
    ]  # fmt: skip
    returncode, output = inner_session.run(args, cwd=root, monkeypatch=monkeypatch, capsys=capsys)
    tail = "\n".join(output.splitlines()[-60:])
    failures = output.partition("= FAILURES =")[2].partition("warnings summary")[0]
    assert returncode in (0, 1) and "3 search tests" in output, f"{failures[:8000]}\n...\n{tail}"
    assert "[masked-lane-scored]" in output, tail  # met: its region held draws, or a call confirmed it
    blocks = re.split(r"\n(?=\S*\s*\[(?:new-\d+|[a-z0-9-]+)\] \()", failures)
    named = [block[:3000] for block in blocks if "[new-" in block.split("\n", 1)[0]
             and "likely cause [masked-lane-scored]" in block]  # fmt: skip
    assert not named, "\n\n".join(named)
