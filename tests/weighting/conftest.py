"""Fixtures shared by the weighting tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Runs each weighting test on one thread, as the benchmarks do.

    The CG solver makes hundreds of GEMMs of moderate size; on a loaded machine, OpenMP threads
    waiting at each one's barrier made the large tests up to ten times slower. The answers do
    not depend on the thread count.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
