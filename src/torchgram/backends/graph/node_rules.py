"""Per-sample rows of common layers' parameters, from the tensors autograd saved.

# NOTE [node rules]
The sample-sparse walk (NOTE [sample-sparse walk]) needs, where a node's edge leads from a
tensor that carries the samples to one that does not (a parameter), the *expanded* rows:
row ``(k, b)`` is the node's vector-Jacobian product with direction ``k``'s cotangent on
sample ``b``'s slice only. Calling the node on ``B`` masked cotangents costs ``B`` times the
node's backward. For the layers whose parameter gradient is a sum over positions, the same
rows come from one batched product over the samples' own slices of what the node saved:

* ``AddmmBackward0`` / ``MmBackward0`` (``nn.Linear``, ``x @ W``): ``grad W[(k, b)] =
  α · x_bᵀ g_(k, b)`` for samples along the rows (or ``g W_bᵀ`` for samples along the
  columns, ``W @ x``), ``grad bias[(k, b)] = β · Σ_t g_(k, b, t)``;
* ``ConvolutionBackward0`` (not transposed): the patches of sample ``b``'s input against its
  cotangent, per group (the structured conv rule's factors, NOTE [factors]); the bias sums
  over positions;
* ``EmbeddingBackward0``: sample ``b``'s cotangents added into the rows of its indices
  (``padding_idx`` gets none; ``scale_grad_by_freq`` couples samples: no rule);
* ``NativeLayerNormBackward0``: ``Σ_t x̂ ⊙ g`` and ``Σ_t g`` over sample ``b``'s positions,
  ``x̂`` from the saved input, mean and reciprocal deviation;
* ``AddBackward0`` / ``SubBackward0`` / ``MulBackward0`` with an operand broadcast over the
  samples (a bias added, a scale multiplied): sample ``b``'s cotangent (times the other,
  saved, operand for a product) summed to that operand's shape.

Complex operands enter conjugated, as in torch's formulas (``grad · other̄``, ``grad @ W̄ᵀ``,
``x̄ᵀ @ grad``): without it, a complex layer's rows were those of another function (the eager
G with ``batch_dim`` 0.28 to 1.01 off on a complex ``x @ W`` or ``x * w``; session 59).

A rule applies only when every expanded edge the walk asks for is one it computes, with the
samples where it expects them; otherwise the node is called on the masked rows. The saved
tensors are read through ``_torch_compat.saved`` (unpacking them: under a non-reentrant
checkpoint that recomputes them, as a backward would).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from torchgram._core import _torch_compat
from torchgram._core._torch_compat import Node
from torchgram.backends.eager.samples import SampleLayout
from torchgram.backends.graph.nodes import Edge, node_name
from torchgram.backends.structured.rules.conv import ConvLayout

Compact = tuple[Tensor, SampleLayout | None]
"""A slot's compact rows ``[c, *slot]`` and the samples' layout there."""

Rule = Callable[[Node, Sequence["Compact | None"], list[int], int],
                "dict[int, Tensor] | None"]


def expanded_by_rule(node: Node, compact: Sequence[Compact | None],
                     edges: Sequence[Edge | None], samples: int) -> list[Tensor | None] | None:
    """Expanded rows ``[c·B, *edge]`` on ``edges``, or ``None`` when no rule applies."""
    rule = _RULES.get(node_name(node))
    if rule is None or len(compact) != 1 or compact[0] is None or compact[0][1] is None:
        return None
    wanted = [k for k, edge in enumerate(edges) if edge is not None]
    try:
        found = rule(node, compact, wanted, samples)
    except RuntimeError as error:
        if _torch_compat.is_freed_graph_error(error):
            raise
        return None
    if found is None or set(found) != set(wanted):
        return None
    out: list[Tensor | None] = [None] * len(edges)
    for k, rows in found.items():
        edge = edges[k]
        assert edge is not None
        meta = _torch_compat.slot_metadata(edge[0])[edge[1]]
        if tuple(rows.shape[1:]) != meta.shape:
            return None
        if rows.is_complex() and not meta.dtype.is_complex:  # a real operand: torch keeps
            rows = rows.real  # the real part of its complex gradient (no cast warning)
        out[k] = rows.to(dtype=meta.dtype, device=meta.device)
    return out


def _matmul_rows(g: Tensor, layout: SampleLayout, samples: int, left: Tensor | None,
                 right: Tensor | None, alpha: float, wanted: list[int], first: int,
                 bias: int | None, beta: float) -> dict[int, Tensor] | None:
    """Rows of ``out = β·bias + α·left @ right`` (``g: [c, N, n]``) on the edges in ``wanted``.

    ``first`` is the edge index of ``left`` (``right`` is ``first + 1``).
    """
    count = g.shape[0]
    found: dict[int, Tensor] = {}
    for k in wanted:
        if k == first + 1 and layout.dim == 0 and left is not None:  # grad of right
            per_g = layout.view(g, 1, samples)  # [c, B, N/B, n]
            per_x = layout.view(left, 0, samples).to(g.dtype).conj()  # [B, N/B, d]
            rows = _batched(per_x.transpose(1, 2), per_g, alpha)  # [c, B, d, n]
            found[k] = rows.reshape(count * samples, *rows.shape[2:])
        elif k == first and layout.dim == 1 and right is not None:  # grad of left
            per_g = layout.view(g, 1, samples)  # [c, B, N, n/B]
            per_w = layout.view(right, 0, samples).to(g.dtype).conj()  # [B, d, n/B]
            rows = _batched(per_w, per_g.transpose(-1, -2), alpha).transpose(-1, -2)
            found[k] = rows.reshape(count * samples, *rows.shape[2:])
        elif bias is not None and k == bias and layout.dim == 0:
            per_g = layout.view(g, 1, samples)  # [c, B, N/B, n]
            found[k] = (beta * per_g.sum(2)).reshape(count * samples, -1)
        else:
            return None
    return found


def _batched(left: Tensor, right: Tensor, alpha: float) -> Tensor:
    """``α · left[b] @ right[k, b]`` (``left [B, i, t]``, ``right [c, B, t, j]``): ``[c, B, i, j]``.

    One ``bmm`` over the samples, the directions side by side (the product of a sample's
    own slices: the cost of one weight gradient, not ``B``).
    """
    count, samples, inner, cols = right.shape
    stacked = right.permute(1, 2, 0, 3).reshape(samples, inner, count * cols)
    out = torch.bmm(left, stacked)
    if alpha != 1.0:
        out = out.mul_(alpha)
    return out.reshape(samples, left.shape[1], count, cols).permute(2, 0, 1, 3)


def _addmm(node: Node, compact: Sequence[Compact | None], wanted: list[int],
           samples: int) -> dict[int, Tensor] | None:
    g, layout = compact[0]  # type: ignore[misc]
    if layout is None or g.dim() != 3:
        return None
    left = _torch_compat.saved(node, "mat1") if 2 in wanted else None
    right = _torch_compat.saved(node, "mat2") if 1 in wanted else None
    if 0 in wanted and tuple(_torch_compat.slot_metadata(node.next_functions[0][0])[
            node.next_functions[0][1]].shape) != (g.shape[-1],):
        return None  # a bias of another shape than [n]
    return _matmul_rows(g, layout, samples, left, right,
                        float(_torch_compat.saved(node, "alpha")), wanted, 1, 0,
                        float(_torch_compat.saved(node, "beta")))


def _mm(node: Node, compact: Sequence[Compact | None], wanted: list[int],
        samples: int) -> dict[int, Tensor] | None:
    g, layout = compact[0]  # type: ignore[misc]
    if layout is None or g.dim() != 3:
        return None
    left = _torch_compat.saved(node, "self") if 1 in wanted else None
    right = _torch_compat.saved(node, "mat2") if 0 in wanted else None
    return _matmul_rows(g, layout, samples, left, right, 1.0, wanted, 0, None, 1.0)


def _convolution(node: Node, compact: Sequence[Compact | None], wanted: list[int],
                 samples: int) -> dict[int, Tensor] | None:
    g, layout = compact[0]  # type: ignore[misc]
    if layout != SampleLayout(0) or 0 in wanted or _torch_compat.saved(node, "transposed"):
        return None
    x = _torch_compat.saved(node, "input")
    nd = x.dim() - 2
    if nd < 1 or g.dim() != nd + 3:
        return None
    count, found = g.shape[0], {}
    per_g = g.reshape(count, samples, 1, *g.shape[2:])  # [c, B, 1, C_out, *spatial]
    if 1 in wanted:
        weight_shape = _torch_compat.slot_metadata(node.next_functions[1][0])[
            node.next_functions[1][1]].shape
        groups = int(_torch_compat.saved(node, "groups"))
        kernel = tuple(weight_shape[2:])
        padding = tuple((p, p) for p in _torch_compat.saved(node, "padding"))
        conv = ConvLayout(nd, c_in=x.shape[1], c_out=weight_shape[0], groups=groups,
                          kernel=kernel, stride=tuple(_torch_compat.saved(node, "stride")),
                          padding=padding, dilation=tuple(_torch_compat.saved(node,
                                                                              "dilation")))
        act = conv.act_factor(x.to(g.dtype).reshape(samples, 1, *x.shape[1:]), 1)
        cot = conv.cot_factor(per_g, 2, None)  # [c, B, T, G, C_out/G]
        rows = torch.einsum("kbtgo,btga->kbgoa", cot, act)
        found[1] = rows.reshape(count * samples, *weight_shape)
    if 2 in wanted:
        found[2] = per_g.sum(tuple(range(4, per_g.dim()))).reshape(count * samples, -1)
    return found


def _embedding(node: Node, compact: Sequence[Compact | None], wanted: list[int],
               samples: int) -> dict[int, Tensor] | None:
    g, layout = compact[0]  # type: ignore[misc]
    if layout is None or wanted != [0] or _torch_compat.saved(node, "scale_grad_by_freq") \
            or _torch_compat.saved(node, "sparse"):
        return None
    index = _torch_compat.saved(node, "indices")
    if layout.dim >= index.dim():
        return None
    classes = int(_torch_compat.saved(node, "weight_sym_argsize_0"))
    padding = int(_torch_compat.saved(node, "padding_idx"))
    count, dim = g.shape[0], g.shape[-1]
    per_index = layout.view(index, 0, samples).reshape(samples, -1)  # [B, T]
    per_g = layout.view(g, 1, samples).reshape(count, samples, -1, dim)  # [c, B, T, d]
    if 0 <= padding < classes:
        per_g = per_g * (per_index != padding)[None, :, :, None].to(g.dtype)
    offsets = (per_index[None] + classes * torch.arange(count * samples, device=g.device)
               .reshape(count, samples, 1))
    table = g.new_zeros(count * samples * classes, dim)
    table.index_add_(0, offsets.reshape(-1), per_g.reshape(-1, dim))
    return {0: table.reshape(count * samples, classes, dim)}


def _layer_norm(node: Node, compact: Sequence[Compact | None], wanted: list[int],
                samples: int) -> dict[int, Tensor] | None:
    g, layout = compact[0]  # type: ignore[misc]
    if layout is None or 0 in wanted:
        return None
    shape = tuple(_torch_compat.saved(node, "normalized_shape"))
    if layout.dim >= g.dim() - 1 - len(shape):
        return None
    count = g.shape[0]
    per_g = layout.view(g, 1, samples)
    lead = tuple(range(2, per_g.dim() - len(shape)))
    found: dict[int, Tensor] = {}
    if 1 in wanted:
        x = _torch_compat.saved(node, "input")
        mean, rstd = _torch_compat.saved(node, "result1"), _torch_compat.saved(node, "result2")
        normed = ((x - mean) * rstd).to(g.dtype)
        per_x = layout.view(normed, 0, samples)
        found[1] = (per_g * per_x).sum(lead).reshape(count * samples, *shape)
    if 2 in wanted:
        found[2] = per_g.sum(lead).reshape(count * samples, *shape)
    return found


def _edge_shape(node: Node, k: int) -> tuple[int, ...]:
    child, nr = node.next_functions[k]
    return tuple(_torch_compat.slot_metadata(child)[nr].shape)


def _reduce_rows(rows: Tensor, shape: tuple[int, ...]) -> Tensor | None:
    """Each row ``[*s]`` of ``rows [n, *s]`` summed to the broadcast operand's ``shape``."""
    per_row = rows.shape[1:]
    if len(shape) > len(per_row):
        return None
    padded = (1,) * (len(per_row) - len(shape)) + shape
    if any(p not in (1, s) for p, s in zip(padded, per_row, strict=True)):
        return None
    dims = [1 + i for i, (p, s) in enumerate(zip(padded, per_row, strict=True)) if p != s]
    summed = rows.sum(dims, keepdim=True) if dims else rows
    return summed.reshape(rows.shape[0], *shape)


