"""Rank-side code of tests/test_identity.py: ranks whose calls differ (issue 23, item 4).

A *case* runs one call on rank 0 and another on rank 1, catches what each
rank raised, then has both ranks make a good call together (rank 0's call
again, on both: its result must be what it gives when nothing went wrong)
to show that the group is still usable. Before it, the group's history
(the layouts every rank ran, ``_agree``) is brought to one of the
protocol's ``SITUATIONS`` the same way on every rank, so that the pair
meets on the path the situation names. A rank whose good call fails stops
its list of cases there (its peer's fails too, or hangs until the group's
timeout, then fails), so that one case that leaves the ranks out of step
fails the test once, within a bounded time, instead of every later case.

Ranks that part ways after a layout's first use meet in buckets of
different sizes, which gloo answers by aborting the process outside the
checks' debug mode (the contract: ../shared/API.md): every scenario but the
group's first calls (``matrix_first``, where the ranks meet in their
probes) runs in the debug mode. tests/test_steady_state.py covers the
default mode's warm divergence (buckets of one size).

The scenarios register with ``_dist_workers`` and run through its spawner
(loopback only, a file store, bounded timeouts, stragglers killed).
"""

from __future__ import annotations

import itertools
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, NamedTuple

import optree
import torch
import torch.distributed as dist
from _dist_workers import _main, in_debug_mode, outcome, scenario

import freplicate as fr
from freplicate._distributed import _agree as agree

D = "fr.distributed."


def main(*args: Any) -> None:
    _main(*args)


def same(a: Any, b: Any) -> bool:
    """Whether two results are the same tree of the same values (bit for bit)."""
    la, sa = optree.tree_flatten(a, none_is_leaf=True)
    lb, sb = optree.tree_flatten(b, none_is_leaf=True)
    return sa == sb and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb)
    )


# --- the calls --------------------------------------------------------------------------


def tree() -> dict[str, torch.Tensor]:
    """The tree every call of the matrix runs on, the same on every rank (rows that pad)."""
    return {"w": torch.arange(12.0).view(4, 3) / 8, "b": torch.linspace(-1.0, 1.0, 5)}


def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
    total = torch.zeros(())
    for k, x in enumerate(p.values()):
        total = total + ((x * (k + 1)) ** 2).sum()
    return total


class Call(NamedTuple):
    """A public call on a tree, and what tells it apart: its function, kind and options."""

    run: Callable[[Any], Any]
    caller: str
    kind: str
    options: dict[str, Any]  # as ``Options.describe`` names them


def _options(
    op: str = "mean",
    cap: float = 25.0,
    compress: Any = None,
    src: Any = None,
    weighted: bool = False,
) -> dict[str, Any]:
    return {"op": op, "bucket_cap_mb": cap, "compress": compress, "src": src, "weighted": weighted}


def _step(**kwargs: Any) -> Callable[[Any], Any]:
    return lambda t: fr.distributed.grad_and_value(loss, **kwargs)(t)[0]


