"""Weighting benchmark (issue 16): torchgram.weighting vs torchjd, and one Jacobian-descent step.

Run:  python benchmarks/weighting.py            full run (m = 16, 64, 256, 1024; ~20-40 min)
      python benchmarks/weighting.py --quick    tiny sizes, a few seconds (what the smoke test runs)

Everything runs on one CPU thread (``torch.set_num_threads(1)``). Each table row times our
weighting and torchjd's on the same Gramian, alternating their turns within one process
(``--repeats`` turns each, after one warm-up call each); the figures are medians, and the
ratios, taken within one run, are what counts: other load on the machine shifts absolute times.

Gramians (float64), for each ``m``:

* ``random``: ``A Aᵀ`` with ``A`` of shape ``[m, 3m]`` (the issue's measurements);
* ``rank-1`` and ``rank-m/2``: ``A Bᵀ``-factored, rank-deficient;
* ``ill-conditioned``: eigenvalues spread evenly in log scale over ``1e-8 … 1``;
* ``training``: per-sample Gramians ``tg.gramian(losses, batch_dim=0)`` of an MLP 64-64-10 on
  scikit-learn's digits, with a batch of ``m`` samples, after 100 SGD steps.

Accuracy columns: ``KKT`` is the largest relative KKT residual ``ρ`` of the QPs behind the
weights (UPGrad, DualProj: ``_kkt.kkt_residual`` of every projection; MGDA: the simplex QP's),
``≤ 1e-13`` is what the solvers certify (NOTE [KKT certificate] in
``torchgram/weighting/_kkt.py``); ``vs torchjd`` is ``max |w - w_torchjd| / max |w_torchjd|``
(for MGDA, whose torchjd version is Frank-Wolfe with a stopping rule, the difference of the
objectives ``(w_torchjdᵀGw_torchjd - wᵀGw) / tr(G)`` instead, ``≥ 0`` when ours is at least as
good; PCGrad's visiting orders are random, so only its time is compared). torchjd's
quadprog-based UPGrad takes about an hour per call at ``m = 1024`` (its time grows like
``m⁴``): above ``--torchjd-max-m`` (256) it is skipped, as is torchjd's PCGrad (a Python loop
over ``m²`` pairs); the table says so.

The step section times one Jacobian-descent step with UPGrad over the per-sample losses of the
benchmark MLP 784-512-512-10 (random inputs) with the public API: ``tg.gramian(losses,
batch_dim=0)``, ``tg.weighting.upgrad``, and ``Jᵀw`` as one ``torch.func.vjp`` with cotangent
``w``; then ``tg.aggregated_grad`` (the same, in one call), all against a plain backward of the
mean loss. The warm-start section times ``upgrad`` over consecutive training steps with and
without a ``tg.weighting.WarmStart``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import torchgram as tg
from torchgram.weighting._dual_cone import normalize_and_regularize
from torchgram.weighting._kkt import KKT_TOL, kkt_residual
from torchgram.weighting._nonneg import solve_nonneg

RESULTS = Path(__file__).resolve().parent / "results"
FAMILIES = ("random", "rank-1", "rank-m/2", "ill-conditioned", "training")
WEIGHTINGS = ("upgrad", "dualproj", "mgda", "imtl_g", "aligned_mtl", "pcgrad")


@dataclass(frozen=True)
class Config:
    """What one run measures."""

    sizes: tuple[int, ...]
    families: tuple[str, ...]
    weightings: tuple[str, ...]
    repeats: int
    torchjd_max_m: int
    pcgrad_max_m: int
    step_batches: tuple[int, ...]
    step_widths: tuple[int, ...]
    warm_steps: int
    warm_sizes: tuple[int, ...]
    train_steps: int
    large_repeats: int  # repeats from m = 1024 on


FULL = Config(sizes=(16, 64, 256, 1024), families=FAMILIES, weightings=WEIGHTINGS, repeats=5,
              torchjd_max_m=256, pcgrad_max_m=256, step_batches=(64, 256),
              step_widths=(784, 512, 512, 10), warm_steps=10, warm_sizes=(64, 256),
              train_steps=100, large_repeats=3)
# Small enough to run in a few seconds, and with one size (130) on the CG solver's side.
QUICK = Config(sizes=(6, 130), families=("random", "training"), weightings=WEIGHTINGS,
               repeats=1, torchjd_max_m=130, pcgrad_max_m=6, step_batches=(8,),
               step_widths=(20, 16, 16, 10), warm_steps=3, warm_sizes=(130,), train_steps=3,
               large_repeats=1)


@dataclass
class Row:
    """One (weighting, m, family) comparison."""

    weighting: str
    m: int
    family: str
    ours_ms: float
    torchjd_ms: float | None = None
    kkt: float | None = None
    agreement: float | None = None
    solver: str = ""
    note: str = ""

    @property
    def speedup(self) -> float | None:
        """torchjd's median time over ours."""
        return None if self.torchjd_ms is None else self.torchjd_ms / self.ours_ms


