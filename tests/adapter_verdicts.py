"""Three peer adapters around the bundled reference (CPU), for ``test_adapter_verdicts.py``: the same
checks and the same arithmetic, reached three ways.

* ``AskedPeer``: the adapter hands the call to its "peer" through ``_peer.call_peer`` (the way every
  built-in adapter runs its peer), so the reference's errors are the peer's own verdict.
* ``AdapterAnswers``: the adapter runs the same checks itself, outside ``call_peer``: its errors are
  refusals from adapter code, which must never make a test pass.
* ``UnsafeLengths``: like ``AskedPeer``, but refuses a strided ``topk_length`` with ``UnsafeForPeer``
  naming it (an invariant test accepts a refusal that names the argument: an adapter's must not count).
"""

from __future__ import annotations

from typing import Any

from pytest_sparse_mla.implementations import ReferenceImplementation
from pytest_sparse_mla.implementations._peer import PeerAdapter, UnsafeForPeer, call_peer

_REFERENCE = ReferenceImplementation(None)
_SOURCE = {"kind": "import", "module": "pytest_sparse_mla.implementations"}


class _OverReference(PeerAdapter):
    envelope = _REFERENCE.envelope
    devices = ("cpu", "cuda")
    peer = "the bundled reference as a peer"

    def pack(self, *args: Any, **kwargs: Any) -> Any:
        return _REFERENCE.pack(*args, **kwargs)


class AskedPeer(_OverReference):
    name = "asked-peer"

    def sparse_mla_forward(self, q: Any, kv_cache: Any, indices: Any, **kwargs: Any) -> Any:
        return call_peer(_SOURCE, "sparse_mla_forward", _REFERENCE.sparse_mla_forward, (q, kv_cache, indices), kwargs)


class AdapterAnswers(_OverReference):
    name = "adapter-answers"

    def sparse_mla_forward(self, q: Any, kv_cache: Any, indices: Any, **kwargs: Any) -> Any:
        return _REFERENCE.sparse_mla_forward(q, kv_cache, indices, **kwargs)  # not through call_peer


class UnsafeLengths(AskedPeer):
    name = "unsafe-lengths"

    def sparse_mla_forward(self, q: Any, kv_cache: Any, indices: Any, **kwargs: Any) -> Any:
        length = kwargs.get("topk_length")
        if length is not None and not length.is_contiguous():
            stride = length.stride()
            raise UnsafeForPeer(f"{self.name}: topk_length has stride {stride}; the peer reads it contiguously")
        return super().sparse_mla_forward(q, kv_cache, indices, **kwargs)
