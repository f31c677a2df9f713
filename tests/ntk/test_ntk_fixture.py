"""``torchgram.ntk`` against neural-tangents' own outputs (tests/data/nt_reference, float64).

Every kernel combination NT's default implementation accepts, on the fixture's MLP and CNN,
on every backend, with and without per-sample structure; every combination it rejects
raises a torchgram error that says why. The fixture and the rules it checks are described
in ``benchmarks/nt/SEMANTICS.md``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import torchgram as tg

DATA = Path(__file__).resolve().parents[1] / "data" / "nt_reference"
META = json.loads(DATA.with_suffix(".json").read_text())
with np.load(DATA.with_suffix(".npz")) as _data:
    ARRAYS = {key: torch.from_numpy(_data[key]) for key in _data.files}
BACKENDS = ("auto", "structured", "jacobian", "ntvp")


def model(name: str) -> Any:
    """The fixture's ``f(params, x)`` in torch (``benchmarks.nt.client.torch_apply``'s layers)."""
    layers = META["models"][name]["layers"]

    def f(params: dict[str, Tensor], x: Tensor) -> Tensor:
        h = x
        for layer in layers:
            op = layer["op"]
            if op == "dense":
                h = h @ params[layer["w"]] + params[layer["b"]]
            elif op == "conv":
                (top, _), (left, _) = layer["padding"]
                h = F.conv2d(h, params[layer["w"]], params[layer["b"]],
                             stride=tuple(layer["stride"]), padding=(top, left))
            elif op == "relu":
                h = torch.relu(h)
            elif op == "tanh":
                h = torch.tanh(h)
            elif op == "avgpool_global":
                h = h.mean(dim=(2, 3))
            else:
                raise AssertionError(op)
        return h

    return f


def arrays(name: str) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The model's parameters and inputs (x1, x2, x3)."""
    prefix = name + "."
    own = {key[len(prefix):]: value for key, value in ARRAYS.items()
           if key.startswith(prefix) and "." not in key[len(prefix):]}
    return ({k: v for k, v in own.items() if not k.startswith("x")},
            {k: v for k, v in own.items() if k.startswith("x")})


ACCEPTED = [entry for entry in META["kernels"] if entry["stored"]]
REJECTED = [entry for entry in META["kernels"] if not entry["stored"]]


@pytest.mark.parametrize("vmap_axes", [0, None], ids=["vmap0", "novmap"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("entry", ACCEPTED, ids=[e["key"] for e in ACCEPTED])
def test_every_accepted_kernel_matches_neural_tangents(entry: dict[str, Any], backend: str,
                                                       vmap_axes: int | None) -> None:
    params, inputs = arrays(entry["model"])
    ntk_fn = tg.ntk.empirical_ntk_fn(model(entry["model"]), trace_axes=tuple(entry["trace_axes"]),
                                     diagonal_axes=tuple(entry["diagonal_axes"]),
                                     vmap_axes=vmap_axes, backend=backend)
    x2 = None if entry["x2"] is None else inputs[entry["x2"]]
    kernel = ntk_fn(inputs["x1"], x2, params)
    expected = ARRAYS[entry["key"]]
    assert list(kernel.shape) == entry["shape"]
    assert kernel.dtype == torch.float64
    torch.testing.assert_close(kernel, expected, rtol=1e-12, atol=1e-12 * expected.abs().max())


@pytest.mark.parametrize("entry", [e for e in ACCEPTED if e["x2"] is None],
                         ids=[e["key"] for e in ACCEPTED if e["x2"] is None])
def test_graph_backend_computes_kernels_of_one_input_set(entry: dict[str, Any]) -> None:
    params, inputs = arrays(entry["model"])
    ntk_fn = tg.ntk.empirical_ntk_fn(model(entry["model"]), trace_axes=tuple(entry["trace_axes"]),
                                     diagonal_axes=tuple(entry["diagonal_axes"]), backend="graph")
    torch.testing.assert_close(ntk_fn(inputs["x1"], None, params), ARRAYS[entry["key"]],
                               rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("entry", REJECTED, ids=[e["key"] for e in REJECTED])
def test_every_rejected_combination_raises_with_the_reason(entry: dict[str, Any]) -> None:
    params, inputs = arrays(entry["model"])
    x2 = None if entry["x2"] is None else inputs[entry["x2"]]
    trace, diagonal = tuple(entry["trace_axes"]), tuple(entry["diagonal_axes"])
    reason = entry["reference"]
    assert reason.startswith("rejected")
    if "both traced and diagonal" in reason:
        with pytest.raises(ValueError, match="trace_axes and diagonal_axes to name different"):
            tg.ntk.empirical_ntk_fn(model(entry["model"]), trace_axes=trace,
                                    diagonal_axes=diagonal)
        return
    ntk_fn = tg.ntk.empirical_ntk_fn(model(entry["model"]), trace_axes=trace,
                                     diagonal_axes=diagonal)
    with pytest.raises(ValueError, match=r"diagonal axis 0 to have the same size in f\(x1\) "
                                         r"and f\(x2\), but got sizes 3 and 2"):
        ntk_fn(inputs["x1"], x2, params)


def test_the_fixture_holds_every_combination() -> None:
    """2 models × 2 traces × 4 diagonals × 3 input pairs; 15 accepted per model."""
    assert len(META["kernels"]) == 48
    assert sum(e["model"] == "mlp" for e in ACCEPTED) == 15
    assert not META["checks_failed"]


def test_trace_is_the_mean_over_the_pair() -> None:
    """SEMANTICS.md's worked example: entry [0, 1] of the MLP's traced kernel."""
    params, inputs = arrays("mlp")
    traced = tg.ntk.empirical_ntk_fn(model("mlp"))(inputs["x1"], None, params)
    full = tg.ntk.empirical_ntk_fn(model("mlp"), trace_axes=())(inputs["x1"], None, params)
    assert traced[0, 1].item() == pytest.approx(1.81795265, abs=1e-8)
    assert full[0, 1].diagonal().sum().item() == pytest.approx(7.27181062, abs=1e-8)
    torch.testing.assert_close(traced, full.diagonal(dim1=2, dim2=3).mean(-1))
