"""Concurrent calls from several threads: right on every backend, modules left intact.

NOTE [threads] in ``torchgram._core.threads`` says what is process-wide and how each is
handled; these tests run the combinations that went wrong before it: forward-mode AD
(``ntvp``) and ``tg.functionalize`` from several threads, attention (the kernel switches),
per-sample ``vmap`` paths and the shared caches.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import torchgram as tg
from reference import dense_gramian
from torchgram._core import problem as problem_module
from torchgram._core import threads
from torchgram._core.composition import differentiable_evaluation
from torchgram._core.rng import RngState
from torchgram._core.signature import clear_caches

BACKENDS = ["jacobian", "ntvp", "graph", "structured", "auto"]
THREADS = 4


@dataclass
class Job:
    """One call and the oracle's answer."""

    name: str
    f: Callable[..., Any]
    args: tuple[Any, ...]
    options: dict[str, Any]
    expected: Tensor


def _jobs() -> tuple[list[Job], list[nn.Module]]:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    encoder = nn.TransformerEncoderLayer(d_model=4, nhead=2, dim_feedforward=6, dropout=0.0,
                                         batch_first=True).double()
    mlp_fn, mlp_params = tg.functionalize(mlp)
    enc_fn, enc_params = tg.functionalize(encoder)
    pure = {"w": torch.randn(5, 6, dtype=torch.float64), "v": torch.randn(6, 2,
                                                                        dtype=torch.float64)}

    def pure_f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return torch.tanh(x @ p["w"]) @ p["v"]

    def mlp_losses(p: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(mlp_fn(p, x), y, reduction="none")

    def enc_losses(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return enc_fn(p, x).pow(2).mean((1, 2))

    calls = [
        ("pure", pure_f, lambda: (pure, torch.randn(4, 5, dtype=torch.float64))),
        ("mlp", mlp_losses, lambda: (mlp_params, torch.randn(5, 5, dtype=torch.float64),
                                     torch.randint(0, 3, (5,)))),
        ("encoder", enc_losses, lambda: (enc_params, torch.randn(3, 2, 4, dtype=torch.float64))),
    ]
    jobs = []
    for name, f, make_args in calls:
        for variant in range(2):  # two argument sets per function: threads disagree on data
            args = make_args()
            expected = dense_gramian(f, args).shaped()
            for batch_dim in (None, 0):
                jobs.append(Job(f"{name}[{variant}]-batch{batch_dim}", f, args,
                                dict(batch_dim=batch_dim), expected))
    return jobs, [mlp, encoder]


def _module_state(module: nn.Module) -> list[tuple[str, Tensor, Tensor]]:
    return [(name, t, t.detach().clone()) for name, t in
            module.state_dict(keep_vars=True).items()]


def test_concurrent_calls_every_backend_and_module() -> None:
    """THREADS threads × every backend × functionalized modules and a pure function."""
    jobs, modules = _jobs()
    before = [_module_state(m) for m in modules]
    flags = torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()
    failures: list[str] = []
    counts = [0] * THREADS
    start = threading.Barrier(THREADS)

    def worker(index: int) -> None:
        start.wait()
        order = [(backend, job) for job in jobs for backend in BACKENDS]
        order = order[::-1] if index % 2 else order  # each thread in its own order
        shift = index * len(order) // THREADS
        for backend, job in order[shift:] + order[:shift]:
            try:
                G = tg.gramian(job.f, backend=backend, **job.options)(*job.args)
                error = ((G - job.expected).abs().max() / job.expected.abs().max()).item()
                if not error < 1e-8:
                    failures.append(f"{backend} {job.name}: relative error {error:.3g}")
            except Exception as exc:  # noqa: BLE001 -- every error is a failure here
                failures.append(f"{backend} {job.name}: {type(exc).__name__}: {exc}")
            counts[index] += 1

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    began = time.perf_counter()
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in workers), "a thread hung (deadlock?)"
    elapsed = time.perf_counter() - began
    assert not failures, f"{len(failures)} wrong calls: {failures[:5]}"
    assert sum(counts) == THREADS * len(jobs) * len(BACKENDS)
    assert elapsed < 300
    for module, state in zip(modules, before, strict=True):
        current = module.state_dict(keep_vars=True)
        for name, tensor, value in state:
            assert current[name] is tensor, f"{name} was replaced"
            assert torch.equal(tensor.detach(), value)
        for name, parameter in module.named_parameters():
            assert isinstance(parameter, nn.Parameter), name
            assert not torch._C._functorch.is_functorch_wrapped_tensor(parameter), name
    assert (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()) \
        == flags
    assert torch.autograd.forward_ad._current_level == -1


def test_functionalize_never_shows_a_call_its_neighbours_tensors() -> None:
    """Two threads call one functionalized module with different parameters, many times."""
    class Slow(nn.Linear):
        def forward(self, x: Tensor) -> Tensor:
            y = x @ self.weight.T
            time.sleep(1e-4)  # Python work between two reads of the module's attributes
            return y + self.bias

    torch.manual_seed(0)
    model = Slow(3, 2).double()
    fn, params = tg.functionalize(model)
    x = torch.randn(4, 3, dtype=torch.float64)
    variants = [{k: v + shift for k, v in params.items()} for shift in (0.0, 1.0, -2.0)]
    expected = [F.linear(x, p["weight"], p["bias"]) for p in variants]
    wrong: list[int] = []

    def worker(index: int) -> None:
        for _ in range(100):
            if not torch.equal(fn(variants[index], x), expected[index]):
                wrong.append(index)

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    assert not wrong
    assert torch.equal(model(x), F.linear(x, params["weight"], params["bias"]))
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())


