"""The structured backend's per-sample forward, checked (NOTE [per-sample]).

Three ways, each with its check (NOTE [structured passes] for the ways themselves):

* **batched** (every leaf covered by a rule): ``f`` on the whole batch, taps read per
  sample. Checked: no call makes samples interact (the run's ``coupling``), and, unless
  ``f`` draws random numbers, the first and last samples run apart from the others give the
  batch's outputs (as a batch of their own, one evaluation, when the batch has more than
  two samples; each alone otherwise) -- with the derivative check, and on calls that
  rewrote a call the trace does not settle (NOTE [when the values are compared]).
* **vmap**, or a **loop** where ``vmap`` cannot batch ``f`` (leaves on the fallback):
  ``f`` one sample at a time. Checked like the jacobian backend's per-sample way: one
  evaluation of the whole batch first (no random draw, no interacting call), then every
  sample's outputs against it; a sample that fails alone where the batch ran, or draws
  random numbers, ends it.

Any check that fails raises :class:`NotPerSample`; the backend then contracts the rows of
the whole batch (the exact coupled Gramian when samples interact).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from torchgram._core import _torch_compat
from torchgram._core.errors import (
    BackendCannotRun,
    DifferentiatedTwice,
    NotPerSample,
    OutputChanged,
)
from torchgram._core.per_sample import (
    batch_rows,
    check_samples,
    even_odd,
    fails_alone,
    separating_groups,
    subset_rows,
    tolerance,
)
from torchgram._core.problem import Problem
from torchgram._core.vmap_failures import failure_key, remember, remembered
from torchgram.backends.structured.cost import Force
from torchgram.backends.structured.passes import (
    Forward,
    SampleAxis,
    batched_forward,
    forget_trace,
    per_sample_forward,
    per_sample_view,
    restrict,
    trace,
)
from torchgram.backends.structured.plan import StructuredPlan, plan_problem
from torchgram.backends.structured.selections import check_weights, opened_nodes
from torchgram.backends.structured.trace import Recording, TapMode, TraceMismatch


def per_sample_forward_checked(problem: Problem, plan: StructuredPlan | None,
                               force: Force | None) -> tuple[Forward, StructuredPlan]:
    """The checked per-sample forward and the plan that goes with it (module docstring)."""
    traced = plan.recording if plan is not None else trace(problem)
    if traced.coupling:
        raise NotPerSample(f"f calls {traced.coupling[0]}: its samples interact")
    refused = refused_per_sample(traced)
    if refused is not None:
        raise NotPerSample(refused)
    forward, used = _forward(problem, traced)
    if used is not traced:  # traced afresh (the cached trace was stale): plan from it
        traced, plan = used, None
    if forward.recording.coupling:
        raise NotPerSample(f"f calls {forward.recording.coupling[0]}: its samples interact")
    if len(forward.carrier_leaves) > len(traced.unrecognised):  # the run diverged
        traced = Recording(unrecognised={i: [_LEFT_ITS_TRACE]
                                         for i in range(len(problem.leaves))})
        plan = None
    if plan is None or force is not None:
        plan = plan_problem(problem, traced, force=force)
    return forward, plan


_LEFT_ITS_TRACE = "(a run that left its trace)"
"""What :func:`per_sample_forward_checked` lists for every leaf where a sample's run diverged."""


def left_its_trace(recording: Recording) -> bool:
    """Whether ``recording`` is the all-fallback one of a run that left its trace."""
    return any(_LEFT_ITS_TRACE in notes for notes in recording.unrecognised.values())


