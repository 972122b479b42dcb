"""Self-tests of the one-GPU-per-xdist-worker pinning (works without a GPU: only the environment is checked)."""

from __future__ import annotations

import json

import pytest

from pytest_sparse_mla import xdist_gpu


@pytest.mark.parametrize(
    "environ, count, expected",
    [
        ({}, 2, ["0", "1"]),
        ({"CUDA_VISIBLE_DEVICES": "3,5"}, None, ["3", "5"]),  # the caller's narrowed list is kept
        ({"CUDA_VISIBLE_DEVICES": "GPU-aa, GPU-bb"}, None, ["GPU-aa", "GPU-bb"]),
        ({"CUDA_VISIBLE_DEVICES": ""}, None, []),  # hides every GPU
        ({}, 0, []),
    ],
)
def test_visible_gpus(environ: dict[str, str], count: int | None, expected: list[str]) -> None:
    assert xdist_gpu.visible_gpus(environ, count) == expected


def test_round_robin_assignment_indexes_into_the_callers_list() -> None:
    gpus = ["3", "5"]
    assert [xdist_gpu.assign_gpu(f"gw{i}", gpus) for i in range(5)] == ["3", "5", "3", "5", "3"]
    assert xdist_gpu.assign_gpu("gw0", []) is None
    with pytest.raises(ValueError, match="worker_id='master'"):
        xdist_gpu.assign_gpu("master", gpus)


@pytest.mark.full_tier
def test_each_worker_is_pinned_before_tests_run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,9")
    pytester.makepyfile(
        """
        import os, pytest

        @pytest.mark.parametrize("i", range(8))
        def test_record(i, worker_id, tmp_path_factory):
            base = tmp_path_factory.getbasetemp().parent
            (base / f"{worker_id}-{i}.txt").write_text(os.environ["CUDA_VISIBLE_DEVICES"])
        """
    )
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess(
        "-p", "sparse_mla", "-n", "2", "--sparse-mla-report-json", str(report), "--basetemp", str(pytester.path / "bt")
    )
    result.assert_outcomes(passed=8)
    seen = {p.name.split("-")[0]: p.read_text() for p in pytester.path.rglob("gw*-*.txt")}
    assert seen == {"gw0": "7", "gw1": "9"}
    result.stdout.fnmatch_lines_random(["gw0: CUDA_VISIBLE_DEVICES=7 -> *", "gw1: CUDA_VISIBLE_DEVICES=9 -> *"])
    workers = json.loads(report.read_text())["workers"]
    assert {w: r["CUDA_VISIBLE_DEVICES"] for w, r in workers.items()} == {"gw0": "7", "gw1": "9"}


@pytest.mark.full_tier
def test_pinning_can_be_turned_off(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,9")
    pytester.makepyfile(
        """
        import os

        def test_env():
            assert os.environ["CUDA_VISIBLE_DEVICES"] == "7,9"
        """
    )
    result = pytester.runpytest_subprocess("-p", "sparse_mla", "-n", "2", "--sparse-mla-no-gpu-pinning")
    result.assert_outcomes(passed=1)


@pytest.mark.parametrize("workers, cores, expected", [(2, 2, 1), (1, 2, 2), (4, 16, 4), (8, 2, 1)])
def test_worker_cpu_threads_split_the_cores(workers: int, cores: int, expected: int) -> None:
    assert xdist_gpu.worker_cpu_threads(workers, cores) == expected


@pytest.mark.full_tier
def test_workers_do_not_oversubscribe_the_cpu(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    pytester.makepyfile(
        """
        import os

        def test_threads():
            expected = max(1, (os.cpu_count() or 1) // 2)
            assert os.environ["OMP_NUM_THREADS"] == str(expected)
            import torch
            assert torch.get_num_threads() == expected
        """
    )
    result = pytester.runpytest_subprocess("-p", "sparse_mla", "-n", "2")
    result.assert_outcomes(passed=1)
