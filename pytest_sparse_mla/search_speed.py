"""The search at GPU speed: a kernel warmed on a new shape before its judged call.

A Triton (or TileLang, or ``torch.utils.cpp_extension``) kernel compiles, and an autotuned one
benchmarks its configurations, the first time it meets a new specialisation: a new head count, a
new width, a new page size, a new dtype or alignment of an argument. On an H200 that is seconds
per shape, against milliseconds for the call itself: a drawn call that happens to be the first of
its shape spends its time limit compiling (``device_health.compiling_in`` names that case in a
timeout's message). :func:`warm` runs the implementation once on a copy of a call's inputs, outside
the judged call, so that the judged call runs a compiled kernel; its result is never judged.

Imports torch inside functions only; never imports pytest.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["WARMED", "shape_key", "warm", "warm_arguments"]

#: Shape keys (:func:`shape_key`) this process has warmed a kernel on: Triton's and TileLang's
#: compiled kernels and autotune results live per process, so one warm-up per key and process
#: serves every later test of the same xdist worker (the search and the fixed cases alike).
WARMED: set[tuple[Any, ...]] = set()


def shape_key(q: Any, kv_cache: Any, indices: Any, kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """What a JIT kernel may specialise on, for CUDA inputs (``None`` when ``q`` is not a CUDA
    tensor): every tensor argument's shape, strides, dtype and 16-byte alignment (Triton
    specialises integer arguments equal to 1 or divisible by 16 and pointers aligned to 16 bytes;
    an autotuner keys on sizes), which keywords are given, and the values of the non-numeric ones
    (``fmt``, conventions); other values by their type name."""
    if getattr(getattr(q, "device", None), "type", None) != "cuda":
        return None

    def key(v: Any) -> Any:
        if hasattr(v, "untyped_storage"):
            return (tuple(v.shape), v.stride(), str(v.dtype), (v.storage_offset() * v.element_size()) % 16)
        return v if isinstance(v, (str, bool)) or v is None else type(v).__name__

    return (key(q), key(kv_cache), key(indices), tuple(sorted((k, key(v)) for k, v in kwargs.items())))


def warm(impl: Any, inputs: Any, *, synchronize: bool = True) -> float:
    """Run ``impl.sparse_mla_forward`` once on copies of ``inputs``' tensors (a
    :class:`pytest_sparse_mla.search.SearchInputs`), to compile and autotune its kernels for this
    shape before the judged call; the result is discarded and nothing is checked.

    The copies are fresh allocations of the same shapes, strides, dtypes, devices and storage offsets
    (views inside a copy of each whole allocation), so a kernel specialised on alignment or
    strides compiles the same variant the judged call uses, and a kernel that writes into its inputs
    cannot change the judged call's (``SearchInputs.before`` stays the reference). Call it with the
    implementation as the search calls it (the guarded ``sparse_mla_impl`` fixture: the call is
    then recorded as a kernel call in flight, so a hang while warming is reported like any other).

    Args:
        impl: an object with ``sparse_mla_forward(q, kv_cache, indices, **kwargs)``.
        inputs: the built call (``q``, ``kv_cache``, ``indices``, ``kwargs``).
        synchronize: wait for the device afterwards (CUDA), so compile and run time end inside
            this function.

    Returns:
        The wall time of the warm-up call in seconds (compilation included).

    Raises:
        Whatever the implementation raises: a call that fails while warming would fail judged too.
    """
    return warm_arguments(impl, inputs.q, inputs.kv_cache, inputs.indices, inputs.kwargs, synchronize=synchronize)


def warm_arguments(
    impl: Any, q: Any, kv_cache: Any, indices: Any, kwargs: dict[str, Any], *, synchronize: bool = True
) -> float:
    """:func:`warm` for a call given as its arguments (``impl.sparse_mla_forward(q, kv_cache,
    indices, **kwargs)``): one call on copies of every tensor argument (each whole allocation
    copied once, views kept as views), the result discarded. Returns the wall time in seconds;
    raises whatever the implementation raises."""
    import torch

    clones: dict[int, torch.Tensor] = {}

    def copy(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in clones:  # one copy per allocation: views of one pool stay views of one copy
            flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            clones[key] = flat.clone()
        whole = clones[key]
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(
            whole.untyped_storage(), t.storage_offset(), t.shape, t.stride()
        )

    q, kv, idx = copy(q), copy(kv_cache), copy(indices)
    kwargs = {k: copy(v) for k, v in kwargs.items()}
    start = time.perf_counter()
    impl.sparse_mla_forward(q, kv, idx, **kwargs)
    if synchronize and q.device.type == "cuda":
        torch.cuda.synchronize(q.device)
    return time.perf_counter() - start