def refused_per_sample(recording: Recording) -> str | None:
    """Why the per-sample way would run what ``torch.func`` refuses, if it would.

    NOTE [refused per-sample passes]: a leaf that needs the per-sample fallback is
    differentiated under ``vmap``, which refuses what the trace lists in
    ``Recording.transform_refusals`` (checkpoint regions, packed RNNs, ``retain_grad``,
    module backward hooks). The pass then found that the per-sample passes did not hold and
    took the rows of the whole batch, after a failed attempt; and ``auto``, which planned
    the per-sample way, tried the graph walk first: 1.7-2.6 times slower than those rows on
    the ``gpt2-checkpointing`` and ``lstm-packed`` models (B = 3), 1.36 times on GPT-2 with
    activation checkpointing at B = 16, as fast at B = 32 (session 65; both carry every row
    through the batch's backward). Those rows are now taken from the start.
    """
    if recording.transform_refusals and recording.unrecognised:
        return ("a leaf needs the per-sample fallback, whose torch.func transforms refuse "
                f"{recording.transform_refusals[0]}")
    return None


def _forward(problem: Problem, traced: Recording, *,
             retrace: bool = True) -> tuple[Forward, Recording]:
    """The batched way if possible, else one sample at a time; all-fallback if it diverges.

    Returns the forward and the trace it followed: a cached trace the run does not replay
    may be another function's (NOTE [call signatures]: a key holds ids, which the garbage
    collector reuses), so ``f`` is traced afresh once before the all-fallback way.
    """
    fallback = sorted(traced.unrecognised)
    tapped = [i for i in range(len(problem.leaves)) if i not in set(fallback)]
    key = ("restricted", tuple(tapped))
    expected = traced.plans.get(key)
    if expected is None:  # the trace's plans cache holds it for the next calls
        expected = traced.plans[key] = restrict(traced, tapped)
    try:
        if not fallback and traced.merged_order is not False and not traced.not_batched:
            forward = batched_forward(problem, expected)
            traced.not_batched = forward is None  # NOTE [runs that cannot be batched]
            if forward is not None and _check_batched(problem, forward, traced):
                return forward, traced
        return _one_sample_at_a_time(problem, expected, fallback), traced
    except TraceMismatch:
        forget_trace(problem)  # the next call traces afresh
        if retrace:
            return _forward(problem, trace(problem), retrace=False)
        return _one_sample_at_a_time(problem, restrict(traced, []),
                                     list(range(len(problem.leaves)))), traced


# NOTE [runs that cannot be batched]
# Whether a trace's run can be batched is a property of f's code, like its trace: T5's
# relative position bias, shared by the samples, meets the mask in `torch.where`,
# Nyströmformer's in an in-place `add_`, where the tapping mode cannot follow it to the batch
# (NOTE [shared taps]). The structured pass then runs one sample at a time (under vmap, or in
# a loop where f reads the batch's values). Each call made the batched run first and gave up
# (5 of T5's 96 ms); the trace now remembers it, and auto estimates such a trace's passes as
# per-sample ones, which against loops makes it pick the graph walk (NOTE [the graph walk
# against loops]: T5 30 ms against 85-107 ms, session 64).