@dataclass
class Results:
    """Everything a run measured, as written to the json file."""

    config: dict[str, Any]
    machine: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    warm: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0


# ---------------------------------------------------------------- Gramians


def _digits_mlp_gramians(sizes: Sequence[int], train_steps: int) -> dict[int, Tensor]:
    """Per-sample Gramians of an MLP 64-64-10 on sklearn's digits after ``train_steps`` steps."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32) / 16.0
    y = torch.tensor(labels)
    torch.manual_seed(0)
    fn, params = tg.functionalize(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)))

    def losses(p: dict[str, Tensor], xb: Tensor, yb: Tensor) -> Tensor:
        return F.cross_entropy(fn(p, xb), yb, reduction="none")

    step = tg.aggregated_grad(losses, tg.weighting.upgrad, batch_dim=0)
    generator = torch.Generator().manual_seed(1)
    for _ in range(train_steps):
        index = torch.randint(len(y), (32,), generator=generator)
        update, _ = step(params, x[index], y[index])
        params = {name: value - 0.1 * update[name] for name, value in params.items()}
    gramian = tg.gramian(losses, batch_dim=0)
    index = torch.randperm(len(y), generator=generator)
    return {m: _symmetric(gramian(params, x[index[:m]], y[index[:m]]).double()) for m in sizes}


def _symmetric(G: Tensor) -> Tensor:
    """``(G + Gᵀ) / 2``: a float32 Gramian cast to float64 is symmetric only to float32 ulps."""
    return (G + G.T) / 2


def make_gramian(family: str, m: int, training: dict[int, Tensor]) -> Tensor:
    """The float64 Gramian of ``family`` with ``m`` rows (seeded by ``m``)."""
    if family == "training":
        return training[m]
    generator = torch.Generator().manual_seed(m)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    if family == "random":
        A = randn(m, 3 * m)
    elif family == "rank-1":
        A = randn(m, 1) @ randn(1, 3 * m)
    elif family == "rank-m/2":
        A = randn(m, max(m // 2, 1)) @ randn(max(m // 2, 1), 3 * m)
    elif family == "ill-conditioned":
        U, _ = torch.linalg.qr(randn(m, m))
        A = U * torch.logspace(0, -4, m, dtype=torch.float64)  # G = A Aᵀ: cond 1e8.
    else:
        raise ValueError(f"unknown Gramian family {family!r}")
    return _symmetric(A @ A.T)


# ---------------------------------------------------------------- accuracy


def dual_cone_kkt(G: Tensor, name: str) -> tuple[float, str]:
    """Largest KKT residual of the QPs behind upgrad / dualproj on ``G``, and the solver used."""
    H = normalize_and_regularize(G, 1e-4, 1e-4)
    m = G.shape[0]
    U = (torch.eye(m, dtype=torch.float64) if name == "upgrad"
         else torch.full((1, m), 1.0 / m, dtype=torch.float64))
    q = U @ H
    solution = solve_nonneg(H, q)
    return float(kkt_residual(H, q, solution.x).max()), solution.solver


def simplex_kkt(G: Tensor, w: Tensor) -> float:
    """Relative KKT residual of MGDA's ``min wᵀHw`` over the simplex (``H = G / tr G``)."""
    H = G / G.diagonal().sum()
    w = w.double().clamp(min=0.0)
    hw = H @ w
    nu = w @ hw
    scale = H.abs() @ w + nu.abs()
    # (Hw)_i ≥ ν everywhere, = ν on the support; and Σw = 1.
    violation = torch.where(w > 0, (hw - nu).abs(), (nu - hw).clamp(min=0.0))
    return max(float((violation / scale.clamp(min=1e-300)).max()), abs(float(w.sum()) - 1.0))


