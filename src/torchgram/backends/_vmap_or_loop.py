"""Vectorized first, loops if ``vmap`` cannot: NOTE [vmap or loop].

# NOTE [vmap or loop]
Backends run rows' vjps (and, with ``batch_dim``, single-sample passes, and ``ntvp``'s
forward pushes) under ``vmap``, which fails on functions it cannot batch: a custom
``autograd.Function`` without vmap support, data-dependent control flow, ops without a
batching rule. Then the whole computation is redone with plain loops (what
``chunk_size=1`` does), which need only autograd: slower, always exact. An error the loops
raise too is the function's own, or a declared inability (``BackendCannotRun``), and
reaches the caller as it is; so does :class:`NotPerSample` (NOTE [per-sample]), which the
backend answers by working on the whole batch.

# NOTE [vmap failures remembered]
Whether ``vmap`` can batch ``f`` is a property of its code (``transformers``' mask code reads
the mask's values: every BERT, GPT-2 or LLaMA), so a failure is remembered per backend, way
(per sample or rows of the batch) and call signature: later calls loop at once instead of
failing again first. ``auto`` chose the backend on an estimate that assumed ``vmap``; a
backend it runs declines at the first failure (:class:`VmapFailed`, under
:func:`vmap_failures_declined`) instead of looping, and ``auto`` ranks its candidates again
with the loops' cost (NOTE [auto cost model]). Small ``transformers`` models (hidden size 8 to
32) went to ``jacobian``, which then looped over the samples on every call: 90-130 times a
backward, against 6-7 times with ``structured`` (and ``tg.ntk``: 145 ms against 9 ms).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from torchgram._core.errors import BackendCannotRun, NotPerSample, OutputChanged
from torchgram._core.problem import Problem
from torchgram._core.result import BackendResult
from torchgram._core.vmap_declines import vmap_failures_declined, vmap_failures_declined_now
from torchgram._core.vmap_failures import failure_key, reason_of, remember, remembered
from torchgram.backends._registry import Result, first_that_runs


class VmapFailed(Exception):  # noqa: N818 -- a signal to auto, as OutputChanged
    """A backend's ``vmap`` failed where ``auto`` runs it (NOTE [vmap failures remembered]).

    Attributes:
        backend: The backend.
        reason: Why, in one line.
    """

    def __init__(self, backend: str, reason: str) -> None:
        super().__init__(f"{backend}: vmap failed ({reason})")
        self.backend = backend
        self.reason = reason


def first_that_runs_ranked_again(order: Callable[[list[VmapFailed]], tuple[str, ...]],
                                 run: Callable[[str], Result],
                                 attempts: list[tuple[str, str]]) -> Result:
    """``auto``'s candidates, each declining at a ``vmap`` failure, ranked again after one.

    NOTE [vmap failures remembered]: ``first_that_runs`` over ``order(failures)`` (the
    failures so far, whose loops' cost the ranking then knows), each candidate run under
    :func:`vmap_failures_declined`; a candidate fails once at most (it loops after, its
    failure remembered), and the last round declines nothing. The result's report notes the
    failures.
    """
    failures: list[VmapFailed] = []

    def declining(name: str) -> Result:
        try:
            with vmap_failures_declined():
                return run(name)
        except VmapFailed as failed:  # (a backend may run another's passes: ntvp's diagonal)
            raise VmapFailed(name, failed.reason) from failed

    for _ in range(_ROUNDS):
        try:
            return _noting(first_that_runs(order(failures), declining, attempts), failures)
        except VmapFailed as failed:
            failures.append(failed)
    return _noting(first_that_runs(order(failures), run, attempts), failures)


_ROUNDS = 4
"""Rounds that may decline: more than the backends that can (jacobian, ntvp)."""


def _noting(result: Result, failures: list[VmapFailed]) -> Result:
    """``result`` (a backend's or a kernel's), its report noting the ``vmap`` failures."""
    for failed in failures:
        result.report.notes.append(
            f"{failed.backend}: vmap failed ({failed.reason}); candidates ranked again with "
            "its loops' cost")
    return result


def vmap_or_loop(run: Callable[[bool], Result], *, loop: bool, backend: str = "",
                 key: Hashable | None = None) -> Result:
    """``run(loop=False)``, or ``run(loop=True)`` when that fails (or when ``loop``).

    ``key``: where the failure is remembered (NOTE [vmap failures remembered]): a known one
    loops at once. The result's report says why it looped.
    """
    if loop:
        return run(True)
    known = remembered(key)
    if known is not None:
        result = run(True)
        result.report.notes.append(f"vmap failed on this call signature before ({known}); "
                                   "loops")
        return result
    try:
        return run(False)
    except (BackendCannotRun, OutputChanged, NotPerSample):
        raise
    except Exception as error:  # noqa: BLE001 -- any vmap failure: loop instead
        reason = reason_of(error)
        if vmap_failures_declined_now() and key is not None:
            remember(key, error)
            raise VmapFailed(backend, reason) from error
        result = run(True)
        remember(key, error)  # the loops ran: the failure was vmap's
        result.report.notes.append(f"vmap failed ({reason}); redone with loops")
        return result


def per_sample_or_batch(problem: Problem, backend: str,
                        run: Callable[[bool, bool], BackendResult]) -> BackendResult:
    """``run(loop, per_sample)`` under :func:`vmap_or_loop`, per sample where it holds.

    Per sample with ``batch_dim``; the rows of the whole batch without it, or where the
    per-sample way does not hold (NOTE [per-sample]: the same matrix).
    """
    loop = problem.loops_only

    def way(per_sample: bool) -> BackendResult:
        return vmap_or_loop(lambda loop: run(loop, per_sample), loop=loop, backend=backend,
                            key=failure_key(problem, backend, per_sample))

    if problem.batch is None:
        return way(False)
    try:
        return way(True)
    except NotPerSample as why:
        result = way(False)
        result.report.notes.append(f"per-sample evaluation does not hold ({why.reason}): "
                                   "rows of the whole batch instead")
        return result
