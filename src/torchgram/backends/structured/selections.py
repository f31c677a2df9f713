"""Selections opened for the derivative check: structural edges through closed branches.

NOTE [opened selections]
The batched way's derivative check (NOTE [derivative check] in ``cross.py``, NOTE [checking
the batched pass] in ``per_sample.py``) runs a backward of the batch's rows in a few
directions and asks whether any reaches another sample's taps. Its verdict is kept for the
trace (every later call of the signature skips the thorough check), so it must see every
path along which a later call's cotangents can move between samples, not only those this
call's values leave open. Two kinds of value hide a path:

* a zero factor (``h + w · mix(h)`` with ``w = 0`` on the first step): the check's
  directions carry NaN (:func:`check_weights`), which goes through a product with zero and
  never cancels (the eager probes' remedy, NOTE [NaN probes] in ``backends/eager``);
* a selection: ``where(mask, h - h.mean(0), h)`` with an all-False mask, a ReLU closed on a
  coupled input (``relu(h - h.mean(0) - t)``), a saturated ``clamp``. Their backward formulas
  *select* (``where(mask, grad, 0)``), which drops NaN too. Before session 29 a per-sample
  mask that hid a coupling on a signature's first call and opened it later gave wrong
  matrices without a word on structured and auto (0.01 to 0.65 off, relative).

So the first batched run of a trace (the one whose derivatives get the thorough check)
runs each selection opened: its result goes through :class:`_Opened`, the identity forward,
whose backward hands the cotangent on unchanged and gives every floating input of the
selection (both branches of ``where``, the input of a ReLU or a clamp) the cotangent's NaN
entries and exact zeros elsewhere. The real backward of that run is unchanged (it adds
zeros; an infinite cotangent is not turned into NaN), while a NaN direction reaches
everything a path of the *code* leads to, whatever the masks. A selection done in place
(``relu_``, ``masked_fill_``, ``nn.ReLU(inplace=True)``) runs on a copy of its input, is
opened there and written back, so that what it saved for its backward is never modified.
Only the first batched run pays it: a copy per selection and, in its backwards, two
elementwise ops per selection.

What is left open: selections that route rather than select (an index, ``masked_select``,
sorting) are covered by the routing digest (NOTE [routing values]); ``max``/``min`` over a
dim and pooling select one entry by value; a coupling added by Python control flow after
the first call (a closure flag) changes no trace and is not seen.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import optree
import torch
import torch.nn.functional as F
from torch import Tensor

from torchgram._core import _torch_compat
from torchgram.backends.graph.nodes import NodeCaller

_SELECTIONS: frozenset[Any] = frozenset({
    torch.where, Tensor.where,
    torch.masked_fill, Tensor.masked_fill, Tensor.masked_fill_,
    torch.relu, torch.relu_, Tensor.relu, Tensor.relu_, F.relu, F.relu_, F.relu6,
    F.hardtanh, F.hardtanh_, F.hardsigmoid, F.hardswish, F.hardshrink, F.softshrink,
    torch.threshold, torch.threshold_, F.threshold, F.threshold_,  # type: ignore[attr-defined]
    torch.clamp, torch.clip, torch.clamp_, torch.clip_, torch.clamp_min, torch.clamp_max,
    Tensor.clamp, Tensor.clip, Tensor.clamp_, Tensor.clip_, Tensor.clamp_min, Tensor.clamp_max,
    Tensor.clamp_min_, Tensor.clamp_max_,
    torch.maximum, torch.minimum, torch.fmax, torch.fmin, Tensor.maximum, Tensor.minimum,
    Tensor.fmax, Tensor.fmin,
})
"""Calls whose backward selects by value (a mask, a threshold), opened by the first batched
run of a trace. ``torch.max``/``torch.min`` of two tensors are :data:`_BINARY_REDUCTIONS`."""

_BINARY_REDUCTIONS: frozenset[Any] = frozenset({torch.max, torch.min, Tensor.max, Tensor.min})
"""Selections only in their elementwise form (a second tensor argument)."""


def is_selection(func: Any, args: tuple[Any, ...]) -> bool:
    """Whether ``func(*args)`` selects by value elementwise (NOTE [opened selections]).

    Example:
        >>> x = torch.ones(2)
        >>> is_selection(torch.relu, (x,)), is_selection(torch.max, (x,))
        (True, False)
        >>> is_selection(torch.max, (x, x)), is_selection(torch.tanh, (x,))
        (True, False)
    """
    try:
        if func in _SELECTIONS:
            return True
        return func in _BINARY_REDUCTIONS and len(args) > 1 and isinstance(args[1], Tensor)
    except TypeError:  # an unhashable callable
        return False


def opened(call: Callable[[tuple[Any, ...], dict[str, Any]], Any], func: Any,
           args: tuple[Any, ...], kwargs: dict[str, Any],
           saved_outputs: list[tuple[Tensor, int, str]] | None = None) -> Any:
    """``call(args, kwargs)`` (the selection ``func``), opened (NOTE [opened selections]).

    ``saved_outputs``: where an in-place ReLU notes its output and version. Torch's ReLU saves
    its output, so ``f`` modifying it in place afterwards is refused at the backward; opened,
    the ReLU saved a copy, so the caller must refuse it instead (at the end of the run).

    Example:
        >>> h = torch.tensor([1.0, -1.0], requires_grad=True)
        >>> y = opened(lambda a, k: torch.relu(*a, **k), torch.relu, (h,), {})
        >>> grad, = torch.autograd.grad(y, h, torch.tensor([1.0, math.nan]))
        >>> grad  # the closed entry sees the NaN direction; the open one its real gradient
        tensor([1., nan])
        >>> torch.autograd.grad(torch.relu(h), h, torch.tensor([1.0, math.nan]))[0]
        tensor([1., 0.])
    """
    leaves: list[Any] = optree.tree_leaves((args, kwargs))  # type: ignore[arg-type]
    branches = [leaf for leaf in leaves
                if isinstance(leaf, Tensor) and leaf.requires_grad and leaf.is_floating_point()]
    if not branches or not torch.is_grad_enabled():
        return call(args, kwargs)
    target = args[0] if args and isinstance(args[0], Tensor) else None
    name = getattr(func, "__name__", "")
    if target is not None and target.requires_grad and target.is_floating_point() and (
            name.endswith("_") or kwargs.get("inplace") is True
            or any(a is True for a in args[1:])):
        # in place: on a copy, opened, then written back (the selection's saved tensors are
        # the copy's, which nothing modifies after it; the branch is the input's history)
        work = target.clone()
        if call((work, *args[1:]), kwargs) is not work:
            raise AssertionError(f"{name} was expected to work in place")
        target.copy_(_Opened.apply(work, *branches))
        if saved_outputs is not None and name.rstrip("_") == "relu":
            saved_outputs.append((target, _torch_compat.version(target), name))
        return target
    result = call(args, kwargs)
    if not isinstance(result, Tensor) or not result.requires_grad \
            or not result.is_floating_point() or result is target:
        return result
    return _Opened.apply(result, *branches)


def _structural(grad: Tensor, inputs: list[tuple[torch.Size, torch.dtype]]
                ) -> tuple[Tensor, ...]:
    """Each input's share of ``grad``'s NaN entries, zero elsewhere (summed to its shape)."""
    nan_only = torch.where(grad.isnan(), grad, torch.zeros((), dtype=grad.dtype,
                                                           device=grad.device))
    return tuple(nan_only.sum_to_size(shape).to(dtype) if shape != grad.shape
                 else nan_only.to(dtype) for shape, dtype in inputs)


class _Opened(torch.autograd.Function):
    """Identity forward; backward: the cotangent on, its NaN entries to every input too."""

    @staticmethod
    def forward(ctx: Any, result: Tensor, *branches: Tensor) -> Tensor:
        ctx.inputs = [(branch.shape, branch.dtype) for branch in branches]
        return result.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, ...]:
        return (grad, *_structural(grad, ctx.inputs))


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


OPENED_NODE: type = _Opened._backward_cls
"""The autograd node of an opened selection (walked through: NOTE [routing values])."""


# -- the same for a graph already built: eager probes ----------------------------------------

SELECTION_NODES: frozenset[str] = frozenset({
    "WhereBackward0", "MaskedFillBackward0", "MaskedFillBackward1", "ReluBackward0",
    "ThresholdBackward0", "ClampBackward0", "ClampBackward1", "ClampMinBackward0",
    "ClampMaxBackward0", "HardtanhBackward0", "HardsigmoidBackward0", "HardswishBackward0",
    "HardshrinkBackward0", "SoftshrinkBackward0", "MaximumBackward0", "MinimumBackward0",
    "FmaxBackward0", "FminBackward0",
})
"""The autograd nodes of :data:`_SELECTIONS`: what an eager graph's probes open (NOTE [opened
selections in probes])."""

# NOTE [opened selections in probes]
# Eager code cannot be run again opened (and ``record()`` promises the user's graph exactly
# as written), so the eager probes (NOTE [sample layouts]) open the selections of the graph
# they run in: during a probe, every selection node of the graph gets a temporary post-hook
# (an engine pass) or its call is wrapped (a walk), adding the cotangent's NaN entries at
# its output to each gradient it gives its inputs. The hooks are removed when the probe
# ends, so the graph and its hooks are the user's again. Without it, ``record()``'s layouts,
# probed on a call whose per-sample mask shut a coupling, were kept for the signature and
# later calls were 0.14 to 0.86 off (session 28).


def open_grads(grad_inputs: Sequence[Tensor | None], grad_output: Tensor | None
               ) -> tuple[Tensor | None, ...]:
    """``grad_inputs`` plus ``grad_output``'s NaN entries (summed to each one's shape).

    Example:
        >>> open_grads([torch.zeros(2), None], torch.tensor([math.nan, 1.0]))
        (tensor([nan, 0.]), None)
    """
    if grad_output is None:
        return tuple(grad_inputs)
    nan_only = torch.where(grad_output.isnan(), grad_output,
                           torch.zeros((), dtype=grad_output.dtype, device=grad_output.device))
    return tuple(None if grad is None else
                 grad + (nan_only if grad.shape == nan_only.shape
                         else nan_only.sum_to_size(grad.shape)).to(grad.dtype)
                 for grad in grad_inputs)


def _hook(grad_inputs: tuple[Tensor | None, ...], grad_outputs: tuple[Tensor | None, ...]
          ) -> tuple[Tensor | None, ...]:
    return open_grads(grad_inputs, grad_outputs[0])


@contextlib.contextmanager
def opened_nodes(nodes: Iterable[Any]) -> Iterator[None]:
    """Open the selection nodes among ``nodes`` for the engine passes inside the block.

    Example:
        >>> h = torch.tensor([1.0, -1.0], requires_grad=True)
        >>> y = torch.relu(h * 1.0)
        >>> with opened_nodes([y.grad_fn]):
        ...     torch.autograd.grad(y, h, torch.tensor([1.0, math.nan]), retain_graph=True)
        (tensor([1., nan]),)
        >>> torch.autograd.grad(y, h, torch.tensor([1.0, math.nan]))  # the hook is gone
        (tensor([1., 0.]),)
    """
    handles = [node.register_hook(_hook) for node in nodes
               if type(node).__name__ in SELECTION_NODES]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class OpenedCaller(NodeCaller):
    """A :class:`NodeCaller` whose selection nodes are opened (the probes of a walk)."""

    def __call__(self, node: Any, grads: Sequence[Tensor | None],
                 edges: Sequence[Any]) -> list[Tensor | None]:
        """The node's gradients, opened where it is a selection (:func:`open_grads`)."""
        out = super().__call__(node, grads, edges)
        if type(node).__name__ not in SELECTION_NODES:
            return out
        return list(open_grads(out, grads[0]))
