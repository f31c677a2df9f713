"""torchgram.distributed on 2 gloo ranks with DDP, FSDP2 and tensor-parallel modules.

The session's ranks run every check (``worker``, ``spawning``): eager Jacobian-descent steps
of DDP and FSDP2 modules equal the single-process step, ``tg.functionalize`` gives an FSDP2
model's whole parameters, a tensor-parallel MLP (colwise, then rowwise with a replicated
bias) has the single-process Gramian and update, and the single-process APIs refuse DTensors
clearly.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from spawning import Checks, Results, digest, outcome
from torch import Tensor, nn

import torchgram as tg

MODULE = "test_sharded"
TOL = 1e-10


def _setup(rank: int) -> tuple[nn.Module, Tensor, Tensor, Tensor, Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.randint(0, 3, (5,))
    local = slice(0, 3) if rank == 0 else slice(3, 5)  # uneven: 3 and 2 samples
    return model, x, y, x[local], y[local]


def _losses(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="none")


def _reference(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Any]:
    """The single-process eager step on the whole batch."""
    plain = copy.deepcopy(model)
    losses = _losses(plain(x), y)
    gramian = tg.autograd.gramian(losses, list(plain.parameters()))
    weights = tg.autograd.backward(losses, list(plain.parameters()), tg.weighting.upgrad)
    return {"gramian": gramian, "weights": weights,
            "grads": [p.grad.clone() for p in plain.parameters()]}


def _ddp(rank: int, static_graph: bool = False) -> dict[str, Any]:
    """``static_graph=True``: its output sink's backward queues an engine callback, which the
    walk called outside a backward (torch's raw error before session 57)."""
    from torch.nn.parallel import DistributedDataParallel

    model, x, y, xl, yl = _setup(rank)
    ref = _reference(model, x, y)
    ddp = DistributedDataParallel(copy.deepcopy(model), static_graph=static_graph)
    losses = _losses(ddp(xl), yl)
    weights, info = tg.distributed.autograd.backward(losses, ddp, tg.weighting.upgrad,
                                                     with_info=True)
    grads = [p.grad.clone() for p in ddp.module.parameters()]
    # a second step runs as usual (DDP's reducer was left in order)
    loss = _losses(ddp(xl), yl).mean()
    loss.backward()
    # cross_rank="local": each rank weights its own block, DDP averages the ranks' steps
    ddp.zero_grad()
    losses = _losses(ddp(xl), yl)
    local_gramian = tg.distributed.autograd.gramian(losses, ddp, cross_rank="local")
    local_weights = tg.distributed.autograd.backward(losses, ddp, tg.weighting.upgrad,
                                                     cross_rank="local")
    local_grads = [p.grad.clone() for p in ddp.module.parameters()]
    parts = [_reference(model, x[part], y[part]) for part in (slice(0, 3), slice(3, 5))]
    own = parts[rank]
    mean = [(a + b) / 2 for a, b in zip(parts[0]["grads"], parts[1]["grads"], strict=True)]
    return {"weights": float((weights - ref["weights"]).abs().max()),
            "gramian": float((info.gramian - ref["gramian"]).abs().max()),
            "grads": max(float((g - r).abs().max()) for g, r in zip(grads, ref["grads"],
                                                                      strict=True)),
            "digest": digest(weights) + "".join(digest(g) for g in grads),
            "local gramian": float((local_gramian - own["gramian"]).abs().max()),
            "local weights": float((local_weights - own["weights"]).abs().max()),
            "local grads": max(float((g - r).abs().max()) for g, r in zip(local_grads, mean,
                                                                          strict=True))}


def _fsdp(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, x, y, xl, yl = _setup(rank)
    ref = _reference(model, x, y)
    mesh = init_device_mesh("cpu", (2,))
    sharded = copy.deepcopy(model)
    for layer in (sharded[0], sharded[2], sharded):
        fully_shard(layer, mesh=mesh)  # reshard_after_forward=True: the default
    out = {}
    # tg.autograd.gramian used to return zeros here: now a clear error
    losses = _losses(sharded(xl), yl)
    try:
        tg.autograd.gramian(losses, list(sharded.parameters()))
        out["autograd"] = "no error"
    except TypeError as error:
        out["autograd"] = str(error)
    gramian = tg.distributed.autograd.gramian(losses, sharded)
    out["eager gramian"] = float((gramian - ref["gramian"]).abs().max())
    weights = tg.distributed.autograd.backward(losses, sharded, tg.weighting.upgrad)
    grads = [p.grad.full_tensor() for p in sharded.parameters()]
    out["weights"] = float((weights - ref["weights"]).abs().max())
    out["grads"] = max(float((g - r).abs().max()) for g, r in zip(grads, ref["grads"],
                                                                  strict=True))
    out["digest"] = digest(weights) + "".join(digest(g) for g in grads)
    # functionalize: the whole parameters, and the functional API on the local samples
    fn, params = tg.functionalize(sharded)
    out["params"] = sorted(type(p).__name__ for p in params.values())

    def f(p: Any, x: Tensor, y: Tensor) -> Tensor:
        return _losses(fn(p, x), y)

    ref_fn, ref_params = tg.functionalize(copy.deepcopy(model))
    functional = tg.distributed.gramian(f, batch_dim=0)(params, xl, yl)
    single = tg.gramian(lambda p, x, y: _losses(ref_fn(p, x), y), batch_dim=0)(ref_params, x, y)
    out["functional"] = float((functional - single).abs().max())
    out["functional digest"] = digest(functional)
    try:
        tg.gramian(lambda p, x: sharded(x).sum(1))(dict(sharded.named_parameters()), xl)
        out["gramian of DTensors"] = "no error"
    except TypeError as error:
        out["gramian of DTensors"] = str(error)
    return out


def _fsdp_internals(rank: int) -> dict[str, Any]:
    """The FSDP2 internals ``_core/_torch_compat.py`` reads, on the installed torch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torchgram._core import _torch_compat

    model, _, _, xl, yl = _setup(rank)
    mesh = init_device_mesh("cpu", (2,))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    losses = _losses(model(xl), yl)
    params = list(_torch_compat.fsdp_params(model))
    seen, stack, post_backward = set(), [losses.grad_fn], False
    while stack:  # FSDP2's post-backward Function on the sharded modules' inputs
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        post_backward |= _torch_compat.passes_cotangents_through(node)
        stack.extend(child for child, _ in node.next_functions)
    return {"params": sorted(f"{type(p.module).__name__}.{p.name}" for p in params),
            "shards are DTensors": all(_torch_compat.is_dtensor(p.sharded) for p in params),
            "whole after forward": [tuple(p.unsharded.shape) for p in params
                                    if p.unsharded is not None],
            "original class": _torch_compat.fsdp_original_class(model[0]).__name__,
            "plain module": _torch_compat.fsdp_original_class(model[1]),
            "forward hooks": len(_torch_compat.fsdp_forward_hook_ids(model[0])),
            "post-backward node": post_backward}


def _tensor_parallel(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model, x, y, _, _ = _setup(rank)
    ref_fn, ref_params = tg.functionalize(copy.deepcopy(model))
    mesh = init_device_mesh("cpu", (2,))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fn, params = tg.functionalize(model)
    placements = {name: str(p.placements) for name, p in params.items()}

    def f(p: Any, x: Tensor, y: Tensor) -> Tensor:
        return _losses(fn(p, x), y)

    def ref(p: Any, x: Tensor, y: Tensor) -> Tensor:
        return _losses(ref_fn(p, x), y)

    gramian = tg.distributed.gramian(f, batch_dim=0)(params, x, y)
    per_leaf = tg.distributed.gramian(f, batch_dim=0, per_leaf=True)(params, x, y)
    single = tg.gramian(ref, batch_dim=0)(ref_params, x, y)
    single_leaf = tg.gramian(ref, batch_dim=0, per_leaf=True)(ref_params, x, y)
    update, info = tg.distributed.aggregated_grad(f, tg.weighting.upgrad, batch_dim=0)(
        params, x, y)
    single_update, _ = tg.aggregated_grad(ref, tg.weighting.upgrad, batch_dim=0)(
        ref_params, x, y)
    return {"placements": placements,
            "gramian": float((gramian - single).abs().max()),
            "per leaf": max(float((per_leaf[k] - single_leaf[k]).abs().max())
                            for k in per_leaf),
            "update": max(float((update[k].full_tensor() - single_update[k]).abs().max())
                          for k in update),
            "update types": sorted({type(u).__name__ for u in update.values()}),
            "digest": digest(gramian) + digest(info.weights)}


def _tp_change_after_the_gramian(rank: int) -> dict[str, Any]:
    """NOTE [evaluations after the backend]: ``f`` changes in its last evaluation of a step,
    after the Gramian was reduced over the mesh. That evaluation raised torchgram's internal
    ``OutputChanged``; now each rank raises the user's error, and no write lands."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model, x, y, _, _ = _setup(rank)
    parallelize_module(model, init_device_mesh("cpu", (2,)),
                       {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fn, params = tg.functionalize(model)
    counts = torch.zeros(3, dtype=torch.float64)

    def attempt(change: str) -> tuple[str, str]:
        state = {"calls": 0, "at": -1}

        def f(p: Any, x: Tensor, y: Tensor) -> Tensor:
            state["calls"] += 1
            losses = _losses(fn(p, x), y)
            if state["calls"] == state["at"]:  # the step's last evaluation
                if change == "write":
                    counts.add_(1.0)
                else:
                    return losses[:-1]
            return losses

        step = tg.distributed.aggregated_grad(f, tg.weighting.upgrad, batch_dim=0)
        step(params, x, y)
        before = state["calls"]
        step(params, x, y)  # under the cached probe: how many evaluations a step makes
        state["at"] = 2 * state["calls"] - before
        try:
            step(params, x, y)
        except Exception as error:  # noqa: BLE001 -- the test reads its type
            return type(error).__name__, str(error)
        return "no error", ""

    out: dict[str, Any] = {change: attempt(change) for change in ("output", "write")}
    out["counts"] = counts.tolist()
    return out


def _two_dim_mesh(rank: int) -> tuple[str, str]:
    """A DTensor parameter on a 2-D mesh: a clear error on every rank, before any exchange."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    weight = distribute_tensor(torch.randn(4, 3, dtype=torch.float64), mesh,
                               [Shard(0), Replicate()])
    try:
        tg.distributed.gramian(lambda p, x: p["w"].sum() * x)({"w": weight},
                                                              torch.ones(2))
    except NotImplementedError as error:
        return type(error).__name__, str(error)
    return "no error", ""



def _one_rank_without_grad(rank: int) -> dict[str, str]:
    """Rank 1's losses do not require grad: every call raises on both ranks (rank 1 used to
    raise before the exchange, leaving rank 0 waiting until the process group's timeout)."""
    from torch.nn.parallel import DistributedDataParallel

    model, _, _, xl, yl = _setup(rank)
    ddp = DistributedDataParallel(model)
    calls = {
        "gramian": lambda losses: tg.distributed.autograd.gramian(losses, ddp),
        "backward": lambda losses: tg.distributed.autograd.backward(
            losses, ddp, tg.weighting.upgrad),
        "local backward": lambda losses: tg.distributed.autograd.backward(
            losses, ddp, tg.weighting.upgrad, cross_rank="local"),
    }
    out = {}
    for name, call in calls.items():
        with torch.no_grad() if rank == 1 else torch.enable_grad():
            losses = _losses(ddp(xl), yl)
        try:
            call(losses)
            out[name] = "no error"
        except ValueError as error:
            out[name] = str(error)
    ddp.zero_grad()
    out["then it still works"] = digest(tg.distributed.autograd.gramian(_losses(ddp(xl), yl), ddp))
    return out


def worker(checks: Checks, rank: int, world: int) -> None:
    assert world == 2
    checks.run("ddp", lambda: _ddp(rank))
    checks.run("ddp static graph", lambda: _ddp(rank, static_graph=True))
    checks.run("fsdp", lambda: _fsdp(rank))
    checks.run("fsdp internals", lambda: _fsdp_internals(rank))
    checks.run("tensor parallel", lambda: _tensor_parallel(rank))
    checks.run("tensor parallel change", lambda: _tp_change_after_the_gramian(rank))
    checks.run("2-D mesh", lambda: _two_dim_mesh(rank))
    checks.run("one rank without grad", lambda: _one_rank_without_grad(rank))


@pytest.fixture(scope="module")
def results(distributed_results: dict[str, Results]) -> Results:
    return distributed_results[MODULE]


@pytest.mark.parametrize("check", ["ddp", "ddp static graph"])
def test_ddp_step_is_the_single_process_step(results: list[dict[str, Any]], check: str) -> None:
    first, second = outcome(results, check)
    for value in (first, second):
        assert value["weights"] < TOL and value["gramian"] < TOL and value["grads"] < TOL
        assert value["local gramian"] < TOL and value["local weights"] < TOL
        assert value["local grads"] < TOL
    assert first["digest"] == second["digest"]


def test_fsdp2_step_is_the_single_process_step(results: list[dict[str, Any]]) -> None:
    first, second = outcome(results, "fsdp")
    for value in (first, second):
        assert value["eager gramian"] < TOL
        assert value["weights"] < TOL and value["grads"] < TOL
    assert first["digest"] == second["digest"]


def test_fsdp2_functionalize_gives_whole_parameters(results: list[dict[str, Any]]) -> None:
    first, second = outcome(results, "fsdp")
    assert first["params"] == ["Tensor"] * 4
    assert first["functional"] < TOL and second["functional"] < TOL
    assert first["functional digest"] == second["functional digest"]


def test_the_fsdp2_internals_torchgram_reads_are_where_it_reads_them(
        results: Results) -> None:
    for value in outcome(results, "fsdp internals"):
        assert value["params"] == ["FSDPLinear.bias", "FSDPLinear.bias", "FSDPLinear.weight",
                                   "FSDPLinear.weight"], value
        assert value["shards are DTensors"]
        assert sorted(value["whole after forward"]) == [(3,), (3, 8), (8,), (8, 6)]
        assert value["original class"] == "Linear" and value["plain module"] is None
        assert value["forward hooks"] >= 2  # pre-forward and forward hooks
        assert value["post-backward node"]


def test_single_process_apis_refuse_sharded_parameters(results: list[dict[str, Any]]) -> None:
    first, _ = outcome(results, "fsdp")
    assert "torchgram.distributed.autograd" in first["autograd"]
    assert "torchgram.distributed.gramian" in first["gramian of DTensors"]


def test_tensor_parallel_sums_shard_blocks_and_counts_replicas_once(
        results: list[dict[str, Any]]) -> None:
    first, second = outcome(results, "tensor parallel")
    assert first["placements"]["2.bias"] == "(Replicate(),)"
    assert first["placements"]["0.weight"] == "(Shard(dim=0),)"
    for value in (first, second):
        assert value["gramian"] < TOL and value["per leaf"] < TOL and value["update"] < TOL
    assert first["update types"] == ["DTensor"]
    assert first["digest"] == second["digest"]


def test_tensor_parallel_change_after_the_gramian_is_the_users_error(
        results: Results) -> None:
    for value in outcome(results, "tensor parallel change"):
        kind, text = value["output"]  # one sample dropped in that evaluation
        assert kind == "ValueError" and "one entry per sample along batch_dim" in text, text
        assert "torchgram.distributed.aggregated_grad" in text, text
        kind, text = value["write"]
        assert kind == "ValueError" and "torchgram.distributed.aggregated_grad" in text, text
        assert value["counts"] == [0.0, 0.0, 0.0]


def test_tensor_parallel_on_a_2d_mesh_is_refused_clearly(results: Results) -> None:
    for error, text in outcome(results, "2-D mesh"):
        assert error == "NotImplementedError" and "1-D device mesh" in text, text


def test_a_rank_whose_losses_fail_the_checks_fails_every_rank(results: Results) -> None:
    first, second = outcome(results, "one rank without grad")
    for name in ("gramian", "backward", "local backward"):
        assert "outputs that require grad" in second[name], second[name]
        assert "rank 1" in first[name] and "outputs that require grad" in first[name], first
    assert first["then it still works"] == second["then it still works"]
