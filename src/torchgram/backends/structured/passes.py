"""The structured backend's passes: one tapped forward, then backwards for row cotangents.

# NOTE [structured passes]
*Per-sample* (``batch_dim``): a trace of ``f`` on one sample (a batch of one) says which calls
are tapped and which leaves need the fallback; traces are cached per function and call
signature, which is safe because every run is checked against its trace (below). Then ONE
forward, in one of two ways:

* **batched** (no fallback leaf): ``f`` runs on the whole batch with plain autograd. Each
  tapped call's output must have the trace's shape except in one dimension, where the trace
  has 1 and the batch ``B``: that dimension indexes the samples (wherever the model moved it).
  This assumes that samples keep their order along it inside ``f`` (true unless ``f`` sorts
  or permutes its batch); if any shape does not fit, the ``vmap`` way is used instead.
* **vmap**: ``f`` runs per sample under ``vmap`` (each sample a batch of one, DESIGN.md §3)
  with the taps ``[B, *y]`` and per-sample copies ``[B, *θ]`` of the fallback leaves (their
  "carriers") as batched inputs, and plain autograd outside. Scaled dot-product attention
  runs with its math kernel there: the fused kernels have no batching rule, and vmap would
  call them once per sample.

Row ``(b, k)`` depends on sample ``b`` only, so the backward of a cotangent that is 1 at
``(b, k)`` for *every* ``b`` gives, at once, every sample's ``∂out_(b,k)/∂y`` on that
sample's slice of each tap, and its per-sample fallback gradients on the carriers. ``K = 1``
(per-sample losses) is one forward and one backward; ``K > 1`` vmaps the backward over
chunks of ``k`` (``is_grads_batched``). ``chunk_size=1`` loops without ``vmap``: over rows,
and (for the ``vmap`` way) over samples.

*Dense rows* (no ``batch_dim``): one forward of ``f`` with taps made on the fly, every leaf's
tensor carrying the gradient of its unrecognised uses, and the backward vmapped over chunks
of basis cotangents of the ``m`` rows: everything is one "sample" with ``R = m`` rows.

A run that leaves its trace (different tapped calls, an unrecognised use the trace did not
see) raises ``TraceMismatch``; the backend then redoes the pass with every leaf on the
fallback, which is always right.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge

from torchgram._core import _torch_compat
from torchgram._core.composition import graph_leaf
from torchgram._core.errors import BackendCannotRun, NotPerSample, OutputChanged
from torchgram._core.functional import stack_grads
from torchgram._core.per_sample import fails_alone
from torchgram._core.problem import Problem
from torchgram._core.result import NO_AUX
from torchgram._core.signature import LruCache, call_signature
from torchgram._core.threads import math_attention
from torchgram.backends.structured.selections import SELECTION_NODES
from torchgram.backends.structured.trace import (
    HookOnTap,
    NotBatched,
    Recording,
    TapMode,
    TraceMismatch,
    UseRecord,
    zero_tap,
)
from torchgram.backends.structured.value_reads import BatchFollowingTapMode

GradChunk = tuple[int, int, list[Tensor | None], dict[int, Tensor]]
T = TypeVar("T")

ForwardKind = Literal["batched", "vmap", "loop", "dense"]
"""The ways of running ``f`` (NOTE [structured passes])."""

_TRACES = LruCache[Recording](maxsize=64)


def _trace_key(problem: Problem, *, dense: bool = False) -> Hashable | None:
    """The trace's cache key (NOTE [call signatures]); ``dense``: the whole batch's."""
    batch = problem.batch
    key = call_signature(problem.f, problem.args, problem.kwargs, problem.diff.positions,
                         problem.has_aux,
                         None if batch is None else (batch.batch_dim, batch.positions,
                                                     batch.dims))
    return ("dense", key) if dense and key is not None and batch is not None else key


def cached_trace(problem: Problem, *, dense: bool = False) -> Recording | None:
    """The cached trace of this call's signature, if any.

    ``dense``: with ``batch_dim``, the recording of a tapped forward of the whole batch
    (NOTE [dense rows planned once] in ``auto.py``), not the one-sample trace.
    """
    return _TRACES.get(_trace_key(problem, dense=dense))


def keep_trace(problem: Problem, recording: Recording, *, dense: bool = False) -> None:
    """Cache a recording made by a tapped run as this call's trace (``dense``: see above)."""
    _TRACES.put(_trace_key(problem, dense=dense), recording)


def forget_trace(problem: Problem) -> None:
    """Drop the cached trace of this call's signature (a run did not replay it)."""
    _TRACES.pop(_trace_key(problem))


