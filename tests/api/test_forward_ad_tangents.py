"""Calls made with ``torch.autograd.forward_ad`` dual tensors (NOTE [composition]).

Session 63's hunt: dual parameters gave ``G`` (and ``aggregated_grad``'s update) no tangent on
every backend, and a dual input gave a tangent 0.42 off on ``structured`` and ``auto`` (an
NTK's too), 0.30 for the update, or a raw error without ``batch_dim``, without a word.
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor

import torchgram as tg
from helpers import world_of_one  # noqa: F401 -- a fixture
from reference import dense_gramian_fn
from torchgram.backends.ntvp import _prepare_forward_ad

_prepare_forward_ad()  # torch's first forward-mode product warns (NOTE [first forward-AD call])

DOUBLE = torch.float64
BACKENDS = ["auto", "structured", "graph", "jacobian", "ntvp"]
CARRYING = ("graph", "jacobian")  # what carries an input's tangent (auto: by moving on)


def _f(p: dict[str, Tensor], x: Tensor) -> Tensor:
    return (torch.tanh(x @ p["first"].T + p["bias"]) @ p["second"].T).squeeze(-1)


def _case() -> tuple[dict[str, Tensor], Tensor, Tensor]:
    torch.manual_seed(0)
    params = {"first": torch.randn(6, 3, dtype=DOUBLE), "bias": torch.randn(6, dtype=DOUBLE),
              "second": torch.randn(1, 6, dtype=DOUBLE)}
    return params, torch.randn(5, 3, dtype=DOUBLE), torch.randn(5, 3, dtype=DOUBLE)


@pytest.mark.parametrize("batch_dim", [None, 0], ids=["dense", "batch_dim0"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dual_input_gives_gs_tangent_or_a_refusal(backend: str,
                                                    batch_dim: int | None) -> None:
    params, x, tangent = _case()
    wanted, wanted_tangent = torch.func.jvp(lambda x: dense_gramian_fn(_f)(params, x),
                                            (x,), (tangent,))
    with fwAD.dual_level():
        call = tg.gramian(_f, backend=backend, batch_dim=batch_dim)
        if backend not in (*CARRYING, "auto"):
            with pytest.raises(tg.BackendCannotRun, match="graph|jacobian|outside"):
                call(params, fwAD.make_dual(x, tangent))
            return
        gramian, gramian_tangent = fwAD.unpack_dual(call(params, fwAD.make_dual(x, tangent)))
    torch.testing.assert_close(gramian, wanted, rtol=1e-10, atol=1e-12)
    assert gramian_tangent is not None
    torch.testing.assert_close(gramian_tangent, wanted_tangent, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", ["auto", "structured"])
def test_a_dual_input_of_an_update_and_a_kernel(backend: str) -> None:
    params, x, tangent = _case()
    weights = torch.full((5,), 0.2, dtype=DOUBLE)

    def update(x: Tensor) -> Tensor:
        _, pullback = torch.func.vjp(lambda p: _f(p, x), params)
        return torch.cat([g.reshape(-1) for g in pullback(weights)[0].values()])

    _, wanted = torch.func.jvp(update, (x,), (tangent,))
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, tangent)
        if backend == "structured":
            with pytest.raises(tg.BackendCannotRun, match="forward_ad"):
                tg.aggregated_grad(_f, tg.weighting.mean, batch_dim=0, backend=backend)(
                    params, dual)
            return
        got, _ = tg.aggregated_grad(_f, tg.weighting.mean, batch_dim=0, backend=backend)(
            params, dual)
        got_tangent = torch.cat([fwAD.unpack_dual(g).tangent.reshape(-1)
                                 for g in got.values()])
        kernel = fwAD.unpack_dual(tg.ntk.empirical_ntk_fn(_f, trace_axes=())(dual, None,
                                                                            params))
    torch.testing.assert_close(got_tangent, wanted, rtol=1e-10, atol=1e-12)
    _, kernel_tangent = torch.func.jvp(lambda x: dense_gramian_fn(_f)(params, x),
                                       (x,), (tangent,))
    torch.testing.assert_close(kernel.tangent, kernel_tangent, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dual_parameters_are_refused(backend: str) -> None:
    params, x, _ = _case()
    with fwAD.dual_level():
        duals = {key: fwAD.make_dual(value, torch.ones_like(value))
                 for key, value in params.items()}
        with pytest.raises(NotImplementedError, match=r"^torchgram.gramian: expected "
                           r"differentiated tensors without forward-mode tangents.*jvp"):
            tg.gramian(_f, backend=backend, batch_dim=0)(duals, x)


class _DualHolder(torch.nn.Module):
    """A layer whose buffer ``shift`` may be made dual by the caller."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 6, dtype=DOUBLE)
        self.head = torch.nn.Linear(6, 1, dtype=DOUBLE)
        self.register_buffer("shift", torch.zeros(6, dtype=DOUBLE))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.layer(x) + self.shift)).squeeze(-1)


