"""Eager code with per-sample structure: ``tg.autograd.record`` and the sample-sparse walk.

Every Gramian is compared with the dense float64 oracle (``reference.dense_gramian``) of the
same computation written as a pure function, recorded and walked, under the conditions
eager code has: module hooks, ``torch.utils.checkpoint``, DistributedDataParallel, CPU
autocast, ``retain_graph`` both ways, non-leaf inputs, samples that interact.
"""

from __future__ import annotations

import copy
import gc
import os
import re
import tempfile
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import torchgram as tg
from custom_functions import NumpySquare
from models.test_eager_models import eager_leaves
from reference import dense_gramian
from torchgram.backends.eager.graph_index import index_graph
from torchgram.backends.eager.record import current_recording
from zoo import NAMES, build

DOUBLE = torch.float64


def assert_close(actual: Tensor, expected: Tensor, tol: float = 1e-10) -> None:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    actual, expected = actual.detach(), expected.detach()
    scale = expected.abs().max().clamp_min(1e-30)
    error = float((actual.to(expected.dtype) - expected).abs().max() / scale)
    assert error <= tol, error


def forward(run: Callable[[], Any], recorded: bool) -> Any:
    if recorded:
        with tg.autograd.record():
            return run()
    return run()


WAYS = [pytest.param(True, id="record"), pytest.param(False, id="walk")]


@pytest.mark.parametrize("recorded", WAYS)
@pytest.mark.parametrize("diagonal", [False, True], ids=["full", "diagonal"])
@pytest.mark.parametrize("name", NAMES)
def test_zoo_with_batch_dim_matches_oracle(name: str, diagonal: bool, recorded: bool) -> None:
    case = build(name, DOUBLE)
    expected = dense_gramian(case.f, case.args).gramian
    expected = expected.diagonal() if diagonal else expected
    for batch_dim in {case.batch_dim, None} | ({0} if name == "coupled_batch" else set()):
        for _ in range(2):  # the second call uses the cached layouts
            params, leaves = eager_leaves(case)
            out = forward(lambda p=params: case.f(p, *case.inputs), recorded)
            G = tg.autograd.gramian(optree.tree_leaves(out), leaves, batch_dim=batch_dim,
                                    diagonal=diagonal)
            assert_close(G, expected)
            assert all(leaf.grad is None for leaf in leaves)


@pytest.mark.parametrize("recorded", WAYS)
def test_per_input_blocks_and_chunks(recorded: bool) -> None:
    case = build("mlp_logits", DOUBLE)  # [B, 3]: three rows per sample
    dense = dense_gramian(case.f, case.args)
    params, leaves = eager_leaves(case)
    out = forward(lambda: case.f(params, *case.inputs), recorded)
    blocks = tg.autograd.gramian(out, leaves, batch_dim=0, per_input=True)
    for block, expected in zip(blocks, dense.blocks, strict=True):
        assert_close(block, dense.shaped(expected))
    for chunk_size in (1, 5, 7):
        for diagonal in (False, True):
            G = tg.autograd.gramian(out, leaves, batch_dim=0, chunk_size=chunk_size,
                                    diagonal=diagonal)
            assert_close(G, dense.shaped(diagonal=diagonal))


# -- the recording -------------------------------------------------------------------------


def mlp(width: int = 6) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, width), nn.Tanh(), nn.Linear(width, 3)).to(DOUBLE)
    return model, torch.randn(6, 5, dtype=DOUBLE), torch.randint(0, 3, (6,))


def oracle_of(model: nn.Module, losses: Callable[[Any], Tensor]) -> Tensor:
    fn, params = tg.functionalize(model)
    return dense_gramian(lambda p: losses(lambda *a: fn(p, *a)), (params,)).shaped()


def test_recording_leaves_nothing_behind_and_lives_with_the_graph() -> None:
    model, x, y = mlp()
    state = {name: (dict(m._forward_hooks), dict(m._backward_hooks), dict(m.__dict__))
             for name, m in model.named_modules()}
    with tg.autograd.record() as recording:
        losses = F.cross_entropy(model(x), y, reduction="none")
    assert [use.role for use in recording.uses] == ["weight", "bias", "weight", "bias"]
    G = tg.autograd.gramian(losses, list(model.parameters()), batch_dim=0)
    assert_close(G, oracle_of(model, lambda m: F.cross_entropy(m(x), y, reduction="none")))
    for name, m in model.named_modules():
        assert (dict(m._forward_hooks), dict(m._backward_hooks), dict(m.__dict__)) == \
            state[name]
    for p in model.parameters():
        assert p.grad is None and p._backward_hooks is None and p.requires_grad
    alive = weakref.ref(recording)
    del recording
    gc.collect()
    assert alive() is not None  # held by the graph it tapped
    del losses, G
    gc.collect()
    assert alive() is None  # and freed with it


def test_one_record_context_entered_every_step_and_nested() -> None:
    """``rec = tg.autograd.record()`` kept and entered again: Python's raw "'_GeneratorContext
    Manager' object has no attribute 'args'" on the second ``with`` (session 60's hunt)."""
    model, x, y = mlp()
    wanted = oracle_of(model, lambda m: F.cross_entropy(m(x), y, reduction="none"))
    recorder = tg.autograd.record()
    for _ in range(2):
        with recorder as recording:
            with recorder as inner:  # nested: its own block, the outer one's still open
                assert inner is not recording and current_recording() is inner
            losses = F.cross_entropy(model(x), y, reduction="none")
        assert recording.uses
        assert_close(tg.autograd.gramian(losses, list(model.parameters()), batch_dim=0), wanted)

    @tg.autograd.record()  # a decorator, as the generator context was (session 60's review)
    def recorded_losses() -> Tensor:
        return F.cross_entropy(model(x), y, reduction="none")

    assert_close(tg.autograd.gramian(recorded_losses(), list(model.parameters()), batch_dim=0),
                 wanted)


