"""``tg.autograd.record()`` under saved-tensor hooks (NOTE [saved-tensor hooks that rewrite]).

Hooks that change what the backward reads (activation compression, a scale) make torch's
gradients those of the stored values; a recorded layer's true activations do not match them.
Such layers are walked (the gramian and ``.grad`` are then torch's, as without ``record()``);
torch's own hooks that keep values (``save_on_cpu``, non-reentrant checkpointing) keep the
recorded ways. Before session 58 a ×2 pack hook gave a recorded ``G`` 0.73 off torch's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 -- torch's own spelling
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import torchgram as tg

DOUBLE = torch.float64


def _scaled() -> Any:
    return torch.autograd.graph.saved_tensors_hooks(
        lambda t: t * 2 if t.is_floating_point() else t, lambda t: t)


def _bf16() -> Any:
    def pack(t: Tensor) -> Any:
        return (t.dtype, t.to(torch.bfloat16)) if t.is_floating_point() else (None, t)

    def unpack(packed: Any) -> Tensor:
        dtype, t = packed
        return t if dtype is None else t.to(dtype)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


HOOKS: dict[str, tuple[Callable[[], Any], bool]] = {  # name: (context, recorded ways kept)
    "scale-x2": (_scaled, False),
    "bf16-compression": (_bf16, False),
    "save-on-cpu": (torch.autograd.graph.save_on_cpu, True),
    "none": (contextlib.nullcontext, True),
}


def _setup() -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(DOUBLE)
    return model, torch.randn(5, 6, dtype=DOUBLE), torch.randint(0, 3, (5,))


def _torch_gramian(model: nn.Module, losses: Tensor) -> Tensor:
    """``G`` of the Jacobian torch's own backward gives (through the hooks)."""
    params = list(model.parameters())
    jacobian = torch.stack([
        torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params, retain_graph=True)])
        for loss in losses])
    return jacobian @ jacobian.T


@pytest.mark.parametrize("batch_dim", [0, None], ids=["batch0", "dense"])
@pytest.mark.parametrize("hooks", HOOKS)
def test_recorded_gramian_and_grads_are_torchs(hooks: str, batch_dim: int | None) -> None:
    model, x, y = _setup()
    context, recorded = HOOKS[hooks]
    with tg.autograd.record(), context():
        losses = F.cross_entropy(model(x), y, reduction="none")
    expected = _torch_gramian(model, losses)
    named = list(model.named_parameters())
    report = tg.autograd.explain(losses, named, batch_dim=batch_dim)
    torch.testing.assert_close(report.gramian, expected, rtol=1e-10, atol=1e-12)
    walked = {row.name for row in report.inputs if row.way == "walk"}
    assert walked == (set() if recorded else {name for name, _ in named}), report
    weights = torch.linspace(0.5, 1.5, 5, dtype=DOUBLE)
    params = [p for _, p in named]
    expected_grads = torch.autograd.grad(losses, params, weights, retain_graph=True)
    tg.autograd.backward(losses, params, lambda G: weights, batch_dim=batch_dim)
    for param, grad in zip(params, expected_grads, strict=True):
        torch.testing.assert_close(param.grad, grad, rtol=1e-10, atol=1e-12)


def test_checkpointed_layers_stay_recorded() -> None:
    model, x, y = _setup()
    with tg.autograd.record():
        hidden = checkpoint(model[:2], x, use_reentrant=False)
        losses = F.cross_entropy(model[2](hidden), y, reduction="none")
    report = tg.autograd.explain(losses, list(model.named_parameters()), batch_dim=0)
    torch.testing.assert_close(report.gramian, _torch_gramian(model, losses), rtol=1e-10,
                               atol=1e-12)
    assert all(row.way != "walk" for row in report.inputs), report


def test_a_checkpoint_inside_hooks_that_rewrite_is_walked() -> None:
    """The checkpoint saves its region's inputs through the hooks below its own: recomputed
    from rewritten inputs (the review of session 58: recorded, G was 0.64 off torch's)."""
    model, x, y = _setup()
    with tg.autograd.record(), _scaled():
        hidden = checkpoint(model[:2], x, use_reentrant=False)
        losses = F.cross_entropy(model[2](hidden), y, reduction="none")
    report = tg.autograd.explain(losses, list(model.named_parameters()), batch_dim=0)
    torch.testing.assert_close(report.gramian, _torch_gramian(model, losses), rtol=1e-10,
                               atol=1e-12)
    assert all(row.way == "walk" for row in report.inputs), report
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # left as found
