"""neural-tangents' axes: ``trace_axes`` / ``diagonal_axes`` → a pair spec, and its layout.

# NOTE [NT layout]
neural-tangents' empirical kernel of ``f(params, x)`` with outputs ``fx1 = f(x1)`` and
``fx2 = f(x2)`` of ``n`` axes (``benchmarks/nt/SEMANTICS.md`` verifies every rule on NT
0.6.5):

* output axes are taken in order; a **free** axis contributes its pair *side by side*
  (``fx1``'s size, then ``fx2``'s): logits ``[N, K]`` give ``[N1, N2, K, K]``, never
  ``[N1, K, N2, K]``;
* a **diagonal** axis keeps the pairs ``i == j`` and appears once, in place (both sizes
  must agree);
* a **traced** axis disappears: NT contracts the pair and divides by the axis size, i.e. it
  takes the **mean** over the pair (``trace_axes=(-1,)``: ``(1/K) Σ_k G[a, k, b, k]``);
* an axis both traced and diagonal, or a traced/diagonal axis whose sizes differ between
  ``x1`` and ``x2``, is rejected (NT's default implementation fails with an XLA error,
  another of its implementations silently answers something else).

:func:`make_spec` turns the axes into a :class:`~torchgram._core.cross.PairSpec`;
:func:`to_nt_layout` turns a canonical block (NOTE [cross kernels]) into NT's layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from torchgram._core.checks import fail
from torchgram._core.cross import AxisMode, PairSpec

Axes = int | Sequence[int]


def check_axes(api: str, name: str, axes: Any) -> tuple[int, ...]:
    """``trace_axes`` / ``diagonal_axes`` as a tuple of ints (range checked per call)."""
    values = (axes,) if isinstance(axes, int) and not isinstance(axes, bool) else axes
    if not isinstance(values, tuple | list) or any(
            isinstance(a, bool) or not isinstance(a, int) for a in values):
        fail(api, f"{name} to be an int or a tuple of ints (output axes)", repr(axes),
             f"E.g. {name}=(-1,) for the last output axis, or {name}=() for none.", TypeError)
    if len(set(values)) != len(values):
        fail(api, f"{name} without repeated axes", repr(axes), "Name each axis once.")
    return tuple(values)


def normalize(api: str, name: str, axes: Sequence[int], ndim: int) -> tuple[int, ...]:
    """Axes made non-negative against an output of ``ndim`` dimensions, sorted."""
    resolved = []
    for axis in axes:
        if not -ndim <= axis < ndim:
            fail(api, f"{name} within [-{ndim}, {ndim}) for an output of {ndim} dimension(s)",
                 f"{name}={tuple(axes)!r}", f"{name} names axes of f's output.")
        resolved.append(axis % ndim)
    if len(set(resolved)) != len(resolved):
        fail(api, f"{name} naming distinct axes", f"{name}={tuple(axes)!r} for an output of "
             f"{ndim} dimension(s)", "Name each axis once.")
    return tuple(sorted(resolved))


def make_spec(api: str, trace_axes: Sequence[int], diagonal_axes: Sequence[int],
              shape1: Sequence[int], shape2: Sequence[int],
              batch_axis: int | None) -> PairSpec:
    """The pair spec of NT's axes for outputs of shapes ``shape1`` and ``shape2``.

    Raises the errors NT's default implementation raises, with messages that say why.

    Example:
        >>> make_spec("api", (-1,), (), (3, 4), (2, 4), 0)
        PairSpec(modes=('free', 'trace'), batch_axis=0)
        >>> make_spec("api", (), (0,), (3, 4), (2, 4), 0)
        Traceback (most recent call last):
        ...
        ValueError: api: expected diagonal axis 0 to have the same size in f(x1) and f(x2), \
