"""Determinants of exactly singular matrices, refused in torchgram's evaluations of ``f``.

# NOTE [singular determinants]
The derivative of ``det`` is the transposed adjugate, which is not zero at a singular matrix
of rank ``n - 1``. torch 2.13 gets it wrong there, differently on each path (session 54, by
hand after the OpInfo scan): at ``[[1, 2], [2, 4]]`` (or ``diag(0, 1, 1)``), whose
determinant LU computes as exactly ``0``, the plain backward gives ``0`` instead of
``[[4, -2], [-2, 1]]`` (and so the dense oracle, the structured backend and the graph walk,
without a word), forward mode gives ``0`` (ntvp), and only ``vmap``'s batched backward (the
jacobian backend) is right; at a ``1 × 1`` zero only forward mode is wrong. The log-
determinants' backwards raise a raw ``linalg.solve`` error at such matrices. No backend can
be trusted there, so when the probe sees ``f`` compute a determinant (``Probe.decomposed``
lists it), every later evaluation runs under :class:`SingularDeterminantsRefused`: a call of
``det``, ``slogdet`` or ``logdet`` whose result says an input matrix is exactly singular
(``det == 0``, or ``slogdet``'s sign ``0``) raises :class:`SingularDeterminant`, which every
API turns into a torchgram ``ValueError`` (``derivative_faults_refused``). Matrices of
rank below ``n - 1`` (a zero matrix: derivative ``0``, which torch gets right) are refused
too: telling the ranks apart exactly is what LU cannot do. A determinant that is merely
tiny (a numerically singular matrix) is differentiated as usual, by the inverse, and torch's
paths agree there. Values that cannot be read (inside the caller's or a backend's ``vmap``)
are not checked: the plain evaluations of the same call are (every backend makes one).
Evaluations under a cached probe that did not see a determinant and then meet one start
over (NOTE [stale probes]). On graphs built outside these evaluations (``tg.autograd``), the
walk reads what the determinant's node saved (:func:`check_determinant_node`): its result
(``det``) or sign (``slogdet``, which ``logdet`` goes through).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode, resolve_name

from torchgram._core.errors import DerivativeFault

DETERMINANT = "a determinant"
"""The name under which probes record that ``f`` computes a determinant."""

_DETERMINANTS = frozenset({torch.linalg.det, torch.det, Tensor.det, torch.logdet, Tensor.logdet})
_SIGNED_LOG_DETERMINANTS = frozenset({torch.linalg.slogdet, torch.slogdet, Tensor.slogdet})


_SAVED_DETERMINANTS = {"LinalgDetBackward0": "_saved_result",
                       "LinalgSlogdetBackward0": "_saved_sign"}
"""The nodes of the determinants, and the saved value that is zero at a singular matrix."""

DETERMINANT_NODES = frozenset(_SAVED_DETERMINANTS)
"""The names of the determinants' autograd nodes."""


def check_determinant_node(node: Any, name: str) -> None:
    """Refuse ``node`` (named ``name``) if it is a determinant's at a singular matrix.

    Raises :class:`SingularDeterminant` where the value it saved is zero (NOTE [singular
    determinants]); other nodes pass unread.

    Example:
        >>> X = torch.tensor([[1.0, 2.0], [2.0, 4.0]], requires_grad=True)
        >>> node = torch.linalg.det(X).grad_fn
        >>> check_determinant_node(node, node.name())
        Traceback (most recent call last):
        ...
        torchgram._core.determinants.SingularDeterminant: torch.linalg.det (LinalgDetBackward0)
    """
    saved = _SAVED_DETERMINANTS.get(name)
    if saved is None:
        return
    value = getattr(node, saved, None)
    if isinstance(value, Tensor) and bool((value == 0).any()):
        what = "torch.linalg.det" if name == "LinalgDetBackward0" else "torch.linalg.slogdet"
        raise SingularDeterminant(f"{what} ({name})")


def computes_determinant(func: Any) -> bool:
    """Whether ``func`` is one of torch's determinants.

    Example:
        >>> computes_determinant(torch.linalg.det), computes_determinant(torch.inverse)
        (True, False)
    """
    try:
        return func in _DETERMINANTS or func in _SIGNED_LOG_DETERMINANTS
    except TypeError:  # unhashable callables
        return False


class SingularDeterminant(DerivativeFault):
    """A determinant of an exactly singular matrix (NOTE [singular determinants])."""

    expected = ("determinants of matrices that are not exactly singular (torch 2.13 "
                "differentiates a determinant at an exactly singular matrix wrongly, differently "
                "in each mode: NOTE [singular determinants])")
    got = "{call} of an exactly singular matrix"
    fix = ("Move the matrix off singularity (e.g. add a small multiple of the identity), or "
           "compute what you need without the determinant there.")


class SingularDeterminantsRefused(TorchFunctionMode):
    """Raises :class:`SingularDeterminant` at a determinant of an exactly singular matrix.

    See NOTE [singular determinants]; every other call runs unchanged.

    Example:
        >>> with SingularDeterminantsRefused():
        ...     torch.linalg.det(torch.tensor([[1.0, 2.0], [2.0, 4.0]]))
        Traceback (most recent call last):
        ...
        torchgram._core.determinants.SingularDeterminant: torch.linalg.det
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if computes_determinant(func) and _singular(func, result):
            raise SingularDeterminant(resolve_name(func) or "a determinant")
        return result


def _singular(func: Any, result: Any) -> bool:
    """Whether a determinant's ``result`` says some input matrix is exactly singular."""
    zero = result[0] if func in _SIGNED_LOG_DETERMINANTS else result  # slogdet's sign
    if func in (torch.logdet, Tensor.logdet):
        zero = torch.exp(result)  # -inf at a singular matrix
    try:
        return bool((zero == 0).any())
    except RuntimeError:  # a value that cannot be read under vmap: see the NOTE
        return False
