"""Transports: how a bucket's flat buffer goes through its collective, eagerly or traced.

Everything above this file is written once; here is the choice between the
two ways to run it (torchopt's ``accelerated_op`` shape: two backends, one
interface, call sites written once):

* ``Eager``: ``torch.distributed``'s asynchronous collectives on buffers
  taken from pools (a pool hands a buffer out again only once no result
  views it, so results of successive calls never alias, and a training loop
  reuses two buffers instead of paying a large allocation every step); the
  flag words are read back to the host.
* ``Traced``, while ``torch.compile`` traces: the functional collectives
  (``torch.ops._c10d_functional``), which Dynamo writes into the graph, on
  fresh buffers; nothing is read back (the layout was checked while tracing,
  see ``_plans``).

Both take the same buffers' shapes from the layout (``_layout``) and the same
copy-in and copy-out (``_copy``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .._torch import functional_collectives, storage_use_count
from ._group import collective
from ._layout import Bucket

__all__ = ["Eager", "Pool", "Pools", "Traced", "real_view", "run_collective"]


class Pool:
    """Flat buffers of one size, each reused only when nothing outside the pool shares it.

    ``take()`` returns a buffer no result views any more, or a new one. With
    ``keep`` the pool keeps that many at most and, beyond the busy ones, one
    spare: a loop that holds one result while it asks for the next
    alternates between two buffers; one that drops them all keeps one.
    Where torch cannot tell how many share a storage, nothing is kept.

    >>> pool = Pool(3, torch.float32, torch.device("cpu"))
    >>> a = pool.take()
    >>> view = a[:2]  # a result: a is busy
    >>> pool.take().data_ptr() != a.data_ptr()
    True
    >>> del view
    >>> pool.take().data_ptr() == a.data_ptr()
    True
    """

    __slots__ = ("device", "dtype", "entries", "keep", "numel")

    def __init__(
        self, numel: int, dtype: torch.dtype, device: torch.device, *, keep: int = 3
    ) -> None:
        self.numel = numel
        self.dtype = dtype
        self.device = device
        self.keep = keep if storage_use_count(torch.empty(0)) is not None else 0
        self.entries: list[tuple[torch.Tensor, int | None]] = []

    def take(self) -> torch.Tensor:
        spare = None
        kept = []
        for entry in self.entries:
            if storage_use_count(entry[0]) != entry[1]:
                kept.append(entry)  # busy: a result still views it
            elif spare is None:
                spare = entry
                kept.append(entry)
            # else a second spare buffer: let it go (one spare at most)
        if len(kept) != len(self.entries):
            self.entries = kept
        if spare is not None:
            return spare[0]
        flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        if len(self.entries) < self.keep:
            self.entries.append((flat, storage_use_count(flat)))
        return flat


class Pools:
    """One bucket's pools: what it sends, what it receives, and where its results live.

    A buffer that results view is kept while they live (``keep=3``); a
    buffer that only carries the collective is the bucket's own (``keep=1``).
    """

    __slots__ = ("recv", "res", "send")

    def __init__(self, bucket: Bucket, kind: str) -> None:
        n, w, dev = bucket.chunk, bucket.chunks, bucket.device
        same = bucket.comm == bucket.dtype
        send_is_result = kind == "reduce" and same
        self.send = Pool(
            n * w if kind == "scatter" else n, bucket.comm, dev, keep=3 if send_is_result else 1
        )
        self.recv = None
        if kind != "reduce":
            recv_is_result = kind == "scatter" and same
            size = n if kind == "scatter" else n * w
            self.recv = Pool(size, bucket.comm, dev, keep=3 if recv_is_result else 1)
        self.res = None
        if not same or kind == "gather":
            size = bucket.data * (w if kind == "gather" else 1)
            self.res = Pool(size, bucket.dtype, dev)

    def clear(self) -> None:
        """Let go of every buffer (results still held keep theirs alive, as any tensor)."""
        for pool in (self.send, self.recv, self.res):
            if pool is not None:
                pool.entries = []


def run_collective(
    kind: str, send: torch.Tensor, recv: torch.Tensor | None, maximum: bool, group: Any, caller: str
) -> Any:
    """Start one eager collective of ``kind`` from ``send`` (into ``recv``); its work handle."""
    op = dist.ReduceOp.MAX if maximum else dist.ReduceOp.SUM
    with collective(caller):
        if kind == "reduce":
            return dist.all_reduce(send, op=op, group=group, async_op=True)
        if kind == "scatter":
            # torch 2.13's names: the older ones warn (FutureWarning) at every call
            scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            return scatter(recv, send, op=op, group=group, async_op=True)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return gather(recv, send, group=group, async_op=True)


def real_view(t: torch.Tensor) -> torch.Tensor:
    """Collectives take complex buffers as their real view."""
    return torch.view_as_real(t).view(-1) if t.is_complex() else t


class Eager:
    """torch.distributed's collectives on pooled buffers, their flag words read back."""

    eager = True

    def __init__(self, kind: str, pools: list[Pools], group: Any, caller: str) -> None:
        self.kind = kind
        self.pools = pools
        self.group = group
        self.caller = caller
        # an empty view of each buffer this call took: busy for the pools while the call lives
        self.held: list[torch.Tensor] = []

    def _take(self, pool: Pool) -> torch.Tensor:
        buf = pool.take()
        self.held.append(buf[:0])
        return buf

    def send(self, b: int, bucket: Bucket) -> torch.Tensor:
        """The buffer bucket ``b`` is packed into (its chunks, in the bucket's comm dtype)."""
        return self._take(self.pools[b].send)

    def result(self, b: int, bucket: Bucket) -> torch.Tensor | None:
        """Where bucket ``b``'s results live, unless they view the landed buffer (``None``)."""
        pool = self.pools[b].res
        return None if pool is None else self._take(pool)

    def start(self, b: int, bucket: Bucket, send: torch.Tensor) -> tuple[Any, torch.Tensor]:
        pool = self.pools[b].recv
        recv = send if pool is None else self._take(pool)
        out = None if pool is None else real_view(recv)
        work = run_collective(
            self.kind, real_view(send), out, bucket.maximum, self.group, self.caller
        )
        return work, recv

    @staticmethod
    def landing(handle: tuple[Any, torch.Tensor]) -> torch.Tensor | None:
        """The buffer a started collective's values land in (known before they do)."""
        return handle[1]

    def wait(self, handle: tuple[Any, torch.Tensor]) -> torch.Tensor:
        """The landed buffer: the sum (reduce), this rank's chunk (scatter), every chunk (gather)."""
        work, recv = handle
        with collective(self.caller):
            work.wait()
        return recv

    @staticmethod
    def read(words: torch.Tensor) -> list[float] | None:
        """The words' values on the host."""
        return (words.real if words.is_complex() else words).tolist()  # type: ignore[no-any-return]


