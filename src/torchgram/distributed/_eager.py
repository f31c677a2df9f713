"""Eager DDP and FSDP2: the Gramian of every rank's autograd graph, and the weighted step.

# NOTE [eager data parallel]
Each rank ran its module on its own samples and holds the graph of its losses. Without
``f`` there is no structured pass to stop early, so every rank walks its graph (the
``graph`` backend's walk, NOTE [calling nodes directly]) to the per-row Jacobian of each
parameter, and the Jacobians travel as payloads (NOTE [data-parallel Gramian]): rows are
every rank's losses, one rank after the other. For ghost factors instead of per-sample
gradients, use the functional API (``torchgram.functionalize`` works on DDP and FSDP2
modules).

* **DDP** (``inputs`` the ``DistributedDataParallel`` module): the graph's leaves are the
  wrapped module's parameters. The step is DDP's own: ``backward`` with cotangents
  ``W·w_r`` (``W`` ranks, ``w_r`` this rank's weights), which DDP's all-reduce averages to
  ``Jᵀ w`` in every ``.grad``.
* **FSDP2** (``inputs`` the root module of ``fully_shard``): the graph's leaves are the
  whole parameters FSDP all-gathers for forward, which it frees again after forward
  (``reshard_after_forward=True``, the default) — walking the graph, or differentiating
  with respect to the sharded ``module.parameters()``, would then read freed memory or
  give zero blocks. So the walk first all-gathers them again (``unshard()``, what FSDP's
  own pre-backward does), takes them as the leaves, and treats FSDP's post-backward
  Function on module inputs as the identity it is for cotangents. The step is FSDP's own
  backward with cotangents ``W·w_r``: its reduce-scatter averages ``Jᵀ w`` into the
  sharded ``.grad``.
* **Plain tensors** (a list, or a module without a wrapper): ``.grad += Jᵀ w``, this rank's
  part ``J_rᵀ w_r`` summed over ranks by one ``all_reduce``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import optree
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from torchgram._core import _torch_compat, checks
from torchgram._core.checks import fail
from torchgram._core.options import Options
from torchgram._core.pytree import select_diff_leaves
from torchgram.backends.graph.gramian import graph_jacobians
from torchgram.backends.structured.cost import LeafPlan
from torchgram.backends.structured.payloads import LeafPayload, PassPayloads
from torchgram.distributed._agreement import OutputDesc, RankSummary, agree, raise_any_error
from torchgram.distributed._data_parallel import Local, Result, _exchange_and_reduce
from torchgram.distributed._group import Group, GroupLike, resolve_group
from torchgram.distributed._guard import CollectiveInF, NoCollectives
from torchgram.distributed._payloads import describe

Wrapper = Literal["ddp", "fsdp", "plain"]


@dataclass
class EagerInputs:
    """What to differentiate, and who reduces the gradients of the step.

    Attributes:
        tensors: The graph's tensors (FSDP2: the whole, all-gathered parameters).
        wrapper: ``"ddp"``, ``"fsdp"`` or ``"plain"``.
        group: The wrapper's group (DDP's process group, FSDP2's mesh), for ``group=None``.
        resharded: FSDP2 modules this call all-gathered, to reshard after a Gramian alone.
    """

    tensors: list[Tensor]
    wrapper: Wrapper
    group: GroupLike = None
    resharded: tuple[nn.Module, ...] = ()

    def reshard(self) -> None:
        """Free again what this call all-gathered (FSDP2, when no backward follows)."""
        for module in self.resharded:
            module.reshard()  # type: ignore[operator]


def eager_inputs(api: str, inputs: nn.Module | Tensor | Iterable[Tensor]) -> EagerInputs:
    """Resolve ``inputs`` (a module or tensors) to the graph's tensors (NOTE above)."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(inputs, DistributedDataParallel):
        return EagerInputs([p for p in inputs.module.parameters() if p.requires_grad], "ddp",
                           inputs.process_group)
    if isinstance(inputs, nn.Module):
        managed = list(_torch_compat.fsdp_params(inputs))
        if not managed:
            return EagerInputs([p for p in inputs.parameters() if p.requires_grad], "plain")
        return _fsdp_inputs(inputs, managed)
    tensors = [inputs] if isinstance(inputs, Tensor) else list(inputs)
    if not tensors or not all(isinstance(t, Tensor) for t in tensors):
        checks.fail(api, "inputs to be a module (DDP, FSDP2 or plain) or a list of tensors",
                    f"{type(inputs).__name__}", "Pass e.g. the DDP module itself.", TypeError)
    for index, tensor in enumerate(tensors):
        if _torch_compat.is_dtensor(tensor):
            checks.fail(api, "the FSDP2 module itself, or plain tensors",
                        f"inputs[{index}], a DTensor (placements "
                        f"{getattr(tensor, 'placements', None)})",
                        "Pass the root module given to fully_shard: its graph's leaves are "
                        "FSDP's whole parameters, which only the module knows.", TypeError)
    return EagerInputs(tensors, "plain")


