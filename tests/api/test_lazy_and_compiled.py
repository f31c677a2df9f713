"""Lazy modules and ``torch.compile``'d code around the public calls (session 60's hunt).

Before: a lazy module's first forward inside ``tg.autograd.record()``, or inside an ``f``
that captures it, raised torch's raw "uninitialized parameter"; its uninitialised parameters
passed to ``tg.gramian`` too. ``tg.autograd.*``, ``record()`` and ``tg.ntk`` kernels inside a
``torch.compile``'d function were traced by dynamo (raw errors: ``set_stance``, ``setStorage``,
an unhashable list); a compiled region's backward with donated buffers (``aot_eager``,
dynamic shapes) raised torch's raw error from the eager walk.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 -- torch's own spelling
from torch import Tensor, nn

import torchgram as tg
from reference import dense_gramian

DOUBLE = torch.float64


def _rows_oracle(losses_of: object, params: list[Tensor]) -> Tensor:
    losses = losses_of()  # type: ignore[operator]
    rows = [torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params,
                                                                retain_graph=True)])
            for loss in losses]
    J = torch.stack(rows)
    return J @ J.T


def test_a_lazy_module_first_called_inside_the_recording() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(4), nn.Tanh(), nn.Linear(4, 2)).to(DOUBLE)
    x, y = torch.randn(5, 3, dtype=DOUBLE), torch.tensor([0, 1, 1, 0, 1])
    with tg.autograd.record():
        losses = F.cross_entropy(model(x), y, reduction="none")
    params = list(model.parameters())
    G = tg.autograd.gramian(losses, params, batch_dim=0)
    wanted = _rows_oracle(lambda: F.cross_entropy(model(x), y, reduction="none"), params)
    torch.testing.assert_close(G, wanted, rtol=1e-10, atol=1e-12)


def test_a_lazy_head_that_f_captures_and_lazy_parameters_passed_in() -> None:
    torch.manual_seed(0)
    head = nn.LazyLinear(2).to(DOUBLE)
    w = torch.randn(3, 4, dtype=DOUBLE)
    x = torch.randn(5, 3, dtype=DOUBLE)

    def f(w: Tensor, x: Tensor) -> Tensor:
        return head(torch.tanh(x @ w)).sum(1)

    with pytest.raises(ValueError, match="LazyLinear not called yet"):  # NOTE [lazy modules]
        tg.gramian(f, batch_dim=0)(w, x)
    assert head.has_uninitialized_params()  # left as it was
    f(w, x)  # the plain first call
    G = tg.gramian(f, batch_dim=0)(w, x)
    torch.testing.assert_close(G, dense_gramian(f, (w, x)).gramian, rtol=1e-10, atol=1e-12)
    lazy = nn.LazyLinear(2)
    with pytest.raises(ValueError, match="LazyLinear not called yet|parameter of a lazy"):
        tg.gramian(lambda p, x: torch.func.functional_call(lazy, p, (x,)).sum(1),
                   batch_dim=0)(dict(lazy.named_parameters()), x.float())


def test_the_public_calls_inside_a_compiled_function() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DOUBLE)
    params = list(model.parameters())
    x, y = torch.randn(5, 3, dtype=DOUBLE), torch.tensor([0, 1, 1, 0, 1])

    def losses_of() -> Tensor:
        return F.cross_entropy(model(x), y, reduction="none")

    wanted = _rows_oracle(losses_of, params)

    def eager_step(x: Tensor) -> Tensor:
        with tg.autograd.record():
            losses = F.cross_entropy(model(x), y, reduction="none")
        return tg.autograd.gramian(losses, params, batch_dim=0)

    torch.compiler.reset()
    torch.testing.assert_close(torch.compile(eager_step, backend="eager")(x), wanted,
                               rtol=1e-10, atol=1e-12)
    fn, named = tg.functionalize(model)
    kernel_fn = tg.ntk.empirical_ntk_fn(fn, trace_axes=())
    kernel = torch.compile(lambda x: kernel_fn(x, None, named), backend="eager")(x)
    torch.testing.assert_close(kernel, kernel_fn(x, None, named), rtol=1e-10, atol=1e-12)
    torch.compiler.reset()


@pytest.mark.parametrize("backend", ["auto", "structured", "graph", "jacobian", "ntvp"])
def test_the_transforms_themselves_compiled(backend: str) -> None:
    # Session 63's hunt: torch.compile(tg.gramian(f)) traced the probe cache (torch's raw
    # "unhashable type: 'list'"), on every backend; tg.aggregated_grad's too.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).to(DOUBLE)
    fn, params = tg.functionalize(model)
    x = torch.randn(5, 3, dtype=DOUBLE)

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return fn(p, x).squeeze(-1)

    torch.compiler.reset()
    gramian = torch.compile(tg.gramian(f, batch_dim=0, backend=backend), backend="eager")
    torch.testing.assert_close(gramian(params, x), dense_gramian(f, (params, x)).gramian,
                               rtol=1e-10, atol=1e-12)
    aggregated = torch.compile(tg.aggregated_grad(f, tg.weighting.mean, backend=backend),
                               backend="eager")
    update, _ = aggregated(params, x)
    wanted, _ = tg.aggregated_grad(f, tg.weighting.mean, backend=backend)(params, x)
    for key in params:
        torch.testing.assert_close(update[key], wanted[key], rtol=1e-10, atol=1e-12)
    torch.compiler.reset()


def test_the_transform_of_a_compiled_f_inside_compiled_code() -> None:
    # Session 63's review: functools.wraps copied the compiled f's _torchdynamo_orig_callable
    # onto the transform, and dynamo inlined f instead: the step returned f's output, not G.
    torch.manual_seed(0)
    w, x = torch.randn(3, 5, dtype=DOUBLE), torch.randn(4, 5, dtype=DOUBLE)

    def f(w: Tensor, x: Tensor) -> Tensor:
        return torch.tanh(x @ w.T).sum(-1)

    torch.compiler.reset()
    compiled_f = torch.compile(f, backend="eager")
    wanted = dense_gramian(f, (w, x)).gramian
    step = torch.compile(lambda w, x: tg.gramian(compiled_f)(w, x), backend="eager")
    torch.testing.assert_close(step(w, x), wanted, rtol=1e-10, atol=1e-12)
    transform = torch.compile(tg.gramian(compiled_f, batch_dim=0), backend="eager")
    torch.testing.assert_close(transform(w, x), wanted, rtol=1e-10, atol=1e-12)
    update, _ = torch.compile(lambda w, x: tg.aggregated_grad(compiled_f, tg.weighting.mean)(
        w, x), backend="eager")(w, x)
    assert update.shape == w.shape
    independence = torch.compile(tg.check_independence(compiled_f, batch_dim=0),
                                 backend="eager")(w, x)
    assert independence.independent
    torch.compiler.reset()


def test_a_compiled_backward_with_donated_buffers_is_a_clear_error() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    torch.compiler.reset()
    compiled = torch.compile(model, backend="aot_eager", dynamic=True)
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    losses = F.cross_entropy(compiled(x), y, reduction="none")
    try:
        G = tg.autograd.gramian(losses, list(model.parameters()), batch_dim=0)
    except RuntimeError as error:
        assert "torchgram.autograd.gramian: expected a graph whose backward can run more " \
            "than once" in str(error) and "donated_buffer" in str(error)
    else:  # a torch that donates nothing here: the right matrix
        wanted = _rows_oracle(lambda: F.cross_entropy(model(x), y, reduction="none"),
                              list(model.parameters()))
        torch.testing.assert_close(G, wanted, rtol=1e-5, atol=1e-6)
    torch.compiler.reset()


def test_a_lazy_batch_norm_reached_by_f_is_refused_and_left_alone() -> None:
    """Its initialisation's writes met the write guards inside torchgram's evaluation: a
    refusal that left ``weight`` as ``torch.empty``'s garbage, or under another model's cached
    probe a G 0.65-1.0 off (the review of session 60)."""
    torch.manual_seed(0)
    norm: nn.Module = nn.BatchNorm1d(4).to(DOUBLE).eval()
    w, x = torch.randn(3, 4, dtype=DOUBLE), torch.randn(6, 3, dtype=DOUBLE)

    def f(w: Tensor, x: Tensor) -> Tensor:
        return norm(torch.tanh(x @ w)).sum(1)

    tg.gramian(f, batch_dim=0)(w, x)  # a probe of this signature, cached
    norm = nn.LazyBatchNorm1d().to(DOUBLE).eval()
    for backend in ("auto", "structured", "graph", "jacobian", "ntvp"):
        with pytest.raises(ValueError, match="LazyBatchNorm1d not called yet"):
            tg.gramian(f, backend=backend, batch_dim=0)(w, x)
    assert norm.has_uninitialized_params()
    norm(torch.tanh(x @ w))  # the plain first call
    torch.testing.assert_close(tg.gramian(f, batch_dim=0)(w, x), dense_gramian(f, (w, x)).gramian,
                               rtol=1e-10, atol=1e-12)
    assert torch.equal(norm.weight, torch.ones(4, dtype=DOUBLE))


def test_a_lazy_model_passed_as_an_argument_is_refused() -> None:
    """Passed to ``f`` rather than captured (the review of session 60: under a cached probe
    G 0.92-1.0 off, the norm's weights left as garbage)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.LazyBatchNorm1d()).to(DOUBLE).eval()
    x = torch.randn(6, 3, dtype=DOUBLE)
    params = {name: p for name, p in model.named_parameters() if name.startswith("0.")}

    def f(p: dict[str, Tensor], net: nn.Module, x: Tensor) -> Tensor:
        return torch.func.functional_call(net, p, (x,), strict=False).sum(1)

    with pytest.raises(ValueError, match="LazyBatchNorm1d not called yet"):
        tg.gramian(f, batch_dim=0, in_dims=(None, 0))(params, model, x)
    assert model[2].has_uninitialized_params()
