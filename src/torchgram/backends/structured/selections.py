"""Selections opened for the derivative checks and the probes: paths through closed branches.

NOTE [opened selections]
The batched way's thorough derivative check (NOTE [derivative check] in ``cross.py``, NOTE
[checking the batched pass] in ``per_sample.py``) runs a backward of the batch's rows in a
few directions and asks whether any reaches another sample's taps; the eager probes (NOTE
[sample layouts]) ask the same of a recorded graph. Their verdict is kept for the trace or
the signature (later calls skip them), so they must see every path along which a later
call's cotangents can move between samples, not only those this call's values leave open.
Two kinds of value hide a path:

* a zero factor (``h + w · mix(h)`` with ``w = 0`` on the first step): the directions carry
  NaN (:func:`check_weights`; the eager probes' rows, NOTE [NaN probes]), which goes through
  a product with zero and never cancels;
* a selection: ``where(mask, h - h.mean(0), h)`` with an all-False mask, a ReLU closed on a
  coupled input (``relu(h - h.mean(0) - t)``), a saturated ``clamp``. Their backward
  formulas *select* (``where(mask, grad, 0)``), which drops NaN too. Before session 29 a
  per-sample mask that hid a coupling on a signature's first call and opened it later gave
  wrong matrices without a word: 0.06 to 0.46 off (largest error over largest entry) on
  structured and auto, and with ``record()``; the eager walk on a gated ``h.roll(2, 0)``.

So during those passes every selection node of the graph (:data:`SELECTION_NODES`:
``where``, ``masked_fill``, ReLU, ``threshold``, ``clamp``, ``hardtanh``/``relu6``,
``hardsigmoid``/``hardswish``, ``hard``/``softshrink``, elementwise ``maximum``/``minimum``,
in place or not) is opened: a temporary post-hook (:func:`opened_nodes`, for an autograd
pass; :class:`OpenedCaller` for the walk's node calls) adds to each gradient it gives its
inputs the NaN entries of the cotangent at its output (summed to the input's shape), exact
zeros elsewhere. The real rows of a pass that carries both (the kernels' check shares the
backward) are unchanged where they are finite, and an infinite cotangent is not turned into
NaN. But a real row can hold NaN that the selection drops, as torch's backward does: behind
``sqrt(relu(h))`` another sample's row is ``0 · ∞`` at a closed entry. The eager walk, whose
probe rows ride along with the direction rows, therefore opens the probe rows only (session
58: before, that NaN reached every sample's entries of ``G`` on a signature's first call).
The hooks are removed when the pass ends, so the graph (the user's, with ``record()``) is
left as it was. Cost: two elementwise ops per selection node in the checking pass only.

A node that routes by value **within a row** selects too: a max-pooling (or adaptive,
fractional) window's maximum, a whole tensor's ``max()`` or ``min()``, an unpooling's
positions, a classification loss's target class (``nll_loss``, ``cross_entropy``, the margin
losses, CTC), an embedding's table row. Their index
tensors are new every batch, so they are left out of the routing digest (NOTE [routing
values]: ``_ROW_LOCAL_*`` in ``_core/_torch_compat.py``), and their backward sends a row's
cotangent to the entries this call's indices chose, exact zeros elsewhere. So the check must
see every entry another call's indices could choose: opened, such a node gives NaN to **every
entry of each input row** whose output row has one (:data:`ROW_ROUTES`: a pooling's
``(N, C)`` plane, a loss's classes of one sample, for an embedding the whole table). Before
session 51 they were not opened, and a row that holds a coupled entry and an uncoupled one
(``max_pool1d`` over ``h`` and ``h - h.mean(0) + t``, the centred branch winning only for
later calls' ``t``; ``F.embedding`` of a batch's activations, ``max_unpool1d`` or ``nll_loss``
laid out across the samples, their indices exchanging samples 1 and 2 from the second call)
gave wrong matrices without a word from the second call on: 0.12 to 0.16 off on structured
and auto (a helper's hunt). A layout whose rows span samples (an unpooling over the
flattened batch) now reads as samples that interact: the exact matrix of the whole batch.

Some backward formulas drop NaN at particular values, as a selection does: ``std`` where it
is 0, a power whose tensor exponent is 0, a ``prod`` with two zeros, a vector norm or a
``cdist`` distance of 0 (a helper's hunt in session 51: a mask input all zero on the first
call hid a coupling behind them, 0.0008 to 13 off from the second call on structured, auto
and ``record()``). The powers are opened entry by entry; the reductions (and ``median()``,
which gives the entries it did not choose zeros) as rows: every entry reduced into an output
entry with NaN (:data:`ROW_ROUTES`). A second hunt (session 52) found fifteen more, 0.015 to
2.0 off the same way: ``sinc`` at 0, ``xlogy`` / ``xlog1py`` where ``self`` is 0, ``logit``
outside ``[eps, 1 - eps]``, an in-place ``threshold``, ``clamp_min`` / ``clamp_max`` with a
tensor bound (entry by entry); ``cumprod`` after a zero, a segment's max, ``renorm`` below its
bound (the whole slice it norms), ``pdist`` and ``cdist``'s matrix-product path at distance 0,
``grid_sample`` out of bounds or nearest (each sample's whole input and grid), a PReLU weight
where the input is positive (by channel); and ``logcumsumexp``, whose formula drops NaN at
every value (``where(grad > 0, log|grad|, lowest)``), so that a coupling behind it was missed
on the first call too. Others of the kind may remain: the walk of the graph backend and the
jacobian and ntvp backends check every call's own values.

Left to other checks: selections that route across rows (an index, ``masked_select``,
sorting, ``max``/``min`` over a dim with their indices, ``gather``) are in the routing digest
(NOTE [routing values]).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from torchgram.backends.graph.nodes import NodeCaller

# The masks below work on the trailing dims (the op's own): a walk calls a node with its
# check directions as leading dims of every cotangent, and each direction must stay apart.

def _pooled_rows(node: Any, nan: Tensor, shape: torch.Size, index: int, spatial: int) -> Tensor:
    """The ``(N, C)`` planes (the dims before the last ``spatial``) that have NaN (pooling)."""
    del node, index
    planes = nan.reshape(*nan.shape[:-spatial], -1).any(-1)  # (no flatten under vmap)
    return planes.reshape(*shape[:-spatial], *(1,) * spatial)


def _class_rows(node: Any, nan: Tensor, shape: torch.Size, index: int, classes: int) -> Tensor:
    """The samples whose loss has NaN, along the classes (dim ``classes``, from the end)."""
    if getattr(node, "_saved_reduction", 0) != 0:  # reduced: one loss for every sample
        return _reduced_rows(node, nan, shape, index)
    return nan.unsqueeze(classes)


def _reduced_rows(node: Any, nan: Tensor, shape: torch.Size, index: int) -> Tensor:
    """All of the input of a full reduction (``Tensor.max()``) whose one output has NaN."""
    del node, index
    return nan.reshape(*nan.shape, *(1,) * (len(shape) - nan.dim()))


def _ctc_rows(node: Any, nan: Tensor, shape: torch.Size, index: int) -> Tensor:
    """``log_probs [T, N, C]``' entries of the samples whose loss ``[N]`` has NaN."""
    del node, shape, index
    return nan.unsqueeze(-1).unsqueeze(-3)


