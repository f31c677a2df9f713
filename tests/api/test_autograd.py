"""``torchgram.autograd.gramian``: the graph walk on eager code, against the dense oracle.

Every Gramian here is compared with ``reference.dense_gramian`` of the same computation
written as a pure function, so paths that meet (``a + a``, diamonds, reuse), non-leaf
inputs and custom Functions are all checked for exactness, not only for shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import torchgram as tg
from custom_functions import NumpySquare
from reference import dense_gramian
from torchgram._core.result import RunReport
from torchgram._core.sink import LeafBlocks
from torchgram.backends.graph import graph_gramian
from zoo import NAMES, build

DOUBLE = torch.float64


def assert_matches(actual: Tensor, expected: Tensor) -> None:
    assert actual.shape == expected.shape
    scale = expected.abs().max().clamp_min(1.0)
    torch.testing.assert_close(actual / scale, expected.to(actual.dtype) / scale,
                               rtol=1e-10, atol=1e-10)


def leaves_like(*tensors: Tensor) -> list[Tensor]:
    """Fresh leaves that require grad, with the values of ``tensors``."""
    return [t.detach().clone().requires_grad_() for t in tensors]


def oracle(f: Callable[..., Tensor], params: list[Tensor], *inputs: Any) -> Tensor:
    """Dense ``S + S`` Gramian of ``f(params, *inputs)`` w.r.t. all of ``params``."""
    return dense_gramian(f, (leaves_like(*params), *inputs)).shaped()


# -- paths that meet --------------------------------------------------------------------------


def test_a_plus_a_is_four_times_not_twice() -> None:
    a = torch.randn(3, dtype=DOUBLE, requires_grad=True)
    out = (a + a).sin()
    G = tg.autograd.gramian(out, a)
    J = torch.diag(2 * (2 * a.detach()).cos())
    assert_matches(G, J @ J.T)


def diamond(p: list[Tensor], x: Tensor) -> Tensor:
    h = torch.tanh(x @ p[0])
    return (h.sin() * h.cos() + h.exp()) @ p[1]  # h reaches the output along three paths


def two_branches(p: list[Tensor], x: Tensor) -> Tensor:
    h = x @ p[0]
    left, right = torch.relu(h) @ p[1], torch.sigmoid(h) @ p[2]  # h reused in two branches
    return torch.cat([left, right], dim=1) + left.sum(1, keepdim=True)


def module_twice(p: list[Tensor], x: Tensor) -> Tensor:
    h = F.linear(torch.tanh(F.linear(x, p[0], p[1])), p[0], p[1])  # one layer called twice
    return (h * p[2]).sum(1)


GRAPHS = {
    "diamond": (diamond, [(3, 4), (4, 2)]),
    "two_branches": (two_branches, [(3, 4), (4, 2), (4, 2)]),
    "module_twice": (module_twice, [(3, 3), (3,), (3,)]),
}


@pytest.mark.parametrize("name", list(GRAPHS))
@pytest.mark.parametrize("chunk_size", [None, 1, 4], ids=lambda c: f"chunk{c}")
def test_joins_match_oracle(name: str, chunk_size: int | None) -> None:
    f, shapes = GRAPHS[name]
    params = [torch.randn(s, dtype=DOUBLE) for s in shapes]
    x = torch.randn(5, 3, dtype=DOUBLE)
    leaves = leaves_like(*params)
    G = tg.autograd.gramian(f(leaves, x), leaves, chunk_size=chunk_size)
    assert_matches(G, oracle(f, params, x))


def test_per_input_blocks_sum_to_gramian_and_match_oracle() -> None:
    params = [torch.randn(3, 4, dtype=DOUBLE), torch.randn(4, 2, dtype=DOUBLE)]
    x = torch.randn(5, 3, dtype=DOUBLE)
    leaves = leaves_like(*params)
    out = diamond(leaves, x)
    blocks = tg.autograd.gramian(out, leaves, per_input=True)
    dense = dense_gramian(diamond, (leaves_like(*params), x))
    assert isinstance(blocks, tuple) and len(blocks) == 2
    for block, expected in zip(blocks, dense.blocks, strict=True):
        assert_matches(block, dense.shaped(expected))
    assert_matches(blocks[0] + blocks[1], tg.autograd.gramian(out, leaves))


# -- inputs: non-leaf, unreached, duplicated, complex -----------------------------------------


def test_non_leaf_input_is_the_cotangent_at_its_node() -> None:
    w1, w2 = torch.randn(3, 4, dtype=DOUBLE), torch.randn(4, 2, dtype=DOUBLE)
    x = torch.randn(5, 3, dtype=DOUBLE)
    leaf1, leaf2 = leaves_like(w1, w2)
    h = torch.tanh(x @ leaf1)
    out = (h.sin() + h) @ leaf2
    h_block, w1_block = tg.autograd.gramian(out, [h, leaf1], per_input=True)
    h_value = torch.tanh(x @ w1)
    assert_matches(h_block, oracle(lambda p, w: (p[0].sin() + p[0]) @ w, [h_value], w2))
    # the leaf behind h still gets its full Jacobian, through h
    assert_matches(w1_block, oracle(lambda p, w: (torch.tanh(x @ p[0]).sin()
                                                   + torch.tanh(x @ p[0])) @ w, [w1], w2))


def test_non_leaf_input_at_a_second_output_of_its_node() -> None:
    w = torch.randn(3, 4, dtype=DOUBLE)
    x = torch.randn(5, 3, dtype=DOUBLE)
    (leaf,) = leaves_like(w)
    first, second = (x @ leaf).chunk(2, dim=1)  # one SplitBackward0, output_nr 0 and 1
    assert second.grad_fn is first.grad_fn and second.output_nr == 1
    out = (first * second.exp()).sum(1)
    G = tg.autograd.gramian(out, second)
    value_first, value_second = (x @ w).chunk(2, dim=1)
    assert_matches(G, oracle(lambda p, a: (a * p[0].exp()).sum(1), [value_second], value_first))


def test_unreached_inputs_give_zero_blocks() -> None:
    w, unused = leaves_like(torch.randn(3, 2, dtype=DOUBLE), torch.randn(4, dtype=DOUBLE))
    out = torch.tanh(torch.randn(5, 3, dtype=DOUBLE) @ w).sum(1)
    after = out * 2  # computed from the output: the output does not depend on it
    blocks = tg.autograd.gramian(out, [unused, w, after], per_input=True)
    assert torch.equal(blocks[0], torch.zeros(5, 5, dtype=DOUBLE))
    assert torch.equal(blocks[2], torch.zeros(5, 5, dtype=DOUBLE))
    assert_matches(blocks[1], tg.autograd.gramian(out, w))


def test_duplicated_input_gets_a_block_each_time() -> None:
    (w,) = leaves_like(torch.randn(3, 2, dtype=DOUBLE))
    out = torch.tanh(torch.randn(4, 3, dtype=DOUBLE) @ w).sum(1)
    first, second = tg.autograd.gramian(out, [w, w], per_input=True)
    assert_matches(first, second)
    assert_matches(tg.autograd.gramian(out, [w, w]), 2 * first)


def test_output_as_input_gives_identity_and_outputs_may_depend_on_each_other() -> None:
    (w,) = leaves_like(torch.randn(3, dtype=DOUBLE))
    h = w.sin()
    out = h.exp()
    assert_matches(tg.autograd.gramian(h, h), torch.eye(3, dtype=DOUBLE))
    assert_matches(tg.autograd.gramian(w, w), torch.eye(3, dtype=DOUBLE))  # a leaf output
    J = torch.cat([torch.diag(w.detach().cos()), torch.diag(w.detach().sin().exp()
                                                             * w.detach().cos())])
    assert_matches(tg.autograd.gramian([h, out], w), J @ J.T)  # out's graph passes through h


def test_complex_input_counts_real_and_imaginary_parts() -> None:
    real, imag = leaves_like(torch.randn(3, dtype=DOUBLE), torch.randn(3, dtype=DOUBLE))
    x = torch.randn(4, 3, dtype=torch.complex128)
    (z,) = leaves_like(torch.complex(real, imag))
    expected = tg.autograd.gramian((x @ torch.complex(real, imag)).abs(), [real, imag])
    assert_matches(tg.autograd.gramian((x @ z).abs(), z), expected)


@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "batch0"])
def test_a_complex_input_used_through_its_conjugate(batch_dim: int | None) -> None:
    """``x * w.conj()``: the walk's row-Jacobian of ``w`` is a lazily conjugated tensor,
    which ``view_as_real`` refused (torch's raw error, session 60's hunt)."""
    real, imag = leaves_like(torch.randn(3, dtype=DOUBLE), torch.randn(3, dtype=DOUBLE))
    x = torch.randn(4, 3, dtype=torch.complex128)
    (z,) = leaves_like(torch.complex(real, imag))
    expected = tg.autograd.gramian((x * torch.complex(real, imag).conj()).sum(1).abs(),
                                   [real, imag], batch_dim=batch_dim)
    assert_matches(tg.autograd.gramian((x * z.conj()).sum(1).abs(), z, batch_dim=batch_dim),
                   expected)


def test_a_float8_input_is_a_clear_error() -> None:
    """Torch's raw "Promotion for Float8 Types is not supported" before (session 60's hunt)."""
    scale = torch.ones(3).to(torch.float8_e4m3fn).requires_grad_()
    w = torch.randn(3, requires_grad=True)
    losses = torch.randn(4, 3) @ (w * scale.float())
    with pytest.raises(TypeError, match=r"inputs of 16 bits or more, but got inputs\[1\]"):
        tg.autograd.gramian(losses, [w, scale])


# -- custom autograd.Function -----------------------------------------------------------------


class Cube(torch.autograd.Function):
    """Torch ops only in backward: works under vmap. A non-tensor and a constant input."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, power: int, offset: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        ctx.power = power
        return x**power + offset

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        return grad * ctx.power * x ** (ctx.power - 1), None, grad




