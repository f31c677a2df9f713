"""Minimal repros of the silent wrong answers of issue 9, one case each (float64, ``B = 3``).

1. ``tied-padding-idx`` / ``tied-scale-grad-by-freq`` — ``ntvp`` with an embedding whose
   ``padding_idx`` row (or ``scale_grad_by_freq`` table) is also used elsewhere, here a tied LM
   head. Autograd's backward of ``embedding`` zeroes the padding row's gradient (or divides
   by token counts); its forward-mode derivative does not, so ``J (Jᵀ e)`` mixes two
   different Jacobians.
2. ``padding-idx-fallback`` — ``structured``/``auto`` with ``batch_dim`` and an
   ``nn.Embedding(padding_idx=0)`` whose table is also used outside the embedding rule (here
   centred by its mean), so its block comes from the per-sample ``vmap`` fallback, where
   torch's batching rule of the embedding backward zeroes the padding row for sample 0 only.
3. ``keyword-mask`` — a tensor passed **by keyword** (a padding mask) with ``batch_dim``: it
   must be split per sample like a positional input. The function reads the mask rows by
   batch position, as ``transformers``' mask helpers do (``padding_mask[batch_idx, kv_idx]``
   with ``batch_idx = arange(batch_size)``), so an unsplit mask gives every sample the mask
   of sample 0.
4. ``centered-batch`` — ``x - x.mean(0)`` couples the samples; with ``batch_dim`` the answer
   must be the coupled Gramian (what ``batch_dim=None`` gives) or a torchgram error.
5. ``mixed-precision-*`` — float32 and float64 leaves in one call (``graph`` was 6e-3 off in
   some layouts). The float32 branch is kept small, so that G stays float64-accurate and is
   compared at the float64 tolerance: a float64 block computed or summed in float32 shows.
   ``f32-output`` has a float32 output, compared at float32 accuracy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.case import ModelCase, module_case

BATCH, TOKENS, VOCAB, WIDTH = 3, 4, 7, 4


def _tokens() -> Tensor:
    """``[B, T]`` tokens: padding (0) in every sample, a token repeated in and across samples."""
    tokens = torch.randint(1, VOCAB, (BATCH, TOKENS))
    tokens[:, -1] = 0
    tokens[0, :2] = 3
    tokens[2, 0] = 3
    return tokens


class TiedLM(nn.Module):
    """Embedding → tanh(linear) → head whose weight *is* the embedding table."""

    def __init__(self, **embedding_options: Any) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH, **embedding_options)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mix(self.emb(tokens))))


def next_token_losses(logits: Tensor, targets: Tensor) -> Tensor:
    """Per-sample mean cross-entropy ``[B]`` of ``[B, T, V]`` logits."""
    return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(1)


def _tied(name: str, note: str, **embedding_options: Any) -> ModelCase:
    model = TiedLM(**embedding_options).to(torch.float64)
    tokens = _tokens()
    return module_case(name, model, (tokens, tokens.roll(-1, 1)), head=next_token_losses,
                       output_shape=(BATCH,), note=note)


def tied_padding_idx() -> ModelCase:
    return _tied("tied-padding-idx", "tied LM head + nn.Embedding(padding_idx=0)", padding_idx=0)


def tied_scale_grad_by_freq() -> ModelCase:
    return _tied("tied-scale-grad-by-freq", "tied LM head + nn.Embedding(scale_grad_by_freq)",
                 scale_grad_by_freq=True)


class CenteredBag(nn.Module):
    """Mean of centred embeddings (the table minus its mean row), then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH, padding_idx=0)
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, tokens: Tensor) -> Tensor:
        centred = self.emb(tokens) - self.emb.weight.mean(0)  # a use no rule covers
        return self.head(torch.tanh(centred).mean(1))


def padding_idx_fallback() -> ModelCase:
    model = CenteredBag().to(torch.float64)
    return module_case("padding-idx-fallback", model, (_tokens(),), output_shape=(BATCH, 2),
                       note="nn.Embedding(padding_idx=0) on the per-sample fallback")


