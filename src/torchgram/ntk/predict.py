"""Predictions from a kernel: neural-tangents' ``gradient_descent_mse``, and kernel regression.

# NOTE [gradient_descent_mse]
``nt.predict.gradient_descent_mse`` (``benchmarks/nt/SEMANTICS.md``; every formula here is
tested against NT's own outputs in ``tests/data/nt_reference``): gradient flow on
``L(f) = ‖f − y‖² / (2n)`` in function space, ``n = y_train.numel()`` (traced axes
included), for the network linearized at its parameters::

    df/dτ = −(1/n) Θ (f − y),        τ = learning_rate · t

with ``Θ`` the kernel, read as ``Θ ⊗ I`` over ``trace_axes`` (the axes of ``y`` the kernel
lacks), flattened to ``[rows, rows]``, and ``Θ_reg = Θ + diag_reg · s · I`` where
``s = trace(Θ) / rows`` (``diag_reg`` is relative to the mean of the kernel's diagonal) or
``s = 1`` with ``diag_reg_absolute_scale=True``. With ``Θ_reg = V diag(λ) Vᵀ``:

* finite ``t`` (a scalar, or a tensor of any shape ``T``: outputs get ``T`` in front)::

      f_train(t) = f0 + V expm1(−max(λ, 0) τ / n) Vᵀ (f0 − y)
      f_test(t)  = g0 + K_test,train V [expm1(−max(λ, 0) τ / n) / |λ|] Vᵀ (f0 − y)

  (NT divides by ``|λ|`` unguarded: an eigenvalue exactly 0 gives NaN on the test set, as
  in NT — regularize a singular kernel);
* ``t=None`` (infinite time, a Cholesky solve, no eigendecomposition): ``f_train = y``
  exactly (``diag_reg`` does not enter), ``f_test = g0 + K_test,train Θ_reg⁻¹ (y − f0)``.

``fx_train_0=None`` means ``f0 = 0`` and no train outputs; ``fx_test_0=None`` no test
outputs. The result is ``f_train``, ``f_test``, or the pair ``(f_train, f_test)`` when both
are asked for, in the kernel's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from torchgram._core import _torch_compat
from torchgram._core.checks import fail
from torchgram._core.display import key_values_html, key_values_text
from torchgram._core.functional import public_math

_API = "torchgram.ntk.gradient_descent_mse"


def _as_axes(api: str, trace_axes: Any, ndim: int) -> tuple[int, ...]:
    axes = (trace_axes,) if isinstance(trace_axes, int) and not isinstance(trace_axes, bool) \
        else trace_axes
    if not isinstance(axes, tuple | list) or any(isinstance(a, bool) or not isinstance(a, int)
                                                 for a in axes):
        fail(api, "trace_axes to be an int or a tuple of ints (axes of y_train)",
             repr(trace_axes), "E.g. trace_axes=(-1,) for a traced kernel [N, N], () for a "
             "full one [N, N, K, K].", TypeError)
    resolved = []
    for axis in axes:
        if not -ndim <= axis < ndim:
            fail(api, f"trace_axes within [-{ndim}, {ndim}) for y_train of {ndim} "
                 "dimension(s)", f"trace_axes={tuple(axes)!r}", "Name axes of y_train.")
        resolved.append(axis % ndim)
    return tuple(sorted(set(resolved)))


def _check_tensor(api: str, name: str, value: Any, device: torch.device | None = None) -> Tensor:
    """``value`` if it is a dense floating tensor with values (on ``device`` when given)."""
    if not isinstance(value, Tensor) or not value.is_floating_point():
        fail(api, f"{name} to be a floating tensor", f"{type(value).__name__}"
             + (f" of dtype {value.dtype}" if isinstance(value, Tensor) else ""),
             f"Pass {name} as a float tensor (e.g. from an ntk_fn).", TypeError)
    if value.layout != torch.strided:
        fail(api, f"{name} to be a dense tensor (layout torch.strided)",
             f"layout {value.layout}", f"Pass {name}.to_dense().", TypeError)
    if value.is_meta:
        fail(api, f"{name} with values", f"a tensor of shape {tuple(value.shape)} on the meta "
             "device", "Compute it on a real device first.")
    if device is not None and value.device != device:
        fail(api, f"{name} on k_train_train's device ({device})",
             f"a tensor on {value.device}", f"Move it first: {name}.to({str(device)!r}).")
    return value


def _values(api: str, name: str, value: Any, dtype: torch.dtype, device: torch.device,
            shape: Sequence[int] | None = None) -> Tensor:
    """``value`` (a number, a tensor, an array) as a tensor of ``dtype``, broadcast to ``shape``.

    Checked before any work: a string or a shape that does not broadcast raised torch's
    ``new(): invalid data type 'str'`` / "The expanded size of the tensor" (session 59).
    """
    try:
        tensor = torch.as_tensor(value, dtype=dtype, device=device)
    except (TypeError, ValueError, RuntimeError):
        fail(api, f"{name} to be a number or a tensor", f"{type(value).__name__} {value!r:.40}",
             f"Pass {name} as a float or a tensor.", TypeError)
    if shape is None:
        return tensor
    try:
        return tensor.broadcast_to(tuple(shape))
    except RuntimeError:
        fail(api, f"{name} of shape {list(shape)} (or one that broadcasts to it)",
             f"shape {list(tensor.shape)}", f"Pass one {name} entry per output to predict.")


_FLAGGED = 16
"""An estimated smallest eigenvalue below this many times ``eps`` of the largest diagonal entry
sends the kernel to its eigendecomposition (NOTE [singular train kernels])."""
_CUT = 4
"""There, eigenvalues at most this many times ``eps`` of the largest count as zero."""


def _smallest_eigenvalue_above(kernel: Tensor, factor: Tensor, fraction: float) -> bool:
    """Whether ``kernel``'s estimated smallest eigenvalue exceeds ``fraction`` of its diagonal.

    Three steps of inverse iteration through its Cholesky ``factor`` estimate it (the Rayleigh
    quotient: an upper bound), against ``fraction`` times its largest diagonal entry. The start
    has fixed entries: no random draw.
    """
    rows = kernel.shape[0]
    vector = torch.cos(torch.arange(rows, dtype=kernel.dtype, device=kernel.device) * 2.399963)
    vector = vector.unsqueeze(-1)
    for _ in range(3):
        vector = torch.cholesky_solve(vector, factor)
        vector = vector / torch.linalg.vector_norm(vector).clamp(min=torch.finfo(kernel.dtype).tiny)
    quotient = (vector.mT @ kernel @ vector).squeeze()
    return bool(quotient > fraction * kernel.diagonal().abs().max())


class _Solver(NamedTuple):
    """``b ↦ Θ⁺ b``, and an orthonormal basis ``[rows, r]`` of Θ's range where it is singular."""

    solve: Callable[[Tensor], Tensor]
    range: Tensor | None


