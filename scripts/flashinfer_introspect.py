#!/usr/bin/env python3
"""Compare an installed FlashInfer's own dispatch tables with the bundled grids (CPU only).

A CI tool of the checkout, not part of the installed package: the ``flashinfer-*`` tox lanes and
``tests/test_flashinfer_introspection.py`` (which loads it from this folder) use it.

    python scripts/flashinfer_introspect.py [--check NAME ...] [--load-only]

prints one summary per check of :data:`CHECKS` and exits 0 (every check ok or skipped), 1 (a
mismatch) or 2 (FlashInfer cannot be read here: :class:`IntrospectionUnavailable`); ``--load-only``
prints the installed version and stops.

Nothing here needs a GPU or compiles a kernel: it imports ``flashinfer.mla._sparse_mla_sm120``
(pure Python on CPU with apache-tvm-ffi and CPU torch installed), reads the release's public
tables and pure-Python predicates, runs the release's own Python routing with the kernel entry
points stubbed out, and reads the C++ sources the wheel ships under ``flashinfer/data``. Each
check returns a :class:`CheckResult`; a mismatch names the differing cells, e.g.
``decode DSV4 (num_heads=8, topk=192): bundled absent, installed present``.

Checks (:data:`CHECKS`) and what they read, by release family:

``decode_grid``
    0.6.x: the frozensets ``_DECODE_DSV4_DISPATCH`` / ``_DECODE_DSV3_2_DISPATCH`` and
    ``_DECODE_DSV4_PAGE_BLOCK_SIZE`` / ``_DECODE_DSV3_2_PAGE_BLOCK_SIZE`` / ``_DECODE_MAX_TOKENS``.
    0.7.x: envelope membership ``(h, k) in _DECODE_DSV4_DISPATCH`` over a probe grid, iteration
    (0.7.1+: dedicated heads paired with min_topk), 0.7.1+ ``_policy._STATIC_DECODE_ENVELOPE``,
    and ``flashinfer.mla.supported_sparse_mla_sm120_configs()`` fields and ``supports_decode``.
``prefill_grid``
    0.6.x: ``dispatch_dsv4_single`` / ``dispatch_dsv4_dual`` / ``dispatch_v32`` in
    ``data/csrc/sparse_mla_sm120_prefill.cu``. 0.7.0: ``prefill_variant`` and
    ``decode_splitk_eligible`` of ``flashinfer.mla._sparse_mla_sm120_plan`` over a probe grid,
    plus the dual extra page sizes in the C++ source. 0.7.1+: skipped (prefill eligibility
    needs the compiled module's ``candidates()``).
``error_texts``
    0.6.x/0.7.0: the C++ ``TVM_FFI_ICHECK`` statements in ``data/csrc/sparse_mla_sm120.cu``
    (message rebuilt from their literals and compared with ours). 0.7.x: the release's
    ``_decode_dispatch_error_message`` called with the fields of every unsupported probe
    config. 0.7.1+: ``unsupported tokens/heads`` in ``attention_validation.h`` and the absence
    of the removed prefill text.
``python_routing``
    0.6.x only: the release's ``_paged_attention`` run on zero-storage CPU tensors with
    ``gen_sparse_mla_sm120_module`` and the decode entry points stubbed; it says which path a
    decode-sized call takes (decode kernel, C++ orchestrator, or the 0.6.18 ``ValueError``,
    whose exact text is compared).
``tvm_error_type``
    apache-tvm-ffi's ``Check failed`` formats (``include/tvm/ffi/error.h``) and the Python type
    an ``InternalError`` surfaces as (``testing.test_raise_error``): a ``RuntimeError``.

Sources: the flashinfer-python wheels 0.6.14-0.7.4, whose module, constant and file names are given
above (the constants and ``supported_sparse_mla_sm120_configs()`` import and run on the CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_sparse_mla.dispatch import errors, grid

__all__ = [
    "CHECKS",
    "Mismatch",
    "CheckResult",
    "InstalledFlashInfer",
    "IntrospectionUnavailable",
    "installed_version",
    "load_installed",
    "run_check",
    "run_all",
    "compare_decode_grid",
    "compare_prefill_grid",
    "compare_error_texts",
    "compare_python_routing",
    "compare_tvm_error_type",
    "main",
]

CHECKS = ("decode_grid", "prefill_grid", "error_texts", "python_routing", "tvm_error_type")


@dataclass(frozen=True)
class Mismatch:
    """One cell where the installed release and the bundled grid disagree."""

    cell: str
    bundled: str
    installed: str

    def __str__(self) -> str:
        return f"{self.cell}: bundled {self.bundled}, installed {self.installed}"


@dataclass(frozen=True)
class CheckResult:
    """Outcome of one check: ``status`` is ``"ok"``, ``"mismatch"`` or ``"skipped"``.

    Attributes:
        name: one of :data:`CHECKS`.
        detail: what was compared (ok/mismatch) or why it was skipped.
        compared: number of cells compared.
        mismatches: the differing cells.
    """

    name: str
    status: str
    detail: str
    compared: int = 0
    mismatches: tuple[Mismatch, ...] = ()

    def summary(self) -> str:
        """Multi-line text naming every differing cell (for assertion messages)."""
        head = f"{self.name}: {self.status} ({self.detail}; {self.compared} cells compared)"
        return "\n".join([head, *(f"  - {m}" for m in self.mismatches)])


class IntrospectionUnavailable(RuntimeError):
    """FlashInfer is absent, cannot be imported on this machine, or has no SM120 grid."""


@dataclass
class InstalledFlashInfer:
    """What :func:`load_installed` found.

    Attributes:
        version: distribution version of flashinfer-python.
        family: its bundled :class:`~pytest_sparse_mla.dispatch.GridFamily`.
        sm: the module ``flashinfer.mla._sparse_mla_sm120`` (a package from 0.7.1).
        mla: the module ``flashinfer.mla``.
        plan: ``flashinfer.mla._sparse_mla_sm120_plan`` (0.7.0 only), else ``None``.
        data_dir: the wheel's ``flashinfer/data`` directory, or ``None``.
    """

    version: str
    family: grid.GridFamily
    sm: Any
    mla: Any
    plan: Any = None
    data_dir: Path | None = None
    notes: list[str] = field(default_factory=list)


def installed_version() -> str | None:
    """flashinfer-python's distribution version (package metadata only), or ``None``."""
    try:
        return importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return None


