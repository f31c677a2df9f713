"""The fuzzing property: the oracle's matrix, or a torchgram error; and nothing left behind.

:func:`check` runs one backend on one :class:`~fuzz_arch.FuzzCase` and asserts that

* it returns the dense float64 oracle's matrix (``reference.dense_gramian``), in the
  documented shape, structure (``per_leaf``, ``has_aux``) and dtype, or raises an exception
  whose message starts with ``torchgram.`` (a declared inability or a refused call);
* with ``backend="auto"``, it answers whenever ``jacobian`` or ``graph`` does;
* afterwards no mode or transform is active, grad mode and the attention-kernel switches are
  as they were, and no argument, flag or module was changed (:class:`Snapshot`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch import Tensor, nn

import torchgram as tg
from fuzz_arch import (
    Built,
    FuzzCase,
    Route,
    build,
    draws,
    host_draw_state,
    rescaled,
    seed_draws,
)
from reference import Dense, PreluByDefinition, dense_gramian, weighted_backward

REPEAT_SCALE = 1.5
"""``case.repeat == "values"``: the second call's parameters, relative to the first's."""

TOLERANCE = {torch.float64: 1e-8, torch.float32: 5e-4}
"""Largest entry error allowed, relative to the largest entry of the oracle's matrix."""

OWN_ROUND_OFF = 100.0
"""How many times the float32 oracle's own error a float32 result may be off by."""


# -- global state ----------------------------------------------------------------------------


def global_state() -> dict[str, Any]:
    """The process state a call must leave as it found it (modes, transforms, switches)."""
    return {
        "torch function modes": torch._C._len_torch_function_stack(),
        "functorch transforms": torch._C._functorch.peek_interpreter_stack() is not None,
        "forward AD level": torch.autograd.forward_ad._current_level,
        "grad mode": torch.is_grad_enabled(),
        "sdpa kernels": (torch.backends.cuda.flash_sdp_enabled(),
                         torch.backends.cuda.mem_efficient_sdp_enabled(),
                         torch.backends.cuda.math_sdp_enabled(),
                         torch.backends.cuda.cudnn_sdp_enabled()),
    }


CLEAN_STATE = {"torch function modes": 0, "functorch transforms": False, "forward AD level": -1}


