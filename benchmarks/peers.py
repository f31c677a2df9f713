"""Every way of getting the Gramian (or its diagonal) that the benchmark compares.

A :class:`Method` has a ``prepare(case) -> call`` function: ``prepare`` does the one-off setup
a user would do once (build the transform, wrap or hook the model) and ``call()`` computes
the result from the inputs, forward pass included. ``call()`` returns the Gramian in any
shape that flattens to ``[m, m]`` (``[m]`` for a ``diagonal`` case), or ``None`` for the
floor. ``skip_reason(case)`` says, cheaply and before any measurement, why a method does
not apply to a case or why its package is missing (``prepare`` may still raise
:class:`Unavailable`); the table then shows it as skipped, with the reason.

Kinds: ``floor`` (plain ``rows.sum().backward()``, what a training step costs anyway),
``torchgram`` (one per registered backend, found at run time) and ``peer`` (other
libraries; the "best peer" of a case is the fastest peer whose answer agrees).
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import torchgram as tg
from benchmarks.cases import Case

Call = Callable[[], Any]


class Unavailable(Exception):
    """The method does not apply to this case, or its package is not installed."""


@dataclass(frozen=True)
class Method:
    """One way of computing the result; see the module docstring."""

    name: str
    kind: str
    prepare: Callable[[Case], Call]
    skip_reason: Callable[[Case], str | None] = lambda case: None
    """Cheap check, run before any measurement: why the method does not apply, or ``None``."""


# Backends the issue plans; a missing one is reported as "not available yet" by run.py.
EXPECTED_BACKENDS = ("auto", "jacobian", "ntvp", "structured", "graph")


def flat_result(result: Any, case: Case) -> Tensor:
    """The result as ``[m, m]`` (or ``[m]`` for a diagonal case), detached."""
    result = torch.as_tensor(result).detach()
    m = result.numel() if case.diagonal else int(round(result.numel() ** 0.5))
    return result.reshape(m) if case.diagonal else result.reshape(m, m)


def _gram_of_blocks(blocks: Iterable[Tensor], m: int, diagonal: bool) -> Tensor:
    """``Σ_l J_l J_lᵀ`` (or its diagonal) for Jacobian blocks whose leading dims hold ``m`` rows."""
    total: Tensor | None = None
    for block in blocks:
        J = block.reshape(m, -1)
        part = (J * J).sum(dim=1) if diagonal else J @ J.T
        total = part if total is None else total + part
    assert total is not None
    return total


def _zero_grads(params: Iterable[Tensor]) -> None:
    for p in params:
        p.grad = None


def _missing(package: str) -> str | None:
    if importlib.util.find_spec(package) is None:
        return f"package {package!r} is not installed"
    return None


# ------------------------------------------------------------------------------ the floor

def _backward(case: Case) -> Call:
    model, params = case.module, list(case.module.parameters())

    def call() -> None:
        _zero_grads(params)
        case.rows(model, *case.inputs).sum().backward()

    return call


# ------------------------------------------------------------------------------ torchgram

def _torchgram(backend: str) -> Callable[[Case], Call]:
    def prepare(case: Case) -> Call:
        transform = tg.gramian(case.f, backend=backend, batch_dim=case.batch_dim,
                               diagonal=case.diagonal)
        return lambda: transform(case.params, *case.inputs)

    return prepare


def _torchgram_imperative(case: Case) -> Call:
    """``tg.autograd.gramian(outputs, inputs)`` on an eager forward (the graph backend's API)."""
    gramian = getattr(tg.autograd, "gramian", None)
    if gramian is None:
        raise Unavailable(_imperative_skip(case))
    model, params = case.module, list(case.module.parameters())
    options = {"diagonal": True} if case.diagonal else {}
    return lambda: gramian(case.rows(model, *case.inputs), params, **options)


def _imperative_skip(case: Case) -> str | None:
    del case
    if not hasattr(tg.autograd, "gramian"):
        return "torchgram.autograd.gramian does not exist yet (graph backend)"
    return None


# ------------------------------------------------------------------------------ torch.func

def _per_sample_skip(case: Case) -> str | None:
    return None if case.batch_dim is not None else "no per-sample structure (rows are dense)"


def _vmap_per_sample(case: Case) -> Call:
    """Per-sample gradients ``vmap(grad)`` (``vmap(jacrev)`` for several rows per sample)."""
    from torch.func import grad, jacrev, vmap

    m, batch = case.num_rows, case.inputs[0].shape[0]
    per_sample_rows = m // batch

    def one(params: dict[str, Tensor], *sample: Tensor) -> Tensor:
        out = case.f(params, *(s.unsqueeze(0) for s in sample))
        return out.reshape(()) if per_sample_rows == 1 else out.reshape(-1)

    derivative = grad(one) if per_sample_rows == 1 else jacrev(one)
    per_sample = vmap(derivative, in_dims=(None, *(0,) * len(case.inputs)))

    def call() -> Tensor:
        jac = per_sample(case.params, *case.inputs)  # name -> [B, (K,) *shape]
        return _gram_of_blocks(jac.values(), m, case.diagonal)

    return call


def _naive_jacrev(case: Case) -> Call:
    """The full Jacobian of all ``m`` rows with ``jacrev`` (no batch structure), then Gram."""
    from torch.func import jacrev

    m, jacobian = case.num_rows, jacrev(case.f)

    def call() -> Tensor:
        jac = jacobian(case.params, *case.inputs)  # name -> [*rows_shape, *shape]
        return _gram_of_blocks(jac.values(), m, case.diagonal)

    return call


# ------------------------------------------------------------------------------ peers

def _torchjd(case: Case) -> Call:
    """``torchjd.autogram.Engine(model, batch_dim=...).compute_gramian(rows)``.

    torchjd has no diagonal mode: for a diagonal case it computes the Gramian and takes its
    diagonal.
    """
    from torchjd.autogram import Engine

    model = copy.deepcopy(case.module)  # the engine hooks the model
    engine = Engine(model, batch_dim=case.batch_dim)

    def call() -> Tensor:
        G = engine.compute_gramian(case.rows(model, *case.inputs))
        return G.diagonal() if case.diagonal else G

    return call


def _norms_skip(package: str) -> Callable[[Case], str | None]:
    def skip_reason(case: Case) -> str | None:
        if not case.diagonal:
            return f"{package} computes per-sample gradient norms only (diagonal cases)"
        if not case.classifier:
            return f"{package} needs a model(x) + cross-entropy(y) case"
        return _missing(package)

    return skip_reason


def _backpack(case: Case) -> Call:
    """BackPACK ``BatchL2Grad``: per-sample squared gradient norms of a sum-reduced loss."""
    x, y = case.inputs
    from backpack import backpack, extend
    from backpack.extensions import BatchL2Grad

    model = extend(copy.deepcopy(case.module))
    loss_fn = extend(torch.nn.CrossEntropyLoss(reduction="sum"))
    params = list(model.parameters())

    def call() -> Tensor:
        _zero_grads(params)
        loss = loss_fn(model(x), y)
        with backpack(BatchL2Grad()):
            loss.backward()
        return torch.stack([p.batch_l2 for p in params]).sum(dim=0)

    return call


def _opacus(case: Case) -> Call:
    """opacus ghost clipping's norm pass: ``GradSampleModuleFastGradientClipping`` + backward.

    This is the first of ghost clipping's two backward passes (the one that yields the
    per-sample norms); opacus uses ghost norms for ``Linear``/``Embedding`` and per-sample
    gradients for other layers (e.g. conv).
    """
    x, y = case.inputs
    from opacus.grad_sample import GradSampleModuleFastGradientClipping

    model = GradSampleModuleFastGradientClipping(
        copy.deepcopy(case.module), batch_first=True, loss_reduction="sum",
        use_ghost_clipping=True)
    params = list(model.parameters())

    def call() -> Tensor:
        _zero_grads(params)
        F.cross_entropy(model(x), y, reduction="sum").backward()
        return model.get_norm_sample() ** 2

    return call


# ---------------------------------------------------------------------------------------
# NOTE [aggregated_grad, issue 5 — placeholder, not implemented here]
# Issue 5 adds `tg.aggregated_grad(losses_fn, weighting, batch_dim=0)(params, x, y)`, returning
# `(update, info)` with `update == Jᵀ w` and `w = weighting(G)`. It must be measured on these
# same cases against (a) `tg.gramian` followed by a separate `torch.func.vjp` with the same
# weights, and (b) torchjd: `Engine(model, batch_dim=0)`, `G = engine.compute_gramian(losses)`,
# `w = <torchjd weighting>(G)`, `losses.backward(w)`. To add it: write three `prepare`
# functions here whose `call()` returns the flattened update (concatenate the leaves in
# `case.params` order; torchjd's from `p.grad`), register them in a second list like
# `_FIXED` with kind "aggregated", and make report.py compare them as vectors (the Gramian
# agreement check already compares any tensor result; only `flat_result` must not reshape a
# vector to a square). Until then nothing here measures it.
# ---------------------------------------------------------------------------------------

_FIXED = (
    Method("torchjd autogram", "peer", _torchjd, lambda case: _missing("torchjd")),
    Method("torch.func vmap(grad)", "peer", _vmap_per_sample, _per_sample_skip),
    Method("torch.func jacrev (naive)", "peer", _naive_jacrev),
    Method("backpack BatchL2Grad", "peer", _backpack, _norms_skip("backpack")),
    Method("opacus ghost norms", "peer", _opacus, _norms_skip("opacus")),
)
FLOOR = "backward (floor)"


def available_backends() -> tuple[str, ...]:
    """The torchgram backends registered in this build."""
    from torchgram.backends import backend_names

    return tuple(backend_names())


def all_methods() -> list[Method]:
    """Every method, in table order: the floor, torchgram's backends, then the peers."""
    methods = [Method(FLOOR, "floor", _backward)]
    methods += [Method(f"torchgram[{name}]", "torchgram", _torchgram(name))
                for name in available_backends()]
    methods.append(Method("torchgram autograd.gramian", "torchgram", _torchgram_imperative,
                          _imperative_skip))
    return methods + list(_FIXED)


def get(name: str) -> Method:
    """The method called ``name``."""
    for method in all_methods():
        if method.name == name:
            return method
    raise ValueError(f"benchmarks: expected a method in {[m.name for m in all_methods()]}, "
                     f"but got {name!r}.")
