"""``backend="ntvp"``: chunking, the c·P memory bound, missing forward AD, side effects.

Agreement with the oracle on every zoo model is in ``test_oracle.py``; here are the checks
specific to pushing vjps forward with jvps.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import optree
import pytest
import torch
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

import torchgram as tg
from custom_functions import SavesInput
from reference import dense_gramian
from zoo import build

M = 15  # rows of the chunking models: 5 samples × 3 rows each


def assert_matches(actual: Tensor, expected: Tensor) -> None:
    scale = expected.abs().max().clamp_min(1.0)
    torch.testing.assert_close(actual / scale, expected / scale, rtol=1e-10, atol=1e-10)


# -- chunk sizes -----------------------------------------------------------------------------

CHUNKS = [
    pytest.param(1, id="chunk1-loop"),
    pytest.param(2, id="chunk2-below-rows-per-sample"),
    pytest.param(4, id="chunk4-non-divisor"),
    pytest.param(M, id="chunk15-exactly-m"),
    pytest.param(40, id="chunk40-more-than-m"),
    pytest.param(None, id="all-rows"),
]


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("per_leaf", [False, True], ids=["summed", "per_leaf"])
@pytest.mark.parametrize("batch", [None, "per_sample"], ids=["dense", "per_sample"])
@pytest.mark.parametrize("name", ["mlp_logits", "pytree_output"])
def test_chunk_sizes_match_oracle(name: str, batch: str | None, per_leaf: bool,
                                  chunk_size: int | None) -> None:
    case = build(name, torch.float64)
    expected = dense_gramian(case.f, case.args)
    assert expected.gramian.shape == (M, M)
    result = tg.gramian(case.f, backend="ntvp", chunk_size=chunk_size, per_leaf=per_leaf,
                        batch_dim=case.batch_dim if batch else None)(*case.args)
    if not per_leaf:
        assert_matches(result, expected.shaped())
        return
    blocks = optree.tree_leaves(result)
    assert len(blocks) == len(expected.blocks)
    for block, expected_block in zip(blocks, expected.blocks, strict=True):
        assert_matches(block, expected.shaped(expected_block))


@pytest.mark.parametrize("per_leaf", [False, True], ids=["summed", "per_leaf"])
def test_result_is_exactly_symmetric(per_leaf: bool) -> None:
    case = build("cnn", torch.float32)
    result = tg.gramian(case.f, backend="ntvp", chunk_size=2, per_leaf=per_leaf)(*case.args)
    for block in optree.tree_leaves(result):
        assert torch.equal(block, block.mT)


# -- memory: what is materialized per chunk --------------------------------------------------

def _pushes(f: Any, args: tuple[Any, ...], **options: Any) -> tuple[Tensor, list]:
    """Run ntvp; return ``G`` and ``(rows, bytes of vjps, bytes of jvp outputs)`` per push."""
    explanation = tg.explain(f, backend="ntvp", run=True, **options)(*args)
    assert explanation.ran is not None and explanation.ran.backend == "ntvp"
    return explanation.gramian, explanation.ran.pushes


@pytest.mark.parametrize("chunk_size", [1, 2, 4, M, 40])
@pytest.mark.parametrize("per_leaf", [False, True], ids=["summed", "per_leaf"])
@pytest.mark.parametrize("batch", [None, "per_sample"], ids=["dense", "per_sample"])
def test_each_chunk_holds_at_most_chunk_size_vjps(batch: str | None, per_leaf: bool,
                                                  chunk_size: int) -> None:
    case = build("mlp_logits", torch.float64)
    leaves = optree.tree_leaves(case.params)
    itemsize = 8
    widths = [leaf.numel() for leaf in leaves] if per_leaf else [sum(x.numel() for x in leaves)]
    _, pushes = _pushes(case.f, case.args, chunk_size=chunk_size, per_leaf=per_leaf,
                        batch_dim=case.batch_dim if batch else None)
    rows_per_sample = M // 5
    if batch and chunk_size < rows_per_sample:  # slices of one sample's rows
        sizes = [min(chunk_size, rows_per_sample - k) for _ in range(5)
                 for k in range(0, rows_per_sample, chunk_size)]
    elif batch:  # whole samples
        per_pass = (chunk_size // rows_per_sample) * rows_per_sample
        sizes = [min(per_pass, M - r) for r in range(0, M, per_pass)]
    else:
        sizes = [min(chunk_size, M - r) for r in range(0, M, chunk_size)]
    expected = [size for size in sizes for _ in widths]
    assert [rows for rows, _, _ in pushes] == expected
    for (rows, vjp_bytes, out_bytes), width in zip(pushes, widths * len(sizes), strict=True):
        assert rows <= chunk_size
        assert vjp_bytes == rows * width * itemsize  # c · P (c · P_l per leaf), never m · P
        assert out_bytes == rows * M * itemsize


@pytest.mark.parametrize(("budget_rows", "expected_rows"), [(3, 3), (0.5, 1), (100, M)],
                         ids=["three-rows", "less-than-one-row", "more-than-m"])
def test_memory_budget_sets_chunk(budget_rows: float, expected_rows: int) -> None:
    case = build("mlp_logits", torch.float64)
    num_params = sum(leaf.numel() for leaf in optree.tree_leaves(case.params))
    budget = int(budget_rows * num_params * 8)
    G, pushes = _pushes(case.f, case.args, memory_budget=budget)
    assert max(rows for rows, _, _ in pushes) == expected_rows
    assert_matches(G, dense_gramian(case.f, case.args).shaped())


# -- memory: measured peak -------------------------------------------------------------------

def _wide_mlp() -> tuple[Any, dict[str, Tensor], Tensor]:
    """P ≈ 8.5k parameters, m = 20 rows, tiny activations: Jacobian-like data dominates."""
    generator = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(64, 128, generator=generator, dtype=torch.float64),
              "b1": torch.randn(64, generator=generator, dtype=torch.float64),
              "w2": torch.randn(4, 64, generator=generator, dtype=torch.float64)}

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return torch.tanh(x @ p["w1"].T + p["b1"]) @ p["w2"].T

    return f, params, torch.randn(5, 128, generator=generator, dtype=torch.float64)


def _peak_bytes(fn: Any) -> int:
    """Peak of CPU bytes allocated while ``fn`` runs (profiler allocation events, in order)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage),
                    key=lambda e: e.time_range.start)
    live = peak = 0
    for event in events:
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "per_sample"])
def test_peak_memory_scales_with_chunk_size_not_rows(batch_dim: int | None) -> None:
    f, params, x = _wide_mlp()
    num_params = sum(p.numel() for p in params.values())
    num_rows = 20
    row_bytes = num_params * 8  # one row of the Jacobian

    def run(chunk: int) -> Tensor:
        return tg.gramian(f, backend="ntvp", chunk_size=chunk, batch_dim=batch_dim)(params, x)

    run(1)  # warm up lazy initialisations outside the measurement
    slack = 8 * num_rows**2 * 4 + 64 * 1024  # result buffers, activations, bookkeeping
    # per sample, the check of the samples' derivatives holds two gradients for a moment
    # (NOTE [per-sample]): a constant, whatever the chunk size and the number of rows
    check = 2 * row_bytes if batch_dim is not None else 0
    for chunk in (1, 2, 4):
        assert _peak_bytes(lambda chunk=chunk: run(chunk)) <= (1.5 * chunk * row_bytes + check
                                                               + slack)
    # The measurement does see Jacobian-sized data when it exists: all rows at once hold m·P.
    assert _peak_bytes(lambda: run(num_rows)) >= num_rows * row_bytes


