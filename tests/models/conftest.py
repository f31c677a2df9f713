"""One torch thread for the model suite (its models are tiny), and cold caches per case.

On the shared 2-core machines, intra-op threads only add fork-join waits for these shapes:
measured here, a call that takes 20-40 ms on one thread took 0.2-4 s on two under load. The
previous setting is restored when the package's tests are done.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from torchgram._core.signature import clear_caches


@pytest.fixture(autouse=True, scope="package")
def _one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def _cold_caches() -> None:
    """Each case starts as in a fresh process: no probe or trace of an earlier case's function
    (whose ids a later one may reuse, NOTE [call signatures]) is found first."""
    clear_caches()
