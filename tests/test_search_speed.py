"""Self-tests of the search's speed helpers: a timeout inside a compiler says so
(``device_health.compiling_in``, ``device_health.note_timeout``), and ``search_speed.warm`` runs the
implementation once on copies of a built call's inputs.

The stacks are written by hand: frames named as Triton 3.6's and TileLang's files name them
(``triton/runtime/autotuner.py`` ``Autotuner.run``, ``triton/compiler/compiler.py`` ``compile``,
``triton/backends/nvidia/compiler.py`` ``make_cubin`` running ``ptxas`` through ``subprocess``).
"""

from __future__ import annotations

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