def load_installed() -> InstalledFlashInfer:
    """Import the installed FlashInfer's SM120 sparse-MLA modules (CPU import, no JIT).

    Raises:
        IntrospectionUnavailable: flashinfer-python is not installed, its version has no
            bundled grid, or importing ``flashinfer.mla._sparse_mla_sm120`` fails here (the
            message carries the import error).
    """
    version = installed_version()
    if version is None:
        raise IntrospectionUnavailable("flashinfer-python is not installed")
    try:
        family = grid.release_family(version)
    except errors.UnsupportedReleaseError as exc:
        raise IntrospectionUnavailable(str(exc)) from None
    try:
        mla = importlib.import_module("flashinfer.mla")
        sm = importlib.import_module("flashinfer.mla._sparse_mla_sm120")
    except Exception as exc:  # any import-time failure means "cannot introspect here"
        raise IntrospectionUnavailable(
            f"flashinfer-python {version} is installed but flashinfer.mla._sparse_mla_sm120 "
            f"does not import on this machine: {type(exc).__name__}: {exc}"
        ) from exc
    plan = None
    if family.engine == "planner":
        try:
            plan = importlib.import_module("flashinfer.mla._sparse_mla_sm120_plan")
        except Exception as exc:
            raise IntrospectionUnavailable(
                f"flashinfer-python {version}: flashinfer.mla._sparse_mla_sm120_plan does not "
                f"import: {type(exc).__name__}: {exc}"
            ) from exc
    data_dir = None
    root = getattr(importlib.import_module("flashinfer"), "__file__", None)
    if root is not None and (Path(root).parent / "data").is_dir():
        data_dir = Path(root).parent / "data"
    return InstalledFlashInfer(
        version=version, family=family, sm=sm, mla=mla, plan=plan, data_dir=data_dir
    )


# ----------------------------------------------------------------------------- helpers

_MODEL_TYPE = {name: m.model_type for name, m in grid.MODELS.items()}
_PROBE_HEADS = (1, 7, 8, 16, 24, 32, 64, 100, 127, 128, 129, 256)
_PROBE_TOPKS = (1, 63, 64, 100, 128, 192, 256, 320, 512, 1024, 2048, 4096)


def _config(model: str, t: int, h: int, k: int, p: int, e: int = 0, ep: int = 0) -> Any:
    return grid.SparseMlaConfig(model, t, h, k, p, e, ep)


def _presence(flag: bool) -> str:
    return "present" if flag else "absent"


def _result(name: str, detail: str, compared: int, mismatches: list[Mismatch]) -> CheckResult:
    return CheckResult(
        name=name,
        status="mismatch" if mismatches else "ok",
        detail=detail,
        compared=compared,
        mismatches=tuple(mismatches),
    )


def _skip(name: str, reason: str) -> CheckResult:
    return CheckResult(name=name, status="skipped", detail=reason)


def _bundled_decode(model: str, fam: grid.GridFamily, t: int, h: int, k: int, p: int) -> bool:
    return not grid._decode(_config(model, t, h, k, p), fam)


def _read(data_dir: Path | None, relative: str) -> str | None:
    if data_dir is None:
        return None
    path = data_dir / relative
    return path.read_text("utf-8", errors="replace") if path.is_file() else None


def _between(text: str, start: str, end: str) -> str:
    i = text.find(start)
    if i < 0:
        return ""
    j = text.find(end, i + len(start))
    return text[i:] if j < 0 else text[i:j]


