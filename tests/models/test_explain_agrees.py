"""``tg.explain`` says what runs, on every real model (issue 12).

Without ``run``, ``explain`` predicts (it traces ``f`` once, runs nothing); with ``run=True``
it reports what the computation did, leaf by leaf. On every model of the suite, with and
without ``batch_dim``, the report with ``run=True`` is what ran, and the prediction is too:
the backend, and for the structured backend the way of every leaf (none of them on the
fallback unless the plan said so). The one exception is a batch whose samples interact
through plain ops (``x - x.mean(0)``): only a run of ``f`` on the data can tell, and the
report with ``run=True`` says so.
"""

from __future__ import annotations

import pytest

import torchgram as tg
from models import recurrent, regressions, torchjd_ports, transformers_models, vision
from models.case import BATCH_DIMS, build

SUITES = {"transformers": transformers_models.BUILDERS, "vision": vision.BUILDERS,
          "recurrent": recurrent.BUILDERS, "torchjd_ports": torchjd_ports.BUILDERS,
          "regressions": regressions.BUILDERS}


@pytest.mark.parametrize(("suite", "name", "batch_dim"), [
    pytest.param(suite, name, batch_dim, id=f"{name}-batch{batch_dim}")
    for suite, builders in SUITES.items() for name in builders for batch_dim in BATCH_DIMS])
def test_explain_agrees_with_what_runs(suite: str, name: str, batch_dim: int | None) -> None:
    case = build(SUITES[suite], name)
    options = {"batch_dim": batch_dim,
               "in_dims": case.in_dims if batch_dim is not None else 0}
    predicted = tg.explain(case.f, **options)(*case.args, **case.kw_inputs)
    report = tg.explain(case.f, run=True, **options)(*case.args, **case.kw_inputs)
    ran = report.ran
    assert ran is not None
    assert report.backend == ran.backend
    if ran.backend == "structured":
        assert tuple(leaf.way for leaf in report.leaves) == ran.leaf_ways
    if case.coupled and any("run alone gives other outputs" in note for note in ran.notes):
        return  # found by the per-call check of the samples, which explain does not run
    assert (predicted.backend, predicted.fallback) == (ran.backend, report.fallback), ran.notes
    if ran.backend == "structured":
        assert tuple(leaf.way for leaf in predicted.leaves) == ran.leaf_ways, ran.notes
