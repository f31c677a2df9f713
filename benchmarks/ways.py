"""What the "ways" benchmarks share: their options and how they write their report.

``embedding_ways.py`` and ``weight_ways.py`` each time a leaf's block with every way forced
against the cost model's pick (NOTE [structured cost model]); this module parses their common
command line and writes the Markdown report with the run's context.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.measure import set_threads
from benchmarks.run import _commit, _cpu, _load


@dataclass(frozen=True)
class WaysRun:
    """A parsed command line, with the threads set and the load noted before the run."""

    quick: bool
    threads: int
    rounds: int
    out: Path | None
    load_before: str


def start(argv: list[str] | None, description: str, rounds: int) -> WaysRun:
    """Parse ``[--quick] [--threads N] [--rounds N] [--out DIR]`` and set the threads."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="a tiny grid, one round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    set_threads(args.threads)
    return WaysRun(args.quick, args.threads, 1 if args.quick else args.rounds, args.out,
                   str(_load()))


def finish(run: WaysRun, script: str, title: str, explanation: str, lines: list[str],
           regrets: list[float]) -> None:
    """Print the summary; write ``<script stem>.md`` to ``run.out`` if given."""
    summary = (f"\nPoints: {len(regrets)}; mean regret {statistics.fmean(regrets):.3f}, "
               f"largest {max(regrets):.2f} (1 = the faster way every time).")
    print(summary)
    if run.out is None:
        return
    run.out.mkdir(parents=True, exist_ok=True)
    header = (
        f"# {title}\n\n"
        f"Written by `python benchmarks/{script}{' --quick' if run.quick else ''} "
        f"--threads {run.threads} --rounds {run.rounds} --out {run.out}` (see its docstring) "
        f"at {_commit()}: {_cpu()}, {run.threads} torch thread(s), torch {torch.__version__}; "
        f"load average {run.load_before} before, {_load()} after. {explanation}\n\n")
    (run.out / Path(script).with_suffix(".md").name).write_text(
        header + "\n".join(lines) + "\n" + summary + "\n")
