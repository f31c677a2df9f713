"""The one dense oracle: one plain ``torch.autograd.grad`` per row, flattened, ``J @ J.T``.

Slow and memory-hungry on purpose: it builds the full Jacobian ``[m, P]`` of the
flattened output with respect to every floating tensor leaf of the differentiated
arguments, and contracts it. Every backend is checked against it.

It evaluates ``f`` once, as a plain call (no ``torch.func`` transform), and takes one plain
backward per row, so that it is the Jacobian of the function as a user's own call runs it:

* no ``vmap`` over backward passes: a batching rule of torch can be wrong where the op's
  plain backward is right (torch 2.13: the backward of ``torch.cdist``), and the backends
  use ``vmap`` everywhere, so a vmapped oracle could agree with a wrong backend;
* no functorch wrappers around the forward: they can change what a random op draws where
  (``F.dropout`` lays its mask out along its input's strides, which a wrapped ``batch_norm``
  output does not share), and the contract is the draw a plain call sees (DESIGN.md §3).

``tests/fuzz/FINDINGS.md`` tells both stories.

Where torch's plain backward itself is wrong (torch 2.13: ``as_strided_scatter`` with respect
to its input, ``det`` at an exactly singular matrix), this oracle is wrong with it: the tests
of those compare with the same function written without the op
(``tests/core/test_as_strided_scatter.py``) or check the refusal
(``tests/core/test_determinants.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode


@dataclass
class Dense:
    """The oracle's answer: the Gramian in ``[m, m]`` row order, its per-leaf blocks, the output."""

    gramian: Tensor
    blocks: list[Tensor]
    jacobian: Tensor
    output: Any

    def shaped(self, block: Tensor | None = None, *, diagonal: bool = False) -> Tensor:
        """``block`` (default: the Gramian) in the documented shape (``S + S`` for tensors)."""
        block = self.gramian if block is None else block
        if diagonal:
            block = block.diagonal()
        if not isinstance(self.output, Tensor):
            return block
        shape = self.output.shape
        return block.reshape(shape if diagonal else (*shape, *shape))


def _float_leaves(args: Sequence[Any], argnums: int | tuple[int, ...]
                  ) -> tuple[list[Tensor], Callable[[Sequence[Tensor]], list[Any]]]:
    """The floating tensor leaves of ``args`` at ``argnums``, and ``rebuild(values)``: the
    arguments with those leaves replaced by ``values`` (in the same order)."""
    nums = (argnums,) if isinstance(argnums, int) else argnums
    nums = tuple(n % len(args) for n in nums)
    flat = {n: optree.tree_flatten(args[n]) for n in nums}
    positions = [(n, j) for n in nums for j, leaf in enumerate(flat[n][0])
                 if isinstance(leaf, Tensor) and leaf.is_floating_point()]

    def rebuild(values: Sequence[Tensor]) -> list[Any]:
        per_arg = {n: list(flat[n][0]) for n in nums}
        for (n, j), value in zip(positions, values, strict=True):
            per_arg[n][j] = value
        rebuilt = list(args)
        for n in nums:
            rebuilt[n] = optree.tree_unflatten(flat[n][1], per_arg[n])
        return rebuilt

    return [flat[n][0][j] for n, j in positions], rebuild


def _plain_rows(f: Callable[..., Any], args: Sequence[Any],
                argnums: int | tuple[int, ...]) -> tuple[list[Tensor], Any, Tensor]:
    """One plain evaluation of ``f`` on fresh leaves that require grad (the float leaves at
    ``argnums``): the leaves, the output, and its rows (every output leaf flattened row-major,
    concatenated), recorded by autograd."""
    originals, rebuild = _float_leaves(args, argnums)
    leaves = [leaf.detach().requires_grad_() for leaf in originals]
    with torch.enable_grad():  # one plain evaluation: with random ops, the draw it sees
        out = f(*rebuild(leaves))
        rows = torch.cat([leaf.reshape(-1) for leaf in optree.tree_leaves(out)])
    return leaves, out, rows


