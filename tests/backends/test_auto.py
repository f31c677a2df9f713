"""``backend="auto"``: the shape-based choice, and that it runs what it chose."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchgram as tg
from helpers import make_problem
from reference import dense_gramian
from torchgram.backends import backend_names
from torchgram.backends.auto import choose_backend, estimate_backends, pick
from torchgram.backends.structured import plan_problem

_problem = make_problem


def _mlp_losses(widths, batch):
    layers = []
    for d_in, d_out in zip(widths[:-1], widths[1:], strict=False):
        layers += [nn.Linear(d_in, d_out), nn.ReLU()]
    fn, params = tg.functionalize(nn.Sequential(*layers[:-1]))
    x, y = torch.randn(batch, widths[0]), torch.randint(0, widths[-1], (batch,))
    return (lambda p, x, y: F.cross_entropy(fn(p, x), y, reduction="none")), (params, x, y)


@pytest.mark.parametrize("diagonal", [False, True])
def test_structured_for_per_sample_losses_of_a_covered_model(diagonal):
    f, args = _mlp_losses([784, 512, 512, 10], batch=64)
    assert choose_backend(_problem(f, args, batch_dim=0, diagonal=diagonal)) == "structured"


def test_a_budget_counts_one_column_chunk_of_a_materialized_jacobian():
    """``held_memory``: a materialized weight over many positions is contracted by column
    chunks (NOTE [Gram by column chunks]), so a budget under its whole Jacobian but over its
    chunks keeps the structured pass (before: the jacobian backend, 4x the memory on an
    LSTM)."""
    torch.manual_seed(0)
    params = {name: torch.randn(256, 256, dtype=torch.float64) / 16 for name in ("w1", "w2")}

    def f(p, x):
        return torch.tanh(F.linear(torch.tanh(F.linear(x, p["w1"])), p["w2"])).sum((1, 2))

    args = (params, torch.randn(16, 32, 256, dtype=torch.float64))
    budget = 12 * 2**20  # each Jacobian 8 MiB (16 in all), one chunk each about 2 MiB
    explanation = tg.explain(f, batch_dim=0, memory_budget=budget, run=True)(*args)
    assert [leaf.way for leaf in explanation.leaves] == ["materialize", "materialize"]
    estimate = explanation.estimates["structured"]
    assert estimate.fits and estimate.memory < budget / 2
    assert explanation.auto_choice == "structured"
    assert explanation.ran is not None and explanation.ran.backend == "structured"
    expected = dense_gramian(f, args).gramian
    torch.testing.assert_close(explanation.gramian, expected, rtol=1e-10, atol=1e-10)


def test_structured_for_the_ntk_of_an_mlp():
    fn, params = tg.functionalize(nn.Sequential(nn.Linear(256, 256), nn.Tanh(),
                                                nn.Linear(256, 10)))
    args = (params, torch.randn(16, 256))
    assert choose_backend(_problem(lambda p, x: fn(p, x), args, batch_dim=0)) == "structured"


def test_jacobian_for_a_tiny_problem():
    args = (torch.randn(3, 2), torch.randn(4, 3))
    assert choose_backend(_problem(lambda w, x: torch.tanh(x @ w).sum(-1), args)) == "jacobian"


def test_ntvp_for_huge_parameters_few_rows_and_a_memory_budget():
    params = {"scale": torch.randn(1_000_000)}

    def f(p, x):  # an elementwise parameter: no rule, a fallback for structured
        return (torch.tanh(x * p["scale"])).sum(-1)

    args = (params, torch.randn(4, 1_000_000))
    budget = 8 * 2**20
    problem = _problem(f, args, memory_budget=budget)
    estimates = estimate_backends(problem, plan_problem(problem))
    assert not estimates["structured"].fits
    assert estimates["jacobian"].memory <= budget and estimates["ntvp"].fits
    assert pick(estimates) == "ntvp"
    assert choose_backend(_problem(f, args)) != "ntvp"  # without a budget, m·P is fine


def test_estimates_are_positive_and_name_registered_backends():
    f, args = _mlp_losses([20, 16, 3], batch=5)
    problem = _problem(f, args, batch_dim=0)
    estimates = estimate_backends(problem, plan_problem(problem))
    assert set(estimates) <= set(backend_names())
    assert all(e.time > 0 and e.memory >= 0 for e in estimates.values())


def test_auto_runs_its_choice_and_matches_the_oracle():
    f, args = _mlp_losses([12, 16, 3], batch=6)
    args64 = tuple(a.double() if a.is_floating_point() else a for a in args[1:])
    params64 = {k: v.double() for k, v in args[0].items()}
    expected = dense_gramian(f, (params64, *args64)).gramian
    for batch_dim in (None, 0):
        G = tg.gramian(f, backend="auto", batch_dim=batch_dim)(params64, *args64)
        torch.testing.assert_close(G, expected)


class _SquareWithoutJvp(torch.autograd.Function):
    """No forward-mode derivative: ntvp cannot push through it."""

    @staticmethod
    def forward(x):
        return x * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


def test_auto_falls_back_when_its_choice_declares_it_cannot_run():
    """ntvp fits a tight budget best, but f has an op without forward AD: the next one runs."""
    params = {"scale": torch.randn(1_000_000, dtype=torch.float64)}

    def f(p, x):  # huge P, four rows: ntvp (as in the test above)
        return _SquareWithoutJvp.apply(torch.tanh(x * p["scale"])).sum(-1)

    args = (params, torch.randn(4, 1_000_000, dtype=torch.float64))
    budget = 8 * 2**20
    explanation = tg.explain(f, memory_budget=budget, run=True)(*args)
    assert explanation.auto_choice == "ntvp"
    ran = explanation.ran
    assert ran.backend != "ntvp" and [name for name, _ in ran.attempts] == ["ntvp"]
    assert "_SquareWithoutJvp without a jvp" in ran.attempts[0][1]
    expected = tg.gramian(f, backend="graph")(*args)
    torch.testing.assert_close(explanation.gramian, expected)
    with pytest.raises(NotImplementedError, match="backend='jacobian' or backend='graph'"):
        tg.gramian(f, backend="ntvp", memory_budget=budget)(*args)


@pytest.mark.parametrize(("suite", "name"), [
    ("transformers", "bert-mask-eager"), ("transformers", "gpt2-mask-sdpa"),
    ("transformers", "llama-mask-eager"), ("transformers", "vit-eager"),
    ("vision", "resnet-eval"), ("vision", "mobilenet"),
])
def test_small_real_models_with_per_sample_rows_go_to_structured(suite, name):
    """The jacobian backend's per-sample ``vmap(jacrev)`` costs ~0.2 ms a torch call, and
    ``transformers``' mask code makes it loop over the samples (NOTE [reads of the batch's
    values]): at these small sizes it took 2-3 times (and with a mask 13-20 times) the
    structured backend's time, where ``auto`` picked it before session 64."""
    from models import transformers_models, vision
    from models.case import build

    builders = {"transformers": transformers_models.BUILDERS, "vision": vision.BUILDERS}[suite]
    case = build(builders, name)
    report = tg.explain(case.f, batch_dim=0, in_dims=case.in_dims)(*case.args,
                                                                    **case.kw_inputs)
    assert report.backend == "structured", report.estimates