# -- missing forward-mode AD -----------------------------------------------------------------

class CubeWithoutJvp(SavesInput):
    """x³ with a backward but no jvp."""

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return x**3

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return 3 * x**2 * grad


class CubeWithJvp(CubeWithoutJvp):
    """The same with a jvp."""

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor], output: Tensor) -> None:
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    def jvp(ctx: Any, tangent: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return 3 * x**2 * tangent


class CubeWithFailingJvp(CubeWithJvp):
    """A jvp that fails for its own reasons: the error must come through unchanged."""

    @staticmethod
    def jvp(ctx: Any, tangent: Tensor) -> Tensor:
        raise RuntimeError("boom from the user's jvp")


def _with_function(function: type[torch.autograd.Function]) -> Any:
    def f(w: Tensor, x: Tensor) -> Tensor:
        return function.apply(x @ w).sum(-1)

    return f


ARGS = (torch.randn(3, 2, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64))


@pytest.mark.parametrize("chunk_size", [1, None], ids=["loop", "vmap"])
def test_custom_function_without_jvp_is_named(chunk_size: int | None) -> None:
    f = _with_function(CubeWithoutJvp)
    with pytest.raises(NotImplementedError, match=r"(?s)torchgram.gramian: expected every "
                       r"operation of f to support forward-mode AD.*CubeWithoutJvp without a "
                       r"jvp staticmethod.*backend='jacobian' or backend='graph'"):
        tg.gramian(f, backend="ntvp", chunk_size=chunk_size)(*ARGS)
    # the suggested backend does work on it
    assert_matches(tg.gramian(f, backend="jacobian")(*ARGS), dense_gramian(f, ARGS).gramian)


def test_custom_function_with_jvp_works() -> None:
    f = _with_function(CubeWithJvp)
    assert_matches(tg.gramian(f, backend="ntvp", chunk_size=3)(*ARGS),
                   dense_gramian(f, ARGS).gramian)


def test_other_errors_pass_through_unchanged() -> None:
    with pytest.raises(RuntimeError, match="^boom from the user's jvp$"):
        tg.gramian(_with_function(CubeWithFailingJvp), backend="ntvp")(*ARGS)


@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "per_sample"])
def test_native_op_without_forward_ad_is_named(batch_dim: int | None) -> None:
    anchors = torch.randn(3, 2, dtype=torch.float64)

    def f(w: Tensor, x: Tensor) -> Tensor:
        return torch.cdist(x @ w, anchors).sum(-1)  # torch.cdist has no forward AD

    with pytest.raises(NotImplementedError, match=r"(?s)expected every operation of f to "
                       r"support forward-mode AD.*aten::_cdist_forward.*backend='jacobian'"):
        tg.gramian(f, backend="ntvp", batch_dim=batch_dim)(*ARGS)


