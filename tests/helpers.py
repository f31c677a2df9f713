"""The one way tests build a problem and read a backend's result (through the pipeline)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torchgram._core.options import Options
from torchgram._core.problem import Problem, build_problem
from torchgram._core.result import BackendResult
from torchgram._core.sink import assemble


def make_problem(f: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: Mapping[str, Any] | None = None, *, want_pullback: bool = False,
                 **options: Any) -> Problem:
    """The problem ``tg.gramian(f, **options)(*args, **kwargs)`` would build."""
    validated = Options.validate("test", f, **options)
    return build_problem(validated, f, tuple(args), kwargs or {}, want_pullback=want_pullback)


def flat_gramian(problem: Problem, result: BackendResult) -> torch.Tensor:
    """A backend's summed result as the sink assembles it: ``[m, m]`` (``[m]``), output order."""
    blocks = assemble(problem, result)
    return blocks[0] if len(blocks) == 1 else torch.stack(blocks).sum(0)


def assert_batched_on_every_draw(f: Callable[..., Any], params: Any, inputs: list[Any], *,
                                 backend: str, in_dims: int = 0) -> None:
    """``tg.gramian(f, batch_dim=0)`` on each input, seeded ``0, 1, …``, is the oracle's Gramian
    of that draw, and the structured backend runs the last one batched without fallback."""
    import torchgram as tg
    from reference import assert_oracle_of_the_draw

    gramian = tg.gramian(f, backend=backend, batch_dim=0, in_dims=in_dims)
    for seed, x in enumerate(inputs):
        assert_oracle_of_the_draw(f, (params, x), gramian, seed)
    torch.manual_seed(0)
    report = tg.explain(f, backend="structured", batch_dim=0, in_dims=in_dims,
                        run=True)(params, inputs[-1])
    assert report.fallback == ()
    assert report.ran is not None and report.ran.way == "batched", report.ran.notes


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """A gloo process group of one rank in this process (the distributed API's calls)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
