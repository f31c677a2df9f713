"""Every public entry point called inside ``torch.inference_mode()`` (NOTE [inference mode]).

Autograd records nothing in that mode and ``enable_grad`` does not turn it back on. Before
session 40, ``tg.gramian`` called there returned a zero matrix without a word on ``auto``,
``structured`` and ``graph`` once its signature had a cached probe (a first call outside the
mode), and torch's raw "Inference tensors do not track version counter" on every backend
otherwise; the eager APIs raised raw errors. Each case is compared with the dense float64
oracle computed outside the mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 -- torch's own spelling
from torch import Tensor, nn

import torchgram as tg
from reference import dense_cross_kernel, dense_gramian
from torchgram._core.signature import clear_caches

DOUBLE = torch.float64
BACKENDS = ["auto", "structured", "graph", "jacobian", "ntvp"]
WHERE = ["made-outside", "made-inside", "called-outside-first"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3)).to(DOUBLE)


def _setup() -> tuple[nn.Module, Callable[..., Tensor], dict[str, Tensor], Tensor, Tensor]:
    module = _model()
    fn, params = tg.functionalize(module)
    x = torch.randn(5, 4, dtype=DOUBLE)
    y = torch.randint(0, 3, (5,))
    return module, lambda p, x, y: F.cross_entropy(fn(p, x), y, reduction="none"), params, x, y


def _inside(where: str, call: Callable[[Tensor], Any], x: Tensor) -> Any:
    """``call(x)`` inside the mode, ``x`` made inside or not, after a call outside or not."""
    if where == "called-outside-first":
        call(x)
    with torch.inference_mode():
        inputs = x.clone() if where == "made-inside" else x
        return call(inputs)


def _close(actual: Tensor, wanted: Tensor) -> None:
    assert not actual.is_inference()
    torch.testing.assert_close(actual, wanted, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gramian(backend: str, where: str) -> None:
    clear_caches()
    _, f, params, x, y = _setup()
    wanted = dense_gramian(f, (params, x, y)).shaped()
    gramian = tg.gramian(f, batch_dim=0, backend=backend)
    _close(_inside(where, lambda inputs: gramian(params, inputs, y), x), wanted)


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("backend", BACKENDS)
def test_aggregated_grad(backend: str, where: str) -> None:
    clear_caches()
    _, f, params, x, y = _setup()
    weights = tg.weighting.upgrad(dense_gramian(f, (params, x, y)).shaped())
    wanted = torch.func.vjp(lambda p: f(p, x, y), params)[1](weights)[0]
    step = tg.aggregated_grad(f, tg.weighting.upgrad, batch_dim=0, backend=backend)
    update, info = _inside(where, lambda inputs: step(params, inputs, y), x)
    for name in wanted:
        _close(update[name], wanted[name])
    _close(info.weights, weights)


@pytest.mark.parametrize("where", WHERE)
def test_explain_and_independence(where: str) -> None:
    clear_caches()
    _, f, params, x, y = _setup()
    explanation = _inside(where, lambda inputs: tg.explain(f, batch_dim=0, run=True)(
        params, inputs, y), x)
    assert explanation.ran.way == "batched"
    report = _inside(where, lambda inputs: tg.check_independence(f, batch_dim=0)(
        params, inputs, y), x)
    assert report.independent


@pytest.mark.parametrize("where", WHERE)
def test_kernel(where: str) -> None:
    clear_caches()
    module = _model()
    fn, params = tg.functionalize(module)
    x = torch.randn(5, 4, dtype=DOUBLE)
    wanted = dense_gramian(fn, (params, x)).shaped().permute(0, 2, 1, 3)  # NT's layout
    kernel = tg.ntk.empirical_ntk_fn(fn, trace_axes=())
    _close(_inside(where, lambda inputs: kernel(inputs, None, params), x), wanted)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_kernel_of_parameters_made_inside(backend: str) -> None:
    """Parameters made in the mode (a model loaded there): both sides of a cross kernel
    share one clone of them. The graph walk declined before ("other arguments than their
    batched inputs": each side had cloned its own), where the other backends answered."""
    clear_caches()
    fn, params = tg.functionalize(_model())
    x1, x2 = torch.randn(5, 4, dtype=DOUBLE), torch.randn(3, 4, dtype=DOUBLE)
    wanted = dense_cross_kernel(fn, params, x1, x2)
    with torch.inference_mode():
        inside = {name: value.clone() for name, value in params.items()}
    kernel = tg.ntk.empirical_ntk_fn(fn, trace_axes=(), backend=backend)
    _close(kernel(x1, x2, inside), wanted)


@pytest.mark.parametrize("recorded", [False, True], ids=["walked", "recorded"])
def test_eager_calls_on_outputs_computed_outside(recorded: bool) -> None:
    """The graph was recorded outside the mode; the Gramian and the step are asked inside."""
    clear_caches()
    module, f, params, x, y = _setup()
    gramian = dense_gramian(f, (params, x, y)).shaped()
    weights = tg.weighting.upgrad(gramian)
    inputs = list(module.parameters())

    def losses() -> Tensor:
        if not recorded:
            return F.cross_entropy(module(x), y, reduction="none")
        with tg.autograd.record():
            return F.cross_entropy(module(x), y, reduction="none")

    rows = losses()
    with torch.inference_mode():
        _close(tg.autograd.gramian(rows, inputs, batch_dim=0), gramian)
        assert tg.autograd.explain(rows, inputs, batch_dim=0) is not None
    wanted = torch.autograd.grad(losses(), inputs, weights)
    rows = losses()
    with torch.inference_mode():
        tg.autograd.backward(rows, inputs, tg.weighting.upgrad, batch_dim=0)
    for param, grad in zip(inputs, wanted, strict=True):
        assert param.grad is not None
        _close(param.grad, grad)


def test_eager_outputs_computed_inside_are_refused_by_name() -> None:
    module, _, _, x, y = _setup()
    with torch.inference_mode(), tg.autograd.record():
        rows = F.cross_entropy(module(x), y, reduction="none")
    with pytest.raises(ValueError, match="inference_mode"):
        tg.autograd.gramian(rows, list(module.parameters()), batch_dim=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_parameters_that_require_grad_give_results_without_a_graph(backend: str) -> None:
    # Session 63's hunt: G came back with a grad_fn there (the create-graph path, paid for),
    # where the mode's own ops make tensors that do not require grad.
    _, f, params, x, y = _setup()
    leaves = {key: value.detach().requires_grad_() for key, value in params.items()}
    wanted = dense_gramian(f, (params, x, y)).gramian
    with torch.inference_mode():
        gramian = tg.gramian(f, backend=backend, batch_dim=0)(leaves, x, y)
        update, _ = tg.aggregated_grad(f, tg.weighting.mean, backend=backend)(leaves, x, y)
    assert not gramian.requires_grad and gramian.grad_fn is None
    assert not any(value.requires_grad for value in update.values())
    torch.testing.assert_close(gramian, wanted, rtol=1e-10, atol=1e-12)
