"""``torchgram.autograd.record``: seeing the structured layers of an eager forward as it runs.

# NOTE [eager recording]
``with tg.autograd.record(): losses = loss_fn(model(x), y)`` runs the user's forward under a
``TorchFunctionMode`` (:class:`RecordMode`) that changes nothing it computes: every call runs
as written, on the user's tensors. It notes, for every call a structured rule recognises
(``rules.RULES``: linear, matmul, conv, embedding, layer/group norm; self-attention and fused
RNNs through their rewrites, NOTE [attention rewrite], NOTE [eager step taps]) whose weight
or bias **is** a tensor that requires grad and is a leaf (an ``nn.Parameter``, discovered as
it is used):

* the call's output ``y``: not the tensor, but where its cotangent arrives in the graph, its
  node's sequence number (``Node._sequence_nr()``, unique per thread) and ``output_nr``; the
  Gramian's pass finds that node again by walking the graph from the outputs and asks
  autograd for ``∂out/∂y`` there (a ``GradientEdge``), so no zero "tap" is added and the
  graph is exactly the one the user would have built;
* the activation (the other operand), detached: a view sharing its storage, whose version
  counter says whether it was later changed in place;
* the nodes of the call that hold the edges to the leaf (``AddmmBackward0`` for a bias,
  ``TBackward0`` for a linear weight, ...), by sequence number: the Gramian checks that every
  edge into the leaf's ``AccumulateGrad`` in the graph comes from such a node, so a use the
  recording did not see (before the ``with`` block, inside a custom ``autograd.Function``, in
  an op no rule covers) can never be missed: that leaf goes to the graph walk instead.

Every node the recording names is also marked as its own (NOTE [recorded nodes]): a node of
the graph is taken for a recorded one only if it carries that mark.

A recognised call's output that is later broadcast against other tensors by ``+`` / ``-``
/ ``*`` / ``expand`` is noted there too (an :class:`EagerMeeting`): a position embedding looked up
with ``[1, T]`` ids meets the batch where it is added to the ``[B, T, d]`` token embeddings
(NOTE [eager shared taps]).

Any other call that involves a leaf and returns a floating tensor is an *unrecognised* use
(the leaf is then walked); calls that make samples interact (batch-norm in training mode, ...)
are noted, as are ``Tensor.register_hook`` / ``retain_grad`` calls (NOTE [eager taps]).
A block that differentiates its own computation (``torch.autograd.grad(...,
create_graph=True)``: NOTE [f that differentiates itself]) is noted too, and none of its
leaves is read from the taps: the derivative formulas of that backward use the weights
through the very nodes the recorded calls made (a linear's saved ``W.T``), so the check of
the edges above cannot see those uses (session 37: 0.73 off on a tanh MLP's input-gradient
residual).

**Lifetimes.** Nothing is written on the user's modules or tensors, and no hook is installed.
The recording is referenced from the ``metadata`` dict of the tapped nodes (and weakly from
a per-thread slot), so it lives exactly as long as the recorded graph: dropping the outputs
frees it. The activations it holds are released earlier when they cannot be used any more:
when the next ``record()`` starts on the same thread (one live recording per thread: so a
training loop never holds two steps' activations), after a ``tg.autograd.gramian`` /
``tg.autograd.backward`` call with ``retain_graph=False`` on a graph that holds a call it
tapped (the call frees that graph: nothing can use them any more), or on
:meth:`Recording.close`. An expired recording is simply not used (nor extended, if the block
is still running): the Gramian is then computed by the graph walk, exactly.

# NOTE [recorded nodes]
A sequence number names a node only within its thread: each thread counts from zero, so a
graph built by another thread (the same model on other data, a ``DataParallel`` replica,
the nodes a CUDA backward with ``create_graph=True`` makes on the device's thread) has nodes
with the recording's numbers and names. Matching by number alone, the recording's
activations were contracted with that graph's cotangents (a hunt found 0.11 off,
relative, and ``.grad`` 1.78 off). So the recording marks every node it names: the taps'
and the steps' outputs, the meetings, and every node of a recognised call (its holders and
callers, at most :data:`_HOLDER_SEARCH`), by adding itself to the list under
:data:`METADATA_KEY` in the node's ``metadata`` (a list: nested blocks may both mark a
node). :meth:`Recording.owns` reads it back, and the Gramian takes a node for a recorded one
only if the recording owns it: a graph the recording did not make, or the part of a graph
another thread or a later forward added, has no node it owns, and its leaves are walked.
The nodes a step tap's steps made (NOTE [eager step taps]) are made by the rewrite outside
the mode; the rewrite tells the mode of those with an edge into an alias (or into ``W_hhᵀ``),
the only ones the check of uses after the block asks about, and :meth:`RecordMode.steps_made`
marks them. (Until session 52 they were known by a range of
numbers only, and a node of another thread's graph with one of those numbers was taken for a
step's: a recorded ``nn.RNN`` whose ``∂out/∂x`` was taken on another thread, ``G`` 0.039 off.)
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ContextDecorator, contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor
from torch.nn.parameter import is_lazy
from torch.overrides import TorchFunctionMode

from torchgram._core import _torch_compat
from torchgram._core.caller_context import beneath_caller_modes
from torchgram._core.census import coupling_op
from torchgram._core.pytree import PLAIN_VALUES, leaves_of
from torchgram._core.threads import compiled_code_eager
from torchgram.backends.structured.rules import rewrite_for, rule_for
from torchgram.backends.structured.rules.base import Layout, Match
from torchgram.backends.structured.trace import LeafRef, StepTap, _is_transpose, describe

METADATA_KEY = "torchgram.record"
"""Key of the recordings in the ``metadata`` dict of the nodes they noted (NOTE [recorded
nodes]): a list, since nested blocks may both note a node."""

_HOLDER_SEARCH = 64
"""Most nodes searched inside one recognised call for the edges into its leaves."""

_HOOK_METHODS = frozenset({torch.Tensor.register_hook, torch.Tensor.retain_grad})


@dataclass(frozen=True)
class EagerTap:
    """Where one recognised call's output cotangent arrives, and that output's description.

    Attributes:
        seq: The sequence number of the output's node (found again in the graph by it).
        node_name: That node's name (checked when it is found again).
        output_nr: The output's slot at that node.
        shape: The output's shape (the whole batch).
        dtype: The output's dtype.
        rule: The rule that recognised the call.
        steps: For the tap of a call made once per step (NOTE [eager step taps]): where
            each step's output cotangent arrives, ``(seq, node_name, output_nr)`` in step
            order (``seq`` and ``node_name`` above are step 0's); the tap is their stack
            along ``step_dim``. Empty while the steps run (and if they did not finish).
        step_dim: The steps' dim of the tap.
    """

    seq: int
    node_name: str
    output_nr: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    rule: str
    steps: tuple[tuple[int, str, int], ...] | None = None
    step_dim: int = 0


@dataclass(frozen=True)
class EagerUse:
    """One recognised use of a recorded leaf.

    Attributes:
        leaf: The leaf's index in the recording.
        role: ``"weight"`` or ``"bias"``.
        layout: The rule's factor layout (NOTE [factors]).
        act_first: Whether the activation is the first factor in the leaf's own layout.
        tap: Index of the call's :class:`EagerTap`.
        act: Index of the activation among the recorded activations (weights only).
        holders: Sequence numbers of the call's nodes with an edge into the leaf.
        callers: Sequence numbers of the call's own nodes (those of all its steps for a step
            tap): the only nodes that may have an edge into its holders other than its
            output's (NOTE [eager recording]: a backward of the recorded code, taken after the
            block, adds edges into them, e.g. through a linear's saved ``W.T``).
    """

    leaf: int
    role: Literal["weight", "bias"]
    layout: Layout
    act_first: bool
    tap: int
    act: int | None
    holders: frozenset[int] = frozenset()
    callers: frozenset[int] | range = frozenset()


@dataclass(frozen=True)
class EagerMeeting:
    """A recorded call's output ``y``, broadcast in ``z = y ± x``, ``x ⊙ y`` or ``y.expand(...)``.

    NOTE [eager shared taps]: ``∂z/∂y`` is ``scale`` (times ``x`` for a product) entry by
    entry, summed over the dims along which ``y`` is broadcast.

    Attributes:
        tap: The call's tap (whose output is ``y``).
        seq: The sequence number of ``z``'s node.
        node_name: That node's name.
        output_nr: ``z``'s slot at that node.
        shape: ``z``'s shape.
        scale: ``∂z/∂y`` entry by entry (``1`` for ``+``, ``*`` and ``expand``, ``-α`` for
            ``x - α y``, ...).
        factor: For ``z = x ⊙ y``, the index of ``x`` (of ``z``'s shape) among the recorded
            activations.
    """

    tap: int
    seq: int
    node_name: str
    output_nr: int
    shape: tuple[int, ...]
    scale: float
    factor: int | None = None


@dataclass(eq=False)
class Recording:
    """What one ``record()`` block saw (NOTE [eager recording]).

    Attributes:
        leaves: The leaves (tensors that require grad) used by recorded calls, by index.
        taps: One per recognised call that built a graph.
        uses: The recognised uses of the leaves, in call order.
        acts: The activations of the weight uses (detached views), by index.
        act_versions: Their version counters when recorded.
        holders: Per leaf, the sequence numbers of the nodes of recognised calls that hold
            an edge into the leaf's ``AccumulateGrad``.
        unrecognised: Per leaf, the calls that used it outside every rule.
        coupling: Calls that make samples interact (NOTE [per-sample]).
        hooks: Hook registrations seen (``Tensor.register_hook``, ``retain_grad``).
        differentiated: How the recorded code differentiated its own computation
            (``torch.autograd.grad``, forward-mode AD): the derivative formulas of that pass
            use the leaves where no tap sees, so no leaf is read from the taps (NOTE [f that
            differentiates itself]).
        meetings: Where recorded outputs were broadcast against other tensors.
        calls: Number of torch calls seen.
        signature: A hash of the names and plain arguments (dims, flags) of every call
            seen, in order (with the taps' shapes, the key of the cached sample layouts,
            NOTE [sample layouts]).
        expired: Set when the activations were released (the recording is not used then).
        outputs: The recorded calls' outputs, held weakly: a hook registered on one after
            the block is seen (:meth:`hooked_outputs`).
    """

    leaves: list[Tensor] = field(default_factory=list)
    taps: list[EagerTap] = field(default_factory=list)
    uses: list[EagerUse] = field(default_factory=list)
    acts: list[Tensor] = field(default_factory=list)
    act_versions: list[int] = field(default_factory=list)
    holders: dict[int, set[int]] = field(default_factory=dict)
    unrecognised: dict[int, list[str]] = field(default_factory=dict)
    coupling: list[str] = field(default_factory=list)
    hooks: list[str] = field(default_factory=list)
    differentiated: list[str] = field(default_factory=list)
    meetings: list[EagerMeeting] = field(default_factory=list)
    calls: int = 0
    signature: int = 0
    expired: bool = False
    outputs: list[weakref.ReferenceType[Tensor]] = field(default_factory=list)

    def leaf_index(self, tensor: Tensor) -> int | None:
        """The index of ``tensor`` (by identity) among the recorded leaves."""
        for index, leaf in enumerate(self.leaves):
            if leaf is tensor:
                return index
        return None

    def hooked_outputs(self) -> bool:
        """Whether a recorded call's output has gradient hooks now (registered after the block).

        torch hands the taps such an output's gradient before its hooks when the backward goes
        on past it (NOTE [hooks on taps] in ``structured/trace.py``): the recorded layer's own
        block and ``Jᵀw`` from the factors missed the hook (G 0.68 off, ``.grad`` 0.67 off
        torch's; session 58's hunt). Such a pass is walked, as for hooks seen in the block.
        """
        return any((output := ref()) is not None and bool(output._backward_hooks)
                   for ref in self.outputs)

    def close(self) -> None:
        """Release the activations; the recording is not used (nor extended) any more."""
        self.expired = True
        self.acts = []
        self.act_versions = []

    def owns(self, node: Any) -> bool:
        """Whether this recording noted ``node`` (NOTE [recorded nodes])."""
        marks = node.metadata.get(METADATA_KEY)
        return marks is not None and any(mark is self for mark in marks)

    def mark(self, node: Any) -> None:
        """Note ``node`` as one of this recording's (NOTE [recorded nodes])."""
        marks = node.metadata.setdefault(METADATA_KEY, [])
        if not any(mark is self for mark in marks):
            marks.append(self)

    def stale_acts(self) -> set[int]:
        """Indices of activations changed in place since they were recorded."""
        return {i for i, (act, version) in enumerate(zip(self.acts, self.act_versions,
                                                         strict=True))
                if _torch_compat.version(act) != version}

    def _note(self, table: dict[int, list[str]], leaf: int, name: str) -> None:
        names = table.setdefault(leaf, [])
        if name not in names:
            names.append(name)


def _unrecorded(func: Any, match: Match | None, chosen: bool, hooked: str | None) -> str:
    """Why a call of a leaf was not recorded, as ``explain`` lists it."""
    if hooked is not None:
        assert match is not None
        return f"{match.rule} under saved-tensor hooks that may change values ({hooked})"
    if not chosen:
        return describe(func)
    return f"{match.rule if match else describe(func)} (as an activation)"


class _ThreadState(threading.local):
    latest: weakref.ReferenceType[Recording] | None = None
    depth: int = 0
    paused: int = 0  # > 0 while torchgram itself computes (its calls are not the user's)


_STATE = _ThreadState()


@contextmanager
def paused() -> Iterator[None]:
    """Within this block, the modes of ``record()`` blocks pass every call through unseen."""
    _STATE.paused += 1
    try:
        yield
    finally:
        _STATE.paused -= 1


def current_recording() -> Recording | None:
    """The live recording of this thread, if any (NOTE [eager recording])."""
    ref = _STATE.latest
    recording = None if ref is None else ref()
    return None if recording is None or recording.expired else recording


class RecordMode(TorchFunctionMode):
    """The mode of a ``record()`` block: runs every call unchanged and records the taps."""

    def __init__(self, recording: Recording) -> None:
        super().__init__()
        self.recording = recording
        self._refs: dict[int, LeafRef] = {}
        self._pins: list[Tensor] = []  # transposed views: keep their ids valid
        self._outputs: dict[int, tuple[weakref.ReferenceType[Tensor], int]] = {}  # taps' y
        self._steps: dict[int, list[tuple[int, str, int] | None]] = {}  # step taps' slots
        self._step_holders: dict[int, dict[int, int]] = {}  # by id of the StepTap: aliases

    def _found(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[Tensor,
                                                                                   LeafRef]]:
        found = []
        for value in _tensors_of(args, kwargs):
            ref = self._refs.get(id(value))
            if is_lazy(value):  # a lazy module's first call
                continue  # initialises it: not a leaf of this graph yet
            if ref is None and value.is_leaf and value.requires_grad \
                    and value.is_floating_point() and value.numel():  # NOTE [empty leaves]
                ref = self._refs[id(value)] = LeafRef(len(self.recording.leaves))
                self.recording.leaves.append(value)
            if ref is not None:
                found.append((value, ref))
        return found

    @torch.compiler.disable  # NOTE [torch.compile]: a block inside a compiled function runs
    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),  # eagerly
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if _STATE.paused or self.recording.expired:  # closed: nothing more is recorded
            return func(*args, **kwargs)
        recording = self.recording
        recording.calls += 1
        recording.signature = hash((recording.signature, getattr(func, "__name__", None),
                                    _plain_arguments(args, kwargs)))
        why = coupling_op(func, args, kwargs)
        if why is not None and why not in recording.coupling:
            recording.coupling.append(why)
        try:
            if func in _HOOK_METHODS:
                recording.hooks.append(describe(func))
        except TypeError:  # unhashable callables
            pass
        how = _torch_compat.self_differentiation(func)
        if how is not None and how not in recording.differentiated:
            recording.differentiated.append(how)
        found = self._found(args, kwargs)
        if not found:
            result = func(*args, **kwargs)
            if self._outputs:
                self._meet(func, args, kwargs, result)
            return result
        if len(found) == 1 and args and args[0] is found[0][0] and args[0].dim() == 2 \
                and _is_transpose(func, args, kwargs):
            result = func(*args, **kwargs)
            ref = found[0][1]
            self._refs[id(result)] = LeafRef(ref.index, not ref.transposed)
            self._pins.append(result)
            return result
        rewrite = rewrite_for(func)
        if rewrite is not None:  # it enters the mode where the rules must see its calls
            result = rewrite(args, kwargs, self)  # (NOTE [attention rewrite])
            if result is not NotImplemented:
                return result
        rule = rule_for(func)
        match = rule.match(func, args, kwargs) if rule is not None else None
        chosen = self._chosen(match) if match is not None else []
        hooked = _torch_compat.rewriting_saved_tensor_hooks() if chosen else None
        if hooked is not None:  # NOTE [saved-tensor hooks that rewrite]: the walk's
            chosen = []
        result = func(*args, **kwargs)
        if chosen:
            assert match is not None
            tapped = self._record(match, chosen, found, result, args, kwargs)
        else:
            tapped = set()
        if _has_float_tensor(result):
            for leaf, ref in found:
                if id(leaf) not in tapped:
                    recording._note(recording.unrecognised, ref.index, _unrecorded(
                        func, match, bool(chosen), hooked))
        return result

    # -- NOTE [eager step taps]: the recurrent rewrite's protocol (NOTE [step taps]) -----------

    def tap_steps(self, match: Match, steps: int, step_shape: Sequence[int],
                  dtype: torch.dtype, device: torch.device, *, dim: int = 0,
                  share: int | None = None) -> StepTap | None:
        """One tap for ``steps`` calls like ``match`` (NOTE [eager step taps]), or ``None``.

        ``share``: the tap of an earlier output of the whole tap's shape that the steps'
        outputs are only ever added to (the uses join it). ``None`` (the rewrite then makes
        the calls one by one under the mode) without autograd, when no operand is a leaf
        or a leaf is an activation or a transposed view, or when ``share``'s shape differs.
        """
        del device
        if not torch.is_grad_enabled():
            return None
        self._found(tuple(operand.value for operand in match.operands), {})
        chosen = self._chosen(match)
        picked = {i for i, _, _ in chosen}
        if not chosen or any(ref.transposed for _, ref, _ in chosen) or any(
                (self._refs.get(id(operand.value)) is not None and i not in picked)
                or (isinstance(operand.act, Tensor) and operand.act.requires_grad
                    and operand.act.is_leaf)
                for i, operand in enumerate(match.operands)):
            return None
        shape = (*step_shape[:dim], steps, *step_shape[dim:])
        if share is not None and (self.recording.taps[share].shape != shape
                                  or self.recording.taps[share].steps is not None):
            return None
        values: list[Any] = [operand.value for operand in match.operands]
        holders: dict[int, int] = {}
        for i, ref, _ in chosen:  # an alias per leaf: its node alone holds the steps' edges
            values[i] = values[i].view_as(values[i])
            node: Any = values[i].grad_fn
            self.recording.mark(node)
            holders[ref.index] = _torch_compat.creation_order(node)
        if share is None:
            share = len(self.recording.taps)
            self.recording.taps.append(EagerTap(-1, "", 0, shape, dtype, match.rule, steps=(),
                                                step_dim=dim))
            self._steps[share] = [None] * steps
        step_tap = StepTap(share, tuple(values), None)
        self._step_holders[id(step_tap)] = holders
        return step_tap

    def step_output(self, step_tap: StepTap, t: int, y: Tensor) -> Tensor:
        """Note where step ``t``'s output ``y`` of a step tap is in the graph; return ``y``."""
        slots = self._steps.get(step_tap.index)
        node: Any = y.grad_fn
        if slots is not None and node is not None:
            self.recording.mark(node)
            slots[t] = (_torch_compat.creation_order(node), node.name(), y.output_nr)
        return y

    def steps_made(self, step_tap: StepTap, y: Tensor) -> None:
        """Mark ``y``'s node: the rewrite made it for ``step_tap``'s steps, outside the mode.

        NOTE [recorded nodes]: the steps' nodes with an edge into an alias (or ``W_hhᵀ``) are
        the only ones the check of uses after the block asks about; ``step_output`` marks the
        others' outputs.
        """
        del step_tap
        if y.grad_fn is not None:
            self.recording.mark(y.grad_fn)

    def record_steps(self, step_tap: StepTap, match: Match) -> None:
        """Record the uses of a step tap; ``match`` has every step's activation stacked."""
        recording = self.recording
        holders = self._step_holders.pop(id(step_tap))
        slots = self._steps.pop(step_tap.index, None)
        if slots is not None:
            if any(slot is None for slot in slots):
                return  # a step made no node: the tap stays without steps (walked)
            first = slots[0]
            assert first is not None
            tap = recording.taps[step_tap.index]
            recording.taps[step_tap.index] = EagerTap(
                first[0], first[1], first[2], tap.shape, tap.dtype, tap.rule,
                steps=tuple(slot for slot in slots if slot is not None),
                step_dim=tap.step_dim)
        act = next(operand.act for operand in match.operands if operand.act is not None)
        # the steps' nodes: made after the alias, before the stack of their inputs
        end = _torch_compat.creation_order(act.grad_fn) if act.grad_fn is not None \
            else _NO_END
        act_index = len(recording.acts)
        recording.acts.append(act.detach())
        recording.act_versions.append(_torch_compat.version(act))
        for i, ref, role in self._chosen(match):
            operand = match.operands[i]
            layout = operand.layout if role == "weight" else operand.bias_of
            assert layout is not None
            recording.uses.append(EagerUse(
                ref.index, role, layout, layout.act_first != ref.transposed, step_tap.index,
                act_index if role == "weight" else None, frozenset({holders[ref.index]}),
                range(holders[ref.index] + 1, end)))
            recording.holders.setdefault(ref.index, set()).add(holders[ref.index])

    def _chosen(self, match: Match) -> list[tuple[int, LeafRef, Literal["weight", "bias"]]]:
        chosen: list[tuple[int, LeafRef, Literal["weight", "bias"]]] = []
        for i, operand in enumerate(match.operands):
            ref = self._refs.get(id(operand.value)) if isinstance(operand.value, Tensor) \
                else None
            if ref is None:
                continue
            if operand.layout is not None:
                chosen.append((i, ref, "weight"))
            elif operand.bias_of is not None and not ref.transposed:
                chosen.append((i, ref, "bias"))
        return chosen

    def _record(self, match: Match, chosen: list[tuple[int, LeafRef, Literal["weight", "bias"]]],
                found: list[tuple[Tensor, LeafRef]], y: Any, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> set[int]:
        """Record the call's tap and uses; return the ids of the operands it accounts for."""
        recording = self.recording
        if not isinstance(y, Tensor) or y.grad_fn is None:
            return {id(match.operands[i].value) for i, _, _ in chosen}  # no graph: no use
        # an operand passed twice (as weight and as activation) is an unrecognised use
        counts: dict[int, int] = {}
        for leaf, _ in found:
            counts[id(leaf)] = counts.get(id(leaf), 0) + 1
        for i, _, _ in chosen:
            counts[id(match.operands[i].value)] -= 1
        if any(count > 0 for count in counts.values()):
            return set()
        searched = _holders(y, args, kwargs, self._refs)
        if searched is None:
            return set()
        holder_nodes, call_nodes = searched
        for marked in (*call_nodes, *(holder for _, holder in holder_nodes)):
            recording.mark(marked)  # y's node among them: NOTE [recorded nodes]
        holders = [(index, _torch_compat.creation_order(holder))
                   for index, holder in holder_nodes]
        callers = frozenset(_torch_compat.creation_order(caller) for caller in call_nodes)
        node: Any = y.grad_fn
        tap = EagerTap(_torch_compat.creation_order(node), node.name(), y.output_nr,
                       tuple(y.shape), y.dtype, match.rule)
        tap_index = len(recording.taps)
        recording.taps.append(tap)
        output = weakref.ref(y)
        self._outputs[id(y)] = (output, tap_index)
        recording.outputs.append(output)
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
                    act_index = acts[id(operand.act)] = len(recording.acts)
                    recording.acts.append(operand.act.detach())
                    recording.act_versions.append(_torch_compat.version(operand.act))
            recording.uses.append(EagerUse(
                ref.index, role, layout, layout.act_first != ref.transposed, tap_index,
                act_index, frozenset(seq for index, seq in holders if index == ref.index),
                callers))
        for index, seq in holders:
            recording.holders.setdefault(index, set()).add(seq)
        return {id(match.operands[i].value) for i, _, _ in chosen}


    def _meet(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
              z: Any) -> None:
        """Note where a recorded output is broadcast by ``+``, ``-``, ``*`` or ``expand``."""
        try:
            kind = _MEETS.get(func)
        except TypeError:  # unhashable callables
            return
        if kind is None or not isinstance(z, Tensor) or set(kwargs) - {"alpha"} \
                or (kind == "mul" and kwargs):
            return
        node: Any = z.grad_fn
        if node is None:
            return
        alpha = kwargs.get("alpha", 1)
        if not isinstance(alpha, int | float) or isinstance(alpha, bool):
            return
        for position, value in enumerate(args[:1] if kind == "expand" else args[:2]):
            if not isinstance(value, Tensor) or value.numel() >= z.numel():
                continue
            entry = self._outputs.get(id(value))
            if entry is None or entry[0]() is not value:
                continue
            factor = None
            if kind == "mul":  # ∂z/∂y = x: kept, as the activations are
                other = args[1 - position] if len(args) == 2 else None
                if not isinstance(other, Tensor) or not other.is_floating_point() \
                        or tuple(other.shape) != tuple(z.shape):
                    continue
                factor = len(self.recording.acts)
                self.recording.acts.append(other.detach())
                self.recording.act_versions.append(_torch_compat.version(other))
            scale = {("add", 0): 1.0, ("add", 1): float(alpha), ("sub", 0): 1.0,
                     ("sub", 1): -float(alpha), ("rsub", 0): -float(alpha), ("rsub", 1): 1.0,
                     ("mul", 0): 1.0, ("mul", 1): 1.0, ("expand", 0): 1.0}[kind, position]
            self.recording.mark(node)
            self.recording.meetings.append(EagerMeeting(
                entry[1], _torch_compat.creation_order(node), node.name(), z.output_nr,
                tuple(z.shape), scale, factor))


_MEETS: dict[Any, str] = {
    **dict.fromkeys((torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__,
                     torch.Tensor.add_, torch.Tensor.__iadd__), "add"),
    **dict.fromkeys((torch.sub, torch.subtract, torch.Tensor.sub, torch.Tensor.subtract,
                     torch.Tensor.__sub__, torch.Tensor.sub_, torch.Tensor.__isub__), "sub"),
    **dict.fromkeys((torch.rsub, torch.Tensor.__rsub__), "rsub"),
    # not ``x *= y``: it overwrites ``x``, the factor of ``∂z/∂y``
    **dict.fromkeys((torch.mul, torch.multiply, torch.Tensor.mul, torch.Tensor.multiply,
                     torch.Tensor.__mul__, torch.Tensor.__rmul__), "mul"),
    **dict.fromkeys((torch.Tensor.expand, torch.Tensor.expand_as, torch.broadcast_to,
                     torch.Tensor.broadcast_to), "expand"),
}
"""The ops where a recorded output meets the batch (NOTE [eager shared taps]), by kind."""


def _holders(y: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any],
             refs: dict[int, LeafRef]) -> tuple[list[tuple[int, Any]], set[Any]] | None:
    """The edges into leaves one call made, and its nodes.

    The edges as ``(leaf, holder node)``. Searches the nodes the call created,
    from its output's node down to the nodes of its tensor arguments; ``None`` if that does
    not end within :data:`_HOLDER_SEARCH` nodes. A transposed view of a leaf made under the
    mode (``W.T``) holds the leaf's edge for the call.
    """
    stop: dict[Any, int | None] = {}  # the arguments' nodes; a transposed leaf's: its leaf
    for value in _tensors_of(args, kwargs):
        if value.grad_fn is not None:
            ref = refs.get(id(value))
            stop[value.grad_fn] = None if ref is None else ref.index
    found = []
    stack: list[Any] = [y.grad_fn]
    seen: set[Any] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if len(seen) > _HOLDER_SEARCH:
            return None
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child in stop:
                leaf = stop[child]
                if leaf is not None:  # ``W.T`` made by the user: its node holds W's edge
                    found.append((leaf, child))
                continue
            if _torch_compat.is_leaf_accumulator(child):
                ref = refs.get(id(_torch_compat.leaf_of(child)))
                if ref is not None:
                    found.append((ref.index, node))
                continue
            stack.append(child)
    return found, seen


