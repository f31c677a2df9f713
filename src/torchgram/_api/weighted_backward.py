"""``torchgram.autograd.backward``: Jacobian descent on eager code, in one call."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from torchgram._api.autograd import prepare
from torchgram._api.pipeline import outside_compile
from torchgram._api.step_times import StepTimes, Stopwatch
from torchgram._api.weights import call_weighting, check_weighting
from torchgram._core import checks
from torchgram._core.functional import public_call
from torchgram._core.result import RunReport
from torchgram._core.scratch import scratch_scope
from torchgram.backends.eager.record import paused

_API = "torchgram.autograd.backward"


@outside_compile  # NOTE [torch.compile]: dynamo traced into the walk (raw errors)
@public_call  # NOTE [inference mode], NOTE [the caller's function modes]
def backward(
    outputs: Tensor | Iterable[Tensor],
    inputs: Tensor | Iterable[Tensor],
    weighting: Callable[[Tensor], Tensor],
    *,
    batch_dim: int | None = None,
    chunk_size: int | None = None,
    retain_graph: bool = False,
    with_info: bool = False,
) -> Tensor | tuple[Tensor, BackwardInfo]:
    """Accumulate ``Jᵀ w`` into ``inputs``' ``.grad``, with ``w = weighting(J Jᵀ)``.

    The imperative counterpart of :func:`torchgram.aggregated_grad`: the Gramian of the
    existing graph (:func:`torchgram.autograd.gramian`), the weighting's ``w``, then one
    ``torch.autograd.backward(outputs, w, inputs=inputs)``. Like ``torch.autograd.backward``
    it *accumulates* into ``.grad`` (zero them first, e.g. ``optimizer.zero_grad()``), and
    only the given inputs receive gradients.

    Args:
        outputs: A tensor or a sequence of tensors (e.g. per-sample or per-task losses).
        inputs: The tensors whose ``.grad`` is set, e.g. ``list(model.parameters())``.
        weighting: A function ``G [m, m] -> w [m]``, e.g. :func:`torchgram.weighting.upgrad`.
        batch_dim: The outputs' dimension that indexes independent samples, as for
            :func:`torchgram.autograd.gramian`. With a recorded forward
            (:func:`torchgram.autograd.record`) covering every input, ``Jᵀ w`` comes from
            the recorded factors instead of a second backward (NOTE [Jᵀw from the recording]).
        chunk_size: Rows per vectorized node call of the Gramian's graph walk.
        retain_graph: Keep the graph after the backward pass (as in ``torch.autograd``).
            Without it the graph may be freed before the weighting runs (under
            :func:`record`, ``Jᵀ w`` comes from the recorded factors and the Gramian's pass
            is the last one): to call again after a weighting that raised, pass ``True``.
        with_info: Also return a :class:`BackwardInfo`: the Gramian and where the step's
            time went (Gramian, weighting, ``Jᵀ w``).

    Returns:
        The weights ``w``, shaped like ``outputs`` (``[m]`` for a sequence of tensors); with
        ``with_info``, ``(w, info)``.

    Example:
        >>> import torch, torchgram as tg
        >>> w = torch.zeros(3, requires_grad=True)
        >>> losses = (torch.eye(3) @ w - 1.0) ** 2
        >>> tg.autograd.backward(losses, [w], tg.weighting.mean)
        tensor([0.3333, 0.3333, 0.3333])
        >>> w.grad
        tensor([-0.6667, -0.6667, -0.6667])
        >>> losses = (torch.eye(3) @ w - 1.0) ** 2
        >>> _, info = tg.autograd.backward(losses, [w], tg.weighting.upgrad, with_info=True)
        >>> info.gramian.shape, info.times.total > 0
        (torch.Size([3, 3]), True)
    """
    with paused(), scratch_scope():  # inside a record() block, these calls are not the
        # user's; NOTE [scratch memory]
        return _backward(outputs, inputs, weighting, batch_dim, chunk_size, retain_graph,
                         with_info)


def _backward(outputs: Any, inputs: Any, weighting: Callable[[Tensor], Tensor],
              batch_dim: int | None, chunk_size: int | None, retain_graph: bool,
              with_info: bool) -> Tensor | tuple[Tensor, BackwardInfo]:
    check_weighting(_API, weighting)
    checks.check_bool(_API, "with_info", with_info)
    call = prepare(_API, outputs, inputs, batch_dim=batch_dim, chunk_size=chunk_size,
                   retain_graph=retain_graph, diagonal=False, per_input=False,
                   distinct_inputs=True)
    output_list, input_list = call.outputs, call.inputs
    watch = Stopwatch(output_list[0].device)
    outcome = call.run(want_pullback=True)
    matrix = outcome.value
    assert isinstance(matrix, Tensor)  # per_input=False: one block
    num_rows = call.num_rows
    gramian_time = watch.lap()
    weights = call_weighting(_API, weighting, matrix.reshape(num_rows, num_rows))
    weighting_time = watch.lap()
    pullback = outcome.result.pullback
    if pullback is not None and outcome.result.engine and all(t.is_leaf for t in input_list):
        _accumulate(input_list, pullback(weights))  # NOTE [Jᵀw from the recording]
    else:
        pieces = weights.split([out.numel() for out in output_list])
        cotangents = [piece.reshape(out.shape).to(out.dtype)
                      for piece, out in zip(pieces, output_list, strict=True)]
        torch.autograd.backward(output_list, cotangents, inputs=input_list,
                                retain_graph=retain_graph)
    times = StepTimes(gramian_time, weighting_time, watch.lap())
    shaped = weights.reshape(output_list[0].shape) if call.as_tensor else weights
    info = BackwardInfo(matrix, times, outcome.result.report)
    return (shaped, info) if with_info else shaped


# NOTE [Jᵀw from the recording]
# With a recording whose calls cover every input (and no hook in the graph that torchgram
# can see, NOTE [eager taps]), the Gramian's pass already holds every sample's factors, so
# Jᵀw = Σ_b w_b J_b is one contraction per recorded call (the size of a weight-gradient
# product; a matrix-vector product for a leaf whose per-sample Jacobians were kept, NOTE [Jᵀw
# from kept Jacobians]) instead of a second backward through the whole graph. It is
# accumulated into .grad by autograd itself, `torch.autograd.backward` on the leaves (through
# an alias of each, NOTE [handing Jᵀw to autograd]): hooks on
# the leaves (Tensor.register_hook, register_post_accumulate_grad_hook, the gradient hooks of
# DistributedDataParallel) run as in any backward, and .grad accumulates exactly as
# torch.autograd.backward(outputs, w, inputs=inputs) would. Hooks on intermediate tensors
# added after the record() block are not run (torchgram cannot see them); with hooks it can
# see, the second backward is run as written.


def _accumulate(inputs: list[Tensor], grads: dict[int, Tensor]) -> None:
    """Accumulate ``grads[i]`` (flat) into ``inputs[i].grad`` through autograd."""
    done: set[int] = set()
    tensors, values = [], []
    for index, grad in grads.items():
        tensor = inputs[index]
        if id(tensor) in done:
            continue
        done.add(id(tensor))
        tensors.append(tensor)
        values.append(grad.reshape(tensor.shape).to(tensor.dtype))
    if tensors:
        with torch.enable_grad():  # NOTE [handing Jᵀw to autograd]
            aliases = [tensor.view_as(tensor) for tensor in tensors]
        torch.autograd.backward(aliases, values)


# NOTE [handing Jᵀw to autograd]
# `torch.autograd.backward(leaves, grads)` runs the leaves' AccumulateGrad nodes, hooks and
# all, but the grads it is handed are still referenced by the caller, so AccumulateGrad copies
# each into a fresh `.grad` (on CPU, fresh pages: ~as long as forming Jᵀw itself on the MLP).
# Through an alias (`leaf.view_as(leaf)`, a ViewBackward node) the gradient reaching
# AccumulateGrad is the view node's own output, which nothing else holds: it becomes `.grad`
# as in any backward (accumulated into an existing `.grad` as usual). Same hooks, same values.


class BackwardInfo(NamedTuple):
    """What :func:`backward` computed besides the weights (``with_info=True``).

    Attributes:
        gramian: ``G = J Jᵀ``, shaped as :func:`torchgram.autograd.gramian` returns it.
        times: Where the step's time went: the Gramian, the weighting, ``Jᵀ w``.
        report: How the Gramian was computed (per input: recorded and contracted, or
            walked; nodes called per row; notes).
    """

    gramian: Tensor
    times: StepTimes
    report: RunReport | None = None
