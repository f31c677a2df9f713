"""``_core/layouts``: values given another tensor's strides, size-1 dims included."""

from __future__ import annotations

import pytest
import torch

from torchgram._core.layouts import laid_out_like, with_strides

# (shape, the strides to give) -- each a dense layout
DENSE = {
    "transposed": ((2, 3), (1, 2)),
    "time_major_seen_batch_first": ((3, 4, 5), (5, 15, 1)),
    "size_one_step": ((3, 1, 1), (1, 3, 1)),
    "size_one_everywhere": ((1, 1, 1), (7, 1, 3)),
    "size_one_inner": ((2, 1, 3), (1, 6, 2)),
    "scalar": ((), ()),
}


@pytest.mark.parametrize("name", list(DENSE))
def test_dense_strides_are_given_exactly(name):
    shape, strides = DENSE[name]
    value = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    result = with_strides(value, strides)
    assert result.stride() == strides
    torch.testing.assert_close(result, value)
    torch.autograd.gradcheck(lambda v: with_strides(v, strides), (value,))


def test_strides_with_gaps_keep_the_order_of_entries():
    original = torch.randn(4, 6)[:, ::2].T  # [3, 4] with strides (2, 6): not dense
    value = torch.randn(3, 4)
    result = laid_out_like(value, original)
    torch.testing.assert_close(result, value)
    assert result.stride() == (1, 3)  # the same order as (2, 6), densely


def test_an_einsum_after_it_lays_out_its_output_as_after_the_original():
    """What makes size-1 strides matter: einsum lays its output out by them."""
    original = torch.randn(1, 3, 1).transpose(0, 1)  # [3, 1, 1], strides (1, 3, 1)
    weight = torch.randn(4, 1)
    value = torch.empty_strided((3, 1, 1), (1, 1, 1)).copy_(original)  # same values
    expected = torch.einsum("btd,od->bto", original, weight).stride()
    assert torch.einsum("btd,od->bto", value, weight).stride() != expected
    given = laid_out_like(value, original)
    assert torch.einsum("btd,od->bto", given, weight).stride() == expected


def test_non_tensors_pass_through():
    assert laid_out_like(None, torch.zeros(2)) is None
    value = torch.zeros(2)
    assert laid_out_like(value, 3) is value
