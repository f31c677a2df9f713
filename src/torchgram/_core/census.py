"""Which calls ``f`` makes that change how it may be differentiated, seen while it runs.

A ``TorchFunctionMode`` sees every torch function call ``f`` makes. :class:`OpCensus`
records, among others (it runs during one evaluation that happens anyway: the probe, or the
evaluation of the whole batch that per-sample ways check against):

* calls that make samples interact (NOTE [per-sample]): batch-norm with batch statistics,
  an embedding with ``scale_grad_by_freq``;
* calls whose backward torch's ``vmap`` computes wrongly (``_torch_compat``'s list): every
  backend then computes the rows' vjps one at a time where it would have vmapped them;
* calls by which ``f`` differentiates itself (NOTE [f that differentiates itself]): the
  structured backend declines those ``f``.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from torchgram._core import _torch_compat
from torchgram._core.captured_writes import StaleWrites
from torchgram._core.errors import OutputChanged, gradient_hooks_refused
from torchgram._core.watched_calls import watched_name

T = TypeVar("T")

_MISSING = object()


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], position: int, name: str,
              default: Any = _MISSING) -> Any:
    """A call's argument ``name`` (parameter number ``position``), as a binding would read it.

    Read directly rather than through ``inspect.Signature.bind`` (about 30 µs a call: every
    batch-norm call ``f`` makes goes through here, under every mode).

    Example:
        >>> _argument((1, 2), {"c": 3}, 2, "c"), _argument((1,), {}, 2, "c", 0)
        (3, 0)
    """
    return args[position] if position < len(args) else kwargs.get(name, default)


def coupling_op(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why a torch function call makes samples interact, or ``None``.

    Example:
        >>> import torch
        >>> x = torch.randn(4, 3)
        >>> coupling_op(F.batch_norm, (x, None, None), {"training": True})
        'batch_norm in training mode (statistics of the whole batch)'
        >>> coupling_op(F.batch_norm, (x, torch.zeros(3), torch.ones(3)), {}) is None
        True
    """
    if func is F.batch_norm:
        mean = _argument(args, kwargs, 1, "running_mean")
        var = _argument(args, kwargs, 2, "running_var")
        if mean is _MISSING or var is _MISSING:  # a call we cannot read: not one of these
            return None
        if _argument(args, kwargs, 5, "training", False) or mean is None or var is None:
            return "batch_norm in training mode (statistics of the whole batch)"
    elif func is F.embedding and _argument(args, kwargs, 5, "scale_grad_by_freq", False):
        return ("embedding(scale_grad_by_freq=True) (gradients divided by token counts over "
                "the whole batch)")
    return None


# NOTE [sparse embedding gradients]
# nn.Embedding(sparse=True) and nn.EmbeddingBag(sparse=True) (recommendation models, word2vec)
# give their table a sparse COO gradient: the same Jacobian, in a layout that the reshapes,
# Gram products and vmaps of every backend refuse (session 27: torch's raw "reshape is not
# implemented for sparse tensors", "Could not run 'aten::amax' with arguments from the
# 'SparseCPU' backend" from every backend and both eager APIs). The probe's census calls them
# with sparse=False and notes it (Probe.sparse_embeddings); every later evaluation of such an
# f runs under DenseEmbeddingGradients, which does the same, and so does the eager recording.
# The graph walk, which meets the sparse gradients of an eager forward run without a
# recording, makes them dense where a node returns them. Gradients handed back to the user
# (tg.autograd.backward's .grad) keep the layout torch's backward would give them.
_SPARSE_ARGUMENT = {F.embedding: 6, F.embedding_bag: 7, torch.embedding: 4}
"""Where the ``sparse`` flag of each embedding call is (NOTE [sparse embedding gradients])."""


