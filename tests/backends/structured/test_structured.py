"""The structured backend: both ways on every zoo model, the cost model, options, purity."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchgram as tg
from helpers import flat_gramian, make_problem
from reference import dense_gramian, dense_gramian_fn
from torchgram._core.sink import to_backend_order
from torchgram.backends.structured import plan_problem, run_structured
from zoo import NAMES, build

_problem = make_problem


def _forced(case, way, batch_dim, diagonal):
    problem = _problem(case.f, case.args, batch_dim=batch_dim, in_dims=case.in_dims,
                       diagonal=diagonal)
    return flat_gramian(problem, run_structured(problem, force=way))


def _close(actual, expected):
    scale = expected.abs().max().clamp_min(1.0)
    torch.testing.assert_close(actual / scale, expected / scale, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("way", ["ghost", "materialize", "sparse"])
@pytest.mark.parametrize(("name", "per_sample"), [
    pytest.param(name, per_sample, id=f"{name}-{'batch' if per_sample else 'dense'}")
    for name in NAMES for per_sample in (False, True)
    if not (per_sample and build(name).batch_dim is None)
])
def test_both_ways_match_oracle_on_zoo(name, per_sample, way):
    """Cross terms of tied / reused leaves, index grams, groups: ghost and materialize agree."""
    case = build(name)
    expected = dense_gramian(case.f, case.args).gramian
    batch_dim = case.batch_dim if per_sample else None
    _close(_forced(case, way, batch_dim, diagonal=False), expected)
    _close(_forced(case, way, batch_dim, diagonal=True), expected.diagonal())


def _mlp_losses(widths, batch):
    layers = []
    for d_in, d_out in zip(widths[:-1], widths[1:], strict=False):
        layers += [nn.Linear(d_in, d_out), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    fn, params = tg.functionalize(model)
    x, y = torch.randn(batch, widths[0]), torch.randint(0, widths[-1], (batch,))
    return (lambda p, x, y: F.cross_entropy(fn(p, x), y, reduction="none")), (params, x, y)


def test_cost_model_picks_ghost_for_mlp_layers_without_positions():
    f, args = _mlp_losses([784, 512, 512, 10], batch=64)
    plan = plan_problem(_problem(f, args, batch_dim=0))
    ways = {tuple(args[0][name].shape): p.way for name, p in zip(sorted(args[0]), plan.leaves,
                                                                  strict=True)}
    assert ways[(512, 784)] == ways[(512, 512)] == ways[(10, 512)] == "ghost"
    assert all(p.ghost_cost < p.materialize_cost for p in plan.leaves if p.way == "ghost")


def test_cost_model_materializes_long_sequences_of_narrow_layers():
    params = {"w": torch.randn(8, 8)}

    def f(p, x):  # x: [B, T=256, 8]
        return torch.tanh(F.linear(x, p["w"])).mean((1, 2))

    plan = plan_problem(_problem(f, (params, torch.randn(16, 256, 8)), batch_dim=0))
    assert [p.way for p in plan.leaves] == ["materialize"]
    assert plan.leaves[0].ghost_cost > plan.leaves[0].materialize_cost
    short = plan_problem(_problem(f, (params, torch.randn(16, 1, 8)), batch_dim=0))
    assert [p.way for p in short.leaves] == ["ghost"]


def test_memory_budget_turns_a_large_materialized_jacobian_into_ghost():
    params = {"w": torch.randn(8, 8)}

    def f(p, x):
        return torch.tanh(F.linear(x, p["w"])).mean((1, 2))

    args = (params, torch.randn(16, 256, 8))
    assert [p.way for p in plan_problem(_problem(f, args, batch_dim=0,
                                                 memory_budget=1024)).leaves] == ["ghost"]


@pytest.mark.parametrize("chunk_size", [None, 1, 4, 100])
@pytest.mark.parametrize("memory_budget", [None, 2048])
def test_ntk_rows_in_chunks(chunk_size, memory_budget):
    case = build("mlp_logits")
    expected = dense_gramian(case.f, case.args)
    for batch_dim in (None, 0):
        G = tg.gramian(case.f, backend="structured", batch_dim=batch_dim, chunk_size=chunk_size,
                       memory_budget=memory_budget)(*case.args)
        _close(G, expected.shaped())


def test_shared_inputs_and_in_dims():
    torch.manual_seed(0)
    params = {"w": torch.randn(3, 4, dtype=torch.float64)}

    def f(p, x, shift):
        return torch.tanh(F.linear(x + shift, p["w"])).sum(-1)

    args = (params, torch.randn(5, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64))
    G = tg.gramian(f, backend="structured", batch_dim=0, in_dims=(0, None))(*args)
    _close(G, dense_gramian(f, args).gramian)


def test_output_without_dependence_on_parameters_gives_zeros():
    params = {"w": torch.randn(3, 4, dtype=torch.float64)}
    x = torch.randn(5, 4, dtype=torch.float64)
    for batch_dim in (None, 0):
        G = tg.gramian(lambda p, x: x.sum(-1), backend="structured", batch_dim=batch_dim)(params, x)
        assert torch.equal(G, torch.zeros(5, 5, dtype=torch.float64))


def test_user_tensors_are_left_alone():
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    params = {name: p.detach().clone().requires_grad_() for name, p in model.named_parameters()}
    before = {name: p.detach().clone() for name, p in params.items()}
    x = torch.randn(6, 4)

    def f(p, x):
        return torch.func.functional_call(model, p, (x,)).sum(-1)

    for batch_dim in (None, 0):
        G = tg.gramian(f, backend="structured", batch_dim=batch_dim)(params, x)
        assert G.requires_grad  # create-graph: NOTE [composition]
        with torch.no_grad():
            G = tg.gramian(f, backend="structured", batch_dim=batch_dim)(params, x)
        assert not G.requires_grad
    for name, p in params.items():
        assert p.requires_grad and p.grad is None and p.is_leaf
        assert torch.equal(p.detach(), before[name])
    assert all(p.grad is None for p in model.parameters())


def test_aggregated_grad_uses_the_rows_the_backend_recorded():
    case = build("mlp")
    weights = lambda G: torch.linspace(0.5, 1.5, G.shape[0], dtype=G.dtype)  # noqa: E731
    reference, info_ref = tg.aggregated_grad(case.f, weights, backend="jacobian",
                                             batch_dim=0)(*case.args)
    update, info = tg.aggregated_grad(case.f, weights, backend="structured",
                                      batch_dim=0)(*case.args)
    torch.testing.assert_close(info.output, info_ref.output)
    for name in reference:
        torch.testing.assert_close(update[name], reference[name])


def _forward_kind(f, args, **options):
    report = tg.explain(f, backend="structured", batch_dim=0, run=True, **options)(*args).ran
    assert report is not None and report.backend == "structured"
    return report.way


def test_per_sample_forward_runs_batched_when_shapes_say_where_samples_are():
    mlp = build("mlp")
    assert _forward_kind(mlp.f, mlp.args) == "batched"
    elementwise = build("elementwise")  # an elementwise parameter needs the fallback
    assert _forward_kind(elementwise.f, elementwise.args) == "vmap"
    attention = build("attention")  # self-attention is rewritten into linear layers
    assert _forward_kind(attention.f, attention.args) == "batched"
    params = {"w": torch.randn(3, 4, dtype=torch.float64), "b": torch.randn(3, dtype=torch.float64)}

    def flat_tokens(p, x):  # [B, T, 4] -> [B·T, 4]: each sample's tokens together
        return torch.addmm(p["b"], x.reshape(-1, 4), p["w"].T).reshape(x.shape[0], -1).sum(-1)

    args = (params, torch.randn(5, 2, 4, dtype=torch.float64))
    assert _forward_kind(flat_tokens, args) == "batched"
    _close(tg.gramian(flat_tokens, backend="structured", batch_dim=0)(*args),
           dense_gramian(flat_tokens, args).gramian)

    def interleaved(p, x):  # [B, T, 4] -> [T·B, 4]: the same shapes, samples interleaved
        h = torch.addmm(p["b"], x.transpose(0, 1).reshape(-1, 4), p["w"].T)
        return h.reshape(x.shape[1], x.shape[0], -1).transpose(0, 1).reshape(x.shape[0], -1)\
            .sum(-1)

    assert _forward_kind(interleaved, args) == "vmap"  # the check of merged dims finds it
    _close(tg.gramian(interleaved, backend="structured", batch_dim=0)(*args),
           dense_gramian(interleaved, args).gramian)


@pytest.mark.parametrize(("order", "way"), [("sample-major", "batched"),
                                             ("interleaved", "dense")])
def test_merged_sample_dims_of_a_random_f_are_checked_by_derivatives(order, way):
    """With dropout the samples cannot run apart: the derivative check finds the order (NOTE
    [merged order from derivatives]); every call, the first and later ones, the oracle's."""
    params = {"w": torch.randn(3, 4, dtype=torch.float64), "b": torch.randn(3, dtype=torch.float64)}

    def f(p, x):
        merged = x.reshape(-1, 4) if order == "sample-major" else x.transpose(0, 1).reshape(-1, 4)
        h = F.dropout(torch.addmm(p["b"], merged, p["w"].T), 0.3, training=True)
        if order == "interleaved":
            return h.reshape(x.shape[1], x.shape[0], -1).transpose(0, 1).reshape(x.shape[0], -1)\
                .tanh().sum(-1)
        return h.reshape(x.shape[0], -1).tanh().sum(-1)

    transform = tg.gramian(f, backend="structured", batch_dim=0)
    for seed in range(3):
        args = (params, torch.randn(5, 2, 4, dtype=torch.float64))
        torch.manual_seed(seed)
        assert _forward_kind(f, args) == way
        torch.manual_seed(seed)
        expected = dense_gramian(f, args).gramian
        torch.manual_seed(seed)
        _close(transform(*args), expected)


