"""Leaves without entries, leaves whose entries share memory, outputs without entries.

On every backend and API. A zero-size leaf (``nn.Parameter(torch.empty(0))`` as a device
marker, a rank-0 adapter) made every backend but the graph walk raise torch's errors once
it was used, and jacobian and ntvp even when it was not (NOTE [empty leaves]); an expanded
leaf (stride 0) made ntvp raise forward AD's "more than one element ... refers to a single
memory location", and a leaf of overlapping windows (``unfold``, a Toeplitz ``as_strided``)
made it return a wrong G, 0.5-0.97 off (session 58's hunt); an output without entries
(``K = 0`` rows per sample) made the per-sample checks and the kernels' reshapes raise.
Found in session 39 by trying shapes by hand.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 -- torch's own spelling
from torch import Tensor

import torchgram as tg
from reference import dense_gramian

BACKENDS = ["jacobian", "ntvp", "graph", "structured", "auto"]
DTYPE = torch.float64
Case = tuple[dict[str, Tensor], Callable[[dict[str, Tensor], Tensor], Tensor]]


def _weight() -> Tensor:
    return torch.randn(5, 3, dtype=DTYPE, generator=torch.Generator().manual_seed(1))


def _unused() -> Case:
    return ({"marker": torch.empty(0, dtype=DTYPE), "w": _weight()},
            lambda p, x: torch.tanh(x @ p["w"].T))


def _matmul() -> Case:
    return ({"adapter": torch.zeros(0, 3, dtype=DTYPE), "w": _weight()},
            lambda p, x: torch.tanh(x @ p["w"].T) + (x @ p["adapter"].T).sum(1, keepdim=True))


def _linear_with_bias() -> Case:
    return ({"a": torch.zeros(0, 3, dtype=DTYPE), "b": torch.zeros(0, dtype=DTYPE),
             "w": _weight()},
            lambda p, x: torch.tanh(x @ p["w"].T)
            + F.linear(x, p["a"], p["b"]).sum(1, keepdim=True))


def _elementwise() -> Case:
    return ({"scale": torch.zeros(0, dtype=DTYPE), "w": _weight()},
            lambda p, x: torch.tanh(x @ p["w"].T) + (x[:, :0] * p["scale"]).sum(1, keepdim=True))


def _concatenated() -> Case:  # a use no rule covers: the leaf goes to the fallback
    return ({"extra": torch.zeros(0, 3, dtype=DTYPE), "w": _weight()},
            lambda p, x: torch.tanh(torch.cat([p["w"], p["extra"]]) @ x.T).T)


def _expanded() -> Case:
    column = torch.randn(3, 1, dtype=DTYPE, generator=torch.Generator().manual_seed(2))
    return {"a": column.expand(3, 5)}, lambda p, x: torch.tanh(x @ p["a"])


def _expanded_bias() -> Case:
    bias = torch.randn(1, dtype=DTYPE, generator=torch.Generator().manual_seed(3)).expand(5)
    return {"b": bias, "w": _weight()}, lambda p, x: torch.tanh(F.linear(x, p["w"], p["b"]))


def _toeplitz() -> Case:  # entries shared along diagonals: an as_strided view
    diagonals = torch.randn(7, dtype=DTYPE, generator=torch.Generator().manual_seed(4))
    return ({"a": diagonals.as_strided((3, 5), (1, 1))},
            lambda p, x: torch.tanh(x @ p["a"]))


def _windows() -> Case:  # overlapping windows of one signal (unfold with step 1)
    signal = torch.randn(7, dtype=DTYPE, generator=torch.Generator().manual_seed(5))
    return ({"a": signal.unfold(0, 5, 1), "w": _weight()},
            lambda p, x: torch.tanh(x @ p["a"]) + torch.tanh(x @ p["w"].T))


CASES = {"unused-empty": _unused, "matmul-empty": _matmul, "linear-empty": _linear_with_bias,
         "elementwise-empty": _elementwise, "cat-empty": _concatenated,
         "expanded": _expanded, "expanded-bias": _expanded_bias,
         "toeplitz": _toeplitz, "windows": _windows}


def _inputs() -> Tensor:
    return torch.randn(4, 3, dtype=DTYPE, generator=torch.Generator().manual_seed(0))


def _rows(f: Callable[[dict[str, Tensor], Tensor], Tensor]
          ) -> Callable[[dict[str, Tensor], Tensor], Tensor]:
    return lambda p, x: f(p, x).sum(1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch_dim", [0, None], ids=["batch0", "dense"])
@pytest.mark.parametrize("case", CASES)
def test_gramian_matches_the_oracle(case: str, batch_dim: int | None, backend: str) -> None:
    params, f = CASES[case]()
    x = _inputs()
    rows = _rows(f)
    expected = dense_gramian(rows, (params, x))
    G = tg.gramian(rows, backend=backend, batch_dim=batch_dim)(params, x)
    torch.testing.assert_close(G, expected.gramian, rtol=1e-10, atol=1e-12)
    d = tg.gramian(rows, backend=backend, batch_dim=batch_dim, diagonal=True)(params, x)
    torch.testing.assert_close(d, expected.gramian.diagonal(), rtol=1e-10, atol=1e-12)
    blocks = tg.gramian(rows, backend=backend, batch_dim=batch_dim, per_leaf=True)(params, x)
    for name, block in zip(sorted(params), expected.blocks, strict=True):
        torch.testing.assert_close(blocks[name], block, rtol=1e-10, atol=1e-12)
        if params[name].numel() == 0:
            assert blocks[name].shape == (4, 4) and not blocks[name].any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_update_and_kernel(case: str, backend: str) -> None:
    params, f = CASES[case]()
    x = _inputs()
    rows = _rows(f)
    update, info = tg.aggregated_grad(rows, tg.weighting.upgrad, batch_dim=0,
                                      backend=backend)(params, x)
    expected = dense_gramian(rows, (params, x))
    weights = info.weights.reshape(-1)
    for k, name in enumerate(sorted(params)):
        width = params[name].numel()
        start = sum(params[other].numel() for other in sorted(params)[:k])
        pulled = weights @ expected.jacobian[:, start:start + width]
        assert update[name].shape == params[name].shape
        torch.testing.assert_close(update[name].reshape(-1), pulled, rtol=1e-10, atol=1e-12)
    kernel = tg.ntk.empirical_ntk_fn(f, trace_axes=(), backend=backend)(x, x[:2], params)
    joined = dense_gramian(lambda p, x: f(p, x).reshape(-1), (params, x)).gramian
    torch.testing.assert_close(kernel, joined.reshape(4, 5, 4, 5)[:, :, :2].permute(0, 2, 1, 3),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", CASES)
def test_explain_runs(case: str) -> None:
    params, f = CASES[case]()
    explanation = tg.explain(_rows(f), batch_dim=0, run=True)(params, _inputs())
    empty = [name for name in params if params[name].numel() == 0]
    ways = {leaf.name: leaf.way for leaf in explanation.leaves}
    assert all(ways[name] == "unused" for name in empty), ways
    if case != "cat-empty":  # an empty leaf does not send the others to the fallback
        assert explanation.ran.way == "batched" and "fallback" not in ways.values(), explanation


@pytest.mark.parametrize("recorded", [True, False], ids=["record", "walk"])
@pytest.mark.parametrize("case", [name for name in CASES if name.endswith("-empty")])
def test_eager(case: str, recorded: bool) -> None:
    params, f = CASES[case]()
    x = _inputs()
    rows = _rows(f)
    expected = dense_gramian(rows, (params, x)).gramian
    leaves = {name: value.clone().requires_grad_() for name, value in params.items()}
    if recorded:
        with tg.autograd.record():
            losses = rows(leaves, x)
    else:
        losses = rows(leaves, x)
    inputs = [leaves[name] for name in sorted(leaves)]
    G = tg.autograd.gramian(losses, inputs, batch_dim=0, retain_graph=True)
    torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-12)
    tg.autograd.backward(losses, inputs, tg.weighting.upgrad, batch_dim=0)
    assert all(leaf.grad is None or leaf.grad.shape == leaf.shape for leaf in inputs)
    assert inputs[-1].grad is not None  # the weight every case uses


def _no_entries(p: dict[str, Tensor], x: Tensor) -> Tensor:
    return torch.tanh(x @ p["w"].T)[:, :0]  # [B, 0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", [{"batch_dim": 0}, {"batch_dim": 0, "diagonal": True},
                                     {"batch_dim": 0, "per_leaf": True}, {}],
                         ids=["batch0", "diagonal", "per-leaf", "dense"])
def test_output_without_entries(backend: str, options: dict[str, object]) -> None:
    params, x = {"w": _weight()}, _inputs()
    G = tg.gramian(_no_entries, backend=backend, **options)(params, x)
    block = G["w"] if options.get("per_leaf") else G
    assert block.shape == ((4, 0) if options.get("diagonal") else (4, 0, 4, 0))
    options.pop("diagonal", None)
    update, info = tg.aggregated_grad(_no_entries, tg.weighting.upgrad, backend=backend,
                                      **options)(params, x)
    assert update["w"].shape == (5, 3) and not update["w"].any()
    kernel = tg.ntk.empirical_ntk_fn(_no_entries, trace_axes=(), backend=backend)(
        x, x[:2], params)
    assert kernel.shape == (4, 2, 0, 0)


@pytest.mark.parametrize("recorded", [True, False], ids=["record", "walk"])
def test_eager_output_without_entries(recorded: bool) -> None:
    """``tg.autograd.backward`` of an output without entries: zero ``.grad``, as torch's
    ``out.backward(zeros)`` (it raised "backward through the graph a second time": the
    Gramian's pass, which had no rows, freed the graph before the update's backward)."""
    weight = _weight().requires_grad_()
    x = _inputs()
    for call in ("gramian", "backward"):
        if recorded:
            with tg.autograd.record():
                out = torch.tanh(x @ weight.T)[:, :0]
        else:
            out = torch.tanh(x @ weight.T)[:, :0]
        if call == "gramian":
            assert tg.autograd.gramian(out, [weight], batch_dim=0).shape == (4, 0, 4, 0)
            continue
        weights = tg.autograd.backward(out, [weight], tg.weighting.upgrad, batch_dim=0)
        assert weights.shape == (4, 0)
        assert weight.grad is not None and weight.grad.shape == (5, 3) and not weight.grad.any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_inputs_of_overlapping_windows(backend: str) -> None:
    """The Gramian w.r.t. the inputs of sliding windows of one series (``argnums=1``)."""
    series = torch.randn(10, dtype=DTYPE, generator=torch.Generator().manual_seed(6))
    windows = series.unfold(0, 6, 1)  # [5, 6], consecutive windows share 5 entries
    weight = torch.randn(6, 3, dtype=DTYPE, generator=torch.Generator().manual_seed(7))

    def f(w: Tensor, x: Tensor) -> Tensor:
        return torch.tanh(x @ w)

    jacobian = torch.func.jacrev(f, argnums=1)(weight, windows).reshape(15, -1)
    G = tg.gramian(f, argnums=1, backend=backend)(weight, windows)
    torch.testing.assert_close(G.reshape(15, 15), jacobian @ jacobian.T, rtol=1e-10,
                               atol=1e-12)
