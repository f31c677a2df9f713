"""The errors a computation can raise besides bad input: a backend's declared inability.

# NOTE [declared inability]
A backend that meets something it cannot compute exactly (an op without forward-mode AD
for ``ntvp``, an op without a batching rule on a ``vmap`` path, ...) never returns a wrong
matrix and never lets a raw torch error escape: it raises :class:`BackendCannotRun`, which
says what it met and which backends or options can. ``auto`` catches it and runs the next
candidate of its plan (``torchgram.explain(..., run=True)`` shows the attempts); a backend
the user chose explicitly lets it reach the user, whose message then names the fix.

:class:`OutputChanged` is internal: an evaluation of ``f`` returned an output whose
structure differs from the one the call was planned for (a cached probe gone stale); the
pipeline drops its caches and plans the call afresh, once.
"""

from __future__ import annotations

from collections.abc import Sequence

from torchgram._core.checks import message


class BackendCannotRun(NotImplementedError):  # noqa: N818 -- reads as a statement, like StopIteration
    """A backend cannot compute this Gramian exactly; other backends or options can.

    Args:
        api: The public API that was called.
        backend: The backend that cannot run.
        expected: What the backend needs.
        got: What it met instead.
        alternatives: Backends (or options) that can, in order of preference.
        fix: What the user can do, in a sentence (``alternatives`` are named before it).

    Example:
        >>> error = BackendCannotRun("torchgram.gramian", "ntvp", "forward-mode AD",
        ...                          "aten::cdist", ("jacobian", "graph"), "")
        >>> error.alternatives
        ('jacobian', 'graph')
        >>> str(error).split(", but got ")[1]
        "aten::cdist. Use backend='jacobian' or backend='graph'. "
    """

    def __init__(self, api: str, backend: str, expected: str, got: str,
                 alternatives: Sequence[str], fix: str) -> None:
        self.api = api
        self.backend = backend
        self.alternatives = tuple(alternatives)
        self.reason = got
        use = " or ".join(f"backend={name!r}" for name in self.alternatives)
        advice = (f"Use {use}. " if use else "") + fix
        super().__init__(message(api, f"{expected} (backend={backend!r})", got, advice))


class OutputChanged(RuntimeError):  # noqa: N818
    """An evaluation of ``f`` did not return the output structure the call was planned for."""


class NotPerSample(RuntimeError):  # noqa: N818
    """Evaluating ``f`` one sample at a time does not give its Gramian (NOTE [per-sample]).

    Internal: a backend's per-sample way raises it, and the backend computes the same matrix
    from the whole batch instead.

    Attributes:
        reason: What was found, for reports.
        random: Whether the reason is that ``f`` draws random numbers (as opposed to samples
            that interact, or ``f`` failing on a batch of one).
    """

    def __init__(self, reason: str, *, random: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.random = random
