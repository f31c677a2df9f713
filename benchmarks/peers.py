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

The second section, the aggregated update ``Jᵀ w`` of issue 5 (:func:`aggregated_methods`,
NOTE [aggregated_grad, issue 5]), has kinds ``aggregated`` (whose ``call()`` returns the update
as one vector) and ``weighting`` (the weighting alone, which returns nothing).
"""

from __future__ import annotations

import copy
import importlib.util
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

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


def flat_result(result: Any, case: Case, *, vector: bool = False) -> Tensor:
    """The result as ``[m, m]`` (``[m]`` for a diagonal case; as is when ``vector``), detached."""
    if isinstance(result, Update):
        result = result.flat()
    result = torch.as_tensor(result).detach()
    if vector:
        return result.reshape(-1)
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
    """``tg.autograd.gramian(rows, params, batch_dim=...)`` on an eager forward: the walk."""
    gramian = getattr(tg.autograd, "gramian", None)
    if gramian is None:
        raise Unavailable(_imperative_skip(case))
    model, params = case.module, list(case.module.parameters())
    options = {"diagonal": case.diagonal, "batch_dim": case.batch_dim}
    return lambda: gramian(case.rows(model, *case.inputs), params, **options)


def _torchgram_recorded(case: Case) -> Call:
    """The forward inside ``tg.autograd.record()``, then ``tg.autograd.gramian`` (issue 15)."""
    model, params = case.module, list(case.module.parameters())
    options = {"diagonal": case.diagonal, "batch_dim": case.batch_dim}

    def call() -> Tensor:
        with tg.autograd.record():
            rows = case.rows(model, *case.inputs)
        return tg.autograd.gramian(rows, params, **options)

    return call


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


# ------------------------------------------------------------------------------ aggregated Jᵀw

# NOTE [aggregated_grad, issue 5]
# A second section of the benchmark times the whole Jacobian-descent step ``Jᵀ w`` with
# ``w = upgrad(G)`` on the per-sample-loss cases (and the multi-task one), every way a user
# would write it: `tg.aggregated_grad` (backend auto), `tg.gramian` (backend auto) then a
# separate `torch.func.vjp` with the weights, and torchjd's `Engine.compute_gramian(losses)`
# then `losses.backward(w)`. All three call the SAME weighting, `torchgram.weighting.upgrad`
# (on torchjd's Gramian too), so they differ only in how they get G and Jᵀw. The QP of the
# weighting costs more than everything else on some cases (m = 64) and would drown that
# difference, so each call's seconds inside the weighting are counted (`_TimedWeighting`,
# read by measure.py after every timed call) and the table also gives each method's time
# without them. The weighting is also timed alone on the case's Gramian ("weighting only"
# rows; torchjd's own `UPGradWeighting` too, for reference: no method here calls it). An
# aggregated call returns the update flattened to one vector (leaves in `case.params` order;
# torchjd's from `.grad`), which the report compares like the Gramians; a weighting-only call
# returns nothing. The floor of this section is the Gramian section's plain backward.

AGGREGATED = "aggregated"
WEIGHTING = "weighting"
# Eager code (issue 15): the imperative API on a plain forward, walked or recorded.
EAGER_WALK = "torchgram autograd.gramian"
EAGER_RECORDED = "torchgram autograd.gramian + record"
EAGER_STEP_RECORDED = "torchgram autograd.backward + record"
EAGER_STEP_WALK = "torchgram autograd.backward"
# The cases of the aggregated section: per-sample losses, and task losses.
AGGREGATED_CASES = ("mlp", "cnn", "transformer", "multitask", "tied-lm")


class _TimedWeighting:
    """``torchgram.weighting.upgrad``, keeping count of the seconds spent in it.

    :func:`benchmarks.measure.measure` reads and resets the count after each timed call
    (``call.weighting_lap``), so the table can give each call's time without its weighting.
    The benchmark runs on CPU, where the weighting's tensors are ready when it returns.
    """

    def __init__(self) -> None:
        self.weighting: Callable[[Tensor], Tensor] = tg.weighting.upgrad
        self.seconds = 0.0

    def __call__(self, G: Tensor) -> Tensor:
        start = time.perf_counter()
        weights = self.weighting(G)
        self.seconds += time.perf_counter() - start
        return weights

    def lap(self) -> float:
        """The seconds spent in the weighting since the last lap."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def _with_lap(call: Call, weighting: _TimedWeighting) -> Call:
    call.weighting_lap = weighting.lap  # type: ignore[attr-defined]
    return call


class Update(NamedTuple):
    """A step's update per parameter name, made one vector only when it is compared.

    A step's timed call returns this; :func:`flat_result` (outside the timed region) joins it
    into one vector, so that the step is not charged with a copy of every gradient that the
    plain backward it is measured against does not make.
    """

    grads: dict[str, Tensor | None]
    case: Case

    def flat(self) -> Tensor:
        """The update as one vector, leaves in ``case.params`` order (zeros for a missing grad)."""
        return torch.cat([(torch.zeros_like(p) if self.grads[name] is None
                           else self.grads[name]).reshape(-1)
                          for name, p in self.case.params.items()])


def _flat_update(grads: dict[str, Tensor | None], case: Case) -> Update:
    """The update, joined into one vector when compared (:class:`Update`)."""
    return Update(grads, case)


def _aggregated_skip(case: Case) -> str | None:
    if case.diagonal:
        return "a weighting needs the whole Gramian, not its diagonal"
    return None


def _aggregated_torchjd_skip(case: Case) -> str | None:
    return _aggregated_skip(case) or _missing("torchjd")


