"""``torchgram.autograd.explain``: how each input's block of an eager Gramian was computed."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from torchgram._api.autograd import prepare
from torchgram._api.pipeline import outside_compile
from torchgram._core import checks
from torchgram._core.display import html_columns, html_lines, text_columns
from torchgram._core.functional import public_call
from torchgram._core.result import RunReport
from torchgram.backends.eager.record import paused

_API = "torchgram.autograd.explain"
_TITLES = ("input", "shape", "way", "why")


@dataclass(frozen=True)
class InputReport:
    """One input of an :class:`EagerExplanation`.

    Attributes:
        name: The input's name (from a mapping or ``named_parameters()``), else
            ``inputs[i]``.
        shape: Its shape.
        way: ``"ghost"``, ``"materialize"``, ``"sparse"`` (from a recorded call's factors,
            NOTE [structured cost model]), ``"unused"``, or ``"walk"`` (the graph walk).
        why: Why it was walked, when it was ("" otherwise).
    """

    name: str
    shape: tuple[int, ...]
    way: str
    why: str


@dataclass(frozen=True)
class EagerExplanation:
    """What :func:`torchgram.autograd.gramian` did, per input (see :func:`explain`).

    Attributes:
        gramian: The Gramian, as ``tg.autograd.gramian`` returns it.
        inputs: One :class:`InputReport` per input.
        samples: ``B`` (1 without ``batch_dim``).
        ran: The full report: the way the recorded layers' cotangents were obtained, the
            nodes the walk called once per row because ``vmap`` could not batch them
            (``looped_nodes``), the nodes it split per sample, notes.
    """

    gramian: Tensor | tuple[Tensor, ...]
    inputs: tuple[InputReport, ...]
    samples: int
    ran: RunReport

    @property
    def walked(self) -> tuple[str, ...]:
        """Names of the inputs the graph walk computed."""
        return tuple(item.name for item in self.inputs if item.way == "walk")

    @property
    def looped_nodes(self) -> dict[str, int]:
        """Nodes called once per row instead of vectorized (by name: failed ``vmap`` calls)."""
        return dict(self.ran.looped_nodes)

    def _rows(self) -> list[tuple[str, str, str, str]]:
        return [(item.name, "×".join(map(str, item.shape)) or "scalar", item.way, item.why)
                for item in self.inputs]

    def _footer(self) -> list[str]:
        lines = []
        if self.ran.looped_nodes:
            lines.append("nodes called once per row (vmap could not batch them): " + ", ".join(
                f"{name} ({count}×)" for name, count in self.ran.looped_nodes.items()))
        return lines + [note for note in self.ran.notes if not note.startswith("inputs[")]

    def __str__(self) -> str:
        return "\n".join([f"{_API}: {self.samples} sample(s); {self.ran.way}",
                          *text_columns(_TITLES, self._rows()), *self._footer()])

    def __repr__(self) -> str:  # a notebook cell's plain display: the report, not the fields
        return str(self)

    def _repr_html_(self) -> str:
        return (f"<div>{html_lines([f'{_API}: {self.samples} sample(s); {self.ran.way}'])}"
                f"{html_columns(_TITLES, self._rows())}{html_lines(self._footer())}</div>")


@outside_compile  # NOTE [torch.compile]: dynamo traced into the walk (raw errors)
@public_call  # NOTE [inference mode], NOTE [the caller's function modes]
def explain(
    outputs: Tensor | Iterable[Tensor],
    inputs: Tensor | Iterable[Tensor] | Iterable[tuple[str, Tensor]] | Mapping[str, Tensor],
    *,
    batch_dim: int | None = None,
    chunk_size: int | None = None,
    diagonal: bool = False,
) -> EagerExplanation:
    """Compute :func:`torchgram.autograd.gramian` and report how each input's block was made.

    The graph is kept (``retain_graph=True``). For each input: whether a call recorded by
    :func:`torchgram.autograd.record` covered all its uses (its block then comes from that
    call's factors: **ghost**, **materialize** or **sparse**) or the graph **walk**
    computed it, and why; and which nodes the walk had to call once per row (``vmap``
    could not batch them) or per sample. ``print`` it.

    Args:
        outputs: As for :func:`torchgram.autograd.gramian`.
        inputs: As for :func:`torchgram.autograd.gramian`; also a mapping of names to
            tensors or ``(name, tensor)`` pairs, e.g. ``model.named_parameters()``, to name
            the rows of the report.
        batch_dim: As for :func:`torchgram.autograd.gramian`.
        chunk_size: As for :func:`torchgram.autograd.gramian`.
        diagonal: As for :func:`torchgram.autograd.gramian`.

    Returns:
        An :class:`EagerExplanation` (its ``gramian`` is the result).

    Example:
        >>> import torch, torchgram as tg
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
        ...                             torch.nn.Linear(8, 3))
        >>> x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
        >>> with tg.autograd.record():
        ...     losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        >>> report = tg.autograd.explain(losses, model.named_parameters(), batch_dim=0)
        >>> [(item.name, item.way) for item in report.inputs]
        [('0.weight', 'ghost'), ('0.bias', 'materialize'), ('2.weight', 'ghost'), ('2.bias', 'materialize')]
    """  # noqa: E501
    with paused():  # inside a record() block, torchgram's calls are not the user's
        names, tensors = _named(inputs)
        call = prepare(_API, outputs, tensors, batch_dim=batch_dim, chunk_size=chunk_size,
                       retain_graph=True, diagonal=diagonal, per_input=False)
        outcome = call.run()
    report = outcome.result.report
    from torchgram.backends.eager.gramian import walk_reasons

    reasons = walk_reasons(report)
    unrecorded = "the forward was not recorded (tg.autograd.record)" \
        if not report.way.startswith("recorded") else ""
    ways = report.leaf_ways or ("walk",) * len(tensors)
    samples = 1 if batch_dim is None else call.outputs[0].shape[batch_dim]
    return EagerExplanation(
        outcome.value,
        tuple(InputReport(name, tuple(t.shape), way, reasons.get(i, unrecorded)
                          if way == "walk" else "")
              for i, (name, t, way) in enumerate(zip(names, call.inputs, ways, strict=True))),
        samples, report)


def _named(inputs: Any) -> tuple[list[str], Any]:
    if isinstance(inputs, Mapping):
        return [str(k) for k in inputs], list(inputs.values())
    if isinstance(inputs, Tensor):
        return ["inputs[0]"], inputs
    if not isinstance(inputs, Iterable) or isinstance(inputs, str | bytes):
        checks.fail(_API, "inputs to be tensors, a mapping of names to tensors or (name, "
                    "tensor) pairs", f"{type(inputs).__name__}",
                    "Pass e.g. model.named_parameters().", TypeError)
    items = list(inputs)
    if items and all(isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                     for item in items):
        return [name for name, _ in items], [tensor for _, tensor in items]
    return [f"inputs[{i}]" for i in range(len(items))], items
