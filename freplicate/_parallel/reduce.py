"""The one-process all_reduce: a leaf-wise sum or mean of one tree per device."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal, TypeVar

import torch

from .. import _pack, _tree
from .._torch import transform_level
from .scatter import _kind

__all__ = ["all_reduce"]

T = TypeVar("T")
Op = Literal["sum", "mean"]


def _by_device(
    positions: Iterable[int], targets: Sequence[torch.device]
) -> dict[torch.device, list[int]]:
    groups: dict[torch.device, list[int]] = {}
    for i in positions:
        groups.setdefault(targets[i], []).append(i)
    return groups


def _move_each(
    tensors: list[torch.Tensor], targets: Sequence[torch.device], paths: Sequence[str], name: str
) -> list[torch.Tensor]:
    """``tensors[i]`` onto ``targets[i]``, coalesced per target device."""
    out = list(tensors)
    away = [i for i in range(len(tensors)) if tensors[i].device != targets[i]]
    for dev, idx in _by_device(away, targets).items():
        moved = _pack.broadcast_coalesced(
            [tensors[i] for i in idx], [dev], paths=[paths[i] for i in idx], fn=name
        )[0]
        for i, t in zip(idx, moved):
            out[i] = t
    return out


def all_reduce(trees: Sequence[T], *, op: Op = "mean") -> list[T]:
    """Leaf-wise sum or mean of ``trees`` (one per device), a result on each tree's devices.

    Result tree *i* has the structure of ``trees[i]``, its non-tensor leaves,
    and, at every tensor leaf, the sum (``op="sum"``) or the mean
    (``op="mean"``) over all trees, on the device of ``trees[i]``'s leaf. The
    reduction is coalesced as ``replicate``: one flat buffer per (device,
    dtype) per tree. Result trees whose leaves lie on the same device share
    those result tensors; none is an input tensor, and nothing is modified.
    Differentiable.

    >>> a, b = {"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, 6.0])}
    >>> all_reduce([a, b])[1]["w"], all_reduce([a, b], op="sum")[0]["w"]
    (tensor([2., 4.]), tensor([4., 8.]))
    >>> all_reduce([{"n": torch.tensor(1)}, {"n": torch.tensor(2)}])
    Traceback (most recent call last):
    ...
    TypeError: fr.all_reduce: op='mean' needs floating-point or complex leaves, but the leaf at ['n'] is torch.int64; use op='sum'
    """
    name = "fr.all_reduce"
    if op not in ("sum", "mean"):
        raise ValueError(f"{name}: op must be 'sum' or 'mean', got {op!r}")
    trees = list(trees)
    if not trees:
        raise ValueError(f"{name}: trees is empty; give one tree per device")
    flats = [_tree.flatten(t) for t in trees]
    diff = _tree.first_difference([s for _, s in flats], trees)
    if diff is not None:
        raise ValueError(f"{name}: {diff}")
    spec = flats[0][1]
    leaves0 = flats[0][0]
    unique, slot = _tree.alias_groups(leaves0)
    if any(_tree.alias_groups(leaves)[1] != slot for leaves, _ in flats[1:]):
        # aliasing differs between trees: reduce every tensor position on its own
        unique = [i for i, x in enumerate(leaves0) if isinstance(x, torch.Tensor)]
        slot = [
            unique.index(i) if isinstance(x, torch.Tensor) else -1 for i, x in enumerate(leaves0)
        ]
    paths = _tree.LazyPaths(spec, unique)
    lists = [[leaves[i] for i in unique] for leaves, _ in flats]
    _check_reducible(lists, paths, op, name)
    targets0 = [t.device for t in lists[0]]
    totals = _reduce(lists, targets0, op, paths, name)
    out: list[T] = []
    for j, (leaves, _) in enumerate(flats):
        here = totals if j == 0 else _move_each(totals, [t.device for t in lists[j]], paths, name)
        out.append(_tree.unflatten(spec, [here[s] if s >= 0 else x for x, s in zip(leaves, slot)]))
    return out


def _check_reducible(lists: list[list[Any]], paths: Sequence[str], op: str, name: str) -> None:
    ref = lists[0]
    for j, lst in enumerate(lists[1:], start=1):
        for k, (a, b) in enumerate(zip(ref, lst)):
            if not isinstance(b, torch.Tensor):
                raise ValueError(
                    f"{name}: trees differ at {paths[k]}: a tensor in tree 0, "
                    f"{_kind(b)} in tree {j}"
                )
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(
                    f"{name}: trees differ at {paths[k]}: {a.dtype} of shape {tuple(a.shape)} "
                    f"in tree 0, {b.dtype} of shape {tuple(b.shape)} in tree {j}"
                )
    if op == "mean":
        for k, a in enumerate(ref):
            if not (a.is_floating_point() or a.is_complex()):
                raise TypeError(
                    f"{name}: op='mean' needs floating-point or complex leaves, but the leaf "
                    f"at {paths[k]} is {a.dtype}; use op='sum'"
                )


def _reduce(
    lists: Sequence[Sequence[torch.Tensor]],
    targets: Sequence[torch.device],
    op: str,
    paths: Sequence[str],
    name: str,
) -> list[torch.Tensor]:
    """Leaf-wise sum / mean of ``lists``; position ``k`` lands on ``targets[k]``."""
    out: list[torch.Tensor] = [None] * len(targets)  # type: ignore[list-item]
    n = len(lists)
    for dev, idx in _by_device(range(len(targets)), targets).items():
        every = len(idx) == len(targets)
        group = [list(lst) if every else [lst[k] for k in idx] for lst in lists]
        sums = _pack.reduce_add_coalesced(
            group, dev, paths=paths if every else [paths[k] for k in idx], caller=name
        )
        if op == "mean":
            if transform_level() is None and not any(s.requires_grad for s in sums):
                # the sums are fresh buffers of ours, never an input: divide in place
                torch._foreach_div_(sums, n)
            else:
                # autograd or a torch.func transform (foreach ops have no batching rules)
                sums = [s / n for s in sums]
        for k, s in zip(idx, sums):
            out[k] = s
    return out
