"""A backward that accumulates into ``.grad`` itself, outside the graph, is refused.

NOTE [gradients outside the graph] (``_core/side_gradients.py``): before session 62, a custom
``autograd.Function`` whose backward recomputes its layer and calls ``torch.autograd.backward``
(``transformers``' Reformer) gave zero blocks for that layer's parameters (0.60 off on this
MLP, 0.32 on Reformer) and wrote their ``.grad``, on auto, structured, graph and the eager API.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import torchgram as tg
from reference import dense_gramian

DOUBLE = torch.float64
REFUSAL = (r"expected a backward whose derivatives all go through the autograd graph, but got "
           r"a backward that accumulated into the .grad of 2 parameter\(s\) itself \(shapes "
           r"\(6,?\)?.*\)\. .*Reformer")


class Reversible(torch.autograd.Function):
    """Runs ``layer`` without a graph; its backward recomputes it and backpropagates itself."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, layer: nn.Module) -> Tensor:
        ctx.layer = layer
        ctx.save_for_backward(x)
        with torch.no_grad():
            return layer(x)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, None]:
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            torch.autograd.backward(ctx.layer(x), grad_output)  # into the layer's .grad
        return x.grad, None


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 6)
        self.second = nn.Linear(6, 6)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(Reversible.apply(torch.tanh(self.first(x)), self.second)).pow(2).sum(1)


def _model(trained: bool = False) -> tuple[Model, Tensor]:
    """The model, and its input; ``trained``: with ``.grad`` from a plain backward."""
    torch.manual_seed(0)
    model, x = Model().to(DOUBLE), torch.randn(5, 4, dtype=DOUBLE)
    if trained:
        model(x).sum().backward()
    return model, x


def _grads(model: nn.Module) -> list[tuple[Tensor | None, Tensor | None]]:
    return [(parameter.grad, None if parameter.grad is None else parameter.grad.clone())
            for parameter in model.parameters()]


def _assert_grads_left_alone(model: nn.Module,
                             before: list[tuple[Tensor | None, Tensor | None]]) -> None:
    # Session 63: a refused call left what torchgram's passes fed that backward in .grad
    # (Reformer: NaN, which the next plain backward added to).
    assert not any(parameter._post_accumulate_grad_hooks for parameter in model.parameters())
    for parameter, (grad, values) in zip(model.parameters(), before, strict=True):
        assert parameter.grad is grad
        assert values is None or torch.equal(parameter.grad, values)


TRAINED = pytest.mark.parametrize("trained", [False, True], ids=["no_grad", "with_grad"])


@pytest.mark.parametrize("copied", [False, True], ids=["detached", "cloned"])
@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "batch_dim0"])
@pytest.mark.parametrize("backend", ["auto", "structured", "graph"])
@TRAINED
def test_the_functional_api_refuses(backend: str, batch_dim: int | None, copied: bool,
                                    trained: bool) -> None:
    model, x = _model(trained)
    before = _grads(model)
    params = {key: value.detach().clone() if copied else value.detach()
              for key, value in model.named_parameters()}

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return torch.func.functional_call(model, p, (x,))

    with pytest.raises(NotImplementedError, match=r"^torchgram.gramian: " + REFUSAL):
        tg.gramian(f, backend=backend, batch_dim=batch_dim)(params, x)
    _assert_grads_left_alone(model, before)


@pytest.mark.parametrize("recorded", [False, True], ids=["walked", "recorded"])
@TRAINED
def test_the_eager_api_refuses(recorded: bool, trained: bool) -> None:
    model, x = _model(trained)
    with tg.autograd.record() if recorded else contextlib.nullcontext():
        losses = model(x)
    before = _grads(model)
    with pytest.raises(NotImplementedError, match=r"^torchgram.autograd.gramian: " + REFUSAL):
        tg.autograd.gramian(losses, list(model.parameters()), batch_dim=0)
    _assert_grads_left_alone(model, before)


