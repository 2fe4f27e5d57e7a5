"""ZeRO-3's units: which parameters each submodule gathers, planned once per module.

A unit is a submodule whose forward ``apply_sharded`` wraps: its full
parameters are all-gathered just before that forward and released after it;
the parameters of no unit are gathered for the whole call. ``materialize``
reads a ``units=`` argument the same way.

The default follows the model: a container of repeated blocks (an
``nn.ModuleList``, ``nn.Sequential`` or ``nn.ModuleDict`` of two or more
members of one class, each holding parameters and submodules: Hugging
Face's and torchtitan's decoder layers) gives one unit per block, wherever
it sits; the modules beside it
that hold parameters (an embedding, a final norm, an output head) are
units of their own, found the same way, so that only the parameters a
module holds directly on the way down to the blocks are outside every
unit. A parameter reachable from two units (tied by assignment, or held by
a module both reach) is outside every unit: gathered once for the call.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from torch import nn

from .. import _apply
from .._caches import register
from .._torch import is_compiling
from .._tree import describe
from ._wire import order_of

__all__ = ["Units", "unit_names", "units_of"]

_CALLER = "fr.distributed.apply_sharded"


class Units(NamedTuple):
    """A module cut into units: the parameters each gathers, and where they sit."""

    names: tuple[str, ...]  # the units, in named_modules() order
    gathers: dict[str, tuple[str, ...]]  # per unit: the canonical names it binds
    outside: tuple[str, ...]  # parameters of no unit: gathered for the whole call
    full: dict[str, tuple[tuple[int, ...], Any]]  # per name: its full shape and memory order


_UNITS: weakref.WeakKeyDictionary[nn.Module, dict[Any, Units]] = weakref.WeakKeyDictionary()
register(_UNITS.clear)
#: the model structures already warned about (a unit holding most of the parameters)
_WARNED: set[Any] = set()
register(_WARNED.clear)
#: a default unit holding more than this share of the parameters is warned about
LOPSIDED = 0.5


def units_of(module: nn.Module, units: Sequence[str] | None, caller: str = _CALLER) -> Units:
    """``module``'s units (default: one per repeated block, see the module), cached per module.

    With the default units, a unit holding most of the parameters is warned
    about, once per model structure.

    Raises:
        TypeError: ``units`` is not a list of names.
        ValueError: a name is not a submodule's.
    """
    if is_compiling():  # planned afresh once per trace: a guard on the cache's weak keys would
        return _cut(module, unit_names(module, units, caller))  # fail once a key dies (gc)
    key = None if units is None else tuple(units)
    cached = _UNITS.setdefault(module, {})
    found = cached.get(key)
    if found is None:
        found = cached[key] = _cut(module, unit_names(module, units, caller))
        if units is None:
            _warn_lopsided(module, found, caller)
    return found


def unit_names(module: nn.Module, units: Any, caller: str, *, run: bool = True) -> tuple[str, ...]:
    """The units' names, checked (``materialize`` reads ``units`` the same way).

    ``run``: the units must run a forward of their own (``apply_sharded``
    gathers around it), which a container does not.

    >>> blocks = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2)))
    >>> net = nn.Sequential(nn.Embedding(9, 4), blocks, nn.Linear(4, 9))
    >>> unit_names(net, None, "f")  # a unit per block; the modules beside them, units too
    ('0', '1.0', '1.1', '2')
    """
    names = [n for n, _ in module.named_modules()]
    if units is None:
        return tuple(_default_units(module, ""))
    if isinstance(units, str) or not all(isinstance(u, str) for u in units):
        raise TypeError(
            f"{caller}: units must be a list of submodules' qualified names (as named_modules() "
            f"gives them), got {describe(units)}"
        )
    unknown = [u for u in units if u not in names]
    if unknown:
        raise ValueError(
            f"{caller}: units {unknown} are not submodules of the module (named_modules() names "
            f"them {names[:8]}{' ...' if len(names) > 8 else ''})"
        )
    modules = dict(module.named_modules())
    containers = [u for u in units if _container(modules[u])]
    if containers and run:
        raise ValueError(
            f"{caller}: units {containers} are containers without a forward of their own "
            "(ModuleList, ModuleDict), which never run: name their members instead"
        )
    return tuple(n for n in names if n in set(units))


def _container(m: nn.Module) -> bool:
    """A module whose forward is ``nn.Module``'s own: it never runs (ModuleList, ModuleDict)."""
    return type(m).forward is nn.Module.forward


