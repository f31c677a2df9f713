"""Calling a user's weighting ``G -> w``, checked the same way by every step API."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from torchgram._core import checks


def check_weighting(api: str, weighting: Any) -> None:
    """Reject what is not a weighting ``G -> w``, before any work.

    Not callable (its result passed by mistake); a class (``tg.weighting.WarmStart``
    without ``()``: torch's ``TypeError`` after four evaluations of ``f`` before session 59);
    a torchjd *aggregator* (``UPGrad()``), which maps a Jacobian ``[m, n]`` to a vector
    ``[n]``: given the square ``G`` it returns ``m`` numbers that are not weights, and the
    update was 2.5 to 17 times off without a word (session 59's hunt).

    Example:
        >>> import torchgram as tg
        >>> check_weighting("api", tg.weighting.upgrad)
        >>> try:
        ...     check_weighting("api", tg.weighting.WarmStart)
        ... except TypeError as error:
        ...     print(str(error).split(". ")[-1])
        Pass an instance: WarmStart().
    """
    if isinstance(weighting, type):
        checks.fail(api, "a weighting callable G -> w (a function such as "
                    "torchgram.weighting.upgrad, or an instance)",
                    f"the class {weighting.__name__}",
                    f"Pass an instance: {weighting.__name__}().", TypeError)
    aggregator = _torchjd_aggregator(weighting)
    if aggregator is not None:
        name = type(weighting).__name__
        counterpart = (f"torchjd.aggregation.{name}Weighting()" if hasattr(aggregator,
                                                                           f"{name}Weighting")
                       else "a torchjd Weighting")
        checks.fail(api, "a weighting G -> w (torchjd's Weighting objects are; its Aggregators "
                    "map a Jacobian to an update)", f"torchjd's aggregator {name}()",
                    f"Pass {counterpart}, or a torchgram.weighting function such as "
                    "torchgram.weighting.upgrad.", TypeError)
    if not callable(weighting):
        checks.fail(api, "a weighting callable G -> w (e.g. torchgram.weighting.upgrad)",
                    type(weighting).__name__, "Pass the function itself, not its result.",
                    TypeError)


def _torchjd_aggregator(weighting: Any) -> ModuleType | None:
    """``torchjd.aggregation`` if ``weighting`` is one of its aggregators, else ``None``."""
    for cls in type(weighting).__mro__:
        if cls.__name__ == "Aggregator" and cls.__module__.startswith("torchjd."):
            return sys.modules.get("torchjd.aggregation")
    return None


def call_weighting(api: str, weighting: Callable[[Tensor], Tensor], matrix: Tensor) -> Tensor:
    """``weighting(matrix)``, checked to be ``[m]`` weights, in the Gramian's dtype."""
    weights = weighting(matrix)
    num_rows = matrix.shape[0]
    if not isinstance(weights, Tensor) or weights.shape != (num_rows,):
        got = (f"shape {tuple(weights.shape)}" if isinstance(weights, Tensor)
               else type(weights).__name__)
        checks.fail(api, f"the weighting to return a tensor of shape ({num_rows},), one "
                    "weight per output entry", got,
                    "A weighting maps the [m, m] Gramian to [m] weights.", TypeError)
    # a sparse, nested or meta tensor met torch's raw errors in Jᵀw, and complex weights lost
    # their imaginary part without a word (session 67's hunt)
    if weights.layout != torch.strided or weights.is_nested or weights.is_complex() \
            or not (weights.is_floating_point() or weights.dtype in (torch.bool, *_INTEGERS)):
        checks.fail(api, "the weighting to return a dense real tensor of weights",
                    f"a tensor of dtype {weights.dtype} and layout {weights.layout}"
                    + (" (nested)" if weights.is_nested else ""),
                    "Return real weights as a dense tensor (e.g. w.to_dense(), w.real).",
                    TypeError)
    if weights.device != matrix.device:
        checks.fail(api, f"the weighting to return its weights on the Gramian's device "
                    f"({matrix.device})", f"weights on {weights.device}",
                    "Return w.to(G.device) (e.g. upgrad(G.cpu()).to(G.device)).")
    return weights.to(matrix.dtype)


_INTEGERS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