def relative_difference(w: Tensor, reference: Tensor) -> float:
    """``max |w - w_ref| / max |w_ref|``."""
    return float((w.double() - reference.double()).abs().max() / reference.double().abs().max())


# ---------------------------------------------------------------- timing


def alternate(functions: dict[str, Callable[[], Any]], repeats: int
              ) -> tuple[dict[str, float], dict[str, Any]]:
    """Median milliseconds of each function, timed in alternating turns after one warm-up each,
    and each function's last result."""
    times: dict[str, list[float]] = {name: [] for name in functions}
    results = {name: function() for name, function in functions.items()}
    names = list(functions)
    for turn in range(repeats):
        for name in names[turn % len(names):] + names[:turn % len(names)]:
            start = time.perf_counter()
            results[name] = functions[name]()
            times[name].append(1e3 * (time.perf_counter() - start))
    return {name: statistics.median(values) for name, values in times.items()}, results


def _torchjd_weighting(name: str) -> Callable[[Tensor], Tensor] | None:
    try:
        from torchjd import aggregation
    except ImportError:
        return None
    factories = {"upgrad": "UPGradWeighting", "dualproj": "DualProjWeighting",
                 "mgda": "MGDAWeighting", "imtl_g": "IMTLGWeighting",
                 "aligned_mtl": "AlignedMTLWeighting", "pcgrad": "PCGradWeighting"}
    weighting: Callable[[Tensor], Tensor] = getattr(aggregation, factories[name])()
    return weighting


def compare(name: str, m: int, family: str, G: Tensor, config: Config) -> Row:
    """Times ours and torchjd's ``name`` on ``G`` and checks their answers."""
    ours: Callable[[Tensor], Tensor] = getattr(tg.weighting, name)
    theirs = _torchjd_weighting(name)
    note = ""
    limit = config.pcgrad_max_m if name == "pcgrad" else config.torchjd_max_m
    if theirs is not None and name in ("upgrad", "pcgrad") and m > limit:
        theirs, note = None, f"torchjd skipped above m = {limit} (too slow)"
    elif theirs is None:
        note = "torchjd not installed"
    functions: dict[str, Callable[[], Any]] = {"ours": lambda: ours(G)}
    if theirs is not None:
        reference = theirs
        functions["torchjd"] = lambda: reference(G)
    times, answers = alternate(functions, config.repeats if m < 1024 else config.large_repeats)
    row = Row(name, m, family, times["ours"], times.get("torchjd"), note=note)
    w = answers["ours"]
    if name in ("upgrad", "dualproj"):
        row.kkt, row.solver = dual_cone_kkt(G, name)
    elif name == "mgda":
        row.kkt = simplex_kkt(G, w)
    if theirs is not None and name == "mgda":
        w_ref = answers["torchjd"].double()
        w64 = w.double()
        row.agreement = float((w_ref @ G @ w_ref - w64 @ G @ w64) / G.diagonal().sum())
    elif theirs is not None and name != "pcgrad":
        row.agreement = relative_difference(w, answers["torchjd"])
    return row


# ---------------------------------------------------------------- one Jacobian-descent step


