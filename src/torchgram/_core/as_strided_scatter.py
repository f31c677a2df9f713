"""``as_strided_scatter`` with a right backward in torchgram's evaluations of ``f``.

# NOTE [as_strided_scatter's backward]
torch 2.13's backward of ``as_strided_scatter(input, src, size, stride, storage_offset)``
with respect to ``input`` is wrong on every input (CPU; session 53's OpInfo scan, confirmed by
hand in session 54): it passes the gradient to the positions ``src`` overwrites and ``0`` to
the ones kept, the reverse of the derivative (at ``[[1, 2], [3, 4]]`` with ``src`` written
over the first row, ``d sum(w * out) / d input`` came out ``[[1, 2], [0, 0]]`` for
``[[0, 0], [3, 4]]``); its gradient with respect to ``src`` is right. The dense oracle, the
jacobian, structured and graph backends were wrong with it, without a word. So when the probe
sees ``f`` call it (``Probe.decomposed``), every later evaluation of ``f`` runs under
:class:`AsStridedScatterRewritten`: ``torch.where(kept, input, as_strided_scatter(zeros,
src, ...))``, with ``kept`` the positions the view does not cover (a constant): the same
values (``where`` selects, so an infinite ``input`` where ``src`` goes stays out of it), and
each operand's derivative right (``where`` masks ``input``'s; ``src``'s goes through torch's
right one). On graphs built outside these evaluations (``tg.autograd``), the walk cannot
change the node's backward and refuses ``AsStridedScatterBackward0`` nodes whose ``input``
needs a gradient (:func:`check_as_strided_scatter_node`). Evaluations under a cached probe
that did not see it and then meet it start over (NOTE [stale probes]).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from torchgram._core.errors import DerivativeFault

AS_STRIDED_SCATTER = "torch.as_strided_scatter"
"""The name under which probes record that ``f`` calls ``as_strided_scatter``."""

_CALLS = frozenset({torch.as_strided_scatter, Tensor.as_strided_scatter})


def calls_as_strided_scatter(func: Any) -> bool:
    """Whether ``func`` is ``as_strided_scatter``.

    Example:
        >>> calls_as_strided_scatter(torch.as_strided_scatter), calls_as_strided_scatter(torch.add)
        (True, False)
    """
    try:
        return func in _CALLS
    except TypeError:  # unhashable callables
        return False


class AsStridedScatterRewritten(TorchFunctionMode):
    """``as_strided_scatter`` as ``where`` over its view (NOTE [as_strided_scatter's backward]).

    Example:
        >>> base = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
        >>> with AsStridedScatterRewritten():
        ...     out = torch.as_strided_scatter(base, torch.zeros(2), (2,), (1,))
        >>> out.detach()
        tensor([[0., 0.],
                [3., 4.]])
        >>> torch.autograd.grad(out.sum(), base)[0]  # the kept positions
        tensor([[0., 0.],
                [1., 1.]])
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if not calls_as_strided_scatter(func):
            return func(*args, **kwargs)
        names = ("input", "src", "size", "stride", "storage_offset")
        values: list[Any] = [args[i] if i < len(args) else kwargs.get(name)
                             for i, name in enumerate(names)]
        base, src, view = values[0], values[1], values[2:]
        if not (isinstance(base, Tensor) and isinstance(src, Tensor)) or src.dtype != base.dtype \
                or len(args) + len(kwargs) > len(names):
            return func(*args, **kwargs)  # torch says why (or promotes as it does)
        with torch.no_grad():
            covered = torch.as_strided_scatter(torch.zeros_like(base, dtype=torch.bool),
                                               torch.ones_like(src, dtype=torch.bool), *view)
        placed = torch.as_strided_scatter(torch.zeros_like(base), src, *view)
        return torch.where(covered, placed, base)


class WrongBackward(DerivativeFault):
    """A node of an eager graph whose backward torch gets wrong.

    NOTE [as_strided_scatter's backward].
    """

    expected = ("a graph without as_strided_scatter into a tensor that needs a gradient (torch "
                "2.13's backward with respect to its input is wrong: NOTE [as_strided_scatter's "
                "backward])")
    got = "{call} in the graph of the outputs"
    fix = ("Compute the outputs in a function f and use tg.gramian (its evaluations rewrite "
           "the call), or write the scatter as torch.where over a mask.")


AS_STRIDED_SCATTER_NODE = "AsStridedScatterBackward0"


def check_as_strided_scatter_node(node: Any, name: str) -> None:
    """Refuse ``node`` (named ``name``) if it is an ``as_strided_scatter``'s into a gradient.

    Raises :class:`WrongBackward` where its ``input`` needs a gradient (NOTE
    [as_strided_scatter's backward]); other nodes pass.

    Example:
        >>> base = torch.zeros(2, 2, requires_grad=True)
        >>> node = torch.as_strided_scatter(base, torch.ones(2), (2,), (1,)).grad_fn
        >>> check_as_strided_scatter_node(node, node.name())
        Traceback (most recent call last):
        ...
        torchgram._core.as_strided_scatter.WrongBackward: torch.as_strided_scatter
    """
    if name == AS_STRIDED_SCATTER_NODE and node.next_functions \
            and node.next_functions[0][0] is not None:
        raise WrongBackward(AS_STRIDED_SCATTER)
