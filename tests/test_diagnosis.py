"""``pytest_sparse_mla.diagnosis``: a failure's cause and evidence read back from the text the
console prints (hand-written messages of the comparisons' and the search's form)."""

from __future__ import annotations

import pytest

from pytest_sparse_mla import diagnosis

MESSAGE = """AssertionError: fi-decode-h64-k256: output: 4 check(s) failed
  FAIL elementwise: 24903 of 524288 elements exceed their bound; worst at token 15, head 35
  FAIL per-row normwise: 512 of 1024 (token, head) rows exceed their bound
  elementwise: |A - E| <= 1 * ((3*u_p + ...
  likely cause [sink-or-normaliser]: the output is off by a per-head constant factor (head 32: x1.03)
  likely cause [head-grouping]: only heads 32..63 of 64 are wrong: head grouping?
lse: 1 check(s) failed
  FAIL 256 of 512 LSE values differ
only heads [32, 33] of 64 are wrong
(tolerance profile 'kernel')"""


def test_the_first_cause_and_the_first_violation_are_read_back() -> None:
    found = diagnosis.read(MESSAGE)
    assert found.key == "sink-or-normaliser"
    assert found.cause == "the output is off by a per-head constant factor (head 32: x1.03)"
    assert found.evidence == (
        "elementwise: 24903 of 524288 elements exceed their bound; worst at token 15, head 35; "
        "only heads [32, 33] of 64 are wrong; likely cause: only heads 32..63 of 64 are wrong: head grouping?"
    )
    assert diagnosis.cause_keys(MESSAGE) == ["sink-or-normaliser", "head-grouping"]


def test_a_counterfactual_the_result_matches_comes_first() -> None:
    text = MESSAGE + f"\nlikely cause [sm_scale-ignored]: sm_scale ignored ({diagnosis.MATCHED}: relative error 1e-4)"
    assert diagnosis.read(text).key == "sm_scale-ignored"


def test_a_message_without_a_cause_has_only_evidence_and_keys_are_checked() -> None:
    found = diagnosis.read("AssertionError: x\n  FAIL 3 of 8 LSE values differ")
    assert (found.key, found.cause, found.evidence) == (None, None, "3 of 8 LSE values differ")
    assert diagnosis.read("").as_dict() == {"cause_key": None, "cause": None, "evidence": None}
    assert diagnosis.cause_line("a-b", "t") == "likely cause [a-b]: t"
    with pytest.raises(ValueError, match="cause key 'a b'"):
        diagnosis.cause_line("a b", "t")
