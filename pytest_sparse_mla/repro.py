"""Standalone reproducers of failing judged calls (``--sparse-mla-repro-dir DIR``).

A maintainer reading "test X fails against your kernel" should not have to install this plugin to
see it. With ``--sparse-mla-repro-dir DIR``, every call a failing or xfailed test made to the
implementation under test becomes, when it is itself wrong, one folder
``DIR/<test id>/call<k>/`` holding:

* ``inputs.pt`` (``torch.save``; loads with ``weights_only=True``): the call's tensors and
  arguments, exactly as the kernel received them (views keep their storage, strides and offset),
  the float64 oracle's output and LSE for that call, and the elementwise bounds the suite applied
  (``tolerances.output_bound``, ``tolerances.lse_bound``); for a page split, the bytes of the bundled
  torch split from empty buffers (the script fills the memory the allocator hands out next with
  ``0xA5`` first, so a buffer the peer never wrote shows);
* ``repro.py``: a script that needs only torch and the implementation. Where a built-in peer
  adapter made the call, it calls the peer's own function with the arguments the adapter passed it
  (``flash_mla.flash_mla_with_kvcache``, FlagGems' and vLLM's source files, FlashInfer's
  references, SGLang's decode and page split), never this package; otherwise it imports the
  implementation by its import string and calls ``sparse_mla_forward(q, kv_cache, indices,
  **kwargs)`` (or ``page_split``). ``--impl module:Class`` runs
  another implementation on the same inputs (``pytest_sparse_mla.implementations:ReferenceImplementation``
  is the bundled reference). It prints expected vs got at the worst element and exits 1 while the
  discrepancy exists, 0 once the result lies within the bound (2: it could not run).

What counts as wrong is what the script itself checks (:func:`_judge`, whose source the script
carries): a non-finite or out-of-bound output element, an out-of-bound LSE (protocol calls only: a
peer's native LSE is in its own convention, so a call whose only wrong value is its LSE gets a
script that calls the implementation, not the peer), an error raised by a call the suite expected to
succeed, or no ``TypeError``/``ValueError`` naming the argument for a deliberately bad call. A test
none of whose calls is wrong by itself (its failure compares calls with each other, as an invariance
does, or with a stored golden; or its call never reached the implementation's own function, as when
a peer adapter refuses an input the peer would read out of bounds) gets a ``NO-REPRO.txt`` instead:
each call and why it gets no script, the comparison that failed (the test's own failure text), the
command that reruns the test, and ``calls.pt`` (every call's arguments and result or error).

The calls come from :mod:`pytest_sparse_mla.recording` (the guard records each call of the
implementation, the peer adapters the peer call they make for it); :func:`write_for_report` is what
the plugin's report hook does with them.
"""

from __future__ import annotations

import inspect
import json
import re
import types
from pathlib import Path
from typing import Any

from pytest_sparse_mla.recording import NativeCall, RecordedCall, recorded_calls

__all__ = [
    "write_for_report",
    "write_reproducers",
    "write_safely",
    "ReproWriteWarning",
]

# --- the judgement (its source is copied into every script) ------------------------------------


def _judge(expected: Any, bound: Any, got: Any, what: str) -> list[str]:
    """Lines describing where ``got`` leaves ``|got - expected| <= bound`` (non-finite counts as out),
    worst element first; ``[]`` when it stays inside. Tensors of one shape; ``expected`` may hold
    ``+-inf`` (an empty row's LSE), matched by the same infinity."""
    import torch

    e = expected.double().cpu()
    a = got.double().cpu().reshape(e.shape)
    same_inf = torch.isinf(a) & torch.isinf(e) & (torch.sign(a) == torch.sign(e))
    diff = torch.where(same_inf, torch.zeros_like(a), (a - e).abs())
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    bad = diff > bound.double().cpu()
    if not bool(bad.any()):
        return []
    ratio = torch.where(bad, diff / bound.double().cpu().clamp_min(1e-300), torch.zeros_like(diff))
    ratio = ratio.nan_to_num(posinf=1e308)
    idx = tuple(int(i) for i in torch.unravel_index(ratio.argmax(), ratio.shape))
    where = ", ".join(f"{n} {i}" for n, i in zip(("token", "head", "dim"), idx, strict=False))
    return [
        f"{what}: {int(bad.sum())} of {bad.numel()} values outside the bound; worst at {where}: "
        f"expected {float(e[idx]):.7g}, got {float(a[idx]):.7g}, |diff| {float(diff[idx]):.3g} > "
        f"bound {float(bound.double()[idx]):.3g}"
    ]


