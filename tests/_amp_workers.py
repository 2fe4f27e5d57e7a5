"""Rank-side code of tests/test_amp.py: ``fr.GradScaler`` on 2 gloo ranks against GradScaler + DDP.

fp16 autocast on CPU, a huge first scale (every rank overflows until the
scale has backed off), growth after ``growth_interval`` clean steps, and
one step where only rank 1 overflows (a batch of huge values). The
scenarios register with ``_dist_workers`` and run through its spawner;
``main`` is the ranks' entry point, which imports this module so that they
find them.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from _dist_workers import Net, _main, batch, scenario, snapshot, spawn, unchanged
from torch import nn

import freplicate as fr

LR = 0.1
STEPS = 24
ONLY_RANK_1 = 12  # the step at which rank 1 alone overflows (rank 0 would not)
OPTIONS = {"init_scale": 2.0**24, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3}


def main(*args: Any) -> None:
    _main(*args)


def run(names: list[str], **kwargs: Any) -> dict[str, list[Any]]:
    return spawn(names, target=main, **kwargs)


def data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(rank, step)
    if rank == 1 and step == ONLY_RANK_1:
        x = x * 1e5  # float16 activations overflow on this rank only
    return x, y


def forward_loss(model: nn.Module, params: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):  # inside the loss: the backward runs in grad
        out, _ = fr.apply(model, fr.State(params, {}), x)
        return F.cross_entropy(out, y)


def sgd(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: p.add(grads[k], alpha=-LR) for k, p in params.items()}  # SGD's add_(g, alpha=-lr)


@scenario
def scaler_against_ddp(rank: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = Net(batchnorm=False)
    ddp = DistributedDataParallel(copy.deepcopy(model))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    torch_scaler = torch.amp.GradScaler("cpu", **OPTIONS)

    scaler = fr.GradScaler(**OPTIONS)

    def scaled_loss(p: Any, amp: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        loss = forward_loss(model, p, x, y)
        return scaler.scale(amp, loss), loss

    reduced = fr.distributed.grad_and_value(scaled_loss, has_aux=True)
    local = fr.grad_and_value(scaled_loss, has_aux=True)

    def step_reduced(p: Any, amp: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        """Gradients from fr.distributed.grad_and_value: reduced, so they carry a peer's inf."""
        grads, _ = reduced(p, amp, x, y)
        grads, found = scaler.unscale(amp, grads)
        return scaler.step(found, sgd(p, grads), p), scaler.update(amp, found), found

    def step_local(p: Any, amp: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        """Local gradients: the flag is agreed across ranks, then the gradients reduced."""
        grads, _ = local(p, amp, x, y)
        grads, found = scaler.unscale(amp, grads, across_ranks=True)
        grads = fr.distributed.all_reduce(grads)
        return scaler.step(found, sgd(p, grads), p), scaler.update(amp, found), found

    compiled = torch.compile(step_local, backend="eager")
    params = dict(fr.state(model).params)
    paths = {"reduced": step_reduced, "local": step_local, "compiled": compiled}
    trees = {name: (params, scaler.init()) for name in paths}
    snap = snapshot(params)
    record: dict[str, list[Any]] = {"ddp_scale": [], "ddp_tracker": [], "params_equal": []}
    record |= {f"{name}_scale": [] for name in paths} | {f"{name}_found": [] for name in paths}
    record["local_flag"] = []  # this rank's own flag, before the ranks agree
    for i in range(STEPS):
        x, y = data(rank, i)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(ddp(x), y)
        torch_scaler.scale(loss).backward()
        torch_scaler.step(opt)
        torch_scaler.update()
        record["ddp_scale"].append(torch_scaler.get_scale())
        record["ddp_tracker"].append(torch_scaler._get_growth_tracker())
        p, amp = trees["local"]
        record["local_flag"].append(float(scaler.unscale(amp, local(p, amp, x, y)[0])[1]))
        want = {k: p.detach() for k, p in ddp.module.named_parameters()}
        equal = {}
        for name, run_step in paths.items():
            p, amp, found = run_step(*trees[name], x, y)
            trees[name] = (p, amp)
            record[f"{name}_scale"].append(float(amp["scale"]))
            record[f"{name}_found"].append(float(found) != 0)
            equal[name] = all(torch.equal(p[k], want[k]) for k in want)
        record["params_equal"].append(equal)
    record["unchanged"] = unchanged(params, snap)
    return record
