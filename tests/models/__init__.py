"""The models people bring (issue 9): real architectures, torchjd's test architectures, repros.

Every module here builds :class:`models.case.ModelCase` objects, pure functions
``f(params, *inputs, **kw_inputs)`` with their parameters and inputs in float64, and the
suite (``test_*.py``) checks every backend × ``batch_dim`` in ``(0, None)`` against the one
dense oracle of ``tests/reference.py`` with the team's contract (:mod:`models.case`).

* :mod:`models.transformers_models` — BERT, GPT-2, LLaMA, ViT from tiny ``transformers``
  configs (random init, no downloads);
* :mod:`models.vision` — a ResNet (eval and train mode) and a MobileNet, without torchvision;
* :mod:`models.recurrent` — LSTM / GRU / RNN classifiers and unrolled cells;
* :mod:`models.torchjd_ports` — ports of the architectures of torchjd's autogram tests;
* :mod:`models.regressions` — minimal repros of the silent wrong answers of issue 9.

``python tests/models/baseline.py`` runs the whole grid without stopping at failures and
rewrites ``tests/models/BASELINE.md``.
"""
