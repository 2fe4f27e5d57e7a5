"""``apply(module, state, ...)``: run a module's forward with a state bound.

``apply`` computes what ``torch.func.functional_call`` computes, without
touching the caller's module, through a *skeleton*: a shallow copy of every
submodule object that holds a tensor somewhere below it (the seed
``replicate``'s per-device copies), with ``_parameters`` / ``_buffers`` /
``_modules`` dicts of its own. Binding a state writes those dicts only, so
two threads never see each other's tensors and replicas run truly in
parallel (no lock around the forward).

Three things shape the binding:

- **Structure without hooks.** What ``apply`` knows of a module (a
  ``_Binder``: where each tensor sits, which names are tied) is checked on
  every call against the modules themselves: the identity of every value in
  the copied modules' tensor and child dicts, at C speed. Any change (a
  parameter deleted, set to ``None``, replaced or newly tied, a child
  inserted or swapped) rebuilds it. Nothing is installed process-wide.
- **No leak.** A binder holds its modules only weakly, and a skeleton at
  rest holds none of the originals' attributes (hooks that refer to their
  module would otherwise keep it alive through the cache).
- **Autograd's recomputation.** Activation checkpointing re-runs parts of the
  forward during backward, on the module objects it captured (the skeleton's
  copies). A skeleton stays bound to its call's tensors for as long as
  anything outside it still refers to one of its copies (checked by
  reference counts when the forward returns); only a skeleton that nothing
  else holds is unbound and reused. While ``torch.compile`` traces, the
  binding is ``torch.func.functional_call`` itself, which Dynamo understands.
"""

from __future__ import annotations

import itertools
import operator
import sys
import weakref
from collections import deque
from collections.abc import Callable
from itertools import repeat
from typing import Any

import torch
from torch import nn

from . import _caches
from ._checks import check_state
from ._state import State
from ._torch import is_compiling

__all__ = ["apply"]

_MISSING: Any = object()
_SET_ATTR = object.__setattr__  # past nn.Module.__setattr__: the copy's __dict__ itself
_DICT = operator.attrgetter("__dict__")
_DEREF = weakref.ref.__call__
_PARAMS = operator.itemgetter("_parameters")
_BUFFERS = operator.itemgetter("_buffers")
_MODULES = operator.itemgetter("_modules")
_VALUES = dict.values
_CHAIN = itertools.chain.from_iterable
_REFCOUNT = sys.getrefcount
_FIRST = operator.itemgetter(0)
_SECOND = operator.itemgetter(1)
# At most this many idle skeletons are kept per module (one per concurrent caller).
_POOL_SIZE = 8
# where a tensor is bound: (index of the copy, key, canonical name)
_Slot = tuple[int, str, str]


class _Skeleton:
    """One shallow copy of a module tree, with its own tensor and child dicts.

    At rest, a copy's attribute dict holds only its own three dicts, whose
    tensor slots hold ``None``: no caller tensor and no attribute of the
    originals (hooks that may refer to their module) is kept alive. Its
    ``_modules`` holds only the copies of its copied children; the other
    children (tensorless modules) are taken from the original on each call.
    """

    __slots__ = ("at_bound", "at_rest", "bdicts", "blank", "call", "copies", "kids", "own", "pdicts")

    def __init__(self, binder: _Binder, mods: list[nn.Module]) -> None:
        # ``mods``: the copied modules, checked against ``binder``'s structure just now
        copies = [m.__new__(type(m)) for m in mods]
        self.pdicts: list[dict[str, Any]] = [dict.fromkeys(m._parameters) for m in mods]
        self.bdicts: list[dict[str, Any]] = [dict.fromkeys(m._buffers) for m in mods]
        self.kids: list[dict[str, nn.Module]] = [{} for _ in mods]
        for parent, key, child in binder.links:
            self.kids[parent][key] = copies[child]
        self.own = [
            {"_parameters": p, "_buffers": b, "_modules": k}
            for p, b, k in zip(self.pdicts, self.bdicts, self.kids)
        ]
        self.blank = [(dict(p), dict(b)) for p, b in zip(self.pdicts, self.bdicts)]
        deque(map(_SET_ATTR, copies, repeat("__dict__"), self.own), 0)
        self.copies = copies
        self.call: Callable[..., Any] = copies[0]
        if binder.compiled is not None:
            # torch.compile(m): a compiled wrapper of the copy of m, made as torch.compile makes
            # one (its compiled code would otherwise run on m itself and ignore the state);
            # the wrapper reads the copy's attributes once, so lend it the original's
            j = self.copies.index(self.kids[0]["_orig_mod"])
            _SET_ATTR(copies[j], "__dict__", mods[j].__dict__ | self.own[j])
            self.call = binder.compiled(copies[j])
            _SET_ATTR(copies[j], "__dict__", self.own[j])
        self.at_rest: list[int] = []
        self.at_bound: list[int] = []

    def counts(self) -> list[int]:
        """Reference counts of the copies: above the expected, something outside holds one."""
        return list(map(_REFCOUNT, self.copies))