def _own_dim(node: Any, dim: int, saved: str) -> int:
    """``node``'s ``dim`` counted from the end of its input ``saved`` (a walk's directions lead).

    A 0-dim input reduces over its dim 0 or -1 as if it had one dim of size 1.
    """
    rank = max(1, getattr(node, saved).dim())
    return dim % rank - rank


def _dims_rows(node: Any, nan: Tensor, shape: torch.Size, index: int) -> Tensor:
    """What a reduction over ``node``'s saved ``dim`` (``None``: all) gathers into NaN entries.

    ``std``, ``prod``, ``linalg.vector_norm``...: each output entry with NaN opens the input
    entries reduced into it.
    """
    del index
    dims = getattr(node, "_saved_dim", None)
    dims = (dims,) if isinstance(dims, int) else tuple(dims or ())
    if not dims:  # a full reduction
        return _reduced_rows(node, nan, shape, 0)
    if getattr(node, "_saved_keepdim", False):  # the reduced dims are there, of size 1
        return nan
    for dim in sorted((_own_dim(node, d, "_saved_self") for d in dims), reverse=True):
        nan = nan.unsqueeze(dim)
    return nan


def _distance_rows(node: Any, nan: Tensor, shape: torch.Size, index: int) -> Tensor:
    """The rows of ``x1 [P, M]`` (``index`` 0) or ``x2 [R, M]`` with a NaN distance ``[P, R]``."""
    del node, shape
    return nan.any(-1, keepdim=True) if index == 0 else nan.any(-2).unsqueeze(-1)