CALLS: dict[str, Call] = {
    "broadcast(src=0)": Call(
        lambda t: fr.distributed.broadcast(t, src=0),
        D + "broadcast",
        "broadcast",
        _options("sum", src=0),
    ),
    "broadcast(src=1)": Call(
        lambda t: fr.distributed.broadcast(t, src=1),
        D + "broadcast",
        "broadcast",
        _options("sum", src=1),
    ),
    "all_reduce(op='mean')": Call(
        fr.distributed.all_reduce, D + "all_reduce", "all_reduce", _options()
    ),
    "all_reduce(op='sum')": Call(
        lambda t: fr.distributed.all_reduce(t, op="sum"),
        D + "all_reduce",
        "all_reduce",
        _options("sum"),
    ),
    "all_reduce(weight=2.0)": Call(
        lambda t: fr.distributed.all_reduce(t, weight=2.0),
        D + "all_reduce",
        "all_reduce",
        _options(weighted=True),
    ),
    "all_reduce(compress='bf16')": Call(
        lambda t: fr.distributed.all_reduce(t, compress="bf16"),
        D + "all_reduce",
        "all_reduce",
        _options(compress="bf16"),
    ),
    "all_reduce(bucket_cap_mb=1e-05)": Call(  # a bucket per tensor: the fast path waits in between
        lambda t: fr.distributed.all_reduce(t, bucket_cap_mb=1e-5),
        D + "all_reduce",
        "all_reduce",
        _options(cap=1e-05),
    ),
    "reduce_scatter(op='sum')": Call(
        lambda t: fr.distributed.reduce_scatter(t, op="sum"),
        D + "reduce_scatter",
        "reduce_scatter",
        _options("sum"),
    ),
    "reduce_scatter(op='mean')": Call(
        fr.distributed.reduce_scatter, D + "reduce_scatter", "reduce_scatter", _options()
    ),
    "all_gather": Call(
        lambda t: fr.distributed.all_gather(fr.distributed.shard(t), t),
        D + "all_gather",
        "all_gather",
        _options("sum"),
    ),
    "sync_buffers(mode='broadcast')": Call(
        fr.distributed.sync_buffers, D + "sync_buffers", "broadcast", _options("sum", src=0)
    ),
    "sync_buffers(mode='mean')": Call(  # its first call; a second broadcasts the rest (none here)
        lambda t: fr.distributed.sync_buffers(t, mode="mean"),
        D + "sync_buffers",
        "all_reduce",
        _options(),
    ),
    "step": Call(_step(), D + "grad_and_value", "all_reduce", _options()),
    "step(shard=True)": Call(_step(shard=True), D + "grad_and_value", "reduce_scatter", _options()),
    "step(op='sum')": Call(_step(op="sum"), D + "grad_and_value", "all_reduce", _options("sum")),
    "step.skip": Call(
        lambda t: fr.distributed.grad_and_value(loss).skip(t)[0],
        D + "grad_and_value",
        "all_reduce",
        _options(),
    ),
    "step.accumulate": Call(
        lambda t: fr.distributed.grad_and_value(loss).accumulate(t, [(), ()])[0],
        D + "grad_and_value",
        "all_reduce",
        _options(),
    ),
}


def identity(name: str) -> tuple[Any, ...]:
    """What tells a call apart: its function, kind and options."""
    c = CALLS[name]
    return (c.caller, c.kind, tuple(sorted(c.options.items())))


PAIRS = [(a, b) for a in CALLS for b in CALLS if a != b]
#: one call to the protocol under several names: a step, a skip and an accumulate pair up by design
COMPATIBLE = [(a, b) for a, b in PAIRS if identity(a) == identity(b)]
#: different functions that run the same collective (kind and options)
SILENT = [
    (a, b)
    for a, b in PAIRS
    if identity(a)[0] != identity(b)[0] and identity(a)[1:] == identity(b)[1:]
]
#: of those, where one rank's function goes on to a second collective, alone
CASCADING = [p for p in SILENT if "sync_buffers(mode='mean')" in p]
DIFFERENT = [p for p in PAIRS if p not in COMPATIBLE and p not in SILENT]

#: the protocol's situations a case meets in (``_agree``)
SITUATIONS = (
    "first",  # the group's first call: no history, every rank probes (the default mode)
    "fast",  # rank 0's call ran twice before (the debug mode: every call probes)
    "known",  # both calls ran before, then another (the debug mode)
    "new",  # another layout ran before (the debug mode)
)


def other_layout() -> Any:
    return fr.distributed.all_reduce({"z": torch.ones(3)}, op="sum")


_FRESH = itertools.count()


def fresh_layout() -> Any:
    """A layout no rank ran before (every rank draws the same names, in the same order)."""
    return fr.distributed.all_reduce({f"fresh{next(_FRESH)}": torch.ones(3)}, op="sum")


def forget() -> None:
    """As a fresh group: the history of every group forgotten, on every rank alike."""
    agree._HISTORY.clear()


def then(*calls: Callable[[], Any]) -> Callable[[], None]:
    """Run ``calls`` on the history as it is (every rank)."""

    def before() -> None:
        for call in calls:
            call()

    return before


