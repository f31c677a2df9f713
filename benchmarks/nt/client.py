"""neural-tangents as a benchmark peer, driven from the main (torch) environment.

The NT side runs in its own venv (``benchmarks/nt/setup_venv.sh``) as a subprocess:
this module builds each case in torch, converts the weights to JAX's layout, runs
``benchmarks/nt/worker.py`` with the venv's python, and checks every NT kernel against a dense
float64 torch reference (``torch.func.jacrev``, ``J1 @ J2.T``, put in NT's layout by
:func:`semantics.to_nt_layout`). Without the venv, :func:`run_case` returns a skip with
:data:`NOT_INSTALLED` and nothing else happens (the test suite never needs the venv)::

    python -m benchmarks.nt.client                        # every case, 1 and 2 threads
    python -m benchmarks.nt.client --cases mlp-trace --threads 1 --repeats 5
    python -m benchmarks.nt.client --quick                # tiny sizes: a smoke run
    python -m benchmarks.nt.client --check-fixture        # the fixture, rebuilt in torch

Weight layout (torch → JAX):

* ``nn.Linear``: ``W [out, in]`` → ``W.T [in, out]``; the worker computes ``x @ W + b``
  (NT's structured derivatives are ~500× slower on ``x @ W.T`` with ``[out, in]`` weights).
* ``nn.Conv2d`` (layout ``NHWC``, the default): ``W [out, in, kh, kw]`` (OIHW) →
  ``W.permute(2, 3, 1, 0)`` (HWIO), images ``[N, C, H, W]`` → ``x.permute(0, 2, 3, 1)``.
  A ``Linear`` after ``Flatten`` of a ``[C, H, W]`` map reads torch's ``(c, h, w)`` order;
  JAX flattens NHWC as ``(h, w, c)``, so its rows are permuted:
  ``W.reshape(out, C, H, W).permute(2, 3, 1, 0).reshape(H * W * C, out)``.
* Layout ``NCHW``: conv weights and images pass unchanged (``OIHW``, torch's own order).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from benchmarks.nt import semantics  # noqa: E402

HERE = Path(__file__).resolve().parent
VENV_PYTHON = HERE / ".venv" / "bin" / "python"
WORKER = HERE / "worker.py"
NOT_INSTALLED = "neural-tangents not installed: run benchmarks/nt/setup_venv.sh"
IMPLEMENTATIONS = ("JACOBIAN_CONTRACTION", "NTK_VECTOR_PRODUCTS", "STRUCTURED_DERIVATIVES",
                   "AUTO")
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}


@dataclass
class NTCase:
    """One kernel to compute: a model, its inputs and NT's kernel options.

    Attributes:
        name: Short id (``mlp-full``, ``cnn-trace``, ``mlp-cross``, …).
        title: One line for the report.
        module: An ``nn.Sequential`` of ``Linear``, ``Conv2d``, ``ReLU``, ``Tanh``,
            ``MaxPool2d``, ``AdaptiveAvgPool2d(1)`` and ``Flatten`` layers.
        x1: First inputs ``[N1, ...]``.
        x2: Second inputs ``[N2, ...]``, or ``None`` for ``x1`` (NT's ``x2=None``).
        trace_axes: NT's ``trace_axes`` (mean over each traced output-axis pair).
        diagonal_axes: NT's ``diagonal_axes``.
        implementations: The ``nt.NtkImplementation`` names the worker runs.
    """

    name: str
    title: str
    module: nn.Sequential
    x1: Tensor
    x2: Tensor | None
    trace_axes: tuple[int, ...]
    diagonal_axes: tuple[int, ...] = ()
    implementations: tuple[str, ...] = IMPLEMENTATIONS
    notes: list[str] = field(default_factory=list)


def build_cases(quick: bool = False) -> dict[str, NTCase]:
    """The benchmark's cases, on the models of ``benchmarks.cases`` (``ntk-mlp``, ``ntk-cnn``).

    ``mlp-*`` use the MLP 784-512-512-10 (ReLU) on N = 16 inputs, ``cnn-*`` the CNN
    (2× conv3x3 16/32 channels + ReLU + max-pool, MLP head 2048-128-10) on 16 images
    3×32×32; ``mlp-cross`` is the traced kernel between those 16 inputs and 512 others.
    ``quick`` uses ``benchmarks.cases.QUICK`` sizes (x2 of 8) for a smoke run.
    """
    from benchmarks import cases as bench_cases

    sizes = bench_cases.QUICK if quick else bench_cases.FULL
    mlp, cnn = bench_cases.build("ntk-mlp", sizes), bench_cases.build("ntk-cnn", sizes)
    generator = torch.Generator().manual_seed(1)
    n2 = 8 if quick else 512
    x_cross = torch.randn(n2, mlp.inputs[0].shape[1], generator=generator)
    widths = "-".join(map(str, sizes.mlp_widths))
    n = sizes.ntk_batch
    built = [
        NTCase("mlp-full", f"MLP {widths} logits, N={n}: full kernel [{n}, {n}, 10, 10]",
               mlp.module, mlp.inputs[0], None, ()),
        NTCase("mlp-trace", f"MLP {widths} logits, N={n}: traced kernel [{n}, {n}]",
               mlp.module, mlp.inputs[0], None, (-1,)),
        NTCase("cnn-full", f"CNN logits, N={n}: full kernel [{n}, {n}, 10, 10]",
               cnn.module, cnn.inputs[0], None, ()),
        NTCase("cnn-trace", f"CNN logits, N={n}: traced kernel [{n}, {n}]",
               cnn.module, cnn.inputs[0], None, (-1,)),
        NTCase("mlp-cross", f"MLP {widths} logits, cross kernel {n} × {n2}, traced "
               f"[{n}, {n2}]", mlp.module, mlp.inputs[0], x_cross, (-1,)),
    ]
    return {case.name: case for case in built}


def torch_to_layers(module: nn.Sequential, x: Tensor, layout: str = "NHWC"
                    ) -> tuple[list[dict[str, Any]], dict[str, np.ndarray]]:
    """Describe ``module`` as the worker's layers, with its weights in JAX's layout.

    Args:
        module: The torch model (see :class:`NTCase` for the layers it may hold).
        x: An example input batch (used to follow the activation shapes).
        layout: ``"NHWC"`` (JAX's usual, HWIO conv weights) or ``"NCHW"`` (torch's).

    Returns:
        ``(layers, arrays)``: the worker's layer list and the named weights (float arrays in
        the module's dtype). The module docstring gives every conversion.
    """
    layers: list[dict[str, Any]] = []
    arrays: dict[str, np.ndarray] = {}
    h = x
    flattened_from: tuple[int, int, int] | None = None  # [C, H, W] before a Flatten
    with torch.no_grad():
        for index, layer in enumerate(module):
            w, b = f"w{index}", f"b{index}"
            if isinstance(layer, nn.Linear):
                weight = layer.weight.detach()
                if flattened_from is not None and layout == "NHWC":
                    c, hh, ww = flattened_from
                    weight = weight.reshape(-1, c, hh, ww).permute(0, 2, 3, 1).reshape(
                        weight.shape[0], -1)
                arrays[w] = weight.T.contiguous().numpy()
                arrays[b] = layer.bias.detach().numpy()
                layers.append({"op": "dense", "w": w, "b": b})
                flattened_from = None
            elif isinstance(layer, nn.Conv2d):
                if layer.groups != 1 or layer.dilation != (1, 1) or layer.padding_mode != "zeros":
                    raise ValueError(f"client: unsupported Conv2d options in {layer}")
                if isinstance(layer.padding, str):
                    raise ValueError(f"client: string padding {layer.padding!r} unsupported")
                weight = layer.weight.detach()
                arrays[w] = (weight.permute(2, 3, 1, 0) if layout == "NHWC" else weight
                             ).contiguous().numpy()
                arrays[b] = layer.bias.detach().numpy()
                layers.append({"op": "conv", "w": w, "b": b, "stride": list(layer.stride),
                               "padding": [[p, p] for p in layer.padding]})
            elif isinstance(layer, nn.ReLU):
                layers.append({"op": "relu"})
            elif isinstance(layer, nn.Tanh):
                layers.append({"op": "tanh"})
            elif isinstance(layer, nn.MaxPool2d):
                if layer.stride != layer.kernel_size or layer.padding != 0:
                    raise ValueError(f"client: only MaxPool2d(k) (stride k) supported: {layer}")
                layers.append({"op": "maxpool", "window": layer.kernel_size})
            elif isinstance(layer, nn.AdaptiveAvgPool2d):
                if layer.output_size not in (1, (1, 1)):
                    raise ValueError(f"client: only AdaptiveAvgPool2d(1) supported: {layer}")
                layers.append({"op": "avgpool_global"})
                h = layer(h).flatten(1)
                continue
            elif isinstance(layer, nn.Flatten):
                if h.ndim == 4:
                    flattened_from = (h.shape[1], h.shape[2], h.shape[3])
                layers.append({"op": "flatten"})
            else:
                raise ValueError(f"client: no JAX translation for layer {layer}")
            h = layer(h)
    return layers, arrays


def jax_input(x: Tensor, layout: str) -> np.ndarray:
    """``x`` as the worker expects it (images ``NCHW`` → ``NHWC`` for that layout)."""
    x = x.detach()
    if x.ndim == 4 and layout == "NHWC":
        x = x.permute(0, 2, 3, 1)
    return x.contiguous().numpy()


def reference_kernel(case: NTCase, chunk: int = 16, dtype: torch.dtype = torch.float64
                     ) -> np.ndarray:
    """NT's kernel from a dense torch Gramian: ``J(x1) J(x2)ᵀ`` in NT's layout, in ``dtype``.

    ``J`` is ``torch.func.jacrev`` of the flattened outputs w.r.t. every parameter, per
    sample (``vmap`` over chunks of ``chunk`` samples: the models have no cross-sample ops),
    concatenated over the parameters; the Gramian ``[N1, K, N2, K]`` is reduced by
    :func:`semantics.to_nt_layout`.
    """
    module = _copy_module(case.module, dtype)
    params = {k: v.detach() for k, v in module.named_parameters()}

    def one(p: dict[str, Tensor], xi: Tensor) -> Tensor:
        return torch.func.functional_call(module, p, (xi[None],))[0]

    per_sample = torch.func.vmap(torch.func.jacrev(one), in_dims=(None, 0))

    def jacobian(x: Tensor) -> Tensor:  # [n, K, P]
        jac = per_sample(params, x.to(dtype))
        return torch.cat([leaf.reshape(x.shape[0], -1, params[k].numel())
                          for k, leaf in jac.items()], dim=2)

    x2 = case.x1 if case.x2 is None else case.x2
    with torch.no_grad():
        j1 = jacobian(case.x1)
        blocks = [torch.einsum("akp,bjp->akbj", j1, jacobian(x2[i:i + chunk]))
                  for i in range(0, x2.shape[0], chunk)]
    gram = torch.cat(blocks, dim=2).numpy()
    return semantics.to_nt_layout(gram, 2, case.trace_axes, case.diagonal_axes)


def _copy_module(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    import copy

    return copy.deepcopy(module).to(dtype)


FIXTURE = HERE.parents[1] / "tests" / "data" / "nt_reference"


def torch_apply(layers: Sequence[dict[str, Any]]
                ) -> Callable[[dict[str, Tensor], Tensor], Tensor]:
    """The fixture's models in torch (layout ``NCHW``): ``f(params, x)`` from the worker's layers.

    ``dense`` is ``x @ w + b`` (``[in, out]``), ``conv`` is ``F.conv2d`` with torch's OIHW
    weights as stored; ``params`` maps the layers' weight names to tensors.
    """
    import torch.nn.functional as F

    def apply(params: dict[str, Tensor], x: Tensor) -> Tensor:
        h = x
        for layer in layers:
            op = layer["op"]
            if op == "dense":
                h = h @ params[layer["w"]] + params[layer["b"]]
            elif op == "conv":
                (top, bottom), (left, right) = layer["padding"]
                if top != bottom or left != right:
                    raise ValueError("client: asymmetric padding")
                h = F.conv2d(h, params[layer["w"]], params[layer["b"]],
                             stride=tuple(layer["stride"]), padding=(top, left))
            elif op == "relu":
                h = torch.relu(h)
            elif op == "tanh":
                h = torch.tanh(h)
            elif op == "avgpool_global":
                h = h.mean(dim=(2, 3))
            elif op == "flatten":
                h = h.flatten(1)
            else:
                raise ValueError(f"client: no torch translation for {op!r}")
        return h

    return apply


def check_fixture(path: Path = FIXTURE) -> dict[str, float]:
    """Rebuild the fixture's models in torch and compare every stored NT kernel.

    The dense float64 Gramian ``jacrev`` gives, put in NT's layout by
    :func:`semantics.to_nt_layout`, must equal each ``*.ntk.*`` array: the check that the
    fixture can be reproduced without jax (what ``torchgram.ntk``'s tests will do).

    Returns:
        Key → relative error, for every stored kernel.
    """
    meta = json.loads(path.with_suffix(".json").read_text())
    errors: dict[str, float] = {}
    with np.load(path.with_suffix(".npz")) as data:
        arrays = {key: torch.from_numpy(data[key]) for key in data.files}
    for entry in meta["kernels"]:
        if not entry["stored"]:
            continue
        model = meta["models"][entry["model"]]
        prefix = entry["model"] + "."
        weights = {name[len(prefix):]: value for name, value in arrays.items()
                   if name.startswith(prefix) and "." not in name[len(prefix):]}
        params = {k: v for k, v in weights.items() if not k.startswith("x")}
        f = torch_apply(model["layers"])
        x1 = weights["x1"]
        x2 = x1 if entry["x2"] is None else weights[entry["x2"]]

        def flat_jacobian(x: Tensor, f: Any = f, params: dict[str, Tensor] = params
                          ) -> Tensor:
            jac = torch.func.jacrev(lambda p: f(p, x))(params)
            return torch.cat([leaf.reshape(x.shape[0] * leaf.shape[1], -1)
                              for leaf in jac.values()], dim=1)

        out = f(params, x1)
        gram = (flat_jacobian(x1) @ flat_jacobian(x2).T).reshape(
            tuple(out.shape) + (x2.shape[0],) + tuple(out.shape[1:]))
        kernel = semantics.to_nt_layout(gram.numpy(), out.ndim, entry["trace_axes"],
                                        entry["diagonal_axes"])
        errors[entry["key"]] = relative_error(kernel, arrays[entry["key"]].numpy())
    return errors


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    """``max |a - b| / max |b|``."""
    return float(np.max(np.abs(a.astype(np.float64) - b)) / max(np.max(np.abs(b)), 1e-300))


def run_worker(case: NTCase, threads: int | None, *, repeats: int = 10,
               max_seconds: float = 20.0, layout: str = "NHWC", x64: bool = False,
               max_memory_gb: float | None = 12.0, timeout: float = 1800.0,
               implementations: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the worker on ``case`` in the NT venv; return its report with the kernels.

    Returns:
        The worker's JSON report plus ``"kernels"`` → implementation → ``np.ndarray``
        (under ``report["arrays"]``), ``"wall_s"`` (the whole subprocess, imports included)
        and ``"command"``; or ``{"skipped": NOT_INSTALLED}`` without the venv.
    """
    if not VENV_PYTHON.exists():
        return {"skipped": NOT_INSTALLED}
    layers, arrays = torch_to_layers(case.module, case.x1, layout)
    dtype = np.float64 if x64 else np.float32
    arrays = {k: v.astype(dtype) for k, v in arrays.items()}
    arrays["x1"] = jax_input(case.x1, layout).astype(dtype)
    if case.x2 is not None:
        arrays["x2"] = jax_input(case.x2, layout).astype(dtype)
    with tempfile.TemporaryDirectory(prefix="torchgram-nt-") as tmp:
        folder = Path(tmp)
        np.savez(folder / "request.npz", **arrays)
        request = {
            "arrays": str(folder / "request.npz"), "output": str(folder / "result"),
            "threads": threads, "x64": x64, "layout": layout, "layers": layers,
            "kernels": [{"name": case.name, "x1": "x1",
                         "x2": None if case.x2 is None else "x2",
                         "trace_axes": list(case.trace_axes),
                         "diagonal_axes": list(case.diagonal_axes), "vmap_axes": 0}],
            "implementations": list(implementations or case.implementations),
            "repeats": repeats, "max_seconds": max_seconds, "max_memory_gb": max_memory_gb,
        }
        (folder / "request.json").write_text(json.dumps(request))
        command = [str(VENV_PYTHON), str(WORKER), str(folder / "request.json")]
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
        wall = time.perf_counter() - start
        if done.returncode != 0 or not (folder / "result.json").exists():
            return {"error": f"worker exited with {done.returncode}: {done.stderr[-3000:]}",
                    "wall_s": wall}
        report = json.loads((folder / "result.json").read_text())
        with np.load(folder / "result.npz") as result:
            kernels = {name.split("__", 1)[1]: result[name] for name in result.files}
    report["arrays"] = kernels
    report["wall_s"] = wall
    report["command"] = shlex.join(command[:2] + ["REQUEST.json"])
    return report


def time_torchgram(case: NTCase, repeats: int) -> dict[str, Any]:
    """Time torchgram's current way: ``tg.gramian(fn, batch_dim=0)(params, x)`` + NT layout.

    The ``[N, K, N, K]`` Gramian is put in NT's layout (traced by mean) inside the timed
    call. A cross kernel has no API today: the Gramian of ``cat([x1, x2])`` is computed and
    its ``x1 × x2`` block taken.
    """
    import torchgram as tg

    fn, params = tg.functionalize(case.module)
    params = {k: v.detach() for k, v in params.items()}
    gramian = tg.gramian(fn, batch_dim=0)
    n1 = case.x1.shape[0]
    x = case.x1 if case.x2 is None else torch.cat([case.x1, case.x2])

    def call() -> Tensor:
        g = gramian(params, x)  # [N, K, N, K]
        if case.x2 is not None:
            g = g[:n1, :, n1:, :]
        if case.trace_axes:
            return torch.einsum("akbk->ab", g) / g.shape[1]
        return g.permute(0, 2, 1, 3)

    start = time.perf_counter()
    kernel = call()
    first = time.perf_counter() - start
    warm, cpu = [], []
    for _ in range(repeats):
        cpu_start, start = time.process_time(), time.perf_counter()
        call()
        warm.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
    return {"method": "tg.gramian(batch_dim=0)" + (" on cat([x1, x2])" if case.x2 is not None
                                                  else ""),
            "first_call_s": first, "warm_median_s": statistics.median(warm),
            "warm_min_s": min(warm), "cpu_median_s": statistics.median(cpu),
            "cpu_per_wall": sum(cpu) / sum(warm), "warm_s": warm,
            "kernel": kernel.detach().numpy(), "shape": list(kernel.shape)}


def run_case(case: NTCase, threads: int | None, *, repeats: int = 10,
             check: bool = True, torchgram: bool = True, **worker_options: Any
             ) -> dict[str, Any]:
    """NT's kernels and timings for ``case``, checked against the dense torch reference.

    Returns:
        A JSON-able record: per implementation ``first_call_s``, ``warm_median_s``,
        ``rel_error`` and ``agrees`` (``rel_error <= 1e-5`` in float32), the worker's
        settings and versions, and torchgram's timing of the same kernel when
        ``torchgram`` (with its own ``rel_error``); or ``{"skipped": NOT_INSTALLED}``.
    """
    record: dict[str, Any] = {"case": case.name, "title": case.title, "threads": threads}
    torch.set_num_threads(threads or os.cpu_count() or 1)
    report = run_worker(case, threads, repeats=repeats, **worker_options)
    if "skipped" in report or "error" in report:
        return {**record, **report}
    x64 = bool(report.get("x64"))
    tolerance = TOLERANCE[torch.float64 if x64 else torch.float32]
    reference = reference_kernel(case) if check else None
    kernels = report.pop("arrays")
    implementations = report["kernels"][case.name]["implementations"]
    for name, entry in implementations.items():
        entry.pop("warm_s", None)
        entry.pop("cpu_s", None)
        if reference is not None and name in kernels:
            entry["rel_error"] = relative_error(kernels[name], reference)
            entry["agrees"] = entry["rel_error"] <= tolerance
    record.update({"implementations": implementations, "tolerance": tolerance,
                   "worker_wall_s": report["wall_s"], "versions": report["versions"],
                   "thread_settings": report.get("thread_settings"),
                   "shape": next((list(k.shape) for k in kernels.values()), None)})
    if torchgram:
        tg_record = time_torchgram(case, repeats)
        kernel = tg_record.pop("kernel", None)
        tg_record.pop("warm_s", None)
        if kernel is not None and reference is not None:
            tg_record["rel_error"] = relative_error(kernel, reference)
        record["torchgram"] = tg_record
    return record


def _best(record: dict[str, Any]) -> tuple[str, float] | None:
    timed = {name: e["warm_median_s"] for name, e in record.get("implementations", {}).items()
             if e.get("warm_median_s") is not None and e.get("agrees", True)}
    return min(timed.items(), key=lambda item: item[1]) if timed else None


def _ms(entry: dict[str, Any], key: str) -> str:
    value = entry.get(key)
    return "—" if value is None else f"{1000 * value:.1f}"


def format_table(records: Sequence[dict[str, Any]]) -> str:
    """A markdown table: one row per (case, threads, implementation)."""
    lines = ["| case | threads | implementation | first call (s) | warm median (ms) | "
             "warm min (ms) | CPU per call (ms) | rel. error vs dense torch | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for record in records:
        if "implementations" not in record:
            reason = record.get("skipped") or record.get("error", "")
            lines.append(f"| {record['case']} | {record['threads']} | — | — | — | — | — | "
                         f"— | {reason[:200]} |")
            continue
        best = _best(record)
        rows = list(record["implementations"].items())
        if "torchgram" in record:
            rows.append((f"torchgram today: {record['torchgram'].get('method', 'gramian')}",
                         record["torchgram"]))
        for name, e in rows:
            if "error" in e or "skipped" in e:
                note = (e.get("error") or e.get("skipped", "")).splitlines()[0][:120]
                lines.append(f"| {record['case']} | {record['threads']} | {name} | — | — | — | "
                             f"— | — | {note} |")
                continue
            note = []
            if best and name == best[0]:
                note.append("**NT best**")
            if "auto_choice" in e:
                note.append(f"AUTO chose {e['auto_choice']}")
            if e.get("agrees") is False:
                note.append("MISMATCH")
            error = f"{e['rel_error']:.1e}" if "rel_error" in e else "—"
            lines.append(f"| {record['case']} | {record['threads']} | {name} | "
                         f"{e['first_call_s']:.2f} | {_ms(e, 'warm_median_s')} | "
                         f"{_ms(e, 'warm_min_s')} | {_ms(e, 'cpu_median_s')} | "
                         f"{error} | {'; '.join(note)} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: run the cases, print the table, optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="mlp-full,mlp-trace,cnn-full,cnn-trace,mlp-cross")
    parser.add_argument("--threads", default="1,2",
                        help="comma-separated thread counts; each case alternates them")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--max-seconds", type=float, default=20.0,
                        help="stop timing one implementation after this much warm time")
    parser.add_argument("--max-memory-gb", type=float, default=12.0)
    parser.add_argument("--layout", default="NHWC", choices=("NHWC", "NCHW"))
    parser.add_argument("--implementations", default=",".join(IMPLEMENTATIONS))
    parser.add_argument("--skip", default="mlp-cross:NTK_VECTOR_PRODUCTS",
                        help="comma-separated case:IMPLEMENTATION pairs not to run")
    parser.add_argument("--no-torchgram", action="store_true")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke run)")
    parser.add_argument("--json", type=Path, default=None, help="write every record here")
    parser.add_argument("--render", type=Path, default=None,
                        help="print the table of a --json file and exit (runs nothing)")
    parser.add_argument("--check-fixture", action="store_true",
                        help="rebuild tests/data/nt_reference in torch, compare every stored "
                             "kernel with a dense float64 jacrev (needs no NT venv) and exit")
    args = parser.parse_args(argv)
    if args.check_fixture:
        errors = check_fixture()
        worst = max(errors, key=errors.__getitem__)
        print(f"{len(errors)} fixture kernels reproduced in torch; largest relative error "
              f"{errors[worst]:.1e} ({worst})")
        return 0 if errors[worst] < 1e-12 else 1
    if args.render is not None:
        saved = json.loads(args.render.read_text())
        print(json.dumps(saved["header"]))
        print(format_table(saved["records"]))
        return 0
    if not VENV_PYTHON.exists():
        print(NOT_INSTALLED)
        return 0
    cases = build_cases(args.quick)
    skip = {tuple(pair.split(":", 1)) for pair in args.skip.split(",") if pair}
    records = []
    load_before = os.getloadavg()
    start = time.perf_counter()
    for name in args.cases.split(","):
        case = cases[name]
        case.implementations = tuple(i for i in args.implementations.split(",")
                                     if (name, i) not in skip)
        for threads in (int(t) for t in args.threads.split(",")):
            record = run_case(case, threads, repeats=args.repeats, max_seconds=args.max_seconds,
                              layout=args.layout, max_memory_gb=args.max_memory_gb,
                              torchgram=not args.no_torchgram)
            record["skipped_implementations"] = sorted(i for c, i in skip if c == name)
            records.append(record)
            print(format_table([record]).split("\n", 2)[2], flush=True)
    header = {"command": shlex.join(["python", "-m", "benchmarks.nt.client",
                                     *(sys.argv[1:] if argv is None else argv)]),
              "load_before": load_before, "load_after": os.getloadavg(),
              "wall_s": time.perf_counter() - start, "torch": torch.__version__}
    print(json.dumps(header))
    print(format_table(records))
    if args.json is not None:
        args.json.write_text(json.dumps({"header": header, "records": records}, indent=1,
                                        default=_jsonable))
    return 0


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(type(value))


if __name__ == "__main__":
    raise SystemExit(main())

