"""``backend="auto"``: pick a backend from the problem's shapes, without trial runs."""

from __future__ import annotations

from typing import Any

from torchgram._problem import GramianProblem
from torchgram.backends._registry import get_backend, register
from torchgram.backends._sink import GramSink


def choose_backend(problem: GramianProblem) -> str:
    """The backend ``auto`` uses for ``problem`` (``jacobian`` is the only one so far)."""
    del problem
    return "jacobian"


@register("auto")
def auto_backend(problem: GramianProblem, sink: GramSink) -> Any:
    """Run the backend chosen by :func:`choose_backend`."""
    return get_backend(choose_backend(problem))(problem, sink)
