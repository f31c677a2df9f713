"""The real models of ``real_models.py``: ``transformers`` models from configs, vision and RNNs.

Every case is built deterministically (``torch.manual_seed(0)``), in float32, from small
configurations (no downloads, no torchvision: ResNet-18 and MobileNetV3-small are written
here, with the layer lists of the papers / torchvision). A case's rows are per-sample losses
``[B]``; ``rows(model, *inputs, **kw)`` runs the module (plain backward, torchjd) and
``f(params, *inputs, **kw)`` is the same through ``tg.functionalize`` (torchgram, torch.func).

* ``gpt2``: ``GPT2LMHeadModel``, 2 layers, d=128, 4 heads, tied embeddings; right-padded tokens
  with an attention mask, LM loss;
* ``llama``: ``LlamaForCausalLM``, 2 layers, d=128, 4/2 heads (GQA), RMSNorm, rotary; as gpt2;
* ``bert``: ``BertForSequenceClassification``, 2 layers, d=128, 4 heads; padded tokens with an
  attention mask, cross-entropy;
* ``vit``: ``ViTForImageClassification``, 2 layers, d=128, 4 heads, 24×24 images in 4×4
  patches (37 tokens);
* ``swin``: ``SwinForImageClassification``, two stages of 2 blocks (d=64 then 128, 2 then 4
  heads), 4×4 windows with shifts and a relative position bias, 32×32 images in 2×2 patches;
* ``nanogpt``: a nanoGPT-style decoder written here (token + ``[T, d]`` position embeddings of
  ``arange(T)``, 2 pre-norm blocks with a fused qkv projection and causal
  ``scaled_dot_product_attention``, tied head), d=128, 4 heads, LM loss;
* ``resnet18``: ResNet-18 (BasicBlock ×[2, 2, 2, 2], CIFAR stem), widths 16-128, eval-mode
  batch-norm, 32×32 images;
* ``mobilenet``: MobileNetV3-small (11 inverted residuals, squeeze-excite, hardswish),
  eval-mode batch-norm, 64×64 images;
* ``lstm``: embedding 64 → ``nn.LSTM`` 128 → linear head on the last step;
* ``gru``: embedding 64 → 2-layer bidirectional ``nn.GRU`` 128 → head on the final hidden
  states.

Training-mode cases (:data:`TRAINING`, measured by ``real_models.py`` only), a draw per call
(``RealCase.seed``): ``gpt2-train``, ``gpt2`` in train mode with its three dropouts at 0.1;
``gru-train``, ``gru`` in train mode with dropout 0.2 between its layers; ``encoder-train``,
``nn.TransformerEncoder`` (2 layers, d=128, 4 heads) with its default dropout 0.1, over token
embeddings and a learned position table, mean-pooled, in train mode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import torchgram as tg


@dataclass(frozen=True)
class Sizes:
    """The knobs of every case; :data:`FULL` is the reported configuration."""

    batch: int = 16
    tokens: int = 32
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    vocab: int = 1000
    classes: int = 10
    vit_image: int = 24
    vit_patch: int = 4
    swin_image: int = 32
    swin_window: int = 4
    resnet_image: int = 32
    resnet_width: int = 16
    mobilenet_image: int = 64
    mobilenet_width: float = 1.0
    rnn_embed: int = 64
    rnn_hidden: int = 128


FULL = Sizes()
QUICK = Sizes(batch=3, tokens=6, hidden=16, layers=1, heads=2, vocab=30, classes=3, vit_image=8,
              vit_patch=4, swin_image=8, swin_window=2, resnet_image=8, resnet_width=4,
              mobilenet_image=32, mobilenet_width=0.25, rnn_embed=8, rnn_hidden=8)


@dataclass
class RealCase:
    """One model with its inputs (see the module docstring).

    Attributes:
        name: Short id (``gpt2``).
        title: One line saying what it is.
        module: The model (every trainable parameter is differentiated).
        inputs: Positional inputs, samples along dim 0.
        kw_inputs: Keyword inputs (``attention_mask``), samples along dim 0.
        rows: ``rows(model, *inputs, **kw_inputs) -> [B]`` per-sample losses.
        seed: For a model that draws (dropout): the seed to set before every call, so that
            every method sees the same draw; ``None`` for the others.
    """

    name: str
    title: str
    module: nn.Module
    inputs: tuple[Tensor, ...]
    rows: Callable[..., Tensor]
    kw_inputs: dict[str, Tensor] = field(default_factory=dict)
    seed: int | None = None

    def __post_init__(self) -> None:
        self._fn, self.params = tg.functionalize(self.module)

    def f(self, params: dict[str, Tensor], *inputs: Tensor, **kw: Tensor) -> Tensor:
        """The pure function given to torchgram and torch.func."""
        return self.rows(lambda *a, **k: self._fn(params, *a, **k), *inputs, **kw)

    @property
    def batch(self) -> int:
        """``B``."""
        return self.inputs[0].shape[0]

    @property
    def num_params(self) -> int:
        """``P``."""
        return sum(p.numel() for p in self.params.values())


# -- text: transformers models ------------------------------------------------------------------

def _padded(s: Sizes) -> tuple[Tensor, Tensor]:
    """Right-padded token ids ``[B, T]`` (pad 0) and their attention mask (1 = real token)."""
    ids = torch.randint(1, s.vocab, (s.batch, s.tokens))
    lengths = torch.randint(s.tokens // 2, s.tokens + 1, (s.batch,))
    lengths[0] = s.tokens
    mask = (torch.arange(s.tokens)[None] < lengths[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask


def _lm_losses(model: Callable[..., Any], ids: Tensor, *, attention_mask: Tensor) -> Tensor:
    logits = model(ids, attention_mask=attention_mask).logits[:, :-1]
    token = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    weights = attention_mask[:, 1:].to(token.dtype)
    return (token * weights).sum(1) / weights.sum(1)


def _classify(model: Callable[..., Any], ids: Tensor, labels: Tensor, *,
              attention_mask: Tensor) -> Tensor:
    logits = model(ids, attention_mask=attention_mask).logits
    return F.cross_entropy(logits, labels, reduction="none")


def _images_ce(model: Callable[..., Any], images: Tensor, labels: Tensor) -> Tensor:
    out = model(images)
    logits = out if isinstance(out, Tensor) else out.logits
    return F.cross_entropy(logits, labels, reduction="none")


def gpt2(s: Sizes, *, dropout: float = 0.0) -> RealCase:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=s.vocab, n_positions=max(64, s.tokens), n_embd=s.hidden,
                        n_layer=s.layers, n_head=s.heads, resid_pdrop=dropout,
                        embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=1, eos_token_id=1)
    model = GPT2LMHeadModel(config).train(dropout > 0)
    ids, mask = _padded(s)
    title = (f"GPT2LMHeadModel {s.layers} layers d={s.hidden} {s.heads} heads, tied embeddings, "
             f"T={s.tokens} right-padded + mask, LM loss")
    if dropout:
        return RealCase("gpt2-train", f"{title}; train mode, dropout {dropout}", model, (ids,),
                        _lm_losses, {"attention_mask": mask}, seed=0)
    return RealCase("gpt2", title, model, (ids,), _lm_losses, {"attention_mask": mask})


def llama(s: Sizes) -> RealCase:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=2 * s.hidden,
                         num_hidden_layers=s.layers, num_attention_heads=s.heads,
                         num_key_value_heads=max(1, s.heads // 2),
                         max_position_embeddings=max(64, s.tokens), pad_token_id=0,
                         bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).eval()
    ids, mask = _padded(s)
    return RealCase("llama", f"LlamaForCausalLM {s.layers} layers d={s.hidden} GQA {s.heads}/"
                    f"{max(1, s.heads // 2)} heads, RMSNorm, rotary, T={s.tokens} padded + mask",
                    model, (ids,), _lm_losses, {"attention_mask": mask})


def bert(s: Sizes) -> RealCase:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=s.vocab, hidden_size=s.hidden, num_hidden_layers=s.layers,
                        num_attention_heads=s.heads, intermediate_size=4 * s.hidden,
                        max_position_embeddings=max(64, s.tokens), num_labels=s.classes,
                        pad_token_id=0, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(config).eval()
    ids, mask = _padded(s)
    labels = torch.randint(0, s.classes, (s.batch,))
    return RealCase("bert", f"BertForSequenceClassification {s.layers} layers d={s.hidden} "
                    f"{s.heads} heads, T={s.tokens} padded + attention mask",
                    model, (ids, labels), _classify, {"attention_mask": mask})


def vit(s: Sizes) -> RealCase:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=s.vit_image, patch_size=s.vit_patch, num_channels=3,
                       hidden_size=s.hidden, num_hidden_layers=s.layers,
                       num_attention_heads=s.heads, intermediate_size=4 * s.hidden,
                       num_labels=s.classes, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    model = ViTForImageClassification(config).eval()
    images = torch.randn(s.batch, 3, s.vit_image, s.vit_image)
    labels = torch.randint(0, s.classes, (s.batch,))
    tokens = (s.vit_image // s.vit_patch) ** 2 + 1
    return RealCase("vit", f"ViTForImageClassification {s.layers} layers d={s.hidden} "
                    f"{s.heads} heads, {s.vit_image}×{s.vit_image} images ({tokens} tokens)",
                    model, (images, labels), _images_ce)


def swin(s: Sizes) -> RealCase:
    from transformers import SwinConfig, SwinForImageClassification

    config = SwinConfig(image_size=s.swin_image, patch_size=2, num_channels=3,
                        embed_dim=s.hidden // 2, depths=[2, 2], num_heads=[s.heads // 2, s.heads],
                        window_size=s.swin_window, mlp_ratio=4.0, num_labels=s.classes,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        drop_path_rate=0.0)
    model = SwinForImageClassification(config).eval()
    images = torch.randn(s.batch, 3, s.swin_image, s.swin_image)
    labels = torch.randint(0, s.classes, (s.batch,))
    return RealCase("swin", f"SwinForImageClassification 2+2 blocks d={s.hidden // 2}-{s.hidden}, "
                    f"{s.swin_window}×{s.swin_window} windows, {s.swin_image}×{s.swin_image} "
                    "images", model, (images, labels), _images_ce)


class NanoBlock(nn.Module):
    """A nanoGPT block: pre-norm causal self-attention (fused qkv) and a GELU MLP."""

    def __init__(self, s: Sizes) -> None:
        super().__init__()
        self.heads = s.heads
        self.norm1, self.norm2 = nn.LayerNorm(s.hidden), nn.LayerNorm(s.hidden)
        self.qkv, self.proj = nn.Linear(s.hidden, 3 * s.hidden), nn.Linear(s.hidden, s.hidden)
        self.up, self.down = nn.Linear(s.hidden, 4 * s.hidden), nn.Linear(4 * s.hidden, s.hidden)

    def forward(self, x: Tensor) -> Tensor:
        batch, tokens, width = x.shape
        q, k, v = (t.view(batch, tokens, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(self.norm1(x)).split(width, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, tokens, width))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class NanoGPT(nn.Module):
    """nanoGPT's model: ``wte(idx) + wpe(arange(T))``, blocks, final norm, tied head."""

    def __init__(self, s: Sizes) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(s.vocab, s.hidden), nn.Embedding(s.tokens, s.hidden)
        self.blocks = nn.ModuleList(NanoBlock(s) for _ in range(s.layers))
        self.norm = nn.LayerNorm(s.hidden)
        self.head = nn.Linear(s.hidden, s.vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids: Tensor) -> Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _next_token_losses(model: Callable[..., Tensor], ids: Tensor) -> Tensor:
    logits = model(ids)[:, :-1]
    return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


