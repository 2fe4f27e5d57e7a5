"""What rides in a reduction's first bucket besides the layout check: ``join``'s bit.

``fr.distributed.join`` must learn, once per step, whether any rank of the
group still has data. Rather than a collective of its own, it *arms* a
``Joining`` with this rank's bit (it has a next item); the first reduction
on the group that starts after that (the step's own: gradients, buffers, a
``skip``) writes the bit into its first bucket's *more* flag, and reads the
sum back when its results land (``_call.Call``). Only a step that
made no such reduction pays for a collective of its own (``join``). The
decision is the same on every rank: ranks make the same calls, or raise
together.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ._group import group_ref, remember

__all__ = ["Joining", "armed", "enter", "leave"]


class Joining:
    """One ``join`` loop's state: this rank's bit for the next step, and the group's answer.

    ``bit``: whether this rank has a next item (``None`` between steps);
    ``total``: how many ranks have one (a tensor, read by ``join`` alone),
    once a reduction (or ``join``'s own collective) has carried the bit;
    ``None`` until then.
    """

    __slots__ = ("__weakref__", "bit", "carrier", "total")

    def __init__(self) -> None:
        self.bit: int | None = None
        self.total: torch.Tensor | None = None
        self.carrier: Any = None  # the layout (``_agree.Known``) of the call that carried the bit

    def arm(self, more: bool) -> None:
        self.bit = int(more)
        self.total = None

    def settle(self, total: torch.Tensor) -> None:
        self.total = total
        self.bit = None


# Per group: the join loop whose bit a reduction carries (the innermost, the latest started).
# Keyed by ``group_ref`` (``remember``): the entry goes with the group, and emptiness and
# lookups cost no Python call (every reduction asks).
_CURRENT: dict[weakref.ref[Any], Joining] = {}


def enter(group: Any, joining: Joining) -> None:
    """``joining`` is the loop whose bit reductions on ``group`` carry from now on."""
    remember(_CURRENT, group, joining)


def leave(group: Any, joining: Joining) -> None:
    """``joining`` is over; a loop entered after it keeps its place."""
    key = group_ref(group)
    if _CURRENT.get(key) is joining:
        del _CURRENT[key]


def armed(group: Any) -> Joining | None:
    """The join loop on ``group`` whose bit waits for a reduction to carry it, if any."""
    if not _CURRENT:
        return None
    joining = _CURRENT.get(group_ref(group))
    if joining is None or joining.bit is None:
        return None
    return joining
