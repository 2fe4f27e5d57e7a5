"""Starting from the meta device: each rank makes its shards of a module's tensors, unit by unit.

A model built under ``torch.device("meta")`` has shapes and no values.
``materialize`` runs the module's own initialisation again, on a copy of
one unit at a time (never the module itself), and keeps this rank's rows
of each parameter: a rank never holds more than the unit being made (and
the units nested in it) at full size. The draws are those of building the
model on the device: each module's ``reset_parameters`` (torch's
``_reset_parameters`` where a module has only that) after its submodules',
in module order, which is the order in which an ``__init__`` that builds
its submodules and then calls ``self.reset_parameters()`` draws; or, with
``seed=``, each module's under a generator of its own, seeded from the seed
and its name. ``init=`` adds a function run on each module after its reset
(a Hugging Face model's ``_init_weights``), under the same generator: the
way to make modules that have no reset of their own (``LlamaRMSNorm``) and
buffers made in ``__init__`` (the rotary ``inv_freq``).

What a reset must not do, it cannot do silently: a tensor it leaves unset
(NaN until set) raises, and a tensor of a module outside what is being made
is a stand-in that raises on any use, naming the tensor.
"""

from __future__ import annotations

import copy
import hashlib
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .._checks import check_int
from .._state import State
from .._tree import describe
from .._typing import DeviceSpec
from ._collectives import shard  # the split every fr.distributed function uses
from ._dcp import agree
from ._group import comm_device, groups_of, world_size
from ._units import unit_names

__all__ = ["materialize"]

_CALLER = "fr.distributed.materialize"


