"""Rank-side code of tests/test_hsdp.py: hybrid sharding on 4 gloo ranks, a 2 x 2 mesh.

The mesh is FSDP2's (``init_device_mesh("cpu", (2, 2), ("replicate",
"shard"))``): ranks 0, 1 and 2, 3 shard, 0, 2 and 1, 3 replicate. FSDP2
``fully_shard`` on each block and on the root over that mesh is the
stateful twin; freplicate runs ``apply_sharded(group=mesh)`` (and the same
with the pair of groups) with ``torch.optim.AdamW`` on the shards.
"""

from __future__ import annotations

import copy
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from _dist_workers import _main, in_debug_mode, scenario, snapshot, spawn, unchanged
from _precision_workers import STEPS, UNITS, Net, batch, fsdp2, loss_of, policy

import freplicate as fr

LR = 1e-2


def main(*args: Any) -> None:
    _main(*args)


def run(names: list[str], *, world: int = 4, **kwargs: Any) -> dict[str, list[Any]]:
    return spawn(names, target=main, world=world, deadline=240.0, pg_timeout=60.0, **kwargs)


def mesh_2x2() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def zero3(model: Any, group: Any, mp: Any, rank: int) -> tuple[list[float], dict[str, Any]]:
    like = fr.state(model).params
    shards = {
        k: t.clone().requires_grad_() for k, t in fr.distributed.shard(like, group=group).items()
    }
    opt = torch.optim.AdamW(list(shards.values()), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = batch(rank, step)
        out, _ = fr.distributed.apply_sharded(
            model, fr.State(shards, {}), x, units=UNITS, group=group, mp_policy=mp
        )
        loss = loss_of(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    detached = {k: t.detach() for k, t in shards.items()}
    return losses, fr.distributed.all_gather(detached, like, group=group), detached  # type: ignore[return-value]


def compare(rank: int, mp: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    mesh = mesh_2x2()
    theirs = fsdp2(model, mp, rank, mesh)
    ours = zero3(model, mesh, mp, rank)
    pair = zero3(model, (mesh.get_group(0), mesh.get_group(1)), mp, rank)
    x = batch(rank, STEPS)[0]
    with torch.inference_mode():  # an evaluation: no backward, so no replicas to reduce over
        evaluated = fr.distributed.apply_sharded(
            model, fr.State(ours[2], {}), x, units=UNITS, group=mesh, mp_policy=mp
        )[0]
    with torch.no_grad():
        full = copy.deepcopy(model)
        full.load_state_dict(ours[1])
        want = full(x) if mp is None else None
    return {
        "eval_equal": want is None or torch.equal(evaluated, want),
        "losses": (ours[0], theirs[0], pair[0]),
        "max_diff": {n: (ours[1][n] - theirs[1][n]).abs().max().item() for n in theirs[1]},
        "pair_equal": all(torch.equal(ours[1][n], pair[1][n]) for n in ours[1]),
    }


@scenario
def hsdp_fp32(rank: int) -> dict[str, Any]:
    return compare(rank, None)


@scenario
def hsdp_bf16(rank: int) -> dict[str, Any]:
    return compare(rank, policy("bf16_fp32"))


def _scale(m: Any) -> None:
    """The one tensor of ``Net`` no reset makes (``materialize``'s ``init=``)."""
    if isinstance(m, Net):
        m.scale.fill_(1.5)


@scenario
def hsdp_checkpoint(rank: int) -> dict[str, Any]:
    """Trained on the 2 x 2 mesh, saved there; loaded on 4 ranks sharding (1-D) and on 2 x 2."""
    torch.manual_seed(0)
    model = Net()
    mesh = mesh_2x2()
    like = fr.state(model).params
    _, full, shards = zero3(model, mesh, None, rank)  # type: ignore[misc]
    before = snapshot(shards)
    directory = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(directory, src=0)
    fr.distributed.save_sharded(directory[0], shards, like, group=mesh)
    meta = {k: torch.empty_like(t, device="meta") for k, t in like.items()}
    flat = fr.distributed.load_sharded(directory[0], fr.distributed.shard(meta))  # 4 shards
    again = fr.distributed.load_sharded(
        directory[0], fr.distributed.shard(meta, group=mesh), group=mesh
    )
    want_flat = fr.distributed.shard(full)
    want_mesh = fr.distributed.shard(full, group=mesh)
    torch.manual_seed(0)
    with torch.device("meta"):
        meta_model = Net()
    made = fr.distributed.materialize(meta_model, group=mesh, init=_scale)
    start = fr.distributed.shard(fr.state(model).params, group=mesh)
    return {
        "materialized": all(torch.equal(made.params[k], start[k]) for k in like),
        "flat": all(torch.equal(flat[k], want_flat[k]) for k in like),
        "mesh": all(torch.equal(again[k], want_mesh[k]) for k in like),
        "unchanged": unchanged(shards, before),
    }


@scenario
@in_debug_mode
def replicas_that_freeze_differently(rank: int) -> tuple[str, str]:
    """The replicas {0, 2} and {1, 3} disagree on a frozen parameter, each shard group agreeing
    with itself: the all-reduce over the replicas sees it (every call probes in debug mode)."""
    torch.manual_seed(0)
    model = Net()
    mesh = mesh_2x2()
    like = fr.state(model).params
    shards = {
        k: t.clone().requires_grad_() for k, t in fr.distributed.shard(like, group=mesh).items()
    }
    if mesh.get_local_rank(0) == 1:  # the second replica freezes the head
        shards["head.weight"].requires_grad_(False)
    x, y = batch(rank, 0)
    try:
        out, _ = fr.distributed.apply_sharded(
            model, fr.State(shards, {}), x, units=UNITS, group=mesh
        )
        loss_of(out, y).backward()
    except Exception as err:  # the test reads the type and the message
        return type(err).__name__, str(err)
    return "ok", ""


@scenario
def bad_groups(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = Net()
    mesh = mesh_2x2()
    shards = fr.distributed.shard(fr.state(model).params, group=mesh)
    x = batch(rank, 0)[0]
    got = {}
    cube = init_device_mesh("cpu", (1, 2, 2))
    for name, group in {
        "same_twice": (mesh.get_group(1), mesh.get_group(1)),
        "three": (mesh.get_group(0), mesh.get_group(1), mesh.get_group(1)),
        "cube": cube,
        "compiled": mesh,
    }.items():
        call = fr.distributed.apply_sharded
        if name == "compiled":
            call = torch.compile(call, backend="eager")
        try:
            call(model, fr.State(shards, {}), x, units=UNITS, group=group)
            got[name] = ("ok",)
        except Exception as err:  # the test reads the type and the message
            got[name] = (type(err).__name__, str(err))
    return got
