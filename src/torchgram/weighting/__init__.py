"""Weightings: functions from the Gramian ``G = J Jᵀ`` of m losses to weights ``w`` of shape [m].

The update direction of Jacobian descent is ``Jᵀw``; since every method here only needs inner
products of the rows of ``J``, it only needs ``G``, as computed by :func:`torchgram.gramian`.
In a training loop, backpropagate ``w @ losses`` (``w`` held constant) to get ``Jᵀw``.

Every function takes the Gramian positionally and its options as keywords, validates it (square,
symmetric, finite, non-negative diagonal: one host synchronisation in all) and returns weights
with the Gramian's dtype and device, not differentiable with respect to the Gramian: where
``G`` carries a derivative (it requires grad, or has a forward-mode tangent), a derivative that
reaches the weights raises a torchgram error (pass ``G.detach()`` to hold them constant, as
Jacobian descent does; NOTE [weights are not differentiable]), and none runs under
``torch.func.vmap``. The
quadratic programs of :func:`upgrad`, :func:`dualproj` and :func:`mgda` are solved exactly (to
float64 round-off) by batched tensor code on that device: active-set methods whose face systems
are solved by batched Cholesky factorisations for small ``m`` and, for :func:`upgrad` and
:func:`dualproj` from ``m = 128`` (resp. 768), by batched conjugate gradients with every answer
certified by its KKT residual (``ρ ≤ 1e-13``; NOTE [KKT certificate] in ``_kkt.py``). They
synchronise with the host to decide convergence (once per few iterations). :func:`imtl_g` and
:func:`aligned_mtl` use Cholesky factorisations or ``torch.linalg.eigh``, which check for
convergence failures (a synchronisation on CUDA).

In a training loop, a :class:`WarmStart` passed as ``state=`` to :func:`upgrad`,
:func:`dualproj` or :func:`mgda` lets each call start from the previous call's solution.

Example:
    >>> import torch
    >>> import torchgram.weighting as weighting
    >>> J = torch.tensor([[1.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)
    >>> G = J @ J.T
    >>> direction = J.T @ weighting.upgrad(G)
    >>> bool((J @ direction >= 0).all())
    True
"""

from ._aligned_mtl import aligned_mtl as aligned_mtl
from ._dualproj import dualproj as dualproj
from ._imtl_g import imtl_g as imtl_g
from ._mean import mean as mean
from ._mgda import mgda as mgda
from ._pcgrad import pcgrad as pcgrad
from ._sum import sum as sum
from ._upgrad import upgrad as upgrad
from ._warm_start import WarmStart as WarmStart

__all__ = [
    "WarmStart",
    "aligned_mtl",
    "dualproj",
    "imtl_g",
    "mean",
    "mgda",
    "pcgrad",
    "sum",
    "upgrad",
]