def test_a_cached_trace_that_no_longer_fits_is_caught():
    state = {"square": False}
    params = {"w": torch.randn(3, 4, dtype=torch.float64)}

    def f(p, x):
        h = torch.tanh(F.linear(x, p["w"]))
        return (h * p["w"].sum() if state["square"] else h).sum(-1)

    x = torch.randn(5, 4, dtype=torch.float64)
    transform = tg.gramian(f, backend="structured", batch_dim=0)
    _close(transform(params, x), dense_gramian(f, (params, x)).gramian)
    state["square"] = True  # same code, same shapes: the cached trace is stale
    _close(transform(params, x), dense_gramian(f, (params, x)).gramian)


@pytest.mark.parametrize("way", ["ghost", "materialize", "sparse"])
@pytest.mark.parametrize(("name", "per_sample"), [
    pytest.param(name, per_sample, id=f"{name}-{'batch' if per_sample else 'dense'}")
    for name in ["mlp_logits", "cnn", "transformer", "tied_lm", "elementwise", "embedding",
                 "batch_on_dim1", "pytree_output"]
    for per_sample in (False, True)
])
def test_pullback_from_kept_factors_matches_a_vjp(name, per_sample, way):
    case = build(name)
    batch_dim = case.batch_dim if per_sample else None
    problem = _problem(case.f, case.args, batch_dim=batch_dim, in_dims=case.in_dims,
                       want_pullback=True)
    result = run_structured(problem, force=way)
    assert result.pullback is not None
    weights = torch.linspace(-1, 2, problem.output.num_rows, dtype=torch.float64)
    _, vjp_fn = torch.func.vjp(lambda *leaves: problem.rows(leaves)[0], *problem.leaves)
    ours = result.pullback(to_backend_order(problem, result.row_order, weights))
    for actual, expected in zip(ours, vjp_fn(weights), strict=True):
        _close(actual, expected)


