"""``torchgram.autograd.gramian``: the Gramian of an autograd graph that already exists."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from torchgram._api.pipeline import outside_compile
from torchgram._core import _torch_compat, checks
from torchgram._core.errors import derivative_faults_refused
from torchgram._core.functional import public_call
from torchgram._core.result import RunReport
from torchgram._core.running_stats import RecomputedUpdatesUndone
from torchgram._core.scratch import scratch_scope
from torchgram._core.side_gradients import gradients_outside_the_graph_refused
from torchgram._core.sink import LeafBlocks
from torchgram.backends.eager.record import paused

if TYPE_CHECKING:
    from torchgram.backends.eager.gramian import EagerResult

_API = "torchgram.autograd.gramian"
CHUNK_ROWS_HINT = "chunk_size counts rows per vectorized node call, e.g. 32."
"""What ``chunk_size`` means to the eager APIs (the hint of their errors)."""


@outside_compile  # NOTE [torch.compile]: dynamo traced into the walk (raw errors)
@public_call  # NOTE [inference mode], NOTE [the caller's function modes]
def gramian(
    outputs: Tensor | Iterable[Tensor],
    inputs: Tensor | Iterable[Tensor],
    *,
    batch_dim: int | None = None,
    chunk_size: int | None = None,
    retain_graph: bool = True,
    diagonal: bool = False,
    per_input: bool = False,
) -> Tensor | tuple[Tensor, ...]:
    """Gramian ``G = J Jᵀ`` of the Jacobian of ``outputs`` w.r.t. ``inputs``, from their graph.

    Like :func:`torch.autograd.grad`, this works on the autograd graph recorded by ordinary
    eager code: ``J``'s rows are the entries of ``outputs``, its columns the entries of
    ``inputs``, and ``G[i, j]`` is the inner product of the gradients of entries ``i`` and
    ``j`` (e.g. of per-sample losses). The graph is walked from the outputs to the inputs,
    pushing row-Jacobians through its nodes in topological order (each node under
    ``torch.func.vmap`` over the rows); an input's block ``J_i J_iᵀ`` is formed as soon as
    its Jacobian is complete, and every Jacobian is freed once consumed, so the memory is
    that of the live frontier, not of the whole ``[m, P]`` Jacobian.

    **Fast: record the forward.** When the outputs were computed inside
    ``with tg.autograd.record():`` (:func:`torchgram.autograd.record`), the parameters used
    by the layers the structured rules recognise (linear, matmul, conv, embedding,
    layer/group norm, self-attention) get their blocks from the cotangents at those layers'
    outputs and the recorded activations, like ``tg.gramian``'s structured backend: with
    ``batch_dim``, one backward serves every sample. Other inputs are walked.

    Nothing of the graph is changed and no ``.grad`` is written; with the default
    ``retain_graph=True`` the graph can be used afterwards (e.g. ``backward``). (With
    ``batch_dim``, the probes that locate the samples on a graph signature's first call hook
    its selection nodes for their own pass and remove the hooks right after: NOTE [opened
    selections].) The walk runs
    no hook; a recorded call's pass is one ``torch.autograd.grad`` when the graph has no hook
    torchgram can see (NOTE [eager taps]). torchgram cannot see the hooks added to the
    recorded graph *after* the ``record()`` block (``Tensor.register_hook``, ``retain_grad``,
    ``grad_fn.register_hook``): like in any ``torch.autograd.grad``, they run during those
    passes, and a tensor that retains its grad receives one. Add them inside the block (the
    pass is then walked, running none) or do not record.

    Args:
        outputs: A tensor, or a sequence of tensors, that require grad. Rows are their
            entries, in order, each flattened row-major.
        inputs: A tensor, or an iterable of tensors (``model.parameters()`` works), that
            require grad: leaves or intermediate (non-leaf) tensors of the graph. An input
            that the outputs do not depend on contributes a zero block.
        batch_dim: The outputs' dimension that indexes independent samples: entry ``b``
            along it depends only on sample ``b`` of the data, as for per-sample losses
            (``batch_dim=0`` for losses of shape ``[B]``). Each pass then serves every
            sample; the result is the same matrix. Samples that interact (batch-norm in
            training mode, ...) are detected where torchgram can see it, and the rows of the
            whole batch are used instead (the exact Gramian of the code as run).
        chunk_size: Rows per vectorized node call (``None``: all rows at once; ``1``: a plain
            loop). With ``diagonal=True`` the whole walk runs once per chunk of rows, which
            also bounds the memory of the frontier to ``chunk_size`` rows.
        retain_graph: ``False`` frees the graph's saved tensors afterwards, as
            ``torch.autograd.grad`` does; this runs one autograd pass with zero cotangents,
            and so the graph's hooks (NOTE [releasing the graph] in
            ``torchgram.backends.graph.release``).
        diagonal: Return only ``G[i, i]``, the squared gradient norm of each entry.
        per_input: Return one block ``J_i J_iᵀ`` per input, as a tuple (their sum is ``G``).

    Returns:
        ``G``, with the outputs' dtype (promoted across them) and device: under
        ``torch.autocast``, float32 losses give a float32 ``G`` whose entries carry the round-off
        of the lower-precision activations and cotangents the forward saved. For a tensor
        ``outputs`` of shape ``S``, ``G`` has shape ``S + S`` (``S`` with ``diagonal=True``);
        for a sequence of tensors, ``[m, m]`` (``[m]``) over their ``m`` entries. With
        ``per_input=True``, a tuple of such tensors, one per input. A complex input counts
        its real and imaginary parts as two real entries.

    Raises:
        TypeError: If ``outputs`` or ``inputs`` are not tensors, or an option has the wrong
            type.
        ValueError: If an output or an input does not require grad, or an option is out of
            range.
        RuntimeError: If the graph was already freed by an earlier backward pass.

    Example:
        >>> import torch, torchgram as tg
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
        ...                             torch.nn.Linear(8, 3))
        >>> x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
        >>> losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        >>> G = tg.autograd.gramian(losses, list(model.parameters()))  # [6, 6]
        >>> G.shape
        torch.Size([6, 6])
        >>> tg.autograd.gramian(losses, model[0].weight, diagonal=True).shape
        torch.Size([6])
        >>> weights = torch.ones(6) / 6  # e.g. from a Gramian-based weighting of G
        >>> losses.backward(weights)  # the graph is still usable
    """
    with paused(), scratch_scope():  # inside a record() block our calls are not recorded;
        # NOTE [scratch memory]
        call = prepare(_API, outputs, inputs, batch_dim=batch_dim, chunk_size=chunk_size,
                       retain_graph=retain_graph, diagonal=diagonal, per_input=per_input)
        return call.run().value


@dataclass
class Call:
    """One validated imperative call (shared by ``gramian``, ``backward`` and ``explain``)."""

    api: str
    outputs: list[Tensor]
    inputs: list[Tensor]
    as_tensor: bool
    batch_dim: int | None
    chunk_size: int | None
    retain_graph: bool
    diagonal: bool
    per_input: bool

    @property
    def num_rows(self) -> int:
        """``m``."""
        return sum(out.numel() for out in self.outputs)

    def run(self, *, want_pullback: bool = False) -> Outcome:
        """Compute the Gramian (NOTE [imperative Gramian])."""
        output_list, input_list = self.outputs, self.inputs
        num_rows = self.num_rows
        dtype = output_list[0].dtype
        for out in output_list[1:]:
            dtype = torch.promote_types(dtype, out.dtype)
        widest = dtype
        for tensor in input_list:
            widest = torch.promote_types(widest, tensor.real.dtype if tensor.is_complex()
                                         else tensor.dtype)
        blocks = LeafBlocks(len(input_list), per_leaf=self.per_input, diagonal=self.diagonal,
                            dtype=widest)
        with (gradients_outside_the_graph_refused(self.api, input_list),  # NOTE [gradients
              _recomputation_frozen(output_list)):  # outside the graph]
            result = self._blocks(output_list, input_list, blocks, num_rows, want_pullback)
        shape = output_list[0].shape if self.as_tensor else (num_rows,)
        diagonal = self.diagonal
        device = output_list[0].device
        results = [
            (torch.zeros((num_rows,) if diagonal else (num_rows, num_rows), dtype=dtype,
                         device=device) if block is None
             else block.to(dtype=dtype, device=device))
            .reshape(shape if diagonal else (*shape, *shape))
            for block in blocks.blocks()
        ]
        return Outcome(tuple(results) if self.per_input else results[0], result)

    def _blocks(self, output_list: list[Tensor], input_list: list[Tensor], blocks: LeafBlocks,
                num_rows: int, want_pullback: bool) -> EagerResult:
        """Fill ``blocks``; what the engine reported."""
        from torchgram.backends.eager.gramian import EagerResult, eager_gramian
        from torchgram.backends.graph import plan_graph, release_graph

        if num_rows:
            try:
                with derivative_faults_refused(self.api):  # what the walk found wrong
                    result = eager_gramian(self.api, output_list, input_list, blocks,
                                           batch_dim=self.batch_dim,
                                           chunk_size=self.chunk_size, diagonal=self.diagonal,
                                           retain_graph=self.retain_graph,
                                           want_pullback=want_pullback)
            except RuntimeError as error:  # NOTE [sparse tensors in f]
                sparse = [i for i, t in enumerate(input_list) if t.layout != torch.strided]
                if not sparse or not _torch_compat.is_sparse_gradient_error(error):
                    raise
                checks.fail(self.api, "inputs the graph walk can view (the strided layout)",
                            f"inputs{sparse} in a sparse layout, reached through the graph",
                            "Run the forward under tg.autograd.record() (its rules take "
                            "sparse parameters), or pass dense ones (p.to_dense()).")
        else:
            result = EagerResult(RunReport("autograd", "no rows"))
            if not self.retain_graph and not want_pullback:  # else the caller's backward
                release_graph(output_list, plan_graph(output_list, input_list))  # frees it
        return result


@dataclass
class Outcome:
    """A call's Gramian(s) and what the engine reported."""

    value: Tensor | tuple[Tensor, ...]
    result: EagerResult


