"""The cross-rank agreement on a call's layout, eagerly, and the exchange that names what went wrong.

Every call checks its layout across ranks, so trees that differ, or ranks
that call different functions, raise ``ValueError`` on every rank instead of
hanging, aborting or reducing garbage. Each group remembers the layouts all
its ranks ran (``KNOWN`` of them) and which one followed which; the call
predicted next (the *expected* layout) takes the fast path, its check riding
in the first bucket's flag words, at no collective of its own. Every other
call first *mirrors* the expected layout's first collective (same kind,
size, dtype and op), so that a rank on the fast path and a rank on anything
else always meet in a collective of one shape (gloo aborts the process when
two collectives of different sizes meet): the words then tell every rank
what happened. A layout no rank ran before costs one more small collective,
the *probe*, which also compares a checksum of the parameters a gradient
step differentiates (forgetting ``fr.distributed.broadcast`` at the start).

Whatever went wrong (a mismatch, a rank whose call failed) is then named in
one exchange (``exchange``), in which every rank sends either its layout's
description or its error: every rank raises, the same step, and the group
stays usable. The traced path checks layouts while tracing instead
(``_store``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, NoReturn

import torch
import torch.distributed as dist

from . import _flags
from ._group import ProtocolError, collective, comm_device, group_key
from ._layout import First, Layout, difference

__all__ = [
    "Mismatch",
    "OwnFailure",
    "PeerFailed",
    "agree",
    "announce",
    "exchange",
    "record",
    "sparse_gradients",
]

# the probe of a rank that announces a failure: no fingerprint equals it
_FAILED_PROBE = 2**63 - 1


class Mismatch(ProtocolError, ValueError):
    """The ranks' layouts, options or calls differ (raised on every rank, naming the difference)."""


class PeerFailed(ProtocolError, RuntimeError):
    """Another rank's call failed; this rank's call was abandoned with it (no result)."""


class OwnFailure(ProtocolError):
    """Raised on the failing rank once its peers know; its caller raises its own error."""


class Agreed(NamedTuple):
    """A layout every rank of a group is known to have run: its fingerprint, its first collective."""

    fingerprint: int
    first: First


class _History:
    """What every rank of a group knows in common: the layouts run together, which followed which.

    Identical on every rank: it changes only after a collective verdict
    (``record``). ``known``: the last ``KNOWN`` layouts, most recent first;
    ``after``: the layout that followed each of them last time; ``last``:
    the latest; ``sparse``: the gradient layouts whose gradients came out
    sparse, and which (a step reduces those after the backward pass).
    """

    __slots__ = ("__weakref__", "after", "known", "last", "sparse")

    def __init__(self) -> None:
        self.known: list[Agreed] = []
        self.after: dict[int, int] = {}
        self.last: int | None = None
        self.sparse: dict[int, dict[int, int]] = {}

    def expected(self) -> Agreed | None:
        """The layout predicted for the next call: what followed the latest last time, or it."""
        if self.last is None:
            return None
        want = self.after.get(self.last, self.last)
        for entry in self.known:
            if entry.fingerprint == want:
                return entry
        return self.known[0] if self.known else None


# Per process group, weakly keyed: a destroyed group's history goes with it. Tiny (fingerprints
# and shapes), and never cleared by fr.clear_caches: a rank that forgot it would take another
# path through the protocol than its peers.
_HISTORY: weakref.WeakKeyDictionary[Any, _History] = weakref.WeakKeyDictionary()


def _history(group: Any) -> _History:
    key = group_key(group)
    history = _HISTORY.get(key)
    if history is None:
        history = _HISTORY[key] = _History()
    return history


def sparse_gradients(group: Any) -> dict[int, dict[int, int]]:
    """The gradient layouts whose gradients are sparse, the same on every rank.

    Keyed by the layout's fingerprint: the positions of its sparse gradients
    among its leaves, each with its number of sparse dimensions.
    """
    return _history(group).sparse


