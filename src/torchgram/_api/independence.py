"""``torchgram.check_independence``: does ``f`` really keep its samples apart on this batch?

``batch_dim`` is a promise: output entry ``b`` along it depends on sample ``b`` of the
batched inputs only. torchgram checks what it can on every call (NOTE [per-sample]); this
opt-in check verifies the promise itself on a given batch, by perturbation: each sample's
inputs are changed in turn and every other sample's outputs must stay as they were. The
random-number state is the same for every evaluation, so dropout does not hide or fake an
interaction.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch import Tensor

from torchgram._api.pipeline import outside_compile, wraps_user_function
from torchgram._core.census import OpCensus
from torchgram._core.checks import fail, function_name
from torchgram._core.errors import OutputChanged, output_changes_refused
from torchgram._core.functional import public_call
from torchgram._core.hooked_modules import puts_back_hooked_attributes
from torchgram._core.options import Options
from torchgram._core.per_sample import working_tolerance
from torchgram._core.problem import (
    Problem,
    build_problem,
    concat_rows,
    forget_probe,
    replace_input_leaves,
)

_API = "torchgram.check_independence"


@dataclass(frozen=True)
class Independence:
    """The result of :func:`check_independence`.

    Attributes:
        independent: Whether no sample's outputs moved when another sample's inputs did,
            and no call known to make samples interact ran.
        interactions: ``(b, c)`` pairs: changing sample ``b``'s inputs moved sample ``c``'s
            outputs (``b != c``).
        coupling_ops: Calls of ``f`` known to make samples interact (batch-norm in training
            mode, ``scale_grad_by_freq`` embeddings).
        samples_checked: The samples whose inputs were changed.
    """

    independent: bool
    interactions: tuple[tuple[int, int], ...]
    coupling_ops: tuple[str, ...]
    samples_checked: tuple[int, ...]

    def __str__(self) -> str:
        if self.independent:
            return (f"{_API}: the samples are independent on this batch (checked by changing "
                    f"samples {list(self.samples_checked)}).")
        lines = [f"{_API}: the samples interact on this batch."]
        if self.interactions:
            shown = ", ".join(f"{b}→{c}" for b, c in self.interactions[:8])
            more = "" if len(self.interactions) <= 8 else f" (+{len(self.interactions) - 8})"
            lines.append(f"Changing sample b moved sample c: {shown}{more}.")
        if self.coupling_ops:
            lines.append("Calls that mix samples: " + "; ".join(self.coupling_ops) + ".")
        lines.append("torchgram then returns the coupled Gramian (what batch_dim=None gives).")
        return "\n".join(lines)

    def _repr_markdown_(self) -> str:
        return str(self).replace("\n", "  \n")


def check_independence(
    f: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    batch_dim: int = 0,
    in_dims: Any = 0,
    has_aux: bool = False,
    samples: Sequence[int] | None = None,
) -> Callable[..., Independence]:
    """Check, on a given batch, that ``f``'s samples do not interact (``batch_dim``'s promise).

    Each sample's batched inputs (selected by ``in_dims``, as for :func:`torchgram.gramian`)
    are changed in turn — floating inputs by about their own size, integer inputs (token
    ids, masks) by the next sample's values — and ``f`` is evaluated without gradients,
    always from the same random-number state; every other sample's outputs must not move
    beyond round-off. Calls known to mix samples are reported too. It costs one forward of
    the batch per checked sample. A coupling whose effect on the other samples stays below
    the dtype's round-off passes (in float32, ``h + 0.01 · h.mean(0)`` at B = 256; float64
    sees it).

    Args:
        f: The function, as for :func:`torchgram.gramian`.
        argnums: As for :func:`torchgram.gramian` (the differentiated arguments are not
            perturbed).
        batch_dim: The output dimension that indexes samples.
        in_dims: Where the samples are in the inputs, as for :func:`torchgram.gramian`.
        has_aux: As for :func:`torchgram.gramian`.
        samples: The samples to change (default: all of them).

    Returns:
        A function of ``f``'s arguments returning an :class:`Independence` report.

    Example:
        >>> import torch, torchgram as tg
        >>> _ = torch.manual_seed(0)
        >>> w = torch.randn(3)
        >>> x = torch.randn(5, 3)
        >>> tg.check_independence(lambda w, x: torch.tanh(x @ w))(w, x).independent
        True
        >>> report = tg.check_independence(lambda w, x: (x - x.mean(0)) @ w)(w, x)
        >>> report.independent, report.interactions[:2]
        (False, ((0, 1), (0, 2)))
    """
    options = Options.validate(_API, f, argnums, has_aux=has_aux, batch_dim=batch_dim,
                               in_dims=in_dims)
    if batch_dim is None:  # Options accepts it for the transforms; here it is the point
        fail(_API, "batch_dim, the output dimension that indexes samples (an int)", "None",
             "Pass batch_dim=0 (or the dim of f's output that indexes the samples).", TypeError)
    chosen_samples = _checked_samples(samples)

    @wraps_user_function(f)
    @outside_compile  # NOTE [torch.compile]: dynamo traced into the call (raw errors)
    @public_call  # NOTE [inference mode], NOTE [the caller's function modes]
    @puts_back_hooked_attributes(_API, f)  # NOTE [tensors hooks set]
    def check_f(*args: Any, **kwargs: Any) -> Independence:
        problem = build_problem(options, f, args, kwargs)
        try:
            return _check(problem)
        except OutputChanged:  # a cached probe went stale (an id reused): probe afresh, once
            problem.draw.rewind()  # the call starts afresh, from its own random state
            forget_probe(problem)
            problem = build_problem(options, f, args, kwargs, fresh=True)
            with output_changes_refused(_API, problem.draw.rewind):
                return _check(problem)

    def _check(problem: Problem) -> Independence:
        batch = problem.batch
        assert batch is not None
        chosen = tuple(range(batch.size)) if chosen_samples is None else chosen_samples
        for b in chosen:
            if not 0 <= b < batch.size:
                fail(_API, f"samples within [0, {batch.size})", f"sample {b}",
                     "Name samples of the batch.")
        census = OpCensus()
        with census:
            reference = _rows(problem, batch.tensors)
        index = problem.sample_major_index  # [B, K] output rows of each sample
        scale = reference.abs().max()
        rtol = 10 * working_tolerance(problem)
        interactions = []
        generator = torch.Generator().manual_seed(0)
        for b in chosen:
            moved = _rows(problem, _changed(batch.tensors, batch.dims, b, batch.size,
                                            generator))
            changed = ((moved - reference).abs() > rtol * (scale + reference.abs()))[index]
            interactions += [(b, c) for c in changed.any(dim=1).nonzero().flatten().tolist()
                             if c != b]
        problem.draw.finish()
        return Independence(not interactions and not census.coupling, tuple(interactions),
                            tuple(census.coupling), chosen)

    check_f.__doc__ = (f"Checks that {function_name(f)} keeps its samples apart "
                       f"(batch_dim={batch_dim}); built by {_API}.")
    return check_f


def _checked_samples(samples: Any) -> tuple[int, ...] | None:
    """``samples`` as a tuple of ints (``None``: all), checked when the function is built."""
    if samples is None:
        return None
    if hasattr(samples, "tolist") and not isinstance(samples, list | tuple):
        samples = samples.tolist()  # a tensor or an array of indices (floats stay refused)
    if isinstance(samples, Iterable) and not isinstance(samples, str | bytes):
        samples = list(samples)  # a set, a range, dict keys, a generator
    if not isinstance(samples, list) or any(
            isinstance(b, bool) or not isinstance(b, int | numbers.Integral) for b in samples):
        fail(_API, "samples to be a sequence of sample indices (ints), or None for all",
             f"{type(samples).__name__} {samples!r:.60}", "Pass e.g. samples=[0, 3].",
             TypeError)
    if not samples:  # a check of nothing would say "independent" (an exhausted generator)
        fail(_API, "at least one sample to change", "an empty selection",
             "Pass samples=None for all of them, or name some: samples=[0, 3].")
    return tuple(dict.fromkeys(int(b) for b in samples))  # each once, in order


def _rows(problem: Problem, inputs: tuple[Tensor, ...]) -> Tensor:
    """``f``'s output rows on the batch with ``inputs`` as its batched tensors, no gradient."""
    batch = problem.batch
    assert batch is not None
    args, kwargs = replace_input_leaves(problem.args, problem.kwargs, batch.positions, inputs)
    with torch.no_grad():
        out, _ = problem.call(problem.leaves, args, kwargs)
    out_leaves, treespec = optree.tree_flatten(out)
    problem.output.check(out_leaves, treespec, per_sample=False)  # the probe's structure
    return concat_rows(out_leaves, problem.output.dtype)


def _changed(tensors: tuple[Tensor, ...], dims: tuple[int, ...], sample: int, size: int,
             generator: torch.Generator) -> tuple[Tensor, ...]:
    """The batched inputs with sample ``sample`` changed (floats moved, integers replaced).

    A float moves by about its own size (``(|x| + 1) · N(0, 1)``): a coupling moves the other
    samples in proportion, and a nudge of 1e-2 left ``h + 0.05 · h.mean(0)`` in float32
    below round-off at B = 8 (``independent=True`` where the per-sample G was 9.7e-2 off;
    session 59's hunt).
    """
    changed = []
    for tensor, dim in zip(tensors, dims, strict=True):
        moved = tensor.clone()
        target = moved.narrow(dim, sample, 1)
        if tensor.is_floating_point() or tensor.is_complex():
            noise = torch.randn(target.shape, generator=generator).to(tensor.dtype)
            target.add_((target.abs() + 1) * noise.to(tensor.device))
        elif size > 1:
            target.copy_(tensor.narrow(dim, (sample + 1) % size, 1))
        changed.append(moved)
    return tuple(changed)

