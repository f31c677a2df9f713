"""torchgram composes like a torch.func transform: every backend × situation vs the oracle.

The reference for anything computed *through* a Gramian is ``torch.func`` applied to the
dense oracle written as a function (``reference.dense_gramian_fn``). Each backend either
gives the reference's answer or declares, with ``BackendCannotRun``, that it cannot and
names the backends that can (``EXPECTED`` is the table the README shows); ``auto`` always
answers.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

import torchgram as tg
from reference import central_differences, dense_gramian_fn
from torchgram._core.errors import BackendCannotRun
from torchgram._core.signature import clear_caches
from torchgram.backends.ntvp import _prepare_forward_ad
from zoo import NAMES, build

_prepare_forward_ad()  # torch's first forward-mode product warns (NOTE [first forward-AD call])

DOUBLE = torch.float64
BACKENDS = ["auto", "jacobian", "ntvp", "graph", "structured"]
FUNCTORCH = {"grad-params", "grad-inputs", "jvp-params", "jacfwd-inputs", "vmap-ensemble",
             "vmap-datasets", "grad-of-vmap", "hessian-inputs"}
"""Situations inside torch.func transforms: only the backends that compose serve them."""
SITUATIONS = sorted(FUNCTORCH) + ["eager-create-graph", "eager-inputs", "nested", "compile",
                                  "mixed-dtypes"]
DECLARED = {"graph": FUNCTORCH, "structured": FUNCTORCH | {"nested"}}
"""What each backend declares it cannot do (BackendCannotRun naming jacobian and ntvp)."""
KINDS = {"losses": 0, "ntk": 0, "dense": None}
"""The function (per-sample losses ``[B]``, logits ``[B, 2]``) and its ``batch_dim``."""


def _params(dtype: torch.dtype = DOUBLE, seed: int = 0) -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = {"w1": (3, 4), "b1": (4,), "w2": (4, 2), "scale": (2,)}
    return {k: torch.randn(*s, generator=generator, dtype=dtype) / 2 for k, s in shapes.items()}


def _inputs(count: int = 5, seed: int = 1) -> Tensor:
    return torch.randn(count, 3, generator=torch.Generator().manual_seed(seed), dtype=DOUBLE)


def logits(p: dict[str, Tensor], x: Tensor) -> Tensor:
    """A two-layer MLP; ``scale`` is used elementwise (the structured fallback)."""
    h = torch.tanh(x.to(p["w1"].dtype) @ p["w1"] + p["b1"])
    return (h.to(p["w2"].dtype) @ p["w2"]) * p["scale"]


def losses(p: dict[str, Tensor], x: Tensor) -> Tensor:
    return (logits(p, x) - 1).pow(2).sum(-1)


FUNCTIONS = {"losses": losses, "ntk": logits, "dense": losses}


def objective(G: Tensor) -> Tensor:
    """A nonlinear function of the Gramian (its gradient depends on every entry)."""
    return (G**2).sum() + G.sum()


def assert_close(actual: Any, expected: Any, rtol: float = 1e-9) -> None:
    """Pytrees of tensors agree, relative to the largest entry of each expected leaf."""
    actual_leaves, expected_leaves = optree.tree_leaves(actual), optree.tree_leaves(expected)
    assert len(actual_leaves) == len(expected_leaves)
    for a, e in zip(actual_leaves, expected_leaves, strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype
        scale = e.abs().max().clamp_min(1.0)
        torch.testing.assert_close(a / scale, e / scale, rtol=rtol, atol=rtol)


def _stacked(count: int = 3) -> dict[str, Tensor]:
    ensemble = [_params(seed=s) for s in range(count)]
    return {k: torch.stack([p[k] for p in ensemble]) for k in ensemble[0]}


Maker = Callable[[Callable[..., Any]], Callable[..., Any]]


def _run(situation: str, gramian: Maker, f: Callable[..., Tensor], dense: Maker) -> Any:
    """The situation, computed with ``gramian(f)`` (torchgram's or the reference's).

    ``dense`` makes the Gramian of a function without per-sample structure (nesting).
    """
    G = gramian(f)
    params, x = _params(), _inputs()
    if situation == "grad-params":
        return torch.func.grad(lambda p: objective(G(p, x)))(params)
    if situation == "grad-inputs":
        return torch.func.grad(lambda x: objective(G(params, x)))(x)
    if situation == "jvp-params":
        tangent = _params(seed=7)
        return torch.func.jvp(lambda p: objective(G(p, x)), (params,), (tangent,))
    if situation == "jacfwd-inputs":
        return torch.func.jacfwd(lambda x: G(params, x).sum(0))(x)
    if situation == "vmap-ensemble":
        return torch.func.vmap(G, in_dims=(0, None))(_stacked(), x)
    if situation == "vmap-datasets":
        datasets = torch.stack([_inputs(seed=s) for s in range(3)])
        return torch.func.vmap(G, in_dims=(None, 0))(params, datasets)
    if situation == "grad-of-vmap":
        return torch.func.grad(
            lambda p: objective(torch.func.vmap(G, in_dims=(0, None))(p, x)))(_stacked())
    if situation == "hessian-inputs":
        return torch.func.hessian(lambda x: G(params, x).diagonal().sum())(x[:3])
    if situation in ("eager-create-graph", "eager-inputs"):
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        x = x.clone().requires_grad_(situation == "eager-inputs")
        wrt = [x] if situation == "eager-inputs" else list(leaves.values())
        value = objective(G(leaves, x))
        return value.detach(), torch.autograd.grad(value, wrt)
    if situation == "nested":  # the Gramian of the inner Gramian's diagonal
        return dense(lambda p, x: G(p, x).reshape(-1)[:4])(params, x)
    if situation == "compile":  # G is a graph break; dynamo then reads a non-leaf's .grad
        compiled = torch.compile(lambda p, x: objective(G(p, x)), backend="aot_eager")
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is "
                                    "not a leaf", category=UserWarning)
            value = compiled(leaves, x)
        return value.detach(), torch.autograd.grad(value, list(leaves.values()))
    if situation == "mixed-dtypes":
        mixed = {k: v.float() if k in ("w1", "scale") else v for k, v in params.items()}
        return G(mixed, x)
    raise AssertionError(situation)


def _torchgram(backend: str, kind: str | None) -> Maker:
    return lambda f: tg.gramian(f, backend=backend, batch_dim=None if kind is None else KINDS[kind])


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("situation", SITUATIONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_composes_or_declares(backend: str, situation: str, kind: str) -> None:
    torch.compiler.reset() if situation == "compile" else None
    f = FUNCTIONS[kind]
    if situation in DECLARED.get(backend, set()):
        with pytest.raises(BackendCannotRun) as caught:
            _run(situation, _torchgram(backend, kind), f, _torchgram(backend, None))
        assert "jacobian" in caught.value.alternatives
        assert "backend='jacobian'" in str(caught.value)
        return
    expected = _run(situation, dense_gramian_fn, f, dense_gramian_fn)
    actual = _run(situation, _torchgram(backend, kind), f, _torchgram(backend, None))
    assert_close(actual, expected, rtol=1e-5 if situation == "mixed-dtypes" else 1e-9)


def _zoo_grid() -> list[Any]:
    grid = []
    for name in NAMES:
        case = build(name)
        for batch in ([None] if case.batch_dim is None else [None, case.batch_dim]):
            for backend, chunk in (("structured", None), ("structured", 1), ("graph", None),
                                   ("jacobian", None), ("ntvp", None)):
                label = "dense" if batch is None else "per_sample"
                grid.append(pytest.param(backend, name, batch, chunk,
                                         id=f"{backend}-{name}-{label}-chunk{chunk}"))
    return grid


@pytest.mark.parametrize(("backend", "name", "batch_dim", "chunk_size"), _zoo_grid())
def test_eager_create_graph_on_the_zoo(backend: str, name: str, batch_dim: int | None,
                                       chunk_size: int | None) -> None:
    """Eager create-graph on every zoo model: autograd through G vs torch.func on the oracle.

    The oracle loops over rows (``chunk_size=1``): torch 2.13 gets the derivatives of batched
    layer- and batch-norm backwards wrong (NOTE [decomposed norms]).
    """
    case = build(name)
    flat, spec = optree.tree_flatten(case.params)
    floating = [i for i, leaf in enumerate(flat)
                if isinstance(leaf, Tensor) and leaf.is_floating_point()]

    def with_leaves(values: list[Tensor]) -> Any:
        rebuilt = list(flat)
        for i, value in zip(floating, values, strict=True):
            rebuilt[i] = value
        return optree.tree_unflatten(spec, rebuilt)

    def objective_of(gramian: Callable[..., Tensor]) -> Callable[[list[Tensor]], Tensor]:
        return lambda values: objective(gramian(with_leaves(values), *case.inputs))

    values = [flat[i] for i in floating]
    with sdpa_kernel(SDPBackend.MATH):  # the fused attention kernels have no double backward
        expected = torch.func.grad(objective_of(dense_gramian_fn(case.f, chunk_size=1)))(values)
    leaves = [value.detach().clone().requires_grad_() for value in values]
    G = tg.gramian(case.f, backend=backend, batch_dim=batch_dim, in_dims=case.in_dims,
                   chunk_size=chunk_size)
    grads = torch.autograd.grad(objective_of(G)(leaves), leaves, allow_unused=True)
    assert_close([torch.zeros_like(e) if g is None else g
                  for g, e in zip(grads, expected, strict=True)], expected)


def _softmin_weighting(G: Tensor) -> Tensor:
    """A weighting that depends on G smoothly (favours samples with small gradients)."""
    return torch.softmax(-G.diagonal() / G.diagonal().mean(), dim=0)


def _reference_update(p: dict[str, Tensor], x: Tensor) -> dict[str, Tensor]:
    """``Jᵀ w`` with ``w = weighting(J Jᵀ)``, from the dense oracle."""
    weights = _softmin_weighting(dense_gramian_fn(losses)(p, x))
    _, vjp_fn = torch.func.vjp(lambda q: losses(q, x), p)
    return vjp_fn(weights)[0]


@pytest.mark.parametrize("situation", ["grad-params", "eager-create-graph", "vmap-ensemble"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_aggregated_grad_composes(backend: str, situation: str) -> None:
    """A meta-objective of one Jacobian-descent step's update, differentiated or batched."""
    aggregated = tg.aggregated_grad(losses, _softmin_weighting, backend=backend, batch_dim=0)

    def run(update: Callable[..., Any]) -> Any:
        params, x = _params(), _inputs()
        if situation == "grad-params":
            return torch.func.grad(lambda p: sum(u.square().sum()
                                                 for u in update(p, x).values()))(params)
        if situation == "vmap-ensemble":
            return torch.func.vmap(update, in_dims=(0, None))(_stacked(), x)
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        value = sum(u.square().sum() for u in update(leaves, x).values())
        return torch.autograd.grad(value, list(leaves.values()))

    def ours(p: dict[str, Tensor], x: Tensor) -> dict[str, Tensor]:
        return aggregated(p, x)[0]

    if situation != "eager-create-graph" and backend in DECLARED:
        with pytest.raises(BackendCannotRun):
            run(ours)
        return
    assert_close(run(ours), run(_reference_update))