@dataclass
class Snapshot:
    """Every tensor a call could change (values, versions, flags) and the global state."""

    tensors: list[tuple[Tensor, Tensor, bool, int]]
    module: dict[str, tuple[Tensor, Tensor, bool]] | None
    training: list[bool] | None
    state: dict[str, Any]

    @classmethod
    def take(cls, args: Any, kwargs: Any, module: nn.Module | None) -> Snapshot:
        tensors = [(t, t.detach().clone(), t.requires_grad, t._version)
                   for t in optree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        state = None
        training = None
        if module is not None:
            state = {name: (t, t.detach().clone(), t.requires_grad)
                     for name, t in module.state_dict(keep_vars=True).items()}
            training = [m.training for m in module.modules()]
        return cls(tensors, state, training, global_state())

    def assert_unchanged(self, module: nn.Module | None) -> None:
        for tensor, value, requires_grad, version in self.tensors:
            assert tensor.requires_grad == requires_grad, "an argument's requires_grad changed"
            assert tensor._version == version, "an argument was changed in place"
            assert torch.equal(tensor.detach(), value), "an argument's value changed"
        if module is not None:
            assert self.module is not None
            current = module.state_dict(keep_vars=True)
            assert current.keys() == self.module.keys(), "the module's tensors changed"
            for name, (tensor, value, requires_grad) in self.module.items():
                assert current[name] is tensor, f"module tensor {name} was replaced"
                assert tensor.requires_grad == requires_grad, f"{name}: requires_grad changed"
                assert torch.equal(tensor.detach(), value), f"{name}: value changed"
            assert [m.training for m in module.modules()] == self.training
            for name, parameter in module.named_parameters():
                assert not torch._C._functorch.is_functorch_wrapped_tensor(parameter), name
        state = global_state()
        assert state == self.state, f"global state changed: {self.state} -> {state}"
        for name, clean in CLEAN_STATE.items():
            assert state[name] == clean, f"{name} left active: {state[name]}"


# -- the property ----------------------------------------------------------------------------


def oracle(case: FuzzCase, *, repeated: bool = False, in_case_dtype: bool = False,
           eager: bool = False) -> Dense | None:
    """The dense float64 oracle of the case, or ``None`` if it has no leaf to differentiate.

    ``repeated``: of the case's second call (``case.repeat``); ``in_case_dtype``: the same
    dense computation in the case's own dtype (how far off its round-off alone puts it).

    An ``f`` that differentiates itself (``head_extra="input_gradient"``) runs prelu as its
    definition (``PreluByDefinition``), as torchgram's functional evaluations do (NOTE [prelu
    as where]): torch's double backward of prelu at 0 is not the derivative of its backward
    (the :class:`Kink` layer puts every other feature there), and the input gradient's rows
    differentiate that backward (a long fuzz run's case: ``G`` 1.16 off, by the slope squared,
    against torch's). ``eager``: for ``tg.autograd`` on the graph of the case's own call, whose
    nodes are torch's prelu (its walk takes their derivatives, as torch's autograd does).
    """
    seed_draws(case.seed)  # random ops: the oracle and the call see the same draw
    if not in_case_dtype:
        PLAIN_HOST_END.clear()  # (set again below, once the plain call ran)
    # ... in the case's own dtype: a float32 and a float64 run of the same layers may lay the
    # same random numbers out differently (hunt 7: a float64 oracle of a float32 case with
    # dropout after a grouped conv was another draw; the backends matched the float32 call)
    random = draws(case)
    built = build(case, None if random or in_case_dtype else torch.float64)
    if repeated and case.repeat == "values":
        built = rescaled(built, REPEAT_SCALE)
    if repeated and case.repeat in ("skip_last", "open_gates"):
        built.switch[case.repeat] = True
    g, args = built.oracle()
    argnums = built.argnums
    nums = (argnums,) if isinstance(argnums, int) else argnums
    if not any(isinstance(leaf, Tensor) and leaf.is_floating_point()
               for n in nums for leaf in optree.tree_leaves(args[n])):
        return None
    by_definition = case.head_extra == "input_gradient" and not eager
    with PreluByDefinition() if by_definition else contextlib.nullcontext():
        dense = dense_gramian(g, args, argnums)
    if not in_case_dtype:
        PLAIN_HOST_END[:] = [host_draw_state()]  # one plain call's (NOTE [generators f holds])
    return dense


PLAIN_HOST_END: list[Any] = []
"""Where the last oracle's plain call left the host generators (numpy's, the held one)."""


def plain_update(case: FuzzCase, weights: Tensor) -> Tensor:
    """``Jᵀ w`` by one plain backward in the case's own dtype (``weighted_backward``).

    Where ``J`` is zero analytically because per-sample terms cancel (batch-norm in training
    mode over samples that look up the same embedding row: each row of ``f`` moves them by
    opposite amounts), the row-by-row float32 oracle can come out exactly zero while one
    backward of the weighted rows, torch's own or a backend's, leaves the round-off of the
    cancellation, amplified by ``1 / sqrt(eps)`` (long fuzz run, seed 5001: 8.7e-6 on terms
    of about 1). Prelu as the oracle runs it (:func:`oracle`).
    """
    seed_draws(case.seed)  # random ops: the oracle and the call see the same draw
    built = build(case)
    g, args = built.oracle()
    with PreluByDefinition() if case.head_extra == "input_gradient" else \
            contextlib.nullcontext():
        return weighted_backward(g, args, built.argnums, weights)


class RefusedInPlace:
    """The oracle's answer where torch's autograd refuses ``f``: a tensor it saved for the
    backward was changed in place afterwards (``Activation.inplace``). Every backend must
    then raise torchgram's ``ValueError`` (NOTE [in-place modifications]), unless it declines
    first for another reason (``BackendCannotRun``: ntvp before a random op)."""


REFUSED_IN_PLACE = RefusedInPlace()


def oracle_or_refusal(case: FuzzCase, *, repeated: bool = False) -> Dense | RefusedInPlace | None:
    """:func:`oracle`, or :data:`REFUSED_IN_PLACE` where torch refuses the case's in-place op."""
    try:
        return oracle(case, repeated=repeated)
    except RuntimeError as error:
        if "modified by an inplace operation" not in str(error):
            raise
        return REFUSED_IN_PLACE


def run(built: Built, backend: str, *, no_grad: bool = False) -> Any:
    """``tg.gramian(f, backend=backend, **options)(*args, **kwargs)`` (under ``no_grad``)."""
    with torch.set_grad_enabled(not no_grad):
        return tg.gramian(built.f, backend=backend, **built.options)(*built.args,
                                                                     **built.kwargs)


def assert_close(actual: Tensor, expected: Tensor, dtype: torch.dtype, what: str, *,
                 precision: torch.dtype | None = None) -> None:
    """Agreement relative to the largest entry of ``expected`` (the oracle, float64).

    ``precision``: the dtype the computation ran in (default ``dtype``) sets the tolerance.
    """
    precision = precision or dtype
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == dtype, f"{what}: dtype {actual.dtype}, expected {dtype}"
    scale = max(expected.abs().max().item() if expected.numel() else 0.0, 1e-2)
    error = (actual.double() - expected).abs().max().item() / scale if actual.numel() else 0.0
    tolerance = TOLERANCE[precision]
    assert math.isfinite(error) and error <= tolerance, \
        f"{what}: relative error {error:.3g} > {tolerance:g}"


def check(case: FuzzCase, backend: str) -> str:
    """Run the property on ``case`` with ``backend``; say whether it answered or refused.

    With ``case.repeat``, the same function object is called a second time, with other
    parameter values or with a switch changed that the call signature cannot see (what the
    probe and trace caches must notice, NOTE [call signatures]).
    """
    built = build(case)
    outcome = _call(case, built, backend, oracle_or_refusal(case))
    if case.repeat == "none":
        return outcome
    if case.repeat == "values":
        built = rescaled(built, REPEAT_SCALE)
    else:
        built.switch[case.repeat] = True
    second = _call(case, built, backend, oracle_or_refusal(case, repeated=True))
    return outcome if outcome == second else f"{outcome}, then {second}"


def _call(case: FuzzCase, built: Built, backend: str,
          expected: Dense | RefusedInPlace | None) -> str:
    seed_draws(case.seed)  # random ops: the oracle and the call see the same draw
    snapshot = Snapshot.take(built.args, built.kwargs, built.module)
    # where one plain call leaves the host generators: the oracle's, computed just before
    expected_end = PLAIN_HOST_END.pop() if PLAIN_HOST_END else None
    try:
        result = run(built, backend, no_grad=case.grad_mode == "no_grad")
    except Exception as error:  # noqa: BLE001 -- the property is about which errors escape
        snapshot.assert_unchanged(built.module)
        if not str(error).startswith("torchgram."):
            raise AssertionError(f"{backend}: a raw error escaped: {type(error).__name__}: "
                                 f"{error}") from error
        if expected is REFUSED_IN_PLACE:  # or declined first for another reason
            assert isinstance(error, tg.BackendCannotRun) or (
                isinstance(error, ValueError) and "out of place" in str(error)), \
                f"{backend}: torch refuses the in-place op, but got: {error}"
            return "refused (in place, as torch's autograd)"
        assert expected is not None or "floating-point tensor leaves" in str(error), error
        if backend == "auto" and expected is not None:
            _assert_nobody_answers(built, str(error))
        return f"refused ({type(error).__name__}: {str(error)[:60]}...)"
    snapshot.assert_unchanged(built.module)
    assert expected is not None, "answered a call without any leaf to differentiate"
    assert isinstance(expected, Dense), \
        f"{backend}: answered where torch's autograd refuses the in-place op"
    assert expected_end is None or host_draw_state() == expected_end, \
        f"{backend}: numpy's or the held generator ends elsewhere than one plain call leaves it"
    _compare(case, built, result, expected)
    return "answered"


def _assert_nobody_answers(built: Built, auto_error: str) -> None:
    for other in ("jacobian", "graph"):
        try:
            run(built, other)
        except Exception:  # noqa: BLE001, S112 -- refusing is what auto claimed
            continue
        raise AssertionError(f"auto refused ({auto_error}) but backend {other!r} answers")


def _compare(case: FuzzCase, built: Built, result: Any, expected: Dense) -> None:
    dtype = _output_dtype(case)
    if case.has_aux:
        assert isinstance(result, tuple) and len(result) == 2, "has_aux: expected (G, aux)"
        result, aux = result
        assert aux["tag"] == "aux"
        assert isinstance(aux["hidden"], Tensor) and not aux["hidden"].requires_grad
    if not case.per_leaf:
        assert isinstance(result, Tensor), f"expected a tensor, got {type(result).__name__}"
        assert_close(result, expected.shaped(diagonal=case.diagonal), dtype, "G",
                     precision=getattr(torch, case.dtype))
        return
    if case.params_at == "split":
        assert isinstance(result, tuple) and len(result) == 2, "per_leaf with argnums tuple"
    blocks = [b for b in optree.tree_leaves(result) if b is not None]
    assert len(blocks) == len(expected.blocks), \
        f"per_leaf: {len(blocks)} blocks, expected {len(expected.blocks)}"
    own_blocks = None
    for i, (block, want) in enumerate(zip(blocks, expected.blocks, strict=True)):
        want = expected.shaped(want, diagonal=case.diagonal)
        try:
            assert_close(block, want, dtype, f"block {i}", precision=getattr(torch, case.dtype))
        except AssertionError:
            if case.dtype != "float32":
                raise
            # A block of a float32 case off the float64 oracle by its own round-off: allowed
            # up to OWN_ROUND_OFF times the float32 dense oracle's error on that block (a long
            # fuzz run after session 55: per-leaf blocks 0.01 and 6e9 after three
            # determinants of 1x1 matrices, the small one 0.026 off in float32 on every
            # backend and in torch.func.jacrev alike; as fuzz_aggregate's update check).
            own_blocks = own_blocks or oracle(case, in_case_dtype=True)
            assert own_blocks is not None
            own = expected.shaped(own_blocks.blocks[i], diagonal=case.diagonal).double()
            floor = OWN_ROUND_OFF * (own - want).abs().max().item()
            error = (block.double() - want).abs().max().item()
            assert error <= floor, f"block {i}: {error:.3g} off, float32 oracle {floor:.3g}"


def _output_dtype(case: FuzzCase) -> torch.dtype:
    return torch.float64 if case.mixed_dtypes else getattr(torch, case.dtype)


# -- eager code: tg.autograd.gramian on the graph of a plain call (issue 15) ------------------


def check_eager(case: FuzzCase, recorded: bool) -> str:
    """The property for the imperative API: the case's function called eagerly (inside
    ``tg.autograd.record()`` when ``recorded``) on fresh leaves that require grad, then
    ``tg.autograd.gramian`` of its outputs with the case's ``batch_dim`` and without one.

    The oracle's matrix or a torchgram error; no ``.grad`` written, nothing left behind.
    Cases that alias one tensor under two leaves (two leaves to ``tg.gramian``, one tensor to
    autograd) or run under ``no_grad`` (no graph) do not apply.
    """
    if case.alias_tied or case.grad_mode == "no_grad":
        return "not applicable"
    outcomes = [_check_eager_once(case, recorded)]
    if case.repeat == "open_gates":  # the same signature with the gates opened (NOTE [opened
        # selections]): the first call's probes must not decide for this one
        outcomes.append(_check_eager_once(case, recorded, open_gates=True))
    if any(isinstance(layer, Route) for layer in case.layers):
        # the same graph signature routing otherwise (NOTE [routing values]): a first call
        # whose order was the identity must not decide for this one
        outcomes.append(_check_eager_once(rerouted(case), recorded))
    return "; ".join(outcomes)


def rerouted(case: FuzzCase) -> FuzzCase:
    """``case`` with every :class:`Route`'s order rotated by one sample."""
    return dataclasses.replace(case, layers=tuple(
        dataclasses.replace(layer, order=(*layer.order[1:], *layer.order[:1]))
        if isinstance(layer, Route) else layer for layer in case.layers))


def _check_eager_once(case: FuzzCase, recorded: bool, *, open_gates: bool = False) -> str:
    expected = oracle(case, repeated=open_gates, eager=True)
    if expected is None:
        return "not applicable"
    want = expected.shaped(diagonal=case.diagonal)
    outcomes = []
    for batch_dim in dict.fromkeys([case.batch_dim, None]):
        built = build(case)
        built.switch["open_gates"] = open_gates
        snapshot = Snapshot.take(built.args, built.kwargs, built.module)
        try:
            G, leaves = _eager_gramian(case, built, recorded, batch_dim)
        except Exception as error:  # noqa: BLE001 -- the property is about which errors escape
            snapshot.assert_unchanged(built.module)
            if not str(error).startswith("torchgram."):
                raise AssertionError(f"eager: a raw error escaped: {type(error).__name__}: "
                                     f"{error}") from error
            outcomes.append("refused")
            continue
        snapshot.assert_unchanged(built.module)
        assert all(leaf.grad is None for leaf in leaves), "eager: a .grad was written"
        try:
            assert_close(G, want, G.dtype, f"G (batch_dim={batch_dim})", precision=torch.float32
                         if case.mixed_dtypes else getattr(torch, case.dtype))
        except AssertionError:
            if case.dtype != "float32":
                raise
            # off the float64 oracle by the case's own round-off, as check()'s blocks: a
            # train-mode batch norm over two samples between RMS norms, 2.1e-3 off in float32
            # on every backend and in the dense float32 computation alike (session 60's run)
            own = oracle(case, repeated=open_gates, eager=True, in_case_dtype=True)
            assert own is not None
            floor = OWN_ROUND_OFF * (own.shaped(diagonal=case.diagonal).double()
                                     - want).abs().max().item()
            error = (G.double() - want).abs().max().item()
            assert error <= floor, f"G (batch_dim={batch_dim}): {error:.3g} off, float32 " \
                f"oracle {floor:.3g}"
        outcomes.append("answered")
    return ", ".join(outcomes)


def fresh_leaves(built: Built) -> tuple[list[Any], list[Tensor]]:
    """``built``'s arguments with fresh leaves that require grad at ``argnums`` (one per
    distinct tensor), and those leaves: what an eager training step differentiates."""
    argnums = built.argnums
    nums = {n % len(built.args) for n in ((argnums,) if isinstance(argnums, int) else argnums)}
    fresh: dict[int, Tensor] = {}

    def leaf_of(value: Any) -> Any:
        if not (isinstance(value, Tensor) and value.is_floating_point()):
            return value
        if id(value) not in fresh:
            fresh[id(value)] = value.detach().clone().requires_grad_()
        return fresh[id(value)]

    args = [optree.tree_map(leaf_of, arg) if i in nums else arg
            for i, arg in enumerate(built.args)]
    return args, list(fresh.values())


def eager_rows(case: FuzzCase, built: Built, args: list[Any], recorded: bool) -> Any:
    """The case's output rows from an eager call on ``args`` (inside ``tg.autograd.record()``
    when ``recorded``): a tensor, or the list of a pytree's leaves; aux dropped."""
    seed_draws(case.seed)  # random ops: the oracle and the call see the same draw
    if recorded:
        with tg.autograd.record():
            out = built.f(*args, **built.kwargs)
    else:
        out = built.f(*args, **built.kwargs)
    if built.options.get("has_aux", False):
        out = out[0]
    return out if isinstance(out, Tensor) else optree.tree_leaves(out)


def _eager_gramian(case: FuzzCase, built: Built, recorded: bool,
                   batch_dim: int | None) -> tuple[Tensor, list[Tensor]]:
    args, leaves = fresh_leaves(built)
    rows = eager_rows(case, built, args, recorded)
    G = tg.autograd.gramian(rows, leaves, batch_dim=batch_dim, diagonal=case.diagonal,
                            chunk_size=case.chunk_size)
    assert isinstance(G, Tensor)
    return G, leaves
