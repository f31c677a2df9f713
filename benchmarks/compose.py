"""What composing costs: differentiating through ``G``, and ``torch.compile`` vs eager.

``python benchmarks/compose.py [--quick] [--threads N] [--out FILE]``

On the benchmark MLP (784-512-512-10, batch 64, per-sample cross-entropy losses; the ``mlp``
case of ``cases.py``), it times, as medians of calls that each start from the inputs, in
**CPU time of the process** (``time.process_time``) with one torch thread by default: on a
shared machine the wall time of a call mostly measures how long it waited for a core (the
ratios moved by 3× between runs), while its CPU time does not:

* ``G``: ``tg.gramian(losses, batch_dim=0)`` on parameters that do not require grad (the
  detached fast path; ``auto`` picks ``structured``);
* ``G with its graph``: the same call on parameters that require grad (eager create-graph,
  NOTE [composition]): ``G`` carries the autograd graph;
* ``G, then backward through it``: that, then ``torch.autograd.grad`` of a regularizer of
  ``G`` (the gradient-alignment penalty of ``examples/regularize.py``) w.r.t. the parameters:
  the whole cost of differentiating through ``G``. Issue 10's target: at most about 3× ``G``;
* the same two for ``backend="jacobian"``, and ``torch.func.grad`` of the regularizer (inside
  a ``torch.func`` transform ``auto`` runs ``jacobian``);
* a training step ``loss + λ·reg(G)`` then backward, eager and under ``torch.compile`` (the
  torchgram call is one graph break, NOTE [torch.compile]; compile time excluded), and
  whether ``fullgraph=True`` compiles.

It prints a markdown table and writes it to ``--out`` (default
``benchmarks/results/compose.md``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

import torchgram as tg  # noqa: E402
from benchmarks import cases  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "compose.md"


def alignment_penalty(G: Tensor) -> Tensor:
    """Mean squared cosine similarity between different samples' gradients (from ``G``)."""
    norms = G.diagonal().clamp_min(1e-12).sqrt()
    cosine = G / (norms[:, None] * norms[None, :])
    off = cosine - torch.diag_embed(cosine.diagonal())
    return off.square().sum() / (G.shape[0] * (G.shape[0] - 1))


def _median(call: Callable[[], Any], reps: int, warmups: int = 2) -> float:
    for _ in range(warmups):
        call()
    times = []
    for _ in range(reps):
        start = time.process_time()
        call()
        times.append(time.process_time() - start)
    return statistics.median(times)


def _fullgraph_compiles(step: Callable[[], Any], compile_backend: str) -> str:
    torch.compiler.reset()
    compiled = torch.compile(step, fullgraph=True, backend=compile_backend)
    try:
        compiled()
    except Exception as error:  # noqa: BLE001 -- reported, not raised
        return f"no ({type(error).__name__})"
    return "yes"


def run(argv: list[str] | None = None) -> str:
    """Measure and return the markdown report (also written to ``--out``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one timed call")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: CPU time is then the time of one core)")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend (inductor; aot_eager is faster to build)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = cases.QUICK if args.quick else cases.FULL
    reps = 1 if args.quick else 9
    case = cases.build("mlp", sizes)
    params, inputs = case.params, case.inputs
    leaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    lam = 0.1

    def gramian(backend: str) -> Callable[..., Tensor]:
        return tg.gramian(case.f, batch_dim=0, backend=backend)

    def through(backend: str) -> Callable[[], Any]:
        G_fn = gramian(backend)
        return lambda: torch.autograd.grad(alignment_penalty(G_fn(leaves, *inputs)),
                                           list(leaves.values()))

    def functorch_grad() -> Any:
        G_fn = gramian("auto")
        return torch.func.grad(lambda p: alignment_penalty(G_fn(p, *inputs)))(params)

    G_auto = gramian("auto")

    def step() -> Any:
        losses = case.f(leaves, *inputs)
        total = losses.mean() + lam * alignment_penalty(G_auto(leaves, *inputs))
        return torch.autograd.grad(total, list(leaves.values()))

    def plain_step() -> Any:
        losses = case.f(leaves, *inputs)
        return torch.autograd.grad(losses.mean(), list(leaves.values()))

    report = tg.explain(case.f, batch_dim=0, run=True)(leaves, *inputs)
    rows: list[tuple[str, float]] = []
    rows.append(("plain training step: loss.mean(), backward", _median(plain_step, reps)))
    rows.append(("G (auto; nothing requires grad: fast path)",
                 _median(lambda: G_auto(params, *inputs), reps)))
    rows.append(("G with its graph (auto; parameters require grad)",
                 _median(lambda: G_auto(leaves, *inputs), reps)))
    rows.append(("G, then backward through it (auto)", _median(through("auto"), reps)))
    rows.append(("G (jacobian; fast path)",
                 _median(lambda: gramian("jacobian")(params, *inputs), max(1, reps // 3), 1)))
    rows.append(("G, then backward through it (jacobian)",
                 _median(through("jacobian"), max(1, reps // 3), 1)))
    rows.append(("torch.func.grad of reg(G) (auto runs jacobian inside transforms)",
                 _median(functorch_grad, max(1, reps // 3), 1)))
    rows.append(("training step loss + λ·reg(G), backward: eager", _median(step, reps)))
    with warnings.catch_warnings():  # dynamo reads .grad of the non-leaf G after the break
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is "
                                "not a leaf", category=UserWarning)
        torch.compiler.reset()
        compiled_step = torch.compile(step, backend=args.compile_backend)
        rows.append(("training step loss + λ·reg(G), backward: torch.compile",
                     _median(compiled_step, reps)))
        compiled_gramian = torch.compile(lambda: G_auto(params, *inputs) * 1.0,
                                         backend=args.compile_backend)
        rows.append(("G (auto, fast path): torch.compile", _median(compiled_gramian, reps)))
        fullgraph = _fullgraph_compiles(lambda: G_auto(params, *inputs) * 1.0,
                                        args.compile_backend)
    times = dict(rows)
    base = times["G (auto; nothing requires grad: fast path)"]
    floor = times["plain training step: loss.mean(), backward"]
    ran = report.ran.backend if report.ran is not None else "?"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        "# Composing: differentiating through G, and torch.compile",
        "",
        f"`python benchmarks/compose.py{' --quick' if args.quick else ''}` — {case.title}; "
        f"torch {torch.__version__}, {args.threads} thread(s), {platform.machine()}, load "
        f"average {load:.2f} before; medians of the CPU time of {reps} calls (a third as "
        f"many for the slow jacobian rows); compile backend `{args.compile_backend}`. With "
        f"parameters that require grad, `auto` ran `{ran}`.",
        "",
        "| what | CPU time | × G | × plain step |",
        "|---|--:|--:|--:|",
    ]
    lines += [f"| {name} | {t * 1e3:.2f} ms | {t / base:.2f} | {t / floor:.2f} |"
              for name, t in rows]
    through_ratio = times["G, then backward through it (auto)"] / base
    compile_ratio = (times["training step loss + λ·reg(G), backward: torch.compile"]
                     / times["training step loss + λ·reg(G), backward: eager"])
    lines += [
        "",
        f"Differentiating through G (G with its graph, then the backward of the "
        f"regularizer) costs **{through_ratio:.2f}× G** (target: at most about 3×). "
        f"Compiled training step / eager: **{compile_ratio:.2f}**. "
        f"`fullgraph=True` on a function calling `tg.gramian`: {fullgraph}.",
    ]
    text = "\n".join(lines) + "\n"
    out = args.out if args.out is not None else (None if args.quick else RESULTS)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    run()
