"""Rank-side code of tests/test_zero3_loop.py: docs/sharding.md's short ZeRO-3 loop on gloo ranks.

The loop under test is the one the ZeRO-3 section opens with: this rank's
rows as tensors of its own (``requires_grad``), ``torch.optim.AdamW`` over
them, and each step ``zero_grad``, ``loss.backward()`` through
``fr.distributed.apply_sharded``, ``step``. Beside it the same steps on
FSDP2 (``fully_shard`` on each unit and on the root, a 1-D ``DeviceMesh``
on ``"cpu"`` over gloo) + ``torch.optim.AdamW``, and on
``DistributedDataParallel`` + ``torch.optim.AdamW``, from the same
parameters and batches. Also: the gradient norm of the shards through
``fr.distributed.clip_grad_norm`` against DDP's ``clip_grad_norm_`` (and
what ``fr.clip_grad_norm`` of the shards gives: this rank's part), and the
advice ``fr.distributed.grad_and_value`` gives when it is wrapped around a
loss that calls ``apply_sharded``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist_workers import _kind, _main, scenario, spawn
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import freplicate as fr

STEPS, LR, WD = 12, 1e-2, 1e-2
UNITS = ["0", "2", "4"]


def main(*args: Any) -> None:
    _main(*args)


def run(names: list[str], *, world: int = 2, **kwargs: Any) -> dict[str, list[Any]]:
    return spawn(names, target=main, world=world, **kwargs)


def net(width: int = 33, classes: int = 3) -> nn.Sequential:
    """docs/sharding.md's model: rows of 33 and 3 divide by 2 unevenly (32 and 4: evenly)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, width),
        nn.Tanh(),
        nn.Linear(width, width),
        nn.Tanh(),
        nn.Linear(width, classes),
    )


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(STEPS)]  # fmt: skip


