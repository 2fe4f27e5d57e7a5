"""Transports: how a bucket's flat buffer goes through its collective, eagerly or traced.

Everything above this file is written once; here is the choice between the
two ways to run it (torchopt's ``accelerated_op`` shape: two backends, one
interface, call sites written once). The kind (``_wire``) says what its
buffers are and which collective moves them; a transport says where the
buffers come from and how the collective runs:

* ``Eager``: ``torch.distributed``'s asynchronous collectives on buffers
  taken from pools (a pool hands a buffer out again only once no result
  views it, so results of successive calls never alias, and a training loop
  reuses two buffers instead of paying a large allocation every step); the
  flag words are read back to the host.
* ``Traced``, while ``torch.compile`` traces: the functional collectives
  (``torch.ops._c10d_functional``), which Dynamo writes into the graph, on
  fresh buffers; nothing is read back (the layout was checked while tracing,
  see ``_plans``).

Besides the buckets, a transport starts the two other collectives a call may
need: a sparse tensor's all-reduce (eagerly only) and a weighted mean's sum
of weights where the first bucket is too narrow to carry it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .._torch import functional_collectives, storage_use_count
from ._group import collective, comm_error
from ._wire import Bucket, Kind, real_view

__all__ = ["Eager", "Pool", "Pools", "Traced"]


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

    Their sizes are the kind's (``Kind.sizes``): a buffer that results view
    is kept while they live (``keep=3``); one that only carries the
    collective is the bucket's own (``keep=1``).
    """

    __slots__ = ("recv", "res", "send")

    def __init__(self, bucket: Bucket, kind: Kind, *, kept: bool = True) -> None:
        sizes = kind.sizes(bucket, lean=not kept)
        dev = bucket.device
        # ``kept=False`` (ZeRO-3's units, where memory is the point): every buffer fresh and let
        # go with the collective or its results, as FSDP2's are (none idle between the units or
        # the steps: its peak heap on a 24M-parameter Llama 0.99 of FSDP2's, 1.10 with two send
        # buffers of each size kept; 4% slower a step on gloo; benchmarks/bench_shard.py)
        at_most = 1 if kept else 0
        self.send = Pool(sizes.send, bucket.comm, dev, keep=sizes.send_kept * at_most)
        self.recv = None
        if sizes.recv is not None:
            self.recv = Pool(sizes.recv, bucket.comm, dev, keep=sizes.recv_kept * at_most)
        self.res = None if sizes.res is None else Pool(sizes.res, bucket.dtype, dev, keep=3 * at_most)

    def clear(self) -> None:
        """Let go of every buffer (results still held keep theirs alive, as any tensor)."""
        for pool in (self.send, self.recv, self.res):
            if pool is not None:
                pool.entries = []


class Eager:
    """torch.distributed's collectives on pooled buffers, their flag words read back."""

    eager = True

    def __init__(self, kind: Kind, pools: list[Pools], group: Any, caller: str) -> None:
        self.kind = kind
        self.pools = pools
        # the default group resolved once: torch's collectives look it up at every call else
        self.group = dist.group.WORLD if group is None else group
        self.caller = caller
        # per bucket, an empty view of each buffer it took: busy for the pools until it lands
        self.held: dict[int, list[torch.Tensor]] = {}

    def _take(self, b: int, pool: Pool) -> torch.Tensor:
        buf = pool.take()
        self.held.setdefault(b, []).append(buf[:0])
        return buf

    def send(self, b: int, bucket: Bucket) -> torch.Tensor:
        """The buffer bucket ``b`` is packed into (its chunks, in the bucket's comm dtype)."""
        buf = self.pools[b].send.take()  # ``_take``, written out: it runs for every bucket
        self.held.setdefault(b, []).append(buf[:0])
        return buf

    def result(self, b: int, bucket: Bucket) -> torch.Tensor | None:
        """Where bucket ``b``'s results live, unless they view the landed buffer (``None``)."""
        pool = self.pools[b].res
        return None if pool is None else self._take(b, pool)

    def let_go(self, b: int) -> None:
        """Bucket ``b`` landed: its buffers stay busy for their pools only while its results
        view them (a send buffer they do not view is free again, or gone if not pooled)."""
        self.held.pop(b, None)

    def start(self, b: int, bucket: Bucket, send: torch.Tensor) -> tuple[Any, torch.Tensor]:
        pool = self.pools[b].recv
        recv = None if pool is None else self._take(b, pool)
        work = self.kind.start(send, recv, bucket.maximum, self.group, self.caller)
        return work, send if recv is None else recv

    @staticmethod
    def landing(handle: tuple[Any, torch.Tensor]) -> torch.Tensor | None:
        """The buffer a started collective's values land in (known before they do)."""
        return handle[1]

    def wait(self, handle: tuple[Any, torch.Tensor]) -> torch.Tensor:
        """The landed buffer: the sum (reduce), this rank's chunk (scatter), every chunk (gather)."""
        work, recv = handle
        try:
            work.wait()
        except Exception as err:
            raise comm_error(self.caller, err)  # noqa: B904 - comm_error chains it
        return recv

    @staticmethod
    def read(words: torch.Tensor) -> list[float] | None:
        """The words' values on the host."""
        return (words.real if words.is_complex() else words).tolist()  # type: ignore[no-any-return]

    def sum(self, t: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """Start a sum of ``t`` over the group, into it: a weighted mean's weights, or a sparse
        tensor (gloo sums sparse tensors of any number of entries)."""
        with collective(self.caller):
            return dist.all_reduce(t, group=self.group, async_op=True), t


class Traced:
    """The functional collectives, which Dynamo traces into the graph, on fresh buffers."""

    eager = False

    def __init__(self, kind: Kind, group: Any, world: int) -> None:
        pg = dist.group.WORLD if group is None else group
        self.kind = kind
        self.name = pg.group_name  # type: ignore[union-attr]
        self.world = world
        self.ops = functional_collectives()

    def result(self, b: int, bucket: Bucket) -> torch.Tensor | None:
        size = self.kind.sizes(bucket).res
        return None if size is None else torch.empty(size, dtype=bucket.dtype, device=bucket.device)

    def let_go(self, b: int) -> None:
        """Nothing to let go: a traced call's buffers are the graph's."""

    def start(self, b: int, bucket: Bucket, send: torch.Tensor) -> tuple[Any, torch.Tensor]:
        flat = real_view(send)
        return self.kind.start_traced(self.ops, flat, bucket.maximum, self.world, self.name), send

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

    def sum(self, t: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """A traced sum of ``t`` over the group (sparse tensors are refused while tracing)."""
        return self.ops.all_reduce(t, "sum", self.name), t

    def probe(self, fingerprint: int, device: torch.device) -> torch.Tensor:
        """The layout's probe, in the graph: a zero the first bucket's words depend on, or the
        eager protocol's error on every rank where the ranks run different layouts (the op is
        ``_ops``', defined while the call's layout was planned)."""
        words = torch.tensor([fingerprint, -fingerprint, 0, 0], dtype=torch.int64, device=device)
        landed = self.ops.wait_tensor(self.ops.all_reduce(words, "max", self.name))
        return torch.ops.freplicate.verify_layout(landed, fingerprint, self.name)  # type: ignore[no-any-return]
