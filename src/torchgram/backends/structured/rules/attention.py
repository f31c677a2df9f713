"""Seeing inside ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``).

# NOTE [attention rewrite]
A ``TorchFunctionMode`` sees the call to ``F.multi_head_attention_forward`` but not the ops
inside it, so its weights would all need the fallback. For plain self-attention (query, key
and value one tensor; packed input projection; no masks, extra key/value biases, zero
attention or active dropout) the call is *rewritten* while the mode is active: the same
math written with ``F.linear`` for the projections, so the rules see them::

    q, k, v = linear(x, W_in, b_in).chunk(3)           per head: [B, H, T, E/H]
    a = softmax(q kᵀ / √(E/H)) v                       (scaled_dot_product_attention)
    y = linear(a, W_out, b_out)                        back to [T, B, E]

Both projections keep the sequence and batch dims separate (``[T, B, ·]``), so a sample's
positions stay one slice of the batch dimension. Anything else (cross-attention, where the
packed weight is split; masks; ``bias_k``/``bias_v``; dropout) is left to the original
function, and its parameters to the fallback. Results are exact either way; the oracle
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
    if a["add_zero_attn"] or a["is_causal"] or (a["training"] and a["dropout_p"] > 0):
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
        return _rewritten(a)


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
