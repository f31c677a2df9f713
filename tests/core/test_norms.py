"""NOTE [decomposed norms]: the plain-op norms equal torch's and fix its batched derivatives."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from reference import central_differences
from torchgram._core.norms import DecomposedNorms
from torchgram.backends.ntvp import _prepare_forward_ad

_prepare_forward_ad()  # torch's first forward-mode product warns (NOTE [first forward-AD call])

DOUBLE = torch.float64


def _stats() -> tuple[Tensor, Tensor]:
    return torch.linspace(-1, 1, 3, dtype=DOUBLE), torch.linspace(0.5, 2, 3, dtype=DOUBLE)


CALLS: dict[str, Callable[[Tensor, Tensor, Tensor, tuple[Tensor, Tensor]], Tensor]] = {
    "F.layer_norm": lambda x, w, b, s: F.layer_norm(x, x.shape[-1:], w.repeat(2)[:x.shape[-1]],
                                                    None, 1e-3),
    "torch.layer_norm": lambda x, w, b, s: torch.layer_norm(x, [x.shape[-1]]),
    "F.batch_norm-train": lambda x, w, b, s: F.batch_norm(x, *s, w, b, True, 0.3, 1e-4),
    "F.batch_norm-no-stats": lambda x, w, b, s: F.batch_norm(x, None, None, w, b, True),
    "F.batch_norm-eval": lambda x, w, b, s: F.batch_norm(x, *s, w, b, False),
    "torch.batch_norm": lambda x, w, b, s: torch.batch_norm(x, w, b, *s, True, 0.2, 1e-5,
                                                            False),
    "F.instance_norm": lambda x, w, b, s: F.instance_norm(x, *s, w, b, True, 0.4),
    "torch.instance_norm": lambda x, w, b, s: torch.instance_norm(x, w, b, None, None, True,
                                                                  0.1, 1e-5, False),
    "nn.BatchNorm1d": lambda x, w, b, s: torch.nn.BatchNorm1d(3, dtype=DOUBLE)(x),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_values_and_running_statistics_match_torch(name: str) -> None:
    x = torch.randn(4, 3, 5, dtype=DOUBLE)
    w, b = torch.randn(3, dtype=DOUBLE), torch.randn(3, dtype=DOUBLE)
    theirs, ours = _stats(), _stats()
    expected = CALLS[name](x, w, b, theirs)
    with DecomposedNorms():
        actual = CALLS[name](x, w, b, ours)
    torch.testing.assert_close(actual, expected)
    for a, e in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, e)


NORMS = {
    "layer_norm": lambda h, g: F.layer_norm(h, (6,), g),
    "batch_norm": lambda h, g: F.batch_norm(h, None, None, g, training=True),
    "instance_norm": lambda h, g: F.instance_norm(h[:, :, None] * torch.arange(1, 4, dtype=DOUBLE),
                                                  weight=g).sum(-1),
}


@pytest.mark.parametrize("mode", ["vmap", "jvp"])
@pytest.mark.parametrize("norm", list(NORMS))
def test_batched_and_forward_derivatives_are_right(norm: str, mode: str) -> None:
    """d/dW of the vmapped vjp (or of the jvp) w.r.t. the norm's weight, vs a plain loop."""
    x = torch.randn(5, 6, dtype=DOUBLE)
    W, gamma, v, C = (torch.randn(6, 6, dtype=DOUBLE), torch.randn(6, dtype=DOUBLE),
                      torch.randn(6, dtype=DOUBLE), torch.randn(5, 6, dtype=DOUBLE))

    def f(W: Tensor, gamma: Tensor) -> Tensor:
        return torch.tanh(NORMS[norm](x @ W.T, gamma)) @ v

    def rows_times_c(W: Tensor, way: str) -> Tensor:
        if way == "jvp":
            return torch.func.jvp(lambda g: f(W, g), (gamma,), (C[0],))[1].sum()
        _, vjp_fn = torch.func.vjp(lambda g: f(W, g), gamma)
        basis = torch.eye(5, dtype=DOUBLE)
        J = torch.func.vmap(vjp_fn)(basis)[0] if way == "vmap" else \
            torch.stack([vjp_fn(e)[0] for e in basis])
        return (J @ C[0]).sum() if mode == "jvp" else (J * C).sum()

    expected = torch.func.grad(rows_times_c)(W, "loop")
    with DecomposedNorms():
        actual = torch.func.grad(rows_times_c)(W, mode)
    torch.testing.assert_close(actual, expected)


def test_torch_still_gets_batched_norm_derivatives_wrong() -> None:
    """When this fails, torch fixed its batching rules: DecomposedNorms can go."""
    x, W, gamma = (torch.randn(5, 6, dtype=DOUBLE), torch.randn(6, 6, dtype=DOUBLE),
                   torch.randn(6, dtype=DOUBLE))

    def weight_jacobian_sum(W: Tensor, batched: bool) -> Tensor:
        _, vjp_fn = torch.func.vjp(lambda g: torch.tanh(F.layer_norm(x @ W.T, (6,), g)).sum(-1),
                                   gamma)
        basis = torch.eye(5, dtype=DOUBLE)
        J = torch.func.vmap(vjp_fn)(basis)[0] if batched else \
            torch.stack([vjp_fn(e)[0] for e in basis])
        return (J * torch.arange(30, dtype=DOUBLE).reshape(5, 6)).sum()

    batched = torch.func.grad(weight_jacobian_sum)(W, True)
    looped = torch.func.grad(weight_jacobian_sum)(W, False)
    assert not torch.allclose(batched, looped), "torch fixed layer_norm's batched backward"


@pytest.mark.parametrize("norm", ["layer_norm", "batch_norm"])
def test_torch_still_gets_third_norm_derivatives_wrong_without_vmap(norm: str) -> None:
    """Plain nested autograd, no vmap: the third derivative of the fused kernels is wrong in
    torch 2.13 (layer_norm 0.29, batch_norm 0.88 off, relative); the same arithmetic decomposed
    is right. When this fails, torch fixed its double backwards' derivatives."""
    generator = torch.Generator().manual_seed(0)
    x, gamma = (torch.randn(3, 6, generator=generator, dtype=DOUBLE),
                torch.randn(6, generator=generator, dtype=DOUBLE))

    def second(x: Tensor, leaf: Tensor | None = None) -> Tensor:
        """``‖d/dx ‖d/dγ Σ sin(norm(x))‖²‖²`` (differentiable in ``leaf`` if given)."""
        leaf = x.clone().requires_grad_() if leaf is None else leaf
        weight = gamma.clone().requires_grad_()
        value = torch.sin(F.layer_norm(leaf, (6,), weight) if norm == "layer_norm" else
                          F.batch_norm(leaf, None, None, weight, training=True)).sum()
        by_weight = torch.autograd.grad(value, weight, create_graph=True)[0]
        by_x = torch.autograd.grad(by_weight.square().sum(), leaf, create_graph=True)[0]
        return by_x.square().sum()

    def third(x: Tensor) -> Tensor:
        leaf = x.clone().requires_grad_()
        return torch.autograd.grad(second(x, leaf), leaf)[0]

    central = central_differences(second, x)
    fused = third(x)
    with DecomposedNorms():
        decomposed = third(x)
    torch.testing.assert_close(decomposed, central, rtol=1e-6,
                               atol=1e-6 * central.abs().max().item())
    assert not torch.allclose(fused, central, rtol=1e-3), \
        "torch fixed the third derivatives of layer_norm / batch_norm"
