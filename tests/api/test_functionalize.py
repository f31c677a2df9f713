"""``torchgram.functionalize``: a module as a pure function of its trainable parameters."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import torchgram as tg


def test_params_are_trainable_detached_and_share_storage() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    model[1].requires_grad_(False)
    fn, params = tg.functionalize(model)
    assert sorted(params) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    for name, value in params.items():
        original = model.get_parameter(name)
        assert not value.requires_grad and value.data_ptr() == original.data_ptr()
    x = torch.randn(5, 3)
    torch.testing.assert_close(fn(params, x), model(x))


def test_new_values_replace_parameters_and_missing_names_use_the_module() -> None:
    model = nn.Linear(3, 2)
    fn, params = tg.functionalize(model)
    x = torch.randn(4, 3)
    zeroed = {"weight": torch.zeros_like(params["weight"])}
    torch.testing.assert_close(fn(zeroed, x), model.bias.detach().expand(4, 2))


def test_tied_weights_appear_once_and_stay_tied() -> None:
    emb = nn.Embedding(5, 3)
    head = nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    fn, params = tg.functionalize(model)
    assert list(params) == ["0.weight"]
    tokens = torch.tensor([[1, 2]])
    new = {"0.weight": torch.randn(5, 3)}
    expected = new["0.weight"][tokens] @ new["0.weight"].T
    torch.testing.assert_close(fn(new, tokens), expected)


def test_buffers_are_current_and_never_updated() -> None:
    model = nn.BatchNorm1d(3)
    fn, params = tg.functionalize(model)
    model.running_mean.fill_(2.0)  # current buffers are used, not a snapshot
    model.eval()
    x = torch.randn(4, 3)
    torch.testing.assert_close(fn(params, x), model(x))
    model.train()
    fn(params, x)  # a training forward updates statistics on copies only
    torch.testing.assert_close(model.running_mean, torch.full((3,), 2.0))
    assert model.num_batches_tracked == 0


def test_kwargs_reach_the_module() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x, *, scale=1.0):
            return self.lin(x) * scale

    model = Scaled()
    fn, params = tg.functionalize(model)
    x = torch.randn(3, 2)
    torch.testing.assert_close(fn(params, x, scale=3.0), model(x) * 3.0)


def test_not_a_module_is_rejected() -> None:
    with pytest.raises(TypeError, match="torchgram.functionalize: expected an nn.Module, but "
                                        "got function"):
        tg.functionalize(lambda x: x)


@pytest.mark.parametrize("how", ["script", "trace"])
def test_a_torchscript_module_is_rejected_at_build_time(how: str) -> None:
    """torch's stateless API refuses TorchScript modules: every call of fn raised a raw
    RuntimeError (session 27). The error names the eager API, which takes them."""
    model = nn.Sequential(nn.Linear(3, 2), nn.Tanh())
    x = torch.randn(4, 3)
    with warnings.catch_warnings():  # torch >= 2.11: torch.jit is deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(model) if how == "script" else torch.jit.trace(model, x)
    with pytest.raises(TypeError, match="torchgram.functionalize: expected an nn.Module whose "
                       "forward runs in Python, but got a TorchScript module.*tg.autograd"):
        tg.functionalize(scripted)
    with pytest.raises(TypeError, match="but got a module with a TorchScript submodule "
                       "\\('1'\\).*tg.autograd"):  # a raw pybind TypeError before
        tg.functionalize(nn.Sequential(nn.Linear(3, 3), scripted))


def test_an_uninitialized_lazy_module_is_rejected_at_build_time() -> None:
    model = nn.Sequential(nn.LazyLinear(2), nn.Tanh())
    with pytest.raises(ValueError, match="torchgram.functionalize: expected initialized "
                       "parameters, but got the uninitialized parameter '0.weight'.*module\\(x\\)"):
        tg.functionalize(model)
    model(torch.randn(4, 3))  # initialized: fine
    assert sorted(tg.functionalize(model)[1]) == ["0.bias", "0.weight"]


def test_unknown_parameter_name_and_non_mapping_are_rejected() -> None:
    fn, params = tg.functionalize(nn.Linear(2, 2))
    with pytest.raises(KeyError, match=r"parameter name\(s\) \['wieght'\].*Valid names"):
        fn({"wieght": torch.zeros(2, 2)}, torch.randn(1, 2))
    with pytest.raises(TypeError, match="expected a dict of parameters.*got Tensor"):
        fn(torch.zeros(2), torch.randn(1, 2))


def _functional_call(model: nn.Module, params: dict[str, torch.Tensor],
                     *args: torch.Tensor) -> torch.Tensor:
    """The reference: ``torch.func.functional_call`` as ``fn`` documents it."""
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    return torch.func.functional_call(model, {**buffers, **params}, args, tie_weights=True,
                                      strict=False)


def _state(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False)]


def test_tied_alias_and_shared_submodule_are_written_everywhere() -> None:
    """NOTE [parameter slots]: a tied parameter given under its other name, and a submodule
    reached by two paths, are replaced everywhere, and put back everywhere (torch 2.13's
    functional_call leaves the shared submodule's bias changed here)."""
    shared = nn.Linear(3, 3)
    emb = nn.Embedding(5, 3)
    head = nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, shared, nn.Tanh(), shared, head)
    fn, _ = tg.functionalize(model)
    tokens = torch.tensor([[1, 2, 4]])
    before = [(name, value.clone()) for name, value in _state(model)]
    new = {"4.weight": torch.randn(5, 3), "3.bias": torch.randn(3)}
    with torch.no_grad():
        h = new["4.weight"][tokens]
        for _ in range(2):  # shared, tanh, shared
            h = torch.tanh(h) if _ else h
            h = h @ shared.weight.T + new["3.bias"]
        expected = h @ new["4.weight"].T
    torch.testing.assert_close(fn(new, tokens), expected)
    for (name, value), (_, old) in zip(_state(model), before, strict=True):
        assert torch.equal(value, old), name


