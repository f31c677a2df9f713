"""The Gramian of an existing autograd graph: seeds, the frontier walk, one block per input.

Shared by ``torchgram.autograd.gramian`` (the imperative API) and ``backend="graph"`` (the
functional front, which runs ``f`` on leaves that require grad and then walks).

# NOTE [Gramian is not linear]
The walk propagates row-Jacobians, not Gramians, and forms a Gramian only at a target,
once its Jacobian is complete. Two reasons make anything cheaper wrong:

* **paths add up before the square.** A tensor reached by several paths (``a + a``, tied
  weights, a module called twice, a diamond) has ``J = Σ_p J_p``, and
  ``J Jᵀ = Σ_p J_p J_pᵀ + Σ_{p≠q} J_p J_qᵀ``: summing per-path Gramians drops the cross
  terms (for ``a + a`` it gives ``2 G`` instead of ``4 G``). Hence the dependency counts:
  a target is Grammed only when every path into it has delivered.
* **a node's pullback is not a function of the Gramian.** A node maps the row-Jacobian
  ``J`` at its output to ``J A`` at its input (``A`` its local Jacobian), whose Gramian is
  ``J A Aᵀ Jᵀ``. Two Jacobians with the same ``J Jᵀ`` (``[1, 0]`` and ``[0, 1]``) give
  different results as soon as ``A Aᵀ`` weighs coordinates differently, so ``J Jᵀ`` cannot be
  pushed through the node in place of ``J``.

The Jacobian is linear in the cotangents, the Gramian is quadratic: only the former can be
propagated (and summed at joins); the square is taken last.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from torchgram._core import _torch_compat
from torchgram._core.checks import fail
from torchgram._core.errors import (
    IN_PLACE_FIX,
    SELECTIVE_CHECKPOINT_EXPECTED,
    SELECTIVE_CHECKPOINT_GOT,
    in_place_what,
    selective_checkpoint_refused,
)
from torchgram._core.result import RunReport
from torchgram._core.sink import LeafBlocks
from torchgram.backends.graph.nodes import Edge, NodeCaller
from torchgram.backends.graph.walk import WalkPlan


def plan_graph(outputs: Sequence[Tensor], inputs: Sequence[Tensor]) -> WalkPlan:
    """The walk from ``outputs`` (all requiring grad) to ``inputs`` (leaves or not)."""
    roots = [_torch_compat.gradient_edge(out).node for out in outputs]
    return WalkPlan(roots, [input_edge(tensor) for tensor in inputs])


def input_edge(tensor: Tensor) -> Edge:
    """The slot whose cotangent is ``tensor``'s gradient.

    That is its ``grad_fn`` at its ``output_nr``, or its ``AccumulateGrad`` for a leaf
    (``get_gradient_edge`` handles both).
    """
    edge = _torch_compat.gradient_edge(tensor)
    return edge.node, edge.output_nr


def graph_gramian(api: str, outputs: Sequence[Tensor], inputs: Sequence[Tensor],
                  blocks: LeafBlocks, *, chunk_size: int | None, diagonal: bool,
                  plan: WalkPlan | None = None, report: RunReport | None = None,
                  create_graph: bool = False, backend: str | None = None) -> WalkPlan:
    """Add ``J_i J_iᵀ`` (or its diagonal) of every input ``i`` to ``blocks`` (leaf ``i``).

    Rows are the outputs' entries, in order, each flattened row-major. Every output must
    require grad; an input no output reaches contributes nothing (a zero block).

    Args:
        api: The public API, for error messages.
        outputs: The tensors whose entries are the Jacobian's rows.
        inputs: The tensors whose entries are its columns.
        blocks: Receives one contribution per input (index = position in ``inputs``).
        chunk_size: Rows per vectorized node call. With ``diagonal=True`` the whole walk runs
            once per chunk of rows, so the live frontier holds only ``chunk_size`` rows.
        diagonal: Add ``[m]`` squared row norms instead of ``[m, m]`` blocks.
        plan: A plan already made for these outputs and inputs.
        report: Receives the peak size of the frontier.
        create_graph: Call the nodes under grad mode, as a backward with
            ``create_graph=True`` does: the blocks carry the autograd graph.
        backend: The functional backend walking ``f``'s graph, if one is: what torch refuses
            to walk is then its refusal (:func:`freed_graph_is_clear`).

    Returns:
        The plan, for a caller that releases the graph afterwards.
    """
    plan = plan_graph(outputs, inputs) if plan is None else plan
    _check_no_reentrant_checkpoint(api, plan)
    num_rows = sum(out.numel() for out in outputs)
    by_edge: dict[Edge, list[int]] = {}
    for index, tensor in enumerate(inputs):
        by_edge.setdefault(input_edge(tensor), []).append(index)
    caller = NodeCaller(chunk_size)
    step = chunk_size if diagonal and chunk_size is not None else max(num_rows, 1)
    for start in range(0, num_rows, step):
        stop = min(start + step, num_rows)

        def on_target(edge: Edge, jacobian: Tensor | None, start: int = start) -> None:
            if jacobian is None:
                return  # not reached: a zero block
            flat = real_columns(jacobian.reshape(jacobian.shape[0], -1))
            if blocks.dtype is not None:  # Grams in the call's widest dtype
                flat = flat.to(blocks.dtype)
            for index in by_edge[edge]:
                blocks.add(index, _gram(flat, diagonal, start, num_rows))

        with freed_graph_is_clear(api, backend), torch.set_grad_enabled(create_graph):
            peak = plan.run(_seeds(outputs, start, stop), on_target, caller)
        if report is not None:
            report.peak_frontier = max(report.peak_frontier, peak)
            report.looped_nodes = dict(caller.vmap_failures)
    return plan


@contextlib.contextmanager
def freed_graph_is_clear(api: str, backend: str | None = None) -> Iterator[None]:
    """A walk over a graph torch refuses to go back through raises a clear error, not torch's.

    Its saved tensors freed by an earlier backward, or modified in place after they were
    saved (NOTE [in-place modifications]), or handed out to one backward pass only (selective
    activation checkpointing: torch's raw "Trying to backward an extra time", session 60's
    hunt; for a functional ``backend`` a refusal naming structured, which goes through ``f``'s
    graph once).
    """
    try:
        yield
    except RuntimeError as error:
        if _torch_compat.is_selective_checkpoint_error(error):
            if backend is not None:
                raise selective_checkpoint_refused(api, backend, ("structured",)) from error
            fail(api, SELECTIVE_CHECKPOINT_EXPECTED,
                 f"{SELECTIVE_CHECKPOINT_GOT} (this graph is spent now)",
                 "Checkpoint without a context_fn (use_reentrant=False), or compute the "
                 "Gramian of a forward without selective checkpointing.", RuntimeError)
        if _torch_compat.is_donated_buffers_error(error):  # session 60's hunt: raw before
            fail(api, "a graph whose backward can run more than once",
                 "a torch.compile'd region whose compiled backward frees its saved buffers "
                 "(donated buffers, aot backends: one backward pass, without retain_graph)",
                 "Set torch._functorch.config.donated_buffer = False before the model is "
                 "compiled, or use the functional tg.gramian(f), which compiles nothing.",
                 RuntimeError)
        if _torch_compat.is_in_place_error(error):
            fail(api, "a graph whose saved tensors are as they were saved (torch refuses a "
                 "backward through one modified in place since)", in_place_what(error),
                 IN_PLACE_FIX, ValueError)
        if not _torch_compat.is_freed_graph_error(error):
            raise
        fail(api, "a graph whose saved tensors are still alive",
             "a graph already freed by an earlier backward pass or autograd.grad call",
             "Pass retain_graph=True to that earlier call, or compute the Gramian first "
             "and then call backward.", RuntimeError)


def graph_jacobians(api: str, outputs: Sequence[Tensor], inputs: Sequence[Tensor], *,
                    chunk_size: int | None) -> list[Tensor | None]:
    """Every input's row-Jacobian ``[m, numel]`` from one walk (``None``: not reached).

    The columns are the input's entries in row-major order (a complex input: real and
    imaginary parts interleaved), so that Jacobians of the same input made by different
    processes line up column by column (``torchgram.distributed.autograd``).
    """
    plan = plan_graph(outputs, inputs)
    _check_no_reentrant_checkpoint(api, plan)
    num_rows = sum(out.numel() for out in outputs)
    by_edge: dict[Edge, list[int]] = {}
    for index, tensor in enumerate(inputs):
        by_edge.setdefault(input_edge(tensor), []).append(index)
    found: list[Tensor | None] = [None] * len(inputs)

    def on_target(edge: Edge, jacobian: Tensor | None) -> None:
        if jacobian is None:
            return
        flat = real_columns(jacobian.reshape(jacobian.shape[0], -1))
        for index in by_edge[edge]:
            found[index] = flat

    if num_rows:
        with freed_graph_is_clear(api), torch.no_grad():
            plan.run(_seeds(outputs, 0, num_rows), on_target, NodeCaller(chunk_size))
    return found


def _check_no_reentrant_checkpoint(api: str, plan: WalkPlan) -> None:
    """Refuse graphs with a reentrant checkpoint: its parameters are not in the graph.

    ``torch.utils.checkpoint(..., use_reentrant=True)`` records one custom Function whose
    backward re-runs the forward and calls autograd on that hidden graph, accumulating into
    ``.grad``: the parameters inside have no edge here (they would get zero blocks) and
    calling the node would write their ``.grad``.
    """
    for node in plan.children:
        if _torch_compat.is_reentrant_checkpoint(node):
            fail(api, "a graph without reentrant checkpoints",
                 "a torch.utils.checkpoint(..., use_reentrant=True) region, whose parameters "
                 "are hidden from the graph",
                 "Use torch.utils.checkpoint(..., use_reentrant=False), which this walk "
                 "supports.")


def real_columns(flat: Tensor) -> Tensor:
    """Rows ``[c, n]`` of a Jacobian with real columns: a complex entry's parts are two.

    A lazily conjugated tensor is resolved first (``view_as_real`` refused it, session 60's
    hunt).

    Example:
        >>> real_columns(torch.tensor([[1 + 2j, 3 - 1j]]).conj())
        tensor([[ 1., -2.,  3.,  1.]])
    """
    if not flat.is_complex():
        return flat
    return torch.view_as_real(flat.resolve_conj()).reshape(flat.shape[0], -1)


def _gram(flat: Tensor, diagonal: bool, start: int, num_rows: int) -> Tensor:
    if not diagonal:
        return flat @ flat.T
    squares = flat.new_zeros(num_rows)
    squares[start:start + flat.shape[0]] = flat.square().sum(dim=1)
    return squares


def _seeds(outputs: Sequence[Tensor], start: int, stop: int) -> list[tuple[Edge, Tensor]]:
    """Row-Jacobians of each output w.r.t. itself, restricted to rows ``start..stop-1``."""
    seeds = []
    offset = 0
    for out in outputs:
        numel = out.numel()
        first, last = max(start, offset), min(stop, offset + numel)
        if first < last:
            seed = out.new_zeros(stop - start, numel)
            rows = torch.arange(first - start, last - start, device=out.device)
            seed[rows, rows + (start - offset)] = 1
            edge = _torch_compat.gradient_edge(out)
            seeds.append(((edge.node, edge.output_nr), seed.reshape(stop - start, *out.shape)))
        offset += numel
    return seeds
