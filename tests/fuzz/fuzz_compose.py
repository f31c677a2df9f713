"""Fuzzed compositions: ``torch.func`` transforms and eager autograd *through* ``tg.gramian``.

The same generated architectures as the Gramian property (``fuzz_strategies.cases``), made
float64, the call's own options kept (``batch_dim``, ``diagonal``, ``chunk_size``, budgets,
layouts), then differentiated or batched through the Gramian (``mode``):

* ``grad``: ``torch.func.grad`` of ``(G * R).sum()`` (``R`` fixed, random) w.r.t. the
  floating leaves of the differentiated argument;
* ``jvp``: ``torch.func.jvp`` of ``G`` along random tangents;
* ``vmap``: ``torch.func.vmap`` of ``G`` over an ensemble of two parameter sets;
* ``create_graph``: eager ``torch.autograd.grad`` of ``(G * R).sum()`` w.r.t. leaves that
  require grad (``G`` built with a graph).

The property: the answer of the same transform applied to the dense oracle written as a
function (``reference.dense_gramian_fn``), or a torchgram error. A raw error is allowed only
where torch itself raises for ``f`` (inside ``f``, or in the transform's own differentiation
after ``tg.gramian`` returned); where the oracle cannot be computed (torch lacks the
derivative), the call must still not raise a raw error from torchgram's code. Session 25's
compose hunt found two bugs this way (NOTE [ops without a batching rule], NOTE [embedding
conventions]).
"""

from __future__ import annotations

import dataclasses
import math
import traceback
from collections.abc import Callable
from typing import Any, Literal

import optree
import torch
from torch import Tensor

import torchgram as tg
from fuzz_arch import FuzzCase, build, draws
from reference import dense_gramian_fn

Mode = Literal["grad", "jvp", "vmap", "create_graph"]
MODES: tuple[Mode, ...] = ("grad", "jvp", "vmap", "create_graph")
TOLERANCE = 1e-8
"""Relative to the largest entry of each expected leaf (everything runs in float64), floored
at 1e-2 and at :data:`LEAF_FLOOR` times the largest entry of all leaves."""
LEAF_FLOOR = 1e-4
"""A leaf whose derivative is exactly zero gets the round-off of the others: the bias before a
batch norm in training mode over 3 values (the norm removes it) had 1.8e-10 in the oracle's
gradient of ``G`` against entries of 8e3 elsewhere, and every backend's exact 0 failed at 1e-8
relative to the 1e-2 floor (long run, ``--hypothesis-seed=4545``, session 45)."""


def composable(case: FuzzCase) -> FuzzCase:
    """``case`` in float64 with what a transform around the call excludes turned off.

    No aux, per-leaf blocks, second calls, ``no_grad``, leaves that already require grad,
    aliased leaves or split ``argnums`` (one differentiated argument, one ``G``).
    """
    return dataclasses.replace(
        case, dtype="float64", mixed_dtypes=False, has_aux=False, per_leaf=False,
        repeat="none", grad_mode="enabled", requires_grad=False, alias_tied=False,
        params_at="first" if case.params_at == "split" else case.params_at)


