"""``torch.einsum`` with a weight (NOTE [einsum rewrite]): rewritten or not, the oracle's matrix."""

from __future__ import annotations

import pytest
import torch

import torchgram as tg
from torchgram.backends.structured.rules.einsum import rewrite_einsum

B, T, D, K = 3, 4, 5, 2


def _randn(*shape):
    return torch.randn(*shape, dtype=torch.float64)


CASES = {  # name: (f, parameter shapes, input shape, the rules that see the weight or None)
    "x_w": (lambda p, x: torch.einsum("btd,dk->btk", x, p["w"]).tanh().sum((1, 2)),
            {"w": (D, K)}, (B, T, D), ("matmul",)),
    "linear_permuted_out": (lambda p, x: torch.einsum("btd,kd->bkt", x, p["w"]).tanh()
                            .sum((1, 2)), {"w": (K, D)}, (B, T, D), ("linear",)),
    "weight_first": (lambda p, x: torch.einsum("dk,btd->kbt", p["w"], x).tanh().sum((0, 2)),
                     {"w": (D, K)}, (B, T, D), ("matmul",)),
    "contracted_inside": (lambda p, x: torch.einsum("bdt,kd->btk", x, p["w"]).tanh()
                          .sum((1, 2)), {"w": (K, D)}, (B, D, T), ("linear",)),
    "vector": (lambda p, x: torch.einsum("btd,d->bt", x, p["v"]).sin().sum(1),
               {"v": (D,)}, (B, T, D), ("matmul",)),
    "list_operands": (lambda p, x: torch.einsum("b d, k d -> b k", [x, p["w"]]).cos().sum(1),
                      {"w": (K, D)}, (B, D), ("linear",)),
    "reused": (lambda p, x: torch.einsum("bd,de->be", torch.tanh(
        torch.einsum("bd,de->be", x, p["w"])), p["w"]).sum(1), {"w": (D, D)}, (B, D),
        ("matmul", "matmul")),
    # a weight per group (per token here): a bmm of x as [t, b, d]
    "grouped": (lambda p, x: torch.einsum("btd,tdk->btk", x, p["w"]).tanh().sum((1, 2)),
                {"w": (T, D, K)}, (B, T, D), ("bmm",)),
    "grouped_weight_first": (lambda p, x: torch.einsum("hdk,bdh->bkh", p["w"], x).tanh()
                             .sum((1, 2)), {"w": (T, D, K)}, (B, D, T), ("bmm",)),
    # not rewritten: the weights keep the fallback, the matrix is still the oracle's
    "grouped_transposed": (lambda p, x: torch.einsum("btd,tkd->btk", x, p["w"]).tanh()
                           .sum((1, 2)), {"w": (T, K, D)}, (B, T, D), None),
    "two_kept": (lambda p, x: torch.einsum("bd,dkl->bkl", x, p["w"]).tanh().sum((1, 2)),
                 {"w": (D, K, 2)}, (B, D), None),
}


@pytest.mark.parametrize("batch_dim", [0, None], ids=["batch", "dense"])
@pytest.mark.parametrize("name", list(CASES))
def test_einsum_against_oracle(name, batch_dim, check):
    f, shapes, x_shape, rules = CASES[name]
    torch.manual_seed(0)
    params = {key: _randn(*shape) for key, shape in shapes.items()}
    args = (params, _randn(*x_shape))
    check(f, args, force=None, batch_dim=batch_dim)
    report = tg.explain(f, backend="structured", batch_dim=batch_dim)(*args)
    if rules is None:
        assert report.fallback == tuple(shapes)
    else:
        assert report.fallback == ()
        assert report.leaves[0].rules == rules


@pytest.mark.parametrize("way", ["ghost", "materialize"])
def test_einsum_forced_ways(way, check):
    f, shapes, x_shape, _ = CASES["linear_permuted_out"]
    torch.manual_seed(1)
    args = ({"w": _randn(*shapes["w"])}, _randn(*x_shape))
    check(f, args, force=way, batch_dim=0)


@pytest.mark.parametrize("equation", ["bij,bkj->bik", "bi,bi->b", "ij,jk", "...d,dk->...k",
                                      "bii,ik->bk", "bd,dk,kl->bl", "bhij,bhjk->bhik"])
def test_unsupported_equations_keep_the_call(equation):
    operands = [_randn(*(3,) * len(term.replace("...", "x")))
                for term in equation.split("->")[0].split(",")]
    assert rewrite_einsum((equation, *operands), {}) is NotImplemented


@pytest.mark.parametrize("equation", ["btd,dk->btk", "btd,kd->bkt", "dk,btd->kbt", "btd,d->bt",
                                      "bhd,hdk->bhk", "hdk,bdh->bkh", "bij,bjk->bik"])
def test_rewritten_values_are_einsum_s(equation):
    sizes = dict(zip("bthdkij", (2, 3, 4, 5, 6, 3, 5), strict=True))
    operands = [_randn(*(sizes[letter] for letter in term))
                for term in equation.split("->")[0].split(",")]
    actual = rewrite_einsum((equation, *operands), {})
    torch.testing.assert_close(actual, torch.einsum(equation, *operands))