def _statement_literals(text: str, anchor: str) -> list[str] | None:
    """String literals of the C++ statement starting at ``anchor`` (up to its ``;``)."""
    i = text.find(anchor)
    if i < 0:
        return None
    literals: list[str] = []
    for match in re.finditer(r'"((?:[^"\\]|\\.)*)"|;', text[i:]):
        if match.group(0) == ";":  # the statement's end (a ';' inside a literal is skipped)
            break
        literals.append(match.group(1))
    return literals


# ----------------------------------------------------------------------------- decode grid


def compare_decode_grid(fam: grid.GridFamily, sm: Any, mla: Any) -> CheckResult:
    """Compare the installed decode tables (module objects ``sm``/``mla``) with family ``fam``."""
    mismatches: list[Mismatch] = []
    compared = 0
    decode = fam.data["decode"]
    if fam.engine == "fixed_grid":
        for model, attr in (("DSV4", "_DECODE_DSV4_DISPATCH"), ("DSV3_2", "_DECODE_DSV3_2_DISPATCH")):
            bundled = {tuple(pair) for pair in decode[model]["pairs"]}
            table = getattr(sm, attr, None)
            if table is None:
                mismatches.append(Mismatch(attr, f"frozenset of {len(bundled)} pairs", "absent"))
                continue
            installed = {tuple(pair) for pair in table}
            for pair in sorted(bundled | installed):
                compared += 1
                if (pair in bundled) != (pair in installed):
                    mismatches.append(
                        Mismatch(
                            f"decode {model} (num_heads={pair[0]}, topk={pair[1]})",
                            _presence(pair in bundled),
                            _presence(pair in installed),
                        )
                    )
        constants = (
            ("_DECODE_DSV4_PAGE_BLOCK_SIZE", decode["DSV4"]["page_block_sizes"][0]),
            ("_DECODE_DSV3_2_PAGE_BLOCK_SIZE", decode["DSV3_2"]["page_block_sizes"][0]),
            ("_DECODE_MAX_TOKENS", decode["max_num_tokens"]),
        )
        for attr, want in constants:
            compared += 1
            got = getattr(sm, attr, "absent")
            if got != want:
                mismatches.append(Mismatch(attr, repr(want), repr(got)))
        return _result("decode_grid", f"{fam.label} frozensets and constants", compared, mismatches)

    configs = mla.supported_sparse_mla_sm120_configs()
    for model, attr, family_name in (
        ("DSV4", "_DECODE_DSV4_DISPATCH", "dsv4"),
        ("DSV3_2", "_DECODE_DSV3_2_DISPATCH", "dsv3_2"),
    ):
        d = decode[model]
        low, high = d["num_heads_range"]
        envelope = getattr(sm, attr, None)
        if envelope is None:
            mismatches.append(Mismatch(attr, "envelope", "absent"))
        else:
            for h in (0, *_PROBE_HEADS):
                for k in (0, *_PROBE_TOPKS):
                    compared += 1
                    want = low <= h <= high and k >= d["min_topk"]
                    got = (h, k) in envelope
                    if want != got:
                        mismatches.append(
                            Mismatch(
                                f"({h}, {k}) in {attr}",
                                str(want),
                                str(got),
                            )
                        )
            if fam.engine == "resolver":
                compared += 1
                want_iter = [(h, d["min_topk"]) for h in d["dedicated_num_heads"]]
                got_iter: object
                try:
                    got_iter = list(envelope)
                except TypeError as exc:
                    got_iter = f"not iterable ({exc})"
                if got_iter != want_iter:
                    mismatches.append(Mismatch(f"iter({attr})", str(want_iter), str(got_iter)))
        if fam.engine == "resolver":  # _policy._STATIC_DECODE_ENVELOPE[model_type]
            policy = getattr(sm, "_policy", None)
            table = getattr(policy, "_STATIC_DECODE_ENVELOPE", None)
            static = table.get(_MODEL_TYPE[model]) if isinstance(table, dict) else None
            if static is None:
                mismatches.append(
                    Mismatch(f"_policy._STATIC_DECODE_ENVELOPE[{_MODEL_TYPE[model]}]", "present", "absent")
                )
            else:
                for name, want in (
                    ("dedicated_heads", frozenset(d["dedicated_num_heads"])),
                    ("max_num_heads", high),
                    ("min_topk", d["min_topk"]),
                    ("page_block_size_is_runtime", d["page_block_sizes"] is None),
                ):
                    compared += 1
                    got = getattr(static, name, None)
                    if got != want:
                        mismatches.append(
                            Mismatch(
                                f"_policy._STATIC_DECODE_ENVELOPE[{_MODEL_TYPE[model]}].{name}",
                                repr(want),
                                repr(got),
                            )
                        )
        config = configs.get(family_name)
        if config is None:
            mismatches.append(
                Mismatch(f"supported_sparse_mla_sm120_configs()[{family_name!r}]", "present", "absent")
            )
            continue
        runtime_page = d["page_block_sizes"] is None
        fields = {
            "max_num_tokens": decode["max_num_tokens"],
            "min_topk": d["min_topk"],
            "max_num_heads": high,
            "topks": frozenset(d["calibrated_topks"]),
            "page_block_size_is_runtime": runtime_page,
        }
        if not runtime_page:
            fields["page_block_size"] = d["page_block_sizes"][0]
        for name, want in fields.items():
            compared += 1
            got = getattr(config, name, False if name == "page_block_size_is_runtime" else None)
            if got != want:
                mismatches.append(
                    Mismatch(
                        f"supported_sparse_mla_sm120_configs()[{family_name!r}].{name}",
                        repr(want),
                        repr(got),
                    )
                )
        for t in (1, 64, 65):
            for p in (32, 64, 128):
                for h in _PROBE_HEADS:
                    for k in _PROBE_TOPKS:
                        compared += 1
                        want = _bundled_decode(model, fam, t, h, k, p)
                        got = bool(config.supports_decode(h, k, num_tokens=t, page_block_size=p))
                        if want != got:
                            mismatches.append(
                                Mismatch(
                                    f"{family_name}.supports_decode(num_heads={h}, topk={k}, "
                                    f"num_tokens={t}, page_block_size={p})",
                                    str(want),
                                    str(got),
                                )
                            )
    return _result(
        "decode_grid",
        f"{fam.label} envelope membership and supported_sparse_mla_sm120_configs()",
        compared,
        mismatches,
    )