def trace(problem: Problem) -> Recording:
    """Run ``f`` once under a tracing :class:`TapMode` (one sample with ``batch_dim``).

    Leaves are given as tensors that require gradients, with gradients enabled, so that
    code which branches on ``requires_grad`` takes the same path as in the real pass. The
    recording is cached per function and call signature (NOTE [call signatures]).
    """
    recording = cached_trace(problem)
    if recording is not None:
        return recording
    with torch.enable_grad():
        carriers = tuple(leaf.detach().requires_grad_() for leaf in problem.leaves)
        batch = problem.batch
        if batch is None:
            mode = TapMode(carriers, problem.leaves, taps="trace")
            with mode:
                rows = problem.rows(carriers)[0]
        else:
            sample = batch.narrow(0, 1)
            # NOTE [reads of the batch's values]: what vmap over the samples cannot batch
            mode = BatchFollowingTapMode(carriers, problem.leaves, taps="trace", probe=True,
                                         batched=sample)
            try:
                with mode:
                    rows = problem.sample_rows(carriers, sample, check_draw=False)
                mode.recording.draws = problem.draw.drew()
            except (BackendCannotRun, OutputChanged, NotPerSample):
                raise
            except Exception as error:  # the probe ran the batch: f fails on a batch of one
                raise fails_alone(error) from error
            mode.recording.uses = live_positions(mode.recording.uses, rows, mode.probes,
                                                 drew=mode.recording.draws)
        mode.note_rows(rows)
        mode.note_unseen_uses(rows, carriers)  # NOTE [unseen uses]
        mode.recording.transform_refusals += _torch_compat.old_style_functions(rows)
    mode.recording.rows = rows.numel()
    keep_trace(problem, mode.recording)
    return mode.recording


# NOTE [dead positions]
# A use's Jacobian sums ``first[t] ⊗ second[t]`` over its positions, and a position where the
# cotangent is zero for every row and sample adds nothing: dropping it from both factors is
# exact. Such positions are common where the output reads a few positions of a layer: BERT's
# and ViT's classifiers read the first token of the last layer, so its feed-forward layers,
# attention output and queries have one live position of T; a causal LM's loss never reads
# the last position's logits. Contracting all T there costs ~T times the work (materialized
# ``Σ_t g_t ⊗ x_t`` over T positions, ghost pairs over T²).
# The trace finds them: it adds a zero tap to every tapped output (``TapMode(probe=True)``),
# and one backward of the traced sample's rows, weighted by random positive numbers (so that
# no row cancels another), shows which positions of each tap the rows reach. A use of a
# matrix product (not a bias, a norm's scale or a lookup, which cost about one pass over the
# cotangent anyway) with at most half its positions live records how many (``UseRecord.live``;
# fewer dead ones do not pay for the check and the copies: a causal LM's one dead position of
# T = 32 in every layer made GPT-2's and LLaMA's Gramians ~7% slower, measured), and the
# cost model counts only those: the way it picks is the one that fits the live positions
# (ghost, for one live position of a wide layer). Only the hint comes from one sample: the
# contraction drops a position only when the run's cotangent is zero there for every row and
# sample (one reduction of the cotangent, one host read, for the hinted uses only), and
# contracts every other position, so a sample that reaches more positions than the traced
# one costs more, never a wrong block.


def live_positions(uses: Sequence[UseRecord], rows: Tensor,
                   probes: Sequence[tuple[int, Tensor]], *, drew: bool = False) -> list[UseRecord]:
    """``uses`` with ``live`` set where the traced rows reach fewer positions.

    NOTE [dead positions]; ``probes``: the trace's zero taps, with their tap indices;
    ``drew``: the traced evaluation drew random numbers, whose zeros (dropout) are that
    draw's: a use none of whose positions the rows reach then gets no hint (NOTE [hints
    from one draw]).
    """
    wanted = [use for use in uses if use.role == "weight" and not use.shape.elementwise
              and not use.shape.act_is_index and use.shape.positions > 1]
    taps = {use.tap for use in wanted}
    probes = [(tap, probe) for tap, probe in probes if tap in taps]
    if not probes or not rows.requires_grad or not rows.is_floating_point():
        return list(uses)
    generator = torch.Generator(device=rows.device).manual_seed(0)  # leaves the draws alone
    weights = (0.5 + torch.rand(rows.shape, generator=generator, device=rows.device)).to(
        rows.dtype)
    try:
        grads = torch.autograd.grad(rows, [probe for _, probe in probes], weights,
                                    allow_unused=True)
    except Exception:  # noqa: BLE001 -- a hint only: the pass itself reports what fails
        return list(uses)
    reached = {tap: grad for (tap, _), grad in zip(probes, grads, strict=True)}
    live: dict[int, int] = {}
    for use in wanted:
        if use.tap not in reached:
            continue
        grad = reached[use.tap]
        count = 0 if grad is None else _live_count(use, grad)
        if count == 0 and drew:  # NOTE [hints from one draw]
            continue
        if count is not None and 2 * count <= use.shape.positions:
            live[id(use)] = count
    return [dataclasses.replace(use, live=live[id(use)]) if id(use) in live else use
            for use in uses]


