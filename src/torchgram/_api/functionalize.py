"""``torchgram.functionalize``: an ``nn.Module`` as a pure function of its parameters."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import Tensor, nn

from torchgram._core import _torch_compat
from torchgram._core.hooked_modules import hooked_snapshot, put_back_tensors
from torchgram._core.threads import MODULE_LOCK

_API = "torchgram.functionalize"


def functionalize(module: nn.Module) -> tuple[Callable[..., Any], dict[str, Tensor]]:
    """Split a module into a pure function and its trainable parameters.

    Args:
        module: Any ``nn.Module``.

    Returns:
        ``(fn, params)``. ``params`` maps each trainable parameter's name (as in
        ``module.named_parameters()``; a parameter tied under several names appears once)
        to a **detached** tensor sharing storage with the module's parameter.
        ``fn(params, *args, **kwargs)`` runs ``module(*args, **kwargs)`` as
        ``torch.func.functional_call`` does, with the given tensors in place of those
        parameters (NOTE [parameter slots]);
        frozen parameters (``requires_grad=False``) and buffers are the module's current
        ones. ``fn`` is pure: buffers the forward updates in place (e.g. BatchNorm running
        statistics) are updated on copies, so the module is never changed by a call. A
        subset of ``params`` may be passed; missing names use the module's own tensors.
        ``fn`` may be called from several threads: while it runs, the module's attributes
        are the call's tensors, so calls of functionalized modules run their forward
        passes one at a time (NOTE [threads]); do not use the module itself from another
        thread meanwhile. A module that checkpoints (``torch.utils.checkpoint`` with
        ``use_reentrant=False``, ``transformers``' ``gradient_checkpointing_enable``)
        recomputes its regions during the backward, after ``fn`` has put the module's own
        parameters back: the recomputation reads those, not ``params`` (as
        ``torch.func.functional_call``'s does), so derivatives through such a region are
        those of the module's parameters (session 58's hunt). Disable checkpointing for
        ``fn``, or pass the module's own parameters (``params`` as returned, updated in
        place); a module with ``transformers``' ``gradient_checkpointing`` on refuses other
        tensors (``ValueError``), one calling ``torch.utils.checkpoint`` itself cannot be
        seen.

    Distributed modules: a ``DistributedDataParallel`` wrapper is unwrapped (names are those
    of ``ddp.module``, and ``fn`` never triggers DDP's gradient synchronisation). An FSDP2
    module (``fully_shard``) is data parallel for the Gramian: ``params`` are its **whole**
    parameters, all-gathered once here (a collective: every rank of its mesh calls
    ``functionalize`` together), and ``fn`` runs a plain replica of the module, without
    FSDP2's hooks, that shares its buffers (NOTE [FSDP2 replica]). Tensor-parallel DTensor
    parameters stay DTensors (``torchgram.distributed`` takes them as they are).

    Raises:
        TypeError: If ``module`` is not an ``nn.Module`` or is a TorchScript module (at build
            time), or ``params`` is not a mapping (at call time).
        KeyError: If ``params`` names a parameter the module does not have.
        ValueError: If ``params`` gives a tied parameter two values under two of its names.

    Example:
        >>> import torch, torchgram as tg
        >>> model = torch.nn.Linear(3, 2)
        >>> fn, params = tg.functionalize(model)
        >>> sorted(params)
        ['bias', 'weight']
        >>> x = torch.randn(4, 3)
        >>> torch.allclose(fn(params, x), model(x))
        True
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"{_API}: expected an nn.Module, but got {type(module).__name__}. "
                        "For a plain function, pass it to tg.gramian directly.")
    module = _plain(module)
    scripted = next((name for name, sub in module.named_modules()
                     if isinstance(sub, torch.jit.ScriptModule)), None)
    if scripted is not None:
        # torch's stateless API refuses them: fn raised a raw RuntimeError on every call (a
        # scripted submodule, a raw TypeError here)
        where = "a TorchScript module" if scripted == "" else \
            f"a module with a TorchScript submodule ({scripted!r})"
        raise TypeError(
            f"{_API}: expected an nn.Module whose forward runs in Python, but got {where} "
            "(from torch.jit.script or torch.jit.trace), which cannot run with other tensors "
            "in place of its parameters (torch's torch.func.functional_call refuses it). "
            "Functionalize the modules before scripting them, or take the Gramian of the "
            "outputs eagerly: tg.autograd.gramian(module(x), list(module.parameters())).")
    lazy = next((name for name, p in [*module.named_parameters(), *module.named_buffers()]
                 if torch.nn.parameter.is_lazy(p)), None)  # NOTE [lazy modules]
    if lazy is not None:  # detach() raised torch's own ValueError
        raise ValueError(
            f"{_API}: expected initialized parameters, but got the uninitialized parameter "
            f"{lazy!r} of a lazy module (nn.LazyLinear, nn.LazyConv2d, ...). Run the module "
            "once on a batch (module(x)) to initialize it, then functionalize it.")
    params = {name: p.detach() for name, p in module.named_parameters() if p.requires_grad}
    slots = _Slots(module)

    def fn(params: dict[str, Tensor], /, *args: Any, **kwargs: Any) -> Any:
        if not hasattr(params, "keys"):
            raise TypeError(f"{_API}: fn expected a dict of parameters as its first argument, "
                            f"but got {type(params).__name__}. Call fn(params, *inputs).")
        with MODULE_LOCK:  # the call swaps the module's attributes: NOTE [threads]
            return slots.call(params, args, kwargs)

    fn.__doc__ = f"Pure function of {type(module).__name__}: fn(params, *args, **kwargs)."
    fn.__name__ = f"functional_{type(module).__name__}"
    return fn, params