def afresh(*calls: Callable[[], Any]) -> Callable[[], None]:
    """Forget the history, then run ``calls`` (every rank)."""
    return then(forget, *calls)


class Case(NamedTuple):
    """One case: ``calls[r]`` on rank r, after ``before`` (every rank), then ``good`` (every rank).

    ``good`` returns ``True`` where the group works as before.
    """

    key: tuple[Any, ...]
    before: Callable[[], Any]
    calls: Sequence[Callable[[], Any]]
    good: Callable[[], bool]


def run_cases(rank: int, todo: Sequence[Case]) -> dict[Any, Any]:
    """``{key: (outcome, good call's outcome)}`` on this rank; ``"stopped"``: where the ranks parted."""
    out: dict[Any, Any] = {}
    for case in todo:
        case.before()
        got = outcome(case.calls[rank])
        good = outcome(case.good)
        out[case.key] = (got, good)
        if good != ("returned", True):
            out["stopped"] = case.key
            break
    return out


def setup(
    situation: str, first: Callable[[], Any], second: Callable[[], Any], again: bool = False
) -> Callable[[], None]:
    """What every rank runs before a case so that the history is ``situation`` (``first``: rank
    0's call). ``again``: the previous case had the same ``first``, and its good call was ``first``
    on every rank, so the history goes on from there (cheaper, and the same situation)."""
    if situation == "fast":  # first, expected: after itself
        return then() if again else afresh(first, first)
    if situation == "known":  # both known; expected: a layout never run before (nothing follows it)
        return then(second, fresh_layout) if again else afresh(first, second, fresh_layout)
    if situation == "new":
        return afresh(other_layout)
    return afresh()


def pair_cases(
    situation: str, pairs: Sequence[tuple[str, str]], call_of: Callable[[str], Callable[[], Any]]
) -> list[Case]:
    """A case per pair of names (``call_of(name)``: the call), pairs of one ``first`` in a row;
    the good call is rank 0's call on both ranks, its result the one it gives alone."""
    forget()
    reference = {name: call_of(name)() for name in dict.fromkeys(a for a, _ in pairs)}
    todo = []
    previous = None
    for a, b in pairs:
        first, second = call_of(a), call_of(b)
        before = setup(situation, first, second, again=previous == a)
        good = lambda f=first, a=a: same(f(), reference[a])  # noqa: E731
        todo.append(Case((situation, a, b), before, (first, second), good))
        previous = a
    return todo


def on_tree(name: str) -> Callable[[], Any]:
    return lambda: CALLS[name].run(tree())


def _matrix(situation: str) -> Callable[[int], dict[Any, Any]]:
    """The scenario ``matrix_<situation>``: every pair of ``CALLS`` (those that cascade aside)."""

    def matrix(rank: int) -> dict[Any, Any]:
        pairs = [p for p in PAIRS if p not in CASCADING]
        return run_cases(rank, pair_cases(situation, pairs, on_tree))

    matrix.__name__ = f"matrix_{situation}"
    return matrix


for _situation in SITUATIONS:
    # the group's first calls meet in their probes in the default mode; the other situations part
    # ways after a layout's first use, where only the debug mode checks before the data moves
    _run = _matrix(_situation)
    scenario(_run if _situation == "first" else in_debug_mode(_run))


# --- the rules path: inputs that require grad, forward and transposed collectives --------

#: the collectives (no step) a tree that requires grad goes through with their rules
RULED = [n for n, c in CALLS.items() if c.caller not in (D + "grad_and_value", D + "sync_buffers")]


def graph_tree() -> dict[str, torch.Tensor]:
    return {k: v.requires_grad_() for k, v in tree().items()}


def through(name: str) -> Callable[[], Any]:
    """``name``'s call on a tree that requires grad, then a backward through it: the gradients."""

    def call() -> Any:
        t = graph_tree()
        out = CALLS[name].run(t)
        total = sum(((y * (k + 2)) ** 2).sum() for k, y in enumerate(out.values()))
        return torch.autograd.grad(total, list(t.values()))

    return call


