"""Each adversary kernel is wrong on an input of its own (``tests/adversary_kernels.py``).

A demonstration shows a discrepancy when, against the float64 oracle of the same call, the
kernel's output has a normwise relative error above 5%, or its LSE is off by more than 0.05
natural-log units (an infinity where the oracle is finite counts), or the output is non-finite
where the oracle's is finite.
"""

from __future__ import annotations

import adversary_kernels as adversary
import pytest

REL_ERR = 0.05
LSE_ERR = 0.05


def test_at_least_twelve_kernels_each_bf16_and_named():
    assert len(adversary.ADVERSARY) >= 12
    for name, entry in adversary.ADVERSARY.items():
        assert entry.kernel.name == name
        assert entry.kernel.compute_mode == "bf16"
        assert getattr(adversary, name) is entry.kernel
        assert entry.bug and entry.origin and entry.demonstrated_on


@pytest.mark.parametrize("name", sorted(adversary.ADVERSARY))
def test_demonstration_shows_a_discrepancy(name):
    entry = adversary.ADVERSARY[name]
    got, oracle = entry.demonstrate()
    d = adversary.discrepancy(got, oracle)
    assert d["rel_err"] > REL_ERR or d["lse_err"] > LSE_ERR or d["nonfinite"], (name, d)
