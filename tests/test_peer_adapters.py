"""CPU self-tests of the peer adapters ``sglang-triton``, ``sglang-torch`` and ``flashmla``.

Neither peer is installed on the CPU CI machine, so the argument mapping is checked against fake
peers that have the peers' public call signatures and compute their answer with the float64 oracle
in the *peer's* own conventions (FlashMLA: natural-log LSE without the sink, ``+inf`` for an empty
row; SGLang Triton: natural log with the sink; SGLang torch: without the sink, ``-inf`` empty):

* a fake ``flash_mla`` module put into ``sys.modules``;
* a fake ``sglang`` package directory (two files at the paths of the real wheel) put on
  ``sys.path``, whose ``flash_mla_sm120.py`` imports the same ``sglang.srt`` names as the real one.

The adapter's result must then equal the oracle's in both project LSE conventions, and the fakes
record what the adapter passed (shapes, views sharing the caller's bytes, the values it must not
change). Tests marked ``real_sglang`` run against an installed sglang wheel (the tox lane
``sglang``) and skip elsewhere.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from pytest_sparse_mla import Unsupported, data, formats
from pytest_sparse_mla.attention import oracle_forward
from pytest_sparse_mla.implementations import BUILTINS, _peer, flashmla, sglang
from pytest_sparse_mla.page_split import BufferRegistry, page_split

SM_SCALE = 512**-0.5


def _inputs(num_tokens: int, num_heads: int, *, fmt: str = "dsv4", extra: bool = True, seed: int = 0) -> dict:
    """A small dual-cache call with a sink, -1 lanes, a topk_length 0 row (empty main row)."""
    gen = torch.Generator().manual_seed(seed)
    f = formats.get_format(fmt)
    main = data.make_packed_cache(gen, fmt=fmt, num_pages=4, page_block_size=64, page_stride="tight", form="3d")
    q = data.latent((num_tokens, num_heads, f.d_qk), gen)
    idx = torch.randint(0, 256, (num_tokens, 64), generator=gen, dtype=torch.int32)
    idx[0, 5:] = -1
    kw = {"sm_scale": SM_SCALE, "attn_sink": data.attn_sink(num_heads, gen)}
    if extra:
        ecache = data.make_packed_cache(gen, fmt=fmt, num_pages=32, page_block_size=2, form="2d")
        kw |= {
            "extra_kv_cache": ecache.packed,
            "extra_page_block_size": 2,
            "extra_indices": torch.randint(0, 64, (num_tokens, 64), generator=gen, dtype=torch.int32),
            "topk_length": torch.tensor([64] + [40] * (num_tokens - 2) + [0], dtype=torch.int32)[:num_tokens],
        }
    return {"q": q, "kv_cache": main.packed, "indices": idx, "fmt": fmt, **kw}


def _oracle(call: dict, convention: str):
    return oracle_forward(call["q"], call["kv_cache"], call["indices"], **_kw(call), lse_convention=convention)


def _kw(call: dict) -> dict:
    return {k: v for k, v in call.items() if k not in ("q", "kv_cache", "indices")}


def _assert_matches_oracle(result, call: dict, convention: str) -> None:
    expected = _oracle(call, convention)
    torch.testing.assert_close(result.output.double(), expected.output.to(torch.bfloat16).double(), atol=0, rtol=0)
    finite = torch.isfinite(expected.lse)
    assert torch.equal(torch.isfinite(result.lse), finite)
    assert torch.equal(result.lse[~finite].double(), expected.lse[~finite])
    torch.testing.assert_close(result.lse[finite].double(), expected.lse[finite], atol=2e-6, rtol=0)


# ------------------------------------------------------------------------------------------ registry


def test_importing_the_adapters_imports_neither_torch_nor_the_peers() -> None:
    code = (
        "import sys; import pytest_sparse_mla.implementations.sglang, pytest_sparse_mla.implementations.flashmla;"
        "from pytest_sparse_mla.implementations import BUILTINS;"
        "[BUILTINS[n](None) for n in ('sglang-triton', 'sglang-torch', 'flashmla')];"
        "bad = [m for m in ('torch', 'triton', 'sglang', 'flash_mla') if m in sys.modules];"
        "sys.exit(repr(bad) if bad else 0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------------------- LSE conversion


@pytest.mark.parametrize("with_sink", [False, True], ids=["no-sink", "sink"])
@pytest.mark.parametrize("convention", ["flashinfer", "flashmla"])
def test_lse_conversion_from_each_peer_convention(with_sink: bool, convention: str) -> None:
    """Hand-computed: L = ln(e^1 + e^2), sink s = 0.5; an empty row; converted both ways."""
    lse_excl = torch.tensor([[math.log(math.e + math.e**2), -math.inf]], dtype=torch.float32)
    sink = torch.tensor([0.5, 0.5]) if with_sink else None
    total = [math.log(math.e + math.e**2 + (math.exp(0.5) if with_sink else 0.0)), 0.5 if with_sink else -math.inf]
    want = {
        "flashinfer": [t / math.log(2.0) * 1.5 for t in total],
        "flashmla": [math.log(math.e + math.e**2), math.inf],
    }[convention]
    scale = 1.5 if convention == "flashinfer" else 1.0
    peer_inputs = {
        "flashmla": (lse_excl.where(torch.isfinite(lse_excl), torch.tensor(math.inf)), False),  # empty = +inf
        "sglang-torch": (lse_excl, False),  # empty = -inf
        "sglang-triton": (torch.tensor([total], dtype=torch.float32), True),  # sink included
    }
    for peer, (lse, included) in peer_inputs.items():
        got = _peer.lse_to_convention(
            lse, sink_included=included and with_sink, attn_sink=sink, lse_convention=convention, lse_scale=scale
        )
        assert got.dtype == torch.float32 and got.shape == (1, 2)
        assert got[0, 0].item() == pytest.approx(want[0], abs=2e-6), peer
        assert got[0, 1].item() == pytest.approx(want[1], abs=2e-6), peer  # the empty row (exact if inf)


def test_removing_a_dominant_sink_reports_an_empty_row_not_nan() -> None:
    """lse rounded to the sink (sink 40 >> L = 0): ln(e^lse - e^sink) would be ln(0) or ln(<0)."""
    got = _peer.lse_to_convention(
        torch.tensor([[40.0]]),
        sink_included=True,
        attn_sink=torch.tensor([40.0]),
        lse_convention="flashmla",
        lse_scale=1.0,
    )
    assert got.item() == math.inf


# ------------------------------------------------------------------------------ declarations, reasons


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"heads": 32}, "num_heads=32 is not in num_heads=(64, 128)"),
        ({"topk": 100}, "topk=100 is not a multiple of 64"),
        ({"tokens": 0}, "num_tokens=0 is outside [1, None]"),
        ({"fmt": "dsv3_2", "topk_length": True}, "topk_length for 'dsv3_2'"),
        ({"fmt": "dsv3_2", "extra": True}, "an extra cache for 'dsv3_2'"),
        # the envelope is what both routes take: the V32 decode takes neither, so neither route is asked
        ({"fmt": "dsv3_2", "tokens": 65, "extra": True, "topk_length": True}, "an extra cache for 'dsv3_2'"),
        ({"device": "cpu"}, "runs on cuda, not on cpu"),
        ({}, None),
    ],
)
def test_flashmla_unsupported_reasons(change: dict, expected: str | None) -> None:
    fmt = change.get("fmt", "dsv4")
    d_qk = formats.get_format(fmt).d_qk
    q = torch.empty((change.get("tokens", 4), change.get("heads", 64), d_qk), dtype=torch.bfloat16)
    q = q if change.get("device") == "cpu" else _cuda_like(q)
    kw = {"fmt": fmt, "indices": torch.empty((q.shape[0], change.get("topk", 128)), dtype=torch.int32)}
    if change.get("extra"):
        kw["extra_indices"] = torch.empty((q.shape[0], 64), dtype=torch.int32)
    if change.get("topk_length"):
        kw["topk_length"] = torch.empty(q.shape[0], dtype=torch.int32)
    cache = data.make_packed_cache(torch.Generator().manual_seed(0), fmt=fmt, num_pages=1, page_block_size=4).packed
    reason = flashmla.FlashMlaImplementation().unsupported_reason("sparse_mla_forward", q, cache, **kw)
    assert (reason is None) if expected is None else (expected in reason), reason


def _cuda_like(q: torch.Tensor) -> types.SimpleNamespace:
    """A stand-in with a CUDA device for shape-only checks on a machine without CUDA."""
    return types.SimpleNamespace(shape=q.shape, device=torch.device("cuda", 0))


def test_flashmla_refuses_padded_dsv3_2_rows() -> None:
    buffer = torch.zeros((2, 4 * 672), dtype=torch.uint8)  # 672-byte rows (>= 656, multiple of 16)
    cache = torch.as_strided(buffer, (2, 4, 656), (4 * 672, 672, 1))
    q = _cuda_like(torch.empty((4, 64, 576), device="meta"))
    reason = flashmla.FlashMlaImplementation().unsupported_reason(
        "sparse_mla_forward", q, cache, torch.zeros((4, 64), dtype=torch.int32), fmt="dsv3_2"
    )
    assert "exactly 656 bytes" in reason


def test_sglang_unsupported_reasons() -> None:
    q = torch.empty((4, 8, 576), dtype=torch.bfloat16)
    reason = sglang.SglangTorchImplementation().unsupported_reason(
        "sparse_mla_forward", q, None, torch.empty((4, 8), dtype=torch.int32), fmt="dsv3_2"
    )
    assert "format 'dsv3_2' is not in formats=('dsv4',)" in reason
    split = sglang.SglangTritonImplementation().unsupported_reason("page_split", None, key_suffix="_extra")
    assert "one scratch per device" in split and "'_extra'" in split
    stride = sglang.SglangTritonImplementation().unsupported_reason("page_split", None, dst_page_stride=37_376)
    assert "fixed stride of 37440" in stride


def test_unsupported_is_a_skip_with_its_reason(pytester: pytest.Pytester) -> None:
    """A test that calls a kernel directly (outside the envelope guard) and gets
    :class:`pytest_sparse_mla.Unsupported` is skipped with its reason, in a session using the plugin."""
    assert issubclass(Unsupported, NotImplementedError)
    pytester.makepyfile(
        """
        from pytest_sparse_mla import Unsupported

        def test_needs_eight_heads():
            raise Unsupported("flashmla: num_heads=8 is not in num_heads=(64, 128)")
        """
    )
    result = pytester.runpytest("-p", "sparse_mla", "-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*num_heads=8 is not in num_heads=(64, 128)*"])


def test_skip_reasons_name_the_missing_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flashmla, "_find_flash_mla", lambda: False)
    assert "flash_mla is not importable" in flashmla.FlashMlaImplementation().skip_reason("sparse_mla_forward", "cuda")
    assert flashmla.FlashMlaImplementation().skip_reason("pack", "cuda") is None
    monkeypatch.setattr(sglang, "sglang_root", lambda: (_ for _ in ()).throw(ImportError("sglang is not installed")))
    sglang.load_module.cache_clear()
    try:
        for impl in (sglang.SglangTritonImplementation(), sglang.SglangTorchImplementation()):
            for capability in ("sparse_mla_forward", "page_split"):
                assert "sglang is not installed" in impl.skip_reason(capability, "cpu")
    finally:
        sglang.load_module.cache_clear()


# ----------------------------------------------------------------------------------- fake FlashMLA


class FakeFlashMla(types.ModuleType):
    """``flash_mla`` with the public signatures; answers with the float64 oracle, FlashMLA's LSE."""

    def __init__(self, fmt: str) -> None:
        super().__init__("flash_mla")
        self.fmt = fmt
        self.calls: list[tuple[str, dict]] = []

    def get_mla_metadata(self, *args, **kwargs):
        return types.SimpleNamespace(have_initialized=False), None

    def flash_mla_with_kvcache(
        self, q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits=None,
        softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None, attn_sink=None,
        extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None, extra_topk_length=None,
    ):  # fmt: skip
        self.calls.append(("decode", dict(locals())))
        extra = {}
        if extra_k_cache is not None:
            extra = {"extra_kv_cache": extra_k_cache, "extra_indices": extra_indices_in_kvcache[:, 0]}
        res = oracle_forward(
            q[:, 0], k_cache, indices[:, 0], sm_scale=softmax_scale, fmt=self.fmt, topk_length=topk_length,
            attn_sink=attn_sink, extra_topk_length=extra_topk_length, lse_convention="flashmla", **extra,
        )  # fmt: skip
        return res.output.to(torch.bfloat16).unsqueeze(1), res.lse.to(torch.float32).unsqueeze(-1)

    def flash_mla_sparse_fwd(self, q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
        self.calls.append(("prefill", dict(locals())))
        table = kv[:, 0].double()  # the BF16 table, rows = tokens; FlashMLA's prefill reference math
        rows = indices[:, 0].long()
        valid = (rows >= 0) & (rows < table.shape[0])
        if topk_length is not None:
            valid &= torch.arange(rows.shape[1]) < topk_length.long().unsqueeze(1)
        keys = table[rows.clamp(0, table.shape[0] - 1)]  # [T, K, d_qk]
        scores = torch.einsum("thd,tkd->thk", q.double(), keys) * sm_scale
        scores = scores.masked_fill(~valid.unsqueeze(1), -math.inf)
        lse = torch.logsumexp(scores, -1)
        denom = lse if attn_sink is None else torch.logaddexp(lse, attn_sink.double().unsqueeze(0))
        probs = torch.exp(scores - denom.unsqueeze(-1)).nan_to_num(0.0)
        out = torch.einsum("thk,tkd->thd", probs, keys[..., :d_v])
        return out.to(torch.bfloat16), None, torch.where(torch.isneginf(lse), math.inf, lse).float()


@pytest.fixture
def fake_flash_mla(monkeypatch: pytest.MonkeyPatch):
    """Install a :class:`FakeFlashMla` as ``flash_mla``; the adapter admits CPU tensors."""
    monkeypatch.setattr(flashmla.FlashMlaImplementation, "devices", ("cuda", "cpu"))

    def install(fmt: str) -> FakeFlashMla:
        fake = FakeFlashMla(fmt)
        monkeypatch.setitem(sys.modules, "flash_mla", fake)
        return fake

    return install


@pytest.mark.parametrize("convention", ["flashinfer", "flashmla"])
@pytest.mark.parametrize("fmt, extra", [("dsv4", True), ("dsv3_2", False)])
def test_flashmla_decode_mapping(fake_flash_mla, fmt: str, extra: bool, convention: str) -> None:
    fake = fake_flash_mla(fmt)
    call = _inputs(4, 64, fmt=fmt, extra=extra)
    res = flashmla.FlashMlaImplementation().sparse_mla_forward(
        call["q"], call["kv_cache"], call["indices"], **_kw(call), lse_convention=convention
    )
    assert res.route == "decode" and res.entry == "flash_mla.flash_mla_with_kvcache"
    _assert_matches_oracle(res, call, convention)
    ((kind, args),) = fake.calls
    cache = call["kv_cache"]
    assert kind == "decode" and args["is_fp8_kvcache"] is True and args["head_dim_v"] == 512
    assert args["softmax_scale"] == SM_SCALE and args["causal"] is False and args["block_table"] is None
    assert tuple(args["q"].shape) == (4, 1, 64, formats.get_format(fmt).d_qk)
    kv = args["k_cache"]  # the caller's bytes, as [P, ps, 1, B] with the caller's page stride
    assert tuple(kv.shape) == (4, 64, 1, formats.get_format(fmt).bytes_per_token)
    assert kv.data_ptr() == cache.data_ptr() and kv.stride(0) == cache.stride(0)
    assert args["indices"].data_ptr() == call["indices"].data_ptr() and tuple(args["indices"].shape) == (4, 1, 64)
    if extra:
        assert args["extra_k_cache"].shape[1] == 2 and args["extra_k_cache"].dim() == 4
        assert torch.equal(args["topk_length"], call["topk_length"])


@pytest.mark.parametrize("extra", [True, False], ids=["dual", "single"])
@pytest.mark.parametrize("convention", ["flashinfer", "flashmla"])
def test_flashmla_prefill_mapping(fake_flash_mla, extra: bool, convention: str) -> None:
    fake = fake_flash_mla("dsv4")
    call = _inputs(66, 64, extra=extra, seed=3)
    if not extra:
        call["topk_length"] = torch.full((66,), 50, dtype=torch.int32)
    res = flashmla.FlashMlaImplementation().sparse_mla_forward(
        call["q"], call["kv_cache"], call["indices"], **_kw(call), lse_convention=convention
    )
    assert res.route == "prefill" and res.entry == "flash_mla.flash_mla_sparse_fwd"
    _assert_matches_oracle(res, call, convention)
    ((kind, args),) = fake.calls
    rows = args["indices"][:, 0]
    assert rows.dtype == torch.int32 and rows.shape[1] % 128 == 0 and bool((rows[:, 128 if extra else 64 :] < 0).all())
    main_table = formats.unpack_dequantize(call["kv_cache"], "dsv4", dtype=torch.bfloat16).reshape(-1, 512)
    assert args["kv"].dtype == torch.bfloat16 and torch.equal(args["kv"][: main_table.shape[0], 0], main_table)
    if extra:  # lanes past the lengths became -1; extra lanes point past the main table
        assert args["topk_length"] is None and bool((rows[-1, :64] == -1).all())
        assert torch.equal(rows[1, 64:128], call["extra_indices"][1] + 256)
    else:
        assert torch.equal(args["topk_length"], call["topk_length"])


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda c: c["indices"].__setitem__((1, 3), -2), "masks only -1"),
        (lambda c: c.__setitem__("topk_length", torch.tensor([65, 1, 1, 1], dtype=torch.int32)), "outside [0, 64]"),
        (lambda c: c.__setitem__("indices", torch.zeros((4, 65), dtype=torch.int32)[:, 1:]), "8-byte boundary"),
    ],
    ids=["minus-two", "topk_length-past-topk", "odd-row-start"],
)
def test_flashmla_refuses_inputs_its_decode_would_read_out_of_bounds(fake_flash_mla, mutate, message) -> None:
    fake = fake_flash_mla("dsv4")
    call = _inputs(4, 64, extra=False)
    mutate(call)
    with pytest.raises(_peer.UnsafeForPeer, match=re_escape(message)):
        flashmla.FlashMlaImplementation().sparse_mla_forward(call["q"], call["kv_cache"], call["indices"], **_kw(call))
    assert fake.calls == []


