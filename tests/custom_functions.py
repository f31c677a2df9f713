"""Custom ``autograd.Function``s that tests put inside ``f`` (new-style and old-style).

Their ``forward`` runs with gradients off and their derivative is their ``backward``'s (NOTE
[uses with gradients off]); the old-style ones (``forward(ctx, ...)``) torch refuses under
``torch.func`` transforms (NOTE [old-style autograd.Functions]).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def _linear_grads(h: Tensor, w: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    """The gradients of ``h @ wᵀ`` in ``h`` and ``w`` for the output's ``grad``."""
    flat = grad.reshape(-1, grad.shape[-1])
    return grad @ w, flat.T @ h.reshape(-1, h.shape[-1])


class FunctionLinear(torch.autograd.Function):
    """``h @ wᵀ`` as a custom Function (``forward`` without ``ctx``): its forward's ops run with
    gradients off, and the derivative is its ``backward``'s (NOTE [uses with gradients off])."""

    generate_vmap_rule = True

    @staticmethod
    def forward(h: Tensor, w: Tensor) -> Tensor:  # noqa: D102
        return h @ w.T

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:  # noqa: D102
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:  # noqa: D102
        return _linear_grads(*ctx.saved_tensors, grad)


class OldStyleFunctionLinear(torch.autograd.Function):
    """The same written the old way (``forward(ctx, ...)``): refused under ``torch.func``."""

    @staticmethod
    def forward(ctx: Any, h: Tensor, w: Tensor) -> Tensor:  # noqa: D102
        ctx.save_for_backward(h, w)
        return h @ w.T

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:  # noqa: D102
        return _linear_grads(*ctx.saved_tensors, grad)


class OldStyleCube(torch.autograd.Function):
    """``x³`` the pre-torch.func way."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # noqa: D102
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # noqa: D102
        (x,) = ctx.saved_tensors
        return 3 * x**2 * grad


class RouteOnCtx(torch.autograd.Function):
    """``h[perm]`` whose backward reads ``perm`` from an attribute of ``ctx``."""

    @staticmethod
    def forward(ctx: Any, h: Tensor, perm: Tensor) -> Tensor:
        ctx.perm = perm
        return h[perm]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return torch.zeros_like(grad).index_add(0, ctx.perm, grad), None


class RouteSaved(torch.autograd.Function):
    """``h[perm]`` whose backward reads ``perm`` from ``ctx.save_for_backward``."""

    @staticmethod
    def forward(ctx: Any, h: Tensor, perm: Tensor) -> Tensor:
        ctx.save_for_backward(perm)
        return h[perm]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (perm,) = ctx.saved_tensors
        return torch.zeros_like(grad).index_add(0, perm, grad), None


class NumpySquare(torch.autograd.Function):
    """``x²`` with its backward through numpy: vmap cannot batch it, so walks and passes that
    vectorize over rows fall back to loops (NOTE [vmap fallback])."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x**2

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return torch.from_numpy(2 * x.numpy() * grad.numpy())


class ItemInBackward(torch.autograd.Function):
    """``2 x``, new-style, whose backward reads a Python number (``.item()``): each row's
    backward runs, a backward vmapped over several rows cannot (NOTE [batched backwards that
    fail])."""

    @staticmethod
    def forward(x: Tensor) -> Tensor:  # noqa: D102
        return x * 2

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor], output: Tensor) -> None:  # noqa: D102
        pass

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # noqa: D102
        scale = 2.0 if grad.abs().max().item() >= 0 else 0.0
        return grad * scale


class SavesInput(torch.autograd.Function):
    """New-style, vmappable, its input saved for ``backward``: subclasses give the maths."""

    generate_vmap_rule = True

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, ...], output: Tensor) -> None:  # noqa: D102
        ctx.save_for_backward(inputs[0])


class WhereRelu(SavesInput):
    """A ReLU whose backward selects (``where``) instead of multiplying: opaque to the checks'
    NaN directions (NOTE [opaque selections])."""

    @staticmethod
    def forward(x: Tensor) -> Tensor:  # noqa: D102
        return x.clamp(min=0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # noqa: D102
        (x,) = ctx.saved_tensors
        return torch.where(x > 0, grad, 0.0)


class SquareWithoutVmap(SavesInput):
    """``x²`` with a jvp and no vmap rule: ``vmap`` over samples refuses it, ``grad`` and
    ``jvp`` run it, and a trace cannot tell (NOTE [vmap failures remembered])."""

    generate_vmap_rule = False

    @staticmethod
    def forward(x: Tensor) -> Tensor:  # noqa: D102
        return x * x

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, ...], output: Tensor) -> None:  # noqa: D102
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # noqa: D102
        (x,) = ctx.saved_tensors
        return 2 * x * grad

    @staticmethod
    def jvp(ctx: Any, tangent: Tensor) -> Tensor:  # noqa: D102
        (x,) = ctx.saved_tensors
        return 2 * x * tangent
