"""One model of the suite, its oracle, and the team's contract for every backend's answer.

The contract (issue 9, DESIGN.md §3-4): for every backend and every ``batch_dim`` in
``(0, None)``, ``tg.gramian`` either

* returns the dense float64 oracle's matrix (``tests/reference.py``) of the function **as
  called on the whole batch** — for coupled samples (batch-norm in train mode,
  ``x - x.mean(0)``) with ``batch_dim=0`` that is the coupled Gramian, the one
  ``batch_dim=None`` returns; for random ops (dropout) it is the Gramian of the one draw a
  single plain call ``f(params, *inputs, **kw_inputs)`` sees after ``torch.manual_seed(seed)``;
* or raises a **torchgram error**: an exception whose message starts with ``torchgram.``
  (``"{api}: expected ..., but got .... {fix}"``);

and never changes what it was given (parameters, inputs, the module's buffers). A raw torch
error, a wrong matrix or a mutated buffer breaks the contract. Keyword tensor inputs follow
per-sample semantics: with ``batch_dim`` they are split along their batch dimension like
positional ones (``in_dims`` is an int for every case that has keyword inputs).
"""

from __future__ import annotations

import functools
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import optree
import pytest
import torch
from torch import Tensor, nn

import torchgram as tg
from reference import Dense, dense_gramian

BACKENDS: tuple[str, ...] = ("jacobian", "ntvp", "graph", "structured", "auto")
BATCH_DIMS: tuple[int | None, ...] = (0, None)
RTOL = 1e-10
"""Largest allowed ``max |G - oracle|``, relative to ``max |oracle|`` (float64)."""


@dataclass
class ModelCase:
    """A pure function of a pytree of parameters, with inputs, as a user would bring it.

    Attributes:
        name: The id used in test names (``bert-mask-eager``).
        f: ``f(params, *inputs, **kw_inputs)``, usually built on ``tg.functionalize(model)``.
        params: The differentiated pytree (float64 leaves).
        inputs: Positional inputs; samples along dim 0 unless ``in_dims`` says otherwise.
        kw_inputs: Keyword inputs (e.g. ``attention_mask=``), passed by keyword to
            ``tg.gramian``'s function; tensors among them are batched along dim 0.
        in_dims: The ``in_dims`` that is true for the positional inputs when ``batch_dim=0``.
        output_shape: The shape of ``f``'s output on the whole batch (``None`` for a pytree
            output); the Gramian then has shape ``output_shape * 2``.
        module: The module behind ``f``, whose parameters and buffers must survive a call.
        seed: For random functions: the seed set before every evaluation (one draw).
        coupled: Samples interact (batch statistics): ``batch_dim=0`` is then not a true
            declaration, and the contract asks for the coupled Gramian or a torchgram error.
        rtol: Tolerance on ``max |G - oracle| / max |oracle|``: :data:`RTOL` for float64, looser
            only where float32 leaves make the oracle itself float32-accurate.
        note: What the case is about, in a few words.
    """

    name: str
    f: Callable[..., Any]
    params: Any
    inputs: tuple[Any, ...]
    kw_inputs: dict[str, Any] = field(default_factory=dict)
    in_dims: Any = 0
    output_shape: tuple[int, ...] | None = None
    module: nn.Module | None = None
    seed: int | None = None
    coupled: bool = False
    rtol: float = RTOL
    note: str = ""

    @property
    def args(self) -> tuple[Any, ...]:
        """``(params, *inputs)``: the positional arguments of ``f``."""
        return (self.params, *self.inputs)

    def plain(self, *args: Any) -> Any:
        """``f(*args, **kw_inputs)``, after re-seeding the RNG for random functions."""
        if self.seed is not None:
            torch.manual_seed(self.seed)
        return self.f(*args, **self.kw_inputs)


def module_case(name: str, module: nn.Module, inputs: tuple[Any, ...], *,
                model_inputs: int = 1, head: Callable[..., Any] | None = None,
                **extra: Any) -> ModelCase:
    """A case running ``module`` through ``tg.functionalize``.

    ``f(params, *inputs, **kw) = head(fn(params, *inputs[:model_inputs], **kw),
    *inputs[model_inputs:])`` (no head: the module's output itself).
    """
    fn, params = tg.functionalize(module)

    def f(p: Any, *xs: Any, **kw: Any) -> Any:
        out = fn(p, *xs[:model_inputs], **kw)
        return out if head is None else head(out, *xs[model_inputs:])

    return ModelCase(name, f, params, inputs, module=module, **extra)


