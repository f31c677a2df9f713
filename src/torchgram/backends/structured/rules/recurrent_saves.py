"""What torch's fused recurrent kernels save, asked when ``f`` modifies their tensors in place.

# NOTE [recurrent tensors modified in place]
torch's fused recurrent kernels keep some of their inputs and outputs for their backward: on a
CPU the oneDNN LSTM of float32 inputs keeps its output, while a GRU, or an LSTM in float64,
runs as ops that keep neither. So an ``f`` that modifies the output of an ``nn.LSTM`` in place
after the call (``out.tanh_()``, an ``nn.Tanh``-like in-place activation) is refused by torch's
autograd, and every backend that runs torch's backward refuses it (NOTE [in-place
modifications]). The recurrent rewrite (NOTE [recurrent rewrite]) keeps copies of what its
backward reads, so the tapped passes answered there -- ``structured``, and ``auto`` with
``batch_dim``, while ``auto`` without it refused (found by the fuzzer, seed 4444). The tapping
mode therefore notes the version of every tensor of a rewritten recurrent call (its tensor
arguments, then its outputs: :func:`call_tensors`), and where one changed by the end of the
evaluation it asks torch (:func:`fused_call_refuses`): the original call on detached copies
(without the torch-function modes), the same tensors marked modified
(``torch.autograd.graph.increment_version``), one backward. torch's refusal becomes the
mode's (``ModifiedInPlace``, the ``ValueError`` of every backend); where torch answers, so do
the passes. The extra call runs only where something was modified. Under ``torch.func``
transforms (a per-sample ``vmap`` pass) the versions of wrapped tensors do not move and the
question is not asked.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import optree
import torch
from torch import Tensor

from torchgram._core import _torch_compat

RECURRENT_KERNELS: frozenset[Any] = frozenset({torch.lstm, torch.gru, torch.rnn_tanh,
                                               torch.rnn_relu})
"""The fused recurrent kernels the recurrent rewrite replaces (NOTE [recurrent rewrite])."""


def call_tensors(args: Any, kwargs: Any, result: Any) -> list[Tensor]:
    """The tensors of a call: its arguments' (flattened, in order), then its outputs'.

    Example:
        >>> a, b = torch.ones(1), torch.zeros(2)
        >>> [t.shape[0] for t in call_tensors((a, [b, 3]), {}, (a + 1,))]
        [1, 2, 1]
    """
    call: Any = (args, kwargs)
    leaves: list[Any] = [*optree.tree_leaves(call), *optree.tree_leaves(result)]
    return [leaf for leaf in leaves if isinstance(leaf, Tensor)]


def fused_call_refuses(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                       modified: Collection[int]) -> bool:
    """Whether torch's backward through ``func(*args, **kwargs)`` refuses after ``modified``.

    ``modified``: positions in :func:`call_tensors` of the tensors modified in place after
    the call (NOTE [recurrent tensors modified in place]).

    Example:
        >>> lstm = torch.nn.LSTM(2, 3, batch_first=True)
        >>> x, h = torch.randn(4, 5, 2), torch.zeros(1, 4, 3)
        >>> args = (x, (h, h), lstm._flat_weights, True, 1, 0.0, False, False, True)
        >>> output = len(call_tensors(args, {}, ()))  # the first output: after the arguments
        >>> fused_call_refuses(torch.lstm, args, {}, [output])  # the oneDNN kernel keeps it
        True
        >>> fused_call_refuses(torch.lstm, args, {}, [])
        False
    """
    call: Any = (args, kwargs)
    leaves: list[Any]
    leaves, spec = optree.tree_flatten(call)
    if any(isinstance(leaf, Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(leaf)
           for leaf in leaves):
        return False  # NOTE [recurrent tensors modified in place]: not under transforms
    copies = [leaf.detach().clone().requires_grad_(leaf.is_floating_point())
              if isinstance(leaf, Tensor) else leaf for leaf in leaves]
    with torch._C.DisableTorchFunction(), torch.enable_grad():
        copied: Any = optree.tree_unflatten(spec, copies)
        copied_args, copied_kwargs = copied
        result = func(*copied_args, **copied_kwargs)
        tensors = call_tensors(copied_args, copied_kwargs, result)
        for index in modified:
            torch.autograd.graph.increment_version(tensors[index])
        roots = [output.sum() for output in call_tensors((), {}, result) if output.requires_grad]
        inputs = [copy for copy in copies if isinstance(copy, Tensor) and copy.requires_grad]
        if not roots or not inputs:
            return False
        try:
            torch.autograd.grad(roots, inputs, allow_unused=True)
        except RuntimeError as error:
            if _torch_compat.is_in_place_error(error):
                return True
            raise
    return False
