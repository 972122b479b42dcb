"""The search: properties of the suites asserted on calls drawn over the whole input space.

Specification. For every call Hypothesis draws inside the implementation's envelope
(``pytest_sparse_mla.search.calls``: every dimension of ``pytest_sparse_mla.input_space``, from
one token to the prefill route, widths, page sizes, lengths, masks, duplicates, the first and last
slot, magnitudes over each format's whole range, placed score regimes, ``sm_scale`` values real
models pass and others the contract admits, sinks from ``-inf`` to far above the scores, both LSE
conventions, cache forms, page strides, per-layer views and strided queries):

* **The float64 oracle**: output and LSE match ``oracle_forward`` under the implementation's
  tolerance profile (the sink as an extra logit, the LSE convention and its empty-row sentinels
  included; a kernel without an LSE is judged on its output, which the sink and every lane still
  move); a row without a valid lane outputs exactly 0.
* **Never-read bytes**: every cache byte no valid lane reads is an FP8 NaN pattern, lanes past
  ``topk_length`` name poisoned slots or hold stale padding: none reaches the output.
* **Nothing written outside the outputs**: every input's whole allocation (canary bytes before and
  after each cache, the other layers of its pool, the queries' padding) is unchanged by the call.
* **Call sequences on the same buffers**: the call is made, then its buffers (queries, caches,
  indices, lengths, sink) are rewritten in place with the contents of the next step's call of the
  same shapes (``search.next_step``, ``search.rewritten_in_place``) and the kernel is called again,
  twice: each call is judged in full against the oracle of what its buffers hold now. A kernel
  that keeps state between calls (a plan, a dequantized cache or lengths keyed by a buffer's
  address) must answer as one that does not.
* **Lane order and padding**: the same call with each row's valid lanes permuted (within its
  length) and the row padded with ``-1`` lanes (to a width the envelope takes) is judged in full
  the same way: a kernel whose answer depends on where a lane sits (a row ended at its first
  ``-1``, a tile count taken from the width) fails it.

A failure shrinks to a minimal call; its message gives the call in words, the likely cause read from
the evidence (``search.diagnose``) and Hypothesis's ``@reproduce_failure`` line; with
``--sparse-mla-repro-dir`` the minimal call gets a standalone reproducer. Budget: the
``sparse_mla_search`` fixture (``--sparse-mla-search-examples``, ``--sparse-mla-search-seed``,
``--sparse-mla-search-shards``; derandomized and small by default).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

pytest.importorskip("hypothesis")

from pytest_sparse_mla import regions, search  # noqa: E402
from pytest_sparse_mla.attention import oracle_forward  # noqa: E402
from pytest_sparse_mla.guard import check_result_shapes  # noqa: E402

pytestmark = [pytest.mark.sparse_mla_needs("sparse_mla_forward"), pytest.mark.sparse_mla_error_class("search")]


def _judge(impl: Any, inputs: search.SearchInputs, tol: Any, run: Any = None) -> None:
    """One drawn call against the oracle, its inputs and its empty rows (module docstring); ``run``
    (the ``sparse_mla_search`` fixture) first warms the kernel on a shape it has not met (CUDA)."""
    call = inputs.call
    if run is not None:
        run.warm(impl, inputs)
    res = impl.sparse_mla_forward(inputs.q, inputs.kv_cache, inputs.indices, **inputs.kwargs)
    changed = inputs.changed_inputs()
    assert not changed, f"the call wrote into its inputs: {'; '.join(changed)}\ncall: {call.describe()}"
    check_result_shapes(res, call.num_tokens, call.num_heads)
    oracle = oracle_forward(inputs.q, inputs.kv_cache, inputs.indices, **inputs.kwargs)
    empty = ~inputs.valid.any(-1).to(res.output.device)
    if bool(empty.any()):
        rows = res.output[empty]
        assert bool((rows == 0).all()), (
            f"{int(empty.sum())} rows have no valid lane: their output must be exactly 0; got max |output| "
            f"{float(rows.float().abs().nan_to_num(nan=float('inf')).max()):.3g}\ncall: {call.describe()}"
        )
    try:
        tol.check_result(res, oracle, fmt=call.fmt, what="drawn call")
    except AssertionError as exc:
        hints = ([] if run is not None and not run.hints  # a call on the way to the reported one: no diagnosis
                 else search.diagnose(res.output, inputs, oracle, oracle_forward))  # fmt: skip
        text = "\n".join([str(exc), *hints])
        raise AssertionError(f"{text}\ncall: {search.describe_call(inputs, text)}") from None


def _built(call: search.DrawnCall, device: torch.device, run: Any) -> search.SearchInputs:
    """``call``'s tensors on ``device``, recorded by the search run ``run`` (its coverage record)."""
    inputs = search.build(call, device)
    run.note(call, inputs)
    return inputs


