"""``torchgram.aggregated_grad``: weights from the Gramian, then ``Jᵀ w``, in one call."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from torchgram._api.pipeline import (
    Computation,
    compute_then,
    outside_compile,
    refused_derivatives,
    wraps_user_function,
)
from torchgram._api.step_times import StepTimes, Stopwatch
from torchgram._api.weights import call_weighting, check_weighting
from torchgram._core import checks
from torchgram._core.functional import public_call
from torchgram._core.options import Options
from torchgram._core.pytree import leaves_of
from torchgram._core.scratch import scratch_scope
from torchgram._core.sink import shape_block

_API = "torchgram.aggregated_grad"


class Aggregation(NamedTuple):
    """What :func:`aggregated_grad` computed besides the update.

    Attributes:
        gramian: ``G = J Jᵀ``, shaped as ``torchgram.gramian`` returns it (per-leaf blocks
            with ``per_leaf=True``).
        weights: The weighting's ``w``, shaped like ``f``'s output (``[m]`` for a pytree).
        output: ``f``'s output (detached).
        aux: ``f``'s aux with ``has_aux=True``, else ``None``.
        times: Where the step's time went: the Gramian, the weighting, ``Jᵀ w``.
    """

    gramian: Any
    weights: Tensor
    output: Any
    aux: Any
    times: StepTimes


def aggregated_grad(
    f: Callable[..., Any],
    weighting: Callable[[Tensor], Tensor],
    argnums: int | Sequence[int] = 0,
    *,
    has_aux: bool = False,
    backend: str = "auto",
    chunk_size: int | None = None,
    batch_dim: int | None = None,
    in_dims: int | None | Sequence[Any] = 0,
    per_leaf: bool = False,
    memory_budget: int | None = None,
    progress: bool = False,
) -> Callable[..., tuple[Any, Aggregation]]:
    """The update ``Jᵀ w`` with ``w = weighting(J Jᵀ)``: Jacobian descent in one call.

    The Gramian is computed as by :func:`torchgram.gramian` (same options, except
    ``diagonal``, which a weighting cannot use), the weighting maps it to one weight per
    output entry, and the update is the weighted sum of the rows' gradients. When the backend
    kept what makes it cheap (the ``jacobian`` backend with its Jacobian in one block), the
    update is one matrix-vector product with no further pass; otherwise it costs one more
    forward and backward (a ``vjp`` with cotangent ``w``). Like ``gramian``, it composes with
    ``torch.func`` transforms and eager autograd (NOTE [composition]): the update is
    differentiable through ``G`` and ``w`` when the weighting is.

    Args:
        f: ``f(*args, **kwargs)`` returning the losses (any floating tensor or pytree).
        weighting: A function ``G [m, m] -> w [m]``, e.g. :func:`torchgram.weighting.upgrad`.
        argnums: The differentiated positional argument(s), as for ``gramian``.
        has_aux: ``f`` returns ``(output, aux)``; aux is reported in the info.
        backend: As for ``gramian``.
        chunk_size: As for ``gramian``.
        batch_dim: As for ``gramian``.
        in_dims: As for ``gramian``.
        per_leaf: Report per-leaf Gramian blocks in the info (the weighting sees their sum).
        memory_budget: As for ``gramian``.
        progress: As for ``gramian``.

    Returns:
        A function of ``f``'s arguments returning ``(update, info)``: ``update`` has the
        structure of the differentiated argument (a tuple of them for a tuple ``argnums``),
        ``None`` at constant leaves, and ``info`` is an :class:`Aggregation`.

    Example:
        >>> import torch, torchgram as tg
        >>> def losses(w, x):
        ...     return (x @ w - 1.0) ** 2
        >>> w, x = torch.zeros(3), torch.eye(3)
        >>> update, info = tg.aggregated_grad(losses, lambda G: torch.ones(3) / 3)(w, x)
        >>> update
        tensor([-0.6667, -0.6667, -0.6667])
        >>> info.gramian.shape, info.weights.shape
        (torch.Size([3, 3]), torch.Size([3]))
    """
    options = Options.validate(
        _API, f, argnums, has_aux=has_aux, backend=backend, chunk_size=chunk_size,
        batch_dim=batch_dim, in_dims=in_dims, diagonal=False, per_leaf=per_leaf,
        memory_budget=memory_budget, progress=progress,
    )
    check_weighting(_API, weighting)

    @wraps_user_function(f)
    @outside_compile
    @public_call  # NOTE [inference mode], NOTE [the caller's function modes]
    def aggregated_grad_of_f(*args: Any, **kwargs: Any) -> tuple[Any, Aggregation]:
        watch = Stopwatch(_device(args))

        def step(computation: Computation) -> _Step:  # NOTE [evaluations after the backend]
            blocks = computation.blocks
            matrix = blocks[0] if len(blocks) == 1 else torch.stack(blocks).sum(0)
            gramian_time = watch.lap()
            weights = call_weighting(_API, weighting, matrix)
            weighting_time = watch.lap()
            grads = computation.pullback(weights)  # fresh tensors: nothing of the scope
            times = StepTimes(gramian_time, weighting_time, watch.lap())
            return _Step(computation, weights, grads, computation.output(), times)

        with scratch_scope():  # NOTE [scratch memory]: the Jacobians kept for Jᵀw
            computation, weights, grads, output, times = compute_then(
                options, f, args, kwargs, step, want_pullback=True)
        problem = computation.problem
        if problem.unseen_ops:  # NOTE [unseen calls]: Jᵀw's derivative needs f's second ones
            grads = tuple(refused_derivatives(problem, list(grads)))
        update = problem.diff.unflatten_like_args(list(grads),
                                                  as_tuple=not options.single_argnum)
        shaped_weights = shape_block(problem, weights, diagonal=True)
        return update, Aggregation(computation.value(), shaped_weights, output,
                                   computation.aux, times)

    aggregated_grad_of_f.__doc__ = (
        f"Jᵀ w with w = {checks.function_name(weighting)}(J Jᵀ), J the Jacobian of "
        f"{checks.function_name(f)} w.r.t. argument(s) {argnums!r}. Built by "
        f"torchgram.aggregated_grad."
    )
    return aggregated_grad_of_f


class _Step(NamedTuple):
    """What one step computed: the computation, its weights, ``Jᵀw``, the output, the times."""

    computation: Computation
    weights: Tensor
    grads: tuple[Tensor, ...]
    output: Any
    times: StepTimes


def _device(args: tuple[Any, ...]) -> torch.device:
    """The device of the first tensor among the arguments (where the step's work is queued)."""
    for leaf in leaves_of(args):
        if isinstance(leaf, Tensor):
            return leaf.device
    return torch.device("cpu")
