"""Call signatures, the keys of the probe and trace caches (NOTE [call signatures])."""

from __future__ import annotations

import torch

import torchgram as tg
from torchgram._core.signature import call_signature, function_identity, identity


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


class _Model:
    pass


def test_a_new_object_never_takes_a_dead_ones_identity() -> None:
    """Python gives a new object the id of one that died; its identity in a key is its own
    (NOTE [identities]): before session 49 a sweep's lambda over a rebuilt model ran under the
    previous model's probe whenever the ids matched."""
    first = _Model()
    dead_id, dead_identity = id(first), identity(first)
    assert identity(first) == dead_identity
    del first
    later = [_Model() for _ in range(64)]
    reused = [obj for obj in later if id(obj) == dead_id]
    assert reused, "CPython reuses a freed object's id for the next one of its size"
    assert identity(reused[0]) != dead_identity
    held = [3]
    assert identity(held) == ("id", id(held))  # mutable: by id


def test_immutable_values_are_named_by_value() -> None:
    """A sweep's ``lambda p, x, dims=(0, i): ...`` made a fresh tuple default per iteration,
    which took a dead one's id: ``tg.explain`` reported another function's leaves (session
    66's review). Immutable values are named by their value (NOTE [identities])."""
    assert identity(3) == identity(3) == ("value", int, 3) != identity(3.0) != identity(True)
    assert identity(0.0) != identity(-0.0) and identity(float("nan")) == identity(float("nan"))
    assert identity((1, ("a", None))) == identity((1, ("a", None))) != identity((1, ("b", None)))
    model = _Model()
    assert identity((model, 2)) == identity((model, 2)) != identity((_Model(), 2))
    keys = set()
    for width in range(20):  # fresh tuples whose ids the collector reuses
        keys.add(function_identity(lambda x, dims=(0, width): x.sum(dims)))
    assert len(keys) == 20


def test_a_rebuilt_closure_over_a_new_object_has_a_new_key() -> None:
    x = torch.zeros(4, 3)
    rows = _rows(_Model())  # the closure's content dies with it
    first = call_signature(rows, (x,), {})
    del rows
    for _ in range(64):
        rows = _rows(_Model())
        assert call_signature(rows, (x,), {}) != first


def test_functions_that_differ_in_their_defaults_have_other_keys() -> None:
    """``[lambda p, x, g=g: g(p, x).sum(-1) for g in layers]``: one code object, no closure,
    other defaults; before session 66 they shared a key and ``tg.explain`` reported the first
    one's leaves for the others (a helper's hunt)."""
    double = torch.float64
    params = {"a": torch.randn(4, 4, dtype=double), "b": torch.randn(4, 4, dtype=double)}
    x = torch.randn(3, 4, dtype=double)
    layers = [lambda p, x: (x @ p["a"]).sin(), lambda p, x: (x @ p["b"]).cos()]
    rows = [lambda p, x, g=g: g(p, x).sum(-1) for g in layers]
    assert call_signature(rows[0], (params, x), {}) != call_signature(rows[1], (params, x), {})
    keyword = [lambda p, x, *, g=g: g(p, x).sum(-1) for g in layers]
    assert call_signature(keyword[0], (params, x), {}) != \
        call_signature(keyword[1], (params, x), {})
    for batch_dim in (None, 0):
        for used, f in zip("ab", rows, strict=True):
            leaves = tg.explain(f, batch_dim=batch_dim)(params, x).leaves
            assert [leaf.name for leaf in leaves if leaf.way != "unused"] == [used]