def with_dense_gradients(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                         ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """An embedding call that asks for a sparse gradient, with ``sparse=False``; else ``None``.

    Example:
        >>> table, ids = torch.randn(5, 2), torch.tensor([1, 3])
        >>> with_dense_gradients(F.embedding, (ids, table), {"sparse": True})[1]
        {'sparse': False}
        >>> with_dense_gradients(F.embedding, (ids, table), {}) is None
        True
    """
    position = _SPARSE_ARGUMENT.get(func)
    if position is None or not _argument(args, kwargs, position, "sparse", False):
        return None
    if position < len(args):
        return (*args[:position], False, *args[position + 1:]), kwargs
    return args, {**kwargs, "sparse": False}


class DenseEmbeddingGradients(TorchFunctionMode):
    """Embeddings asked for sparse gradients give dense ones (NOTE [sparse embedding gradients])."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        rewritten = with_dense_gradients(func, args, kwargs)
        if rewritten is not None:
            args, kwargs = rewritten
        return func(*args, **kwargs)


# NOTE [stale probes]
# The probe of a call signature is cached (NOTE [call signatures]); its output spec is checked
# on every evaluation, but what else it found was trusted: the calls whose batched backward
# torch gets wrong (Probe.unbatched), the embeddings asking for sparse gradients and the
# calls by which f differentiates itself (Probe.differentiates). A key
# cannot see what f's globals, flags or data decide, so a cached probe may belong to another
# f (a module-level function whose loss switched to torch.cdist; a lambda re-made in a loop):
# session 27 found jacobian and auto 0.76 off (relative) on cdist after the same code had run
# without it, vmapping the backward the probe said was safe. Evaluations under a cached probe
# therefore run under a ProbeCheck, which raises OutputChanged at the end of an evaluation
# that made such a call the probe did not see: the call then probes afresh and starts over,
# as for a changed output.


class ProbeCheck(StaleWrites):
    """Raise :class:`OutputChanged` after an evaluation a cached probe did not describe.

    See NOTE [stale probes]. ``unbatched``, ``sparse_embeddings`` and ``differentiates`` are
    the probe's; ``captured`` as for :class:`StaleWrites` (NOTE [writes under a cached
    probe]), whose check it makes too.
    """

    def __init__(self, unbatched: Collection[str], sparse_embeddings: bool,
                 differentiates: str | None = None, decomposed: Collection[str] = (),
                 captured: Callable[[], frozenset[int]] = frozenset,
                 on_generator: Callable[[torch.Generator], None] | None = None,
                 parameters: Sequence[Tensor] = ()) -> None:
        super().__init__(captured, on_generator, parameters)
        self._unbatched = unbatched
        self._sparse_embeddings = sparse_embeddings
        self._differentiates = differentiates
        self._decomposed = decomposed
        self.unseen: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = _torch_compat.wrong_batched_backward(func)
        if name is not None and name not in self._unbatched:
            self.unseen.append(name)
        if not self._sparse_embeddings and with_dense_gradients(func, args, kwargs) is not None:
            self.unseen.append("an embedding with sparse gradients")
        if self._differentiates is None:  # NOTE [f that differentiates itself]
            how = _torch_compat.self_differentiation(func)
            if how is not None:
                self.unseen.append(how)
        watched = watched_name(func)  # NOTE [prelu as where] and the others of watched_calls
        if watched is not None and watched not in self._decomposed:
            self.unseen.append(watched)
        return super().__torch_function__(func, types, args, kwargs)  # writes, then the call

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self.unseen and exc[0] is None:
            raise OutputChanged(f"f called {self.unseen[0]}, which its cached probe did not see")


# NOTE [gradient hooks inside f]
# f may register hooks on its own tensors (h.register_hook(lambda g: -g), a gradient reversal;
# clipping; logging). torch's backward runs them, and so do the oracle (torch.func's vjp), the
# jacobian backend and the structured backend's backward to its taps. The graph walk calls
# nodes itself and runs no hook, and ntvp pushes vjps (hooks run) forward with jvp (hooks do
# not): both gave another matrix (0.88 and 0.66 off, relative; session 26). A hook can only be
# seen being registered, so their evaluations of f run under an OpCensus, which counts
# Tensor.register_hook calls, and they decline when f made any (naming jacobian and
# structured). Hooks registered on autograd nodes (grad_fn.register_prehook) cannot be seen.
# torch refuses a hook on a tensor that does not require grad, which the evaluations without a
# graph made (the probe, the per-sample check): an f registering one unconditionally (as
# torch.func.jacrev allows) met torch's raw error on every backend before session 57; they now
# evaluate again with a graph where the census counted a hook, and ntvp's pushes under jvp
# alone decline as above.
GRADIENT_HOOKS = frozenset({torch.Tensor.register_hook})
"""Calls that register a hook on a tensor's gradient (NOTE [gradient hooks inside f])."""

NEEDS_GRAPH = GRADIENT_HOOKS | {torch.Tensor.retain_grad}
"""Calls torch refuses on a tensor without grad, which the evaluations without a graph make:
those evaluate again with one (NOTE [gradient hooks inside f]; ``retain_grad`` changes no
gradient, but raised torch's error on every backend until session 58)."""


def again_with_graph(error: Exception, saw_graph_calls: bool, again: Callable[[], T]) -> T:
    """``again()``, the evaluation with a graph after ``error`` from the one without.

    Where it fails too: ``f``'s own ``error`` as raised (its cause and context kept), or the
    second error where the census saw calls that need a graph (then that one says why).
    Call it inside the ``except`` block that caught ``error`` (:func:`may_need_a_graph`).
    """
    try:
        return again()
    except Exception:
        if saw_graph_calls:
            raise
    raise error


def may_need_a_graph(error: BaseException) -> bool:
    """Whether an evaluation of ``f`` without a graph that raised ``error`` is made again with one.

    Any error but torchgram's own: besides the calls the census sees (``NEEDS_GRAPH``), f may
    reach its graph in ways no mode sees: ``torch.autograd.graph.register_multi_grad_hook``
    (torch's raw ``AssertionError: Expected gradient function to be set`` on every backend
    before session 59), ``h.grad_fn.name()``, ``assert h.requires_grad``. An ``f`` that fails
    either way fails once more, with a graph, on its way to the error.

    Example:
        >>> may_need_a_graph(AssertionError("Expected gradient function to be set"))
        True
    """
    return not type(error).__module__.startswith("torchgram")


