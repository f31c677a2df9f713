"""Functions whose backward torch's vmap gets wrong: every backend is still exact.

NOTE [wrong batching rules] in ``_core/_torch_compat.py``. The reference here computes each
row's gradient with plain autograd, one row at a time, since the dense oracle's vmapped
``jacrev`` is itself wrong on these functions.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import torchgram as tg

DOUBLE = torch.float64
BACKENDS = ["jacobian", "graph", "structured", "auto"]  # ntvp: cdist has no forward AD


def _per_row_gramian(f, params: dict[str, Tensor], x: Tensor) -> Tensor:
    leaves = [p.detach().requires_grad_() for p in params.values()]
    rows = f(dict(zip(params, leaves, strict=True)), x).reshape(-1)
    jacobian = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
        row, leaves, retain_graph=True)]) for row in rows])
    return jacobian @ jacobian.T


@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "batch0"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_cdist_in_f_gives_the_autograd_gramian(backend: str, batch_dim: int | None) -> None:
    torch.manual_seed(0)
    anchors = torch.randn(3, 4, dtype=DOUBLE)
    params = {"w": torch.randn(5, 4, dtype=DOUBLE), "scale": torch.rand(4, dtype=DOUBLE) + 0.5}

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return torch.cdist(torch.tanh(x @ p["w"]) * p["scale"], anchors).sum(-1)

    x = torch.randn(6, 5, dtype=DOUBLE)
    G = tg.gramian(f, backend=backend, batch_dim=batch_dim)(params, x)
    torch.testing.assert_close(G, _per_row_gramian(f, params, x), rtol=1e-10, atol=1e-10)
