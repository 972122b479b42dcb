"""The registry of implementations and ``--sparse-mla-impl`` resolution (the plugin layer: it
takes a ``pytest.Config`` and raises ``pytest.UsageError``), and the check of what it resolves (a
capability provided, an ``envelope`` attribute that is an Envelope: :func:`declared_envelope`,
which the guard and the fixtures read too). The built-ins are the entries of
``catalogue`` (name, adapter class); the adapters themselves live in their own
modules, one per adapter, and import no pytest; the protocol is in ``implementations.__init__`` and
``implementations.protocol``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from pytest_sparse_mla import capabilities, catalogue, options
from pytest_sparse_mla.envelope import Envelope

# The public names are exported by the package (``pytest_sparse_mla.implementations.__all__``).

#: capabilities an implementation may provide.
CAPABILITIES: tuple[str, ...] = ("pack", "page_split", "sparse_mla_forward")
NEEDS_MARKER = "sparse_mla_needs"
_IMPL_KEY = pytest.StashKey[Any]()


def _factory(entry: catalogue.Builtin) -> Callable[[pytest.Config], Any]:
    """Factory of ``entry``'s adapter class (its module imported on first use); a class that
    ``takes_grid`` gets the session's ``--sparse-mla-grid`` release."""

    def make(config: pytest.Config) -> Any:
        adapter = getattr(importlib.import_module(entry.module), entry.attribute)
        return adapter(options.get_options(config).grid) if entry.takes_grid else adapter()

    return make


#: built-in name -> factory(config), one per entry of ``catalogue.BUILTINS``, in its
#: order (``options.BUILTIN_NAMES`` reads the same table for ``--help``).
BUILTINS: dict[str, Callable[[pytest.Config], Any]] = {entry.name: _factory(entry) for entry in catalogue.BUILTINS}


if TYPE_CHECKING:  # the built-ins type-check against the protocol (mypy --strict, lint lane)
    from pytest_sparse_mla.implementations.builtin import ReferenceImplementation, TritonImplementation
    from pytest_sparse_mla.implementations.flashinfer import FlashInferImplementation
    from pytest_sparse_mla.implementations.protocol import SparseMlaForward, SparseMlaImplementation

    _REFERENCE: SparseMlaImplementation = ReferenceImplementation()
    _TRITON: SparseMlaImplementation = TritonImplementation()
    _FLASHINFER: SparseMlaForward = FlashInferImplementation()


def available_implementations(config: pytest.Config) -> dict[str, Any]:
    """Selectable names -> built-in factory or registered object (hook names override built-ins).

    Raises:
        pytest.UsageError: a hook returned something other than a dict with str keys.
    """
    names: dict[str, Any] = dict(BUILTINS)
    hook = getattr(config.hook, "pytest_sparse_mla_implementations", None)
    if hook is None:
        return names
    for result in reversed(hook(config=config)):
        if result is None:
            continue
        if not isinstance(result, dict) or not all(isinstance(k, str) for k in result):
            raise pytest.UsageError(
                f"pytest_sparse_mla_implementations returned {type(result).__name__}: expected a "
                "dict {name: implementation}"
            )
        names.update(result)
    return names


