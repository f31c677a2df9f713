"""``torchgram.aggregated_grad``: ``Jᵀ weighting(J Jᵀ)`` against the dense oracle."""

from __future__ import annotations

import optree
import pytest
import torch

import torchgram as tg
from reference import dense_gramian
from zoo import NAMES, build


def rows_weighting(G: torch.Tensor) -> torch.Tensor:
    """A deterministic, non-uniform weighting that depends on all of G."""
    return torch.softmax(G.diagonal() / G.diagonal().abs().max().clamp_min(1e-12), 0) + G.sum(0)


def expected_update(case, weighting=rows_weighting):
    dense = dense_gramian(case.f, case.args)
    weights = weighting(dense.gramian)
    return dense, weights, dense.jacobian.T @ weights


def flat_update(update) -> torch.Tensor:
    return torch.cat([u.reshape(-1) for u in optree.tree_leaves(update) if u is not None])


@pytest.mark.parametrize("batch", [None, "per_sample"])
@pytest.mark.parametrize("budget", [None, 256], ids=["one-block", "grouped"])
@pytest.mark.parametrize("name", NAMES)
def test_update_is_jacobian_transpose_times_weights(name, budget, batch) -> None:
    case = build(name)
    if batch and case.batch_dim is None:
        batch = None  # coupled samples: only the dense declaration is true
    dense, weights, expected = expected_update(case)
    update, info = tg.aggregated_grad(
        case.f, rows_weighting, batch_dim=case.batch_dim if batch else None,
        in_dims=case.in_dims, memory_budget=budget,
    )(*case.args)
    torch.testing.assert_close(flat_update(update), expected)
    torch.testing.assert_close(info.gramian, dense.shaped())
    torch.testing.assert_close(info.weights.reshape(-1), weights)
    for got, want in zip(optree.tree_leaves(info.output), optree.tree_leaves(dense.output),
                         strict=True):
        torch.testing.assert_close(got, want.detach())


def test_update_keeps_param_structure_and_one_block_needs_no_second_pass(monkeypatch) -> None:
    case = build("nested_pytree")
    calls = []
    original = torch.func.vjp
    monkeypatch.setattr(torch.func, "vjp", lambda *a, **k: calls.append(1) or original(*a, **k))
    update, _ = tg.aggregated_grad(case.f, rows_weighting, backend="jacobian")(*case.args)
    assert len(calls) == 1  # the Gramian's own forward; J^T w came from the kept block
    assert update[0]["step"] is None and update[1]["name"] is None
    assert update[0]["w"].shape == (3, 4) and update[1]["b"].shape == (2,)


def test_per_leaf_info_has_aux_and_tuple_argnums() -> None:
    case = build("mlp")
    scale = torch.tensor(2.0, dtype=torch.float64)

    def f(params, scale, x, y):
        out = case.f(params, x, y) * scale
        return out, {"mean": out.mean()}

    update, info = tg.aggregated_grad(f, rows_weighting, argnums=(0, 1), has_aux=True,
                                      per_leaf=True)(case.params, scale, *case.inputs)
    assert isinstance(update, tuple) and update[1].shape == ()
    assert isinstance(info.gramian, tuple) and set(info.gramian[0]) == set(case.params)
    torch.testing.assert_close(info.aux["mean"], info.output.mean())


def test_bad_weighting_is_rejected() -> None:
    case = build("mlp")
    with pytest.raises(TypeError, match="torchgram.aggregated_grad: expected a weighting "
                                        "callable"):
        tg.aggregated_grad(case.f, "upgrad")
    with pytest.raises(TypeError, match=r"tensor of shape \(5,\).*got shape \(5, 5\)"):
        tg.aggregated_grad(case.f, lambda G: G)(*case.args)
    with pytest.raises(ValueError, match="torchgram.aggregated_grad: expected chunk_size"):
        tg.aggregated_grad(case.f, rows_weighting, chunk_size=0)


def test_info_reports_where_the_step_time_went() -> None:
    case = build("mlp")
    _, info = tg.aggregated_grad(case.f, tg.weighting.upgrad, batch_dim=0)(*case.args)
    times = info.times
    assert times.gramian > 0 and times.weighting > 0 and times.pullback >= 0
    assert times.total == times.gramian + times.weighting + times.pullback
    assert "Gramian" in str(times) and "Jᵀw" in str(times)


