"""Kept name: the parity helper lives in tests/helpers/parity.py (`assert_params_close`)."""

from tests.helpers.parity import assert_params_close, max_relative_error, relative_errors

assert_close_params = assert_params_close

__all__ = ["assert_close_params", "assert_params_close", "max_relative_error", "relative_errors"]
