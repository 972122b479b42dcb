"""Peers side by side, same run, same inputs: the bundled reference against SGLang and FlashMLA.

Attention (one test per ``num_tokens``, every implementation timed in the same process on the same
tensors): H = 64, DSV4 caches, main topk 128 on 64-token pages (128 pages), extra topk 512 on
64-token pages (256 pages), every index valid, ``attn_sink`` on. ``T = 64`` (decode) and
``T = 4096`` (prefill-sized): the reference with ``backend="triton"``, ``sglang-triton``
(``flash_mla_sparse_decode_triton``), ``sglang-torch`` (``_sm120_sparse_decode_fwd``) and, at
``T = 64``, ``flashmla`` (``flash_mla_with_kvcache``, MODEL1). Each row: median CUDA-event time of
the adapter call (10 reps after 2 warm-ups), the ratio ``ms / reference ms``, and the normwise
relative output error and max LSE error (natural log) of 8 tokens against the float64 oracle.

Page split (one test per scenario, ours and SGLang's replayed alternately from CUDA graphs of 8
calls, as ``test_bench_page_split.py`` does): full split of the 1,073,479,680-byte pool (7,168
pages of 256 tokens, 149,760 B stride) and touched splits of 1% and 10% of its pages from
``[64, 512]`` index tensors (8 different page sets per graph). Ours: the Triton backend of
``page_split``; SGLang's: ``_split_kv_pages_to_64`` through the ``sglang-*`` adapter. Before timing,
SGLang's destination pages are checked byte for byte against the torch split. Rows give both
times, the ratio, and the fraction of a device copy's bandwidth (full split) or the multiple of
the ideal time (touched).

Skipped without CUDA or without the peer (``pip install --no-deps sglang==0.5.23``; a built
FlashMLA on ``PYTHONPATH``).
"""

from __future__ import annotations

import pytest
import torch
from bench_utils import SPLIT_SRC_PAGES, capture_graph, cuda_median_ms, interleaved_median_ms, record, synced

from pytest_sparse_mla import data
from pytest_sparse_mla.attention import oracle_forward
from pytest_sparse_mla.implementations import BUILTINS
from pytest_sparse_mla.page_split import SPLIT_BUFFER_NAME, BufferRegistry, page_split

pytestmark = pytest.mark.sparse_mla_requires_cuda

H, TOPK, EXTRA_TOPK, PAGE = 64, 128, 512, 64
MAIN_PAGES, EXTRA_PAGES = 128, 256
SM_SCALE = 512**-0.5
CHECK_TOKENS = 8
PS, SRC_STRIDE, DST_STRIDE, DST_BYTES, RATIO, ROTATE = 256, 149_760, 37_440, 37_376, 4, 8
PEERS = {4096: ("sglang-triton", "sglang-torch"), 64: ("sglang-triton", "sglang-torch", "flashmla")}


def _peer(name: str):
    impl = BUILTINS[name](None)
    reason = impl.skip_reason("sparse_mla_forward", "cuda")
    return impl, reason


def _inputs(num_tokens: int) -> dict:
    gen = torch.Generator().manual_seed(4096)
    main = data.make_packed_cache(gen, num_pages=MAIN_PAGES, page_block_size=PAGE, device="cuda")
    extra = data.make_packed_cache(gen, num_pages=EXTRA_PAGES, page_block_size=PAGE, device="cuda")
    q = data.latent((num_tokens, H, 512), gen, device="cuda")
    idx = torch.randint(0, MAIN_PAGES * PAGE, (num_tokens, TOPK), generator=gen, dtype=torch.int32)
    extra_idx = torch.randint(0, EXTRA_PAGES * PAGE, (num_tokens, EXTRA_TOPK), generator=gen, dtype=torch.int32)
    return {
        "q": q,
        "kv_cache": main.packed,
        "indices": idx.cuda(),
        "extra_kv_cache": extra.packed,
        "extra_indices": extra_idx.cuda(),
        "attn_sink": data.attn_sink(H, gen, device="cuda"),
        "sm_scale": SM_SCALE,
    }


