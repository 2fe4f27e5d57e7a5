"""Uneven inputs: ``join``, DDP's ``Join`` as a generator over this rank's own data.

A rank whose data runs out must still take part in its peers' reductions
until every rank is done, or they wait for it until the group's timeout.
``join`` yields this rank's items, then ``None`` while any rank still has
one, and stops on every rank at the same step. Whether any rank has a next
item is decided once per step, as DDP's ``Join`` does, but without a
collective of its own where it can: each step's first reduction carries
this rank's bit in its first bucket (``carry``), so ``join`` looks one item
ahead. Only a step that made no reduction on the group, and the loop's
start, pay for one small reduction of their own.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch

from . import _carry as carry
from ._call import Announced
from ._collectives import collect
from ._group import comm_device, world_size
from ._options import Options
from ._wire import ALL_REDUCE, Spec

__all__ = ["join"]

T = TypeVar("T")
_END: Any = object()  # the end of this rank's items
_MORE = Options(ALL_REDUCE.name, "sum", 25.0, None)


def join(iterable: Iterable[T], *, group: Any = None) -> Iterator[T | None]:
    """This rank's items, then ``None`` while another rank of ``group`` still has items.

    The functional ``torch.distributed.algorithms.Join``: ranks with
    different numbers of batches (uneven shards, the last batches of an
    epoch) loop together, and stop together, once no rank has an item left.
    Where it yields ``None`` this rank has no batch, and calls ``skip`` on
    its step (``fr.distributed.grad_and_value``'s) instead of the step
    itself, so that its peers' reductions find it there (see the example).
    Every rank then applies the same update at every step, as under DDP's
    ``Join`` (``divide_by_initial_world_size=True``: a rank out of data
    contributes zeros to a mean over the world size); a step's ``weight=``
    averages over the ranks that had data instead.

    Whether some rank has a next item rides in the step's own first
    reduction on ``group`` (any ``fr.distributed`` call: the gradients,
    ``sync_buffers``, a ``skip``), at no collective of its own; a step that
    makes no reduction on ``group``, and the loop's start, cost one small
    reduction. ``join`` therefore reads one item ahead of the loop. Items
    must not be ``None``. Collective: every rank of ``group`` iterates, and
    makes the same ``fr.distributed`` calls at each step; a rank that makes
    none where its peers make some meets them in its own reduction and every
    rank raises ``ValueError`` ("ranks called different functions").

    Args:
        iterable: this rank's items (its batches).
        group: the process group (default: the default group).

    Returns:
        A generator of this rank's items, then ``None`` until every rank is
        done; without a process group or with one rank, the items alone.

    Raises:
        TypeError: ``iterable`` is not iterable; a bad ``group``.
        RuntimeError: iterating raised on another rank (naming it); this
            rank's own error is raised as it is, on this rank.

    Examples:
        >>> list(fr.distributed.join([1, 2, 3]))  # no process group here: the items
        [1, 2, 3]
        >>> step = fr.distributed.grad_and_value(lambda p, x: (p["w"] * x).sum())
        >>> params = {"w": torch.ones(2)}
        >>> for x in fr.distributed.join([torch.ones(2), torch.ones(2)]):
        ...     grads, _ = step.skip(params) if x is None else step(params, x)
        ...     params = {"w": params["w"] - 0.1 * grads["w"]}
        >>> params["w"]
        tensor([0.8000, 0.8000])
    """
    caller = "fr.distributed.join"
    world = world_size(group, caller)
    try:
        items = iter(iterable)
    except TypeError:
        raise TypeError(
            f"{caller}: iterable must be iterable (this rank's batches), got "
            f"{type(iterable).__name__}"
        ) from None
    if world <= 1:
        return items
    return _joined(items, group, world, caller)


def _joined(items: Iterator[T], group: Any, world: int, caller: str) -> Iterator[T | None]:
    joining = carry.Joining()
    carry.enter(group, joining)
    try:
        current = _next(items, joining, group, world, caller)
        joining.arm(current is not _END)
        if not _settle(joining, group, world, caller):
            return
        while True:
            following = _END if current is _END else _next(items, joining, group, world, caller)
            joining.arm(following is not _END)  # carried by the step's first reduction
            yield None if current is _END else current
            if not _settle(joining, group, world, caller):
                return
            current = following
    finally:
        carry.leave(group, joining)


def _next(items: Iterator[T], joining: carry.Joining, group: Any, world: int, caller: str) -> Any:
    """The next item or ``_END``; an error raised on every rank, this one's own here (in the
    call the peers make next: the step's reduction that carried the bit last time)."""
    with Announced(group, world, caller, known=joining.carrier):
        return next(items, _END)


def _settle(joining: carry.Joining, group: Any, world: int, caller: str) -> bool:
    """Whether any rank has a next item: read from the reduction that carried the bit, or asked."""
    if joining.total is None:  # no reduction carried it: one of its own, which carries it
        more = torch.tensor([float(joining.bit or 0)], device=comm_device(group))
        out = collect({"more": more}, Spec(_MORE, group, world, caller, True, ()))
        joining.settle(out["more"][0])
    assert joining.total is not None
    return bool(joining.total > 0)  # the loop's one host read a step, as DDP's Join's
