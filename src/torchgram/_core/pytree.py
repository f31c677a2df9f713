"""Pytree helpers: which leaves are differentiated, and how to put them back.

torchgram uses `optree` with its default conventions everywhere, so dict leaves come
out in **sorted key order**. Every row/column order the library documents follows
from `optree.tree_leaves` with those defaults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch import Tensor

PLAIN_VALUES = (int, float, bool, str, type(None))
"""Non-tensor leaves read and compared by value (a call's flags and sizes)."""


def is_differentiable_leaf(leaf: Any) -> bool:
    """Whether a pytree leaf is a parameter torchgram differentiates (a floating tensor)."""
    return isinstance(leaf, Tensor) and leaf.is_floating_point()


@dataclass(frozen=True)
class DiffLeaves:
    """The floating tensor leaves of the differentiated arguments, flattened.

    Attributes:
        argnums: The positions of the differentiated arguments (normalised, sorted as given).
        treespecs: One optree treespec per differentiated argument.
        arg_leaves: All leaves of each differentiated argument (constants included).
        positions: For every differentiated leaf, ``(k, j)``: leaf ``j`` of argument ``argnums[k]``.
        leaves: The differentiated leaves themselves, detached (they share storage with the
            user's tensors and never carry the user's ``requires_grad`` flag into our graphs),
            or as given when the call must be differentiable (NOTE [composition]).
    """

    argnums: tuple[int, ...]
    treespecs: tuple[optree.PyTreeSpec, ...]
    arg_leaves: tuple[tuple[Any, ...], ...]
    positions: tuple[tuple[int, int], ...]
    leaves: tuple[Tensor, ...]

    def replace_leaves(self, leaves: tuple[Tensor, ...]) -> DiffLeaves:
        """The same structure with other tensors for the differentiated leaves."""
        return dataclasses.replace(self, leaves=leaves)

    @property
    def numels(self) -> tuple[int, ...]:
        """Number of scalar parameters in each differentiated leaf."""
        return tuple(leaf.numel() for leaf in self.leaves)

    def rebuild_args(self, args: Sequence[Any], new_leaves: Sequence[Tensor]) -> tuple[Any, ...]:
        """Return ``args`` with the differentiated leaves replaced by ``new_leaves``."""
        per_arg = [list(leaves) for leaves in self.arg_leaves]
        for (k, j), leaf in zip(self.positions, new_leaves, strict=True):
            per_arg[k][j] = leaf
        rebuilt = list(args)
        for k, argnum in enumerate(self.argnums):
            rebuilt[argnum] = optree.tree_unflatten(self.treespecs[k], per_arg[k])
        return tuple(rebuilt)

    def unflatten_like_args(self, per_leaf: Sequence[Any], *, as_tuple: bool) -> Any:
        """Put one value per differentiated leaf into the structure of the argument(s).

        Constant (non-differentiated) leaves get ``None``. With ``as_tuple`` the result is a
        tuple with one pytree per differentiated argument, otherwise the single pytree.
        """
        per_arg: list[list[Any]] = [[None] * len(leaves) for leaves in self.arg_leaves]
        for (k, j), value in zip(self.positions, per_leaf, strict=True):
            per_arg[k][j] = value
        trees = tuple(
            optree.tree_unflatten(spec, values)
            for spec, values in zip(self.treespecs, per_arg, strict=True)
        )
        return trees if as_tuple else trees[0]


def select_diff_leaves(args: Sequence[Any], argnums: tuple[int, ...], *,
                       detach: bool = True) -> DiffLeaves:
    """Flatten the differentiated arguments and pick their floating tensor leaves.

    ``detach=False`` keeps the leaves as given (a ``G`` differentiable through them).
    """
    treespecs = []
    arg_leaves = []
    positions = []
    leaves = []
    for k, argnum in enumerate(argnums):
        flat, spec = optree.tree_flatten(args[argnum])
        treespecs.append(spec)
        arg_leaves.append(tuple(flat))
        for j, leaf in enumerate(flat):
            if is_differentiable_leaf(leaf):
                positions.append((k, j))
                leaves.append(leaf.detach() if detach else leaf)
    return DiffLeaves(tuple(argnums), tuple(treespecs), tuple(arg_leaves), tuple(positions),
                      tuple(leaves))


def leaves_of(tree: Any) -> list[Any]:
    """Every leaf of ``tree`` (``optree.tree_leaves``, typed for any pytree)."""
    return list(optree.tree_leaves(tree))


def tree_map_tensors(fn: Callable[[Tensor], Any], tree: Any) -> Any:
    """Apply ``fn`` to every tensor leaf of ``tree``, leaving other leaves unchanged."""
    return optree.tree_map(lambda leaf: fn(leaf) if isinstance(leaf, Tensor) else leaf, tree)


def detach_tree(tree: Any) -> Any:
    """Detach every tensor leaf of ``tree``."""
    return tree_map_tensors(torch.Tensor.detach, tree)
