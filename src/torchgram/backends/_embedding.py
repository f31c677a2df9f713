"""Embedding lookups whose derivatives agree in every mode: NOTE [embedding conventions].

# NOTE [embedding conventions]
``F.embedding``'s reverse-mode derivative follows two conventions that are not derivatives
of the lookup: no gradient reaches the ``padding_idx`` row from the positions that hold it,
and with ``scale_grad_by_freq`` the gradient of row ``v`` is divided by the number of
times ``v`` appears in the call's index tensor. Its forward-mode derivative (``ntvp``'s jvp)
follows neither, and torch's batching rule for a per-sample weight (``vmap``) zeroes the
padding row of the first sample only. So wherever torchgram differentiates a lookup in
those modes, the call is rewritten into a plain lookup whose conventions are written out:

    out = embedding(index, W)                                   (same values)
    out = where(index == padding_idx, out.detach(), out)         (no derivative there)
    out = out.detach() + (out - out.detach()) / count[index]     (1/count derivative)

which has the same value and, in every mode, the derivative reverse mode defines (the one
``torch.func.jacrev`` and the oracle use). With ``max_norm`` the rows are first
renormalised in place, as ``F.embedding`` does (on copies of the user's table: NOTE
[probing]).

The rewrite holds at every order of differentiation, where torch's own lookup does not: its
forward-mode derivative ignores both conventions at an outer ``torch.func.jvp`` too, and the
derivative of its backward (double backward) ignores ``scale_grad_by_freq``. So where the
Gramian is differentiated again, the written-out lookup's derivatives are not torch's (a
compose hunt of session 25, relative errors): ``ntvp`` under ``jvp`` 0.1-0.8 off (either
convention) and under ``grad`` 0.01-0.24 (``scale_grad_by_freq``), ``structured`` with
``create_graph`` and ``scale_grad_by_freq`` 0.016; ``vmap`` alone, and ``padding_idx`` under
reverse mode, are right. Those backends then decline there (``BackendCannotRun``, naming
``jacobian``, which runs torch's own lookup and agrees with the oracle):
:func:`checked_conventions`. Which conventions a run wrote out is collected as it goes
(:func:`collected_conventions`), so a data-dependent ``f`` is judged on what it did.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from torchgram._core.errors import BackendCannotRun
from torchgram._core.problem import Problem

_SIGNATURE = inspect.signature(F.embedding)

_WRITTEN: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "torchgram_embedding_conventions_written", default=None)
"""The conventions the lookups of the current run wrote out (``None``: nobody collects)."""


@contextlib.contextmanager
def collected_conventions() -> Iterator[set[str]]:
    """The conventions (``"padding_idx"``, ``"scale_grad_by_freq"``) written out meanwhile.

    Inside another such block, its set (``auto`` collects over its planning and every
    backend it runs: a planned forward counts for the run that reuses it).
    """
    written = _WRITTEN.get()
    if written is not None:
        yield written
        return
    written = set()
    token = _WRITTEN.set(written)
    try:
        yield written
    finally:
        _WRITTEN.reset(token)


def embedding_with_conventions(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``F.embedding(*args, **kwargs)`` written out (NOTE above), or ``NotImplemented``.

    Example:
        >>> W = torch.randn(5, 2, requires_grad=True)
        >>> index = torch.tensor([0, 3, 3])
        >>> out = embedding_with_conventions((index, W), {"padding_idx": 0})
        >>> torch.equal(out, F.embedding(index, W, padding_idx=0))
        True
        >>> out.sum().backward(); W.grad[0]
        tensor([0., 0.])
    """
    try:
        bound = _SIGNATURE.bind(*args, **kwargs)
    except TypeError:
        return NotImplemented
    a = bound.arguments
    padding_idx = a.get("padding_idx")
    by_freq = a.get("scale_grad_by_freq", False)
    index, weight = a["input"], a["weight"]
    if (padding_idx is None and not by_freq) or a.get("sparse", False) \
            or not isinstance(weight, Tensor):
        return NotImplemented
    max_norm = a.get("max_norm")
    if max_norm is not None:  # what F.embedding does first: rows renormalised in place
        with torch.no_grad():
            torch.embedding_renorm_(weight.detach(), index.contiguous(), max_norm,
                                    a.get("norm_type", 2.0))
    out = F.embedding(index, weight)
    written = _WRITTEN.get()
    if written is not None:
        written.update(name for name, on in (("padding_idx", padding_idx is not None),
                                             ("scale_grad_by_freq", bool(by_freq))) if on)
    if padding_idx is not None:
        padding = (index == padding_idx % weight.shape[0]).unsqueeze(-1)
        out = torch.where(padding, out.detach(), out)
    if by_freq:
        counts = torch.bincount(index.reshape(-1), minlength=weight.shape[0])[index]
        scale = (1.0 / counts.to(out.dtype)).unsqueeze(-1)
        out = out.detach() + (out - out.detach()) * scale
    return out


class EmbeddingConventions(TorchFunctionMode):
    """Runs every ``F.embedding`` call as :func:`embedding_with_conventions`."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.embedding:
            result = embedding_with_conventions(args, kwargs)
            if result is not NotImplemented:
                return result
        return func(*args, **kwargs)


def _mismatch(problem: Problem, written: set[str]) -> str | None:
    """The written-out conventions whose higher derivatives differ from torch's here, if any.

    Under ``jvp`` both (torch's forward mode follows neither); where reverse mode
    differentiates again (``grad``, ``create_graph``), ``scale_grad_by_freq`` (torch's double
    backward ignores it, its backward keeps ``padding_idx``).
    """
    composition = problem.composition
    if "jvp" in composition.transforms:
        found = written
    elif "grad" in composition.transforms or composition.create_graph:
        found = written & {"scale_grad_by_freq"}
    else:
        return None
    return " and ".join(sorted(found)) or None


@contextlib.contextmanager
def checked_conventions(problem: Problem, backend: str, *, write_out: bool) -> Iterator[None]:
    """A backend's run, its written-out lookups checked afterwards (NOTE above).

    ``write_out``: run every ``F.embedding`` call as :func:`embedding_with_conventions`
    (:class:`EmbeddingConventions`); the structured backend's taps write out their own.
    Raises ``BackendCannotRun`` after the run where a convention written out has other
    higher derivatives than torch's (:func:`_mismatch`).
    """
    rewrite = EmbeddingConventions() if write_out else contextlib.nullcontext()
    with collected_conventions() as written, rewrite:
        yield
    mismatch = _mismatch(problem, written)
    if mismatch is not None:
        raise _declined(problem, backend, mismatch)


def _declined(problem: Problem, backend: str, conventions: str) -> BackendCannotRun:
    return BackendCannotRun(
        problem.api, backend, "a Gramian that is not differentiated again where f looks up "
        f"an embedding with {conventions} (the derivatives torch gives such a lookup beyond "
        "the first differ from the conventions written out here)",
        f"such a lookup {problem.composition.describe()}", ("jacobian",),
        "It differentiates the lookup with torch's own derivatives.")
