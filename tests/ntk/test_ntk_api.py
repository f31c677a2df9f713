"""``torchgram.ntk.empirical_ntk_fn``: configuration, inputs, tiles, progress, display."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import torchgram as tg
from reference import dense_cross_kernel


def mlp(dtype: torch.dtype = torch.float64) -> tuple[object, dict[str, Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 4)).to(dtype)
    return tg.functionalize(model)


def inputs(n: int, dtype: torch.dtype = torch.float64, seed: int = 1) -> Tensor:
    return torch.randn(n, 3, dtype=dtype, generator=torch.Generator().manual_seed(seed))


# -- configuration -----------------------------------------------------------------------------

@pytest.mark.parametrize(("options", "error", "match"), [
    ({"trace_axes": "last"}, TypeError, "trace_axes to be an int or a tuple of ints"),
    ({"trace_axes": (1, 1)}, ValueError, "trace_axes without repeated axes"),
    ({"diagonal_axes": (0.5,)}, TypeError, "diagonal_axes to be an int or a tuple"),
    ({"trace_axes": (-1,), "diagonal_axes": (-1,)}, ValueError,
     "trace_axes and diagonal_axes to name different axes"),
    ({"vmap_axes": "batch"}, TypeError, "vmap_axes to be None, an int, or a triple"),
    ({"vmap_axes": (0, 0, {"mask": "x"})}, TypeError, "vmap_axes to be None"),
    ({"backend": "fast"}, ValueError, "backend to be one of"),
    ({"chunk_size": 0}, ValueError, "chunk_size to be a positive int"),
    ({"memory_budget": -1}, ValueError, "memory_budget to be a positive int"),
    ({"progress": 1}, TypeError, "progress to be True or False"),
])
def test_bad_configuration_is_refused_when_built(options: dict[str, object], error: type,
                                                 match: str) -> None:
    fn, _ = mlp()
    with pytest.raises(error, match=f"torchgram.ntk.empirical_ntk_fn: expected {match}"):
        tg.ntk.empirical_ntk_fn(fn, **options)


def test_f_must_be_callable() -> None:
    with pytest.raises(TypeError, match="a callable"):
        tg.ntk.empirical_ntk_fn(42)  # type: ignore[arg-type]


def test_bad_calls_are_refused_before_any_jacobian_work() -> None:
    fn, params = mlp()
    x = inputs(3)
    with pytest.raises(ValueError, match=r"trace_axes within \[-2, 2\)"):
        tg.ntk.empirical_ntk_fn(fn, trace_axes=(2,))(x, None, params)
    with pytest.raises(ValueError, match="trace_axes and diagonal_axes to name different axes"):
        tg.ntk.empirical_ntk_fn(fn, trace_axes=(1,), diagonal_axes=(-1,))(x, None, params)
    with pytest.raises(TypeError, match="to return one tensor"):
        tg.ntk.empirical_ntk_fn(lambda p, x: {"a": fn(p, x)})(x, None, params)
    with pytest.raises(TypeError, match="floating-point tensor leaves"):
        tg.ntk.empirical_ntk_fn(fn)(x, None, {"step": torch.tensor(3)})
    with pytest.raises(ValueError, match=r"traced axis 0 to have the same size in f\(x1\)"):
        tg.ntk.empirical_ntk_fn(fn, trace_axes=(0,))(x, inputs(2), params)
    with pytest.raises(ValueError, match="kwargs_axes to name keyword arguments"):
        tg.ntk.empirical_ntk_fn(fn, vmap_axes=(0, 0, {"mask": 0}))(x, None, params)


# -- semantics ---------------------------------------------------------------------------------

def test_defaults_are_neural_tangents_logit_trace() -> None:
    fn, params = mlp()
    x1, x2 = inputs(3), inputs(2, seed=2)
    kernel = tg.ntk.empirical_ntk_fn(fn)(x1, x2, params)
    torch.testing.assert_close(kernel, dense_cross_kernel(fn, params, x1, x2, (-1,)))
    assert kernel.shape == (3, 2)


def test_float32_in_float32_out() -> None:
    fn, params = mlp(torch.float32)
    kernel = tg.ntk.empirical_ntk_fn(fn, trace_axes=())(inputs(3, torch.float32), None, params)
    assert kernel.dtype == torch.float32 and kernel.shape == (3, 3, 4, 4)


def test_keyword_arguments_follow_neural_tangents() -> None:
    """A pair (a, b) goes to f(x1) and f(x2); anything else is shared; kwargs_axes batches."""
    fn, params = mlp()

    def f(p: dict[str, Tensor], x: Tensor, scale: Tensor) -> Tensor:
        return fn(p, x * scale)

    x1, x2 = inputs(3), inputs(2, seed=2)
    s1, s2 = torch.tensor(2.0, dtype=torch.float64), torch.tensor(0.5, dtype=torch.float64)
    ntk_fn = tg.ntk.empirical_ntk_fn(f, trace_axes=())
    expected = dense_cross_kernel(lambda p, x: fn(p, x), params, x1 * s1, x2 * s2)
    torch.testing.assert_close(ntk_fn(x1, x2, params, scale=(s1, s2)), expected)
    shared = dense_cross_kernel(lambda p, x: fn(p, x), params, x1 * s1, x2 * s1)
    torch.testing.assert_close(ntk_fn(x1, x2, params, scale=s1), shared)
    per_sample = torch.rand(3, 1, dtype=torch.float64) + 0.5
    batched = tg.ntk.empirical_ntk_fn(f, trace_axes=(), vmap_axes=(0, 0, {"scale": 0}))
    torch.testing.assert_close(batched(x1, None, params, scale=per_sample),
                               dense_cross_kernel(lambda p, x: fn(p, x), params,
                                                  x1 * per_sample, None))


def test_batch_on_another_axis() -> None:
    fn, params = mlp()

    def f(p: dict[str, Tensor], x_t: Tensor) -> Tensor:  # [features, N] -> [K, N]
        return fn(p, x_t.T).T

    x1, x2 = inputs(3).T, inputs(2, seed=2).T
    ntk_fn = tg.ntk.empirical_ntk_fn(f, trace_axes=(0,), vmap_axes=1)
    kernel = ntk_fn(x1, x2, params)
    torch.testing.assert_close(kernel, dense_cross_kernel(f, params, x1, x2, (0,)))
    assert kernel.shape == (3, 2)


# -- tiles and progress ------------------------------------------------------------------------

@pytest.mark.parametrize(("backend", "trace", "diagonal"), [
    ("auto", (), ()), ("auto", (-1,), ()), ("auto", (), (0,)), ("auto", (), (0, -1)),
    ("auto", (0,), ()), ("jacobian", (-1,), ()), ("jacobian", (), (0,))])
def test_tiles_give_the_same_kernel(trace: tuple[int, ...], diagonal: tuple[int, ...],
                                    backend: str) -> None:
    fn, params = mlp()
    x1 = inputs(11)
    x2 = inputs(11 if 0 in diagonal or 0 in trace else 7, seed=2)
    whole = tg.ntk.empirical_ntk_fn(fn, trace_axes=trace, diagonal_axes=diagonal,
                                    backend=backend)
    tiled = tg.ntk.empirical_ntk_fn(fn, trace_axes=trace, diagonal_axes=diagonal,
                                    backend=backend, memory_budget=4_000)
    for second in (None, x2):
        expected = whole(x1, second, params)
        torch.testing.assert_close(tiled(x1, second, params), expected)
        assert tiled.last_run is not None and tiled.last_run.tile_size is not None
        assert tiled.last_run.tiles[0] > 1
        torch.testing.assert_close(expected, dense_cross_kernel(fn, params, x1, second, trace,
                                                                diagonal))


@pytest.mark.parametrize("backend", ["auto", "jacobian", "ntvp", "structured"])
def test_no_tiles_where_only_the_derivatives_show_the_samples_interact(backend: str) -> None:
    """Kernel hunt 2: samples whose features are the same where they meet give the same
    ``h - h.mean(0)`` (zero) alone and in the batch, so the tiles' outputs were the batch's;
    the derivative in ``w`` is not (``x_b - mean(x)`` in the batch, zero alone), and kernels
    from tiles of one sample were wrong. One tile per side now, as the batch computes it."""
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]], dtype=torch.float64)  # x·w = 1 each
    params = {"w": torch.ones(2, dtype=torch.float64), "u": torch.randn(2, 3).double()}

    def f(p: dict[str, Tensor], xs: Tensor) -> Tensor:
        h = xs @ p["w"]
        return (h - h.mean(0))[:, None] + torch.tanh(xs @ p["u"])

    expected = dense_cross_kernel(f, params, x, None)
    ntk_fn = tg.ntk.empirical_ntk_fn(f, trace_axes=(), backend=backend, memory_budget=64)
    torch.testing.assert_close(ntk_fn(x, None, params), expected)
    assert ntk_fn.last_run is not None and ntk_fn.last_run.tiles == (1, 1)
    assert "derivatives" in " ".join(ntk_fn.last_run.notes)


def test_tiles_of_a_self_kernel_compute_each_pair_once() -> None:
    fn, params = mlp()
    ntk_fn = tg.ntk.empirical_ntk_fn(fn, memory_budget=4_000)
    ntk_fn(inputs(11), None, params)
    run = ntk_fn.last_run
    assert run is not None and run.tile_size is not None
    tiles = run.tiles[0]
    assert run.blocks == tiles * (tiles + 1) // 2


def test_progress_shows_a_bar_over_the_tiles(capsys: pytest.CaptureFixture[str]) -> None:
    fn, params = mlp()
    tg.ntk.empirical_ntk_fn(fn, memory_budget=4_000, progress=True)(inputs(11), None, params)
    assert "kernel tiles" in capsys.readouterr().err
    tg.ntk.empirical_ntk_fn(fn, progress=True)(inputs(11), None, params)  # one tile: no bar
    assert "kernel tiles" not in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["jacobian", "ntvp", "structured"])
def test_gramian_progress_over_row_chunks(backend: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    fn, params = mlp()
    x = inputs(5)
    expected = tg.gramian(fn, batch_dim=0)(params, x)
    G = tg.gramian(fn, backend=backend, batch_dim=0, chunk_size=4, progress=True)(params, x)
    torch.testing.assert_close(G, expected)
    assert "row chunks" in capsys.readouterr().err
    tg.gramian(fn, backend=backend, batch_dim=0, progress=True)(params, x)
    assert "row chunks" not in capsys.readouterr().err


# -- display -----------------------------------------------------------------------------------

def test_kernel_functions_and_runs_display_as_tables() -> None:
    fn, params = mlp()
    ntk_fn = tg.ntk.empirical_ntk_fn(fn, diagonal_axes=(0,), memory_budget=2**20)
    text = repr(ntk_fn)
    assert text.startswith("EmpiricalNTK") and "mean over each traced pair" in text
    assert "1,048,576 bytes" in text
    assert ntk_fn._repr_html_().startswith("<table>")
    assert ntk_fn.last_run is None
    ntk_fn(inputs(4), None, params)
    run = ntk_fn.last_run
    assert run is not None
    assert "kernel shape" in repr(run) and "[4]" in repr(run)
    assert "<th" in run._repr_html_()


@pytest.mark.parametrize("vmap_axes", [0, None], ids=["per-sample", "dense"])
@pytest.mark.parametrize("backend", ["auto", "structured", "graph", "jacobian", "ntvp"])
def test_an_f_no_probe_describes_raises_the_public_errors(backend: str,
                                                           vmap_axes: int | None) -> None:
    """``f`` writes into a captured tensor, or returns another output, only where gradients
    are on, and the probes run without them: the evaluations after the second probe meet it
    again. The kernel raised torchgram's internal ``OutputChanged`` (and a write moved the
    counter on graph, structured and auto); now the errors of ``tg.gramian``, nothing written
    (NOTE [writes its probe did not see])."""
    calls = torch.zeros((), dtype=torch.float64)
    w = torch.randn(3, 2, dtype=torch.float64)
    x = torch.randn(6, 3, dtype=torch.float64)

    def writes(w: Tensor, x: Tensor) -> Tensor:
        if torch.is_grad_enabled():
            calls.add_(1)
        return torch.tanh(x @ w)

    def reshapes(w: Tensor, x: Tensor) -> Tensor:
        out = torch.tanh(x @ w)
        return out[:, :1] if torch.is_grad_enabled() else out

    with pytest.raises(ValueError, match="functionalize"):
        tg.ntk.empirical_ntk_fn(writes, vmap_axes=vmap_axes, backend=backend)(x, None, w)
    assert float(calls) == 0.0
    with pytest.raises(RuntimeError, match="outputs of the same structure") as caught:
        tg.ntk.empirical_ntk_fn(reshapes, vmap_axes=vmap_axes, backend=backend)(x, None, w)
    assert type(caught.value) is RuntimeError
