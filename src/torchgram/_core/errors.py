"""The errors a computation can raise besides bad input: a backend's declared inability.

# NOTE [declared inability]
A backend that meets something it cannot compute exactly (an op without forward-mode AD
for ``ntvp``, an op without a batching rule on a ``vmap`` path, ...) never returns a wrong
matrix and never lets a raw torch error escape: it raises :class:`BackendCannotRun`, which
says what it met and which backends or options can. ``auto`` catches it and runs the next
candidate of its plan (``torchgram.explain(..., run=True)`` shows the attempts); a backend
the user chose explicitly lets it reach the user, whose message then names the fix.

:class:`OutputChanged` is internal: an evaluation of ``f`` returned an output whose
structure differs from the one the call was planned for (a cached probe gone stale), or did
what its probe did not see (:class:`UnseenWrite`); the pipeline drops its caches and plans
the call afresh, once, and raises :func:`output_changed_refusal` where that happens again:
it never reaches the user itself.

# NOTE [old-style autograd.Functions]
A custom ``autograd.Function`` whose ``forward`` takes ``ctx`` (no ``setup_context``
staticmethod; ``transformers``' BLOOM GELU) runs under plain autograd only: inside a
``torch.func`` transform (``vmap``, ``vjp``, ``jvp``) torch raises a ``RuntimeError``; so it
does for ``Tensor.requires_grad_()`` called inside ``f``, for saved-tensor hooks (a
non-reentrant ``torch.utils.checkpoint`` region) and for random ops that a checkpoint's
backward recomputes inside a vmapped backward. The
``jacobian`` and ``ntvp`` backends and the per-sample ``vmap`` ways run ``f`` under
transforms; the graph walk and the structured backend's batched pass do not. Every
registered backend runs inside :func:`torch_refusals`, which turns that error into
:class:`BackendCannotRun`, so ``auto`` goes on to a backend that can and an explicit choice
names it. The trace lists what transforms would refuse (the old-style Functions in the graph
of the rows, checkpoint regions: ``Recording.transform_refusals``), and ``auto`` then tries
those backends last, and plans the structured pass on the rows of the whole batch where its
per-sample ``vmap`` way would meet them (NOTE [refused per-sample passes]), so that
``explain`` predicts what runs.
``torch.utils.checkpoint(..., use_reentrant=True)`` is an old-style Function too, and torch
also refuses ``torch.autograd.grad`` through it, which every backend takes: that refusal
becomes a torchgram ``ValueError`` naming the fix (``use_reentrant=False``).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.utils.checkpoint
from torch import Tensor

from torchgram._core import _torch_compat
from torchgram._core.checks import message


class BackendCannotRun(NotImplementedError):  # noqa: N818 -- reads as a statement, like StopIteration
    """A backend cannot compute this Gramian exactly; other backends or options can.

    Args:
        api: The public API that was called.
        backend: The backend that cannot run.
        expected: What the backend needs.
        got: What it met instead.
        alternatives: Backends (or options) that can, in order of preference.
        fix: What the user can do, in a sentence (``alternatives`` are named before it);
            kept as ``fix``.

    Example:
        >>> error = BackendCannotRun("torchgram.gramian", "ntvp", "forward-mode AD",
        ...                          "aten::cdist", ("jacobian", "graph"), "")
        >>> error.alternatives
        ('jacobian', 'graph')
        >>> str(error).split(", but got ")[1]
        "aten::cdist. Use backend='jacobian' or backend='graph'. "
    """

    def __init__(self, api: str, backend: str, expected: str, got: str,
                 alternatives: Sequence[str], fix: str) -> None:
        self.api = api
        self.backend = backend
        self.alternatives = tuple(alternatives)
        self.reason = got
        self.fix = fix
        use = " or ".join(f"backend={name!r}" for name in self.alternatives)
        advice = (f"Use {use}. " if use else "") + fix
        super().__init__(message(api, f"{expected} (backend={backend!r})", got, advice))


class DifferentiatedTwice(RuntimeError):  # noqa: N818
    """A node of a tapped pass that is differentiable once was differentiated with a graph.

    Raised by the fused recurrences' backward under ``create_graph`` (NOTE [fused
    recurrences]): only ``f`` differentiating its own LSTM or GRU inside the pass does that.
    :func:`torch_refusals` turns it into :class:`BackendCannotRun`.
    """


class ParameterConverted(RuntimeError):  # noqa: N818
    """A tapped call met a parameter whose dtype ``f`` changed in place.

    ``module.to(dtype)`` inside ``f`` (``transformers``' Switch router casts its classifier to
    float32 in every forward) assigns ``param.data`` a converted copy; the structured backend's
    taps hold the parameter's values in its old dtype (session 63's hunt: torch's raw "mat1
    and mat2 must have the same dtype" from ``structured`` and ``auto``, on a bfloat16 or
    float64 model). :func:`torch_refusals` and ``auto``'s planning turn it into
    :class:`BackendCannotRun` naming the graph walk, which follows the conversion (``jacobian``
    follows it with ``batch_dim`` only: without, it refuses the ``.data`` assignment).
    """


def parameter_converted_refused(api: str, error: ParameterConverted) -> BackendCannotRun:
    """The structured backend's refusal of :class:`ParameterConverted`."""
    return BackendCannotRun(
        api, "structured", "f that leaves its parameters' dtypes as they are",
        f"a parameter converted inside f ({error}: module.to(dtype) in a forward)",
        ("graph",), "It follows the conversion as a plain backward does.")


