"""Rank-side code of tests/test_precision.py: mixed precision against FSDP2's own policy.

Every scenario trains the same model from the same weights on the same
per-rank batches twice: FSDP2 (``fully_shard`` on each block and on the
root, with a ``MixedPrecisionPolicy``) + ``torch.optim.AdamW``, and
freplicate with the same policy object: ZeRO-3 (``apply_sharded``, a unit
per block) or ZeRO-2 (``fr.distributed.grad_and_value(shard=True)``), each
with ``torch.optim.AdamW`` on this rank's shards in place. It returns both
sides' losses, full parameters and what the wire carried, for the test to
compare.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from _dist_workers import _main, scenario, snapshot, spawn, unchanged
from torch import nn

import freplicate as fr
from freplicate._distributed import _sharded

STEPS = 3
LR = 1e-2


def main(*args: Any) -> None:
    _main(*args)


def run(names: list[str], *, world: int = 2, **kwargs: Any) -> dict[str, list[Any]]:
    return spawn(names, target=main, world=world, deadline=180.0, **kwargs)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h + torch.tanh(self.lin(h)))


class Net(nn.Module):
    """An input layer, three blocks (the units) and a head; 7 rows of every weight."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.layers = nn.ModuleList(Block(7) for _ in range(3))
        self.head = nn.Linear(7, 3)
        self.scale = nn.Parameter(torch.tensor([1.5]))  # one row: a rank of 2 holds none

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h) * self.scale


UNITS = ["layers.0", "layers.1", "layers.2"]


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 5, generator=g), torch.randn(6, 3, generator=g)


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out.float() - y) ** 2).mean()


def policy(name: str) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return {
        "bf16_fp32": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16),
        "bf16_out": MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
        ),
    }[name]


