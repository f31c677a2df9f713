"""Sample layouts of the recorded eager path: broadcast parameters, merged samples, shared taps.

Each case is a small eager forward recorded with ``tg.autograd.record()``; its Gramian with
``batch_dim=0`` is compared with the dense float64 oracle of the same function written
purely, and ``explain`` must say what ran: every input read per sample from a recorded
call (no walk, not the rows of the whole batch), or, where the samples interact or a shared
output is used twice, the exact fallback it names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import torchgram as tg
from reference import dense_gramian
from torchgram._core.signature import clear_caches

DOUBLE = torch.float64
B, T, D, VOCAB = 4, 5, 3, 7


def params() -> dict[str, Tensor]:
    torch.manual_seed(0)
    return {"tok": torch.randn(VOCAB, D, dtype=DOUBLE), "pos": torch.randn(T, D, dtype=DOUBLE),
            "w": torch.randn(D, D, dtype=DOUBLE), "b": torch.randn(D, dtype=DOUBLE),
            "scale": torch.randn(D, dtype=DOUBLE), "cls": torch.randn(1, 1, D, dtype=DOUBLE),
            "pos_param": torch.randn(1, T + 1, D, dtype=DOUBLE)}


IDS = torch.randint(0, VOCAB, (B, T))
POSITIONS = torch.arange(T)[None]  # [1, T]: one buffer for every sample
QUERY = torch.randn(1, 1, D, dtype=DOUBLE)


def head(h: Tensor, p: dict[str, Tensor]) -> Tensor:
    """Per-sample losses from ``[B, T, D]`` hidden states: a linear layer, tanh, a sum."""
    return torch.tanh(F.linear(h, p["w"], p["b"])).pow(2).sum((1, 2))


Model = Callable[[dict[str, Tensor]], Tensor]


def shared_add(p: dict[str, Tensor]) -> Tensor:
    return head(F.embedding(IDS, p["tok"]) + F.embedding(POSITIONS, p["pos"]), p)


def shared_radd_to(p: dict[str, Tensor]) -> Tensor:  # y on the left, .to() in between
    pos = F.embedding(POSITIONS, p["pos"])
    return head(pos.to(pos.device) + F.embedding(IDS, p["tok"]), p)


def shared_sub_alpha(p: dict[str, Tensor]) -> Tensor:
    return head(torch.sub(F.embedding(IDS, p["tok"]), F.embedding(POSITIONS, p["pos"]),
                          alpha=0.5), p)


def shared_rsub(p: dict[str, Tensor]) -> Tensor:
    return head(torch.rsub(F.embedding(POSITIONS, p["pos"]), F.embedding(IDS, p["tok"]),
                           alpha=2.0), p)


def shared_inplace(p: dict[str, Tensor]) -> Tensor:  # BERT: embeddings += position_embeddings
    h = F.embedding(IDS, p["tok"])
    h += F.embedding(POSITIONS, p["pos"])
    return head(h, p)


def shared_fewer_dims(p: dict[str, Tensor]) -> Tensor:  # [T, D] + [B, T, D]
    return head(F.embedding(IDS, p["tok"]) + F.embedding(torch.arange(T), p["pos"]), p)


def shared_linear_expand(p: dict[str, Tensor]) -> Tensor:  # a learned query, expanded
    query = F.linear(QUERY, p["w"], p["b"])  # [1, 1, D]: its weight's use is shared
    h = torch.cat([query.expand(B, 1, D), F.embedding(IDS, p["tok"])], dim=1)
    return torch.tanh(h).pow(2).sum((1, 2))


def shared_mul(p: dict[str, Tensor]) -> Tensor:  # position-wise scales
    return head(F.embedding(IDS, p["tok"]) * F.embedding(POSITIONS, p["pos"]), p)


def shared_rmul_over_positions(p: dict[str, Tensor]) -> Tensor:  # y [1, 1, D] ⊙ x [B, T, D]
    return head(F.linear(QUERY, p["w"], p["b"]).__rmul__(F.embedding(IDS, p["tok"])), p)


def shared_merged(p: dict[str, Tensor]) -> Tensor:  # GPT-2's Conv1D: rows [B·T, D]
    h = F.embedding(IDS, p["tok"]) + F.embedding(POSITIONS, p["pos"])
    flat = torch.addmm(p["b"], h.view(-1, D), p["w"])
    return torch.tanh(flat.view(B, T, D)).pow(2).sum((1, 2))


def broadcast_params(p: dict[str, Tensor]) -> Tensor:  # LLaMA's RMSNorm, ViT's embeddings
    h = F.embedding(IDS, p["tok"])
    h = torch.cat([p["cls"].expand(B, -1, -1), h], dim=1) + p["pos_param"]
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return head(p["scale"] * h, p)


def broadcast_merged(p: dict[str, Tensor]) -> Tensor:  # x ⊙ w on [B·T, D], bias on [B·T, D]
    h = F.embedding(IDS, p["tok"]).view(-1, D)
    h = torch.tanh(h * p["scale"] + p["b"])
    return h.view(B, T, D).pow(2).sum((1, 2))


PER_SAMPLE: dict[str, Model] = {
    "shared-add": shared_add, "shared-radd-to": shared_radd_to,
    "shared-sub-alpha": shared_sub_alpha, "shared-rsub": shared_rsub,
    "shared-inplace": shared_inplace, "shared-fewer-dims": shared_fewer_dims,
    "shared-linear-expand": shared_linear_expand, "shared-merged": shared_merged,
    "shared-mul": shared_mul, "shared-rmul-over-positions": shared_rmul_over_positions,
    "broadcast-params": broadcast_params, "broadcast-merged": broadcast_merged,
}


def used(model: Model) -> dict[str, Tensor]:
    """The parameters the model uses (a recorded forward finds them)."""
    p = {k: v.clone().requires_grad_() for k, v in params().items()}
    out = model(p)
    grads = torch.autograd.grad(out.sum(), list(p.values()), allow_unused=True)
    return {k: v.detach() for (k, v), g in zip(p.items(), grads, strict=True) if g is not None}


def run(model: Model) -> tuple[tg.autograd.EagerExplanation, Tensor]:
    plain = used(model)
    expected = dense_gramian(lambda q: model({**params(), **q}), (plain,)).shaped()
    leaves = {k: v.clone().requires_grad_() for k, v in plain.items()}
    with tg.autograd.record():
        out = model({**params(), **leaves})
    return tg.autograd.explain(out, leaves, batch_dim=0), expected


def assert_close(actual: Tensor | tuple[Tensor, ...], expected: Tensor,
                 tol: float = 1e-10) -> None:
    assert isinstance(actual, Tensor)
    scale = expected.abs().max().clamp_min(1e-30)
    error = float((actual.detach() - expected).abs().max() / scale)
    assert error <= tol, error


@pytest.mark.parametrize("name", PER_SAMPLE)
def test_read_per_sample(name: str) -> None:
    report, expected = run(PER_SAMPLE[name])
    assert_close(report.gramian, expected)
    assert report.walked == (), [(i.name, i.why) for i in report.inputs if i.way == "walk"]
    assert report.ran.way == "recorded taps (engine pass)", report.ran.notes
    assert any("shared by the samples" in note for note in report.ran.notes) \
        == name.startswith("shared")


def shared_used_twice(p: dict[str, Tensor]) -> Tensor:  # y has two consumers: not one meeting
    pos = F.embedding(POSITIONS, p["pos"])
    return head(F.embedding(IDS, p["tok"]) + pos, p) + pos.pow(2).sum()


def shared_from_the_batch(p: dict[str, Tensor]) -> Tensor:  # samples interact through y
    h = F.embedding(IDS, p["tok"])
    shared = F.linear(h.mean(0, keepdim=True), p["w"])  # [1, T, D], from every sample
    return head(h + shared, p)


def shared_then_mixed(p: dict[str, Tensor]) -> Tensor:  # they interact after the meeting
    h = F.embedding(IDS, p["tok"]) + F.embedding(POSITIONS, p["pos"])
    return head(h - h.mean(0), p)


def test_shared_output_used_twice_is_walked_exactly() -> None:
    report, expected = run(shared_used_twice)
    assert_close(report.gramian, expected)
    assert report.walked == ("pos",)
    assert "no dimension of its shape holds the samples" in report.inputs[1].why


def test_samples_interacting_through_a_shared_tap_give_the_coupled_gramian() -> None:
    for model in (shared_from_the_batch, shared_then_mixed):
        report, expected = run(model)
        assert_close(report.gramian, expected)
        assert report.ran.way.endswith("rows of the whole batch"), report.ran.notes


def test_a_training_loop_probes_its_first_step_only() -> None:
    clear_caches()
    notes = []
    for _ in range(2):
        report, expected = run(shared_merged)
        assert_close(report.gramian, expected)
        notes.append(" ".join(report.ran.notes))
    assert "probed samples" in notes[0]
    assert "probed samples" not in notes[1]
    assert "shared by the samples" in notes[1]


@pytest.mark.parametrize("name", ["shared-add", "shared-linear-expand", "shared-mul",
                                  "broadcast-params"])
def test_backward_is_the_weighted_gradient(name: str) -> None:
    """``tg.autograd.backward`` from the shared and broadcast taps' factors: ``Σ w_i ∇out_i``."""
    model = PER_SAMPLE[name]
    leaves = {k: v.clone().requires_grad_() for k, v in used(model).items()}
    with tg.autograd.record():
        out = model({**params(), **leaves})
    w, info = tg.autograd.backward(out, list(leaves.values()), tg.weighting.upgrad,
                                   batch_dim=0, retain_graph=True, with_info=True)
    assert info.report is not None and info.report.way == "recorded taps (engine pass)"
    expected = torch.autograd.grad(out, list(leaves.values()), w)
    for leaf, grad in zip(leaves.values(), expected, strict=True):
        assert leaf.grad is not None
        assert_close(leaf.grad, grad)


@pytest.mark.parametrize("options", [{"chunk_size": 1}, {"diagonal": True}, {"hook": True}],
                         ids=["chunk1", "diagonal", "walked-pass"])
def test_shared_taps_in_every_pass(options: dict[str, Any]) -> None:
    """One row direction a pass, the diagonal, and the walked pass (a hook in the block)."""
    model = shared_merged
    plain = used(model)
    expected = dense_gramian(lambda q: model({**params(), **q}), (plain,)).shaped()
    leaves = {k: v.clone().requires_grad_() for k, v in plain.items()}
    with tg.autograd.record():
        out = model({**params(), **leaves})
        if options.get("hook"):
            out.register_hook(lambda grad: grad)
    diagonal = bool(options.get("diagonal"))
    report = tg.autograd.explain(out, leaves, batch_dim=0, diagonal=diagonal,
                                 chunk_size=options.get("chunk_size"))
    assert_close(report.gramian, expected.diagonal() if diagonal else expected)
    assert report.walked == ()
    assert any("shared by the samples" in note for note in report.ran.notes)
    assert report.ran.way == "recorded taps (" + ("walked" if options.get("hook")
                                                   else "engine") + " pass)"
