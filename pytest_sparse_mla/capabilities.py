"""One lazy, cached probe of what this machine can run, and the evaluation of capability markers.

Here "capabilities" are the machine's (:class:`Capabilities`: GPU, compute capability, CUDA, torch,
Triton and FlashInfer versions). An implementation's "capabilities" (``pack``, ``page_split``,
``sparse_mla_forward``: ``implementations.CAPABILITIES``) are the operations it provides; of this
module, only the ``sparse_mla_needs`` marker's description refers to those.

Importing it imports no torch, triton or flashinfer; nothing touches CUDA until :func:`probe` is first
called (at collection or later), once per process (per xdist worker, after ``xdist_gpu`` pinned its GPU).
Versions are compared with :mod:`packaging`, never as strings ("12.10" < "12.3" lexically;
sgl-project/sglang sgl-kernel/tests/test_flashmla.py ``is_sm90_supported``). Markers (registered by
the plugin when active; namespaced, so a project's own ``requires_torch`` is never claimed):

==============================================  =============================================
``sparse_mla_requires_cuda``                    a CUDA device is visible to torch
``sparse_mla_requires_sm(spec)``                compute capability matches ``spec``: ``"12.0"``
                                                (exact), ``"==12.*"`` (family), ``">=9.0"``
``sparse_mla_requires_cuda_version(spec)``      torch's CUDA toolkit version matches ``spec``
``sparse_mla_requires_torch(spec)``             installed torch version matches ``spec``
``sparse_mla_requires_triton(spec="")``         triton is installed (and matches ``spec``)
``sparse_mla_requires_flashinfer(spec="")``     flashinfer-python is installed (and matches)
==============================================  =============================================

FlashInfer gates its SM120 sparse-MLA kernels on compute capability 12.x with CUDA >= 12.8
(flashinfer-ai/flashinfer: flashinfer/utils.py ``is_sm120a_supported`` / ``is_sm12x_supported``), so
an SM120 test is marked ``sparse_mla_requires_sm("==12.*")`` and ``sparse_mla_requires_cuda_version(">=12.8")``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from pytest_sparse_mla.errors import CapabilityMarkerError

__all__ = [
    "Capabilities",
    "MARKERS",
    "probe",
    "evaluate_marker",
    "is_gpu_marker",
    "unmet_markers",
    "parse_sm_spec",
    "load_triton_kernels",
    "triton_unavailable_reason",
    "TritonKernels",
]

#: marker name -> one-line description (registered with ``config.addinivalue_line``).
MARKERS: dict[str, str] = {
    "sparse_mla_requires_cuda": "sparse_mla_requires_cuda: skip unless torch sees a CUDA device",
    "sparse_mla_requires_sm": "sparse_mla_requires_sm(spec): skip unless the GPU compute capability "
    "matches spec, "
    "e.g. '12.0' (exact), '==12.*' (SM12x family), '>=9.0'",
    "sparse_mla_requires_cuda_version": "sparse_mla_requires_cuda_version(spec): skip unless torch's "
    "CUDA toolkit "
    "version matches spec, e.g. '>=12.8'",
    "sparse_mla_requires_torch": "sparse_mla_requires_torch(spec): skip unless the torch version matches spec",
    "sparse_mla_requires_triton": "sparse_mla_requires_triton(spec=''): skip unless triton is installed "
    "(and matches)",
    "sparse_mla_requires_flashinfer": "sparse_mla_requires_flashinfer(spec=''): skip unless flashinfer-python is "
    "installed (and its version matches spec, e.g. '>=0.6.18')",
    "sparse_mla_needs": "sparse_mla_needs(*capabilities): skip unless the implementation under "
    "test provides every named capability (pack, page_split, sparse_mla_forward, ...)",
    "sparse_mla_benchmark": "sparse_mla_benchmark: a pytest-benchmark measurement of the benchmarks/ "
    "folder (run with --benchmark-only)",
}

#: markers whose miss means "no usable GPU" (turned into errors by --sparse-mla-require-gpu).
_GPU_MARKERS = frozenset(
    {"sparse_mla_requires_cuda", "sparse_mla_requires_sm", "sparse_mla_requires_cuda_version"}
)


@dataclass(frozen=True)
class Capabilities:
    """What the probe found. Every version is a string as the package reports it, or ``None``.

    Attributes:
        torch_version: ``torch.__version__`` (e.g. ``"2.13.0+cpu"``), ``None`` if torch is absent.
        cuda_version: ``torch.version.cuda`` (toolkit torch was built with), ``None`` on CPU builds.
        cuda_available: ``torch.cuda.is_available()``.
        device_count: ``torch.cuda.device_count()`` (0 without CUDA).
        device_name: name of the current CUDA device (after xdist pinning), or ``None``.
        compute_capability: ``(major, minor)`` of the current device, or ``None``.
        triton_version: distribution version of ``triton`` (read from metadata, not imported).
        flashinfer_version: distribution version of ``flashinfer-python`` (metadata only).
    """

    torch_version: str | None = None
    cuda_version: str | None = None
    cuda_available: bool = False
    device_count: int = 0
    device_name: str | None = None
    compute_capability: tuple[int, int] | None = None
    triton_version: str | None = None
    flashinfer_version: str | None = None
    errors: tuple[str, ...] = field(default=())

    @property
    def sm(self) -> str | None:
        """Compute capability as ``"major.minor"`` (``"9.0"`` on H200, ``"12.0"`` on SM120)."""
        if self.compute_capability is None:
            return None
        return f"{self.compute_capability[0]}.{self.compute_capability[1]}"

    def summary(self) -> str:
        """One line for the pytest report header."""
        flashinfer = self.flashinfer_version or "not installed"
        triton = self.triton_version or "not installed"
        if self.cuda_available:
            gpu = f"{self.device_name} (sm {self.sm}), {self.device_count} visible"
        else:
            gpu = "no CUDA device"
        return (
            f"torch {self.torch_version or 'not installed'} (CUDA {self.cuda_version or 'none'}), "
            f"triton {triton}, flashinfer {flashinfer}; {gpu}"
        )


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def probe() -> Capabilities:
    """Probe torch, CUDA, Triton and FlashInfer once per process (cached).

    Imports torch (never triton or flashinfer: their versions come from package metadata, so a
    FlashInfer wheel that needs a GPU toolchain to import cannot break collection on CPU).

    Returns:
        A frozen :class:`Capabilities`. Probe failures are recorded in ``errors``, never raised.
    """
    errors: list[str] = []
    kwargs: dict[str, Any] = {
        "triton_version": _dist_version("triton"),
        "flashinfer_version": _dist_version("flashinfer-python"),
    }
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a hard dependency
        errors.append(f"torch import failed: {exc}")
        return Capabilities(errors=tuple(errors), **kwargs)
    kwargs["torch_version"] = str(torch.__version__)
    kwargs["cuda_version"] = torch.version.cuda
    try:
        available = bool(torch.cuda.is_available())
    except Exception as exc:  # pragma: no cover - broken driver
        errors.append(f"torch.cuda.is_available() raised: {exc}")
        available = False
    kwargs["cuda_available"] = available
    if available:
        try:
            kwargs["device_count"] = int(torch.cuda.device_count())
            index = torch.cuda.current_device()
            kwargs["device_name"] = torch.cuda.get_device_name(index)
            kwargs["compute_capability"] = tuple(torch.cuda.get_device_capability(index))
        except Exception as exc:  # pragma: no cover - broken driver
            errors.append(f"CUDA device query raised: {exc}")
    return Capabilities(errors=tuple(errors), **kwargs)


def parse_sm_spec(spec: str | float | int | tuple[int, int]) -> str:
    """Normalise a compute-capability spec into a ``packaging`` specifier string.

    ``"12.0"``, ``12.0`` and ``(12, 0)`` mean exactly 12.0 (``"==12.0"``); ``"12"`` means the
    whole family (``"==12.*"``); strings with an operator (``">=9.0"``, ``"==12.*"``) pass through.

    Raises:
        ValueError: ``spec`` is not a version, a ``(major, minor)`` tuple or a valid specifier.
    """
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    if isinstance(spec, tuple):
        if len(spec) != 2 or not all(isinstance(v, int) for v in spec):
            raise ValueError(
                f"sparse_mla_requires_sm: spec={spec!r}; expected a (major, minor) tuple of ints"
            )
        text = f"=={spec[0]}.{spec[1]}"
    else:
        text = str(spec).strip()
        if text and text[0].isdigit():
            text = f"=={text}.*" if "." not in text else f"=={text}"
    try:
        SpecifierSet(text)
    except InvalidSpecifier as exc:
        raise ValueError(
            f"sparse_mla_requires_sm: spec={spec!r} is not a compute-capability specifier; "
            "expected e.g. '12.0', '==12.*' or '>=9.0'"
        ) from exc
    return text


def _matches(found: str, spec: str) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    # Local build tags ("+cpu", "+cu130") must not make "2.13.0+cpu" fail ">=2.4".
    return Version(Version(found).base_version) in SpecifierSet(spec, prereleases=True)


def _spec_arg(mark: Any, default: str = "") -> str:
    if mark.args:
        return str(mark.args[0])
    return str(mark.kwargs.get("spec", default))


def evaluate_marker(name: str, mark: Any, caps: Capabilities) -> str | None:
    """Return the skip reason for capability marker ``mark`` on ``caps``, or ``None`` if it runs.

    Reasons say what is required and what was found, e.g.
    ``"requires compute capability ==12.0; found 9.0 (NVIDIA H200)"``.

    Raises:
        ValueError: the marker's spec is malformed (reported as a usage error by the plugin).
    """
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    def check_spec(spec: str) -> None:
        try:
            SpecifierSet(spec)
        except InvalidSpecifier as exc:
            raise ValueError(f"{name}: spec={spec!r} is not a version specifier") from exc

    if name == "sparse_mla_requires_cuda":
        if not caps.cuda_available:
            return f"requires a CUDA device; found none (torch {caps.torch_version}, " \
                f"CUDA build {caps.cuda_version or 'none'})"
        return None
    if name == "sparse_mla_requires_sm":
        if not mark.args and "spec" not in mark.kwargs:
            raise ValueError(
                "sparse_mla_requires_sm: missing spec; expected e.g. sparse_mla_requires_sm('12.0')"
            )
        spec = parse_sm_spec(mark.args[0] if mark.args else mark.kwargs["spec"])
        if caps.sm is None:
            return f"requires compute capability {spec}; found no CUDA device"
        if not _matches(caps.sm, spec):
            return f"requires compute capability {spec}; found {caps.sm} ({caps.device_name})"
        return None
    if name == "sparse_mla_requires_cuda_version":
        spec = _spec_arg(mark)
        check_spec(spec)
        if caps.cuda_version is None:
            return f"requires CUDA toolkit {spec}; torch {caps.torch_version} has no CUDA"
        if not _matches(caps.cuda_version, spec):
            return f"requires CUDA toolkit {spec}; found {caps.cuda_version}"
        return None
    packages = {
        "sparse_mla_requires_torch": ("torch", caps.torch_version),
        "sparse_mla_requires_triton": ("triton", caps.triton_version),
        "sparse_mla_requires_flashinfer": ("flashinfer-python", caps.flashinfer_version),
    }
    if name in packages:
        package, found = packages[name]
        spec = _spec_arg(mark)
        check_spec(spec)
        if found is None:
            return f"requires {package}{spec}; not installed"
        if spec and not _matches(found, spec):
            return f"requires {package}{spec}; found {found}"
        return None
    return None


def is_gpu_marker(name: str) -> bool:
    """True for markers whose miss means "no usable GPU" (see ``--sparse-mla-require-gpu``)."""
    return name in _GPU_MARKERS


def unmet_markers(items: Iterable[Any]) -> list[tuple[Any, str, str]]:
    """The capability markers of ``items`` this machine does not meet, as ``(item, marker name,
    reason)`` in item order (reason: ``"requires ...; found ..."``). Probes the machine only when
    an item carries a capability marker. The plugin turns each into a skip, or, for a GPU marker
    under ``--sparse-mla-require-gpu`` (:func:`is_gpu_marker`), a setup failure
    (``pytest_sparse_mla.selection.skip_unmet``).

    Args:
        items: collected test items (anything with ``nodeid`` and ``iter_markers(name=...)``).

    Raises:
        CapabilityMarkerError: a marker's spec is malformed (the message starts with the test's
            node id).
    """
    caps: Capabilities | None = None
    unmet: list[tuple[Any, str, str]] = []
    for item in items:
        for name in MARKERS:
            for mark in item.iter_markers(name=name):
                if caps is None:
                    caps = probe()
                try:
                    reason = evaluate_marker(name, mark, caps)
                except ValueError as exc:
                    raise CapabilityMarkerError(f"{item.nodeid}: {exc}") from None
                if reason is not None:
                    unmet.append((item, name, reason))
    return unmet


@functools.cache
def interpreter_unusable_reason() -> str | None:
    """Why Triton's CPU interpreter cannot run these kernels here, or ``None``.

    The interpreter holds a program id as a one-element array and turns a scalar into a Python int
    (a loop bound) with ``int(array)``; NumPy versions that refuse ``int`` of a one-element 1-D
    array (``TypeError: only 0-dimensional arrays can be converted to Python scalars``) then break
    every kernel whose loop bound derives from a program id. Triton 3.9's interpreter squeezes
    first; 3.6's does not (seen with NumPy 2.4.6: the touched page split and the split attention
    launch fail). The check is the conversion itself, so a NumPy that allows it passes with any Triton.
    """
    import numpy as np
    import triton
    from packaging.version import Version

    try:
        int(np.array([1]))
    except TypeError:
        if Version(triton.__version__).release < (3, 9):
            return (
                f"triton {triton.__version__}'s CPU interpreter with numpy {np.__version__}: it converts one-element "
                "arrays with int(), which this numpy refuses; use triton>=3.9 (or a GPU) for interpreted Triton kernels"
            )
    return None


def load_triton_kernels(module: str) -> ModuleType:
    """Import the Triton kernel module ``module``, deciding first whether it is interpreted.

    Triton decides at decoration time whether a ``@triton.jit`` kernel is compiled or interpreted
    (triton-lang/triton ``docs/programming-guide/chapter-3/debugging.rst``), so when
    ``TRITON_INTERPRET`` is unset and torch sees no CUDA device this sets ``TRITON_INTERPRET=1``
    before the import. Kernel modules record the mode they got in ``INTERPRETED``.

    Raises:
        ImportError: triton (or numpy, which its interpreter needs) is not importable.
    """
    if "TRITON_INTERPRET" not in os.environ and not probe().cuda_available:
        os.environ["TRITON_INTERPRET"] = "1"
    return importlib.import_module(module)


def triton_unavailable_reason(module: str, device: Any) -> str | None:
    """Why the Triton kernels of ``module`` cannot run on ``device`` here, or ``None`` when they can.

    Reasons: a device that is neither CPU nor CUDA; triton not importable; CPU tensors but kernels
    decorated as compiled (``TRITON_INTERPRET`` unset while CUDA was visible); CUDA tensors but
    kernels decorated as interpreted; an interpreter that cannot run them
    (:func:`interpreter_unusable_reason`). Imports ``module`` (see :func:`load_triton_kernels`).
    """
    kind = getattr(device, "type", str(device).split(":", 1)[0])
    if kind not in ("cpu", "cuda"):
        return f"Triton kernels run on CUDA (or interpreted on the CPU), not on {kind}"
    try:
        kernels = load_triton_kernels(module)
    except ImportError as exc:
        return f"triton is not importable ({exc})"
    if kind == "cpu" and not kernels.INTERPRETED:
        return "Triton kernels on CPU tensors need TRITON_INTERPRET=1 before the first call"
    if kind == "cpu":
        return interpreter_unusable_reason()
    if kind == "cuda" and kernels.INTERPRETED:
        return "the Triton kernels were decorated under TRITON_INTERPRET=1 (CPU tensors only)"
    return None


@dataclass(frozen=True)
class TritonKernels:
    """A module of Triton kernels (``attention._triton_forward``, ``page_split._triton``), imported on
    first use.

    Attributes:
        module: the module's import name.
    """

    module: str

    def load(self) -> ModuleType:
        """Import and return the module, interpreted when torch sees no CUDA device
        (:func:`load_triton_kernels`).

        Raises:
            ImportError: triton (or numpy, for its interpreter) is not importable.
        """
        return load_triton_kernels(self.module)

    def unavailable_reason(self, device: Any) -> str | None:
        """Why the kernels cannot run on ``device`` here, or ``None`` (:func:`triton_unavailable_reason`)."""
        return triton_unavailable_reason(self.module, device)

