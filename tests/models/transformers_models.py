"""``transformers`` models from tiny configs: random init, no downloads, float64.

Each builder returns a :class:`models.case.ModelCase` whose function calls the model the way
people do — ``model(input_ids, attention_mask=mask)``, the mask **by keyword** (issue 9,
regression 3) — and returns per-sample losses ``[B]``. Models are in eval mode with dropout
probabilities 0, except ``bert-dropout`` (train mode, one random draw per call). Attention
runs with the ``eager`` kernels and with ``sdpa`` (the library's default on CPU), since the
two build and use the mask differently.

Sizes: hidden 8 (LLaMA 16), 1 layer, 2 heads (LLaMA 4 query / 2 key-value heads), vocab 20,
``B = 3`` samples of ``T = 5`` tokens, padded to different lengths.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import (
    AlbertConfig,
    AlbertForSequenceClassification,
    BeitConfig,
    BeitForImageClassification,
    BertConfig,
    BertForSequenceClassification,
    BloomConfig,
    BloomForCausalLM,
    ConvBertConfig,
    ConvBertForSequenceClassification,
    ConvNextConfig,
    ConvNextForImageClassification,
    DebertaV2Config,
    DebertaV2ForSequenceClassification,
    Dinov2Config,
    Dinov2ForImageClassification,
    DistilBertConfig,
    DistilBertForSequenceClassification,
    FNetConfig,
    FNetForSequenceClassification,
    FunnelConfig,
    FunnelForSequenceClassification,
    GemmaConfig,
    GemmaForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MambaConfig,
    MambaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    MobileBertConfig,
    MobileBertForSequenceClassification,
    MobileNetV2Config,
    MobileNetV2ForImageClassification,
    NystromformerConfig,
    NystromformerForSequenceClassification,
    OPTConfig,
    OPTForCausalLM,
    PhiConfig,
    PhiForCausalLM,
    PoolFormerConfig,
    PoolFormerForImageClassification,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    RobertaConfig,
    RobertaForSequenceClassification,
    SegformerConfig,
    SegformerForImageClassification,
    SqueezeBertConfig,
    SqueezeBertForSequenceClassification,
    StableLmConfig,
    StableLmForCausalLM,
    SwinConfig,
    SwinForImageClassification,
    T5Config,
    T5ForConditionalGeneration,
    ViTConfig,
    ViTForImageClassification,
)

import torchgram as tg
from models.case import ModelCase

BATCH, TOKENS, VOCAB, LABELS = 3, 5, 20, 3
PAD = 0
LENGTHS = (5, 3, 4)
"""Unpadded length of each sample."""


def _padded_tokens() -> tuple[Tensor, Tensor]:
    """Token ids ``[B, T]``, right-padded with ``PAD``, and the attention mask (int64, 1 = real).

    Right padding: with left padding, the eager causal attention of ``transformers`` 5.24 gives
    NaN outputs for the fully masked rows of the padded queries, in every sample's loss.
    """
    ids = torch.randint(1, VOCAB, (BATCH, TOKENS))
    mask = torch.zeros(BATCH, TOKENS, dtype=torch.long)
    for b, length in enumerate(LENGTHS):
        mask[b, :length] = 1
    ids[mask == 0] = PAD
    return ids, mask


def lm_losses(logits: Tensor, ids: Tensor, mask: Tensor | None = None) -> Tensor:
    """Per-sample next-token cross-entropy ``[B]``, averaged over the real target tokens."""
    token = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    if mask is None:
        return token.mean(1)
    weights = mask[:, 1:].to(token.dtype)
    return (token * weights).sum(1) / weights.sum(1)


def bert(attn: str, *, dropout: float = 0.0) -> ModelCase:
    config = BertConfig(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=16, max_position_embeddings=8,
                        num_labels=LABELS, pad_token_id=PAD, hidden_dropout_prob=dropout,
                        attention_probs_dropout_prob=dropout, attn_implementation=attn)
    if dropout:
        return classifier("bert-dropout", config, BertForSequenceClassification,
                          "BertForSequenceClassification, train mode, dropout 0.1, padded + mask",
                          seed=1234)
    return classifier(f"bert-mask-{attn}", config, BertForSequenceClassification,
                      "BertForSequenceClassification, padded samples + attention mask")


def gpt2_dropout() -> ModelCase:
    """GPT-2 in train mode with dropout 0.1 (embeddings, attention, residuals): ``Conv1D``
    merges the tokens of every sample into one dim, and every call draws."""
    config = GPT2Config(vocab_size=VOCAB, n_positions=8, n_embd=8, n_layer=1, n_head=2,
                        n_inner=16, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                        bos_token_id=1, eos_token_id=1, attn_implementation="eager")
    model = GPT2LMHeadModel(config).to(torch.float64).train()
    return causal_lm("gpt2-dropout", config, GPT2LMHeadModel,
                     "GPT2LMHeadModel, train mode, dropout 0.1, padded + mask, LM loss",
                     model=model, seed=4321)


def gpt2(attn: str, *, masked: bool) -> ModelCase:
    config = GPT2Config(vocab_size=VOCAB, n_positions=8, n_embd=8, n_layer=1, n_head=2,
                        n_inner=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=1, eos_token_id=1, attn_implementation=attn)
    model = GPT2LMHeadModel(config).to(torch.float64).eval()
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    fn, params = tg.functionalize(model)
    ids, mask = _padded_tokens()
    if not masked:
        def f_plain(p: dict[str, Tensor], ids: Tensor) -> Tensor:
            return lm_losses(fn(p, ids).logits, ids)

        return ModelCase(f"gpt2-{attn}", f_plain, params, (ids,), output_shape=(BATCH,),
                         module=model, note="GPT2LMHeadModel, tied embeddings, LM loss")

    def f(p: dict[str, Tensor], ids: Tensor, *, attention_mask: Tensor) -> Tensor:
        return lm_losses(fn(p, ids, attention_mask=attention_mask).logits, ids, attention_mask)

    return ModelCase(f"gpt2-mask-{attn}", f, params, (ids,), {"attention_mask": mask},
                     output_shape=(BATCH,), module=model,
                     note="GPT2LMHeadModel, tied embeddings, right-padded + mask, LM loss")


LLAMA_RTOL = 1e-6
"""LLaMA computes in float32 inside a float64 model: ``LlamaRMSNorm`` casts the hidden states
to float32 for the variance, and eager attention takes its softmax in float32. Forward- and
reverse-mode derivatives (``ntvp`` vs the oracle) then agree to ~1e-8 only; with a float64
RMSNorm they agree to 1e-11 (eager) and 1e-16 (sdpa). Real errors seen here are > 1e-1."""


def llama(attn: str) -> ModelCase:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=16, pad_token_id=PAD, bos_token_id=1,
                         eos_token_id=2, attn_implementation=attn)
    return causal_lm(f"llama-mask-{attn}", config, LlamaForCausalLM,
                     "LlamaForCausalLM: GQA 4/2 heads, RMSNorm, rotary; padded + mask",
                     rtol=LLAMA_RTOL)


def image_classifier(name: str, config: PretrainedConfig, model_class: type[PreTrainedModel],
                     note: str) -> ModelCase:
    """``model(pixels).logits`` → per-sample cross-entropy, ``8×8`` RGB images."""
    model = model_class(config).to(torch.float64).eval()
    fn, params = tg.functionalize(model)
    pixels = torch.randn(BATCH, 3, 8, 8, dtype=torch.float64)
    labels = torch.randint(0, LABELS, (BATCH,))

    def f(p: dict[str, Tensor], pixels: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(fn(p, pixels).logits, labels, reduction="none")

    return ModelCase(name, f, params, (pixels, labels), output_shape=(BATCH,), module=model,
                     note=note)


def vit(attn: str) -> ModelCase:
    config = ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=8,
                       num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                       num_labels=LABELS, attn_implementation=attn)
    return image_classifier(f"vit-{attn}", config, ViTForImageClassification,
                            "ViTForImageClassification, 8x8 images, 4x4 patches")


# -- more architectures: the same two calls, each model's own quirks -------------------------

def classifier(name: str, config: PretrainedConfig, model_class: type[PreTrainedModel],
               note: str, *, seed: int | None = None, rtol: float | None = None) -> ModelCase:
    """``model(ids, attention_mask=mask).logits`` → per-sample cross-entropy, padded samples.

    ``seed``: a random model (dropout), in train mode, one draw per call from that seed;
    ``rtol``: a looser tolerance than the case's default, for models that round inside.
    """
    model = model_class(config).to(torch.float64).train(seed is not None)
    fn, params = tg.functionalize(model)
    ids, mask = _padded_tokens()
    labels = torch.randint(0, LABELS, (BATCH,))

    def f(p: dict[str, Tensor], ids: Tensor, labels: Tensor, *, attention_mask: Tensor) -> Tensor:
        logits = fn(p, ids, attention_mask=attention_mask).logits
        return F.cross_entropy(logits, labels, reduction="none")

    options = {} if rtol is None else {"rtol": rtol}
    return ModelCase(name, f, params, (ids, labels), {"attention_mask": mask},
                     output_shape=(BATCH,), module=model, seed=seed, note=note, **options)


def causal_lm(name: str, config: PretrainedConfig, model_class: type[PreTrainedModel],
              note: str, *, rtol: float | None = None, dtype: torch.dtype = torch.float64,
              model: PreTrainedModel | None = None, seed: int | None = None) -> ModelCase:
    """``model(ids, attention_mask=mask).logits`` → per-sample LM loss over the real tokens.

    ``model``: one already built (and set up), instead of ``model_class(config)`` in eval mode;
    ``seed``: a random model (dropout), one draw per call from that seed.
    """
    model = model_class(config).to(dtype).eval() if model is None else model
    fn, params = tg.functionalize(model)
    ids, mask = _padded_tokens()

    def f(p: dict[str, Tensor], ids: Tensor, *, attention_mask: Tensor) -> Tensor:
        return lm_losses(fn(p, ids, attention_mask=attention_mask).logits, ids, attention_mask)

    options = {} if rtol is None else {"rtol": rtol}
    return ModelCase(name, f, params, (ids,), {"attention_mask": mask}, output_shape=(BATCH,),
                     module=model, note=note, seed=seed, **options)


_ENCODER = {"vocab_size": VOCAB, "hidden_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 16, "max_position_embeddings": 16,
            "num_labels": LABELS, "pad_token_id": PAD}
_GQA = {"vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16}

MORE: dict[str, Callable[[], ModelCase]] = {
    # position ids counted from the padding mask of the input ids (cumsum), padding_idx rows
    "roberta": lambda: classifier(
        "roberta", RobertaConfig(**_ENCODER), RobertaForSequenceClassification,
        "RobertaForSequenceClassification: positions from the padding mask"),
    "distilbert": lambda: classifier(
        "distilbert", DistilBertConfig(vocab_size=VOCAB, dim=8, n_layers=1, n_heads=2,
                                       hidden_dim=16, max_position_embeddings=16,
                                       num_labels=LABELS, pad_token_id=PAD),
        DistilBertForSequenceClassification, "DistilBertForSequenceClassification"),
    # one layer's weights used by both layers, and a factorised embedding
    "albert": lambda: classifier(
        "albert", AlbertConfig(**{**_ENCODER, "num_hidden_layers": 2}, embedding_size=4),
        AlbertForSequenceClassification,
        "AlbertForSequenceClassification: 2 layers sharing weights, embedding 4 → 8"),
    "qwen2": lambda: causal_lm(
        "qwen2", Qwen2Config(**_GQA), Qwen2ForCausalLM,
        "Qwen2ForCausalLM: GQA with biased q/k/v projections", rtol=LLAMA_RTOL),
    # learned positions offset by 2, computed from the attention mask (cumsum)
    "opt": lambda: causal_lm(
        "opt", OPTConfig(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, ffn_dim=16,
                         num_attention_heads=2, max_position_embeddings=16,
                         word_embed_proj_dim=8, pad_token_id=PAD), OPTForCausalLM,
        "OPTForCausalLM: learned positions from the mask"),
    "gpt-neox": lambda: causal_lm(
        "gpt-neox", GPTNeoXConfig(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=16,
                                  max_position_embeddings=16, rotary_pct=0.5),
        GPTNeoXForCausalLM, "GPTNeoXForCausalLM: parallel residual, partial rotary",
        rtol=LLAMA_RTOL),
    # ALiBi from the mask, and a GELU written as an old-style autograd.Function (forward(ctx,
    # ...)): torch refuses it under torch.func transforms (NOTE [old-style autograd.Functions])
    "bloom": lambda: causal_lm(
        "bloom", BloomConfig(vocab_size=VOCAB, hidden_size=8, n_layer=1, n_head=2),
        BloomForCausalLM, "BloomForCausalLM: ALiBi, old-style autograd.Function GELU"),
}


def t5() -> ModelCase:
    """Encoder-decoder with a relative position bias: a table of buckets added to every
    attention score matrix, shared by the samples (NOTE [shared taps])."""
    config = T5Config(vocab_size=VOCAB, d_model=8, d_kv=4, d_ff=16, num_layers=1,
                      num_decoder_layers=1, num_heads=2, relative_attention_num_buckets=4,
                      relative_attention_max_distance=8, dropout_rate=0.0, pad_token_id=PAD,
                      decoder_start_token_id=PAD)
    model = T5ForConditionalGeneration(config).to(torch.float64).eval()
    fn, params = tg.functionalize(model)
    ids, mask = _padded_tokens()
    targets = torch.randint(1, VOCAB, (BATCH, 3))

    def f(p: dict[str, Tensor], ids: Tensor, targets: Tensor, *,
          attention_mask: Tensor) -> Tensor:
        logits = fn(p, input_ids=ids, attention_mask=attention_mask, labels=targets).logits
        return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(1)

    return ModelCase("t5", f, params, (ids, targets), {"attention_mask": mask},
                     output_shape=(BATCH,), module=model, rtol=LLAMA_RTOL,  # float32 norms,
                     note="T5ForConditionalGeneration: relative position bias, decoder")  # as LLaMA


def swin() -> ModelCase:
    config = SwinConfig(image_size=8, patch_size=2, num_channels=3, embed_dim=8, depths=[1, 1],
                        num_heads=[2, 2], window_size=2, mlp_ratio=2.0, num_labels=LABELS,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        drop_path_rate=0.0)
    return image_classifier("swin", config, SwinForImageClassification,
                            "SwinForImageClassification: windows, relative position bias table")


def gpt2_checkpointing() -> ModelCase:
    """GPT-2 with ``activation_checkpointing_enable`` (non-reentrant): every block a
    ``torch.utils.checkpoint`` region, recomputed in the backward (NOTE [uses with gradients
    off]); train mode, dropout probabilities 0."""
    config = GPT2Config(vocab_size=VOCAB, n_positions=8, n_embd=8, n_layer=2, n_head=2,
                        n_inner=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=1, eos_token_id=1)
    model = GPT2LMHeadModel(config).to(torch.float64)
    model.activation_checkpointing_enable({"use_reentrant": False})
    case = causal_lm("gpt2-checkpointing", config, GPT2LMHeadModel,
                     "GPT2LMHeadModel, 2 blocks, gradient checkpointing (non-reentrant)",
                     model=model.train())
    return case


MORE_RTOL_FLOAT32 = 2e-5
"""A float32 model against a float32 oracle (``torch._grouped_mm``, Mixtral's experts, has
no float64 kernel on CPU)."""

MORE.update({
    "t5": t5,
    "swin": swin,
    "gpt2-checkpointing": gpt2_checkpointing,
    "deberta-v2": lambda: classifier(
        "deberta-v2", DebertaV2Config(**_ENCODER, relative_attention=True, position_buckets=4,
                                      pos_att_type=["p2c", "c2p"]),
        DebertaV2ForSequenceClassification,
        "DebertaV2ForSequenceClassification: disentangled relative attention"),
    # top-2 of 3 experts per token through torch._grouped_mm, float32 only on CPU
    "mixtral": lambda: causal_lm(
        "mixtral", MixtralConfig(**_GQA, num_local_experts=3, num_experts_per_tok=2),
        MixtralForCausalLM, "MixtralForCausalLM: mixture of experts (float32)",
        rtol=MORE_RTOL_FLOAT32, dtype=torch.float32),
})


BUILDERS: dict[str, Callable[[], ModelCase]] = {
    "bert-mask-eager": lambda: bert("eager"),
    "bert-mask-sdpa": lambda: bert("sdpa"),
    "bert-dropout": lambda: bert("eager", dropout=0.1),
    "gpt2-eager": lambda: gpt2("eager", masked=False),
    "gpt2-mask-eager": lambda: gpt2("eager", masked=True),
    "gpt2-mask-sdpa": lambda: gpt2("sdpa", masked=True),
    "gpt2-dropout": gpt2_dropout,
    "llama-mask-eager": lambda: llama("eager"),
    "llama-mask-sdpa": lambda: llama("sdpa"),
    "vit-eager": lambda: vit("eager"),
    "vit-sdpa": lambda: vit("sdpa"),
    **MORE,
}


# -- session 50: more mechanisms people bring, each architecture for what it does differently --

FUNNEL_RTOL = 1e-7
"""Funnel takes its attention scores to float32 (``attn_score.float()``) inside a float64
model: forward- and reverse-mode derivatives through that rounding (``ntvp`` against the
oracle) agree to 2.5e-10 of the largest entry, not to float64's round-off."""

