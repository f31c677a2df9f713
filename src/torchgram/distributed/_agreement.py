"""What every rank found locally, and the one plan all ranks then follow.

# NOTE [plan agreement]
A data-parallel call has two phases. In the **local phase** every rank runs the
structured pass on its own samples (NOTE [payloads]) with no collective at all (NOTE [no
collectives in f]): how it runs ``f`` there (batched, ``vmap``, a loop, the rows of the
whole batch after a failed check, a trace mismatch, all-fallback) is its own business, since
nothing it does can wait on another rank. Each rank then describes what it holds in a
small :class:`RankSummary` (its sample count, output structure, and per leaf the shapes of
its factors and of its Jacobian, or its error), and one ``all_gather_object`` gives every
rank every summary. From them, :func:`agree` computes the same :class:`Agreement`
everywhere — a pure function of the gathered summaries, so no rank can take another road:

* **an error anywhere is raised everywhere** (the failing rank raises its own exception,
  the others the same type naming that rank); nothing has been exchanged yet, so no rank
  is left waiting;
* **rows**: ``"samples"`` when every rank with samples ran the per-sample pass (the
  global rows are ``(k, b)`` over all ranks' samples in rank order); ``"ranks"`` when any
  rank needed the rows of its whole batch (``f`` draws random numbers; or no
  ``batch_dim``): every rank is then one "sample" of its own rows, padded to the largest
  count — the most conservative plan wins, and every leaf travels as a Jacobian when the
  two kinds of ranks meet;
* **per leaf**, the payload every rank sends: its **factors** when every rank holding
  the leaf has factors of one structure (the same uses, widths and groups; positions may
  differ and are zero-padded) and they are smaller in all than the per-sample Jacobians,
  else the **Jacobian** (always possible); a leaf no rank reaches sends nothing;
* **owners**: each leaf's block is formed by one rank holding it, leaves given in
  decreasing estimated cost to the least loaded rank (ties to the lower rank).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import optree

from torchgram._core.checks import fail

Mode = Literal["samples", "ranks", "empty"]
Alone = Literal["checked", "coupled", "unchecked"]
PayloadKind = Literal["factors", "jacobian", "zero"]

_ERRORS: dict[str, type[Exception]] = {
    error.__name__: error
    for error in (ValueError, TypeError, RuntimeError, NotImplementedError, KeyError,
                  IndexError)
}


@dataclass(frozen=True)
class TensorDesc:
    """Shape and dtype of one tensor of a payload (``dtype`` as ``str(torch.dtype)``)."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        """Its bytes on the wire (8-byte aligned)."""
        size = math.prod(self.shape) * _itemsize(self.dtype)
        return -(-size // 8) * 8


def _itemsize(dtype: str) -> int:
    return {"torch.float64": 8, "torch.int64": 8, "torch.float32": 4, "torch.int32": 4,
            "torch.float16": 2, "torch.bfloat16": 2, "torch.int16": 2}.get(dtype, 8)


@dataclass(frozen=True)
class LeafSummary:
    """One rank's payloads of one leaf.

    Attributes:
        zero: The rank's rows do not reach the leaf.
        signature: The structure of its factors, without sample, row and position counts
            (``None``: no factors, only a Jacobian).
        factors: The factor tensors, in the order they travel.
        jacobian: The per-row Jacobian ``[R, B, P]``.
        cost: Estimated multiply-adds of the contraction on this rank's samples alone.
    """

    zero: bool
    signature: tuple[Any, ...] | None = None
    factors: tuple[TensorDesc, ...] = ()
    jacobian: TensorDesc | None = None

    @property
    def factor_bytes(self) -> int:
        """Bytes of the factors."""
        return sum(desc.nbytes for desc in self.factors)

    @property
    def jacobian_bytes(self) -> int:
        """Bytes of the Jacobian."""
        return 0 if self.jacobian is None else self.jacobian.nbytes


@dataclass(frozen=True)
class OutputDesc:
    """``f``'s output structure on one rank (shapes of one sample with ``batch_dim``)."""

    treespec: optree.PyTreeSpec
    shapes: tuple[tuple[int, ...], ...]
    batch_dims: tuple[int, ...] | None
    dtypes: tuple[str, ...]
    dtype: str


