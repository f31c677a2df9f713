"""The real transformers models run the recorded per-sample way in eager code (issue 15).

With ``tg.autograd.record()`` around a plain call and ``batch_dim=0``, every input of GPT-2
(``Conv1D``: ``addmm`` on ``[B·T, d]``, its position embedding looked up with ``[1, T]``
ids), BERT (position ids ``[1, T]``, attention mask), LLaMA (RMSNorm: ``x ⊙ w``) and ViT (cls
token ``expand``, position embedding ``+``) comes from a recorded call read per sample: no
input is walked and the rows are not those of the whole batch. The matrix is the dense
float64 oracle's, and ``explain`` reports what ran.
"""

from __future__ import annotations

import pytest

import torchgram as tg
from models import transformers_models
from models.case import build, compare, oracle
from models.test_eager_models import eager_leaves

NAMES = ("bert-mask-eager", "bert-mask-sdpa", "gpt2-eager", "gpt2-mask-eager", "gpt2-mask-sdpa",
         "llama-mask-eager", "llama-mask-sdpa", "vit-eager", "vit-sdpa")


@pytest.mark.parametrize("name", NAMES)
def test_recorded_per_sample_without_walk(name: str) -> None:
    builders = transformers_models.BUILDERS
    case = build(builders, name)
    params, leaves = eager_leaves(case)
    with tg.autograd.record():
        out = case.f(params, *case.inputs, **case.kw_inputs)
    report = tg.autograd.explain(out, leaves, batch_dim=0)
    assert report.walked == (), [(item.name, item.why) for item in report.inputs
                                 if item.way == "walk"]
    assert report.ran.way == "recorded taps (engine pass)", report.ran.notes
    expected, _ = oracle(builders, name)
    compare(report.gramian, expected, case.rtol)
    if name.startswith(("bert", "gpt2")):  # the position embedding: where it meets the batch
        assert any("shared by the samples" in note for note in report.ran.notes)
