"""Finding and tapping the structured uses of parameter leaves while ``f`` runs.

# NOTE [taps]
:class:`TapMode` is a ``torch.overrides.TorchFunctionMode``. It sees every torch function
call made by ``f`` (not the inside of composite functions it intercepts, e.g.
``F.multi_head_attention_forward``: those are opaque calls). A call is a *use* of leaf ``l``
when one of its arguments **is** (by identity) the tensor ``f`` received for ``l`` — compared
against the leaves as the transformed function received them, which under ``vmap`` are
wrapped tensors — or a transposed view of it made under the mode (``W.T``, ``W.t()``, ...).

* A call a rule recognises (``rules.RULES``) whose weight or bias operand is a leaf is
  *tapped*: it runs with plain, gradient-free copies of those leaves, a zero tap ``z`` is
  added to its output, and its other operand (the activation) is recorded. The cotangent
  reaching ``z`` in a backward pass is the ``∂out/∂y`` the factors need (NOTE [factors]).
* A composite function with a rewrite (``rules.REWRITES``, e.g. self-attention) runs as its
  rewrite, which enters the mode around the calls the rules must see (all of them but the
  parameter-free cell ops of a recurrent net).
* Any other call involving a leaf that returns a floating tensor is an *unrecognised* use:
  it runs unchanged on the tensor ``f`` received, so gradients reach that tensor (the
  leaf's "carrier"), and the leaf needs the fallback for those uses.

Three ways to run: ``trace`` (no taps; record what is used how), ``lazy`` taps (created on the
fly; every leaf's tensor carries gradients for its unrecognised uses), and ``given`` taps
(made beforehand from a trace, e.g. batched for ``vmap``; the run must replay the trace).

# NOTE [tap edges]
A lazy tap costs nothing when the tapped output ``y`` already has an autograd node (its
activation requires gradients): the tap is then ``y``'s gradient edge
(``torch.autograd.graph.get_gradient_edge``), and the backward asks for the gradient that
reaches that edge, which is ``∂out/∂y`` for the ``y`` the op returned even when ``f``
modifies ``y`` in place afterwards (``relu_``, ``+=``). Adding a zero tensor instead would
copy every tapped output once more in the forward. An output without a node (the first
layer's, whose input needs no gradient) gets a zero tap, which also makes the rest of the
forward record the graph.
An output that autograd treats as a view of the op's own result (``F.linear`` with a bias on
a ``[B, T, d]`` input is ``addmm`` on ``[B·T, d]``, then ``view``) would lose its edge: an
in-place op on a view (``relu_``, ``+=``) replaces the view's node, and the rows no longer
reach the old one, so the tap got no cotangent and the leaf a zero block (two stacked
linears with a bias, then ``relu_`` on the output: ``G`` 0.69 off on structured, a fuzz
hunt in session 29, pre-existing). Such an output is re-expressed as an ``_unsafe_view`` of
its base (what ``matmul`` returns for 3-D inputs: the same storage, not a view to autograd);
a strided one gets a zero tap.

# NOTE [uses with gradients off]
A call that uses a leaf while gradients are off inside ``f`` (they were on when the mode was
entered) is never tapped: its output has no graph, so a tap there would get no cotangent,
and the leaf's Jacobian is not where the call is. Inside a custom ``autograd.Function``'s
``forward`` (always run with gradients off) the derivative reaches the leaf through the
Function's own ``backward``, and a tap would give the leaf a zero block (a linear layer
inside such a Function: ``G`` 0.9 off, relative, found in session 23; so too the forward of
``torch.utils.checkpoint(..., use_reentrant=True)``). The use is noted unrecognised instead,
so the leaf gets a carrier that requires gradients and its rows come from the graph (through
the Function's ``backward``); under ``torch.no_grad`` the carrier gets no gradient there,
which is the zero Jacobian that use has. A mode entered with gradients off (the check of
merged sample dims) records as before. Likewise under saved-tensor hooks that were not in
force when the mode was entered: a non-reentrant ``torch.utils.checkpoint`` region's
backward re-runs the region without the mode, and a tapped call there would make the
recomputation differ from the forward (torch's ``CheckpointError``). Likewise inside a
``torch.func`` transform of ``f``'s own (``torch.vmap(per_sample_loss)(x)`` written in ``f``):
a tap made there is a tensor of that transform's level, which no backward outside it can
read, and making one raised torch's "requires_grad_() inside of a function being transformed"
(auto and structured declined an ``f`` that graph, jacobian and ntvp ran, and ``explain``
raised it; session 59's hunt): the leaf's rows come from the graph, through the transform.

# NOTE [rewritten layouts]
A rewrite computes the composite's values, not its memory layout: ``torch.einsum`` lays its
output out by rules of its own (a size-1 contracted index, a transposed activation give
strides no matmul reproduces), and self-attention's rewrite may differ likewise. Values do
not depend on strides, but random draws do: ``F.dropout`` after the call fills a mask laid
out along its input's strides, so other strides drop other entries, and the Gramian would be
that of another function than ``f`` as called (the aggregated-update hunt found it: einsum
after ``multi_head_attention_forward``, then dropout). Whether ``f`` draws is known only after
a full evaluation, and running the original composite beside every rewrite would double its
forward on every call. So a tapped run notes whether it rewrote a call (``rewrote``); when it
did and ``f`` drew random numbers, the run is repeated from the call's random state with
``original_layouts``: each rewrite's output is then given the strides of the original call's
output (computed without gradients beside it), so every draw after it is the plain call's.
A function that draws nothing, or rewrites nothing, runs once as before. The recurrent
rewrite knows the fused kernel's layout and gives it always (NOTE [recurrent rewrite]), and
draws its inter-layer dropout as the kernel does (NOTE [inter-layer dropout]), and so does the
attention rewrite with dropout, which takes the call's own steps (NOTE [attention dropout]):
those neither ask for the second run nor run the original beside them
(``rules.rewrite_keeps_layout``). Any rewrite draws what its call draws, so an original call
run beside a rewrite for its layout runs from the generators' state after the rewrite and
puts that state back: its draws would move every later one (session 47).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from collections import Counter, OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import optree
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.graph import GradientEdge
from torch.overrides import TorchFunctionMode

from torchgram._core import _torch_compat
from torchgram._core.census import GRADIENT_HOOKS, coupling_op
from torchgram._core.composition import tapped_evaluation
from torchgram._core.errors import DifferentiatesItself, ModifiedInPlace, ParameterConverted
from torchgram._core.layouts import laid_out_like
from torchgram._core.pytree import leaves_of
from torchgram._core.rng import RngState
from torchgram.backends._embedding import embedding_with_conventions
from torchgram.backends.structured.rules import (
    SETTLED_PER_TRACE,
    rewrite_for,
    rewrite_keeps_layout,
    rule_for,
)
from torchgram.backends.structured.rules.base import Layout, Match, UseShape
from torchgram.backends.structured.rules.embedding import row_gather, row_slice
from torchgram.backends.structured.rules.recurrent_saves import (
    RECURRENT_KERNELS,
    call_tensors,
    fused_call_refuses,
)

Role = Literal["weight", "bias"]
"""How a recognised call uses a leaf."""


_RETAIN_GRAD = "Tensor.retain_grad() (torch.func transforms refuse it)"


class TraceMismatch(RuntimeError):
    """A tapped run did not replay the trace it was prepared from."""


class NotBatched(RuntimeError):
    """A batched run cannot read per-sample pieces (NOTE [shared taps]); stop it."""


class HookOnTap(RuntimeError):  # noqa: N818 -- reads as a statement
    """``f`` hooked a gradient this structured pass does not see (NOTE [hooks on taps]).

    ``rule``: what was hooked (a tapped call's output, a parameter).
    """

    def __init__(self, rule: str) -> None:
        super().__init__(rule)
        self.rule = rule


# NOTE [hooks on taps]
# A tap is mostly the gradient edge of the tapped call's output (NOTE [tap edges]), and one
# backward gives every tap's cotangent (``autograd.grad`` with the taps as inputs). torch
# 2.13 captures an input's gradient *before* the tensor hooks registered on it when the
# backward goes on past it (to taps further up): a hook on a layer's output
# (``o.register_hook(lambda g: 5 * g)``, activation-gradient clipping or scaling) was
# missing from that layer's own weight block, G 0.08 off and the update 0.15 off on
# ``structured`` and on ``auto`` (session 58's hunt). Hooks on other tensors run as torch
# runs them, and so does the streamed backward (NOTE [streamed taps]: a node pre-hook reads
# an edge tap, after the tensor's hooks). So the tapping mode notes such a registration
# (``Recording.hooked_tap``) and a backward that asks for the taps as inputs
# (:func:`passes.backward_chunks`, the kernels' checked chunks) raises :class:`HookOnTap`,
# which the structured backend turns into a refusal naming ``jacobian``; ``auto``'s plan puts
# structured last where its pass would not stream. A hook on a parameter itself (a pruning
# mask on its gradient), a view of one or a tensor made of parameters only (a merged LoRA
# weight) is never seen by the factors, streamed or not (``Recording.hooked_leaf``: the
# review of session 58, G 0.35-0.94 off): every structured pass refuses then.


@dataclass(frozen=True)
class LeafRef:
    """Leaf ``index``, its transpose, or a view of it with the entries in the same order.

    ``view_shape`` is the shape of such a view (``p.view(1, 1, -1)``, ``p[None]``...), which
    rules that only see the entries one by one (elementwise weights, biases) accept.
    """

    index: int
    transposed: bool = False
    view_shape: tuple[int, ...] | None = None


@dataclass(frozen=True)
class TapRecord:
    """One tapped call: its output's shape and dtype (per evaluated batch) and rule."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    rule: str


@dataclass(frozen=True)
class UseRecord:
    """One recognised use of a leaf.

    Attributes:
        leaf: The leaf's index.
        role: ``"weight"`` or ``"bias"``.
        rule: The rule's name (``"linear"``, ``"matmul"``, ``"conv2d"``, ``"embedding"``...).
        layout: The weight operand's factor layout (for a bias, the layout it sums).
        act_first: Whether the activation is the first factor in the *leaf's* layout.
        tap: Index of the call's tap.
        act: Index of the activation among the mode's recorded activations (weights only).
        shape: The use's sizes per evaluated batch.
        act_shape: The activation's shape (weights only).
        live: The positions the traced rows reach, where at most half of them (NOTE [dead
            positions]); ``None`` otherwise.
    """

    leaf: int
    role: Role
    rule: str
    layout: Layout
    act_first: bool
    tap: int
    act: int | None
    shape: UseShape
    act_shape: tuple[int, ...] | None = None
    live: int | None = None

    def same_structure(self, other: UseRecord, samples: int = 1) -> bool:
        """Whether ``other`` is this use seen on ``samples`` times the batch (or the same)."""
        mine, theirs = self.shape, other.shape
        return (self.leaf, self.role, self.rule, self.act_first, self.tap, self.act) == \
            (other.leaf, other.role, other.rule, other.act_first, other.tap, other.act) and \
            (mine.groups, mine.act_width, mine.cot_width, mine.act_is_index, mine.elementwise) == \
            (theirs.groups, theirs.act_width, theirs.cot_width, theirs.act_is_index,
             theirs.elementwise) and \
            mine.positions * samples == theirs.positions


@dataclass(frozen=True)
class StepTap:
    """One tap for a call made once per step (NOTE [step taps]).

    Attributes:
        index: The tap's index.
        values: The call's operands, tapped leaves replaced by their plain copies.
        steps: Step ``t``'s slice of the tap, to add to its output (``None`` in a trace or
            for a shared tap).
        tap: The tap itself, whose slices ``steps`` are (for a node that runs all the steps,
            NOTE [fused recurrences]).
    """

    index: int
    values: tuple[Any, ...]
    steps: tuple[Tensor, ...] | None
    tap: Tensor | None = None


CHECKED_ROUTINGS = 64
"""Most routings a trace remembers as checked (:attr:`Recording.checked_routings`): code that
alternates between a few graphs (a mask dropped when a batch has no padding) checks each
once."""


@dataclass
class Recording:
    """What a run of ``f`` under :class:`TapMode` found."""

    taps: list[TapRecord] = field(default_factory=list)
    uses: list[UseRecord] = field(default_factory=list)
    hooked_tap: str | None = None  # the rule of a call whose output f hooks: NOTE [hooks on taps]
    hooked_leaf: str | None = None  # what f hooks that the factors never pass (same NOTE)
    unrecognised: dict[int, list[str]] = field(default_factory=dict)
    unrecognised_flops: dict[int, int] = field(default_factory=dict)
    rows: int | None = None
    """Output rows of the evaluation (``K`` for one sample, ``m`` for the whole batch)."""
    coupling: list[str] = field(default_factory=list)
    """Calls that make samples interact (NOTE [per-sample]), named."""
    draws: bool = False
    """Whether the traced evaluation of one sample drew random numbers (dropout, ...)."""
    calls: int = 0
    """Torch function calls seen (a measure of ``f``'s per-call overhead)."""
    unbatchable: list[str] = field(default_factory=list)
    """Calls ``vmap`` cannot batch (fused recurrent kernels): per-sample ``vmap`` passes over
    ``f`` loop over the samples instead."""
    gradient_hooks: bool = False
    """Whether ``f`` registered gradient hooks on its tensors, which the graph walk and
    ntvp's jvps would not run (NOTE [gradient hooks inside f])."""
    transform_refusals: list[str] = field(default_factory=list)
    """What ``torch.func`` transforms would refuse in ``f``: old-style ``autograd.Function``s
    in the graph of the rows, ``torch.utils.checkpoint`` regions (NOTE [old-style
    autograd.Functions]); ``auto`` tries the backends that use transforms last."""
    plans: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)
    """Plans made from this recording, by the backend (a cache)."""
    not_batched: bool = field(default=False, compare=False, repr=False)
    """Whether a batched run of this trace could not be made (a tapped output shared by the
    samples that never meets the batch as the mode can follow, a tap without a sample dim):
    its runs then go per sample at once, and ``auto`` counts that (NOTE [runs that cannot be
    batched])."""
    merged_order: bool | None = field(default=None, compare=False, repr=False)
    """Whether the merged sample dims of a batched run of this trace hold each sample's
    entries together (``None``: not checked yet; NOTE [checking the batched pass])."""
    checked_routings: set[Any] = field(default_factory=set, compare=False, repr=False)
    """The routings (:attr:`Forward.routing`: the batched graph's routing digest and
    signature) on which a run of this trace showed, by the thorough derivative check, that no
    sample's rows reach another sample's taps (empty: never; NOTE [checking the batched
    pass], NOTE [derivative check]): another routing, another thorough check. At most
    :data:`CHECKED_ROUTINGS` are kept (then it starts afresh)."""

    def note_checked(self, routing: Any) -> None:
        """Note that the thorough check passed on ``routing`` (:attr:`checked_routings`).

        Not under ``torch.autograd.set_detect_anomaly``: the check's weights are finite
        there (``selections.check_weights``), blind to a coupling this call's values scale
        by zero, which a later call outside the mode must still look for (a ramp-up weight
        at 0 on a first call under anomaly mode: every later call's G 1.01 off on
        ``structured`` and ``auto``, kernels and updates too; session 59's hunt).
        """
        if torch.is_anomaly_enabled():
            return
        if len(self.checked_routings) >= CHECKED_ROUTINGS:
            self.checked_routings.clear()
        self.checked_routings.add(routing)

    def uses_of(self, leaf: int) -> list[UseRecord]:
        """The recognised uses of ``leaf``, in call order."""
        return [use for use in self.uses if use.leaf == leaf]


