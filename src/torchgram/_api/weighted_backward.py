"""``torchgram.autograd.backward``: Jacobian descent on eager code, in one call."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
from torch import Tensor

from torchgram._api.autograd import gramian
from torchgram._api.step_times import StepTimes, Stopwatch
from torchgram._api.weights import call_weighting, check_weighting
from torchgram._core import checks

_API = "torchgram.autograd.backward"


def backward(
    outputs: Tensor | Iterable[Tensor],
    inputs: Tensor | Iterable[Tensor],
    weighting: Callable[[Tensor], Tensor],
    *,
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
        chunk_size: Rows per vectorized node call of the Gramian's graph walk.
        retain_graph: Keep the graph after the backward pass (as in ``torch.autograd``).
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
    check_weighting(_API, weighting)
    checks.check_bool(_API, "retain_graph", retain_graph)
    checks.check_bool(_API, "with_info", with_info)
    input_list = [inputs] if isinstance(inputs, Tensor) else list(inputs)
    output_list = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    watch = Stopwatch(output_list[0].device if output_list else torch.device("cpu"))
    matrix = gramian(outputs, input_list, chunk_size=chunk_size, retain_graph=True)
    num_rows = sum(out.numel() for out in output_list)
    assert isinstance(matrix, Tensor)  # per_input=False: one block
    gramian_time = watch.lap()
    weights = call_weighting(_API, weighting, matrix.reshape(num_rows, num_rows))
    weighting_time = watch.lap()
    pieces = weights.split([out.numel() for out in output_list])
    cotangents = [piece.reshape(out.shape).to(out.dtype)
                  for piece, out in zip(pieces, output_list, strict=True)]
    torch.autograd.backward(output_list, cotangents, inputs=input_list,
                            retain_graph=retain_graph)
    times = StepTimes(gramian_time, weighting_time, watch.lap())
    shaped = weights.reshape(output_list[0].shape) if isinstance(outputs, Tensor) else weights
    return (shaped, BackwardInfo(matrix, times)) if with_info else shaped


class BackwardInfo(NamedTuple):
    """What :func:`backward` computed besides the weights (``with_info=True``).

    Attributes:
        gramian: ``G = J Jᵀ``, shaped as :func:`torchgram.autograd.gramian` returns it.
        times: Where the step's time went: the Gramian, the weighting, ``Jᵀ w``.
    """

    gramian: Tensor
    times: StepTimes
