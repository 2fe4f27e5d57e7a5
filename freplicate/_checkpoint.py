"""Checkpoints from and to DistributedDataParallel: state dicts <-> ``fr.State`` and name-keyed trees.

A DDP run saves ``ddp.state_dict()`` (the module's keys prefixed
``module.``, tied parameters under every name, non-persistent buffers left
out) and ``optimizer.state_dict()`` (per-parameter state keyed by the
parameter's index in the optimizer, ``param_groups`` listing indices). A
freplicate run holds ``fr.State`` (keyed by ``named_parameters()`` /
``named_buffers()`` names, tied parameters once, every buffer) and
optimizer state as trees keyed by parameter name. These four functions
translate between the two, exactly (the tensors themselves, no copy, no
arithmetic), so that a run resumes across the designs bit for bit:

- ``from_state_dict`` / ``to_state_dict``: a module's state dict (DDP's,
  DataParallel's or its own) <-> ``fr.State``;
- ``optimizer_state_by_name`` / ``optimizer_state_by_index``: a
  ``torch.optim`` state dict <-> the same state keyed by parameter name and
  transposed into one tree per kind of state (``{"exp_avg": {name: ...}}``),
  the shape an optimizer written as tree maps takes.

None of them modifies its arguments or the module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ._state import State

__all__ = [
    "from_state_dict",
    "optimizer_state_by_index",
    "optimizer_state_by_name",
    "to_state_dict",
]


def _module(caller: str, module: Any) -> nn.Module:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{caller}: module must be an nn.Module, got {type(module).__name__}")
    return module


def _mapping(caller: str, arg: str, value: Any) -> Mapping[Any, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"{caller}: {arg} must be a dict, got {type(value).__name__}")
    return value


def _shape_errors(
    given: Mapping[str, Any], paths: Mapping[str, str], own: Mapping[str, Any]
) -> list[str]:
    """A line per name whose given value is no tensor of the module's shape (``paths``: where it is)."""
    bad = []
    for name, value in given.items():
        if not isinstance(value, torch.Tensor):
            bad.append(f"{paths[name]} is a {type(value).__name__}, not a tensor")
        elif value.shape != own[name].shape:
            bad.append(
                f"{paths[name]} has shape {tuple(value.shape)}, the module's {name!r} "
                f"{tuple(own[name].shape)}"
            )
    return bad


def _optimizer_state(caller: str, arg: str, value: Any, what: str) -> Mapping[str, Any]:
    """``value``, a dict with ``"state"`` and ``"param_groups"`` (``what`` says whose)."""
    value = _mapping(caller, arg, value)
    if "state" not in value or "param_groups" not in value:
        raise TypeError(
            f"{caller}: {arg} must be {what} with 'state' and 'param_groups', got keys "
            f"{sorted(map(str, value))}"
        )
    return value


def _listed(what: str, names: list[str], why: str) -> list[str]:
    """``["<what> 'a', 'b', <why>"]``, or nothing without names."""
    return [f"{what} {', '.join(map(repr, names))}, {why}"] if names else []


def _raise_all(caller: str, error: type[Exception], lines: list[str], advice: str) -> None:
    if lines:
        raise error(f"{caller}: " + "; ".join(lines) + f". {advice}")


