"""``replicate(tree, devices)``: the seed ``torch.nn.parallel.replicate``, on trees.

Flatten, deduplicate tied leaves, let the coalescing engine broadcast the
distinct tensors, re-alias and unflatten once per device. Plain tensor ops
throughout, so gradients of all replicas sum back into ``tree`` under autograd
and ``torch.func`` alike (the seed's ``Broadcast``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch

from . import _pack, _tree
from ._devices import DeviceSpec, as_devices
from ._state import State

__all__ = ["replicate"]

T = TypeVar("T")
_new_tuple = tuple.__new__  # a NamedTuple without its Python-level __new__


def replicate(tree: T, devices: Sequence[DeviceSpec], *, detach: bool = False) -> list[T]:
    """One copy of ``tree`` per device, same structure; nothing is modified.

    Leaves already on a target device are shared, not copied; the others are
    moved in one flat buffer per (source device, dtype). A tensor at several
    leaf positions (tied weights) is moved once and stays one object within
    each replica. Non-tensor leaves pass by reference.

    >>> t = torch.ones(2)
    >>> r = replicate({"w": t, "tied": t, "n": 3}, ["cpu", "meta"])
    >>> r[0]["w"] is t, r[1]["w"].device, r[1]["w"] is r[1]["tied"], r[1]["n"]
    (True, device(type='meta'), True, 3)
    """
    devs = as_devices(devices, fn="fr.replicate")
    if not detach and type(tree) is State:
        shared = _shared_state(tree, devs)  # type: ignore[arg-type]
        if shared is not None:
            return shared  # type: ignore[return-value]
    leaves, spec = _tree.flatten(tree)
    if not detach:
        # Every tensor already on every target device (replicas on the host, or a
        # state replicated onto the device it lives on): the replicas are new trees
        # of the very same leaves, ties included, and there is nothing to pack.
        where = {x.device for x in leaves if isinstance(x, torch.Tensor)}
        if len(where) == 1 and all(d in where for d in devs):
            return [_tree.unflatten(spec, leaves) for _ in devs]
    unique, slot = _tree.alias_groups(leaves)
    if not unique:
        return [tree for _ in devs]
    tensors = [leaves[i] for i in unique]
    paths = _tree.LazyPaths(spec, unique)
    copies = _pack.broadcast_coalesced(tensors, devs, paths=paths, fn="fr.replicate", detach=detach)
    if len(unique) == len(leaves):  # every leaf a distinct tensor: nothing to re-alias
        return [_tree.unflatten(spec, moved) for moved in copies]
    out: list[Any] = []
    for moved in copies:
        new = [moved[s] if s >= 0 else leaf for leaf, s in zip(leaves, slot)]
        out.append(_tree.unflatten(spec, new))
    return out


def _shared_state(state: State, devs: list[torch.device]) -> list[State] | None:
    """Replicas of a ``State`` of plain dicts of tensors all on every target device, else ``None``.

    The common case of replicas on the host (or of a state replicated onto
    its own device) at dict-copy speed: the general path's flatten and
    unflattens build the same new dicts, in the same order, of the same
    tensors (a few microseconds that matter against the deep copies of a
    small model).
    """
    params, buffers = state
    if type(params) is not dict or type(buffers) is not dict:
        return None
    where = set()
    for part in (params, buffers):
        for t in part.values():
            if not isinstance(t, torch.Tensor):
                return None
            where.add(t.device)
    if len(where) != 1 or any(d not in where for d in devs):
        return None
    return [_new_tuple(State, (dict(params), dict(buffers))) for _ in devs]
