"""One tensor given another's memory order of entries (strides), differentiably.

Random ops lay their draws out along their input's strides (``F.dropout``: O2 in
``tests/fuzz/FINDINGS.md``), so where torchgram runs an op another way than ``f`` would
(a rewritten attention or einsum, NOTE [rewritten layouts]; a decomposed norm, NOTE
[decomposed norms]) its result must have the strides the original op gives, or a random op
after it would drop other entries than in the call being differentiated.
"""

from __future__ import annotations

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
    if not isinstance(value, Tensor) or not isinstance(original, Tensor) or \
            value.stride() == original.stride():
        return value
    outer_first = sorted(range(original.dim()), key=original.stride, reverse=True)
    back = sorted(range(original.dim()), key=outer_first.__getitem__)
    return value.permute(outer_first).contiguous().permute(back)
