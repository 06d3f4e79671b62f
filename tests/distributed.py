"""Kept name: the multi-process runner lives in tests/helpers/runner.py."""

from tests.helpers.runner import DEFAULT_TIMEOUT_S, init_method, run_distributed

__all__ = ["DEFAULT_TIMEOUT_S", "init_method", "run_distributed"]
