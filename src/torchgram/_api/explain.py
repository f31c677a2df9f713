"""``torchgram.explain``: what the structured backend and ``auto`` would do, per leaf, and why.

A report to read when a Gramian is slower than expected: for every parameter leaf, the
rule(s) that recognised its uses, ghost or materialize (or the fallback, with the calls
that caused it), and the cost model's estimates (NOTE [structured cost model],
NOTE [auto cost model]). Nothing is differentiated: ``f`` is traced once (one sample with
``batch_dim``), as the backends themselves do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import optree

from torchgram._core import checks
from torchgram._core.checks import function_name
from torchgram._core.display import html_columns, html_lines, text_columns
from torchgram._core.errors import BackendCannotRun, OutputChanged, output_changes_refused
from torchgram._core.functional import public_call
from torchgram._core.hooked_modules import puts_back_hooked_attributes
from torchgram._core.options import Options
from torchgram._core.problem import build_problem, forget_probe
from torchgram._core.pytree import DiffLeaves
from torchgram._core.result import RunReport

if TYPE_CHECKING:  # the backends are imported when a report is made (import stays light)
    from torchgram.backends.auto import Estimate
    from torchgram.backends.structured.cost import LeafPlan

_API = "torchgram.explain"
_TITLES = ("leaf", "shape", "way", "uses", "est. cost")
"""The columns of an explanation's table, one row per leaf."""


@dataclass(frozen=True)
class LeafReport:
    """One parameter leaf in an :class:`Explanation`.

    Attributes:
        name: The leaf's path in the differentiated argument(s), e.g. ``"0.weight"``.
        shape: Its shape.
        way: ``"ghost"``, ``"materialize"``, ``"sparse"``, ``"fallback"`` or ``"unused"``;
            with ``run=True``, the way the structured backend really used (the reason then
            says what was planned, when the run could not follow the plan).
        rules: The rule of each recognised use, in call order (``"linear"``, ``"conv2d"``...).
        unrecognised: The calls that use the leaf outside every rule (why it falls back).
        cost: Estimated multiply-adds of this leaf's share of the work.
        memory: Estimated bytes held for it.
        reason: The cost model's reason for the way.
    """

    name: str
    shape: tuple[int, ...]
    way: str
    rules: tuple[str, ...]
    unrecognised: tuple[str, ...]
    cost: float
    memory: float
    reason: str


