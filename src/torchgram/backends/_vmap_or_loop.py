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
"""

from __future__ import annotations

from collections.abc import Callable

from torchgram._core.errors import BackendCannotRun, NotPerSample, OutputChanged
from torchgram._core.problem import Problem
from torchgram._core.result import BackendResult


def vmap_or_loop(run: Callable[[bool], BackendResult], *, loop: bool) -> BackendResult:
    """``run(loop=False)``, or ``run(loop=True)`` when that fails (or when ``loop``)."""
    if loop:
        return run(True)
    try:
        return run(False)
    except (BackendCannotRun, OutputChanged, NotPerSample):
        raise
    except Exception as error:  # noqa: BLE001 -- any vmap failure: loop instead
        result = run(True)
        text = str(error).strip()
        first_line = text.splitlines()[0][:120] if text else ""
        result.report.notes.append(f"vmap failed ({type(error).__name__}: {first_line}); "
                                   "redone with loops")
        return result


def per_sample_or_batch(problem: Problem,
                        run: Callable[[bool, bool], BackendResult]) -> BackendResult:
    """``run(loop, per_sample)`` under :func:`vmap_or_loop`, per sample where it holds.

    Per sample with ``batch_dim``; the rows of the whole batch without it, or where the
    per-sample way does not hold (NOTE [per-sample]: the same matrix).
    """
    loop = problem.loops_only
    if problem.batch is None:
        return vmap_or_loop(lambda loop: run(loop, False), loop=loop)
    try:
        return vmap_or_loop(lambda loop: run(loop, True), loop=loop)
    except NotPerSample as why:
        result = vmap_or_loop(lambda loop: run(loop, False), loop=loop)
        result.report.notes.append(f"per-sample evaluation does not hold ({why.reason}): "
                                   "rows of the whole batch instead")
        return result