# NOTE [reentrant checkpoints seen]
# torch refuses torch.autograd.grad through a torch.utils.checkpoint(..., use_reentrant=True)
# region, and every backend's error becomes a torchgram ValueError naming use_reentrant=False.
# But where no input of the region requires grad (the parameters reached through a closure,
# the batch's data as input), the region leaves no node in the graph at all: its outputs do
# not depend on the parameters, and G was 0 without a word on auto, structured and graph
# (torch warns "None of the inputs have requires_grad=True"; session 58's README check). The
# probe's census sees the region switch gradients off inside CheckpointFunction.forward and
# the call is refused the same way.
_CHECKPOINT_FILE = "torch/utils/checkpoint.py"


def _in_reentrant_checkpoint() -> bool:
    """Whether a reentrant checkpoint's forward is among the nearest callers."""
    frame: types.FrameType | None = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "forward" and code.co_filename.replace("\\", "/").endswith(
                _CHECKPOINT_FILE):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def refusing_gradient_hooks(api: str, backend: str) -> Iterator[None]:
    """Run the body under an :class:`OpCensus`; decline if ``f`` registered gradient hooks.

    ``backend`` does not run them (NOTE [gradient hooks inside f]); checked after the body.
    """
    census = OpCensus()
    with census:
        yield
    if census.hooks:
        raise gradient_hooks_refused(api, backend)


# NOTE [f that differentiates itself]
# f may run a backward or a forward-mode pass of its own and use what it gives: the residuals
# of physics-informed networks (torch.autograd.grad(u, x, create_graph=True)), input-gradient
# penalties, torch.func.grad or jvp inside f. The structured backend's taps see the torch
# functions f calls, not the derivative formulas that such a pass runs (in C++) on the same
# weights: its Gramian, and auto's, which picks it, missed those terms without a word (0.7
# off, relative, on a tanh MLP's input-gradient residual; 0.01 on session 36's review case).
# So the census counts those calls (_torch_compat.self_differentiation), the probe records the
# first (Probe.differentiates), and the structured backend declines before any work, naming
# the graph walk, which backpropagates through f's own passes at any order, and the jacobian
# backend (torch.func transforms nest); its tapping mode also declines at such a call, should
# an evaluation make one the probe did not see. A backward without create_graph gives f
# constants, which the taps would get right; it is declined all the same (with respect to a
# parameter it met the taps' gradient-free copies: torch's raw "does not require grad").
# An f that differentiates with respect to its parameters needs them to require grad, which a
# probe without gradients does not give (torch's raw error from every backend): the probe
# then evaluates again with leaves that require grad.


class OpCensus(TorchFunctionMode):
    """Records, while ``f`` runs, the calls that matter to how it may be differentiated.

    Attributes:
        coupling: Calls that make samples interact (:func:`coupling_op`).
        unbatched: Calls whose backward ``vmap`` gets wrong (``_torch_compat``): the rows'
            vjps then run one at a time.
        hooks: How many gradient hooks ``f`` registered on its tensors (NOTE [gradient
            hooks inside f]).
        sparse_embeddings: Whether ``f`` asked an embedding for a sparse gradient (it gets a
            dense one here: NOTE [sparse embedding gradients]).
        differentiates: How ``f`` first differentiated its own computation, or ``None`` (NOTE
            [f that differentiates itself]).
        decomposed: Calls that torchgram's later evaluations of ``f`` run decomposed (NOTE
            [prelu as where]) or watched (``watched_calls``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.coupling: list[str] = []
        self.unbatched: list[str] = []
        self.hooks = 0
        self.needs_graph = 0  # calls torch refuses without a graph (NEEDS_GRAPH)
        self.reentrant_checkpoint = False  # NOTE [reentrant checkpoints seen]
        self.sparse_embeddings = False
        self.differentiates: str | None = None
        self.decomposed: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in NEEDS_GRAPH:
            self.needs_graph += 1
            self.hooks += func in GRADIENT_HOOKS
        if func is torch._C._set_grad_enabled and args and args[0] is False \
                and _in_reentrant_checkpoint():
            self.reentrant_checkpoint = True
        if self.differentiates is None:
            self.differentiates = _torch_compat.self_differentiation(func)
        rewritten = with_dense_gradients(func, args, kwargs)
        if rewritten is not None:  # NOTE [sparse embedding gradients]
            args, kwargs = rewritten
            self.sparse_embeddings = True
        why = coupling_op(func, args, kwargs)
        if why is not None and why not in self.coupling:
            self.coupling.append(why)
        name = _torch_compat.wrong_batched_backward(func)
        if name is not None and name not in self.unbatched:
            self.unbatched.append(name)
        watched = watched_name(func)  # the table of watched_calls
        if watched is not None and watched not in self.decomposed:
            self.decomposed.append(watched)
        return func(*args, **kwargs)
