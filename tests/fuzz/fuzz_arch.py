"""Random architectures as plain data, and the functions, arguments and options they build.

A :class:`FuzzCase` is a frozen dataclass (its ``repr`` is Python that rebuilds it, so a
falsifying example hypothesis prints can be pasted into ``test_regressions.py``). It says:

* the model: an input (float features or token ids), a list of layers acting on a hidden
  state ``h`` of shape ``[B, T, D]`` sample by sample (linear in several spellings, conv1d
  over ``T``, attention, RNN cells unrolled over ``T``, norms, elementwise parameters,
  buffers broadcast along the batch, activations, a head tied to the input embedding), and
  a head giving the output (per-sample losses, features, sequences, a pytree);
* how parameters are held: a pure function of a pytree (flat dict, nested dicts, a list of
  tuples; frozen leaves as constants in a closure, a positional or a keyword argument;
  unused, integer and non-tensor leaves beside them) or an ``nn.Module`` through
  ``tg.functionalize``; layers may reuse (tie) an earlier layer's parameters, transposed or
  not;
* how it is called: parameters first, last, or split over two arguments (``argnums``),
  the batch at any dimension of the input (``in_dims``) and of the output (``batch_dim``),
  ``has_aux``, ``diagonal``, ``per_leaf``, ``chunk_size``, ``memory_budget``, the dtype.

:func:`build` turns a case into a :class:`Built` call; values come from the case's seed,
drawn in float64 and cast, so the float32 and float64 builds of a case are the same
function at (rounded) same values and the float64 build is the oracle's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import optree
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import torchgram as tg
from custom_functions import FunctionLinear, OldStyleFunctionLinear
from opaque_code import compiled_linear, scripted_linear

# -- the layers ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Linear:
    """``h @ Wᵀ + b``, ``W`` of shape ``[out, D]``, written as ``form``.

    ``tie``: reuse layer ``tie``'s weight (and bias) instead of owning one; with
    ``transposed`` its weight is used transposed (so ``out`` is that layer's input width)
    and the bias is this layer's own.
    """

    out: int
    bias: bool = True
    form: Literal["linear", "matmul_t", "matmul", "einsum", "addmm", "function",
                  "function_old", "script", "compiled"] = "linear"
    tie: int | None = None
    transposed: bool = False
    frozen: bool = False


@dataclass(frozen=True)
class Conv1d:
    """A conv1d over the token axis ``T`` (channels ``D``)."""

    out: int
    kernel: int = 1
    stride: int = 1
    padding: int = 0
    dilation: int = 1
    groups: int = 1
    bias: bool = True
    frozen: bool = False


@dataclass(frozen=True)
class Attention:
    """Self-attention over ``T``: ``sdpa`` (four projections) or ``mha`` (packed in-proj).

    ``mha`` only: ``dropout``, on the attention weights in training mode (a random op);
    ``weights``: ``need_weights=True`` (torch's ``bmm`` path, the weights dropped).
    """

    heads: int = 1
    form: Literal["sdpa", "mha"] = "sdpa"
    causal: bool = False
    bias: bool = True
    frozen: bool = False
    dropout: float = 0.0
    weights: bool = False


@dataclass(frozen=True)
class RnnCell:
    """An RNN / GRU / LSTM cell unrolled over ``T`` (``torch.rnn_tanh_cell`` and co.)."""

    hidden: int
    kind: Literal["rnn_tanh", "gru", "lstm"] = "gru"
    bias: bool = True
    frozen: bool = False


@dataclass(frozen=True)
class Norm:
    """A normalisation over the features (``group`` over channel groups, ``batch_*`` over B)."""

    kind: Literal["layer", "group", "rms", "batch_eval", "batch_train"] = "layer"
    affine: bool = True
    groups: int = 1
    frozen: bool = False


@dataclass(frozen=True)
class Elementwise:
    """Parameters used elementwise (no rule recognises them: the per-leaf fallback)."""

    kind: Literal["scale_shift", "square_gate", "exp", "slice", "gram"] = "scale_shift"
    frozen: bool = False


@dataclass(frozen=True)
class Kink:
    """A nonlinearity at its kink: every other feature made exactly 0 (``h - h.detach()``,
    whose derivative is ``h``'s), then ``prelu`` with a learned slope, or ``fmax`` / ``fmin``
    / ``clamp`` against a zero tensor (ties).

    Forward and reverse mode take other derivatives there (NOTE [kinks in forward mode]),
    and prelu's backward is wrong under nested ``vmap`` (NOTE [prelu as where]).
    """

    kind: Literal["prelu", "fmax", "fmin", "clamp"] = "prelu"
    frozen: bool = False


@dataclass(frozen=True)
class Distance:
    """Distances to learned anchors: ``torch.cdist(h, A)``, ``A`` of shape ``[anchors, D]``."""

    anchors: int = 2
    p: float = 2.0
    frozen: bool = False


@dataclass(frozen=True)
class Linalg:
    """A learned 3×3 matrix per position, ``M = diag(2, 2.5, 3) + tanh(h Aᵀ)[1:] / 4``, through
    ``kind``: ``det`` / ``slogdet`` scale ``h``; ``solve`` / ``lu_solve`` add the sum of
    ``M⁻¹ (h Bᵀ)`` to it. torch gets these ops' forward-mode derivatives wrong once
    differentiated or batched twice, and ``lu_solve``'s batched backward (session 45). ``M``
    is a view at an offset (the layout those batched derivatives get wrong) and well
    conditioned, with distinct singular values where ``h = 0``: torch differentiates a
    functorch ``det`` backward through an SVD, NaN where singular values repeat (``2 I``, an
    orthogonal matrix), the oracle's ``G``'s derivative included.
    """

    kind: Literal["det", "slogdet", "solve", "lu_solve"] = "det"
    frozen: bool = False


@dataclass(frozen=True)
class Buffer:
    """A constant broadcast along the batch: ``[D]`` (feature) or ``[1, T, D]`` (token)."""

    shape: Literal["feature", "token"] = "feature"
    op: Literal["add", "mul"] = "add"
    via: Literal["closure", "positional", "keyword"] = "closure"


@dataclass(frozen=True)
class Positions:
    """A learned table ``[T, D]`` read at positions shared by the samples, added to ``h``.

    BERT's and GPT-2's position embeddings (NOTE [shared taps]): ``lookup`` is ``F.embedding``
    of ``[1, T]`` ids, of ``[T]`` ids (``flat``: nanoGPT's, the samples' dim prepended where
    it meets ``h``), ``table[ids]`` (a row gather, NOTE [row gathers]), ``table[arange(T)]``
    unsqueezed (a layout call before it meets the batch) or ``table[:T]`` (a row slice);
    ``uses``: ``once`` (``h + pos``), ``twice`` (``tanh(h + pos) + pos``), ``regularised``
    (``h + pos + pos.pow(2).sum()``, a use that does not meet the batch) or ``merged`` (its
    first row added to ``h`` flattened to ``[B·T, D]``: the samples merged with the
    positions, as Swin's windows); ``write``: ``pos`` is scaled in place first (not a slice,
    a view of the table).
    """

    lookup: Literal["embedding", "flat", "index", "unsqueeze", "slice"] = "embedding"
    uses: Literal["once", "twice", "regularised", "merged"] = "once"
    write: bool = False
    frozen: bool = False


@dataclass(frozen=True)
class Activation:
    """A parameter-free nonlinearity; ``inplace``: applied in place (``torch.relu_``, ...).

    In place, the same values: whether torch's autograd accepts it depends on what came
    before (an op that saved its output for its backward, then changed: refused).
    """

    kind: Literal["tanh", "relu", "gelu", "sigmoid", "softplus", "silu"] = "tanh"
    inplace: bool = False


IN_PLACE_KINDS = ("tanh", "relu", "sigmoid", "silu")
"""The activations torch has an in-place form of."""


@dataclass(frozen=True)
class TiedOut:
    """Logits against the input embedding table: ``h @ Eᵀ`` (``D`` must be its width)."""


@dataclass(frozen=True)
class Center:
    """``h - h.mean(0)``: couples the samples (only without ``batch_dim``)."""


@dataclass(frozen=True)
class StopGradient:
    """``h + 0.5 · tanh(h)`` with the second term computed without gradients: a stop-gradient
    target (an EMA teacher's output, a detached baseline) whose value depends on the
    parameters while its derivative is cut (NOTE [no_grad in forward mode]: torch's forward
    mode would push tangents through a ``no_grad`` block).

    ``form``: a ``torch.no_grad()`` block, ``h.detach()``, or ``torch.set_grad_enabled(False)``.
    """

    form: Literal["no_grad", "detach", "grad_disabled"] = "no_grad"


@dataclass(frozen=True)
class Route:
    """Rows sent by index values along the batch: ``h[order]`` and the like.

    ``order`` (one entry per sample, possibly repeated) is read modulo the batch size
    (``index_put`` writes the rows at ``argsort(order)``, a permutation). Cases that differ
    only in ``order`` have the same graph signature (NOTE [routing values]).
    """

    order: tuple[int, ...] = (0,)
    form: Literal["index", "gather", "index_select", "index_put"] = "index"


@dataclass(frozen=True)
class Gate:
    """A coupling of the samples opened by a per-sample selection, shut on the first call.

    ``h + select(mask, mix(h))``: ``mix`` is the batch mean's deviation or ``h.roll(2, 0)``
    (each sample reads the one two before it: within the even or the odd samples); the mask
    holds samples ``b % 3 == 1`` (middle ones, never the first; the last only when B = 2)
    once the case's ``open_gates`` switch is on (the repeated call, ``repeat="open_gates"``),
    none before; the selection is a ``where``, a ``masked_fill`` or a ReLU shut by a large
    shift (NOTE [opened selections]).
    """

    mix: Literal["mean", "roll"] = "mean"
    form: Literal["where", "masked_fill", "relu"] = "where"


@dataclass(frozen=True)
class Dropout:
    """``F.dropout`` in training mode: a random op.

    ``source``: the mask from torch's generator (``F.dropout``), from numpy's global one, or
    from :data:`HELD_GENERATOR`, a generator of this module that ``f`` reaches through the
    globals of the functions it calls (NOTE [host generators], NOTE [generators f holds]).
    """

    p: float = 0.5
    source: Literal["torch", "numpy", "held"] = "torch"


HELD_GENERATOR = np.random.default_rng(0)
"""The generator a :class:`Dropout` with ``source="held"`` draws from (:func:`seed_draws`)."""


def seed_draws(seed: int) -> None:
    """Seed every generator a case draws from: the oracle and the call see the same draw."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    HELD_GENERATOR.bit_generator.state = np.random.default_rng(seed).bit_generator.state


def host_draw_state() -> tuple[Any, ...]:
    """Where numpy's global generator and :data:`HELD_GENERATOR` stand (comparable with ``==``)."""
    _, key, *rest = np.random.get_state()
    return key.tobytes(), tuple(rest), HELD_GENERATOR.bit_generator.state


def _dropout(layer: Dropout, h: Tensor) -> Tensor:
    if layer.source == "torch":
        return F.dropout(h, layer.p, training=True)
    generator = np.random if layer.source == "numpy" else HELD_GENERATOR
    keep = generator.random(tuple(h.shape)) >= layer.p
    return h * torch.from_numpy(keep / (1 - layer.p)).to(h.dtype).to(h.device)


@dataclass(frozen=True)
class FusedRnn:
    """``torch.gru`` / ``torch.lstm`` over ``T``: one fused kernel for the whole sequence.

    ``bidirectional``: a second direction over the reversed steps (outputs side by side,
    width ``2 * hidden``); ``bias``: ``b_ih`` and ``b_hh``; ``layers`` stacked, with
    ``dropout`` between them in training mode (a random op when ``layers > 1``).
    """

    hidden: int
    kind: Literal["gru", "lstm"] = "gru"
    bidirectional: bool = False
    bias: bool = True
    layers: int = 1
    dropout: float = 0.0


def draws(case: FuzzCase) -> bool:
    """Whether the case's ``f`` draws random numbers (dropout layers, or inside a call)."""
    return any(isinstance(layer, Dropout)
               or (isinstance(layer, Attention) and layer.dropout > 0)
               or (isinstance(layer, FusedRnn) and layer.dropout > 0 and layer.layers > 1)
               for layer in case.layers)


Layer = (Linear | Conv1d | Attention | RnnCell | Norm | Elementwise | Kink | Distance | Linalg
         | Buffer | Positions | Activation | TiedOut | Center | StopGradient | Route | Gate
         | Dropout | FusedRnn)


@dataclass(frozen=True)
class Features:
    """Float inputs ``[B, T, D]`` (``flat``: ``[B, D]`` with ``T = 1``)."""

    width: int
    flat: bool = False


@dataclass(frozen=True)
class Tokens:
    """Token ids ``[B, T]`` looked up in an embedding table ``[vocab, width]``."""

    vocab: int
    width: int
    padding_idx: int | None = None
    scale_grad_by_freq: bool = False
    frozen: bool = False
    sparse: bool = False  # the table's gradient sparse (NOTE [sparse embedding gradients])
    max_norm: float | None = None  # rows renormalised in place (NOTE [probing])


@dataclass(frozen=True)
class Head:
    """The output, from ``h`` ``[B, T, D]``.

    * ``sq_mean``: ``h.pow(2).mean`` over the sample → ``[B]``;
    * ``ce``: cross-entropy of a linear classifier on ``h.mean(1)`` against labels → ``[B]``;
    * ``token_ce``: per-token cross-entropy of ``h`` (``D`` = classes) against targets
      ``[B, T]``, averaged over ``T`` → ``[B]``;
    * ``feat``: ``h.mean(1)`` → ``[B, D]``; ``seq``: ``h`` → ``[B, T, D]``;
    * ``dict`` / ``tuple``: a pytree of ``sq_mean`` and ``feat``.
    """

    kind: Literal["sq_mean", "ce", "token_ce", "feat", "seq", "dict", "tuple"] = "sq_mean"
    classes: int = 3


@dataclass(frozen=True)
class FuzzCase:
    """One generated architecture and call (see the module docstring)."""

    seed: int
    batch: int
    length: int
    input: Features | Tokens
    layers: tuple[Layer, ...]
    head: Head
    dtype: Literal["float32", "float64"] = "float64"
    batch_dim: int | None = None
    output_dim: int = 0
    input_dim: int = 0
    as_module: bool = False
    input_via: Literal["positional", "keyword"] = "positional"
    mixed_dtypes: bool = False
    layout: Literal["flat", "nested", "list"] = "flat"
    consts_via: Literal["closure", "positional", "keyword"] = "closure"
    params_at: Literal["first", "last", "split"] = "first"
    extra_leaves: bool = False
    has_aux: bool = False
    diagonal: bool = False
    per_leaf: bool = False
    chunk_size: int | None = None
    memory_budget: int | None = None
    repeat: Literal["none", "values", "skip_last", "open_gates"] = "none"
    head_extra: Literal["none", "expand", "constant", "input_gradient"] = "none"
    requires_grad: bool = False
    noncontiguous: bool = False
    alias_tied: bool = False
    grad_mode: Literal["enabled", "no_grad"] = "enabled"


# -- parameters ------------------------------------------------------------------------------


@dataclass
class _Param:
    layer: int
    name: str
    shape: tuple[int, ...]
    frozen: bool
    kind: Literal["weight", "ones", "zeros", "positive"] = "weight"


@dataclass
class Shapes:
    """The widths and lengths seen while walking a case's layers (for the strategy too)."""

    width: int
    length: int
    params: list[_Param] = field(default_factory=list)
    linears: dict[int, tuple[int, int]] = field(default_factory=dict)  # layer -> (out, in)


def _fan(shape: tuple[int, ...]) -> int:
    return max(1, math.prod(shape[1:]) if len(shape) > 1 else shape[0])


def conv_length(length: int, conv: Conv1d) -> int:
    """The output length of ``conv`` on ``length`` positions (may be < 1: invalid)."""
    span = conv.dilation * (conv.kernel - 1) + 1
    return (length + 2 * conv.padding - span) // conv.stride + 1


def without_dropout(case: FuzzCase) -> FuzzCase:
    """``case`` without its :class:`Dropout` layers (and dropout inside attention and stacked
    recurrent layers), ties pointing at their layers' new indices.

    A linear layer's ``tie`` is an index into ``case.layers``: dropping a layer before the tied
    one without renumbering crashed the fuzzer's own shape walk (the kernels' property in
    session 25, the concurrency property in session 41's long run).
    """
    kept = [i for i, layer in enumerate(case.layers) if not isinstance(layer, Dropout)]
    new_index = {old: new for new, old in enumerate(kept)}

    def renumbered(layer: Layer) -> Layer:
        if isinstance(layer, Linear) and layer.tie is not None:
            return replace(layer, tie=new_index[layer.tie])
        if isinstance(layer, Attention | FusedRnn) and layer.dropout > 0:  # dropout inside
            return replace(layer, dropout=0.0)
        return layer

    return replace(case, layers=tuple(renumbered(case.layers[i]) for i in kept))


def walk_shapes(case_input: Features | Tokens, length: int,
                layers: tuple[Layer, ...]) -> Shapes:
    """The parameters of each layer and the width/length after the last one.

    Raises ``ValueError`` for an inconsistent case (the strategy never makes one).
    """
    shapes = Shapes(case_input.width, 1 if isinstance(case_input, Features) and case_input.flat
                    else length)
    if isinstance(case_input, Tokens):
        shapes.params.append(_Param(-1, "table", (case_input.vocab, case_input.width),
                                    case_input.frozen))
    for i, layer in enumerate(layers):
        d = shapes.width
        add = shapes.params.append
        if isinstance(layer, Linear):
            if layer.tie is None:
                shapes.linears[i] = (layer.out, d)
                add(_Param(i, "weight", (layer.out, d), layer.frozen))
                if layer.bias:
                    add(_Param(i, "bias", (layer.out,), layer.frozen, "zeros"))
                shapes.width = layer.out
            else:
                out, width = shapes.linears[layer.tie]
                if layer.transposed:
                    out, width = width, out
                    if layer.bias:
                        add(_Param(i, "bias", (out,), layer.frozen, "zeros"))
                if width != d:
                    raise ValueError(f"layer {i} ties a weight of width {width} to width {d}")
                shapes.width = out
        elif isinstance(layer, Conv1d):
            add(_Param(i, "weight", (layer.out, d // layer.groups, layer.kernel), layer.frozen))
            if layer.bias:
                add(_Param(i, "bias", (layer.out,), layer.frozen, "zeros"))
            shapes.width = layer.out
            shapes.length = conv_length(shapes.length, layer)
        elif isinstance(layer, Attention):
            if layer.form == "sdpa":
                for name in ("q", "k", "v", "o"):
                    add(_Param(i, name, (d, d), layer.frozen))
                    if layer.bias:
                        add(_Param(i, f"{name}_bias", (d,), layer.frozen, "zeros"))
            else:
                add(_Param(i, "in_proj_weight", (3 * d, d), layer.frozen))
                add(_Param(i, "out_proj_weight", (d, d), layer.frozen))
                if layer.bias:
                    add(_Param(i, "in_proj_bias", (3 * d,), layer.frozen, "zeros"))
                    add(_Param(i, "out_proj_bias", (d,), layer.frozen, "zeros"))
        elif isinstance(layer, RnnCell | FusedRnn):
            gates = {"rnn_tanh": 1, "gru": 3, "lstm": 4}[layer.kind]
            frozen = getattr(layer, "frozen", False)
            directions = 2 if getattr(layer, "bidirectional", False) else 1
            for stacked in range(getattr(layer, "layers", 1)):
                width = d if stacked == 0 else layer.hidden * directions
                for suffix in ("", "_reverse")[:directions]:
                    suffix = _rnn_suffix(stacked, suffix)
                    add(_Param(i, f"w_ih{suffix}", (gates * layer.hidden, width), frozen))
                    add(_Param(i, f"w_hh{suffix}", (gates * layer.hidden, layer.hidden),
                               frozen))
                    if layer.bias:
                        add(_Param(i, f"b_ih{suffix}", (gates * layer.hidden,), frozen,
                                   "zeros"))
                        add(_Param(i, f"b_hh{suffix}", (gates * layer.hidden,), frozen,
                                   "zeros"))
            shapes.width = layer.hidden * directions
        elif isinstance(layer, Norm):
            if layer.affine:
                add(_Param(i, "weight", (d,), layer.frozen, "ones"))
                if layer.kind != "rms":
                    add(_Param(i, "bias", (d,), layer.frozen, "zeros"))
            if layer.kind == "batch_eval":
                add(_Param(i, "running_mean", (d,), True, "zeros"))
                add(_Param(i, "running_var", (d,), True, "positive"))
        elif isinstance(layer, Elementwise):
            if layer.kind == "scale_shift":
                add(_Param(i, "scale", (d,), layer.frozen, "ones"))
                add(_Param(i, "shift", (d,), layer.frozen, "zeros"))
            elif layer.kind == "slice":
                add(_Param(i, "scale", (d + 2,), layer.frozen, "ones"))
            elif layer.kind == "gram":
                add(_Param(i, "factor", (2, d), layer.frozen))
            else:
                add(_Param(i, "gate", (d,), layer.frozen))
        elif isinstance(layer, Kink):
            if layer.kind == "prelu":
                add(_Param(i, "slope", (1,), layer.frozen, "positive"))
        elif isinstance(layer, Distance):
            add(_Param(i, "anchors", (layer.anchors, d), layer.frozen))
            shapes.width = layer.anchors
        elif isinstance(layer, Linalg):
            add(_Param(i, "mix", (10, d), layer.frozen))
            if layer.kind in ("solve", "lu_solve"):
                add(_Param(i, "rhs", (3, d), layer.frozen))
        elif isinstance(layer, Buffer):
            shape = (d,) if layer.shape == "feature" else (1, shapes.length, d)
            add(_Param(i, "buffer", shape, True, "positive" if layer.op == "mul" else "weight"))
        elif isinstance(layer, Positions):
            add(_Param(i, "table", (shapes.length, d), layer.frozen))
        elif isinstance(layer, TiedOut):
            if not isinstance(case_input, Tokens) or d != case_input.width:
                raise ValueError(f"layer {i}: TiedOut needs the embedding's width")
            shapes.width = case_input.vocab
    return shapes


# -- the forward -----------------------------------------------------------------------------

Get = Callable[[int, str], Tensor]
"""``get(layer, name)``: the tensor of a parameter (or buffer) of a layer (``-1``: the input)."""


def forward(case: FuzzCase, get: Get, x: Tensor, labels: Tensor | None, *,
            skip_last: bool = False, open_gates: bool = False) -> Any:
    """The model of ``case`` on ``x`` (``[B, T, D]`` floats, or ``[B, T]`` ids), batch first.

    ``skip_last``: leave the last layer out; ``open_gates``: open the :class:`Gate` layers'
    masks (switches the call signature cannot see).
    """
    inp = case.input
    if isinstance(inp, Tokens):
        h = F.embedding(x, get(-1, "table"), padding_idx=inp.padding_idx,
                        max_norm=inp.max_norm, scale_grad_by_freq=inp.scale_grad_by_freq,
                        sparse=inp.sparse)
    else:
        h = x if not inp.flat else x[:, None]
        if any(isinstance(layer, Activation) and layer.inplace for layer in case.layers):
            h = h.clone()  # in-place layers never write into the caller's input
    for i, layer in enumerate(case.layers[:-1] if skip_last else case.layers):
        h = _gate(layer, h, open_gates) if isinstance(layer, Gate) else \
            _layer(case, i, layer, h, get)
    out = _head(case.head, h, get, labels)
    if case.mixed_dtypes:
        gain = get(-3, "gain")
        out = gain * out if isinstance(out, Tensor) else \
            type(out)(gain * t for t in out) if isinstance(out, tuple) else \
            {k: gain * v for k, v in out.items()}
    return out


def _gate(layer: Gate, h: Tensor, open_gates: bool) -> Tensor:
    """:class:`Gate`'s ``h + select(mask, mix(h))``."""
    mask = torch.tensor([open_gates and b % 3 == 1 for b in range(h.shape[0])],
                        device=h.device).reshape(-1, *(1,) * (h.dim() - 1))
    mixed = h - h.mean(0, keepdim=True) if layer.mix == "mean" else h.roll(2, 0)
    if layer.form == "where":
        return h + torch.where(mask, mixed, 0.0)
    if layer.form == "masked_fill":
        return h + mixed.masked_fill(~mask, 0.0)
    return h + torch.relu(mixed + torch.where(mask, 30.0, -30.0)) - 30.0 * mask  # shut


def _owner(case: FuzzCase, i: int) -> int:
    layer = case.layers[i]
    return layer.tie if isinstance(layer, Linear) and layer.tie is not None else i


def _weight(case: FuzzCase, i: int, get: Get) -> Tensor:
    """Layer ``i``'s weight: under its own name where the case aliases tied weights."""
    owner = _owner(case, i)
    if owner != i and case.alias_tied and not case.as_module:
        try:
            return get(i, "weight")
        except KeyError:  # the tied weight is frozen: no alias
            pass
    return get(owner, "weight")


def _layer(case: FuzzCase, i: int, layer: Layer, h: Tensor, get: Get) -> Tensor:
    if isinstance(layer, Linear):
        owner = _owner(case, i)
        w = _weight(case, i, get)
        if layer.transposed:
            w = w.T
            b = get(i, "bias") if layer.bias else None
        else:
            b = get(owner, "bias") if _has_bias(case, owner) else None
        if layer.form == "linear":
            return F.linear(h, w, b)
        if layer.form == "matmul_t":
            y = h @ w.T
        elif layer.form == "matmul":
            y = torch.matmul(h, w.t())
        elif layer.form == "einsum":
            y = torch.einsum("btd,od->bto", h, w)
        elif layer.form == "function":
            y = FunctionLinear.apply(h, w)
        elif layer.form == "function_old":
            y = OldStyleFunctionLinear.apply(h, w)
        elif layer.form == "script":  # TorchScript: calls no mode sees (NOTE [unseen uses])
            y = scripted_linear(h, w)
        elif layer.form == "compiled":  # NOTE [compiled code in f]
            y = compiled_linear(h, w)
        else:  # addmm on the flattened positions
            flat = h.reshape(-1, h.shape[-1])
            bias = b if b is not None else torch.zeros(w.shape[0], dtype=h.dtype)
            return torch.addmm(bias, flat, w.T).reshape(*h.shape[:-1], w.shape[0])
        return y if b is None else y + b
    if isinstance(layer, Conv1d):
        # one position: the same [B, D, 1] as a reshape, with a unit stride along T, since
        # torch 2.13's CPU conv1d crashes (SIGSEGV) on a transposed [B, 1, D] with stride 2,
        # padding 1, dilation 2 and a bias (FINDINGS.md, "torch 2.13 behaviours")
        x = h.reshape(h.shape[0], h.shape[2], 1) if h.shape[1] == 1 else h.transpose(1, 2)
        y = F.conv1d(x, get(i, "weight"), get(i, "bias") if layer.bias else None,
                     stride=layer.stride, padding=layer.padding, dilation=layer.dilation,
                     groups=layer.groups)
        return y.transpose(1, 2)
    if isinstance(layer, Attention):
        return _attention(layer, i, h, get)
    if isinstance(layer, RnnCell):
        return _rnn_cell(layer, i, h, get)
    if isinstance(layer, FusedRnn):
        names = ("w_ih", "w_hh", "b_ih", "b_hh") if layer.bias else ("w_ih", "w_hh")
        suffixes = ("", "_reverse") if layer.bidirectional else ("",)
        weights = [get(i, name + _rnn_suffix(stacked, suffix)) for stacked in range(layer.layers)
                   for suffix in suffixes for name in names]
        hx = h.new_zeros(len(suffixes) * layer.layers, h.shape[0], layer.hidden)
        flags = (layer.bias, layer.layers, layer.dropout, layer.dropout > 0,
                 layer.bidirectional, True)
        if layer.kind == "gru":
            out, _ = torch.gru(h, hx, weights, *flags)
        else:
            out, _, _ = torch.lstm(h, (hx, hx), weights, *flags)
        return out
    if isinstance(layer, Norm):
        return _norm(layer, i, h, get)
    if isinstance(layer, Elementwise):
        if layer.kind == "scale_shift":
            return h * get(i, "scale") + get(i, "shift")
        if layer.kind == "square_gate":
            return h * get(i, "gate") ** 2
        if layer.kind == "exp":
            return h * torch.exp(0.5 * get(i, "gate"))
        if layer.kind == "slice":
            return h * get(i, "scale")[1:-1]
        factor = get(i, "factor")
        return h + 0.5 * h @ (factor.T @ factor)
    if isinstance(layer, Kink):
        ties = torch.arange(h.shape[-1], device=h.device) % 2 == 0
        h = torch.where(ties, h - h.detach(), h)  # every other feature 0, with h's derivative
        if layer.kind == "prelu":
            return F.prelu(h, get(i, "slope"))
        zero = torch.zeros(h.shape[-1], dtype=h.dtype, device=h.device)
        if layer.kind == "clamp":
            return torch.clamp(h, min=zero, max=zero + 1)
        return torch.fmax(h, zero) if layer.kind == "fmax" else torch.fmin(zero, h)
    if isinstance(layer, Distance):
        return torch.cdist(h, get(i, "anchors"), p=layer.p)
    if isinstance(layer, Linalg):
        base = torch.diag(torch.tensor([2.0, 2.5, 3.0], dtype=h.dtype, device=h.device))
        m = base + torch.tanh(h @ get(i, "mix").T)[..., 1:].unflatten(-1, (3, 3)) / 4
        if layer.kind == "det":
            return h * torch.linalg.det(m)[..., None]
        if layer.kind == "slogdet":
            return h * torch.linalg.slogdet(m).logabsdet[..., None]
        b = (h @ get(i, "rhs").T)[..., None]
        x = torch.linalg.solve(m, b) if layer.kind == "solve" \
            else torch.linalg.lu_solve(*torch.linalg.lu_factor(m), b)
        return h + x.sum((-2, -1))[..., None]
    if isinstance(layer, Buffer):
        buffer = get(i, "buffer")
        return h + buffer if layer.op == "add" else h * buffer
    if isinstance(layer, Positions):
        return _positions(layer, get(i, "table"), h)
    if isinstance(layer, Activation):
        if layer.inplace and layer.kind in IN_PLACE_KINDS:
            return F.silu(h, inplace=True) if layer.kind == "silu" \
                else getattr(torch, f"{layer.kind}_")(h)
        return getattr(torch, layer.kind)(h) if layer.kind in ("tanh", "relu", "sigmoid") \
            else getattr(F, layer.kind)(h)
    if isinstance(layer, TiedOut):
        return h @ get(-1, "table").T
    if isinstance(layer, Center):
        return h - h.mean(0, keepdim=True)
    if isinstance(layer, StopGradient):
        if layer.form == "detach":
            target = torch.tanh(h.detach())
        else:
            with torch.no_grad() if layer.form == "no_grad" else torch.set_grad_enabled(False):
                target = torch.tanh(h)
        return h + 0.5 * target
    if isinstance(layer, Route):
        order = torch.tensor([k % h.shape[0] for k in layer.order[:h.shape[0]]]
                             + list(range(len(layer.order), h.shape[0])), device=h.device)
        if layer.form == "gather":
            return h.gather(0, order.reshape(-1, *(1,) * (h.dim() - 1)).expand_as(h))
        if layer.form == "index_select":
            return h.index_select(0, order)
        if layer.form == "index_put":
            return torch.zeros_like(h).index_put((torch.argsort(order, stable=True),), h)
        return h[order]
    if isinstance(layer, Dropout):
        return _dropout(layer, h)
    raise TypeError(layer)


def _positions(layer: Positions, table: Tensor, h: Tensor) -> Tensor:
    ids = torch.arange(h.shape[1], device=h.device)
    if layer.lookup in ("embedding", "flat"):
        pos = F.embedding(ids[None] if layer.lookup == "embedding" else ids, table)
    elif layer.lookup == "index":
        pos = table[ids[None]]
    elif layer.lookup == "slice":
        pos = table[:h.shape[1]]
    else:
        pos = table[ids].unsqueeze(0)
    if layer.write:
        pos = pos.mul_(1.5)
    if layer.uses == "merged":
        return (h.reshape(-1, h.shape[-1]) + pos.reshape(-1, pos.shape[-1])[:1]).reshape(h.shape)
    out = h + pos
    if layer.uses == "twice":
        return torch.tanh(out) + pos
    return out + pos.pow(2).sum() if layer.uses == "regularised" else out


def _rnn_suffix(stacked: int, direction: str) -> str:
    """A fused recurrent weight's name suffix: ``""``/``"_reverse"``, ``_l1`` from layer 1."""
    return direction if stacked == 0 else f"_l{stacked}{direction}"


def _has_bias(case: FuzzCase, owner: int) -> bool:
    layer = case.layers[owner]
    return isinstance(layer, Linear) and layer.bias


def _attention(layer: Attention, i: int, h: Tensor, get: Get) -> Tensor:
    batch, length, d = h.shape
    heads = layer.heads

    def bias(name: str) -> Tensor | None:
        return get(i, name) if layer.bias else None

    if layer.form == "sdpa":
        def split(name: str) -> Tensor:
            y = F.linear(h, get(i, name), bias(f"{name}_bias"))
            return y.reshape(batch, length, heads, d // heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(split("q"), split("k"), split("v"),
                                           is_causal=layer.causal)
        y = y.transpose(1, 2).reshape(batch, length, d)
        return F.linear(y, get(i, "o"), bias("o_bias"))
    seq = h.transpose(0, 1)
    mask = None
    if layer.causal:
        mask = torch.triu(torch.full((length, length), float("-inf"), dtype=h.dtype), 1)
    y, _ = F.multi_head_attention_forward(
        seq, seq, seq, d, heads, get(i, "in_proj_weight"), bias("in_proj_bias"), None, None,
        False, layer.dropout, get(i, "out_proj_weight"), bias("out_proj_bias"),
        training=layer.dropout > 0, need_weights=layer.weights, attn_mask=mask)
    return y.transpose(0, 1)


def _rnn_cell(layer: RnnCell, i: int, h: Tensor, get: Get) -> Tensor:
    w_ih, w_hh = get(i, "w_ih"), get(i, "w_hh")
    b_ih, b_hh = (get(i, "b_ih"), get(i, "b_hh")) if layer.bias else (None, None)
    state = h.new_zeros(h.shape[0], layer.hidden)
    cell = state
    outputs = []
    for t in range(h.shape[1]):
        if layer.kind == "lstm":
            state, cell = torch.lstm_cell(h[:, t], (state, cell), w_ih, w_hh, b_ih, b_hh)
        elif layer.kind == "gru":
            state = torch.gru_cell(h[:, t], state, w_ih, w_hh, b_ih, b_hh)
        else:
            state = torch.rnn_tanh_cell(h[:, t], state, w_ih, w_hh, b_ih, b_hh)
        outputs.append(state)
    return torch.stack(outputs, dim=1)


def _norm(layer: Norm, i: int, h: Tensor, get: Get) -> Tensor:
    d = h.shape[-1]
    weight = get(i, "weight") if layer.affine else None
    bias = get(i, "bias") if layer.affine and layer.kind != "rms" else None
    if layer.kind == "layer":
        return F.layer_norm(h, (d,), weight, bias)
    if layer.kind == "rms":
        return F.rms_norm(h, (d,), weight, eps=1e-5)  # the default eps depends on the dtype
    if layer.kind == "group":
        return F.group_norm(h.transpose(1, 2), layer.groups, weight, bias).transpose(1, 2)
    train = layer.kind == "batch_train"  # batch statistics, no running ones to update
    y = F.batch_norm(h.transpose(1, 2), None if train else get(i, "running_mean"),
                     None if train else get(i, "running_var"), weight, bias, training=train)
    return y.transpose(1, 2)


def _head(head: Head, h: Tensor, get: Get, labels: Tensor | None) -> Any:
    if head.kind == "sq_mean":
        return h.pow(2).mean((1, 2))
    if head.kind == "ce":
        assert labels is not None
        logits = F.linear(h.mean(1), get(-2, "weight"), get(-2, "bias"))
        return F.cross_entropy(logits, labels, reduction="none")
    if head.kind == "token_ce":
        assert labels is not None
        return F.cross_entropy(h.transpose(1, 2), labels, reduction="none").mean(1)
    if head.kind == "feat":
        return h.mean(1)
    if head.kind == "seq":
        return h
    loss, feat = h.pow(2).mean((1, 2)), h[:, -1]
    return {"loss": loss, "feat": feat} if head.kind == "dict" else (feat, loss)


def head_params(head: Head, width: int) -> list[_Param]:
    """The head's own parameters (layer index ``-2``)."""
    if head.kind != "ce":
        return []
    return [_Param(-2, "weight", (head.classes, width), False),
            _Param(-2, "bias", (head.classes,), False, "zeros")]


def output_rows_per_sample(head: Head, width: int, length: int) -> int:
    """``K``: output entries per sample."""
    return {"sq_mean": 1, "ce": 1, "token_ce": 1, "feat": width, "seq": length * width,
            "dict": 1 + width, "tuple": 1 + width}[head.kind]


# -- building a call -------------------------------------------------------------------------


@dataclass
class Built:
    """A case made concrete: ``tg.gramian(f, **options)(*args, **kwargs)``.

    ``oracle_f`` / ``oracle_args``: the same function as a positional-only call for
    ``dense_gramian`` (keywords bound), with ``argnums`` as in ``options``.
    """

    f: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    options: dict[str, Any]
    module: nn.Module | None = None
    switch: dict[str, bool] = field(
        default_factory=lambda: {"skip_last": False, "open_gates": False})

    @property
    def argnums(self) -> int | tuple[int, ...]:
        """The differentiated positions."""
        return self.options.get("argnums", 0)

    def oracle(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """``(g, args)`` with ``g(*args) == f(*args, **kwargs)``'s output (aux dropped)."""
        f, kwargs, has_aux = self.f, self.kwargs, self.options.get("has_aux", False)

        def g(*args: Any) -> Any:
            out = f(*args, **kwargs)
            return out[0] if has_aux else out

        return g, self.args


def rescaled(built: Built, factor: float) -> Built:
    """The same function (the same object: caches keyed on it hit) at parameters × factor."""
    argnums = built.argnums
    nums = {n % len(built.args) for n in ((argnums,) if isinstance(argnums, int) else argnums)}

    def scale(leaf: Any) -> Any:
        return leaf * factor if isinstance(leaf, Tensor) and leaf.is_floating_point() else leaf

    args = tuple(optree.tree_map(scale, arg) if i in nums else arg
                 for i, arg in enumerate(built.args))
    return Built(built.f, args, built.kwargs, built.options, built.module, built.switch)


def _values(params: list[_Param], generator: torch.Generator) -> dict[tuple[int, str], Tensor]:
    values = {}
    for param in params:
        if param.kind == "ones":
            value = 1 + 0.3 * torch.randn(param.shape, generator=generator, dtype=torch.float64)
        elif param.kind == "zeros":
            value = 0.3 * torch.randn(param.shape, generator=generator, dtype=torch.float64)
        elif param.kind == "positive":
            value = 0.5 + torch.rand(param.shape, generator=generator, dtype=torch.float64)
        else:
            value = torch.randn(param.shape, generator=generator, dtype=torch.float64) \
                / math.sqrt(_fan(param.shape))
        values[(param.layer, param.name)] = value
    return values


def _key(layer: int, name: str) -> str:
    return {-1: "embed", -2: "head", -3: "mix"}.get(layer, f"l{layer}") + "." + name


def build(case: FuzzCase, dtype: torch.dtype | None = None) -> Built:
    """The call of ``case`` in ``dtype`` (default: the case's own)."""
    dtype = dtype or getattr(torch, case.dtype)
    generator = torch.Generator().manual_seed(case.seed)
    shapes = walk_shapes(case.input, case.length, case.layers)
    params = shapes.params + head_params(case.head, shapes.width)
    if case.mixed_dtypes:
        params.append(_Param(-3, "gain", (1,), False, "ones"))
    values = {k: v.to(dtype) for k, v in _values(params, generator).items()}
    if case.mixed_dtypes:  # a float64 gain on the output beside the other leaves
        values[(-3, "gain")] = values[(-3, "gain")].double()
    if case.noncontiguous:  # matrices as transposed views: same values, other strides
        values = {k: v.T.contiguous().T if v.dim() == 2 else v for k, v in values.items()}
    frozen = {(p.layer, p.name) for p in params if p.frozen}
    if case.requires_grad:  # leaves the caller's own autograd tracks
        values = {k: v.requires_grad_() if k not in frozen else v for k, v in values.items()}
    buffers = {(p.layer, p.name): case.layers[p.layer] for p in params
               if p.layer >= 0 and isinstance(case.layers[p.layer], Buffer)}
    length = case.length
    x: Tensor
    if isinstance(case.input, Tokens):
        x = torch.randint(0, case.input.vocab, (case.batch, length), generator=generator)
        if case.input.padding_idx is not None:  # some padding, and a repeated token
            x[:, 0] = case.input.padding_idx
            x[0, -1] = x[-1, -1]
    elif case.input.flat:
        x = torch.randn(case.batch, case.input.width, generator=generator,
                        dtype=torch.float64).to(dtype)
    else:
        x = torch.randn(case.batch, length, case.input.width, generator=generator,
                        dtype=torch.float64).to(dtype)
    labels = None
    if case.head.kind == "ce":
        labels = torch.randint(0, case.head.classes, (case.batch,), generator=generator)
    elif case.head.kind == "token_ce":
        labels = torch.randint(0, shapes.width, (case.batch, shapes.length), generator=generator)
    x = x.movedim(0, case.input_dim)
    if case.requires_grad and x.is_floating_point():
        x.requires_grad_()
    if case.as_module:
        return _build_module(case, values, frozen, buffers, x, labels)
    return _build_function(case, values, frozen, buffers, x, labels)


def _differentiated(case: FuzzCase, model: Callable[[Tensor], Any], x: Tensor) -> Any:
    """``model(x)``; with ``head_extra="input_gradient"``, also each sample's squared gradient
    of the outputs' sum in its input: ``f`` differentiates itself (a physics-informed
    residual; NOTE [f that differentiates itself]). Attention runs its math kernel: the fused
    ones have no double backward, which the oracle needs (torchgram swaps it in itself)."""
    if case.head_extra != "input_gradient":
        return model(x)
    with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
        inputs = x.detach().requires_grad_()
        out = model(inputs)
        leaves = optree.tree_leaves(out)
        (grad,) = torch.autograd.grad(sum(leaf.sum() for leaf in leaves), inputs,
                                      create_graph=True)
    penalty = grad.pow(2).reshape(grad.shape[0], -1).sum(1).to(leaves[0].dtype)
    return {"out": out, "input_gradient": penalty}


def _finish(case: FuzzCase, out: Any, aux_source: Tensor) -> Any:
    """Add ``head_extra``, move the batch to ``output_dim`` in every output leaf; add aux."""
    def move(t: Tensor) -> Tensor:
        return t.movedim(0, case.output_dim % t.dim())

    if case.head_extra == "expand" and isinstance(out, Tensor):  # rows repeated, stride 0
        out = out[..., None].expand(*out.shape, 2)
    elif case.head_extra == "constant":  # rows that depend on no parameter
        dtype = optree.tree_leaves(out)[0].dtype
        const = aux_source.detach().reshape(aux_source.shape[0], -1).sum(1).to(dtype)
        out = {"out": out, "const": const}

    out = optree.tree_map(move, out)
    if case.has_aux:
        return out, {"hidden": aux_source.detach(), "tag": "aux"}
    return out


def _options(case: FuzzCase, argnums: int | tuple[int, ...], in_dims: Any) -> dict[str, Any]:
    options: dict[str, Any] = dict(argnums=argnums, has_aux=case.has_aux,
                                   diagonal=case.diagonal, per_leaf=case.per_leaf,
                                   chunk_size=case.chunk_size, memory_budget=case.memory_budget)
    if case.batch_dim is not None:
        options.update(batch_dim=case.batch_dim, in_dims=in_dims)
    return options


def _layout(case: FuzzCase, entries: Mapping[tuple[int, str], Tensor]) -> Any:
    """A pytree of ``entries`` in the case's layout, and a getter into it."""
    if case.layout == "flat":
        return {_key(*k): v for k, v in entries.items()}
    nested: dict[str, dict[str, Tensor]] = {}
    for (layer, name), value in entries.items():
        owner, _, leaf = _key(layer, name).partition(".")
        nested.setdefault(owner, {})[leaf] = value
    if case.layout == "nested":
        return nested
    return [(owner, tuple(sorted(group.items()))) for owner, group in sorted(nested.items())]


def _lookup(case: FuzzCase, tree: Any, layer: int, name: str) -> Tensor | None:
    key = _key(layer, name)
    if case.layout == "flat":
        return tree.get(key)
    owner, _, leaf = key.partition(".")
    if case.layout == "nested":
        return tree.get(owner, {}).get(leaf)
    for tree_owner, group in tree:
        if tree_owner == owner:
            return dict(group).get(leaf)
    return None


def _build_function(case: FuzzCase, values: dict[tuple[int, str], Tensor],
                    frozen: set[tuple[int, str]], buffers: dict[tuple[int, str], Layer],
                    x: Tensor, labels: Tensor | None) -> Built:
    trainable = {k: v for k, v in values.items() if k not in frozen}
    if case.alias_tied:  # a tied weight under each of its names: one tensor, two leaves
        for i, layer in enumerate(case.layers):
            if isinstance(layer, Linear) and layer.tie is not None \
                    and (layer.tie, "weight") in trainable:
                trainable[(i, "weight")] = trainable[(layer.tie, "weight")]
    consts = {k: v for k, v in values.items() if k in frozen and k not in buffers}
    via = {k: layer.via for k, layer in buffers.items() if isinstance(layer, Buffer)}
    closure_buffers = {k: v for k, v in values.items() if via.get(k) == "closure"}
    positional_buffers = [(k, v) for k, v in values.items() if via.get(k) == "positional"]
    keyword_buffers = {f"buf{k[0]}": v for k, v in values.items() if via.get(k) == "keyword"}
    # running stats of batch norms are buffers too: keep them with the constants
    if case.params_at == "split":
        keys = sorted(trainable)
        first = {k: trainable[k] for k in keys[::2]}
        second = {k: trainable[k] for k in keys[1::2]}
        groups = [_layout(case, first), _layout(case, second)]
    else:
        groups = [_layout(case, trainable)]
    if case.extra_leaves:
        dtype = x.dtype if x.is_floating_point() else getattr(torch, case.dtype)
        extra = {"unused": torch.ones(2, dtype=dtype), "marker": torch.empty(0, dtype=dtype),
                 "step": torch.tensor(3), "gain": 0.5, "name": "extra"}  # NOTE [empty leaves]
        groups[0] = {"model": groups[0], "extra": extra}
    const_tree = _layout(case, consts)

    # positional layout: [params?, x?, labels?, *buffers, consts?, params?]
    inputs: list[Any] = [x] if case.input_via == "positional" else []
    in_dims: list[int | None] = [case.input_dim] if case.input_via == "positional" else []
    if labels is not None:
        inputs.append(labels)
        in_dims.append(0)
    for _, value in positional_buffers:
        inputs.append(value)
        in_dims.append(None)
    kwargs: dict[str, Any] = dict(keyword_buffers)
    if case.input_via == "keyword":
        kwargs["x"] = x
    if case.consts_via == "positional":
        inputs.append(const_tree)
        in_dims.append(None)
    elif case.consts_via == "keyword":
        kwargs["consts"] = const_tree
    if case.params_at == "first":
        args = (groups[0], *inputs)
        argnums: int | tuple[int, ...] = 0
    elif case.params_at == "last":
        args = (*inputs, groups[0])
        argnums = -1
    else:
        args = (groups[0], *inputs, groups[1])
        argnums = (0, -1)
    num_inputs = len(inputs)
    switch = {"skip_last": False, "open_gates": False}
    positional_keys = [k for k, _ in positional_buffers]

    def f(*args: Any, **kwargs: Any) -> Any:
        if case.params_at == "first":
            trees, rest = [args[0]], args[1:]
        elif case.params_at == "last":
            trees, rest = [args[-1]], args[:-1]
        else:
            trees, rest = [args[0], args[-1]], args[1:-1]
        assert len(rest) == num_inputs
        if case.extra_leaves:
            trees[0] = trees[0]["model"]
        rest = list(rest)
        xb = rest.pop(0) if case.input_via == "positional" else kwargs["x"]
        lab = rest.pop(0) if labels is not None else None
        pos_buffers = {k: rest.pop(0) for k in positional_keys}
        const = rest.pop(0) if case.consts_via == "positional" else \
            kwargs["consts"] if case.consts_via == "keyword" else const_tree

        def get(layer: int, name: str) -> Tensor:
            key = (layer, name)
            if key in buffers:
                b = buffers[key]
                assert isinstance(b, Buffer)
                return closure_buffers[key] if b.via == "closure" else \
                    pos_buffers[key] if b.via == "positional" else kwargs[f"buf{layer}"]
            for tree in (*trees, const):
                value = _lookup(case, tree, layer, name)
                if value is not None:
                    return value
            raise KeyError(key)

        xb = xb.movedim(case.input_dim, 0)
        out = _differentiated(case, lambda inputs: forward(
            case, get, inputs, lab, skip_last=switch["skip_last"],
            open_gates=switch["open_gates"]), xb)
        return _finish(case, out, xb)

    keyword_dims = {name: case.input_dim if name == "x" else None for name in kwargs}
    in_dims_value: tuple[Any, ...] = (*in_dims, keyword_dims) if keyword_dims else tuple(in_dims)
    return Built(f, args, kwargs, _options(case, argnums, in_dims_value), switch=switch)


class _Holder(nn.Module):
    """A layer's parameters and buffers, as registered attributes."""


class FuzzModule(nn.Module):
    """The case's model as an ``nn.Module`` (for ``tg.functionalize``)."""

    def __init__(self, case: FuzzCase, values: dict[tuple[int, str], Tensor],
                 frozen: set[tuple[int, str]], buffers: dict[tuple[int, str], Layer]) -> None:
        super().__init__()
        self.case = case
        self.switch = {"skip_last": False, "open_gates": False}
        owners: dict[str, _Holder] = {}
        for (layer, name), value in values.items():
            owner = _key(layer, name).partition(".")[0]
            holder = owners.get(owner)
            if holder is None:
                holder = owners[owner] = _Holder()
                self.add_module(owner, holder)
            if (layer, name) in buffers or name.startswith("running_"):
                holder.register_buffer(name, value.detach().clone())
            else:
                holder.register_parameter(name, nn.Parameter(value.detach().clone(),
                                                             requires_grad=(layer, name)
                                                             not in frozen))

    def forward(self, x: Tensor, labels: Tensor | None = None) -> Any:
        """The case's forward (batch first inside, moved as the case says)."""
        def get(layer: int, name: str) -> Tensor:
            owner, _, leaf = _key(layer, name).partition(".")
            return getattr(getattr(self, owner), leaf)

        xb = x.movedim(self.case.input_dim, 0)
        out = _differentiated(self.case, lambda inputs: forward(
            self.case, get, inputs, labels, skip_last=self.switch["skip_last"],
            open_gates=self.switch["open_gates"]), xb)
        return _finish(self.case, out, xb)


def _build_module(case: FuzzCase, values: dict[tuple[int, str], Tensor],
                  frozen: set[tuple[int, str]], buffers: dict[tuple[int, str], Layer],
                  x: Tensor, labels: Tensor | None) -> Built:
    module = FuzzModule(case, values, frozen, buffers)
    fn, params = tg.functionalize(module)
    inputs: tuple[Any, ...] = (x,) if labels is None else (x, labels)
    in_dims = (case.input_dim,) if labels is None else (case.input_dim, 0)
    if case.params_at == "last":
        def f(*args: Any) -> Any:
            return fn(args[-1], *args[:-1])

        return Built(f, (*inputs, params), {}, _options(case, -1, in_dims), module,
                     module.switch)
    return Built(fn, (params, *inputs), {}, _options(case, 0, in_dims), module, module.switch)
