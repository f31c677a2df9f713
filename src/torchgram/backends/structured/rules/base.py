"""What a structured rule says about one call: its operands, their factor layouts.

# NOTE [factors]
A recognised use ``u`` of a parameter leaf has a Jacobian that is a sum of outer products
(DESIGN.md §1). Seen as a matrix ``[p, q]`` in the leaf's own layout (``leaf.reshape(p, -1)``),
one output row's Jacobian is

    J_u = Σ_t Σ_g  first[t, g] ⊗ second[t, g]

over the use's ``T`` *positions* ``t`` (tokens, pixels, ...) and ``G`` *groups* ``g`` (conv
``groups``; ``p = G · p_g``). One of the two factors is the **activation** (the other
operand of the op; it does not depend on the output row), the other is the **cotangent**
``∂out_row/∂y`` at the op's output (read from a zero "tap" added to ``y``). For ``F.linear``
(``y = x Wᵀ``, ``W: [d_out, d_in]``) the first factor is the cotangent and the second the
activation; for ``x @ W`` it is the other way round; for ``F.embedding`` the activation is
the one-hot of the index, kept as the index itself.

A norm's affine weight is the one *elementwise* use: ``y = x̂ ⊙ w + b`` gives
``J_w = Σ_t x̂_t ⊙ g_t``, a vector the size of ``w``, cheapest materialized.

A :class:`Layout` turns the raw activation and the raw cotangent (with any leading dims,
e.g. ``[rows, samples]``) into factors of shape ``[*lead, T, G, width]``; an index
activation becomes ``[*lead, T]`` integers. Everything the Gram contractions and the cost
model need follows from that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor


@dataclass(frozen=True)
class UseShape:
    """Sizes of one use, per evaluated batch (one sample with per-sample structure).

    Attributes:
        positions: ``T``, the positions summed over in the outer-product form.
        groups: ``G``, independent channel groups (1 except for grouped convolutions).
        act_width: Width of the activation factor per group (classes for an index).
        cot_width: Width of the cotangent factor per group.
        act_is_index: Whether the activation is an index (embedding), not a dense tensor.
        elementwise: Whether the use scales its input entry by entry (a norm's affine
            weight): its Jacobian is ``Σ_t first[t] ⊙ second[t]``, not an outer product.
    """

    positions: int
    groups: int
    act_width: int
    cot_width: int
    act_is_index: bool = False
    elementwise: bool = False

    @property
    def forward_flops(self) -> int:
        """Multiply-adds of the op itself (a gather for an index activation)."""
        if self.act_is_index or self.elementwise:
            return self.positions * self.groups * self.cot_width
        return self.positions * self.groups * self.act_width * self.cot_width


class Layout:
    """How a rule's raw activation and cotangent become factors (NOTE [factors]).

    Attributes:
        rule: Name of the rule, for reports (``"linear"``, ``"conv2d"``, ...).
        act_first: Whether the activation is the *first* factor in the layout of the weight
            operand as the op received it (a transposed leaf swaps the factors).
        groups: ``G``.
        act_width: Activation width per group (number of classes for an index activation).
        cot_width: Cotangent width per group.
        act_is_index: Whether the activation is an index (embedding).
        elementwise: Whether the Jacobian is ``Σ_t act[t] ⊙ cot[t]`` (both of one width).
    """

    rule: str = ""
    act_first: bool = False
    groups: int = 1
    act_width: int = 0
    cot_width: int = 0
    act_is_index: bool = False
    elementwise: bool = False

    def act_factor(self, raw: Tensor, nlead: int) -> Tensor:
        """``[*lead, T, G, act_width]`` (``[*lead, T]`` integers for an index)."""
        raise NotImplementedError

    def cot_factor(self, raw: Tensor, nlead: int, act_raw: Tensor | None) -> Tensor:
        """``[*lead, T, G, cot_width]`` from the cotangent of the op's output.

        ``act_raw`` (``None`` for a bias whose weight is no leaf) has the same leading dims,
        or one fewer (shared across the first one).
        """
        raise NotImplementedError

    def materialize(self, act_raw: Tensor | None, cot_raw: Tensor, bias: bool) -> Tensor | None:
        """The per-row Jacobian ``[c, B, numel]`` of a use straight from the raw tensors.

        ``cot_raw`` is the cotangent ``[c, B, *y]`` of the op's output, ``act_raw`` the
        activation ``[B, *x]`` (``None`` for a bias). ``bias``: the use sums the cotangent
        (a bias) instead of pairing it with the activation. ``None`` (the default): go
        through the factors (NOTE [factors]); layouts override it where a fused kernel or a
        plain reduction is cheaper than forming the factors.
        """
        del act_raw, cot_raw, bias
        return None

    def fused_jacobian(self, positions: int) -> bool:
        """Whether :meth:`materialize` forms a weight use's Jacobian with a fused kernel.

        At this many output positions, rather than returning ``None`` for the factors.
        Callers that would otherwise contract the factors themselves (the eager recording's
        single-use leaves) leave such uses to the contraction, which calls :meth:`materialize`.
        """
        del positions
        return False

    def shape(self, out_numel: int) -> UseShape:
        """The use's sizes, given the number of entries of the op's output (one sample)."""
        positions = out_numel // max(1, self.groups * self.cot_width)
        return UseShape(positions, self.groups, self.act_width, self.cot_width,
                        self.act_is_index, self.elementwise)


def flat_positions(raw: Tensor, nlead: int, groups: int, width: int) -> Tensor:
    """``raw [*lead, ..., groups·width]`` as ``[*lead, T, groups, width]``.

    Example:
        >>> import torch
        >>> flat_positions(torch.zeros(2, 3, 4, 6), 1, 2, 3).shape
        torch.Size([2, 12, 2, 3])
    """
    return raw.reshape(*raw.shape[:nlead], -1, groups, width)


@dataclass(frozen=True)
class Operand:
    """One argument of a recognised call that may be a parameter leaf.

    An operand is a *weight* when it has a ``layout``, a *bias* when it has ``bias_of``, and
    neither when the rule has no structure for it (a leaf there is an unrecognised use).

    Attributes:
        value: The argument as the op received it.
        layout: The factor layout when this operand is a weight.
        act: The activation paired with this weight operand.
        bias_of: For a bias, the layout whose cotangent factor it sums over positions.
    """

    value: Any
    layout: Layout | None
    act: Tensor | None = None
    bias_of: Layout | None = None


@dataclass(frozen=True)
class Match:
    """A call a rule recognises.

    Attributes:
        rule: The rule's name.
        operands: The arguments that may be parameter leaves, in ``compute``'s order.
        compute: ``compute(*values)`` runs the op with ``values`` in place of the operands.
    """

    rule: str
    operands: tuple[Operand, ...]
    compute: Callable[..., Tensor]


class Rule:
    """A family of ops with a factor structure: ``match`` recognises its calls."""

    name: str = ""
    funcs: frozenset[Any] = frozenset()

    def match(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Match | None:
        """The call's structure, or ``None`` when this call is not of the supported kind."""
        raise NotImplementedError

