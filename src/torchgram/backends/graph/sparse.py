"""The graph walk with per-sample structure: sample-block-sparse row-Jacobians.

# NOTE [sample-sparse walk]
With ``batch_dim``, row ``(b, k)``'s cotangent at a tensor that carries the samples lives on
sample ``b``'s slice of it (NOTE [sample layouts]). So the walk does not push the ``B·K``
rows densely: at such a slot it keeps, per row direction ``k``, one **compact** tensor
``Σ_b cot(b, k)`` (the rows of all samples at once, each on its own slice), and pushes
``K`` rows through the nodes instead of ``B·K``: for per-sample losses, one. A slot whose
tensor does not carry the samples (a parameter, its transpose, a table shared by all
samples) gets the rows **expanded**, ``[K·B, *slot]``: they are formed where a node's edge
leads from a compact slot to such a slot, by calling the node on every sample's masked
cotangent (``node_rules`` does that for common layers from their saved tensors, in one
batched product instead of ``B`` node calls), and everything below an expanded slot is
expanded. A leaf's block is the Gram of its expanded rows; a non-leaf input that stays
compact has a block-diagonal block (samples do not share entries).

Where the samples are at each slot (which dimension, or none) is decided from the slot's
shape and two probe rows pushed along (the rows of samples ``0`` and ``B - 1``), as in
NOTE [sample layouts]: a slot whose candidates the probes leave ambiguous, or where one
sample's cotangent spreads over the others (the samples interact there, e.g. batch-norm in
training mode), is expanded, which is always exact. The decisions are cached per signature
of the graph and ``B``, and the probe rows are pushed only when there is no cached
decision. The signature holds every node's type, input shapes, non-tensor saved arguments
(``batch_norm``'s ``training``, a reduction's ``dim``) and edges (NOTE [graph signatures]
in ``_torch_compat.py``; without the edges, two wirings of the same nodes shared one key
until session 40) and the values of the index tensors that route cotangents (NOTE [routing
values]). A slot's decision is kept by the slot, and so is a probe's finding that one
edge's rows are not localized where an earlier edge put the slot (kept by the edge: the
later calls expand that edge's rows too; until session 28 they did not, and
``h + softmax(h, dim=0)`` was 1 to 7% off from its second call).

NOTE [routing values]
A node that routes cotangents by the values of a saved index or mask (``x[perm]``,
``index_select``, ``gather``, ``sort``, ``take``, ``index_put``, ``scatter``...) can send
sample ``b``'s cotangent to another sample's slice in one call and not in the next, with the
same nodes and shapes. Until session 28 the signature held only those, so a first call whose
permutation was the identity cached "compact" decisions that a later call with another
permutation reused: ``tg.autograd.gramian(losses, params, batch_dim=0)`` of ``model(x)[perm]``
was 3 to 22 (absolute) off, recorded (``tg.autograd.record``, whose tap layouts are cached
the same way) or not. Both caches' keys now hold a digest of those values
(``_torch_compat.routing_values``), so another routing probes again. Nodes whose indices
route within a row (a loss's target class, a dropout or ``where`` mask, an embedding's
token ids, pooling windows) are left out: their values change every batch and cannot move
a cotangent to another sample.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from torchgram._core import _torch_compat
from torchgram._core._torch_compat import Node
from torchgram._core.result import RunReport
from torchgram._core.signature import LruCache
from torchgram.backends.eager.rows import Rows
from torchgram.backends.eager.samples import (
    SampleLayout,
    candidates,
    choose,
    probe_samples,
    twinned,
)
from torchgram.backends.graph.node_rules import expanded_by_rule
from torchgram.backends.graph.nodes import (
    Edge,
    NodeCaller,
    input_slots,
    node_name,
)
from torchgram.backends.graph.walk import WalkPlan, _priority
from torchgram.backends.structured.selections import opened_call

_EXPANDED = "expanded"
Decision = SampleLayout | str
"""A slot's representation: compact with a sample layout, or :data:`_EXPANDED`."""

_DECISIONS = LruCache[dict[tuple[int, ...], Decision]](maxsize=32)


@dataclass
class _Slot:
    """The rows at one input slot: compact ``[c + probes, *slot]`` or expanded ``[c·B, *slot]``."""

    rows: Tensor
    layout: SampleLayout | None  # None: expanded