def test_attention_uses_math_kernel_and_restores_flags() -> None:
    flags = (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.mem_efficient_sdp_enabled,
             torch.backends.cuda.math_sdp_enabled, torch.backends.cuda.cudnn_sdp_enabled)
    before = [flag() for flag in flags]
    case = build("transformer", torch.float64)
    G = tg.gramian(case.f, backend="ntvp", chunk_size=2)(*case.args)
    assert_matches(G, dense_gramian(case.f, case.args).shaped())
    assert [flag() for flag in flags] == before
    with pytest.raises(NotImplementedError):
        tg.gramian(_with_function(CubeWithoutJvp), backend="ntvp")(*ARGS)
    assert [flag() for flag in flags] == before


def test_first_forward_ad_call_raises_no_warning() -> None:
    """torch's lazy jvp set-up warns (torch.jit.script is deprecated): we keep it quiet."""
    code = ("import torch, torchgram as tg\n"
            "G = tg.gramian(lambda w, x: torch.tanh(x @ w), backend='ntvp')("
            "torch.randn(3, 2), torch.randn(4, 3))\n"
            "print(tuple(G.shape))\n")
    done = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(4, 2, 4, 2)"


# -- side effects ----------------------------------------------------------------------------

def test_user_tensors_and_flags_untouched() -> None:
    case = build("mlp", torch.float64)
    params = optree.tree_map(lambda p: p.clone().requires_grad_(), case.params)
    snapshot = [p.detach().clone() for p in optree.tree_leaves(params)]
    tg.gramian(case.f, backend="ntvp", chunk_size=2)(params, *case.inputs)
    for p, before in zip(optree.tree_leaves(params), snapshot, strict=True):
        assert p.requires_grad and p.is_leaf and p.grad is None
        assert torch.equal(p.detach(), before)