@pytest.mark.parametrize("held_by", ["closure", "buffer"])
def test_dual_tensors_f_holds_give_gs_tangent_on_auto(held_by: str) -> None:
    # Session 63's review: structured (and auto) gave tangents 0.40 (closure) and 0.68 (a
    # module's buffer) off; now structured declines inside a dual level, auto moves on.
    torch.manual_seed(0)
    module = _DualHolder()
    fn, params = tg.functionalize(module)
    x, shift, tangent = (torch.randn(5, 3, dtype=DOUBLE), torch.randn(6, dtype=DOUBLE),
                         torch.randn(6, dtype=DOUBLE))

    def dense(shift: Tensor) -> Tensor:
        return dense_gramian_fn(lambda p, x: torch.func.functional_call(
            module, {**p, "shift": shift}, (x,)))(params, x)

    wanted, wanted_tangent = torch.func.jvp(dense, (shift,), (tangent,))
    with fwAD.dual_level():
        dual = fwAD.make_dual(shift, tangent)
        if held_by == "closure":
            call = tg.gramian(lambda p, x: torch.func.functional_call(
                module, {**p, "shift": dual}, (x,)), batch_dim=0)
        else:
            module.shift = dual
            call = tg.gramian(fn, batch_dim=0)
        try:
            gramian, gramian_tangent = fwAD.unpack_dual(call(params, x))
        finally:
            module.shift = shift
    torch.testing.assert_close(gramian, wanted, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gramian_tangent, wanted_tangent, rtol=1e-10, atol=1e-12)


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("cross_rank", ["exact", "local"])
def test_the_distributed_api_refuses_a_tangent_f_holds(cross_rank: str) -> None:
    # The third review: refusing dual arguments only, a dual tensor f captured lost its
    # tangent without a word (a call in a dual level had been refused).
    params, x, tangent = _case()
    held = {"scale": torch.tensor(1.5, dtype=DOUBLE)}

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return _f(p, x) * held["scale"]

    with fwAD.dual_level():
        held["scale"] = fwAD.make_dual(held["scale"], torch.tensor(1.0, dtype=DOUBLE))
        with pytest.raises(NotImplementedError, match=r"^torchgram.distributed.gramian: "
                           r"expected f whose output carries no torch.autograd.forward_ad"):
            tg.distributed.gramian(f, batch_dim=0, cross_rank=cross_rank)(params, x)
    plain = tg.distributed.gramian(_f, batch_dim=0, cross_rank=cross_rank)
    with fwAD.dual_level():  # a level open without duals: answered
        torch.testing.assert_close(plain(params, x), tg.gramian(_f, batch_dim=0)(params, x),
                                   rtol=1e-10, atol=1e-12)


def test_the_distributed_api_refuses_dual_arguments() -> None:
    params, x, tangent = _case()
    with fwAD.dual_level(), pytest.raises(
            NotImplementedError, match=r"^torchgram.distributed.gramian: expected arguments "
            r"without torch.autograd.forward_ad tangents"):
        tg.distributed.gramian(_f, batch_dim=0)(params, fwAD.make_dual(x, tangent))


def test_a_tensor_f_captures_made_dual_after_a_plain_call_of_the_signature() -> None:
    # The second review: the cached probe of the plain call said "no tangent", and auto and
    # structured gave a tangent 1.02 off; an evaluation carrying one now probes afresh.
    torch.manual_seed(0)
    module = _DualHolder()
    params = {key: value.detach() for key, value in module.named_parameters()}
    x, shift, tangent = (torch.randn(5, 3, dtype=DOUBLE), torch.randn(6, dtype=DOUBLE),
                         torch.randn(6, dtype=DOUBLE))
    held = {"shift": shift}

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return torch.func.functional_call(module, {**p, "shift": held["shift"]}, (x,))

    def dense(shift: Tensor) -> Tensor:
        return dense_gramian_fn(lambda p, x: torch.func.functional_call(
            module, {**p, "shift": shift}, (x,)))(params, x)

    _, wanted_tangent = torch.func.jvp(dense, (shift,), (tangent,))
    call = tg.gramian(f, batch_dim=0)
    with fwAD.dual_level():
        call(params, x)  # plain: the signature's probe
        held["shift"] = fwAD.make_dual(shift, tangent)
        _, gramian_tangent = fwAD.unpack_dual(call(params, x))
    torch.testing.assert_close(gramian_tangent, wanted_tangent, rtol=1e-10, atol=1e-12)
