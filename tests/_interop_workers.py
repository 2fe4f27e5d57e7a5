"""Rank-side code of tests/test_optim_bridge.py and tests/test_ckpt_ddp.py: fr beside DDP's tools.

The scenarios register with ``_dist_workers`` and run through its spawner
(loopback only, a file store, bounded timeouts, stragglers killed) on 2
gloo ranks; ``main`` is the ranks' entry point. The stateful oracle is
``DistributedDataParallel`` with ``torch.optim`` optimizers and
``torch.optim.lr_scheduler`` schedules, on the same model (BatchNorm
statistics, a tied weight, a non-persistent buffer), init and per-rank
batches. Each scenario returns what both designs computed; the tests
compare.

- Optimizers (issue 25, item 7): any ``torch.optim`` optimizer fed
  ``fr.distributed.grad_and_value``'s gradients through ``.grad`` (the
  bridge); torchopt's ``sgd`` with torchopt schedules (close); torchopt's
  ``sgd`` for the direction, a ``torch.optim.lr_scheduler`` for the rate and
  ``p.add(u, alpha=lr)`` for the step (bit for bit).
- Checkpoints (item 8): a DDP checkpoint resumed by freplicate and a
  freplicate checkpoint resumed by DDP, through ``torch.save`` bytes.
"""

from __future__ import annotations

import copy
import io
import math
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist_workers import _main, scenario, spawn
from torch import nn
from torch.optim import lr_scheduler

import freplicate as fr
from freplicate import _checkpoint as ckpt

STEPS, RESUME_AT = 12, 5
LR, MOMENTUM, WD = 0.05, 0.9, 1e-2


def main(*args: Any) -> None:
    _main(*args)


def run(names: list[str], *, world: int = 2, **kwargs: Any) -> dict[str, list[Any]]:
    return spawn(names, target=main, world=world, **kwargs)


class Net(nn.Module):
    """BatchNorm statistics, a weight tied between two layers, and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 16, bias=False)
        self.fc3.weight = self.fc2.weight
        self.head = nn.Linear(16, 3)
        self.register_buffer("scale", torch.tensor(0.5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc2(torch.relu(self.bn(self.fc1(x)))))
        return self.head(torch.tanh(self.fc3(h)) * self.scale)


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)


def ddp_of(model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(copy.deepcopy(model))


def ddp_steps(ddp: nn.Module, opt: Any, sched: Any, steps: range, rank: int) -> list[float]:
    """DDP's loop: zero, forward (rank 0's buffers broadcast first), backward, step, schedule."""
    lrs = []
    for i in steps:
        x, y = batch(rank, i)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        if sched is not None:
            sched.step()
    return lrs


def snapshot_of(module: nn.Module) -> dict[str, Any]:
    return {
        "params": {k: p.detach().clone() for k, p in module.named_parameters()},
        "buffers": {k: b.clone() for k, b in module.named_buffers()},
    }


def fr_step(model: nn.Module) -> Callable[..., Any]:
    """``(params, buffers, x, y) -> (grads, new buffers)``: DDP's gradients and buffer policy."""

    def loss_fn(params: Any, buffers: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        out, new = fr.apply(model, fr.State(params, buffers), x)
        return F.cross_entropy(out, y), new.buffers

    grad = fr.distributed.grad_and_value(loss_fn, has_aux=True)

    def step(params: Any, buffers: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        buffers = fr.distributed.sync_buffers(buffers)  # DDP: rank 0's, before every forward
        grads, (_, buffers) = grad(params, buffers, x, y)
        return grads, buffers

    return step


def shared_bytes(obj: Any) -> bytes:
    """``torch.save`` of rank 0's ``obj``, on every rank: a checkpoint saved by rank 0."""
    blob = [None]
    if dist.get_rank() == 0:
        buf = io.BytesIO()
        torch.save(obj, buf)
        blob = [buf.getvalue()]  # type: ignore[list-item]
    dist.broadcast_object_list(blob, src=0)
    return blob[0]  # type: ignore[return-value]


def load(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob))  # weights_only=True, torch's default


# --- item 7: optimizers and schedules -----------------------------------------------------


def warmup_cosine(opt: Any) -> Any:
    warm = lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3)
    cosine = lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS - 3)
    return lr_scheduler.SequentialLR(opt, [warm, cosine], milestones=[3])


