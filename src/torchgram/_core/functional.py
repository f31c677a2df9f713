"""Typed shorthands for the ``torch.func`` calls used across backends.

``torch.func.vjp`` returns a pair or a triple depending on ``has_aux``, which a type checker
cannot tell apart; these wrappers say which.

# NOTE [backward under no_grad]
``torch.func``'s vjp ignores an outer ``torch.no_grad()``, but some backward kernels read the
global grad mode themselves: torch 2.13's fused ``torch.lstm`` backward then finds no
workspace ("Expected a proper Tensor but got None ... for argument #22 'workspace'"), and
a call of ``tg.gramian`` under ``no_grad`` failed. Backward passes therefore run through
:func:`with_grad`: grad mode on, and under an outer ``no_grad`` their results detached, so
that nothing records a graph the caller turned off.

# NOTE [inference mode]
Inside ``torch.inference_mode()`` autograd records nothing, and ``enable_grad`` does not
turn it back on: before session 40, ``tg.gramian`` called there gave a zero matrix without
a word on ``auto``, ``structured`` and ``graph`` when its signature had a cached probe, and
torch's raw "Inference tensors do not track version counter" on every backend otherwise;
``tg.autograd.gramian`` and ``backward`` raised raw errors. Every public entry point runs
its call under ``torch.inference_mode(False)`` (:func:`public_call`): a Gramian
is computed wherever it is asked for, as ``torch.func`` transforms are; tensors the caller
made inside the mode are cloned before use (``problem.without_inference_tensors``), the
results are ordinary tensors that carry no graph (the call runs under ``no_grad``, as the
mode's own ops would: with parameters that required grad, ``G`` came back with a
``grad_fn``, paying for the create-graph path; session 63's hunt), and eager outputs computed
inside the mode do not require grad, which the eager APIs report as such.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import optree
import torch
from torch import Tensor

from torchgram._core.caller_context import (
    outside_caller_context,
    plain_caller_context,
    without_autocast,
)
from torchgram._core.vmap_declines import vmap_failures_declined, vmap_failures_declined_now

Result = TypeVar("Result")
Fn = TypeVar("Fn", bound=Callable[..., Any])

VjpFn = Callable[..., tuple[Tensor, ...]]
"""A vector-Jacobian product: cotangent(s) → one gradient per primal."""


def vjp(fn: Callable[..., Tensor], *primals: Tensor) -> tuple[Tensor, VjpFn]:
    """``torch.func.vjp(fn, *primals)``: the output and its vjp."""
    return cast(tuple[Tensor, VjpFn], torch.func.vjp(fn, *primals))


def vjp_with_aux(fn: Callable[..., tuple[Tensor, Any]],
                 *primals: Tensor) -> tuple[Tensor, VjpFn, Any]:
    """``torch.func.vjp(fn, *primals, has_aux=True)``: the output, its vjp and the aux."""
    return cast(tuple[Tensor, VjpFn, Any], torch.func.vjp(fn, *primals, has_aux=True))


def with_grad(fn: Callable[[], Result]) -> Result:
    """``fn()`` with grad mode on (NOTE [backward under no_grad]).

    Example:
        >>> with torch.no_grad():
        ...     grad = with_grad(lambda: torch.func.grad(torch.sin)(torch.zeros(())))
        >>> grad, grad.requires_grad
        (tensor(1.), False)
    """
    if torch.is_grad_enabled():
        return fn()
    with torch.enable_grad():
        result = fn()
    tree: Any = result
    return cast(Result, optree.tree_map(
        lambda leaf: leaf.detach() if isinstance(leaf, Tensor) else leaf, tree))


def public_call(fn: Fn) -> Fn:
    """``fn`` as a public entry point: outside inference mode and the caller's function modes.

    Under ``torch.inference_mode(False)`` and ``no_grad`` when called inside the mode (NOTE
    [inference mode]); without the caller's function modes, ``f``'s evaluations excepted (NOTE [the
    caller's function modes]).

    Example:
        >>> @public_call
        ... def tracked():  # (under no_grad: a backend enables grad for its own passes)
        ...     x = torch.ones(2, requires_grad=True)
        ...     with torch.enable_grad():
        ...         return (x * x).grad_fn is not None
        >>> with torch.inference_mode():
        ...     tracked()
        True
    """
    @functools.wraps(fn)
    def outside(*args: Any, **kwargs: Any) -> Any:
        if vmap_failures_declined_now():  # a call inside f that an auto run evaluates decides
            with vmap_failures_declined(False):  # for itself (NOTE [vmap failures remembered])
                return outside(*args, **kwargs)
        if plain_caller_context() and not torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)  # the common case: nothing to lift (~0.2 µs)
        with outside_caller_context():
            if not torch.is_inference_mode_enabled():
                return fn(*args, **kwargs)
            with torch.inference_mode(False), torch.no_grad():  # (as in the mode: no graph)
                return fn(*args, **kwargs)

    return cast(Fn, outside)


def public_math(fn: Fn) -> Fn:
    """``fn`` as a public function that evaluates no ``f``: :func:`public_call`, autocast off.

    The weightings and the NTK predictions: no caller's function mode sees their products,
    and they compute in full precision inside a caller's autocast region (NOTE [autocast]).

    Example:
        >>> from torch.overrides import TorchFunctionMode
        >>> class Refusing(TorchFunctionMode):
        ...     def __torch_function__(self, func, types, args=(), kwargs=None):
        ...         raise AssertionError("a caller's mode saw an op")
        >>> square = public_math(lambda a: (a @ a).dtype)
        >>> x = torch.ones(2, 2)
        >>> with torch.autocast("cpu", dtype=torch.bfloat16), Refusing():
        ...     square(x)
        torch.float32
    """
    return public_call(without_autocast(fn))


def stack_grads(grads: Sequence[Tensor | None]) -> Tensor | None:
    """``[c, *g]`` from one gradient per cotangent (``None``: zeros); ``None`` if all are.

    Example:
        >>> stack_grads([None, torch.ones(2)])
        tensor([[0., 0.],
                [1., 1.]])
        >>> stack_grads([None, None]) is None
        True
    """
    present = next((grad for grad in grads if grad is not None), None)
    if present is None:
        return None
    if len(grads) == 1:
        return present.unsqueeze(0)
    return torch.stack([torch.zeros_like(present) if grad is None else grad for grad in grads])
