"""Seeing inside ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``).

# NOTE [attention rewrite]
A ``TorchFunctionMode`` sees the call to ``F.multi_head_attention_forward`` but not the ops
inside it, so its weights would all need the fallback. For plain self-attention (query, key
and value one tensor; packed input projection; no masks, extra key/value biases or zero
attention) the call is *rewritten* while the mode is active: the same
math written with ``F.linear`` for the projections, so the rules see them::

    q, k, v = linear(x, W_in, b_in).chunk(3)           per head: [B, H, T, E/H]
    a = softmax(q kᵀ / √(E/H)) v                       (scaled_dot_product_attention)
    y = linear(a, W_out, b_out)                        back to [T, B, E]

Both projections keep the sequence and batch dims separate (``[T, B, ·]``), so a sample's
positions stay one slice of the batch dimension. With dropout in training mode the rewrite
takes torch's own steps instead, so that it draws the same masks (NOTE [attention dropout];
before session 47 such a call kept the original function: in a function that draws, the
rows of the whole batch, ~34x the backward of ``nn.TransformerEncoderLayer``'s default
dropout 0.1). Anything else (cross-attention, where the packed weight is split; masks;
``bias_k``/``bias_v``) is left to the original function, and its parameters to the
fallback. Results are exact either way; the oracle
tests compare both paths against ``torch.func.jacrev`` of the original module.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


def _supported(a: dict[str, Any]) -> bool:
    query, weight = a["query"], a["in_proj_weight"]
    if not (isinstance(query, Tensor) and a["key"] is query and a["value"] is query):
        return False
    if query.dim() not in (2, 3) or a["use_separate_proj_weight"]:
        return False
    embed = query.shape[-1]
    if not isinstance(weight, Tensor) or tuple(weight.shape) != (3 * embed, embed):
        return False
    if a["embed_dim_to_check"] != embed or embed % a["num_heads"]:
        return False
    if any(a[name] is not None for name in ("bias_k", "bias_v", "key_padding_mask",
                                            "attn_mask", "static_k", "static_v")):
        return False
    if a["add_zero_attn"] or a["is_causal"]:
        return False
    out_weight = a["out_proj_weight"]
    return isinstance(out_weight, Tensor) and tuple(out_weight.shape) == (embed, embed)


def rewrite_multi_head_attention(args: tuple[Any, ...], kwargs: dict[str, Any],
                                 mode: AbstractContextManager[Any] | None = None) -> Any:
    """``F.multi_head_attention_forward(*args, **kwargs)`` rewritten, or ``NotImplemented``.

    The whole rewrite runs in ``mode`` (the tapping mode, when given).

    Example:
        >>> import torch
        >>> mha = torch.nn.MultiheadAttention(8, 2)
        >>> x = torch.randn(5, 3, 8)
        >>> expected, _ = mha(x, x, x, need_weights=False)
        >>> args = (x, x, x, 8, 2, mha.in_proj_weight, mha.in_proj_bias, None, None, False,
        ...         0.0, mha.out_proj.weight, mha.out_proj.bias)
        >>> out, weights = rewrite_multi_head_attention(args, {"need_weights": False})
        >>> torch.allclose(out, expected, atol=1e-6), weights
        (True, None)
    """
    try:
        bound = _SIGNATURE.bind(*args, **kwargs)
    except TypeError:
        return NotImplemented
    bound.apply_defaults()
    a = bound.arguments
    if not _supported(a):
        return NotImplemented
    with mode or contextlib.nullcontext():
        if a["training"] and a["dropout_p"] > 0:
            return _rewritten_with_dropout(a)
        return _rewritten(a)


def takes_torch_steps(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the rewrite of this call takes torch's own steps (NOTE [attention dropout]).

    Its output then has the call's layout, and it draws what the call draws.
    """
    try:
        bound = _SIGNATURE.bind(*args, **kwargs)
    except TypeError:
        return False
    bound.apply_defaults()
    return bool(bound.arguments["training"]) and bound.arguments["dropout_p"] > 0


def _rewritten(a: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
    query = a["query"]
    batched = query.dim() == 3
    x = query if batched else query.unsqueeze(1)
    length, batch, embed = x.shape
    heads = a["num_heads"]
    head_dim = embed // heads

    def split(t: Tensor) -> Tensor:  # [T, B, E] -> [B, H, T, E/H]
        return t.reshape(length, batch, heads, head_dim).permute(1, 2, 0, 3)

    q, k, v = (split(t) for t in F.linear(x, a["in_proj_weight"], a["in_proj_bias"]).chunk(
        3, dim=-1))
    weights = None
    if a["need_weights"]:
        scores = (q * (1.0 / math.sqrt(head_dim))) @ k.transpose(-2, -1)
        weights = torch.softmax(scores, dim=-1)
        attended = weights @ v
        weights = weights.mean(dim=1) if a["average_attn_weights"] else weights
        if not batched:
            weights = weights.squeeze(0)
    else:
        attended = F.scaled_dot_product_attention(q, k, v)
    merged = attended.permute(2, 0, 1, 3).reshape(length, batch, embed)
    out = F.linear(merged, a["out_proj_weight"], a["out_proj_bias"])
    return (out if batched else out.squeeze(1)), weights


def _rewritten_with_dropout(a: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
    """The rewrite with attention dropout: ``F.multi_head_attention_forward``'s own ops.

    NOTE [attention dropout]: the dropout is drawn inside the call (``F.dropout`` of the
    attention weights, or ``scaled_dot_product_attention``'s ``dropout_p``), on tensors laid
    out by the steps before it, and its mask follows that layout. So this rewrite takes
    torch's own steps for packed self-attention without masks, op for op and view for view
    (``unflatten(-1, (3, E)) … contiguous()`` of the input projection, ``[B·H, T, E/H]``
    heads, the same scaling, the same dropout or attention call): the same draws in the same
    order, on every device, and every later draw where a plain call leaves it. Only the
    projections differ, and only in what the rules see: ``F.linear`` keeps the output
    projection's input ``[T, B, E]`` (torch flattens it to ``[T·B, E]``, the same memory), so
    that a sample's positions stay one slice of the batch dim.
    """
    query = a["query"]
    batched = query.dim() == 3
    x = query if batched else query.unsqueeze(1)
    length, batch, embed = x.shape
    heads = a["num_heads"]
    head_dim = embed // heads
    p = a["dropout_p"]
    proj = F.linear(x, a["in_proj_weight"], a["in_proj_bias"])
    proj = proj.unflatten(-1, (3, embed)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
    q, k, v = (t.view(length, batch * heads, head_dim).transpose(0, 1)
               for t in (proj[0], proj[1], proj[2]))
    weights = None
    if a["need_weights"]:
        scores = torch.bmm(q * math.sqrt(1.0 / float(head_dim)), k.transpose(-2, -1))
        scores = F.dropout(torch.softmax(scores, dim=-1), p=p)
        merged = torch.bmm(scores, v).transpose(0, 1).reshape(length, batch, embed)
        weights = scores.view(batch, heads, length, length)
        if a["average_attn_weights"]:
            weights = weights.mean(dim=1)
        if not batched:
            weights = weights.squeeze(0)
    else:
        q, k, v = (t.view(batch, heads, length, head_dim) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, None, p, False)
        merged = attended.permute(2, 0, 1, 3).reshape(length, batch, embed)
    out = F.linear(merged, a["out_proj_weight"], a["out_proj_bias"])
    return (out if batched else out.squeeze(1)), weights
