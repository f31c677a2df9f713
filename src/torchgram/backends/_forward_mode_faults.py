"""Ops whose forward-mode derivative torch gets wrong where ntvp's ``G`` is composed.

# NOTE [forward-mode derivatives torch gets wrong]
ntvp's columns ``J (Jᵀ e)`` push vjps forward with forward-mode AD. Two compositions of those
forward-mode derivatives are wrong in torch 2.13 for some ops, without a word (session 45's
hunt of about 120 ops, float64, against central differences and against the same products
made one at a time):

* **Differentiated once more**, where ``G`` is differentiated (the caller's ``grad`` / ``jvp``
  through it, or eager create-graph: NOTE [composition]): determinants (``linalg.det``,
  ``det``, ``slogdet``, ``logdet``; 5e-2 to 40 off, relative), linear solves
  (``linalg.solve``, ``solve_ex``, ``tensorsolve``; 0.1 to 1), ``householder_product`` /
  ``orgqr`` (0.7), ``cholesky_inverse`` (0.2) and ``cumprod`` where its input holds a zero
  (1 to 11, NaN in reverse; exact elsewhere), while the derivatives of their reverse-mode
  products are right (``cholesky_inverse``'s under forward mode aside, which the dense
  oracle shares). ntvp's gradients of Gramians through them were 0.0025 (slogdet) to 0.38
  (cholesky_inverse) off the oracle, NaN through cumprod.
* **Batched twice**, under the caller's ``vmap`` (ensembles over parameters or inputs), where
  ntvp's pass vmaps its tangents inside the caller's batch of primals: ``det``, ``slogdet``,
  ``logdet``, the linear solves and ``lu_solve`` give jvps O(1) to 1e3 off the same jvps made
  one at a time (copying the matrix first does not help; one level of ``vmap`` alone is
  right on contiguous matrices, and ntvp never batches primals itself); ntvp's Gramians of
  networks with a determinant were 0.2 to 280 off there.

* **At first order**, on plain calls (session 53's scan of torch's OpInfos, ``jacfwd``
  against ``jacrev`` and central differences): ``cholesky_inverse`` of any ordinary factor
  (0.03 off where its entries are 0.3) and ``logcumsumexp`` where the values along the dim
  spread by more than about 15 (``d out[0] / d x[0]`` is 0.48 instead of 1 at ``[0, 30]``).
  ntvp's G was 0.03 and 1.4e-3 off the oracle, without a word.

The normalisation kernels with the first fault are decomposed instead (NOTE [decomposed
norms]). So in those situations ntvp's forward pass raises :class:`WrongForwardDerivative`
at a call of these ops (``cumprod`` only where its input holds a zero, or cannot be read),
and ntvp declines, naming ``jacobian``, whose reverse-mode products are right there; the
third fault's calls it declines on every call (``logcumsumexp`` whatever its values: the
spread at which it goes wrong is not a clean bound).
``tests/backends/test_forward_mode_faults.py`` checks the refusals, the other backends
against the oracle, and that torch still gets ``det`` and ``solve`` wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode, resolve_name

from torchgram._core.census import _argument


class WrongForwardDerivative(RuntimeError):
    """A call whose forward-mode derivative torch gets wrong in the situation of the call.

    Attributes:
        call: The call's name (``torch.linalg.det``).
        differentiated: Whether it is wrong because ``G`` may be differentiated (else: because
            the caller's ``vmap`` batches its primals, or at first order).
        first_order: Whether its forward-mode derivative itself is wrong (the third fault).
    """

    def __init__(self, call: str, *, differentiated: bool, first_order: bool = False) -> None:
        super().__init__(call)
        self.call = call
        self.differentiated = differentiated
        self.first_order = first_order


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


_DETERMINANTS_AND_SOLVES = [
    torch.linalg.det, torch.det, Tensor.det, torch.linalg.slogdet, torch.slogdet,
    Tensor.slogdet, torch.logdet, Tensor.logdet, torch.linalg.solve, torch.linalg.solve_ex,
    torch.linalg.tensorsolve]

_WRONG_ONCE_DIFFERENTIATED: dict[Any, Callable[[tuple[Any, ...], dict[str, Any]], bool]] = {
    **dict.fromkeys([*_DETERMINANTS_AND_SOLVES, torch.linalg.householder_product, torch.orgqr,
                     Tensor.orgqr, torch.cholesky_inverse, Tensor.cholesky_inverse], _always),
    **dict.fromkeys([torch.cumprod, Tensor.cumprod, Tensor.cumprod_], _holds_a_zero),
}
"""The first fault of the NOTE above, with when the derivative goes wrong."""

_WRONG_BATCHED_TWICE = frozenset(
    [*_DETERMINANTS_AND_SOLVES, torch.linalg.lu_solve, torch.lu_solve])
"""The second fault of the NOTE above."""

_WRONG_AT_FIRST_ORDER = frozenset(
    [torch.cholesky_inverse, Tensor.cholesky_inverse, torch.logcumsumexp,
     Tensor.logcumsumexp])
"""The third fault of the NOTE above."""

_WATCHED = _WRONG_AT_FIRST_ORDER | frozenset(_WRONG_ONCE_DIFFERENTIATED) | _WRONG_BATCHED_TWICE
"""Every call one of the faults may refuse (the others run after one set lookup)."""


class RefuseWrongTangents(TorchFunctionMode):
    """Raises :class:`WrongForwardDerivative` at the calls the situation makes wrong.

    NOTE [forward-mode derivatives torch gets wrong]; other calls run unchanged.

    Args:
        differentiated: ``G`` may be differentiated.
        batched: The caller's ``vmap`` batches the primals.

    Example:
        >>> with RefuseWrongTangents(differentiated=True, batched=False):
        ...     torch.linalg.det(torch.eye(2))
        Traceback (most recent call last):
        ...
        torchgram.backends._forward_mode_faults.WrongForwardDerivative: torch.linalg.det
    """

    def __init__(self, *, differentiated: bool, batched: bool) -> None:
        super().__init__()
        self._differentiated = differentiated
        self._batched = batched

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        try:
            if func not in _WATCHED:  # most calls: one lookup
                return func(*args, **kwargs)
        except TypeError:  # unhashable callables
            return func(*args, **kwargs)
        if func in _WRONG_AT_FIRST_ORDER:
            raise WrongForwardDerivative(resolve_name(func) or "a call", differentiated=False,
                                         first_order=True)
        wrong_differentiated = _WRONG_ONCE_DIFFERENTIATED.get(func)
        wrong_batched = func in _WRONG_BATCHED_TWICE
        if self._differentiated and wrong_differentiated is not None \
                and wrong_differentiated(args, kwargs):
            raise WrongForwardDerivative(resolve_name(func) or "a call", differentiated=True)
        if self._batched and wrong_batched:
            raise WrongForwardDerivative(resolve_name(func) or "a call", differentiated=False)
        return func(*args, **kwargs)
