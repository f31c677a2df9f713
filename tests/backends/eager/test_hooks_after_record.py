"""A gradient hook registered after ``tg.autograd.record()`` on a recorded layer's output.

torch hands an ``inputs=`` edge's gradient to the taps before that tensor's hooks when the
backward goes on past it (NOTE [hooks on taps]); the recorded layer's own block and ``Jᵀw``
from the factors then missed the hook, and the rest had it (G 0.68 off the hooked oracle and
0.99 off the unhooked one, ``.grad`` 0.67 off torch's; session 58's hunt). Such a pass is
now walked, as for hooks registered inside the block: G is the graph's without hooks (the
walk runs none, as documented) and ``.grad`` torch's backward's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 -- torch's own spelling
from torch import Tensor, nn

import torchgram as tg

DOUBLE = torch.float64


def _jacobian(losses: Tensor, params: list[Tensor]) -> Tensor:
    return torch.stack([
        torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params, retain_graph=True)])
        for loss in losses])


@pytest.mark.parametrize("batch_dim", [0, None], ids=["batch0", "dense"])
def test_a_hook_after_the_block_gives_the_walk_and_torchs_grads(batch_dim: int | None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 3)).to(DOUBLE)
    x, y = torch.randn(5, 6, dtype=DOUBLE), torch.randint(0, 3, (5,))
    params = list(model.parameters())

    def forward() -> tuple[Tensor, Tensor]:
        with tg.autograd.record():
            hidden = model[1](model[0](x))
            middle = model[2](hidden)  # a recorded layer's output
            losses = F.cross_entropy(model[4](model[3](middle)), y, reduction="none")
        return middle, losses

    _, plain = forward()
    unhooked = _jacobian(plain, params)
    middle, losses = forward()
    middle.register_hook(lambda grad: 3 * grad)  # after the block
    hooked = _jacobian(losses, params)
    weights = torch.linspace(0.5, 1.5, 5, dtype=DOUBLE)
    _, info = tg.autograd.backward(losses, params, lambda G: weights, batch_dim=batch_dim,
                                   with_info=True)
    torch.testing.assert_close(info.gramian, unhooked @ unhooked.T, rtol=1e-10, atol=1e-12)
    grads = torch.cat([p.grad.reshape(-1) for p in params])
    torch.testing.assert_close(grads, hooked.T @ weights, rtol=1e-10, atol=1e-12)
