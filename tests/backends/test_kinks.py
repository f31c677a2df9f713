"""Derivatives at kinks and PReLU: every backend agrees with the oracle.

NOTE [kinks in forward mode]: torch 2.13's forward mode takes another derivative than its
backward at ties of fmax / fmin of two tensors and of clamp with tensor bounds, and ntvp
multiplies the two (``J (Jᵀ e)``): 0.60 off (relative) with ``fmax(h, 0)`` where a weight
row was zero, before session 39. NOTE [prelu as where]: prelu's backward is wrong under
nested ``vmap`` (a PReLU network's per-sample Gramian with two samples of two outputs: 0.27
off on jacobian and auto, 0.25 on ntvp), its forward mode takes the slope 1 at 0, and the
structured backend had no rule for its weight.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 -- torch's own spelling
from torch import Tensor
from torch.func import jacfwd, jacrev

import torchgram as tg
from reference import dense_gramian, dense_gramian_fn
from torchgram.backends._kinks import ReverseKinks

# torch's first forward-mode derivative in a process loads decompositions that warn
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning")

BACKENDS = ["jacobian", "ntvp", "graph", "structured", "auto"]
DTYPE = torch.float64

ZERO = torch.zeros(6, dtype=DTYPE)
HALF = torch.full((6,), 0.5, dtype=DTYPE)
ACTIVATIONS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "prelu": lambda h, slope: F.prelu(h, slope),
    "prelu-method": lambda h, slope: h.prelu(slope),
    "fmax": lambda h, slope: torch.fmax(h, ZERO) + slope.sum() * h,
    "fmin": lambda h, slope: torch.fmin(ZERO, h) + slope.sum() * h,
    "clamp-min": lambda h, slope: torch.clamp(h, min=ZERO) + slope.sum() * h,
    "clamp-both": lambda h, slope: h.clamp(ZERO, HALF) + slope.sum() * h,
    "clip": lambda h, slope: torch.clip(h, max=ZERO) + slope.sum() * h,
    "clamp-min-method": lambda h, slope: h.clamp_min(ZERO) + slope.sum() * h,
    "clamp-in-place": lambda h, slope: (h * 1.0).clamp_(min=ZERO) + slope.sum() * h,
}


def _problem(samples: int = 4) -> tuple[dict[str, Tensor], Tensor]:
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(6, 3, dtype=DTYPE, generator=generator)
    w[0] = 0.0  # every sample's first pre-activation is exactly at the kink
    w[1] = -w[2]
    params = {"w": w, "slope": torch.full((1,), 0.25, dtype=DTYPE),
              "v": torch.randn(2, 6, dtype=DTYPE, generator=generator)}
    x = torch.randn(samples, 3, dtype=DTYPE, generator=generator)
    x[0] = 0.0  # one sample at the kink everywhere
    return params, x


def _f(activation: str) -> Callable[[dict[str, Tensor], Tensor], Tensor]:
    act = ACTIVATIONS[activation]
    return lambda p, x: act(x @ p["w"].T, p["slope"]) @ p["v"].T


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("samples", [2, 4])  # 2: as many samples as rows per sample
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gramian_matches_the_oracle(activation: str, samples: int, backend: str) -> None:
    params, x = _problem(samples)
    f = _f(activation)
    expected = dense_gramian(f, (params, x))
    G = tg.gramian(f, backend=backend, batch_dim=0)(params, x)
    torch.testing.assert_close(G.reshape(2 * samples, -1), expected.gramian,
                               rtol=1e-10, atol=1e-12)
    rows = lambda p, x: f(p, x).sum(-1)  # noqa: E731
    torch.testing.assert_close(tg.gramian(rows, backend=backend, batch_dim=0)(params, x),
                               dense_gramian(rows, (params, x)).gramian, rtol=1e-10, atol=1e-12)
    blocks = tg.gramian(f, backend=backend, per_leaf=True)(params, x)
    for name, block in zip(sorted(params), expected.blocks, strict=True):
        torch.testing.assert_close(blocks[name].reshape(2 * samples, -1), block,
                                   rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("activation", ["prelu", "fmax", "clamp-both"])
def test_cross_kernel(activation: str, backend: str) -> None:
    params, x = _problem()
    f = _f(activation)
    kernel = tg.ntk.empirical_ntk_fn(f, trace_axes=(), backend=backend)(x, x[:2], params)
    joined = dense_gramian(lambda p, x: f(p, x).reshape(-1), (params, x)).gramian
    torch.testing.assert_close(kernel, joined.reshape(4, 2, 4, 2)[:, :, :2].permute(0, 2, 1, 3),
                               rtol=1e-10, atol=1e-12)


def test_prelu_network_runs_batched_on_the_structured_backend() -> None:
    """PReLU's slopes are an elementwise use once it runs as ``torch.where``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.PReLU(3), torch.nn.Flatten(),
                                torch.nn.Linear(48, 2), torch.nn.PReLU()).double()
    fn, params = tg.functionalize(model)
    x = torch.randn(4, 2, 6, 6, dtype=DTYPE)
    explanation = tg.explain(fn, batch_dim=0, run=True)(params, x)
    assert explanation.ran.backend == "structured" and explanation.ran.way == "batched"
    assert "fallback" not in {leaf.way for leaf in explanation.leaves}, explanation
    expected = dense_gramian(fn, (params, x)).gramian
    torch.testing.assert_close(tg.gramian(fn, batch_dim=0)(params, x).reshape(8, 8), expected,
                               rtol=1e-10, atol=1e-12)


