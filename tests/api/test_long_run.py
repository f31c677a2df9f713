"""A thousand calls: fresh closures, varying shapes, exceptions now and then.

Memory stays flat (live tensors and resident memory after a warm-up), the probe and trace
caches stay within their bounds, no mode or transform is left active and the
functionalized module is unchanged.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable

import torch
from torch import Tensor, nn

import torchgram as tg
from reference import dense_gramian
from torchgram._core import problem as problem_module
from torchgram.backends.structured import passes

BACKENDS = ["jacobian", "ntvp", "graph", "structured", "auto"]
CALLS = 1000
WARM_UP = 200
CHECKED_EVERY = 97  # calls compared with the oracle
RAISING_EVERY = 13  # calls whose f raises
MAX_GROWTH_MIB = 16.0


class Failure(Exception):
    """Raised by f on purpose."""


def _resident_mib() -> float | None:
    """Resident memory of this process (Linux ``/proc``), ``None`` where not available."""
    path = "/proc/self/statm"
    if not os.path.exists(path):
        return None
    with open(path) as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), Tensor))  # no __class__


def _make_call(index: int, fn: Callable[..., Tensor],
               params: dict[str, Tensor]) -> tuple[Callable[..., Tensor], tuple[Tensor, ...]]:
    """A fresh closure per call, with its own shapes; some raise at some evaluation."""
    generator = torch.Generator().manual_seed(index)
    batch, width = 2 + index % 4, 2 + index % 3
    scale = torch.rand((), generator=generator, dtype=torch.float64) + 0.5
    w = torch.randn(3, width, generator=generator, dtype=torch.float64)
    x = torch.randn(batch, 3, generator=generator, dtype=torch.float64)
    fail_at = index % 4 if index % RAISING_EVERY == 0 else -1
    evaluations = [0]

    def f(p: dict[str, Tensor], w: Tensor, x: Tensor) -> Tensor:
        evaluations[0] += 1
        if evaluations[0] > fail_at >= 0:
            raise Failure(f"call {index}")
        h = torch.tanh(x @ w) * scale
        return fn(p, h.sum(-1, keepdim=True).expand(-1, 4)).sum(-1) + (h ** 2).sum(-1)

    return f, (params, w, x)


def test_thousand_calls_leave_memory_caches_modes_and_module_as_they_were() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1)).double()
    fn, params = tg.functionalize(model)
    state = {name: (t, t.detach().clone()) for name, t in model.state_dict(keep_vars=True).items()}
    failures = answers = 0
    baseline: tuple[int, float | None] | None = None
    for index in range(CALLS):
        if index == WARM_UP:
            baseline = _live_tensors(), _resident_mib()
        f, args = _make_call(index, fn, params)
        backend = BACKENDS[index % len(BACKENDS)]
        options = dict(batch_dim=0) if index % 2 else {}
        try:
            G = tg.gramian(f, argnums=(0, 1), backend=backend, **options)(*args)
        except Failure:
            failures += 1
        else:
            answers += 1
            if index % CHECKED_EVERY == 0:
                expected = dense_gramian(f, args, argnums=(0, 1)).shaped()
                torch.testing.assert_close(G, expected)
        assert torch._C._len_torch_function_stack() == 0
        assert torch._C._functorch.peek_interpreter_stack() is None
        assert torch.autograd.forward_ad._current_level == -1
        del f, args
    # f raising at its first evaluation always fails the call; later ones may not be reached
    assert failures >= len(range(0, CALLS, 4 * RAISING_EVERY)) and answers + failures == CALLS
    assert baseline is not None
    tensors, resident = _live_tensors(), _resident_mib()
    print(f"{CALLS} calls ({answers} answered, {failures} raised on purpose); after the "
          f"warm-up: live tensors {baseline[0]} -> {tensors}, resident memory "
          f"{baseline[1] or 0:.1f} -> {resident or 0:.1f} MiB")  # shown by pytest -s
    assert tensors <= baseline[0] + 10, f"live tensors grew from {baseline[0]} to {tensors}"
    if resident is not None and baseline[1] is not None:
        assert resident - baseline[1] < MAX_GROWTH_MIB, \
            f"resident memory grew from {baseline[1]:.1f} to {resident:.1f} MiB"
    assert len(passes._TRACES) <= passes._TRACES.maxsize
    assert len(problem_module._PROBES) <= problem_module._PROBES.maxsize
    current = model.state_dict(keep_vars=True)
    for name, (tensor, value) in state.items():
        assert current[name] is tensor and torch.equal(tensor.detach(), value), name
    assert all(type(p) is nn.Parameter for p in model.parameters())
