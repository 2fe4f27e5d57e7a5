"""The public collectives on trees, each written once: eager and traced share every line.

``all_reduce``, ``broadcast``, ``sync_buffers``, and, for sharded data
parallelism, ``reduce_scatter``, ``all_gather`` and ``shard``. Each plans
its tree (``_plans``, errors naming the tree's paths) and runs one
collective of its kind on the tree's tensors: plainly, one ``Call``
(``_call``), where nothing differentiates or batches through it, else as a
primitive with its rules (``_rules``); then it rebuilds the tree. Where
eager and traced runs differ (the buffers, the collectives, the checks read
back) the transport decides, at the leaf.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Literal

import optree
import torch
import torch.distributed as dist

from .._checks import check_choice, check_int
from .._torch import is_compiling
from .._tree import (
    NAMESPACE,
    alias_groups,
    describe,
    first_difference,
    flatten_in_order,
    paths_of,
    rebuild,
    tensor_values,
)
from .._typing import Compress, Op, TensorTree
from ._agree import debugging
from ._call import Announced, Call, Request, Send, send_of
from ._group import check_src, groups_of, resolve, world_size
from ._options import Options, reduction, weight_value
from ._plans import Plan, plan_of
from ._rules import apply, held, needs_rules, plain
from ._wire import ALL_GATHER, ALL_REDUCE, BROADCAST, REDUCE_SCATTER, Spec, replaced, valid_rows

__all__ = [
    "all_gather",
    "all_reduce",
    "broadcast",
    "collect",
    "reduce_scatter",
    "run",
    "shard",
    "sync_buffers",
]


def all_reduce(
    tree: TensorTree,
    *,
    op: Op = "mean",
    group: Any = None,
    bucket_cap_mb: float = 25.0,
    compress: Compress = None,
    check: bool = True,
    weight: float | None = None,
) -> TensorTree:
    """A new tree whose tensor leaves are the sum or mean of ``tree``'s over the ranks of ``group``.

    Collective: every rank calls it, in the same order, with a tree of the
    same layout. Leaves are packed per (device, dtype) into buckets of at
    most ``bucket_cap_mb`` (in the reverse order of the leaves, as DDP
    buckets gradients); every bucket is in flight at once, all are waited on
    at the end. Sparse COO leaves (the gradients of ``nn.Embedding(sparse=True)``)
    are reduced one by one and stay sparse, as DDP reduces them.
    A mean multiplies each leaf by ``1 / world_size`` as it is packed, as
    DDP's reducer does. ``compress="bf16"`` or ``"fp16"`` sends
    floating-point buckets in that dtype and returns leaves in their own
    dtype (DDP's compression hooks). Boolean leaves reduce with
    ``op="sum"`` to their logical or. Non-tensor leaves pass through by
    reference; a tensor at several positions is reduced once and stays one
    object. ``tree`` is never modified, and never used as the reduction buffer.
    Under ``torch.compile`` the same buckets go through torch's traceable
    collectives, in the graph.

    Each call checks the layout across ranks: trees that differ in
    structure, shape or dtype, calls with different options, or ranks that
    call different fr.distributed functions raise ``ValueError`` naming the
    difference on every rank (never a hang, never an abort). The group
    learns the order of its calls' layouts: on the layout that comes next in
    that order, the check rides in the first bucket, at no collective of its
    own; another known layout costs one small extra collective, a new one
    two. Compiled, the check runs once per trace (see ``docs/compile.md``).

    ``weight`` (this rank's, a number >= 0) makes the mean a weighted one,
    ``sum_r weight_r * tree_r / sum_r weight_r`` (zeros where every weight is
    0): each rank sends its weighted leaves and its weight in the same buckets,
    at no collective more (a first bucket narrower than float32 sends the
    weights in one small float64 collective of their own), then divides by
    the summed weights.

    Args:
        tree: the tree to reduce; its tensor leaves may lie on several devices.
        op: ``"mean"`` (DDP's) or ``"sum"``.
        group: the process group (default: the default group).
        bucket_cap_mb: the most megabytes a bucket holds.
        compress: ``"bf16"`` or ``"fp16"`` to send floating-point buckets in
            that dtype, ``None`` to send them as they are.
        check: ``False`` skips the probe of a layout's first use (the words a
            warm call carries are checked all the same), and with it the
            promise that ranks whose layouts differ raise before data moves
            (pass it alike on every rank).
        weight: this rank's weight in a weighted mean (``op="mean"`` only),
            or ``None`` for the plain mean; give one on every rank or on none.

    Returns:
        The reduced tree; ``tree`` itself without an initialised process group,
        with one rank, or on a rank outside ``group`` (with a warning).

    Raises:
        TypeError: ``op="mean"`` on an integer or bool leaf, or a leaf that
            cannot be packed (naming its path); a bad ``bucket_cap_mb``,
            ``group`` or ``weight`` type.
        ValueError: a bad ``op``, ``compress`` or ``bucket_cap_mb``; a
            negative or non-finite ``weight``, or one with ``op="sum"``;
            trees or options that differ across ranks (on every rank).
        RuntimeError: under ``torch.compile`` inside a ``torch.func``
            transform (eagerly the collectives compose: docs/composing.md);
            several processes launched but no process group initialised;
            another rank's call failed (naming it).

    Examples:
        >>> g = {"w": torch.ones(2, 2), "step": 3}
        >>> fr.distributed.all_reduce(g) is g  # no process group here: unchanged
        True
        >>> fr.distributed.all_reduce(g, weight=3) is g  # a weighted mean over one rank
        True
    """
    caller = "fr.distributed.all_reduce"
    options = reduction(
        caller, ALL_REDUCE, op, bucket_cap_mb, compress, weighted=weight is not None
    )
    if weight is not None and not (is_compiling() and isinstance(weight, torch.Tensor)):
        weight = weight_value(caller, weight)
    world, group, traced = resolve(group, caller)
    if world <= 1:
        return tree
    spec = Spec(options, group, world, caller, check, ())
    return collect(tree, spec, weight=weight, traced=traced)


def reduce_scatter(
    tree: TensorTree,
    *,
    op: Op = "mean",
    group: Any = None,
    bucket_cap_mb: float = 25.0,
    compress: Compress = None,
    check: bool = True,
) -> TensorTree:
    """``shard(all_reduce(tree))``, with one reduce-scatter per bucket in place of an all-reduce.

    This rank's rows of the sum or mean over the ranks of every tensor leaf
    (``shard``'s rows: ``torch.chunk``'s split of dim 0; a 0-dim leaf whole).
    The buckets are ``all_reduce``'s, each laid out rank-major (every rank's
    rows of every leaf, zero-padded where dim 0 does not divide, as FSDP2's
    copy-in), so each rank receives only its own chunk: half the traffic of
    an all-reduce on two ranks. Checked across ranks as ``all_reduce``;
    ``compress`` as there. Dense tensors only. Equal to ``all_reduce``'s
    rows bitwise on two ranks (one addition); on more, within rounding: the
    backend may add the ranks' values in another order for each collective.

    Args:
        tree: the tree to reduce; every rank passes the same layout.
        op: ``"mean"`` or ``"sum"``.
        group: the process group (default: the default group).
        bucket_cap_mb: the most megabytes a bucket holds (all ranks' rows).
        compress: ``"bf16"`` or ``"fp16"`` to send floating-point buckets in
            that dtype.
        check: ``False`` skips the probe of a layout's first use (pass it alike).

    Returns:
        The tree of this rank's shards of the reduced leaves; ``tree`` itself
        without a process group or with one rank.

    Raises:
        TypeError: a sparse leaf; ``op="mean"`` on an integer or bool leaf.
        ValueError: bad options; trees that differ across ranks (on every rank).

    Examples:
        >>> g = {"w": torch.ones(4, 2)}
        >>> fr.distributed.reduce_scatter(g) is g  # no process group here
        True
    """
    caller = "fr.distributed.reduce_scatter"
    options = reduction(caller, REDUCE_SCATTER, op, bucket_cap_mb, compress)
    world = world_size(group, caller)
    if world <= 1:
        return tree
    return collect(tree, Spec(options, group, world, caller, check, ()))


def collect(
    tree: TensorTree,
    spec: Spec,
    *,
    weight: Any = None,
    presummed: bool = False,
    traced: bool | None = None,
) -> TensorTree:
    """One collective of ``spec``'s kind on ``tree``'s tensors over ``spec.world`` > 1 ranks.

    ``spec.paths`` is filled in from the tree. ``weight``: this rank's in a
    weighted mean, its tensors multiplied by it unless ``presummed`` (they
    hold weighted sums already). ``traced``: whether Dynamo traces, where the
    caller asked already.
    """
    with Announced(spec.group, spec.world, spec.caller) as scope:
        plan, leaves = plan_of(
            tree, spec.options, spec.group, spec.world, spec.caller, check=spec.check, traced=traced
        )
        tensors = plan.tensors(leaves)
        if not needs_rules(tensors, spec.caller, traced):
            with plan.lock or contextlib.nullcontext():
                request = Request(plan, spec.group, spec.world, spec.caller, spec.check)
                call = scope.call = Call(request)
                send = send_of(request, weight=weight)
                results = run(
                    call, plan, tensors, replaced(send, scale=None) if presummed else send
                )
            return plan.rebuild(leaves, results)
    # through the rules: the tensors' own calls, announced there (not twice)
    paths = tuple(plan.layout.description[0][i] for i in plan.layout.unique)
    ruled = replaced(spec, paths=paths)
    if weight is None:
        return plan.rebuild(leaves, apply(ruled, tensors))
    return plan.rebuild(leaves, _weighted(ruled, tensors, weight, presummed))


def _weighted(
    spec: Spec, tensors: Sequence[torch.Tensor], weight: Any, presummed: bool
) -> list[torch.Tensor]:
    """A weighted mean through the rules: the weights summed (a constant), then the tensors'."""
    caller = spec.caller
    w = torch.as_tensor(weight, dtype=torch.float64, device=tensors[0].device if tensors else None)
    total_spec = Spec(
        Options(ALL_REDUCE.name, "sum", 25.0, None),
        spec.group,
        spec.world,
        caller,
        spec.check,
        ("<weights>",),
    )
    total = plain(total_spec, [w.reshape(1)])[0].reshape(())
    summed = replaced(spec, options=replaced(spec.options, op="sum", weighted=False))
    scaled = [t if presummed else t * weight for t in tensors]
    out = apply(summed, scaled)
    return [torch.where(total == 0, torch.zeros_like(r), r / total.to(r.dtype)) for r in out]


def run(
    call: Call,
    plan: Plan,
    tensors: Sequence[Any],
    send: Send,
    *,
    checksums: Any = None,
    begun: bool = False,
) -> list[Any]:
    """Agree (unless ``begun``), launch every bucket of ``tensors`` (one per tensor), finish."""
    if not begun:
        call.begin(checksums)
    layout = plan.layout
    parts = plan.all_parts(tensors)
    call.launch_rest(parts, send, [tensors[k] for k in layout.sparse] if layout.sparse else ())
    return call.finish()


def broadcast(
    tree: TensorTree, *, src: int = 0, group: Any = None, check: bool = True
) -> TensorTree:
    """A new tree whose tensor leaves equal rank ``src``'s; the input is unchanged.

    The initial sync DDP does at construction (and, for buffers, at every
    forward). Collective, coalesced and checked across ranks as
    ``all_reduce`` (it is one: ``src`` sends its values, the other ranks
    -0.0, which leaves every value as it is, bit for bit).

    Args:
        tree: the tree to send (on ``src``) or to receive into (elsewhere:
            its layout, not its values, matters).
        src: the global rank whose values every rank gets; a rank of ``group``.
        group: the process group (default: the default group).
        check: ``False`` skips the probe of a layout's first use (the words a
            warm call carries are checked all the same), and with it the
            promise that ranks whose layouts differ raise before data moves
            (pass it alike on every rank).

    Returns:
        The tree of ``src``'s values (fresh tensors on every rank); ``tree``
        itself without an initialised process group, with one rank, or on a
        rank outside ``group``.

    Raises:
        TypeError: ``src`` is not an int; a bad ``group``.
        ValueError: ``src`` is not a rank of ``group``; trees that differ
            across ranks (on every rank).
        RuntimeError: under ``torch.compile`` inside a ``torch.func``
            transform (eagerly the collectives compose: docs/composing.md);
            several processes launched but no process group initialised.

    Examples:
        >>> s = fr.state(nn.Linear(2, 2))
        >>> fr.distributed.broadcast(s, src=0) is s  # no process group here: unchanged
        True
    """
    return _broadcast(tree, "fr.distributed.broadcast", src, group, check)


def _broadcast(tree: TensorTree, caller: str, src: Any, group: Any, check: bool) -> TensorTree:
    world = world_size(group, caller)
    if world == 0:  # not a rank of group: nothing to do (warned)
        return tree
    check_src(caller, src, group)
    if world == 1:
        return tree
    # a sum of src's values and every other rank's neutral -0.0: src's values, bit for bit
    options = Options(BROADCAST.name, "sum", 25.0, None, src)
    return collect(tree, Spec(options, group, world, caller, check, ()))


def sync_buffers(
    buffers: TensorTree,
    *,
    mode: Literal["broadcast", "mean"] = "broadcast",
    src: int = 0,
    group: Any = None,
) -> TensorTree:
    """Make buffers (BatchNorm statistics ...) agree across ranks; the explicit buffer policy.

    ``mode="broadcast"``: every rank gets rank ``src``'s buffers, what
    DistributedDataParallel does before every forward (``broadcast_buffers=True``);
    call it before each step's forward to match DDP exactly.
    ``mode="mean"``: floating-point buffers become their mean over the ranks
    (running statistics of the whole global batch, roughly); the others
    (``num_batches_tracked``) are broadcast from ``src``. The composable
    ``replicate`` never syncs buffers: not calling this matches it. Buffers
    without a tensor (a model without buffers) cost no collective, and so are
    not checked across ranks: every rank's model must have the same buffers.

    Args:
        buffers: the buffers, e.g. ``fr.state(module).buffers``.
        mode: ``"broadcast"`` or ``"mean"``.
        src: the global rank whose buffers are broadcast.
        group: the process group (default: the default group).

    Returns:
        The synced buffers; ``buffers`` itself without an initialised
        process group, with one rank, or without tensors.

    Raises:
        ValueError: a bad ``mode`` or ``src``; buffers that differ across ranks.

    Examples:
        >>> b = fr.state(nn.BatchNorm1d(3)).buffers
        >>> fr.distributed.sync_buffers(b, mode="mean") is b  # no process group here
        True
    """
    caller = "fr.distributed.sync_buffers"
    check_choice(caller, "mode", mode, ("broadcast", "mean"))
    values = tensor_values(buffers)
    leaves = values if values is not None else optree.tree_leaves(buffers, namespace=NAMESPACE)
    if not any(isinstance(x, torch.Tensor) for x in leaves):
        check_int(caller, "src", src)
        return buffers  # nothing to sync (a model without buffers): no collective
    if mode == "broadcast":
        return _broadcast(buffers, caller, src, group, True)
    world = world_size(group, caller)
    if world <= 1:
        return buffers
    floating = optree.tree_map(_if_floating, buffers, none_is_leaf=True, namespace=NAMESPACE)
    others = optree.tree_map(_unless_floating, buffers, none_is_leaf=True, namespace=NAMESPACE)
    options = Options(ALL_REDUCE.name, "mean", 25.0, None)
    means = collect(floating, Spec(options, group, world, caller, True, ()))
    synced = _broadcast(others, caller, src, group, True)
    return optree.tree_map(
        lambda m, s: s if m is None else m, means, synced, none_is_leaf=True, namespace=NAMESPACE
    )


def _if_floating(x: Any) -> Any:
    return x if isinstance(x, torch.Tensor) and x.is_floating_point() else None


def _unless_floating(x: Any) -> Any:
    return None if isinstance(x, torch.Tensor) and x.is_floating_point() else x


# --- sharded data parallelism -----------------------------------------------------------


def _rank_and_world(group: Any, caller: str) -> tuple[int, int]:
    world = world_size(group, caller)
    if world <= 1:
        return 0, max(world, 1)
    return dist.get_rank(group), world


def _rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's rows of ``t`` as a view (``torch.chunk``'s split), a 0-dim tensor whole.

    A view in every case, never ``t`` itself: a step's parameters and their
    shards share no tensor object (Dynamo would guard on the duplicate).
    """
    if t.dim() == 0:
        return t.view(())
    c = -(-t.shape[0] // world)
    return t[rank * c : rank * c + valid_rows(c, t.shape[0], rank)]


def shard(tree: TensorTree, *, group: Any = None) -> TensorTree:
    """This rank's rows of every tensor leaf, as views: no copy, no communication.

    With world size W and a leaf of d0 rows, c = ceil(d0 / W): rank r holds
    rows [r*c, min((r+1)*c, d0)), as ``torch.chunk`` splits (so a late rank
    may hold 0 rows); a 0-dim leaf is held whole by every rank. Non-tensor
    leaves pass through. The rows ``reduce_scatter`` gives this rank and
    ``all_gather`` puts back together.

    Args:
        tree: any tree (parameters, gradients, optimizer state).
        group: the process group (default: the default group); a
            ``DeviceMesh`` or a pair ``(replicate_group, shard_group)``: the
            rows of its shard group (hybrid sharding).

    Returns:
        The tree of views; ``tree`` itself without a process group or with one rank.

    Raises:
        TypeError: a bad ``group``.

    Examples:
        >>> fr.distributed.shard({"w": torch.ones(3, 2)})["w"].shape  # one rank: every row
        torch.Size([3, 2])
    """
    caller = "fr.distributed.shard"
    rank, world = _rank_and_world(groups_of(group, caller).shard, caller)
    if world <= 1:
        return tree
    leaves, spec = flatten_in_order(tree)
    unique, slot = alias_groups(leaves)  # a tied tensor: one view, tied in the result too
    for i in unique:
        if isinstance(leaves[i], torch.Tensor) and leaves[i].layout != torch.strided:
            path = paths_of(spec)[i]
            raise TypeError(
                f"{caller}: the tensor at {path} has layout {leaves[i].layout}, whose rows cannot "
                "be taken as a view (a shard takes dense tensors only, as reduce_scatter and "
                "all_gather do); convert it (e.g. .to_dense()) or keep it out of the tree"
            )
    return rebuild(spec, leaves, slot, [_rows(leaves[i], rank, world) for i in unique])


def all_gather(
    shards: TensorTree, like: TensorTree, *, group: Any = None, check: bool = True
) -> TensorTree:
    """The full tree, with ``like``'s structure, shapes and dtypes, from every rank's shards.

    ``shards`` holds this rank's rows of each leaf of ``like`` (``shard``'s:
    ``all_gather(shard(t), t)`` equals ``t`` exactly); every rank sends its
    own, coalesced into ``all_reduce``'s buckets laid out rank-major, and
    receives everyone's. A 0-dim leaf is held whole by every rank: it comes
    back as a copy of this rank's. ``like``'s values are not read, only its layout.
    Checked across ranks as ``all_reduce``.

    Args:
        shards: this rank's shards, a tree of ``like``'s structure.
        like: the full tree (e.g. the parameters before the update).
        group: the process group (default: the default group); a
            ``DeviceMesh`` or a pair ``(replicate_group, shard_group)``: its
            shard group (hybrid sharding: every replica gathers alike).
        check: ``False`` skips the probe of a layout's first use (pass it alike).

    Returns:
        A new tree of full tensors; ``shards`` itself without a process group
        or with one rank.

    Raises:
        ValueError: ``shards`` and ``like`` differ in structure, or a shard
            in shape or dtype (naming the path); layouts that differ across
            ranks (on every rank).

    Examples:
        >>> t = {"w": torch.arange(6.0).view(3, 2)}
        >>> fr.distributed.all_gather(fr.distributed.shard(t), t)["w"].shape
        torch.Size([3, 2])
    """
    caller = "fr.distributed.all_gather"
    group = groups_of(group, caller).shard
    rank, world = _rank_and_world(group, caller)
    if world <= 1:
        return shards
    options = Options(ALL_GATHER.name, "sum", 25.0, None)
    return gather(shards, like, Spec(options, group, world, caller, check, ()), rank)


def gather(shards: TensorTree, like: TensorTree, spec: Spec, rank: int) -> TensorTree:
    """``all_gather`` over ``spec.world`` > 1 ranks (its ``op``: its transpose's)."""
    like = _tied_as(like, shards)
    with Announced(spec.group, spec.world, spec.caller) as scope:
        plan, leaves = plan_of(
            like, spec.options, spec.group, spec.world, spec.caller, check=spec.check
        )
        request = Request(plan, spec.group, spec.world, spec.caller, spec.check)
        early = None
        # agreed before the shards are checked, so that a wrong shard on one rank is announced
        # in this call's own buckets (in the debug mode every rank probes first: announce meets it)
        if not is_compiling() and not debugging():
            early = scope.call = Call(request)
            early.begin()
        # (the shards' leaves: a non-tensor leaf, a step count, comes back as the shards hold it,
        # as without a group, not as like's)
        mine, leaves = _shard_leaves(shards, like, plan, leaves, rank, spec.world, spec.caller)
        scope.call = None
        if not needs_rules(mine, spec.caller):
            layout = plan.layout
            with plan.lock or contextlib.nullcontext():
                call = scope.call = early or Call(request)
                if early is None:
                    call.begin()
                parts = plan.all_parts(mine)
                call.launch_rest(parts, send_of(request))
                # a 0-dim leaf: a new tensor too, so results never alias the shards given
                results = call.finish(local=held(spec, [mine[k] for k in layout.local]))
            return plan.rebuild(leaves, results)
    layout = plan.layout
    paths = tuple(layout.description[0][i] for i in layout.unique)
    full = tuple((s[0], s[4]) for s in layout.sigs)
    return plan.rebuild(leaves, apply(replaced(spec, paths=paths, like=full), mine))


def _tied_as(like: TensorTree, shards: TensorTree) -> TensorTree:
    """``like`` with the shards' ties, not its own: its values are never read, so one tensor at
    two of its paths (moments made from one ``zeros`` tree) says nothing of the data, and
    gathering it once would give the first path's rows at both. Where ``like`` ties nothing
    (the common case, decided at C speed eagerly) it is returned as is."""
    compiling = is_compiling()
    values = None if compiling else tensor_values(like)
    if values is not None and len(set(map(id, values))) == len(values):
        return like
    leaves, spec = flatten_in_order(like)
    unique, _ = alias_groups(leaves)
    if len(unique) == sum(isinstance(t, torch.Tensor) for t in leaves):
        return like
    theirs, their_spec = flatten_in_order(shards)
    if their_spec != spec:
        return like  # the structure's error is raised where the shards are read, naming it
    _, slot = alias_groups(theirs)
    made: dict[Any, torch.Tensor] = {}
    used: dict[Any, bool] = {}  # like's tensors given out once (keys: as alias_groups keys)
    out = list(leaves)
    for i, t in enumerate(leaves):
        if not isinstance(t, torch.Tensor):
            continue
        key = slot[i] if slot[i] >= 0 else -1 - i
        if key not in made:
            mine = t if compiling else id(t)
            made[key] = t.view_as(t) if mine in used else t  # a view: another tensor object
            used[mine] = True
        out[i] = made[key]
    return optree.tree_unflatten(spec, out)


def _shard_leaves(
    shards: TensorTree,
    like: TensorTree,
    plan: Plan,
    leaves: Sequence[Any],
    rank: int,
    world: int,
    caller: str,
) -> tuple[list[torch.Tensor], list[Any]]:
    """``shards``' tensors, one per tensor of ``like``'s layout, checked against their rows;
    and the shards' leaves."""
    values = tensor_values(shards)
    got: list[Any]
    if values is not None and plan.keys is not None and tuple(shards) == plan.keys:
        got = values
    else:
        got, spec = flatten_in_order(shards)
        _, like_spec = flatten_in_order(like)
        if spec != like_spec:
            where = first_difference([like_spec, spec], [like, shards])
            raise ValueError(
                f"{caller}: shards must have like's structure; {where} (tree 0 is like, tree 1 the shards)"
            )
    tensors = plan.tensors(got)
    paths = plan.layout.description[0]
    for k, (t, sig) in enumerate(zip(tensors, plan.layout.sigs)):
        shape, dtype = sig[0], sig[1]
        want = (
            shape if not shape else (valid_rows(-(-shape[0] // world), shape[0], rank), *shape[1:])
        )
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want or t.dtype != dtype:
            raise ValueError(
                f"{caller}: the shard at {paths[plan.layout.unique[k]]} must be this rank's rows "
                f"of like's leaf (shape {want}, dtype {dtype}: rank {rank} of {world}), got "
                f"{describe(t)}"
            )
    return tensors, got
