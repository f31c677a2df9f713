"""``torchgram.autograd.gramian``: the Gramian of an autograd graph that already exists."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from torchgram._core import checks
from torchgram._core.sink import LeafBlocks
from torchgram.backends.graph import graph_gramian, plan_graph, release_graph

_API = "torchgram.autograd.gramian"


def gramian(
    outputs: Tensor | Iterable[Tensor],
    inputs: Tensor | Iterable[Tensor],
    *,
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

    Nothing of the graph is changed: no hook runs, no ``.grad`` is written, and with the
    default ``retain_graph=True`` the graph can be used afterwards (e.g. ``backward``).

    Args:
        outputs: A tensor, or a sequence of tensors, that require grad. Rows are their
            entries, in order, each flattened row-major.
        inputs: A tensor, or an iterable of tensors (``model.parameters()`` works), that
            require grad: leaves or intermediate (non-leaf) tensors of the graph. An input
            that the outputs do not depend on contributes a zero block.
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
        ``G``, with the outputs' dtype (promoted across them) and device. For a tensor
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
    checks.check_positive_int(_API, "chunk_size", chunk_size,
                               "chunk_size counts rows per vectorized node call, e.g. 32.")
    for name, flag in (("retain_graph", retain_graph), ("diagonal", diagonal),
                       ("per_input", per_input)):
        checks.check_bool(_API, name, flag)
    output_list = _tensors("outputs", outputs)
    input_list = _tensors("inputs", inputs)
    _check_outputs(output_list)
    _check_inputs(input_list)

    num_rows = sum(out.numel() for out in output_list)
    dtype = output_list[0].dtype
    for out in output_list[1:]:
        dtype = torch.promote_types(dtype, out.dtype)
    widest = dtype
    for tensor in input_list:
        widest = torch.promote_types(widest, tensor.real.dtype if tensor.is_complex()
                                     else tensor.dtype)
    blocks = LeafBlocks(len(input_list), per_leaf=per_input, diagonal=diagonal, dtype=widest)
    plan = plan_graph(output_list, input_list)
    if num_rows:
        graph_gramian(_API, output_list, input_list, blocks, chunk_size=chunk_size,
                      diagonal=diagonal, plan=plan)
    if not retain_graph:
        release_graph(output_list, plan)
    shape = output_list[0].shape if isinstance(outputs, Tensor) else (num_rows,)
    device = output_list[0].device
    results = [
        (torch.zeros((num_rows,) if diagonal else (num_rows, num_rows), dtype=dtype,
                     device=device) if block is None else block.to(dtype=dtype, device=device))
        .reshape(shape if diagonal else (*shape, *shape))
        for block in blocks.blocks()
    ]
    return tuple(results) if per_input else results[0]


def _tensors(name: str, value: Any) -> list[Tensor]:
    """``value`` as a non-empty list of tensors, or a message saying what was wrong."""
    if isinstance(value, Tensor):
        return [value]
    fix = (f"Pass a tensor or a list of tensors, e.g. {name}=list(model.parameters())."
           if name == "inputs" else f"Pass a tensor or a list of tensors as {name}.")
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        checks.fail(_API, f"{name} to be a tensor or a sequence of tensors",
                    f"{type(value).__name__} {value!r:.60}", fix, TypeError)
    tensors = list(value)
    if not tensors:
        checks.fail(_API, f"at least one tensor in {name}", "an empty sequence", fix)
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, Tensor):
            checks.fail(_API, f"{name} to be a tensor or a sequence of tensors",
                        f"{name}[{index}] of type {type(tensor).__name__}", fix, TypeError)
    return tensors


def _check_outputs(outputs: list[Tensor]) -> None:
    for index, out in enumerate(outputs):
        where = f"outputs[{index}] of shape {tuple(out.shape)}"
        if out.is_complex():
            checks.fail(_API, "real floating outputs", f"{where} with dtype {out.dtype}",
                        "The Gramian of a complex output is not defined here: pass "
                        "torch.view_as_real(out) to treat real and imaginary parts as rows.",
                        TypeError)
        if not out.requires_grad:
            checks.fail(_API, "outputs that require grad", f"{where} with requires_grad=False",
                        "Compute the outputs from tensors that require grad, outside "
                        "torch.no_grad(), and do not pass detached tensors.")


def _check_inputs(inputs: list[Tensor]) -> None:
    for index, tensor in enumerate(inputs):
        if not tensor.requires_grad:
            checks.fail(_API, "inputs that require grad",
                        f"inputs[{index}] of shape {tuple(tensor.shape)} with "
                        "requires_grad=False",
                        "Its Jacobian is not recorded in the graph. Drop it, e.g. "
                        "[p for p in model.parameters() if p.requires_grad].")
