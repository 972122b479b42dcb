"""FlashInfer SM120 sparse-MLA dispatch grids by release: ``supports()`` and ``enforce_grid()``.

Pure Python (no torch, no flashinfer). :func:`supports` judges a :class:`SparseMlaConfig` (counts in
tokens and heads) on a release and returns a :class:`Verdict`: ``route`` (:data:`ROUTES`) and
``numeric_route`` (:data:`NUMERIC_ROUTES`, FlashInfer's ``NumericRoute``), or the exact error type
and text that release raises. :func:`enforce_grid` raises that error (``InternalError``, a
``RuntimeError``, or ``UnsupportedShapeError``, a ``ValueError``; :mod:`.errors`).

The data is the package file ``dispatch/grids.json`` (one entry per release family); this module
holds each family's control flow (:attr:`GridFamily.engine`): ``fixed_grid`` (0.6.14-0.6.18: exact
instantiated decode pairs, else the C++ prefill-only orchestrator), ``planner`` (0.7.0: decode
envelope, then prefill, then ``ValueError``), ``resolver`` (0.7.1+: runtime page sizes). Models:
``DSV4``, ``DSV3_2``, ``DSV4_1`` (0.7.1+) and ``DSV4_1_INLINE`` (0.7.4+); an earlier release raises
``UnsupportedReleaseError``. Routing uses the primary index width ``topk`` only. The grid models the
backend below the public wrapper ``trtllm_batch_decode_sparse_mla_dsv4`` (whose DSV4 head check is
reported in :attr:`Verdict.notes`). Versions are compared with :mod:`packaging` only.

Sources: the flashinfer-python wheels 0.6.13-0.7.4 (``flashinfer/mla/_sparse_mla_sm120*.py``,
``flashinfer/data/csrc/sparse_mla_sm120*``; file paths per family in ``grids.json``),
flashinfer-ai/flashinfer PRs #3395, #4380, #4802. Each family's rules, the DeepSeek-V4.1 and
DeepSeek-V3.2-with-extra-cache cases, and how each family was checked:
``docs/design/flashinfer-dispatch.md``.
"""

from __future__ import annotations

import functools
import json
import warnings
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from typing import Any

from pytest_sparse_mla import formats
from pytest_sparse_mla.dispatch import errors

__all__ = [
    "MODELS",
    "ROUTES",
    "NUMERIC_ROUTES",
    "COMPUTE_MODES",
    "SparseMlaConfig",
    "GridFamily",
    "Verdict",
    "grid_data",
    "families",
    "parse_release",
    "check_known_release",
    "release_family",
    "supports",
    "enforce_grid",
    "inline_v41_model",
    "format_model",
]

#: route names a supported verdict carries.
ROUTES = ("decode", "prefill_single", "prefill_dual")
#: numeric routes of a supported prefill verdict (FlashInfer ``ComputeMode``, named ``NumericRoute``
#: from 0.7.1): which operands are BF16 and which FP8. Decode verdicts carry none.
NUMERIC_ROUTES = ("BF16", "FP8", "QkBF16PvFP8")
#: Deprecated alias of :data:`NUMERIC_ROUTES` (not an implementation's ``compute_mode``, which names a
#: tolerance profile: ``pytest_sparse_mla.tolerances.COMPUTE_MODES``).
COMPUTE_MODES = NUMERIC_ROUTES


@dataclass(frozen=True)
class _Model:
    cpp: str  # name in the C++ prefill text
    family: str  # name in the 0.7.x ValueError / supported_sparse_mla_sm120_configs()
    model_type: int  # integer printed by 0.6.18
    d_qk: int


#: model key -> how FlashInfer names it (``ModelType`` DSV3_2=0, DSV4=1, DSV4_1=5, DSV4_1_INLINE=6;
#: model_type.h). Which model judges a call of each attention call format is the format's entry in
#: ``formats.CALL_FORMATS`` (``grid_model``; :func:`format_model`).
MODELS: dict[str, _Model] = {
    "DSV4": _Model(cpp="DSV4", family="dsv4", model_type=1, d_qk=512),
    "DSV3_2": _Model(cpp="DSV3_2", family="dsv3_2", model_type=0, d_qk=576),
    "DSV4_1": _Model(cpp="DSV4_1", family="dsv4_1", model_type=5, d_qk=512),
    "DSV4_1_INLINE": _Model(cpp="DSV4_1_INLINE", family="dsv4_1_inline", model_type=6, d_qk=512),
}


