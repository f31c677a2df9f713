"""How one call composes with what surrounds it: ``torch.func`` transforms, eager autograd.

# NOTE [composition]
``torchgram.gramian`` is a function transform, and its users compose it the way they compose
``jacrev`` and ``vmap``. :func:`detect_composition` looks at the call, before dispatch, and
records in the problem (:class:`Composition`) which of three situations it is in:

* **inside torch.func transforms** (``grad``, ``vjp``, ``jacrev``, ``jacfwd``, ``jvp``, ``vmap``,
  ``hessian``, or a backend of an enclosing torchgram call): functorch's interpreter stack is
  not empty. Leaves, inputs and tensors ``f`` captures may be wrapped tensors of those levels,
  and ``G`` must be a function of them that the outer levels can differentiate and batch.
  So the leaves are **not detached**, ``G`` is built from ``torch.func`` products only, and no
  wrapped value is written in place into a fresh buffer (``vmap`` refuses that): blocks are
  concatenated and summed out of place. The ``jacobian`` and ``ntvp`` backends do this; the
  ``structured`` and ``graph`` backends run ``f`` with eager autograd (``requires_grad_``,
  ``autograd.grad``, a ``TorchFunctionMode``), which functorch levels do not see, so they raise
  :class:`~torchgram._core.errors.BackendCannotRun` naming those two, and ``auto`` picks one
  of them.
* **eager create-graph**: grad mode is on and a differentiated leaf or an input tensor
  (positional or keyword) requires grad: ``G`` carries the autograd graph, as
  ``torch.autograd.grad(..., create_graph=True)`` would, so that ``loss + λ·reg(G)`` trains.
  Leaves are not detached; ``jacobian`` and ``ntvp`` (``torch.func`` composes with eager
  autograd as its outermost level), ``structured`` (its backwards with ``create_graph=True``,
  activations and tapped weights kept in the graph) and ``graph`` (its node calls under grad
  mode) all serve it.
* **neither** (the common case): leaves are detached, backends write in place, and nothing
  extra is paid.

In the first two situations every evaluation of ``f`` runs with ops whose derivatives are
right at any order, batched or not (:func:`differentiable_evaluation`: attention's math
kernel, NOTE [decomposed norms]); under ``jvp`` / ``jacfwd`` the probe too runs attention's
math kernel (the fused kernels have no forward-mode derivative), and an op torch cannot
differentiate in forward mode raises a torchgram error (``errors.forward_mode_refusal``).
Inside ``vmap`` the per-sample check of ``batch_dim`` (NOTE [per-sample]) is data-dependent
and cannot run, so backends compute the rows of the whole batch there: the same matrix,
checked or not.

**Forward-mode dual tensors** (``torch.autograd.forward_ad.make_dual`` inside the caller's
``dual_level()``): differentiated leaves carrying a tangent are refused
(:func:`refuse_forward_mode_tangents`: every backend detaches or rebuilds them, and ``G``
came back with no tangent at all); ``torch.func.jvp`` and ``jacfwd`` around the call, outside
the block, give that derivative. Where the probe's output carries a tangent (the level is
global to the process: another thread's ``jvp`` opens one too, so the tangent decides; calls
inside a level probe apart, a probe that saw a tangent is not cached, and an evaluation that
meets a tangent its cached probe did not see probes afresh), ``structured`` declines
(:func:`require_no_forward_tangents`; its tangent came out 0.42 off for a dual input, 0.40 for
a dual tensor ``f`` captured, 0.68 for a dual buffer, the update's 0.30, a raw error without
``batch_dim``; session 63's hunt and review) and ``auto`` moves on; ``graph`` and
``jacobian`` carry the tangents of inputs, captured tensors and buffers. The distributed API,
whose ranks exchange detached pieces, refuses calls made there.

Tensors ``f`` captures from its closure are not inspected in eager mode (they are, in
effect, under ``torch.func`` transforms): to differentiate ``G`` eagerly with respect to
them, pass them as arguments.

**Nesting** (``f`` itself calls a torchgram transform) needs nothing more: an enclosing
``jacobian`` or ``ntvp`` call runs ``f`` under ``torch.func`` transforms, an enclosing
``graph`` call with leaves that require grad, and the inner call composes accordingly. The
one exception is an enclosing ``structured`` call: its taps see the torch functions ``f``
calls, not the backward passes a nested call runs on the same leaves, so its per-leaf
structure would miss those uses. A call made while a structured trace or forward runs
(:func:`tapped_evaluation`) therefore raises ``BackendCannotRun`` for the enclosing
structured backend, and ``auto`` moves on to its next candidate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import optree
import torch
from torch import Tensor
from torch.autograd import forward_ad

from torchgram._core import _torch_compat
from torchgram._core.checks import fail
from torchgram._core.errors import BackendCannotRun
from torchgram._core.norms import DecomposedNorms
from torchgram._core.threads import level_of_another_thread, math_attention

if TYPE_CHECKING:
    from torchgram._core.problem import Problem

COMPOSING_BACKENDS = ("jacobian", "ntvp")
"""The backends that run under ``torch.func`` transforms (NOTE [composition])."""


@dataclass(frozen=True)
class Composition:
    """What surrounds one call (NOTE [composition]).

    Attributes:
        transforms: The ``torch.func`` transforms active around the call, outermost first
            (``"grad"``, ``"jvp"``, ``"vmap"``); empty outside any.
        create_graph: Grad mode is on and a differentiated leaf or an input requires grad:
            ``G`` must carry the eager autograd graph.

    Example:
        >>> Composition().differentiable
        False
        >>> Composition(("grad", "vmap")).describe()
        'inside torch.func transforms (grad, vmap)'
    """

    transforms: tuple[str, ...] = ()
    create_graph: bool = False

    @property
    def differentiable(self) -> bool:
        """Whether ``G`` must be a differentiable (and batchable) function of the call."""
        return bool(self.transforms) or self.create_graph

    @property
    def differentiated_by_transforms(self) -> bool:
        """Whether a ``torch.func`` ``grad`` or ``jvp`` level will differentiate ``G``."""
        return any(name in ("grad", "jvp") for name in self.transforms)

    @property
    def may_be_differentiated(self) -> bool:
        """Whether ``G`` will (transforms) or may (create-graph) be differentiated.

        Its derivative needs the derivatives of ``f``'s first derivatives, not only
        ``vmap``'s batching (NOTE [unseen calls]).
        """
        return self.create_graph or self.differentiated_by_transforms

    def evaluation(self) -> contextlib.AbstractContextManager[None]:
        """The context every evaluation of ``f`` runs in (:func:`differentiable_evaluation`)."""
        return differentiable_evaluation() if self.differentiable else contextlib.nullcontext()

    def describe(self) -> str:
        """The situation in words, for messages and reports."""
        if self.transforms:
            return f"inside torch.func transforms ({', '.join(self.transforms)})"
        if self.create_graph:
            return "eager autograd with inputs that require grad (create-graph)"
        return "plain (no transform, nothing requires grad)"


def detect_composition(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Composition:
    """The :class:`Composition` of a call with these arguments, in the current context."""
    transforms = _torch_compat.functorch_transforms()
    leaves: list[Any] = optree.tree_leaves((args, dict(kwargs)))  # type: ignore[arg-type]
    create_graph = torch.is_grad_enabled() and any(
        isinstance(leaf, Tensor) and leaf.requires_grad for leaf in leaves)
    return Composition(transforms, create_graph)


def _has_forward_tangent(leaf: Any) -> bool:
    return isinstance(leaf, Tensor) and forward_ad.unpack_dual(leaf).tangent is not None


def forward_ad_level_open() -> bool:
    """Whether the caller opened a forward-mode level.

    The level is process-wide: another thread's ``ntvp`` pass opens one too (NOTE [threads]),
    and marks its thread meanwhile (``threads.forward_mode_pass``). A level open while another
    thread's pass is marked is that pass's; read as the caller's, a call in this thread looked
    for tangents on its ``vmap``-batched tensors, where ``unpack_dual`` has no batching rule
    (torch's raw error; a helper's hunt, session 66). The read takes no lock that is held
    while ``f`` runs (waiting for the forward-mode pass's lock deadlocked nested calls, and
    trying it made a caller's own level look closed whenever another thread's call held it:
    the two reviews). A level the caller opened stays open while this thread reads it.
    """
    level_open, theirs = level_of_another_thread(_torch_compat.forward_ad_level_open)
    return level_open and not theirs


def refuse_forward_mode_tangents(api: str, differentiated: Any) -> None:
    """Refuse differentiated leaves carrying a ``forward_ad`` tangent (NOTE [composition]).

    Example:
        >>> import torch, warnings
        >>> import torch.autograd.forward_ad as fwAD
        >>> with fwAD.dual_level(), warnings.catch_warnings():
        ...     warnings.simplefilter("ignore", DeprecationWarning)  # torch's first make_dual
        ...     weight = fwAD.make_dual(torch.ones(2), torch.ones(2))
        ...     refuse_forward_mode_tangents("api", {"weight": weight})
        Traceback (most recent call last):
        ...
        NotImplementedError: api: expected differentiated tensors without forward-mode ...
    """
    if not forward_ad_level_open():  # NOTE [threads]
        return
    dual = [leaf for leaf in optree.tree_leaves(differentiated) if _has_forward_tangent(leaf)]
    if dual:
        fail(api, "differentiated tensors without forward-mode tangents",
             f"a tensor of shape {tuple(dual[0].shape)} made dual by "
             f"torch.autograd.forward_ad.make_dual (no backend carries its tangent into G)",
             "Pass forward_ad.unpack_dual(t).primal, or take G's derivative with "
             "torch.func.jvp or jacfwd around the call, outside the dual_level() block.",
             NotImplementedError)


def carries_forward_tangents(out: Any) -> bool:
    """Whether a tensor of ``out`` carries a ``forward_ad`` tangent (inside a dual level).

    The level is global to the process (another thread's ``ntvp`` pass opens one too:
    :func:`forward_ad_level_open`); the tangent is the call's own.
    """
    return forward_ad_level_open() and any(
        _has_forward_tangent(leaf) for leaf in optree.tree_leaves(out))


def require_no_forward_tangents(problem: Problem, backend: str) -> None:
    """Raise :class:`BackendCannotRun` where ``f``'s output carried a ``forward_ad`` tangent.

    From a dual input, a tensor ``f`` captures or a buffer: the structured backend's taps and
    contractions do not carry it (NOTE [composition]).
    """
    if problem.forward_tangents:
        raise BackendCannotRun(
            problem.api, backend, "f whose output carries no torch.autograd.forward_ad "
            "tangent (its taps and contractions do not carry them)", "an output made dual "
            "by an input, a tensor f holds or a buffer", ("graph", "jacobian"),
            "Those carry the tangents into G.")


def require_no_transforms(problem: Problem, backend: str) -> None:
    """Raise :class:`BackendCannotRun` when the call runs inside ``torch.func`` transforms."""
    composition = problem.composition
    if composition.transforms:
        raise BackendCannotRun(
            problem.api, backend, "a call outside torch.func transforms (this backend runs f "
            "with eager autograd, which the transforms' levels do not see)",
            f"a call {composition.describe()}", COMPOSING_BACKENDS,
            "Those build G from torch.func products, which compose with grad, jvp, vmap and "
            "nested calls.")


def graph_leaf(leaf: Tensor, copies: int | None = None) -> Tensor:
    """A fresh tensor with ``leaf``'s values that requires grad, for a backend's own graph.

    Autograd gives the gradient with respect to it; when ``leaf`` requires grad itself (eager
    create-graph, NOTE [composition]) it is a view of ``leaf``, so that the backend's graph
    also reaches the user's leaf, otherwise a detached alias. ``copies``: ``copies`` stacked
    copies ``[copies, *leaf.shape]`` (per-sample carriers), each with memory of its own: as
    an expanded view, ``f``'s ``as_strided`` of a carrier (whose backward works on the
    storage) summed every sample's gradient into the one storage (0.86-0.97 off on the
    structured fallback, a Toeplitz parametrisation among them: session 60's hunt). They
    cost what the fallback's per-sample gradients cost anyway, ``[copies, *leaf.shape]``.

    Example:
        >>> w = torch.ones(2, requires_grad=True)
        >>> graph_leaf(w).grad_fn is not None, graph_leaf(w.detach()).is_leaf
        (True, True)
        >>> graph_leaf(w, copies=3).shape
        torch.Size([3, 2])
    """
    if leaf.requires_grad:
        return leaf.view_as(leaf) if copies is None else leaf.expand(copies, *leaf.shape).clone()
    alias = leaf.detach()
    if copies is not None:
        alias = alias.expand(copies, *leaf.shape).clone()
    return alias.requires_grad_()


_TAPPED: ContextVar[bool] = ContextVar("torchgram_tapped_evaluation", default=False)


@contextlib.contextmanager
def tapped_evaluation() -> Iterator[None]:
    """Mark the evaluation of ``f`` under the structured backend's taps (NOTE [composition])."""
    token = _TAPPED.set(True)
    try:
        yield
    finally:
        _TAPPED.reset(token)


def refuse_inside_taps(api: str) -> None:
    """Raise :class:`BackendCannotRun` for the enclosing structured call, if there is one."""
    if _TAPPED.get():
        raise BackendCannotRun(
            api, "structured", "f without torchgram calls inside (the taps see the torch "
            "functions f calls, not the backward passes a nested call runs on the same "
            "leaves)", "a nested torchgram call in f", (*COMPOSING_BACKENDS, "graph"), "")


@contextlib.contextmanager
def differentiable_evaluation() -> Iterator[None]:
    """Evaluate ``f`` with ops whose derivatives are right at any order, batched or not.

    The fused ``scaled_dot_product_attention`` kernels have no double backward: its math
    implementation, the same function, runs instead (a process-wide setting, restored on
    exit by the last thread out: NOTE [threads]). Layer, batch and instance norm run
    decomposed (NOTE [decomposed norms]).
    """
    with math_attention(), DecomposedNorms():
        yield
