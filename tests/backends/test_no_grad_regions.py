"""``no_grad`` regions inside ``f``, on every backend (NOTE [no_grad in forward mode]).

A stop-gradient written as ``with torch.no_grad():`` (a target computed from the same
network, an EMA buffer updated in the forward) contributes nothing to the backward's
Jacobian, but forward-mode AD pushes tangents through it: ntvp's ``J (Jᵀ e)`` was neither
the oracle's Gramian nor any Gramian (session 40: 1.7e-2 off with an EMA buffer). Every
case is compared with the dense float64 oracle (``jacrev``, which respects the regions).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import torchgram as tg
from reference import dense_gramian
from torchgram.backends.ntvp import _prepare_forward_ad

_prepare_forward_ad()  # torch's first forward-mode product warns (NOTE [first forward-AD call])

DOUBLE = torch.float64
BACKENDS = ["auto", "structured", "graph", "jacobian", "ntvp"]


class _EMA(nn.Module):
    """Subtracts an EMA of the batch's activations, updated in the forward under no_grad."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.register_buffer("ema", torch.zeros(3))

    def forward(self, x: Tensor) -> Tensor:
        h = self.linear(x)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * h.mean(0))
        return h - self.ema


def _network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DOUBLE)


@torch.no_grad()
def _decorated_target(fn: Callable[..., Tensor], p: dict[str, Tensor], x: Tensor) -> Tensor:
    return fn(p, x.flip(1))


def _cases() -> dict[str, tuple[Callable[..., Tensor], dict[str, Tensor]]]:
    torch.manual_seed(0)
    ema_fn, ema_params = tg.functionalize(_EMA().to(DOUBLE))
    net_fn, net_params = tg.functionalize(_network())

    def stop_gradient_target(p: dict[str, Tensor], x: Tensor) -> Tensor:
        with torch.no_grad():
            target = net_fn(p, x.flip(1))
        return (net_fn(p, x) - target).pow(2).sum(1)

    def grad_disabled_scale(p: dict[str, Tensor], x: Tensor) -> Tensor:
        out = net_fn(p, x)
        with torch.set_grad_enabled(False):
            scale = out.norm(dim=1, keepdim=True)
        return (out / scale).sum(1) + out[:, 0]

    return {
        "ema-buffer": (lambda p, x: ema_fn(p, x).pow(2).sum(1), ema_params),
        "stop-gradient-target": (stop_gradient_target, net_params),
        "decorated-target": (lambda p, x: (net_fn(p, x) - _decorated_target(net_fn, p, x))
                             .pow(2).sum(1), net_params),
        "grad-disabled-scale": (grad_disabled_scale, net_params),
    }


CASES = list(_cases())


