"""``torchgram.distributed.gramian``, ``aggregated_grad`` and ``explain``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import optree
import torch
from torch import Tensor

from torchgram._api.pipeline import Computation, compute, compute_then, wraps_user_function
from torchgram._api.step_times import StepTimes, Stopwatch
from torchgram._api.weights import call_weighting, check_weighting
from torchgram._core import _torch_compat, checks
from torchgram._core.composition import carries_forward_tangents
from torchgram._core.errors import output_changes_refused
from torchgram._core.functional import public_call
from torchgram._core.hooked_modules import puts_back_hooked_attributes
from torchgram._core.options import Options
from torchgram._core.pytree import DiffLeaves, leaves_of
from torchgram._core.sink import shape_block
from torchgram.backends.structured.payloads import payload_pullback
from torchgram.distributed._agreement import fail_together
from torchgram.distributed._data_parallel import Result, local_batch, run
from torchgram.distributed._group import Group, GroupLike, check_group, resolve_group
from torchgram.distributed._report import Exchange, LeafExchange
from torchgram.distributed._rows import local_to_global, shape_global
from torchgram.distributed._tensor_parallel import (
    dtensor_grads,
    has_dtensor_leaves,
    reduced_blocks,
    sharded_compute,
    sharded_pullback,
    sharded_value,
)

CrossRank = Literal["exact", "local"]

_GRAMIAN = "torchgram.distributed.gramian"
_AGGREGATED = "torchgram.distributed.aggregated_grad"
_EXPLAIN = "torchgram.distributed.explain"
_BACKENDS = ("auto", "structured", "jacobian")


def _validate(api: str, f: Callable[..., Any], argnums: int | Sequence[int], group: GroupLike,
              cross_rank: str, **options: Any) -> Options:
    validated = Options.validate(api, f, argnums, **options)
    checks.check_choice(api, "cross_rank", cross_rank, ("exact", "local"))
    check_group(api, group)
    if validated.backend not in _BACKENDS:
        checks.fail(api, f"backend to be one of {_BACKENDS} (the payloads of a "
                    "data-parallel call come from the structured pass)",
                    repr(validated.backend),
                    "Use backend='auto'; backend='jacobian' exchanges per-sample gradients "
                    "for every leaf.")
    return validated


def gramian(
    f: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    group: GroupLike = None,
    cross_rank: CrossRank = "exact",
    has_aux: bool = False,
    backend: str = "auto",
    chunk_size: int | None = None,
    batch_dim: int | None = None,
    in_dims: int | None | Sequence[Any] = 0,
    diagonal: bool = False,
    per_leaf: bool = False,
    memory_budget: int | None = None,
) -> Callable[..., Any]:
    """The Gramian of the whole batch when each rank holds part of it.

    Every rank of ``group`` calls the returned function with the same parameters and its
    own samples. Every rank gets the matrix ``torchgram.gramian`` (same options) would
    return on all ranks' samples concatenated in rank order along ``batch_dim`` —
    bit-identical on every rank. Without ``batch_dim``, the rows are every rank's outputs
    (flattened) one rank after the other, and ``G`` is ``[M, M]``.

    Nothing but what the blocks are made of travels: per layer, the smaller of its ghost
    factors (activations and output cotangents) and its per-sample gradients, gathered to
    one owner rank that forms its block; then one ``all_reduce`` of the ``M × M`` blocks
    (NOTE [data-parallel Gramian]). Inputs are never gathered and no rank recomputes
    another's samples. Ranks may hold different numbers of samples, or none.

    Parameters that are DTensors sharded over a 1-D mesh (tensor parallelism,
    ``parallelize_module``) get per-shard blocks summed over the mesh, replicated ones
    counted once (NOTE [tensor-parallel Gramian]); every rank of the mesh then passes the
    same inputs.

    Args:
        f: As for :func:`torchgram.gramian`; it must not communicate (NOTE [no collectives
            in f]) unless its parameters are DTensors.
        argnums: As for :func:`torchgram.gramian`.
        group: A ``ProcessGroup``, a 1-D ``DeviceMesh`` or a ``(mesh, dim name)`` pair
            (``None``: the default group; with DTensor parameters, their mesh).
        cross_rank: ``"exact"`` (default), or ``"local"``: each rank's own block only
            (its own samples' Gramian, no communication). ``"local"`` is what running a
            single-process library under DDP gives; it drops the blocks between ranks'
            samples, and with them guarantees such as UPGrad's (no conflict with any
            sample's gradient).
        has_aux: ``f`` returns ``(output, aux)``; returns ``(G, aux)`` with this rank's aux.
        backend: ``"auto"`` or ``"structured"`` (the structured pass), or ``"jacobian"``
            (per-sample gradients for every leaf).
        chunk_size: As for :func:`torchgram.gramian` (the local passes).
        batch_dim: As for :func:`torchgram.gramian`. The samples of different ranks must
            not interact: batch-norm in training mode raises an error naming the call.
        in_dims: As for :func:`torchgram.gramian`.
        diagonal: Only ``G[i, i]`` (no exchange: each rank's own, gathered).
        per_leaf: One block per leaf, in the structure of the differentiated argument(s).
        memory_budget: As for :func:`torchgram.gramian` (the local passes).

    Returns:
        A function of ``f``'s arguments returning ``G`` (``S + S`` for a tensor output of
        shape ``S`` over the whole batch with ``batch_dim``, else ``[M, M]``). Unlike
        :func:`torchgram.gramian`, ``G`` carries no autograd graph, and a call under
        ``torch.func`` transforms is refused: no gradient flows through the exchange.

    Example:
        >>> import torch, torchgram as tg
        >>> tg.distributed.gramian(lambda w, x: x @ w, batch_dim=0, group=None)
        ... # doctest: +ELLIPSIS
        <function <lambda> at ...>
    """
    options = _validate(_GRAMIAN, f, argnums, group, cross_rank, has_aux=has_aux,
                        backend=backend, chunk_size=chunk_size, batch_dim=batch_dim,
                        in_dims=in_dims, diagonal=diagonal, per_leaf=per_leaf,
                        memory_budget=memory_budget)

    @wraps_user_function(f)
    @public_call  # NOTE [inference mode], NOTE [the caller's function modes]
    @puts_back_hooked_attributes(options.api, f)  # NOTE [gradients outside the graph]
    def gramian_of_f(*args: Any, **kwargs: Any) -> Any:
        refuse_transforms(options.api)
        refuse_dual_arguments(options.api, args, kwargs)
        value, aux, _ = _gramian(options, f, args, kwargs, group, cross_rank)
        return (detached(value), aux) if has_aux else detached(value)

    gramian_of_f.__doc__ = (f"Gramian J Jᵀ of {checks.function_name(f)} over the samples of "
                            "every rank. Built by torchgram.distributed.gramian.")
    return gramian_of_f


def _gramian(options: Options, f: Callable[..., Any], args: tuple[Any, ...],
             kwargs: Mapping[str, Any], group: GroupLike,
             cross_rank: str) -> tuple[Any, Any, Exchange]:
    """``(G as returned, aux, exchange)``."""
    if has_dtensor_leaves(options, args):
        call = sharded_compute(options, f, args, kwargs, group)
        blocks = reduced_blocks(call, options.per_leaf)
        value = sharded_value(options, call, blocks)
        return value, call.computation.aux, _tp_report(call.group)
    if cross_rank == "local":
        resolved = resolve_group(options.api, group)
        computation = compute(options, f, args, kwargs)
        return computation.value(), computation.aux, _local_report(resolved)
    result = run(options, f, args, kwargs, resolve_group(options.api, group))
    return _value(options, result), result.local.aux, _named(result.exchange, result.local.diff,
                                                              args)


def refuse_transforms(api: str) -> None:
    """Refuse a call under ``torch.func`` transforms (before any collective, on every rank).

    The exchange is neither differentiable nor batchable: gradients through it would miss
    the blocks other ranks formed, so results carry no autograd graph (:func:`detached`).
    """
    active = _torch_compat.functorch_transforms()
    if active:
        checks.fail(api, "a call outside torch.func transforms",
                    f"a call under {' and '.join(active)}",
                    "The exchange between ranks is not differentiable and cannot be "
                    "batched: call it outside grad / vmap / jvp (differentiate "
                    "torchgram.gramian within one process instead).", RuntimeError)


def refuse_dual_arguments(api: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse arguments carrying ``forward_ad`` tangents (NOTE [composition]: ``G`` had none).

    By the tangents, not by the dual level, which is global to the process (another thread's
    ``jvp`` opens one: the second review).
    """
    if carries_forward_tangents((args, kwargs)):
        checks.fail(api, "arguments without torch.autograd.forward_ad tangents", "a tensor "
                    "made dual by make_dual (the ranks exchange detached pieces, which carry "
                    "no forward-mode tangent)", "Pass forward_ad.unpack_dual(t).primal; for "
                    "G's derivative, torch.func.jvp around torchgram.gramian on one process.",
                    NotImplementedError)


def detached(tree: Any) -> Any:
    """``tree`` with every tensor detached: no gradient flows through the exchange."""
    return optree.tree_map(lambda leaf: leaf.detach() if isinstance(leaf, Tensor) else leaf,
                           tree, none_is_leaf=True)


def _value(options: Options, result: Result) -> Any:
    blocks = result.blocks
    if not options.per_leaf:
        return blocks[0]
    diff = result.local.diff
    assert diff is not None
    return diff.unflatten_like_args(blocks, as_tuple=not options.single_argnum)


def _tp_report(group: Group) -> Exchange:
    return Exchange("tensor parallel", group.size, (), (), (0,) * group.size,
                    (0,) * group.size, 0)


def _local_report(group: Group) -> Exchange:
    return Exchange("local", group.size, (), (), (0,) * group.size, (0,) * group.size, 0)


def _named(exchange: Exchange, diff: DiffLeaves | None, args: tuple[Any, ...]) -> Exchange:
    if diff is None or not exchange.leaves:
        return exchange
    names = leaf_names(diff, args)
    leaves = tuple(LeafExchange(leaf.leaf, leaf.kind, leaf.owner, leaf.sent, names[leaf.leaf])
                   for leaf in exchange.leaves)
    return Exchange(exchange.mode, exchange.ranks, exchange.sizes, leaves, exchange.received,
                    exchange.sent, exchange.reduced)


def leaf_names(diff: DiffLeaves, args: tuple[Any, ...]) -> list[str]:
    """The path of every differentiated leaf (``"0.weight"``, ``"[1]['w']"``...)."""
    names = []
    for k, j in diff.positions:
        paths = optree.tree_paths(args[diff.argnums[k]])
        path = paths[j]
        names.append(".".join(str(p) for p in path) if path else f"arg{diff.argnums[k]}")
    return names


class Aggregation(NamedTuple):
    """What :func:`aggregated_grad` computed besides the update.

    Attributes:
        gramian: ``G`` of the whole batch, as :func:`gramian` returns it.
        weights: The weighting's ``w`` for the whole batch (computed on the group's first
            rank and broadcast), shaped like the whole batch's output (``[M]`` without
            ``batch_dim`` or for a pytree).
        output: ``f``'s output on this rank's samples (detached).
        aux: ``f``'s aux on this rank's samples with ``has_aux=True``, else ``None``.
        times: Where the step's time went: the Gramian, the weighting, ``Jᵀ w``.
        exchange: What travelled between the ranks.
    """

    gramian: Any
    weights: Tensor
    output: Any
    aux: Any
    times: StepTimes
    exchange: Exchange


def aggregated_grad(
    f: Callable[..., Any],
    weighting: Callable[[Tensor], Tensor],
    argnums: int | Sequence[int] = 0,
    *,
    group: GroupLike = None,
    cross_rank: CrossRank = "exact",
    has_aux: bool = False,
    backend: str = "auto",
    chunk_size: int | None = None,
    batch_dim: int | None = None,
    in_dims: int | None | Sequence[Any] = 0,
    per_leaf: bool = False,
    memory_budget: int | None = None,
) -> Callable[..., tuple[Any, Aggregation]]:
    """A Jacobian-descent step over every rank's samples: ``Jᵀ w`` with ``w = weighting(G)``.

    ``G`` is :func:`gramian`'s (the whole batch, the same on every rank); the weights are
    computed once, on the group's first rank, and broadcast, so that the solver's rounding
    never makes ranks disagree; each rank pulls its own rows' weights back through its own
    samples (from the factors it kept, no further pass) and one ``all_reduce`` sums them:
    ``update`` is ``Jᵀ w`` of the whole batch, identical on every rank and ready to apply
    like a replicated gradient. With DTensor parameters (tensor parallelism), ``update``
    holds DTensors placed like them.

    Args:
        f: As for :func:`gramian`.
        weighting: ``G [M, M] -> w [M]``, e.g. :func:`torchgram.weighting.upgrad`.
        argnums: As for :func:`gramian`.
        group: As for :func:`gramian`.
        cross_rank: ``"exact"``, or ``"local"``: each rank weights its own block, and the
            update is the average over ranks of their ``J_rᵀ w_r`` (what DDP averaging of a
            single-process step gives; loses UPGrad's guarantee, see :func:`gramian`).
        has_aux: As for :func:`gramian`.
        backend: As for :func:`gramian`.
        chunk_size: As for :func:`gramian`.
        batch_dim: As for :func:`gramian`.
        in_dims: As for :func:`gramian`.
        per_leaf: Report per-leaf blocks in the info (the weighting sees their sum).
        memory_budget: As for :func:`gramian`.

    Returns:
        A function of ``f``'s arguments returning ``(update, info)``: ``update`` in the
        structure of the differentiated argument(s), ``info`` an :class:`Aggregation`
        (tensors without autograd graph, as for :func:`gramian`).
    """
    options = _validate(_AGGREGATED, f, argnums, group, cross_rank, has_aux=has_aux,
                        backend=backend, chunk_size=chunk_size, batch_dim=batch_dim,
                        in_dims=in_dims, diagonal=False, per_leaf=per_leaf,
                        memory_budget=memory_budget)
    check_weighting(_AGGREGATED, weighting)

    @wraps_user_function(f)
    @public_call  # NOTE [inference mode], NOTE [the caller's function modes]
    @puts_back_hooked_attributes(options.api, f)  # NOTE [gradients outside the graph]
    def aggregated_grad_of_f(*args: Any, **kwargs: Any) -> tuple[Any, Aggregation]:
        refuse_transforms(options.api)
        refuse_dual_arguments(options.api, args, kwargs)
        update, info = step(*args, **kwargs)
        return detached(update), info._replace(gramian=detached(info.gramian),
                                               weights=info.weights.detach())

    def step(*args: Any, **kwargs: Any) -> tuple[Any, Aggregation]:
        watch = Stopwatch(_device(args))
        if has_dtensor_leaves(options, args):
            return _tp_step(options, f, weighting, args, kwargs, group, watch)
        resolved = resolve_group(options.api, group)
        if cross_rank == "local":
            return _local_step(options, f, weighting, args, kwargs, resolved, watch)
        result = run(options, f, args, kwargs, resolved)
        matrix = _matrix(result.blocks)
        gramian_time = watch.lap()
        weights = broadcast_weights(options.api, weighting, matrix, resolved)
        weighting_time = watch.lap()
        grads = _data_parallel_update(result, weights, resolved)
        times = StepTimes(gramian_time, weighting_time, watch.lap())
        diff = result.local.diff
        assert diff is not None
        update = diff.unflatten_like_args(grads, as_tuple=not options.single_argnum)
        shaped = shape_global(weights, result.agreement, diagonal=True)
        info = Aggregation(_value(options, result), shaped, _local_output(result), result.local.aux,
                           times, _named(result.exchange, diff, args))
        return update, info

    aggregated_grad_of_f.__doc__ = (
        f"Jᵀ w with w = {checks.function_name(weighting)}(J Jᵀ) over the samples of every "
        f"rank, J the Jacobian of {checks.function_name(f)}. Built by "
        "torchgram.distributed.aggregated_grad.")
    return aggregated_grad_of_f


def _matrix(blocks: list[Tensor]) -> Tensor:
    """The summed Gramian as ``[M, M]``."""
    matrix = blocks[0] if len(blocks) == 1 else torch.stack(blocks).sum(0)
    size = int(matrix.numel() ** 0.5)
    return matrix.reshape(size, size)


def broadcast_weights(api: str, weighting: Callable[[Tensor], Tensor], matrix: Tensor,
                      group: Group) -> Tensor:
    """``weighting(matrix)`` computed on the group's first rank, on every rank.

    A failure there is raised on every rank (the flag travels with the weights).
    """
    size = matrix.shape[0]
    buffer = torch.zeros(size + 1, dtype=matrix.dtype, device=matrix.device)
    error: BaseException | None = None
    if group.rank == 0:
        try:
            buffer[:size] = call_weighting(api, weighting, matrix)
        except Exception as caught:  # noqa: BLE001 -- raised below, on every rank
            error = caught
            kinds = [kind for kind in _WEIGHTING_ERRORS if isinstance(caught, kind)]
            buffer[size] = 1 + _WEIGHTING_ERRORS.index(kinds[0] if kinds else RuntimeError)
    buffer = group.broadcast(buffer, src=0)
    flag = int(buffer[size])
    if flag:
        if error is not None:
            raise error
        kind = _WEIGHTING_ERRORS[flag - 1]
        raise kind(f"{api}: the weighting failed on the group's first rank, which computes "
                   f"the weights for all ({kind.__name__}); see its message there.")
    return buffer[:size]


_WEIGHTING_ERRORS: list[type[Exception]] = [TypeError, ValueError, RuntimeError]


def _data_parallel_update(result: Result, weights: Tensor, group: Group) -> list[Tensor]:
    """``Jᵀ w`` of the whole batch: each rank's rows pulled back locally, then summed."""
    local = result.local
    diff = local.diff
    assert diff is not None
    leaves = diff.leaves
    numels = [leaf.numel() for leaf in leaves]
    dtype = weights.dtype
    for leaf in leaves:
        dtype = torch.promote_types(dtype, leaf.dtype)
    device = leaves[0].device
    flat = torch.zeros(sum(numels), dtype=dtype, device=device)
    payloads, problem = local.payloads, local.problem
    if payloads is not None and problem is not None:
        rows = local_to_global(result.agreement, group.rank, weights.device)
        if payloads.kind == "dense":
            local_weights = weights[rows].reshape(-1, 1)
        else:
            local_weights = weights[rows[problem.sample_major_index.T]]  # [K, B]
        pieces = []
        for payload, numel in zip(payloads.leaves, numels, strict=True):
            piece = payload_pullback(payload, local_weights, numel)
            pieces.append(flat.new_zeros(numel) if piece is None else piece.to(dtype))
        flat = torch.cat(pieces)
    flat = group.all_reduce(flat)
    return [piece.reshape(leaf.shape).to(leaf.dtype)
            for piece, leaf in zip(flat.split(numels), leaves, strict=True)]


def _local_output(result: Result) -> Any:
    problem = result.local.problem
    outputs = result.local.outputs
    if problem is None or outputs is None:
        return None
    return problem.unflatten_rows(outputs)


def _local_step(options: Options, f: Callable[..., Any],
                weighting: Callable[[Tensor], Tensor], args: tuple[Any, ...],
                kwargs: Mapping[str, Any], group: Group,
                watch: Stopwatch) -> tuple[Any, Aggregation]:
    """``cross_rank="local"``: each rank weights its own block; the updates are averaged."""
    def step(computation: Computation) -> tuple[Computation, Tensor, tuple[Tensor, ...],
                                                Any, float, float]:
        blocks = computation.blocks  # NOTE [evaluations after the backend]: before any
        matrix = blocks[0] if len(blocks) == 1 else torch.stack(blocks).sum(0)  # collective
        gramian_time = watch.lap()
        weights = call_weighting(options.api, weighting, matrix)
        weighting_time = watch.lap()
        grads = computation.pullback(weights)
        return computation, weights, grads, computation.output(), gramian_time, weighting_time

    error: BaseException | None = None  # NOTE [local steps fail together]
    computation: Computation | None = None
    try:
        diff, samples = local_batch(options, args, kwargs)
        grads: tuple[Tensor, ...] = tuple(torch.zeros_like(leaf) for leaf in diff.leaves)
        if samples != 0:
            computation, weights, grads, output, gramian_time, weighting_time = compute_then(
                options, f, args, kwargs, step, want_pullback=True)
            diff = computation.problem.diff
    except Exception as caught:  # noqa: BLE001 -- shared with every rank below
        error = caught
    fail_together(options.api, group, error)
    flat = group.all_reduce(torch.cat([g.reshape(-1) for g in grads])) / group.size
    pieces = flat.split([leaf.numel() for leaf in diff.leaves])
    update = diff.unflatten_like_args(
        [piece.reshape(leaf.shape).to(leaf.dtype) for piece, leaf in
         zip(pieces, diff.leaves, strict=True)], as_tuple=not options.single_argnum)
    if computation is None:  # no sample here: a zero update in the average
        return update, Aggregation(flat.new_zeros(0, 0), flat.new_zeros(0), None, None,
                                   StepTimes(0.0, 0.0, watch.lap()), _local_report(group))
    times = StepTimes(gramian_time, weighting_time, watch.lap())
    shaped = shape_block(computation.problem, weights, diagonal=True)
    return update, Aggregation(computation.value(), shaped, output,
                               computation.aux, times, _local_report(group))


# NOTE [local steps fail together]
# cross_rank="local" computes each rank's step without communication, then averages the
# updates with one all_reduce. A rank whose step raised (f failing there, a weighting refusing
# its block) left the others blocked in that all_reduce until the process group's timeout (30
# minutes by default; a helper's hunt, session 57). The ranks now gather each one's outcome
# first and every rank raises the first failing rank's error (its own where it failed), as
# the exact mode does at its agreement. A rank holding no sample contributes a zero update
# to the average (as DDP averages over every rank), with an empty Gramian and weights and no
# output; before, it raised "expected a non-empty batch" (and the others hung). The eager API
# (``torchgram.distributed.autograd``) likewise carries a rank's failed checks of its outputs
# (losses that do not require grad) to the exchange, exact or local, instead of raising
# before it (session 58: the other ranks waited in the exchange until gloo gave up).


def _tp_step(options: Options, f: Callable[..., Any], weighting: Callable[[Tensor], Tensor],
             args: tuple[Any, ...], kwargs: Mapping[str, Any], group: GroupLike,
             watch: Stopwatch) -> tuple[Any, Aggregation]:
    """Tensor parallel: weights from the reduced ``G``, the update as sharded DTensors."""
    call = sharded_compute(options, f, args, kwargs, group)
    blocks = reduced_blocks(call, options.per_leaf)
    matrix = blocks[0] if len(blocks) == 1 else torch.stack(blocks).sum(0)
    gramian_time = watch.lap()
    weights = broadcast_weights(options.api, weighting, matrix, call.group)
    weighting_time = watch.lap()
    # NOTE [evaluations after the backend]: the pullback and the output evaluate f again. A
    # rank cannot start the step afresh alone (G was reduced over the mesh), so a change met
    # there is the user's error, never torchgram's internal one.
    with output_changes_refused(options.api):
        grads = dtensor_grads(call, sharded_pullback(call, weights))
        times = StepTimes(gramian_time, weighting_time, watch.lap())
        output = call.computation.output()
    computation = call.computation
    update = call.diff.unflatten_like_args(grads, as_tuple=not options.single_argnum)
    shaped = shape_block(computation.problem, weights, diagonal=True)
    return update, Aggregation(sharded_value(options, call, blocks), shaped, output,
                               computation.aux, times, _tp_report(call.group))


def explain(
    f: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    group: GroupLike = None,
    has_aux: bool = False,
    backend: str = "auto",
    chunk_size: int | None = None,
    batch_dim: int | None = None,
    in_dims: int | None | Sequence[Any] = 0,
    diagonal: bool = False,
    per_leaf: bool = False,
    memory_budget: int | None = None,
) -> Callable[..., Exchange]:
    """What :func:`gramian` exchanges for a call: payload kind, owner and bytes per leaf.

    Runs the call (every rank of the group must call it) and returns an :class:`Exchange`
    instead of the Gramian; ``print`` it for a table.
    """
    options = _validate(_EXPLAIN, f, argnums, group, "exact", has_aux=has_aux,
                        backend=backend, chunk_size=chunk_size, batch_dim=batch_dim,
                        in_dims=in_dims, diagonal=diagonal, per_leaf=per_leaf,
                        memory_budget=memory_budget)

    @wraps_user_function(f)
    @public_call  # NOTE [inference mode], NOTE [the caller's function modes]
    @puts_back_hooked_attributes(options.api, f)  # NOTE [gradients outside the graph]
    def explain_f(*args: Any, **kwargs: Any) -> Exchange:
        refuse_transforms(options.api)
        refuse_dual_arguments(options.api, args, kwargs)
        return _gramian(options, f, args, kwargs, group, "exact")[2]

    return explain_f


def _device(args: tuple[Any, ...]) -> torch.device:
    for leaf in leaves_of(args):
        if isinstance(leaf, Tensor):
            return leaf.device
    return torch.device("cpu")