class _Binder:
    """What ``apply`` knows of one module's structure, and a pool of its skeletons.

    Holds modules only weakly: a hook or attribute of a module that refers to
    the module itself must not keep it alive through this cache. The
    tensors of the copied modules are held (snapshots of their tensor
    dicts, compared on every call by identity at C speed).
    """

    def __init__(self, module: nn.Module) -> None:
        mods = list(module.modules())
        index = {id(m): i for i, m in enumerate(mods)}
        children = [
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
        # Only modules with a tensor somewhere below them need a copy of their own;
        # the rest (activations, dropout, ...) hold nothing to bind, and the skeleton
        # calls the originals, so each call refreshes fewer attribute dicts.
        needs = [bool(m._parameters or m._buffers) for m in mods]
        grew = True
        while grew:  # up from every holder to the root (shared submodules: any order)
            grew = False
            for i, kids in enumerate(children):
                if not needs[i] and any(j >= 0 and needs[j] for _, j in kids):
                    needs[i] = grew = True
        needs[0] = True  # the root is always a copy: the call goes through it
        copied = [i for i, n in enumerate(needs) if n]
        position = {i: k for k, i in enumerate(copied)}
        self.param_slots: list[_Slot] = [
            (position[i], key, canon[id(p)])
            for i, m in enumerate(mods)
            for key, p in m._parameters.items()
            if p is not None
        ]
        self.buffer_slots: list[_Slot] = [
            (position[i], key, canon[id(b)])
            for i, m in enumerate(mods)
            for key, b in m._buffers.items()
            if b is not None
        ]
        self.param_at = [k for k, _, _ in self.param_slots]
        self.param_keys = [key for _, key, _ in self.param_slots]
        self.param_canon = [c for _, _, c in self.param_slots]
        self.param_names = frozenset(self.param_canon)
        self.buffer_names = list(dict.fromkeys(slot[2] for slot in self.buffer_slots))
        # the structure each call checks: copied modules, their tensor dicts, copied children
        self.refs = [weakref.ref(mods[i]) for i in copied]
        self.with_params = [k for k, i in enumerate(copied) if mods[i]._parameters]
        self.snap_params = [dict(mods[copied[k]]._parameters) for k in self.with_params]
        self.with_buffers = [k for k, i in enumerate(copied) if mods[i]._buffers]
        self.snap_buffers = [dict(mods[copied[k]]._buffers) for k in self.with_buffers]
        self.links = [
            (position[i], key, position[j])
            for i in copied
            for key, j in children[i]
            if j >= 0 and needs[j]
        ]
        self.link_child = [c for _, _, c in self.links]
        # per parent: its copied children's keys and positions, each looked up in one C call
        by_parent: dict[int, list[tuple[str, int]]] = {}
        for parent, key, child in self.links:
            by_parent.setdefault(parent, []).append((key, child))
        self.kid_checks = [
            (parent, _getter([k for k, _ in kids]), _getter([c for _, c in kids]))
            for parent, kids in by_parent.items()
        ]
        # copies whose _modules must be merged with the original's on each call
        self.with_children = [k for k, i in enumerate(copied) if mods[i]._modules]
        self.compiled = _dynamo_context(module)
        self.pool: list[_Skeleton] = []

    def originals(self) -> list[dict[str, Any]] | None:
        """The copied modules' attribute dicts now, or ``None`` if the structure changed."""
        mods = list(map(_DEREF, self.refs))
        if None in mods:
            return None
        dicts = list(map(_DICT, mods))
        at = dicts.__getitem__
        try:
            if list(map(_PARAMS, map(at, self.with_params))) != self.snap_params:
                return None
            if self.with_buffers and list(map(_BUFFERS, map(at, self.with_buffers))) != self.snap_buffers:
                return None
            for parent, keys, positions in self.kid_checks:
                if keys(dicts[parent]["_modules"]) != positions(mods):
                    return None
        except (KeyError, RuntimeError):  # a child gone; tensors compared by value: changed
            return None
        return dicts

    def skeleton(self) -> _Skeleton:
        try:
            return self.pool.pop()  # atomic: no lock, each caller its own skeleton
        except IndexError:
            pass
        mods = list(map(_DEREF, self.refs))
        skel = _Skeleton(self, mods)  # type: ignore[arg-type]
        del mods
        skel.at_rest = skel.counts()  # here, where no local refers to a copy
        # while bound, each copied child is also held by its parent's merged child dict
        bound = list(skel.at_rest)
        for child in self.link_child:
            bound[child] += 1
        skel.at_bound = bound
        return skel

    def release(self, skel: _Skeleton) -> None:
        if len(self.pool) < _POOL_SIZE:
            self.pool.append(skel)


def _getter(items: list[Any]) -> Callable[[Any], tuple[Any, ...]]:
    """``itemgetter`` that always returns a tuple (one item included)."""
    if len(items) == 1:
        get = operator.itemgetter(items[0])
        return lambda x: (get(x),)
    return operator.itemgetter(*items)  # type: ignore[return-value]


def _dynamo_context(module: nn.Module) -> Callable[[nn.Module], nn.Module] | None:
    """For ``torch.compile(m)``: a function wrapping a copy of ``m`` as ``m`` is wrapped."""
    orig = module.__dict__.get("_modules", {}).get("_orig_mod")
    ctx = module.__dict__.get("dynamo_ctx")
    if orig is None or ctx is None or type(module).__name__ != "OptimizedModule":
        return None
    return lambda copy: type(module)(copy, ctx)  # type: ignore[call-arg]


_BINDERS: weakref.WeakKeyDictionary[nn.Module, _Binder] = weakref.WeakKeyDictionary()
_caches.register(_BINDERS.clear)


def _binder(module: nn.Module) -> tuple[_Binder, list[dict[str, Any]]]:
    """The module's binder, checked against the module as it is now (rebuilt if it changed)."""
    b = _BINDERS.get(module)
    if b is not None:
        dicts = b.originals()
        if dicts is not None:
            return b, dicts
    b = _Binder(module)
    _BINDERS[module] = b
    dicts = b.originals()
    assert dicts is not None
    return b, dicts


def _canonical(given: dict[str, Any], b: _Binder, what: str) -> dict[str, Any] | None:
    """``given`` under canonical names; ``None`` if it names something the binder lacks."""
    if given.keys() <= b.canonical_names:  # the common case, checked at C speed
        return given
    alias = b.alias
    if any(k not in alias for k in given):
        return None
    if all(alias[k] == k for k in given):
        return given
    out: dict[str, Any] = {}
    for k, v in given.items():
        c = alias[k]
        if c in out and out[c] is not v:
            raise ValueError(
                f"fr.apply: state.{what} gives different tensors for the tied names {c!r} and {k!r}"
            )
        out[c] = v
    return out


def _unknown(given: dict[str, Any], b: _Binder, what: str) -> KeyError:
    unknown = [k for k in given if k not in b.alias]
    return KeyError(
        f"fr.apply: state.{what} has {unknown[0]!r}, which the module does not have"
        + (f" (nor {unknown[1:]!r})" if len(unknown) > 1 else "")
    )


def apply(module: nn.Module, state: State, /, *args: Any, **kwargs: Any) -> tuple[Any, State]:
    """Run ``module``'s forward with ``state`` bound; return ``(output, new_state)``.

    Equivalent to ``torch.func.functional_call(module, {**params, **buffers},
    args, kwargs)``, but safe to call from several threads at once on one
    module, and nothing is modified: buffers are copied before the forward,
    and their values after it (BatchNorm statistics) come back in
    ``new_state.buffers``; ``new_state.params`` is ``state.params``. Names
    missing from ``state`` fall back to the module's own tensors.

    The binding lasts as long as the call's autograd graph can replay the
    forward (activation checkpointing recomputes with the state's tensors,
    not the module's). A ``torch.compile``-d module runs its compiled code
    with the state bound. Under ``torch.compile`` the call traces as
    ``functional_call`` (no graph break).

    Args:
        module: the module whose forward runs; never modified.
        state: an ``fr.State(params, buffers)``: dicts of tensors keyed by
            qualified name (tied names may be given under any of their names).
        *args: positional arguments of the forward.
        **kwargs: keyword arguments of the forward.

    Returns:
        ``(output, new_state)``: the forward's output, and ``State(state.params,
        buffers after the forward)``.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, or ``state`` is not a
            ``State`` of dicts of tensors (the message names the bad entry).
        KeyError: ``state`` names a tensor the module does not have.
        ValueError: two tied names are given different tensors.

    >>> import freplicate as fr
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <...>
    >>> bn = nn.BatchNorm1d(2)
    >>> s = fr.state(bn)
    >>> out, s2 = fr.apply(bn, s, torch.randn(4, 2))
    >>> int(s2.buffers["num_batches_tracked"]), int(s.buffers["num_batches_tracked"])
    (1, 0)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fr.apply: module must be an nn.Module, got {type(module).__name__}")
    check_state("fr.apply", state, entries=False)
    if is_compiling():
        return _traced(module, state, args, kwargs)
    b, dicts = _binder(module)
    params: dict[str, Any] = state[0]
    buffers: dict[str, Any] = state[1]
    # every parameter under its first name (what fr.state gives): one pass decides
    complete = params.keys() == b.param_names
    if not complete or buffers:
        canon_p = params if complete else _canonical(params, b, "params")
        canon_b = _canonical(buffers, b, "buffers")
        if canon_p is None or canon_b is None:
            # a name the cached structure lacks, perhaps in a module it does not watch
            b = _BINDERS[module] = _Binder(module)
            dicts = b.originals()  # type: ignore[assignment]
            canon_p = params if complete else _canonical(params, b, "params")
            canon_b = _canonical(buffers, b, "buffers")
            if canon_p is None:
                raise _unknown(params, b, "params")
            if canon_b is None:
                raise _unknown(buffers, b, "buffers")
        params, buffers = canon_p, canon_b
        complete = params.keys() >= b.param_names
    skel = b.skeleton()
    bound = False
    try:
        # each copy gets a new attribute dict: its original's, with its own tensor dicts
        # (``original | own``, a C-level clone): train()/eval() and any attribute change are
        # seen, and an attribute a forward sets on the copy is forgotten. Children: the
        # original's (tensorless ones as they are now), with the copies in place of the
        # copied ones.
        fresh = list(map(operator.or_, dicts, skel.own))
        if b.with_children:
            at = dicts.__getitem__
            merged = map(operator.or_, map(_MODULES, map(at, b.with_children)), map(skel.kids.__getitem__, b.with_children))
            deque(map(operator.setitem, map(fresh.__getitem__, b.with_children), repeat("_modules"), merged), 0)
        deque(map(_SET_ATTR, skel.copies, repeat("__dict__"), fresh), 0)
        del fresh
        bound = True
        pdicts = skel.pdicts
        if complete:  # every parameter given: bind at C speed
            targets = map(pdicts.__getitem__, b.param_at)
            values = map(params.__getitem__, b.param_canon)
            deque(map(operator.setitem, targets, b.param_keys, values), 0)
        else:
            pget, bget = params.get, buffers.get
            for at_, key, canon in b.param_slots:
                v = pget(canon, _MISSING)
                if v is _MISSING:
                    v = bget(canon, _MISSING)
                    if v is _MISSING:
                        v = dicts[at_]["_parameters"][key]
                pdicts[at_][key] = v
        new_buffers: dict[str, torch.Tensor] = {}
        if b.buffer_slots:
            bget, pget = buffers.get, params.get
            for at_, key, canon in b.buffer_slots:
                v = new_buffers.get(canon)
                if v is None:
                    v = bget(canon, _MISSING)
                    if v is _MISSING:
                        v = pget(canon, _MISSING)
                        if v is _MISSING:
                            v = dicts[at_]["_buffers"][key]
                    if not isinstance(v, torch.Tensor):
                        check_state("fr.apply", state)
                    v = new_buffers[canon] = v.clone()
                skel.bdicts[at_][key] = v
        try:
            out = skel.call(*args, **kwargs)
        except Exception:
            check_state("fr.apply", state)  # a non-tensor in the state: say so, not torch
            raise
        if b.buffer_slots:  # a forward may rebind a buffer (``self.buf = new``)
            new_buffers = {canon: skel.bdicts[at_][key] for at_, key, canon in b.buffer_slots}
    finally:
        del dicts
        if bound and skel.counts() == skel.at_bound:
            _unbind(b, skel)
            b.release(skel)
        # else: something outside (a checkpoint's recomputation, a forward that kept
        # ``self``) still holds a copy: the skeleton stays bound to this call's tensors
        # until that is gone, and is never reused.
    ordered = {k: new_buffers[k] for k in buffers if k in new_buffers}
    for k in b.buffer_names:
        ordered.setdefault(k, new_buffers[k])
    return out, State(state[0], ordered)


def _unbind(b: _Binder, skel: _Skeleton) -> None:
    """Back to rest: no caller tensor, no attribute of the originals kept alive."""
    deque(map(_SET_ATTR, skel.copies, repeat("__dict__"), skel.own), 0)
    deque(map(dict.update, skel.pdicts, map(_FIRST, skel.blank)), 0)
    if b.buffer_slots:
        deque(map(dict.update, skel.bdicts, map(_SECOND, skel.blank)), 0)


def _traced(module: nn.Module, state: State, args: Any, kwargs: Any) -> tuple[Any, State]:
    """The binding while Dynamo traces: ``functional_call``, which it compiles without a break."""
    params, buffers = state
    named = dict(module.named_buffers())
    new_buffers = {k: v.clone() for k, v in buffers.items()}
    for k, v in named.items():
        if k not in new_buffers and k not in params:
            new_buffers[k] = v.clone()
    out = torch.func.functional_call(module, {**params, **new_buffers}, args, kwargs)
    return out, State(params, new_buffers)