@pytest.mark.parametrize("change", ["write", "output"])
@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "per-sample"])
@pytest.mark.parametrize("backend", ["auto", "structured", "graph", "jacobian", "ntvp"])
def test_a_stale_probe_met_by_the_pullback_starts_the_call_afresh(backend: str,
                                                                   batch_dim: int | None,
                                                                   change: str) -> None:
    """NOTE [evaluations after the backend]: graph and ntvp keep no pullback, and the vjp of
    ``Jᵀw`` evaluates ``f`` once more, after the retry of a stale probe: a write into a
    captured tensor or another output there raised torchgram's internal ``OutputChanged`` to
    the user. Now the whole step is made again; the update is right, the buffer kept."""
    from torchgram._core.signature import clear_caches

    torch.manual_seed(0)
    w, x = torch.randn(3, 2, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    counts = torch.zeros(3, dtype=torch.float64)
    state = {"calls": 0, "at": -1}

    def f(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        state["calls"] += 1
        out = torch.tanh(x @ w)
        if state["calls"] == state["at"]:  # once, in the last evaluation of a call
            if change == "write":
                counts.add_(1.0)
            else:
                return out[:, :1]
        return out

    def uniform(G: torch.Tensor) -> torch.Tensor:
        return torch.ones(G.shape[0], dtype=G.dtype)

    step = tg.aggregated_grad(f, uniform, backend=backend, batch_dim=batch_dim)
    clear_caches()
    step(w, x)
    before = state["calls"]
    step(w, x)  # under the cached probe: how many evaluations a call makes
    state["at"] = 2 * state["calls"] - before
    update, info = step(w, x)
    assert state["calls"] > state["at"]  # the change was met, and the step made again
    dense = dense_gramian(f, (w, x))
    torch.testing.assert_close(update.reshape(-1), dense.jacobian.T @ uniform(dense.gramian),
                               rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(info.output, torch.tanh(x @ w), rtol=0, atol=0)
    assert torch.equal(counts, torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("backend", ["auto", "structured", "graph", "jacobian", "ntvp"])
def test_the_update_keeps_the_derivative_of_learned_weights(backend: str) -> None:
    """Weights that depend on a tensor requiring grad (a learned task weighting): graph and
    ntvp gave an update without their derivative, 0.78 off (session 67's hunt)."""
    case = build("mlp", torch.float64)
    dense = dense_gramian(case.f, case.args)
    rows = dense.jacobian.shape[0]
    alpha = torch.linspace(0.1, 1.0, rows, dtype=torch.float64, requires_grad=True)
    update, _ = tg.aggregated_grad(case.f, lambda G: alpha * G.diagonal().detach(),
                                   backend=backend)(*case.args)
    direction = torch.randn(dense.jacobian.shape[1], dtype=torch.float64)
    derivative, = torch.autograd.grad(flat_update(update) @ direction, alpha)
    expected = (dense.jacobian @ direction) * dense.gramian.diagonal()
    torch.testing.assert_close(derivative, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", ["auto", "structured", "graph"])
def test_a_weightings_draws_stay_drawn(backend: str) -> None:
    """A random f and a weighting that draws (pcgrad without a generator): graph's ``Jᵀw``
    evaluates f again, and its finish put the generator back before the weighting's draws;
    the next step's dropout reused them (session 67's hunt)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Dropout(0.5),
                                torch.nn.Linear(16, 3)).double().train()
    fn, params = tg.functionalize(model)
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,))

    def losses(p, x, y):
        return torch.nn.functional.cross_entropy(fn(p, x), y, reduction="none")

    torch.manual_seed(7)
    losses(params, x, y)
    tg.weighting.pcgrad(torch.eye(6, dtype=torch.float64) - 0.1)
    expected = torch.get_rng_state()
    torch.manual_seed(7)
    tg.aggregated_grad(losses, tg.weighting.pcgrad, backend=backend)(params, x, y)
    assert torch.equal(torch.get_rng_state(), expected)
