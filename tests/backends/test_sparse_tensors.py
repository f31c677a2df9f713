"""Sparse (COO, CSR) and meta tensors in a call: the oracle's matrix or a torchgram error.

Session 35's sweep found torch's raw errors from every backend for sparse inputs of ``f``
(``x @ w``, ``torch.sparse.mm(x, w)``), split or not, and for sparse parameters on the graph
walk; and raw errors for meta inputs, sparse or meta Gramians and kernels, sparse outputs of
the eager API. NOTE [sparse inputs], NOTE [sparse tensors in f].
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import torchgram as tg
from reference import dense_cross_kernel, dense_gramian

BACKENDS = ["auto", "jacobian", "ntvp", "graph", "structured"]
LAYOUTS = {"coo": Tensor.to_sparse, "csr": Tensor.to_sparse_csr}

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")


def _matmul(w: Tensor, x: Tensor) -> Tensor:
    return torch.tanh(x @ w).sum(1)


def _sparse_mm(w: Tensor, x: Tensor) -> Tensor:
    return torch.tanh(torch.sparse.mm(x, w)).sum(1)


FUNCTIONS = {"matmul": _matmul, "sparse_mm": _sparse_mm}


def _data() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(6, 4, generator=generator, dtype=torch.float64)
    x = torch.randn(8, 6, generator=generator, dtype=torch.float64)
    return w, x.masked_fill(x.abs() < 0.8, 0.0)


def _oracle() -> Tensor:
    w, x = _data()
    return dense_gramian(_matmul, (w, x)).gramian


def _answer_or_alternatives(f: Callable[..., Tensor], backend: str, batch_dim: int | None,
                            *args: Tensor, named: bool = True, depth: int = 0) -> list[Tensor]:
    """The Gramian, or the Gramians of the backends a refusal names (``named``: at least one;
    a named backend answers, it does not refuse in turn)."""
    try:
        return [tg.gramian(f, backend=backend, batch_dim=batch_dim)(*args)]
    except tg.BackendCannotRun as error:
        assert depth == 0, f"{backend}, named by a refusal, refused: {error}"
        assert not named or error.alternatives, str(error)
        assert str(error).startswith("torchgram.gramian: expected ")
        return [G for alternative in error.alternatives
                for G in _answer_or_alternatives(f, alternative, batch_dim, *args,
                                                 depth=depth + 1)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("function", FUNCTIONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_unbatched_sparse_input(backend: str, function: str, layout: str) -> None:
    """Not split per sample: the oracle's matrix, or a refusal naming a backend that gives it;
    ``auto`` finds one."""
    w, x = _data()
    answers = _answer_or_alternatives(FUNCTIONS[function], backend, None, w,
                                      LAYOUTS[layout](x))
    for G in answers:
        torch.testing.assert_close(G, _oracle(), rtol=1e-10, atol=1e-10)
    if backend == "auto":
        assert len(answers) == 1


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_sparse_input_is_refused_before_any_evaluation(backend: str,
                                                               layout: str) -> None:
    w, x = _data()
    calls = []

    def f(w: Tensor, x: Tensor) -> Tensor:
        calls.append(1)
        return _matmul(w, x)

    with pytest.raises(TypeError, match=r"^torchgram\.gramian: expected batched inputs in the "
                                        rf"strided \(dense\) layout .*torch\.sparse_{layout}"
                                        r".*x\.to_dense\(\)"):
        tg.gramian(f, backend=backend, batch_dim=0)(w, LAYOUTS[layout](x))
    assert not calls


@pytest.mark.parametrize("batch_dim", [0, None], ids=["per-sample", "dense"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_parameter(backend: str, layout: str, batch_dim: int | None) -> None:
    """The Gramian over every entry of a sparse parameter (as autograd's densified gradient),
    or a torchgram refusal (it names no backend: which can depends on how f uses it);
    ``auto`` answers."""
    w, x = _data()
    answers = _answer_or_alternatives(_matmul, backend, batch_dim, LAYOUTS[layout](w), x,
                                      named=False)
    for G in answers:
        torch.testing.assert_close(G, _oracle(), rtol=1e-10, atol=1e-10)
    if backend == "auto":
        assert len(answers) == 1


@pytest.mark.parametrize("use", ["densified", "transposed", "scaled"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_parameter_used_otherwise(backend: str, layout: str, use: str) -> None:
    """Uses of a sparse parameter no backend may take (session 35's review: a refusal named
    ``structured``, which refused too; ``auto`` ended in an internal AssertionError after a
    dense call of the same shapes): the oracle's matrix or a torchgram error, whatever
    was called before."""
    w, x = _data()
    uses = {"densified": lambda p, v: torch.tanh(v @ p.to_dense()).sum(1),
            "transposed": lambda p, v: torch.tanh(F.linear(v, p.t())).sum(1),
            "scaled": lambda p, v: torch.tanh(v @ (2 * p)).sum(1)}
    f = uses[use]
    expected = dense_gramian(f, (w, x)).gramian  # to_dense() of a dense tensor is itself
    transform = tg.gramian(f, backend=backend, batch_dim=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            transform(w, x)  # a dense call first: it fills the caches
        except tg.BackendCannotRun:
            pass
    try:
        G = transform(LAYOUTS[layout](w), x)
    except (tg.BackendCannotRun, TypeError, ValueError) as error:
        assert str(error).startswith("torchgram.gramian: expected "), str(error)
        return
    torch.testing.assert_close(G, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_call_after_a_dense_one(backend: str) -> None:
    """The review's reproduction: CSR parameters and inputs (``x @ w`` of two CSR matrices is
    not even a valid ``f``) after a dense call of the same shapes: a torchgram error or torch's
    own error of ``f``, never an internal one (``auto`` ended in "unreachable": the probe of
    the dense call was reused, its key had no layout)."""
    w, x = _data()
    with pytest.raises(RuntimeError) as plain:  # the user's own call of f
        _matmul(w.to_sparse_csr(), x.to_sparse_csr())
    transform = tg.gramian(_matmul, backend=backend)
    transform(w, x)
    with pytest.raises(Exception) as raised:  # noqa: PT011 -- which one is the point
        transform(w.to_sparse_csr(), x.to_sparse_csr())
    message = str(raised.value)
    assert not isinstance(raised.value, AssertionError), message
    assert message.startswith("torchgram.gramian: expected ") or message == str(plain.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_meta_input_is_refused(backend: str) -> None:
    w, x = _data()
    with pytest.raises(ValueError, match=r"^torchgram\.gramian: expected inputs with values, "
                                         r"but got a tensor of shape \(8, 6\) on the meta"):
        tg.gramian(_matmul, backend=backend, batch_dim=0)(w, x.to("meta"))


@pytest.mark.parametrize("x2", ["cross", "none"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", ["auto", "jacobian", "ntvp", "structured"])
def test_kernel_of_unbatched_sparse_inputs(backend: str, layout: str, x2: str) -> None:
    """``tg.ntk`` kernels (``vmap_axes=None``): the oracle's kernel, or a torchgram error whose
    named backends give it (a cross kernel has no graph walk: CSR inputs there must be dense);
    ``auto`` answers for COO inputs."""
    w, x = _data()
    sparse = LAYOUTS[layout](x)
    first, second = (LAYOUTS[layout](x[:3]), sparse) if x2 == "cross" else (sparse, None)
    expected = dense_cross_kernel(lambda p, v: torch.tanh(v @ p), w, x[:3] if x2 == "cross"
                                  else x, x if x2 == "cross" else None)

    def kernel(name: str) -> Tensor:
        ntk_fn = tg.ntk.empirical_ntk_fn(lambda p, v: torch.tanh(v @ p), trace_axes=(),
                                         vmap_axes=None, backend=name)
        return ntk_fn(first, second, w)

    try:
        answers = [kernel(backend)]
    except tg.BackendCannotRun as error:
        assert str(error).startswith("torchgram.ntk.empirical_ntk_fn: expected ")
        if backend == "auto" and layout == "coo":
            raise
        if x2 == "none" and backend != "auto":  # one input set: the graph walk takes it
            assert error.alternatives == ("graph",), str(error)
        answers = [kernel(name) for name in error.alternatives if backend != "auto"]
    for K in answers:
        torch.testing.assert_close(K, expected, rtol=1e-10, atol=1e-10)


# -- the eager API -------------------------------------------------------------------------------


def _eager(w: Tensor, x: Tensor) -> Tensor:
    return _matmul(w, x)


@pytest.mark.parametrize("batch_dim", [0, None], ids=["per-sample", "dense"])
def test_eager_sparse_output_is_refused(batch_dim: int | None) -> None:
    w, x = _data()
    w.requires_grad_()
    with pytest.raises(TypeError, match=r"^torchgram\.autograd\.gramian: expected dense "
                                        r"outputs .*torch\.sparse_coo.*to_dense"):
        tg.autograd.gramian(_eager(w, x).to_sparse(), [w], batch_dim=batch_dim)


@pytest.mark.parametrize("batch_dim", [0, None], ids=["per-sample", "dense"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_eager_sparse_parameter(layout: str, batch_dim: int | None) -> None:
    """Recorded: the oracle's matrix; walked: a torchgram error naming the recording."""
    w, x = _data()
    sparse = LAYOUTS[layout](w).requires_grad_()
    with tg.autograd.record():
        recorded = _eager(sparse, x)
    G = tg.autograd.gramian(recorded, [sparse], batch_dim=batch_dim)
    torch.testing.assert_close(G, _oracle(), rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match=r"^torchgram\.autograd\.gramian: expected inputs the "
                                         r"graph walk can view .*tg\.autograd\.record\(\)"):
        tg.autograd.gramian(_eager(sparse, x), [sparse], batch_dim=batch_dim)


