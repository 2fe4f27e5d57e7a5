"""The cross-rank agreement on a call's layout, and the messages that name a mismatch or failure.

Every call checks the layout across ranks, so trees that differ, or ranks
that call different functions, raise ``ValueError`` on every rank instead of
hanging, aborting or reducing garbage. Each group remembers the layouts all
its ranks ran (``KNOWN`` of them) and which one followed which; the call
predicted next (the *expected* layout) takes the fast path, its check riding
in the first bucket's flags, at no collective of its own. Every other call
first *mirrors* the expected layout's first collective (same size, dtype and
op), so a rank on the fast path and a rank on anything else always meet in a
collective of one shape (gloo aborts the process when two collectives of
different sizes meet): their flags then tell every rank what happened.

The same flags carry *failed*: a rank whose ``fn`` raised inside
``fr.distributed.grad_and_value`` still joins the collectives, with it set,
so that every rank raises (``failure``) instead of waiting for it.
"""

from __future__ import annotations

import pickle
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple, NoReturn

import optree
import torch
import torch.distributed as dist

from .._tree import NAMESPACE, LazyPaths, describe, structure_difference
from .._typing import TensorTree
from .group import comm_device, world_size
from .plan import FAILED, FLAGS, KNOWN, OFF, ON, FirstCollective, Plan

__all__ = [
    "Agreed",
    "OwnFailure",
    "agree",
    "announce_failure",
    "failure",
    "mismatch",
    "probe",
    "record",
    "sparse_gradients",
    "verify",
]

# the probe of a rank that announces a failure: no fingerprint equals it
_FAILED_PROBE = 2**63 - 1


class Agreed(NamedTuple):
    """A layout every rank of a group is known to have run: its fingerprint, its first collective."""

    fingerprint: int
    first: FirstCollective


class _History:
    """What every rank of a group knows in common: the layouts run together, which followed which.

    Identical on every rank: it changes only after a collective verdict
    (``record``). ``known``: the last ``KNOWN`` layouts, most recent first;
    ``after``: the layout that followed each of them last time; ``last``:
    the latest; ``sparse``: the parameter layouts whose gradients came out
    sparse, and which (``grad_and_value`` reduces those after the backward pass).
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
    key = dist.group.WORLD if group is None else group
    history = _HISTORY.get(key)
    if history is None:
        history = _HISTORY[key] = _History()
    return history


def sparse_gradients(group: Any) -> dict[int, dict[int, int]]:
    """The parameter layouts whose gradients are sparse, the same on every rank.

    Keyed by the layout's fingerprint: the positions of its sparse gradients
    among its leaves (``flatten_in_order``'s order), each with its number of
    sparse dimensions, which a ``skip`` mirrors.
    """
    return _history(group).sparse


def record(plan: Plan, group: Any) -> None:
    """Every rank ran ``plan`` together: remember it as the latest, after the one before."""
    if plan.first is None:
        return
    history = _history(group)
    fingerprint = plan.fingerprint
    if history.last is not None:
        history.after[history.last] = fingerprint
    history.last = fingerprint
    known = [Agreed(fingerprint, plan.first)]
    known += [e for e in history.known if e.fingerprint != fingerprint][: KNOWN - 1]
    history.known = known
    kept = {e.fingerprint for e in known}
    history.after = {k: v for k, v in history.after.items() if k in kept}


def probe(plan: Plan, group: Any) -> tuple[torch.Tensor, Any]:
    """Start this call's full cross-rank check: the fingerprint and its negation, MAX-reduced."""
    t = torch.tensor([plan.fingerprint, -plan.fingerprint], device=comm_device(group))
    return t, dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True)


def verify(
    plan: Plan, started: tuple[torch.Tensor, Any], tree: TensorTree, group: Any, caller: str
) -> None:
    """Finish the check ``probe`` started: ``ValueError`` on every rank if layouts differ."""
    t, work = started
    work.wait()
    if int(t[0]) == plan.fingerprint and int(t[1]) == -plan.fingerprint:
        return
    # Every rank saw the difference, so every rank takes this slower path together.
    mismatch(plan, tree, group, caller)