def ruled_cases(situation: str) -> list[Case]:
    """The pairs of ``RULED`` through the rules (forward, and the good call's backward too)."""
    pairs = [(a, b) for a, b in PAIRS if a in RULED and b in RULED]
    return [c._replace(key=("ruled", *c.key)) for c in pair_cases(situation, pairs, through)]


@scenario
@in_debug_mode
def ruled_pairs(rank: int) -> dict[Any, Any]:
    return run_cases(rank, ruled_cases("first") + ruled_cases("fast"))


def transposed(name: str, after: Callable[[], Any] | None) -> Callable[[], Any]:
    """Rank 0's side: ``name`` on a tree that requires grad, then ``.backward()`` (its transpose).

    Rank 1's side (``after`` given): ``name`` on a tree that does not, then ``after()``.
    """

    def call() -> Any:
        if after is None:
            out = CALLS[name].run(graph_tree())
            sum(y.sum() for y in out.values()).backward()
            return "backward"
        CALLS[name].run(tree())
        return after()

    return call


#: what rank 1 goes on to while rank 0 runs a backward through its last call
THEN: dict[str, Callable[[], Any]] = {
    "another collective": lambda: fr.distributed.reduce_scatter({"r": torch.ones(4)}),
    "all_reduce of the same tree": lambda: fr.distributed.all_reduce(tree()),
    "all_gather of the same tree": lambda: fr.distributed.all_gather(
        fr.distributed.shard(tree()), tree()
    ),
    "a step on the same tree": lambda: fr.distributed.grad_and_value(loss)(tree()),
}


#: one call of each kind, differentiated on one rank only
BACKWARD_CALLS = (
    "all_reduce(op='mean')",
    "reduce_scatter(op='sum')",
    "broadcast(src=0)",
    "all_gather",
)


@scenario
@in_debug_mode
def backward_on_one_rank(rank: int) -> dict[Any, Any]:
    """One rank differentiates through a collective (its transpose runs), the other goes on."""
    todo = []
    for name in BACKWARD_CALLS:
        for following, f in THEN.items():
            todo.append(
                Case(
                    (name, following),
                    afresh(),
                    (transposed(name, None), transposed(name, f)),
                    other_fine,
                )
            )
    return run_cases(rank, todo)


# --- trees that differ in memory format, dtype or ties only -----------------------------

VARIANT_CALLS = [
    "broadcast(src=0)",
    "all_reduce(op='mean')",
    "reduce_scatter(op='sum')",
    "all_gather",
    "sync_buffers(mode='mean')",
    "step",
    "step(shard=True)",
    "step.skip",
]
VARIANTS = ("memory_format", "dtype", "tied")


