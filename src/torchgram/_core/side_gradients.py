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

So a call notes the ``.grad`` of the parameters of the modules ``f`` reaches (NOTE [tensors
hooks set]'s walk: the ``params`` differentiated are those, or copies or views of them, which
the module's own parameters stand for in such a backward), and for the eager API those of its
``inputs``. Where torchgram's passes changed one (a new tensor, or one written in place), the
call raises a torchgram error saying how many, and puts back the ``.grad`` it replaced (one
written in place keeps what was added: its old values are not kept, which would cost a copy
of every gradient on every call). A parameter ``f`` does not differentiate counts too: its
``.grad`` written once per evaluation, several times a call, is not what a plain call leaves.
(A first version noted only the parameters whose memory was among the arguments: ``params``
passed as clones hid the write, and the wrong matrix with it.)
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor, nn

from torchgram._core._torch_compat import version
from torchgram._core.checks import fail


class NotedGradients:
    """The ``.grad`` of some tensors, as a call found them (NOTE [gradients outside the graph]).

    Example:
        >>> import torch
        >>> weight = torch.ones(2, requires_grad=True)
        >>> noted = NotedGradients([weight])
        >>> noted.refuse_changes("api")  # nothing written
        >>> (weight * 2).sum().backward()
        >>> noted.refuse_changes("api")
        Traceback (most recent call last):
        ...
        NotImplementedError: api: expected a backward whose derivatives all go through ...
        >>> weight.grad is None  # put back
        True
    """

    def __init__(self, tensors: Iterable[Tensor]) -> None:
        self._noted = [(tensor, tensor.grad, _version_of(tensor.grad)) for tensor in tensors]

    @classmethod
    def of_modules(cls, modules: Iterable[nn.Module]) -> NotedGradients:
        """The parameters of ``modules``."""
        parameters = {id(parameter): parameter for module in modules
                      for parameter in module._parameters.values() if parameter is not None}
        return cls(parameters.values())

    def refuse_changes(self, api: str) -> None:
        """Raise if a noted ``.grad`` changed since (one replaced is put back first)."""
        changed = [(tensor, grad) for tensor, grad, at in self._noted
                   if tensor.grad is not grad or _version_of(grad) != at]
        if not changed:
            return
        in_place = 0
        for tensor, grad in changed:
            if tensor.grad is grad:
                in_place += 1
            else:
                tensor.grad = grad
        shapes = ", ".join(str(tuple(tensor.shape)) for tensor, _ in changed[:4])
        kept = (f" ({in_place} of them written in place, which keep what was added)"
                if in_place else "")
        fail(api, "a backward whose derivatives all go through the autograd graph",
             f"a backward that wrote the .grad of {len(changed)} parameter(s) "
             f"itself (shapes {shapes}{'...' if len(changed) > 4 else ''}){kept}",
             "A custom autograd.Function whose backward recomputes its forward and calls "
             "torch.autograd.backward (transformers' Reformer reversible layers, reversible "
             "residual blocks) sends the derivatives of the parameters it closes over into "
             "their .grad, where no backend can see them: the Gramian would miss them. Pass "
             "those parameters to Function.apply as inputs and return their derivatives from "
             "its backward, or use a model without reversible layers.", NotImplementedError)


def _version_of(grad: Tensor | None) -> int | None:
    return None if grad is None else version(grad)