def keyword_mask() -> ModelCase:
    params = {"w": torch.randn(3, WIDTH, dtype=torch.float64),
              "v": torch.randn(WIDTH, dtype=torch.float64)}
    x = torch.randn(BATCH, TOKENS, 3, dtype=torch.float64)
    mask = torch.ones(BATCH, TOKENS, dtype=torch.long)
    mask[1, 2:] = 0
    mask[2, 1:] = 0

    def f(p: dict[str, Tensor], x: Tensor, *, mask: Tensor) -> Tensor:
        rows = mask[torch.arange(x.shape[0])]  # by batch position, like transformers' masks
        weights = rows.to(x.dtype)[..., None]
        pooled = (torch.tanh(x @ p["w"]) * weights).sum(1) / weights.sum(1)
        return pooled @ p["v"]

    return ModelCase("keyword-mask", f, params, (x,), {"mask": mask}, output_shape=(BATCH,),
                     note="padding mask passed by keyword, read by batch position")


def centered_batch() -> ModelCase:
    params = {"w": torch.randn(3, WIDTH, dtype=torch.float64),
              "v": torch.randn(WIDTH, dtype=torch.float64)}

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return torch.tanh((x - x.mean(0)) @ p["w"]) @ p["v"]

    return ModelCase("centered-batch", f, params, (torch.randn(BATCH, 3, dtype=torch.float64),),
                     output_shape=(BATCH,), coupled=True, note="x - x.mean(0): coupled samples")


MIXED_RTOL = 1e-5
"""For a float32 output: the oracle itself is then only float32-accurate."""


def mixed_precision(layout: str) -> ModelCase:
    """float32 and float64 leaves in one call.

    ``f32-first`` / ``f64-first``: a float64 output dominated by a float64 branch, plus a
    float32 branch scaled by 1e-3, whose block (1e-6 of G, float32-accurate) changes G by
    less than 1e-13: G must be float64-accurate, so the default tolerance holds. The two
    layouts differ only in which leaves come first in the sorted parameter dict.
    ``f32-output``: a float64 layer cast to float32 before a float32 head; G is float32.
    """
    w64, v64 = torch.randn(3, WIDTH, dtype=torch.float64), torch.randn(WIDTH, dtype=torch.float64)
    w32, v32 = torch.randn(3, WIDTH), torch.randn(WIDTH)
    x = torch.randn(BATCH, 3, dtype=torch.float64)
    if layout == "f32-output":
        def f_out32(p: dict[str, Tensor], x: Tensor) -> Tensor:
            return torch.tanh(x @ p["w"]).float() @ p["v"]

        return ModelCase(f"mixed-precision-{layout}", f_out32, {"w": w64, "v": v32}, (x,),
                         output_shape=(BATCH,), rtol=MIXED_RTOL,
                         note="float64 layer, cast, float32 head: float32 output")
    small, large = ("a", "b") if layout == "f32-first" else ("b", "a")

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        dominant = torch.tanh(x @ p[large + "_w"]) @ p[large + "_v"]
        minor = torch.tanh(x.float() @ p[small + "_w"]) @ p[small + "_v"]
        return dominant + 1e-3 * minor.double()

    params = {large + "_w": w64, large + "_v": v64, small + "_w": w32, small + "_v": v32}
    return ModelCase(f"mixed-precision-{layout}", f, params, (x,), output_shape=(BATCH,),
                     note=f"float64 branch + 1e-3 x float32 branch, {layout} in the dict")


BUILDERS: dict[str, Callable[[], ModelCase]] = {
    "tied-padding-idx": tied_padding_idx,
    "tied-scale-grad-by-freq": tied_scale_grad_by_freq,
    "padding-idx-fallback": padding_idx_fallback,
    "keyword-mask": keyword_mask,
    "centered-batch": centered_batch,
    "mixed-precision-f32-first": lambda: mixed_precision("f32-first"),
    "mixed-precision-f64-first": lambda: mixed_precision("f64-first"),
    "mixed-precision-f32-output": lambda: mixed_precision("f32-output"),
}
