"""The implementation under test as the suites see it: inside its envelope, with one result shape.

The ``sparse_mla_impl`` fixture hands the suites a :class:`GuardedImplementation` around the
selected implementation. Its ``sparse_mla_forward``:

* reads each well-formed call once (:func:`read_call`) and checks it against the implementation's
  envelope (:func:`envelope_of`, ``SparseMlaCall.envelope_reason``); a call outside a *declared*
  envelope is a bug of the suite's case fitting and fails as such (the kernel is never called). A
  built-in peer adapter is handed that read call (``implementations._peer.PeerAdapter.forward_call``)
  instead of reading and checking it again;
* drops ``lse_convention`` / ``lse_scale`` for a kernel that returns no LSE, ``lse_scale`` for one
  without the FlashInfer convention, and asks such a kernel for its own convention when a call
  names none (the protocol's default is ``"flashinfer"``);
* turns :class:`pytest_sparse_mla.Unsupported` into a skip (no envelope declared) or a failure
  (the call lies inside the envelope the implementation declared);
* accepts FlashMLA's ``(output, lse)`` tuple, a bare output tensor (no LSE) or a result object
  with ``output`` / ``lse`` / ``route``, and gives back a :class:`ForwardResult`;
* fails a result of another form (no output, an output that is not a BF16 tensor, an output that
  is not ``[num_tokens, num_heads, d_v]`` or an LSE that is not ``[num_tokens, num_heads]`` for the
  call's queries and ``fmt`` (:func:`expected_shapes`), no LSE although the envelope declares LSE
  conventions) with :class:`ResultFormError`: the plugin then stops the
  run and reports it once as a usage error (exit status 4), since every test would fail alike;
* makes the call again when it runs out of device memory, after releasing this process's cached
  memory, and fails it as an environment condition when every try does
  (``device_health.with_memory_retries``, ``OutOfDeviceMemory``): neither the kernel's verdict nor,
  when the adapter allocated, the adapter's.

Its ``page_split`` runs with uninitialised memory poisoned (:func:`uninitialised_memory_poisoned`):
a destination the implementation allocates with ``torch.empty`` and never writes holds 0xFF bytes,
not whatever the allocator happened to hand out (on a CPU, fresh pages are often zero, and the
stale-scratch bug of sgl-project/sglang PR #39288 passed or failed with the allocator's history).

A verdict comes from the kernel, never from this package's adapter code (:func:`peer_was_not_asked`):
with one of the built-in peer adapters (``implementations._peer.PeerAdapter``), an
``UnsafeForPeer`` refusal fails the test (a discrepancy, listed in the peer's xfail file), an error
the adapter raised itself on a call the suites consider valid fails it, and one it raised on
deliberately bad input skips the test as not asked (the peer never saw the input), so no test
passes on an adapter's check.

Every other attribute is the implementation's own. Deliberately malformed calls (the bad-input
suite) go through :meth:`GuardedImplementation.bad_call`, straight to the implementation. Each call
is recorded for ``--sparse-mla-repro-dir`` (:mod:`pytest_sparse_mla.recording`) and as the kernel call in
flight (:mod:`pytest_sparse_mla.device_health`: a dead CUDA context's or a timeout's message names it).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

from pytest_sparse_mla.envelope import INVARIANCE_CLAIMS, UNIVERSAL, Envelope, Unsupported

if TYPE_CHECKING:
    from pytest_sparse_mla.attention.call import SparseMlaCall

__all__ = [
    "RESULT_FORM_KEY",
    "RESULT_FORM_POINTER",
    "RESULT_FORM_STOP",
    "ForwardResult",
    "ResultFormError",
    "GuardedImplementation",
    "call_reason",
    "check_result_shapes",
    "expected_shapes",
    "peer_was_not_asked",
    "envelope_of",
    "read_call",
    "result_of",
    "uninitialised_memory_poisoned",
]


def envelope_of(impl: Any) -> Envelope:
    """The envelope the suites hold ``impl`` to: the declared one, else :data:`UNIVERSAL`, with
    every bitwise invariance claim when the default profile of its compute mode is bitwise
    (``tolerances.profile_for``: ``"exact"``).

    Raises:
        pytest.UsageError: as ``implementations.registry.declared_envelope``.
    """
    from pytest_sparse_mla import tolerances
    from pytest_sparse_mla.implementations.registry import declared_envelope

    env = declared_envelope(impl)
    if env is not None:
        return env
    profiles = tolerances.DEFAULT_PROFILES
    bitwise = profiles.get(tolerances.profile_for(impl), profiles["kernel"]).bitwise_invariants
    return Envelope(bitwise_invariance=frozenset(INVARIANCE_CLAIMS)) if bitwise else UNIVERSAL


@dataclass(frozen=True)
class ForwardResult:
    """A forward result in one shape.

    Attributes:
        output: ``[T, H, d_v]`` as the kernel returned it.
        lse: ``[T, H]`` or ``None`` (a kernel whose envelope declares no LSE).
        route: ``"decode"`` / ``"prefill"`` where the kernel reports one, else ``None``.
    """

    output: Any
    lse: Any = None
    route: str | None = None


#: ``user_properties`` key of a test report whose failure is a :class:`ResultFormError` (its message).
RESULT_FORM_KEY = "sparse_mla_result_form"
#: Why a run with such a failure stops (``session.shouldstop``).
RESULT_FORM_STOP = "usage error: the implementation's results have the wrong form"
#: The failure text of such a test: the message is written once, in the session's usage-error section.
RESULT_FORM_POINTER = (
    "the implementation's result has the wrong form: the fix is in the 'sparse-mla usage error' section"
)


class ResultFormError(pytest.fail.Exception):  # type: ignore[misc,name-defined]
    """The implementation returned a result the protocol does not describe (a test failure that
    the plugin turns into one usage error for the run: ``plugin._ControllerHooks``)."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg, pytrace=False)