def test_flashmla_ignores_negative_values_past_topk_length(fake_flash_mla) -> None:
    """Lanes past topk_length are set to -1 by FlashMLA's MODEL1 decode: any value is safe there."""
    fake_flash_mla("dsv4")
    call = _inputs(4, 64, extra=False)
    call["topk_length"] = torch.full((4,), 8, dtype=torch.int32)
    call["indices"][:, 8:] = -7
    res = flashmla.FlashMlaImplementation().sparse_mla_forward(
        call["q"], call["kv_cache"], call["indices"], **_kw(call)
    )
    _assert_matches_oracle(res, call, "flashinfer")


def test_flashmla_unsupported_call_raises_the_reason(fake_flash_mla) -> None:
    fake = fake_flash_mla("dsv4")
    call = _inputs(4, 8, extra=False)
    with pytest.raises(Unsupported, match=r"num_heads=8 is not in num_heads=\(64, 128\)"):
        flashmla.FlashMlaImplementation().sparse_mla_forward(call["q"], call["kv_cache"], call["indices"], **_kw(call))
    assert fake.calls == []


def test_a_valid_lane_past_the_cache_reaches_the_peer(fake_flash_mla) -> None:
    """The adapter never answers for its peer: a valid lane past the cache goes to flash_mla (the
    fake computes with the oracle, which raises), and the error is marked as the peer's."""
    fake = fake_flash_mla("dsv4")
    call = _inputs(4, 64, extra=False)
    call["indices"][2, 7] = 256
    with pytest.raises(ValueError) as excinfo:
        flashmla.FlashMlaImplementation().sparse_mla_forward(call["q"], call["kv_cache"], call["indices"], **_kw(call))
    assert [kind for kind, _ in fake.calls] == ["decode"]
    assert _peer.raised_by_peer(excinfo.value)


