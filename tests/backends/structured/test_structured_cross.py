"""The structured backend's cross kernels, every way forced (NOTE [structured cross kernels]).

The cost model picks ghost or materialize per leaf; here each side is computed with every
leaf that allows it in ghost form, then every leaf materialized, and the contraction between
the two sides is compared with the dense oracle: ghost pairs with positions and groups
(convolutions, sequences), index activations (embeddings), several uses of a leaf (tied and
reused weights, cross terms included), fallback leaves and whole-batch sides.
"""

from __future__ import annotations

from typing import Any

import optree
import pytest
import torch

import torchgram as tg
from reference import dense_cross_gramian, dense_cross_kernel, nt_layout
from torchgram._core.cross import PairSpec
from torchgram._core.options import Options
from torchgram._core.problem import build_problem
from torchgram.backends.structured import cross as structured_cross
from torchgram.backends.structured.cross import (
    _ghost_pairs_ok,
    compute_side,
    contract,
    derivative_check_cheaper,
)
from torchgram.backends.structured.plan import plan_problem
from torchgram.ntk._layout import make_spec, to_nt_layout
from zoo import NAMES, build

CASES = [name for name in NAMES if name not in ("pytree_output", "coupled_batch")]


def _problem(f: Any, params: Any, x: Any, batch_dim: int | None, in_dims: Any) -> Any:
    options = Options.validate("test", f, 0, batch_dim=batch_dim, in_dims=in_dims)
    return build_problem(options, f, (params, x), {})


@pytest.mark.parametrize("forced", ["ghost", "materialize"])
@pytest.mark.parametrize("name", CASES)
def test_every_way_between_two_sides_matches_the_oracle(name: str, forced: str) -> None:
    case = build(name)

    def f(params: Any, xs: tuple[Any, ...]) -> torch.Tensor:
        return case.f(params, *xs)

    dim = 1 if case.batch_dim == 1 else 0

    def take(start: int, stop: int) -> Any:
        return optree.tree_map(lambda t: t.narrow(dim, start, stop - start)
                               if isinstance(t, torch.Tensor) else t, case.inputs)

    x1, x2 = take(0, 3), take(3, 5)
    grams = {id(x): dense_cross_gramian(f, case.params, x1, x) for x in (None, x2)}
    left = _problem(f, case.params, x1, case.batch_dim, case.in_dims)
    right = _problem(f, case.params, x2, case.batch_dim, case.in_dims)
    plan = plan_problem(left)
    ways = {p.leaf: ("unused" if p.way == "unused" else
                     forced if forced == "materialize" or _ghost_pairs_ok(p) else "materialize")
            for p in plan.leaves}
    shape1, shape2 = tuple(left.output.shapes[0]), tuple(right.output.shapes[0])
    batch_axis = left.output.batch_dims[0] if left.output.batch_dims else None
    trace = ((0,) if batch_axis == 1 else (-1,)) if len(shape1) > 1 else ()
    for trace_axes in {(), trace}:
        spec: PairSpec = make_spec("test", trace_axes, (), shape1, shape2, batch_axis)
        side1, side2 = compute_side(left, ways), compute_side(right, ways)
        for second, other in ((None, None), (x2, side2)):
            block = contract(side1, other, spec, torch.float64)
            kernel = to_nt_layout(block, spec, shape1, shape1 if second is None else shape2)
            expected = nt_layout(grams[id(second)], trace_axes)
            torch.testing.assert_close(kernel, expected, rtol=1e-10,
                                       atol=1e-10 * expected.abs().max().item())


def test_the_cheaper_check_is_chosen_from_the_forward_cost() -> None:
    assert derivative_check_cheaper(1e6, 16)  # small batches: two more directions
    assert not derivative_check_cheaper(1e9, 512)  # large ones: one more evaluation
    assert not derivative_check_cheaper(1e6, 1)  # one sample: nothing to check


def _conv1d_like(p: Any, x: torch.Tensor) -> torch.Tensor:
    """GPT-2's ``Conv1D``: the tokens of every sample merged into one dim, then ``addmm``."""
    b, t, d = x.shape
    y = torch.addmm(p["b"], x.reshape(-1, d), p["w"]).reshape(b, t, -1)
    return torch.tanh(y).sum((1, 2))