def test_an_eager_explanation_displays_as_its_report() -> None:
    """A notebook cell showed the dataclass's fields, the whole Gramian among them, before
    session 57; now its report, as a table in HTML."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    with tg.autograd.record():
        losses = F.cross_entropy(model(x), y, reduction="none")
    report = tg.autograd.explain(losses, model.named_parameters(), batch_dim=0)
    assert repr(report) == str(report) and "tensor(" not in repr(report)
    assert str(report).splitlines()[1].split() == ["input", "shape", "way", "why"]
    page = report._repr_html_()
    assert page.count("<tr>") == 1 + len(report.inputs) and "0.weight" in page


def test_next_recording_releases_the_previous_activations() -> None:
    model, x, y = mlp()
    with tg.autograd.record() as first:
        old = F.cross_entropy(model(x), y, reduction="none")
    assert first.acts and current_recording() is first
    with tg.autograd.record() as second:
        F.cross_entropy(model(x), y, reduction="none")
    assert first.expired and not first.acts and current_recording() is second
    # the old graph is still exact, through the walk
    report = tg.autograd.explain(old, model.named_parameters(), batch_dim=0)
    assert report.walked == ("0.weight", "0.bias", "2.weight", "2.bias")
    assert_close(report.gramian, oracle_of(model, lambda m: F.cross_entropy(m(x), y,
                                                                             reduction="none")))


def _in_thread(run: Callable[[], Any]) -> Any:
    """``run()`` in a fresh thread (its nodes' sequence numbers count from its own start)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = run()
        except BaseException as error:  # noqa: BLE001 -- re-raised in the caller's thread
            box["error"] = error

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


@pytest.mark.parametrize("there", ["plain", "recorded"], ids=["unrecorded", "own-recording"])
@pytest.mark.parametrize("batch_dim", [0, None], ids=["batch_dim0", "no-batch_dim"])
def test_a_graph_of_another_thread_is_walked(there: str, batch_dim: int | None) -> None:
    model, x, y = mlp()
    other_x = torch.randn_like(x)

    def losses_of(inputs: Tensor) -> Tensor:
        return F.cross_entropy(model(inputs), y, reduction="none")

    def other() -> Tensor:  # the same forward on other data, in a fresh thread
        return forward(lambda: losses_of(other_x), there == "recorded")

    def here() -> tuple[Any, ...]:  # a fresh thread too: both count from the same number
        with tg.autograd.record() as recording:
            recorded = losses_of(x)
        losses = _in_thread(other)
        named = {(node._sequence_nr(), node.name()) for node in index_graph([losses]).every}
        assert {(tap.seq, tap.node_name) for tap in recording.taps} <= named  # they collide
        params = list(model.parameters())
        G = tg.autograd.gramian(losses, params, batch_dim=batch_dim)
        report = tg.autograd.explain(losses, model.named_parameters(), batch_dim=batch_dim)
        w = tg.autograd.backward(losses, params, tg.weighting.upgrad, batch_dim=batch_dim,
                                 retain_graph=True)
        assert current_recording() is recording  # still live, used on its own graph:
        mine = tg.autograd.explain(recorded, model.named_parameters(), batch_dim=batch_dim)
        return G, report, w, [p.grad for p in params], mine

    G, report, w, grads, mine = _in_thread(here)
    assert_close(G, oracle_of(model, lambda m: F.cross_entropy(m(other_x), y,
                                                               reduction="none")))
    assert report.walked == ("0.weight", "0.bias", "2.weight", "2.bias")
    assert {item.why for item in report.inputs} == {
        "the graph uses it where the recording did not see it"}
    expected = torch.autograd.grad(losses_of(other_x), list(model.parameters()), w)
    for grad, g in zip(grads, expected, strict=True):
        assert_close(grad, g)
    assert mine.walked == ()
    assert_close(mine.gramian, oracle_of(model, lambda m: F.cross_entropy(m(x), y,
                                                                          reduction="none")))


def test_a_forward_after_the_block_is_walked() -> None:
    model, x, y = mlp()
    other_x = torch.randn_like(x)
    with tg.autograd.record():
        recorded = F.cross_entropy(model(x), y, reduction="none")
    later = F.cross_entropy(model(other_x), y, reduction="none")  # same model, not recorded
    report = tg.autograd.explain(later, model.named_parameters(), batch_dim=0)
    assert report.walked == ("0.weight", "0.bias", "2.weight", "2.bias")
    assert_close(report.gramian, oracle_of(model, lambda m: F.cross_entropy(
        m(other_x), y, reduction="none")))
    both = tg.autograd.explain([recorded, later], model.named_parameters())
    assert both.walked == ("0.weight", "0.bias", "2.weight", "2.bias")
    assert_close(both.gramian, oracle_of(model, lambda m: torch.cat([
        F.cross_entropy(m(x), y, reduction="none"),
        F.cross_entropy(m(other_x), y, reduction="none")])))


def test_a_backward_of_the_recorded_graph_on_another_thread_is_seen() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, 1)).to(DOUBLE)
    x = torch.randn(5, 2, dtype=DOUBLE)

    def residual(m: Callable[[Tensor], Tensor], inputs: Tensor, derivative: Callable[
            [Tensor, Tensor], Tensor]) -> Tensor:
        u = m(inputs)
        return u.squeeze(1) + derivative(u, inputs).pow(2).sum(1)

    def grad_of(u: Tensor, inputs: Tensor) -> Tensor:
        return torch.autograd.grad(u.sum(), inputs, create_graph=True)[0]

    def here() -> Any:  # ∂u/∂x taken on another thread: its nodes count from their own start
        inputs = x.clone().requires_grad_()
        with tg.autograd.record():
            u = model(inputs)
        du = _in_thread(lambda: grad_of(u, inputs))
        return tg.autograd.explain(u.squeeze(1) + du.pow(2).sum(1),
                                   model.named_parameters(), batch_dim=0)

    report = _in_thread(here)
    assert "2.weight" in report.walked  # used by ∂u/∂x through the recorded call's W.T
    fn, params = tg.functionalize(model)
    inputs = x.clone().requires_grad_()
    assert_close(report.gramian, dense_gramian(
        lambda p: residual(lambda a: fn(p, a), inputs, grad_of), (params,)).shaped())