def test_an_error_the_adapter_raises_itself_is_not_the_peers(fake_flash_mla) -> None:
    fake = fake_flash_mla("dsv4")
    call = _inputs(4, 64, extra=False)
    with pytest.raises(ValueError) as excinfo:  # SparseMlaCall.read: the adapter cannot map a 1-D index row
        impl = flashmla.FlashMlaImplementation()
        impl.sparse_mla_forward(call["q"], call["kv_cache"], call["indices"][0], **_kw(call))
    assert fake.calls == [] and not _peer.raised_by_peer(excinfo.value)


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


# ------------------------------------------------------------------------------------- fake SGLang

_FAKE_TRITON_FILE = '''
"""Fake of sglang/kernels/ops/attention/flash_mla_sm120_triton.py: LSE natural log, sink included."""
import math
import torch
from pytest_sparse_mla.attention import oracle_forward
CALLS = []

def flash_mla_sparse_decode_triton(q, k_cache, indices, topk_length, attn_sink, head_dim_v, softmax_scale,
                                   extra_k_cache=None, extra_indices=None, extra_topk_length=None):
    CALLS.append(dict(locals()))
    extra = {}
    if extra_k_cache is not None and extra_indices is not None:
        extra = {"extra_kv_cache": extra_k_cache, "extra_indices": extra_indices[:, 0],
                 "extra_topk_length": extra_topk_length}
    res = oracle_forward(q[:, 0], k_cache, indices[:, 0], sm_scale=softmax_scale, topk_length=topk_length,
                         attn_sink=attn_sink, lse_convention="flashinfer", lse_scale=math.log(2.0), **extra)
    return res.output.to(torch.bfloat16).unsqueeze(1), res.lse.float().unsqueeze(-1)
'''

