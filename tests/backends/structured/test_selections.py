"""Selections opened for the first derivative check of a trace (NOTE [opened selections])."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import torchgram as tg
from reference import dense_cross_kernel, dense_gramian
from torchgram.backends.structured.selections import check_weights, opened_nodes

DOUBLE = torch.float64
NAN = math.nan


# -- the opened nodes ----------------------------------------------------------------------

def _grads(func: Callable[..., Tensor], extra: tuple[object, ...], kwargs: dict[str, object],
           x: Tensor, cotangent: Tensor, *, opened: bool) -> Tensor:
    leaf = x.clone().requires_grad_()
    out = func(leaf * 1.0, *extra, **kwargs)  # a non-leaf input, as a model's activations are
    with opened_nodes([out.grad_fn] if opened else ()) as count:
        grad = torch.autograd.grad(out, leaf, cotangent)[0]
    assert count == (1 if opened else 0)
    return grad


SELECTIONS = {  # func, its arguments after the input, its keywords
    "relu": (torch.relu, (), {}),
    "relu_": (torch.relu_, (), {}),
    "F.relu(inplace)": (F.relu, (), {"inplace": True}),
    "clamp": (torch.Tensor.clamp, (-0.5, 0.5), {}),
    "clamp_": (torch.Tensor.clamp_, (-0.5, 0.5), {}),
    "clamp_min": (torch.Tensor.clamp_min, (0.0,), {}),
    "where": (lambda h: torch.where(h > 0, h, 0.0), (), {}),
    "masked_fill_": (torch.Tensor.masked_fill_, (torch.tensor([0, 1, 0, 1]).bool(), 0.0), {}),
    "hardtanh(inplace)": (F.hardtanh, (-0.5, 0.5, True), {}),
    "relu6": (F.relu6, (), {}),
    "hardswish": (F.hardswish, (), {}),
    "threshold": (F.threshold, (0.5, 0.0), {}),
    "softshrink": (F.softshrink, (1.0,), {}),
}


@pytest.mark.parametrize("name", list(SELECTIONS))
def test_an_opened_selection_keeps_its_gradient_and_lets_nan_through(name: str) -> None:
    """Finite cotangents: the selection's own gradient, exactly. NaN ones reach every entry
    of the input, closed or open; an infinite cotangent does not become NaN."""
    func, extra, kwargs = SELECTIONS[name]
    x = torch.tensor([2.0, -3.0, 0.25, -0.25], dtype=DOUBLE)
    cotangent = torch.tensor([1.0, 2.0, -3.0, 4.0], dtype=DOUBLE)
    expected = _grads(func, extra, kwargs, x, cotangent, opened=False)
    assert torch.equal(_grads(func, extra, kwargs, x, cotangent, opened=True), expected)
    closed = expected.eq(0)
    assert bool(closed.any())  # the case closes an entry: the test can fail
    nan = torch.full_like(x, NAN)
    assert not bool(_grads(func, extra, kwargs, x, nan, opened=False).isnan().all())
    assert bool(_grads(func, extra, kwargs, x, nan, opened=True).isnan().all())
    infinite = torch.where(closed, math.inf, cotangent)
    assert not bool(_grads(func, extra, kwargs, x, infinite, opened=True).isnan().any())


def test_a_broadcast_branch_gets_its_own_shape_and_dtype() -> None:
    h = torch.randn(3, 2, dtype=DOUBLE, requires_grad=True)
    fill = torch.randn(2, dtype=torch.float32, requires_grad=True)  # promoted in the where
    mask = torch.tensor([[True, False], [False, False], [True, True]])
    out = torch.where(mask, h * 1.0, fill)
    with opened_nodes([out.grad_fn]):
        grad_h, grad_fill = torch.autograd.grad(out, [h, fill],
                                                torch.full((3, 2), NAN, dtype=DOUBLE))
    assert grad_h.shape == (3, 2) and grad_fill.shape == (2,) and grad_fill.dtype == torch.float32
    assert bool(grad_h.isnan().all() and grad_fill.isnan().all())


def test_the_nodes_are_left_without_hooks() -> None:
    """The hooks go when the block ends, also when it raises."""
    h = torch.randn(3, dtype=DOUBLE, requires_grad=True)
    out = torch.relu(h * 1.0)
    with pytest.raises(ZeroDivisionError), opened_nodes([out.grad_fn]):
        raise ZeroDivisionError
    cotangent = torch.tensor([NAN, NAN, NAN], dtype=DOUBLE)
    grad = torch.autograd.grad(out, h, cotangent)[0]
    assert bool((grad.isnan() == (h > 0)).all())  # the closed entries are zero again


def test_the_check_weights_are_finite_under_anomaly_detection() -> None:
    generator = torch.Generator().manual_seed(0)
    assert bool(check_weights(3, DOUBLE, torch.device("cpu"), generator).isnan().all())
    with torch.autograd.set_detect_anomaly(True):
        weights = check_weights(3, DOUBLE, torch.device("cpu"), generator)
    assert bool((weights >= 0.5).all() and (weights < 1.5).all())


# -- couplings that a selection hid on a trace's first call ---------------------------------

B = 6
MIDDLE = torch.tensor([0, 1, 0, 1, 1, 0], dtype=torch.bool)  # the first and the last stay shut


def _gated(kind: str, h: Tensor, gate: Tensor) -> Tensor:
    """A coupling of the samples that ``gate`` (per sample, ``[B]``) opens."""
    centred = h - h.mean(0)
    if kind == "roll":  # each sample reads the one two before it: within even/odd groups
        return h + torch.where(gate[:, None], h.roll(2, 0), 0.0)
    if kind == "where":
        return torch.where(gate[:, None], centred, h)
    if kind == "masked_fill":
        return h + centred.masked_fill(~gate[:, None], 0.0)
    shift = torch.where(gate, 0.0, 100.0)[:, None]  # closes the ReLU / saturates the clamp
    if kind == "relu":
        return h + torch.relu(centred - shift)
    if kind == "relu_inplace":
        return h + F.relu(centred - shift, inplace=True)
    if kind == "clamp":
        return h + (centred - shift).clamp(min=-1.0)
    raise AssertionError(kind)


KINDS = ["where", "masked_fill", "relu", "relu_inplace", "clamp", "roll"]
GATES = [torch.zeros(B, dtype=torch.bool), MIDDLE, torch.ones(B, dtype=torch.bool)]


def _params() -> dict[str, Tensor]:
    torch.manual_seed(1)
    return {"w": torch.randn(3, 4, dtype=DOUBLE), "u": torch.randn(4, 2, dtype=DOUBLE)}


def _model(kind: str) -> Callable[[dict[str, Tensor], Tensor, Tensor], Tensor]:
    def f(p: dict[str, Tensor], x: Tensor, gate: Tensor) -> Tensor:
        h = _gated(kind, torch.tanh(x @ p["w"]), gate)
        return (h @ p["u"]).pow(2).sum(1)
    return f


@pytest.mark.parametrize("backend", ["structured", "auto"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_coupling_a_selection_hid_on_the_first_call_is_seen(backend: str, kind: str) -> None:
    """Shut on the first call (the derivatives were zero through it), opened later for middle
    samples (the first and the last, checked by value on every call, stay shut): 0.01 to 0.65
    off (relative) on structured and auto until session 29."""
    params, f = _params(), _model(kind)
    gramian = tg.gramian(f, backend=backend, batch_dim=0)
    for gate in GATES:
        x = torch.randn(B, 3, dtype=DOUBLE)
        expected = dense_gramian(f, (params, x, gate)).shaped()
        torch.testing.assert_close(gramian(params, x, gate), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", ["structured", "auto"])
def test_a_kernel_sees_a_coupling_a_selection_hid_on_the_first_call(backend: str) -> None:
    """Kernels check the even- and the odd-numbered samples on every call, in the same
    backward as the rows; a coupling within those groups (sample 4 reading sample 2), shut on
    the first call, was missed (the gate is the inputs' last column)."""
    params, model = _params(), _model("roll")

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return model(p, x[:, :3], x[:, 3] > 0.5)[:, None]

    ntk_fn = tg.ntk.empirical_ntk_fn(f, trace_axes=(), backend=backend)
    for gate in [GATES[0], torch.tensor([0, 0, 1, 0, 1, 0], dtype=torch.bool)]:
        x = torch.cat([torch.randn(B, 3, dtype=DOUBLE), gate[:, None].to(DOUBLE)], 1)
        torch.testing.assert_close(ntk_fn(x, None, params),
                                   dense_cross_kernel(f, params, x, None, ()))


def test_selections_of_independent_samples_stay_batched() -> None:
    """ReLUs, clamps and per-sample masks that mix nothing: the opened check passes them and
    the batched way runs (no false alarm), on the first call and after."""
    params = _params()

    def f(p: dict[str, Tensor], x: Tensor, gate: Tensor) -> Tensor:
        h = torch.relu(x @ p["w"])
        h = torch.where(gate[:, None], h.clamp(max=1.0), F.relu(-h, inplace=False))
        return (h.masked_fill(h > 2.0, 0.0) @ p["u"]).pow(2).sum(1)

    for gate in GATES:
        args = (params, torch.randn(B, 3, dtype=DOUBLE), gate)
        report = tg.explain(f, backend="structured", batch_dim=0, run=True)(*args)
        assert report.ran is not None and report.ran.way == "batched", report.ran.notes
        torch.testing.assert_close(report.gramian, dense_gramian(f, args).shaped(),
                                   rtol=1e-10, atol=1e-12)


# -- the routing: node kinds, walked through the opened nodes -------------------------------

def _thorough_checks(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Spy on tg.gramian's derivative checks: one ``True`` per check (each separates every
    pair of samples with the selections opened)."""
    from torchgram.backends.structured import per_sample

    calls: list[bool] = []
    check = per_sample._check_derivatives

    def spy(problem, forward):  # noqa: ANN001, ANN202
        calls.append(True)
        return check(problem, forward)

    monkeypatch.setattr(per_sample, "_check_derivatives", spy)
    return calls


@pytest.mark.parametrize("backend", ["structured", "auto"])
def test_a_coupling_added_by_python_control_flow_after_the_first_call_is_seen(
        backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A closure flag that adds ``h.flip(0)`` (middle samples exchanged, the first and the
    last kept) from the second call: no traced call changes and no index is saved, so the
    trace's check was not run again: 1.53 off (session 28's hunt). The routing now holds the
    graph's node kinds; a new kind means a new thorough check."""
    params, thorough = _params(), _thorough_checks(monkeypatch)
    flag = {"mix": False}

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        h = torch.tanh(x @ p["w"])
        if flag["mix"]:
            mixed = h.clone()
            mixed[1:-1] = h[1:-1].flip(0)
            h = mixed
        return (h @ p["u"]).pow(2).sum(1)

    gramian = tg.gramian(f, backend=backend, batch_dim=0)
    for mix in (False, True, True):
        flag["mix"] = mix
        x = torch.randn(B, 3, dtype=DOUBLE)
        torch.testing.assert_close(gramian(params, x), dense_gramian(f, (params, x)).shaped(),
                                   rtol=1e-10, atol=1e-12)
    assert thorough[:2] == [True, True]


def test_each_routing_is_checked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Code with selections and index routes is checked on its first call only; code
    alternating between two graphs is checked once per graph."""
    params, thorough = _params(), _thorough_checks(monkeypatch)
    flag = {"bias": False}

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        h = torch.relu(x @ p["w"])[torch.arange(x.shape[0])]  # an index route: the identity
        h = torch.where(h > 0.5, h, h.clamp(max=0.1))
        if flag["bias"]:
            h = h + 1.0
        return (h @ p["u"]).pow(2).sum(1)

    gramian = tg.gramian(f, backend="structured", batch_dim=0)
    for bias in (False, False, True, False, True, False):
        flag["bias"] = bias
        x = torch.randn(B, 3, dtype=DOUBLE)
        torch.testing.assert_close(gramian(params, x), dense_gramian(f, (params, x)).shaped(),
                                   rtol=1e-10, atol=1e-12)
    assert thorough == [True, True]


@pytest.mark.parametrize("backend", ["structured", "auto"])
def test_samples_exchanged_by_python_integers_after_the_first_call_are_seen(
        backend: str) -> None:
    """``torch.cat`` of slices whose bounds a switch chooses: samples 1 and 2 exchanged with
    the same nodes and shapes (0.43 off on structured, 0.15 on auto, before session 29); the
    slices' integers count in the routing digest."""
    params = _params()
    swap = {"on": False}

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        h = torch.tanh(x @ p["w"])
        parts = [h[:1], h[2:3], h[1:2], h[3:]] if swap["on"] else [h[:1], h[1:2], h[2:3], h[3:]]
        return (torch.cat(parts) @ p["u"]).pow(2).sum(1)

    gramian = tg.gramian(f, backend=backend, batch_dim=0)
    for on in (False, True):
        swap["on"] = on
        x = torch.randn(B, 3, dtype=DOUBLE)
        torch.testing.assert_close(gramian(params, x), dense_gramian(f, (params, x)).shaped(),
                                   rtol=1e-10, atol=1e-12)