def _judge_bytes(expected: Any, got: Any, what: str) -> list[str]:
    """Lines describing where the bytes of ``got`` differ from ``expected`` (same shape, any dtype
    viewed as bytes), first differing element first; ``[]`` when they are equal."""
    import torch

    e = expected.detach().cpu().contiguous()
    a = got.detach().cpu().contiguous()
    if tuple(a.shape) != tuple(e.shape) or a.dtype != e.dtype:
        return [f"{what}: shape {tuple(a.shape)} {a.dtype}, expected {tuple(e.shape)} {e.dtype}"]
    eb, ab = e.reshape(-1).view(torch.uint8), a.reshape(-1).view(torch.uint8)
    bad = eb != ab
    if not bool(bad.any()):
        return []
    first = int(bad.nonzero()[0, 0])
    per_row = eb.numel() // max(e.shape[0], 1)
    return [
        f"{what}: {int(bad.sum())} of {eb.numel()} bytes differ; first at byte {first} (page {first // per_row}, "
        f"byte {first % per_row} of it): expected 0x{int(eb[first]):02x}, got 0x{int(ab[first]):02x}"
    ]


# --- writing ------------------------------------------------------------------------------------

#: The protocol's three leading arguments, positional or keyword (``sparse_mla_forward(q, kv_cache, indices, ...)``).
_CALL_TENSORS = ("q", "kv_cache", "indices")
_ORACLE_KEYS = (
    "sm_scale", "fmt", "page_block_size", "topk_length", "attn_sink", "extra_kv_cache", "extra_indices",
    "extra_topk_length", "extra_page_block_size", "lse_convention", "lse_scale",
)  # fmt: skip


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", name)[:150]


def _expectation(rec: RecordedCall, profile: Any) -> dict[str, Any] | None:
    """The oracle's output, LSE and bounds for ``rec`` (a page split: the bundled torch split's
    bytes from empty buffers); ``None`` when the oracle refuses the call."""

    import torch

    from pytest_sparse_mla import tolerances
    from pytest_sparse_mla.attention.oracle import oracle_forward

    if rec.capability == "page_split":
        from pytest_sparse_mla.page_split import BufferRegistry, page_split

        try:
            split = page_split(*rec.args, **rec.kwargs, registry=BufferRegistry(), backend="torch")
        except (TypeError, ValueError):
            return None
        return {"expected_split": split.clone()}

    # q, kv_cache and indices may come as keywords (the golden suite calls sparse_mla_forward(**inputs)).
    kwargs = {k: v for k, v in rec.kwargs.items() if k in _ORACLE_KEYS or k in _CALL_TENSORS[len(rec.args) :]}
    try:
        oracle = oracle_forward(*rec.args, **kwargs)
    except (TypeError, ValueError):
        return None
    fmt = kwargs.get("fmt", "dsv4")
    dtype = rec.output.dtype if rec.output is not None else torch.bfloat16
    out = {
        "expected_output": oracle.output.to(torch.float64),
        "output_bound": tolerances.output_bound(oracle.output, profile=profile, fmt=fmt, scales=oracle.scales,
                                                output_dtype=dtype),  # fmt: skip
        "lse_convention": oracle.lse_convention,
        "lse_scale": float(oracle.lse_scale),
    }
    natural = tolerances._to_natural(oracle.lse, oracle.lse_convention, oracle.lse_scale)
    out["expected_lse_natural"] = natural
    out["lse_bound_natural"] = tolerances.lse_bound(natural, profile=profile, fmt=fmt, scales=oracle.scales)
    return out


