"""The table of backends, filled by each backend module when it is imported."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol

from torchgram._problem import GramianProblem
from torchgram.backends._sink import GramSink

NO_AUX: Any = object()
"""Returned by a backend that did not evaluate ``f`` on the full batch (see ``full_aux``)."""


class Backend(Protocol):
    """Computes the per-leaf Gramian blocks of a problem into a sink; returns aux."""

    def __call__(self, problem: GramianProblem, sink: GramSink, /) -> Any: ...


_BACKENDS: dict[str, Backend] = {}
# Modules that register backends; imported lazily so `import torchgram` stays light.
_MODULES = ("torchgram.backends.jacobian", "torchgram.backends.auto", "torchgram.backends.ntvp",
            "torchgram.backends.graph", "torchgram.backends.structured")


def register(name: str) -> Callable[[Backend], Backend]:
    """Decorator registering a backend under ``name``."""

    def decorate(backend: Backend) -> Backend:
        _BACKENDS[name] = backend
        return backend

    return decorate


def _load() -> None:
    for module in _MODULES:
        importlib.import_module(module)


def backend_names() -> tuple[str, ...]:
    """The valid backend names, ``"auto"`` first."""
    _load()
    return ("auto", *sorted(name for name in _BACKENDS if name != "auto"))


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``."""
    _load()
    return _BACKENDS[name]
