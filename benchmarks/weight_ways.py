"""Dense weights with positions: does the cost model pick the faster of ghost and materialize?

``python benchmarks/weight_ways.py [--quick] [--threads 1] [--rounds 7] [--out DIR]``

Two layers, each alone in ``f`` (one output per sample, ``tanh`` then a sum, no bias), ``B``
samples, over a grid:

* ``conv``: a ``3 × 3`` convolution, ``C`` channels in and out, padding 1, on ``S × S`` inputs
  (``T = S²`` output positions per sample): the ResNet / CIFAR shapes;
* ``linear``: ``x @ Wᵀ`` with ``x: [B, T, a]`` and ``W: [c, a]``: the transformer shapes.

Per point, the structured backend's per-sample Gramian (``batch_dim=0``) with the weight's way
forced to ``ghost`` and to ``materialize`` (the pipeline as ``tg.gramian`` runs it, through
``run_structured(..., force=...)``, in alternated turns, medians; ghost only where its
``(B·T)²·(a + c)`` multiply-adds stay under :data:`MAX_GHOST_MACS`), and the way the cost
model picks unforced (NOTE [structured cost model] in ``torchgram/backends/structured/cost.py``,
no constant fitted here). *Regret*: the picked way's time over the faster one's. Writes
``weight_ways.md`` to ``--out`` (default: print only).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from benchmarks import ways  # noqa: E402
from benchmarks.measure import alternated_medians  # noqa: E402
from torchgram._core.options import Options  # noqa: E402
from torchgram._core.problem import Problem, build_problem  # noqa: E402
from torchgram.backends.structured import plan_problem, run_structured  # noqa: E402

FULL = {
    "conv": {"width": [16, 32, 64, 128, 256], "side": [2, 4, 8, 16], "samples": [8, 16, 32]},
    "linear": {"width": [64, 256, 768], "positions": [1, 4, 16, 64], "samples": [8, 32]},
}
QUICK = {
    "conv": {"width": [16], "side": [2, 4], "samples": [4]},
    "linear": {"width": [32], "positions": [1, 8], "samples": [4]},
}
MAX_GHOST_MACS = 3e9
"""The ghost way is timed only where ``(B·T)²·(a + c)`` is smaller (seconds beyond)."""
MAX_JACOBIAN_ENTRIES = 4e7
"""Points whose materialized Jacobian ``B·P`` is larger are skipped."""
WAYS = ("materialize", "ghost")


def _conv(p: dict[str, Tensor], x: Tensor) -> Tensor:
    return torch.tanh(torch.conv2d(x, p["weight"], padding=1)).sum((1, 2, 3))


def _linear(p: dict[str, Tensor], x: Tensor) -> Tensor:
    return torch.tanh(x @ p["weight"].T).sum((1, 2))


def _points(grid: dict[str, dict[str, list[int]]]) -> Iterator[tuple[str, int, int, int]]:
    """``(layer, width, positions per sample, samples)`` over the grid."""
    for layer, axes in grid.items():
        for width, extent, samples in itertools.product(*axes.values()):
            yield layer, width, extent * extent if layer == "conv" else extent, samples


def _problem(layer: str, width: int, positions: int, samples: int) -> Problem:
    generator = torch.Generator().manual_seed(0)
    f: Callable[[dict[str, Tensor], Tensor], Tensor]
    if layer == "conv":
        side = round(positions ** 0.5)
        weight = torch.randn(width, width, 3, 3, generator=generator) / (3 * width ** 0.5)
        x = torch.randn(samples, width, side, side, generator=generator)
        f = _conv
    else:
        weight = torch.randn(width, width, generator=generator) / width ** 0.5
        x = torch.randn(samples, positions, width, generator=generator)
        f = _linear
    options = Options.validate("weight_ways", f, batch_dim=0)
    return build_problem(options, f, ({"weight": weight}, x), {})


def _ghost_macs(layer: str, width: int, positions: int, samples: int) -> float:
    act_width = 9 * width if layer == "conv" else width
    return float((samples * positions) ** 2 * (act_width + width))


def main(argv: list[str] | None = None) -> None:
    run = ways.start(argv, __doc__.splitlines()[0], rounds=7)
    grid = QUICK if run.quick else FULL
    rounds = run.rounds
    lines = ["| layer | width | T | B | materialize (ms) | ghost (ms) | est. materialize | "
             "est. ghost | picked | regret |",
             "|---|--:|--:|--:|--:|--:|--:|--:|---|--:|"]
    regrets = []
    for layer, width, positions, samples in _points(grid):
        numel = width * width * (9 if layer == "conv" else 1)
        if samples * numel > MAX_JACOBIAN_ENTRIES:
            continue
        problem = _problem(layer, width, positions, samples)
        plan = plan_problem(problem).leaves[0]
        timed_ways = [way for way in WAYS if way != "ghost"
                or _ghost_macs(layer, width, positions, samples) <= MAX_GHOST_MACS]
        seconds = alternated_medians({
            way: lambda way=way, problem=problem: run_structured(problem, force=way)
            for way in timed_ways}, rounds)
        regret = seconds.get(plan.way, float("inf")) / min(seconds.values())
        regrets.append(regret)
        cells = " | ".join(f"{seconds[way] * 1e3:.3f}" if way in seconds else "—" for way in WAYS)
        lines.append(f"| {layer} | {width} | {positions} | {samples} | {cells} | "
                     f"{plan.materialize_cost:.3g} | {plan.ghost_cost:.3g} | {plan.way} | "
                     f"{regret:.2f} |")
        print(lines[-1], flush=True)
    ways.finish(run, "weight_ways.py", "Dense weights with positions: ghost or materialized",
                "Times: the per-sample Gramian with the weight's way forced (ms, medians of "
                "alternated turns); *est.*: the cost model's multiply-adds; *picked*: its "
                "way; *regret*: its time over the fastest.",
                lines, regrets)


if __name__ == "__main__":
    main()
