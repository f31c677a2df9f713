"""Rule for ``F.embedding`` / ``nn.Embedding`` (with ``padding_idx``; never a one-hot).

``y[t] = W[i_t]`` is a linear layer whose input is the one-hot of ``i_t``, so with
``W: [V, d]``:

    J_W = Σ_t onehot(i_t) ⊗ g_t        (the index first, the cotangent second)

and every inner product involving the one-hot is an index comparison or a gather:
``⟨onehot(i), onehot(j)⟩ = [i == j]``, ``⟨onehot(i), v⟩ = v[i]``. Positions whose index is
``padding_idx`` get no gradient (as in ``F.embedding``'s backward): their cotangent is masked.
``max_norm`` (which renormalises the weight in place), ``scale_grad_by_freq`` and ``sparse``
are left to the fallback.

# NOTE [row gathers]
Models also read rows of a parameter table by indexing it: Swin's and BEiT's relative
position bias, ``table[index.view(-1)]`` with a buffer of indices, and ``index_select`` along
the rows. That is ``F.embedding(index, table)`` (negative indices counted from the end, as
indexing does), so the tapping mode hands such a call to this rule (:func:`row_gather`) rather
than leaving the table to the fallback, whose per-row Jacobians need the per-sample pass for
the whole model. Only whole rows of a 2-D table at an integer tensor on the table's device;
a boolean mask or a column index keep the call as it is. (BEiT interpolates its table before
the lookup: that table stays with the fallback.) Slices of whole rows are lookups too
(:func:`row_slice`): minGPT's ``pos_emb[:, :T, :]`` of a ``[1, block, d]`` parameter,
Whisper's ``weight[:T]``, ``narrow``, ``[a:b:step]``; the table is then the parameter viewed
as ``[rows, d]`` (its entries in the same order).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from torchgram.backends.structured.rules.base import Layout, Match, Operand, Rule


class EmbeddingLayout(Layout):
    """Index activation ``[T]`` (into ``V`` rows) first, cotangent ``[T, 1, d]`` second.

    Example:
        >>> import torch
        >>> layout = EmbeddingLayout(num_embeddings=10, dim=4, padding_idx=0)
        >>> index = torch.tensor([[0, 3, 3]])
        >>> layout.cot_factor(torch.ones(2, 1, 3, 4), 2, index).sum((-2, -1))
        tensor([[[0., 4., 4.]],
        <BLANKLINE>
                [[0., 4., 4.]]])
    """

    def __init__(self, num_embeddings: int, dim: int, padding_idx: int | None) -> None:
        self.rule = "embedding"
        self.act_first = True
        self.act_is_index = True
        self.act_width = num_embeddings
        self.cot_width = dim
        self.padding_idx = padding_idx

    def act_factor(self, raw: Tensor, nlead: int) -> Tensor:
        """The indices, ``[*lead, T]``."""
        return raw.reshape(*raw.shape[:nlead], -1)

    def cot_factor(self, raw: Tensor, nlead: int, act_raw: Tensor | None) -> Tensor:
        """``[*lead, T, 1, d]``, zero where the index is ``padding_idx``."""
        cot = raw.reshape(*raw.shape[:nlead], -1, 1, self.cot_width)
        if self.padding_idx is None or act_raw is None:
            return cot
        index_lead = nlead if act_raw.dim() + 1 == raw.dim() else nlead - 1
        keep = act_raw.reshape(*act_raw.shape[:index_lead], -1) != self.padding_idx
        return cot * keep[..., None, None].to(cot.dtype)


class EmbeddingRule(Rule):
    """``F.embedding(indices, W, padding_idx)`` with a 2-D ``W``."""

    name = "embedding"
    funcs = frozenset({F.embedding})
    _NAMES = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq",
              "sparse")
    _DEFAULTS = (None, None, None, None, 2.0, False, False)

    def match(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Match | None:
        """Recognise a plain lookup (no ``max_norm``, ``scale_grad_by_freq`` or ``sparse``)."""
        values = [args[i] if i < len(args) else kwargs.get(name, default)
                  for i, (name, default) in enumerate(zip(self._NAMES, self._DEFAULTS,
                                                          strict=True))]
        index, weight, padding_idx, max_norm, norm_type, by_freq, sparse = values
        if not (isinstance(index, Tensor) and isinstance(weight, Tensor)) or weight.dim() != 2:
            return None
        if index.is_floating_point() or index.is_complex():
            return None
        if max_norm is not None or by_freq or sparse:
            return None
        num_embeddings = weight.shape[0]
        pad = None if padding_idx is None else padding_idx % num_embeddings
        layout = EmbeddingLayout(num_embeddings, weight.shape[1], pad)

        def compute(w: Tensor) -> Tensor:
            return F.embedding(index, w, padding_idx, None, float(norm_type or 2.0), False, False)

        return Match(self.name, (Operand(weight, layout, act=index),), compute)


_ROW_GATHERS = frozenset({torch.Tensor.__getitem__, torch.Tensor.index_select,
                          torch.index_select})


def _whole_rows(index: Any) -> Any:
    """The row index of ``table[index]`` when it selects whole rows (``None`` otherwise)."""
    if not isinstance(index, tuple):
        return index
    if index and all(i is Ellipsis or (isinstance(i, slice) and i == slice(None))
                     for i in index[1:]) \
            and sum(i is Ellipsis for i in index[1:]) <= 1 and len(index) <= 2:
        return index[0]
    return None


def row_gather(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> tuple[Tensor, Tensor] | None:
    """``(index, table)`` where the call is ``F.embedding(index, table)`` (NOTE [row gathers]).

    Example:
        >>> table, index = torch.randn(5, 3), torch.tensor([[4, -1], [0, 2]])
        >>> found = row_gather(torch.Tensor.__getitem__, (table, index), {})
        >>> torch.equal(F.embedding(*found), table[index])
        True
        >>> row_gather(torch.Tensor.__getitem__, (table, index > 0), {}) is None  # a mask
        True
        >>> row_gather(torch.Tensor.__getitem__, (table, (slice(None), index)), {}) is None
        True
    """
    try:
        if func not in _ROW_GATHERS:
            return None
    except TypeError:  # unhashable func
        return None
    if func is torch.Tensor.__getitem__:
        if len(args) != 2 or kwargs:
            return None
        table, index = args[0], _whole_rows(args[1])
    else:
        names = ("input", "dim", "index")
        values = dict(zip(names, args, strict=False)) | kwargs
        if set(values) != set(names) or values["dim"] not in (0, -2):
            return None
        table, index = values["input"], values["index"]
    if not (isinstance(table, Tensor) and isinstance(index, Tensor)) or table.dim() != 2 \
            or index.dtype not in (torch.long, torch.int) or index.device != table.device:
        return None
    return torch.where(index < 0, index + table.shape[0], index), table


_NARROWS = frozenset({torch.Tensor.narrow, torch.narrow})


def _basic_key(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """The index of a basic indexing call (ints, slices, ``None``, ``...``), as a tuple."""
    if func is torch.Tensor.__getitem__ and len(args) == 2 and not kwargs:
        key = args[1] if isinstance(args[1], tuple) else (args[1],)
    elif func in _NARROWS and len(args) == 4 and not kwargs \
            and all(isinstance(a, int) and not isinstance(a, bool) for a in args[1:]):
        dim = args[1] % max(args[0].dim(), 1)
        key = (*(slice(None),) * dim, slice(args[2], args[2] + args[3]))
    else:
        return None
    if not all(k is None or k is Ellipsis or (isinstance(k, int | slice)
                                               and not isinstance(k, bool)) for k in key):
        return None
    return key


def row_slice(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    """The rows read by a basic indexing of ``args[0]`` that keeps its last dim whole.

    Row ``r`` is ``args[0].reshape(-1, d)[r]`` (``d`` its last size): the call is then
    ``F.embedding(rows, args[0].reshape(-1, d))`` (NOTE [row gathers]); ``None`` where the
    call is another (or reads no row).

    Example:
        >>> table = torch.randn(1, 6, 4)
        >>> rows = row_slice(torch.Tensor.__getitem__, (table, (slice(None), slice(1, 5, 2))),
        ...                  {})
        >>> rows
        tensor([[1, 3]])
        >>> torch.equal(F.embedding(rows, table.reshape(-1, 4)), table[:, 1:5:2])
        True
        >>> row_slice(torch.Tensor.__getitem__, (table, (..., slice(0, 2))), {}) is None
        True
    """
    try:
        if func is not torch.Tensor.__getitem__ and func not in _NARROWS:
            return None
    except TypeError:  # unhashable func
        return None
    table = args[0] if args else None
    if not isinstance(table, Tensor) or table.dim() < 2 or table.shape[-1] == 0:
        return None
    key = _basic_key(func, args, kwargs)
    if key is None or sum(k is Ellipsis for k in key) > 1:
        return None
    consumed = sum(k is not None and k is not Ellipsis for k in key)
    if consumed > table.dim():
        return None
    full = (slice(None),) * (table.dim() - consumed)
    if any(k is Ellipsis for k in key):
        at = next(i for i, k in enumerate(key) if k is Ellipsis)
        key = (*key[:at], *full, *key[at + 1:])
    else:
        key = (*key, *full)
    if not (isinstance(key[-1], slice) and key[-1] == slice(None)):
        return None
    width = table.shape[-1]
    rows = torch.arange(table.numel() // width, device=table.device).view(table.shape[:-1])
    rows = rows[key[:-1]]
    return rows if rows.numel() else None
