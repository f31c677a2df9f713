"""Every private or undocumented torch behaviour torchgram relies on, in one place.

Each function here wraps one such behaviour, and ``tests/_core/test_torch_compat.py`` checks
each against the installed torch, so that a torch release that moves one fails a named
test instead of producing a wrong Gramian. Nothing else in the package touches these
internals directly.

* autograd nodes (the graph backend walks an existing graph): a node's input metadata
  (``node._input_metadata``), what a node saved (``node._saved_<name>``), its creation
  order (``node._sequence_nr()``), calling a C++ node directly (``node(*grads)``), the
  Python node of a custom ``autograd.Function`` (``BackwardCFunction``, its ``apply`` and
  ``needs_input_grad``), a leaf's
  ``AccumulateGrad`` ``variable``, the reentrant checkpoint's Function
  (``torch.utils.checkpoint.CheckpointFunction``), the Function through which module
  backward hooks run (``torch.nn.modules._functions.BackwardHookFunction``);
* error messages torch raises that mean something precise: an op or a custom Function
  without forward-mode AD, a graph freed by an earlier backward;
* ``Tensor.T`` / ``Tensor.mT`` as seen by a ``TorchFunctionMode`` (the getter's descriptor as
  ``func.__self__``);
* ``torch.distributed``: the ``TorchDispatchMode`` base class
  (``torch.utils._python_dispatch``), the namespaces of the ops collectives dispatch, and
  FSDP2's internals: the class ``fully_shard`` replaced (``_orig_cls_mro_index``), its
  forward hooks (``FSDPState._pre_forward_hook_handle``...) and its parameters
  (``FSDPParamGroup.fsdp_params``: ``sharded_param``, ``_unsharded_param``,
  ``_module_info``) and the custom Function it puts on a sharded module's inputs
  (``RegisterPostBackwardFunction``);
* the functorch transforms active around a call (``torch._C._functorch.get_interpreter_stack``:
  torch has no public way to ask whether code runs under ``torch.func.grad`` or ``vmap``).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import re
import sys
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import optree
import torch
from torch import Tensor
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge
from torch.nn.modules._functions import BackwardHookFunction
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode
from torch.utils.checkpoint import CheckpointFunction

Node = Any
"""An autograd node (``tensor.grad_fn`` or an entry of ``node.next_functions``)."""


# -- autograd nodes ----------------------------------------------------------------------------

@dataclass(frozen=True)
class SlotMetadata:
    """What the engine knows of a node's input slot: the cotangent's shape, dtype, device."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def slot_metadata(node: Node) -> list[SlotMetadata]:
    """One entry per input slot of ``node`` (one per output of its forward op).

    Example:
        >>> y = torch.ones(2, 3, requires_grad=True).sum(0)
        >>> slot_metadata(y.grad_fn)
        [SlotMetadata(shape=(3,), dtype=torch.float32, device=device(type='cpu'))]
    """
    return [SlotMetadata(tuple(meta.shape), meta.dtype, meta.device)
            for meta in node._input_metadata]


def slot_shapes(node: Node) -> tuple[tuple[int, ...], ...]:
    """The shapes of :func:`slot_metadata`, alone (cheaper: graph signatures read them all).

    Example:
        >>> slot_shapes(torch.ones(2, 3, requires_grad=True).sum(0).grad_fn)
        ((3,),)
    """
    return tuple(tuple(meta.shape) for meta in node._input_metadata)


def creation_order(node: Node) -> int:
    """The engine's priority of ``node``: later-created nodes run first in a backward.

    A leaf's ``AccumulateGrad`` has the largest value (``2**64 - 1``).
    """
    return int(node._sequence_nr())


def is_custom_function_node(node: Node) -> bool:
    """Whether ``node`` belongs to a custom ``autograd.Function`` (not callable directly)."""
    return isinstance(node, BackwardCFunction)


def call_builtin_node(node: Node, grads: list[Tensor | None]) -> list[Tensor | None]:
    """Run a C++ node's backward on ``grads``: one gradient (or ``None``) per next edge.

    ``None`` is accepted for an input slot that received no cotangent.
    """
    result = node(*grads)  # a bare tensor when the node has one next edge
    results = [result] if isinstance(result, Tensor) or result is None else list(result)
    # an embedding's sparse gradient, dense (NOTE [sparse embedding gradients])
    return [grad.to_dense() if grad is not None and grad.is_sparse else grad for grad in results]


def call_custom_function_node(node: Node,
                              grads: list[Tensor]) -> tuple[list[Any], tuple[bool, ...]]:
    """Run a custom Function's ``backward``.

    Returns its outputs (one per forward argument) and ``needs_input_grad`` (which forward
    arguments have a next edge, in order).
    """
    result = node.apply(*grads)
    per_argument = list(result) if isinstance(result, tuple | list) else [result]
    return per_argument, tuple(node.needs_input_grad)


def custom_function_class(node: Node) -> type | None:
    """The ``autograd.Function`` subclass whose ``apply`` recorded ``node``, if any."""
    cls = getattr(node, "_forward_cls", None)
    return cls if isinstance(cls, type) else None


def is_old_style_function(cls: type) -> bool:
    """Whether an ``autograd.Function`` subclass is old-style: ``forward(ctx, ...)``.

    Without a ``setup_context`` staticmethod, torch refuses it under ``torch.func`` transforms.
    """
    return getattr(cls, "setup_context", None) is torch.autograd.Function.setup_context


def old_style_functions(output: Tensor) -> list[str]:
    """The old-style ``autograd.Function`` classes in ``output``'s graph, by name.

    In the order a walk from the output meets them (NOTE [old-style autograd.Functions]).
    torchgram's own nodes (``torchgram_rewrite``: the fused recurrences of its tapped passes,
    which never run under ``torch.func``) are not ``f``'s and are left out: counted, they
    sent ``auto`` past ``jacobian`` and ``ntvp`` for every LSTM (session 36's review).

    Example:
        >>> class Twice(torch.autograd.Function):
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         return 2 * x
        ...     @staticmethod
        ...     def backward(ctx, grad):
        ...         return 2 * grad
        >>> old_style_functions(Twice.apply(torch.ones(2, requires_grad=True)).sum())
        ['Twice']
    """
    names: list[str] = []
    for node in graph_nodes(output):
        cls = custom_function_class(node)
        if cls is not None and is_old_style_function(cls) and cls.__qualname__ not in names \
                and not getattr(cls, "torchgram_rewrite", False):
            names.append(cls.__qualname__)
    return names


def graph_nodes(output: Tensor | Sequence[Tensor]) -> Iterator[Node]:
    """The nodes of ``output``'s autograd graph (or outputs'), each once, depth first."""
    seen: set[Node] = set()
    stack = [output.grad_fn] if isinstance(output, Tensor) else [out.grad_fn for out in output]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(next_node for next_node, _ in node.next_functions)


def reached_leaves(output: Tensor, leaves: Sequence[Tensor],
                   nodes: Iterable[Node] | None = None) -> list[int]:
    """The positions in ``leaves`` of the tensors ``output``'s graph reaches.

    ``nodes``: that graph's nodes, when the caller walked it already (:func:`graph_nodes`).

    A tensor is reached when the walk meets its gradient edge's node: its ``AccumulateGrad``
    for a leaf, its ``grad_fn`` otherwise (a view of a parameter that requires gradients).
    A tensor without entries is never reported: no derivative reaches it through the graph
    (the structured backend's NOTE [empty leaves]).

    Example:
        >>> a, b = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
        >>> view = a.view(2)
        >>> reached_leaves((3 * b).sum(), [a, b]), reached_leaves((3 * view).sum(), [b, view])
        ([1], [1])
    """
    for i, leaf in enumerate(leaves):
        if output is leaf:  # the output itself
            return [i]
    # A leaf tensor is known by identity from its AccumulateGrad node's variable (asking for
    # its gradient edge would create that node, ~15 µs a leaf), any other by its grad_fn.
    by_id = {id(leaf): i for i, leaf in enumerate(leaves)
             if leaf.grad_fn is None and leaf.numel()}
    by_node = {leaf.grad_fn: i for i, leaf in enumerate(leaves)
               if leaf.grad_fn is not None and leaf.numel()}
    found = set()
    for node in graph_nodes(output) if nodes is None else nodes:
        if node in by_node:
            found.add(by_node[node])
        elif isinstance(node, _ACCUMULATE_GRAD) and id(variable := node.variable) in by_id:
            found.add(by_id[id(variable)])
    return sorted(found)


_ACCUMULATE_GRAD: Any = getattr(torch._C._functions, "AccumulateGrad")  # noqa: B009 (untyped)
"""The node that accumulates a leaf tensor's gradient (``node.variable`` is the leaf)."""


