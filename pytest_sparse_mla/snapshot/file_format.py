"""The tensor golden file format: what a test asserts (:func:`exact`, :func:`close`) and the
``*.tensor.json`` file it is stored in. Imports neither pytest nor syrupy; torch only inside
functions.

A test states how each tensor is compared, per snapshot:

* :func:`exact` for byte layouts (packed caches, split pages, index tensors): the file holds shape,
  dtype, strides, the byte count, the SHA-256 of the raw bytes and a short SHA-256 of every slice
  along dim 0 (so a diff names the page that changed); a match needs all of them equal.
* :func:`close` for float outputs: the file holds shape, dtype, strides, a few rounded statistics
  and the values themselves (base64 of the raw little-endian bytes, row-major, 57 bytes a line); a
  match needs the same shape and dtype and values within ``atol + rtol * |golden|``
  (``torch.testing.assert_close``). A mismatch report (:func:`compare_close`) gives the number of
  mismatched elements, the greatest absolute and relative differences, their indices and the
  values there.

A file is a JSON object, one field a line (lists of strings one element a line, so a diff shows
what changed), starting with ``"format": FORMAT_TAG``. :func:`read_tensor_snapshot` decodes one.
Where a file lives is ``pytest_sparse_mla.snapshot.location``'s business; checking and writing
files during a test is the syrupy extension's (``pytest_sparse_mla.snapshot.extension``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "FILE_EXTENSION",
    "FORMAT_TAG",
    "TensorRecord",
    "TensorSnapshot",
    "close",
    "compare_close",
    "exact",
    "read_tensor_snapshot",
]

#: First field of every snapshot file; bump the number when the file layout changes.
FORMAT_TAG = "pytest-sparse-mla/tensor-snapshot/1"
#: File name suffix of tensor snapshots (distinct from syrupy's own ``.json`` extension).
FILE_EXTENSION = "tensor.json"
_B64_BYTES_PER_LINE = 57  # 76 base64 characters, the MIME line length
_DIM0_HASH_MAX_ROWS = 256
_DIM0_HASH_HEX = 16
_COMPARES = ("exact", "close")


# --- what a test asserts -----------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSnapshot:
    """A tensor and how it is compared with its golden (build it with :func:`exact` / :func:`close`).

    Attributes:
        tensor: any strided ``torch.Tensor`` on any device (copied to the CPU to serialize).
        compare: ``"exact"`` (bytes, shape, dtype, strides) or ``"close"`` (values within tolerance).
        atol, rtol: tolerances of ``"close"`` (ignored by ``"exact"``).
    """

    tensor: Any
    compare: str
    atol: float = 0.0
    rtol: float = 0.0


def _check_tensor(tensor: object, func: str) -> torch.Tensor:
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{func}(tensor={type(tensor).__name__}): expected a torch.Tensor")
    if tensor.layout != torch.strided:
        raise ValueError(f"{func}(tensor): layout {tensor.layout} is not supported; expected strided")
    if tensor.device.type == "meta":
        raise ValueError(f"{func}(tensor): a meta tensor has no values to snapshot")
    return tensor


def exact(tensor: torch.Tensor) -> TensorSnapshot:
    """Compare ``tensor`` bit for bit: shape, dtype, strides and the SHA-256 of its raw bytes.

    For packed caches (uint8 ``[P, ps, 1, 584]`` and other forms, page stride kept), split pages,
    index tensors and anything else whose exact bytes are the contract. The bytes hashed are the
    tensor's elements in row-major order (padding between pages is not an element and is not
    hashed; the page stride is recorded in ``strides``, in elements).

    Raises:
        TypeError: ``tensor`` is not a ``torch.Tensor``.
        ValueError: a sparse or meta tensor.
    """
    return TensorSnapshot(_check_tensor(tensor, "exact"), "exact")


def close(tensor: torch.Tensor, *, atol: float, rtol: float) -> TensorSnapshot:
    """Compare the floating-point ``tensor`` with its golden within ``atol + rtol * |golden|``.

    Shape and dtype must match exactly; strides are recorded but not compared. The comparison is
    ``torch.testing.assert_close(received, golden, atol=atol, rtol=rtol, equal_nan=False)`` in
    float64 (NaN never matches; equal infinities do).

    Args:
        tensor: a floating-point tensor (e.g. attention output ``[T, H, 512]`` BF16, lse ``[T, H]``
            fp32).
        atol: absolute tolerance, same units as the values, finite and ``>= 0``.
        rtol: relative tolerance (a fraction), finite and ``>= 0``.

    Raises:
        TypeError: not a tensor, or not a floating-point dtype.
        ValueError: a negative or non-finite tolerance; a sparse or meta tensor.
    """
    t = _check_tensor(tensor, "close")
    if not t.is_floating_point():
        raise TypeError(
            f"close(tensor): dtype {t.dtype} is not floating point; use exact() for integer, "
            "boolean and byte tensors"
        )
    for arg, value in (("atol", atol), ("rtol", rtol)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"close({arg}={value!r}): expected a float")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"close({arg}={value!r}): expected a finite value >= 0")
    return TensorSnapshot(t, "close", float(atol), float(rtol))


# --- the file ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorRecord:
    """A snapshot file, decoded (see :func:`read_tensor_snapshot`).

    Attributes:
        compare: ``"exact"`` or ``"close"``.
        dtype: the ``torch.dtype``.
        shape, strides: as recorded (strides in elements).
        sha256: hex SHA-256 of the raw bytes.
        values: the stored values as a CPU tensor of ``dtype`` (``"close"`` snapshots), else ``None``.
        fields: every field of the file, parsed.
    """

    compare: str
    dtype: Any
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    sha256: str
    values: Any
    fields: dict[str, Any]


def _raw_bytes(t: torch.Tensor) -> bytes:
    """Row-major raw bytes of ``t``'s elements (little-endian; copied to the CPU)."""
    import torch

    if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
        raise RuntimeError("tensor snapshots store little-endian bytes; this machine is big-endian")
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    u8 = flat.view(torch.uint8)
    try:
        return u8.numpy().tobytes()
    except (RuntimeError, TypeError, ImportError):  # torch built without numpy
        return bytes(u8.tolist())


