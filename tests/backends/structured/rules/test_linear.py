"""The linear and matmul rules, each op alone, against the dense oracle."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchgram.backends.structured.rules.linear import (
    AddmmRule,
    LinearLayout,
    MatmulLeftLayout,
    MatmulRule,
)
from torchgram.backends.structured.trace import TapMode

B = 4
WAYS = ["ghost", "materialize"]
BATCH = [None, 0]


def _grid():
    return [pytest.param(way, batch, diagonal, id=f"{way}-{'dense' if batch is None else 'batch'}"
                         f"{'-diag' if diagonal else ''}")
            for way in WAYS for batch in BATCH for diagonal in (False, True)]


def _randn(*shape):
    return torch.randn(*shape, dtype=torch.float64)


CASES = {
    "linear": (lambda p, x: F.linear(x, p["w"], p["b"]), {"w": (3, 5), "b": (3,)}, (B, 5)),
    "linear_no_bias_tanh": (lambda p, x: torch.tanh(F.linear(x, p["w"])).sum(-1),
                            {"w": (3, 5)}, (B, 5)),
    "linear_sequence": (lambda p, x: torch.tanh(F.linear(x, p["w"], p["b"])).mean(1),
                        {"w": (3, 5), "b": (3,)}, (B, 6, 5)),
    "linear_transposed_weight": (lambda p, x: F.linear(x, p["w"].T).sin(), {"w": (5, 3)}, (B, 5)),
    "x_at_w": (lambda p, x: (x @ p["w"]).cos(), {"w": (5, 3)}, (B, 5)),
    "x_at_w_T": (lambda p, x: torch.matmul(x, p["w"].T).cos(), {"w": (3, 5)}, (B, 5)),
    "x_at_w_t": (lambda p, x: x.matmul(p["w"].t()).cos(), {"w": (3, 5)}, (B, 5)),
    "mm": (lambda p, x: torch.mm(x, p["w"]).cos(), {"w": (5, 3)}, (B, 5)),
    "x_at_vector": (lambda p, x: torch.tanh(x @ p["v"]), {"v": (5,)}, (B, 5)),
    "w_at_x_columns": (lambda p, x: torch.tanh(p["w"] @ x).sum(1), {"w": (3, 5)}, (B, 5, 2)),
    "w_T_at_x": (lambda p, x: torch.tanh(p["w"].transpose(0, 1) @ x).sum(1),
                 {"w": (5, 3)}, (B, 5, 2)),
    "w_mT_at_x": (lambda p, x: torch.tanh(p["w"].mT @ x).sum(1), {"w": (5, 3)}, (B, 5, 2)),
    "vector_at_x": (lambda p, x: torch.tanh(p["v"] @ x), {"v": (5,)}, (B, 5, 2)),
    "w_at_vector_rows": (lambda p, x: torch.stack([torch.tanh(p["w"] @ xb) for xb in x]),
                         {"w": (3, 5)}, (B, 5)),
    "reused": (lambda p, x: F.linear(torch.tanh(F.linear(x, p["w"], p["b"])), p["w"], p["b"]),
               {"w": (5, 5), "b": (5,)}, (B, 5)),
    "tied_both_orientations": (lambda p, x: torch.tanh(x @ p["w"]) @ p["w"].T,
                               {"w": (5, 3)}, (B, 5)),
    "two_leaves_product": (lambda p, x: x @ (p["a"] @ p["b"]), {"a": (5, 4), "b": (4, 3)},
                           (B, 5)),
    "same_leaf_both_sides": (lambda p, x: x @ (p["w"] @ p["w"]), {"w": (5, 5)}, (B, 5)),
    "leaf_as_activation": (lambda p, x: F.linear(p["w"], p["w"]).sum() * x.sum(-1),
                           {"w": (4, 4)}, (B, 5)),
    # GPT-2's Conv1D: the tokens of every sample merged into one dim, then addmm
    "addmm_conv1d": (lambda p, x: torch.tanh(torch.addmm(p["b"], x.reshape(-1, 5), p["w"])
                                             .reshape(x.shape[0], -1, 3)).sum((1, 2)),
                     {"w": (5, 3), "b": (3,)}, (B, 6, 5)),
    "addmm_left_weight": (lambda p, x: torch.tanh(torch.addmm(p["b"], p["w"], x.T)).sum(0),
                          {"w": (3, 5), "b": (3, 1)}, (B, 5)),
    "addmm_beta_method": (lambda p, x: x.addmm(x, p["w"], beta=0.5).sin().sum(-1),
                          {"w": (5, 5)}, (B, 5)),
    "addmm_bias_rows": (lambda p, x: torch.addmm(p["b"], x, p["w"]).cos().sum(-1),
                        {"w": (5, 3), "b": (1, 3)}, (B, 5)),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize(("way", "batch_dim", "diagonal"), _grid())
def test_rule_matches_oracle(check, name, way, batch_dim, diagonal):
    torch.manual_seed(0)
    f, shapes, x_shape = CASES[name]
    params = {k: _randn(*s) for k, s in shapes.items()}
    check(f, (params, _randn(*x_shape)), force=way, batch_dim=batch_dim, diagonal=diagonal)


@pytest.mark.parametrize("name", ["linear_sequence", "x_at_w", "tied_both_orientations"])
def test_ntk_outputs_with_rows_per_sample(check, name):
    torch.manual_seed(1)
    f, shapes, x_shape = CASES[name]
    params = {k: _randn(*s) for k, s in shapes.items()}
    ntk = lambda p, x: torch.stack([f(p, x), 2 * f(p, x) ** 2], dim=1)  # noqa: E731
    for way in WAYS:
        check(ntk, (params, _randn(*x_shape)), force=way, batch_dim=0)


def test_recognised_calls_are_tapped_not_unrecognised():
    w, x = _randn(3, 5), _randn(B, 5)
    with TapMode([w], [w], taps="trace") as mode:
        F.linear(x, w)
        x @ w.T
        w.shape, w.dtype, w.size(0)  # metadata is no use
    recording = mode.recording
    assert [use.rule for use in recording.uses] == ["linear", "matmul"]
    assert [use.act_first for use in recording.uses] == [False, False]
    assert recording.unrecognised == {}


def test_leaf_used_as_activation_is_unrecognised():
    w = _randn(4, 4)
    with TapMode([w], [w], taps="trace") as mode:
        F.linear(w, w)
    assert [use.role for use in mode.recording.uses] == ["weight"]
    assert mode.recording.unrecognised == {0: ["linear (as an activation)"]}


def test_layout_positions_and_shapes():
    layout = LinearLayout(d_in=5, d_out=3)
    assert layout.act_factor(_randn(2, 4, 6, 5), nlead=1).shape == (2, 24, 1, 5)
    assert layout.shape(out_numel=6 * 3).positions == 6
    left = MatmulLeftLayout(p=3, q=5, act_is_vector=False)
    x = _randn(2, 5, 7)
    assert torch.equal(left.act_factor(x, 1)[0, :, 0], x[0].T)


def test_matmul_rule_rejects_out_and_batched_weights():
    rule = MatmulRule()
    a, b = _randn(2, 3), _randn(3, 4)
    assert rule.match(torch.matmul, (a, b), {"out": _randn(2, 4)}) is None
    match = rule.match(torch.matmul, (_randn(2, 2, 3), _randn(2, 3, 4)), {})
    assert match is not None and all(op.layout is None for op in match.operands)


def test_addmm_is_structured_and_batched(ways):
    import torchgram as tg

    f, shapes, x_shape = CASES["addmm_conv1d"]
    params = {k: _randn(*s) for k, s in shapes.items()}
    args = (params, _randn(*x_shape))
    assert "fallback" not in ways(f, args, batch_dim=0)
    ran = tg.explain(f, backend="structured", batch_dim=0, run=True)(*args).ran
    assert ran is not None and ran.way == "batched"
    assert AddmmRule().match(torch.addmm, (_randn(3), _randn(2, 4), _randn(4, 3)),
                             {"alpha": 2.0}) is None
