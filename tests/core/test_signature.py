"""Call signatures, the keys of the probe and trace caches (NOTE [call signatures])."""

from __future__ import annotations

import torch

from torchgram._core.signature import call_signature


def _rows(f):
    return lambda p, x: f(p, x).sum(1)


def test_parameter_names_are_part_of_the_key() -> None:
    """Two closures of one code object whose contents share an id (the garbage collector
    reuses ids: here the same ``f``), called on parameters of the same shapes under other
    names, are other calls: before session 40 the second ran the first's trace."""
    f = torch.mul
    rows = _rows(f)
    x = torch.zeros(4, 3)
    first = call_signature(rows, ({"adapter": torch.zeros(0, 3), "w": torch.zeros(5, 3)}, x), {})
    second = call_signature(rows, ({"extra": torch.zeros(0, 3), "w": torch.zeros(5, 3)}, x), {})
    same = call_signature(rows, ({"adapter": torch.ones(0, 3), "w": torch.ones(5, 3)}, x), {})
    assert first != second
    assert first == same


def test_keyword_structure_is_part_of_the_key() -> None:
    rows = _rows(torch.mul)
    x = torch.zeros(4, 3)
    assert call_signature(rows, (x,), {"mask": (x, x)}) != \
        call_signature(rows, (x,), {"mask": [x, x]})
