"""torchgram.distributed on 2 gloo ranks, data parallel: each rank its own samples.

The session's ranks run every check (``worker``, ``spawning``); each test reads its check's
results on both ranks: the Gramian equals the single-process ``tg.gramian`` on the
concatenated batch and the dense oracle, and it is bit-identical on the two ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from spawning import Checks, Results, digest, outcome
from torch import Tensor, nn

import torchgram as tg

MODULE = "test_data_parallel"

# (zoo model, samples of rank 0, samples of rank 1): uneven splits, and empty ranks
ZOO = [("mlp", 3, 2), ("mlp_logits", 1, 4), ("cnn", 2, 3), ("conv_variants", 4, 1),
       ("transformer", 3, 2), ("embedding", 5, 0), ("tied_lm", 2, 3), ("reused_module", 0, 5),
       ("frozen_norm", 3, 2), ("elementwise", 2, 3), ("nested_pytree", 1, 4),
       ("raw_matmul", 3, 2), ("batch_on_dim1", 2, 3), ("attention", 4, 1),
       ("pytree_output", 3, 2)]
DENSE = [("mlp", 3, 2), ("coupled_batch", 2, 3), ("embedding", 4, 1)]
TOL = 1e-10


def _split(case: Any, rank: int, sizes: tuple[int, int]) -> tuple[Any, ...]:
    dim = case.in_dims if isinstance(case.in_dims, int) else 0
    start, count = sum(sizes[:rank]), sizes[rank]
    return tuple(x.narrow(dim, start, count) if isinstance(x, Tensor) else x
                 for x in case.inputs)


def _zoo(name: str, sizes: tuple[int, int], rank: int) -> dict[str, Any]:
    import zoo
    from reference import dense_gramian

    case = zoo.build(name)
    options = {"batch_dim": case.batch_dim, "in_dims": case.in_dims}
    local = _split(case, rank, sizes)
    got = tg.distributed.gramian(case.f, **options)(case.params, *local)
    single = tg.gramian(case.f, **options)(case.params, *case.inputs)
    oracle = dense_gramian(case.f, case.args).shaped()
    exchange = tg.distributed.explain(case.f, **options)(case.params, *local)
    return {"single": float((got - single).abs().max()),
            "oracle": float((got.reshape(oracle.shape) - oracle).abs().max()),
            "digest": digest(got), "kinds": sorted({leaf.kind for leaf in exchange.leaves}),
            "received": exchange.received, "mode": exchange.mode}


def _dense(name: str, sizes: tuple[int, int], rank: int) -> dict[str, Any]:
    """No batch_dim: the rows are every rank's outputs, rank after rank."""
    import zoo
    from reference import dense_gramian

    case = zoo.build(name)
    local = _split(case, rank, sizes)
    parts = [_split(case, r, sizes) for r in range(2)]

    def both(params: Any) -> Tensor:  # the rows of rank 0, then those of rank 1
        return torch.cat([case.f(params, *part).reshape(-1) for part in parts if
                          part[0].shape[0 if case.in_dims == 0 else case.in_dims]])

    got = tg.distributed.gramian(case.f)(case.params, *local)
    oracle = dense_gramian(both, (case.params,)).gramian
    update, info = tg.distributed.aggregated_grad(case.f, tg.weighting.upgrad)(case.params,
                                                                              *local)
    single, single_info = tg.aggregated_grad(both, tg.weighting.upgrad)(case.params)
    return {"oracle": float((got - oracle).abs().max()), "digest": digest(got),
            "update": max(float((update[k] - single[k]).abs().max()) for k in update),
            "weights": float((info.weights - single_info.weights).abs().max()),
            "update digest": digest(update)}


def _mlp(rank: int, sizes: tuple[int, int] = (3, 2)) -> tuple[Any, ...]:
    import zoo

    case = zoo.build("mlp")
    return case, _split(case, rank, sizes)


