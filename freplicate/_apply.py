"""``apply(module, state, ...)``: run a module's forward with a state bound.

``apply`` runs a module's forward with a given state bound, as
``torch.func.functional_call`` does, but through a *skeleton*: a shallow copy
of every submodule object (the seed ``replicate``'s per-device copies), whose
``_parameters`` / ``_buffers`` / ``_modules`` dicts are its own. Binding a
state writes those dicts only, so the caller's module is never touched and
two threads never see each other's tensors. Skeletons are built once per
module and kept in a small pool (one per concurrent caller): a lock guards
only the pool, never the forward, so replicas run truly in parallel.

Each call refreshes every skeleton object's plain attributes from its
original (``training``, hooks, ``dropout.p`` ..., and attributes deleted
since), and a change of structure makes the next call rebuild it: a
parameter, buffer or submodule registered anywhere (registration hooks), or
a child removed or inserted without one (``del seq[1]``, ``seq.insert``,
``seq.pop``, which write ``_modules`` directly).
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections import deque
from itertools import repeat
from typing import Any

import torch
from torch import nn

from ._state import State

__all__ = ["apply"]


# --- structure generation: bumped whenever any module registers a tensor or a submodule


_GENERATION = [0]


def _bump(*_: Any) -> None:
    _GENERATION[0] += 1


nn.modules.module.register_module_parameter_registration_hook(_bump)
nn.modules.module.register_module_buffer_registration_hook(_bump)
nn.modules.module.register_module_module_registration_hook(_bump)

_MISSING: Any = object()
_MODULES = operator.itemgetter("_modules")
_SET_ATTR = object.__setattr__  # past nn.Module.__setattr__: the copy's __dict__ itself
# where a tensor is bound: (the copy's dict, key, canonical name, the original's dict)
_Slots = list[tuple[dict[str, Any], str, str, dict[str, Any]]]


class _Skeleton:
    """One shallow copy of a module tree, with its own tensor and child dicts."""

    __slots__ = (
        "bound_dicts",
        "buffer_slots",
        "copies",
        "own",
        "param_dicts",
        "param_origs",
        "param_slots",
        "root",
    )

    def __init__(self, binder: _Binder, mods: list[nn.Module]) -> None:
        copies: list[nn.Module] = list(mods)  # a module without tensors below it is used as is
        for i in binder.copied:
            m = mods[i]
            c = m.__new__(type(m))
            c.__dict__ = m.__dict__.copy()
            c.__dict__["_parameters"] = dict(m._parameters)
            c.__dict__["_buffers"] = dict(m._buffers)
            c.__dict__["_modules"] = dict(m._modules)
            copies[i] = c
        for i in binder.copied:
            c = copies[i]
            for key, j in binder.children[i]:
                c._modules[key] = copies[j] if j >= 0 else None
        self.root = copies[0]
        self.copies = [copies[i] for i in binder.copied]
        self.own = [
            {"_parameters": c._parameters, "_buffers": c._buffers, "_modules": c._modules}
            for c in (copies[i] for i in binder.copied)
        ]
        self.param_slots: _Slots = [
            (copies[i]._parameters, key, canon, mods[i]._parameters)
            for i, key, canon in binder.param_slots
        ]
        # the same, column-wise, for the C-speed binding of a complete ``params``
        self.param_dicts = [d for d, _, _, _ in self.param_slots]
        # each copy's parameter dict once, beside its original's: unbinding restores it whole
        pairs = {id(d): (d, od) for d, _, _, od in self.param_slots}
        self.bound_dicts = [d for d, _ in pairs.values()]
        self.param_origs = [od for _, od in pairs.values()]
        self.buffer_slots: _Slots = [
            (copies[i]._buffers, key, canon, mods[i]._buffers)
            for i, key, canon in binder.buffer_slots
        ]


class _Binder:
    """What ``apply`` knows of one module: its names, and a pool of skeletons."""

    def __init__(self, module: nn.Module) -> None:
        mods = list(module.modules())
        index = {id(m): i for i, m in enumerate(mods)}
        self.generation = _GENERATION[0]
        self.mods_ref = [weakref.ref(m) for m in mods]
        self.orig_dicts = [m.__dict__ for m in mods]
        # Children change without a registration hook only through direct edits of
        # ``_modules`` (``del seq[1]``, ``seq.insert``, ``seq.pop``): watch the
        # modules that have children, and the containers that make such edits.
        watched = [
            m
            for m in mods
            if m._modules or isinstance(m, (nn.Sequential, nn.ModuleList, nn.ModuleDict))
        ]
        self.watched_dicts = [m.__dict__ for m in watched]
        self.children_snapshot = [dict(m._modules) for m in watched]
        self.children = [
            [(k, index[id(c)] if c is not None else -1) for k, c in m._modules.items()]
            for m in mods
        ]
        canon: dict[int, str] = {}
        for name, p in module.named_parameters():
            canon.setdefault(id(p), name)
        for name, t in module.named_buffers():
            canon.setdefault(id(t), name)
        # every name a tensor is reachable under (tied weights, shared submodules)
        self.alias: dict[str, str] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            self.alias[name] = canon[id(p)]
        for name, t in module.named_buffers(remove_duplicate=False):
            self.alias[name] = canon[id(t)]
        self.canonical_names = frozenset(canon.values())
        self.param_slots = [
            (i, key, canon[id(p)])
            for i, m in enumerate(mods)
            for key, p in m._parameters.items()
            if p is not None
        ]
        self.buffer_slots = [
            (i, key, canon[id(b)])
            for i, m in enumerate(mods)
            for key, b in m._buffers.items()
            if b is not None
        ]
        self.param_keys = [key for _, key, _ in self.param_slots]
        self.param_canon = [canon for _, _, canon in self.param_slots]
        self.param_names = frozenset(self.param_canon)
        self.buffer_names = list(dict.fromkeys(c for _, _, c in self.buffer_slots))
        # Only modules with a tensor somewhere below them need a copy of their own;
        # the rest (activations, dropout, ...) hold nothing to bind, and the skeleton
        # calls the originals, so each call refreshes fewer attribute dicts.
        needs = [False] * len(mods)
        for i, _, _ in self.param_slots + self.buffer_slots:
            needs[i] = True
        grew = True
        while grew:  # up from every holder to the root (shared submodules: any order)
            grew = False
            for i, kids in enumerate(self.children):
                if not needs[i] and any(j >= 0 and needs[j] for _, j in kids):
                    needs[i] = grew = True
        self.copied = [i for i, n in enumerate(needs) if n]
        self.copied_dicts = [self.orig_dicts[i] for i in self.copied]
        self.pool: list[_Skeleton] = []
        self.lock = threading.Lock()

    def children_unchanged(self) -> bool:
        # Deleting or inserting a child (``del seq[1]``, ``seq.insert``) fires no
        # registration hook; children compare by identity, at C speed.
        return all(map(operator.eq, map(_MODULES, self.watched_dicts), self.children_snapshot))

    def same_structure(self, other: _Binder) -> bool:
        return (
            self.children == other.children
            and self.param_slots == other.param_slots
            and self.buffer_slots == other.buffer_slots
            and all(x() is y() for x, y in zip(self.mods_ref, other.mods_ref))
        )

    def acquire(self) -> _Skeleton:
        with self.lock:
            if self.pool:
                return self.pool.pop()
        mods = [r() for r in self.mods_ref]
        return _Skeleton(self, mods)  # type: ignore[arg-type]

    def release(self, skel: _Skeleton) -> None:
        with self.lock:
            self.pool.append(skel)


_BINDERS: weakref.WeakKeyDictionary[nn.Module, _Binder] = weakref.WeakKeyDictionary()
_BINDERS_LOCK = threading.Lock()


def _binder(module: nn.Module) -> _Binder:
    b = _BINDERS.get(module)
    if b is not None and b.generation == _GENERATION[0] and b.children_unchanged():
        return b
    # Something, somewhere, registered a tensor or a submodule: check this module.
    with _BINDERS_LOCK:
        fresh = _Binder(module)
        if b is not None and b.same_structure(fresh):
            b.generation = fresh.generation
            return b
        _BINDERS[module] = fresh
        return fresh


def _canonical(given: dict[str, torch.Tensor], b: _Binder, what: str) -> dict[str, torch.Tensor]:
    if given.keys() <= b.canonical_names:  # the common case, checked at C speed
        return given
    alias = b.alias
    unknown = [k for k in given if k not in alias]
    if unknown:
        raise KeyError(
            f"fr.apply: state.{what} has {unknown[0]!r}, which the module does not have"
            + (f" (nor {unknown[1:]!r})" if len(unknown) > 1 else "")
        )
    if all(alias[k] == k for k in given):
        return given
    out: dict[str, torch.Tensor] = {}
    for k, v in given.items():
        c = alias[k]
        if c in out and out[c] is not v:
            raise ValueError(
                f"fr.apply: state.{what} gives different tensors for the tied names {c!r} and {k!r}"
            )
        out[c] = v
    return out


def apply(module: nn.Module, state: State, /, *args: Any, **kwargs: Any) -> tuple[Any, State]:
    """Run ``module``'s forward with ``state`` bound; return ``(output, new_state)``.

    Equivalent to ``torch.func.functional_call(module, {**params, **buffers},
    args, kwargs)``, but safe to call from several threads at once on one
    module, and nothing is modified: buffers are copied before the forward,
    and their values after it (BatchNorm statistics) come back in
    ``new_state.buffers``; ``new_state.params`` is ``state.params``. Names
    missing from ``state`` fall back to the module's own tensors.

    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <...>
    >>> bn = nn.BatchNorm1d(2)
    >>> s = state(bn)
    >>> out, s2 = apply(bn, s, torch.randn(4, 2))
    >>> int(s2.buffers["num_batches_tracked"]), int(s.buffers["num_batches_tracked"])
    (1, 0)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fr.apply: module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(state, tuple) or len(state) != 2:
        raise TypeError(
            f"fr.apply: state must be an fr.State(params, buffers), got {type(state).__name__}"
        )
    b = _binder(module)
    params = state[0]
    # every parameter under its first name (what fr.state gives): one pass decides
    complete = params.keys() == b.param_names
    if not complete:
        params = _canonical(params, b, "params")
        complete = params.keys() >= b.param_names
    buffers = _canonical(state[1], b, "buffers")
    skel = b.acquire()
    try:
        # each copy gets a new attribute dict: its original's, with its own tensor and child
        # dicts (``original | own``, a C-level clone): train()/eval() and any attribute
        # change are seen, and an attribute a forward set on the copy is forgotten
        fresh = map(operator.or_, b.copied_dicts, skel.own)
        deque(map(_SET_ATTR, skel.copies, repeat("__dict__"), fresh), 0)
        pget, bget = params.get, buffers.get
        if complete:  # every parameter given: bind at C speed
            values = map(params.__getitem__, b.param_canon)
            deque(map(operator.setitem, skel.param_dicts, b.param_keys, values), 0)
        else:
            for d, key, canon, od in skel.param_slots:
                v = pget(canon, _MISSING)
                if v is _MISSING:
                    v = bget(canon, _MISSING)
                    if v is _MISSING:
                        v = od[key]
                d[key] = v
        copies: dict[str, torch.Tensor] = {}
        for d, key, canon, od in skel.buffer_slots:
            v = copies.get(canon)
            if v is None:
                v = bget(canon, _MISSING)
                if v is _MISSING:
                    v = pget(canon, _MISSING)
                    if v is _MISSING:
                        v = od[key]
                v = copies[canon] = v.clone()
            d[key] = v
        out = skel.root(*args, **kwargs)
        new_buffers = {canon: d[key] for d, key, canon, _ in skel.buffer_slots}
    finally:
        # unbind (back to the module's own tensors), so that a pooled skeleton
        # keeps no caller's tensor alive
        deque(map(dict.update, skel.bound_dicts, skel.param_origs), 0)
        for d, key, _, od in skel.buffer_slots:
            d[key] = od.get(key)
        b.release(skel)
    ordered = {k: new_buffers[k] for k in buffers if k in new_buffers}
    for k in b.buffer_names:
        ordered.setdefault(k, new_buffers[k])
    return out, State(state[0], ordered)
