"""Every backend on an accelerator, against the dense float64 oracle on the same device.

The test suite runs on the CPU alone; this script is the check for another device (a GPU),
run where one is at hand::

    python benchmarks/device_check.py                  # cuda if torch sees one, else cpu
    python benchmarks/device_check.py --device cuda --out results/device_check.md
    python benchmarks/device_check.py --quick          # the zoo's first models, no timings

Sections (each call on ``--device``; each oracle from ``tests/reference.py``, in float64, on
``--device`` too, and its distance to the same oracle on the CPU reported beside: a model's own
function can differ across devices, e.g. LLaMA's rotary tables are computed in float32):

* ``zoo``: every model of ``tests/zoo.py`` with every backend, float64 (dense, per-sample,
  per-sample diagonal) and float32 (per-sample where the case declares it);
* ``real``: the real models of ``real_cases.py`` (GPT-2, LLaMA, BERT with attention masks, ViT,
  ResNet-18, MobileNet, LSTM, GRU) at the QUICK sizes in float64: ``auto`` per-sample (full and
  diagonal), ``tg.autograd.gramian`` recorded and walked, ``tg.aggregated_grad`` with UPGrad;
* ``ntk``: ``tg.ntk.empirical_ntk_fn`` cross kernels of the zoo's kernel models, every backend,
  full and traced;
* ``weighting``: every weighting on random PSD Gramians (m = 16, 64, 256; float64) against the
  same call on the CPU;
* ``timing`` (not with ``--quick``): the per-sample Gramian (``auto``) and the recorded eager
  Gramian as ratios to the plain backward on the benchmark's MLP, CNN and transformer and the
  real models (FULL sizes, float32), and ``upgrad`` / ``mgda`` in milliseconds at
  m = 64 / 256 / 1024;
* ``profile`` (not with ``--quick``): where those calls' time goes on the device, for the MLP,
  the transformer, GPT-2 and ResNet-18: wall and host time per call, aten ops, and on CUDA
  kernels, kernel time and synchronising runtime calls (``torch.profiler``): host-bound when
  the kernel time is far below the wall time.

A call passes when its answer is on ``--device``, in the asked dtype and within the tolerance of
the oracle (largest entry error relative to the oracle's largest entry, at least 1: float64
1e-10, float32 1e-5), or when it raises the same torchgram error as the same call on the CPU.
TF32 is switched off for the correctness sections (a user's TF32 changes their own backward as
much: it is a choice of precision, not torchgram's); the timings run with torch's defaults.
The exit status is 1 when any check failed.
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optree
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tests"):  # run as a script: `benchmarks` and `tests` are folders
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torchgram as tg  # noqa: E402
from benchmarks import cases as bench_cases  # noqa: E402
from benchmarks import real_cases  # noqa: E402
from benchmarks import weighting as weighting_bench  # noqa: E402
from reference import Dense, dense_cross_kernel, dense_gramian  # noqa: E402
from zoo import NAMES as ZOO_NAMES  # noqa: E402
from zoo import build as build_zoo  # noqa: E402

BACKENDS = ("jacobian", "ntvp", "graph", "structured", "auto")
NTK_BACKENDS = ("auto", "structured", "jacobian", "ntvp")
WEIGHTINGS = ("upgrad", "dualproj", "mgda", "imtl_g", "aligned_mtl", "pcgrad", "mean")
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
QUICK_ZOO = ("mlp", "cnn", "transformer")
TIMED_BENCH = ("mlp", "cnn", "transformer")


@dataclass
class Check:
    """One call's outcome: ``ok``, ``refused`` (the CPU's torchgram refusal too) or ``FAIL``."""

    section: str
    name: str
    status: str
    error: float | None = None
    detail: str = ""
    dtype: torch.dtype = torch.float64


class Checks:
    """The collected outcomes, printed as they come."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.items: list[Check] = []
        self.oracle_gaps: dict[str, float] = {}
        """Per model: the device oracle's largest entry error against the CPU's (no check)."""

    def oracle(self, section: str, name: str, on_device: Any, on_cpu: Any) -> Any:
        """Note how far the device oracle is from the CPU's; return the device's."""
        key = f"{section}/{name}"
        self.oracle_gaps[key] = max(self.oracle_gaps.get(key, 0.0),
                                    _worst_error(on_device, on_cpu, self.device,
                                                 torch.float64)[0])
        return on_device

    def add(self, check: Check) -> None:
        self.items.append(check)
        error = "" if check.error is None else f" {check.error:.1e}"
        if check.status != "ok":
            print(f"  {check.status:7s} {check.section}/{check.name}{error} {check.detail}",
                  flush=True)

    def run(self, section: str, name: str, on_device: Callable[[], Any],
            on_cpu: Callable[[], Any], expected: Any, dtype: torch.dtype) -> None:
        """Compare ``on_device()`` with ``expected``; an exception must be the CPU's too."""
        try:
            actual = on_device()
        except Exception as error:  # noqa: BLE001 -- every exception is an outcome here
            self.add(self._refusal(section, name, error, on_cpu))
            return
        worst, where = _worst_error(actual, expected, self.device, dtype)
        status = "ok" if where == "" and worst <= TOLERANCE[dtype] else "FAIL"
        self.add(Check(section, name, status, worst, where, dtype))

    @staticmethod
    def _refusal(section: str, name: str, error: Exception, on_cpu: Callable[[], Any]) -> Check:
        message = _one_line(error)
        ours = str(error).startswith("torchgram")
        try:
            on_cpu()
        except Exception as cpu_error:  # noqa: BLE001
            same = message == _one_line(cpu_error) and ours
            return Check(section, name, "refused" if same else "FAIL", None,
                         message if same else f"device: {message} | cpu: {_one_line(cpu_error)}")
        detail = f"raised on the device only: {message}"
        if not ours:
            detail += " | " + " ".join(traceback.format_exception(error)[-3:-1]).strip()[-400:]
        return Check(section, name, "FAIL", None, detail)


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def _worst_error(actual: Any, expected: Any, device: torch.device,
                 dtype: torch.dtype) -> tuple[float, str]:
    """Largest entry error relative to the oracle's largest entry (at least 1), and a note on
    anything else wrong (a leaf off the device, a wrong dtype or shape)."""
    got, want = optree.tree_leaves(actual), optree.tree_leaves(expected)
    if len(got) != len(want):
        return float("inf"), f"{len(got)} leaves, expected {len(want)}"
    worst = 0.0
    for a, e in zip(got, want, strict=True):
        if a.device.type != device.type:
            return float("inf"), f"answer on {a.device}, expected {device}"
        if a.dtype != dtype:
            return float("inf"), f"answer in {a.dtype}, expected {dtype}"
        if a.shape != e.shape:
            return float("inf"), f"shape {tuple(a.shape)}, expected {tuple(e.shape)}"
        a64, e64 = a.detach().cpu().double(), e.detach().cpu().double()
        scale = max(e64.abs().max().item() if e64.numel() else 0.0, 1.0)
        if a64.numel():
            gap = (a64 - e64).abs().max().item()
            if gap != gap:  # NaN: never within any tolerance
                return float("inf"), "NaN in the answer or the oracle"
            worst = max(worst, gap / scale)
    return worst, ""