def mismatch(plan: Plan, tree: TensorTree, group: Any, caller: str) -> NoReturn:
    """Raise naming how the layouts differ (or who failed); every rank calls it together."""
    try:
        skeleton: bytes | None = pickle.dumps(optree.tree_map(describe, tree))
    except Exception:  # a node type that does not pickle: compare the spec text only
        skeleton = None
    everyone = _gather((skeleton, plan.description, caller), group, caller)
    raise ValueError(f"{caller}: {_mismatch(everyone, LazyPaths(plan.spec, plan.unique))}")


def _render(node: Any) -> str:
    """A node of a received skeleton: its leaves are already text, the rest as ``describe`` says."""
    return node if isinstance(node, str) else describe(node)


class _Failed(NamedTuple):
    """What a rank whose call failed sends the others: its function and its error, as text."""

    caller: str
    error: str


def failure(group: Any, caller: str, error: BaseException | None = None) -> NoReturn:
    """Every rank, together, once a flag said a rank failed: raise naming the failing rank(s).

    A failing rank passes its ``error`` and raises it again itself; the
    others raise ``RuntimeError`` naming the rank and its error.
    """
    mine = None if error is None else _Failed(caller, f"{type(error).__name__}: {error}")
    _gather(mine, group, caller)  # raises on every rank, unless no rank said what failed
    raise RuntimeError(f"{caller}: a rank flagged its call as failed; no result on any rank")


