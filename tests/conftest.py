"""Shared pytest fixtures (shared functions are in tests/helpers/)."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch

from tests.helpers.processes import References


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cuda-dry-run", action="store_true",
                     help="run the `cuda` tests on CPU with gloo (their logic, not CUDA's) instead of skipping them")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`cuda` tests skip, with the reason, where no CUDA device is visible and no dry run is asked for."""
    if torch.cuda.is_available() or config.getoption("--cuda-dry-run"):
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False; --cuda-dry-run runs it on CPU)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


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
