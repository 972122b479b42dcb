"""Self-tests of the stored goldens of ``suites/test_golden.py`` (not of a selected implementation).

* Honesty: every float golden (attention output and LSE of the bundled reference), decoded from its
  file, is within the ``tight`` profile of the float64 oracle computed afresh on the same inputs, so
  a golden cannot quietly freeze a bug; and no float golden exists that no such check covers.
* Without syrupy the golden suite is skipped with the reason, not a collection error.

The golden cases and their inputs are imported from the shipped suite module
(``pytest_sparse_mla.suites.test_golden``), whose files live under ``<golden root>/suites/test_golden``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("syrupy", reason="the golden suite needs syrupy")

from pytest_sparse_mla import snapshots, tolerances  # noqa: E402
from pytest_sparse_mla.suites import test_golden as golden_suite  # noqa: E402

SUITE_FILE = Path(golden_suite.__file__)
TIGHT = tolerances.SparseMlaTolerances("tight", tolerances.DEFAULT_PROFILES["tight"])


def _golden(config: pytest.Config, case: golden_suite.AttentionCase, name: str) -> snapshots.TensorRecord:
    path = golden_suite.golden_path(config, SUITE_FILE, case, name)
    if not path.is_file():
        pytest.fail(f"golden {path} is missing: run `pytest -p sparse_mla suites/test_golden.py "
                    "--snapshot-update` (one process)", pytrace=False)  # fmt: skip
    return snapshots.read_tensor_snapshot(path)


@pytest.mark.parametrize("case", golden_suite.ATTENTION_CASES, ids=str)
def test_float_golden_matches_the_oracle(case: golden_suite.AttentionCase, request: pytest.FixtureRequest) -> None:
    from pytest_sparse_mla.attention.oracle import oracle_forward

    inputs = golden_suite.attention_inputs(case, "cpu")
    # The oracle treats each token on its own, so it only needs the frozen tokens.
    oracle = oracle_forward(**{
        key: golden_suite.frozen_rows(case, value) if key in golden_suite.PER_TOKEN else value
        for key, value in inputs.items()
    })  # fmt: skip
    stored = {name: _golden(request.config, case, name) for name in ("output", "lse")}
    assert stored["output"].dtype == torch.bfloat16 and stored["lse"].dtype == torch.float32
    for name in ("output", "lse"):
        assert stored[name].shape == tuple(getattr(oracle, name).shape), name
        assert bool(torch.isfinite(stored[name].values).all()), name  # every case has valid candidates
    golden = SimpleNamespace(output=stored["output"].values, lse=stored["lse"].values)
    TIGHT.check_result(golden, oracle, what=f"stored golden {case}")


def test_every_float_golden_is_checked_against_the_oracle(request: pytest.FixtureRequest) -> None:
    checked = {
        golden_suite.golden_path(request.config, SUITE_FILE, case, name)
        for case in golden_suite.ATTENTION_CASES
        for name in ("output", "lse")
    }
    module_dir = next(iter(checked)).parent
    floats = {
        path
        for path in module_dir.glob(f"*.{snapshots.FILE_EXTENSION}")
        if snapshots.read_tensor_snapshot(path).compare == "close"
    }
    assert floats, f"no float goldens under {module_dir}"
    unchecked = sorted(p.name for p in floats - checked)
    assert not unchecked, f"float goldens no oracle test covers: {unchecked}"


def test_golden_suite_is_skipped_with_a_reason_without_syrupy(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """syrupy hidden (an importable ``syrupy`` that raises ImportError, its plugin not loaded): the
    suite module is skipped with the reason, no collection error."""
    hidden = pytester.mkdir("hidden")
    (hidden / "syrupy").mkdir()
    (hidden / "syrupy" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'syrupy' (hidden by the test)\", name='syrupy')\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(hidden))
    result = pytester.runpytest_subprocess(
        "-p", "sparse_mla", "-p", "no:syrupy", str(SUITE_FILE), "--sparse-mla-device", "cpu",
        "-p", "no:cacheprovider", "-rs",
        # importlib: an installed suite file must not put site-packages (the real syrupy) before the
        # hiding folder on sys.path, as the default prepend mode does.
        "--import-mode=importlib",
    )  # fmt: skip
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED or result.ret == pytest.ExitCode.OK, result.stdout.str()
    result.stdout.fnmatch_lines(["*SKIPPED*golden snapshots need syrupy*"])
    assert "error" not in result.stdout.str().splitlines()[-1]
