"""Build ``docs/conformance.json`` and ``docs/conformance.md`` from a conformance run's result files.

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
import re
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
XFAIL_DIR = ROOT / "pytest_sparse_mla" / "xfail"
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
_DEFINITION = re.compile(r"^#\s*\[(?P<key>[A-Za-z0-9_-]+)\]\s*(?P<kind>[a-z ]+):\s*(?P<text>.+)$")


def test_id(case: ET.Element) -> tuple[str, str]:
    """``(suite file, node id)`` of a JUnit ``testcase`` (``suites.test_x`` + ``name``)."""
    classname = case.get("classname", "")
    parts = classname.split(".")
    module = [p for p in parts if p.startswith("test_")]
    file = "/".join(parts[: parts.index(module[0]) + 1]) + ".py" if module else classname
    inner = parts[parts.index(module[0]) + 1 :] if module else []
    return file, "::".join([file, *inner, case.get("name", "")])


def outcome(case: ET.Element) -> tuple[str, str]:
    """``(outcome, message)`` of a JUnit ``testcase`` as pytest writes it (xunit2)."""
    for tag in ("failure", "error"):
        node = case.find(tag)
        if node is not None:
            message = node.get("message") or (node.text or "")
            if message.startswith("[XPASS(strict)]"):
                return "xpassed", message
            return ("failed" if tag == "failure" else "error"), message
    node = case.find("skipped")
    if node is not None:
        kind = "xfailed" if node.get("type") == "pytest.xfail" else "skipped"
        return kind, node.get("message") or ""
    return "passed", ""


def read_junit(path: Path) -> list[dict[str, Any]]:
    """One dict per test case: ``file``, ``id``, ``outcome``, ``message``, ``seconds``."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        file, node = test_id(case)
        kind, message = outcome(case)
        rows.append(
            {"file": file, "id": node, "outcome": kind, "message": message, "seconds": float(case.get("time", 0))}
        )
    return rows


def read_xfail_file(path: Path) -> dict[str, Any]:
    """Discrepancy definitions and entries of a shipped xfail file (module docstring)."""
    definitions: dict[str, dict[str, str]] = {}
    entries: list[dict[str, str]] = []
    for line in path.read_text().splitlines():
        stripped = line.strip()
        match = _DEFINITION.match(stripped)
        if match:
            definitions[match["key"]] = {"kind": match["kind"].strip(), "text": match["text"].strip()}
            continue
        if not stripped or stripped.startswith("#"):
            continue
        parts = re.split(r"\s#", stripped, maxsplit=1)
        comment = parts[1].strip() if len(parts) > 1 else ""
        entries.append({"prefix": parts[0].strip(), "key": comment.split()[0] if comment else ""})
    return {"definitions": definitions, "entries": entries}


