"""ZeRO-3's units: which parameters each submodule gathers, planned once per module.

A unit is a submodule whose forward ``apply_sharded`` wraps: its full
parameters are all-gathered just before that forward and released after it;
the parameters of no unit are gathered for the whole call. ``materialize``
reads a ``units=`` argument the same way.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from torch import nn

from .. import _apply
from .._caches import register
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


def units_of(module: nn.Module, units: Sequence[str] | None, caller: str = _CALLER) -> Units:
    """``module``'s units (default: each direct child holding parameters), cached per module.

    Raises:
        TypeError: ``units`` is not a list of names.
        ValueError: a name is not a submodule's.
    """
    key = None if units is None else tuple(units)
    cached = _UNITS.setdefault(module, {})
    found = cached.get(key)
    if found is None:
        found = cached[key] = _cut(module, unit_names(module, units, caller))
    return found


def unit_names(module: nn.Module, units: Any, caller: str, *, run: bool = True) -> tuple[str, ...]:
    """The units' names, checked (``materialize`` reads ``units`` the same way).

    ``run``: the units must run a forward of their own (``apply_sharded``
    gathers around it), which a container does not.
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


def _default_units(module: nn.Module, prefix: str) -> Iterator[str]:
    """Each direct child holding parameters; a container's members in its place."""
    for name, child in module.named_children():
        if not any(True for _ in child.parameters()):
            continue
        qualified = f"{prefix}{name}"
        if _container(child):
            yield from _default_units(child, qualified + ".")
        else:
            yield qualified


def _cut(module: nn.Module, names: tuple[str, ...]) -> Units:
    """Each parameter to the innermost unit holding its module.

    A parameter tied across units (an embedding and the output head) is
    gathered once for the whole call, as one outside every unit: its
    gradients from both places then add up before its one reduce-scatter,
    as DDP adds them before its all-reduce (bit for bit).
    """
    layout = _apply._Layout(_apply._modules(module))
    where: dict[str, set[str | None]] = {}
    for i, _, name in layout.param_slots:
        at = layout.prefixes[i][:-1]
        inside = [u for u in names if u == "" or at == u or at.startswith(u + ".")]
        where.setdefault(name, set()).add(max(inside, key=len) if inside else None)
    gathers: dict[str, list[str]] = {u: [] for u in names}
    outside: list[str] = []
    for name, held in where.items():
        (gathers[next(iter(held))] if len(held) == 1 and None not in held else outside).append(name)  # type: ignore[index]
    own = dict(module.named_parameters())
    full = {n: (tuple(p.shape), order_of(p)) for n, p in own.items()}
    return Units(names, {u: tuple(v) for u, v in gathers.items()}, tuple(outside), full)
