"""Normalisation layers as plain tensor ops, while a differentiable ``G`` is computed.

# NOTE [decomposed norms]
A ``G`` that is differentiated (NOTE [composition]) holds first derivatives of ``f``, so its
derivatives are second derivatives of ``f``, taken through the batched (``vmap``) or
forward-mode derivatives of every op of ``f``. For three fused normalisation kernels torch
2.13 gets those wrong, silently: the derivatives with respect to anything upstream of the
layer of a vmapped ``native_layer_norm_backward`` / ``native_batch_norm_backward`` (training
statistics) — and of their forward-mode derivatives — treat the batch statistics as
constants. ``layer_norm``, ``batch_norm`` in training mode and ``instance_norm`` are affected
(``group_norm`` and ``rms_norm`` are decomposed by torch itself and are right); the
``jacobian`` and ``ntvp`` backends and the dense ``jacrev`` oracle inherit the error (up to
6× on a transformer's ``G`` gradient), while loops without ``vmap`` are right. One order
higher, not even loops are: the third derivatives of the fused ``layer_norm`` and training
``batch_norm`` are wrong in plain nested autograd (0.29 and 0.88 off, relative), so a
derivative of a derivative of ``G`` (``d/dx ‖∇ₓ tr G‖²``) was 1.3 off on the oracle and is
right here (session 46; ``tests/core/test_norms.py``, ``tests/api/test_compose.py``).

So while a differentiable ``G`` is computed, :class:`DecomposedNorms` (a
``TorchFunctionMode``) runs those three functions as the same arithmetic written with
plain ops (mean, biased variance, ``rsqrt``), whose derivatives of every order, batched or
not, are right. Values agree with the fused kernels to round-off, and the result is laid out
as the fused kernel's (run once more without gradients for its strides: a dropout after a
batch norm of a transposed input drew another mask, update hunt 4). Running statistics (batch
norm in training mode, instance norm with ``use_input_stats`` and running buffers) are
updated in place exactly as the fused kernels do (momentum, unbiased variance), outside
autograd, when a call passes them (torchgram's own evaluations of ``f`` pass none: NOTE
[frozen running statistics] in ``running_stats.py``). Eval-mode batch norm is an affine
map of fixed statistics and runs unchanged.
``tests/core/test_norms.py`` checks that torch still gets it wrong (and fails once torch
fixes it, when this mode can go).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from torchgram._core.layouts import laid_out_like


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str,
         default: Any = None) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def _normalize(x: Tensor, dims: Sequence[int], eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(x - mean) / sqrt(var + eps)`` over ``dims`` (biased variance), mean and variance."""
    mean = x.mean(dim=tuple(dims), keepdim=True)
    var = (x - mean).square().mean(dim=tuple(dims), keepdim=True)
    return (x - mean) * torch.rsqrt(var + eps), mean, var


def _channel_view(t: Tensor | None, ndim: int) -> Tensor | None:
    """A per-channel vector ``[C]`` shaped to broadcast against ``[N, C, ...]``."""
    return None if t is None else t.reshape(1, -1, *([1] * (ndim - 2)))


