"""Validation of transform configuration, done when a transform is built.

Every message follows the same pattern: the API that refused, what it expected, what it
got, and what to do instead.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch


def message(api: str, expected: str, got: str, fix: str) -> str:
    """Torchgram's error message layout: the API, what it expected, what it got, the fix.

    Example:
        >>> message("torchgram.gramian", "an int", "'a'", "Pass 0.")
        "torchgram.gramian: expected an int, but got 'a'. Pass 0."
    """
    return f"{api}: expected {expected}, but got {got}. {fix}"


def fail(api: str, expected: str, got: str, fix: str,
         error: type[Exception] = ValueError) -> NoReturn:
    """Raise ``error`` with torchgram's message layout (:func:`message`)."""
    raise error(message(api, expected, got, fix))


def check_callable(api: str, f: Any) -> None:
    """Reject a non-callable function argument."""
    if not callable(f):
        fail(api, "a callable f(params, *inputs)", f"{type(f).__name__} {f!r:.60}",
             "Pass the function itself, e.g. tg.gramian(loss_fn), not its result.", TypeError)


def normalize_argnums(api: str, argnums: int | Sequence[int]) -> tuple[tuple[int, ...], bool]:
    """Check ``argnums`` and return it as a tuple, plus whether a bare int was given.

    Range is checked later, against the arguments of each call (negative values allowed).
    """
    if isinstance(argnums, bool) or not isinstance(argnums, int | tuple | list):
        fail(api, "argnums to be an int or a tuple of ints", repr(argnums),
             "Use e.g. argnums=0 or argnums=(0, 1).", TypeError)
    if isinstance(argnums, int):
        return (argnums,), True
    nums = tuple(argnums)
    if not nums:
        fail(api, "a non-empty tuple of argnums", "()", "Name at least one argument.")
    for num in nums:
        if isinstance(num, bool) or not isinstance(num, int):
            fail(api, "every entry of argnums to be an int", repr(argnums),
                 "Use e.g. argnums=(0, 1).", TypeError)
    if len(set(nums)) != len(nums):
        fail(api, "argnums without duplicates", repr(argnums),
             "List each differentiated argument once.")
    return nums, False


def resolve_argnums(api: str, argnums: tuple[int, ...], num_args: int) -> tuple[int, ...]:
    """Resolve negative argnums against the number of positional arguments of a call."""
    resolved = []
    for num in argnums:
        if not -num_args <= num < num_args:
            fail(api, f"argnums within [-{num_args}, {num_args}) for a call with {num_args} "
                 "positional argument(s)", f"argnums={argnums!r}",
                 "Pass the parameters positionally, or fix argnums.")
        resolved.append(num % num_args)
    if len(set(resolved)) != len(resolved):
        fail(api, "argnums naming distinct arguments", f"{argnums!r} (after resolving negatives)",
             "List each differentiated argument once.")
    return tuple(resolved)


def positive_int(api: str, name: str, value: Any, hint: str) -> int | None:
    """``value`` as a positive ``int`` (or ``None``); anything else is refused.

    Integers of other types (``numpy.int64``, a 0-d integer tensor: what ``len`` of an array
    or ``x.shape[0] // 4`` of a traced shape gives) are taken as their value.

    Example:
        >>> import numpy as np
        >>> positive_int("torchgram.gramian", "chunk_size", np.int64(8), "")
        8
    """
    if value is None:
        return None
    number: int | None = None
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and not value.is_floating_point() and not value.is_complex() \
                and value.dtype != torch.bool and value.device.type != "meta":
            number = int(value.item())
    elif not isinstance(value, bool):
        try:
            number = operator.index(value)  # numpy integers; numpy bools refuse it
        except TypeError:
            pass
    if number is None:
        fail(api, f"{name} to be None or a positive int", repr(value), hint, TypeError)
    if number <= 0:
        fail(api, f"{name} to be a positive int", repr(value), hint)
    return number


def check_bool(api: str, name: str, value: Any) -> None:
    """Reject non-bool flags (a common slip: passing a tensor or a string)."""
    if not isinstance(value, bool):
        fail(api, f"{name} to be True or False", repr(value), f"Pass {name}=True or False.",
             TypeError)


def check_batch_dim(api: str, batch_dim: Any) -> None:
    """``batch_dim`` is ``None`` or an int (its range is checked against the output)."""
    if batch_dim is None:
        return
    if isinstance(batch_dim, bool) or not isinstance(batch_dim, int):
        fail(api, "batch_dim to be None or an int", repr(batch_dim),
             "Pass the output dimension that indexes independent samples, e.g. batch_dim=0.",
             TypeError)


def check_in_dims(api: str, in_dims: Any) -> None:
    """Check ``in_dims``: an int or ``None``, or a tuple of those, optionally with a dict.

    The tuple has one entry per non-differentiated positional argument, optionally followed
    by a dict ``{keyword: int or None}`` (NOTE [in_dims]).
    """
    entries = list(in_dims) if isinstance(in_dims, tuple | list) else [in_dims]
    if entries and isinstance(entries[-1], dict) and isinstance(in_dims, tuple | list):
        keywords = entries.pop()
        entries += list(keywords.values())
        if not all(isinstance(name, str) for name in keywords):
            fail(api, "the keyword entries of in_dims to be named by strings",
                 repr(in_dims), "E.g. in_dims=(0, {'attention_mask': 0}).", TypeError)
    for entry in entries:
        if entry is not None and (isinstance(entry, bool) or not isinstance(entry, int)):
            fail(api, "in_dims to be an int, None, or a tuple of ints/None (one per "
                 "non-differentiated positional argument, then optionally a dict for "
                 "keyword arguments)", repr(in_dims),
                 "E.g. in_dims=0, in_dims=(0, None) for a batched x and a shared y, or "
                 "in_dims=(0, {'mask': None}) for a shared keyword tensor.", TypeError)


def check_choice(api: str, name: str, value: Any, choices: Sequence[str]) -> None:
    """Reject a value outside ``choices``, listing the valid ones."""
    if not isinstance(value, str) or value not in choices:
        fail(api, f"{name} to be one of {', '.join(map(repr, choices))}", repr(value),
             f"Pick one of the listed {name}s.")


def function_name(f: Callable[..., Any]) -> str:
    """A readable name for ``f`` in docstrings and messages."""
    return getattr(f, "__qualname__", None) or getattr(f, "__name__", None) or repr(f)


def check_not_meta(api: str, tensors: Sequence[Any], what: str) -> None:
    """Reject tensors on the ``meta`` device: they have shapes, not values.

    ``tg.explain`` plans from shapes and takes them; everything that computes does not (a
    raw ``Tensor.item() cannot be called on meta tensors`` before, session 27): the problem
    of every call but a plan checks its parameters before ``f`` is evaluated.

    Example:
        >>> import torch
        >>> check_not_meta("doc", [torch.ones(1)], "parameters")
        >>> try:
        ...     check_not_meta("doc", [torch.empty(2, device="meta")], "parameters")
        ... except ValueError as error:
        ...     print(str(error)[:71])
        doc: expected parameters with values, but got a tensor of shape (2,) on
    """
    for tensor in tensors:
        if getattr(tensor, "is_meta", False):
            fail(api, f"{what} with values", f"a tensor of shape {tuple(tensor.shape)} on the "
                 "meta device", "tg.explain plans from shapes on meta tensors; to compute, "
                 + ("materialize them (module.to_empty(device=...), then load or initialize "
                    "the weights)." if what == "parameters" else
                    "pass tensors with values on a real device."))