# -- kernels' predictions ------------------------------------------------------------------------


def _kernels() -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    a = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    return a @ a.T, torch.randn(3, 4, generator=generator, dtype=torch.float64), \
        torch.randn(4, 2, generator=generator, dtype=torch.float64)


PREDICTIONS = {
    "kernel_regression": lambda k, kt, y: tg.ntk.kernel_regression(k, kt, y),
    "gradient_descent_mse": lambda k, kt, y: tg.ntk.gradient_descent_mse(k, y)(
        1.0, fx_test_0=0.0, k_test_train=kt),
}


@pytest.mark.parametrize("argument", [0, 1, 2], ids=["k_train_train", "k_test_train",
                                                      "y_train"])
@pytest.mark.parametrize("kind", ["coo", "csr", "meta"])
@pytest.mark.parametrize("api", PREDICTIONS)
def test_prediction_refuses_sparse_and_meta_tensors(api: str, kind: str, argument: int) -> None:
    tensors = list(_kernels())
    tensors[argument] = (tensors[argument].to("meta") if kind == "meta"
                         else LAYOUTS[kind](tensors[argument]))
    name = ("k_train_train", "k_test_train", "y_train")[argument]
    message = (rf"expected {name} with values, .* meta device" if kind == "meta" else
               rf"expected {name} to be a dense tensor .*layout torch\.sparse_{kind}")
    with pytest.raises((TypeError, ValueError), match=rf"^torchgram\.ntk\.{api}: {message}"):
        PREDICTIONS[api](*tensors)


def test_prediction_refuses_tensors_on_another_device() -> None:
    """The device check itself (a second real device is not at hand on CPU-only CI)."""
    from torchgram.ntk.predict import _check_tensor

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=r"^api: expected y_train on k_train_train's device "
                                             r"\(meta\), but got a tensor on cpu\. Move it "
                                             r"first: y_train\.to\('meta'\)"):
            _check_tensor("api", "y_train", torch.ones(2), torch.device("meta"))
