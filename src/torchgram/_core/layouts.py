"""One tensor given another's memory order of entries (strides), differentiably.

Random ops lay their draws out along their input's strides (``F.dropout``: O2 in
``tests/fuzz/FINDINGS.md``), so where torchgram runs an op another way than ``f`` would
(a rewritten attention, einsum or fused recurrent layer, NOTE [rewritten layouts]; a
decomposed norm, NOTE [decomposed norms]) its result must have the strides the original op
gives, or a random op after it would drop other entries than in the call being
differentiated. The strides of size-1 dims count too: they never move an entry, but ops lay
out their outputs by them (``torch.einsum`` of a ``[B, 1, D]`` input with strides
``(1, 1, 1)`` returns other strides than of the same values with ``(1, B, 1)``), so a random
op two calls later would see another layout. ``Tensor.contiguous`` keeps whatever strides a
size-1 dim has, so those are set by a view of the same storage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor


def laid_out_like(value: Any, original: Any) -> Any:
    """``value`` with ``original``'s memory order of entries (NOTE [rewritten layouts]).

    Example:
        >>> import torch
        >>> original = torch.zeros(3, 2).T
        >>> laid_out_like(torch.ones(2, 3), original).stride()
        (1, 2)
    """
    if not isinstance(value, Tensor) or not isinstance(original, Tensor):
        return value
    return with_strides(value, original.stride())


def with_strides(value: Tensor, strides: Sequence[int]) -> Tensor:
    """``value``'s entries laid out with ``strides``, exactly where they are dense.

    The entries are copied (differentiably) into the memory order ``strides`` give; where
    ``strides`` lay the entries out densely, without gaps or overlaps, the result has exactly
    those strides, size-1 dims included (module docstring). Other strides keep only the order.

    Example:
        >>> import torch
        >>> batch_first = torch.ones(3, 1, 4)  # as a time-major kernel returns it: (4, 12, 1)
        >>> with_strides(batch_first, (4, 12, 1)).stride()
        (4, 12, 1)
    """
    strides = tuple(strides)
    if value.stride() == strides:
        return value
    outer_first = sorted(range(value.dim()), key=strides.__getitem__, reverse=True)
    back = sorted(range(value.dim()), key=outer_first.__getitem__)
    result = value.permute(outer_first).contiguous().permute(back)
    if result.stride() != strides and _dense_apart_from_size_one(result, strides):
        result = result.as_strided(result.shape, strides, result.storage_offset())
    return result


def _dense_apart_from_size_one(laid_out: Tensor, strides: tuple[int, ...]) -> bool:
    """Whether ``strides`` differ from ``laid_out``'s (dense) ones only on size-1 dims."""
    return all(size == 1 or stride == target
               for size, stride, target in zip(laid_out.shape, laid_out.stride(), strides,
                                               strict=True))