def record(layout: Layout, group: Any) -> None:
    """Every rank ran ``layout`` together: remember it as the latest, after the one before."""
    first = layout.first
    history = _history(group)
    fingerprint = layout.fingerprint
    if history.last is not None:
        history.after[history.last] = fingerprint
    history.last = fingerprint
    known = [Agreed(fingerprint, first)]
    known += [e for e in history.known if e.fingerprint != fingerprint][: _flags.KNOWN - 1]
    history.known = known
    kept = {e.fingerprint for e in known}
    history.after = {k: v for k, v in history.after.items() if k in kept}


def agree(
    layout: Layout,
    group: Any,
    world: int,
    caller: str,
    checksums: Callable[[], list[int]] | None = None,
) -> bool:
    """The cross-rank layout check before a call's first bucket; ``True``: the fast path.

    On the fast path (``layout`` is the expected one) nothing is sent here:
    the first bucket carries ``[off 0, on 1, ...]`` and the call reads them
    back before its second bucket starts (or before returning), then
    ``record``s itself. Any other call mirrors the expected layout's first
    collective with ``[off 1, on 0, ...]`` and, per known layout, 0 if it
    runs that one, else 1; every rank reads the same sums. *on* set: some
    rank is on the fast path, so every rank names the difference together.
    Else a known layout's word still 0: every rank runs that one, done.
    Else the probe (``checksums``: of the differentiated parameters, compared too).
    """
    history = _history(group)
    expected = history.expected()
    speculates = layout.speculates(world)
    if expected is not None:
        if speculates and expected.fingerprint == layout.fingerprint:
            return True
        on_known = -1
        if speculates:
            for j, entry in enumerate(history.known):
                if entry.fingerprint == layout.fingerprint:
                    on_known = j
        words = _mirror(expected.first, on_known=on_known, failed=False, group=group, caller=caller)
        if words[_flags.ON] or words[_flags.FAILED]:
            exchange(layout, group, caller)  # someone ran the expected layout, or failed
        if on_known >= 0 and words[_flags.KNOWN_AT + on_known] == 0:  # everyone runs it
            record(layout, group)
            return False
    _probe(layout, group, caller, checksums)
    if speculates:
        record(layout, group)
    return False


def _probe(
    layout: Layout, group: Any, caller: str, checksums: Callable[[], list[int]] | None
) -> None:
    """The fingerprint (and a checksum of the parameters), MAX-reduced with their negations."""
    sums = checksums() if checksums is not None else []
    total = hash(tuple(sums)) >> 1 if sums else 0
    words = [layout.fingerprint, -layout.fingerprint, total, -total]
    t = torch.tensor(words, dtype=torch.int64, device=comm_device(group))
    with collective(caller):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    got = t.tolist()
    if got[:2] != words[:2]:
        exchange(layout, group, caller)  # every rank saw the difference: all take this path
    if got[2:] != words[2:]:
        _different_values(layout, group, caller, sums)


def _different_values(layout: Layout, group: Any, caller: str, sums: Sequence[int]) -> NoReturn:
    """The differentiated parameters differ across ranks: name the first leaf that does."""
    everyone = _everyone(list(sums), group, caller)
    if len({len(e) for e in everyone}) > 1:  # ranks differentiating different trees
        exchange(layout, group, caller)
    paths = layout.description[0]
    for k, i in enumerate(layout.unique):
        mine = everyone[0][k]
        for r, theirs in enumerate(everyone[1:], start=1):
            if theirs[k] != mine:
                raise Mismatch(
                    f"{caller}: the parameters differ across ranks at {paths[i]} (rank 0 and "
                    f"rank {r} differ there): every rank must start from the same values, as "
                    "DistributedDataParallel makes them at construction; broadcast them first "
                    "(params = fr.distributed.broadcast(params)), or pass check=False"
                )
    raise Mismatch(f"{caller}: the parameters differ across ranks")  # pragma: no cover