def _interleaved(p: Any, x: torch.Tensor) -> torch.Tensor:
    """Samples merged token-major (interleaved): the batched way must not read it per sample."""
    b, t, d = x.shape
    y = torch.addmm(p["b"], x.transpose(0, 1).reshape(-1, d), p["w"])
    return torch.tanh(y.reshape(t, b, -1).transpose(0, 1)).sum((1, 2))


@pytest.mark.parametrize("f", [_conv1d_like, _interleaved], ids=["merged", "interleaved"])
def test_sides_with_merged_sample_dims_match_the_oracle(f: Any) -> None:
    torch.manual_seed(0)
    params = {"w": torch.randn(4, 3, dtype=torch.float64),
              "b": torch.randn(3, dtype=torch.float64)}
    x1, x2 = torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(2, 5, 4, dtype=torch.float64)
    left, right = _problem(f, params, x1, 0, 0), _problem(f, params, x2, 0, 0)
    spec: PairSpec = make_spec("test", (), (), (3,), (2,), 0)
    side1 = compute_side(left)
    side2 = compute_side(right, side1.ways)
    for second, other in ((None, None), (x2, side2)):
        block = contract(side1, other, spec, torch.float64)
        kernel = to_nt_layout(block, spec, (3,), (3,) if second is None else (2,))
        expected = nt_layout(dense_cross_gramian(f, params, x1, second), ())
        torch.testing.assert_close(kernel, expected, rtol=1e-10,
                                   atol=1e-10 * expected.abs().max().item())


STREAMED_AXES = {"full": ((), ()), "traced": ((-1,), ()), "diagonal rows": ((), (-1,)),
                 "diagonal batch": ((), (0,))}




def _streamable(name: str) -> bool:
    """Samples along dim 0 of inputs and output, and a sample's rows along one axis."""
    case = build(name)
    if case.batch_dim != 0 or case.in_dims not in (0, None):
        return False
    out = case.f(case.params, *case.inputs)
    return isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[1] > 1


STREAMABLE = [name for name in CASES if _streamable(name)]