@pytest.mark.parametrize("cell", [nn.RNN, nn.GRU, nn.LSTM], ids=["rnn", "gru", "lstm"])
@pytest.mark.parametrize("before", range(8), ids=lambda k: f"{k}-nodes-before")
def test_a_backward_of_recorded_steps_on_another_thread_is_seen(cell: type[nn.RNNBase],
                                                                before: int) -> None:
    # The steps' nodes of a fused recurrence are made outside the mode. Known by a range of
    # sequence numbers only, a node of the other thread's ∂out/∂x with one of them (at one
    # count of its prior nodes) was taken for a step's: weight_hh kept on its taps, G 0.039 off.
    torch.manual_seed(0)
    net = cell(3, 4, batch_first=True).to(DOUBLE)
    x = torch.randn(4, 2, 3, dtype=DOUBLE)

    def grad_of(u: Tensor, inputs: Tensor) -> Tensor:
        for _ in range(before):  # moves the other thread's numbers against the steps'
            torch.ones(1, requires_grad=True) * 2
        return torch.autograd.grad(u.sum(), inputs, create_graph=True)[0]

    def here() -> Any:
        inputs = x.clone().requires_grad_()
        with tg.autograd.record():
            u = net(inputs)[0][:, -1].sum(-1)
        du = _in_thread(lambda: grad_of(u, inputs))
        return tg.autograd.explain(u + du.pow(2).sum((1, 2)), net.named_parameters(),
                                   batch_dim=0)

    report = _in_thread(here)
    assert "weight_hh_l0" in report.walked  # used by ∂out/∂x through the steps' W_hhᵀ
    inputs = x.clone().requires_grad_()
    u = net(inputs)[0][:, -1].sum(-1)
    losses = u + grad_of(u, inputs).pow(2).sum((1, 2))
    rows = [torch.cat([g.reshape(-1) for g in torch.autograd.grad(
        loss, list(net.parameters()), retain_graph=True)]) for loss in losses]
    J = torch.stack(rows)
    assert_close(report.gramian, J @ J.T)


@pytest.mark.parametrize("api", ["gramian", "backward"])
@pytest.mark.parametrize("retain_graph", [True, False], ids=["retain", "free"])
def test_a_call_that_frees_the_graph_releases_the_activations(api: str,
                                                               retain_graph: bool) -> None:
    model, x, y = mlp()
    params = list(model.parameters())
    with tg.autograd.record() as recording:
        losses = F.cross_entropy(model(x), y, reduction="none")
    unrelated = F.cross_entropy(model(x), y, reduction="none")
    tg.autograd.gramian(unrelated, params, batch_dim=0, retain_graph=False)
    assert not recording.expired  # another graph went: the recording is not its
    if api == "gramian":
        G = tg.autograd.gramian(losses, params, batch_dim=0, retain_graph=retain_graph)
    else:
        _, info = tg.autograd.backward(losses, params, tg.weighting.upgrad, batch_dim=0,
                                       retain_graph=retain_graph, with_info=True)
        G = info.gramian
    assert_close(G, oracle_of(model, lambda m: F.cross_entropy(m(x), y, reduction="none")))
    if retain_graph:
        assert not recording.expired and recording.acts and current_recording() is recording
    else:  # NOTE [eager recording]: its graph is freed, nothing can use them any more
        assert recording.expired and not recording.acts and current_recording() is None


def test_a_call_that_frees_the_graph_inside_the_block_ends_the_recording() -> None:
    model, x, y = mlp()
    with tg.autograd.record() as recording:
        losses = F.cross_entropy(model(x), y, reduction="none")
        tg.autograd.gramian(losses, list(model.parameters()), batch_dim=0, retain_graph=False)
        calls = recording.calls
        again = F.cross_entropy(model(x), y, reduction="none")  # not recorded any more
    assert recording.expired and recording.calls == calls and not recording.acts
    report = tg.autograd.explain(again, model.named_parameters(), batch_dim=0)
    assert report.walked == ("0.weight", "0.bias", "2.weight", "2.bias")
    assert_close(report.gramian, oracle_of(model, lambda m: F.cross_entropy(
        m(x), y, reduction="none")))


