"""``torchgram.distributed`` on the benchmark models: bytes received and time per rank.

Every case of ``cases.py`` with its batch split evenly over ``--ranks`` gloo processes on
this machine (FileStore rendezvous, one thread each): per rank, the payload bytes it
received in the exchange (``torchgram.distributed.explain``), with the plan torchgram took
(ghost factors or per-sample gradients per leaf) and with per-sample gradients for every
leaf (``backend="jacobian"``); the ``M × M`` all-reduce; and, for scale, the bytes of one
gradient (what DDP all-reduces each step). The Gramian every rank gets is compared with
the single-process ``tg.gramian`` of the whole batch, and the time of a distributed call
with that of one process on the whole batch (medians; the ranks share this machine's
cores, so the times say little about a real cluster: the bytes are the point).

Run:  python benchmarks/distributed.py [--quick] [--ranks 2] [--cases mlp,cnn]
      (writes benchmarks/results/distributed.{md,json}; --quick: tiny sizes, no files)
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: `benchmarks` is a folder, not a package
    sys.path.insert(0, str(ROOT))

import torchgram as tg  # noqa: E402
from benchmarks import cases  # noqa: E402

CASES = ("mlp", "cnn", "transformer", "tied-lm", "ntk-mlp", "ntk-cnn", "multitask")
"""The Gramian cases (the ``-norms`` ones exchange nothing: each rank's diagonal is its own)."""


def _local_inputs(case: cases.Case, rank: int, ranks: int) -> tuple[Tensor, ...]:
    """This rank's part of the batch (dim 0; near-even split, earlier ranks one more)."""
    total = case.inputs[0].shape[0]
    counts = [total // ranks + (r < total % ranks) for r in range(ranks)]
    start = sum(counts[:rank])
    return tuple(x.narrow(0, start, counts[rank]) for x in case.inputs)


def _median_time(fn: Callable[[], Any], reps: int) -> float:
    fn()  # warm-up (traces, caches)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_case(name: str, sizes: cases.Sizes, reps: int = 3) -> dict[str, Any]:
    """One case on this rank (every rank of the default group calls it together)."""
    rank, ranks = dist.get_rank(), dist.get_world_size()
    case = cases.build(name, sizes)
    options = {"batch_dim": case.batch_dim}
    local = _local_inputs(case, rank, ranks)
    exchange = tg.distributed.explain(case.f, **options)(case.params, *local)
    per_sample = tg.distributed.explain(case.f, backend="jacobian", **options)(case.params,
                                                                               *local)
    distributed = tg.distributed.gramian(case.f, **options)
    got = distributed(case.params, *local)
    result: dict[str, Any] = {
        "case": name, "title": case.title, "ranks": ranks, "rank": rank,
        "params": case.num_params, "mode": exchange.mode, "sizes": list(exchange.sizes),
        "received": exchange.received[rank], "sent": exchange.sent[rank],
        "received_per_sample_grads": per_sample.received[rank],
        "all_reduce": exchange.reduced,
        "gradient": sum(p.numel() * p.element_size() for p in case.params.values()),
        "kinds": {kind: sum(1 for leaf in exchange.leaves if leaf.kind == kind)
                  for kind in ("factors", "jacobian", "zero")},
        "time_distributed": _median_time(lambda: distributed(case.params, *local), reps),
    }
    if case.batch_dim is not None:
        single = tg.gramian(case.f, **options)(case.params, *case.inputs)
        result["rel_error"] = float((got - single).norm() / single.norm())
        result["time_single"] = _median_time(
            lambda: tg.gramian(case.f, **options)(case.params, *case.inputs), reps)
    else:  # rows by ranks: the oracle is the single-process Gramian of every rank's rows
        parts = [_local_inputs(case, r, ranks) for r in range(ranks)]

        def rows(params: Any) -> Tensor:
            return torch.cat([case.f(params, *part).reshape(-1) for part in parts])

        single = tg.gramian(rows)(case.params)
        result["rel_error"] = float((got - single).norm() / single.norm())
        result["time_single"] = _median_time(lambda: tg.gramian(rows)(case.params), reps)
    dist.barrier()  # the single-process timings above ran on every rank at once
    return result


def _entry(rank: int, ranks: int, store: str, out: str, names: list[str], quick: bool,
           reps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, ranks), rank=rank,
                            world_size=ranks, timeout=timedelta(seconds=600))
    sizes = cases.QUICK if quick else cases.FULL
    results = []
    try:
        for name in names:
            results.append(measure_case(name, sizes, reps))
            if rank == 0:
                print(f"  {name}: done", flush=True)
    finally:
        with open(os.path.join(out, f"rank{rank}.pkl"), "wb") as file:
            pickle.dump(results, file)
        dist.destroy_process_group()


def _mb(n: float) -> str:
    return f"{n / 1e6:.3g} MB" if n >= 1e5 else f"{n / 1e3:.3g} kB"


def render(rows: list[list[dict[str, Any]]], header: str) -> str:
    """The results page (markdown): per case, the figures of every rank."""
    lines = [header, "",
             "| case | params | plan (leaves) | received per rank | per-sample gradients "
             "instead | G all-reduce | one gradient (DDP) | rel. error | time per rank / "
             "one process |", "|---|---|---|---|---|---|---|---|---|"]
    for per_rank in rows:
        first = per_rank[0]
        plan = ", ".join(f"{k} {v}" for k, v in first["kinds"].items() if v)
        received = " / ".join(_mb(r["received"]) for r in per_rank)
        grads = " / ".join(_mb(r["received_per_sample_grads"]) for r in per_rank)
        error = max(r["rel_error"] for r in per_rank)
        times = " / ".join(f"{r['time_distributed']:.3f} s" for r in per_rank)
        lines.append(f"| {first['case']} | {first['params']:,} | {first['mode']}: {plan} | "
                     f"{received} | {grads} | {_mb(first['all_reduce'])} | "
                     f"{_mb(first['gradient'])} | {error:.1e} | {times} / "
                     f"{first['time_single']:.3f} s |")
    lines += ["", "Cases:", ""]
    lines += [f"* `{per_rank[0]['case']}`: {per_rank[0]['title']}; "
              f"{'rows' if per_rank[0]['mode'] == 'ranks' else 'samples'} per rank "
              f"{per_rank[0]['sizes']}" for per_rank in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[list[dict[str, Any]]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--quick", action="store_true", help="tiny sizes; writes no files")
    parser.add_argument("--reps", type=int, default=3, help="timed calls per measurement")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    names = args.cases.split(",")
    load = os.getloadavg()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as directory:
        mp.start_processes(_entry, args=(args.ranks, os.path.join(directory, "store"),
                                         directory, names, args.quick, args.reps),
                           nprocs=args.ranks, join=True, start_method="spawn")
        per_rank = []
        for rank in range(args.ranks):
            with open(os.path.join(directory, f"rank{rank}.pkl"), "rb") as file:
                per_rank.append(pickle.load(file))
    rows = [list(case_rows) for case_rows in zip(*per_rank, strict=True)]
    header = (f"# torchgram.distributed: bytes and time per rank\n\n"
              f"`python benchmarks/distributed.py{' --quick' if args.quick else ''} --ranks "
              f"{args.ranks}`: {args.ranks} gloo processes on one machine "
              f"({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
              f"1 thread per rank), torch {torch.__version__}, float32; load average "
              f"{load[0]:.1f} before, {os.getloadavg()[0]:.1f} after; "
              f"{time.perf_counter() - start:.0f} s.\n\n"
              "Bytes are exact (what the exchange moved, counted by `explain`); times are "
              "medians of a few calls of processes sharing these cores, so they include "
              "contention and gloo's loopback and say little about a cluster.")
    page = render(rows, header)
    print(page)
    if not args.quick:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "distributed.md").write_text(page)
        (out / "distributed.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
