"""``torchgram.explain``: per-leaf reports of the structured plan and of auto's choice."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchgram as tg
from reference import dense_gramian
from zoo import build


class CrossAttention(nn.Module):
    """Queries from x, keys and values from a projection of x: the packed weight is split."""

    def __init__(self) -> None:
        super().__init__()
        self.memory = nn.Linear(6, 6)
        self.attn = nn.MultiheadAttention(6, 2, batch_first=True)
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        memory = self.memory(x)
        h, _ = self.attn(x, memory, memory, need_weights=False)
        return self.head(h.mean(1)).squeeze(-1)


def test_names_the_fallback_leaves_of_multihead_attention():
    fn, params = tg.functionalize(CrossAttention())
    x = torch.randn(5, 3, 6)
    for batch_dim in (None, 0):
        report = tg.explain(lambda p, x: fn(p, x), batch_dim=batch_dim)(params, x)
        assert "attn.in_proj_weight" in report.fallback
        assert set(report.fallback) == {"attn.in_proj_weight", "attn.in_proj_bias",
                                        "attn.out_proj.weight", "attn.out_proj.bias"}
        leaf = report.by_name("attn.in_proj_weight")
        assert leaf.unrecognised == ("multi_head_attention_forward",)
        assert "attn.in_proj_weight" in str(report)
        assert "multi_head_attention_forward" in str(report)
        assert report.by_name("memory.weight").rules == ("linear",)


def test_self_attention_is_seen_through():
    case = build("attention")  # nn.MultiheadAttention(x, x, x, need_weights=False)
    report = tg.explain(case.f, batch_dim=0)(*case.args)
    assert report.fallback == ()
    assert report.by_name("attn.in_proj_weight").rules == ("linear",)
    assert report.by_name("attn.out_proj.bias").rules == ("linear",)


def test_mlp_report_shows_ghost_layers_and_the_choice():
    model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 10))
    fn, params = tg.functionalize(model)

    def losses(p, x, y):
        return F.cross_entropy(fn(p, x), y, reduction="none")

    args = (params, torch.randn(64, 784), torch.randint(0, 10, (64,)))
    report = tg.explain(losses, batch_dim=0)(*args)
    assert [(leaf.name, leaf.way) for leaf in report.leaves] == [
        ("0.bias", "materialize"), ("0.weight", "ghost"), ("2.bias", "materialize"),
        ("2.weight", "ghost")]
    assert report.backend == report.auto_choice == "structured"
    assert report.samples == 64 and report.rows_per_sample == 1
    assert report.by_name("0.weight").shape == (512, 784)
    text = str(report)
    assert "ghost" in text and "64 samples" in text and "structured" in text
    markdown = report._repr_markdown_()
    assert "| `0.weight` | 512×784 | ghost | linear |" in markdown
    jacobian = tg.explain(losses, batch_dim=0, backend="jacobian")(*args)
    assert jacobian.backend == "jacobian" and "auto would choose 'structured'" in str(jacobian)


def test_tied_weights_list_every_use():
    case = build("tied_lm")
    report = tg.explain(case.f, batch_dim=0)(*case.args)
    assert report.by_name("emb.weight").rules == ("embedding", "linear")
    assert report.fallback == ()


def test_leaf_names_with_several_argnums_and_nested_pytrees():
    case = build("nested_pytree")
    extra = torch.randn(2)

    def f(params, extra, x):
        return case.f(params, x) * extra.sum()

    report = tg.explain(f, argnums=(0, 1))(case.params, extra, *case.inputs)
    assert [leaf.name for leaf in report.leaves] == ["arg0.0.b", "arg0.0.w", "arg0.1.b",
                                                    "arg0.1.w", "arg1"]
    assert report.by_name("arg1").way == "fallback"
    with pytest.raises(KeyError, match="no leaf named 'w'"):
        report.by_name("w")


def test_options_are_checked_like_gramian():
    f = lambda w, x: x @ w  # noqa: E731
    with pytest.raises(TypeError, match=r"torchgram.explain: expected batch_dim to be None or"):
        tg.explain(f, batch_dim="0")
    with pytest.raises(ValueError, match=r"torchgram.explain: expected backend to be one of"):
        tg.explain(f, backend="fast")
    with pytest.raises(TypeError, match=r"torchgram.explain: expected floating-point tensor"):
        tg.explain(f)(torch.ones(3, dtype=torch.int64), torch.randn(2, 3))
    with pytest.raises(ValueError, match=r"torchgram.explain: expected argnums within"):
        tg.explain(f, argnums=2)(torch.randn(3), torch.randn(2, 3))


def test_explaining_leaves_the_inputs_alone():
    w = torch.randn(3, 2, requires_grad=True)
    x = torch.randn(4, 3)
    tg.explain(lambda w, x: torch.tanh(x @ w).sum(-1), batch_dim=0)(w, x)
    assert w.grad is None and w.requires_grad and w.is_leaf


def test_displays_as_a_table_in_notebooks() -> None:
    import torch

    import torchgram as tg

    def f(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.nn.functional.linear(x, p["w"], p["b"])).sum(-1)

    p = {"w": torch.randn(3, 2), "b": torch.randn(3)}
    report = tg.explain(f, batch_dim=0, run=True)(p, torch.randn(4, 2))
    assert repr(report) == str(report)  # not the dataclass dump
    assert "ran: backend" in repr(report)
    html = report._repr_html_()
    assert html.startswith("<div>") and "<table>" in html and "<th" in html
    assert "ran: backend" in html and "'" not in html.split("<table>")[0].replace("&#x27;", "")


def test_a_stale_probe_met_while_planning_is_probed_afresh() -> None:
    """NOTE [stale probes]: a switch makes ``f`` call ``prelu`` where its cached probe saw
    none (a lambda re-made in a loop does the same at a reused signature). ``explain`` plans
    by evaluating ``f`` when its samples interact (the rows of the whole batch), and that
    evaluation's check raised torchgram's internal ``OutputChanged`` to the user (session 47,
    a hand hunt over modules); it now probes afresh, as ``tg.gramian`` does."""
    switch = {"prelu": False}
    p = {"w": torch.randn(3, 4, dtype=torch.float64), "a": torch.rand(3, dtype=torch.float64)}

    def f(p, x):
        h = F.batch_norm(x @ p["w"].T, None, None, training=True)  # planned on the batch's rows
        h = F.prelu(h, p["a"]) if switch["prelu"] else torch.tanh(h) * p["a"]
        return h.pow(2).sum(-1)

    x = torch.randn(5, 4, dtype=torch.float64)
    for run in (False, True):
        switch["prelu"] = False
        tg.explain(f, batch_dim=0, run=run)(p, x)
        switch["prelu"] = True
        report = tg.explain(f, batch_dim=0, run=run)(p, x)
        assert [leaf.name for leaf in report.leaves] == ["a", "w"]
        if run:
            torch.testing.assert_close(report.gramian, dense_gramian(f, (p, x)).shaped(),
                                       rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "per-sample"])
def test_an_f_no_probe_describes_raises_the_public_errors(batch_dim: int | None) -> None:
    """``f`` writes into a captured tensor, or returns another output, only where gradients
    are on, and the probes run without them: planning after the second probe met it again
    and raised torchgram's internal ``OutputChanged``. Now ``tg.gramian``'s errors, nothing
    written (NOTE [writes its probe did not see])."""
    calls = torch.zeros((), dtype=torch.float64)
    w = torch.randn(3, 2, dtype=torch.float64)
    x = torch.randn(6, 3, dtype=torch.float64)

    def writes(w, x):
        if torch.is_grad_enabled():
            calls.add_(1)
        return torch.tanh(x @ w)

    def reshapes(w, x):
        out = torch.tanh(x @ w)
        return out[:, :1] if torch.is_grad_enabled() else out

    with pytest.raises(ValueError, match="functionalize"):
        tg.explain(writes, batch_dim=batch_dim)(w, x)
    assert float(calls) == 0.0
    with pytest.raises(RuntimeError, match="outputs of the same structure") as caught:
        tg.explain(reshapes, batch_dim=batch_dim)(w, x)
    assert type(caught.value) is RuntimeError


def test_a_stale_probe_of_a_random_f_starts_from_the_calls_own_draw() -> None:
    """NOTE [one draw]: a random ``f`` whose cached probe went stale while planning. The
    failed attempt's draws moved the generator on: the fresh plan, and with ``run=True`` the
    Gramian, must still see the draw of one plain call from the caller's state."""
    switch = {"prelu": False}
    p = {"w": torch.randn(3, 4, dtype=torch.float64), "a": torch.rand(3, dtype=torch.float64)}

    def f(p, x):
        h = F.batch_norm(F.dropout(x, 0.3) @ p["w"].T, None, None, training=True)
        h = F.prelu(h, p["a"]) if switch["prelu"] else torch.tanh(h) * p["a"]
        return h.pow(2).sum(-1)

    x = torch.randn(5, 4, dtype=torch.float64)
    tg.explain(f, batch_dim=0, run=True)(p, x)
    switch["prelu"] = True
    torch.manual_seed(3)
    wanted = dense_gramian(f, (p, x)).shaped()
    after_one_call = torch.get_rng_state()
    torch.manual_seed(3)
    report = tg.explain(f, batch_dim=0, run=True)(p, x)
    torch.testing.assert_close(report.gramian, wanted, rtol=1e-10, atol=1e-12)
    assert torch.equal(torch.get_rng_state(), after_one_call)