def from_state_dict(
    module: nn.Module, state_dict: Mapping[str, torch.Tensor], *, prefix: str = "module."
) -> State:
    """The ``fr.State`` of a state dict: DDP's (keys prefixed ``module.``) or the module's own.

    ``prefix`` is taken off every key when every key has it
    (``DistributedDataParallel`` and ``nn.DataParallel`` save the wrapped
    module's keys under ``module.``); keys are read as they are when none
    has it. ``params`` and ``buffers`` are keyed and ordered as
    ``fr.state(module)``'s: a tied parameter once, under its first name
    (its other names must hold an equal tensor); a non-persistent buffer,
    which no state dict holds, is the module's own (as ``fr.state`` gives
    it); extra state (a submodule's ``get_extra_state``), which a ``State``
    has no place for, is left out. The leaves are the state dict's tensors
    themselves (no copy, on their own devices; detached). Nothing is
    modified.

    >>> model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    >>> saved = {"module." + k: v for k, v in model.state_dict().items()}  # as DDP saves
    >>> s = from_state_dict(model, saved)
    >>> list(s.params), list(s.buffers)
    (['0.weight', '0.bias', '1.weight', '1.bias'], ['1.running_mean', '1.running_var', '1.num_batches_tracked'])
    >>> from_state_dict(model, {"module.0.weight": torch.ones(2, 2)})
    Traceback (most recent call last):
    ...
    KeyError: "fr.from_state_dict: state_dict lacks 'module.0.bias', 'module.1.weight', ..., which the module has. ..."

    Args:
        module: the module the state dict is of (any device, ``meta`` too);
            it supplies the names, the shapes and the non-persistent buffers.
        state_dict: ``ddp.state_dict()``, ``model.state_dict()``, or one
            loaded from a checkpoint.
        prefix: the wrapper's prefix, stripped where every key has it
            (``""``: never).

    Returns:
        ``State(params, buffers)``.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, or ``state_dict`` not a
            dict or has a value that is not a tensor (naming the key).
        KeyError: keys the module lacks or keys of the module missing (all
            named at once, as they stand in ``state_dict``).
        ValueError: ``prefix`` on some keys only; a shape not the module's;
            a tied parameter's names holding different values (naming them).
    """
    caller = "fr.from_state_dict"
    module = _module(caller, module)
    given = _mapping(caller, "state_dict", state_dict)
    keys = list(given)
    having = [k for k in keys if isinstance(k, str) and k.startswith(prefix)] if prefix else []
    strip = bool(prefix) and len(having) == len(keys) and bool(keys)
    if having and not strip:
        other = next(k for k in keys if k not in set(having))
        raise ValueError(
            f"{caller}: some keys of state_dict start with prefix={prefix!r} ({having[0]!r}) "
            f"and some do not ({other!r}); pass the state dict of one module, or prefix=''"
        )
    key_of = {(k[len(prefix) :] if strip else k): k for k in keys}
    values = {name: given[k] for name, k in key_of.items()}
    first = _first_names(module)
    # every saved name (tied ones included), less extra state, which a State has no place for
    wanted = {n: t for n, t in module.state_dict(keep_vars=True).items() if id(t) in first}
    extra = set(module.state_dict(keep_vars=True)) - set(wanted)
    missing = [n for n in wanted if n not in values]
    unknown = [key_of[n] for n in values if n not in wanted and n not in extra]
    lines = _listed(
        "state_dict lacks", [(prefix if strip else "") + n for n in missing], "which the module has"
    )
    lines += _listed("state_dict has", unknown, "which the module lacks")
    _raise_all(caller, KeyError, lines, "Pass the state dict of this module")
    paths = {n: f"state_dict[{k!r}]" for n, k in key_of.items()}
    bad = _shape_errors({n: values[n] for n in wanted}, paths, wanted)
    kind = TypeError if any(not isinstance(values[n], torch.Tensor) for n in wanted) else ValueError
    _raise_all(caller, kind, bad, "Pass the state dict of this module")
    ties = [
        f"{paths[n]} differs from its tied {paths[first[id(t)]]}"
        for n, t in wanted.items()
        if first[id(t)] != n and not _same(values[n], values[first[id(t)]])
    ]
    _raise_all(caller, ValueError, ties, "Tied names hold one tensor: save them equal")
    params = {name: values[name].detach() for name, _ in module.named_parameters()}
    buffers = {
        name: (values[name] if name in wanted else b).detach() for name, b in module.named_buffers()
    }
    return State(params, buffers)