class SplitHalves(torch.autograd.Function):
    """Two outputs; when only one is used, the other's cotangent is materialized as zeros."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(x)
        return x[..., :2].exp(), x[..., 2:].sin()

    @staticmethod
    def backward(ctx: Any, grad_a: Tensor, grad_b: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return torch.cat([grad_a * x[..., :2].exp(), grad_b * x[..., 2:].cos()], dim=-1)


def custom_model(p: list[Tensor], x: Tensor, function: str) -> Tensor:
    h = x @ p[0]
    if function == "Cube":
        h = Cube.apply(h, 3, torch.ones(4, dtype=h.dtype))  # offset does not require grad
    elif function == "NumpySquare":
        h = NumpySquare.apply(h)
    else:
        h = SplitHalves.apply(h)[0].repeat(1, 2)
    return torch.tanh(h) @ p[1]


def reference_model(p: list[Tensor], x: Tensor, function: str) -> Tensor:
    h = x @ p[0]
    if function == "Cube":
        h = h**3 + 1
    elif function == "NumpySquare":
        h = h**2
    else:
        h = h[..., :2].exp().repeat(1, 2)
    return torch.tanh(h) @ p[1]


class MixWhenAsked(torch.autograd.Function):
    """Mixes each sample with the one before by ``ctx.switch``, a plain value its backward
    branches on in Python (shortcut: nothing to mix where it is ``None`` or 0)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, switch: Any) -> Tensor:
        ctx.switch = switch
        return x + (0.0 if _off(switch) else 0.7) * x.roll(1, 0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        if _off(ctx.switch):
            return grad, None
        return grad + 0.7 * grad.roll(-1, 0), None


def _off(switch: Any) -> bool:
    return switch is None or switch == 0.0 or switch == [0.0]


@pytest.mark.parametrize("switches", [(0.0, 0.7), (None, 0.7), ([0.0], [0.7])],
                         ids=["float", "none", "list"])
def test_a_custom_backward_branching_on_a_plain_value_is_followed_on_later_calls(
        switches: tuple[Any, Any]) -> None:
    """The same graph signature, other ctx values: the first call's sample layout (no
    mixing) must not be reused where the backward mixes samples (0.21 off before session
    57, whose routing digest held a ctx's ints and strings only)."""
    torch.manual_seed(0)
    params = [torch.randn(3, 5, dtype=DOUBLE), torch.randn(5, 2, dtype=DOUBLE)]
    for switch in (*switches, switches[1]):
        x = torch.randn(4, 3, dtype=DOUBLE)
        leaves = leaves_like(*params)
        out = (MixWhenAsked.apply(torch.tanh(x @ leaves[0]), switch) @ leaves[1]).pow(2).sum(1)
        rows = [torch.cat([g.reshape(-1) for g in torch.autograd.grad(row, leaves,
                                                                      retain_graph=True)])
                for row in out]
        jacobian = torch.stack(rows)
        assert_matches(tg.autograd.gramian(out, leaves, batch_dim=0), jacobian @ jacobian.T)


@pytest.mark.parametrize("function", ["Cube", "NumpySquare", "SplitHalves"])
@pytest.mark.parametrize("chunk_size", [None, 1], ids=lambda c: f"chunk{c}")
def test_custom_function_matches_oracle(function: str, chunk_size: int | None) -> None:
    params = [0.5 * torch.randn(3, 4, dtype=DOUBLE), torch.randn(4, 2, dtype=DOUBLE)]
    x = torch.randn(5, 3, dtype=DOUBLE)
    leaves = leaves_like(*params)
    G = tg.autograd.gramian(custom_model(leaves, x, function), leaves, chunk_size=chunk_size)
    assert_matches(G, oracle(lambda p, x: reference_model(p, x, function), params, x))


def test_node_vmap_cannot_handle_falls_back_to_a_row_loop_once_per_type() -> None:
    params = leaves_like(torch.randn(3, 4, dtype=DOUBLE), torch.randn(4, 2, dtype=DOUBLE))
    x = torch.randn(5, 3, dtype=DOUBLE)
    h = NumpySquare.apply(NumpySquare.apply(x @ params[0]))  # two nodes of the same type
    out = torch.tanh(h) @ params[1]
    blocks = LeafBlocks(2, per_leaf=False, diagonal=False)
    report = RunReport("graph")
    graph_gramian("test", [out.reshape(-1)], params, blocks, chunk_size=None, diagonal=False,
                  report=report)
    assert report.looped_nodes == {"NumpySquareBackward": 1}  # the second went to the loop
    expected = oracle(lambda p, x: torch.tanh((x @ p[0]) ** 4) @ p[1], params, x)
    assert_matches(blocks.blocks()[0].reshape(expected.shape), expected)


def test_non_reentrant_checkpoint_works_and_reentrant_is_refused() -> None:
    model, x, y = eager_mlp()
    fn, params = tg.functionalize(model)
    expected = dense_gramian(lambda p: fn(p, x).sum(1), (params,)).shaped()
    out = checkpoint(model, x, use_reentrant=False).sum(1)  # recomputes on saved-tensor access
    assert_matches(tg.autograd.gramian(out, list(model.parameters())), expected)
    out = checkpoint(model, x.clone().requires_grad_(), use_reentrant=True).sum(1)
    with pytest.raises(ValueError, match=r"expected a graph without reentrant checkpoints, .* "
                       r"use_reentrant=False"):
        tg.autograd.gramian(out, list(model.parameters()))
    assert all(p.grad is None for p in model.parameters())


# -- the user's graph is left as it was --------------------------------------------------------


def eager_mlp() -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(DOUBLE)
    x, y = torch.randn(5, 4, dtype=DOUBLE), torch.randint(0, 3, (5,))
    return model, x, y


def test_readme_example_and_backward_afterwards() -> None:
    model, x, y = eager_mlp()
    losses = F.cross_entropy(model(x), y, reduction="none")
    G = tg.autograd.gramian(losses, model.parameters())  # a generator works too
    fn, params = tg.functionalize(model)
    assert_matches(G, dense_gramian(lambda p: F.cross_entropy(fn(p, x), y, reduction="none"),
                                    (params,)).shaped())
    weights = torch.linspace(0.1, 1.0, 5, dtype=DOUBLE)
    losses.backward(weights)  # retain_graph=True (default): the graph is intact
    expected = torch.autograd.grad((F.cross_entropy(model(x), y, reduction="none")
                                    * weights).sum(), list(model.parameters()))
    for p, g in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, g)


