"""One call's buckets through a transport: agree, pack, launch in order, check, finish.

Every collective of fr.distributed is a ``Call`` made from an immutable
``Request`` (the plan of its layout, the group, who calls, whether to check):
it agrees on the layout (eagerly, ``_agree``: a probe on the layout's first
use only; while tracing the plan was checked already), launches the buckets
in order, every rank alike, without waiting on any of them (a gradient step
from backward hooks as buckets fill, the others at once), and finishes:
waits, verifies the words every bucket's results landed with by a
device-side assertion (no host read: ``_flags``), hands out the results as
views. What this rank puts in the buckets is a ``Send`` given with the
launches (its tensors or nothing, the scale of a mean, a weight, the
micro-batches summed so far). The kind (``_wire``) packs and views the
buffers; the transport (``_transport``) starts their collectives: this file
issues none itself.

The failure protocol lives here, once. A rank whose call fails after the
agreement still launches every bucket left, with nothing of its own and
*failed* set (``fail``): every rank's assertion fails where the results
land, every rank then reads the words on the host and raises
together (the failing rank its own error, the others one naming it), in
the same step, and the group stays usable. A rank that must run the call
again another way (a sparse gradient where a dense one was planned) sets
*retry* instead (``retry``): every rank then raises ``Redo`` and runs the
call again on the slow path. ``Announced`` wraps a public function's body:
every ``BaseException`` raised in it is announced to the peers before it
propagates (before the agreement, by meeting the peers' first collective).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, NoReturn

import torch
import torch.distributed as dist

from .._caches import register
from .._torch import assume_constant_result, foreach_add
from . import _carry, _flags
from ._agree import DEBUG_VARIABLE, Known, OwnFailure, agree, announce, debugging, exchange, failure
from ._group import ProtocolError
from ._plans import Plan
from ._transport import Eager, Traced
from ._wire import KINDS, Bucket, Part, replaced

__all__ = ["Announced", "Call", "Redo", "Request", "Send"]

_WIDE = (torch.float32, torch.float64, torch.complex64, torch.complex128)


class Redo(ProtocolError):
    """A rank set *retry*: every rank runs this call again, on the slow path."""


class Request(NamedTuple):
    """One call, all but its data: made once, read only."""

    plan: Plan
    group: Any
    world: int
    caller: str
    check: bool


class Send(NamedTuple):
    """What this rank puts in a call's buckets.

    ``sending``: its tensors (``False``: nothing of its own, as ``broadcast``
    off its source, a ``skip``, a failed rank); ``scale``: what they are
    multiplied by as they are packed (``1 / world`` for a mean, a rank's
    weight); ``weight``: the weight word (a weighted mean's divisor, summed);
    ``acc``: per tensor of the layout, micro-batches' gradients summed so
    far, added in as each bucket is packed, the new ones weighted ``alpha``.
    """

    sending: bool = True
    scale: Any = None
    weight: Any = None
    acc: Sequence[torch.Tensor] | None = None
    alpha: Any = 1.0


def send_of(request: Request, *, weight: Any = None, sending: bool | None = None) -> Send:
    """The plain ``Send`` of a call: its kind's sender, a mean's ``1 / W`` or a weight."""
    options = request.plan.layout.options
    kind = KINDS[options.kind]  # a lookup Dynamo traces (not a property of a constant)
    # a mean divides as it packs; an all-gather's mean is its transpose's: it packs as it is,
    # and, traced, scales its shards' gradient (``AllGather.joined``; eagerly its rules divide)
    mean = options.op == "mean"
    scale = weight if weight is not None else (1.0 / request.world if mean else None)
    own = kind.sends(options) if sending is None else sending
    return Send(own, scale, weight)


_NOTHING = Send(sending=False)
# the debug mode as a trace-time constant: a compiled call probes or not as it was traced
_debugging_now = assume_constant_result(debugging)


class Call:
    """One call of a public function on ``request``'s layout (see the module's text)."""

    __slots__ = (
        "clean",
        "error",
        "joining",
        "kind",
        "launched",
        "layout",
        "pending",
        "probed",
        "rank",
        "redo",
        "request",
        "sent",
        "side",
        "sparse",
        "transport",
    )

    def __init__(self, request: Request) -> None:
        plan = request.plan
        self.request = request
        self.layout = layout = plan.layout
        self.kind = kind = KINDS[layout.wire]  # a lookup Dynamo traces (the carrying kind)
        self.transport: Eager | Traced = (
            Eager(kind, plan.pools, request.group, request.caller)
            if plan.lock is not None
            else Traced(kind, request.group, request.world)
        )
        # eagerly, the layout's clean words as sent and as they land, per bucket (``_words_of``)
        self.clean = _words_of(request) if self.transport.eager else ([], [])
        self.rank = dist.get_rank(request.group) if kind.needs_rank else 0
        self.probed: Any = None  # traced: the probe's zero, which the first words add
        self.error: BaseException | None = None
        self.redo = False
        self.joining: _carry.Joining | None = None
        self.launched = 0
        self.pending: list[Any] = []
        self.sparse: list[tuple[Any, torch.Tensor]] = []
        self.sent: Send | None = None  # what the first bucket carried (its weight word)
        self.side: Any = None  # the weights' own sum, where the first bucket is too narrow for it

    def begin(self, checksums: Any = None) -> None:
        """Agree on the layout: eagerly a probe on its first use (``_agree``); traced, the probe
        that the graph's first bucket waits for (``_store``)."""
        r = self.request
        if not r.check:
            return
        if self.transport.eager:
            agree(self.layout, r.group, r.world, r.caller, checksums, r.plan.dims)
        elif _debugging_now():  # the debug mode: every compiled call probes first
            device = self.layout.buckets[0].device
            self.probed = self.transport.probe(self.layout.fingerprint, device)  # type: ignore[union-attr]

    def launch(self, b: int, parts: Sequence[Part] | None, send: Send) -> None:
        """Bucket ``b`` (the next one), from ``parts`` (one per run) as ``send`` says."""
        if b == 0:
            self.sent = send
        bucket = self.layout.buckets[b]
        words = self._words(b, bucket, send) if bucket.extra else None
        ours = parts
        if parts is not None and send.sending and send.acc is not None:
            ours = _merged(self.layout, b, parts, send)
        if self.transport.eager:  # a pooled buffer, packed (no graph: ``_rules`` keeps it)
            buf = self.transport.send(b, bucket)  # type: ignore[union-attr]
            if ours is None or not send.sending:
                self.kind.fill(bucket, buf)
            else:
                self.kind.pack(bucket, buf, ours, self.rank, send.scale)
            if words is not None:
                self.kind.put_words(bucket, buf, words)
        else:  # one new tensor, in the graph (and in autograd's, where its parts are)
            buf = self.kind.joined(bucket, ours, send, words, self.rank)
        self.pending.append(self.transport.start(b, bucket, buf))
        self.launched += 1

    def launch_rest(
        self,
        parts: Sequence[Sequence[Part] | None],
        send: Send,
        sparse: Sequence[torch.Tensor] = (),
    ) -> None:
        """Every bucket not launched yet, ``parts[b]`` each, and the sparse tensors, in order.

        The sparse tensors go before the last bucket, whose words must come
        last: a failure before it is still announced in them.
        """
        last = len(self.layout.buckets) - 1
        for b in range(self.launched, last):
            self.launch(b, parts[b], send)
        if len(self.sparse) < len(self.layout.sparse):
            self.launch_sparse(sparse, send)
        if self.launched == last:
            self.launch(last, parts[last], send)

    def _words(self, b: int, bucket: Bucket, send: Send) -> torch.Tensor:
        """The words bucket ``b`` ends with (eagerly, a shared tensor where all are clean)."""
        changed: dict[int, float] = {}
        if b == len(self.layout.buckets) - 1:
            if self.error is not None:
                changed[_flags.FAILED] = 1.0
            if self.redo:
                changed[_flags.RETRY] = 1.0
        carried = None
        if b == 0:
            joining = _carry.armed(self.request.group) if self.transport.eager else None
            if joining is not None and self.layout.carries_check(self.request.world):
                if joining.bit:
                    changed[_flags.MORE] = float(joining.bit)
                self.joining = joining
                joining.carrier = Known(self.layout, tuple(self.request.plan.dims))
            if self.layout.options.weighted:
                if bucket.comm in _WIDE:
                    carried = send.weight
                else:  # the first bucket's dtype would round the divisor: on its own, in float64
                    weight = 0.0 if send.weight is None else send.weight
                    t = torch.as_tensor(weight, dtype=torch.float64, device=bucket.device)
                    self.side = self.transport.sum(t.reshape(1))
        if self.transport.eager and not changed and carried is None:
            clean = self.clean[0][b]
            assert clean is not None  # ``_words`` is called for buckets with words only
            return clean
        words = _flags.sent(bucket.extra, self.layout.fingerprint)
        for i, value in changed.items():
            words[i] = value
        out = torch.tensor(words, dtype=bucket.comm, device=bucket.device)
        if carried is not None:
            out[_flags.WEIGHT] = carried
        if b == 0 and self.probed is not None:  # after the probe, in the graph's order
            out = out + self.probed.to(out.dtype)
        return out

    def launch_sparse(self, tensors: Sequence[torch.Tensor], send: Send) -> None:
        """The layout's sparse tensors, one sum each (eagerly only), before the last bucket.

        Each sends a coalesced copy (scaled as the buckets are; nothing of
        this rank's where it does not send).
        """
        empty = not send.sending or self.error is not None or self.redo or not tensors
        if empty:
            tensors = self.request.plan.empty_sparse()
        for t in tensors:
            c = t.coalesce()
            indices, values = c.indices(), c.values()
            if empty:
                indices, values = indices[:, :0], values[:0]
            values = values * send.scale if send.scale is not None else values.clone()
            mine = torch.sparse_coo_tensor(indices.clone(), values, c.shape, is_coalesced=True)
            handle = self.transport.sum(mine)
            # one at a time: gloo's sparse all-reduce writes the sum into ``mine`` from its own
            # thread. The sparse scenarios of tests/test_distributed.py crashed a rank about one
            # run in 40 with heap corruption while several were in flight; the cause was not
            # found, and this guard (cheap: sparse tensors are few) is not proven to remove it
            self.transport.wait(handle)
            self.sparse.append(handle)

    def drain(self) -> None:
        """Launch what is left with nothing of this rank's (the peers' calls go on)."""
        send = _NOTHING if self.sent is None else replaced(self.sent, sending=False, acc=None)
        self.launch_rest([None] * len(self.layout.buckets), send)

    def fail(self, error: BaseException) -> None:
        """This rank's call failed after ``begin``: its peers learn it in this call's words.

        Raises ``OwnFailure`` once every rank knows (the caller raises
        ``error`` itself); the other ranks raise ``PeerFailed`` naming this
        one. While tracing nothing can be announced: it returns.
        """
        if not self.transport.eager or self.launched == len(self.layout.buckets):
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

    def finish(self, local: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
        """The results, one per tensor of the layout (``local``: those that stay as given).

        Bucket by bucket, in launch order: its results' views made while it
        is in flight, wherever it is known where its values will land (they
        read none: no time after the collective; eagerly only: traced, views
        made before ``land`` writes their base would break autograd's rule
        for views of a base modified in place), then waited for, landed, and
        its buffers let go before the next is waited for (a reduce-scatter's
        send buffer holds every rank's rows: the buckets' together, a whole
        gradient). Every rank then verifies the words its buckets landed with
        (``_verdict``): *failed* set, every rank raises (``failure``); *retry*
        set, every rank raises ``Redo``; another layout on some rank, every
        rank raises ``Mismatch`` naming the difference.
        """
        t, kind, rank = self.transport, self.kind, self.rank
        weighted = self.layout.options.weighted
        total: Any = None
        same: Any = None  # eagerly: whether every bucket's words so far are the clean ones
        landed: list[torch.Tensor] = []  # traced: every bucket's (checked together at the end)
        last: torch.Tensor | None = None  # eagerly: the last bucket's (its words name a failure)
        out: list[torch.Tensor] = []
        for b, bucket in enumerate(self.layout.buckets):
            res = t.result(b, bucket)
            where = res if res is not None else t.landing(self.pending[b])
            early = None if where is None or not t.eager else kind.views(bucket, where, rank)
            got = t.wait(self.pending[b])
            self.pending[b] = None  # landed: the collective's buffers are ours to let go
            if t.eager:
                same, last = self._words_agree(b, bucket, got, same), got
            else:
                landed.append(got)
            if weighted and b == 0:
                total = self._total(got)
            buf = kind.land(bucket, got, res, rank)
            if weighted and self.transport.eager:
                _divide(buf[: bucket.data], total)
            elif weighted:  # traced: a new buffer, in autograd's graph
                buf = torch.where(total == 0, torch.zeros_like(buf), buf / total)  # type: ignore[arg-type, operator]
            out += early if early is not None else kind.views(bucket, buf, rank)
            t.let_go(b)
        sparse = [t.wait(h) for h in self.sparse] if self.sparse else []
        if last is not None:
            self._verdict(same, last)
        elif landed:
            self._traced_verdict(landed)
        if weighted and sparse:  # sparse tensors are waited for one by one already (``launch_sparse``)
            scalar = float(total)
            sparse = [s / scalar if scalar else s * 0 for s in sparse]
        return self.request.plan.reorder(out + sparse + list(local))

    def _words_agree(self, b: int, bucket: Bucket, landed: torch.Tensor, same: Any) -> Any:
        """``same``, and whether bucket ``b`` landed with the clean words (on the device); the
        first bucket's *more* bit settles a ``join`` loop's (a tensor until the loop reads it)."""
        if b == 0 and self.joining is not None:
            self.joining.settle(self.kind.words_of(bucket, landed)[_flags.MORE].clone())
        want = self.clean[1][b]
        if want is None:
            return same
        now = torch.eq(self.kind.words_of(bucket, landed)[-_flags.CHECK :], want).all()
        return now if same is None else same.logical_and_(now)

    def _verdict(self, same: Any, last: torch.Tensor) -> None:
        """Every rank checks the words its buckets landed with (``same``), on the device; raise
        together.

        The words land the same on every rank, so every rank's assertion
        passes or fails alike: only then are they read on the host (the last
        bucket's, ``last``), to name what went wrong (``_named``).
        """
        if self.error is not None:
            self._named(last)
        if same is None:  # no bucket carries words
            return
        try:  # on a CUDA device, asynchronous: a failure surfaces at the next synchronisation
            caller = self.request.caller
            message = _DIFFERENT.get(caller)
            if message is None:
                message = _DIFFERENT[caller] = _different(caller)
            torch._assert_async(same, message)
        except RuntimeError:  # raised by the assertion alone: the words differ from clean ones
            self._named(last)

    def _traced_verdict(self, landed: Sequence[torch.Tensor]) -> None:
        """The same check in the graph: a device-side assertion on the landed words.

        A compiled call cannot exchange descriptions, so the error says what
        happened and how to have it named (the debug mode's probe, which
        checks before the data moves).
        """
        layout, world, caller = self.layout, self.request.world, self.request.caller
        bad: Any = None
        for b, bucket in enumerate(layout.buckets):
            if not bucket.extra:
                continue
            got = self.kind.words_of(bucket, landed[b])[-_flags.CHECK :]
            want = _flags.expected(
                bucket.extra, layout.fingerprint, world, self.kind.words_max(bucket)
            )
            differs = torch.ne(got, torch.tensor(want, dtype=got.dtype, device=got.device)).any()
            bad = differs if bad is None else bad | differs
        torch._assert_async(~bad, _different(caller))

    def _named(self, landed: torch.Tensor) -> NoReturn:
        """Raise, on every rank together, what the landed words say (the last bucket's,
        ``landed``; read on the host)."""
        t, kind, r = self.transport, self.kind, self.request
        last = t.read(kind.words_of(self.layout.buckets[-1], landed))
        assert last is not None
        if last[_flags.FAILED] or self.error is not None:
            failure(r.group, r.caller, self.error)
        if last[_flags.RETRY]:
            raise Redo
        exchange(self.layout, r.group, r.caller)

    def _total(self, first: torch.Tensor) -> Any:
        """The summed weights, a tensor (never read on the host; ``first``: the first bucket's
        landed buffer, whose words carry them unless too narrow)."""
        if self.side is not None:
            total = self.transport.wait(self.side)[0]
        else:
            total = self.kind.words_of(self.layout.buckets[0], first)[_flags.WEIGHT]
        return total.real if total.is_complex() else total


# eagerly, each caller's message made once (the assertion takes it at every call)
_DIFFERENT: dict[str, str] = {}


def _different(caller: str) -> str:
    """The device-side assertion's message: raised as it is where the words cannot be read
    (compiled, or on a CUDA device, at the next synchronisation)."""
    return (
        f"{caller}: the ranks ran different calls here (another layout or collective on some "
        "rank, or a rank's failure); every rank raises. Set "
        f"{DEBUG_VARIABLE}=DETAIL on every rank to check every call before its data moves, "
        "naming the difference"
    )


def _merged(layout: Any, b: int, parts: Sequence[Part], send: Send) -> Sequence[Part]:
    """``parts`` plus the micro-batches' sums so far (an accumulated step's last bucket)."""
    assert send.acc is not None
    out: list[Part] = []
    bucket = layout.buckets[b]
    i = 0
    for run, part in zip(bucket.runs, parts):
        acc = [send.acc[k] for k in bucket.members[i : i + run.n]]
        i += run.n
        if isinstance(part, torch.Tensor):
            out.append(torch.stack(acc).add_(part, alpha=send.alpha))
        else:
            out.append(foreach_add(acc, part, alpha=send.alpha))
    return out


_WORDS: dict[tuple[int, int], tuple[list[torch.Tensor | None], list[torch.Tensor | None]]] = {}
register(_WORDS.clear)


def _words_of(
    request: Request,
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """A layout's clean words as this rank sends them, and the check of each as it lands, per
    bucket (``None``: no words): made once per layout, only ever copied from."""
    layout = request.plan.layout
    key = (layout.fingerprint, request.world)
    got = _WORDS.get(key)
    if got is None:
        sent: list[torch.Tensor | None] = []
        wants: list[torch.Tensor | None] = []
        for bucket in layout.buckets:
            if not bucket.extra:
                sent.append(None)
                wants.append(None)
                continue
            dtype, device = bucket.comm, bucket.device
            words = _flags.sent(bucket.extra, layout.fingerprint)
            sent.append(torch.tensor(words, dtype=dtype, device=device))
            maximum = layout.kind.words_max(bucket)
            want = _flags.expected(bucket.extra, layout.fingerprint, request.world, maximum)
            wants.append(torch.tensor(want, dtype=dtype, device=device))
        got = _WORDS[key] = (sent, wants)
        while len(_WORDS) > 64:
            del _WORDS[next(iter(_WORDS))]
    return got


def _divide(data: torch.Tensor, total: torch.Tensor) -> None:
    """A weighted mean's last step: the sums divided by the summed weights (zeros for none),
    on the device (nothing read on the host)."""
    with torch.no_grad():
        data.copy_(torch.where(total == 0, torch.zeros_like(data), data / total))


class Announced:
    """Around a public function's body: any ``BaseException`` raised in it is announced, then raised.

    ``scope.call`` is the body's ``Call`` once it exists (``None`` before):
    from then on a failure drains it (``Call.fail``); before, the rank meets
    its peers' first collective (``_agree.announce``). Errors of the protocol
    pass as they are: every rank raises them already. While tracing nothing
    can be announced. The one place where a failure is announced.
    """

    __slots__ = ("call", "caller", "group", "known", "world")

    def __init__(self, group: Any, world: int, caller: str, known: Known | None = None) -> None:
        self.group = group
        self.world = world
        self.caller = caller
        self.known = known  # the call the peers run next, where the body knows it
        self.call: Call | None = None

    def __enter__(self) -> Announced:
        return self

    def _drain(self, known: Known, error: BaseException) -> None:
        """Fail a call of ``known``'s layout: every bucket sent with nothing of this rank's."""
        plan = Plan(known.layout, None, None, eager=True, pooled=False, dims=known.dims)
        call = Call(Request(plan, self.group, self.world, self.caller, False))
        call.fail(error)

    def __exit__(self, kind: Any, err: BaseException | None, tb: Any) -> None:
        if err is None or isinstance(err, ProtocolError) or torch.compiler.is_compiling():
            return
        try:
            if self.call is not None:
                self.call.fail(err)
            else:
                announce(self.group, self.world, self.caller, err, self._drain, self.known)
        except OwnFailure:
            pass
