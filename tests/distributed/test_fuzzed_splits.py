"""Fuzzed architectures split over simulated ranks: the single-process Gramian, or a refusal.

The fuzzer's random architectures and calls (``tests/fuzz``) with ``batch_dim``, their batch
split into 2 or 3 parts (some empty), through the data-parallel machinery in one process
(``test_in_process.simulate_calls``: local phases, agreement, payloads through bytes, owners'
contractions). The result must be the single-process ``tg.gramian`` of the whole batch —
itself fuzzed against the dense oracle — or the clear error for samples that interact
(which no split can honour). Random ops are left out: each rank draws its own.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import optree
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from test_in_process import simulate_calls

import torchgram as tg
from torchgram._core.checks import resolve_argnums
from torchgram._core.problem import make_batch_spec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fuzz"))
from fuzz_arch import Route, build, draws  # noqa: E402
from fuzz_check import oracle  # noqa: E402
from fuzz_strategies import cases, profile  # noqa: E402

TOLERANCE = {torch.float64: 1e-8, torch.float32: 5e-4}


def _parts(built: Any, sizes: list[int]) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
    """Every rank's positional and keyword arguments: the batched inputs narrowed."""
    options = built.options
    given = options.get("argnums", 0)
    argnums = resolve_argnums("fuzz", (given,) if isinstance(given, int) else tuple(given),
                              len(built.args))
    spec = make_batch_spec("fuzz", built.args, argnums, options["batch_dim"],
                           options.get("in_dims", 0), built.kwargs)
    args_parts, kwargs_parts = [], []
    for rank, count in enumerate(sizes):
        narrowed = spec.narrow(sum(sizes[:rank]), count)
        args, kwargs = list(built.args), dict(built.kwargs)
        for (where, index), tensor in zip(spec.positions, narrowed, strict=True):
            holder: Any = args if isinstance(where, int) else kwargs
            leaves, treespec = optree.tree_flatten(holder[where], none_is_leaf=True)
            leaves[index] = tensor
            holder[where] = optree.tree_unflatten(treespec, leaves)
        args_parts.append(tuple(args))
        kwargs_parts.append(kwargs)
    return args_parts, kwargs_parts


@profile()
@given(data=st.data())
def test_fuzzed_split_gives_the_single_process_gramian(data: st.DataObject) -> None:
    case = data.draw(cases("structured"), label="case")
    assume(case.batch_dim is not None and not case.diagonal and not case.per_leaf)
    assume(not draws(case))  # dropout layers, and dropout inside attention or between RNNs
    # a Route reads its order modulo the batch size: on a rank's part it is another function
    # (a permutation of the whole batch can be the identity on each part), so no split can
    # see that coupling; each rank checks only its own samples (session 39)
    assume(not any(isinstance(layer, Route) for layer in case.layers))
    assume(case.grad_mode == "enabled")
    built = build(case)
    options = {k: v for k, v in built.options.items() if k != "argnums"}
    argnums = built.options.get("argnums", 0)
    try:
        expected = tg.gramian(built.f, argnums, **options)(*built.args, **built.kwargs)
    except Exception:  # noqa: BLE001 -- refused in one process: nothing to split
        assume(False)
    if case.has_aux:
        expected = expected[0]
    expected = expected.detach()  # G carries a graph when leaves require grad
    ranks = data.draw(st.integers(2, 3), label="ranks")
    sizes = data.draw(st.lists(st.integers(0, case.batch), min_size=ranks, max_size=ranks)
                      .filter(lambda s: sum(s) == case.batch), label="sizes")
    args_parts, kwargs_parts = _parts(built, sizes)
    try:
        got = simulate_calls(built.f, list(zip(args_parts, kwargs_parts, strict=True)),
                             argnums=argnums, **options)
    except ValueError as error:  # samples that interact: no split can give the batch's G
        assert "interact" in str(error), error
        return
    except NotImplementedError as error:  # an f that differentiates itself: refused, naming
        assert "differentiate its own computation" in str(error), error  # the way out
        return
    got = got.detach().reshape(expected.shape)
    scale = max(float(expected.abs().max()) if expected.numel() else 0.0, 1e-2)
    error = float((got.double() - expected.double()).abs().max()) / scale if got.numel() else 0.0
    precision = getattr(torch, case.dtype)  # mixed dtypes: a float64 output of float32 layers
    if not (math.isfinite(error) and error <= TOLERANCE[precision]):
        dense = oracle(case).shaped().reshape(expected.shape)
        raise AssertionError(
            f"split {sizes}: relative error {error:.3g} against tg.gramian; against the "
            f"oracle, tg.gramian {float((expected.double() - dense).abs().max()) / scale:.3g}"
            f", the split {float((got.double() - dense).abs().max()) / scale:.3g}")
