"""The structured backend's cost model: ghost or materialize, per leaf, from shapes alone.

# NOTE [structured cost model]
Counts are multiply-adds (or compared/gathered entries) for one call. ``B`` samples (``1``
without ``batch_dim``: the whole batch is one "sample"), ``R`` rows per sample (``K``, or
``m`` without ``batch_dim``), and for a use ``u``: ``T_u`` positions per sample, ``G``
groups, first/second factor widths ``w1, w2`` in the leaf's layout (``P = G·w1·w2``), one
of them the activation ``a``, the other the cotangent ``c`` (NOTE [factors]).

**Materialize** (per-row Jacobians ``[R·B, P]``, then one Gram matrix product)::

    build:  Σ_u R·B·T_u·P          (R·B·T_u·c for an embedding's scatter, a bias, a norm)
    Gram:   (R·B)²·P               (R·B·P with diagonal=True)
    memory: R·B·P entries; what the Gramian's contraction holds at once is one chunk of
            them where it takes the Gram by column chunks (:func:`held_memory`)

**Ghost** (never forms a Jacobian; sums over every ordered pair of uses ``(u, v)`` of the
leaf, which gives the cross terms of tied / reused weights)::

    factor Gram of two activations:      B²·T_u·T_v·G·a      (B²·T_u·T_v for two indices)
    factor Gram of a cotangent and one:  R·B²·T_u·T_v·G·w    (a gather for an index)
    factor Gram of two cotangents:       R²·B²·T_u·T_v·G·c
    combine and sum over positions:      R²·B²·T_u·T_v·G
    memory: the factors (R·B·T·G·c cotangents), plus row-chunked pair blocks

With ``diagonal=True`` only ``b = b'`` and ``r = r'`` are formed: ``B²`` becomes ``B``
and ``R²`` becomes ``R``. For a linear layer without positions (``T = 1``) ghost costs
``B²·(a + c)`` against ``B²·a·c`` for materialize, the known switch (``2T² < a·c`` in
private-transformers / fastDP, ``S²(D1 + D2) < D1·D2`` in curvlinops) with the real row count
and batch structure. The elementwise combine is memory-bound where the Gram products are
matrix products, so it is weighted by :data:`ELEMENTWISE_WEIGHT`.

``T_u`` counts only the positions the rows reach where the trace found others that they do
not (NOTE [dead positions]): the contraction drops those.

**Fallback** leaves (used outside any rule) get their per-row Jacobian from the same
backward (the gradient of a per-sample copy of the leaf): ``R·B·(unrecognised op cost per
sample)``, the op's cost taken as ``output entries × P / (leading dim of the leaf)``, plus
the Gram ``(R·B)²·P``.

**Sparse** (an embedding table used only by lookups): each row's Jacobian has non-zero
rows only for its sample's tokens; summing the cotangents per (row, sample, token) gives
``n ≈ B·min(ΣT, V)`` entries, and only pairs of entries with the same token meet::

    scatter R·B·ΣT·d,  pairs W·R²·Π·d  with  Π ≈ SKEW·n·(1 + n/V)   (R·n·d with diagonal=True)

(``Π`` is exact for uniform tokens, ``SKEW`` allows for frequent ones). Each pair gathers two
rows and meets them outside any matrix product: ``W =`` :data:`SPARSE_PAIR_WEIGHT`, and the
sorting and grouping cost :data:`SPARSE_FIXED` (measured on a CPU against the materialized
and ghost ways by ``benchmarks/embedding_ways.py``: sparse wins for large vocabularies, loses
for tables every sample uses whole, like position embeddings, where ``Π ≈ T·B²``).

A ghost plan needs every use of the leaf to be a weight with the same factor widths and
groups; otherwise (or with a bias use, or a fallback part) the leaf is materialized. With
``memory_budget``, a leaf whose materialized Jacobian exceeds it is ghosted when possible.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from torchgram.backends.structured.trace import Recording, UseRecord

ELEMENTWISE_WEIGHT = 4.0
"""Cost of one elementwise multiply-add relative to one inside a matrix product."""
SKEW = 2.0
"""Allowance for frequent tokens in the sparse way's pair count."""
SPARSE_FIXED = 2e6
"""Fixed cost of the sparse way beyond the other ways' (sorting and grouping the entries).

Fitted in the pipeline by ``benchmarks/embedding_ways.py`` (the value with the least regret
over its grid; with 1.5e7 before, ghost or materialize where sparse was up to 1.6 times
faster, the LSTM benchmark's ``1000 × 64`` token table at ``B = 16, T = 32`` among them)."""
SPARSE_PAIR_WEIGHT = 32.0
"""Cost of one entry of a pair of gathered rows relative to a multiply-add in a matrix product."""


