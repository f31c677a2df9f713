"""Whether a backend's ``vmap`` failure declines instead of looping.

NOTE [vmap failures remembered]: ``auto`` sets it around its candidates; every public call
clears it for itself.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_DECLINING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "torchgram_vmap_failures_declined", default=False)


@contextlib.contextmanager
def vmap_failures_declined(declined: bool = True) -> Iterator[None]:
    """Inside: a backend whose ``vmap`` fails declines instead of looping.

    It raises ``VmapFailed``, for ``auto`` to rank its candidates again; with
    ``declined=False``, not (a torchgram call inside ``f``: every public call decides for
    itself).
    """
    token = _DECLINING.set(declined)
    try:
        yield
    finally:
        _DECLINING.reset(token)


def vmap_failures_declined_now() -> bool:
    """Whether a ``vmap`` failure declines here (:func:`vmap_failures_declined`)."""
    return _DECLINING.get()