def test_uses_the_recording_did_not_see_are_walked() -> None:
    model, x, y = mlp()
    before = model[0](x)  # used before the block
    with tg.autograd.record():
        losses = F.cross_entropy(model[2](torch.tanh(model[0](x) + before)), y,
                                 reduction="none") * model[2].bias.sum()
    report = tg.autograd.explain(losses, model.named_parameters(), batch_dim=0)
    ways = {item.name: (item.way, item.why) for item in report.inputs}
    assert ways["0.weight"] == ("walk", "the graph uses it where the recording did not see it")
    assert ways["2.bias"] == ("walk", "used outside the rules in Tensor.sum")
    assert ways["2.weight"][0] == "ghost"

    def f(m: Callable[..., Tensor]) -> Tensor:
        raise NotImplementedError

    fn, params = tg.functionalize(model)

    def pure(p: dict[str, Tensor]) -> Tensor:
        h = F.linear(x, p["0.weight"], p["0.bias"])
        logits = F.linear(torch.tanh(h + h), p["2.weight"], p["2.bias"])
        return F.cross_entropy(logits, y, reduction="none") * p["2.bias"].sum()

    assert_close(report.gramian, dense_gramian(pure, (params,)).shaped())


def test_activation_changed_in_place_is_a_clear_error() -> None:
    model, x, y = mlp()
    with tg.autograd.record():
        h = model[0](x) * 1.0  # the product saves nothing
        logits = model[2](h)
        h.add_(0.0)  # bumps the version of the activation the second layer recorded
        losses = F.cross_entropy(logits, y, reduction="none")
    with pytest.raises(ValueError, match=r"^torchgram.autograd.gramian: expected the "
                       r"activations of the recorded calls unchanged .* recorded linear call "
                       r"\(multiplied by inputs\[2\]\) changed in place"):
        tg.autograd.gramian(losses, list(model.parameters()), batch_dim=0)


def test_gramian_inside_the_record_block() -> None:
    model, x, y = mlp()
    with tg.autograd.record() as recording:
        losses = F.cross_entropy(model(x), y, reduction="none")
        calls = recording.calls
        G = tg.autograd.gramian(losses, list(model.parameters()), batch_dim=0)
        assert recording.calls == calls  # torchgram's own calls are not recorded
    assert_close(G, oracle_of(model, lambda m: F.cross_entropy(m(x), y, reduction="none")))


# -- samples: where they are, and when they interact ----------------------------------------


@pytest.mark.parametrize("recorded", WAYS)
def test_batch_size_equal_to_feature_sizes(recorded: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)).to(DOUBLE)
    x = torch.randn(6, 6, dtype=DOUBLE)  # B = 6 = every width
    out = forward(lambda: model(x).pow(2).sum(1), recorded)
    G = tg.autograd.gramian(out, list(model.parameters()), batch_dim=0)
    assert_close(G, oracle_of(model, lambda m: m(x).pow(2).sum(1)))


@pytest.mark.parametrize("recorded", WAYS)
def test_samples_flattened_with_positions(recorded: bool) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(4, 4).to(DOUBLE)
    x = torch.randn(3, 5, 4, dtype=DOUBLE)  # [B, T, d] seen as [B·T, d] and [T·B, d]

    def f(m: Callable[[Tensor], Tensor]) -> Tensor:
        a = m(x.reshape(15, 4)).reshape(3, 5, 4)
        b = m(x.transpose(0, 1).reshape(15, 4)).reshape(5, 3, 4).transpose(0, 1)
        return (a * b).sum((1, 2))

    out = forward(lambda: f(lin), recorded)
    G = tg.autograd.gramian(out, list(lin.parameters()), batch_dim=0)
    assert_close(G, oracle_of(lin, f))


@pytest.mark.parametrize("recorded", WAYS)
def test_interacting_samples_give_the_coupled_gramian(recorded: bool) -> None:
    model, x, y = mlp()

    def f(m: Callable[[Tensor], Tensor]) -> Tensor:  # x - x.mean(0): no census knows it
        h = m(x)
        return F.cross_entropy(h - h.mean(0), y, reduction="none")

    expected = oracle_of(model, f)
    for _ in range(2):
        out = forward(lambda: f(model), recorded)
        report = tg.autograd.explain(out, model.named_parameters(), batch_dim=0)
        assert_close(report.gramian, expected)


# -- the conditions of eager code ------------------------------------------------------------


@pytest.mark.parametrize("recorded", WAYS)
def test_module_hooks_fire_once_in_the_users_backward(recorded: bool) -> None:
    model, x, y = mlp()
    expected = oracle_of(model, lambda m: F.cross_entropy(m(x), y, reduction="none"))
    fired: list[str] = []
    model[0].register_forward_hook(lambda *a: fired.append("forward"))
    model[2].register_full_backward_hook(lambda *a: fired.append("backward"))
    model[2].register_full_backward_pre_hook(lambda *a: fired.append("backward pre"))
    model[0].weight.register_hook(lambda g: fired.append("leaf"))
    out = forward(lambda: F.cross_entropy(model(x), y, reduction="none"), recorded)
    assert fired == ["forward"]
    report = tg.autograd.explain(out, model.named_parameters(), batch_dim=0)
    assert fired == ["forward"]  # the Gramian ran no hook
    if recorded:
        assert report.ran.way == "recorded taps (walked pass)"
    assert_close(report.gramian, expected)
    out.backward(torch.ones(6, dtype=DOUBLE))
    assert sorted(fired) == sorted(["forward", "backward pre", "backward", "leaf"])


