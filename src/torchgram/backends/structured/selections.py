"""Selections opened for the derivative checks and the probes: paths through closed branches.

NOTE [opened selections]
The batched way's thorough derivative check (NOTE [derivative check] in ``cross.py``, NOTE
[checking the batched pass] in ``per_sample.py``) runs a backward of the batch's rows in a
few directions and asks whether any reaches another sample's taps; the eager probes (NOTE
[sample layouts]) ask the same of a recorded graph. Their verdict is kept for the trace or
the signature (later calls skip them), so they must see every path along which a later
call's cotangents can move between samples, not only those this call's values leave open.
Two kinds of value hide a path:

* a zero factor (``h + w · mix(h)`` with ``w = 0`` on the first step): the directions carry
  NaN (:func:`check_weights`; the eager probes' rows, NOTE [NaN probes]), which goes through
  a product with zero and never cancels;
* a selection: ``where(mask, h - h.mean(0), h)`` with an all-False mask, a ReLU closed on a
  coupled input (``relu(h - h.mean(0) - t)``), a saturated ``clamp``. Their backward
  formulas *select* (``where(mask, grad, 0)``), which drops NaN too. Before session 29 a
  per-sample mask that hid a coupling on a signature's first call and opened it later gave
  wrong matrices without a word: 0.06 to 0.46 off (largest error over largest entry) on
  structured and auto, and with ``record()``; the eager walk on a gated ``h.roll(2, 0)``.

So during those passes every selection node of the graph (:data:`SELECTION_NODES`:
``where``, ``masked_fill``, ReLU, ``threshold``, ``clamp``, ``hardtanh``/``relu6``,
``hardsigmoid``/``hardswish``, ``hard``/``softshrink``, elementwise ``maximum``/``minimum``,
in place or not) is opened: a temporary post-hook (:func:`opened_nodes`, for an autograd
pass; :class:`OpenedCaller` for the walk's node calls) adds to each gradient it gives its
inputs the NaN entries of the cotangent at its output (summed to the input's shape), exact
zeros elsewhere. The real rows of a pass that carries both (the kernels' check shares the
backward) are unchanged: they are finite, and an infinite cotangent is not turned into NaN.
The hooks are removed when the pass ends, so the graph (the user's, with ``record()``) is
left as it was. Cost: two elementwise ops per selection node in the checking pass only.

Left to other checks: selections that route rather than select (an index, ``masked_select``,
sorting) are in the routing digest (NOTE [routing values]); ``max``/``min`` over a dim and
pooling select one entry by value.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from torchgram.backends.graph.nodes import NodeCaller

SELECTION_NODES: frozenset[str] = frozenset({
    "WhereBackward0", "MaskedFillBackward0", "MaskedFillBackward1", "ReluBackward0",
    "ThresholdBackward0", "ClampBackward0", "ClampBackward1", "ClampMinBackward0",
    "ClampMaxBackward0", "HardtanhBackward0", "HardsigmoidBackward0", "HardswishBackward0",
    "HardshrinkBackward0", "SoftshrinkBackward0", "MaximumBackward0", "MinimumBackward0",
    "FmaxBackward0", "FminBackward0",
})
"""The autograd nodes whose backward selects by value (NOTE [opened selections])."""


def open_grads(grad_inputs: Sequence[Tensor | None], grad_output: Tensor | None
               ) -> tuple[Tensor | None, ...]:
    """``grad_inputs`` plus ``grad_output``'s NaN entries (summed to each one's shape).

    Example:
        >>> open_grads([torch.zeros(2), None], torch.tensor([math.nan, 1.0]))
        (tensor([nan, 0.]), None)
    """
    if grad_output is None:
        return tuple(grad_inputs)
    nan = grad_output.isnan()
    nan_only: Tensor | None = None
    opened: list[Tensor | None] = []
    for grad in grad_inputs:
        if grad is None:
            opened.append(None)
        elif grad.shape == grad_output.shape:  # one select: NaN there, the gradient elsewhere
            opened.append(torch.where(nan, grad_output.to(grad.dtype), grad))
        else:  # a broadcast input: the NaN entries summed to its shape
            if nan_only is None:
                nan_only = torch.where(nan, grad_output, torch.zeros(
                    (), dtype=grad_output.dtype, device=grad_output.device))
            opened.append(grad + nan_only.sum_to_size(grad.shape).to(grad.dtype))
    return tuple(opened)


def _hook(grad_inputs: tuple[Tensor | None, ...], grad_outputs: tuple[Tensor | None, ...]
          ) -> tuple[Tensor | None, ...]:
    return open_grads(grad_inputs, grad_outputs[0])


@contextlib.contextmanager
def opened_nodes(nodes: Iterable[Any]) -> Iterator[int]:
    """Open the selection nodes among ``nodes`` for the autograd passes inside the block.

    Yields how many it opened. The hooks are removed when the block ends.

    Example:
        >>> h = torch.tensor([1.0, -1.0], requires_grad=True)
        >>> y = torch.relu(h * 1.0)
        >>> with opened_nodes([y.grad_fn]):
        ...     torch.autograd.grad(y, h, torch.tensor([1.0, math.nan]), retain_graph=True)
        (tensor([1., nan]),)
        >>> torch.autograd.grad(y, h, torch.tensor([1.0, math.nan]))  # the hook is gone
        (tensor([1., 0.]),)
    """
    handles = [node.register_hook(_hook) for node in nodes
               if type(node).__name__ in SELECTION_NODES]
    try:
        yield len(handles)
    finally:
        for handle in handles:
            handle.remove()


def opened_call(node: Any, grads: Sequence[Tensor | None],
                outs: list[Tensor | None]) -> list[Tensor | None]:
    """A node call's gradients ``outs``, opened where ``node`` is a selection.

    For the walks, which call the nodes themselves (no hook runs there): ``grads`` are the
    node's incoming cotangents, ``outs`` what the call gave each edge.
    """
    if type(node).__name__ not in SELECTION_NODES:
        return outs
    return list(open_grads(outs, grads[0]))


class OpenedCaller(NodeCaller):
    """A :class:`NodeCaller` whose selection nodes are opened (the probes of a walk)."""

    def __call__(self, node: Any, grads: Sequence[Tensor | None],
                 edges: Sequence[Any]) -> list[Tensor | None]:
        """The node's gradients, opened where it is a selection (:func:`opened_call`)."""
        return opened_call(node, grads, super().__call__(node, grads, edges))


def check_weights(count: int, dtype: torch.dtype, device: torch.device,
                  generator: torch.Generator) -> Tensor:
    """The derivative check's weights on ``count`` rows: NaN (NOTE [opened selections]).

    Under ``torch.autograd.set_detect_anomaly`` (which raises on NaN gradients) they are
    random positive weights in ``[0.5, 1.5)`` instead, blind to zero factors and selections.

    Example:
        >>> check_weights(2, torch.float32, torch.device("cpu"), torch.Generator())
        tensor([nan, nan])
    """
    if not torch.is_anomaly_enabled():
        return torch.full((count,), math.nan, dtype=dtype, device=device)
    return 0.5 + torch.rand(count, generator=generator, device=device).to(dtype)
