"""Build ``docs/conformance.json`` and ``docs/conformance.md`` from a conformance run's result files,
with the package's report code (``pytest_sparse_mla.conformance``: the same Markdown that
``--sparse-mla-report-md`` and ``sparse-mla-report`` write), plus this project's extras: the peers'
declarations, errors against the oracle, reproducers, benchmarks and ``docs/discrepancies.md``.

Reads, in the results directory written by ``scripts/device_conformance.sh``:

* ``conformance-IMPL.xml`` (JUnit XML: every test's outcome and message) and
  ``conformance-IMPL.exit.json`` (exit status, seconds) for each implementation;
* ``machine.json`` (GPU, driver, versions, the peers' sources);
* optionally ``smoke.json`` (``scripts/peers_smoke.py``: errors against the float64 oracle per
  peer, headline timings) and ``bench/results.json`` (``benchmarks/test_bench_peers.py``);

and, from this checkout, the shipped xfail files ``pytest_sparse_mla/xfail/IMPL.txt``: a comment
line ``# [KEY] kind: text`` defines a discrepancy (kind ``convention`` or ``bug``; the text says
what differs, where in the peer, and the smallest input that shows it), and each test entry ends
with ``# KEY`` naming the discrepancy it is listed for. Every number in the Markdown comes from
these files; nothing is typed by hand.

    python3 scripts/conformance_report.py RESULTS_DIR --json docs/conformance.json --md docs/conformance.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pytest_sparse_mla import catalogue, sanitizer
from pytest_sparse_mla.conformance import _matches, markdown, read_junit, read_xfail_file
from pytest_sparse_mla.conformance import build as build_doc

ROOT = Path(__file__).resolve().parents[1]
XFAIL_DIR = ROOT / "pytest_sparse_mla" / "xfail"


#: The built-in peer adapters, in report order (``catalogue``).
PEERS = catalogue.peer_names()


def declarations() -> dict[str, Any]:
    """Each peer adapter's envelope, entry points and devices (imported from this checkout; no torch needed)."""
    from pytest_sparse_mla.implementations import BUILTINS

    out = {}
    for name in PEERS:
        impl = BUILTINS[name](None)
        out[name] = {"peer": impl.peer, "devices": list(impl.devices), **impl.envelope.as_dict()}
    return out


def build(results: Path, smoke_path: Path | None = None, notes_path: Path | None = None) -> dict[str, Any]:
    impls = sorted(p.name[len("conformance-") : -len(".xml")] for p in results.glob("conformance-*.xml"))
    order = list(catalogue.conformance_names())
    impls.sort(key=lambda n: (order.index(n) if n in order else len(order), n))
    notes_path = notes_path or ROOT / "docs" / "conformance" / "notes.json"
    notes = json.loads(notes_path.read_text()) if notes_path.exists() else {}
    machine = json.loads((results / "machine.json").read_text()) if (results / "machine.json").exists() else {}
    workers = machine.get("xdist", 4)  # device_conformance.sh's XDIST (runs before it recorded it used 4)
    runs = []
    for impl in impls:
        exit_path, report_path = results / f"conformance-{impl}.exit.json", results / f"conformance-{impl}.json"
        xfail_path = XFAIL_DIR / f"{impl}.txt"
        runs.append({
            "impl": impl,
            "rows": read_junit(results / f"conformance-{impl}.xml"),
            "exit_info": json.loads(exit_path.read_text()) if exit_path.exists() else {},
            "run_report": json.loads(report_path.read_text()) if report_path.exists() else {},
            "xfail": read_xfail_file(xfail_path) if xfail_path.exists() else None,
        })  # fmt: skip
    doc = build_doc(
        runs,
        machine=machine,
        command=f"RESULTS=results XDIST={workers} bash scripts/device_conformance.sh "
        "(per implementation: pytest -p sparse_mla suites --sparse-mla-impl IMPL --sparse-mla-require-gpu "
        f"-n {workers} --sparse-mla-xfail-file pytest_sparse_mla/xfail/IMPL.txt --sparse-mla-report-json ... "
        "--junitxml ...)",
        declarations=declarations(),
        notes=notes,
        title="Conformance of real sparse-MLA kernels",
        generated_by="scripts/conformance_report.py from docs/conformance.json",
    )
    smoke = smoke_path or results / "smoke.json"
    if smoke.exists():
        data = json.loads(smoke.read_text())
        doc["oracle_errors"] = data.get("summary", {})
        doc["headline"] = data.get("headline", {})
        doc["oracle_error_cases"] = {
            impl: {c: e for c, per in data.get("cases", {}).items() if (e := per.get(impl, {})).get("status") != "ok"}
            for impl in data.get("summary", {})
        }
    check = results / "repro-check.json"
    if check.exists():
        data = json.loads(check.read_text())
        per: dict[str, dict[str, int]] = {}
        for rec in data.get("records", []):
            row = per.setdefault(rec.get("impl", "?"), {"scripts": 0, "hold": 0, "native": 0})
            row["scripts"] += 1
            row["hold"] += int(bool(rec.get("holds")))
            row["native"] += int(bool(rec.get("native")))
        doc["reproducers"] = {"summary": data.get("summary", {}), "per_implementation": per}
    logs = sorted(results.glob("sanitizer-*.log"))  # SANITIZER=1 runs (scripts/device_conformance.sh)
    if logs:
        doc["sanitizer"] = {
            p.name[len("sanitizer-") : -len(".log")]: sanitizer.summarize_log(p.read_text("utf-8", "replace"))
            for p in logs
        }
    bench = results / "bench" / "results.json"
    if bench.exists():
        doc["benchmarks"] = json.loads(bench.read_text())
    return doc