class _Layout:
    """How ``y``'s axes map to a kernel's rows (the non-traced axes) and channels."""

    def __init__(self, api: str, y_shape: Sequence[int], trace: tuple[int, ...],
                 axes_fix: str = "Pass the trace_axes the kernel was computed with") -> None:
        self.ndim = len(y_shape)
        self.trace = trace
        self.rows_axes = tuple(a for a in range(self.ndim) if a not in trace)
        self.order = self.rows_axes + trace
        self.channel_shape = tuple(y_shape[a] for a in trace)
        self.channels = math.prod(self.channel_shape)
        self.api = api
        self.axes_fix = axes_fix
        """The fix a kernel of other axes is told (its API's argument naming them)."""

    def flat(self, y: Tensor) -> Tensor:
        """``y [*shape]`` as ``[rows, channels]`` (sizes spelled out: either may be 0)."""
        rows = math.prod(y.shape[a] for a in self.rows_axes)
        return y.permute(self.order).reshape(rows, self.channels)

    def unflat(self, flat: Tensor, row_shape: Sequence[int], lead: Sequence[int] = ()) -> Tensor:
        """``[*lead, rows, channels]`` back to ``[*lead, *shape]`` (``row_shape``: row axes)."""
        out = flat.reshape(*lead, *row_shape, *self.channel_shape)
        inverse = [0] * self.ndim
        for position, axis in enumerate(self.order):
            inverse[axis] = position
        nlead = len(lead)
        return out.permute(*range(nlead), *(nlead + p for p in inverse))

    def kernel_2d(self, name: str, kernel: Tensor, rows_shape: Sequence[int] | None,
                  cols_shape: Sequence[int]) -> Tensor:
        """An interleaved kernel ``[a1, b1, a2, b2, ...]`` as ``[Π a, Π b]``."""
        pairs = len(self.rows_axes)
        if kernel.dim() != 2 * pairs:
            expected = 2 * pairs
            fail(self.api, f"{name} with {expected} dimensions (pairs of y_train's "
                 f"{pairs} non-traced axes, trace_axes={self.trace})",
                 f"a kernel of shape {tuple(kernel.shape)}",
                 f"{self.axes_fix}: trace_axes=() for a full kernel [N1, N2, K, K], (-1,) "
                 "for a traced one [N1, N2].")
        if tuple(kernel.shape[1::2]) != tuple(cols_shape) or (
                rows_shape is not None and tuple(kernel.shape[0::2]) != tuple(rows_shape)):
            fail(self.api, f"{name} pairing y_train's non-traced axes "
                 f"{tuple(cols_shape)} (as its odd axes)",
                 f"a kernel of shape {tuple(kernel.shape)}",
                 "Use NT's layout: k_train_train = ntk_fn(x_train, None, params), "
                 "k_test_train = ntk_fn(x_test, x_train, params); and "
                 f"{self.axes_fix[0].lower()}{self.axes_fix[1:]} (traced: "
                 f"{self.trace}).")
        evens = tuple(range(0, kernel.dim(), 2))
        odds = tuple(range(1, kernel.dim(), 2))
        rows = math.prod(kernel.shape[0::2])  # (spelled out: either side may be empty)
        return kernel.permute(evens + odds).reshape(rows, math.prod(kernel.shape[1::2]))