@contextmanager
def _exact_float32() -> Iterator[None]:
    """TF32 off (matrix products and convolutions), restored after."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# -- zoo -----------------------------------------------------------------------------------------


def _zoo_gramian(name: str, backend: str, dtype: torch.dtype, per_sample: bool,
                 diagonal: bool, device: torch.device | None) -> Any:
    case = build_zoo(name, dtype, device=device)
    return tg.gramian(case.f, backend=backend, diagonal=diagonal,
                      batch_dim=case.batch_dim if per_sample else None,
                      in_dims=case.in_dims)(*case.args)


def check_zoo(checks: Checks, names: Sequence[str]) -> None:
    """Every backend on every zoo model: float64 dense / per-sample / diagonal, float32."""
    for name in names:
        here = build_zoo(name, device=checks.device)
        oracle = dense_gramian(here.f, here.args)
        checks.oracle("zoo", name, oracle.gramian,
                      dense_gramian(build_zoo(name).f, build_zoo(name).args).gramian)
        batched = build_zoo(name).batch_dim is not None
        modes = [("dense", torch.float64, False, False)]
        if batched:
            modes += [("per-sample", torch.float64, True, False),
                      ("diagonal", torch.float64, True, True)]
        modes.append(("float32", torch.float32, batched, False))
        for backend in BACKENDS:
            for mode, dtype, per_sample, diagonal in modes:
                call = functools.partial(_zoo_gramian, name, backend, dtype, per_sample,
                                         diagonal)
                checks.run("zoo", f"{name}/{backend}/{mode}",
                           functools.partial(call, checks.device), functools.partial(call, None),
                           oracle.shaped(diagonal=diagonal), dtype)


# -- real models ---------------------------------------------------------------------------------


def _real_case(name: str, device: torch.device | None) -> real_cases.RealCase:
    """Real model ``name`` at the QUICK sizes, in float64, on ``device``."""
    case = real_cases.build(name, real_cases.QUICK)
    case.module.to(device=device, dtype=torch.float64)
    case.inputs = tuple(_moved(x, device, torch.float64) for x in case.inputs)
    case.kw_inputs = {k: _moved(v, device, torch.float64) for k, v in case.kw_inputs.items()}
    case.__post_init__()  # the functional view of the moved module
    return case


def _moved(tensor: Tensor, device: torch.device | None, dtype: torch.dtype) -> Tensor:
    return tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else None)


def _eager_gramian(case: real_cases.RealCase, recorded: bool) -> Tensor:
    params = [p for p in case.module.parameters() if p.requires_grad]
    if recorded:
        with tg.autograd.record():
            losses = case.rows(case.module, *case.inputs, **case.kw_inputs)
    else:
        losses = case.rows(case.module, *case.inputs, **case.kw_inputs)
    gramian = tg.autograd.gramian(losses, params, batch_dim=0)
    assert isinstance(gramian, Tensor)
    return gramian


def _aggregated(case: real_cases.RealCase) -> Any:
    grads, _ = tg.aggregated_grad(case.f, tg.weighting.upgrad, batch_dim=0)(
        case.params, *case.inputs, **case.kw_inputs)
    return grads


def _eager_step(case: real_cases.RealCase) -> list[Tensor]:
    params = [p for p in case.module.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    with tg.autograd.record():
        losses = case.rows(case.module, *case.inputs, **case.kw_inputs)
    tg.autograd.backward(losses, params, tg.weighting.upgrad, batch_dim=0)
    return [torch.zeros_like(p) if p.grad is None else p.grad for p in params]


def check_real(checks: Checks, names: Sequence[str]) -> None:
    """The real models: the functional and eager per-sample paths, and one UPGrad step."""
    for name in names:
        here = _real_case(name, checks.device)
        oracle = dense_gramian(functools.partial(_real_rows, here), (here.params,))
        cpu = _real_case(name, None)
        checks.oracle("real", name, oracle.gramian,
                      dense_gramian(functools.partial(_real_rows, cpu), (cpu.params,)).gramian)
        calls: dict[str, tuple[Callable[[real_cases.RealCase], Any], Any]] = {
            "auto": (lambda c: tg.gramian(c.f, batch_dim=0)(c.params, *c.inputs, **c.kw_inputs),
                     oracle.gramian),
            "auto-diagonal": (lambda c: tg.gramian(c.f, batch_dim=0, diagonal=True)(
                c.params, *c.inputs, **c.kw_inputs), oracle.gramian.diagonal()),
            "eager-record": (lambda c: _eager_gramian(c, True), oracle.gramian),
            "eager-walk": (lambda c: _eager_gramian(c, False), oracle.gramian),
            "aggregated-upgrad": (_aggregated, _oracle_update(oracle, here, as_dict=True)),
            "eager-upgrad-step": (_eager_step, _oracle_update(oracle, here, as_dict=False)),
        }
        for label, (call, expected) in calls.items():
            checks.run("real", f"{name}/{label}",
                       functools.partial(_on_real_case, call, name, checks.device),
                       functools.partial(_on_real_case, call, name, None), expected,
                       torch.float64)


def _real_rows(case: real_cases.RealCase, params: Any) -> Tensor:
    return case.f(params, *case.inputs, **case.kw_inputs)


def _oracle_update(oracle: Dense, case: real_cases.RealCase, *, as_dict: bool) -> Any:
    """``Jᵀ upgrad(G)`` from the dense oracle, per parameter (a dict as ``aggregated_grad``
    returns it, or a list in ``module.parameters()`` order as ``.grad``)."""
    update = oracle.jacobian.T @ tg.weighting.upgrad(oracle.gramian)
    leaves: list[Tensor]
    leaves, spec = optree.tree_flatten(case.params)  # type: ignore[arg-type]  # column order
    parts = update.split([leaf.numel() for leaf in leaves])
    per_name = optree.tree_unflatten(spec, [part.reshape(leaf.shape) for leaf, part
                                            in zip(leaves, parts, strict=True)])
    if as_dict:
        return per_name
    return [per_name[name] for name, p in case.module.named_parameters() if p.requires_grad]


def _on_real_case(call: Callable[[real_cases.RealCase], Any], name: str,
                  device: torch.device | None) -> Any:
    return call(_real_case(name, device))


# -- kernels -------------------------------------------------------------------------------------


def _cross_kernel(name: str, backend: str, trace_axes: tuple[int, ...],
                  device: torch.device | None) -> Tensor:
    case = build_zoo(name, device=device)
    inputs = case.inputs[0]
    kernel = tg.ntk.empirical_ntk_fn(case.f, trace_axes=trace_axes, backend=backend)
    return kernel(inputs[:3], inputs, case.params)


def check_ntk(checks: Checks) -> None:
    """Cross kernels (3 × 5 inputs) of the zoo's kernel models, full and logit-traced."""
    names = [n for n in ZOO_NAMES if "ntk" in build_zoo(n).tags and build_zoo(n).in_dims == 0]
    for name in names:
        here, cpu = build_zoo(name, device=checks.device), build_zoo(name)
        x, x_cpu = here.inputs[0], cpu.inputs[0]
        for trace_axes in ((), (-1,)):
            expected = checks.oracle(
                "ntk", name, dense_cross_kernel(here.f, here.params, x[:3], x, trace_axes),
                dense_cross_kernel(cpu.f, cpu.params, x_cpu[:3], x_cpu, trace_axes))
            for backend in NTK_BACKENDS:
                call = functools.partial(_cross_kernel, name, backend, trace_axes)
                checks.run("ntk", f"{name}/{backend}/{'traced' if trace_axes else 'full'}",
                           functools.partial(call, checks.device), functools.partial(call, None),
                           expected, torch.float64)


