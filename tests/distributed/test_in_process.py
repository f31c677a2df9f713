"""The data-parallel machinery in one process: ranks simulated, payloads through bytes.

Each simulated rank runs its local phase on its part of the batch; the summaries are
agreed on; every leaf's payloads are packed to bytes, unpacked and concatenated at its
owner, as the collectives would; the owners' blocks summed and put in the global order
must be the single-process Gramian of the whole batch (NOTE [data-parallel Gramian]).
Three ranks, uneven and empty, every zoo model, every payload kind and row layout.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import optree
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import torchgram as tg
import zoo
from reference import dense_gramian
from torchgram._core.options import Options
from torchgram.backends.structured.cost import Sizes
from torchgram.backends.structured.payloads import contract_payload, payload_way
from torchgram.distributed._agreement import (
    LeafSummary,
    OutputDesc,
    RankSummary,
    TensorDesc,
    agree,
    raise_any_error,
)
from torchgram.distributed._data_parallel import (
    _received_descs,
    _sendable,
    local_phase,
)
from torchgram.distributed._payloads import concatenate, pack, unpack, wire_tensors
from torchgram.distributed._rows import layout_index, shape_global, to_global_order

TOL = 1e-10
CPU = torch.device("cpu")


def _split(case: Any, sizes: tuple[int, ...]) -> list[tuple[Any, ...]]:
    dim = case.in_dims if isinstance(case.in_dims, int) else 0
    parts = []
    for rank, count in enumerate(sizes):
        start = sum(sizes[:rank])
        parts.append(tuple(x.narrow(dim, start, count) if isinstance(x, Tensor) else x
                           for x in case.inputs))
    return parts


def simulate(f: Any, params: Any, parts: list[tuple[Any, ...]], *, seeds: list[int] | None = None,
             force_jacobian: bool = False, **options: Any) -> Tensor:
    """What every rank of ``torchgram.distributed.gramian`` returns, computed in-process."""
    return simulate_calls(f, [((params, *part), {}) for part in parts], seeds=seeds,
                          force_jacobian=force_jacobian, **options)


def simulate_calls(f: Any, calls: list[tuple[tuple[Any, ...], dict[str, Any]]], *,
                   seeds: list[int] | None = None, force_jacobian: bool = False,
                   **options: Any) -> Tensor:
    """:func:`simulate` with every rank's whole call ``(args, kwargs)``."""
    validated = Options.validate("test", f, **options)
    locals_ = []
    for rank, (args, kwargs) in enumerate(calls):
        if seeds is not None:
            torch.manual_seed(seeds[rank])
        locals_.append(local_phase(validated, f, args, kwargs))
    summaries = [local.summary for local in locals_]
    raise_any_error("test", [summary.error for summary in summaries], 0, locals_[0].error)
    agreement = agree("test", summaries, force_jacobian=force_jacobian)
    leaves = next(local.diff.leaves for local in locals_ if local.diff is not None)
    n = agreement.rows * agreement.total
    total = torch.zeros(n, n, dtype=torch.float64)
    for i, agreed in enumerate(agreement.leaves):
        if agreed.owner is None:
            continue
        received: list[list[Tensor] | None] = [None] * len(calls)
        for source in agreed.sources:
            tensors = wire_tensors(_sendable(locals_[source], agreement)[i], agreed.kind,
                                   leaves[i])
            descs = _received_descs(summaries[source], agreement, i, source)
            received[source] = unpack(pack(tensors, CPU), descs, CPU)  # through bytes
        own = _sendable(locals_[agreed.owner], agreement)[i]
        combined = concatenate(own, agreed.kind, received, agreement.sizes, agreement.rows,
                               per_rank=agreement.mode == "ranks")
        sizes = Sizes(agreement.total, agreement.rows, False, 8)
        way = payload_way(combined, leaves[i].numel(), sizes, None)
        block = contract_payload(combined, leaves[i].numel(), agreement.rows, agreement.total,
                                 diagonal=False, dtype=torch.float64, way=way)
        if block is not None:
            total += block.reshape(n, n)
    ordered = to_global_order(total, layout_index(agreement, CPU), diagonal=False)
    return shape_global(ordered, agreement, diagonal=False)


BATCHED = [name for name in zoo.NAMES if zoo.build(name).batch_dim is not None]


@pytest.mark.parametrize("sizes", [(2, 0, 3), (1, 1, 3)], ids=["empty-rank", "uneven"])
@pytest.mark.parametrize("name", BATCHED)
def test_gathered_payloads_give_the_single_process_gramian(name: str,
                                                            sizes: tuple[int, ...]) -> None:
    case = zoo.build(name)
    options = {"batch_dim": case.batch_dim, "in_dims": case.in_dims}
    expected = tg.gramian(case.f, **options)(case.params, *case.inputs)
    got = simulate(case.f, case.params, _split(case, sizes), **options)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["mlp", "cnn", "embedding", "tied_lm", "attention"])
