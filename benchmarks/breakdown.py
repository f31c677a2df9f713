"""Where the time of a per-sample Gramian goes: the structured backend's stages, profiled.

``python benchmarks/breakdown.py [--cases mlp,cnn,transformer] [--calls 15]``

For each case of :mod:`benchmarks.cases` (1 torch thread) it times the plain forward, the
plain forward + backward and ``tg.gramian(f, batch_dim=0)`` (medians, alternated), then
profiles ``--calls`` more Gramian calls with ``cProfile`` and prints the cumulative time of
each stage of the pipeline: building the problem, ``auto``'s plan, the tapped forward (the
model's forward under the tapping mode), the check of the first and last samples, the
backward to the taps, the contractions (``add_rows``: factors and materialized Jacobians;
``blocks``: ghost pairs and Grams), and the tapping mode's own handler (Python per call of
``f``, the ops it runs included). ``cProfile`` adds its own overhead to Python-heavy
stages: the profiled total is printed next to the unprofiled time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import torchgram as tg  # noqa: E402
from benchmarks import cases  # noqa: E402

STAGES = {
    "compute": ("pipeline.py", "compute"),
    "build the problem": ("problem.py", "build_problem"),
    "auto's plan": ("auto.py", "plan_auto"),
    "tapped forward": ("passes.py", "batched_forward"),
    "check of the first and last samples": ("per_sample.py", "_check_batched"),
    "backward to the taps": ("passes.py", "backward_chunks"),
    "contractions: add_rows": ("contraction.py", "add_rows"),
    "contractions: blocks": ("contraction.py", "blocks"),
    "tapping mode's handler (ops included)": ("trace.py", "__torch_function__"),
}


def _median_ms(call: object, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def breakdown(name: str, calls: int) -> None:
    """Print the timings and the profile of one case."""
    case = cases.build(name)
    transform = tg.gramian(case.f, batch_dim=0, diagonal=case.diagonal)
    model, params = case.module, list(case.module.parameters())

    def forward() -> None:
        case.rows(model, *case.inputs).sum()

    def backward() -> None:
        for p in params:
            p.grad = None
        case.rows(model, *case.inputs).sum().backward()

    def gramian() -> None:
        transform(case.params, *case.inputs)

    for _ in range(3):
        backward()
        gramian()
    fw, fb, gram = (_median_ms(c, calls) for c in (forward, backward, gramian))
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        gramian()
    profile.disable()
    totals: dict[str, float] = {}
    for (file, _, func), (_, _, _, cumulative, _) in pstats.Stats(profile).stats.items():
        for label, (suffix, function) in STAGES.items():
            if file.endswith(suffix) and func == function:
                totals[label] = totals.get(label, 0.0) + cumulative * 1e3 / calls
    total = totals.get("compute", float("nan"))
    print(f"== {name}: forward {fw:.2f} ms, forward + backward {fb:.2f} ms, Gramian "
          f"{gram:.2f} ms ({gram / fb:.2f}x); {total:.2f} ms under cProfile")
    for label in STAGES:
        if label in totals:
            print(f"   {label:40s} {totals[label]:8.2f} ms  {totals[label] / total:6.1%}")


def main() -> None:
    """Parse the command line and print every case's breakdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="mlp,cnn,transformer")
    parser.add_argument("--calls", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in args.cases.split(","):
        breakdown(name.strip(), args.calls)


if __name__ == "__main__":
    main()
