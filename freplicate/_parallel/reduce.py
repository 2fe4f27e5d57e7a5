"""The one-process all_reduce: a leaf-wise sum or mean of one tree per device.

``reduce_lists`` is the reduction itself, on flat lists, for the composites.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import _pack, _tree
from .._checks import check_mean, check_op, check_trees
from .._torch import foreach_div_, is_compiling, transform_level
from .._typing import Op, T

__all__ = ["all_reduce", "reduce_lists"]

_DENSE = {torch.strided}
# A mean in these dtypes sums in float64 and rounds once at the end: n values
# near the dtype's largest would overflow a sum in the dtype (float16 tops out
# at 65504; bfloat16 shares float32's range, so float32 is no wider), and
# dividing each operand first (as DDP does across ranks) rounds n times.
_WIDEN = frozenset({torch.float16, torch.bfloat16})


def all_reduce(trees: Sequence[T], *, op: Op = "mean") -> list[T]:
    """Leaf-wise sum or mean of ``trees`` (one per device), a result on each tree's devices.

    Result tree *i* has the structure of ``trees[i]``, its non-tensor leaves,
    and, at every tensor leaf, the sum (``op="sum"``) or the mean
    (``op="mean"``) over all trees, on the device of ``trees[i]``'s leaf. The
    reduction is coalesced as ``replicate``: one flat buffer per (device,
    dtype) per tree. A result has the memory format of tree 0's leaf
    (``channels_last`` stays ``channels_last``). Sparse COO leaves (the gradients of
    ``nn.Embedding(sparse=True)``) are reduced one by one and stay sparse
    (coalesced). Result trees whose leaves lie on the same device share
    those result tensors; none is an input tensor, and nothing is modified.
    Differentiable.

    Args:
        trees: one tree per replica, all of one structure, shapes and dtypes
            (a list of trees, not one tree).
        op: ``"sum"`` or ``"mean"``.

    Returns:
        One result tree per input tree, on that tree's devices.

    Raises:
        TypeError: ``trees`` is a single tree (a dict, a tensor) rather than a
            list of them; ``op="mean"`` on an integer or bool leaf (naming its path).
        ValueError: ``trees`` is empty; a bad ``op``; trees that differ in
            structure, shape or dtype, or a tensor in one tree where another
            has a non-tensor (naming the path).

    Examples:
        >>> a, b = {"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, 6.0])}
        >>> all_reduce([a, b])[1]["w"], all_reduce([a, b], op="sum")[0]["w"]
        (tensor([2., 4.]), tensor([4., 8.]))
        >>> all_reduce([{"n": torch.tensor(1)}, {"n": torch.tensor(2)}])
        Traceback (most recent call last):
        ...
        TypeError: fr.all_reduce: op='mean' needs floating-point or complex leaves, but the leaf at ['n'] is torch.int64; use op='sum' or convert it
    """
    caller = "fr.all_reduce"
    check_op(caller, op)
    trees = check_trees(caller, trees)
    if not trees:
        raise ValueError(f"{caller}: trees is empty; give one tree per device")
    flats = [_tree.flatten(t) for t in trees]
    diff = _tree.first_difference([s for _, s in flats], trees)
    if diff is not None:
        raise ValueError(f"{caller}: {diff}")
    spec = flats[0][1]
    leaves0 = flats[0][0]
    unique, slot = _tree.alias_groups(leaves0)
    if any(_tree.alias_groups(leaves)[1] != slot for leaves, _ in flats[1:]):
        # aliasing differs between trees: reduce every tensor position on its own
        unique = [i for i, x in enumerate(leaves0) if isinstance(x, torch.Tensor)]
        slot = [
            unique.index(i) if isinstance(x, torch.Tensor) else -1 for i, x in enumerate(leaves0)
        ]
    _check_kinds([leaves for leaves, _ in flats], slot, _tree.LazyPaths(spec), caller)
    paths = _tree.LazyPaths(spec, unique)
    lists = [[leaves[i] for i in unique] for leaves, _ in flats]
    _check_reducible(lists, paths, caller)
    if op == "mean":
        check_mean(caller, lists[0], paths)
    totals = reduce_lists(lists, [t.device for t in lists[0]], op, paths=paths, caller=caller)
    out: list[T] = []
    for j, (leaves, _) in enumerate(flats):
        here = totals
        if j > 0:
            here = _pack.move_each(totals, [t.device for t in lists[j]], paths=paths, caller=caller)
        out.append(_tree.rebuild(spec, leaves, slot, here))
    return out


def _check_kinds(
    leaves: list[list[object]], slot: Sequence[int], paths: Sequence[str], caller: str
) -> None:
    """``ValueError`` where a tree has a tensor and tree 0 a non-tensor (it would pass unreduced)."""
    others = [i for i, s in enumerate(slot) if s < 0]
    for j, lst in enumerate(leaves[1:], start=1):
        for i in others:
            if isinstance(lst[i], torch.Tensor):
                raise ValueError(
                    f"{caller}: trees differ at {paths[i]}: {_tree.describe(leaves[0][i])} in "
                    f"tree 0, {_tree.describe(lst[i])} in tree {j}"
                )


def _check_reducible(lists: list[list[object]], paths: Sequence[str], caller: str) -> None:
    ref = lists[0]
    for j, lst in enumerate(lists[1:], start=1):
        for k, (a, b) in enumerate(zip(ref, lst)):
            assert isinstance(a, torch.Tensor)
            if not isinstance(b, torch.Tensor):
                raise ValueError(
                    f"{caller}: trees differ at {paths[k]}: {_tree.describe(a)} in tree 0, "
                    f"{_tree.describe(b)} in tree {j}"
                )
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(
                    f"{caller}: trees differ at {paths[k]}: {a.dtype} of shape "
                    f"{tuple(a.shape)} in tree 0, {b.dtype} of shape {tuple(b.shape)} in tree {j}"
                )
            if a.layout != b.layout:
                raise ValueError(
                    f"{caller}: trees differ at {paths[k]}: layout {a.layout} in tree 0, "
                    f"{b.layout} in tree {j}"
                )


def reduce_lists(
    lists: Sequence[Sequence[torch.Tensor]],
    targets: Sequence[torch.device],
    op: Op,
    *,
    paths: Sequence[str],
    caller: str,
) -> list[torch.Tensor]:
    """Leaf-wise sum / mean of ``lists`` (checked alike); position ``k`` lands on ``targets[k]``.

    Dense tensors are summed coalesced, per target device; sparse ones (the
    gradients of ``nn.Embedding(sparse=True)``) one by one, staying sparse.
    A mean in float16 and bfloat16 sums in float64 and rounds once (``_WIDEN``).
    """
    out: list[torch.Tensor] = [None] * len(targets)  # type: ignore[list-item]
    n = len(lists)
    positions: Sequence[int] = range(len(targets))
    if {t.layout for t in lists[0]} != _DENSE:  # (Dynamo cannot trace attrgetter)
        sparse = [k for k in positions if lists[0][k].layout != torch.strided]
        for k in sparse:
            total = lists[0][k].to(targets[k])
            for lst in lists[1:]:
                total = total + lst[k].to(targets[k])
            out[k] = (total / n if op == "mean" else total).coalesce()
        positions = [k for k in positions if out[k] is None]
    for dev, where in _pack.group_by(positions, targets.__getitem__).items():
        idx = [positions[w] for w in where]
        every = len(idx) == len(targets)
        group = [list(lst) if every else [lst[k] for k in idx] for lst in lists]
        widened: list[tuple[int, torch.dtype]] = []  # positions summed in float64
        if op == "mean" and n > 1 and not _WIDEN.isdisjoint(t.dtype for t in group[0]):
            widened = [(i, t.dtype) for i, t in enumerate(group[0]) if t.dtype in _WIDEN]
            for lst in group:
                for i, _ in widened:
                    lst[i] = lst[i].double()
        sums = _pack.reduce_add_coalesced(
            group, dev, paths=paths if every else [paths[k] for k in idx], caller=caller
        )
        if op == "mean":
            if _in_place(sums):
                # the sums are fresh buffers of ours, never an input: divide in place
                foreach_div_(sums, n)
            else:
                # autograd, a torch.func transform (foreach ops have no batching rules), or
                # Dynamo tracing: the same division, out of place
                sums = [t / n for t in sums]
            for i, dtype in widened:
                sums[i] = sums[i].to(dtype)
        for k, s in zip(idx, sums):
            out[k] = s
    return out


def _in_place(sums: Sequence[torch.Tensor]) -> bool:
    """Whether dividing ``sums`` in place is safe: eager, outside autograd and every transform."""
    if is_compiling() or transform_level() is not None:
        return False
    return not any(s.requires_grad for s in sums)