def test_jacobian_payloads_give_the_same_gramian(name: str) -> None:
    case = zoo.build(name)
    options = {"batch_dim": case.batch_dim, "in_dims": case.in_dims}
    expected = tg.gramian(case.f, **options)(case.params, *case.inputs)
    got = simulate(case.f, case.params, _split(case, (3, 2)), force_jacobian=True, **options)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["mlp", "embedding", "coupled_batch", "pytree_output"])
def test_rows_by_rank_without_batch_dim(name: str) -> None:
    case = zoo.build(name)
    parts = _split(case, (2, 0, 3))

    def both(params: Any) -> Tensor:
        return torch.cat([torch.cat([leaf.reshape(-1) for leaf in
                                     optree.tree_leaves(case.f(params, *part))])
                          for part in parts if part[0].shape[0]])

    expected = dense_gramian(both, (case.params,)).gramian
    got = simulate(case.f, case.params, parts)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)


def test_ranks_that_ran_per_sample_and_by_rows_meet() -> None:
    """A rank whose f draws random numbers sends its batch's rows; another its samples'."""
    case = zoo.build("mlp")
    drop = nn.Dropout(0.5)

    def f(p: Any, x: Tensor, y: Tensor) -> Tensor:
        logits = torch.func.functional_call(case.module, p, (x,)) * p["0.bias"].sum()
        return F.cross_entropy(drop(logits) if x.shape[0] > 2 else logits, y,
                               reduction="none")

    parts = _split(case, (3, 2))
    got = simulate(f, case.params, parts, seeds=[7, 0], batch_dim=0)

    def both(params: Any) -> Tensor:
        torch.manual_seed(7)
        return torch.cat([f(params, *part) for part in parts])

    expected = dense_gramian(both, (case.params,)).gramian
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)


def _summary(mode: str, samples: int, leaves: tuple[LeafSummary, ...]) -> RankSummary:
    output = OutputDesc(optree.tree_structure(0), ((1,),), (0,), ("torch.float64",),
                        "torch.float64")
    return RankSummary(None, mode, samples, 1, samples, output, leaves)  # type: ignore[arg-type]


