"""``backend="graph"``: the functional front of the graph walk, and its memory frontier.

Agreement with the oracle on every zoo model is in ``test_oracle.py``; the imperative API
and the walk's exactness on joins, non-leaf inputs and custom Functions are in
``tests/test_autograd.py``. Here: what the functional front promises about the user's
tensors, aux and ignored options, and that the walk holds only its frontier.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

import torchgram as tg
from reference import dense_gramian
from torchgram.backends import backend_names
from zoo import build

DOUBLE = torch.float64


def assert_matches(actual: Tensor, expected: Tensor) -> None:
    assert actual.shape == expected.shape
    scale = expected.abs().max().clamp_min(1.0)
    torch.testing.assert_close(actual / scale, expected / scale, rtol=1e-10, atol=1e-10)


def test_graph_is_a_registered_backend() -> None:
    assert "graph" in backend_names()


def test_user_tensors_are_not_the_walked_leaves_and_stay_untouched() -> None:
    model = nn.Linear(3, 2).to(DOUBLE)  # parameters require grad
    frozen = torch.randn(2, dtype=DOUBLE)  # does not
    seen: list[Tensor] = []

    def f(params: dict[str, Tensor], x: Tensor) -> Tensor:
        seen.extend(params.values())
        return torch.tanh(x @ params["w"].T + params["b"]) @ params["v"]

    params = {"w": model.weight, "b": model.bias, "v": frozen}
    x = torch.randn(4, 3, dtype=DOUBLE)
    with torch.no_grad():  # no graph wanted through G: f runs once, on fresh leaves
        G = tg.gramian(f, backend="graph")(params, x)
    assert len(seen) == 3  # f ran once, on the walked leaves
    assert all(t.requires_grad and t.grad_fn is None for t in seen)
    assert not any(t is p for t in seen for p in params.values())
    assert_matches(G, dense_gramian(f, (params, x)).gramian)
    assert model.weight.grad is None and model.bias.grad is None
    assert not frozen.requires_grad and frozen.grad is None
    seen.clear()
    G = tg.gramian(f, backend="graph")(params, x)  # G carries the graph: NOTE [composition]
    assert G.requires_grad and not any(t is p for t in seen for p in params.values())
    assert_matches(G.detach(), dense_gramian(f, (params, x)).gramian)
    assert model.weight.grad is None and model.bias.grad is None
    assert not frozen.requires_grad and frozen.grad is None


def test_has_aux_returns_the_full_batch_aux_detached() -> None:
    case = build("mlp", DOUBLE)

    def with_aux(params: Any, *inputs: Any) -> tuple[Tensor, dict[str, Any]]:
        out = case.f(params, *inputs)
        return out, {"out": out, "rows": out.shape[0], "none": None}

    G, aux = tg.gramian(with_aux, backend="graph", has_aux=True)(*case.args)
    assert_matches(G, dense_gramian(case.f, case.args).gramian)
    torch.testing.assert_close(aux["out"], case.f(*case.args))
    assert aux["out"].grad_fn is None and not aux["out"].requires_grad
    assert aux["rows"] == 5 and aux["none"] is None


def test_works_when_called_under_no_grad() -> None:
    case = build("mlp_logits", DOUBLE)
    with torch.no_grad():
        G = tg.gramian(case.f, backend="graph")(*case.args)
    assert_matches(G, dense_gramian(case.f, case.args).shaped())


def test_function_independent_of_the_parameters_has_a_zero_gramian() -> None:
    x = torch.randn(4, 3, dtype=DOUBLE)
    G = tg.gramian(lambda w, x: x.sin(), backend="graph")(torch.randn(2, dtype=DOUBLE), x)
    assert torch.equal(G, torch.zeros(4, 3, 4, 3, dtype=DOUBLE))


def test_batch_dim_and_memory_budget_are_accepted_and_change_nothing() -> None:
    case = build("batch_on_dim1", DOUBLE)
    expected = dense_gramian(case.f, case.args).shaped()
    for options in (dict(batch_dim=1, in_dims=1), dict(memory_budget=64)):
        G = tg.gramian(case.f, backend="graph", **options)(*case.args)
        assert_matches(G, expected)
    with pytest.raises(ValueError, match=r"output dim 0 \(batch_dim\) to have size 5"):
        tg.gramian(case.f, backend="graph", batch_dim=0, in_dims=1)(*case.args)


# -- the frontier ------------------------------------------------------------------------------

WIDTH, DEPTH, BATCH = 16, 8, 6


def deep_chain(params: list[Tensor], x: Tensor) -> Tensor:
    h = x
    for w in params:
        h = torch.tanh(h @ w)
    return h.sum(1)


def peak_live_jacobian(**options: Any) -> tuple[int, Tensor]:
    """Run the graph backend on ``deep_chain``; return the peak numel of filled slots."""
    torch.manual_seed(0)
    params = [torch.randn(WIDTH, WIDTH, dtype=DOUBLE) / 4 for _ in range(DEPTH)]
    x = torch.randn(BATCH, WIDTH, dtype=DOUBLE)
    explanation = tg.explain(deep_chain, backend="graph", run=True, **options)(params, x)
    assert explanation.ran is not None and explanation.ran.backend == "graph"
    G = explanation.gramian
    assert_matches(G, dense_gramian(deep_chain, (params, x)).shaped(diagonal="diagonal" in options))
    return explanation.ran.peak_frontier, G


def one_layer(rows: int) -> int:
    """Row-Jacobians of one layer: its activation ``[BATCH, WIDTH]`` and its weight."""
    return rows * (BATCH * WIDTH + WIDTH * WIDTH)


def test_walk_holds_only_its_frontier() -> None:
    peak, _ = peak_live_jacobian()
    # m = BATCH rows. Were nothing freed, every layer's slots would be alive at the end.
    assert peak <= one_layer(BATCH) < DEPTH * one_layer(BATCH)


def test_diagonal_with_chunks_walks_a_few_rows_at_a_time() -> None:
    peak, _ = peak_live_jacobian(diagonal=True, chunk_size=2)
    assert peak <= one_layer(2)  # two rows at a time, not BATCH


class _Tagged(torch.Tensor):
    """A tensor subclass with a Python ``__torch_function__`` (tagging, logging libraries)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("api", ["graph", "auto", "eager-walked", "eager-recorded"])
def test_a_tensor_subclass_leaf(api: str) -> None:
    """``get_gradient_edge`` of a subclass leaf went through its ``__torch_function__`` and
    gave a new view node: the graph walk and the eager API gave the leaf a zero block (the
    update of ``aggregated_grad`` on graph 0.34 off; session 60's hunt)."""

    generator = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, generator=generator, dtype=torch.float64).as_subclass(_Tagged)
    x = torch.randn(5, 4, generator=generator, dtype=torch.float64)

    def f(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return (x @ w).tanh().sum(1)

    wanted = dense_gramian(lambda w, x: f(w.as_subclass(torch.Tensor), x),
                           (w.as_subclass(torch.Tensor), x)).gramian
    if api.startswith("eager"):
        leaf = w.detach().requires_grad_()
        if api == "eager-recorded":
            with tg.autograd.record():
                losses = f(leaf, x)
        else:
            losses = f(leaf, x)
        G = tg.autograd.gramian(losses, [leaf], batch_dim=0)
    else:
        G = tg.gramian(f, backend=api, batch_dim=0)(w, x)
    torch.testing.assert_close(G.as_subclass(torch.Tensor), wanted, rtol=1e-10, atol=1e-12)