Way = Literal["ghost", "materialize", "sparse", "fallback", "unused"]
"""How a leaf's block is computed (NOTE [structured cost model])."""

Force = Literal["ghost", "materialize", "sparse"]
"""A way tests may force where it is possible."""


@dataclass(frozen=True)
class Sizes:
    """The problem's row structure: ``samples`` (B) × ``rows`` per sample (R)."""

    samples: int
    rows: int
    diagonal: bool
    itemsize: int


@dataclass(frozen=True)
class LeafPlan:
    """How the structured backend handles one leaf, with its estimated cost.

    Attributes:
        leaf: The leaf's index.
        way: ``"ghost"``, ``"materialize"``, ``"sparse"`` (embedding tables),
            ``"fallback"`` (per-row Jacobian from the backward, for uses outside every rule)
            or ``"unused"``.
        uses: The recognised uses the backend contracts (tapped in the pass).
        all_uses: Every recognised use seen (for reports).
        unrecognised: Names of the calls that use the leaf outside every rule.
        ghost_cost: Estimated multiply-adds of the ghost way (``None`` when impossible).
        materialize_cost: Estimated multiply-adds of materializing (including a fallback).
        sparse_cost: Estimated multiply-adds of the sparse way (``None`` when not chosen).
        memory: Estimated bytes held for this leaf by the chosen way.
        reason: Why this way.
    """

    leaf: int
    way: Way
    uses: tuple[UseRecord, ...]
    all_uses: tuple[UseRecord, ...]
    unrecognised: tuple[str, ...]
    ghost_cost: float | None
    materialize_cost: float
    memory: float
    reason: str
    sparse_cost: float | None = None

    @property
    def cost(self) -> float:
        """Estimated multiply-adds of the chosen way."""
        if self.way == "ghost":
            assert self.ghost_cost is not None
            return self.ghost_cost
        if self.way == "sparse":
            assert self.sparse_cost is not None
            return self.sparse_cost
        return 0.0 if self.way == "unused" else self.materialize_cost


def positions(use: UseRecord) -> int:
    """``T_u`` as the cost model counts it: the positions the rows reach.

    All of them where the trace found none they do not reach (NOTE [dead positions]).
    """
    return use.shape.positions if use.live is None else max(1, use.live)


def _widths(use: UseRecord) -> tuple[int, int]:
    shape = use.shape
    return ((shape.act_width, shape.cot_width) if use.act_first
            else (shape.cot_width, shape.act_width))


def _row_factor(cots: int, rows: int, diagonal: bool) -> int:
    """Row pairs formed by a factor Gram with ``cots`` row-dependent (cotangent) sides."""
    if cots == 0:
        return 1
    return rows if cots == 1 or diagonal else rows * rows


def _factor_gram_cost(kinds: tuple[str, str], width: int, pairs: float, sizes: Sizes,
                      groups: int) -> float:
    """Cost of the Gram of two factors (``kinds`` of ``act``/``cot``/``index``)."""
    cots = kinds.count("cot")
    rows = _row_factor(cots, sizes.rows, sizes.diagonal)
    if "index" in kinds:
        return pairs * rows  # an index comparison or a gather per entry
    return pairs * rows * groups * width


def _kinds(use: UseRecord) -> tuple[str, str]:
    act = "index" if use.shape.act_is_index else "act"
    return (act, "cot") if use.act_first else ("cot", act)


def ghost_cost(uses: Sequence[UseRecord], sizes: Sizes) -> float:
    """Ghost multiply-adds over every ordered pair of uses (NOTE [structured cost model])."""
    b = sizes.samples
    b2 = b if sizes.diagonal else b * b
    total = 0.0
    for u in uses:
        for v in uses:
            pairs = b2 * positions(u) * positions(v)
            w1, w2 = _widths(u)
            ku, kv = _kinds(u), _kinds(v)
            g = u.shape.groups
            first = _factor_gram_cost((ku[0], kv[0]), w1, pairs, sizes, g)
            second = _factor_gram_cost((ku[1], kv[1]), w2, pairs, sizes, g)
            combine = ELEMENTWISE_WEIGHT * _row_factor(2, sizes.rows, sizes.diagonal) * pairs * g
            total += first + second + combine
    return total


