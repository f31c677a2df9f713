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
#
# Under an enclosing forward-mode transform (the caller's ``jvp`` / ``jacfwd`` through ``G``)
# the `where` also gives the *caller's* tangent the backward's branch, where torch's forward
# mode, and so the oracle under that transform, gives it the other operand's: the caller's
# tangent of ``G`` then mixes the conventions (0.034 off with ``fmax(h, 0)`` after a GRU cell,
# fuzz seed 4444, session 45; up to 0.54 on other draws). Nothing takes ntvp's own level alone
# (as with NOTE [no_grad in forward mode]), so there a call whose conventions differ at its
# values (a tie) raises :class:`TieInForwardMode` and ntvp declines, naming the backends that
# can; the other calls take one derivative in every convention and run on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from torchgram._core.census import _argument


class TieInForwardMode(RuntimeError):
    """A rewritten call at a tie while the caller's forward mode differentiates ``G``."""


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

_OUT_OF_PLACE: dict[Any, Any] = {
    Tensor.clamp_: torch.clamp, Tensor.clip_: torch.clamp, torch.clamp_: torch.clamp,
    torch.clip_: torch.clamp, Tensor.clamp_min_: torch.clamp_min,
    Tensor.clamp_max_: torch.clamp_max,
}
"""In-place calls of :data:`_REWRITES`, checked as their out-of-place forms."""


def _modes_differ(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether torch's forward mode takes another derivative than the backward at these values.

    One small jvp of the plain call and of the rewrite per floating tensor argument.

    Measured rather than tabled: in torch 2.13 ``fmax`` at a tie and ``clamp`` with one tensor
    bound at it differ, ``fmin``, ``clamp`` with two and ``clamp_min`` / ``clamp_max`` do not.
    Where the values cannot be read (batched under ``vmap``), as if they differed.
    """
    func = _OUT_OF_PLACE.get(func, func)
    rewrite = _REWRITES[func]
    if rewrite(args, kwargs) is None:  # not rewritten (number bounds, out=): torch's own
        return False
    every_slot: list[int | str] = [*range(len(args)), *kwargs]
    for slot in every_slot:
        value = args[slot] if isinstance(slot, int) else kwargs[slot]
        if not isinstance(value, Tensor) or not value.is_floating_point():
            continue

        def call(op: Callable[..., Any], replaced: Tensor, slot: int | str = slot) -> Any:
            call_args, call_kwargs = list(args), dict(kwargs)
            if isinstance(slot, int):
                call_args[slot] = replaced
            else:
                call_kwargs[slot] = replaced
            return op(tuple(call_args), call_kwargs)

        tangent = (torch.ones_like(value),)
        try:
            plain = torch.func.jvp(lambda v: call(lambda a, k: func(*a, **k), v), (value,),
                                   tangent)[1]
            ours = torch.func.jvp(lambda v: call(rewrite, v), (value,), tangent)[1]
            if not torch.equal(plain.nan_to_num(), ours.nan_to_num()):
                return True
        except RuntimeError:  # data-dependent control flow under vmap
            return True
    return False


class ReverseKinks(TorchFunctionMode):
    """Computes the calls of :data:`_REWRITES` with the backward's derivative at kinks.

    NOTE [kinks in forward mode]. Same values; other calls run unchanged.

    ``refuse_ties``: raise :class:`TieInForwardMode` at a call with a tie instead (the
    caller's forward mode differentiates the pass).

    Example:
        >>> x = torch.tensor([-1.0, 0.0, 2.0], requires_grad=True)
        >>> with ReverseKinks():
        ...     y = torch.fmax(x, torch.zeros(3))
        >>> y.detach(), y.grad_fn.name()  # the same values, where's derivatives
        (tensor([0., 0., 2.]), 'WhereBackward0')
    """

    def __init__(self, *, refuse_ties: bool = False) -> None:
        super().__init__()
        self._refuse_ties = refuse_ties

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        try:
            rewrite = _REWRITES.get(func)
        except TypeError:  # unhashable callables
            rewrite = None
        if rewrite is not None and self._refuse_ties \
                and _modes_differ(func, args, kwargs):
            raise TieInForwardMode(getattr(func, "__name__", "a call"))
        if rewrite is not None:
            result = rewrite(args, kwargs)
            if result is not None:
                return result
        return func(*args, **kwargs)
