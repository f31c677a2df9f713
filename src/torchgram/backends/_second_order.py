"""Ops whose forward-mode derivative torch cannot differentiate again, for the ntvp backend.

# NOTE [forward-mode derivatives that are not differentiable]
ntvp's columns ``J (Jᵀ e)`` push vjps forward with forward-mode AD. Where ``G`` is
differentiated (the caller's ``grad`` / ``jvp`` through it, or eager create-graph: NOTE
[composition]), its derivative differentiates those forward-mode derivatives once more. For
some ops torch 2.13's forward-mode formula is right to first order, but its own derivative
is not: against central differences in float64 at generic points, the derivative (forward
or reverse) of the jvp of

* determinants (``linalg.det``, ``det``, ``slogdet``, ``logdet``): 5e-2 to 40 off, relative;
* linear solves (``linalg.solve``, ``solve_ex``, ``tensorsolve``): 0.1 to 1;
* ``householder_product`` / ``orgqr`` (0.7) and ``cholesky_inverse`` (0.2);
* ``cumprod`` where its input holds a zero (1 to 11 forward, NaN reverse; exact elsewhere)

while the derivatives of their reverse-mode products are right (up to ``cholesky_inverse``
under the caller's forward mode, which the dense oracle shares). ntvp's gradients of
Gramians through them were 0.0025 (slogdet) to 0.38 (cholesky_inverse) off the oracle, NaN
through cumprod (session 45's hunt of ops' second derivatives,
``tests/backends/test_second_order.py``). The normalisation kernels with
the same fault are decomposed instead (NOTE [decomposed norms]). So where ``G`` may be
differentiated, ntvp's forward pass raises :class:`ForwardDerivativeNotDifferentiable` at a
call of these ops (``cumprod`` only where its input holds a zero, or cannot be read) and
ntvp declines, naming ``jacobian``, whose reverse-mode products differentiate right.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode, resolve_name

from torchgram._core.census import _argument


class ForwardDerivativeNotDifferentiable(RuntimeError):
    """A call whose forward-mode derivative torch cannot differentiate, while ``G`` may be."""


def _always(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return True


def _holds_a_zero(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the first argument holds a zero (as if it did where it cannot be read)."""
    x = _argument(args, kwargs, 0, "input")
    if not isinstance(x, Tensor):
        return False
    try:
        return bool((x == 0).any())
    except RuntimeError:  # data-dependent control flow under vmap
        return True


_REFUSED: dict[Any, Callable[[tuple[Any, ...], dict[str, Any]], bool]] = {
    **dict.fromkeys([torch.linalg.det, torch.det, Tensor.det, torch.linalg.slogdet,
                     torch.slogdet, Tensor.slogdet, torch.logdet, Tensor.logdet,
                     torch.linalg.solve, torch.linalg.solve_ex, torch.linalg.tensorsolve,
                     torch.linalg.householder_product, torch.orgqr, Tensor.orgqr,
                     torch.cholesky_inverse, Tensor.cholesky_inverse], _always),
    **dict.fromkeys([torch.cumprod, Tensor.cumprod, Tensor.cumprod_], _holds_a_zero),
}
"""The calls of the NOTE above, with when their forward-mode derivative goes wrong."""


class RefuseUndifferentiableTangents(TorchFunctionMode):
    """Raises :class:`ForwardDerivativeNotDifferentiable` at the calls of :data:`_REFUSED`.

    NOTE [forward-mode derivatives that are not differentiable]; other calls run unchanged.

    Example:
        >>> a = torch.eye(2)
        >>> with RefuseUndifferentiableTangents():
        ...     torch.linalg.det(a)
        Traceback (most recent call last):
        ...
        torchgram.backends._second_order.ForwardDerivativeNotDifferentiable: torch.linalg.det
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        try:
            refused = _REFUSED.get(func)
        except TypeError:  # unhashable callables
            refused = None
        if refused is not None and refused(args, kwargs):
            raise ForwardDerivativeNotDifferentiable(resolve_name(func) or "a call")
        return func(*args, **kwargs)