def test_forward_ad_from_threads_under_vmap() -> None:
    """ntvp's vmapped forward-mode pushes from four threads (the case of issue 14)."""
    w = torch.randn(4, 3, dtype=torch.float64)

    def f(w: Tensor, x: Tensor) -> Tensor:
        return torch.sin(x @ w).sum(-1)

    inputs = [torch.randn(6, 4, dtype=torch.float64) for _ in range(THREADS)]
    expected = [dense_gramian(f, (w, x)).shaped() for x in inputs]
    errors: list[float] = []

    def worker(index: int) -> None:
        for _ in range(15):
            G = tg.gramian(f, backend="ntvp", chunk_size=3)(w, inputs[index])
            errors.append(((G - expected[index]).abs().max()).item())

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    assert len(errors) == 15 * THREADS and max(errors) < 1e-10


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_call_under_vmap_while_another_thread_is_in_forward_mode(backend: str) -> None:
    """Thread A's ntvp pass waits inside its forward-mode level (process-wide) while thread B
    calls ``vmap(tg.gramian)``: B must not take A's level for its caller's (it looked for
    tangents on its batched tensors: torch's raw "Batching rule not implemented for
    aten::_unpack_dual", a helper's hunt, session 66)."""
    torch.manual_seed(0)
    w, v = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    in_level, b_done = threading.Event(), threading.Event()

    def f_a(w: Tensor, x: Tensor) -> Tensor:
        if torch.autograd.forward_ad._current_level >= 0:  # inside ntvp's pass
            in_level.set()
            b_done.wait(timeout=0.5)  # B blocks on the level's lock until this returns
        return torch.sin(x @ w).sum(-1)

    def f_b(v: Tensor, x: Tensor) -> Tensor:
        return torch.tanh(x @ v).sum(-1)

    xa, xb = torch.randn(5, 4, dtype=torch.float64), torch.randn(2, 3, 4, dtype=torch.float64)
    expected = torch.stack([dense_gramian(f_b, (v, x)).shaped() for x in xb])
    outcome: dict[str, Any] = {}

    def a() -> None:
        outcome["a"] = tg.gramian(f_a, backend="ntvp", batch_dim=0)(w, xa)

    def b() -> None:
        assert in_level.wait(timeout=30.0)
        try:
            outcome["b"] = torch.func.vmap(
                lambda x: tg.gramian(f_b, backend=backend)(v, x))(xb)
        except Exception as error:  # noqa: BLE001 -- reported below
            outcome["b"] = error
        b_done.set()

    workers = [threading.Thread(target=a), threading.Thread(target=b)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    if isinstance(outcome["b"], tg.BackendCannotRun):  # a backend that runs no transforms
        assert backend in ("graph", "structured")
    else:
        assert isinstance(outcome["b"], Tensor), outcome["b"]
        torch.testing.assert_close(outcome["b"], expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(outcome["a"], dense_gramian(f_a, (w, xa)).shaped(),
                               rtol=1e-10, atol=1e-12)


def test_a_callers_dual_level_is_seen_while_other_threads_call() -> None:
    """The second review of session 66: with the forward-mode lock *tried*, any other thread's
    call holding it for an instant made the caller's own dual level look closed, and dual
    parameters were accepted with their tangent dropped (329 of 3917 calls) where one thread
    alone refuses them every time. The level is now the caller's unless another thread's
    forward-mode pass is marked as running."""
    torch.manual_seed(0)
    params = {"w": torch.randn(3, 4, dtype=torch.float64)}
    x = torch.randn(4, 3, dtype=torch.float64)
    stop = threading.Event()

    def other() -> None:
        while not stop.is_set():
            tg.gramian(lambda p, x: (x @ p["w"]).sin().sum(-1), backend="jacobian",
                       batch_dim=0)(params, x)

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    accepted = 0
    try:
        for _ in range(300):
            with torch.autograd.forward_ad.dual_level():
                dual = {"w": torch.autograd.forward_ad.make_dual(params["w"],
                                                                 torch.ones_like(params["w"]))}
                try:
                    tg.gramian(lambda p, x: torch.tanh(x @ p["w"]).sum(-1), batch_dim=0)(
                        dual, x)
                    accepted += 1
                except NotImplementedError:
                    pass
    finally:
        stop.set()
        thread.join(timeout=60.0)
    assert accepted == 0, f"{accepted} of 300 calls dropped the tangent of their dual parameters"


def test_nested_calls_in_two_threads_one_in_forward_mode_do_not_deadlock() -> None:
    """The review of session 66: every call reading the forward-mode level under
    FORWARD_AD_LOCK (waiting for it) deadlocked with an ntvp pass whose f makes a nested call
    (4 of 4 runs of 150 calls): thread A's pass holds the forward-mode lock and its nested
    call waits for the random state's lock, which thread B's first evaluation holds while its
    own nested call waits for the forward-mode lock. The lock is tried now, not waited for."""
    torch.manual_seed(0)
    w, x = torch.randn(3, 2, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)

    def f(w: Tensor, x: Tensor) -> Tensor:
        inner = tg.gramian(lambda q, z: (z @ q).sum(-1), backend="jacobian")(
            torch.ones(3, dtype=torch.float64), x.detach())
        return torch.tanh(x @ w).sum(-1) * (1 + 0 * inner.sum())

    expected = dense_gramian(f, (w, x)).shaped()
    errors: list[float] = []

    def worker(backend: str) -> None:
        for _ in range(100):
            clear_caches()  # as the review ran it: every call probes afresh
            errors.append(float((tg.gramian(f, backend=backend)(w, x) - expected).abs().max()))

    workers = [threading.Thread(target=worker, args=(backend,), daemon=True)
               for backend in ("ntvp", "jacobian")]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join(timeout=120.0)
    assert not any(thread.is_alive() for thread in workers), "deadlocked"
    assert len(errors) == 200 and max(errors) < 1e-10


@pytest.mark.parametrize("context", [threads.math_attention, differentiable_evaluation],
                         ids=["math_attention", "differentiable_evaluation"])
def test_math_attention_restores_the_flags_whatever_the_interleaving(
        context: Callable[[], AbstractContextManager[None]]) -> None:
    """Two threads in, the first out, the second out: the flags as before either.

    ``differentiable_evaluation`` (every evaluation of ``f`` under a transform or with
    create-graph) set them with its own ``sdpa_kernel`` and left flash attention off for the
    process (session 26's concurrency property, jacobian backend)."""
    flash = torch.backends.cuda.flash_sdp_enabled()
    entered = threading.Barrier(2)
    left = threading.Event()
    seen: list[bool] = []

    def first() -> None:
        with context():
            entered.wait()
            left.wait()  # leaves after the second thread entered
            seen.append(torch.backends.cuda.flash_sdp_enabled())

    def second() -> None:
        entered.wait()
        with context():
            left.set()
            time.sleep(0.05)
        seen.append(torch.backends.cuda.flash_sdp_enabled())

    workers = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    assert torch.backends.cuda.flash_sdp_enabled() == flash
    assert False in seen  # math only while someone was inside


class Interrupt(BaseException):
    """Like ``KeyboardInterrupt``: nothing on the way may catch it."""


@pytest.mark.parametrize("backend", ["ntvp", "structured"])
def test_math_attention_is_released_on_interrupt(backend: str) -> None:
    flash = torch.backends.cuda.flash_sdp_enabled()

    def f(w: Tensor, x: Tensor) -> Tensor:
        if not torch.backends.cuda.flash_sdp_enabled():  # inside the math-attention pass
            raise Interrupt
        q = x @ w + w[:, 0]  # w[:, 0]: a use no rule knows, so structured runs f under vmap
        return F.scaled_dot_product_attention(q, q, q).sum((1, 2))

    with pytest.raises(Interrupt):
        tg.gramian(f, backend=backend, batch_dim=0)(torch.randn(3, 3), torch.randn(2, 4, 3))
    assert torch.backends.cuda.flash_sdp_enabled() == flash
    assert torch.autograd.forward_ad._current_level == -1


_local = threading.local()


def _unwrapped(t: Tensor) -> Tensor:
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


@pytest.mark.parametrize("backend", ["auto", "graph", "structured"])  # jacobian, ntvp refuse
def test_random_functions_from_threads_each_see_one_draw(backend: str) -> None:
    """Dropout in f, four threads: every evaluation of a call sees the same masks (the
    generators are process-wide: NOTE [threads]), and G is the Gramian of that draw."""
    torch.manual_seed(0)
    params = {"w": torch.randn(5, 8, dtype=torch.float64),
              "v": torch.randn(8, 3, dtype=torch.float64)}

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        d1 = F.dropout(torch.tanh(x @ p["w"]), 0.5)
        time.sleep(1e-3)  # let other threads run between two draws
        d2 = F.dropout(d1, 0.5)
        _local.masks.append((_unwrapped(d1) != 0, _unwrapped(d2) != 0))
        return d2 @ p["v"]

    inputs = [torch.randn(6, 5, dtype=torch.float64) for _ in range(THREADS)]
    failures: list[str] = []

    def worker(index: int) -> None:
        _local.masks = []
        for call in range(8):
            _local.masks.clear()
            G = tg.gramian(f, backend=backend)(params, inputs[index])
            first = _local.masks[0]
            if any(not (torch.equal(m[0], first[0]) and torch.equal(m[1], first[1]))
                   for m in _local.masks):
                failures.append(f"call {call} of thread {index}: evaluations saw other draws")
                continue
            scale = first[0].to(torch.float64) * first[1].to(torch.float64) * 4

            def masked(p: dict[str, Tensor], x: Tensor, scale: Tensor = scale) -> Tensor:
                return (torch.tanh(x @ p["w"]) * scale) @ p["v"]

            expected = dense_gramian(masked, (params, inputs[index])).shaped()
            if not torch.allclose(G, expected, rtol=1e-10, atol=1e-12):
                failures.append(f"call {call} of thread {index}: not that draw's Gramian")

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    assert not failures, failures[:3]


def test_a_call_of_a_function_without_random_ops_leaves_the_generator_alone() -> None:
    """Another thread's draws are not rewound by a call that draws nothing (NOTE [threads])."""
    w = torch.randn(3, 2)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    torch.rand(5)  # as if another thread drew while the call ran
    advanced = torch.get_rng_state()
    draw = problem_module.Draw(RngState.capture([]))
    draw.start = RngState(state, ())  # the call began before that draw
    draw.end = RngState(state, ())  # and f drew nothing
    draw.finish()
    assert torch.equal(torch.get_rng_state(), advanced)
    assert tg.gramian(lambda w, x: torch.tanh(x @ w))(w, torch.randn(4, 3)).shape == (4, 2, 4, 2)