# NOTE [hints from one draw]
# A random f's trace sees one draw: a dropout after a layer can zero every cotangent of its
# tap there (nn.Dropout2d over few channels: all of them with probability p^C), and the hint
# said the rows reach none of its positions, so the cost model counted one position of T.
# The run contracts the positions the batch's draw reaches (exact), at up to T² times the
# cost the choice assumed: the tests/models zoo's conv + Dropout2d (3 channels, 9 positions,
# 27 rows a sample) went to ghost at an estimated 4.6e4 multiply-adds where it costs ~2e6
# (materialize: 5.4e5), and the structured pass took 4.7-5.3 ms against the graph walk's
# 2.6-2.9 (session 65). A use such a trace sees unreached gets no hint; one it sees reached
# at a few positions keeps its hint (BERT's classifier reads one token in every draw).


def _live_count(use: UseRecord, grad: Tensor) -> int | None:
    """Positions of ``use`` where the trace's cotangent ``grad`` is not zero (``None``: unknown).

    The traced tap has one sample's shape, which is what a per-sample view of the batch's
    tap has (its sample dim kept with size 1): the layout reads it as one row of one sample.
    """
    try:
        factor = use.layout.cot_factor(grad.reshape(1, 1, *grad.shape), 2, None)
    except Exception:  # noqa: BLE001 -- a layout that needs more than the cotangent: no hint
        return None
    if factor.dim() != 5 or factor.shape[2] != use.shape.positions:
        return None
    reached = factor.amax(dim=(0, 1, 3, 4)).ne(0) | factor.amin(dim=(0, 1, 3, 4)).ne(0)
    return int(reached.sum())


def check_replay(traced: Recording, run: Recording, samples: int) -> None:
    """Raise ``TraceMismatch`` unless ``run`` has the trace's uses (``samples`` × positions)."""
    if len(traced.uses) != len(run.uses) or len(traced.taps) != len(run.taps) or not all(
            t.same_structure(r, samples) for t, r in zip(traced.uses, run.uses, strict=True)):
        raise TraceMismatch("the run's tapped uses differ from the trace's")


@dataclass
class Forward:
    """A tapped forward, ready for backwards.

    Attributes:
        kind: ``"batched"``, ``"vmap"``, ``"loop"`` or ``"dense"`` (NOTE [structured passes]).
        recording: The tapped calls and uses as seen by the run.
        samples: ``B`` (1 for dense rows).
        rows_per_sample: ``R``.
        acts: Recorded activations, each ``[B, *per-sample shape]``.
        outputs: The rows: ``[B, R]`` (vmap), per sample ``[R]`` (loop), ``[m]`` (batched:
            output order; dense).
        taps: The taps (per sample for ``loop``).
        carriers: The fallback leaves' tensors (per sample for ``loop``).
        carrier_leaves: The leaves with carriers, in order.
        aux: ``f``'s aux when the full batch was evaluated, else ``NO_AUX``.
        tap_dims: ``batched`` only: each tap's sample axis.
        order: ``batched`` only: ``order[b, k]`` is the output row of row ``k`` of sample ``b``.
        merged_acts: ``batched`` only: the activations whose samples are merged in one dim,
            and that dim (their order is checked against samples run without the others).
        routing: ``batched`` only: the routing digest of the run's graph (NOTE [routing
            values]) and its signature (NOTE [graph signatures]: its nodes, their arguments
            and how they are wired; code that adds a node mixing the samples, ``h.flip(0)``
            behind a Python flag, or wires the same nodes otherwise, changes it), read by
            the derivative checks.
        selections: ``batched`` only: the graph's selection nodes, which the thorough
            derivative check opens (NOTE [opened selections]).
        recheck_values: ``batched`` only: whether the run rewrote a call whose agreement with
            the original one call per trace does not settle (NOTE [rewritten layouts],
            ``rules.SETTLED_PER_TRACE``); its values are then compared with ``f``'s own on
            every call.
    """

    kind: ForwardKind
    recording: Recording
    samples: int
    rows_per_sample: int
    acts: list[Tensor]
    outputs: list[Tensor]
    taps: list[list[Tensor | GradientEdge]]
    carriers: list[list[Tensor]]
    carrier_leaves: list[int]
    aux: Any = NO_AUX
    tap_dims: list[SampleAxis | None] = field(default_factory=list)
    order: Tensor | None = None
    merged_acts: dict[int, int] = field(default_factory=dict)
    routing: tuple[Any, ...] = ()
    selections: list[_torch_compat.Node] = field(default_factory=list)
    recheck_values: bool = False

    def take_acts(self) -> list[Tensor]:
        """The activations, handed over: the forward lets go of them (they can be freed)."""
        acts, self.acts = self.acts, []
        return acts

    def detached_rows(self) -> Tensor:
        """The output rows, in the backend's ``[B, R]`` layout (``[m]`` when batched/dense)."""
        if self.kind in ("batched", "dense"):
            return self.outputs[0].detach().reshape(-1)
        if len(self.outputs) == 1:
            return self.outputs[0].detach()
        return torch.stack([out.detach().reshape(-1) for out in self.outputs])