@dataclass(frozen=True)
class RankSummary:
    """What one rank holds after its local phase (NOTE [plan agreement]).

    Attributes:
        error: ``(exception type name, message)`` if the local phase failed.
        mode: ``"samples"`` (per-sample payloads), ``"ranks"`` (rows of the whole batch) or
            ``"empty"`` (no rows).
        samples: ``B`` of this rank (``1`` in ``"ranks"`` mode, ``0`` when empty).
        rows: ``R``: rows per sample (``m`` in ``"ranks"`` mode).
        batch: This rank's number of samples along ``batch_dim`` (``None`` without it).
        output: Its output structure (``None`` when it could not run ``f``).
        leaves: One summary per differentiated leaf.
        alone: With one sample, whether another sample moved its outputs (``"coupled"``)
            or could not be made (``"unchecked"``), NOTE [one sample per rank].
    """

    error: tuple[str, str] | None
    mode: Mode
    samples: int = 0
    rows: int = 0
    batch: int | None = None
    output: OutputDesc | None = None
    leaves: tuple[LeafSummary, ...] = ()
    alone: Alone = "checked"


@dataclass(frozen=True)
class LeafAgreement:
    """How one leaf travels: its payload kind, the ranks that send it and its owner."""

    kind: PayloadKind
    owner: int | None = None
    sources: tuple[int, ...] = ()


@dataclass(frozen=True)
class Agreement:
    """The plan every rank follows (NOTE [plan agreement]).

    Attributes:
        mode: ``"samples"`` or ``"ranks"``.
        sizes: Per rank, its samples (``"samples"``) or rows (``"ranks"``); 0 when empty.
        batches: Per rank, its samples along ``batch_dim`` (``None`` without it).
        rows: ``R``: rows per sample, or the largest row count of a rank (``"ranks"``).
        leaves: One :class:`LeafAgreement` per differentiated leaf.
        output: The output structure (of the first rank with rows).
        convert: Whether some rank ran per-sample and must send rows of its whole batch.
    """

    mode: Literal["samples", "ranks"]
    sizes: tuple[int, ...]
    batches: tuple[int | None, ...]
    rows: int
    leaves: tuple[LeafAgreement, ...]
    output: OutputDesc
    convert: bool

    @property
    def total(self) -> int:
        """The number of "samples" of the exchange's layout (``B`` of all ranks, or ranks)."""
        return sum(self.sizes) if self.mode == "samples" else len(self.sizes)

    def offset(self, rank: int) -> int:
        """The first sample (``"samples"``) of ``rank`` in the layout, or its index."""
        return sum(self.sizes[:rank]) if self.mode == "samples" else rank


def raise_any_error(api: str, errors: Sequence[tuple[str, str] | None], rank: int,
                    own: BaseException | None) -> None:
    """Raise the first failing rank's error on every rank (its own exception where it failed).

    ``errors``: every rank's error (its type's name and text) or ``None``, as gathered.
    """
    for source, described in enumerate(errors):
        if described is None:
            continue
        if own is not None:
            raise own
        name, text = described
        error = _ERRORS.get(name, RuntimeError)
        raise error(f"{api}: rank {source} of the group failed, and so every rank stops "
                    f"(rank {rank} here): {name}: {text}")


def fail_together(api: str, group: Any, own: BaseException | None) -> None:
    """Share each rank's outcome (one ``all_gather_object``); raise the first failure on all.

    ``group``: the :class:`~torchgram.distributed._group.Group`; ``own``: this rank's error,
    or ``None``. Called before a collective that a failed rank would never enter (NOTE [local
    steps fail together] in ``_api.py``).
    """
    errors = group.all_gather_object(None if own is None else (type(own).__name__, str(own)))
    raise_any_error(api, errors, group.rank, own)


def agree(api: str, summaries: list[RankSummary], *, force_jacobian: bool) -> Agreement:
    """The plan of every rank, from every rank's summary (NOTE [plan agreement])."""
    active = [r for r, s in enumerate(summaries) if s.mode != "empty"]
    if not active:
        fail(api, "at least one rank with samples", "no rows on any rank of the group",
             "Give some rank a non-empty batch.")
    first = summaries[active[0]]
    assert first.output is not None
    _check_outputs(api, summaries, active)
    modes = {summaries[r].mode for r in active}
    mode: Literal["samples", "ranks"] = "samples" if modes == {"samples"} else "ranks"
    _check_verified(api, summaries, active)
    convert = len(modes) > 1
    if mode == "samples":
        sizes = tuple(s.samples if s.mode != "empty" else 0 for s in summaries)
        rows = first.rows
    else:
        sizes = tuple(_rank_rows(s) for s in summaries)
        rows = max(sizes)
    batches = tuple(s.batch for s in summaries)
    leaves = tuple(_leaf_agreement(summaries, active, i, force_jacobian or convert)
                   for i in range(len(first.leaves)))
    owned = _owners(summaries, leaves, rows, sum(sizes) if mode == "samples" else len(sizes))
    return Agreement(mode, sizes, batches, rows, owned, first.output, convert)