def _dtype_from_name(name: object) -> torch.dtype:
    import torch

    attr = str(name).removeprefix("torch.")
    dtype = getattr(torch, attr, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} in a tensor snapshot is not a torch dtype")
    return dtype


def _decode_values(fields: dict[str, Any]) -> torch.Tensor:
    import torch

    dtype = _dtype_from_name(fields["dtype"])
    shape = tuple(int(v) for v in fields["shape"])
    raw = base64.b64decode("".join(fields["values"]), validate=True)
    if len(raw) != int(fields["nbytes"]):
        raise ValueError(f"values hold {len(raw)} bytes; the header says nbytes={fields['nbytes']}")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    as_bytes = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    if dtype == torch.bool:
        return as_bytes.to(torch.bool).reshape(shape)
    return as_bytes.view(dtype).reshape(shape)


def _round(x: float) -> float:
    return float(f"{x:.6g}")


def _stats(t: torch.Tensor) -> dict[str, Any]:
    import torch

    x = t.detach().to("cpu", torch.float64).reshape(-1)
    finite = x[torch.isfinite(x)]
    stats: dict[str, Any] = {}
    if finite.numel():
        stats.update(
            min=_round(finite.min().item()),
            max=_round(finite.max().item()),
            mean=_round(finite.mean().item()),
            rms=_round(finite.square().mean().sqrt().item()),
        )
    stats.update(
        nan=int(torch.isnan(x).sum().item()),
        posinf=int((x == math.inf).sum().item()),
        neginf=int((x == -math.inf).sum().item()),
    )
    return stats