def jd_step(batch: int, widths: Sequence[int], repeats: int) -> dict[str, Any]:
    """Times the parts of one UPGrad step on an MLP's per-sample losses, and a plain backward."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i, (d_in, d_out) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        layers += [nn.Linear(d_in, d_out)] + ([nn.ReLU()] if i < len(widths) - 2 else [])
    model = nn.Sequential(*layers)
    x, y = torch.randn(batch, widths[0]), torch.randint(0, widths[-1], (batch,))
    fn, params = tg.functionalize(model)

    def losses(p: dict[str, Tensor]) -> Tensor:
        return F.cross_entropy(fn(p, x), y, reduction="none")

    def backward() -> None:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()

    gramian = tg.gramian(lambda p, xb, yb: F.cross_entropy(fn(p, xb), yb, reduction="none"),
                         batch_dim=0)
    G = gramian(params, x, y)
    w = tg.weighting.upgrad(G)

    def vjp() -> Any:
        _, pullback = torch.func.vjp(losses, params)
        return pullback(w)

    def composed() -> Any:
        G_ = gramian(params, x, y)
        w_ = tg.weighting.upgrad(G_)
        _, pullback = torch.func.vjp(losses, params)
        return pullback(w_)

    aggregated = tg.aggregated_grad(
        lambda p, xb, yb: F.cross_entropy(fn(p, xb), yb, reduction="none"),
        tg.weighting.upgrad, batch_dim=0)
    times, _ = alternate({
        "backward": backward, "gramian": lambda: gramian(params, x, y),
        "upgrad": lambda: tg.weighting.upgrad(G), "vjp (Jᵀw)": vjp,
        "gramian + upgrad + vjp": composed,
        "aggregated_grad": lambda: aggregated(params, x, y),
    }, repeats)
    floor = times["backward"]
    return {"batch": batch, "widths": list(widths), "ms": times,
            "x backward": {name: value / floor for name, value in times.items()}}


# ---------------------------------------------------------------- warm starts


def warm_start(m: int, steps: int) -> dict[str, Any]:
    """``upgrad`` over consecutive steps of a training loop, cold and with a WarmStart.

    Two loops on the digits MLP, UPGrad steps with learning rate 0.1: one on a fixed batch of
    ``m`` samples (consecutive Gramians are close and their rows match: the case warm starts
    are for) and one on fresh batches (rows are different samples at every step).
    """
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32) / 16.0
    y = torch.tensor(labels)
    out: dict[str, Any] = {"m": m, "steps": steps}
    torch.manual_seed(0)
    fn, initial = tg.functionalize(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)))

    def losses(p: dict[str, Tensor], xb: Tensor, yb: Tensor) -> Tensor:
        return F.cross_entropy(fn(p, xb), yb, reduction="none")

    step = tg.aggregated_grad(losses, tg.weighting.upgrad, batch_dim=0)
    for kind in ("same batch", "fresh batches"):
        params = initial
        generator = torch.Generator().manual_seed(2)
        index = torch.randperm(len(y), generator=generator)[:m]
        gramians = []
        for _ in range(steps):
            if kind == "fresh batches":
                index = torch.randperm(len(y), generator=generator)[:m]
            update, info = step(params, x[index], y[index])
            gramians.append(_symmetric(info.gramian.double()))
            params = {name: value - 0.1 * update[name] for name, value in params.items()}
        cold, warm, worst = [], [], 0.0
        state = tg.weighting.WarmStart()
        tg.weighting.upgrad(gramians[0], state=state)
        for G in gramians[1:]:
            start = time.perf_counter()
            w_cold = tg.weighting.upgrad(G)
            cold.append(1e3 * (time.perf_counter() - start))
            start = time.perf_counter()
            w_warm = tg.weighting.upgrad(G, state=state)
            warm.append(1e3 * (time.perf_counter() - start))
            worst = max(worst, relative_difference(w_warm, w_cold))
        out[kind] = {"cold_ms": statistics.median(cold), "warm_ms": statistics.median(warm),
                     "max relative difference": worst, "solver": state.solver}
    return out


# ---------------------------------------------------------------- report


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) \
        else format(value, spec)


def render(results: Results) -> str:
    """The markdown page."""
    c = results.config
    lines = [
        "# Weighting benchmark (issue 16)", "",
        "Written by `benchmarks/weighting.py` (see its docstring for what is measured).", "",
        f"Command: `python benchmarks/weighting.py{' --quick' if c['quick'] else ''}` — "
        f"{results.machine['threads']} thread, torch {results.machine['torch']}, "
        f"{results.machine['processor']}; load average before {results.machine['load_before']}"
        f", after {results.machine['load_after']}; wall time {results.wall_s:.0f} s.", "",
        "Medians of "
        f"{c['repeats']} ({c['large_repeats']} from m = 1024 on) alternating turns (ours, "
        "torchjd) on the same float64 Gramian, after one warm-up call each. "
        f"`KKT`: largest relative KKT residual of the QPs (certified ≤ {KKT_TOL:g} for "
        "upgrad/dualproj); `vs torchjd`: max |w - w_torchjd| / max |w_torchjd| (mgda: "
        "(w_torchjdᵀGw_torchjd - wᵀGw) / tr(G), ≥ 0 means ours is at least as good).", "",
    ]
    for name in c["weightings"]:
        rows = [row for row in results.rows if row.weighting == name]
        if not rows:
            continue
        lines += [f"## {name}", "",
                  "| m | Gramian | ours (ms) | torchjd (ms) | speed-up | KKT | vs torchjd | "
                  "solver | note |", "|---|---|---|---|---|---|---|---|---|"]
        for row in rows:
            lines.append(
                f"| {row.m} | {row.family} | {_fmt(row.ours_ms, '.3g')} | "
                f"{_fmt(row.torchjd_ms, '.3g')} | {_fmt(row.speedup, '.1f')}"
                f"{'×' if row.speedup is not None else ''} | {_fmt(row.kkt, '.1e')} | "
                f"{_fmt(row.agreement, '.1e')} | {row.solver} | {row.note} |")
        lines.append("")
    if results.steps:
        lines += ["## One Jacobian-descent step (UPGrad over per-sample losses)", "",
                  "Times in ms (× a plain backward of the mean loss).", "",
                  "| MLP | batch | " + " | ".join(results.steps[0]["ms"]) + " |",
                  "|---|---|" + "---|" * len(results.steps[0]["ms"])]
        for step in results.steps:
            cells = [f"{step['ms'][k]:.3g} ({step['x backward'][k]:.2f}×)" for k in step["ms"]]
            lines.append(f"| {'-'.join(map(str, step['widths']))} | {step['batch']} | "
                         + " | ".join(cells) + " |")
        lines.append("")
    if results.warm:
        lines += ["## Warm starts (upgrad over consecutive training steps)", "",
                  "| m | loop | cold (ms) | with WarmStart (ms) | max relative difference | "
                  "solver |", "|---|---|---|---|---|---|"]
        for warm in results.warm:
            for kind in ("same batch", "fresh batches"):
                entry = warm[kind]
                lines.append(f"| {warm['m']} | {kind} | {entry['cold_ms']:.3g} | "
                             f"{entry['warm_ms']:.3g} | {entry['max relative difference']:.1e} "
                             f"| {entry['solver']} |")
        lines.append("")
    return "\n".join(lines)


def _load() -> str:
    try:
        return " ".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        return "unknown"


def main(argv: Sequence[str] | None = None) -> Results:
    """Runs the benchmark; writes ``<out>/weighting.md`` and ``weighting.json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="output folder")
    parser.add_argument("--sizes", type=lambda s: tuple(int(v) for v in s.split(",")))
    parser.add_argument("--families", type=lambda s: tuple(s.split(",")))
    parser.add_argument("--weightings", type=lambda s: tuple(s.split(",")))
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--torchjd-max-m", type=int)
    parser.add_argument("--no-step", action="store_true", help="skip the JD-step section")
    parser.add_argument("--no-warm", action="store_true", help="skip the warm-start section")
    args = parser.parse_args(argv)
    config = QUICK if args.quick else FULL
    overrides = {"sizes": args.sizes, "families": args.families, "weightings": args.weightings,
                 "repeats": args.repeats, "torchjd_max_m": args.torchjd_max_m,
                 "pcgrad_max_m": args.torchjd_max_m}
    config = Config(**{**asdict(config), **{k: v for k, v in overrides.items() if v}})

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    results = Results(config={**asdict(config), "quick": args.quick},
                      machine={"threads": 1, "torch": torch.__version__,
                               "processor": platform.processor() or platform.machine(),
                               "load_before": _load()})
    try:
        training = (_digits_mlp_gramians(config.sizes, config.train_steps)
                    if "training" in config.families else {})
        for m in config.sizes:
            for family in config.families:
                G = make_gramian(family, m, training)
                for name in config.weightings:
                    row = compare(name, m, family, G, config)
                    results.rows.append(row)
                    print(f"{name:12} m={m:<5} {family:16} ours {row.ours_ms:9.3f} ms  "
                          f"torchjd {_fmt(row.torchjd_ms, '9.3f')} ms  KKT {_fmt(row.kkt, '.1e')}"
                          f"  vs torchjd {_fmt(row.agreement, '.1e')} {row.note}", flush=True)
        if not args.no_step:
            for batch in config.step_batches:
                results.steps.append(jd_step(batch, config.step_widths, config.repeats))
                print("step", results.steps[-1], flush=True)
        if not args.no_warm:
            for m in config.warm_sizes:
                results.warm.append(warm_start(m, config.warm_steps))
                print("warm", results.warm[-1], flush=True)
    finally:
        torch.set_num_threads(threads)
    results.wall_s = time.perf_counter() - start
    results.machine["load_after"] = _load()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "weighting.md").write_text(render(results))
    payload = asdict(results)
    payload["rows"] = [{**asdict(row), "speedup": row.speedup} for row in results.rows]
    (args.out / "weighting.json").write_text(json.dumps(payload, indent=1))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
