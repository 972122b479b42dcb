"""The conformance report: a run's tests, summarised per implementation and written as Markdown.

One code path serves three uses:

* ``--sparse-mla-report-md PATH``: the plugin writes the report of the implementation that ran
  (totals, per suite, failures not listed in the xfail file, skip reasons, error-class coverage, the
  discrepancies the xfail file defines, the declared envelope), from the session's own reports;
* ``sparse-mla-report RUN.json ... --md OUT.md [--json OUT.json]`` (the console script,
  :func:`main`): one report from several ``--sparse-mla-report-json`` files, one per CI job, GPU type
  or implementation (each holds its tests' outcomes under ``"tests"``); the reports of the machines
  of one search matrix (``--sparse-mla-search-shard-group I/N``) are first merged into one run
  (:func:`merge_shard_groups`);
* ``scripts/conformance_report.py`` in a checkout: this project's ``docs/conformance.md`` from the
  JUnit XML and JSON files of an H200 run of every built-in peer (:func:`read_junit`).

An xfail file in the shipped format (``pytest_sparse_mla/xfail/*.txt``) names discrepancies: a
comment line ``# [KEY] kind: text`` defines one (kind ``convention`` or ``bug``; the text says what
differs, where, and the smallest input), and each test entry ends with ``# KEY``. Every number in
the Markdown comes from the run; nothing is typed by hand. This module imports neither pytest nor
torch (the plugin feeds it plain dicts).
"""

from __future__ import annotations

import argparse
import json
import re
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = [
    "OUTCOMES",
    "build",
    "main",
    "markdown",
    "read_junit",
    "read_xfail_file",
    "merge_shard_groups",
    "row_of",
    "summarize",
]

OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
_DEFINITION = re.compile(r"^#\s*\[(?P<key>[A-Za-z0-9_-]+)\]\s*(?P<kind>[a-z ]+):\s*(?P<text>.+)$")


def junit_test_id(case: ET.Element) -> tuple[str, str]:
    """``(suite file, node id)`` of a JUnit ``testcase`` (``suites.test_x`` + ``name``)."""
    classname = case.get("classname", "")
    parts = classname.split(".")
    module = [p for p in parts if p.startswith("test_")]
    file = "/".join(parts[: parts.index(module[0]) + 1]) + ".py" if module else classname
    inner = parts[parts.index(module[0]) + 1 :] if module else []
    return file, "::".join([file, *inner, case.get("name", "")])


def junit_outcome(case: ET.Element) -> tuple[str, str]:
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
        file, node = junit_test_id(case)
        kind, message = junit_outcome(case)
        rows.append(
            {"file": file, "id": node, "outcome": kind, "message": message, "seconds": float(case.get("time", 0)),
             **_diagnosis_of(kind, message)}
        )  # fmt: skip
    return rows


def _diagnosis_of(outcome: str, message: str) -> dict[str, str | None]:
    """``cause_key``, ``cause`` and ``evidence`` of a failed, errored or xfailed test's full message
    (``diagnosis.read``), all ``None`` for another outcome."""
    from pytest_sparse_mla import diagnosis

    if outcome not in ("failed", "error", "xfailed", "xpassed") or not message:
        return diagnosis.Diagnosis().as_dict()
    return diagnosis.read(message).as_dict()


def read_xfail_file(path: Path) -> dict[str, Any]:
    """Discrepancy definitions and entries of a shipped xfail file (module docstring)."""
    definitions: dict[str, dict[str, str]] = {}
    entries: list[dict[str, str]] = []
    for line in path.read_text().splitlines():
        stripped = line.strip()
        match = _DEFINITION.match(stripped)
        if match and match["kind"].strip() == "region":  # where the search finds it (pytest_sparse_mla.regions)
            definitions.setdefault(match["key"], {}).setdefault("regions", []).append(match["text"].strip())
            continue
        if match:
            definitions[match["key"]] = {**definitions.get(match["key"], {}), "kind": match["kind"].strip(),
                                         "text": match["text"].strip()}  # fmt: skip
            continue
        if not stripped or stripped.startswith("#"):
            continue
        parts = re.split(r"\s#", stripped, maxsplit=1)
        comment = parts[1].strip() if len(parts) > 1 else ""
        entries.append({"prefix": parts[0].strip(), "key": comment.split()[0] if comment else ""})
    return {"definitions": definitions, "entries": entries}