def _dim_rows(node: Any, nan: Tensor, shape: torch.Size, index: int, dim: str = "_saved_dim",
              saved: str = "_saved_self") -> Tensor:
    """Every entry along ``node``'s ``dim`` where any output entry along it has NaN.

    A scan (``cumprod``, ``logcumsumexp``) or a segment reduction along that dim: each output
    entry reads entries along it that the values choose.
    """
    del shape, index
    return nan.any(_own_dim(node, getattr(node, dim), saved), keepdim=True)


def _slice_rows(node: Any, nan: Tensor, shape: torch.Size, index: int) -> Tensor:
    """``renorm``'s slices ``select(dim, i)`` (normed as a whole) where any entry has NaN."""
    del shape, index
    rank = node._saved_self.dim()
    dim = _own_dim(node, node._saved_dim, "_saved_self")
    others = tuple(d for d in range(-rank, 0) if d != dim)
    return nan.any(others, keepdim=True) if others else nan


def _pair_rows(node: Any, nan: Tensor, shape: torch.Size, index: int) -> Tensor:
    """All of ``pdist``'s input ``[N, M]`` where any distance ``[N (N - 1) / 2]`` has NaN."""
    del node, shape, index
    return nan.any(-1).reshape(*nan.shape[:-1], 1, 1)


def _sampled_rows(node: Any, nan: Tensor, shape: torch.Size, index: int,
                  spatial: int) -> Tensor:
    """All of ``grid_sample``'s input and grid of each sample whose output has NaN.

    The input ``[N, C, *in]``, the grid ``[N, *out, spatial]``, the output ``[N, C, *out]``:
    the grid's values pick the pixels.
    """
    del node, shape, index
    samples = nan.reshape(*nan.shape[:-(spatial + 1)], -1).any(-1)
    return samples.reshape(*samples.shape, *(1,) * (spatial + 1))


def _prelu_rows(node: Any, nan: Tensor, shape: torch.Size, index: int) -> Tensor:
    """``prelu``'s input entry by entry; its weight ``[C]`` (or ``[1]``) by channel (dim 1)."""
    if index == 0:
        return nan
    rank = node._saved_self.dim()
    lead = nan.shape[:nan.dim() - rank]
    if shape[-1] == 1 or rank < 2:  # one weight for every channel
        return nan.reshape(*lead, -1).any(-1).reshape(*lead, 1)
    channels = nan.movedim(1 - rank, -1)
    return channels.reshape(*lead, -1, channels.shape[-1]).any(-2)


def _table_rows(node: Any, nan: Tensor, shape: torch.Size, index: int) -> Tensor:
    """Every row of an embedding's table ``[V, d]``, where any looked-up row has NaN."""
    del node, index
    lead = nan.shape[:len(shape) - 2]
    return nan.reshape(*lead, -1).any(-1).reshape(*lead, 1, 1)