def _form_error(name: str, what: str) -> ResultFormError:
    return ResultFormError(
        f"{name}.sparse_mla_forward returned {what}; a result must be an object with .output (and .lse), "
        "an (output, lse) pair as FlashMLA returns, or the output tensor alone, where output is a BF16 "
        "tensor [num_tokens, num_heads, d_v] and lse an fp32 tensor [num_tokens, num_heads] "
        "(pytest_sparse_mla.implementations, the protocol)"
    )


def _dims(shape: Any) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def _looks_like_lse(x: Any) -> bool:
    return str(getattr(x, "dtype", "")) == "torch.float32" and len(getattr(x, "shape", ())) == 2


def _looks_like_output(x: Any) -> bool:
    return str(getattr(x, "dtype", "")) == "torch.bfloat16" and len(getattr(x, "shape", ())) == 3


def check_result_shapes(result: ForwardResult, num_tokens: int, num_heads: int) -> None:
    """Assert a forward result's shapes and dtypes: output BF16 ``[T, H, 512]``, LSE (when there is
    one) fp32 ``[T, H]``.

    Raises:
        AssertionError: naming the quantity, the expected and the actual shape and dtype.
    """
    t, h = num_tokens, num_heads
    out = result.output
    assert str(out.dtype) == "torch.bfloat16" and tuple(out.shape) == (t, h, 512), (
        f"output: expected BF16 [{t}, {h}, 512], got {out.dtype} {tuple(out.shape)}"
    )
    if result.lse is not None:
        lse = result.lse
        assert str(lse.dtype) == "torch.float32" and tuple(lse.shape) == (t, h), (
            f"lse: expected fp32 [{t}, {h}], got {lse.dtype} {tuple(lse.shape)}"
        )