def _elementwise(factor: Callable[[Node, int], Tensor | float | None]) -> Rule:
    """A rule for ``self ∘ other`` nodes whose shared operand is broadcast over the samples."""

    def rule(node: Node, compact: Sequence[Compact | None], wanted: list[int],
             samples: int) -> dict[int, Tensor] | None:
        g, layout = compact[0]  # type: ignore[misc]
        if layout is None:
            return None
        count = g.shape[0]
        found = {}
        for k in wanted:
            shape = _edge_shape(node, k)
            offset = g.dim() - 1 - len(shape)  # the operand's dims align on the right
            if layout.dim >= offset and shape[layout.dim - offset] != 1:
                return None  # the operand itself varies along the samples: not shared
            scale = factor(node, k)
            if scale is None:
                return None
            per_g = layout.view(g, 1, samples)  # [c, B, *per sample]
            if isinstance(scale, Tensor):
                if scale.dim() > g.dim() - 1:
                    return None
                scale = layout.view(scale.expand(g.shape[1:]), 0, samples)
            rows = (per_g * scale).reshape(count * samples, *per_g.shape[2:])
            reduced = _reduce_rows(rows, shape)
            if reduced is None:
                return None
            found[k] = reduced
        return found

    return rule


def _add_factor(node: Node, k: int) -> float:
    return 1.0 if k == 0 else float(_torch_compat.saved(node, "alpha"))


def _sub_factor(node: Node, k: int) -> float:
    return 1.0 if k == 0 else -float(_torch_compat.saved(node, "alpha"))


def _mul_factor(node: Node, k: int) -> Tensor | None:
    other = _torch_compat.saved(node, "other" if k == 0 else "self")
    return other.conj() if isinstance(other, Tensor) else None  # torch's grad · other̄


_RULES: dict[str, Rule] = {
    "AddBackward0": _elementwise(_add_factor),
    "SubBackward0": _elementwise(_sub_factor),
    "MulBackward0": _elementwise(_mul_factor),
    "AddmmBackward0": _addmm,
    "MmBackward0": _mm,
    "ConvolutionBackward0": _convolution,
    "EmbeddingBackward0": _embedding,
    "NativeLayerNormBackward0": _layer_norm,
}
"""The rules, by node name (NOTE [node rules])."""
