"""Rank-side code of tests/test_shard.py: sharded data parallelism (ZeRO-1/2) on gloo ranks.

The scenarios register with ``_dist_workers`` and run through its spawner
(loopback only, a file store, bounded timeouts, stragglers killed), on 2
ranks or, for the padding cases, 3; ``main`` is the ranks' entry point,
which imports this module so that they find them. The oracles are
PyTorch's stateful designs: ``dist.all_reduce`` of each leaf, then
``torch.chunk``'s rows; ``DistributedDataParallel`` (with ``no_sync`` and
``Join``) and its gradients' rows; ``torch.optim.AdamW`` and
``clip_grad_norm_`` on DDP's full gradients; ``ZeroRedundancyOptimizer``.
Each scenario returns what it computed beside what the oracle computed:
the test compares them.
"""

from __future__ import annotations

import copy
import io
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist_workers import (
    _kind,
    _main,
    debug_mode,
    in_debug_mode,
    scenario,
    snapshot,
    spawn,
    unchanged,
)
from _uneven_workers import LR, Calls, loss_of, params_of, sgd_under_join
from torch import nn

import freplicate as fr


def main(*args: Any) -> None:
    _main(*args)


def run(names: list[str], *, world: int = 2, **kwargs: Any) -> dict[str, list[Any]]:
    return spawn(names, target=main, world=world, **kwargs)


