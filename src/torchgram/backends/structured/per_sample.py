"""The structured backend's per-sample forward, checked (NOTE [per-sample]).

Three ways, each with its check (NOTE [structured passes] for the ways themselves):

* **batched** (every leaf covered by a rule): ``f`` on the whole batch, taps read per
  sample. Checked: no call makes samples interact (the run's ``coupling``), and, unless
  ``f`` draws random numbers, the first and last samples run apart from the others give the
  batch's outputs (as a batch of their own, one evaluation, when the batch has more than
  two samples; the first alone otherwise).
* **vmap**, or a **loop** where ``vmap`` cannot batch ``f`` (leaves on the fallback):
  ``f`` one sample at a time. Checked like the jacobian backend's per-sample way: one
  evaluation of the whole batch first (no random draw, no interacting call), then every
  sample's outputs against it; a sample that fails alone where the batch ran, or draws
  random numbers, ends it.

Any check that fails raises :class:`NotPerSample`; the backend then contracts the rows of
the whole batch (the exact coupled Gramian when samples interact).
"""

from __future__ import annotations

import optree
import torch
from torch import Tensor

from torchgram._core.errors import BackendCannotRun, NotPerSample, OutputChanged
from torchgram._core.per_sample import batch_rows, check_samples, fails_alone
from torchgram._core.problem import Problem, replace_input_leaves
from torchgram.backends.structured.cost import Force
from torchgram.backends.structured.passes import (
    Forward,
    batched_forward,
    forget_trace,
    per_sample_forward,
    restrict,
    trace,
)
from torchgram.backends.structured.plan import StructuredPlan, plan_problem
from torchgram.backends.structured.trace import Recording, TraceMismatch


def per_sample_forward_checked(problem: Problem, plan: StructuredPlan | None,
                               force: Force | None) -> tuple[Forward, StructuredPlan]:
    """The checked per-sample forward and the plan that goes with it (module docstring)."""
    traced = plan.recording if plan is not None else trace(problem)
    if traced.coupling:
        raise NotPerSample(f"f calls {traced.coupling[0]}: its samples interact")
    forward = _forward(problem, traced)
    if forward.recording.coupling:
        raise NotPerSample(f"f calls {forward.recording.coupling[0]}: its samples interact")
    if len(forward.carrier_leaves) > len(traced.unrecognised):  # the run diverged
        traced = Recording(unrecognised={i: ["(a run that left its trace)"]
                                         for i in range(len(problem.leaves))})
        plan = None
    if plan is None or force is not None:
        plan = plan_problem(problem, traced, force=force)
    return forward, plan


def _forward(problem: Problem, traced: Recording) -> Forward:
    """The batched way if possible, else one sample at a time; all-fallback if it diverges."""
    fallback = sorted(traced.unrecognised)
    tapped = [i for i in range(len(problem.leaves)) if i not in set(fallback)]
    key = ("restricted", tuple(tapped))
    expected = traced.plans.get(key)
    if expected is None:  # the trace's plans cache holds it for the next calls
        expected = traced.plans[key] = restrict(traced, tapped)
    try:
        if not fallback:
            forward = batched_forward(problem, expected)
            if forward is not None:
                _check_batched(problem, forward)
                return forward
        return _one_sample_at_a_time(problem, expected, fallback)
    except TraceMismatch:
        forget_trace(problem)  # the next call traces afresh
        return _one_sample_at_a_time(problem, restrict(traced, []),
                                     list(range(len(problem.leaves))))


def _check_batched(problem: Problem, forward: Forward) -> None:
    """The first and last samples run alone give the batch's outputs (unless ``f`` is random)."""
    if forward.recording.coupling:
        raise NotPerSample(f"f calls {forward.recording.coupling[0]}: its samples interact")
    batch = problem.batch
    assert batch is not None
    if batch.size == 1 or problem.draw.random:
        return
    if batch.size == 2:
        samples = torch.tensor([0])
        with torch.no_grad():
            rows = problem.sample_rows(problem.leaves, batch.narrow(0, 1))[None]
    else:
        samples = torch.tensor([0, batch.size - 1])
        rows = _subbatch_rows(problem, samples)
    check_samples(problem, rows, samples, forward.outputs[0].detach())


def _subbatch_rows(problem: Problem, samples: Tensor) -> Tensor:
    """``[count, K]``: the rows of ``f`` evaluated on the samples ``samples`` alone, as a batch."""
    batch = problem.batch
    assert batch is not None
    spec = problem.output
    assert spec.batch_dims is not None
    inputs = tuple(t.index_select(d, samples.to(t.device))
                   for t, d in zip(batch.tensors, batch.dims, strict=True))
    args, kwargs = replace_input_leaves(problem.args, problem.kwargs, batch.positions, inputs)
    with torch.no_grad():
        out, _ = problem.call(problem.leaves, args, kwargs, full=False)
    out_leaves, treespec = optree.tree_flatten(out)
    count = samples.numel()
    shapes = [torch.Size((*shape[:dim], count, *shape[dim + 1:]))
              for shape, dim in zip(spec.shapes, spec.batch_dims, strict=True)]
    if treespec != spec.treespec or [getattr(leaf, "shape", None) for leaf in out_leaves] \
            != shapes:
        raise OutputChanged("f returned an output of another structure on part of the batch")
    return torch.cat([leaf.movedim(dim, 0).reshape(count, -1).to(spec.dtype)
                      for leaf, dim in zip(out_leaves, spec.batch_dims, strict=True)], dim=1)


def _one_sample_at_a_time(problem: Problem, expected: Recording, fallback: list[int]) -> Forward:
    """``vmap`` over samples, a loop where it cannot; every sample checked against the batch."""
    batch_outputs, _ = batch_rows(problem)
    loop = problem.loops_only
    forward = None
    if not loop:
        try:
            forward = per_sample_forward(problem, expected, fallback, loop=False)
        except (BackendCannotRun, OutputChanged, NotPerSample, TraceMismatch):
            raise
        except Exception:  # noqa: BLE001 -- NOTE [vmap or loop]: loop instead
            forward = None
    if forward is None:
        try:
            forward = per_sample_forward(problem, expected, fallback, loop=True)
        except (BackendCannotRun, OutputChanged, NotPerSample, TraceMismatch):
            raise
        except Exception as error:  # the batch ran: f fails on a batch of one
            raise fails_alone(error) from error
    rows = forward.detached_rows().reshape(forward.samples, -1)
    check_samples(problem, rows, torch.arange(forward.samples), batch_outputs)
    return forward
