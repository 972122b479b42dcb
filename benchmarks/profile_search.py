"""Where a search call's time goes: drawing, building, the kernel, the checks, the oracle.

For ``N`` decode calls (``num_tokens <= 64``) drawn by ``search.calls`` for the bundled
reference's envelope on the device (``search_harness.decode_calls``), it times:

* ``hypothesis_draw``: Hypothesis generating one call (a ``@given`` run with an empty body, per call);
* ``calls_per_s``: the judge run over the calls a second time, nothing wrapped (the first pass,
  ``calls_per_s_first_pass``, compiles the kernels for each new shape);
* each phase of the suite's judge (``search_harness.Judge``), exclusive of the phases nested in it:
  ``build`` (the rest of ``search.build``) and its helpers ``_source``, ``_indices``, ``_stale``,
  ``_place``, ``_queries``, ``_sink``, ``formats.quantize_pack``, ``formats.unpack_dequantize``
  (the build's, and the oracle's own, counted apart); ``kernel`` (the guarded forward);
  ``changed_inputs``; ``oracle``; ``check_result`` (``tolerances``).

On CUDA every timed phase is bracketed by ``torch.cuda.synchronize()``, so device work is charged
to the phase that queued it (the syncs themselves add a little). ``--baseline`` profiles the
modules of ``search_harness.BASELINE_COMMIT`` instead of this checkout's. Prints a table and,
with ``--out FILE``, writes JSON.

Usage: ``python benchmarks/profile_search.py [--device cuda] [--calls 40] [--baseline] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import machine_summary  # noqa: E402
from search_harness import Judge, baseline_modules, current_modules, decode_calls  # noqa: E402


class Phases:
    """Exclusive wall time per phase name, with nesting (a stack of running phases)."""

    def __init__(self, cuda: bool) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.stack: list[list[Any]] = []
        self.cuda = cuda

    def _sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        """Time ``owner.attr`` as phase ``name`` from now on."""
        fn = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._sync()
            frame = [name, time.perf_counter(), 0.0]  # name, start, time of nested phases
            self.stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                self.stack.pop()
                spent = time.perf_counter() - frame[1]
                self.total[name] += spent - frame[2]
                if self.stack:
                    self.stack[-1][2] += spent

        setattr(owner, attr, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--baseline", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()

    import torch
    from hypothesis import HealthCheck, Phase, given, settings

    from pytest_sparse_mla import formats, guard
    from pytest_sparse_mla.implementations.builtin import ReferenceImplementation

    impl = ReferenceImplementation()
    device_type = torch.device(args.device).type
    t0 = time.perf_counter()
    calls = decode_calls(impl.envelope, device_type, args.calls)
    draw_all = time.perf_counter() - t0

    seen = [0]

    @settings(max_examples=len(calls), derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(call=__import__("pytest_sparse_mla.search", fromlist=["calls"]).calls(impl.envelope, device_type))
    def empty(call: Any) -> None:
        seen[0] += 1

    t0 = time.perf_counter()
    empty()
    hypothesis_per_call = (time.perf_counter() - t0) / max(1, seen[0])

    modules = baseline_modules() if args.baseline else current_modules()
    judge = Judge(modules, impl, args.device)
    t0 = time.perf_counter()
    for call in calls:  # first pass: kernels compiled for each new shape, caches filled
        judge(call)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    for call in calls:  # second pass, nothing wrapped: the throughput
        judge(call)
    warm = time.perf_counter() - t0
    phases = Phases(device_type == "cuda")
    s, o, t = modules["search"], modules["oracle"], modules["tolerances"]
    for helper in ("_source", "_indices", "_stale", "_place", "_queries", "_sink", "_token_byte_mask"):
        if hasattr(s, helper):
            phases.wrap(s, helper, helper)
    phases.wrap(formats, "quantize_pack", "formats.quantize_pack")
    phases.wrap(formats, "unpack_dequantize", "formats.unpack_dequantize")
    phases.wrap(s, "build", "build (rest)")
    phases.wrap(s.SearchInputs, "changed_inputs", "changed_inputs")
    phases.wrap(o, "oracle_forward", "oracle (rest)")
    phases.wrap(t.SparseMlaTolerances, "check_result", "check_result")
    phases.wrap(guard.GuardedImplementation, "sparse_mla_forward", "kernel (guarded forward)")
    t0 = time.perf_counter()
    for call in calls:
        judge(call)
    wall = time.perf_counter() - t0
    n = len(calls)
    rows = {k: 1e3 * v / n for k, v in sorted(phases.total.items(), key=lambda kv: -kv[1])}
    rows["other (judge, syncs)"] = 1e3 * wall / n - sum(rows.values())
    doc = {
        "machine": machine_summary(), "device": args.device, "modules": "baseline" if args.baseline else "current",
        "calls": n, "tokens": [c.num_tokens for c in calls], "ms_per_call": rows,
        "judged_ms_per_call": 1e3 * wall / n, "hypothesis_draw_ms_per_call": 1e3 * hypothesis_per_call,
        "calls_per_s_with_phase_syncs": n / wall, "draw_all_s": draw_all,
        "calls_per_s_first_pass": n / cold, "calls_per_s": n / warm,
    }  # fmt: skip
    print(f"{doc['modules']} on {args.device}: {n} calls, {n / warm:.1f} calls/s ({n / cold:.1f} first pass); "
          f"phases timed apart: {doc['judged_ms_per_call']:.1f} ms/call judged "
          f"(+{doc['hypothesis_draw_ms_per_call']:.1f} ms Hypothesis draw)")  # fmt: skip
    for k, v in rows.items():
        print(f"  {k:32s} {v:8.2f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
