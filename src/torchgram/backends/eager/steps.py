"""Taps of calls made once per step (a fused RNN's recurrent projection), read in one pass.

# NOTE [eager step taps]
Under a ``record()`` block a fused ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` call is rewritten
into its cells (NOTE [recurrent rewrite]), and the recurrent weight ``W_hh`` is applied once
per step. Tapping each step's call would make ``T`` taps and ``T`` uses per layer and
direction, and ``T`` trips through the mode per step. The rewrite asks its mode for *one*
tap of all the steps (NOTE [step taps]); the recording answers that protocol without
changing what the forward computes, and with no zero tap added to the graph:

* :meth:`~torchgram.backends.eager.record.RecordMode.tap_steps` gives the rewrite, for each
  leaf operand (``W_hh``, ``b_hh``), an alias ``W.view_as(W)``: the alias's node is then the
  only node of the recorded graph with an edge into the leaf from these steps, so it is the
  use's holder, and the check that the recording saw every use of the leaf (NOTE [eager
  recording]) holds as for any recognised call;
* with ``share`` (an LSTM's or RNN's gates are ``xs[t] + h W_hhᵀ + b_hh``, with ``xs`` the
  tapped input projection of all steps) the cotangent at ``xs`` is the gates' cotangent of
  every step: the uses join ``xs``'s tap and the rewrite computes the gates with one
  ``addmm`` per step outside the mode;
* otherwise (a GRU: ``r ⊙ (h W_hnᵀ + b_hn)`` is not added to ``xs``) each step's output
  ``h W_hhᵀ + b_hh`` is computed outside the mode and noted by
  :meth:`~torchgram.backends.eager.record.RecordMode.step_output` (its node and slot); the
  tap is the stack of those ``T`` slots along the steps' dim (:class:`StepSlots`), read by
  one backward pass with every step's slot among its targets (:func:`slot_edges`,
  :func:`gather_steps`);
* :meth:`~torchgram.backends.eager.record.RecordMode.record_steps` then records one use per
  leaf with the stacked inputs ``h`` of all steps as its activation: one use of ``T`` times
  the positions, the factors the per-step uses give once taken together.

Where the mode cannot (no autograd, an initial state that is itself a leaf, a leaf passed
transposed), the rewrite falls back to one recorded call per step, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from torchgram.backends.graph.nodes import Edge


@dataclass(frozen=True)
class StepSlots:
    """A step tap's slots: step ``t``'s output is ``edges[t]``; the tap stacks them at ``dim``."""

    edges: tuple[Edge, ...]
    dim: int


TapSlot = Edge | StepSlots
"""Where a tap's cotangent is read: one slot, or the slots of its steps."""


def slot_edges(slots: Sequence[TapSlot]) -> list[Edge]:
    """Every edge of ``slots``, in order (a step tap's: all its steps)."""
    edges: list[Edge] = []
    for slot in slots:
        if isinstance(slot, StepSlots):
            edges.extend(slot.edges)
        else:
            edges.append(slot)
    return edges


def gather_steps(slots: Sequence[TapSlot],
                 raw: Sequence[Tensor | None]) -> list[Tensor | None]:
    """Per slot, its ``[c, *tap]`` cotangent from ``raw`` (one per :func:`slot_edges` edge).

    A step tap's steps are stacked along its dim (a step that no output reaches: zeros);
    ``None`` where no output reaches any of them.
    """
    found: list[Tensor | None] = []
    at = 0
    for slot in slots:
        if not isinstance(slot, StepSlots):
            found.append(raw[at])
            at += 1
            continue
        steps = raw[at:at + len(slot.edges)]
        at += len(slot.edges)
        present = next((cot for cot in steps if cot is not None), None)
        if present is None:
            found.append(None)
            continue
        found.append(torch.stack([torch.zeros_like(present) if cot is None else cot
                                  for cot in steps], dim=slot.dim + 1))
    return found


def by_steps(cotangents: Callable[[list[Tensor], list[Edge], bool], list[Tensor | None]]
             ) -> Callable[[list[Tensor], list[TapSlot], bool], list[Tensor | None]]:
    """``cotangents(seeds, edges, free)`` for taps: a step tap's cotangent is its steps'."""

    def of_slots(seeds: list[Tensor], slots: list[TapSlot], free: bool) -> list[Tensor | None]:
        return gather_steps(slots, cotangents(seeds, slot_edges(slots), free))

    return of_slots
