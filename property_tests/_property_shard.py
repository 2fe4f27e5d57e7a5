"""The rank side of the sharding properties (``test_shard.py``), on ``_property_ddp``'s ranks.

The ranks run the checks registered in ``_property_ddp.CHECKS``; the names
of these are ``Check`` strings, whose unpickling in a rank imports this
module, and so registers them there too (the ranks were spawned knowing
only ``_property_ddp``'s own).
"""

from __future__ import annotations

from typing import Any

import optree
import torch
import torch.distributed as dist
from _property_clip import torch_clip
from _property_ddp import CHECKS, WORLD, _ddp_reference, _loss, _tuple
from _property_support import Unchanged, refill

import freplicate as fr
from freplicate.testing import assert_trees_close


class Check(str):
    """A check's name; unpickling it imports this module (see the module's text)."""

    __slots__ = ()


def rows(t: torch.Tensor, rank: int) -> torch.Tensor:
    """``rank``'s rows of ``t`` as ``torch.chunk`` splits it (a 0-dim tensor whole)."""
    if t.dim() == 0 or t.shape[0] == 0:
        return t
    parts = torch.chunk(t, WORLD)
    return parts[rank] if rank < len(parts) else t[t.shape[0] :]


def rows_of(tree: Any, rank: int) -> Any:
    return optree.tree_map(lambda x: rows(x, rank) if isinstance(x, torch.Tensor) else x, tree)


def ties(tree: Any) -> list[tuple[int, int]]:
    """The pairs of leaf positions that hold one tensor object."""
    leaves = optree.tree_leaves(tree)
    first: dict[int, int] = {}
    out = []
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            if id(x) in first:
                out.append((first[id(x)], i))
            first.setdefault(id(x), i)
    return out


def kept(tree: Any, pairs: list[tuple[int, int]]) -> bool:
    leaves = optree.tree_leaves(tree)
    return all(leaves[a] is leaves[b] for a, b in pairs)


def exact(actual: Any, expected: Any) -> None:
    assert_trees_close(actual, expected, rtol=0, atol=0)


def check_reduce_scatter(rank: int, p: dict[str, Any]) -> None:
    """reduce_scatter is the rows of the leaf-wise sum or mean; all_gather puts it together."""
    everyone = [refill(p["tree"], p["seed"] + r) for r in range(WORLD)]
    mine = everyone[rank]
    unchanged = Unchanged(mine)
    options = {"op": p["op"], "bucket_cap_mb": p["bucket_cap_mb"], "compress": p["compress"]}
    got = fr.distributed.reduce_scatter(mine, **options)
    reduced = fr.distributed.all_reduce(mine, **options)
    regathered = fr.distributed.all_gather(got, mine)
    unchanged.check("fr.distributed.reduce_scatter / all_gather")

    def total(*column: Any) -> Any:
        if not isinstance(column[0], torch.Tensor):
            return column[rank]
        if column[0].dtype == torch.bool:
            return torch.stack(column).any(0)
        s = sum(c.double() for c in column)
        return (s / WORLD if p["op"] == "mean" else s).to(column[0].dtype)

    # small integral values: every sum and mean of two is exact, compressed too
    exact(got, rows_of(optree.tree_map(total, *everyone), rank))
    exact(regathered, reduced)
    assert kept(got, ties(mine)) and kept(regathered, ties(mine)), "a tied leaf came back twice"


def check_all_gather(rank: int, p: dict[str, Any]) -> None:
    """all_gather(shard(t), t) is t, bit for bit; shard's leaves are torch.chunk's rows, as views."""
    tree = refill(p["tree"], p["seed"])  # the same on every rank, as replicated parameters are
    unchanged = Unchanged(tree)
    mine = fr.distributed.shard(tree)
    exact(mine, rows_of(tree, rank))
    back = fr.distributed.all_gather(mine, tree)
    unchanged.check("fr.distributed.shard / all_gather")
    exact(back, tree)
    assert kept(back, ties(tree)), "a tied leaf came back twice"


def check_zero2_gradients(rank: int, p: dict[str, Any]) -> None:
    """grad_and_value(..., shard=True): this rank's rows of DDP's gradients."""
    module, inputs = p["module"], p["inputs"][rank]
    _, _, want = _ddp_reference(module, inputs)
    s = fr.state(module)
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else (_tuple(inputs), {})
    train = {k: v for k, v in s.params.items() if k in want}
    frozen = {k: v for k, v in s.params.items() if k not in want}

    def loss_fn(params: dict[str, torch.Tensor]) -> torch.Tensor:
        out, _ = fr.apply(module, fr.State({**frozen, **params}, s.buffers), *args, **kwargs)
        return _loss(out)

    unchanged = Unchanged(s, inputs)
    grads, _ = fr.distributed.grad_and_value(loss_fn, shard=True, bucket_cap_mb=p["cap"])(train)
    unchanged.check("fr.distributed.grad_and_value(shard=True)")
    assert_trees_close(grads, rows_of(want, rank), rtol=1e-5, atol=1e-6)


def check_clip(rank: int, p: dict[str, Any]) -> None:
    """fr.distributed.clip_grad_norm of the shards: clip_grad_norm_ of the full gradients' rows,
    the same total on every rank."""
    full = refill(p["tree"], p["seed"], integral=False)
    shards = fr.distributed.shard(full)
    unchanged = Unchanged(shards)
    got, total = fr.distributed.clip_grad_norm(shards, p["max_norm"], norm_type=p["norm_type"])
    unchanged.check("fr.distributed.clip_grad_norm")
    everyone: list[Any] = [None] * WORLD
    dist.all_gather_object(everyone, total)
    assert all(torch.equal(t, total) for t in everyone), "the ranks' totals differ"
    try:
        want, want_total = torch_clip(full, p["max_norm"], p["norm_type"])
    except RuntimeError:  # torch has no max, min or negative power of an empty gradient
        return
    torch.testing.assert_close(total, want_total, rtol=1e-6, atol=0, equal_nan=True)
    assert_trees_close(got, rows_of(want, rank), rtol=1e-5, atol=1e-7)


CHECKS[Check("reduce_scatter")] = check_reduce_scatter
CHECKS[Check("all_gather")] = check_all_gather
CHECKS[Check("zero2_gradients")] = check_zero2_gradients
CHECKS[Check("sharded_clip")] = check_clip
