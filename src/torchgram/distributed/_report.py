"""What a data-parallel call exchanged: per leaf its payload kind, owner and bytes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LeafExchange:
    """How one leaf travelled.

    Attributes:
        leaf: The leaf's index among the differentiated leaves.
        kind: ``"factors"`` (ghost factors), ``"jacobian"`` (per-sample gradients) or
            ``"zero"`` (no rank's rows reach it).
        owner: The rank that formed its block (``None`` for a zero leaf).
        sent: Bytes each rank sent of it to the owner (0 for the owner itself).
        name: The leaf's path in the differentiated argument(s).
    """

    leaf: int
    kind: str
    owner: int | None
    sent: tuple[int, ...]
    name: str = ""


@dataclass(frozen=True)
class Exchange:
    """What a data-parallel call exchanged (``torchgram.distributed.explain``).

    Attributes:
        mode: ``"samples"`` (rows ``(k, b)`` of all ranks' samples), ``"ranks"`` (every
            rank's rows as one block: no ``batch_dim``, or a rank that needed the rows of its
            whole batch), ``"diagonal"`` (nothing but the diagonals travelled), ``"local"``
            (``cross_rank="local"``) or ``"tensor parallel"``.
        ranks: The size of the group.
        sizes: Per rank, its samples (``"samples"``) or rows.
        leaves: Per leaf, how it travelled.
        received: Bytes of payload each rank received (the ``all_to_all``).
        sent: Bytes of payload each rank sent.
        reduced: Bytes of the ``all_reduce``'d blocks (on every rank).
    """

    mode: str
    ranks: int
    sizes: tuple[int, ...]
    leaves: tuple[LeafExchange, ...]
    received: tuple[int, ...]
    sent: tuple[int, ...]
    reduced: int

    def __str__(self) -> str:
        lines = [f"torchgram.distributed: {self.ranks} ranks, rows by {self.mode}, sizes "
                 f"{list(self.sizes)}",
                 f"payload bytes received per rank {list(self.received)}, all-reduced "
                 f"{self.reduced} bytes"]
        if self.leaves:
            width = max(len(leaf.name or str(leaf.leaf)) for leaf in self.leaves)
            lines.append(f"{'leaf':<{width}}  payload   owner  bytes sent per rank")
            for leaf in self.leaves:
                owner = "-" if leaf.owner is None else str(leaf.owner)
                lines.append(f"{leaf.name or str(leaf.leaf):<{width}}  {leaf.kind:<8}  "
                             f"{owner:>5}  {list(leaf.sent)}")
        return "\n".join(lines)