OPTIMIZERS: dict[str, Callable[[Any], Any]] = {
    "SGD(momentum, nesterov, weight_decay)": lambda ps: torch.optim.SGD(
        ps, lr=LR, momentum=MOMENTUM, nesterov=True, weight_decay=WD
    ),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WD),
    "Adam(amsgrad)": lambda ps: torch.optim.Adam(ps, lr=LR, amsgrad=True),
    "RMSprop(momentum, centered)": lambda ps: torch.optim.RMSprop(
        ps, lr=LR / 10, momentum=MOMENTUM, centered=True
    ),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=LR),
    "NAdam": lambda ps: torch.optim.NAdam(ps, lr=LR),
    "RAdam": lambda ps: torch.optim.RAdam(ps, lr=LR),
}
SCHEDULES: dict[str, Callable[[Any], Any]] = {
    "StepLR": lambda opt: lr_scheduler.StepLR(opt, step_size=4, gamma=0.5),
    "LinearLR warm-up, CosineAnnealingLR": warmup_cosine,
    # and the momentum or beta1 cycled too, where the optimizer has one
    "OneCycleLR": lambda opt: lr_scheduler.OneCycleLR(
        opt,
        max_lr=LR,
        total_steps=STEPS,
        cycle_momentum="momentum" in opt.defaults or "betas" in opt.defaults,
    ),
}


def bridge_steps(
    model: nn.Module, opt: Any, sched: Any, buffers: Any, steps: range, rank: int
) -> tuple[Any, list[float]]:
    """fr's gradients into ``.grad`` of the module's parameters, then ``opt.step()``."""
    step = fr_step(model)
    params = fr.state(model).params  # views of the module's parameters: the optimizer's own
    lrs = []
    for i in steps:
        grads, buffers = step(params, buffers, *batch(rank, i))
        for name, p in model.named_parameters():
            p.grad = grads[name]
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        if sched is not None:
            sched.step()
    return buffers, lrs


@scenario
def bridge(rank: int) -> dict[str, Any]:
    """Every optimizer, under the schedules in turn: DDP + torch.optim beside fr + the same."""
    out: dict[str, Any] = {}
    schedules = list(SCHEDULES.items())
    for k, (opt_name, make_opt) in enumerate(OPTIMIZERS.items()):
        for sched_name, make_sched in [schedules[k % len(schedules)]]:
            model = make_net()
            ddp = ddp_of(model)
            ddp_opt = make_opt(ddp.parameters())
            ddp_lrs = ddp_steps(ddp, ddp_opt, make_sched(ddp_opt), range(STEPS), rank)
            opt = make_opt(model.parameters())
            buffers = fr.state(model).buffers
            buffers, lrs = bridge_steps(model, opt, make_sched(opt), buffers, range(STEPS), rank)
            out[(opt_name, sched_name)] = {
                "ddp": snapshot_of(ddp.module),
                "fr": {"params": fr.state(model).params, "buffers": buffers},
                "lrs": (lrs, ddp_lrs),
            }
    return out


def sgd_exact(params: Any, lr_of: Any, steps: range, rank: int, model: nn.Module) -> Any:
    """torchopt's SGD for the direction, a torch scheduler's rate, ``p.add(u, alpha=lr)``."""
    import torchopt

    step = fr_step(model)
    sgd = torchopt.sgd(lr=1.0, momentum=MOMENTUM, nesterov=True, weight_decay=WD)
    opt_state, buffers = sgd.init(params), fr.state(model).buffers
    for i in steps:
        grads, buffers = step(params, buffers, *batch(rank, i))
        updates, opt_state = sgd.update(grads, opt_state, params=params, inplace=False)
        lr = lr_of()
        params = {k: p.add(updates[k], alpha=lr) for k, p in params.items()}
    return params, buffers