_IMAGE = {"num_channels": 3, "num_labels": LABELS}

BUILDERS.update({
    "phi": lambda: causal_lm(
        "phi", PhiConfig(**_GQA, partial_rotary_factor=0.5), PhiForCausalLM,
        "PhiForCausalLM: parallel attention and MLP, partial rotary", rtol=LLAMA_RTOL),
    "mistral": lambda: causal_lm(
        "mistral", MistralConfig(**_GQA, sliding_window=2), MistralForCausalLM,
        "MistralForCausalLM: sliding-window attention (window 2) with padding",
        rtol=LLAMA_RTOL),
    "gemma": lambda: causal_lm(
        "gemma", GemmaConfig(**_GQA, head_dim=4), GemmaForCausalLM,
        "GemmaForCausalLM: embeddings scaled by sqrt(d), RMSNorm with (1 + w)",
        rtol=LLAMA_RTOL),
    "stablelm": lambda: causal_lm(
        "stablelm", StableLmConfig(**_GQA, qk_layernorm=True, use_qkv_bias=True),
        StableLmForCausalLM, "StableLmForCausalLM: a LayerNorm per head on queries and keys",
        rtol=LLAMA_RTOL),
    # selective scan by the reference PyTorch path; the model returns float32 logits
    "mamba": lambda: causal_lm(
        "mamba", MambaConfig(vocab_size=VOCAB, hidden_size=8, state_size=4,
                             num_hidden_layers=1, expand=2, conv_kernel=2, use_mambapy=False),
        MambaForCausalLM, "MambaForCausalLM: causal conv1d, selective scan (float32 output)",
        rtol=MORE_RTOL_FLOAT32),
    "mobilebert": lambda: classifier(
        "mobilebert", MobileBertConfig(**_ENCODER, embedding_size=8, intra_bottleneck_size=8,
                                       true_hidden_size=8, num_feedforward_networks=2),
        MobileBertForSequenceClassification,
        "MobileBertForSequenceClassification: NoNorm (elementwise affine), bottlenecks, "
        "two FFNs"),
    "funnel": lambda: classifier(
        "funnel", FunnelConfig(vocab_size=VOCAB, block_sizes=[1, 1], d_model=8, n_head=2,
                               d_head=4, d_inner=16, num_labels=LABELS, pad_token_id=PAD),
        FunnelForSequenceClassification,
        "FunnelForSequenceClassification: pooled sequence, relative attention, float32 "
        "scores", rtol=FUNNEL_RTOL),
    "convbert": lambda: classifier(
        "convbert", ConvBertConfig(**_ENCODER, embedding_size=8, conv_kernel_size=3,
                                   head_ratio=2),
        ConvBertForSequenceClassification,
        "ConvBertForSequenceClassification: span-based dynamic convolution"),
    "squeezebert": lambda: classifier(
        "squeezebert", SqueezeBertConfig(**_ENCODER, embedding_size=8, q_groups=2, k_groups=2,
                                         v_groups=2, post_attention_groups=2,
                                         intermediate_groups=2, output_groups=2),
        SqueezeBertForSequenceClassification,
        "SqueezeBertForSequenceClassification: grouped 1x1 convolutions"),
    "fnet": lambda: classifier(
        "fnet", FNetConfig(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1,
                           intermediate_size=16, max_position_embeddings=16, num_labels=LABELS,
                           pad_token_id=PAD, use_tpu_fourier_optimizations=False),
        FNetForSequenceClassification, "FNetForSequenceClassification: FFT token mixing"),
    "nystromformer": lambda: classifier(
        "nystromformer", NystromformerConfig(**_ENCODER, num_landmarks=5,
                                             segment_means_seq_len=5),
        NystromformerForSequenceClassification,
        "NystromformerForSequenceClassification: landmark attention, iterative pseudo-inverse"),
    "convnext": lambda: image_classifier(
        "convnext", ConvNextConfig(**_IMAGE, patch_size=2, num_stages=2, hidden_sizes=[8, 16],
                                   depths=[1, 1], layer_scale_init_value=0.5),
        ConvNextForImageClassification,
        "ConvNextForImageClassification: depthwise 7x7, channels-last LayerNorm, layer scale"),
    "beit": lambda: image_classifier(
        "beit", BeitConfig(**_IMAGE, image_size=8, patch_size=4, hidden_size=8,
                           num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                           use_relative_position_bias=True, layer_scale_init_value=0.5,
                           use_mean_pooling=True),
        BeitForImageClassification,
        "BeitForImageClassification: relative position bias table, layer scale"),
    "segformer": lambda: image_classifier(
        "segformer", SegformerConfig(**_IMAGE, num_encoder_blocks=2, depths=[1, 1],
                                     sr_ratios=[2, 1], hidden_sizes=[8, 16],
                                     patch_sizes=[3, 3], strides=[2, 2],
                                     num_attention_heads=[1, 2], mlp_ratios=[2, 2]),
        SegformerForImageClassification,
        "SegformerForImageClassification: attention over a strided-conv reduction, "
        "depthwise mix-FFN"),
    "dinov2": lambda: image_classifier(
        "dinov2", Dinov2Config(**_IMAGE, image_size=8, patch_size=4, hidden_size=8,
                               num_hidden_layers=1, num_attention_heads=2, mlp_ratio=2,
                               layerscale_value=0.5),
        Dinov2ForImageClassification,
        "Dinov2ForImageClassification: interpolated position embeddings, layer scale"),
    "poolformer": lambda: image_classifier(
        "poolformer", PoolFormerConfig(**_IMAGE, hidden_sizes=[8, 16], depths=[1, 1],
                                       patch_sizes=[3, 3], strides=[2, 2], padding=[1, 1],
                                       num_encoder_blocks=2),
        PoolFormerForImageClassification,
        "PoolFormerForImageClassification: average-pool token mixer, GroupNorm, layer scale"),
    "mobilenetv2": lambda: image_classifier(
        "mobilenetv2", MobileNetV2Config(**_IMAGE, image_size=8, depth_multiplier=0.25),
        MobileNetV2ForImageClassification,
        "MobileNetV2ForImageClassification: inverted residuals, eval-mode batch-norm, ReLU6"),
})