# -- weightings ----------------------------------------------------------------------------------


def _random_gramian(m: int, device: torch.device | None, dtype: torch.dtype) -> Tensor:
    """The weighting benchmark's random Gramian ``A Aᵀ`` (``A``: m × 3m, seeded by m)."""
    return weighting_bench.make_gramian("random", m, {}).to(device=device, dtype=dtype)


def _seeded_pcgrad(seed: int, gramian: Tensor) -> Tensor:
    return tg.weighting.pcgrad(gramian, generator=torch.Generator().manual_seed(seed))


def check_weighting(checks: Checks, sizes: Sequence[int] = (16, 64, 256)) -> None:
    """Every weighting on the device against the same call on the CPU (float64)."""
    for m in sizes:
        for name in WEIGHTINGS:
            weighting = getattr(tg.weighting, name)
            if name == "pcgrad":  # the same visiting orders on both devices (CPU generator)
                weighting = functools.partial(_seeded_pcgrad, m)
            expected = weighting(_random_gramian(m, None, torch.float64))
            checks.run("weighting", f"{name}/m={m}",
                       functools.partial(_weigh, weighting, m, checks.device),
                       functools.partial(_weigh, weighting, m, None), expected, torch.float64)


def _weigh(weighting: Callable[[Tensor], Tensor], m: int, device: torch.device | None) -> Tensor:
    return weighting(_random_gramian(m, device, torch.float64))