# NOTE [recomputed running statistics]
# A non-reentrant torch.utils.checkpoint region recomputes its forward whenever a saved tensor
# of it is unpacked: once in a backward, but many times in torchgram's passes (the engine's
# chunks, the walk's calls of each node, the release pass), and a batch norm in training mode
# in the region updates its module's running statistics at each: a hunt after session 55 saw
# num_batches_tracked at 9 to 23 after one call where a plain backward leaves 2, and
# running_mean moved as far (G was right). Where a batch norm sits below the outputs in such
# a region (_torch_compat.recomputes_batch_norm: its saved input carries the checkpoint's
# unpack hook; instance norms run one), the passes run under RecomputedUpdatesUndone
# (running_stats.py): a dispatch mode (a torch-function mode is off inside the engine's node
# calls, where the engine's passes recompute: measured) that lets each recomputation run as
# torch runs it and writes back, at the end, whatever the recomputations wrote into tensors
# made before them (the statistics, the counter, an instance norm's statistics copied back
# through an alias). tg.autograd.gramian leaves them as the user's forward left them;
# tg.autograd.backward's last pass, where it is a plain backward (the walk; a recording that
# does not cover every parameter), recomputes once as torch's does, and Jᵀw from a
# recording's factors recomputes nothing. Other graphs pay nothing (the scan: 11 us for the
# benchmark MLP's graph, 59 us for the transformer's); these pay a Python dispatch per aten
# call of the passes: a 4-block checkpointed batch-norm CNN's per-sample Gramian 52-60 ms ->
# 94 ms.


