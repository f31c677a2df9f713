"""Jacobian descent over torch.distributed: UPGrad on digits, each rank holding its own samples.

Every step, the ranks draw the same batch of 32 digits and each keeps its own part;
``torchgram.distributed.aggregated_grad`` gives every rank the UPGrad step of the **whole**
batch: the Gramian of all 32 per-sample gradients (its blocks between ranks formed from the
layers' ghost factors, which the ranks exchange), the weights computed once and broadcast,
and ``Jᵀw`` summed over the ranks — identical on every rank, so the replicas stay equal.
The script checks that this is the single-process run (same parameters and loss curve),
and compares it with ``cross_rank="local"``, each rank weighting its own block only (what a
single-process library run under DDP gives): that step conflicts with per-sample gradients
that UPGrad would have protected.

Run:  torchrun --nproc_per_node=2 examples/distributed_jd.py   (gloo on CPU, nccl with CUDA)
      python examples/distributed_jd.py          (starts 2 gloo processes on this machine)
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from sklearn.datasets import load_digits
from torch import nn

import torchgram as tg

STEPS = 40
BATCH_SIZE = 32
LR = 0.1
REG_EPS = 1e-4  # upgrad's ridge on the trace-normalized Gramian (its default)


def load_data(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = load_digits(return_X_y=True)
    return (torch.tensor(images, dtype=torch.float32, device=device) / 16.0,
            torch.tensor(labels, device=device))


def make_model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)  # the same initial network on every rank
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)


def beyond_ridge(G: torch.Tensor, w: torch.Tensor) -> int:
    """Samples the step ``Jᵀw`` hurts beyond UPGrad's ridge: ``(G w)_i < -reg_eps tr(G) w_i``."""
    return int((G @ w < -(REG_EPS * w.abs() + 1e-5) * G.trace()).sum())


def train(device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = load_data(device)
    fn, params = tg.functionalize(make_model(device))

    def losses(p, x, y):  # one loss per sample
        return nn.functional.cross_entropy(fn(p, x), y, reduction="none")

    exact = tg.distributed.aggregated_grad(losses, tg.weighting.upgrad, batch_dim=0)
    local = tg.distributed.aggregated_grad(losses, tg.weighting.upgrad, batch_dim=0,
                                           cross_rank="local")
    single = tg.aggregated_grad(losses, tg.weighting.upgrad, batch_dim=0)
    full_gramian = tg.distributed.gramian(losses, batch_dim=0)
    params_local, params_single = dict(params), dict(params)
    batches = torch.Generator().manual_seed(1)  # the same batches on every rank
    mine = torch.arange(BATCH_SIZE).chunk(world)[rank]  # this rank's samples of a batch
    curves: dict[str, list[float]] = {"exact": [], "single": [], "local": []}
    hurt = {"exact": 0, "local": 0}
    for _ in range(STEPS):
        if rank == 0:
            with torch.no_grad():
                for name, p in (("exact", params), ("local", params_local),
                                ("single", params_single)):
                    curves[name].append(losses(p, x, y).mean().item())
        index = torch.randint(len(y), (BATCH_SIZE,), generator=batches).to(device)
        xb, yb = x[index], y[index]
        update, info = exact(params, xb[mine], yb[mine])
        hurt["exact"] += beyond_ridge(info.gramian, info.weights)
        # cross_rank="local": each rank's own block; the update is the ranks' average, i.e.
        # Jᵀw for the whole batch's weights w = (w_0, w_1, ...) / world
        G = full_gramian(params_local, xb[mine], yb[mine])
        update_local, info_local = local(params_local, xb[mine], yb[mine])
        parts = [torch.empty_like(info_local.weights) for _ in range(world)]
        dist.all_gather(parts, info_local.weights.contiguous())
        hurt["local"] += beyond_ridge(G, torch.cat(parts) / world)
        if rank == 0:  # the single-process run on the whole batch, for comparison
            update_single, _ = single(params_single, xb, yb)
            params_single = {k: p - LR * update_single[k] for k, p in params_single.items()}
        params = {k: p - LR * update[k] for k, p in params.items()}
        params_local = {k: p - LR * update_local[k] for k, p in params_local.items()}

    # every rank holds the same parameters: compare them with rank 0's, bit for bit
    flat = torch.cat([p.reshape(-1) for p in params.values()])
    first = flat.clone()
    dist.broadcast(first, src=0)
    assert torch.equal(flat, first), "the replicas diverged"
    if rank == 0:
        drift = max(float((params[k] - params_single[k]).abs().max()) for k in params)
        print(f"{world} ranks, {STEPS} UPGrad steps of {BATCH_SIZE} digits "
              f"({len(mine)} per rank), MLP 64-64-10")
        print(f"{'step':>6}{'exact':>10}{'single':>10}{'local':>10}   mean training loss")
        for step in range(0, STEPS, 8):
            print(f"{step:6d}" + "".join(f"{curves[k][step]:10.4f}"
                                         for k in ("exact", "single", "local")))
        print(f"largest parameter difference, exact vs single process: {drift:.1e}")
        print(f"samples hurt beyond UPGrad's ridge, all steps: exact {hurt['exact']}, "
              f"local {hurt['local']}")
        assert drift < 1e-4, drift  # float32: the same step, summed in another order
        assert hurt["exact"] == 0
        pairs = zip(curves["exact"], curves["single"], strict=True)
        assert max(abs(a - b) for a, b in pairs) < 1e-4  # the single-process loss curve
        assert curves["exact"][-1] < 0.6 * curves["exact"][0]
        print("OK")


def worker(rank: int, world: int, store: str) -> None:
    """One rank, started by ``main`` (no torchrun): gloo on the CPU."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world)
    try:
        train(torch.device("cpu"))
        dist.barrier()  # both ranks done before either tears its gloo pairs down
    finally:
        dist.destroy_process_group()
    # torch 2.13's gloo threads can still abort the interpreter's own exit ("terminate called
    # without an active exception", SIGABRT, now and then under load): a finished rank leaves
    # without it
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    if "RANK" in os.environ:  # started by torchrun
        cuda = torch.cuda.is_available()
        dist.init_process_group("nccl" if cuda else "gloo")
        device = torch.device("cpu")
        if cuda:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        try:
            train(device)
        finally:
            dist.destroy_process_group()
        return
    with tempfile.TemporaryDirectory() as directory:
        mp.start_processes(worker, args=(2, os.path.join(directory, "store")), nprocs=2,
                           start_method="spawn")


if __name__ == "__main__":
    main()