def materialize(
    module: nn.Module,
    *,
    group: Any = None,
    units: Sequence[str] | None = None,
    seed: int | None = None,
    device: DeviceSpec | None = None,
    init: Callable[[nn.Module], Any] | None = None,
) -> State:
    """This rank's shards of ``module``'s parameters, and its buffers whole, made by the module's own initialisation.

    Collective (one small exchange, to check that the ranks agree). For a
    module built on the ``meta`` device (``with torch.device("meta"):``):
    every rank runs each module's ``reset_parameters()`` on a copy of one
    unit at a time, on ``device``, and keeps its rows of every parameter
    (``fr.distributed.shard``'s) and every buffer whole: the ``State`` that
    ``fr.distributed.apply_sharded`` takes, and whose ``params`` are the
    shards a ZeRO-2 loop updates. No rank holds more full tensors than one
    unit's (and those of the units nested in it). ``module`` is never
    modified, nor are its tensors read: only their shapes and dtypes.

    The values: with ``seed=None``, the resets draw from ``device``'s
    global generator, each module's after its submodules', in module order:
    what building the model on ``device`` draws when each module's
    ``__init__`` builds its submodules and then calls
    ``self.reset_parameters()`` (every ``torch.nn`` module does). So
    ``torch.manual_seed(s); materialize(meta_model)`` equals
    ``torch.manual_seed(s); fr.distributed.shard(fr.state(build()))`` bit for
    bit, and leaves the generator where building it would. Every rank's
    generator must be alike (checked). With ``init=``, each module's reset is
    followed by ``init(module)``, drawing from the same generator: a Hugging
    Face model is made as its ``post_init`` makes it (each module's reset,
    then its ``_init_weights``) with ``init=model._init_weights``, and
    ``torch.manual_seed(s); materialize(meta_model, init=f)`` equals the
    model built on the CPU and then, after ``torch.manual_seed(s)``, every
    module's reset and ``f`` run in the same order (each module after its
    submodules). Not reproduced: draws an ``__init__``
    makes outside ``reset_parameters`` (a ``torch.randn`` in ``__init__``),
    modules that copy a submodule instead of building it
    (``nn.TransformerEncoder(layer, n)`` starts its ``n`` layers equal),
    initialisation done after construction (a loop over ``model.modules()``),
    and ties made after construction: a tensor held by several modules takes
    the values of the first that holds it, in ``named_modules()`` order (the
    others' resets draw into a copy thrown away). With ``seed=`` an int,
    each module's reset runs under a generator seeded from ``seed`` and the
    module's name, and the global generators are left alone: the result does
    not depend on the order of the modules, the units or the world size,
    and equals this function's on one process with the same seed.

    Args:
        module: the module (on the meta device, or any: its values are not read).
        group: the process group (default: the default group), or a 2-D
            ``DeviceMesh`` (replicate, shard) or pair of groups, as
            ``apply_sharded``'s: the rows of the shard group's ranks.
        units: qualified names of submodules (as ``named_modules()``; ``""``
            for the whole module) made one at a time, each with its
            submodules except those that are units themselves. A module in
            no unit is made alone. Default: ``apply_sharded``'s default
            units (one per repeated block and the modules beside the
            blocks). A reset that uses the tensors of its
            submodules (``nn.MultiheadAttention``'s, ``nn.Transformer``'s)
            must lie in the same unit as they.
        seed: ``None`` (draw from the global generator, in module order) or an
            int (each module's reset seeded from it and the module's name).
        device: where the tensors are made (default: the group's device: the
            CPU for gloo or without a group, the current CUDA device for NCCL).
        init: ``None``, or a function run on every module (a copy of it, its
            tensors on ``device``) after the module's reset, under no_grad and
            the same generator; what it sets wins. For modules without a
            ``reset_parameters`` (``LlamaRMSNorm``) and buffers made in
            ``__init__`` (a rotary embedding's ``inv_freq``): a Hugging Face
            model's own, ``init=model._init_weights``. To run it only where a
            module has no reset: ``init=lambda m: None if hasattr(m,
            "reset_parameters") else model._init_weights(m)``. Every rank
            must pass the same function (its name is checked).

    Returns:
        ``fr.State(params, buffers)`` keyed as ``fr.state(module)``: this
        rank's rows of each parameter (fresh tensors) and each buffer whole.

    Raises:
        TypeError: a bad ``module``, ``units``, ``seed``, ``device``, ``init`` or ``group``.
        ValueError: a unit that is not a submodule; a lazy parameter; a module
            holding an integer or bool tensor without a ``reset_parameters``;
            a reset (or ``init``) that leaves a floating-point tensor unset or
            uses a tensor of another unit (naming it: a buffer no reset makes,
            such as a rotary ``inv_freq``, by its qualified name); modules,
            units, seeds, ``init`` or generators that differ across ranks (on
            every rank).

    Examples:
        >>> with torch.device("meta"):
        ...     model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
        >>> _ = torch.manual_seed(0)
        >>> state = fr.distributed.materialize(model)  # no process group: every row
        >>> _ = torch.manual_seed(0)
        >>> built = fr.state(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)))
        >>> all(torch.equal(state.params[k], built.params[k]) for k in built.params)
        True
        >>> state.buffers["1.running_var"]
        tensor([1., 1., 1.])
    """
    group = groups_of(group, _CALLER).shard  # a mesh's shard dim: each replica makes its rows
    world = world_size(group, _CALLER)
    if world == 0:
        raise ValueError(f"{_CALLER}: this rank is not in group, so it holds no shards")
    failed = None
    try:  # a rank's mistake raises on every rank, none waits for the others
        plan = _Plan(module, units)
        if seed is not None:
            check_int(_CALLER, "seed", seed)
        if init is not None and not callable(init):
            raise TypeError(
                f"{_CALLER}: init must be a function of a module (such as a Hugging Face "
                f"model's _init_weights) or None, got {describe(init)}"
            )
        where = comm_device(group) if device is None else _device(device)
        generator = _generator(where) if seed is None else None
        how = (seed, None if init is None else getattr(init, "__qualname__", type(init).__name__))
        report: Any = ("ok", (plan.layout, sorted(plan.units), how, generator))
    except Exception as err:
        report, failed = (type(err).__name__, str(err)), err
    _check_alike(agree(report, group, world, failed))

    def rows(full: torch.Tensor) -> torch.Tensor:
        return full if world == 1 else shard(full, group=group).clone()

    return _make(plan, where, seed, rows, init)


# --- the plan: who holds what, which unit makes it --------------------------------------


class _Plan:
    """``module``'s modules in post-order, their units, and the first holder of each tensor."""

    def __init__(self, module: Any, units: Any) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"{_CALLER}: module must be an nn.Module, got {describe(module)}")
        names = dict(module.named_modules())
        self.units = _units(module, units, names)
        self.order = _post_order(module)
        self.roots = {u: names[u] for u in self.units}
        self.item = {id(m): _item_of(name, self.units) for name, m in self.order}
        _check_modules(self.order)
        self.params = {id(p): n for n, p in module.named_parameters()}
        self.buffers = {id(b): n for n, b in module.named_buffers()}
        self.claims: dict[int, tuple[int, str]] = {}
        for _, m in module.named_modules():
            for attr, t in _direct(m):
                self.claims.setdefault(id(t), (id(m), attr))
        self.layout = [
            (n, tuple(t.shape), str(t.dtype))
            for n, t in (*module.named_parameters(), *module.named_buffers())
        ]

    def name(self, t: torch.Tensor) -> str:
        return self.params.get(id(t)) or self.buffers[id(t)]