def test_grad_fields_and_hooks_are_untouched() -> None:
    model, x, y = eager_mlp()
    fired: list[str] = []
    model[0].weight.grad = torch.full_like(model[0].weight, 7.0)
    previous_grad = model[0].weight.grad
    model[0].weight.register_hook(lambda g: fired.append("leaf hook"))
    model[2].register_full_backward_hook(lambda *a: fired.append("module hook"))
    hidden = model[1](model[0](x))
    hidden.retain_grad()
    hidden.register_hook(lambda g: fired.append("tensor hook"))
    losses = F.cross_entropy(model[2](hidden), y, reduction="none")
    losses.grad_fn.register_hook(lambda *a: fired.append("node hook"))
    losses.grad_fn.register_prehook(lambda *a: fired.append("node prehook"))
    flags = [p.requires_grad for p in model.parameters()]

    tg.autograd.gramian(losses, list(model.parameters()), chunk_size=2)

    assert fired == []
    assert hidden.grad is None
    assert model[0].weight.grad is previous_grad and bool((previous_grad == 7).all())
    assert all(p.grad is None for p in list(model.parameters())[1:])
    assert [p.requires_grad for p in model.parameters()] == flags
    losses.sum().backward()  # and the hooks still work afterwards
    assert {"leaf hook", "module hook", "tensor hook", "node hook", "node prehook"} <= set(fired)