@dataclass
class SparseResult:
    """Row-major ``(k, b)`` row-Jacobian blocks per target slot are handed to ``on_target``."""

    expanded_nodes: dict[str, int] = field(default_factory=dict)
    ruled_nodes: dict[str, int] = field(default_factory=dict)
    probed: bool = False


OnTarget = Callable[[Edge, "_Slot | None"], None]


class SparseWalk:
    """One sample-sparse walk (NOTE [sample-sparse walk]) of ``rows``' outputs to ``targets``.

    Args:
        rows: The outputs and their per-sample structure (``B > 1``).
        targets: Input slots whose rows are wanted.
        caller: Calls nodes on row batches.
    """

    def __init__(self, rows: Rows, targets: Sequence[Edge], caller: NodeCaller) -> None:
        assert rows.batch_dim is not None
        self.rows = rows
        self.samples = rows.samples
        self.caller = caller
        self._probing = False
        self.edges = [_torch_compat.gradient_edge(out) for out in rows.outputs]
        self.plan = WalkPlan([edge.node for edge in self.edges], targets)
        leaves = [node for node in self.plan.needed if _torch_compat.is_leaf_accumulator(node)]
        self.order = sorted((node for node in self.plan.needed
                             if not _torch_compat.is_leaf_accumulator(node)),
                            key=_torch_compat.creation_order)
        self.position = {node: i for i, node in enumerate(self.order)}
        self.key: Hashable = (rows.samples, rows.batch_dim,
            _torch_compat.graph_signature(self.order),  # NOTE [graph signatures]
            tuple(sorted(_torch_compat.slot_shapes(node) for node in leaves)),
            tuple(sorted(self.position.get(node, -1) for node in self.plan.targets)),
            _torch_compat.routing_values(self.order, rows.samples))  # NOTE [routing values]
        self.result = SparseResult()

    def run(self, start: int, stop: int, on_target: OnTarget) -> None:
        """Push row directions ``start:stop`` (and probes, if undecided) to the targets."""
        cached = _DECISIONS.get(self.key)
        decisions: dict[tuple[int, ...], Decision] = {} if cached is None else dict(cached)
        probing = self._probing = cached is None
        self.result.probed = self.result.probed or probing
        count = stop - start
        probes = twinned(probe_samples(self.samples)) if probing else ()  # NOTE [finite twins]
        seeds = self.rows.direction_seeds(start, stop)
        extra = self.rows.probe_seeds(probes, finite_from=len(probes) // 2) if probes else None
        frontier: dict[Node, list[_Slot | None]] = {}
        batch_dim = self.rows.batch_dim
        assert batch_dim is not None
        for k, (output, out) in enumerate(zip(self.edges, self.rows.outputs, strict=True)):
            rows = seeds[k] if extra is None else torch.cat([seeds[k], extra[k]])
            layout = SampleLayout(batch_dim % out.dim())
            self._accumulate(frontier, (output.node, output.output_nr), _Slot(rows, layout),
                             count)
        remaining = dict(self.plan.dependencies)
        counter = itertools.count()
        ready = [(_priority(node), next(counter), node) for node in self.plan.roots
                 if node in self.plan.needed and remaining[node] == 0]
        heapq.heapify(ready)
        while ready:
            node = heapq.heappop(ready)[2]
            slots = frontier.pop(node, None)
            for input_nr in self.plan.targets.get(node, ()):
                on_target((node, input_nr), None if slots is None else slots[input_nr])
            wanted = self.plan._wanted_edges(node)
            if wanted and slots is not None and any(s is not None for s in slots):
                edges = [e if e is not None and e[0] in self.plan.needed else None
                         for e in self.plan.children[node]]
                for target, slot in self._call(node, slots, edges, count, len(probes),
                                               frontier, decisions):
                    self._accumulate(frontier, target, slot, count)
            for child, _ in wanted:
                remaining[child] -= 1
                if remaining[child] == 0:
                    heapq.heappush(ready, (_priority(child), next(counter), child))
        if probing:
            _DECISIONS.put(self.key, decisions)

    # -- one node ----------------------------------------------------------------------------

    def _call(self, node: Node, slots: list[_Slot | None], edges: list[Edge | None],
              count: int, num_probes: int, frontier: dict[Node, list[_Slot | None]],
              decisions: dict[tuple[int, ...], Decision]) -> list[tuple[Edge, _Slot]]:
        """The node's rows on each wanted edge, compact or expanded (NOTE above)."""
        if any(slot is not None and slot.layout is None for slot in slots):
            expanded = [None if slot is None else self._expand(slot, count) for slot in slots]
            outs = self._node_call(node, expanded, edges)
            return [(edge, _Slot(out, None)) for edge, out in zip(edges, outs, strict=True)
                    if edge is not None and out is not None]
        want: dict[int, Decision | None] = {}
        for k, edge in enumerate(edges):
            if edge is None:
                continue
            child, nr = edge
            if _torch_compat.is_leaf_accumulator(child):
                want[k] = _EXPANDED
                continue
            current = frontier.get(child, [None] * input_slots(child))[nr]
            if decisions.get(self._edge_key(node, k)) == _EXPANDED:  # the probes said so
                want[k] = _EXPANDED
                continue
            if current is not None:
                want[k] = _EXPANDED if current.layout is None else current.layout
                continue
            want[k] = decisions.get((self.position.get(child, -1), nr))
        compact_edges = [edge if k in want and want[k] != _EXPANDED else None
                         for k, edge in enumerate(edges)]
        expand_edges = [edge if want.get(k) == _EXPANDED else None
                        for k, edge in enumerate(edges)]
        results: list[tuple[Edge, _Slot]] = []
        compact_outs: list[Tensor | None] = [None] * len(edges)
        if any(e is not None for e in compact_edges):
            compact_outs = self._node_call(
                node, [None if s is None else s.rows for s in slots], compact_edges, count)
        for k, edge in enumerate(edges):
            out = compact_outs[k]
            if edge is None or out is None or compact_edges[k] is None:
                continue
            decision = want[k]
            if decision is None:  # undecided: the shape and the probes decide (and verify)
                decision = self._decide(edge, out, count, num_probes)
                decisions[(self.position.get(edge[0], -1), edge[1])] = decision
            elif num_probes and isinstance(decision, SampleLayout) and \
                    choose([decision], self._probes(out, count, num_probes),
                           self.samples).layout is None:
                decision = _EXPANDED  # a later parent's rows are not localized there:
                decisions[self._edge_key(node, k)] = decision  # so on cached runs too
            if decision == _EXPANDED:
                expand_edges[k] = edge
                continue
            assert isinstance(decision, SampleLayout)
            results.append((edge, _Slot(out, decision)))
        if any(e is not None for e in expand_edges):
            results += [(edge, _Slot(out, None))
                        for edge, out in zip(expand_edges,
                                             self._expanded_call(node, slots, expand_edges,
                                                                 count), strict=True)
                        if edge is not None and out is not None]
        return results

    def _node_call(self, node: Node, grads: list[Tensor | None], edges: list[Edge | None],
                   probes_from: int | None = None) -> list[Tensor | None]:
        """The caller's gradients; a selection's opened on the probe rows while probing.

        NOTE [opened selections]: only the probes' rows (``probes_from:``, after the
        ``count`` direction rows of a compact call) are opened. The direction rows can hold
        NaN that the selection drops, as torch's backward does: ``sqrt(relu(h))`` at a closed
        entry gives another sample's row ``0 · ∞`` there; opened, it reached every sample's
        entries of ``G`` on a signature's first call (session 58's hunt).
        """
        outs = self.caller(node, grads, edges)
        if not self._probing or probes_from is None:
            return outs
        opened = opened_call(node, [None if g is None else g[probes_from:] for g in grads],
                             [None if o is None else o[probes_from:] for o in outs])
        return [out if out is None or probe is None else torch.cat([out[:probes_from], probe])
                for out, probe in zip(outs, opened, strict=True)]

    def _edge_key(self, node: Node, k: int) -> tuple[int, ...]:
        """The key of a decision for ``node``'s ``k``-th edge alone (not its child's slot)."""
        return (-1, self.position.get(node, -1), k)

    def _probes(self, out: Tensor, count: int,
                num_probes: int) -> list[tuple[tuple[int, ...], Tensor | None]]:
        probed = twinned(probe_samples(self.samples))[:num_probes]
        return [(sample, out[count + i]) for i, sample in enumerate(probed)]

    def _decide(self, edge: Edge, out: Tensor, count: int, num_probes: int) -> Decision:
        shape = out.shape[1:]
        options = candidates(shape, self.samples, range(len(shape)))
        if not num_probes:
            return options[0] if len(options) == 1 else _EXPANDED
        choice = choose(options, self._probes(out, count, num_probes), self.samples)
        del edge
        return _EXPANDED if choice.layout is None else choice.layout

    def _expand(self, slot: _Slot, count: int) -> Tensor:
        """``[c·B, *slot]`` rows: each direction's compact rows masked to each sample."""
        if slot.layout is None:
            return slot.rows
        return expand(slot.rows[:count], slot.layout, self.samples)

    def _expanded_call(self, node: Node, slots: list[_Slot | None],
                       edges: list[Edge | None], count: int) -> list[Tensor | None]:
        """The node's expanded rows on ``edges``: by a rule when one applies, else by mask."""
        name = node_name(node)
        compact = [None if s is None else (s.rows[:count], s.layout) for s in slots]
        ruled = expanded_by_rule(node, compact, edges, self.samples)
        if ruled is not None:
            self.result.ruled_nodes[name] = self.result.ruled_nodes.get(name, 0) + 1
            return ruled
        self.result.expanded_nodes[name] = self.result.expanded_nodes.get(name, 0) + 1
        expanded = [None if s is None else self._expand(s, count) for s in slots]
        return self._node_call(node, expanded, edges)

    def _accumulate(self, frontier: dict[Node, list[_Slot | None]], edge: Edge, slot: _Slot,
                    count: int) -> None:
        node, nr = edge
        buffer = frontier.get(node)
        if buffer is None:
            buffer = frontier[node] = [None] * input_slots(node)
        current = buffer[nr]
        if current is None:
            buffer[nr] = slot
            return
        if current.layout is not None and slot.layout is not None:
            if current.layout == slot.layout:
                buffer[nr] = _Slot(current.rows + slot.rows, current.layout)
                return
        buffer[nr] = _Slot(self._expand(current, count) + self._expand(slot, count), None)


def expand(compact: Tensor, layout: SampleLayout, samples: int) -> Tensor:
    """``[c·B, *slot]``: row ``(k, b)`` is ``compact[k]`` on sample ``b``'s slice, zero elsewhere.

    Example:
        >>> expand(torch.tensor([[1., 2., 3., 4.]]), SampleLayout(0, inner=2), 2)
        tensor([[1., 2., 0., 0.],
                [0., 0., 3., 4.]])
    """
    count = compact.shape[0]
    shape = compact.shape[1:]
    size = shape[layout.dim]
    owner = torch.div(torch.arange(size, device=compact.device), layout.inner,
                      rounding_mode="floor") % samples
    mask = owner == torch.arange(samples, device=compact.device)[:, None]  # [B, size]
    view = [samples] + [1] * len(shape)
    view[1 + layout.dim] = size
    masked = compact.unsqueeze(1) * mask.reshape(view).to(compact.dtype)
    return masked.reshape(count * samples, *shape)


def compact_block(rows: Tensor, layout: SampleLayout, samples: int,
                  diagonal: bool) -> Tensor:
    """The row-major Gram block of compact rows ``[c, *slot]`` (samples share no entry)."""
    count = rows.shape[0]
    per_sample = layout.view(rows, 1, samples).reshape(count, samples, -1)
    if diagonal:
        return per_sample.square().sum(-1).reshape(-1)
    inner = torch.einsum("kbp,lbp->bkl", per_sample, per_sample)  # [B, c, c]
    block = per_sample.new_zeros(count, samples, count, samples)
    index = torch.arange(samples, device=rows.device)
    block[:, index, :, index] = inner
    return block.reshape(count * samples, count * samples)


def slot_numel(shape: Sequence[int]) -> int:
    """Entries of a slot."""
    return math.prod(shape)


__all__ = ["SparseResult", "SparseWalk", "compact_block", "expand"]


def sparse_report(result: SparseResult, report: RunReport | None) -> None:
    """Add what the walk did to ``report``."""
    if report is None:
        return
    for name, count in result.expanded_nodes.items():
        report.notes.append(f"{name}: called on every sample's rows ({count}×)")