def _case_gramian(case: Case) -> Tensor:
    m = case.num_rows
    return tg.gramian(case.f, batch_dim=case.batch_dim)(case.params, *case.inputs).reshape(m, m)


def _weighting_torchgram(case: Case) -> Call:
    """``torchgram.weighting.upgrad(G)`` alone, on the case's Gramian (computed once)."""
    G, upgrad = _case_gramian(case), tg.weighting.upgrad

    def call() -> None:
        upgrad(G)

    return call


def _weighting_torchjd(case: Case) -> Call:
    """torchjd's ``UPGradWeighting()(G)`` alone, on the case's Gramian (computed once)."""
    from torchjd.aggregation import UPGradWeighting

    G, weighting = _case_gramian(case), UPGradWeighting()

    def call() -> None:
        weighting(G)

    return call


def _aggregated_grad(case: Case) -> Call:
    """``tg.aggregated_grad(f, upgrad, batch_dim=...)`` with backend auto: one call."""
    upgrad = _TimedWeighting()
    step = tg.aggregated_grad(case.f, upgrad, batch_dim=case.batch_dim)

    def call() -> Update:
        update, _ = step(case.params, *case.inputs)
        return _flat_update(update, case)

    return _with_lap(call, upgrad)


def _gramian_then_vjp(case: Case) -> Call:
    """``tg.gramian`` (backend auto), ``w = upgrad(G)``, then a separate ``torch.func.vjp``."""
    transform = tg.gramian(case.f, batch_dim=case.batch_dim)
    upgrad, m = _TimedWeighting(), case.num_rows

    def losses(params: dict[str, Tensor]) -> Tensor:
        return case.f(params, *case.inputs)

    def call() -> Update:
        w = upgrad(transform(case.params, *case.inputs).reshape(m, m))
        out, vjp_fn = torch.func.vjp(losses, case.params)
        (update,) = vjp_fn(w.reshape(out.shape))
        return _flat_update(update, case)

    return _with_lap(call, upgrad)


def _torchjd_backward(case: Case) -> Call:
    """torchjd: ``G = engine.compute_gramian(losses)``, ``w = upgrad(G)``, ``losses.backward(w)``.

    The weighting is torchgram's ``upgrad`` (not torchjd's ``UPGradWeighting``), as in the
    other two methods, so that the comparison is of the Gramian and update machinery only.
    """
    from torchjd.autogram import Engine

    model = copy.deepcopy(case.module)  # the engine hooks the model
    engine, upgrad = Engine(model, batch_dim=case.batch_dim), _TimedWeighting()
    named = dict(model.named_parameters())

    def call() -> Update:
        _zero_grads(named.values())
        losses = case.rows(model, *case.inputs)
        losses.backward(upgrad(engine.compute_gramian(losses)))
        return _flat_update({name: p.grad for name, p in named.items()}, case)

    return _with_lap(call, upgrad)


def _eager_backward(recorded: bool) -> Callable[[Case], Call]:
    """``tg.autograd.backward(rows, params, upgrad, batch_dim=...)`` on an eager forward
    (inside ``tg.autograd.record()`` when ``recorded``); the update read from ``.grad``."""

    def prepare(case: Case) -> Call:
        model, upgrad = case.module, _TimedWeighting()
        named = dict(model.named_parameters())
        params = list(named.values())

        def call() -> Update:
            _zero_grads(params)
            if recorded:
                with tg.autograd.record():
                    rows = case.rows(model, *case.inputs)
            else:
                rows = case.rows(model, *case.inputs)
            tg.autograd.backward(rows, params, upgrad, batch_dim=case.batch_dim)
            return _flat_update({name: p.grad for name, p in named.items()}, case)

        return _with_lap(call, upgrad)

    return prepare


_AGGREGATED = (
    Method("weighting only: torchgram upgrad", WEIGHTING, _weighting_torchgram, _aggregated_skip),
    Method("weighting only: torchjd UPGradWeighting", WEIGHTING, _weighting_torchjd,
           _aggregated_torchjd_skip),
    Method("torchgram aggregated_grad", AGGREGATED, _aggregated_grad, _aggregated_skip),
    Method("torchgram gramian + vjp", AGGREGATED, _gramian_then_vjp, _aggregated_skip),
    Method("torchjd Engine + backward(w)", AGGREGATED, _torchjd_backward,
           _aggregated_torchjd_skip),
    Method(EAGER_STEP_RECORDED, AGGREGATED, _eager_backward(True), _aggregated_skip),
    Method(EAGER_STEP_WALK, AGGREGATED, _eager_backward(False), _aggregated_skip),
)
# The weighting-only row of the weighting that the aggregated methods call.
WEIGHTING_ROW = _AGGREGATED[0].name

_FIXED = (
    Method("torchjd autogram", "peer", _torchjd, lambda case: _missing("torchjd")),
    Method("torch.func vmap(grad)", "peer", _vmap_per_sample, _per_sample_skip),
    Method("torch.func jacrev (naive)", "peer", _naive_jacrev),
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
    methods.append(Method(EAGER_WALK, "torchgram", _torchgram_imperative, _imperative_skip))
    methods.append(Method(EAGER_RECORDED, "torchgram", _torchgram_recorded, _imperative_skip))
    return methods + list(_FIXED)


def aggregated_methods() -> list[Method]:
    """The methods of the aggregated ``Jᵀw`` section, in table order (floor: :data:`FLOOR`)."""
    return list(_AGGREGATED)


def get(name: str) -> Method:
    """The method called ``name`` (of either section)."""
    known = all_methods() + aggregated_methods()
    for method in known:
        if method.name == name:
            return method
    raise ValueError(f"benchmarks: expected a method in {[m.name for m in known]}, "
                     f"but got {name!r}.")