_NO_END = 2**62
"""The end of a step use's callers when its stacked inputs have no node (none is checked)."""

_NO_TENSOR = (int, float, bool, complex, str, type(None), slice, type(Ellipsis), torch.dtype,
              torch.device, torch.layout, torch.memory_format, torch.Size)
"""Arguments that are pytree leaves and not tensors (``torch.Size`` holds ints only)."""


def _tensors_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
    """The tensor leaves of a call's arguments, in ``leaves_of((args, kwargs))`` order.

    Most calls take tensors, plain values and flat lists of them: those are read directly
    (the recorded forward runs this on every call); anything else is flattened as a pytree.
    """
    found: list[Tensor] = []
    for value in (*args, *(kwargs[key] for key in sorted(kwargs))) if kwargs else args:
        if isinstance(value, Tensor):
            found.append(value)
        elif type(value) is list or type(value) is tuple:
            for item in value:
                if isinstance(item, Tensor):
                    found.append(item)
                elif not isinstance(item, _NO_TENSOR):
                    return _tensor_leaves(args, kwargs)
        elif not isinstance(value, _NO_TENSOR):
            return _tensor_leaves(args, kwargs)
    return found


def _tensor_leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
    return [value for value in leaves_of((args, kwargs)) if isinstance(value, Tensor)]