# -- timings -------------------------------------------------------------------------------------


def _timed_ms(call: Callable[[], Any], device: torch.device, reps: int = 20) -> float:
    """Median milliseconds of ``call`` after three warm-up calls (device synchronised)."""
    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):
        call()
    synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


@dataclass
class Timing:
    """One model's medians (ms) and its ratios to the plain backward."""

    model: str
    backward_ms: float
    auto_ms: float | None
    recorded_ms: float | None
    note: str = ""


METHODS = ("backward", "auto", "recorded")


def _methods(name: str, device: torch.device) -> dict[str, Callable[[], Any]]:
    """Model ``name`` (the benchmark's or a real one, FULL sizes, float32) on ``device``: its
    plain backward, ``auto``'s per-sample Gramian and the recorded eager Gramian."""
    case: bench_cases.Case | real_cases.RealCase
    if name in bench_cases.NAMES:
        case = bench_cases.build(name)
        kw_inputs: dict[str, Tensor] = {}
    else:
        case = real_cases.build(name)
        kw_inputs = case.kw_inputs = {k: v.to(device) for k, v in case.kw_inputs.items()}
    case.module.to(device)
    case.inputs = tuple(x.to(device) for x in case.inputs)
    case.__post_init__()
    module, rows, inputs = case.module, case.rows, case.inputs
    trainable = [p for p in module.parameters() if p.requires_grad]
    gramian = tg.gramian(case.f, batch_dim=0)

    def backward() -> None:
        for p in trainable:
            p.grad = None
        rows(module, *inputs, **kw_inputs).sum().backward()

    def recorded() -> Any:
        with tg.autograd.record():
            losses = rows(module, *inputs, **kw_inputs)
        return tg.autograd.gramian(losses, trainable, batch_dim=0)

    return {"backward": backward,
            "auto": lambda: gramian(case.params, *inputs, **kw_inputs),
            "recorded": recorded}


