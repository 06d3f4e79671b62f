"""Shared pytest fixtures."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Single-process references in the parent run on one thread: the spawned workers share the
    cores, and many shared-core threads make tiny models very slow."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
