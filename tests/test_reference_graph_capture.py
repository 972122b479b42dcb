"""The bundled reference forward in a CUDA graph: captured once, replayed on changing inputs.

A kernel engineer replays the reference beside their own kernel under one graph, so a replay must
compute from the *current* contents of the captured input tensors: indices, ``topk_length``,
``attn_sink`` and queries change between replays (lanes set to -1, lengths cut to 0, a sink set to
``-inf``), and every replay must equal an eager call on the same inputs bit for bit (the eager
call is deterministic and is itself checked against the float64 oracle once). A forward that read
any of them on the host during capture (a host sync is refused by the capture), or a graph that
replayed stale inputs, fails: the test first checks that the eager results of the rounds differ.
An index past its cache is counted on the device in ``out_of_range`` during a replay (the host
check cannot run inside a graph) and raises in an eager call.
"""

from __future__ import annotations

import pytest
import torch

from pytest_sparse_mla import data
from pytest_sparse_mla.attention import oracle_forward, sparse_mla_forward
from pytest_sparse_mla.attention.reference import triton_unavailable_reason

pytestmark = pytest.mark.sparse_mla_requires_cuda

T, H, TOPK, EXTRA_TOPK = 5, 24, 100, 70


def _backends() -> list:
    reason = triton_unavailable_reason("cuda") if torch.cuda.is_available() else None
    return [pytest.param("triton", marks=pytest.mark.skipif(reason is not None, reason=str(reason))), "torch"]


def _draw(g: torch.Generator, d_qk: int, rows: int, extra_rows: int) -> dict[str, torch.Tensor]:
    """New inputs: queries, index rows with -1 lanes, lengths (one 0), sinks (one -inf)."""
    indices = torch.randint(0, rows, (T, TOPK), generator=g, dtype=torch.int32)
    indices[torch.rand(T, TOPK, generator=g) < 0.3] = -1
    extra = torch.randint(0, extra_rows, (T, EXTRA_TOPK), generator=g, dtype=torch.int32)
    extra[torch.rand(T, EXTRA_TOPK, generator=g) < 0.3] = -1
    lengths = torch.randint(0, TOPK + 1, (T,), generator=g, dtype=torch.int32)
    extra_lengths = torch.randint(0, EXTRA_TOPK + 1, (T,), generator=g, dtype=torch.int32)
    empty = int(torch.randint(0, T, (1,), generator=g))
    lengths[empty], extra_lengths[empty] = 0, 0  # one empty row per round
    sink = data.attn_sink(H, g)
    sink[int(torch.randint(0, H, (1,), generator=g))] = float("-inf")
    return {
        "q": data.latent((T, H, d_qk), g),
        "indices": indices,
        "topk_length": lengths,
        "extra_indices": extra,
        "extra_topk_length": extra_lengths,
        "attn_sink": sink,
    }


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("fmt", ["dsv4", "dsv3_2"])
def test_graph_replays_equal_eager_calls_bit_for_bit(fmt, backend) -> None:
    device = torch.device("cuda")
    g = torch.Generator().manual_seed(15)
    main = data.make_packed_cache(g, fmt=fmt, num_pages=4, page_block_size=64, device=device)
    extra = data.make_packed_cache(g, fmt=fmt, num_pages=64, page_block_size=2, device=device)
    d_qk = main.fmt.d_qk
    static = {k: v.to(device) for k, v in _draw(g, d_qk, main.num_tokens, extra.num_tokens).items()}

    def forward(**kw):
        inputs = {**static, **kw}
        return sparse_mla_forward(
            inputs.pop("q"), main.packed, inputs.pop("indices"), sm_scale=d_qk**-0.5, fmt=fmt,
            extra_kv_cache=extra.packed, backend=backend, return_fp32=True, **inputs,
        )  # fmt: skip

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()  # warm-up: Triton compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = forward()
        with pytest.raises(ValueError, match=r"check_indices=True: .* CUDA graph capture cannot"):
            forward(check_indices=True)
    torch.cuda.synchronize()

    previous = None
    for round_ in range(3):
        new = _draw(g, d_qk, main.num_tokens, extra.num_tokens)
        for name, value in new.items():
            static[name].copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        eager = forward()
        if previous is not None:  # the inputs changed, so must the results (else the test is blind)
            assert not torch.equal(eager.output, previous)
        previous = eager.output.clone()
        for field in ("output", "lse", "output_fp32"):
            assert torch.equal(getattr(captured, field), getattr(eager, field)), f"round {round_}: {field}"
        assert int(captured.out_of_range.abs().sum()) == 0
        if round_ == 0:  # the eager call itself is right: float64 oracle
            ref = oracle_forward(**{k: v.cpu() for k, v in static.items()}, kv_cache=main.packed.cpu(),
                                 sm_scale=d_qk**-0.5, fmt=fmt, extra_kv_cache=extra.packed.cpu())  # fmt: skip
            torch.testing.assert_close(eager.output_fp32.cpu().double(), ref.output, atol=1e-5, rtol=0)

    # An index past the main cache in token 2's valid prefix: counted by the replay, raised eagerly.
    static["indices"][2, 0] = main.num_tokens
    static["topk_length"][2] = TOPK
    graph.replay()
    torch.cuda.synchronize()
    assert captured.out_of_range.cpu().tolist() == [0, 0, 1, 0, 0]
    unchecked = forward(check_indices=False)
    assert torch.equal(captured.output, unchecked.output) and torch.equal(captured.lse, unchecked.lse)
    with pytest.raises(ValueError, match=rf"indices\[2, 0\]={main.num_tokens} is out of range"):
        forward()
