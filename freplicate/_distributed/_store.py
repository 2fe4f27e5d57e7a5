"""The traced path's layout check: once per trace, through the group's store, outside the graph.

While Dynamo traces a call, the layout is checked for real (``_plans`` runs
this from a function Dynamo treats as constant, so its answer is baked into
the graph). It compares this call's layout with every other rank's through
the process group's store, not through a collective: a rank that retraces
alone (a smaller last batch changes its input shapes, not its parameters)
must not send a collective that the other ranks, running their compiled
graphs, would take for a bucket. A layout every rank has checked before
passes without waiting. The compiled graph itself checks nothing: Dynamo
guards the shapes, dtypes and keys it traced, so a changed layout retraces,
and so is checked again.

Each rank publishes the layout it is checking (``at/<rank>``: its
fingerprint, a fresh attempt id and its description) and marks the
fingerprint as reached (``layout/<fingerprint>/<rank>``); a layout passes
once every rank has reached it. A rank that sees another checking a layout
no rank agreed on raises, and leaves the other its message under that
attempt's ``fail/<id>``, so both raise. A rank that never reaches this
layout makes it raise after the store's timeout, naming that rank's latest.
The words of the messages are ``_layout.difference``'s, as eagerly.
"""

from __future__ import annotations

import itertools
import os
import pickle
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from .._caches import register
from .._torch import group_store, resolve_group
from ._layout import Layout, difference

__all__ = ["check"]

# The layouts this process has seen every rank of a group check, per group object (weakly: a
# group made again under the same name after destroy_process_group starts with none).
_CHECKED: weakref.WeakKeyDictionary[Any, OrderedDict[int, None]] = weakref.WeakKeyDictionary()
_CHECKED_SIZE = 64
_KEY = "freplicate/compiled"  # the store keys' prefix (a group's store is its own already)
_ATTEMPTS = itertools.count()  # with the pid, an id for each check this process makes
# Other ranks' attempts this process failed: their ``at`` entries are stale until they notice.
_FAILED: OrderedDict[str, None] = OrderedDict()
register(_CHECKED.clear)

Described = tuple[str, tuple[Any, ...]]  # (caller, a layout's description)


def check(caller: str, group_name: str, layout: Layout) -> str | None:
    """The message naming how the layouts differ across ranks, or ``None`` when they agree."""
    pg = resolve_group(group_name)
    mine: Described = (caller, layout.description)
    fingerprint = layout.fingerprint
    store = group_store(pg)
    if store is None:  # a torch without the lookup (tests/test_compile.py takes it away)
        return _by_collective(caller, pg, fingerprint, mine)
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    attempt = f"{os.getpid()}.{next(_ATTEMPTS)}"
    store.set(f"{_KEY}/at/{rank}", pickle.dumps((fingerprint, attempt, mine)))
    checked = _CHECKED.setdefault(pg, OrderedDict())
    if fingerprint in checked:
        # Agreed before: it passes, no wait and no comparison (this rank may retrace alone;
        # a rank seen at another layout may simply have run ahead to its next call).
        checked.move_to_end(fingerprint)
        return None
    store.set(f"{_KEY}/layout/{fingerprint}/{rank}", b"")
    error = _wait_for(store, rank, world, fingerprint, attempt, mine)
    if error is not None:
        store.set(f"{_KEY}/at/{rank}", pickle.dumps(None))  # nobody compares with a failed one
        return f"{caller}: {error} (checked when torch.compile traced this call)"
    checked[fingerprint] = None
    while len(checked) > _CHECKED_SIZE:
        checked.popitem(last=False)
    return None


def _reached(store: Any, fingerprint: int, ranks: Sequence[int]) -> bool:
    return bool(store.check([f"{_KEY}/layout/{fingerprint}/{r}" for r in ranks]))


def _wait_for(
    store: Any, rank: int, world: int, fingerprint: int, attempt: str, mine: Described
) -> str | None:
    """Poll the store until every rank reached this layout (``None``), or say why not."""
    everyone = range(world)
    timeout = store.timeout.total_seconds()
    deadline = time.monotonic() + timeout
    fail = f"{_KEY}/fail/{attempt}"
    pause = 0.001
    while not _reached(store, fingerprint, everyone):
        if store.check([fail]):  # another rank found this attempt's layout to differ
            return pickle.loads(store.get(fail))  # type: ignore[no-any-return]
        error = _elsewhere(store, rank, world, fingerprint, mine)
        if error is not None:
            return error
        if time.monotonic() > deadline:
            return _late(store, rank, world, fingerprint, mine, timeout)
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    return None


def _elsewhere(store: Any, rank: int, world: int, fingerprint: int, mine: Described) -> str | None:
    """The difference with a rank checking a layout no rank agreed on, or ``None``.

    Such a rank runs another tree at this call: this one raises, and leaves
    the other its own message under its attempt's ``fail/<id>``.
    """
    everyone = range(world)
    for r, (theirs, their_attempt, their_layout) in _others_at(store, rank, world):
        if theirs == fingerprint or their_attempt in _FAILED or _reached(store, theirs, everyone):
            continue  # here too, failed already, or still leaving a layout every rank agreed on
        if _reached(store, fingerprint, everyone):
            return None  # it reached this one, then moved on
        store.set(
            f"{_KEY}/fail/{their_attempt}", pickle.dumps(difference(their_layout, r, mine, rank))
        )
        _FAILED[their_attempt] = None
        while len(_FAILED) > _CHECKED_SIZE:
            _FAILED.popitem(last=False)
        return difference(mine, rank, their_layout, r)
    return None


def _late(
    store: Any, rank: int, world: int, fingerprint: int, mine: Described, timeout: float
) -> str:
    """Why the check timed out: who never reached this layout, and what it checked last."""
    missing = [r for r in range(world) if not _reached(store, fingerprint, [r])]
    elsewhere = [
        difference(mine, rank, entry[2], r)
        for r, entry in _others_at(store, rank, world)
        if r in missing and entry[0] != fingerprint
    ]
    return (
        f"rank(s) {missing} did not check this tree layout within the store's timeout "
        f"({timeout:.0f} s): " + (elsewhere[0] if elsewhere else "they are not at this call")
    )


def _others_at(store: Any, rank: int, world: int) -> list[tuple[int, Any]]:
    """``(rank, (fingerprint, attempt, (caller, description)))`` of each other rank checking now."""
    found = []
    for r in range(world):
        key = f"{_KEY}/at/{r}"
        if r != rank and store.check([key]):
            entry = pickle.loads(store.get(key))
            if entry is not None:
                found.append((r, entry))
    return found


def _by_collective(caller: str, pg: Any, fingerprint: int, mine: Described) -> str | None:
    """The same check through one all-gather, for a torch whose store cannot be reached."""
    everyone: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(everyone, (fingerprint, mine), group=pg)
    rank = dist.get_rank(pg)
    for r, (theirs, their_layout) in enumerate(everyone):
        if theirs != fingerprint:
            error = difference(mine, rank, their_layout, r)
            return f"{caller}: {error} (checked when torch.compile traced this call)"
    return None