def _normalize_model(model: object) -> str:
    if isinstance(model, str):
        key = model.strip().upper().replace(".", "_").replace("-", "_")
        if key in MODELS:
            return key
    raise ValueError(
        f"model={model!r}: expected 'DSV4' (DeepSeek-V4, d_qk=512), 'DSV3_2' "
        "(DeepSeek-V3.2, d_qk=576), 'DSV4_1' or 'DSV4_1_INLINE' (DeepSeek-V4.1 footer pages or "
        "inline records, d_qk=512)"
    )


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r}: expected an int >= {minimum}")
    if value < minimum:
        raise ValueError(f"{name}={value}: expected an int >= {minimum}")
    return value


@dataclass(frozen=True)
class SparseMlaConfig:
    """One SM120 sparse-MLA call shape, as FlashInfer's dispatch sees it.

    Attributes:
        model: ``"DSV4"`` (d_qk 512, 584 B/token), ``"DSV3_2"`` (d_qk 576, 656 B/token),
            ``"DSV4_1"`` or ``"DSV4_1_INLINE"`` (d_qk 512, 528 B/token SWA main cache in footer
            pages or inline records; extra cache 528 B or 288 B FP4); ``"dsv4"``, ``"DSV3.2"``,
            ``"dsv3_2"``, ``"DSV4.1"`` are accepted and normalised.
        num_tokens: flattened query rows ``T`` (decode is ``T <= 64``), >= 1.
        num_heads: query heads ``H`` on this rank, >= 1.
        topk: primary (SWA) index width, ``indices.shape[-1]``, >= 1. Routing uses this.
        page_block_size: tokens per page of the main cache, >= 1.
        topk_extra: extra (compressed) index width, ``extra_indices.shape[-1]``; 0 = single cache.
        extra_page_block_size: tokens per page of the extra cache; 0 = single cache. A DSV3_2
            config may have one: no release has a DSV3.2 dual-cache kernel, but 0.6.14-0.6.18
            accept the call on the DSV3.2 decode route and drop the extra cache
            (:attr:`Verdict.extra_cache_ignored`).

    Raises:
        ValueError: a field is not an int in range, or only one of ``topk_extra`` /
            ``extra_page_block_size`` is positive.
    """

    model: str
    num_tokens: int
    num_heads: int
    topk: int
    page_block_size: int
    topk_extra: int = 0
    extra_page_block_size: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", _normalize_model(self.model))
        _check_int("num_tokens", self.num_tokens, 1)
        _check_int("num_heads", self.num_heads, 1)
        _check_int("topk", self.topk, 1)
        _check_int("page_block_size", self.page_block_size, 1)
        _check_int("topk_extra", self.topk_extra, 0)
        _check_int("extra_page_block_size", self.extra_page_block_size, 0)
        if (self.topk_extra > 0) != (self.extra_page_block_size > 0):
            raise ValueError(
                f"topk_extra={self.topk_extra}, extra_page_block_size="
                f"{self.extra_page_block_size}: expected both 0 (single cache) or both "
                "positive (dual cache: extra_kv_cache + extra_indices)"
            )

    @property
    def dual(self) -> bool:
        """True when the call carries an extra (compressed) cache."""
        return self.topk_extra > 0

    @property
    def d_qk(self) -> int:
        """Query/key head dim of the model (512 DSV4 and DeepSeek-V4.1, 576 DSV3_2)."""
        return MODELS[self.model].d_qk

    def describe(self) -> str:
        """Short one-line form, e.g. ``DSV4 T=65 H=8 topk=128 page=64 extra=512@2``."""
        text = (
            f"{self.model} T={self.num_tokens} H={self.num_heads} topk={self.topk} "
            f"page={self.page_block_size}"
        )
        if self.dual:
            text += f" extra={self.topk_extra}@{self.extra_page_block_size}"
        return text


@dataclass(frozen=True)
class GridFamily:
    """One release family of ``grids.json`` (``name`` is its first release, e.g. ``"0.6.18"``).

    Attributes:
        name: first release of the family (``"0.6.14"``, ``"0.6.18"``, ``"0.7.0"``, ``"0.7.1"``).
        label: human label (``"0.6.14-0.6.17"``, ``"0.7.1+"``).
        specifier: the :mod:`packaging` specifier of the releases it covers.
        examined: releases whose sources were read.
        engine: ``"fixed_grid"``, ``"planner"`` or ``"resolver"`` (``docs/design/flashinfer-dispatch.md``).
    """

    name: str
    label: str
    specifier: str
    examined: tuple[str, ...]
    engine: str
    decode_miss: str
    data: dict[str, Any] = field(compare=False, hash=False, repr=False)