def _errors(forward, kwargs: dict) -> tuple[float, float]:
    """Normwise relative output error and max |LSE error| (natural log) of the first tokens."""
    part = {k: (v[:CHECK_TOKENS] if k in ("q", "indices", "extra_indices") else v) for k, v in kwargs.items()}
    got = forward(**part, lse_convention="flashmla")
    want = oracle_forward(**part, lse_convention="flashmla")
    diff = got.output.double() - want.output.to(got.output.device)
    rel = (diff.norm() / want.output.norm()).item()
    return rel, (got.lse.double() - want.lse.to(got.lse.device)).abs().max().item()


@pytest.mark.parametrize("num_tokens", [64, 4096], ids=["decode-T64", "prefill-T4096"])
def test_peer_attention(benchmark, bench_results, num_tokens):
    from pytest_sparse_mla.attention import sparse_mla_forward

    kwargs = _inputs(num_tokens)

    def reference(**kw):
        return sparse_mla_forward(**kw, backend="triton")

    runs = {"reference (triton backend)": reference}
    for name in PEERS[num_tokens]:
        impl, reason = _peer(name)
        if reason is None:
            runs[name] = impl.sparse_mla_forward
        else:
            bench_results.append({"name": f"{name} T={num_tokens}", "ms": float("nan"), "notes": f"skipped: {reason}"})
    if "flashmla" in runs:
        runs["flashmla kernel only (sched meta reused)"] = _flash_mla_direct(kwargs)
    flops = 2 * num_tokens * H * (TOPK + EXTRA_TOPK) * 512 * 2
    times = {}
    for label, forward in runs.items():
        rel, lse_err = _errors(forward, kwargs)
        times[label] = cuda_median_ms(lambda f=forward: f(**kwargs), warmup=2, reps=10)
        record(
            benchmark,
            bench_results,
            {
                "name": f"peer attention {label} T={num_tokens} H={H} topk {TOPK}+{EXTRA_TOPK} (page 64, sink)",
                "ms": times[label],
                "TFLOPs": flops / times[label] / 1e9,
                "x_reference": times[label] / times["reference (triton backend)"],
                "rel_err_output": rel,
                "max_abs_err_lse_ln": lse_err,
                "notes": f"{times[label] / times['reference (triton backend)']:.2f}x the reference's time; "
                f"vs oracle: out {rel:.1e} normwise, lse {lse_err:.1e}",
            },
        )
    fastest = min(times, key=times.get)
    benchmark.pedantic(synced(lambda: runs[fastest](**kwargs)), rounds=3, warmup_rounds=1)


def _flash_mla_direct(kwargs: dict):
    """``flash_mla_with_kvcache`` on pre-built views with one reused ``FlashMLASchedMeta`` (no adapter
    checks, no scheduling kernel after the first call); returns a forward with the adapter's result."""
    import flash_mla

    from pytest_sparse_mla import formats
    from pytest_sparse_mla.implementations._peer import PeerResult, lse_to_convention, nhd_view

    kv4 = nhd_view(kwargs["kv_cache"], formats.parse_cache(kwargs["kv_cache"], "dsv4"))
    extra4 = nhd_view(kwargs["extra_kv_cache"], formats.parse_cache(kwargs["extra_kv_cache"], "dsv4"))
    sched, _ = flash_mla.get_mla_metadata()
    sink = kwargs["attn_sink"]

    def forward(q, kv_cache, indices, *, extra_indices, lse_convention="flashinfer", **_):
        same = q.shape[0] == kwargs["q"].shape[0]
        out, lse = flash_mla.flash_mla_with_kvcache(
            q.unsqueeze(1), kv4, None, None, 512, sched if same else flash_mla.get_mla_metadata()[0], None,
            softmax_scale=SM_SCALE, is_fp8_kvcache=True, indices=indices.unsqueeze(1), attn_sink=sink,
            extra_k_cache=extra4, extra_indices_in_kvcache=extra_indices.unsqueeze(1),
        )  # fmt: skip
        lse = lse_to_convention(
            lse[:, :, 0], sink_included=False, attn_sink=sink, lse_convention=lse_convention, lse_scale=1.0
        )
        return PeerResult(out[:, 0], lse, "decode", "flash_mla.flash_mla_with_kvcache")

    return forward