def test_a_module_changed_after_functionalize_is_still_used_as_it_is() -> None:
    """A parameter replaced, a submodule swapped or a buffer added since ``functionalize``:
    each call follows the module as it is then (functional_call's way)."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    fn, params = tg.functionalize(model)
    x = torch.randn(4, 3)
    model[2].weight = nn.Parameter(torch.randn(2, 3))  # replaced: fn's params still apply
    torch.testing.assert_close(fn(params, x), _functional_call(model, params, x))
    model[1] = nn.BatchNorm1d(3)  # swapped in, training mode: statistics on copies
    torch.testing.assert_close(fn(params, x), _functional_call(model, params, x))
    assert model[1].num_batches_tracked == 0
    torch.testing.assert_close(model[1].running_mean, torch.zeros(3))
    model[0].register_buffer("offset", torch.zeros(3))
    torch.testing.assert_close(fn(params, x), _functional_call(model, params, x))
    model[1].register_parameter("extra", nn.Parameter(torch.ones(3)))  # a name fn now takes
    torch.testing.assert_close(fn({**params, "1.extra": torch.zeros(3)}, x),
                               _functional_call(model, params, x))


def test_two_values_for_one_tied_parameter_are_an_error() -> None:
    emb = nn.Embedding(5, 3)
    head = nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    fn, _ = tg.functionalize(nn.Sequential(emb, head))
    with pytest.raises(ValueError, match="two for the tied names '0.weight' and '1.weight'"):
        fn({"0.weight": torch.randn(5, 3), "1.weight": torch.randn(5, 3)},
           torch.tensor([[1]]))


@pytest.mark.parametrize("backend", ["auto", "structured", "graph", "jacobian", "ntvp"])
def test_one_tensor_under_two_tied_names_through_functional_call_is_named(backend: str) -> None:
    """``functional_call`` meets each leaf apart: torch's raw "multiple values for keys ...
    Consider using tie_weights=False", whose fix unties the weights (session 67's hunt)."""
    emb = nn.Embedding(5, 3)
    head = nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    table = emb.weight.detach()
    params = {"0.weight": table, "1.weight": table}

    def losses(p: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, (p,), (tokens,)).sum((1, 2))

    with pytest.raises(ValueError, match=r"the tied names \['0.weight', '1.weight'\] among "
                                         r"them\. Keep one of the tied names"):
        tg.gramian(losses, backend=backend, batch_dim=0)(params, torch.tensor([[1, 2], [3, 4]]))


