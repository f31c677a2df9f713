"""Selections whose other operand is a statistic of the batch, broadcast against it.

``torch.minimum(z, z.mean(0))`` and its kin route each entry's cotangent by value between the
batch's ``[B, k]`` operand and a ``[k]`` one that every sample reaches. The eager walk opens
them on its probe rows (NOTE [opened selections]); the ``[k]`` operand's opened gradient was
summed with torch's trailing alignment, which does not see the walk's leading row dim: raw
"size {[9, 8]} is not expandable to size {[9, 32, 8]}" walked and recorded (session 60's
hunt). Every case is compared with the dense float64 oracle, walked and recorded.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

import torchgram as tg
from reference import dense_gramian
from torchgram._core.signature import clear_caches

DOUBLE = torch.float64

SELECTIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "minimum-mean": lambda z: torch.minimum(z, z.mean(0)),
    "maximum-first": lambda z: torch.maximum(z, z[0]),
    "fmin-mean": lambda z: torch.fmin(z, z.mean(0)),
    "clamp-max-mean": lambda z: torch.clamp(z, max=z.mean(0)),
    "where-mean": lambda z: torch.where(z < z.mean(0), z, z.mean(0)),
    "pow-mean": lambda z: torch.pow(z.abs() + 1, z.mean(0)),
    "xlogy-mean": lambda z: torch.xlogy(z, z.mean(0).abs() + 1),
}


@pytest.mark.parametrize("recorded", [False, True], ids=["walked", "recorded"])
@pytest.mark.parametrize("batch", [3, 8, 32], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("name", list(SELECTIONS))
def test_a_batch_statistic_beside_the_batch(name: str, batch: int, recorded: bool) -> None:
    clear_caches()
    generator = torch.Generator().manual_seed(batch)
    x = 5 * torch.randn(batch, 6, generator=generator, dtype=DOUBLE)
    w = torch.randn(6, 8, generator=generator, dtype=DOUBLE, requires_grad=True)

    def f(w: Tensor) -> Tensor:
        return SELECTIONS[name](x @ w).pow(2).sum(1)

    if recorded:
        with tg.autograd.record():
            losses = f(w)
    else:
        losses = f(w)
    G = tg.autograd.gramian(losses, [w], batch_dim=0)
    torch.testing.assert_close(G, dense_gramian(f, (w,)).gramian, rtol=1e-10, atol=1e-12)
