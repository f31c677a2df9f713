"""One torch thread for the model suite: its models are tiny (a few thousand parameters).

On the shared 2-core machines, intra-op threads only add fork-join waits for these shapes:
measured here, a call that takes 20-40 ms on one thread took 0.2-4 s on two under load. The
previous setting is restored when the package's tests are done.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
