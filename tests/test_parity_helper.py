"""The parity helper (tests/helpers/parity.py) fails on NaN and inf wherever they are, and names the worst tensor."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.parity import assert_params_close, max_relative_error, relative_errors


def _states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    expected = {"a": torch.tensor([1.0, -2.0]), "b": torch.tensor([[4.0, 0.5]]), "c": torch.zeros(3)}
    return {k: v.clone() for k, v in expected.items()}, expected


def test_equal_states_pass_with_zero_error() -> None:
    actual, expected = _states()
    assert assert_params_close(actual, expected, 1e-5) == 0.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("name", ["b", "c"])
def test_non_finite_in_a_later_tensor_fails(bad: float, name: str) -> None:
    actual, expected = _states()
    actual[name].view(-1)[0] = bad
    with pytest.raises(AssertionError, match=f"1 of 3 tensors .* worst {name}: "):
        assert_params_close(actual, expected, 1e-5, "rank 1")


def test_max_hides_a_nan_that_the_helper_reports() -> None:
    """The defect being fixed: `max(errors) <= tol` passes when the NaN is not the first error."""
    actual, expected = _states()
    actual["b"].view(-1)[1] = float("nan")
    errors = relative_errors(actual, expected)
    assert list(errors) == ["a", "b", "c"] and errors["b"] != errors["b"]
    assert max(errors.values()) <= 1e-5  # the old check: NaN silently dropped
    with pytest.raises(AssertionError, match=r"worst b: nan$"):
        assert_params_close(actual, expected, 1e-5)


def test_reports_the_worst_tensor_and_its_relative_error() -> None:
    tol = 2.0**-16  # the perturbations below are exact in fp32
    actual, expected = _states()
    actual["a"][1] += 2 * tol  # tol of max|a| = 2: exactly at the bound, passes
    actual["b"][0, 1] += 4 * 2**-10  # 2^-10 of max|b| = 4
    actual["c"][2] = 2 * tol  # all-zero reference: absolute error
    assert relative_errors(actual, expected) == {"a": tol, "b": 2**-10, "c": 2 * tol}
    with pytest.raises(AssertionError, match=r"^rank 0: 2 of 3 tensors .* than 1.52588e-05 .*worst b: 9\.766e-04$"):
        assert_params_close(actual, expected, tol, "rank 0")
    assert assert_params_close(actual, expected, 2**-10) == 2**-10


def test_missing_extra_or_reshaped_tensors_fail() -> None:
    actual, expected = _states()
    with pytest.raises(AssertionError, match=r"missing \['c'\], extra \['d'\]"):
        assert_params_close({"a": actual["a"], "b": actual["b"], "d": actual["c"]}, expected, 1e-5)
    with pytest.raises(AssertionError, match=r"b: shape \(2,\) != \(1, 2\)"):
        assert_params_close({**actual, "b": actual["b"].flatten()}, expected, 1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_max_relative_error_keeps_a_non_finite_error_of_a_later_tensor(bad: float) -> None:
    actual, expected = _states()
    actual["c"][1] = bad
    worst = max_relative_error(actual, expected)
    assert not worst <= 1.0  # NaN or inf: every `<= tol` check on it fails
    assert math.isnan(worst) if math.isnan(bad) else worst == math.inf
    assert max_relative_error(expected, expected) == 0.0