def _rank_rows(summary: RankSummary) -> int:
    if summary.mode == "empty":
        return 0
    return summary.rows * summary.samples


def _check_verified(api: str, summaries: list[RankSummary], active: list[int]) -> None:
    """Refuse samples that interact, seen by a rank holding one (NOTE [one sample per rank]).

    Also when every rank with samples holds one and some could not change its inputs: then
    nothing checked ``batch_dim``'s promise.
    """
    batches = [summaries[r].batch for r in active]
    if any(b is None for b in batches) or sum(b or 0 for b in batches) < 2:
        return
    coupled = [r for r in active if summaries[r].alone == "coupled"]
    if coupled:
        fail(api, "samples that do not interact: batch_dim promises it, and each rank sees "
             "its own samples only",
             f"another sample moves the outputs of the one sample of ranks {coupled} (checked "
             "on a batch of two): the samples interact",
             "Use batch-norm in eval mode, GroupNorm or LayerNorm, or batch_dim=None for the "
             "Gramian of the rows each rank computes.")
    unchecked = [r for r in active if summaries[r].alone == "unchecked"]
    if unchecked and all(b == 1 for b in batches):
        fail(api, "a way to check batch_dim's promise that samples do not interact",
             f"one sample on every rank, and ranks {unchecked} could not change theirs "
             "(integer inputs with a single entry per sample)",
             "Give some rank two samples or more, or pass batch_dim=None (the Gramian of the "
             "rows each rank computes).")


def _check_outputs(api: str, summaries: list[RankSummary], active: list[int]) -> None:
    first = summaries[active[0]].output
    assert first is not None
    for r in active[1:]:
        other = summaries[r].output
        assert other is not None
        if first.batch_dims is None:
            same = other.dtype == first.dtype
        else:
            same = (other.treespec, other.shapes, other.batch_dims, other.dtypes) == \
                (first.treespec, first.shapes, first.batch_dims, first.dtypes)
        if not same:
            fail(api, "every rank's f to return outputs of one structure (the same shapes "
                 "per sample, dtypes and pytree)",
                 f"rank {active[0]}: {first.shapes} {first.dtypes}, rank {r}: "
                 f"{other.shapes} {other.dtypes}",
                 "Give every rank samples of the same shape (pad sequences to one length).")


def _leaf_agreement(summaries: list[RankSummary], active: list[int], leaf: int,
                    force_jacobian: bool) -> LeafAgreement:
    held = [r for r in active if not summaries[r].leaves[leaf].zero]
    if not held:
        return LeafAgreement("zero")
    parts = [summaries[r].leaves[leaf] for r in held]
    signatures = {part.signature for part in parts}
    factored = not force_jacobian and None not in signatures and len(signatures) == 1
    if factored and sum(p.factor_bytes for p in parts) <= sum(p.jacobian_bytes for p in parts):
        return LeafAgreement("factors", sources=tuple(held))
    return LeafAgreement("jacobian", sources=tuple(held))


def _owners(summaries: list[RankSummary], leaves: tuple[LeafAgreement, ...], rows: int,
            total: int) -> tuple[LeafAgreement, ...]:
    """Give each leaf to the least loaded rank that holds it, costliest leaves first."""
    costs = []
    for i, agreed in enumerate(leaves):
        if agreed.kind == "zero":
            costs.append(0.0)
            continue
        part = summaries[agreed.sources[0]].leaves[i]
        width = math.prod(part.jacobian.shape[2:]) if part.jacobian is not None else 1
        costs.append(float(rows * total) ** 2 * width)
    load = [0.0] * len(summaries)
    owners: dict[int, int] = {}
    for i in sorted(range(len(leaves)), key=lambda j: (-costs[j], j)):
        agreed = leaves[i]
        if agreed.kind == "zero":
            continue
        owner = min(agreed.sources, key=lambda r: (load[r], r))
        owners[i] = owner
        load[owner] += costs[i]
    return tuple(LeafAgreement(agreed.kind, owners.get(i), agreed.sources)
                 for i, agreed in enumerate(leaves))