class DifferentiatesItself(RuntimeError):  # noqa: N818
    """``f`` differentiated its own computation inside a tapped pass.

    NOTE [f that differentiates itself] (``census.py``): raised by the structured backend's
    tapping mode at the call, should the probe not have seen one; :func:`torch_refusals` and
    ``auto``'s planning turn it into :func:`self_differentiation_refused`.

    Attributes:
        how: The call (``"torch.autograd.grad"``, forward-mode AD).
    """

    def __init__(self, how: str) -> None:
        super().__init__(how)
        self.how = how


def self_differentiation_refused(api: str, backend: str, how: str) -> BackendCannotRun:
    """The structured backend declines an ``f`` that differentiates itself; the graph walk can.

    NOTE [f that differentiates itself] (``census.py``).

    Example:
        >>> error = self_differentiation_refused("torchgram.gramian", "structured",
        ...                                      "torch.autograd.grad")
        >>> error.alternatives, error.reason
        (('graph', 'jacobian'), 'a call of torch.autograd.grad inside f')
    """
    return BackendCannotRun(
        api, backend, "f that does not differentiate its own computation (the taps see the "
        "torch functions f calls, not what a backward or forward-mode pass of f's own "
        "computes with the same parameters)", f"a call of {how} inside f",
        ("graph", "jacobian"), "")


class OutputChanged(RuntimeError):  # noqa: N818
    """An evaluation of ``f`` did not return the output structure the call was planned for.

    Attributes:
        samples: Where only the output's size along its batch dimension differs: that size
            and the batch's ``B`` (a per-sample ``f`` that drops or adds samples); else ``None``.
    """

    def __init__(self, message: str, samples: tuple[int, int] | None = None) -> None:
        super().__init__(message)
        self.samples = samples


class UnseenWrite(OutputChanged):
    """An evaluation of ``f`` was about to write into a tensor ``f`` captured or received.

    NOTE [writes its probe did not see] (``captured_writes.py``): raised before the write,
    where the call's probe saw none; the call then probes the whole batch afresh.

    Attributes:
        write: The writing call (``add_``, ``copy_``, ``embedding``...), for the message.
    """

    def __init__(self, write: str, message: str) -> None:
        super().__init__(message)
        self.write = write


def output_changed_refusal(api: str, error: OutputChanged) -> Exception:
    """The public error for an ``f`` that a fresh probe still did not describe.

    The pipeline probes afresh once after :class:`OutputChanged`; where an evaluation after
    that probe raises it again, ``f`` writes into a tensor it did not make (the ``ValueError``
    of :func:`captured_write_refusal`) or changes its output's structure from one evaluation
    to the next (a ``RuntimeError``).

    Example:
        >>> error = UnseenWrite("add_", "f wrote ...")
        >>> type(output_changed_refusal("torchgram.gramian", error)).__name__
        'ValueError'
        >>> type(output_changed_refusal("torchgram.gramian", OutputChanged("..."))).__name__
        'RuntimeError'
    """
    if isinstance(error, UnseenWrite):
        refusal = captured_write_refusal(api, CapturedWrite(error.write))
        assert refusal is not None
        return refusal
    if error.samples is not None:
        got, batch = error.samples
        return ValueError(message(
            api, f"f's output to have one entry per sample along batch_dim (the batch has "
            f"{batch} samples)", f"{got} entries along it on the whole batch",
            "Return one output row per sample (f must not drop, add or pool samples), or call "
            "without batch_dim."))
    todo = "Make the output's structure a function of the inputs' shapes only."
    if torch._C._is_any_autocast_enabled():  # torch.func.vmap skips autocast for some ops
        todo = ("Under torch.autocast, torch.func.vmap runs some ops without it (convolutions "
                "among them), so evaluations under vmap may return another dtype: call outside "
                "torch.autocast (or cast f's output to one dtype). Otherwise: " + todo)
    return RuntimeError(message(
        api, "f to return outputs of the same structure on every evaluation",
        "outputs whose shapes or dtypes change from one evaluation to the next", todo))


@contextlib.contextmanager
def output_changes_refused(api: str,
                           rewind: Callable[[], None] | None = None) -> Iterator[None]:
    """Inside the block, :class:`OutputChanged` becomes :func:`output_changed_refusal`'s error.

    For the evaluations after a fresh probe, the retry's second try: never the internal
    error (NOTE [evaluations after the backend] in ``_api/pipeline.py``). ``rewind``: puts
    the call's generators back where it started before the refusal (NOTE [one draw]).
    """
    try:
        yield
    except OutputChanged as error:
        if rewind is not None:
            rewind()
        raise output_changed_refusal(api, error) from error


