"""Gramian backends, one module (or package) each (DESIGN.md §2).

A backend is a pure function ``problem -> BackendResult`` (NOTE [backend results] in
``torchgram._core.result``): it evaluates the problem's function, and returns per-leaf
blocks in its own row order, ``f``'s aux when it evaluated the whole batch, and optionally
a pullback; it writes nothing into the problem. Choose one with ``tg.gramian(...,
backend=name)``; :func:`backend_names` lists them. The modules' docstrings are the design
notes of each backend; their functions are internal and may change between releases.
"""

from torchgram.backends._registry import Backend, backend_names, get_backend, register

__all__ = ["Backend", "backend_names", "get_backend", "register"]
