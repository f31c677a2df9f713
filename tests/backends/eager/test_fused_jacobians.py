"""Recorded convolutions whose per-sample Jacobians come from a fused kernel.

The eager recording contracts a single-use weight's factors itself (``_FastLeaf``), except
where the layout forms the Jacobian with a fused kernel (``Layout.fused_jacobian``: a
convolution at many output positions, NOTE [per-sample convolution gradients]); those go
through the structured contraction, which calls ``Layout.materialize``. Both routes must give
the oracle's Gramian and ``tg.autograd.backward`` the weighted gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import torchgram as tg
from reference import dense_gramian
from torchgram.backends.structured.rules.conv import ConvLayout

DOUBLE = torch.float64


def conv_losses(p: dict[str, Tensor], x: Tensor, padding: int) -> Tensor:
    h = torch.tanh(F.conv2d(x, p["conv"], p["bias"], padding=padding))
    return (F.linear(h.flatten(1), p["head"]) ** 2).sum(1)


@pytest.mark.parametrize(("side", "fused"), [(16, True), (6, False)],
                         ids=["256-positions-fused", "36-positions-factors"])
@pytest.mark.parametrize("diagonal", [False, True], ids=["full", "diagonal"])
def test_recorded_conv_matches_the_oracle(side: int, fused: bool, diagonal: bool) -> None:
    torch.manual_seed(0)
    layout = ConvLayout(2, c_in=8, c_out=4, groups=1, kernel=(3, 3), stride=(1, 1),
                        padding=((1, 1), (1, 1)), dilation=(1, 1))
    assert layout.fused_jacobian(side * side) is fused
    x = torch.randn(3, 8, side, side, dtype=DOUBLE)
    p = {"conv": torch.randn(4, 8, 3, 3, dtype=DOUBLE) / 8,
         "bias": torch.randn(4, dtype=DOUBLE),
         "head": torch.randn(2, 4 * side * side, dtype=DOUBLE) / side}
    expected = dense_gramian(lambda q: conv_losses(q, x, 1), (p,)).shaped()
    leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
    with tg.autograd.record():
        losses = conv_losses(leaves, x, 1)
    gram = tg.autograd.gramian(losses, list(leaves.values()), batch_dim=0, diagonal=diagonal,
                               retain_graph=True)
    torch.testing.assert_close(gram, expected.diagonal() if diagonal else expected,
                               rtol=1e-10, atol=1e-12)
    w = tg.autograd.backward(losses, list(leaves.values()), tg.weighting.upgrad, batch_dim=0,
                             retain_graph=True)
    wanted = torch.autograd.grad(losses, list(leaves.values()), w)
    for leaf, grad in zip(leaves.values(), wanted, strict=True):
        assert leaf.grad is not None
        torch.testing.assert_close(leaf.grad, grad, rtol=1e-10, atol=1e-12)


def test_functional_update_keeps_the_fused_jacobian() -> None:
    """``tg.aggregated_grad``: the fused kernel's Jacobian is kept for ``Jᵀw`` (its factors,
    the patches, are never formed); the update is the weighted gradient."""
    torch.manual_seed(1)
    x = torch.randn(3, 8, 16, 16, dtype=DOUBLE)
    p = {"conv": torch.randn(4, 8, 3, 3, dtype=DOUBLE) / 8, "bias": torch.randn(4, dtype=DOUBLE),
         "head": torch.randn(2, 4 * 256, dtype=DOUBLE) / 16}
    step, info = tg.aggregated_grad(lambda q, xs: conv_losses(q, xs, 1), tg.weighting.upgrad,
                                    batch_dim=0)(p, x)
    leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
    wanted = torch.autograd.grad(conv_losses(leaves, x, 1), list(leaves.values()),
                                 info.weights)
    for name, grad in zip(p, wanted, strict=True):
        torch.testing.assert_close(step[name], grad, rtol=1e-10, atol=1e-12)