def saved_tensor_hooks() -> Any:
    """The innermost saved-tensor hooks in force, or ``None``.

    ``torch.utils.checkpoint``'s non-reentrant regions and ``torch.autograd.graph.save_on_cpu``
    set them.

    Example:
        >>> with torch.autograd.graph.save_on_cpu():
        ...     saved_tensor_hooks() is not None
        True
    """
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def is_reentrant_checkpoint(node: Node) -> bool:
    """Whether ``node`` is a ``torch.utils.checkpoint(..., use_reentrant=True)`` region."""
    return custom_function_class(node) is CheckpointFunction


MODULE_HOOKS = BackwardHookFunction.__qualname__
"""The old-style Function that runs module backward hooks, as :func:`old_style_functions`
names it."""


def is_module_hook_node(node: Node) -> bool:
    """Whether ``node`` runs module backward hooks (``register_full_backward_hook`` & co)."""
    return custom_function_class(node) is BackwardHookFunction


_NORM_BACKWARDS = ("NativeBatchNormBackward0", "CudnnBatchNormBackward0",
                   "MiopenBatchNormBackward0")
_NORM_SAVED = ("_raw_saved_input", "_raw_saved_self")


def recomputes_batch_norm(outputs: Sequence[Tensor]) -> bool:
    """Whether a batch norm below ``outputs`` sits in a non-reentrant checkpoint region.

    Its saved input is packed by the checkpoint's hook (``SavedTensor.unpack_hook``, read
    without unpacking): every access to it recomputes the region, whose batch norm in
    training mode updates its running statistics again (NOTE [recomputed running statistics]
    in ``_api/autograd.py``).
    """
    for node in graph_nodes(outputs):
        if type(node).__name__ in _NORM_BACKWARDS:
            for name in _NORM_SAVED:
                hook = getattr(getattr(node, name, None), "unpack_hook", None)
                if hook is not None and "checkpoint" in getattr(hook, "__qualname__", ""):
                    return True
    return False


def gradient_edge(tensor: Tensor) -> GradientEdge:
    """``torch.autograd.graph.get_gradient_edge(tensor)``, whatever ``tensor``'s class.

    For a leaf, torch finds its ``AccumulateGrad`` through ``tensor.view_as(tensor)``, which a
    ``Tensor`` subclass's ``__torch_function__`` (``w.as_subclass(MyTensor)``, a Parameter
    subclass re-enabling it) turned into a new view node: the graph walk and the eager API
    gave such leaves zero blocks (session 60's hunt). Found with subclasses' torch functions
    off, as for a plain tensor.

    Example:
        >>> class Tagged(torch.Tensor):
        ...     @classmethod
        ...     def __torch_function__(cls, func, types, args=(), kwargs=None):
        ...         return super().__torch_function__(func, types, args, kwargs or {})
        >>> w = torch.ones(2).as_subclass(Tagged).requires_grad_()
        >>> gradient_edge(w).node.name()
        'torch::autograd::AccumulateGrad'
    """
    with torch._C.DisableTorchFunctionSubclass():
        return torch.autograd.graph.get_gradient_edge(tensor)


def is_leaf_accumulator(node: Node) -> bool:
    """Whether ``node`` is a leaf's ``AccumulateGrad`` (the only nodes with a ``variable``)."""
    return not node.next_functions and getattr(node, "variable", None) is not None


def saved(node: Node, name: str) -> Any:
    """What a built-in node saved under ``name`` (``node._saved_<name>``), unpacked.

    Example:
        >>> x = torch.randn(2, 3, requires_grad=True)
        >>> node = (x @ torch.randn(3, 4)).grad_fn  # MmBackward0
        >>> saved(node, "self") is None, tuple(saved(node, "mat2").shape)
        (True, (3, 4))
    """
    return getattr(node, f"_saved_{name}")


_SCALAR_SAVED: dict[type, tuple[str, ...]] = {}


def saved_arguments(node: Node) -> tuple[Any, ...]:
    """The non-tensor arguments a built-in node saved (``dim``, ``training``, ``eps``, ...).

    Tensors a node saves have a ``_raw_saved_<name>`` twin; the other ``_saved_<name>``
    attributes are the op's plain arguments, read without unpacking any tensor. They tell
    apart nodes of one type and shapes that compute differently (``batch_norm`` in training
    mode or not, a mean over another dim).

    Example:
        >>> x = torch.randn(4, 3, requires_grad=True)
        >>> saved_arguments(x.mean(0).grad_fn)[:2]
        (('dim', (0,)), ('keepdim', False))
    """
    names = _SCALAR_SAVED.get(type(node))
    if names is None:
        attributes = dir(node)
        names = _SCALAR_SAVED[type(node)] = tuple(
            name[len("_saved_"):] for name in attributes
            if name.startswith("_saved_") and f"_raw{name}" not in attributes)
    values = []
    for name in names:
        value = getattr(node, f"_saved_{name}")
        if isinstance(value, list):
            value = tuple(value)
        if isinstance(value, Tensor):
            continue
        try:
            hash(value)
        except TypeError:
            value = repr(value)
        values.append((name, value))
    return tuple(values)


_ROW_LOCAL_ROUTING = frozenset({
    "NllLossBackward0", "NllLoss2DBackward0", "MultiMarginLossBackward0",
    "MultilabelMarginLossBackward0", "CtcLossBackward0", "MaskedFillBackward0",
    "MaskedFillBackward1", "WhereBackward0", "NativeDropoutBackward0", "FusedDropoutBackward0",
})
"""Nodes whose saved index or mask tensors route a cotangent within its own row: a target
class (losses), a position (masks), a table's row (embeddings, by prefix), a pooling
window (by prefix), the attention or RNN kernels' random state (by prefix). Left out of the
digest, so a later call's indices may choose other entries of a row than the checked call's:
the derivative checks open these nodes, every entry of a row at once (NOTE [opened
selections] in ``backends/structured/selections.py``)."""
_ROW_LOCAL_PREFIXES = ("EmbeddingBackward", "EmbeddingDenseBackward", "MaxPool",
                       "AdaptiveMaxPool", "FractionalMaxPool", "MaxUnpool", "ScaledDotProduct",
                       "CudnnRnn", "MiopenRnn", "Mkldnn")
"""``EmbeddingBag`` is not among them: its offsets send ``per_sample_weights``' cotangents
to the bags' tokens, across samples (0.07 off, session 28's helper hunt)."""
_TENSOR_SAVED: dict[type, list[str]] = {}
"""Per node type, the saved tensors that may hold indices: a name is dropped once it held a
floating-point tensor (an op's indices and masks are typed as such by its schema)."""


_INT_SAVED: dict[type, tuple[str, ...]] = {}
"""Per node type, its saved values that are not tensors (``start``, ``end``, ``index``,
``dim``, ``shifts``...): Python ints that place rows, read for the digest when they are
integers. Left out: sizes and strides (``sym`` in the name: the signature holds the shapes),
``alpha``/``beta`` scale factors, and convolutions' settings (a convolution never moves
entries between samples; 7 per call on MobileNet's 52 were most of the digest's cost)."""
_NO_INT_ROUTES = ("Convolution", "MkldnnConvolution", "CudnnConvolution", "SlowConv",
                  "ThnnConv")


_SELECTIONS = {"WhereBackward0": "condition", "MaskedFillBackward0": "mask",
               "MaskedFillBackward1": "mask"}
"""Row-local nodes whose mask, when broadcast along the samples, selects for all of them."""