def _verdict(rec: RecordedCall, expect: dict[str, Any] | None) -> list[str]:
    """What is wrong with ``rec`` by the script's own checks (``[]``: nothing by itself)."""
    if rec.expect_error is not None:
        wanted = "a TypeError or ValueError" + (f" naming {rec.expect_error!r}" if rec.expect_error else "")
        if rec.error is None:
            return [f"no error raised; expected {wanted}"]
        kind = rec.error.split(":", 1)[0]
        named = not rec.expect_error or re.search(rf"\b{rec.expect_error}\b", rec.error)
        if kind not in ("TypeError", "ValueError") or not named:
            return [f"raised {rec.error}; expected {wanted}"]
        return []
    if rec.error is not None:
        if rec.error.startswith(("Skipped", "Failed", "XFailed", "Unsupported")):
            return []  # pytest's own outcomes and declared refusals are not the kernel's answer
        return [f"raised {rec.error}; the call lies inside the envelope and must succeed"]
    if expect is None or rec.output is None:
        return []
    if "expected_split" in expect:
        return _judge_bytes(expect["expected_split"], rec.output, "split")
    lines = _judge(expect["expected_output"], expect["output_bound"], rec.output, "output")
    if rec.lse is not None:
        from pytest_sparse_mla.tolerances import _to_natural

        got = _to_natural(rec.lse, expect["lse_convention"], expect["lse_scale"])
        lines += _judge(expect["expected_lse_natural"], expect["lse_bound_natural"], got, "lse (natural log)")
    return lines


def _recorded_device(rec: RecordedCall) -> str:
    """The device the call's first argument lived on (the arguments themselves are host copies)."""
    devices = rec.devices.get("args") if isinstance(rec.devices, dict) else None
    first = devices[0] if devices else None
    return first if isinstance(first, str) else "cpu"


def _import_root(spec: str) -> str | None:
    """The ``sys.path`` entry the module of ``spec`` (``module:attribute``) was imported from, or ``None``."""
    import sys

    module = sys.modules.get(spec.partition(":")[0])
    file = getattr(module, "__file__", None)
    if not file:
        return None
    root = Path(file).resolve().parent
    for _ in range(spec.partition(":")[0].count(".")):  # package.module: up to the top package's parent
        root = root.parent
    return str(root)


def _impl_string(impl: Any) -> str:
    """The import string of ``impl``: a module's name (a module selected as the implementation), else
    ``module:Class`` of its class."""
    if isinstance(impl, types.ModuleType):
        return impl.__name__
    cls = type(impl)
    return f"{cls.__module__}:{cls.__qualname__}"


def _impl_name(impl: Any, spec: str | None) -> str:
    """The implementation's ``name``, or its import string where it declares none."""
    return str(getattr(impl, "name", "") or spec or _impl_string(impl))


