"""Infinite derivatives that a closed selection drops, on a signature's first eager call.

``sqrt(relu(h))``, ``log(relu(h))``, ``clamp(h, min=0) ** 0.5``: where the selection is
closed, the next node's derivative is infinite, and another sample's row carries
``0 · ∞ = NaN`` there, which torch's backward of the selection drops. The walk's first call
of a signature probes with its selections opened (NOTE [opened selections]); before session
58 it opened the direction rows too, and that NaN reached every sample's entries of ``G``
(``tg.autograd.gramian(..., batch_dim=0)``; ``backward`` then refused the Gramian or wrote NaN
into ``.grad``). Compared with the float64 oracle, walked and recorded, on the first calls.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 -- torch's own spelling
from torch import Tensor, nn

import torchgram as tg
from torchgram._core.signature import clear_caches

DOUBLE = torch.float64
SHIFT = torch.tensor([1.0, -1.0, 1.0, 1.0], dtype=DOUBLE)  # sample 1 is below zero

OPS: dict[str, Callable[[Tensor], Tensor]] = {
    "sqrt-relu": lambda s: torch.sqrt(F.relu(s)),
    "sqrt-clamp": lambda s: torch.clamp(s, min=0).sqrt(),
    "pow-clamp": lambda s: torch.clamp(s, min=0) ** 0.5,
    "log-relu": lambda s: torch.log(F.relu(s)) * 0 + F.relu(s),  # finite value, -inf inside
    "acos-clamp": lambda s: torch.acos(torch.clamp(s + 0.5, -1.0, 1.0)),  # closed above 1
}


def _setup(op: Callable[[Tensor], Tensor]) -> tuple[nn.Module, Callable[[], Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(DOUBLE)
    x = torch.randn(4, 6, dtype=DOUBLE)

    def losses() -> Tensor:
        z = model(x)[:, 0]
        return op(z - z.detach() + SHIFT)  # the value SHIFT, the derivative 1 w.r.t. z

    return model, losses


def _oracle(model: nn.Module, losses: Tensor) -> Tensor:
    params = list(model.parameters())
    rows = [torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params,
                                                                  retain_graph=True)])
            for loss in losses]
    jacobian = torch.stack(rows)
    return jacobian @ jacobian.T


@pytest.mark.parametrize("recorded", [False, True], ids=["walk", "record"])
@pytest.mark.parametrize("op", OPS)
def test_first_calls_are_finite_and_exact(op: str, recorded: bool) -> None:
    clear_caches()  # a first call of the signature: the probes run
    model, losses = _setup(OPS[op])
    expected = _oracle(model, losses())
    assert expected.isfinite().all()
    for _ in range(2):
        if recorded:
            with tg.autograd.record():
                out = losses()
        else:
            out = losses()
        G = tg.autograd.gramian(out, list(model.parameters()), batch_dim=0)
        torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-12)


def test_backward_writes_finite_grads_on_the_first_call() -> None:
    clear_caches()
    model, losses = _setup(OPS["sqrt-relu"])
    out = losses()
    expected = _oracle(model, out)
    weights = tg.autograd.backward(out, list(model.parameters()), tg.weighting.upgrad,
                                   batch_dim=0)
    torch.testing.assert_close(weights, tg.weighting.upgrad(expected), rtol=1e-10, atol=1e-12)
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
