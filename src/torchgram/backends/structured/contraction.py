"""Gram contractions of the structured backend: ghost pairs, materialized blocks, fallback.

Rows are in the backend's own order ``(r, b)``: ``R`` rows per sample × ``B`` samples
(``B = 1`` without per-sample structure). Every leaf gets a block ``[R, B, R, B]``
(``[R, B]`` with ``diagonal=True``):

* **materialize / fallback**: the per-row Jacobian ``[R, B, P]`` is the sum of every tapped
  use's ``Σ_t first ⊗ second`` and of the gradient of the leaf's carrier (its per-sample copy),
  then one Gram product;
* **ghost**: ``Σ_{u, v} Σ_{t, t', g} ⟨first_u, first_v⟩ ⟨second_u, second_v⟩`` over every
  ordered pair of uses (cross terms included), from factor Grams (NOTE [factors]); index
  factors (embeddings) use comparisons and gathers instead of one-hots.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from torchgram._core.scratch import give_back, scratch_bmm
from torchgram.backends.structured.cost import MIN_JACOBIAN_CHUNK_BYTES, LeafPlan
from torchgram.backends.structured.lifetimes import Lifetimes
from torchgram.backends.structured.trace import UseRecord
from torchgram.backends.structured.workspace import Workspace

_U_LETTERS = {"cot": "rbtg", "act": "btg", "index": "bt"}
_V_LETTERS = {"cot": "scwg", "act": "cwg", "index": "cw"}
_V_DIAGONAL_LETTERS = {"cot": "rbwg", "act": "bwg", "index": "bw"}

DEFAULT_PAIR_ELEMENTS = 2**25
"""Entries of one ghost pair block (``[R, B, T, R, B, T, G]``) before it is row-chunked."""


FactorKind = Literal["act", "cot", "index"]


@dataclass(frozen=True)
class Factor:
    """One factor of a use: ``act [B, T, G, a]``, ``cot [R, B, T, G, c]`` or ``index [B, T]``."""

    tensor: Tensor
    kind: FactorKind
    key: Any = None
    """For a cotangent of all rows: which tap it comes from (its Gram can be shared)."""

    def take(self, rows: slice, samples: slice) -> Factor:
        """Restrict to some rows (cotangents only) and samples."""
        if self.kind == "cot":
            return Factor(self.tensor[rows, samples], self.kind)
        return Factor(self.tensor[samples], self.kind)


def _dedupe(letters: str) -> str:
    return "".join(dict.fromkeys(letters))


def factor_gram(x: Factor, y: Factor, diagonal: bool, dtype: torch.dtype) -> tuple[Tensor, str]:
    """Inner products of every position of ``x`` with every position of ``y``.

    Returns the tensor and its einsum letters: ``r b t g`` for ``x``'s row, sample, position
    and group, ``s c w`` for ``y``'s (``r b`` again when ``diagonal``: same row and sample).

    Example:
        >>> import torch
        >>> act = Factor(torch.randn(3, 1, 1, 4), "act")
        >>> gram, letters = factor_gram(act, act, False, torch.float32)
        >>> letters, gram.shape
        ('btgcw', torch.Size([3, 1, 1, 3, 1]))
    """
    xl = _U_LETTERS[x.kind]
    yl = (_V_DIAGONAL_LETTERS if diagonal else _V_LETTERS)[y.kind]
    if x.kind != "index" and y.kind != "index":
        out = _dedupe(xl + yl)
        return torch.einsum(f"{xl}z,{yl}z->{out}", x.tensor, y.tensor), out
    if x.kind == "index" and y.kind == "index":
        a, b = x.tensor, y.tensor
        if diagonal:
            return (a[:, :, None] == b[:, None, :]).to(dtype), "btw"
        return (a[:, :, None, None] == b[None, None]).to(dtype), "btcw"
    index, il, dense, dl = ((x.tensor, xl, y.tensor, yl) if x.kind == "index"
                            else (y.tensor, yl, x.tensor, xl))
    dense = dense.select(dl.index("g"), 0)  # an embedding has one group
    dl = dl.replace("g", "")
    sample, position = il[0], il[1]
    if sample in dl:  # diagonal: the same sample on both sides
        view = [1] * len(dl)
        view[dl.index(sample)] = index.shape[0]
        gather_index = index.reshape(*view, index.shape[1]).expand(*dense.shape[:-1],
                                                                   index.shape[1])
        return torch.gather(dense, -1, gather_index), dl + position
    gathered = dense.index_select(-1, index.reshape(-1))
    return gathered.reshape(*dense.shape[:-1], *index.shape), dl + il


@dataclass(frozen=True)
class UseFactors:
    """A use's two factors in the leaf's layout (``first ⊗ second``)."""

    first: Factor
    second: Factor

    def take(self, rows: slice, samples: slice) -> UseFactors:
        """Restrict to some rows and samples."""
        return UseFactors(self.first.take(rows, samples), self.second.take(rows, samples))


def _single_position(u: UseFactors, v: UseFactors) -> bool:
    """Dense factors, same orientation, one position and one group: plain matrix products."""
    factors = (u.first, u.second, v.first, v.second)
    return (u.first.kind == v.first.kind and all(f.kind != "index" for f in factors)
            and all(f.tensor.shape[-3] == 1 and f.tensor.shape[-2] == 1 for f in factors))


def single_position_cot_gram(x: Factor, y: Factor, diagonal: bool,
                             cache: dict[Any, Tensor] | None = None) -> Tensor:
    """``⟨x[r, b], y[s, c]⟩`` of one-position cotangents: ``[R, B, R', B']`` (``[R, B]``).

    Shared through ``cache`` when both are the same tap's cotangent (a weight and its bias).
    """
    key = (x.key, diagonal) if x.key is not None and x.key == y.key else None
    if cache is not None and key is not None and key in cache:
        return cache[key]
    rows, samples = x.tensor.shape[:2]
    c_x = x.tensor.reshape(rows * samples, -1)
    c_y = y.tensor.reshape(y.tensor.shape[0] * y.tensor.shape[1], -1)
    if diagonal:
        gram = (c_x * c_y).sum(-1).reshape(rows, samples)
    else:
        gram = (c_x @ c_y.T).reshape(rows, samples, y.tensor.shape[0], y.tensor.shape[1])
    if cache is not None and key is not None:
        cache[key] = gram
    return gram


def _pair_single_position(u: UseFactors, v: UseFactors, diagonal: bool,
                          cache: dict[Any, Tensor] | None) -> Tensor:
    """:func:`pair_gram` for ``T = G = 1``: ``(A Aᵀ) ⊙ (C Cᵀ)`` (the MLP case)."""
    act_u, cot_u = (u.first, u.second) if u.first.kind == "act" else (u.second, u.first)
    act_v, cot_v = (v.first, v.second) if v.first.kind == "act" else (v.second, v.first)
    a_u = act_u.tensor.reshape(act_u.tensor.shape[0], -1)
    a_v = act_v.tensor.reshape(act_v.tensor.shape[0], -1)
    cots = single_position_cot_gram(cot_u, cot_v, diagonal, cache)
    if diagonal:
        return cots * (a_u * a_v).sum(-1)
    return cots * (a_u @ a_v.T)[None, :, None, :]


def pair_gram(u: UseFactors, v: UseFactors, diagonal: bool, dtype: torch.dtype,
              cache: dict[Any, Tensor] | None = None) -> Tensor:
    """``⟨J_u[r, b], J_v[s, c]⟩`` as ``[R, B, R', B']`` (``[R, B]`` when ``diagonal``).

    ``cache`` shares the Gram of a tap's cotangent between the uses of one call.
    """
    if _single_position(u, v):
        return _pair_single_position(u, v, diagonal, cache)
    first, first_letters = factor_gram(u.first, v.first, diagonal, dtype)
    second, second_letters = factor_gram(u.second, v.second, diagonal, dtype)
    out = "rb" if diagonal else "rbsc"
    return torch.einsum(f"{first_letters},{second_letters}->{out}", first, second)


def _pair_chunked(u: UseFactors, v: UseFactors, rows: int, samples: int, positions: int,
                  diagonal: bool, dtype: torch.dtype, max_elements: int,
                  cache: dict[Any, Tensor] | None = None) -> Tensor:
    """:func:`pair_gram`, split over u's samples (or rows) so one block stays bounded."""
    per_sample = rows * positions * (1 if diagonal else rows * samples * positions)
    sample_chunk = max(1, min(samples, max_elements // max(1, per_sample)))
    row_chunk = rows
    if sample_chunk == 1 and per_sample > max_elements:
        row_chunk = max(1, rows * max_elements // per_sample)
    if sample_chunk >= samples and row_chunk >= rows:
        return pair_gram(u, v, diagonal, dtype, cache)
    pieces_b = []
    for b0 in range(0, samples, sample_chunk):
        b_slice = slice(b0, b0 + sample_chunk)
        pieces_r = []
        for r0 in range(0, rows, row_chunk):
            r_slice = slice(r0, r0 + row_chunk)
            u_part = u.take(r_slice, b_slice)
            v_part = v.take(r_slice, b_slice) if diagonal else v
            pieces_r.append(pair_gram(u_part, v_part, diagonal, dtype))
        pieces_b.append(torch.cat(pieces_r, dim=0))
    return torch.cat(pieces_b, dim=1)


# NOTE [uses taken together]
# A leaf used several times has J = Σ_u Σ_t first_u[t] ⊗ second_u[t]: uses whose factors have
# the same kinds, orientation and widths are one use over all their positions, so their
# factors are concatenated along the positions before any contraction. The result is the same
# (the cross terms between the uses are the cross terms between positions), with one matrix
# product instead of one per use (materialize) or per pair of uses (ghost): e.g. the ``T``
# per-step uses of a recurrent weight whose bias needs the fallback (else it has one use:
# NOTE [step taps]), or a layer applied twice.

_POSITION_DIM = {"cot": 2, "act": 1, "index": 1}
"""The positions dim of a factor: ``cot [R, B, T, G, c]``, ``act [B, T, G, a]``, ``index [B, T]``.
"""


def _signature(use: UseRecord, factors: UseFactors) -> tuple[Any, ...]:
    def widths(factor: Factor) -> tuple[int, ...]:
        return () if factor.kind == "index" else tuple(factor.tensor.shape[-2:])

    return (use.role, use.act_first, use.shape.elementwise, use.shape.act_width,
            getattr(use.layout, "premultiplied", False), factors.first.kind,
            factors.second.kind, widths(factors.first), widths(factors.second))


def together(items: Sequence[tuple[UseRecord, UseFactors]]) -> list[tuple[UseRecord, UseFactors]]:
    """The uses of one leaf, those with the same factor shapes concatenated along positions.

    NOTE [uses taken together]. Each item keeps its first use as the record of the group.
    """
    groups: dict[tuple[Any, ...], list[tuple[UseRecord, UseFactors]]] = {}
    for use, factors in items:
        groups.setdefault(_signature(use, factors), []).append((use, factors))
    merged = []
    for group in groups.values():
        if len(group) == 1:
            merged.append(group[0])
            continue
        use, first_factors = group[0]
        premultiplied = bool(getattr(use.layout, "premultiplied", False))
        first = _cat([f.first for _, f in group], premultiplied)
        second = first if first_factors.second is first_factors.first else \
            _cat([f.second for _, f in group], premultiplied)
        merged.append((use, UseFactors(first, second)))
    return merged


def _cat(factors: list[Factor], premultiplied: bool) -> Factor:
    """Factors of uses taken together, concatenated along their positions."""
    if premultiplied and factors[0].kind == "act":  # ones: the act is in the cotangent
        return factors[0]
    kind = factors[0].kind
    return Factor(torch.cat([f.tensor for f in factors], dim=_POSITION_DIM[kind]), kind)


def drop_dead_positions(factors: UseFactors) -> UseFactors:
    """``factors`` without the positions where the cotangent is zero for every row and sample.

    NOTE [dead positions]: exact, since such a position adds ``0 ⊗ act`` to every row's
    Jacobian. One reduction of the cotangent and one host read; not where the cotangent
    requires gradients (a differentiable ``G``: a zero value may have a non-zero derivative).
    At least one position is kept (all zero: a zero block).
    """
    cot = factors.first if factors.first.kind == "cot" else factors.second
    tensor = cot.tensor
    positions = tensor.shape[2]
    if cot.kind != "cot" or positions < 2 or tensor.requires_grad:
        return factors
    # NaN or inf entries are non-zero here: such positions stay
    reached = tensor.amax(dim=(0, 1, 3, 4)).ne(0) | tensor.amin(dim=(0, 1, 3, 4)).ne(0)
    index = reached.nonzero().reshape(-1)
    if index.numel() == positions:
        return factors
    if index.numel() == 0:
        index = index.new_zeros(1)
    start, count = int(index[0]), index.numel()
    contiguous = int(index[-1]) - start + 1 == count  # a view of them, no copy

    def take(factor: Factor) -> Factor:
        dim = _POSITION_DIM[factor.kind]
        if factor.tensor.shape[dim] != positions:  # broadcast along the positions (ones)
            return factor
        tensor = (factor.tensor.narrow(dim, start, count) if contiguous
                  else factor.tensor.index_select(dim, index))
        return Factor(tensor, factor.kind, factor.key)

    first = take(factors.first)
    second = first if factors.second is factors.first else take(factors.second)
    return UseFactors(first, second)


def _apart(matrices: Tensor) -> Tensor:
    """``[B, m, n]`` with each sample's matrix in one block of memory (a copy if interleaved).

    Factors read from a position-major tap (``[T, B, d]``: recurrent nets) interleave the
    samples' rows; a batched product reading them in place was measured ~2.5× slower on CPU
    (an LSTM's ``[16, 32, 512]`` cotangent) than a copy and the product. Transposed views
    whose samples lie apart (convolutions: ``[B, d, T]`` read as ``[B, T, d]``) are read as
    they are: copying those was slower.
    """
    batch_stride = matrices.stride(0)
    interleaved = matrices.shape[0] > 1 and any(
        matrices.shape[d] > 1 and batch_stride < matrices.stride(d) for d in (1, 2))
    return matrices.contiguous() if interleaved else matrices


def materialize_use(use: UseRecord, factors: UseFactors, numel: int,
                    into: Tensor | None = None, may_write: bool = False) -> Tensor:
    """The use's per-row Jacobian ``[R, B, numel]`` in the leaf's layout.

    ``into``: the Jacobian ``[R, B, numel]`` of the leaf's other uses, added to this one's
    (NOTE [Jacobians of several uses]); ``may_write``: whether ``into`` may be written to.
    """
    jac = _materialize_use(use, factors, numel, into if may_write else None)
    if into is None or jac is into:
        return jac
    if jac.shape != into.shape or jac.dtype != torch.promote_types(jac.dtype, into.dtype):
        return jac + into
    return jac.add_(into)  # jac is a new tensor: no third one


# NOTE [Jacobians of several uses]
# A materialized leaf with several uses (GPT-2's tied token embedding: a lookup and the output
# projection) sums their per-row Jacobians, each as large as the leaf times the rows. A sum
# ``part + jac`` would write a third such tensor (fresh memory: page faults on CPU, measured
# several ms for GPT-2's [16, 128000]); instead each new Jacobian takes the sum in place, and a
# lookup, contracted last, adds its rows straight into the Jacobian of the other uses (no
# zero-filled table of its own) when that one is a tensor the contraction made itself.


def _materialize_use(use: UseRecord, factors: UseFactors, numel: int,
                     into: Tensor | None) -> Tensor:
    """:func:`materialize_use`; a lookup adds its rows into ``into`` when given (returned)."""
    if use.role == "bias":
        cot = factors.first.tensor if factors.first.kind == "cot" else factors.second.tensor
        summed = cot.sum(dim=2)
        return summed.reshape(*summed.shape[:2], -1)
    first, second = factors.first, factors.second
    if use.shape.elementwise:  # Σ_t act ⊙ cot, the activation shared by the rows
        act_factor, cot_factor = (first, second) if first.kind == "act" else (second, first)
        summed = (cot_factor.tensor.sum(dim=2) if getattr(use.layout, "premultiplied", False)
                  else (cot_factor.tensor * act_factor.tensor).sum(dim=2))
        return summed.reshape(*summed.shape[:2], numel)
    if first.kind == "index" or second.kind == "index":
        index, cot = ((first.tensor, second.tensor) if first.kind == "index"
                      else (second.tensor, first.tensor))
        rows, samples, positions = cot.shape[:3]
        classes = use.shape.act_width
        dim = cot.shape[-1]
        offsets = index + classes * torch.arange(samples, device=index.device)[:, None]
        values = cot.reshape(rows, samples * positions, dim)
        if into is not None and first.kind == "index" and into.is_contiguous() \
                and into.shape == (rows, samples, numel) and into.dtype == cot.dtype:
            into.view(rows, samples * classes, dim).index_add_(1, offsets.reshape(-1), values)
            return into
        jac = cot.new_zeros(rows, samples * classes, dim)
        jac.index_add_(1, offsets.reshape(-1), values)
        jac = jac.reshape(rows, samples, classes, dim)
        if first.kind != "index":  # a transposed embedding table
            jac = jac.transpose(-1, -2)
        return jac.reshape(rows, samples, numel)
    # [(R,) B, T, G, i] -> [(R,) B, G, i, T] and [(R,) B, G, T, j]: one (broadcast) matmul
    # writes the Jacobian contiguously in the leaf's layout [R, B, G, i, j]
    operands = per_sample_operands(factors)
    if operands is not None:
        left, right = operands
        # NOTE [scratch memory]: given back after its Gram (Contraction._add_leaf)
        return scratch_bmm(left, right).reshape(1, left.shape[0], numel)
    jac = torch.matmul(*broadcast_operands(factors))
    return jac.reshape(*jac.shape[:2], numel)


def broadcast_operands(factors: UseFactors) -> tuple[Tensor, Tensor]:
    """``[(R,) B, G, i, T]`` and ``[(R,) B, G, T, j]``, whose broadcast product is the Jacobian.

    The product is in the leaf's layout ``[R, B, G, i, j]``.
    """
    first, second = factors.first, factors.second
    left = first.tensor.movedim(-3, -1)
    right = second.tensor.movedim(-2, -3)
    if first.kind != "cot":
        left = left.unsqueeze(0)
    if second.kind != "cot":
        right = right.unsqueeze(0)
    return left, right


def per_sample_operands(factors: UseFactors) -> tuple[Tensor, Tensor] | None:
    """``[B, i, T]`` and ``[B, T, j]`` with ``J[b] = left[b] @ right[b]``, or ``None``.

    For dense factors with one row per sample and one group (``first [1, B, T, 1, i]`` or
    ``[B, T, 1, i]``, the same for ``second``): transposed views, no copies except where
    the samples are interleaved (:func:`_apart`).
    """
    first, second = factors.first, factors.second
    if "index" in (first.kind, second.kind) or "cot" not in (first.kind, second.kind):
        return None
    rows = max(f.tensor.shape[0] for f in (first, second) if f.kind == "cot")
    if rows != 1 or first.tensor.shape[-2] != 1:
        return None
    samples, positions = first.tensor.shape[-4], first.tensor.shape[-3]
    left = _apart(first.tensor.reshape(samples, positions, -1)).transpose(1, 2)
    right = _apart(second.tensor.reshape(samples, positions, -1))
    return left, right


# NOTE [Gram by column chunks]
# A materialized leaf's per-row Jacobian J [R, B, P] is formed only for its Gram J Jᵀ, and a
# Gram is a sum over columns: J Jᵀ = Σ_c J_c J_cᵀ for any split of the columns into chunks
# J_c. Formed whole, J is the largest tensor of the pass on many models (a 512×128 layer's
# [16, 65536] on BERT, a 3×3 convolution's [16, 147456] on ResNet-18: 4-9 MiB, where the
# plain backward peaks at 10-20 MiB), and a fresh block of that size each time. For one use
# (or uses taken together) J is one matrix product of the factors, first [.., i, T] @ second
# [.., T, j]; slices of the i rows of the first give J's columns chunk by chunk, each
# contracted and freed before the next is formed (a lookup's table: a slice of its columns
# at a time). A chunk holds at most max(MIN_JACOBIAN_CHUNK_BYTES, the two factors' size)
# bytes: the extra memory stays under what the pass holds for that use anyway (or a small
# constant), and a chunk stays large enough for the products to run at full speed (the same
# multiply-adds, a few more calls). The chunks are written into one workspace (NOTE
# [workspace]): on a CPU the first touch of fresh memory (page faults) costs as much as the
# product itself (ResNet-18's [16, 128, 16] @ [16, 16, 1152]: 6 ms into fresh memory, 1.5 ms
# into memory used before), so reusing one buffer is also what makes the late convolutions
# fast. A leaf with a carrier or with uses of several kinds, and factors kept for ``Jᵀw``,
# still form the whole Jacobian.


def chunked_gram_applies(use: UseRecord, factors: UseFactors) -> bool:
    """Whether :func:`chunked_gram` can contract this (merged) use: a product or a lookup."""
    return use.role != "bias" and not use.shape.elementwise


def chunked_gram(factors: UseFactors, classes: int, diagonal: bool,
                 max_bytes: int | None = None, workspace: Workspace | None = None) -> Tensor:
    """The Gram block ``[R, B, R, B]`` (``[R, B]``) of a use's per-row Jacobian, by chunks.

    NOTE [Gram by column chunks]. ``classes``: a lookup's number of rows of its table (its
    ``act_width``). ``max_bytes``: bound on one chunk of the Jacobian (``None``: see the
    note). ``workspace``: where the chunks are written (NOTE [workspace]), unless the factors
    require gradients. Where the whole Jacobian fits, this is
    ``gram_of_rows(materialize_use(...))``.
    """
    first, second = factors.first, factors.second
    if "index" in (first.kind, second.kind):
        return _chunked_lookup_gram(factors, classes, diagonal, max_bytes, workspace)
    itemsize = torch.promote_types(first.tensor.dtype, second.tensor.dtype).itemsize
    bound = max_bytes if max_bytes is not None else max(
        MIN_JACOBIAN_CHUNK_BYTES, (first.tensor.numel() + second.tensor.numel()) * itemsize)
    rows = max(f.tensor.shape[0] for f in (first, second) if f.kind == "cot")
    samples, groups = first.tensor.shape[-4], first.tensor.shape[-2]
    # transposed views and one batched product where it can (as materialize_use)
    left, right = per_sample_operands(factors) or broadcast_operands(factors)
    width, per_row = left.shape[-2], rows * samples * groups * right.shape[-1] * itemsize
    step = max(1, bound // max(1, per_row))
    if left.requires_grad or right.requires_grad:
        workspace = None
    total: Tensor | None = None
    for start in range(0, width, step):
        chunk = left[..., start:start + step, :]
        if workspace is None:
            jac = torch.matmul(chunk, right)
        else:
            shape = (*(max(a, b) for a, b in zip(chunk.shape[:-2], right.shape[:-2],
                                                  strict=True)),  # sizes are equal or 1
                     chunk.shape[-2], right.shape[-1])
            jac = torch.matmul(chunk, right, out=workspace.take(
                shape, torch.promote_types(chunk.dtype, right.dtype), chunk.device))
        gram = gram_of_rows(jac.reshape(rows, samples, -1), diagonal)
        del jac
        total = gram if total is None else total.add_(gram)
    assert total is not None
    return total


def _chunked_lookup_gram(factors: UseFactors, classes: int, diagonal: bool,
                         max_bytes: int | None, workspace: Workspace | None) -> Tensor:
    """:func:`chunked_gram` of a lookup: its Jacobian's table rows, a slice of columns at a time.

    The Gram does not depend on the order of the Jacobian's entries: a transposed table
    (the index second) has the same one.
    """
    index, cot = ((factors.first.tensor, factors.second.tensor) if factors.first.kind == "index"
                  else (factors.second.tensor, factors.first.tensor))
    rows, samples, positions, dim = cot.shape[0], cot.shape[1], cot.shape[2], cot.shape[-1]
    bound = max_bytes if max_bytes is not None else max(
        MIN_JACOBIAN_CHUNK_BYTES, index.numel() * index.element_size()
        + cot.numel() * cot.element_size())
    step = max(1, bound // max(1, rows * samples * classes * cot.element_size()))
    offsets = (index + classes * torch.arange(samples, device=index.device)[:, None]).reshape(-1)
    values = cot.reshape(rows, samples * positions, dim)
    if cot.requires_grad:
        workspace = None
    total: Tensor | None = None
    for start in range(0, dim, step):
        part = values[..., start:start + step]
        shape = (rows, samples * classes, part.shape[-1])
        jac = (cot.new_zeros(shape) if workspace is None
               else workspace.zeros(shape, cot.dtype, cot.device))
        jac.index_add_(1, offsets, part)
        gram = gram_of_rows(jac.reshape(rows, samples, -1), diagonal)
        del jac
        total = gram if total is None else total.add_(gram)
    assert total is not None
    return total


def _is_lookup(item: tuple[UseRecord, UseFactors]) -> bool:
    return "index" in (item[1].first.kind, item[1].second.kind)


def flat_rows(jacobian: Tensor) -> Tensor:
    """``[R, B, *shape]`` → ``[R, B, P]``, with the entries in memory order (no copy).

    The order of a Jacobian's columns does not change its Gram matrix, so the flattening
    follows the strides the backward produced instead of copying to row-major order: only
    for a Jacobian whose rows all come at once (NOTE [columns of row chunks]).
    """
    rest = sorted(range(2, jacobian.dim()), key=lambda d: -jacobian.stride()[d])
    return jacobian.permute(0, 1, *rest).reshape(*jacobian.shape[:2], -1)


# NOTE [columns of row chunks]
# A leaf's Jacobian built from several backwards (chunk_size rows at a time) is one matrix:
# its columns must be in the same order in every chunk. The backward lays a gradient out as
# its last node writes it, which can differ between a batched pass of several rows and the
# plain pass of one row (a leaf used as W and as W.T inside custom autograd.Functions: the
# batched pass gave [c, 5, 3] in row-major order, the last chunk's single row a transposed
# [5, 3] view). Flattened each in its own memory order (flat_rows), the chunks' columns
# were permuted against each other: the diagonal blocks were right, the cross terms between
# chunks wrong (a Gramian hunt case: that leaf's block 0.29 off, relative). A chunk of some
# rows is flattened in the leaf's row-major order; only a Jacobian whose rows all come at
# once keeps the order it was written in.


# NOTE [Jᵀw from kept Jacobians]
# A materialized leaf's per-row Jacobians [R, B, P] are formed for its Gram block anyway. For
# Jᵀw = Σ_{r,b} w[r, b] J[r, b], keeping them makes the pullback one matrix-vector product
# (it reads R·B·P numbers once) instead of the contraction of the factors again (a bias's
# cotangents summed over their T positions, a layer's product over B·T of activations and
# weighted cotangents: the work of the layer's weight gradient in a backward, ~T times the
# read of the Jacobians). They are kept when at most KEPT_JACOBIAN_GROWTH times the size of
# the factors they stand for (activation and cotangent), and the factors are then let go: the
# memory kept for Jᵀw grows by at most that factor (plus an activation that something else,
# the recording or the graph, holds anyway). Where they are larger (wide linear layers at few
# positions, where contracting the factors again costs about as much as reading the
# Jacobians), the factors are kept and contracted again. With "no larger than the factors",
# the transformer of benchmarks/eager.py (T = 64, linear layers 128 -> 384 / 512, Jacobians
# 1.5-1.6 times their factors) paid one more weight-gradient's work in its step: 101.7 ms, now
# 94.2 ms (a plain backward: 64.9 ms).
KEPT_JACOBIAN_GROWTH = 2
"""How much larger than its factors a leaf's kept Jacobian may be (NOTE above)."""


def keeps_jacobian(jacobian: Tensor, factors: Sequence[Tensor]) -> bool:
    """Whether a leaf keeps ``jacobian`` for ``Jᵀw`` (NOTE [Jᵀw from kept Jacobians]).

    Example:
        >>> act, cot = torch.zeros(32, 64, 128), torch.zeros(32, 64, 512)  # [B, T, width]
        >>> keeps_jacobian(torch.zeros(32, 128 * 512), (act, cot))  # 1.6 times the factors
        True
        >>> keeps_jacobian(torch.zeros(32, 784 * 512), (act[:, :1], cot[:, :1]))  # T = 1
        False
    """
    return jacobian.numel() <= KEPT_JACOBIAN_GROWTH * sum(factor.numel() for factor in factors)


def weighted_rows(weights: Tensor, jacobian: Tensor) -> Tensor:
    """``Σ_{r,b} w[r, b] J[r, b]`` for ``weights [R, B]`` and ``jacobian [R, B, *rest]``, flat."""
    rows = weights.shape[0] * weights.shape[1]
    return weights.reshape(rows).to(jacobian.dtype) @ jacobian.reshape(rows, -1)


def gram_of_rows(jacobian: Tensor, diagonal: bool) -> Tensor:
    """The Gram block ``[R, B, R, B]`` (or ``[R, B]``) of per-row Jacobians ``[R, B, P]``."""
    if diagonal:
        return jacobian.square().sum(dim=-1)
    rows, samples = jacobian.shape[:2]
    flat = jacobian.reshape(rows * samples, -1)
    return (flat @ flat.T).reshape(rows, samples, rows, samples)


def sparse_embedding_gram(indices: Sequence[Tensor], cots: Sequence[Tensor], classes: int,
                          diagonal: bool) -> Tensor:
    """The block of an embedding table used only by lookups, from its non-zero rows.

    Row ``(r, b)``'s Jacobian has a non-zero row ``v`` only for the tokens of sample ``b``:
    ``S[r, b, v] = Σ_{uses, t: index = v} g[r, b, t]``. Then
    ``G[(r, b), (s, c)] = Σ_v ⟨S[r, b, v], S[s, c, v]⟩`` over the pairs of (sample, token)
    entries that share a token: about ``n·(1 + n/V)`` pairs for ``n`` entries spread over
    ``V`` tokens, instead of ``(R·B)²·V·d`` for the materialized Gram.

    Args:
        indices: Per use, the indices ``[B, T]``.
        cots: Per use, the cotangents ``[R, B, T, 1, d]`` (padding already masked).
        classes: ``V``, the number of rows of the table.
        diagonal: Return only ``[R, B]`` (each row's squared norm).

    Returns:
        ``[R, B, R, B]`` (``[R, B]`` with ``diagonal``).

    Example:
        >>> import torch
        >>> index = torch.tensor([[1, 1, 2], [2, 0, 0]])
        >>> cot = torch.randn(1, 2, 3, 1, 4)
        >>> jac = torch.zeros(2, 3, 4).index_put_(
        ...     (torch.tensor([[0], [1]]).expand(2, 3), index), cot[0, :, :, 0], accumulate=True)
        >>> dense = jac.reshape(2, -1) @ jac.reshape(2, -1).T
        >>> torch.allclose(sparse_embedding_gram([index], [cot], 3, False)[0, :, 0], dense)
        True
    """
    rows, samples = cots[0].shape[:2]
    device = cots[0].device
    sample_ids = torch.arange(samples, device=device)[:, None]
    keys = torch.cat([(index + classes * sample_ids).reshape(-1) for index in indices])
    values = torch.cat([cot.reshape(rows, -1, cot.shape[-1]) for cot in cots], dim=1)
    unique, inverse = torch.unique(keys, return_inverse=True)
    summed = values.new_zeros(rows, unique.numel(), values.shape[-1])
    summed.index_add_(1, inverse, values)  # S[r, (b, v)]
    key_sample = torch.div(unique, classes, rounding_mode="floor")
    if diagonal:
        out = values.new_zeros(rows, samples)
        return out.index_add_(1, key_sample, summed.square().sum(-1))
    token = unique - classes * key_sample
    order = torch.argsort(token, stable=True)
    token_sorted = token[order]
    starts = torch.ones_like(token_sorted, dtype=torch.bool)
    starts[1:] = token_sorted[1:] != token_sorted[:-1]
    group = torch.cumsum(starts.long(), 0) - 1
    group_start = torch.nonzero(starts).reshape(-1)
    group_size = torch.diff(torch.cat([group_start, group_start.new_tensor([token.numel()])]))
    per_entry = group_size[group]
    left = torch.repeat_interleave(torch.arange(token.numel(), device=device), per_entry)
    first_pair = torch.cumsum(per_entry, 0) - per_entry
    right = group_start[group[left]] + (torch.arange(left.numel(), device=device)
                                        - first_pair[left])
    left, right = order[left], order[right]
    # index_select, not advanced indexing: on CPU it gathers several rows' pairs faster
    dots = torch.einsum("rpd,spd->prs", summed.index_select(1, left),
                        summed.index_select(1, right))
    out = values.new_zeros(samples, samples, rows, rows)
    out.index_put_((key_sample[left], key_sample[right]), dots, accumulate=True)
    return out.permute(2, 0, 3, 1)


def pullback_use(use: UseRecord, factors: UseFactors, weights: Tensor, numel: int) -> Tensor:
    """``Σ_{r, b} w[r, b] J_u[r, b]``, flattened in the leaf's layout (``weights: [R, B]``)."""
    def weighted(factor: Factor) -> Tensor:
        w = weights.to(factor.tensor.dtype)
        tensor = factor.tensor
        if tensor.shape[0] == 1:  # one row direction: nothing to sum over (no copy)
            return tensor[0] * w[0].reshape(-1, *([1] * (tensor.dim() - 2)))
        return (tensor * w.reshape(*w.shape, *([1] * (tensor.dim() - 2)))).sum(0)

    first, second = factors.first, factors.second
    if use.role == "bias":  # Σ_{r,b} w[r, b] Σ_t cot[r, b, t]: one product over (r, b)
        cot = (first if first.kind == "cot" else second).tensor
        w = weights.reshape(-1).to(cot.dtype)
        summed = w @ cot.reshape(w.shape[0], -1)
        return summed.reshape(-1, numel).sum(0) if summed.numel() != numel else summed
    first_t = weighted(first) if first.kind == "cot" else first.tensor
    second_t = weighted(second) if second.kind == "cot" else second.tensor
    if use.shape.elementwise:
        return (first_t * second_t).sum((0, 1)).reshape(numel)
    if first.kind == "index" or second.kind == "index":
        index, cot = (first_t, second_t) if first.kind == "index" else (second_t, first_t)
        table = cot.new_zeros(use.shape.act_width, cot.shape[-1])
        table.index_add_(0, index.reshape(-1), cot.reshape(-1, cot.shape[-1]))
        return (table if first.kind == "index" else table.T).reshape(numel)
    if first_t.shape[2] == 1:  # one group: a plain matrix product over (b, t)
        return (first_t.reshape(-1, first_t.shape[-1]).T
                @ second_t.reshape(-1, second_t.shape[-1])).reshape(numel)
    return torch.einsum("btgi,btgj->gij", first_t, second_t).reshape(numel)


class Contraction:
    """Collects the pass's factors, row chunk by row chunk, and yields per-leaf blocks.

    Args:
        plans: One plan per leaf (its ``way``).
        uses: The run's records of each planned leaf's tapped uses (they carry the layouts
            of the run; the plan's are the trace's).
        numels: Number of entries of every leaf.
        samples: ``B``.
        rows: ``R``.
        diagonal: Whether only the diagonal is wanted.
        max_pair_elements: Bound on one ghost pair block before row-chunking.
        keep: Keep the factors for :meth:`pullback`.
        dtype: The dtype factors and Jacobians are contracted in (``None``: their own); the
            widest of the leaves' and the output's, so mixed-dtype leaves stay exact.
        consume: Contract each leaf as soon as all its rows are in and let go of the
            activations (and, in a streamed pass, the cotangents) no other leaf reads
            (NOTE [streamed taps]). Not with ``keep``; needs ``dtype``.
        max_jacobian_bytes: Bound on the per-row Jacobian a materialized leaf forms at once
            (NOTE [Gram by column chunks]); ``None``: :data:`MIN_JACOBIAN_CHUNK_BYTES` or the
            size of the use's factors, whichever is larger.
    """

    def __init__(self, plans: Sequence[LeafPlan], uses: dict[int, tuple[UseRecord, ...]],
                 numels: Sequence[int], samples: int, rows: int, diagonal: bool,
                 max_pair_elements: int = DEFAULT_PAIR_ELEMENTS, keep: bool = False,
                 dtype: torch.dtype | None = None, consume: bool = False,
                 max_jacobian_bytes: int | None = None) -> None:
        self.plans = plans
        self.dtype = dtype
        self.uses = uses
        self.keep = keep
        self.consume = consume and not keep and dtype is not None
        self.max_jacobian_bytes = max_jacobian_bytes
        self.streamed_bytes = 0
        """Bytes of the cotangents a streamed pass handed over (for the run's report)."""
        self._plan_of = {plan.leaf: plan for plan in plans}
        self._workspace = Workspace()
        self._stream_cots: list[Tensor | None] = []
        self._stream_lifetimes: Lifetimes | None = None
        self._stream_waits: set[int] = set()
        self._streamed: set[int] = set()
        self._kept: dict[int, list[tuple[UseRecord, UseFactors] | Tensor]] = {}
        self._kept_whole: set[int] = set()
        self.complete = True
        self.numels = numels
        self.samples = samples
        self.rows = rows
        self.diagonal = diagonal
        self.max_pair_elements = max_pair_elements
        self._acts: list[Tensor | None] = []
        self._act_factors: dict[tuple[int, int], Factor] = {}
        self._jacobians: dict[int, Tensor] = {}
        self._grams: dict[int, Tensor] = {}
        self._cot_grams: dict[Any, Tensor] = {}
        self._ghost_cots: dict[tuple[int, int], list[Tensor]] = {}

    def set_acts(self, acts: Sequence[Tensor]) -> None:
        """The recorded activations, each with a leading sample dim.

        With ``consume``, the caller lets go of its own references for them to be freed.
        """
        self._acts = list(acts)

    def _act_factor(self, key: tuple[int, int], use: UseRecord) -> Factor:
        factor = self._act_factors.get(key)
        if factor is None:
            assert use.act is not None
            tensor = use.layout.act_factor(self._act(use.act), 1)
            if not use.shape.act_is_index:
                tensor = self._cast(tensor)
            factor = Factor(tensor, "index" if use.shape.act_is_index else "act")
            self._act_factors[key] = factor
        return factor

    def _act(self, index: int) -> Tensor:
        act = self._acts[index]
        assert act is not None, "an activation was let go before its last reader"
        return act

    def _cot_tensor(self, use: UseRecord, tap_cots: Sequence[Tensor | None]) -> Tensor | None:
        raw = tap_cots[use.tap]
        if raw is None:
            return None
        act_raw = self._act(use.act) if use.act is not None else None
        return self._cast(use.layout.cot_factor(raw, 2, act_raw))

    def _cast(self, tensor: Tensor) -> Tensor:
        return tensor if self.dtype is None else tensor.to(self.dtype)

    def _factors(self, key: tuple[int, int], use: UseRecord, cot: Tensor,
                 complete: bool = False) -> UseFactors:
        cot_factor = Factor(cot, "cot", (use.tap, id(use.layout)) if complete else None)
        if use.role == "bias":
            return UseFactors(cot_factor, cot_factor)
        act = self._act_factor(key, use)
        factors = UseFactors(act, cot_factor) if use.act_first else UseFactors(cot_factor, act)
        return drop_dead_positions(factors) if self._hinted(key) else factors

    def _hinted(self, key: tuple[int, int]) -> bool:
        """Whether the trace found positions of use ``key`` that the rows do not reach."""
        plan = self._plan_of.get(key[0])
        return plan is not None and key[1] < len(plan.uses) and plan.uses[key[1]].live is not None

    def add_rows(self, start: int, stop: int, tap_cots: Sequence[Tensor | None],
                 carrier_grads: dict[int, Tensor]) -> None:
        """Consume rows ``start:stop``: tap cotangents ``[c, B, *y]`` and carrier gradients.

        ``carrier_grads[leaf]`` is ``[c, B, *leaf.shape]``: the Jacobian of the leaf's
        unrecognised uses.
        """
        if self.keep:
            self._keep(start, stop, tap_cots, carrier_grads)
        complete = start == 0 and stop == self.rows
        lifetimes = self._new_lifetimes() if self.consume and complete else None
        for plan in self.plans:
            self._add_leaf(plan, start, stop, tap_cots, carrier_grads)
            if lifetimes is not None:
                self._release(lifetimes, plan.leaf, None)

    # -- NOTE [streamed taps]: the cotangents of all rows, one tap at a time --------------------

    def start_stream(self, taps: int, carrier_leaves: Sequence[int]) -> None:
        """Rows ``0:R`` come in one backward, tap by tap (:meth:`add_tap`), then carriers.

        Needs ``consume``. ``carrier_leaves``: the leaves whose contraction also waits for
        their carriers' gradients (:meth:`finish_stream`).
        """
        assert self.consume, "a streamed pass needs a consuming contraction"
        self._stream_cots = [None] * taps
        self._stream_lifetimes = self._new_lifetimes()
        self._stream_waits = set(carrier_leaves)
        self._streamed = set()

    def add_tap(self, tap: int, cot: Tensor | None) -> None:
        """Tap ``tap``'s cotangent ``[R, B, *y]`` (``None``: zero); contracts what it completes."""
        lifetimes = self._stream_lifetimes
        assert lifetimes is not None, "start_stream first"
        self._stream_cots[tap] = cot
        if cot is not None:
            self.streamed_bytes += cot.numel() * cot.element_size()
        for leaf in lifetimes.arrived(tap):
            if leaf not in self._stream_waits:
                self._stream_leaf(leaf, {})

    def finish_stream(self, carrier_grads: dict[int, Tensor]) -> None:
        """The backward is over: contract the leaves still waiting (carriers, unreached taps)."""
        for plan in self.plans:
            if plan.leaf not in self._streamed:
                self._stream_leaf(plan.leaf, carrier_grads)
        self._stream_cots, self._stream_lifetimes = [], None

    def _stream_leaf(self, leaf: int, carrier_grads: dict[int, Tensor]) -> None:
        lifetimes = self._stream_lifetimes
        assert lifetimes is not None
        self._add_leaf(self._plan_of[leaf], 0, self.rows, self._stream_cots, carrier_grads)
        self._streamed.add(leaf)
        self._release(lifetimes, leaf, self._stream_cots)

    def _new_lifetimes(self) -> Lifetimes:
        return Lifetimes(self.uses, [plan.leaf for plan in self.plans])

    def _release(self, lifetimes: Lifetimes, leaf: int,
                 tap_cots: list[Tensor | None] | None) -> None:
        """Let go of what only ``leaf`` still read (``tap_cots``: cotangents this owns)."""
        taps, acts = lifetimes.done(leaf)
        if tap_cots is not None:
            for tap in taps:
                tap_cots[tap] = None
        for act in acts:
            self._acts[act] = None
        for key in [key for key in self._act_factors if key[0] == leaf]:
            del self._act_factors[key]

    def _add_leaf(self, plan: LeafPlan, start: int, stop: int,
                  tap_cots: Sequence[Tensor | None], carrier_grads: dict[int, Tensor]) -> None:
        """Rows ``start:stop`` of one leaf (:meth:`add_rows`)."""
        complete = start == 0 and stop == self.rows
        if plan.way in ("ghost", "sparse"):
            for k, use in enumerate(self.uses.get(plan.leaf, ())):
                cot = self._cot_tensor(use, tap_cots)
                pieces = self._ghost_cots.setdefault((plan.leaf, k), [])
                if cot is not None:
                    pieces.append(cot)
            if self.consume and complete:  # the block now, and its factors go
                assert self.dtype is not None
                block = (self._ghost_block(plan, self.dtype) if plan.way == "ghost"
                         else self._sparse_block(plan))
                if block is not None:
                    self._grams[plan.leaf] = block
            return
        if plan.way == "unused":
            return
        numel = self.numels[plan.leaf]
        part: Tensor | None = carrier_grads.pop(plan.leaf, None)
        owned = False  # whether part is a tensor made here (not the carrier's gradient)
        uses = self.uses.get(plan.leaf, ())
        if part is not None:  # [c, B, *leaf.shape]: in the leaf's layout if others add to it
            # or if other row chunks add to it (their backward may lay the gradient out
            # otherwise: NOTE [columns of row chunks]); alone and whole, in memory order
            part = self._cast(part.reshape(*part.shape[:2], -1) if uses or not complete
                              else flat_rows(part))
        if complete and part is None and len(uses) == 1 and uses[0].role == "bias":
            cot = self._cot_tensor(uses[0], tap_cots)
            if cot is None:
                return
            if cot.shape[2] * cot.shape[3] == 1:
                # a bias without positions (per sample): its Jacobian is the cotangent
                factor = Factor(cot, "cot", (uses[0].tap, id(uses[0].layout)))
                self._grams[plan.leaf] = single_position_cot_gram(
                    factor, factor, self.diagonal, self._cot_grams)
                return
        items = []
        for k, use in enumerate(uses):
            raw = tap_cots[use.tap]
            if raw is None:
                continue
            act_raw = self._act(use.act) if use.act is not None else None
            if act_raw is not None and act_raw.is_floating_point():
                act_raw = self._cast(act_raw)
            jac = use.layout.materialize(act_raw, self._cast(raw), use.role == "bias")
            if jac is not None:  # straight from the raw tensors
                part, owned = (jac, False) if part is None else (part + jac, True)
                continue
            cot = self._cast(use.layout.cot_factor(raw, 2, act_raw))
            items.append((use, self._factors((plan.leaf, k), use, cot)))
        merged = together(items)
        if complete and part is None and not self.keep and len(merged) == 1 \
                and chunked_gram_applies(*merged[0]):  # NOTE [Gram by column chunks]
            use, factors = merged[0]
            self._grams[plan.leaf] = chunked_gram(factors, use.shape.act_width, self.diagonal,
                                                  self.max_jacobian_bytes, self._workspace)
            return
        # lookups last, to add into the others' Jacobian: NOTE [Jacobians of several uses]
        for use, factors in sorted(merged, key=_is_lookup):
            part = materialize_use(use, factors, numel, into=part, may_write=owned)
            owned = True
        if part is None:
            return
        kept = self.keep and complete and bool(uses) and self._keep_jacobian(plan.leaf, part)
        store = self._jacobians.get(plan.leaf)
        if store is None and complete:  # all rows at once: Gram and free
            self._grams[plan.leaf] = gram_of_rows(part, self.diagonal)
        else:
            if store is None:
                store = self._jacobians[plan.leaf] = part.new_zeros(self.rows, self.samples,
                                                                    numel)
            store[start:stop] += part
        if not kept:
            give_back(part)  # if it is the scratch's latest loan (NOTE [scratch memory])

    def _keep(self, start: int, stop: int, tap_cots: Sequence[Tensor | None],
              carrier_grads: dict[int, Tensor]) -> None:
        """Keep what ``Jᵀ w`` needs (one chunk of all rows only)."""
        if not (start == 0 and stop == self.rows):
            self.complete = False
            return
        for plan in self.plans:
            kept = self._kept.setdefault(plan.leaf, [])
            if plan.leaf in carrier_grads:
                kept.append(carrier_grads[plan.leaf])
            for k, use in enumerate(self.uses.get(plan.leaf, ())):
                cot = self._cot_tensor(use, tap_cots)
                if cot is None:
                    continue
                shape = use.shape
                if plan.way == "materialize" and use.role == "weight" \
                        and use.layout.fused_jacobian(shape.positions) \
                        and shape.act_width * shape.cot_width \
                        <= shape.positions * (shape.act_width + shape.cot_width):
                    # materialize forms its Jacobian without the factors (a convolution's
                    # patches), and it is no larger than they would be (NOTE [Jᵀw from kept
                    # Jacobians]): that Jacobian is kept, the factors are never formed
                    self._kept_whole.add(plan.leaf)
                    continue
                kept.append((use, self._factors((plan.leaf, k), use, cot)))

    def _keep_jacobian(self, leaf: int, jacobian: Tensor) -> bool:
        """Keep a leaf's whole Jacobian instead of its factors if not much larger (whether kept).

        Always where some of its factors were never formed (:meth:`_keep`).
        """
        kept = self._kept.get(leaf)
        if leaf in self._kept_whole:
            self._kept[leaf] = [jacobian]
            return True
        if not kept:
            return False
        factors: list[Tensor] = []
        for item in kept:
            factors.extend([item] if isinstance(item, Tensor)
                           else [item[1].first.tensor, item[1].second.tensor])
        if keeps_jacobian(jacobian, factors):  # NOTE [Jᵀw from kept Jacobians]
            self._kept[leaf] = [jacobian]
            return True
        return False

    def pullback(self, weights: Tensor) -> list[Tensor | None]:
        """``Jᵀ w`` per leaf (flattened; ``None`` where zero), for ``weights [R, B]``.

        Needs ``keep=True`` and all rows in one chunk (:attr:`complete`).
        """
        grads: list[Tensor | None] = [None] * len(self.numels)
        for leaf, kept in self._kept.items():
            for item in kept:
                if isinstance(item, Tensor):  # Jacobians [R, B, *leaf.shape] (a carrier's)
                    piece = weighted_rows(weights, item)
                else:
                    piece = pullback_use(item[0], item[1], weights, self.numels[leaf])
                current = grads[leaf]
                grads[leaf] = piece if current is None else current + piece
        return grads

    def blocks(self, dtype: torch.dtype) -> Iterator[tuple[int, Tensor]]:
        """``(leaf, block)`` for every leaf with a non-zero contribution, freeing as it goes."""
        for plan in self.plans:
            block: Tensor | None
            if plan.leaf in self._grams:
                block = self._grams.pop(plan.leaf)
            elif plan.way == "ghost":
                block = self._ghost_block(plan, dtype)
            elif plan.way == "sparse":
                block = self._sparse_block(plan)
            else:
                jacobian = self._jacobians.pop(plan.leaf, None)
                block = None if jacobian is None else gram_of_rows(jacobian, self.diagonal)
            if block is not None:
                yield plan.leaf, block

    def _sparse_block(self, plan: LeafPlan) -> Tensor | None:
        indices, cots = [], []
        for k, use in enumerate(self.uses.get(plan.leaf, ())):
            pieces = self._ghost_cots.pop((plan.leaf, k), [])
            if pieces:
                cots.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces))
                indices.append(self._act_factor((plan.leaf, k), use).tensor)
        if not cots:
            return None
        return sparse_embedding_gram(indices, cots, self.uses[plan.leaf][0].shape.act_width,
                                     self.diagonal)

    def _ghost_block(self, plan: LeafPlan, dtype: torch.dtype) -> Tensor | None:
        items = []
        for k, use in enumerate(self.uses.get(plan.leaf, ())):
            pieces = self._ghost_cots.pop((plan.leaf, k), [])
            if not pieces:
                continue
            cot = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            items.append((use, self._factors((plan.leaf, k), use, cot, complete=True)))
        # per-sample positions × groups of each (merged) use, from its cotangent
        # [R, B, T, G, c] (the run's use records count the positions of the whole batch in a
        # batched pass)
        factors: list[tuple[UseFactors, int]] = []
        for _, merged in together(items):  # NOTE [uses taken together]
            cot_factor = merged.first if merged.first.kind == "cot" else merged.second
            factors.append((merged, cot_factor.tensor.shape[2] * cot_factor.tensor.shape[3]))
        return ghost_block(factors, self.rows, self.samples, self.diagonal, dtype,
                           self.max_pair_elements, self._cot_grams)


# NOTE [centered positions]
# The ghost form of a use over positions, ⟨J_b, J_c⟩ = Σ_{t,s} ⟨x_bt, x_cs⟩ ⟨g_bt, g_cs⟩, sums
# products of the size of |x̄|² |g|² where J_b = Σ_t g_bt ⊗ x_bt may be far smaller: inputs
# sharing a large common part x̄ (an offset, the residual stream's shared direction) met with
# cotangents that cancel over the positions (softmax's keys, a norm over the positions, a
# trained minimum). In float32 the block then carries round-off of eps (|x̄| / std x)², where
# a plain backward's J carries eps |x̄| / std x: auto and structured gave per-sample squared
# norms 8.8e-2 off (relative) where float32 jacrev is 2.2e-6 off, at inputs 10 + 0.01 noise
# (session 67's hunt; full blocks 0.27 off at a mean of 1000 times the spread). Such a use is
# contracted centered. With m, n the means over positions of x_b and g_b, d_t = x_bt - m,
# e_t = g_bt - n, S = Σ_t x_bt and D = Σ_t e_t, the identity
#     J_b = Σ_t (n + e_t) ⊗ x_bt = n ⊗ S + Σ_t e_t ⊗ (m + d_t) = Σ_t e_t ⊗ d_t + n ⊗ S + D ⊗ m
# gives T + 1 positions (e_t with d_t, n with S) whose pairwise products stay of the size of
# the result. D is zero but for the round-off of the mean, and D ⊗ m of the size of the
# round-off a plain backward's J carries (eps |m| |g|): left out, it would cost a position
# (the review: (T + 2)² / T², 2-3× at T = 2 to 6). Used where a factor's mean over the
# positions holds most of its squared norm (above _COMMON_SHARE: 0.9, a mean above 3 spreads;
# float64, with 1e-16 to spare, from 0.9999), at the cost of a position and one read of the
# factors; not in float16, whose sums of the positions overflow.


def centered(factors: UseFactors, positions: int) -> tuple[UseFactors, int]:
    """A use's factors over ``T + 2`` centered positions where the ghost form needs them.

    NOTE [centered positions]; ``positions`` (per sample, times the groups) grows with them.
    Factors of one position, shared by both sides, or an embedding's indices are kept.
    """
    first, second = factors.first, factors.second
    if first is second or first.kind == "index" or second.kind == "index":
        return factors, positions
    cot, act = (first, second) if first.kind == "cot" else (second, first)
    if cot.kind != "cot" or act.kind != "act":
        return factors, positions
    steps = cot.tensor.shape[2]
    if steps < 2 or act.tensor.shape[1] != steps or act.tensor.requires_grad \
            or cot.tensor.requires_grad:
        return factors, positions
    dtype = torch.promote_types(act.tensor.dtype, cot.tensor.dtype)
    threshold = _COMMON_SHARE.get(dtype, 0.9)
    if dtype == torch.float16 or not any(
            share > threshold for share in _common_shares(((act.tensor, 1), (cot.tensor, 2)))):
        return factors, positions
    x_mean = act.tensor.mean(1, keepdim=True)
    g_mean = cot.tensor.mean(2, keepdim=True)
    # J = Σ_t g_t ⊗ x_t = Σ_t e_t ⊗ d_t + n ⊗ S (+ D ⊗ m, D = Σ_t e_t: round-off of the mean)
    act_centered = Factor(torch.cat([act.tensor - x_mean, act.tensor.sum(1, keepdim=True)],
                                    dim=1), "act")
    cot_centered = Factor(torch.cat([cot.tensor - g_mean, g_mean], dim=2), "cot")
    groups = cot.tensor.shape[3]
    result = (UseFactors(cot_centered, act_centered) if first.kind == "cot"
              else UseFactors(act_centered, cot_centered))
    return result, positions + groups


_COMMON_SHARE = {torch.float64: 0.9999}
"""Above this share of a factor's squared norm in its mean over positions, a use is contracted
centered (NOTE [centered positions]); other dtypes: 0.9 (float16 never: its sums of the
positions overflow where the plain form is finite; session 67's review)."""


def _common_shares(factors: Sequence[tuple[Tensor, int]]) -> list[float]:
    """``T |mean_t f|² / Σ_t |f_t|²`` of each factor ``f`` over its positions' ``dim``.

    The share of its squared norm in its mean (0 for a zero factor; NaN where a norm is not
    finite, which the caller's comparison reads as no share), in float32 at least (a float16
    norm overflowed), read to the host at once.
    """
    with torch.no_grad():
        shares = []
        for tensor, dim in factors:
            wide = torch.promote_types(tensor.dtype, torch.float32)
            total = torch.linalg.vector_norm(tensor, dtype=wide).square()  # (no copy)
            common = torch.linalg.vector_norm(tensor.sum(dim, dtype=wide)).square() \
                / tensor.shape[dim]
            shares.append(torch.where(total > 0, common / total, 0.0))
        return [float(share) for share in torch.stack(shares).tolist()]


def ghost_block(factors: Sequence[tuple[UseFactors, int]], rows: int, samples: int,
                diagonal: bool, dtype: torch.dtype, max_pair_elements: int = DEFAULT_PAIR_ELEMENTS,
                cache: dict[Any, Tensor] | None = None) -> Tensor | None:
    """A leaf's ghost block ``[R, B, R, B]`` (``[R, B]``) from its uses' factors.

    ``factors``: per use, its factors and its positions × groups per sample. Every ordered
    pair of uses is contracted (the cross terms of a leaf used several times), each pair
    row-chunked so that one block stays under ``max_pair_elements``.
    """
    total: Tensor | None = None
    factors = [centered(u, pos) for u, pos in factors]  # NOTE [centered positions]
    for i, (u, pos_u) in enumerate(factors):
        for j in range(i, len(factors)):
            v, pos_v = factors[j]
            block = _pair_chunked(u, v, rows, samples, max(pos_u, pos_v), diagonal, dtype,
                                  max_pair_elements, cache)
            if i != j:
                block = 2 * block if diagonal else block + block.permute(2, 3, 0, 1)
            total = block if total is None else total + block
    return total


def to_row_major(block: Tensor, diagonal: bool) -> Tensor:
    """A block ``[R, B, R, B]`` (``[R, B]``) as ``[m, m]`` (``[m]``), rows in ``(r, b)`` order."""
    rows, samples = block.shape[:2]
    m = rows * samples
    return block.reshape(m) if diagonal else block.reshape(m, m)
