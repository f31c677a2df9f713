"""Attributes ``f`` rebinds on its modules are put back after each evaluation.

NOTE [attributes f rebinds] (``_core/module_state.py``): before session 62, a module whose
``forward`` kept state by rebinding an attribute (a moving-average scale, a step counter, a
replaced buffer) made every backend return a Gramian that matched no single call (0.45 to 1.6
off, relative), jacobian and ntvp fail torch's internal assert, and the module keep the state
moved by several evaluations.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import torchgram as tg
from reference import dense_cross_kernel, dense_gramian
from torchgram._core.module_state import ModuleAttributes

DOUBLE = torch.float64
BACKENDS = ["auto", "structured", "graph", "jacobian", "ntvp"]


class MovingScale(nn.Module):
    """Divides by a moving average of its outputs' size, kept as a plain attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.scale = torch.tensor(1.0)

    def forward(self, x: Tensor) -> Tensor:
        y = self.linear(x)
        self.scale = 0.5 * self.scale + 0.5 * y.detach().abs().mean()
        return y / self.scale


class MovingBuffer(nn.Module):
    """The same with a registered buffer, replaced by a new tensor on each call."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x: Tensor) -> Tensor:
        y = self.linear(x)
        self.scale = 0.5 * self.scale + 0.5 * y.detach().abs().mean(0)
        return y / self.scale


class Steps(nn.Module):
    """Counts its calls in a Python int, which scales its output."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.step = 0

    def forward(self, x: Tensor) -> Tensor:
        self.step += 1
        return torch.tanh(self.linear(x)) * (1.0 + self.step)


class KeepsLast(nn.Module):
    """Keeps its last output and a cache made on its first call (neither changes the math)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        if "two" not in vars(self):
            self.two = torch.tensor(2.0, dtype=x.dtype)
        self.last = torch.tanh(self.linear(x)) * self.two
        return self.last


class Outer(nn.Module):
    """A stateful layer inside a container, behind a plain one."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(torch.sin(self.first(x)))


MODULES: dict[str, Callable[[], nn.Module]] = {
    "moving_scale": MovingScale,
    "moving_buffer": MovingBuffer,
    "steps": Steps,
    "keeps_last": KeepsLast,
    "nested_moving_scale": lambda: Outer(MovingScale()),
}


def _state(module: nn.Module) -> list[tuple[str, list[tuple[str, int]]]]:
    """Every submodule's entries and buffers, by identity (what a call must leave)."""
    return [(name, [(key, id(value)) for key, value in [*vars(sub).items(),
                                                         *sub._buffers.items()]])
            for name, sub in module.named_modules()]


def _setup(name: str, *, through: str = "closure"
           ) -> tuple[Callable[..., Tensor], nn.Module, dict[str, Tensor], Tensor]:
    torch.manual_seed(0)
    module = MODULES[name]().to(DOUBLE)
    params = {key: value.detach() for key, value in module.named_parameters()}
    x = torch.randn(5, 4, dtype=DOUBLE)
    if through == "argument":
        def f_of_module(p: dict[str, Tensor], x: Tensor, model: nn.Module) -> Tensor:
            return torch.func.functional_call(model, p, (x,)).sin().sum(-1)

        return f_of_module, module, params, x

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return torch.func.functional_call(module, p, (x,)).sin().sum(-1)

    return f, module, params, x


@contextlib.contextmanager
def _as_it_was(module: nn.Module) -> Iterator[None]:
    """Around plain calls of the oracle: every submodule's entries put back after them."""
    kept = [(entries, dict(entries)) for sub in module.modules()
            for entries in (vars(sub), sub._buffers)]
    yield
    for entries, before in kept:
        entries.clear()
        entries.update(before)


def _oracle(f: Callable[..., Tensor], module: nn.Module, args: tuple[Any, ...]) -> Tensor:
    """The Gramian of one plain call from the module's state now (left as it was)."""
    with _as_it_was(module):
        return dense_gramian(f, args).gramian


def _assert_close(got: Tensor, wanted: Tensor) -> None:
    error = (got - wanted).abs().max() / wanted.abs().max()
    assert error < 1e-10, f"relative error {error:.3g}"


@pytest.mark.parametrize("through", ["closure", "argument"])
@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "batch_dim0"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(MODULES))
def test_every_evaluation_starts_from_the_calls_state(name: str, backend: str,
                                                      batch_dim: int | None,
                                                      through: str) -> None:
    f, module, params, x = _setup(name, through=through)
    args = (params, x, module) if through == "argument" else (params, x)
    wanted = _oracle(f, module, args)
    before = _state(module)
    for _ in range(2):  # the second call of the signature takes the cached probe
        got = tg.gramian(f, backend=backend, batch_dim=batch_dim)(*args)
        _assert_close(got, wanted)
        assert _state(module) == before  # left as found, nothing of torchgram's on it


