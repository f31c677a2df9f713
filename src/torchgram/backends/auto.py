"""``backend="auto"``: pick a backend from the problem's shapes, without trial runs.

# NOTE [auto cost model]
``auto`` traces ``f`` the way the structured backend does (one sample with ``batch_dim``,
cached per function and call signature; the whole batch without), plans every leaf
(NOTE [structured cost model]) and estimates, in multiply-adds, with ``F`` the forward's
multiply-adds on the whole batch (recognised ops exactly, other ops roughly), ``m = B·R``
rows, ``D`` backward directions (``R`` rows per sample with ``batch_dim``, ``m`` without)
and ``P`` parameters::

    structured:  F·(1 + D) + Σ_l cost_l (+ 0.1·F with a vmap pass) + fixed costs
    jacobian:    (F·(1 + 2·D) + 4·m·P + Gram) · blocks (+ (0.3·F + c·calls) per-sample)
                 + fixed costs,   Gram = m²·P (m·P diagonal)
    ntvp:        F·(1 + 2·D) + 2·F·m (+ c·calls per-sample) + fixed costs
                 (jacobian's path if diagonal)

Where ``f`` calls what ``vmap`` cannot batch (fused RNN kernels, seen by the trace), every
per-sample ``vmap`` pass over ``f`` loops over the samples instead: the jacobian and ntvp
backends, and the structured one when a leaf needs the fallback, then add
``B · calls · 3 · LOOP_PER_CALL`` (``calls`` torch calls per evaluation of ``f``, each
dispatched once per sample in the forward, the backward and the vjp set-up). The trace sees
what ``vmap`` cannot batch: fused RNN kernels, and reads of the batch's values into Python
(NOTE [reads of the batch's values]: ``transformers``' mask code); a failure it did not see is
remembered per call signature and counted the same way (NOTE [vmap failures remembered]).
Per sample, each call of ``f`` also costs ``c = PER_SAMPLE_PER_CALL`` in the jacobian and
ntvp backends, whose ``vmap`` over the samples dispatches it through two transforms (about
0.2 ms a call on a CPU: small real models took 2-3 times the structured backend's time
there, which ``auto`` picked for them before session 64).

A structured backward only reaches the activations (``F``), the jacobian and ntvp ones also
every weight gradient (``2F``); ``4·m·P`` is writing the per-row gradients, ``blocks`` the
number of leaf groups ``memory_budget`` forces on the jacobian backend (each reruns the
passes). Memory: structured holds its materialized / fallback Jacobians and ghost factors,
jacobian ``m·P`` (or the budget), ntvp ``c·P`` for ``c`` rows per chunk. With a
``memory_budget`` a backend that cannot stay under it is only chosen if none can. The
cheapest estimate wins. The fixed costs (Python and dispatch per call) are calibrated on a
CPU so that tiny problems (small ``P·m``) go to ``jacobian`` when their rows are not per
sample; ntvp wins where ``m·P`` does not fit the budget but a chunk of vjps does (huge ``P``,
few rows).

Inside ``torch.func`` transforms (NOTE [composition]) nothing is traced or estimated: the
candidates are the backends that compose, ``jacobian`` then ``ntvp``. With eager inputs that
require grad every backend can build a differentiable ``G``, and the plan is made as usual.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from torchgram._core import _torch_compat
from torchgram._core._torch_compat import old_style_functions
from torchgram._core.composition import COMPOSING_BACKENDS, require_no_forward_tangents
from torchgram._core.errors import (
    BackendCannotRun,
    DifferentiatesItself,
    NotPerSample,
    ParameterConverted,
    parameter_converted_refused,
    self_differentiation_refused,
    sparse_refusal,
    torch_refusals,
)
from torchgram._core.problem import Problem
from torchgram._core.result import BackendResult
from torchgram._core.vmap_failures import known_failure
from torchgram.backends._draws_under_transforms import REFUSING_BACKENDS
from torchgram.backends._embedding import collected_conventions
from torchgram.backends._registry import get_backend, register
from torchgram.backends._vmap_or_loop import VmapFailed, first_that_runs_ranked_again
from torchgram.backends.structured import StructuredPlan, plan_problem, run_structured
from torchgram.backends.structured.cost import held_memory
from torchgram.backends.structured.passes import Forward, cached_trace, dense_forward, keep_trace
from torchgram.backends.structured.per_sample import refused_per_sample

STRUCTURED_FIXED = 2.5e7
"""Fixed cost of a structured call (the tapping mode, planning), in multiply-adds."""
STRUCTURED_PER_USE = 5e5
"""Per tapped use (factor extraction and contraction dispatch)."""
STRUCTURED_VMAP = 1e7
"""Extra fixed cost of the per-sample ``vmap`` pass (when some leaf needs the fallback)."""
VMAP_OVERHEAD = {"structured": 0.1, "jacobian": 0.3}
"""Extra cost of a per-sample ``vmap`` pass, as a fraction of ``F`` (the jacobian backend's
``vmap(jacrev)`` also runs fused attention once per sample)."""
JACOBIAN_FIXED = {"dense": 2e7, "per_sample": 3.5e7}
"""Fixed cost of a jacobian call (``vmap``/``jacrev`` set-up)."""
NTVP_FIXED = 5e7
"""Fixed cost of an ntvp call (forward-mode set-up)."""
PER_SAMPLE_PER_CALL = 2.5e6
"""Cost of one torch call of ``f`` in the jacobian backend's per-sample ``vmap(jacrev)`` and
ntvp's per-sample pushes: its forward and backward dispatched through two ``torch.func``
transforms, about 0.15-0.27 ms a call measured on a CPU (ViT, ResNet-18, MobileNet, Swin and
MLPs at small sizes, where the jacobian backend took 2-3 times the structured one's time)."""
GRAPH_OVER_STRUCTURED = 2.0
"""The graph walk's time over the structured pass's without its per-sample part (NOTE [the
graph walk against loops])."""
LOOP_PER_CALL = 1.5e5
"""Cost of one torch call of ``f`` evaluated for one sample in a loop (dispatch, autograd),
in multiply-adds (about 10 µs on a CPU)."""
WRITE_COST = 4.0
"""Cost of writing one per-row gradient entry, relative to one multiply-add."""


@dataclass(frozen=True)
class Estimate:
    """A backend's estimated cost on a problem.

    Attributes:
        backend: Its name.
        time: Estimated multiply-adds (NOTE [auto cost model]).
        memory: Estimated bytes it holds beyond ``f``'s own activations.
        fits: Whether it stays under ``memory_budget`` (always ``True`` without one).
    """

    backend: str
    time: float
    memory: float
    fits: bool


def estimate_backends(problem: Problem, plan: StructuredPlan) -> dict[str, Estimate]:
    """The estimates of every candidate backend that is registered (NOTE [auto cost model])."""
    sizes = plan.sizes
    samples, rows = sizes.samples, sizes.rows
    m = samples * rows
    per_sample = problem.batch is not None and not plan.dense
    directions = rows if per_sample else m
    numel = sum(leaf.numel() for leaf in problem.leaves)
    forward = max(plan.forward_flops, float(numel * samples))
    budget = problem.memory_budget
    itemsize = sizes.itemsize
    gram = m * numel * (1 if sizes.diagonal else m)
    estimates = {}

    uses = sum(len(p.uses) for p in plan.leaves)
    vmap = per_sample and (plan.recording.not_batched  # NOTE [runs that cannot be batched]
                           or any(p.way == "fallback" for p in plan.leaves))
    recording = plan.recording
    loop = (3 * samples * recording.calls * LOOP_PER_CALL
            if per_sample and recording.unbatchable else 0.0)
    # NOTE [vmap failures remembered]: where a backend's vmap failed on this call signature,
    # its per-sample passes loop over the samples, its rows of the batch over the rows
    looped = 3 * samples * recording.calls * LOOP_PER_CALL if per_sample \
        else m * recording.calls * LOOP_PER_CALL
    loops = {name: looped if known_failure(problem, name) is not None else loop
             for name in ("jacobian", "ntvp")}
    transformed_calls = PER_SAMPLE_PER_CALL * recording.calls if per_sample else 0.0
    structured_loop = looped if per_sample and known_failure(problem, "structured") else loop
    vmap_extra = (STRUCTURED_VMAP + VMAP_OVERHEAD["structured"] * forward + structured_loop
                  + transformed_calls if vmap else 0.0)
    structured_time = (forward * (1 + directions) + plan.contraction_cost + STRUCTURED_FIXED
                       + STRUCTURED_PER_USE * uses + vmap_extra)
    structured_memory = sum(p.memory if problem.want_pullback else held_memory(p, sizes)
                            for p in plan.leaves)
    estimates["structured"] = Estimate("structured", structured_time, structured_memory,
                                       budget is None or structured_memory <= budget)

    jacobian_memory = float(m * numel * itemsize)
    blocks = 1 if budget is None or sizes.diagonal else max(1, math.ceil(jacobian_memory / budget))
    one_pass = forward * (1 + 2 * directions) + WRITE_COST * m * numel
    if per_sample:
        one_pass += VMAP_OVERHEAD["jacobian"] * forward
    jacobian_time = (one_pass + gram) * blocks + \
        JACOBIAN_FIXED["per_sample" if per_sample else "dense"] + \
        (loops["jacobian"] + transformed_calls) * blocks
    estimates["jacobian"] = Estimate("jacobian", jacobian_time,
                                     min(jacobian_memory, budget or jacobian_memory), True)

    if sizes.diagonal:
        ntvp = estimates["jacobian"]
    else:
        chunk = problem.chunk_size or m
        if budget is not None and problem.chunk_size is None:
            chunk = max(1, budget // max(1, numel * itemsize))
        chunk = min(chunk, m)
        ntvp_memory = float(chunk * numel * itemsize)
        ntvp_time = forward * (1 + 2 * directions) + 2 * forward * m + NTVP_FIXED + \
            loops["ntvp"] + transformed_calls
        ntvp = Estimate("ntvp", ntvp_time, ntvp_memory, budget is None or ntvp_memory <= budget)
    estimates["ntvp"] = Estimate("ntvp", ntvp.time, ntvp.memory, ntvp.fits)
    if vmap and budget is None:  # NOTE [the graph walk against loops]
        walk = max(GRAPH_OVER_STRUCTURED * (structured_time - vmap_extra),
                   forward * (1 + m))  # every row through the batch's backward
        estimates[LAST_RESORT] = Estimate(LAST_RESORT, walk, structured_memory, True)
    return estimates


# NOTE [the graph walk against loops]
# The graph walk is not estimated: it is the last resort (LAST_RESORT). But where the
# structured pass goes per sample -- a leaf no rule covers (Mixtral's router, Gemma, Mamba,
# ConvBERT, DeBERTa-v2, FNet, BEiT), or a run that cannot be batched (T5's relative position
# bias meets the mask in `where`, Nyströmformer's in `add_`: NOTE [runs that cannot be
# batched]) -- its per-sample pass dispatches every call of f through vmap
# (PER_SAMPLE_PER_CALL), or loops over the samples where f reads the batch's values; the walk,
# one forward and no per-sample pass, took 1.4-3.5 times less time there (session 64, the
# tests/models zoo: T5 30 ms against 71-107 ms, ConvBERT 17-18 against 44-53, FNet 8-9
# against 13-18). There it is estimated at GRAPH_OVER_STRUCTURED times the structured pass
# without its per-sample part: the walk took 1.3-2.2 times the structured pass on models
# without one (BERT, GPT-2, ViT, Swin, at small and medium sizes) -- and at least F·(1 + m):
# the walk carries every one of the m rows through the batch's backward, so its time grows
# as B² where the structured pass's grows as B (the second review of session 64: with 2x
# alone it took the walk for BERT, GPT-2, LLaMA at B = 32-64 with a leaf no rule covers,
# 1.8-5.3 times slower than the structured pass, and for a deep MLP at B = 128, 5.4 times).
# Without a memory budget only (its memory is not modelled).


def ranked(estimates: dict[str, Estimate]) -> tuple[str, ...]:
    """Candidates cheapest first: those that fit the memory budget, then the others."""
    by_time = sorted(estimates.values(), key=lambda e: e.time)
    return tuple(e.backend for e in by_time if e.fits) + \
        tuple(e.backend for e in by_time if not e.fits)


def with_last_resort(order: tuple[str, ...]) -> tuple[str, ...]:
    """``order``, then :data:`LAST_RESORT` unless it is in it (it was estimated)."""
    return order if LAST_RESORT in order else (*order, LAST_RESORT)


def pick(estimates: dict[str, Estimate]) -> str:
    """The cheapest backend among those that fit the memory budget (or all, if none fits)."""
    return ranked(estimates)[0]


LAST_RESORT = "graph"
"""Tried after every estimated candidate declared it cannot run: it walks the autograd
graph of one plain forward, which every differentiable function has."""


@dataclass(frozen=True)
class AutoPlan:
    """What ``auto`` decided for a problem, kept for the run.

    Attributes:
        structured: The structured backend's plan (its trace is what the estimates use).
        estimates: Every candidate's estimate.
        order: The candidates in the order they are tried (NOTE [declared inability]).
        forward: For dense rows planned from a fresh trace (no ``batch_dim``, or samples
            that interact), the structured backend's tapped forward, which the run reuses
            instead of running ``f`` again.
    """

    structured: StructuredPlan
    estimates: dict[str, Estimate]
    order: tuple[str, ...]
    forward: Forward | None = None

    @property
    def choice(self) -> str:
        """The backend tried first."""
        return self.order[0]


def plan_auto(problem: Problem) -> AutoPlan:
    """Trace ``f`` (or reuse its cached trace), plan the structured way, rank the backends.

    Raises :class:`BackendCannotRun` (naming the backends that can) where the structured
    backend cannot trace ``f``: ``f`` differentiates itself (NOTE [f that differentiates
    itself]), calls torchgram, or uses sparse tensors; its output carries forward-mode tangents.
    """
    if problem.differentiates is not None:
        raise self_differentiation_refused(problem.api, "structured", problem.differentiates)
    require_no_forward_tangents(problem, "structured")  # NOTE [composition]
    try:
        return _plan_auto(problem)
    except ParameterConverted as error:  # module.to(dtype) in a forward
        raise parameter_converted_refused(problem.api, error) from error


def _plan_auto(problem: Problem) -> AutoPlan:
    forward = None
    if problem.batch is None and cached_trace(problem) is None:
        with torch.enable_grad():  # the tapped forward the structured backend would run
            forward = _dense_forward(problem)
        keep_trace(problem, forward.recording)
        structured = plan_problem(problem, forward.recording)
    else:
        try:
            structured = plan_problem(problem)
            # samples that interact, or a random f with a leaf that needs the per-sample
            # fallback (NOTE [per-sample]): the rows of the whole batch, planned from the
            # tapped forward the structured backend then reuses
            recording = structured.recording
            dense = problem.batch is not None and (
                bool(recording.coupling) or (recording.draws and bool(recording.unrecognised))
                or refused_per_sample(recording) is not None)
        except NotPerSample:  # f fails on a batch of one: plan the whole batch's rows
            dense = True
        if dense:  # NOTE [dense rows planned once]
            kept = cached_trace(problem, dense=True)
            if kept is None:
                with torch.enable_grad():
                    forward = _dense_forward(problem)
                kept = forward.recording
                keep_trace(problem, kept, dense=True)
            structured = plan_problem(problem, kept, dense=True)
    estimates = estimate_backends(problem, structured)
    return AutoPlan(structured, estimates, _ordered(problem, structured, estimates), forward)


def _ordered(problem: Problem, structured: StructuredPlan,
             estimates: dict[str, Estimate]) -> tuple[str, ...]:
    """The candidates in the order ``auto`` tries them: cheapest first, refusing ones last."""
    order = with_last_resort(ranked(estimates))
    refusing: tuple[str, ...] = ()
    if problem.draw.random or structured.recording.draws:  # NOTE [draws under torch.func]
        refusing = REFUSING_BACKENDS
    if structured.recording.transform_refusals:  # NOTE [old-style autograd.Functions]
        # the graph walk runs no hook and declines them (NOTE [module backward hooks]); the
        # structured pass takes the rows of the whole batch where its per-sample way would
        # run f under the transforms (NOTE [refused per-sample passes])
        hooks = _torch_compat.MODULE_HOOKS in structured.recording.transform_refusals
        refusing = (*REFUSING_BACKENDS, *((LAST_RESORT,) if hooks else ()))
    if structured.recording.gradient_hooks:  # NOTE [gradient hooks inside f]
        refusing = (*refusing, "ntvp", LAST_RESORT)
    recording = structured.recording
    if recording.hooked_leaf is not None or (recording.hooked_tap is not None
                                             and not _streams(problem)):
        refusing = (*refusing, "structured")  # NOTE [hooks on taps]: it would refuse
    return (*(n for n in order if n not in refusing), *(n for n in order if n in refusing))


# NOTE [dense rows planned once]
# Where the samples interact (batch norm in train mode), f fails on a batch of one (batch
# norm in train mode again: its one-sample trace raised), f draws with a leaf on the
# per-sample fallback, or the per-sample way would meet a transform refusal, the plan is
# that of the rows of the whole batch, made from a tapped forward of the whole batch. That
# forward ran on every call, with the one-sample trace before it where that failed, both
# wasted when another backend came first: ResNet-18 in train mode (the tests/models zoo,
# B = 3) took 8.8 ms under auto, which chose jacobian (6.2 ms alone; the structured pass 6.1),
# session 65. The whole batch's recording is now kept per call signature, as the trace
# without batch_dim is (keep_trace): later calls plan from it without that forward, and the
# structured pass, if it comes first, runs its own (reused where this call made one).
# Whether the rows are the whole batch's is still decided on every call, from the one-sample
# trace (cached where it ran; where it failed, traced again, which stops at the failing
# call): keeping that decision too made a model switched from train() to eval() plan the
# whole batch's rows for good (the review: an MLP with batch norm at B = 128, 451 ms against
# 7.6; B = 32, 13.8 against 2.9). The kept recording only feeds the estimates (the
# structured pass plans from its own run), so a stale one misleads the choice, never the
# result.


def _streams(problem: Problem) -> bool:
    """Whether the structured pass would be one streamed backward (NOTE [streamed taps]).

    As ``can_stream`` decides from the run (which may still not stream: a graph that does not
    end at the forward's own leaves); here from the problem alone.
    """
    return (problem.batch is not None and problem.rows_per_sample == 1
            and not problem.want_pullback and not problem.composition.create_graph)


def _dense_forward(problem: Problem) -> Forward:
    """The structured backend's dense forward, with the old-style Functions of its graph."""
    forward = dense_forward(problem, fuse=False)  # a plan: NOTE [fused recurrences]
    forward.recording.transform_refusals += old_style_functions(forward.outputs[0])
    return forward


def choose_backend(problem: Problem) -> str:
    """The backend ``auto`` tries first for ``problem`` (``structured``, ``jacobian``, ...).

    Example:
        >>> import torch
        >>> from torchgram._core.options import Options
        >>> from torchgram._core.problem import build_problem
        >>> def f(w, x):
        ...     return torch.tanh(x @ w).sum(-1)
        >>> args = (torch.randn(3, 2), torch.randn(4, 3))
        >>> problem = build_problem(Options.validate("doc", f), f, args, {})
        >>> choose_backend(problem)  # six parameters, four rows: plain Jacobian rows
        'jacobian'
    """
    return plan_auto(problem).choice


@register("auto")
def auto_backend(problem: Problem) -> BackendResult:
    """Run the backends of :func:`plan_auto`'s order until one can (reusing the plan)."""
    if problem.composition.transforms:  # NOTE [composition]: no trace under torch.func
        return _first_that_runs(problem, COMPOSING_BACKENDS, None)
    with collected_conventions():  # over the planning too (NOTE [embedding conventions])
        try:
            try:
                plan = plan_auto(problem)
            except RuntimeError as error:  # NOTE [sparse tensors in f]: the trace met one
                if isinstance(error, DifferentiatesItself):  # one the probe did not see
                    raise self_differentiation_refused(problem.api, "structured",
                                                       error.how) from error
                if not _torch_compat.is_sparse_gradient_error(error):
                    raise
                raise sparse_refusal(problem.api, "structured", problem.diff.leaves) from error
        except BackendCannotRun as error:  # the trace met a nested torchgram call, a sparse
            # tensor (NOTE [sparse tensors in f]) or f differentiating itself: the backends
            # without a trace
            order = error.alternatives or ("jacobian", "graph")
            return _first_that_runs(problem, order, None, [(error.backend, error.reason)])
        return _first_that_runs(problem, plan.order, plan)


def _first_that_runs(problem: Problem, order: tuple[str, ...], plan: AutoPlan | None,
                     attempts: list[tuple[str, str]] | None = None) -> BackendResult:
    def run(name: str) -> BackendResult:
        if name == "structured" and plan is not None:
            with torch_refusals(problem.api, name, problem.diff.leaves):  # NOTE [old-style ...]
                return run_structured(problem, plan.structured, forward=plan.forward)
        return get_backend(name)(problem)

    attempts = [] if attempts is None else attempts

    def ranked_again(failures: list[VmapFailed]) -> tuple[str, ...]:
        if not failures or plan is None:
            again = order
        else:  # the failures' loops are in the estimates now
            again = _ordered(problem, plan.structured,
                             estimate_backends(problem, plan.structured))
        declined = {name for name, _ in attempts}
        return tuple(name for name in again if name not in declined)

    return first_that_runs_ranked_again(ranked_again, run, attempts)
