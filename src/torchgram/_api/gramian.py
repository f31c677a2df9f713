"""``torchgram.gramian``: the transform."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torchgram._api.pipeline import compute, outside_compile, wraps_user_function
from torchgram._core.checks import function_name
from torchgram._core.functional import public_call
from torchgram._core.options import Options
from torchgram._core.scratch import scratch_scope

_API = "torchgram.gramian"


def gramian(
    f: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    has_aux: bool = False,
    backend: str = "auto",
    chunk_size: int | None = None,
    batch_dim: int | None = None,
    in_dims: int | None | Sequence[Any] = 0,
    diagonal: bool = False,
    per_leaf: bool = False,
    memory_budget: int | None = None,
    progress: bool = False,
) -> Callable[..., Any]:
    """Gramian ``G = J Jᵀ`` of the Jacobian of ``f`` w.r.t. the arguments ``argnums``.

    ``J`` is the Jacobian of ``f``'s output, flattened to ``m`` rows, with respect to every
    floating-point tensor leaf of the differentiated argument(s), flattened and
    concatenated into columns. ``G[i, j]`` is the inner product of the gradients of output
    entries ``i`` and ``j``: the empirical NTK, or the pairwise inner products of
    per-sample / per-task gradients.

    It composes like a ``torch.func`` transform (NOTE [composition]): ``grad``, ``jacrev``,
    ``jacfwd``, ``vjp``, ``jvp`` and ``vmap`` of a function that calls it, and nested calls, give
    the right answers (inside those transforms ``auto`` runs the ``jacobian`` backend); in
    eager mode ``G`` carries the autograd graph when a differentiated leaf or an input
    requires grad (and nothing extra is paid when none does); under ``torch.compile`` the
    call runs eagerly, as one graph break.

    Args:
        f: The function ``f(*args, **kwargs)``. It returns a floating tensor or a pytree of
            floating tensors (``(output, aux)`` with ``has_aux=True``).
        argnums: The positional argument(s) to differentiate (int or tuple, negative values
            allowed). Every floating tensor leaf of those arguments is a parameter; other
            leaves (integer tensors, Python numbers, ...) are constants. An object optree
            does not know that holds floating tensors (a dataclass not registered as a
            pytree node, a ``SimpleNamespace``, a module) is refused with a ``TypeError``.
        has_aux: ``f`` returns ``(output, aux)``; the transform then returns ``(G, aux)``.
        backend: ``"auto"`` (default) or the name of a backend, see
            :func:`torchgram.backends.backend_names`.
        chunk_size: Jacobian rows per vectorized pass (``None``: all at once; ``1``: a
            plain Python loop without ``vmap``). Bounds the transient memory to about
            ``chunk_size × P``.
        batch_dim: Declares per-sample structure: output dimension ``batch_dim`` indexes
            independent samples, and entry ``b`` along it depends only on sample ``b`` of the
            batched inputs. Backends then work on per-sample pieces (about ``B`` times less
            work than ``B·K`` dense rows). The result is the same matrix; where the samples
            turn out to interact (batch-norm in training mode, ``x - x.mean(0)``), it is the
            exact coupled Gramian (NOTE [per-sample]).
        in_dims: With ``batch_dim``, where the samples are in each non-differentiated
            argument, like ``torch.func.vmap``: an int for all of them (keyword arguments
            included), or one int/``None`` per non-differentiated positional argument,
            optionally followed by a dict ``{keyword: int or None}`` (keywords it does not
            name: dim 0). ``None`` = shared by all samples.
        diagonal: Return only ``G[i, i]`` (squared per-row gradient norms), without any
            ``m × m`` work.
        per_leaf: Return one block ``J_l J_lᵀ`` per parameter leaf, in the structure of the
            differentiated argument(s) (``None`` at constant leaves; a tuple of pytrees for a
            tuple ``argnums``). Their sum is ``G``.
        memory_budget: Bytes of Jacobian the ``jacobian`` backend may assemble at once.
            Leaves are grouped into blocks that fit; a leaf too large on its own is split
            into column slices (each re-running the row passes). See NOTE [memory budget].
        progress: Show a ``tqdm`` progress bar over the backend's row chunks when it runs
            more than one (``chunk_size`` or ``memory_budget`` splitting the rows).

    Returns:
        A function taking the same arguments as ``f`` and returning ``G`` (or ``(G, aux)``).
        If ``f`` returns a tensor of shape ``S``, ``G`` has shape ``S + S`` and
        ``G[i..., j...]`` pairs output entries ``out[i...]`` and ``out[j...]``; with
        ``diagonal=True`` it has shape ``S``. If ``f`` returns a pytree, its leaves are
        taken in ``optree.tree_leaves`` order (dict keys sorted), each flattened row-major
        and concatenated into ``m`` rows, and ``G`` has shape ``[m, m]`` (``[m]`` diagonal).
        ``G`` has the output's dtype and device.

    Raises:
        TypeError, ValueError: For bad configuration when the transform is built, and for
            bad arguments or outputs when it is called (before any Jacobian work).

    Example:
        >>> import torch, torchgram as tg
        >>> def f(params, x):
        ...     return torch.tanh(x @ params["w"]) @ params["v"]
        >>> params = {"w": torch.randn(3, 4), "v": torch.randn(4)}
        >>> x = torch.randn(5, 3)
        >>> tg.gramian(f)(params, x).shape
        torch.Size([5, 5])
        >>> tg.gramian(f, diagonal=True, batch_dim=0)(params, x).shape
        torch.Size([5])
        >>> sorted(tg.gramian(f, per_leaf=True)(params, x))
        ['v', 'w']
    """
    options = Options.validate(
        _API, f, argnums, has_aux=has_aux, backend=backend, chunk_size=chunk_size,
        batch_dim=batch_dim, in_dims=in_dims, diagonal=diagonal, per_leaf=per_leaf,
        memory_budget=memory_budget, progress=progress,
    )

    @wraps_user_function(f)
    @outside_compile
    @public_call  # NOTE [inference mode], NOTE [the caller's function modes]
    def gramian_of_f(*args: Any, **kwargs: Any) -> Any:
        with scratch_scope():  # NOTE [scratch memory]
            computation = compute(options, f, args, kwargs)
            result = computation.value()
        return (result, computation.aux) if has_aux else result

    gramian_of_f.__doc__ = (
        f"Gramian J Jᵀ of {function_name(f)} with respect to positional argument(s) "
        f"{argnums!r}{' (diagonal only)' if diagonal else ''}"
        f"{', per parameter leaf' if per_leaf else ''}; backend {backend!r}.\n\n"
        f"Built by torchgram.gramian. Original docstring:\n\n{f.__doc__ or ''}"
    )
    return gramian_of_f
