"""Calling one autograd node on a batch of row cotangents, outside the autograd engine.

The graph walk (``_graph_walk``) pushes *row-Jacobians* through the nodes of an existing
autograd graph: node ``N`` receives, for each of its input slots, a tensor
``[rows, *slot_shape]`` (row ``r`` is the cotangent of output row ``r``), and must return,
for each of its next edges, ``[rows, *edge_shape]``. A node computes one vector-Jacobian
product per call, so the rows are batched with ``torch.func.vmap``.

# NOTE [calling nodes directly]
Two kinds of node exist, called differently:

* C++ nodes (``MulBackward0``, ``AddmmBackward0``, ...) are callable: ``node(*grads)``
  runs ``Node::apply`` and returns one gradient per entry of ``next_functions`` (a bare
  tensor when there is one), with ``None`` for edges that need none. ``None`` is accepted
  for an input slot that received no cotangent (an undefined gradient, as the engine
  passes it).
* Custom ``autograd.Function`` nodes (``BackwardCFunction``) are not callable; their
  Python ``apply`` runs the user's ``backward`` and returns one gradient per *forward
  argument* (non-tensor arguments included). The engine's wrapper (``PyNode``) maps them
  to next edges; we do the same: the gradients at the positions where
  ``needs_input_grad`` is true are, in order, those of the valid (non-``None``) next edges.
  Missing cotangents are materialized as zeros (the default of
  ``ctx.set_materialize_grads``, which is not readable from Python; a backward written for
  ``None`` handles zeros too).

Calling a node directly skips what the engine does around the call, which we redo:

* **gradient layout**: the engine's ``validate_outputs`` reduces a gradient to the shape
  recorded for the next node's input (``_input_metadata``; e.g. ``AddBackward0`` returns
  the *unbroadcast* gradient of a broadcast operand) and casts it to its dtype and device;
  :func:`_to_edge` does the same;
* **hooks** are not run: tensor hooks, node pre/post hooks, ``retain_grad`` and module
  backward hooks never see our cotangents, and no ``.grad`` is written (we never call the
  ``AccumulateGrad`` nodes: leaves are where the walk stops);
* **graph retention**: saved tensors are never released by a direct call (that is
  ``_graph_release``'s job when ``retain_graph=False``).

A custom Function whose ``backward`` itself runs autograd on a graph of its own (reentrant
checkpointing is the common case) hides that graph's leaves from the walk; the walk refuses
``torch.utils.checkpoint(..., use_reentrant=True)`` (``_graph_gramian``), and the
non-reentrant checkpoint works as any graph (its saved-tensor hooks recompute on access).

# NOTE [vmap fallback]
``vmap`` over a node call works for nearly every built-in node (each op of a backward
formula has a batching rule; torch's own ``autograd.grad(..., is_grads_batched=True)``
relies on the same thing) and for custom Functions whose ``backward`` only uses torch
ops. When it raises (a ``backward`` calling ``.numpy()`` or ``.item()``, data-dependent
control flow, an op without a batching rule under ``warnings`` as errors, ...), the node
is called once per row instead, and its *type* is remembered so that later nodes of the
same type go to the loop directly. A failure never yields partial results: the loop
recomputes every row of the node.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from torchgram._core import _torch_compat
from torchgram._core._torch_compat import Node
from torchgram._core.watched_calls import check_node

Edge = tuple[Node, int]
"""A next edge ``(node, input_nr)``: where a node's gradient goes."""


def node_name(node: Node) -> str:
    """A readable node name for messages, e.g. ``'MulBackward0'``."""
    name = getattr(node, "name", None)
    return name() if callable(name) else type(node).__name__


def input_slots(node: Node) -> int:
    """How many cotangents ``node`` takes (one per output of its forward op)."""
    return len(_torch_compat.slot_metadata(node))


class NodeCaller:
    """Applies nodes to row-batched cotangents: ``vmap`` over row chunks, or a row loop.

    Args:
        chunk_size: Rows per vectorized call (``None``: all rows at once; ``1``: a plain
            loop, no ``vmap``).

    Example:
        >>> import torch
        >>> x = torch.randn(3, requires_grad=True)
        >>> y = x.sin() * 2
        >>> caller = NodeCaller(chunk_size=None)
        >>> mul = y.grad_fn  # MulBackward0; next edges: SinBackward0, and None for the 2
        >>> [node_name(child) if child else None for child, _ in mul.next_functions]
        ['SinBackward0', None]
        >>> grad, _ = caller(mul, [torch.eye(3)], [mul.next_functions[0], None])
        >>> torch.equal(grad, 2 * torch.eye(3))
        True
    """

    def __init__(self, chunk_size: int | None) -> None:
        self.chunk_size = chunk_size
        self.loop_types: set[type] = set()  # node types vmap failed on: NOTE [vmap fallback]
        self.vmap_failures: dict[str, int] = {}  # by node name, for reports

    def __call__(self, node: Node, grads: Sequence[Tensor | None],
                 edges: Sequence[Edge | None]) -> list[Tensor | None]:
        """Gradients ``[rows, *edge_shape]`` for each of ``edges`` (``None`` = not wanted).

        Args:
            node: The node to call.
            grads: One entry per input slot of ``node``: ``[rows, *slot_shape]`` or ``None``
                (no cotangent reached that slot). At least one must be a tensor.
            edges: One entry per next edge of ``node``: the edge, or ``None`` where the walk
                does not need that gradient.

        Returns:
            One entry per next edge: the row gradients, or ``None`` where the edge is not
            wanted or the node returned no gradient for it.
        """
        check_node(node, node_name(node))  # a backward torch gets wrong: watched_calls
        rows = next(g for g in grads if g is not None).shape[0]
        chunk = rows if self.chunk_size is None else min(self.chunk_size, rows)
        results: list[Tensor | None] = [None] * len(edges)
        for start in range(0, rows, chunk):
            stop = min(start + chunk, rows)
            part = [None if g is None else g[start:stop] for g in grads]
            for k, value in enumerate(self._rows(node, part, edges, stop - start)):
                if value is None:
                    continue
                if results[k] is None:
                    if start == 0 and stop == rows:
                        results[k] = value
                        continue
                    results[k] = value.new_zeros((rows, *value.shape[1:]))
                results[k][start:stop] = value  # type: ignore[index]
        return results

    def _rows(self, node: Node, grads: list[Tensor | None], edges: Sequence[Edge | None],
              count: int) -> list[Tensor | None]:
        if count > 1 and self.chunk_size != 1 and type(node) not in self.loop_types \
                and node_name(node) not in _torch_compat.WRONG_BATCHED_NODES:
            try:
                return _vmapped(node, grads, edges)
            except Exception:  # noqa: BLE001 -- NOTE [vmap fallback]: any failure, loop instead
                self.loop_types.add(type(node))
                name = node_name(node)
                self.vmap_failures[name] = self.vmap_failures.get(name, 0) + 1
        return _looped(node, grads, edges, count)


