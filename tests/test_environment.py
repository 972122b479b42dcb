"""Environment probe: the device each test process uses (recorded in the junit XML / JSON report).

Run it with the suites on a GPU machine (``pytest -p sparse_mla -n 2 tests/test_environment.py suites``)
to record which GPU each xdist worker saw."""

from __future__ import annotations

import os

import pytest

from pytest_sparse_mla import xdist_gpu


@pytest.mark.sparse_mla_requires_cuda
def test_each_xdist_worker_sees_exactly_its_pinned_gpu(
    pytestconfig: pytest.Config, record_property, sparse_mla_device, sparse_mla_capabilities  # type: ignore[no-untyped-def]
) -> None:
    """Under ``-n N`` each worker sees one GPU: the entry of the caller's list it was assigned."""
    import torch

    pinned = xdist_gpu.worker_gpu(pytestconfig)
    record_property("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
    record_property("device_name", torch.cuda.get_device_name(sparse_mla_device))
    if pinned is None:
        pytest.skip("not running in a pinned xdist worker (run with -n 2 on a machine with GPUs)")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == pinned
    assert torch.cuda.device_count() == 1
    assert sparse_mla_device == torch.device("cuda", 0)
