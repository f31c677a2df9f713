"""The scratch memory of eager calls (NOTE [scratch memory]): reused, never overwritten live."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import torchgram as tg
from reference import dense_gramian
from torchgram._core import scratch as scratch_module
from torchgram._core.scratch import (
    Scratch,
    current_scratch,
    kept_bytes,
    release_scratch,
    scratch_for,
    scratch_scope,
)

CPU = torch.device("cpu")
DOUBLE = torch.float64


def test_buffer_grows_to_what_a_scope_asked_for_and_is_reused() -> None:
    scratch = Scratch()
    first = scratch.take((8, 8), torch.float32, CPU)  # no buffer yet: a fresh tensor
    scratch.end()
    a = scratch.take((8, 8), torch.float32, CPU)
    assert a.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    scratch.end()
    b = scratch.take((8, 8), torch.float32, CPU)  # the same place in the next scope
    assert b.data_ptr() == a.data_ptr()


def test_loans_of_one_scope_do_not_overlap() -> None:
    scratch = Scratch()
    for _ in range(2):
        loans = [scratch.take((n, 3), torch.float64, CPU) for n in (5, 1, 7)]
        for value, loan in enumerate(loans):
            loan.fill_(value)
        assert [float(loan.unique()) for loan in loans] == [0.0, 1.0, 2.0]
        scratch.end()


def test_a_loan_given_back_makes_room_for_the_next() -> None:
    """Transient loans (a Gram's Jacobian, dropped at once) take one place: the buffer grows to
    the most held at once, not to their sum."""
    scratch = Scratch()
    for _ in range(2):
        kept = scratch.take((16,), torch.float32, CPU)
        for _ in range(3):
            scratch.give_back(scratch.take((64,), torch.float32, CPU))
        scratch.end()
    assert scratch._buffer is not None and scratch._buffer.numel() == 64 + 256
    kept = scratch.take((16,), torch.float32, CPU)
    first = scratch.take((64,), torch.float32, CPU)
    scratch.give_back(first)
    second = scratch.take((64,), torch.float32, CPU)
    assert second.data_ptr() == first.data_ptr() != kept.data_ptr()


def test_nothing_above_the_limit_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scratch_module, "SCRATCH_LIMIT_BYTES", 1024)
    scratch = Scratch()
    scratch.take((512,), torch.float32, CPU)  # 2 KiB: above the limit
    scratch.end()
    a = scratch.take((512,), torch.float32, CPU)
    b = scratch.take((512,), torch.float32, CPU)
    assert a.data_ptr() != b.data_ptr()  # both fresh


def test_the_limit_holds_for_all_threads_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many threads calling torchgram keep at most the limit between them, not each."""
    import gc

    monkeypatch.setattr(scratch_module, "SCRATCH_LIMIT_BYTES", kept_bytes() + 1024)
    first, second = Scratch(), Scratch()
    first.take((192,), torch.float32, CPU)  # 768 bytes
    first.end()
    second.take((128,), torch.float32, CPU)  # 512 more: over the limit, not kept
    second.end()
    assert second._buffer is None and first._buffer is not None
    first.release()
    second.take((128,), torch.float32, CPU)
    second.end()
    assert second._buffer is not None and second._buffer.numel() == 512
    before = kept_bytes()
    del second
    gc.collect()
    assert kept_bytes() == before - 512  # a thread's buffer goes with it


def test_a_scope_inside_a_scope_gets_none() -> None:
    with scratch_scope() as outer:
        assert outer is not None and current_scratch() is outer
        with scratch_scope() as inner:
            assert inner is None and current_scratch() is None
        assert current_scratch() is outer
    assert current_scratch() is None
    release_scratch()


def test_a_call_inside_a_call_leaves_the_outer_loans_alone() -> None:
    """The outer scope's loans survive a nested call (which ends its own scope) and the outer
    scope's later loans: none of them overlap."""
    with scratch_scope() as warm:  # a buffer for the scopes below
        assert warm is not None
        warm.take((64,), DOUBLE, CPU)
        warm.take((64,), DOUBLE, CPU)
    with scratch_scope() as outer:
        assert outer is not None
        first = outer.take((64,), DOUBLE, CPU).fill_(1.0)
        with scratch_scope() as inner:  # e.g. a weighting calling torchgram
            assert inner is None
        second = outer.take((64,), DOUBLE, CPU).fill_(2.0)
        assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
        assert bool((first == 1.0).all()) and bool((second == 2.0).all())
    release_scratch()


class _Subclass(Tensor):
    pass


def test_scratch_only_for_plain_untracked_operands() -> None:
    """``out=`` products are not differentiable nor batched: tracked operands, tensor
    subclasses and mixed dtypes get no scratch; plain ones do, inside a scope only."""
    plain = torch.ones(2, 2)
    assert scratch_for(plain, plain) is None  # outside a scope
    with scratch_scope() as scratch:
        assert scratch_for(plain, plain) is scratch
        assert scratch_for(plain, torch.ones(2, 2, requires_grad=True)) is None
        assert scratch_for(plain, plain.double()) is None
        assert scratch_for(plain, plain.as_subclass(_Subclass)) is None
        seen = torch.func.vmap(lambda row: torch.tensor(scratch_for(row, row) is None))(plain)
        assert bool(seen.all())
    release_scratch()


class _Positions(nn.Module):
    """Linear layers at eight positions: their per-sample Jacobians are formed (and kept for
    ``Jᵀw``), the temporaries the scratch holds."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 16)
        self.second = nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:  # x [B, 8, 6] -> [B]
        return self.second(torch.tanh(self.first(x))).square().sum((1, 2))


def _model_and_input(seed: int) -> tuple[nn.Module, Tensor]:
    torch.manual_seed(seed)
    return _Positions().double(), torch.randn(5, 8, 6, dtype=DOUBLE)


def _oracle(model: nn.Module, x: Tensor) -> Tensor:
    params = dict(model.named_parameters())
    return dense_gramian(lambda p: torch.func.functional_call(model, p, (x,)), (params,)).gramian


def _recorded_gramian(model: nn.Module, x: Tensor) -> Tensor:
    with tg.autograd.record():
        out = model(x)
    return tg.autograd.gramian(out, list(model.parameters()), batch_dim=0)


def test_results_do_not_share_the_scratch() -> None:
    """A result of one call is unchanged by the next (it is not a view of the buffer)."""
    (model, x), (other, y) = _model_and_input(0), _model_and_input(1)
    first = _recorded_gramian(model, x)
    kept = first.clone()
    for _ in range(3):
        _recorded_gramian(other, y)
    assert torch.equal(first, kept)
    torch.testing.assert_close(first, _oracle(model, x), rtol=1e-10, atol=1e-12)


def test_a_weighting_that_calls_torchgram_overwrites_nothing() -> None:
    """``tg.autograd.backward`` keeps per-sample Jacobians for ``Jᵀw`` in its scratch while the
    weighting runs; a Gramian computed inside the weighting must neither read nor overwrite
    them: both the inner Gramian and the step are exact."""
    (model, x), (other, y) = _model_and_input(0), _model_and_input(1)
    inner: list[Tensor] = []

    def weighting(gramian: Tensor) -> Tensor:
        inner.append(_recorded_gramian(other, y))  # a call inside the call
        return tg.weighting.upgrad(gramian)

    params = list(model.parameters())
    for _ in range(2):  # the first call makes the thread's buffer, the second lends it
        model.zero_grad(set_to_none=True)
        with tg.autograd.record():
            out = model(x)
        w = tg.autograd.backward(out, params, weighting, batch_dim=0, retain_graph=True)
        torch.testing.assert_close(inner[-1], _oracle(other, y), rtol=1e-10, atol=1e-12)
        expected = torch.autograd.grad(out, params, w)
        for p, g in zip(params, expected, strict=True):
            torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-12)


def test_threads_have_their_own_scratch() -> None:
    cases = [_model_and_input(seed) for seed in range(4)]
    expected = [_oracle(model, x) for model, x in cases]
    results: dict[int, list[Tensor]] = {}
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            model, x = cases[index]
            results[index] = [_recorded_gramian(model, x) for _ in range(5)]
        except BaseException as error:  # noqa: BLE001 -- reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for index, gramians in results.items():
        for gramian in gramians:
            torch.testing.assert_close(gramian, expected[index], rtol=1e-10, atol=1e-12)


def test_aggregated_grad_with_a_nested_call_in_its_weighting() -> None:
    """``tg.aggregated_grad`` keeps per-sample Jacobians in its scratch for ``Jᵀw``; a kernel
    computed inside its weighting leaves them alone, and the update is the weighted gradient
    (twice: the second call lends the buffer the first one made)."""
    (model, x), (other, y) = _model_and_input(0), _model_and_input(1)
    fn, params = tg.functionalize(model)
    other_fn, other_params = tg.functionalize(other)
    inner: list[Tensor] = []

    def weighting(gramian: Tensor) -> Tensor:
        inner.append(tg.gramian(other_fn, batch_dim=0)(other_params, y))
        return tg.weighting.upgrad(gramian)

    step = tg.aggregated_grad(fn, weighting, batch_dim=0)
    for _ in range(2):
        update, info = step(params, x)
        torch.testing.assert_close(inner[-1], _oracle(other, y), rtol=1e-10, atol=1e-12)
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        out = torch.func.functional_call(model, leaves, (x,))
        expected = torch.autograd.grad(out, list(leaves.values()), info.weights)
        for name, grad in zip(leaves, expected, strict=True):
            torch.testing.assert_close(update[name], grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk_bytes", [None, 256], ids=["whole", "column-chunks"])
def test_gramian_calls_reuse_the_scratch_exactly(chunk_bytes: int | None,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``tg.gramian`` forms its materialized Jacobians (whole, or by column chunks, NOTE [Gram
    by column chunks], each ending the previous one) in the scratch: exact on every call."""
    from torchgram.backends.structured import contraction

    chunked_gram, takes = contraction.chunked_gram, []

    def spy(factors: Any, classes: int, diagonal: bool, max_bytes: int | None = None,
            workspace: Any = None) -> Tensor:
        takes.append(current_scratch() is not None and workspace is not None)
        return chunked_gram(factors, classes, diagonal, chunk_bytes or max_bytes, workspace)

    monkeypatch.setattr(contraction, "chunked_gram", spy)
    (model, x), (other, y) = _model_and_input(0), _model_and_input(1)
    fn, params = tg.functionalize(model)
    other_fn, other_params = tg.functionalize(other)
    gramian = tg.gramian(fn, batch_dim=0, backend="structured")
    other_gramian = tg.gramian(other_fn, batch_dim=0, backend="structured")
    expected, other_expected = _oracle(model, x), _oracle(other, y)
    for _ in range(3):
        torch.testing.assert_close(gramian(params, x), expected, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(other_gramian(other_params, y), other_expected, rtol=1e-10,
                                   atol=1e-12)
    assert takes and all(takes)