POINTS = torch.tensor([-3.0, -1.0, 0.0, 0.5, 1.0, float("nan")], dtype=DTYPE)
BOUND = torch.tensor([0.0, float("nan"), 0.0, 0.5, 2.0, 0.0], dtype=DTYPE)
CALLS: dict[str, Callable[[Tensor], Tensor]] = {
    "fmax": lambda x: torch.fmax(x, BOUND), "fmax-method": lambda x: x.fmax(BOUND.flip(0)),
    "fmin": lambda x: torch.fmin(BOUND, x),
    "clamp-min": lambda x: x.clamp(min=BOUND), "clamp-max": lambda x: torch.clamp(x, max=BOUND),
    "clamp-both": lambda x: x.clamp(ZERO, BOUND), "clamp-crossed": lambda x: x.clamp(HALF, ZERO),
    "clip": lambda x: torch.clip(x, BOUND, None),
    "clamp_max": lambda x: torch.clamp_max(x, BOUND),
    "clamp_": lambda x: (x * 1.0).clamp_(max=BOUND),
    "clamp_min_": lambda x: (x * 1.0).clamp_min_(BOUND),
    "broadcast": lambda x: x.reshape(2, 3).clamp(min=BOUND[:3]),
}
TIED = {"fmax", "clamp-min", "clamp-max", "clamp-both", "clip", "clamp_", "broadcast"}
"""The calls whose plain forward mode differs from the backward at these points."""


