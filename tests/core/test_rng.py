"""One draw per call, from the default generators and from those ``f`` names itself.

NOTE [one draw] and NOTE [explicit generators] (``_core/rng.py``): before session 57, an
``f`` drawing its mask from a ``torch.Generator`` of its own got a Gramian mixing the masks
of several evaluations (0.76 to 3.4 off, relative, on every backend but the graph walk), and
the generator was left elsewhere than one plain call leaves it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import Tensor

import torchgram as tg
from reference import dense_cross_kernel, dense_gramian

DOUBLE = torch.float64
BACKENDS = ["auto", "structured", "graph", "jacobian", "ntvp"]


def _setup(seed: int) -> tuple[Callable[..., Tensor], dict[str, Tensor], torch.Generator]:
    torch.manual_seed(0)
    params = {"w": torch.randn(4, 6, dtype=DOUBLE), "v": torch.randn(6, 3, dtype=DOUBLE)}
    generator = torch.Generator().manual_seed(seed)

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        h = torch.tanh(x @ p["w"])
        mask = torch.bernoulli(torch.full_like(h, 0.5), generator=generator) * 2
        return ((h * mask) @ p["v"]).sin().sum(1)

    return f, params, generator


def _plain(f: Callable[..., Tensor], params: dict[str, Tensor], x: Tensor,
           generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """The oracle of one plain call from the generator's state now, and where it leaves it."""
    start = generator.get_state()
    wanted = dense_gramian(f, (params, x)).gramian
    end = generator.get_state()
    generator.set_state(start)
    return wanted, end


@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "batch_dim0"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_explicit_generator_gives_one_draw_or_a_refusal(backend: str,
                                                           batch_dim: int | None) -> None:
    f, params, generator = _setup(11)
    gramian = tg.gramian(f, backend=backend, batch_dim=batch_dim)
    for _ in range(2):  # the second call of the signature: its probe is not reused
        x = torch.randn(5, 4, dtype=DOUBLE)
        wanted, end = _plain(f, params, x, generator)
        G = _gramian_or_refusal(gramian, backend, params, x)
        if G is None:
            return
        torch.testing.assert_close(G, wanted, rtol=1e-10, atol=1e-12)
        assert torch.equal(generator.get_state(), end)  # where one plain call leaves it


def _gramian_or_refusal(gramian: Callable[..., Tensor], backend: str,
                        *args: object) -> Tensor | None:
    """``gramian(*args)``, or ``None`` where a backend that runs ``f`` under transforms
    declines a random ``f`` (as for dropout)."""
    try:
        return gramian(*args)
    except tg.BackendCannotRun as error:
        assert backend in ("jacobian", "ntvp"), error
        assert "draws random numbers" in str(error)
        return None


def test_aggregated_grad_and_kernels_see_one_draw() -> None:
    f, params, generator = _setup(3)
    x = torch.randn(5, 4, dtype=DOUBLE)
    wanted, end = _plain(f, params, x, generator)
    update, info = tg.aggregated_grad(f, tg.weighting.upgrad, batch_dim=0)(params, x)
    torch.testing.assert_close(info.gramian, wanted, rtol=1e-10, atol=1e-12)
    assert torch.equal(generator.get_state(), end)
    generator.manual_seed(3)
    leaves = {name: value.detach().requires_grad_() for name, value in params.items()}
    expected = torch.autograd.grad(f(leaves, x), list(leaves.values()), info.weights)
    for name, grad in zip(leaves, expected, strict=True):
        torch.testing.assert_close(update[name], grad, rtol=1e-10, atol=1e-12)
    generator.manual_seed(3)
    kernel_wanted = dense_cross_kernel(f, params, x, None)
    generator.manual_seed(3)
    kernel = tg.ntk.empirical_ntk_fn(f, trace_axes=(), vmap_axes=None)(x, None, params)
    torch.testing.assert_close(kernel, kernel_wanted, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "batch_dim0"])
@pytest.mark.parametrize("backend", ["auto", "structured", "graph"])
def test_the_default_generator_named_explicitly_after_dropout(backend: str,
                                                              batch_dim: int | None) -> None:
    """``generator=torch.default_generator`` after a dropout's draw: adopting it as an
    explicit generator (from its state at that use) broke its restore (1.02 off, a review's
    find in session 57); the default generators are RngState's alone."""
    torch.manual_seed(0)
    params = {"w": torch.randn(4, 6, dtype=DOUBLE)}
    x = torch.randn(5, 4, dtype=DOUBLE)

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        h = torch.nn.functional.dropout(torch.tanh(x @ p["w"]), 0.5)
        noise = torch.rand(h.shape, dtype=DOUBLE, generator=torch.default_generator)
        return (h * noise).sin().sum(1)

    start = torch.get_rng_state()
    wanted = dense_gramian(f, (params, x)).gramian
    end = torch.get_rng_state()
    torch.set_rng_state(start)
    G = tg.gramian(f, backend=backend, batch_dim=batch_dim)(params, x)
    torch.testing.assert_close(G, wanted, rtol=1e-10, atol=1e-12)
    assert torch.equal(torch.get_rng_state(), end)