def tensor_map(f: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """``f`` of every tensor leaf (and the matching leaves of ``rest``); others as they are."""
    return optree.tree_map(
        lambda x, *r: f(x, *r) if isinstance(x, torch.Tensor) else x, tree, *rest, none_is_leaf=True
    )


def rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """``rank``'s rows of ``t`` as ``torch.chunk`` splits it (a 0-dim tensor whole)."""
    if t.dim() == 0 or t.shape[0] == 0:
        return t
    parts = torch.chunk(t, world)
    return parts[rank] if rank < len(parts) else t[t.shape[0] :]


def rows_of(tree: Any, rank: int, world: int) -> Any:
    return tensor_map(lambda t: rows(t, rank, world), tree)


def everyone(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, obj)
    return got


def outcome(f: Callable[[], Any]) -> tuple[Any, ...]:
    """``("ok", result)`` or ``("raised", builtin type name, message)``."""
    try:
        return ("ok", f())
    except Exception as err:
        return ("raised", _kind(err), str(err))


# --- the primitives ---------------------------------------------------------------------


def floats(rank: int) -> dict[str, Any]:
    """Every floating-point and complex dtype, and every padding case of 2 and 3 ranks."""
    g = torch.Generator().manual_seed(10 + rank)
    shared = torch.randn(3, 2, generator=g)
    return {
        "odd": torch.randn(5, 3, generator=g),  # 5 rows: divides neither 2 nor 3
        "few": torch.randn(2, 4, generator=g),  # fewer rows than 3 ranks
        "one": torch.randn(1, 2, generator=g),  # fewer rows than 2
        "scalar": torch.tensor(rank + 0.25),  # 0-dim: whole on every rank
        "empty": torch.ones(0, 3),
        "hollow": torch.ones(4, 0),  # rows without elements
        "f64": torch.randn(7, generator=g, dtype=torch.float64),
        "f16": torch.randn(3, 2, generator=g).half(),
        "bf16": torch.randn(4, 3, generator=g).bfloat16(),
        "c64": torch.randn(4, generator=g, dtype=torch.complex64),
        "c128": torch.randn(3, 2, generator=g, dtype=torch.complex128),
        "transposed": torch.randn(3, 4, generator=g).t(),  # not contiguous
        "param": nn.Parameter(torch.randn(3, generator=g)),
        "tied": [shared, shared],
        "name": "w",
        "none": None,
        "k": 7,
    }


def integers(rank: int) -> dict[str, Any]:
    """Every integer dtype gloo reduces (not int16) and bool (``op="sum"`` only); sums that fit."""
    g = torch.Generator().manual_seed(20 + rank)
    return {
        "i64": torch.randint(-1000, 1000, (5, 2), generator=g),
        "i32": torch.randint(-1000, 1000, (3,), generator=g, dtype=torch.int32),
        "i8": torch.randint(-40, 40, (5,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 80, (2, 3), generator=g, dtype=torch.uint8),
        "bool": torch.tensor([rank == 0, False, rank == 1, True, False]),
        "count": torch.tensor(rank + 3),
    }


def stateful_sum(tree: Any) -> Any:
    """The oracle's reduction: ``dist.all_reduce`` of a copy of every leaf (bools: a logical or)."""

    def one(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.bool:
            u = t.to(torch.uint8)
            dist.all_reduce(u, op=dist.ReduceOp.MAX)
            return u.bool()
        c = t.detach().clone()
        if c.is_complex():
            dist.all_reduce(torch.view_as_real(c))
        else:
            dist.all_reduce(c)
        return c

    return tensor_map(one, tree)


def pieced(everyone: list[Any], rank: int) -> Any:
    """Every rank's own rows of its own tree, put together (a 0-dim leaf: this rank's)."""
    world = len(everyone)

    def cat(t: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return (t, *others)[rank]
        return torch.cat([rows(x, r, world) for r, x in enumerate((t, *others))])

    return tensor_map(cat, everyone[0], *everyone[1:])


def primitives_of(
    tree_of: Callable[[int], Any], rank: int, world: int, op: str, **options: Any
) -> dict[str, Any]:
    """reduce_scatter, shard and all_gather of ``tree_of(rank)`` beside their oracles."""
    tree = tree_of(rank)
    same = tree_of(0)  # a tree equal on every rank, as replicated parameters are
    snap = snapshot((tree, same))
    scattered = fr.distributed.reduce_scatter(tree, op=op, **options)
    reduced = fr.distributed.all_reduce(tree, op=op, **options)
    mine = fr.distributed.shard(tree)
    gathered = fr.distributed.all_gather(mine, tree)
    regathered = fr.distributed.all_gather(scattered, tree)
    replicated = fr.distributed.all_gather(fr.distributed.shard(same), same)
    total = stateful_sum(tree)
    if op == "mean":
        total = tensor_map(lambda t: t / world, total)
    inputs = [x for x in optree.tree_leaves((tree, same)) if isinstance(x, torch.Tensor)]
    outputs = [
        x
        for out in (scattered, gathered, regathered, replicated)
        for x in optree.tree_leaves(out)
        if isinstance(x, torch.Tensor)
    ]
    return {
        "scattered": scattered,
        "of_all_reduce": rows_of(reduced, rank, world),  # shard(all_reduce(tree)), by torch.chunk
        "stateful": rows_of(total, rank, world),  # dist.all_reduce, then torch.chunk
        "shard": mine,
        "chunk": rows_of(tree, rank, world),
        "gathered": gathered,
        "pieced": pieced([tree_of(r) for r in range(world)], rank),
        "replicated": replicated,
        "same": same,
        "regathered": regathered,
        "reduced": reduced,
        "unchanged": unchanged((tree, same), snap),
        # the shards are views of the tree's own tensors; the collectives' results are fresh
        "views": all(
            s.numel() == 0 or s.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
            for s, t in zip(optree.tree_leaves(mine), optree.tree_leaves(tree))
            if isinstance(t, torch.Tensor)
        ),
        "fresh": all(
            o.numel() == 0 or all(o.data_ptr() != i.data_ptr() for i in inputs if i.numel())
            for o in outputs
            if o.dim()  # a 0-dim leaf of all_gather is this rank's own, as it is
        ),
        "passed": [
            out["name"] is tree["name"] and out["k"] is tree["k"] and out["none"] is None
            for out in (scattered, mine, gathered)
            if "name" in tree
        ],
        "tied": [
            out["tied"][0] is out["tied"][1] for out in (scattered, gathered) if "tied" in tree
        ],
        "shard_tied": "tied" not in tree or mine["tied"][0] is mine["tied"][1],
    }


@scenario
def primitives(rank: int) -> dict[str, Any]:
    """Every dtype and padding case, one bucket and a bucket per leaf, and compressed buckets."""
    world = dist.get_world_size()
    return {
        "mean": primitives_of(floats, rank, world, "mean"),
        "sum": primitives_of(floats, rank, world, "sum"),
        "ints": primitives_of(integers, rank, world, "sum"),
        "tiny": primitives_of(floats, rank, world, "mean", bucket_cap_mb=1e-5),
        "bf16": primitives_of(floats, rank, world, "mean", compress="bf16"),
        "fp16": primitives_of(floats, rank, world, "sum", compress="fp16"),
        "fp16_tiny": primitives_of(
            floats, rank, world, "mean", compress="fp16", bucket_cap_mb=1e-5
        ),
        "empty_tree": fr.distributed.reduce_scatter({"n": 3, "s": "x"}),
        "world": world,
    }


@scenario
@in_debug_mode  # layouts run before, in other scenarios: ranks part ways after first use
def mismatches(rank: int) -> dict[str, Any]:
    """Trees that differ across ranks: ``ValueError`` on every rank, then the group still works."""
    world = dist.get_world_size()
    like = {"w": torch.ones(5, 3), "b": torch.ones(4)}
    good = fr.distributed.shard(like)
    wrong = dict(good)
    if rank == 1:  # rank 1 gives a shard of the wrong shape: rank 0's rows
        wrong["w"] = torch.ones(3, 3)
    return {
        "rs_shape": outcome(
            lambda: fr.distributed.reduce_scatter({"a": torch.ones(3), "b": torch.ones(2 + rank)})
        ),
        "rs_structure": outcome(
            lambda: fr.distributed.reduce_scatter(
                {"a": torch.ones(3), "c": torch.ones(2)} if rank else {"a": torch.ones(3)}
            )
        ),
        "rs_dtype": outcome(
            lambda: fr.distributed.reduce_scatter(
                {"a": torch.ones(3, dtype=torch.float64 if rank else torch.float32)}
            )
        ),
        "rs_options": outcome(
            lambda: fr.distributed.reduce_scatter(
                {"a": torch.ones(3)}, op="sum" if rank else "mean"
            )
        ),
        "ag_like_shape": outcome(
            lambda: fr.distributed.all_gather(
                fr.distributed.shard({"w": torch.ones(4 + rank)}), {"w": torch.ones(4 + rank)}
            )
        ),
        "ag_wrong_shard": outcome(lambda: fr.distributed.all_gather(wrong, like)),
        "ag_structure": outcome(lambda: fr.distributed.all_gather({"w": good["w"]}, like)),
        "ag_dtype": outcome(
            lambda: fr.distributed.all_gather({**good, "b": good["b"].double()}, like)
        ),
        "different_functions": outcome(
            lambda: (
                fr.distributed.all_gather(good, like)
                if rank
                else fr.distributed.reduce_scatter(like)
            )
        ),
        "rs_mean_of_ints": outcome(
            lambda: fr.distributed.reduce_scatter({"i": torch.ones(3, dtype=torch.int64)})
        ),
        "rs_sparse": outcome(
            lambda: fr.distributed.reduce_scatter({"s": torch.eye(3).to_sparse()}, op="sum")
        ),
        "after": fr.distributed.all_gather(
            fr.distributed.reduce_scatter({"x": torch.full((world + 1,), float(rank))}, op="sum"),
            {"x": torch.ones(world + 1)},
        ),
    }


@scenario
def no_warnings(rank: int) -> list[str]:
    """The eager collectives warn of nothing (torch 2.13 deprecated the names of two of them)."""
    like = {"w": torch.ones(5, 3), "s": torch.tensor(1.0)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fr.distributed.all_gather(fr.distributed.reduce_scatter(like), like)
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def collectives(tree: Any, ints: Any) -> dict[str, Any]:
    """One call of each layout: a second call of a layout in the same trace meets the race of
    ``compiled_check_race`` (reported)."""
    mine = fr.distributed.shard(tree)
    scattered = fr.distributed.reduce_scatter(tree)
    return {
        "scattered": scattered,
        "sum": fr.distributed.reduce_scatter(ints, op="sum", bucket_cap_mb=1e-5),
        "bf16": fr.distributed.reduce_scatter(tree, compress="bf16"),
        "shard": mine,
        "regathered": fr.distributed.all_gather(scattered, tree),
        "int_gathered": fr.distributed.all_gather(fr.distributed.shard(ints), ints),
    }


@scenario
def large_all_gather(rank: int) -> dict[str, Any]:
    """An all-gather of 4 MiB and more, which gloo carries as an all-reduce of the rows with
    -0.0 elsewhere (``_wire.AllGatherBySum``): the full tensors bit for bit (-0.0 kept), eager
    and compiled, the inputs untouched, and its transpose (a sum's: every rank's cotangent rows
    summed) under autograd, eager and with the forward compiled."""
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(11)
    full = {
        "w": torch.randn(1027, 1024, generator=g),  # 4.01 MiB; rows divide by neither 2 nor 3
        "z": torch.tensor([-0.0, 0.0, -1.5, 2.0, -0.0]),
    }
    cot = {k: torch.randn(v.shape, generator=g) for k, v in full.items()}
    mine = {k: v.clone() for k, v in fr.distributed.shard(full).items()}
    snap = snapshot(mine)
    gather = lambda m: fr.distributed.all_gather(m, full)  # noqa: E731
    compiled = torch.compile(gather, backend="eager", fullgraph=True)

    def transpose(fn: Callable[[Any], Any]) -> dict[str, torch.Tensor]:
        m = {k: v.clone().requires_grad_() for k, v in mine.items()}
        out = fn(m)
        loss = sum((out[k] * cot[k]).sum() for k in out)
        return dict(zip(m, torch.autograd.grad(loss, list(m.values()))))

    rows = fr.distributed.shard(cot)
    eager = gather(mine)
    from freplicate._distributed import _plans

    return {
        "eager": eager,
        "wires": sorted({plan.layout.wire for plan in _plans._PLANS.values()}),
        "compiled": compiled(mine),
        "full": full,
        "signs": [torch.signbit(gather(mine)["z"]), torch.signbit(full["z"])],
        "unchanged": unchanged(mine, snap),
        "grad": transpose(gather),
        "grad_compiled": transpose(compiled),
        "expected_grad": {k: world * v for k, v in rows.items()},
    }


@scenario
def primitives_compiled(rank: int) -> dict[str, Any]:
    """The primitives traced whole (``fullgraph=True``: no break) and run, beside the eager calls."""
    torch._dynamo.reset()
    tree = {k: v for k, v in floats(rank).items() if k != "param"}
    ints = integers(rank)
    snap = snapshot((tree, ints))
    compiled = torch.compile(collectives, backend="eager", fullgraph=True)(tree, ints)
    return {
        "compiled": compiled,
        "eager": collectives(tree, ints),
        "unchanged": unchanged((tree, ints), snap),
        "tied": compiled["scattered"]["tied"][0] is compiled["scattered"]["tied"][1],
    }


@scenario
@in_debug_mode  # layouts run before, in other scenarios: ranks part ways after first use
def mismatch_compiled(rank: int) -> Any:
    """Compiled: trees that differ across ranks, a ValueError on every rank as the graph is traced."""
    torch._dynamo.reset()
    scatter = torch.compile(fr.distributed.reduce_scatter, backend="eager")
    gather = torch.compile(fr.distributed.all_gather, backend="eager")
    return {
        "scatter": outcome(lambda: scatter({"sm": torch.ones(3 + rank)})),
        "gather": outcome(lambda: gather({"gm": torch.ones(2)}, {"gm": torch.ones(4 + rank)})),
        "after": scatter({"ok": torch.full((4,), float(rank))}, op="sum"),
    }


# --- ZeRO-2 gradients against DDP -------------------------------------------------------


class ShardNet(nn.Module):
    """Rows that pad on 2 and 3 ranks (16, 5 and 3 of them), and a 0-dim parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 5)
        self.fc3 = nn.Linear(5, 3)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.relu(self.fc1(x))))) * self.scale


def net() -> nn.Module:
    torch.manual_seed(0)
    return ShardNet()


def batch(rank: int, step: int, rows: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(rows, 8, generator=g), torch.randint(0, 3, (rows,), generator=g)


def grads_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in module.named_parameters() if p.grad is not None}


def ddp_of(model: nn.Module, **options: Any) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(copy.deepcopy(model), **options)


@scenario
def zero2_grads(rank: int) -> dict[str, Any]:
    """One step's shards against the rows of DDP's gradients, with one bucket, a bucket per
    tensor (launched from hooks during the backward pass) and a few; compressed; summed."""
    world = dist.get_world_size()
    model = net()
    params = fr.state(model).params
    loss_fn = loss_of(model)
    x, y = batch(rank, 0)
    out: dict[str, Any] = {}
    for cap in (25.0, 1e-6, 0.0005):
        ddp = ddp_of(model, bucket_cap_mb=cap)
        F.cross_entropy(ddp(x), y).backward()
        snap = snapshot((params, x, y))
        with Calls("all_reduce") as scatters:  # on gloo a reduce-scatter travels as one
            grads, value = fr.distributed.grad_and_value(loss_fn, shard=True, bucket_cap_mb=cap)(
                params, x, y
            )
        full, _ = fr.distributed.grad_and_value(loss_fn, bucket_cap_mb=cap)(params, x, y)
        local, local_value = fr.grad_and_value(loss_fn)(params, x, y)
        out[cap] = {
            "grads": grads,
            "ddp_rows": rows_of(grads_of(ddp.module), rank, world),
            "of_full": fr.distributed.shard(full),
            "of_local": fr.distributed.reduce_scatter(local, bucket_cap_mb=cap),
            "value": value,
            "local_value": local_value,
            "inside": scatters.inside,
            "unchanged": unchanged((params, x, y), snap),
        }
    step = fr.distributed.grad_and_value(loss_fn, shard=True, compress="bf16")
    full = fr.distributed.grad_and_value(loss_fn, compress="bf16")
    out["bf16"] = (step(params, x, y)[0], fr.distributed.shard(full(params, x, y)[0]))
    step = fr.distributed.grad_and_value(loss_fn, shard=True, op="sum")
    full = fr.distributed.grad_and_value(loss_fn, op="sum")
    out["sum"] = (step(params, x, y)[0], fr.distributed.shard(full(params, x, y)[0]))
    return out


def micro_of(rank: int, s: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [batch(rank, 10 * s + k, 4) for k in range(3)]


@scenario
def zero2_accumulate(rank: int) -> dict[str, Any]:
    """Three micro-batches, one reduce-scatter: against the rows of DDP's gradients after
    ``no_sync`` on the first two, with one bucket and several."""
    world = dist.get_world_size()
    model = net()
    params = fr.state(model).params
    out: dict[str, Any] = {}
    for cap in (25.0, 0.0005):
        ddp = ddp_of(model, bucket_cap_mb=cap)
        micro = micro_of(rank, 0)
        with ddp.no_sync():
            for x, y in micro[:-1]:
                F.cross_entropy(ddp(x), y).backward()
        F.cross_entropy(ddp(*micro[-1][:1]), micro[-1][1]).backward()
        step = fr.distributed.grad_and_value(loss_of(model), shard=True, bucket_cap_mb=cap)
        with Calls("all_reduce") as scatters:  # on gloo a reduce-scatter travels as one
            grads, values = step.accumulate(params, micro)
        unsharded = fr.distributed.grad_and_value(loss_of(model), bucket_cap_mb=cap)
        out[cap] = {
            "grads": grads,
            "ddp_rows": rows_of(grads_of(ddp.module), rank, world),
            "of_full": fr.distributed.shard(unsharded.accumulate(params, micro)[0]),
            "values": len(values),
            "inside": scatters.inside,
            "generator": step.accumulate(params, iter(micro), count=3)[0],  # reduced after the last
        }
    return out


def zero2_sgd(params: Any, mine: Any, grads: Any) -> tuple[Any, Any]:
    """SGD on this rank's shard (``torch.optim.SGD``'s own operation), then the full parameters."""
    mine = {k: p.add(grads[k], alpha=-LR) for k, p in mine.items()}
    return fr.distributed.all_gather(mine, params), mine


@scenario
def zero2_join(rank: int) -> dict[str, Any]:
    """5 batches on rank 0, 3 on rank 1: ZeRO-2 SGD with ``join`` and ``skip`` against DDP under
    ``Join``, step by step."""
    model = net()
    data = [batch(rank, i) for i in range([5, 3][rank])]
    ddp_steps = sgd_under_join(ddp_of(model), data)

    params = fr.state(model).params
    mine = fr.distributed.shard(params)
    step = fr.distributed.grad_and_value(loss_of(model), shard=True)
    fr_steps, skipped = [], 0
    for b in fr.distributed.join(data):
        if b is None:
            grads, _ = step.skip(params)
            skipped += 1
        else:
            grads, _ = step(params, *b)
        params, mine = zero2_sgd(params, mine, grads)
        fr_steps.append(params)
    return {"fr": fr_steps, "ddp": ddp_steps, "skipped": skipped}


@scenario
def zero2_weighted(rank: int) -> dict[str, Any]:
    """Batches of 6 and 2 rows, ``weight=`` the rows: the shards of the full-batch gradient over
    both ranks' examples (and of the unsharded weighted step); accumulated, the same."""
    world = dist.get_world_size()
    model = net()
    loss_fn = loss_of(model)
    params = fr.state(model).params
    weight = lambda p, x, y: x.shape[0]  # noqa: E731
    sharded = fr.distributed.grad_and_value(loss_fn, shard=True, weight=weight)
    unsharded = fr.distributed.grad_and_value(loss_fn, weight=weight)
    rows_per_rank = [6, 2]
    mine = batch(rank, 0, rows_per_rank[rank])
    xs, ys = (torch.cat(p) for p in zip(*(batch(r, 0, n) for r, n in enumerate(rows_per_rank))))
    full_batch = fr.grad_and_value(loss_fn)(params, xs, ys)[0]
    micro = micro_of_sizes(rank)
    xm, ym = (torch.cat(p) for p in zip(*(b for r in range(world) for b in micro_of_sizes(r))))
    return {
        "step": (sharded(params, *mine)[0], fr.distributed.shard(unsharded(params, *mine)[0])),
        "full_batch": rows_of(full_batch, rank, world),
        # rank 1 has no batch: the weighted mean over rank 0's examples alone
        "skip": (
            sharded.skip(params)[0] if rank else sharded(params, *mine)[0],
            fr.distributed.shard(
                unsharded.skip(params)[0] if rank else unsharded(params, *mine)[0]
            ),
            rows_of(fr.grad_and_value(loss_fn)(params, *batch(0, 0, 6))[0], rank, world),
        ),
        "accumulate": (
            sharded.accumulate(params, micro)[0],
            fr.distributed.shard(unsharded.accumulate(params, micro)[0]),
            rows_of(fr.grad_and_value(loss_fn)(params, xm, ym)[0], rank, world),
        ),
    }


def micro_of_sizes(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [batch(rank, k, n) for k, n in enumerate([[4, 3], [1]][rank])]


# --- clipping sharded gradients -----------------------------------------------------------

NORMS = (2.0, 1.0, 3.0, 0.5, math.inf, -math.inf, 0.0)


def full_gradients(rank: int) -> dict[str, torch.Tensor]:
    """DDP's reduced gradients of one step (the same on every rank), and a 1-row leaf."""
    model = net()
    ddp = ddp_of(model)
    F.cross_entropy(ddp(batch(rank, 0)[0]), batch(rank, 0)[1]).backward()
    g = torch.Generator().manual_seed(5)
    return {**grads_of(ddp.module), "one": torch.randn(1, 4, generator=g)}


def torch_clip(grads: dict[str, torch.Tensor], max_norm: float, p: float) -> tuple[Any, Any]:
    """``clip_grad_norm_`` on parameters whose ``.grad`` are copies of ``grads``."""
    params = {k: nn.Parameter(torch.zeros_like(g)) for k, g in grads.items()}
    for k, q in params.items():
        q.grad = grads[k].clone()
    total = torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm, norm_type=p)
    return {k: q.grad for k, q in params.items()}, total


@scenario
def clip_against_torch(rank: int) -> dict[str, Any]:
    """The total norm of the full gradient from its shards, and the clipped shards, against
    ``clip_grad_norm_`` on the full gradients, for every kind of norm; the same total on every
    rank; compiled as eager."""
    world = dist.get_world_size()
    full = full_gradients(rank)
    shards = fr.distributed.shard(full)
    snap = snapshot(shards)
    out: dict[str, Any] = {}
    for p in NORMS:
        for max_norm in (0.05, 1e6):
            want, want_total = torch_clip(full, max_norm, p)
            got, total = fr.distributed.clip_grad_norm(shards, max_norm, norm_type=p)
            out[(p, max_norm)] = {
                "got": got,
                "total": total,
                "want": rows_of(want, rank, world),
                "want_total": want_total,
                "totals": everyone(total),
            }
    out["unchanged"] = unchanged(shards, snap)
    torch._dynamo.reset()
    compiled = torch.compile(fr.distributed.clip_grad_norm, backend="eager", fullgraph=True)
    out["compiled"] = (compiled(shards, 0.05), fr.distributed.clip_grad_norm(shards, 0.05))
    with debug_mode():  # the norms' layout is warm on rank 0 only: checked before data moves
        out["mismatch"] = outcome(
            lambda: fr.distributed.clip_grad_norm(
                {**shards, "extra": torch.ones(2)} if rank else shards, 1.0
            )
        )
    out["empty"] = fr.distributed.clip_grad_norm({"n": None, "k": 3}, 1.0)
    out["after"] = fr.distributed.reduce_scatter({"x": torch.ones(world)}, op="sum")
    return out


# --- AdamW loops: ZeRO-2 and ZeRO-1 against DDP + torch.optim.AdamW -----------------------

ALR, WD, STEPS, MAX_NORM = 1e-2, 0.1, 20, 0.3


def adamw_init(params: Any) -> dict[str, Any]:
    zeros = tensor_map(torch.zeros_like, params)
    return {"step": 0, "exp_avg": zeros, "exp_avg_sq": tensor_map(torch.zeros_like, params)}


def adamw(params: Any, grads: Any, state: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """AdamW as tree maps, in ``torch.optim.AdamW``'s single-tensor operations and order (its
    CPU default): decay, both moments, then one ``addcdiv`` with the corrected step size."""
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    step = state["step"] + 1
    step_size = ALR / (1 - beta1**step)
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    m = tensor_map(lambda m, g: torch.lerp(m, g, 1 - beta1), state["exp_avg"], grads)
    v = tensor_map(
        lambda v, g: torch.addcmul(v.mul(beta2), g, g, value=1 - beta2), state["exp_avg_sq"], grads
    )

    def move(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        denom = (v.sqrt() / bias_correction2_sqrt).add(eps)
        return torch.addcdiv(p.mul(1 - ALR * WD), m, denom, value=-step_size)

    return tensor_map(move, params, m, v), {"step": step, "exp_avg": m, "exp_avg_sq": v}


def torchopt_adamw() -> Any:
    import torchopt

    return torchopt.chain(  # torchopt.adamw(ALR, weight_decay=WD), as docs/optimizers.md spells it
        torchopt.transform.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8),
        torchopt.transform.add_decayed_weights(WD),
        torchopt.transform.scale(-ALR),
    )


def stateful(rank: int, kind: str, clip: bool) -> list[dict[str, torch.Tensor]]:
    """DDP + ``torch.optim.AdamW`` (``kind="adamw"``) or + ``ZeroRedundancyOptimizer(AdamW)``."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    ddp = ddp_of(net())
    if kind == "adamw":
        opt: Any = torch.optim.AdamW(ddp.parameters(), lr=ALR, weight_decay=WD)
    else:
        opt = ZeroRedundancyOptimizer(
            ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=ALR, weight_decay=WD
        )
    steps = []
    for i in range(STEPS):
        opt.zero_grad()
        x, y = batch(rank, i)
        F.cross_entropy(ddp(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM)
        opt.step()
        steps.append(params_of(ddp.module))
    return steps


def zero2(rank: int, optimizer: str, clip: bool, steps: int = STEPS) -> list[Any]:
    """The ZeRO-2 loop of docs/sharding.md: parameters replicated, gradients and optimizer state
    sharded (``optimizer``: ``"exact"``, the tree-map AdamW above, or ``"torchopt"``)."""
    model = net()
    params = fr.state(model).params
    step = fr.distributed.grad_and_value(loss_of(model), shard=True)
    mine = fr.distributed.shard(params)
    opt = torchopt_adamw() if optimizer == "torchopt" else None
    opt_state = opt.init(mine) if opt is not None else adamw_init(mine)
    out = []
    for i in range(steps):
        grads, _ = step(params, *batch(rank, i))
        if clip:
            grads, _ = fr.distributed.clip_grad_norm(grads, MAX_NORM)
        if opt is None:
            mine, opt_state = adamw(mine, grads, opt_state)
        else:
            import torchopt

            updates, opt_state = opt.update(grads, opt_state, params=mine, inplace=False)
            mine = torchopt.apply_updates(mine, updates, inplace=False)
        params = fr.distributed.all_gather(mine, params)
        out.append(params)
    return out


def zero1(rank: int, clip: bool) -> list[Any]:
    """ZeRO-1: gradients all-reduced (DDP's), then this rank's shard of them; clipped whole."""
    model = net()
    params = fr.state(model).params
    step = fr.distributed.grad_and_value(loss_of(model))
    mine = fr.distributed.shard(params)
    opt_state = adamw_init(mine)
    out = []
    for i in range(STEPS):
        grads, _ = step(params, *batch(rank, i))
        if clip:  # every rank holds the full gradients: clip them as torch does, bit for bit
            grads, _ = fr.clip_grad_norm(grads, MAX_NORM)
        mine, opt_state = adamw(mine, fr.distributed.shard(grads), opt_state)
        params = fr.distributed.all_gather(mine, params)
        out.append(params)
    return out


@scenario
def adamw_loops(rank: int) -> dict[str, Any]:
    """20 AdamW steps of every side from the same init on the same batches, step by step."""
    norms = []
    ddp = ddp_of(net())
    for i in range(STEPS):  # the gradient norms at the initial parameters: does MAX_NORM clip?
        ddp.zero_grad()
        F.cross_entropy(ddp(batch(rank, i)[0]), batch(rank, i)[1]).backward()
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in ddp.parameters()])))
    return {
        "ddp": stateful(rank, "adamw", False),
        "ddp_clip": stateful(rank, "adamw", True),
        "zero": stateful(rank, "zero", False),
        "zero_clip": stateful(rank, "zero", True),
        "zero2": zero2(rank, "exact", False),
        "zero2_clip": zero2(rank, "exact", True),
        "zero2_torchopt": zero2(rank, "torchopt", False),
        "zero2_torchopt_clip": zero2(rank, "torchopt", True),
        "zero1": zero1(rank, False),
        "zero1_clip": zero1(rank, True),
        "norms": norms,
    }


# --- checkpoints: resumed on another number of ranks --------------------------------------

RESUME_AT, RESUME_STEPS = 5, 10


def saved(obj: Any) -> Any:
    """``obj`` through ``torch.save`` and ``torch.load(weights_only=True)``, as a checkpoint."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def one_rank_steps(params: Any, state: dict[str, Any], start: int, stop: int) -> tuple[Any, Any]:
    """Steps ``start`` to ``stop`` on one process, with the gradient two ranks reduce: each rank's
    batch's gradient, scaled by 1/2 and summed, as the mean of the reduce-scatter sums them."""
    model = net()
    local = fr.grad_and_value(loss_of(model))
    for i in range(start, stop):
        g0, g1 = (local(params, *batch(r, i))[0] for r in range(2))
        grads = {k: g0[k] * 0.5 + g1[k] * 0.5 for k in g0}
        params, state = adamw(params, grads, state)
    return params, state


def full_state(state: dict[str, Any], params: Any) -> dict[str, Any]:
    """The optimizer state put together from every rank's shard (each moment is like params)."""
    return {
        "step": state["step"],
        "exp_avg": fr.distributed.all_gather(state["exp_avg"], params),
        "exp_avg_sq": fr.distributed.all_gather(state["exp_avg_sq"], params),
    }


def zero2_steps(params: Any, state: dict[str, Any], rank: int, start: int, stop: int) -> Any:
    """The ZeRO-2 loop from ``start`` to ``stop``, from the full parameters and this rank's state."""
    step = fr.distributed.grad_and_value(loss_of(net()), shard=True)
    mine = fr.distributed.shard(params)
    for i in range(start, stop):
        grads, _ = step(params, *batch(rank, i))
        mine, state = adamw(mine, grads, state)
        params = fr.distributed.all_gather(mine, params)
    return params, state


@scenario
def resume(rank: int) -> dict[str, Any]:
    """A ZeRO-2 run of 10 steps on 2 ranks, and the same run stopped after 5 and resumed on 1
    process (from the gathered state, and from the ranks' own shards put together), and a run
    of 5 steps on 1 process resumed on 2 ranks (its state sharded)."""
    params = fr.state(net()).params
    start = adamw_init(fr.distributed.shard(params))
    whole, _ = zero2_steps(params, start, rank, 0, RESUME_STEPS)

    # 2 -> 1: every rank gathers the full state (rank 0 would save it), or saves its own shard
    half, state = zero2_steps(params, start, rank, 0, RESUME_AT)
    checkpoint = saved({"params": half, "opt": full_state(state, half)})
    shards = everyone(saved(state))  # each rank's file, as one process would read them all
    put_together = {
        "step": shards[0]["step"],
        **{
            k: tensor_map(
                lambda *rows: rows[0] if rows[0].dim() == 0 else torch.cat(rows),
                *(s[k] for s in shards),
            )
            for k in ("exp_avg", "exp_avg_sq")
        },
    }
    on_one, _ = one_rank_steps(checkpoint["params"], checkpoint["opt"], RESUME_AT, RESUME_STEPS)

    # 1 -> 2: one process trains 5 steps and saves; the ranks load it and shard it
    alone, alone_state = one_rank_steps(params, adamw_init(params), 0, RESUME_AT)
    loaded = saved({"params": alone, "opt": alone_state})
    mine = {
        "step": loaded["opt"]["step"],
        "exp_avg": fr.distributed.shard(loaded["opt"]["exp_avg"]),
        "exp_avg_sq": fr.distributed.shard(loaded["opt"]["exp_avg_sq"]),
    }
    on_two, _ = zero2_steps(loaded["params"], mine, rank, RESUME_AT, RESUME_STEPS)
    return {
        "whole": whole,
        "two_to_one": on_one,
        "full_state": checkpoint["opt"],
        "put_together": put_together,
        "one_to_two": on_two,
        "one_rank_whole": one_rank_steps(params, adamw_init(params), 0, RESUME_STEPS)[0],
    }


@scenario
def compiled_check_race(rank: int) -> Any:
    """Reported: while tracing, a layout agreed before does not wait, so a rank may run ahead to
    the next (new) layout; a peer still at the agreed one takes it for a different tree there
    (``fullgraph=True`` raises; without it the trace breaks, restarts and passes: a silent
    graph break)."""
    torch._dynamo.reset()
    a, b = {"race_a": torch.ones(4)}, {"race_b": torch.ones(6)}
    torch.compile(lambda a: fr.distributed.all_reduce(a), backend="eager")(a)  # a: agreed
    if rank == 0:
        time.sleep(2.0)  # rank 1 reaches b first
    both = torch.compile(
        lambda a, b: (fr.distributed.all_reduce(a), fr.distributed.all_reduce(b)),
        backend="eager",
        fullgraph=True,
    )
    return outcome(lambda: both(a, b))


# --- the whole ZeRO-2 step compiled --------------------------------------------------------


def adamw_counted(params: Any, grads: Any, state: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """AdamW with its step count a float64 tensor (``torch.optim.AdamW(capturable=True)``'s
    arithmetic): a compiled step does not recompile as it counts."""
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    step = state["step"] + 1
    step_size_neg = -(ALR / (1 - beta1**step))
    bias_correction2_sqrt = (1 - beta2**step).sqrt()
    m = tensor_map(lambda m, g: torch.lerp(m, g, 1 - beta1), state["exp_avg"], grads)
    v = tensor_map(
        lambda v, g: torch.addcmul(v.mul(beta2), g, g, value=1 - beta2), state["exp_avg_sq"], grads
    )

    def move(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # the float64 factors rounded to the parameter's dtype (a 0-dim parameter would promote)
        neg, correction = step_size_neg.to(p.dtype), bias_correction2_sqrt.to(p.dtype)
        denom = (v.sqrt() / (correction * neg)).add(eps / neg)
        return p.mul(1 - ALR * WD).addcdiv(m, denom)

    return tensor_map(move, params, m, v), {"step": step, "exp_avg": m, "exp_avg_sq": v}


def zero2_step(model: nn.Module) -> Callable[..., Any]:
    """The ZeRO-2 training step: sharded gradients, clipped, AdamW on the shards, all-gather."""
    grad_fn = fr.distributed.grad_and_value(loss_of(model), shard=True)

    def train_step(params: Any, mine: Any, state: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        grads, loss = grad_fn(params, x, y)
        grads, _ = fr.distributed.clip_grad_norm(grads, MAX_NORM)
        mine, state = adamw_counted(mine, grads, state)
        return fr.distributed.all_gather(mine, params), mine, state, loss

    return train_step


@scenario
def zero2_compiled(rank: int) -> dict[str, Any]:
    """Five steps compiled whole (``fullgraph=True``: no break), counting the graphs, beside the
    same steps eagerly and DDP + AdamW + ``clip_grad_norm_``."""
    torch._dynamo.reset()
    graphs: list[Any] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    model = net()

    def train(step: Callable[..., Any]) -> list[Any]:
        params = fr.state(model).params
        mine = fr.distributed.shard(params)
        state = {  # two trees of zeros: one tree twice would alias at the first call only
            "step": torch.zeros((), dtype=torch.float64),
            "exp_avg": tensor_map(torch.zeros_like, mine),
            "exp_avg_sq": tensor_map(torch.zeros_like, mine),
        }
        out = []
        for i in range(5):
            params, mine, state, _ = step(params, mine, state, *batch(rank, i))
            out.append(params)
        return out

    params = fr.state(model).params
    mine = fr.distributed.shard(params)
    zeros = tensor_map(torch.zeros_like, mine)
    state = {"step": torch.zeros((), dtype=torch.float64), "exp_avg": zeros, "exp_avg_sq": zeros}
    report = torch._dynamo.explain(zero2_step(model))(params, mine, state, *batch(rank, 0))
    torch._dynamo.reset()
    compiled = train(torch.compile(zero2_step(model), backend=backend, fullgraph=True))
    return {
        "explained": (report.graph_count, report.graph_break_count),
        "compiled": compiled,
        "graphs": len(graphs),
        "eager": train(zero2_step(model)),
        "ddp": stateful(rank, "adamw", True)[:5],
    }


@scenario
def compiled_new_shapes(rank: int) -> Any:
    """One compiled function called on trees of new shapes: Dynamo retraces with dynamic sizes,
    which the traced plan specializes (a graph per size, each planned and checked across ranks:
    new sizes that differ across ranks are a mismatch on both)."""
    torch._dynamo.reset()
    reduce = torch.compile(lambda t: fr.distributed.all_reduce(t), backend="eager", fullgraph=True)
    full = float(rank + 1)
    return {
        "sizes": [
            outcome(lambda n=n: reduce({"dyn": torch.full((n, 2), full)})) for n in (3, 5, 7, 5)
        ],
        "mismatch": outcome(lambda: reduce({"dyn": torch.full((9 + rank, 2), full)})),
    }


@scenario
def zero2_methods_compiled(rank: int) -> dict[str, Any]:
    """``skip`` (rank 1 has no batch), ``accumulate`` and ``weight=`` with ``shard=True``, each
    traced whole (``fullgraph=True``), beside the same calls eagerly."""
    torch._dynamo.reset()
    model = net()
    params = fr.state(model).params
    step = fr.distributed.grad_and_value(loss_of(model), shard=True)
    weighted = fr.distributed.grad_and_value(
        loss_of(model), shard=True, weight=lambda p, x, y: x.shape[0]
    )
    x, y = batch(rank, 0, [6, 2][rank])
    micro = micro_of(rank, 0)

    def skip_or_step(p: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        return step.skip(p)[0] if rank == 1 else step(p, x, y)[0]

    calls = {
        "skip": (skip_or_step, (params, x, y)),
        "accumulate": (lambda p, m: step.accumulate(p, m)[0], (params, micro)),
        "weighted": (lambda p, x, y: weighted(p, x, y)[0], (params, x, y)),
    }
    return {
        name: (torch.compile(f, backend="eager", fullgraph=True)(*args), f(*args))
        for name, (f, args) in calls.items()
    }


def _gather_moments(shards: dict[str, torch.Tensor], like: dict[str, torch.Tensor]) -> Any:
    return fr.distributed.all_gather(shards, like)


@scenario
def tied_like(rank: int) -> dict[str, Any]:
    """``all_gather`` of distinct shards into a ``like`` that holds one tensor at two paths
    (moments made from one zeros tree): each path its own rows, eager and compiled; a
    non-tensor leaf comes back as the shards hold it (as without a group), not as like's."""
    zeros = torch.zeros(5, 3)
    like = {"m": zeros, "v": zeros, "w": torch.zeros(2), "count": 0}
    full = {"m": torch.randn(5, 3), "v": torch.randn(5, 3) + 10, "w": torch.randn(2)}
    full = {**fr.distributed.broadcast(full), "count": 7}  # a step count: the shards' comes back
    shards = {k: t.clone() for k, t in fr.distributed.shard(full).items() if k != "count"}
    shards["count"] = 7
    torch._dynamo.reset()
    compiled = torch.compile(_gather_moments, backend="eager", fullgraph=True)(shards, like)
    return {"full": full, "eager": _gather_moments(shards, like), "compiled": compiled}
