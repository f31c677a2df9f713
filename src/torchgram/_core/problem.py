"""One Gramian call, normalised: the pure function of the differentiated leaves.

# NOTE [the problem]
A :class:`Problem` is built once per call, before any backend runs, and never changes:
the function, the arguments, the differentiated leaves (:class:`~torchgram._core.pytree.
DiffLeaves`), the per-sample structure (:class:`BatchSpec`), the output's structure
(:class:`OutputSpec`, from a probe of ``f``: NOTE [call signatures]) and the options.
Backends are functions ``problem -> BackendResult`` (``_core.result``); they evaluate ``f``
through the problem:

* :meth:`Problem.rows` evaluates ``f`` on the full inputs and returns its output flattened
  to the ``m`` rows of the Jacobian (``optree.tree_leaves`` order, each leaf flattened
  row-major) and aux;
* with per-sample structure, :meth:`Problem.sample_rows` evaluates ``f`` on one sample seen
  as a batch of one and returns that sample's ``K`` rows; :meth:`OutputSpec.sample_major_index`
  says where row ``k`` of sample ``b`` sits among the ``m`` rows.

Every evaluation checks its output against the spec (shapes only, no host sync) and starts
from the call's random-number state (NOTE [one draw]).
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import optree
import torch
from torch import Tensor
from torch.nn.parameter import is_lazy

from torchgram._core import _torch_compat
from torchgram._core.caller_context import caller_context
from torchgram._core.captured_writes import (
    CapturedWrites,
    RenormalisedOnce,
    StaleWrites,
    argument_memory,
    captured_memory,
    hidden_tensor,
    memory_of,
    parameter_changed_unseen,
)
from torchgram._core.census import (
    DenseEmbeddingGradients,
    OpCensus,
    ProbeCheck,
    again_with_graph,
    may_need_a_graph,
)
from torchgram._core.checks import check_not_meta, fail, message, resolve_argnums
from torchgram._core.composition import (
    Composition,
    carries_forward_tangents,
    detect_composition,
    differentiable_evaluation,
    forward_ad_level_open,
    refuse_forward_mode_tangents,
)
from torchgram._core.errors import (
    CapturedWrite,
    CounterRead,
    NotPerSample,
    OutputChanged,
    RunningStatsDifferentiated,
    UnseenWrite,
    captured_write_refusal,
    counter_read_error,
    derivative_faults_refused,
    draws_refused_by_vmap,
    f_refused_by_vmap,
    forward_mode_refusal,
    in_place_refusal,
    reentrant_checkpoint_refused,
    running_stats_refusal,
    tied_keys_refusal,
    unseen_calls_refused,
)
from torchgram._core.hooked_modules import reached
from torchgram._core.model_caches import refuse_updated_caches
from torchgram._core.options import InDims, Options
from torchgram._core.pytree import DiffLeaves, leaves_of, select_diff_leaves
from torchgram._core.rng import RngState
from torchgram._core.running_stats import FrozenRunningStats, counters_refused
from torchgram._core.side_gradients import evaluating
from torchgram._core.signature import LruCache, call_signature
from torchgram._core.threads import RNG_LOCK, compiled_code_eager, math_attention
from torchgram._core.unseen import UnseenCalls
from torchgram._core.watched_calls import watched_calls_modes

_TENSOR_SLOT = object()


@dataclass(frozen=True)
class OutputSpec:
    """Structure of ``f``'s output on the full batch.

    Attributes:
        treespec: The output's optree treespec (a single leaf for a tensor output).
        shapes: The full shape of every output leaf.
        dtypes: The dtype of every output leaf.
        dtype: Their common (promoted) floating dtype: the Gramian has this dtype.
        device: The device of the first output leaf; the Gramian lives there.
        batch_dims: With per-sample structure, the sample dimension of every output leaf
            (non-negative); otherwise ``None``.
    """

    treespec: optree.PyTreeSpec
    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    dtype: torch.dtype
    device: torch.device
    batch_dims: tuple[int, ...] | None

    @property
    def num_rows(self) -> int:
        """``m``: the total number of output entries, i.e. of Jacobian rows."""
        return sum(math.prod(shape) for shape in self.shapes)

    @property
    def is_tensor(self) -> bool:
        """Whether ``f`` returned a bare tensor (the Gramian then has shape ``S + S``)."""
        return self.treespec.num_nodes == 1 and self.treespec.num_leaves == 1

    @property
    def sample_shapes(self) -> tuple[torch.Size, ...]:
        """The shape of every output leaf for one sample (size 1 along its batch dim)."""
        assert self.batch_dims is not None
        return tuple(torch.Size((*shape[:dim], 1, *shape[dim + 1:]))
                     for shape, dim in zip(self.shapes, self.batch_dims, strict=True))

    def sample_major_index(self, samples: int) -> Tensor:
        """``[B, K]`` index: row ``k`` of sample ``b`` is row ``index[b, k]`` of the output.

        The per-sample row order is that of :meth:`Problem.sample_rows`: output leaves in
        order, each flattened row-major with its batch dimension removed.
        """
        assert self.batch_dims is not None
        columns = []
        offset = 0
        for shape, dim in zip(self.shapes, self.batch_dims, strict=True):
            numel = math.prod(shape)
            index = torch.arange(offset, offset + numel, device=self.device).reshape(shape)
            columns.append(index.movedim(dim, 0).reshape(samples, -1))
            offset += numel
        return torch.cat(columns, dim=1)

    @property
    def sample_major_is_output_order(self) -> bool:
        """Whether sample-major rows are already in the output's order (one leaf, dim 0)."""
        return self.batch_dims is not None and len(self.shapes) == 1 and self.batch_dims[0] == 0

    def check(self, out_leaves: list[Tensor], treespec: optree.PyTreeSpec, *,
              per_sample: bool) -> None:
        """Raise :class:`OutputChanged` unless the leaves have this structure."""
        shapes = self.sample_shapes if per_sample else self.shapes
        if treespec != self.treespec or len(out_leaves) != len(shapes) or any(
                not isinstance(leaf, Tensor) or leaf.shape != shape or leaf.dtype != dtype
                for leaf, shape, dtype in zip(out_leaves, shapes, self.dtypes, strict=True)):
            raise OutputChanged("f returned an output of another structure than its probe",
                                None if per_sample or treespec != self.treespec
                                else self._other_sample_count(out_leaves))

    def _other_sample_count(self, out_leaves: list[Tensor]) -> tuple[int, int] | None:
        """``(size, B)`` where the leaves differ from the spec only in their batch size."""
        if self.batch_dims is None or len(out_leaves) != len(self.shapes):
            return None
        for leaf, shape, dim in zip(out_leaves, self.shapes, self.batch_dims, strict=True):
            if (isinstance(leaf, Tensor) and same_beyond(leaf.shape, shape, dim)
                    and leaf.shape[dim] != shape[dim]):
                return leaf.shape[dim], shape[dim]
        return None


def same_beyond(shape: Sequence[int], other: Sequence[int], dim: int) -> bool:
    """Whether two shapes have the same rank and sizes, except (perhaps) along ``dim``.

    Example:
        >>> same_beyond((3, 4), (5, 4), 0), same_beyond((3, 4), (3, 5), 0)
        (True, False)
    """
    return len(shape) == len(other) and all(
        a == b for d, (a, b) in enumerate(zip(shape, other, strict=True)) if d != dim % len(shape))


@dataclass(frozen=True)
class BatchSpec:
    """Where the samples are in the inputs (DESIGN.md §3).

    Attributes:
        batch_dim: The output dimension that indexes samples, as the user gave it.
        size: The number of samples ``B``.
        positions: For every batched input tensor, ``(arg position or keyword, leaf index)``.
        dims: The (non-negative) batch dimension of every batched input tensor.
        tensors: The batched input tensors themselves.
    """

    batch_dim: int
    size: int
    positions: tuple[tuple[int | str, int], ...]
    dims: tuple[int, ...]
    tensors: tuple[Tensor, ...]

    def narrow(self, first: int, count: int) -> tuple[Tensor, ...]:
        """The batched inputs restricted to samples ``first..first+count-1`` (dims kept)."""
        return tuple(t.narrow(d, first, count) for t, d in zip(self.tensors, self.dims,
                                                                strict=True))