def nanogpt(s: Sizes) -> RealCase:
    model = NanoGPT(s).eval()
    ids = torch.randint(0, s.vocab, (s.batch, s.tokens))
    return RealCase("nanogpt", f"nanoGPT-style decoder {s.layers} blocks d={s.hidden} "
                    f"{s.heads} heads, T={s.tokens}, positions of arange(T), tied head",
                    model, (ids,), _next_token_losses)


# -- vision: ResNet-18 and MobileNetV3-small ------------------------------------------------------

class BasicBlock(nn.Module):
    """ResNet's basic block: conv-bn-relu-conv-bn plus a (1×1 conv + bn) shortcut."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                          nn.BatchNorm2d(c_out))

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 (BasicBlock ×[2, 2, 2, 2]) with a CIFAR stem (3×3 conv, no max-pool)."""

    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        blocks: list[nn.Module] = []
        c_in = width
        for stage, stride in enumerate((1, 2, 2, 2)):
            c_out = width * 2 ** stage
            blocks += [BasicBlock(c_in, c_out, stride), BasicBlock(c_out, c_out, 1)]
            c_in = c_out
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(c_in, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.blocks(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


def _divisible(value: float, divisor: int = 8) -> int:
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


class SqueezeExcite(nn.Module):
    """MobileNetV3's squeeze-excite: pooled → 1×1 conv → ReLU → 1×1 conv → hardsigmoid gate."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        squeezed = _divisible(channels // 4)
        self.fc1 = nn.Conv2d(channels, squeezed, 1)
        self.fc2 = nn.Conv2d(squeezed, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        scale = F.hardsigmoid(self.fc2(F.relu(self.fc1(F.adaptive_avg_pool2d(x, 1)))))
        return x * scale


class InvertedResidual(nn.Module):
    """[expand 1×1] - depthwise k×k - [SE] - project 1×1, each conv followed by batch-norm."""

    def __init__(self, c_in: int, kernel: int, expanded: int, c_out: int, se: bool,
                 activation: type[nn.Module], stride: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        if expanded != c_in:
            layers += [nn.Conv2d(c_in, expanded, 1, bias=False), nn.BatchNorm2d(expanded),
                       activation()]
        layers += [nn.Conv2d(expanded, expanded, kernel, stride, kernel // 2, groups=expanded,
                             bias=False), nn.BatchNorm2d(expanded), activation()]
        if se:
            layers.append(SqueezeExcite(expanded))
        layers += [nn.Conv2d(expanded, c_out, 1, bias=False), nn.BatchNorm2d(c_out)]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: Tensor) -> Tensor:
        h = self.block(x)
        return x + h if self.residual else h


# torchvision's mobilenet_v3_small: (kernel, expanded, out, SE, hardswish, stride)
_SMALL = ((3, 16, 16, True, False, 2), (3, 72, 24, False, False, 2),
          (3, 88, 24, False, False, 1), (5, 96, 40, True, True, 2), (5, 240, 40, True, True, 1),
          (5, 240, 40, True, True, 1), (5, 120, 48, True, True, 1), (5, 144, 48, True, True, 1),
          (5, 288, 96, True, True, 2), (5, 576, 96, True, True, 1), (5, 576, 96, True, True, 1))


class MobileNetV3Small(nn.Module):
    """MobileNetV3-small: stem, 11 inverted residuals, 1×1 conv to 576, 1024-wide classifier."""

    def __init__(self, classes: int, width: float = 1.0) -> None:
        super().__init__()

        def c(channels: int) -> int:
            return _divisible(channels * width)

        layers: list[nn.Module] = [nn.Conv2d(3, c(16), 3, 2, 1, bias=False),
                                   nn.BatchNorm2d(c(16)), nn.Hardswish()]
        c_in = c(16)
        for kernel, expanded, out, se, hs, stride in _SMALL:
            layers.append(InvertedResidual(c_in, kernel, c(expanded), c(out), se,
                                           nn.Hardswish if hs else nn.ReLU, stride))
            c_in = c(out)
        layers += [nn.Conv2d(c_in, c(576), 1, bias=False), nn.BatchNorm2d(c(576)),
                   nn.Hardswish()]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Linear(c(576), c(1024)), nn.Hardswish(),
                                        nn.Linear(c(1024), classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(F.adaptive_avg_pool2d(self.features(x), 1).flatten(1))


def _running_stats(model: nn.Module) -> nn.Module:
    """Non-trivial batch-norm running statistics (as after training), then eval mode."""
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            assert module.running_mean is not None and module.running_var is not None
            module.running_mean.normal_(0.0, 0.2)
            module.running_var.uniform_(0.5, 2.0)
    return model.eval()


def resnet18(s: Sizes) -> RealCase:
    model = _running_stats(ResNet18(s.resnet_width, s.classes))
    images = torch.randn(s.batch, 3, s.resnet_image, s.resnet_image)
    labels = torch.randint(0, s.classes, (s.batch,))
    return RealCase("resnet18", f"ResNet-18 widths {s.resnet_width}-{8 * s.resnet_width}, "
                    f"eval-mode batch-norm, {s.resnet_image}×{s.resnet_image} images",
                    model, (images, labels), _images_ce)


def mobilenet(s: Sizes) -> RealCase:
    model = _running_stats(MobileNetV3Small(s.classes, s.mobilenet_width))
    images = torch.randn(s.batch, 3, s.mobilenet_image, s.mobilenet_image)
    labels = torch.randint(0, s.classes, (s.batch,))
    return RealCase("mobilenet", f"MobileNetV3-small (width ×{s.mobilenet_width}), eval-mode "
                    f"batch-norm, {s.mobilenet_image}×{s.mobilenet_image} images",
                    model, (images, labels), _images_ce)


# -- recurrent ------------------------------------------------------------------------------------

class RNNClassifier(nn.Module):
    """Embedding → fused RNN → linear head (last output step, or final hidden states)."""

    def __init__(self, rnn: nn.RNNBase, s: Sizes, final_hidden: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.rnn_embed)
        self.rnn = rnn
        self.final_hidden = final_hidden
        directions = 2 if rnn.bidirectional else 1
        self.head = nn.Linear(s.rnn_hidden * directions, s.classes)

    def forward(self, ids: Tensor) -> Tensor:
        out, state = self.rnn(self.embed(ids))
        if not self.final_hidden:
            return self.head(out[:, -1])
        h_n = state[0] if isinstance(state, tuple) else state
        directions = 2 if self.rnn.bidirectional else 1
        return self.head(h_n[-directions:].transpose(0, 1).flatten(1))


def _tokens_ce(model: Callable[..., Tensor], ids: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(model(ids), labels, reduction="none")


def lstm(s: Sizes) -> RealCase:
    model = RNNClassifier(nn.LSTM(s.rnn_embed, s.rnn_hidden, batch_first=True), s, False)
    ids = torch.randint(0, s.vocab, (s.batch, s.tokens))
    labels = torch.randint(0, s.classes, (s.batch,))
    return RealCase("lstm", f"embedding {s.rnn_embed} → nn.LSTM {s.rnn_hidden} → head, "
                    f"T={s.tokens}", model, (ids, labels), _tokens_ce)


def gru(s: Sizes, *, dropout: float = 0.0) -> RealCase:
    rnn = nn.GRU(s.rnn_embed, s.rnn_hidden, num_layers=2, bidirectional=True, batch_first=True,
                 dropout=dropout)
    model = RNNClassifier(rnn, s, True).train(dropout > 0)
    ids = torch.randint(0, s.vocab, (s.batch, s.tokens))
    labels = torch.randint(0, s.classes, (s.batch,))
    title = (f"embedding {s.rnn_embed} → 2-layer bidirectional nn.GRU {s.rnn_hidden} → head, "
             f"T={s.tokens}")
    if dropout:
        return RealCase("gru-train", f"{title}; train mode, dropout {dropout} between the layers",
                        model, (ids, labels), _tokens_ce, seed=0)
    return RealCase("gru", title, model, (ids, labels), _tokens_ce)


class TokenEncoder(nn.Module):
    """Embedding + positions → ``nn.TransformerEncoder`` (its defaults: dropout 0.1, post-norm)
    → mean over the tokens → linear head."""

    def __init__(self, s: Sizes) -> None:
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.hidden)
        self.positions = nn.Parameter(torch.randn(s.tokens, s.hidden) * 0.02)
        layer = nn.TransformerEncoderLayer(s.hidden, s.heads, 4 * s.hidden, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, s.layers, enable_nested_tensor=False)
        self.head = nn.Linear(s.hidden, s.classes)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.encoder(self.embed(ids) + self.positions).mean(1))


def torch_encoder_train(s: Sizes) -> RealCase:
    model = TokenEncoder(s).train()
    ids = torch.randint(0, s.vocab, (s.batch, s.tokens))
    labels = torch.randint(0, s.classes, (s.batch,))
    return RealCase("encoder-train", f"nn.TransformerEncoder {s.layers} layers d={s.hidden} "
                    f"{s.heads} heads, T={s.tokens}; train mode, its default dropout 0.1",
                    model, (ids, labels), _tokens_ce, seed=0)


BUILDERS: dict[str, Callable[[Sizes], RealCase]] = {
    "gpt2": gpt2, "llama": llama, "bert": bert, "vit": vit, "swin": swin, "nanogpt": nanogpt,
    "resnet18": resnet18, "mobilenet": mobilenet, "lstm": lstm, "gru": gru,
}
NAMES: tuple[str, ...] = tuple(BUILDERS)

TRAINING: dict[str, Callable[[Sizes], RealCase]] = {
    "gpt2-train": lambda s: gpt2(s, dropout=0.1),
    "gru-train": lambda s: gru(s, dropout=0.2),
    "encoder-train": torch_encoder_train,
}
"""Models in train mode that draw (dropout): ``real_models.py`` measures them too."""


def build(name: str, sizes: Sizes = FULL) -> RealCase:
    """Build case ``name`` (of :data:`BUILDERS` or :data:`TRAINING`) deterministically."""
    builders = {**BUILDERS, **TRAINING}
    if name not in builders:
        raise ValueError(f"benchmarks: expected a model in {list(builders)}, but got {name!r}.")
    torch.manual_seed(0)
    return builders[name](sizes)