def _plain_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """A call's non-tensor arguments that hash (dims, flags): part of the signature."""
    plain: list[Any] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, PLAIN_VALUES):
            plain.append(value)
        elif isinstance(value, tuple | list) and all(isinstance(v, PLAIN_VALUES) for v in value):
            plain.append(tuple(value))
    return tuple(plain)


def _has_float_tensor(result: Any) -> bool:
    if isinstance(result, Tensor):
        return result.is_floating_point()
    return any(isinstance(leaf, Tensor) and leaf.is_floating_point()
               for leaf in leaves_of(result))


class _Blocks(threading.local):
    """Per thread, the blocks a :class:`_RecordContext` has open (innermost last)."""

    def __init__(self) -> None:
        self.open: list[AbstractContextManager[Recording]] = []


class _RecordContext(ContextDecorator, AbstractContextManager[Recording]):
    """What :func:`record` returns: each ``with`` opens a block of its own.

    Reusable (``rec = tg.autograd.record()`` once, ``with rec:`` every step, as with
    ``torch.no_grad()``), nested and from several threads: a generator context manager
    raised Python's raw ``AttributeError`` on its second ``with`` (session 60's hunt). A
    decorator too (``@tg.autograd.record()`` on a forward function), as it was.
    """

    def __init__(self) -> None:
        self._blocks = _Blocks()

    @torch.compiler.disable  # NOTE [torch.compile]: dynamo refused its set_stance
    def __enter__(self) -> Recording:
        block = _record_block()
        recording = block.__enter__()
        self._blocks.open.append(block)
        return recording

    @torch.compiler.disable
    def __exit__(self, *exc_info: Any) -> bool | None:
        return self._blocks.open.pop().__exit__(*exc_info)


