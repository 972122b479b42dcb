"""Self-tests of the Triton attention kernel's own entry points (``attention._triton_forward``):
shapes and dtypes that do not agree are refused with a ``ValueError`` naming them, before any
launch (the kernel itself does no bounds checks)."""

from __future__ import annotations

import pytest
import torch

from pytest_sparse_mla.attention.reference import triton_forward_module, triton_unavailable_reason

if triton_unavailable_reason("cpu") is not None:  # pragma: no cover - triton missing
    pytest.skip(f"triton: {triton_unavailable_reason('cpu')}", allow_module_level=True)

tf = triton_forward_module()


def _inputs(tokens: int = 2, heads: int = 4, d_qk: int = 512, rows: int = 65) -> tuple:
    q = torch.zeros(tokens, heads, d_qk, dtype=torch.bfloat16)
    pieces = tf.bf16_pieces(torch.zeros(rows, d_qk), True)
    lanes = torch.full((tokens, 64), rows - 1, dtype=torch.int32)
    return q, pieces, lanes


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda q, p, r: (q, p, r[:1]), r"rows.shape\[0\]=1 must be T=2"),
        (lambda q, p, r: (q[..., :448].contiguous(), p, r), r"pieces.shape\[2\]=512 must be d_qk=448"),
        (lambda q, p, r: (q, p, r.float()), r"rows.dtype=torch.float32 must be torch.int32"),
        (lambda q, p, r: (q, p, r[0]), r"expected q \[T, H, d_qk\].*rows.shape=\(64,\)"),
        (lambda q, p, r: (q.float(), p, r), r"q.dtype=torch.float32 .* must be torch.bfloat16"),
        (lambda q, p, r: (q, p, r[:, :32]), r"lanes=32 must be a multiple of 64"),
    ],
    ids=["rows-not-T-long", "pieces-wider-than-q", "float-rows", "1-d-rows", "fp32-q", "lanes-32"],
)
def test_online_softmax_refuses_inputs_that_do_not_agree(change, match) -> None:
    q, pieces, rows = change(*_inputs())
    with pytest.raises(ValueError, match=match):
        tf.online_softmax(q, pieces, rows, 64, 0.1, 512)


def test_online_softmax_refuses_d_v_past_the_row_zero_row_outside_and_odd_config() -> None:
    q, pieces, rows = _inputs()
    with pytest.raises(ValueError, match=r"0 < d_v=1024 <= d_qk"):
        tf.online_softmax(q, pieces, rows, 64, 0.1, 1024)
    with pytest.raises(ValueError, match=r"zero_row=65 a row of the 65-row table"):
        tf.online_softmax(q, pieces, rows, 65, 0.1, 512)
    with pytest.raises(ValueError, match=r"head_group=12: expected a power of two >= 16"):
        tf.online_softmax(q, pieces, rows, 64, 0.1, 512, config=(12, 512, 4, 2))


def test_bf16_pieces_takes_only_a_2d_fp32_table_and_returns_contiguous_pieces() -> None:
    with pytest.raises(ValueError, match=r"table: expected a 2-D torch.float32 tensor, got torch.int32"):
        tf.bf16_pieces(torch.zeros(4, 512, dtype=torch.int32), True)
    table = torch.randn(512, 8).t()  # a transposed (non-contiguous) fp32 table
    for exact in (True, False):
        pieces = tf.bf16_pieces(table, exact)
        assert pieces.is_contiguous() and pieces.dtype == torch.bfloat16
    # Three pieces hold the fp32 values within 2**-24 relative (here: exactly, 24 bits in 3 x 8).
    three = tf.bf16_pieces(table, False).float().sum(0)
    torch.testing.assert_close(three, table, rtol=2.0**-24, atol=0.0)
