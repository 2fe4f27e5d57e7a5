"""The bucket pipeline: pack a plan's buckets, launch their collectives in order, collect.

One pipeline serves every collective of fr.distributed: ``all_reduce`` and
``grad_and_value`` pack their tensors (divided by the world size for a
mean), ``broadcast`` packs them on the source rank and a neutral filler
elsewhere (a sum then gives every rank the source's values), so that every
call's first collective is a first bucket, with the layout check's flags.

A weighted mean packs ``weight * tensor``, sends the weight in the first
bucket's *weight* flag, and divides the landed sums by the summed weights:
no collective of its own. An accumulated step (``grad_and_value``'s
``accumulate``) packs the gradients summed so far and adds the last
micro-batch's into the bucket as they come. The first bucket also carries
``join``'s bit (``carry``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._pack import FlatPool
from .._typing import Op, TensorTree
from . import carry
from .agree import failure, record
from .plan import FAILED, FLAGS, MORE, OFF, WEIGHT, Plan

__all__ = ["Reduction"]


class Reduction:
    """One call's reduction over a plan: fill buckets, launch them in order, collect results.

    ``poisoned``: on the fast path of the layout check, what to do if the
    first bucket's flags say another rank ran something else. ``error``: this
    rank's own failure (``fail``), announced to the others in the flags of
    the buckets still to launch. ``weight``: this rank's weight in a
    weighted mean (``None``: the plain sum or mean); ``scale``: what its
    tensors are multiplied by when packed (the weight, unless they were
    weighted already). ``acc``: gradients accumulated so far, one per tensor
    of the plan, added to the bucket's own as it is packed.
    """

    __slots__ = (
        "acc",
        "caller",
        "error",
        "group",
        "joining",
        "launched",
        "op",
        "pending",
        "plan",
        "poisoned",
        "scale",
        "sparse",
        "weight",
        "world",
    )

    def __init__(
        self,
        plan: Plan,
        op: Op,
        group: Any,
        world: int,
        poisoned: Callable[[], None] | None,
        caller: str,
    ) -> None:
        self.plan = plan
        self.op = op
        self.group = group
        self.world = world
        self.poisoned = poisoned
        self.caller = caller
        self.error: BaseException | None = None
        self.weight: float | None = None
        self.scale = 1.0
        self.acc: Sequence[torch.Tensor] | None = None
        self.joining: carry.Joining | None = None
        self.launched = 0
        self.pending: list[tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, Any]] = []
        self.sparse: list[tuple[torch.Tensor, Any]] = []

    def stage(self, b: int, parts: Sequence[Any] | None) -> tuple[Any, ...]:
        """Pack bucket ``b`` from ``parts`` (``FlatPool.pack``'s, one per run), ready to start.

        ``parts=None``: nothing of this rank's to send (``broadcast`` off the
        source, a ``skip``, or a failed call): the bucket holds -0.0, the
        sum's neutral element for every value, +0.0 and -0.0 included (0 for
        integers).
        """
        bucket = self.plan.buckets[b]
        res, runs = bucket.results.take()
        comm, comm_runs = (res, runs) if bucket.comm is None else bucket.comm.take()
        pool = bucket.results if bucket.comm is None else bucket.comm
        # a mean divides before the sum, as DDP does: one pass with the copy, no fp16 overflow
        div = self.world if self.op == "mean" and self.weight is None else 1
        if parts is None:
            comm.fill_(-0.0 if comm.is_floating_point() or comm.is_complex() else 0)
        elif self.acc is not None:
            # in full precision: the sum so far, then this micro-batch's gradients added in
            bucket.results.pack(runs, self.plan.parts(b, self.acc), div=div)
            _add(runs, parts, self.scale if self.weight is not None else 1 / div)
            if comm is not res:
                comm.copy_(res)
        else:
            pool.pack(comm_runs, parts, div=div)
            if self.weight is not None and self.scale != 1:
                comm[: comm.numel() - bucket.extra].mul_(self.scale)
        if bucket.clear is not None:
            comm[-bucket.extra :].copy_(bucket.clear)
            if self.error is not None:
                comm[FAILED if b == 0 else -1] = 1
            if b == 0 and bucket.extra == FLAGS:
                if self.weight is not None:
                    comm[WEIGHT] = self.weight
                joining = carry.armed(self.group)
                if joining is not None and self.plan.speculates(self.world):
                    comm[MORE] = joining.bit or 0
                    self.joining = joining
        return runs, comm, res, bucket.red

    def start(self, staged: tuple[Any, ...]) -> None:
        if self.launched == 1 and self.poisoned is not None:
            self.confirm()  # no second bucket before every rank is known to run this layout
        runs, comm, res, red = staged
        work = dist.all_reduce(comm, op=red, group=self.group, async_op=True)
        self.pending.append((runs, comm, res, work))
        self.launched += 1

    def launch(self, b: int, parts: Sequence[Any] | None) -> None:
        self.start(self.stage(b, parts))

    def start_sparse(self, tensors: Sequence[torch.Tensor], *, send: bool = True) -> None:
        """Start the plan's sparse tensors' all-reduces (after its buckets), one each.

        Each sends a coalesced copy (divided by the world size for a mean, as
        DDP does; nothing of this rank's where ``send`` is false): gloo sums
        sparse tensors of any number of entries into it, in place.
        """
        if tensors and self.poisoned is not None and self.launched:
            self.confirm()  # nothing more before every rank is known to run this layout
        for t in tensors:
            c = t.coalesce()
            indices, values = c.indices(), c.values()
            if not send:
                indices, values = indices[:, :0], values[:0]
            if self.weight is not None:
                values = values * self.scale
            elif self.op == "mean":
                values = values / self.world
            else:
                values = values.clone()
            mine = torch.sparse_coo_tensor(indices.clone(), values, c.shape, is_coalesced=True)
            work = dist.all_reduce(mine, group=self.group, async_op=True)
            self.sparse.append((mine, work))
        if tensors and self.weight is not None and not self.plan.buckets:
            # no bucket to carry the weight: the weights' sum travels on its own
            total = torch.tensor([self.weight], dtype=torch.float64, device=mine.device)
            self.sparse.append((total, dist.all_reduce(total, group=self.group, async_op=True)))

    def fail(self, error: BaseException) -> None:
        """This rank's call failed: launch what is left with the failed flag, then raise together.

        Raises ``OwnFailure`` once every rank knows (the caller re-raises
        ``error``); the other ranks raise a ``RuntimeError`` naming this one.
        """
        self.error = error
        self.drain()

    def drain(self) -> None:
        """Launch the buckets left with nothing of this rank's, and finish; the results unused."""
        for b in range(self.launched, len(self.plan.buckets)):
            self.launch(b, None)
        self.finish(lambda results: None)

    def confirm(self) -> None:
        """Wait for the first bucket and read its flags: the fast path's layout check."""
        poisoned, self.poisoned = self.poisoned, None
        _, comm, _, work = self.pending[0]
        work.wait()
        if comm[OFF].item() != 0 or comm[FAILED].item() != 0:
            if self.error is not None:
                failure(self.group, self.caller, self.error)
            assert poisoned is not None
            poisoned()  # a rank mirrored the expected layout: it runs another one, or failed
        record(self.plan, self.group)

    def finish(self, build: Callable[[Sequence[torch.Tensor]], TensorTree]) -> TensorTree:
        """``build`` of the results (one per unique tensor of the plan), returned once all landed.

        The results are views of the buckets' result buffers; the pools
        reuse a buffer only once all of its views are gone. Views of a buffer
        still being reduced in place are valid before its values land, so
        they and ``build``'s tree are made while the buckets are in flight,
        and handed out only after the waits. Every rank reads the failed
        flag of the last bucket: set, every rank raises (``failure``).
        """
        views: list[torch.Tensor] = []
        for runs, _, _, _ in self.pending:
            views += FlatPool.views(runs)
        sparse = [mine for mine, _ in self.sparse[: len(self.plan.sparse)]]
        out = build(self.plan.reorder(views + sparse))
        if self.poisoned is not None:
            self.confirm()
        for *_, work in self.pending + self.sparse:
            work.wait()
        if self.pending:
            first, last = self.pending[0][1], self.pending[-1][1]
            if last[FAILED if len(self.pending) == 1 else -1].item() != 0:
                failure(self.group, self.caller, self.error)
            if self.joining is not None:
                self.joining.settle(first[MORE].real.item() != 0)
        for _, comm, res, _ in self.pending:
            if comm is not res:
                res.copy_(comm)
        if self.weight is not None:
            self._divide(sparse)
        return out

    def _divide(self, sparse: Sequence[torch.Tensor]) -> None:
        """A weighted mean's last step: every landed sum divided by the sum of the weights.

        Zero weights on every rank (nothing to average) give zeros.
        """
        if self.pending:
            total = float(self.pending[0][1][WEIGHT].real.item())
        elif len(self.sparse) > len(sparse):
            total = float(self.sparse[-1][0].item())
        else:
            return
        with torch.no_grad():
            for b, (_, _, res, _) in enumerate(self.pending):
                data = res[: res.numel() - self.plan.buckets[b].extra]
                if total:
                    data.div_(total)
                else:
                    data.zero_()
            for mine in sparse:
                if total:
                    mine.div_(total)
                else:
                    mine.mul_(0)


def _add(runs: Sequence[torch.Tensor], parts: Sequence[Any], alpha: float) -> None:
    """Add ``parts`` (``FlatPool.pack``'s, one per run) times ``alpha`` into ``runs``, in place."""
    with torch.no_grad():
        for run, part in zip(runs, parts):
            if isinstance(part, torch.Tensor):
                run.add_(part, alpha=alpha)
            else:
                torch._foreach_add_(list(run.unbind(0)), list(part), alpha=alpha)