def test_explain_says_what_ran_and_refuses_inside_transforms() -> None:
    params, x = _params(), _inputs()
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    report = tg.explain(losses, batch_dim=0, run=True)(leaves, x)
    assert report.ran is not None and report.gramian.requires_grad
    with pytest.raises(RuntimeError, match="outside torch.func transforms"):
        torch.func.grad(lambda p: tg.explain(losses, run=True)(p, x).gramian.sum())(params)


def test_nothing_is_differentiable_without_a_reason() -> None:
    """No transform, nothing requires grad (or grad mode off): the detached fast path."""
    params, x = _params(), _inputs()
    assert not tg.gramian(losses, batch_dim=0)(params, x).requires_grad
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    with torch.no_grad():
        assert not tg.gramian(losses, batch_dim=0)(leaves, x).requires_grad
    G, aux = tg.gramian(lambda p, x: (losses(p, x), losses(p, x).mean()), batch_dim=0,
                        has_aux=True)(leaves, x)
    assert G.requires_grad and aux.requires_grad  # aux keeps its graph where G does


def _recurrent(kind: str, dtype: torch.dtype) -> tuple[Callable[..., Tensor], dict[str, Tensor],
                                                      Tensor]:
    """Per-sample losses of a fused LSTM or GRU, or of an LSTM cell, and their inputs."""
    torch.manual_seed(0)
    if kind == "lstm_cell":
        cell_fn, params = tg.functionalize(torch.nn.LSTMCell(3, 2).to(dtype))

        def cell_losses(p: dict[str, Tensor], x: Tensor) -> Tensor:
            return cell_fn(p, x)[0].pow(2).sum(-1)

        return cell_losses, params, torch.randn(4, 3, dtype=dtype)
    module = (torch.nn.LSTM if kind == "lstm" else torch.nn.GRU)(3, 2, batch_first=True)
    rnn_fn, params = tg.functionalize(module.to(dtype))

    def rnn_losses(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return rnn_fn(p, x)[0].pow(2).mean((1, 2))

    return rnn_losses, params, torch.randn(4, 5, 3, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("kind", ["lstm", "gru", "lstm_cell"])
@pytest.mark.parametrize("backend", ["auto", "jacobian", "ntvp"])
def test_vmap_over_an_ensemble_of_recurrent_models(backend: str, kind: str,
                                                   dtype: torch.dtype) -> None:
    """Found by session 25's compose hunt (NOTE [ops without a batching rule]).

    vmap has no batching rule for torch.lstm, torch.gru and torch.lstm_cell evaluated without
    autograd: torchgram's own evaluations of f (the probe, the batch's outputs) raised torch's
    error on every backend. They now run inside a vjp level there; a backend that still
    cannot (ntvp: no forward-mode derivative of the fused CPU kernel) says so.
    """
    losses_fn, params, x = _recurrent(kind, dtype)
    members = {k: torch.stack([v, 0.5 * v]) for k, v in params.items()}
    expected = torch.func.vmap(lambda p: dense_gramian_fn(losses_fn)(p, x))(members)
    for batch_dim in (None, 0):
        transform = tg.gramian(losses_fn, backend=backend, batch_dim=batch_dim)
        try:
            actual = torch.func.vmap(lambda p, t=transform: t(p, x))(members)
        except BackendCannotRun as refusal:
            assert backend == "ntvp" and "forward-mode" in str(refusal), refusal
            continue
        scale = expected.abs().max()
        rtol = 1e-10 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(actual / scale, expected / scale, rtol=rtol, atol=rtol)


def _lookup_losses(padding_idx: int | None, by_freq: bool) -> Callable[..., Tensor]:
    def lookup_losses(p: dict[str, Tensor], index: Tensor, labels: Tensor) -> Tensor:
        h = torch.nn.functional.embedding(index, p["table"], padding_idx=padding_idx,
                                          scale_grad_by_freq=by_freq).mean(1)
        return torch.nn.functional.cross_entropy(h @ p["head"].T, labels, reduction="none")

    return lookup_losses


@pytest.mark.parametrize("situation", ["grad", "jvp", "vmap", "eager-create-graph"])
@pytest.mark.parametrize("convention", ["padding_idx", "scale_grad_by_freq", "both"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_embedding_conventions_under_transforms(backend: str, convention: str,
                                                situation: str) -> None:
    """Found by session 25's compose hunt (NOTE [embedding conventions]).

    ntvp wrote the lookup's conventions out for every order of differentiation, where torch's
    own forward mode ignores them: jvp through its Gramian was 0.1-0.8 off, grad 0.01-0.24;
    structured's create-graph Gramian with scale_grad_by_freq 0.016 (torch's double backward
    ignores it). Both now decline there; every other answer agrees, auto's always.
    """
    f = _lookup_losses(None if convention == "scale_grad_by_freq" else 0,
                       convention != "padding_idx")
    generator = torch.Generator().manual_seed(0)
    params = {"table": torch.randn(5, 2, generator=generator, dtype=DOUBLE),
              "head": torch.randn(3, 2, generator=generator, dtype=DOUBLE)}
    index, labels = torch.tensor([[0, 1, 3], [0, 3, 3]]), torch.tensor([0, 2])
    tangent = {k: torch.randn(v.shape, generator=generator, dtype=DOUBLE)
               for k, v in params.items()}
    members = {k: torch.stack([v, -0.5 * v]) for k, v in params.items()}

    def run(G: Callable[..., Tensor]) -> Any:
        if situation == "grad":
            return torch.func.grad(lambda p: G(p, index, labels).pow(2).sum())(params)
        if situation == "jvp":
            return torch.func.jvp(lambda p: G(p, index, labels), (params,), (tangent,))[1]
        if situation == "vmap":
            return torch.func.vmap(lambda p: G(p, index, labels))(members)
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        return torch.autograd.grad(G(leaves, index, labels).pow(2).sum(), list(leaves.values()))

    expected = run(dense_gramian_fn(f))
    try:
        actual = run(tg.gramian(f, backend=backend, batch_dim=0))
    except BackendCannotRun as refusal:
        rescaled = convention != "padding_idx"
        declined = (backend in DECLARED and situation in ("grad", "jvp", "vmap")
                    or backend == "ntvp" and (situation == "jvp" or rescaled
                                              and situation != "vmap")
                    or backend == "structured" and situation == "eager-create-graph"
                    and rescaled)
        assert declined, refusal
        return
    assert_close(actual, expected)


@pytest.mark.parametrize("backend", ["auto", "jacobian", "ntvp"])
def test_a_call_under_fewer_levels_after_one_under_more(backend: str) -> None:
    """Found by session 25's composition property: the per-sample row index was cached across
    calls, and one made under jvp(grad(...)) belonged to those (dead) levels: the next call under
    grad alone failed torch's internal assert ("level <= current_level ... escaped?")."""
    params, x = _params(), _inputs()
    G = tg.gramian(losses, backend=backend, batch_dim=0)
    reference = dense_gramian_fn(losses)
    tangent = _params(seed=7)

    def gradient(gramian: Callable[..., Tensor]) -> Callable[..., Any]:
        return torch.func.grad(lambda p: objective(gramian(p, x)))

    assert_close(torch.func.jvp(gradient(G), (params,), (tangent,))[1],
                 torch.func.jvp(gradient(reference), (params,), (tangent,))[1])
    assert_close(gradient(G)(params), gradient(reference)(params))
    assert_close(torch.func.vmap(gradient(G))(_stacked()),
                 torch.func.vmap(gradient(reference))(_stacked()))


def _attention_losses(p: dict[str, Tensor], x: Tensor) -> Tensor:
    """Per-sample losses of two-head self-attention through ``scaled_dot_product_attention``.

    ``[B, heads, T, d]`` operands, as ``transformers`` passes them: torch picks its fused CPU
    kernel for those (for 3-D ones, the math one).
    """
    batch, tokens, _ = x.shape
    q, k, v = ((x @ p[name]).reshape(batch, tokens, 2, 2).transpose(1, 2)
               for name in ("wq", "wk", "wv"))
    h = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    return (h.reshape(batch, tokens, 4).sum(-2) @ p["out"]).pow(2).sum(-1)


def _attention_params() -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(3)
    shapes = {"wq": (3, 4), "wk": (3, 4), "wv": (3, 4), "out": (4, 2)}
    return {k: torch.randn(*s, generator=generator, dtype=DOUBLE) / 2 for k, s in shapes.items()}


@pytest.mark.parametrize("transform", ["jvp", "jacfwd"])
@pytest.mark.parametrize("batch_dim", [0, None], ids=["batch0", "batchNone"])
@pytest.mark.parametrize("backend", ["auto", "jacobian", "ntvp"])
def test_forward_mode_through_fused_attention(backend: str, batch_dim: int | None,
                                              transform: str) -> None:
    """``jvp``/``jacfwd`` through G of f calling SDPA: every evaluation uses the math kernel.

    The fused kernels have no forward-mode derivative; the probe's evaluation under the outer
    jvp level ran them (torch's raw NotImplementedError from every backend before session 30,
    e.g. on every ``transformers`` model with ``attn_implementation="sdpa"``).
    """
    params, x = _attention_params(), torch.randn(4, 5, 3, dtype=DOUBLE,
                                                 generator=torch.Generator().manual_seed(4))
    tangent = {k: torch.ones_like(v) / 3 for k, v in params.items()}

    def through(gramian: Maker) -> Any:
        G = gramian(_attention_losses)
        if transform == "jvp":
            return torch.func.jvp(lambda p: objective(G(p, x)), (params,), (tangent,))
        return torch.func.jacfwd(lambda w: G({**params, "wq": w}, x).sum(0))(params["wq"])

    with sdpa_kernel(SDPBackend.MATH):  # the oracle's own forward-mode pass needs it too
        expected = through(dense_gramian_fn)
    clear_caches()  # the first call's probe is the evaluation this is about
    actual = through(lambda f: tg.gramian(f, backend=backend, batch_dim=batch_dim))
    assert_close(actual, expected)


def _hard_sigmoid_losses(p: dict[str, Tensor], x: Tensor) -> Tensor:
    return torch.nn.functional.hardsigmoid(x @ p["w1"]).pow(2).sum(-1)


def _cdist_losses(p: dict[str, Tensor], x: Tensor) -> Tensor:
    h = x @ p["w1"]
    return torch.cdist(h, h).sum(-1)


@pytest.mark.parametrize(("f", "op"), [(_hard_sigmoid_losses, "hardsigmoid_backward"),
                                       (_cdist_losses, "_cdist_forward")],
                         ids=["in-the-derivative", "in-f-itself"])
@pytest.mark.parametrize("backend", ["auto", "jacobian", "ntvp"])
def test_forward_mode_through_an_op_torch_cannot_differentiate_so(
        backend: str, f: Callable[..., Tensor], op: str) -> None:
    """No backend can: a torchgram error naming the op and reverse mode, on every call."""
    params, x = _params(), _inputs()
    G = tg.gramian(f, backend=backend, batch_dim=0)
    for _ in range(2):  # the second call has its probe cached
        with pytest.raises(NotImplementedError, match=rf"^torchgram\.gramian: .*{op}.*"
                           r"Differentiate it in reverse mode"):
            torch.func.jvp(lambda p: objective(G(p, x)), (params,), (params,))


def _dropout_ensemble() -> tuple[Callable[..., Tensor], dict[str, Tensor], dict[str, Tensor]]:
    """``f(params, buffers, x)`` of a net with dropout, and an ensemble's stacked state."""
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Dropout(0.3), torch.nn.Tanh(),
                                  torch.nn.Linear(6, 1)).to(DOUBLE) for _ in range(2)]
    params, buffers = torch.func.stack_module_state(models)  # type: ignore[arg-type]
    base = models[0].to("meta")

    def f(p: dict[str, Tensor], b: dict[str, Tensor], x: Tensor) -> Tensor:
        return torch.func.functional_call(base, (p, b), (x,)).squeeze(-1)

    return f, {k: v.detach() for k, v in params.items()}, buffers


@pytest.mark.parametrize("randomness", ["error", "same", "different"])
@pytest.mark.parametrize("kind", ["gramian", "ntk"])
def test_a_random_f_under_vmap_is_declined_by_every_backend_naming_what_to_do(
        kind: str, randomness: str) -> None:
    """NOTE [draws under torch.func]: no backend can; torch's vmap error (randomness='error')
    was raw before session 31, and the other modes' refusal named graph and structured, which
    cannot run inside transforms either."""
    f, params, buffers = _dropout_ensemble()
    x = torch.randn(5, 4, dtype=DOUBLE)

    def one(p: dict[str, Tensor], b: dict[str, Tensor]) -> Tensor:
        if kind == "ntk":
            return tg.ntk.empirical_ntk_fn(lambda q, x: f(q, b, x)[:, None])(x, None, p)
        return tg.gramian(lambda q, x: f(q, b, x), batch_dim=0)(p, x)

    with pytest.raises(NotImplementedError, match="No backend can inside torch.func "
                       "transforms.*model.eval\\(\\) for dropout") as info:
        torch.func.vmap(one, randomness=randomness)(params, buffers)
    assert getattr(info.value, "alternatives", ()) == ()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_random_f_under_grad_is_declined_naming_no_backend(backend: str) -> None:
    f, params, buffers = _dropout_ensemble()
    member = {k: v[0] for k, v in params.items()}
    state = {k: v[0] for k, v in buffers.items()}
    x = torch.randn(5, 4, dtype=DOUBLE)
    with pytest.raises(BackendCannotRun) as info:
        torch.func.grad(lambda p: tg.gramian(lambda q, x: f(q, state, x), backend=backend)(
            p, x).sum())(member)
    if backend in ("jacobian", "ntvp", "auto"):
        assert info.value.alternatives == ()
        assert "No backend can inside torch.func transforms" in str(info.value)


def _branches_on_values(w: Tensor, x: Tensor) -> Tensor:
    h = x @ w
    return h.sum(-1) if bool(h.sum() > 0) else -h.sum(-1)  # Python control flow on a value


def _fused_rnn() -> Callable[[dict[str, Tensor], Tensor], Tensor]:
    torch.manual_seed(0)
    fn, _ = tg.functionalize(torch.nn.RNN(3, 4, batch_first=True).to(DOUBLE))
    return lambda p, x: fn(p, x)[0].sum((-2, -1))


def _max_norm_embedding() -> tuple[Callable[[dict[str, Tensor], Tensor], Tensor],
                                    dict[str, Tensor]]:
    torch.manual_seed(0)
    fn, params = tg.functionalize(torch.nn.Embedding(7, 3, max_norm=0.5).to(DOUBLE))
    return lambda p, ids: fn(p, ids).tanh().sum((-2, -1)), params


@pytest.mark.parametrize("plain_first", [False, True], ids=["vmap-first", "after-a-plain-call"])
@pytest.mark.parametrize("kind", ["gramian", "ntk"])
@pytest.mark.parametrize("model", ["control-flow", "fused-rnn", "max-norm"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_f_that_vmap_cannot_run_over_input_sets_is_a_torchgram_error(
        backend: str, model: str, kind: str, plain_first: bool) -> None:
    """torch.func.vmap of f itself fails the same way (no backend can): torch's raw errors
    ("data-dependent control flow", a fused RNN writing batched values into its unbatched
    initial state) reached the user before session 31; an embedding with ``max_norm``
    (renormalising the rows of batched indices in its unbatched table) before session 49;
    after a plain call of the same signature, whose cached probe the vmapped call took,
    before session 51 (auto, jacobian, ntvp; a helper's hunt)."""
    if model == "control-flow":
        f: Callable[..., Tensor] = _branches_on_values
        params: Any = torch.randn(3, 2, dtype=DOUBLE)
        input_sets: Tensor = torch.randn(2, 4, 3, dtype=DOUBLE)
    elif model == "max-norm":
        f, params = _max_norm_embedding()
        input_sets = torch.randint(0, 7, (2, 4, 5), generator=torch.Generator().manual_seed(0))
    else:
        f = _fused_rnn()
        params = {k: v.detach() for k, v in
                  torch.nn.RNN(3, 4, batch_first=True).to(DOUBLE).named_parameters()}
        input_sets = torch.randn(2, 4, 5, 3, dtype=DOUBLE)

    def one(x: Tensor) -> Tensor:
        if kind == "ntk":
            return tg.ntk.empirical_ntk_fn(lambda p, x: f(p, x)[:, None], backend=backend)(
                x, None, params)
        return tg.gramian(f, backend=backend, batch_dim=0)(params, x)

    if plain_first:
        one(input_sets[0])
    with pytest.raises(NotImplementedError, match="f that runs under the torch.func.vmap "
                       "around the call.*in a loop instead of vmap"):
        torch.func.vmap(one)(input_sets)


def _normed_rows(norm: str) -> Callable[[dict[str, Tensor], Tensor], Tensor]:
    def rows(p: dict[str, Tensor], x: Tensor) -> Tensor:
        h = x @ p["w1"] + p["b1"]
        h = torch.nn.functional.layer_norm(h, (4,), p["gamma"]) if norm == "layer_norm" else \
            torch.nn.functional.batch_norm(h, None, None, p["gamma"], training=True)
        return torch.tanh(h) @ p["w2"]
    return rows


def _trace_gradient_norm(G: Callable[..., Tensor], params: dict[str, Tensor], x: Tensor) -> Tensor:
    """``‖∇ₓ tr G(params, x)‖²`` (``G`` of rows ``[5, 2]``)."""
    return torch.func.grad(lambda x: G(params, x).reshape(10, 10).trace())(x).square().sum()


@functools.cache
def _normed_problem(norm: str) -> tuple[dict[str, Tensor], Tensor, Tensor]:
    """Parameters, inputs and the central differences of :func:`_trace_gradient_norm`.

    The differences are of the oracle's second derivatives, which are right where it loops
    over rows (``chunk_size=1``).
    """
    generator = torch.Generator().manual_seed(3)
    shapes = {"w1": (3, 4), "b1": (4,), "gamma": (4,), "w2": (4, 2)}
    params = {k: torch.randn(*s, generator=generator, dtype=DOUBLE) for k, s in shapes.items()}
    x = torch.randn(5, 3, generator=generator, dtype=DOUBLE)
    oracle = dense_gramian_fn(_normed_rows(norm), chunk_size=1)
    return params, x, central_differences(lambda x: _trace_gradient_norm(oracle, params, x), x)


@pytest.mark.parametrize(("backend", "transform"), [
    *((backend, "torch.func") for backend in BACKENDS if backend not in DECLARED),
    *((backend, "eager-create-graph") for backend in BACKENDS)])
@pytest.mark.parametrize("norm", ["layer_norm", "batch_norm-train"])
def test_third_derivatives_through_norms_match_finite_differences(
        backend: str, norm: str, transform: str) -> None:
    """``d/dx ‖∇ₓ tr G‖²``: third derivatives of ``f`` through its norm layers.

    torch 2.13's own third derivatives of the fused ``layer_norm`` and training
    ``batch_norm`` are wrong even without ``vmap`` (0.3 and 0.9 off, relative:
    ``tests/core/test_norms.py``), and so is the oracle's (1.3 off here); NOTE [decomposed
    norms] makes them right. The reference is central differences (:func:`_normed_problem`).
    """
    kind = norm.removesuffix("-train")
    params, x, expected = _normed_problem(kind)
    G = tg.gramian(_normed_rows(kind), backend=backend,
                   batch_dim=0 if kind == "layer_norm" else None)
    if transform == "torch.func":
        actual = torch.func.grad(lambda x: _trace_gradient_norm(G, params, x))(x)
    else:
        leaf = x.clone().requires_grad_()
        trace = G(params, leaf).reshape(10, 10).trace()
        inner = torch.autograd.grad(trace, leaf, create_graph=True)[0]
        actual = torch.autograd.grad(inner.square().sum(), leaf)[0]
    torch.testing.assert_close(actual, expected, rtol=1e-6,
                               atol=1e-6 * expected.abs().max().item())


@pytest.mark.parametrize("batch_dim", [0, None], ids=["batch0", "nobatch"])
@pytest.mark.parametrize("backend", ["auto", "structured", "graph", "jacobian", "ntvp"])
def test_f_that_vmaps_its_own_per_sample_loss(backend: str, batch_dim: int | None) -> None:
    """``f = vmap(per_sample_loss)``: the structured taps were made inside f's own vmap
    (torch's "requires_grad_() inside of a function being transformed"; auto and structured
    declined, ``explain`` raised it; session 59's hunt). NOTE [uses with gradients off]."""
    generator = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 5, generator=generator, dtype=torch.float64),
              "v": torch.randn(5, generator=generator, dtype=torch.float64)}
    x = torch.randn(6, 4, generator=generator, dtype=torch.float64)

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return torch.vmap(lambda row: torch.tanh(row @ p["w"]) @ p["v"])(x)

    expected = dense_gramian_fn(f)(params, x)
    G = tg.gramian(f, backend=backend, batch_dim=batch_dim)(params, x)
    torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-12)
    explanation = tg.explain(f, backend=backend, batch_dim=batch_dim, run=True)(params, x)
    assert explanation.ran is not None
