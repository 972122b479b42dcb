"""The suites catch wrong kernels: each deliberately wrong implementation (``tests/wrong_impls.py``)
makes the suite that specifies the rule it breaks fail, while the bundled reference passes the same
selection.

Each case runs one suite file, narrowed with ``-k`` to the tests that exercise the rule, in a fresh
pytest process with ``--sparse-mla-impl wrong_impls:<name>`` (``tests/`` on ``PYTHONPATH``), and
names the tests that must fail, so a wrong kernel is caught for the stated reason and not by
accident.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

SUITES = Path(__file__).resolve().parents[1] / "suites"
TESTS = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Catch:
    """A wrong implementation, the suite file and ``-k`` selection that must catch it, and the
    tests that must fail."""

    impl: str
    suite: str
    select: str
    must_fail: tuple[str, ...]


CATCHES = [
    Catch(
        "ignores_sink", "test_attention_accuracy.py", "lse_conventions and flashinfer-1.0",
        ("test_lse_conventions[sink-flashinfer-1.0]",),
    ),
    Catch(
        "past_topk_length", "test_attention_accuracy.py", "empty_rows and topk_length-0",
        ("test_empty_rows_give_zero_output_and_sentinel_lse[topk_length-0-no-sink]",
         "test_empty_rows_give_zero_output_and_sentinel_lse[topk_length-0-sink]"),
    ),
    Catch(
        "sglang_floor", "test_impl_pack_and_split.py", "scale_byte or byte_identical",
        ("test_pack_writes_the_scale_byte_of_the_requested_rule[0.0-flashmla-114]",
         "test_pack_is_byte_identical_to_the_specified_packer[dsv4-ps64-padded-nhd-flashmla]"),
    ),
    Catch(
        "uninitialised_scratch", "test_impl_pack_and_split.py", "split",
        ("test_touched_split_into_fresh_scratch_leaves_untouched_pages_zero",),
    ),
    Catch(
        "shared_split_buffer", "test_impl_pack_and_split.py", "split",
        ("test_splits_under_different_key_suffixes_coexist",),
    ),
]  # fmt: skip


def _run(pytester: pytest.Pytester, impl: str, suites: list[str], select: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess(
        "-p", "sparse_mla", *(str(SUITES / s) for s in suites), "-k", select,
        "--sparse-mla-impl", impl, "--sparse-mla-device", "cpu", "-p", "no:cacheprovider", "-rf",
    )  # fmt: skip


@pytest.fixture
def wrong_impls_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Put ``tests/`` on the subprocess's ``PYTHONPATH`` so ``wrong_impls:<name>`` imports."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))


@pytest.mark.usefixtures("wrong_impls_importable")
@pytest.mark.parametrize("catch", CATCHES, ids=[c.impl for c in CATCHES])
def test_suite_catches_the_wrong_implementation(catch: Catch, pytester: pytest.Pytester) -> None:
    result = _run(pytester, f"wrong_impls:{catch.impl}", [catch.suite], catch.select)
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) >= len(catch.must_fail), result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines_random(
        [f"FAILED */{catch.suite}::{name.replace('[', '[[]')}*" for name in catch.must_fail]
    )


@pytest.mark.usefixtures("wrong_impls_importable")
def test_reference_passes_every_selection_that_catches_a_wrong_implementation(pytester: pytest.Pytester) -> None:
    suites = sorted({c.suite for c in CATCHES})
    select = " or ".join(f"({c.select})" for c in CATCHES)
    result = _run(pytester, "reference", suites, select)
    outcomes = result.parseoutcomes()
    expected = sum(len(c.must_fail) for c in CATCHES)
    assert outcomes.get("passed", 0) >= expected, result.stdout.str()[-3000:]
    bad = {k: v for k, v in outcomes.items() if k in ("failed", "error", "errors")}
    assert not bad, result.stdout.str()[-3000:]