@pytest.mark.parametrize("axes", list(STREAMED_AXES), ids=list(STREAMED_AXES))
@pytest.mark.parametrize("name", STREAMABLE)
def test_streamed_right_sides_match_the_oracle(name: str, axes: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The larger side's backwards one direction at a time, each contracted at once."""
    case = build(name)

    def f(params: Any, xs: tuple[Any, ...]) -> torch.Tensor:
        return case.f(params, *xs)

    def take(start: int, stop: int) -> Any:
        return optree.tree_map(lambda t: t[start:stop] if isinstance(t, torch.Tensor) else t,
                               case.inputs)

    # the larger side is streamed: x1 (3 samples against 2), then x2 (2 against 3)
    pairs = ([(take(0, 3), take(0, 3))] if axes == "diagonal batch" else
             [(take(0, 3), take(3, 5)), (take(0, 2), take(2, 5))])
    trace_axes, diagonal_axes = STREAMED_AXES[axes]
    rows = f(case.params, pairs[0][0]).shape[1:]
    chunks: list[Any] = []
    take_rows = structured_cross._take_rows
    monkeypatch.setattr(structured_cross, "STREAM_PASS_BYTES", 1)  # one direction per pass
    monkeypatch.setattr(structured_cross, "_take_rows",
                        lambda *a: chunks.append(a[1:]) or take_rows(*a))
    chunked_blocks: list[Any] = []
    contract_block = structured_cross.contract
    monkeypatch.setattr(structured_cross, "contract",
                        lambda *a: chunked_blocks.append(a[1].row_shape) or contract_block(*a))
    ntk_fn = tg.ntk.empirical_ntk_fn(f, trace_axes=trace_axes, diagonal_axes=diagonal_axes,
                                     backend="structured")
    for x1, x2 in pairs:
        chunks.clear()
        chunked_blocks.clear()
        kernel = ntk_fn(x1, x2, case.params)
        expected = dense_cross_kernel(f, case.params, x1, x2, trace_axes, diagonal_axes)
        torch.testing.assert_close(kernel, expected.to(kernel.dtype), rtol=1e-10,
                                   atol=1e-10 * expected.abs().max().item())
        assert len(chunked_blocks) == rows[0]  # one contraction per direction: streamed
        rows_free = axes in ("full", "diagonal batch")  # x1 keeps its rows for each chunk
        assert chunks == ([] if rows_free else [(k, k + 1) for k in range(rows[0])])


def test_a_streamed_side_whose_samples_interact_gets_the_whole_batch_rows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Interacting samples of x2 are found before any chunk is contracted: no streaming."""
    torch.manual_seed(0)
    weight = torch.randn(3, 4, dtype=torch.float64)

    def f(params: Any, x: torch.Tensor) -> torch.Tensor:
        h = x @ params["w"]
        return torch.tanh(h - h.mean(0))  # every sample's output sees the batch mean

    monkeypatch.setattr(structured_cross, "STREAM_PASS_BYTES", 1)
    x1, x2 = torch.randn(3, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    for trace_axes in ((), (-1,)):
        ntk_fn = tg.ntk.empirical_ntk_fn(f, trace_axes=trace_axes, backend="structured")
        kernel = ntk_fn(x1, x2, {"w": weight})
        expected = dense_cross_kernel(f, {"w": weight}, x1, x2, trace_axes)
        torch.testing.assert_close(kernel, expected, rtol=1e-10, atol=1e-12)


def test_a_cross_kernel_of_offset_inputs_keeps_float32_accuracy() -> None:
    """NOTE [centered positions] in the cross kernels' ghost pairs: 4.5 off (relative) in
    float32 for inputs 10 + 0.01 noise whose cotangents cancel over the positions, where
    float32 jacrev is 6e-5 off (session 67)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(512, 512, generator=generator, dtype=torch.float64) / 22
    x1 = 10 + 0.01 * torch.randn(16, 2, 512, generator=generator, dtype=torch.float64)
    x2 = 10 + 0.01 * torch.randn(12, 2, 512, generator=generator, dtype=torch.float64)
    g = torch.randn(2, 512, generator=generator, dtype=torch.float64)
    g = g - g.mean(0)

    def f(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return ((x @ p["W"].T) * g.to(x.dtype)).sum((1, 2))[:, None]

    def jacobian(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.jacrev(f)(p, x)["W"].reshape(x.shape[0], -1)

    exact = jacobian({"W": weight}, x1) @ jacobian({"W": weight}, x2).T
    kernel = tg.ntk.empirical_ntk_fn(f, trace_axes=(), backend="structured")(
        x1.float(), x2.float(), {"W": weight.float()})
    error = (kernel.double().reshape(16, 12) - exact).abs().max() / exact.abs().max()
    assert error < 2e-4, error  # float32 jacrev: 5.8e-5


def _branching(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Each sample through ``b`` only where its first input is positive."""
    rows = []
    for sample in range(x.shape[0]):
        h = torch.tanh(x[sample] @ p["a"].T)
        if x[sample, 0] > 0:
            h = torch.tanh(h @ p["b"].T)
        rows.append(h.sum())
    return torch.stack(rows)


@pytest.mark.parametrize("backend", ["structured", "auto"])
def test_a_cross_kernel_whose_samples_take_other_paths(backend: str) -> None:
    """A first input set whose later samples use a leaf its first sample skips (an early exit,
    a route through other experts): the leaf's pieces came out zero, the kernel 1.0 off
    (session 67's hunt). Such a side now takes the rows of the whole batch."""
    torch.manual_seed(0)
    params = {"a": torch.randn(3, 3, dtype=torch.float64),
              "b": torch.randn(3, 3, dtype=torch.float64)}
    x1 = torch.randn(3, 3, dtype=torch.float64)
    x1[0, 0], x1[1:, 0] = -1.0, 1.0
    x2 = torch.randn(2, 3, dtype=torch.float64)
    x2[:, 0] = 1.0

    def jacobian(x: torch.Tensor) -> torch.Tensor:
        leaves = torch.func.jacrev(_branching)(params, x)
        return torch.cat([leaves[k].reshape(x.shape[0], -1) for k in sorted(leaves)], 1)

    kernel = tg.ntk.empirical_ntk_fn(_branching, trace_axes=(), backend=backend)(x1, x2, params)
    torch.testing.assert_close(kernel, jacobian(x1) @ jacobian(x2).T, rtol=1e-10, atol=1e-12)
