"""The recorded forward reads each call's tensor arguments as a pytree flatten would."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch

from torchgram._core.pytree import leaves_of
from torchgram.backends.eager.record import _tensors_of
from torchgram.backends.structured.rules.elementwise import broadcast_shape

A, B, C = torch.zeros(1), torch.ones(2), torch.zeros(3, requires_grad=True)
Pair = collections.namedtuple("Pair", ["x", "y"])

CALLS: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
    ((), {}), ((A,), {}), ((A, 1, None, "s", torch.float64, torch.Size([2])), {}),
    (([A, B], 0), {}), (((A, 2.0), slice(1, 2), ...), {}),
    ((A,), {"weight": B, "bias": None, "alpha": 2}), ((A,), {"z": B, "a": C}),
    (([A, [B, C]],), {}), ((Pair(A, B),), {}), ((A,), {"extra": {"k": C, "j": B}}),
    (({"k": B},), {"out": (A, C)}),
]


@pytest.mark.parametrize(("args", "kwargs"), CALLS)
def test_tensors_of_is_the_pytree_order(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    expected = [value for value in leaves_of((args, kwargs)) if isinstance(value, torch.Tensor)]
    found = _tensors_of(args, kwargs)
    assert len(found) == len(expected)
    assert all(a is b for a, b in zip(found, expected, strict=True))


@pytest.mark.parametrize(("a", "b"), [((2, 1, 3), (4, 1)), ((), (3,)), ((0, 1), (1, 5)),
                                      ((2, 3), (4,)), ((3, 1), (1, 0)), ((5,), (5,))])
def test_broadcast_shape_is_torchs(a: tuple[int, ...], b: tuple[int, ...]) -> None:
    try:
        expected: tuple[int, ...] | None = tuple(torch.broadcast_shapes(a, b))
    except RuntimeError:
        expected = None
    assert broadcast_shape(a, b) == expected