# -- the ways of running f -----------------------------------------------------------------

@dataclass(frozen=True)
class SampleAxis:
    """Where a batched tensor holds its samples.

    Dim ``dim`` (one entry per sample), or, ``merged``, dim ``dim`` of size ``B·n`` holding the
    ``n`` entries of each sample one sample after the other (``x.view(-1, d)`` of a
    ``[B, T, d]`` tensor).
    """

    dim: int
    merged: bool = False


def per_sample_view(x: Tensor, axis: SampleAxis | None, lead: int, samples: int) -> Tensor:
    """``x`` with its samples (``axis``, after ``lead`` dims) moved to dim ``lead``.

    The other dims have the sizes of one sample's tensor: a split axis keeps a size-1 dim, a
    merged one the sample's own entries. ``axis=None``: ``x`` does not depend on the sample
    (``samples > 1``: shared, expanded) or there is one sample.
    """
    if axis is None:
        x = x.unsqueeze(lead)
        return x.expand(*x.shape[:lead], samples, *x.shape[lead + 1:])
    if axis.merged:
        return x.unflatten(lead + axis.dim, (samples, -1)).movedim(lead + axis.dim, lead)
    return x.movedim(lead + axis.dim, lead).unsqueeze(lead + 1 + axis.dim)


_NO_DIM = SampleAxis(-1)


def _sample_dim(traced: Sequence[int], full: Sequence[int], samples: int, *,
                shared_ok: bool) -> SampleAxis | None:
    """The axis of ``full`` that indexes samples (``None``: no such axis), or ``_NO_DIM``.

    A dim of size 1 in the trace (one sample) and ``B`` in the batch holds the samples; a dim
    of size ``n > 1`` in the trace and ``B·n`` in the batch holds them merged, each sample's
    entries together (to be checked: :func:`merged_acts`).
    """
    if len(traced) != len(full):
        return _NO_DIM
    differ = [i for i, (t, f) in enumerate(zip(traced, full, strict=True)) if t != f]
    if not differ:
        return None if (samples == 1 or shared_ok) else _NO_DIM
    if len(differ) == 1:
        t, f = traced[differ[0]], full[differ[0]]
        if t == 1 and f == samples:
            return SampleAxis(differ[0])
        if t > 1 and f == samples * t:
            return SampleAxis(differ[0], merged=True)
    return _NO_DIM


def _tapped_rows(problem: Problem, carriers: tuple[Tensor, ...],
                 make_mode: Callable[[bool], TapMode]) -> tuple[TapMode, Tensor, Any]:
    """``f``'s rows on the full inputs under ``make_mode(original_layouts)``, and the mode.

    Run again with the original calls' layouts when the first run rewrote a call and ``f``
    drew random numbers (NOTE [rewritten layouts]).
    """
    mode = make_mode(False)
    with mode:
        rows, aux = problem.rows(carriers)
    if mode.rewrote and problem.draw.random:
        mode = make_mode(True)
        with mode:
            rows, aux = problem.rows(carriers)
    mode.note_rows(rows)
    return mode, rows, aux


def batched_forward(problem: Problem, traced: Recording) -> Forward | None:
    """The per-sample forward on the whole batch without ``vmap``, or ``None`` if it cannot be.

    Raises ``TraceMismatch`` when the run leaves the trace.
    """
    batch = problem.batch
    assert batch is not None
    samples = batch.size
    leaves = problem.leaves
    carriers = tuple(graph_leaf(leaf) for leaf in leaves)

    def batched_mode(original_layouts: bool) -> TapMode:
        return TapMode(carriers, leaves, taps="lazy", carriers=(), expected=traced.taps,
                       samples=samples, keep_graph=problem.composition.create_graph,
                       original_layouts=original_layouts)

    try:
        mode, rows, aux = _tapped_rows(problem, carriers, batched_mode)
    except NotBatched:
        return None
    mode.finish()
    nodes = list(_torch_compat.graph_nodes(rows))  # walked once, for two checks
    _check_no_unseen_uses(rows, carriers, nodes)
    if mode.not_batched is not None:
        return None
    run = mode.recording
    check_replay(traced, run, samples)
    tap_dims = [_sample_dim(t.shape, r.shape, samples, shared_ok=False)
                for t, r in zip(traced.taps, run.taps, strict=True)]
    act_dims: dict[int, SampleAxis | None] = {}
    for t, r in zip(traced.uses, run.uses, strict=True):
        if r.act is not None and t.act_shape is not None and r.act_shape is not None:
            act_dims[r.act] = _sample_dim(t.act_shape, r.act_shape, samples, shared_ok=True)
    if _NO_DIM in tap_dims or _NO_DIM in act_dims.values() or len(act_dims) != len(mode.acts):
        return None
    if not _merged_taps_have_acts(run, tap_dims, act_dims, mode.built_taps):
        return None
    acts = [per_sample_view(act, act_dims[i], 0, samples) for i, act in enumerate(mode.acts)]
    per_sample = rows.numel() // samples
    return Forward("batched", run, samples, per_sample, acts, [rows], [mode.made_taps], [[]],
                   [], aux=aux, tap_dims=tap_dims,
                   order=problem.sample_major_index if per_sample > 1 else None,
                   merged_acts={i: axis.dim for i, axis in act_dims.items()
                                if axis is not None and axis.merged},
                   routing=(_torch_compat.routing_values(nodes, samples),
                            _torch_compat.graph_signature(nodes)),  # NOTE [graph signatures]
                   selections=[node for node in nodes
                               if type(node).__name__ in SELECTION_NODES],
                   recheck_values=mode.recheck_values)


