"""Derivatives a backward sends into ``.grad`` itself, outside the graph: refused.

NOTE [gradients outside the graph]
A custom ``torch.autograd.Function`` may differentiate by itself: its backward recomputes its
forward with grad enabled and calls ``torch.autograd.backward`` on it (``transformers``'
Reformer reversible layers, reversible residual networks: memory for recomputation). The
derivatives with respect to the parameters it closes over then go into their ``.grad``, not
back through the graph, where every backend (``autograd.grad``, ``torch.func``, the graph
walk) looks: those parameters got zero blocks, and each call wrote their ``.grad`` (session 62's
hunt: 0.60 off on a two-layer MLP, 0.32 on Reformer, without a word; ``jacobian`` declined the
old-style Function). A plain ``loss.backward()`` trains such a model through those ``.grad``
writes, so its Jacobian is what they hold.

So while a call runs, the parameters of the modules ``f`` reaches (NOTE [tensors hooks set]'s
walk: the ``params`` differentiated are those, or copies or views of them, which the module's
own parameters stand for in such a backward), or the eager API's leaf ``inputs``, carry a
post-accumulate-grad hook that notes an accumulation made by the call's own thread outside an
evaluation of ``f`` -- that is, inside torchgram's backward passes -- and the call then raises
a torchgram error. The hooks are removed when the call ends. What such a backward added to
``.grad`` is taken out again: torchgram's passes feed it their own cotangents (batched rows,
probes), so it held no plain backward's gradient -- Reformer's were NaN, and the user's next
``loss.backward()`` trained on them (session 63). A pre-hook on each watched leaf's
``AccumulateGrad`` node (which runs before an accumulation, never for ``autograd.grad``) keeps
``.grad`` as it was before the first such accumulation, and the refusal puts it back.

Not counted: another thread's backward on the same model (a training thread beside a serving
one: a first version compared ``.grad`` before and after the call, refused such calls and put
back a ``.grad`` the other thread had just written, a review's find); a backward that ``f``'s
own forward runs (a frozen teacher's ``loss.backward()``, ``optimizer.zero_grad()``), which
torchgram's evaluations repeat but which is not in the Gramian's derivatives. Not seen: a
backward torch runs on an accelerator's own threads (CUDA's autograd runs there: the thread
cannot be told from another caller's), parameters no module the walk reaches holds, and an
eager ``inputs`` that is a non-leaf copy of the parameters such a Function closes over.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from torchgram._core.checks import fail

_EVALUATING = threading.local()
"""How many evaluations of ``f`` the thread is inside (:func:`evaluating`)."""


@contextlib.contextmanager
def evaluating() -> Iterator[None]:
    """Mark an evaluation of ``f``: what its own backwards accumulate is ``f``'s business."""
    _EVALUATING.depth = getattr(_EVALUATING, "depth", 0) + 1
    try:
        yield
    finally:
        _EVALUATING.depth -= 1


@contextlib.contextmanager
def gradients_outside_the_graph_refused(api: str, tensors: Iterable[Tensor]) -> Iterator[None]:
    """Around a call: refuse it if its backward passes accumulated into ``tensors``' ``.grad``.

    NOTE [gradients outside the graph]. Only leaves that require grad can be accumulated
    into; the others are skipped. The refusal comes after the call's work, where it ended
    without an error of its own.

    Example:
        >>> import torch
        >>> weight = torch.ones(2, requires_grad=True)
        >>> with gradients_outside_the_graph_refused("api", [weight]):
        ...     (weight * 2).sum().backward()
        Traceback (most recent call last):
        ...
        NotImplementedError: api: expected a backward whose derivatives all go through ...
    """
    thread = threading.get_ident()
    written: dict[int, Tensor] = {}
    before: dict[int, tuple[Tensor | None, Tensor | None]] = {}

    def ours() -> bool:
        return threading.get_ident() == thread and not getattr(_EVALUATING, "depth", 0)

    def keep(tensor: Tensor) -> None:
        if ours() and id(tensor) not in before:
            grad = tensor.grad
            before[id(tensor)] = (grad, None if grad is None else grad.detach().clone())

    def note(tensor: Tensor) -> None:
        if ours():
            written[id(tensor)] = tensor

    watched = {id(tensor): tensor for tensor in tensors
               if tensor.is_leaf and tensor.requires_grad}
    # The accumulator nodes are held while the call runs: a leaf keeps only a weak reference.
    accumulators = [torch.autograd.graph.get_gradient_edge(tensor).node
                    for tensor in watched.values()]
    handles = [tensor.register_post_accumulate_grad_hook(note) for tensor in watched.values()]
    handles += [accumulator.register_prehook(lambda grads, tensor=tensor: keep(tensor))
                for accumulator, tensor in zip(accumulators, watched.values(), strict=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for key, tensor in written.items():
            grad, value = before.get(key, (tensor.grad, None))
            if grad is not None and value is not None:
                grad.copy_(value)
            tensor.grad = grad
    if written:
        shapes = ", ".join(str(tuple(tensor.shape)) for tensor in list(written.values())[:4])
        fail(api, "a backward whose derivatives all go through the autograd graph",
             f"a backward that accumulated into the .grad of {len(written)} parameter(s) "
             f"itself (shapes {shapes}{', ...' if len(written) > 4 else ''})",
             "A custom autograd.Function whose backward recomputes its forward and calls "
             "torch.autograd.backward (transformers' Reformer reversible layers, reversible "
             "residual blocks) sends the derivatives of the parameters it closes over into "
             "their .grad, where no backend can see them: the Gramian would miss them (their "
             ".grad is left as it was before the call). Pass those parameters "
             "to Function.apply as inputs and return their derivatives from its backward, or "
             "use a model without reversible layers.", NotImplementedError)