def graph_signature(order: Sequence[Node]) -> tuple[Hashable, ...]:
    """What makes two graphs the same computation, for caches keyed by a graph's signature.

    NOTE [graph signatures]: per node of ``order`` (a graph's nodes in an order that is the
    same for the same graph: creation order, or the walk's from the output), its name, its
    input shapes, its non-tensor saved arguments (``batch_norm``'s ``training``, a
    reduction's ``dim``) and **where its edges lead**: the position in ``order`` of each next
    node, or the ordinal of one not in ``order`` (a leaf's accumulator, numbered as first
    reached), with the edge's input slot. The caches that decide where the samples are (the
    eager sample layouts and the graph walk's decisions, keyed by this) and the structured
    pass's thorough derivative check (run once per signature) must tell apart every graph
    whose cotangents can move between samples otherwise. Before session 40 they held fewer:

    * the eager layouts only the recorded calls, not the code after the ``record()`` block:
      ``l - l.mean()`` there, after a call without it, reused its per-sample layouts (1.0
      off, relative, no error);
    * the eager layouts and the graph walk the nodes, not their edges: ``s * t.flip(0)
      .flip(0)`` (per sample) and ``s.flip(0) * t.flip(0)`` (each row another sample's) make
      the same nodes in the same creation order (0.7 off from the second call, recorded or
      walked);
    * the structured pass the node kinds in walk order, which ``s.flip(0).flip(0) * (s * s)``
      (per sample) and ``s.flip(0) * (s.flip(0) * s)`` (each row mixes samples ``b`` and
      ``B - 1 - b``, which the value check of samples ``0`` and ``B - 1`` cannot see) share:
      1.0 off from the second call on ``auto`` and ``structured``.

    The values of index tensors are the other half of such keys (:func:`routing_values`).

    Example:
        >>> def signature(y):
        ...     nodes = [node for node in graph_nodes(y)
        ...              if not is_leaf_accumulator(node)]
        ...     return graph_signature(sorted(nodes, key=creation_order))
        >>> x = torch.randn(3, 2, requires_grad=True)
        >>> s, t = x[:, 0], x[:, 1]
        >>> per_sample = s * t.flip(0).flip(0)
        >>> s, t = x[:, 0], x[:, 1]
        >>> flipped_t = t.flip(0)
        >>> exchanged = s.flip(0) * flipped_t
        >>> [name for name, *_ in signature(per_sample)] == [
        ...     name for name, *_ in signature(exchanged)]
        True
        >>> signature(per_sample) == signature(exchanged)
        False
    """
    position: dict[Node, int] = {node: i for i, node in enumerate(order)}
    leaves: dict[Node, int] = {}
    described = []
    for node in order:
        edges = tuple(
            None if child is None
            else (position[child] if child in position
                  else -1 - leaves.setdefault(child, len(leaves)), input_nr)
            for child, input_nr in node.next_functions)
        described.append((node.name(), slot_shapes(node),
                          saved_arguments(node), edges))
    return tuple(described)


def routing_values(nodes: Iterable[Node], samples: int | None = None) -> tuple[Hashable, ...]:
    """The values of the index and mask tensors ``nodes`` saved, as a hashable digest.

    A node such as ``x[perm]``'s ``IndexBackward0``, ``gather``, ``sort`` or ``index_put``
    routes each cotangent to a place its saved integer (or boolean) tensor holds, so two
    graphs with the same nodes and shapes can send a sample's cotangent to different
    samples. Caches keyed by a graph's signature add this digest (NOTE [routing values] in
    ``backends/graph/sparse.py``); ``nodes`` come in an order that is the same for the same
    graph (the digest holds their positions in it). Nodes whose saved indices route within
    a row (a loss's target, a dropout or ``where`` mask, an embedding's token ids, pooling
    indices) are left out, so that their values, new every batch, do not defeat the
    caches; a custom Function's saved integer (and 0-dim) tensors count, and so do the
    index tensors and plain values (numbers, ``None``, strings) its forward kept on ``ctx``
    (floats by their sign and zero: NOTE [branches on numbers]).
    So do the integers a node saved that are not tensors (a slice's ``start`` and ``end``,
    a ``select``'s index, ``roll``'s shifts): ``torch.cat([h[:1], h[2:3], h[1:2], h[3:]])``
    behind a Python switch exchanges samples 1 and 2 with the same nodes and shapes (0.43
    off on structured, 0.11 with ``record()``, before session 29). With ``samples``, a
    ``where`` condition or a ``masked_fill`` mask without a dim of that size (a flag
    broadcast along the samples: ``torch.where(flag, h.flip(0), h)``) counts too: it selects
    a branch for every sample.

    Example:
        >>> x = torch.randn(3, 2, requires_grad=True)
        >>> digest = routing_values([x[torch.tensor([0, 1, 2])].grad_fn])
        >>> digest == routing_values([x[torch.tensor([1, 0, 2])].grad_fn])
        False
        >>> routing_values([torch.nn.functional.dropout(x, 0.5).grad_fn])
        ()
        >>> flag = torch.tensor(False)
        >>> len(routing_values([torch.where(flag, x.flip(0), x).grad_fn], samples=3))
        1
    """
    digest: list[Hashable] = []
    for ordinal, node in enumerate(nodes):
        kind = type(node)
        names = _TENSOR_SAVED.get(kind)
        if names is None:
            name = kind.__name__
            routes_within_rows = (name in _ROW_LOCAL_ROUTING
                                  or name.startswith(_ROW_LOCAL_PREFIXES))
            attributes = () if routes_within_rows else dir(node)
            names = _TENSOR_SAVED[kind] = [
                attribute[len("_raw_saved_"):] for attribute in attributes
                if attribute.startswith("_raw_saved_")]
        custom = is_custom_function_node(node)
        if custom:  # what its forward kept on ``ctx``: index tensors, ints
            digest.extend(_ctx_values(ordinal, node))
        else:
            digest.extend(_int_values(ordinal, node))
        if kind.__name__ in _SPARSE_OPERAND_NODES:  # NOTE [sparse routes]
            digest.extend(_sparse_operands(ordinal, node))
        selection = _SELECTIONS.get(kind.__name__) if samples is not None else None
        if selection is not None:
            mask = getattr(node, f"_saved_{selection}", None)
            if isinstance(mask, Tensor) and samples not in mask.shape:
                digest.append((ordinal, selection, 0, _index_digest(mask)))
        for name in tuple(names):
            try:  # a custom Function's are its ``saved_tensors``
                value = node.saved_tensors if custom else getattr(node, f"_saved_{name}")
            except (RuntimeError, AttributeError):  # freed by a backward: the walk says so
                continue
            if isinstance(value, Tensor) and not custom and (value.is_floating_point()
                                                             or value.is_complex()):
                if value.layout != torch.strided:  # NOTE [sparse routes]
                    digest.append((ordinal, name, 0, _sparse_structure(value)))
                    continue
                _TENSOR_SAVED[kind] = [kept for kept in _TENSOR_SAVED[kind] if kept != name]
                continue
            values = value if isinstance(value, list | tuple) else (value,)
            digest.extend((ordinal, name, position, _index_digest(tensor))
                          for position, tensor in enumerate(values) if _holds_indices(tensor))
            if custom:  # NOTE [branches on numbers], NOTE [opaque selections]
                digest.extend((ordinal, name, position, _coarse(tensor.item()))
                              for position, tensor in enumerate(values)
                              if _is_scalar(tensor) and not _holds_indices(tensor))
                if not _is_own_function(node):  # torchgram's fused recurrences are known
                    digest.extend((ordinal, name, position, _gates(tensor))
                                  for position, tensor in enumerate(values)
                                  if isinstance(tensor, Tensor) and tensor.dim() > 0
                                  and tensor.is_floating_point())
    return tuple(digest)


# NOTE [sparse routes]
# A sparse operand routes like an index tensor: ``torch.sparse.mm(A, h)`` with a sparse
# ``[B, B]`` adjacency ``A`` sends sample ``c``'s cotangent to sample ``r`` only where ``A``
# stores ``(c, r)``, and its backward never touches the structural zeros, so no probe (NaN
# or not) sees a coupling that a later call's ``A`` stores. The digest held floating saved
# tensors by nothing: an identity ``A`` on the first call fixed per-sample layouts that
# every later call reused (the eager Gramian 0.14 to 0.28 off, walked or recorded, also
# inside a checkpoint; session 59's hunt). A sparse floating tensor now adds its layout,
# shape and index structure. A node kind whose first saved floating tensor was dense stops
# reading that name (its values change every batch and are no routing), so the matmul
# kinds, where a sparse constant meets a dense activation, also read their operands'
# stored data directly (``SavedTensor.data``: no unpack hook runs, no recomputation).

_SPARSE_OPERAND_NODES = frozenset({
    "MmBackward0", "AddmmBackward0", "BmmBackward0", "BaddbmmBackward0", "MvBackward0",
    "AddmvBackward0", "SparseAddmmBackward0"})
_MATMUL_OPERANDS = ("self", "mat1", "mat2", "batch1", "batch2", "mat", "vec")


_OPERANDS_OF: dict[type, tuple[str, ...]] = {}
"""The matmul operands each node kind saves (:data:`_MATMUL_OPERANDS` it has)."""


def _sparse_operands(ordinal: int, node: Node) -> list[Hashable]:
    """The index structure of the sparse operands a matmul node saved (NOTE [sparse routes])."""
    kind = type(node)
    names = _OPERANDS_OF.get(kind)
    if names is None:
        names = _OPERANDS_OF[kind] = tuple(name for name in _MATMUL_OPERANDS
                                           if hasattr(node, f"_raw_saved_{name}"))
    found: list[Hashable] = []
    for name in names:
        raw = getattr(node, f"_raw_saved_{name}", None)
        try:
            data = None if raw is None else raw.data  # as stored: no unpack hook runs
        except RuntimeError:  # freed by a backward: the walk says so
            continue
        if isinstance(data, Tensor) and data.layout != torch.strided:
            found.append((ordinal, name, "sparse", _sparse_structure(data)))
    return found