class NotPerSample(RuntimeError):  # noqa: N818
    """Evaluating ``f`` one sample at a time does not give its Gramian (NOTE [per-sample]).

    Internal: a backend's per-sample way raises it, and the backend computes the same matrix
    from the whole batch instead.

    Attributes:
        reason: What was found, for reports.
        random: Whether the reason is that ``f`` draws random numbers (as opposed to samples
            that interact, or ``f`` failing on a batch of one).
    """

    def __init__(self, reason: str, *, random: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.random = random


class ModifiedInPlace(RuntimeError):  # noqa: N818
    """``f`` modified in place a tensor that a parameter's use had read.

    NOTE [in-place modifications]: :func:`torch_refusals` turns it into the ``ValueError``
    every backend raises for such an ``f``.

    Attributes:
        what: The use whose input changed, for the message.
    """

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


class CapturedWrite(RuntimeError):  # noqa: N818
    """``f`` was about to write into a tensor it captured or received.

    NOTE [captured writes] (``captured_writes.py``); the probe turns it into
    :func:`captured_write_refusal`, the ``ValueError`` every backend raises for such an ``f``.
    ``str(error)`` is the write's name; ``into`` names the tensor written into where it is one
    of ``f``'s inputs (``"f's argument 'x'"``) or a differentiated parameter.
    """

    def __init__(self, write: str, into: str | None = None, *, parameter: bool = False) -> None:
        super().__init__(write)
        self.into = into
        self.parameter = parameter
        """Whether ``into`` is a differentiated parameter (NOTE [writes into the parameters])."""


class DerivativeFault(RuntimeError):  # noqa: N818 -- a refusal, raised for the API to convert
    """A call whose derivative torch 2.13 gets wrong where ``f`` (or the caller's graph) makes it.

    Each subclass says what every API expected (``expected``), what it got (``got``, formatted
    with the call's name, ``str(error)``) and what to do (``fix``); see
    :func:`derivative_faults_refused` and the modules that raise them (NOTE [singular
    determinants], NOTE [as_strided_scatter's backward], NOTE [scatter_reduce's ties with the
    excluded self]).
    """

    expected = ""
    got = "{call}"
    fix = ""


@contextlib.contextmanager
def derivative_faults_refused(api: str) -> Iterator[None]:
    """Turn a :class:`DerivativeFault` into the torchgram ``ValueError`` that says why."""
    try:
        yield
    except DerivativeFault as error:
        raise ValueError(message(api, error.expected, error.got.format(call=error),
                                 error.fix)) from error


class CounterRead(RuntimeError):  # noqa: N818
    """``f`` used a skipped counter (other than as a number) or statistics left stale.

    A counter whose in-place increment was skipped, or running statistics whose update was
    dropped: NOTE [frozen running statistics] (``running_stats.py``). Every evaluation of
    ``f`` turns it into :func:`counter_read_error`, the ``ValueError`` every backend raises.
    """


class NormInCheckpoint(CounterRead):
    """A training-mode norm call inside a ``torch.utils.checkpoint`` region of ``f``.

    Raised by the evaluation that meets it (the probe: before any backward), turned into
    :func:`recomputation_differs` (NOTE [recomputed checkpoints differ]).
    """


DRAWS_UNDER_TRANSFORMS_FIX = (
    "No backend can inside torch.func transforms (those that evaluate f plainly cannot run "
    "there): evaluate f without random ops (model.eval() for dropout), or compute G outside "
    "the transforms (e.g. a loop over an ensemble's members instead of vmap).")
"""What to do about an ``f`` that draws, called inside ``torch.func`` transforms (NOTE
[draws under torch.func])."""


def draws_refused_by_vmap(api: str, error: BaseException) -> NotImplementedError | None:
    """The torchgram error for ``vmap``'s refusal of a random op (``randomness='error'``).

    ``None`` for any other error. A ``vmap`` around the call in its default mode refuses the
    random ops of ``f`` (dropout) before torchgram knows that ``f`` draws; in the other
    modes every backend declines such an ``f`` (NOTE [draws under torch.func]).

    Example:
        >>> error = RuntimeError("vmap: called random operation while in randomness error "
        ...                      "mode. Please either use the 'same' or 'different' ...")
        >>> str(draws_refused_by_vmap("torchgram.gramian", error))[:59]
        'torchgram.gramian: expected a function that draws no random'
    """
    if not isinstance(error, RuntimeError) or _VMAP_RANDOMNESS not in str(error):
        return None
    return NotImplementedError(message(
        api, "a function that draws no random numbers, inside torch.func transforms",
        "a random op (dropout, ...) under torch.func.vmap, which refuses it in its default "
        "randomness='error' mode", DRAWS_UNDER_TRANSFORMS_FIX))


_VMAP_RANDOMNESS = "called random operation while in randomness error mode"


def f_refused_by_vmap(api: str, error: BaseException) -> NotImplementedError | None:
    """The torchgram error for ``f`` that cannot run under the ``vmap`` around the call.

    ``None`` outside ``vmap`` or for another error. The probe (``f`` on the whole batch,
    with no more transforms than the user's and one ``vjp`` level) failed with one of torch's
    ``vmap`` refusals: data-dependent Python control flow on a tensor or ``.item()``
    (``transformers``' attention-mask checks), an op without a batching rule, or an in-place
    write of a batched value into an unbatched tensor (a fused ``nn.RNN``'s decomposition
    over batched inputs). ``torch.func.vmap`` of ``f`` (or of ``jacrev(f)``) fails the same
    way, and no backend can run ``f`` there (session 31: torch's raw errors before).

    Example:
        >>> error = RuntimeError("Batching rule not implemented for aten::rnn_tanh.input.")
        >>> found = []
        >>> _ = torch.func.vmap(lambda x: (found.append(f_refused_by_vmap("api", error)), x)[1])(
        ...     torch.ones(2))
        >>> str(found[0]).split(", but got ")[0]
        'api: expected f that runs under the torch.func.vmap around the call'
        >>> f_refused_by_vmap("api", error) is None  # no vmap around
        True
    """
    if not isinstance(error, RuntimeError) or "vmap" not in _torch_compat.functorch_transforms():
        return None
    message_text = str(error)
    if not (_torch_compat.missing_batching_rule(error)
            or any(pattern in message_text for pattern in _VMAP_REFUSALS)):
        return None
    return NotImplementedError(message(
        api, "f that runs under the torch.func.vmap around the call",
        f"f refused by vmap (torch: {message_text.splitlines()[0][:160]})",
        "No backend can run such an f there: compute G for each input or parameter set in a "
        "loop instead of vmap, or make f vmappable (no Python control flow on tensor values, "
        "no .item(); torch.func.vmap(f) shows the same error)."))


_VMAP_REFUSALS = ("vmap: It looks like you're", "doesn't match the broadcast shape",
                  "in extra_args that has more elements than `self`")
"""torch's messages for what ``vmap`` cannot run besides a missing batching rule
(``_torch_compat.missing_batching_rule``): data-dependent control flow, and an in-place write
of a batched value into an unbatched tensor (through a broadcasting op, or through an op that
takes the batched values as extra arguments: an embedding's ``max_norm`` renormalises the rows
of batched indices in its unbatched table, session 49)."""


def counter_read_error(api: str, error: CounterRead) -> ValueError:
    """The ``ValueError`` every backend raises for ``f`` using a skipped counter as a tensor.

    Example:
        >>> str(counter_read_error("torchgram.gramian", CounterRead("it is used in mul")))[:56]
        'torchgram.gramian: expected f that does not use, as a te'
    """
    if isinstance(error, NormInCheckpoint):
        return recomputation_differs(api, str(error))
    return ValueError(message(
        api, "f that does not use, as a tensor, a 0-dim integer tensor it increments in "
        "place, nor running statistics after a training-mode norm call (torchgram evaluates "
        "f several times and leaves such counters, as batch norm's num_batches_tracked, and "
        "the running statistics as they were: NOTE [frozen running statistics])",
        f"f that does: {error}",
        "Increment the counter outside f, or give f a copy of it (tg.functionalize(model) "
        "runs the module on copies of its buffers); read running statistics before the "
        "training-mode call, or use the batch's own statistics."))


def reentrant_checkpoint_refused(api: str) -> ValueError:
    """A ``torch.utils.checkpoint(..., use_reentrant=True)`` region in ``f``: no backend can."""
    return ValueError(message(
        api, "f without torch.utils.checkpoint(..., use_reentrant=True) regions (torch "
        "cannot differentiate them with torch.autograd.grad, which every backend uses)",
        "a reentrant checkpoint", "Use torch.utils.checkpoint(..., use_reentrant=False): it "
        "recomputes the same way and works with every backend."))


SELECTIVE_CHECKPOINT_EXPECTED = "a graph that can be gone back through more than once"
SELECTIVE_CHECKPOINT_GOT = (
    "a region of selective activation checkpointing (torch.utils.checkpoint with "
    "context_fn=create_selective_checkpoint_contexts), whose saved tensors torch hands out to "
    "one backward pass; the walk goes back through the graph several times")


def selective_checkpoint_refused(api: str, backend: str,
                                 alternatives: Sequence[str]) -> BackendCannotRun:
    """``backend`` goes back through ``f``'s graph more than once: refused by selective checkpoints.

    Their regions let one backward pass through (torch's raw "Trying to backward an extra
    time", session 60's hunt and review).
    """
    return BackendCannotRun(api, backend, SELECTIVE_CHECKPOINT_EXPECTED,
                            SELECTIVE_CHECKPOINT_GOT, alternatives,
                            "" if alternatives else "Or checkpoint without a context_fn "
                            "(use_reentrant=False): every backend but jacobian and ntvp "
                            "recomputes through it.")


def gradient_hooks_refused(api: str, backend: str) -> BackendCannotRun:
    """``backend`` does not run the gradient hooks ``f`` registers; others do.

    NOTE [gradient hooks inside f]: ``jacobian`` and ``structured`` run them.
    """
    return BackendCannotRun(
        api, backend, "f without gradient hooks on its tensors (this backend does not run "
        "them the way torch's backward does)", "Tensor.register_hook calls inside f",
        ("jacobian", "structured"), "Or register the hooks outside f.")


IN_PLACE_FIX = ("Write the in-place op out of place: y = F.relu(y) instead of "
                "F.relu(y, inplace=True) or nn.ReLU(inplace=True), y = y + x instead of "
                "y += x, h = h * 2 instead of h.mul_(2).")
"""What to do about a saved tensor modified in place (NOTE [in-place modifications])."""


def in_place_what(error: RuntimeError) -> str:
    """What was modified, from torch's refusal or a :class:`ModifiedInPlace` (no hint)."""
    if isinstance(error, ModifiedInPlace):
        return error.what
    return str(error).split(". Hint:")[0]


def in_place_refusal(api: str, error: BaseException) -> ValueError | None:
    """The ``ValueError`` for torch's refusal of a saved tensor modified in place, or ``None``.

    NOTE [in-place modifications]: every backend refuses such an ``f``, and so does the
    probe when ``f``'s own backward (NOTE [f that differentiates itself]) meets it.

    Example:
        >>> refusal = in_place_refusal("torchgram.gramian", ModifiedInPlace("h was"))
        >>> str(refusal)[:66]
        'torchgram.gramian: expected f that leaves the tensors its differen'
        >>> in_place_refusal("torchgram.gramian", RuntimeError("other")) is None
        True
    """
    if not isinstance(error, ModifiedInPlace) and not (
            isinstance(error, RuntimeError) and _torch_compat.is_in_place_error(error)):
        return None
    return ValueError(message(
        api, "f that leaves the tensors its differentiated ops read as they were (torch's "
        "autograd refuses a backward through a saved tensor changed in place, on every "
        "backend)", in_place_what(error), IN_PLACE_FIX))


_TIED_KEYS = re.compile(r"functional_call got multiple values for keys (\[.*?\]), which are tied")


class RunningStatsDifferentiated(RuntimeError):  # noqa: N818 -- a refusal for the API
    """An eval-mode norm read running statistics among the differentiated tensors.

    NOTE [running statistics differentiated] (``running_stats.py``); the probe turns it into
    :func:`running_stats_refusal`.
    """


def running_stats_refusal(api: str) -> ValueError:
    """The ``ValueError`` for a norm's running statistics among the differentiated tensors.

    NOTE [running statistics differentiated].

    Example:
        >>> str(running_stats_refusal("torchgram.gramian"))[:50]
        'torchgram.gramian: expected differentiated tensors'
    """
    return ValueError(message(  # torch's native_batch_norm has no derivative there
        api, "differentiated tensors with respect to which torch can differentiate f",
        "a batch norm's running statistics among them (torch's batch norm has no "
        "derivative with respect to its running mean and variance)",
        "Keep the buffers out of the differentiated argument: "
        "fn, params = tg.functionalize(model) differentiates the parameters only, "
        "or pass the buffers as another argument."))


def tied_keys_refusal(api: str, error: BaseException) -> ValueError | None:
    """The ``ValueError`` for ``functional_call`` refusing two values of tied names, or ``None``.

    A dict holding one tensor under two names a module ties (``head.weight`` and
    ``emb.weight``) reaches ``functional_call`` as two values: torchgram, like
    ``torch.func.jacrev``, differentiates each leaf of the pytree apart. torch's raw
    ``ValueError`` suggested ``tie_weights=False``, which unties them and changes the Gramian
    (session 67's hunt).

    Example:
        >>> torch_error = ValueError("functional_call got multiple values for keys "
        ...                          "['emb.weight', 'head.weight'], which are tied. ...")
        >>> "['emb.weight', 'head.weight']" in str(tied_keys_refusal("torchgram.gramian",
        ...                                                          torch_error))
        True
        >>> tied_keys_refusal("torchgram.gramian", ValueError("other")) is None
        True
    """
    found = _TIED_KEYS.search(str(error)) if isinstance(error, ValueError) else None
    if found is None:
        return None
    return ValueError(message(
        api, "differentiated parameters that name each tensor a module ties once (each leaf "
        "of the pytree is differentiated apart, so two names holding one tensor reach "
        "torch.func.functional_call as two values)",
        f"the tied names {found.group(1)} among them",
        "Keep one of the tied names in the dict (functional_call gives the module's other "
        "names the same tensor): dict(model.named_parameters()) does, and so does "
        "fn, params = tg.functionalize(model). tie_weights=False would untie them, another "
        "Gramian."))


def captured_write_refusal(api: str, error: BaseException) -> ValueError | None:
    """The ``ValueError`` for ``f`` writing into a tensor it did not make, or ``None``.

    NOTE [captured writes] (``_core/captured_writes.py``): raised by the probe before the
    write, on every backend.

    Example:
        >>> str(captured_write_refusal("torchgram.gramian", CapturedWrite("add_")))[:60]
        'torchgram.gramian: expected f that writes only into tensors '
        >>> refusal = captured_write_refusal("torchgram.gramian",
        ...                                  CapturedWrite("__setitem__", "f's argument 'x'"))
        >>> "but got an in-place __setitem__ into f's argument 'x'" in str(refusal)
        True
    """
    if not isinstance(error, CapturedWrite):
        return None
    if str(error) in ("embedding", "embedding_bag"):  # max_norm: NOTE [captured writes]
        return ValueError(message(
            api, "f that writes only into tensors it made (torchgram evaluates f several "
            "times per call: each write into a tensor f captured or received would change "
            "yours)",
            f"an {error} with max_norm, which renormalises rows of a table f did not get "
            "among the differentiated parameters, in place",
            "Pass the table among the parameters (torchgram then renormalises its own copy "
            "and leaves yours as it is), or renormalise it once before the call (e.g. "
            "torch.embedding_renorm_(table, indices, max_norm, 2.0) under torch.no_grad()) "
            "and call the embedding without max_norm."))
    expected = ("f that writes only into tensors it made (torchgram evaluates f several times "
                "per call: each write into a tensor f captured or received would change yours "
                "and make the next evaluation another function)")
    if error.parameter:  # NOTE [writes into the parameters]
        return ValueError(message(
            api, "f that leaves the parameters it is differentiated with respect to as they "
            "are (torchgram differentiates f at the values you pass and evaluates f several "
            "times per call: a write into them would make each evaluation another function)",
            f"an in-place {error} into {error.into}",
            "Apply the update outside f, before the call (e.g. under torch.no_grad()), or "
            "compute the changed value out of place inside f (v = v + 1 instead of "
            "v.add_(1)): it is then part of what is differentiated. For a buffer the module "
            "updates itself (spectral_norm's vectors, running statistics) passed among the "
            "differentiated tensors, keep it out of them: tg.functionalize(model) "
            "differentiates the parameters only."))
    if error.into is not None:  # one of f's inputs: tg.functionalize would not help
        return ValueError(message(
            api, expected, f"an in-place {error} into {error.into}, a tensor you pass to f",
            "Clone it inside f before anything writes into it (x = x.clone(), or "
            "model(x.clone()) where the model's forward writes into its input), or write "
            "out of place (torch.where or masked_fill instead of x[mask] = 0)."))
    return ValueError(message(
        api, expected,
        f"an in-place {error} into a tensor f did not make (a module buffer updated by its "
        "forward, such as a running average or a counter, when f calls "
        "torch.func.functional_call(model, ...); or f's own input)",
        "Use fn, params = tg.functionalize(model): its calls work on copies of the module's "
        "buffers and leave yours as they are. Or move the update out of f, or write it out "
        "of place."))


_WITHOUT_TRANSFORMS = ("graph", "structured")
"""Backends that can run ``f`` without ``torch.func`` transforms, surest first."""

_TRANSFORMING = ("jacobian", "ntvp")
"""Backends that always run ``f`` under ``torch.func`` transforms."""


@contextlib.contextmanager
def torch_refusals(api: str, backend: str, parameters: Sequence[Tensor] = (),
                   cross: bool = False, differentiates: str | None = None) -> Iterator[None]:
    """Turn torch's refusals of old-style ``autograd.Function``s into torchgram errors.

    Under a transform, :class:`BackendCannotRun`; a reentrant checkpoint under
    ``torch.autograd.grad``, a ``ValueError`` (NOTE [old-style autograd.Functions]); a saved
    tensor modified in place, a ``ValueError`` (NOTE [in-place modifications]); an op without
    a forward-mode derivative under ``jvp``, a ``NotImplementedError``
    (:func:`forward_mode_refusal`). Where ``f`` differentiates itself (``differentiates``:
    how, NOTE [f that differentiates itself]), any other torch error of a backend but the
    graph walk is a :class:`BackendCannotRun` naming it: under the transforms of ``jacobian``
    and ``ntvp``, what ``f`` differentiates need not require grad (torch's "does not require
    grad", where the graph walk is exact).

    Example:
        >>> import torch
        >>> class Square(torch.autograd.Function):  # forward(ctx, ...): old style
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         ctx.save_for_backward(x)
        ...         return x * x
        ...     @staticmethod
        ...     def backward(ctx, grad):
        ...         return 2 * ctx.saved_tensors[0] * grad
        >>> try:
        ...     with torch_refusals("torchgram.gramian", "jacobian"):
        ...         torch.func.vmap(Square.apply)(torch.ones(2))
        ... except BackendCannotRun as error:
        ...     print(error.alternatives)
        ('graph', 'structured')
    """
    try:
        yield
    except AssertionError as error:  # torch.compile'd code inside f, under a transform
        if _torch_compat.is_hook_without_grad_error(error) and backend not in (
                "jacobian", "structured"):  # NOTE [gradient hooks inside f]: a multi-grad hook
            raise gradient_hooks_refused(api, backend) from error
        if backend == "ntvp" and "flat_bdims must not be None" in str(error):
            raise _declined(api, backend, _torch_compat.Refusal(  # torch.func.jvp's own
                "a custom autograd.Function under vmap inside f whose forward-mode derivative "
                "torch cannot batch (no jvp staticmethod, generate_vmap_rule=True)",
                "Or give the Function a jvp staticmethod.")) from error
        if backend not in _TRANSFORMING or not _torch_compat.raised_in_dynamo(error):
            raise
        refusal = _torch_compat.Refusal(
            f"torch.compile'd code that torch {torch.__version__} cannot run under them "
            f"(dynamo raised: {str(error).splitlines()[0][:60]})", "")
        raise _declined(api, backend, refusal) from error
    except RuntimeError as error:  # NotImplementedError included
        if isinstance(error, DifferentiatesItself):
            raise self_differentiation_refused(api, backend, error.how) from error
        if isinstance(error, ParameterConverted):
            raise parameter_converted_refused(api, error) from error
        if isinstance(error, DifferentiatedTwice):
            raise BackendCannotRun(
                api, backend, "f that does not differentiate its own nn.LSTM / nn.GRU (the "
                "pass runs their steps as one node, differentiable once)", str(error),
                ("graph",), "") from error
        if (no_forward_mode := forward_mode_refusal(api, error)) is not None:
            raise no_forward_mode from error
        ours = type(error).__module__.startswith("torchgram") or str(error).startswith(
            "torchgram.")
        if differentiates is not None and not ours and _torch_compat.missing_derivative(error):
            raise NotImplementedError(message(
                api, f"f whose own {differentiates} torch can differentiate once more (the "
                "Gramian of such an f needs the derivatives of that pass, on every backend)",
                f"torch's error: {str(error).splitlines()[0][:120].rstrip('.')}",
                "Write that op in f with ops whose backward torch differentiates (for "
                "torch.cdist: ((a[:, None] - b[None]) ** 2).sum(-1).sqrt()).")) from error
        if (in_place := in_place_refusal(api, error)) is not None:
            raise in_place from error
        if not ours and "not differentiable with respect to argument 'running_" in str(error):
            raise running_stats_refusal(api) from error  # (the probe refuses them first)
        if _torch_compat.is_reentrant_grad_error(error):
            raise reentrant_checkpoint_refused(api) from error
        if isinstance(error, torch.utils.checkpoint.CheckpointError):
            first = str(error).strip().splitlines()[0][:120] if str(error).strip() else ""
            raise recomputation_differs(api, f"torch's CheckpointError ({first})") from error
        if _torch_compat.is_sparse_gradient_error(error):
            raise sparse_refusal(api, backend, parameters, cross) from error
        if _torch_compat.is_hook_without_grad_error(error) and backend not in (
                "jacobian", "structured"):  # NOTE [gradient hooks inside f]: which run them
            raise gradient_hooks_refused(api, backend) from error
        refused = _torch_compat.refused_under_transforms(error)
        if refused is not None:  # structured declines an f that differentiates itself
            raise _declined(api, backend, refused, without=() if differentiates is None
                            else ("structured",)) from error
        if differentiates is not None and backend != "graph" and not ours:  # torch's own
            raise BackendCannotRun(
                api, backend, f"f whose own {differentiates} this backend's evaluation of f can "
                "run", f"torch's error: {str(error).splitlines()[0][:120]}", ("graph",),
                "") from error
        raise


def recomputation_differs(api: str, got: str) -> ValueError:
    """A checkpoint region whose backward recomputation differs from torchgram's evaluation.

    NOTE [recomputed checkpoints differ]: torchgram evaluates ``f`` with the normalisation
    layers' running statistics left alone (NOTE [frozen running statistics]: batch norm in
    training mode is called without its running buffers); a non-reentrant
    ``torch.utils.checkpoint`` region is recomputed by the backward as written, outside those
    evaluations, where a batch norm in training mode saves other tensors than its first run
    did and updates the module's running statistics. torch raised its raw ``CheckpointError``
    from every backend that runs ``f`` plainly, after the recomputation had moved the
    statistics (the review of session 65; the others refuse checkpoints under
    ``torch.func``). :class:`FrozenRunningStats` now refuses such a norm call in the
    evaluation that meets it (the probe, before any backward: nothing moves), and any other
    ``CheckpointError`` of a backend gets this message too. An eager forward
    (``tg.autograd.record()``) keeps what the forward did.

    Example:
        >>> str(recomputation_differs("torchgram.gramian", "batch_norm in training mode"))[:62]
        'torchgram.gramian: expected a torch.utils.checkpoint region th'
    """
    return ValueError(message(
        api, "a torch.utils.checkpoint region that its backward recomputes as torchgram "
        "evaluated it", got, "A batch norm in training mode inside the region is one cause: "
        "torchgram's evaluations of f leave the running statistics alone, the backward's "
        "recomputation does not. Put the region's norm layers in eval mode or outside the "
        "region, or run the forward eagerly inside tg.autograd.record() and call "
        "tg.autograd.gramian on its outputs."))


def sparse_refusal(api: str, backend: str, parameters: Sequence[Tensor] = (),
                   cross: bool = False) -> BackendCannotRun:
    """The refusal of ``backend`` meeting a sparse tensor (NOTE [sparse tensors in f]).

    ``parameters``: the differentiated leaves (is one sparse?); ``cross``: a kernel between two
    input sets, which the graph walk does not make.

    Example:
        >>> sparse_refusal("torchgram.gramian", "jacobian").alternatives
        ('graph',)
        >>> sparse_refusal("torchgram.gramian", "jacobian", [torch.eye(2).to_sparse()]).reason
        'a sparse parameter'
    """
    # NOTE [sparse tensors in f]
    # A sparse tensor meets code that needs the strided layout: a sparse gradient torchgram's
    # evaluations could not make dense (an embedding with sparse=True inside TorchScript,
    # NOTE [sparse embedding gradients]), an input of f that is not split per sample (COO or
    # CSR: torch.sparse.mm(x, w), x @ w; NOTE [sparse inputs] for split ones), or a sparse
    # parameter. The graph walk densifies what its nodes return and takes sparse inputs
    # (session 35's sweep: x @ w and torch.sparse.mm(x, w), COO and CSR, the oracle's matrix);
    # it is named. A sparse parameter is taken by the structured backend (COO and CSR) and
    # jacobian (COO) where f uses it as in x @ w, not where f densifies or transposes it
    # (session 35's review), so no backend is named for it: auto tries them all, and the
    # message says so. A cross kernel has no graph walk: a sparse input there is for the
    # backends that take it as it is (COO: jacobian, auto) or dense.
    if any(leaf.layout != torch.strided for leaf in parameters):
        return BackendCannotRun(
            api, backend, "parameters in the strided (dense) layout", "a sparse parameter",
            (), "Pass the parameters dense (p.to_dense()): the Gramian is the same. "
            "backend='auto' tries every backend (structured, and jacobian for COO, take sparse "
            "parameters used as in x @ w).")
    return BackendCannotRun(
        api, backend, "tensors in the strided (dense) layout",
        "a sparse tensor: an input of f, or a sparse gradient from a call torchgram cannot make "
        "dense (e.g. an embedding with sparse=True inside TorchScript)",
        () if backend == "graph" or cross else ("graph",),
        "Or pass dense inputs (x.to_dense()) and ask for dense gradients (sparse=False): the "
        "Jacobian is the same.")


def forward_mode_refusal(api: str, error: BaseException) -> NotImplementedError | None:
    """The torchgram error for ``error``, torch's missing forward-mode derivative under jvp.

    Under ``torch.func.jvp`` or ``jacfwd`` around the call, ``G``'s tangent needs forward-mode
    derivatives of ``f``'s ops and of their first derivatives (backward ops included:
    ``hardsigmoid``'s backward has none in torch 2.13), on every backend; where torch has
    none, no backend can (session 30's compose hunt: torch's raw ``NotImplementedError`` from
    all five on MobileNet-like models). ``None`` for any other error.

    Example:
        >>> torch_error = NotImplementedError("Trying to use forward AD with cdist that does "
        ...                                   "not support it")
        >>> forward_mode_refusal("torchgram.gramian", torch_error) is None  # no jvp around
        True
        >>> seen = []
        >>> def under_jvp(x):
        ...     seen.append(forward_mode_refusal("torchgram.gramian", torch_error))
        ...     return x
        >>> import warnings
        >>> with warnings.catch_warnings():  # torch's first forward-mode product warns
        ...     warnings.simplefilter("ignore", DeprecationWarning)
        ...     _ = torch.func.jvp(under_jvp, (torch.ones(1),), (torch.ones(1),))
        >>> str(seen[0]).split(", but got ")[1][:40]
        'the op cdist, which has none in torch 2.'
    """
    missing = _torch_compat.missing_forward_ad(error)
    if missing is None or "jvp" not in _torch_compat.functorch_transforms():
        return None
    kind, name = missing
    what = f"the op {name}" if kind == "op" else "a custom autograd.Function without a jvp"
    return NotImplementedError(message(
        api, "f whose ops and their derivatives have forward-mode derivatives "
        "(torch.func.jvp or jacfwd through a Gramian or kernel differentiates f's first "
        "derivatives in forward mode, on every backend)",
        f"{what}, which has none in torch {torch.__version__}",
        "Differentiate it in reverse mode instead (torch.func.grad, vjp or jacrev), or "
        "replace that op by one with forward-mode support."))


def unseen_calls_refused(api: str, ops: Sequence[str], situation: str,
                         by_transforms: bool) -> NotImplementedError:
    """No backend can differentiate ``G`` through code the modes cannot see (TorchScript).

    NOTE [unseen calls] (``unseen.py``): torch computes zero second derivatives through
    TorchScript under ``torch.func`` transforms. ``situation``: the composition, in words;
    ``by_transforms``: a ``grad`` or ``jvp`` transform differentiates ``G`` (otherwise an
    eager backward may: ``G``'s value is then returned).

    Example:
        >>> error = unseen_calls_refused("torchgram.gramian", ["aten.mm.default"],
        ...                              "inside torch.func transforms (grad)", True)
        >>> str(error).split(", but got ")[1][:58]
        'the ops aten.mm.default, run by code torchgram cannot see '
    """
    shown = ", ".join(ops[:4]) + (f" and {len(ops) - 4} more" if len(ops) > 4 else "")
    scripted = ("call the Python function instead of its scripted version (setting "
                "PYTORCH_JIT=0 before torch is imported makes torch.jit.script return it)")
    fix = (f"To differentiate through G, {scripted}; or compute G outside the transform."
           if by_transforms else
           "G's value is right: detach it if you do not differentiate it (or pass "
           f"parameters that do not require grad). To differentiate through G, {scripted}.")
    return NotImplementedError(message(
        api, f"f without TorchScript where the Gramian is differentiated, as {situation}: "
        "its derivative needs second derivatives of f, which torch "
        f"{torch.__version__} computes as zero through TorchScript under torch.func "
        "transforms, on every backend",
        f"the ops {shown}, run by code torchgram cannot see (a function made by "
        "torch.jit.script or torch.jit.trace, or a C++ extension's)", fix))


def _declined(api: str, backend: str, refusal: _torch_compat.Refusal,
              without: tuple[str, ...] = ()) -> BackendCannotRun:
    """``backend`` cannot run ``f`` under the transforms it uses; the others can.

    ``without``: backends not to name (they decline ``f`` for another reason).
    """
    return BackendCannotRun(api, backend, "f to run under torch.func transforms (vmap, vjp, jvp)",
                            refusal.what,
                            tuple(name for name in _WITHOUT_TRANSFORMS
                                  if name != backend and name not in without),
                            refusal.fix)
