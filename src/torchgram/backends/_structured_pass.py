"""The structured backend's passes: one tapped forward, then backwards for row cotangents.

# NOTE [structured passes]
*Per-sample* (``batch_dim``): a trace on one sample (a batch of one) says which calls are
tapped and which leaves need the fallback. Then ONE forward runs ``f`` per sample under
``vmap`` (each sample a batch of one, as in DESIGN.md §3, so models that move the batch
dimension inside are fine) with the taps ``[B, *y]`` and the per-sample copies ``[B, *θ]``
of the fallback leaves (their "carriers") as batched inputs, and plain autograd outside:
row ``(b, k)`` depends on sample ``b`` only, so the backward of a cotangent that is 1 at
``(b, k)`` for *every* ``b`` gives, at once, every sample's ``∂out_(b,k)/∂y`` on that
sample's slice of the taps, and its per-sample fallback gradients on the carriers. ``K = 1``
(per-sample losses) is one forward and one backward; ``K > 1`` vmaps the backward over
row-chunks of ``k`` (``is_grads_batched``). ``chunk_size=1`` loops over samples and rows
without ``vmap``.

*Dense rows* (no ``batch_dim``): one forward of ``f`` with taps created on the fly, every
leaf's tensor carrying the gradient of its unrecognised uses, and the backward vmapped over
chunks of basis cotangents of the ``m`` rows. Everything is one "sample" with ``R = m``.

If a per-sample run leaves its trace (the mode reports a ``TraceMismatch``, e.g. control
flow that depends on ``requires_grad``), the pass is redone with every leaf on the fallback,
which is always right.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from torchgram._problem import GramianProblem
from torchgram.rules.taps import Recording, TapMode

GradChunk = tuple[int, int, list[Tensor | None], dict[int, Tensor]]


def trace(problem: GramianProblem) -> Recording:
    """Run ``f`` once under a tracing :class:`TapMode` (one sample with ``batch_dim``).

    Leaves are given as tensors that require gradients, with gradients enabled, so that
    code which branches on ``requires_grad`` takes the same path as in the real pass.
    """
    with torch.enable_grad():
        carriers = tuple(leaf.detach().requires_grad_() for leaf in problem.leaves)
        mode = TapMode(carriers, problem.leaves, taps="trace")
        batch = problem.batch
        if batch is None:
            with mode:
                problem.rows(carriers)
        else:
            sample = tuple(t.narrow(d, 0, 1) for t, d in zip(batch.tensors, batch.dims,
                                                             strict=True))
            with mode:
                problem.sample_rows(carriers, sample)
    return mode.recording


@dataclass
class Forward:
    """A tapped forward, ready for backwards.

    Attributes:
        recording: The tapped calls and uses (as seen by the run).
        samples: ``B`` (1 for dense rows).
        rows_per_sample: ``R``.
        acts: Recorded activations, each with a leading sample dim.
        outputs: Per sample the ``[R]`` output rows (one tensor ``[B, R]`` when vectorized),
            or ``[1, m]`` for dense rows.
        taps: Per sample (or once, batched) the taps.
        carriers: Per sample (or once, batched) the fallback leaves' tensors.
        carrier_leaves: The leaves with carriers, in order.
        aux: ``f``'s aux (dense rows only).
    """

    recording: Recording
    samples: int
    rows_per_sample: int
    acts: list[Tensor]
    outputs: list[Tensor]
    taps: list[list[Tensor]]
    carriers: list[list[Tensor]]
    carrier_leaves: list[int]
    aux: Any = None
    looped: bool = False
    dense: bool = False

    def detached_rows(self) -> Tensor:
        """The output rows ``[B, R]`` without gradient history."""
        if len(self.outputs) == 1:
            return self.outputs[0].detach()
        return torch.stack([out.detach().reshape(-1) for out in self.outputs])


def per_sample_forward(problem: GramianProblem, recording: Recording,
                       fallback: Sequence[int], *, loop: bool) -> Forward:
    """The tapped per-sample forward (NOTE [structured passes])."""
    batch = problem.batch
    assert batch is not None
    size = batch.size
    leaves = problem.leaves
    fallback = sorted(fallback)
    tapped = [i for i in range(len(leaves)) if i not in set(fallback)]
    tap_specs = recording.taps
    base = [leaf.detach().requires_grad_() for leaf in leaves]

    def run(taps: Sequence[Tensor], carriers: Sequence[Tensor],
            sample: tuple[Tensor, ...]) -> tuple[Tensor, list[Tensor]]:
        run_leaves = list(base)
        for leaf, carrier in zip(fallback, carriers, strict=True):
            run_leaves[leaf] = carrier
        mode = TapMode(run_leaves, leaves, tapped=tapped, taps=list(taps), expected=tap_specs,
                       carriers=fallback)
        with mode:
            rows = problem.sample_rows(tuple(run_leaves), sample)
        mode.finish()
        return rows, mode.acts

    if loop:
        outputs, acts_per_sample, taps_all, carriers_all = [], [], [], []
        for b in range(size):
            taps = [torch.zeros(spec.shape, dtype=spec.dtype, device=leaves[0].device,
                                requires_grad=True) for spec in tap_specs]
            carriers = [leaves[i].detach().requires_grad_() for i in fallback]
            sample = tuple(t.narrow(d, b, 1) for t, d in zip(batch.tensors, batch.dims,
                                                             strict=True))
            rows, acts = run(taps, carriers, sample)
            outputs.append(rows)
            acts_per_sample.append(acts)
            taps_all.append(taps)
            carriers_all.append(carriers)
        acts = [torch.stack([acts_b[i] for acts_b in acts_per_sample])
                for i in range(len(acts_per_sample[0]))] if acts_per_sample else []
        return Forward(recording, size, outputs[0].numel(), acts, outputs, taps_all,
                       carriers_all, fallback, looped=True)

    taps = [torch.zeros((size, *spec.shape), dtype=spec.dtype, device=leaves[0].device,
                        requires_grad=True) for spec in tap_specs]
    carriers = [leaves[i].detach().expand(size, *leaves[i].shape).requires_grad_()
                for i in fallback]

    def one_sample(taps: tuple[Tensor, ...], carriers: tuple[Tensor, ...],
                   *inputs: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        sample = tuple(x.unsqueeze(d) for x, d in zip(inputs, batch.dims, strict=True))
        rows, acts = run(taps, carriers, sample)
        return rows, tuple(acts)

    rows, acts = torch.func.vmap(one_sample, in_dims=(0, 0, *batch.dims))(
        tuple(taps), tuple(carriers), *batch.tensors)
    return Forward(recording, size, rows.shape[1], list(acts), [rows], [taps], [carriers],
                   fallback)


def dense_forward(problem: GramianProblem) -> Forward:
    """The tapped forward on the full inputs, taps made on the fly (dense rows)."""
    leaves = problem.leaves
    carriers = [leaf.detach().requires_grad_() for leaf in leaves]
    mode = TapMode(carriers, leaves, taps="lazy")
    with mode:
        rows, aux = problem.rows(tuple(carriers))
    used = sorted(mode.recording.unrecognised)
    return Forward(mode.recording, 1, rows.numel(), [act.unsqueeze(0) for act in mode.acts],
                   [rows.reshape(1, -1)], [mode.made_taps], [[carriers[i] for i in used]], used,
                   aux=aux, dense=True)


def rows_per_pass(problem: GramianProblem, forward: Forward) -> int:
    """Cotangent directions per backward (each covers every sample): chunk_size / budget."""
    rows = forward.rows_per_sample
    if problem.chunk_size is not None:
        return max(1, min(rows, problem.chunk_size // max(1, forward.samples)))
    if problem.memory_budget is None:
        return max(rows, 1)
    per_direction = sum(t.numel() for t in forward.taps[0]) + \
        sum(c.numel() for c in forward.carriers[0])
    per_direction *= forward.samples if forward.looped else 1
    itemsize = max(leaf.element_size() for leaf in problem.leaves)
    return int(max(1, min(rows, problem.memory_budget // max(1, per_direction * itemsize))))


def backward_chunks(forward: Forward, per_pass: int, *,
                    vectorize: bool) -> Iterator[GradChunk]:
    """``(start, stop, tap cotangents [c, B, *y], carrier grads [c, B, P])`` per row chunk.

    A tap the output does not depend on gets ``None``.
    """
    if forward.looped:
        yield from _looped_chunks(forward)
        return
    rows = forward.outputs[0]
    if not rows.requires_grad:
        return
    inputs = [*forward.taps[0], *forward.carriers[0]]
    num_taps = len(forward.taps[0])
    total = forward.rows_per_sample
    for start in range(0, total, per_pass):
        stop = min(start + per_pass, total)
        count = stop - start
        cot = rows.new_zeros(count, *rows.shape)
        cot[torch.arange(count), :, torch.arange(start, stop)] = 1
        batched = vectorize and count > 1
        grads = torch.autograd.grad(
            rows, inputs, cot if batched else cot[0], retain_graph=stop < total,
            allow_unused=True, is_grads_batched=batched)
        if not batched:
            grads = tuple(None if g is None else g.unsqueeze(0) for g in grads)
        if forward.dense:  # taps and carriers have no sample dim: add B = 1
            grads = tuple(None if g is None else g.unsqueeze(1) for g in grads)
        tap_cots = list(grads[:num_taps])
        carrier_grads = {
            leaf: grad.reshape(count, forward.samples, -1)
            for leaf, grad in zip(forward.carrier_leaves, grads[num_taps:], strict=True)
            if grad is not None
        }
        yield start, stop, tap_cots, carrier_grads


def _looped_chunks(forward: Forward) -> Iterator[GradChunk]:
    """One row at a time, one sample at a time, without vmap (``chunk_size=1``)."""
    total = forward.rows_per_sample
    for k in range(total):
        per_sample: list[list[Tensor | None]] = []
        for b, rows in enumerate(forward.outputs):
            inputs = [*forward.taps[b], *forward.carriers[b]]
            if not rows.requires_grad or not inputs:
                per_sample.append([None] * len(inputs))
                continue
            grads = torch.autograd.grad(rows.reshape(-1)[k], inputs,
                                        retain_graph=k + 1 < total, allow_unused=True)
            per_sample.append(list(grads))
        num_taps = len(forward.taps[0]) if forward.taps else 0
        columns = list(zip(*per_sample, strict=True)) if per_sample else []
        stacked: list[Tensor | None] = []
        for i, column in enumerate(columns):
            if all(g is None for g in column):
                stacked.append(None)
                continue
            like = forward.taps[0][i] if i < num_taps else forward.carriers[0][i - num_taps]
            stacked.append(torch.stack([torch.zeros_like(like) if g is None else g
                                        for g in column]).unsqueeze(0))
        tap_cots = stacked[:num_taps]
        carrier_grads = {
            leaf: grad.reshape(1, forward.samples, -1)
            for leaf, grad in zip(forward.carrier_leaves, stacked[num_taps:], strict=True)
            if grad is not None
        }
        yield k, k + 1, tap_cots, carrier_grads
