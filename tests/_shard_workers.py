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

import warnings
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.distributed as dist
from _dist_workers import _kind, _main, scenario, snapshot, spawn, unchanged
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
    mine = fr.distributed.shard(tree)
    scattered = fr.distributed.reduce_scatter(tree)
    return {
        "scattered": scattered,
        "sum": fr.distributed.reduce_scatter(ints, op="sum", bucket_cap_mb=1e-5),
        "bf16": fr.distributed.reduce_scatter(tree, compress="bf16"),
        "shard": mine,
        "gathered": fr.distributed.all_gather(mine, tree),
        "regathered": fr.distributed.all_gather(scattered, tree),
        "int_gathered": fr.distributed.all_gather(fr.distributed.shard(ints), ints),
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