def short_loop(model: nn.Module, data: Any, clip: float | None = None) -> dict[str, torch.Tensor]:
    """docs/sharding.md's ZeRO-3 loop, as written there (the model on the meta device)."""
    start = fr.state(model).params
    with torch.device("meta"):
        shape = copy.deepcopy(model).to("meta")

    def loss_fn(shards: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        out, _ = fr.distributed.apply_sharded(shape, fr.State(shards, {}), x, units=UNITS)
        return F.cross_entropy(out, y)

    # --- the loop of the docs -------------------------------------------------------
    shards = {k: t.clone().requires_grad_() for k, t in fr.distributed.shard(start).items()}
    opt = torch.optim.AdamW(shards.values(), lr=LR, weight_decay=WD)
    for x, y in data:
        opt.zero_grad()
        loss_fn(shards, x, y).backward()
        if clip is not None:
            grads, _ = fr.distributed.clip_grad_norm({k: t.grad for k, t in shards.items()}, clip)
            for k, t in shards.items():
                t.grad = grads[k]
        opt.step()
    # ---------------------------------------------------------------------------------
    return fr.distributed.all_gather({k: t.detach() for k, t in shards.items()}, start)  # type: ignore[no-any-return]


def fsdp2_loop(model: nn.Module, data: Any, clip: float | None = None) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    own = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for name in UNITS:
        fully_shard(own.get_submodule(name), mesh=mesh)
    fully_shard(own, mesh=mesh)
    _stateful(own, own, data, clip)
    return {k: p.full_tensor().detach() for k, p in own.named_parameters()}


def ddp_loop(model: nn.Module, data: Any, clip: float | None = None) -> dict[str, torch.Tensor]:
    own = copy.deepcopy(model)
    _stateful(own, DistributedDataParallel(own), data, clip)
    return {k: p.detach().clone() for k, p in own.named_parameters()}


def _stateful(own: nn.Module, run: nn.Module, data: Any, clip: float | None) -> None:
    """The stateful loop: ``torch.optim.AdamW`` of ``own``'s parameters, ``run`` the forward."""
    opt = torch.optim.AdamW(own.parameters(), lr=LR, weight_decay=WD)
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(run(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(own.parameters(), clip)
        opt.step()


@scenario
def loops(rank: int) -> dict[str, Any]:
    """The docs' loop, FSDP2 and DDP, 12 AdamW steps, unclipped and clipped; the start untouched."""
    out: dict[str, Any] = {}
    for clip in (None, 0.5):
        model, data = net(), batches(rank)
        before = {k: (p._version, p.detach().clone()) for k, p in model.named_parameters()}
        out[clip] = {
            "fr": short_loop(model, data, clip),
            "fsdp2": fsdp2_loop(model, data, clip),
            "ddp": ddp_loop(model, data, clip),
            "untouched": all(
                p._version == before[k][0] and torch.equal(p, before[k][1])
                for k, p in model.named_parameters()
            ),
        }
    return out


def _first_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """This rank's rows of the mean gradient, through the docs' loop's backward."""
    start = fr.state(model).params
    shape = copy.deepcopy(model).to("meta")
    shards = {k: t.clone().requires_grad_() for k, t in fr.distributed.shard(start).items()}
    out, _ = fr.distributed.apply_sharded(shape, fr.State(shards, {}), x, units=UNITS)
    F.cross_entropy(out, y).backward()
    return {k: t.grad for k, t in shards.items()}  # type: ignore[misc]


@scenario
def norms(rank: int) -> dict[str, Any]:
    """The shards' norm three ways, and DDP's ``clip_grad_norm_`` of the same gradients."""
    model = net()
    x, y = batches(rank)[0]
    grads = _first_grads(model, x, y)
    ddp_model = copy.deepcopy(model)
    ddp = DistributedDataParallel(ddp_model)
    F.cross_entropy(ddp(x), y).backward()
    ddp_norm = torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 0.1)
    clipped, sharded = fr.distributed.clip_grad_norm(grads, 0.1)
    _, local = fr.clip_grad_norm(grads, 0.1)
    like = {k: p.detach() for k, p in ddp_model.named_parameters()}
    return {
        "sharded": sharded,
        "local": local,
        "ddp": ddp_norm,
        "clipped": fr.distributed.all_gather(clipped, like),
        "ddp clipped": {k: p.grad for k, p in ddp_model.named_parameters()},
    }


@scenario
def advice(rank: int) -> dict[str, Any]:
    """``fr.distributed.grad_and_value`` around a loss calling ``apply_sharded``: what it says.

    With rows of 33 and 3 (17 / 16 and 2 / 1 on 2 ranks) the shards' shapes differ across
    ranks; with rows of 32 and 4 they agree and their values differ. A ZeRO-2 tree whose shapes differ otherwise
    (not as shard's rows) gets no word of ZeRO-3.
    """
    out: dict[str, Any] = {}
    for width, classes in ((33, 3), (32, 4)):
        model = net(width, classes)
        shape = copy.deepcopy(model).to("meta")
        shards = fr.distributed.shard(fr.state(model).params)
        x, y = batches(rank)[0]

        def loss_fn(shards: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
            out, _ = fr.distributed.apply_sharded(shape, fr.State(shards, {}), x, units=UNITS)  # noqa: B023
            return F.cross_entropy(out, y)

        try:
            fr.distributed.grad_and_value(loss_fn)(shards, x, y)
            out[width] = ("ok",)
        except Exception as err:
            out[width] = ("raised", _kind(err), str(err))
    # not rows of a split: 3 elements on rank 0, 5 on rank 1 (a split of 8 is 4 and 4)
    params = {"w": torch.ones(3 if rank == 0 else 5)}
    try:
        fr.distributed.grad_and_value(lambda p: p["w"].square().sum())(params)
        out["other"] = ("ok",)
    except Exception as err:
        out["other"] = ("raised", _kind(err), str(err))
    return out