ROW_ROUTES: dict[str, Callable[[Any, Tensor, torch.Size, int], Tensor]] = {
    **{f"{kind}{nd}DBackward0": functools.partial(_pooled_rows, spatial=nd)
       for kind in ("MaxPool", "AdaptiveMaxPool", "FractionalMaxPool", "MaxUnpool")
       for nd in (2, 3)},
    **{f"{kind}{nd}D{suffix}Backward0": functools.partial(_pooled_rows, spatial=nd)
       for kind, suffix in (("MaxPool", "WithIndices"), ("MkldnnMaxPool", "")) for nd in (2, 3)},
    # Tensor.max() / .min() of a whole tensor (the CPU backward gives the others zeros)
    **dict.fromkeys(("MaxBackward1", "MinBackward1"), _reduced_rows),
    **dict.fromkeys(("NllLossBackward0", "MultiMarginLossBackward0",
                     "MultilabelMarginLossBackward0"),
                    functools.partial(_class_rows, classes=-1)),
    "NllLoss2DBackward0": functools.partial(_class_rows, classes=-3),  # [N, C, H, W]
    "CtcLossBackward0": _ctc_rows,
    # reductions whose backward formula gives exact zeros at some values (std 0, a product
    # with two zeros, a norm 0, a distance 0, the entries a median did not choose)
    **dict.fromkeys(("StdBackward0", "StdMeanBackward0", "ProdBackward1",
                     "LinalgVectorNormBackward0", "NormBackward1", "NormBackward3"), _dims_rows),
    **dict.fromkeys(("ProdBackward0", "MedianBackward0", "NanmedianBackward0", "NormBackward0",
                     "NormBackward2", "DistBackward0"), _reduced_rows),
    **dict.fromkeys(("CdistBackward0", "EuclideanDistBackward0"), _distance_rows),
    "EmbeddingBackward0": _table_rows,
    # found by a helper's hunt in session 52: scans, pair distances, a grid's sampling, a
    # segment's max, a renorm below its bound, a PReLU weight where the input is positive
    **dict.fromkeys(("CumprodBackward0", "LogcumsumexpBackward0"), _dim_rows),
    "SegmentReduceBackward0": functools.partial(_dim_rows, dim="_saved_axis",
                                                saved="_saved_data"),
    "RenormBackward0": _slice_rows,
    "PdistBackward0": _pair_rows,
    **{f"GridSampler{nd}DBackward0": functools.partial(_sampled_rows, spatial=nd)
       for nd in (2, 3)},
    "PreluKernelBackward0": _prelu_rows,
}
"""Nodes that route a cotangent within a row by value, or whose backward formula drops it at
some values, and, from the node, the NaN entries of its output's cotangent, an input's shape
and its index, the entries of that input (broadcastable) that another call's values could
send them to (NOTE [opened selections]). The 1-D poolings run
as 2-D ones. Where a mask does not fit the input's shape, each leading index the cotangent
and the input share (a walk's directions) opens all of its entries, apart from the others."""

SELECTION_NODES: frozenset[str] = frozenset({
    "WhereBackward0", "MaskedFillBackward0", "MaskedFillBackward1", "ReluBackward0",
    "ThresholdBackward0", "ClampBackward0", "ClampBackward1", "ClampMinBackward0",
    "ClampMaxBackward0", "HardtanhBackward0", "HardsigmoidBackward0", "HardswishBackward0",
    "HardshrinkBackward0", "SoftshrinkBackward0", "MaximumBackward0", "MinimumBackward0",
    "FmaxBackward0", "FminBackward0", *ROW_ROUTES,
    "PowBackward1", "PowBackward2",  # zeros where the exponent is 0 (the base 0), NaN or not
    # zeros at some values (session 52's hunt): sinc at 0, xlogy / xlog1py where self is 0,
    # logit outside [eps, 1 - eps], an in-place threshold, clamps with a tensor bound
    "SincBackward0", "XlogyBackward0", "XlogyBackward2", "SpecialXlog1PyBackward0",
    "SpecialXlog1PyBackward2", "LogitBackward0", "ThresholdBackward1", "ClampMinBackward1",
    "ClampMaxBackward1",
    "NextafterBackward0",  # where self == other (a systematic scan of torch's OpInfos)
})
"""The autograd nodes whose backward selects by value (NOTE [opened selections])."""