@dataclass(frozen=True)
class Explanation:
    """Per-leaf report of the structured plan and the backend choice, for one call.

    Attributes:
        leaves: One :class:`LeafReport` per differentiated leaf (``optree`` order).
        backend: The backend the call would use (``auto``'s choice when ``backend="auto"``);
            with ``run=True``, the one that answered.
        auto_choice: What ``auto`` would choose.
        estimates: ``auto``'s estimate for each candidate backend.
        samples: ``B`` (1 without ``batch_dim``).
        rows_per_sample: ``R`` (all ``m`` rows without ``batch_dim``).
        forward_flops: Rough multiply-adds of one forward on the whole batch.
        ran: With ``run=True``, what the computation really did (the backend that answered,
            the candidates ``auto`` gave up on and why, how each leaf was computed).
        gramian: With ``run=True``, the Gramian ``torchgram.gramian`` returns (without
            ``f``'s aux where ``has_aux=True``).
    """

    leaves: tuple[LeafReport, ...]
    backend: str
    auto_choice: str
    estimates: dict[str, Estimate]
    samples: int
    rows_per_sample: int
    forward_flops: float
    ran: RunReport | None = None
    gramian: Any = None

    @property
    def fallback(self) -> tuple[str, ...]:
        """Names of the leaves whose uses need the fallback (the usual reason for slowness)."""
        return tuple(leaf.name for leaf in self.leaves if leaf.way == "fallback")

    def by_name(self, name: str) -> LeafReport:
        """The report of the leaf called ``name``."""
        for leaf in self.leaves:
            if leaf.name == name:
                return leaf
        raise KeyError(f"{_API}: no leaf named {name!r}; leaves: {[x.name for x in self.leaves]}")

    def _rows(self) -> list[tuple[str, ...]]:
        rows: list[tuple[str, ...]] = []
        for leaf in self.leaves:
            uses = _uses(leaf.rules) if leaf.rules else "-"
            if leaf.unrecognised:
                uses = (uses + "; " if leaf.rules else "") + "other: " + ", ".join(
                    leaf.unrecognised)
            rows.append((leaf.name, "×".join(map(str, leaf.shape)) or "scalar", leaf.way,
                         uses, f"{leaf.cost:.2g}"))
        return rows

    def _header(self) -> str:
        structure = (f"{self.samples} samples × {self.rows_per_sample} row(s) each"
                     if self.samples > 1 or self.rows_per_sample == 1
                     else f"{self.rows_per_sample} dense rows")
        estimates = ", ".join(f"{name} {e.time:.2g}" + ("" if e.fits else " (over budget)")
                              for name, e in sorted(self.estimates.items(),
                                                    key=lambda item: item[1].time)) \
            or "none (the structured backend cannot trace f)"
        choice = (f"backend {self.backend!r}" if self.backend == self.auto_choice
                  else f"backend {self.backend!r} (auto would choose {self.auto_choice!r})")
        return (f"{_API}: {structure}, forward ≈ {self.forward_flops:.2g} multiply-adds; "
                f"{choice}\nestimated multiply-adds: {estimates}")

    def _ran_lines(self) -> list[str]:
        """What the computation really did (``run=True``), one line each."""
        ran = self.ran
        if ran is None:
            return []
        lines = [f"ran: backend {ran.backend!r}" + (f" ({ran.way})" if ran.way else "")]
        lines += [f"gave up on {name!r}: {why}" for name, why in ran.attempts]
        if ran.row_chunks:
            lines.append(f"row chunks: {len(ran.row_chunks)}")
        lines += [f"note: {note}" for note in ran.notes]
        return lines

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        return (f"<div>{html_lines(self._header().split(chr(10)))}"
                f"{html_columns(_TITLES, self._rows())}{html_lines(self._ran_lines())}</div>")

    def __str__(self) -> str:
        lines = [self._header(), *text_columns(_TITLES, self._rows())]
        if self.fallback:
            lines.append("fallback (per-row Jacobians from the backward): "
                         + ", ".join(self.fallback))
        lines += self._ran_lines()
        return "\n".join(lines)

    def _repr_markdown_(self) -> str:
        header = self._header().replace("\n", "  \n")
        table = ["| leaf | shape | way | uses | est. cost |", "|---|---|---|---|---|"]
        table += ["| " + " | ".join(f"`{cell}`" if i == 0 else cell
                                     for i, cell in enumerate(row)) + " |"
                  for row in self._rows()]
        ran = "".join(f"  \n{line}" for line in self._ran_lines())
        return header + "\n\n" + "\n".join(table) + ("\n" + ran if ran else "")


