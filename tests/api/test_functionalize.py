"""``torchgram.functionalize``: a module as a pure function of its trainable parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchgram as tg


def test_params_are_trainable_detached_and_share_storage() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    model[1].requires_grad_(False)
    fn, params = tg.functionalize(model)
    assert sorted(params) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    for name, value in params.items():
        original = model.get_parameter(name)
        assert not value.requires_grad and value.data_ptr() == original.data_ptr()
    x = torch.randn(5, 3)
    torch.testing.assert_close(fn(params, x), model(x))


def test_new_values_replace_parameters_and_missing_names_use_the_module() -> None:
    model = nn.Linear(3, 2)
    fn, params = tg.functionalize(model)
    x = torch.randn(4, 3)
    zeroed = {"weight": torch.zeros_like(params["weight"])}
    torch.testing.assert_close(fn(zeroed, x), model.bias.detach().expand(4, 2))


def test_tied_weights_appear_once_and_stay_tied() -> None:
    emb = nn.Embedding(5, 3)
    head = nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    fn, params = tg.functionalize(model)
    assert list(params) == ["0.weight"]
    tokens = torch.tensor([[1, 2]])
    new = {"0.weight": torch.randn(5, 3)}
    expected = new["0.weight"][tokens] @ new["0.weight"].T
    torch.testing.assert_close(fn(new, tokens), expected)


def test_buffers_are_current_and_never_updated() -> None:
    model = nn.BatchNorm1d(3)
    fn, params = tg.functionalize(model)
    model.running_mean.fill_(2.0)  # current buffers are used, not a snapshot
    model.eval()
    x = torch.randn(4, 3)
    torch.testing.assert_close(fn(params, x), model(x))
    model.train()
    fn(params, x)  # a training forward updates statistics on copies only
    torch.testing.assert_close(model.running_mean, torch.full((3,), 2.0))
    assert model.num_batches_tracked == 0


def test_kwargs_reach_the_module() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x, *, scale=1.0):
            return self.lin(x) * scale

    model = Scaled()
    fn, params = tg.functionalize(model)
    x = torch.randn(3, 2)
    torch.testing.assert_close(fn(params, x, scale=3.0), model(x) * 3.0)


def test_not_a_module_is_rejected() -> None:
    with pytest.raises(TypeError, match="torchgram.functionalize: expected an nn.Module, but "
                                        "got function"):
        tg.functionalize(lambda x: x)


def test_unknown_parameter_name_and_non_mapping_are_rejected() -> None:
    fn, params = tg.functionalize(nn.Linear(2, 2))
    with pytest.raises(KeyError, match=r"parameter name\(s\) \['wieght'\].*Valid names"):
        fn({"wieght": torch.zeros(2, 2)}, torch.randn(1, 2))
    with pytest.raises(TypeError, match="expected a dict of parameters.*got Tensor"):
        fn(torch.zeros(2), torch.randn(1, 2))