def check_composed(case: FuzzCase, backend: str, mode: Mode) -> str:
    """The property on one call; say how it ended (answered, refused, not applicable)."""
    if draws(case):
        return "not applicable (random f: the oracle's draws differ under transforms)"
    case = composable(case)
    built = build(case, torch.float64)
    argnum = built.argnums
    assert isinstance(argnum, int)
    flat, spec = optree.tree_flatten(built.args[argnum], none_is_leaf=True)
    at = [i for i, leaf in enumerate(flat) if isinstance(leaf, Tensor) and leaf.is_floating_point()]
    if not at:
        return "not applicable (no floating leaf)"
    values = tuple(flat[i] for i in at)

    def rebuilt(leaves: tuple[Tensor, ...]) -> tuple[Any, ...]:
        items = list(flat)
        for i, leaf in zip(at, leaves, strict=True):
            items[i] = leaf
        args = list(built.args)
        args[argnum] = optree.tree_unflatten(spec, items)
        return tuple(args)

    g, _ = built.oracle()
    dense = dense_gramian_fn(g, argnum, chunk_size=1)
    diagonal = bool(built.options.get("diagonal", False))

    def oracle_gramian(*leaves: Tensor) -> Tensor:
        full = dense(*rebuilt(leaves))
        if not diagonal:
            return full
        rows = full.shape[:full.dim() // 2]
        count = math.prod(rows)
        return full.reshape(count, count).diagonal().reshape(rows)

    def ours(*leaves: Tensor) -> Tensor:
        gramian = tg.gramian(built.f, backend=backend, **built.options)
        return gramian(*rebuilt(leaves), **built.kwargs)

    try:
        shape: torch.Size | None = oracle_gramian(*values).shape
    except Exception:  # noqa: BLE001 -- torch cannot even form the oracle (e.g. an old-style
        shape = None  # autograd.Function under jacrev): ours still must not raise raw errors
    try:
        actual = _apply(mode, ours, values, shape, torch.Generator().manual_seed(case.seed))
    except Exception as error:  # noqa: BLE001 -- the property is about which errors escape
        return _raised(error)
    try:
        expected = _apply(mode, oracle_gramian, values, shape,
                          torch.Generator().manual_seed(case.seed))
    except Exception as error:  # noqa: BLE001 -- torch lacks a derivative the oracle needs
        return f"answered, unchecked (the oracle raised {type(error).__name__})"
    largest = max((e.abs().max().item() for e in optree.tree_leaves(expected) if e.numel()),
                  default=0.0)
    for a, e in zip(optree.tree_leaves(actual), optree.tree_leaves(expected), strict=True):
        scale = max(e.abs().max().item() if e.numel() else 0.0, 1e-2, LEAF_FLOOR * largest)
        error = (a.double() - e).abs().max().item() / scale if e.numel() else 0.0
        assert error == error and error <= TOLERANCE, f"{mode}: relative error {error:.3g}"
    return "answered"


def _apply(mode: Mode, gramian: Callable[..., Tensor], values: tuple[Tensor, ...],
           shape: torch.Size | None, generator: torch.Generator) -> Any:
    """``mode`` through ``gramian`` (a function of the floating leaves)."""
    weights = None if shape is None else torch.randn(shape, generator=generator,
                                                     dtype=torch.float64)

    def objective(*leaves: Tensor) -> Tensor:
        G = gramian(*leaves)
        return (G * (torch.ones_like(G) if weights is None else weights)).sum()

    argnums = tuple(range(len(values)))
    if mode == "grad":
        return torch.func.grad(objective, argnums=argnums)(*values)
    if mode == "jvp":
        tangents = tuple(torch.randn(v.shape, generator=generator, dtype=v.dtype)
                         for v in values)
        return torch.func.jvp(gramian, values, tangents)[1]
    if mode == "vmap":
        return torch.func.vmap(gramian)(*(torch.stack([v, 0.7 * v]) for v in values))
    leaves = tuple(v.detach().clone().requires_grad_() for v in values)
    value = objective(*leaves)
    if not value.requires_grad:
        return tuple(torch.zeros_like(leaf) for leaf in leaves)
    grads = torch.autograd.grad(value, leaves, allow_unused=True)
    return tuple(torch.zeros_like(leaf) if g is None else g
                 for g, leaf in zip(grads, leaves, strict=True))


def _raised(error: Exception) -> str:
    """The outcome of a composed call that raised: a torchgram error, or torch's own.

    torch's own error is allowed where ``f`` itself raised under the transform (a frame of the
    fuzzed function) or where the transform's differentiation raised after ``tg.gramian``
    returned (no frame of torchgram's code).
    """
    if str(error).startswith("torchgram."):
        return f"refused ({type(error).__name__}: {str(error)[:60]}...)"
    files = [frame.filename.replace("\\", "/") for frame in traceback.extract_tb(
        error.__traceback__)]
    if any(name.endswith("fuzz_arch.py") for name in files):
        return f"f itself raised under the transform ({type(error).__name__})"
    if not any("/torchgram/" in name and "/tests/" not in name for name in files):
        return f"the transform raised after the call ({type(error).__name__})"
    raise AssertionError(f"a raw error escaped from torchgram: {type(error).__name__}: "
                         f"{error}") from error