def explain(
    f: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    has_aux: bool = False,
    backend: str = "auto",
    chunk_size: int | None = None,
    batch_dim: int | None = None,
    in_dims: int | None | Sequence[Any] = 0,
    diagonal: bool = False,
    per_leaf: bool = False,
    memory_budget: int | None = None,
    progress: bool = False,
    run: bool = False,
) -> Callable[..., Explanation]:
    """Report, per parameter leaf, how ``torchgram.gramian`` with these options would work.

    Takes exactly the arguments of :func:`torchgram.gramian` and returns a function of
    ``f``'s arguments that traces ``f`` once (one sample with ``batch_dim``, nothing
    differentiated) and returns an :class:`Explanation`: for each leaf, the rules that
    recognised its uses and whether its Gramian block is computed in **ghost** form, from
    **materialized** per-row Jacobians, or by the **fallback** (uses no rule covers, named),
    with estimated costs; and which backend ``auto`` picks, with every candidate's
    estimate. ``print`` it, or display it in a notebook.

    Args:
        f: As for :func:`torchgram.gramian`.
        argnums: As for :func:`torchgram.gramian`.
        has_aux: As for :func:`torchgram.gramian`.
        backend: As for :func:`torchgram.gramian` (reported next to ``auto``'s choice).
        chunk_size: As for :func:`torchgram.gramian`.
        batch_dim: As for :func:`torchgram.gramian`.
        in_dims: As for :func:`torchgram.gramian`.
        diagonal: As for :func:`torchgram.gramian`.
        per_leaf: As for :func:`torchgram.gramian`.
        memory_budget: As for :func:`torchgram.gramian`.
        progress: As for :func:`torchgram.gramian` (with ``run=True``).
        run: Also compute the Gramian, and report what really ran (``Explanation.ran``:
            the backend that answered, the candidates ``auto`` gave up on and why, each
            structured leaf's way, the Jacobian blocks and row chunks it formed). Without
            it, the random generators ``f`` draws from are left as the call found them; with
            it, where one plain call of ``f`` leaves them (as ``torchgram.gramian`` does).

    Returns:
        A function taking ``f``'s arguments and returning an :class:`Explanation`.

    Raises:
        TypeError, ValueError: As :func:`torchgram.gramian` does, for the same inputs.

    Example:
        >>> import torch, torchgram as tg
        >>> def f(p, x):
        ...     h = torch.nn.functional.linear(x, p["w"], p["b"])
        ...     return (torch.tanh(h) * p["scale"].cos()).sum(-1)
        >>> p = {"w": torch.randn(8, 4), "b": torch.randn(8), "scale": torch.randn(8)}
        >>> report = tg.explain(f, batch_dim=0)(p, torch.randn(32, 4))
        >>> [(leaf.name, leaf.way) for leaf in report.leaves]
        [('b', 'materialize'), ('scale', 'fallback'), ('w', 'ghost')]
        >>> report.fallback, report.by_name("scale").unrecognised
        (('scale',), ('Tensor.cos',))
    """
    options = Options.validate(
        _API, f, argnums, has_aux=has_aux, backend=backend, chunk_size=chunk_size,
        batch_dim=batch_dim, in_dims=in_dims, diagonal=diagonal, per_leaf=per_leaf,
        memory_budget=memory_budget, progress=progress,
    )
    checks.check_bool(_API, "run", run)

    from torchgram._api.pipeline import outside_compile, wraps_user_function

    @wraps_user_function(f)
    @outside_compile
    @public_call  # NOTE [inference mode], NOTE [the caller's function modes]
    @puts_back_hooked_attributes(_API, f)  # NOTE [tensors hooks set]
    def explain_f(*args: Any, **kwargs: Any) -> Explanation:
        from torchgram._api.pipeline import compute
        from torchgram.backends.auto import plan_auto

        problem = build_problem(options, f, args, kwargs, planning=True)
        if problem.composition.transforms:  # NOTE [composition]
            checks.fail(_API, "a call outside torch.func transforms (explain traces f with "
                        "eager autograd)", f"a call {problem.composition.describe()}",
                        "Call torchgram.explain outside the transform: inside one, backend="
                        "'auto' runs the jacobian backend (then ntvp).", RuntimeError)
        names = leaf_names(problem.diff, args)
        plan, declined = None, None
        try:
            try:
                plan = plan_auto(problem)
            except OutputChanged:  # a cached probe went stale (NOTE [stale probes]): once more
                problem.draw.rewind()  # the call starts afresh, from its own random state
                forget_probe(problem)
                problem = build_problem(options, f, args, kwargs, planning=True, fresh=True)
                with output_changes_refused(_API, problem.draw.rewind):
                    plan = plan_auto(problem)
        except BackendCannotRun as refusal:  # the structured backend cannot trace f (it
            declined = refusal  # differentiates itself, calls torchgram, uses sparse tensors)
        ran, gramian = None, None
        if run:  # the draw of one plain call, as tg.gramian from here would see it
            problem.draw.rewind()
            computation = compute(options, f, args, kwargs)
            ran, gramian = computation.result.report, computation.value()
        if declined is not None:
            leaves = tuple(_untraced(name, leaf.shape, declined)
                           for name, leaf in zip(names, problem.leaves, strict=True))
            choice = declined.alternatives[0] if declined.alternatives else "graph"
            dense = problem.batch is None
            explanation = Explanation(
                leaves=leaves, backend=choice if options.backend == "auto" else options.backend,
                auto_choice=choice, estimates={}, samples=1 if dense else problem.samples,
                rows_per_sample=problem.num_rows if dense else problem.rows_per_sample,
                forward_flops=float("nan"))
        else:
            assert plan is not None
            structured = plan.structured
            explanation = Explanation(
                leaves=tuple(_report(names[p.leaf], problem.leaves[p.leaf].shape, p)
                             for p in structured.leaves),
                backend=plan.choice if options.backend == "auto" else options.backend,
                auto_choice=plan.choice, estimates=plan.estimates,
                samples=structured.sizes.samples, rows_per_sample=structured.sizes.rows,
                forward_flops=structured.forward_flops)
        if ran is None:  # planned only: the generators as the call found them (NOTE [one draw])
            problem.draw.rewind()
            return explanation
        # what really ran, where the plan could not be followed
        return dataclasses.replace(explanation, backend=ran.backend,
                                   leaves=_as_run(explanation.leaves, ran), ran=ran,
                                   gramian=gramian)

    explain_f.__doc__ = (f"Explanation of the Gramian of {function_name(f)} "
                         f"(built by torchgram.explain).")
    return explain_f