def announce(group: Any, world: int, caller: str, error: BaseException) -> NoReturn:
    """A rank that failed before its call's agreement joins its peers' first collective, and raises.

    It meets the others' first collective, whatever its peers run: a mirror
    of the expected layout with *failed* set, or, on a group with no history
    yet, a probe that matches no fingerprint. Raises ``OwnFailure`` here, a
    ``PeerFailed`` naming this rank on the others.
    """
    expected = _history(group).expected()
    if expected is None:
        t = torch.tensor([_FAILED_PROBE] * 4, device=comm_device(group))
        with collective(caller):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    else:
        _mirror(expected.first, on_known=-1, failed=True, group=group, caller=caller)
    failure(group, caller, error)


class _Failed(NamedTuple):
    """What a rank whose call failed sends the others: its function and its error, as text."""

    caller: str
    error: str


def failure(group: Any, caller: str, error: BaseException | None) -> NoReturn:
    """Every rank, together, once a word said a rank failed: raise naming the failing rank(s)."""
    mine = None if error is None else _Failed(caller, f"{type(error).__name__}: {error}")
    _everyone(mine, group, caller)  # raises on every rank, unless no rank said what failed
    raise PeerFailed(f"{caller}: a rank flagged its call as failed; no result on any rank")


def exchange(
    layout: Layout, group: Any, caller: str, error: BaseException | None = None
) -> NoReturn:
    """Raise, on every rank together, naming how the layouts differ or who failed.

    Each rank sends its error (if its call failed) or its layout's
    description: a failure anywhere is named first; else the first
    difference between rank 0's layout and another's.
    """
    if error is not None:
        failure(group, caller, error)
    everyone = _everyone((caller, layout.description), group, caller)
    for r in range(1, len(everyone)):
        if everyone[r] != everyone[0]:
            raise Mismatch(f"{caller}: {difference(everyone[0], 0, everyone[r], r)}")
    raise Mismatch(f"{caller}: the tree layout differs across ranks")


def _everyone(mine: Any, group: Any, caller: str) -> list[Any]:
    """Everyone's ``mine``; raises at once, on every rank, if a rank sent a ``_Failed``."""
    size = dist.get_world_size(group)
    everyone: list[Any] = [None] * size
    with collective(caller):
        dist.all_gather_object(everyone, mine, group=group)
    failed = [(r, f) for r, f in enumerate(everyone) if isinstance(f, _Failed)]
    if failed:
        if isinstance(mine, _Failed):
            raise OwnFailure
        named = "; ".join(f"rank {r} ({f.caller}) raised {f.error}" for r, f in failed)
        raise PeerFailed(
            f"{caller}: {named}; this rank's call was abandoned with it (no result), as were "
            "the other ranks'"
        )
    return everyone


def _mirror(first: First, *, on_known: int, failed: bool, group: Any, caller: str) -> list[float]:
    """Run the expected layout's first collective with zeros and off-path words; their sums."""
    kind, bucket = first
    words = [0.0] * _flags.FIRST
    words[_flags.OFF] = 1.0
    words[_flags.FAILED] = 1.0 if failed else 0.0
    words[_flags.KNOWN_AT : _flags.KNOWN_AT + _flags.KNOWN] = [1.0] * _flags.KNOWN
    if on_known >= 0:
        words[_flags.KNOWN_AT + on_known] = 0.0
    sizes = kind.sizes(bucket)
    send = torch.zeros(sizes.send, dtype=bucket.comm, device=bucket.device)
    kind.put_words(bucket, send, torch.tensor(words, dtype=bucket.comm, device=bucket.device))
    recv = None
    if sizes.recv is not None:
        recv = torch.empty(sizes.recv, dtype=bucket.comm, device=bucket.device)
    work = kind.start(send, recv, bucket.maximum, group, caller)
    with collective(caller):
        work.wait()
    landed = kind.words_of(bucket, send if recv is None else recv)
    return (landed.real if landed.is_complex() else landed).tolist()  # type: ignore[no-any-return]