def _recomputation_frozen(outputs: list[Tensor]) -> contextlib.AbstractContextManager[Any]:
    """NOTE [recomputed running statistics]."""
    if not _torch_compat.recomputes_batch_norm(outputs):
        return contextlib.nullcontext()
    return RecomputedUpdatesUndone()


def prepare(api: str, outputs: Any, inputs: Any, *, batch_dim: Any, chunk_size: Any,
            retain_graph: Any, diagonal: Any, per_input: Any,
            distinct_inputs: bool = False) -> Call:
    """Validate an imperative call's arguments (errors name ``api``).

    ``distinct_inputs``: refuse a tensor listed twice in ``inputs`` (``backward``, whose
    ``.grad`` cannot take its two blocks).
    """
    chunk_size = checks.positive_int(api, "chunk_size", chunk_size, CHUNK_ROWS_HINT)
    for name, flag in (("retain_graph", retain_graph), ("diagonal", diagonal),
                       ("per_input", per_input)):
        checks.check_bool(api, name, flag)
    checks.check_batch_dim(api, batch_dim)
    output_list = _tensors(api, "outputs", outputs)
    input_list = _tensors(api, "inputs", inputs)
    _check_outputs(api, output_list)
    _check_inputs(api, input_list)
    if distinct_inputs:
        check_distinct(api, input_list)
    if batch_dim is not None:
        _check_batch(api, output_list, batch_dim)
    return Call(api, output_list, input_list, isinstance(outputs, Tensor), batch_dim,
                chunk_size, retain_graph, diagonal, per_input)


def _check_batch(api: str, outputs: list[Tensor], batch_dim: int) -> None:
    sizes = []
    for index, out in enumerate(outputs):
        if not -out.dim() <= batch_dim < out.dim():
            checks.fail(api, f"batch_dim within the dims of every output (-{out.dim()} to "
                        f"{out.dim() - 1} for outputs[{index}])",
                        f"batch_dim={batch_dim} for outputs[{index}] of shape "
                        f"{tuple(out.shape)}",
                        "Pass the dimension of the outputs that indexes the samples, e.g. "
                        "batch_dim=0 for per-sample losses of shape [B].")
        sizes.append(out.shape[batch_dim])
    if len(set(sizes)) > 1:
        checks.fail(api, "the same number of samples along batch_dim in every output",
                    f"sizes {sizes} along dim {batch_dim}",
                    "Pass outputs that all hold the same samples, or batch_dim=None.")


