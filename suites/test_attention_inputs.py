"""Bad input to ``sparse_mla_forward``: every implementation raises a clear error.

Specification: a ``TypeError`` or ``ValueError`` whose message names the offending argument, for
wrong dtypes and shapes, a ``topk_length`` of the wrong length, a sink of the wrong size, an extra
cache without extra indices (and the reverse), ``extra_topk_length`` without an extra cache, and
tensors on different devices. FlashInfer 0.7.4 raises ``ValueError`` for its metadata checks
(``flashinfer/mla/_sparse_mla_sm120/_api.py`` ``_sparse_mla_sm120_paged_attention`` and
``data/csrc/sparse_mla_sm120/attention_validation.h``; older releases raised ``RuntimeError``, listed
in an xfail file if needed). ``num_tokens == 0`` is a no-op that returns empty results (FlashInfer
returns before launching).

The well-formed call each bad input is made from is fitted to the implementation's envelope (head
count, widths); a bad input about something the envelope does not take (an extra cache, lengths,
a sink) is not applicable. These calls go to the implementation directly, past the envelope guard.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pytest_sparse_mla.attention.cases import AttentionCase, AttentionInputs, CacheCase, Conventions

pytestmark = pytest.mark.sparse_mla_needs("sparse_mla_forward")

CASE = AttentionCase("bad", 4, 8, CacheCase(64), extra=CacheCase(64, page_block_size=2, num_pages=64))


def _other_device(device: torch.device) -> str:
    return "meta" if device.type == "cpu" else "cpu"


# name -> (argument the message must name, what of the envelope it needs, mutation of the call's (args, kwargs))
Mutation = Callable[[AttentionInputs, list[Any], dict[str, Any]], None]


def _t(i: AttentionInputs) -> int:
    return int(i.q.shape[0])


def _h(i: AttentionInputs) -> int:
    return int(i.q.shape[1])


BAD_INPUTS: dict[str, tuple[str, str, Mutation]] = {
    "q-float32": ("q", "", lambda i, a, k: a.__setitem__(0, i.q.float())),
    "q-2d": ("q", "", lambda i, a, k: a.__setitem__(0, i.q[:, 0])),
    # the ids name the DSV4 case; a DSV3.2-only kernel gets the same mutations at its own widths
    "q-d576-for-dsv4": ("q", "", lambda i, a, k: a.__setitem__(0, torch.cat([i.q, i.q[..., :64]], -1))),
    "kv_cache-float8": ("kv_cache", "", lambda i, a, k: a.__setitem__(1, i.cache.packed.view(torch.float8_e4m3fn))),
    "kv_cache-width-583": ("kv_cache", "", lambda i, a, k: a.__setitem__(
        1, i.cache.packed[..., : i.cache.fmt.bytes_per_token - 1])),
    "indices-int64": ("indices", "", lambda i, a, k: a.__setitem__(2, i.indices.long())),
    "indices-1d": ("indices", "", lambda i, a, k: a.__setitem__(2, i.indices[0])),
    "indices-wrong-T": ("indices", "", lambda i, a, k: a.__setitem__(2, i.indices[:-1])),
    "topk_length-wrong-length": ("topk_length", "topk_length", lambda i, a, k: k.__setitem__(
        "topk_length", torch.full((_t(i) + 1,), 3, dtype=torch.int32, device=i.q.device))),
    "topk_length-int64": ("topk_length", "topk_length", lambda i, a, k: k.__setitem__(
        "topk_length", torch.full((_t(i),), 3, dtype=torch.int64, device=i.q.device))),
    "attn_sink-wrong-size": ("attn_sink", "sink", lambda i, a, k: k.__setitem__(
        "attn_sink", torch.zeros(_h(i) + 1, dtype=torch.float32, device=i.q.device))),
    "attn_sink-bf16": ("attn_sink", "sink", lambda i, a, k: k.__setitem__(
        "attn_sink", torch.zeros(_h(i), dtype=torch.bfloat16, device=i.q.device))),
    "extra_kv_cache-without-indices": ("extra_indices", "extra", lambda i, a, k: k.pop("extra_indices")),
    "extra_indices-without-cache": ("extra_kv_cache", "extra", lambda i, a, k: k.pop("extra_kv_cache")),
    "extra_topk_length-without-extra": ("extra_topk_length", "extra topk_length", lambda i, a, k: (
        k.pop("extra_kv_cache"), k.pop("extra_indices"), k.__setitem__(
            "extra_topk_length", torch.full((_t(i),), 3, dtype=torch.int32, device=i.q.device)))),
    "extra_indices-wrong-T": ("extra_indices", "extra", lambda i, a, k: k.__setitem__(
        "extra_indices", i.extra_indices[:-1])),
    "attn_sink-other-device": ("attn_sink", "sink", lambda i, a, k: k.__setitem__(
        "attn_sink", torch.zeros(_h(i), dtype=torch.float32, device=_other_device(i.q.device)))),
    "indices-other-device": ("indices", "", lambda i, a, k: a.__setitem__(
        2, torch.zeros(tuple(i.indices.shape), dtype=torch.int32, device=_other_device(i.q.device)))),
}  # fmt: skip


@pytest.mark.sparse_mla_error_class("bad-input")
@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_raises_a_clear_error(name, sparse_mla_impl, sparse_mla_inputs, sparse_mla_envelope):
    argument, needs, mutate = BAD_INPUTS[name]
    env = sparse_mla_envelope
    fmt = env.formats[0] if "dsv4" not in env.formats else "dsv4"
    missing = [n for n, ok in (("extra", env.takes_extra(fmt)), ("topk_length", env.takes_lengths(fmt)),
                               ("sink", env.takes_sink(fmt))) if n in needs.split() and not ok]  # fmt: skip
    if missing:
        pytest.skip(f"not applicable to this envelope: it takes no {' / '.join(missing)} for {fmt!r}")
    inputs = sparse_mla_inputs(CASE)
    args: list[Any] = [inputs.q, inputs.cache.packed, inputs.indices]
    kwargs = inputs.kwargs()
    mutate(inputs, args, kwargs)
    with pytest.raises((TypeError, ValueError)) as excinfo:
        sparse_mla_impl.bad_call(argument, *args, **kwargs)
    assert re.search(rf"\b{argument}\b", str(excinfo.value)), f"the error must name {argument!r}: {excinfo.value}"


@pytest.mark.sparse_mla_error_class("zero-tokens")
def test_zero_tokens_is_a_no_op(sparse_mla_impl, sparse_mla_inputs):
    inputs = sparse_mla_inputs(AttentionCase("empty", 0, 8, CacheCase(64), requires=("tokens",)))
    res = inputs.run(sparse_mla_impl.sparse_mla_forward)
    heads = inputs.q.shape[1]
    assert tuple(res.output.shape) == (0, heads, 512)
    assert res.lse is None or tuple(res.lse.shape) == (0, heads)


#: The two caches a lane may name: the test case, and the argument holding the lane's index row.
_CACHES = {
    "main": (dict(), "indices"),
    "extra": (dict(extra=CacheCase(64, page_block_size=64, num_pages=2), requires=("extra",)), "extra_indices"),
}


def _row_call(inputs: object, argument: str, row: torch.Tensor) -> tuple[tuple[object, ...], dict[str, object]]:
    """The positional and keyword arguments of ``inputs``' call with ``argument`` replaced by ``row``."""
    if argument == "indices":
        return (inputs.q, inputs.cache.packed, row), inputs.kwargs()
    return (inputs.q, inputs.cache.packed, inputs.indices), inputs.kwargs(**{argument: row})


