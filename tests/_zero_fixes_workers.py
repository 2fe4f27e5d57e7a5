"""Rank-side code of tests/test_zero_fixes.py: ZeRO-2/3 misuses fixed, on gloo ranks.

The scenarios register with ``_dist_workers`` and run through its spawner
(loopback only, a file store, bounded timeouts, stragglers killed). The
oracles are PyTorch's stateful designs on the same initial values and the
same per-rank batches: ``DistributedDataParallel`` + ``torch.optim.AdamW``,
and FSDP2 (``fully_shard`` on a 1-D CPU ``DeviceMesh``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist_workers import _main, scenario, snapshot, spawn, unchanged
from _zero3_workers import outcome
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import freplicate as fr
from freplicate._distributed import _plans, _wire


def main(*args: Any) -> None:
    _main(*args)


def run(names: list[str], *, world: int = 2, **kwargs: Any) -> dict[str, list[Any]]:
    return spawn(names, target=main, world=world, **kwargs)


# --- the model ------------------------------------------------------------------------------

WIDTH, HIDDEN, STEPS, LR, WD = 8, 301, 6, 1e-2, 1e-2


class Unit(nn.Module):
    """A Linear and a 0-dim gain: a whole parameter inside a unit."""

    def __init__(self, i: int, o: int) -> None:
        super().__init__()
        self.fc = nn.Linear(i, o)
        self.gain = nn.Parameter(torch.tensor(0.5 + i / 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x)) * self.gain


class Model(nn.Module):
    """Two units, and outside them a 0-dim scale and a 1-row parameter (ranks past 0 hold none
    of its rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Unit(WIDTH, HIDDEN)
        self.b = Unit(HIDDEN, WIDTH)
        self.scale = nn.Parameter(torch.tensor(1.25))
        self.row = nn.Parameter(torch.linspace(-1.0, 1.0, WIDTH).unsqueeze(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) * self.scale + self.row


UNITS = ["a", "b"]
WHOLE = ("a.gain", "b.gain", "scale")


def model() -> Model:
    torch.manual_seed(0)
    return Model()


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(5, WIDTH, generator=g), torch.randn(5, WIDTH, generator=g)


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


# --- the loops ------------------------------------------------------------------------------


def ddp_loop(rank: int) -> list[dict[str, torch.Tensor]]:
    own = model()
    ddp = DistributedDataParallel(own)
    opt = torch.optim.AdamW(own.parameters(), lr=LR, weight_decay=WD)
    seen = []
    for s in range(STEPS):
        x, y = batch(rank, s)
        opt.zero_grad()
        loss_of(ddp(x), y).backward()
        opt.step()
        seen.append({k: p.detach().clone() for k, p in own.named_parameters()})
        seen[-1].update({"grad " + k: own.get_parameter(k).grad.clone() for k in WHOLE})
    return seen


def zero3_loop(rank: int) -> list[dict[str, torch.Tensor]]:
    """docs/sharding.md's loop: torch.optim.AdamW on the shards, apply_sharded's gradients."""
    own = model()
    start = fr.state(own).params
    shards = {k: t.clone().requires_grad_() for k, t in fr.distributed.shard(start).items()}
    opt = torch.optim.AdamW(shards.values(), lr=LR, weight_decay=WD)
    seen = []
    for s in range(STEPS):
        x, y = batch(rank, s)
        opt.zero_grad()
        out, _ = fr.distributed.apply_sharded(own, fr.State(shards, {}), x, units=UNITS)
        loss_of(out, y).backward()
        opt.step()
        seen.append(_full({k: t.detach() for k, t in shards.items()}, start))
        seen[-1].update({"grad " + k: shards[k].grad.clone() for k in WHOLE})
    return seen


def zero2_loop(rank: int) -> list[dict[str, torch.Tensor]]:
    """ZeRO-2: the gradients' shards (grad_and_value(shard=True)), AdamW on the shards, gathered."""
    own = model()
    full = fr.state(own).params
    shards = {k: t.clone() for k, t in fr.distributed.shard(full).items()}
    opt = torch.optim.AdamW(shards.values(), lr=LR, weight_decay=WD)

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        out, _ = fr.apply(own, fr.State(params, {}), x)
        return loss_of(out, y)

    step = fr.distributed.grad_and_value(loss_fn, shard=True)
    seen = []
    for s in range(STEPS):
        grads, _ = step(full, *batch(rank, s))
        for k, t in shards.items():
            t.grad = grads[k]
        opt.step()
        full = fr.distributed.all_gather(shards, full)
        seen.append(_full(shards, full))
        seen[-1].update({"grad " + k: grads[k].clone() for k in WHOLE})
    return seen


def _full(shards: dict[str, torch.Tensor], like: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The whole parameters: the gathered rows, and a 0-dim one as this rank holds it."""
    return {k: v.clone() for k, v in fr.distributed.all_gather(shards, like).items()}


@contextmanager
def real_reduce_scatter() -> Iterator[None]:
    """gloo's own reduce-scatter carries reduce_scatter (as on a backend that has one: NCCL),
    instead of the all-reduce of the whole buffer freplicate chooses on gloo."""
    kind = _wire.REDUCE_SCATTER
    kind.on = lambda backend, nbytes: kind  # type: ignore[method-assign]
    _plans.clear_plans()
    try:
        yield
    finally:
        del kind.on
        _plans.clear_plans()


@scenario
def whole_parameters(rank: int) -> dict[str, Any]:
    """Six AdamW steps of DDP, ZeRO-3 and ZeRO-2 (on gloo's carrier, and ZeRO-2 on a real
    reduce-scatter): every parameter whole after each step, and the 0-dim ones' gradients."""
    out = {"ddp": ddp_loop(rank), "zero3": zero3_loop(rank), "zero2": zero2_loop(rank)}
    with real_reduce_scatter():  # ZeRO-3's gradient goes through the same kind as ZeRO-2's
        out["zero2 real"] = zero2_loop(rank)
    return out


def scattered_tree(rank: int) -> dict[str, torch.Tensor]:
    """0-dim leaves among long ones, of magnitudes that round differently in each order."""
    g = torch.Generator().manual_seed(rank)
    return {
        "long": torch.randn(3000, generator=g) * 1e3,
        "s0": torch.randn((), generator=g),
        "mid": torch.randn(50, 7, generator=g),
        "s1": torch.randn((), generator=g) * 1e-3,
    }


@scenario
def reduce_scatter_whole(rank: int) -> dict[str, Any]:
    """reduce_scatter of 0-dim leaves among long ones, op sum and mean, on gloo's carrier and on
    gloo's own reduce-scatter: this rank's results."""
    tree = scattered_tree(rank)
    out = {}
    for op in ("sum", "mean"):
        out[op] = fr.distributed.reduce_scatter(tree, op=op)
        with real_reduce_scatter():
            out[op + " real"] = fr.distributed.reduce_scatter(tree, op=op)
    return out


# --- compiled, with parameters outside every unit -------------------------------------------


class Small(nn.Module):
    """One unit, and outside it 0-dim parameters alone (each rank keeps its own: no gather)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Unit(WIDTH, WIDTH)
        self.scale = nn.Parameter(torch.tensor(1.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * self.scale


def compiled_case(rank: int, backend: str | None) -> Any:
    """A loss calling apply_sharded, compiled with ``backend`` (``None``: eager), and its gradient."""
    torch.manual_seed(0)
    own = Small()
    units = ["a"]
    shards = fr.distributed.shard(fr.state(own).params)
    params = {k: t.clone().requires_grad_() for k, t in shards.items()}
    x, y = batch(rank, 0)

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        out, _ = fr.distributed.apply_sharded(own, fr.State(params, {}), x, units=units)
        return loss_of(out, y)

    torch._dynamo.reset()
    fn = loss_fn if backend is None else torch.compile(loss_fn, backend=backend)
    loss = fn(params, x)
    loss.backward()
    return loss.detach(), {k: t.grad for k, t in params.items()}


@scenario
def compiled_outside(rank: int) -> dict[str, Any]:
    """Eager, and compiled with two backends."""
    return {
        backend: outcome(lambda b=backend: compiled_case(rank, b))
        for backend in (None, "eager", "aot_eager")
    }


# --- a dtype gloo cannot carry ----------------------------------------------------------------

F8 = torch.float8_e4m3fn


class Coded(nn.Module):
    """A Linear scaled by a frozen float8 code (FP8 weights kept for inference, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        code = torch.linspace(-3.0, 3.0, 5 * WIDTH).reshape(5, WIDTH).to(F8)
        self.code = nn.Parameter(code, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.code.float().sum(0)


class CodedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Coded()
        self.b = Coded()  # outside every unit: gathered with the root's parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def coded() -> CodedModel:
    torch.manual_seed(0)
    return CodedModel()


def fsdp2_coded(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    own = coded()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(own.a, mesh=mesh)
    fully_shard(own, mesh=mesh)
    x, y = batch(rank, 0)
    loss = loss_of(own(x), y)
    loss.backward()
    grads = {k: p.grad.full_tensor() for k, p in own.named_parameters() if p.requires_grad}
    return {"loss": loss.detach(), "grads": fr.distributed.shard(grads)}


def zero3_coded(rank: int) -> dict[str, Any]:
    own = coded()
    rows = fr.distributed.shard(fr.state(own).params)
    trainable = {k: t.clone().requires_grad_() for k, t in rows.items() if t.dtype != F8}
    frozen = {k: t.clone() for k, t in rows.items() if t.dtype == F8}
    before = snapshot(frozen)
    x, y = batch(rank, 0)
    out, _ = fr.distributed.apply_sharded(
        own, fr.State({**trainable, **frozen}, {}), x, units=["a"]
    )
    loss = loss_of(out, y)
    loss.backward()
    return {
        "loss": loss.detach(),
        "grads": {k: t.grad for k, t in trainable.items()},
        "unchanged": unchanged(frozen, before),
    }


@scenario
def float8(rank: int) -> dict[str, Any]:
    """ZeRO-3 with frozen float8 parameters beside FSDP2; float8 gathered, broadcast, reduced; an
    unsigned integer reduced as its bits; a dtype gloo has no carrier for."""
    whole = coded().a.code.detach()
    mine = {"code": whole.clone() if rank == 0 else torch.zeros_like(whole)}
    floats = {"w": torch.randn(3), "code": whole}
    counts = {"n": torch.tensor([2**32 - 1 - rank, 7 * rank], dtype=torch.uint32)}
    return {
        "zero3": outcome(lambda: zero3_coded(rank)),
        "fsdp2": outcome(lambda: fsdp2_coded(rank)),
        "whole": whole,
        "all_gather": outcome(
            lambda: fr.distributed.all_gather(
                fr.distributed.shard({"code": whole}), {"code": whole}
            )
        ),
        "broadcast": outcome(lambda: fr.distributed.broadcast(mine)),
        "all_reduce": outcome(lambda: fr.distributed.all_reduce(floats)),
        "reduce_scatter": outcome(lambda: fr.distributed.reduce_scatter(floats)),
        "uint32": outcome(lambda: fr.distributed.all_reduce(counts, op="sum")),
        "int16": outcome(
            lambda: fr.distributed.all_reduce({"k": torch.ones(2, dtype=torch.int16)})
        ),
        "after": outcome(lambda: fr.distributed.all_reduce({"w": torch.ones(2)})),  # still in step
    }


# --- ZeRO-2's gradient shards hold their rows alone ---------------------------------------------


def storage_bytes(tree: dict[str, torch.Tensor]) -> int:
    """The bytes of the distinct storages ``tree``'s tensors keep alive."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tree.values()}
    return sum(seen.values())


@scenario
def gradient_storage(rank: int) -> dict[str, Any]:
    """The storage ZeRO-2's gradient shards (and reduce_scatter's results) keep alive, on gloo's
    all-reduce carrier and on a real reduce-scatter, beside the full gradients' bytes."""
    own = model()
    full = fr.state(own).params

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        out, _ = fr.apply(own, fr.State(params, {}), x)
        return loss_of(out, y)

    local, _ = fr.grad_and_value(loss_fn)(full, *batch(rank, 0))
    out: dict[str, Any] = {"full": sum(t.numel() * t.element_size() for t in full.values())}
    for real in (False, True):
        with real_reduce_scatter() if real else _nothing():
            step = fr.distributed.grad_and_value(loss_fn, shard=True)
            kept = [step(full, *batch(rank, s))[0] for s in range(3)]  # results held, as a loop may
            scattered = fr.distributed.reduce_scatter(local)
            copied = [
                pools.res is not None
                for plan in _plans._PLANS.values()
                if plan.layout.wire.startswith("reduce_scatter")
                for pools in plan.pools
            ]
            out["real" if real else "gloo"] = {
                "step": [storage_bytes(g) for g in kept],
                "reduce_scatter": storage_bytes(scattered),
                "copied out": copied,
                "values": (kept[0], scattered),
                "distinct": len({g["a.fc.weight"].data_ptr() for g in kept}),
            }
    return out


@contextmanager
def _nothing() -> Iterator[None]:
    yield