@pytest.mark.parametrize(("name", "learnt"), [
    pytest.param("gemma", False, id="gemma-fallback-leaves"),
    pytest.param("mixtral", False, id="mixtral-router"),
    pytest.param("t5", True, id="t5-run-not-batched"),
    pytest.param("fnet", True, id="fnet-run-not-batched-under-vmap"),
])
def test_the_graph_walk_where_the_structured_pass_loops_over_the_samples(name, learnt):
    """NOTE [the graph walk against loops]: where the structured pass goes per sample (a leaf
    on the fallback, or a run that cannot be batched, which the first call finds: NOTE [runs
    that cannot be batched]), under vmap or in a loop where f reads the batch's values, the
    walk is 1.4-3.5 times faster (session 64)."""
    from models import transformers_models
    from models.case import build

    case = build(transformers_models.BUILDERS, name)
    options = {"batch_dim": 0, "in_dims": case.in_dims}
    if learnt:
        tg.gramian(case.f, **options)(*case.args, **case.kw_inputs)
    report = tg.explain(case.f, run=True, **options)(*case.args, **case.kw_inputs)
    assert report.backend == report.ran.backend == "graph", report.estimates


def test_the_graph_walk_is_not_taken_where_its_rows_grow_with_the_batch():
    """The walk carries all ``B`` rows through the batch's backward (its time grows as B²,
    the structured pass's as B): with a leaf no rule covers at B = 128, the walk took 5-8
    times the structured pass, which ``auto`` keeps (the second review of session 64)."""
    torch.manual_seed(0)
    width, depth = 64, 12
    layers = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])
    fn, params = tg.functionalize(nn.ModuleDict({"layers": layers, "head": nn.Linear(width, 10)}))
    params = {**params, "power": torch.full((width,), 1.2)}

    def f(p, x, y):
        h = (x.abs() + 1) ** p["power"]  # no rule: a fallback leaf, per sample
        for i in range(depth):
            h = h + torch.tanh(F.linear(h, p[f"layers.{i}.weight"], p[f"layers.{i}.bias"]))
        logits = F.linear(h, p["head.weight"], p["head.bias"])
        return F.cross_entropy(logits, y, reduction="none")

    x, y = torch.randn(128, width), torch.randint(0, 10, (128,))
    report = tg.explain(f, batch_dim=0)(params, x, y)
    assert report.fallback == ("power",)
    assert report.backend == "structured", report.estimates


