"""Kernels between two input sets on every backend, against the dense oracle, on the zoo.

``x1`` and ``x2`` are disjoint samples of a zoo case's batch (3 and 2 samples; 3 and 3 for
a diagonal batch axis); the oracle is ``J(x1) J(x2)ᵀ`` from two dense ``jacrev`` Jacobians
(``reference.dense_cross_kernel``), put in neural-tangents' layout independently.
"""

from __future__ import annotations

from typing import Any

import optree
import pytest
import torch
from torch import Tensor

import torchgram as tg
from reference import dense_cross_gramian, dense_cross_kernel, nt_layout
from zoo import NAMES, build

TENSOR_CASES = [name for name in NAMES if name != "pytree_output"]
BACKENDS = ("auto", "structured", "jacobian", "ntvp")


def split(case: Any, first: slice, second: slice) -> tuple[Any, Any]:
    """Two sample sets of the case's inputs (a tuple pytree), along its batch dim."""
    dim = 1 if case.in_dims == 1 else 0

    def take(part: slice) -> Any:
        return optree.tree_map(lambda t: t.narrow(dim, part.start, part.stop - part.start)
                               if isinstance(t, Tensor) else t, case.inputs)

    return take(first), take(second)


def kernel_case(name: str) -> tuple[Any, Any, Any, Any]:
    """``f(params, xs)`` with the inputs as one tuple, its params, and ``vmap_axes``."""
    case = build(name)

    def f(params: Any, xs: tuple[Any, ...]) -> Tensor:
        return case.f(params, *xs)

    vmap = None if case.batch_dim is None else (
        (1, 1, {}) if case.batch_dim == 1 else 0)
    return case, f, case.params, vmap


def specs(case: Any, f: Any) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    out = f(case.params, case.inputs)
    batch = 1 if case.batch_dim == 1 else 0
    found = [((), ())]
    if out.dim() >= 2:
        found.append(((-1 if batch == 0 else 0,), ()))
        found.append(((), (batch, -1 if batch == 0 else 0)))
    else:
        found.append(((), (batch,)))
    return found


# ntvp (forward-mode pushes) and rows without batch structure are slow on the larger zoo
# models: they run on a representative subset (tied weights, embeddings, convolutions, the
# batch on dim 1, elementwise parameters).
SUBSET = ("mlp_logits", "cnn", "embedding", "tied_lm", "batch_on_dim1", "elementwise")
GRID = [pytest.param(name, backend, structure, id=f"{name}-{backend}-{structure}")
        for name in TENSOR_CASES
        for backend, structure in (("auto", "vmap"), ("structured", "vmap"), ("jacobian", "vmap"),
                                   ("ntvp", "vmap"), ("jacobian", "novmap"))
        if name in SUBSET or backend in ("auto", "structured", "jacobian") and structure == "vmap"]


@pytest.mark.parametrize(("name", "backend", "structure"), GRID)
def test_cross_kernels_match_the_dense_oracle(name: str, backend: str, structure: str) -> None:
    case, f, params, vmap = kernel_case(name)
    x1, x2 = split(case, slice(0, 3), slice(3, 5))
    _, x3 = split(case, slice(0, 3), slice(2, 5))  # as many samples as x1
    grams = {id(x): dense_cross_gramian(f, params, x1, x) for x in (None, x2, x3)}
    for trace, diagonal in specs(case, f):
        same = bool(diagonal) and (0 in diagonal or (case.batch_dim == 1 and 1 in diagonal))
        ntk_fn = tg.ntk.empirical_ntk_fn(f, trace_axes=trace, diagonal_axes=diagonal,
                                         vmap_axes=vmap if structure == "vmap" else None,
                                         backend=backend)
        for second in (None, x3 if same else x2):
            expected = nt_layout(grams[id(second)], trace, diagonal)
            kernel = ntk_fn(x1, second, params)
            assert kernel.shape == expected.shape, (trace, diagonal)
            scale = expected.abs().max().clamp_min(1e-12)
            torch.testing.assert_close(kernel / scale, expected / scale, rtol=1e-10, atol=1e-10,
                                       msg=f"{trace=} {diagonal=} x2={second is not None}")