def summarize(impl: str, results: Path, notes: dict[str, Any] | None = None) -> dict[str, Any]:
    """Totals, per-suite counts, skip reasons, failures and xfails of one implementation.

    ``notes["project_faults"]``: ``{"test", "impls", "explanation"}`` entries that explain a failure
    which is a fault of this project (not of the peer), shown beside it.
    """
    rows = read_junit(results / f"conformance-{impl}.xml")
    exit_info = {}
    exit_path = results / f"conformance-{impl}.exit.json"
    if exit_path.exists():
        exit_info = json.loads(exit_path.read_text())
    xfail: dict[str, Any] = {"definitions": {}, "entries": []}
    xfail_path = XFAIL_DIR / f"{impl}.txt"
    if xfail_path.exists():
        xfail = read_xfail_file(xfail_path)
    # A run made without the xfail file (exit info "xfail_file": null, or none recorded) counts a failure
    # that an entry lists as xfailed, marked "listed_after_run"; a run with the file reports pytest's own outcome.
    applied = bool(exit_info.get("xfail_file"))
    listed_after_run = 0
    by_key: Counter = Counter()
    for r in rows:
        key = next((e["key"] for e in xfail["entries"] if _matches(r["id"], e["prefix"])), None)
        if key is not None and not applied and r["outcome"] in ("failed", "error"):
            r["outcome"], r["listed_after_run"] = "xfailed", True
            listed_after_run += 1
        if r["outcome"] == "xfailed":
            r["key"] = key or ""
            by_key[r["key"]] += 1
    totals = Counter(r["outcome"] for r in rows)
    suites: dict[str, Counter] = {}
    for r in rows:
        suites.setdefault(r["file"], Counter())[r["outcome"]] += 1
    skips = Counter(_short(r["message"]) for r in rows if r["outcome"] == "skipped")
    report_path = results / f"conformance-{impl}.json"
    run_report = json.loads(report_path.read_text()) if report_path.exists() else {}
    return {
        "coverage": run_report.get("coverage", []),
        "envelope": run_report.get("envelope"),
        "xfail_file_applied": applied,
        "xfailed_listed_after_run": listed_after_run,
        "exit": exit_info.get("exit"),
        "seconds": exit_info.get("seconds"),
        "tests": len(rows),
        "totals": {k: totals.get(k, 0) for k in OUTCOMES},
        "suites": {f: {k: c.get(k, 0) for k in OUTCOMES} for f, c in sorted(suites.items())},
        "skip_reasons": [{"reason": k, "count": v} for k, v in skips.most_common()],
        "failures": [
            {
                "id": r["id"],
                "outcome": r["outcome"],
                "message": _short(r["message"], 600),
                "explanation": next(
                    (
                        n["explanation"]
                        for n in (notes or {}).get("project_faults", [])
                        if impl in n.get("impls", [impl]) and _matches(r["id"], n["test"])
                    ),
                    "",
                ),
            }
            for r in rows
            if r["outcome"] in ("failed", "error", "xpassed")
        ],
        "xfailed": [
            {"id": r["id"], "key": r.get("key", ""), "listed_after_run": r.get("listed_after_run", False)}
            for r in rows
            if r["outcome"] == "xfailed"
        ],
        "discrepancies": [
            {"key": k, **d, "xfailed_tests": by_key.get(k, 0)} for k, d in sorted(xfail["definitions"].items())
        ],
    }


def _matches(node_id: str, prefix: str) -> bool:
    return node_id.startswith(prefix) or node_id.replace("pytest_sparse_mla/", "").startswith(prefix)


def _short(text: str, limit: int = 240) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


#: The built-in peer adapters, in report order.
PEERS = ("sglang-triton", "sglang-torch", "flashmla", "flaggems", "vllm-triton", "flashinfer-reference")


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
    order = ["reference", *PEERS]
    impls.sort(key=lambda n: (order.index(n) if n in order else len(order), n))
    notes_path = notes_path or ROOT / "docs" / "conformance" / "notes.json"
    notes = json.loads(notes_path.read_text()) if notes_path.exists() else {}
    machine = json.loads((results / "machine.json").read_text()) if (results / "machine.json").exists() else {}
    workers = machine.get("xdist", 4)  # device_conformance.sh's XDIST (runs before it recorded it used 4)
    doc: dict[str, Any] = {
        "machine": machine,
        "command": f"RESULTS=results XDIST={workers} bash scripts/device_conformance.sh "
        "(per implementation: pytest -p sparse_mla suites --sparse-mla-impl IMPL --sparse-mla-require-gpu "
        f"-n {workers} --sparse-mla-xfail-file pytest_sparse_mla/xfail/IMPL.txt --sparse-mla-report-json ... "
        "--junitxml ...)",
        "implementations": {impl: summarize(impl, results, notes) for impl in impls},
        "declarations": declarations(),
    }
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
    bench = results / "bench" / "results.json"
    if bench.exists():
        doc["benchmarks"] = json.loads(bench.read_text())
    return doc


