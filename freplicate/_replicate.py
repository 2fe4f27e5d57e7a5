"""``replicate(tree, devices)``: the seed ``torch.nn.parallel.replicate``, on trees.

Flatten, deduplicate tied leaves, let the coalescing engine broadcast the
distinct tensors, re-alias and unflatten once per device. Plain tensor ops
throughout, so gradients of all replicas sum back into ``tree`` under autograd
and ``torch.func`` alike (the seed's ``Broadcast``).

A leaf already on a target device is not copied, but neither is it handed
out as is: every replica gets tensor objects of its own that share the
leaf's storage (``detach()`` for a leaf outside every graph, ``aten.alias`` for
one in a graph, ``view_as`` under a ``torch.func`` transform, so that gradients
still flow back to it). A forward that writes ``.grad`` or calls ``zero_grad()`` on
its replica then touches that replica's objects only, never the caller's nor
another replica's (replicas run in threads of their own).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any, TypeVar

import torch
from torch import nn

from . import _pack, _tree
from ._devices import DeviceSpec, as_devices
from ._state import State
from ._torch import is_compiling, transform_level

__all__ = ["replicate", "replicate_shared"]

T = TypeVar("T")
_new_tuple = tuple.__new__  # a NamedTuple without its Python-level __new__
_DETACH = torch.Tensor.detach
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_DEVICE = operator.attrgetter("device")


def replicate(tree: T, devices: Sequence[DeviceSpec], *, detach: bool = False) -> list[T]:
    """One copy of ``tree`` per device, same structure; nothing is modified.

    Leaves already on a target device are not copied: the replica's tensor
    is a new tensor object sharing the leaf's storage (zero copy), so that
    what a replica does to its tensor objects (``.grad``, ``zero_grad()``
    in a forward) never reaches the caller's tensors nor another replica's.
    The other leaves are moved in one flat buffer per (source device,
    dtype). A tensor at several leaf positions (tied weights) is moved once
    and stays one object within each replica. Non-tensor leaves pass by
    reference. A moved tensor has the strides ``leaf.to(device)`` gives it
    (``channels_last`` stays ``channels_last``), and starts 64-byte aligned
    in its buffer, as a tensor of its own would.

    Args:
        tree: a tree of tensors (``fr.state(module)``, a dict of parameters);
            not a module: replicate its state, ``fr.replicate(fr.state(module), devices)``.
        devices: one device per replica (repeats allowed: ``["cpu", "cpu"]``).
        detach: replicas outside every autograd graph. Otherwise gradients
            of all replicas sum back into ``tree``, under autograd and
            ``torch.func``.

    Returns:
        One tree per device, of ``tree``'s structure.

    Raises:
        TypeError: ``tree`` is (or holds) an ``nn.Module``; a leaf that cannot
            be moved (named by its path).
        ValueError: an empty ``devices``, or a bad device.

    >>> t = torch.ones(2)
    >>> r = replicate({"w": t, "tied": t, "n": 3}, ["cpu", "meta"])
    >>> r[0]["w"] is t, r[0]["w"].data_ptr() == t.data_ptr(), r[1]["w"].device
    (False, True, device(type='meta'))
    >>> r[1]["w"] is r[1]["tied"], r[1]["n"]
    (True, 3)
    """
    return _replicate(tree, devices, detach=detach, own=True)


def replicate_shared(tree: T, devices: Sequence[torch.device]) -> list[T]:
    """``replicate`` for internal callers that never expose the replicas' tensor objects.

    A leaf already on a target device is the replica's (no new object): for
    ``fr.data_parallel_grad``, whose gradient function binds fresh leaves of
    its own to every replica's values.
    """
    return _replicate(tree, devices, detach=False, own=False)


def _replicate(tree: T, devices: Sequence[DeviceSpec], *, detach: bool, own: bool) -> list[T]:
    if isinstance(tree, nn.Module):
        raise _module_error(tree)
    devs = as_devices(devices, caller="fr.replicate")
    if type(tree) is State:
        shared = _local_state(tree, devs, detach, own)  # type: ignore[arg-type]
        if shared is not None:
            return shared  # type: ignore[return-value]
    leaves, spec = _tree.flatten(tree)
    unique, slot = _tree.alias_groups(leaves)
    if len(unique) != len(leaves):
        for leaf, s in zip(leaves, slot):
            if s < 0 and isinstance(leaf, nn.Module):
                raise _module_error(leaf)
    if not unique:
        return [tree for _ in devs]
    tensors = [leaves[i] for i in unique]
    where = {x.device for x in tensors}
    if len(where) == 1 and all(d in where for d in devs):
        # every tensor already on every target device (replicas on the host, or a
        # state replicated onto the device it lives on): nothing to pack
        if not own and not detach:
            return [_tree.unflatten(spec, leaves) for _ in devs]
        alias = _aliaser(tensors, detach)
        copies = [list(map(alias, tensors)) for _ in devs]
    else:
        paths = _tree.LazyPaths(spec, unique)
        copies = _pack.broadcast_coalesced(
            tensors, devs, paths=paths, caller="fr.replicate", detach=detach
        )
        if own:
            # the engine hands a leaf already on its device out as is, and one list
            # to every repeat of a device: each replica gets objects of its own
            alias = _aliaser(tensors, detach)
            engine, seen = list(copies), set()
            for d, moved in enumerate(engine):
                if id(moved) in seen:
                    copies[d] = list(map(alias, moved))
                else:
                    seen.add(id(moved))
                    copies[d] = [alias(m) if m is t else m for m, t in zip(moved, tensors)]
    if len(unique) == len(leaves):  # every leaf a distinct tensor: nothing to re-alias
        return [_tree.unflatten(spec, moved) for moved in copies]
    return [_tree.rebuild(spec, leaves, slot, moved) for moved in copies]


def _module_error(module: nn.Module) -> TypeError:
    return TypeError(
        f"fr.replicate: got a module ({type(module).__name__}), which is not a tree of "
        "tensors; replicate its state instead: fr.replicate(fr.state(module), devices)"
    )


_ALIAS = torch.ops.aten.alias.default


def _alias_in_graph(t: torch.Tensor) -> torch.Tensor:
    # a leaf in a graph gets an alias, through which its replica's gradients flow back as
    # they are (a view's backward reshapes, which a sparse gradient refuses: nn.Embedding)
    return _ALIAS(t) if t.requires_grad else t.detach()


def _view(t: torch.Tensor) -> torch.Tensor:
    return t.view_as(t)


def _aliaser(tensors: Sequence[torch.Tensor], detach: bool) -> Callable[[torch.Tensor], Any]:
    """How to make a new tensor object on a leaf's storage that keeps what ``replicate`` promises.

    ``detach()`` is the cheapest alias; a leaf in an autograd graph (or any
    leaf under a ``torch.func`` transform, whose wrappers carry the graph)
    is viewed instead, so that the replica stays differentiable.
    """
    if detach:
        return _DETACH
    if is_compiling() or transform_level() is not None:
        # a view is free in a compiled graph, and a transform's wrappers may not report
        # requires_grad while they carry its graph
        return _view
    if any(map(_REQUIRES_GRAD, tensors)):
        return _alias_in_graph
    return _DETACH


def _local_state(
    state: State, devs: list[torch.device], detach: bool, own: bool
) -> list[State] | None:
    """Replicas of a ``State`` of plain dicts of tensors all on every target device, else ``None``.

    The common case of replicas on the host (or of a state replicated onto
    its own device) at dict-building speed: the general path's flatten and
    unflattens build the same new dicts, in the same order, of the same
    aliases (a few microseconds that matter against the deep copies of a
    small model).
    """
    params, buffers = state
    if type(params) is not dict or type(buffers) is not dict:
        return None
    values = [*params.values(), *buffers.values()]
    if is_compiling():  # Dynamo traces comprehensions, not attrgetter
        if not all(isinstance(t, torch.Tensor) for t in values):
            return None
        where = {t.device for t in values}
    else:
        if not all(map(isinstance, values, repeat(torch.Tensor))):
            return None
        where = set(map(_DEVICE, values))
    if len(where) > 1 or (where and any(d not in where for d in devs)):
        return None
    if not own and not detach:
        return [_new_tuple(State, (dict(params), dict(buffers))) for _ in devs]
    pv, bv = list(params.values()), list(buffers.values())
    alias = _aliaser(values, detach)
    # no tied tensors; or compiling, where id() would make Dynamo guard on each tensor's
    # identity (a recompile every step): tied names then get aliases of their own, which
    # nothing in a graph can tell apart
    if is_compiling() or len(set(map(id, values))) == len(values):
        pk, bk = list(params), list(buffers)
        return [
            _new_tuple(State, (dict(zip(pk, map(alias, pv))), dict(zip(bk, map(alias, bv)))))
            for _ in devs
        ]
    out = []
    for _ in devs:
        memo: dict[int, torch.Tensor] = {}  # a tied tensor: one alias per replica
        parts = []
        for part in (params, buffers):
            new = {}
            for k, v in part.items():
                a = memo.get(id(v))
                if a is None:
                    a = memo[id(v)] = alias(v)
                new[k] = a
            parts.append(new)
        out.append(_new_tuple(State, tuple(parts)))
    return out