def _tensors(api: str, name: str, value: Any) -> list[Tensor]:
    """``value`` as a non-empty list of tensors, or a message saying what was wrong."""
    if isinstance(value, Tensor):
        return [value]
    fix = (f"Pass a tensor or a list of tensors, e.g. {name}=list(model.parameters())."
           if name == "inputs" else f"Pass a tensor or a list of tensors as {name}.")
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        checks.fail(api, f"{name} to be a tensor or a sequence of tensors",
                    f"{type(value).__name__} {value!r:.60}", fix, TypeError)
    tensors = list(value)
    if not tensors:
        checks.fail(api, f"at least one tensor in {name}", "an empty sequence", fix)
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, Tensor):
            checks.fail(api, f"{name} to be a tensor or a sequence of tensors",
                        f"{name}[{index}] of type {type(tensor).__name__}", fix, TypeError)
    return tensors


def _check_outputs(api: str, outputs: list[Tensor]) -> None:
    checks.check_not_meta(api, outputs, "outputs")
    for index, out in enumerate(outputs):
        where = f"outputs[{index}] of shape {tuple(out.shape)}"
        if out.layout != torch.strided:
            checks.fail(api, "dense outputs (the strided layout)",
                        f"{where} in the layout {out.layout}",
                        "Pass out.to_dense(): autograd differentiates through it, and the "
                        "Gramian is the same.", TypeError)
        if out.is_complex():
            checks.fail(api, "real floating outputs", f"{where} with dtype {out.dtype}",
                        "The Gramian of a complex output is not defined here: pass "
                        "torch.view_as_real(out) to treat real and imaginary parts as rows.",
                        TypeError)
        if not out.requires_grad:
            checks.fail(api, "outputs that require grad", f"{where} with requires_grad=False",
                        "Compute the outputs from tensors that require grad, outside "
                        "torch.no_grad() and torch.inference_mode(), and do not pass "
                        "detached tensors.")


def check_distinct(api: str, inputs: Sequence[Tensor]) -> None:
    """Refuse a tensor listed twice in a ``backward``'s ``inputs``.

    ``G`` would count its Jacobian twice (a block per entry, as ``gramian`` gives), while
    ``.grad`` receives ``Jᵀw`` once, as torch's ``backward`` writes it (session 62's hunt:
    weights and update 0.16-0.5 off, without a word).
    """
    first_index: dict[int, int] = {}
    for index, tensor in enumerate(inputs):
        first = first_index.setdefault(id(tensor), index)
        if first != index:
            checks.fail(api, "inputs without duplicates",
                        f"the same tensor at inputs[{first}] and inputs[{index}] (shape "
                        f"{tuple(tensor.shape)})",
                        "Pass each tensor once (list(model.parameters()) lists a tied "
                        "parameter once): its Jacobian would count twice in the Gramian "
                        "that weights the step, but its .grad receives Jᵀw once.")


def _check_inputs(api: str, inputs: list[Tensor]) -> None:
    for index, tensor in enumerate(inputs):
        if _torch_compat.is_dtensor(tensor):
            checks.fail(api, "inputs that are the graph's own tensors",
                        f"inputs[{index}], a DTensor (placements "
                        f"{getattr(tensor, 'placements', None)})",
                        "A DTensor parameter holds one shard: an FSDP2 module's graph "
                        "uses the whole parameters FSDP all-gathers (a zero block here), "
                        "a tensor-parallel one only this rank's part. Use "
                        "torchgram.distributed.autograd.gramian / backward(losses, module, "
                        "...) on every rank.", TypeError)
        if not tensor.requires_grad:
            checks.fail(api, "inputs that require grad",
                        f"inputs[{index}] of shape {tuple(tensor.shape)} with "
                        "requires_grad=False",
                        "Its Jacobian is not recorded in the graph. Drop it, e.g. "
                        "[p for p in model.parameters() if p.requires_grad].")
        if torch.nn.parameter.is_lazy(tensor):  # NOTE [lazy modules]
            checks.fail(api, "initialised inputs", f"inputs[{index}], an uninitialised "
                        "parameter of a lazy module (nn.LazyLinear, ...)",
                        "Run the module once (module(x)) before taking its parameters.")
        if tensor.dtype.itemsize == 1:  # float8: torch promotes it with no other dtype
            checks.fail(api, "inputs of 16 bits or more", f"inputs[{index}] of shape "
                        f"{tuple(tensor.shape)} with dtype {tensor.dtype}",
                        "Differentiate a wider copy (p.to(torch.bfloat16)) that the forward "
                        "casts to float8.", TypeError)