def _holds(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def _repeated(m: nn.Module) -> bool:
    """A container of repeated blocks: two or more members, all of one class, each holding
    parameters and submodules (decoder layers; not ``nn.Sequential(Linear, ReLU, Linear)``)."""
    if not isinstance(m, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
        return False
    members = list(m.children())
    return (
        len(members) >= 2
        and len({type(c) for c in members}) == 1
        and all(_holds(c) and any(True for _ in c.children()) for c in members)
    )


def _default_units(module: nn.Module, prefix: str, seen: set[int] | None = None) -> Iterator[str]:
    """Each direct child holding parameters; in place of a container (one without a forward,
    or of repeated blocks) its members, and in place of a module with repeated blocks
    somewhere inside, its children found the same way; a block is a unit whatever repeats
    inside it (the experts of a layer). A module reached twice counts under its first name
    (``named_modules()``'s)."""
    seen = {id(module)} if seen is None else seen
    blocks = _repeated(module)  # its members are units, whatever repeats inside them
    for name, child in module.named_children():
        if id(child) in seen or not _holds(child):
            continue
        seen.add(id(child))
        qualified = f"{prefix}{name}"
        if _container(child) or (not blocks and any(map(_repeated, child.modules()))):
            yield from _default_units(child, qualified + ".", seen)
        else:
            yield qualified


def _cut(module: nn.Module, names: tuple[str, ...]) -> Units:
    """Each parameter to the innermost unit holding it, when every path reaches it through that
    unit entered by one path; any other parameter outside every unit.

    A parameter reached from two units, tied across them (an embedding and
    the output head) or held by a module both reach (one ``nn.Linear`` in
    two blocks), or of a unit reached under two names (one block twice in a
    list, which runs twice), is gathered once for the whole call, as one
    outside every unit: its gradients from every place it is used then add
    up before its one reduce-scatter, as DDP adds them before its
    all-reduce (bit for bit).
    """
    layout = _apply._Layout(_apply._modules(module))
    index = {prefix[:-1]: i for i, prefix in enumerate(layout.prefixes)}
    unit_at = {index[u]: u for u in names}
    # per parameter: each (unit, the path it was entered by) it is reached through
    where: dict[str, set[tuple[str, str] | None]] = {}
    root = (unit_at[0], "") if 0 in unit_at else None
    stack: list[tuple[int, str, tuple[int, ...], tuple[str, str] | None]] = [(0, "", (0,), root)]
    while stack:  # every path from the root that repeats no module, as _Layout walks them
        i, prefix, path, entered = stack.pop()
        for name in layout.held[i].values():
            if name in layout.param_names:
                where.setdefault(name, set()).add(entered)
        for key, j in layout.children[i]:
            if j not in path:
                here = f"{prefix}{key}"
                inner = (unit_at[j], here) if j in unit_at else entered
                stack.append((j, here + ".", (*path, j), inner))
    gathers: dict[str, list[str]] = {u: [] for u in names}
    outside: list[str] = []
    own = dict(module.named_parameters())
    for name in own:
        (entered,) = where[name] if len(where[name]) == 1 else (None,)
        (outside if entered is None else gathers[entered[0]]).append(name)
    full = {n: (tuple(p.shape), order_of(p)) for n, p in own.items()}
    return Units(names, {u: tuple(v) for u, v in gathers.items()}, tuple(outside), full)


def _divisible(m: nn.Module) -> bool:
    """Whether ``m``'s parameters lie in two or more submodules, which could be units apart."""
    while True:
        holders = [c for c in m.children() if _holds(c)]
        if len(holders) != 1:
            return len(holders) >= 2
        m = holders[0]


def _warn_lopsided(module: nn.Module, plan: Units, caller: str) -> None:
    """A ``UserWarning`` when one default unit holds most of the parameters and has submodules
    that hold parameters, which could be units of their own (once per model structure)."""
    sizes = {n: math.prod(shape) for n, (shape, _) in plan.full.items()}
    total = sum(sizes.values())
    held = {u: sum(sizes[n] for n in names) for u, names in plan.gathers.items()}
    unit = max(held, key=held.__getitem__, default=None)
    if unit is None or not total or held[unit] <= LOPSIDED * total:
        return
    if not _divisible(module.get_submodule(unit)):
        return  # one layer (a Linear) holding most: no smaller unit to name
    structure = (type(module), tuple((n, shape) for n, (shape, _) in plan.full.items()))
    if structure in _WARNED:
        return
    _WARNED.add(structure)
    warnings.warn(
        f"{caller}: the default unit {unit or '(the whole module)'!r} holds "
        f"{held[unit] / total:.0%} of the parameters ({held[unit]:,} of {total:,}), all gathered "
        "at once, so sharding saves little memory there: pass units= the qualified names of "
        "smaller submodules that run a forward of their own (as named_modules() names them, "
        "such as a ModuleList's blocks, [f'layers.{i}' for i in range(n)])",
        UserWarning,
        stacklevel=4,
    )