def _detached(value: Tensor | float) -> Tensor | float:
    """``value`` without its graph (a display reads it: no autograd warning)."""
    return value.detach() if isinstance(value, Tensor) else value


class GradientDescentMSE:
    """``predict_fn(t=None, fx_train_0=0., fx_test_0=None, k_test_train=None)`` (NOTE above).

    Made by :func:`gradient_descent_mse`. The eigendecomposition (finite ``t``, and ``t=None``
    for a numerically singular kernel) and the Cholesky factor (``t=None``) of the regularized
    kernel are computed once, at first use.
    ``repr`` (or a notebook) shows the settings and, once computed, the spectrum.
    """

    def __init__(self, k_train_train: Tensor, y_train: Tensor, learning_rate: float,
                 diag_reg: float, diag_reg_absolute_scale: bool, trace_axes: Any,
                 api: str = _API,
                 axes_fix: str = "Pass the trace_axes the kernel was computed with") -> None:
        self.api = api
        self.k_train_train = _check_tensor(api, "k_train_train", k_train_train)
        y = _check_tensor(api, "y_train", y_train, k_train_train.device)
        for name, value in (("learning_rate", learning_rate), ("diag_reg", diag_reg)):
            if isinstance(value, bool) or not isinstance(value, int | float):
                fail(api, f"{name} to be a number", repr(value), f"Pass {name}=0.1, say.",
                     TypeError)
        if not isinstance(diag_reg_absolute_scale, bool):
            fail(api, "diag_reg_absolute_scale to be True or False",
                 repr(diag_reg_absolute_scale), "Pass a bool.", TypeError)
        self.learning_rate = float(learning_rate)
        self.diag_reg = float(diag_reg)
        self.diag_reg_absolute_scale = diag_reg_absolute_scale
        self.layout = _Layout(api, y.shape, _as_axes(api, trace_axes, y.dim()), axes_fix)
        self.row_shape = tuple(y.shape[a] for a in self.layout.rows_axes)
        if math.prod(self.row_shape) == 0:  # torch's raw reduction error at the first solve
            fail(api, "at least one training point", f"y_train of shape {tuple(y.shape)} and "
                 f"k_train_train of shape {tuple(k_train_train.shape)}", "Pass the training "
                 "set's kernel and targets (test points alone have nothing to regress on).")
        dtype = k_train_train.dtype
        regularized = self._regularized()  # also checks the kernel's shape
        if not (_torch_compat.is_batched(regularized[0]) or regularized[0].is_meta) \
                and not bool(torch.isfinite(regularized[0]).all()):  # eigh's raw LinAlgError
            fail(api, "a finite k_train_train", "NaN or infinite entries",
                 "Check the kernel's inputs and parameters for non-finite values.")
        self._kept = regularized if self._keeps() else None
        self.y = y.to(dtype)
        self.size = y.numel()
        self._eigen: tuple[Tensor, Tensor] | None = None
        self._solve: Any = None

    def _regularized(self) -> tuple[Tensor, Tensor | float]:
        """The regularized kernel ``[rows, rows]`` and its ridge (in the kernel's units)."""
        kernel = self.layout.kernel_2d("k_train_train", self.k_train_train, self.row_shape,
                                       self.row_shape)
        rows = kernel.shape[0]
        scale = 1.0 if self.diag_reg_absolute_scale else kernel.diagonal().sum() / rows
        regularizer = self.diag_reg * scale
        eye = torch.eye(rows, dtype=kernel.dtype, device=kernel.device)
        return kernel + regularizer * eye, regularizer

    def _current(self) -> tuple[Tensor, Tensor | float]:
        """The kept regularized kernel and ridge, or new ones where they are not kept.

        NOTE [kept factorizations]: a backward frees the graph of the last one.
        """
        return self._kept or self._regularized()

    @property
    def kernel(self) -> Tensor:
        """The regularized kernel (made again at each use where it is not kept)."""
        return self._current()[0]

    @property
    def regularizer(self) -> Tensor | float:
        """The ridge added to the kernel's diagonal."""
        return self._current()[1]

    # -- pieces, computed once -------------------------------------------------------------

    # NOTE [kept factorizations]
    # The regularized kernel and its factorizations are kept for later calls only for a kernel
    # that is a plain constant:
    # one that requires grad or is a torch.func transform's would keep a first call's graph (a
    # call under no_grad logging a prediction left later gradients without the kernel's path,
    # 25% to 7x off; a second backward met torch's "backward through the graph a second
    # time") or a transform's level (session 58's composition hunt).

    def _keeps(self) -> bool:
        """Whether factorizations may be kept for later calls (NOTE [kept factorizations])."""
        kernel = self.k_train_train
        return not (kernel.requires_grad
                    or torch._C._functorch.is_functorch_wrapped_tensor(kernel))

    def eigen(self) -> tuple[Tensor, Tensor]:
        """``(λ, V)`` of the regularized kernel ``[rows, rows]`` (``eigh``)."""
        if self._eigen is not None:
            return self._eigen
        eigen = torch.linalg.eigh(self.kernel)
        if self._keeps():
            self._eigen = eigen
        return eigen

    def solve(self, rhs: Tensor) -> Tensor:
        """``Θ_reg⁺ rhs`` (NOTE [singular train kernels]: ``Θ_reg⁻¹`` where it is regular)."""
        result: Tensor = self.solver().solve(rhs)
        return result

    def solver(self) -> _Solver:
        """The solves of the regularized kernel, factorized once (where it may be kept)."""
        solver = self._solve
        if solver is None:
            solver = self._factorized()
            if self._keeps():
                self._solve = solver
        return solver

    # NOTE [singular train kernels]
    # A kernel of rank below its rows (more training outputs than parameters) is singular to
    # working precision. Solved anyway -- LU where Cholesky failed, Cholesky where round-off
    # let it pass -- its round-off came back up to 121 times the answer at t=None (session
    # 62's hunt; NT 0.6.5 gives NaN). The limit of the gradient flow still exists: the finite-t
    # formula tends to Θ⁺ (y - f0) on the test side and to f0 + P (y - f0) on the train side,
    # Θ⁺ the pseudo-inverse and P the projection on Θ's range (the null space never moves). So
    # a kernel whose Cholesky factorization fails, or whose smallest eigenvalue, estimated by
    # three steps of inverse iteration through that factor, is below _FLAGGED · eps times its
    # largest diagonal entry, goes through its eigendecomposition; eigenvalues at most _CUT ·
    # eps · |λ|max count as zero. Neither grows with the rows: pinv's cut-off, rows · eps ·
    # |λ|max, dropped genuine eigenvalues of ill-conditioned kernels (float32, 300 rows, κ 9e4:
    # 0.47 off where Cholesky was 4e-4 off; a review), and round-off leaves a rank-deficient
    # kernel's zero eigenvalues within a few eps (2 eps at most on forty seeds). Where it leaves
    # them above _CUT · eps (very large kernels), they are inverted, as before. A full-rank
    # kernel conditioned beyond 1 / (_CUT · eps) (float32: 2e6) counts as singular too: its
    # smallest eigenvalues are round-off there (a review: float32 NTKs of κ 2e7 came 2e-2 to 1.1
    # off the float64 answer this way, 4e-3 to 0.2 by Cholesky): pass float64 kernels then.
    # (The last Cholesky pivot of a rank-deficient kernel is no test: 3,000 times eps on one of
    # twenty seeds.) A kernel with none is solved as before (Cholesky if it passed, else LU).
    # A singular one that requires grad is refused (eigh's derivatives are not defined at a
    # repeated zero eigenvalue); one under vmap is solved by LU, as before (its status cannot
    # be read on the host there).

    def _factorized(self) -> _Solver:
        """The solves of the regularized kernel (NOTE [singular train kernels])."""
        kernel = self.kernel
        if _torch_compat.is_batched(kernel):  # torch's raw .item() error before session 58
            lu = torch.linalg.lu_factor(kernel)
            return _Solver(lambda b: torch.linalg.lu_solve(*lu, b), None)
        rows = kernel.shape[0]
        eps = torch.finfo(kernel.dtype).eps
        factor, info = torch.linalg.cholesky_ex(kernel)
        if int(info) == 0 and _smallest_eigenvalue_above(kernel.detach(), factor.detach(),
                                                         _FLAGGED * eps):
            return _Solver(lambda b: torch.cholesky_solve(b, factor), None)
        evals, evecs = self.eigen()
        kept = evals.detach().abs() > _CUT * eps * evals.detach().abs().max()
        if bool(kept.all()):
            if int(info) == 0:
                return _Solver(lambda b: torch.cholesky_solve(b, factor), None)
            lu, lu_pivots, lu_info = torch.linalg.lu_factor_ex(kernel)
            if int(lu_info) == 0:
                return _Solver(lambda b: torch.linalg.lu_solve(lu, lu_pivots, b), None)
        if kernel.requires_grad or torch._C._functorch.is_functorch_wrapped_tensor(kernel):
            fail(self.api, "a regularized train kernel that can be solved with (t=None)",
                 f"a numerically singular kernel that requires grad ({int((~kept).sum())} of "
                 f"its {rows} eigenvalues at most {_CUT} · eps times the largest: a kernel of "
                 "rank below its rows, e.g. more training outputs than parameters, or "
                 "conditioned beyond what its dtype resolves)",
                 "Add a ridge: diag_reg > 0 (gradient_descent_mse) or ridge > 0 "
                 "(kernel_regression), e.g. 1e-6 times the kernel's mean diagonal.")
        basis, inverse = evecs[:, kept], 1.0 / evals[kept]
        return _Solver(lambda b: basis @ (inverse[:, None] * (basis.T @ b)), basis)

    # -- display ---------------------------------------------------------------------------

    def _rows(self) -> list[tuple[str, str]]:
        kernel, regularizer = self._current()
        rows = [("kernel", f"{list(self.k_train_train.shape)} → [{kernel.shape[0]}, "
                 f"{kernel.shape[0]}]"),
                ("y_train", str(list(self.y.shape))),
                ("trace_axes", str(self.layout.trace)),
                ("learning_rate", f"{self.learning_rate:g}"),
                ("diag_reg", f"{self.diag_reg:g}" + ("" if self.diag_reg_absolute_scale
                                                     else " × mean diagonal")
                 + f" = {float(_detached(regularizer)):.4g}")]
        if self._eigen is not None:
            evals = self._eigen[0]
            rows.append(("eigenvalues", f"{float(evals.min()):.4g} … {float(evals.max()):.4g}"
                         f" (slowest mode's time scale n/λ_min = "
                         f"{self.size / max(float(evals.min()), 1e-300):.4g})"))
        return rows

    def __repr__(self) -> str:
        return key_values_text("GradientDescentMSE", self._rows())

    def _repr_html_(self) -> str:
        return key_values_html("GradientDescentMSE", self._rows())

    # -- predictions -----------------------------------------------------------------------

    @public_math  # NOTE [autocast], NOTE [the caller's function modes]
    def __call__(self, t: Any = None, fx_train_0: Any = 0.0, fx_test_0: Any = None,
                 k_test_train: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Train and/or test outputs at time(s) ``t`` (NOTE [gradient_descent_mse])."""
        dtype, device = self.k_train_train.dtype, self.k_train_train.device  # the kernel's
        if fx_train_0 is None and fx_test_0 is None:
            fail(self.api, "fx_train_0 or fx_test_0 (the outputs to predict)", "both None",
                 "Pass fx_train_0 for train outputs, fx_test_0 (with k_test_train) for test "
                 "outputs.")
        f0 = None if fx_train_0 is None else _values(self.api, "fx_train_0", fx_train_0,
                                                     dtype, device, self.y.shape)
        test = None
        if fx_test_0 is not None:
            if k_test_train is None:
                fail(self.api, "k_test_train with fx_test_0", "k_test_train=None",
                     "Pass k_test_train = ntk_fn(x_test, x_train, params).")
            kt = _check_tensor(self.api, "k_test_train", k_test_train, device).to(dtype)
            test_rows = tuple(kt.shape[0::2])
            test = (self.layout.kernel_2d("k_test_train", kt, None, self.row_shape),
                    test_rows)
            test_shape = [0] * self.layout.ndim
            for axis, size in zip(self.layout.rows_axes, test_rows, strict=True):
                test_shape[axis] = size
            for axis, size in zip(self.layout.trace, self.layout.channel_shape, strict=True):
                test_shape[axis] = size
            g0 = _values(self.api, "fx_test_0", fx_test_0, dtype, device, test_shape)
        y2d = self.layout.flat(self.y)
        if t is None:
            rhs = y2d if f0 is None else y2d - self.layout.flat(f0)
            solver = self.solver()  # NOTE [singular train kernels]: the range's projection
            if solver.range is None:
                targets = self.y.clone()
            else:
                targets = self.layout.unflat(solver.range @ (solver.range.T @ rhs),
                                             self.row_shape)
                targets = targets if f0 is None else f0 + targets
            if test is None:
                return targets
            limit = g0 + self.layout.unflat(test[0] @ self.solve(rhs), test[1])
            return limit if f0 is None else (targets, limit)
        tau = _values(self.api, "t", t, dtype, device) * self.learning_rate
        lead = tuple(tau.shape)
        evals, evecs = self.eigen()
        decay = torch.expm1(-evals.clamp(min=0)[None, :] * tau.reshape(-1, 1) / self.size)
        residual = -y2d if f0 is None else self.layout.flat(f0) - y2d
        coeff = evecs.T @ residual  # [rows, channels]
        fx_train: Tensor | None = None
        fx_test: Tensor | None = None
        if f0 is not None:
            dfx = torch.einsum("ji,ti,ic->tjc", evecs, decay, coeff)
            fx_train = f0 + self.layout.unflat(dfx, self.row_shape, (tau.numel(),))
            fx_train = fx_train.reshape(*lead, *self.y.shape)
        if test is not None:
            dfx = torch.einsum("sj,ji,ti,ic->tsc", test[0], evecs, decay / evals.abs()[None, :],
                               coeff)
            fx_test = g0 + self.layout.unflat(dfx, test[1], (tau.numel(),))
            fx_test = fx_test.reshape(*lead, *g0.shape)
        if fx_train is not None and fx_test is not None:
            return fx_train, fx_test
        result = fx_train if fx_test is None else fx_test
        assert result is not None
        return result


def gradient_descent_mse(k_train_train: Tensor, y_train: Tensor, learning_rate: float = 1.0,
                         diag_reg: float = 0.0, diag_reg_absolute_scale: bool = False,
                         trace_axes: int | Sequence[int] = (-1,)) -> GradientDescentMSE:
    """neural-tangents' ``nt.predict.gradient_descent_mse``: outputs of the linearized network.

    Gradient flow on the mean squared error ``‖f − y‖² / (2n)`` in function space, with the
    kernel ``k_train_train`` (NOTE [gradient_descent_mse] for the formulas).

    Args:
        k_train_train: The kernel on the training inputs in neural-tangents' layout, e.g.
            ``ntk_fn(x_train, None, params)``: ``[N, N]`` (traced) or ``[N, N, K, K]``.
        y_train: The targets ``[N, K]`` (any shape whose non-traced axes the kernel pairs).
        learning_rate: Rescales time: ``τ = learning_rate · t``.
        diag_reg: Added to the kernel's diagonal, relative to its mean diagonal (absolute
            with ``diag_reg_absolute_scale``).
        diag_reg_absolute_scale: Whether ``diag_reg`` is in absolute units.
        trace_axes: The axes of ``y_train`` the kernel lacks (as given to the ``ntk_fn``):
            ``(-1,)`` for an ``[N, N]`` kernel (NT's default), ``()`` for ``[N, N, K, K]``.

    Returns:
        ``predict_fn(t=None, fx_train_0=0.0, fx_test_0=None, k_test_train=None)``, a
        :class:`GradientDescentMSE`: ``t`` is a time or a tensor of times (``None``:
        infinity), ``fx_train_0`` / ``fx_test_0`` the outputs at ``t = 0`` on the train
        and test inputs (``None``: not wanted), ``k_test_train`` the kernel
        ``ntk_fn(x_test, x_train, params)``. It returns the train outputs, the test outputs,
        or both as a pair, with ``t``'s shape in front.

    Raises:
        TypeError, ValueError: For kernels whose shape does not pair ``y_train``'s axes (a
            message names the ``trace_axes`` to pass), bad numbers, or ``fx_test_0``
            without ``k_test_train``; at ``t=None``, for a numerically singular regularized
            train kernel that requires grad (add ``diag_reg``).

    A numerically singular train kernel (rank below its rows, e.g. more training outputs
    than parameters: eigenvalues at most ``4 · eps`` times the largest) gives at ``t=None``
    the limit of the gradient flow, through its pseudo-inverse: test outputs ``fx_test_0 +
    k_test_train Θ⁺ (y - fx_train_0)``, train outputs ``fx_train_0 + P (y - fx_train_0)``
    with ``P`` the projection on the kernel's range (NT 0.6.5 returns NaN there; NOTE
    [singular train kernels]). A float32 kernel conditioned beyond about 2e6 counts as
    singular: use a float64 kernel for such.

    Example:
        >>> import torch, torchgram as tg
        >>> k = torch.tensor([[2.0, 0.5], [0.5, 1.0]])
        >>> y = torch.tensor([[1.0], [-1.0]])
        >>> predict_fn = tg.ntk.gradient_descent_mse(k, y)
        >>> predict_fn(t=None)          # infinite time: the train targets
        tensor([[ 1.],
                [-1.]])
        >>> predict_fn(t=torch.tensor([0.0, 1e9])).shape   # [times, N, K]
        torch.Size([2, 2, 1])
    """
    return GradientDescentMSE(k_train_train, y_train, learning_rate, diag_reg,
                              diag_reg_absolute_scale, trace_axes)


@public_math  # NOTE [autocast], NOTE [the caller's function modes]
def kernel_regression(k_train_train: Tensor, k_test_train: Tensor, y_train: Tensor,
                      ridge: float = 0.0, *,
                      trace_axes: int | Sequence[int] | None = None) -> Tensor:
    """Kernel (ridge) regression: ``K_test,train (K_train,train + ridge · I)⁻¹ y_train``.

    The infinite-time test outputs of :func:`gradient_descent_mse` from zero initial
    outputs, with ``ridge`` in absolute units (NT's ``gp_inference`` mean). The kernels are
    in neural-tangents' layout; with ``trace_axes=None`` whether they are traced (``[N, N]``
    for ``y_train [N, K]``) or full (``[N, N, K, K]``) is read from their number of
    dimensions, the traced axes being ``y_train``'s last ones.

    Args:
        k_train_train: ``ntk_fn(x_train, None, params)``.
        k_test_train: ``ntk_fn(x_test, x_train, params)``.
        y_train: The targets, ``[N, ...]``.
        ridge: Added to the diagonal of ``k_train_train`` (absolute units).
        trace_axes: The axes of ``y_train`` the kernels were traced over, as given to
            :func:`~torchgram.ntk.empirical_ntk_fn` (e.g. ``(1,)`` for ``y_train [N, T, K]``
            and a kernel ``[N, N, K, K]``); ``None``: read from the kernel, as above.

    Returns:
        The predictions on the test inputs, shaped like ``y_train`` with ``N_test`` samples.

    A numerically singular ``k_train_train + ridge · I`` is solved through its pseudo-inverse,
    as :func:`gradient_descent_mse` at ``t=None`` (one that requires grad raises a
    ``ValueError``: add a ridge).

    Example:
        >>> import torch, torchgram as tg
        >>> k = torch.eye(3) * 2.0           # three independent training points
        >>> y = torch.tensor([[1.0], [2.0], [3.0]])
        >>> tg.ntk.kernel_regression(k, k[:2], y, ridge=2.0)   # each shrunk by 2 / (2 + 2)
        tensor([[0.5000],
                [1.0000]])
    """
    api = "torchgram.ntk.kernel_regression"
    _check_tensor(api, "k_train_train", k_train_train)
    y = _check_tensor(api, "y_train", y_train, k_train_train.device)
    _check_tensor(api, "k_test_train", k_test_train, k_train_train.device)
    if isinstance(ridge, bool) or not isinstance(ridge, int | float):
        fail(api, "ridge to be a number", repr(ridge), "Pass ridge=0.1, say (a float; "
             "float(t) of a 0-dim tensor t).", TypeError)
    if trace_axes is None:
        pairs = k_train_train.dim() // 2
        if k_train_train.dim() % 2 or not 1 <= pairs <= y.dim():
            fail(api, f"k_train_train with an even number of dimensions, at most 2 × "
                 f"y_train's ({y.dim()})", f"a kernel of shape {tuple(k_train_train.shape)}",
                 "Pass a kernel in neural-tangents' layout: [N, N] or [N, N, K, K].")
        trace_axes = tuple(range(pairs, y.dim()))
    predict = GradientDescentMSE(k_train_train, y, 1.0, ridge, True, trace_axes, api=api,
                                 axes_fix="Pass trace_axes= as the kernels were computed "
                                 "with (None reads them as y_train's last axes)")
    test_rows = tuple(k_test_train.shape[0::2])
    test_shape = list(y.shape)
    for axis, size in zip(predict.layout.rows_axes, test_rows, strict=False):
        test_shape[axis] = size
    zeros = torch.zeros(test_shape, dtype=k_train_train.dtype, device=k_train_train.device)
    result = predict(t=None, fx_train_0=None, fx_test_0=zeros, k_test_train=k_test_train)
    assert isinstance(result, Tensor)
    return result


__all__ = ["GradientDescentMSE", "gradient_descent_mse", "kernel_regression"]
