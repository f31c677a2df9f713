"""Rule for ``conv1d`` / ``conv2d`` / ``conv3d`` (stride, padding, dilation, groups, bias).

A convolution is a linear layer applied at every output position to the input *patch*
under the kernel. With ``W: [C_out, C_in/G, *k]`` seen as ``[G, C_out/G, (C_in/G)·K]``:

    J_W = Σ_t Σ_g g[t, g] ⊗ patch[t, g]          (cotangent first, G groups)
    J_b = Σ_t g[t]

Patches are extracted after the pass, from the saved input: zero padding, then
``Tensor.unfold`` along every spatial dim with a window of ``dilation·(k-1)+1`` and step
``stride``, keeping every ``dilation``-th element (``F.unfold`` for the 2-D symmetric case),
channel-major like the weight's ``(C_in/G, *k)`` flattening.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from torchgram.backends.structured.rules.base import Layout, Match, Operand, Rule


def _tuple(value: Any, nd: int) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * nd
    values = tuple(int(v) for v in value)
    return values * nd if len(values) == 1 else values


def resolve_padding(padding: Any, kernel: tuple[int, ...],
                    dilation: tuple[int, ...]) -> tuple[tuple[int, int], ...] | None:
    """``(left, right)`` zero padding per spatial dim; ``None`` for an unknown spec.

    Example:
        >>> resolve_padding("same", (4, 3), (1, 2))
        ((1, 2), (2, 2))
        >>> resolve_padding(1, (3, 3), (1, 1))
        ((1, 1), (1, 1))
    """
    nd = len(kernel)
    if padding == "valid":
        return ((0, 0),) * nd
    if padding == "same":
        totals = [d * (k - 1) for k, d in zip(kernel, dilation, strict=True)]
        return tuple((t // 2, t - t // 2) for t in totals)
    if isinstance(padding, str):
        return None
    return tuple((p, p) for p in _tuple(padding, nd))


def patches(x: Tensor, kernel: tuple[int, ...], stride: tuple[int, ...],
            padding: tuple[tuple[int, int], ...], dilation: tuple[int, ...]) -> Tensor:
    """Input patches ``[N, C·K, L]`` of ``x: [N, C, *spatial]`` (like ``F.unfold``, any nd).

    Rows are channel-major ``(c, k_1, ..., k_nd)``, like the weight's flattening; the ``L``
    output positions are innermost, which keeps the one copy this makes contiguous.

    Example:
        >>> import torch
        >>> x = torch.randn(2, 3, 5, 5)
        >>> w = torch.randn(4, 3, 2, 2)
        >>> p = patches(x, (2, 2), (2, 2), ((1, 1), (1, 1)), (1, 1))
        >>> y = torch.conv2d(x, w, stride=2, padding=1)
        >>> torch.allclose((w.reshape(4, -1) @ p).reshape(y.shape), y, atol=1e-5)
        True
    """
    nd = len(kernel)
    flat_pad = [p for pair in reversed(padding) for p in pair]
    if any(flat_pad):
        x = F.pad(x, flat_pad)
    for i in range(nd):
        span = dilation[i] * (kernel[i] - 1) + 1
        x = x.unfold(2 + i, span, stride[i])
    if any(d > 1 for d in dilation):
        every_dilation: Any = (..., *(slice(None, None, d) for d in dilation))
        x = x[every_dilation]
    n, c = x.shape[:2]
    # [N, C, L_1..L_nd, k_1..k_nd] -> [N, C, k_1..k_nd, L_1..L_nd]
    order = (0, 1, *range(2 + nd, 2 + 2 * nd), *range(2, 2 + nd))
    positions = math.prod(x.shape[2:2 + nd])
    return x.permute(order).reshape(n, c * math.prod(kernel), positions)


class ConvLayout(Layout):
    """Convolution factors: cotangent ``[T, G, C_out/G]`` first, patches ``[T, G, a]`` second.

    Example:
        >>> import torch
        >>> layout = ConvLayout(2, c_in=4, c_out=6, groups=2, kernel=(3, 3), stride=(1, 1),
        ...                     padding=((1, 1), (1, 1)), dilation=(1, 1))
        >>> layout.act_factor(torch.zeros(7, 1, 4, 5, 5), nlead=1).shape
        torch.Size([7, 25, 2, 18])
        >>> layout.cot_factor(torch.zeros(7, 1, 6, 5, 5), 1, torch.zeros(0)).shape
        torch.Size([7, 25, 2, 3])
    """

    def __init__(self, nd: int, *, c_in: int, c_out: int, groups: int, kernel: tuple[int, ...],
                 stride: tuple[int, ...], padding: tuple[tuple[int, int], ...],
                 dilation: tuple[int, ...]) -> None:
        self.rule = f"conv{nd}d"
        self.act_first = False
        self.nd = nd
        self.c_in, self.c_out, self.groups = c_in, c_out, groups
        self.kernel, self.stride, self.padding, self.dilation = kernel, stride, padding, dilation
        self.act_width = (c_in // groups) * math.prod(kernel)
        self.cot_width = c_out // groups

    def act_factor(self, raw: Tensor, nlead: int) -> Tensor:
        """Patches of the input, positions = (inner batch, output positions)."""
        lead = raw.shape[:nlead]
        x = raw.reshape(-1, self.c_in, *raw.shape[raw.dim() - self.nd:])
        cols = patches(x, self.kernel, self.stride, self.padding, self.dilation)
        n, _, positions = cols.shape
        per_position = cols.view(n, self.groups, self.act_width, positions).permute(0, 3, 1, 2)
        return per_position.reshape(*lead, -1, self.groups, self.act_width)

    def cot_factor(self, raw: Tensor, nlead: int, act_raw: Tensor | None) -> Tensor:
        """Output cotangent, positions = (inner batch, output positions)."""
        del act_raw
        lead = raw.shape[:nlead]
        spatial = math.prod(raw.shape[raw.dim() - self.nd:])
        g = raw.reshape(-1, self.c_out, spatial).transpose(1, 2)
        return g.reshape(*lead, -1, self.groups, self.cot_width)


    @property
    def depthwise(self) -> bool:
        """Whether every group has one input channel (a depthwise convolution, any multiplier)."""
        return self.groups > 1 and self.c_in == self.groups

    def uses_grouped_kernel(self, positions: int) -> bool:
        """Whether :meth:`materialize` uses the grouped weight-gradient kernel (see there)."""
        return not self.depthwise and (self.groups > 1 or (
            positions >= 256 and self.c_in // self.groups >= 8 and math.prod(self.kernel) > 1))

    def fused_jacobian(self, positions: int) -> bool:
        """Whether :meth:`materialize` forms the weight's Jacobian (see there)."""
        return self.depthwise or self.uses_grouped_kernel(positions)

    def materialize(self, act_raw: Tensor | None, cot_raw: Tensor, bias: bool) -> Tensor | None:
        """Per-sample weight gradients as one grouped convolution's weight gradient.

        NOTE [per-sample convolution gradients]: putting the ``B`` samples side by side as
        channel groups (``[n, B·C_in, *]`` input, ``[n, B·C_out, *]`` cotangent, ``B·G``
        groups), the weight gradient of that grouped convolution *is* the ``B`` per-sample
        weight gradients ``[B·C_out, C_in/G, *k]``, from the same kernel the plain backward
        uses, with no patches copied. It is chosen for grouped convolutions and for many
        output positions (``T ≥ 256``, ``C_in/G ≥ 8``), where measured faster than patches
        and a batched matmul (the factor way, used otherwise), except for a ``1×1`` kernel
        (its patches are the input itself; the kernel was measured 10-30% slower there);
        depthwise convolutions have a faster way still (NOTE [per-sample depthwise
        gradients]). A bias sums its cotangent over the positions.
        """
        nd = self.nd
        lead = cot_raw.shape[:2]
        if bias:  # [c, B, (n,) C_out, *spatial] -> [c, B, C_out]
            summed = cot_raw.reshape(*lead, -1, self.c_out, math.prod(cot_raw.shape[-nd:]))
            return summed.sum((2, 4))
        assert act_raw is not None
        if self.depthwise:
            return self._depthwise_gradients(act_raw, cot_raw)
        if not self.uses_grouped_kernel(math.prod(cot_raw.shape[-nd:])):
            return None
        samples = act_raw.shape[0]
        x = act_raw.reshape(samples, -1, self.c_in, *act_raw.shape[-nd:]).transpose(0, 1)
        x = x.reshape(x.shape[0], samples * self.c_in, *x.shape[3:])
        pads = [p for pair in self.padding for p in pair]
        if any(left != right for left, right in self.padding):
            x = F.pad(x, [p for pair in reversed(self.padding) for p in pair])
            pads = [0] * (2 * nd)
        kernel_shape = (samples * self.c_out, self.c_in // self.groups, *self.kernel)
        weight = x.new_zeros(()).expand(kernel_shape)
        rows = []
        for r in range(lead[0]):
            g = cot_raw[r].reshape(samples, -1, self.c_out, *cot_raw.shape[-nd:]).transpose(0, 1)
            g = g.reshape(g.shape[0], samples * self.c_out, *g.shape[3:])
            grad = torch.ops.aten.convolution_backward(
                g, x, weight, None, list(self.stride), pads[::2], list(self.dilation), False,
                [0] * nd, samples * self.groups, [False, True, False])[1]
            rows.append(grad.reshape(samples, -1))
        return torch.stack(rows)

    def _depthwise_gradients(self, act_raw: Tensor, cot_raw: Tensor) -> Tensor:
        """Per-row, per-sample weight gradients ``[c, B, numel]`` of a depthwise convolution.

        NOTE [per-sample depthwise gradients]: with one input channel per group, the weight
        gradient of sample ``b`` is, channel by channel, the correlation of the padded input
        with the cotangent: ``J[b, o, κ] = Σ_t g[b, o, t] · x_pad[b, o // m, κ·dilation +
        t·stride]`` (``m = C_out/C_in``). That is itself a depthwise convolution *forward*:
        input ``[1, B·n·C_in, *padded]``, the cotangents ``[B·n·C_out, 1, *out]`` as its
        kernel, ``B·n·C_in`` groups, stride and dilation swapped; its first ``k`` outputs
        per dim are the gradients (the inner batch ``n`` is then summed). Measured on a CPU
        (MobileNetV3's depthwise layers, 16 samples) 2-10× faster than the grouped
        weight-gradient kernel at few output positions, and as fast at many; patches and a
        product per channel were slower than both.
        """
        nd = self.nd
        samples = act_raw.shape[0]
        x = act_raw.reshape(1, -1, *act_raw.shape[-nd:])  # [1, B·n·C_in, *spatial]
        flat_pad = [p for pair in reversed(self.padding) for p in pair]
        if any(flat_pad):
            x = F.pad(x, flat_pad)
        crop: Any = (..., *(slice(0, k) for k in self.kernel))
        conv = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
        numel = self.c_out * math.prod(self.kernel)
        rows = []
        for r in range(cot_raw.shape[0]):
            g = cot_raw[r].reshape(-1, 1, *cot_raw.shape[-nd:])  # [B·n·C_out, 1, *out]
            grad = conv(x, g, None, self.dilation, 0, self.stride, x.shape[1])[crop]
            rows.append(grad.reshape(samples, -1, numel).sum(1))
        return torch.stack(rows)


class ConvRule(Rule):
    """``torch.conv{1,2,3}d`` (= ``F.conv{1,2,3}d``, ``nn.Conv{1,2,3}d``)."""

    name = "conv"
    funcs = frozenset({torch.conv1d, torch.conv2d, torch.conv3d})
    _ND = {torch.conv1d: 1, torch.conv2d: 2, torch.conv3d: 3}
    _NAMES = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    _DEFAULTS = (None, None, None, 1, 0, 1, 1)

    def match(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Match | None:
        """Recognise a convolution with zero (or ``"same"``/``"valid"``) padding."""
        nd = self._ND[func]
        values = [args[i] if i < len(args) else kwargs.get(name, default)
                  for i, (name, default) in enumerate(zip(self._NAMES, self._DEFAULTS,
                                                          strict=True))]
        x, weight, bias, stride, padding, dilation, groups = values
        if not (isinstance(x, Tensor) and isinstance(weight, Tensor)) or weight.dim() != nd + 2:
            return None
        if x.dim() not in (nd + 1, nd + 2) or not isinstance(groups, int):
            return None
        if bias is not None and (not isinstance(bias, Tensor) or bias.dim() != 1):
            return None
        kernel = tuple(weight.shape[2:])
        dilation_t = _tuple(dilation, nd)
        pads = resolve_padding(padding, kernel, dilation_t)
        if pads is None:
            return None
        layout = ConvLayout(nd, c_in=x.shape[-nd - 1], c_out=weight.shape[0], groups=groups,
                            kernel=kernel, stride=_tuple(stride, nd), padding=pads,
                            dilation=dilation_t)
        operands = [Operand(weight, layout, act=x)]
        if bias is not None:
            operands.append(Operand(bias, None, bias_of=layout))

        def compute(w: Tensor, b: Tensor | None = None) -> Tensor:
            return func(x, w, b, stride, padding, dilation, groups)

        return Match(f"conv{nd}d", tuple(operands), compute)
