"""compute-sanitizer memcheck under the suites: each test's report names the first out-of-bounds
access its kernels made (the logic behind ``device_health.judge_report``).

Most out-of-bounds reads do not crash: they return garbage or NaN, and a test that does not look at
the garbage passes. NVIDIA's compute-sanitizer (``--tool memcheck``, shipped with the CUDA toolkit;
https://docs.nvidia.com/compute-sanitizer/ComputeSanitizer) checks every global and shared memory
access of every kernel and writes one report per faulting access (``========= Invalid __global__
read of size 4 bytes`` with the kernel, thread, block and address). The tox lane ``sanitizer`` and
``SANITIZER=1 scripts/device_conformance.sh`` run pytest under it, in one process (``-p no:xdist``:
the sanitizer's frontend writes every target process's reports to one log, so reports could not be
told apart between workers), with ``--log-file LOG``, ``--padding 4096`` (4 KiB of guard bytes after
every allocation: without it a read just past a tensor lands in the next allocation, which memcheck
cannot tell from a legal read; ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` gives each tensor its own allocation,
instead of a slice of the caching allocator's segments), ``--destroy-on-device-error kernel`` (a
faulting kernel is ended, the CUDA context stays usable and the run goes on) and
``SPARSE_MLA_SANITIZER_LOG=LOG``. The plugin then reads, after each test's call phase, what the
sanitizer wrote to the log since the test's setup began (:func:`begin_test`, :func:`first_error`):
a report there fails the test with its first access and the kernel call in flight
(``device_health``; an xfailed test too: an out-of-bounds access is never the expected failure).
Should the context die anyway, ``device_health`` fails that test as a dead context, with the
sanitizer's text in its message.

Nothing here imports torch or reads a device; without ``SPARSE_MLA_SANITIZER_LOG`` every function
is a no-op.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["ENV", "TIMEOUT_FACTOR", "active", "begin_test", "first_error", "log_path", "summarize_log"]

#: environment variable naming compute-sanitizer's ``--log-file``.
ENV = "SPARSE_MLA_SANITIZER_LOG"
#: memcheck runs kernels 10-100x slower: default per-test time limits are scaled by this.
TIMEOUT_FACTOR = 10.0

#: a memcheck report's first line: an invalid or misaligned access, a hardware exception, a
#: device-side assert (``Program hit``), a malformed or out-of-range access.
_REPORT = re.compile(
    r"^=+ (Invalid |Misaligned |Out-of-range |Malformed |Program hit |Warp |Lane |Address |Barrier |Uninitialized )",
    re.MULTILINE,
)
_MAX_LINES = 12

_offset = 0


def active() -> bool:
    """Whether this process runs under the sanitizer lane (``SPARSE_MLA_SANITIZER_LOG`` set)."""
    return bool(os.environ.get(ENV))


def log_path() -> Path | None:
    """The sanitizer's log (``SPARSE_MLA_SANITIZER_LOG``), or ``None`` outside the lane."""
    path = os.environ.get(ENV)
    return Path(path) if path else None


def _size(path: Path | None) -> int:
    try:
        return path.stat().st_size if path is not None else 0
    except OSError:
        return 0


def begin_test() -> None:
    """Remember where this process's log ends (called when a test's setup starts)."""
    global _offset
    _offset = _size(log_path())


def first_error() -> str | None:
    """The first memcheck report (up to 12 lines, the ``=========`` prefix dropped) written to the
    log since :func:`begin_test`, or ``None`` (also outside the lane, or with no log)."""
    path = log_path()
    if path is None or _size(path) <= _offset:
        return None
    try:
        with path.open("rb") as f:
            f.seek(_offset)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    return _report_at(text, _REPORT.search(text))


#: the frontend's last line: ``========= ERROR SUMMARY: 3 errors`` (``1 error``).
_SUMMARY = re.compile(r"^=+ ERROR SUMMARY: (\d+) errors?", re.MULTILINE)


def summarize_log(text: str) -> dict[str, object]:
    """What a whole sanitizer log (``--log-file``) says: ``{"reports": N, "error_summary": M,
    "first": text}``: ``N`` memcheck reports (first lines matched as in :func:`first_error`), ``M``
    the total of its ``ERROR SUMMARY: M errors`` lines (``None`` when there is none: the frontend
    did not finish, e.g. killed at a time limit), ``first`` the first report (as
    :func:`first_error` gives it) or ``None``. Used by ``scripts/conformance_report.py`` for the
    report's sanitizer section."""
    summaries = [int(m.group(1)) for m in _SUMMARY.finditer(text)]
    return {
        "reports": len(_REPORT.findall(text)),
        "error_summary": sum(summaries) if summaries else None,
        "first": _report_at(text, _REPORT.search(text)),
    }


def _report_at(text: str, match: re.Match[str] | None) -> str | None:
    """The report starting at ``match`` (up to :data:`_MAX_LINES` lines, the ``=`` prefix dropped)."""
    if match is None:
        return None
    lines: list[str] = []
    for line in text[match.start() :].splitlines():
        body = line.lstrip("=").strip()
        if lines and not body:  # a bare "=========" line ends the report
            break
        if body:
            lines.append(body)
        if len(lines) >= _MAX_LINES:
            break
    return "\n".join(lines)