# NOTE [parameter slots]
# torch.func.functional_call finds every parameter and buffer of the module by name on each
# call (named_modules walks, tied-name maps, get_submodule per name): 0.4 ms for BERT's 41
# parameters, and 1.2-1.4 ms a call of BERT or ResNet-18 in all, where each Gramian evaluates
# f at least twice (the batch and its check). functionalize instead finds, once, the
# dictionaries that hold each parameter (under every name a tied parameter or a shared
# submodule gives it) and each buffer; a call writes the given tensors, and copies of the
# current buffers, into them and puts the originals back afterwards, which is what
# functional_call(tie_weights=True, strict=False) does to the module. A module changed since
# (a parameter replaced or added, a submodule swapped, a buffer added) is looked at afresh
# first. It also mends a functional_call bug: given a parameter of a submodule reached by two
# paths under one of its names, torch 2.13 restores it from the value it wrote, and the module
# keeps the call's tensor.


Slot = tuple[dict[str, Any], str]


def _check_names(params: Any, known: Collection[str], module: nn.Module) -> None:
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise KeyError(f"{_API}: fn got parameter name(s) {unknown} that "
                       f"{type(module).__name__} does not have. Valid names: "
                       f"{sorted(known)}.")


class _Slots:
    """Where each parameter and buffer of a module is held (NOTE [parameter slots])."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.where: dict[str, list[Slot]] = {}
        """Every parameter name, and all the places its tensor is held."""
        self.buffers: list[Slot] = []
        self.renormalised: list[Slot] = []
        """The tables of embeddings with ``max_norm`` (NOTE [frozen renormalised tables])."""
        self.held: list[tuple[dict[str, Any], tuple[Any, ...]]] = []
        """Each submodule's children and parameters, and the objects they were."""
        self.named: list[tuple[dict[str, Any], tuple[str, ...]]] = []
        """Each submodule's buffers and their names (a call reads their values afresh)."""
        self.modules: list[nn.Module] = []
        """Every submodule (NOTE [tensors hooks set])."""
        self._scan()

    def _scan(self) -> None:
        self.held, self.named, self.where, self.buffers = [], [], {}, []
        self.modules = list(self.module.modules())
        self.renormalised = [
            (owner._parameters, "weight") for owner in self.modules
            if isinstance(owner, (nn.Embedding, nn.EmbeddingBag))
            and owner.max_norm is not None and owner._parameters.get("weight") is not None]
        for owner in self.modules:
            self.held += [(owner._modules, tuple(owner._modules.values())),
                          (owner._parameters, tuple(owner._parameters.values()))]
            self.named.append((owner._buffers, tuple(owner._buffers)))
        by_tensor: dict[int, list[Slot]] = {}
        seen: set[tuple[int, str]] = set()  # a submodule reached by two paths: once
        for prefix, owner in self.module.named_modules(remove_duplicate=False):
            for attr, param in owner._parameters.items():
                if param is None:
                    continue
                slots = by_tensor.setdefault(id(param), [])
                self.where[f"{prefix}.{attr}" if prefix else attr] = slots
                if (id(owner._parameters), attr) not in seen:
                    seen.add((id(owner._parameters), attr))
                    slots.append((owner._parameters, attr))
            for attr, buffer in owner._buffers.items():
                if buffer is not None and (id(owner._buffers), attr) not in seen:
                    seen.add((id(owner._buffers), attr))
                    self.buffers.append((owner._buffers, attr))

    def _unchanged(self) -> bool:
        """Whether every submodule holds the children, parameters and buffers it held."""
        for holder, objects in self.held:
            if len(holder) != len(objects) or any(
                    value is not obj for value, obj in zip(holder.values(), objects,
                                                           strict=True)):
                return False
        return all(tuple(holder) == names for holder, names in self.named)

    # NOTE [checkpointing modules]
    # A checkpointed region (torch.utils.checkpoint with use_reentrant=False) keeps the graph
    # of fn's call but recomputes its saved values during the backward, after fn has put
    # the module's own parameters back: with other params (the README's out-of-place update)
    # the recomputed values are the module's, and every backend's G was 9e-2 off without a
    # word (torch.func.functional_call does the same; session 58's hunt). Modules that say
    # they checkpoint (transformers' gradient_checkpointing flag) are refused then; a module
    # calling torch.utils.checkpoint on its own cannot be seen (the docstring says so).

    def _checkpointing(self) -> bool:
        """Whether a submodule says it checkpoints (``gradient_checkpointing`` is True)."""
        return any(getattr(owner, "gradient_checkpointing", False) is True
                   for owner in self.modules)

    def _other_storage(self, params: Any) -> bool:
        """Whether a passed parameter is not (a view of) the module's own tensor."""
        for name, value in params.items():
            holder, attr = self.where[name][0]
            try:  # through a transform's wrappers (vmap over inputs leaves params unbatched)
                if _torch_compat.innermost(value).untyped_storage().data_ptr() != \
                        holder[attr].untyped_storage().data_ptr():
                    return True
            except (RuntimeError, NotImplementedError):  # batched: not the module's own
                return True
        return False

    def call(self, params: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``module(*args, **kwargs)`` with ``params`` and copies of the current buffers."""
        if not self._unchanged():
            self._scan()
        _check_names(params, self.where, self.module)
        given: dict[int, tuple[str, Any]] = {}
        for name, value in params.items():
            first = given.setdefault(id(self.where[name]), (name, value))
            if first[1] is not value:
                raise ValueError(
                    f"{_API}: fn expected one value per parameter, but got two for the tied "
                    f"names {first[0]!r} and {name!r} (one tensor in the module). Pass one "
                    "of them.")
        saved: list[tuple[dict[str, Any], str, Any]] = []
        copies: dict[int, Tensor] = {}  # a tensor held in several places: one copy

        def hold_copy(holder: dict[str, Any], attr: str,
                      copy_of: Callable[[Tensor], Tensor]) -> None:
            original = holder[attr]
            copy = copies.get(id(original))
            if copy is None:
                copy = copies[id(original)] = copy_of(original)
            saved.append((holder, attr, original))
            holder[attr] = copy

        if torch.is_grad_enabled() and self._checkpointing() and self._other_storage(params):
            raise ValueError(  # NOTE [checkpointing modules]
                f"{_API}: fn expected the module's own parameters while it checkpoints "
                "(gradient_checkpointing is on), but got other tensors: the checkpointed "
                "regions are recomputed during the backward, after fn has put the module's "
                "parameters back, so their derivatives would be those of the module's "
                "parameters. Call model.gradient_checkpointing_disable(), or update the "
                "module's parameters in place and pass them as functionalize returned them.")
        hooked = hooked_snapshot(self.modules)
        try:
            for name, value in params.items():
                for holder, attr in self.where[name]:
                    saved.append((holder, attr, holder[attr]))
                    holder[attr] = value
            for holder, attr in self.renormalised:  # NOTE [frozen renormalised tables]
                if not any(holder[attr] is value for value in params.values()):
                    hold_copy(holder, attr, lambda table: table.detach().clone())
            for holder, attr in self.buffers:
                hold_copy(holder, attr, Tensor.clone)
            return self.module(*args, **kwargs)
        finally:
            for holder, attr, original in reversed(saved):
                holder[attr] = original
            for attributes, before in hooked:  # NOTE [tensors hooks set]
                put_back_tensors(attributes, before)


# NOTE [tensors hooks set] is in _core/hooked_modules.py.


# NOTE [frozen renormalised tables]
# An embedding with max_norm renormalises the rows it reads in its own table, in place. A
# differentiated table is the call's (the probe sees the write and every call works on copies:
# NOTE [probing]); a frozen one (requires_grad=False: not among fn's params) is the module's,
# and each evaluation renormalised the caller's table (session 49's review). A call now gives
# such a module a copy of its table, as it does for buffers: the rows are renormalised as a
# plain call renormalises them, in the copy.

# NOTE [FSDP2 replica]
# fully_shard swaps a module's class for an FSDP subclass, registers forward hooks that
# all-gather its parameters into FSDP's own unsharded tensors (ignoring whatever
# functional_call put in their place) and leaves DTensor shards registered between
# iterations. For a function of the parameters, functionalize builds a replica instead:
# every module of the tree re-created with its original class and the same attributes
# (buffers and submodule state shared), FSDP's forward hooks left out, and each sharded
# parameter replaced by its whole tensor (DTensor.full_tensor(), one all-gather each).

def _plain(module: nn.Module) -> nn.Module:
    """``module`` without DDP's wrapper, and an FSDP2 tree as a plain replica."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        module = module.module
    if not any(_torch_compat.fsdp_original_class(m) is not None for m in module.modules()):
        return module
    return _replica(module, {})


def _replica(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    original = _torch_compat.fsdp_original_class(module)
    cls = type(module) if original is None else original
    replica: nn.Module = object.__new__(cls)
    replica.__dict__.update(module.__dict__)
    if original is not None:
        hooks = _torch_compat.fsdp_forward_hook_ids(module)
        replica._forward_pre_hooks = type(module._forward_pre_hooks)(
            (key, hook) for key, hook in module._forward_pre_hooks.items() if key not in hooks)
        replica._forward_hooks = type(module._forward_hooks)(
            (key, hook) for key, hook in module._forward_hooks.items() if key not in hooks)
    replica._parameters = {name: _whole(p, memo) for name, p in module._parameters.items()}
    replica._modules = {name: None if child is None else _replica(child, memo)
                        for name, child in module._modules.items()}
    return replica


def _whole(param: nn.Parameter | None, memo: dict[int, Any]) -> nn.Parameter | None:
    """A DTensor parameter's whole tensor (once per parameter: tied weights stay tied)."""
    if param is None or not _torch_compat.is_dtensor(param):
        return param
    if id(param) not in memo:
        whole = param.full_tensor()  # type: ignore[attr-defined]
        memo[id(param)] = nn.Parameter(whole.detach(), requires_grad=param.requires_grad)
    whole_param: nn.Parameter = memo[id(param)]
    return whole_param