@scenario
def torchopt_sgd(rank: int) -> dict[str, Any]:
    """torchopt's SGD (momentum, Nesterov, weight decay) beside DDP + ``torch.optim.SGD``: with
    torchopt's schedules as they are, and exact with a torch scheduler for the rate."""
    import torchopt

    out: dict[str, Any] = {}
    steps = range(STEPS)
    warm = torchopt.schedule.linear_schedule(LR * 0.1, LR, transition_steps=3)

    def cosine(count: Any) -> Any:
        t = (count - 3).clamp(min=0)
        return LR * (1 + torch.cos(math.pi * t / (STEPS - 3))) / 2

    torchopt_schedules = {
        "StepLR": torchopt.schedule.exponential_decay(
            LR, decay_rate=0.5, transition_steps=4, staircase=True
        ),
        "LinearLR warm-up, CosineAnnealingLR": lambda c: torch.where(c < 3, warm(c), cosine(c)),
    }
    for name, schedule in torchopt_schedules.items():
        model = make_net()
        ddp = ddp_of(model)
        ddp_opt = OPTIMIZERS["SGD(momentum, nesterov, weight_decay)"](ddp.parameters())
        ddp_steps(ddp, ddp_opt, SCHEDULES[name](ddp_opt), steps, rank)
        # torchopt's sgd as it is: its schedule in float32 tensors, the step a mul and an add
        step = fr_step(model)
        sgd = torchopt.sgd(lr=schedule, momentum=MOMENTUM, nesterov=True, weight_decay=WD)
        params, buffers = dict(fr.state(model).params), fr.state(model).buffers
        opt_state = sgd.init(params)
        for i in steps:
            grads, buffers = step(params, buffers, *batch(rank, i))
            updates, opt_state = sgd.update(grads, opt_state, params=params, inplace=False)
            params = torchopt.apply_updates(params, updates, inplace=False)
        # exact: the rate from torch's own scheduler, driven on a stand-in optimizer
        holder = torch.optim.SGD([torch.zeros(())], lr=LR)
        sched = SCHEDULES[name](holder)

        def lr_of(holder: Any = holder, sched: Any = sched) -> float:
            lr = holder.param_groups[0]["lr"]
            holder.step()  # nothing to update: the scheduler sees a step taken
            sched.step()
            return lr

        exact, exact_buffers = sgd_exact(dict(fr.state(model).params), lr_of, steps, rank, model)
        out[name] = {
            "ddp": snapshot_of(ddp.module),
            "torchopt": {"params": params, "buffers": buffers},
            "exact": {"params": exact, "buffers": exact_buffers},
        }
    return out


# --- item 8: checkpoints from and to DDP --------------------------------------------------


def adamw_init() -> dict[str, Any]:
    """AdamW's state before its first step, keyed by name as ``optimizer_state_by_name`` keys it."""
    group = torch.optim.AdamW([torch.zeros(())], lr=LR, weight_decay=WD).state_dict()
    return {"state": {}, "param_groups": [{**group["param_groups"][0], "params": []}]}


