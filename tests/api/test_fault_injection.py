"""An exception at every evaluation of ``f``, on every backend, leaves everything as it was.

``f`` is counted on a clean call; then, for each index ``k``, the ``k``-th evaluation of ``f``
raises (an ``Exception`` and a ``KeyboardInterrupt``). The call either lets it through or,
for an ``Exception`` a backend may answer by redoing the work another way (NOTE [vmap or
loop]), returns the right matrix. Afterwards no mode or transform is active, the switches
and generators are as they were, the module is intact, and the next call is right.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import torchgram as tg
from reference import dense_gramian

BACKENDS = ["jacobian", "ntvp", "graph", "structured", "auto"]
CONFIGS = {
    "dense": dict(chunk_size=2),
    "per_sample": dict(batch_dim=0, chunk_size=2),
    "diagonal_per_leaf": dict(batch_dim=0, diagonal=True, per_leaf=True),
}


class Injected(Exception):
    """The exception ``f`` raises on purpose."""


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 2)
        self.register_buffer("offset", torch.linspace(-1, 1, 4))

    def forward(self, x: Tensor) -> Tensor:
        h, _ = self.attn(x, x, x, need_weights=False)
        return self.head(self.norm(h + self.offset).mean(1))


def _process_state() -> dict[str, Any]:
    return {
        "modes": torch._C._len_torch_function_stack(),
        "transforms": torch._C._functorch.peek_interpreter_stack() is not None,
        "forward AD": torch.autograd.forward_ad._current_level,
        "grad": torch.is_grad_enabled(),
        "sdpa": (torch.backends.cuda.flash_sdp_enabled(),
                 torch.backends.cuda.mem_efficient_sdp_enabled(),
                 torch.backends.cuda.math_sdp_enabled()),
        "rng": torch.get_rng_state(),
    }


def _assert_same_state(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before.keys() == after.keys()
    for key, value in before.items():
        same = torch.equal(value, after[key]) if isinstance(value, Tensor) else value == after[key]
        assert same, f"{key}: {value} -> {after[key]}"


def _setup() -> tuple[nn.Module, Callable[..., Tensor], dict[str, Tensor], Tensor,
                      dict[str, int]]:
    torch.manual_seed(0)
    model = Model().double()
    fn, params = tg.functionalize(model)
    x = torch.randn(3, 2, 4, dtype=torch.float64)
    counter = {"calls": 0, "fail_at": -1, "kind": 0}

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        index = counter["calls"]
        counter["calls"] += 1
        if index == counter["fail_at"]:
            raise KeyboardInterrupt if counter["kind"] else Injected(f"evaluation {index}")
        return F.softplus(fn(p, x)).sum(-1)

    return model, f, params, x, counter


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_exception_at_every_evaluation_leaves_everything_as_it_was(backend: str,
                                                                   config: str) -> None:
    model, f, params, x, counter = _setup()
    options = CONFIGS[config]
    transform = tg.gramian(f, backend=backend, **options)
    oracle = dense_gramian(f, (params, x))
    expected = oracle.shaped(diagonal=options.get("diagonal", False))
    module_state = {name: (t, t.detach().clone())
                    for name, t in model.state_dict(keep_vars=True).items()}

    def value(result: Any) -> Tensor:
        return torch.stack(list(result.values())).sum(0) if isinstance(result, dict) else result

    for _ in range(2):  # the second call is counted: the first also probes f (then cached)
        counter["calls"] = 0
        torch.testing.assert_close(value(transform(params, x)), expected)
    evaluations = counter["calls"]
    assert evaluations >= 1
    for kind in (0, 1):
        for index in range(evaluations):
            counter.update(calls=0, fail_at=index, kind=kind)
            before = _process_state()
            try:
                result = transform(params, x)
            except (Injected, KeyboardInterrupt) as error:
                assert isinstance(error, KeyboardInterrupt if kind else Injected)
            else:  # an Exception a backend answered another way (vmap -> loops)
                reached = counter["calls"] > index
                assert not (kind and reached), \
                    f"a KeyboardInterrupt at evaluation {index} was swallowed"
                torch.testing.assert_close(value(result), expected)
            _assert_same_state(before, _process_state())
            current = model.state_dict(keep_vars=True)
            for name, (tensor, saved) in module_state.items():
                assert current[name] is tensor, f"{name} replaced (evaluation {index})"
                assert torch.equal(tensor.detach(), saved), f"{name} changed"
            assert all(type(p) is nn.Parameter for p in model.parameters())
            counter["fail_at"] = -1  # the next call is right
            torch.testing.assert_close(value(transform(params, x)), expected)
