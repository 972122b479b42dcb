"""Executing a peer's source file without importing its package, and finding it.

Standard library only, and self-contained on purpose: :mod:`pytest_sparse_mla.repro` copies these
functions' source (``inspect.getsource``) into the standalone reproducer scripts it writes, which
must run with torch and the peer alone. The adapters (``flaggems``, ``vllm_triton``,
``flashinfer_reference``) call the same functions, so a script loads the peer exactly as the suite did.
"""

from __future__ import annotations

from typing import Any

__all__ = ["exec_source", "find_source", "stubbed", "stubs_for"]


def find_source(package: str, path: str) -> Any:
    """``<package dir>/<path>`` for the first ``package`` directory on ``sys.path`` holding ``path``
    (``importlib.util.find_spec``: the package is not imported), or ``None``."""
    import importlib.util
    from pathlib import Path

    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(location) / path
        if candidate.is_file():
            return candidate
    return None


def stubs_for(kind: Any) -> dict[str, dict[str, Any]]:
    """The stand-ins a peer's file gets for its package's imports while it executes.

    ``"flaggems"``: ``flag_gems.utils.triton_version_utils.has_triton_tle`` answering ``False`` (the
    FlagTree-only paths off). ``"vllm"``: ``vllm.triton_utils`` as Triton itself (``triton``, ``tl``)
    and vLLM's two constants ``LOG2E``, ``LOGE2`` (``vllm/triton_utils/__init__.py``). ``"sglang"``:
    the three ``sglang.srt`` names ``flash_mla_sm120.py`` reads (``environ.envs`` with
    ``SGLANG_SM120_FLASHMLA_BACKEND.get() == "torch"``, ``utils.is_hip() == False``,
    ``runtime_context.get_resources`` with an empty ``buffers`` dict: the adapter binds the
    caller's registry instead). ``"sglang-kernels"``: for the files under SGLang's
    ``kernels/ops/attention/`` that import other kernel files of the wheel by absolute name
    (``dsv4/triton_sparse_decode/``, ``dsv4/tilelang_fp8_attention.py``, ``dsa/*.py``): the packages
    ``sglang.kernels``, ``.ops``, ``.ops.attention``, ``.attention.dsa`` and ``.attention.dsv4`` as
    empty stand-ins whose ``__path__`` is the installed directory (their files load from the wheel,
    their ``__init__.py`` never runs), and the four SGLang platform queries those files read, each
    answering as SGLang 0.5.23 does on a CUDA build (``python/sglang/srt/utils/common.py``,
    ``kernels/ops/quantization/fp8_kernel.py``): ``srt.utils.is_hip``, ``is_gfx95_supported``,
    ``common.is_gfx942_supported`` (``False``), ``fp8_kernel.is_fp8_fnuz`` (``False``), and
    ``srt.utils.get_device_core_count(i)`` (the CUDA device's multiprocessor count, 0 without CUDA).
    ``"sglang-q8kv8"``: the ``"sglang-kernels"`` stand-ins, plus what
    ``kernels/ops/attention/sparse_mla_q8kv8_prefill_sm90.py`` and the wheel's JIT build code
    (``kernels/jit/utils/``, which runs from the wheel: ``load_jit``, its ``build.ninja``, its cache)
    import from ``sglang.srt``: ``srt.environ.envs`` with the eight ``SGLANG_JIT_*`` /
    ``SGLANG_CRASH_ON_JIT_COMPILE`` / ``SGLANG_SAIL_GPU_ARCH`` fields those files read, each ``.get()``
    reading the environment variable with SGLang 0.5.23's default (``python/sglang/srt/environ.py``
    lines 1397-1426); ``srt.utils.common.is_cuda`` (as SGLang: CUDA available and a CUDA torch);
    ``srt.utils.custom_op.register_custom_op`` as the identity decorator (SGLang's registers the
    function as a ``torch.library`` op of namespace ``sglang`` whose CUDA implementation is the
    function itself, for ``torch.compile``; an eager call runs the function, directly or through
    that op: ``srt/utils/custom_op.py`` ``_call_directly_in_eager``, ``srt/utils/common.py``
    ``direct_register_custom_op``). And the one place a device run
    points the build at its CUTLASS: ``sglang.kernels.jit.utils.deps`` is the wheel's ``deps.py``
    (executed as ``_sparse_mla_sglang_jit_deps``), except that its ``"cutlass"`` dependency answers
    the directories of ``SPARSE_MLA_SGLANG_CUTLASS`` (``os.pathsep``-separated) when that variable
    is set (``scripts/peers_env.sh``: FlashMLA's CUTLASS) and SGLang's own lookup (FlashInfer's or
    DeepGEMM's bundled headers) otherwise.
    ``None``: none.

    Raises:
        ValueError: another ``kind``.
    """
    import math
    import types

    if kind is None:
        return {}
    if kind == "sglang":
        resources = types.SimpleNamespace(buffers={})  # the split's persistent buffers (a fresh dict)

        def get_resources() -> Any:
            return resources

        backend = types.SimpleNamespace(get=lambda: "torch")
        return {
            "sglang": {},
            "sglang.srt": {},
            "sglang.srt.environ": {"envs": types.SimpleNamespace(SGLANG_SM120_FLASHMLA_BACKEND=backend)},
            "sglang.srt.utils": {"is_hip": lambda: False},
            "sglang.srt.runtime_context": {"get_resources": get_resources},
        }
    if kind == "sglang-kernels":
        anchor = find_source("sglang", "kernels/ops/attention/dsa/triton_sparse_mla.py")
        if anchor is None:
            raise ImportError("sglang/kernels/ops/attention/dsa/triton_sparse_mla.py is not on sys.path")
        attention = anchor.parent.parent

        def get_device_core_count(device_id: int = 0) -> int:
            import torch

            return torch.cuda.get_device_properties(device_id).multi_processor_count if torch.cuda.is_available() else 0

        def no() -> bool:
            return False

        return {
            "sglang": {"__path__": []},
            "sglang.kernels": {"__path__": [str(attention.parent.parent)]},
            "sglang.kernels.ops": {"__path__": [str(attention.parent)]},
            "sglang.kernels.ops.attention": {"__path__": [str(attention)]},
            "sglang.kernels.ops.attention.dsa": {"__path__": [str(attention / "dsa")]},
            "sglang.kernels.ops.attention.dsv4": {"__path__": [str(attention / "dsv4")]},
            "sglang.kernels.ops.quantization": {},
            "sglang.kernels.ops.quantization.fp8_kernel": {"is_fp8_fnuz": no},
            "sglang.srt": {},
            "sglang.srt.utils": {
                "is_hip": no, "is_gfx95_supported": no, "get_device_core_count": get_device_core_count,
            },
            "sglang.srt.utils.common": {"is_gfx942_supported": no},
        }  # fmt: skip
    if kind == "sglang-q8kv8":
        import os

        stubs = stubs_for("sglang-kernels")
        deps_file = find_source("sglang", "kernels/jit/utils/deps.py")
        if deps_file is None:
            raise ImportError("sglang/kernels/jit/utils/deps.py is not on sys.path")

        def env(name: str, default: Any, parse: Any) -> Any:
            def get() -> Any:
                value = os.environ.get(name)
                return default if value is None else parse(value)

            return types.SimpleNamespace(get=get)

        def flag(value: str) -> bool:
            return value.lower() in ("true", "1", "yes", "y")

        envs = types.SimpleNamespace(
            SGLANG_JIT_CACHE_DIR=env("SGLANG_JIT_CACHE_DIR", None, str),
            SGLANG_JIT_CACHE_DEBUG=env("SGLANG_JIT_CACHE_DEBUG", False, flag),
            SGLANG_JIT_CACHE_KEEP=env("SGLANG_JIT_CACHE_KEEP", None, int),
            SGLANG_JIT_FORCE_RECOMPILE=env("SGLANG_JIT_FORCE_RECOMPILE", False, flag),
            SGLANG_CRASH_ON_JIT_COMPILE=env("SGLANG_CRASH_ON_JIT_COMPILE", False, flag),
            SGLANG_JIT_LOG_RESOURCE_USAGE=env("SGLANG_JIT_LOG_RESOURCE_USAGE", False, flag),
            SGLANG_SAIL_GPU_ARCH=env("SGLANG_SAIL_GPU_ARCH", "native", str),
            SGLANG_JIT_KERNEL_RUN_FULL_TESTS=env("SGLANG_JIT_KERNEL_RUN_FULL_TESTS", False, flag),
        )
        deps = exec_source("_sparse_mla_sglang_jit_deps", deps_file, {})
        registered = dict(deps.REGISTERED_DEPENDENCIES)
        sglang_cutlass = registered["cutlass"]

        def cutlass() -> list[str]:
            carried = os.environ.get("SPARSE_MLA_SGLANG_CUTLASS")
            return [p for p in carried.split(os.pathsep) if p] if carried else sglang_cutlass()

        registered["cutlass"] = cutlass

        def is_cuda() -> bool:
            import torch

            return torch.cuda.is_available() and torch.version.cuda is not None

        def register_custom_op(fn: Any = None, **kwargs: Any) -> Any:
            return fn if fn is not None else (lambda f: f)

        stubs["sglang.srt.environ"] = {"envs": envs}
        stubs["sglang.srt.utils.common"] = {**stubs["sglang.srt.utils.common"], "is_cuda": is_cuda}
        stubs["sglang.srt.utils.custom_op"] = {"register_custom_op": register_custom_op}
        stubs["sglang.kernels.jit.utils.deps"] = {
            "REGISTERED_DEPENDENCIES": registered, "register_dependency": deps.register_dependency,
        }  # fmt: skip
        return stubs
    if kind == "flaggems":
        return {
            "flag_gems": {},
            "flag_gems.utils": {},
            "flag_gems.utils.triton_version_utils": {"has_triton_tle": lambda *args, **kwargs: False},
        }
    if kind == "vllm":
        import triton
        import triton.language as tl

        return {
            "vllm": {},
            "vllm.triton_utils": {"LOG2E": math.log2(math.e), "LOGE2": math.log(2.0), "tl": tl, "triton": triton},
        }
    raise ValueError(
        f"stubs_for({kind!r}): expected None, 'flaggems', 'vllm', 'sglang', 'sglang-kernels' or 'sglang-q8kv8'"
    )