def _fmt(value: Any, spec: str = ".2e") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    impls = doc["implementations"]
    out = [
        "# Conformance of real sparse-MLA kernels",
        "",
        "<!-- Generated by scripts/conformance_report.py from docs/conformance.json; do not edit by hand. -->",
        "",
        f"Machine: {m.get('gpu_count', '?')} x {m.get('gpu', '?')} (sm {m.get('sm', '?')}), driver {m.get('driver')}, "
        f"torch {m.get('torch')} (CUDA {m.get('cuda_runtime')}), triton {m.get('triton')}, Python {m.get('python')}, "
        f"{m.get('cpu_count')} CPUs; run {m.get('date_utc')} UTC.",
        f"Peers: SGLang {m.get('sglang')} (wheel from PyPI, installed --no-deps); FlashMLA "
        f"{'; '.join(m.get('flashmla_source') or ['not built'])}, built with FLASH_MLA_DISABLE_SM100=1; "
        f"FlagGems {'; '.join(m.get('flaggems_source') or ['not carried'])} (source files); vLLM "
        f"{'; '.join(m.get('vllm_source') or ['not carried'])}; FlashInfer references: "
        f"{'; '.join(m.get('flashinfer_reference_source') or ['not carried'])}.",
        *([f"Note: {m['note']}.", ""] if m.get("note") else [""]),
        f"Command: `{doc['command']}`. Each peer's shipped xfail file is applied, so a known discrepancy "
        "counts as `xfailed` and a test that starts passing fails the run (`xfail_strict`). A capability the "
        "peer lacks is never asked: every case is fitted to the adapter's `envelope`, and a case that cannot "
        "exist inside it is skipped as not applicable, naming the envelope field.",
        "",
        "## Totals",
        "",
        "| implementation | tests | passed | failed | errors | skipped | xfailed | xpassed | exit | seconds |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, s in impls.items():
        t = s["totals"]
        out.append(
            f"| `{name}` | {s['tests']} | {t['passed']} | {t['failed']} | {t['error']} | {t['skipped']} | "
            f"{t['xfailed']} | {t['xpassed']} | {_fmt(s['exit'])} | {_fmt(s['seconds'])} |"
        )
    late = {n: s["xfailed_listed_after_run"] for n, s in impls.items() if s["xfailed_listed_after_run"]}
    if late:
        listed = ", ".join(f"`{n}` {c}" for n, c in late.items())
        out += [
            "",
            f"This run was made before the xfail files existed: the failures their entries list ({listed}) are "
            "counted as xfailed here; every other failure is listed below.",
        ]
    out += ["", "## Per suite (passed / failed+errors / skipped / xfailed)", ""]
    suites = sorted({f for s in impls.values() for f in s["suites"]})
    out.append("| suite | " + " | ".join(f"`{n}`" for n in impls) + " |")
    out.append("| --- |" + " --- |" * len(impls))
    for f in suites:
        cells = []
        for s in impls.values():
            c = s["suites"].get(f)
            cells.append(
                "-"
                if c is None
                else f"{c['passed']} / {c['failed'] + c['error'] + c['xpassed']} / {c['skipped']} / {c['xfailed']}"
            )
        out.append(f"| `{f}` | " + " | ".join(cells) + " |")
    if doc.get("oracle_errors"):
        out += [
            "",
            "## Errors against the float64 oracle",
            "",
            "Over every case of the attention suites (`attention.cases`: conformance, FlashInfer and deployment "
            "cases up to 600 tokens) the adapter takes; `scripts/peers_smoke.py`. Normwise relative output error "
            "`||A - E|| / ||E||`, cosine similarity, LSE error in natural-log units (infinite LSEs must match).",
            "",
            "| implementation | cases run | not taken | raised | max normwise rel. error | min cosine | max LSE error "
            "| inf-LSE mismatches | non-finite outputs |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name, e in doc["oracle_errors"].items():
            counts = f"{e['cases_ok']} | {e['cases_unsupported']} | {e['cases_error']}"
            errors = f"{_fmt(e['max_rel_err'])} | {_fmt(e['min_cosine'], '.7f')} | {_fmt(e['max_lse_err'])}"
            out.append(f"| `{name}` | {counts} | {errors} | {e['lse_inf_mismatch']} | {e['nonfinite_out']} |")
    if doc.get("headline"):
        out += [
            "",
            "## Headline shapes (T = 64, sink on)",
            "",
            "| case | implementation | median ms | normwise rel. error vs oracle | vs bundled reference | LSE error |",
            "| --- | --- | ---: | ---: | ---: | ---: |",
        ]
        for case, per in doc["headline"].items():
            for name, e in per.items():
                if e.get("status") != "ok":
                    why = _short(e.get("reason") or e.get("error", ""), 90)
                    out.append(f"| {case} | `{name}` | {e.get('status')}: {why} | | | |")
                    continue
                out.append(
                    f"| {case} | `{name}` | {_fmt(e['ms'], '.3f')} | {_fmt(e['rel_err'])} | "
                    f"{_fmt(e.get('rel_vs_reference'))} | {_fmt(e['lse_err'])} |"
                )
    out += ["", "## Discrepancies found in the peers", ""]
    any_disc = False
    for name, s in impls.items():
        for d in s["discrepancies"]:
            any_disc = True
            out.append(f"* **`{name}` [{d['key']}] {d['kind']}** ({d['xfailed_tests']} xfailed tests): {d['text']}")
    if not any_disc:
        out.append("None recorded.")
    if doc.get("reproducers"):
        rep = doc["reproducers"]
        out += [
            "",
            "## Reproducers",
            "",
            "The same run with `--sparse-mla-repro-dir` (REPRO=1): one standalone `repro.py` per wrong call of an "
            "xfailed or failed test, then `scripts/check_repros.py`: a script holds when it exits 1 on its "
            "implementation (a script that calls the peer directly runs with `pytest` and `pytest_sparse_mla` "
            "unimportable) and 0 with `--impl` the bundled reference. `docs/discrepancies.md` lists them.",
            "",
            "| implementation | scripts | hold | call the peer directly |",
            "| --- | ---: | ---: | ---: |",
        ]
        for name, row in rep["per_implementation"].items():
            out.append(f"| `{name}` | {row['scripts']} | {row['hold']} | {row['native']} |")
        missing = rep["summary"].get("xfail_lines_without_a_holding_script") or {}
        if missing:
            out += ["", "xfail lines without a holding script (a relation between calls, or not run here):", ""]
            for name, ids in missing.items():
                out += [f"* `{name}`: " + ", ".join(f"`{i.split('::', 1)[-1]}`" for i in ids)]
    out += ["", "## Failures not listed in an xfail file", ""]
    any_fail = False
    for name, s in impls.items():
        for f in s["failures"]:
            any_fail = True
            why = f" **Explained:** {f['explanation']}" if f.get("explanation") else " **Not yet explained.**"
            out.append(f"* `{name}` {f['outcome']} `{f['id']}`: {f['message']}{why}")
    if not any_fail:
        out.append("None.")
    out += ["", "## Skips (capabilities a peer lacks), most frequent reasons", ""]
    for name, s in impls.items():
        if not s["skip_reasons"]:
            continue
        out.append(f"* `{name}`:")
        for r in s["skip_reasons"][:12]:
            out.append(f"  * {r['count']} x {r['reason']}")
    out += ["", "## Error-class coverage (classes each implementation's envelope let run)", ""]
    for name, s in impls.items():
        rows = s.get("coverage") or []
        if not rows:
            continue
        never = [r["class"] for r in rows if not r["ran"]]
        failing = [r["class"] for r in rows if r["failed"]]
        out.append(
            f"* `{name}`: {sum(1 for r in rows if r['ran'])} of {len(rows)} classes ran; never ran: "
            f"{', '.join(never) or 'none'}; with failures: {', '.join(failing) or 'none'}."
        )
        for r in rows:
            if not r["ran"] and r["why_not"]:
                out.append(f"  * `{r['class']}` not run: {r['why_not'][0]}")
    out += ["", "## What each adapter declares (its `envelope`)", ""]
    for name, d in doc["declarations"].items():
        heads = "any" if d["num_heads"] is None else "/".join(map(str, d["num_heads"]))
        extra = ", ".join(d["extra_cache_formats"]) or "none"
        lengths = ", ".join(d["topk_length_formats"]) or "none"
        lse = ", ".join(d["lse_conventions"]) or "none (output only)"
        out.append(
            f"* `{name}`: {d['peer']}; formats {', '.join(d['formats'])}; heads {heads}; topk multiple "
            f"of {d['topk']['multiple']}; extra cache for {extra}; topk_length for {lengths} "
            f"({d['topk_length_range']}); tokens >= {d['min_tokens']}; masked lanes: {d['masked_indices']}; "
            f"index past the cache: {d['index_past_cache']}; LSE conventions {lse}; devices {', '.join(d['devices'])}."
        )
        for note in d["notes"]:
            out.append(f"  * {note}")
    return "\n".join(out) + "\n"


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


#: Where each peer's version is read from ``machine.json`` (label, key).
_VERSIONS = {
    "sglang-triton": ("sglang", "sglang"),
    "sglang-torch": ("sglang", "sglang"),
    "flashmla": ("FlashMLA", "flashmla_source"),
    "flaggems": ("FlagGems", "flaggems_source"),
    "vllm-triton": ("vLLM", "vllm_source"),
    "flashinfer-reference": ("FlashInfer", "flashinfer_reference_source"),
}


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
            out.append(f"* xfailed tests: {d['xfailed_tests']} (of {len(ids)} listed)")
            if held:
                more = f" and {len(tests) - 4} more" if len(tests) > 4 else ""
                shown = ", ".join(f"`{t}`" for t in tests[:4]) + more
                out.append(f"* reproducers that hold: {len(held)} ({native} call the peer directly): {shown}")
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
