"""Weights that refuse a derivative through the Gramian instead of passing for constants.

NOTE [weights are not differentiable]
The weightings solve quadratic programs, eigenproblems and sequential projections whose steps
are decided on the host; their weights depend on ``G``, but no derivative of them is computed.
Until session 55 they returned weights made from ``G.detach()``, so a derivative through them
saw constants without a word: a backward (eager, or ``torch.func.grad``/``vjp``/``jacrev``)
and a forward-mode pass (``torch.func.jvp``) alike. ``torch.func.grad`` of a function of
``tg.aggregated_grad(f, upgrad)``'s update missed the weights' dependence on the parameters
(1.07 off against finite differences of at most 0.72), while with ``mean`` it matched them to
1e-10. Now, where ``G`` carries a derivative (it requires grad, or has a forward-mode tangent),
each weighting's weights come out connected to ``G`` through a node whose backward and
forward-mode derivative raise a torchgram error (:func:`refuse_derivative` of
``_core/unseen.py``). A backward that reaches the weights raises; one that does not (the
weights used under ``no_grad``, or other outputs differentiated) runs as before. Forward mode
computes every tangent as the calls run, so there the call itself raises, whether or not the
weights reach the output (a weighting inside a ``jvp``'s aux included). The weights (and
``tg.aggregated_grad``'s ``info.weights``, with parameters that require grad) then require
grad: ``.detach()`` them to log them. To hold the weights constant, as Jacobian descent does,
pass ``G.detach()``. ``mean`` and ``sum``, whose
weights do not depend on ``G``'s values (a zero derivative, which is right), are not wrapped.
Under ``torch.func.vmap`` no weighting can run (host synchronisations): ``check_gramian``
refuses a batched ``G`` with a torchgram error (it was torch's "Cannot access data pointer of
Tensor that doesn't have storage").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Concatenate, ParamSpec

from torch import Tensor

from torchgram._core.unseen import refuse_derivative

_Options = ParamSpec("_Options")
Weighting = Callable[Concatenate[Tensor, _Options], Tensor]


def refusal(name: str) -> str:
    """The message of a derivative that reached the weights of ``name`` through ``G``."""
    return (
        f"torchgram.weighting.{name}: its weights are not differentiable with respect to the "
        "Gramian, and a derivative reached them through G (a backward, torch.func.grad, vjp, "
        "jacrev or jvp). To use the weights as constants, as Jacobian descent does, pass "
        f"G.detach() (in torchgram.aggregated_grad or torchgram.autograd.backward: weighting="
        f"lambda G: torchgram.weighting.{name}(G.detach())); the weights of "
        "torchgram.weighting.mean and sum do not depend on G."
    )


def refusing_derivatives(name: str) -> Callable[[Weighting[_Options]], Weighting[_Options]]:
    """Wraps the weighting ``name`` so that a derivative through its weights raises.

    See NOTE [weights are not differentiable] at the top of this module.

    Example:
        >>> import torch
        >>> @refusing_derivatives("double")
        ... def double(G: Tensor, /) -> Tensor:
        ...     return 2 * G.detach().diagonal()
        >>> G = torch.eye(2, requires_grad=True)
        >>> double(G.detach()).requires_grad  # held constant: as before
        False
        >>> try:
        ...     double(G).sum().backward()
        ... except NotImplementedError as error:
        ...     print(str(error)[:80])
        torchgram.weighting.double: its weights are not differentiable with respect to t
    """
    message = refusal(name)

    def decorate(weighting: Weighting[_Options]) -> Weighting[_Options]:
        @functools.wraps(weighting)
        def refusing(G: Tensor, /, *args: _Options.args, **kwargs: _Options.kwargs) -> Tensor:
            weights = weighting(G, *args, **kwargs)  # G was checked to be a tensor
            return refuse_derivative(weights, message, [G], forward_mode=True)

        return refusing

    return decorate