@pytest.mark.parametrize("name", TENSOR_CASES)
def test_graph_pairs_two_sets_through_their_joined_batch(name: str) -> None:
    """A cross block of the graph walk: the off-diagonal block of the joined batch's Gramian;
    without a batch axis (``coupled_batch``: ``vmap_axes=None``) it declines."""
    case, f, params, vmap = kernel_case(name)
    x1, x2 = split(case, slice(0, 3), slice(3, 5))
    ntk_fn = tg.ntk.empirical_ntk_fn(f, trace_axes=(), vmap_axes=vmap, backend="graph")
    torch.testing.assert_close(ntk_fn(x1, None, params), dense_cross_kernel(f, params, x1, None),
                               rtol=1e-10, atol=1e-10)
    if vmap is None:
        with pytest.raises(tg.BackendCannotRun, match="without a batch axis to join them"):
            ntk_fn(x1, x2, params)
        return
    expected = dense_cross_kernel(f, params, x1, x2)
    scale = expected.abs().max()
    torch.testing.assert_close(ntk_fn(x1, x2, params) / scale, expected / scale,
                               rtol=1e-10, atol=1e-10)
    assert ntk_fn.last_run is not None
    assert any("joined into one batch" in note for report in ntk_fn.last_run.reports
               for note in report.notes)


def test_graph_declines_two_sets_whose_samples_interact() -> None:
    """Joined, samples that interact (``h - h.mean(0)``) would see each other's: declined."""
    torch.manual_seed(0)
    params = {"w": torch.randn(4, 3, dtype=torch.float64)}

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        hidden = torch.tanh(x @ p["w"].T)
        return hidden - hidden.mean(0)

    x1, x2 = torch.randn(3, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
    ntk_fn = tg.ntk.empirical_ntk_fn(f, trace_axes=(), backend="graph")
    with pytest.raises(tg.BackendCannotRun, match="does not compute each set's rows"):
        ntk_fn(x1, x2, params)


def test_graph_declines_two_sets_of_other_lengths_and_auto_answers() -> None:
    """A hunt after session 55: x1 ``[3, 5, 3]`` and x2 ``[2, 7, 3]`` (sequences of other
    lengths) cannot be joined into one batch; the graph walk raised torch's ``cat`` error."""
    torch.manual_seed(0)
    params = {"w": torch.randn(4, 3, dtype=torch.float64)}

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return torch.tanh(x @ p["w"].T)

    x1, x2 = torch.randn(3, 5, 3, dtype=torch.float64), torch.randn(2, 7, 3, dtype=torch.float64)
    with pytest.raises(tg.BackendCannotRun, match=r"differ in shape beyond the batch axis "
                       r"\(\(3, 5, 3\) and \(2, 7, 3\)\).*backend='structured'"):
        tg.ntk.empirical_ntk_fn(f, backend="graph")(x1, x2, params)
    kernel = tg.ntk.empirical_ntk_fn(f, trace_axes=())(x1, x2, params)
    torch.testing.assert_close(kernel, dense_cross_kernel(f, params, x1, x2, (), ()),
                               rtol=1e-10, atol=1e-12)


def test_auto_falls_back_from_a_backend_that_cannot() -> None:
    case, f, params, vmap = kernel_case("mlp_logits")
    x1, x2 = split(case, slice(0, 3), slice(3, 5))
    ntk_fn = tg.ntk.empirical_ntk_fn(f, trace_axes=(), vmap_axes=vmap)
    torch.testing.assert_close(ntk_fn(x1, x2, params), dense_cross_kernel(f, params, x1, x2),
                               rtol=1e-10, atol=1e-10)
    assert ntk_fn.last_run is not None and ntk_fn.last_run.backends


def test_interacting_samples_give_the_kernel_of_f_as_called() -> None:
    """Samples mixed between layers: vmap_axes=0 is not true, the kernel is still exact."""
    torch.manual_seed(0)
    params = {"w": torch.randn(4, 3, dtype=torch.float64), "b": torch.randn(4, dtype=torch.float64),
              "v": torch.randn(2, 4, dtype=torch.float64)}

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        h = torch.tanh(torch.nn.functional.linear(x, p["w"], p["b"]))
        return torch.nn.functional.linear(h - h.mean(0), p["v"])

    x1, x2 = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)
    for backend in BACKENDS:
        ntk_fn = tg.ntk.empirical_ntk_fn(f, trace_axes=(), vmap_axes=0, backend=backend)
        for second in (None, x2):
            torch.testing.assert_close(ntk_fn(x1, second, params),
                                       dense_cross_kernel(f, params, x1, second))
        assert ntk_fn.last_run is not None
        notes = [note for report in ntk_fn.last_run.reports for note in report.notes]
        assert any("whole batch" in note for note in notes), backend


