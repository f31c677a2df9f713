"""Gramian backends: one module each, all producing per-leaf blocks (DESIGN.md §2).

A backend is a function ``backend(problem, sink) -> aux``: it evaluates the problem's
function, adds every leaf's Gramian contribution to the :class:`GramSink`, and returns the
aux output of ``f`` (or :data:`NO_AUX` when it did not evaluate ``f`` on the full batch, in
which case the caller computes aux with one gradient-free forward).
"""

from torchgram.backends._registry import NO_AUX, Backend, backend_names, get_backend, register

__all__ = ["NO_AUX", "Backend", "backend_names", "get_backend", "register"]