_FAKE_TORCH_FILE = '''
"""Fake of sglang/kernels/ops/attention/flash_mla_sm120.py: same module-level sglang imports."""
import math
import torch
from sglang.srt.environ import envs
from sglang.srt.utils import is_hip
from pytest_sparse_mla.attention import oracle_forward
CALLS = []
_is_hip = is_hip()
BACKEND = envs.SGLANG_SM120_FLASHMLA_BACKEND.get()

def _sm120_sparse_decode_fwd(q, k_cache, indices, topk_length, attn_sink, head_dim_v, softmax_scale,
                             extra_k_cache=None, extra_indices=None, extra_topk_length=None):
    CALLS.append(dict(locals()))
    extra = {}
    if extra_k_cache is not None and extra_indices is not None:
        extra = {"extra_kv_cache": extra_k_cache, "extra_indices": extra_indices[:, 0],
                 "extra_topk_length": extra_topk_length}
    res = oracle_forward(q[:, 0], k_cache, indices[:, 0], sm_scale=softmax_scale, topk_length=topk_length,
                         attn_sink=attn_sink, lse_convention="flashmla", **extra)
    lse = torch.where(torch.isposinf(res.lse), -math.inf, res.lse)  # logsumexp of nothing
    return res.output.to(torch.bfloat16).unsqueeze(1), lse.float().unsqueeze(-1)

def _split_kv_pages_to_64(kv_u8, src_pbs, touched_indices=None):
    from sglang.srt.runtime_context import get_resources
    CALLS.append({"split": (kv_u8, src_pbs, touched_indices)})
    buffers = get_resources().buffers
    key = f"flash_mla_sm120_split:{kv_u8.device}"
    if buffers.get(key) is None:
        buffers[key] = torch.empty(4, 37440, dtype=torch.uint8, device=kv_u8.device)
    return buffers[key]
'''