def time_models(device: torch.device) -> list[Timing]:
    """The benchmark's own models and the real models (FULL sizes, float32) on ``device``."""
    timings = []
    for name in (*TIMED_BENCH, *real_cases.NAMES):
        methods = _methods(name, device)
        timing = Timing(name, _timed_ms(methods["backward"], device), None, None)
        notes = []
        for label in ("auto", "recorded"):
            try:
                setattr(timing, f"{label}_ms", _timed_ms(methods[label], device))
            except Exception as error:  # noqa: BLE001
                notes.append(f"{label}: {_one_line(error)[:120]}")
        timing.note = "; ".join(notes)
        timings.append(timing)
        print(f"  timed {name}", flush=True)
    return timings


# -- where a call's time goes on the device ------------------------------------------------------


PROFILED = ("mlp", "transformer", "gpt2", "resnet18")
SYNCHRONISING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                 "cudaMemcpy", "cudaMemcpyAsync")
"""CUDA runtime calls that make the host wait for the device (a copy to the host waits for the
kernels before it; ``cudaMemcpyAsync`` is counted too: torch's device-to-host ``.item()`` and
``bool()`` use it, then wait)."""


@dataclass
class Profiled:
    """One method's costs per call: wall time (synchronised), the host's time to return
    (not synchronised at the end: what the host spends issuing work, and waiting inside),
    aten ops dispatched, and on CUDA the kernels, their summed time and the synchronising
    runtime calls."""

    model: str
    method: str
    wall_ms: float
    host_ms: float
    ops: int
    kernels: float | None = None
    device_ms: float | None = None
    syncs: float | None = None


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def _host_ms(call: Callable[[], Any], device: torch.device, reps: int = 10) -> float:
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _device_profile(call: Callable[[], Any], reps: int = 5) -> tuple[float, float, float]:
    """Kernels, kernel milliseconds and synchronising runtime calls per call (CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    kernels, kernel_us, syncs = 0, 0.0, 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
            kernel_us += event.device_time_total
        elif event.name in SYNCHRONISING:
            syncs += 1
    return kernels / reps, kernel_us / 1e3 / reps, syncs / reps


def profile_models(device: torch.device, names: Sequence[str] = PROFILED) -> list[Profiled]:
    """Where each method's time goes on ``device`` (see :class:`Profiled`)."""
    out = []
    for name in names:
        for method, call in _methods(name, device).items():
            try:
                wall = _timed_ms(call, device, reps=10)
                host = _host_ms(call, device)
                with _CountOps() as counter:
                    call()
                record = Profiled(name, method, wall, host, counter.count)
                if device.type == "cuda":
                    record.kernels, record.device_ms, record.syncs = _device_profile(call)
            except Exception as error:  # noqa: BLE001
                print(f"  {name}/{method}: {_one_line(error)}", flush=True)
                continue
            out.append(record)
        print(f"  profiled {name}", flush=True)
    return out