def materialize_cost(uses: Sequence[UseRecord], numel: int, sizes: Sizes,
                     fallback_flops: float = 0.0) -> float:
    """Build the per-row Jacobians of the uses (and fallback), then one Gram product."""
    rows = sizes.samples * sizes.rows
    build = 0.0
    for use in uses:
        if use.role == "bias" or use.shape.act_is_index or use.shape.elementwise:
            build += rows * use.shape.positions * use.shape.groups * use.shape.cot_width
        else:
            build += rows * positions(use) * numel
    build += sizes.rows * sizes.samples * fallback_flops  # flops are per evaluated batch
    gram = rows * numel * (1 if sizes.diagonal else rows)
    return build + gram


def ghost_compatible(uses: Sequence[UseRecord]) -> bool:
    """Whether the uses can be combined in ghost form (weights with equal factor shapes)."""
    if not uses or any(use.role != "weight" or use.shape.elementwise for use in uses):
        return False
    first = uses[0]
    return all(_widths(use) == _widths(first) and use.shape.groups == first.shape.groups
               for use in uses)


def sparse_compatible(uses: Sequence[UseRecord]) -> bool:
    """Whether every use is a lookup in the leaf's rows (an embedding, not transposed)."""
    return bool(uses) and all(use.role == "weight" and use.shape.act_is_index and use.act_first
                              for use in uses)


def sparse_cost(uses: Sequence[UseRecord], sizes: Sizes) -> tuple[float, float]:
    """``(multiply-adds, entries held)`` of the sparse way (NOTE [structured cost model])."""
    b, r = sizes.samples, sizes.rows
    classes, dim = uses[0].shape.act_width, uses[0].shape.cot_width
    positions = sum(use.shape.positions for use in uses)
    entries = b * min(positions, classes)
    scatter = r * b * positions * dim
    if sizes.diagonal:
        return (scatter + ELEMENTWISE_WEIGHT * r * entries * dim + SPARSE_FIXED,
                float(r * entries * dim))
    pairs = SKEW * entries * (1 + entries / classes)
    return (scatter + SPARSE_PAIR_WEIGHT * r * r * pairs * dim + SPARSE_FIXED,
            float(r * entries * dim + r * r * pairs))


def ghost_memory(uses: Sequence[UseRecord], sizes: Sizes) -> float:
    """Bytes of the factors a ghost plan keeps (cotangents for every row, activations)."""
    per_row = sum(positions(use) * use.shape.groups * use.shape.cot_width for use in uses)
    acts = sum(positions(use) * use.shape.groups * use.shape.act_width
               for use in uses if not use.shape.act_is_index)
    return float(sizes.samples * (sizes.rows * per_row + acts) * sizes.itemsize)


MIN_JACOBIAN_CHUNK_BYTES = 2**20
"""The smallest bound on a chunk of a materialized Jacobian (NOTE [Gram by column chunks])."""


def held_memory(plan: LeafPlan, sizes: Sizes) -> float:
    """Bytes of per-row Jacobian the Gramian's contraction holds at once for a planned leaf.

    :attr:`LeafPlan.memory`, but one chunk of a materialized Jacobian where the contraction
    takes its Gram by column chunks: one row per sample (every row in one pass) and weights
    of one factor shape (as a ghost plan needs; NOTE [Gram by column chunks] in
    ``contraction.py``), unless the Jacobians are kept for ``Jᵀw`` (not counted here: the
    caller's). Before session 44 ``auto`` counted the whole Jacobian there too, so under a
    ``memory_budget`` it left a recurrent model's structured pass (~9 MiB of peak) for the
    jacobian backend's per-sample ``vmap`` (~36 MiB).

    Example:
        >>> sizes = Sizes(samples=16, rows=1, diagonal=False, itemsize=4)
        >>> plan = LeafPlan(0, "unused", (), (), (), None, 0.0, 0.0, "")
        >>> held_memory(plan, sizes)
        0.0
    """
    if plan.way != "materialize" or sizes.rows != 1 or not ghost_compatible(plan.uses):
        return plan.memory
    return min(plan.memory, max(float(MIN_JACOBIAN_CHUNK_BYTES), ghost_memory(plan.uses, sizes)))


