"""What a backend returns: per-leaf blocks in its own row order, aux, a pullback, a report.

# NOTE [backend results]
A backend is a function ``problem -> BackendResult`` that writes nothing into the problem.
It returns Gramian blocks (one per differentiated leaf with ``per_leaf=True``, else their
sum; ``None`` for a zero block) whose rows are in the order the backend found cheapest:

* ``"output"``: the ``m`` output rows in the output's order;
* ``"sample_major"``: ``(b, k)``, sample by sample (``[B, K]`` flattened);
* ``"row_major"``: ``(k, b)``, row ``k`` of every sample, then row ``k + 1`` (the structured
  backend's backward directions).

The sink (``_core.sink``) alone turns them into what the call returns: output order,
symmetrisation of a block computed column by column (``symmetric=False``), dtype and the
``S + S`` shape. ``rows`` (the output rows, when the backend saw them for free) and
``pullback`` (``w ↦ Jᵀ w`` from what the backend kept, ``w`` in the backend's row order) are
translated by the sink too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import Tensor

RowOrder = Literal["output", "sample_major", "row_major"]
"""The order of a backend's rows (NOTE [backend results])."""

Pullback = Callable[[Tensor], tuple[Tensor, ...]]
"""``w ↦ Jᵀ w``: weights ``[m]`` in the backend's row order → one gradient per leaf."""

NO_AUX: Any = object()
"""``aux`` of a backend that did not evaluate ``f`` on the full batch."""


@dataclass
class RunReport:
    """What a backend really did, for ``torchgram.explain(..., run=True)`` and tests.

    Attributes:
        backend: The backend that produced the result.
        way: How it ran, in its own words (e.g. ``"per-sample vmap"``, ``"batched"``).
        attempts: ``(backend, why it could not run)`` for each candidate ``auto`` gave up on.
        jacobian_blocks: ``(rows, columns)`` of every Jacobian block the backend assembled.
        row_chunks: ``(rows, bytes)`` of every transient chunk of per-row gradients.
        pushes: ``ntvp``: ``(rows, bytes of vjps, bytes of pushed outputs)`` of every
            forward-mode push.
        peak_frontier: The largest number of live row-Jacobian entries during a graph walk.
        looped_nodes: Graph walks: node types ``vmap`` could not run, called once per row
            instead, with the number of failed ``vmap`` attempts (once per type).
        leaf_ways: For the structured backend, how each leaf's block was computed.
        notes: Anything else worth telling (fallbacks, retries).
    """

    backend: str
    way: str = ""
    attempts: list[tuple[str, str]] = field(default_factory=list)
    jacobian_blocks: list[tuple[int, int]] = field(default_factory=list)
    row_chunks: list[tuple[int, int]] = field(default_factory=list)
    pushes: list[tuple[int, int, int]] = field(default_factory=list)
    peak_frontier: int = 0
    looped_nodes: dict[str, int] = field(default_factory=dict)
    leaf_ways: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class BackendResult:
    """A backend's answer (NOTE [backend results]).

    Attributes:
        blocks: The Gramian blocks ``[m, m]`` (``[m]`` with ``diagonal``), one per leaf with
            ``per_leaf``, else one; ``None`` for a zero block.
        row_order: The order of their rows.
        symmetric: ``False`` when a block is only symmetric up to round-off (the sink
            averages it with its transpose).
        aux: ``f``'s aux on the full batch, or :data:`NO_AUX`.
        rows: ``f``'s output rows ``[m]`` in ``row_order`` (detached), when seen for free.
        pullback: ``w ↦ Jᵀ w`` from what the backend kept, when cheap.
        report: What the backend did.
    """

    blocks: tuple[Tensor | None, ...]
    report: RunReport
    row_order: RowOrder = "output"
    symmetric: bool = True
    aux: Any = NO_AUX
    rows: Tensor | None = None
    pullback: Pullback | None = None
