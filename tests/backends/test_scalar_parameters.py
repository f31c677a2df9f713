"""0-dim parameters (a temperature, CLIP's ``logit_scale``) on every backend and ``batch_dim``.

The structured backend's dense pass reshaped a 0-dim leaf's gradient with
``shape[-(dim - 2):]``, which is the whole shape when ``dim == 2`` (``-0``): a raw
``RuntimeError`` (found in session 23 by trying patterns by hand). The fuzzer's parameters
all have a dim.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 -- torch's own spelling
from torch import Tensor

import torchgram as tg
from reference import dense_gramian

BACKENDS = ["jacobian", "ntvp", "graph", "structured", "auto"]


def _problem() -> tuple[dict[str, Tensor], Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 2, dtype=torch.float64, generator=generator),
              "logit_scale": torch.tensor(0.7, dtype=torch.float64),
              "temperature": torch.tensor(1.3, dtype=torch.float64)}
    x = torch.randn(4, 2, dtype=torch.float64, generator=generator)
    return params, x, torch.tensor([0, 2, 1, 2])


def f(p: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
    logits = F.linear(x, p["w"]) * p["logit_scale"].exp()
    return F.cross_entropy(F.softplus(logits) / p["temperature"], y, reduction="none")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch_dim", [0, None], ids=["batch0", "dense"])
def test_matches_the_oracle(backend: str, batch_dim: int | None) -> None:
    params, x, y = _problem()
    expected = dense_gramian(f, (params, x, y)).gramian
    G = tg.gramian(f, backend=backend, batch_dim=batch_dim)(params, x, y)
    torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("recorded", [True, False], ids=["record", "walk"])
def test_eager(recorded: bool) -> None:
    params, x, y = _problem()
    expected = dense_gramian(f, (params, x, y)).gramian
    leaves = {name: value.clone().requires_grad_() for name, value in params.items()}
    if recorded:
        with tg.autograd.record():
            losses = f(leaves, x, y)
    else:
        losses = f(leaves, x, y)
    G = tg.autograd.gramian(losses, [leaves[name] for name in sorted(leaves)], batch_dim=0)
    torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-12)