def adamw(params: Any, grads: Any, named: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``torch.optim.AdamW`` as tree maps over name-keyed state, in its single-tensor operations
    and order (its CPU default): its per-parameter ``step`` tensors, state made at the first step."""
    group = named["param_groups"][0]
    lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    state = named["state"]
    zeros = {k: torch.zeros_like(p, memory_format=torch.preserve_format) for k, p in params.items()}
    steps = {k: state.get("step", {}).get(k, torch.tensor(0.0)) + 1 for k in params}
    m = {k: torch.lerp(state.get("exp_avg", zeros)[k], grads[k], 1 - beta1) for k in params}
    v = {
        k: torch.addcmul(
            state.get("exp_avg_sq", zeros)[k].mul(beta2), grads[k], grads[k], value=1 - beta2
        )
        for k in params
    }
    new = {}
    for k, p in params.items():
        step = float(steps[k])
        denom = (v[k].sqrt() / (1 - beta2**step) ** 0.5).add(eps)
        new[k] = torch.addcdiv(p.mul(1 - lr * wd), m[k], denom, value=-lr / (1 - beta1**step))
    groups = [{**group, "params": list(params)}]
    return new, {"state": {"step": steps, "exp_avg": m, "exp_avg_sq": v}, "param_groups": groups}


def fr_adamw_steps(
    model: nn.Module,
    state: fr.State,
    named: dict[str, Any],
    sched_state: Any,
    steps: range,
    rank: int,
) -> tuple[fr.State, dict[str, Any], Any]:
    """freplicate's loop: DDP's gradients and buffers, AdamW as tree maps, StepLR for the rate."""
    step = fr_step(model)
    holder = torch.optim.SGD([torch.zeros(())], lr=named["param_groups"][0]["lr"])
    sched = SCHEDULES["StepLR"](holder)
    if sched_state is not None:
        sched.load_state_dict(sched_state)
    params, buffers = state
    for i in steps:
        grads, buffers = step(params, buffers, *batch(rank, i))
        params, named = adamw(params, grads, named)
        holder.step()
        sched.step()
        # the rate the scheduler set, as it sets it in the optimizer's group
        named["param_groups"][0].update(
            lr=holder.param_groups[0]["lr"], initial_lr=holder.param_groups[0]["initial_lr"]
        )
    return fr.State(params, buffers), named, sched.state_dict()


def ddp_checkpointed(opt_name: str, sched_name: str | None, rank: int) -> tuple[nn.Module, bytes]:
    """DDP with ``OPTIMIZERS[opt_name]`` (and ``SCHEDULES[sched_name]``): RESUME_AT steps, rank 0's
    checkpoint (``torch.save`` bytes, on every rank), then on to STEPS: the run that never stopped."""
    ddp = ddp_of(make_net())
    opt = OPTIMIZERS[opt_name](ddp.parameters())
    sched = None if sched_name is None else SCHEDULES[sched_name](opt)
    ddp_steps(ddp, opt, sched, range(RESUME_AT), rank)
    saved = {"model": ddp.state_dict(), "optimizer": opt.state_dict()}
    blob = shared_bytes(saved if sched is None else {**saved, "scheduler": sched.state_dict()})
    ddp_steps(ddp, opt, sched, range(RESUME_AT, STEPS), rank)
    return ddp, blob


@scenario
def ddp_checkpoint_into_fr(rank: int) -> dict[str, Any]:
    """DDP + AdamW + StepLR for RESUME_AT steps, saved by rank 0; freplicate resumes from the
    file on another init; DDP's run that never stopped is the oracle."""
    ddp, blob = ddp_checkpointed("AdamW", "StepLR", rank)

    fresh = make_net(seed=1)  # another init: only the checkpoint's tensors count
    saved = load(blob)
    state = ckpt.from_state_dict(fresh, saved["model"])
    named = ckpt.optimizer_state_by_name(saved["optimizer"], list(state.params))
    resumed, _, _ = fr_adamw_steps(
        fresh, state, named, saved["scheduler"], range(RESUME_AT, STEPS), rank
    )
    return {
        "ddp": snapshot_of(ddp.module),
        "fr": {"params": resumed.params, "buffers": resumed.buffers},
        "keys": (list(state.params), list(state.buffers), list(saved["model"])),
        "scale": (float(state.buffers["scale"]), float(fresh.scale)),
    }


@scenario
def fr_checkpoint_into_ddp(rank: int) -> dict[str, Any]:
    """freplicate for RESUME_AT steps, its checkpoint (``to_state_dict``, ``optimizer_state_by_
    index``) beside DDP's own at the same step, then DDP resumes from it; freplicate's run that
    never stopped is the oracle."""
    model = make_net()
    start = fr.state(model)
    state, named, sched_state = fr_adamw_steps(
        model, start, adamw_init(), None, range(RESUME_AT), rank
    )
    blob = shared_bytes(
        {
            "model": ckpt.to_state_dict(model, state),
            "optimizer": ckpt.optimizer_state_by_index(named),
            "scheduler": sched_state,
        }
    )
    straight, _, _ = fr_adamw_steps(model, state, named, sched_state, range(RESUME_AT, STEPS), rank)

    ddp = ddp_of(model)  # DDP's own run to the same step: what its checkpoint holds
    opt = OPTIMIZERS["AdamW"](ddp.parameters())
    sched = SCHEDULES["StepLR"](opt)
    ddp_steps(ddp, opt, sched, range(RESUME_AT), rank)
    saved = load(blob)
    own = load(shared_bytes({"model": ddp.state_dict(), "optimizer": opt.state_dict()}))

    fresh = ddp_of(make_net(seed=1))
    fresh_opt = OPTIMIZERS["AdamW"](fresh.parameters())
    fresh_sched = SCHEDULES["StepLR"](fresh_opt)
    loaded = (
        str(fresh.load_state_dict(saved["model"])),
        fresh_opt.load_state_dict(saved["optimizer"]),
        fresh_sched.load_state_dict(saved["scheduler"]),
    )
    ddp_steps(fresh, fresh_opt, fresh_sched, range(RESUME_AT, STEPS), rank)
    again = load(blob)  # torch.optim's load_state_dict keeps the loaded tensors: DDP moved them
    return {
        "saved": {"model": again["model"], "optimizer": again["optimizer"]},
        "ddp_saved": own,
        "loaded": loaded[0],
        "ddp": snapshot_of(fresh.module),
        "fr": {"params": straight.params, "buffers": straight.buffers},
    }


@scenario
def bridge_resumes_a_ddp_checkpoint(rank: int) -> dict[str, Any]:
    """The bridge resumes DDP's checkpoint as DDP does: the model's state dict through
    ``from_state_dict`` / ``to_state_dict(prefix="")``, the optimizer's as it is."""
    sgd, schedule = "SGD(momentum, nesterov, weight_decay)", "LinearLR warm-up, CosineAnnealingLR"
    ddp, blob = ddp_checkpointed(sgd, schedule, rank)

    fresh = make_net(seed=1)
    saved = load(blob)
    state = ckpt.from_state_dict(fresh, saved["model"])
    fresh.load_state_dict(ckpt.to_state_dict(fresh, state, prefix=""))
    bridge_opt = OPTIMIZERS[sgd](fresh.parameters())
    bridge_sched = SCHEDULES[schedule](bridge_opt)
    bridge_opt.load_state_dict(saved["optimizer"])
    bridge_sched.load_state_dict(saved["scheduler"])
    buffers, _ = bridge_steps(
        fresh, bridge_opt, bridge_sched, state.buffers, range(RESUME_AT, STEPS), rank
    )
    return {
        "ddp": snapshot_of(ddp.module),
        "fr": {"params": fr.state(fresh).params, "buffers": buffers},
    }


@scenario
def torchopt_sgd_resumes_a_ddp_checkpoint(rank: int) -> dict[str, Any]:
    """DDP + SGD(momentum, Nesterov, weight decay) saved; torchopt's SGD resumes from its momentum
    buffers (TraceState, in optree's order of the names): exact once a throwaway update has spent
    torchopt's first-call flag, off without it (the flag is no part of its state)."""
    import torchopt

    ddp, blob = ddp_checkpointed("SGD(momentum, nesterov, weight_decay)", None, rank)
    out: dict[str, Any] = {"ddp": snapshot_of(ddp.module)}
    for spent in (True, False):
        fresh = make_net(seed=1)
        saved = load(blob)
        state = ckpt.from_state_dict(fresh, saved["model"])
        named = ckpt.optimizer_state_by_name(saved["optimizer"], list(state.params))
        sgd = torchopt.sgd(lr=1.0, momentum=MOMENTUM, nesterov=True, weight_decay=WD)
        params = dict(state.params)
        if spent:  # torchopt's trace adds the first gradient to a zero trace: spend that call
            zeros = optree.tree_map(torch.zeros_like, params)
            sgd.update(zeros, sgd.init(params), params=params, inplace=False)
        empty, trace, scale = sgd.init(params)
        trace = trace._replace(trace=optree.tree_leaves(named["state"]["momentum_buffer"]))
        opt_state = (empty, trace, scale)
        step = fr_step(fresh)
        buffers = state.buffers
        for i in range(RESUME_AT, STEPS):
            grads, buffers = step(params, buffers, *batch(rank, i))
            updates, opt_state = sgd.update(grads, opt_state, params=params, inplace=False)
            params = {k: p.add(updates[k], alpha=LR) for k, p in params.items()}
        out["spent" if spent else "fresh"] = {"params": params, "buffers": buffers}
    return out