@pytest.mark.parametrize("recorded", WAYS)
def test_tensor_hook_registered_in_the_block_does_not_run(recorded: bool) -> None:
    model, x, y = mlp()
    fired: list[Tensor] = []

    def run() -> Tensor:
        h = model[0](x)
        h.register_hook(fired.append)
        h.retain_grad()
        return F.cross_entropy(model[2](torch.tanh(h)), y, reduction="none")

    out = forward(run, recorded)
    G = tg.autograd.gramian(out, list(model.parameters()), batch_dim=0)
    assert fired == []
    assert_close(G, oracle_of(model, lambda m: F.cross_entropy(m(x), y, reduction="none")))


@pytest.mark.parametrize("recorded", WAYS)
def test_non_reentrant_checkpoint_works_and_reentrant_is_refused(recorded: bool) -> None:
    model, x, y = mlp()
    expected = oracle_of(model, lambda m: F.cross_entropy(m(x), y, reduction="none"))
    out = forward(lambda: F.cross_entropy(checkpoint(model, x, use_reentrant=False), y,
                                          reduction="none"), recorded)
    assert_close(tg.autograd.gramian(out, list(model.parameters()), batch_dim=0), expected)
    out = forward(lambda: F.cross_entropy(checkpoint(model, x.clone().requires_grad_(),
                                                     use_reentrant=True), y,
                                          reduction="none"), recorded)
    with pytest.raises(ValueError, match=r"^torchgram.autograd.gramian: expected a graph without "
                       r"reentrant checkpoints, .* use_reentrant=False"):
        tg.autograd.gramian(out, list(model.parameters()), batch_dim=0)
    assert all(p.grad is None for p in model.parameters())


NORMS: dict[str, Callable[[], nn.Module]] = {
    "batch-norm": lambda: nn.BatchNorm1d(3),
    "instance-norm": lambda: nn.InstanceNorm1d(3, affine=True, track_running_stats=True,
                                               momentum=0.5),  # its statistics copied back
}


def _checkpointed_norm(norm: str) -> tuple[nn.Module, nn.Module, Tensor]:
    torch.manual_seed(0)
    body = nn.Sequential(nn.Conv1d(4, 3, 1), NORMS[norm](), nn.Tanh(), nn.Flatten()).to(DOUBLE)
    return body, nn.Linear(9, 2).to(DOUBLE), torch.randn(5, 4, 3, dtype=DOUBLE)


def _losses(body: nn.Module, head: nn.Module, x: Tensor) -> Tensor:
    return head(checkpoint(body, x, use_reentrant=False)).pow(2).sum(1)


@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("recorded", WAYS)
@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "per-sample"])
@pytest.mark.parametrize("api", ["gramian", "backward"])
def test_a_checkpointed_norm_updates_its_statistics_as_a_backward_does(
        recorded: bool, batch_dim: int | None, api: str, norm: str) -> None:
    """NOTE [recomputed running statistics]: torchgram's passes recomputed the region, and
    updated its running statistics, up to 23 times a call (a hunt after session 55)."""
    weights = torch.linspace(0.5, 1.5, 5, dtype=DOUBLE)
    body, head, x = _checkpointed_norm(norm)
    params = [*body.parameters(), *head.parameters()]
    losses = _losses(body, head, x)
    after_forward = copy.deepcopy(body.state_dict())
    rows = [torch.autograd.grad(loss, params, retain_graph=True) for loss in losses]
    jacobian = torch.stack([torch.cat([g.reshape(-1) for g in row]) for row in rows])
    body, head, x = _checkpointed_norm(norm)
    _losses(body, head, x).backward(weights)
    after_backward, grads = copy.deepcopy(body.state_dict()), [
        p.grad for p in [*body.parameters(), *head.parameters()]]

    body, head, x = _checkpointed_norm(norm)
    params = [*body.parameters(), *head.parameters()]
    losses = forward(lambda: _losses(body, head, x), recorded)
    if api == "gramian":
        assert_close(tg.autograd.gramian(losses, params, batch_dim=batch_dim),
                     jacobian @ jacobian.T)
        allowed = [after_forward]  # nothing recomputed updates them
    else:
        _, info = tg.autograd.backward(losses, params, lambda G: weights, batch_dim=batch_dim,
                                       with_info=True)
        scale = max(float(grad.abs().max()) for grad in grads)  # a bias before the norm:
        for param, grad in zip(params, grads, strict=True):  # zero but for round-off
            assert float((param.grad - grad).abs().max()) <= 1e-10 * scale
        # The walk's Jᵀw is a plain backward, which recomputes once, as torch's; under
        # record(), Jᵀw comes from the recorded factors where they cover every parameter
        # (nothing is recomputed), else from a plain backward too.
        allowed = [after_backward, after_forward] if recorded else [after_backward]
    state = body.state_dict()
    assert any(all(torch.equal(v, expected[k]) for k, v in state.items()) for expected in allowed)


ROWS = [pytest.param(0, False, id="one-row-per-sample"),
        pytest.param(None, False, id="no-batch_dim"),  # one pass of every row
        pytest.param(0, True, id="three-rows-per-sample")]  # one pass of three seeds