def record() -> AbstractContextManager[Recording]:
    """Record the structured layers of the forward run inside the block (NOTE above).

    Yields the :class:`Recording` (``with tg.autograd.record() as rec``); it is found by
    ``tg.autograd.gramian`` / ``backward`` without being passed. Starting a block releases
    the activations of this thread's previous recording, as does a ``gramian`` /
    ``backward`` call with ``retain_graph=False`` on the recorded graph.

    Nothing is installed on the user's modules or tensors: the recording lives in the
    recorded graph and is freed with it. Hooks on the graph's tensors (``register_hook``,
    ``retain_grad``) should be added inside the block: added after it, torchgram cannot see
    them, and they run during the Gramian's backward pass (a retained grad is then written).

    The context can be kept and entered again (``rec = tg.autograd.record()``, then ``with
    rec:`` every step), each time for a new recording.

    Example:
        >>> import torch, torchgram as tg
        >>> w = torch.randn(3, 2, requires_grad=True)
        >>> recorder = tg.autograd.record()
        >>> for _ in range(2):
        ...     with recorder:
        ...         losses = (torch.randn(4, 3) @ w).pow(2).sum(1)
        ...     tg.autograd.gramian(losses, [w], batch_dim=0).shape
        torch.Size([4, 4])
        torch.Size([4, 4])
    """
    return _RecordContext()


@contextmanager
def _record_block() -> Iterator[Recording]:
    """One block of :func:`record`."""
    previous = current_recording()
    if previous is not None and _STATE.depth == 0:
        previous.close()
    recording = Recording()
    _STATE.latest = weakref.ref(recording)
    _STATE.depth += 1
    try:  # compiled code runs eagerly, its calls seen (NOTE [compiled code in f])
        # NOTE [the caller's function modes]: theirs see the block's calls first
        with compiled_code_eager(), beneath_caller_modes(RecordMode(recording)):
            yield recording
    finally:
        _STATE.depth -= 1
