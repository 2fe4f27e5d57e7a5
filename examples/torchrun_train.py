"""Data-parallel training across processes with fr.distributed, launched by torchrun.

Run on one machine, two CPU processes, gloo, listening on loopback only:

    .venv/bin/torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29531 \\
        examples/torchrun_train.py

Every rank builds the same model, takes rank 0's parameters and buffers
(``fr.distributed.broadcast``: what DDP does at construction), then trains a
few SGD steps on its own data. ``fr.distributed.grad_and_value`` averages the
gradients over the ranks during the backward pass, as DDP does;
``fr.distributed.sync_buffers`` gives every rank rank 0's BatchNorm
statistics before each step's forward, and before the evaluation that
follows training, as DDP does. The ranks end with the same parameters,
which the script checks and prints, with the validation loss.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import freplicate as fr


def main() -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)

    torch.manual_seed(rank)  # a different init per rank: broadcast makes them agree
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    state = fr.distributed.broadcast(fr.state(model))
    params, buffers = state.params, state.buffers

    def loss_fn(params, buffers, x, y):
        out, new = fr.apply(model, fr.State(params, buffers), x)
        return F.cross_entropy(out, y), new.buffers

    step = fr.distributed.grad_and_value(loss_fn, has_aux=True)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own shard of data
    for i in range(5):
        x, y = torch.randn(16, 8, generator=data), torch.randint(0, 4, (16,), generator=data)
        buffers = fr.distributed.sync_buffers(buffers)
        grads, (loss, buffers) = step(params, buffers, x, y)
        params = {k: p - 0.1 * grads[k] for k, p in params.items()}
        print(f"rank {rank} step {i}: local loss {loss.item():.4f}", flush=True)

    # DDP broadcasts rank 0's buffers on the first forward after training, an evaluation under
    # no_grad included: without this sync, every other rank would evaluate on its own statistics
    buffers = fr.distributed.sync_buffers(buffers)
    model.eval()
    with torch.no_grad():
        x, y = torch.randn(64, 8, generator=data), torch.randint(0, 4, (64,), generator=data)
        out, _ = fr.apply(model, fr.State(params, buffers), x)
        val = fr.distributed.all_reduce(F.cross_entropy(out, y))  # the mean over the ranks
    model.train()
    if rank == 0:
        print(f"validation loss (mean over {world} ranks): {val.item():.4f}", flush=True)

    # the same parameters everywhere: rank 0's copy, broadcast, must equal ours exactly
    theirs = fr.distributed.broadcast(params)
    agree = all(torch.equal(params[k], theirs[k]) for k in params)
    flag = torch.tensor([int(agree)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"{world} ranks agree on every parameter: {bool(flag.item())}", flush=True)
    dist.destroy_process_group()
    if not flag.item():
        raise SystemExit(1)


if __name__ == "__main__":
    main()