@pytest.fixture
def fake_sglang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    root = tmp_path / "site" / "sglang"
    target = root / "kernels" / "ops" / "attention"
    target.mkdir(parents=True)
    (root / "__init__.py").write_text("raise ImportError('the fake sglang package must never be imported')\n")
    (target / "flash_mla_sm120_triton.py").write_text(textwrap.dedent(_FAKE_TRITON_FILE))
    (target / "flash_mla_sm120.py").write_text(textwrap.dedent(_FAKE_TORCH_FILE))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    cls = sglang.SglangTritonImplementation
    monkeypatch.setattr(cls, "devices", ("cuda", "cpu"))  # the fake runs anywhere
    sglang.load_module.cache_clear()
    yield root
    sglang.load_module.cache_clear()
    for name in list(sys.modules):
        if name.startswith("_sparse_mla_peer_sglang."):
            del sys.modules[name]


@pytest.mark.parametrize("convention", ["flashinfer", "flashmla"])
@pytest.mark.parametrize("impl_name", ["sglang-torch", "sglang-triton"])
def test_sglang_forward_mapping(fake_sglang: Path, impl_name: str, convention: str) -> None:
    impl = BUILTINS[impl_name](None)
    call = _inputs(5, 3)
    res = impl.sparse_mla_forward(call["q"], call["kv_cache"], call["indices"], **_kw(call), lse_convention=convention)
    assert res.route is None
    _assert_matches_oracle(res, call, convention)
    module = sglang.load_module("flash_mla_sm120" if impl_name == "sglang-torch" else "flash_mla_sm120_triton")
    (args,) = module.CALLS
    assert module.__file__ == str(fake_sglang / sglang.SGLANG_FILES[module.__name__.rpartition(".")[2]])
    assert tuple(args["q"].shape) == (5, 1, 3, 512) and args["head_dim_v"] == 512
    assert args["softmax_scale"] == SM_SCALE
    kv = args["k_cache"]
    assert tuple(kv.shape) == (4, 64, 1, 584) and kv.data_ptr() == call["kv_cache"].data_ptr()
    assert tuple(args["extra_k_cache"].shape) == (32, 2, 1, 584)
    assert args["extra_k_cache"].stride(0) == call["extra_kv_cache"].stride(0)
    assert "sglang" not in sys.modules  # the stand-ins are gone after loading


