"""Vectorized first, loops if ``vmap`` cannot: NOTE [vmap or loop].

# NOTE [vmap or loop]
Backends run rows' vjps (and, with ``batch_dim``, single-sample passes, and ``ntvp``'s
forward pushes) under ``vmap``, which fails on functions it cannot batch: a custom
``autograd.Function`` without vmap support, data-dependent control flow, ops without a
batching rule. Then the whole computation is redone with plain loops (what
``chunk_size=1`` does), which need only autograd: slower, always exact. An error the loops
raise too is the function's own, or a declared inability (``BackendCannotRun``), and
reaches the caller as it is.

A batching rule can also be wrong without raising (NOTE [wrong batching rules]): the
vectorized run refuses, as soon as ``f`` calls one of those functions, with
:class:`WrongBatchingRule`, and the loops run instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.overrides import TorchFunctionMode

from torchgram._core import _torch_compat
from torchgram._core.errors import BackendCannotRun, OutputChanged
from torchgram._core.result import BackendResult


class WrongBatchingRule(RuntimeError):
    """``f`` calls a function whose backward ``vmap`` computes wrongly: loop instead."""


class _RefuseWrongBatchingRules(TorchFunctionMode):
    """Raises :class:`WrongBatchingRule` at a call of a function listed by ``_torch_compat``."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        name = _torch_compat.has_wrong_batched_backward(func)
        if name is not None:
            raise WrongBatchingRule(f"torch.{name}: its backward's batching rule is wrong in "
                                    "this torch (NOTE [wrong batching rules])")
        return func(*args, **(kwargs or {}))


def vmap_or_loop(run: Callable[[bool], BackendResult], *, loop: bool,
                 batched_backward: bool = True) -> BackendResult:
    """``run(loop=False)``, or ``run(loop=True)`` when that fails (or when ``loop``).

    ``batched_backward``: whether the vectorized run vmaps over the vjps of rows with ``f``'s
    own inputs unbatched; it then refuses the functions of NOTE [wrong batching rules].
    """
    if loop:
        return run(True)
    try:
        if not batched_backward:
            return run(False)
        with _RefuseWrongBatchingRules():
            return run(False)
    except (BackendCannotRun, OutputChanged):
        raise
    except Exception as error:  # noqa: BLE001 -- any vmap failure: loop instead
        result = run(True)
        text = str(error).strip()
        first_line = text.splitlines()[0][:120] if text else ""
        result.report.notes.append(f"vmap failed ({type(error).__name__}: {first_line}); "
                                   "redone with loops")
        return result
