"""The demo: functional data-parallel training beside PyTorch's stateful path.

Two short training runs, each done twice from the same initial weights and
batches, once the functional way (freplicate) and once the stateful way
(PyTorch's own designs), with the parameters and buffers compared after
every step:

1. DataParallel. ``fr.data_parallel`` + ``fr.grad_and_value`` against
   ``nn.DataParallel`` on CUDA devices, or, without CUDA (where
   ``nn.DataParallel`` silently runs unreplicated), against what it does
   spelled out: a deep copy of the module per replica, the batch chunked,
   outputs concatenated, one backward, the replicas' gradients summed into
   the module, buffers taken from replica 0.
2. DDP-style gradient averaging. ``fr.data_parallel_grad`` (per-device
   gradients, all-reduced) against a stateful full-batch step with
   ``torch.optim.SGD``, which it equals for equal shards and a mean loss.
3. Two processes. ``fr.distributed.grad_and_value`` against
   ``DistributedDataParallel`` + ``torch.optim.SGD`` on 2 gloo ranks spawned on
   this machine (loopback only, bounded timeouts), each rank on its own data.

Only the public face (``import freplicate as fr``) is used, as a user would.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import freplicate as fr

LR = 0.05


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, 32),
        nn.BatchNorm1d(32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.Tanh(),
        nn.Linear(32, 4),
    )


def _batches(steps: int, batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, 8, generator=g), torch.randint(0, 4, (batch,), generator=g))
        for _ in range(steps)
    ]


def _stateful_data_parallel_step(
    module: nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    devices: Sequence[str],
) -> float:
    """One step of what nn.DataParallel does, spelled out with per-replica deep copies."""
    replicas = [copy.deepcopy(module).to(d) for d in devices]
    chunks = x.chunk(len(devices))
    outs = [rep(c.to(d)) for rep, c, d in zip(replicas, chunks, devices)]
    out = torch.cat([o.to(devices[0]) for o in outs])
    loss = F.cross_entropy(out, y.to(devices[0]))
    loss.backward()
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        for name, p in module.named_parameters():
            copies = [dict(r.named_parameters())[name].grad for r in replicas[: len(outs)]]
            p.grad = torch.stack([g.to(p.device) for g in copies if g is not None]).sum(0)
        for name, b in module.named_buffers():
            b.copy_(dict(replicas[0].named_buffers())[name])
    opt.step()
    return float(loss.detach())


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(
        float((a[k].detach().double().cpu() - b[k].detach().double().cpu()).abs().max()) for k in a
    )


def demo(steps: int = 5, devices: Sequence[str] | None = None, batch: int = 32) -> bool:
    """Run both comparisons, print a table per part, return whether all agreed."""
    torch.manual_seed(0)
    if devices is None:
        n = torch.cuda.device_count()
        devices = [f"cuda:{i}" for i in range(n)] if n >= 2 else ["cpu", "cpu"]
    devices = list(devices)
    on_cuda = all(d.startswith("cuda") for d in devices)
    print("freplicate demo: functional data parallelism beside PyTorch's stateful path")
    print(f"devices: {devices}" + ("" if on_cuda else "  (CPU replicas: no CUDA devices here)"))
    ok = True
    tol = 1e-5

    # --- Part 1: DataParallel --------------------------------------------------
    model = _model().to(devices[0])
    stateful = copy.deepcopy(model)
    opt = torch.optim.SGD(stateful.parameters(), lr=LR)
    dp = (
        nn.DataParallel(stateful, device_ids=[torch.device(d) for d in devices])
        if on_cuda
        else None
    )
    state = fr.state(model)
    params, buffers = state.params, state.buffers

    def loss_fn(p, b, x, y):
        out, new = fr.data_parallel(model, fr.State(p, b), x, devices=devices)
        return F.cross_entropy(out, y.to(out.device)), new.buffers

    step = fr.grad_and_value(loss_fn, has_aux=True)
    print(
        "\n1. fr.data_parallel + fr.grad_and_value  vs  "
        + ("nn.DataParallel" if on_cuda else "DataParallel's algorithm on per-replica deep copies")
    )
    print(
        f"   {'step':>4} {'loss (fr)':>12} {'loss (stateful)':>16} {'max |Δ params|':>16} {'max |Δ buffers|':>16}"
    )
    for i, (x, y) in enumerate(_batches(steps, batch)):
        x, y = x.to(devices[0]), y.to(devices[0])
        grads, (loss, buffers) = step(params, buffers, x, y)
        params = {k: p - LR * grads[k] for k, p in params.items()}
        if dp is not None:
            opt.zero_grad(set_to_none=True)
            ref_loss = F.cross_entropy(dp(x), y)
            ref_loss.backward()
            opt.step()
            ref = float(ref_loss.detach())
        else:
            ref = _stateful_data_parallel_step(stateful, opt, x, y, devices)
        dpar = _max_diff(params, dict(stateful.named_parameters()))
        dbuf = _max_diff(buffers, dict(stateful.named_buffers()))
        ok &= dpar < tol and dbuf < tol and abs(float(loss) - ref) < tol
        print(f"   {i:>4} {float(loss):>12.6f} {ref:>16.6f} {dpar:>16.2e} {dbuf:>16.2e}")

    # --- Part 2: DDP-style gradient averaging -------------------------------------
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)).to(devices[0])
    stateful_mlp = copy.deepcopy(mlp)
    opt = torch.optim.SGD(stateful_mlp.parameters(), lr=LR)
    params = fr.state(mlp).params

    def mlp_loss(p, x, y):
        out, _ = fr.apply(mlp, fr.State(p, {}), x)
        return F.cross_entropy(out, y.to(out.device))

    dp_step = fr.data_parallel_grad(mlp_loss, devices)
    print(
        "\n2. fr.data_parallel_grad (per-device grads, all-reduced)  vs  full-batch torch.optim.SGD"
    )
    print(f"   {'step':>4} {'loss (fr)':>12} {'loss (stateful)':>16} {'max |Δ params|':>16}")
    for i, (x, y) in enumerate(_batches(steps, batch)):
        x, y = x.to(devices[0]), y.to(devices[0])
        grads, loss = dp_step(params, x, y)
        params = {k: p - LR * grads[k] for k, p in params.items()}
        opt.zero_grad(set_to_none=True)
        ref_loss = F.cross_entropy(stateful_mlp(x), y)
        ref_loss.backward()
        opt.step()
        dpar = _max_diff(params, dict(stateful_mlp.named_parameters()))
        ok &= dpar < tol and abs(float(loss) - float(ref_loss.detach())) < tol
        print(f"   {i:>4} {float(loss):>12.6f} {float(ref_loss.detach()):>16.6f} {dpar:>16.2e}")

    ok &= _two_processes(steps, batch, tol)

    print(
        "\n"
        + (
            f"OK: the functional and stateful paths agree (tolerance {tol:.0e})."
            if ok
            else "MISMATCH: the functional and stateful paths disagree."
        )
    )
    print("The same across processes under torchrun: examples/torchrun_train.py.")
    return ok


def _rank(rank: int, store: str, steps: int, batch: int, out: Any) -> None:
    """One rank of part 3: train DDP and fr.distributed side by side from one init."""
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # the ranks talk over loopback only
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    try:
        torch.manual_seed(rank)  # different inits: both sides start from rank 0's
        model = _model()
        ddp = DistributedDataParallel(copy.deepcopy(model))  # broadcasts rank 0's state
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
        state = fr.distributed.broadcast(fr.state(model))  # the same, as a function
        params, buffers = state.params, state.buffers

        def loss_fn(p, b, x, y):
            out, new = fr.apply(model, fr.State(p, b), x)
            return F.cross_entropy(out, y), new.buffers

        step = fr.distributed.grad_and_value(loss_fn, has_aux=True)
        rows = []
        for x, y in _batches(steps, batch, seed=100 + rank):  # each rank its own data
            opt.zero_grad(set_to_none=True)
            ref = F.cross_entropy(ddp(x), y)
            ref.backward()
            opt.step()
            buffers = fr.distributed.sync_buffers(buffers)  # DDP's buffer policy
            grads, (loss, buffers) = step(params, buffers, x, y)
            params = {k: p - LR * grads[k] for k, p in params.items()}
            mod = ddp.module
            rows.append(
                (
                    float(loss),
                    float(ref.detach()),
                    _max_diff(params, dict(mod.named_parameters())),
                    _max_diff(buffers, dict(mod.named_buffers())),
                )
            )
        out.put((rank, rows))
    finally:
        dist.destroy_process_group()


def _two_processes(steps: int, batch: int, tol: float, timeout: float = 120.0) -> bool:
    # a file store: no listening socket at all for the rendezvous
    store = os.path.join(tempfile.mkdtemp(prefix="freplicate-demo-"), "store")
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    print(
        "\n3. fr.distributed.grad_and_value  vs  DistributedDataParallel, 2 gloo ranks on 127.0.0.1"
    )
    procs = [ctx.Process(target=_rank, args=(r, store, steps, batch, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    shutil.rmtree(os.path.dirname(store), ignore_errors=True)
    if alive or any(p.exitcode != 0 for p in procs):
        print(f"   the ranks did not finish cleanly (exit codes {[p.exitcode for p in procs]})")
        return False
    results = dict(out.get() for _ in procs)
    print(
        f"   {'step':>4} {'rank':>4} {'loss (fr)':>12} {'loss (DDP)':>12} {'max |Δ params|':>16} {'max |Δ buffers|':>16}"
    )
    ok = True
    for i in range(steps):
        for r in (0, 1):
            loss, ref, dpar, dbuf = results[r][i]
            ok &= dpar < tol and dbuf < tol and abs(loss - ref) < tol
            print(f"   {i:>4} {r:>4} {loss:>12.6f} {ref:>12.6f} {dpar:>16.2e} {dbuf:>16.2e}")
    return ok
