"""The public collectives on trees: all_reduce, broadcast, sync_buffers."""

from __future__ import annotations

from typing import Any

import optree
import torch
import torch.distributed as dist

from .._pack import FlatPool
from .agree import _agree, mismatch, probe, verify
from .group import _not_transformed, _world
from .pipeline import _Reduction
from .plan import _check_args, _plan_for, _rebuild

__all__ = ["all_reduce", "broadcast", "sync_buffers"]


def all_reduce(
    tree: Any,
    *,
    op: str = "mean",
    group: Any = None,
    bucket_cap_mb: float = 25.0,
    compress: str | None = None,
    check: bool = True,
) -> Any:
    """A new tree whose tensor leaves are the sum or mean of ``tree``'s over the ranks of ``group``.

    Collective: every rank calls it, in the same order, with a tree of the
    same layout. Leaves are packed per (device, dtype) into buckets of at
    most ``bucket_cap_mb`` (in the reverse order of the leaves, as DDP
    buckets gradients); every bucket is in flight at once, all are waited on
    at the end. ``compress="bf16"`` or ``"fp16"`` sends floating-point
    buckets in that dtype (divided by the world size first for ``"mean"``,
    as DDP's compression hooks) and returns leaves in their own dtype.
    ``op="mean"`` needs floating-point or complex leaves (``TypeError``
    naming the path otherwise); boolean leaves reduce with ``op="sum"`` to
    their logical or. Non-tensor leaves pass through by reference; a tensor
    at several positions is reduced once and stays one object.

    Each call checks the layout across ranks (``check=False`` skips it):
    trees that differ in structure, shape or dtype, or calls with different
    options, raise ``ValueError`` naming the difference on every rank. On
    the layout the group agreed on last, the check rides in the first
    bucket; switching back to the one before costs one small extra
    collective, a new layout two. ``tree`` is never modified, and
    never used as the reduction buffer. Without an initialised process
    group, or with one rank, ``tree`` itself is returned.

    >>> g = {"w": torch.ones(2, 2), "step": 3}
    >>> fr.distributed.all_reduce(g) is g  # no process group here: unchanged
    True
    """
    fn = "fr.distributed.all_reduce"
    _check_args(fn, op, compress)
    world = _world(group)
    if world == 1:
        return tree
    _not_transformed(fn)
    plan, leaves = _plan_for(tree, fn, op, bucket_cap_mb, compress, None)
    if not plan.unique:  # nothing to reduce; the check still catches a rank that has tensors
        if check:
            _agree(plan, tree, group, world, fn)
        return tree
    with plan.lock:
        fast = check and _agree(plan, tree, group, world, fn)
        poisoned = (lambda: mismatch(plan, tree, group, fn)) if fast else None
        red = _Reduction(plan, op, group, world, poisoned)
        tensors = leaves if plan.bare else [leaves[i] for i in plan.unique]
        staged = [red.stage(b, plan.parts(b, tensors)) for b in range(len(plan.buckets))]
        for st in staged:
            red.start(st)
        return red.finish(lambda results: _rebuild(plan, leaves, results))


def broadcast(tree: Any, *, src: int = 0, group: Any = None, check: bool = True) -> Any:
    """A new tree whose tensor leaves equal rank ``src``'s; the input is unchanged.

    The initial sync DDP does at construction (and, for buffers, at every
    forward). Collective, coalesced as ``all_reduce``, with the cross-rank
    check (here one tiny collective on every call). ``src`` is a global
    rank. On rank ``src`` the result holds the given tensors themselves
    (their values are the answer); on the others fresh tensors. Without an
    initialised process group, or with one rank, ``tree`` itself is returned.

    >>> s = fr.state(nn.Linear(2, 2))
    >>> fr.distributed.broadcast(s, src=0) is s  # no process group here: unchanged
    True
    """
    fn = "fr.distributed.broadcast"
    world = _world(group)
    if world == 1:
        return tree
    _not_transformed(fn)
    if not 0 <= src < dist.get_world_size():
        raise ValueError(
            f"{fn}: src={src} is not a rank of the default group (0..{dist.get_world_size() - 1})"
        )
    plan, leaves = _plan_for(tree, fn, "sum", 25.0, None, src)
    if not plan.unique:  # nothing to send; the check still catches a rank that has tensors
        if check:
            verify(plan, probe(plan, group), tree, group, fn)
        return tree
    root = dist.get_rank() == src
    with plan.lock:
        pending_check = probe(plan, group) if check else None
        staged = []
        tensors = leaves if plan.bare else [leaves[i] for i in plan.unique]
        for b, bucket in enumerate(plan.buckets):
            flat, runs = bucket.results.take()
            if root:
                bucket.results.pack(runs, plan.parts(b, tensors))
            staged.append((flat, runs))
        if pending_check is not None:
            verify(plan, pending_check, tree, group, fn)
        pending = [
            (runs, dist.broadcast(flat, src=src, group=group, async_op=True))
            for flat, runs in staged
        ]
        views: list[torch.Tensor] = []
        for runs, work in pending:
            work.wait()
            if not root:
                views += FlatPool.views(runs)
    if root:  # a new tree holding the given tensors: their values are the answer
        return optree.tree_unflatten(plan.spec, leaves)
    return _rebuild(plan, leaves, plan.reorder(views))


def sync_buffers(buffers: Any, *, mode: str = "broadcast", src: int = 0, group: Any = None) -> Any:
    """Make buffers (BatchNorm statistics ...) agree across ranks; the explicit buffer policy.

    ``mode="broadcast"``: every rank gets rank ``src``'s buffers, what
    DistributedDataParallel does before every forward (``broadcast_buffers=True``);
    call it before each step's forward to match DDP exactly.
    ``mode="mean"``: floating-point buffers become their mean over the ranks
    (running statistics of the whole global batch, roughly); the others
    (``num_batches_tracked``) are broadcast from ``src``. The composable
    ``replicate`` never syncs buffers: not calling this matches it.

    >>> b = fr.state(nn.BatchNorm1d(3)).buffers
    >>> fr.distributed.sync_buffers(b, mode="mean") is b  # no process group here
    True
    """
    fn = "fr.distributed.sync_buffers"
    if mode == "broadcast":
        return broadcast(buffers, src=src, group=group)
    if mode != "mean":
        raise ValueError(f"{fn}: mode must be 'broadcast' or 'mean', got {mode!r}")
    if _world(group) == 1:
        return buffers
    floating = optree.tree_map(
        lambda x: x if isinstance(x, torch.Tensor) and x.is_floating_point() else None,
        buffers,
        none_is_leaf=True,
    )
    others = optree.tree_map(
        lambda x: None if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
        buffers,
        none_is_leaf=True,
    )
    means = all_reduce(floating, op="mean", group=group)
    synced = broadcast(others, src=src, group=group)
    return optree.tree_map(lambda m, s: s if m is None else m, means, synced, none_is_leaf=True)