def test_an_error_in_the_forward_leaves_the_module_as_it_was() -> None:
    class Failing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("count", torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.count += 1
            raise RuntimeError("inside the forward")

    model = Failing()
    fn, params = tg.functionalize(model)
    weight, count = model.lin.weight, model.count
    with pytest.raises(RuntimeError, match="inside the forward"):
        fn({"lin.weight": torch.zeros(2, 2)}, torch.randn(1, 2))
    assert model.lin.weight is weight and model.count is count and count == 0


def _parametrized_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    nn.utils.parametrizations.orthogonal(model[0])
    nn.utils.parametrizations.weight_norm(model[2])
    return model


@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "batch_dim0"])
@pytest.mark.parametrize("backend", ["auto", "structured", "graph", "jacobian"])
def test_parametrized_weights_inside_parametrize_cached(backend: str,
                                                        batch_dim: int | None) -> None:
    """NOTE [parametrization caches]: a later evaluation of f read the weight an earlier one
    cached, with no path to its own leaves (0.72 off before session 57)."""
    from reference import dense_gramian

    fn, params = tg.functionalize(_parametrized_model())
    x = torch.randn(5, 4, dtype=torch.float64)

    def f(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return fn(p, x).sin().sum(1)

    wanted = dense_gramian(f, (params, x)).gramian
    with nn.utils.parametrize.cached():
        G = tg.gramian(f, backend=backend, batch_dim=batch_dim)(params, x)
    torch.testing.assert_close(G, wanted, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("norm", ["weight_norm", "spectral_norm"])
def test_a_hook_based_norm_keeps_its_weight_attribute(norm: str) -> None:
    """NOTE [tensors hooks set]: the pre-hook's ``module.weight`` was left a tensor of
    torchgram's transforms ("tensor may have escaped" on its next use, before session 57)."""
    from reference import dense_gramian

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates the hook-based forms
        layer = getattr(nn.utils, norm)(nn.Linear(4, 3).double())
    layer.eval()  # spectral_norm: no power iteration (a plain call would move its u)
    x = torch.randn(5, 4, dtype=torch.float64)
    layer(x)
    before = layer.weight
    fn, params = tg.functionalize(layer)

    def f(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return fn(p, x).sum(1)

    for backend in ["auto", "structured", "jacobian"]:
        G = tg.gramian(f, backend=backend, batch_dim=0)(params, x)
        torch.testing.assert_close(G, dense_gramian(f, (params, x)).gramian, rtol=1e-10,
                                   atol=1e-12)
        assert layer.weight is before
    layer.weight.sum()  # usable: a plain tensor of the caller's


def test_tensors_a_forward_hook_keeps_in_a_container_are_put_back() -> None:
    """NOTE [tensors hooks set], for a hook keeping ``{"out": out}`` or ``(out,)`` (the
    module held escaped vmap tensors after a jacobian Gramian before; a review's find)."""
    torch.manual_seed(0)
    layer = nn.Linear(3, 2).double()
    layer.stats, layer.saved = {"out": None}, ()

    def keep(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        module.stats = {"out": out}
        module.saved = (out,)

    layer.register_forward_hook(keep)
    layer(torch.randn(4, 3, dtype=torch.float64))
    stats, saved = layer.stats, layer.saved
    fn, params = tg.functionalize(layer)
    for backend in ["jacobian", "structured", "graph"]:
        tg.gramian(lambda p, x: fn(p, x).sum(1), backend=backend, batch_dim=0)(
            params, torch.randn(5, 3, dtype=torch.float64))
        assert layer.stats is stats and layer.saved is saved
    layer.stats["out"].sum()  # the caller's tensor, usable


@pytest.mark.parametrize("api", ["gramian", "aggregated_grad", "ntk"])
def test_a_pruned_module_called_through_functional_call_is_put_back(api: str) -> None:
    """NOTE [tensors hooks set] for an ``f`` written with ``torch.func.functional_call``:
    prune's pre-hook left ``module.weight`` a tensor of torchgram's vmap, and the next pruning
    round raised torch's raw "tensor may have escaped" (session 60's hunt)."""
    from torch.func import functional_call
    from torch.nn.utils import prune

    from reference import dense_gramian

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    prune.l1_unstructured(model[0], "weight", amount=0.25)
    x = torch.randn(5, 6, dtype=torch.float64)

    def f(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (x,)).sin().sum(1)

    params = dict(model.named_parameters())
    wanted = dense_gramian(f, (params, x)).gramian
    model(x)  # the oracle's jacrev leaves its own tensor there: a plain call sets it afresh
    before = model[0].weight
    if api == "gramian":
        G = tg.gramian(f, batch_dim=0)(params, x)
        torch.testing.assert_close(G, wanted, rtol=1e-10, atol=1e-12)
    elif api == "aggregated_grad":
        tg.aggregated_grad(f, tg.weighting.upgrad, batch_dim=0)(params, x)
    else:
        tg.ntk.empirical_ntk_fn(lambda p, x: functional_call(model, p, (x,)))(x, None, params)
    assert model[0].weight is before
    prune.l1_unstructured(model[0], "weight", amount=0.25)  # the next round: usable


class _Checkpointed(torch.nn.Module):
    """Checkpoints its first block when ``gradient_checkpointing`` is on (transformers' flag)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh())
        self.head = torch.nn.Linear(6, 2)
        self.gradient_checkpointing = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        return self.head(hidden)


def test_a_checkpointing_module_refuses_other_parameters() -> None:
    """NOTE [checkpointing modules]: its regions are recomputed in the backward with the
    module's own parameters: with updated ones every backend's G was 9e-2 off (session 58)."""
    import torch.utils.checkpoint  # noqa: F401 -- the module uses it

    torch.manual_seed(0)
    model = _Checkpointed().double()
    fn, params = tg.functionalize(model)
    x = torch.randn(5, 4, dtype=torch.float64)

    def rows(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return fn(p, x).sum(1)

    own = tg.gramian(rows, batch_dim=0, backend="graph")(params, x)
    model.gradient_checkpointing = False
    torch.testing.assert_close(own, tg.gramian(rows, batch_dim=0)(params, x))
    model.gradient_checkpointing = True
    updated = {name: value + 0.1 for name, value in params.items()}
    with pytest.raises(ValueError, match="gradient_checkpointing_disable"):
        tg.gramian(rows, batch_dim=0, backend="graph")(updated, x)
    with torch.no_grad():  # no backward: no recomputation, nothing to refuse
        fn(updated, x)


def test_pruned_layers_in_a_list_are_put_back() -> None:
    """NOTE [tensors hooks set] for 70 pruned layers in a plain Python list (the walk for
    modules once stopped at containers of 64: every weight kept a transform's tensor, the
    review of session 60)."""
    from torch.func import functional_call
    from torch.nn.utils import prune

    torch.manual_seed(0)
    layers = [nn.Linear(3, 3).double() for _ in range(70)]
    for layer in layers:
        prune.l1_unstructured(layer, "weight", amount=0.3)
    x = torch.randn(4, 3, dtype=torch.float64)

    def f(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in layers[:3]:
            h = torch.tanh(functional_call(layer, p, (h,)))
        return h.sum(1)

    before = [layer.weight for layer in layers]
    tg.gramian(f, backend="jacobian", batch_dim=0)(dict(layers[0].named_parameters()), x)
    assert all(layer.weight is weight for layer, weight in zip(layers, before, strict=True))


def test_a_pruned_model_passed_as_an_argument_or_behind_data_is_put_back() -> None:
    """The walk for modules started from ``f`` alone for a while, and counted a captured
    list of tensors in its budget: a pruned model passed as an argument, or held in a dict
    beside 600 captured tensors, kept a transform's tensor (the review of session 60)."""
    from torch.func import functional_call
    from torch.nn.utils import prune

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    prune.l1_unstructured(model[0], "weight", amount=0.25)
    x = torch.randn(5, 3, dtype=torch.float64)
    data = [torch.randn(2) for _ in range(600)]
    holder = {"model": model}

    def passed(p: dict[str, torch.Tensor], net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return functional_call(net, p, (x,)).squeeze(-1)

    def behind_data(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        assert len(data) == 600
        return functional_call(holder["model"], p, (x,)).squeeze(-1)

    params = dict(model.named_parameters())
    _pruned_weight_kept(
        model, x,
        lambda: tg.gramian(passed, backend="jacobian", batch_dim=0, in_dims=(None, 0))(
            params, model, x),
        lambda: tg.gramian(behind_data, backend="jacobian", batch_dim=0)(params, x))


def _pruned_weight_kept(model: nn.Module, x: torch.Tensor, *calls: Any) -> None:
    """After a plain forward, each call leaves the pruned first layer's ``weight`` as it was."""
    model(x)
    before = model[0].weight
    for call in calls:
        call()
        assert model[0].weight is before


def test_a_pruned_model_in_a_dict_beside_a_tensor_is_put_back() -> None:
    """A mixed container (a tensor first, the model last) is looked into."""
    from torch.func import functional_call
    from torch.nn.utils import prune

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    prune.l1_unstructured(model[0], "weight", amount=0.25)
    state = {"scale": torch.tensor(2.0, dtype=torch.float64), "model": model}
    x = torch.randn(5, 3, dtype=torch.float64)

    def f(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return state["scale"] * functional_call(state["model"], p, (x,)).squeeze(-1)

    model(x)
    before = model[0].weight
    tg.gramian(f, backend="jacobian", batch_dim=0)(dict(model.named_parameters()), x)
    assert model[0].weight is before


def test_a_pruned_model_between_tensors_is_put_back() -> None:
    """Passed as the middle argument (``(w, model, x)``: the argument tuple has tensors at
    both ends) or held between two tensors in a captured list: missed by the walk's first
    ways of skipping containers of tensors (the last review of session 60)."""
    from torch.func import functional_call
    from torch.nn.utils import prune

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    prune.l1_unstructured(model[0], "weight", amount=0.25)
    x = torch.randn(5, 3, dtype=torch.float64)
    mixed = [torch.ones((), dtype=torch.float64), model, torch.zeros((), dtype=torch.float64)]

    def passed(w: torch.Tensor, net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return functional_call(net, {"0.weight_orig": w}, (x,), strict=False).squeeze(-1)

    def captured(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return mixed[0] * functional_call(mixed[1], {"0.weight_orig": w}, (x,),
                                          strict=False).squeeze(-1) + mixed[2]

    w = model[0].weight_orig.detach().clone()
    _pruned_weight_kept(
        model, x,
        lambda: tg.gramian(passed, backend="jacobian", batch_dim=0, in_dims=(None, 0))(
            w, model, x),
        lambda: tg.gramian(captured, backend="jacobian", batch_dim=0)(w, x))
