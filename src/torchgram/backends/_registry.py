"""The table of backends, filled by each backend module when it is imported."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from torchgram._core.cross import CrossProblem, CrossResult
from torchgram._core.errors import BackendCannotRun, torch_refusals
from torchgram._core.options import BACKEND_NAMES
from torchgram._core.problem import Problem
from torchgram._core.result import BackendResult


class Backend(Protocol):
    """Computes a problem's Gramian blocks (NOTE [backend results])."""

    def __call__(self, problem: Problem, /) -> BackendResult: ...


class CrossBackend(Protocol):
    """Computes the kernel blocks of a cross problem (NOTE [cross kernels])."""

    def __call__(self, problem: CrossProblem, /) -> CrossResult: ...


_LOADED: set[str] = set()
_BACKENDS: dict[str, Backend] = {}
_CROSS: dict[str, CrossBackend] = {}
# Modules that register backends; imported lazily so `import torchgram` stays light.
_MODULES = ("torchgram.backends.jacobian", "torchgram.backends.auto", "torchgram.backends.ntvp",
            "torchgram.backends.graph", "torchgram.backends.structured",
            "torchgram.backends.cross")


def register(name: str) -> Callable[[Backend], Backend]:
    """Decorator registering a backend under ``name`` (one of ``BackendName``)."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown backend name {name!r}: add it to BackendName first")

    def decorate(backend: Backend) -> Backend:
        def guarded(problem: Problem) -> BackendResult:  # NOTE [old-style autograd.Functions]
            with torch_refusals(problem.api, name, problem.diff.leaves,
                                differentiates=problem.differentiates):
                return backend(problem)

        _BACKENDS[name] = guarded
        return backend

    return decorate


def register_cross(name: str) -> Callable[[CrossBackend], CrossBackend]:
    """Decorator registering backend ``name``'s kernels between two input sets."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown backend name {name!r}: add it to BackendName first")

    def decorate(backend: CrossBackend) -> CrossBackend:
        def guarded(problem: CrossProblem) -> CrossResult:  # NOTE [old-style autograd.Functions]
            with torch_refusals(problem.left.api, name, problem.left.diff.leaves,
                                cross=any(right is not None for right in problem.rights),
                                differentiates=problem.left.differentiates):
                return backend(problem)

        _CROSS[name] = guarded
        return backend

    return decorate


def _load() -> None:
    if len(_LOADED) < len(_MODULES):  # once: import_module costs ~5 µs even when imported
        for module in _MODULES:
            importlib.import_module(module)
            _LOADED.add(module)


def backend_names() -> tuple[str, ...]:
    """The valid backend names, ``"auto"`` first.

    Example:
        >>> backend_names()
        ('auto', 'graph', 'jacobian', 'ntvp', 'structured')
    """
    _load()
    return ("auto", *sorted(name for name in _BACKENDS if name != "auto"))


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``."""
    _load()
    return _BACKENDS[name]


def get_cross_backend(name: str) -> CrossBackend:
    """The cross-kernel implementation of backend ``name`` (NOTE [cross kernels])."""
    _load()
    return _CROSS[name]


Result = TypeVar("Result", BackendResult, CrossResult)


def first_that_runs(order: Sequence[str], run: Callable[[str], Result],
                    attempts: list[tuple[str, str]] | None = None) -> Result:
    """``run(name)`` for the names of ``order`` until one does not declare it cannot run.

    The declined names and their reasons (after ``attempts``, declined earlier) go first in
    the result's ``report.attempts``; the last name's inability reaches the caller.
    """
    attempts = [] if attempts is None else attempts
    fixes: list[str] = []
    for name in order:
        try:
            result = run(name)
        except BackendCannotRun as error:
            attempts.append((name, error.reason))
            if error.fix and error.fix not in fixes:
                fixes.append(error.fix)
            if name == order[-1]:
                if (exhausted := _every_one_declined(error, attempts, fixes)) is not None:
                    raise exhausted from error
                raise
            continue
        result.report.attempts[:0] = attempts
        return result
    raise AssertionError("unreachable: the last candidate either returns or raises")


def _every_one_declined(last: BackendCannotRun, attempts: list[tuple[str, str]],
                        fixes: list[str]) -> BackendCannotRun | None:
    """The error for candidates that all declined, where the last one's advice is among them.

    NOTE [declared inability]: each backend's refusal names the backends that can; when
    ``auto`` has tried every one of those already, passing the last refusal on as it is would
    send the user in a circle. This error names only what was not tried, and says why each
    tried backend declined. ``None`` where the last refusal names a backend not tried, or
    none (it then says itself that no backend can, and what to do).
    """
    tried = {name for name, _ in attempts}
    if not last.alternatives or not set(last.alternatives) <= tried:
        return None  # it names none (its own advice stands), or one not tried
    reasons = "; ".join(f"{name!r}: {reason}" for name, reason in attempts)
    return BackendCannotRun(
        last.api, "auto", "f that one of its candidates can run",
        f"a refusal from each of them ({reasons})",
        tuple(name for name in last.alternatives if name not in tried),
        " ".join(["No backend can compute this exactly as called: see each refusal's reason "
                  "(each backend chosen explicitly says what it needs).", *fixes]))