# ----------------------------------------------------------------------------- prefill grid

_CASE = r"case\s+(\d+):\s*\\?\s*"


def _parse_prefill_source(text: str) -> dict[str, Any]:
    """Prefill grids as written in a 0.6.x/0.7.0 ``sparse_mla_sm120_prefill.cu``."""
    single = _between(text, "inline bool dispatch_dsv4_single", "inline bool dispatch_dsv4_dual")
    dual = _between(text, "inline bool dispatch_dsv4_dual", "bool sparse_mla_prefill_dispatch")
    dual_regular = dual[dual.find("#define DISPATCH_DUAL_MG_CM"):] if dual else ""
    v32 = _between(text, "inline bool dispatch_v32", "inline bool dispatch_dsv4_single")
    v32_heads = {int(h) for h in re.findall(r"num_heads\s*==\s*(\d+)", v32)}
    v32_heads |= {int(h) for h in re.findall(r"num_heads\s*!=\s*(\d+)\)\s*return false", v32)}
    v32_heads |= {int(h) for h in re.findall(_CASE + r"DISPATCH_DSV3_2_MG", v32)}
    return {
        "DSV4.single.num_heads": sorted(
            {int(h) for h in re.findall(_CASE + r"DISPATCH_MG_CM\(CM,\s*\d+", single)}
        ),
        "DSV4.single.topk_numeric_route": {
            int(k): cm
            for k, cm in re.findall(
                r"topk\s*==\s*(\d+)\)\s*DISPATCH_BY_NH_CM\((\w+),\s*\d+\)", single
            )
        },
        "DSV4.dual.num_heads": sorted(
            {int(h) for h, _ in re.findall(_CASE + r"DISPATCH_DUAL_MG_CM\((\w+),", dual_regular)}
        ),
        "DSV4.dual.numeric_routes": sorted(
            {cm for _, cm in re.findall(_CASE + r"DISPATCH_DUAL_MG_CM\((\w+),", dual_regular)}
        ),
        "DSV4.dual.topk": sorted(
            {int(k) for k in re.findall(r"if \(topk != (\d+)\) return false;", dual_regular)}
        ),
        "DSV4.dual.extra_page_block_sizes": sorted(
            {
                int(p)
                for p in re.findall(
                    r"extra_page_block_size\s*==\s*(\d+)\)\s*\{\s*DISPATCH_BY_NH_PBSX", dual_regular
                )
            }
        ),
        "DSV3_2.single.topk": sorted(
            {int(k) for k in re.findall(r"if \(topk != (\d+)\) return false;", v32)}
        ),
        "DSV3_2.single.num_heads": sorted(v32_heads),
    }


def _bundled_prefill_source_view(fam: grid.GridFamily) -> dict[str, Any]:
    p = fam.data["prefill"]
    single, dual, v32 = p["DSV4"]["single"], p["DSV4"]["dual"], p["DSV3_2"]["single"]
    view: dict[str, Any] = {
        "DSV4.dual.extra_page_block_sizes": sorted(dual["extra_page_block_sizes"]),
    }
    if fam.engine == "fixed_grid":
        view.update(
            {
                "DSV4.single.num_heads": sorted(single["num_heads"]),
                "DSV4.single.topk_numeric_route": {
                    int(k): v for k, v in single["topk_numeric_route"].items()
                },
                "DSV4.dual.num_heads": sorted(dual["num_heads"]),
                "DSV4.dual.numeric_routes": sorted(set(dual["topk_numeric_route"].values())),
                "DSV4.dual.topk": sorted(int(k) for k in dual["topk_numeric_route"]),
                "DSV3_2.single.topk": sorted(int(k) for k in v32["topk_numeric_route"]),
                "DSV3_2.single.num_heads": sorted(v32["num_heads"]),
            }
        )
    else:
        view["DSV4.dual.num_heads"] = sorted(dual["num_heads"])
        view["DSV4.dual.numeric_routes"] = [dual["numeric_route"]]
    return view


