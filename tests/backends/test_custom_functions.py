"""Custom ``autograd.Function``s inside ``f`` on every backend, old-style and new-style.

* Old-style ones (``forward(ctx, ...)``) torch refuses under ``torch.func`` transforms (a raw
  ``RuntimeError``: the ``transformers`` BLOOM model's GELU reached users that way through
  ``auto``). The backends that transform ``f`` now decline with a torchgram error naming the
  ones that can, and ``auto`` goes on to one of them (NOTE [old-style autograd.Functions] in
  ``_core/errors.py``).
* A Function that takes a parameter and uses it inside its ``forward`` (where gradients are
  off) gave the structured backend, and ``auto`` with it, a zero block for that parameter
  (``G`` 0.9 off, relative); such uses are now left to the graph (NOTE [uses with gradients
  off] in ``backends/structured/trace.py``).
* Gradients stopped inside ``f`` (``detach``, ``.data``, ``torch.no_grad``) have no Jacobian
  on any backend; ``requires_grad_()`` inside ``f`` torch refuses under transforms, like
  old-style Functions.
* A non-reentrant ``torch.utils.checkpoint`` region (``transformers``'
  ``gradient_checkpointing_enable``): its backward recomputes the region without the
  structured backend's taps (torch raised ``CheckpointError``), and ``torch.func`` refuses
  its saved-tensor hooks; uses inside are left to the graph, refusals are torchgram errors.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 -- torch's own spelling
import torch.utils.checkpoint
from torch import Tensor

import torchgram as tg
from custom_functions import (
    FunctionLinear,
    ItemInBackward,
    OldStyleCube,
    OldStyleFunctionLinear,
)
from reference import dense_cross_kernel, dense_gramian

B, D, H, C = 4, 3, 5, 2
BACKENDS = ["jacobian", "ntvp", "graph", "structured", "auto"]


def _linear_inside(function: Any) -> Any:
    def hidden(params: dict[str, Tensor], x: Tensor) -> Tensor:
        return torch.tanh(function.apply(x, params["w1"]) + params["b1"])

    return hidden


def _hidden(params: dict[str, Tensor], x: Tensor) -> Tensor:
    return OldStyleCube.apply(F.linear(x, params["w1"], params["b1"]))


def _checkpointed(params: dict[str, Tensor], x: Tensor) -> Tensor:
    def region(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:  # tensors as arguments:
        return OldStyleCube.apply(F.linear(x, weight, bias))  # the reentrant way needs them

    return torch.utils.checkpoint.checkpoint(region, x, params["w1"], params["b1"],
                                             use_reentrant=True)


def _problem(body: Any) -> tuple[Any, dict[str, Tensor], Tensor, Tensor]:
    torch.manual_seed(0)
    params = {"w1": torch.randn(H, D, dtype=torch.float64),
              "b1": torch.randn(H, dtype=torch.float64),
              "w2": torch.randn(C, H, dtype=torch.float64)}
    x = torch.randn(B, D, dtype=torch.float64)
    y = torch.randint(0, C, (B,))

    def f(p: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(F.linear(body(p, x), p["w2"]), y, reduction="none")

    return f, params, x, y


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch_dim", [0, None], ids=["batch0", "dense"])
def test_the_oracle_or_a_torchgram_error_naming_who_can(backend: str,
                                                        batch_dim: int | None) -> None:
    f, params, x, y = _problem(_hidden)
    expected = dense_gramian(f, (params, x, y)).gramian
    transform = tg.gramian(f, backend=backend, batch_dim=batch_dim)
    try:
        G = transform(params, x, y)
    except NotImplementedError as error:
        assert backend in ("jacobian", "ntvp"), error
        message = str(error)
        assert message.startswith("torchgram.gramian: expected f to run under torch.func")
        assert "setup_context" in message and "backend='graph'" in message
        return
    torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("function", [FunctionLinear, OldStyleFunctionLinear], ids=["new", "old"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch_dim", [0, None], ids=["batch0", "dense"])
def test_a_parameter_used_inside_a_function(function: Any, backend: str,
                                            batch_dim: int | None) -> None:
    """Its derivative is the Function's ``backward``'s, not the ops its ``forward`` runs."""
    f, params, x, y = _problem(_linear_inside(function))
    expected = dense_gramian(f, (params, x, y)).gramian
    try:
        G = tg.gramian(f, backend=backend, batch_dim=batch_dim)(params, x, y)
    except NotImplementedError as error:  # no transforms (old), no forward AD (both)
        assert backend in ("jacobian", "ntvp", "structured"), error
        assert str(error).startswith("torchgram.gramian: expected"), error
        assert backend != "structured" or function is OldStyleFunctionLinear, error
        return
    torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")  # torch's, on probes
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch_dim", [0, None], ids=["batch0", "dense"])
def test_a_reentrant_checkpoint_is_refused_by_every_backend(backend: str,
                                                            batch_dim: int | None) -> None:
    """torch refuses ``torch.autograd.grad`` through it (and so does the oracle); the forward
    of the structured backend's tapped run saw the ops inside it and gave its parameters
    zero blocks (``G`` 0.8 off, relative), and ``auto`` with it."""
    f, params, x, y = _problem(_checkpointed)
    with pytest.raises((ValueError, NotImplementedError)) as caught:
        tg.gramian(f, backend=backend, batch_dim=batch_dim)(params, x, y)
    message = str(caught.value)
    assert message.startswith("torchgram.gramian: expected"), message
    if backend in ("graph", "auto") or caught.type is ValueError:
        assert caught.type is ValueError and "use_reentrant=False" in message, message
    else:  # declined under a transform, naming the graph, which then names the fix
        assert "setup_context" in message and "backend='graph'" in message, message


def test_auto_and_graph_always_answer() -> None:
    f, params, x, y = _problem(_hidden)
    expected = dense_gramian(f, (params, x, y)).gramian
    for backend in ("auto", "graph"):
        for batch_dim in (0, None):
            G = tg.gramian(f, backend=backend, batch_dim=batch_dim)(params, x, y)
            torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", ["auto", "structured", "jacobian"])
def test_kernels_between_two_input_sets(backend: str) -> None:
    f, params, x, _ = _problem(_hidden)

    def logits(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return F.linear(_hidden(p, x), p["w2"])

    x2 = torch.randn(3, D, dtype=torch.float64)
    ntk_fn = tg.ntk.empirical_ntk_fn(logits, trace_axes=(), backend=backend)
    expected = dense_cross_kernel(logits, params, x, x2)
    try:
        kernel = ntk_fn(x, x2, params)
    except NotImplementedError as error:
        assert backend == "jacobian", error
        assert "setup_context" in str(error) and "backend='graph'" in str(error)
        return
    torch.testing.assert_close(kernel, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("body", ["cube", "old_linear", "new_linear"])
@pytest.mark.parametrize("backend", ["auto", "graph", "structured"])
def test_aggregated_grad(body: str, backend: str) -> None:
    """``Jᵀw`` ran ``f`` under ``torch.func.vjp`` after the Gramian, outside any backend: a
    raw error with old-style Functions on every backend (session 23's update hunt)."""
    hidden = {"cube": _hidden, "old_linear": _linear_inside(OldStyleFunctionLinear),
              "new_linear": _linear_inside(FunctionLinear)}[body]
    f, params, x, y = _problem(hidden)
    dense = dense_gramian(f, (params, x, y))
    weights = torch.full((B,), 0.25, dtype=torch.float64)
    try:
        update, _ = tg.aggregated_grad(f, lambda G: weights, backend=backend,
                                       batch_dim=0)(params, x, y)
    except NotImplementedError as error:  # the structured vmap path and old-style Functions
        assert backend == "structured" and body == "old_linear", error
        return
    flat = torch.cat([update[k].reshape(-1) for k in sorted(params)])  # the oracle's order
    torch.testing.assert_close(flat, dense.jacobian.T @ weights, rtol=1e-10, atol=1e-12)


def test_other_runtime_errors_pass_through() -> None:
    """Only torch's refusal of old-style Functions is translated."""
    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        raise RuntimeError("boom from f")

    params = {"w": torch.randn(2, 2)}
    for backend in ("jacobian", "auto"):
        with pytest.raises(RuntimeError, match="boom from f"):
            tg.gramian(f, backend=backend)(params, torch.randn(2, 2))


@pytest.mark.parametrize("batch_dim", [0, None], ids=["batch0", "dense"])
def test_auto_plans_around_old_style_functions(batch_dim: int | None) -> None:
    """The trace sees the Function in the rows' graph, and ``auto`` tries the backends that
    transform ``f`` last: ``explain`` predicts what runs, and nothing is tried in vain."""
    class Cube(OldStyleCube):  # a class of its own: the trace cache is keyed by f
        pass

    def f(p: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        hidden = Cube.apply(F.linear(x, p["w1"], p["b1"]))
        return F.cross_entropy(F.linear(hidden, p["w2"]), y, reduction="none")

    _, params, x, y = _problem(_hidden)
    predicted = tg.explain(f, batch_dim=batch_dim)(params, x, y)
    report = tg.explain(f, batch_dim=batch_dim, run=True)(params, x, y)
    assert report.ran is not None
    assert predicted.backend == report.ran.backend not in ("jacobian", "ntvp")
    assert report.ran.attempts == []


def test_kernel_tiles_of_a_function_with_an_old_style_function() -> None:
    """The check of kernel tiles runs ``f`` under ``torch.func.vjp`` outside any backend: a
    raw error escaped ``empirical_ntk_fn`` with a ``memory_budget`` (session 23's fuzzing).
    The side is now one tile, with a note."""
    def logits(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return F.linear(_hidden(p, x), p["w2"])

    _, params, x, _ = _problem(_hidden)
    ntk_fn = tg.ntk.empirical_ntk_fn(logits, trace_axes=(), memory_budget=200)
    kernel = ntk_fn(x, None, params)
    torch.testing.assert_close(kernel, dense_cross_kernel(logits, params, x, None),
                               rtol=1e-10, atol=1e-12)
    assert ntk_fn.last_run is not None
    assert any("setup_context" in note for note in ntk_fn.last_run.notes), ntk_fn.last_run.notes


def _no_grad_linear(x: Tensor, weight: Tensor) -> Tensor:
    with torch.no_grad():
        return F.linear(x, weight)


STOPPED = {
    "detach": lambda x, weight: F.linear(x, weight.detach()),
    "data": lambda x, weight: F.linear(x, weight.data),
    "no_grad": _no_grad_linear,
    "straight_through": lambda x, weight: F.linear(x, weight + (weight.detach() - weight)),
    "requires_grad_false": lambda x, weight: F.linear(x, weight.detach().requires_grad_(False)),
}


@pytest.mark.parametrize("stopped", list(STOPPED))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch_dim", [0, None], ids=["batch0", "dense"])
def test_gradients_stopped_inside_f(stopped: str, backend: str, batch_dim: int | None) -> None:
    """A use the gradient does not flow through has no Jacobian; ``requires_grad_()`` inside
    ``f`` is refused by torch under transforms (a raw error through ``auto`` before)."""
    def f(p: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        hidden = torch.tanh(STOPPED[stopped](x, p["w1"]) + p["b1"])
        return F.cross_entropy(F.linear(hidden, p["w2"]), y, reduction="none")

    _, params, x, y = _problem(_hidden)
    expected = dense_gramian(f, (params, x, y)).gramian
    try:
        G = tg.gramian(f, backend=backend, batch_dim=batch_dim)(params, x, y)
    except NotImplementedError as error:
        assert stopped == "requires_grad_false" and backend in ("jacobian", "ntvp", "structured")
        assert "requires_grad_()" in str(error) and "backend='graph'" in str(error), error
        return
    torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-12)


def _checkpointed_block(x: Tensor, weight: Tensor, bias: Tensor, dropout: bool) -> Tensor:
    h = torch.tanh(F.linear(x, weight, bias))
    return F.dropout(h, 0.3, training=True) if dropout else h


@pytest.mark.parametrize("dropout", [False, True], ids=["plain", "dropout"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch_dim", [0, None], ids=["batch0", "dense"])
def test_a_non_reentrant_checkpoint(dropout: bool, backend: str, batch_dim: int | None) -> None:
    def f(p: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        h = torch.utils.checkpoint.checkpoint(_checkpointed_block, x, p["w1"], p["b1"], dropout,
                                              use_reentrant=False)
        return F.cross_entropy(F.linear(h, p["w2"]), y, reduction="none")

    _, params, x, y = _problem(_hidden)
    torch.manual_seed(5)
    expected = dense_gramian(f, (params, x, y)).gramian
    torch.manual_seed(5)
    try:
        G = tg.gramian(f, backend=backend, batch_dim=batch_dim)(params, x, y)
    except NotImplementedError as error:
        assert backend in ("jacobian", "ntvp", "structured"), error
        assert str(error).startswith("torchgram.gramian: expected"), error
        assert "backend='graph'" in str(error), error
        return
    torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-12)


def test_saved_tensor_hooks_around_the_call_keep_the_fast_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Hooks in force when the call starts (``save_on_cpu`` around it) are not a checkpoint
    inside ``f``: the structured backend still taps every use. Empty caches: a cached trace
    of another test's ``f`` at a reused ``id`` (NOTE [call signatures]) can make auto choose
    another backend (the same matrix), as a fresh clone's full run did once (session 47)."""
    from torchgram._core import problem
    from torchgram._core.signature import LruCache
    from torchgram.backends.structured import passes

    monkeypatch.setattr(problem, "_PROBES", LruCache(maxsize=256))
    monkeypatch.setattr(passes, "_TRACES", LruCache(maxsize=64))
    f, params, x, y = _problem(lambda p, x: torch.tanh(F.linear(x, p["w1"], p["b1"])))
    expected = dense_gramian(f, (params, x, y)).gramian
    with torch.autograd.graph.save_on_cpu():
        report = tg.explain(f, batch_dim=0, run=True)(params, x, y)
        G = tg.gramian(f, batch_dim=0)(params, x, y)
    torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-12)
    assert report.ran is not None and report.ran.backend == "structured"
    assert "fallback" not in report.ran.leaf_ways


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor")  # dynamo's, tracing
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_compiled_submodule(backend: str) -> None:
    """``torch.compile``'d code inside ``f``: under ``torch.func`` transforms torch 2.13's
    dynamo fails with a bare ``AssertionError`` (it escaped raw from jacobian and ntvp, which
    then declined it); torchgram's evaluations now run it eagerly where torch has stances
    (NOTE [compiled code in f]), and every backend gives the oracle's matrix."""
    torch.manual_seed(0)
    inner = torch.nn.Linear(H, H).double()
    compiled = torch.compile(inner, backend="eager")
    _, params, x, y = _problem(_hidden)

    def f(p: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        hidden = compiled(torch.tanh(F.linear(x, p["w1"], p["b1"])))
        return F.cross_entropy(F.linear(hidden, p["w2"]), y, reduction="none")

    expected = dense_gramian(f, (params, x, y)).gramian
    try:
        G = tg.gramian(f, backend=backend, batch_dim=0)(params, x, y)
    except NotImplementedError as error:
        assert backend in ("jacobian", "ntvp"), error
        assert not hasattr(torch.compiler, "set_stance"), error  # torch < 2.6 only
        assert "torch.compile'd code" in str(error) and "backend='graph'" in str(error), error
        return
    torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-12)


UNBATCHABLE_BACKWARDS = {
    "item-in-backward": lambda h: ItemInBackward.apply(h),
    "cross-map-lrn": lambda h: torch.nn.CrossMapLRN2d(3)(h[:, :, None, None])[:, :, 0, 0],
}


@pytest.mark.parametrize("backend", ["auto", "structured"])
@pytest.mark.parametrize("rows", ["two-per-sample", "dense"])
@pytest.mark.parametrize("body", UNBATCHABLE_BACKWARDS)
def test_backwards_vmap_cannot_batch_run_one_row_at_a_time(body: str, rows: str,
                                                           backend: str) -> None:
    """Several rows per backward used to raise torch's batching errors (session 58)."""
    inside = UNBATCHABLE_BACKWARDS[body]
    params = {"w1": torch.randn(H, D, dtype=torch.float64),
              "w2": torch.randn(C, H, dtype=torch.float64)}
    x = torch.randn(B, D, dtype=torch.float64)

    def logits(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return F.linear(torch.tanh(inside(F.linear(x, p["w1"]))), p["w2"])

    f, batch_dim = (logits, 0) if rows == "two-per-sample" else (
        lambda p, x: logits(p, x).sum(1), None)
    expected = dense_gramian(f, (params, x))
    G = tg.gramian(f, backend=backend, batch_dim=batch_dim)(params, x)
    torch.testing.assert_close(G, expected.gramian if batch_dim is None
                               else expected.shaped(), rtol=1e-10, atol=1e-12)
    x2 = torch.randn(3, D, dtype=torch.float64)
    kernel = tg.ntk.empirical_ntk_fn(logits, trace_axes=(), backend=backend)(x, x2, params)
    torch.testing.assert_close(kernel, dense_cross_kernel(logits, params, x, x2),
                               rtol=1e-10, atol=1e-12)


def test_a_signature_whose_batched_backward_failed_runs_one_row_at_a_time_at_once() -> None:
    """Later calls of the signature do not fail and redo again (twice the evaluations)."""
    params = {"w1": torch.randn(H, D, dtype=torch.float64),
              "w2": torch.randn(C, H, dtype=torch.float64)}
    x = torch.randn(B, D, dtype=torch.float64)
    evaluations = []

    def losses(p: dict[str, Tensor], x: Tensor) -> Tensor:
        evaluations.append(1)
        return F.linear(torch.tanh(ItemInBackward.apply(F.linear(x, p["w1"]))), p["w2"]).sum(1)

    gramian = tg.gramian(losses, backend="structured")
    counts = []
    for _ in range(3):
        evaluations.clear()
        gramian(params, x)
        counts.append(len(evaluations))
    assert counts[1:] == [1, 1], counts


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")  # torch's own
@pytest.mark.parametrize("backend", ["auto", "structured", "graph"])
@pytest.mark.parametrize("batch_dim", [0, None], ids=["batch0", "dense"])
def test_a_reentrant_checkpoint_of_the_data_is_refused_too(backend: str,
                                                           batch_dim: int | None) -> None:
    """The region's input (the data) does not require grad, its parameters come through a
    closure: it leaves no node, and G was 0 without a word (session 58's README check).
    NOTE [reentrant checkpoints seen]."""
    params = {"w1": torch.randn(H, D, dtype=torch.float64),
              "w2": torch.randn(C, H, dtype=torch.float64)}
    x = torch.randn(B, D, dtype=torch.float64)

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        hidden = torch.utils.checkpoint.checkpoint(lambda x: torch.tanh(F.linear(x, p["w1"])),
                                                   x, use_reentrant=True)
        return F.linear(hidden, p["w2"]).sum(1)

    with pytest.raises(ValueError, match="use_reentrant=False"):
        tg.gramian(f, backend=backend, batch_dim=batch_dim)(params, x)


class _NormInCheckpoint(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn = torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6)
        self.head = torch.nn.Linear(6, 3)

    def region(self, x: Tensor) -> Tensor:
        return torch.tanh(self.bn(self.a(x)))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.utils.checkpoint.checkpoint(self.region, x, use_reentrant=False))


@pytest.mark.parametrize("backend", ["auto", "structured", "graph"])
@pytest.mark.parametrize("batch_dim", [0, None], ids=["batch0", "dense"])
def test_a_batch_norm_in_training_mode_inside_a_checkpoint_region(backend: str,
                                                                  batch_dim: int | None) -> None:
    """NOTE [recomputed checkpoints differ]: torchgram's evaluations leave the running
    statistics alone, the backward's recomputation of the region does not, and torch raised
    its raw ``CheckpointError`` (the review of session 65). A torchgram ``ValueError`` names
    the eager way, which gives the oracle's matrix; it is raised by the probe, before any
    recomputation could move the module's running statistics."""
    torch.manual_seed(0)
    model = _NormInCheckpoint().double().train()
    fn, params = tg.functionalize(model)

    def f(p: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(fn(p, x), y, reduction="none")

    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    with pytest.raises(ValueError, match=r"^torchgram\.gramian: expected a torch\.utils\."
                       r"checkpoint region .* tg\.autograd\.record\(\)"):
        tg.gramian(f, backend=backend, batch_dim=batch_dim)(params, x, y)
    for name, buffer in model.named_buffers():  # refused before any recomputation
        assert torch.equal(buffer, buffers[name]), name
    expected = dense_gramian(f, (params, x, y)).gramian
    with tg.autograd.record():
        losses = F.cross_entropy(model(x), y, reduction="none")
    G = tg.autograd.gramian(losses, list(model.parameters()), batch_dim=batch_dim)
    torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-12)