def _sparse_structure(value: Tensor) -> tuple[Any, ...]:
    """A sparse tensor's layout, shape and stored positions, digested (NOTE [sparse routes]).

    Example:
        >>> eye = torch.eye(3).to_sparse()
        >>> _sparse_structure(eye) == _sparse_structure(2 * eye)
        True
        >>> _sparse_structure(eye) == _sparse_structure(torch.eye(3).flip(0).to_sparse())
        False
    """
    if value.layout == torch.sparse_coo:
        parts: tuple[Tensor, ...] = (value._indices(),)
    elif value.layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = (value.crow_indices(), value.col_indices())
    elif value.layout in (torch.sparse_csc, torch.sparse_bsc):
        parts = (value.ccol_indices(), value.row_indices())
    else:  # nested or other: what it shows
        parts = ()
    return (str(value.layout), tuple(value.shape), *(_index_digest(part) for part in parts))


def _int_values(ordinal: int, node: Node) -> list[Hashable]:
    """``node``'s saved integers that are not tensors (``_INT_SAVED``), with their names."""
    kind = type(node)
    names = _INT_SAVED.get(kind)
    if names is None:
        attributes = set() if kind.__name__.startswith(_NO_INT_ROUTES) else set(dir(node))
        names = _INT_SAVED[kind] = tuple(
            attribute for attribute in sorted(attributes)
            if attribute.startswith("_saved_") and f"_raw{attribute}" not in attributes
            and not any(part in attribute for part in ("sym", "stride", "alpha", "beta")))
    found: list[Hashable] = []
    for name in names:
        try:
            value = getattr(node, name)
        except (RuntimeError, AttributeError):
            continue
        if isinstance(value, int) or (isinstance(value, tuple) and all(
                isinstance(item, int) for item in value)):
            found.append((ordinal, name, value))
    return found


def _holds_indices(value: Any) -> bool:
    return isinstance(value, Tensor) and not (value.is_floating_point() or value.is_complex())


def _is_scalar(value: Any) -> bool:
    """A 0-dim tensor: a custom Function's saved number, which its backward may branch on."""
    return isinstance(value, Tensor) and value.dim() == 0


def _index_digest(tensor: Tensor) -> tuple[Any, ...]:
    if tensor.layout != torch.strided:  # sparse or nested: its shape and layout only
        return tensor.dtype, tuple(tensor.shape), str(tensor.layout)
    if tensor.dim() == 0:
        # read as a number: a wrapped Python scalar (the 4 of ``x * 4``) fails torch ops
        # under a dispatch mode (the data-parallel phase's NoCollectives: "aten::detach()
        # Expected a value of type 'Tensor' ... found type 'int'", a fuzzed split; session 48)
        return tensor.dtype, (), tensor.tolist()
    held = tensor.detach().cpu().reshape(-1).contiguous()
    content = hashlib.blake2b(held.view(torch.uint8).numpy().tobytes() if held.numel() else b"",
                              digest_size=16)
    return held.dtype, tuple(tensor.shape), content.digest()


# NOTE [branches on numbers]
# A custom Function's backward is Python and may branch on any number its forward kept: ``if
# ctx.coef == 0.0: return g`` (else mix the samples) was walked on later calls with the first
# call's sample layout, 0.21 off, before session 57, whose digest held a ctx's ints and strings
# only (a helper's hunt; likewise a saved 0-dim tensor, ``None`` or a list). Those values count
# now; a float (on ctx, or a saved 0-dim float tensor) only by its sign, zero, NaN and infinity
# (_coarse): a learned step size or scale that a quantiser's Function saves moves every step,
# and its exact value in the digest made every call miss the caches (4.7x slower, a review's
# measurement), while the branches such code takes are at zero, or on a sign. A branch at
# another threshold (``if ctx.scale > 0.5``) is not seen.


# NOTE [opaque selections]
# A custom ``autograd.Function``'s backward is Python torchgram cannot open: a ReLU written as
# one (``torch.where(x > 0, g, 0)``, ``g[x <= 0] = 0``), a compiled function's
# ``CompiledFunctionBackward`` holding a ReLU, a GNN layer whose backward applies a saved
# adjacency as a sparse product. A derivative check or probe whose directions meet a closed
# gate there sees no coupling, and the verdict was cached for the signature: a later call
# with the gate open reused it (``h + MyReLU(h.flip(0) + b)``, closed on the first call:
# 0.21 to 0.41 off on auto and structured, kernels and updates too; the eager walk 0.13 to
# 0.36 off through a compiled ReLU, 0.19 to 0.22 through a saved adjacency; session 59's
# hunt). Where such a node saved floating tensors, their sign pattern (negative, zero,
# positive, NaN per entry) joins the routing digest, so a call whose gates or adjacency
# stand otherwise is checked again. It costs a pass over those tensors per call, and new
# data makes a new digest: such graphs are checked on every call.


def _is_own_function(node: Node) -> bool:
    """Whether ``node`` is one of torchgram's own Functions (NOTE [opaque selections]).

    Its fused LSTM or GRU sequences, whose backward keeps every sample's cotangent in its row.
    """
    forward_cls = getattr(node, "_forward_cls", None)
    return getattr(forward_cls, "__module__", "").startswith("torchgram.")


def _gates(tensor: Tensor) -> tuple[Any, ...]:
    """Where a custom Function's saved floating tensor may stand for gates.

    NOTE [opaque selections]: a constant (an adjacency, a mask) by its whole sign pattern; an
    activation (it requires grad) by which signs occur at all.

    An activation's sign pattern is new with every batch, and keying the check on it ran the
    thorough check at every call of any model with a custom activation Function (a custom
    GELU: 2.4-3.4x slower per call; session 59's review); a gate closed or opened for a
    whole tensor (the coupling the hunt found, closed by a bias of -100) still changes it.

    Example:
        >>> x = torch.tensor([1.0, -2.0], requires_grad=True)
        >>> _gates(x) == _gates(torch.tensor([-1.0, 3.0], requires_grad=True))
        True
        >>> _gates(x) == _gates(torch.tensor([-1.0, -3.0], requires_grad=True))
        False
    """
    if tensor.requires_grad and tensor.layout == torch.strided:
        return ("signs", *_signs_occurring(tensor.detach()))
    return _sign_pattern(tensor)


def _signs_occurring(values: Any) -> tuple[bool, bool, bool, bool]:
    """Whether ``values`` (a tensor or a numpy array) holds negative, zero, positive, NaN.

    Example:
        >>> _signs_occurring(torch.tensor([1.0, -2.0])), _signs_occurring(np.zeros(2))
        ((True, False, True, False), (False, True, False, False))
    """
    return (bool((values < 0).any()), bool((values == 0).any()), bool((values > 0).any()),
            bool((values != values).any()))


def _sign_pattern(tensor: Tensor) -> tuple[Any, ...]:
    """The sign of each entry (NaN apart), digested: where selections can stand.

    Example:
        >>> _sign_pattern(torch.tensor([1.0, -2.0])) == _sign_pattern(torch.tensor([3.0, -1.0]))
        True
        >>> _sign_pattern(torch.tensor([1.0, 0.0])) == _sign_pattern(torch.tensor([1.0, 1.0]))
        False
    """
    if tensor.layout != torch.strided:
        return _sparse_structure(tensor)
    signs = torch.sign(tensor.detach()).to(torch.int8)
    return _index_digest(signs.masked_fill(tensor.detach().isnan(), 2))


def _coarse(number: float) -> tuple[bool, bool, bool, bool]:
    """Where a float stands for a branch: ``(negative, zero, NaN, infinite)``.

    Example:
        >>> _coarse(0.7) == _coarse(3.0), _coarse(0.0) == _coarse(0.7), _coarse(-1.0)
        (True, False, (True, False, False, False))
    """
    return number < 0, number == 0, math.isnan(number), math.isinf(number)


def _ctx_values(ordinal: int, node: Node) -> list[Hashable]:
    """A custom Function's ``ctx`` attributes that may route: index tensors, plain values.

    NOTE [branches on numbers]: floats by :func:`_coarse`.
    """
    found: list[Hashable] = []
    for name, value in sorted(vars(node).items()):
        if _holds_indices(value):
            found.append((ordinal, name, 0, _index_digest(value)))
        elif isinstance(value, Tensor) and value.is_floating_point() and value.dim() > 0 \
                and not _is_own_function(node):  # NOTE [opaque selections]: an adjacency
            found.append((ordinal, name, 0, _gates(value)))  # kept on ctx, not saved
        elif (plain := _plain_value(value)) is not _NOT_PLAIN:
            found.append((ordinal, name, 0, plain))
    return found