def expected_shapes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The shapes the protocol gives the result of the call ``(args, kwargs)``: output
    ``[num_tokens, num_heads, d_v]`` and LSE ``[num_tokens, num_heads]``, from the queries
    (``q``: ``[num_tokens, num_heads, d_qk]``) and the call format (``fmt``, default ``"dsv4"``;
    ``d_v`` of its main record format, ``formats.cache_formats``: 512 for every format). ``None``
    for a call whose ``q`` is not a 3-D tensor or whose ``fmt`` is unknown (a malformed call, which
    the implementation under test is left to refuse)."""
    from pytest_sparse_mla import formats

    q = args[0] if args else kwargs.get("q")
    shape = getattr(q, "shape", None)
    if shape is None or len(shape) != 3:
        return None
    try:
        d_v = int(formats.cache_formats(kwargs.get("fmt", "dsv4"))[0].d_v)
    except (TypeError, ValueError, KeyError):
        return None
    t, h = int(shape[0]), int(shape[1])
    return (t, h, d_v), (t, h)


def result_of(
    res: Any,
    env: Envelope,
    name: str,
    shapes: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
) -> ForwardResult:
    """``res`` (an object with ``output``, an ``(output, lse)`` pair or a bare tensor) as a
    :class:`ForwardResult`.

    Args:
        shapes: the output's and the LSE's expected shapes (:func:`expected_shapes`), or ``None``
            (not checked).

    Raises:
        ResultFormError: no output, an output that is not a BF16 tensor, an output or an LSE whose
            shape is not the one of ``shapes`` (e.g. ``[T, H*512]`` for ``[T, H, 512]``), a tuple or list that is
            not a pair (FlashMLA's ``(output, max_logits, lse)`` triple would have ``max_logits``
            judged as the LSE), a pair in the order ``(lse, output)``, or no LSE although ``env``
            declares LSE conventions.
    """
    if isinstance(res, (tuple, list)):
        if len(res) != 2:
            triple = (
                "; FlashMLA's flash_mla_sparse_fwd (flash_mla/flash_mla_interface.py) and vLLM's "
                "triton_bf16_mla_sparse_interface return (output, max_logits, lse): return (output, lse) "
                "from the adapter"
                if len(res) == 3
                else ""
            )
            raise _form_error(name, f"a {type(res).__name__} of {len(res)} item{'' if len(res) == 1 else 's'}{triple}")
        output, lse, route = res[0], res[1], None
        if _looks_like_lse(output) and _looks_like_output(lse):
            swapped = "(lse, output), the pair swapped (an fp32 [T, H] tensor first, BF16 [T, H, D] second)"
            raise _form_error(name, swapped)
    elif hasattr(res, "output"):
        output, lse, route = res.output, getattr(res, "lse", None), getattr(res, "route", None)
    elif hasattr(res, "shape") and hasattr(res, "dtype"):
        output, lse, route = res, None, None
    else:
        raise _form_error(name, f"a {type(res).__name__}")
    dtype = getattr(output, "dtype", None)
    if dtype is None or str(dtype) != "torch.bfloat16":
        got = f"an output of type {type(output).__name__}" if dtype is None else f"a {dtype} output"
        shape = getattr(output, "shape", None)
        raise _form_error(name, got if shape is None else f"{got} of shape {tuple(shape)}")
    if shapes is not None and tuple(output.shape) != shapes[0]:
        raise _form_error(name, f"an output of shape {_dims(output.shape)} for a call that needs {_dims(shapes[0])}")
    if not env.returns_lse:
        lse = None
    elif lse is None:
        raise ResultFormError(
            f"{name}.sparse_mla_forward returned no LSE, but its envelope declares "
            f"lse_conventions={env.lse_conventions} (declare lse_conventions=() for an output-only kernel)"
        )
    lse_shape = getattr(lse, "shape", None)
    if shapes is not None and lse is not None and (lse_shape is None or tuple(lse_shape) != shapes[1]):
        got = f"of type {type(lse).__name__}" if lse_shape is None else f"of shape {_dims(lse_shape)}"
        raise _form_error(name, f"an LSE {got} for a call that needs {_dims(shapes[1])}")
    return ForwardResult(output, lse, route if isinstance(route, str) else None)


@contextmanager
def uninitialised_memory_poisoned() -> Iterator[None]:
    """Inside: ``torch.empty`` and its kin fill new memory with a known value (floating point NaN,
    integers their dtype's maximum: uint8 0xFF), by turning on torch's deterministic mode with
    ``warn_only=True`` and ``torch.utils.deterministic.fill_uninitialized_memory`` (PyTorch
    ``torch.use_deterministic_algorithms`` documentation); its warnings about operations without
    a deterministic implementation are silenced. Both settings are restored on exit."""
    import torch

    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    was_fill = torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # type: ignore[attr-defined]
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*deterministic.*")
            yield
    finally:
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = was_fill  # type: ignore[attr-defined]


_POSITIONAL = ("q", "kv_cache", "indices")


def peer_was_not_asked(impl: Any, exc: BaseException) -> str | None:
    """Where a built-in peer adapter raised ``exc`` itself, before or instead of its peer, or ``None``.

    ``None`` for an implementation that is not a ``PeerAdapter`` (the bundled reference, a user's
    kernel: its errors are its own), for ``Unsupported`` (outside the envelope: a skip) and for an
    exception the peer raised (``_peer.raised_by_peer``: it came out of ``_peer.call_peer``).

    Returns:
        ``"file.py:line in function"`` of the innermost frame that raised it.
    """
    from pytest_sparse_mla.implementations._peer import PeerAdapter, raised_by_peer

    if not isinstance(impl, PeerAdapter) or isinstance(exc, Unsupported) or raised_by_peer(exc):
        return None
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return "?"
    code = tb.tb_frame.f_code
    return f"{code.co_filename.rsplit('/', 1)[-1]}:{tb.tb_lineno} in {code.co_name}"


def read_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> SparseMlaCall | None:
    """The call ``(args, kwargs)`` of ``sparse_mla_forward`` as ``attention.call.SparseMlaCall.read``
    reads it (keywords it does not read are left out), or ``None`` for a malformed call, which the
    implementation under test is left to refuse."""
    from pytest_sparse_mla.attention.call import CALL_ARGUMENTS, SparseMlaCall

    given = {**dict(zip(_POSITIONAL, args, strict=False)), **kwargs}
    try:
        return SparseMlaCall.read(
            *(given.get(name) for name in _POSITIONAL), **{k: v for k, v in given.items() if k in CALL_ARGUMENTS}
        )
    except (TypeError, ValueError, IndexError, AttributeError):
        return None


def _reason(env: Envelope, call: SparseMlaCall, kwargs: dict[str, Any]) -> str | None:
    """Why a read call with ``[T, H, d_qk]`` queries lies outside ``env`` (``SparseMlaCall.envelope_reason``,
    with its page sizes, and its LSE convention when the call names one), or ``None``."""
    return call.envelope_reason(env, lse="lse_convention" in kwargs)


def call_reason(env: Envelope, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why a well-formed call lies outside ``env``, or ``None`` (also for a malformed call, which
    the implementation under test is left to refuse): the call read once (:func:`read_call`) and
    held to the envelope with its page sizes and its LSE convention (``SparseMlaCall.envelope_reason``).
    """
    call = read_call(args, kwargs)
    if call is None or call.q.dim() != 3:
        return None
    return _reason(env, call, kwargs)


class GuardedImplementation:
    """The implementation under test behind the envelope guard (module docstring).

    Args:
        impl: the selected implementation.
        envelope: the envelope it is held to (:func:`envelope_of`).
        declared: whether the implementation declared it (refusals inside it then fail).
        untimed: ``None`` (no warm-ups), or a function returning a context manager inside which time
            is not the test's (``device_health.untimed`` of the test), or ``None`` when the test has
            no time limit. Given it, a forward call on CUDA tensors whose shape key
            (``search_speed.shape_key``) this process has not met is first run once on copies of
            its arguments inside that context (``search_speed.warm_arguments``), so that a JIT
            kernel's compile and autotune for a new shape are not counted in the judged call's time
            limit. The warm-up is not recorded (no reproducer replays it), its result is discarded,
            and an exception it raises is dropped: the judged call, made next on the real
            arguments, meets it again and is judged.
    """

    def __init__(
        self, impl: Any, envelope: Envelope, declared: bool, untimed: Callable[[], Any] | None = None
    ) -> None:
        self.unguarded = impl
        self.envelope = envelope
        self.declared = declared
        self._untimed = untimed
        self._name = str(getattr(impl, "name", None) or type(impl).__name__)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.unguarded, name)  # what the implementation lacks stays missing
        if name == "page_split":
            return lambda *args, **kwargs: self._recorded_split(attr, *args, **kwargs)
        return attr

    def sparse_mla_forward(self, *args: Any, **kwargs: Any) -> ForwardResult:
        """The implementation's ``sparse_mla_forward`` inside its envelope (module docstring)."""
        from pytest_sparse_mla.implementations._peer import takes_read_call

        env = self.envelope
        if not env.returns_lse:
            kwargs.pop("lse_convention", None)
        if "flashinfer" not in env.lse_conventions:  # lse_scale belongs to the FlashInfer convention
            kwargs.pop("lse_scale", None)
            if env.returns_lse:  # the protocol's default ("flashinfer") is not one this kernel honours
                kwargs.setdefault("lse_convention", env.lse_convention)
        impl = self.unguarded
        # A built-in peer adapter is handed the call read here (read once, held to the envelope once).
        hand_over = len(args) == len(_POSITIONAL) and takes_read_call(impl, kwargs)
        call = read_call(args, kwargs) if self.declared or hand_over else None
        judged = self.declared and call is not None and call.q.dim() == 3
        reason = _reason(env, call, kwargs) if judged and call is not None else None
        if reason is not None:
            pytest.fail(
                f"pytest-sparse-mla called {self._name} outside its declared envelope ({reason}): "
                "a bug of the suite's case fitting, not of the kernel",
                pytrace=False,
            )
        from pytest_sparse_mla import device_health, recording

        self._warm(args, kwargs)
        with recording.judged_call(args, kwargs) as rec:
            running = device_health.begin_call(self._name, "sparse_mla_forward", args, kwargs)
            try:
                if hand_over and call is not None:
                    return_fp32 = bool(kwargs.get("return_fp32", False))
                    res = device_health.with_memory_retries(
                        lambda: impl.forward_call(call, return_fp32=return_fp32, envelope_checked=judged),
                        f"{self._name}.sparse_mla_forward",
                    )
                else:
                    res = device_health.with_memory_retries(
                        lambda: impl.sparse_mla_forward(*args, **kwargs), f"{self._name}.sparse_mla_forward"
                    )
            except Unsupported as exc:
                if self.declared:
                    pytest.fail(f"{self._name} refused a call inside its declared envelope: {exc}", pytrace=False)
                pytest.skip(f"{self._name} refused the call: {exc}")
            except Exception as exc:  # not OutOfDeviceMemory (a pytest outcome): never the adapter's verdict
                recording.note_error(rec, exc)  # the implementation's error, not the outcome the guard makes of it
                self._judge_adapter_error(exc, bad_input=None)
                raise
            finally:
                device_health.end_call(running)
            result = result_of(res, env, self._name, expected_shapes(args, kwargs))
            recording.set_result(rec, result.output, result.lse)
        return result

    def _warm(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The warm-up of a forward call on a new shape (the ``untimed`` argument above)."""
        if self._untimed is None or len(args) != len(_POSITIONAL):
            return
        from pytest_sparse_mla import device_health, search_speed

        key = search_speed.shape_key(*args, kwargs)
        if key is None or key in search_speed.WARMED:
            return
        context = self._untimed()
        if context is None:  # the test has no time limit: nothing to keep compile time out of
            return
        search_speed.WARMED.add(key)
        with context:
            running = device_health.begin_call(self._name, "sparse_mla_forward", args, kwargs)
            try:
                search_speed.warm_arguments(self.unguarded, *args, kwargs)
            except Exception:  # noqa: BLE001 - the judged call meets it again and is judged
                pass
            finally:
                device_health.end_call(running)

    def _recorded_split(self, split: Any, *args: Any, **kwargs: Any) -> Any:
        """The implementation's ``page_split`` (reached as ``.page_split`` when it has one), run with
        uninitialised memory poisoned, recorded for ``--sparse-mla-repro-dir`` and as the kernel call
        in flight (``device_health``)."""
        from pytest_sparse_mla import device_health, recording

        with recording.judged_call(args, kwargs, capability="page_split") as rec, uninitialised_memory_poisoned():
            running = device_health.begin_call(self._name, "page_split", args, kwargs)
            try:
                out = device_health.with_memory_retries(lambda: split(*args, **kwargs), f"{self._name}.page_split")
            except Exception as exc:
                self._judge_adapter_error(exc, bad_input=None)
                raise
            finally:
                device_health.end_call(running)
            recording.set_result(rec, out, None)
        return out

    def bad_call(self, argument: str, *args: Any, capability: str = "sparse_mla_forward", **kwargs: Any) -> Any:
        """Call the implementation's ``capability`` (``sparse_mla_forward`` or ``page_split``) with
        deliberately bad input (no guard): it must raise a ``TypeError`` or ``ValueError`` naming
        ``argument`` (``""``: any such error). Recorded for ``--sparse-mla-repro-dir`` with that
        expectation."""
        from pytest_sparse_mla import device_health, recording

        with recording.judged_call(args, kwargs, expect_error=argument, capability=capability):
            running = device_health.begin_call(self._name, capability, args, kwargs)
            try:
                return getattr(self.unguarded, capability)(*args, **kwargs)
            except Exception as exc:
                self._judge_adapter_error(exc, bad_input=argument)
                raise
            finally:
                device_health.end_call(running)

    def _judge_adapter_error(self, exc: Exception, bad_input: str | None) -> None:
        """Keep an error a built-in peer adapter raised itself from deciding the test
        (:func:`peer_was_not_asked`): ``UnsafeForPeer`` fails it; another error fails it on a
        valid call (``bad_input=None``) and skips it as not asked on deliberately bad input
        (``bad_input``: the argument the test expects named). Returns for the peer's own errors."""
        where = peer_was_not_asked(self.unguarded, exc)
        if where is None:
            return
        from pytest_sparse_mla.implementations._peer import UnsafeForPeer

        peer = getattr(self.unguarded, "peer", None) or self._name
        if isinstance(exc, UnsafeForPeer):
            pytest.fail(
                f"{peer} was not run: {exc} (the adapter refused an input the peer would mishandle out "
                "of bounds: a discrepancy, never a pass)",
                pytrace=False,
            )
        said = f"{type(exc).__name__} at {where}: {exc}"
        if bad_input is None:
            pytest.fail(
                f"{self._name}'s adapter raised before {peer} ran, on a call the suites consider valid ({said})",
                pytrace=False,
            )
        pytest.skip(
            f"not asked: {self._name}'s adapter refused this input itself ({said}); {peer} never ran, so its "
            f"own handling of bad {bad_input or 'input'} is not measured"
        )

    def __repr__(self) -> str:
        return f"<guarded {self.unguarded!r}>"