@pytest.mark.parametrize("name", ["moving_scale", "steps"])
def test_updates_kernels_and_explanations_see_the_calls_state(name: str) -> None:
    f, module, params, x = _setup(name)
    before = _state(module)
    weights = torch.tensor([0.5, 1.0, 2.0, 0.0, 1.0], dtype=DOUBLE)
    wanted_gramian = _oracle(f, module, (params, x))

    def weighting(G: Tensor) -> Tensor:
        _assert_close(G, wanted_gramian)
        return weights

    update, _ = tg.aggregated_grad(f, weighting, batch_dim=0)(params, x)
    with _as_it_was(module):
        _, vjp = torch.func.vjp(lambda p: f(p, x), params)
        wanted = vjp(weights)[0]
    for key in params:
        torch.testing.assert_close(update[key], wanted[key], rtol=1e-10, atol=1e-12)
    assert _state(module) == before

    x2 = torch.randn(3, 4, dtype=DOUBLE)

    def g(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return torch.func.functional_call(module, p, (x,)).sin().sum(-1, keepdim=True)

    def g_from_the_start(p: dict[str, Tensor], x: Tensor) -> Tensor:
        with _as_it_was(module):  # x1's and x2's rows from one state, as the kernel's
            return g(p, x)

    wanted_kernel = dense_cross_kernel(g_from_the_start, params, x, x2, trace_axes=(-1,))
    _assert_close(tg.ntk.empirical_ntk_fn(g)(x, x2, params), wanted_kernel)
    assert _state(module) == before

    explained = tg.explain(f, batch_dim=0, run=True)(params, x)
    assert explained.ran is not None
    assert _state(module) == before


def test_functionalize_fn_puts_back_what_the_forward_rebinds() -> None:
    torch.manual_seed(0)
    module = MovingScale().to(DOUBLE)
    fn, params = tg.functionalize(module)
    x = torch.randn(5, 4, dtype=DOUBLE)

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return fn(p, x).sin().sum(-1)

    wanted = _oracle(f, module, (params, x))
    before = _state(module)
    _assert_close(tg.gramian(f, batch_dim=0)(params, x), wanted)
    assert _state(module) == before


@pytest.mark.parametrize("made_by", ["functional_call", "functionalize"])
def test_a_recurrent_layers_flat_weights_stay_its_parameters(made_by: str) -> None:
    # functionalize writes the parameters into the module's dicts, functional_call sets them:
    # nn.RNNBase sees either through its weak references to them, put back with its list
    torch.manual_seed(0)
    lstm = nn.LSTM(3, 4, batch_first=True).to(DOUBLE)
    x = torch.randn(2, 5, 3, dtype=DOUBLE)
    if made_by == "functionalize":
        fn, params = tg.functionalize(lstm)
    else:
        fn = functools.partial(torch.func.functional_call, lstm)
        params = {key: value.detach() for key, value in lstm.named_parameters()}

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return fn(p, (x,) if made_by == "functional_call" else x)[0].sum((1, 2))

    wanted = dense_gramian(f, (params, x)).gramian
    plain = lstm(x)[0]
    for backend in BACKENDS:
        _assert_close(tg.gramian(f, backend=backend, batch_dim=0)(params, x), wanted)
        again = lstm(x)[0]  # a plain call still runs with the module's parameters
        assert torch.equal(again, plain)
        again.sum().backward()
        assert all(parameter.grad is not None for parameter in lstm.parameters()), backend
        lstm.zero_grad(set_to_none=True)


def test_put_back_restores_rebinds_additions_and_deletions() -> None:
    layer = nn.Linear(2, 2)
    layer.keep = "kept"
    layer.gone = [1]
    gone, weight = layer.gone, layer.weight
    attributes = ModuleAttributes.capture([layer])
    layer.keep = "rebound"
    layer.added = torch.ones(1)
    del layer.gone
    layer.register_buffer("extra", torch.zeros(1))
    attributes.put_back()
    assert layer.keep == "kept" and layer.gone is gone and layer.weight is weight
    assert not hasattr(layer, "added") and "extra" not in layer._buffers


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # x needs no grad
@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "batch_dim0"])
@pytest.mark.parametrize("backend", ["auto", "structured"])
def test_a_backward_hook_reads_what_its_forward_hook_kept(backend: str,
                                                          batch_dim: int | None) -> None:
    # The put-back comes before the next evaluation, not right after one: torchgram's backward
    # of an evaluation runs the module's hooks (opacus keeps activations this way).
    torch.manual_seed(0)
    layer = nn.Linear(4, 3).to(DOUBLE)
    read = []

    def keep(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        module.saved = inputs[0].detach()

    def use(module: nn.Module, grad_inputs: Any, grad_outputs: Any) -> None:
        read.append(module.saved.shape)

    layer.register_forward_hook(keep)
    layer.register_full_backward_hook(use)
    params = {key: value.detach() for key, value in layer.named_parameters()}
    x = torch.randn(5, 4, dtype=DOUBLE)

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return torch.func.functional_call(layer, p, (x,)).sin().sum(-1)

    wanted = _oracle(f, layer, (params, x))
    before = _state(layer)
    _assert_close(tg.gramian(f, backend=backend, batch_dim=batch_dim)(params, x), wanted)
    assert read and _state(layer) == before
