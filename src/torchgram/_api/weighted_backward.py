"""``torchgram.autograd.backward``: Jacobian descent on eager code, in one call."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from torchgram._api.autograd import gramian
from torchgram._core import checks

_API = "torchgram.autograd.backward"


def backward(
    outputs: Tensor | Iterable[Tensor],
    inputs: Tensor | Iterable[Tensor],
    weighting: Callable[[Tensor], Tensor],
    *,
    chunk_size: int | None = None,
    retain_graph: bool = False,
) -> Tensor:
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

    Returns:
        The weights ``w``, shaped like ``outputs`` (``[m]`` for a sequence of tensors).

    Example:
        >>> import torch, torchgram as tg
        >>> w = torch.zeros(3, requires_grad=True)
        >>> losses = (torch.eye(3) @ w - 1.0) ** 2
        >>> tg.autograd.backward(losses, [w], tg.weighting.mean)
        tensor([0.3333, 0.3333, 0.3333])
        >>> w.grad
        tensor([-0.6667, -0.6667, -0.6667])
    """
    if not callable(weighting):
        checks.fail(_API, "a weighting callable G -> w (e.g. torchgram.weighting.upgrad)",
                    type(weighting).__name__, "Pass the function itself, not its result.",
                    TypeError)
    checks.check_bool(_API, "retain_graph", retain_graph)
    input_list = [inputs] if isinstance(inputs, Tensor) else list(inputs)
    matrix = gramian(outputs, input_list, chunk_size=chunk_size, retain_graph=True)
    output_list = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    num_rows = sum(out.numel() for out in output_list)
    assert isinstance(matrix, Tensor)  # per_input=False: one block
    weights = weighting(matrix.reshape(num_rows, num_rows))
    if not isinstance(weights, Tensor) or weights.shape != (num_rows,):
        got = (f"shape {tuple(weights.shape)}" if isinstance(weights, Tensor)
               else type(weights).__name__)
        checks.fail(_API, f"the weighting to return a tensor of shape ({num_rows},)", got,
                    "A weighting maps the [m, m] Gramian to [m] weights.", TypeError)
    pieces = weights.split([out.numel() for out in output_list])
    cotangents = [piece.reshape(out.shape).to(out.dtype)
                  for piece, out in zip(pieces, output_list, strict=True)]
    torch.autograd.backward(output_list, cotangents, inputs=input_list,
                            retain_graph=retain_graph)
    return weights.reshape(output_list[0].shape) if isinstance(outputs, Tensor) else weights