def test_mixing_inputs_before_the_first_layer_keeps_the_per_sample_way() -> None:
    """NOTE [derivative check]: x - x.mean(0) before any parameter is still exact per sample."""
    torch.manual_seed(0)
    params = {"w": torch.randn(4, 3, dtype=torch.float64), "v": torch.randn(2, 4,
                                                                           dtype=torch.float64)}

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        h = torch.tanh(torch.nn.functional.linear(x - x.mean(0), p["w"]))
        return torch.nn.functional.linear(h, p["v"])

    x1, x2 = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)
    ntk_fn = tg.ntk.empirical_ntk_fn(f, trace_axes=(), backend="structured")
    torch.testing.assert_close(ntk_fn(x1, x2, params), dense_cross_kernel(f, params, x1, x2))
    assert ntk_fn.last_run is not None
    assert ntk_fn.last_run.reports[0].way == "batched"
    assert not ntk_fn.last_run.reports[0].notes


@pytest.mark.parametrize("backend", ["auto", "structured"])
def test_samples_sorted_by_value_are_checked_again_when_the_order_changes(backend: str) -> None:
    """``model(x)[x[:, 0].argsort()]``: the rows follow the samples' values. A first call on
    sorted inputs (the identity) passed the thorough derivative check, and later calls
    exchanging samples 0 and 2 were checked by the even/odd pair only, which keeps them
    together: 0.34 and 0.95 off (relative, session 28). The check is thorough again when the
    routing indices of the batched graph change (NOTE [routing values])."""
    torch.manual_seed(0)
    params = {"w": torch.randn(3, 5, dtype=torch.float64),
              "u": torch.randn(5, 2, dtype=torch.float64)}

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return (torch.tanh(x @ p["w"]) @ p["u"])[x[:, 0].argsort()]

    ntk_fn = tg.ntk.empirical_ntk_fn(f, trace_axes=(), backend=backend)
    for order in ([0, 1, 2, 3, 4, 5], [2, 1, 0, 3, 4, 5], [0, 1, 4, 3, 2, 5]):
        x = torch.randn(6, 3, dtype=torch.float64)
        x = x[x[:, 0].argsort()][order]
        torch.testing.assert_close(ntk_fn(x, None, params),
                                   dense_cross_kernel(f, params, x, None, ()))


@pytest.mark.parametrize("backend", ["auto", "structured"])
@pytest.mark.parametrize("trace", [(), (-1,)], ids=["full", "traced"])
def test_a_coupling_behind_dead_first_and_last_samples_is_seen(backend: str,
                                                               trace: tuple[int, ...]) -> None:
    """Kernel hunt (session 24): ``h - h.mean(0)`` before a relu that zeroes every sample's
    output but one in the middle. The derivative check weighed the first and the last
    sample's rows only, both without gradient, and let the per-sample passes run: kernels
    0.64 off (relative). It now weighs the even- and the odd-numbered samples."""
    params = {"w": torch.ones(1, 3, dtype=torch.float64),
              "u": torch.tensor([[1.0, -2.0], [0.5, 1.0], [2.0, 0.25]], dtype=torch.float64)}

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        h = x @ p["w"]
        return torch.relu(h - h.mean(0)) @ p["u"]

    x1 = torch.tensor([[1.0], [1.0], [5.0], [1.0]], dtype=torch.float64)  # only sample 2 lives
    x2 = torch.tensor([[2.0], [7.0], [2.0]], dtype=torch.float64)  # only sample 1 lives
    ntk_fn = tg.ntk.empirical_ntk_fn(f, trace_axes=trace, backend=backend)
    for second in (None, x2):
        torch.testing.assert_close(ntk_fn(x1, second, params),
                                   dense_cross_kernel(f, params, x1, second, trace))


@pytest.mark.parametrize("backend", (*BACKENDS, "graph"))
@pytest.mark.parametrize("empty", ["x1", "x2"])
def test_an_empty_input_set_gives_an_empty_kernel(backend: str, empty: str) -> None:
    """Without batch structure, an empty side gave torch's reshape or cat errors (session 58)."""
    params = {"w": torch.randn(5, 3, dtype=torch.float64), "b": torch.randn(3, dtype=torch.float64)}

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return torch.tanh(x @ p["w"] + p["b"])

    some, none = torch.randn(4, 5, dtype=torch.float64), torch.randn(0, 5, dtype=torch.float64)
    x1, x2 = (none, some) if empty == "x1" else (some, none)
    kernel = tg.ntk.empirical_ntk_fn(f, trace_axes=(), vmap_axes=None, backend=backend)(
        x1, x2, params)
    assert kernel.shape == (x1.shape[0], x2.shape[0], 3, 3) and kernel.dtype == torch.float64