def test_sglang_torch_module_sees_the_stand_ins(fake_sglang: Path) -> None:
    module = sglang.load_module("flash_mla_sm120")
    assert module.BACKEND == "torch" and module._is_hip is False


def test_sglang_page_split_uses_the_callers_registry(fake_sglang: Path) -> None:
    impl = sglang.SglangTritonImplementation()
    registry = BufferRegistry()
    cache = data.make_packed_cache(torch.Generator().manual_seed(0), num_pages=1, page_block_size=256).packed
    out = impl.page_split(cache, registry=registry, touched_indices=torch.tensor([3, -1], dtype=torch.int32))
    assert registry.keys() == ["flash_mla_sm120_split:cpu"]
    assert registry.allocation_log == [("flash_mla_sm120_split:cpu", (4, 37440), torch.uint8)]
    assert out.data_ptr() == registry.lookup("flash_mla_sm120_split", "cpu").data_ptr()
    (split,) = [c["split"] for c in sglang.load_module("flash_mla_sm120").CALLS if "split" in c]
    assert split[0] is cache and split[1] == 256
    assert "sglang" not in sys.modules and "sglang.srt.runtime_context" not in sys.modules


@pytest.mark.parametrize("form, expected", [("hnd", 128), ("3d", 128), ("nhd", 128)])
def test_sglang_split_page_size_from_the_shape(fake_sglang: Path, form: str, expected: int) -> None:
    cache = data.make_packed_cache(torch.Generator().manual_seed(0), num_pages=1, page_block_size=128, form=form)
    sglang.SglangTorchImplementation().page_split(cache.packed, registry=BufferRegistry())
    (split,) = [c["split"] for c in sglang.load_module("flash_mla_sm120").CALLS if "split" in c]
    assert split[1] == expected