def test_retain_graph_false_frees_the_graph_without_writing_grad() -> None:
    model, x, y = eager_mlp()
    losses = F.cross_entropy(model(x), y, reduction="none")
    G = tg.autograd.gramian(losses, list(model.parameters()), retain_graph=False)
    assert G.shape == (5, 5)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        losses.sum().backward()


def test_freed_graph_is_a_clear_error() -> None:
    model, x, y = eager_mlp()
    losses = F.cross_entropy(model(x), y, reduction="none")
    losses.sum().backward()
    with pytest.raises(RuntimeError, match=r"torchgram.autograd.gramian: expected a graph whose "
                       r"saved tensors are still alive, .* Pass retain_graph=True"):
        tg.autograd.gramian(losses, list(model.parameters()))


# -- result layout --------------------------------------------------------------------------


def test_shapes_dtypes_diagonal_and_chunked_diagonal() -> None:
    w = torch.randn(3, 2, requires_grad=True)
    v = torch.randn(2, dtype=DOUBLE, requires_grad=True)
    out = torch.tanh(torch.randn(4, 3) @ w)  # [4, 2] float32
    score = out.double() @ v  # [4] float64
    assert tg.autograd.gramian(out, w).shape == (4, 2, 4, 2)
    assert tg.autograd.gramian(out, w, diagonal=True).shape == (4, 2)
    G = tg.autograd.gramian([out, score], [w, v])
    assert G.shape == (12, 12) and G.dtype == DOUBLE
    full = tg.autograd.gramian([out, score], [w, v], diagonal=True)
    for chunk_size in (1, 5, 12, 50):
        chunked = tg.autograd.gramian([out, score], [w, v], diagonal=True, chunk_size=chunk_size)
        torch.testing.assert_close(chunked, full)
    torch.testing.assert_close(full, G.diagonal())
    empty = tg.autograd.gramian(out[:0], w)
    assert empty.shape == (0, 2, 0, 2)