def _first_names(module: nn.Module) -> dict[int, str]:
    """``id(tensor) -> its first name``, as ``named_parameters()`` / ``named_buffers()`` give it."""
    first: dict[int, str] = {}
    for name, t in (
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ):
        first.setdefault(id(t), name)
    return first


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """One tensor, or equal values (NaNs where the other has NaNs)."""
    if a is b:
        return True
    if (a.shape, a.dtype, a.device) != (b.shape, b.dtype, b.device):
        return False
    if a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True  # one storage: what a saved and loaded tie is
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def to_state_dict(
    module: nn.Module, state: State, *, prefix: str = "module."
) -> dict[str, torch.Tensor]:
    """``state`` as a state dict: DDP's (``prefix="module."``) or the module's own (``prefix=""``).

    The keys and their order are ``module.state_dict()``'s, each prefixed:
    a tied parameter under each of its names (one tensor, ``state``'s),
    non-persistent buffers left out, as ``DistributedDataParallel(module)``
    saves them; ``ddp.load_state_dict`` and ``module.load_state_dict``
    (``prefix=""``) take it. The values are ``state``'s tensors themselves
    (no copy); extra state (``get_extra_state``) is the module's own. Every
    parameter and persistent buffer must be in ``state`` (a partitioned
    state: ``fr.combine(trainable, frozen)`` first). Nothing is modified.

    >>> model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    >>> sd = to_state_dict(model, fr.state(model))
    >>> list(sd)
    ['module.0.weight', 'module.0.bias', 'module.1.weight', 'module.1.bias', 'module.1.running_mean', 'module.1.running_var', 'module.1.num_batches_tracked']
    >>> model.load_state_dict(to_state_dict(model, fr.state(model), prefix=""))
    <All keys matched successfully>

    Args:
        module: the module ``state`` is of.
        state: ``fr.State`` keyed as ``fr.state(module)``.
        prefix: put before every key: ``"module."`` for DDP's and
            DataParallel's state dict, ``""`` for the module's own.

    Returns:
        A new dict from key to tensor.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, ``state`` not a
            ``State``-like pair of dicts, or a value not a tensor.
        KeyError: names the module lacks, or parameters and persistent
            buffers missing from ``state`` (all named at once).
        ValueError: a shape not the module's (naming it).
    """
    caller = "fr.to_state_dict"
    module = _module(caller, module)
    if not (isinstance(state, tuple) and len(state) == 2):
        raise TypeError(
            f"{caller}: state must be a fr.State(params, buffers), got {type(state).__name__}"
        )
    params = _mapping(caller, "state.params", state[0])
    buffers = _mapping(caller, "state.buffers", state[1])
    own_params = dict(module.named_parameters())
    own_buffers = dict(module.named_buffers())
    first = _first_names(module)
    saved = module.state_dict(keep_vars=True)
    lines = _listed(
        "state.params has",
        [n for n in params if n not in own_params],
        "not parameters of the module",
    )
    lines += _listed(
        "state.buffers has",
        [n for n in buffers if n not in own_buffers],
        "not buffers of the module",
    )
    given = {**params, **buffers}
    lacking = [n for n, t in saved.items() if first.get(id(t)) == n and n not in given]
    lines += _listed("state lacks", lacking, "which the module saves")
    _raise_all(caller, KeyError, lines, "Pass every parameter and persistent buffer of this module")
    paths = {n: f"state.params[{n!r}]" for n in params} | {
        n: f"state.buffers[{n!r}]" for n in buffers
    }
    bad = _shape_errors(given, paths, {**own_params, **own_buffers})
    kind = TypeError if any(not isinstance(v, torch.Tensor) for v in given.values()) else ValueError
    _raise_all(caller, kind, bad, "Pass the state of this module")
    # extra state (get_extra_state) is the module's own: a State has no place for it
    return {prefix + n: given[first[id(t)]] if id(t) in first else t for n, t in saved.items()}


def _names(caller: str, groups: Any, names: Sequence[str] | None, prefix: str) -> list[str]:
    """The parameter names in the optimizer's order: ``names``, or the groups' ``param_names``."""
    count = sum(len(g["params"]) for g in groups)
    if names is None:
        if not all("param_names" in g for g in groups):
            raise ValueError(
                f"{caller}: the optimizer state dict names no parameters (its param_groups have "
                "no 'param_names'): pass names, the parameter names in the optimizer's order, "
                "e.g. list(fr.state(model).params) for an optimizer of model.parameters()"
            )
        names = [n for g in groups for n in g["param_names"]]
        if prefix and all(n.startswith(prefix) for n in names):
            names = [n[len(prefix) :] for n in names]
    names = list(names)
    if len(names) != count:
        raise ValueError(
            f"{caller}: names has {len(names)} names, the optimizer {count} parameters; pass one "
            "name per parameter, in the order the optimizer was given them"
        )
    seen: set[str] = set()
    for n in names:
        if n in seen:
            raise ValueError(f"{caller}: names has {n!r} twice; each parameter is named once")
        seen.add(n)
    return names


