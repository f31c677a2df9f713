"""The neural-tangents side of the NTK benchmark: runs INSIDE ``benchmarks/nt/.venv``.

Only numpy, jax and neural_tangents are imported here (never torch). The main environment
(``benchmarks/nt/client.py``) writes a request and runs::

    benchmarks/nt/.venv/bin/python benchmarks/nt/worker.py REQUEST.json

or, to take turns with torchgram call by call (``benchmarks/ntk.py``)::

    benchmarks/nt/.venv/bin/python benchmarks/nt/worker.py --serve REQUEST.json

which builds, compiles and first-calls every implementation of the request's first kernel,
writes the kernels and a report (``output``), prints one JSON line ``{"ready": report}``, then
answers each JSON line ``{"run": IMPLEMENTATION}`` read from stdin with one timed warm call,
``{"wall_s": ..., "cpu_s": ...}``, and each ``{"gemm": [M, K, N]}`` with the multiply-adds per
second of a jitted float32 ``[M, K] × [K, N]`` product, ``{"gmacs": ...}`` (the machine's
matrix-product speed as XLA sees it), until ``{"quit": true}`` or end of input. Protocol lines
are the only output on stdout (everything else the libraries print goes to stderr).

Request (JSON)::

    {
      "arrays": "req.npz",          # weights and inputs, by name
      "output": "res",              # writes res.npz (kernels) and res.json (times, shapes)
      "threads": 1,                 # 1, N, or null (XLA's default: every schedulable core)
      "x64": false,                 # jax_enable_x64 (float64 end to end)
      "layout": "NHWC",             # image layout of conv layers: "NHWC" (HWIO weights) or
                                    # "NCHW" (OIHW weights, torch's own layout)
      "layers": [{"op": "dense", "w": "w0", "b": "b0"}, {"op": "relu"}, ...],
      "kernels": [{"name": "full", "x1": "x1", "x2": null, "trace_axes": [],
                   "diagonal_axes": [], "vmap_axes": 0}],
      "implementations": ["JACOBIAN_CONTRACTION", "NTK_VECTOR_PRODUCTS",
                          "STRUCTURED_DERIVATIVES", "AUTO"],
      "repeats": 10,                # warm calls timed per implementation (median reported)
      "max_seconds": 20.0,          # stop timing one implementation after this much warm time
      "max_memory_gb": 12           # address-space cap (RLIMIT_AS): an implementation that
                                    # needs more fails with RESOURCE_EXHAUSTED, recorded
    }

Layers (``f(params, x)`` is their composition; weights use JAX's ``[in, out]`` layout):

* ``dense``: ``x @ w + b`` with ``w [in, out]``.
* ``conv``: ``lax.conv_general_dilated`` + bias, ``stride [sh, sw]``, ``padding [[t, b], [l, r]]``;
  ``w`` is HWIO for ``layout="NHWC"``, OIHW (torch's ``[out, in, kh, kw]``) for ``"NCHW"``.
* ``relu``, ``tanh``; ``maxpool`` (``window`` = stride, no padding, like ``nn.MaxPool2d(k)``);
  ``avgpool_global`` (mean over the spatial axes, giving ``[N, C]``); ``flatten``
  (``reshape(N, -1)`` in the layout's own order).

Every implementation in ``nt.NtkImplementation`` named in the request is built with
``nt.empirical_ntk_fn(f, trace_axes, diagonal_axes, vmap_axes, implementation)`` and wrapped in
``jax.jit``. After a jitted forward and gradient of ``f`` (so that jax's own start-up is
paid before any timing), each implementation's first call (trace + compile + run,
``block_until_ready``) is timed once, then,
after one more untimed call, the implementations take turns (round robin, the order rotating
every round) for ``repeats`` timed calls each; the median is reported. A failure is recorded
with its message, never raised.

Threads: the request's ``threads`` is applied *before* jax is imported. ``threads == 1`` sets
``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1``; any
``threads`` pins the process to that many cores (``os.sched_setaffinity``: XLA sizes its
thread pool from the schedulable cores) and sets ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``,
``OPENBLAS_NUM_THREADS`` and ``TF_NUM_INTRAOP_THREADS`` to it. The result records the CPU time
over wall time of the timed calls, which shows how many cores were really busy.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

IMPLEMENTATIONS = ("JACOBIAN_CONTRACTION", "NTK_VECTOR_PRODUCTS", "STRUCTURED_DERIVATIVES",
                   "AUTO")
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                    "TF_NUM_INTRAOP_THREADS")
SINGLE_THREAD_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def configure_threads(threads: int | None) -> dict[str, Any]:
    """Restrict this process to ``threads`` cores; must run before jax is imported.

    Returns:
        What was set: the XLA flags, the pinned cores and the thread variables.
    """
    if threads is not None:
        if threads < 1:
            raise ValueError(f"worker: expected threads >= 1 or null, but got {threads}.")
        if threads == 1:
            flags = os.environ.get("XLA_FLAGS", "")
            os.environ["XLA_FLAGS"] = f"{flags} {SINGLE_THREAD_XLA_FLAGS}".strip()
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, cores[:threads])
        for variable in THREAD_VARIABLES:
            os.environ[variable] = str(threads)
        os.environ["TF_NUM_INTEROP_THREADS"] = "1"
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return {"threads": threads, "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
            "affinity": sorted(os.sched_getaffinity(0)),
            **{variable: os.environ.get(variable) for variable in THREAD_VARIABLES}}


def build_apply(layers: Sequence[dict[str, Any]], layout: str) -> Callable[[Any, Any], Any]:
    """Return ``f(params, x)``: the composition of ``layers`` (``params[i]`` is layer i's).

    ``params`` is a list aligned with ``layers``: ``{"w": w, "b": b}`` for ``dense`` and
    ``conv``, ``None`` for the layers without parameters.
    """
    import jax
    import jax.numpy as jnp
    from jax import lax

    if layout not in ("NHWC", "NCHW"):
        raise ValueError(f"worker: expected layout 'NHWC' or 'NCHW', but got {layout!r}.")
    spatial = (1, 2) if layout == "NHWC" else (2, 3)
    numbers = ("NHWC", "HWIO", "NHWC") if layout == "NHWC" else ("NCHW", "OIHW", "NCHW")

    def apply(params: list[Any], x: Any) -> Any:
        h = x
        for layer, p in zip(layers, params, strict=True):
            op = layer["op"]
            if op == "dense":
                h = h @ p["w"] + p["b"]
            elif op == "conv":
                h = lax.conv_general_dilated(
                    h, p["w"], window_strides=tuple(layer["stride"]),
                    padding=[tuple(pad) for pad in layer["padding"]],
                    dimension_numbers=numbers)
                h = h + (p["b"] if layout == "NHWC" else p["b"][:, None, None])
            elif op == "relu":
                h = jax.nn.relu(h)
            elif op == "tanh":
                h = jnp.tanh(h)
            elif op == "maxpool":
                window = [1] * h.ndim
                for axis in spatial:
                    window[axis] = layer["window"]
                h = lax.reduce_window(h, -jnp.inf, lax.max, tuple(window), tuple(window),
                                      "VALID")
            elif op == "avgpool_global":
                h = jnp.mean(h, axis=spatial)
            elif op == "flatten":
                h = h.reshape(h.shape[0], -1)
            else:
                raise ValueError(f"worker: unknown layer op {op!r}.")
        return h

    return apply


def build_params(layers: Sequence[dict[str, Any]], arrays: dict[str, Any]) -> list[Any]:
    """The parameter pytree of :func:`build_apply` from the request's named arrays."""
    import jax.numpy as jnp

    return [{"w": jnp.asarray(arrays[layer["w"]]), "b": jnp.asarray(arrays[layer["b"]])}
            if layer["op"] in ("dense", "conv") else None for layer in layers]


def _error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 2000 else text[:2000] + " …"


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def gemm_gmacs(m: int, k: int, n: int, repeats: int = 5) -> float:
    """Billions of multiply-adds per second of a jitted float32 ``[m, k] × [k, n]`` product."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
    b = jnp.asarray(rng.standard_normal((k, n), dtype=np.float32))
    product = jax.jit(jnp.matmul)
    product(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        product(a, b).block_until_ready()
        times.append(time.perf_counter() - start)
    return m * k * n / statistics.median(times) / 1e9


def build_kernels(f: Callable[[Any, Any], Any], params: Any, x1: Any, x2: Any | None,
                  spec: dict[str, Any], implementations: Sequence[str]
                  ) -> tuple[dict[str, Callable[..., Any]], dict[str, Any], dict[str, Any]]:
    """Jit every implementation, time its first call, run it once more (untimed).

    Returns:
        ``(fns, kernels, report)``: the jitted kernel function of each implementation that
        ran, its kernel (numpy), and per implementation ``first_call_s``, ``shape``,
        ``dtype`` (AUTO: ``auto_flops``, ``auto_choice``) — or ``error``.
    """
    import jax
    import neural_tangents as nt
    import numpy as np

    fns: dict[str, Callable[..., Any]] = {}
    report: dict[str, Any] = {}
    kernels: dict[str, Any] = {}
    for name in implementations:
        entry: dict[str, Any] = {}
        report[name] = entry
        if not hasattr(nt.NtkImplementation, name):
            entry["error"] = f"nt.NtkImplementation has no {name} in this version"
            continue
        try:
            fn = jax.jit(nt.empirical_ntk_fn(
                f, trace_axes=tuple(spec["trace_axes"]),
                diagonal_axes=tuple(spec["diagonal_axes"]), vmap_axes=spec["vmap_axes"],
                implementation=getattr(nt.NtkImplementation, name)))
            printed = io.StringIO()  # AUTO prints "impl=N, flops=F" per candidate
            with contextlib.redirect_stdout(printed):
                start = time.perf_counter()
                kernel = fn(x1, x2, params).block_until_ready()
                entry["first_call_s"] = time.perf_counter() - start
            flops = {nt.NtkImplementation(int(i)).name: float(v)
                     for i, v in re.findall(r"impl=(\d+), flops=([0-9.e+-]+)", printed.getvalue())}
            if flops:
                entry["auto_flops"] = flops
                entry["auto_choice"] = min(flops, key=flops.__getitem__)
            fn(x1, x2, params).block_until_ready()  # one more, untimed
        except Exception as exc:  # noqa: BLE001 - recorded, the others still run
            entry["error"] = _error(exc)
            continue
        kernels[name] = np.asarray(kernel)
        entry["shape"] = list(kernel.shape)
        entry["dtype"] = str(kernel.dtype)
        fns[name] = fn
    return fns, kernels, report


def time_kernel(f: Callable[[Any, Any], Any], params: Any, x1: Any, x2: Any | None,
                spec: dict[str, Any], implementations: Sequence[str], repeats: int,
                max_seconds: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """Compute and time one kernel with every implementation.

    Returns:
        ``(kernels, report)``: the kernel of each implementation that ran (numpy), and per
        implementation ``first_call_s``, ``warm_median_s``, ``warm_min_s``, ``warm_s`` (every
        timed call), ``cpu_s`` and ``cpu_median_s`` (this process's CPU seconds per call: on
        one thread, what the call costs with the core to itself), ``cpu_per_wall``,
        ``shape`` — or ``error``.
    """
    fns, kernels, report = build_kernels(f, params, x1, x2, spec, implementations)
    for name in fns:
        report[name]["warm_s"], report[name]["cpu_s"] = [], []
    for round_ in range(repeats):
        running = [name for name in fns if sum(report[name]["warm_s"]) < max_seconds]
        if not running:
            break
        shift = round_ % len(running)
        for name in running[shift:] + running[:shift]:
            cpu_start, start = _cpu_seconds(), time.perf_counter()
            fns[name](x1, x2, params).block_until_ready()
            report[name]["warm_s"].append(time.perf_counter() - start)
            report[name]["cpu_s"].append(_cpu_seconds() - cpu_start)
    for name in fns:
        warm, cpu = report[name]["warm_s"], report[name]["cpu_s"]
        report[name]["warm_median_s"] = statistics.median(warm) if warm else None
        report[name]["warm_min_s"] = min(warm) if warm else None
        report[name]["cpu_median_s"] = statistics.median(cpu) if cpu else None
        report[name]["cpu_per_wall"] = sum(cpu) / sum(warm) if warm else None
    return kernels, report


def run(request: dict[str, Any]) -> dict[str, Any]:
    """Carry out one request (threads already configured); write and return the report."""
    import jax

    jax.config.update("jax_enable_x64", bool(request.get("x64", False)))
    import jax.numpy as jnp
    import neural_tangents as nt
    import numpy as np

    jnp.zeros(1).block_until_ready()  # start the backend outside every timing
    with np.load(request["arrays"]) as data:
        arrays = {name: data[name] for name in data.files}
    layers = request["layers"]
    f = build_apply(layers, request.get("layout", "NHWC"))
    params = build_params(layers, arrays)
    implementations = request.get("implementations", IMPLEMENTATIONS)
    out_arrays: dict[str, Any] = {}
    report: dict[str, Any] = {
        "versions": {"jax": jax.__version__, "neural_tangents": nt.__version__,
                     "numpy": np.__version__, "python": sys.version.split()[0]},
        "devices": [str(d) for d in jax.devices()], "x64": bool(request.get("x64", False)),
        "layout": request.get("layout", "NHWC"), "kernels": {}}
    for spec in request["kernels"]:
        x1 = jnp.asarray(arrays[spec["x1"]])
        x2 = None if spec.get("x2") is None else jnp.asarray(arrays[spec["x2"]])
        # Warm jax's tracing, autodiff and compilation machinery on this model (a jitted
        # forward and gradient) so that no implementation's first call pays for it alone.
        jax.jit(f)(params, x1).block_until_ready()
        jax.block_until_ready(jax.jit(jax.grad(lambda p, x: f(p, x).sum()))(params, x1))
        kernels, timing = time_kernel(f, params, x1, x2, spec, implementations,
                                      int(request.get("repeats", 10)),
                                      float(request.get("max_seconds", 20.0)))
        for name, kernel in kernels.items():
            out_arrays[f"{spec['name']}__{name}"] = kernel
        report["kernels"][spec["name"]] = {"spec": spec, "implementations": timing}
    output = Path(request["output"])
    np.savez(output.with_suffix(".npz"), **out_arrays)
    output.with_suffix(".json").write_text(json.dumps(report, indent=1))
    return report


def serve(request: dict[str, Any], protocol: Any) -> dict[str, Any]:
    """The ``--serve`` mode (module docstring): build, report ready, then time calls on demand.

    ``protocol`` is the text stream the JSON lines go to (the original stdout).
    """
    import jax

    jax.config.update("jax_enable_x64", bool(request.get("x64", False)))
    import jax.numpy as jnp
    import neural_tangents as nt
    import numpy as np

    jnp.zeros(1).block_until_ready()
    with np.load(request["arrays"]) as data:
        arrays = {name: data[name] for name in data.files}
    layers = request["layers"]
    f = build_apply(layers, request.get("layout", "NHWC"))
    params = build_params(layers, arrays)
    spec = request["kernels"][0]
    x1 = jnp.asarray(arrays[spec["x1"]])
    x2 = None if spec.get("x2") is None else jnp.asarray(arrays[spec["x2"]])
    jax.jit(f)(params, x1).block_until_ready()
    jax.block_until_ready(jax.jit(jax.grad(lambda p, x: f(p, x).sum()))(params, x1))
    fns, kernels, timing = build_kernels(f, params, x1, x2, spec,
                                         request.get("implementations", IMPLEMENTATIONS))
    output = Path(request["output"])
    np.savez(output.with_suffix(".npz"),
             **{f"{spec['name']}__{name}": kernel for name, kernel in kernels.items()})
    report: dict[str, Any] = {
        "versions": {"jax": jax.__version__, "neural_tangents": nt.__version__,
                     "numpy": np.__version__, "python": sys.version.split()[0]},
        "x64": bool(request.get("x64", False)), "layout": request.get("layout", "NHWC"),
        "kernels": {spec["name"]: {"spec": spec, "implementations": timing}}}
    output.with_suffix(".json").write_text(json.dumps(report, indent=1))
    protocol.write(json.dumps({"ready": report}) + "\n")
    protocol.flush()
    for line in sys.stdin:
        message = json.loads(line)
        if message.get("quit"):
            break
        if "gemm" in message:
            protocol.write(json.dumps({"gmacs": gemm_gmacs(*message["gemm"])}) + "\n")
            protocol.flush()
            continue
        name = message["run"]
        cpu_start, start = _cpu_seconds(), time.perf_counter()
        fns[name](x1, x2, params).block_until_ready()
        reply = {"wall_s": time.perf_counter() - start, "cpu_s": _cpu_seconds() - cpu_start}
        protocol.write(json.dumps(reply) + "\n")
        protocol.flush()
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``worker.py REQUEST.json`` or ``worker.py --serve REQUEST.json``."""
    args = list(sys.argv[1:] if argv is None else argv)
    serving = bool(args) and args[0] == "--serve"
    if serving:
        args = args[1:]
    if len(args) != 1:
        print("usage: worker.py [--serve] REQUEST.json", file=sys.stderr)
        return 2
    request = json.loads(Path(args[0]).read_text())
    if request.get("max_memory_gb"):
        cap = int(float(request["max_memory_gb"]) * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    threads = configure_threads(request.get("threads"))
    if serving:
        protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w")
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints go to stderr
        sys.stdout = sys.stderr
        serve(request, protocol)
        return 0
    report = run(request)
    report["thread_settings"] = threads
    Path(request["output"]).with_suffix(".json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
