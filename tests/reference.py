"""The one dense oracle: ``torch.func.jacrev``, flattened, ``J @ J.T``.

Slow and memory-hungry on purpose: it builds the full Jacobian ``[m, P]`` of the
flattened output with respect to every floating tensor leaf of the differentiated
arguments, and contracts it. Every backend is checked against it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch import Tensor


@dataclass
class Dense:
    """The oracle's answer: the Gramian in ``[m, m]`` row order, its per-leaf blocks, the output."""

    gramian: Tensor
    blocks: list[Tensor]
    jacobian: Tensor
    output: Any

    def shaped(self, block: Tensor | None = None, *, diagonal: bool = False) -> Tensor:
        """``block`` (default: the Gramian) in the documented shape (``S + S`` for tensors)."""
        block = self.gramian if block is None else block
        if diagonal:
            block = block.diagonal()
        if not isinstance(self.output, Tensor):
            return block
        shape = self.output.shape
        return block.reshape(shape if diagonal else (*shape, *shape))


def dense_gramian(f: Callable[..., Any], args: Sequence[Any],
                  argnums: int | tuple[int, ...] = 0) -> Dense:
    """Dense reference Gramian of ``f(*args)`` w.r.t. the float leaves at ``argnums``."""
    nums = (argnums,) if isinstance(argnums, int) else argnums
    nums = tuple(n % len(args) for n in nums)
    flat = {n: optree.tree_flatten(args[n]) for n in nums}
    positions = [(n, j) for n in nums for j, leaf in enumerate(flat[n][0])
                 if isinstance(leaf, Tensor) and leaf.is_floating_point()]

    def rebuild(values: Sequence[Tensor]) -> list[Any]:
        per_arg = {n: list(flat[n][0]) for n in nums}
        for (n, j), value in zip(positions, values, strict=True):
            per_arg[n][j] = value
        rebuilt = list(args)
        for n in nums:
            rebuilt[n] = optree.tree_unflatten(flat[n][1], per_arg[n])
        return rebuilt

    def flat_output(*values: Tensor) -> Tensor:
        out = f(*rebuild(values))
        return torch.cat([leaf.reshape(-1) for leaf in optree.tree_leaves(out)])

    leaves = [flat[n][0][j].detach() for n, j in positions]
    output = f(*rebuild(leaves))
    per_leaf = torch.func.jacrev(flat_output, argnums=tuple(range(len(leaves))))(*leaves)
    num_rows = per_leaf[0].shape[0]
    columns = [jac.reshape(num_rows, -1) for jac in per_leaf]
    blocks = [c @ c.T for c in columns]
    jacobian = torch.cat(columns, dim=1)
    return Dense(jacobian @ jacobian.T, blocks, jacobian, output)


def dense_cross_gramian(f: Callable[..., Any], params: Any, x1: Any, x2: Any | None,
                        kwargs: dict[str, Any] | None = None) -> Tensor:
    """``J(x1) J(x2)ᵀ`` of ``f(params, x)`` from two dense Jacobians, shaped ``S1 + S2``."""
    kwargs = kwargs or {}
    first = dense_gramian(lambda p: f(p, x1, **kwargs), (params,))
    second = first if x2 is None else dense_gramian(lambda p: f(p, x2, **kwargs), (params,))
    shape = tuple(first.output.shape) + tuple(second.output.shape)
    return (first.jacobian @ second.jacobian.T).reshape(shape)


def nt_layout(gram: Tensor, trace_axes: Sequence[int] = (),
              diagonal_axes: Sequence[int] = ()) -> Tensor:
    """A cross Gramian ``S1 + S2`` in neural-tangents' layout, independently of torchgram.

    Output axes in order; a free axis's pair side by side, a diagonal axis once (its
    diagonal), a traced axis averaged over its pair (NT divides by the size).
    """
    ndim = gram.dim() // 2
    trace = {a % ndim for a in trace_axes}
    diagonal = {a % ndim for a in diagonal_axes}
    letters = "abcdefghijklmnopqrstuvwxyz"
    left, right, out = list(letters[:ndim]), list(letters[ndim:2 * ndim]), ""
    size = 1
    for axis in range(ndim):
        if axis in trace or axis in diagonal:
            right[axis] = left[axis]
            out += "" if axis in trace else left[axis]
            size *= gram.shape[axis] if axis in trace else 1
        else:
            out += left[axis] + right[axis]
    return torch.einsum(f"{''.join(left)}{''.join(right)}->{out}", gram) / size


def dense_cross_kernel(f: Callable[..., Any], params: Any, x1: Any, x2: Any | None,
                       trace_axes: Sequence[int] = (), diagonal_axes: Sequence[int] = (),
                       kwargs: dict[str, Any] | None = None) -> Tensor:
    """neural-tangents' kernel of ``f(params, x)``: :func:`nt_layout` of the dense cross Gramian."""
    return nt_layout(dense_cross_gramian(f, params, x1, x2, kwargs), trace_axes, diagonal_axes)