def _options(rank: int) -> dict[str, Any]:
    """diagonal, per_leaf, backend='jacobian', chunk_size, has_aux, against tg.gramian."""
    case, local = _mlp(rank)
    out = {}
    for label, options in [("diagonal", {"diagonal": True}), ("per_leaf", {"per_leaf": True}),
                           ("jacobian", {"backend": "jacobian"}),
                           ("chunk_size", {"chunk_size": 1})]:
        got = tg.distributed.gramian(case.f, batch_dim=0, **options)(case.params, *local)
        single = tg.gramian(case.f, batch_dim=0, **options)(case.params, *case.inputs)
        if isinstance(got, dict):
            err = max(float((got[k] - single[k]).abs().max()) for k in got)
        else:
            err = float((got - single).abs().max())
        out[label] = (err, digest(got))
    exchange = tg.distributed.explain(case.f, batch_dim=0, backend="jacobian")(case.params,
                                                                               *local)
    out["jacobian kinds"] = sorted({leaf.kind for leaf in exchange.leaves})

    def with_aux(p: Any, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        return case.f(p, x, y), x.sum()

    G, aux = tg.distributed.gramian(with_aux, batch_dim=0, has_aux=True)(case.params, *local)
    out["aux"] = float((aux - local[0].sum()).abs())
    return out


def _step(rank: int) -> dict[str, Any]:
    """aggregated_grad: the update and weights of the single-process step, on both ranks."""
    case, local = _mlp(rank, (2, 3))
    update, info = tg.distributed.aggregated_grad(case.f, tg.weighting.upgrad, batch_dim=0)(
        case.params, *local)
    single, single_info = tg.aggregated_grad(case.f, tg.weighting.upgrad, batch_dim=0)(
        case.params, *case.inputs)
    local_update, local_info = tg.distributed.aggregated_grad(
        case.f, tg.weighting.mean, batch_dim=0, cross_rank="local")(case.params, *local)
    mean_update, _ = tg.aggregated_grad(case.f, tg.weighting.mean, batch_dim=0)(
        case.params, *local)
    return {"update": max(float((update[k] - single[k]).abs().max()) for k in update),
            "weights": float((info.weights - single_info.weights).abs().max()),
            "gramian": float((info.gramian - single_info.gramian).abs().max()),
            "digest": digest(update) + digest(info.weights),
            "local shape": tuple(local_info.gramian.shape), "local update": digest(local_update),
            "own mean": {k: v.clone() for k, v in mean_update.items()},
            "local mean": {k: v.clone() for k, v in local_update.items()}}


def _local(rank: int) -> dict[str, Any]:
    """cross_rank="local": each rank's own Gramian, no communication."""
    case, local = _mlp(rank)
    got = tg.distributed.gramian(case.f, batch_dim=0, cross_rank="local")(case.params, *local)
    own = tg.gramian(case.f, batch_dim=0)(case.params, *local)
    # NOTE [local steps fail together]: a rank without samples adds a zero update
    mine = local if rank == 0 else tuple(t[:0] for t in local)
    update, info = tg.distributed.aggregated_grad(
        case.f, tg.weighting.mean, batch_dim=0, cross_rank="local")(case.params, *mine)
    first, _ = tg.aggregated_grad(case.f, tg.weighting.mean, batch_dim=0)(case.params, *mine) \
        if rank == 0 else (update, None)
    return {"shape": tuple(got.shape), "own": float((got - own).abs().max()),
            "empty rank": digest(update), "empty shape": tuple(info.gramian.shape),
            "half of rank 0's": max(float((update[k] - first[k] / 2).abs().max())
                                    for k in update) if rank == 0 else 0.0}


def _no_graph(rank: int) -> dict[str, Any]:
    """Parameters that require grad: results without a graph (the same on every rank), and
    a call under torch.func.grad refused on every rank."""
    case, local = _mlp(rank)
    params = {k: v.clone().requires_grad_() for k, v in case.params.items()}
    G = tg.distributed.gramian(case.f, batch_dim=0)(params, *local)
    update, info = tg.distributed.aggregated_grad(case.f, tg.weighting.upgrad, batch_dim=0)(
        params, *local)
    single = tg.gramian(case.f, batch_dim=0)(case.params, *case.inputs)
    under = _error(lambda: torch.func.grad(
        lambda p: tg.distributed.gramian(case.f, batch_dim=0)(p, *local).sum())(case.params))
    return {"requires grad": [G.requires_grad, info.gramian.requires_grad,
                              info.weights.requires_grad,
                              *(u.requires_grad for u in update.values())],
            "single": float((G - single).abs().max()), "under grad": under}


def _dropout(rank: int) -> dict[str, Any]:
    """f draws random numbers: one draw per rank, each rank's block that of its own draw.

    With every leaf tapped the batched pass sees the draw of one plain call (rows by
    samples); with a leaf on the fallback, per-sample evaluation cannot, and every rank
    sends the rows of its whole batch (rows by ranks).
    """
    case, local = _mlp(rank)
    drop = nn.Dropout(0.5)

    def noisy(p: Any, x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(drop(torch.func.functional_call(case.module, p, (x,))), y,
                               reduction="none")

    def noisy_fallback(p: Any, x: Tensor, y: Tensor) -> Tensor:
        return noisy(p, x, y) * p["0.bias"].sum()  # 0.bias used outside every rule

    out = {}
    for label, f in [("batched", noisy), ("fallback", noisy_fallback)]:
        torch.manual_seed(rank)
        exchange = tg.distributed.explain(f, batch_dim=0)(case.params, *local)
        torch.manual_seed(rank)
        got = tg.distributed.gramian(f, batch_dim=0)(case.params, *local)
        torch.manual_seed(rank)
        own = tg.gramian(f)(case.params, *local)
        start, count = (0, 3) if rank == 0 else (3, 2)
        block = got[start:start + count, start:start + count]
        out[label] = {"mode": exchange.mode, "own block": float((block - own).abs().max()),
                      "digest": digest(got)}
    return out


def _error(fn: Any) -> tuple[str, str]:
    try:
        fn()
    except Exception as error:  # noqa: BLE001
        return type(error).__name__, str(error)
    return "no error", ""


def _errors(rank: int) -> dict[str, tuple[str, str]]:
    """Every rank raises (none hangs): its own error, or the failing rank's."""
    import zoo

    case, local = _mlp(rank)
    coupled = zoo.build("coupled_batch")
    x = _split(coupled, rank, (3, 2))
    out = {"coupled": _error(lambda: tg.distributed.gramian(coupled.f, batch_dim=0)(
        coupled.params, *x))}

    def failing(p: Any, x: Tensor, y: Tensor) -> Tensor:
        if rank == 1:
            raise ValueError("no data on this rank's disk")
        return case.f(p, x, y)

    out["one rank fails"] = _error(lambda: tg.distributed.gramian(failing, batch_dim=0)(
        case.params, *local))

    def communicating(p: Any, x: Tensor, y: Tensor) -> Tensor:
        losses = case.f(p, x, y)
        total = losses.detach().sum()
        torch.distributed.all_reduce(total)  # what SyncBatchNorm does in training mode
        return losses

    out["collective in f"] = _error(lambda: tg.distributed.gramian(communicating, batch_dim=0)(
        case.params, *local))

    def per_rank_width(p: Any, x: Tensor, y: Tensor) -> Tensor:
        losses = case.f(p, x, y)
        return losses[:, None].expand(-1, 1 + rank)

    out["outputs differ"] = _error(lambda: tg.distributed.gramian(per_rank_width, batch_dim=0)(
        case.params, *local))
    shifted = {k: v + 0.1 * rank for k, v in case.params.items()}
    out["other parameters on one rank"] = _error(lambda: tg.distributed.gramian(
        case.f, batch_dim=0)(shifted, *local))
    out["local step, one rank fails"] = _error(lambda: tg.distributed.aggregated_grad(
        failing, tg.weighting.mean, batch_dim=0, cross_rank="local")(case.params, *local))
    out["weighting fails"] = _error(lambda: tg.distributed.aggregated_grad(
        case.f, lambda G: G.sum(0)[:1], batch_dim=0)(case.params, *local))
    out["no samples anywhere"] = _error(lambda: tg.distributed.gramian(case.f, batch_dim=0)(
        case.params, local[0][:0], local[1][:0]))
    w = torch.randn(3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    xs = torch.randn(2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def random_centred(w: Tensor, x: Tensor) -> Tensor:  # dropout, then samples interact
        h = F.dropout(torch.tanh(x @ w), 0.5)
        return (h - h.mean(0)).pow(2).sum(-1)

    def random_per_sample(w: Tensor, x: Tensor) -> Tensor:
        return F.dropout(torch.tanh(x @ w), 0.5).pow(2).sum(-1)

    one_sample = xs[rank:rank + 1]
    out["random, one sample per rank, coupled"] = _error(
        lambda: tg.distributed.gramian(random_centred, batch_dim=0)(w, one_sample))
    out["random, one sample per rank"] = _error(
        lambda: tg.distributed.gramian(random_per_sample, batch_dim=0)(w, one_sample))
    # NOTE [the same call on every rank]: raw IndexError / gloo's abort before session 66
    out["diagonal on one rank"] = _error(lambda: tg.distributed.gramian(
        case.f, batch_dim=0, diagonal=rank == 1)(case.params, *local))
    out["per_leaf on one rank"] = _error(lambda: tg.distributed.gramian(
        case.f, batch_dim=0, per_leaf=rank == 1)(case.params, *local))
    out["another backend on one rank"] = _error(lambda: tg.distributed.gramian(
        case.f, batch_dim=0, backend="jacobian" if rank else "auto")(case.params, *local))
    # one call spelled two ways is no mismatch (falsely refused at first: the second review)
    spelled = tg.distributed.gramian(case.f, batch_dim=-1 if rank else 0,
                                     argnums=-3 if rank else (0,))(case.params, *local)
    plain = tg.distributed.gramian(case.f, batch_dim=0)(case.params, *local)
    out["one call spelled two ways"] = ("no error", "") if torch.equal(spelled, plain) else (
        "mismatch", f"{spelled} against {plain}")
    for name, bad in (("inf", float("inf")), ("nan", float("nan"))):  # the same on every rank
        broken = {k: v.clone() for k, v in case.params.items()}
        next(iter(broken.values())).view(-1)[0] = bad
        single = tg.gramian(case.f, batch_dim=0)(broken, *case.inputs)
        mine = tg.distributed.gramian(case.f, batch_dim=0)(broken, *local)
        out[f"{name} in a parameter"] = ("no error", "") if torch.equal(
            mine.isnan(), single.isnan()) and torch.allclose(
            mine.nan_to_num(), single.nan_to_num(), rtol=1e-10, atol=1e-12) else (
            "mismatch", f"{mine} against {single}")
    out["then it still works"] = ("ok", digest(tg.distributed.gramian(case.f, batch_dim=0)(
        case.params, *local)))
    return out


def _benchmark(rank: int) -> list[dict[str, Any]]:
    """benchmarks/distributed.py's per-rank measurement, on tiny sizes."""
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:  # `benchmarks` is a top-level folder, not an installed package
        sys.path.insert(0, root)
    from benchmarks import cases
    from benchmarks.distributed import measure_case, render

    measured = [measure_case(name, cases.QUICK, reps=1) for name in ("mlp", "multitask")]
    render([[m] for m in measured], "header")  # the page renders (one rank's figures)
    return measured


def worker(checks: Checks, rank: int, world: int) -> None:
    assert world == 2
    for name, *sizes in ZOO:
        checks.run(f"zoo {name}", lambda n=name, s=tuple(sizes): _zoo(n, s, rank))
    for name, *sizes in DENSE:
        checks.run(f"dense {name}", lambda n=name, s=tuple(sizes): _dense(n, s, rank))
    checks.run("options", lambda: _options(rank))
    checks.run("step", lambda: _step(rank))
    checks.run("local", lambda: _local(rank))
    checks.run("no graph", lambda: _no_graph(rank))
    checks.run("dropout", lambda: _dropout(rank))
    checks.run("errors", lambda: _errors(rank))
    checks.run("benchmark", lambda: _benchmark(rank))


@pytest.fixture(scope="module")
def results(distributed_results: dict[str, Results]) -> Results:
    return distributed_results[MODULE]


@pytest.mark.parametrize("name", [z[0] for z in ZOO])
def test_zoo_gramian_is_the_single_process_one_on_every_rank(
        results: list[dict[str, Any]], name: str) -> None:
    first, second = outcome(results, f"zoo {name}")
    for value in (first, second):
        assert value["single"] < TOL and value["oracle"] < TOL, value
        assert value["mode"] == "samples"
    assert first["digest"] == second["digest"]  # bit-identical on both ranks


def test_both_payload_kinds_travel(results: list[dict[str, Any]]) -> None:
    kinds = {kind for name, *_ in ZOO for kind in outcome(results, f"zoo {name}")[0]["kinds"]}
    assert {"factors", "jacobian"} <= kinds
    mlp = outcome(results, "zoo mlp")[0]
    assert mlp["kinds"] == ["factors"] and sum(mlp["received"]) > 0
    empty = outcome(results, "zoo embedding")[0]  # rank 1 has no samples: nothing moves
    assert empty["received"] == (0, 0)


@pytest.mark.parametrize("name", [d[0] for d in DENSE])
def test_without_batch_dim_rows_are_every_rank_outputs_in_rank_order(
        results: list[dict[str, Any]], name: str) -> None:
    first, second = outcome(results, f"dense {name}")
    for value in (first, second):
        assert value["oracle"] < TOL and value["update"] < TOL and value["weights"] < TOL
    assert first["digest"] == second["digest"]
    assert first["update digest"] == second["update digest"]


def test_options_match_the_single_process_call(results: list[dict[str, Any]]) -> None:
    first, second = outcome(results, "options")
    for label in ("diagonal", "per_leaf", "jacobian", "chunk_size"):
        assert first[label][0] < TOL, label
        assert first[label][1] == second[label][1], label
    assert first["jacobian kinds"] == ["jacobian"]
    assert first["aux"] == 0.0 and second["aux"] == 0.0  # each rank gets its own aux


def test_a_step_is_the_single_process_step_identical_on_every_rank(
        results: list[dict[str, Any]]) -> None:
    first, second = outcome(results, "step")
    for value in (first, second):
        assert value["update"] < TOL and value["weights"] < TOL and value["gramian"] < TOL
    assert first["digest"] == second["digest"]
    # cross_rank="local": each rank's own block, updates averaged like DDP averages them
    assert first["local shape"] == (2, 2) and second["local shape"] == (3, 3)
    assert first["local update"] == second["local update"]
    for key, value in first["local mean"].items():
        expected = (first["own mean"][key] + second["own mean"][key]) / 2
        torch.testing.assert_close(value, expected)


def test_local_gramian_is_each_rank_own(results: Results) -> None:
    first, second = outcome(results, "local")
    assert first["shape"] == (3, 3) and second["shape"] == (2, 2)
    assert first["own"] < TOL and second["own"] < TOL
    assert first["empty rank"] == second["empty rank"] and second["empty shape"] == (0, 0)
    assert first["half of rank 0's"] < TOL


def test_no_gradient_flows_through_the_exchange(results: Results) -> None:
    for value in outcome(results, "no graph"):
        assert not any(value["requires grad"]), value
        assert value["single"] < TOL
        error, text = value["under grad"]
        assert error == "RuntimeError" and "outside torch.func transforms" in text, text


def test_random_f_gives_each_rank_block_of_its_own_draw(
        results: list[dict[str, Any]]) -> None:
    first, second = outcome(results, "dropout")
    assert first["batched"]["mode"] == "samples" and first["fallback"]["mode"] == "ranks"
    for label in ("batched", "fallback"):
        assert first[label]["own block"] < TOL and second[label]["own block"] < TOL
        assert first[label]["digest"] == second[label]["digest"]


@pytest.mark.parametrize(("check", "error", "text"), [
    ("coupled", "ValueError", "batch_norm in training mode"),
    ("one rank fails", "ValueError", "no data on this rank's disk"),
    ("local step, one rank fails", "ValueError", "no data on this rank's disk"),
    ("other parameters on one rank", "ValueError", "other parameters on rank 1 than on rank 0"),
    ("collective in f", "RuntimeError", "collective"),
    ("outputs differ", "ValueError", "outputs of one structure"),
    ("weighting fails", "TypeError", "weighting"),
    ("no samples anywhere", "ValueError", "at least one rank with samples"),
    ("random, one sample per rank, coupled", "ValueError", "the samples interact"),
    ("random, one sample per rank", "no error", ""),
    ("diagonal on one rank", "ValueError", "diagonal=True against False on rank 1"),
    ("per_leaf on one rank", "ValueError", "per_leaf=True against False on rank 1"),
    ("another backend on one rank", "ValueError", "backend='jacobian' against 'auto'"),
    ("one call spelled two ways", "no error", ""),
    ("inf in a parameter", "no error", ""),
    ("nan in a parameter", "no error", ""),
])
def test_errors_are_raised_on_every_rank(results: list[dict[str, Any]], check: str, error: str,
                                         text: str) -> None:
    first, second = outcome(results, "errors")
    for value in (first, second):
        assert value[check][0] == error, value[check]
        assert text in value[check][1], value[check]
    assert first["then it still works"] == second["then it still works"]


def test_benchmark_script_measures_bytes_and_checks_the_gramian(results: Results) -> None:
    first, second = outcome(results, "benchmark")
    for per_rank in (first, second):
        mlp, multitask = per_rank
        assert mlp["mode"] == "samples" and multitask["mode"] == "ranks"
        for case in per_rank:
            assert case["rel_error"] < 1e-5  # float32
            assert 0 < case["received"] < case["received_per_sample_grads"]
    assert first[0]["all_reduce"] == second[0]["all_reduce"] > 0
