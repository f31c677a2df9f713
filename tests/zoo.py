"""The zoo of small models every backend is checked on, against the dense oracle.

Each case is a pure function ``f(params, *inputs)`` with its parameters and inputs,
built in a given dtype, and the per-sample declaration (``batch_dim``, ``in_dims``) that
is *true* for it (``None`` where samples are coupled).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import optree
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import torchgram as tg

BATCH = 5


@dataclass
class Case:
    """One zoo entry."""

    name: str
    f: Callable[..., Any]
    params: Any
    inputs: tuple[Any, ...]
    batch_dim: int | None = 0
    in_dims: Any = 0
    module: nn.Module | None = None
    tags: set[str] = field(default_factory=set)

    @property
    def args(self) -> tuple[Any, ...]:
        """``(params, *inputs)``."""
        return (self.params, *self.inputs)


def _module_case(name: str, module: nn.Module, inputs: tuple[Any, ...], *,
                 head: Callable[..., Tensor] | None = None, **extra: Any) -> Case:
    fn, params = tg.functionalize(module)

    def f(p: Any, *xs: Any) -> Any:
        out = fn(p, *xs[:1])
        return out if head is None else head(out, *xs[1:])

    return Case(name, f, params, inputs, module=module, **extra)


def _cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits, labels, reduction="none")


def mlp() -> Case:
    model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 3))
    x, y = torch.randn(BATCH, 6), torch.randint(0, 3, (BATCH,))
    return _module_case("mlp", model, (x, y), head=_cross_entropy, tags={"losses"})


def mlp_logits() -> Case:
    model = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 3))
    return _module_case("mlp_logits", model, (torch.randn(BATCH, 4),), tags={"ntk"})


def cnn() -> Case:
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(4, 3),
    )
    x, y = torch.randn(BATCH, 2, 8, 8), torch.randint(0, 3, (BATCH,))
    return _module_case("cnn", model, (x, y), head=_cross_entropy, tags={"losses", "conv"})


def conv_variants() -> Case:
    class ConvVariants(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.grouped = nn.Conv2d(4, 4, 3, groups=2, dilation=2, stride=2, padding=1)
            self.conv1d = nn.Conv1d(4, 2, 2, stride=1, bias=False)
            self.conv3d = nn.Conv3d(1, 2, (1, 2, 2))
            self.head = nn.Linear(2 + 2, 2)

        def forward(self, x: Tensor) -> Tensor:
            h = torch.tanh(self.grouped(x))                        # [B, 4, 5, 5]
            a = self.conv1d(h.flatten(2)).mean(-1)                 # [B, 2]
            b = self.conv3d(h[:, None, :2]).mean((2, 3, 4))        # [B, 2]
            return self.head(torch.cat([a, b], dim=1))

    return _module_case("conv_variants", ConvVariants(), (torch.randn(BATCH, 4, 9, 9),),
                        tags={"ntk", "conv"})


def transformer() -> Case:
    layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=12, dropout=0.0,
                                       batch_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False))
    x = torch.randn(BATCH, 4, 8)
    return _module_case("transformer", model, (x,), head=lambda h: h.pow(2).mean((1, 2)),
                        tags={"losses", "attention"})


def embedding() -> Case:
    class Bag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(11, 4, padding_idx=0)
            self.head = nn.Linear(4, 3)

        def forward(self, tokens: Tensor) -> Tensor:
            return self.head(self.emb(tokens).mean(1))

    tokens = torch.randint(0, 11, (BATCH, 6))
    tokens[:, 0] = 0  # padding entries
    tokens[0, :3] = 3  # repeated token within a sample
    return _module_case("embedding", Bag(), (tokens,), tags={"ntk", "embedding"})


def positions() -> Case:
    """Token and learned position embeddings added as BERT and GPT-2 add them; the position
    lookup, shared by the samples, meets the batch twice (NOTE [shared taps])."""

    class Positions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(9, 4)
            self.pos = nn.Embedding(6, 4)
            self.proj = nn.Linear(4, 3)
            self.register_buffer("position_ids", torch.arange(6)[None], persistent=False)

        def forward(self, tokens: Tensor) -> Tensor:
            pos = self.pos(self.position_ids[:, :tokens.shape[1]])
            hidden = torch.tanh(self.tok(tokens) + pos)
            return self.proj(hidden + pos).mean(1)

    tokens = torch.randint(0, 9, (BATCH, 5))
    return _module_case("positions", Positions(), (tokens,), tags={"ntk", "embedding"})


def tied_lm() -> Case:
    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(9, 6)
            self.mix = nn.Linear(6, 6)
            self.out = nn.Linear(6, 9, bias=False)
            self.out.weight = self.emb.weight  # tied

        def forward(self, tokens: Tensor) -> Tensor:
            return self.out(torch.tanh(self.mix(self.emb(tokens))))

    tokens = torch.randint(0, 9, (BATCH, 4))

    def next_token_loss(logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(1)

    return _module_case("tied_lm", TinyLM(), (tokens, tokens.roll(-1, 1)), head=next_token_loss,
                        tags={"losses", "embedding", "tied"})


def reused_module() -> Case:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(5, 5)
            self.head = nn.Linear(5, 2)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.lin(torch.tanh(self.lin(x))))

    return _module_case("reused_module", Twice(), (torch.randn(BATCH, 5),), tags={"ntk"})


def frozen_norm() -> Case:
    class Normed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.frozen = nn.Linear(5, 6)
            self.frozen.requires_grad_(False)
            self.norm = nn.LayerNorm(6)
            self.conv = nn.Conv1d(1, 4, 3, padding=1)
            self.group_norm = nn.GroupNorm(2, 4)
            self.head = nn.Linear(24, 2)
            self.register_buffer("offset", torch.linspace(-1, 1, 6))

        def forward(self, x: Tensor) -> Tensor:
            h = self.norm(self.frozen(x) + self.offset)
            h = self.group_norm(self.conv(h[:, None]))
            return self.head(torch.relu(h).flatten(1))

    return _module_case("frozen_norm", Normed(), (torch.randn(BATCH, 5),), tags={"ntk", "norm"})


def elementwise() -> Case:
    params = {"scale": torch.randn(4), "shift": torch.randn(4), "w": torch.randn(4, 3)}

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        h = torch.sin(x * p["scale"] + p["shift"] ** 2)
        return F.linear(h, p["w"].T).sum(1) * p["scale"][0]

    return Case("elementwise", f, params, (torch.randn(BATCH, 4),), tags={"losses"})


def nested_pytree() -> Case:
    params = [
        {"w": torch.randn(3, 4), "b": torch.randn(4), "step": torch.tensor(7)},
        {"w": torch.randn(4, 2), "b": torch.randn(2), "name": "head", "gain": 0.5},
    ]

    def f(p: list[dict[str, Any]], x: Tensor) -> Tensor:
        h = torch.tanh(x @ p[0]["w"] + p[0]["b"])
        return (h @ p[1]["w"] + p[1]["b"]) * p[1]["gain"]

    return Case("nested_pytree", f, params, (torch.randn(BATCH, 3),), tags={"ntk"})


def raw_matmul() -> Case:
    params = (torch.randn(4, 6), torch.randn(6), torch.randn(3, 6))

    def f(p: tuple[Tensor, Tensor, Tensor], x: Tensor) -> Tensor:
        w1, b1, w2 = p
        h = torch.relu(x @ w1 + b1)
        ones = torch.ones(3, dtype=x.dtype, device=x.device)
        return torch.matmul(h, w2.T) @ ones + (w1.T @ x.T).sum(0)

    return Case("raw_matmul", f, params, (torch.randn(BATCH, 4),), tags={"losses"})


def batch_on_dim1() -> Case:
    model = nn.Sequential(nn.Linear(3, 5), nn.Softplus(), nn.Linear(5, 2))
    fn, params = tg.functionalize(model)

    def f(p: Any, x_t: Tensor) -> Tensor:  # x_t: [features, batch] -> out [outputs, batch]
        return fn(p, x_t.T).T

    return Case("batch_on_dim1", f, params, (torch.randn(3, BATCH),), batch_dim=1, in_dims=1,
                module=model, tags={"ntk"})


def attention() -> Case:
    class SelfAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(6, 2)  # [T, B, E] inside
            self.head = nn.Linear(6, 1)

        def forward(self, x: Tensor) -> Tensor:  # x: [B, T, E]
            seq_first = x.transpose(0, 1)
            h, _ = self.attn(seq_first, seq_first, seq_first, need_weights=False)
            return self.head(h.mean(0)).squeeze(-1)

    return _module_case("attention", SelfAttention(), (torch.randn(BATCH, 3, 6),),
                        tags={"losses", "attention"})


def pytree_output() -> Case:
    params = {"w": torch.randn(3, 2), "v": torch.randn(2)}

    def f(p: dict[str, Tensor], x: Tensor) -> dict[str, Tensor]:
        h = torch.tanh(x @ p["w"])
        return {"score": h @ p["v"], "hidden": h}

    return Case("pytree_output", f, params, (torch.randn(BATCH, 3),), tags={"pytree_out"})


def coupled_batch() -> Case:
    """Samples interact (batch statistics), so no per-sample declaration is true."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 1))
    fn, params = tg.functionalize(model)
    return Case("coupled_batch", lambda p, x: fn(p, x).squeeze(-1), params,
                (torch.randn(BATCH, 3),), batch_dim=None, module=model, tags={"losses"})


BUILDERS: dict[str, Callable[[], Case]] = {
    builder.__name__: builder
    for builder in (mlp, mlp_logits, cnn, conv_variants, transformer, embedding, positions,
                    tied_lm, reused_module, frozen_norm, elementwise, nested_pytree, raw_matmul,
                    batch_on_dim1, attention, pytree_output, coupled_batch)
}
NAMES = tuple(BUILDERS)


def build(name: str, dtype: torch.dtype = torch.float64, seed: int = 0,
          device: torch.device | str | None = None) -> Case:
    """Build zoo case ``name`` with floating parameters and inputs in ``dtype``, on ``device``
    (default: where torch creates tensors; the same values on every device)."""
    torch.manual_seed(seed)
    case = BUILDERS[name]()
    assert case.name == name
    if case.module is not None:
        case.module.to(device=device, dtype=dtype)
        _, case.params = tg.functionalize(case.module)

    def cast(leaf: Any) -> Any:
        if isinstance(leaf, Tensor):
            return leaf.to(device=device, dtype=dtype if leaf.is_floating_point() else None)
        return leaf

    case.params = optree.tree_map(cast, case.params)
    case.inputs = optree.tree_map(cast, case.inputs)
    return case