def compare_prefill_grid(
    fam: grid.GridFamily, plan: Any = None, prefill_source: str | None = None
) -> CheckResult:
    """Compare the installed prefill grid with family ``fam``.

    Args:
        plan: the 0.7.0 module ``flashinfer.mla._sparse_mla_sm120_plan`` (planner family only).
        prefill_source: text of ``data/csrc/sparse_mla_sm120_prefill.cu`` (0.6.x, 0.7.0).
    """
    if fam.engine == "resolver":
        return _skip(
            "prefill_grid",
            f"{fam.label}: prefill eligibility comes from the compiled module "
            "(_policy._candidates -> query('candidates')); there is no pure-Python prefill "
            "table to read without JIT/AOT kernels",
        )
    mismatches: list[Mismatch] = []
    compared = 0
    detail = []
    if prefill_source is not None:
        parsed = _parse_prefill_source(prefill_source)
        bundled = _bundled_prefill_source_view(fam)
        for key, want in bundled.items():
            compared += 1
            got = parsed.get(key)
            if got != want:
                mismatches.append(
                    Mismatch(f"sparse_mla_sm120_prefill.cu {key}", repr(want), repr(got))
                )
        detail.append("C++ prefill dispatch source")
    if fam.engine == "planner":
        if plan is None:
            mismatches.append(Mismatch("_sparse_mla_sm120_plan", "importable", "absent"))
        else:
            compared += 1
            heads = frozenset(fam.data["prefill"]["DSV4"]["single"]["num_heads"])
            got_heads = getattr(plan, "_PREFILL_DSV4_HEADS", None)
            if got_heads != heads:
                mismatches.append(Mismatch("_PREFILL_DSV4_HEADS", repr(heads), repr(got_heads)))
            for model in ("DSV4", "DSV3_2"):
                for dual in (False, True):
                    for p in (32, 64, 128):
                        for h in _PROBE_HEADS:
                            for k in _PROBE_TOPKS:
                                compared += 1
                                cfg = _config(model, 65, h, k, p, *((512, 64) if dual else (0, 0)))
                                pf = grid._prefill(cfg, fam)
                                want = None if pf.reasons else pf.variant
                                got = plan.prefill_variant(_MODEL_TYPE[model], h, k, p, dual, 0)
                                got = None if got is None else int(got)
                                if want != got:
                                    mismatches.append(
                                        Mismatch(
                                            f"prefill_variant({model}, num_heads={h}, topk={k}, "
                                            f"page_block_size={p}, dual={dual})",
                                            repr(want),
                                            repr(got),
                                        )
                                    )
                                for t in (1, 64, 65):
                                    compared += 1
                                    extra = (512, 64) if dual else (0, 0)
                                    want_d = not grid._decode(_config(model, t, h, k, p, *extra), fam)
                                    got_d = bool(
                                        plan.decode_splitk_eligible(
                                            _MODEL_TYPE[model], h, k, p, dual, t
                                        )
                                    )
                                    if want_d != got_d:
                                        mismatches.append(
                                            Mismatch(
                                                f"decode_splitk_eligible({model}, num_heads={h}, "
                                                f"topk={k}, page_block_size={p}, dual={dual}, "
                                                f"num_tokens={t})",
                                                str(want_d),
                                                str(got_d),
                                            )
                                        )
            detail.append("_sparse_mla_sm120_plan predicates")
    if not detail:
        return _skip(
            "prefill_grid",
            f"{fam.label}: the prefill grid exists only in C++ and the wheel's "
            "data/csrc/sparse_mla_sm120_prefill.cu was not found",
        )
    return _result("prefill_grid", f"{fam.label} " + " + ".join(detail), compared, mismatches)


# ----------------------------------------------------------------------------- error texts


def _probe_configs(fam: grid.GridFamily) -> Iterator[Any]:
    for model in ("DSV4", "DSV3_2"):
        for t in (1, 5, 64, 65):
            for h in (8, 16, 24, 32, 64, 128, 200):
                for k in (100, 128, 192, 256, 512, 2048):
                    for p in (32, 64, 128):
                        yield _config(model, t, h, k, p)
                        yield _config(model, t, h, k, p, 512, 2)
                        if model == "DSV4":
                            yield _config(model, t, h, k, p, 512, 128)


