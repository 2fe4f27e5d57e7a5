"""``apply(module, state, ...)``: run a module's forward with a state bound.

``apply`` computes what ``torch.func.functional_call`` computes, under one
contract eager and while ``torch.compile`` traces (the table in
docs/apply.md): a state's names are read against the module's *layout*
(where each tensor sits, and every name it is reachable under) by one
function, ``_resolve``, and only the binding differs.

- **Eager: fresh copies per call.** A call binds its tensors into new shallow
  copies of the submodules that hold a tensor somewhere below them (the seed
  ``replicate``'s per-device copies): each copy has ``_parameters`` /
  ``_buffers`` / ``_modules`` dicts of its own and the original's other
  attributes as they are at the call (``training``, hooks). Nothing of the
  caller's module is written, so threads never see each other's tensors and
  replicas run truly in parallel; whatever keeps a copy alive (a checkpoint
  that recomputes the forward during backward) keeps that call's tensors with
  it. What the copies are made from, a ``_Plan``, is cached per module, holds
  the modules only weakly, and is checked on every call against the modules
  themselves: any change of structure rebuilds it.
- **Traced: ``functional_call``.** While Dynamo traces, the binding is
  ``torch.func.functional_call`` (which Dynamo compiles without a break), given
  one name per place a tensor sits, so that a shared submodule is rebound once
  and restored once.
"""

from __future__ import annotations

import operator
import types
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from . import _caches, _torch, _tree
from ._checks import check_state
from ._state import State

__all__ = ["Around", "apply", "bound_call", "check_bindable"]

_CALLER = "fr.apply"
_OWN = ("_parameters", "_buffers", "_modules")
# where a tensor sits: (index of its module, key in that module's dict, canonical name)
_Slot = tuple[int, str, str]


def _name(prefix: str) -> str:
    return f"module.{prefix}" if prefix else "module"