def summarize(
    impl: str,
    rows: list[dict[str, Any]],
    *,
    exit_info: dict[str, Any] | None = None,
    run_report: dict[str, Any] | None = None,
    xfail: dict[str, Any] | None = None,
    notes: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Totals, per-suite counts, skip reasons, failures and xfails of one implementation's run.

    Args:
        impl: the implementation's name (``--sparse-mla-impl``).
        rows: one dict per test (:func:`read_junit`, :class:`Rows`): ``file``, ``id``, ``outcome``
            (one of :data:`OUTCOMES`), ``message``, ``seconds``.
        exit_info: ``exit`` (pytest's exit status), ``seconds`` (the run's wall time) and
            ``xfail_file`` (the xfail file the run applied, or ``None``; a failure that an older
            file missed and ``xfail`` lists is reported failed, explained as listed after the run).
        run_report: the ``--sparse-mla-report-json`` document (its ``coverage`` and ``envelope``).
        xfail: :func:`read_xfail_file` of the implementation's xfail file (its definitions name the
            discrepancies; a run made without it counts the failures it lists as xfailed).
        notes: ``notes["project_faults"]``: ``{"test", "impls", "explanation"}`` entries that
            explain a failure which is a fault of the test tool (not of the kernel), shown beside it.
    """
    exit_info = exit_info or {}
    run_report = run_report or {}
    xfail = xfail or {"definitions": {}, "entries": []}
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
        elif key is not None and r["outcome"] in ("failed", "error"):
            r["listed_key"] = key  # an older xfail file was applied: the run failed it, the file lists it now
        if r["outcome"] == "xfailed":
            r["key"] = key or ""
            by_key[r["key"]] += 1
    totals = Counter(r["outcome"] for r in rows)
    suites: dict[str, Counter] = {}
    for r in rows:
        suites.setdefault(r["file"], Counter())[r["outcome"]] += 1
    skips = Counter(_short(r["message"]) for r in rows if r["outcome"] == "skipped")
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
                "message": _short(_gist(r["message"]), 600),
                **{k: r.get(k) for k in ("cause_key", "cause", "evidence")},
                "explanation": next(
                    (
                        n["explanation"]
                        for n in (notes or {}).get("project_faults", [])
                        if impl in n.get("impls", [impl]) and _matches(r["id"], n["test"])
                    ),
                    f"listed after this run, under [{r['listed_key']}] of the implementation's xfail file"
                    if r.get("listed_key")
                    else "",
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
        "search": run_report.get("search"),
        "shard_groups": run_report.get("shard_groups", []),
        "missing_shard_groups": run_report.get("missing_shard_groups", []),
    }


def _matches(node_id: str, prefix: str) -> bool:
    return node_id.startswith(prefix) or node_id.replace("pytest_sparse_mla/", "").startswith(prefix)


def _gist(message: str) -> str:
    """A failure's first line, and its ``likely cause:`` line when it has one (the tolerance
    messages' hint), joined with `` | ``."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    if not lines:
        return ""
    cause = next((ln for ln in lines[1:] if ln.lower().startswith("likely cause")), None)
    return lines[0] + (f" | {cause}" if cause else "")


