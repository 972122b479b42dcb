"""The syrupy extension of the tensor goldens: ``TensorSnapshotExtension`` (imports syrupy).

The ``tensor_snapshot`` fixture (``pytest_sparse_mla.fixtures``) hands it to syrupy's ``snapshot``.
It writes the file format of ``pytest_sparse_mla.snapshot.file_format`` at the place
``pytest_sparse_mla.snapshot.location`` names, under the session's root
(``pytest_sparse_mla.snapshot.session.golden_root``). Only this module of the package imports
syrupy, so the others import where syrupy is not installed; the class is also reachable, imported
on first use, as ``pytest_sparse_mla.snapshots.TensorSnapshotExtension``.

syrupy facts this extension relies on (syrupy-project/syrupy ``src/syrupy/extensions/single_file.py``,
``extensions/base.py``, ``assertion.py``, ``location.py``, ``report.py``; the gotchas are also
recorded in AntoineD/syrupy-matplotlib ``src/syrupy_matplotlib/_extension.py``):

* ``matches()`` gets no test context: the tolerance of the current assertion is stashed on the
  extension instance by ``serialize()`` (syrupy calls both on the same instance, in that order).
* An exception inside ``serialize()`` / ``matches()`` is caught by syrupy and turned into a failed
  assertion whose diff is the traceback; wrong arguments are therefore rejected earlier, by
  ``file_format.exact`` and ``file_format.close``, with a plain exception in the test body.
* Files under a suite's directory that no test claims are reported as unused and deleted by
  ``--snapshot-update``; :meth:`TensorSnapshotExtension.matches_test_location` claims a file only
  from its own ``<suite>/<module>`` directory.

syrupy versions: checking and writing goldens works from 4.6 (``file_extension`` became public in
5.0; both spellings are set). Unused detection outside ``__snapshots__`` directories needs 4.7.2,
unused detection under pytest-xdist 5.5 (syrupy PR #1132), and the per-directory ownership above
7.0 (older releases never ask the extension, so a skipped test of a same-named module in another
suite can keep an orphan from being reported). Goldens of a *deleted* test module are reported
only when pytest runs without path arguments and still collects another module of that suite
(syrupy scans the suite directory of each collected module, and its ``report.py`` cleans up after
deleted modules only inside a directory named on the command line, which the golden root is not).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from syrupy.extensions.single_file import SingleFileSnapshotExtension, WriteMode

from pytest_sparse_mla.snapshot.file_format import (
    FILE_EXTENSION,
    TensorSnapshot,
    _decode_values,
    _fields,
    _parse,
    _render,
    compare_close,
)
from pytest_sparse_mla.snapshot.location import default_golden_dir, session_roots, suite_name
from pytest_sparse_mla.snapshot.session import golden_root

__all__ = ["TensorSnapshotExtension"]


def _root_for(test_location: Any) -> Path:
    config = getattr(getattr(test_location, "item", None), "config", None)
    if config is not None:
        return golden_root(config)
    roots = session_roots()
    if roots:
        return roots[-1]
    return default_golden_dir()


class TensorSnapshotExtension(SingleFileSnapshotExtension):
    """syrupy extension storing one ``.tensor.json`` file per snapshot under the golden root.

    Accepts only :class:`TensorSnapshot` values (``file_format.exact``, ``file_format.close``).
    See ``pytest_sparse_mla.snapshot.file_format`` for the file layout and the comparison rules.
    """

    _write_mode = WriteMode.TEXT
    file_extension = FILE_EXTENSION  # syrupy >= 5
    _file_extension = FILE_EXTENSION  # syrupy 4.x

    def __init__(self) -> None:
        super().__init__()
        # (atol, rtol) of the assertion being evaluated: matches() gets no test context.
        self._tolerance: tuple[float, float] | None = None

    # -- where --------------------------------------------------------------------------------

    @classmethod
    def dirname(cls, *, test_location: Any) -> str:
        """``<golden root>/<suite>/<test module stem>``."""
        filepath = Path(test_location.filepath)
        return str(_root_for(test_location) / suite_name(filepath) / test_location.basename)

    @classmethod
    def matches_test_location(cls, *, test_location: Any, snapshot_location: str) -> bool:
        """Claim a file only from this test module's own ``<suite>/<module>`` directory (syrupy
        >= 7 asks this for unused detection; its default accepts any directory outside the test
        tree whose name is the module stem, so same-named modules of two suites would collide)."""
        own = Path(cls.dirname(test_location=test_location)).resolve()
        if Path(snapshot_location).resolve().parent != own:
            return False
        base = getattr(super(), "matches_test_location", None)
        if base is None:  # pragma: no cover - syrupy < 7 never calls this
            return True
        return bool(base(test_location=test_location, snapshot_location=snapshot_location))

    def delete_snapshots(self, *, snapshot_location: str, snapshot_names: set[str]) -> None:
        """Delete an unused snapshot file and its module directory once empty."""
        path = Path(snapshot_location)
        path.unlink(missing_ok=True)
        try:
            path.parent.rmdir()
        except OSError:
            pass

    # -- what ---------------------------------------------------------------------------------

    def serialize(self, data: Any, *, exclude: Any = None, include: Any = None, matcher: Any = None) -> str:
        """Render a :class:`TensorSnapshot` as the text of its file.

        Raises:
            TypeError: ``data`` is not a :class:`TensorSnapshot` (wrap the tensor in :func:`exact`
                or :func:`close`).
        """
        if not isinstance(data, TensorSnapshot):
            raise TypeError(
                f"tensor_snapshot == {type(data).__name__}: expected exact(tensor) or "
                "close(tensor, atol=..., rtol=...) from pytest_sparse_mla.snapshots"
            )
        self._tolerance = (data.atol, data.rtol) if data.compare == "close" else None
        return _render(_fields(data))

    def matches(self, *, serialized_data: Any, snapshot_data: Any) -> bool:
        """Exact snapshots: every field equal. Close snapshots: same shape and dtype, values
        within the tolerance of the assertion (see :func:`compare_close`)."""
        received, golden = _parse(serialized_data), _parse(snapshot_data)
        if received is None or golden is None:
            return bool(serialized_data == snapshot_data)
        if received["compare"] != golden["compare"]:
            return False
        if received["compare"] == "exact":
            return received == golden
        return not self._close_report(received, golden)

    def _close_report(self, received: dict[str, Any], golden: dict[str, Any]) -> list[str]:
        for key in ("format", "dtype", "shape"):
            if received[key] != golden[key]:
                return [f"{key} differs: golden {golden[key]!r}, received {received[key]!r}"]
        if self._tolerance is None:  # no tolerance known: compare the bytes
            if received["sha256"] == golden["sha256"]:
                return []
            return ["values differ (no tolerance known for this comparison)"]
        atol, rtol = self._tolerance
        report = compare_close(
            _decode_values(received), _decode_values(golden), atol=atol, rtol=rtol
        )
        return report or []

    # -- how a failure reads ------------------------------------------------------------------

    def diff_lines(self, serialized_data: Any, snapshot_data: Any) -> Iterator[str]:
        """A tensor-aware diff: the close-comparison report or the dim-0 slices whose hashes
        differ, then a line diff of the file without its base64 values."""
        received, golden = _parse(serialized_data), _parse(snapshot_data)
        if received is not None and golden is not None:
            yield from self._summary(received, golden)
        left = _render(received, omit_values=True) if received is not None else serialized_data
        right = _render(golden, omit_values=True) if golden is not None else snapshot_data
        yield from super().diff_lines(left, right)

    def _summary(self, received: dict[str, Any], golden: dict[str, Any]) -> Iterator[str]:
        if received["compare"] != golden["compare"]:
            yield f"compare mode differs: golden {golden['compare']!r}, received {received['compare']!r}"
            return
        if received["compare"] == "close":
            try:
                yield from self._close_report(received, golden)
            except Exception as exc:  # a corrupt golden: say so instead of hiding the diff
                yield f"could not compare values: {type(exc).__name__}: {exc}"
            return
        rows_r: Sequence[str] = received.get("sha256_dim0", ())
        rows_g: Sequence[str] = golden.get("sha256_dim0", ())
        if rows_r and len(rows_r) == len(rows_g):
            changed = [i for i, (a, b) in enumerate(zip(rows_r, rows_g, strict=True)) if a != b]
            if changed:
                shown = ", ".join(map(str, changed[:32])) + (" ..." if len(changed) > 32 else "")
                yield (
                    f"bytes differ in {len(changed)} of {len(rows_g)} slices along dim 0 "
                    f"(index {shown})"
                )
