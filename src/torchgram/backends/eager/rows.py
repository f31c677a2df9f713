"""The rows of an imperative Gramian: outputs, per-sample structure, seeds of the passes.

Rows are kept internally in *row-major* order ``(k, b)`` (row direction ``k`` of every
sample, then ``k + 1``: the structured backend's order, NOTE [backend results]); ``index``
maps them to the outputs' order (entries of the outputs, each flattened row-major, in turn).
Without per-sample structure (``B = 1``), ``K = m`` and the two orders are the same.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Rows:
    """The ``m = B · K`` rows of a call.

    Attributes:
        outputs: The output tensors.
        samples: ``B`` (``1`` without ``batch_dim``).
        per_sample: ``K`` (``m`` without ``batch_dim``).
        index: ``[B, K]``: the output row of row ``k`` of sample ``b``.
        batch_dim: The outputs' batch dimension (``None``: dense rows).
    """

    outputs: tuple[Tensor, ...]
    samples: int
    per_sample: int
    index: Tensor
    batch_dim: int | None

    @classmethod
    def of(cls, outputs: Sequence[Tensor], batch_dim: int | None) -> Rows:
        """The rows of ``outputs``, per sample along ``batch_dim`` (sizes checked by the API).

        Example:
            >>> out = torch.zeros(2, 3)
            >>> Rows.of([out], batch_dim=1).index  # sample b is column b
            tensor([[0, 3],
                    [1, 4],
                    [2, 5]])
        """
        device = outputs[0].device
        m = sum(out.numel() for out in outputs)
        if batch_dim is None:
            return cls(tuple(outputs), 1, m, torch.arange(m, device=device)[None], None)
        pieces, offset = [], 0
        for out in outputs:
            flat = torch.arange(offset, offset + out.numel(), device=device).reshape(out.shape)
            pieces.append(flat.movedim(batch_dim % out.dim(), 0).reshape(out.shape[batch_dim],
                                                                         -1))
            offset += out.numel()
        index = torch.cat(pieces, dim=1)
        return cls(tuple(outputs), index.shape[0], index.shape[1], index, batch_dim)

    @property
    def num_rows(self) -> int:
        """``m``."""
        return self.samples * self.per_sample

    @property
    def row_major(self) -> Tensor:
        """``[m]``: the output row of each row-major row ``(k, b)``."""
        return self.index.T.reshape(-1)

    @functools.cached_property
    def row_major_is_output_order(self) -> bool:
        """Whether row-major order is the outputs' order (e.g. one row per sample)."""
        if self.samples == 1:
            return True
        return bool((self.row_major == torch.arange(self.num_rows,
                                                    device=self.index.device)).all())

    def to_output_order(self, block: Tensor, diagonal: bool) -> Tensor:
        """A ``[m, m]`` (``[m]``) block from row-major order to the outputs' order."""
        if self.row_major_is_output_order:
            return block
        inverse = torch.argsort(self.row_major)
        if diagonal:
            return block[inverse]
        return block.index_select(0, inverse).index_select(1, inverse)

    def to_row_major(self, weights: Tensor) -> Tensor:
        """Weights ``[m]`` in the outputs' order, as ``[K, B]`` in row-major order."""
        if self.row_major_is_output_order:
            return weights.reshape(self.per_sample, self.samples)
        return weights[self.row_major].reshape(self.per_sample, self.samples)

    def _split(self, flat: Tensor) -> list[Tensor]:
        pieces = flat.split([out.numel() for out in self.outputs], dim=1)
        return [piece.reshape(flat.shape[0], *out.shape)
                for piece, out in zip(pieces, self.outputs, strict=True)]

    def direction_seeds(self, start: int, stop: int) -> list[Tensor]:
        """Per output ``[c, *shape]``: for each ``k`` in ``start:stop``, 1 at every ``(b, k)``."""
        if self.per_sample == 1:  # one row per sample (per-sample losses): every entry
            return [out.new_ones((1, *out.shape)) for out in self.outputs]
        first = self.outputs[0]
        flat = first.new_zeros(stop - start, self.num_rows)
        rows = torch.arange(stop - start, device=first.device)[:, None]
        flat[rows, self.index[:, start:stop].T] = 1
        return self._split(flat)

    def probe_seeds(self, groups: Sequence[Sequence[int]],
                    finite_from: int | None = None) -> list[Tensor]:
        """Per output ``[len(groups), *shape]``: the rows of one group of samples each.

        The rows carry NaN (NOTE [NaN probes]): it reaches every tensor a path of products
        leads to, even where a factor is zero in this call, and never cancels. From group
        ``finite_from`` on (the finite twins, NOTE [finite twins]), and every row under
        ``torch.autograd.set_detect_anomaly`` (which raises on a NaN gradient), they carry
        fixed random weights in ``[1, 2)`` instead, the same for a sample in every probe.
        """
        first = self.outputs[0]
        flat = first.new_zeros(len(groups), self.num_rows)
        finite = 1 + torch.rand(self.samples, generator=torch.Generator().manual_seed(0),
                                dtype=torch.float64)
        nan = (torch.full((self.samples,), math.nan, dtype=torch.float64)
               if not torch.is_anomaly_enabled() else finite)
        for i, group in enumerate(groups):
            members = list(group)
            weights = nan if finite_from is None or i < finite_from else finite
            flat[i, self.index[members].reshape(-1)] = weights[members].repeat_interleave(
                self.index.shape[1]).to(flat)
        return self._split(flat)
