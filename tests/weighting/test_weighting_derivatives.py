"""Derivatives through the weights and ``vmap`` over them (``weighting/_derivatives.py``).

NOTE [weights are not differentiable]: a derivative that reaches a weighting's weights through
``G`` raises a torchgram error instead of treating them as constants; ``G.detach()`` holds
them constant; ``mean`` and ``sum`` (weights independent of ``G``) have the zero derivative.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor
from torch.autograd import forward_ad

import torchgram as tg
import torchgram.weighting as weighting
from torchgram.backends.ntvp import _prepare_forward_ad

_prepare_forward_ad()  # torch's first forward-mode product warns (NOTE [first forward-AD call])

VARYING: dict[str, Callable[[Tensor], Tensor]] = {
    "upgrad": weighting.upgrad,
    "dualproj": weighting.dualproj,
    "mgda": weighting.mgda,
    "imtl_g": weighting.imtl_g,
    "aligned_mtl": weighting.aligned_mtl,
    "pcgrad": lambda G: weighting.pcgrad(G, generator=torch.Generator().manual_seed(0)),
}
CONSTANT: dict[str, Callable[[Tensor], Tensor]] = {"mean": weighting.mean, "sum": weighting.sum}


def _jacobian() -> Tensor:
    J = torch.randn(4, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    J[::2] *= -1.0  # conflicting rows: every weighting's weights depend on G
    return J


def _backward(fn: Callable[[Tensor], Tensor], J: Tensor) -> None:
    J = J.clone().requires_grad_()
    fn(J @ J.T).square().sum().backward()


def _func_grad(fn: Callable[[Tensor], Tensor], J: Tensor) -> None:
    torch.func.grad(lambda J: fn(J @ J.T).square().sum())(J)


def _func_jvp(fn: Callable[[Tensor], Tensor], J: Tensor) -> None:
    torch.func.jvp(lambda J: fn(J @ J.T), (J,), (torch.ones_like(J),))


def _forward_ad(fn: Callable[[Tensor], Tensor], J: Tensor) -> None:
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(J, torch.ones_like(J))
        forward_ad.unpack_dual(fn(dual @ dual.T))


DERIVATIVES = {"backward": _backward, "func.grad": _func_grad, "func.jvp": _func_jvp,
               "forward_ad": _forward_ad}


@pytest.mark.parametrize("how", DERIVATIVES)
@pytest.mark.parametrize("name", VARYING)
def test_a_derivative_through_the_weights_is_refused(name: str, how: str) -> None:
    # Before session 55 each of these saw constant weights without a word.
    with pytest.raises(NotImplementedError, match=f"torchgram.weighting.{name}: its weights are "
                                                  "not differentiable .* G.detach()"):
        DERIVATIVES[how](VARYING[name], _jacobian())


@pytest.mark.parametrize("name", VARYING)
def test_weights_of_a_detached_gramian_are_constants(name: str) -> None:
    J = _jacobian()
    expected = VARYING[name](J @ J.T)
    # Held constant on purpose: eager, and under torch.func.grad (a detached wrapped tensor).
    Jg = J.clone().requires_grad_()
    w = VARYING[name]((Jg @ Jg.T).detach())
    assert not w.requires_grad and torch.equal(w, expected)
    grad = torch.func.grad(lambda J: (J.T @ VARYING[name]((J @ J.T).detach())).square().sum())(J)
    w = expected
    assert torch.allclose(grad, 2 * torch.outer(w, J.T @ w))


@pytest.mark.parametrize("name", VARYING)
def test_weights_used_without_their_derivative_run(name: str) -> None:
    # Connected to G but never differentiated: no refusal (a step applied under no_grad).
    J = _jacobian().requires_grad_()
    w = VARYING[name](J @ J.T)
    assert w.requires_grad
    with torch.no_grad():
        step = J.T @ w
    assert torch.equal(step, J.detach().T @ VARYING[name]((J @ J.T).detach()))
    (J.square().sum()).backward()  # another output of J: its backward does not reach w


@pytest.mark.parametrize("name", CONSTANT)
def test_weights_that_do_not_depend_on_the_gramian_have_a_zero_derivative(name: str) -> None:
    J = _jacobian()
    grad = torch.func.grad(lambda J: (J.T @ CONSTANT[name](J @ J.T)).square().sum())(J)
    w = CONSTANT[name](J @ J.T)
    assert torch.allclose(grad, 2 * torch.outer(w, J.T @ w))


@pytest.mark.parametrize("name", [*VARYING, *CONSTANT])
def test_vmap_over_gramians_is_refused(name: str) -> None:
    J = _jacobian()
    gramians = torch.stack([J @ J.T, 2 * J @ J.T])
    fn = {**VARYING, **CONSTANT}[name]
    with pytest.raises(NotImplementedError, match=f"torchgram.weighting.{name}: expected a "
                                                  "Gramian outside torch.func.vmap"):
        torch.func.vmap(fn)(gramians)
    # Under vmap of a grad, too (the batched level is below the grad one).
    with pytest.raises(NotImplementedError, match="outside torch.func.vmap"):
        torch.func.vmap(torch.func.grad(lambda J: fn((J @ J.T).detach()).sum() + J.sum()))(
            torch.stack([J, 2 * J]))


def test_aggregated_grad_under_grad_refuses_the_weights_derivative() -> None:
    # torch.func.grad of a function of the update: its derivative needs the weights'; before
    # session 55 they counted as constants (1.07 off against finite differences).
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    W = torch.randn(3, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def f(params: dict[str, Tensor], x: Tensor) -> Tensor:
        return (x @ params["W"].T).sin().sum(-1)

    def squared_update(W: Tensor, chosen: Callable[[Tensor], Tensor]) -> Tensor:
        update, _ = tg.aggregated_grad(f, chosen, batch_dim=0)({"W": W}, x)
        return update["W"].square().sum()

    with pytest.raises(NotImplementedError, match="torchgram.weighting.upgrad: its weights"):
        torch.func.grad(squared_update)(W, weighting.upgrad)
    # With mean (weights independent of G) the derivative is the true one.
    grad = torch.func.grad(squared_update)(W, weighting.mean)
    eps = 1e-6
    for i, j in [(0, 0), (1, 2), (2, 3)]:
        step = torch.zeros_like(W)
        step[i, j] = eps
        finite = (squared_update(W + step, weighting.mean)
                  - squared_update(W - step, weighting.mean)) / (2 * eps)
        assert abs(float(grad[i, j] - finite)) <= 1e-7 * (1 + abs(float(finite)))
    # Held constant on purpose: runs.
    torch.func.grad(squared_update)(W, lambda G: weighting.upgrad(G.detach()))
