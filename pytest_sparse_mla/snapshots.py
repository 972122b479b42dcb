"""Golden snapshots of tensors: the stable public names (a re-export module).

The goldens live in the package ``pytest_sparse_mla.snapshot``, by concern: ``file_format`` (what
a test asserts and the ``*.tensor.json`` file), ``location`` (where files live), ``session`` (a
session's golden root and the ``--snapshot-update`` guard) and ``extension`` (the syrupy
extension). This module only re-exports their public names, so that tests keep one import::

    from pytest_sparse_mla.snapshots import close, exact

    assert tensor_snapshot(name="packed") == exact(cache.packed)
    assert tensor_snapshot(name="output") == close(res.output, atol=2e-3, rtol=1e-2)

* :func:`exact`: shape, dtype, strides and the SHA-256 of the raw bytes must match.
* :func:`close`: same shape and dtype, values within ``atol + rtol * |golden|``.
* Files: ``<golden root>/<suite>/<test module>/<test name>[<name>].tensor.json``
  (:func:`golden_file`); the root is ``--sparse-mla-golden-dir`` / ini ``sparse_mla_golden_dir``
  or :func:`default_golden_dir` (:func:`golden_root` of a session).

Importing this module imports neither syrupy nor torch; ``TensorSnapshotExtension`` (which needs
syrupy) and :func:`golden_root` (which reads pytest's config) are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pytest_sparse_mla.snapshot.file_format import (
    FILE_EXTENSION,
    FORMAT_TAG,
    TensorRecord,
    TensorSnapshot,
    close,
    compare_close,
    exact,
    read_tensor_snapshot,
)
from pytest_sparse_mla.snapshot.location import (
    default_golden_dir,
    golden_file,
    pop_session_root,
    push_session_root,
    session_roots,
    suite_name,
)

if TYPE_CHECKING:  # for type checkers; at run time __getattr__ imports them on first use
    from pytest_sparse_mla.snapshot.extension import TensorSnapshotExtension
    from pytest_sparse_mla.snapshot.session import golden_root

__all__ = [
    "FORMAT_TAG",
    "FILE_EXTENSION",
    "TensorSnapshot",
    "TensorRecord",
    "exact",
    "close",
    "default_golden_dir",
    "golden_root",
    "golden_file",
    "session_roots",
    "suite_name",
    "read_tensor_snapshot",
    "compare_close",
    "TensorSnapshotExtension",
    "pop_session_root",
    "push_session_root",
]

def __getattr__(name: str) -> Any:
    """``TensorSnapshotExtension`` (``snapshot.extension``, subclasses syrupy's extension) and
    ``golden_root`` (``snapshot.session``, reads the session's options) are imported on first use.

    Raises:
        ImportError: ``TensorSnapshotExtension`` where syrupy is not installed.
        AttributeError: any other missing name.
    """
    if name == "TensorSnapshotExtension":
        from pytest_sparse_mla.snapshot.extension import TensorSnapshotExtension

        return TensorSnapshotExtension
    if name == "golden_root":
        from pytest_sparse_mla.snapshot.session import golden_root

        return golden_root
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