@pytest.mark.parametrize("call", CALLS)
def test_reverse_kinks_keeps_values_and_takes_the_backwards_derivative(call: str) -> None:
    op = CALLS[call]
    plain = op(POINTS)
    with ReverseKinks():
        value = op(POINTS)
        forward = jacfwd(op)(POINTS)
    torch.testing.assert_close(value, plain, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(forward, jacrev(op)(POINTS), equal_nan=True, rtol=0, atol=0)
    differs = not torch.equal(jacfwd(op)(POINTS).nan_to_num(), forward.nan_to_num())
    assert differs == (call in TIED)  # the points do hit torch's differing conventions


@pytest.mark.parametrize("backend", ["jacobian", "auto"])
@pytest.mark.parametrize("activation", ["prelu", "fmax", "clamp-both"])
def test_derivative_through_the_gramian(activation: str, backend: str) -> None:
    """Second derivatives of ``f`` at the kinks: torch.func.grad through ``G``. The oracle
    computes prelu by its definition (torch's double backward of prelu at 0 is not the
    derivative of its backward: ``tests/core/test_prelu.py``)."""
    params, x = _problem(2)
    f = _f(activation)
    names = sorted(params)
    weights = torch.randn(2, 2, 2, 2, dtype=DTYPE, generator=torch.Generator().manual_seed(3))

    def objective(gramian: Callable[..., Tensor]) -> Callable[..., Tensor]:
        return lambda *leaves: (gramian(dict(zip(names, leaves, strict=True)), x)
                                * weights).sum()

    leaves = tuple(params[name] for name in names)
    argnums = tuple(range(len(leaves)))
    ours = torch.func.grad(objective(tg.gramian(f, backend=backend, batch_dim=0)),
                           argnums=argnums)(*leaves)
    expected = torch.func.grad(objective(dense_gramian_fn(f, chunk_size=1)),
                               argnums=argnums)(*leaves)
    for got, want in zip(ours, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


def _tangent_of_gramian(backend: str | None, activation: str, params: dict[str, Tensor],
                        x: Tensor) -> Tensor:
    """``torch.func.jvp`` through ``G`` (``backend``'s, or the oracle's where ``None``) of a
    layer with a bias: ``act(x wᵀ + b) vᵀ``."""
    act = ACTIVATIONS[activation]

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return act(x @ p["w"].T + p["b"], p["slope"]) @ p["v"].T

    gramian = dense_gramian_fn(f, chunk_size=1) if backend is None \
        else tg.gramian(f, backend=backend, batch_dim=0)
    generator = torch.Generator().manual_seed(5)
    tangents = {name: torch.randn(leaf.shape, dtype=DTYPE, generator=generator)
                for name, leaf in params.items()}
    return torch.func.jvp(lambda p: gramian(p, x), (params,), (tangents,))[1]


@pytest.mark.parametrize("backend", ["jacobian", "ntvp", "auto"])
@pytest.mark.parametrize("activation", ["fmax", "fmin", "clamp-min", "clamp-both", "clip"])
def test_forward_mode_through_the_gramian(activation: str, backend: str) -> None:
    """The caller's jvp through ``G`` where a zero input meets a zero bias: pre-activations at
    the kink whose tangents (the bias's) are not the bound's. The caller's tangent takes
    torch's forward-mode convention there (the oracle's); where it is not the backward's,
    ntvp's pass, which needs the backward's for its own tangents, cannot split the two and
    declines (NOTE [kinks in forward mode]; 0.016 to 0.033 off before session 45). Off the
    kinks, and where the conventions agree (fmin, clamp with two tensor bounds), it answers."""
    params, x = _problem(2)
    params = dict(params, b=torch.zeros(6, dtype=DTYPE))  # x[0] = 0: sample 0 at every kink
    if backend == "ntvp" and activation in {"fmax", "clamp-min", "clip"}:
        with pytest.raises(tg.BackendCannotRun, match="ties at fmax.*jacobian"):
            _tangent_of_gramian(backend, activation, params, x)
        params = dict(params, w=params["w"] + 0.125, b=params["b"] + 0.25)  # off every kink
    torch.testing.assert_close(_tangent_of_gramian(backend, activation, params, x),
                               _tangent_of_gramian(None, activation, params, x),
                               rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prelu_that_a_cached_probe_did_not_see(backend: str) -> None:
    """NOTE [stale probes]: the same function object switches to prelu on its second call."""
    params, x = _problem(2)
    switch = {"prelu": False}

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        h = x @ p["w"].T
        h = F.prelu(h, p["slope"]) if switch["prelu"] else torch.tanh(h) + p["slope"] * h
        return h @ p["v"].T

    gramian = tg.gramian(f, backend=backend, batch_dim=0)
    gramian(params, x)
    switch["prelu"] = True
    torch.testing.assert_close(gramian(params, x).reshape(4, 4),
                               dense_gramian(f, (params, x)).gramian, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("batch_dim", [0, None], ids=["batch0", "dense"])
@pytest.mark.parametrize("backend", ["structured", "graph", "auto"])
def test_prelu_inside_a_checkpoint_region(backend: str, batch_dim: int | None) -> None:
    """A non-reentrant checkpoint's backward recomputes its region without torchgram's modes:
    prelu runs there as it is (written as ``where`` it raised torch's ``CheckpointError``)."""
    params, x = _problem()

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        h = torch.utils.checkpoint.checkpoint(F.prelu, x @ p["w"].T, p["slope"],
                                              use_reentrant=False)
        return F.prelu(h, p["slope"]) @ p["v"].T

    torch.testing.assert_close(
        tg.gramian(f, backend=backend, batch_dim=batch_dim)(params, x).reshape(8, 8),
        dense_gramian(f, (params, x)).gramian, rtol=1e-10, atol=1e-12)