def _check_batched(problem: Problem, forward: Forward, traced: Recording) -> bool:
    """The first and last samples without the others give the batch's outputs.

    Raises :class:`NotPerSample` when they do not; returns ``False`` when a dim that merges
    the samples (``Forward.merged_acts``) does not hold each sample's entries together.

    NOTE [checking the batched pass]: with ``B > 2`` the two samples run as one batch of two
    (one evaluation of ``f``, the cost of about one sample: the weights are read once);
    samples that interact then see another batch than the whole one and give other outputs,
    in both directions (the first sample sees the last, the last the first). With ``B = 2``
    each runs alone. Where samples are merged in one dim of a tapped activation
    (``x.view(-1, d)`` before ``torch.addmm``, as GPT-2's ``Conv1D`` does), the same run
    records its activations, and each sample's slice of the merged dim (its entries taken
    together, sample after sample) must be what the sample gave there. That order is a
    property of the code, like the tapped calls of the trace, so it is checked on the first
    batched run of a trace (later runs replay the same calls and shapes); a trace whose
    order does not hold is not used batched again. When ``f`` draws random numbers the
    samples cannot run apart with the batch's draws (NOTE [per-sample]): derivatives of the
    same forward are checked instead (:func:`_check_derivatives`), merged orders included
    (NOTE [merged order from derivatives]). The derivatives are also checked
    on the first batched run of every trace: outputs can agree whatever the coupling (samples
    that are the same where they meet, e.g. every sample's one token the padding id, give the
    same ``x - x.mean(0)`` alone and in the batch), while the batch's graph carries every
    sample's rows to every sample's taps (update hunt 3: ``G`` 112 times off, relative). A
    coupling is a property of the code, like the order of merged dims.

    NOTE [when the values are compared]: the outputs are compared with the thorough
    derivative check (once per trace and routing), while a merged order is unverified, and
    on every call whose run rewrote a call (NOTE [rewritten layouts]: the rewrite's values
    against the original composite's) -- but for the rewrites that hold for any values
    (``rules.SETTLED_PER_TRACE``: the recurrent cells, session 44, 1 ms of the LSTM case's
    12.4 ms, 4.5 of the GRU's 48; self-attention and einsum, session 46, 3.5 ms of the
    benchmark transformer's 108): the first call of a trace compares them, a replay checks
    the shapes and taps they depend on. Other calls of a checked trace and
    routing skip the evaluation of the two samples (session 42; ~0.7 ms of the benchmark
    MLP's 3.8 ms, 6 ms of ResNet-18's 81): what decides the per-sample Gramian is that no
    row reaches another sample's taps, which the derivative check proves from the graph,
    and the graph's signature, its routing digest and its selections (opened) are what can
    change it between calls of one trace. A coupling through values alone (a detached batch
    statistic) leaves the Jacobian of ``f`` as called block-per-sample at the taps, and
    both ways give that matrix; the tests of NOTE [per-sample] and the fuzzers pass without
    the per-call comparison. The derivatives are checked again when the index tensors that
    route the batched graph's cotangents change (``h[x[:, 0].argsort()]``: a first call on
    sorted inputs passed, and later calls exchanging samples 1 and 2, which the two samples
    run apart do not see, were 0.5 to 0.7 off before session 28; NOTE [routing values]),
    and when the kinds of the graph's nodes change (Python control flow that adds
    ``h.flip(0)`` from the second call was 1.53 off before session 29). Each routing is
    checked once (:attr:`Recording.checked_routings`), by a pass with the graph's selections
    opened (NOTE [opened selections]).
    """
    if forward.recording.coupling:
        raise NotPerSample(f"f calls {forward.recording.coupling[0]}: its samples interact")
    if forward.merged_acts and traced.merged_order is False:
        return False
    batch = problem.batch
    assert batch is not None
    if batch.size == 1:
        return True
    routing = forward.routing
    # the thorough derivative check: once per trace and routing (NOTE [routing values])
    thorough = routing not in traced.checked_routings
    if problem.draw.random:  # samples cannot run apart with the batch's draws
        return _check_derivatives_of_draws(problem, forward, traced, thorough=thorough)
    verify = bool(forward.merged_acts) and traced.merged_order is None
    if not (thorough or verify or forward.recheck_values):  # NOTE [when the values are compared]
        return True
    samples = [0, batch.size - 1]
    rows, same = [], True
    for subset in ([[0], [1]] if batch.size == 2 else [samples]):
        mode = TapMode(problem.leaves, problem.leaves, keep_acts=True) if verify else None
        with torch.no_grad(), mode or contextlib.nullcontext():
            rows.append(subset_rows(problem, subset))
        if mode is not None:
            same = same and _same_merged_acts(forward, mode.acts, subset)
    check_samples(problem, torch.cat(rows), torch.tensor(samples), forward.outputs[0].detach())
    if verify:
        traced.merged_order = same
    if same and thorough:  # outputs can hide a coupling
        _check_derivatives(problem, forward)
        traced.note_checked(routing)
    return same