def optimizer_state_by_name(
    optimizer_state_dict: Mapping[str, Any],
    names: Sequence[str] | None = None,
    *,
    prefix: str = "module.",
) -> dict[str, Any]:
    """A ``torch.optim`` state dict keyed by parameter name, one tree per kind of state.

    ``optimizer.state_dict()`` keys each parameter's state by its index
    (its place in the parameters the optimizer was given, group after
    group). This gives ``{"state": {kind: {name: value}}, "param_groups":
    [{..., "params": [name, ...]}]}``: for AdamW ``state["exp_avg"]`` is a
    dict of tensors keyed and ordered as the parameters (those the optimizer
    has state for), ready for ``optree.tree_map`` beside the parameters and
    gradients. The values are the state dict's own (no copy);
    ``optimizer_state_by_index`` is the inverse.

    ``names`` are the parameter names in the optimizer's order:
    ``list(fr.state(model).params)`` for an optimizer of
    ``model.parameters()`` or ``ddp.parameters()`` (the same order). By
    default they are the groups' ``param_names`` (an optimizer given
    ``named_parameters()``), with ``prefix`` taken off where all have it.

    >>> model = nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    >>> model(torch.ones(1, 2)).sum().backward(); opt.step()
    >>> named = optimizer_state_by_name(opt.state_dict(), list(fr.state(model).params))
    >>> named["state"]
    {'momentum_buffer': {'weight': tensor([[1., 1.]]), 'bias': tensor([1.])}}
    >>> named["param_groups"][0]["params"], named["param_groups"][0]["momentum"]
    (['weight', 'bias'], 0.9)

    Args:
        optimizer_state_dict: ``optimizer.state_dict()``, or one loaded.
        names: the parameter names in the optimizer's order.
        prefix: taken off the groups' ``param_names`` (DDP's ``module.``).

    Returns:
        A new dict ``{"state": ..., "param_groups": ...}``.

    Raises:
        TypeError: not an optimizer state dict.
        ValueError: ``names`` of the wrong length or with a repeat, or
            missing where the state dict has no ``param_names``.
    """
    caller = "fr.optimizer_state_by_name"
    sd = _optimizer_state(
        caller, "optimizer_state_dict", optimizer_state_dict, "an optimizer's state_dict()"
    )
    groups = sd["param_groups"]
    names = _names(caller, groups, names, prefix)
    order = [i for g in groups for i in g["params"]]
    name_of = dict(zip(order, names))
    unknown = [i for i in sd["state"] if i not in name_of]
    if unknown:
        raise ValueError(
            f"{caller}: optimizer_state_dict['state'] has parameter indices {unknown} that no "
            "param_group lists"
        )
    state: dict[str, dict[str, Any]] = {}
    for i in order:  # the parameters' order, whatever the state dict's
        for kind, value in sd["state"].get(i, {}).items():
            state.setdefault(kind, {})[name_of[i]] = value
    return {
        "state": state,
        "param_groups": [{**g, "params": [name_of[i] for i in g["params"]]} for g in groups],
    }


def optimizer_state_by_index(named: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of ``optimizer_state_by_name``: a state dict ``optimizer.load_state_dict`` takes.

    ``named["param_groups"]`` list parameter names (with the groups'
    hyperparameters, e.g. from ``optimizer_state_by_name`` or from a new
    optimizer's ``state_dict()["param_groups"]`` with the names put in);
    each name's index is its place in those lists, group after group,
    which is the order the loading optimizer must have been given its
    parameters in. ``named["state"]`` maps each kind of state to a dict
    from name to value. The values are ``named``'s own (no copy).

    >>> named = {
    ...     "state": {"momentum_buffer": {"bias": torch.ones(1)}},
    ...     "param_groups": [{"lr": 0.1, "params": ["weight", "bias"]}],
    ... }
    >>> optimizer_state_by_index(named)
    {'state': {1: {'momentum_buffer': tensor([1.])}}, 'param_groups': [{'lr': 0.1, 'params': [0, 1]}]}

    Args:
        named: ``{"state": {kind: {name: value}}, "param_groups": [...]}``.

    Returns:
        A new dict ``{"state": {index: {kind: value}}, "param_groups": [...]}``.

    Raises:
        TypeError: not a name-keyed optimizer state.
        KeyError: a name in ``named["state"]`` no group lists (all named).
        ValueError: a name listed twice in the groups.
    """
    caller = "fr.optimizer_state_by_index"
    tree = _optimizer_state(caller, "named", named, "optimizer_state_by_name's result")
    groups = tree["param_groups"]
    names = _names(caller, [{**g, "param_names": g["params"]} for g in groups], None, "")
    index = {n: i for i, n in enumerate(names)}
    unknown = [
        f"named['state'][{kind!r}][{n!r}]"
        for kind, values in _mapping(caller, "named['state']", tree["state"]).items()
        for n in values
        if n not in index
    ]
    if unknown:
        raise KeyError(
            f"{caller}: {', '.join(unknown)} name parameters that no param_group lists; list "
            "every parameter in named['param_groups']"
        )
    state: dict[int, dict[str, Any]] = {}
    for n in names:
        entry = {kind: values[n] for kind, values in tree["state"].items() if n in values}
        if entry:
            state[index[n]] = entry
    out_groups, at = [], 0
    for g in groups:
        out_groups.append({**g, "params": list(range(at, at + len(g["params"])))})
        at += len(g["params"])
    return {"state": state, "param_groups": out_groups}