def test_gradients_already_there_are_not_a_refusal() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).to(DOUBLE)
    x = torch.randn(5, 4, dtype=DOUBLE)
    model(x).sum().backward()
    grads = [(parameter.grad, parameter.grad.clone()) for parameter in model.parameters()]
    params = {key: value.detach() for key, value in model.named_parameters()}
    tg.gramian(lambda p, x: torch.func.functional_call(model, p, (x,)).sum(1),
               batch_dim=0)(params, x)
    tg.autograd.gramian(model(x).sum(1), list(model.parameters()), batch_dim=0)
    for parameter, (grad, values) in zip(model.parameters(), grads, strict=True):
        assert parameter.grad is grad and torch.equal(grad, values)


def test_another_threads_backward_is_not_a_refusal_and_keeps_its_grad() -> None:
    # A review of the first version (which compared .grad before and after): refused, and the
    # other thread's gradient put back to None.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(DOUBLE)
    x, x_other = torch.randn(5, 4, dtype=DOUBLE), torch.randn(2, 4, dtype=DOUBLE)
    started, finished = threading.Event(), threading.Event()

    class Pause(torch.autograd.Function):  # the call's backward waits for the other thread
        @staticmethod
        def forward(ctx: Any, t: Tensor) -> Tensor:
            return t.clone()

        @staticmethod
        def backward(ctx: Any, grad: Tensor) -> Tensor:
            if not started.is_set():
                started.set()
                finished.wait(10)
            return grad

    def other() -> None:
        started.wait(10)
        model(x_other).pow(2).sum().backward()
        finished.set()

    thread = threading.Thread(target=other)
    thread.start()
    losses = Pause.apply(model(x)).pow(2).sum(1)
    gramian = tg.autograd.gramian(losses, list(model.parameters()), batch_dim=0)
    thread.join()
    assert gramian.isfinite().all()
    wanted = torch.autograd.grad(model(x_other).pow(2).sum(), list(model.parameters()))
    for parameter, grad in zip(model.parameters(), wanted, strict=True):
        torch.testing.assert_close(parameter.grad, grad)


def test_a_backward_in_fs_own_forward_is_fs_business() -> None:
    torch.manual_seed(0)
    teacher = nn.Linear(4, 3).to(DOUBLE)
    student = nn.Linear(4, 3).to(DOUBLE)
    x = torch.randn(5, 4, dtype=DOUBLE)

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        teacher(x).pow(2).sum().backward()  # a frozen teacher's own step, say
        return torch.func.functional_call(student, p, (x,)).tanh().sum(1)

    params = {key: value.detach() for key, value in student.named_parameters()}
    wanted = dense_gramian(f, (params, x)).gramian
    for backend in ["auto", "graph"]:  # structured refuses an f that differentiates itself
        got = tg.gramian(f, backend=backend, batch_dim=0)(params, x)
        torch.testing.assert_close(got, wanted, rtol=1e-10, atol=1e-12)


def test_a_non_leaf_input_is_not_watched_and_warns_nothing() -> None:
    torch.manual_seed(0)
    weight = torch.randn(4, 3, dtype=DOUBLE, requires_grad=True)
    scaled = weight * 2  # a non-leaf input: reading its .grad would warn
    losses = torch.tanh(torch.randn(5, 4, dtype=DOUBLE) @ scaled).sum(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tg.autograd.gramian(losses, [scaled], batch_dim=0)
        tg.autograd.backward(losses, [scaled], tg.weighting.mean, batch_dim=0)


def test_a_grad_that_requires_grad_is_put_back_with_the_refusal() -> None:
    # Session 63's review: putting back its values met torch's raw "a leaf Variable that
    # requires grad is being used in an in-place operation", and the refusal was lost.
    model, x = _model()
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter).requires_grad_()
    before = _grads(model)
    with pytest.raises(NotImplementedError, match=r"^torchgram.autograd.gramian: " + REFUSAL):
        tg.autograd.gramian(model(x), list(model.parameters()), batch_dim=0)
    _assert_grads_left_alone(model, before)