def _check_derivatives_of_draws(problem: Problem, forward: Forward, traced: Recording, *,
                                thorough: bool) -> bool:
    """:func:`_check_batched` for an ``f`` that draws: the derivatives alone decide.

    NOTE [merged order from derivatives]: an unverified merged order is checked by the
    thorough derivative check of the same forward (the same draw), which reads each tap's
    cotangents through the sample-major view of its merged dim: every row that a sample's
    outputs reach must lie in that sample's slice. Where it does, the per-sample factors
    (row ``r`` of the activation with row ``r`` of the tap, each sample's slice summed) are
    exact whatever rows the other slices hold; where the order is another (``[T, B]``
    flattened), a sample's rows lie in other slices and the check finds them. A leak then
    sends the call to the other per-sample way (which finds a coupling its own way), and
    the trace is not used batched again. Before session 47 merged dims waited for a run
    without draws (GPT-2 from ``transformers`` in train mode with dropout, whose ``Conv1D``
    merges the tokens of the samples: every call ran per sample, ~12x its backward).

    NOTE [later calls that draw]: like those of an ``f`` that draws nothing (NOTE [when the
    values are compared]), later calls of a checked trace and routing run no check. A draw
    changes values, not paths: a dropout mask multiplies (NaN goes through its zeros), a
    drawn condition selects (opened in the check), drawn indices route (in the routing
    digest, which sends the call to the check again) and a drawn Python branch changes the
    graph's signature. Before session 47 every such call ran two more backwards to its taps
    (the even- and the odd-numbered samples): GPT-2 with dropout 2.5x its backward, 1.56x
    without them (B=16, T=32, 1 thread).
    """
    verify = bool(forward.merged_acts) and not traced.merged_order
    if not (thorough or verify):  # NOTE [later calls that draw]
        return True
    try:
        _check_derivatives(problem, forward)
    except NotPerSample:
        if not verify:
            raise
        traced.merged_order = False
        return False
    if verify:
        traced.merged_order = True
    traced.note_checked(forward.routing)
    return True


def _check_derivatives(problem: Problem, forward: Forward) -> None:
    """Raise :class:`NotPerSample` if rows of one group of samples reach another's taps.

    One more backward of the same forward (the same draw, where ``f`` draws) per group of
    :func:`separating_groups` (every pair of samples is separated by one), with NaN on the
    rows of the group's samples (NaN goes through zero factors, and the selections are
    opened: NOTE [opened selections]), must leave every tapped output of the other samples
    without gradient. An output row that depends on another sample's tapped activations
    (``x - x.mean(0)`` after a layer) has one there, and the batched pass's per-sample
    factors would then miss its cross-sample terms (found by the fuzzer: a wrong matrix).
    Interactions before every tap (centering the inputs) leave the per-sample Gramian exact
    and pass. Before session 23 the first and the last sample alone were weighed, and saw
    nothing when a dropout had zeroed both their outputs (a Gramian hunt case: ``G`` 957
    times off); before session 28 the even- and the odd-numbered samples, which missed
    samples exchanged within a group where the values could not tell (``h[order]``
    exchanging samples 0 and 2, whose tokens were both the padding id, then per-sample
    labels: ``G`` 1.57 off, relative, on structured, auto and the kernels; a Gramian fuzz
    case). A coupling is a property of the code, so the check runs once per trace and
    routing (NOTE [when the values are compared], NOTE [later calls that draw]).
    """
    rows, taps = forward.outputs[0], forward.taps[0]
    samples = forward.samples
    if not rows.requires_grad or not taps or samples < 2:
        return
    cot, outside = group_directions(rows, problem.sample_major_index, samples,
                                    separating_groups(samples))
    inputs: Any = list(taps)  # tensors and gradient edges
    with opened_nodes(forward.selections):  # NOTE [opened selections]
        for direction, where_zero in zip(cot, outside, strict=True):  # NOTE [checks one by one]
            grads = torch.autograd.grad(rows, inputs, direction.reshape(rows.shape),
                                        retain_graph=True, allow_unused=True)
            check_leaks([None if grad is None else grad[None] for grad in grads], forward,
                        where_zero[None])


