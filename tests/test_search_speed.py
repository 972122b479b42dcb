"""Self-tests of the search's speed helpers: a timeout inside a compiler says so
(``device_health.compiling_in``, ``device_health.note_timeout``), and ``search_speed.warm`` runs the
implementation once on copies of a built call's inputs.

The stacks are written by hand: frames named as Triton 3.6's and TileLang's files name them
(``triton/runtime/autotuner.py`` ``Autotuner.run``, ``triton/compiler/compiler.py`` ``compile``,
``triton/backends/nvidia/compiler.py`` ``make_cubin`` running ``ptxas`` through ``subprocess``).
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from types import SimpleNamespace

import pytest
import torch

from pytest_sparse_mla import device_health, search_speed

SITE = "/usr/lib/python3.12/site-packages"


def _stack(*frames: tuple[str, str]) -> list[traceback.FrameSummary]:
    test = [("/work/suites/test_attention_search.py", "drawn"),
            (f"{SITE}/pytest_sparse_mla/guard.py", "sparse_mla_forward")]  # fmt: skip
    return [traceback.FrameSummary(path, 1, name) for path, name in [*test, *frames]]


AUTOTUNER = (f"{SITE}/triton/runtime/autotuner.py", "run")
JIT_RUN = (f"{SITE}/triton/runtime/jit.py", "run")
COMPILE = (f"{SITE}/triton/compiler/compiler.py", "compile")
CUBIN = (f"{SITE}/triton/backends/nvidia/compiler.py", "make_cubin")
SUBPROCESS = ("/usr/lib/python3.12/subprocess.py", "run")


@pytest.mark.parametrize(
    ("frames", "words"),
    [
        ((AUTOTUNER, JIT_RUN, COMPILE), "Triton's autotuner compiling for a new shape"),
        ((AUTOTUNER, JIT_RUN, COMPILE, CUBIN, SUBPROCESS),
         "Triton's autotuner compiling for a new shape, waiting for ptxas (a subprocess)"),
        ((AUTOTUNER, (f"{SITE}/triton/testing.py", "do_bench")),
         "Triton's autotuner benchmarking configurations for a new shape"),
        ((JIT_RUN, COMPILE), "Triton's compiler compiling a kernel for a new shape"),
        (((f"{SITE}/tilelang/jit/kernel.py", "__init__"),), "TileLang's JIT build"),
        (((f"{SITE}/torch/utils/cpp_extension.py", "load"), SUBPROCESS),
         "a torch.utils.cpp_extension JIT build (a C++/CUDA extension compiling)"),
    ],
    ids=["autotuner-compiling", "ptxas", "autotuner-benchmarking", "jit-compile", "tilelang", "cpp-extension"],
)  # fmt: skip
def test_a_stack_inside_a_compiler_is_named(frames: tuple[tuple[str, str], ...], words: str) -> None:
    assert device_health.compiling_in(_stack(*frames)) == words


def test_a_kernel_that_runs_is_not_compiling() -> None:
    # A launched Triton kernel: jit.py's run without a compile frame below it; a synchronisation.
    assert device_health.compiling_in(_stack(JIT_RUN)) is None
    assert device_health.compiling_in(_stack((f"{SITE}/torch/cuda/__init__.py", "synchronize"))) is None


def test_a_signal_timeout_inside_the_autotuner_says_so() -> None:
    """The ``signal`` method: the failure raised in the innermost frame, here one compiled with Triton's
    compiler's file name, called from one with the autotuner's: the message names the autotuner, not
    a kernel call that did not return."""
    namespace: dict[str, object] = {}
    exec(compile("def compile(fail):\n    fail()\n", f"{SITE}/triton/compiler/compiler.py", "exec"), namespace)
    exec(compile("def run(inner, fail):\n    inner(fail)\n", f"{SITE}/triton/runtime/autotuner.py", "exec"), namespace)

    def timeout() -> None:
        pytest.fail("Timeout (>1.0s) from pytest-timeout.")

    device_health.begin_test()
    running = device_health.begin_call("k", "sparse_mla_forward", (torch.zeros(2),), {})
    try:
        namespace["run"](namespace["compile"], timeout)  # type: ignore[operator]
    except pytest.fail.Exception as exc:
        info = SimpleNamespace(excinfo=SimpleNamespace(value=exc, tb=exc.__traceback__))
        device_health.note_timeout(info)  # type: ignore[arg-type]
        message = str(exc.msg)
    device_health.end_call(running)
    assert message.startswith(
        "Timeout (>1.0s) from pytest-timeout. The time limit ended inside Triton's autotuner compiling for a new "
        "shape: compile and autotune time is not the kernel's run time"
    ), message
    assert "the kernel call in flight: k.sparse_mla_forward(" in message
    assert "did not return" not in message


def test_warm_calls_the_implementation_once_on_copies_of_the_inputs() -> None:
    pool = torch.arange(64, dtype=torch.uint8)
    cache = pool[16:48].view(2, 16)  # a view inside a larger allocation, offset 16
    inputs = SimpleNamespace(q=torch.ones(1, 2, 4), kv_cache=cache, indices=torch.zeros(1, 3, dtype=torch.int32),
                             kwargs={"sm_scale": 0.5, "attn_sink": torch.zeros(2)})  # fmt: skip
    seen = []

    class Impl:
        def sparse_mla_forward(self, q, kv_cache, indices, **kwargs):  # type: ignore[no-untyped-def]
            seen.append((q, kv_cache, indices, kwargs))
            kv_cache.fill_(255)  # a kernel that writes into its input writes into the copy
            return q

    assert search_speed.warm(Impl(), inputs) >= 0.0
    (q, kv, idx, kwargs), = seen
    assert torch.equal(kv, cache) is False and bool((kv == 255).all())
    assert torch.equal(cache, torch.arange(16, 48, dtype=torch.uint8).view(2, 16))  # the judged inputs unchanged
    assert kv.storage_offset() == 16 and kv.stride() == (16, 1) and kv.untyped_storage().nbytes() == 64
    assert kv.untyped_storage().data_ptr() != pool.untyped_storage().data_ptr()
    assert torch.equal(q, inputs.q) and q.data_ptr() != inputs.q.data_ptr() and torch.equal(idx, inputs.indices)
    assert kwargs["sm_scale"] == 0.5 and torch.equal(kwargs["attn_sink"], torch.zeros(2))


def _thread_settings(seconds: float) -> object:
    import pytest_timeout

    return pytest_timeout.Settings(timeout=seconds, method="thread", func_only=False, disable_debugger_detection=True)


def test_time_inside_untimed_is_not_the_tests_and_the_test_resumes_with_what_it_had_left(monkeypatch) -> None:
    """A test limited to 0.6 s spends 0.2 s, then 0.8 s warming (longer than its whole limit), then
    0.2 s: its timer never fires; without ``untimed`` the same sequence times out."""
    import time

    fired: list[tuple[str, float]] = []
    monkeypatch.setattr(device_health, "_on_thread_timeout", lambda item, s: fired.append((item.nodeid, s.timeout)))
    item = SimpleNamespace(nodeid="t::warm")
    assert device_health.start_thread_timer(item, _thread_settings(0.6)) is True
    time.sleep(0.2)
    with device_health.untimed(item, limit=5.0):
        time.sleep(0.8)
    time.sleep(0.2)
    item.cancel_timeout()
    assert fired == []
    assert 0.1 < item._sparse_mla_timer.left < 0.45  # resumed with 0.6 - 0.2 s, not the whole limit

    plain = SimpleNamespace(nodeid="t::plain")
    device_health.start_thread_timer(plain, _thread_settings(0.6))
    time.sleep(1.0)
    plain.cancel_timeout()
    assert fired == [("t::plain", 0.6)]


def test_a_warm_up_past_its_own_limit_is_a_timeout_while_warming(monkeypatch) -> None:
    import time

    fired: list[float] = []
    monkeypatch.setattr(device_health, "_on_thread_timeout", lambda item, s: fired.append(s.timeout))
    item = SimpleNamespace(nodeid="t::hang", config=SimpleNamespace(workerinput={"workerid": "gw0"}))
    device_health.start_thread_timer(item, _thread_settings(30.0))
    with device_health.untimed(item, limit=0.2):
        time.sleep(0.5)
        assert item._sparse_mla_warming is True
        monkeypatch.setattr(device_health, "_main_stack", lambda limit=12: "")
        message = device_health._timeout_message(item, 0.2)
    item.cancel_timeout()
    assert fired == [0.2]
    assert "while warming the kernel on a new shape" in message


def test_untimed_is_a_no_op_without_a_thread_timer() -> None:
    item = SimpleNamespace(nodeid="t::signal")
    with device_health.untimed(item, limit=0.1):
        pass
    assert not hasattr(item, "cancel_timeout")


def test_once_the_warm_up_budget_is_spent_calls_of_new_shapes_are_not_made(monkeypatch) -> None:
    """``SearchRun.note``/``warm`` on CUDA-looking inputs (the shape key reads ``q.device``): each warm
    takes 0.3 s against a budget of 0.5 s, so the third new shape is not made (``ColdShape``) while a
    warm shape still is."""
    import time

    from pytest_sparse_mla import search_run

    monkeypatch.setattr(search_speed, "warm", lambda impl, inputs: time.sleep(0.3) or 0.3)
    monkeypatch.setattr(search_run.search, "record", lambda call, inputs: {"call": call.describe()})
    monkeypatch.setattr(search_run.covering, "ends_of", lambda call: {})
    run = search_run.SearchRun(4, None, 0, lambda *a: None, warm_seconds=0.5)

    class CudaLooking(torch.Tensor):  # a CPU tensor whose device reads as CUDA: the shape key is all it feeds
        @property
        def device(self) -> SimpleNamespace:  # type: ignore[override]
            return SimpleNamespace(type="cuda")

    def inputs(heads: int) -> SimpleNamespace:
        call = SimpleNamespace(describe=lambda: f"heads={heads}")
        q = torch.zeros(1, heads, 512, dtype=torch.bfloat16).as_subclass(CudaLooking)
        return SimpleNamespace(q=q, kv_cache=torch.zeros(1, 64, 584, dtype=torch.uint8),
                               indices=torch.zeros(1, 64, dtype=torch.int32), call=call,
                               kwargs={"sm_scale": 0.1, "fmt": "dsv4"})  # fmt: skip

    for heads in (1, 2):
        x = inputs(heads)
        run.note(x.call, x)
        run.warm(None, x)
    with pytest.raises(search_run.ColdShape, match="heads=3"):
        run.note(inputs(3).call, inputs(3))
    run.note(inputs(2).call, inputs(2))  # a warm shape is still made
    assert run.spent["warm-up"] == 2 and 0.55 < run.warm_spent < 1.5 and len(run.drawn) == 3


def _guarded(calls: list[str], untimed: object, *, fail_first: bool = False) -> object:
    from pytest_sparse_mla import guard
    from pytest_sparse_mla.envelope import UNIVERSAL

    class Impl:
        name = "k"

        def sparse_mla_forward(self, q, kv_cache, indices, **kwargs):  # type: ignore[no-untyped-def]
            calls.append("warm" if q.data_ptr() != inputs[0].data_ptr() else "judged")
            if fail_first and len(calls) == 1:
                raise RuntimeError("compile failed")
            return torch.zeros(q.shape[0], q.shape[1], 512, dtype=torch.bfloat16), torch.zeros(q.shape[0], q.shape[1])

    return guard.GuardedImplementation(Impl(), UNIVERSAL, False, untimed=untimed)  # type: ignore[arg-type]


inputs = (torch.ones(1, 2, 512), torch.zeros(1, 64, 1, 584, dtype=torch.uint8), torch.zeros(1, 64, dtype=torch.int32))


def test_the_guard_warms_each_new_shape_once_outside_the_time_limit(monkeypatch) -> None:
    """A fixed case's first call of a shape is run once on copies inside ``untimed`` (a JIT
    kernel's compile and autotune are not its run time), then judged; the next call of that shape,
    and every call without a time limit, is not warmed. Shape keys are CUDA-only: the key is
    forced here for CPU tensors."""
    import contextlib

    monkeypatch.setattr(search_speed, "shape_key", lambda q, kv, idx, kw: (tuple(q.shape), "forced"))
    monkeypatch.setattr(search_speed, "WARMED", set())
    entered: list[int] = []

    @contextlib.contextmanager
    def limit_stopped():  # type: ignore[no-untyped-def]
        entered.append(1)
        yield

    calls: list[str] = []
    impl = _guarded(calls, limit_stopped)
    impl.sparse_mla_forward(*inputs, sm_scale=0.1)
    impl.sparse_mla_forward(*inputs, sm_scale=0.1)
    assert calls == ["warm", "judged", "judged"] and entered == [1]

    calls.clear()
    monkeypatch.setattr(search_speed, "WARMED", set())
    _guarded(calls, lambda: None).sparse_mla_forward(*inputs, sm_scale=0.1)  # no time limit: no warm-up
    assert calls == ["judged"]


def test_an_error_while_warming_is_left_to_the_judged_call(monkeypatch) -> None:
    import contextlib

    monkeypatch.setattr(search_speed, "shape_key", lambda q, kv, idx, kw: (tuple(q.shape), "forced"))
    monkeypatch.setattr(search_speed, "WARMED", set())
    calls: list[str] = []
    impl = _guarded(calls, contextlib.nullcontext, fail_first=True)
    impl.sparse_mla_forward(*inputs, sm_scale=0.1)  # the warm-up's error is dropped; the judged call runs
    assert calls == ["warm", "judged"]


@pytest.mark.full_tier  # a search run of a wrong kernel, shrunk and reported; 659 draws built (CONTRIBUTING.md)
@pytest.mark.parametrize(("twins", "derived"), [(True, False), (False, False), (True, True)],
                         ids=["warm-twins", "no-twins", "derived-inputs"])
def test_once_the_warm_up_budget_is_spent_a_drawn_call_is_judged_on_a_warm_shape(
    monkeypatch, twins: bool, derived: bool
) -> None:  # fmt: skip
    """A kernel that autotunes per shape spends the warm-up budget on its first shape; after that a
    drawn call of a new shape is judged with its own values on a shape already warm
    (``search.with_shape_of``), so a bug of values (here: wrong when the NoPE exponent is above 20)
    is still found. The shape keys are the real ones of the built tensors (``search_speed.shape_key``
    on CPU tensors that read as CUDA). Without the twins (``SearchRun._warm_twin`` off) the same run
    makes only the draws that happen to have the warm shape (1 or 2) and finds nothing. A property
    that judges inputs of another shape than the drawn call's (the lane-order property pads each row
    with a ``-1`` lane) names them to ``note`` (``judged=``): the shapes warmed are those judged, and
    the twins are made on them the same way."""
    from pytest_sparse_mla import search, search_run
    from pytest_sparse_mla.envelope import Envelope, Widths
    from pytest_sparse_mla.errors import NewDiscrepancy

    class CudaLooking(torch.Tensor):  # a CPU tensor whose device reads as CUDA: the shape key is all it feeds
        @property
        def device(self) -> SimpleNamespace:  # type: ignore[override]
            return SimpleNamespace(type="cuda")

    real_key = search_speed.shape_key
    monkeypatch.setattr(search_speed, "shape_key",
                        lambda q, kv, idx, kw: real_key(q.as_subclass(CudaLooking), kv, idx, kw))  # fmt: skip
    monkeypatch.setattr(search_speed, "WARMED", set())
    monkeypatch.setattr(search_speed, "warm", lambda impl, inputs: time.sleep(0.05))
    if not twins:
        monkeypatch.setattr(search_run.SearchRun, "_warm_twin", lambda self, call: None)
    small = Envelope(formats=("dsv4",), num_heads=(1, 2, 4), topk=Widths(max=64), extra_cache_formats=(),
                     page_block_sizes=(64,), max_tokens=4)  # cheap builds: every rejected draw is built  # fmt: skip
    run = search_run.SearchRun(12, None, 0, lambda *a: None, warm_seconds=0.01)
    made: list[tuple[object, ...]] = []

    def prop(call: search.DrawnCall) -> None:
        inputs = search.build(call)
        judged = inputs
        if derived:  # one -1 lane more per row: another indices shape than the drawn call's
            pad = torch.full((inputs.indices.shape[0], 1), -1, dtype=inputs.indices.dtype)
            judged = dataclasses.replace(inputs, indices=torch.cat([inputs.indices, pad], dim=1))
        run.note(call, inputs, judged=judged)
        run.warm(None, judged)
        made.append(search_speed.shape_key(judged.q, judged.kv_cache, judged.indices, judged.kwargs))
        if call.main.value_exponent > 20:
            raise AssertionError("wrong output for large NoPE values")

    if not twins:
        run.check(prop, small, "cpu", covering=False)  # nothing found: only draws of the one warm shape are made
        assert len(made) < 4 and run.spent["cold-shape"] > 100 and "warm-twin" not in run.spent, run.spent
        return
    with pytest.raises(NewDiscrepancy, match="wrong output for large NoPE values"):
        run.check(prop, small, "cpu", covering=False)
    assert len(search_speed.WARMED) == 1 and set(made) == search_speed.WARMED, made  # every call on the warm shape
    assert run.spent["warm-twin"] >= 2 and run.spent["warm-up"] == 1, run.spent
    (found,) = run.found
    assert found.call.main.value_exponent > 20 and found.region.conditions.get("value_exponent") == {"above-2**20"}, (
        found.region.text()
    )