def _fields(snap: TensorSnapshot) -> dict[str, Any]:
    """The fields of a snapshot file, in file order."""
    t = snap.tensor
    raw = _raw_bytes(t)
    fields: dict[str, Any] = {
        "format": FORMAT_TAG,
        "compare": snap.compare,
        "dtype": str(t.dtype),
        "shape": list(t.shape),
        "strides": list(t.stride()),
        "nbytes": len(raw),
        "sha256": hashlib.sha256(raw).hexdigest(),
    }
    if snap.compare == "exact":
        if t.dim() >= 2 and 1 < t.shape[0] <= _DIM0_HASH_MAX_ROWS:
            row = len(raw) // t.shape[0]
            fields["sha256_dim0"] = [
                hashlib.sha256(raw[i * row : (i + 1) * row]).hexdigest()[:_DIM0_HASH_HEX]
                for i in range(t.shape[0])
            ]
    else:
        fields["stats"] = _stats(t)
        fields["values_encoding"] = "base64 of the raw little-endian bytes, row-major"
        fields["values"] = [
            base64.b64encode(raw[i : i + _B64_BYTES_PER_LINE]).decode("ascii")
            for i in range(0, len(raw), _B64_BYTES_PER_LINE)
        ]
    return fields


def _render(fields: dict[str, Any], *, omit_values: bool = False) -> str:
    """One field a line; lists of strings one element a line (so a diff shows what changed)."""
    lines = ["{"]
    items = list(fields.items())
    for i, (key, value) in enumerate(items):
        comma = "," if i < len(items) - 1 else ""
        if key == "values" and omit_values:
            lines.append(f'  "values": "<{len(value)} lines of base64>"{comma}')
        elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            lines.append(f"  {json.dumps(key)}: [")
            lines.extend(
                f"    {json.dumps(v)}{',' if j < len(value) - 1 else ''}" for j, v in enumerate(value)
            )
            lines.append(f"  ]{comma}")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}{comma}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _parse(text: object) -> dict[str, Any] | None:
    """The fields of a snapshot text, or ``None`` when it is not a tensor snapshot."""
    if not isinstance(text, str) or not text.strip():
        return None
    try:
        fields = json.loads(text)
    except ValueError:
        return None
    if not isinstance(fields, dict) or fields.get("format") != FORMAT_TAG:
        return None
    if fields.get("compare") not in _COMPARES:
        return None
    return fields


def read_tensor_snapshot(path: str | Path) -> TensorRecord:
    """Read and decode a tensor snapshot file.

    Args:
        path: a ``*.tensor.json`` file written by the ``tensor_snapshot`` fixture
            (``pytest_sparse_mla.snapshot.extension.TensorSnapshotExtension``).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a tensor snapshot of this format, or corrupt values.
    """
    text = Path(path).read_text(encoding="utf-8")
    fields = _parse(text)
    if fields is None:
        raise ValueError(f"{path}: not a tensor snapshot (expected format {FORMAT_TAG!r})")
    values = _decode_values(fields) if fields["compare"] == "close" else None
    return TensorRecord(
        compare=fields["compare"],
        dtype=_dtype_from_name(fields["dtype"]),
        shape=tuple(fields["shape"]),
        strides=tuple(fields["strides"]),
        sha256=fields["sha256"],
        values=values,
        fields=fields,
    )


def compare_close(
    received: torch.Tensor, golden: torch.Tensor, *, atol: float, rtol: float
) -> list[str] | None:
    """Compare two same-shape float tensors; ``None`` if close, else the lines of a report.

    The decision is ``torch.testing.assert_close`` in float64 (``equal_nan=False``); the report
    repeats its message (mismatched elements, greatest absolute and relative difference and their
    indices) and adds the golden and received values at those indices.
    """
    import torch

    r = received.detach().to("cpu", torch.float64)
    g = golden.detach().to("cpu", torch.float64)
    try:
        torch.testing.assert_close(r, g, atol=atol, rtol=rtol, equal_nan=False)
    except AssertionError as exc:
        lines = [f"tensor values differ from the golden beyond atol={atol:g}, rtol={rtol:g}:"]
        lines += [f"  {line}" for line in str(exc).splitlines()[1:] if line.strip()]
        diff = (r - g).abs()
        diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
        rel = diff / g.abs()
        rel = torch.where(torch.isnan(rel), torch.full_like(rel, math.inf), rel)
        seen: set[tuple[int, ...]] = set()
        for what, err in (("absolute", diff), ("relative", rel)):
            flat = int(torch.argmax(err.reshape(-1)).item()) if err.numel() else 0
            index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), r.shape))
            if index in seen:
                continue
            seen.add(index)
            lines.append(
                f"  at index {index} (greatest {what} difference): golden {g[index].item()!r}, "
                f"received {r[index].item()!r}"
            )
        return lines
    return None
