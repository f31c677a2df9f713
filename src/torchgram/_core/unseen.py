"""Ops ``f`` runs through code that no torch-function mode sees (NOTE [unseen calls]).

# NOTE [unseen calls]
# A TorchScript function (``torch.jit.script``) runs its ops in TorchScript's interpreter,
# past every torch-function mode (the structured backend's NOTE [unseen uses]). torch 2.13
# computes no second-order derivative through such a function under torch.func transforms:
# ``grad`` of ``grad``, or ``jvp`` of ``grad``, gives zero for its terms, while first-order
# ``grad``, ``vmap`` and an eager double backward are right (measured on ``h @ w.t()`` in a
# scripted helper fed by an embedding). A Gramian differentiated through -- inside
# ``torch.func.grad`` or ``jvp``, or with inputs that require grad, where the backends build
# ``G`` with torch.func's vjp and vmap -- needs exactly those derivatives: the compose hunt
# of session 38 found ``G``'s gradient 0.3 to 800 off (relative) on jacobian, graph and auto,
# and the oracle (``jacrev`` under ``grad``) itself wrong once the scripted function had
# warmed up. No backend can compute it, so such a call is refused before any work.
#
# How it is seen: during the probe of a call whose ``G`` may be differentiated, a
# torch-function mode counts the calls in flight (every torch function, Tensor method and
# operator that Python code calls), and a torch-dispatch mode sees every aten op; an op
# dispatched while no call is in flight came from code the modes cannot see (TorchScript, or
# a C++ extension's function called directly). Not counted: views and in-place views
# (functorch's own unwrapping dispatches ``detach``, a ``vmap`` inside ``f`` moves its batch
# dims with ``permute`` and ``expand``, ``torch.from_numpy`` and the legacy constructors
# ``torch.Tensor([...])`` dispatch ``lift_fresh``, unpickling ``set_``) and ops without a
# tensor argument (``torch.FloatTensor(3)``): none of them computes anything whose second
# derivative could be lost (a scripted function made of views only would be missed).
#
# Under ``grad`` or ``jvp`` the call is refused at once. With create-graph (inputs that
# require grad, also where the user never differentiates ``G``) the value is right and
# returned, and its backward raises the refusal (:func:`refuse_derivative`), connected to
# every tensor of the call that requires grad: once TorchScript has run a scripted
# function a few times with inputs that require grad, its optimised plan gives the backends'
# ``G`` no graph at all, and ``G``'s term would silently drop out of the user's backward
# (the review of session 38). The same holds for ``aggregated_grad``'s update ``Jᵀw``, whose
# derivative also needs ``f``'s second derivatives (jacobian's kept Jacobian gave it no graph
# once warmed): its derivative is refused the same way. The finding is kept with the probe
# of the call signature (NOTE [probing]); a probe cached by a call that did not look is made
# again, once. Like the probe's other findings, an ``f`` that starts calling TorchScript
# later under a cached probe, or only with grad mode on (the probe runs without), is not
# seen.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch._ops import HigherOrderOperator
from torch.autograd import forward_ad
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


def _computes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an aten op computes from tensors: not a view, not a factory (NOTE above)."""
    if func.is_view or torch.Tag.inplace_view in func.tags:
        return False
    return any(isinstance(value, Tensor) for value in (*args, *kwargs.values()))


class _InFlight(TorchFunctionMode):
    """Counts the torch calls in flight (NOTE [unseen calls])."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        self.depth += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.depth -= 1


class _Dispatched(TorchDispatchMode):
    """Notes the aten ops dispatched while no torch call is in flight."""

    supports_higher_order_operators = True  # torch.cond, flex_attention: passed through

    def __init__(self, in_flight: _InFlight, ops: list[str]) -> None:
        super().__init__()
        self._in_flight = in_flight
        self._ops = ops

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):  # torch has popped this mode for it
            return func(*args, **kwargs)
        if self._in_flight.depth == 0 and _computes(func, args, kwargs):
            name = str(func)
            if name not in self._ops:
                self._ops.append(name)
        return func(*args, **kwargs)


class UnseenCalls:
    """A context that notes the ops ``f`` runs outside any visible torch call.

    Attributes:
        ops: The aten ops seen, first occurrence first (empty when every op ran inside a
            torch call that Python code made).

    Example:
        >>> import torch, warnings
        >>> x = torch.ones(3)
        >>> with warnings.catch_warnings():  # torch >= 2.11 deprecates torch.jit
        ...     warnings.simplefilter("ignore", DeprecationWarning)
        ...     scripted = torch.jit.trace(lambda x: x * 2, x)  # runs in TorchScript
        >>> with UnseenCalls() as unseen:
        ...     _ = (x + 1).sum()
        >>> unseen.ops
        []
        >>> with UnseenCalls() as unseen:
        ...     _ = scripted(x)
        >>> unseen.ops
        ['aten.mul.Scalar']
    """

    def __init__(self) -> None:
        self.ops: list[str] = []
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> UnseenCalls:
        in_flight = _InFlight()
        self._stack.enter_context(in_flight)
        self._stack.enter_context(_Dispatched(in_flight, self.ops))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()


class _RefusedDerivative(torch.autograd.Function):
    """The identity on its first input, whose backward raises the refusal it was given."""

    generate_vmap_rule = True

    @staticmethod
    def forward(value: Tensor, refusal: str, *connected: Tensor) -> Tensor:
        return value.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.refusal = inputs[1]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise NotImplementedError(ctx.refusal)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:  # forward mode (torch.func.jvp, forward_ad)
        raise NotImplementedError(ctx.refusal)


def refuse_derivative(value: Tensor, refusal: str, connected: Sequence[Tensor], *,
                      forward_mode: bool = False) -> Tensor:
    """``value`` (a copy), whose backward raises ``refusal`` (NOTE [unseen calls]).

    The result depends on ``value`` and on every tensor of ``connected`` that requires grad
    (the call's parameters and inputs): a backward that reaches any of them raises, also
    where ``value`` itself came without a graph. ``value`` is returned as it is when nothing
    requires grad. With ``forward_mode``, tensors of ``connected`` with a forward-mode tangent
    (``torch.func.jvp``, ``torch.autograd.forward_ad``) count too, and a forward-mode pass
    through the result raises as well (NOTE [weights are not differentiable]).

    Example:
        >>> w = torch.ones(2, requires_grad=True)
        >>> G = refuse_derivative(torch.ones(2, 2), "torchgram.gramian: no", [w])
        >>> G
        tensor([[1., 1.],
                [1., 1.]], grad_fn=<_RefusedDerivativeBackward>)
        >>> try:
        ...     (G.sum() + w.sum()).backward()
        ... except NotImplementedError as error:
        ...     print(error)
        torchgram.gramian: no
    """
    tensors = [t for t in connected if isinstance(t, Tensor) and (
        t.requires_grad or forward_mode and forward_ad.unpack_dual(t).tangent is not None)]
    if not value.requires_grad and not tensors:
        return value
    return _RefusedDerivative.apply(value, refusal, *tensors)