def time_weightings(device: torch.device, sizes: Sequence[int] = (64, 256, 1024)
                    ) -> list[tuple[str, int, float]]:
    """``upgrad`` and ``mgda`` medians (ms) on random float32 Gramians on ``device``."""
    out = []
    for m in sizes:
        gramian = _random_gramian(m, device, torch.float32)
        for name in ("upgrad", "mgda"):
            weighting = getattr(tg.weighting, name)
            out.append((name, m, _timed_ms(functools.partial(weighting, gramian), device,
                                           reps=5 if m >= 1024 else 20)))
    return out


# -- report --------------------------------------------------------------------------------------


def _environment(device: torch.device) -> list[str]:
    lines = [f"* torch {torch.__version__}, Python {platform.python_version()}, "
             f"device `{device}`"]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        lines.append(f"* {props.name}, {props.total_memory / 2**30:.0f} GiB, "
                     f"{props.multi_processor_count} multiprocessors")
    return lines


def markdown(checks: Checks, timings: list[Timing],
             weighting_times: list[tuple[str, int, float]], profiled: list[Profiled],
             seconds: float) -> str:
    """The report: counts per section, every non-ok check, the timings."""
    lines = ["# Device check", "", *_environment(checks.device),
             f"* {len(checks.items)} checks in {seconds:.0f} s", "",
             "| section | ok | refused (as on the CPU) | FAIL | worst ok error: float64 | "
             "float32 |", "|---|--:|--:|--:|--:|--:|"]
    for section in dict.fromkeys(c.section for c in checks.items):
        items = [c for c in checks.items if c.section == section]
        count = {s: sum(c.status == s for c in items) for s in ("ok", "refused", "FAIL")}
        worst = [max((c.error for c in items if c.status == "ok" and c.error is not None
                      and c.dtype == dtype), default=None)
                 for dtype in (torch.float64, torch.float32)]
        cells = ["—" if w is None else f"{w:.1e}" for w in worst]
        lines.append(f"| {section} | {count['ok']} | {count['refused']} | {count['FAIL']} | "
                     f"{cells[0]} | {cells[1]} |")
    if checks.oracle_gaps:
        widest = max(checks.oracle_gaps, key=checks.oracle_gaps.__getitem__)
        lines += ["", "The oracle on the device against the oracle on the CPU (the models' own "
                  f"functions across devices): at most {checks.oracle_gaps[widest]:.1e} "
                  f"(`{widest}`); above 1e-12: " + ", ".join(f"`{k}` {v:.1e}" for k, v
                                                in checks.oracle_gaps.items() if v > 1e-12)]
    others = [c for c in checks.items if c.status != "ok"]
    if others:
        lines += ["", "| check | status | detail |", "|---|---|---|"]
        lines += [f"| {c.section}/{c.name} | {c.status} | "
                  f"{c.detail.replace('|', '/')} |" for c in others]
    if timings:
        lines += ["", "Per-sample Gramians, float32, median ms and ratio to the plain backward:",
                  "", "| model | backward ms | `auto` | recorded eager | note |",
                  "|---|--:|--:|--:|---|"]
        for t in timings:
            cells = [f"{ms:.2f} ({ms / t.backward_ms:.2f}×)" if ms is not None else "—"
                     for ms in (t.auto_ms, t.recorded_ms)]
            lines.append(f"| {t.model} | {t.backward_ms:.2f} | {cells[0]} | {cells[1]} | "
                         f"{t.note} |")
    if weighting_times:
        lines += ["", "Weightings on random float32 Gramians `A Aᵀ` (`A`: m × 3m), median ms:", "",
                  "| weighting | m | ms |", "|---|--:|--:|"]
        lines += [f"| {name} | {m} | {ms:.2f} |" for name, m, ms in weighting_times]
    if profiled:
        def cell(value: float | None, digits: int) -> str:
            return "—" if value is None else f"{value:.{digits}f}"

        lines += ["", "Per call (float32): wall ms (synchronised), host ms to return (not "
                  "synchronised), aten ops, and on CUDA kernels, kernel ms, synchronising "
                  "runtime calls:", "",
                  "| model | method | wall ms | host ms | ops | kernels | kernel ms | syncs |",
                  "|---|---|--:|--:|--:|--:|--:|--:|"]
        lines += [f"| {p.model} | {p.method} | {p.wall_ms:.2f} | {p.host_ms:.2f} | {p.ops} | "
                  f"{cell(p.kernels, 0)} | {cell(p.device_ms, 2)} | {cell(p.syncs, 1)} |"
                  for p in profiled]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the checks (and the timings), print and write the report; 1 if any check failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true",
                        help="the first zoo models, one real model, no timings")
    parser.add_argument("--sections", default="zoo,real,ntk,weighting,timing,profile")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown report here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    sections = set(args.sections.split(","))
    checks = Checks(device)
    start = time.perf_counter()
    with _exact_float32():
        for section, run in (
                ("zoo", lambda: check_zoo(checks, QUICK_ZOO if args.quick else ZOO_NAMES)),
                ("real", lambda: check_real(checks, real_cases.NAMES[:1] if args.quick
                                            else real_cases.NAMES)),
                ("ntk", lambda: check_ntk(checks)),
                ("weighting", lambda: check_weighting(checks, (16,) if args.quick
                                                      else (16, 64, 256)))):
            if section in sections:
                print(f"{section}:", flush=True)
                try:
                    run()
                except Exception as error:  # noqa: BLE001 -- a broken section is a failure
                    checks.add(Check(section, "(section)", "FAIL", None, _one_line(error)))
                    traceback.print_exc()
    timings: list[Timing] = []
    weighting_times: list[tuple[str, int, float]] = []
    profiled: list[Profiled] = []
    if "timing" in sections and not args.quick:
        print("timing:", flush=True)
        timings = time_models(device)
        weighting_times = time_weightings(device)
    if "profile" in sections and not args.quick:
        print("profile:", flush=True)
        profiled = profile_models(device)
    text = markdown(checks, timings, weighting_times, profiled, time.perf_counter() - start)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return int(any(c.status == "FAIL" for c in checks.items))


if __name__ == "__main__":
    raise SystemExit(main())