def _fsdp_inputs(root: nn.Module, managed: list[_torch_compat.FsdpParam]) -> EagerInputs:
    sharded = []
    modules = [m for m in root.modules() if _torch_compat.fsdp_original_class(m) is not None]
    for module in modules:
        params = [p for p in managed if p.module in set(module.modules())]
        if any(p.module._parameters.get(p.name) is p.sharded for p in params):
            sharded.append(module)
    for module in modules:  # every rank all-gathers the same modules, in the same order
        module.unshard()  # type: ignore[operator]
    tensors = []
    for param in _torch_compat.fsdp_params(root):
        if param.unsharded is not None and param.sharded.requires_grad:
            tensors.append(param.unsharded)
    mesh = managed[0].sharded.device_mesh  # type: ignore[attr-defined]
    return EagerInputs(tensors, "fsdp", mesh, tuple(sharded))


def _options(api: str, chunk_size: int | None) -> Options:
    return Options(api, (0,), True, False, "auto", chunk_size, None, 0, False, False, None)


def eager_gramian(api: str, outputs: list[Tensor], inputs: EagerInputs, group: Group,
                  chunk_size: int | None, failed: BaseException | None = None) -> Result:
    """``G`` of every rank's rows (NOTE [eager data parallel]), identical everywhere.

    ``failed``: this rank's error from the checks of its outputs, raised on every rank with
    the others' (a rank raising before the exchange would leave the others waiting in it).
    """
    options = _options(api, chunk_size)
    diff = select_diff_leaves((inputs.tensors,), (0,))
    local = Local(diff=diff)
    num_rows = sum(out.numel() for out in outputs)
    try:
        if failed is not None:
            raise failed
        with NoCollectives():
            jacobians = graph_jacobians(api, outputs, inputs.tensors, chunk_size=chunk_size) \
                if num_rows else [None] * len(inputs.tensors)
        leaves = tuple(
            LeafPayload(_plan(i)) if jac is None else
            LeafPayload(_plan(i), carrier=jac.reshape(num_rows, 1, -1))
            for i, jac in enumerate(jacobians))
        rows = torch.cat([out.detach().reshape(-1) for out in outputs]) if outputs else None
        assert rows is not None
        local.payloads = PassPayloads("dense", 1, num_rows, leaves, rows, None)
        dtype = outputs[0].dtype
        for out in outputs[1:]:
            dtype = torch.promote_types(dtype, out.dtype)
        output = OutputDesc(optree.tree_structure(list(range(len(outputs)))),  # type: ignore[arg-type]
                            tuple(tuple(out.shape) for out in outputs), None,
                            tuple(str(out.dtype) for out in outputs), str(dtype))
        local.summary = RankSummary(
            error=None, mode="ranks" if num_rows else "empty", samples=1, rows=num_rows,
            output=output,
            leaves=tuple(describe(p, num_rows, 1, t) for p, t in zip(leaves, diff.leaves,
                                                                      strict=True)))
    except CollectiveInF as error:  # pragma: no cover -- a graph's backward communicating
        local.error = RuntimeError(f"{api}: the graph's backward communicates ({error.op})")
    except Exception as error:  # noqa: BLE001 -- shared with every rank, then raised
        local.error = error
    if local.error is not None:
        local.summary = RankSummary(error=(type(local.error).__name__, str(local.error)),
                                    mode="empty")
    summaries = group.all_gather_object(local.summary)
    raise_any_error(api, [summary.error for summary in summaries], group.rank, local.error)
    agreement = agree(api, summaries, force_jacobian=True)
    return _exchange_and_reduce(options, local, agreement, summaries, group)