def test_the_plan_of_a_random_f_after_a_call_is_what_runs() -> None:
    """Without ``batch_dim``, a later call's plan (from the cached trace, ``f`` not evaluated
    yet) did not know that ``f`` draws: it named ``jacobian``, which then refused (session
    58's hunt)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(8, 2)).double().train()
    fn, params = tg.functionalize(model)
    x = torch.randn(4, 5, dtype=torch.float64)

    def rows(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return fn(p, x).sin().sum(1)

    tg.gramian(rows)(params, x)
    plan = tg.explain(rows)(params, x)
    ran = tg.explain(rows, run=True)(params, x)
    assert plan.backend == ran.backend == "structured"
    assert ran.ran.attempts == [], ran.ran.attempts


@pytest.mark.parametrize("source", ["torch", "numpy", "held"])
@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "per-sample"])
def test_planning_leaves_the_generators_where_it_found_them(batch_dim: int | None,
                                                           source: str) -> None:
    """``explain`` without ``run`` evaluates ``f`` (its probe, a trace) but computes nothing:
    the generators ``f`` draws from are left as it found them (the first review of session 61:
    a generator ended neither there nor where one plain call leaves it)."""
    held = np.random.default_rng(3)

    def mask(shape: tuple[int, ...]) -> torch.Tensor:
        if source == "torch":
            return torch.bernoulli(torch.full(shape, 0.5, dtype=torch.float64))
        generator = np.random if source == "numpy" else held
        return torch.from_numpy((generator.random(shape) < 0.5).astype(np.float64))

    def f(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ w)
        return (h * mask(tuple(h.shape))).sum(1)

    w, x = torch.randn(4, 3, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)

    def states() -> tuple[object, ...]:
        return (torch.get_rng_state().tolist(), np.random.get_state()[1].tolist(),
                held.bit_generator.state)

    for _ in range(2):  # a fresh probe, then a cached one
        before = states()
        tg.explain(f, batch_dim=batch_dim)(w, x)
        assert states() == before
