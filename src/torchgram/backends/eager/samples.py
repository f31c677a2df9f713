"""Where the samples are in a tensor of an eager graph, from its shape and a probe.

# NOTE [sample layouts]
With ``batch_dim``, output row ``(b, k)`` depends on sample ``b`` only, so its cotangent at
any tensor that *carries the samples* lives on sample ``b``'s slice of it: one backward per
row direction ``k`` (cotangent 1 at ``(b, k)`` for every ``b``) gives every sample's
cotangent at once (NOTE [structured passes]). The functional path finds each tensor's
sample dimension by comparing its shape with a trace of one sample; eager code cannot be
re-run, so here a :class:`SampleLayout` is found from the shape alone and, when that is
not enough, from a probe:

* **candidates**: the dims where a rule allows samples (not a feature dim; for a parameter
  broadcast by ``x ⊙ p``, ``x + p`` or ``p.expand``, the dims it is broadcast along) whose
  size is ``B``, and those of size ``n·B`` holding the samples outermost (``index // n``)
  or innermost (``index % B``) — e.g. ``[B·T, d]`` or ``[T·B, d]`` after a reshape (GPT-2's
  ``Conv1D``: ``addmm`` on ``x.view(-1, d)``);
* **probe**: a backward whose cotangent is 1 on every row of one sample ``s`` only: under the
  promise, its cotangent at a tensor carrying the samples is exactly zero outside sample
  ``s``'s slice, so a candidate for which it is not is wrong, and a tensor for which every
  candidate fails does not carry the samples (it is shared by all samples, or they interact:
  the exact answer is then the rows of the whole batch). The probes: the first sample, the
  last, and groups of samples that **separate every pair** (a probe of several samples must
  be zero outside their slices), their rows carrying NaN (NOTE [NaN probes]). The
  first and the last alone saw nothing when both their rows were zero functions (a dropout
  had zeroed their outputs) while the others' rows reached every sample through a batch
  mean (session 23: ``G`` 0.36 off, relative); even- and odd-numbered groups were then
  added, which take in every sample but do not see samples exchanged within a group:
  ``model(x)[perm]`` with ``perm = [0, 3, 2, 1, 4, 5]`` was 1.6 off (absolute; session 28).
  Now sample ``b`` gets a distinct ``⌊n/2⌋``-subset ``code(b)`` of ``n`` groups (the smallest
  ``n`` with enough subsets: 4 groups for 6 samples, 8 for 64, 13 for 1024) and group ``j``
  holds the samples whose code has ``j``: for any ``b ≠ c``, some group holds ``b`` and not
  ``c`` (equal-size subsets never contain one another), so a cotangent moving from ``b`` to
  ``c`` is seen, whatever the permutation, duplication or mixing.

NOTE [NaN probes]
The probes' rows carry NaN, not ones. A probe's outcome is cached for the signature, so it
must see every path along which a later call's cotangents can move between samples, not
only those this call's values leave open: ``h + w · mix(h)`` with ``w = 0`` on the first
step (a ramp-up weight, a gate initialised at zero) gave exactly zero cotangents through
``mix``, the cached layouts were per sample, and every later step was wrong (7 to 22% off,
session 28). NaN goes through a product with zero (``NaN · 0 = NaN``) and never cancels, so
a probe reaches every tensor a path of products leads to. What selects rather than
multiplies still stops it (a ReLU's mask, ``where``, an index): a coupling that only a
closed ReLU hid on the first call is not seen. Under ``torch.autograd.set_detect_anomaly``
(which raises on NaN gradients) the rows carry fixed random weights in ``[1, 2)``.

NOTE [finite twins]
NaN stops where code replaces it: a custom ``autograd.Function`` whose backward returns
``nan_to_num(...)`` (a "safe" square root or norm), or a gradient hook added after the
``record()`` block that cleans its gradient (``torch.nan_to_num``, ``where(isnan, 0, g)``),
turned a probe's NaN into zeros where samples interact: the layouts were per sample, cached,
and ``G`` 4e-2 to 0.15 off, on every later step too (session 60's hunt). So each probe has a
twin of the same samples whose rows carry the fixed weights in ``[1, 2)`` (the ones used under
anomaly mode): finite cotangents pass such code unchanged. A layout must hold for both, so the
twins only ever see more; what hides from both at once (a product with zero *and* a NaN
cleaner on one path, in one call) is not seen. The twins double the probes' rows, on the first
call of a signature only.

A recorded output shared by the samples (``[1, T, d]`` position embeddings) has no layout of
its own; it is read per sample where it meets the batch (:class:`SharedSamples`, NOTE
[eager shared taps]).

Probes cost one more backward, so their outcome is cached per signature of the recording
(the calls, their shapes and ``B``) and of the whole graph, the code after the ``record()``
block included (NOTE [graph signatures] in ``_core/_torch_compat.py``: before session 40 a
centred loss computed after the block reused a per-sample call's layouts, 1.0 off), like the
functional path caches its traces: a training loop pays it on its first step only.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from torch import Tensor

from torchgram._core.per_sample import separating_groups
from torchgram._core.signature import LruCache
from torchgram.backends.structured.rules.base import Layout
from torchgram.backends.structured.rules.conv import ConvLayout
from torchgram.backends.structured.rules.elementwise import BroadcastLayout
from torchgram.backends.structured.rules.embedding import EmbeddingLayout
from torchgram.backends.structured.rules.linear import (
    LinearLayout,
    MatmulLeftLayout,
    MatmulRightLayout,
)
from torchgram.backends.structured.rules.norm import GroupNormLayout, LayerNormLayout


@dataclass(frozen=True)
class SampleLayout:
    """Samples along ``dim``, whose ``outer · B · inner`` entries are indexed ``(o, b, i)``.

    Example:
        >>> import torch
        >>> x = torch.arange(12).reshape(2, 6)        # dim 1 holds (3 positions, B=2)
        >>> SampleLayout(1, outer=3, inner=1).view(x, 0, 2)[1]  # sample 1: odd columns
        tensor([[ 1,  3,  5],
                [ 7,  9, 11]])
    """

    dim: int
    outer: int = 1
    inner: int = 1

    def view(self, tensor: Tensor, lead: int, samples: int) -> Tensor:
        """``[*lead, *shape]`` as ``[*lead, B, *per-sample shape]`` (``dim``'s size over ``B``)."""
        d = lead + self.dim
        split = tensor.unflatten(d, (self.outer, samples, self.inner)).movedim(d + 1, lead)
        return split.flatten(d + 1, d + 2)

    def per_sample_shape(self, shape: Sequence[int], samples: int) -> tuple[int, ...]:
        """The shape of one sample's slice (a size-1 dim stays where the samples were)."""
        out = list(shape)
        out[self.dim] //= samples
        return tuple(out)


@dataclass(frozen=True)
class SharedSamples:
    """A shared output ``y`` read per sample from ``z``, where it meets the batch.

    Stands for a :class:`SampleLayout` of the tap (same ``view`` and ``per_sample_shape``),
    but ``view`` takes the cotangents at ``z`` (NOTE [eager shared taps]).

    Attributes:
        at: The samples' layout in ``z``.
        shape: ``y``'s shape.
        scale: ``∂z/∂y`` entry by entry.

    Example:
        >>> import torch
        >>> shared = SharedSamples(SampleLayout(0), (1, 3), scale=2.0)
        >>> cot_z = torch.arange(6.).reshape(1, 2, 3)   # one direction, B = 2 samples of [3]
        >>> shared.view(cot_z, 1, 2)                     # each sample's cotangent at y
        tensor([[[[ 0.,  2.,  4.]],
        <BLANKLINE>
                 [[ 6.,  8., 10.]]]])
    """

    at: SampleLayout
    shape: tuple[int, ...]
    scale: float = 1.0

    def per_sample_shape(self, shape: Sequence[int], samples: int) -> tuple[int, ...]:
        """``y``'s shape: every sample sees all of it."""
        del shape, samples
        return self.shape

    def view(self, cot: Tensor, lead: int, samples: int) -> Tensor:
        """``[*lead, *z.shape]`` cotangents at ``z`` as ``[*lead, B, *y.shape]`` at ``y``."""
        per = self.at.view(cot, lead, samples)  # [*lead, B, *z per sample]
        start = lead + 1
        z_shape = per.shape[start:]
        extra = len(z_shape) - len(self.shape)
        dims = [start + i for i in range(extra)] + [
            start + extra + i for i, size in enumerate(self.shape)
            if size == 1 and z_shape[extra + i] != 1]
        summed = per.sum(dims, keepdim=True) if dims else per
        summed = summed.reshape(*per.shape[:start], *self.shape)
        return summed * self.scale if self.scale != 1.0 else summed

    def act_view(self, act: Tensor, samples: int) -> Tensor:
        """A call's activation, the same for every sample: ``[B, *act.shape]``."""
        return act.unsqueeze(0).expand(samples, *act.shape)


def candidates(shape: Sequence[int], samples: int, dims: Sequence[int]) -> list[SampleLayout]:
    """The layouts the shape allows, among ``dims`` (NOTE [sample layouts]).

    Example:
        >>> candidates((32, 48, 128), 32, [0, 1])
        [SampleLayout(dim=0, outer=1, inner=1)]
        >>> candidates((2048, 128), 32, [0])
        [SampleLayout(dim=0, outer=1, inner=64), SampleLayout(dim=0, outer=64, inner=1)]
    """
    exact = [SampleLayout(d) for d in dims if shape[d] == samples]
    found = []
    for d in dims:
        size = shape[d]
        if size > samples and size % samples == 0:
            found += [SampleLayout(d, 1, size // samples), SampleLayout(d, size // samples, 1)]
    return exact + found


def allowed_dims(layout: Layout, shape: Sequence[int],
                 act_shape: Sequence[int] | None) -> list[int]:
    """The dims of a recognised call's output that may hold its samples.

    Feature dims never do (the last one of a linear layer's output, the channels of a
    convolution, ...); the activation must have the same size there (``act_shape``).
    """
    ndim = len(shape)
    if isinstance(layout, ConvLayout | GroupNormLayout):
        dims = [0] if ndim == (layout.nd + 2 if isinstance(layout, ConvLayout) else ndim) \
            and ndim >= 2 else []
    elif isinstance(layout, MatmulLeftLayout):
        dims = [] if layout.act_is_vector or layout.out_is_scalar_per_column \
            else [d for d in range(ndim) if d != ndim - 2]
    elif isinstance(layout, MatmulRightLayout) and act_shape is not None \
            and len(act_shape) == ndim + 1:  # ``a @ w`` with a vector ``w``: no feature dim
        dims = list(range(ndim))
    elif isinstance(layout, LinearLayout | EmbeddingLayout):
        dims = list(range(ndim - 1))
    elif isinstance(layout, LayerNormLayout):
        dims = list(range(ndim - len(layout.normalized_shape)))
    elif isinstance(layout, BroadcastLayout):  # ``x ⊙ p``, ``x + p``, ``p.expand``: the
        dims = [d for d in range(ndim) if d not in layout.width_dims]  # dims p is broadcast on
        if act_shape is not None and len(act_shape) != ndim:  # ``x`` broadcast too: the
            return []  # per-sample product would need its own alignment
    else:
        dims = []
    if act_shape is not None:
        if len(act_shape) < ndim - (1 if isinstance(layout, EmbeddingLayout) else 0):
            return []
        dims = [d for d in dims if d < len(act_shape) and act_shape[d] == shape[d]]
    return dims


def localized(probe: Tensor, layout: SampleLayout, members: Sequence[int], samples: int) -> bool:
    """Whether ``probe`` (the cotangent of ``members``' rows) is zero outside their slices."""
    per_sample = layout.view(probe, 0, samples)
    inside = set(members)
    outside = [b for b in range(samples) if b not in inside]
    return not outside or not bool(per_sample[outside].any())


class Choice:
    """The outcome of choosing one tensor's layout (NOTE [sample layouts]).

    ``shared``: the tap is read where it meets the batch, whose layout is ``layout``.
    """

    def __init__(self, layout: SampleLayout | None, reason: str = "",
                 shared: SharedSamples | None = None) -> None:
        self.layout = layout
        self.reason = reason
        self.shared = shared

    def __repr__(self) -> str:
        return f"Choice({self.shared or self.layout}, {self.reason!r})"


def choose(options: Sequence[SampleLayout],
           probes: Sequence[tuple[Sequence[int], Tensor | None]], samples: int) -> Choice:
    """Pick the layout the probes allow: exactly one candidate must survive them all.

    ``probes`` are ``(samples probed, cotangent)`` pairs (``None``: the probe did not reach
    the tensor: its cotangent is zero). A choice with ``layout=None`` says why there is none.
    """
    if not options:
        return Choice(None, "no dimension of its shape holds the samples")
    informative = [(s, p) for s, p in probes if p is not None and bool(p.any())]
    surviving = [layout for layout in options
                 if all(localized(p, layout, s, samples) for s, p in informative)]
    if not surviving:
        return Choice(None, "its cotangent for one sample spreads over other samples: it is "
                            "shared by the samples, or they interact")
    if len(surviving) == 1 and (informative or len(options) == 1):
        return Choice(surviving[0])
    return Choice(None, "the shape and the probes leave its samples' dimension ambiguous")


def probe_samples(samples: int) -> tuple[tuple[int, ...], ...]:
    """The groups of samples probed: the first, the last, and groups separating every pair.

    The separating groups are :func:`~torchgram._core.per_sample.separating_groups` (NOTE
    [sample layouts]); groups equal to an earlier one are dropped.

    Example:
        >>> probe_samples(5)
        ((0,), (4,), (0, 1, 2), (0, 3, 4), (1, 3), (2, 4))
        >>> len(probe_samples(64)), len(probe_samples(1024))
        (10, 15)
    """
    if samples <= 2:
        return tuple((b,) for b in range(samples))
    found: list[tuple[int, ...]] = [(0,), (samples - 1,)]
    found += [group for group in separating_groups(samples) if group not in found]
    return tuple(found)


def twinned(groups: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """Each probe's group twice: first the NaN probes, then their finite twins.

    NOTE [finite twins]; :meth:`~torchgram.backends.eager.rows.Rows.probe_seeds` gives the
    rows from ``len(groups)`` on finite weights.

    Example:
        >>> twinned(((0,), (1,)))
        ((0,), (1,), (0,), (1,))
    """
    return (*groups, *groups)


LAYOUT_CACHE = LruCache[tuple[Choice, ...]](maxsize=64)
"""Chosen layouts by signature (NOTE [sample layouts])."""


def signature(*parts: Hashable) -> Hashable:
    """A cache key from hashable parts (shapes, names, sizes)."""
    return tuple(parts)


def numel(shape: Sequence[int]) -> int:
    """Number of entries of a shape."""
    return math.prod(shape)