def _flat_gradient(leaves: Sequence[Tensor], grads: Sequence[Tensor | None],
                   dtype: torch.dtype) -> Tensor:
    """The gradients with respect to ``leaves``, flattened and concatenated in ``dtype``:
    zeros for a leaf not reached, a sparse gradient (``embedding(sparse=True)``) dense."""
    return torch.cat([
        (torch.zeros_like(leaf) if grad is None else grad.to_dense() if grad.is_sparse
         else grad).reshape(-1).to(dtype)
        for leaf, grad in zip(leaves, grads, strict=True)])


def _grads(rows: Tensor, leaves: Sequence[Tensor], cotangent: Tensor,
           retain_graph: bool = False) -> Sequence[Tensor | None]:
    """``torch.autograd.grad`` of ``rows`` (``None`` for every leaf where nothing is recorded)."""
    if not rows.requires_grad:
        return (None,) * len(leaves)
    return torch.autograd.grad(rows, leaves, cotangent, retain_graph=retain_graph,
                               allow_unused=True)


def dense_gramian(f: Callable[..., Any], args: Sequence[Any],
                  argnums: int | tuple[int, ...] = 0) -> Dense:
    """Dense reference Gramian of ``f(*args)`` w.r.t. the float leaves at ``argnums``."""
    leaves, out, rows = _plain_rows(f, args, argnums)
    with torch.enable_grad():  # a row of the recorded output: rows[i] recorded too
        per_row = [_flat_gradient(leaves, _grads(rows[i], leaves, torch.ones_like(rows[i]),
                                                 retain_graph=True), rows.dtype)
                   for i in range(rows.numel())]
    output = optree.tree_map(lambda t: t.detach(), out)
    widths = [leaf.numel() for leaf in leaves]
    full = torch.stack(per_row) if per_row else rows.new_zeros(0, sum(widths))
    columns = list(full.detach().split(widths, dim=1))
    blocks = [c @ c.T for c in columns]
    jacobian = torch.cat(columns, dim=1)
    return Dense(jacobian @ jacobian.T, blocks, jacobian, output)


def weighted_backward(f: Callable[..., Any], args: Sequence[Any],
                      argnums: int | tuple[int, ...], weights: Tensor) -> Tensor:
    """``Jᵀ w`` by one plain backward of ``Σ_r w_r out_r``, in ``f``'s own dtype (float64 out).

    What a user's ``losses.backward(w)`` gives, with the rows flattened as
    :func:`dense_gramian` flattens them and the gradients concatenated in its leaf order
    (zeros for a leaf the rows do not reach). Not an oracle: the round-off of one float32
    backward, which a float32 update cannot be asked to beat.
    """
    leaves, _, rows = _plain_rows(f, args, argnums)
    return _flat_gradient(leaves, _grads(rows, leaves, weights.to(rows.dtype)), torch.float64)


