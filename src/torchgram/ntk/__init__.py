"""``torchgram.ntk``: neural-tangents' empirical-NTK API in PyTorch.

* :func:`empirical_ntk_fn` — ``ntk_fn(x1, x2, params, **kwargs)`` with neural-tangents'
  semantics, shapes and values: kernels between two input sets, ``trace_axes`` (the mean
  over each traced pair), ``diagonal_axes``, ``vmap_axes``; computed by torchgram's backends
  without concatenating the inputs, in tiles within a ``memory_budget``.
* :func:`gradient_descent_mse` — ``nt.predict.gradient_descent_mse``: the outputs of the
  linearized network trained by gradient flow on the mean squared error, at any time.
* :func:`kernel_regression` — ``K_test,train (K_train,train + ridge·I)⁻¹ y``.

Example:
    >>> import torch, torchgram as tg
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(),
    ...                             torch.nn.Linear(16, 2))
    >>> fn, params = tg.functionalize(model)
    >>> x_train, x_test, y_train = torch.randn(8, 3), torch.randn(4, 3), torch.randn(8, 2)
    >>> ntk_fn = tg.ntk.empirical_ntk_fn(fn)
    >>> k_train_train = ntk_fn(x_train, None, params)        # [8, 8]
    >>> k_test_train = ntk_fn(x_test, x_train, params)       # [4, 8]
    >>> predict_fn = tg.ntk.gradient_descent_mse(k_train_train, y_train, diag_reg=1e-4)
    >>> fx_train, fx_test = predict_fn(t=None, fx_train_0=0.0,
    ...                                fx_test_0=torch.zeros(4, 2), k_test_train=k_test_train)
    >>> fx_test.shape
    torch.Size([4, 2])
"""

from torchgram.ntk._empirical import EmpiricalNTK as EmpiricalNTK
from torchgram.ntk._empirical import KernelRun as KernelRun
from torchgram.ntk._empirical import empirical_ntk_fn as empirical_ntk_fn
from torchgram.ntk.predict import GradientDescentMSE as GradientDescentMSE
from torchgram.ntk.predict import gradient_descent_mse as gradient_descent_mse
from torchgram.ntk.predict import kernel_regression as kernel_regression

__all__ = [
    "EmpiricalNTK",
    "GradientDescentMSE",
    "KernelRun",
    "empirical_ntk_fn",
    "gradient_descent_mse",
    "kernel_regression",
]