def _merged_taps_have_acts(run: Recording, tap_dims: Sequence[SampleAxis | None],
                           act_dims: dict[int, SampleAxis | None],
                           built: Collection[int] = ()) -> bool:
    """Whether every tap with merged samples has a weight use whose activation is merged too.

    The order of a merged axis (each sample's entries together, not interleaved) is checked
    on the activations (:func:`merged_acts`); a tap's output rows follow its activation's.
    ``built``: taps whose merged order the tapping mode made (NOTE [shared taps]).
    """
    for tap, axis in enumerate(tap_dims):
        if axis is None or not axis.merged or tap in built:
            continue
        acts = [use.act for use in run.uses if use.tap == tap and use.act is not None]
        if not acts or any(act_dims[a] is None or not act_dims[a].merged  # type: ignore[union-attr]
                           for a in acts):
            return False
    return True


def restrict(traced: Recording, tapped: Sequence[int]) -> Recording:
    """The trace as a run that taps only the ``tapped`` leaves sees it (renumbered)."""
    keep = set(tapped)
    uses = [use for use in traced.uses if use.leaf in keep]
    taps = sorted({use.tap for use in uses})
    acts = sorted({use.act for use in uses if use.act is not None})
    tap_index = {old: new for new, old in enumerate(taps)}
    act_index = {old: new for new, old in enumerate(acts)}
    return Recording(
        taps=[traced.taps[i] for i in taps],
        uses=[dataclasses.replace(use, tap=tap_index[use.tap],
                                  act=None if use.act is None else act_index[use.act])
              for use in uses],
        unrecognised=traced.unrecognised, unrecognised_flops=traced.unrecognised_flops,
        gradient_hooks=traced.gradient_hooks)


