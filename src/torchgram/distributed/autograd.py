"""Eager DDP and FSDP2 modules: the Gramian of every rank's graph, and Jacobian descent.

Like :mod:`torchgram.autograd`, on the autograd graph ordinary eager code built, with each
rank's losses as rows (one rank after the other), NOTE [eager data parallel].

Example:
    >>> import torch, torchgram as tg
    >>> tg.distributed.autograd.backward  # doctest: +ELLIPSIS
    <function backward at ...>
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal

import torch
from torch import Tensor, nn

from torchgram._api.autograd import CHUNK_ROWS_HINT, check_distinct
from torchgram._api.step_times import StepTimes, Stopwatch
from torchgram._api.weighted_backward import BackwardInfo
from torchgram._api.weights import call_weighting, check_weighting
from torchgram._core import checks
from torchgram._core.functional import public_call
from torchgram._core.sink import LeafBlocks
from torchgram.backends.graph.gramian import graph_gramian
from torchgram.distributed._agreement import fail_together
from torchgram.distributed._api import broadcast_weights, detached, refuse_transforms
from torchgram.distributed._eager import (
    EagerInputs,
    accumulate,
    cotangents,
    eager_gramian,
    eager_inputs,
    local_grads,
    local_rows,
    resolve,
    sum_over_ranks,
)
from torchgram.distributed._group import Group, GroupLike, check_group

__all__ = ["backward", "gramian"]

_GRAMIAN = "torchgram.distributed.autograd.gramian"
_BACKWARD = "torchgram.distributed.autograd.backward"


def _outputs(api: str, outputs: Tensor | Iterable[Tensor]) -> list[Tensor]:
    tensors = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    for index, out in enumerate(tensors):
        if not isinstance(out, Tensor) or not out.requires_grad:
            checks.fail(api, "outputs that require grad",
                        f"outputs[{index}] of type {type(out).__name__}"
                        + ("" if isinstance(out, Tensor) else ""),
                        "Compute the losses from the module's parameters, outside no_grad.",
                        TypeError if not isinstance(out, Tensor) else ValueError)
    return tensors


def _checked_outputs(api: str, outputs: Tensor | Iterable[Tensor]
                     ) -> tuple[list[Tensor], Exception | None]:
    """The outputs and the error of their checks, if any (raised with every rank's later).

    A rank whose outputs fail the checks must not raise before the exchange: the other ranks
    would wait in it until the process group's timeout (NOTE [local steps fail together]).
    """
    try:
        return _outputs(api, outputs), None
    except (TypeError, ValueError) as error:
        return [], error


def _local_gramian(outputs: list[Tensor], inputs: EagerInputs,
                   chunk_size: int | None) -> Tensor:
    """This rank's own block (``cross_rank="local"``)."""
    num_rows = sum(out.numel() for out in outputs)
    dtype = outputs[0].dtype if outputs else torch.float32
    blocks = LeafBlocks(len(inputs.tensors), per_leaf=False, diagonal=False)
    if num_rows:
        graph_gramian(_GRAMIAN, outputs, inputs.tensors, blocks, chunk_size=chunk_size,
                      diagonal=False)
    block = blocks.blocks()[0]
    device = outputs[0].device if outputs else torch.device("cpu")
    return torch.zeros(num_rows, num_rows, dtype=dtype, device=device) if block is None \
        else block.to(dtype)


@public_call  # NOTE [inference mode], NOTE [the caller's function modes]
def gramian(
    outputs: Tensor | Iterable[Tensor],
    inputs: nn.Module | Tensor | Iterable[Tensor],
    *,
    group: GroupLike = None,
    cross_rank: Literal["exact", "local"] = "exact",
    chunk_size: int | None = None,
) -> Tensor:
    """``G`` of every rank's ``outputs`` (rows in rank order), the same on every rank.

    Args:
        outputs: This rank's losses (tensors that require grad), from its eager forward.
        inputs: The module (a ``DistributedDataParallel`` wrapper, the root of
            ``fully_shard``, or a plain module) or a list of tensors of the graph.
        group: The process group (``None``: DDP's, FSDP2's mesh, or the default group).
        cross_rank: ``"exact"``, or ``"local"``: this rank's own block only.
        chunk_size: Rows per vectorized node call of the graph walk.

    Returns:
        ``[M, M]`` over every rank's ``m_r`` rows, one rank after the other
        (``"local"``: ``[m_r, m_r]``).
    """
    checks.check_choice(_GRAMIAN, "cross_rank", cross_rank, ("exact", "local"))
    chunk_size = checks.positive_int(_GRAMIAN, "chunk_size", chunk_size, CHUNK_ROWS_HINT)
    check_group(_GRAMIAN, group)
    refuse_transforms(_GRAMIAN)
    output_list, failed = _checked_outputs(_GRAMIAN, outputs)
    if failed is not None and cross_rank == "local":
        raise failed  # no collective: the other ranks do not wait on this one
    resolved_inputs = eager_inputs(_GRAMIAN, inputs)
    try:
        if cross_rank == "local":
            return detached(_local_gramian(output_list, resolved_inputs, chunk_size))
        resolved = resolve(_GRAMIAN, resolved_inputs, group)
        return detached(eager_gramian(_GRAMIAN, output_list, resolved_inputs, resolved,
                                      chunk_size, failed).blocks[0])
    finally:
        resolved_inputs.reshard()


@public_call  # NOTE [inference mode], NOTE [the caller's function modes]
def backward(
    losses: Tensor | Iterable[Tensor],
    inputs: nn.Module | Tensor | Iterable[Tensor],
    weighting: Callable[[Tensor], Tensor],
    *,
    group: GroupLike = None,
    cross_rank: Literal["exact", "local"] = "exact",
    chunk_size: int | None = None,
    retain_graph: bool = False,
    with_info: bool = False,
) -> Tensor | tuple[Tensor, BackwardInfo]:
    """A Jacobian-descent step on every rank's losses: ``.grad`` as DDP / FSDP2 reduce it.

    ``G`` of every rank's losses (:func:`gramian`), ``w = weighting(G)`` computed on the
    group's first rank and broadcast, then the backward each wrapper would run for the
    weighted loss ``Σ_i w_i loss_i`` of the whole batch (NOTE [eager data parallel]):

    * ``DistributedDataParallel`` module: every ``.grad`` holds ``Jᵀ w`` (DDP's average of
      the ranks' ``W · J_rᵀ w_r``);
    * FSDP2 root module: every sharded ``.grad`` holds its shard of ``Jᵀ w`` (FSDP2's
      reduce-scatter, averaging);
    * plain module or tensors: ``.grad += Jᵀ w`` (summed over ranks here).

    Like ``torch.autograd.backward`` it accumulates: zero the gradients first.

    Args:
        losses: This rank's losses.
        inputs: As for :func:`gramian`.
        weighting: ``G [M, M] -> w [M]``, e.g. :func:`torchgram.weighting.upgrad`.
        group: As for :func:`gramian`.
        cross_rank: ``"exact"``, or ``"local"``: each rank weights its own block (the
            step DDP takes around a single-process library; UPGrad's guarantee is lost).
        chunk_size: As for :func:`gramian`.
        retain_graph: Keep the graph after the backward pass.
        with_info: Also return a :class:`~torchgram.autograd.BackwardInfo` (``G``, times).

    Returns:
        The weights ``w`` ``[M]`` of every rank's losses (``"local"``: this rank's ``[m_r]``);
        with ``with_info``, ``(w, info)``.
    """
    check_weighting(_BACKWARD, weighting)
    checks.check_choice(_BACKWARD, "cross_rank", cross_rank, ("exact", "local"))
    chunk_size = checks.positive_int(_BACKWARD, "chunk_size", chunk_size, CHUNK_ROWS_HINT)
    check_group(_BACKWARD, group)
    refuse_transforms(_BACKWARD)
    output_list, failed = _checked_outputs(_BACKWARD, losses)
    resolved_inputs = eager_inputs(_BACKWARD, inputs)
    check_distinct(_BACKWARD, resolved_inputs.tensors)  # G would count one twice, .grad once
    try:
        device = output_list[0].device if output_list else torch.device("cpu")
        watch = Stopwatch(device)
        resolved = resolve(_BACKWARD, resolved_inputs, group)
        if cross_rank == "local":
            error: BaseException | None = None  # NOTE [local steps fail together]
            try:
                if failed is not None:
                    raise failed
                matrix = _local_gramian(output_list, resolved_inputs, chunk_size)
                gramian_time = watch.lap()
                weights = call_weighting(_BACKWARD, weighting, matrix)
            except Exception as caught:  # noqa: BLE001 -- shared with every rank
                error = caught
            fail_together(_BACKWARD, resolved, error)
            mine, scale = weights, 1.0 / resolved.size
        else:
            result = eager_gramian(_BACKWARD, output_list, resolved_inputs, resolved, chunk_size,
                                   failed)
            matrix = result.blocks[0]
            gramian_time = watch.lap()
            weights = broadcast_weights(_BACKWARD, weighting, matrix, resolved)
            mine, scale = weights[local_rows(result, resolved)], 1.0
        weighting_time = watch.lap()
        _step(output_list, resolved_inputs, mine, scale, resolved, retain_graph)
    except BaseException:
        resolved_inputs.reshard()  # no backward ran: free what eager_inputs gathered
        raise
    times = StepTimes(gramian_time, weighting_time, watch.lap())
    weights = weights.detach()
    return (weights, BackwardInfo(detached(matrix), times)) if with_info else weights


def _step(outputs: list[Tensor], inputs: EagerInputs, weights: Tensor, scale: float,
          group: Group, retain_graph: bool) -> None:
    """``.grad`` of the weighted loss, reduced as the wrapper reduces it (averaging)."""
    if inputs.wrapper in ("ddp", "fsdp"):
        # the wrapper averages over its W ranks: W · (this rank's part) gives the sum
        factor = group.size * scale
        torch.autograd.backward(outputs, cotangents(outputs, weights * factor),
                                retain_graph=retain_graph)
        return
    grads = local_grads(outputs, inputs.tensors, weights, retain_graph)
    accumulate(inputs.tensors, sum_over_ranks(grads, group, scale))