def test_forward_mode_failures_under_autocast_name_the_other_backends() -> None:
    """torch 2.13's forward mode under CPU autocast fails on a grouped strided conv after a
    batch norm in eval mode ("Input type (torch.FloatTensor) and weight type
    (CPUBFloat16Type) should be the same"), where the plain call runs: a raw error from ntvp
    before session 26. ntvp answers like jacobian, or declines naming it; auto answers."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4).eval(), torch.nn.ReLU(),
        torch.nn.Conv2d(4, 4, 3, stride=2, groups=2), torch.nn.Flatten(), torch.nn.Linear(16, 3))
    fn, params = tg.functionalize(model)
    params = {name: value.detach() for name, value in params.items()}
    x = torch.randn(4, 3, 6, 6)

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return torch.nn.functional.cross_entropy(fn(p, x).float(), torch.arange(4) % 3,
                                                 reduction="none")

    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = tg.gramian(f, backend="jacobian", batch_dim=0)(params, x)
        torch.testing.assert_close(tg.gramian(f, batch_dim=0)(params, x), expected,
                                   rtol=2e-2, atol=2e-2 * expected.abs().max().item())
        try:
            G = tg.gramian(f, backend="ntvp", batch_dim=0)(params, x)
        except tg.BackendCannotRun as error:
            assert "autocast" in str(error) and "backend='jacobian'" in str(error)
        else:
            torch.testing.assert_close(G, expected, rtol=2e-2,
                                       atol=2e-2 * expected.abs().max().item())


def test_forward_mode_failures_on_mixed_dtype_parameters_name_the_other_backends() -> None:
    """A float32 LayerNorm between bfloat16 layers (a common mixed-precision layout): torch
    2.13's forward mode gives the norm's output a float32 tangent, and the next bfloat16
    linear layer raises "expected m1 and m2 to have the same dtype", where the plain call
    runs. A raw error from ntvp before session 39; now a torchgram error naming the reverse
    backends, and auto answers."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16),
                                torch.nn.GELU(), torch.nn.Linear(16, 3))
    fn, params = tg.functionalize(model)
    params = {name: value.detach().float() if name.startswith("1.")
              else value.detach().to(torch.bfloat16) for name, value in params.items()}
    x, y = torch.randn(8, 6).to(torch.bfloat16), torch.arange(8) % 3

    def f(p: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        return torch.nn.functional.cross_entropy(fn(p, x).float(), y, reduction="none")

    expected = tg.gramian(f, backend="jacobian", batch_dim=0)(params, x, y)
    torch.testing.assert_close(tg.gramian(f, batch_dim=0)(params, x, y), expected,
                               rtol=2e-2, atol=2e-2 * expected.abs().max().item())
    with pytest.raises(tg.BackendCannotRun, match=r"several dtypes.*backend='jacobian'"):
        tg.gramian(f, backend="ntvp", batch_dim=0)(params, x, y)


@pytest.mark.parametrize("kernel", [False, True], ids=["gramian", "kernel"])
def test_a_call_inside_a_forward_mode_level_is_declined_by_name(kernel: bool) -> None:
    """torch nests no forward-mode levels: inside ``forward_ad.dual_level()`` ntvp raised
    torch's raw "Nested forward mode AD is not supported" (session 40); ``auto`` answers."""
    w = torch.randn(3, 4, dtype=torch.float64)
    x = torch.randn(5, 4, dtype=torch.float64)

    def f(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w.T)

    def call(backend: str) -> torch.Tensor:
        if kernel:
            return tg.ntk.empirical_ntk_fn(lambda w, x: f(w, x), trace_axes=(),
                                           backend=backend)(x, x[:2], w)
        return tg.gramian(f, backend=backend)(w, x)

    wanted = call("jacobian")
    with torch.autograd.forward_ad.dual_level():
        with pytest.raises(tg.BackendCannotRun, match="dual_level"):
            call("ntvp")
        torch.testing.assert_close(call("auto"), wanted, rtol=1e-10, atol=1e-12)


# -- non-finite forward-mode derivatives (NOTE [non-finite pushes]) ---------------------------

def _lp_pool_after_relu() -> tuple[Any, dict[str, Tensor], Tensor]:
    """``LPPool2d`` over windows of exact zeros (a closed ReLU on part of the image)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1), torch.nn.ReLU(),
                                torch.nn.LPPool2d(2, 2), torch.nn.Flatten(),
                                torch.nn.Linear(2, 1)).double()
    with torch.no_grad():
        model[0].bias.fill_(-10.0)
        model[0].weight.copy_(torch.tensor([1.0, -1.0], dtype=torch.float64).reshape(2, 1, 1, 1))
    fn, params = tg.functionalize(model)
    x = torch.randn(3, 1, 2, 2, dtype=torch.float64) * 8
    x[0] = 20.0  # sample 0: channel 0 open, channel 1 closed (its window is all zeros)
    return lambda p, x: fn(p, x)[:, 0], params, x


def _distance_beyond_a_radius() -> tuple[Any, dict[str, Tensor], Tensor]:
    """``sqrt(clamp_min(d² - r², 0))``, sample 0 on a centre (inside the radius)."""
    torch.manual_seed(0)
    params = {"w": torch.randn(2, 2, dtype=torch.float64),
              "c": torch.randn(3, 2, dtype=torch.float64)}
    x = torch.randn(3, 2, dtype=torch.float64)
    x[0] = torch.linalg.solve(params["w"].T, params["c"][0])

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        h = x @ p["w"]
        d2 = (h * h).sum(-1, keepdim=True) + (p["c"] * p["c"]).sum(-1) - 2 * h @ p["c"].T
        return (d2 - 0.25).clamp_min(0).sqrt()

    return f, params, x


SELECTED_ZEROS = {"lp-pool-after-relu": _lp_pool_after_relu,
                  "distance-beyond-a-radius": _distance_beyond_a_radius}


@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "per-sample"])
@pytest.mark.parametrize("case", list(SELECTED_ZEROS))
def test_forward_mode_nan_where_the_backward_selects_a_zero_declines(
        case: str, batch_dim: int | None) -> None:
    """Forward mode multiplies a selected zero by an infinite derivative (``0 · inf``) where the
    backward selects: ntvp's G held NaN where the oracle's is finite (session 53's hunt). Now
    ntvp declines naming the backends that can, and ``auto`` answers with the oracle's G."""
    f, params, x = SELECTED_ZEROS[case]()
    wanted = dense_gramian(f, (params, x)).shaped()
    assert bool(wanted.isfinite().all())
    with pytest.raises(tg.BackendCannotRun, match="non-finite entries of G") as caught:
        tg.gramian(f, backend="ntvp", batch_dim=batch_dim)(params, x)
    assert "backend='jacobian'" in str(caught.value)
    assert_matches(tg.gramian(f, batch_dim=batch_dim)(params, x), wanted)


@pytest.mark.parametrize("case", list(SELECTED_ZEROS))
def test_forward_mode_nan_in_a_cross_kernel_declines(case: str) -> None:
    """The same through ``empirical_ntk_fn``: a block whose forward pass meets the zero declines;
    where only side 2 holds it (reverse mode only there: the distance's sample 0; every
    sample of the pool has a closed channel), the block runs."""
    f, params, x = SELECTED_ZEROS[case]()
    other = x[1:].flip(0) * 1.5

    def g(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return f(p, x).reshape(x.shape[0], -1)

    ntvp = tg.ntk.empirical_ntk_fn(g, trace_axes=(), backend="ntvp")
    oracle = tg.ntk.empirical_ntk_fn(g, trace_axes=(), backend="jacobian")
    with pytest.raises(tg.BackendCannotRun, match="non-finite entries of G"):
        ntvp(x, other, params)
    if case == "distance-beyond-a-radius":
        assert_matches(ntvp(other, x, params), oracle(other, x, params))
    assert_matches(tg.ntk.empirical_ntk_fn(g, trace_axes=())(x, other, params),
                   oracle(x, other, params))


def test_a_non_finite_jacobian_is_not_declined() -> None:
    """Where the backward's own derivatives are not finite (sqrt at 0, nothing selected: the
    batch's backward spreads its NaN to every row), G is NaN for every backend, the oracle's
    included: ntvp returns it as they do."""
    params = {"w": torch.tensor([[1.0], [0.0]], dtype=torch.float64)}
    x = torch.tensor([[0.0, 1.0], [2.0, 1.0]], dtype=torch.float64)

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return (x @ p["w"]).sqrt()[:, 0]

    wanted = dense_gramian(f, (params, x)).shaped()
    actual = tg.gramian(f, backend="ntvp")(params, x)
    assert not bool(wanted.isfinite().any())
    assert not bool(actual.isfinite().any())


def test_a_tangent_torch_shapes_wrongly_is_a_refusal_naming_who_can() -> None:
    """``weight_norm(dim=None)`` (a 0-d ``g``): torch's forward-mode formula of
    ``_weight_norm`` gives its tangent another shape; a raw torch error until session 58."""
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(0)
    model = weight_norm(torch.nn.Linear(5, 4).double(), dim=None)
    fn, params = tg.functionalize(model)
    x = torch.randn(3, 5, dtype=torch.float64)

    def losses(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return fn(p, x).sin().sum(1)

    with pytest.raises(NotImplementedError, match="backend='jacobian' or backend='graph'"):
        tg.gramian(losses, backend="ntvp", batch_dim=0)(params, x)
    expected = tg.gramian(losses, backend="jacobian", batch_dim=0)(params, x)
    torch.testing.assert_close(tg.gramian(losses, batch_dim=0)(params, x), expected)


def test_a_channels_last_group_norm_is_a_refusal_auto_routes_around() -> None:
    """torch's forward mode of ``group_norm`` views a channels_last input its decomposition
    cannot: a raw "view size is not compatible" from ntvp, also through auto's NTK plan (a
    per-pixel output) until session 60."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 1), torch.nn.GroupNorm(2, 4)).double()
    fn, params = tg.functionalize(model)
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64).contiguous(
        memory_format=torch.channels_last)

    def pixels(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return fn(p, x).flatten(1).sin()

    with pytest.raises(NotImplementedError, match="backend='jacobian' or backend='graph'"):
        tg.gramian(pixels, backend="ntvp")(params, x)
    wanted = dense_gramian(pixels, (params, x)).shaped()
    for batch_dim in (None, 0):
        assert_matches(tg.gramian(pixels, batch_dim=batch_dim)(params, x), wanted)


def _first_layer(activation: Any) -> Any:
    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return (activation(x @ p["W1"] + p["b1"]) @ p["W2"]).squeeze(-1)
    return f


@pytest.mark.parametrize(("activation", "per_leaf"), [
    (lambda h: torch.log(torch.relu(h)), True),
    (lambda h: torch.where(h > 0, h.sqrt(), torch.zeros_like(h)), False),
], ids=["log-relu-per-leaf", "where-sqrt"])
def test_forward_mode_non_finite_entries_are_refused(activation: Any, per_leaf: bool) -> None:
    """NOTE [non-finite pushes], per leaf and both ways (session 58's hunt): a first-layer
    block NaN where the oracle's is finite (the next layer's rows NaN from one sample's -inf
    activation hid it), and a finite 0 where the oracle's rows are NaN."""
    generator = torch.Generator().manual_seed(0)
    params = {"W1": torch.rand(3, 5, generator=generator, dtype=torch.float64) + 0.1,
              "b1": torch.zeros(5, dtype=torch.float64),
              "W2": torch.randn(5, 1, generator=generator, dtype=torch.float64)}
    x = torch.rand(4, 3, generator=generator, dtype=torch.float64) + 0.1
    x[2] = 0.0  # sample 2's pre-activations are 0
    f = _first_layer(activation)
    with pytest.raises(NotImplementedError, match="backend='jacobian' or backend='graph'"):
        tg.gramian(f, backend="ntvp", per_leaf=per_leaf, batch_dim=0)(params, x)
    expected = tg.gramian(f, backend="jacobian", per_leaf=per_leaf, batch_dim=0)(params, x)
    got = tg.gramian(f, per_leaf=per_leaf, batch_dim=0)(params, x)  # auto
    for g, e in (zip(got.values(), expected.values(), strict=True) if per_leaf
                 else [(got, expected)]):
        torch.testing.assert_close(g, e, equal_nan=True)


class _DoubleWithoutJvp(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return 2 * x

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor], output: Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return 2 * grad


@pytest.mark.parametrize("batch_dim", [0, None], ids=["batch0", "nobatch"])
def test_a_vmapped_custom_function_without_jvp_is_declined(batch_dim: int | None) -> None:
    """torch.func.jvp's raw "flat_bdims must not be None" before session 59."""
    w, x = torch.randn(3, 2, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)

    def f(w: Tensor, x: Tensor) -> Tensor:
        return torch.vmap(lambda row: _DoubleWithoutJvp.apply(torch.tanh(row @ w)))(x).sum(1)

    with pytest.raises(tg.BackendCannotRun, match="jvp staticmethod"):
        tg.gramian(f, backend="ntvp", batch_dim=batch_dim)(w, x)
    torch.testing.assert_close(tg.gramian(f, batch_dim=batch_dim)(w, x),
                               dense_gramian(f, (w, x)).gramian, rtol=1e-10, atol=1e-12)
