"""The bucket pipeline: pack a plan's buckets, launch their collectives in order, collect."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._pack import FlatPool
from .._typing import Op, TensorTree
from .plan import FLAGS, Plan

__all__ = ["Reduction"]


class Reduction:
    """One call's reduction over a plan: fill buckets, launch them in order, collect results."""

    __slots__ = ("group", "launched", "op", "pending", "plan", "poisoned", "world")

    def __init__(
        self, plan: Plan, op: Op, group: Any, world: int, poisoned: Callable[[], None] | None
    ) -> None:
        self.plan = plan
        self.op = op
        self.group = group
        self.world = world
        # on the fast path of the layout check: what to do if the first bucket's flags are poisoned
        self.poisoned = poisoned
        self.launched = 0
        self.pending: list[tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, Any]] = []

    def stage(self, b: int, parts: Sequence[Any]) -> tuple[Any, ...]:
        """Pack bucket ``b`` from ``parts`` (``FlatPool.pack``'s, one per run), ready to start."""
        bucket = self.plan.buckets[b]
        res, runs = bucket.results.take()
        # a mean divides before the sum, as DDP does: one pass with the copy, no overflow in fp16
        div = self.world if self.op == "mean" else 1
        if bucket.comm is None:
            comm = res
            bucket.results.pack(runs, parts, div=div)
        else:
            comm, comm_runs = bucket.comm.take()
            bucket.comm.pack(comm_runs, parts, div=div)
        if bucket.clear is not None:
            comm[-FLAGS:].copy_(bucket.clear)
        return runs, comm, res, bucket.red

    def start(self, staged: tuple[Any, ...]) -> None:
        if self.launched == 1 and self.poisoned is not None:
            self.confirm()  # no second bucket before every rank is known to run this layout
        runs, comm, res, red = staged
        work = dist.all_reduce(comm, op=red, group=self.group, async_op=True)
        self.pending.append((runs, comm, res, work))
        self.launched += 1

    def confirm(self) -> None:
        """Wait for the first bucket and read its flags: the fast path's layout check."""
        poisoned, self.poisoned = self.poisoned, None
        _, comm, _, work = self.pending[0]
        work.wait()
        if poisoned is not None and comm[-FLAGS].item() != 0:
            poisoned()  # a rank mirrored the agreed layout: it runs another one

    def launch(self, b: int, parts: Sequence[Any]) -> None:
        self.start(self.stage(b, parts))

    def finish(self, build: Callable[[Sequence[torch.Tensor]], TensorTree]) -> TensorTree:
        """``build`` of the results (one per unique tensor of the plan), returned once all landed.

        The results are views of the buckets' result buffers; the pools
        reuse a buffer only once all of its views are gone. Views of a buffer
        still being reduced in place are valid before its values land, so
        they and ``build``'s tree are made while the buckets are in flight,
        and handed out only after the waits.
        """
        views: list[torch.Tensor] = []
        for runs, _, _, _ in self.pending:
            views += FlatPool.views(runs)
        out = build(self.plan.reorder(views))
        if self.poisoned is not None:
            self.confirm()
        for _, comm, res, work in self.pending:
            work.wait()
            if comm is not res:
                res.copy_(comm)
        return out
