"""``scatter_reduce`` max/min without ``self`` with a right backward in torchgram's evaluations.

# NOTE [scatter_reduce's ties with the excluded self]
``scatter_reduce(input, dim, index, src, "amax" | "amin", include_self=False)`` leaves
``input`` out of the reduction, but torch 2.13's backward still counts it: where the reduced
value equals the position's own (excluded) value, it halves the gradient to ``src`` as for a
tie (session 53's OpInfo scan; by hand in session 54: max-aggregation into a zeros buffer, as
message passing does, with a message exactly 0, e.g. from a zero-initialised layer:
``d out[0] / d src[0]`` was 0.5 for 1). The dense oracle and every backend followed it, 0.75
off ``G`` (relative) on the scan's case. So when the probe sees ``f`` call it, every later
evaluation of ``f`` runs under :class:`ScatterReduceWithoutSelf`: such a call becomes
``where(received, scatter_reduce(full(∓inf), dim, index, src, reduce, include_self=True),
input)``, with ``received`` the positions ``index`` reaches (a constant): the same values,
and ``src``'s derivative split among ties within ``src`` only, as torch does among sources.
Other reductions, ``include_self=True`` and the in-place ``scatter_reduce_`` run unchanged.
On graphs built outside these evaluations (``tg.autograd``), the walk refuses the node where
such a tie occurred (:func:`check_scatter_reduce_node`). Evaluations under a cached probe that
did not see the call and then meet it start over (NOTE [stale probes]).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from torchgram._core.errors import DerivativeFault

SCATTER_REDUCE = "torch.scatter_reduce"
"""The name under which probes record that ``f`` calls ``scatter_reduce``."""

_CALLS = frozenset({torch.scatter_reduce, Tensor.scatter_reduce})
_EXTREMES = {"amax": -float("inf"), "amin": float("inf")}
_NAMES = ("input", "dim", "index", "src", "reduce")
SCATTER_REDUCE_NODE = "ScatterReduceBackward0"


def calls_scatter_reduce(func: Any) -> bool:
    """Whether ``func`` is the out-of-place ``scatter_reduce``.

    Example:
        >>> calls_scatter_reduce(torch.scatter_reduce), calls_scatter_reduce(torch.scatter)
        (True, False)
    """
    try:
        return func in _CALLS
    except TypeError:  # unhashable callables
        return False


class ScatterReduceWithoutSelf(TorchFunctionMode):
    """Max/min ``scatter_reduce`` without ``self`` as a ``where`` (see the NOTE).

    Example:
        >>> index, src = torch.tensor([0, 1, 1]), torch.tensor([0.0, 1.0, -2.0], requires_grad=True)
        >>> with ScatterReduceWithoutSelf():
        ...     out = torch.zeros(3).scatter_reduce(0, index, src, "amax", include_self=False)
        >>> out.detach()
        tensor([0., 1., 0.])
        >>> torch.autograd.grad(out[0], src)[0]  # src[0] ties the excluded 0: all of it
        tensor([1., 0., 0.])
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if not calls_scatter_reduce(func) or kwargs.get("include_self", True) is not False \
                or len(args) > len(_NAMES):
            return func(*args, **kwargs)
        values: list[Any] = [args[i] if i < len(args) else kwargs.get(name)
                             for i, name in enumerate(_NAMES)]
        base, dim, index, src, reduce = values
        if reduce not in _EXTREMES or not isinstance(base, Tensor) \
                or set(kwargs) - {*_NAMES[len(args):], "include_self"}:
            return func(*args, **kwargs)
        with torch.no_grad():
            received = torch.zeros_like(base, dtype=torch.bool).scatter(dim, index, True)
        reduced = torch.scatter_reduce(torch.full_like(base, _EXTREMES[reduce]), dim, index,
                                       src, reduce, include_self=True)
        return torch.where(received, reduced, base)


class WrongTieBackward(DerivativeFault):
    """A ``scatter_reduce`` node of an eager graph at a tie with the excluded ``self``."""

    expected = ("a graph without a max/min scatter_reduce(include_self=False) whose result "
                "equals the excluded value (torch 2.13's backward halves the gradient there: NOTE "
                "[scatter_reduce's ties with the excluded self])")
    got = "such a tie in {call}"
    fix = ("Compute the outputs in a function f and use tg.gramian (its evaluations rewrite "
           "the call), or start the buffer at -inf (+inf for amin) with include_self=True.")


def check_scatter_reduce_node(node: Any, name: str) -> None:
    """Refuse ``node`` (named ``name``) at a tie that torch's backward gets wrong.

    That is: a max/min ``scatter_reduce`` without ``self`` whose result equals the excluded
    value somewhere (see the NOTE); other nodes pass.

    Example:
        >>> src = torch.tensor([0.0, 1.0], requires_grad=True)
        >>> out = torch.zeros(2).scatter_reduce(0, torch.tensor([0, 1]), src, "amax",
        ...                                     include_self=False)
        >>> check_scatter_reduce_node(out.grad_fn, out.grad_fn.name())
        Traceback (most recent call last):
        ...
        torchgram._core.scatter_reduce.WrongTieBackward: torch.scatter_reduce
    """
    if name != SCATTER_REDUCE_NODE or getattr(node, "_saved_include_self", True) \
            or getattr(node, "_saved_reduce", None) not in _EXTREMES:
        return
    dim, index = node._saved_dim, node._saved_index
    received = torch.zeros_like(node._saved_result, dtype=torch.bool).scatter(dim, index, True)
    if bool((received & (node._saved_result == node._saved_self)).any()):
        raise WrongTieBackward(SCATTER_REDUCE)