@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "batch_dim0"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_generator_first_drawn_from_under_a_cached_probe(backend: str,
                                                           batch_dim: int | None) -> None:
    """A first call that draws nothing (eval mode) caches the signature's probe; the next
    draws from ``f``'s own generator: every evaluation hands it to the call's draw, not only
    the probe's (2.24 off on auto and structured, 0.6 to 2.3 on jacobian and ntvp, a review's
    find in session 57)."""
    f, params, generator = _setup(5)
    training = {"on": False}

    def g(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return f(p, x) if training["on"] else torch.tanh(x @ p["w"]).sum(1)

    gramian = tg.gramian(g, backend=backend, batch_dim=batch_dim)
    x = torch.randn(5, 4, dtype=DOUBLE)
    gramian(params, x)
    training["on"] = True
    wanted, end = _plain(g, params, x, generator)
    try:
        G = gramian(params, x)
    except tg.BackendCannotRun as error:
        assert backend in ("jacobian", "ntvp") and "draws random numbers" in str(error), error
        return
    torch.testing.assert_close(G, wanted, rtol=1e-10, atol=1e-12)
    assert torch.equal(generator.get_state(), end)


def _host_draws(source: str) -> Callable[[tuple[int, ...]], Tensor]:
    """A mask of ``shape`` from Python's ``random`` or numpy's global ``np.random``."""
    if source == "numpy":
        return lambda shape: torch.from_numpy(
            (np.random.rand(*shape) < 0.5).astype(np.float64)) * 2
    return lambda shape: torch.tensor(
        [float(random.random() < 0.5) for _ in range(math.prod(shape))],
        dtype=DOUBLE).reshape(shape) * 2


def _host_state(source: str) -> object:
    return np.random.get_state()[1].tolist() if source == "numpy" else random.getstate()


@pytest.mark.parametrize("source", ["numpy", "python"])
@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "batch_dim0"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_host_generators_give_one_draw_or_a_refusal(backend: str, batch_dim: int | None,
                                                        source: str) -> None:
    """NOTE [host generators]: masks drawn from ``np.random`` (``transformers``' SpecAugment)
    or ``random`` were drawn anew by each evaluation: 0.4-0.9 off on every backend but graph
    (session 60's hunt), and the generators were left elsewhere than one plain call leaves
    them."""
    torch.manual_seed(0)
    params = {"w": torch.randn(4, 6, dtype=DOUBLE), "v": torch.randn(6, 3, dtype=DOUBLE)}
    mask_of = _host_draws(source)

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        h = torch.tanh(x @ p["w"])
        return ((h * mask_of(tuple(h.shape))) @ p["v"]).sin().sum(1)

    np.random.seed(3)
    random.seed(3)
    gramian = tg.gramian(f, backend=backend, batch_dim=batch_dim)
    for _ in range(2):
        x = torch.randn(5, 4, dtype=DOUBLE)
        start = (random.getstate(), np.random.get_state())
        wanted = dense_gramian(f, (params, x)).gramian
        end = _host_state(source)
        random.setstate(start[0])
        np.random.set_state(start[1])
        G = _gramian_or_refusal(gramian, backend, params, x)
        if G is None:
            return
        torch.testing.assert_close(G, wanted, rtol=1e-10, atol=1e-12)
        assert _host_state(source) == end


@pytest.mark.parametrize("backend", ["auto", "structured", "ntvp"])
def test_a_kernel_between_two_input_sets_of_a_numpy_drawing_f(backend: str) -> None:
    """Each input set's evaluations start from the call's state: the second set's first
    evaluation once started where the first set's left numpy (0.76-1.0 off; the review of
    session 60)."""
    torch.manual_seed(0)
    w = torch.randn(4, 3, dtype=DOUBLE)
    x1, x2 = torch.randn(5, 4, dtype=DOUBLE), torch.randn(3, 4, dtype=DOUBLE)
    mask_of = _host_draws("numpy")

    def f(w: Tensor, x: Tensor) -> Tensor:
        h = torch.tanh(x @ w)
        return h * mask_of(tuple(h.shape))

    np.random.seed(5)
    start = np.random.get_state()
    J1 = torch.func.jacrev(f)(w, x1).reshape(5, 3, -1)
    np.random.set_state(start)
    J2 = torch.func.jacrev(f)(w, x2).reshape(3, 3, -1)
    wanted = torch.einsum("ikp,jlp->ijkl", J1, J2)
    np.random.set_state(start)
    try:
        kernel = tg.ntk.empirical_ntk_fn(f, trace_axes=(), backend=backend)(x1, x2, w)
    except tg.BackendCannotRun as error:
        assert backend == "ntvp" and "draws random numbers" in str(error), error
        return
    torch.testing.assert_close(kernel, wanted, rtol=1e-10, atol=1e-12)