def test_a_drawn_call_matches_the_oracle(
    sparse_mla_impl, sparse_mla_envelope, sparse_mla_tolerances, sparse_mla_device, sparse_mla_search
):
    def drawn(call: search.DrawnCall) -> None:
        inputs = _built(call, sparse_mla_device, sparse_mla_search)
        _judge(sparse_mla_impl, inputs, sparse_mla_tolerances, sparse_mla_search)

    sparse_mla_search.check(drawn, sparse_mla_envelope, sparse_mla_device.type)


def _reorder(indices: torch.Tensor, lengths: torch.Tensor | None, generator: torch.Generator) -> torch.Tensor:
    """Each row's lanes below its length (all lanes without lengths) in a random order."""
    num_tokens, width = indices.shape
    lanes = torch.arange(width).expand(num_tokens, width)
    inside = lanes < (lengths.cpu().long().clamp(0, width).unsqueeze(1) if lengths is not None else width)
    keys = torch.where(inside, torch.rand((num_tokens, width), generator=generator), 1.0 + lanes)
    return indices.gather(1, keys.argsort(dim=1).to(indices.device))


def _wider(width: int, widths: Any) -> int:
    """The next width after ``width`` that ``widths`` (the envelope's ``topk`` or ``extra_topk``)
    takes, or ``width`` itself when it takes none: what :func:`_padded` pads a row to."""
    return max(width, widths.fit(width + 1)[1])


def _padded(indices: torch.Tensor, widths: Any) -> torch.Tensor:
    """``indices`` with ``-1`` lanes up to the next width ``widths`` takes (itself when none)."""
    width = indices.shape[1]
    wider = _wider(width, widths)
    if wider == width:
        return indices
    pad = torch.full((indices.shape[0], wider - width), -1, dtype=indices.dtype, device=indices.device)
    return torch.cat([indices, pad], dim=1)


def test_a_drawn_call_does_not_depend_on_lane_order_or_padding(
    sparse_mla_impl, sparse_mla_envelope, sparse_mla_tolerances, sparse_mla_device, sparse_mla_search
):
    env = sparse_mla_envelope

    def drawn(call: search.DrawnCall) -> None:
        inputs = search.build(call, sparse_mla_device)
        g = torch.Generator().manual_seed(call.seed + 1)
        kw = dict(inputs.kwargs)
        moved = _padded(_reorder(inputs.indices, kw.get("topk_length"), g), env.topk)
        if "extra_indices" in kw:
            kw["extra_indices"] = _padded(_reorder(kw["extra_indices"], kw.get("extra_topk_length"), g), env.extra_topk)
        moved_inputs = dataclasses.replace(inputs, indices=moved, kwargs=kw)
        sparse_mla_search.note(call, inputs, judged=moved_inputs)  # the padded shape is the one warmed
        _judge(sparse_mla_impl, moved_inputs, sparse_mla_tolerances, sparse_mla_search)

    def judged_as(call: search.DrawnCall, classes: dict[str, str]) -> dict[str, str]:
        """The classes of the permuted, padded call (a known region of -1 lanes holds it)."""
        main = _wider(call.main.width, env.topk) > call.main.width
        extra = call.extra is not None and _wider(call.extra.width, env.extra_topk) > call.extra.width
        return regions.permuted_and_padded(classes, main_padded=main, extra_padded=extra)

    sparse_mla_search.check(drawn, env, sparse_mla_device.type, covering=False, judged_as=judged_as)


def test_a_call_sequence_on_the_same_buffers_matches_fresh_calls(
    sparse_mla_impl, sparse_mla_envelope, sparse_mla_tolerances, sparse_mla_device, sparse_mla_search
):
    def drawn(call: search.DrawnCall) -> None:
        buffers = _built(call, sparse_mla_device, sparse_mla_search)
        _judge(sparse_mla_impl, buffers, sparse_mla_tolerances, sparse_mla_search)
        for step in (1, 2):
            fresh = _built(search.next_step(call, step), sparse_mla_device, sparse_mla_search)
            try:
                _judge(sparse_mla_impl, search.rewritten_in_place(buffers, fresh), sparse_mla_tolerances)
            except AssertionError as exc:
                raise AssertionError(
                    f"call {step + 1} of a sequence on the same buffers (call 1 passed): {exc}"
                ) from None

    sparse_mla_search.check(drawn, sparse_mla_envelope, sparse_mla_device.type, covering=False,
                            examples=max(1, sparse_mla_search.examples // 4))  # three calls per draw