def _affine(y: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def layer_norm(x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None = None,
               bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """``F.layer_norm`` with plain ops (NOTE [decomposed norms]).

    Example:
        >>> x, w = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
        >>> torch.allclose(layer_norm(x, (3,), w), F.layer_norm(x, (3,), w))
        True
    """
    dims = range(x.dim() - len(normalized_shape), x.dim())
    return _affine(_normalize(x, dims, eps)[0], weight, bias)


def _update_running(running_mean: Tensor | None, running_var: Tensor | None, mean: Tensor,
                    var: Tensor, count: int, momentum: float) -> None:
    """Update running statistics as the fused kernels do: unbiased variance, momentum."""
    with torch.no_grad():
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.detach().reshape(running_mean.shape),
                                                 alpha=momentum)
        if running_var is not None:
            unbiased = var.detach() * (count / max(count - 1, 1))
            running_var.mul_(1 - momentum).add_(unbiased.reshape(running_var.shape),
                                                alpha=momentum)


def batch_norm(x: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
               weight: Tensor | None = None, bias: Tensor | None = None,
               training: bool = False, momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
    """``F.batch_norm`` with plain ops when it uses batch statistics (NOTE [decomposed norms]).

    Example:
        >>> x = torch.randn(5, 3, 2, dtype=torch.float64)
        >>> ours = (torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64))
        >>> theirs = (torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64))
        >>> y = batch_norm(x, *ours, training=True)
        >>> torch.allclose(y, F.batch_norm(x, *theirs, training=True))
        True
        >>> all(torch.allclose(a, b) for a, b in zip(ours, theirs))
        True
    """
    if (running_mean is None) != (running_var is None):  # torch refuses that too
        raise ValueError("running_mean and running_var must either both be None or neither be "
                         "None")
    if not training and running_mean is not None and running_var is not None:
        return F.batch_norm(x, running_mean, running_var, weight, bias, False, momentum, eps)
    dims = [0, *range(2, x.dim())]
    y, mean, var = _normalize(x, dims, eps)
    if training:
        _update_running(running_mean, running_var, mean, var, x.numel() // x.shape[1], momentum)
    return _affine(y, _channel_view(weight, x.dim()), _channel_view(bias, x.dim()))


def instance_norm(x: Tensor, running_mean: Tensor | None = None,
                  running_var: Tensor | None = None, weight: Tensor | None = None,
                  bias: Tensor | None = None, use_input_stats: bool = True,
                  momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
    """``F.instance_norm`` with plain ops when it uses input statistics.

    Example:
        >>> x = torch.randn(2, 3, 4, dtype=torch.float64)
        >>> torch.allclose(instance_norm(x), F.instance_norm(x))
        True
    """
    if not use_input_stats:
        return F.instance_norm(x, running_mean, running_var, weight, bias, False, momentum, eps)
    y, mean, var = _normalize(x, range(2, x.dim()), eps)
    if running_mean is not None or running_var is not None:  # averaged over the batch
        _update_running(running_mean, running_var, mean.mean(0), var.mean(0),
                        x[0, 0].numel(), momentum)
    return _affine(y, _channel_view(weight, x.dim()), _channel_view(bias, x.dim()))


def _call_layer_norm(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    shape = _arg(args, kwargs, 1, "normalized_shape")
    return layer_norm(_arg(args, kwargs, 0, "input"),
                      (shape,) if isinstance(shape, int) else tuple(shape),
                      _arg(args, kwargs, 2, "weight"), _arg(args, kwargs, 3, "bias"),
                      _arg(args, kwargs, 4, "eps", 1e-5))


def _call_f_batch_norm(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    return batch_norm(*(_arg(args, kwargs, i, name, default) for i, (name, default) in
                        enumerate((("input", None), ("running_mean", None),
                                   ("running_var", None), ("weight", None), ("bias", None),
                                   ("training", False), ("momentum", 0.1), ("eps", 1e-5)))))


def _call_torch_batch_norm(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    names = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum",
             "eps")
    x, weight, bias, running_mean, running_var, training, momentum, eps = (
        _arg(args, kwargs, i, name) for i, name in enumerate(names))
    return batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)


def _call_f_instance_norm(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    return instance_norm(*(_arg(args, kwargs, i, name, default) for i, (name, default) in
                           enumerate((("input", None), ("running_mean", None),
                                      ("running_var", None), ("weight", None), ("bias", None),
                                      ("use_input_stats", True), ("momentum", 0.1),
                                      ("eps", 1e-5)))))


def _call_torch_instance_norm(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    names = ("input", "weight", "bias", "running_mean", "running_var", "use_input_stats",
             "momentum", "eps")
    x, weight, bias, running_mean, running_var, use_input_stats, momentum, eps = (
        _arg(args, kwargs, i, name) for i, name in enumerate(names))
    return instance_norm(x, running_mean, running_var, weight, bias, use_input_stats,
                         momentum, eps)


def _layer_norm_layout(x: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    shape = _arg(args, kwargs, 1, "normalized_shape")
    return F.layer_norm(x, (shape,) if isinstance(shape, int) else tuple(shape))


def _batch_norm_layout(x: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    return F.batch_norm(x, None, None, training=True)  # no running statistics to update


def _instance_norm_layout(x: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    return F.instance_norm(x)


_LAYOUT_PROBES = {
    F.layer_norm: _layer_norm_layout, torch.layer_norm: _layer_norm_layout,
    F.batch_norm: _batch_norm_layout, torch.batch_norm: _batch_norm_layout,
    F.instance_norm: _instance_norm_layout, torch.instance_norm: _instance_norm_layout,
}
"""The fused op without statistics to update or affine terms, for the strides it gives."""

_DECOMPOSITIONS = {
    F.layer_norm: _call_layer_norm,
    torch.layer_norm: _call_layer_norm,
    F.batch_norm: _call_f_batch_norm,
    torch.batch_norm: _call_torch_batch_norm,
    F.instance_norm: _call_f_instance_norm,
    torch.instance_norm: _call_torch_instance_norm,
}


class DecomposedNorms(TorchFunctionMode):
    """Runs ``layer_norm``, ``batch_norm`` and ``instance_norm`` as plain ops.

    See NOTE [decomposed norms]. Every other call runs unchanged.

    Example:
        >>> x = torch.randn(4, 3, dtype=torch.float64)
        >>> with DecomposedNorms():
        ...     y = torch.nn.LayerNorm(3, dtype=torch.float64)(x)
        >>> y.grad_fn.name()  # not NativeLayerNormBackward0
        'AddBackward0'
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        try:
            decomposition = _DECOMPOSITIONS.get(func)
        except TypeError:  # an unhashable callable
            decomposition = None
        if decomposition is None:
            return func(*args, **kwargs)
        result = decomposition(args, kwargs)
        x = _arg(args, kwargs, 0, "input")
        if isinstance(x, Tensor) and result.dim() > 1 and _decomposed(func, args, kwargs):
            # the fused kernel's strides: a random op after it lays its draws out along them;
            # unseen by the modes below (ntvp's refuses calls with grad off under the caller's
            # jvp: every layer norm declined, naming no_grad regions f did not have)
            with torch.no_grad(), torch._C.DisableTorchFunction():
                original = _LAYOUT_PROBES[func](x.detach(), args, kwargs)
            result = laid_out_like(result, original)
        return result


def _decomposed(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the decomposition wrote the call with plain ops.

    Not where it runs the fused kernel itself: batch norm with running statistics in eval
    mode, instance norm with running ones.
    """
    if func in (F.layer_norm, torch.layer_norm):
        return True
    if func in (F.batch_norm, torch.batch_norm):
        stats = (1, 2) if func is F.batch_norm else (3, 4)
        names = ("running_mean", "running_var")
        fused = not _arg(args, kwargs, 5, "training", False) and all(
            _arg(args, kwargs, i, name) is not None for i, name in zip(stats, names, strict=True))
        return not fused
    return bool(_arg(args, kwargs, 5, "use_input_stats", True))  # instance norm
