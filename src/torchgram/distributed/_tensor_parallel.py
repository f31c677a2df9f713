"""Tensor parallel: DTensor parameters sharded over a mesh, per-shard blocks summed over it.

# NOTE [tensor-parallel Gramian]
With parameters sharded by ``parallelize_module`` (``ColwiseParallel`` rows,
``RowwiseParallel`` columns) every rank of the mesh sees the same inputs and outputs, but
holds one shard of each sharded parameter. A sharded leaf's Jacobian is the concatenation
of its shards' Jacobians, so its block is the **sum of the per-shard blocks**
``J_k J_kᵀ`` (DESIGN.md §1, the block sum): each rank forms the blocks of its own shards,
with its shards as the differentiated leaves (``DTensor.from_local`` rebuilds the DTensor
inside ``f``, so the module runs exactly as parallelized, collectives included) and one
``all_reduce`` over the mesh sums them. A leaf every rank holds whole (``Replicate``
placements, or a plain tensor) is **counted once**: only the mesh's first rank adds it.

``f`` communicates here (the layers' own collectives), so it runs with plain autograd
once, and the blocks come from a walk of that graph (the ``graph`` backend), which every
rank performs identically; inputs must be the same on every rank of the mesh, as tensor
parallelism requires.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from torchgram._api.pipeline import Computation, compute
from torchgram._core.checks import fail, resolve_argnums
from torchgram._core.options import Options
from torchgram._core.pytree import DiffLeaves, select_diff_leaves
from torchgram._core.sink import shape_block
from torchgram.distributed._group import Group, GroupLike, resolve_group


def has_dtensor_leaves(options: Options, args: tuple[Any, ...]) -> bool:
    """Whether a differentiated leaf of the call is a DTensor."""
    argnums = resolve_argnums(options.api, options.argnums, len(args))
    return any(isinstance(leaf, DTensor)
               for leaf in select_diff_leaves(args, argnums).leaves)


@dataclass
class ShardedCall:
    """A call whose DTensor leaves were replaced by their local shards.

    Attributes:
        diff: The differentiated leaves of the original call (DTensors).
        group: The mesh's process group.
        counted: Per leaf, whether this rank adds its block (sharded, or the first rank).
        computation: The local shards' per-leaf computation.
    """

    diff: DiffLeaves
    group: Group
    counted: tuple[bool, ...]
    computation: Computation


def sharded_compute(options: Options, f: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: Mapping[str, Any], group_like: GroupLike, *,
                    want_pullback: bool = False) -> ShardedCall:
    """Per-leaf blocks of this rank's shards (NOTE [tensor-parallel Gramian])."""
    api = options.api
    argnums = resolve_argnums(api, options.argnums, len(args))
    diff = select_diff_leaves(args, argnums)
    specs: list[tuple[Any, ...] | None] = []
    meshes = set()
    for leaf in diff.leaves:
        if isinstance(leaf, DTensor):
            specs.append((leaf.device_mesh, leaf.placements, leaf.shape, leaf.stride()))
            meshes.add(leaf.device_mesh)
        else:
            specs.append(None)
    mesh = next(iter(meshes))
    if len(meshes) > 1 or mesh.ndim != 1:
        fail(api, "DTensor parameters on one 1-D device mesh (tensor parallelism)",
             f"{len(meshes)} mesh(es) of dims {[m.ndim for m in meshes]}",
             "Combine tensor parallelism with data parallelism by functionalizing the "
             "tensor-parallel part only; 2-D meshes are not supported yet.", NotImplementedError)
    group = resolve_group(api, mesh if group_like is None else group_like)
    mesh_ranks = dist.get_process_group_ranks(mesh.get_group())
    if dist.get_process_group_ranks(group.pg) != mesh_ranks:
        fail(api, f"group to be the mesh of the DTensor parameters (ranks {mesh_ranks})",
             f"a group of ranks {dist.get_process_group_ranks(group.pg)}",
             "Pass group=None (the parameters' mesh) or that mesh.")
    local_leaves = [leaf.to_local() if isinstance(leaf, DTensor) else leaf
                    for leaf in diff.leaves]
    local_args = diff.rebuild_args(args, local_leaves)
    positions = diff.positions

    def with_dtensors(*call_args: Any, **call_kwargs: Any) -> Any:
        rebuilt = list(call_args)
        for k, argnum in enumerate(argnums):
            flat, spec = optree.tree_flatten(call_args[argnum])
            for (kk, j), leaf_spec in zip(positions, specs, strict=True):
                if kk == k and leaf_spec is not None:
                    leaf_mesh, placements, shape, stride = leaf_spec
                    flat[j] = DTensor.from_local(flat[j], leaf_mesh, placements,
                                                 run_check=False, shape=shape, stride=stride)
            rebuilt[argnum] = optree.tree_unflatten(spec, flat)
        return f(*rebuilt, **call_kwargs)

    local_options = options.replace(backend="graph", per_leaf=True)
    computation = compute(local_options, with_dtensors, local_args, kwargs,
                          want_pullback=want_pullback)
    counted = tuple(
        group.rank == 0 if spec is None or all(isinstance(p, Replicate) for p in spec[1])
        else True for spec in specs)
    return ShardedCall(diff, group, counted, computation)


def reduced_blocks(call: ShardedCall, per_leaf: bool) -> list[Tensor]:
    """The blocks of the whole parameters: per-shard blocks summed over the mesh."""
    blocks = call.computation.blocks
    counted = [block if keep else torch.zeros_like(block)
               for block, keep in zip(blocks, call.counted, strict=True)]
    stacked = torch.stack(counted) if per_leaf else torch.stack(counted).sum(0, keepdim=True)
    return list(call.group.all_reduce(stacked))


def dtensor_grads(call: ShardedCall, grads: Sequence[Tensor]) -> list[Tensor]:
    """Local-shard gradients as DTensors placed like their parameters."""
    out: list[Tensor] = []
    for grad, leaf in zip(grads, call.diff.leaves, strict=True):
        if isinstance(leaf, DTensor):
            out.append(DTensor.from_local(grad, leaf.device_mesh, leaf.placements,
                                          run_check=False, shape=leaf.shape,
                                          stride=leaf.stride()))
        else:
            out.append(grad)
    return out


def sharded_value(options: Options, call: ShardedCall, blocks: list[Tensor]) -> Any:
    """What the call returns for the reduced blocks (shaped, per leaf or summed)."""
    problem = call.computation.problem
    shaped = [shape_block(problem, block, diagonal=options.diagonal) for block in blocks]
    if not options.per_leaf:
        return shaped[0]
    return call.diff.unflatten_like_args(shaped, as_tuple=not options.single_argnum)


def sharded_pullback(call: ShardedCall, weights: Tensor) -> list[Tensor]:
    """``Jᵀ w`` for this rank's shards: one forward and backward with plain autograd.

    (``DTensor.from_local`` is an ``autograd.Function`` without functorch support, so no
    ``torch.func.vjp`` here.)
    """
    problem = call.computation.problem
    leaves = tuple(leaf.detach().requires_grad_() for leaf in problem.leaves)
    try:
        with torch.enable_grad():
            rows = problem.rows(leaves)[0]
            grads = torch.autograd.grad(rows, leaves, weights.to(rows.dtype), allow_unused=True)
    finally:
        problem.draw.finish()
    return [torch.zeros_like(leaf) if grad is None else grad
            for grad, leaf in zip(grads, leaves, strict=True)]
