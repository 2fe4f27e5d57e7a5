"""The ops a traced call puts in its graph besides the collectives, defined while tracing.

Each is a ``torch.library`` custom op, opaque to Dynamo and with its own
autograd formula where it takes part in a gradient:

* ``verify_layout``: reads a call's probe, one fixed-size collective that
  every traced call begins with (its fingerprint and its negation,
  MAX-reduced), and raises the eager protocol's error, on every rank, where
  the ranks run different layouts. A compiled graph runs its collectives as
  they were traced: two ranks whose cached graphs differ (an all-reduce on
  one, a reduce-scatter on the other) would meet in collectives of different
  sizes, which gloo answers by aborting the process. The call's first bucket
  depends on the op's output, so that it is neither dropped nor moved after it.
* ``held``: a copy whose backward all-reduces (``op``): a tensor an
  all-gather leaves where it is (held whole by every rank), whose transpose
  is an all-reduce, as the kinds' rules say.
* ``grad_scaled``: a copy whose backward multiplies by a factor: an
  all-gather's shards, where its transpose is a mean (the functional
  all-gather's own formula, a reduce-scatter, sums).

They are defined the first time a layout is planned while Dynamo traces
(``_plans._layout_now`` runs in plain Python then): an op cannot be defined
in code Dynamo traces, and defining them at import would cost every import.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from .._torch import resolve_group
from ._layout import Layout

__all__ = ["define", "remember"]

_SIZE = 64
_TRACED: OrderedDict[tuple[str, int], tuple[str, Layout]] = OrderedDict()
_DEFINED: list[bool] = []


def remember(group_name: str, caller: str, layout: Layout) -> None:
    """A traced call's layout, kept for its probe to name a difference at run time."""
    define()
    key = (group_name, layout.fingerprint)
    _TRACED[key] = (caller, layout)
    _TRACED.move_to_end(key)
    while len(_TRACED) > _SIZE:
        _TRACED.popitem(last=False)


def define() -> None:
    """Define the ops (once per process)."""
    if _DEFINED:
        return
    from torch.library import custom_op

    @custom_op("freplicate::verify_layout", mutates_args=())
    def verify_layout(landed: torch.Tensor, fingerprint: int, group_name: str) -> torch.Tensor:
        got = landed.tolist()
        if got[0] != fingerprint or got[1] != -fingerprint:
            from ._agree import exchange

            caller, layout = _TRACED[(group_name, fingerprint)]
            exchange(layout, resolve_group(group_name), caller)
        return landed.new_zeros(1)

    @verify_layout.register_fake
    def _(landed: torch.Tensor, fingerprint: int, group_name: str) -> torch.Tensor:
        return landed.new_empty(1)

    @custom_op("freplicate::held", mutates_args=())
    def held(t: torch.Tensor, op: str, world: int, group_name: str) -> torch.Tensor:
        return t.clone()

    @held.register_fake
    def _(t: torch.Tensor, op: str, world: int, group_name: str) -> torch.Tensor:
        return torch.empty_like(t)

    def held_backward(ctx: Any, ct: torch.Tensor) -> tuple[Any, ...]:
        ops = torch.ops._c10d_functional
        summed = ops.wait_tensor(ops.all_reduce(ct.contiguous(), "sum", ctx.group_name))
        return (summed / ctx.world if ctx.op == "mean" else summed), None, None, None

    def held_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, ctx.op, ctx.world, ctx.group_name = inputs

    held.register_autograd(held_backward, setup_context=held_context)

    @custom_op("freplicate::grad_scaled", mutates_args=())
    def grad_scaled(t: torch.Tensor, factor: float) -> torch.Tensor:
        return t.clone()

    @grad_scaled.register_fake
    def _(t: torch.Tensor, factor: float) -> torch.Tensor:
        return torch.empty_like(t)

    def scaled_backward(ctx: Any, ct: torch.Tensor) -> tuple[Any, ...]:
        return ct * ctx.factor, None

    def scaled_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.factor = inputs[1]

    grad_scaled.register_autograd(scaled_backward, setup_context=scaled_context)
    _DEFINED.append(True)