def _cpp_prefill_from_source(literals: list[str], cfg: Any, variant: int | None) -> str:
    """Rebuild the C++ prefill text from its statement's literals (field labels in order)."""
    values = {
        "model": grid.MODELS[cfg.model].cpp,
        "num_heads": cfg.num_heads,
        "topk": cfg.topk,
        "page_block_size": cfg.page_block_size,
        "topk_extra": cfg.topk_extra,
        "extra_page_block_size": cfg.extra_page_block_size,
        "variant": variant,
    }
    prefix = next((s for s in literals if s.startswith("Unsupported")), "")
    text = prefix
    for literal in literals:
        match = re.fullmatch(r" ?(\w+)=", literal)
        if match and match.group(1) in values:
            text += literal + str(values[match.group(1)])
    return errors.tvm_check_failed("ok", text)


def compare_error_texts(
    fam: grid.GridFamily, sm: Any = None, sources: dict[str, str | None] | None = None
) -> CheckResult:
    """Compare our texts with the installed release's message builders and C++ sources.

    Args:
        sm: ``flashinfer.mla._sparse_mla_sm120`` (0.7.x: its ``_decode_dispatch_error_message``).
        sources: file name -> text for ``sparse_mla_sm120.cu`` (0.6.x/0.7.0) and
            ``sparse_mla_sm120/attention_validation.h`` plus ``all_csrc`` (0.7.1+).
    """
    sources = sources or {}
    mismatches: list[Mismatch] = []
    compared = 0
    detail = []
    configs = list(_probe_configs(fam))
    release = fam.examined[-1]
    orchestrator = sources.get("sparse_mla_sm120.cu")
    if fam.engine in ("fixed_grid", "planner") and orchestrator is not None:
        literals = _statement_literals(orchestrator, "TVM_FFI_ICHECK(ok)")
        if not literals:
            mismatches.append(Mismatch("sparse_mla_sm120.cu TVM_FFI_ICHECK(ok)", "present", "absent"))
        else:
            for cfg in configs:
                verdict = grid.supports(cfg, release)
                message = verdict.error_message or ""
                if "Unsupported sparse-MLA prefill configuration" not in message:
                    continue
                compared += 1
                variant = grid._prefill(cfg, fam).variant if fam.engine == "planner" else None
                want = _cpp_prefill_from_source(literals, cfg, variant)
                if want != message:
                    mismatches.append(Mismatch(f"C++ prefill text for {cfg.describe()}", message, want))
        if fam.decode_miss == "cpp_orchestrator":
            literals = _statement_literals(orchestrator, "TVM_FFI_ICHECK_GT(num_tokens, 64)")
            if not literals:
                mismatches.append(
                    Mismatch("sparse_mla_sm120.cu TVM_FFI_ICHECK_GT(num_tokens, 64)", "present", "absent")
                )
            else:
                for t in (1, 5, 7, 64):
                    compared += 1
                    want = errors.tvm_check_binary_failed(
                        "num_tokens", ">", "64", t, 64, "".join(literals) + str(t)
                    )
                    ours = errors.orchestrator_decode_message(t)
                    if want != ours:
                        mismatches.append(Mismatch(f"C++ decode-miss text T={t}", ours, want))
        detail.append("sparse_mla_sm120.cu TVM_FFI_ICHECK statements")
    if fam.engine in ("planner", "resolver") and sm is not None:
        builder = getattr(sm, "_decode_dispatch_error_message", None)
        if builder is None:
            mismatches.append(Mismatch("_decode_dispatch_error_message", "present", "absent"))
        else:
            for cfg in configs:
                verdict = grid.supports(cfg, release)
                message = verdict.error_message or ""
                if not message.startswith("SM120 sparse-MLA has no decode kernel"):
                    continue
                compared += 1
                got = builder(
                    num_tokens=cfg.num_tokens,
                    num_heads=cfg.num_heads,
                    topk=cfg.topk,
                    d_qk=cfg.d_qk,
                    page_block_size=cfg.page_block_size,
                    model_type=_MODEL_TYPE[cfg.model],
                    extra_topk=cfg.topk_extra,
                )
                if got != message:
                    mismatches.append(Mismatch(f"ValueError text for {cfg.describe()}", message, got))
            detail.append("_decode_dispatch_error_message")
    if fam.engine == "resolver":
        validation = sources.get("sparse_mla_sm120/attention_validation.h")
        if validation is not None:
            compared += 1
            match = re.search(
                r'TVM_FFI_ICHECK\((t > 0 && h > 0 && h <= [\w:]+)\)\s*<<\s*"unsupported tokens/heads"',
                validation,
            )
            got = (
                errors.tvm_check_failed(match.group(1), "unsupported tokens/heads")
                if match
                else "absent"
            )
            if got != errors.metadata_tokens_heads_message():
                mismatches.append(
                    Mismatch("attention_validation.h tokens/heads check", errors.metadata_tokens_heads_message(), got)
                )
            detail.append("attention_validation.h")
        all_csrc = sources.get("all_csrc")
        if all_csrc is not None:
            compared += 1
            if "Unsupported sparse-MLA prefill configuration" in all_csrc:
                mismatches.append(
                    Mismatch("C++ 'Unsupported sparse-MLA prefill configuration' text", "removed", "present")
                )
            detail.append("C++ prefill text absent")
    if not detail:
        return _skip("error_texts", f"{fam.label}: neither message builders nor C++ sources found")
    return _result("error_texts", f"{fam.label} " + " + ".join(detail), compared, mismatches)


