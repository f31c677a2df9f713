"""Run the distributed tests' checks on 2 ranks: one spawn, gloo over a FileStore (no ports).

A test module listed in :data:`MODULES` defines ``worker(checks, rank, world)``, which runs
its checks on every rank through ``checks.run(name, fn)``. The ranks are started **once
per test session** (``tests/distributed/conftest.py``; starting two Python processes that
import torch costs several seconds on 2 cores) and run every module's worker, one after
the other, on the same process group; :func:`spawn` returns, per module and per rank,
``{name: (ok, value or traceback)}`` for the module's tests to assert on.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RANKS = 2
MODULES = ("test_data_parallel", "test_sharded")
"""The modules whose workers the session's ranks run, in this order."""
TIMEOUT = 300.0
"""Seconds for all the ranks' work (a hang fails the distributed tests, never the suite)."""

Results = list[dict[str, tuple[bool, Any]]]
"""Per rank, ``{check name: (ok, value or traceback)}``."""


class Checks:
    """Runs named checks on one rank, recording a value or the traceback of each."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.results: dict[str, tuple[bool, Any]] = {}

    def run(self, name: str, fn: Callable[[], Any]) -> None:
        try:
            self.results[name] = (True, fn())
        except Exception:  # noqa: BLE001 -- reported by the test that reads it
            self.results[name] = (False, traceback.format_exc())


def digest(tensor: Any) -> str:
    """A hash of a tensor's (or a dict of tensors') exact bytes, to compare ranks bit for bit."""
    if isinstance(tensor, dict):
        return "".join(digest(tensor[k]) for k in sorted(tensor))
    data = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return hashlib.sha256(data.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def _entry(rank: int, world: int, store: str, out: str, modules: Sequence[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    results: dict[str, dict[str, tuple[bool, Any]]] = {}
    try:
        for module in modules:
            checks = Checks(rank)
            results[module] = checks.results
            try:
                importlib.import_module(module).worker(checks, rank, world)
            except Exception:  # noqa: BLE001 -- the worker itself failed
                checks.results["<worker>"] = (False, traceback.format_exc())
    finally:
        with open(os.path.join(out, f"rank{rank}.pkl"), "wb") as file:
            pickle.dump(results, file)
        dist.destroy_process_group()
    # torch 2.13's gloo threads can abort the interpreter's own exit now and then ("terminate
    # called without an active exception", SIGABRT; examples/distributed_jd.py met it): the
    # results are written, so the rank leaves without it
    sys.stdout.flush()
    os._exit(0)


def spawn(modules: Sequence[str], directory: Path) -> dict[str, Results]:
    """Run every module's ``worker`` on :data:`RANKS` ranks; per module, every rank's results."""
    directory.mkdir(parents=True, exist_ok=True)
    context = mp.start_processes(_entry, args=(RANKS, str(directory / "store"), str(directory),
                                               tuple(modules)),
                                 nprocs=RANKS, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{list(modules)}: ranks still running after {TIMEOUT} s")
    per_rank = []
    for rank in range(RANKS):
        with open(directory / f"rank{rank}.pkl", "rb") as file:
            per_rank.append(pickle.load(file))
    return {module: [ranks.get(module, {"<worker>": (False, "did not run")})
                     for ranks in per_rank] for module in modules}


def outcome(results: Results, name: str) -> list[Any]:
    """Every rank's value of check ``name``; fails with the rank's traceback if it failed."""
    values = []
    for rank, per_rank in enumerate(results):
        assert "<worker>" not in per_rank, per_rank["<worker>"][1]
        assert name in per_rank, f"check {name!r} did not run on rank {rank}"
        ok, value = per_rank[name]
        assert ok, f"rank {rank}: {value}"
        values.append(value)
    return values