@dataclass(frozen=True)
class Evaluation:
    """An evaluation of ``f`` on the full batch with autograd, made by the probe.

    Attributes:
        leaves: Fresh aliases of the differentiated leaves that require grad (never the
            user's tensors).
        rows: The output rows ``[m]``, with their autograd graph.
        aux: ``f``'s aux.
        hooks: Whether ``f`` registered gradient hooks on its tensors (NOTE [gradient hooks
            inside f]).
    """

    leaves: tuple[Tensor, ...]
    rows: Tensor
    aux: Any
    hooks: bool = False


class Draw:
    """The random-number states of one call (NOTE [one draw]): where it starts and ends.

    Owned by the call (not shared between calls); every evaluation restores ``start``.
    The generators are process-wide (NOTE [threads]): evaluations that may draw hold
    ``RNG_LOCK`` from the restore to their end, and once a full evaluation has shown that
    ``f`` draws nothing, the call leaves the generators alone.
    """

    def __init__(self, start: RngState) -> None:
        self.start = start
        self.end: RngState | None = None
        self._end_moved = False  # whether ``end`` differs from ``start`` (set with ``end``)
        self._explicit: dict[int, ExplicitGenerator] = {}

    @property
    def generators(self) -> tuple[Any, ...]:
        """The host generators ``f`` holds that this draw looks after.

        NOTE [generators f holds].
        """
        return () if self.start.host is None else self.start.host.generators

    def adopt(self, generator: torch.Generator) -> None:
        """Handle ``generator`` (one ``f`` draws from explicitly) like the default ones.

        Called by every evaluation's write guard before ``f`` draws from it (NOTE [explicit
        generators]): its state then is the call's start. Held weakly: a generator made
        inside an evaluation (seeded there, so the same draws every time: torchgram's own
        checks nested in ``f`` make some) is gone when the evaluation ends, and does not
        make ``f`` random.
        """
        kept = self._explicit.get(id(generator))
        if (kept is None or kept.generator() is not generator) and not _is_default(generator):
            self._explicit[id(generator)] = ExplicitGenerator(weakref.ref(generator),
                                                              generator.get_state())

    def _live(self) -> list[tuple[ExplicitGenerator, torch.Generator]]:
        """The adopted generators still alive (the others are forgotten)."""
        live = []
        for key, kept in list(self._explicit.items()):
            generator = kept.generator()
            if generator is None:
                del self._explicit[key]
            else:
                live.append((kept, generator))
        return live

    def _explicit_moved(self) -> bool:
        return any(not torch.equal(generator.get_state(), kept.start)
                   for kept, generator in self._live())

    def _restore_explicit(self, *, end: bool) -> None:
        for kept, generator in self._live():
            generator.set_state(kept.end if end and kept.end is not None else kept.start)

    @classmethod
    def capture(cls, devices: Iterable[torch.device], owned: tuple[Any, ...] = ()) -> Draw:
        """The draw of a call starting now.

        ``owned``: the generators ``f`` holds (NOTE [generators f holds]).
        """
        with RNG_LOCK:
            return cls(RngState.capture(devices, owned=owned))

    @contextlib.contextmanager
    def evaluation(self, *, full: bool, check: bool = False,
                   restore_after: bool = False) -> Iterator[None]:
        """One evaluation of ``f`` from the call's state.

        ``full``: it evaluates the whole batch (it fixes where the call ends); ``check``: an
        evaluation of part of the batch that must not draw (:meth:`check_no_draw`);
        ``restore_after``: put the generators back to the call's start afterwards.
        """
        if self.random is False:  # f draws nothing: the generators are none of our business
            yield
            return
        with RNG_LOCK:
            self.start.restore()
            self._restore_explicit(end=False)
            try:
                yield
                if full:
                    self.after_full_evaluation()
                elif check:
                    self.check_no_draw()
            finally:
                if restore_after:
                    self.start.restore()
                    self._restore_explicit(end=False)

    def after_full_evaluation(self) -> None:
        """Remember where a plain call of ``f`` leaves the generators (the first time)."""
        if self.end is None:
            self.end = self.start.again()
            self._end_moved = not self.end.same_as(self.start)  # both fixed from now on
        for kept, generator in self._live():
            if kept.end is None:
                kept.end = generator.get_state()

    @property
    def random(self) -> bool | None:
        """Whether a full evaluation of ``f`` drew random numbers (``None``: none ran yet)."""
        if self.end is None:
            return None
        return self._end_moved or any(
            kept.end is not None and not torch.equal(kept.end, kept.start)
            for kept, _ in self._live())

    def drew(self) -> bool:
        """Whether ``f`` draws random numbers.

        As a full evaluation showed; before any, whether the generators have left the call's
        start (asked right after an evaluation of part of the batch, e.g. a trace).
        """
        if self.random is not None:
            return self.random
        now = self.start.again()
        return not now.same_as(self.start) or self._explicit_moved()

    def check_no_draw(self) -> None:
        """Raise :class:`NotPerSample` if the evaluation that just ran drew random numbers."""
        now = self.start.again()
        if not now.same_as(self.start) or self._explicit_moved():
            raise NotPerSample("f draws random numbers (dropout, ...): one sample at a time it "
                               "would see other draws than the batch's", random=True)

    def rewind(self) -> None:
        """Put the generators back where the call started (it is started afresh)."""
        if self.random is False:  # untouched by the call
            return
        with RNG_LOCK:
            self.start.restore()
            self._restore_explicit(end=False)

    @contextlib.contextmanager
    def kept_across(self) -> Iterator[None]:
        """Evaluations of ``f`` inside leave the generators as they are at the start.

        For an evaluation after the call's computation (``Jᵀw``, the output): the generators
        then stand where the call leaves them plus what ran since, e.g. a weighting's draws
        (``pcgrad`` without a generator), which the evaluation's :meth:`finish` undid on
        ``graph`` (session 67's hunt: the next step's dropout reused them).
        """
        if self.random is False:
            yield
            return
        with RNG_LOCK:
            now = self.start.again()
            explicit = [(generator, generator.get_state()) for _, generator in self._live()]
        try:
            yield
        finally:
            with RNG_LOCK:
                now.restore()
                for generator, state in explicit:
                    generator.set_state(state)

    def finish(self) -> None:
        """Leave the generators where one plain call of ``f`` would."""
        if self.random is False:  # untouched by the call: other threads may have drawn since
            return
        with RNG_LOCK:
            (self.end or self.start).restore()
            self._restore_explicit(end=True)


def _is_default(generator: torch.Generator) -> bool:
    """Whether ``generator`` is a default one (``RngState`` restores those already)."""
    if generator is torch.default_generator:
        return True
    module = getattr(torch, generator.device.type, None)
    return generator in tuple(getattr(module, "default_generators", ()))


@dataclass
class ExplicitGenerator:
    """A ``torch.Generator`` ``f`` draws from (weakly), its state at the call's start and end."""

    generator: weakref.ref[torch.Generator]
    start: Tensor
    end: Tensor | None = None


