"""One Gramian call through the pipeline: problem → backend → sink (DESIGN.md §5).

``gramian``, ``aggregated_grad`` and ``explain`` validate their :class:`~torchgram._core.
options.Options` when they are built and call :func:`compute` when they are called.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
from torch import Tensor

from torchgram._core import _torch_compat, functional
from torchgram._core.checks import fail
from torchgram._core.composition import graph_leaf, refuse_inside_taps
from torchgram._core.cross import CrossProblem, CrossResult
from torchgram._core.errors import (
    OutputChanged,
    output_changes_refused,
    torch_refusals,
    unseen_calls_refused,
)
from torchgram._core.hooked_modules import hooked_attributes_put_back
from torchgram._core.options import Options
from torchgram._core.problem import Problem, build_problem, forget_probe
from torchgram._core.pytree import detach_tree, leaves_of
from torchgram._core.result import NO_AUX, BackendResult, RunReport
from torchgram._core.sink import assemble, shape_block, to_backend_order, to_output_order
from torchgram._core.unseen import refuse_derivative
from torchgram.backends import get_backend
from torchgram.backends._registry import get_cross_backend


@dataclass(frozen=True)
class Computation:
    """One call's problem, the backend's result and the assembled blocks.

    Attributes:
        problem: The call's problem.
        result: What the backend returned.
        blocks: ``[m, m]`` (``[m]`` diagonal) in output order: one per leaf with
            ``per_leaf``, else one.
        aux: ``f``'s aux (detached) with ``has_aux``, else ``None``.
    """

    problem: Problem
    result: BackendResult
    blocks: list[Tensor]
    aux: Any

    def value(self, blocks: list[Tensor] | None = None, *, diagonal: bool | None = None) -> Any:
        """What the transform returns for ``blocks``: ``S + S`` shaped, per leaf or summed."""
        problem = self.problem
        blocks = self.blocks if blocks is None else blocks
        diagonal = problem.diagonal if diagonal is None else diagonal
        shaped = [shape_block(problem, block, diagonal=diagonal) for block in blocks]
        if not problem.per_leaf:
            return shaped[0]
        return problem.diff.unflatten_like_args(shaped,
                                                as_tuple=not problem.options.single_argnum)

    def output(self) -> Any:
        """``f``'s output (detached), from the backend's rows or one gradient-free forward."""
        problem = self.problem
        rows = self.result.rows
        if rows is None:
            with problem.draw.kept_across(), torch.no_grad():  # (after the call's finish)
                rows = problem.rows(problem.leaves)[0]
        else:
            rows = to_output_order(problem, self.result.row_order, rows, diagonal=True)
        return problem.unflatten_rows(rows.detach())

    def pullback(self, weights: Tensor) -> tuple[Tensor, ...]:
        """``Jᵀ w`` per leaf for weights ``[m]`` in output order (kept factors, or a vjp)."""
        problem = self.problem
        kept = self.result.pullback
        if kept is not None:
            return kept(to_backend_order(problem, self.result.row_order, weights))
        cotangent = weights.to(problem.output.dtype)
        with torch_refusals(problem.api, self.result.report.backend), \
                problem.draw.kept_across():  # after the call's finish, and the weighting's draws
            if not problem.composition.transforms:  # NOTE [draws under torch.func], NOTE
                grads = _plain_vjp(problem, cotangent)  # [old-style autograd.Functions]
            else:
                _, vjp_fn = functional.vjp(lambda *leaves: problem.rows(leaves)[0],
                                           *problem.leaves)
                grads = functional.with_grad(  # NOTE [backward under no_grad]
                    lambda: vjp_fn(cotangent))
        return tuple(grad.to(leaf.dtype) for grad, leaf in zip(grads, problem.leaves,
                                                               strict=True))


def _plain_vjp(problem: Problem, cotangent: Tensor) -> tuple[Tensor, ...]:
    """``Jᵀ cotangent`` by plain autograd through one evaluation of ``f``.

    A random ``f``'s update must see the draws of the plain call (NOTE [draws under
    torch.func]): ``torch.func.vjp``'s wrappers may give an op other strides, and dropout
    would then drop other entries.
    """
    def backward() -> tuple[Tensor, ...]:
        carriers = tuple(graph_leaf(leaf) for leaf in problem.leaves)
        rows = problem.rows(carriers)[0]
        if not rows.requires_grad:  # no row depends on a leaf
            return tuple(torch.zeros_like(leaf) for leaf in problem.leaves)
        # weights that require grad (a learned weighting): Jᵀw keeps their derivative, as
        # the kept pullbacks do (graph and ntvp dropped it, 0.78 off: session 67's hunt)
        return torch.autograd.grad(rows, carriers, cotangent, allow_unused=True,
                                   materialize_grads=True,
                                   create_graph=problem.composition.create_graph
                                   or cotangent.requires_grad)

    return functional.with_grad(backward)  # NOTE [backward under no_grad]


# NOTE [torch.compile]
# A function that calls a torchgram transform can be compiled: the call itself runs eagerly,
# as one graph break (torch.compiler.disable), and the code around it is compiled. Dynamo
# cannot trace the call's own machinery (optree treespecs made outside the graph, the probe
# and trace caches, TorchFunctionMode taps keyed by tensor identity, random-number state
# captured and restored), and every backend's eager path is the one tested against the
# oracle, so the answer is the same with and without compile, on every backend.
# fullgraph=True therefore raises at a torchgram call (dynamo's "skip" error): compile the
# code before and after it, or use mode="reduce-overhead" without fullgraph. The same holds
# for the eager API (tg.autograd.gramian / backward / explain), tg.ntk's kernels and a
# tg.autograd.record() block inside a compiled function, whose recording mode runs the
# block's calls eagerly (before session 60 dynamo traced into them: raw errors).

Fn = TypeVar("Fn", bound=Callable[..., Any])
T = TypeVar("T")


def outside_compile(fn: Fn) -> Fn:
    """``fn`` runs eagerly under ``torch.compile``, as a graph break (NOTE [torch.compile]).

    Disabled twice over: ``torch.compile`` of a disabled function compiles the function the
    disabling wrapped (``torch.compile(tg.gramian(f))``: dynamo traced the probe cache, torch's
    raw "unhashable type: 'list'"; session 63's hunt), so that function only calls the
    disabled ``fn``, where dynamo breaks the graph. Called from compiled code, the outer
    wrapper breaks it at once, before dynamo looks at the arguments (it read a non-leaf's
    ``.grad`` there, a warning).
    """
    disabled = torch.compiler.disable(fn)

    @functools.wraps(fn)
    def eager_call(*args: Any, **kwargs: Any) -> Any:
        return disabled(*args, **kwargs)

    return cast(Fn, torch.compiler.disable(eager_call))


_COMPILED_ATTRIBUTES = frozenset({"__wrapped__", "get_compiler_config", "aot_compile"})
"""What ``torch.compile`` sets on a compiled function besides ``_torchdynamo*`` (the second
review: the transform's ``__wrapped__`` became the plain ``f``; ``get_compiler_config`` made
compiling the transform of a compiled ``f`` raise "compile_wrapper already has" it)."""


def wraps_user_function(f: Callable[..., Any]) -> Callable[[Fn], Fn]:
    """``functools.wraps(f)``, without ``torch.compile``'s attributes of ``f``.

    ``functools.wraps`` copies ``f.__dict__``: of a ``torch.compile``'d ``f``, its
    ``_torchdynamo_orig_callable`` (the plain ``f``), which dynamo then inlined in place of the
    transform -- ``torch.compile(lambda w, x: tg.gramian(fc)(w, x))`` returned ``f``'s output,
    not ``G``, without a word (session 63's review).
    """
    def decorate(wrapper: Fn) -> Fn:
        functools.update_wrapper(wrapper, f, updated=())
        wrapper.__dict__.update({key: value for key, value in getattr(f, "__dict__", {}).items()
                                 if not (key.startswith(("_torchdynamo", "_is_torch_compile"))
                                         or key in _COMPILED_ATTRIBUTES)})
        return wrapper

    return decorate


def compute(options: Options, f: Callable[..., Any], args: tuple[Any, ...],
            kwargs: Mapping[str, Any], *, want_pullback: bool = False) -> Computation:
    """Build the call's problem, run the backend, assemble its blocks; compute aux if needed."""
    return compute_then(options, f, args, kwargs, _itself, want_pullback=want_pullback)


def _itself(computation: Computation) -> Computation:
    return computation


# NOTE [evaluations after the backend]
# OutputChanged means that a probe no longer describes f (NOTE [stale probes], NOTE [writes
# its probe did not see]): the call probes afresh and starts over, once. Evaluations of f
# after the backend's -- aux where the backend never evaluated the whole batch, the output
# and the vjp of Jᵀw where the backend kept no pullback (graph, ntvp) -- raised it outside that
# retry, and the internal error reached the user (aggregated_grad on graph and ntvp, a hunt
# after session 50). compute_then runs them inside the retry: a caller hands it what it does
# with the computation (weighting G, the pullback, the output), and all of it is done again
# after the fresh probe. The weighting runs again then, on the new G.


def compute_then(options: Options, f: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: Mapping[str, Any], then: Callable[[Computation], T], *,
                 want_pullback: bool = False) -> T:
    """``then`` of the call's :class:`Computation`, both inside the retry of a stale probe.

    NOTE [evaluations after the backend]: ``then`` may evaluate ``f`` again (a pullback, the
    output); where that raises ``OutputChanged``, the whole call starts afresh, once.
    """
    refuse_inside_taps(options.api)  # NOTE [composition]: nested in a structured call
    _refuse_dtensors(options, args)
    probe_with_grad = options.backend == "graph"
    # NOTE [tensors hooks set]
    with hooked_attributes_put_back(options.api, f, (*args, *kwargs.values())) as generators:
        problem = build_problem(options, f, args, kwargs, want_pullback=want_pullback,
                                probe_with_grad=probe_with_grad, generators=generators)
        try:
            return then(_computation(problem))
        except OutputChanged:  # a probe went stale: probe afresh, once
            problem.draw.rewind()  # the call starts afresh, from its own random state
            forget_probe(problem)
            problem = build_problem(options, f, args, kwargs, want_pullback=want_pullback,
                                    probe_with_grad=probe_with_grad, fresh=True,
                                    generators=generators)
            with output_changes_refused(options.api, problem.draw.rewind):
                return then(_computation(problem))


def _computation(problem: Problem) -> Computation:
    """Run the backend on ``problem``, compute aux if needed, assemble the blocks."""
    result = _run(problem)
    options = problem.options
    aux = None
    if options.has_aux:  # differentiable where G is (NOTE [composition]), else detached
        differentiable = problem.composition.differentiable
        aux = result.aux
        if aux is NO_AUX:  # the backend never evaluated the whole batch
            with torch.set_grad_enabled(differentiable and torch.is_grad_enabled()):
                aux = problem.call(problem.leaves)[1]
        if not differentiable:
            aux = detach_tree(aux)
    problem.draw.finish()
    blocks = assemble(problem, result)
    if problem.unseen_ops:  # NOTE [unseen calls]: G's value, not its derivative
        blocks = refused_derivatives(problem, blocks)
    return Computation(problem, result, blocks, aux)


def refused_derivatives(problem: Problem, values: list[Tensor]) -> list[Tensor]:
    """``values`` whose backward raises the refusal of ``problem``'s unseen calls.

    NOTE [unseen calls]: connected to every tensor of the call that requires grad.
    """
    refusal = str(unseen_calls_refused(problem.api, problem.unseen_ops,
                                       problem.composition.describe(), False))
    connected = [*problem.leaves, *leaves_of((problem.args, dict(problem.kwargs)))]
    return [refuse_derivative(value, refusal, connected) for value in values]


def _refuse_dtensors(options: Options, args: tuple[Any, ...]) -> None:
    """DTensor parameters hold a shard each: one process sees part of the Gramian only."""
    for num in options.argnums:
        if not -len(args) <= num < len(args):
            continue  # build_problem reports it
        for leaf in leaves_of(args[num]):
            if _torch_compat.is_dtensor(leaf):
                fail(options.api, "plain tensors as parameters",
                     f"a DTensor (placements {leaf.placements}) in argument {num}",
                     "A process holds one shard of a DTensor, and so only part of the "
                     "Gramian. Call torchgram.distributed.gramian / aggregated_grad on every "
                     "rank instead (tg.functionalize gives an FSDP2 model's whole "
                     "parameters).", TypeError)


def _run(problem: Problem) -> BackendResult:
    if problem.num_rows == 0:  # f returned no entries: every block is empty, nothing to run
        slots = len(problem.leaves) if problem.per_leaf else 1
        return BackendResult((None,) * slots, RunReport(problem.options.backend, "no rows"))
    try:
        return get_backend(problem.options.backend)(problem)
    except OutputChanged:  # the call starts afresh, from its own random state (NOTE [one draw])
        problem.draw.rewind()
        raise
    except BaseException:
        problem.draw.finish()
        raise


def compute_cross(problem: CrossProblem) -> CrossResult:
    """Run a kernel between two input sets on the options' backend (NOTE [cross kernels]).

    The blocks come back in the canonical layout; ``torchgram.ntk`` assembles them. Every
    side's random-number state is left where a plain call of ``f`` leaves it.
    """
    try:
        left = problem.left
        if left.num_rows == 0 or all(right is not None and right.num_rows == 0
                                     for right in problem.rights):
            # f returns no entries on one side (an empty input set): every block is empty
            return CrossResult(tuple(
                torch.zeros(problem.block_shape(index), dtype=left.compute_dtype,
                            device=left.output.device) for index in range(len(problem.rights))),
                RunReport(left.options.backend, "no rows"))
        return get_cross_backend(problem.left.options.backend)(problem)
    finally:
        for side in (problem.left, *problem.rights):
            if side is not None:
                side.draw.finish()