def _vmapped(node: Node, grads: list[Tensor | None],
             edges: Sequence[Edge | None]) -> list[Tensor | None]:
    present = [k for k, g in enumerate(grads) if g is not None]
    defined: list[bool] = []

    def one_row(*values: Tensor) -> tuple[Tensor, ...]:
        row: list[Tensor | None] = [None] * len(grads)
        for k, value in zip(present, values, strict=True):
            row[k] = value
        outs = apply_node(node, row, edges)
        defined[:] = [out is not None for out in outs]
        return tuple(out for out in outs if out is not None)

    batched = iter(torch.func.vmap(one_row)(*(g for g in grads if g is not None)))
    return [next(batched) if is_defined else None for is_defined in defined]


def _looped(node: Node, grads: list[Tensor | None], edges: Sequence[Edge | None],
            count: int) -> list[Tensor | None]:
    if count == 1:  # one row: no copy
        outs = apply_node(node, [None if g is None else g[0] for g in grads], edges)
        return [None if out is None else out.unsqueeze(0) for out in outs]
    per_row = [apply_node(node, [None if g is None else g[r] for g in grads], edges)
               for r in range(count)]
    stacked: list[Tensor | None] = []
    for k in range(len(edges)):
        values = [outs[k] for outs in per_row]
        first = next((v for v in values if v is not None), None)
        if first is None:
            stacked.append(None)
            continue
        stacked.append(torch.stack([first.new_zeros(()).expand_as(first) if v is None else v
                                    for v in values]))
    return stacked


def apply_node(node: Node, grads: Sequence[Tensor | None],
               edges: Sequence[Edge | None]) -> list[Tensor | None]:
    """One vector-Jacobian product through ``node``, laid out for each wanted next edge.

    See NOTE [calling nodes directly]. ``grads`` has one cotangent (or ``None``) per input
    slot; the result has one gradient (or ``None``) per next edge, reduced and cast to the
    layout the next node expects.
    """
    if _torch_compat.is_custom_function_node(node):
        outs = _apply_custom(node, grads)
    else:
        outs = _torch_compat.call_builtin_node(node, list(grads))
    return [None if edge is None or out is None else _to_edge(out, edge)
            for out, edge in zip(outs, edges, strict=True)]


def _apply_custom(node: Node, grads: Sequence[Tensor | None]) -> list[Tensor | None]:
    metadata = _torch_compat.slot_metadata(node)
    materialized = [
        torch.zeros(meta.shape, dtype=meta.dtype, device=meta.device) if g is None else g
        for g, meta in zip(grads, metadata, strict=True)
    ]
    if _torch_compat.passes_cotangents_through(node):  # no side effect (FSDP2's hook)
        per_argument, needs = [None, *materialized], tuple(node.needs_input_grad)
    else:
        per_argument, needs = _torch_compat.call_custom_function_node(node, materialized)
    wanted = [per_argument[i] if i < len(per_argument) else None
              for i, need in enumerate(needs) if need]
    valid = [k for k, (child, _) in enumerate(node.next_functions) if child is not None]
    if len(wanted) != len(valid):
        raise RuntimeError(f"{node_name(node)}: {len(wanted)} inputs need a gradient but the "
                           f"node has {len(valid)} next edges")
    outs: list[Tensor | None] = [None] * len(node.next_functions)
    for k, grad in zip(valid, wanted, strict=True):
        outs[k] = grad
    return outs


def _to_edge(grad: Tensor, edge: Edge) -> Tensor:
    """Reduce and cast ``grad`` to the input layout of ``edge`` (the engine's validate_outputs)."""
    child, input_nr = edge
    meta = _torch_compat.slot_metadata(child)[input_nr]
    shape = meta.shape
    if tuple(grad.shape) != shape:
        grad = grad.sum_to_size(shape)
    if grad.dtype != meta.dtype:
        grad = grad.to(meta.dtype)
    if grad.device != meta.device:
        grad = grad.to(meta.device)
    return grad