@dataclass(frozen=True)
class Problem:
    """The function, its differentiated leaves, its inputs, its output and the options.

    Build one with :func:`build_problem`; see NOTE [the problem].

    Attributes:
        f: The user's function.
        args: The positional arguments of the call.
        kwargs: The keyword arguments, passed through to ``f``.
        diff: The differentiated leaves.
        options: The transform's options.
        batch: The per-sample structure, or ``None`` for dense rows.
        output: The output's structure.
        draw: The call's random-number states.
        want_pullback: Whether the caller also wants ``Jᵀ w`` (``aggregated_grad``): a
            backend that keeps what makes it cheap returns a pullback.
        evaluation: The probe's evaluation, when it was one the backend can use (NOTE
            [probing]); ``None`` otherwise.
        unbatched: Calls of ``f`` whose backward ``vmap`` gets wrong: vjps one at a time.
        composition: The transforms and autograd around the call (NOTE [composition]).
        mutates_leaves: Whether ``f`` writes into its leaves (``Probe.mutates_leaves``): the
            problem's leaves are then copies, and a transform must take them all as inputs
            (torch refuses writes into a tensor a transform captured).
        sparse_embeddings: Whether ``f`` asks embeddings for sparse gradients
            (``Probe.sparse_embeddings``): its evaluations get dense ones.
        probe_cached: Whether the probe came from the cache: evaluations then check that it
            still describes ``f`` (NOTE [stale probes]); they check writes after any probe
            (NOTE [writes its probe did not see]).
        differentiates: How ``f`` differentiates its own computation (``Probe.differentiates``):
            the structured backend declines (NOTE [f that differentiates itself]).
        unseen_ops: Ops ``f`` runs through code no mode sees, found where ``G`` carries a
            graph (``Probe.unseen_ops``): ``G``'s derivative is then refused (NOTE [unseen
            calls]).
        decomposed: Calls of ``f`` that its evaluations run decomposed
            (``Probe.decomposed``, NOTE [prelu as where]).
        writes: Whether the probe saw ``f`` write into any tensor (``Probe.writes``, NOTE
            [writes under a cached probe]).
        assigns_data: Whether ``f`` assigns a captured tensor's ``.data`` to itself
            (``Probe.assigns_data``, NOTE [data assigned to itself]).
        forward_tangents: ``Probe.forward_tangents``: the structured backend declines.
        signature: The call signature with the transforms around it, the probe cache's key
            (what the caches of its traces and ``vmap`` failures are keyed by too).
        unseen_writes: The writes into captured tensors that evaluations refused (NOTE
            [writes its probe did not see]): :func:`forget_probe` then has the next probe
            evaluate the whole batch.
    """

    f: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    diff: DiffLeaves
    options: Options
    batch: BatchSpec | None
    output: OutputSpec
    draw: Draw = field(compare=False, repr=False)
    want_pullback: bool = False
    evaluation: Evaluation | None = field(default=None, compare=False, repr=False)
    unbatched: tuple[str, ...] = ()
    composition: Composition = Composition()
    mutates_leaves: bool = False
    sparse_embeddings: bool = False
    probe_cached: bool = field(default=False, compare=False)
    differentiates: str | None = None
    unseen_ops: tuple[str, ...] = ()
    decomposed: tuple[str, ...] = ()
    writes: bool = True
    unseen_writes: list[str] = field(default_factory=list, compare=False, repr=False)
    assigns_data: bool = False
    forward_tangents: bool = False
    signature: Hashable | None = field(default=None, compare=False, repr=False)

    # -- the options, for short ------------------------------------------------------------

    @property
    def api(self) -> str:
        """The public API, for error messages."""
        return self.options.api

    @property
    def leaves(self) -> tuple[Tensor, ...]:
        """The differentiated leaves (detached unless the call composes: NOTE [composition])."""
        return self.diff.leaves

    @property
    def chunk_size(self) -> int | None:
        """Rows per vectorized pass (``None``: all at once; ``1``: a plain loop)."""
        return self.options.chunk_size

    @property
    def memory_budget(self) -> int | None:
        """Bytes of Jacobian a backend may hold at once (``None``: no cap)."""
        return self.options.memory_budget

    @property
    def diagonal(self) -> bool:
        """Whether only the diagonal of the Gramian is wanted."""
        return self.options.diagonal

    @property
    def per_leaf(self) -> bool:
        """Whether one block per leaf is wanted (otherwise only their sum)."""
        return self.options.per_leaf

    @property
    def has_aux(self) -> bool:
        """Whether ``f`` returns ``(output, aux)``."""
        return self.options.has_aux

    @property
    def num_rows(self) -> int:
        """``m``."""
        return self.output.num_rows

    @property
    def loops_only(self) -> bool:
        """Whether vjps must run one at a time: ``chunk_size=1``, or ``unbatched`` calls."""
        return self.chunk_size == 1 or bool(self.unbatched)

    @property
    def samples(self) -> int:
        """``B`` (1 without per-sample structure)."""
        return 1 if self.batch is None else self.batch.size

    @property
    def rows_per_sample(self) -> int:
        """``K`` rows per sample (``m`` without per-sample structure)."""
        return self.num_rows // self.samples

    @property
    def itemsize(self) -> int:
        """Bytes of the widest differentiated leaf's entries."""
        return max(leaf.element_size() for leaf in self.leaves)

    @functools.cached_property
    def compute_dtype(self) -> torch.dtype:
        """The widest of the output's and the leaves' dtypes: blocks are summed in it."""
        dtype = self.output.dtype
        for leaf in self.leaves:
            dtype = torch.promote_types(dtype, leaf.dtype)
        return dtype

    @functools.cached_property
    def sample_major_index(self) -> Tensor:
        """``[B, K]``: the output row of row ``k`` of sample ``b`` (per-sample problems).

        Shared by every problem with this output structure (never write into it), except
        inside ``torch.func`` transforms: a tensor made there belongs to their levels (torch
        2.13 wraps even ``torch.arange`` under ``grad``), and a later call under other levels
        failed torch's internal assert on the cached one ("level <= current_level ...
        escaped?", the composition property of session 25).
        """
        if self.composition.transforms:
            return self.output.sample_major_index(self.samples)
        return _sample_major_index(self.output, self.samples)

    # -- evaluation ------------------------------------------------------------------------

    def call(self, leaves: tuple[Tensor, ...], args: tuple[Any, ...] | None = None,
             kwargs: Mapping[str, Any] | None = None, *, full: bool = True,
             check_draw: bool = True) -> tuple[Any, Any]:
        """Run ``f`` with ``leaves`` in place of the parameters; return ``(output, aux)``.

        ``full``: whether this evaluates the whole batch (it then fixes the call's final
        random-number state, NOTE [one draw]); an evaluation of part of the batch that draws
        random numbers raises :class:`NotPerSample` (unless ``check_draw`` is false: a trace
        that only looks at the ops).
        """
        given = self.args if args is None else args
        keywords = self.kwargs if kwargs is None else kwargs

        def evaluate(values: tuple[Tensor, ...]) -> Any:
            return self.f(*self.diff.rebuild_args(given, values), **keywords)

        try:
            with counters_refused(self.api), derivative_faults_refused(self.api):
                result = evaluate_f(evaluate, leaves,
                                    lambda: self.draw.evaluation(full=full, check=check_draw),
                                    self._evaluation,  # NOTE [decomposed norms]
                                    DenseEmbeddingGradients if self.sparse_embeddings
                                    else contextlib.nullcontext,
                                    lambda: self._probe_check(leaves),
                                    FrozenRunningStats,  # NOTE [frozen running statistics]
                                    # NOTE [prelu as where] and the others of watched_calls
                                    lambda: watched_calls_modes(self.decomposed),
                                    RenormalisedOnce if self.mutates_leaves
                                    else contextlib.nullcontext)  # NOTE [renormalised once]
        except UnseenWrite as error:  # NOTE [writes its probe did not see]
            self.unseen_writes.append(error.write)
            raise
        out, aux = split_aux(self.api, result, self.has_aux)
        if self.probe_cached and not self.forward_tangents and carries_forward_tangents(out):
            raise OutputChanged("a forward-mode tangent its cached probe did not see: probe "
                                "afresh")  # NOTE [composition]: a tensor f captures made dual
        return out, aux

    def _evaluation(self) -> contextlib.AbstractContextManager[Any]:
        """The context of every evaluation of ``f``.

        ``Composition.evaluation``'s, or, for an ``f`` that differentiates itself, ops whose
        derivatives are right at any order (NOTE [f that differentiates itself]: the fused
        attention kernels have no double backward).
        """
        if self.differentiates is not None and not self.composition.differentiable:
            return differentiable_evaluation()
        return self.composition.evaluation()

    @functools.cached_property
    def _captured(self) -> frozenset[int]:
        """The memory of what ``f`` captured or received (the caller's tensors, not copies).

        Found before ``f`` runs where its probe saw writes, else at a first write (NOTE
        [writes under a cached probe]).
        """
        return captured_memory(self.f, (self.args, dict(self.kwargs)))

    def _protected(self) -> Callable[[], frozenset[int]]:
        """What :class:`StaleWrites` protects, found now where the probe saw ``f`` write."""
        if self.writes:
            captured = self._captured
            return lambda: captured
        return lambda: self._captured

    def _probe_check(self, leaves: Sequence[Tensor]) -> contextlib.AbstractContextManager[Any]:
        """The checks that the probe still describes ``f``.

        After any probe, writes (NOTE [writes under a cached probe], NOTE [writes its probe
        did not see]); after a cached one, with gradients, also the calls of NOTE [stale
        probes] (what they look for matters only to backward passes; a fresh probe was
        ``f``'s own).
        """
        if not self.probe_cached or not torch.is_grad_enabled():
            return StaleWrites(self._protected(), self.draw.adopt, leaves)
        return ProbeCheck(self.unbatched, self.sparse_embeddings, self.differentiates,
                          self.decomposed, self._protected(), self.draw.adopt, leaves)

    def rows(self, leaves: tuple[Tensor, ...]) -> tuple[Tensor, Any]:
        """Evaluate ``f`` on the full inputs; return its output as an ``[m]`` vector and aux."""
        out, aux = self.call(leaves)
        out_leaves, treespec = optree.tree_flatten(out)
        self.output.check(out_leaves, treespec, per_sample=False)
        return concat_rows(out_leaves, self.output.dtype), aux

    def sample_rows(self, leaves: tuple[Tensor, ...], sample_inputs: tuple[Tensor, ...], *,
                    check_draw: bool = True) -> Tensor:
        """Evaluate ``f`` on one sample (a batch of one); return that sample's ``[K]`` rows.

        ``sample_inputs`` are the batched input tensors restricted to one sample, with their
        batch dimension kept (size 1), in the order of ``self.batch.positions``.
        ``check_draw``: see :meth:`call`.
        """
        batch = self._require_batch()
        args, kwargs = replace_input_leaves(self.args, self.kwargs, batch.positions,
                                            sample_inputs)
        out, _ = self.call(leaves, args, kwargs, full=False, check_draw=check_draw)
        out_leaves, treespec = optree.tree_flatten(out)
        spec = self.output
        spec.check(out_leaves, treespec, per_sample=True)
        assert spec.batch_dims is not None
        squeezed = [leaf.squeeze(dim) for leaf, dim in zip(out_leaves, spec.batch_dims,
                                                            strict=True)]
        return concat_rows(squeezed, spec.dtype)

    def unflatten_rows(self, rows: Tensor) -> Any:
        """``[m]`` output rows (output order) back into ``f``'s output structure."""
        spec = self.output
        pieces = rows.split([math.prod(shape) for shape in spec.shapes])
        leaves = [piece.reshape(shape).to(dtype) for piece, shape, dtype
                  in zip(pieces, spec.shapes, spec.dtypes, strict=True)]
        return optree.tree_unflatten(spec.treespec, leaves)

    def _require_batch(self) -> BatchSpec:
        if self.batch is None:
            raise RuntimeError("per-sample evaluation needs batch_dim")
        return self.batch