def test_sglang_split_refuses_touched_indices_past_the_pool(fake_sglang: Path) -> None:
    cache = data.make_packed_cache(torch.Generator().manual_seed(0), num_pages=2, page_block_size=256).packed
    with pytest.raises(_peer.UnsafeForPeer, match="512 >= num_pages\\*src_pbs = 512"):
        sglang.SglangTorchImplementation().page_split(cache, touched_indices=torch.tensor([0, 512], dtype=torch.int32))
    with pytest.raises(Unsupported, match="one scratch per device"):
        sglang.SglangTorchImplementation().page_split(cache, key_suffix="_extra")


def test_sglang_torch_refuses_out_of_range_lanes_past_topk_length(fake_sglang: Path) -> None:
    call = _inputs(4, 2, extra=False)
    call["topk_length"] = torch.full((4,), 10, dtype=torch.int32)
    call["indices"][1, 20] = 1 << 30
    with pytest.raises(_peer.UnsafeForPeer, match=re_escape("indices[1, 20]=1073741824 lies past topk_length")):
        sglang.SglangTorchImplementation().sparse_mla_forward(call["q"], call["kv_cache"], call["indices"], **_kw(call))
    res = sglang.SglangTritonImplementation().sparse_mla_forward(
        call["q"], call["kv_cache"], call["indices"], **_kw(call)
    )
    _assert_matches_oracle(res, call, "flashinfer")  # the Triton path never reads those lanes


