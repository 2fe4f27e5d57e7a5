"""The cross-rank agreement on a call's layout: checked once, before data moves; then carried.

Every call checks its layout across ranks, so trees that differ, or ranks
that call different functions, raise ``ValueError`` on every rank instead of
reducing garbage. What it costs is paid once per layout, not once per call:

* **First use.** A layout no call on the group ran before is checked before
  any data moves: one small collective, the *probe* (the fingerprint and its
  negation, MAX-reduced, and a checksum of the parameters a gradient step
  differentiates: forgetting ``fr.distributed.broadcast`` at the start). A
  difference is named on every rank (``exchange``); otherwise every rank
  remembers the layout as *known* (``KNOWN`` of them per group, the same on
  every rank: they change only after a verdict every rank reads alike).
* **Steady state.** A known layout's call sends nothing of its own: its
  check rides in the flag words of its buckets (``_flags``) and is verified
  where the results land (``_call``), without a wait between its launches or
  a host read. A call that diverged on one rank (rank-dependent control flow)
  raises everywhere then, at the latest; where the divergence meets buckets
  of other sizes the backend itself fails (gloo aborts, NCCL hangs), which
  the debug mode prevents.
* **Debug mode** (``FREPLICATE_DISTRIBUTED_DEBUG=DETAIL`` on every rank, as
  ``TORCH_DISTRIBUTED_DEBUG`` is for c10d): every call probes first, so any
  divergence raises ``ValueError`` on every rank before data moves, at one
  small collective and one host read per call.

Whatever went wrong (a mismatch, a rank whose call failed) is then named in
one exchange (``exchange``), in which every rank sends either its layout's
description or its error: every rank raises, the same step, and the group
stays usable. A rank that fails before its call has a layout meets its peers
in the call they predictably run (``announce``). The traced path checks
layouts while tracing instead (``_store``).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, NoReturn

import torch
import torch.distributed as dist

from ._group import ProtocolError, collective, comm_device, group_ref, remember
from ._layout import Layout, difference

__all__ = [
    "DEBUG_VARIABLE",
    "Mismatch",
    "OwnFailure",
    "PeerFailed",
    "agree",
    "announce",
    "debugging",
    "exchange",
    "expected",
    "failure",
    "sparse_gradients",
]

#: the environment variable that turns on the debug mode of the checks, on every rank
DEBUG_VARIABLE = "FREPLICATE_DISTRIBUTED_DEBUG"
# how many layouts each group remembers as checked by every rank (then it starts afresh)
KNOWN = 64
# the probe of a rank that announces a failure: no fingerprint equals it
_FAILED_PROBE = 2**63 - 1


class Mismatch(ProtocolError, ValueError):
    """The ranks' layouts, options or calls differ (raised on every rank, naming the difference)."""


class PeerFailed(ProtocolError, RuntimeError):
    """Another rank's call failed; this rank's call was abandoned with it (no result)."""


class OwnFailure(ProtocolError):
    """Raised on the failing rank once its peers know; its caller raises its own error."""


# ``os.environ``'s own dict (encoded keys and values), read at C speed: every call reads the
# variable (a test turns the mode on and off in a running process), and ``os.environ.get``
# costs three Python frames
_ENVIRON: Any = getattr(os.environ, "_data", None)
_DEBUG_KEY: Any = os.environ.encodekey(DEBUG_VARIABLE) if _ENVIRON is not None else None  # type: ignore[attr-defined]
_ON = {"DETAIL", "1", "ON", "TRUE"}


def debugging() -> bool:
    """Whether the debug mode is on: every call checked before data moves (``DEBUG_VARIABLE``)."""
    if _ENVIRON is None:  # pragma: no cover - an os.environ without its dict
        return os.environ.get(DEBUG_VARIABLE, "").upper() in _ON
    raw = _ENVIRON.get(_DEBUG_KEY)
    return raw is not None and os.environ.decodevalue(raw).upper() in _ON  # type: ignore[attr-defined]


class Known(NamedTuple):
    """A layout every rank of a group checked, its sparse tensors' sparse dims, and whether its
    buckets' words carry its check (``Layout.carries_check``: else every call probes)."""

    layout: Layout
    dims: tuple[int, ...]
    carries: bool = True


class _History:
    """What every rank of a group knows in common: the layouts checked, which followed which.

    ``known``: the checked layouts by fingerprint (at most ``KNOWN``);
    ``after``: the layout that followed each last time and ``last``, the
    latest: what a rank failing before its call predicts its peers run;
    ``sparse``: the gradient layouts whose gradients came out sparse, and
    which (a step reduces those after the backward pass).
    """

    __slots__ = ("__weakref__", "after", "known", "last", "sparse")

    def __init__(self) -> None:
        self.known: dict[int, Known] = {}
        self.after: dict[int, int] = {}
        self.last: int | None = None
        self.sparse: dict[int, dict[int, int]] = {}

    def follow(self, fingerprint: int) -> None:
        if self.last is not None and self.after.get(self.last) != fingerprint:
            self.after[self.last] = fingerprint
        self.last = fingerprint

    def expected(self) -> Known | None:
        """The layout predicted for the next call: what followed the latest last time, or it."""
        if self.last is None:
            return None
        return self.known.get(self.after.get(self.last, self.last))


# Per process group, weakly keyed: a destroyed group's history goes with it. Tiny (layouts),
# and never cleared by fr.clear_caches: a rank that forgot it would probe where its peers
# do not.
_HISTORY: dict[weakref.ref[Any], _History] = {}  # keyed by ``group_ref`` (``remember``)


