"""neural-tangents' empirical-NTK and ``predict`` semantics, written out in plain numpy.

This module imports numpy only, so that both sides use it: the worker's venv
(``make_fixture.py`` checks every formula here against neural-tangents itself) and the main
environment (``client.py`` turns a dense torch ``J1 @ J2.T`` into NT's layout with it). See
``SEMANTICS.md`` for the prose and the numbers that verified each statement.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Axes = int | Sequence[int]


def canonical_axes(axes: Axes, ndim: int) -> tuple[int, ...]:
    """Sorted, non-negative, de-duplicated axes of an ``ndim``-dimensional output."""
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    for axis in axes:
        if not -ndim <= axis < ndim:
            raise ValueError(f"axis {axis} out of range for an output of {ndim} dimensions")
    return tuple(sorted({axis % ndim for axis in axes}))


def nt_kernel_shape(shape1: Sequence[int], shape2: Sequence[int], trace_axes: Axes = (-1,),
                    diagonal_axes: Axes = ()) -> tuple[int, ...]:
    """The shape of NT's kernel for outputs of shapes ``shape1`` (``f(x1)``) and ``shape2``.

    Output axes are taken in order: a traced axis disappears, a diagonal axis appears once,
    every other axis appears twice, interleaved (``(n1, n2)``, then ``(k1, k2)``, …).
    """
    ndim = len(shape1)
    trace, diagonal = canonical_axes(trace_axes, ndim), canonical_axes(diagonal_axes, ndim)
    if set(trace) & set(diagonal):
        raise ValueError(f"axes {sorted(set(trace) & set(diagonal))} both traced and diagonal")
    shape: tuple[int, ...] = ()
    for axis, (a1, a2) in enumerate(zip(shape1, shape2, strict=True)):
        if axis in trace or axis in diagonal:
            if a1 != a2:
                raise ValueError(f"axis {axis} is traced or diagonal but has sizes {a1} != {a2}")
            shape += () if axis in trace else (a1,)
        else:
            shape += (a1, a2)
    return shape


def to_nt_layout(gram: np.ndarray, ndim: int, trace_axes: Axes = (-1,),
                 diagonal_axes: Axes = ()) -> np.ndarray:
    """NT's kernel from the generalized Gramian ``gram = J(x1) J(x2)ᵀ`` of shape ``S1 + S2``.

    ``gram[i..., j...] = <∂f(x1)[i...]/∂θ, ∂f(x2)[j...]/∂θ>`` with ``ndim == len(S1)``. NT's
    kernel keeps output axis pairs in order and interleaved, takes the diagonal of each
    pair in ``diagonal_axes`` (one axis left, in place) and the **mean** over each pair in
    ``trace_axes`` (the trace divided by the axis size: ``trace_axes=(-1,)`` on logits
    ``[N, K]`` gives ``(1/K) Σ_k J1[n1, k] · J2[n2, k]``).
    """
    if gram.ndim != 2 * ndim:
        raise ValueError(f"expected a Gramian of {2 * ndim} dimensions, got {gram.ndim}")
    nt_kernel_shape(gram.shape[:ndim], gram.shape[ndim:], trace_axes, diagonal_axes)
    trace, diagonal = canonical_axes(trace_axes, ndim), canonical_axes(diagonal_axes, ndim)
    letters = "abcdefghijklmnopqrstuvwxyz"
    first, second, out = list(letters[:ndim]), list(letters[ndim:2 * ndim]), ""
    for axis in range(ndim):
        if axis in trace or axis in diagonal:
            second[axis] = first[axis]  # repeated letter: trace (summed) or diagonal (kept)
            out += "" if axis in trace else first[axis]
        else:
            out += first[axis] + second[axis]
    kernel = np.einsum(f"{''.join(first)}{''.join(second)}->{out}", gram)
    size = int(np.prod([gram.shape[axis] for axis in trace], dtype=np.int64))
    return kernel / size


def add_diagonal_regularizer(k2d: np.ndarray, diag_reg: float,
                             absolute_scale: bool = False) -> np.ndarray:
    """``K + diag_reg · s · I`` with ``s = 1`` (absolute) or ``s = trace(K) / n`` (NT default)."""
    n = k2d.shape[0]
    scale = 1.0 if absolute_scale else np.trace(k2d) / n
    return k2d + diag_reg * scale * np.eye(n)


def _flat_kernel(k: np.ndarray, y: np.ndarray, trace_axes: Axes) -> tuple[np.ndarray, int]:
    """``k`` as ``[rows, rows]`` (rows of ``y`` that are not traced) and the traced size."""
    trace = canonical_axes(trace_axes, y.ndim)
    if trace != tuple(range(y.ndim - len(trace), y.ndim)):
        raise NotImplementedError("this reference handles trailing trace axes only")
    rows = int(np.prod(k.shape[1::2], dtype=np.int64))
    channels = int(np.prod([y.shape[axis] for axis in trace], dtype=np.int64))
    k2d = np.transpose(k, tuple(range(0, k.ndim, 2)) + tuple(range(1, k.ndim, 2)))
    return k2d.reshape(-1, rows), channels


def gradient_descent_mse(k_train_train: np.ndarray, y_train: np.ndarray, t: float | np.ndarray |
                         None, fx_train_0: np.ndarray | float = 0.0,
                         fx_test_0: np.ndarray | None = None,
                         k_test_train: np.ndarray | None = None, learning_rate: float = 1.0,
                         diag_reg: float = 0.0, diag_reg_absolute_scale: bool = False,
                         trace_axes: Axes = (-1,)) -> tuple[np.ndarray, np.ndarray | None]:
    """``nt.predict.gradient_descent_mse(...)(t, fx_train_0, fx_test_0, k_test_train)``.

    Gradient flow on ``L(f) = ||f - y||² / (2 · y.size)`` in function space, so that
    ``df/dτ = -(1 / y.size) Θ (f - y)`` with ``τ = learning_rate · t`` and ``Θ`` the kernel
    (``Θ ⊗ I`` over traced axes), ``Θ_reg = Θ + diag_reg · s · I`` (see
    :func:`add_diagonal_regularizer`), ``Θ_reg = V diag(λ) Vᵀ``:

    * train: ``f(τ) = f0 + V (exp(-max(λ, 0) τ / y.size) - 1) Vᵀ (f0 - y)``;
      ``t=None``: exactly ``y`` (no regularization applied to the train outputs).
    * test: ``g(τ) = g0 + K_test,train V [(exp(-max(λ, 0) τ / y.size) - 1) / |λ|] Vᵀ (f0 - y)``;
      ``t=None``: ``g0 + K_test,train Θ_reg⁻¹ (y - f0)`` (Cholesky solve).

    A ``t`` array of shape ``T`` gives outputs of shape ``T + y.shape`` (``T + y_test.shape``).

    Returns:
        ``(fx_train_t, fx_test_t)``; ``fx_test_t`` is ``None`` when ``fx_test_0`` is.
    """
    k2d, channels = _flat_kernel(k_train_train, y_train, trace_axes)
    rows = k2d.shape[0]
    k2d = add_diagonal_regularizer(k2d, diag_reg, diag_reg_absolute_scale)
    f0 = np.broadcast_to(np.asarray(fx_train_0, dtype=k2d.dtype), y_train.shape)
    residual = (f0 - y_train).reshape(rows, channels)  # trailing trace axes only
    kt2d = None
    if fx_test_0 is not None:
        if k_test_train is None:
            raise ValueError("fx_test_0 needs k_test_train")
        test_rows = int(np.prod(k_test_train.shape[0::2], dtype=np.int64))
        kt2d = np.transpose(k_test_train, tuple(range(0, k_test_train.ndim, 2))
                            + tuple(range(1, k_test_train.ndim, 2))).reshape(test_rows, rows)
    if t is None:
        fx_train = y_train.astype(k2d.dtype)
        if kt2d is None or fx_test_0 is None:
            return fx_train, None
        fx_test = fx_test_0 + (kt2d @ np.linalg.solve(k2d, -residual)).reshape(fx_test_0.shape)
        return fx_train, fx_test
    tau = np.asarray(t, dtype=k2d.dtype) * learning_rate
    evals, evecs = np.linalg.eigh(k2d)
    decay = np.expm1(-np.maximum(evals, 0.0)[None, :] * tau.reshape(-1, 1) / y_train.size)
    coeff = evecs.T @ residual  # [rows, channels]
    fx_train = f0[None] + np.einsum("ji,ti,ic->tjc", evecs, decay, coeff).reshape(
        (-1,) + y_train.shape)
    fx_train = fx_train.reshape(tau.shape + y_train.shape)
    if kt2d is None or fx_test_0 is None:
        return fx_train, None
    d_test = np.einsum("sj,ji,ti,ic->tsc", kt2d, evecs, decay / np.abs(evals)[None, :], coeff)
    fx_test = (fx_test_0[None] + d_test.reshape((-1,) + fx_test_0.shape)).reshape(
        tau.shape + fx_test_0.shape)
    return fx_train, fx_test


def gp_inference_mean(k_train_train: np.ndarray, y_train: np.ndarray,
                      k_test_train: np.ndarray, diag_reg: float = 0.0,
                      diag_reg_absolute_scale: bool = False,
                      trace_axes: Axes = (-1,)) -> np.ndarray:
    """Mean of ``nt.predict.gp_inference(...)(get="ntk", k_test_train=...)``: kernel regression.

    ``K_test,train Θ_reg⁻¹ y`` with ``Θ_reg`` as in :func:`gradient_descent_mse` (no initial
    outputs: the infinite-time limit of gradient descent from ``f0 = 0``).
    """
    k2d, channels = _flat_kernel(k_train_train, y_train, trace_axes)
    k2d = add_diagonal_regularizer(k2d, diag_reg, diag_reg_absolute_scale)
    test_rows = int(np.prod(k_test_train.shape[0::2], dtype=np.int64))
    kt2d = np.transpose(k_test_train, tuple(range(0, k_test_train.ndim, 2))
                        + tuple(range(1, k_test_train.ndim, 2))).reshape(test_rows, -1)
    mean = kt2d @ np.linalg.solve(k2d, y_train.reshape(k2d.shape[0], channels))
    return mean.reshape(k_test_train.shape[0::2] + tuple(y_train.shape[y_train.ndim - len(
        canonical_axes(trace_axes, y_train.ndim)):]))


def gp_inference_ntkgp_cov(k_train_train: np.ndarray, k_test_train: np.ndarray,
                           k_test_test: np.ndarray, diag_reg: float = 0.0,
                           diag_reg_absolute_scale: bool = False) -> np.ndarray:
    """Covariance of ``gp_inference(...)(get="ntkgp", k_test_train, k_test_test)``.

    ``K_test,test - K_test,train Θ_reg⁻¹ K_train,test``, every kernel in NT's interleaved
    layout (``[N1, N2, K, K]`` or, traced, ``[N1, N2]``) and the result too.
    """
    def flat(k: np.ndarray) -> np.ndarray:
        ndim = k.ndim // 2
        rows = int(np.prod(k.shape[0::2], dtype=np.int64))
        return np.transpose(k, tuple(range(0, 2 * ndim, 2)) + tuple(range(1, 2 * ndim, 2))
                            ).reshape(rows, -1)

    theta = add_diagonal_regularizer(flat(k_train_train), diag_reg, diag_reg_absolute_scale)
    k_st = flat(k_test_train)
    cov = flat(k_test_test) - k_st @ np.linalg.solve(theta, k_st.T)
    ndim = k_test_test.ndim // 2
    unflat = cov.reshape(k_test_test.shape[0::2] + k_test_test.shape[1::2])
    order = [axis for pair in zip(range(ndim), range(ndim, 2 * ndim), strict=True)
             for axis in pair]
    return np.transpose(unflat, order)
