"""An ``f`` that differentiates its own computation, on every API, against the dense oracle.

NOTE [f that differentiates itself] (``census.py``): the residuals of physics-informed
networks, input-gradient penalties, ``torch.func.grad`` or ``jvp`` inside ``f``. The
structured backend's taps cannot see what such a pass computes with the weights: it
declines, naming the graph walk, and ``auto`` takes that (session 36's review: structured
and ``auto`` were 0.01-0.73 off, relative, without an error). Every other backend matches
the oracle or declines (a ``BackendCannotRun``): never a wrong matrix, never torch's raw
error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import optree
import pytest
import torch
from torch import Tensor

import torchgram as tg
from reference import dense_cross_kernel, dense_gramian
from torchgram._core import _torch_compat
from torchgram._core.census import OpCensus

pytestmark = pytest.mark.filterwarnings(  # torch's, for backward(create_graph=True) in f
    "ignore:Using backward\\(\\) with create_graph=True:UserWarning")

DOUBLE = torch.float64
D, H, K, B = 3, 8, 2, 5


def _params() -> dict[str, Tensor]:
    torch.manual_seed(0)
    return {"w1": torch.randn(H, D, dtype=DOUBLE), "b1": torch.randn(H, dtype=DOUBLE),
            "w2": torch.randn(K, H, dtype=DOUBLE)}


def _net(p: dict[str, Tensor], x: Tensor) -> Tensor:
    return torch.tanh(x @ p["w1"].T + p["b1"]) @ p["w2"].T


def _fresh_input(x: Tensor) -> Tensor:
    return x.detach().requires_grad_()


def input_gradient(p: dict[str, Tensor], x: Tensor) -> Tensor:
    """A physics-informed residual: ``|∂u/∂x|² + u``, through ``torch.autograd.grad``."""
    with torch.enable_grad():
        xr = _fresh_input(x)
        out = _net(p, xr)
        (gx,) = torch.autograd.grad(out.sum(), xr, create_graph=True)
    return gx.pow(2).sum(-1) + out.sum(-1)


def functional_jacobian(p: dict[str, Tensor], x: Tensor) -> Tensor:
    """``torch.autograd.functional.jacobian(..., create_graph=True)`` inside ``f``."""
    with torch.enable_grad():
        xr = _fresh_input(x)
        jac = torch.autograd.functional.jacobian(lambda xi: _net(p, xi).sum(0), xr,
                                                 create_graph=True)
    return jac.pow(2).sum((0, 2))


def func_grad(p: dict[str, Tensor], x: Tensor) -> Tensor:
    """``torch.func.grad`` of the network in its input, per sample."""
    grads = torch.func.vmap(torch.func.grad(lambda xi: _net(p, xi).sum()))(x)
    return grads.pow(2).sum(-1)


def func_jvp(p: dict[str, Tensor], x: Tensor) -> Tensor:
    """A directional derivative in the input, by forward-mode AD."""
    _, tangent = torch.func.jvp(lambda xi: _net(p, xi), (x,), (torch.ones_like(x),))
    return tangent.pow(2).sum(-1)


def backward_with_inputs(p: dict[str, Tensor], x: Tensor) -> Tensor:
    """``torch.autograd.backward(..., inputs=, create_graph=True)``, then the input's ``.grad``."""
    with torch.enable_grad():
        xr = _fresh_input(x)
        out = _net(p, xr)
        torch.autograd.backward(out.sum(), inputs=[xr], create_graph=True)
        assert xr.grad is not None
    return xr.grad.pow(2).sum(-1) + out[:, 0]


def parameter_gradient(p: dict[str, Tensor], x: Tensor) -> Tensor:
    """A penalty on the gradient in a parameter (shared by the samples: they interact)."""
    with torch.enable_grad():
        out = _net(p, x)
        (gw,) = torch.autograd.grad(out.pow(2).sum(), p["w2"], create_graph=True)
    return out.sum(-1) + gw.pow(2).sum()


def constant_gradient(p: dict[str, Tensor], x: Tensor) -> Tensor:
    """A backward without ``create_graph``: its result is a constant of ``f``."""
    with torch.enable_grad():
        xr = _fresh_input(x)
        out = _net(p, xr)
        (gx,) = torch.autograd.grad(out.sum(), xr, retain_graph=True)
    return (out * gx[:, :K]).sum(-1)