# ------------------------------------------------------------------------------------------- split


@pytest.fixture(scope="module")
def pool() -> torch.Tensor:
    """[7168, 149760] uint8 random bytes on the GPU (the 2-D raw page-buffer form)."""
    gen = torch.Generator(device="cuda").manual_seed(27_455)
    return torch.randint(0, 256, (SPLIT_SRC_PAGES, SRC_STRIDE), dtype=torch.uint8, device="cuda", generator=gen)


@pytest.fixture(scope="module")
def sglang_split():
    impl, _ = _peer("sglang-triton")
    reason = impl.skip_reason("page_split", "cuda")
    if reason is not None:
        pytest.skip(reason)
    return impl.page_split


def _index_sets(frac: float) -> tuple[int, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(32_320)
    k = max(1, round(SPLIT_SRC_PAGES * frac))
    out = []
    for _ in range(ROTATE):
        pages = torch.randperm(SPLIT_SRC_PAGES, generator=gen)[:k]
        pick = pages[torch.randint(0, k, (64 * 512,), generator=gen)]
        pick[: min(k, 64 * 512)] = pages[: min(k, 64 * 512)]
        out.append((pick * PS + torch.randint(0, PS, (64 * 512,), generator=gen)).to(torch.int32).view(64, 512).cuda())
    return k, out


@pytest.mark.parametrize("frac", [None, 0.01, 0.10], ids=["full", "touched-1pct", "touched-10pct"])
def test_peer_page_split(benchmark, bench_results, copy_baseline, pool, sglang_split, frac):
    ours_reg, theirs_reg, check_reg = BufferRegistry(), BufferRegistry(), BufferRegistry()
    if frac is None:
        k, sets = SPLIT_SRC_PAGES, [None] * ROTATE
    else:
        k, sets = _index_sets(frac)
    page_split(pool, src_page_block_size=PS, touched_indices=sets[0], registry=check_reg, backend="torch")
    sglang_split(pool, src_page_block_size=PS, touched_indices=sets[0], registry=theirs_reg)
    rows = torch.ones(SPLIT_SRC_PAGES * RATIO, dtype=torch.bool, device="cuda")
    if sets[0] is not None:
        touched = torch.zeros(SPLIT_SRC_PAGES, dtype=torch.bool, device="cuda")
        touched[(sets[0].view(-1).long() // PS)] = True
        rows = touched.repeat_interleave(RATIO)
    want = check_reg.lookup(SPLIT_BUFFER_NAME, pool.device)[rows, :DST_BYTES]
    assert torch.equal(theirs_reg.lookup(SPLIT_BUFFER_NAME, pool.device)[rows, :DST_BYTES], want)

    def calls(split, reg, **kw):
        return [lambda i=i: split(pool, src_page_block_size=PS, touched_indices=i, registry=reg, **kw) for i in sets]

    ours = capture_graph(calls(page_split, ours_reg, backend="triton"))
    theirs = capture_graph(calls(sglang_split, theirs_reg))
    ours_ms, theirs_ms = (t / ROTATE for t in interleaved_median_ms(ours.replay, theirs.replay, reps=20))
    moved = 2 * DST_BYTES * k * RATIO
    ideal = copy_baseline.ideal_ms(moved)
    label = "full split" if frac is None else f"touched split {frac:.0%} ({k} of {SPLIT_SRC_PAGES} pages)"
    for who, ms in (("ours (triton)", ours_ms), ("sglang _split_kv_pages_to_64", theirs_ms)):
        row = {
            "name": f"peer {label} {who}",
            "ms": ms,
            "GBps": moved / ms / 1e6,
            "x_sglang": ms / theirs_ms,
            "notes": f"SGLang/ours = {theirs_ms / ours_ms:.2f}x; CUDA graph of 8, time per split",
        }
        if frac is None:
            row["copy_ratio"] = ideal / ms
        else:
            row["x_ideal"] = ms / ideal
        record(benchmark, bench_results, row)
    benchmark.pedantic(synced(ours.replay), rounds=5, warmup_rounds=1)