def _short(text: str, limit: int = 240) -> str:
    """``text`` on one line, cut at a word boundary before ``limit`` characters (with "...")."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[: limit - 3]
    return (cut.rsplit(" ", 1)[0] if " " in cut else cut) + " ..."


def _fmt(value: Any, spec: str = ".2e") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def _peers_line(m: dict[str, Any]) -> list[str]:
    """The peers' versions and sources (this project's H200 runs; ``machine.json``, the keys and words
    of ``catalogue.sources``), if any is recorded."""
    from pytest_sparse_mla.catalogue import sources

    if not any(m.get(source.key) for source in sources()):
        return []
    words = []
    for source in sources():
        value = m.get(source.key) or source.missing
        words.append(source.line.format("; ".join(value) if isinstance(value, list) else value))
    return ["Peers: " + "; ".join(words) + "."]


def _sanitizer_lines(logs: dict[str, dict[str, Any]]) -> list[str]:
    """The sanitizer section: per implementation, what its compute-sanitizer memcheck log says
    (``sanitizer.summarize_log``); nothing without a log."""
    if not logs:
        return []
    out = [
        "",
        "## Sanitizer lane",
        "",
        "`SANITIZER=1 scripts/device_conformance.sh` (compute-sanitizer memcheck, `--padding 4096`, one "
        "process; `pytest_sparse_mla.sanitizer`): a report fails its test (see the failures below); the log's totals:",
        "",
        "| implementation | memcheck reports | error summary | first report |",
        "| --- | ---: | ---: | --- |",
    ]
    for name, log in logs.items():
        total = "not written (the run was cut)" if log.get("error_summary") is None else str(log["error_summary"])
        first = _short(str(log["first"]).replace("\n", "; "), 200) if log.get("first") else "none"
        out.append(f"| `{name}` | {log.get('reports', 0)} | {total} | {first} |")
    return out


def _search_lines(impls: dict[str, Any]) -> list[str]:
    """The "Search" section: what each implementation's search drew (``search``: the merged summary,
    ``shards.merge_summaries``), which machine ran which shards (``shard_groups``), the machines whose
    report is missing and the discrepancies the search reports; nothing when no search ran."""
    if not any(s.get("search") or s.get("shard_groups") for s in impls.values()):
        return []
    out = ["", "## Search (the property tests' drawn calls)", ""]
    for name, s in impls.items():
        search = s.get("search") or {}
        if not search and not s.get("shard_groups"):
            continue
        seed = search.get("seed")
        out.append(
            f"* `{name}`: {search.get('tests', 0)} search test shards, {search.get('calls', 0)} calls drawn "
            f"(shrinking included), {search.get('failed', 0)} failed; "
            + ("derandomized." if seed is None else f"seed {seed}.")
        )
        for g in s.get("shard_groups", []):
            shards = g.get("global_shards") or []
            span = f"shards {shards[0]}..{shards[-1]}" if shards else "no shards"
            drawn = g.get("search") or {}
            out.append(
                f"  * machine {g['group']} ({g['report']}): {span}, {g['tests']} tests, exit {_fmt(g.get('exit'))}, "
                f"{drawn.get('calls', 0)} calls drawn, {drawn.get('failed', 0)} failed."
            )
        if s.get("missing_shard_groups"):
            out.append(f"  * **missing machines** (no report): {', '.join(s['missing_shard_groups'])}.")
        for d in search.get("discrepancies") or []:
            if isinstance(d, dict) and "key" in d:
                count = f" ({d['count']} x)" if "count" in d else ""
                region = f": {_short(str(d['region']), 200)}" if d.get("region") is not None else ""
                out.append(f"  * discrepancy `{d['key']}`{count}{region}")
    return out


def _cause_lines(impls: dict[str, Any]) -> list[str]:
    """The "Failures by likely cause" section: per implementation, each cause key the failures'
    messages name (``diagnosis``), how many tests, the first test's cause and evidence; the
    failures that name no cause, counted."""
    out = ["", "## Failures by likely cause", ""]
    any_fail = False
    for name, s in impls.items():
        groups: dict[str | None, list[dict[str, Any]]] = {}
        for f in s["failures"]:
            if f["outcome"] in ("failed", "error"):
                groups.setdefault(f.get("cause_key") if f.get("cause") else None, []).append(f)
        for key, fs in groups.items():
            any_fail = True
            if key is None:
                out.append(f"* `{name}`: {len(fs)} test(s) whose failure names no likely cause")
                continue
            first = fs[0]
            evidence = f"; evidence: {_short(str(first['evidence']), 400)}" if first.get("evidence") else ""
            out.append(f"* `{name}` `[{key}]` ({len(fs)} test(s)): {_short(str(first['cause']), 600)}{evidence}")
    if not any_fail:
        out.append("None.")
    return out


def markdown(doc: dict[str, Any]) -> str:
    """The report of :func:`build`'s document as Markdown."""
    m = doc["machine"]
    impls = doc["implementations"]
    gpu = f"{m.get('gpu_count', '?')} x {m.get('gpu')} (sm {m.get('sm', '?')}), driver {m.get('driver')}" if m.get(
        "gpu"
    ) else "no GPU"
    out = [
        f"# {doc.get('title') or 'Conformance of sparse-MLA kernels'}",
        "",
        f"<!-- Generated by {doc.get('generated_by') or 'pytest_sparse_mla.conformance'}; do not edit by hand. -->",
        "",
        f"Machine: {gpu}, torch {m.get('torch')} (CUDA build {m.get('cuda_runtime') or 'none'}), "
        f"triton {m.get('triton')}, "
        f"Python {m.get('python')}, {m.get('cpu_count')} CPUs; run {m.get('date_utc')} UTC.",
        *_peers_line(m),
        *([f"Note: {m['note']}.", ""] if m.get("note") else [""]),
        f"Command: `{doc['command']}`. Where an implementation's xfail file is applied, a known discrepancy "
        "counts as `xfailed` and a test that starts passing fails the run (`xfail_strict`). A capability the "
        "implementation lacks is never asked: every case is fitted to its `envelope`, and a case that cannot "
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
            f"{t['xfailed']} | {t['xpassed']} | {_fmt(s['exit'])} | {_fmt(s['seconds'], '.1f')} |"
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
    out += ["", "## Discrepancies (defined in the xfail files)", ""]
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
    out += _sanitizer_lines(doc.get("sanitizer") or {})
    out += _search_lines(impls)
    out += _cause_lines(impls)
    out += ["", "## Failures not listed in an xfail file", ""]
    any_fail = False
    for name, s in impls.items():
        for f in s["failures"]:
            any_fail = True
            if f.get("explanation"):
                why = f" **Explained:** {f['explanation']}"
            elif f.get("cause"):
                why = f" **Likely cause** `[{f.get('cause_key')}]`: {_short(str(f['cause']), 400)}"
            else:
                why = " **Not yet explained.**"
            evidence = f" Evidence: {_short(str(f['evidence']), 400)}" if f.get("evidence") else ""
            message = f["message"].split(" | likely cause")[0] if f.get("cause") else f["message"]
            out.append(f"* `{name}` {f['outcome']} `{f['id']}`: {message}{why}{evidence}")
    if not any_fail:
        out.append("None.")
    out += ["", "## Skips, most frequent reasons", ""]
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
    out += ["", "## What each implementation declares (its `envelope`)", ""]
    for name, d in doc["declarations"].items():
        heads = "any" if d["num_heads"] is None else "/".join(map(str, d["num_heads"]))
        extra = ", ".join(d["extra_cache_formats"]) or "none"
        lengths = ", ".join(d["topk_length_formats"]) or "none"
        lse = ", ".join(d["lse_conventions"]) or "none (output only)"
        out.append(
            f"* `{name}`: {d.get('peer') or name}; formats {', '.join(d['formats'])}; heads {heads}; topk multiple "
            f"of {d['topk']['multiple']}; extra cache for {extra}; topk_length for {lengths} "
            f"({d['topk_length_range']}); tokens >= {d['min_tokens']}; masked lanes: {d['masked_indices']}; "
            f"index past the cache: {d['index_past_cache']}; LSE conventions {lse}; devices "
            f"{', '.join(d.get('devices') or ['-'])}."
        )
        for note in d.get("notes", ()):
            out.append(f"  * {note}")
    return "\n".join(out) + "\n"




class Rows:
    """Each test's outcome, gathered from pytest's phase reports (the plugin feeds it plain values).

    The outcome is pytest's: a failed setup is an ``error``; a failed call ``failed``, or
    ``xpassed`` for an ``[XPASS(strict)]``; a skip ``skipped``, or ``xfailed`` for an expected failure;
    a call that passed with an xfail mark ``xpassed``; a failed teardown after a pass ``error``.
    """

    def __init__(self) -> None:
        self._rows: dict[str, dict[str, Any]] = {}

    def add(
        self, test_id: str, when: str, outcome: str, *, message: str = "", wasxfail: bool = False, seconds: float = 0.0
    ) -> None:
        """One phase report: ``when`` (``setup`` / ``call`` / ``teardown``), pytest's ``outcome``
        (``passed`` / ``failed`` / ``skipped``), its message, whether it carries ``wasxfail``."""
        row = self._rows.setdefault(
            test_id, {"file": test_id.split("::")[0], "id": test_id, "outcome": "passed", "message": "", "seconds": 0.0,
                      "cause_key": None, "cause": None, "evidence": None}
        )  # fmt: skip
        row["seconds"] = round(row["seconds"] + seconds, 6)
        if when == "teardown":
            if outcome == "failed" and row["outcome"] in ("passed", "xpassed"):
                row["outcome"], row["message"] = "error", message[:600]
                row.update(_diagnosis_of("error", message))
            return
        if when == "setup" and outcome == "passed":
            return
        if outcome == "failed":
            kind = "xpassed" if "[XPASS(strict)]" in message else ("failed" if when == "call" else "error")
        elif outcome == "skipped":
            kind = "xfailed" if wasxfail else "skipped"
        else:
            kind = "xpassed" if wasxfail else "passed"
        row["outcome"], row["message"] = kind, message[:600]
        row.update(_diagnosis_of(kind, message))  # read from the whole message (the cause line is near its end)

    def rows(self) -> list[dict[str, Any]]:
        """One dict per test (as :func:`read_junit`), in the order the tests first reported."""
        return [dict(r) for r in self._rows.values()]


def label_of(run_report: dict[str, Any]) -> str:
    """The one label of a run's implementation in the reports: its ``name`` (``implementation.name``
    of a ``--sparse-mla-report-json`` document, the name its skips and failures use), else the
    ``--sparse-mla-impl`` value (a document without it)."""
    name = (run_report.get("implementation") or {}).get("name")
    return str(name or run_report.get("options", {}).get("impl", "?"))


def row_of(run_report: dict[str, Any]) -> dict[str, Any]:
    """The :func:`build` input of one ``--sparse-mla-report-json`` document: ``impl``, ``rows``
    (its ``"tests"``), ``exit_info``, ``run_report`` and ``xfail`` (the xfail file the run applied,
    when it is still readable)."""
    opts = run_report.get("options", {})
    path = opts.get("xfail_file")
    xfail = read_xfail_file(Path(path)) if path and Path(path).is_file() else None
    return {
        "impl": label_of(run_report),
        "rows": list(run_report.get("tests", [])),
        "exit_info": {"exit": run_report.get("exit"), "seconds": run_report.get("seconds"), "xfail_file": path},
        "run_report": run_report,
        "xfail": xfail,
    }


def machine_of(run_report: dict[str, Any]) -> dict[str, Any]:
    """The report header's machine fields from a ``--sparse-mla-report-json`` document."""
    caps = run_report.get("capabilities", {})
    workers = run_report.get("workers", {})
    names = sorted({str(w.get("device_name")) for w in workers.values() if w.get("device_name")})
    cc = caps.get("compute_capability")
    return {
        "gpu": ", ".join(names) or caps.get("device_name"),
        "gpu_count": caps.get("device_count"),
        "sm": ".".join(str(v) for v in cc) if isinstance(cc, (list, tuple)) else cc,
        "driver": caps.get("driver"),
        "torch": caps.get("torch_version"),
        "cuda_runtime": caps.get("cuda_version"),
        "triton": caps.get("triton_version"),
        "python": run_report.get("python"),
        "cpu_count": run_report.get("cpu_count"),
        "date_utc": run_report.get("date_utc"),
    }


def build(
    runs: list[dict[str, Any]],
    *,
    machine: dict[str, Any],
    command: str,
    declarations: dict[str, dict[str, Any]] | None = None,
    notes: dict[str, Any] | None = None,
    title: str = "",
    generated_by: str = "",
) -> dict[str, Any]:
    """The report document of one or more runs (each as :func:`row_of` gives it). Two runs of one
    implementation (two GPU types, two jobs) are told apart by their position (``impl #2``).
    ``declarations``: ``{name: {"peer", "devices", **Envelope.as_dict()}}``; by default each run's
    own ``envelope`` (``--sparse-mla-report-json``)."""
    impls: dict[str, Any] = {}
    declared: dict[str, Any] = {}
    for run in runs:
        name = run["impl"]
        n = 2
        while name in impls:
            name, n = f"{run['impl']} #{n}", n + 1
        impls[name] = summarize(
            name, run["rows"], exit_info=run.get("exit_info"), run_report=run.get("run_report"),
            xfail=run.get("xfail"), notes=notes,
        )  # fmt: skip
        envelope = dict((run.get("run_report") or {}).get("envelope") or {})
        if envelope:
            envelope.pop("declared", None)
            device = (run.get("run_report") or {}).get("options", {}).get("device")
            declared[name] = {"peer": name, "devices": [str(device)] if device else [], **envelope}
    return {
        "title": title,
        "generated_by": generated_by,
        "machine": machine,
        "command": command,
        "implementations": impls,
        "declarations": declarations if declarations is not None else declared,
    }


#: A test that ran on several machines of a search matrix (a test that is not a search shard) keeps
#: the first of these outcomes it had: a failure anywhere is a failure.
_WORST_FIRST = ("failed", "error", "xpassed", "xfailed", "passed", "skipped")


def _matrix_of(name: str, doc: dict[str, Any]) -> tuple[tuple[Any, ...], int, int] | None:
    """``(matrix key, machine index, machines)`` of a report made with a shard group, else ``None``.
    Reports of one matrix share the implementation, the number of machines, the shards per machine,
    the search seed and the budget.

    Raises:
        ValueError: the report's ``search_shard_group`` is not ``I/N``.
    """
    from pytest_sparse_mla.shards import parse_group

    opts = doc.get("options", {})
    text = opts.get("search_shard_group")
    if not text:
        return None
    group = parse_group(str(text), f"{name}: options.search_shard_group")
    key = (str(opts.get("impl", "?")), group.count, opts.get("search_shards"), opts.get("search_seed"),
           opts.get("search_examples"))  # fmt: skip
    return key, group.index, group.count


def _merge_coverage(tables: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One coverage table (``coverage.Coverage.rows``) of several: counts summed per class, the
    commonest reasons re-counted from each table's ``why_not`` (``"N x reason"``)."""
    merged: dict[str, dict[str, Any]] = {}
    reasons: dict[str, Counter] = {}
    for rows in tables:
        for r in rows:
            row = merged.setdefault(r["class"], {"class": r["class"], "ran": 0, "passed": 0, "failed": 0, "not_run": 0})
            for k in ("ran", "passed", "failed", "not_run"):
                row[k] += int(r.get(k, 0))
            for why in r.get("why_not", []):
                match = re.match(r"^(\d+) x (.*)$", why, re.DOTALL)
                reasons.setdefault(r["class"], Counter())[match[2] if match else why] += int(match[1]) if match else 1
    return [
        {**merged[name], "why_not": [f"{n} x {why}" for why, n in reasons.get(name, Counter()).most_common(3)]}
        for name in sorted(merged)
    ]


def _merge_matrix(members: list[tuple[str, dict[str, Any], int]], machines: int) -> dict[str, Any]:
    """One run report of the reports of one search matrix (:func:`merge_shard_groups`)."""
    from pytest_sparse_mla.shards import merge_summaries

    members = sorted(members, key=lambda m: m[2])
    first = members[0][1]
    rows: dict[str, dict[str, Any]] = {}
    for _, doc, _ in members:
        for row in doc.get("tests", []):
            kept = rows.get(row["id"])
            if kept is None or _WORST_FIRST.index(row["outcome"]) < _WORST_FIRST.index(kept["outcome"]):
                rows[row["id"]] = dict(row)
    groups: list[dict[str, Any]] = []
    for name, doc, index in members:
        search = doc.get("search") or {}
        groups.append({
            "group": f"{index}/{machines}", "report": name,
            "global_shards": list(doc.get("options", {}).get("search_global_shards") or []),
            "tests": len(doc.get("tests", [])), "exit": doc.get("exit"), "seconds": doc.get("seconds"),
            "search": {k: search.get(k, 0) for k in ("tests", "calls", "failed")},
        })  # fmt: skip
    searches = [doc["search"] for _, doc, _ in members if doc.get("search")]
    exits = [doc["exit"] for _, doc, _ in members if doc.get("exit") is not None]
    seconds = [doc["seconds"] for _, doc, _ in members if doc.get("seconds") is not None]
    ran = {index for _, _, index in members}
    return {
        **first,
        "options": {
            **first.get("options", {}),
            "search_shard_group": ", ".join(g["group"] for g in groups),
            "search_global_shards": sorted(k for g in groups for k in g["global_shards"]),
        },
        "workers": {
            f"{g['group']} {k}": v
            for g, (_, doc, _) in zip(groups, members, strict=True)
            for k, v in (doc.get("workers") or {}).items()
        },
        "coverage": _merge_coverage([doc.get("coverage") or [] for _, doc, _ in members]),
        "device_faults": [f for _, doc, _ in members for f in doc.get("device_faults") or []],
        "search": merge_summaries(searches) if searches else None,
        "tests": list(rows.values()),
        "exit": max(exits) if exits else None,
        "seconds": max(seconds) if seconds else None,
        "shard_groups": groups,
        "missing_shard_groups": [f"{i}/{machines}" for i in range(machines) if i not in ran],
    }


def merge_shard_groups(reports: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The run reports of several machines of one search matrix merged into one run report each.

    Args:
        reports: ``(name, --sparse-mla-report-json document)`` pairs, in the order given (the
            name, usually the file, is recorded in ``shard_groups`` and named in errors).

    Returns:
        The documents in the order given, where the reports of one matrix (the same implementation,
        number of machines ``N``, ``search_shards``, ``search_seed`` and ``search_examples``, each with
        its own ``search_shard_group`` ``I/N``) are replaced, at the place of the first, by one:
        ``tests`` (one row per test id: the search shards' ids are disjoint; a test that ran on several
        machines keeps its worst outcome, :data:`_WORST_FIRST`), ``search``
        (``shards.merge_summaries`` of the machines' summaries), ``coverage`` (counts summed per
        class), ``device_faults`` (concatenated), ``workers`` (keyed ``"I/N gwK"``), ``exit`` (the
        highest) and ``seconds`` (the slowest machine's), ``options`` (the first machine's, with
        ``search_shard_group`` listing the groups and ``search_global_shards`` their union), and
        ``shard_groups`` (per machine: ``group``, ``report``, ``global_shards``, ``tests``, ``exit``,
        ``seconds`` and its ``search`` counts) and ``missing_shard_groups`` (the machines without a
        report). The rest is the first machine's. A report without a shard group is kept as it is.

    Raises:
        ValueError: two reports of one matrix ran the same shard group; a shard group that is not
            ``I/N``.
    """
    order: list[Any] = []
    matrices: dict[tuple[Any, ...], tuple[int, list[tuple[str, dict[str, Any], int]]]] = {}
    for name, doc in reports:
        found = _matrix_of(name, doc)
        if found is None:
            order.append(doc)
            continue
        key, index, machines = found
        if key not in matrices:
            matrices[key] = (machines, [])
            order.append(key)
        for other, _, seen in matrices[key][1]:
            if seen == index:
                raise ValueError(
                    f"{name}: shard group {index}/{machines} of {key[0]!r} is also in {other}; expected one report "
                    "per machine of a search matrix (a job that ran twice?)"
                )
        matrices[key][1].append((name, doc, index))
    return [_merge_matrix(matrices[x][1], matrices[x][0]) if isinstance(x, tuple) else x for x in order]


def main(argv: list[str] | None = None) -> int:
    """``sparse-mla-report RUN.json [RUN.json ...] --md OUT.md [--json OUT.json]``: one report of
    several ``--sparse-mla-report-json`` files (one per CI job, GPU type or implementation; the
    machines of one search matrix merged first: :func:`merge_shard_groups`)."""
    parser = argparse.ArgumentParser(
        prog="sparse-mla-report",
        description="Merge --sparse-mla-report-json files into one Markdown (and JSON) conformance report.",
    )
    parser.add_argument("reports", type=Path, nargs="+", help="--sparse-mla-report-json files")
    parser.add_argument("--md", type=Path, required=True, help="the Markdown report to write")
    parser.add_argument("--json", type=Path, help="also write the merged document as JSON")
    parser.add_argument("--title", default="", help="the report's title")
    args = parser.parse_args(argv)
    loaded: list[tuple[str, dict[str, Any]]] = []
    for path in args.reports:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            parser.error(f"{path}: not a readable --sparse-mla-report-json file ({exc})")
        if "tests" not in data:
            parser.error(f"{path}: no per-test outcomes ('tests'): written by an older pytest-sparse-mla")
        loaded.append((str(path), data))
    try:
        runs = [row_of(doc) for doc in merge_shard_groups(loaded)]
    except ValueError as exc:
        parser.error(str(exc))
    machine = machine_of(loaded[0][1])
    doc = build(
        runs, machine=machine, command="sparse-mla-report " + " ".join(str(p) for p in args.reports),
        title=args.title, generated_by="sparse-mla-report",
    )  # fmt: skip
    args.md.write_text(markdown(doc))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"sparse-mla-report: {args.md} ({', '.join(doc['implementations'])}; {time.strftime('%H:%M:%S')})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