CASES: dict[str, Callable[[dict[str, Tensor], Tensor], Tensor]] = {
    "input_gradient": input_gradient,
    "functional_jacobian": functional_jacobian,
    "func_grad": func_grad,
    "func_jvp": func_jvp,
    "backward_with_inputs": backward_with_inputs,
    "parameter_gradient": parameter_gradient,
    "constant_gradient": constant_gradient,
}
PER_SAMPLE = [name for name in CASES if name != "parameter_gradient"]


def assert_close(actual: Tensor, expected: Tensor, tol: float = 1e-10) -> None:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = expected.abs().max().clamp_min(1e-30)
    error = float((actual.detach().to(expected.dtype) - expected).abs().max() / scale)
    assert error <= tol, error


@pytest.mark.parametrize("batch_dim", [0, None], ids=["batch_dim0", "dense"])
@pytest.mark.parametrize("name", list(CASES))
def test_every_backend_matches_the_oracle_or_declines(name: str, batch_dim: int | None) -> None:
    f, p = CASES[name], _params()
    x = torch.randn(B, D, dtype=DOUBLE)
    expected = dense_gramian(f, (p, x)).gramian
    with pytest.raises(tg.BackendCannotRun, match="backend='graph'"):
        tg.gramian(f, backend="structured", batch_dim=batch_dim)(p, x)
    for backend in ("auto", "graph"):
        assert_close(tg.gramian(f, backend=backend, batch_dim=batch_dim)(p, x), expected)
    for backend in ("jacobian", "ntvp"):
        try:
            G = tg.gramian(f, backend=backend, batch_dim=batch_dim)(p, x)
        except tg.BackendCannotRun as refusal:
            assert "graph" in refusal.alternatives, str(refusal)
        else:
            assert_close(G, expected)


def test_structured_declines_before_running_and_names_what_f_called() -> None:
    f, p = CASES["input_gradient"], _params()
    with pytest.raises(tg.BackendCannotRun) as info:
        tg.gramian(f, backend="structured", batch_dim=0)(p, torch.randn(B, D, dtype=DOUBLE))
    assert info.value.reason == "a call of torch.autograd.grad inside f"
    assert info.value.alternatives == ("graph", "jacobian")
    assert "expected f that does not differentiate its own computation" in str(info.value)


def test_a_cached_probe_that_did_not_see_it_is_caught() -> None:
    """``f`` differentiates itself only from its second call (a flag): not a wrong matrix."""
    p, x = _params(), torch.randn(B, D, dtype=DOUBLE)
    flag = {"on": False}

    def f(params: dict[str, Tensor], inputs: Tensor) -> Tensor:
        return input_gradient(params, inputs) if flag["on"] else _net(params, inputs).sum(-1)

    gramians = {backend: tg.gramian(f, backend=backend, batch_dim=0) for backend in
                ("auto", "structured")}
    for gramian in gramians.values():
        gramian(p, x)  # probes (and traces) f without the flag: cached
    flag["on"] = True
    expected = dense_gramian(f, (p, x)).gramian
    assert_close(gramians["auto"](p, x), expected)
    with pytest.raises(tg.BackendCannotRun, match="backend='graph'"):
        gramians["structured"](p, x)


@pytest.mark.parametrize("name", ["input_gradient", "func_grad"])
def test_aggregated_grad_matches_the_oracle(name: str) -> None:
    f, p = CASES[name], _params()
    x = torch.randn(B, D, dtype=DOUBLE)
    grads, aggregation = tg.aggregated_grad(f, tg.weighting.upgrad, batch_dim=0)(p, x)
    dense = dense_gramian(f, (p, x))
    assert_close(aggregation.gramian, dense.gramian)
    flat = torch.cat([leaf.reshape(-1) for leaf in optree.tree_leaves(grads)])
    assert_close(flat, aggregation.weights @ dense.jacobian)


def forces(p: dict[str, Tensor], x: Tensor) -> Tensor:
    """Forces from an energy, as written in the caller's grad mode (no ``enable_grad``)."""
    xr = _fresh_input(x)
    (gx,) = torch.autograd.grad(_net(p, xr).sum(), xr, create_graph=True)
    return -gx


@pytest.mark.parametrize("backend", ["auto", "graph"])
def test_a_cross_kernel_of_forces_from_an_energy_matches_the_oracle(backend: str) -> None:
    """The joined batch's check evaluates f with gradients, as its probe does: it declined
    before (f's own ``autograd.grad`` failed without a graph), and so did every backend."""
    p = _params()
    x1, x2 = torch.randn(4, D, dtype=DOUBLE), torch.randn(3, D, dtype=DOUBLE)
    ntk_fn = tg.ntk.empirical_ntk_fn(forces, trace_axes=(), backend=backend)
    assert_close(ntk_fn(x1, x2, p), dense_cross_kernel(forces, p, x1, x2))


