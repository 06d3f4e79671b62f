"""The matrix runner of tests/helpers/runner.py: a failing case hides none of the others."""

from __future__ import annotations

import pytest

from tests.helpers.runner import CaseError, case_result, run_each


def _case(name: str) -> int:
    if name == "bad":
        raise ValueError("layout bad is broken")
    return len(name)


def test_a_failing_case_is_kept_and_the_next_case_still_runs() -> None:
    out = run_each(_case, ["a", "bad", "ccc"])
    assert out["a"] == 1 and out["ccc"] == 3
    assert isinstance(out["bad"], CaseError) and "ValueError: layout bad is broken" in out["bad"].traceback


def test_each_case_reads_its_own_result_and_a_failure_names_case_and_rank() -> None:
    ranks = [run_each(_case, ["a", "ccc"]), run_each(_case, ["a", "bad", "ccc"])]
    ranks[0]["bad"] = 3
    assert case_result(ranks, "ccc") == [3, 3]
    with pytest.raises(AssertionError, match=r"(?s)^bad failed on rank 1:\n.*layout bad is broken"):
        case_result(ranks, "bad")