def test_aggregated_grad_needs_no_second_pass(monkeypatch):
    case = build("mlp")

    def no_vjp(*args, **kwargs):
        raise AssertionError("aggregated_grad ran a vjp: the structured pullback was not used")

    reference, _ = tg.aggregated_grad(case.f, lambda G: torch.ones(G.shape[0], dtype=G.dtype),
                                      backend="jacobian", batch_dim=0)(*case.args)
    monkeypatch.setattr(torch.func, "vjp", no_vjp)
    update, _ = tg.aggregated_grad(case.f, lambda G: torch.ones(G.shape[0], dtype=G.dtype),
                                   backend="structured", batch_dim=0)(*case.args)
    for name in reference:
        _close(update[name], reference[name])


@pytest.mark.parametrize("name", ["mlp", "elementwise"])
def test_works_when_called_under_no_grad(name):
    case = build(name)
    expected = dense_gramian(case.f, case.args).shaped()
    with torch.no_grad():
        for batch_dim in (None, case.batch_dim):
            _close(tg.gramian(case.f, backend="structured", batch_dim=batch_dim)(*case.args),
                   expected)


def test_a_stale_cached_trace_is_traced_afresh_not_run_on_the_fallback():
    """A trace cached under the same key but made by another function (ids are reused once
    their objects are collected, or a switch the key cannot see): the run traces afresh and
    takes the batched pass, as a fresh trace plans it, instead of the all-fallback way."""
    state = {"deeper": False}
    params = {"w": torch.randn(4, 4, dtype=torch.float64),
              "v": torch.randn(2, 4, dtype=torch.float64)}

    def f(p, x):
        h = torch.tanh(F.linear(x, p["w"]))
        if state["deeper"]:  # w used twice
            h = torch.tanh(F.linear(h, p["w"]))
        return F.linear(h, p["v"]).sum(-1)

    x = torch.randn(5, 4, dtype=torch.float64)
    tg.gramian(f, backend="structured", batch_dim=0)(params, x)
    state["deeper"] = True  # same code, same shapes: the cached trace is another function's
    report = tg.explain(f, backend="structured", batch_dim=0, run=True)(params, x)
    assert report.ran is not None and "fallback" not in report.ran.leaf_ways
    _close(tg.gramian(f, backend="structured", batch_dim=0)(params, x),
           dense_gramian(f, (params, x)).gramian)


