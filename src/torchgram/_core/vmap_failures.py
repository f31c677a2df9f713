"""What ``vmap`` failed to batch, per call signature: NOTE [vmap failures remembered]."""

from __future__ import annotations

from collections.abc import Hashable

from torchgram._core.problem import Problem
from torchgram._core.signature import LruCache

_FAILED = LruCache[str](maxsize=128)
"""``(backend, per_sample, call signature)`` -> why ``vmap`` failed there (NOTE [vmap
failures remembered])."""


def failure_key(problem: Problem, backend: str, per_sample: bool) -> Hashable | None:
    """The key under which a failure of ``backend``'s ``vmap`` on ``problem`` is remembered."""
    signature = problem.signature
    return None if signature is None else (backend, per_sample, signature)


def known_failure(problem: Problem, backend: str) -> str | None:
    """Why ``backend``'s ``vmap`` failed on ``problem``'s call signature before, if it did.

    Either way (per sample, or rows of the batch, where the per-sample way does not hold).
    """
    signature = problem.signature
    if signature is None:
        return None
    return _FAILED.get((backend, True, signature)) or _FAILED.get((backend, False, signature))


def remembered(key: Hashable | None) -> str | None:
    """Why ``vmap`` failed under ``key`` (a :func:`failure_key`) before, if it did."""
    return _FAILED.get(key)


def remember(key: Hashable | None, error: BaseException) -> None:
    """Remember that ``vmap`` failed under ``key`` with ``error`` (the loops then ran)."""
    _FAILED.put(key, reason_of(error))


def reason_of(error: BaseException) -> str:
    """An error in one line (what a report says of a vmap failure)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:120] if text else ''}"