_CHECKPOINT_REGION = "torch.utils.checkpoint regions (saved-tensor hooks)"

_PACKED_RNN = "a fused RNN over a PackedSequence"
UNSEEN_USE = "a call the tapping mode cannot see (TorchScript, a C++ extension)"
"""How an unseen use of a leaf is named (NOTE [unseen uses])."""
_FUSED_RNNS = frozenset({torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu})
"""Their packed form ``(data, batch_sizes, ...)`` runs under no ``torch.func`` transform
(torch 2.13 reads its inputs' memory directly; ``_torch_compat._TRANSFORM_REFUSALS``)."""

_TRANSPOSE_METHODS = frozenset({torch.Tensor.t, torch.t})
_SWAP_METHODS = frozenset({torch.Tensor.transpose, torch.transpose, torch.Tensor.swapaxes,
                           torch.swapaxes, torch.Tensor.swapdims, torch.swapdims})
_PERMUTE_METHODS = frozenset({torch.Tensor.permute, torch.permute})


def _is_transpose(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``func(*args, **kwargs)`` transposes a 2-D tensor ``args[0]``."""
    if _torch_compat.is_transpose_getter(func):
        return True
    try:
        if func in _TRANSPOSE_METHODS:
            return len(args) == 1 and not kwargs
        if func in _SWAP_METHODS:
            swapped = list(args[1:]) + list(kwargs.values())
            return len(swapped) == 2 and all(isinstance(d, int) for d in swapped) \
                and {d % 2 for d in swapped} == {0, 1}
        if func in _PERMUTE_METHODS:
            order = args[1:] if len(args) > 2 else (args[1] if len(args) == 2 else
                                                    kwargs.get("dims", ()))
            return [d % 2 for d in order] == [1, 0]
    except TypeError:  # unhashable func
        return False
    return False


_RESHAPE_METHODS = frozenset({torch.Tensor.view, torch.Tensor.reshape, torch.reshape,
                              torch.Tensor.view_as, torch.Tensor.reshape_as,
                              torch.Tensor.unsqueeze, torch.unsqueeze, torch.Tensor.squeeze,
                              torch.squeeze, torch.Tensor.flatten, torch.flatten})


def _keeps_order(func: Any, args: tuple[Any, ...], result: Any) -> bool:
    """Whether ``result = func(*args)`` is ``args[0]`` reshaped, its entries in the same order."""
    x = args[0]
    if not isinstance(result, Tensor) or result.dtype != x.dtype or result.numel() != x.numel():
        return False
    try:
        if func in _RESHAPE_METHODS:
            return True
        if func is torch.Tensor.__getitem__ and len(args) == 2:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            return all(i is None or i is Ellipsis or i == slice(None) for i in index)
    except TypeError:  # unhashable func
        return False
    return False


_BROADCASTING = frozenset({
    torch.add, torch.sub, torch.mul, torch.div, torch.Tensor.add, torch.Tensor.sub,
    torch.Tensor.mul, torch.Tensor.div, torch.Tensor.__add__, torch.Tensor.__radd__,
    torch.Tensor.__sub__, torch.Tensor.__rsub__, torch.Tensor.__mul__, torch.Tensor.__rmul__,
    torch.Tensor.__truediv__, torch.Tensor.__rtruediv__, torch.Tensor.__iadd__,
    torch.Tensor.__isub__, torch.Tensor.__imul__, torch.Tensor.__itruediv__,
})
_IN_PLACE = frozenset({torch.Tensor.__iadd__, torch.Tensor.__isub__, torch.Tensor.__imul__,
                       torch.Tensor.__itruediv__})
_EXPANDS = frozenset({torch.Tensor.expand, torch.Tensor.expand_as})


_UNBATCHABLE = frozenset({torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu, torch.lstm_cell,
                          torch.gru_cell, torch.rnn_tanh_cell, torch.rnn_relu_cell})
"""Calls ``vmap`` runs once per sample (or refuses), rewritten or not (the other backends run
them as called)."""


# NOTE [metadata calls]: most calls a model makes under the mode only read a tensor's
# metadata (``x.shape``, ``x.size(-1)``, ``x.dim()``, ``x.device``: 35-45 of GPT-2's 190
# calls). They read no entry, so they can neither use a leaf nor make samples interact nor
# meet the batch; the mode hands them straight to torch instead of looking for leaves,
# couplings and taps in their arguments (about 5 µs a call). A tensor shared by the samples
# and still waiting to meet the batch (NOTE [shared taps]) stays pending through them.
_METADATA = frozenset({
    *(inspect.getattr_static(torch.Tensor, name).__get__  # property getters
      for name in ("shape", "dtype", "device", "ndim", "layout", "requires_grad", "is_cuda")),
    torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel,
    torch.Tensor.nelement, torch.Tensor.ndimension, torch.Tensor.stride,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.is_contiguous,
    torch.Tensor.element_size, torch.Tensor.get_device, torch.Tensor.__len__,
})


def reads_metadata(func: Any) -> bool:
    """Whether ``func`` only reads tensors' metadata (NOTE [metadata calls]).

    Example:
        >>> reads_metadata(torch.Tensor.size), reads_metadata(torch.Tensor.add)
        (True, False)
    """
    try:
        return func in _METADATA
    except TypeError:  # unhashable func
        return False


_LayoutCall = tuple[Any, tuple[Any, ...], dict[str, Any]]
"""A call on a shared output: ``(func, the arguments after the tensor, kwargs)``."""

_LAYOUT_CALLS = frozenset({
    torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.unsqueeze,
    torch.unsqueeze, torch.Tensor.squeeze, torch.squeeze, torch.Tensor.permute, torch.permute,
    torch.Tensor.transpose, torch.transpose, torch.Tensor.swapaxes, torch.Tensor.swapdims,
    torch.Tensor.t, torch.t, torch.Tensor.contiguous, torch.Tensor.flatten, torch.flatten,
    torch.Tensor.unflatten, torch.Tensor.movedim, torch.movedim, torch.Tensor.__getitem__,
})


def _is_layout_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                    result: Any) -> bool:
    """Whether ``result = func(*args, **kwargs)`` lays out ``args[0]``'s entries anew.

    Views, reshapes, permutations and basic indexing (full slices, ``None``, ``...``, an int
    or a slice with a step): calls that depend on no other tensor and draw nothing, so they
    can run again on every sample's copy (NOTE [shared taps]).
    """
    try:
        if func not in _LAYOUT_CALLS:
            return False
    except TypeError:  # unhashable func
        return False
    if not isinstance(result, Tensor) or result.dtype != args[0].dtype:
        return False
    others = leaves_of((args[1:], kwargs))
    return not any(isinstance(value, Tensor) for value in others)


def _attention_mask(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                    ) -> tuple[int | str, Tensor, tuple[int, ...]] | None:
    """``(where, mask, scores shape)`` of a ``scaled_dot_product_attention`` call's tensor mask.

    ``where``: its position in ``args`` or its keyword. The mask broadcasts against the
    scores ``[*batch, L, S]`` (NOTE [shared taps]: a relative position bias passed as the
    mask meets the batch there).
    """
    if func is not F.scaled_dot_product_attention or len(args) < 3:
        return None
    query, key = args[0], args[1]
    where: int | str = 3 if len(args) > 3 else "attn_mask"
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    if not (isinstance(mask, Tensor) and isinstance(query, Tensor) and isinstance(key, Tensor)) \
            or mask.dtype == torch.bool or query.dim() < 2 or key.dim() < 2:
        return None
    batch = torch.broadcast_shapes(query.shape[:-2], key.shape[:-2])
    return where, mask, (*batch, query.shape[-2], key.shape[-2])


def _written(kept: tuple[Tensor, int]) -> bool:
    """Whether the storage of ``kept`` (:func:`_torch_compat.version_of`) was written since."""
    owner, version = kept
    return _torch_compat.version(owner) != version


def _unbatchable(func: Any) -> bool:
    """Whether ``vmap`` cannot batch ``func`` (it then runs once per sample)."""
    try:
        return func in _UNBATCHABLE
    except TypeError:  # unhashable func
        return False


def _leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The leaves of ``(args, kwargs)`` (``optree`` beyond one level of lists and tuples).

    Example:
        >>> _leaves((1, [2, 3]), {"a": 4})
        [1, 2, 3, 4]
    """
    leaves: list[Any] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, list | tuple):
            for item in value:
                if isinstance(item, list | tuple | dict):
                    return leaves_of((args, kwargs))
                leaves.append(item)
        elif isinstance(value, dict):
            return leaves_of((args, kwargs))
        else:
            leaves.append(value)
    return leaves


