"""The real models stay on the structured backend's fast path, with the oracle's matrix (issue 12).

With ``batch_dim=0``, every model of the suite whose samples are independent and whose
forward draws nothing runs the **batched** per-sample pass (one tapped forward of the whole
batch, one backward) with **no fallback leaf**: BERT with its ``[1, T]`` position and
token-type id buffers and an attention mask, GPT-2's ``Conv1D`` (``addmm`` on merged sample
dims), LLaMA's RMSNorm, ViT's cls token and position embedding, batch-norm in eval mode, and
the fused recurrent kernels (rewritten into their cells). The matrix it returns is the dense
float64 oracle's. Models that draw (dropout in train mode) run it too, GPT-2's merged sample
dims (NOTE [merged order from derivatives]) and a stacked LSTM's inter-layer dropout (NOTE
[inter-layer dropout]) included, on the first call and on later ones.
"""

from __future__ import annotations

import pytest
import torch

import torchgram as tg
from models import recurrent, transformers_models, vision
from models.case import build, compare, oracle

FAST = {
    "transformers": (transformers_models.BUILDERS,
                     ("bert-mask-eager", "bert-mask-sdpa", "gpt2-eager", "gpt2-mask-eager",
                      "gpt2-mask-sdpa", "llama-mask-eager", "llama-mask-sdpa", "vit-eager",
                      "vit-sdpa")),
    "vision": (vision.BUILDERS, ("resnet-eval", "mobilenet")),
    "recurrent": (recurrent.BUILDERS, ("lstm", "gru-bidir", "rnn-2layer", "lstm-lengths")),
}


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize(("suite", "name"), [
    pytest.param(suite, name, id=name) for suite, (_, names) in FAST.items() for name in names])
def test_batched_without_fallback(suite: str, name: str) -> None:
    builders = FAST[suite][0]
    case = build(builders, name)
    report = tg.explain(case.f, backend="structured", batch_dim=0, in_dims=case.in_dims,
                        run=True)(*case.args, **case.kw_inputs)
    assert report.ran is not None
    assert (report.ran.way, report.fallback) == ("batched", ()), report.ran.notes
    expected, _ = oracle(builders, name)
    compare(report.gramian, expected, case.rtol)


RANDOM = {"bert-dropout": transformers_models.BUILDERS,
          "gpt2-dropout": transformers_models.BUILDERS, "lstm-dropout": recurrent.BUILDERS}


@pytest.mark.parametrize("name", list(RANDOM))
def test_random_models_batched_on_every_call(name: str) -> None:
    builders = RANDOM[name]
    case = build(builders, name)
    assert case.seed is not None
    expected, _ = oracle(builders, name)
    transform = tg.gramian(case.f, backend="structured", batch_dim=0, in_dims=case.in_dims)
    for _ in range(3):  # the first call checks the trace, later ones replay it
        torch.manual_seed(case.seed)
        report = tg.explain(case.f, backend="structured", batch_dim=0, in_dims=case.in_dims,
                            run=True)(*case.args, **case.kw_inputs)
        assert report.ran is not None
        assert (report.ran.way, report.fallback) == ("batched", ()), report.ran.notes
        compare(report.gramian, expected, case.rtol)
        torch.manual_seed(case.seed)
        compare(transform(*case.args, **case.kw_inputs), expected, case.rtol)
