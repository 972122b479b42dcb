"""Deployment coverage report: which DeepSeek-V4 deployments each FlashInfer release serves.

Console script ``sparse-mla-deployments`` (``--format text|json``, ``--release X`` repeatable,
``--gaps-only``) and the pytest option ``--sparse-mla-deployment-report {text,json}`` (which prints
the report alone and exits, like ``--markers``). Rows are :data:`pytest_sparse_mla.deployments.DEPLOYMENTS` x
{decode, prefill}; columns are releases (default: the last examined release of each family);
each cell is the :func:`~pytest_sparse_mla.dispatch.supports` verdict, and every gap is listed
with its reason and the exact error that release raises. Pure Python (no torch).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pytest_sparse_mla.deployments import DEPLOYMENTS, PHASES, PREFILL_NUM_TOKENS, Deployment
from pytest_sparse_mla.dispatch import errors, grid

__all__ = [
    "DEFAULT_RELEASES",
    "Row",
    "coverage",
    "deployment_config",
    "main",
    "releases_with",
    "render",
    "render_json",
    "render_text",
]

#: one release per family: the last examined release of each.
DEFAULT_RELEASES: tuple[str, ...] = tuple(f.examined[-1] for f in grid.families())


@dataclass(frozen=True)
class Row:
    """One deployment in one phase, judged by each release."""

    deployment: Deployment
    phase: str
    config: grid.SparseMlaConfig
    verdicts: tuple[grid.Verdict, ...]


def deployment_config(deployment: Deployment, phase: str) -> grid.SparseMlaConfig:
    """The DSV4 :class:`~pytest_sparse_mla.dispatch.SparseMlaConfig` of one call of ``deployment``
    in ``phase`` (``"decode"`` or ``"prefill"``: rows from :meth:`Deployment.num_tokens`; the other
    fields are the deployment's, in FlashInfer's spelling).

    Raises:
        ValueError: unknown phase.
    """
    return grid.SparseMlaConfig(
        model="DSV4",
        num_tokens=deployment.num_tokens(phase),
        num_heads=deployment.num_heads,
        topk=deployment.topk,
        page_block_size=deployment.page_block_size,
        topk_extra=deployment.extra_topk,  # FlashInfer's config spells it topk_extra
        extra_page_block_size=deployment.extra_page_block_size,
    )


def coverage(
    releases: Sequence[str] | None = None, deployments: Sequence[Deployment] | None = None
) -> list[Row]:
    """Judge every deployment x phase on every release.

    Raises:
        UnsupportedReleaseError: a release has no SM120 sparse-MLA grid or is newer than the last
            examined release (:func:`~pytest_sparse_mla.dispatch.grid.check_known_release`).
    """
    releases = tuple(releases or DEFAULT_RELEASES)
    for release in releases:
        grid.check_known_release(release)
    rows = []
    for deployment in deployments or DEPLOYMENTS:
        for phase in PHASES:
            config = deployment_config(deployment, phase)
            verdicts = tuple(grid.supports(config, release) for release in releases)
            rows.append(Row(deployment, phase, config, verdicts))
    return rows


def _column(release: str) -> str:
    family = grid.release_family(release)
    return f"{release} [{family.label}]" if release != family.label else release


def _cell(verdict: grid.Verdict, footnote: int | None) -> str:
    if not verdict.supported:
        return f"FAIL [{footnote}]"
    names = {"decode": "decode", "prefill_single": "single", "prefill_dual": "dual"}
    route = names[verdict.route or "decode"]
    text = route if verdict.numeric_route is None else f"{route} {verdict.numeric_route}"
    return text + (" (page unchecked)" if verdict.unchecked_page_size else "")


def render_text(rows: Sequence[Row], releases: Sequence[str], *, gaps_only: bool = False) -> str:
    """The report as a fixed-width table followed by the numbered gaps."""
    header = ["deployment", "TP", "heads", "topk", "extra", "phase", *map(_column, releases)]
    table: list[list[str]] = []
    gap_ids: dict[tuple[str, str, str], int] = {}
    gap_releases: dict[int, list[str]] = {}
    for row in rows:
        cells = []
        failed = False
        for verdict in row.verdicts:
            footnote = None
            if not verdict.supported:
                failed = True
                error_type = verdict.error_type.__name__ if verdict.error_type else "?"
                key = (verdict.reason or "", error_type, verdict.error_message or "")
                footnote = gap_ids.setdefault(key, len(gap_ids) + 1)
                if verdict.release not in gap_releases.setdefault(footnote, []):
                    gap_releases[footnote].append(verdict.release)
            cells.append(_cell(verdict, footnote))
        if gaps_only and not failed:
            continue
        d = row.deployment
        extra = f"{d.extra_topk}@{d.extra_page_block_size}" if d.extra_topk else "-"
        table.append(
            [f"{d.model} {d.layer}", str(d.tp), str(d.num_heads), str(d.topk), extra,
             f"{row.phase} T={row.config.num_tokens}", *cells]
        )  # fmt: skip
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
    lines = [
        "DeepSeek-V4 on FlashInfer SM120/SM121 sparse MLA (FP8 584 B/token cache, backend "
        "'sparse', main page 64 after the 256->64 split): which deployments each release serves",
        f"decode: num_tokens <= 64; prefill: num_tokens={PREFILL_NUM_TOKENS} stands for every "
        "num_tokens > 64. Cell: route and numeric route, or FAIL [gap].",
        "",
        "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)),
        "  ".join("-" * w for w in widths),
    ]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
    lines.append("")
    for i, release in enumerate(releases):
        served = sum(row.verdicts[i].supported for row in rows)
        lines.append(f"{_column(release)}: serves {served} of {len(rows)} deployment calls")
    if gap_ids:
        lines += ["", f"gaps ({len(gap_ids)}):"]
        for (reason, error_type, message), number in gap_ids.items():
            on = ", ".join(gap_releases[number])
            lines += [f"[{number}] on {on}: {reason}", f"    {error_type}: {message}"]
    return "\n".join(lines)


def render_json(rows: Sequence[Row], releases: Sequence[str]) -> str:
    """The report as JSON: releases, rows (deployment, phase, config, verdict per release)."""
    document: dict[str, Any] = {
        "releases": [
            {"release": r, "family": grid.release_family(r).label} for r in releases
        ],
        "prefill_num_tokens": PREFILL_NUM_TOKENS,
        "rows": [
            {
                "deployment": {**asdict(row.deployment), "key": row.deployment.key},
                "phase": row.phase,
                "config": asdict(row.config),
                "verdicts": {r: v.to_dict() for r, v in zip(releases, row.verdicts, strict=True)},
            }
            for row in rows
        ],
        "summary": {
            r: {"served": sum(row.verdicts[i].supported for row in rows), "total": len(rows)}
            for i, r in enumerate(releases)
        },
    }
    return json.dumps(document, indent=2)


def releases_with(release: str | None) -> tuple[str, ...]:
    """:data:`DEFAULT_RELEASES` plus ``release`` (the ``--sparse-mla-grid`` release) when it is
    another one."""
    if release is None or release in DEFAULT_RELEASES:
        return DEFAULT_RELEASES
    return (*DEFAULT_RELEASES, release)


def render(fmt: str = "text", releases: Sequence[str] | None = None, *, gaps_only: bool = False) -> str:
    """The report in ``fmt`` (``"text"`` or ``"json"``) for ``releases`` (default: one per family).

    Raises:
        ValueError: unknown ``fmt``.
        UnsupportedReleaseError: a release has no SM120 sparse-MLA grid or is newer than the last
            examined release.
    """
    releases = tuple(releases or DEFAULT_RELEASES)
    rows = coverage(releases)
    if fmt == "text":
        return render_text(rows, releases, gaps_only=gaps_only)
    if fmt == "json":
        return render_json(rows, releases)
    raise ValueError(f"fmt={fmt!r}: expected 'text' or 'json'")


def main(argv: Sequence[str] | None = None) -> int:
    """Console script ``sparse-mla-deployments``; returns the exit status (2 on a bad release)."""
    parser = argparse.ArgumentParser(
        prog="sparse-mla-deployments",
        description="Which DeepSeek-V4 deployments (V4-Flash, V4-Pro, DSpark draft x TP 1/2/4/8 "
        "x decode/prefill) each FlashInfer release serves on SM120, with the reason for each gap.",
    )
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument(
        "--release",
        action="append",
        metavar="VERSION",
        help="FlashInfer release to report (repeatable; default: "
        + ", ".join(DEFAULT_RELEASES)
        + ")",
    )
    parser.add_argument("--gaps-only", action="store_true", help="text: only rows with a gap")
    args = parser.parse_args(argv)
    try:
        text = render(args.format, args.release, gaps_only=args.gaps_only)
    except errors.UnsupportedReleaseError as exc:
        print(f"sparse-mla-deployments: {exc}", file=sys.stderr)
        return 2
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `sparse-mla-deployments | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
