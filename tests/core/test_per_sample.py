"""``_core/per_sample``: ``f`` that cannot run on part of the batch, under ``batch_dim``.

``f`` indexes its outputs with ``torch.arange(5)``, a batch size written into the code: on the
two samples the per-sample check runs apart it raises an ``IndexError``, which escaped raw
from jacobian, ntvp and auto (found in session 23 by trying patterns by hand). A failure on
part of the batch now means the samples cannot run apart: the rows of the whole batch, as
when ``f`` fails on a batch of one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optree
import pytest
import torch
import torch.nn.functional as F  # noqa: N812 -- torch's own spelling
from torch import Tensor

import torchgram as tg
from helpers import make_problem
from reference import dense_cross_kernel, dense_gramian, weighted_backward
from torchgram._core import per_sample
from torchgram._core.errors import NotPerSample
from torchgram._core.signature import clear_caches

B = 5


def f(p: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
    logits = F.linear(torch.tanh(F.linear(x, p["w"], p["b"])), p["v"])
    return logits.logsumexp(-1) - logits[torch.arange(B), y]  # B written into the code


@pytest.mark.parametrize("backend", ["jacobian", "ntvp", "graph", "structured", "auto"])
def test_f_that_fails_on_part_of_the_batch(backend: str) -> None:
    generator = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 4, dtype=torch.float64, generator=generator),
              "b": torch.randn(3, dtype=torch.float64, generator=generator),
              "v": torch.randn(2, 3, dtype=torch.float64, generator=generator)}
    x = torch.randn(B, 4, dtype=torch.float64, generator=generator)
    y = torch.tensor([0, 1, 1, 0, 1])
    expected = dense_gramian(f, (params, x, y)).gramian
    G = tg.gramian(f, backend=backend, batch_dim=0)(params, x, y)
    torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-12)


MIDDLE = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.0, 0.0])
"""Samples 1 and 2 of six: coupled where the first and the last sample cannot see it."""


def _middle_coupled(kind: str) -> tuple[Any, dict[str, Tensor], Tensor]:
    torch.manual_seed(1)
    params = {"w1": torch.randn(3, 4, dtype=torch.float64) * 0.7,
              "b1": torch.randn(4, dtype=torch.float64) * 0.1,
              "w2": torch.randn(4, 2, dtype=torch.float64) * 0.7}
    x = torch.randn(6, 3, dtype=torch.float64)
    if kind == "group-mean":  # h of samples 1 and 2 equal in value, not in derivative
        params["w1"][2] = 0.0
        x[2] = x[1]
        x[2, 2] += 1.0

    def f(p: dict[str, Tensor], x: Tensor, m: Tensor) -> Tensor:
        h = torch.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]
        if kind == "detached":  # the same values, a derivative through the others
            h = h + m[:, None] * (m[:, None] * (h - h.detach())).sum(0)
        else:
            h = h - m[:, None] * (m[:, None] * h).sum(0) / m.sum().clamp(min=1.0)
        return h.pow(2).sum(1) + h[:, 0]

    return f, params, x


@pytest.mark.parametrize("backend", ["jacobian", "ntvp", "structured", "auto"])
@pytest.mark.parametrize("kind", ["detached", "group-mean"])
def test_middle_samples_coupled_where_values_do_not_show(kind: str, backend: str) -> None:
    """The derivative check ran apart only the first and the last sample: jacobian 0.52 and
    ntvp 0.32 off (relative) on a coupling of samples 1 and 2 that their values hide (session
    28's helper hunt). Each call compares the batch with every sample alone now (NOTE [the
    derivative check on every call])."""
    f, params, x = _middle_coupled(kind)
    expected = dense_gramian(f, (params, x, MIDDLE)).shaped()
    for _ in range(2):
        actual = tg.gramian(f, backend=backend, batch_dim=0)(params, x, MIDDLE)
        torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12)
    kernel = tg.ntk.empirical_ntk_fn(lambda p, xs: f(p, *xs), trace_axes=(), backend=backend)
    torch.testing.assert_close(kernel((x, MIDDLE), None, params),
                               expected.reshape(6, 6), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk_size", [None, 1], ids=["vmap", "loops"])
@pytest.mark.parametrize("backend", ["jacobian", "ntvp", "structured", "graph", "auto"])
def test_a_later_call_sees_a_coupling_its_first_call_did_not_have(backend: str,
                                                                  chunk_size: int | None) -> None:
    """NOTE [the derivative check on every call]: only a signature's first call ran the
    separating groups apart; a later call whose values couple samples 1 and 2 (the first had
    no sample flagged) compared samples 0 and 5 alone: jacobian 0.50 and ntvp 0.25 off
    (relative), their kernels and aggregated_grad too. Each call checks its own values now."""
    clear_caches()
    f, params, x = _middle_coupled("detached")
    first = torch.zeros_like(MIDDLE)
    dense = dense_gramian(f, (params, x, MIDDLE))
    gramian = tg.gramian(f, backend=backend, batch_dim=0, chunk_size=chunk_size)
    torch.testing.assert_close(gramian(params, x, first),
                               dense_gramian(f, (params, x, first)).shaped())
    torch.testing.assert_close(gramian(params, x, MIDDLE), dense.shaped(), rtol=1e-10,
                               atol=1e-12)
    kernel = tg.ntk.empirical_ntk_fn(lambda p, xs: f(p, *xs), trace_axes=(), backend=backend)
    kernel((x, first), None, params)
    torch.testing.assert_close(kernel((x, MIDDLE), None, params), dense.gramian, rtol=1e-10,
                               atol=1e-12)
    update = tg.aggregated_grad(f, lambda G: G.sum(1), backend=backend, batch_dim=0,
                                chunk_size=chunk_size)
    update(params, x, first)
    grads, _ = update(params, x, MIDDLE)
    expected = weighted_backward(f, (params, x, MIDDLE), 0, dense.gramian.sum(1))
    torch.testing.assert_close(torch.cat([g.reshape(-1) for g in optree.tree_leaves(grads)]),
                               expected,
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk_size", [None, 1], ids=["vmap", "groups"])
def test_the_derivative_check_of_every_call_sees_its_values(chunk_size: int | None) -> None:
    """check_derivatives on a call after one of the same signature raises where that call's
    values couple middle samples; with vjps under vmap in one comparison of the whole batch
    with the samples run alone, with loops (``chunk_size=1``) by the separating groups."""
    clear_caches()
    f, params, x = _middle_coupled("detached")
    per_sample.check_derivatives(make_problem(f, (params, x, torch.zeros_like(MIDDLE)),
                                              batch_dim=0, chunk_size=chunk_size))
    later = make_problem(f, (params, x, MIDDLE), batch_dim=0, chunk_size=chunk_size)
    assert later.probe_cached
    with pytest.raises(NotPerSample, match="other derivatives than in the batch"):
        per_sample.check_derivatives(later)


def test_the_derivative_check_runs_the_samples_alone_once(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """Where vmap runs f, the check is one vmapped evaluation of the samples alone and no
    group runs apart (the separating groups cost 28-31% of a call on the mlp benchmark)."""
    clear_caches()
    f, params, x = _middle_coupled("detached")
    groups: list[list[int]] = []
    real = per_sample._compare_group

    def spy(problem: Any, index: Tensor, samples: list[int], *rest: Any) -> None:
        groups.append(samples)
        real(problem, index, samples, *rest)

    monkeypatch.setattr(per_sample, "_compare_group", spy)
    per_sample.check_derivatives(make_problem(f, (params, x, torch.zeros_like(MIDDLE)),
                                              batch_dim=0))
    assert groups == []
    per_sample.check_derivatives(make_problem(f, (params, x, torch.zeros_like(MIDDLE)),
                                              batch_dim=0, chunk_size=1))
    assert groups == [list(group) for group in per_sample.separating_groups(6)]


def _round_off_leaf(p: dict[str, Tensor], x: Tensor) -> Tensor:
    """Rows whose leaf ``tiny`` has products of round-off size that depend on the batch."""
    return torch.tanh(x @ p["w"]).sum(-1) + p["tiny"] * (1e-30 * x.shape[0])


@pytest.mark.parametrize("backend", ["graph", "jacobian", "ntvp", "auto"])
def test_a_leaf_whose_products_are_round_off_is_no_coupling(backend: str) -> None:
    """NOTE [leaves without a gradient]: the derivative check compared each leaf's products
    with that leaf's own scale, so a leaf whose products are round-off alone (an attention's
    key bias) made BERT's samples look coupled; a kernel between two input sets on graph was
    declined (BackendCannotRun) before session 49."""
    generator = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, dtype=torch.float64, generator=generator),
              "tiny": torch.ones((), dtype=torch.float64)}
    x1 = torch.randn(3, 4, dtype=torch.float64, generator=generator)
    x2 = torch.randn(4, 4, dtype=torch.float64, generator=generator)
    kernel = tg.ntk.empirical_ntk_fn(lambda p, x: _round_off_leaf(p, x)[:, None], trace_axes=(),
                                     backend=backend)(x1, x2, params)
    expected = dense_cross_kernel(lambda p, x: _round_off_leaf(p, x)[:, None], params, x1, x2)
    torch.testing.assert_close(kernel, expected, rtol=1e-10, atol=1e-12)


def test_a_float32_model_with_float64_losses_keeps_the_per_sample_way() -> None:
    """Samples alone against the batch at the tolerance of the least precise of the output,
    parameters and inputs: at float64's, a float32 model's round-off read as samples that
    interact (the single-process call fell back to the whole batch's rows; the data-parallel
    one refused; a helper's hunt, session 57)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    fn, params = tg.functionalize(model)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))

    def f(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(fn(p, x).double(), y, reduction="none")

    explanation = tg.explain(f, batch_dim=0, run=True)(params, x, y)
    assert explanation.ran is not None and explanation.ran.way == "batched"
    assert tg.check_independence(f, batch_dim=0)(params, x, y).independent
    wanted = dense_gramian(f, (params, x, y)).gramian
    torch.testing.assert_close(explanation.gramian, wanted, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("with_targets", [False, True], ids=["alone", "beside_targets"])
def test_a_mapping_optree_keeps_whole_is_named(with_targets: bool) -> None:
    # Session 63's hunt: a tokenizer's BatchEncoding (a UserDict) passed to f met "no batched
    # input" or blamed closures; its tensors are not split. A shared one stays accepted.
    from transformers import BatchEncoding

    torch.manual_seed(0)
    weight = torch.randn(7, 2, dtype=torch.float64)
    batch = BatchEncoding({"features": torch.randn(4, 7, dtype=torch.float64)})
    targets = torch.randn(4, 2, dtype=torch.float64)

    def f(w: torch.Tensor, batch: Any, *rest: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(batch["features"] @ w)
        return (out - rest[0]).pow(2).sum(1) if rest else out.sum(1)

    args = (weight, batch, targets) if with_targets else (weight, batch)
    with pytest.raises(ValueError, match=r"a BatchEncoding in argument 1 holding a tensor of "
                       r"shape \(4, 7\).*dict\(batch\)"):
        tg.gramian(f, batch_dim=0)(*args)
    got = tg.gramian(f, batch_dim=0)(weight, dict(batch), *args[2:])
    torch.testing.assert_close(got, dense_gramian(f, (weight, dict(batch), *args[2:])).gramian,
                               rtol=1e-10, atol=1e-12)
    shared = BatchEncoding({"scale": torch.ones(3, dtype=torch.float64)})  # not batch-sized
    tg.gramian(lambda w, x, shared: torch.tanh(x @ w).sum(1) * shared["scale"][0],
               batch_dim=0)(weight, torch.randn(4, 7, dtype=torch.float64), shared)
    # the second review: a shared tensor of the batch's size in another mapping was refused
    from collections import UserDict

    weights = UserDict({"scale": torch.rand(4, dtype=torch.float64)})
    x = torch.randn(4, 7, dtype=torch.float64)

    def g(w: torch.Tensor, x: torch.Tensor, weights: Any) -> torch.Tensor:
        return torch.tanh(x @ w).sum(1) * weights["scale"].sum()

    torch.testing.assert_close(tg.gramian(g, batch_dim=0)(weight, x, weights),
                               dense_gramian(g, (weight, x, weights)).gramian, rtol=1e-10,
                               atol=1e-12)


@dataclasses.dataclass
class _Batch:  # not registered with optree: one leaf
    features: torch.Tensor


def test_an_object_optree_keeps_whole_is_named() -> None:
    """A dataclass as the only batched input met "in_dims=0 selecting no tensor among the
    inputs. Pass the batch as a positional argument", which it was (a helper's hunt, session
    66); the error now says why its tensors are not split."""
    weight = torch.randn(7, 2, dtype=torch.float64)
    batch = _Batch(torch.randn(4, 7, dtype=torch.float64))

    def f(w: torch.Tensor, batch: Any) -> torch.Tensor:
        return torch.tanh(batch.features @ w).sum(1)

    with pytest.raises(ValueError, match=r"a _Batch in argument 1 holding a tensor of shape "
                       r"\(4, 7\): optree sees it as one leaf.*dataclasses.asdict"):
        tg.gramian(f, batch_dim=0)(weight, batch)
