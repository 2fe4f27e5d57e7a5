"""Module <-> tree: ``State`` and ``state(module)``."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

__all__ = ["State", "state"]


class State(NamedTuple):
    """A module's tensors as a tree: ``params`` and ``buffers`` keyed by qualified name.

    >>> s = state(nn.BatchNorm1d(2))
    >>> sorted(s.params), sorted(s.buffers)
    (['bias', 'weight'], ['num_batches_tracked', 'running_mean', 'running_var'])
    """

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]


def state(module: nn.Module) -> State:
    """The module's parameters and buffers as a ``State``, without copying.

    Leaves are detached tensors sharing storage with the module's own; tied
    parameters appear once, under their first name (as ``named_parameters()``).

    >>> lin = nn.Linear(3, 2)
    >>> s = state(lin)
    >>> s.params["weight"].data_ptr() == lin.weight.data_ptr(), s.params["weight"].requires_grad
    (True, False)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fr.state: module must be an nn.Module, got {type(module).__name__}")
    return State(
        {name: p.detach() for name, p in module.named_parameters()},
        {name: b.detach() for name, b in module.named_buffers()},
    )