def _history(group: Any) -> _History:
    history = _HISTORY.get(group_ref(group))
    if history is None:
        history = remember(_HISTORY, group, _History())
    return history


def sparse_gradients(group: Any) -> dict[int, dict[int, int]]:
    """The gradient layouts whose gradients are sparse, the same on every rank.

    Keyed by the layout's fingerprint: the positions of its sparse gradients
    among its leaves, each with its number of sparse dimensions.
    """
    return _history(group).sparse


def expected(group: Any) -> Known | None:
    """The layout a rank's peers predictably run next (``announce``), if any."""
    return _history(group).expected()


def agree(
    layout: Layout,
    group: Any,
    world: int,
    caller: str,
    checksums: Callable[[], list[int]] | None = None,
    dims: Sequence[int] = (),
) -> None:
    """The cross-rank check of a call's layout before its first bucket (see the module's text).

    Probes on a layout's first use on ``group``, on every call in the debug
    mode, and on every call whose words cannot carry the check (a sum of
    byte-sized integers that could wrap round); otherwise sends nothing.
    ``checksums``: of the differentiated parameters, compared at the first probe;
    ``dims``: the layout's sparse tensors' sparse dims (what ``announce``
    sends in their place).
    """
    history = _history(group)
    fingerprint = layout.fingerprint
    known = history.known.get(fingerprint)
    if known is None or not known.carries or debugging():
        _probe(layout, group, caller, checksums if known is None else None)
        if known is None:
            if len(history.known) >= KNOWN:
                history.known.clear()  # every rank alike: they made the same calls
            history.known[fingerprint] = Known(layout, tuple(dims), layout.carries_check(world))
    history.follow(fingerprint)


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
                    "(params = fr.distributed.broadcast(params)), or pass check=False; "
                    f"{_SHARDS_ADVICE}"
                )
    raise Mismatch(f"{caller}: the parameters differ across ranks")  # pragma: no cover


def announce(
    group: Any,
    world: int,
    caller: str,
    error: BaseException,
    drain: Callable[[Known, BaseException], None],
    known: Known | None = None,
) -> NoReturn:
    """A rank that failed before its call had a layout joins its peers' call, and raises.

    Its peers run ``known`` where the caller knows it (``join``: the step
    whose reduction carried its bit), else the predicted layout
    (``expected``), known and unprobed outside the debug mode: this rank
    sends that call's every bucket with
    nothing of its own and *failed* set (``drain``), and every rank reads it
    where the results land. Otherwise (no prediction, or the debug mode)
    the peers probe first: this rank's probe matches no fingerprint. Raises
    ``OwnFailure`` here, a ``PeerFailed`` naming this rank on the others. A
    prediction that misses meets another collective (as any divergence
    outside the debug mode).
    """
    known = known or _history(group).expected()
    if known is None or debugging() or not known.carries:
        t = torch.tensor([_FAILED_PROBE] * 4, device=comm_device(group))
        with collective(caller):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        failure(group, caller, error)
    drain(known, error)
    raise AssertionError("a drained failure without OwnFailure")  # pragma: no cover


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
            advice = f"; {_SHARDS_ADVICE}" if _as_rows(everyone) else ""
            raise Mismatch(f"{caller}: {difference(everyone[0], 0, everyone[r], r)}{advice}")
    raise Mismatch(f"{caller}: the tree layout differs across ranks")


# A gradient step's parameters that differ across ranks may be ZeRO-3's shards, differentiated
# by the wrong function: apply_sharded's backward reduce-scatters their gradient itself
_SHARDS_ADVICE = (
    "if these are this rank's shards of a ZeRO-3 model (fr.distributed.shard's rows, run "
    "through fr.distributed.apply_sharded), differentiate the loss with fr.grad_and_value or "
    "loss.backward(), not fr.distributed.grad_and_value: apply_sharded's backward already "
    "reduce-scatters the gradient to each rank's rows"
)


def _as_rows(everyone: Sequence[Any]) -> bool:
    """Whether the ranks' gradient layouts differ only as ``fr.distributed.shard``'s rows do.

    The same caller (a gradient step), paths, dtypes and kinds of tensors on every rank, and
    each tensor's shapes the same but along dim 0, where rank ``r`` holds ``torch.chunk``'s
    ``r``-th piece of the rows all ranks hold together (at least one tensor split unevenly
    or not at all alike; a split that divides looks the same on every rank, and is no sign).
    """
    callers = {caller for caller, _ in everyone}
    if len(callers) != 1 or not next(iter(callers)).endswith("grad_and_value"):
        return False
    paths = {description[0] for _, description in everyone}
    rest = {description[2:] for _, description in everyone}
    sigs = [description[1] for _, description in everyone]
    if len(paths) != 1 or len(rest) != 1 or len({len(s) for s in sigs}) != 1:
        return False
    world, split = len(everyone), False
    for column in zip(*sigs):
        if any(s is None for s in column):
            if any(s is not None for s in column):
                return False
            continue
        shapes = [s[0] for s in column]
        if any(s[1:] != column[0][1:] for s in column):
            return False  # dtype, device, layout or memory format differ: not a split
        if len(set(shapes)) == 1:
            continue
        if any(len(shape) == 0 or shape[1:] != shapes[0][1:] for shape in shapes):
            return False
        rows = sum(shape[0] for shape in shapes)
        c = -(-rows // world)
        if [shape[0] for shape in shapes] != [min(c, max(0, rows - r * c)) for r in range(world)]:
            return False
        split = True
    return split


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
