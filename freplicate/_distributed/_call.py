"""One call's buckets through a transport: agree, pack, launch in order, check, finish.

Every public function of fr.distributed is a ``Call`` on a plan: it agrees
on the layout (eagerly, ``_agree``; while tracing the plan was checked
already), launches the buckets in order, every rank alike (a gradient step
from backward hooks as buckets fill, the others at once), and finishes:
waits, reads the last bucket's words, hands out the results as views.

The failure protocol lives here, once. A rank whose call fails after the
agreement still launches every bucket left, with nothing of its own and
*failed* set (``fail``): every rank reads the word at the end and raises
together (the failing rank its own error, the others one naming it), in
the same step, and the group stays usable. A rank that must run the call
again another way (a sparse gradient where a dense one was planned) sets
*retry* instead (``retry``): every rank then raises ``Redo`` and runs the
call again on the slow path. ``announced`` wraps a public function's body:
every ``BaseException`` raised in it is announced to the peers before it
propagates (before the agreement, by meeting the peers' first collective).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from .._caches import register
from .._torch import foreach_add
from . import _carry, _flags
from ._agree import OwnFailure, agree, announce, exchange, failure, record
from ._copy import Part, fill, joined, land, pack, put_words, views, words_of
from ._group import ProtocolError, collective
from ._plans import Plan
from ._transport import Eager, Traced

__all__ = ["Announced", "Call", "Redo"]

_WIDE = (torch.float32, torch.float64, torch.complex64, torch.complex128)


class Redo(ProtocolError):
    """A rank set *retry*: every rank runs this call again, on the slow path."""


class Call:
    """One call of a public function over ``plan``'s layout (see the module's text).

    ``sending``: this rank sends its tensors (``False``: ``broadcast`` off
    its source, a ``skip``); ``scale``: what they are multiplied by as they
    are packed (``1 / world`` for a mean, a rank's weight); ``weight``: the
    weight word (a weighted mean's divisor, summed); ``acc``: per tensor of
    the layout, micro-batches' gradients summed so far, added in as each
    bucket is packed (``alpha``: the weight they come in with).
    """

    __slots__ = (
        "acc",
        "alpha",
        "caller",
        "check",
        "error",
        "fast",
        "group",
        "joining",
        "kind",
        "launched",
        "layout",
        "pending",
        "plan",
        "rank",
        "redo",
        "scale",
        "sending",
        "side",
        "sparse",
        "transport",
        "weight",
        "world",
    )

    def __init__(
        self,
        plan: Plan,
        group: Any,
        world: int,
        caller: str,
        *,
        check: bool,
        sending: bool = True,
        weight: Any = None,
    ) -> None:
        self.plan = plan
        self.layout = layout = plan.layout
        self.kind = layout.options.kind
        self.group = group
        self.world = world
        self.caller = caller
        self.check = check
        self.sending = sending
        self.transport: Eager | Traced = (
            Eager(self.kind, plan.pools, group, caller)
            if plan.lock is not None
            else Traced(self.kind, group, world)
        )
        self.rank = dist.get_rank(group) if self.kind != "reduce" else 0
        self.weight = weight
        mean = layout.options.op == "mean" and self.kind != "gather"
        self.scale: Any = weight if weight is not None else (1.0 / world if mean else None)
        self.acc: Sequence[torch.Tensor] | None = None
        self.alpha: Any = 1.0
        self.fast = False
        self.error: BaseException | None = None
        self.redo = False
        self.joining: _carry.Joining | None = None
        self.launched = 0
        self.pending: list[Any] = []
        self.sparse: list[tuple[torch.Tensor, Any]] = []
        self.side: Any = None  # the weights' own sum, where the first bucket is too narrow for it

    @property
    def eager(self) -> bool:
        return self.transport.eager

    def begin(self, checksums: Any = None) -> None:
        """Agree on the layout (eagerly, with the check): the fast path, or a verdict now."""
        if self.eager and self.check:
            self.fast = agree(self.layout, self.group, self.world, self.caller, checksums)

    def launch(self, b: int, parts: Sequence[Part] | None) -> None:
        """Bucket ``b`` (the next one), from ``parts`` (one per run), or nothing of ours (``None``)."""
        if b == 1 and self.fast:
            self._confirm()  # no second bucket before every rank is known to run this layout
        bucket = self.layout.buckets[b]
        t = self.transport
        send = t.send(b, bucket)
        ours = None if parts is None or not self.sending else self._merged(b, parts)
        if send is None:  # a traced reduction: its buffer made of its parts
            words = self._words(b, bucket) if bucket.extra else None
            send = joined(bucket, ours, self.scale, words)
        else:
            if ours is None:
                fill(self.kind, bucket, send)
            else:
                pack(self.kind, bucket, send, ours, self.rank, self.scale)
            if bucket.extra:
                put_words(self.kind, bucket, send, self._words(b, bucket))
        self.pending.append(t.start(b, bucket, send))
        self.launched += 1

    def launch_rest(
        self, parts: Sequence[Sequence[Part] | None], sparse: Sequence[torch.Tensor] = ()
    ) -> None:
        """Every bucket not launched yet, ``parts[b]`` each, and the sparse tensors, in order.

        The sparse tensors go before the last bucket, whose words must come
        last: a failure before it is still announced in them.
        """
        last = len(self.layout.buckets) - 1
        for b in range(self.launched, last):
            self.launch(b, parts[b])
        if len(self.sparse) < len(self.layout.sparse):
            self.launch_sparse(sparse)
        if self.launched == last:
            self.launch(last, parts[last])

    def _merged(self, b: int, parts: Sequence[Part]) -> Sequence[Part]:
        """``parts`` plus the micro-batches' sums so far (an accumulated step's last bucket)."""
        if self.acc is None:
            return parts
        out: list[Part] = []
        members = self.layout.buckets[b].members
        i = 0
        for run, part in zip(self.layout.buckets[b].runs, parts):
            acc = [self.acc[k] for k in members[i : i + run.n]]
            i += run.n
            if isinstance(part, torch.Tensor):
                out.append(torch.stack(acc).add_(part, alpha=self.alpha))
            else:
                out.append(foreach_add(acc, part, alpha=self.alpha))
        return out

    def _words(self, b: int, bucket: Any) -> torch.Tensor:
        """The words bucket ``b`` ends with (eagerly, a shared tensor where all are clean)."""
        changed: dict[int, float] = {}
        if b == len(self.layout.buckets) - 1:
            if self.error is not None:
                changed[_flags.FAILED] = 1.0
            if self.redo:
                changed[_flags.RETRY] = 1.0
        carried = None
        if b == 0:
            joining = _carry.armed(self.group) if self.eager else None
            if joining is not None and self.layout.speculates(self.world):
                if joining.bit:
                    changed[_flags.MORE] = float(joining.bit)
                self.joining = joining
            if self.weight is not None:
                if bucket.comm in _WIDE:
                    carried = self.weight
                else:
                    self._weigh_aside(bucket)
        if self.eager and not changed and carried is None:
            return _clean_words(bucket.extra, bucket.comm, bucket.device)
        words = _flags.clean(bucket.extra)
        for i, value in changed.items():
            words[i] = value
        out = torch.tensor(words, dtype=bucket.comm, device=bucket.device)
        if carried is not None:
            out[_flags.WEIGHT] = carried
        return out

    def _weigh_aside(self, bucket: Any) -> None:
        """The weight on its own, in float64: the first bucket's dtype would round the divisor."""
        t = torch.as_tensor(self.weight, dtype=torch.float64, device=bucket.device).reshape(1)
        self.side = _sum(t, self.transport, self.group, self.caller)

    def launch_sparse(self, tensors: Sequence[torch.Tensor]) -> None:
        """The layout's sparse tensors, one all-reduce each (eagerly only), before the last bucket.

        Each sends a coalesced copy (scaled as the buckets are; nothing of
        this rank's where it does not send): gloo sums sparse tensors of any
        number of entries into it, in place.
        """
        if self.fast and self.launched:
            self._confirm()  # nothing more before every rank is known to run this layout
        empty = not self.sending or self.error is not None or self.redo or not tensors
        if empty:
            tensors = self.plan.empty_sparse()
        for t in tensors:
            c = t.coalesce()
            indices, values = c.indices(), c.values()
            if empty:
                indices, values = indices[:, :0], values[:0]
            values = values * self.scale if self.scale is not None else values.clone()
            mine = torch.sparse_coo_tensor(indices.clone(), values, c.shape, is_coalesced=True)
            with collective(self.caller):
                work = dist.all_reduce(mine, group=self.group, async_op=True)
            self.sparse.append((mine, work))

    def drain(self) -> None:
        """Launch what is left with nothing of this rank's (the peers' calls go on)."""
        self.launch_rest([None] * len(self.layout.buckets))

    def fail(self, error: BaseException) -> None:
        """This rank's call failed after ``begin``: its peers learn it in this call's words.

        Raises ``OwnFailure`` once every rank knows (the caller raises
        ``error`` itself); the other ranks raise ``PeerFailed`` naming this
        one. While tracing nothing can be announced: it returns.
        """
        if not self.eager or self.launched == len(self.layout.buckets):
            return  # nothing left to carry the word: the peers have their results already
        self.error = error
        self.drain()
        self.finish()

    def retry(self) -> NoReturn:
        """This rank must run the call again another way: every rank raises ``Redo``."""
        self.redo = True
        self.drain()
        self.finish()
        raise AssertionError("a retry without Redo")  # pragma: no cover - finish raised

    def _confirm(self) -> None:
        """The fast path's check: the first bucket's words, back before anything else starts."""
        self.fast = False
        landed = self.transport.wait(self.pending[0])
        words = self.transport.read(words_of(self.kind, self.layout.buckets[0], landed))
        assert words is not None
        if words[_flags.OFF] or words[_flags.FAILED]:
            exchange(self.layout, self.group, self.caller, self.error)
        record(self.layout, self.group)

    def finish(self, local: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
        """The results, one per tensor of the layout (``local``: those that stay as given).

        Every rank reads the last bucket's words: *failed* set, every rank
        raises (``failure``); *retry* set, every rank raises ``Redo``.
        """
        t = self.transport
        buckets = self.layout.buckets
        # the results' views first, while the buckets are in flight, wherever it is known
        # where their values will land (they read none): no time after the collectives
        res = [t.result(b, bucket) for b, bucket in enumerate(buckets)]
        where = [r if r is not None else t.landing(h) for r, h in zip(res, self.pending)]
        early = [
            None if w is None else views(self.kind, bucket, w, self.rank)
            for bucket, w in zip(buckets, where)
        ]
        if self.fast:
            self._confirm()
        landed = [t.wait(h) for h in self.pending]
        for _, work in self.sparse:
            with collective(self.caller):
                work.wait()
        if landed and t.eager:
            last = t.read(words_of(self.kind, buckets[-1], landed[-1]))
            assert last is not None
            if last[_flags.FAILED] or self.error is not None:
                failure(self.group, self.caller, self.error)
            if last[_flags.RETRY]:
                raise Redo
            if self.joining is not None:
                first = t.read(words_of(self.kind, buckets[0], landed[0]))
                assert first is not None
                self.joining.settle(first[_flags.MORE] != 0)
        out: list[torch.Tensor] = []
        for b, bucket in enumerate(buckets):
            buf = land(self.kind, bucket, landed[b], res[b])
            if self.weight is not None:
                _divide(buf[: bucket.data] if self.kind != "gather" else buf, self._total(landed))
            got = early[b]
            out += got if got is not None else views(self.kind, bucket, buf, self.rank)
        sparse = [mine for mine, _ in self.sparse]
        if self.weight is not None and sparse:
            total = self._total(landed)
            sparse = [s / total if total else s * 0 for s in sparse]
        return self.plan.reorder(out + sparse + list(local))

    def _total(self, landed: Sequence[torch.Tensor]) -> Any:
        """The summed weights: read eagerly, a tensor while tracing."""
        if self.side is not None:
            total = self.transport.wait(self.side)[0]
        else:
            total = words_of(self.kind, self.layout.buckets[0], landed[0])[_flags.WEIGHT]
        total = total.real if total.is_complex() else total
        return float(total) if self.eager else total


_CLEAN: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}
register(_CLEAN.clear)


def _clean_words(extra: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``_flags.clean(extra)`` as a tensor, made once per kind (only ever copied from)."""
    key = (extra, dtype, device)
    words = _CLEAN.get(key)
    if words is None:
        words = _CLEAN[key] = torch.tensor(_flags.clean(extra), dtype=dtype, device=device)
    return words


def _sum(t: torch.Tensor, transport: Eager | Traced, group: Any, caller: str) -> Any:
    """Start a sum of ``t`` over the group through ``transport``'s kind of collective."""
    if isinstance(transport, Traced):
        return transport.ops.all_reduce(t, "sum", transport.name), t
    with collective(caller):
        return dist.all_reduce(t, group=group, async_op=True), t


def _divide(data: torch.Tensor, total: Any) -> None:
    """A weighted mean's last step: the sums divided by the summed weights (zeros for none)."""
    with torch.no_grad():
        if isinstance(total, float):
            if total:
                data.div_(total)
            else:
                data.zero_()
        else:
            data.copy_(torch.where(total == 0, torch.zeros_like(data), data / total))


class Announced:
    """Around a public function's body: any ``BaseException`` raised in it is announced, then raised.

    ``scope.call`` is the body's ``Call`` once it exists (``None`` before):
    from then on a failure drains it (``Call.fail``); before, the rank meets
    its peers' first collective (``_agree.announce``). Errors of the protocol
    pass as they are: every rank raises them already. While tracing nothing
    can be announced. The one place where a failure is announced.
    """

    __slots__ = ("call", "caller", "group", "world")

    def __init__(self, group: Any, world: int, caller: str) -> None:
        self.group = group
        self.world = world
        self.caller = caller
        self.call: Call | None = None

    def __enter__(self) -> Announced:
        return self

    def __exit__(self, kind: Any, err: BaseException | None, tb: Any) -> None:
        if err is None or isinstance(err, ProtocolError) or torch.compiler.is_compiling():
            return
        try:
            if self.call is not None:
                self.call.fail(err)
            else:
                announce(self.group, self.world, self.caller, err)
        except OwnFailure:
            pass