def open_grads(grad_inputs: Sequence[Tensor | None], grad_output: Tensor | None,
               node: Any = None, lead: int = 0) -> tuple[Tensor | None, ...]:
    """``grad_inputs`` plus ``grad_output``'s NaN entries (summed to each one's shape).

    ``lead`` leading dims index the rows of a walk (the same in every gradient): a broadcast
    input's NaN entries are summed within each row (``sum_to_size`` alone aligns the trailing
    dims: a ``[k]`` operand beside ``[B, k]`` under ``n`` rows raised torch's raw "not
    expandable" error, or summed rows into samples where ``n = B``; session 60's hunt).

    For a ``node`` that routes within rows (its type in :data:`ROW_ROUTES`): NaN on every
    entry of each input row whose output row has one.

    Example:
        >>> open_grads([torch.zeros(2), None], torch.tensor([math.nan, 1.0]))
        (tensor([nan, 0.]), None)
        >>> x = torch.zeros(2, 1, 1, 4, requires_grad=True)
        >>> pool = torch.nn.functional.max_pool2d(x, (1, 2))  # [2, 1, 1, 2]
        >>> nan_on_sample_0 = torch.tensor([math.nan, 0.0, 0.0, 0.0]).reshape(2, 1, 1, 2)
        >>> pooled = open_grads([torch.zeros(2, 1, 1, 4)], nan_on_sample_0, pool.grad_fn)[0]
        >>> pooled.isnan().reshape(2, 4)  # sample 0's whole plane, not sample 1's
        tensor([[ True,  True,  True,  True],
                [False, False, False, False]])
    """
    if grad_output is None:
        return tuple(grad_inputs)
    rows = ROW_ROUTES.get(type(node).__name__)
    if rows is not None:
        return tuple(None if grad is None else _opened_rows(grad, node, rows, grad_output, index)
                     for index, grad in enumerate(grad_inputs))
    nan = grad_output.isnan()
    nan_only: Tensor | None = None
    opened: list[Tensor | None] = []
    for grad in grad_inputs:
        if grad is None:
            opened.append(None)
        elif grad.shape == grad_output.shape:  # one select: NaN there, the gradient elsewhere
            opened.append(torch.where(nan, grad_output.to(grad.dtype), grad))
        else:  # a broadcast input: the NaN entries summed to its shape
            if nan_only is None:
                nan_only = torch.where(nan, grad_output, torch.zeros(
                    (), dtype=grad_output.dtype, device=grad_output.device))
            spread = (1,) * (nan_only.dim() - grad.dim())  # the dims the input was broadcast on
            within = (*grad.shape[:lead], *spread, *grad.shape[lead:])
            opened.append(grad + nan_only.sum_to_size(within).reshape(grad.shape).to(grad.dtype))
    return tuple(opened)


def _opened_rows(grad: Tensor, node: Any,
                 rows: Callable[[Any, Tensor, torch.Size, int], Tensor], grad_output: Tensor,
                 index: int) -> Tensor:
    """``grad`` with NaN on the entries ``rows`` opens (all of it where the mask does not fit)."""
    if grad.layout != torch.strided:  # an embedding's sparse gradient
        grad = grad.to_dense()
    nan = grad_output.isnan()
    try:
        mask = _fitted(rows(node, nan, grad.shape, index), grad.shape)
    except (RuntimeError, IndexError):  # a layout the mask does not know: per shared index
        shared = 0
        while (shared < min(nan.dim(), grad.dim())
               and nan.shape[shared] == grad.shape[shared]):
            shared += 1
        lead = nan.shape[:shared]
        mask = nan.reshape(*lead, -1).any(-1).reshape(*lead, *(1,) * (grad.dim() - shared))
    return torch.where(mask, torch.full((), math.nan, dtype=grad.dtype, device=grad.device),
                       grad)