_NOT_PLAIN = object()
_PLAIN_TYPES = (type(None), bool, int, float, complex, str)


def _plain_value(value: Any) -> Any:
    """``value`` as a hashable plain value (lists as tuples), or ``_NOT_PLAIN``.

    Example:
        >>> _plain_value([1, (-0.5, None)]), _plain_value(torch.zeros(1)) is _NOT_PLAIN
        ((1, ((True, False, False, False), None)), True)
    """
    if isinstance(value, float):
        return _coarse(value)
    if isinstance(value, _PLAIN_TYPES):
        return value
    if isinstance(value, list | tuple):
        items = tuple(_plain_value(item) for item in value)
        return _NOT_PLAIN if any(item is _NOT_PLAIN for item in items) else items
    if isinstance(value, dict):  # a config of routes: {"perm": [...]} (session 59's review)
        pairs = tuple((repr(key), _plain_value(item)) for key, item in value.items())
        return _NOT_PLAIN if any(item is _NOT_PLAIN for _, item in pairs) else ("dict", pairs)
    if isinstance(value, np.ndarray) and value.dtype.kind in "biu":  # an index array
        held = np.ascontiguousarray(value)
        return ("ndarray", held.dtype.str, held.shape,
                hashlib.blake2b(held.tobytes(), digest_size=16).digest())
    if isinstance(value, np.ndarray) and value.dtype.kind == "f":  # values, as _gates keeps
        return ("ndarray", value.dtype.str, value.shape, *_signs_occurring(value))  # them
    return _NOT_PLAIN


def leaf_of(node: Node) -> Tensor:
    """The leaf tensor of an ``AccumulateGrad`` node (see :func:`is_leaf_accumulator`)."""
    return node.variable


def version(tensor: Tensor) -> int:
    """The version counter of ``tensor``'s storage: it grows with every in-place write."""
    return int(tensor._version)


# -- error messages --------------------------------------------------------------------------

_NATIVE_OP = re.compile(r"Trying to use forward AD with (\S+) that does not support it")
_CUSTOM_FUNCTION = "must implement the jvp function for custom autograd.Function"
_FREED = "backward through the graph a second time"


def forward_ad_level_open() -> bool:
    """Whether the caller opened a ``torch.autograd.forward_ad.dual_level()`` block.

    torch 2.13 nests no forward-mode levels there: a ``torch.func.jvp`` inside one raises
    "Nested forward mode AD is not supported at the moment". (``torch.func.jvp`` opens such
    a level too, but nests its own transforms: not counted.)

    Example:
        >>> with torch.autograd.forward_ad.dual_level():
        ...     inside = forward_ad_level_open()
        >>> inside, forward_ad_level_open()
        (True, False)
    """
    level = int(getattr(torch.autograd.forward_ad, "_current_level", -1))
    return level >= 0 and "jvp" not in functorch_transforms()


def missing_forward_ad(error: BaseException) -> tuple[str, str] | None:
    """``("op", name)`` or ``("function", "")`` if ``error`` says forward AD is missing.

    Example:
        >>> missing_forward_ad(NotImplementedError(
        ...     "Trying to use forward AD with _cdist_forward that does not support it"))
        ('op', '_cdist_forward')
    """
    message = str(error)
    native = _NATIVE_OP.search(message)
    if native is not None:
        return "op", native.group(1)
    if _CUSTOM_FUNCTION in message:
        return "function", ""
    return None


class Refusal(NamedTuple):
    """What ``f`` did that torch refuses under ``torch.func`` transforms, and what to do."""

    what: str
    fix: str


_FUNCTION_FIX = ("Or write the Function with forward(*args) and a setup_context staticmethod "
                 "(see the PyTorch notes 'Extending torch.func with autograd.Function').")

_TRANSFORM_REFUSALS = {
    "must override the setup_context staticmethod": Refusal(
        "an autograd.Function without a setup_context staticmethod (forward(ctx, ...))",
        _FUNCTION_FIX),
    "You are attempting to call Tensor.requires_grad_()": Refusal(
        "a call of Tensor.requires_grad_() (or of torch.autograd.functional) inside f", ""),
    "You are attempting to call Tensor.retain_grad()": Refusal(
        "a call of Tensor.retain_grad() inside f",
        "Or call retain_grad() outside f."),
    "don't yet support saved tensor hooks": Refusal(
        "saved-tensor hooks inside f (torch.utils.checkpoint, torch.autograd.graph.save_on_cpu)",
        ""),
    "We do not yet support calling random operations inside of vmap": Refusal(
        "random operations run inside a vmapped backward (a torch.utils.checkpoint region "
        "with dropout, recomputed in the backward)", ""),
    # torch 2.13's fused RNN kernels over a PackedSequence read their inputs' memory directly,
    # which a transform's wrapped tensors do not have (session 26: raw on every backend but
    # graph, and through auto).
    # a tensor f captured (not one of its arguments) changed in place: torchgram's own
    # evaluations leave norms' running statistics alone (NOTE [frozen running statistics]),
    # so this is another buffer or state of the user's
    "that would mutate a captured Tensor": Refusal(
        "an in-place change of a tensor that f captured rather than took as an argument",
        "Or pass that tensor to f as an argument, or change a copy of it inside f."),
    # a stop-gradient target from the same network (session 59's hunt: raw on every backend
    # but graph; torch.func.jacrev raises it too)
    "Cannot set version_counter for inference tensor": Refusal(
        "a torch.inference_mode() region inside f that reads its parameters or inputs",
        "Or use torch.no_grad() there: it stops gradients the same way."),
    # `module.to(dtype)` inside f writes `param.data` even when nothing changes
    # (nn.Module._apply): `transformers`' Switch router does it on every call (session 60's
    # hunt: raw on every backend but graph, and through auto)
    "mutating directly with `.data` inside functorch transform": Refusal(
        "an assignment to a tensor's .data inside f (e.g. module.to(dtype) or "
        "module.float() called in f's forward)",
        "Or move the module to its dtype once, before calling torchgram."),
    "Cannot access data pointer of Tensor that doesn't have storage": Refusal(
        "an op that reads its inputs' memory directly, which torch.func's wrapped tensors "
        "have not (e.g. nn.LSTM / nn.GRU over a nn.utils.rnn.PackedSequence)", ""),
}


# NOTE [compiled code in f]
# ``torch.compile``'d code called by ``f`` runs through dynamo, which traces the Python it
# calls -- the torch-function modes torchgram evaluates ``f`` under included (the structured
# backend's taps, the census of ops) -- and replays compiled graphs whose calls no mode sees.
# Under torch 2.13 that raised dynamo's own ``AssertionError`` ("Guard failed on the same
# frame it was created") from auto, structured and the eager recording, a raw
# ``RuntimeError`` from the graph backend, and refusals from jacobian and ntvp (session 27).
# A compiled function computes what its Python computes, so torchgram's evaluations of ``f``
# run compiled code eagerly (dynamo's "force_eager" stance, process-wide and shared by
# overlapping calls: ``threads.compiled_code_eager``): every call is then seen, on every
# backend, and the matrix is the oracle's. Compiled code outside ``f`` is unaffected but for
# other threads' calls that overlap one of torchgram's evaluations (run eagerly meanwhile:
# the same values, possibly slower). Torch before 2.6 has no stances: compiled code there
# meets the transforms as before (refusals naming the backends that run it). A thread of
# yours that sets its own stance with `with torch.compiler.set_stance(...)` while a
# torchgram call runs saves and restores the stance it found, which may be force_eager: set
# stances outside torchgram calls (the attention switches share this limit).


def compiled_code_runs_eagerly() -> contextlib.AbstractContextManager[object]:
    """A context in which ``torch.compile``'d code runs eagerly (NOTE [compiled code in f]).

    Dynamo's ``force_eager`` stance where torch has stances and dynamo lets it be set here
    (not inside a region being compiled); otherwise a context that does nothing.

    Example:
        >>> compiled = torch.compile(lambda x: x + 1, backend="eager")
        >>> with compiled_code_runs_eagerly():
        ...     compiled(torch.zeros(1))
        tensor([1.])
    """
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:
        return contextlib.nullcontext()
    try:
        return set_stance("force_eager")  # set now; restored by its __exit__
    except RuntimeError:  # "attempted to set_stance in a torch.compile region"
        return contextlib.nullcontext()


