"""``torchgram.distributed``: exact Gramians and Jacobian descent over ``torch.distributed``.

Each rank of a process group holds part of the batch (DDP; FSDP2, which is data parallel
for the Gramian) or a shard of the parameters (tensor parallelism). Every rank gets the
single-process answer on the whole batch — ``torchgram.gramian`` of all ranks' samples
concatenated in rank order — **bit-identical on every rank**, with the same options as the
single-process functions plus ``group=`` (DESIGN.md §6):

* :func:`gramian`, :func:`aggregated_grad` and :func:`explain`: the functional API. Data
  parallel: each rank runs the structured pass on its own samples; per layer the smaller
  of its ghost factors and its per-sample gradients travels to one owner rank that forms
  its block, and one ``all_reduce`` sums the blocks (NOTE [data-parallel Gramian], NOTE
  [plan agreement], NOTE [no collectives in f]). Tensor parallel (DTensor parameters from
  ``parallelize_module``): per-shard blocks summed over the mesh (NOTE [tensor-parallel
  Gramian]). ``aggregated_grad`` computes the weights once, on the group's first rank, and
  broadcasts them; its update ``Jᵀ w`` of the whole batch is the same on every rank.
* :mod:`torchgram.distributed.autograd`: ``gramian`` and ``backward`` on the autograd graph
  of eager DDP and FSDP2 modules; ``backward`` leaves in ``.grad`` what DDP / FSDP2 would
  for the weighted loss (NOTE [eager data parallel]).
* ``cross_rank="local"``: each rank's own block only, no exchange — what running a
  single-process library under DDP gives. It drops the blocks between ranks' samples, and
  with them UPGrad's guarantee; it is the practical choice when the exchange costs more
  than it is worth (long sequences: see the README's "Scaling out").

Every rank of the group calls the function together, with the same parameters and its
own samples (tensor parallel: the same inputs). Errors on one rank are raised on every
rank, and none hangs. A typical step, launched with ``torchrun``:

    dist.init_process_group()
    step = tg.distributed.aggregated_grad(losses, tg.weighting.upgrad, batch_dim=0)
    update, info = step(params, x_local, y_local)     # the same update on every rank
    params = {k: p - lr * update[k] for k, p in params.items()}

Example:
    >>> import torchgram as tg
    >>> sorted(tg.distributed.__all__)  # doctest: +NORMALIZE_WHITESPACE
    ['Aggregation', 'Exchange', 'LeafExchange', 'aggregated_grad', 'autograd', 'explain',
     'gramian']
"""

from torchgram.distributed import autograd as autograd
from torchgram.distributed._api import Aggregation as Aggregation
from torchgram.distributed._api import aggregated_grad as aggregated_grad
from torchgram.distributed._api import explain as explain
from torchgram.distributed._api import gramian as gramian
from torchgram.distributed._report import Exchange as Exchange
from torchgram.distributed._report import LeafExchange as LeafExchange

__all__ = ["Aggregation", "Exchange", "LeafExchange", "aggregated_grad", "autograd", "explain",
           "gramian"]
