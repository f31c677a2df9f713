"""Forward mode with the backward's derivative at kinks, for the ntvp backend.

# NOTE [kinks in forward mode]
# At a kink (a tie between an input and a bound, an input at zero) a function has no
# derivative, and torch picks one by convention, in each mode by its own formula. For most
# ops both modes pick the same (relu, abs, clamp with number bounds, maximum, amax, max
# pooling, sort, ...), but in torch 2.13 these do not:
#
# * fmax / fmin of two tensors at a tie: the backward gives the derivative to the first
#   operand, forward mode to the second;
# * clamp / clip with tensor bounds at x = min or x = max: the backward gives it to x,
#   forward mode to the bound.
#
# ntvp computes column i of G as J (Jᵀ e_i): a vjp pushed forward by a jvp, so at such a tie it
# multiplied the backward's Jacobian by forward mode's, which is neither G of the oracle
# (jacrev) nor of any one convention: 0.60 off (relative) with fmax(h, 0) where a row of the
# weight was zero (session 39, trying ops at their kinks by hand; prelu, whose forward mode
# takes the slope 1 at x = 0 against the backward's w, runs as `torch.where` in every
# evaluation: NOTE [prelu as where]). Ties
# are not rare in practice: zero inputs (padding, black borders) with zero biases put
# pre-activations exactly at 0. So ntvp's forward-mode pass runs under ReverseKinks, which
# computes these calls as `torch.where` of the same values under the backward's condition;
# `where`'s derivative in both modes is that of the branch it takes, hence the backward's
# convention in forward mode too. Values are unchanged, NaN included (fmax/fmin skip a NaN,
# clamp propagates x's). The rewrite only runs inside ntvp's forward-mode pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from torchgram._core.census import _argument


def _fmax_or_fmin(keeps_first: Callable[[Tensor, Tensor], Tensor]
                  ) -> Callable[[tuple[Any, ...], dict[str, Any]], Tensor | None]:
    def rewrite(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
        first, second = _argument(args, kwargs, 0, "input"), _argument(args, kwargs, 1, "other")
        if not isinstance(first, Tensor) or not isinstance(second, Tensor) \
                or "out" in kwargs:
            return None
        # the backward's mask: the first operand where it wins or ties, or the second is NaN
        return torch.where(keeps_first(first, second) | second.isnan(), first, second)

    return rewrite


def _clamp(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    x = _argument(args, kwargs, 0, "input")
    low, high = _argument(args, kwargs, 1, "min", None), _argument(args, kwargs, 2, "max", None)
    if not isinstance(x, Tensor) or not x.is_floating_point() or "out" in kwargs \
            or not (isinstance(low, Tensor) or isinstance(high, Tensor)):
        return None  # number bounds: both modes agree
    if low is not None and not isinstance(low, Tensor) \
            or high is not None and not isinstance(high, Tensor):
        return None  # a tensor and a number: torch refuses that overload
    result = x
    if low is not None:  # the backward: to x where x >= min, to min where x < min
        result = torch.where(result >= low, result,
                             torch.where(result < low, low, _nan(result, low)))
    if high is not None:
        result = torch.where(result <= high, result,
                             torch.where(result > high, high, _nan(result, high)))
    return result


def _nan(x: Tensor, bound: Tensor) -> Tensor:
    """Where ``x`` or ``bound`` is NaN: NaN, without a derivative (as clamp's backward)."""
    return torch.where(bound.isnan(), bound, x).detach()


def _in_place(rewrite: Callable[[tuple[Any, ...], dict[str, Any]], Tensor | None]
              ) -> Callable[[tuple[Any, ...], dict[str, Any]], Tensor | None]:
    """The in-place variant of ``rewrite``: its value written into the first argument."""
    def in_place(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
        result = rewrite(args, kwargs)
        if result is None or result.shape != args[0].shape:
            return None
        return args[0].copy_(result)

    return in_place


def _clamp_bound(name: str) -> Callable[[tuple[Any, ...], dict[str, Any]], Tensor | None]:
    def rewrite(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
        bound = _argument(args, kwargs, 1, name)
        return _clamp((_argument(args, kwargs, 0, "input"),), {name: bound})

    return rewrite


_REWRITES: dict[Any, Callable[[tuple[Any, ...], dict[str, Any]], Tensor | None]] = {
    torch.fmax: _fmax_or_fmin(torch.ge), Tensor.fmax: _fmax_or_fmin(torch.ge),
    torch.fmin: _fmax_or_fmin(torch.le), Tensor.fmin: _fmax_or_fmin(torch.le),
    torch.clamp: _clamp, torch.clip: _clamp, Tensor.clamp: _clamp, Tensor.clip: _clamp,
    torch.clamp_min: _clamp_bound("min"), Tensor.clamp_min: _clamp_bound("min"),
    torch.clamp_max: _clamp_bound("max"), Tensor.clamp_max: _clamp_bound("max"),
    Tensor.clamp_: _in_place(_clamp), Tensor.clip_: _in_place(_clamp),
    torch.clamp_: _in_place(_clamp), torch.clip_: _in_place(_clamp),
    Tensor.clamp_min_: _in_place(_clamp_bound("min")),
    Tensor.clamp_max_: _in_place(_clamp_bound("max")),
}
"""The calls whose forward-mode derivative at a kink is not the backward's (NOTE above)."""


class ReverseKinks(TorchFunctionMode):
    """Computes the calls of :data:`_REWRITES` with the backward's derivative at kinks.

    NOTE [kinks in forward mode]. Same values; other calls run unchanged.

    Example:
        >>> x = torch.tensor([-1.0, 0.0, 2.0], requires_grad=True)
        >>> with ReverseKinks():
        ...     y = torch.fmax(x, torch.zeros(3))
        >>> y.detach(), y.grad_fn.name()  # the same values, where's derivatives
        (tensor([0., 0., 2.]), 'WhereBackward0')
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        try:
            rewrite = _REWRITES.get(func)
        except TypeError:  # unhashable callables
            rewrite = None
        if rewrite is not None:
            result = rewrite(args, kwargs)
            if result is not None:
                return result
        return func(*args, **kwargs)