def test_auto_says_why_each_backend_declined_when_none_can() -> None:
    """Without a batch axis the graph walk cannot join the sets, and the transforms refuse
    ``requires_grad_()`` in f: the error names no backend already tried, and each reason."""
    p = _params()
    x1, x2 = torch.randn(4, D, dtype=DOUBLE), torch.randn(3, D, dtype=DOUBLE)
    ntk_fn = tg.ntk.empirical_ntk_fn(forces, trace_axes=(), vmap_axes=None)
    with pytest.raises(tg.BackendCannotRun) as caught:
        ntk_fn(x1, x2, p)
    assert caught.value.backend == "auto" and caught.value.alternatives == ()
    assert all(f"{name!r}: " in str(caught.value) for name in ("graph", "jacobian", "ntvp"))
    assert "Use backend=" not in str(caught.value)


@pytest.mark.parametrize("name", ["input_gradient", "func_grad"])
def test_ntk_self_and_cross_kernels_match_the_oracle(name: str) -> None:
    """The cross kernel comes from the graph walk over both sets joined into one batch."""
    single = CASES[name]

    def f(params: dict[str, Tensor], inputs: Tensor) -> Tensor:  # [N, 2]: a kernel per pair
        return torch.stack([single(params, inputs), _net(params, inputs)[:, 0]], -1)

    p = _params()
    x1, x2 = torch.randn(4, D, dtype=DOUBLE), torch.randn(3, D, dtype=DOUBLE)
    for trace_axes in [(), (-1,)]:
        ntk_fn = tg.ntk.empirical_ntk_fn(f, trace_axes=trace_axes)
        for second in (None, x2):
            assert_close(ntk_fn(x1, second, p),
                         dense_cross_kernel(f, p, x1, second, trace_axes=trace_axes))
        assert ntk_fn.last_run is not None and ntk_fn.last_run.backends == ("graph",)
    with pytest.raises(tg.BackendCannotRun, match="backend='graph'"):
        tg.ntk.empirical_ntk_fn(f, backend="structured")(x1, x2, p)


def test_explain_reports_the_graph_walk() -> None:
    f, p = CASES["input_gradient"], _params()
    x = torch.randn(B, D, dtype=DOUBLE)
    report = tg.explain(f, batch_dim=0)(p, x)
    assert report.backend == report.auto_choice == "graph"
    assert set(report.fallback) == {"b1", "w1", "w2"}
    assert report.by_name("w1").unrecognised == ("a call of torch.autograd.grad inside f",)
    assert "cannot trace f" in repr(report)
    ran = tg.explain(f, batch_dim=0, run=True)(p, x)
    assert ran.ran is not None and ran.ran.backend == "graph"
    assert_close(ran.gramian, dense_gramian(f, (p, x)).gramian)


@pytest.mark.parametrize("name", ["input_gradient", "func_grad", "func_jvp"])
def test_a_recorded_forward_that_differentiates_itself_is_walked(name: str) -> None:
    """``tg.autograd.record``: its taps cannot see the inner pass either (was 0.73 off)."""
    f, p = CASES[name], _params()
    x = torch.randn(B, D, dtype=DOUBLE)
    leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
    with tg.autograd.record():
        losses = f(leaves, x)
    G = tg.autograd.gramian(losses, list(optree.tree_leaves(leaves)), batch_dim=0)
    assert_close(G, dense_gramian(f, (p, x)).gramian)


def test_the_census_names_each_way_f_differentiates_itself() -> None:
    p, x = _params(), torch.randn(B, D, dtype=DOUBLE)
    expected = {"input_gradient": "torch.autograd.grad",
                "functional_jacobian": "torch.autograd.grad",
                "func_grad": "torch.autograd.grad",
                "backward_with_inputs": "torch.autograd.backward",
                "constant_gradient": "torch.autograd.grad"}
    for name, how in expected.items():
        census = OpCensus()
        with census:
            CASES[name](p, x)
        assert census.differentiates == how, name
    census = OpCensus()
    with census:
        func_jvp(p, x)
    assert census.differentiates is not None and "forward-mode" in census.differentiates
    census = OpCensus()
    with census:
        _net(p, x).sum().requires_grad_()  # a plain f: nothing
    assert census.differentiates is None
    assert _torch_compat.self_differentiation(torch.Tensor.backward) == "Tensor.backward"