def write_reproducers(
    directory: str | Path,
    nodeid: str,
    impl: Any,
    profile: Any,
    outcome: str,
    calls: list[RecordedCall] | None = None,
    impl_spec: str | None = None,
    failure: str | None = None,
    rerun: str | None = None,
) -> list[Path]:
    """Write one reproducer per wrong call of a failed or xfailed test (module docstring).

    Args:
        directory: the ``--sparse-mla-repro-dir``.
        nodeid: the test id (the folder name, made file-system safe).
        impl: the implementation under test (unguarded).
        profile: the ``tolerances.Profile`` in force for the test.
        outcome: ``"failed"`` or ``"xfailed"`` (recorded in the index).
        calls: the calls (default: this test's recorded calls).
        impl_spec: the ``module:attribute`` the script imports (default: the implementation's class).
        failure: the test's failure text (``NO-REPRO.txt`` quotes it: the comparison that failed).
        rerun: the command that reruns the test (``NO-REPRO.txt`` gives it).

    Returns:
        The folders written (none when no call is wrong by itself: ``NO-REPRO.txt`` says why).
    """
    import torch

    calls = recorded_calls() if calls is None else calls
    if not calls:
        return []
    base = Path(directory) / _safe(nodeid.split("::", 1)[-1])
    written: list[Path] = []
    reasons: list[str] = []
    for k, rec in enumerate(calls):
        expect = None if rec.expect_error is not None else _expectation(rec, profile)
        verdict = _verdict(rec, expect)
        if not verdict:
            reasons.append(f"call {k}: {_why_not_wrong(rec, expect)}")
            continue
        folder = base / f"call{k}"
        folder.mkdir(parents=True, exist_ok=True)
        native = rec.native[-1] if rec.native else None
        if native is not None and all(line.startswith("lse") for line in verdict):
            native = None  # a peer's own LSE is in its own convention: only the protocol call judges it
        data: dict[str, Any] = {
            "nodeid": nodeid,
            "impl": impl_spec or _impl_string(impl),
            "impl_path": _import_root(impl_spec or _impl_string(impl)),
            "impl_name": _impl_name(impl, impl_spec),
            "device": _recorded_device(rec),
            "args": rec.args,
            "kwargs": rec.kwargs,
            "devices": rec.devices,
            "expect_error": rec.expect_error,
            "capability": rec.capability,
            "recorded": verdict,
        }
        if expect is not None:
            data.update(expect)
        if native is not None:
            data["native"] = {"source": native.source, "function": native.function, "args": native.args,
                              "kwargs": native.kwargs}  # fmt: skip
        torch.save(data, folder / "inputs.pt")
        (folder / "repro.py").write_text(_script(nodeid, impl, verdict, native, impl_spec), encoding="utf-8")
        written.append(folder)
    index = Path(directory) / "index.jsonl"
    index.parent.mkdir(parents=True, exist_ok=True)
    with index.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps({"nodeid": nodeid, "outcome": outcome, "impl": _impl_name(impl, impl_spec),
                             "scripts": [str(p / "repro.py") for p in written]}) + "\n")  # fmt: skip
    if not written:
        base.mkdir(parents=True, exist_ok=True)
        torch.save(
            [{"args": c.args, "kwargs": c.kwargs, "capability": c.capability, "output": c.output, "lse": c.lse,
              "error": c.error} for c in calls],
            base / "calls.pt",
        )  # fmt: skip
        (base / "NO-REPRO.txt").write_text(
            _no_repro_text(nodeid, outcome, reasons, failure, rerun, len(calls)), encoding="utf-8"
        )
    return written


def _why_not_wrong(rec: RecordedCall, expect: dict[str, Any] | None) -> str:
    """Why :func:`_verdict` found nothing wrong with ``rec`` by itself, in words."""
    if rec.error is not None:
        first = rec.error.splitlines()[0][:300]
        if " was not run: " in rec.error:
            return f"the implementation's own function was never called, so there is nothing of it to rerun ({first})"
        return f"it did not return a result to judge ({first})"
    if rec.expect_error is not None:
        return "it raised the error the test expected"
    if rec.output is None:
        return "it returned no result to judge"
    if expect is None:
        return "the float64 oracle cannot evaluate its arguments"
    return "its output and LSE lie within the bound of the float64 oracle"


def _no_repro_text(
    nodeid: str, outcome: str, reasons: list[str], failure: str | None, rerun: str | None, calls: int
) -> str:
    """``NO-REPRO.txt``: the comparison that failed (the test's own failure text), why no call of the
    test gets a script, and what reruns the comparison."""
    lines = [f"{nodeid} ({outcome}): no standalone repro.py, since no call of the implementation is wrong when "
             "judged alone against the float64 oracle:"]  # fmt: skip
    lines += [f"  {r}" for r in reasons]
    if failure:
        lines += ["", "The comparison that failed (the test's failure):"]
        lines += [f"  {ln}" for ln in failure.strip().splitlines()[:12]]
    lines += [
        "",
        "What failed is a comparison the test makes beyond one call and the oracle (two calls that must agree, "
        "a stored golden, a byte or buffer check) or a call that did not run. To rerun it:",
        f"  {rerun}" if rerun else "  the test itself (its id above)",
        f"The {calls} call(s) as the implementation received them, with what each returned or raised, are in "
        "calls.pt beside this file (torch.load(path, weights_only=False)).",
    ]
    return "\n".join(lines) + "\n"