@pytest.mark.parametrize(("suite", "name"), [
    ("transformers", "gpt2-checkpointing"), ("recurrent", "lstm-packed"),
])
def test_rows_of_the_batch_where_the_per_sample_way_meets_a_transform_refusal(suite, name):
    """NOTE [refused per-sample passes]: the per-sample fallback runs under ``vmap``, which
    refuses checkpoint regions and packed RNNs. ``auto`` planned that way and tried the graph
    walk first (1.7-2.6 times slower here), and the structured pass found out by a failed
    attempt; both now take the rows of the whole batch from the start, and agree with the
    oracle."""
    from models import recurrent, transformers_models
    from models.case import build, oracle

    builders = {"transformers": transformers_models.BUILDERS,
                "recurrent": recurrent.BUILDERS}[suite]
    case = build(builders, name)
    options = {"batch_dim": 0, "in_dims": case.in_dims}
    expected = oracle(builders, name)[0].gramian
    for backend in ("auto", "structured"):
        report = tg.explain(case.f, backend=backend, run=True, **options)(*case.args,
                                                                          **case.kw_inputs)
        assert report.backend == report.ran.backend == "structured", report.estimates
        assert report.ran.way == "dense", report.ran
        assert any("whose torch.func transforms refuse" in note for note in report.ran.notes)
        G = tg.gramian(case.f, backend=backend, **options)(*case.args, **case.kw_inputs)
        torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-12)


def test_rows_of_the_whole_batch_are_planned_once():
    """NOTE [dense rows planned once]: where samples interact (batch norm in train mode) the
    plan is that of the whole batch's rows, from a tapped forward of the batch. It ran on every
    call, wasted when another backend came first (ResNet-18 in train mode: 8.8 ms under auto,
    6.2 for the jacobian backend it chose); later calls now evaluate f on the whole batch as
    often as the backend that runs does alone, and the model switched to eval mode is planned
    per sample again (the review of session 65: kept whole-batch rows made it 5-60x
    slower)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    fn, params = tg.functionalize(model.double().train())
    evaluations = []

    def f(p, x, y):
        evaluations.append(x.shape[0])
        return F.cross_entropy(fn(p, x), y, reduction="none")

    args = (params, torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,)))
    expected = dense_gramian(f, args).gramian
    ran = tg.explain(f, batch_dim=0, run=True)(*args).ran
    assert ran is not None and any("interact" in note for note in ran.notes), ran

    def second_call(backend):
        gramian = tg.gramian(f, backend=backend, batch_dim=0)
        gramian(*args)
        evaluations.clear()
        G = gramian(*args)
        torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-12)
        return evaluations.count(len(args[2]))  # of the whole batch

    assert second_call("auto") == second_call(ran.backend), ran.backend
    model.eval()
    report = tg.explain(f, batch_dim=0, run=True)(*args)
    assert (report.samples, report.rows_per_sample) == (len(args[2]), 1), report  # per sample
    torch.testing.assert_close(report.gramian, dense_gramian(f, args).gramian, rtol=1e-10,
                               atol=1e-12)