@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "per-sample"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_gramian_as_the_backward_sees_it(case: str, backend: str, batch_dim: int | None) -> None:
    f, params = _cases()[case]
    x = torch.randn(6, 4, dtype=DOUBLE)
    wanted = dense_gramian(f, (params, x)).shaped()
    actual = tg.gramian(f, backend=backend, batch_dim=batch_dim)(params, x)
    torch.testing.assert_close(actual, wanted, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", ["ntvp", "jacobian", "auto"])
@pytest.mark.parametrize("case", [case for case in CASES if case != "ema-buffer"])
def test_kernel_as_the_backward_sees_it(case: str, backend: str) -> None:
    """Cross kernels (the EMA couples the samples through its values: no kernel of two sets
    is defined by one forward there)."""
    f, params = _cases()[case]
    x1, x2 = torch.randn(6, 4, dtype=DOUBLE), torch.randn(3, 4, dtype=DOUBLE)
    kernel = tg.ntk.empirical_ntk_fn(lambda p, x: f(p, x)[:, None], trace_axes=(),
                                     backend=backend)
    wanted = tg.ntk.empirical_ntk_fn(lambda p, x: f(p, x)[:, None], trace_axes=(),
                                     backend="graph")(x1, x2, params)
    torch.testing.assert_close(kernel(x1, x2, params), wanted, rtol=1e-10, atol=1e-12)


def test_a_call_under_no_grad_keeps_its_regions() -> None:
    """The caller's ``no_grad`` around the call: ntvp runs its pass with grad mode on, so the
    regions inside ``f`` are still told apart."""
    f, params = _cases()["stop-gradient-target"]
    x = torch.randn(6, 4, dtype=DOUBLE)
    wanted = dense_gramian(f, (params, x)).shaped()
    with torch.no_grad():
        actual = tg.gramian(f, backend="ntvp", batch_dim=0)(params, x)
    torch.testing.assert_close(actual, wanted, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("transform", ["jvp", "jacfwd"])
def test_forward_mode_through_g_declines_ntvp_by_name(transform: str) -> None:
    """Under the caller's forward mode a detach would stop the caller's tangents too: ntvp
    declines naming the backends that can, and ``auto`` answers with them."""
    f, params = _cases()["stop-gradient-target"]
    x = torch.randn(6, 4, dtype=DOUBLE)

    def g_of(backend: str) -> Callable[[Tensor], Tensor]:
        def g(scale: Tensor) -> Tensor:
            scaled = {name: value * scale for name, value in params.items()}
            return tg.gramian(f, backend=backend, batch_dim=0)(scaled, x).sum()

        return g

    one = torch.ones((), dtype=DOUBLE)

    def derivative(backend: str) -> Tensor:
        if transform == "jvp":
            return torch.func.jvp(g_of(backend), (one,), (one,))[1]
        return torch.func.jacfwd(g_of(backend))(one)

    with pytest.raises(tg.BackendCannotRun, match="no_grad"):
        derivative("ntvp")
    assert torch.is_grad_enabled()  # f's no_grad region, left by the refusal, restored it
    torch.testing.assert_close(derivative("auto"), derivative("jacobian"), rtol=1e-10,
                               atol=1e-12)


def _gaussian_head() -> tuple[Callable[..., Tensor], dict[str, Tensor], Tensor]:
    """A heteroscedastic regression head whose variance is below ``eps`` on some samples.

    ``F.gaussian_nll_loss`` clamps the variance in place under ``no_grad`` inside itself
    (NOTE [no_grad inside torch's own functions]); the samples with ``x[:, 0] < 0`` get a
    variance far below ``eps = 1``.
    """
    net_fn, params = tg.functionalize(_network())

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        out = net_fn(p, x)
        var = torch.exp(out[:, 1:2] + 9.0 * torch.sign(x[:, :1]))
        return F.gaussian_nll_loss(out[:, :1], x[:, 1:2], var, reduction="none",
                                   eps=1.0)[:, 0]

    torch.manual_seed(1)
    x = torch.randn(6, 4, dtype=DOUBLE)
    x[:, 0] = x[:, 0].abs() * torch.tensor([-1.0, 1.0], dtype=DOUBLE).repeat(3)
    return f, params, x


@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "per-sample"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_variance_clamped_inside_gaussian_nll_loss(backend: str,
                                                     batch_dim: int | None) -> None:
    """ntvp's forward mode took the derivative of the loss's inner ``no_grad`` clamp, 0 for
    every clamped variance: G 0.99 off (session 53's hunt). Every backend is the oracle's."""
    f, params, x = _gaussian_head()
    wanted = dense_gramian(f, (params, x)).shaped()
    actual = tg.gramian(f, backend=backend, batch_dim=batch_dim)(params, x)
    torch.testing.assert_close(actual, wanted, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", ["ntvp", "auto"])
def test_a_variance_clamped_inside_gaussian_nll_loss_in_a_kernel(backend: str) -> None:
    f, params, x = _gaussian_head()
    kernel = tg.ntk.empirical_ntk_fn(lambda p, x: f(p, x)[:, None], trace_axes=(),
                                     backend=backend)
    wanted = tg.ntk.empirical_ntk_fn(lambda p, x: f(p, x)[:, None], trace_axes=(),
                                     backend="graph")
    torch.testing.assert_close(kernel(x, x[1:4] * 2, params), wanted(x, x[1:4] * 2, params),
                               rtol=1e-10, atol=1e-12)


def test_forward_mode_through_gaussian_nll_loss_declines_ntvp_by_name() -> None:
    f, params, x = _gaussian_head()

    def g(scale: Tensor) -> Tensor:
        scaled = {name: value * scale for name, value in params.items()}
        return tg.gramian(f, backend="ntvp", batch_dim=0)(scaled, x).sum()

    one = torch.ones((), dtype=DOUBLE)
    with pytest.raises(tg.BackendCannotRun, match="gaussian_nll_loss"):
        torch.func.jvp(g, (one,), (one,))


def test_the_straight_through_variance_keeps_the_loss() -> None:
    f, params, x = _gaussian_head()
    from torchgram.backends._no_grad_tangents import NoGradStopsTangents

    with NoGradStopsTangents():
        inside = f(params, x)
    torch.testing.assert_close(inside, f(params, x), rtol=0, atol=0)