but got sizes 3 and 2 (outputs (3, 4) and (2, 4)). A diagonal axis pairs entry i of f(x1) \
with entry i of f(x2): pass inputs of matching sizes, or drop the axis from diagonal_axes.
    """
    ndim = len(shape1)
    if len(shape2) != ndim:
        fail(api, "f(x1) and f(x2) with the same number of dimensions",
             f"outputs {tuple(shape1)} and {tuple(shape2)}",
             "f must return outputs of the same rank for both inputs.")
    trace = normalize(api, "trace_axes", trace_axes, ndim)
    diagonal = normalize(api, "diagonal_axes", diagonal_axes, ndim)
    both = sorted(set(trace) & set(diagonal))
    if both:
        fail(api, "trace_axes and diagonal_axes to name different axes",
             f"axis {both[0]} in both (trace_axes={tuple(trace_axes)!r}, diagonal_axes="
             f"{tuple(diagonal_axes)!r}, output of {ndim} dimension(s))",
             "A traced axis keeps only its diagonal already (and averages it): drop it from "
             "diagonal_axes, or from trace_axes to keep the diagonal entries apart. "
             "(neural-tangents' default implementation rejects this too.)")
    modes: list[AxisMode] = []
    for axis in range(ndim):
        mode: AxisMode = ("trace" if axis in trace else "diagonal" if axis in diagonal
                          else "free")
        if mode != "free" and shape1[axis] != shape2[axis]:
            kind, name = (("traced", "trace_axes") if mode == "trace"
                          else ("diagonal", "diagonal_axes"))
            fail(api, f"{kind} axis {axis} to have the same size in f(x1) and f(x2)",
                 f"sizes {shape1[axis]} and {shape2[axis]} (outputs {tuple(shape1)} and "
                 f"{tuple(shape2)})",
                 f"A {kind} axis pairs entry i of f(x1) with entry i of f(x2): pass inputs of "
                 f"matching sizes, or drop the axis from {name}.")
        modes.append(mode)
    return PairSpec(tuple(modes), batch_axis)


def nt_shape(spec: PairSpec, shape1: Sequence[int], shape2: Sequence[int]) -> tuple[int, ...]:
    """The shape of NT's kernel (NOTE [NT layout]).

    Example:
        >>> nt_shape(PairSpec(("free", "free")), (3, 4), (2, 4))
        (3, 2, 4, 4)
        >>> nt_shape(PairSpec(("diagonal", "free")), (3, 4), (3, 4))
        (3, 4, 4)
    """
    shape: tuple[int, ...] = ()
    for mode, a, b in zip(spec.modes, shape1, shape2, strict=True):
        shape += () if mode == "trace" else (a,) if mode == "diagonal" else (a, b)
    return shape


def to_nt_layout(block: Tensor, spec: PairSpec, shape1: Sequence[int],
                 shape2: Sequence[int]) -> Tensor:
    """A canonical block ``[Bd, D, F1, B1, F2, B2]`` (traces summed) in NT's layout (averaged).

    ``shape1`` and ``shape2`` are the full output shapes of ``f(x1)`` and ``f(x2)``.

    Example:
        >>> spec = PairSpec(("free", "free"), batch_axis=0)
        >>> import torch
        >>> block = torch.arange(24.0).reshape(1, 1, 2, 3, 2, 2)  # F = K = 2; B1 = 3, B2 = 2
        >>> kernel = to_nt_layout(block, spec, (3, 2), (2, 2))  # [N1, N2, K, K]
        >>> torch.equal(kernel[2, 1], block[0, 0, :, 2, :, 1])
        True
    """
    batch = spec.batch_axis
    names: list[tuple[str, int]] = []  # the canonical dims, after splitting D, F1, F2
    sizes: list[int] = []

    def add(group: str, axes: Sequence[int], shape: Sequence[int]) -> None:
        for axis in axes:
            names.append((group, axis))
            sizes.append(shape[axis])

    row_axes = [i for i in range(len(spec.modes)) if i != batch]
    free = [i for i in row_axes if spec.modes[i] == "free"]
    diagonal = [i for i in row_axes if spec.modes[i] == "diagonal"]
    batch_mode = spec.batch_mode
    if batch is not None and batch_mode == "diagonal":
        add("d", [batch], shape1)
    add("d", diagonal, shape1)
    add("1", free, shape1)
    if batch is not None and batch_mode == "free":
        add("1", [batch], shape1)
    add("2", free, shape2)
    if batch is not None and batch_mode == "free":
        add("2", [batch], shape2)
    kernel = block.reshape(sizes)
    order = []
    for axis, mode in enumerate(spec.modes):
        if mode == "diagonal":
            order.append(names.index(("d", axis)))
        elif mode == "free":
            order += [names.index(("1", axis)), names.index(("2", axis))]
    kernel = kernel.permute(order) if order != sorted(order) else kernel
    size = 1
    for mode, n in zip(spec.modes, shape1, strict=True):
        if mode == "trace":
            size *= n
    return kernel / size if size != 1 else kernel


__all__ = ["check_axes", "make_spec", "normalize", "nt_shape", "to_nt_layout"]