def fsdp2(
    model: nn.Module, mp: Any, rank: int, mesh: Any = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """FSDP2 ``fully_shard`` on each block and on the root (over ``mesh``: default 1-D), the
    same policy (``None``: FSDP2's default), ``torch.optim.AdamW``: the losses and the params."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    own = copy.deepcopy(model)
    mesh = mesh or init_device_mesh("cpu", (dist.get_world_size(),))
    mp = mp or MixedPrecisionPolicy()
    inner = dataclasses.replace(mp, output_dtype=None)  # output_dtype: the root's alone
    for layer in own.layers:
        fully_shard(layer, mesh=mesh, mp_policy=inner)
    fully_shard(own, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(own.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = batch(rank, step)
        loss = loss_of(own(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.full_tensor().detach().clone() for n, p in own.named_parameters()}


def zero3(model: nn.Module, mp: Any, rank: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    like = fr.state(model).params
    shards = fr.distributed.shard(like)
    opt = torch.optim.AdamW(list(shards.values()), lr=LR)

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        out, _ = fr.distributed.apply_sharded(
            model, fr.State(params, {}), x, units=UNITS, mp_policy=mp
        )
        return loss_of(out, y)

    losses = []
    for step in range(STEPS):
        grads, loss = fr.grad_and_value(loss_fn)(shards, *batch(rank, step))
        for n, p in shards.items():
            assert grads[n].dtype == p.dtype, (n, grads[n].dtype)
            p.grad = grads[n]
        opt.step()
        losses.append(loss.item())
    return losses, fr.distributed.all_gather(shards, like)


def zero2(model: nn.Module, mp: Any, rank: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    like = fr.state(model).params
    params = {n: t.detach().clone() for n, t in like.items()}
    shards = fr.distributed.shard(params)
    opt = torch.optim.AdamW(list(shards.values()), lr=LR)

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        x = x.to(mp.param_dtype)  # cast_forward_inputs: the step leaves its arguments alone
        return loss_of(fr.apply(model, fr.State(params, {}), x)[0], y)

    step_fn = fr.distributed.grad_and_value(loss_fn, shard=True, mp_policy=mp)
    losses = []
    for step in range(STEPS):
        grads, loss = step_fn(params, *batch(rank, step))
        for n, p in shards.items():
            p.grad = grads[n]
        opt.step()
        losses.append(loss.item())
        params = fr.distributed.all_gather(shards, like)
    return losses, params


def compare(side: str, mp_name: str, rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    mp = policy(mp_name)
    theirs = fsdp2(model, mp, rank)
    ours = (zero3 if side == "zero3" else zero2)(model, mp, rank)
    return {
        "losses": (ours[0], theirs[0]),
        "max_diff": {n: (ours[1][n] - theirs[1][n]).abs().max().item() for n in theirs[1]},
        "dtypes": {n: str(t.dtype) for n, t in ours[1].items()},
    }


@scenario
def zero3_bf16_fp32(rank: int) -> dict[str, Any]:
    return compare("zero3", "bf16_fp32", rank)


@scenario
def zero3_bf16(rank: int) -> dict[str, Any]:
    return compare("zero3", "bf16", rank)


@scenario
def zero3_bf16_out(rank: int) -> dict[str, Any]:
    return compare("zero3", "bf16_out", rank)


@scenario
def zero2_bf16_fp32(rank: int) -> dict[str, Any]:
    return compare("zero2", "bf16_fp32", rank)


@scenario
def zero2_bf16(rank: int) -> dict[str, Any]:
    return compare("zero2", "bf16", rank)


@scenario
def wire_dtypes(rank: int) -> dict[str, Any]:
    """What the gathers and the reduce-scatters carry, the output's dtype, the shards untouched."""
    torch.manual_seed(0)
    model = Net()
    shards = fr.distributed.shard(fr.state(model).params)
    snap = snapshot(shards)
    sent: list[tuple[str, list[str]]] = []
    plain = _sharded.plain

    def recording(spec: Any, tensors: Any) -> Any:
        sent.append((spec.options.kind, sorted({str(t.dtype) for t in tensors})))
        return plain(spec, tensors)

    _sharded.plain = recording  # type: ignore[assignment]
    pending = _sharded.Pending

    class Recording(pending):  # type: ignore[misc, valid-type]
        def __init__(self, spec: Any, tensors: Any) -> None:
            sent.append((spec.options.kind, sorted({str(t.dtype) for t in tensors})))
            super().__init__(spec, tensors)

    _sharded.Pending = Recording  # type: ignore[misc]
    try:
        x, y = batch(rank, 0)
        out_dtype = []

        def loss_fn(params: dict[str, torch.Tensor]) -> Any:
            out, _ = fr.distributed.apply_sharded(
                model, fr.State(params, {}), x, units=UNITS, mp_policy=policy("bf16_fp32")
            )
            out_dtype.append(str(out.dtype))
            return loss_of(out, y)

        grads, _ = fr.grad_and_value(loss_fn)(shards)
    finally:
        _sharded.plain = plain
        _sharded.Pending = pending  # type: ignore[misc]
    return {
        "sent": sent,
        "out": out_dtype,
        "grads": sorted({str(g.dtype) for g in grads.values()}),
        "unchanged": unchanged(shards, snap),
    }


@scenario
def refusals(rank: int) -> dict[str, Any]:
    """What the policy cannot do where it cannot, said on every rank."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    model = Net()
    shards = fr.distributed.shard(fr.state(model).params)
    x, y = batch(rank, 0)
    got: dict[str, Any] = {}

    def loss_fn(params: dict[str, torch.Tensor]) -> Any:
        out, _ = fr.distributed.apply_sharded(
            model, fr.State(params, {}), x, units=UNITS, mp_policy=policy("bf16_fp32")
        )
        return loss_of(out, y)

    for name, f in {
        "transform": lambda: torch.func.grad(loss_fn)(shards),
        "not_a_policy": lambda: fr.distributed.apply_sharded(
            model, fr.State(shards, {}), x, mp_policy={"param_dtype": torch.bfloat16}
        ),
        "step_output": lambda: fr.distributed.grad_and_value(
            loss_fn, mp_policy=MixedPrecisionPolicy(output_dtype=torch.float32)
        ),
        "step_both": lambda: fr.distributed.grad_and_value(
            loss_fn, compress="fp16", mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        ),
    }.items():
        try:
            f()
            got[name] = ("ok",)
        except Exception as err:
            got[name] = (type(err).__name__, str(err))
    return got
