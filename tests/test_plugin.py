"""Self-tests of the plugin layer: loading, options, markers, skips, the report header, lazy imports."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from pytest_sparse_mla import capabilities

CPU_ONLY = not capabilities.probe().cuda_available


def test_importing_the_plugin_imports_no_heavy_module_and_touches_no_cuda() -> None:
    code = (
        "import sys, pytest_sparse_mla.plugin, pytest_sparse_mla.fixtures, pytest_sparse_mla.options\n"
        "heavy = [m for m in ('torch', 'triton', 'flashinfer') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_dash_p_sparse_mla_loads_the_plugin_and_its_fixtures(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        def test_cache(packed_kv_cache_factory):
            cache = packed_kv_cache_factory(num_pages=2, page_block_size=64, device="cpu")
            assert cache.packed.shape == (2, 64, 1, 584)
            assert cache.packed.stride(0) == 37440
        """
    )
    result = pytester.runpytest("-p", "sparse_mla", "--strict-markers")
    result.assert_outcomes(passed=1)


def test_report_header_says_what_ran_where(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_ok():\n    assert True\n")
    result = pytester.runpytest("-p", "sparse_mla", "--sparse-mla-seed", "1234")
    result.stdout.fnmatch_lines(
        [
            "sparse-mla: torch * (CUDA *), triton *, flashinfer *; *",
            "sparse-mla: device=auto seed=1234 impl=reference grid=none TRITON_INTERPRET=*",
        ]
    )
    result.assert_outcomes(passed=1)


def test_capability_markers_are_registered_for_strict_markers(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.sparse_mla_requires_triton
        @pytest.mark.sparse_mla_requires_torch(">=2.0")
        def test_ok():
            assert True
        """
    )
    result = pytester.runpytest("-p", "sparse_mla", "--strict-markers")
    result.assert_outcomes(passed=1)
    markers = pytester.runpytest("-p", "sparse_mla", "--markers")
    markers.stdout.fnmatch_lines(
        ["@pytest.mark.sparse_mla_requires_sm(spec)*", "@pytest.mark.sparse_mla_requires_flashinfer*"]
    )


@pytest.mark.skipif(not CPU_ONLY, reason="checks the skip reasons of a machine without a GPU")
def test_skips_on_a_cpu_machine_carry_their_reasons(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.sparse_mla_requires_cuda
        def test_cuda():
            assert False, "must not run"

        @pytest.mark.sparse_mla_requires_sm("12.0")
        def test_sm120():
            assert False, "must not run"

        @pytest.mark.sparse_mla_requires_flashinfer(">=99.0")
        def test_flashinfer():
            assert False, "must not run"
        """
    )
    result = pytester.runpytest("-p", "sparse_mla", "-rs")
    result.assert_outcomes(skipped=3)
    result.stdout.fnmatch_lines_random(
        [
            "*sparse_mla_requires_cuda: requires a CUDA device; found none (torch *",
            "*sparse_mla_requires_sm: requires compute capability ==12.0; found no CUDA device*",
            "*sparse_mla_requires_flashinfer: requires flashinfer-python>=99.0; *",
        ]
    )


@pytest.mark.skipif(not CPU_ONLY, reason="needs a machine without a GPU")
def test_require_gpu_turns_gpu_skips_into_failures(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.sparse_mla_requires_cuda
        def test_cuda():
            pass

        def test_device(sparse_mla_device):
            pass
        """
    )
    result = pytester.runpytest("-p", "sparse_mla", "--sparse-mla-require-gpu")
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines_random(
        ["*--sparse-mla-require-gpu: requires a CUDA device; found none*",
         "*--sparse-mla-require-gpu: the suites would run on the CPU*"]
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--sparse-mla-device", "tpu"], "*invalid choice: 'tpu'*"),
        (
            ["--sparse-mla-grid", "flashinfer==latest"],
            "*--sparse-mla-grid='flashinfer==latest': *expected a flashinfer-python version*",
        ),
        (["--sparse-mla-seed", "abc"], "*--sparse-mla-seed='abc': expected an integer*"),
        (["--sparse-mla-grid", "flashinfer==0.6.13"], "*--sparse-mla-grid='flashinfer==0.6.13': *0.6.14*"),
        (["--sparse-mla-xfail-file", "missing.txt"], "*--sparse-mla-xfail-file='missing.txt': no such file*"),
        (["--sparse-mla-golden-dir", "no-goldens"], "*--sparse-mla-golden-dir='no-goldens': no such directory*"),
        (["--sparse-mla-report-json", "no-dir/r.json"], "*--sparse-mla-report-json='no-dir/r.json': no such dir*"),
    ],
)
def test_bad_options_are_usage_errors(pytester: pytest.Pytester, args: list[str], message: str) -> None:
    pytester.makepyfile("def test_ok():\n    pass\n")
    result = pytester.runpytest("-p", "sparse_mla", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_malformed_marker_spec_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.sparse_mla_requires_sm("twelve")
        def test_x():
            pass
        """
    )
    result = pytester.runpytest("-p", "sparse_mla")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*sparse_mla_requires_sm: spec='twelve' is not a compute-capability specifier*"])


# --- marker evaluation against fake capabilities (no GPU needed) ----------------------------------


def _mark(*args: object, **kwargs: object) -> SimpleNamespace:
    return SimpleNamespace(args=args, kwargs=kwargs)


H200 = capabilities.Capabilities(
    torch_version="2.11.0+cu130", cuda_version="13.0", cuda_available=True, device_count=1,
    device_name="NVIDIA H200", compute_capability=(9, 0), triton_version="3.6.0",
)
RTX_PRO_6000 = capabilities.Capabilities(
    torch_version="2.13.0+cu129", cuda_version="12.10", cuda_available=True, device_count=1,
    device_name="NVIDIA RTX PRO 6000", compute_capability=(12, 0), triton_version="3.9.0",
    flashinfer_version="0.6.18.post1",
)


@pytest.mark.parametrize(
    "caps, name, mark, expected",
    [
        (H200, "sparse_mla_requires_sm", _mark("12.0"), "requires compute capability ==12.0; found 9.0 (NVIDIA H200)"),
        (RTX_PRO_6000, "sparse_mla_requires_sm", _mark("12.0"), None),
        (RTX_PRO_6000, "sparse_mla_requires_sm", _mark("==12.*"), None),
        (RTX_PRO_6000, "sparse_mla_requires_sm", _mark("12"), None),
        (H200, "sparse_mla_requires_sm", _mark(">=9.0"), None),
        (H200, "sparse_mla_requires_sm", _mark((9, 0)), None),
        # "12.10" >= "12.8" is False as strings; versions compare numerically.
        (RTX_PRO_6000, "sparse_mla_requires_cuda_version", _mark(">=12.8"), None),
        (H200, "sparse_mla_requires_cuda_version", _mark("<13"), "requires CUDA toolkit <13; found 13.0"),
        (H200, "sparse_mla_requires_flashinfer", _mark(">=0.6.18"), "requires flashinfer-python>=0.6.18; not installed"),  # noqa: E501
        (RTX_PRO_6000, "sparse_mla_requires_flashinfer", _mark(">=0.6.18"), None),  # post release counts
        (RTX_PRO_6000, "sparse_mla_requires_flashinfer", _mark(">=0.7"), "requires flashinfer-python>=0.7; found 0.6.18.post1"),  # noqa: E501
        (H200, "sparse_mla_requires_torch", _mark(">=2.11"), None),  # the +cu130 local tag is ignored
        (H200, "sparse_mla_requires_triton", _mark(), None),
        (H200, "sparse_mla_requires_cuda", _mark(), None),
    ],
)
def test_marker_evaluation_on_fake_machines(caps, name, mark, expected) -> None:  # type: ignore[no-untyped-def]
    assert capabilities.evaluate_marker(name, mark, caps) == expected


def test_probe_is_cached() -> None:
    assert capabilities.probe() is capabilities.probe()


def test_device_cuda_without_a_gpu_is_one_usage_error(pytester: pytest.Pytester) -> None:
    """``--sparse-mla-device cuda`` where torch sees no CUDA device stops the session once, instead
    of skipping every test and exiting 0."""
    from pytest_sparse_mla import capabilities

    if capabilities.probe().cuda_available:
        pytest.skip("this machine has a CUDA device")
    pytester.makepyfile("def test_one(sparse_mla_device):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "sparse_mla", "--sparse-mla-device", "cuda", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--sparse-mla-device=cuda: torch sees no CUDA device*"])
