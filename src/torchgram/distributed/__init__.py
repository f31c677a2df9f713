"""``torchgram.distributed``: exact Gramians and Jacobian descent over ``torch.distributed``.

Data parallel (each rank its own samples: DDP, FSDP2 after :func:`torchgram.functionalize`)
and tensor parallel (DTensor parameters from ``parallelize_module``): every rank gets the
single-process answer on the whole batch, bit-identical (DESIGN.md §6, NOTE [data-parallel
Gramian], NOTE [tensor-parallel Gramian]). ``torchgram.distributed.autograd`` does the same
for eager DDP and FSDP2 modules.
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
