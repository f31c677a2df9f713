"""NOTE [unseen calls]: a Gramian differentiated through TorchScript is refused, never wrong.

torch computes zero second derivatives through a TorchScript function under ``torch.func``
transforms. Unit tests of :class:`UnseenCalls` (what it sees, and no false alarm on the zoo),
then the public API: under ``grad`` and ``jvp`` every backend refuses before any work; with
a graph (create-graph) ``G``'s value is the oracle's and its backward raises; ``vmap`` (first
order) answers; a plain ``f`` keeps its derivative.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import Tensor

import torchgram as tg
import zoo
from reference import dense_cross_kernel, dense_gramian, dense_gramian_fn
from torchgram._core.unseen import UnseenCalls

# torch.func.jvp scripts its forward-mode decompositions on its first use in a process
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning")

DOUBLE = torch.float64
BACKENDS = tg.backends.backend_names()

with warnings.catch_warnings():  # torch >= 2.11: torch.jit.script is deprecated
    warnings.simplefilter("ignore", DeprecationWarning)

    @torch.jit.script
    def _scripted_linear(h: Tensor, w: Tensor) -> Tensor:
        return h @ w.t()


def _plain_linear(h: Tensor, w: Tensor) -> Tensor:
    return h @ w.t()


def _losses(linear: Callable[[Tensor, Tensor], Tensor]) -> Callable[..., Tensor]:
    """Per-sample losses through an embedding, then ``linear`` (the hunt's shape of case)."""

    def f(params: dict[str, Tensor], ids: Tensor) -> Tensor:
        h = torch.nn.functional.embedding(ids, params["embed"])
        return (torch.tanh(linear(h, params["w"])) ** 2).sum(-1)

    return f


def _params() -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(5, 3, generator=generator, dtype=DOUBLE),
            "w": torch.randn(4, 3, generator=generator, dtype=DOUBLE)}


IDS = torch.tensor([0, 3, 3, 1])


