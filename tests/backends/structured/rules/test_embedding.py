"""The embedding rule, alone and tied to a linear head, against the dense oracle."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchgram.backends.structured.rules.embedding import EmbeddingRule

B, T, V, D = 3, 5, 7, 4
WAYS = ["ghost", "materialize", "sparse"]


def _tokens(seed=0):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (B, T), generator=generator)
    tokens[0, :3] = 2  # repeats within a sample
    tokens[1, 0] = 0
    tokens[2, -1] = V - 1
    return tokens


CASES = {
    "plain": lambda p, i: torch.tanh(F.embedding(i, p["e"])).sum((1, 2)),
    "padding_idx": lambda p, i: torch.tanh(F.embedding(i, p["e"], padding_idx=0)).sum((1, 2)),
    "negative_padding_idx": lambda p, i: F.embedding(i, p["e"], padding_idx=-1).pow(2).sum((1, 2)),
    "tied_head": lambda p, i: F.log_softmax(F.linear(torch.tanh(F.embedding(i, p["e"])), p["e"]),
                                            -1)[..., 0].sum(1),
    "tied_head_transposed": lambda p, i: (torch.tanh(F.embedding(i, p["e"])) @ p["e"].T)
    .sin().sum((1, 2)),
    "ntk_rows": lambda p, i: F.embedding(i, p["e"], padding_idx=0).mean(1).tanh(),
    "scale_grad_by_freq": lambda p, i: F.embedding(i, p["e"], scale_grad_by_freq=True)
    .tanh().sum((1, 2)),
    "two_lookups": lambda p, i: (F.embedding(i, p["e"], padding_idx=2)
                                 * F.embedding(i.flip(1), p["e"])).sum((1, 2)),
    # a lookup added into the Jacobian of the other uses (NOTE [Jacobians of several uses]),
    # or kept apart from a use no rule sees (its gradient is not the contraction's to write)
    "tied_head_and_unknown_use": lambda p, i: F.log_softmax(
        F.linear(torch.tanh(F.embedding(i, p["e"], padding_idx=0)), p["e"]), -1)[..., 1].sum(1)
    + torch.sin(p["e"]).sum() * i.double().mean(1),
    "lookup_and_unknown_use": lambda p, i: torch.tanh(F.embedding(i, p["e"])).sum((1, 2))
    * torch.cos(p["e"][i[:, 0], 1:]).sum(1),
    # rows read by indexing the table (NOTE [row gathers]): per-sample indices, negative ones,
    # a tuple index, index_select along the rows, and a lookup shared by the samples (a
    # relative position bias) that meets the batch later
    "row_gather": lambda p, i: torch.tanh(p["e"][i]).sum((1, 2)),
    "row_gather_negative": lambda p, i: (p["e"][i - V] * p["e"][i]).sum((1, 2)),
    "row_gather_tuple": lambda p, i: torch.sin(p["e"][i, ...]).sum((1, 2))
    + p["e"][i[:, :2], :].pow(2).sum((1, 2)),
    "index_select": lambda p, i: p["e"].index_select(0, i.reshape(-1)).reshape(i.shape[0], -1)
    .tanh().sum(1),
    "shared_row_gather": lambda p, i: (F.embedding(i, p["e"])
                                       + p["e"][torch.arange(T - 1, -1, -1)]).tanh().sum((1, 2)),
}


# scale_grad_by_freq scales gradients by counts within the evaluated batch, so its autograd
# "Jacobian" is not per-sample: it is only checked on dense rows.
GRID = [pytest.param(name, batch_dim, id=f"{name}-{'dense' if batch_dim is None else 'batch'}")
        for name in CASES for batch_dim in (None, 0)
        if not (name == "scale_grad_by_freq" and batch_dim == 0)]


@pytest.mark.parametrize(("name", "batch_dim"), GRID)
@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("diagonal", [False, True], ids=["full", "diag"])
def test_embedding_matches_oracle(check, name, way, batch_dim, diagonal):
    torch.manual_seed(0)
    params = {"e": torch.randn(V, D, dtype=torch.float64)}
    check(CASES[name], (params, _tokens()), force=way, batch_dim=batch_dim, diagonal=diagonal)


def test_embedding_plans(ways):
    params = {"e": torch.randn(V, D, dtype=torch.float64)}
    assert ways(CASES["tied_head"], (params, _tokens()), batch_dim=0) != ["fallback"]
    assert ways(CASES["scale_grad_by_freq"], (params, _tokens())) == ["fallback"]


def test_row_gathers_are_lookups_and_masks_are_not(ways):
    params = {"e": torch.randn(V, D, dtype=torch.float64)}
    for name in ("row_gather", "row_gather_negative", "row_gather_tuple", "index_select",
                 "shared_row_gather"):
        assert ways(CASES[name], (params, _tokens()), batch_dim=0) != ["fallback"], name
    masked = lambda p, i: p["e"][p["e"][:, 0] > 0].sum() * i.double().sum(1)  # noqa: E731
    column = lambda p, i: p["e"][:, i[:, 0]].sum(0)  # noqa: E731
    for f in (masked, column):
        assert ways(f, (params, _tokens()), batch_dim=0) == ["fallback"]


def test_embedding_rule_declines_options_it_cannot_express():
    rule = EmbeddingRule()
    weight, index = torch.randn(V, D), _tokens()
    assert rule.match(F.embedding, (index, weight), {"max_norm": 1.0}) is None
    assert rule.match(F.embedding, (index, weight), {"sparse": True}) is None
    assert rule.match(F.embedding, (index.double(), weight), {}) is None
    match = rule.match(F.embedding, (index, weight, -1), {})
    assert match is not None and match.operands[0].layout.padding_idx == V - 1


def test_large_vocabulary_prefers_ghost(ways):
    params = {"e": torch.randn(5000, 16, dtype=torch.float64)}
    tokens = torch.randint(0, 5000, (8, 3))
    f = lambda p, i: F.embedding(i, p["e"]).sum((1, 2))  # noqa: E731
    assert ways(f, (params, tokens), batch_dim=0) == ["ghost"]


SLICES = {
    # whole rows of a table sliced (NOTE [row gathers]): Whisper's weight[:T], minGPT's
    # pos_emb[:, :T, :] of a [1, block, d] parameter, narrow, a step
    "rows": lambda p, i: torch.tanh(F.embedding(i, p["e"]) + p["e"][:T]).sum((1, 2)),
    "rows_of_3d": lambda p, i: torch.tanh(F.embedding(i, p["e"]) + p["pos"][:, :T, :])
    .sum((1, 2)),
    "rows_of_3d_ellipsis": lambda p, i: (F.embedding(i, p["e"]) * p["pos"][0, 1:T + 1, ...])
    .sum((1, 2)),
    "narrow": lambda p, i: torch.sin(F.embedding(i, p["e"]) - p["e"].narrow(0, 1, T))
    .sum((1, 2)),
    "step": lambda p, i: torch.tanh(F.embedding(i[:, :3], p["e"]) + p["pos"][:, ::3]).sum((1, 2)),
    # and the table's other uses: the lookup of the tokens and a tied head
    "rows_and_head": lambda p, i: F.log_softmax(
        F.linear(torch.tanh(F.embedding(i, p["e"]) + p["e"][2:T + 2]), p["e"]), -1)[..., 0]
    .sum(1),
}


@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "batch"])
@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("name", list(SLICES))
def test_row_slices_match_oracle(check, name, way, batch_dim):
    torch.manual_seed(0)
    params = {"e": torch.randn(V, D, dtype=torch.float64),
              "pos": torch.randn(1, V, D, dtype=torch.float64)}
    check(SLICES[name], (params, _tokens()), force=way, batch_dim=batch_dim)


def test_row_slices_are_lookups_and_column_slices_are_not(ways):
    params = {"e": torch.randn(V, D, dtype=torch.float64),
              "pos": torch.randn(1, V, D, dtype=torch.float64)}
    for name in SLICES:
        assert "fallback" not in ways(SLICES[name], (params, _tokens()), batch_dim=0), name
    columns = lambda p, i: (F.embedding(i, p["e"])[..., :2] + p["e"][:T, :2]).sum((1, 2))  # noqa: E731
    assert ways(columns, (params, _tokens()), batch_dim=0)[0] == "fallback"
