"""The public collectives on trees: all_reduce, broadcast, sync_buffers."""

from __future__ import annotations

import math
import numbers
from typing import Any, Literal

import optree
import torch
import torch.distributed as dist

from .._checks import check_choice, check_int, check_op, check_positive
from .._torch import is_compiling
from .._tree import tensor_values
from .._typing import Compress, Op, TensorTree
from . import compiled
from .agree import agree, mismatch
from .group import check_not_transformed, check_src, comm_errors, world_size
from .pipeline import Reduction
from .plan import COMPRESS, Plan, plan_for, rebuild_tree

__all__ = [
    "all_reduce",
    "broadcast",
    "check_reduce_args",
    "check_weighted",
    "reduce_tree",
    "run",
    "sync_buffers",
    "weight_value",
]

_COMPRESS_CHOICES = tuple(COMPRESS)


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
    ``compress="bf16"`` or ``"fp16"`` sends floating-point
    buckets in that dtype (divided by the world size first for ``"mean"``,
    as DDP's compression hooks) and returns leaves in their own dtype.
    Boolean leaves reduce with ``op="sum"`` to their logical or. Non-tensor
    leaves pass through by reference; a tensor at several positions is
    reduced once and stays one object. ``tree`` is never modified, and never
    used as the reduction buffer.

    Each call checks the layout across ranks: trees that differ in
    structure, shape or dtype, calls with different options, or ranks that
    call different fr.distributed functions raise ``ValueError`` naming the
    difference on every rank (never a hang, never an abort). The group
    learns the order of its calls' layouts: on the layout that comes next in
    that order, the check rides in the first bucket, at no collective of its
    own; another known layout costs one small extra collective, a new one two.

    ``weight`` (this rank's, a number >= 0) makes the mean a weighted one,
    ``sum_r weight_r * tree_r / sum_r weight_r`` (zeros where every weight is
    0): each rank sends its weighted leaves and its weight in the same buckets,
    at no collective more, then divides by the summed weights. With each
    rank's number of examples as its weight, the mean of per-rank means is
    the mean over all the examples, however unevenly they are spread.

    Args:
        tree: the tree to reduce; its tensor leaves may lie on several devices.
        op: ``"mean"`` (DDP's) or ``"sum"``.
        group: the process group (default: the default group).
        bucket_cap_mb: the most megabytes a bucket holds.
        compress: ``"bf16"`` or ``"fp16"`` to send floating-point buckets in
            that dtype, ``None`` to send them as they are.
        check: ``False`` skips the cross-rank layout check, and with it the promise
            that ranks that part ways raise instead of hanging (pass it alike on
            every rank).
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
        RuntimeError: under a ``torch.func`` transform; several processes
            launched but no process group initialised.

    Examples:
        >>> g = {"w": torch.ones(2, 2), "step": 3}
        >>> fr.distributed.all_reduce(g) is g  # no process group here: unchanged
        True
        >>> fr.distributed.all_reduce(g, weight=3) is g  # a weighted mean over one rank
        True
    """
    caller = "fr.distributed.all_reduce"
    check_reduce_args(caller, op, bucket_cap_mb, compress)
    if weight is not None:
        check_weighted(caller, op)
        weight = weight_value(caller, weight)
    elif is_compiling():  # functional collectives, traceable (a weighted mean stays eager)
        return compiled.all_reduce(
            tree, op=op, group=group, bucket_cap_mb=bucket_cap_mb, compress=compress, check=check
        )
    world = world_size(group, caller)
    if world <= 1:
        return tree
    check_not_transformed(caller)
    return reduce_tree(
        tree, caller, op, group, world, bucket_cap_mb, compress, check, weight=weight
    )


def check_reduce_args(caller: str, op: Any, bucket_cap_mb: Any, compress: Any) -> None:
    """The checks of a reduction's options, before anything else (with or without a group)."""
    check_op(caller, op)
    check_positive(caller, "bucket_cap_mb", bucket_cap_mb)
    check_choice(caller, "compress", compress, _COMPRESS_CHOICES)


def check_weighted(caller: str, op: Any) -> None:
    """``ValueError`` unless ``op`` is ``"mean"``: a weight makes a mean a weighted one."""
    if op != "mean":
        raise ValueError(
            f"{caller}: weight= makes op='mean' a weighted mean; it has no meaning with "
            f"op={op!r} (drop weight=, or scale the tree yourself)"
        )


def weight_value(caller: str, weight: Any, what: str = "weight") -> float:
    """``weight`` as a float if it is a finite number >= 0 (or a one-element real tensor).

    A tensor is read back to the host (on CUDA, a synchronisation).

    >>> weight_value("fr.f", torch.tensor(3))
    3.0
    >>> weight_value("fr.f", -1)
    Traceback (most recent call last):
    ...
    ValueError: fr.f: weight must be a finite number >= 0, got -1
    """
    value = weight
    if (
        isinstance(value, torch.Tensor)
        and value.numel() == 1
        and not (value.is_complex() or value.dtype == torch.bool)
    ):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{caller}: {what} must be a number (or a one-element real tensor), got "
            f"{weight!r} of type {type(weight).__name__}"
        )
    number = float(value)
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(f"{caller}: {what} must be a finite number >= 0, got {weight!r}")
    return number


def reduce_tree(
    tree: TensorTree,
    caller: str,
    op: Op,
    group: Any,
    world: int,
    bucket_cap_mb: float,
    compress: Compress,
    check: bool,
    *,
    weight: float | None = None,
    scale: float | None = None,
) -> TensorTree:
    """``all_reduce`` on checked options over ``world`` > 1 ranks; errors name ``caller``.

    ``weight``: a weighted mean (``run``); ``scale``: what the leaves are
    multiplied by (default ``weight``; 1 for leaves weighted already).
    """
    plan, leaves = plan_for(tree, caller, op, bucket_cap_mb, compress, None, weight is not None)
    if not plan.unique:  # nothing to reduce; the check still catches a rank that has tensors
        if check:
            with comm_errors(caller):
                agree(plan, tree, group, world, caller)
        return tree
    return run(
        plan, tree, leaves, op, group, world, check, caller, send=True, weight=weight, scale=scale
    )


def run(
    plan: Plan,
    tree: TensorTree,
    leaves: list[Any],
    op: Op,
    group: Any,
    world: int,
    check: bool,
    caller: str,
    *,
    send: bool,
    weight: float | None = None,
    scale: float | None = None,
) -> TensorTree:
    """Agree on ``plan``, then all its buckets through the pipeline; the tree of the results.

    ``send=False``: this rank contributes nothing (``broadcast`` off the
    source, a ``skip``). ``weight``: this rank's weight in a weighted mean
    (0 with ``send=False``), ``scale``: what the leaves are multiplied by
    (default: ``weight``).
    """
    with plan.lock, comm_errors(caller):
        fast = check and agree(plan, tree, group, world, caller)
        poisoned = (lambda: mismatch(plan, tree, group, caller)) if fast else None
        red = Reduction(plan, op, group, world, poisoned, caller)
        if weight is not None:
            red.weight = weight
            red.scale = weight if scale is None else scale
        tensors = leaves if plan.bare else [leaves[i] for i in plan.unique]
        staged = [
            red.stage(b, plan.parts(b, tensors) if send else None) for b in range(len(plan.buckets))
        ]
        for st in staged:
            red.start(st)
        red.start_sparse(plan.sparse_tensors(tensors), send=send)
        return red.finish(lambda results: rebuild_tree(plan, leaves, results))


def broadcast(
    tree: TensorTree, *, src: int = 0, group: Any = None, check: bool = True
) -> TensorTree:
    """A new tree whose tensor leaves equal rank ``src``'s; the input is unchanged.

    The initial sync DDP does at construction (and, for buffers, at every
    forward). Collective, coalesced and checked across ranks as
    ``all_reduce`` (it is one: ``src`` sends its values, the other ranks
    -0.0, which leaves every value as it is). On rank ``src`` the result
    holds the given tensors themselves (their values are the answer); on
    the others fresh tensors.

    Args:
        tree: the tree to send (on ``src``) or to receive into (elsewhere:
            its layout, not its values, matters).
        src: the global rank whose values every rank gets; a rank of ``group``.
        group: the process group (default: the default group).
        check: ``False`` skips the cross-rank layout check, and with it the promise
            that ranks that part ways raise instead of hanging (pass it alike on
            every rank).

    Returns:
        The tree of ``src``'s values; ``tree`` itself without an initialised
        process group, with one rank, or on a rank outside ``group``.

    Raises:
        TypeError: ``src`` is not an int; a bad ``group``.
        ValueError: ``src`` is not a rank of ``group``; trees that differ
            across ranks (on every rank).
        RuntimeError: under a ``torch.func`` transform; several processes
            launched but no process group initialised.

    Examples:
        >>> s = fr.state(nn.Linear(2, 2))
        >>> fr.distributed.broadcast(s, src=0) is s  # no process group here: unchanged
        True
    """
    if is_compiling():
        return compiled.broadcast(tree, src=src, group=group, check=check)
    return _broadcast(tree, "fr.distributed.broadcast", src, group, check)


def _broadcast(tree: TensorTree, caller: str, src: Any, group: Any, check: bool) -> TensorTree:
    world = world_size(group, caller)
    if world == 0:  # not a rank of group: nothing to do (warned)
        return tree
    if dist.is_available() and dist.is_initialized():
        check_src(caller, src, group)
    else:
        check_int(caller, "src", src)
    if world == 1:
        return tree
    check_not_transformed(caller)
    plan, leaves = plan_for(tree, caller, "sum", 25.0, None, src)
    if not plan.unique:  # nothing to send; the check still catches a rank that has tensors
        if check:
            with comm_errors(caller):
                agree(plan, tree, group, world, caller)
        return tree
    # a sum of src's values and every other rank's neutral -0.0: src's values, bit for bit
    root = dist.get_rank() == src
    out = run(plan, tree, leaves, "sum", group, world, check, caller, send=root)
    if root:  # a new tree holding the given tensors: their values are the answer
        return optree.tree_unflatten(plan.spec, leaves)
    return out


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
    if is_compiling():
        return compiled.sync_buffers(buffers, mode=mode, src=src, group=group)
    values = tensor_values(buffers)
    leaves = values if values is not None else optree.tree_leaves(buffers)
    if not any(isinstance(x, torch.Tensor) for x in leaves):
        check_int(caller, "src", src)
        return buffers  # nothing to sync (a model without buffers): no collective
    if mode == "broadcast":
        return _broadcast(buffers, caller, src, group, True)
    world = world_size(group, caller)
    if world <= 1:
        return buffers
    check_not_transformed(caller)
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
    means = reduce_tree(floating, caller, "mean", group, world, 25.0, None, True)
    synced = _broadcast(others, caller, src, group, True)
    return optree.tree_map(lambda m, s: s if m is None else m, means, synced, none_is_leaf=True)
