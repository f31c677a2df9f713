"""``_core/per_sample``: ``f`` that cannot run on part of the batch, under ``batch_dim``.

``f`` indexes its outputs with ``torch.arange(5)``, a batch size written into the code: on the
two samples the per-sample check runs apart it raises an ``IndexError``, which escaped raw
from jacobian, ntvp and auto (found in session 23 by trying patterns by hand). A failure on
part of the batch now means the samples cannot run apart: the rows of the whole batch, as
when ``f`` fails on a batch of one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 -- torch's own spelling
from torch import Tensor

import torchgram as tg
from reference import dense_gramian

B = 5


def f(p: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
    logits = F.linear(torch.tanh(F.linear(x, p["w"], p["b"])), p["v"])
    return logits.logsumexp(-1) - logits[torch.arange(B), y]  # B written into the code


@pytest.mark.parametrize("backend", ["jacobian", "ntvp", "graph", "structured", "auto"])
def test_f_that_fails_on_part_of_the_batch(backend: str) -> None:
    generator = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 4, dtype=torch.float64, generator=generator),
              "b": torch.randn(3, dtype=torch.float64, generator=generator),
              "v": torch.randn(2, 3, dtype=torch.float64, generator=generator)}
    x = torch.randn(B, 4, dtype=torch.float64, generator=generator)
    y = torch.tensor([0, 1, 1, 0, 1])
    expected = dense_gramian(f, (params, x, y)).gramian
    G = tg.gramian(f, backend=backend, batch_dim=0)(params, x, y)
    torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-12)