def stubbed(stubs: dict[str, dict[str, Any]]) -> Any:
    """Context manager: ``stubs`` (module name -> attributes) in ``sys.modules`` for its duration,
    under names not already imported; the entries it added are removed on exit. For a peer function
    that imports a stubbed name when it runs (SGLang's split reads ``get_resources`` then)."""
    import contextlib
    import sys
    import types

    @contextlib.contextmanager
    def manager() -> Any:
        added = []
        for key, attrs in stubs.items():
            if key not in sys.modules:
                stub = types.ModuleType(key)
                stub.__path__ = []  # a package, so dotted stubs below it resolve (or the given __path__)
                stub.__dict__.update(attrs)
                sys.modules[key] = stub
                added.append(key)
        try:
            yield
        finally:
            for key in added:
                sys.modules.pop(key, None)

    return manager()


def exec_source(name: str, path: Any, stubs: dict[str, dict[str, Any]]) -> Any:
    """Execute a peer's source file as module ``name``, with ``stubs`` standing in for its imports.

    For peers whose kernels live in a package too heavy (or too device-specific) to import in a
    test session: the file runs as it is, only the modules in ``stubs`` (module name -> attributes)
    are replaced while it executes; ``sys.modules`` entries of those names are restored afterwards,
    and modules the file imported below a stand-in (a peer's own files, found through a stand-in's
    ``__path__``) are removed again.
    The module stays registered under ``name`` (Triton's JIT reads its functions' source from it).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        Whatever the file raises while it executes.
    """
    import importlib.util
    import sys
    import types
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the peer's source file is missing")
    if name in sys.modules:
        return sys.modules[name]
    saved = {key: sys.modules.get(key) for key in stubs}
    before = set(sys.modules)
    try:
        for key, attrs in stubs.items():
            stub = types.ModuleType(key)
            stub.__path__ = []  # a package, so dotted stubs below it resolve (or the given __path__)
            stub.__dict__.update(attrs)
            sys.modules[key] = stub
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"{path}: not loadable as a module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return module
    finally:
        for key, old in saved.items():
            if old is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = old
        for key in set(sys.modules) - before - {name}:  # the peer's own files, loaded below a stand-in
            if any(key.startswith(stub + ".") for stub in stubs):
                del sys.modules[key]