class PreluByDefinition(TorchFunctionMode):
    """``prelu(x, w)`` evaluated as its definition, ``where(x > 0, x, w * x)``.

    For derivatives *through* a Gramian: torch 2.13's double backward of ``prelu`` at
    ``x = 0`` is not the derivative of its own backward (the backward scales the cotangent by
    ``w`` there, the double backward differentiates it as if by 1), so second derivatives
    of ``f`` through a prelu at 0 came out wrong (``tests/core/test_prelu.py``). First derivatives
    are the same either way.
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.prelu, Tensor.prelu) and len(args) == 2 and not kwargs:
            x, weight = args
            slope = weight.reshape(()) if weight.numel() == 1 else \
                weight.reshape(1, -1, *([1] * (x.dim() - 2)))
            return torch.where(x > 0, x, slope * x)
        return func(*args, **kwargs)


def dense_gramian_fn(f: Callable[..., Any], argnums: int | tuple[int, ...] = 0, *,
                     chunk_size: int | None = None) -> Callable[..., Tensor]:
    """The oracle as a function of ``f``'s arguments, differentiable and batchable.

    The same flattened ``jacrev`` Jacobian as :func:`dense_gramian`, with nothing detached, so
    ``torch.func`` transforms, ``vmap`` and eager autograd compose with it: the reference for
    everything computed *through* a Gramian. The result is shaped as ``torchgram.gramian``
    returns it (``S + S`` for a tensor output of shape ``S``, ``[m, m]`` for a pytree) in the
    output's dtype; the product is formed in the widest dtype of the Jacobian's columns.
    ``chunk_size=1`` makes ``jacrev`` loop instead of ``vmap`` (the derivatives of batched
    batch-norm backwards are wrong in torch 2.13); prelu runs as its definition
    (:class:`PreluByDefinition`: its double backward is wrong at 0).
    """
    def gramian(*args: Any) -> Tensor:
        leaves, rebuild = _float_leaves(args, argnums)

        def flat_output(*values: Tensor) -> tuple[Tensor, Any]:
            with PreluByDefinition():
                out = f(*rebuild(values))
            return torch.cat([leaf.reshape(-1) for leaf in optree.tree_leaves(out)]), out

        per_leaf, out = torch.func.jacrev(flat_output, argnums=tuple(range(len(leaves))),
                                          has_aux=True, chunk_size=chunk_size)(*leaves)
        num_rows = per_leaf[0].shape[0]
        columns = [jac.reshape(num_rows, -1) for jac in per_leaf]
        dtype = columns[0].dtype
        for column in columns[1:]:
            dtype = torch.promote_types(dtype, column.dtype)
        jacobian = torch.cat([column.to(dtype) for column in columns], dim=1)
        out_leaves = optree.tree_leaves(out)
        out_dtype = out_leaves[0].dtype
        for leaf in out_leaves[1:]:
            out_dtype = torch.promote_types(out_dtype, leaf.dtype)
        gram = (jacobian @ jacobian.T).to(out_dtype)
        if isinstance(out, Tensor):
            return gram.reshape(*out.shape, *out.shape)
        return gram

    return gramian


def central_differences(fn: Callable[[Tensor], Tensor], x: Tensor, step: float = 1e-5) -> Tensor:
    """The gradient of the scalar ``fn`` at ``x``, entry by entry, by central differences.

    The reference where torch's own derivative of that order is wrong (third derivatives
    through the fused norm kernels: ``tests/core/test_norms.py``).
    """
    gradient = torch.zeros_like(x)
    for i in range(x.numel()):
        shift = torch.zeros(x.numel(), dtype=x.dtype, device=x.device)
        shift[i] = step
        shift = shift.reshape(x.shape)
        gradient.view(-1)[i] = (fn(x + shift) - fn(x - shift)).detach() / (2 * step)
    return gradient


def dense_cross_gramian(f: Callable[..., Any], params: Any, x1: Any, x2: Any | None,
                        kwargs: dict[str, Any] | None = None) -> Tensor:
    """``J(x1) J(x2)ᵀ`` of ``f(params, x)`` from two dense Jacobians, shaped ``S1 + S2``.

    Each side is evaluated on its own copy of ``params``, as ``f(params, x1)`` and
    ``f(params, x2)`` of a pure function are: an ``f`` that renormalises its embedding table
    in place (``max_norm``) otherwise gave the second side a table the first had renormalised,
    and ``params`` themselves came back changed (a fuzz kernel case with a tied head, session
    51: every backend 0.03 off that oracle, exact against this one).
    """
    kwargs = kwargs or {}

    def side(x: Any) -> Dense:
        copies = optree.tree_map(lambda leaf: leaf.clone() if isinstance(leaf, Tensor) else leaf,
                                 params)
        return dense_gramian(lambda p: f(p, x, **kwargs), (copies,))

    first = side(x1)
    second = first if x2 is None else side(x2)
    shape = tuple(first.output.shape) + tuple(second.output.shape)
    return (first.jacobian @ second.jacobian.T).reshape(shape)


def nt_layout(gram: Tensor, trace_axes: Sequence[int] = (),
              diagonal_axes: Sequence[int] = ()) -> Tensor:
    """A cross Gramian ``S1 + S2`` in neural-tangents' layout, independently of torchgram.

    Output axes in order; a free axis's pair side by side, a diagonal axis once (its
    diagonal), a traced axis averaged over its pair (NT divides by the size).
    """
    ndim = gram.dim() // 2
    trace = {a % ndim for a in trace_axes}
    diagonal = {a % ndim for a in diagonal_axes}
    letters = "abcdefghijklmnopqrstuvwxyz"
    left, right, out = list(letters[:ndim]), list(letters[ndim:2 * ndim]), ""
    size = 1
    for axis in range(ndim):
        if axis in trace or axis in diagonal:
            right[axis] = left[axis]
            out += "" if axis in trace else left[axis]
            size *= gram.shape[axis] if axis in trace else 1
        else:
            out += left[axis] + right[axis]
    return torch.einsum(f"{''.join(left)}{''.join(right)}->{out}", gram) / size


def dense_cross_kernel(f: Callable[..., Any], params: Any, x1: Any, x2: Any | None,
                       trace_axes: Sequence[int] = (), diagonal_axes: Sequence[int] = (),
                       kwargs: dict[str, Any] | None = None) -> Tensor:
    """neural-tangents' kernel of ``f(params, x)``: :func:`nt_layout` of the dense cross Gramian."""
    return nt_layout(dense_cross_gramian(f, params, x1, x2, kwargs), trace_axes, diagonal_axes)