def _plan(leaf: int) -> LeafPlan:
    return LeafPlan(leaf, "fallback", (), (), ("(an eager graph)",), None, 0.0, 0.0,
                    "a Jacobian from the graph walk")


def local_rows(result: Result, group: Group) -> slice:
    """This rank's rows among the ``M`` rows (rank order)."""
    sizes = result.agreement.sizes
    start = sum(sizes[:group.rank])
    return slice(start, start + sizes[group.rank])


def resolve(api: str, inputs: EagerInputs, group: GroupLike) -> Group:
    """The call's group: ``group``, else the wrapper's, else the default group.

    A DDP or FSDP2 step is reduced by the wrapper over its own ranks, so the Gramian's group
    must be made of the same ranks (``Jᵀ w`` of the batch of exactly those ranks).
    """
    resolved = resolve_group(api, group if group is not None else inputs.group)
    if inputs.wrapper != "plain" and inputs.group is not None:
        wrapper = _wrapper_ranks(inputs.group)
        ranks = dist.get_process_group_ranks(resolved.pg)
        if sorted(ranks) != sorted(wrapper):
            fail(api, f"group to be the ranks the {inputs.wrapper.upper()} module reduces "
                 f"over ({wrapper})", f"a group of ranks {ranks}",
                 "Pass group=None: the Gramian is then taken over the wrapper's own ranks.")
    return resolved


def _wrapper_ranks(group: GroupLike) -> list[int]:
    """The global ranks of a DDP process group or an FSDP2 device mesh."""
    if isinstance(group, DeviceMesh):
        return [int(r) for r in group.mesh.flatten().tolist()]
    return list(dist.get_process_group_ranks(group))


def accumulate(tensors: list[Tensor], grads: list[Tensor]) -> None:
    """``tensor.grad += grad`` (``torch.autograd.backward``'s accumulation)."""
    for tensor, grad in zip(tensors, grads, strict=True):
        grad = grad.to(tensor.dtype)
        tensor.grad = grad if tensor.grad is None else tensor.grad + grad


def cotangents(outputs: list[Tensor], weights: Tensor) -> list[Tensor]:
    """``weights`` ``[m_r]`` split and shaped like ``outputs``."""
    pieces = weights.split([out.numel() for out in outputs])
    return [piece.reshape(out.shape).to(out.dtype)
            for piece, out in zip(pieces, outputs, strict=True)]


def local_grads(outputs: list[Tensor], tensors: list[Tensor], weights: Tensor,
                retain_graph: bool) -> list[Tensor]:
    """``J_rᵀ w_r`` for each tensor (zeros where unreached), without touching ``.grad``."""
    if not outputs or sum(out.numel() for out in outputs) == 0:
        return [torch.zeros_like(t) for t in tensors]
    grads = torch.autograd.grad(outputs, tensors, cotangents(outputs, weights),
                                retain_graph=retain_graph, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, tensors, strict=True)]


def sum_over_ranks(grads: list[Tensor], group: Group, scale: float = 1.0) -> list[Tensor]:
    """The sum over ranks of each gradient (one ``all_reduce``), times ``scale``."""
    if not grads:
        return []
    dtype = grads[0].dtype
    for grad in grads[1:]:
        dtype = torch.promote_types(dtype, grad.dtype)
    flat = group.all_reduce(torch.cat([g.reshape(-1).to(dtype) for g in grads]))
    if scale != 1.0:
        flat = flat * scale
    return [piece.reshape(g.shape).to(g.dtype)
            for piece, g in zip(flat.split([g.numel() for g in grads]), grads, strict=True)]
