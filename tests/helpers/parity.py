"""Compare trained parameters (or gradients) with a reference, tensor by tensor, failing on NaN.

The relative error of one tensor is max|actual − expected| / max|expected| (the absolute error when
the expected tensor is all zeros). A check passes only if `err <= tol` holds for every tensor:
written as `not err <= tol`, so a NaN or inf fails, where `max(errors) <= tol` would not (Python's
`max()` keeps the first of NaN and a number, so a NaN in any but the first tensor vanishes).
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

State = Mapping[str, torch.Tensor]


def relative_errors(actual: State, expected: State) -> dict[str, float]:
    """Per-tensor relative error, keyed like `expected`; computed in float64."""
    missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
    assert not missing and not extra, f"tensor names differ: missing {missing}, extra {extra}"
    errors = {}
    for name, want in expected.items():
        got = actual[name]
        assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        diff = (got.double() - want.double()).abs().max()
        scale = want.double().abs().max()
        errors[name] = (diff / scale if scale > 0 else diff).item()
    return errors


def max_relative_error(actual: State, expected: State) -> float:
    """The largest per-tensor relative error; NaN if any tensor's is (where `max()` would drop it)."""
    errors = relative_errors(actual, expected).values()
    return math.nan if any(math.isnan(err) for err in errors) else max(errors, default=0.0)


def assert_params_close(actual: State, expected: State, tol: float, what: str = "") -> float:
    """Fail, naming the worst tensor, unless every tensor's relative error is <= tol; return the worst error."""
    errors = relative_errors(actual, expected)
    bad = {name: err for name, err in errors.items() if not err <= tol}
    if bad:
        worst = max(bad, key=lambda name: math.inf if math.isnan(errors[name]) else errors[name])
        raise AssertionError(
            f"{what}: {len(bad)} of {len(errors)} tensors differ from the reference by more than {tol:g} "
            f"(relative); worst {worst}: {errors[worst]:.3e}"
        )
    return max(errors.values(), default=0.0)
