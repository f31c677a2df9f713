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
# How it is seen: during the probe of a call whose ``G`` will be differentiated, a
# torch-function mode counts the calls in flight (every torch function, Tensor method and
# operator that Python code calls), and a torch-dispatch mode sees every aten op; an op
# dispatched while no call is in flight came from code the modes cannot see (TorchScript, or
# a C++ extension's function called directly). functorch's own unwrapping of the transforms'
# tensors dispatches ``detach``, which is not counted. Under ``grad`` or ``jvp`` the call is
# refused at once; with create-graph (inputs that require grad, also where the user never
# differentiates ``G``) its value is right and returned, and its backward raises the refusal
# (:func:`refuse_derivative`). The finding is kept with the probe of the call signature
# (NOTE [probing]); a probe cached by a call that did not look is made again, once. Like the
# probe's other findings, an ``f`` that starts calling TorchScript later under a cached probe
# is not seen (NOTE [stale probes] checks the calls the modes see).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_BOOKKEEPING = frozenset({"aten.detach.default", "aten.alias.default"})
"""Ops that transforms dispatch themselves around a call (NOTE [unseen calls])."""


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

    def __init__(self, in_flight: _InFlight, ops: list[str]) -> None:
        super().__init__()
        self._in_flight = in_flight
        self._ops = ops

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        name = str(func)
        if self._in_flight.depth == 0 and name not in _BOOKKEEPING and name not in self._ops:
            self._ops.append(name)
        return func(*args, **(kwargs or {}))


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
    """The identity, whose backward raises the refusal it was given."""

    generate_vmap_rule = True

    @staticmethod
    def forward(value: Tensor, refusal: str) -> Tensor:
        return value.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.refusal = inputs[1]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise NotImplementedError(ctx.refusal)


def refuse_derivative(value: Tensor, refusal: BaseException) -> Tensor:
    """``value`` (a copy, where it carries a graph), whose backward raises ``refusal``.

    A Gramian with a graph (create-graph) from an ``f`` whose unseen calls make its
    derivative wrong (NOTE [unseen calls]): its value is right and returned; differentiating
    it raises ``refusal``'s message instead of giving a wrong number.

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> G = refuse_derivative(x * 2, NotImplementedError("torchgram.gramian: no"))
        >>> G
        tensor([2., 2.], grad_fn=<_RefusedDerivativeBackward>)
        >>> try:
        ...     G.sum().backward()
        ... except NotImplementedError as error:
        ...     print(error)
        torchgram.gramian: no
    """
    if not value.requires_grad:
        return value
    return _RefusedDerivative.apply(value, str(refusal))
