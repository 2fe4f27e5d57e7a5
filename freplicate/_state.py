"""Module <-> tree: ``State``, ``state(module)``, and the trainable/frozen split.

``State`` is registered with ``torch.serialization.add_safe_globals`` when
freplicate is imported, so that a checkpoint holding one loads with
``torch.load``'s default ``weights_only=True``: the only change freplicate
makes outside itself, confined to its own type.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import nn

__all__ = ["State", "combine", "partition", "state"]


class State(NamedTuple):
    """A module's tensors as a tree: ``params`` and ``buffers`` keyed by qualified name.

    A ``NamedTuple``, so every tree function (optree, ``torch.utils._pytree``,
    ``fr.replicate``, ``fr.all_reduce``) sees two dicts of tensors. It can be
    saved with ``torch.save`` and loaded with ``torch.load(path)`` (the
    default ``weights_only=True``) once freplicate is imported.

    >>> import freplicate as fr
    >>> s = fr.state(nn.BatchNorm1d(2))
    >>> sorted(s.params), sorted(s.buffers)
    (['bias', 'weight'], ['num_batches_tracked', 'running_mean', 'running_var'])
    """

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]


torch.serialization.add_safe_globals([State])


def state(module: nn.Module) -> State:
    """The module's parameters and buffers as a ``State``, without copying.

    Leaves are detached tensors sharing storage with the module's own; tied
    parameters appear once, under their first name (as ``named_parameters()``).
    Frozen parameters (``requires_grad=False``) are included: split them off
    with ``fr.partition`` to differentiate and communicate only the trainable ones.

    Args:
        module: any ``nn.Module``; not modified.

    Returns:
        ``State(params, buffers)``: dicts from qualified name to detached tensor.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.

    >>> import freplicate as fr
    >>> lin = nn.Linear(3, 2)
    >>> s = fr.state(lin)
    >>> s.params["weight"].data_ptr() == lin.weight.data_ptr(), s.params["weight"].requires_grad
    (True, False)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fr.state: module must be an nn.Module, got {type(module).__name__}")
    return State(
        {name: p.detach() for name, p in module.named_parameters()},
        {name: b.detach() for name, b in module.named_buffers()},
    )


def partition(
    params: Mapping[str, torch.Tensor], module: nn.Module
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split ``params`` into ``(trainable, frozen)`` by the module's own ``requires_grad``.

    The functional form of freezing layers for fine-tuning (Equinox's
    ``partition``): differentiate, all-reduce and update ``trainable`` only,
    and bind both with ``fr.combine(trainable, frozen)``. Frozen parameters
    then get no gradient, cost no backward work and no communication, and
    stay bit-identical, as under DDP.

    Args:
        params: parameters keyed by qualified name (``fr.state(module).params``).
        module: the module whose parameters' ``requires_grad`` decide the split.

    Returns:
        ``(trainable, frozen)``: two dicts in ``params``' order that together hold
        every entry of ``params``.

    Raises:
        TypeError: ``params`` is not a mapping, or ``module`` not an ``nn.Module``.
        KeyError: a name of ``params`` is not a parameter of ``module``.

    >>> import freplicate as fr
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    >>> _ = model[0].requires_grad_(False)
    >>> trainable, frozen = fr.partition(fr.state(model).params, model)
    >>> list(trainable), list(frozen)
    (['1.weight', '1.bias'], ['0.weight', '0.bias'])
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fr.partition: module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(params, Mapping):
        raise TypeError(
            f"fr.partition: params must be a dict of tensors keyed by parameter name, "
            f"got {type(params).__name__}"
        )
    flags = {name: p.requires_grad for name, p in module.named_parameters(remove_duplicate=False)}
    trainable: dict[str, torch.Tensor] = {}
    frozen: dict[str, torch.Tensor] = {}
    for name, value in params.items():
        flag = flags.get(name)
        if flag is None:
            raise KeyError(f"fr.partition: params has {name!r}, which is not a parameter of module")
        (trainable if flag else frozen)[name] = value
    return trainable, frozen


def combine(*parts: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One dict of parameters from disjoint parts (the inverse of ``fr.partition``).

    Args:
        *parts: dicts keyed by parameter name, e.g. ``(trainable, frozen)``.

    Returns:
        A new dict with every entry of every part.

    Raises:
        TypeError: a part is not a dict.
        ValueError: a name appears in two parts (the message names it and
            both parts), as ``fr.apply`` refuses a name in both
            ``state.params`` and ``state.buffers``.

    >>> import freplicate as fr
    >>> fr.combine({"a": torch.ones(1)}, {"b": torch.zeros(1)})
    {'a': tensor([1.]), 'b': tensor([0.])}
    >>> fr.combine({"a": torch.ones(1)}, {"a": torch.zeros(1)})
    Traceback (most recent call last):
    ...
    ValueError: fr.combine: 'a' is in both parts[0] and parts[1]; give each name in one part only
    """
    out: dict[str, torch.Tensor] = {}
    part_of: dict[str, int] = {}
    for i, part in enumerate(parts):
        if not isinstance(part, Mapping):
            raise TypeError(f"fr.combine: parts[{i}] must be a dict, got {type(part).__name__}")
        for name, value in part.items():
            if name in out:
                raise ValueError(
                    f"fr.combine: {name!r} is in both parts[{part_of[name]}] and parts[{i}]; "
                    "give each name in one part only"
                )
            out[name] = value
            part_of[name] = i
    return out