def differentiable_cross_kernel(f: Callable[..., Any], params: Any, x1: Any, x2: Any | None,
                                trace_axes: Sequence[int] = (),
                                diagonal_axes: Sequence[int] = ()) -> Tensor:
    """:func:`dense_cross_kernel` with nothing detached: eager autograd and ``torch.func``
    transforms differentiate through it (the reference for gradients *of* kernels)."""
    def flat_jacobian(x: Any) -> tuple[Tensor, tuple[int, ...]]:
        leaves, spec = optree.tree_flatten(params)
        floating = [i for i, leaf in enumerate(leaves)
                    if isinstance(leaf, Tensor) and leaf.is_floating_point()]

        def flat_output(*values: Tensor) -> Tensor:
            full = list(leaves)
            for i, value in zip(floating, values, strict=True):
                full[i] = value
            return f(optree.tree_unflatten(spec, full), x).reshape(-1)

        out_shape = tuple(f(params, x).shape)
        # rows one at a time, as dense_gramian_fn: torch 2.13's batched batch-norm backwards
        # have wrong derivatives (session 25: gradients of kernels of a training-mode batch
        # norm were ~1 off through a vmapped jacrev, right through this loop and torchgram)
        per_leaf = torch.func.jacrev(flat_output, argnums=tuple(range(len(floating))),
                                     chunk_size=1)(*(leaves[i] for i in floating))
        return torch.cat([jac.reshape(jac.shape[0], -1) for jac in per_leaf], 1), out_shape

    first, shape1 = flat_jacobian(x1)
    second, shape2 = (first, shape1) if x2 is None else flat_jacobian(x2)
    gram = (first @ second.T).reshape(*shape1, *shape2)
    return nt_layout(gram, trace_axes, diagonal_axes)


def assert_oracle_of_the_draw(f: Callable[..., Any], args: Sequence[Any],
                              call: Callable[..., Tensor], seed: int) -> None:
    """``call(*args)`` from ``torch.manual_seed(seed)`` is the oracle's Gramian of ``f`` from
    the same seed (one draw for a random ``f``), to 1e-10 of the largest entry."""
    torch.manual_seed(seed)
    expected = dense_gramian(f, args).gramian
    torch.manual_seed(seed)
    actual = call(*args)
    scale = expected.abs().max()
    torch.testing.assert_close(actual / scale, expected / scale, rtol=1e-10, atol=1e-10)
