"""The process group of a distributed call, and the few collectives torchgram uses on it.

``group=`` is a ``ProcessGroup``, a 1-D ``DeviceMesh``, a ``(mesh, dim name)`` pair or
``None`` (the default group). Everything here is plain ``torch.distributed``: objects are
exchanged with ``all_gather_object``, payloads with one ``all_to_all_single`` of bytes, the
Gramian with ``all_reduce`` and the weights with ``broadcast``. Tensors travel on the
group's device (CUDA for NCCL, CPU for Gloo) and come back on the caller's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from torchgram._core.checks import fail

GroupLike = Any
"""``None``, a ``ProcessGroup``, a ``DeviceMesh`` or a ``(DeviceMesh, dim name)`` pair."""


def check_group(api: str, group: GroupLike) -> None:
    """Reject a ``group`` of the wrong type when the transform is built."""
    if group is None or isinstance(group, dist.ProcessGroup | DeviceMesh):
        return
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh) \
            and isinstance(group[1], str | int):
        return
    fail(api, "group to be None, a ProcessGroup, a DeviceMesh or a (DeviceMesh, dim name) pair",
         f"{type(group).__name__} {group!r:.60}",
         "Pass e.g. group=mesh for a 1-D mesh or group=(mesh, 'dp') for one of its dims.",
         TypeError)


@dataclass(frozen=True)
class Group:
    """A resolved process group.

    Attributes:
        pg: The process group.
        rank: This process's rank in it.
        size: Its number of processes.
        device: Where its collectives run (the current CUDA device for NCCL, else CPU).
    """

    pg: dist.ProcessGroup
    rank: int
    size: int
    device: torch.device

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, obj, group=self.pg)
        return gathered

    def all_reduce(self, tensor: Tensor) -> Tensor:
        """The sum over ranks (a new tensor on ``tensor``'s device, identical on every rank).

        ``all_reduce`` leaves the same values on every rank: every entry is reduced once and
        the result copied to all (ring and tree algorithms alike) — what data parallelism
        itself relies on to keep replicas equal.
        """
        buffer = tensor.to(self.device).contiguous().clone()
        dist.all_reduce(buffer, group=self.pg)
        return buffer.to(tensor.device)

    def broadcast(self, tensor: Tensor, src: int = 0) -> Tensor:
        """``tensor`` of group rank ``src`` on every rank (same shape and dtype everywhere)."""
        buffer = tensor.to(self.device).contiguous().clone()
        dist.broadcast(buffer, src=dist.get_global_rank(self.pg, src), group=self.pg)
        return buffer.to(tensor.device)

    def all_to_all_bytes(self, send: Sequence[Tensor],
                         receive_sizes: Sequence[int]) -> list[Tensor]:
        """Send ``send[r]`` (``uint8``) to rank ``r``; return what each rank sent here."""
        in_splits = [int(t.numel()) for t in send]
        flat = (torch.cat([t.to(self.device) for t in send]) if send
                else torch.empty(0, dtype=torch.uint8, device=self.device))
        out = torch.empty(sum(receive_sizes), dtype=torch.uint8, device=self.device)
        dist.all_to_all_single(out, flat, list(receive_sizes), in_splits, group=self.pg)
        return list(out.split(list(receive_sizes)))


def resolve_group(api: str, group: GroupLike) -> Group:
    """The :class:`Group` of ``group`` (checked at call time: the default group must exist)."""
    if not (dist.is_available() and dist.is_initialized()):
        fail(api, "an initialized torch.distributed default process group",
             "torch.distributed not initialized",
             "Call torch.distributed.init_process_group (torchrun sets its environment) "
             "before the first call.", RuntimeError)
    if group is None:
        pg = dist.group.WORLD
    elif isinstance(group, DeviceMesh):
        if group.ndim != 1:
            fail(api, "a 1-D DeviceMesh (or a (mesh, dim name) pair)",
                 f"a {group.ndim}-D mesh with dims {group.mesh_dim_names}",
                 "Pass group=(mesh, 'dp') to name the data-parallel dimension.")
        pg = group.get_group()
    elif isinstance(group, tuple):
        mesh, dim = group
        pg = mesh.get_group(dim)
    else:
        pg = group
    assert isinstance(pg, dist.ProcessGroup)
    return Group(pg, dist.get_rank(pg), dist.get_world_size(pg), _collective_device(pg))


def _collective_device(pg: dist.ProcessGroup) -> torch.device:
    """Where ``pg``'s collectives run.

    The current CUDA device for NCCL (or a backend that lists it, ``"cpu:gloo,cuda:nccl"``),
    else the CPU (Gloo).
    """
    backend = str(dist.get_backend(pg))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