def write_for_report(item: Any, report: Any) -> None:
    """What ``pytest_runtest_makereport`` does with ``--sparse-mla-repro-dir``: the call phase of a
    failed or xfailed test that used the ``sparse_mla_impl`` fixture gets a reproducer for each of
    its wrong calls (:func:`write_safely`), judged with the test's tolerance model (the
    ``sparse_mla_tolerances`` fixture's, else the default profile of the implementation's compute
    mode), and a ``sparse-mla reproducers`` section on its report naming the scripts (or why none was
    written). Any other report, or a session without the option: nothing.

    Args:
        item: the test (a ``pytest.Item``; its ``funcargs`` hold the fixtures it used).
        report: the phase's ``pytest.TestReport`` (sections are appended to it).

    Raises:
        pytest.UsageError: the implementation's ``compute_mode`` names no tolerance profile
            (``tolerances.profile_for``).
    """
    from pytest_sparse_mla import device_health, options, tolerances

    opts = options.get_options(item.config)
    if opts.repro_dir is None or report.when != "call" or not (report.failed or hasattr(report, "wasxfail")):
        return
    funcargs = getattr(item, "funcargs", {})
    impl = funcargs.get("sparse_mla_impl")
    if impl is None:
        return
    tol = funcargs.get("sparse_mla_tolerances")
    profiles = tolerances.DEFAULT_PROFILES
    with options.usage_errors():
        fallback = profiles.get(tolerances.profile_for(impl), profiles["kernel"])
    model = tol.model if tol is not None else fallback
    outcome = "xfailed" if hasattr(report, "wasxfail") else "failed"
    spec = opts.impl if ":" in opts.impl else None  # an import string names the object itself
    crash = getattr(report.longrepr, "reprcrash", None)
    failure = str(getattr(crash, "message", None) or getattr(report, "wasxfail", None) or report.longrepr or "")
    rerun = f"pytest -p sparse_mla '{item.nodeid}' --sparse-mla-impl {opts.impl} --sparse-mla-device {opts.device}"
    written, error = write_safely(
        opts.repro_dir, item.nodeid, impl.unguarded, model, outcome, impl_spec=spec,
        context_error=device_health.context_error_of(report), failure=failure, rerun=rerun,
    )  # fmt: skip
    if error is not None:
        report.sections.append(("sparse-mla reproducers", f"not written: {error}"))
    if written:
        report.sections.append(("sparse-mla reproducers", "\n".join(f"python {p / 'repro.py'}" for p in written)))


def write_safely(
    directory: str | Path,
    nodeid: str,
    impl: Any,
    profile: Any,
    outcome: str,
    impl_spec: str | None = None,
    context_error: str | None = None,
    failure: str | None = None,
    rerun: str | None = None,
) -> tuple[list[Path], str | None]:
    """:func:`write_reproducers` for the plugin's report hook: an error while writing (a full disk,
    an oracle that refuses the inputs, anything) is returned as ``"Type: message"`` and warned about
    (:class:`ReproWriteWarning`), never raised, so one test's reproducer cannot end the session.

    ``context_error``: the CUDA error after which the test left the context dead
    (``device_health``); when none of the test's calls raised, the last one is the call recorded as
    having raised it (its script re-runs that call: exit 1 while it still crashes). Everything is
    computed on the host copies the calls were recorded as.

    Returns:
        ``(folders written, error or None)``.
    """
    import dataclasses
    import warnings

    calls = recorded_calls()
    if context_error and calls and not any(c.error for c in calls):
        calls[-1] = dataclasses.replace(calls[-1], error=f"{context_error} (the CUDA context was dead after this call)")
    try:
        written = write_reproducers(directory, nodeid, impl, profile, outcome, calls=calls, impl_spec=impl_spec,
                                    failure=failure, rerun=rerun)  # fmt: skip
        return written, None
    except Exception as exc:  # noqa: BLE001 - reported on the test, never an INTERNALERROR
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        try:
            warnings.warn(ReproWriteWarning(f"{nodeid}: no reproducer written ({error})"), stacklevel=2)
        except Warning:  # -W error: the report section still says it
            pass
        return [], error


class ReproWriteWarning(UserWarning):
    """A reproducer could not be written for a failing test (:func:`write_safely`)."""