# NOTE [checks one by one]
# The check directions of the batched pass (NOTE [checking the batched pass]) run as one
# backward each, not as one backward batched over them (``is_grads_batched``): that batching
# (torch's legacy vmap) has no rule for several backward formulas (scaled-dot-product
# attention, layer norm, the ``where`` of the opened selections), which it then runs direction
# by direction anyway and concatenates (99 ms of copies in the benchmark transformer's first
# call, 7 directions), and it holds every direction's intermediates at once. One at a time,
# measured on first calls (1 thread, fresh processes, two runs each): transformer 608-610 ->
# 457-500 ms, CNN 233-241 -> 131-142 ms, GPT-2 223-228 -> 176-179 ms, ResNet-18 377-382 ->
# 327-329 ms, BERT 136-143 -> 124-127 ms, MLP unchanged; the per-call check of an f that
# draws (two directions) within noise.


def check_leaks(grads: Sequence[Tensor | None], forward: Forward, outside: Tensor, *,
                viewed: bool = False) -> None:
    """Raise :class:`NotPerSample` if a check direction reached another group's taps.

    ``grads``: the check directions' cotangents at the taps (``[checks, *tap]``; ``viewed``:
    already ``[checks, B, ...]``); ``outside``: ``[checks, B]``, where each must vanish
    (:func:`group_directions`).
    """
    checks, samples = outside.shape
    for grad, axis in zip(grads, forward.tap_dims, strict=True):
        if grad is None:
            continue
        leaks = (grad if viewed else per_sample_view(grad, axis, 1, samples)).reshape(
            checks, samples, -1)
        if bool((leaks.ne(0).any(-1) & outside).any()):
            raise NotPerSample(LEAK)


LEAK = ("an output row of one sample has a derivative on another sample's activations: the "
        "samples interact")
"""Why the per-sample passes do not hold, when a derivative check finds a leak."""


def group_directions(rows: Tensor, index: Tensor, samples: int,
                     groups: Sequence[Sequence[int]] | None = None) -> tuple[Tensor, Tensor]:
    """The check directions of NOTE [derivative check], and where they must vanish.

    ``index`` (``[B, K]``) gives each sample's rows in ``rows.reshape(-1)``. Direction ``j``
    weighs the rows of the samples of ``groups[j]`` (default: the even- and the
    odd-numbered samples, :func:`even_odd`) by NaN (:func:`check_weights`: it never cancels
    and goes through zero factors and opened selections, NOTE [opened selections]); its
    cotangent must be exactly zero at the taps of every sample outside
    the group (``outside[j]``, ``[len(groups), B]``).

    Example:
        >>> cot, outside = group_directions(torch.zeros(3, 2), torch.arange(6).reshape(3, 2), 3)
        >>> cot.ne(0).int()
        tensor([[1, 1, 0, 0, 1, 1],
                [0, 0, 1, 1, 0, 0]], dtype=torch.int32)
        >>> outside
        tensor([[False,  True, False],
                [ True, False,  True]])
    """
    generator = torch.Generator(device=rows.device).manual_seed(0)  # leaves the draws alone
    groups = even_odd(samples) if groups is None else groups
    cot = rows.new_zeros(len(groups), rows.numel())
    outside = torch.ones(len(groups), samples, dtype=torch.bool, device=rows.device)
    for j, group in enumerate(groups):
        members = index[list(group)].reshape(-1)
        cot[j, members] = check_weights(members.numel(), rows.dtype, rows.device, generator)
        outside[j, list(group)] = False
    return cot, outside


