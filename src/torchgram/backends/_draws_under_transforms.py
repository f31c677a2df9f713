"""Backends that evaluate ``f`` inside ``torch.func`` transforms refuse functions that draw.

# NOTE [draws under torch.func]
The call's Gramian is that of ``f`` with the random numbers of one plain call (NOTE [one
draw]): every evaluation restores the generators, so it draws the same numbers. That is not
enough inside ``torch.func.vjp``/``jvp``: ``F.dropout`` lays its Bernoulli mask out along its
input's strides, and under the transforms' wrappers an op's output can have other strides
than in a plain call (``batch_norm`` in eval mode on a transposed input does), so the same
numbers drop other entries and the backend differentiates another function, silently
(relative error up to 1 and more; found by the fuzzer, ``tests/fuzz/FINDINGS.md``). No cheap
check proves two masks equal, so the ``jacobian`` and ``ntvp`` backends refuse an ``f`` that
drew random numbers on the whole batch (per sample it already is :class:`NotPerSample`), and
``auto`` goes on with ``structured`` or ``graph``, which evaluate ``f`` plainly. For the same
reason the update ``Jᵀ w`` of ``tg.aggregated_grad``, where the backend kept no cheap
pullback, is a plain autograd backward through one evaluation of a random ``f``, not a
``torch.func.vjp`` (update hunt 3: the graph backend's update was another mask's, relative
error 0.49). The structured backend's own rewrites keep the plain call's layouts too (NOTE
[rewritten layouts]).
"""

from __future__ import annotations

from torchgram._core.errors import DRAWS_UNDER_TRANSFORMS_FIX, BackendCannotRun
from torchgram._core.problem import Problem

PLAIN_BACKENDS = ("structured", "graph")
"""The backends that evaluate ``f`` plainly (with autograd), in order of preference."""

REFUSING_BACKENDS = ("jacobian", "ntvp")
"""The backends that evaluate ``f`` inside ``torch.func`` transforms: they refuse a random
``f`` (``auto`` tries them last for one)."""


def refuse_draws(problem: Problem, backend: str) -> None:
    """Raise :class:`BackendCannotRun` if an evaluation of ``f`` by ``backend`` drew.

    Call it after the backend's first evaluation of the whole batch.
    """
    if problem.draw.random:
        under = problem.composition.transforms
        raise BackendCannotRun(
            problem.api, backend, "a function that draws no random numbers (it evaluates f "
            "inside torch.func transforms, whose wrappers can change the strides a random "
            "op lays its draws out along: F.dropout would drop other entries than in a "
            "plain call)", "an f that draws random numbers (dropout, ...)"
            + (f", called {problem.composition.describe()}" if under else ""),
            () if under else PLAIN_BACKENDS,
            DRAWS_UNDER_TRANSFORMS_FIX if under else
            "They evaluate f plainly, with the draws of one call.")


def refuse_data_assignments(problem: Problem, backend: str) -> None:
    """Raise :class:`BackendCannotRun` if ``f`` assigns its module's parameters' ``.data``.

    NOTE [data assigned to itself]: ``module.to(dtype)`` in ``f`` on the module's own
    parameters crashes the process under torch's transforms. Call it before the backend's
    first evaluation.
    """
    if problem.assigns_data:
        raise BackendCannotRun(
            problem.api, backend, "an f that leaves its tensors' .data alone under torch.func "
            "transforms (torch crashes the process there)",
            "an assignment to .data of a tensor f captured (module.to(dtype) or "
            "module.float() called in f on the module whose parameters it differentiates)",
            PLAIN_BACKENDS, "Or move the module to its dtype once, before calling torchgram.")