def _modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``list(module.named_modules())``: each module once, under its first name, in that order.

    Walked here so that a TorchScript module is refused before anything
    reads its children (a traced one's attributes are off limits to Dynamo).
    """
    named: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    stack = [("", module)]
    while stack:
        prefix, m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if isinstance(m, torch.jit.ScriptModule):
            raise TypeError(
                f"{_CALLER}: {_name(prefix)} is a TorchScript module (torch.jit.script or "
                "torch.jit.trace), whose tensors cannot be rebound from Python; pass the "
                "nn.Module it was made from (script or trace the step afterwards if you like)"
            )
        named.append((prefix, m))
        children = [
            (f"{prefix}.{k}" if prefix else k, c) for k, c in m._modules.items() if c is not None
        ]
        stack.extend(reversed(children))
    return named


class _Layout:
    """Where each tensor of a module sits, and every name it is reachable under.

    Built by one walk that visits each module once (a module graph with a
    cycle, ``m.child.parent = m``, is walked as ``named_modules()`` walks it).
    A tensor's *canonical* name is its first, as ``fr.state`` gives it;
    ``alias`` maps every name ``named_parameters(remove_duplicate=False)``
    would give (tied weights, shared submodules, each path once) to it, and
    ``canonical`` any other path that reaches it (through a cycle). Holds
    names and positions only, never a module: ``named`` is ``_modules(module)``,
    whose positions the slots refer to.
    """

    def __init__(self, named: list[tuple[str, nn.Module]]) -> None:
        modules = [m for _, m in named]
        self.prefixes = [f"{p}." if p else "" for p, _ in named]
        index = {id(m): i for i, m in enumerate(modules)}
        self.children = [
            [(key, index[id(c)]) for key, c in m._modules.items() if c is not None] for m in modules
        ]
        canonical: dict[int, str] = {}
        self.param_slots = self._slots(modules, "_parameters", canonical)
        self.buffer_slots = self._slots(modules, "_buffers", canonical)
        self.param_names = frozenset(name for _, _, name in self.param_slots)
        self.buffer_names = list(dict.fromkeys(name for _, _, name in self.buffer_slots))
        # per module: the key and canonical name of each tensor it holds, and the keys it holds
        # as None (``nn.Linear(bias=False)``'s bias)
        self.held: list[dict[str, str]] = [{} for _ in modules]
        for i, key, name in (*self.param_slots, *self.buffer_slots):
            self.held[i][key] = name
        self.empty = [
            {k for k, t in (*m._parameters.items(), *m._buffers.items()) if t is None}
            for m in modules
        ]
        self.alias = self._every_name()

    def _slots(self, modules: list[nn.Module], kind: str, canonical: dict[int, str]) -> list[_Slot]:
        slots = []
        for i, m in enumerate(modules):
            for key, t in getattr(m, kind).items():
                if t is not None:
                    slots.append((i, key, canonical.setdefault(id(t), self.prefixes[i] + key)))
        return slots

    def _every_name(self) -> dict[str, str]:
        """Every name of every tensor: one per path from the root that repeats no module."""
        alias: dict[str, str] = {}
        stack: list[tuple[int, str, tuple[int, ...]]] = [(0, "", (0,))]
        while stack:
            i, prefix, path = stack.pop()
            for key, name in self.held[i].items():
                alias[prefix + key] = name
            for key, j in self.children[i]:
                if j not in path:
                    stack.append((j, f"{prefix}{key}.", (*path, j)))
        return alias

    def _slot(self, name: str) -> tuple[int, str] | None:
        """``(module index, key)`` that the path ``name`` reaches, walked as ``functional_call`` walks it."""
        *path, key = name.split(".")
        i = 0
        for part in path:
            child = next((j for k, j in self.children[i] if k == part), None)
            if child is None:
                return None
            i = child
        return i, key

    def canonical(self, name: str) -> str | None:
        """The canonical name of the tensor ``name`` reaches, or ``None`` if it reaches none.

        Beyond ``alias``, a path through a cycle (``child.parent.head.weight``
        in a module whose child refers back to it) reaches the tensor at its
        end, as in ``functional_call``.
        """
        found = self.alias.get(name)
        if found is None and "." in name:
            slot = self._slot(name)
            if slot is not None:
                found = self.held[slot[0]].get(slot[1])
        return found

    def unknown(self, what: str, names: list[str]) -> KeyError:
        """The error for names in ``state.<what>`` that reach no tensor of the module."""
        slot = self._slot(names[0])
        if slot is not None and slot[1] in self.empty[slot[0]]:
            return KeyError(
                f"{_CALLER}: state.{what} has {names[0]!r}, which the module holds as None (as "
                "nn.Linear(bias=False) holds its bias), so no tensor of its can be bound there; "
                "leave the name out"
            )
        return KeyError(
            f"{_CALLER}: state.{what} has {names[0]!r}, which the module does not have"
            + (f" (nor {names[1:]!r})" if len(names) > 1 else "")
        )


def _resolve(
    layout: _Layout, params: Mapping[str, Any], buffers: Mapping[str, Any]
) -> dict[str, Any]:
    """The state's tensors under their canonical names, ``params`` and ``buffers`` together.

    The one reading of a state's names, for both bindings: a name in both
    dicts is a ``ValueError``, a name the module lacks a ``KeyError`` (all of
    them named), two different tensors for tied names a ``ValueError``
    naming both names.
    """
    both = [k for k in params if k in buffers]
    if both:
        raise ValueError(
            f"{_CALLER}: {both[0]!r} is in both state.params and state.buffers"
            + (f" (and {both[1:]!r})" if len(both) > 1 else "")
            + "; give each name once"
        )
    names: dict[str, str] = {}  # given name -> canonical name
    for what, given in (("params", params), ("buffers", buffers)):
        unknown = []
        for k in given:
            name = layout.canonical(k)
            if name is None:
                unknown.append(k)
            else:
                names[k] = name
        if unknown:
            raise layout.unknown(what, unknown)
    values: dict[str, Any] = {}
    given_as: dict[str, tuple[str, str]] = {}  # canonical name -> (dict, name) that gave it
    for what, given in (("params", params), ("buffers", buffers)):
        for k, v in given.items():
            name = names[k]
            if name in values and values[name] is not v:
                first_what, first = given_as[name]
                where = (
                    f"state.{what} gives"
                    if first_what == what
                    else f"state.{first_what} and state.{what} give"
                )
                raise ValueError(
                    f"{_CALLER}: {where} different tensors for the tied names {first!r} and {k!r}"
                )
            values[name] = v
            given_as.setdefault(name, (what, k))
    return values


def _returned_buffers(
    layout: _Layout, buffers: Mapping[str, Any], new: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The new buffers: those given first, in the given order (canonical names), then the rest."""
    if not new:
        return new
    ordered = {}
    for k in buffers:
        name = layout.canonical(k)
        if name in new:
            ordered[name] = new[name]
    for name in layout.buffer_names:
        ordered.setdefault(name, new[name])
    return ordered


# --- the eager binding


class _Plan:
    """How to copy one module for a call: its layout, and what each copy is made of.

    Holds the modules only weakly (a hook that refers to its own module must
    not keep it alive through this cache), and snapshots of the copied
    modules' tensor dicts, their attribute counts and their copied children,
    which every call compares with the modules as they are.
    """

    def __init__(self, module: nn.Module) -> None:
        named = _modules(module)
        layout = self.layout = _Layout(named)
        mods = [m for _, m in named]
        # Only modules with a tensor somewhere below them need a copy of their own; the rest
        # (activations, dropout, ...) hold nothing to bind, and run as themselves.
        needs = [bool(m._parameters or m._buffers) for m in mods]
        grew = True
        while grew:  # up from every holder to the root (any order: shared submodules, cycles)
            grew = False
            for i, kids in enumerate(layout.children):
                if not needs[i] and any(needs[j] for _, j in kids):
                    needs[i] = grew = True
        needs[0] = True  # the root is always copied: the call goes through it
        copied = [i for i, need in enumerate(needs) if need]
        at = {i: k for k, i in enumerate(copied)}
        originals = [mods[i] for i in copied]
        self.refs = [weakref.ref(m) for m in originals]
        self.classes = [type(m) for m in originals]
        # every copy made as ``object.__new__`` makes it (no class of them has a ``__new__``)
        self.plain_new = all(cls.__new__ is object.__new__ for cls in self.classes)
        self.param_names = layout.param_names
        self.buffer_names = frozenset(layout.buffer_names) - layout.param_names
        self.param_slots = [(at[i], key, name) for i, key, name in layout.param_slots]
        self.buffer_slots = [(at[i], key, name) for i, key, name in layout.buffer_slots]
        self.kids = [[(key, at[j]) for key, j in layout.children[i] if needs[j]] for i in copied]
        self.parents = {child: (k, key) for k, kids in enumerate(self.kids) for key, child in kids}
        self.kid_checks = [
            (k, [key for key, _ in kids], [j for _, j in kids])
            for k, kids in enumerate(self.kids)
            if kids
        ]
        # the structure every call checks
        self.sizes = [len(m.__dict__) for m in originals]
        self.param_dicts = [dict(m._parameters) for m in originals]
        self.buffer_dicts: list[dict[str, Any]] = [dict(m._buffers) for m in originals]
        self.has_buffers = any(self.buffer_dicts)
        # a one-element tensor compares equal to another of the same value: such dicts are
        # compared by identity too
        self.exact = [
            k
            for k, m in enumerate(originals)
            if any(
                t is not None and t.numel() == 1
                for t in (*m._parameters.values(), *m._buffers.values())
            )
        ]
        self.where = [_name(layout.prefixes[i][:-1]) for i in copied]
        self.special = [
            []
            if _torch.compiled_module(m) is not None  # made afresh for each call
            else [
                key for key, v in m.__dict__.items() if _attribute_kind(where, key, v, m.__dict__)
            ]
            for m, where in zip(originals, self.where)
        ]
        self.rebinds = [k for k, keys in enumerate(self.special) if keys]
        self.compiled: list[tuple[int, int, Callable[[nn.Module], nn.Module]]] = []
        for k, m in enumerate(originals):
            found = _torch.compiled_module(m)
            if found is not None:
                inner, wrap = found
                self.compiled.append((k, copied.index(mods.index(inner)), wrap))

    def originals(self) -> list[dict[str, Any]] | None:
        """The copied modules' attribute dicts now, or ``None`` if the structure changed."""
        # maps of C functions, not comprehensions: every call runs this, and each comprehension
        # is a Python call of its own
        mods = [ref() for ref in self.refs]  # (a map of methodcaller("__call__") is slower)
        if None in mods:
            return None
        dicts = list(map(_DICT_OF, mods))
        try:
            if (
                list(map(len, dicts)) != self.sizes
                or list(map(_PARAMETERS, dicts)) != self.param_dicts
                or (self.has_buffers and list(map(_BUFFERS, dicts)) != self.buffer_dicts)
            ):
                return None
        except RuntimeError:  # a tensor replaced, compared by value (ambiguous): changed
            return None
        for k in self.exact:
            d = dicts[k]
            for now, then in (
                (d["_parameters"], self.param_dicts[k]),
                (d["_buffers"], self.buffer_dicts[k]),
            ):
                if any(a is not b for a, b in zip(now.values(), then.values())):
                    return None
        for k, keys, positions in self.kid_checks:
            children = dicts[k]["_modules"]
            if list(map(children.get, keys)) != list(map(mods.__getitem__, positions)):
                return None
        return dicts


def _attribute_kind(where: str, key: str, value: Any, owner: dict[str, Any]) -> str | None:
    """How a copy takes its original's instance attribute ``key``: as it is (``None``), or not.

    ``owner`` is the original's attribute dict. A method bound to the original
    itself (``m.forward = m.other``) is bound to the copy instead
    (``"method"``); ``module.compile()``'s compiled ``_call_impl`` is dropped,
    so that the copy runs uncompiled as a deep copy of the module does
    (``"compiled"``). Any other wrapper of the original's own method, and an
    instance-level ``forward`` of any other kind (a closure, a partial: it may
    compute with the original's own tensors), is refused.
    """
    if isinstance(value, types.MethodType) and getattr(value.__self__, "__dict__", None) is owner:
        return "method"
    if key == _torch.COMPILED_CALL:
        return None if value is None else "compiled"
    wrapped = getattr(value, "__wrapped__", None)
    if key == "forward" or (
        isinstance(wrapped, types.MethodType)
        and getattr(wrapped.__self__, "__dict__", None) is owner
    ):
        raise TypeError(
            f"{_CALLER}: {where}.{key} is set on the module object ({type(value).__name__}) and "
            "may compute with the module's own tensors, which fr.apply cannot rebind; define it "
            "as a method of the class (to compile, torch.compile the function that calls fr.apply)"
        )
    return None


_DICT_OF = operator.attrgetter("__dict__")
_PARAMETERS = operator.itemgetter("_parameters")
_BUFFERS = operator.itemgetter("_buffers")
_COPY = operator.methodcaller("copy")

_PLANS: weakref.WeakKeyDictionary[nn.Module, _Plan] = weakref.WeakKeyDictionary()
_caches.register(_PLANS.clear)


def _plan(module: nn.Module, *, fresh: bool = False) -> tuple[_Plan, list[dict[str, Any]]]:
    """The module's plan, checked against the module as it is now (rebuilt if it changed)."""
    plan = None if fresh else _PLANS.get(module)
    if plan is not None:
        dicts = plan.originals()
        if dicts is not None:
            return plan, dicts
    plan = _PLANS[module] = _Plan(module)
    dicts = plan.originals()
    assert dicts is not None
    return plan, dicts


def _bind(
    plan: _Plan,
    dicts: list[dict[str, Any]],
    values: Mapping[str, Any],
    buffer_values: Mapping[str, Any],
) -> tuple[list[nn.Module], list[dict[str, Any]]]:
    """New copies of the plan's modules with the state bound (the call's first), and their buffers.

    ``values`` and ``buffer_values`` map canonical names to the parameters'
    and the buffers' tensors (one dict for both, once resolved), or to
    ``None``, bound as it is; a name they lack keeps the module's own tensor
    (a buffer: a clone of it, as every buffer is cloned).
    """
    if plan.plain_new:  # (a map of a C function: no Python call a module)
        copies = list(map(object.__new__, plan.classes))
    else:
        copies = [cls.__new__(cls) for cls in plan.classes]
    params = list(map(_COPY, plan.param_dicts))  # the originals' as they are (just checked)
    for k, key, name in plan.param_slots:
        if name in values:
            params[k][key] = values[name]
    buffers = list(map(_COPY, plan.buffer_dicts))
    clones: dict[str, torch.Tensor | None] = {}
    for k, key, name in plan.buffer_slots:
        if name not in clones:
            value = buffer_values[name] if name in buffer_values else buffers[k][key]
            clones[name] = None if value is None else value.clone()
        buffers[k][key] = clones[name]
    for copy, d, p, b, kids in zip(copies, dicts, params, buffers, plan.kids):
        children = d["_modules"].copy()
        for key, j in kids:
            children[key] = copies[j]
        fresh = d.copy()
        fresh["_parameters"] = p
        fresh["_buffers"] = b
        fresh["_modules"] = children
        object.__setattr__(copy, "__dict__", fresh)
    for k in plan.rebinds:
        copy_dict = copies[k].__dict__
        for key in plan.special[k]:
            value = copy_dict[key]
            kind = _attribute_kind(plan.where[k], key, value, dicts[k])
            if kind == "method":
                copy_dict[key] = types.MethodType(value.__func__, copies[k])
            elif kind == "compiled":
                copy_dict[key] = None
    for k, inner, wrap in plan.compiled:
        wrapper = copies[k] = wrap(copies[inner])
        if k in plan.parents:
            parent, key = plan.parents[k]
            copies[parent].__dict__["_modules"][key] = wrapper
    return copies, buffers


def apply(module: nn.Module, state: State, /, *args: Any, **kwargs: Any) -> tuple[Any, State]:
    """Run ``module``'s forward with ``state`` bound; return ``(output, new_state)``.

    Computes what ``torch.func.functional_call(module, {**params,
    **buffers}, args, kwargs)`` computes, but safe to call from several
    threads at once on one module, and nothing is modified: buffers are
    cloned before the forward, and their values after it (updated in place,
    as BatchNorm's statistics, or reassigned, ``self.avg = ...``) come back
    in ``new_state.buffers``; ``new_state.params`` is ``state.params``.
    Names missing from ``state`` fall back to the module's own tensors; a
    ``None`` in it is bound as it is (a Linear given ``bias=None`` computes
    without its bias), and a module the forward returns (``return self``)
    comes back as the module itself, both as in ``functional_call``. The
    same holds, with the same errors, while ``torch.compile`` traces the
    call (it traces as ``functional_call``, without a graph break): the
    contract, mode by mode, is the table in docs/apply.md.

    The binding lasts as long as the call's autograd graph can replay the
    forward (activation checkpointing recomputes with the state's tensors,
    not the module's). A ``torch.compile``-d module (or submodule) runs its
    compiled code with the state bound; one compiled in place
    (``module.compile()``) runs uncompiled, as its deep copy does.

    Args:
        module: the module whose forward runs; never modified.
        state: an ``fr.State(params, buffers)``: dicts of tensors (or
            ``None``) keyed by qualified name (tied names may be given under
            any of their names, a name through a cycle of modules too; which of
            the two dicts holds a name does not matter).
        *args: positional arguments of the forward.
        **kwargs: keyword arguments of the forward.

    Returns:
        ``(output, new_state)``: the forward's output, and ``State(state.params,
        buffers after the forward)``: the given buffers first, in their order
        and under their first names, then the module's others.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, holds a TorchScript
            module, or sets ``forward`` (or a wrapper of its own method) on
            the module object; ``state`` is not a ``State`` of dicts of tensors
            (the message names the bad entry).
        KeyError: ``state`` names a tensor the module does not have (or
            holds as ``None``, as ``nn.Linear(bias=False)`` its bias).
        ValueError: a name is in both ``state.params`` and ``state.buffers``,
            or two tied names are given different tensors.

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
        raise TypeError(f"{_CALLER}: module must be an nn.Module, got {type(module).__name__}")
    # for speed: check_state's isinstance(..., Mapping) only where the types are not exact
    # (docs/benchmarks.md, issue 19)
    if type(state) is not State or type(state[0]) is not dict or type(state[1]) is not dict:
        check_state(_CALLER, state, entries=False)
    if _torch.is_compiling():
        return _traced(module, state[0], state[1], args, kwargs)
    return bound_call(module, state, args, kwargs)


#: what ``bound_call`` hands a caller that wraps units of the call: each copy's module name
#: (``module.<qualified name>``), the copies, and where each parameter sits ``(copy, key, name)``
Around = Callable[[list[str], list[nn.Module], list[_Slot]], None]


def bound_call(
    module: nn.Module, state: State, args: Any, kwargs: Any, around: Around | None = None
) -> tuple[Any, State]:
    """``apply``'s eager call; ``around`` may rebind or wrap the call's own copies before it runs.

    The copies are this call's alone (nothing of ``module`` is touched):
    ``fr.distributed.apply_sharded`` wraps its units' ``forward`` there.
    """
    params, buffers = state
    plan, dicts = _plan(module)
    # for speed: the names fr.state gives need no resolving (docs/benchmarks.md, issue 19)
    if params.keys() == plan.param_names and buffers.keys() <= plan.buffer_names:
        values, buffer_values = params, buffers
    else:
        try:
            values = buffer_values = _resolve(plan.layout, params, buffers)
        except KeyError:
            # perhaps a name of a module the plan does not watch (a tensorless one that
            # gained a tensor): read the module afresh before saying so
            plan, dicts = _plan(module, fresh=True)
            values = buffer_values = _resolve(plan.layout, params, buffers)
    try:
        copies, buffer_dicts = _bind(plan, dicts, values, buffer_values)
        del dicts
        if around is not None:
            around(plan.where, copies, plan.param_slots)
        out = copies[0](*args, **kwargs)
    except Exception:
        check_bindable(_CALLER, state)  # a non-tensor in the state: say so, not torch
        raise
    if type(out) is not torch.Tensor:
        out = _as_functional_call_returns(out, copies, plan)
    # a forward may rebind a buffer (``self.avg = new``): read them where they are now
    new = {}
    for k, key, name in plan.buffer_slots:
        new[name] = buffer_dicts[k][key]
    return out, State(params, _returned_buffers(plan.layout, buffers, new) if new else new)


def _as_functional_call_returns(out: Any, copies: list[nn.Module], plan: _Plan) -> Any:
    """``out`` with the call's copies in it (``return self.block``) replaced by their originals.

    ``functional_call``, and so the traced binding, returns the module
    itself, which holds its own tensors again after the call.
    """
    leaves, spec = _tree.flatten_containers(out)
    if not any(isinstance(x, nn.Module) for x in leaves):
        return out
    originals = {id(c): ref() for c, ref in zip(copies, plan.refs)}
    return _tree.unflatten_containers(spec, [originals.get(id(x), x) for x in leaves], _CALLER)


def check_bindable(caller: str, state: Any) -> None:
    """``check_state`` for a state ``apply`` binds, whose entries may be ``None`` too.

    >>> check_bindable("fr.apply", fr.State({"bias": None}, {"n": 2.0}))
    Traceback (most recent call last):
    ...
    TypeError: fr.apply: state.buffers['n'] must be a tensor, got a float (2.0)
    """
    check_state(caller, state, entries=False)
    check_state(caller, tuple({k: v for k, v in d.items() if v is not None} for d in state))


# --- the traced binding


def _traced(
    module: nn.Module, params: dict[str, Any], buffers: dict[str, Any], args: Any, kwargs: Any
) -> tuple[Any, State]:
    """The binding while Dynamo traces: ``functional_call``, which it compiles without a break.

    The layout is read afresh (once per trace, not per run), the names
    resolved as eager, and ``functional_call`` given one name per place a
    tensor sits, with ``tie_weights=False``: its own untying names every path
    to a shared submodule, swaps it once per path and restores it once per
    path, and so leaves the module holding the state's tensors.
    """
    check_bindable(_CALLER, (params, buffers))
    named = _modules(module)
    layout = _Layout(named)
    values = _resolve(layout, params, buffers)
    bound: dict[str, Any] = {}
    for i, key, name in layout.param_slots:
        if name in values:
            bound[layout.prefixes[i] + key] = values[name]
    clones: dict[str, torch.Tensor | None] = {}
    for i, key, name in layout.buffer_slots:
        if name not in clones:
            value = values[name] if name in values else named[i][1]._buffers[key]
            clones[name] = None if value is None else value.clone()
        bound[layout.prefixes[i] + key] = clones[name]
    out = torch.func.functional_call(module, bound, args, kwargs, tie_weights=False)
    # functional_call writes a buffer the forward reassigned back into ``bound``
    new = {name: bound[layout.prefixes[i] + key] for i, key, name in layout.buffer_slots}
    return out, State(params, _returned_buffers(layout, buffers, new))
