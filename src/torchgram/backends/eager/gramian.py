"""The imperative Gramian: recorded layers contracted like the structured backend, the rest walked.

# NOTE [imperative Gramian]
``tg.autograd.gramian(outputs, inputs, batch_dim=...)`` splits the inputs in two:

* **tapped** inputs: leaves whose every use in the graph is a call the live recording
  recognised (NOTE [eager recording]). Their blocks come from the cotangents at those calls'
  outputs (NOTE [eager taps]) and the recorded activations, contracted by the structured
  backend's :class:`~torchgram.backends.structured.contraction.Contraction` (ghost,
  materialized or sparse embedding blocks, cross terms of reused leaves; NOTE [structured
  cost model]). With ``batch_dim`` each cotangent pass serves every sample (one per row
  direction: a single backward for per-sample losses), read per sample through each
  output's sample layout (NOTE [sample layouts]);
* every other input (no recording, a use the recording did not see or no rule covers, a
  non-leaf tensor, a layer whose samples cannot be located): the graph walk, restricted to
  those inputs (``torchgram.backends.graph``; with ``batch_dim``, the sample-sparse walk).

Samples that interact (a call the recording knows to mix them, or a probe showing it) make
``batch_dim`` untrue: then every row of the whole batch is a row of the passes (``B = 1``,
``K = m``), which is the exact coupled Gramian, and the report says so.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from torchgram._core import _torch_compat
from torchgram._core._torch_compat import Node
from torchgram._core.checks import fail
from torchgram._core.result import RunReport
from torchgram._core.scratch import give_back, scratch_bmm
from torchgram._core.sink import LeafBlocks
from torchgram._core.watched_calls import check_node
from torchgram.backends.eager.graph_index import GraphIndex, index_graph
from torchgram.backends.eager.passes import engine_cotangents, walk_cotangents
from torchgram.backends.eager.record import (
    EagerMeeting,
    EagerTap,
    EagerUse,
    Recording,
    current_recording,
)
from torchgram.backends.eager.rows import Rows
from torchgram.backends.eager.samples import (
    LAYOUT_CACHE,
    Choice,
    SampleLayout,
    SharedSamples,
    allowed_dims,
    candidates,
    choose,
    numel,
    probe_samples,
    twinned,
)
from torchgram.backends.eager.shared import meeting_options, sole_meetings
from torchgram.backends.eager.steps import StepSlots, TapSlot, by_steps
from torchgram.backends.graph.gramian import (
    freed_graph_is_clear,
    graph_gramian,
    input_edge,
    real_columns,
)
from torchgram.backends.graph.nodes import Edge, NodeCaller
from torchgram.backends.graph.release import release_graph
from torchgram.backends.graph.sparse import SparseWalk, _Slot, compact_block
from torchgram.backends.structured.contraction import (
    Contraction,
    flat_rows,
    keeps_jacobian,
    to_row_major,
)
from torchgram.backends.structured.cost import Sizes, plan_leaves
from torchgram.backends.structured.selections import OpenedCaller, opened_nodes
from torchgram.backends.structured.trace import Recording as UseTable
from torchgram.backends.structured.trace import TapRecord, UseRecord

Pullback = Callable[[Tensor], dict[int, Tensor]]
"""Weights ``[m]`` (outputs' order) ↦ ``Jᵀ w`` of each tapped input (by input index)."""


@dataclass
class EagerResult:
    """What :func:`eager_gramian` did besides filling the blocks.

    Attributes:
        report: What ran (ways per input, notes, nodes called per row).
        pullback: ``w ↦ Jᵀ w`` from the recorded factors, when every input was tapped by an
            engine pass and the factors were kept (``want_pullback``). Without it, the graph
            is left for the caller's backward pass.
        graph_freed: Whether the passes already freed the graph (``retain_graph=False``).
        engine: Whether the tapped inputs' cotangents came from an engine pass (no hook in
            the graph that torchgram could see, NOTE [eager taps]).
    """

    report: RunReport
    pullback: Pullback | None = None
    graph_freed: bool = False
    engine: bool = False


@dataclass
class _Tapped:
    """The inputs the recording covers, and how their taps are read."""

    inputs: list[int] = field(default_factory=list)  # input indices (unique tensors)
    uses: dict[int, list[EagerUse]] = field(default_factory=dict)  # by input index
    slots: dict[int, TapSlot] = field(default_factory=dict)  # tap index -> slot(s)


def eager_gramian(api: str, outputs: Sequence[Tensor], inputs: Sequence[Tensor],
                  blocks: LeafBlocks, *, batch_dim: int | None, chunk_size: int | None,
                  diagonal: bool, retain_graph: bool,
                  want_pullback: bool = False) -> EagerResult:
    """Add every input's block (output order) to ``blocks`` (NOTE [imperative Gramian])."""
    rows = Rows.of(outputs, batch_dim)
    report = RunReport("autograd", "graph walk")
    ways = ["walk"] * len(inputs)
    recording = current_recording()
    first_of: dict[int, int] = {}
    for i, tensor in enumerate(inputs):
        first_of.setdefault(id(tensor), i)
    walked = [i for i, tensor in enumerate(inputs) if first_of[id(tensor)] == i]
    final, duplicates = blocks, len(walked) < len(inputs)
    if duplicates:  # one block per tensor, then each counted as often as it is passed
        blocks = LeafBlocks(len(inputs), per_leaf=True, diagonal=diagonal, dtype=final.dtype)
    result = EagerResult(report)
    consumed = None  # the recording of a graph this call frees: released at the end
    if recording is not None:
        graph = index_graph(outputs)
        if graph.reentrant:
            _fail_reentrant(api)
        for node in graph.checked:  # watched_calls (the walk checks the nodes it calls)
            check_node(node, type(node).__name__)
        if not retain_graph and _made(recording, graph):
            consumed = recording
        tapped = _select(api, recording, graph, inputs, walked, report)
        if tapped.inputs:
            others = [i for i in walked if i not in set(tapped.inputs)]
            with freed_graph_is_clear(api):  # the engine pass: NOTE [in-place modifications]
                result = _contract(api, recording, graph, tapped, rows, inputs, blocks, ways,
                                   chunk_size=chunk_size, diagonal=diagonal,
                                   retain_graph=retain_graph or bool(others),
                                   want_pullback=want_pullback and not others, report=report)
            walked = [i for i in walked if i not in set(tapped.inputs)]  # some may be back
    if walked:
        _walk(api, rows, inputs, walked, blocks, chunk_size=chunk_size, diagonal=diagonal,
              report=report)
    for i, tensor in enumerate(inputs):
        ways[i] = ways[first_of[id(tensor)]]
    if duplicates:  # a tensor passed twice gets its block twice
        per_tensor = blocks.blocks()
        for i, tensor in enumerate(inputs):
            block = per_tensor[first_of[id(tensor)]]
            if block is not None:
                final.add(i, block)
    report.leaf_ways = tuple(ways)
    if consumed is not None:  # NOTE [eager recording]: the graph goes, so do its activations
        consumed.close()  # (a pullback holds the views it needs)
    if want_pullback and result.pullback is None:
        return result  # the caller's backward pass frees the graph
    if not retain_graph and not result.graph_freed:
        from torchgram.backends.graph.gramian import plan_graph

        release_graph(list(outputs), plan_graph(outputs, inputs))
    return result


def _made(recording: Recording, graph: GraphIndex) -> bool:
    """Whether a call the recording tapped is in ``graph`` (NOTE [recorded nodes])."""
    return any(graph.node(tap.seq, tap.node_name, recording) is not None
               for tap in recording.taps if tap.steps is None or tap.steps)


def _fail_reentrant(api: str) -> None:
    fail(api, "a graph without reentrant checkpoints",
         "a torch.utils.checkpoint(..., use_reentrant=True) region, whose parameters are "
         "hidden from the graph", "Use torch.utils.checkpoint(..., use_reentrant=False), "
         "which this walk supports.")


def _walked(report: RunReport, index: int, why: str) -> None:
    """Note that input ``index`` is walked, and why."""
    report.notes.append(f"inputs[{index}]: walked ({why})")


def walk_reasons(report: RunReport) -> dict[int, str]:
    """Why each walked input of a report was walked, by input index."""
    reasons = {}
    for note in report.notes:
        found = _WALKED.match(note)
        if found:
            reasons[int(found.group(1))] = found.group(2)
    return reasons


_WALKED = re.compile(r"inputs\[(\d+)\]: walked \((.*)\)$")


def _select(api: str, recording: Recording, graph: GraphIndex, inputs: Sequence[Tensor],
            candidates_: Sequence[int], report: RunReport) -> _Tapped:
    """The inputs whose every use in the graph the recording tapped (NOTE [eager recording])."""
    tapped = _Tapped()
    stale = recording.stale_acts()
    for i in candidates_:
        tensor = inputs[i]
        if not tensor.is_leaf:
            continue
        leaf = recording.leaf_index(tensor)
        if leaf is None:
            continue
        if recording.differentiated:  # NOTE [eager recording]
            _walked(report, i, "the recorded code differentiated itself with "
                    + recording.differentiated[0])
            continue
        if leaf in recording.unrecognised:
            _walked(report, i, "used outside the rules in "
                    + ", ".join(recording.unrecognised[leaf]))
            continue
        in_graph = graph.holders(tensor, recording)  # NOTE [recorded nodes]
        uses = [use for use in recording.uses
                if use.leaf == leaf and in_graph is not None and use.holders & in_graph]
        seen = set().union(*(use.holders for use in uses)) if uses else set()
        if in_graph is None or not in_graph <= seen:
            _walked(report, i, "the graph uses it where the recording did not see it")
            continue
        if _called_from_outside(graph, recording, tensor, uses):
            _walked(report, i, "its recorded calls' nodes are used outside them (a backward "
                    "of the recorded code, taken after the block)")
            continue
        slots = {}
        for use in uses:
            slot = _slot(recording.taps[use.tap], graph, recording)
            if slot is None:
                break
            slots[use.tap] = slot
        else:
            if any(use.act in stale for use in uses if use.act is not None):
                fail(api, "the activations of the recorded calls unchanged until the Gramian",
                     f"an input of a recorded {recording.taps[uses[0].tap].rule} call "
                     f"(multiplied by inputs[{i}]) changed in place after the call",
                     "Do not modify it in place (autograd's own backward needs it too), "
                     "e.g. use out-of-place ops such as torch.relu instead of relu_.")
            tapped.inputs.append(i)
            tapped.uses[i] = uses
            tapped.slots.update(slots)
            continue
        _walked(report, i, "a recorded call is not found in the graph")
    return tapped


def _called_from_outside(graph: GraphIndex, recording: Recording, leaf: Tensor,
                         uses: Sequence[EagerUse]) -> bool:
    """Whether a node outside the recorded calls uses the leaf through their nodes.

    NOTE [eager recording]: the nodes above a leaf that depend on it alone (a linear's
    ``W.T``, a recurrence's alias of ``W_hh`` and its transpose) are reached only from the
    recorded calls' own nodes in the recorded forward; a backward of the recorded code taken
    with ``create_graph`` after the block (a physics-informed residual's ``∂u/∂x``) adds
    edges into them: uses of the leaf that no tap sees (session 37's review: 0.17-0.56 off,
    relative). Only the recording's own nodes are the calls' (NOTE [recorded nodes]): a node
    of another thread with one of their numbers is not.
    """
    outputs = set()  # the calls' outputs, which the code after them uses as it likes
    for use in uses:
        tap = recording.taps[use.tap]
        outputs |= {tap.seq, *(seq for seq, _, _ in tap.steps or ())}

    def own(node: Node, seq: int) -> bool:  # one of the recorded calls' nodes
        return recording.owns(node) and any(seq in use.callers for use in uses)

    parents = graph.parents()
    frontier = [node for node in graph.into.get(id(leaf), ())  # the holders: all owned
                if _torch_compat.creation_order(node) not in outputs
                and graph.of_leaf_only(node, leaf)]
    seen = set(frontier)
    while frontier:
        for parent in parents.get(frontier.pop(), ()):
            if parent in seen:
                continue
            seen.add(parent)
            seq = _torch_compat.creation_order(parent)
            if seq in outputs and recording.owns(parent):
                continue
            if graph.of_leaf_only(parent, leaf):
                frontier.append(parent)
            elif not own(parent, seq):
                return True
    return False


def _slot(tap: EagerTap, graph: GraphIndex, recording: Recording) -> TapSlot | None:
    """Where ``tap``'s cotangent is read in ``graph`` (NOTE [eager step taps]), if it is there."""
    if tap.steps is None:
        node = graph.node(tap.seq, tap.node_name, recording)
        return None if node is None else (node, tap.output_nr)
    edges = []
    for seq, name, output_nr in tap.steps:
        node = graph.node(seq, name, recording)
        if node is None:
            return None
        edges.append((node, output_nr))
    return StepSlots(tuple(edges), tap.step_dim) if edges else None


def _walk(api: str, rows: Rows, inputs: Sequence[Tensor], walked: Sequence[int],
          blocks: LeafBlocks, *, chunk_size: int | None, diagonal: bool,
          report: RunReport) -> None:
    """The walk's blocks of the inputs ``walked`` (output order)."""
    if rows.samples > 1:
        sparse_gramian(api, rows, inputs, walked, blocks, chunk_size=chunk_size,
                       diagonal=diagonal, report=report)
        return
    sub = LeafBlocks(len(walked), per_leaf=blocks.per_leaf, diagonal=diagonal,
                     dtype=blocks.dtype)
    graph_gramian(api, list(rows.outputs), [inputs[i] for i in walked], sub,
                  chunk_size=chunk_size, diagonal=diagonal, report=report)
    for k, block in enumerate(sub.blocks()):
        if block is not None:
            blocks.add(walked[k] if blocks.per_leaf else 0, block)


def sparse_gramian(api: str, rows: Rows, inputs: Sequence[Tensor], walked: Sequence[int],
                   blocks: LeafBlocks, *, chunk_size: int | None, diagonal: bool,
                   report: RunReport) -> None:
    """The sample-sparse walk's blocks of the inputs ``walked`` (NOTE [sample-sparse walk])."""
    by_edge: dict[Edge, list[int]] = {}
    for i in walked:
        by_edge.setdefault(input_edge(inputs[i]), []).append(i)
    caller = NodeCaller(chunk_size)
    walk = SparseWalk(rows, list(by_edge), caller)
    for node in walk.plan.children:
        if _torch_compat.is_reentrant_checkpoint(node):
            _fail_reentrant(api)
    samples, total = rows.samples, rows.per_sample
    step = total if not diagonal or chunk_size is None else max(1, chunk_size // samples)
    dtype = blocks.dtype
    for start in range(0, total, step):
        stop = min(start + step, total)

        def on_target(edge: Edge, slot: _Slot | None, start: int = start,
                      stop: int = stop) -> None:
            if slot is None:
                return
            count = stop - start
            if slot.layout is not None:
                rows_ = slot.rows[:count]
                rows_ = rows_.to(dtype) if dtype is not None else rows_
                block = compact_block(rows_, slot.layout, samples, diagonal)
            else:
                flat = real_columns(flat_rows(slot.rows.unsqueeze(0))[0])  # memory order
                flat = flat.to(dtype) if dtype is not None else flat
                block = flat.square().sum(1) if diagonal else flat @ flat.T
            if diagonal:
                full = block.new_zeros(rows.num_rows)
                full[start * samples:stop * samples] = block
                block = full
            block = rows.to_output_order(block, diagonal)
            for i in by_edge[edge]:
                blocks.add(i if blocks.per_leaf else 0, block)

        with freed_graph_is_clear(api), torch.no_grad():
            walk.run(start, stop, on_target)
    report.looped_nodes = dict(caller.vmap_failures)
    result = walk.result
    report.way = "sample-sparse walk" if report.way == "graph walk" else report.way
    for name, count in result.expanded_nodes.items():
        report.notes.append(f"walk: {name} called on every sample's rows ({count}×)")
    for name, count in result.ruled_nodes.items():
        report.notes.append(f"walk: {name} split per sample from its saved tensors "
                            f"({count}×)")
    if result.probed:
        report.notes.append("walk: probed samples to locate them in the graph (cached for "
                            "this graph's signature)")


# -- the tapped inputs --------------------------------------------------------------------------


@dataclass
class _Layouts:
    """The per-sample layout of every tap (``None`` per tap: dense rows)."""

    samples: int
    per_sample: int
    of_tap: dict[int, SampleLayout | SharedSamples | None]
    dense: bool
    failed: dict[int, str] = field(default_factory=dict)  # tap -> why it has no layout
    factors: dict[int, Tensor] = field(default_factory=dict)  # tap -> x of z = x ⊙ y


def _contract(api: str, recording: Recording, graph: GraphIndex, tapped: _Tapped, rows: Rows,
              inputs: Sequence[Tensor], blocks: LeafBlocks, ways: list[str], *,
              chunk_size: int | None, diagonal: bool, retain_graph: bool,
              want_pullback: bool, report: RunReport) -> EagerResult:
    """Blocks of the tapped inputs from one pass per row direction (NOTE [imperative Gramian])."""
    del api
    engine = not (recording.hooks or graph.module_hooks or recording.hooked_outputs())
    # Jᵀw from the factors only without hooks (NOTE [Jᵀw from the recording]): else the
    # caller's backward runs them, and the graph must be left to it, unfreed
    want_pullback = want_pullback and engine
    caller = NodeCaller(chunk_size)
    taps = sorted(tapped.slots)

    def passes(seeds: list[Tensor], slots: list[Edge], free: bool, *,
               opened: bool) -> list[Tensor | None]:
        if engine:
            with opened_nodes(graph.nodes()) if opened else contextlib.nullcontext():
                return engine_cotangents(rows.outputs, slots, seeds, retain_graph=not free,
                                         vectorize=chunk_size != 1)
        return walk_cotangents(rows.outputs, slots, seeds,
                               OpenedCaller(chunk_size) if opened else caller)

    @by_steps
    def cotangents(seeds: list[Tensor], slots: list[Edge], free: bool) -> list[Tensor | None]:
        return passes(seeds, slots, free, opened=False)

    @by_steps
    def probes(seeds: list[Tensor], slots: list[Edge], free: bool) -> list[Tensor | None]:
        return passes(seeds, slots, free, opened=True)  # NOTE [opened selections]

    layouts = _layouts(recording, graph, tapped, taps, rows, probes, report)
    if layouts.failed:  # inputs whose taps have no layout go to the walk
        for i in list(tapped.inputs):
            bad = [use.tap for use in tapped.uses[i] if use.tap in layouts.failed]
            if bad:
                tapped.inputs.remove(i)
                _walked(report, i, layouts.failed[bad[0]])
        taps = sorted({use.tap for i in tapped.inputs for use in tapped.uses[i]})
        retain_graph, want_pullback = True, False  # the walk comes next
        if not tapped.inputs:
            return EagerResult(report, engine=engine)
    samples, per_sample = layouts.samples, layouts.per_sample
    if layouts.dense and rows.samples > 1:
        report.notes.append("rows of the whole batch: the samples interact ("
                            + (recording.coupling[0] if recording.coupling else
                               "a probe's cotangent spreads over other samples") + ")")
    dtype = blocks.dtype or rows.outputs[0].dtype
    local = {tap: k for k, tap in enumerate(taps)}
    acts_used = sorted({use.act for i in tapped.inputs for use in tapped.uses[i]
                        if use.act is not None})
    act_local = {act: k for k, act in enumerate(acts_used)}
    table = UseTable()
    for tap in taps:
        spec = recording.taps[tap]
        table.taps.append(TapRecord(_per_sample(spec.shape, layouts.of_tap[tap], samples),
                                    spec.dtype, spec.rule))
    leaf_uses: dict[int, tuple[UseRecord, ...]] = {}
    for k, i in enumerate(tapped.inputs):
        records = []
        for use in tapped.uses[i]:
            spec = recording.taps[use.tap]
            layout = layouts.of_tap[use.tap]
            act_shape = None if use.act is None else _per_sample(
                tuple(recording.acts[use.act].shape), layout, samples)
            records.append(UseRecord(
                leaf=k, role=use.role, rule=spec.rule, layout=use.layout,
                act_first=use.act_first, tap=local[use.tap],
                act=None if use.act is None else act_local[use.act],
                shape=use.layout.shape(numel(_per_sample(spec.shape, layout, samples))),
                act_shape=act_shape))
        leaf_uses[k] = tuple(records)
        table.uses.extend(records)
    numels = [inputs[i].numel() for i in tapped.inputs]
    plans = plan_leaves(numels, table, Sizes(samples, per_sample, diagonal,
                                             torch.empty((), dtype=dtype).element_size()),
                        tap_fallback_uses=False, memory_budget=None)
    for k, i in enumerate(tapped.inputs):
        ways[i] = plans[k].way
    per_pass = per_sample if chunk_size is None else max(1, min(per_sample,
                                                                chunk_size // samples))
    fast = {plan.leaf for plan in plans if per_pass == per_sample == 1
            and _FastLeaf.applies(plan.way, leaf_uses[plan.leaf])}
    contraction = Contraction([plan for plan in plans if plan.leaf not in fast], leaf_uses,
                              numels, samples, per_sample, diagonal, keep=want_pullback)
    acts = [_act_view(recording.acts[act], _act_layout(tapped, recording, act, layouts),
                      samples, dtype) for act in acts_used]
    contraction.set_acts(acts)
    fast_leaves: dict[int, _FastLeaf] = {}
    slots = [tapped.slots[tap] for tap in taps]
    freed = False
    for start in range(0, per_sample, per_pass):
        stop = min(start + per_pass, per_sample)
        seeds = (rows.direction_seeds(start, stop) if not layouts.dense
                 else _basis_seeds(rows, start, stop))
        free = not retain_graph and stop == per_sample and engine \
            and (not want_pullback or per_pass == per_sample)
        raw = cotangents(seeds, slots, free)
        freed = freed or free
        cots = [None if cot is None else
                _sample_view(_times_factor(cot, layouts, tap), layouts.of_tap[tap], 1,
                             samples, dtype)
                for cot, tap in zip(raw, taps, strict=True)]
        del raw
        report.row_chunks.append((stop - start, sum(c.numel() * c.element_size()
                                                    for c in cots if c is not None)))
        for k in fast:
            (only,) = leaf_uses[k]
            assert only.act is not None
            fast_leaves[k] = _FastLeaf(only, acts[only.act], cots[only.tap], want_pullback)
        contraction.add_rows(start, stop, cots, {})
        del cots
    rm_rows = _RowMajor(rows, layouts)
    pieces = [(k, leaf.gram(diagonal)) for k, leaf in fast_leaves.items()
              if leaf.valid] + list(contraction.blocks(dtype))
    for k, block in pieces:
        flat = rm_rows.to_output_order(to_row_major(block, diagonal), diagonal)
        blocks.add(tapped.inputs[k] if blocks.per_leaf else 0, flat)
    report.way = ("recorded taps" + (" (engine pass)" if engine else " (walked pass)")
                  + (", rows of the whole batch" if layouts.dense and rows.samples > 1 else ""))
    pullback = None
    if want_pullback and contraction.complete:
        pullback = _pullback(contraction, fast_leaves, rm_rows, tapped.inputs)
    return EagerResult(report, pullback, freed, engine)


class _FastLeaf:
    """A leaf materialized from one weight use, one row per sample, one group.

    The structured contraction forms the per-sample Jacobians in the leaf's layout; their
    Gram does not depend on the order of the columns, and on CPU the batched product
    ``actᵀ · cot`` (``[B, a, c]``) is markedly faster than ``cotᵀ · act`` for a linear
    layer's shapes, so this leaf is contracted here in that orientation. Not where the
    layout forms the Jacobian with a fused kernel (``Layout.fused_jacobian``: a convolution
    at many positions, NOTE [per-sample convolution gradients]): patches and a product there
    took ResNet-18's recorded Gramian from 1.98x (the functional path's) to 2.43x a backward.
    """

    def __init__(self, use: UseRecord, act_raw: Tensor, cot_raw: Tensor | None,
                 keep: bool = False) -> None:
        self.valid = cot_raw is not None
        self.act_first = use.act_first
        self.keep = keep
        self.jacobian: Tensor | None = None
        if cot_raw is None:
            return
        act = use.layout.act_factor(act_raw, 1)  # [B, T, 1, a]
        cot = use.layout.cot_factor(cot_raw, 2, act_raw)[0]  # [B, T, 1, c]
        self.act = act.reshape(act.shape[0], -1, act.shape[-1])
        self.cot = cot.reshape(cot.shape[0], -1, cot.shape[-1])

    @staticmethod
    def applies(way: str, uses: tuple[UseRecord, ...]) -> bool:
        """Whether a leaf planned ``way`` with these uses is one."""
        if way != "materialize" or len(uses) != 1:
            return False
        shape = uses[0].shape
        return uses[0].role == "weight" and not shape.act_is_index and not shape.elementwise \
            and shape.groups == 1 and not uses[0].layout.fused_jacobian(shape.positions)

    def gram(self, diagonal: bool) -> Tensor:
        """The block ``[1, B, 1, B]`` (``[1, B]``)."""
        jacobian = scratch_bmm(self.act.transpose(1, 2), self.cot)  # NOTE [scratch memory]
        flat = jacobian.reshape(jacobian.shape[0], -1)
        kept = self.keep and keeps_jacobian(flat, (self.act, self.cot))
        if kept:
            self.jacobian = flat  # NOTE [Jᵀw from kept Jacobians]: instead of the factors
            self.sizes = (self.act.shape[-1], self.cot.shape[-1])
            self.act = self.cot = flat.new_empty(0)
        block = flat.square().sum(-1) if diagonal else flat @ flat.T
        if not kept:
            give_back(jacobian)  # its place serves the next leaf's
        return block.reshape(1, -1) if diagonal else block.reshape(1, flat.shape[0], 1, -1)

    def pullback(self, weights: Tensor) -> Tensor:
        """``Σ_b w_b J_b`` in the leaf's layout, flattened (``weights: [1, B]``)."""
        if self.jacobian is not None:  # [B, a·c] ([a, c] per sample)
            jacobian = self.jacobian
            grad = (weights.reshape(-1).to(jacobian.dtype) @ jacobian).reshape(self.sizes)
            return (grad if self.act_first else grad.T).reshape(-1)
        act, cot = self.act, self.cot  # the narrower factor takes the weights
        w = weights.reshape(-1, 1, 1)
        if act.shape[-1] < cot.shape[-1]:
            act = act * w.to(act.dtype)
        else:
            cot = cot * w.to(cot.dtype)
        act, cot = act.flatten(0, 1), cot.flatten(0, 1)
        # in the leaf's own layout: no transposed copy of the product
        return (act.T @ cot if self.act_first else cot.T @ act).reshape(-1)


def _per_sample(shape: tuple[int, ...], layout: SampleLayout | SharedSamples | None,
                samples: int) -> tuple[int, ...]:
    return shape if layout is None else layout.per_sample_shape(shape, samples)


def _sample_view(tensor: Tensor, layout: SampleLayout | SharedSamples | None, lead: int,
                 samples: int, dtype: torch.dtype) -> Tensor:
    """``[*lead, B, *per-sample]`` (``B = 1`` without a layout), floating values in ``dtype``."""
    if tensor.is_floating_point() and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    if layout is None:
        return tensor.unsqueeze(lead)
    return layout.view(tensor, lead, samples)


def _times_factor(cot: Tensor, layouts: _Layouts, tap: int) -> Tensor:
    """A shared tap's cotangents at ``z = x ⊙ y`` times ``x`` (NOTE [eager shared taps])."""
    factor = layouts.factors.get(tap)
    return cot if factor is None else cot * factor


def _act_view(act: Tensor, layout: SampleLayout | SharedSamples | None, samples: int,
              dtype: torch.dtype) -> Tensor:
    """An activation as ``[B, *per-sample]`` (a shared call's: the same for every sample)."""
    if isinstance(layout, SharedSamples):
        if act.is_floating_point() and act.dtype != dtype:
            act = act.to(dtype)
        return layout.act_view(act, samples)
    return _sample_view(act, layout, 0, samples, dtype)


def _act_layout(tapped: _Tapped, recording: Recording, act: int,
                layouts: _Layouts) -> SampleLayout | SharedSamples | None:
    """The layout of an activation: that of the tap of a call that multiplies it."""
    for uses in tapped.uses.values():
        for use in uses:
            if use.act == act:
                return layouts.of_tap[use.tap]
    return None


def _basis_seeds(rows: Rows, start: int, stop: int) -> list[Tensor]:
    """Dense rows ``start:stop`` in the outputs' order: one basis vector each."""
    first = rows.outputs[0]
    flat = first.new_zeros(stop - start, rows.num_rows)
    flat[torch.arange(stop - start), torch.arange(start, stop)] = 1
    pieces = flat.split([out.numel() for out in rows.outputs], dim=1)
    return [piece.reshape(stop - start, *out.shape)
            for piece, out in zip(pieces, rows.outputs, strict=True)]


class _RowMajor:
    """The contraction's rows ``(r, b)`` in the outputs' order."""

    def __init__(self, rows: Rows, layouts: _Layouts) -> None:
        self.rows = rows
        self.dense = layouts.dense

    def to_output_order(self, block: Tensor, diagonal: bool) -> Tensor:
        return block if self.dense else self.rows.to_output_order(block, diagonal)

    def weights(self, weights: Tensor) -> Tensor:
        """``[m]`` in the outputs' order as the contraction's ``[R, B]``."""
        if self.dense:
            return weights.reshape(-1, 1)
        return self.rows.to_row_major(weights)


def _pullback(contraction: Contraction, fast: dict[int, _FastLeaf], rm_rows: _RowMajor,
              inputs: list[int]) -> Pullback:
    def pullback(weights: Tensor) -> dict[int, Tensor]:
        shaped = rm_rows.weights(weights)
        grads = contraction.pullback(shaped)
        out = {inputs[k]: grad for k, grad in enumerate(grads) if grad is not None}
        for k, leaf in fast.items():
            if leaf.valid:
                out[inputs[k]] = leaf.pullback(shaped)
        return out

    return pullback


# -- sample layouts -----------------------------------------------------------------------------


def _layouts(recording: Recording, graph: GraphIndex, tapped: _Tapped, taps: list[int],
             rows: Rows,
             probes: Callable[[list[Tensor], list[TapSlot], bool], list[Tensor | None]],
             report: RunReport) -> _Layouts:
    """Each tap's sample layout: from the shapes, the cache, or a probe (NOTE [sample layouts]).

    ``probes`` runs the probes' passes, with the graph's selections opened (NOTE [opened
    selections]).

    A tap without a layout of its own that meets the batch is read there (NOTE [eager shared
    taps]): its slot in ``tapped`` becomes the meeting's.
    """
    dense = _Layouts(1, rows.num_rows, dict.fromkeys(taps), dense=True)
    if rows.samples == 1 or recording.coupling:
        return dense
    samples = rows.samples
    uses_of: dict[int, list[EagerUse]] = {}
    for uses in tapped.uses.values():
        for use in uses:
            uses_of.setdefault(use.tap, []).append(use)
    options: dict[int, list[SampleLayout]] = {}
    for tap in taps:
        spec = recording.taps[tap]
        acts = [recording.acts[use.act] for use in uses_of[tap] if use.act is not None]
        act_shape = tuple(acts[0].shape) if acts else None
        options[tap] = candidates(spec.shape, samples,
                                  allowed_dims(uses_of[tap][0].layout, spec.shape, act_shape))
    stale = recording.stale_acts()
    single = {tap: slot for tap, slot in tapped.slots.items()
              if tap in options and not isinstance(slot, StepSlots)}
    meetings = {tap: met for tap, met in sole_meetings(
        recording, graph, rows.outputs, single).items()
        if met[0].factor not in stale}  # a factor changed in place: no meeting
    met_options = {tap: meeting_options(meeting, recording.taps[tap].shape, samples)
                   for tap, (meeting, _) in meetings.items()}
    met = sorted(met_options)
    nodes = graph.nodes()
    key = (recording.signature, rows.batch_dim, tuple(out.shape for out in rows.outputs),
           tuple((recording.taps[tap].shape, recording.taps[tap].rule, tuple(options[tap]))
                 for tap in taps),
           tuple((tap, _meeting_key(meetings[tap][0]), tuple(met_options[tap]))
                 for tap in met),
           _torch_compat.graph_signature(nodes),  # after the recording too: NOTE [graph signatures]
           _torch_compat.routing_values(nodes, rows.samples))  # NOTE [routing values]
    choices = LAYOUT_CACHE.get(key)
    if choices is None:
        probed = twinned(probe_samples(samples))  # NOTE [finite twins]
        slots = [tapped.slots[tap] for tap in taps] + [meetings[tap][1] for tap in met]
        found = probes(rows.probe_seeds(probed, finite_from=len(probed) // 2), slots, False)

        def pick(layouts: list[SampleLayout], probe: Tensor | None) -> Choice:
            return choose(layouts, [(s, None if probe is None else probe[j])
                                    for j, s in enumerate(probed)], samples)

        own = [pick(options[tap], probe) for tap, probe in zip(taps, found, strict=False)]
        at_meeting = {tap: pick(met_options[tap], probe)
                      for tap, probe in zip(met, found[len(taps):], strict=True)}
        choices = tuple(_shared(recording, tap, own[k], at_meeting.get(tap), meetings)
                        for k, tap in enumerate(taps))
        LAYOUT_CACHE.put(key, choices)
        groups = [list(group) for group in probed[:len(probed) // 2]]
        report.notes.append(f"probed samples {groups} (NaN and finite rows) to locate "
                            f"the samples in {len(taps)} recorded call(s) (cached for this "
                            "signature)")
    if any(choice.layout is None and "spreads" in choice.reason for choice in choices):
        return dense
    of_tap: dict[int, SampleLayout | SharedSamples | None] = {}
    failed, factors = {}, {}
    for tap, choice in zip(taps, choices, strict=True):
        spec = recording.taps[tap]
        of_tap[tap] = choice.shared or choice.layout
        if choice.layout is None:
            failed[tap] = f"{spec.rule} output {spec.shape}: {choice.reason}"
        elif choice.shared is not None:
            meeting, slot = meetings[tap]
            tapped.slots[tap] = slot
            if meeting.factor is not None:
                factors[tap] = recording.acts[meeting.factor]
            report.notes.append(f"{describe_tap(spec)}: shared by the samples, read per sample "
                                f"where it meets the batch ({meeting.node_name} → "
                                f"{tuple(meeting.shape)})")
    return _Layouts(samples, rows.per_sample, of_tap, dense=False, failed=failed,
                    factors=factors)


def _meeting_key(meeting: EagerMeeting) -> tuple[object, ...]:
    """A meeting as part of a cache key: what it is, not when it was made (no ``seq``)."""
    return (meeting.tap, meeting.node_name, meeting.output_nr, meeting.shape, meeting.scale,
            meeting.factor is None)


def _shared(recording: Recording, tap: int, own: Choice, at_meeting: Choice | None,
            meetings: dict[int, tuple[EagerMeeting, Edge]]) -> Choice:
    """A tap's own layout, else (it has none, and it meets the batch) the meeting's."""
    if own.layout is not None or at_meeting is None:
        return own
    if at_meeting.layout is None:
        return at_meeting
    layout = at_meeting.layout
    return Choice(layout, shared=SharedSamples(layout, recording.taps[tap].shape,
                                               meetings[tap][0].scale))


def describe_tap(tap: EagerTap) -> str:
    """A short description of a tap, for reports."""
    return f"{tap.rule} → {tuple(tap.shape)}"

