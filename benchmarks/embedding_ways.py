"""Embedding tables: does the cost model pick the faster of the sparse and materialized ways?

``python benchmarks/embedding_ways.py [--quick] [--threads 1] [--rounds 9] [--out DIR]``

A table of ``V`` rows of width ``d`` looked up at ``T`` positions per sample, ``B`` samples,
``f(p, tokens) = (F.embedding(tokens, p["table"]) · u).sum(1)`` (one output per sample), over a
grid of ``(V, d, B, T)``. Per point, the structured backend's per-sample Gramian
(``batch_dim=0``) with the table's way forced to ``sparse``, ``materialize`` and ``ghost``
(the pipeline as ``tg.gramian`` runs it, through ``run_structured(..., force=...)``, in
alternated turns, medians; ghost only where its ``B²·T²·d`` pairs stay under
:data:`MAX_GHOST_PAIRS`), and the way the cost model picks unforced (NOTE [structured cost
model], :data:`SPARSE_FIXED` and :data:`SPARSE_PAIR_WEIGHT` in
``torchgram/backends/structured/cost.py``). *Regret*: the picked way's time over the faster
one's. Writes ``embedding_ways.md`` to ``--out`` (default: print only).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor  # noqa: E402

from benchmarks import ways  # noqa: E402
from benchmarks.measure import alternated_medians  # noqa: E402
from torchgram._core.options import Options  # noqa: E402
from torchgram._core.problem import Problem, build_problem  # noqa: E402
from torchgram.backends.structured import plan_problem, run_structured  # noqa: E402

FULL = {"classes": [100, 1000, 5000, 30000], "width": [16, 64, 256], "samples": [16, 64],
        "positions": [8, 32, 128]}
QUICK = {"classes": [100, 1000], "width": [16], "samples": [8], "positions": [4, 16]}
MAX_DENSE_ENTRIES = 6e7
"""Points whose materialized Jacobian ``B·V·d`` is larger are skipped (seconds each)."""
MAX_GHOST_PAIRS = 2e8
"""The ghost way is timed only where ``B²·T²·d`` is smaller (it is far slower beyond)."""
WAYS = ("sparse", "materialize", "ghost")


def _lookup(p: dict[str, Tensor], tokens: Tensor) -> Tensor:
    return (F.embedding(tokens, p["table"]) * p["u"]).sum((1, 2))


def _problem(classes: int, width: int, samples: int, positions: int) -> Problem:
    generator = torch.Generator().manual_seed(0)
    params = {"table": torch.randn(classes, width, generator=generator),
              "u": torch.randn(width, generator=generator)}
    tokens = torch.randint(0, classes, (samples, positions), generator=generator)
    options = Options.validate("embedding_ways", _lookup, batch_dim=0)
    return build_problem(options, _lookup, (params, tokens), {})


def main(argv: list[str] | None = None) -> None:
    run = ways.start(argv, __doc__.splitlines()[0], rounds=9)
    grid = QUICK if run.quick else FULL
    rounds = run.rounds
    lines = ["| V | d | B | T | sparse (ms) | materialize (ms) | ghost (ms) | picked | regret |",
             "|--:|--:|--:|--:|--:|--:|--:|---|--:|"]
    regrets = []
    for classes, width, samples, positions in itertools.product(*grid.values()):
        if samples * classes * width > MAX_DENSE_ENTRIES:
            continue
        problem = _problem(classes, width, samples, positions)
        picked = plan_problem(problem).leaves[0].way
        timed_ways = [way for way in WAYS
                if way != "ghost" or (samples * positions) ** 2 * width <= MAX_GHOST_PAIRS]
        seconds = alternated_medians({
            way: lambda way=way, problem=problem: run_structured(problem, force=way)
            for way in timed_ways}, rounds)
        regret = seconds.get(picked, float("inf")) / min(seconds.values())
        regrets.append(regret)
        cells = " | ".join(f"{seconds[way] * 1e3:.3f}" if way in seconds else "—" for way in WAYS)
        lines.append(f"| {classes} | {width} | {samples} | {positions} | {cells} | {picked} | "
                     f"{regret:.2f} |")
        print(lines[-1], flush=True)
    ways.finish(run, "embedding_ways.py", "Embedding tables: sparse, materialized or ghost",
                "Times: the per-sample Gramian with the table's way forced (ms, medians of "
                "alternated turns); *picked*: the cost model's way; *regret*: its time over "
                "the fastest.",
                lines, regrets)


if __name__ == "__main__":
    main()