def per_sample_forward(problem: Problem, traced: Recording,
                       fallback: Sequence[int], *, loop: bool) -> Forward:
    """The tapped per-sample forward under ``vmap`` (or a loop over samples).

    ``traced`` is the trace restricted to the leaves that are not on the fallback.
    """
    batch = problem.batch
    assert batch is not None
    size = batch.size
    leaves = problem.leaves
    fallback = sorted(fallback)
    tapped = [i for i in range(len(leaves)) if i not in set(fallback)]
    tap_specs = traced.taps
    base = [graph_leaf(leaf) for leaf in leaves]
    recordings: list[Recording] = []

    def run(taps: Sequence[Tensor], carriers: Sequence[Tensor],
            sample: tuple[Tensor, ...]) -> tuple[Tensor, list[Tensor]]:
        run_leaves = list(base)
        for leaf, carrier in zip(fallback, carriers, strict=True):
            run_leaves[leaf] = carrier
        mode = TapMode(run_leaves, leaves, tapped=tapped, taps=list(taps), expected=tap_specs,
                       carriers=fallback, keep_graph=problem.composition.create_graph)
        with mode:
            rows = problem.sample_rows(tuple(run_leaves), sample)
        mode.finish()
        recordings.append(mode.recording)
        return rows, mode.acts

    device = leaves[0].device
    if loop:
        outputs, acts_per_sample, taps_all, carriers_all = [], [], [], []
        for b in range(size):
            taps = [zero_tap(spec.shape, spec.dtype, device) for spec in tap_specs]
            carriers = [graph_leaf(leaves[i]) for i in fallback]
            sample = batch.narrow(b, 1)
            rows, acts = run(taps, carriers, sample)
            outputs.append(rows)
            acts_per_sample.append(acts)
            taps_all.append(list[Tensor | GradientEdge](taps))
            carriers_all.append(carriers)
        # every sample's run, not only the first: a later sample routed through another
        # weight (a mixture of experts' router) had its use counted under the first one's
        # tap, 2.8e-2 off on transformers' Switch encoder (session 67's review)
        for recording, rows in zip(recordings, outputs, strict=True):
            check_replay(traced, recording, 1)
            _check_no_unseen_uses(rows, [base[i] for i in tapped])
        acts = [torch.stack([acts_b[i] for acts_b in acts_per_sample])
                for i in range(len(acts_per_sample[0]))]
        return Forward("loop", recordings[0], size, outputs[0].numel(), acts, outputs,
                       taps_all, carriers_all, fallback)

    taps = [zero_tap((size, *spec.shape), spec.dtype, device) for spec in tap_specs]
    carriers = [graph_leaf(leaves[i], copies=size) for i in fallback]

    def one_sample(taps: tuple[Tensor, ...], carriers: tuple[Tensor, ...],
                   *inputs: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        sample = tuple(x.unsqueeze(d) for x, d in zip(inputs, batch.dims, strict=True))
        rows, acts = run(taps, carriers, sample)
        return rows, tuple(acts)

    # Attention's math kernel: the fused ones have no batching rule (NOTE above).
    with math_attention():
        rows, batched_acts = torch.func.vmap(one_sample, in_dims=(0, 0, *batch.dims))(
            tuple(taps), tuple(carriers), *batch.tensors)
    acts = list(batched_acts)
    check_replay(traced, recordings[0], 1)
    _check_no_unseen_uses(rows, [base[i] for i in tapped])
    return Forward("vmap", recordings[0], size, rows.shape[1], list(acts), [rows],
                   [list[Tensor | GradientEdge](taps)], [carriers], fallback)


def _check_no_unseen_uses(rows: Tensor, tapped: Sequence[Tensor],
                          nodes: Sequence[_torch_compat.Node] | None = None) -> None:
    """Raise ``TraceMismatch`` if ``rows`` reach a tapped leaf's tensor (NOTE [unseen uses]).

    A run that follows a trace computes every use of a tapped leaf from a plain copy, so its
    graph never reaches the leaf's own tensor, unless ``f`` now uses it in code the mode
    cannot see, which its (cached) trace did not: the trace is stale, and those rows would be
    dropped.
    """
    if _torch_compat.reached_leaves(rows, tapped, nodes):
        raise TraceMismatch("f uses a parameter in calls the tapping mode cannot see, which "
                            "its trace did not")


def dense_forward(problem: Problem, *, fuse: bool = True) -> Forward:
    """The tapped forward on the full inputs, taps made on the fly (dense rows).

    ``fuse``: as :class:`TapMode`'s (``auto``'s planning forward: ``False``).
    """
    leaves = problem.leaves
    carriers = [graph_leaf(leaf) for leaf in leaves]

    def dense_mode(original_layouts: bool) -> TapMode:
        return TapMode(carriers, leaves, taps="lazy", keep_graph=problem.composition.create_graph,
                       original_layouts=original_layouts, fuse=fuse)

    mode, rows, aux = _tapped_rows(problem, tuple(carriers), dense_mode)
    mode.note_unseen_uses(rows, carriers)  # NOTE [unseen uses]
    # as the trace's: kept as the trace by auto's plan, whose later calls (f not evaluated
    # yet) read from it that f draws (they planned the jacobian backend first, which refuses)
    mode.recording.draws = problem.draw.drew()
    used = sorted(mode.recording.unrecognised)
    mode.recording.rows = rows.numel()
    return Forward("dense", mode.recording, 1, rows.numel(),
                   [act.unsqueeze(0) for act in mode.acts], [rows], [mode.made_taps],
                   [[carriers[i] for i in used]], used, aux=aux)


# -- backwards -------------------------------------------------------------------------------

def rows_per_pass(problem: Problem, forward: Forward) -> int:
    """Cotangent directions per backward (each covers every sample): chunk_size / budget.

    One when the backwards cannot be vmapped (``Problem.loops_only``).
    """
    rows = forward.rows_per_sample
    if problem.loops_only:
        return 1
    if problem.chunk_size is not None:
        return max(1, min(rows, problem.chunk_size // max(1, forward.samples)))
    if problem.memory_budget is None:
        return max(rows, 1)
    per_direction = sum(t.numel() if isinstance(t, Tensor)  # else a gradient edge
                        else math.prod(forward.recording.taps[i].shape)
                        for i, t in enumerate(forward.taps[0])) + \
        sum(c.numel() for c in forward.carriers[0])
    per_direction *= forward.samples if forward.kind == "loop" else 1
    return int(max(1, min(rows, problem.memory_budget // max(1, per_direction *
                                                                  problem.itemsize))))


def _direction_cotangents(forward: Forward, start: int, stop: int) -> Tensor:
    """``[c, *outputs]``: for each ``k`` in ``start:stop``, 1 at row ``k`` of every sample."""
    rows = forward.outputs[0]
    count = stop - start
    cot = rows.new_zeros(count, *rows.shape)
    ks = torch.arange(start, stop, device=rows.device)
    if forward.kind == "batched":
        assert forward.order is not None
        cot[torch.arange(count, device=rows.device)[:, None], forward.order[:, ks].T] = 1
    elif forward.kind == "dense":
        cot[torch.arange(count, device=rows.device), ks] = 1
    else:
        cot[torch.arange(count, device=rows.device), :, ks] = 1
    return cot


def backward_chunks(forward: Forward, per_pass: int, *, vectorize: bool,
                    create_graph: bool = False) -> Iterator[GradChunk]:
    """``(start, stop, tap cotangents [c, B, *y], carrier grads [c, B, *θ])`` per row chunk.

    A tap the output does not depend on gets ``None``. ``create_graph``: the backwards are
    differentiable (NOTE [composition]).
    """
    raise_hooked(forward.recording, streamed=False)  # NOTE [hooks on taps]
    if forward.kind == "loop":
        yield from _looped_chunks(forward, create_graph)
        return
    rows = forward.outputs[0]
    inputs: Any = [*forward.taps[0], *forward.carriers[0]]  # tensors and gradient edges
    if not rows.requires_grad or not inputs:  # f uses no leaf (its inputs may require grad)
        return
    num_taps = len(forward.taps[0])
    total = forward.rows_per_sample
    samples = forward.samples
    for start in range(0, total, per_pass):
        stop = min(start + per_pass, total)
        count = stop - start
        if total == 1 and forward.kind in ("vmap", "batched"):
            cot = torch.ones_like(rows).unsqueeze(0)
        else:
            cot = _direction_cotangents(forward, start, stop)
        batched = vectorize and count > 1
        raw = row_grads(rows, inputs, cot, batched=batched, retain_graph=stop < total,
                     create_graph=create_graph)
        grads: list[Tensor | None] = [None if g is None else (g if batched else g.unsqueeze(0))
                                      for g in raw]
        del raw
        if forward.kind == "dense":  # no sample dim: B = 1
            grads = [None if g is None else g.unsqueeze(1) for g in grads]
        elif forward.kind == "batched":
            grads = [None if g is None else per_sample_view(g, dim, 1, samples)
                     for g, dim in zip(grads, forward.tap_dims, strict=True)]
        tap_cots = grads[:num_taps]
        carrier_grads = {  # [c, B, *leaf.shape], in whatever layout the backward made
            leaf: grad.reshape(count, samples, *grad.shape[2:])  # (not [-(dim - 2):]: -0)
            if forward.kind == "dense" else grad
            for leaf, grad in zip(forward.carrier_leaves, grads[num_taps:], strict=True)
            if grad is not None
        }
        del grads  # the consumer frees what it is done with
        yield start, stop, tap_cots, carrier_grads


# NOTE [batched backwards that fail]
# Several rows' backward runs as one, vmapped over the cotangents (``is_grads_batched``). A
# custom ``autograd.Function`` whose backward vmap cannot run (``.item()`` or ``.numpy()`` in
# it; ``nn.CrossMapLRN2d``, whose backward calls ``grad.new``) makes that raise, though each
# row's backward alone runs: with several rows per backward (``batch_dim=None``, or several
# outputs per sample) ``structured`` and ``auto`` raised torch's error until session 58. The
# backends now redo the call with one row per backward, as ``chunk_size=1`` does (NOTE [vmap
# or loop]) on a copy of the problem marked ``unbatched`` (:func:`with_row_loops`). The failed
# attempt's graph may be partly freed, so the redo evaluates ``f`` again.


class BatchedBackwardFailed(RuntimeError):
    """A backward of several rows at once failed where one row's may not (see the NOTE)."""

    def __init__(self, error: RuntimeError) -> None:
        text = str(error).strip()
        self.reason = f"{type(error).__name__}: {text.splitlines()[0][:120] if text else ''}"
        super().__init__(f"a backward of several rows at once (vmapped) failed: {self.reason}")


_BATCHED_BACKWARD_FAILED = LruCache[str](maxsize=64)
"""Call signatures whose batched backward failed, with why (NOTE [batched backwards that fail])."""


def raise_hooked(recording: Recording, *, streamed: bool) -> None:
    """Raise :class:`HookOnTap` where ``f``'s gradient hooks are not seen by this pass.

    NOTE [hooks on taps]: a hook on a tapped output where the pass asks for the taps as
    inputs (not ``streamed``); a hook on a parameter or on a tensor of parameters only in
    every pass.
    """
    if recording.hooked_leaf is not None:
        raise HookOnTap(recording.hooked_leaf)
    if recording.hooked_tap is not None and not streamed:
        raise HookOnTap(f"a {recording.hooked_tap} call's output")


def _hook_on_tap_refused(api: str, hooked: HookOnTap) -> BackendCannotRun:
    """The structured backend's refusal of a hook it does not see (NOTE [hooks on taps])."""
    return BackendCannotRun(
        api, "structured", "f without gradient hooks on its parameters, or on the outputs "
        "of the calls it taps where the rows' backward asks for the taps (torch hands such an "
        "output's gradient to them before the hook)", f"Tensor.register_hook on {hooked.rule} "
        "inside f", ("jacobian",), "Or register the hook on a tensor computed from the "
        "batch's data after the layer (after the activation), or outside f.")


def with_row_loops(problem: Problem) -> Problem:
    """``problem`` with one row per backward (NOTE [batched backwards that fail])."""
    return dataclasses.replace(problem,
                               unbatched=(*problem.unbatched, "a backward vmap cannot batch"))


def _row_loops_if_known(problem: Problem) -> tuple[Problem, str | None]:
    """``problem``, with one row per backward where its signature's batched backward failed.

    Returns the problem to run and the reason, if one was known (later calls of a signature
    then do not fail and redo each time: twice the evaluations, the review of session 58).
    """
    reason = _BATCHED_BACKWARD_FAILED.get(_trace_key(problem))
    return (problem, None) if reason is None else (with_row_loops(problem), reason)


def _redone(problem: Problem, failed: BatchedBackwardFailed) -> tuple[Problem, str]:
    """Remember that ``problem``'s batched backward failed; the problem to redo and why."""
    _BATCHED_BACKWARD_FAILED.put(_trace_key(problem), failed.reason)
    return with_row_loops(problem), failed.reason


def run_with_fallbacks(problem: Problem, run: Callable[[Problem, bool], T]
                       ) -> tuple[T, str | None]:
    """``run(problem, redo)`` with the structured passes' fallbacks.

    Returns the result and why it ran with one row per backward, if it did. NOTE [batched
    backwards that fail]: where the signature's batched backward failed before, or fails
    now, ``run`` gets the problem with one row per backward (``redo``: after a failure,
    nothing of the failed attempt may be reused). NOTE [hooks on taps]: a pass that does not
    see ``f``'s gradient hooks is a refusal naming ``jacobian``.
    """
    problem, known = _row_loops_if_known(problem)
    try:
        return run(problem, False), known
    except BatchedBackwardFailed as failed:
        problem, known = _redone(problem, failed)
        return run(problem, True), known
    except HookOnTap as hooked:
        raise _hook_on_tap_refused(problem.api, hooked) from hooked


def redone_note(reason: str) -> str:
    """The report's note of a call run with one row per backward."""
    return f"a batched backward failed ({reason}); one row per backward instead"


def row_grads(rows: Tensor, inputs: Sequence[Any], cot: Tensor, *, batched: bool,
           retain_graph: bool, create_graph: bool) -> tuple[Tensor | None, ...]:
    """``autograd.grad`` of ``rows`` for the cotangents ``cot`` (``[c, *rows]``).

    ``c = 1`` unless ``batched``; batched results have a leading ``c`` dim.

    With ``create_graph`` the cotangents are taken one at a time, never batched: torch 2.13's
    batched double-backward formulas are wrong without a word through ``F.group_norm``
    (``is_grads_batched=True, create_graph=True`` gave per-row gradients 3-5 off, where the
    same backward without ``create_graph`` or one cotangent at a time is exact; update hunt 3)
    and fail outright through layer norm, so no batched differentiable backward is trusted.
    """
    if not create_graph:
        try:
            return torch.autograd.grad(rows, inputs, cot if batched else cot[0],
                                       retain_graph=retain_graph, allow_unused=True,
                                       is_grads_batched=batched)
        except RuntimeError as error:
            if not batched or type(error) is not RuntimeError:  # torchgram's own: as they are
                raise
            raise BatchedBackwardFailed(error) from error  # NOTE [batched backwards that fail]
    if batched:
        per_row = [torch.autograd.grad(rows, inputs, c, retain_graph=True, create_graph=True,
                                       allow_unused=True) for c in cot]
        return tuple(stack_grads([g[i] for g in per_row]) for i in range(len(inputs)))
    return torch.autograd.grad(rows, inputs, cot[0], retain_graph=True, create_graph=True,
                               allow_unused=True)


def _looped_chunks(forward: Forward, create_graph: bool) -> Iterator[GradChunk]:
    """One row at a time, one sample at a time, without vmap (``chunk_size=1``)."""
    total = forward.rows_per_sample
    num_taps = len(forward.taps[0])
    for k in range(total):
        per_sample: list[list[Tensor | None]] = []
        for b, rows in enumerate(forward.outputs):
            inputs: Any = [*forward.taps[b], *forward.carriers[b]]  # zero taps: tensors
            if not rows.requires_grad or not inputs:
                per_sample.append([None] * len(inputs))
                continue
            grads = torch.autograd.grad(rows.reshape(-1)[k], inputs,
                                        retain_graph=create_graph or k + 1 < total,
                                        create_graph=create_graph, allow_unused=True)
            per_sample.append(list(grads))
        stacked: list[Tensor | None] = []
        for column in zip(*per_sample, strict=True):
            grad = stack_grads(column)
            stacked.append(None if grad is None else grad.unsqueeze(0))
        carrier_grads = {
            leaf: grad
            for leaf, grad in zip(forward.carrier_leaves, stacked[num_taps:], strict=True)
            if grad is not None
        }
        yield k, k + 1, stacked[:num_taps], carrier_grads