@pytest.mark.parametrize("recorded", WAYS)
@pytest.mark.parametrize("retain_graph", [True, False], ids=["retain", "free"])
@pytest.mark.parametrize(("batch_dim", "logits"), ROWS)
def test_retain_graph_both_ways(recorded: bool, retain_graph: bool, batch_dim: int | None,
                                logits: bool) -> None:
    model, x, y = mlp()

    def rows(m: Callable[[Tensor], Tensor]) -> Tensor:
        return m(x).pow(2) if logits else F.cross_entropy(m(x), y, reduction="none")

    out = forward(lambda: rows(model), recorded)
    G = tg.autograd.gramian(out, list(model.parameters()), batch_dim=batch_dim,
                            retain_graph=retain_graph)
    assert_close(G, oracle_of(model, rows))
    assert all(p.grad is None for p in model.parameters())
    if retain_graph:
        out.sum().backward()
        assert all(p.grad is not None for p in model.parameters())
    else:
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            out.sum().backward()


@pytest.mark.parametrize("recorded", WAYS)
def test_non_leaf_inputs(recorded: bool) -> None:
    model, x, y = mlp()
    hidden: list[Tensor] = []

    def run() -> Tensor:
        h = torch.tanh(model[0](x))
        hidden.append(h)
        return F.cross_entropy(model[2](h), y, reduction="none")

    out = forward(run, recorded)
    h_block, w_block = tg.autograd.gramian(out, [hidden[0], model[0].weight], batch_dim=0,
                                           per_input=True)
    fn, params = tg.functionalize(model[2])
    assert_close(h_block, dense_gramian(
        lambda h: F.cross_entropy(fn(params, h[0]), y, reduction="none"),
        ([hidden[0].detach()],)).shaped())
    w = model[0].weight.detach()
    assert_close(w_block, dense_gramian(
        lambda p: F.cross_entropy(model[2](torch.tanh(F.linear(x, p[0], model[0].bias))), y,
                                  reduction="none"), ([w],)).shaped(), tol=1e-9)


@pytest.mark.parametrize("recorded", WAYS)
def test_autocast_bfloat16(recorded: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))

    def run() -> Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.cross_entropy(model(x), y, reduction="none")  # float32 losses

    out = forward(run, recorded)
    G = tg.autograd.gramian(out, list(model.parameters()), batch_dim=0)
    assert G.dtype == torch.float32  # the outputs' dtype
    walked = tg.autograd.gramian(out, list(model.parameters()))  # the same graph, walked
    assert_close(G, walked, tol=3e-2)  # bfloat16 round-off of the recorded activations
    full = oracle_of(model.double(), lambda m: F.cross_entropy(m(x.double()), y,
                                                               reduction="none"))
    model.float()
    assert_close(G, full.float(), tol=5e-2)