@pytest.mark.parametrize("impl_name", ["sglang-torch", "sglang-triton"])
def test_sglang_refuses_an_extra_cache_without_extra_indices(fake_sglang: Path, impl_name: str) -> None:
    call = _inputs(4, 2)
    del call["extra_indices"]
    with pytest.raises(ValueError, match="extra_indices=None"):
        BUILTINS[impl_name](None).sparse_mla_forward(call["q"], call["kv_cache"], call["indices"], **_kw(call))
    assert not sglang.load_module("flash_mla_sm120_triton").CALLS and not sglang.load_module("flash_mla_sm120").CALLS


# ----------------------------------------------------------------------- the real sglang wheel (lane)

real_sglang = pytest.mark.skipif(
    sglang.sglang_version() is None,
    reason="needs the sglang wheel (tox -e sglang: pip install --no-deps sglang==0.5.23)",
)


@real_sglang
def test_real_sglang_files_load_without_the_server_stack() -> None:
    for which in sglang.SGLANG_FILES:
        module = sglang.load_module(which)
        assert Path(module.__file__).is_relative_to(sglang.sglang_root())
    assert "sglang" not in sys.modules and "sglang.srt" not in sys.modules
    impl = sglang.SglangTritonImplementation()
    assert "autotune" in impl.skip_reason("sparse_mla_forward", "cpu")
    assert sglang.SglangTorchImplementation().skip_reason("sparse_mla_forward", "cpu") is None


@real_sglang
def test_real_sglang_torch_forward_is_close_to_the_oracle() -> None:
    call = _inputs(3, 4)
    for convention in ("flashinfer", "flashmla"):
        res = sglang.SglangTorchImplementation().sparse_mla_forward(
            call["q"], call["kv_cache"], call["indices"], **_kw(call), lse_convention=convention
        )
        want = _oracle(call, convention)
        rel = ((res.output.double() - want.output).norm() / want.output.norm()).item()
        assert rel < 4e-3, rel  # BF16 output rounding (2**-9 per element)
        finite = torch.isfinite(want.lse)
        assert torch.equal(res.lse[~finite].double(), want.lse[~finite])
        assert (res.lse[finite].double() - want.lse[finite]).abs().max().item() < 1e-5


@real_sglang
@pytest.mark.parametrize("touched", [False, True])
def test_real_sglang_split_matches_the_project_split_byte_for_byte(touched: bool) -> None:
    cache = data.make_packed_cache(torch.Generator().manual_seed(1), num_pages=3, page_block_size=256).packed
    indices = torch.tensor([0, 5, 515, -1], dtype=torch.int32) if touched else None
    theirs, ours = BufferRegistry(), BufferRegistry()
    sglang.SglangTritonImplementation().page_split(cache, touched_indices=indices, registry=theirs)
    page_split(cache, touched_indices=indices, registry=ours)
    pages = [0, 1, 2, 3, 8, 9, 10, 11] if touched else list(range(12))
    got = theirs.lookup("flash_mla_sm120_split", "cpu")[pages, :37376]
    assert torch.equal(got, ours.lookup("flash_mla_sm120_split", "cpu")[pages, :37376])
    if touched:
        assert torch.equal(theirs.lookup("flash_mla_sm120_mask", "cpu"), torch.tensor([1, 0, 1], dtype=torch.int8))