def zero_tap(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A zero tensor of ``shape`` that requires gradients, stored as one element.

    Its gradient still has the full shape: it is the cotangent of whatever it is added to.

    Example:
        >>> tap = zero_tap((2, 3), torch.float32, torch.device("cpu"))
        >>> tap.shape, tap.is_leaf, tap.requires_grad, tap.stride()
        (torch.Size([2, 3]), True, True, (0, 0))
    """
    return torch.zeros((), dtype=dtype, device=device).expand(*shape).requires_grad_()


def _not_a_view(y: Tensor) -> Tensor:
    """``y``, as a non-view of its base where it is a contiguous view of all of it.

    NOTE [tap edges].

    Example:
        >>> x = torch.randn(2, 3, 4, requires_grad=True)
        >>> y = torch.nn.functional.linear(x, torch.randn(5, 4), torch.randn(5))
        >>> y._base is not None, _not_a_view(y)._base is None, torch.equal(_not_a_view(y), y)
        (True, True, True)
    """
    base = y._base
    if base is None or base.grad_fn is None or not y.is_contiguous() \
            or not base.is_contiguous() or base.numel() != y.numel() \
            or y.data_ptr() != base.data_ptr():
        return y
    return torch.ops.aten._unsafe_view(base, y.shape)


def _not_chosen(found: list[tuple[Tensor, LeafRef]], chosen: list[Any]) -> list[LeafRef]:
    """The refs of ``found`` leaves met more often than among the ``chosen`` operands.

    Every occurrence of such a leaf is returned (each is an unrecognised use).

    Example:
        >>> a, b = torch.ones(1), torch.ones(1)
        >>> found = [(a, LeafRef(0)), (b, LeafRef(1)), (a, LeafRef(0))]
        >>> [ref.index for ref in _not_chosen(found, [a, b])], _not_chosen(found[:2], [b, a])
        ([0, 0], [])
    """
    found_ids = [id(leaf) for leaf, _ in found]
    chosen_ids = [id(value) for value in chosen]
    if len(found_ids) == len(chosen_ids) and sorted(found_ids) == sorted(chosen_ids):
        return []  # the common case: every leaf found is a chosen operand, once
    remaining = Counter(found_ids)
    remaining.subtract(chosen_ids)
    return [ref for leaf, ref in found if remaining[id(leaf)] > 0]


def _has_float_tensor(result: Any) -> bool:
    return any(isinstance(leaf, Tensor) and leaf.is_floating_point()
               for leaf in optree.tree_leaves(result))


def describe(func: Any) -> str:
    """A short readable name for a torch function (for reports)."""
    getter = _torch_compat.getter_name(func)
    if getter is not None:
        return getter
    name = getattr(func, "__name__", None) or repr(func)
    qualname = getattr(func, "__qualname__", "")
    if qualname.startswith(("TensorBase.", "Tensor.")):
        return "Tensor." + name
    return name


# NOTE [empty leaves]
# A leaf without entries (numel 0: a device-marker `nn.Parameter(torch.empty(0))`, a rank-0
# adapter, a pruned layer) has an empty Jacobian, so its block is zero and its update empty.
# Its uses have a width of 0, which the rules' factor shapes cannot hold (`reshape(..., -1,
# groups, 0)` is ambiguous): every backend raised torch's errors (session 39). The modes
# that tap uses (TapMode, the eager RecordMode) leave such a leaf untracked, so it is
# planned "unused"; the derivative check reads the largest entry of a gradient as 0 when
# it has none.


class TapMode(TorchFunctionMode):
    """Runs ``f`` recognising, tapping and recording the uses of parameter leaves.

    Args:
        leaves: The tensors ``f`` receives for the leaves (identity is what counts).
        plain: Gradient-free tensors with the leaves' values, used in tapped calls.
        tapped: The leaves whose recognised uses are tapped (``None``: all). Other leaves
            are left to their carriers.
        taps: ``"trace"``, ``"lazy"``, or the pre-made taps of a replay.
        expected: For a replay, the trace's tap records (checked call by call).
        carriers: For a replay, the leaves whose tensors carry gradients (an unrecognised use
            of another leaf means the run left the trace).
        samples: For a batched run, ``B``: outputs shared by the samples are tapped where
            they meet the batch (NOTE [shared taps]).
        keep_acts: Record the activations in a trace too (the check of merged sample dims).
        keep_graph: Record the activations with their autograd graph (a differentiable
            ``G``, NOTE [composition]) instead of detached.
        original_layouts: Give each rewritten call's output the original call's strides
            (NOTE [rewritten layouts]); ``rewrote`` says afterwards whether any call but a
            recurrent kernel was,
            ``recheck_values`` whether one outside ``rules.SETTLED_PER_TRACE`` was (its values
            are compared with ``f``'s own on every call: NOTE [when the values are compared]).
        probe: In a trace, add a zero tap to every tapped call's output too (kept in
            ``probes`` with its tap's index), so that a backward of the traced rows can show
            which positions they reach (NOTE [dead positions]).
        fuse: Whether rewritten LSTM / GRU layers may run as one node (NOTE [fused
            recurrences]); never in a trace or with ``keep_graph`` (:attr:`fuses_recurrences`).

    Example:
        >>> import torch
        >>> w = torch.randn(3, 2)
        >>> with TapMode([w], [w], taps="trace") as mode:
        ...     y = torch.tanh(torch.randn(4, 2) @ w.T)
        >>> [(use.rule, use.role, use.act_first, use.shape.positions)
        ...  for use in mode.recording.uses]
        [('matmul', 'weight', False, 4)]
    """

    restartable = False
    """Its taps and activations count the calls it saw: an evaluation of ``f`` under it is
    never made again from its start (NOTE [ops without a batching rule])."""

    def __init__(self, leaves: Sequence[Tensor], plain: Sequence[Tensor], *,
                 tapped: Collection[int] | None = None,
                 taps: Literal["trace", "lazy"] | Sequence[Tensor] = "trace",
                 expected: Sequence[TapRecord] | None = None,
                 carriers: Collection[int] | None = None, samples: int | None = None,
                 keep_acts: bool = False, keep_graph: bool = False,
                 original_layouts: bool = False, probe: bool = False,
                 fuse: bool = True) -> None:
        super().__init__()
        self._keep_graph = keep_graph
        self._fuse = fuse and not keep_graph and taps != "trace"
        self._probe = probe and taps == "trace"
        self.probes: list[tuple[int, Tensor]] = []
        self._original_layouts = original_layouts
        self.rewrote = False
        self.recheck_values = False
        self._refs: dict[int, LeafRef] = {}
        self._pins: list[Tensor] = list(leaves)  # keep ids valid for the whole run
        for index, leaf in enumerate(leaves):
            if leaf.numel():  # a leaf without entries has no uses to tap (NOTE [empty leaves])
                self._refs.setdefault(id(leaf), LeafRef(index))
        self._plain = list(plain)
        self._tapped = None if tapped is None else frozenset(tapped)
        self._taps = taps
        self._expected = expected
        self._carriers = None if carriers is None else frozenset(carriers)
        self.recording = Recording()
        self.acts: list[Tensor] = []
        self._act_versions: list[tuple[Tensor, int, str]] = []  # NOTE [in-place modifications]
        # NOTE [recurrent tensors modified in place]: each rewritten recurrent call, with the
        # versions of its tensors after it
        self._recurrent_calls: list[tuple[Any, tuple[Any, ...], dict[str, Any],
                                          list[tuple[Tensor, int] | None]]] = []
        self._next_act = 0
        self.made_taps: list[Tensor | GradientEdge] = []
        # the outputs of tap edges (a trace's: of calls a run taps by edge), by node and
        # output number: NOTE [hooks on taps]
        self._edge_outputs: dict[tuple[int, int], int] = {}
        self._samples = samples
        self._keep_acts = keep_acts or taps != "trace"
        # NOTE [shared taps]: id -> (tap index, the tapped output, the layout calls since)
        self._pending: dict[int, tuple[int, Tensor, tuple[_LayoutCall, ...]]] = {}
        # NOTE [shared taps]: a pending output once it met the batch -> (the samples' dim
        # counted from the end, the tapped expansion, (storage owner, version) then)
        self._met: dict[int, tuple[tuple[int, int], Tensor, tuple[Tensor, int]]] = {}
        self.built_taps: set[int] = set()
        """Taps whose merged samples are laid out by the mode, not by ``f`` (their order
        needs no check of ``f``'s activations: :meth:`_expand_built`)."""
        self._met_taps: set[int] = set()  # shared taps already expanded where they met it
        self.not_batched: str | None = None
        self._contexts: list[contextlib.ExitStack] = []
        self._grad_at_entry = True
        self._hooks_at_entry: Any = None
        self._transforms_at_entry = 0

    def __enter__(self) -> TapMode:
        if not self._contexts:  # NOTE [uses with gradients off]
            self._grad_at_entry = torch.is_grad_enabled()
            self._hooks_at_entry = _torch_compat.saved_tensor_hooks()
            self._transforms_at_entry = len(_torch_compat.functorch_transforms())
        contexts = contextlib.ExitStack()
        contexts.enter_context(tapped_evaluation())  # nested calls refuse: NOTE [composition]
        self._contexts.append(contexts)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._contexts.pop().__exit__(*exc)
        if not self._contexts and exc[0] is None:
            self._check_versions()

    def _check_versions(self) -> None:
        """Raise if ``f`` changed a kept activation in place (NOTE [in-place modifications])."""
        for owner, version, rule in self._act_versions:
            now = _torch_compat.version(owner)
            if now != version:
                raise ModifiedInPlace(
                    f"an input of a {rule} call that uses a parameter, modified in place "
                    f"after that call (version {version} then, {now} at the end)")
        calls, self._recurrent_calls = self._recurrent_calls, []  # (their tensors let go)
        for func, args, kwargs, kept in calls:
            modified = [i for i, owned in enumerate(kept)
                        if owned is not None and _written(owned)]
            if modified and fused_call_refuses(func, args, kwargs, modified):
                raise ModifiedInPlace(
                    f"a tensor of a {describe(func)} call (an nn.LSTM, nn.GRU or nn.RNN), "
                    "modified in place after that call: torch's kernel keeps it for its "
                    "backward (NOTE [recurrent tensors modified in place])")

    # -- bookkeeping ------------------------------------------------------------------------

    def _ref(self, value: Any) -> LeafRef | None:
        return self._refs.get(id(value)) if isinstance(value, Tensor) else None

    def finish(self) -> None:
        """Check that a replay used every tap it was given."""
        if isinstance(self._taps, Sequence) and not isinstance(self._taps, str):
            if len(self.recording.taps) != len(self._taps):
                raise TraceMismatch(f"the run tapped {len(self.recording.taps)} calls, the "
                                    f"trace {len(self._taps)}")
        met = {tap for tap, _, _ in self._pending.values()} <= self._met_taps
        if not met and self.not_batched is None:
            self.not_batched = "a tapped output shared by the samples never met the batch"

    # -- NOTE [shared taps] -------------------------------------------------------------------
    # In a batched run (``samples`` given), a tapped call whose output has the trace's shape
    # does not depend on the sample: e.g. BERT's and GPT-2's position embeddings, looked up
    # from ``position_ids`` of shape ``[1, T]`` and broadcast against the ``[B, T, d]`` token
    # embeddings. Its cotangent is the sum over the samples, which is not the per-sample
    # factor. Such an output gets no tap at first; where it meets the batch in a
    # broadcasting op (``+``, ``-``, ``*``, ``/``, ``expand``) whose result has ``B`` in
    # exactly one of its size-1 dims, or in exactly one dim that broadcasting prepends to it
    # (nanoGPT's ``[T, d]`` positions of ``arange(T)`` against ``[B, T, d]`` tokens: they ran
    # the per-sample vmap pass before session 48, ~1.9x a backward against ~1.5x), it is
    # expanded along that dim and tapped there, so the tap holds every sample's own
    # cotangent. Ops that return it unchanged (``.to(device)``, dropout in eval mode) keep it
    # pending; so do calls that lay its entries out anew (``unsqueeze``, ``view``,
    # ``permute``, basic indexing: :func:`_is_layout_call`), which are remembered: where such
    # a view meets the batch, the tap sits on the tapped output itself (where the rule's
    # factors are), its samples merged into its first dim sample after sample (laid out by
    # the mode: :attr:`TapMode.built_taps`), and the layout calls run again on every
    # sample's copy under ``vmap`` (a Swin-style relative position bias, gathered, viewed,
    # permuted and unsqueezed before it is added to the scores). The same built tap serves a
    # meeting where the samples are merged with other entries in one dim (Swin adds its bias
    # to ``B·nW`` windows: each sample's copy repeated along it, sample after sample), and
    # one inside ``scaled_dot_product_attention``, whose ``attn_mask`` broadcasts against the
    # scores (Swin's blocks without a shift mask pass the bias there); where the samples are
    # laid out otherwise, the first run's derivative check finds a sample's rows on another's
    # slice. (HF's Swin ran the per-sample vmap pass before session 48.) Any other use,
    # several candidate dims, an in-place op on it, two of its views meeting the batch, or a
    # run that ends with it pending, stops the batched run (:class:`NotBatched`), and the
    # backend takes the per-sample ``vmap`` way instead.
    # Once it met the batch, the output itself still holds no sample's cotangent: a later
    # call that uses it again meets the batch the same way (``x + pe`` then ``2 * x + pe``)
    # and takes the same tapped expansion, or stops the batched run. (It used to run as
    # called, its cotangent lost to the tap: ``G`` 0.67 off for two additions of one
    # position embedding, 0.81 for ``(x + pe).sum() + pe.sum()``; session 48.) A call that
    # returns it written in place (``pe.mul_(2)``, ``F.relu(pe, inplace=True)``) changed it:
    # the tap would sit after that change, the rule's factors before it (0.07-0.25 off,
    # session 48), so that stops the batched run too, as does a write after it met the batch.

    def _is_shared(self, tap_index: int, shape: Sequence[int]) -> bool:
        expected = self._expected
        return (self._samples is not None and self._samples > 1 and expected is not None
                and tap_index < len(expected) and tuple(shape) == expected[tap_index].shape)

    def _give_up(self, why: str) -> NotBatched:
        self.not_batched = self.not_batched or why
        return NotBatched(why)

    def _meet_batch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                    leaves: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
        """``args`` and ``kwargs``, pending shared outputs expanded and tapped; or a result."""
        pending = [i for i, a in enumerate(args) if self._is_shared_output(a)]
        nested = sum(self._is_shared_output(a) for a in leaves)
        if not nested:
            return args, kwargs, NotImplemented
        mask = _attention_mask(func, args, kwargs)
        if mask is not None and self._is_shared_output(mask[1]) and nested == 1:
            where, y, out = mask  # NOTE [shared taps]: a mask meets the scores' batch
            expanded = self._meet(func, y, out)
            if isinstance(where, int):
                return (*args[:where], expanded, *args[where + 1:]), kwargs, NotImplemented
            return args, {**kwargs, where: expanded}, NotImplemented
        try:
            known = func in _BROADCASTING or func in _EXPANDS
        except TypeError:
            known = False
        if not known or nested != len(pending) or (func in _IN_PLACE and 0 in pending):
            kept = _torch_compat.version_of(args[pending[0]]) if len(pending) == 1 else None
            result = func(*args, **kwargs)
            if kept is not None and result is args[pending[0]] and not _written(kept):
                return args, kwargs, result  # unchanged (not written in place): still pending
            entry = self._pending.get(id(args[0])) if pending == [0] and nested == 1 else None
            if entry is not None and kept is not None and not _written(kept) \
                    and _is_layout_call(func, args, kwargs, result):
                tap_index, root, chain = entry
                self._pending[id(result)] = (tap_index, root, (*chain, (func, args[1:], kwargs)))
                self._pins.append(result)
                return args, kwargs, result
            raise self._give_up(f"a tapped output shared by the samples is used by "
                                f"{describe(func)}, where it does not meet the batch")
        tensors = [a for a in args if isinstance(a, Tensor)]
        if func in _EXPANDS:
            out = tuple(func(*args, **kwargs).shape)  # a view
        else:
            out = tuple(torch.broadcast_shapes(*(t.shape for t in tensors)))
        new_args = list(args)
        for i in pending:
            new_args[i] = self._meet(func, args[i], out)
        return tuple(new_args), kwargs, NotImplemented

    def _meet(self, func: Any, y: Tensor, out: tuple[int, ...]) -> Tensor:
        """Shared output ``y`` expanded and tapped where it meets the batch in ``out``.

        The samples' dim (counted from the end) is the one dim of ``out`` that is ``B`` where
        ``y`` has size 1 or none (broadcasting prepends it); failing that, the one such dim
        that is a multiple ``B·k`` (the samples merged with ``k`` entries each, sample after
        sample: Swin's windows; the first run's derivative check finds another order).
        """
        samples = self._samples
        assert samples is not None
        offset = len(out) - y.dim()
        candidates = [(len(out) - q, out[q]) for q in range(max(offset, 0))]
        candidates += [(y.dim() - d, out[offset + d]) for d in range(y.dim())
                       if y.shape[d] == 1 and offset >= 0]
        places = [c for c in candidates if c[1] == samples] or \
            [c for c in candidates if c[1] > samples and c[1] % samples == 0]
        if len(places) != 1 or (places[0][0] > y.dim() and y.dim() == 0):
            raise self._give_up("a tapped output shared by the samples meets the batch in "
                                f"{describe(func)} along {len(places)} candidate dims")
        place = places[0]
        met = self._met.get(id(y))
        if met is None:
            kept = _torch_compat.version_of(y)
            if kept is None:
                raise self._give_up("a tapped output shared by the samples keeps no version "
                                    "counter")
            expanded = self._expand_shared(y, *place)
            self._met[id(y)] = (place, expanded, kept)
            return expanded
        if met[0] == place and not _written(met[2]):
            return met[1]
        raise self._give_up("a tapped output shared by the samples meets the batch again in "
                            f"{describe(func)}, along another dim or written in place since")

    def _is_shared_output(self, value: Any) -> bool:
        """Whether ``value`` is a shared tapped output, pending or met (NOTE [shared taps])."""
        return isinstance(value, Tensor) and (id(value) in self._pending
                                              or id(value) in self._met)

    def _expand_shared(self, y: Tensor, place: int, size: int) -> Tensor:
        """``y`` expanded to ``size`` along the samples' dim (``place``, from the end), tapped.

        Where a dim of ``y`` of size 1 takes exactly the samples, so does the tap. Otherwise
        (:meth:`_expand_built`) the tap is built on the tapped output itself.
        """
        tap_index, root, chain = self._pending.pop(id(y))
        samples = self._samples
        assert samples is not None
        if tap_index in self._met_taps:
            raise self._give_up("a tapped output shared by the samples meets the batch through "
                                "two of its views")
        self._met_taps.add(tap_index)
        if chain or place > y.dim() or size != samples:
            return self._expand_built(tap_index, root, chain, y, place, size)
        dim = y.dim() - place
        shape = (*y.shape[:dim], samples, *y.shape[dim + 1:])
        tap = zero_tap(shape, y.dtype, y.device)
        self._set_tap(tap_index, tap)
        return y.expand(shape) + tap

    def _expand_built(self, tap_index: int, root: Tensor, chain: tuple[_LayoutCall, ...],
                      y: Tensor, place: int, size: int) -> Tensor:
        """:meth:`_expand_shared` of ``y``, made from the tapped output ``root`` by ``chain``.

        The tap sits on ``root`` (the rule's factors are in its layout), its samples merged
        into ``root``'s first dim, each sample's entries together (laid out here, not by
        ``f``: :attr:`built_taps`); the layout calls run on every sample's copy (``vmap``),
        which gives ``y`` with the samples first. They go where ``y`` meets the batch: a dim
        of ``y`` of size 1, or one that broadcasting prepends (``x + pe`` of ``[B, T, d]`` and
        ``[T, d]``, as nanoGPT adds its positions), each sample repeated ``size / B`` times
        there where the samples are merged with other entries (Swin's ``B·nW`` windows).
        """
        samples = self._samples
        assert samples is not None
        if root.dim() == 0:
            raise self._give_up("a tapped scalar shared by the samples meets the batch "
                                "without a dim of its own")
        shape = (samples * root.shape[0], *root.shape[1:])
        tap = zero_tap(shape, root.dtype, root.device)
        stacked = root.unsqueeze(0).expand(samples, *root.shape).reshape(shape) + tap
        self.built_taps.add(tap_index)
        self._set_tap(tap_index, tap)

        def replay(value: Tensor) -> Tensor:
            for func, rest, kwargs in chain:
                value = func(value, *rest, **kwargs)
            return value

        per_sample = stacked.view(samples, *root.shape)
        if chain:
            per_sample = torch.vmap(replay)(per_sample)  # [B, *y.shape]
        if place <= y.dim():  # y's size-1 dim, after the samples' dim 0 here
            dim = y.dim() - place
            per_sample = per_sample.movedim(0, dim)  # [..., B, 1, ...]
        else:
            dim = 0
            per_sample = per_sample.view(samples, *(1,) * (place - y.dim()), *y.shape)
        repeated = per_sample.expand(*per_sample.shape[:dim + 1], size // samples,
                                     *per_sample.shape[dim + 2:])
        return repeated.flatten(dim, dim + 1)

    def _set_tap(self, tap_index: int, tap: Tensor) -> None:
        """Make ``tap`` the tap of shared output ``tap_index``, its shape the recorded one."""
        self.made_taps[tap_index] = tap
        record = self.recording.taps[tap_index]
        self.recording.taps[tap_index] = TapRecord(tuple(tap.shape), record.dtype, record.rule)
        numel = tap.numel()
        self.recording.uses = [dataclasses.replace(use, shape=use.layout.shape(numel))
                               if use.tap == tap_index else use for use in self.recording.uses]

    def note_rows(self, rows: Tensor) -> None:
        """Note a leaf that ``f`` returned as its output, itself or a view of it.

        No call used it, so no use was recorded and its block would be zero: its rows come
        from the graph instead (an unrecognised use; session 26: ``f = lambda p, x: p["b"]``,
        or ``p["b"].view(...)``, ``.flatten()``, ``.to(dtype)`` of the same dtype, gave
        ``G = 0`` on the structured backend).
        """
        ref = self._ref(rows)
        if ref is not None:
            self._note_unrecognised([ref], "returned as the output", rows)

    def note_unseen_uses(self, rows: Tensor, carriers: Sequence[Tensor]) -> None:
        """Note the leaves ``rows`` depend on through calls the mode did not see.

        NOTE [unseen uses]: a recognised use runs on a plain copy of its leaf, and every call
        the mode sees using a leaf's own tensor is noted unrecognised; so when the graph of
        ``rows`` reaches a leaf's tensor (its carrier) that has no unrecognised use, a call the
        mode cannot see used it: a TorchScript function (``torch.jit.script``), whose ops run
        in its interpreter, or a C++ extension's op. Without a use, the leaf's block was
        zero or partial (session 27: ``x @ w.t()`` in a scripted helper, ``G`` 0.49 off on
        structured). Its rows now come from the graph, as for any unrecognised use.
        """
        for index in _torch_compat.reached_leaves(rows, carriers):
            if index not in self.recording.unrecognised:
                self._note_unrecognised([LeafRef(index)], UNSEEN_USE, rows)

    def _note_unrecognised(self, refs: list[LeafRef], name: str, result: Any) -> None:
        flops = sum(leaf.numel() for leaf in optree.tree_leaves(result)
                    if isinstance(leaf, Tensor))
        for ref in refs:
            if self._carriers is not None and ref.index not in self._carriers:
                raise TraceMismatch(f"unrecognised use of leaf {ref.index} in {name} that the "
                                    "trace did not see")
            names = self.recording.unrecognised.setdefault(ref.index, [])
            if name not in names:
                names.append(name)
            width = self._plain[ref.index].numel() // max(1, self._plain[ref.index].shape[0]) \
                if self._plain[ref.index].dim() > 1 else 1
            self.recording.unrecognised_flops[ref.index] = \
                self.recording.unrecognised_flops.get(ref.index, 0) + flops * width

    # -- the mode ---------------------------------------------------------------------------

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        recording = self.recording
        recording.calls += 1
        if reads_metadata(func):  # NOTE [metadata calls]
            return func(*args, **kwargs)
        how = _torch_compat.self_differentiation(func)
        if how is not None:  # NOTE [f that differentiates itself]
            raise DifferentiatesItself(how)
        new_hooks = self._under_new_hooks()
        if new_hooks and _CHECKPOINT_REGION not in recording.transform_refusals:
            recording.transform_refusals.append(_CHECKPOINT_REGION)
        if func in GRADIENT_HOOKS:
            recording.gradient_hooks = True
            target = args[0] if args else None
            self._check_hook_target(target)
            if isinstance(target, Tensor) and not target.requires_grad:  # f guards by grad mode
                if recording.hooked_leaf is not None:  # a shared tap's plain factor: no pass
                    raise HookOnTap(recording.hooked_leaf)  # sees the hook
                if self._taps == "trace":  # a trace's plain leaves: it only records
                    return torch.utils.hooks.RemovableHandle(OrderedDict())
        if func is Tensor.retain_grad and _RETAIN_GRAD not in recording.transform_refusals:
            recording.transform_refusals.append(_RETAIN_GRAD)  # torch.func refuses it
        if func in _FUSED_RNNS and len(args) > 1 and isinstance(args[1], Tensor) \
                and _PACKED_RNN not in recording.transform_refusals:  # batch_sizes: packed
            recording.transform_refusals.append(_PACKED_RNN)
        why = coupling_op(func, args, kwargs)
        if why is not None and why not in recording.coupling:
            recording.coupling.append(why)
        if _unbatchable(func) and describe(func) not in recording.unbatchable:
            recording.unbatchable.append(describe(func))
        leaves = _leaves(args, kwargs)
        if self._pending or self._met:  # NOTE [shared taps]
            args, kwargs, result = self._meet_batch(func, args, kwargs, leaves)
            if result is not NotImplemented:
                return result
            leaves = _leaves(args, kwargs)
        found = [(leaf, ref) for leaf in leaves if (ref := self._ref(leaf)) is not None]
        if not found:
            return func(*args, **kwargs)
        why = self._not_tapped_here(new_hooks)
        if why is not None:  # NOTE [uses with gradients off]
            result = func(*args, **kwargs)
            self._note_unrecognised([ref for _, ref in found], f"{describe(func)} {why}", result)
            return result
        if len(found) == 1 and args and args[0] is found[0][0]:
            ref = found[0][1]
            if args[0].dim() == 2 and ref.view_shape is None \
                    and _is_transpose(func, args, kwargs):
                result = func(*args, **kwargs)
                self._refs[id(result)] = LeafRef(ref.index, not ref.transposed)
                self._pins.append(result)
                return result
            if not ref.transposed and ref.view_shape is None:  # NOTE [row gathers]
                gather = row_gather(func, args, kwargs)
                if gather is not None:
                    return self.__torch_function__(F.embedding, types, gather, {})
                rows = row_slice(func, args, kwargs)
                if rows is not None:  # whole rows of the table viewed [-1, d]
                    table = args[0] if args[0].dim() == 2 else self.__torch_function__(
                        torch.Tensor.reshape, types, (args[0], -1, args[0].shape[-1]), {})
                    return self.__torch_function__(F.embedding, types, (rows, table), {})
            if not ref.transposed and not kwargs and (
                    func in _RESHAPE_METHODS or func is torch.Tensor.__getitem__):
                result = func(*args, **kwargs)
                if _keeps_order(func, args, result):
                    self._refs[id(result)] = LeafRef(ref.index, view_shape=tuple(result.shape))
                    self._pins.append(result)
                    return result
                self._note_unrecognised([ref], describe(func), result)
                return result
        rewrite = rewrite_for(func)
        if rewrite is not None:  # it enters the mode where the rules must see its calls
            result = rewrite(args, kwargs, self)  # (NOTE [attention rewrite])
            if result is not NotImplemented:
                keeps_layout = rewrite_keeps_layout(func, args, kwargs)
                self.rewrote = self.rewrote or not keeps_layout  # NOTE [rewritten layouts]
                self.recheck_values = self.recheck_values or func not in SETTLED_PER_TRACE
                if func in RECURRENT_KERNELS:  # NOTE [recurrent tensors modified in place]
                    self._recurrent_calls.append((func, args, kwargs, [
                        _torch_compat.version_of(t) for t in call_tensors(args, kwargs, result)]))
                if self._original_layouts and not keeps_layout:  # NOTE [rewritten layouts]
                    devices = [t.device for t in call_tensors(args, kwargs, result)
                               if t.device.type != "cpu"]
                    state = RngState.capture(devices, host=False)  # the rewrite drew what
                    # the call draws (torch ops: the host generators are none of theirs)
                    with torch.no_grad():
                        original = func(*args, **kwargs)
                    state.restore()
                    result = optree.tree_map(laid_out_like, result, original, none_is_leaf=True)
                return result
        rule = rule_for(func)
        match = rule.match(func, args, kwargs) if rule is not None else None
        if match is not None:
            result = self._tap(match, found)
            if result is not None:
                return result
        result = NotImplemented
        if func is F.embedding:  # NOTE [embedding conventions]: per-sample carriers too
            result = embedding_with_conventions(args, kwargs)
        if result is NotImplemented:
            result = func(*args, **kwargs)
        if any(result is leaf for leaf, _ in found):  # p.to(p.dtype), p.contiguous(): no use
            return result
        if _has_float_tensor(result):
            self._note_unrecognised([ref for _, ref in found], describe(func), result)
        return result

    def _recognised(self, match: Match) -> list[tuple[int, LeafRef, Role]]:
        chosen: list[tuple[int, LeafRef, Role]] = []
        for i, operand in enumerate(match.operands):
            ref = self._ref(operand.value)
            if ref is None or (self._tapped is not None and ref.index not in self._tapped):
                continue
            if operand.layout is not None:
                # an elementwise use sees entries one by one: a reshaped view is the same
                # use, a transpose is not; other rules need the leaf's own layout
                # (and a lookup, whose table a row-major view keeps in the leaf's order)
                if not ref.transposed if operand.layout.elementwise or \
                        operand.layout.act_is_index else ref.view_shape is None:
                    chosen.append((i, ref, "weight"))
            elif operand.bias_of is not None and not ref.transposed:
                chosen.append((i, ref, "bias"))
        return chosen

    def _under_new_hooks(self) -> bool:
        """Whether saved-tensor hooks not in force at the mode's entry are (a checkpoint)."""
        hooks = _torch_compat.saved_tensor_hooks()  # a new tuple each time: compare its items
        return hooks is not None and hooks != self._hooks_at_entry

    def _not_tapped_here(self, new_hooks: bool) -> str | None:
        """Why no call may be tapped here, if so (NOTE [uses with gradients off]).

        ``new_hooks``: :meth:`_under_new_hooks` for this call.
        """
        if self._grad_at_entry and not torch.is_grad_enabled():
            return ("with gradients off (inside a custom autograd.Function's forward or "
                    "torch.no_grad)")
        if new_hooks:
            return ("under saved-tensor hooks (a torch.utils.checkpoint region, whose backward "
                    "recomputes it without taps)")
        if len(_torch_compat.functorch_transforms()) > self._transforms_at_entry:
            return "inside a torch.func transform of f's own (torch.vmap, grad, jvp in f)"
        return None

    def _check_hook_target(self, tensor: Any) -> None:
        """Note a gradient hook on a tap edge's tensor or on a leaf (NOTE [hooks on taps])."""
        if not isinstance(tensor, Tensor):
            return
        if id(tensor) in self._refs or self._is_shared_output(tensor):
            # a parameter (a pruning mask on its gradient), a view of one, or a tensor made
            # of parameters only: the blocks come from the taps' factors, never through it
            self.recording.hooked_leaf = "a parameter, or a tensor made of parameters only,"
            return
        if tensor.grad_fn is None:
            return
        index = self._edge_outputs.get((id(tensor.grad_fn), tensor.output_nr))
        if index is not None:  # its record is in: a hook comes after the call
            self.recording.hooked_tap = self.recording.taps[index].rule

    def _tap(self, match: Match, found: list[tuple[Tensor, LeafRef]]) -> Tensor | None:
        chosen = self._recognised(match)
        if not chosen:
            return None
        others = _not_chosen(found, [match.operands[i].value for i, _, _ in chosen])
        values = [operand.value for operand in match.operands]
        for i, ref, _ in chosen:
            plain = self._plain[ref.index]
            if plain.dtype != match.operands[i].value.dtype:  # module.to(dtype) inside f
                raise ParameterConverted(f"{match.rule}'s {plain.dtype} parameter is "
                                         f"{match.operands[i].value.dtype} there")
            values[i] = plain.T if ref.transposed else (
                plain if ref.view_shape is None else plain.reshape(ref.view_shape))
        y = match.compute(*values)
        if others:
            self._note_unrecognised(others, f"{match.rule} (as an activation)", y)
        tap_index = len(self.recording.taps)
        record = TapRecord(tuple(y.shape), y.dtype, match.rule)
        # a trace notes the outputs a run would tap by edge, before its probe tap is added
        edge_like = self._taps == "trace" and y.grad_fn is not None \
            and _not_a_view(y)._base is None
        if self._taps == "lazy" and self._is_shared(tap_index, y.shape):  # NOTE [shared taps]
            self.made_taps.append(y)  # replaced by the tap where y meets the batch
            self._pending[id(y)] = (tap_index, y, ())
            self._pins.append(y)
        elif self._taps == "lazy" and y.grad_fn is not None \
                and (plain := _not_a_view(y))._base is None:  # NOTE [tap edges]
            y = plain
            self.made_taps.append(_torch_compat.gradient_edge(y))
            self._edge_outputs[(id(y.grad_fn), y.output_nr)] = tap_index  # NOTE [hooks on taps]
        elif self._taps == "lazy":  # no node, or a strided view (NOTE [tap edges])
            tap = zero_tap(y.shape, y.dtype, y.device)
            self.made_taps.append(tap)
            y = y + tap
        elif not isinstance(self._taps, str):
            expected = self._expected
            if tap_index >= len(self._taps) or expected is None or expected[tap_index] != record:
                raise TraceMismatch(f"tapped call {tap_index} ({match.rule}, output "
                                    f"{tuple(y.shape)}) differs from the trace")
            y = y + self._taps[tap_index]
        elif self._probe and y.is_floating_point():  # NOTE [dead positions]
            probe = zero_tap(y.shape, y.dtype, y.device)
            self.probes.append((tap_index, probe))
            y = y + probe
        if edge_like and y.grad_fn is not None:
            self._edge_outputs[(id(y.grad_fn), y.output_nr)] = tap_index  # NOTE [hooks on taps]
        self.recording.taps.append(record)
        self._record_uses(match, chosen, tap_index, y.numel())
        return y

    def _record_uses(self, match: Match, chosen: list[tuple[int, LeafRef, Role]],
                     tap_index: int, out_numel: int) -> None:
        acts: dict[int, int] = {}
        for i, ref, role in chosen:
            operand = match.operands[i]
            layout = operand.layout if role == "weight" else operand.bias_of
            assert layout is not None
            act_index = None
            if role == "weight":
                assert operand.act is not None
                act_index = acts.get(id(operand.act))
                if act_index is None:
                    act_index = acts[id(operand.act)] = self._next_act
                    self._next_act += 1
                    if self._keep_acts:
                        self.acts.append(operand.act if self._keep_graph
                                         else operand.act.detach())
                        kept = _torch_compat.version_of(operand.act)
                        if kept is not None:
                            self._act_versions.append((*kept, match.rule))
            self.recording.uses.append(UseRecord(
                leaf=ref.index, role=role, rule=match.rule, layout=layout,
                act_first=layout.act_first != ref.transposed, tap=tap_index, act=act_index,
                shape=layout.shape(out_numel),
                act_shape=None if operand.act is None or role != "weight"
                else tuple(operand.act.shape),
            ))

    # -- NOTE [step taps] ---------------------------------------------------------------------
    # A recurrent net applies ``W_hh`` once per step (NOTE [recurrent rewrite]). Tapping each
    # step's call makes ``T`` taps, ``T`` uses and ``T`` trips through this mode; instead the
    # rewrite asks for one tap of all the steps' outputs (:meth:`tap_steps`), computes the
    # steps itself with the plain copies it returns, hands step ``t``'s output to
    # :meth:`step_output` (which adds the tap's slice ``t``), and at the end records the uses
    # once with the stacked activations of all steps (:meth:`record_steps`): one use of ``T``
    # times the positions, the same factors the per-step taps give once taken together (NOTE
    # [uses taken together]). The eager recording answers the same three calls its own way
    # (NOTE [eager step taps]).
    # Where the steps' outputs are only added to the slices of an earlier tapped output
    # (an LSTM's gates are ``xs[t] + h W_hhᵀ + b_hh``, ``xs`` the tapped input projection),
    # that tap's cotangent is already theirs: the uses join it (``share``), no tap is made.

    def tap_steps(self, match: Match, steps: int, step_shape: Sequence[int],
                  dtype: torch.dtype, device: torch.device, *, dim: int = 0,
                  share: int | None = None) -> StepTap | None:
        """One tap for ``steps`` calls like ``match`` (NOTE [step taps]), or ``None``.

        The steps are along ``dim`` of the tap (and of the activations given to
        :meth:`record_steps`). ``share``: an earlier tap of the same shape whose cotangent is
        these calls' (their outputs are only ever added to it); the uses join it and no tap
        is made.
        ``None`` when an operand is a leaf the mode does not tap here, when no operand is a
        tapped leaf, or when the output could be shared by the samples (NOTE [shared
        taps]): the caller then makes the calls one by one under the mode.
        """
        chosen = self._recognised(match)
        picked = {i for i, _, _ in chosen}
        if not chosen or any(self._ref(operand.value) is not None and i not in picked
                             for i, operand in enumerate(match.operands)) or any(
                self._ref(operand.act) is not None for operand in match.operands):
            return None
        shape = (*step_shape[:dim], steps, *step_shape[dim:])
        values = [operand.value for operand in match.operands]
        for i, ref, _ in chosen:
            plain = self._plain[ref.index]
            if plain.dtype != match.operands[i].value.dtype:  # module.to(dtype) inside f
                raise ParameterConverted(f"{match.rule}'s {plain.dtype} parameter is "
                                         f"{match.operands[i].value.dtype} there")
            values[i] = plain.T if ref.transposed else plain
        if share is not None:
            if self.recording.taps[share].shape != shape:
                return None
            return StepTap(share, tuple(values), None)
        tap_index = len(self.recording.taps)
        if self._taps == "lazy" and self._is_shared(tap_index, shape):
            return None
        record = TapRecord(shape, dtype, match.rule)
        tap: Tensor | None = None
        if self._taps == "lazy":
            tap = zero_tap(shape, dtype, device)
            self.made_taps.append(tap)
        elif not isinstance(self._taps, str):
            expected = self._expected
            if tap_index >= len(self._taps) or expected is None or expected[tap_index] != record:
                raise TraceMismatch(f"tapped steps {tap_index} ({match.rule}, output {shape}) "
                                    "differ from the trace")
            tap = self._taps[tap_index]
        self.recording.taps.append(record)
        return StepTap(tap_index, tuple(values), None if tap is None else tap.unbind(dim), tap)

    @property
    def fuses_recurrences(self) -> bool:
        """Whether a rewritten LSTM or GRU layer may run as one node (NOTE [fused recurrences]).

        Not where the pass keeps a differentiable graph (those nodes are differentiable once),
        nor in a pass that only plans (a trace, ``auto``'s planning forward): an ``f`` that
        differentiates its own recurrence makes the node raise, which there would stop the
        plan instead of the structured run that ``auto`` then passes over.
        """
        return self._fuse

    def step_output(self, step_tap: StepTap, t: int, y: Tensor) -> Tensor:
        """Step ``t``'s output ``y`` of a :meth:`tap_steps` tap, with its slice of the tap."""
        return y if step_tap.steps is None else y + step_tap.steps[t]

    def record_steps(self, step_tap: StepTap, match: Match) -> None:
        """Record the uses of a :meth:`tap_steps` tap; ``match`` has every step's activation."""
        numel = math.prod(self.recording.taps[step_tap.index].shape)
        self._record_uses(match, self._recognised(match), step_tap.index, numel)
