"""Kernels that are differentiated: eager autograd through ``ntk_fn`` and ``torch.func`` around it.

Dataset distillation (kernel inducing points) and NTK-based input optimisation differentiate
the kernel with respect to the inputs and the parameters. With inputs or parameters that
require grad, the kernel carries the autograd graph (NOTE [composition]); inside
``torch.func.grad`` / ``vmap`` the composing backends compute it and the others refuse with a
torchgram error. Every gradient is compared with the same gradient of the differentiable
oracle (``reference.differentiable_cross_kernel``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 -- torch's own spelling
from torch import Tensor

import torchgram as tg
from reference import differentiable_cross_kernel

DTYPE = torch.float64
TOLERANCE = 1e-10


def _mlp(params: dict[str, Tensor], x: Tensor) -> Tensor:
    """Layer norm, a tanh layer and a linear head: ``[B, 4] -> [B, 3]``."""
    hidden = torch.tanh(F.layer_norm(x, (4,)) @ params["w1"].T + params["b1"])
    return hidden @ params["w2"].T


def _sequence(params: dict[str, Tensor], x: Tensor) -> Tensor:
    """The same layers on every position, averaged: ``[B, T, 4] -> [B, 3]`` (weight uses with
    positions: the structured kernels materialize them row by row)."""
    hidden = torch.tanh(x @ params["w1"].T + params["b1"])
    return (hidden @ params["w2"].T).mean(1)


MODELS: dict[str, tuple[Callable[..., Tensor], tuple[int, ...]]] = {
    "mlp": (_mlp, (4,)), "sequence": (_sequence, (3, 4))}
SPECS = {"full": ((), ()), "trace": ((-1,), ()), "diagonal": ((), (0,))}


def _params(generator: torch.Generator) -> dict[str, Tensor]:
    return {"w1": torch.randn(5, 4, generator=generator, dtype=DTYPE),
            "b1": torch.randn(5, generator=generator, dtype=DTYPE),
            "w2": torch.randn(3, 5, generator=generator, dtype=DTYPE)}


def _inputs(model: str, second: bool) -> tuple[Tensor, Tensor | None, dict[str, Tensor]]:
    generator = torch.Generator().manual_seed(0)
    shape = MODELS[model][1]
    x1 = torch.randn(3, *shape, generator=generator, dtype=DTYPE)
    x2 = torch.randn(2, *shape, generator=generator, dtype=DTYPE) if second else None
    return x1, x2, _params(generator)


def _relative(actual: Tensor | None, expected: Tensor | None, like: Tensor) -> float:
    actual = torch.zeros_like(like) if actual is None else actual
    expected = torch.zeros_like(like) if expected is None else expected
    scale = max(expected.abs().max().item(), 1e-12)
    return (actual - expected).abs().max().item() / scale


EAGER_GRID = [
    pytest.param(model, backend, vmap, second, spec, budget,
                 id=f"{model}-{backend}-vmap{vmap}-{'x2' if second else 'self'}-{spec}"
                    f"{'-tiles' if budget else ''}")
    for model in MODELS
    for backend in ("auto", "structured", "jacobian", "ntvp")
    for vmap in (0, None)
    for second in (False, True)
    for spec in SPECS
    for budget in (None, 200)
    if not (second and spec == "diagonal") and not (budget and (vmap is None or model != "mlp"))]


@pytest.mark.parametrize(("model", "backend", "vmap", "second", "spec", "budget"), EAGER_GRID)
def test_eager_gradients_of_a_kernel_match_the_oracle(model: str, backend: str,
                                                      vmap: int | None, second: bool,
                                                      spec: str, budget: int | None) -> None:
    """Inputs and parameters that require grad: ``∂⟨R, K⟩`` for each of them, as the oracle's."""
    f = MODELS[model][0]
    x1, x2, params = _inputs(model, second)
    leaves = [x1, *([] if x2 is None else [x2]), *params.values()]
    for leaf in leaves:
        leaf.requires_grad_()
    trace, diagonal = SPECS[spec]
    ntk_fn = tg.ntk.empirical_ntk_fn(f, trace_axes=trace, diagonal_axes=diagonal,
                                     vmap_axes=vmap, backend=backend, memory_budget=budget)
    kernel = ntk_fn(x1, x2, params)
    if budget is not None:
        assert ntk_fn.last_run is not None and ntk_fn.last_run.tiles != (1, 1)
    expected = differentiable_cross_kernel(f, params, x1, x2, trace, diagonal)
    assert _relative(kernel.detach(), expected.detach(), expected) <= TOLERANCE
    weights = torch.randn(kernel.shape, generator=torch.Generator().manual_seed(1), dtype=DTYPE)
    grads = torch.autograd.grad((kernel * weights).sum(), leaves, allow_unused=True)
    expected_grads = torch.autograd.grad((expected * weights).sum(), leaves, allow_unused=True)
    for leaf, grad, expected_grad in zip(leaves, grads, expected_grads, strict=True):
        assert _relative(grad, expected_grad, leaf) <= TOLERANCE
    assert all(leaf.grad is None for leaf in leaves)  # autograd.grad: nothing accumulated