def test_agreement_takes_the_smaller_payload_and_balances_owners() -> None:
    def leaf(factor_bytes: int, jacobian_bytes: int) -> LeafSummary:
        return LeafSummary(False, ("sig",), (TensorDesc((factor_bytes // 8,), "torch.float64"),),
                           TensorDesc((1, 1, jacobian_bytes // 8), "torch.float64"))

    small = leaf(64, 800)  # factors smaller
    large = leaf(800, 64)  # Jacobian smaller
    summaries = [_summary("samples", 2, (small, large, LeafSummary(True))),
                 _summary("samples", 3, (small, large, LeafSummary(True)))]
    agreement = agree("test", summaries, force_jacobian=False)
    assert [a.kind for a in agreement.leaves] == ["factors", "jacobian", "zero"]
    assert agreement.leaves[2].owner is None
    assert {agreement.leaves[0].owner, agreement.leaves[1].owner} == {0, 1}  # balanced
    forced = agree("test", summaries, force_jacobian=True)
    assert [a.kind for a in forced.leaves] == ["jacobian", "jacobian", "zero"]
    # one rank without factors for a leaf: the Jacobian for all
    mixed = [summaries[0], _summary("samples", 3, (LeafSummary(False, None, (), small.jacobian),
                                                   large, LeafSummary(True)))]
    assert agree("test", mixed, force_jacobian=False).leaves[0].kind == "jacobian"
    # a rank by rows: every rank by rows, Jacobians only
    by_rows = [summaries[0], _summary("ranks", 1, (small, large, LeafSummary(True)))]
    agreement = agree("test", by_rows, force_jacobian=False)
    assert agreement.mode == "ranks" and agreement.convert
    assert agreement.leaves[0].kind == "jacobian"


def test_any_error_is_raised_on_every_rank() -> None:
    failed = RankSummary(("ValueError", "boom"), "empty")
    fine = _summary("samples", 2, ())
    with pytest.raises(ValueError, match="rank 1 of the group failed.*boom"):
        raise_any_error("api", [fine.error, failed.error], 0, None)
    own = KeyError("mine")
    with pytest.raises(KeyError, match="mine"):
        raise_any_error("api", [fine.error, failed.error], 1, own)
    raise_any_error("api", [fine.error, fine.error], 0, None)


def test_configuration_errors_at_build_time() -> None:
    with pytest.raises(TypeError, match="group to be None, a ProcessGroup"):
        tg.distributed.gramian(abs, group="world")
    with pytest.raises(ValueError, match="cross_rank"):
        tg.distributed.gramian(abs, cross_rank="global")
    with pytest.raises(ValueError, match="backend to be one of"):
        tg.distributed.aggregated_grad(abs, tg.weighting.mean, backend="ntvp")
    with pytest.raises(TypeError, match="weighting"):
        tg.distributed.aggregated_grad(abs, tg.weighting.mean(torch.eye(2)))
    losses = torch.ones(2, requires_grad=True) * 2
    # the eager API checks its options before it looks for a process group
    with pytest.raises(ValueError, match="chunk_size to be a positive int"):
        tg.distributed.autograd.gramian(losses, [losses], chunk_size=0)
    with pytest.raises(TypeError, match="chunk_size to be None or a positive int"):
        tg.distributed.autograd.backward(losses, [losses], tg.weighting.mean, chunk_size=1.5)


def test_a_tensor_listed_twice_is_refused_before_the_group() -> None:
    # G would count it twice and .grad once (a review of session 62: W.grad 2x, b.grad 1x Jᵀw)
    weight = torch.ones(2, requires_grad=True)
    losses = weight * torch.tensor([1.0, 2.0])
    with pytest.raises(ValueError, match=r"^torchgram.distributed.autograd.backward: expected "
                       r"inputs without duplicates, but got the same tensor at inputs\[0\] "
                       r"and inputs\[1\]"):
        tg.distributed.autograd.backward(losses, [weight, weight], tg.weighting.mean)
    assert weight.grad is None


def test_a_call_without_a_process_group_says_how_to_start_one() -> None:
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        tg.distributed.gramian(lambda w, x: x @ w, batch_dim=0)(torch.ones(2), torch.ones(3, 2))


def test_one_sample_per_rank_still_checks_that_samples_do_not_interact() -> None:
    """NOTE [one sample per rank]: x - x.mean(0) is per-sample on a batch of one."""
    w = torch.randn(3, dtype=torch.float64)
    x = torch.randn(2, 3, dtype=torch.float64)

    def centred(w: Tensor, x: Tensor) -> Tensor:
        return torch.tanh((x - x.mean(0)) @ w)

    with pytest.raises(ValueError, match="another sample moves the outputs"):
        simulate(centred, w, [(x[:1],), (x[1:],)], batch_dim=0)
    # one sample in the whole batch: nothing to interact with, the single-process answer
    alone = simulate(centred, w, [(x[:1],), (x[:0],)], batch_dim=0)
    torch.testing.assert_close(alone, tg.gramian(centred, batch_dim=0)(w, x[:1]))
    # per-sample f, one sample per rank: checked, and answered
    plain = simulate(lambda w, x: torch.tanh(x @ w), w, [(x[:1],), (x[1:],)], batch_dim=0)
    torch.testing.assert_close(plain, tg.gramian(lambda w, x: torch.tanh(x @ w),
                                                 batch_dim=0)(w, x), atol=TOL, rtol=0)
    # a single token per sample cannot be changed: nothing checked the promise, refused
    table = torch.randn(4, 2, dtype=torch.float64)
    tokens = torch.tensor([1, 2])

    def embedded(t: Tensor, i: Tensor) -> Tensor:
        h = t[i]
        return (h - h.mean(0)).sum(-1)

    with pytest.raises(ValueError, match="could not change theirs"):
        simulate(embedded, table, [(tokens[:1],), (tokens[1:],)], batch_dim=0)


def _ranks_with_their_draws(f: Any, parts: list[tuple[Any, ...]],
                            seeds: list[int]) -> Any:
    """``params ↦`` every rank's rows, each part evaluated from its rank's seed (as
    :func:`simulate` with ``seeds`` runs the ranks): the oracle's function of a random ``f``."""
    def rows(params: Any) -> Tensor:
        outputs = []
        for part, seed in zip(parts, seeds, strict=True):
            torch.manual_seed(seed)
            outputs.append(f(params, *part))
        return torch.cat(outputs)

    return rows


def test_random_f_whose_samples_interact_is_refused() -> None:
    """With dropout the rank sends its batch's rows: coupling is checked from one draw."""
    w = torch.randn(3, dtype=torch.float64)
    x = torch.randn(4, 3, dtype=torch.float64)
    drop = nn.Dropout(0.5)

    def noisy_centred(w: Tensor, x: Tensor) -> Tensor:
        return torch.tanh(drop(x - x.mean(0)) @ w)

    torch.manual_seed(0)
    with pytest.raises(ValueError, match="f draws random numbers"):
        simulate(noisy_centred, w, [(x[:2],), (x[2:],)], seeds=[0, 1], batch_dim=0)

    def noisy(w: Tensor, x: Tensor) -> Tensor:
        return torch.tanh(drop(x) @ w)

    parts = [(x[:2],), (x[2:],)]
    got = simulate(noisy, w, parts, seeds=[0, 1], batch_dim=0)
    both = _ranks_with_their_draws(noisy, parts, [0, 1])
    torch.testing.assert_close(got, dense_gramian(both, (w,)).gramian, atol=TOL, rtol=0)
    # one sample per rank: nothing to compare (a batch of two draws other numbers), answered
    got = simulate(noisy, w, [(x[:1],), (x[1:2],)], seeds=[0, 1], batch_dim=0)
    assert got.shape == (2, 2)


@pytest.mark.parametrize("source", ["numpy global", "generator f holds"])
def test_one_sample_per_rank_of_an_f_drawing_from_the_host_is_checked_not_coupled(
        source: str) -> None:
    """The one-sample check (NOTE [one sample per rank]) evaluates its two batches of two from
    the same states of every generator the call looks after: it seeded torch's alone, and an
    ``f`` whose mask comes from numpy was called coupled (session 60's review)."""
    w = torch.randn(3, dtype=torch.float64)
    x = torch.randn(2, 3, dtype=torch.float64)
    rng = np.random.default_rng(0)

    def draw(shape: tuple[int, ...]) -> Tensor:
        source_of = np.random if source == "numpy global" else rng
        return torch.from_numpy((source_of.random(shape) < 0.5).astype(np.float64)) * 2

    def noisy_centred(w: Tensor, x: Tensor) -> Tensor:
        return torch.tanh((x - x.mean(0)) * draw(tuple(x.shape)) @ w)

    def noisy(w: Tensor, x: Tensor) -> Tensor:
        return torch.tanh((x * draw(tuple(x.shape))) @ w)

    np.random.seed(0)
    with pytest.raises(ValueError, match="samples interact"):
        simulate(noisy_centred, w, [(x[:1],), (x[1:],)], batch_dim=0)
    got = simulate(noisy, w, [(x[:1],), (x[1:],)], batch_dim=0)
    assert got.shape == (2, 2)


def test_an_f_that_differentiates_itself_is_refused_before_any_exchange() -> None:
    """The ranks exchange the structured pass's pieces, which miss what ``f``'s own backward
    does with the weights (NOTE [f that differentiates itself]): every rank reports a
    torchgram error naming ``cross_rank='local'``, before any collective."""
    def f(w: Tensor, x: Tensor) -> Tensor:
        with torch.enable_grad():
            xr = x.detach().requires_grad_()
            out = torch.tanh(xr @ w)
            (gx,) = torch.autograd.grad(out.sum(), xr, create_graph=True)
        return gx.pow(2).sum(-1)

    validated = Options.validate("test", f, batch_dim=0)
    local = local_phase(validated, f, (torch.randn(3, 2, dtype=torch.float64),
                                       torch.randn(4, 3, dtype=torch.float64)), {})
    assert isinstance(local.error, NotImplementedError)
    assert "a call of torch.autograd.grad inside f" in str(local.error)
    assert "cross_rank='local'" in str(local.error)
    assert local.summary is not None and local.summary.error is not None


def test_a_stale_probe_of_a_random_f_starts_from_the_ranks_own_draw() -> None:
    """NOTE [one draw]: a rank's cached probe of a random ``f`` went stale (``f`` now calls
    ``prelu``, which the probe did not see). The failed attempt's draws had moved the
    generator on, and the rank's rows were those of another draw than its plain call's."""
    w = torch.randn(3, 3, dtype=torch.float64)
    a = torch.rand(3, dtype=torch.float64)
    x = torch.randn(4, 3, dtype=torch.float64)
    switch = {"prelu": False}

    def noisy(p: dict[str, Tensor], x: Tensor) -> Tensor:
        h = F.dropout(x, 0.5) @ p["w"]
        h = F.prelu(h, p["a"]) if switch["prelu"] else torch.tanh(h) * p["a"]
        return h.sum(-1)

    params, parts = {"w": w, "a": a}, [(x[:2],), (x[2:],)]
    simulate(noisy, params, parts, seeds=[0, 1], batch_dim=0)
    switch["prelu"] = True
    got = simulate(noisy, params, parts, seeds=[0, 1], batch_dim=0)
    both = _ranks_with_their_draws(noisy, parts, [0, 1])
    torch.testing.assert_close(got, dense_gramian(both, (params,)).gramian, atol=TOL, rtol=0)