def test_tensor_backward_inside_f_is_seen() -> None:
    def f(params: dict[str, Tensor], inputs: Tensor) -> Tensor:
        with torch.enable_grad():
            xr = _fresh_input(inputs)
            out = _net(params, xr)
            out.sum().backward(inputs=[xr], create_graph=True)
            assert xr.grad is not None
        return xr.grad.pow(2).sum(-1)

    p, x = _params(), torch.randn(B, D, dtype=DOUBLE)
    with pytest.raises(tg.BackendCannotRun, match="a call of Tensor.backward inside f"):
        tg.gramian(f, backend="structured", batch_dim=0)(p, x)
    assert_close(tg.gramian(f, batch_dim=0)(p, x), dense_gramian(f, (p, x)).gramian)


def test_attention_runs_its_math_kernel_for_the_second_order() -> None:
    """The fused attention kernels have no double backward: torch's raw "derivative for
    aten::_scaled_dot_product_flash_attention_for_cpu_backward is not implemented" escaped
    the graph walk; its evaluations of such an ``f`` now run attention's math kernel."""
    torch.manual_seed(0)
    p = {"wq": torch.randn(4, 4, dtype=DOUBLE), "w": torch.randn(1, 4, dtype=DOUBLE)}

    def f(params: dict[str, Tensor], inputs: Tensor) -> Tensor:
        with torch.enable_grad():
            xr = _fresh_input(inputs)
            q = (xr @ params["wq"].T)[:, None]
            hidden = torch.nn.functional.scaled_dot_product_attention(q, q, q)[:, 0]
            out = (hidden @ params["w"].T).sum(-1)
            (gx,) = torch.autograd.grad(out.sum(), xr, create_graph=True)
        return gx.pow(2).sum((-1, -2)) + out.sum(-1)

    x = torch.randn(3, 5, 4, dtype=DOUBLE)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        expected = dense_gramian(f, (p, x)).gramian
    for backend in ("auto", "graph"):
        assert_close(tg.gramian(f, backend=backend, batch_dim=0)(p, x), expected)


def test_an_op_without_a_second_derivative_is_a_torchgram_error() -> None:
    """``torch.cdist``'s backward has no derivative: no backend can, and none says otherwise
    (the graph walk raised torch's raw ``NotImplementedError``; ``auto`` named the graph)."""
    p = {"w": torch.randn(4, 3, dtype=DOUBLE), "a": torch.randn(2, 4, dtype=DOUBLE)}

    def f(params: dict[str, Tensor], inputs: Tensor) -> Tensor:
        with torch.enable_grad():
            xr = _fresh_input(inputs)
            out = torch.cdist(torch.tanh(xr @ params["w"].T), params["a"]).sum(-1)
            (gx,) = torch.autograd.grad(out.sum(), xr, create_graph=True)
        return gx.pow(2).sum(-1) + out

    x = torch.randn(B, D, dtype=DOUBLE)
    for backend in ("auto", "graph"):
        with pytest.raises(NotImplementedError, match=r"^torchgram.gramian: expected f whose "
                           r"own torch.autograd.grad torch can differentiate once more.*"
                           r"'_cdist_backward' is not implemented\. Write that op"):
            tg.gramian(f, backend=backend, batch_dim=0)(p, x)
    for backend in ("jacobian", "ntvp"):
        with pytest.raises(tg.BackendCannotRun) as info:
            tg.gramian(f, backend=backend, batch_dim=0)(p, x)
        assert info.value.alternatives == ("graph",)


@pytest.mark.parametrize("kind", ["mlp", "lstm"])
@pytest.mark.parametrize("batch_dim", [0, None], ids=["batch_dim0", "dense"])
def test_a_recorded_forward_differentiated_after_the_block_is_walked(
        kind: str, batch_dim: int | None) -> None:
    """The physics-informed layout: the forward recorded, ``∂u/∂x`` taken after the block.

    The inner backward adds edges into the recorded calls' own nodes (a linear's saved
    ``W.T``): those leaves are walked (session 37's review: 0.17-0.56 off, relative)."""
    torch.manual_seed(0)
    if kind == "mlp":
        model: torch.nn.Module = torch.nn.Sequential(
            torch.nn.Linear(D, H), torch.nn.Tanh(), torch.nn.Linear(H, K)).double()
        x = torch.randn(B, D, dtype=DOUBLE)
    else:
        model = torch.nn.LSTM(D, K, batch_first=True).double()
        x = torch.randn(B, 3, D, dtype=DOUBLE)
    fn, params = tg.functionalize(model)

    def u(p: dict[str, Tensor], inputs: Tensor) -> Tensor:
        out = fn(p, inputs)
        return (out[0] if isinstance(out, tuple) else out).flatten(1).sum(-1)

    def residual(p: dict[str, Tensor], inputs: Tensor) -> Tensor:
        with torch.enable_grad():
            xr = _fresh_input(inputs)
            values = u(p, xr)
            (gx,) = torch.autograd.grad(values.sum(), xr, create_graph=True)
        return gx.pow(2).flatten(1).sum(-1) + values

    expected = dense_gramian(residual, ({k: v.detach() for k, v in params.items()}, x)).gramian
    xr = x.clone().requires_grad_()
    with tg.autograd.record():
        values = u(dict(model.named_parameters()), xr)
    (gx,) = torch.autograd.grad(values.sum(), xr, create_graph=True)  # after the block
    losses = gx.pow(2).flatten(1).sum(-1) + values
    G = tg.autograd.gramian(losses, list(model.parameters()), batch_dim=batch_dim)
    assert_close(G, expected)


