"""Smoke check of the peer adapters on a CUDA machine: errors against the float64 oracle and timings.

For each implementation (default: sglang-triton, sglang-torch, flashmla):

1. Headline shapes (FlashMLA's production MODEL1/V32 configurations: T = 64, MODEL1 with 256-token main
   pages and an extra cache of 64x512 (H = 64) or 2x1024 (H = 128), sink on; DSV3.2 topk 2048 at
   H = 64 and 128), with the bundled reference beside them: median CUDA-event time of 10 calls
   after 2 warm-ups, errors against the oracle and the normwise difference from the reference.
2. Every case of the attention suites (``attention.cases``: ``CONFORMANCE_CASES``,
   ``FLASHINFER_CASES``, ``deployment_cases()``; cases with more than ``--max-tokens`` tokens are
   left out) that the adapter takes (``unsupported_reason`` is ``None``): the normwise relative
   output error ``||A - E|| / ||E||``, the cosine similarity and the largest LSE error in natural-log
   units (FlashMLA convention; an infinite LSE must match exactly) against
   ``attention.oracle_forward``; refusals and exceptions are recorded with their message.

Writes ``--out`` (JSON, rewritten after every case) and prints one line per result. Run from the
repository root with the peers on ``PYTHONPATH`` (``scripts/peers_env.sh``)::

    python3 scripts/peers_smoke.py --out smoke.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import time
import zlib
from typing import Any

import torch

from pytest_sparse_mla.attention import oracle_forward
from pytest_sparse_mla.attention.cases import (
    CONFORMANCE_CASES,
    FLASHINFER_CASES,
    AttentionCase,
    CacheCase,
    Conventions,
    deployment_cases,
    make_inputs,
)
from pytest_sparse_mla.implementations import BUILTINS, ReferenceImplementation

HEADLINE = (
    AttentionCase("hl-model1-h64-p256-e64x512", 64, 64, CacheCase(128, page_block_size=256, num_pages=16,
                  masked_fraction=0.0), extra=CacheCase(512, page_block_size=64, num_pages=64, masked_fraction=0.0)),
    AttentionCase("hl-model1-h128-p256-e2x1024", 64, 128, CacheCase(128, page_block_size=256, num_pages=16,
                  masked_fraction=0.0), extra=CacheCase(1024, page_block_size=2, num_pages=1024, masked_fraction=0.0)),
    AttentionCase("hl-v32-h64-k2048", 64, 64, CacheCase(2048, num_pages=64, masked_fraction=0.0),
                  conventions=Conventions("dsv3_2")),
    AttentionCase("hl-v32-h128-k2048", 64, 128, CacheCase(2048, num_pages=64, masked_fraction=0.0),
                  conventions=Conventions("dsv3_2")),
)  # fmt: skip


def _metrics(got: Any, want: Any) -> dict[str, Any]:
    a = got.output.double()
    e = want.output.to(a.device)
    rel = ((a - e).norm() / e.norm()).item() if e.norm() > 0 else float((a - e).norm())
    cos = (torch.dot(a.flatten(), e.flatten()) / (a.norm() * e.norm())).item() if e.norm() > 0 else float("nan")
    la, le = got.lse.double(), want.lse.to(a.device)
    inf_mismatch = int((torch.isinf(la) != torch.isinf(le)).sum() + (torch.isinf(la) & (la != le)).sum())
    finite = torch.isfinite(la) & torch.isfinite(le)
    lse_err = (la[finite] - le[finite]).abs().max().item() if bool(finite.any()) else 0.0
    return {
        "rel_err": rel,
        "cosine": cos,
        "lse_err": lse_err,
        "lse_inf_mismatch": inf_mismatch,
        "nonfinite_out": int((~torch.isfinite(a)).sum()),
    }


def _seed(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


def _time_ms(fn: Any, reps: int = 10) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _ask(impl: Any, inputs: Any) -> str | None:
    ask = getattr(impl, "unsupported_reason", None)
    if ask is None:
        return None
    return ask("sparse_mla_forward", inputs.q, inputs.cache.packed, inputs.indices, **inputs.kwargs())


def _summary(report: dict[str, Any], names: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        entries = [c.get(name, {}) for c in report["cases"].values()]
        rows = [e for e in entries if e.get("status") == "ok"]
        out[name] = {
            "cases_ok": len(rows),
            "cases_unsupported": sum(e.get("status") == "unsupported" for e in entries),
            "cases_error": sum(e.get("status") == "error" for e in entries),
            "max_rel_err": max((r["rel_err"] for r in rows), default=math.nan),
            "min_cosine": min((r["cosine"] for r in rows), default=math.nan),
            "max_lse_err": max((r["lse_err"] for r in rows), default=math.nan),
            "lse_inf_mismatch": sum(r["lse_inf_mismatch"] for r in rows),
            "nonfinite_out": sum(r["nonfinite_out"] for r in rows),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="smoke.json")
    parser.add_argument("--impls", nargs="*", default=["sglang-triton", "sglang-torch", "flashmla"])
    parser.add_argument("--max-tokens", type=int, default=600, help="leave out cases with more tokens")
    parser.add_argument("--cases", default="", help="regular expression the case names must match")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (no headline timings)")
    args = parser.parse_args()
    device = torch.device(args.device)
    pattern = re.compile(args.cases)
    cases = [
        c
        for c in (*CONFORMANCE_CASES, *FLASHINFER_CASES, *deployment_cases())
        if c.num_tokens <= args.max_tokens and pattern.search(c.name) and (device.type == "cuda" or not c.large)
    ]
    impls: dict[str, Any] = {}
    report: dict[str, Any] = {"headline": {}, "cases": {}, "skipped_impls": {}, "case_seconds": {}}
    for name in args.impls:
        impl = ReferenceImplementation() if name == "reference" else BUILTINS[name](None)
        reason = impl.skip_reason("sparse_mla_forward", device.type)
        if reason:
            report["skipped_impls"][name] = reason
            print(f"SKIP {name}: {reason}", flush=True)
        else:
            impls[name] = impl

    def save() -> None:  # after every case, so a run cut short still leaves its results
        report["summary"] = _summary(report, list(impls))
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1, default=str)

    # 1. headline shapes: timings, errors vs the oracle and vs the bundled reference
    reference = ReferenceImplementation()
    for case in HEADLINE if device.type == "cuda" else ():
        inputs = make_inputs(case, _seed(case.name), device=device)
        oracle = inputs.run(oracle_forward, lse_convention="flashmla")
        ref = inputs.run(reference.sparse_mla_forward, lse_convention="flashmla")
        for name, impl in {"reference": reference, **impls}.items():
            why = _ask(impl, inputs)
            if why:
                report["headline"].setdefault(case.name, {})[name] = {"status": "unsupported", "reason": why}
                continue
            try:
                got = inputs.run(impl.sparse_mla_forward, lse_convention="flashmla")
                ms = _time_ms(lambda i=impl, x=inputs: x.run(i.sparse_mla_forward, lse_convention="flashmla"))
            except Exception as exc:  # noqa: BLE001 - recorded, the smoke run goes on
                report["headline"].setdefault(case.name, {})[name] = {"status": "error", "error": str(exc)[:400]}
                continue
            entry = {"status": "ok", "ms": ms, **_metrics(got, oracle)}
            diff = got.output.double() - ref.output.double()
            entry["rel_vs_reference"] = (diff.norm() / ref.output.double().norm()).item()
            finite = torch.isfinite(got.lse) & torch.isfinite(ref.lse)
            entry["lse_vs_reference"] = (got.lse[finite].double() - ref.lse[finite].double()).abs().max().item()
            report["headline"].setdefault(case.name, {})[name] = entry
            brief = {k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in entry.items()}
            print(f"HEADLINE {case.name:32s} {name:14s} {brief}", flush=True)
        save()

    # 2. the suites' cases: errors against the oracle
    for case in cases:
        started = time.perf_counter()
        inputs = make_inputs(case, _seed(case.name), device=device)
        oracle = None
        for name, impl in impls.items():
            why = _ask(impl, inputs)
            entry: dict[str, Any]
            if why:
                entry = {"status": "unsupported", "reason": why}
            else:
                try:
                    got = inputs.run(impl.sparse_mla_forward, lse_convention="flashmla")
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                except Exception as exc:  # noqa: BLE001 - recorded, the smoke run goes on
                    entry = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:400]}
                else:
                    if oracle is None:
                        oracle = inputs.run(oracle_forward, lse_convention="flashmla")
                    entry = {"status": "ok", **_metrics(got, oracle), "route": getattr(got, "route", None)}
            report["cases"].setdefault(case.name, {})[name] = entry
            brief = {k: (f"{v:.2e}" if isinstance(v, float) else v) for k, v in entry.items() if k != "reason"}
            print(f"{case.name:48s} {name:14s} {brief}", flush=True)
        report["case_seconds"][case.name] = time.perf_counter() - started
        save()
    for name, row in _summary(report, list(impls)).items():
        print(f"SUMMARY {name}: {row}", flush=True)
    save()


if __name__ == "__main__":
    main()