@pytest.mark.parametrize("affine", [False, True], ids=["plain", "affine"])
def test_differentiable_gramian_through_group_norm(affine: bool):
    """torch 2.13's batched double backward through ``F.group_norm`` is wrong without a word
    (``is_grads_batched`` with ``create_graph``): leaves that require grad make ``G``
    differentiable, and the embedding's rows came through it 3-5 off. They are taken one
    cotangent at a time there; ``G`` and its gradient match the oracle's."""
    torch.manual_seed(0)
    params = {"table": torch.randn(6, 3, dtype=torch.float64),
              "weight": 1 + 0.3 * torch.randn(3, dtype=torch.float64),
              "head": torch.randn(2, 3, dtype=torch.float64)}
    params = {name: value.requires_grad_() for name, value in params.items()
              if affine or name != "weight"}
    tokens = torch.randint(0, 6, (3, 4))

    def f(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        h = F.embedding(x, p["table"]).transpose(1, 2)  # [B, C, T]
        h = F.group_norm(h, 1, p["weight"] if affine else None)
        return (h.transpose(1, 2) @ p["head"].T).sum(1).reshape(-1)  # [B * 2] rows

    gram = tg.gramian(f, backend="structured")(params, tokens)
    expected = dense_gramian_fn(f, chunk_size=1)(params, tokens)  # jacrev looped: exact
    torch.testing.assert_close(gram, expected, rtol=1e-10, atol=1e-10)
    grads = torch.autograd.grad(gram.square().sum(), list(params.values()))
    expected_grads = torch.autograd.grad(expected.square().sum(), list(params.values()))
    for grad, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, want, rtol=1e-8, atol=1e-10)


def _routed(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Each sample through the expert its input picks, dispatched as mixtures of experts do."""
    route = (x[:, 0] > 0).long()
    out = torch.zeros_like(x)
    for expert in route.unique():  # reads the batch's values: the passes go sample by sample
        chosen = torch.where(route == expert)[0]
        out.index_add_(0, chosen, F.linear(x[chosen], p[f"w{expert.item()}"]))
    return out.sum(-1)


@pytest.mark.parametrize("backend", ["structured", "auto"])
def test_samples_routed_through_other_weights_than_the_first(backend: str) -> None:
    """The sample-by-sample pass checked only the first sample's run against the trace: a later
    sample routed through another expert had its use counted under the first one's tap
    (18% off here; 2.8e-2 on transformers' Switch encoder; session 67's review)."""
    torch.manual_seed(0)
    params = {"w0": torch.randn(2, 2, dtype=torch.float64),
              "w1": torch.randn(2, 2, dtype=torch.float64)}
    x = torch.randn(3, 2, dtype=torch.float64).abs()
    x[1, 0] *= -1  # samples 0 and 2 through w1, sample 1 through w0
    gramian = tg.gramian(_routed, backend=backend, batch_dim=0)(params, x)
    torch.testing.assert_close(gramian, dense_gramian(_routed, (params, x)).gramian, rtol=1e-10,
                               atol=1e-12)
