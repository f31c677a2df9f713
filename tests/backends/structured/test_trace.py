"""The tap machinery: what counts as a use, views, replays that leave their trace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchgram.backends.structured.trace import TapMode, TraceMismatch, describe


def _trace(fn, *leaves):
    with TapMode(list(leaves), list(leaves), taps="trace") as mode:
        fn(*leaves)
    return mode.recording


@pytest.mark.parametrize("view", [
    pytest.param(lambda w: w.T, id="T"),
    pytest.param(lambda w: w.mT, id="mT"),
    pytest.param(lambda w: w.t(), id="t"),
    pytest.param(torch.t, id="torch.t"),
    pytest.param(lambda w: w.transpose(0, 1), id="transpose"),
    pytest.param(lambda w: torch.transpose(w, -1, -2), id="torch.transpose"),
    pytest.param(lambda w: w.permute(1, 0), id="permute"),
    pytest.param(lambda w: w.swapaxes(0, 1), id="swapaxes"),
])
def test_transposed_views_are_followed(view):
    x = torch.randn(4, 3)
    recording = _trace(lambda w: F.linear(x, view(w)), torch.randn(3, 5))
    assert [(use.rule, use.act_first) for use in recording.uses] == [("linear", True)]
    assert recording.unrecognised == {}


def test_double_transpose_is_the_leaf_again():
    x = torch.randn(4, 3)
    recording = _trace(lambda w: F.linear(x, w.T.T), torch.randn(5, 3))
    assert [use.act_first for use in recording.uses] == [False]


def test_every_other_use_is_recorded_with_its_name():
    recording = _trace(lambda w, b: (w[:, 0] * 2, torch.sin(b), b.shape, w.dtype),
                       torch.randn(3, 2), torch.randn(2))
    assert recording.unrecognised == {0: ["Tensor.__getitem__"], 1: ["sin"]}
    assert recording.uses == []


def test_a_view_used_outside_the_rules_is_a_use_of_its_leaf():
    recording = _trace(lambda w: torch.exp(w.T), torch.randn(3, 2))
    assert recording.unrecognised == {0: ["exp"]}


def test_describe():
    assert describe(torch.Tensor.T.__get__) == "Tensor.T"
    assert describe(torch.Tensor.add) == "Tensor.add"
    assert describe(F.layer_norm) == "layer_norm"


def test_replay_checks_each_tapped_call_against_the_trace():
    w, x = torch.randn(3, 5), torch.randn(4, 5)
    recording = _trace(lambda w: F.linear(x, w), w)
    tap = torch.zeros(4, 3, requires_grad=True)
    with pytest.raises(TraceMismatch, match="differs from the trace"):
        with TapMode([w], [w], taps=[tap], expected=recording.taps, carriers=[]):
            x[:2] @ w.T
    mode = TapMode([w], [w], taps=[tap], expected=recording.taps, carriers=[])
    with mode:
        pass
    with pytest.raises(TraceMismatch, match="tapped 0 calls, the trace 1"):
        mode.finish()
    with pytest.raises(TraceMismatch, match="did not see"):
        with TapMode([w], [w], taps=[tap], expected=recording.taps, carriers=[]):
            torch.exp(w)


def test_backend_recovers_from_a_run_that_leaves_its_trace():
    import torchgram as tg

    calls = []

    def moody(w, x):  # the trace sees F.linear, the real pass a matmul: same function
        calls.append(1)
        return torch.tanh(F.linear(x, w) if len(calls) == 1 else x @ w.T).sum(-1)

    w, x = torch.randn(3, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    expected = tg.gramian(lambda w, x: torch.tanh(x @ w.T).sum(-1), backend="jacobian")(w, x)
    actual = tg.gramian(moody, backend="structured", batch_dim=0)(w, x)
    torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("equation", ["btd,od->bto", "btd,od->bot", "od,btd->bto"])
@pytest.mark.parametrize("width", [1, 2], ids=["width1", "width2"])
def test_rewritten_einsum_keeps_the_original_layout_when_asked(equation: str, width: int):
    """NOTE [rewritten layouts]: einsum's own strides (a size-1 contracted index, a
    transposed activation), which a dropout after it would lay its mask out along."""
    x = torch.randn(1, 3, width).transpose(0, 1)
    w = torch.randn(4, width)
    operands = (x, w) if equation.startswith("b") else (w, x)
    expected = torch.einsum(equation, *operands)
    for original_layouts in (False, True):
        with TapMode([w], [w], taps="lazy", original_layouts=original_layouts) as mode:
            y = torch.einsum(equation, *operands)
        assert mode.rewrote
        torch.testing.assert_close(y, expected)
        if original_layouts:
            assert y.stride() == expected.stride()


def test_a_call_without_rewrites_says_so():
    w = torch.randn(3, 2)
    with TapMode([w], [w], taps="lazy") as mode:
        torch.tanh(torch.randn(4, 2) @ w.T)
    assert not mode.rewrote
