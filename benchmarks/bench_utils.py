"""Timing and reporting helpers of the benchmark suite (imported by ``conftest.py`` and the benchmarks)."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: The 1 GB split benchmark: 7,168 source pages of 256 tokens (149,760 B stride) -> 28,672 pages.
SPLIT_SRC_PAGES = 7_168
#: One-way bytes of that split: 28,672 destination pages x 37,376 bytes.
SPLIT_ONE_WAY_BYTES = SPLIT_SRC_PAGES * 4 * 37_376


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def machine_summary() -> dict[str, Any]:
    """GPU name, driver, CUDA/torch/triton versions, host CPU count and the date (UTC)."""
    import torch

    info: dict[str, Any] = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:  # pragma: no cover
        info["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            sm_count=props.multi_processor_count,
            gpu_memory_GiB=round(props.total_memory / 2**30, 1),
            driver=_driver_version(),
        )
    return info


def cuda_median_ms(fn: Callable[[], object], *, warmup: int = 3, reps: int = 20) -> float:
    """Median CUDA-event time in milliseconds of ``fn()`` on the current stream, after ``warmup`` calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(event_ms(fn) for _ in range(reps))


def event_ms(fn: Callable[[], object]) -> float:
    """CUDA-event time in milliseconds of one ``fn()`` on the current stream (waits for it)."""
    import torch

    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def interleaved_median_ms(
    fn_a: Callable[[], object], fn_b: Callable[[], object], *, warmup: int = 3, reps: int = 30
) -> tuple[float, float]:
    """Median CUDA-event times (ms) of ``fn_a`` and ``fn_b`` timed alternately, so both see the same
    clocks and temperature (for a ratio of two bandwidths)."""
    for _ in range(warmup):
        fn_a()
        fn_b()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        times[0].append(event_ms(fn_a))
        times[1].append(event_ms(fn_b))
    return statistics.median(times[0]), statistics.median(times[1])


def bf16_matmul_tflops(n: int = 8192, reps: int = 10) -> float:
    """BF16 tensor-core rate in TFLOP/s: median CUDA-event time of an ``n``^3 ``torch.mm`` on random
    data (zeros run faster), after 3 warm-up products."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn((n, n), device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn((n, n), device="cuda", dtype=torch.bfloat16, generator=gen)
    ms = cuda_median_ms(lambda: torch.mm(a, b), warmup=3, reps=reps)
    return 2 * n**3 / ms / 1e9


def synced(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` followed by ``torch.cuda.synchronize()``: what pytest-benchmark's wall clock times."""
    import torch

    def run() -> None:
        fn()
        torch.cuda.synchronize()

    return run


def capture_graph(fns: list[Callable[[], object]]) -> Any:
    """Capture ``fns`` (run in order) in one ``torch.cuda.CUDAGraph`` after a side-stream warm-up."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    return graph


@dataclass(frozen=True)
class CopyBaseline:
    """A device-to-device copy measured in this run: ``one_way_bytes`` copied in ``ms`` (median).

    ``copy`` runs that copy again (for :func:`interleaved_median_ms`).
    """

    one_way_bytes: int
    ms: float
    copy: Callable[[], object] = field(repr=False, compare=False, default=lambda: None)

    @property
    def gbps(self) -> float:
        """Bytes read plus written per second, in GB/s (1e9 bytes)."""
        return 2 * self.one_way_bytes / self.ms / 1e6

    def ideal_ms(self, moved_bytes: int) -> float:
        """Time to move ``moved_bytes`` (read + written) at this copy's bandwidth, in ms."""
        return moved_bytes / self.gbps / 1e6


def results_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of result rows (``name``, ``ms`` and optional rate and ratio keys)."""
    lines = [
        "| benchmark | median | GB/s or TFLOP/s | vs copy / ideal | notes |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        rate = f"{r['GBps']:.0f} GB/s" if "GBps" in r else (f"{r['TFLOPs']:.2f} TFLOP/s" if "TFLOPs" in r else "")
        rel = ""
        if "copy_ratio" in r:
            rel = f"{100 * r['copy_ratio']:.1f}% of copy"
        elif "x_ideal" in r:
            rel = f"{r['x_ideal']:.2f}x ideal"
        lines.append(f"| {r['name']} | {r['ms']:.4f} ms | {rate} | {rel} | {r.get('notes', '')} |")
    return "\n".join(lines) + "\n"


def record(benchmark: Any, rows: list[dict[str, Any]], row: dict[str, Any]) -> None:
    """Put ``row`` into ``benchmark.extra_info`` and the session's results table."""
    benchmark.extra_info.update({k: v for k, v in row.items() if k != "name"})
    rows.append(row)