class TensorAux:
    """Splits an aux pytree into its tensor leaves (all ``torch.func`` accepts) and the rest.

    One object per evaluation that needs it: ``split`` inside the transformed function,
    ``join`` on the transformed tensor leaves afterwards.

    Example:
        >>> parts = TensorAux()
        >>> tensors = parts.split({"loss": torch.ones(1), "tag": "x"})
        >>> parts.join(tensors)
        {'loss': tensor([1.]), 'tag': 'x'}
    """

    def __init__(self) -> None:
        self._spec: optree.PyTreeSpec | None = None
        self._constants: list[Any] = []

    def split(self, aux: Any) -> tuple[Tensor, ...]:
        """The tensor leaves of ``aux``; the rest is kept for :meth:`join`."""
        leaves, self._spec = optree.tree_flatten(aux, none_is_leaf=True)
        self._constants = [_TENSOR_SLOT if isinstance(a, Tensor) else a for a in leaves]
        return tuple(a for a in leaves if isinstance(a, Tensor))

    def join(self, tensors: tuple[Tensor, ...]) -> Any:
        """The aux pytree with ``tensors`` at its tensor leaves."""
        assert self._spec is not None
        values = iter(tensors)
        leaves = [next(values) if constant is _TENSOR_SLOT else constant
                  for constant in self._constants]
        return optree.tree_unflatten(self._spec, leaves)


@functools.lru_cache(maxsize=64)
def _sample_major_index(spec: OutputSpec, samples: int) -> Tensor:
    return spec.sample_major_index(samples)


def evaluate_f(evaluate: Callable[[tuple[Tensor, ...]], Any], leaves: tuple[Tensor, ...],
               *contexts: Callable[[], contextlib.AbstractContextManager[Any]]) -> Any:
    """``evaluate(leaves)`` inside ``contexts`` (made in order), in a vjp level if vmap refuses.

    ``torch.compile``'d code runs eagerly there (NOTE [compiled code in f] in
    ``_torch_compat.py``).

    Where ``vmap`` finds no batching rule for a fused op evaluated without autograd (NOTE
    [ops without a batching rule]), the evaluation is made again from its start, in fresh
    ``contexts``, inside a ``torch.func.vjp`` level over ``leaves``, where the op decomposes
    -- unless a mode that records the evaluation's calls is active: the error then propagates.
    """
    for through_vjp in (False, True):
        with contextlib.ExitStack() as stack:
            stack.enter_context(compiled_code_eager())  # NOTE [compiled code in f]
            stack.enter_context(evaluating())  # NOTE [gradients outside the graph]: what f's
            # own backwards accumulate is not refused
            stack.enter_context(_torch_compat.own_parametrization_cache())  # NOTE
            # [parametrization caches]
            for context in contexts:
                stack.enter_context(context())
            # NOTE [the caller's function modes]: theirs on top of every other, around f
            stack.enter_context(caller_context())
            if through_vjp:
                return _torch_compat.through_grad_level(evaluate, leaves)
            try:
                return evaluate(leaves)
            except RuntimeError as error:
                if not (leaves and _torch_compat.missing_batching_rule(error)
                        and _torch_compat.restartable_evaluation()):
                    raise
    raise AssertionError("unreachable: the second evaluation returns or raises")


def split_aux(api: str, result: Any, has_aux: bool) -> tuple[Any, Any]:
    """``(output, aux)`` of ``f``'s result (aux ``None`` without ``has_aux``)."""
    if not has_aux:
        return result, None
    if not isinstance(result, tuple | list) or len(result) != 2:
        got = (f"a {type(result).__name__} of length {len(result)}"
               if isinstance(result, tuple | list) else type(result).__name__)
        fail(api, "f to return a pair (output, aux) because has_aux=True", got,
             "Return `out, aux` from f, or drop has_aux=True.", TypeError)
    return result[0], result[1]


def concat_rows(out_leaves: list[Tensor], dtype: torch.dtype) -> Tensor:
    """Output leaves flattened row-major and concatenated, in ``dtype``."""
    if len(out_leaves) == 1:
        return out_leaves[0].reshape(-1).to(dtype)
    return torch.cat([leaf.reshape(-1).to(dtype) for leaf in out_leaves])


