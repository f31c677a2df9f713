"""No collective inside ``f``: the local work of a data-parallel call must not communicate.

# NOTE [no collectives in f]
Every rank evaluates ``f`` as often as *its* plan needs (a probe, a trace, a batched or
per-sample pass, checks), and plans differ between ranks (a cached probe here, a sample
that fails alone there). A collective inside ``f`` (``SyncBatchNorm`` in training mode, a
tensor-parallel layer) would then be entered a different number of times on different
ranks and hang them. So the local phase runs under :class:`NoCollectives`, a
``TorchDispatchMode`` that sees the ``c10d`` ops every ``torch.distributed`` collective
dispatches and raises :class:`CollectiveInF` *before* the collective starts: the rank's
error is then shared with the others at the next agreement (NOTE [plan agreement]) and
every rank raises it, none hangs.
"""

from __future__ import annotations

from typing import Any

from torchgram._core._torch_compat import COLLECTIVE_NAMESPACES, TorchDispatchMode


class CollectiveInF(RuntimeError):  # noqa: N818 -- reads as a statement
    """``f`` called a ``torch.distributed`` collective during the local phase."""

    def __init__(self, op: str) -> None:
        super().__init__(op)
        self.op = op


class NoCollectives(TorchDispatchMode):
    """Raise :class:`CollectiveInF` at the first ``c10d`` op (NOTE [no collectives in f])."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if getattr(func, "namespace", None) in COLLECTIVE_NAMESPACES:
            raise CollectiveInF(str(func))
        return func(*args, **(kwargs or {}))
