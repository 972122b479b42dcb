"""Persistent, grow-only, per-device scratch buffers of the page split, keyed by name and key_suffix.

Key scheme: ``f"{name}{key_suffix}:{device}"``, e.g. ``flash_mla_sm120_split:cuda:0`` and
``flash_mla_sm120_mask:cuda:0`` for the default ``key_suffix=""``: byte for byte the keys SGLang
uses in its runtime resource registry (sgl-project/sglang
``python/sglang/kernels/ops/attention/flash_mla_sm120.py``, ``_split_kv_pages_to_64``). A non-empty
suffix goes between the name and the colon (like a downstream ``buf_tag="_extra"`` for the second
split of a call); it must not contain ``":"``.

Allocation rules (each fixes a reported bug):

* grow-only: a request for ``rows`` returns the prefix ``buffer[:rows]`` of the cached buffer when it
  has that many rows (a stable address for CUDA graphs), else a new buffer replaces it (SGLang PR
  #29927);
* zero-filled on every (re)allocation: FlashInfer <= 0.6.18 gathers slot 0 for masked candidates
  (SGLang PR #39288, FlashInfer PR #5075);
* allocated with ``torch.inference_mode(False)`` (SGLang PR #35116).

Backend-private buffers (the Triton touched split's ``flash_mla_sm120_worklist{key_suffix}:{device}``)
live in :attr:`BufferRegistry.backend_scratch`, same keys and rules, so :meth:`BufferRegistry.keys`
lists SGLang's key set whichever backend ran. Why each rule: ``docs/design/page-split.md``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

__all__ = [
    "SPLIT_BUFFER_NAME",
    "MASK_BUFFER_NAME",
    "WORKLIST_BUFFER_NAME",
    "BufferRegistry",
    "buffer_key",
    "split_buffer_key",
    "mask_buffer_key",
    "default_registry",
]

#: Name of the destination (64-token pages) scratch.
SPLIT_BUFFER_NAME = "flash_mla_sm120_split"
#: Name of the touched-page mask (int8, one byte per source page).
MASK_BUFFER_NAME = "flash_mla_sm120_mask"
#: Name of the Triton touched split's int32 claim/worklist scratch (in ``backend_scratch``).
WORKLIST_BUFFER_NAME = "flash_mla_sm120_worklist"


def _normalize_device(device: torch.device | str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _check_key_part(key_suffix: object, argument: str = "key_suffix") -> str:
    if not isinstance(key_suffix, str):
        raise TypeError(f"{argument}={key_suffix!r}: expected a str")
    if ":" in key_suffix:
        raise ValueError(f"{argument}={key_suffix!r}: must not contain ':' (keys are '<name><suffix>:<device>')")
    return key_suffix


def buffer_key(name: str, device: torch.device | str, key_suffix: str = "") -> str:
    """``f"{name}{key_suffix}:{device}"``; ``cuda`` without an index means the current device.

    Raises:
        TypeError: ``name`` or ``key_suffix`` not a str. ValueError: either contains ``":"``.
    """
    _check_key_part(name, "name")
    _check_key_part(key_suffix)
    return f"{name}{key_suffix}:{_normalize_device(device)}"


def split_buffer_key(device: torch.device | str, key_suffix: str = "") -> str:
    """Key of the destination scratch, ``flash_mla_sm120_split{key_suffix}:{device}``."""
    return buffer_key(SPLIT_BUFFER_NAME, device, key_suffix)


def mask_buffer_key(device: torch.device | str, key_suffix: str = "") -> str:
    """Key of the touched-page mask, ``flash_mla_sm120_mask{key_suffix}:{device}``."""
    return buffer_key(MASK_BUFFER_NAME, device, key_suffix)


class BufferRegistry:
    """A small registry of persistent scratch tensors (rules in the module docstring).

    Attributes:
        allocation_log: ``(key, shape, dtype)`` of every allocation this registry made, in order
            (installs are not allocations; ``backend_scratch`` keeps its own log); tests use it to
            prove "allocates nothing".
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._backend_scratch: BufferRegistry | None = None
        self.allocation_log: list[tuple[str, tuple[int, ...], torch.dtype]] = []

    @property
    def backend_scratch(self) -> BufferRegistry:
        """Child registry of backend-private scratch buffers (created on first use).

        Same keys and rules as this registry (grow-only, zero-filled, allocated outside inference
        mode), but not listed by :meth:`keys` / ``len``: the Triton touched split keeps its int32
        worklist there under ``flash_mla_sm120_worklist{key_suffix}:{device}``. :meth:`clear`
        clears it too.
        """
        if self._backend_scratch is None:
            self._backend_scratch = BufferRegistry()
        return self._backend_scratch

    def get(
        self,
        name: str,
        device: torch.device | str,
        shape: tuple[int, ...],
        dtype: torch.dtype = torch.uint8,
        *,
        key_suffix: str = "",
    ) -> torch.Tensor:
        """Return ``buffer[:shape[0]]`` of the buffer under ``(name, device, key_suffix)``.

        The cached buffer is reused when it has at least ``shape[0]`` rows, the same trailing shape
        and dtype; otherwise a zero-filled ``shape`` buffer is allocated outside inference mode and
        replaces it (the old one stays alive only through views the caller still holds).

        Args:
            name: buffer name, e.g. :data:`SPLIT_BUFFER_NAME`.
            device: where the buffer lives.
            shape: ``(rows, *row_shape)``; rows is the grow-only axis.
            dtype: element type.
            key_suffix: isolates buffers of different roles (see :func:`buffer_key`).

        Raises:
            TypeError, ValueError: bad key parts; ``shape`` empty or with a negative entry.
        """
        key = buffer_key(name, device, key_suffix)
        shape = tuple(int(s) for s in shape)
        if not shape or any(s < 0 for s in shape):
            raise ValueError(f"shape={shape}: expected (rows, *row_shape) with entries >= 0")
        buf = self._buffers.get(key)
        if buf is None or buf.dtype != dtype or tuple(buf.shape[1:]) != shape[1:] or buf.shape[0] < shape[0]:
            with torch.inference_mode(False):
                buf = torch.zeros(shape, dtype=dtype, device=_normalize_device(device))
            self._buffers[key] = buf
            self.allocation_log.append((key, shape, dtype))
        return buf[: shape[0]]

    def install(
        self,
        name: str,
        device: torch.device | str,
        buffer: torch.Tensor,
        *,
        key_suffix: str = "",
    ) -> str:
        """Put a caller-made buffer under ``(name, device, key_suffix)`` and return its key.

        Tests use it to surround the destination with canary bytes (amdpilot-org/sglang
        ``test_flash_mla_sm120_page_split_contracts.py`` installs a 0xA5 destination the same way).
        The buffer must be on ``device``, not an inference tensor, and have contiguous rows
        (``stride == (row elements, ..., 1)``) so that prefixes of it are valid scratch.

        Raises:
            TypeError: not a tensor. ValueError: wrong device, inference tensor, non-contiguous.
        """
        key = buffer_key(name, device, key_suffix)
        if not isinstance(buffer, torch.Tensor):
            raise TypeError(f"buffer: expected a torch.Tensor, got {type(buffer).__name__}")
        if buffer.device != _normalize_device(device):
            raise ValueError(f"buffer.device={buffer.device}: expected {_normalize_device(device)}")
        if buffer.is_inference():
            raise ValueError("buffer: an inference tensor cannot be a persistent scratch buffer")
        if not buffer.is_contiguous():
            raise ValueError(
                f"buffer.stride()={buffer.stride()}: expected contiguous rows (shape {tuple(buffer.shape)})"
            )
        self._buffers[key] = buffer
        return key

    def lookup(self, name: str, device: torch.device | str, *, key_suffix: str = "") -> torch.Tensor | None:
        """The whole buffer under ``(name, device, key_suffix)``, or ``None``."""
        return self._buffers.get(buffer_key(name, device, key_suffix))

    def discard(self, name: str, device: torch.device | str, *, key_suffix: str = "") -> None:
        """Forget the buffer under ``(name, device, key_suffix)`` if there is one."""
        self._buffers.pop(buffer_key(name, device, key_suffix), None)

    def keys(self) -> list[str]:
        """Sorted keys of the buffers held."""
        return sorted(self._buffers)

    def clear(self) -> None:
        """Forget every buffer, backend scratch included (the allocation logs are kept)."""
        self._buffers.clear()
        if self._backend_scratch is not None:
            self._backend_scratch.clear()

    def __contains__(self, key: object) -> bool:
        return key in self._buffers

    def __len__(self) -> int:
        return len(self._buffers)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __repr__(self) -> str:
        items = [f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in sorted(self._buffers.items())]
        if self._backend_scratch is not None and len(self._backend_scratch):
            items.append(f"backend_scratch={self._backend_scratch!r}")
        return f"BufferRegistry({', '.join(items)})"


_DEFAULT = BufferRegistry()


def default_registry() -> BufferRegistry:
    """The process-wide registry that :func:`page_split` uses when ``registry=None``.

    Suites should prefer the per-test ``split_buffer_registry`` fixture, which isolates tests.
    """
    return _DEFAULT