def leaf_names(diff: DiffLeaves, args: tuple[Any, ...]) -> list[str]:
    """Readable paths of the differentiated leaves (``arg<i>.`` prefixed for several args).

    Example:
        >>> import torch
        >>> from torchgram._core.pytree import select_diff_leaves
        >>> args = ({"a": [torch.ones(1), torch.ones(2)], "b": 3}, torch.ones(1))
        >>> leaf_names(select_diff_leaves(args, (0, 1)), args)
        ['arg0.a.0', 'arg0.a.1', 'arg1']
    """
    several = len(diff.argnums) > 1
    paths = [optree.tree_flatten_with_path(args[argnum])[0] for argnum in diff.argnums]
    names = []
    for k, j in diff.positions:
        parts = [str(part) for part in paths[k][j]]
        if several:
            parts.insert(0, f"arg{diff.argnums[k]}")
        names.append(".".join(parts) or "<argument>")
    return names


def _as_run(leaves: tuple[LeafReport, ...], ran: RunReport) -> tuple[LeafReport, ...]:
    """The leaves with the ways the structured backend really used, where they differ."""
    if ran.backend != "structured" or len(ran.leaf_ways) != len(leaves):
        return leaves
    why = "; ".join(ran.notes) or "the run did not replay the trace"
    return tuple(leaf if leaf.way == way else dataclasses.replace(
        leaf, way=way, reason=f"planned {leaf.way}, ran {way}: {why}")
        for leaf, way in zip(leaves, ran.leaf_ways, strict=True))


def _uses(rules: tuple[str, ...]) -> str:
    """Rule names in call order, a run of the same one as ``name ×n``.

    Example:
        >>> _uses(("embedding", "linear", "linear", "linear"))
        'embedding, linear ×3'
    """
    parts: list[tuple[str, int]] = []
    for rule in rules:
        if parts and parts[-1][0] == rule:
            parts[-1] = (rule, parts[-1][1] + 1)
        else:
            parts.append((rule, 1))
    return ", ".join(rule if count == 1 else f"{rule} ×{count}" for rule, count in parts)


def _untraced(name: str, shape: Sequence[int], refusal: BackendCannotRun) -> LeafReport:
    """A leaf of an ``f`` the structured backend cannot trace: left to another backend."""
    return LeafReport(name, tuple(shape), "fallback", (), (refusal.reason,), float("nan"),
                      float("nan"), f"the structured backend declines {refusal.reason}; "
                      f"backends that can: {', '.join(refusal.alternatives)}")


def _report(name: str, shape: tuple[int, ...], plan: LeafPlan) -> LeafReport:
    return LeafReport(name, tuple(shape), plan.way, tuple(use.rule for use in plan.all_uses),
                      plan.unrecognised, plan.cost, plan.memory, plan.reason)


__all__ = ["Explanation", "LeafReport", "explain"]