def _units(module: nn.Module, units: Any, names: dict[str, nn.Module]) -> set[str]:
    """The units, as ``apply_sharded`` reads them (one reading of ``units`` for both)."""
    return set(unit_names(module, units, _CALLER, run=False))


def _post_order(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module once, under its first name (as ``named_modules``), after its submodules."""
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(m: nn.Module, name: str) -> None:
        seen.add(id(m))
        for child_name, child in m.named_children():
            if id(child) not in seen:
                visit(child, f"{name}.{child_name}" if name else child_name)
        out.append((name, m))

    visit(module, "")
    return out


def _item_of(name: str, units: set[str]) -> str | None:
    """The innermost unit that holds the module ``name``, or ``None`` (made alone)."""
    inside = [u for u in units if u == "" or name == u or name.startswith(u + ".")]
    return max(inside, key=len) if inside else None


def _direct(m: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors ``m`` holds itself (not its submodules'), by attribute name."""
    for attr, t in (*m._parameters.items(), *m._buffers.items()):
        if t is not None:
            yield attr, t


def _held(m: nn.Module, attr: str) -> torch.Tensor:
    """The tensor ``m`` holds as ``attr`` (a parameter or a buffer)."""
    held = m._parameters[attr] if attr in m._parameters else m._buffers[attr]
    assert held is not None
    return held


def _reset_of(m: nn.Module) -> Any:
    for attr in ("reset_parameters", "_reset_parameters"):
        fn = getattr(m, attr, None)
        if callable(fn):
            return fn
    return None


def _check_modules(order: list[tuple[str, nn.Module]]) -> None:
    """Lazy parameters, and integer tensors no reset of their own makes: every one, at once."""
    bad = []
    for name, m in order:
        for attr, t in _direct(m):
            where = f"{name}.{attr}" if name else attr
            if is_lazy(t):
                bad.append(f"{where} is a lazy tensor (no shape yet): run a forward first")
            elif not (t.is_floating_point() or t.is_complex()) and _reset_of(m) is None:
                bad.append(
                    f"{where} ({t.dtype}) belongs to {type(m).__name__}, which has no "
                    "reset_parameters() to make it"
                )
    if bad:
        raise ValueError(f"{_CALLER}: {'; '.join(bad)}")


def _check_alike(ranks: list[Any]) -> None:
    for r, (layout, units, seed, generator) in enumerate(ranks):
        if (layout, units, seed) != ranks[0][:3]:
            raise ValueError(
                f"{_CALLER}: the module, units, seed or init differ between rank 0 and rank "
                f"{r}; every rank must make the same module alike"
            )
        if generator != ranks[0][3]:
            raise ValueError(
                f"{_CALLER}: the random generator differs between rank 0 and rank {r}, so their "
                "draws would differ; seed every rank alike (torch.manual_seed(s) on each), or "
                "pass seed="
            )


def _generator(device: torch.device) -> int:
    """A checksum of ``device``'s global generator state."""
    state = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
    return zlib.crc32(bytes(state.tolist()))


def _device(device: Any) -> torch.device:
    try:
        where = torch.device(device)
    except (TypeError, RuntimeError):
        raise TypeError(
            f"{_CALLER}: device must be a device spec, got {describe(device)}"
        ) from None
    if where.type == "meta":
        raise ValueError(f"{_CALLER}: device must hold values, got 'meta'")
    return where


# --- making: a copy of each unit, its resets in post-order -----------------------------------


def _make(plan: _Plan, device: torch.device, seed: int | None, rows: Any, init: Any) -> State:
    """Every module's reset in post-order, each unit on a copy of its own, kept as it closes."""
    made = State({}, {})
    open_: dict[str, _Copy] = {}
    for name, m in plan.order:
        unit = plan.item[id(m)]
        if unit is None:
            alone = _Copy(plan, m, {id(m)}, device)
            _reset(alone.of(m), name, seed, device, init)
            alone.keep(made, rows)
            continue
        if unit not in open_:
            members = {i for i, u in plan.item.items() if u == unit}
            open_[unit] = _Copy(plan, plan.roots[unit], members, device)
        _reset(open_[unit].of(m), name, seed, device, init)
        if name == unit:
            open_.pop(unit).keep(made, rows)
    return State(
        {n: made.params[n] for n in plan.params.values()},
        {n: made.buffers[n] for n in plan.buffers.values()},
    )


class _Copy:
    """A deep copy of ``root``: its ``members``' tensors made on ``device``, every other one a
    stand-in; a member that holds a tensor another module holds first gets one to throw away."""

    def __init__(
        self, plan: _Plan, root: nn.Module, members: set[int], device: torch.device
    ) -> None:
        self.plan, self.members = plan, members
        memo: dict[int, Any] = {}
        modules = list(root.modules())
        for m in modules:
            for attr, t in _direct(m):
                if id(m) in members and plan.claims[id(t)] == (id(m), attr):
                    memo[id(t)] = _fresh(t, device)
        for m in modules:
            for _, t in _direct(m):
                memo.setdefault(id(t), _stand_in(t, plan.name(t)))
        copy.deepcopy(root, memo)
        self.copies = {id(m): memo[id(m)] for m in modules}
        self.originals = [m for m in modules if id(m) in members]
        for m in self.originals:
            for attr, t in _direct(m):
                if plan.claims[id(t)] != (id(m), attr):
                    mine = self.copies[id(m)]
                    where = mine._parameters if attr in mine._parameters else mine._buffers
                    where[attr] = _fresh(t, device)

    def of(self, m: nn.Module) -> nn.Module:
        return self.copies[id(m)]

    def keep(self, made: State, rows: Any) -> None:
        """The members' own tensors (first holders only), checked set: parameters' ``rows``."""
        for m in self.originals:
            mine = self.copies[id(m)]
            for attr, t in _direct(m):
                if self.plan.claims[id(t)] != (id(m), attr):
                    continue
                name = self.plan.name(t)
                value = _held(mine, attr).detach()
                if (value.is_floating_point() or value.is_complex()) and bool(value.isnan().any()):
                    raise ValueError(
                        f"{_CALLER}: {name} is left unset (NaN) by the resets (and init) of its "
                        "unit: pass init= a function that sets it "
                        "(a Hugging Face model's own: init=model._init_weights), give "
                        f"{type(m).__name__} a reset_parameters() that sets every tensor it holds, "
                        "or name in units a module whose reset sets it together with it"
                    )
                if id(t) in self.plan.params:
                    made.params[name] = rows(value)
                else:
                    made.buffers[name] = value


def _fresh(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor of ``t``'s shape and dtype (NaN where it can be), a Parameter if ``t`` is."""
    new = torch.empty(t.shape, dtype=t.dtype, device=device)
    if new.is_floating_point() or new.is_complex():
        new.fill_(float("nan"))
    return nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new


class _Touched(Exception):
    """A stand-in was used: the name of the tensor it stands in for."""


class _StandIn(torch.Tensor):
    """A tensor of another unit, or of a submodule made apart: any use raises ``_Touched``."""

    _fr_name: str

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        found = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, _StandIn)]
        raise _Touched(found[0]._fr_name if found else "?")


def _stand_in(t: torch.Tensor, name: str) -> torch.Tensor:
    s = torch.Tensor._make_subclass(_StandIn, torch.empty(t.shape, dtype=t.dtype, device="meta"))
    s._fr_name = name
    return s


def _reset(m: nn.Module, name: str, seed: int | None, device: torch.device, init: Any) -> None:
    """``m``'s reset, then ``init(m)``, under no_grad: from the global generator, or one seeded
    from its name."""
    reset = _reset_of(m)
    if reset is None and init is None:
        return
    running = reset.__name__ if reset is not None else "init"

    def both() -> None:
        nonlocal running
        if reset is not None:
            reset()
        if init is not None:
            running = "init"
            init(m)

    try:
        with torch.no_grad():
            if seed is None:
                both()
                return
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                _seed(device, _seed_of(seed, name))
                both()
    except _Touched as touched:
        raise ValueError(
            f"{_CALLER}: the {running}() of {name or 'the module'} ({type(m).__name__}) "
            f"uses {touched.args[0]}, which is made apart from it: list {name!r} (or a module "
            "above it) in units, so that they are made together"
        ) from None


def _seed_of(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _seed(device: torch.device, value: int) -> None:
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(value)
    else:
        torch.default_generator.manual_seed(value)