# ----------------------------------------------------------------------------- routing probe


@contextlib.contextmanager
def _patched(module: Any, **attrs: Any) -> Iterator[None]:
    missing = object()
    saved = {name: getattr(module, name, missing) for name in attrs}
    try:
        for name, value in attrs.items():
            setattr(module, name, value)
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                delattr(module, name)
            else:
                setattr(module, name, value)


def compare_python_routing(fam: grid.GridFamily, sm: Any) -> CheckResult:
    """Run a 0.6.x release's own ``_paged_attention`` routing on CPU with stubbed kernels.

    The module builder and the decode entry points are replaced (and restored) for the duration;
    tensors are zero-storage ``expand`` views, so nothing is allocated or launched.
    """
    if fam.engine != "fixed_grid":
        return _skip(
            "python_routing",
            f"{fam.label}: routing is the planner/resolver, compared in decode_grid/prefill_grid",
        )
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return _skip("python_routing", "torch is not importable")
    getter = getattr(sm, "get_sparse_mla_sm120_module", None)
    if getter is None:
        return _result(
            "python_routing", fam.label, 1, [Mismatch("get_sparse_mla_sm120_module", "present", "absent")]
        )
    builder = getattr(getter, "__wrapped__", getter)  # bypass functools.cache: never cache stubs
    calls: list[str] = []

    class _Module:
        def sparse_mla_sm120_paged_attention(self, *args: Any, **kwargs: Any) -> None:
            calls.append("orchestrator")

    class _Gen:
        def build_and_load(self) -> _Module:
            return _Module()

    def decode_stub(*args: Any, **kwargs: Any) -> None:
        # Which decode kernel ran, and whether it was handed the extra cache (0.6.x DSV3.2 drops it).
        calls.append("decode" if kwargs.get("extra_kv_cache") is not None else "decode without extra cache")

    def zeros(*shape: int, dtype: Any) -> Any:
        return torch.zeros((), dtype=dtype).expand(*shape)

    mismatches: list[Mismatch] = []
    compared = 0
    release = fam.examined[-1]
    with _patched(
        sm,
        gen_sparse_mla_sm120_module=lambda *a, **k: _Gen(),
        sparse_mla_sm120_decode_dsv4=decode_stub,
        sparse_mla_sm120_decode_dsv3_2=decode_stub,
    ):
        paged_attention = builder().paged_attention
        for cfg in _probe_configs(fam):
            compared += 1
            bpt = 584 if cfg.model == "DSV4" else 656
            splits = -(-cfg.topk // 64) + -(-cfg.topk_extra // 64)
            q = zeros(cfg.num_tokens, cfg.num_heads, cfg.d_qk, dtype=torch.bfloat16)
            kv = zeros(2, cfg.page_block_size, bpt, dtype=torch.uint8)
            idx = zeros(cfg.num_tokens, cfg.topk, dtype=torch.int32)
            out = zeros(cfg.num_tokens, cfg.num_heads, 512, dtype=torch.bfloat16)
            lse = zeros(cfg.num_tokens, cfg.num_heads, dtype=torch.float32)
            ekv = eidx = None
            if cfg.dual:
                ekv = zeros(2, cfg.extra_page_block_size, bpt, dtype=torch.uint8)
                eidx = zeros(cfg.num_tokens, cfg.topk_extra, dtype=torch.int32)
            mid_out = zeros(cfg.num_tokens, cfg.num_heads, splits, 512, dtype=torch.bfloat16)
            mid_lse = zeros(cfg.num_tokens, cfg.num_heads, splits, dtype=torch.float32)
            calls.clear()
            try:
                paged_attention(
                    q, kv, idx, out, lse, 1.0, 512, _MODEL_TYPE[cfg.model],
                    None, None, ekv, eidx, None, mid_out, mid_lse,
                )  # fmt: skip
                got = calls[-1] if calls else "nothing"
            except ValueError as exc:
                got = f"ValueError: {exc}"
            verdict = grid.supports(cfg, release)
            if verdict.route == "decode":
                dropped = not cfg.dual or verdict.extra_cache_ignored
                want = "decode without extra cache" if dropped else "decode"
            elif verdict.error_type is errors.UnsupportedShapeError:
                want = f"ValueError: {verdict.error_message}"
            else:  # everything else reaches the C++ orchestrator
                want = "orchestrator"
            if want != got:
                mismatches.append(Mismatch(f"routing of {cfg.describe()}", want, got))
    return _result(
        "python_routing", f"{fam.label} _paged_attention with stubbed kernels", compared, mismatches
    )


# ----------------------------------------------------------------------------- tvm error type


def compare_tvm_error_type() -> CheckResult:
    """Check apache-tvm-ffi's ``Check failed`` formats and the Python type of ``InternalError``."""
    try:
        tvm_ffi = importlib.import_module("tvm_ffi")
    except Exception as exc:
        return _skip("tvm_error_type", f"apache-tvm-ffi does not import: {exc}")
    mismatches: list[Mismatch] = []
    compared = 0
    detail = []
    header = Path(str(tvm_ffi.__file__)).parent / "include" / "tvm" / "ffi" / "error.h"
    if header.is_file():
        text = header.read_text("utf-8", errors="replace")
        for fragment in (
            '"Check failed: (" #cond << ") is false: "',
            '"Check failed: " << #x " " #op " " #y << *__tvm_ffi_log_err << ": "',
            'os << " (" << x << " vs. " << y << ") ";',
            "#define TVM_FFI_ICHECK(x) TVM_FFI_CHECK(x, InternalError)",
        ):
            compared += 1
            if fragment not in text:
                mismatches.append(Mismatch(f"tvm/ffi/error.h fragment {fragment}", "present", "absent"))
        detail.append("include/tvm/ffi/error.h")
    raise_error = None
    with contextlib.suppress(Exception):
        raise_error = tvm_ffi.get_global_func("testing.test_raise_error", allow_missing=True)
    if raise_error is not None:
        message = errors.prefill_unsupported_message("DSV4", 8, 128, 64, 0, 0)
        compared += 1
        try:
            raise_error("InternalError", message)
            got = "no exception"
        except Exception as exc:
            got = f"{type(exc).__name__} (RuntimeError: {isinstance(exc, RuntimeError)}): {exc}"
        want = f"(RuntimeError: True): {message}"
        if not got.endswith(want):
            mismatches.append(Mismatch("Python type/text of a tvm-ffi InternalError", want, got))
        detail.append("testing.test_raise_error")
    if not detail:
        return _skip("tvm_error_type", "no tvm-ffi error.h header or testing function found")
    version = getattr(tvm_ffi, "__version__", "?")
    return _result("tvm_error_type", f"apache-tvm-ffi {version}: " + " + ".join(detail), compared, mismatches)


# ----------------------------------------------------------------------------- entry points


def _sources(installed: InstalledFlashInfer) -> dict[str, str | None]:
    data = installed.data_dir
    out: dict[str, str | None] = {
        "sparse_mla_sm120.cu": _read(data, "csrc/sparse_mla_sm120.cu"),
        "sparse_mla_sm120_prefill.cu": _read(data, "csrc/sparse_mla_sm120_prefill.cu"),
        "sparse_mla_sm120/attention_validation.h": _read(
            data, "csrc/sparse_mla_sm120/attention_validation.h"
        ),
    }
    if data is not None and installed.family.engine == "resolver":
        texts: Iterable[Path] = [
            path
            for folder in (data / "csrc", data / "include")
            for path in folder.rglob("*")
            if "sparse_mla" in str(path.relative_to(data)) and path.is_file()
        ]
        out["all_csrc"] = "\n".join(p.read_text("utf-8", errors="replace") for p in texts)
    return out


def run_check(name: str, installed: InstalledFlashInfer | None = None) -> CheckResult:
    """Run one check of :data:`CHECKS` against the installed FlashInfer.

    Raises:
        ValueError: unknown ``name``.
        IntrospectionUnavailable: see :func:`load_installed`.
    """
    if name not in CHECKS:
        raise ValueError(f"name={name!r}: expected one of {', '.join(CHECKS)}")
    if name == "tvm_error_type":
        return compare_tvm_error_type()
    installed = installed or load_installed()
    fam = installed.family
    if name == "decode_grid":
        return compare_decode_grid(fam, installed.sm, installed.mla)
    if name == "prefill_grid":
        return compare_prefill_grid(
            fam, installed.plan, _sources(installed)["sparse_mla_sm120_prefill.cu"]
        )
    if name == "error_texts":
        return compare_error_texts(fam, installed.sm, _sources(installed))
    return compare_python_routing(fam, installed.sm)


def run_all(installed: InstalledFlashInfer | None = None) -> list[CheckResult]:
    """Every check of :data:`CHECKS` (raises :class:`IntrospectionUnavailable` like
    :func:`load_installed`)."""
    installed = installed or load_installed()
    return [run_check(name, installed) for name in CHECKS]


def main(argv: list[str] | None = None) -> int:
    """Command line (module docstring); returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="append", choices=CHECKS, help="run this check only (repeatable)")
    parser.add_argument("--load-only", action="store_true", help="print the installed version and stop")
    args = parser.parse_args(argv)
    try:
        installed = load_installed()
    except IntrospectionUnavailable as exc:
        print(f"flashinfer_introspect: {exc}", file=sys.stderr)
        return 2
    print("flashinfer-python", installed.version, f"({installed.family.label} grid)")
    if args.load_only:
        return 0
    results = [run_check(name, installed) for name in args.check or CHECKS]
    for result in results:
        print(result.summary())
    return 1 if any(r.status == "mismatch" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