class Traced:
    """The functional collectives, which Dynamo traces into the graph, on fresh buffers."""

    eager = False

    def __init__(self, kind: str, group: Any, world: int) -> None:
        pg = dist.group.WORLD if group is None else group
        self.kind = kind
        self.name = pg.group_name  # type: ignore[union-attr]
        self.world = world
        self.ops = functional_collectives()

    def send(self, b: int, bucket: Bucket) -> torch.Tensor | None:
        """A fresh buffer to pack into; ``None`` for a reduction, whose buffer is its parts
        concatenated (``_copy.joined``: what Inductor copies best)."""
        if self.kind == "reduce":
            return None
        size = bucket.chunk * (bucket.chunks if self.kind == "scatter" else 1)
        return torch.empty(size, dtype=bucket.comm, device=bucket.device)

    def result(self, b: int, bucket: Bucket) -> torch.Tensor | None:
        if bucket.comm == bucket.dtype and self.kind != "gather":
            return None
        size = bucket.data * (bucket.chunks if self.kind == "gather" else 1)
        return torch.empty(size, dtype=bucket.dtype, device=bucket.device)

    def start(self, b: int, bucket: Bucket, send: torch.Tensor) -> tuple[Any, torch.Tensor]:
        op = "max" if bucket.maximum else "sum"
        flat = real_view(send)
        if self.kind == "reduce":
            out = self.ops.all_reduce(flat, op, self.name)
        elif self.kind == "scatter":
            out = self.ops.reduce_scatter_tensor(flat, op, self.world, self.name)
        else:
            out = self.ops.all_gather_into_tensor(flat, self.world, self.name)
        return out, send

    @staticmethod
    def landing(handle: tuple[Any, torch.Tensor]) -> torch.Tensor | None:
        """``None``: a traced collective's values land in a new tensor, ``wait``'s."""
        return None

    def wait(self, handle: tuple[Any, torch.Tensor]) -> torch.Tensor:
        out, send = handle
        out = self.ops.wait_tensor(out)
        if send.is_complex():
            return torch.view_as_complex(out.view(-1, 2))
        return out  # type: ignore[no-any-return]

    @staticmethod
    def read(words: torch.Tensor) -> list[float] | None:
        """Nothing is read back while tracing: the layout was checked then (``_plans``)."""
        return None
