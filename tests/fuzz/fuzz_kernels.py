"""Fuzzed kernels: random architectures as ``tg.ntk.empirical_ntk_fn`` cross kernels.

A :class:`KernelCase` is a generated :class:`fuzz_arch.FuzzCase` called as neural-tangents
calls ``f(params, x)`` (parameters first, the inputs as one tuple), on two input sets of the
same architecture and parameters (``x2`` of another batch size, or ``None``), with random
``trace_axes`` / ``diagonal_axes``, ``vmap_axes``, tiles (``memory_budget``), row chunks and
streamed chunks of the structured kernels (``stream_bytes``). The property: the kernel is the
dense oracle's (``reference.dense_cross_kernel``: two ``jacrev`` Jacobians, put in NT's
layout independently) or a torchgram error, and the call leaves the inputs as they were.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import optree
import torch
from hypothesis import strategies as st
from torch import Tensor

import torchgram as tg
import torchgram.backends.structured.cross as structured_cross
from fuzz_arch import (
    Buffer,
    Features,
    FuzzCase,
    Head,
    Norm,
    build,
    walk_shapes,
    without_dropout,
)
from fuzz_check import OWN_ROUND_OFF, TOLERANCE, Snapshot, assert_close
from fuzz_strategies import cases
from reference import dense_cross_kernel

KERNEL_HEADS = ("sq_mean", "ce", "feat", "seq", "token_ce")
"""Heads whose output is one tensor (a kernel is of one output)."""


@dataclass(frozen=True)
class KernelCase:
    """One generated kernel call (see the module docstring).

    ``stream_bytes`` replaces ``STREAM_PASS_BYTES`` of the structured kernels for the call
    (small values stream the larger side a few row directions at a time).
    ``labels_via="keyword"``: a classifier's labels go in as NT's keyword pair
    ``labels=(labels1, labels2)``, batched by ``vmap_axes=(0, 0, {"labels": 0})`` (else in
    ``x``'s tuple).
    """

    case: FuzzCase
    batch2: int | None
    trace_axes: tuple[int, ...]
    diagonal_axes: tuple[int, ...]
    vmap_axes: int | None
    memory_budget: int | None
    chunk_size: int | None
    stream_bytes: int
    labels_via: str = "x"


def _as_kernel_case(case: FuzzCase, head_extra: str) -> FuzzCase:
    """``case`` called as ``f(params, x)``: one tensor output, samples on dim 0 of both.

    Dropout is left out (:func:`fuzz_arch.without_dropout`): two calls of a kernel draw other
    masks than the oracle's two calls.
    """
    layers = tuple(dataclasses.replace(layer, via="closure") if isinstance(layer, Buffer)
                   else layer for layer in without_dropout(case).layers)
    head = case.head if case.head.kind in KERNEL_HEADS else Head("feat")
    return dataclasses.replace(
        case, layers=layers, head=head, params_at="first", input_via="positional",
        consts_via="closure", has_aux=False, head_extra=head_extra, input_dim=0, output_dim=0,
        batch_dim=0, repeat="none", grad_mode="enabled", diagonal=False, per_leaf=False,
        chunk_size=None, memory_budget=None)


def second_batch_sizes(case: FuzzCase) -> list[int | None]:
    """The sizes ``x2`` may have (``None``: no ``x2``) on which ``f`` itself runs.

    Not one sample of one position where batch norm in training mode would see one value
    per channel: ``f`` itself raises there (session 23's kernel hunt; flat features have one
    position whatever ``length`` says: session 24's; a strided convolution before the norm can
    leave one: session 25's).

    Example:
        >>> from fuzz_arch import Features
        >>> case = FuzzCase(seed=0, batch=3, length=1, input=Features(width=2, flat=True),
        ...                 layers=(Norm(kind="batch_train"),), head=Head(kind="feat"))
        >>> second_batch_sizes(case)
        [None, 2, 3, 5, 3]
        >>> second_batch_sizes(dataclasses.replace(case, length=2))  # still one position
        [None, 2, 3, 5, 3]
        >>> from fuzz_arch import Conv1d
        >>> strided = Conv1d(out=2, kernel=1, stride=2, padding=0, dilation=1, groups=1)
        >>> norm = Norm(kind="batch_train")  # 2 positions, 1 after the convolution:
        >>> second_batch_sizes(dataclasses.replace(
        ...     case, length=2, input=Features(width=2), layers=(strided, norm)))
        [None, 2, 3, 5, 3]
    """
    flat = isinstance(case.input, Features) and case.input.flat
    length = 1 if flat else case.length
    one_position = any(
        isinstance(layer, Norm) and layer.kind == "batch_train"
        and walk_shapes(case.input, length, case.layers[:i]).length == 1
        for i, layer in enumerate(case.layers))
    return [None, *([] if one_position else [1]), 2, 3, 5, case.batch]


@st.composite
def kernel_cases(draw: st.DrawFn, backend: str) -> KernelCase:
    """A random kernel call for ``backend``."""
    case = _as_kernel_case(draw(cases(backend)), draw(st.sampled_from(["none", "none",
                                                                       "expand"])))
    batch2 = draw(st.sampled_from(second_batch_sizes(case)))
    ndim = _output(case, case.batch)[2].dim()
    trace = tuple(axis for axis in range(1, ndim) if draw(st.booleans()))
    same_samples = batch2 is None or batch2 == case.batch
    diagonal = tuple(axis for axis in range(ndim) if axis not in trace
                     and (axis != 0 or same_samples) and draw(st.integers(0, 2)) == 0)
    if draw(st.booleans()):  # negative axes
        trace = tuple(axis - ndim for axis in trace)
    return KernelCase(case, batch2, trace, diagonal,
                      vmap_axes=draw(st.sampled_from([0, 0, None])),
                      memory_budget=draw(st.sampled_from([None, None, 200, 2000, 20000])),
                      chunk_size=draw(st.sampled_from([None, None, 1, 2, 3])),
                      stream_bytes=draw(st.sampled_from([structured_cross.STREAM_PASS_BYTES,
                                                         64, 512, 4096])),
                      labels_via=draw(st.sampled_from(["x", "keyword"])))


def _output(case: FuzzCase, batch: int, shift: int = 0,
            dtype: torch.dtype | None = None) -> tuple[Any, Any, Tensor]:
    """``(f, (params, x), output)`` of ``case`` on ``batch`` samples; ``shift`` draws other
    inputs (the same parameters: they are drawn before the inputs); ``dtype``: every float
    built in it (``None``: the case's)."""
    built = build(dataclasses.replace(case, batch=batch), dtype)
    params, *inputs = built.args
    if shift:
        generator = torch.Generator().manual_seed(case.seed + shift)

        def other(value: Any) -> Any:
            if not isinstance(value, Tensor):
                return value
            if value.is_floating_point():
                noise = torch.randn(value.shape, generator=generator, dtype=torch.float64)
                return (value.detach() + 0.3 * noise.to(value.dtype)).requires_grad_(
                    value.requires_grad)
            top = int(value.max()) + 1 if value.numel() else 0
            return torch.randint(0, top, value.shape, generator=generator) if top else value

        inputs = [other(value) for value in inputs]
    base = built.f

    def f(params: Any, xs: tuple[Any, ...]) -> Tensor:
        return base(params, *xs)

    xs = tuple(inputs)
    return f, (params, xs), f(params, xs)


def check_kernel(kernel: KernelCase, backend: str) -> str:
    """The property on one kernel call; say whether it answered or refused."""
    case = kernel.case
    f, (params, x1), _ = _output(case, case.batch)
    x2 = None if kernel.batch2 is None else _output(case, kernel.batch2, shift=1)[1][1]
    expected = dense_cross_kernel(f, params, x1, x2, kernel.trace_axes, kernel.diagonal_axes)
    call_f, vmap_axes, inputs1, inputs2, kwargs = f, kernel.vmap_axes, x1, x2, {}
    if kernel.labels_via == "keyword" and len(x1) == 2:  # (x, labels): labels as keyword
        def call_f(params: Any, x: Any, *, labels: Tensor) -> Tensor:
            return f(params, (*x, labels))

        inputs1, labels1 = x1[:-1], x1[-1]
        inputs2 = None if x2 is None else x2[:-1]
        kwargs = {"labels": labels1 if x2 is None else (labels1, x2[-1])}
        if vmap_axes is not None:
            vmap_axes = (vmap_axes, vmap_axes, {"labels": 0})
    ntk_fn = tg.ntk.empirical_ntk_fn(
        call_f, trace_axes=kernel.trace_axes, diagonal_axes=kernel.diagonal_axes,
        vmap_axes=vmap_axes, backend=backend, chunk_size=kernel.chunk_size,
        memory_budget=kernel.memory_budget)
    snapshot = Snapshot.take((params, x1, x2), {}, None)
    default_stream = structured_cross.STREAM_PASS_BYTES
    structured_cross.STREAM_PASS_BYTES = kernel.stream_bytes
    try:
        result = ntk_fn(inputs1, inputs2, params, **kwargs)
    except Exception as error:  # noqa: BLE001 -- the property is about which errors escape
        if not str(error).startswith("torchgram."):
            raise AssertionError(f"{backend}: a raw error escaped: {type(error).__name__}: "
                                 f"{error}") from error
        return f"refused ({type(error).__name__}: {str(error)[:60]}...)"
    finally:
        structured_cross.STREAM_PASS_BYTES = default_stream
    snapshot.assert_unchanged(None)
    leaves = [leaf for leaf in optree.tree_leaves(params)
              if isinstance(leaf, Tensor) and leaf.is_floating_point()]
    single = case.dtype == "float64" and not case.mixed_dtypes and all(
        leaf.dtype == torch.float64 for leaf in leaves)
    try:
        assert_close(result, expected.to(torch.float64), result.dtype, "kernel",
                     precision=torch.float64 if single else torch.float32)
    except AssertionError:
        if single or not _within_own_round_off(kernel, result, expected):
            raise
    return "answered"


def _within_own_round_off(kernel: KernelCase, result: Tensor, expected: Tensor) -> bool:
    """Whether a float32 kernel is off the float64 one by at most :data:`OWN_ROUND_OFF` times
    the float32 dense kernel's own error (an ill-conditioned case: norms over two values after
    a determinant, where the float32 oracle itself is 1e-3 off; as ``fuzz_aggregate`` does)."""
    case = kernel.case
    f, (params, x1), _ = _output(case, case.batch, dtype=torch.float64)
    x2 = None if kernel.batch2 is None else \
        _output(case, kernel.batch2, shift=1, dtype=torch.float64)[1][1]
    reference = dense_cross_kernel(f, params, x1, x2, kernel.trace_axes, kernel.diagonal_axes)
    own = (expected.double() - reference).abs().max().item()
    error = (result.double() - reference).abs().max().item()
    scale = max(reference.abs().max().item() if reference.numel() else 0.0, 1e-2)
    return math.isfinite(error) and error <= max(TOLERANCE[torch.float32] * scale,
                                                 OWN_ROUND_OFF * own)
