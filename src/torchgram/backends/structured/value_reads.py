"""Reads of the batch's values into Python, which ``vmap`` over the samples cannot batch.

# NOTE [reads of the batch's values]
``f`` that reads values of tensors computed from its batched inputs into Python (``if
mask.all():``, ``x.item()``, ``int(t)``, ``torch.equal``) or makes shapes from them
(``x[mask]``, ``nonzero``, ``unique``) cannot run under ``vmap`` over the samples:
``transformers``' mask code does it in every BERT, GPT-2 and LLaMA. The jacobian and ntvp
backends (and the structured backend's per-sample fallback) then loop over the samples (NOTE
[vmap or loop]). The trace of one sample follows which tensors come from the batched inputs
(:class:`BatchValues`) and notes such a read in ``Recording.unbatchable``, so that ``auto``
counts the loops' cost before running anything (NOTE [auto cost model]) and ``explain``
predicts what runs. A read of a parameter's or a constant's values is no such read (``vmap``
batches neither).

Example:
    >>> import torch
    >>> x = torch.ones(3)
    >>> values = BatchValues([x])
    >>> y = x * 2
    >>> values.follow((x, 2), {}, y)
    >>> values.read(torch.Tensor.__bool__, (y,), {}), values.read(torch.Tensor.__bool__,
    ...                                                           (torch.ones(1),), {})
    (True, False)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optree
import torch
from torch import Tensor

from torchgram.backends.structured.trace import TapMode, describe

_VALUE_READS = frozenset({
    Tensor.__bool__, Tensor.__int__, Tensor.__float__, Tensor.__index__, Tensor.__complex__,
    Tensor.item, Tensor.tolist, Tensor.numpy, Tensor.equal, torch.equal, Tensor.allclose,
    torch.allclose, torch.is_nonzero, Tensor.nonzero, torch.nonzero, torch.argwhere,
    Tensor.argwhere, Tensor.unique, torch.unique, Tensor.unique_consecutive,
    torch.unique_consecutive, Tensor.bincount, torch.bincount,
})
"""Calls that read their tensors' values into Python or make a shape from them."""
_INDEXING = frozenset({Tensor.__getitem__, Tensor.__setitem__})
_MASKED = frozenset({Tensor.masked_select, torch.masked_select})
_REPEATS = frozenset({Tensor.repeat_interleave, torch.repeat_interleave})


def _tensors(tree: Any) -> list[Tensor]:
    return [leaf for leaf in optree.tree_leaves(tree, none_is_leaf=True)
            if isinstance(leaf, Tensor)]


def _read(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
    """The tensors whose values the call reads into Python or makes a shape from.

    A boolean mask indexing (``x[mask]``, ``x[mask] = 0``), ``masked_select``'s mask,
    ``repeat_interleave``'s tensor of repeats; every tensor of the calls of
    :data:`_VALUE_READS`. ``vmap`` refuses them batched (a mask made of parameters is not).
    """
    if func in _VALUE_READS:
        return _tensors((args, kwargs))
    if func in _INDEXING:
        return [index for index in _tensors(args[1:2])
                if index.dtype == torch.bool and index.dim() > 0]
    if func in _MASKED:
        return _tensors((args[1:2], kwargs.get("mask")))
    if func in _REPEATS:
        return _tensors((args[1:2], kwargs.get("repeats")))
    return []


class BatchValues:
    """The tensors of one evaluation computed from its batched inputs (NOTE above).

    Args:
        inputs: The batched inputs (one sample's, in a trace).
    """

    def __init__(self, inputs: Sequence[Tensor]) -> None:
        self._from_batch: dict[int, Tensor] = {id(t): t for t in inputs}  # (kept alive: ids
        # stay theirs)

    def _holds(self, tensors: list[Tensor]) -> bool:
        return any(id(t) in self._from_batch for t in tensors)

    def read(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether this call reads values of the batch into Python (or a shape from them)."""
        try:
            return self._holds(_read(func, args, kwargs))
        except TypeError:  # unhashable func
            return False

    def follow(self, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
        """Note ``result``'s tensors as the batch's where the call's arguments hold one.

        Whatever the call (a view, an in-place write, a new tensor).
        """
        if self._holds(_tensors((args, kwargs))):
            for tensor in _tensors(result):
                self._from_batch[id(tensor)] = tensor


class BatchFollowingTapMode(TapMode):
    """A tracing :class:`TapMode` that notes reads of the batch's values (NOTE above).

    Args:
        batched: The batched inputs of the evaluation it traces; the rest as
            :class:`TapMode`'s.
    """

    def __init__(self, *args: Any, batched: Sequence[Tensor], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._batch_values = BatchValues(batched)

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if self._batch_values.read(func, args, kwargs):
            read = f"{describe(func)} (a read of values computed from the batch)"
            if read not in self.recording.unbatchable:
                self.recording.unbatchable.append(read)
        result = super().__torch_function__(func, types, args, kwargs)
        self._batch_values.follow(args, kwargs, result)
        return result