@pytest.mark.parametrize("backend", ["auto", "graph"])
def test_a_cross_kernel_of_an_f_that_starts_differentiating_itself(backend: str) -> None:
    """The joined batch is probed afresh: a stale probe of its signature raised torchgram's
    internal ``OutputChanged`` out of ``ntk_fn`` (session 37's review)."""
    p, flag = _params(), {"on": False}

    def f(params: dict[str, Tensor], inputs: Tensor) -> Tensor:
        if not flag["on"]:
            return _net(params, inputs)
        with torch.enable_grad():
            xr = _fresh_input(inputs)
            out = _net(params, xr)
            (gx,) = torch.autograd.grad(out.sum(), xr, create_graph=True)
        return out + gx[:, :K].pow(2)

    x1, x2 = torch.randn(4, D, dtype=DOUBLE), torch.randn(3, D, dtype=DOUBLE)
    ntk_fn = tg.ntk.empirical_ntk_fn(f, trace_axes=(), backend=backend)
    ntk_fn(x1, x2, p)
    flag["on"] = True
    assert_close(ntk_fn(x1, x2, p), dense_cross_kernel(f, p, x1, x2))


def test_the_graph_walk_declines_sets_called_with_other_arguments() -> None:
    """A keyword pair ``(a, b)`` gives each set its own argument: the sets cannot be joined
    (numpy arrays there raised numpy's raw "truth value of an array is ambiguous")."""
    p = _params()

    def f(params: dict[str, Tensor], inputs: Tensor, scale: Any = None) -> Tensor:
        return input_gradient(params, inputs)[:, None] * float(scale.sum())

    x1, x2 = torch.randn(4, D, dtype=DOUBLE), torch.randn(3, D, dtype=DOUBLE)
    scales = (np.ones(2), np.ones(2))
    for backend in ("graph", "auto"):
        with pytest.raises(tg.BackendCannotRun):
            tg.ntk.empirical_ntk_fn(f, trace_axes=(), backend=backend)(x1, x2, p, scale=scales)
    with pytest.raises(tg.BackendCannotRun, match="with other arguments than their batched"):
        tg.ntk.empirical_ntk_fn(f, trace_axes=(), backend="graph")(x1, x2, p, scale=scales)


def test_structured_follows_f_that_stops_differentiating_itself() -> None:
    """A flag turns an input-gradient penalty off: structured refused the plain ``f`` on the
    strength of the first call's cached probe until the caches were cleared (session 59's
    hunt); twice on, it refuses twice."""
    generator = torch.Generator().manual_seed(0)
    params = {"w0": torch.randn(6, 6, generator=generator, dtype=torch.float64),
              "w1": torch.randn(1, 6, generator=generator, dtype=torch.float64)}
    x = torch.randn(5, 6, generator=generator, dtype=torch.float64)
    penalty = [True]

    def f(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        out = (torch.tanh(x @ p["w0"].T) @ p["w1"].T).squeeze(-1)
        if penalty[0]:
            grads = torch.vmap(torch.func.grad(lambda row: torch.tanh(row @ p["w0"].T).sum()))(x)
            out = out + grads.pow(2).sum(-1)
        return out

    gramian = tg.gramian(f, backend="structured", batch_dim=0)
    for _ in range(2):
        with pytest.raises(tg.BackendCannotRun, match="does not differentiate its own"):
            gramian(params, x)
    penalty[0] = False
    torch.testing.assert_close(gramian(params, x), dense_gramian(f, (params, x)).gramian,
                               rtol=1e-10, atol=1e-12)