# NOTE [parametrization caches]
# Inside ``torch.nn.utils.parametrize.cached()`` a parametrized weight (``orthogonal``,
# ``weight_norm``) is computed once and kept in a process-wide dict keyed by its module and
# name. torchgram evaluates f several times with other leaves each time (copies, batched or
# dual tensors): a later evaluation read the weight the first one cached, with no path to its
# own leaves (0.72 off, relative, on auto, jacobian and structured, before session 57). Each
# evaluation runs with an empty cache of its own (still a cache: a weight used twice in one
# evaluation is computed once, as in the caller's plain call), and the caller's is put back
# after. Outside ``cached()`` nothing is touched.


@contextlib.contextmanager
def own_parametrization_cache() -> Iterator[None]:
    """An empty parametrization cache for the body where ``parametrize.cached()`` is on.

    Example:
        >>> from torch.nn.utils import parametrize
        >>> with parametrize.cached():
        ...     parametrize._cache[(0, "w")] = torch.zeros(1)
        ...     with own_parametrization_cache():
        ...         inside = dict(parametrize._cache)
        ...     outside = dict(parametrize._cache)
        >>> inside, list(outside)
        ({}, [(0, 'w')])
    """
    from torch.nn.utils import parametrize

    if not getattr(parametrize, "_cache_enabled", 0):
        yield
        return
    callers = parametrize._cache
    parametrize._cache = {}
    try:
        yield
    finally:
        parametrize._cache = callers


def raised_in_dynamo(error: BaseException) -> bool:
    """Whether ``error`` was raised inside ``torch._dynamo`` (``torch.compile``'d code).

    ``torch.compile``'d modules inside ``f`` run under ``torch.func`` transforms only where
    dynamo supports them; torch 2.13 fails some with a bare ``AssertionError`` of its own.
    """
    traceback = error.__traceback__
    while traceback is not None:
        if "/torch/_dynamo/" in traceback.tb_frame.f_code.co_filename.replace("\\", "/"):
            return True
        traceback = traceback.tb_next
    return False


_SPARSE_LAYOUT = re.compile(r"'Sparse[A-Za-z]*' backend|SparseTensorImpl|for sparse tensors"
                            r"|Sparse CSR tensors do not have"
                            r"|unsupported for Sparse[A-Za-z]* tensors")


def is_hook_without_grad_error(error: BaseException) -> bool:
    """Whether ``error`` is torch refusing a gradient hook on a tensor without grad.

    ``f`` registers hooks on its tensors unconditionally (NOTE [gradient hooks inside f]);
    under ``jvp`` alone (``ntvp``'s forward pushes) they do not require grad. torch 2.13's
    ``register_multi_grad_hook`` asserts instead.

    Example:
        >>> try:
        ...     torch.zeros(1).register_hook(lambda g: g)
        ... except RuntimeError as error:
        ...     is_hook_without_grad_error(error)
        True
        >>> try:
        ...     torch.autograd.graph.register_multi_grad_hook([torch.zeros(1)], print)
        ... except AssertionError as error:
        ...     is_hook_without_grad_error(error)
        True
    """
    return (isinstance(error, RuntimeError) and (
        "cannot register a hook on a tensor that doesn't require gradient" in str(error))) or (
        isinstance(error, AssertionError) and "Expected gradient function to be set" in str(error))


def is_sparse_gradient_error(error: BaseException) -> bool:
    """Whether ``error`` is an op refusing a sparse tensor (torch 2.13's messages).

    A sparse gradient met dense code, or a sparse input or parameter of ``f`` met torchgram's.

    Example:
        >>> is_sparse_gradient_error(RuntimeError("reshape is not implemented for sparse "
        ...                                       "tensors"))
        True
        >>> is_sparse_gradient_error(RuntimeError("Sparse CSR tensors do not have strides"))
        True
    """
    return isinstance(error, RuntimeError | NotImplementedError) and bool(
        _SPARSE_LAYOUT.search(str(error)))


def refused_under_transforms(error: BaseException) -> Refusal | None:
    """What ``f`` did that torch refuses inside ``torch.func`` transforms, if ``error`` says so.

    An old-style ``autograd.Function`` (``forward(ctx, ...)``) or a ``requires_grad_()`` call
    runs under plain autograd only; under ``vmap``, ``grad``, ``vjp`` or ``jvp`` torch raises.

    Example:
        >>> refused_under_transforms(RuntimeError("In order to use an autograd.Function with "
        ...     "functorch transforms (vmap, grad, jvp, jacrev, ...), it must override the "
        ...     "setup_context staticmethod.")).what
        'an autograd.Function without a setup_context staticmethod (forward(ctx, ...))'
    """
    if not isinstance(error, RuntimeError):
        return None
    message = str(error)
    if _TORCHSCRIPT in message and _NO_BATCHING_RULE in message:
        return _SCRIPTED_BACKWARD
    return next((refusal for key, refusal in _TRANSFORM_REFUSALS.items() if key in message),
                None)


# TorchScript's profiling executor differentiates a scripted function that has run a few times
# as one graph, whose backward calls aten::detach: vmap has no batching rule for it, so a
# batched backward through it fails (session 27: a scripted bias-GELU, raw from structured
# without a batch dim, the batched backward of its dense rows).
_TORCHSCRIPT = "TorchScript interpreter"
_SCRIPTED_BACKWARD = Refusal(
    "a TorchScript function (torch.jit.script) whose backward vmap cannot batch", "")


# NOTE [ops without a batching rule]
# torch 2.13's vmap has no batching rule, and no fallback, for some fused ops evaluated without
# autograd: aten::lstm.input, aten::gru.input, aten::lstm_cell ("Batching rule not implemented
# for aten::lstm.input. We could not generate a fallback."). Under a grad level (torch.func.vjp,
# jacrev) the same call decomposes into ops that do batch, so f runs there. Evaluations of f that
# torchgram makes without autograd (the probe, the batch's outputs for the per-sample checks)
# are therefore made again inside a vjp level when vmap refuses them (a compose hunt of session
# 25: tg.gramian under vmap over an ensemble of GRU or LSTM models raised torch's error, where
# the jacobian backend computes the right matrix).
# An evaluation is made again only where nothing outside it saw the first attempt's ops: a
# torch-function mode that records what it sees (the structured backend's TapMode, whose taps
# and activations count the calls) says so with `restartable = False`, and the error then
# propagates to that mode's owner (the structured per-sample pass loops over the samples
# instead of vmapping). Restarting under it left the first attempt's taps in its recording: a
# Gramian of an embedding before `torch.lstm_cell` steps came out with the table's block
# wholly wrong (a thread hunt of session 26, relative error 1.0).
_NO_BATCHING_RULE = "Batching rule not implemented for"


def missing_batching_rule(error: BaseException) -> bool:
    """Whether ``error`` is vmap finding no batching rule, nor a fallback, for an op.

    Example:
        >>> missing_batching_rule(RuntimeError(
        ...     "Batching rule not implemented for aten::lstm.input. We could not generate a "
        ...     "fallback."))
        True
    """
    return isinstance(error, RuntimeError) and _NO_BATCHING_RULE in str(error)


_MISSING_DERIVATIVE = re.compile(r"derivative for \S+ is not implemented")


def missing_derivative(error: BaseException) -> bool:
    """Whether ``error`` is autograd meeting an op without a derivative (a backward's own).

    Example:
        >>> missing_derivative(NotImplementedError(
        ...     "the derivative for '_cdist_backward' is not implemented."))
        True
        >>> missing_derivative(RuntimeError("element 0 of tensors does not require grad"))
        False
    """
    return isinstance(error, RuntimeError) and _MISSING_DERIVATIVE.search(str(error)) is not None


def restartable_evaluation() -> bool:
    """Whether an evaluation of ``f`` may be made again from its start here.

    False inside a torch-function mode that keeps what it saw (``restartable = False``):
    NOTE [ops without a batching rule].

    Example:
        >>> restartable_evaluation()
        True
    """
    return all(getattr(mode, "restartable", True)
               for mode in torch.overrides._get_current_function_mode_stack())


