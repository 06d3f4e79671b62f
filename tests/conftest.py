"""Shared pytest fixtures (shared functions are in tests/helpers/)."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch

from tests.helpers.processes import References


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Single-process references in the parent run on one thread: the spawned workers share the
    cores, and many shared-core threads make tiny models very slow."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def references(tmp_path_factory: pytest.TempPathFactory) -> Iterator[References]:
    """Uninterrupted launcher runs, one per layout, shared by the elastic-restart and preemption tests."""
    yield References(tmp_path_factory.mktemp("references"))