def _warmed(steps: int) -> tuple[Callable[..., Tensor], dict[str, Tensor]]:
    """Losses through a freshly scripted linear layer, warmed by ``steps`` training steps
    (backwards with parameters that require grad), and those parameters."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)

        @torch.jit.script
        def fresh_linear(h: Tensor, w: Tensor) -> Tensor:
            return h @ w.t()

    f = _losses(fresh_linear)
    params = {name: value.clone().requires_grad_() for name, value in _params().items()}
    for _ in range(steps):
        f(params, IDS).sum().backward()
    return f, params


def test_unseen_calls_sees_the_ops_of_a_scripted_function_only() -> None:
    params = _params()
    with UnseenCalls() as plain:
        _losses(_plain_linear)(params, IDS)
    with UnseenCalls() as scripted:
        _losses(_scripted_linear)(params, IDS)
    assert plain.ops == []
    assert "aten.mm.default" in scripted.ops


@pytest.mark.parametrize("name", sorted(zoo.BUILDERS))
def test_unseen_calls_sees_nothing_on_the_zoo(name: str) -> None:
    case = zoo.build(name)
    with UnseenCalls() as unseen:
        case.f(*case.args)
    assert unseen.ops == []


@pytest.mark.parametrize("transform", ["grad", "jvp"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_differentiating_through_torchscript_is_refused(backend: str, transform: str) -> None:
    f, params = _losses(_scripted_linear), _params()
    gramian = tg.gramian(f, backend=backend, batch_dim=0)

    def objective(p: dict[str, Tensor]) -> Tensor:
        return gramian(p, IDS).sum()

    with pytest.raises(NotImplementedError, match=r"^torchgram\.gramian: .*TorchScript"):
        if transform == "grad":
            torch.func.grad(objective)(params)
        else:
            torch.func.jvp(objective, (params,), (params,))


@pytest.mark.parametrize("backend", ["auto", "jacobian", "graph"])  # G with a graph
def test_create_graph_gives_the_value_and_refuses_the_derivative(backend: str) -> None:
    f, params = _losses(_scripted_linear), _params()
    expected = dense_gramian(f, (params, IDS)).shaped()
    with_grad = {name: value.clone().requires_grad_() for name, value in params.items()}
    for _ in range(3):  # also once TorchScript has optimised the function
        G = tg.gramian(f, backend=backend, batch_dim=0)(with_grad, IDS)
        torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-12)
        assert G.requires_grad
        with pytest.raises(NotImplementedError, match=r"^torchgram\.gramian: .*TorchScript"):
            G.sum().backward()


@pytest.mark.parametrize("backend", ["auto", "jacobian", "ntvp"])
def test_vmap_over_torchscript_answers(backend: str) -> None:
    f, params = _losses(_scripted_linear), _params()
    ensemble = {name: torch.stack([value, 0.5 * value]) for name, value in params.items()}
    G = torch.func.vmap(lambda p: tg.gramian(f, backend=backend, batch_dim=0)(p, IDS))(ensemble)
    for k in range(2):
        one = {name: value[k] for name, value in ensemble.items()}
        torch.testing.assert_close(G[k], dense_gramian(f, (one, IDS)).shaped(), rtol=1e-10,
                                   atol=1e-12)


def test_kernel_with_a_graph_refuses_its_derivative() -> None:
    f, params = _losses(_scripted_linear), _params()
    with_grad = {name: value.clone().requires_grad_() for name, value in params.items()}
    x2 = torch.tensor([2, 4])
    kernel = tg.ntk.empirical_ntk_fn(f, trace_axes=())(IDS, x2, with_grad)
    torch.testing.assert_close(kernel, dense_cross_kernel(f, params, IDS, x2), rtol=1e-10,
                               atol=1e-12)
    with pytest.raises(NotImplementedError, match=r"^torchgram\.ntk.*TorchScript"):
        kernel.sum().backward()


def test_a_plain_f_keeps_its_derivative_after_a_scripted_one() -> None:
    f, params = _losses(_plain_linear), _params()
    with_grad = {name: value.clone().requires_grad_() for name, value in params.items()}
    G = tg.gramian(f, batch_dim=0)(with_grad, IDS)
    G.sum().backward()
    assert all(value.grad is not None for value in with_grad.values())


def test_a_probe_cached_without_a_graph_is_looked_at_again() -> None:
    f, params = _losses(_scripted_linear), _params()
    gramian = tg.gramian(f, batch_dim=0)
    gramian(params, IDS)  # probed without looking for unseen calls (nothing is differentiated)
    with pytest.raises(NotImplementedError, match="TorchScript"):
        torch.func.grad(lambda p: gramian(p, IDS).sum())(params)


@pytest.mark.parametrize("transform", ["grad", "jvp"])
def test_a_plain_f_is_differentiated_through_under_transforms(transform: str) -> None:
    f, params = _losses(_plain_linear), _params()

    def objective(gramian: Callable[..., Tensor]) -> Callable[[dict[str, Tensor]], Tensor]:
        return lambda p: gramian(p, IDS).sum()

    ours = objective(tg.gramian(f, batch_dim=0))
    oracle = objective(dense_gramian_fn(f, 0, chunk_size=1))
    if transform == "grad":
        got, expected = torch.func.grad(ours)(params), torch.func.grad(oracle)(params)
    else:
        got = torch.func.jvp(ours, (params,), (params,))[1]
        expected = torch.func.jvp(oracle, (params,), (params,))[1]
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def _constants_f(p: dict[str, Tensor], x: Tensor) -> Tensor:
    """Plain torch that dispatches ops outside any torch call: none of them computes."""
    mask = torch.from_numpy(np.array([1.0, 0.0, 1.0, 1.0])) * torch.Tensor([1.0]).double()
    scale = torch.FloatTensor(4).fill_(0.5).double()  # a legacy constructor: aten.empty
    h = torch.tanh(x @ p["w"].T) * mask * scale
    moved = torch.func.vmap(lambda row: row * 2.0, out_dims=1)(h)  # vmap moves its dim back
    return (moved.T ** 2).sum(-1)


def test_views_and_constants_made_outside_torch_calls_are_not_unseen_calls() -> None:
    params, x = {"w": _params()["w"]}, torch.randn(5, 3, dtype=DOUBLE)
    with UnseenCalls() as unseen:
        _constants_f(params, x)
    assert unseen.ops == []
    ours = torch.func.grad(lambda p: tg.gramian(_constants_f, batch_dim=0)(p, x).sum())(params)
    oracle = dense_gramian_fn(_constants_f, 0, chunk_size=1)
    expected = torch.func.grad(lambda p: oracle(p, x).sum())(params)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-12)


def test_a_warmed_scripted_function_that_gives_g_no_graph_still_refuses() -> None:
    """TorchScript's optimised plan, after a few runs with inputs that require grad, gave the
    backends' G no graph: its term silently left the user's backward (session 38's review)."""
    f, params = _warmed(steps=2)
    G = tg.gramian(f, batch_dim=0)(params, IDS)
    torch.testing.assert_close(G, dense_gramian(f, (params, IDS)).shaped(), rtol=1e-10,
                               atol=1e-12)
    assert G.requires_grad
    with pytest.raises(NotImplementedError, match="G's value is right"):
        (G.sum() + params["w"].sum()).backward()


def test_higher_order_operators_pass_through() -> None:
    x = torch.randn(3, dtype=DOUBLE)
    with UnseenCalls() as unseen:
        y = torch.cond(x.sum() > 0, lambda v: v * 2.0, lambda v: v * 3.0, (x,))
    assert unseen.ops == []
    torch.testing.assert_close(y, x * (2.0 if x.sum() > 0 else 3.0))


@pytest.mark.parametrize("backend", ["auto", "jacobian", "graph"])
def test_the_update_of_a_warmed_scripted_function_refuses_its_derivative(backend: str) -> None:
    """``aggregated_grad``'s update with create-graph: once the scripted function had warmed
    up, auto and jacobian returned it without a graph (its term silently left the backward)."""
    f, params = _warmed(steps=6)
    update, _ = tg.aggregated_grad(f, tg.weighting.mean, backend=backend, batch_dim=0)(
        params, IDS)
    with torch.no_grad():
        expected = torch.func.grad(lambda p: f(p, IDS).mean())(
            {name: value.detach() for name, value in params.items()})
    for name, value in update.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-10, atol=1e-12)
        assert value.requires_grad
    with pytest.raises(NotImplementedError, match="TorchScript"):
        (update["w"].sum() + params["w"].sum()).backward()