TRANSFORM_GRID = [
    pytest.param(model, backend, vmap, second, budget,
                 id=f"{model}-{backend}-vmap{vmap}-{'x2' if second else 'self'}"
                    f"{'-tiles' if budget else ''}")
    for model in MODELS
    for backend in ("auto", "jacobian", "ntvp")
    for vmap in (0, None)
    for second in (False, True)
    for budget in (None, 200)
    if not (budget and (vmap is None or model != "mlp"))]


@pytest.mark.parametrize(("model", "backend", "vmap", "second", "budget"), TRANSFORM_GRID)
def test_torch_func_grad_and_vmap_through_a_kernel(model: str, backend: str, vmap: int | None,
                                                   second: bool, budget: int | None) -> None:
    """``torch.func.grad`` of a kernel objective in ``x1``, and ``vmap`` over stacked ``x1``s."""
    f = MODELS[model][0]
    x1, x2, params = _inputs(model, second)
    ntk_fn = tg.ntk.empirical_ntk_fn(f, vmap_axes=vmap, backend=backend, memory_budget=budget)

    def objective(kernel_of: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
        return lambda x: kernel_of(x).square().sum()

    grad = torch.func.grad(objective(lambda x: ntk_fn(x, x2, params)))(x1)
    expected = torch.func.grad(objective(
        lambda x: differentiable_cross_kernel(f, params, x, x2, (-1,))))(x1)
    assert _relative(grad, expected, x1) <= TOLERANCE
    if budget is not None:
        assert ntk_fn.last_run is not None and ntk_fn.last_run.tiles != (1, 1)

    stacked = torch.stack([x1, 2 * x1, x1.flip(0)])
    kernels = torch.func.vmap(lambda x: ntk_fn(x, x2, params))(stacked)
    expected_kernels = torch.stack([differentiable_cross_kernel(f, params, x, x2, (-1,))
                                    for x in stacked])
    assert _relative(kernels, expected_kernels, expected_kernels) <= TOLERANCE


def test_structured_refuses_inside_transforms_with_a_torchgram_error() -> None:
    """The structured kernels run ``f`` with eager autograd: inside ``torch.func.grad`` they
    refuse, naming the backends that compose (``auto`` picks one of those)."""
    x1, x2, params = _inputs("mlp", True)
    ntk_fn = tg.ntk.empirical_ntk_fn(_mlp, backend="structured")
    with pytest.raises(tg.BackendCannotRun, match="jacobian"):
        torch.func.grad(lambda x: ntk_fn(x, x2, params).sum())(x1)


def test_a_kernel_of_plain_tensors_carries_no_graph() -> None:
    """Nothing requires grad: the kernel is a plain tensor (no graph kept by the call)."""
    x1, x2, params = _inputs("mlp", True)
    for backend in ("auto", "structured", "jacobian", "ntvp"):
        kernel: Any = tg.ntk.empirical_ntk_fn(_mlp, backend=backend)(x1, x2, params)
        assert not kernel.requires_grad and kernel.grad_fn is None