def through_grad_level(evaluate: Callable[[tuple[Tensor, ...]], Any],
                       leaves: tuple[Tensor, ...]) -> Any:
    """``evaluate(leaves)`` made inside a ``torch.func.vjp`` level over ``leaves``.

    The result is the same (the primal values, unwrapped), whatever its pytree holds; ops
    that depend on ``leaves`` dispatch through autograd, where fused ops that ``vmap`` cannot
    batch decompose (NOTE [ops without a batching rule]).

    Example:
        >>> out = through_grad_level(lambda ws: {"y": ws[0] * 2, "tag": "aux"}, (torch.ones(2),))
        >>> out["y"], out["tag"]
        (tensor([2., 2.]), 'aux')
        >>> torch.func.vmap(lambda w: through_grad_level(lambda ws: ws[0].sin(), (w,)))(
        ...     torch.zeros(3, 2)).shape
        torch.Size([3, 2])
    """
    found: dict[str, Any] = {}

    def primal(*values: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        flat, spec = optree.tree_flatten(evaluate(values), none_is_leaf=True)
        found.update(flat=flat, spec=spec,
                     at=[i for i, item in enumerate(flat) if isinstance(item, Tensor)])
        return values[0].new_zeros(()), tuple(flat[i] for i in found["at"])

    _, _, tensors = torch.func.vjp(primal, *leaves, has_aux=True)  # type: ignore[misc]
    flat = list(found["flat"])
    for i, tensor in zip(found["at"], tensors, strict=True):
        flat[i] = tensor
    return optree.tree_unflatten(found["spec"], flat)


_REENTRANT_GRAD = "use_reentrant=True, torch.utils.checkpoint is incompatible with .grad()"


def is_reentrant_grad_error(error: BaseException) -> bool:
    """Whether ``error`` is torch refusing ``autograd.grad`` through a reentrant checkpoint."""
    return isinstance(error, RuntimeError) and _REENTRANT_GRAD in str(error)


# NOTE [in-place modifications]
# torch's autograd refuses a backward through a tensor it saved that was modified in place
# afterwards ("one of the variables needed for gradient computation has been modified by an
# inplace operation"): F.relu(h, inplace=True) or h.mul_(2) after a layer read h. The
# backends that run torch's backward meet that error; the structured backend keeps the
# activations of its taps itself (detached views, NOTE [taps]), where nothing would notice: it
# computed the Gramian of the modified activations, a wrong matrix (session 26, 0.15 and 1.3
# off relative). So its tapping mode compares each kept activation's version counter at the
# end of the evaluation with the one it had at the use (through functorch wrappers, whose own
# counters do not move under vmap), and every backend turns either refusal into the same
# torchgram ValueError (errors.torch_refusals).
_MODIFIED_IN_PLACE = "modified by an inplace operation"


def is_in_place_error(error: BaseException) -> bool:
    """Whether ``error`` is autograd's refusal of a saved tensor modified in place.

    Example:
        >>> is_in_place_error(RuntimeError("one of the variables needed for gradient "
        ...     "computation has been modified by an inplace operation: [torch.FloatTensor [3]]"))
        True
    """
    return isinstance(error, RuntimeError) and _MODIFIED_IN_PLACE in str(error)


def version_of(tensor: Tensor) -> tuple[Tensor, int] | None:
    """``(storage owner, its version)`` to compare later, or ``None`` where none is kept.

    Unwraps functorch wrappers (their counters stay still under ``vmap``: NOTE [in-place
    modifications]); inference tensors keep no counter.

    Example:
        >>> h = torch.ones(2)
        >>> owner, version = version_of(h)
        >>> _ = h.mul_(2)
        >>> owner._version > version
        True
    """
    tensor = innermost(tensor)
    if tensor.is_inference():
        return None
    return tensor, version(tensor)


def innermost(tensor: Tensor) -> Tensor:
    """``tensor`` without its functorch wrappers (under ``vmap``: every batch entry, as stored).

    Example:
        >>> seen = []
        >>> _ = torch.func.vmap(lambda row: seen.append(innermost(row).shape) or row)(
        ...     torch.ones(2, 3))
        >>> seen
        [torch.Size([2, 3])]
        >>> x = torch.ones(3)
        >>> innermost(x) is x
        True
    """
    while torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        tensor = torch._C._functorch.get_unwrapped(tensor)
    return tensor


def is_batched(tensor: Tensor) -> bool:
    """Whether ``tensor`` is batched by ``torch.func.vmap`` at any of its functorch levels.

    Example:
        >>> seen = []
        >>> _ = torch.func.vmap(lambda row: seen.append(is_batched(row)) or row)(torch.ones(2, 3))
        >>> seen, is_batched(torch.ones(3))
        ([True], False)
    """
    while torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        if torch._C._functorch.is_batchedtensor(tensor):
            return True
        tensor = torch._C._functorch.get_unwrapped(tensor)
    return False


def is_freed_graph_error(error: BaseException) -> bool:
    """Whether ``error`` says the graph's saved tensors were freed by an earlier backward."""
    return isinstance(error, RuntimeError) and _FREED in str(error)


_SELECTIVE_CHECKPOINT = "region computed under selective activation checkpoint"
_DONATED_BUFFERS = "compiled with non-empty donated buffers"


def is_donated_buffers_error(error: BaseException) -> bool:
    """Whether ``error`` is torch refusing to run a compiled backward with donated buffers again.

    A ``torch.compile``'d region (aot backends) whose compiled backward frees its saved
    buffers runs once, without ``retain_graph``.
    """
    return isinstance(error, RuntimeError) and _DONATED_BUFFERS in str(error)


def is_selective_checkpoint_error(error: BaseException) -> bool:
    """Whether ``error`` is torch refusing a second backward through a selective checkpoint.

    A region of selective activation checkpointing
    (``context_fn=create_selective_checkpoint_contexts``) hands its saved tensors out to one
    backward pass only.
    """
    return isinstance(error, RuntimeError) and _SELECTIVE_CHECKPOINT in str(error)


# -- batching rules torch gets wrong --------------------------------------------------------

# NOTE [wrong batching rules]
# torch 2.13's batching rule for the backward of torch.cdist returns wrong values: for
# h [4, 8], torch.func.jacrev(lambda h: torch.cdist(h, a).sum(-1))(h) differs from plain
# autograd (and from finite differences) by O(1), while jacrev(..., chunk_size=1), which
# does not vmap the backward, is right. Every vmap over a backward through such a call would
# give a wrong Gramian without a word, so backends compute those rows' vjps one at a time
# (and the graph walk calls those nodes row by row). tests/core/test_torch_compat.py checks
# that the bug is still there: when a torch release fixes it, that test fails, and the entry
# can go.
# torch.linalg.lu_solve likewise (session 45's hunt of ops under vmap): the per-sample Gramian
# of a network solving with each sample's LU factors was 1.7e6 off (relative) on jacobian
# with batch_dim=0, and 4.5e5 under the caller's vmap on every composing backend.
# torch.select_scatter with a batched src into an unbatched tensor records, under vmap, a
# backward that gives src wrong gradients (O(1), session 60's hunt: a weight built with
# select_scatter from a parameter, or an activation scattered into zeros, 3-15x off on the
# structured per-sample vmap and the kernels); slice_scatter, diagonal_scatter and index_put
# are right. The loops it calls for avoid the vmapped forward as well.
_WRONG_BATCHED_BACKWARD = {torch.cdist: "torch.cdist",
                           torch.linalg.lu_solve: "torch.linalg.lu_solve",
                           torch.lu_solve: "torch.lu_solve",
                           torch.select_scatter: "torch.select_scatter",
                           torch.Tensor.select_scatter: "Tensor.select_scatter"}
WRONG_BATCHED_NODES = frozenset({"CdistBackward0", "EuclideanDistBackward0",
                                 "LinalgLuSolveBackward0"})
"""Autograd node names whose backward ``vmap`` gets wrong (NOTE [wrong batching rules])."""


def wrong_batched_backward(func: Any) -> str | None:
    """The name of ``func`` if ``vmap`` over its backward is wrong (NOTE above), else ``None``."""
    try:
        return _WRONG_BATCHED_BACKWARD.get(func)
    except TypeError:  # unhashable callables
        return None


_SELF_DIFFERENTIATION = {
    torch.autograd.grad: "torch.autograd.grad",
    torch.autograd.backward: "torch.autograd.backward",
    torch.Tensor.backward: "Tensor.backward",
    torch._make_dual: "forward-mode AD (torch.func.jvp, jacfwd, forward_ad.make_dual)",
}
"""The calls by which ``f`` differentiates its own computation (``torch.func.grad``, ``vjp``,
``jacrev`` and ``torch.autograd.functional`` go through ``torch.autograd.grad``): NOTE [f
that differentiates itself] in ``census.py``."""


# NOTE [saved-tensor hooks that rewrite]
# ``torch.autograd.graph.saved_tensors_hooks`` can change what the backward reads (activation
# compression to bf16 or int8, a scale): the graph's derivatives are then not those of the
# values the forward computed. ``tg.autograd.record()`` taps activations as computed, so a
# layer recorded under such hooks mixed the true activations with the graph's cotangents:
# ``G`` and ``.grad`` matched neither torch's backward nor the true Jacobian (0.73 off with a
# ×2 pack, 1e-3 with int8 compression; session 58's hunt). Such layers are left to the graph
# walk, which reads what torch's backward reads. torch applies only the innermost pair of
# hooks; torch's own that keep values (``save_on_cpu``, non-reentrant checkpointing) are known.
# A checkpoint's region saves its inputs through the pair below its own (the review of
# session 58: a checkpoint inside a compression hook recomputed from compressed inputs, G
# 0.64 off), so below a checkpoint's pair the next one counts too.
_VALUE_KEEPING_SAVED_HOOKS = ("torch.autograd.graph.save_on_cpu.",)
_CHECKPOINT_SAVED_HOOKS = (
    "torch.utils.checkpoint._checkpoint_hook.",
    "torch.utils.checkpoint._recomputation_hook.",
)


def _pack_hook_name(pack: Any) -> str:
    """A saved-tensor pack hook's module and qualified name (matched against the lists above)."""
    return f"{getattr(pack, '__module__', None) or '?'}." \
           f"{getattr(pack, '__qualname__', type(pack).__name__)}"


def in_checkpoint_forward() -> bool:
    """Whether the innermost saved-tensor hooks are a non-reentrant checkpoint's forward.

    Not its recomputation in the backward (the second of :data:`_CHECKPOINT_SAVED_HOOKS`).

    Example:
        >>> import torch.utils.checkpoint
        >>> torch.utils.checkpoint.checkpoint(lambda x: torch.tensor(in_checkpoint_forward()),
        ...                                   torch.ones(1), use_reentrant=False).item()
        True
        >>> in_checkpoint_forward()
        False
    """
    hooks = saved_tensor_hooks()
    return hooks is not None and _pack_hook_name(hooks[0]).startswith(_CHECKPOINT_SAVED_HOOKS[0])


def rewriting_saved_tensor_hooks() -> str | None:
    """The active saved-tensor pack hook's name, unless none or one of torch's that keep values.

    NOTE [saved-tensor hooks that rewrite].

    Example:
        >>> rewriting_saved_tensor_hooks() is None
        True
        >>> with torch.autograd.graph.saved_tensors_hooks(lambda t: t * 2, lambda t: t):
        ...     rewriting_saved_tensor_hooks()
        '..._torch_compat.<lambda>'
        >>> with torch.autograd.graph.save_on_cpu():
        ...     rewriting_saved_tensor_hooks() is None
        True
    """
    autograd = torch._C._autograd
    top = getattr(autograd, "_top_saved_tensors_default_hooks", None)
    pop = getattr(autograd, "_pop_saved_tensors_default_hooks", None)
    push = getattr(autograd, "_push_saved_tensors_default_hooks", None)
    if top is None or pop is None or push is None:
        return None
    below: list[tuple[Any, Any]] = []  # checkpoints' pairs, taken off to read the next one
    try:
        while True:
            hooks = top(False)
            if hooks is None:
                return None
            name = _pack_hook_name(hooks[0])
            if name.startswith(_VALUE_KEEPING_SAVED_HOOKS):
                return None
            if not name.startswith(_CHECKPOINT_SAVED_HOOKS):
                return name
            below.append(hooks)
            pop()
    finally:
        for hooks in reversed(below):
            push(*hooks)


def self_differentiation(func: Any) -> str | None:
    """How ``func`` differentiates (a name), if it is one of :data:`_SELF_DIFFERENTIATION`.

    Example:
        >>> self_differentiation(torch.autograd.grad), self_differentiation(torch.tanh)
        ('torch.autograd.grad', None)
    """
    try:
        return _SELF_DIFFERENTIATION.get(func)
    except TypeError:  # unhashable callables
        return None


# -- TorchFunctionMode -----------------------------------------------------------------------

_TRANSPOSE_GETTERS = (torch.Tensor.T, torch.Tensor.mT)


def is_transpose_getter(func: Any) -> bool:
    """Whether a ``TorchFunctionMode`` call is the ``Tensor.T`` or ``Tensor.mT`` getter."""
    owner = getattr(func, "__self__", None)
    return any(owner is getter for getter in _TRANSPOSE_GETTERS)


def getter_name(func: Any) -> str | None:
    """``"Tensor.<name>"`` when a mode's call is a property getter, else ``None``."""
    owner = getattr(func, "__self__", None)
    if owner is not None and type(owner).__name__ == "getset_descriptor":
        return f"Tensor.{owner.__name__}"
    return None


# -- functorch -------------------------------------------------------------------------------

_TRANSFORM_NAMES = {"Grad": "grad", "Jvp": "jvp", "Vmap": "vmap", "Functionalize": "functionalize"}


def functorch_transforms() -> tuple[str, ...]:
    """The ``torch.func`` transforms the caller runs under, outermost first (``()``: none).

    ``"grad"`` covers ``grad``, ``vjp``, ``jacrev`` and ``hessian``'s reverse levels, ``"jvp"``
    ``jvp`` and ``jacfwd``, ``"vmap"`` ``vmap``.

    Example:
        >>> functorch_transforms()
        ()
        >>> torch.func.vmap(lambda x: (print(functorch_transforms()), x)[1])(torch.ones(2))
        ('vmap',)
        tensor([1., 1.])
    """
    stack = torch._C._functorch.get_interpreter_stack()
    if not stack:
        return ()
    return tuple(_TRANSFORM_NAMES.get(interpreter.key().name, interpreter.key().name.lower())
                 for interpreter in stack)


# -- torch.distributed -----------------------------------------------------------------------

COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})
"""Namespaces of the ops that ``torch.distributed`` collectives dispatch (seen by a
``TorchDispatchMode`` before the collective starts)."""


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor (without importing DTensor when nothing made one)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def fsdp_original_class(module: torch.nn.Module) -> type | None:
    """The class FSDP2's ``fully_shard`` replaced, or ``None`` for a module it did not shard."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None or not isinstance(module, fsdp.FSDPModule):
        return None
    cls = type(module)
    original = cls.__mro__[getattr(cls, "_orig_cls_mro_index", 2)]
    assert isinstance(original, type)
    return original


def fsdp_forward_hook_ids(module: torch.nn.Module) -> set[int]:
    """The ids (keys of ``module._forward_pre_hooks`` / ``_forward_hooks``) of FSDP2's hooks."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    ids: set[int] = set()
    for handle in (state._pre_forward_hook_handle, state._post_forward_hook_handle):
        for one in getattr(handle, "handles", (handle,)):
            if one is not None and hasattr(one, "id"):
                ids.add(one.id)
    return ids


