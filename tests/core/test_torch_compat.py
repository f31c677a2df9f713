"""Each private torch behaviour torchgram relies on, checked against the installed torch.

A failure here means a torch release moved an internal that ``_core/_torch_compat.py``
wraps: fix the wrapper there (nothing else in the package touches these internals).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from custom_functions import RouteOnCtx
from torchgram._core import _torch_compat as compat


def test_slot_metadata_describes_every_output_of_a_node() -> None:
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    a, b = x.split([1, 2], dim=1)
    node = a.grad_fn
    metadata = compat.slot_metadata(node)
    assert [m.shape for m in metadata] == [(2, 1), (2, 2)]
    assert all(m.dtype == torch.float64 and m.device == x.device for m in metadata)
    del b


def test_creation_order_follows_the_forward_and_leaves_come_last() -> None:
    x = torch.randn(3, requires_grad=True)
    first = x.sin()
    second = first.cos()
    accumulate = torch.autograd.graph.get_gradient_edge(x).node
    assert compat.creation_order(second.grad_fn) > compat.creation_order(first.grad_fn)
    assert compat.creation_order(accumulate) == 2**64 - 1


def test_a_builtin_node_called_directly_returns_one_gradient_per_next_edge() -> None:
    x = torch.randn(3, requires_grad=True)
    y = torch.randn(3, requires_grad=True)
    node = (x * y).grad_fn
    assert not compat.is_custom_function_node(node)
    grad_x, grad_y = compat.call_builtin_node(node, [torch.ones(3)])
    torch.testing.assert_close(grad_x, y.detach())
    torch.testing.assert_close(grad_y, x.detach())
    single = compat.call_builtin_node(x.sin().grad_fn, [torch.ones(3)])
    assert len(single) == 1
    torch.testing.assert_close(single[0], x.detach().cos())


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, factor: float, y: Tensor) -> Tensor:
        ctx.factor = factor
        return x * factor + y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, Tensor]:
        return grad * ctx.factor, None, grad


def test_custom_function_nodes_are_recognised_and_called_through_apply() -> None:
    x = torch.randn(3, requires_grad=True)
    y = torch.randn(3)  # no next edge: needs_input_grad marks which arguments have one
    node = _Scale.apply(x, 2.0, y).grad_fn
    assert compat.is_custom_function_node(node)
    assert compat.custom_function_class(node) is _Scale
    outputs, needs = compat.call_custom_function_node(node, [torch.ones(3)])
    assert needs == (True, False, False)
    torch.testing.assert_close(outputs[0], 2 * torch.ones(3))
    assert compat.custom_function_class(x.sin().grad_fn) is None


def test_reentrant_checkpoint_is_recognised() -> None:
    x = torch.randn(3, requires_grad=True)
    reentrant = checkpoint(torch.sin, x, use_reentrant=True)
    plain = checkpoint(torch.sin, x, use_reentrant=False)
    assert compat.is_reentrant_checkpoint(reentrant.grad_fn)
    assert not compat.is_reentrant_checkpoint(plain.grad_fn)


def test_leaf_accumulators_are_recognised() -> None:
    x = torch.randn(3, requires_grad=True)
    accumulate = torch.autograd.graph.get_gradient_edge(x).node
    assert compat.is_leaf_accumulator(accumulate)
    assert not compat.is_leaf_accumulator(x.sin().grad_fn)


def test_forward_ad_errors_are_recognised() -> None:
    with warnings.catch_warnings():  # torch's first jvp imports decompositions noisily
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(NotImplementedError) as native:
            torch.func.jvp(lambda x: torch.cdist(x, x), (torch.ones(2, 2),),
                           (torch.ones(2, 2),))
    assert compat.missing_forward_ad(native.value) == ("op", "_cdist_forward")

    class NoJvp(torch.autograd.Function):
        @staticmethod
        def forward(x: Tensor) -> Tensor:
            return x * 2

        @staticmethod
        def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
            pass

        @staticmethod
        def backward(ctx: Any, grad: Tensor) -> Tensor:
            return grad * 2

    with pytest.raises(NotImplementedError) as custom:
        torch.func.jvp(NoJvp.apply, (torch.ones(2),), (torch.ones(2),))
    assert compat.missing_forward_ad(custom.value) == ("function", "")
    assert compat.missing_forward_ad(RuntimeError("something else")) is None


def test_freed_graph_error_is_recognised() -> None:
    x = torch.randn(3, requires_grad=True)
    y = (x * x).sum()
    y.backward()
    with pytest.raises(RuntimeError) as freed:
        y.backward()
    assert compat.is_freed_graph_error(freed.value)
    assert not compat.is_freed_graph_error(RuntimeError("other"))


def test_transpose_getters_are_seen_by_a_function_mode() -> None:
    seen: list[Any] = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            seen.append(func)
            return func(*args, **(kwargs or {}))

    w = torch.randn(2, 3)
    with Record():
        _ = w.T
        _ = w.mT
        _ = w.t()
        _ = w.shape
    assert [compat.is_transpose_getter(func) for func in seen] == [True, True, False, False]
    assert compat.getter_name(seen[0]) == "Tensor.T"
    assert compat.getter_name(seen[2]) is None


def test_functorch_transforms_names_the_active_levels_outermost_first() -> None:
    seen: list[tuple[str, ...]] = []

    def record(x: Tensor) -> Tensor:
        seen.append(compat.functorch_transforms())
        return x.sin().sum()

    record(torch.ones(2))
    torch.func.grad(record)(torch.ones(2))
    torch.func.vmap(record)(torch.ones(3, 2))
    torch.func.jvp(record, (torch.ones(2),), (torch.ones(2),))
    torch.func.grad(lambda x: torch.func.vmap(record)(x).sum())(torch.ones(3, 2))
    torch.func.jacfwd(torch.func.jacrev(record))(torch.ones(2))
    assert seen == [(), ("grad",), ("vmap",), ("jvp",), ("grad", "vmap"),
                    ("vmap", "jvp", "grad")]


def test_cdist_batched_backward_is_still_wrong() -> None:
    """NOTE [wrong batching rules]: when torch fixes this, drop torch.cdist from the list."""
    torch.manual_seed(0)
    anchors = torch.randn(3, 8, dtype=torch.float64)
    h = torch.randn(4, 8, dtype=torch.float64)

    def f(h: Tensor) -> Tensor:
        return torch.cdist(h, anchors).sum(-1)

    looped = torch.func.jacrev(f, chunk_size=1)(h)
    vmapped = torch.func.jacrev(f)(h)
    assert not torch.allclose(looped, vmapped), "torch fixed cdist's batching rule"
    assert compat.wrong_batched_backward(torch.cdist) == "torch.cdist"
    assert compat.wrong_batched_backward(torch.sin) is None
    assert f(h.requires_grad_()).grad_fn.next_functions[0][0].name() in compat.WRONG_BATCHED_NODES


def test_lu_solve_batched_backward_is_still_wrong() -> None:
    """NOTE [wrong batching rules]: when torch fixes this, drop lu_solve from the list."""
    torch.manual_seed(0)
    x = torch.randn(16, dtype=torch.float64)

    def f(y: Tensor) -> Tensor:
        a = y[:9].reshape(3, 3)
        return torch.linalg.lu_solve(*torch.linalg.lu_factor(a), a[:, :1]).reshape(-1)

    looped = torch.stack([torch.func.jacrev(f)(y) for y in (x, 2 * x)])
    vmapped = torch.func.vmap(torch.func.jacrev(f))(torch.stack([x, 2 * x]))
    assert not torch.allclose(looped, vmapped), "torch fixed lu_solve's batching rule"
    assert compat.wrong_batched_backward(torch.linalg.lu_solve) == "torch.linalg.lu_solve"
    assert f(x.requires_grad_()).grad_fn.next_functions[0][0].name() in compat.WRONG_BATCHED_NODES


def test_select_scatter_batched_backward_is_still_wrong() -> None:
    """NOTE [wrong batching rules]: when torch fixes this, drop select_scatter from the list.

    A batched ``src`` scattered into an unbatched tensor under ``vmap``, the backward taken
    outside it (the structured backend's per-sample forward).
    """
    torch.manual_seed(0)
    x = torch.randn(6, 4, dtype=torch.float64)
    w = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)

    def f(xi: Tensor) -> Tensor:
        return torch.select_scatter(torch.zeros(2, 3, dtype=xi.dtype), torch.tanh(xi @ w), 0,
                                    0).sin().sum()

    vmapped = torch.autograd.grad(torch.func.vmap(f)(x).sum(), w)[0]
    looped = torch.autograd.grad(sum(f(xi) for xi in x), w)[0]
    assert not torch.allclose(looped, vmapped), "torch fixed select_scatter's batching rule"
    assert compat.wrong_batched_backward(torch.select_scatter) == "torch.select_scatter"
    assert compat.wrong_batched_backward(Tensor.select_scatter) == "Tensor.select_scatter"


def test_version_counts_in_place_writes() -> None:
    x = torch.zeros(3)
    before = compat.version(x)
    x.add_(1)
    assert compat.version(x) == before + 1
    assert compat.version(x.detach()) == compat.version(x)  # shared with aliases


ROUTES = {
    "index": lambda h, perm: h[perm],
    "index_select": lambda h, perm: h.index_select(0, perm),
    "gather": lambda h, perm: h.gather(0, perm[:, None].expand_as(h)),
    "take": lambda h, perm: h.take(perm),
    "index_put": lambda h, perm: torch.zeros_like(h).index_put((perm,), h),
    "scatter": lambda h, perm: torch.zeros_like(h).scatter(0, perm[:, None].expand_as(h), h),
    "masked_select": lambda h, perm: h.masked_select(perm[:, None] > 1),
}


@pytest.mark.parametrize("route", list(ROUTES))
def test_routing_values_tell_apart_the_indices_nodes_route_by(route: str) -> None:
    """Each node that routes by a saved index keeps it where ``routing_values`` reads it."""
    h = torch.randn(4, 3, requires_grad=True)

    def digest(order: list[int]) -> tuple[Any, ...]:
        out = ROUTES[route](h, torch.tensor(order))
        return compat.routing_values(compat.graph_nodes(out))

    assert digest([0, 1, 2, 3]) == digest([0, 1, 2, 3])
    assert digest([0, 1, 2, 3]) != digest([2, 0, 3, 1])


def test_routing_values_leave_out_indices_that_route_within_a_row() -> None:
    """Targets, dropout masks and token ids change every batch: not in the digest (which
    holds only the nodes' fixed settings then, the same for every batch)."""
    table = torch.randn(5, 3, requires_grad=True)
    digests = set()
    for _ in range(3):
        ids = torch.randint(0, 5, (4,))
        logits = torch.nn.functional.dropout(torch.nn.functional.embedding(ids, table), 0.5)
        loss = torch.nn.functional.cross_entropy(logits, torch.randint(0, 3, (4,)),
                                                 reduction="none")
        digest = compat.routing_values(compat.graph_nodes(loss))
        assert not any(isinstance(entry[-1], tuple) for entry in digest)  # no tensor digest
        digests.add(digest)
    assert len(digests) == 1


class _Scaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: Any, saved: Tensor) -> Tensor:
        ctx.scale = scale
        ctx.save_for_backward(saved)
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return grad * 2, None, None


@pytest.mark.parametrize("values", [(0.0, 0.5), (None, 1.0), ([0.0], [1.5]), ("a", "b"),
                                    (1.0, -1.0)], ids=["float", "none", "list", "str", "sign"])
def test_routing_values_hold_a_custom_functions_plain_ctx_values(values: tuple[Any, Any]) -> None:
    """A custom backward is Python: it may branch on any number it kept (session 57)."""
    h = torch.randn(4, 3, requires_grad=True)
    first, second = (compat.routing_values(compat.graph_nodes(
        _Scaled.apply(h, value, torch.tensor(0.0)))) for value in values)
    assert first != second


def test_routing_values_hold_a_custom_functions_saved_numbers() -> None:
    h = torch.randn(4, 3, requires_grad=True)
    first, second = (compat.routing_values(compat.graph_nodes(
        _Scaled.apply(h, 1, torch.tensor(value)))) for value in (0.0, 0.7))
    assert first != second


def test_a_step_size_that_moves_keeps_the_digest() -> None:
    """NOTE [branches on numbers]: a quantiser's learned step (saved, or kept on ctx) moves
    every step; by its exact value every call missed the caches (4.7x slower)."""
    h = torch.randn(4, 3, requires_grad=True)
    digests = {compat.routing_values(compat.graph_nodes(_Scaled.apply(h, step, torch.tensor(
        step)))) for step in (0.1, 0.11, 0.3)}
    assert len(digests) == 1


SLICED = {  # the same nodes and shapes, other integers
    "slices": (lambda h: torch.cat([h[:1], h[1:2], h[2:3], h[3:]]),
               lambda h: torch.cat([h[:1], h[2:3], h[1:2], h[3:]])),
    "select": (lambda h: torch.stack([h[0], h[1], h[2], h[3]]),
               lambda h: torch.stack([h[0], h[2], h[1], h[3]])),
    "roll": (lambda h: h.roll(1, 0), lambda h: h.roll(2, 0)),
    "softmax dim": (lambda h: h.softmax(1), lambda h: h.softmax(0)),
    "narrow": (lambda h: torch.cat([h.narrow(0, 2, 2), h.narrow(0, 0, 2)]),
               lambda h: torch.cat([h.narrow(0, 1, 2), h.narrow(0, 3, 1), h.narrow(0, 0, 1)])),
}


@pytest.mark.parametrize("route", list(SLICED))
def test_routing_values_hold_the_integers_nodes_place_rows_by(route: str) -> None:
    """Python integers (a slice's bounds, a select's index, roll's shifts, a reduction's dim)
    chosen by control flow route the rows with the same node kinds and shapes (session 29:
    samples 1 and 2 exchanged by slices were 0.43 off on structured, 0.11 recorded)."""
    h = torch.randn(4, 3, requires_grad=True)
    first, second = (compat.routing_values(compat.graph_nodes(f(h))) for f in SLICED[route])
    assert first != second
    assert first == compat.routing_values(compat.graph_nodes(SLICED[route][0](h)))


def test_routing_values_leave_out_convolution_settings_and_sizes() -> None:
    """A convolution never moves entries between samples, and shapes are the signature's."""
    x = torch.randn(2, 3, 8, requires_grad=True)
    w = torch.randn(4, 3, 3, requires_grad=True)
    conv = torch.nn.functional.conv1d(x, w, stride=2, padding=1)
    assert compat.routing_values([conv.grad_fn]) == ()
    assert compat.routing_values([x.view(6, 8).grad_fn]) == ()


def test_routing_values_read_a_custom_functions_ctx() -> None:
    h = torch.randn(3, 2, requires_grad=True)
    first = compat.routing_values([RouteOnCtx.apply(h, torch.tensor([0, 1, 2])).grad_fn])
    assert first != compat.routing_values([RouteOnCtx.apply(h, torch.tensor([1, 0, 2])).grad_fn])
