"""The one dense oracle: ``torch.func.jacrev(..., chunk_size=1)``, flattened, ``J @ J.T``.

Slow and memory-hungry on purpose: it builds the full Jacobian ``[m, P]`` of the
flattened output with respect to every floating tensor leaf of the differentiated
arguments, and contracts it. Every backend is checked against it.

The rows come from one plain backward per row (``chunk_size=1`` is a loop of vjps, never
``vmap``): a batching rule of torch can be wrong where the op's plain backward is right
(torch 2.13: the backward of ``torch.cdist``, see ``tests/fuzz/FINDINGS.md``), and the
backends use ``vmap`` everywhere, so an oracle that vmapped over its backward passes could
agree with a wrong backend. It still composes with ``torch.func`` transforms around it.
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

    def flat_output(*values: Tensor) -> tuple[Tensor, Any]:
        out = f(*rebuild(values))
        flat_out = torch.cat([leaf.reshape(-1) for leaf in optree.tree_leaves(out)])
        return flat_out, optree.tree_map(lambda t: t.detach(), out)

    leaves = [flat[n][0][j].detach() for n, j in positions]
    # one evaluation of f: with random ops, the Jacobian of the draw one plain call sees
    per_leaf, output = torch.func.jacrev(flat_output, argnums=tuple(range(len(leaves))),
                                         has_aux=True, chunk_size=1)(*leaves)
    num_rows = per_leaf[0].shape[0]
    columns = [jac.reshape(num_rows, -1) for jac in per_leaf]
    blocks = [c @ c.T for c in columns]
    jacobian = torch.cat(columns, dim=1)
    return Dense(jacobian @ jacobian.T, blocks, jacobian, output)
