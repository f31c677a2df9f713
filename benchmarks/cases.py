"""The benchmark models: one ``nn.Module`` each, with inputs and the rows to take the Gramian of.

Every case is built deterministically (``torch.manual_seed(0)``) so that separate processes
measuring separate methods see the same parameters and inputs, and their Gramians can be
compared entry by entry.

A case's *rows* are the output whose Jacobian's Gramian every method computes:
``rows(model, *inputs)`` runs the model (any callable with the module's signature) and
returns per-sample losses ``[B]``, logits ``[B, 10]`` (NTK) or task losses ``[5]``.
The same ``rows`` drives the module path (plain backward, torchjd, opacus) and the
functional path (torchgram, torch.func), through :attr:`Case.f`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import torchgram as tg

Rows = Callable[..., Tensor]


@dataclass
class Case:
    """One benchmark case.

    Attributes:
        name: Short id used on the command line and in the table.
        title: One line saying what the case is (model, sizes, rows).
        module: The model; every trainable parameter is differentiated.
        inputs: The positional inputs after the parameters (all batched along dim 0 when
            ``batch_dim`` is set).
        rows: ``rows(model, *inputs) -> Tensor``: the output whose Gramian is computed.
        batch_dim: ``0`` when row ``b`` (of dim 0) depends on sample ``b`` only, else ``None``.
        diagonal: Whether the case asks for ``diag(G)`` only (per-sample squared norms).
        classifier: Whether ``rows`` is ``cross_entropy(model(x), y, reduction="none")`` for
            ``inputs == (x, y)`` (what opacus needs).
    """

    name: str
    title: str
    module: nn.Module
    inputs: tuple[Tensor, ...]
    rows: Rows
    batch_dim: int | None = 0
    diagonal: bool = False
    classifier: bool = False

    def __post_init__(self) -> None:
        self._fn, self.params = tg.functionalize(self.module)

    def f(self, params: dict[str, Tensor], *inputs: Tensor) -> Tensor:
        """The pure function ``f(params, *inputs) -> rows`` given to torchgram and torch.func."""
        return self.rows(lambda *args, **kwargs: self._fn(params, *args, **kwargs), *inputs)

    @property
    def num_params(self) -> int:
        """``P``: the number of differentiated scalars."""
        return sum(p.numel() for p in self.params.values())

    @property
    def num_rows(self) -> int:
        """``m``: the number of Jacobian rows."""
        with torch.no_grad():
            return self.rows(self.module, *self.inputs).numel()


@dataclass(frozen=True)
class Sizes:
    """The knobs of every case; :data:`FULL` is the reported configuration."""

    mlp_batch: int = 64
    mlp_widths: tuple[int, ...] = (784, 512, 512, 10)
    cnn_batch: int = 64
    cnn_image: int = 32
    cnn_channels: tuple[int, int] = (16, 32)
    cnn_hidden: int = 128
    tf_batch: int = 32
    tf_len: int = 64
    tf_dim: int = 128
    tf_heads: int = 4
    tf_vocab: int = 1000
    ntk_batch: int = 16
    mt_batch: int = 64
    mt_tasks: int = 5
    mt_widths: tuple[int, ...] = (784, 256, 256)
    lm_batch: int = 16
    lm_len: int = 32
    lm_dim: int = 64
    lm_vocab: int = 1000


FULL = Sizes()
QUICK = Sizes(
    mlp_batch=4, mlp_widths=(20, 16, 16, 10), cnn_batch=3, cnn_image=8, cnn_channels=(4, 6),
    cnn_hidden=12, tf_batch=3, tf_len=5, tf_dim=16, tf_heads=2, tf_vocab=30, ntk_batch=3,
    mt_batch=4, mt_tasks=3, mt_widths=(20, 12, 12), lm_batch=3, lm_len=6, lm_dim=16,
    lm_vocab=40,
)


def _per_sample_ce(model: Callable[..., Tensor], x: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(model(x), y, reduction="none")


def _logits(model: Callable[..., Tensor], x: Tensor) -> Tensor:
    return model(x)


def _mlp(widths: tuple[int, ...]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (d_in, d_out) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        layers.append(nn.Linear(d_in, d_out))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _cnn(s: Sizes) -> nn.Sequential:
    c1, c2 = s.cnn_channels
    side = s.cnn_image // 4
    return nn.Sequential(
        nn.Conv2d(3, c1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(c2 * side * side, s.cnn_hidden), nn.ReLU(),
        nn.Linear(s.cnn_hidden, 10),
    )


class _Encoder(nn.Module):
    """Token + position embeddings, a 2-layer post-norm encoder, mean pooling, a linear head."""

    def __init__(self, s: Sizes) -> None:
        super().__init__()
        self.tokens = nn.Embedding(s.tf_vocab, s.tf_dim)
        self.positions = nn.Embedding(s.tf_len, s.tf_dim)
        layer = nn.TransformerEncoderLayer(s.tf_dim, s.tf_heads, dim_feedforward=4 * s.tf_dim,
                                           dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(s.tf_dim, 10)

    def forward(self, tokens: Tensor) -> Tensor:
        B, T = tokens.shape
        positions = torch.arange(T, device=tokens.device).expand(B, T)
        h = self.encoder(self.tokens(tokens) + self.positions(positions))
        return self.head(h.mean(dim=1))


class _MultiTask(nn.Module):
    """A shared MLP trunk and one linear head per task; returns ``[tasks, B, 10]`` logits."""

    def __init__(self, s: Sizes) -> None:
        super().__init__()
        self.trunk = nn.Sequential(_mlp(s.mt_widths), nn.ReLU())
        self.heads = nn.ModuleList(nn.Linear(s.mt_widths[-1], 10) for _ in range(s.mt_tasks))

    def forward(self, x: Tensor) -> Tensor:
        h = self.trunk(x)
        return torch.stack([head(h) for head in self.heads])


def _task_losses(model: Callable[..., Tensor], x: Tensor, y: Tensor) -> Tensor:
    logits = model(x)  # [tasks, B, 10]; y: [B, tasks]
    return torch.stack([F.cross_entropy(logits[t], y[:, t]) for t in range(logits.shape[0])])


class _CausalSelfAttention(nn.Module):
    """Causal multi-head self-attention with separate ``nn.Linear`` projections."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, h: Tensor) -> Tensor:
        B, T, d = h.shape

        def split(t: Tensor) -> Tensor:
            return t.reshape(B, T, self.heads, d // self.heads).transpose(1, 2)

        a = F.scaled_dot_product_attention(split(self.q(h)), split(self.k(h)), split(self.v(h)),
                                           is_causal=True)
        return self.o(a.transpose(1, 2).reshape(B, T, d))


class _TiedLM(nn.Module):
    """A one-block pre-norm causal LM whose output projection is the token embedding matrix.

    Every module takes batch-first inputs (position ids are expanded over the batch) and no
    mask tensor is passed around (``is_causal``), so that hook-based peers apply.
    """

    def __init__(self, s: Sizes) -> None:
        super().__init__()
        d = s.lm_dim
        self.embed = nn.Embedding(s.lm_vocab, d)
        self.positions = nn.Embedding(s.lm_len, d)
        self.norm1, self.norm2, self.norm_out = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.attention = _CausalSelfAttention(d, 4)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.unembed = nn.Linear(d, s.lm_vocab, bias=False)
        self.unembed.weight = self.embed.weight  # tied

    def forward(self, tokens: Tensor) -> Tensor:
        B, T = tokens.shape
        positions = torch.arange(T, device=tokens.device).expand(B, T)
        h = self.embed(tokens) + self.positions(positions)
        h = h + self.attention(self.norm1(h))
        h = h + self.mlp(self.norm2(h))
        return self.unembed(self.norm_out(h))


def _next_token_losses(model: Callable[..., Tensor], tokens: Tensor) -> Tensor:
    logits = model(tokens)[:, :-1]  # [B, T-1, V]
    per_token = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
    return per_token.mean(dim=1)  # one loss per sequence


def _images(s: Sizes, batch: int) -> Tensor:
    return torch.randn(batch, 3, s.cnn_image, s.cnn_image)


def _build_mlp(s: Sizes, *, diagonal: bool = False) -> Case:
    x = torch.randn(s.mlp_batch, s.mlp_widths[0])
    y = torch.randint(0, s.mlp_widths[-1], (s.mlp_batch,))
    widths = "-".join(map(str, s.mlp_widths))
    what = "per-sample squared gradient norms" if diagonal else "per-sample CE losses"
    return Case("mlp-norms" if diagonal else "mlp",
                f"MLP {widths}, batch {s.mlp_batch}, {what}", _mlp(s.mlp_widths), (x, y),
                _per_sample_ce, diagonal=diagonal, classifier=True)


def _build_cnn(s: Sizes, *, diagonal: bool = False) -> Case:
    x, y = _images(s, s.cnn_batch), torch.randint(0, 10, (s.cnn_batch,))
    what = "per-sample squared gradient norms" if diagonal else "per-sample CE losses"
    return Case("cnn-norms" if diagonal else "cnn",
                f"CNN 2×conv3x3 {s.cnn_channels} + MLP on 3×{s.cnn_image}×{s.cnn_image}, batch "
                f"{s.cnn_batch}, {what}", _cnn(s), (x, y), _per_sample_ce, diagonal=diagonal,
                classifier=True)


def _build_transformer(s: Sizes) -> Case:
    tokens = torch.randint(0, s.tf_vocab, (s.tf_batch, s.tf_len))
    y = torch.randint(0, 10, (s.tf_batch,))
    return Case("transformer",
                f"2-layer transformer encoder d={s.tf_dim}, {s.tf_heads} heads, T={s.tf_len}, "
                f"vocab {s.tf_vocab}, batch {s.tf_batch}, per-sample CE losses",
                _Encoder(s), (tokens, y), _per_sample_ce, classifier=True)


def _build_ntk_mlp(s: Sizes) -> Case:
    widths = "-".join(map(str, s.mlp_widths))
    x = torch.randn(s.ntk_batch, s.mlp_widths[0])
    return Case("ntk-mlp", f"NTK of MLP {widths}: logits [{s.ntk_batch}, {s.mlp_widths[-1]}]",
                _mlp(s.mlp_widths), (x,), _logits)


def _build_ntk_cnn(s: Sizes) -> Case:
    return Case("ntk-cnn", f"NTK of the CNN: logits [{s.ntk_batch}, 10]", _cnn(s),
                (_images(s, s.ntk_batch),), _logits)


def _build_multitask(s: Sizes) -> Case:
    x = torch.randn(s.mt_batch, s.mt_widths[0])
    y = torch.randint(0, 10, (s.mt_batch, s.mt_tasks))
    widths = "-".join(map(str, s.mt_widths))
    return Case("multitask",
                f"{s.mt_tasks} task losses (mean CE) of a shared MLP {widths} trunk + "
                f"{s.mt_tasks} linear heads on one batch of {s.mt_batch}; no batch structure",
                _MultiTask(s), (x, y), _task_losses, batch_dim=None)


def _build_tied_lm(s: Sizes) -> Case:
    tokens = torch.randint(0, s.lm_vocab, (s.lm_batch, s.lm_len))
    return Case("tied-lm",
                f"causal LM, embedding tied to the output projection (vocab {s.lm_vocab}, "
                f"d={s.lm_dim}, 1 pre-norm block, 4 heads), T={s.lm_len}, batch {s.lm_batch}, "
                "per-sequence next-token loss", _TiedLM(s), (tokens,), _next_token_losses)


BUILDERS: dict[str, Callable[[Sizes], Case]] = {
    "mlp": _build_mlp,
    "cnn": _build_cnn,
    "transformer": _build_transformer,
    "ntk-mlp": _build_ntk_mlp,
    "ntk-cnn": _build_ntk_cnn,
    "multitask": _build_multitask,
    "tied-lm": _build_tied_lm,
    "mlp-norms": lambda s: _build_mlp(s, diagonal=True),
    "cnn-norms": lambda s: _build_cnn(s, diagonal=True),
}
NAMES: tuple[str, ...] = tuple(BUILDERS)


def build(name: str, sizes: Sizes = FULL) -> Case:
    """Build case ``name`` deterministically (same parameters and inputs in every process)."""
    if name not in BUILDERS:
        raise ValueError(f"benchmarks: expected a case in {list(NAMES)}, but got {name!r}.")
    torch.manual_seed(0)
    case = BUILDERS[name](sizes)
    case.module.train()  # dropout is 0 everywhere; train mode keeps the eager (non-fused) path
    return case


def describe(case: Case) -> dict[str, Any]:
    """Shapes worth printing above the case's table."""
    return {"title": case.title, "rows": case.num_rows, "params": case.num_params,
            "batch_dim": case.batch_dim, "diagonal": case.diagonal,
            "params_str": _human(case.num_params)}


def _human(n: int) -> str:
    if n < 1000:
        return str(n)
    exponent = min(int(math.log10(n) // 3), 2)
    return f"{n / 1000 ** exponent:.{0 if n >= 100 * 1000 ** exponent else 1}f}{' kM'[exponent]}"