def build(builders: dict[str, Callable[[], ModelCase]], name: str, seed: int = 0) -> ModelCase:
    """Build case ``name`` from a registry with a fixed seed (same case on every call)."""
    torch.manual_seed(seed)
    case = builders[name]()
    assert case.name == name, (case.name, name)
    return case


# -- the oracle ---------------------------------------------------------------------------------


@functools.cache
def _cached_oracle(key: tuple[int, str], builder: Callable[[], ModelCase]) -> tuple[Dense, float]:
    torch.manual_seed(0)
    case = builder()
    start = time.perf_counter()
    expected = dense_gramian(case.plain, case.args)
    seconds = time.perf_counter() - start
    if case.output_shape is not None:
        assert tuple(expected.output.shape) == case.output_shape, (
            f"{case.name}: output shape {tuple(expected.output.shape)}, "
            f"declared {case.output_shape}")
    if case.seed is not None:  # the oracle differentiated the draw of one plain call
        again = case.plain(*case.args)
        for a, b in zip(optree.tree_leaves(expected.output), optree.tree_leaves(again),
                        strict=True):
            assert torch.equal(a, b), f"{case.name}: the seeded draw is not reproducible"
    assert torch.isfinite(expected.gramian).all(), f"{case.name}: non-finite oracle"
    return expected, seconds


def oracle(builders: dict[str, Callable[[], ModelCase]], name: str) -> tuple[Dense, float]:
    """The dense float64 Gramian of case ``name`` (cached per case) and its runtime."""
    return _cached_oracle((id(builders), name), builders[name])


# -- running a backend and judging its answer ---------------------------------------------------


class WrongMatrix(AssertionError):
    """A backend returned a matrix that is not the oracle's."""


class Mutated(AssertionError):
    """A call changed a tensor it was given (parameters, inputs, buffers)."""


def torchgram_message(error: BaseException) -> str | None:
    """The message of ``error`` if it is a torchgram error (starts with ``torchgram.``)."""
    message = error.args[0] if error.args and isinstance(error.args[0], str) else str(error)
    return message if message.startswith("torchgram.") else None


def _state(case: ModelCase) -> list[tuple[str, Tensor]]:
    named: list[tuple[str, Tensor]] = []
    if case.module is not None:
        named += [(f"module.{k}", v) for k, v in case.module.state_dict(keep_vars=True).items()]
    for where, tree in (("params", case.params), ("inputs", case.inputs),
                        ("kw_inputs", case.kw_inputs)):
        paths, leaves, _ = optree.tree_flatten_with_path(tree)
        named += [(f"{where}{list(p)}", leaf) for p, leaf in zip(paths, leaves, strict=True)
                  if isinstance(leaf, Tensor)]
    return named


def snapshot(case: ModelCase) -> dict[str, Tensor]:
    """Copies of every tensor a call must leave alone, by name, to compare with afterwards."""
    return {name: t.detach().clone() for name, t in _state(case)}


def check_unchanged(case: ModelCase, before: dict[str, Tensor]) -> None:
    """Raise :class:`Mutated` naming the first tensor changed in place or rebound."""
    after = dict(_state(case))
    if after.keys() != before.keys():
        raise Mutated(f"MUTATED: the call changed the set of tensors: "
                      f"{sorted(after.keys() ^ before.keys())}")
    for name, copy in before.items():
        tensor = after[name].detach()
        if tensor.shape != copy.shape or not torch.equal(tensor, copy):
            raise Mutated(f"MUTATED: the call changed {name}")


def relative_error(actual: Tensor, expected: Tensor) -> float:
    """``max |actual - expected| / max |expected|`` (absolute when the oracle is zero)."""
    scale = expected.abs().max().item()
    difference = (actual - expected).abs().max().item()
    return difference / scale if scale > 0 else difference


def output_dtype(expected: Dense) -> torch.dtype:
    """The dtype the Gramian must have: the (promoted) dtype of ``f``'s output."""
    dtype = None
    for leaf in optree.tree_leaves(expected.output):
        dtype = leaf.dtype if dtype is None else torch.promote_types(dtype, leaf.dtype)
    assert dtype is not None
    return dtype


def compare(actual: Any, expected: Dense, rtol: float = RTOL) -> None:
    """Raise :class:`WrongMatrix` unless ``actual`` is the oracle's Gramian (shape, dtype)."""
    want = expected.shaped()
    if not isinstance(actual, Tensor):
        raise WrongMatrix(f"WRONG: returned {type(actual).__name__}, not a tensor")
    if actual.shape != want.shape:
        raise WrongMatrix(f"WRONG: shape {tuple(actual.shape)}, expected {tuple(want.shape)}")
    if actual.dtype != output_dtype(expected):
        raise WrongMatrix(f"WRONG: dtype {actual.dtype}, expected {output_dtype(expected)}")
    error = relative_error(actual.detach().to(want.dtype), want)
    if not error <= rtol:  # also catches NaN
        raise WrongMatrix(f"WRONG: max |G - oracle| / max |oracle| = {error:.2e} "
                          f"(tolerance {rtol:.0e})")