def variant_tree(variant: str, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tree: rank 1's differs from rank 0's in ``variant`` only."""
    t = {"c": torch.arange(24.0).view(2, 3, 2, 2) / 8, **tree()}
    if variant == "memory_format" and rank == 1:
        t["c"] = t["c"].contiguous(memory_format=torch.channels_last)
    if variant == "dtype" and rank == 1:
        t["b"] = t["b"].double()
    if variant == "tied":  # the same tensor at two places on rank 0; equal values on rank 1
        t["v"] = t["w"] if rank == 0 else t["w"].clone()
    return t


def variant_cases(situation: str) -> list[Case]:
    todo = []
    for variant in VARIANTS:
        for name in VARIANT_CALLS:
            run_ = CALLS[name].run
            first = lambda r=run_, v=variant: r(variant_tree(v, 0))  # noqa: E731
            second = lambda r=run_, v=variant: r(variant_tree(v, 1))  # noqa: E731
            reference = first()
            good = lambda f=first, ref=reference: same(f(), ref)  # noqa: E731
            key = (situation, variant, name)
            todo.append(Case(key, setup(situation, first, second), (first, second), good))
    return todo


@scenario
@in_debug_mode
def tree_variants(rank: int) -> dict[Any, Any]:
    return run_cases(rank, [c for s in SITUATIONS for c in variant_cases(s)])


# --- the report: a wrong shard given to all_gather after a reduce_scatter ------------------


def wrong_shards(rank: int) -> dict[str, torch.Tensor]:
    """``shard(tree())`` but for ``['b']``: the other rank's rows' shape (3 rows on rank 1, 2 on 0)."""
    mine = fr.distributed.shard(tree())
    return {**mine, "b": torch.ones(2 if rank == 0 else 3)}


@scenario
@in_debug_mode
def wrong_shard_after_reduce_scatter(rank: int) -> dict[Any, Any]:
    """The reported case: reduce_scatter(op="sum"), then all_gather with a wrong shard on one rank."""
    like = tree()
    scatter = lambda: fr.distributed.reduce_scatter(like, op="sum")  # noqa: E731
    gather = lambda: fr.distributed.all_gather(fr.distributed.shard(like), like)  # noqa: E731
    histories = {
        "after reduce_scatter": afresh(scatter),
        "after reduce_scatter twice": afresh(scatter, scatter),
        "after all_gather twice": afresh(gather, gather),
        "first": afresh(),
    }
    todo = []
    for history, before in histories.items():
        for bad in (0, 1):
            calls = [
                lambda r=r, bad=bad: fr.distributed.all_gather(
                    wrong_shards(r) if r == bad else fr.distributed.shard(like), like
                )
                for r in (0, 1)
            ]
            good = lambda: same(fr.distributed.all_gather(fr.distributed.shard(like), like), like)  # noqa: E731
            todo.append(Case((history, bad), before, calls, good))
    return run_cases(rank, todo)


# --- one function's two collectives against another's one, on a group of its own -----------


@scenario
@in_debug_mode
def second_collective_alone(rank: int) -> dict[str, Any]:
    """sync_buffers(mode="mean") on rank 1 (two calls), all_reduce(op="mean") on rank 0 (one).

    On a group of its own with a short timeout: a rank left waiting alone
    there costs that timeout, not the default group's.
    """
    group = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    start = time.monotonic()
    if rank == 0:
        got = outcome(lambda: fr.distributed.all_reduce(tree(), group=group))
    else:
        got = outcome(lambda: fr.distributed.sync_buffers(tree(), mode="mean", group=group))
    good = outcome(
        lambda: fr.distributed.all_reduce(
            {"ok": torch.full((2,), float(rank))}, op="sum", group=group
        )["ok"].tolist()
    )
    return {"got": got, "good": good, "seconds": time.monotonic() - start}


# --- a real new group: its first call --------------------------------------------------------


@scenario
@in_debug_mode
def new_group_first_call(rank: int) -> dict[str, Any]:
    """On a group made for it (no history at all): different kinds raise, then the group works."""
    group = dist.new_group([0, 1])
    t = tree()
    out = {
        "kinds": outcome(
            lambda: (
                fr.distributed.reduce_scatter(t, group=group)
                if rank
                else fr.distributed.all_reduce(t, group=group)
            )
        ),
        "shard": outcome(
            lambda: fr.distributed.grad_and_value(loss, shard=rank == 1, group=group)(t)
        ),
        "good": outcome(lambda: fr.distributed.all_reduce(t, op="sum", group=group)["b"].tolist()),
    }
    dist.destroy_process_group(group)
    return out


# --- issue 25, item 9: a sparse leaf in shard; a rank outside the group ------------------


@scenario
@in_debug_mode
def sparse_shard(rank: int) -> dict[str, Any]:
    sparse = {"dense": torch.ones(4), "e": torch.eye(4).to_sparse()}
    return {
        "shard": outcome(lambda: fr.distributed.shard(sparse)),
        "reduce_scatter": outcome(lambda: fr.distributed.reduce_scatter(sparse)),
        "after": outcome(
            lambda: fr.distributed.reduce_scatter({"ok": torch.ones(4)}, op="sum")["ok"].tolist()
        ),
    }


def outside_calls(group: Any, path: str) -> dict[str, Callable[[], Any]]:
    """Every public fr.distributed call, on ``group``."""
    t = tree()
    step = fr.distributed.grad_and_value(loss, group=group)
    with torch.device("meta"):
        meta = torch.nn.Linear(3, 2)
    return {
        "broadcast": lambda: fr.distributed.broadcast(t, group=group),
        "all_reduce": lambda: fr.distributed.all_reduce(t, group=group),
        "reduce_scatter": lambda: fr.distributed.reduce_scatter(t, group=group),
        "all_gather": lambda: fr.distributed.all_gather(t, t, group=group),
        "shard": lambda: fr.distributed.shard(t, group=group),
        "sync_buffers": lambda: fr.distributed.sync_buffers(t, group=group),
        "sync_buffers(mode='mean')": lambda: fr.distributed.sync_buffers(
            t, mode="mean", group=group
        ),
        "grad_and_value": lambda: step(t),
        "skip": lambda: step.skip(t),
        "accumulate": lambda: step.accumulate(t, [()]),
        "clip_grad_norm": lambda: fr.distributed.clip_grad_norm(t, 1.0, group=group),
        "join": lambda: list(fr.distributed.join([1, 2], group=group)),
        "materialize": lambda: fr.distributed.materialize(meta, group=group),
        "save_sharded": lambda: fr.distributed.save_sharded(path, t, t, group=group),
        "load_sharded": lambda: fr.distributed.load_sharded(path, t, group=group),
    }


@scenario
@in_debug_mode
def outside_the_group(rank: int) -> dict[str, Any]:
    """On 3 ranks, a group of ranks 0 and 1: rank 2 calls everything on it (none of it pairs)."""
    group = dist.new_group([0, 1])
    out: dict[str, Any] = {}
    if rank == 2:
        with tempfile.TemporaryDirectory() as tmp:
            for name, call in outside_calls(group, tmp).items():
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    got = outcome(call)
                said = [f"{w.category.__name__}: {w.message}" for w in caught]
                out[name] = (got if got[0] == "raised" else ("returned",), said)
    dist.barrier()
    return out


# --- compiled: the check while tracing (through the store), and a graph that checks nothing ---

COMPILED_PAIRS = [
    ("all_reduce(op='mean')", "reduce_scatter(op='mean')"),
    ("step", "step(shard=True)"),
]


def named_tree(name: str) -> dict[str, torch.Tensor]:
    """``tree()`` under keys of its own: a layout no rank has agreed on yet (Dynamo retraces)."""
    return {f"{k}_{name}": v for k, v in tree().items()}


@scenario
@in_debug_mode
def compiled(rank: int) -> dict[Any, Any]:
    """Pairs compiled on both ranks (each rank traces its own call), then two calls of different
    kinds compiled and run on both ranks, then run one on each: their graphs cached, nothing traces."""
    torch._dynamo.reset()
    traced = {
        name: torch.compile(CALLS[name].run, backend="eager") for p in COMPILED_PAIRS for name in p
    }
    todo = []
    for a, b in COMPILED_PAIRS:
        t = named_tree(a)
        reference = CALLS[a].run(t)
        calls = [lambda f=traced[a], t=t: f(t), lambda f=traced[b], t=t: f(t)]
        good = lambda a=a, t=t, ref=reference: same(CALLS[a].run(t), ref)  # noqa: E731
        todo.append(Case(("traced", a, b), afresh(), calls, good))
    out = run_cases(rank, todo)
    # broadcast is an all-reduce that only src fills: one bucket of the same size as all_reduce's
    reduce = torch.compile(fr.distributed.all_reduce, backend="eager")
    send = torch.compile(fr.distributed.broadcast, backend="eager")
    t = named_tree("agreed")
    out["agreed"] = (outcome(lambda: same(reduce(t), t)), outcome(lambda: same(send(t), t)))
    out["cached"] = (outcome(lambda: (send if rank else reduce)(t)), outcome(other_fine))
    return out


def other_fine() -> bool:
    """A good call on a layout of its own: the group still sums."""
    return same(other_layout(), {"z": torch.full((3,), 2.0)})