def plan_leaf(leaf: int, numel: int, recording: Recording, sizes: Sizes, *,
              tap_fallback_uses: bool, memory_budget: int | None,
              force: Force | None = None) -> LeafPlan:
    """Choose ghost, materialize or fallback for one leaf (NOTE [structured cost model]).

    Args:
        leaf: The leaf's index.
        numel: Its number of entries.
        recording: The uses found by a trace or by the pass itself.
        sizes: Samples, rows per sample, diagonal, itemsize.
        tap_fallback_uses: Whether the recognised uses of a leaf that also has unrecognised
            uses are tapped (then materialized and added to the fallback part), or left to
            the fallback entirely.
        memory_budget: Bytes a materialized Jacobian may take (``None``: no cap).
        force: ``"ghost"``, ``"materialize"`` or ``"sparse"`` to override the cost model
            where that way is possible.
    """
    all_uses = tuple(recording.uses_of(leaf))
    unrecognised = tuple(recording.unrecognised.get(leaf, ()))
    fallback_flops = float(recording.unrecognised_flops.get(leaf, 0))
    mat_memory = float(sizes.samples * sizes.rows * numel * sizes.itemsize)
    if unrecognised:
        uses = all_uses if tap_fallback_uses else ()
        if not tap_fallback_uses:
            fallback_flops += sum(use.shape.forward_flops for use in all_uses)
        cost = materialize_cost(uses, numel, sizes, fallback_flops)
        return LeafPlan(leaf, "fallback", uses, all_uses, unrecognised, None, cost, mat_memory,
                        "used outside the rules in " + ", ".join(unrecognised))
    if not all_uses:
        return LeafPlan(leaf, "unused", (), (), (), None, 0.0, 0.0,
                        "not used by the traced evaluation's calls that return a floating "
                        "tensor (with batch_dim, one sample's: explain(..., run=True) shows "
                        "whether the others use it)")
    mat = materialize_cost(all_uses, numel, sizes)
    if sparse_compatible(all_uses) and force in (None, "sparse"):
        sparse, held = sparse_cost(all_uses, sizes)
        ghost = ghost_cost(all_uses, sizes)
        if force == "sparse" or sparse <= min(mat, ghost):
            return LeafPlan(leaf, "sparse", all_uses, all_uses, (), ghost, mat,
                            held * sizes.itemsize,
                            f"sparse {sparse:.3g} <= ghost {ghost:.3g}, materialize {mat:.3g}",
                            sparse)
    if not ghost_compatible(all_uses):
        why = ("a bias" if any(use.role == "bias" for use in all_uses)
               else "an elementwise scale" if any(use.shape.elementwise for use in all_uses)
               else "uses with different factor shapes")
        return LeafPlan(leaf, "materialize", all_uses, all_uses, (), None, mat, mat_memory,
                        f"{why}: per-row Jacobians are cheap or required")
    ghost = ghost_cost(all_uses, sizes)
    g_memory = ghost_memory(all_uses, sizes)
    over_budget = memory_budget is not None and mat_memory > memory_budget
    if force in ("ghost", "materialize"):
        return LeafPlan(leaf, force, all_uses, all_uses, (), ghost, mat,
                        g_memory if force == "ghost" else mat_memory, "forced")
    if ghost <= mat or over_budget:
        why = (f"materialized Jacobian ({mat_memory:.3g} B) exceeds memory_budget"
               if over_budget and ghost > mat else f"ghost {ghost:.3g} <= materialize {mat:.3g}")
        return LeafPlan(leaf, "ghost", all_uses, all_uses, (), ghost, mat, g_memory,
                        why + _dead(all_uses))
    return LeafPlan(leaf, "materialize", all_uses, all_uses, (), ghost, mat, mat_memory,
                    f"materialize {mat:.3g} < ghost {ghost:.3g}" + _dead(all_uses))


def _dead(uses: Sequence[UseRecord]) -> str:
    """What a reason says of positions the rows do not reach (NOTE [dead positions])."""
    live = [use for use in uses if use.live is not None]
    if not live:
        return ""
    reached = sum(positions(use) for use in live)
    return (f" ({reached} of {sum(use.shape.positions for use in live)} positions reach the "
            "rows)")


def plan_leaves(numels: Sequence[int], recording: Recording, sizes: Sizes, *,
                tap_fallback_uses: bool, memory_budget: int | None,
                force: Force | None = None) -> list[LeafPlan]:
    """:func:`plan_leaf` for every leaf."""
    return [plan_leaf(i, n, recording, sizes, tap_fallback_uses=tap_fallback_uses,
                      memory_budget=memory_budget, force=force) for i, n in enumerate(numels)]