def _fitted(mask: Tensor, shape: torch.Size) -> Tensor:
    """``mask`` reduced (any) until it broadcasts to ``shape``.

    An input the op broadcast (``cdist``'s unbatched ``x2`` beside a batched ``x1``) gets the
    NaN of every entry it reached. Raises ``RuntimeError`` when it cannot (a layout the mask
    does not know).
    """
    extra = mask.dim() - len(shape)
    if extra > 0:
        mask = mask.reshape(-1, *mask.shape[extra:]).any(0)
    for dim, (size, target) in enumerate(zip(mask.shape[-len(shape):], shape, strict=False)):
        if target == 1 and size != 1:
            mask = mask.any(dim - min(mask.dim(), len(shape)), keepdim=True)
    if torch.broadcast_shapes(mask.shape, shape) != shape:
        raise RuntimeError("the mask does not fit the input")
    return mask


def _hook(node: Any, grad_inputs: tuple[Tensor | None, ...],
          grad_outputs: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
    return open_grads(grad_inputs, grad_outputs[0], node)


@contextlib.contextmanager
def opened_nodes(nodes: Iterable[Any]) -> Iterator[int]:
    """Open the selection nodes among ``nodes`` for the autograd passes inside the block.

    Yields how many it opened. The hooks are removed when the block ends.

    Example:
        >>> h = torch.tensor([1.0, -1.0], requires_grad=True)
        >>> y = torch.relu(h * 1.0)
        >>> with opened_nodes([y.grad_fn]):
        ...     torch.autograd.grad(y, h, torch.tensor([1.0, math.nan]), retain_graph=True)
        (tensor([1., nan]),)
        >>> torch.autograd.grad(y, h, torch.tensor([1.0, math.nan]))  # the hook is gone
        (tensor([1., 0.]),)
    """
    handles = [node.register_hook(functools.partial(_hook, node))
               for node in nodes if type(node).__name__ in SELECTION_NODES]
    try:
        yield len(handles)
    finally:
        for handle in handles:
            handle.remove()


def opened_call(node: Any, grads: Sequence[Tensor | None],
                outs: list[Tensor | None]) -> list[Tensor | None]:
    """A node call's gradients ``outs``, opened where ``node`` is a selection.

    For the walks, which call the nodes themselves (no hook runs there): ``grads`` are the
    node's incoming cotangents, ``outs`` what the call gave each edge.
    """
    if type(node).__name__ not in SELECTION_NODES:
        return outs
    return list(open_grads(outs, grads[0], node, lead=1))


class OpenedCaller(NodeCaller):
    """A :class:`NodeCaller` whose selection nodes are opened (the probes of a walk)."""

    def __call__(self, node: Any, grads: Sequence[Tensor | None],
                 edges: Sequence[Any]) -> list[Tensor | None]:
        """The node's gradients, opened where it is a selection (:func:`opened_call`)."""
        return opened_call(node, grads, super().__call__(node, grads, edges))


def check_weights(count: int, dtype: torch.dtype, device: torch.device,
                  generator: torch.Generator) -> Tensor:
    """The derivative check's weights on ``count`` rows: NaN (NOTE [opened selections]).

    Under ``torch.autograd.set_detect_anomaly`` (which raises on NaN gradients) they are
    random positive weights in ``[0.5, 1.5)`` instead, blind to zero factors and selections.

    Example:
        >>> check_weights(2, torch.float32, torch.device("cpu"), torch.Generator())
        tensor([nan, nan])
    """
    if not torch.is_anomaly_enabled():
        return torch.full((count,), math.nan, dtype=dtype, device=device)
    return 0.5 + torch.rand(count, generator=generator, device=device).to(dtype)
