"""One block of memory that the contraction's large temporaries take in turn.

# NOTE [workspace]
The per-row Jacobians a contraction forms one chunk after another (NOTE [Gram by column
chunks]) are freed as soon as their Gram is taken, but a fresh tensor for each still lands at
a new place of the heap: the allocator serves chunks of other sizes (one per layer) from other
free blocks, so the memory a pass touches grows with the number of layers, not with its
largest chunk (on CPU, the resident set of the process grew by ~20 MiB over BERT's 12
materialized layers where their largest chunk is 1.3 MiB). Writing every chunk into the
same buffer, grown to the largest chunk once, keeps them in one place. Only outside autograd
(``out=`` products are not differentiable): with factors that require gradients, fresh
tensors are used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from torchgram._core.scratch import current_scratch


class Workspace:
    """A growing buffer lent out as tensors of any shape; each loan ends with the next.

    Example:
        >>> workspace = Workspace()
        >>> a = workspace.take((2, 3), torch.float32, torch.device("cpu"))
        >>> b = workspace.take((3,), torch.float32, torch.device("cpu"))
        >>> a.shape, b.shape, a.data_ptr() == b.data_ptr()
        (torch.Size([2, 3]), torch.Size([3]), True)
    """

    def __init__(self) -> None:
        self._buffer: Tensor | None = None
        self._loan: Tensor | None = None  # the latest loan, when cut from the scratch

    def take(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
        """An uninitialised contiguous tensor; it shares memory with every earlier loan.

        Inside a call's scratch scope the loans are cut from the thread's scratch buffer,
        which outlives the call (NOTE [scratch memory]); each ends the previous one.
        """
        scratch = current_scratch()
        if scratch is not None:
            if self._loan is not None:
                scratch.give_back(self._loan)
            self._loan = scratch.take(shape, dtype, device)
            return self._loan
        nbytes = math.prod(shape) * dtype.itemsize
        buffer = self._buffer
        if buffer is None or buffer.numel() < nbytes or buffer.device != device:
            self._buffer = None  # the old buffer goes before the new one is made
            buffer = self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buffer[:nbytes].view(dtype).view(*shape)

    def zeros(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
        """Like :meth:`take`, filled with zeros."""
        return self.take(shape, dtype, device).zero_()