@dataclass
class Result:
    """What one backend call did, for the test and for BASELINE.md."""

    status: str
    """``ok`` or ``torchgram error`` (a raw error, a wrong matrix or a mutation raises)."""
    seconds: float
    message: str = ""


def run_gramian(case: ModelCase, backend: str, batch_dim: int | None) -> tuple[Any, float]:
    """``tg.gramian`` of the case with ``backend`` and ``batch_dim``; the result and its time."""
    transform = tg.gramian(case.f, backend=backend, batch_dim=batch_dim,
                           in_dims=case.in_dims if batch_dim is not None else 0)
    if case.seed is not None:
        torch.manual_seed(case.seed)
    start = time.perf_counter()
    result = transform(*case.args, **case.kw_inputs)
    return result, time.perf_counter() - start


def check_contract(case: ModelCase, backend: str, batch_dim: int | None,
                   expected: Dense) -> Result:
    """Run one backend and enforce the contract.

    Returns the :class:`Result` when the call returned the oracle's matrix or raised a
    torchgram error; re-raises any other exception untouched (so its traceback shows), and
    raises :class:`WrongMatrix` / :class:`Mutated` for a wrong matrix / a changed input.
    """
    before = snapshot(case)
    start = time.perf_counter()
    try:
        G, seconds = run_gramian(case, backend, batch_dim)
    except Exception as error:
        message = torchgram_message(error)
        if message is None:
            raise
        check_unchanged(case, before)
        return Result("torchgram error", time.perf_counter() - start, message)
    compare(G, expected, case.rtol)
    check_unchanged(case, before)
    return Result("ok", seconds)


_RELAYS = ("/torchgram/_api/functionalize.py", "/torchgram/backends/structured/rules/",
           "/torchgram/_core/problem.py")
"""torchgram frames that only relay a call of the user's function (functionalize's ``fn``,
the structured taps' mode, the problem's evaluation helpers)."""


def _short(filename: str) -> str:
    for anchor in ("site-packages/", "/src/", "/tests/"):
        if anchor in filename:
            return ("tests/" if anchor == "/tests/" else "") + filename.split(anchor)[-1]
    return filename


def describe_failure(error: BaseException) -> tuple[str, str]:
    """``(status, detail)`` for BASELINE.md.

    The detail of a raw error is its type and first line, then where it happened: the
    raising frame, and the innermost torchgram frame that is not a mere relay of the user's
    function (:data:`_RELAYS`): in practice the backend code that ran it.
    """
    if isinstance(error, WrongMatrix):
        return "WRONG", str(error).removeprefix("WRONG: ")
    if isinstance(error, Mutated):
        return "MUTATED", str(error).removeprefix("MUTATED: ")
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    frames = traceback.extract_tb(error.__traceback__)
    library = [fr for fr in frames if "/torchgram/" in fr.filename and "/tests/" not in fr.filename
               and not any(part in fr.filename for part in _RELAYS)]
    where = [f"{_short(frames[-1].filename)}:{frames[-1].name}"] if frames else []
    if library and library[-1] is not frames[-1]:
        where.append(f"{_short(library[-1].filename)}:{library[-1].name}")
    return "RAW ERROR", f"{type(error).__name__}: {first} [{' <- '.join(where)}]"


# -- the test grid ------------------------------------------------------------------------------


def grid(builders: dict[str, Callable[[], ModelCase]],
         names: tuple[str, ...] | None = None) -> list[Any]:
    """``pytest.param(name, backend, batch_dim)`` for every case × backend × batch_dim, with
    ids like ``bert-mask-eager-auto-batch0`` / ``...-batchNone``."""
    return [pytest.param(name, backend, batch_dim, id=f"{name}-{backend}-batch{batch_dim}")
            for name in (names or tuple(builders)) for backend in BACKENDS
            for batch_dim in BATCH_DIMS]


def assert_contract(builders: dict[str, Callable[[], ModelCase]], name: str, backend: str,
                    batch_dim: int | None) -> Result:
    """The body of every suite test: the oracle's matrix or a torchgram error, nothing else."""
    expected, _ = oracle(builders, name)
    return check_contract(build(builders, name), backend, batch_dim, expected)