def _raised_at(exc: BaseException) -> str:
    """``", at FILE:LINE"``: the last frame of ``exc``'s traceback outside Python's import machinery
    (the line of the implementation's module that raised), or ``""``."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<frozen ")]
    frames = [f for f in frames if not f.filename.endswith(("importlib/__init__.py", "implementations/locate.py"))]
    return f", at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def _import_object(spec: str, config: pytest.Config | None = None) -> Any:
    """Import ``module[:attribute]`` (from ``sys.path``, else from ``locate.search_dirs``).

    Raises:
        locate.ModuleMissing: the module exists nowhere (the caller lists every form).
        pytest.UsageError: it failed to import (an ``ImportError``, or any exception its own code
            raised while it was imported: named with the file and line), or has no such attribute.
    """
    from pytest_sparse_mla.implementations import locate

    module_name, _, attribute = spec.partition(":")
    if not locate.is_module_path(module_name):
        raise locate.ModuleMissing(f"{module_name!r} is not a module path", name=module_name)
    try:
        obj: Any = locate.import_module(module_name, locate.search_dirs(config) if config is not None else [])
    except locate.ModuleMissing:
        raise
    except ImportError as exc:
        file_hint = locate.file_name_hint(module_name)
        hint = f"; {file_hint}" if file_hint else ""
        raise pytest.UsageError(
            f"--sparse-mla-impl={spec!r}: cannot import module {module_name!r} ({exc}{_raised_at(exc)}){hint}"
        ) from None
    except Exception as exc:  # the module's own code failed while it was imported
        raise pytest.UsageError(
            f"--sparse-mla-impl={spec!r}: importing module {module_name!r} raised "
            f"{type(exc).__name__}: {exc}{_raised_at(exc)}"
        ) from None
    parents = [module_name]
    for part in attribute.split(".") if attribute else ():
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise pytest.UsageError(
                f"--sparse-mla-impl={spec!r}: module {module_name!r} has no attribute {attribute!r}"
                + _attribute_hint(obj, part, ":".join([module_name, ".".join(parents[1:] + [""])]).rstrip("."))
            ) from None
        parents.append(part)
    if isinstance(obj, type):
        obj = obj()
    return obj


def _attribute_hint(owner: Any, missing: str, prefix: str) -> str:
    """``"; did you mean --sparse-mla-impl=PREFIX:NAME?"`` for the public names of ``owner`` closest
    to ``missing`` (case ignored: ``Mykernel`` finds ``MyKernel``; ``difflib.get_close_matches``), else
    the names in ``owner`` that provide a capability, else ``""``."""
    import difflib

    names = [name for name in dir(owner) if not name.startswith("_")]
    by_lower = {name.lower(): name for name in names}
    close = [by_lower[n] for n in difflib.get_close_matches(missing.lower(), list(by_lower), n=3, cutoff=0.6)]
    if not close:
        close = [n for n in names if any(callable(getattr(getattr(owner, n, None), cap, None)) for cap in CAPABILITIES)]
    sep = "" if prefix.endswith(":") else "."
    return (
        ("; did you mean " + " or ".join(f"--sparse-mla-impl={prefix}{sep}{n}" for n in close[:3]) + "?")
        if close
        else ""
    )


def implementation_name(impl: Any, default: str = "") -> str:
    """``impl.name`` if it is a string, else ``default``."""
    name = getattr(impl, "name", None)
    return name if isinstance(name, str) and name else default


def _check_provides_something(impl: Any, spec: str) -> None:
    from pytest_sparse_mla.implementations.protocol import CAPABILITY_PROTOCOLS

    provided = [
        cap for cap, proto in CAPABILITY_PROTOCOLS.items() if isinstance(impl, proto) and callable(getattr(impl, cap))
    ]
    if not provided:
        import types

        hint = ""
        if isinstance(impl, types.ModuleType):  # the module itself was selected: name what is in it
            found = [
                name for name, obj in vars(impl).items()
                if not name.startswith("_") and any(callable(getattr(obj, cap, None)) for cap in CAPABILITIES)
            ]  # fmt: skip
            if found:
                hint = "; did you mean " + " or ".join(f"--sparse-mla-impl={spec}:{name}" for name in found[:3]) + "?"
        raise pytest.UsageError(
            f"--sparse-mla-impl={spec!r}: {impl!r} provides none of {', '.join(CAPABILITIES)} "
            f"(see pytest_sparse_mla.implementations for the protocol){hint}"
        )


def declared_envelope(impl: Any) -> Envelope | None:
    """``impl.envelope`` if it declares one, else ``None``.

    Raises:
        pytest.UsageError: ``envelope`` is set but is not a :class:`pytest_sparse_mla.Envelope`.
    """
    env = getattr(impl, "envelope", None)
    if env is None:
        return None
    if not isinstance(env, Envelope):
        kind = type(env)
        kind_name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        raise pytest.UsageError(
            f"implementation {getattr(impl, 'name', impl)!r}: its envelope attribute is a {kind_name} "
            f"({env!r}): expected a pytest_sparse_mla.Envelope (from pytest_sparse_mla import Envelope), "
            "or None (no envelope: every call)"
        )
    return env


def _check_envelope(impl: Any, spec: str) -> None:
    """An ``envelope`` attribute that is not a :class:`pytest_sparse_mla.Envelope` is one usage error
    while the session configures, not an error in every test that asks for the implementation.

    Raises:
        pytest.UsageError: as :func:`declared_envelope`, naming ``spec`` too.
    """
    try:
        declared_envelope(impl)
    except pytest.UsageError as exc:
        raise pytest.UsageError(f"--sparse-mla-impl={spec!r}: {exc}") from None


def resolve_implementation(spec: str, config: pytest.Config) -> Any:
    """The implementation named by ``spec`` (a registered name or an import string).

    Raises:
        pytest.UsageError: unknown name (the message lists the valid ones), an import string that
            does not import, an object that provides no capability, or an ``envelope`` attribute
            that is not a :class:`pytest_sparse_mla.Envelope`.
    """
    from pytest_sparse_mla import entry_points
    from pytest_sparse_mla.implementations import locate

    names = available_implementations(config)
    if spec in names:
        entry = names[spec]
        impl = entry(config) if spec in BUILTINS and entry is BUILTINS[spec] else entry
        if isinstance(impl, str):
            try:
                impl = _import_object(impl)
            except locate.ModuleMissing as exc:
                raise pytest.UsageError(f"--sparse-mla-impl={spec!r}: {impl!r} does not import ({exc})") from None
    else:
        try:
            impl = _import_object(spec, config)
        except locate.ModuleMissing:
            declared = set(entry_points.entry_point_specs())
            raise pytest.UsageError(
                locate.miss_message(
                    spec,
                    builtins=BUILTINS,
                    entry_points=declared,
                    hook_names=set(names) - set(BUILTINS) - declared,
                    dirs=locate.search_dirs(config),
                )
            ) from None
    _check_provides_something(impl, spec)
    _check_envelope(impl, spec)
    return impl


def get_implementation(config: pytest.Config) -> Any:
    """The session's implementation under test (``--sparse-mla-impl``), resolved once and cached.

    Raises:
        pytest.UsageError: as :func:`resolve_implementation`.
    """
    impl = config.stash.get(_IMPL_KEY, None)
    if impl is None:
        impl = resolve_implementation(options.get_options(config).impl, config)
        config.stash[_IMPL_KEY] = impl
    return impl


def needs_of(node: Any) -> tuple[str, ...]:
    """Capabilities named by every ``sparse_mla_needs`` marker on ``node`` (in order, unique).

    Raises:
        pytest.UsageError: a marker names an unknown capability.
    """
    needs: list[str] = []
    for mark in node.iter_markers(NEEDS_MARKER):
        for cap in mark.args:
            if cap not in CAPABILITIES:
                raise pytest.UsageError(
                    f"{node.nodeid}: sparse_mla_needs({cap!r}): unknown capability; expected "
                    f"one of {', '.join(CAPABILITIES)}"
                )
            if cap not in needs:
                needs.append(cap)
    return tuple(needs)


def skip_reason_for(impl: Any, needs: tuple[str, ...], device: str) -> str | None:
    """Why ``impl`` cannot serve ``needs`` on ``device``, or ``None``.

    A capability is missing when the attribute is absent or not callable; otherwise the
    implementation's optional ``skip_reason(capability, device)`` is asked.
    """
    for cap in needs:
        reason = None
        if not callable(getattr(impl, cap, None)):
            reason = f"does not provide {cap!r} (sparse_mla_needs)"
        elif callable(ask := getattr(impl, "skip_reason", None)) and (why := ask(cap, device)):
            reason = f"cannot run {cap!r}: {why}"
        if reason is not None:  # the name (possibly a costly repr) is read only for a reason given
            return f"implementation {implementation_name(impl, repr(impl))!r} {reason}"
    return None


def session_device(config: pytest.Config) -> str:
    """``"cuda"`` or ``"cpu"``: where the suites run (``--sparse-mla-device``, ``auto`` = CUDA
    when torch sees one), as the ``sparse_mla_device`` fixture decides."""
    wanted = options.get_options(config).device
    if wanted == "cpu":
        return "cpu"
    if wanted == "cuda":
        return "cuda"
    return "cuda" if capabilities.probe().cuda_available else "cpu"


def configure(config: pytest.Config) -> None:
    """Resolve ``--sparse-mla-impl`` now (from ``pytest_configure``), so a bad value is a usage
    error before any test runs and before pytest-xdist starts workers. Hook implementations must
    therefore live in a plugin or an initial (rootdir / test-path) ``conftest.py``; a local module
    is looked for in the folders of ``locate.search_dirs``."""
    get_implementation(config)


def skip_unservable(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip items whose ``sparse_mla_needs`` the implementation cannot serve (from
    ``pytest_collection_modifyitems``)."""
    needing = [
        item
        for item in items
        if item.get_closest_marker(NEEDS_MARKER) is not None or "sparse_mla_impl" in getattr(item, "fixturenames", ())
    ]
    if not needing and not options.get_options(config).impl_given:
        return
    impl = get_implementation(config)
    device = session_device(config)
    for item in needing:
        reason = skip_reason_for(impl, needs_of(item), device)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