def _script(nodeid: str, impl: Any, verdict: list[str], native: NativeCall | None, impl_spec: str | None) -> str:
    from pytest_sparse_mla.implementations import _source

    helpers = "\n\n".join(
        inspect.getsource(fn)
        for fn in (_source.find_source, _source.stubs_for, _source.stubbed, _source.exec_source, _judge, _judge_bytes)
    )
    how = (
        f"calls {native.source.get('module') or native.source.get('package')}'s {native.function} directly"
        if native is not None
        else f"imports {impl_spec or _impl_string(impl)} and calls sparse_mla_forward"
    )
    head = f'''#!/usr/bin/env python3
"""Reproducer written by pytest-sparse-mla (--sparse-mla-repro-dir).

Test: {nodeid}
Implementation: {_impl_name(impl, impl_spec)} ({impl_spec or _impl_string(impl)}); this script {how}.
Recorded: {" / ".join(verdict)}

Needs torch and the implementation only. Usage:
    python repro.py                  # the recorded call, on the recorded device
    python repro.py --device cpu     # another device
    python repro.py --impl pytest_sparse_mla.implementations:ReferenceImplementation   # another implementation
Exit 0: the result lies within the bound of the float64 oracle; 1: the discrepancy is there; 2: could not run.
"""
'''
    return head + _SCRIPT_BODY.replace("#HELPERS#", helpers)