def replace_input_leaves(args: tuple[Any, ...], kwargs: Mapping[str, Any],
                         positions: tuple[tuple[int | str, int], ...],
                         values: tuple[Tensor, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with some leaves replaced.

    For each ``(i, j)`` of ``positions``, leaf ``j`` of argument ``i`` (a position or a
    keyword) becomes the matching entry of ``values``.
    """
    by_arg: dict[int | str, list[tuple[int, Tensor]]] = {}
    for (i, j), value in zip(positions, values, strict=True):
        by_arg.setdefault(i, []).append((j, value))
    rebuilt = list(args)
    rebuilt_kwargs = dict(kwargs)
    for i, replacements in by_arg.items():
        leaves, spec = optree.tree_flatten(args[i] if isinstance(i, int) else kwargs[i])
        for j, value in replacements:
            leaves[j] = value
        if isinstance(i, int):
            rebuilt[i] = optree.tree_unflatten(spec, leaves)
        else:
            rebuilt_kwargs[i] = optree.tree_unflatten(spec, leaves)
    return tuple(rebuilt), rebuilt_kwargs


# -- building a problem ------------------------------------------------------------------------

@dataclass(frozen=True)
class Probe:
    """What the probe of a call signature found (cached, NOTE [probing]).

    Attributes:
        spec: The output's structure.
        unbatched: Calls of ``f`` whose backward ``vmap`` gets wrong (NOTE [wrong batching
            rules] in ``_torch_compat``): backends then compute the rows' vjps one at a time.
        mutates_leaves: Whether ``f`` writes into its parameters (``F.embedding`` with
            ``max_norm`` renormalises rows in place): every call then works on copies of
            them, so the user's tensors are never changed.
        sparse_embeddings: Whether ``f`` asks embeddings for sparse gradients: every
            evaluation then gets dense ones (NOTE [sparse embedding gradients]).
        differentiates: How ``f`` differentiates its own computation (``torch.autograd.grad``,
            forward-mode AD), or ``None`` (NOTE [f that differentiates itself]).
        unseen_ops: The aten ops ``f`` ran through code no torch-function mode sees
            (TorchScript), or ``None`` where the probe did not look (NOTE [unseen calls]).
        decomposed: Calls of ``f`` that every later evaluation runs decomposed (NOTE
            [prelu as where]).
        writes: Whether ``f`` wrote into any tensor, its own included (NOTE [writes under a
            cached probe]).
        assigns_data: Whether ``f`` assigned a captured tensor's ``.data`` to itself
            (``module.to(dtype)`` in ``f``: NOTE [data assigned to itself]).
        forward_tangents: Whether ``f``'s output carried a ``torch.autograd.forward_ad``
            tangent (NOTE [composition]: a dual input, captured tensor or buffer).
    """

    spec: OutputSpec
    unbatched: tuple[str, ...] = ()
    mutates_leaves: bool = False
    sparse_embeddings: bool = False
    differentiates: str | None = None
    unseen_ops: tuple[str, ...] | None = None
    decomposed: tuple[str, ...] = ()
    writes: bool = True
    assigns_data: bool = False
    forward_tangents: bool = False


_PROBES = LruCache[Probe](maxsize=256)

_WHOLE_BATCH = LruCache[bool](maxsize=256)
"""Signatures whose next probe evaluates the whole batch (NOTE [writes its probe did not see])."""


# NOTE [probing]
# A problem is built from one evaluation of f, the probe: its output gives the OutputSpec,
# and any error in it (a non-tensor output, a batch_dim that does not index samples...) is
# reported before any Jacobian work. With batch_dim the probe evaluates one sample (a batch
# of one) without gradients, which is cheap; it runs on copies of the parameters, and if f
# writes into them (an embedding's max_norm), every call of that signature works on copies.
# Without batch_dim, it evaluates the batch; when the
# backend will evaluate the batch with plain autograd anyway (graph), the probe is that
# evaluation, with fresh leaves that require grad, and is handed to the backend
# (Problem.evaluation) so that f runs once. Probes are cached per call signature (NOTE [call
# signatures]): a cached probe means no evaluation before dispatch; every later evaluation
# checks its output against the spec, and a stale one is probed afresh (OutputChanged).
# Where an evaluation was about to write into a tensor f did not make, which the probe did
# not see, the signature's next probe evaluates the whole batch (NOTE [writes its probe did
# not see]).

def build_problem(options: Options, f: Callable[..., Any], args: tuple[Any, ...],
                  kwargs: Mapping[str, Any], *, want_pullback: bool = False,
                  probe_with_grad: bool = False, fresh: bool = False,
                  planning: bool = False, generators: tuple[Any, ...] | None = None) -> Problem:
    """Validate a call's arguments against the options and describe it as a :class:`Problem`.

    Raises the call-time errors (argnums out of range, no leaf to differentiate, bad
    ``in_dims`` or batch sizes, a bad output) before any Jacobian work.

    Args:
        options: The transform's options.
        f: The user's function.
        args: The call's positional arguments.
        kwargs: The call's keyword arguments.
        want_pullback: Whether ``Jᵀ w`` will be asked for too.
        probe_with_grad: Whether a full-batch probe should record an autograd graph for the
            backend to reuse (NOTE [probing]).
        fresh: Probe ``f`` even if a probe of this signature is cached (it was stale).
        planning: The call only plans (``tg.explain``): parameters on the meta device, which
            have shapes but no values, are accepted.
        generators: The host generators ``f`` holds, where the caller's walk found them
            (NOTE [generators f holds]); ``None``: walk from ``f`` and the arguments here.
    """
    api = options.api
    argnums = resolve_argnums(api, options.argnums, len(args))
    refuse_lazy_tensors(api, (args, kwargs))
    refuse_updated_caches(api, args, kwargs)  # NOTE [model caches]
    args, kwargs = without_inference_tensors((args, dict(kwargs)))
    refuse_forward_mode_tangents(api, [args[i] for i in argnums])  # NOTE [composition]
    composition = detect_composition(args, kwargs)
    diff = select_diff_leaves(args, argnums, detach=not composition.differentiable)
    complex_leaves = [leaf for i in argnums for leaf in leaves_of(args[i])
                      if isinstance(leaf, Tensor) and leaf.is_complex()]
    if complex_leaves:  # select_diff_leaves keeps real floating leaves: the rest would be dropped
        fail(api, f"real floating-point tensor leaves in the differentiated argument(s) "
             f"{argnums}", f"a complex tensor of shape {tuple(complex_leaves[0].shape)} "
             f"({complex_leaves[0].dtype})",
             "Pass its real and imaginary parts as real parameters: torch.view_as_real(p), "
             "and torch.view_as_complex inside f.", TypeError)
    for leaf in (leaf for leaves in diff.arg_leaves for leaf in leaves):
        if (hidden := hidden_tensor(leaf)) is not None:  # NOTE [tensors inside opaque leaves]
            fail(api, f"the differentiated argument(s) {argnums} as pytrees whose floating "
                 "tensors are their leaves (dicts, lists, tuples, namedtuples, classes "
                 "registered with optree)", f"a {type(leaf).__name__} holding a tensor of shape "
                 f"{tuple(hidden.shape)}: optree sees it as one leaf, and its tensors would be "
                 "constants", "Pass its tensors in a dict (e.g. vars(obj), "
                 "dataclasses.asdict(obj), dict(module.named_parameters())), or register its "
                 "class with optree.register_pytree_node; to keep them constant, pass the "
                 "object as another argument, outside argnums.", TypeError)
    narrow = [leaf for leaf in diff.leaves if leaf.dtype.itemsize == 1]
    if narrow:  # float8: torch promotes it with no other dtype (raw errors on every backend)
        fail(api, f"floating-point leaves of 16 bits or more in the differentiated "
             f"argument(s) {argnums}", f"a {narrow[0].dtype} tensor of shape "
             f"{tuple(narrow[0].shape)}", "Differentiate a wider copy (p.to(torch.bfloat16)) "
             "and cast it inside f, or keep the float8 tensor out of argnums.", TypeError)
    if not diff.leaves:
        fail(api, f"floating-point tensor leaves in the differentiated argument(s) {argnums}",
             "none (" + ", ".join(type(args[i]).__name__ for i in argnums) + ")",
             "Pass the parameters (a tensor or a pytree of float tensors) at argnums, "
             "or change argnums.", TypeError)
    if not planning:
        check_not_meta(api, diff.leaves, "parameters")
        inputs = ([arg for i, arg in enumerate(args) if i not in argnums], dict(kwargs))
        check_not_meta(api, optree.tree_leaves(inputs), "inputs")  # type: ignore[arg-type]
    batch = (None if options.batch_dim is None
             else make_batch_spec(api, args, argnums, options.batch_dim, options.in_dims,
                                  kwargs))
    if generators is None:  # NOTE [generators f holds]: the caller did not walk
        generators = reached(api, f, (*args, *kwargs.values())).generators
    draw = Draw.capture(_devices(args, kwargs), generators)
    key = _probe_key(f, args, kwargs, diff, options.has_aux, batch, composition)
    probe = None if fresh else _PROBES.get(key)
    look_unseen = composition.may_be_differentiated  # NOTE [unseen calls]
    if probe is not None and look_unseen and probe.unseen_ops is None:
        probe = None  # probed by a call that did not look
    probe_cached = probe is not None
    evaluation = None
    if probe is None:
        probe, evaluation = _probe(api, f, args, kwargs, diff, batch, options.has_aux, draw,
                                   with_grad=probe_with_grad and batch is None
                                   and not composition.differentiable,
                                   look_unseen=look_unseen,
                                   whole_batch=_WHOLE_BATCH.get(key) is not None)
        if not probe.forward_tangents:  # NOTE [composition]: a tangent is each call's own
            _PROBES.put(key, probe)  # (cached, it made structured decline later plain calls)
    if probe.forward_tangents and api.startswith("torchgram.distributed."):
        fail(api, "f whose output carries no torch.autograd.forward_ad tangent", "an output "
             "made dual by a tensor f captures or a buffer (the ranks exchange detached "
             "pieces, which carry no forward-mode tangent)", "Pass its primal "
             "(forward_ad.unpack_dual(t).primal); for G's derivative, torch.func.jvp around "
             "torchgram.gramian on one process.", NotImplementedError)  # NOTE [composition]
    unseen_ops = probe.unseen_ops if look_unseen and probe.unseen_ops else ()
    if unseen_ops and composition.differentiated_by_transforms:  # no backend can
        raise unseen_calls_refused(api, unseen_ops, composition.describe(), True)
    if probe.mutates_leaves:
        diff = diff.replace_leaves(tuple(leaf.clone() for leaf in diff.leaves))
    return Problem(f, args, kwargs, diff, options, batch, probe.spec, draw, want_pullback,
                   evaluation, probe.unbatched, composition, probe.mutates_leaves,
                   probe.sparse_embeddings, probe_cached, probe.differentiates,
                   unseen_ops, probe.decomposed, probe.writes,
                   assigns_data=probe.assigns_data, forward_tangents=probe.forward_tangents,
                   signature=key)


def refuse_lazy_tensors(api: str, tree: Any) -> None:
    """Refuse a lazy module's uninitialised tensor among a call's arguments.

    NOTE [lazy modules]; torch's raw "uninitialized parameter in is_inference" before.
    """
    lazy = next((leaf for leaf in leaves_of(tree) if isinstance(leaf, Tensor) and is_lazy(leaf)),
                None)
    if lazy is not None:
        fail(api, "initialised tensors among f's arguments", "an uninitialised parameter of "
             "a lazy module (nn.LazyLinear, nn.LazyConv2d, ...)", "Run the model once on a "
             "batch (model(x)) before taking its parameters, as torch's optimizers need too.")


def without_inference_tensors(tree: Any) -> Any:
    """``tree`` with the tensors made under ``torch.inference_mode`` cloned into normal ones.

    Autograd refuses inference tensors (a model built or loaded under ``inference_mode``: its
    parameters are; session 27: torch's raw "Setting requires_grad=True on inference tensor
    outside InferenceMode is not allowed" from graph, structured and auto). The clones are
    the call's own, like the detached parameters of any call; ``tree`` is returned as it is
    when it holds none. A kernel between two input sets clones once for both sides, so that
    they share the parameters (and keyword arguments) as the caller's call does.
    """
    leaves, spec = optree.tree_flatten(tree)
    if not any(isinstance(leaf, Tensor) and leaf.is_inference() for leaf in leaves):
        return tree
    with torch.inference_mode(False):
        leaves = [leaf.clone() if isinstance(leaf, Tensor) and leaf.is_inference() else leaf
                  for leaf in leaves]
    return optree.tree_unflatten(spec, leaves)


_BATCH_MAPPINGS = frozenset({"BatchEncoding", "BatchFeature"})
"""``transformers``' mappings of a batch (a tokenizer's, a feature extractor's output)."""


def _probe_key(f: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any],
               diff: DiffLeaves, has_aux: bool, batch: BatchSpec | None,
               composition: Composition) -> Hashable | None:
    """The probe cache's key: the call's signature, and the transforms around the call.

    Inside ``torch.func.vmap`` the batched arguments show the shapes of a plain call's, and
    the probe's evaluation is where an ``f`` that ``vmap`` refuses gets the torchgram error
    (``errors.f_refused_by_vmap``): before session 51, a call under ``vmap`` after a plain
    call of the same signature took the plain call's probe and gave torch's raw error (an
    ``nn.LSTM``, BERT's mask code; a helper's hunt). So each stack of transforms probes apart.
    """
    return call_signature(f, args, kwargs, diff.positions, has_aux,
                          None if batch is None else (batch.batch_dim, batch.positions,
                                                      batch.dims),
                          (composition.transforms, forward_ad_level_open()))


def forget_probe(problem: Problem) -> None:
    """Drop the cached probe of this call's signature (it was stale).

    Where the problem's evaluations met a write its probe did not see, the signature's next
    probe evaluates the whole batch (NOTE [writes its probe did not see]).
    """
    key = problem.signature
    _PROBES.pop(key)
    if problem.unseen_writes and problem.batch is not None:
        _WHOLE_BATCH.put(key, True)


def _devices(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[torch.device]:
    return [leaf.device for leaf in leaves_of((args, dict(kwargs)))
            if isinstance(leaf, Tensor) and leaf.device.type != "cpu"]


def _probe(api: str, f: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any],
           diff: DiffLeaves, batch: BatchSpec | None, has_aux: bool, draw: Draw, *,
           with_grad: bool, look_unseen: bool = False,
           whole_batch: bool = False) -> tuple[Probe, Evaluation | None]:
    """Evaluate ``f`` once (NOTE [probing]): what it found, and the evaluation to reuse.

    With ``batch`` the probe evaluates one sample; if ``f`` fails on a batch of one
    (batch-norm in training mode with one value per channel), it evaluates the whole batch
    instead, and raises what that raises: the backends' per-sample ways then fail the same
    way and use the rows of the whole batch (NOTE [per-sample]). ``look_unseen``: also note
    the ops ``f`` runs where no torch-function mode sees them (NOTE [unseen calls]).
    ``whole_batch``: evaluate the whole batch anyway (NOTE [writes its probe did not see]).
    """
    if batch is None:
        return _evaluate_probe(api, f, args, kwargs, diff, None, has_aux, draw,
                               with_grad=with_grad, look_unseen=look_unseen)
    if whole_batch:
        return _evaluate_probe(api, f, args, kwargs, diff, batch, has_aux, draw,
                               with_grad=False, whole_batch=True, look_unseen=look_unseen)
    one_args, one_kwargs = replace_input_leaves(args, kwargs, batch.positions,
                                                batch.narrow(0, 1))
    try:
        return _evaluate_probe(api, f, one_args, one_kwargs, diff, batch, has_aux, draw,
                               with_grad=False, look_unseen=look_unseen)
    except _FailsAlone:
        return _evaluate_probe(api, f, args, kwargs, diff, batch, has_aux, draw,
                               with_grad=False, whole_batch=True, look_unseen=look_unseen)


class _FailsAlone(Exception):
    """``f`` raised on a batch of one (the probe then evaluates the whole batch)."""


def _evaluate_probe(api: str, f: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: Mapping[str, Any], diff: DiffLeaves, batch: BatchSpec | None,
                    has_aux: bool, draw: Draw, *, with_grad: bool,
                    whole_batch: bool = False,
                    look_unseen: bool = False) -> tuple[Probe, Evaluation | None]:
    copies = tuple(leaf.clone() for leaf in diff.leaves)  # f may write into its parameters
    versions = [_torch_compat.version(leaf) for leaf in copies]
    memory = [memory_of(leaf) for leaf in copies]
    parameter_memory = frozenset(memory)
    leaves = tuple(leaf.requires_grad_() for leaf in copies) if with_grad else copies
    census = OpCensus()
    unseen: list[UnseenCalls] = []  # one per evaluation attempt (NOTE [unseen calls])

    def look() -> UnseenCalls:
        unseen.append(UnseenCalls())
        return unseen[-1]

    def evaluate(values: tuple[Tensor, ...]) -> Any:
        return f(*diff.rebuild_args(args, values), **kwargs)

    writes = CapturedWrites(captured_memory(f, (args, dict(kwargs)), own=leaves), draw.adopt,
                            argument_memory(f, args, kwargs, skip=diff.leaves), copies)

    def evaluate_probe() -> Any:  # the next evaluation starts from the call's state
        return evaluate_f(evaluate, leaves,
                          lambda: draw.evaluation(full=with_grad, restore_after=True),
                          _probe_attention, lambda: census,
                          lambda: writes,  # NOTE [captured writes]
                          lambda: FrozenRunningStats(parameter_memory),  # NOTE [running
                          look if look_unseen else contextlib.nullcontext)  # statistics ...]

    with torch.set_grad_enabled(with_grad):
        try:
            try:
                result = evaluate_probe()
            except Exception as error:  # NOTE [f that differentiates itself]: with respect
                # to its parameters, which need grad; NOTE [gradient hooks inside f]: on a
                if with_grad or not may_need_a_graph(error):  # tensor that requires grad
                    raise
                saw_graph_calls = census.differentiates is not None or census.needs_graph > 0
                census = OpCensus()

                def with_graph() -> Any:
                    nonlocal leaves
                    leaves = tuple(leaf.detach().requires_grad_() for leaf in copies)
                    with torch.enable_grad():
                        return evaluate_probe()

                result = again_with_graph(error, saw_graph_calls, with_graph)
        except CounterRead as error:
            raise counter_read_error(api, error) from error
        except RunningStatsDifferentiated as error:  # NOTE [running statistics differentiated]
            raise running_stats_refusal(api) from error
        except Exception as error:
            if (write_refused := captured_write_refusal(api, error)) is not None:
                raise write_refused from error  # no backend can: each evaluation changes yours
            if (refusal := forward_mode_refusal(api, error)) is not None:
                raise refusal from error  # no backend can: f itself lacks forward mode
            if (in_place := in_place_refusal(api, error)) is not None:
                raise in_place from error  # f's own backward met a tensor changed in place
            if (tied := tied_keys_refusal(api, error)) is not None:
                raise tied from error  # no backend can: each leaf is differentiated apart
            if (refusal := draws_refused_by_vmap(api, error)) is not None:
                raise refusal from error  # no backend can: f draws under the user's vmap
            if batch is None or whole_batch:
                if (refusal := f_refused_by_vmap(api, error)) is not None:
                    raise refusal from error  # f itself cannot run under the user's vmap
                if isinstance(f, torch.nn.Module):  # called as f(params, *inputs): the hint
                    _raise_module_as_f(api, f, error)
                raise
            raise _FailsAlone from error
        if census.reentrant_checkpoint:  # NOTE [reentrant checkpoints seen]
            raise reentrant_checkpoint_refused(api)
        changed = parameter_changed_unseen(leaves, diff.leaves, writes.renormalised, memory)
        if changed is not None:  # NOTE [writes no mode sees]
            unseen_write = captured_write_refusal(api, CapturedWrite(
                "write no torch function sees (Tensor.set_, a numpy view, ...)",
                f"a differentiated parameter of shape {tuple(changed.shape)}", parameter=True))
            assert unseen_write is not None
            raise unseen_write
        out, aux = split_aux(api, result, has_aux)
        mutated = any(_torch_compat.version(leaf) != before
                      for leaf, before in zip(copies, versions, strict=True))
        spec = make_output_spec(api, out, batch, whole_batch=whole_batch)
        probe = Probe(spec, tuple(census.unbatched), mutated, census.sparse_embeddings,
                      census.differentiates, tuple(unseen[-1].ops) if look_unseen else None,
                      tuple(census.decomposed), writes.wrote or mutated,
                      writes.assigned_data, carries_forward_tangents(out))
        if not with_grad or census.differentiates is not None:  # the backend evaluates f
            return probe, None  # with ops differentiable at any order (Problem._evaluation)
        rows = concat_rows(optree.tree_leaves(out), probe.spec.dtype)
        return probe, Evaluation(leaves, rows, aux, census.hooks > 0)


def _raise_module_as_f(api: str, module: torch.nn.Module, error: Exception) -> NoReturn:
    """Raise for a module passed as ``f`` whose call failed, with the hint.

    A model of its own (parameters or buffers), given the parameters as its input, or a module
    whose ``forward`` takes fewer arguments, gets a TypeError naming ``tg.functionalize``; a
    functional module (``forward(params, x)``, no state of its own) its own error, unchanged
    (a bug of its own is no misuse).
    """
    fix = "fn, params = tg.functionalize(module), then tg.gramian(fn)(params, x)"
    own_state = next(module.parameters(), None) is not None \
        or next(module.buffers(), None) is not None
    arity = isinstance(error, TypeError) and "positional argument" in str(error)
    if not (own_state or arity):
        raise error
    raise TypeError(message(
        api, "f(params, *inputs), a function of the parameters",
        f"the module {type(module).__name__}"
        + (" (parameters or buffers of its own)" if own_state else "")
        + f", whose call raised {type(error).__name__}: {str(error).splitlines()[0][:100]}",
        f"Make it one: {fix}.")) from error


def _probe_attention() -> contextlib.AbstractContextManager[Any]:
    """Attention's math kernel for a probe under ``torch.func.jvp`` or ``jacfwd``.

    There the probe's forward carries the outer level's tangents, and the fused
    ``scaled_dot_product_attention`` kernels have no forward-mode derivative (torch's raw
    ``NotImplementedError`` from every backend, on every ``transformers`` model with
    ``attn_implementation="sdpa"``: session 30's compose hunt). The backends' own evaluations
    already run the math kernel under transforms (NOTE [composition]); it computes the same
    function.
    """
    if "jvp" in _torch_compat.functorch_transforms():
        return math_attention()
    return contextlib.nullcontext()


def make_output_spec(api: str, out: Any, batch: BatchSpec | None, *,
                     whole_batch: bool = False) -> OutputSpec:
    """Validate ``f``'s output (one sample with ``batch``) and describe it for the batch.

    ``whole_batch``: ``out`` is the output of the whole batch (``f`` fails on one sample).
    """
    out_leaves, treespec = optree.tree_flatten(out)
    if not out_leaves:
        fail(api, "f to return a floating tensor or a pytree of them",
             f"an empty pytree {out!r:.80}", "Return the losses or outputs to differentiate.",
             TypeError)
    for leaf in out_leaves:
        if not isinstance(leaf, Tensor):
            fail(api, "f to return a floating tensor or a pytree of them",
                 f"a leaf of type {type(leaf).__name__}",
                 "Return the output's tensors: e.g. out.logits, or out.to_tuple(), of a "
                 "transformers ModelOutput" if hasattr(leaf, "to_tuple") else
                 "Return torch tensors (wrap Python numbers with torch.as_tensor).", TypeError)
        if leaf.is_complex():
            fail(api, "real floating outputs", f"dtype {leaf.dtype}",
                 "The Gramian of a complex function is not defined here: return "
                 "torch.view_as_real(out) to treat real and imaginary parts as rows.",
                 TypeError)
        if not leaf.is_floating_point():
            fail(api, "floating outputs", f"dtype {leaf.dtype}",
                 "Integer and boolean outputs have no derivative: return a floating "
                 "tensor (e.g. the loss before argmax).", TypeError)
    dtypes = tuple(leaf.dtype for leaf in out_leaves)
    dtype = dtypes[0]
    for other in dtypes[1:]:
        dtype = torch.promote_types(dtype, other)
    shapes = tuple(leaf.shape for leaf in out_leaves)
    batch_dims = None
    if batch is not None:
        batch_dims = tuple(_output_batch_dim(api, shape, batch, 1 if not whole_batch
                                             else batch.size) for shape in shapes)
        shapes = tuple(torch.Size((*shape[:dim], batch.size, *shape[dim + 1:]))
                       for shape, dim in zip(shapes, batch_dims, strict=True))
    return OutputSpec(treespec, shapes, dtypes, dtype, out_leaves[0].device, batch_dims)


def _output_batch_dim(api: str, shape: torch.Size, batch: BatchSpec, samples: int = 1) -> int:
    """The output dim indexing samples, checked on the output of ``samples`` samples."""
    ndim = len(shape)
    if not -ndim <= batch.batch_dim < ndim:
        fail(api, f"batch_dim within [-{ndim}, {ndim}) for an output of {ndim} dimension(s)",
             f"batch_dim={batch.batch_dim} (output shape of one sample {tuple(shape)})",
             "batch_dim names the output dimension that indexes samples.")
    dim = batch.batch_dim % ndim
    if shape[dim] != samples:
        fail(api, f"output dim {dim} (batch_dim) to have size 1 for one sample (a batch of one) "
             f"-- for the whole batch, output dim {dim} (batch_dim) to have size {batch.size} --",
             f"an output of shape {tuple(shape)} for "
             + ("one sample" if samples == 1 else f"the batch of {samples}"),
             ("Check vmap_axes (in_axes, out_axes; keyword arguments are shared unless "
              "kwargs_axes names them, e.g. vmap_axes=(0, 0, {'mask': 0}))"
              if api.startswith("torchgram.ntk") else "Check batch_dim and in_dims")
             + ": each output entry along the batch dim must depend on the matching sample "
             "of the batched inputs only. Batch-sized tensors that f reads from a closure or "
             "a global (targets, masks) are not split with the batch: pass them to f as "
             "arguments.")
    return dim


# NOTE [in_dims]
# in_dims says where the samples are in every non-differentiated argument, positional or
# keyword, like torch.func.vmap's in_dims (and like JAX's vmap for keywords):
# * an int (or None): every non-differentiated positional argument and every keyword
#   argument has its samples along that dimension (None: shared by all samples);
# * a tuple: one int or None per non-differentiated positional argument, optionally followed
#   by a dict {keyword: int or None}; keywords it does not name have their samples along
#   dim 0 (a keyword tensor is never silently left whole: each sample sees its own slice).
# Every tensor leaf of a batched argument is batched along the same dimension; non-tensor
# leaves (strings, flags, Python numbers) are passed as they are.

# NOTE [sparse inputs]
# A batched input is split per sample (narrow, vmap's in_dims), which torch cannot do for a
# sparse (COO, CSR) tensor: every backend raised torch's raw error from the probe's narrow or
# its vmap (session 35's sweep). It is refused before any evaluation, naming the dense input
# (f sees the same values) and the unbatched call. An input that is not split may be sparse:
# the backends that cannot run on it decline (errors.torch_refusals), and auto moves on.


def make_batch_spec(api: str, args: tuple[Any, ...], argnums: tuple[int, ...], batch_dim: int,
                    in_dims: InDims, kwargs: Mapping[str, Any] | None = None, *,
                    allow_empty: bool = False) -> BatchSpec:
    """Find the batched input tensors from ``in_dims`` and check their batch sizes agree.

    ``allow_empty``: accept a batch of size 0 (a process of ``torchgram.distributed`` may
    have no samples).
    """
    kwargs = kwargs or {}
    input_positions = [i for i in range(len(args)) if i not in argnums]
    keyword_dims: dict[str, int | None] = {}
    if isinstance(in_dims, tuple | list):
        entries = list(in_dims)
        last = entries[-1] if entries else None
        if isinstance(last, dict):
            keyword_dims = dict(last)
            entries.pop()
        if len(entries) != len(input_positions):
            fail(api, f"in_dims with one entry per non-differentiated positional argument "
                 f"({len(input_positions)} here: positions {input_positions})",
                 f"in_dims={tuple(in_dims)!r} with {len(entries)} positional entries",
                 "Give an int (batched) or None (shared) for each input, or a single int.")
        per_input: list[Any] = entries
        keyword_default: int | None = 0
    else:
        per_input = [in_dims] * len(input_positions)
        keyword_default = in_dims
    unknown = sorted(set(keyword_dims) - set(kwargs))
    if unknown:
        fail(api, f"in_dims to name keyword arguments of the call ({sorted(kwargs)})",
             f"in_dims for {unknown}", "Name only keywords the call passes.")
    arguments: list[tuple[int | str, Any, Any]] = [
        (i, args[i], dim) for i, dim in zip(input_positions, per_input, strict=True)]
    arguments += [(name, value, keyword_dims.get(name, keyword_default))
                  for name, value in kwargs.items()]
    positions: list[tuple[int | str, int]] = []
    dims, tensors = [], []
    opaque: list[tuple[int | str, Any, Tensor, int]] = []  # in mappings optree keeps whole
    others: list[tuple[int | str, Any]] = []  # other non-tensor leaves (objects, constants)
    for where, value, dim in arguments:
        if dim is None:
            continue
        for j, leaf in enumerate(optree.tree_leaves(value)):
            if isinstance(leaf, Mapping):  # a tokenizer's BatchEncoding: not a pytree
                opaque.extend((where, leaf, item, dim) for item in leaf.values()
                              if isinstance(item, Tensor) and -item.dim() <= dim < item.dim())
            if not isinstance(leaf, Tensor):
                if not isinstance(leaf, Mapping):  # looked into only where no tensor is batched
                    others.append((where, leaf))
                continue
            if leaf.dim() == 0 or not -leaf.dim() <= dim < leaf.dim():
                name = f"argument {where}" if isinstance(where, int) else f"keyword {where!r}"
                entry = (f"in_dims entry {dim}" if isinstance(where, int) or where in keyword_dims
                         else f"the keyword default in_dims {dim}")
                fail(api, f"{entry} to be a valid dimension of every tensor in {name}",
                     f"a tensor of shape {tuple(leaf.shape)}",
                     f"Set {name}'s in_dims entry to None if it is shared by all samples"
                     + ("" if isinstance(where, int) else
                        f", e.g. in_dims=(..., {{{where!r}: None}})") + ".")
            if leaf.layout != torch.strided:  # NOTE [sparse inputs]
                name = f"argument {where}" if isinstance(where, int) else f"keyword {where!r}"
                fail(api, "batched inputs in the strided (dense) layout (they are split "
                     "per sample, which torch cannot do for sparse tensors)",
                     f"a {leaf.layout} tensor of shape {tuple(leaf.shape)} in {name}",
                     "Pass it dense (x.to_dense(): f sees the same values; torch.sparse.mm "
                     "takes dense operands too), or unbatched (batch_dim=None; for kernels, "
                     "vmap_axes=None), where backend='graph' takes sparse inputs.", TypeError)
            positions.append((where, j))
            dims.append(dim % leaf.dim())
            tensors.append(leaf)
    sizes = {tensor.shape[dim] for tensor, dim in zip(tensors, dims, strict=True)}
    unsplit = next(((where, mapping, item) for where, mapping, item, dim in opaque
                    if not tensors or (type(mapping).__name__ in _BATCH_MAPPINGS
                                       and item.shape[dim] in sizes)), None)
    if unsplit is not None:
        where, mapping, item = unsplit
        name = f"argument {where}" if isinstance(where, int) else f"keyword {where!r}"
        fail(api, "batched inputs in tensors, dicts, lists or tuples (the pytrees whose "
             "tensors torchgram splits per sample)", f"a {type(mapping).__name__} in {name} "
             f"holding a tensor of shape {tuple(item.shape)}: a mapping optree does not look "
             f"into, whose tensors would not be split", "Pass a plain dict of it "
             "(dict(batch)) instead.")
    holder = next(((where, leaf, held) for where, leaf in others
                   if (held := hidden_tensor(leaf)) is not None), None) if not tensors else None
    if holder is not None:  # NOTE [tensors inside opaque leaves]: a dataclass optree keeps whole
        where, leaf, held = holder
        name = f"argument {where}" if isinstance(where, int) else f"keyword {where!r}"
        fail(api, "batched inputs in tensors, dicts, lists or tuples (the pytrees whose "
             "tensors torchgram splits per sample)", f"a {type(leaf).__name__} in {name} "
             f"holding a tensor of shape {tuple(held.shape)}: optree sees it as one leaf, "
             "whose tensors would not be split", "Pass its tensors in a dict (e.g. "
             "vars(obj), dataclasses.asdict(obj)), or register its class with "
             "optree.register_pytree_node.")
    if not tensors:
        fail(api, "at least one batched input tensor when batch_dim is given",
             f"in_dims={in_dims!r} selecting no tensor among the inputs",
             "Pass the batch as a positional argument with in_dims pointing at its sample "
             "dimension, or drop batch_dim.")
    if len(sizes) != 1:
        described = ", ".join(
            f"{'arg' if isinstance(i, int) else 'keyword'} {i!r} leaf {j}: {tuple(t.shape)} "
            f"at dim {d}" for (i, j), t, d in zip(positions, tensors, dims, strict=True))
        fail(api, "all batched inputs to have the same batch size",
             f"different sizes {sorted(sizes)} ({described})",
             "Fix in_dims (None for shared inputs) or the inputs' shapes.")
    size = sizes.pop()
    if size == 0 and not allow_empty:
        fail(api, "a non-empty batch", "batch size 0", "Pass at least one sample.")
    return BatchSpec(batch_dim, size, tuple(positions), tuple(dims), tuple(tensors))
