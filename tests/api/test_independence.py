"""``tg.check_independence``: the opt-in check of batch_dim's promise, on every model case."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torchgram as tg
from models import recurrent, regressions, torchjd_ports, transformers_models, vision
from models.case import build

BUILDERS = {**transformers_models.BUILDERS, **vision.BUILDERS, **recurrent.BUILDERS,
            **regressions.BUILDERS, **torchjd_ports.BUILDERS}
INTERACTING = {"resnet-train", "centered-batch", "WithBatchNorm", "tied-scale-grad-by-freq"}
"""Cases whose samples interact: batch statistics, a mean over the batch, and token counts
over the batch in the embedding's backward."""


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_every_model_case_is_judged_right(name: str) -> None:
    case = build(BUILDERS, name)
    check = tg.check_independence(case.f, batch_dim=0, in_dims=case.in_dims)
    report = check(*case.args, **case.kw_inputs)
    assert report.independent == (name not in INTERACTING), str(report)
    assert report.samples_checked == tuple(range(3))
    if name == "resnet-train":
        assert report.coupling_ops and "batch_norm" in report.coupling_ops[0]


def test_interactions_name_the_samples_and_print() -> None:
    w = torch.randn(3, dtype=torch.float64)

    def shifted(w, x):  # sample b sees sample b - 1
        return torch.tanh(torch.roll(x, 1, dims=0) @ w + x @ w)

    report = tg.check_independence(shifted)(w, torch.randn(4, 3, dtype=torch.float64))
    assert not report.independent
    assert set(report.interactions) == {(0, 1), (1, 2), (2, 3), (3, 0)}
    assert "Changing sample b moved sample c: 0→1" in str(report)


def test_bad_sample_index_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"torchgram.check_independence: expected samples "
                                         r"within \[0, 4\)"):
        tg.check_independence(lambda w, x: x @ w, samples=[5])(torch.randn(3),
                                                                 torch.randn(4, 3))


def test_a_stale_probe_is_noticed() -> None:
    """``f``'s output changes structure between calls in a way its call signature cannot show
    (here a switch; in a long test session, a new function at a reused ``id``): the cached
    probe no longer describes it. The check read the rows with the stale probe's layout and
    reported every pair of samples as interacting (a flaky failure in session 23's fresh
    clone); it now checks the output against the probe and probes afresh."""
    switch = {"pytree": False}
    w = torch.randn(3, 3, dtype=torch.float64)

    def f(w: torch.Tensor, x: torch.Tensor) -> object:
        out = x @ w
        return {"a": out[:, :1], "b": [out, out.sum(-1)]} if switch["pytree"] else out

    x = torch.randn(3, 3, dtype=torch.float64)
    check = tg.check_independence(f)
    assert check(w, x).independent
    switch["pytree"] = True
    report = check(w, x)
    assert report.independent, str(report)


def test_a_stale_probe_of_a_random_f_leaves_the_generator_as_one_call_would() -> None:
    """A random ``f`` whose cached probe went stale: the check starts afresh from the call's
    own random state, as ``tg.gramian`` does (NOTE [one draw]). The failed attempt's draws
    moved the generator on, and the retry left it further than one plain call of ``f``."""
    switch = {"pytree": False}
    w = torch.randn(3, 3, dtype=torch.float64)

    def f(w: torch.Tensor, x: torch.Tensor) -> object:
        out = torch.nn.functional.dropout(x, 0.5) @ w
        return {"a": out[:, :1], "b": out[:, 1:]} if switch["pytree"] else out

    x = torch.randn(4, 3, dtype=torch.float64)
    check = tg.check_independence(f)
    check(w, x)
    switch["pytree"] = True
    torch.manual_seed(7)
    f(w, x)
    after_one_call = torch.get_rng_state()
    torch.manual_seed(7)
    check(w, x)
    assert torch.equal(torch.get_rng_state(), after_one_call)


@pytest.mark.parametrize("options", [
    {"batch_dim": None}, {"samples": 3}, {"samples": "01"}, {"samples": [1.0]},
    {"samples": [True]}], ids=["batch_dim_none", "int", "str", "floats", "bools"])
def test_bad_options_are_refused_when_the_check_is_built(options: dict[str, object]) -> None:
    """torch's raw errors (a bare AssertionError after one evaluation of ``f`` for
    ``batch_dim=None``; "'int' object is not iterable"...) before session 59."""
    with pytest.raises(TypeError, match="torchgram.check_independence: expected"):
        tg.check_independence(lambda w, x: x @ w, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("samples", [[], set(), iter([])], ids=["list", "set", "iterator"])
def test_an_empty_selection_is_refused(samples: object) -> None:
    """A check of no sample said "independent" for a coupled f (session 59's review)."""
    with pytest.raises(ValueError, match="at least one sample"):
        tg.check_independence(lambda w, x: x @ w, samples=samples)  # type: ignore[arg-type]


def test_samples_as_an_array_of_indices() -> None:
    w, x = torch.randn(3), torch.randn(5, 3)
    check = tg.check_independence(lambda w, x: torch.tanh(x @ w), samples=np.array([0, 3]))
    assert check(w, x).samples_checked == (0, 3)


@pytest.mark.parametrize("samples", [8, 64])
def test_a_weak_coupling_in_float32_is_seen(samples: int) -> None:
    """``h + 0.05 · h.mean(0)``: the per-sample G is 0.1 off the true one, and a nudge of 1e-2
    left the other samples' outputs within float32 round-off (``independent=True``;
    session 59's hunt)."""
    generator = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(16, 32, generator=generator), torch.randn(32, 1, generator=generator)

    def f(w: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ w[0])
        return (h + 0.05 * h.mean(0)) @ w[1]

    x = torch.randn(samples, 16, generator=generator)
    assert not tg.check_independence(f)((w1, w2), x).independent
