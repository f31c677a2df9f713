"""``torchgram.autograd.backward``: ``.grad`` equals ``Jᵀ weighting(G)`` from the oracle."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import torchgram as tg
from reference import dense_gramian


@pytest.mark.parametrize("weighting", [tg.weighting.upgrad, tg.weighting.mgda, tg.weighting.mean],
                         ids=["upgrad", "mgda", "mean"])
def test_grad_is_jacobian_transpose_times_weights(weighting) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x, y = torch.randn(7, 4, dtype=torch.float64), torch.randint(0, 3, (7,))
    fn, params = tg.functionalize(model)

    def losses_of(p):
        return nn.functional.cross_entropy(fn(p, x), y, reduction="none")

    dense = dense_gramian(losses_of, (params,))
    expected_weights = weighting(dense.gramian)
    expected = dense.jacobian.T @ expected_weights

    losses = nn.functional.cross_entropy(model(x), y, reduction="none")
    weights = tg.autograd.backward(losses, list(model.parameters()), weighting)
    torch.testing.assert_close(weights, expected_weights)
    grads = torch.cat([model.get_parameter(name).grad.reshape(-1) for name in sorted(params)])
    torch.testing.assert_close(grads, expected)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        losses.sum().backward()  # retain_graph=False freed it, as autograd does


def test_accumulates_only_into_the_given_inputs_and_can_retain() -> None:
    w, v = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    losses = torch.stack([(w * v).sum(), (w ** 2).sum()])
    w.grad = torch.ones(2)
    tg.autograd.backward([losses[0], losses[1]], w, tg.weighting.sum, retain_graph=True)
    torch.testing.assert_close(w.grad, torch.ones(2) + v.detach() + 2 * w.detach())
    assert v.grad is None
    losses.sum().backward()  # graph retained


def test_bad_weighting_is_rejected() -> None:
    w = torch.ones(2, requires_grad=True)
    losses = w * 2
    with pytest.raises(TypeError, match="torchgram.autograd.backward: expected a weighting"):
        tg.autograd.backward(losses, w, "upgrad")
    with pytest.raises(TypeError, match=r"shape \(2,\).*got shape \(\)"):
        tg.autograd.backward(losses, w, lambda G: G.sum())
    assert w.grad is None


@pytest.mark.parametrize("recorded", [False, True], ids=["walked", "recorded"])
def test_a_tensor_listed_twice_is_refused_before_any_grad(recorded: bool) -> None:
    # Its Jacobian counted twice in G, Jᵀw once in .grad: weights and update 0.16-0.5 off.
    torch.manual_seed(0)
    layer = nn.Linear(4, 3).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    with tg.autograd.record() if recorded else contextlib.nullcontext():
        losses = torch.tanh(layer(x)).sum(1)
    with pytest.raises(ValueError, match=r"^torchgram.autograd.backward: expected inputs "
                       r"without duplicates, but got the same tensor at inputs\[0\] and "
                       r"inputs\[1\] \(shape \(3, 4\)\)"):
        tg.autograd.backward(losses, [layer.weight, layer.weight, layer.bias],
                             tg.weighting.upgrad, batch_dim=0)
    assert layer.weight.grad is None and layer.bias.grad is None


def test_with_info_returns_the_gramian_and_the_time_split() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    x = torch.randn(6, 4)
    losses = model(x).squeeze(1) ** 2
    params = list(model.parameters())
    expected = tg.autograd.gramian(losses, params)
    weights, info = tg.autograd.backward(losses, params, tg.weighting.mean, with_info=True)
    torch.testing.assert_close(info.gramian, expected)
    assert weights.shape == (6,)
    assert info.times.gramian > 0 and info.times.pullback > 0
    assert all(p.grad is not None for p in params)