@dataclass(frozen=True)
class Verdict:
    """What a FlashInfer release does with one :class:`SparseMlaConfig`.

    Attributes:
        release: the version asked about (``"0.6.17"``).
        family: label of its release family (``"0.6.14-0.6.17"``).
        config: the config judged.
        supported: the release serves it.
        route: ``"decode"``, ``"prefill_single"`` or ``"prefill_dual"`` when supported, else
            ``None``.
        numeric_route: the prefill numeric route the release picks (:data:`NUMERIC_ROUTES`:
            ``"BF16"``, ``"FP8"``, ``"QkBF16PvFP8"``), ``None`` for decode or unsupported. The
            deprecated property :attr:`compute_mode` returns the same value.
        reason: why it is unsupported (human words), ``None`` when supported.
        error_type: the mirror class FlashInfer's error corresponds to
            (:class:`~pytest_sparse_mla.dispatch.errors.InternalError` or
            :class:`~pytest_sparse_mla.dispatch.errors.UnsupportedShapeError`), or ``None``.
        error_message: the exact upstream text, or ``None``.
        unchecked_page_size: supported only because 0.6.x prefill does not check the main page
            size (kernels compiled for 64; INFERRED silently mis-addressed).
        extra_cache_ignored: supported, but the release runs a kernel that does not read the
            extra cache it was given (DSV3.2 decode in 0.6.14-0.6.18): the extra cache, its
            indices and lengths are silently dropped.
        notes: caveats (public-wrapper head check, calibrated crossover, unexamined release...).
    """

    release: str
    family: str
    config: SparseMlaConfig
    supported: bool
    route: str | None = None
    numeric_route: str | None = None
    reason: str | None = None
    error_type: type[errors.SparseMlaGridError] | None = None
    error_message: str | None = None
    unchecked_page_size: bool = False
    extra_cache_ignored: bool = False
    notes: tuple[str, ...] = ()

    @property
    def compute_mode(self) -> str | None:
        """Deprecated alias of :attr:`numeric_route` (warns ``DeprecationWarning``): the name collided
        with an implementation's ``compute_mode``, a tolerance profile (``"exact"``, ``"bf16"``...)."""
        warnings.warn(
            "Verdict.compute_mode is deprecated: use Verdict.numeric_route (FlashInfer's NumericRoute)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.numeric_route

    @property
    def error(self) -> errors.SparseMlaGridError | None:
        """A fresh instance of the mirrored error (``None`` when supported)."""
        if self.error_type is None or self.error_message is None:
            return None
        return self.error_type(self.error_message, self.release, self.config)

    def raise_for_unsupported(self) -> Verdict:
        """Raise :attr:`error` when unsupported; return ``self`` otherwise."""
        error = self.error
        if error is not None:
            raise error
        return self

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``error_type`` as its upstream-facing class name)."""
        return {
            "release": self.release,
            "family": self.family,
            "config": asdict(self.config),
            "supported": self.supported,
            "route": self.route,
            "numeric_route": self.numeric_route,
            "reason": self.reason,
            "error_type": self.error_type.__name__ if self.error_type else None,
            "error_base": _builtin_base(self.error_type),
            "error_message": self.error_message,
            "unchecked_page_size": self.unchecked_page_size,
            "extra_cache_ignored": self.extra_cache_ignored,
            "notes": list(self.notes),
        }


def _builtin_base(error_type: type[BaseException] | None) -> str | None:
    if error_type is None:
        return None
    for base in (RuntimeError, ValueError):
        if issubclass(error_type, base):
            return base.__name__
    return None


# ----------------------------------------------------------------------------- data


@functools.cache
def grid_data() -> dict[str, Any]:
    """The parsed package file ``pytest_sparse_mla/dispatch/grids.json`` (cached; do not mutate)."""
    text = resources.files("pytest_sparse_mla.dispatch").joinpath("grids.json").read_text("utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


@functools.cache
def families() -> tuple[GridFamily, ...]:
    """Every release family, oldest first."""
    return tuple(
        GridFamily(
            name=entry["name"],
            label=entry["label"],
            specifier=entry["specifier"],
            examined=tuple(entry["examined"]),
            engine=entry["engine"],
            decode_miss=entry["decode_miss"],
            data=entry,
        )
        for entry in grid_data()["families"]
    )


_PREFIXES = ("flashinfer-python==", "flashinfer_python==", "flashinfer==")


@functools.lru_cache(maxsize=256)
def _release_text(release: str) -> str:
    return str(parse_release(release))


def _refused(release: object, why: str) -> errors.UnsupportedReleaseError:
    """``UnsupportedReleaseError("release=<release>: <why>")`` (a version object shown as its text)."""
    shown = release if isinstance(release, (str, int, float)) else str(release)
    return errors.UnsupportedReleaseError(f"release={shown!r}: {why}")


def parse_release(release: object) -> Any:
    """Parse a FlashInfer version: ``"0.6.17"``, ``"flashinfer==0.6.17"`` or a ``Version``.

    Returns:
        ``packaging.version.Version`` (local part kept; comparisons use the public part).

    Raises:
        UnsupportedReleaseError: not a version, a pre-/dev-release (0.6.18rc1 lacks PR #4380,
            rc2 has it, so a pre-release cannot be placed), or older than the first release
            with SM120 sparse MLA (0.6.14, flashinfer-ai/flashinfer PR #3395).
    """
    from packaging.version import InvalidVersion, Version

    if isinstance(release, Version):
        version = release
    elif not isinstance(release, str):
        raise _refused(release, "expected a version string such as '0.6.17' (a float cannot tell 0.6.17 from 0.617)")
    else:
        text = str(release).strip()
        for prefix in _PREFIXES:
            if text.lower().startswith(prefix):
                text = text[len(prefix):]
        try:
            version = Version(text)
        except InvalidVersion:
            raise _refused(
                release, "expected a flashinfer-python version such as '0.6.17' or 'flashinfer==0.7.2.post1'"
            ) from None
    if version.is_prerelease or version.is_devrelease:
        raise _refused(
            release, "pre-releases are not covered (0.6.18rc1 lacks flashinfer-ai/flashinfer PR #4380, 0.6.18rc2 "
            "has it); use a final release",
        )  # fmt: skip
    first = Version(grid_data()["first_release"])
    if Version(version.public) < first:
        raise _refused(
            release, f"flashinfer-python {version} has no SM120 sparse-MLA backend; the first release with it is "
            f"{first} ({grid_data()['first_release_note']})",
        )  # fmt: skip
    return version


def check_known_release(release: object) -> Any:
    """:func:`parse_release`, and refuse a release newer than the last one the grids were read
    from (``grids.json`` ``last_examined_release``): nothing is known about it.

    For user input that names a release to judge (``--sparse-mla-grid``, the
    ``sparse-mla-deployments --release`` option), so ``9.9`` is an error rather than a report on
    a release that does not exist. :func:`supports` itself stays lenient (it flags an unexamined
    release in :attr:`Verdict.notes`), so an installed newer FlashInfer can still be compared.

    Returns:
        ``packaging.version.Version``.

    Raises:
        UnsupportedReleaseError: as :func:`parse_release`, or newer than the last examined release.
    """
    from packaging.version import Version

    version = parse_release(release)
    last = Version(grid_data()["last_examined_release"])
    if Version(version.public) > last:
        raise _refused(
            release, f"flashinfer-python {version} is newer than the last release the bundled grids were read from "
            f"({last}); expected a release from {grid_data()['first_release']} to {last}",
        )  # fmt: skip
    return version


def release_family(release: object) -> GridFamily:
    """The :class:`GridFamily` of a FlashInfer version (see :func:`parse_release`).

    Raises:
        UnsupportedReleaseError: as :func:`parse_release`.
    """
    return _family_of(str(parse_release(release)))


@functools.lru_cache(maxsize=256)
def _family_of(release: str) -> GridFamily:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    version = Version(Version(release).public)
    for family in families():
        if version in SpecifierSet(family.specifier):
            return family
    raise _refused(release, f"no grid family covers flashinfer-python {version}")  # pragma: no cover


# ----------------------------------------------------------------------------- evaluation


@dataclass
class _Prefill:
    route: str
    numeric_route: str | None = None
    variant: int | None = None
    reasons: list[str] = field(default_factory=list)
    unchecked_page: bool = False
    extra_page_miss: str | None = None  # reason, when only the extra page size fails


def _sizes(values: list[int]) -> str:
    return ", ".join(str(v) for v in values)


def _decode(cfg: SparseMlaConfig, fam: GridFamily) -> list[str]:
    """Reasons the decode kernels cannot serve ``cfg`` (empty: decode serves it)."""
    data = fam.data["decode"]
    d = data[cfg.model]
    reasons = []
    if cfg.num_tokens > data["max_num_tokens"]:
        reasons.append(f"num_tokens={cfg.num_tokens} > {data['max_num_tokens']} is not decode")
    if cfg.dual and d.get("extra_cache") == "rejected":
        reasons.append(f"{cfg.model} decode has no dual-cache form (extra_kv_cache given)")
    pages = d["page_block_sizes"]
    if pages is not None and cfg.page_block_size not in pages:
        reasons.append(
            f"decode kernels are compiled for page_block_size {_sizes(pages)} only, "
            f"got {cfg.page_block_size}"
        )
    if "pairs" in d:
        pairs = {tuple(p) for p in d["pairs"]}
        if (cfg.num_heads, cfg.topk) not in pairs:
            topks = sorted(k for h, k in pairs if h == cfg.num_heads)
            heads = sorted({h for h, _ in pairs})
            where = (
                f"topk for num_heads={cfg.num_heads}: {_sizes(topks)}"
                if topks
                else f"num_heads: {_sizes(heads)}"
            )
            reasons.append(
                f"(num_heads={cfg.num_heads}, topk={cfg.topk}) is not an instantiated "
                f"{cfg.model} decode pair ({where})"
            )
    else:
        low, high = d["num_heads_range"]
        if not low <= cfg.num_heads <= high:
            reasons.append(f"num_heads={cfg.num_heads} outside the decode envelope [{low}, {high}]")
        if cfg.topk < d["min_topk"]:
            reasons.append(f"topk={cfg.topk} below the decode minimum {d['min_topk']}")
    return reasons


def _prefill_miss_message(cpp_model: str, cfg: SparseMlaConfig, variant: int | None = None) -> str:
    """The C++ prefill-miss text (``errors.prefill_unsupported_message``) for ``cfg``."""
    return errors.prefill_unsupported_message(
        cpp_model, cfg.num_heads, cfg.topk, cfg.page_block_size, cfg.topk_extra, cfg.extra_page_block_size,
        variant=variant,
    )


def _prefill(cfg: SparseMlaConfig, fam: GridFamily) -> _Prefill:
    data = fam.data["prefill"]
    p = data[cfg.model]
    kind = "dual" if cfg.dual else "single"
    out = _Prefill(route=f"prefill_{kind}")
    g = p.get(kind)
    if g is None:  # DSV3_2 with an extra cache: no dual-cache prefill kernel
        out.reasons.append(f"{cfg.model} has no dual-cache prefill (extra_kv_cache given)")
        return out
    if cfg.num_tokens < data["min_num_tokens"]:
        out.reasons.append(f"prefill serves num_tokens >= {data['min_num_tokens']} only")
    pages = p["page_block_sizes"]
    if pages is not None and cfg.page_block_size not in pages:
        if p["page_block_size_checked"]:
            out.reasons.append(
                f"prefill kernels require page_block_size {_sizes(pages)}, "
                f"got {cfg.page_block_size}"
            )
        else:
            out.unchecked_page = True
    if cfg.num_heads not in g["num_heads"]:
        out.reasons.append(
            f"{cfg.model} {kind}-cache prefill has no kernel for num_heads={cfg.num_heads} "
            f"(instantiated: {_sizes(g['num_heads'])})"
        )
    if "topk_numeric_route" in g:
        modes = g["topk_numeric_route"]
        out.numeric_route = modes.get(str(cfg.topk))
        if out.numeric_route is None:
            out.reasons.append(
                f"{cfg.model} {kind}-cache prefill has no kernel for topk={cfg.topk} "
                f"(instantiated: {_sizes([int(k) for k in modes])})"
            )
    else:
        multiple = g["topk_multiple_of"]
        if cfg.topk % multiple:
            out.reasons.append(
                f"prefill needs topk % {multiple} == 0 (whole index tiles), got topk={cfg.topk}"
            )
        threshold = g.get("numeric_route_threshold")
        if threshold is not None:
            le = threshold["le"]
            out.numeric_route = threshold["low"] if cfg.topk <= le else threshold["high"]
        else:
            out.numeric_route = g["numeric_route"]
    extra_pages = g.get("extra_page_block_sizes")
    if cfg.dual and extra_pages is not None and cfg.extra_page_block_size not in extra_pages:
        miss = (
            f"dual-cache prefill has no kernel for extra_page_block_size="
            f"{cfg.extra_page_block_size} (instantiated: {_sizes(extra_pages)})"
        )
        if g.get("extra_page_block_size_checked_by") == "cpp":
            out.extra_page_miss = miss
        else:
            out.reasons.append(miss)
    if "variant" in g:
        out.variant = g["variant"]
    elif "variant_by_heads" in g:
        out.variant = g["variant_by_heads"].get(str(cfg.num_heads))
    if out.reasons:
        out.numeric_route = None
    return out


def _mismatch_reasons(cfg: SparseMlaConfig, fam: GridFamily) -> list[str]:
    """The 0.7.x ``Mismatch:`` reasons (order: d_qk, page, topk, heads; d_qk/topk never apply)."""
    d = fam.data["decode"][cfg.model]
    reasons = []
    pages = d["page_block_sizes"]
    if pages is not None and cfg.page_block_size not in pages:
        reasons.append(errors.page_mismatch_reason(cfg.page_block_size, pages[0]))
    low, high = d["num_heads_range"]
    if not low <= cfg.num_heads <= high:
        reasons.append(errors.num_heads_mismatch_reason(cfg.num_heads, high))
    return reasons


@functools.lru_cache(maxsize=256)
def _unexamined_note(release: str) -> str | None:
    from packaging.version import Version

    fam = _family_of(release)
    version = Version(Version(release).public)
    if any(Version(v) == version for v in fam.examined):
        return None
    last = grid_data()["last_examined_release"]
    return (
        f"flashinfer-python {version} was not examined; assumed identical to the "
        f"{fam.label} family (examined: {', '.join(fam.examined)}; last examined: {last})"
    )


def _common_notes(cfg: SparseMlaConfig, fam: GridFamily, release: str) -> list[str]:
    notes = []
    unexamined = _unexamined_note(release)
    if unexamined is not None:
        notes.append(unexamined)
    if cfg.model == "DSV4" and cfg.num_heads not in (8, 16, 32, 64, 128):
        notes.append(
            "the public wrapper flashinfer.mla.trtllm_batch_decode_sparse_mla_dsv4 rejects this "
            "before dispatch: ValueError: "
            + errors.public_wrapper_num_heads_message(cfg.num_heads)
        )
    return notes


def _ignored_extra_cache_note(cfg: SparseMlaConfig, fam: GridFamily) -> str:
    return (
        f"{fam.label} runs this {cfg.model} decode call on the {cfg.model} decode kernel, which "
        f"takes no extra cache: extra_kv_cache, extra_indices and extra_topk_length "
        f"(topk_extra={cfg.topk_extra}) are silently ignored ({fam.data['decode'][cfg.model]['extra_cache_source']})"
    )


def _unchecked_page_note(cfg: SparseMlaConfig, fam: GridFamily) -> str:
    return (
        f"page_block_size={cfg.page_block_size} is not checked by {fam.label} prefill; "
        "its kernels are compiled for 64 and split indices with idx/64, idx%64 "
        "(INFERRED: silently mis-addressed, not rejected)"
    )


def _evaluate(cfg: SparseMlaConfig, fam: GridFamily, release: str) -> Verdict:
    model = MODELS[cfg.model]
    _check_model_release(cfg.model, release)
    alias = grid_data()["model_aliases"].get(cfg.model)
    if alias is not None:  # the same routes: judge under the alias, keep the model's own name in the text
        verdict = _evaluate(replace(cfg, model=alias), fam, release)
        message = verdict.error_message
        if message is not None:
            message = message.replace(
                f"model_type={MODELS[alias].family},", f"model_type={model.family},"
            )
        return replace(verdict, config=cfg, error_message=message)
    notes = _common_notes(cfg, fam, release)

    def ok(route: str, numeric_route: str | None, *, unchecked: bool = False) -> Verdict:
        extra = []
        if unchecked:
            extra.append(_unchecked_page_note(cfg, fam))
        ignored = route == "decode" and cfg.dual and fam.data["decode"][cfg.model].get("extra_cache") == "ignored"
        if ignored:
            extra.append(_ignored_extra_cache_note(cfg, fam))
        if fam.engine == "resolver" and cfg.model == "DSV4":
            odd = [
                name
                for name, size in (
                    ("page_block_size", cfg.page_block_size),
                    ("extra_page_block_size", cfg.extra_page_block_size),
                )
                if size and (584 * size) % 16
            ]
            if odd:
                extra.append(
                    f"{', '.join(odd)} odd: a densely packed page of 584-byte rows is not a "
                    "multiple of 16 bytes, so the cache needs a padded page stride "
                    "(attention_validation.h: block stride must be 16B-aligned)"
                )
        return Verdict(
            release=release,
            family=fam.label,
            config=cfg,
            supported=True,
            route=route,
            numeric_route=numeric_route,
            unchecked_page_size=unchecked,
            extra_cache_ignored=ignored,
            notes=tuple(notes + extra),
        )

    def fail(error_type: type[errors.SparseMlaGridError], message: str, reason: str) -> Verdict:
        return Verdict(
            release=release,
            family=fam.label,
            config=cfg,
            supported=False,
            reason=reason,
            error_type=error_type,
            error_message=message,
            notes=tuple(notes),
        )

    decode_reasons = _decode(cfg, fam)
    if fam.engine == "fixed_grid":
        if not decode_reasons:
            return ok("decode", None)
        decode_sized = cfg.num_tokens <= fam.data["decode"]["max_num_tokens"]
        if decode_sized and fam.decode_miss == "python_value_error":
            return fail(
                errors.UnsupportedShapeError,
                errors.no_decode_kernel_message(
                    cfg.num_tokens,
                    cfg.num_heads,
                    cfg.topk,
                    cfg.d_qk,
                    cfg.page_block_size,
                    model.model_type,
                    cfg.topk_extra,
                ),
                "decode: " + "; ".join(decode_reasons),
            )
        # The C++ prefill-only orchestrator (csrc/sparse_mla_sm120.cu), checks in source order.
        max_heads = fam.data["prefill"]["max_num_heads_checked"]
        if cfg.num_heads > max_heads:
            return fail(
                errors.InternalError,
                errors.orchestrator_num_heads_message(cfg.num_heads),
                f"num_heads={cfg.num_heads} > {max_heads} fails the orchestrator's head check",
            )
        if decode_sized:
            return fail(
                errors.InternalError,
                errors.orchestrator_decode_message(cfg.num_tokens),
                "decode: "
                + "; ".join(decode_reasons)
                + "; the decode-sized call falls through to the prefill-only orchestrator",
            )
        pf = _prefill(cfg, fam)
        if pf.reasons:
            return fail(
                errors.InternalError,
                _prefill_miss_message(model.cpp, cfg),
                f"{pf.route}: " + "; ".join(pf.reasons),
            )
        return ok(pf.route, pf.numeric_route, unchecked=pf.unchecked_page)

    if fam.engine == "resolver":
        max_heads = fam.data["metadata_max_num_heads"]
        if cfg.num_heads > max_heads:
            return fail(
                errors.UnsupportedShapeError,
                errors.metadata_tokens_heads_message(),
                f"num_heads={cfg.num_heads} > {max_heads} fails the C++ metadata check",
            )
    elif fam.engine != "planner":  # pragma: no cover - grids.json names only these engines
        raise ValueError(f"grids.json family {fam.name}: unknown engine {fam.engine!r}")

    pf = _prefill(cfg, fam)
    if not decode_reasons:
        verdict = ok("decode", None)
        if not pf.reasons:
            hazard = ""
            if pf.extra_page_miss:
                hazard = f", where it would fail ({pf.extra_page_miss})"
            verdict = replace(
                verdict,
                notes=verdict.notes
                + (
                    "decode-first by default; a calibrated decode/prefill crossover may "
                    f"route this call to {pf.route}{hazard}",
                ),
            )
        return verdict
    if not pf.reasons:
        if pf.extra_page_miss:
            return fail(
                errors.InternalError,
                _prefill_miss_message(model.cpp, cfg, pf.variant),
                f"{pf.route}: {pf.extra_page_miss} (checked only in C++; the planner picks "
                f"variant {pf.variant})",
            )
        return ok(pf.route, pf.numeric_route)
    return fail(
        errors.UnsupportedShapeError,
        errors.no_decode_kernel_mismatch_message(
            cfg.num_tokens,
            cfg.num_heads,
            cfg.topk,
            cfg.d_qk,
            cfg.page_block_size,
            model.family,
            cfg.topk_extra,
            _mismatch_reasons(cfg, fam),
        ),
        "decode: " + "; ".join(decode_reasons) + f"; {pf.route}: " + "; ".join(pf.reasons),
    )


def _check_model_release(model: str, release: str) -> None:
    from packaging.version import Version

    first = grid_data()["model_first_release"][model]
    if Version(Version(release).public) < Version(first):
        raise _refused(
            release, f"flashinfer-python {release} has no {model} cache format (ModelType::{model} first ships in "
            f"{first}: grids.json model_first_release_note)",
        )  # fmt: skip


def inline_v41_model(release: object) -> tuple[str, str | None]:
    """The model that judges a DeepSeek-V4.1 call whose caches hold inline records (codes then
    scales per token: this package's V4.1 formats, FlashInfer's ``pack_deepseek_v41_cache_reference``).

    Returns:
        ``("DSV4_1_INLINE", None)`` where the release reads inline records (0.7.4+), else
        ``("DSV4_1", note)``: the release reads footer pages only, and ``note`` says that a cache
        of inline records is misread unless every page holds one token (the two layouts are then
        the same bytes).

    Raises:
        UnsupportedReleaseError: as :func:`parse_release`, or a release before 0.7.1.
    """
    text = _release_text(release if isinstance(release, str) else str(release))
    _check_model_release("DSV4_1", text)
    try:
        _check_model_release("DSV4_1_INLINE", text)
    except errors.UnsupportedReleaseError:
        first = grid_data()["model_first_release"]["DSV4_1_INLINE"]
        return "DSV4_1", (
            f"flashinfer-python {text} reads DeepSeek-V4.1 pages in footer layout only (every token's "
            "codes, then every token's scales): a cache of inline records (codes then scales per "
            "token) is misread unless every page holds one token; inline records "
            f"(kv_scale_format='ue8m0_g32_inline') are read from {first}"
        )
    return "DSV4_1_INLINE", None


def format_model(fmt: str, release: object) -> tuple[str, str | None]:
    """The model (:data:`MODELS`) that judges an attention call of format ``fmt`` on ``release``:
    the format's ``grid_model`` in ``formats.CALL_FORMATS``; a ``"DSV4_1"`` one as
    :func:`inline_v41_model` says (this package's V4.1 caches hold inline records).

    Returns:
        ``(model, note)``: ``note`` is :func:`inline_v41_model`'s (a release that misreads inline
        records), else ``None``.

    Raises:
        ValueError: an unknown format, or one FlashInfer takes no call of (the entry's ``no_grid``).
        UnsupportedReleaseError: as :func:`inline_v41_model`, for a V4.1 format.
    """
    entry = formats.call_format(fmt)
    if entry.grid_model is None:
        raise ValueError(f"fmt={entry.name!r} (flashinfer-python {release}): {entry.no_grid}")
    if entry.grid_model == "DSV4_1":
        return inline_v41_model(release)
    return entry.grid_model, None


@functools.lru_cache(maxsize=8192)
def _cached(cfg: SparseMlaConfig, release: str) -> Verdict:
    return _evaluate(cfg, _family_of(release), release)


def supports(config: SparseMlaConfig, flashinfer_version: object) -> Verdict:
    """What FlashInfer ``flashinfer_version`` does with ``config`` on SM120/SM121.

    Args:
        config: the call shape.
        flashinfer_version: ``"0.6.17"``, ``"flashinfer==0.7.2.post1"`` or a ``Version``.

    Returns:
        A :class:`Verdict`: route and numeric route, or the reason and the exact error
        (type and text) that release raises. Never raises for an unsupported shape.

    Raises:
        TypeError: ``config`` is not a :class:`SparseMlaConfig`.
        UnsupportedReleaseError: the version has no SM120 sparse-MLA grid
            (see :func:`parse_release`), or none for ``config.model`` (``DSV4_1`` before 0.7.1,
            ``DSV4_1_INLINE`` before 0.7.4).
    """
    if not isinstance(config, SparseMlaConfig):
        raise TypeError(f"config={config!r}: expected a SparseMlaConfig")
    from packaging.version import Version

    if not isinstance(flashinfer_version, (str, Version)):
        parse_release(flashinfer_version)  # raises: a float cannot tell 0.6.17 from 0.617
    release = flashinfer_version if isinstance(flashinfer_version, str) else str(flashinfer_version)
    return _cached(config, _release_text(release))


def enforce_grid(
    release: str,
    *,
    model: str,
    num_tokens: int,
    num_heads: int,
    topk: int,
    page_block_size: int,
    topk_extra: int = 0,
    extra_page_block_size: int = 0,
) -> Verdict:
    """Raise what FlashInfer ``release`` raises for this shape, or return its :class:`Verdict`.

    Used by the bundled reference under ``--sparse-mla-grid flashinfer==X`` so serving code can
    test its fallbacks and padding on any machine.

    Args:
        release: FlashInfer version (``"0.6.17"`` or ``"flashinfer==0.6.17"``).
        model, num_tokens, num_heads, topk, page_block_size, topk_extra,
        extra_page_block_size: the fields of :class:`SparseMlaConfig` (counts in tokens/heads).

    Returns:
        The supported :class:`Verdict` (route, numeric route).

    Raises:
        InternalError: (a ``RuntimeError``) where the release fails a C++ ``TVM_FFI_ICHECK``.
        UnsupportedShapeError: (a ``ValueError``) where the release's Python dispatch raises.
        UnsupportedReleaseError: ``release`` has no SM120 sparse-MLA grid, or none for ``model``.
        ValueError: the fields are not a valid :class:`SparseMlaConfig`.

    Warns:
        UncheckedPageSizeWarning: 0.6.x prefill accepts a main page size other than 64 without
            checking it (the verdict is supported with ``unchecked_page_size=True``).
        IgnoredExtraCacheWarning: 0.6.14-0.6.18 run a DSV3.2 decode call with an extra cache on
            the DSV3.2 decode kernel, which drops the extra cache (``extra_cache_ignored=True``).
    """
    config = SparseMlaConfig(
        model=model,
        num_tokens=num_tokens,
        num_heads=num_heads,
        topk=topk,
        page_block_size=page_block_size,
        topk_extra=topk_extra,
        extra_page_block_size=extra_page_block_size,
    )
    verdict = supports(config, release).raise_for_unsupported()
    if verdict.unchecked_page_size:
        warnings.warn(
            errors.UncheckedPageSizeWarning(
                f"flashinfer-python {verdict.release}: {config.describe()}: "
                + _unchecked_page_note(config, release_family(verdict.release))
            ),
            stacklevel=2,
        )
    if verdict.extra_cache_ignored:
        warnings.warn(
            errors.IgnoredExtraCacheWarning(
                f"flashinfer-python {verdict.release}: {config.describe()}: "
                + _ignored_extra_cache_note(config, release_family(verdict.release))
            ),
            stacklevel=2,
        )
    return verdict
