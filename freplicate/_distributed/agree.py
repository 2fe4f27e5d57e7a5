"""The cross-rank agreement on a call's layout, and the messages that name a mismatch.

Every call checks the layout across ranks, so trees that differ raise
``ValueError`` on every rank instead of hanging, aborting or reducing garbage;
on the layout the group last agreed on, the check rides in the first bucket
(three flag elements) and costs no collective of its own (``_agree``).
"""

from __future__ import annotations

import pickle
import weakref
from typing import Any, NamedTuple

import optree
import torch
import torch.distributed as dist

from .._tree import NAMESPACE, describe, paths_of, structure_difference
from .._typing import TensorTree
from .group import comm_device, world_size
from .plan import FLAGS, FirstCollective, Plan

__all__ = ["agree", "mismatch", "probe", "verify"]


class Agreed(NamedTuple):
    """A layout every rank of a group is known to have run: its fingerprint, its first collective."""

    fingerprint: int
    first: FirstCollective


# Per process group: the *agreed* layout and the *second* one (or None): the last two layouts
# every rank is known to have run together. Identical on every rank, as they change only after a
# collective verdict (see ``agree``); kept apart from the plan cache, whose evictions are per
# rank. Weakly keyed: a destroyed group's state goes with it.
_AGREED: weakref.WeakKeyDictionary[Any, tuple[Agreed, Agreed | None]] = weakref.WeakKeyDictionary()


def probe(plan: Plan, group: Any) -> tuple[torch.Tensor, Any]:
    """Start this call's cross-rank check: the fingerprint and its negation, MAX-reduced."""
    t = torch.tensor([plan.fingerprint, -plan.fingerprint], device=comm_device(group))
    return t, dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True)


def verify(
    plan: Plan, started: tuple[torch.Tensor, Any], tree: TensorTree, group: Any, caller: str
) -> None:
    """Finish the check ``probe`` started: ``ValueError`` on every rank if layouts differ."""
    t, work = started
    work.wait()
    if int(t[0]) == plan.fingerprint and int(t[1]) == -plan.fingerprint:
        return
    # Every rank saw the difference, so every rank takes this slower path together.
    mismatch(plan, tree, group, caller)


def mismatch(plan: Plan, tree: TensorTree, group: Any, caller: str) -> None:
    """Raise ``ValueError`` naming how the layouts differ; every rank calls it together."""
    try:
        skeleton: bytes | None = pickle.dumps(optree.tree_map(describe, tree))
    except Exception:  # a node type that does not pickle: compare the spec text only
        skeleton = None
    mine = (skeleton, plan.description)
    everyone: list[Any] = [None] * world_size(group, caller)
    dist.all_gather_object(everyone, mine, group=group)
    raise ValueError(f"{caller}: {_mismatch(everyone, plan.spec)}")


def _render(node: Any) -> str:
    """A node of a received skeleton: its leaves are already text, the rest as ``describe`` says."""
    return node if isinstance(node, str) else describe(node)


def _mismatch(everyone: list[Any], spec: optree.PyTreeSpec) -> str:
    """Text naming the first difference between rank 0's layout and another rank's."""
    _, (spec0, sig0, slot0, opts0) = everyone[0]
    for r in range(1, len(everyone)):
        skeleton, (spec_r, sig_r, slot_r, opts_r) = everyone[r]
        if opts_r != opts0:
            return (
                f"the call's options differ across ranks: {opts0} on rank 0, {opts_r} on rank {r}; "
                "every rank must pass the same op, bucket_cap_mb, compress and src"
            )
        if spec_r != spec0:
            where = None
            if everyone[0][0] is not None and skeleton is not None:
                at, mine, theirs = structure_difference(
                    pickle.loads(everyone[0][0]),
                    pickle.loads(skeleton),
                    _render,
                    namespace=NAMESPACE,
                )
                where = f"at {at}: {mine} on rank 0, {theirs} on rank {r}"
            return (
                "the tree's structure differs across ranks: "
                + (where or f"{spec0} on rank 0, {spec_r} on rank {r}")
                + "; every rank must pass a tree of the same structure"
            )
        if sig_r != sig0:
            paths = paths_of(spec)
            for k, (a, b) in enumerate(zip(sig0, sig_r)):
                if a != b:
                    return (
                        f"the tensor at {paths[k]} differs across ranks: shape {a[0]}, dtype "
                        f"{a[1]} on rank 0; shape {b[0]}, dtype {b[1]} on rank {r}; every rank "
                        "must pass tensors of the same shapes and dtypes"
                    )
        if slot_r != slot0:
            return (
                "tied (aliased) leaves differ across ranks: the same tensor object sits at "
                f"different positions of the tree on rank 0 and on rank {r}"
            )
    return "the tree layout differs across ranks"  # pragma: no cover


def agree(plan: Plan, tree: TensorTree, group: Any, world: int, caller: str) -> bool:
    """The cross-rank layout check before a call's first bucket; ``True``: the fast path.

    On the fast path (``plan`` is the group's agreed layout) nothing is sent
    here: the first bucket carries flags ``[0, 1, 0]`` and ``Reduction``
    reads them back before the second bucket starts (or before returning).
    Any other call first *mirrors* the agreed layout's first collective (same
    size, dtype and op: zeros, then flags ``[1, 0, s]``, ``s`` 0 on the
    second layout, else 1), so ranks on the fast path and ranks here meet in
    one collective and read the same sums. A rank on the fast path sees slot
    0 set, a rank here sees slot 1 set: all of them raise through
    ``mismatch`` together. Slot 2 still 0: every rank runs the second
    layout, checked by this very collective; it and the agreed one swap
    roles, everywhere at once (a loop alternating gradients and buffers pays
    one mirror per switch, no probe). Otherwise the full check runs
    (``probe``, ``verify``) and, passed on every rank, makes ``plan`` the
    agreed layout and the old one the second. Only the agreed layout may take
    the fast path: two ranks each on another would start first buckets of
    different sizes.
    """
    key = dist.group.WORLD if group is None else group
    state = _AGREED.get(key)
    speculates = plan.speculates(world)
    if state is not None:
        agreed, second = state
        if speculates and agreed.fingerprint == plan.fingerprint:
            return True
        first = agreed.first
        mirror = torch.zeros(first.numel, dtype=first.dtype, device=first.device)
        on_second = speculates and second is not None and second.fingerprint == plan.fingerprint
        mirror[-FLAGS] = 1
        mirror[-1] = 0 if on_second else 1
        dist.all_reduce(mirror, op=first.op, group=group)
        if mirror[-2].item() != 0:  # someone ran the agreed layout
            mismatch(plan, tree, group, caller)
        if mirror[-1].item() == 0:  # everyone runs the second layout: the check is done
            assert second is not None
            _AGREED[key] = (second, agreed)
            return False
    verify(plan, probe(plan, group), tree, group, caller)
    if speculates:
        assert plan.first is not None  # a plan that speculates has a first bucket
        entry = Agreed(plan.fingerprint, plan.first)
        _AGREED[key] = (entry, state[0] if state is not None else None)
    return False