def bench_markdown(doc: dict[str, Any]) -> str:
    """The peer rows of ``benchmarks/test_bench_peers.py`` as a Markdown table (for docs/benchmarks.md)."""
    bench = doc.get("benchmarks") or {}
    rows = [r for r in bench.get("results", []) if str(r.get("name", "")).startswith("peer ")]
    m = bench.get("machine", {})
    out = [
        f"One run on {m.get('gpu')} ({m.get('sm_count')} SMs, driver {m.get('driver')}), torch {m.get('torch')}, "
        f"triton {m.get('triton')}, {m.get('date_utc')} UTC.",
        "",
        "| benchmark | median | rate | ratio | vs oracle / notes |",
        "| --- | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        rate = f"{r['GBps']:.0f} GB/s" if "GBps" in r else (f"{r['TFLOPs']:.2f} TFLOP/s" if "TFLOPs" in r else "")
        if "x_reference" in r:
            ratio = f"{r['x_reference']:.2f}x the reference's time"
        elif "copy_ratio" in r:
            ratio = f"{100 * r['copy_ratio']:.1f}% of a device copy"
        elif "x_ideal" in r:
            ratio = f"{r['x_ideal']:.2f}x ideal"
        else:
            ratio = ""
        if "rel_err_output" in r:
            notes = f"out {r['rel_err_output']:.1e} normwise, LSE {r['max_abs_err_lse_ln']:.1e} (8 tokens)"
        else:
            notes = r.get("notes", "")
        out.append(f"| {r['name'][len('peer ') :]} | {r['ms']:.4f} ms | {rate} | {ratio} | {notes} |")
    return "\n".join(out) + "\n"


#: Where each peer's version is read from ``machine.json`` (label, key; ``catalogue``).
_VERSIONS = {entry.name: (entry.source.label, entry.source.key) for entry in catalogue.BUILTINS if entry.source}


def discrepancies_markdown(doc: dict[str, Any], results: Path, notes: dict[str, Any]) -> str:
    """``docs/discrepancies.md``: every discrepancy of every peer, its xfailed tests, the reproducers
    that hold for it (from ``repro-check.json``), the peer's version, and upstream tracking
    (``notes["upstream"]``, ``"IMPL/KEY": text``)."""
    m = doc["machine"]
    check = results / "repro-check.json"
    records = json.loads(check.read_text()).get("records", []) if check.exists() else []
    upstream = notes.get("upstream", {})
    out = [
        "# Discrepancies found in real sparse-MLA kernels",
        "",
        "<!-- Generated by scripts/conformance_report.py --discrepancies from the run files and the shipped xfail "
        "files; do not edit by hand. -->",
        "",
        f"From the conformance run of {m.get('date_utc')} UTC on {m.get('gpu')} ({doc['command'].split(' (')[0]}, "
        "REPRO=1). Each entry is a `# [KEY] kind: text` definition of the peer's shipped xfail file "
        "(`pytest_sparse_mla/xfail/IMPL.txt`): the text says what differs, where in the peer's source, and the "
        "smallest input. A *convention* is a documented difference the adapter cannot convert; a *bug* is a "
        "wrong answer, an out-of-bounds access or a crash.",
        "",
        *([f"Note: {m['note']}.", ""] if m.get("note") else []),
        "**Reproducers.** Run the suites with `--sparse-mla-repro-dir DIR` (and the xfail file) and every wrong call "
        "of an xfailed test becomes `DIR/<test>/call<k>/repro.py` + `inputs.pt`: it needs torch and the peer only "
        "(a script that calls the peer directly names the peer's function in its docstring), prints expected vs got "
        "and exits 1 while the discrepancy exists. The scripts listed below were run on the same machine by "
        "`scripts/check_repros.py`: each exited 1 on its peer (with `pytest` and `pytest_sparse_mla` made "
        "unimportable when it calls the peer directly) and 0 with `--impl "
        "pytest_sparse_mla.implementations:ReferenceImplementation`. They are not shipped (their inputs are "
        "megabytes); the command rewrites them:",
        "",
        "```bash",
        "pytest -p sparse_mla suites --sparse-mla-impl IMPL \\",
        "    --sparse-mla-xfail-file pytest_sparse_mla/xfail/IMPL.txt --sparse-mla-repro-dir repro/IMPL",
        "python repro/IMPL/<test>/call0/repro.py",
        "```",
        "",
    ]
    for name, s in doc["implementations"].items():
        if not s["discrepancies"]:
            continue
        label, key = _VERSIONS.get(name, (name, ""))
        version = m.get(key)
        version = "; ".join(version) if isinstance(version, list) else (version or "?")
        out += [f"## `{name}` ({label} {version})", ""]
        entries = read_xfail_file(XFAIL_DIR / f"{name}.txt")["entries"]
        for d in s["discrepancies"]:
            ids = [e["prefix"] for e in entries if e["key"] == d["key"]]
            held = [
                r for r in records
                if r.get("impl") == name and r.get("holds") and any(_matches(str(r.get("nodeid", "")), i) for i in ids)
            ]  # fmt: skip
            tests = sorted({str(r["nodeid"]).split("::", 1)[-1] for r in held})
            native = sum(1 for r in held if r.get("native"))
            out += [f"### [{d['key']}] {d['kind']}", "", d["text"], ""]
            if d.get("regions"):  # the search's known regions (pytest_sparse_mla.regions): no call is made inside
                out.append("* regions the search does not draw in: " + "; ".join(f"`{r}`" for r in d["regions"]))
            out.append(f"* xfailed tests: {d['xfailed_tests']} (of {len(ids)} listed)")
            if held:
                more = f" and {len(tests) - 4} more" if len(tests) > 4 else ""
                shown = ", ".join(f"`{t}`" for t in tests[:4]) + more
                out.append(f"* reproducers that hold: {len(held)} ({native} call the peer directly): {shown}")
            elif not ids and d.get("regions"):
                out.append("* reproducers: none yet (no test lists it: the search finds it inside its region; a run "
                           "of the search with --sparse-mla-repro-dir writes one)")
            elif not ids:
                out.append("* reproducers: none (no test lists it: a convention the suites never ask about)")
            else:
                out.append("* reproducers: none held")
            tracked = upstream.get(name + "/" + d["key"], "none found (searched 2026-12-01)")
            out.append(f"* upstream: {tracked}")
            out.append("")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--md", type=Path, required=True)
    parser.add_argument("--smoke", type=Path, help="smoke.json from another run (default: RESULTS/smoke.json)")
    parser.add_argument("--bench-md", type=Path, help="also write the peer benchmark table here")
    parser.add_argument("--discrepancies", type=Path, help="also write docs/discrepancies.md here")
    parser.add_argument(
        "--notes", type=Path, help="explanations of project faults (default docs/conformance/notes.json)"
    )
    args = parser.parse_args()
    doc = build(args.results, args.smoke, args.notes)
    args.json.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    args.md.write_text(markdown(doc))
    if args.bench_md:
        args.bench_md.write_text(bench_markdown(doc))
    if args.discrepancies:
        notes_path = args.notes or ROOT / "docs" / "conformance" / "notes.json"
        notes = json.loads(notes_path.read_text()) if notes_path.exists() else {}
        args.discrepancies.write_text(discrepancies_markdown(doc, args.results, notes))


if __name__ == "__main__":
    main()