def test_distributed_data_parallel_single_process() -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model, x, y = mlp()
    reference = [p.detach().clone() for p in model.parameters()]
    with tempfile.TemporaryDirectory() as folder:
        store = dist.FileStore(os.path.join(folder, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            ddp = DistributedDataParallel(model)
            params = list(ddp.parameters())
            for recorded in (True, False, True):  # a step, and the next ones still work
                for p, value in zip(params, reference, strict=True):
                    p.data.copy_(value)
                    p.grad = None
                out = forward(lambda: F.cross_entropy(ddp(x), y, reduction="none"), recorded)
                w, info = tg.autograd.backward(out, params, tg.weighting.upgrad, batch_dim=0,
                                               with_info=True)
                assert_close(info.gramian, oracle_of(model, lambda m: F.cross_entropy(
                    m(x), y, reduction="none")))
                grads = [p.grad.clone() for p in params]
                for p in params:
                    p.grad = None
                F.cross_entropy(ddp(x), y, reduction="none").backward(w)  # plain DDP step
                for g, p in zip(grads, params, strict=True):
                    assert_close(g, p.grad)
        finally:
            dist.destroy_process_group()


# -- tg.autograd.backward ----------------------------------------------------------------------


@pytest.mark.parametrize("recorded", WAYS)
@pytest.mark.parametrize("retain_graph", [True, False], ids=["retain", "free"])
@pytest.mark.parametrize("batch_dim", [0, None], ids=["batch_dim0", "no-batch_dim"])
def test_backward_accumulates_like_a_plain_backward(recorded: bool, retain_graph: bool,
                                                    batch_dim: int | None) -> None:
    model, x, y = mlp()
    counts = {"leaf": 0, "accumulated": 0}
    model[0].weight.register_hook(lambda g: counts.__setitem__("leaf", counts["leaf"] + 1))
    model[0].weight.register_post_accumulate_grad_hook(
        lambda p: counts.__setitem__("accumulated", counts["accumulated"] + 1))
    for p in model.parameters():
        p.grad = torch.ones_like(p)  # accumulated into, as torch does
    out = forward(lambda: F.cross_entropy(model(x), y, reduction="none"), recorded)
    w, info = tg.autograd.backward(out, list(model.parameters()), tg.weighting.upgrad,
                                   batch_dim=batch_dim, retain_graph=retain_graph,
                                   with_info=True)
    assert counts == {"leaf": 1, "accumulated": 1}
    assert info.report is not None and (info.report.way.startswith("recorded") == recorded)
    expected = torch.autograd.grad(F.cross_entropy(model(x), y, reduction="none"),
                                   list(model.parameters()), w)
    for p, g in zip(model.parameters(), expected, strict=True):
        assert_close(p.grad, g + 1)
    if not retain_graph:
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            out.sum().backward()


@pytest.mark.parametrize("retain_graph", [True, False], ids=["retain", "free"])
def test_backward_with_a_hook_in_the_block_runs_its_own_backward(retain_graph: bool) -> None:
    model, x, y = mlp()
    with tg.autograd.record():  # a hook the recording sees: its passes are walked
        h = model[0](x)
        h.register_hook(lambda g: g)
        out = F.cross_entropy(model[2](torch.tanh(h)), y, reduction="none")
    w, info = tg.autograd.backward(out, list(model.parameters()), tg.weighting.upgrad,
                                   batch_dim=0, retain_graph=retain_graph, with_info=True)
    assert info.report is not None and info.report.way == "recorded taps (walked pass)"
    expected = torch.autograd.grad(F.cross_entropy(model(x), y, reduction="none"),
                                   list(model.parameters()), w)
    for p, g in zip(model.parameters(), expected, strict=True):
        assert_close(p.grad, g)  # the backward ran on a graph the Gramian left whole
    if not retain_graph:
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            out.sum().backward()


class _Positions(nn.Module):
    """Wide layers over eight positions, whose factors are less than half their per-sample
    Jacobians (so ``Jᵀw`` contracts the factors, NOTE [Jᵀw from kept Jacobians]): a grouped
    conv, a linear, a head of one or several rows per sample."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(32, 64, 3, padding=1, groups=2)
        self.wide = nn.Linear(64, 48)
        self.head = nn.Linear(48, rows)

    def forward(self, x: Tensor) -> Tensor:  # x [B, 32, T]
        h = torch.tanh(self.conv(x)).transpose(1, 2)  # [B, T, 64]
        return self.head(torch.tanh(self.wide(h))).sum(1).squeeze(-1)  # [B] or [B, rows]


@pytest.mark.parametrize("rows", [1, 3], ids=["one-row", "three-rows"])
def test_backward_from_factors_at_several_positions(rows: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``Jᵀw`` contracted from the kept factors (a linear and a grouped conv at several
    positions; one row per sample: the materialized leaf's own product, several: the
    contraction's) is the weighted gradient."""
    from torchgram.backends.eager import gramian as eager
    from torchgram.backends.structured import contraction

    calls: list[str] = []
    use_pullback, leaf_pullback = contraction.pullback_use, eager._FastLeaf.pullback

    def spy_use(use: Any, *args: Any) -> Tensor:
        calls.append(f"{use.role} {use.shape.groups}")
        return use_pullback(use, *args)

    def spy_leaf(leaf: Any, weights: Tensor) -> Tensor:
        calls.append("leaf" if leaf.jacobian is None else "leaf jacobian")
        return leaf_pullback(leaf, weights)

    monkeypatch.setattr(contraction, "pullback_use", spy_use)
    monkeypatch.setattr(eager._FastLeaf, "pullback", spy_leaf)
    torch.manual_seed(0)
    model = _Positions(rows).double()
    x = torch.randn(16, 32, 8, dtype=DOUBLE)
    params = list(model.parameters())
    with tg.autograd.record():
        out = model(x)
    w = tg.autograd.backward(out, params, tg.weighting.upgrad, batch_dim=0, retain_graph=True)
    # the factors' paths ran: the leaf's own product, or the contraction's (grouped too)
    assert {"leaf" if rows == 1 else "weight 1", "weight 2"} <= set(calls), calls
    expected = torch.autograd.grad(out, params, w.reshape(out.shape))
    for p, g in zip(params, expected, strict=True):
        assert_close(p.grad, g)


def test_backward_keeps_jacobians_up_to_twice_their_factors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A linear layer at eight positions whose per-sample Jacobians are 1.6 times its factors
    keeps them (``Jᵀw`` reads them: no second weight-gradient product); the weighted gradient
    is unchanged (NOTE [Jᵀw from kept Jacobians])."""
    from torchgram.backends.eager import gramian as eager

    calls: list[str] = []
    leaf_pullback = eager._FastLeaf.pullback

    def spy_leaf(leaf: Any, weights: Tensor) -> Tensor:
        calls.append("leaf" if leaf.jacobian is None else "leaf jacobian")
        return leaf_pullback(leaf, weights)

    monkeypatch.setattr(eager._FastLeaf, "pullback", spy_leaf)
    torch.manual_seed(0)
    layer = nn.Linear(16, 64, bias=False).double()  # J: 16·64 = 1024, factors: 8·(16 + 64)
    x = torch.randn(12, 8, 16, dtype=DOUBLE)
    with tg.autograd.record():
        out = torch.tanh(layer(x)).sum((1, 2))
    w = tg.autograd.backward(out, [layer.weight], tg.weighting.upgrad, batch_dim=0,
                             retain_graph=True)
    assert calls == ["leaf jacobian"]
    (expected,) = torch.autograd.grad(out, [layer.weight], w)
    assert_close(layer.weight.grad, expected)


@pytest.mark.parametrize("recorded", WAYS)
@pytest.mark.parametrize("name", NAMES)
def test_zoo_backward_is_the_weighted_gradient(name: str, recorded: bool) -> None:
    """``Jᵀw`` (from the recorded factors or kept Jacobians, or a second backward) written to
    ``.grad`` from ``None``: the gradient of ``Σ w_i out_i``, one fresh tensor per leaf."""
    case = build(name, DOUBLE)
    params, leaves = eager_leaves(case)
    out = forward(lambda: case.f(params, *case.inputs), recorded)
    rows = optree.tree_leaves(out)
    w = tg.autograd.backward(rows, leaves, tg.weighting.upgrad, batch_dim=case.batch_dim,
                             retain_graph=True)
    pieces = w.reshape(-1).split([row.numel() for row in rows])
    expected = torch.autograd.grad(rows, leaves, [piece.reshape(row.shape) for piece, row
                                                  in zip(pieces, rows, strict=True)],
                                   allow_unused=True)
    storages = set()
    # relative to the largest entry of the whole gradient: a leaf whose gradient is zero up to
    # round-off (a bias before batch-norm in training mode) has no scale of its own
    scale = max(float(grad.abs().max()) for grad in expected if grad is not None)
    for leaf, grad in zip(leaves, expected, strict=True):
        if grad is None:
            assert leaf.grad is None or not leaf.grad.any()
            continue
        assert leaf.grad is not None and leaf.grad.shape == leaf.shape
        assert float((leaf.grad - grad).abs().max()) <= 1e-10 * scale
        storages.add(leaf.grad.untyped_storage().data_ptr())
    assert len(storages) == sum(grad is not None for grad in expected)


# -- reports --------------------------------------------------------------------------------




def test_explain_reports_ways_and_nodes_called_per_row() -> None:
    model, x, y = mlp()
    with tg.autograd.record():
        losses = F.cross_entropy(model[2](NumpySquare.apply(model[0](x))), y, reduction="none")
    report = tg.autograd.explain(losses, model.named_parameters(), batch_dim=0)
    assert [item.way for item in report.inputs] == ["ghost", "materialize", "ghost",
                                                    "materialize"]
    text = str(report)
    assert text.startswith("torchgram.autograd.explain: 6 sample(s); recorded taps")
    # two rows per sample: the walk pushes two rows, which vmap cannot batch through numpy
    logits = model[2](NumpySquare.apply(model[0](x)))[:, :2]
    walked = tg.autograd.explain(logits, model.named_parameters(), batch_dim=0)
    assert walked.walked == ("0.weight", "0.bias", "2.weight", "2.bias")
    assert walked.inputs[0].why == "the graph uses it where the recording did not see it"
    assert walked.looped_nodes == {"NumpySquareBackward": 1}
    assert "nodes called once per row (vmap could not batch them): NumpySquareBackward (1×)" \
        in str(walked)
    assert "walk: AddmmBackward0 split per sample from its saved tensors (2×)" in str(walked)
    fn, params = tg.functionalize(model)

    def pure(p: dict[str, Tensor]) -> Tensor:
        return F.linear(F.linear(x, p["0.weight"], p["0.bias"]) ** 2, p["2.weight"],
                        p["2.bias"])

    assert_close(report.gramian, dense_gramian(lambda p: F.cross_entropy(
        pure(p), y, reduction="none"), (params,)).shaped())
    assert_close(walked.gramian, dense_gramian(lambda p: pure(p)[:, :2], (params,)).shaped())


def test_bad_batch_dim_is_a_clear_error() -> None:
    w = torch.randn(3, requires_grad=True)
    out = torch.randn(4, 3) @ w
    with pytest.raises(ValueError, match=r"^torchgram.autograd.gramian: expected batch_dim "
                       r"within the dims of every output .* but got batch_dim=1"):
        tg.autograd.gramian(out, w, batch_dim=1)
    with pytest.raises(ValueError, match=r"same number of samples along batch_dim in every "
                       r"output, but got sizes \[4, 2\]"):
        tg.autograd.gramian([out, out[:2]], w, batch_dim=0)
    with pytest.raises(TypeError, match=r"^torchgram.autograd.backward: .*batch_dim"):
        tg.autograd.backward(out, w, tg.weighting.mean, batch_dim="0")  # type: ignore[arg-type]


# -- the README's eager section runs ------------------------------------------------------------


def test_readme_eager_section_runs(capsys: pytest.CaptureFixture[str]) -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme.split("### Eager code: the torchjd-style training loop", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict[str, Any] = {"torch": torch, "nn": nn, "tg": tg}
    torch.manual_seed(0)
    exec(compile(code, "README.md (eager code)", "exec"), scope)  # noqa: S102
    model, x, y = scope["model"], scope["x"], scope["y"]
    assert all(p.grad is not None for p in model.parameters())  # the loop's last step
    assert_close(scope["G"], oracle_of(model, lambda m: scope["criterion"](m(x), y)), tol=1e-5)
    assert "torchgram.autograd.explain: 16 sample(s); recorded" in capsys.readouterr().out


@pytest.mark.parametrize("recorded", [False, True], ids=["walked", "recorded"])
def test_selective_checkpointing_is_a_clear_error(recorded: bool) -> None:
    """Selective activation checkpointing hands its saved tensors to one backward pass: torch's
    raw "Trying to backward an extra time" from the Gramian's passes (session 60's hunt)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    model, x, y = mlp()

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return (CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.addmm.default
                else CheckpointPolicy.PREFER_RECOMPUTE)

    def forward() -> Tensor:
        logits = checkpoint(model, x, use_reentrant=False, context_fn=lambda: (
            create_selective_checkpoint_contexts(policy)))
        return F.cross_entropy(logits, y, reduction="none")

    if recorded:
        with tg.autograd.record():
            losses = forward()
    else:
        losses = forward()
    try:  # one pass goes through (the layouts of an earlier call cached): the right G
        G = tg.autograd.gramian(losses, list(model.parameters()), batch_dim=0)
    except RuntimeError as error:
        assert re.search("torchgram.autograd.gramian: .*selective activation", str(error))
        return
    assert_close(G, oracle_of(model, lambda m: F.cross_entropy(m(x), y, reduction="none")))