@dataclass(frozen=True)
class FsdpParam:
    """One parameter FSDP2 manages: where it is registered, its shard and its whole tensor.

    Attributes:
        module: The module it is registered on.
        name: Its name there.
        sharded: The sharded DTensor parameter (what ``module.parameters()`` gives between
            iterations).
        unsharded: The whole parameter FSDP2 all-gathers for forward and backward (the leaf
            of the autograd graph), or ``None`` before the first all-gather.
    """

    module: torch.nn.Module
    name: str
    sharded: Tensor
    unsharded: Tensor | None


def fsdp_params(root: torch.nn.Module) -> Iterator[FsdpParam]:
    """Every parameter FSDP2 manages under ``root`` (nothing when ``root`` is not FSDP2)."""
    for module in root.modules():
        if fsdp_original_class(module) is None:
            continue
        state = module._get_fsdp_state()  # type: ignore[operator]
        for group in state._fsdp_param_groups:
            for param in group.fsdp_params:
                info = param._module_info
                yield FsdpParam(info.module, info.param_name, param.sharded_param,
                                getattr(param, "_unsharded_param", None))


def passes_cotangents_through(node: Node) -> bool:
    """Whether a custom Function node only returns its cotangents, around a side effect.

    FSDP2's ``RegisterPostBackwardFunction`` sits on a sharded module's inputs; its
    ``backward`` returns its cotangents unchanged and runs FSDP's post-backward (gradient
    reduce-scatter, resharding), which a graph walk must not trigger. DDP's ``_DDPSink`` sits
    on its outputs; with ``static_graph=True`` its ``backward`` queues the reducer's delayed
    all-reduce on the engine, which torch refuses outside a backward pass (torch's raw "Final
    callbacks can only be installed during backward pass" from the walk; a helper's hunt,
    session 57).
    """
    cls = custom_function_class(node)
    return cls is not None and (
        (cls.__name__ == "RegisterPostBackwardFunction"
         and cls.__module__.startswith("torch.distributed.fsdp"))
        or (cls.__name__ == "_DDPSink" and cls.__module__ == "torch.nn.parallel.distributed"))