def announce_failure(group: Any, world: int, caller: str, error: BaseException) -> NoReturn:
    """A rank that failed before its call's first collective joins the peers' and raises.

    It meets the others' first collective, whatever its peers run: a mirror
    of the expected layout with *failed* set, or, on a group with no history
    yet, a probe that matches no fingerprint.
    """
    expected = _history(group).expected()
    if expected is None:
        t = torch.tensor([_FAILED_PROBE, _FAILED_PROBE], device=comm_device(group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    else:
        _mirror(expected.first, on_known=-1, failed=True, group=group)
    failure(group, caller, error)


def _gather(mine: Any, group: Any, caller: str) -> list[Any]:
    """Everyone's ``mine``; raises at once, on every rank, if a rank sent a ``_Failed``."""
    everyone: list[Any] = [None] * world_size(group, caller)
    dist.all_gather_object(everyone, mine, group=group)
    failed = [(r, f) for r, f in enumerate(everyone) if isinstance(f, _Failed)]
    if failed:
        if isinstance(mine, _Failed):
            raise OwnFailure  # the failing rank raises its own error (``grad_and_value``)
        named = "; ".join(f"rank {r} ({f.caller}) raised {f.error}" for r, f in failed)
        raise RuntimeError(
            f"{caller}: {named}; this rank's call was abandoned with it (no result), as were "
            "the other ranks'"
        )
    return everyone


class OwnFailure(Exception):
    """Raised on the failing rank once its peers know; its caller re-raises its own error."""


def _mirror(first: FirstCollective, *, on_known: int, failed: bool, group: Any) -> torch.Tensor:
    """Run the expected layout's first collective with zeros and off-path flags; its flags."""
    mirror = torch.zeros(first.numel, dtype=first.dtype, device=first.device)
    flags = mirror[-FLAGS:]
    flags[OFF] = 1
    flags[FAILED] = 1 if failed else 0
    flags[FLAGS - KNOWN :] = 1
    if on_known >= 0:
        flags[FLAGS - KNOWN + on_known] = 0
    dist.all_reduce(mirror, op=first.op, group=group)
    return flags


def _options(options: tuple[Any, ...]) -> str:
    """A plan's options (``plan_for``'s), named as the public functions' keywords."""
    names = ("op", "bucket_cap_mb", "compress", "src", "weighted")
    return "(" + ", ".join(f"{n}={v!r}" for n, v in zip(names, options)) + ")"


def _mismatch(everyone: list[Any], paths: Sequence[str]) -> str:
    """Text naming the first difference between rank 0's layout and another rank's."""
    _, (spec0, sig0, slot0, opts0), caller0 = everyone[0]
    for r in range(1, len(everyone)):
        skeleton, (spec_r, sig_r, slot_r, opts_r), caller_r = everyone[r]
        if caller_r != caller0:
            return (
                f"ranks called different functions: {caller0} on rank 0, {caller_r} on rank {r}; "
                "every rank must make the same calls in the same order"
            )
        if opts_r != opts0:
            return (
                f"the call's options differ across ranks: {_options(opts0)} on rank 0, "
                f"{_options(opts_r)} on rank {r}; every rank must pass the same op, "
                "bucket_cap_mb, compress and src, and a weight on every rank or on none"
            )
        if spec_r != spec0:
            where = None
            if everyone[0][0] is not None and skeleton is not None:
                at, mine, theirs = structure_difference(
                    pickle.loads(everyone[0][0]),
                    pickle.loads(skeleton),
                    _render,
                    namespace=NAMESPACE,
                )
                where = f"at {at}: {mine} on rank 0, {theirs} on rank {r}"
            return (
                "the tree's structure differs across ranks: "
                + (where or f"{spec0} on rank 0, {spec_r} on rank {r}")
                + "; every rank must pass a tree of the same structure"
            )
        if sig_r != sig0:
            for k, (a, b) in enumerate(zip(sig0, sig_r)):
                if a[3] != b[3]:
                    return (
                        f"the tensor at {paths[k]} differs across ranks: layout {a[3]} on rank "
                        f"0, {b[3]} on rank {r}; every rank must pass tensors of the same layouts"
                    )
                if a != b:
                    return (
                        f"the tensor at {paths[k]} differs across ranks: shape {a[0]}, dtype "
                        f"{a[1]} on rank 0; shape {b[0]}, dtype {b[1]} on rank {r}; every rank "
                        "must pass tensors of the same shapes and dtypes"
                    )
        if slot_r != slot0:
            return (
                "tied (aliased) leaves differ across ranks: the same tensor object sits at "
                f"different positions of the tree on rank 0 and on rank {r}"
            )
    return "the tree layout differs across ranks"  # pragma: no cover


def agree(plan: Plan, tree: TensorTree, group: Any, world: int, caller: str) -> bool:
    """The cross-rank layout check before a call's first bucket; ``True``: the fast path.

    On the fast path (``plan`` is the expected layout) nothing is sent here:
    the first bucket carries flags ``[off 0, on 1, failed 0, ...]`` and
    ``Reduction`` reads them back before the second bucket starts (or before
    returning), then ``record``s the call. Any other call mirrors the
    expected layout's first collective with ``[off 1, on 0, failed 0]`` and,
    per known layout, 0 if it runs that one, else 1; all ranks read the same
    sums. *on* set: some rank is on the fast path, so every rank raises
    through ``mismatch`` together. Else a known layout's flag still 0: every
    rank runs that one, the check is done. Else the full check runs
    (``probe``, ``verify``). Only the expected layout may take the fast
    path: two ranks each on another would start first buckets of different
    sizes.
    """
    history = _history(group)
    expected = history.expected()
    speculates = plan.speculates(world)
    if expected is not None:
        if speculates and expected.fingerprint == plan.fingerprint:
            return True
        on_known = -1
        if speculates:
            for j, entry in enumerate(history.known):
                if entry.fingerprint == plan.fingerprint:
                    on_known = j
        flags = _mirror(expected.first, on_known=on_known, failed=False, group=group)
        if flags[ON].item() != 0 or flags[FAILED].item() != 0:
            mismatch(plan, tree, group, caller)  # someone ran the expected layout, or failed
        known = flags[FLAGS - KNOWN :].tolist()
        if on_known >= 0 and known[on_known] == 0:  # everyone runs this known layout
            record(plan, group)
            return False
    verify(plan, probe(plan, group), tree, group, caller)
    if speculates:
        record(plan, group)
    return False