@pytest.mark.parametrize("name", NAMES)
def test_zoo_models_match_oracle_through_the_imperative_api(name: str) -> None:
    case = build(name, DOUBLE)
    flat, spec = optree.tree_flatten(case.params)
    positions = [i for i, leaf in enumerate(flat)
                 if isinstance(leaf, Tensor) and leaf.is_floating_point()]
    leaves = leaves_like(*(flat[i] for i in positions))
    for i, leaf in zip(positions, leaves, strict=True):
        flat[i] = leaf
    out = case.f(optree.tree_unflatten(spec, flat), *case.inputs)
    G = tg.autograd.gramian(optree.tree_leaves(out), leaves)
    expected = dense_gramian(case.f, case.args).gramian
    assert_matches(G, expected)


# -- bad inputs --------------------------------------------------------------------------------


def bad_calls() -> list[Any]:
    w = torch.randn(3, requires_grad=True)
    out = w.sin()
    frozen = torch.randn(3)
    return [
        pytest.param(dict(outputs=out.detach(), inputs=w), ValueError,
                     r"expected outputs that require grad, but got outputs\[0\] of shape \(3,\) "
                     r"with requires_grad=False", id="output-not-requiring-grad"),
        pytest.param(dict(outputs=[out, frozen], inputs=w), ValueError,
                     r"outputs\[1\] of shape \(3,\) with requires_grad=False",
                     id="second-output-not-requiring-grad"),
        pytest.param(dict(outputs=3.0, inputs=w), TypeError,
                     r"expected outputs to be a tensor or a sequence of tensors, but got float",
                     id="output-number"),
        pytest.param(dict(outputs=[out, "loss"], inputs=w), TypeError,
                     r"outputs\[1\] of type str", id="output-list-with-string"),
        pytest.param(dict(outputs=[], inputs=w), ValueError,
                     r"expected at least one tensor in outputs, but got an empty sequence",
                     id="no-outputs"),
        pytest.param(dict(outputs=torch.complex(out, out), inputs=w), TypeError,
                     r"expected real floating outputs, .* torch.view_as_real", id="complex-output"),
        pytest.param(dict(outputs=out, inputs=[w, None]), TypeError,
                     r"expected inputs to be a tensor or a sequence of tensors, but got "
                     r"inputs\[1\] of type NoneType", id="input-none"),
        pytest.param(dict(outputs=out, inputs={"w": w}), TypeError,
                     r"but got dict .* e.g. inputs=list\(model.parameters\(\)\)",
                     id="input-dict"),
        pytest.param(dict(outputs=out, inputs=[]), ValueError,
                     r"expected at least one tensor in inputs", id="no-inputs"),
        pytest.param(dict(outputs=out, inputs=[w, frozen]), ValueError,
                     r"expected inputs that require grad, but got inputs\[1\] of shape \(3,\) "
                     r"with requires_grad=False. .*if p.requires_grad", id="frozen-input"),
        pytest.param(dict(outputs=out, inputs=w, chunk_size=0), ValueError,
                     r"expected chunk_size to be a positive int, but got 0", id="chunk-zero"),
        pytest.param(dict(outputs=out, inputs=w, chunk_size=2.0), TypeError,
                     r"chunk_size to be None or a positive int", id="chunk-float"),
        pytest.param(dict(outputs=out, inputs=w, retain_graph=None), TypeError,
                     r"expected retain_graph to be True or False", id="retain-graph-none"),
        pytest.param(dict(outputs=out, inputs=w, diagonal="yes"), TypeError,
                     r"expected diagonal to be True or False", id="diagonal-string"),
        pytest.param(dict(outputs=out, inputs=w, per_input=1), TypeError,
                     r"expected per_input to be True or False", id="per-input-int"),
    ]


@pytest.mark.parametrize(("kwargs", "error", "message"), bad_calls())
def test_bad_inputs_are_clear_errors(kwargs: dict[str, Any], error: type[Exception],
                                     message: str) -> None:
    with pytest.raises(error, match=r"^torchgram.autograd.gramian: .*" + message):
        tg.autograd.gramian(**kwargs)
