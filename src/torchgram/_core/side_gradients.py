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
own parameters stand for in such a backward), or the eager API's leaf ``inputs``, have a
pre-hook on their ``AccumulateGrad`` node (it runs before an accumulation into ``.grad``, never
for ``autograd.grad``; the nodes are held while the call runs, a leaf keeps only a weak
reference) that notes an accumulation made by the call's own thread outside an evaluation of
``f`` -- that is, inside torchgram's backward passes -- and the call then raises a torchgram
error. The hooks are removed when the call ends, and each noted ``.grad`` is put back as it
was before its first such accumulation: torchgram's passes fed that backward their own
cotangents (batched rows, probes), not a plain backward's -- Reformer's ``.grad`` became NaN,
and the user's next ``loss.backward()`` added to it (session 63; session 62 left them).

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
import functools
import threading
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor
from torch.autograd.graph import Node

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
    written: dict[int, tuple[Tensor, Tensor | None, Tensor | None, int]] = {}
    accumulators: list[Node] = []  # held while the call runs: a leaf keeps a weak reference

    def keep(tensor: Tensor, grads: object) -> None:
        """Before an accumulation: note it, and keep ``.grad`` as it was before the first."""
        if (threading.get_ident() == thread and not getattr(_EVALUATING, "depth", 0)
                and id(tensor) not in written):
            grad = tensor.grad
            written[id(tensor)] = (tensor, grad, None if grad is None else grad.detach().clone(),
                                   0 if grad is None else grad._version)

    handles = []
    with torch.enable_grad():
        for tensor in {id(tensor): tensor for tensor in tensors}.values():
            if not (tensor.is_leaf and tensor.requires_grad):
                continue
            # Its AccumulateGrad node; none where no graph can be made here (inference mode,
            # another thread's transformed tensor that functional_call set on a module) or
            # the tensor has no views (a sparse parameter: not watched)
            try:
                view = tensor.view_as(tensor).grad_fn
            except RuntimeError:
                continue
            accumulator = None if view is None else view.next_functions[0][0]
            if accumulator is not None:
                accumulators.append(accumulator)
                handles.append(accumulator.register_prehook(functools.partial(keep, tensor)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for tensor, grad, value, version in written.values():
            # the values, where the accumulation wrote into that .grad (not where it made a
            # new one: a create_graph .grad keeps its graph), and without a graph of ours (a
            # .grad that requires grad itself)
            if grad is not None and value is not None and grad._version != version:
                with torch.no_grad():
                    grad.copy_(value)
            tensor.grad = grad
    if written:
        shapes = ", ".join(str(tuple(entry[0].shape)) for entry in list(written.values())[:4])
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