_SCRIPT_BODY = '''
from __future__ import annotations

import argparse
import importlib
import math
import os
import re
import sys
import warnings
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


#HELPERS#


def _move(tensor: torch.Tensor, device: str) -> torch.Tensor:
    """``tensor`` on ``device`` with its whole storage, offset and strides (a view of a pool stays a view)."""
    target = torch.device(device)
    if tensor.device == target or tensor.device.type == "meta":
        return tensor
    storage = tensor.untyped_storage()
    moved = storage.cpu() if target.type == "cpu" else storage.to(device=target)
    return torch.empty(0, dtype=tensor.dtype, device=target).set_(
        moved, tensor.storage_offset(), tensor.size(), tensor.stride()
    )


def _to(value: Any, device: str, recorded: Any = None, main: str = "") -> Any:
    """Tensors to ``device``; one recorded on another device than ``main`` stays on that device
    (a call that mixes devices on purpose keeps mixing them)."""
    if isinstance(value, torch.Tensor):
        if isinstance(recorded, str) and recorded != main:
            return _move(value, recorded) if not recorded.startswith("cuda") or torch.cuda.is_available() else value
        return _move(value, device)
    if isinstance(value, (tuple, list)):
        rec = recorded if isinstance(recorded, list) else [None] * len(value)
        out = [_to(v, device, r, main) for v, r in zip(value, rec)]
        return tuple(out) if isinstance(value, tuple) else out
    if isinstance(value, dict):
        rec = recorded if isinstance(recorded, dict) else {}
        return {k: _to(v, device, rec.get(k), main) for k, v in value.items()}
    return value


def _peer_module(source: dict) -> Any:
    if source["kind"] == "import":
        return importlib.import_module(source["module"])
    path = find_source(source["package"], source["path"])
    if path is None:
        raise ImportError(f"{source['package']}/{source['path']} is not on sys.path")
    return exec_source("_repro_" + source["package"], path, stubs_for(source.get("stubs")))


def _import_impl(spec: str, where: str | None = None) -> Any:
    module, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(module)
    except ImportError:
        if not where or not os.path.isdir(where) or where in sys.path:
            raise ImportError(
                f"cannot import {module!r}: put the directory that holds it on PYTHONPATH"
                + (f" (it was found in {where} when recorded)" if where else "")
            ) from None
        sys.path.insert(0, where)  # where the module was found when the call was recorded
        obj = importlib.import_module(module)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj() if isinstance(obj, type) else obj


def _poison_allocator(device: str, nbytes: int) -> None:
    """Fill memory the allocator will hand out next with 0xA5 and free it, so a peer's
    ``torch.empty`` buffer shows what it never wrote (CUDA's caching allocator reuses the block);
    then, as the suite's guard does, have torch fill every uninitialised allocation (uint8 0xFF,
    floats NaN: ``torch.utils.deterministic.fill_uninitialized_memory`` under warn-only
    deterministic mode), so the result does not depend on the allocator's history."""
    if nbytes > 0:
        block = torch.full((2 * nbytes,), 0xA5, dtype=torch.uint8, device=device)
        del block
    warnings.filterwarnings("ignore", message=".*deterministic.*")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", help="module:Class of an implementation to run instead (same capability)")
    parser.add_argument("--device", help="device to run on (default: the recorded one)")
    opts = parser.parse_args()
    data = torch.load(os.path.join(HERE, "inputs.pt"), map_location="cpu", weights_only=True)
    device = opts.device or data["device"]
    if device.startswith("cuda") and not torch.cuda.is_available():
        how = "asked for" if opts.device else "recorded on"
        print(f"{how} {device}; no CUDA device here: use --device cpu if the implementation runs there")
        return 2
    if not device.startswith("cuda"):
        os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels on a CPU run interpreted
    capability = data.get("capability", "sparse_mla_forward")
    wanted = "a TypeError or ValueError" + (f" naming {data['expect_error']!r}" if data["expect_error"] else "")
    native = data.get("native") if not opts.impl else None
    try:
        if native is not None:
            target = _peer_module(native["source"])
        else:
            target = _import_impl(opts.impl or data["impl"], None if opts.impl else data.get("impl_path"))
    except Exception as exc:  # noqa: BLE001 - not the answer under test: the environment
        print(f"cannot run: the implementation does not load ({type(exc).__name__}: {exc})")
        if isinstance(exc, ImportError):
            print("  run the script with the directory that holds the implementation's module on PYTHONPATH "
                  "(PYTHONPATH=/path/to/dir python repro.py), as pytest had it (its rootdir or a conftest's folder)")
        return 2
    if "expected_split" in data:
        _poison_allocator(device, data["expected_split"].numel() * data["expected_split"].element_size())
    try:
        if native is not None:
            args = [getattr(target, a["__module_call__"])()[a["index"]] if isinstance(a, dict) and
                    "__module_call__" in a else a for a in _to(native["args"], device)]  # fmt: skip
            with stubbed(stubs_for(native["source"].get("stubs"))):
                result = getattr(target, native["function"])(*args, **_to(native["kwargs"], device))
            output, lse = (result[0] if isinstance(result, (tuple, list)) else result), None
        else:
            devs = data.get("devices") or {}
            args = _to(data["args"], device, devs.get("args"), data["device"])
            kwargs = _to(data["kwargs"], device, devs.get("kwargs"), data["device"])
            result = getattr(target, capability)(*args, **kwargs)
            if isinstance(result, (tuple, list)):
                output, lse = result[0], (result[1] if len(result) > 1 else None)
            elif hasattr(result, "output"):
                output, lse = result.output, getattr(result, "lse", None)
            else:
                output, lse = result, None
    except Exception as exc:  # the answer under test, or an environment problem
        text = f"{type(exc).__name__}: {exc}"
        if data["expect_error"] is not None:
            pattern = r"\\b" + re.escape(data["expect_error"]) + r"\\b"
            word = not data["expect_error"] or bool(re.search(pattern, str(exc)))
            named = exc.__class__.__name__ in ("TypeError", "ValueError") and word
            print(("OK: " if named else "DISCREPANCY: ") + f"raised {text}; expected {wanted}")
            return 0 if named else 1
        print(f"DISCREPANCY: raised {text}; the call must succeed")
        return 1
    if data["expect_error"] is not None:
        print(f"DISCREPANCY: no error raised; expected {wanted}")
        return 1
    if "expected_split" in data:
        lines = _judge_bytes(data["expected_split"], output, "split")
        if lines:
            print("DISCREPANCY (expected = the bundled torch split from empty buffers):")
            print("\\n".join("  " + line for line in lines))
            return 1
        print("OK: the split's bytes equal the bundled torch split's")
        return 0
    if "expected_output" not in data:  # the oracle refused the inputs: the recorded error was the discrepancy
        print("OK: the call ran without error (no oracle expectation was recorded for it)")
        return 0
    lines = _judge(data["expected_output"], data["output_bound"], output, "output")
    if lse is not None and "expected_lse_natural" in data:
        got = lse.double()
        if data["lse_convention"] != "flashmla":
            got = got * (math.log(2.0) / data["lse_scale"])
        lines += _judge(data["expected_lse_natural"], data["lse_bound_natural"], got, "lse (natural log)")
    if lines:
        print("DISCREPANCY (expected = float64 oracle):")
        print("\\n".join("  " + line for line in lines))
        return 1
    print("OK: within the bound of the float64 oracle" + (" (output only: the peer's LSE is in its own convention)"
                                                          if native is not None else ""))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''