def _same_merged_acts(forward: Forward, acts: list[Tensor], subset: list[int]) -> bool:
    """Whether the merged activations of a run of ``subset`` are the batch's slices of them."""
    for i, dim in forward.merged_acts.items():
        if i >= len(acts):
            return False
        alone = per_sample_view(acts[i], SampleAxis(dim, merged=True), 0, len(subset))
        batched = forward.acts[i][subset]
        if alone.shape != batched.shape:
            return False
        if not alone.is_floating_point():
            if not torch.equal(alone, batched):
                return False
            continue
        scale = batched.abs().max()
        if not bool(((alone - batched).abs() <= tolerance(batched.dtype) * (scale + batched.abs()))
                    .all()):
            return False
    return True


# NOTE [gradient hooks under the per-sample vmap]
# The vmap way evaluates f under torchgram's ``vmap`` with the graph outside it (taps and
# carriers require grad, the backward comes after). Under it every tensor that meets the
# batch is a batched wrapper, which says ``requires_grad=False`` whatever it wraps, and
# torch refuses a hook on it: an ``f`` that guards its hook as usual (``if w.requires_grad:
# w.register_hook(...)``) skipped it there and in no other evaluation. With a fallback leaf
# (a merged LoRA weight ``A @ B``, ``2 * w``, ``tanh(A @ B)``: a tensor made of parameters
# only, hooked) the blocks missed the hook: G 0.96 off on ``structured`` and ``auto`` with
# ``batch_dim=0`` (session 58 left it, session 59 found the guard). Neither a
# ``TorchFunctionMode`` (torch 2.13 sends no ``requires_grad`` read through it) nor the
# batched wrapper can answer otherwise, so a trace that saw ``f`` register a gradient hook
# takes the loop, where the carriers are plain tensors that require grad. (An ``f`` whose
# value itself depends on ``requires_grad`` is another function under any ``vmap``, as
# under ``torch.func.vmap`` itself; its gradient-free evaluations see it too.)


def _one_sample_at_a_time(problem: Problem, expected: Recording, fallback: list[int]) -> Forward:
    """``vmap`` over samples, a loop where it cannot; every sample checked against the batch.

    Where the trace saw ``f`` register gradient hooks, which the ``vmap`` way would not run
    as ``f`` means them, a loop (NOTE [gradient hooks under the per-sample vmap]).

    Where torch refuses ``f`` under the transforms the check of the samples needs (an
    old-style ``autograd.Function``, module backward hooks: NOTE [old-style
    autograd.Functions]), the rows of the whole batch give the same matrix instead.
    """
    try:
        batch_outputs, _ = batch_rows(problem)
    except RuntimeError as error:
        refused = _torch_compat.refused_under_transforms(error)
        if refused is None:
            raise
        raise NotPerSample(f"the per-sample check runs f under torch.func transforms, which "
                           f"refuse {refused.what}") from error
    key = failure_key(problem, "structured", True)  # NOTE [vmap failures remembered]
    loop = problem.loops_only or expected.gradient_hooks or remembered(key) is not None
    forward, failure = None, None
    if not loop:
        try:
            forward = per_sample_forward(problem, expected, fallback, loop=False)
        except (BackendCannotRun, OutputChanged, NotPerSample, TraceMismatch):
            raise
        except Exception as error:  # noqa: BLE001 -- NOTE [vmap or loop]: loop instead
            forward, failure = None, error
    if forward is None:
        try:
            forward = per_sample_forward(problem, expected, fallback, loop=True)
        except (BackendCannotRun, OutputChanged, NotPerSample, TraceMismatch,
                DifferentiatedTwice):  # a fused recurrence, run in the loop (not under vmap)
            raise
        except Exception as error:  # the batch ran: f fails on a batch of one
            raise fails_alone(error) from error
        if failure is not None:  # the loops ran: the failure was vmap's
            remember(key, failure)
    rows = forward.detached_rows().reshape(forward.samples, -1)
    check_samples(problem, rows, torch.arange(forward.samples), batch_outputs)
    return forward