@pytest.mark.sparse_mla_error_class("index-past-cache")
@pytest.mark.parametrize("which", list(_CACHES))
def test_a_valid_lane_past_the_cache_does_what_the_envelope_says(
    which, sparse_mla_impl, sparse_mla_inputs, sparse_mla_envelope, sparse_mla_tolerances
):
    """A valid lane (inside ``topk_length``, index >= 0) naming slot ``num_pages * page_block_size``
    of its cache (the main or the extra one): ``index_past_cache="refused"`` raises a
    ``ValueError`` naming ``indices`` / ``extra_indices``; ``"masked"`` gives the result of ``-1``
    there; ``"undefined"`` is never asked."""
    behaviour = sparse_mla_envelope.index_past_cache
    if behaviour == "undefined":
        pytest.skip("not applicable to this envelope: index_past_cache='undefined'")
    extra_case, argument = _CACHES[which]
    inputs = sparse_mla_inputs(AttentionCase(f"past-cache-{which}", 4, 8, CacheCase(64, num_pages=2),
                                             conventions=Conventions(with_sink=False), **extra_case))  # fmt: skip
    row, cache = getattr(inputs, argument), inputs.cache if which == "main" else inputs.extra
    past = row.clone()
    past[-1, 0] = cache.num_tokens  # one past the last slot
    if behaviour == "refused":
        args, kwargs = _row_call(inputs, argument, past)
        with pytest.raises(ValueError) as excinfo:
            sparse_mla_impl.bad_call(argument, *args, **kwargs)
        assert re.search(rf"\b{argument}\b", str(excinfo.value)), f"the error must name {argument!r}: {excinfo.value}"
        return
    masked = row.clone()
    masked[-1, 0] = -1
    args, kwargs = _row_call(inputs, argument, past)
    a = sparse_mla_impl.sparse_mla_forward(*args, **kwargs)
    args, kwargs = _row_call(inputs, argument, masked)
    b = sparse_mla_impl.sparse_mla_forward(*args, **kwargs)
    sparse_mla_tolerances.check_invariant(a, b, claim="padding", what=f"a lane past the {which} cache vs -1")


@pytest.mark.sparse_mla_error_class("negative-indices")
@pytest.mark.parametrize("which", list(_CACHES))
def test_every_negative_index_masks_its_lane_where_the_envelope_says_so(
    which, sparse_mla_impl, sparse_mla_inputs, sparse_mla_envelope, sparse_mla_tolerances
):
    """``masked_indices="negative"``: lanes holding -2, -7 and ``-2**31`` give the result of -1, in
    the main and in the extra cache's index rows (FlashMLA's prefill and SGLang mask every negative
    index; FlashMLA's decode only -1, and declares ``"minus_one"``, for which this is not
    applicable)."""
    if sparse_mla_envelope.masked_indices != "negative":
        pytest.skip("not applicable to this envelope: masked_indices='minus_one' (only -1 masks a lane)")
    extra_case, argument = _CACHES[which]
    main = CacheCase(64, num_pages=2, masked_fraction=0.5)
    inputs = sparse_mla_inputs(AttentionCase(f"negatives-{which}", 4, 8, main, **extra_case))
    others = getattr(inputs, argument).clone()
    lanes = others == -1
    fill = torch.tensor([-2, -7, -(2**31)], dtype=others.dtype, device=others.device)
    others[lanes] = fill[torch.arange(int(lanes.sum()), device=others.device) % 3]
    args, kwargs = _row_call(inputs, argument, others)
    a = sparse_mla_impl.sparse_mla_forward(*args, **kwargs)
    b = inputs.run(sparse_mla_impl.sparse_mla_forward)
    what = f"-2 / -7 / -2**31 lanes vs -1 lanes ({which} cache)"
    sparse_mla_tolerances.check_invariant(a, b, claim="padding", what=what)
