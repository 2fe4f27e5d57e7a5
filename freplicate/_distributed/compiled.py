"""The traceable twins of fr.distributed: what its functions run while torch.compile traces.

The eager functions break Dynamo's graph: ``async_op`` work handles, host
reads of the layout check's flags, pooled buffers, locks. While Dynamo
traces (``is_compiling()``), each public function hands its call to a twin
here, which writes the same reduction into the graph with functional
collectives (``torch.distributed._functional_collectives``, the ops
``_c10d_functional.all_reduce`` / ``broadcast`` / ``wait_tensor``; torch
has no public successor yet): the tree flattened, its tensors packed per
(device, dtype) into the eager path's buckets (``torch.cat``), one
collective per bucket, every bucket issued before the first is waited on,
then split and viewed back. Inductor orders its generated code by
dependencies, so each bucket's collective is issued as soon as its
gradients are computed, amid the rest of the backward pass (DDP's overlap,
without hooks), and the waits come after the last one.

The cross-rank layout check runs once per trace, outside the graph: a
function marked ``torch.compiler.assume_constant_result`` runs for real
while Dynamo traces and its answer (the buckets) is baked into the graph.
It compares this call's layout (paths, shapes, dtypes, device types, tied
leaves and options) with every other rank's through the process group's
store, not through a collective: a rank that retraces alone (a smaller last
batch changes its input shapes, not its parameters) must not send a
collective the other ranks, running their compiled graphs, would take for a
bucket. A layout every rank has checked before passes without waiting. The
compiled graph itself checks nothing: Dynamo guards the shapes, dtypes and
keys it traced, so a changed layout retraces, and so is checked again.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import pickle
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import optree
import torch
import torch.distributed as dist

from .._caches import register
from .._checks import check_choice, check_int, check_mean
from .._pack import buckets, check_packable, group_by, layout_of, pack, unpack
from .._tree import NAMESPACE, path_str
from .._typing import Compress, Op, TensorTree
from .group import check_src, world_size
from .plan import _FIRST_BUCKET_BYTES, COMPRESS

__all__ = ["all_reduce", "broadcast", "grad_and_value", "skip", "sync_buffers"]

try:  # the traceable collectives and the lookups the layout check needs (private torch APIs)
    import torch.distributed._functional_collectives as _fc
    import torch.distributed.distributed_c10d as _c10d

    _OPS: Any = torch.ops._c10d_functional
    _group_name: Callable[[Any], str] = _fc._resolve_group_name
    _resolve_group: Callable[[str], Any] | None = getattr(_c10d, "_resolve_process_group", None)
    _group_store: Callable[[Any], Any] | None = getattr(_c10d, "_get_process_group_store", None)
except (ImportError, AttributeError):  # pragma: no cover - only on a torch without them
    _OPS = None
    _resolve_group = _group_store = None

# The layouts this process has seen every rank of a group check: (group name, fingerprint).
_CHECKED: OrderedDict[tuple[str, int], None] = OrderedDict()
_CHECKED_SIZE = 64
_KEY = "freplicate/compiled"  # the store keys' prefix (a group's store is its own already)
_ATTEMPTS = itertools.count()  # with the pid, an id for each check this process makes
# Other ranks' attempts this process failed: their ``at`` entries are stale until they notice.
_FAILED: OrderedDict[str, None] = OrderedDict()
register(_CHECKED.clear)

# A bucket of the plan: the positions of its leaves, the dtype it travels in, the reduction.
Bucket = tuple[tuple[int, ...], torch.dtype, str]


def all_reduce(
    tree: TensorTree,
    *,
    op: Op = "mean",
    group: Any = None,
    bucket_cap_mb: float = 25.0,
    compress: Compress = None,
    check: bool = True,
    caller: str = "fr.distributed.all_reduce",
) -> TensorTree:
    """``fr.distributed.all_reduce`` as Dynamo traces it: a fresh tree of reduced leaves.

    Same buckets, same arithmetic as the eager path (a mean divides each
    bucket by the world size before the sum; ``compress`` casts after that
    division and back after the sum; booleans travel as ``uint8`` reduced
    with MAX), so the results are bitwise the eager ones.
    """
    world = world_size(group, caller)
    if world <= 1:
        return tree
    name = _group_name(dist.group.WORLD if group is None else group)
    leaves, rebuild, paths = _flatten(tree)
    options = (op, bucket_cap_mb, compress, None)
    plan = _plan(caller, name, paths, _sigs(leaves), _firsts(leaves), options, check)
    _raise_if(plan)
    div = world if op == "mean" else 1
    out = list(leaves)
    pending = [
        (members, comm, _OPS.all_reduce(_pack(leaves, members, comm, div), red, name))
        for members, comm, red in plan[1]
    ]
    for members, _, work in pending:
        _unpack(_OPS.wait_tensor(work), leaves, members, out)
    _realias(out, leaves)
    return rebuild(out)


def broadcast(
    tree: TensorTree,
    *,
    src: int = 0,
    group: Any = None,
    check: bool = True,
    caller: str = "fr.distributed.broadcast",
) -> TensorTree:
    """``fr.distributed.broadcast`` as Dynamo traces it: a fresh tree of ``src``'s values.

    Every rank, ``src`` included, gets the broadcast's output (on ``src``,
    copies equal to its own tensors): one graph for every rank, and no
    collective the compiler could drop as unused on one rank only.
    """
    world = world_size(group, caller)
    if world == 0:  # not a rank of group: nothing to do (warned)
        return tree
    if dist.is_available() and dist.is_initialized():
        check_src(caller, src, group)
    else:
        check_int(caller, "src", src)
    if world == 1:
        return tree
    name = _group_name(dist.group.WORLD if group is None else group)
    leaves, rebuild, paths = _flatten(tree)
    plan = _plan(
        caller, name, paths, _sigs(leaves), _firsts(leaves), ("sum", 25.0, None, src), check
    )
    _raise_if(plan)
    out = list(leaves)
    root = plan[2]  # ``src`` as a rank of the group, which the functional op takes
    pending = [
        (members, _OPS.broadcast(_pack(leaves, members, comm, 1), root, name))
        for members, comm, _ in plan[1]
    ]
    for members, work in pending:
        _unpack(_OPS.wait_tensor(work), leaves, members, out)
    _realias(out, leaves)
    return rebuild(out)


def sync_buffers(
    buffers: TensorTree,
    *,
    mode: str = "broadcast",
    src: int = 0,
    group: Any = None,
) -> TensorTree:
    """``fr.distributed.sync_buffers`` as Dynamo traces it (the same two policies)."""
    caller = "fr.distributed.sync_buffers"
    check_choice(caller, "mode", mode, ("broadcast", "mean"))
    if not any(isinstance(x, torch.Tensor) for x in optree.tree_leaves(buffers)):
        check_int(caller, "src", src)
        return buffers  # nothing to sync (a model without buffers): no collective
    if mode == "broadcast":
        return broadcast(buffers, src=src, group=group, caller=caller)
    if world_size(group, caller) <= 1:
        return buffers
    floating = optree.tree_map(_if_floating, buffers, none_is_leaf=True, namespace=NAMESPACE)
    others = optree.tree_map(_unless_floating, buffers, none_is_leaf=True, namespace=NAMESPACE)
    means = all_reduce(floating, op="mean", group=group, caller=caller)
    synced = broadcast(others, src=src, group=group, caller=caller)
    return optree.tree_map(
        lambda m, s: s if m is None else m, means, synced, none_is_leaf=True, namespace=NAMESPACE
    )


def grad_and_value(
    local: Callable[..., tuple[Any, Any]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    argnums: int,
    *,
    op: Op,
    group: Any,
    bucket_cap_mb: float,
    compress: Compress,
    check: bool,
    caller: str = "fr.distributed.grad_and_value",
) -> tuple[Any, Any]:
    """``fr.distributed.grad_and_value``'s call as Dynamo traces it.

    ``local`` is the ``fr.grad_and_value`` of the user's function, which
    traces as ``torch.func.grad_and_value``; its gradients go through
    ``all_reduce``'s buckets, in the same graph, where each bucket's
    collective depends on its own gradients only (see the module's text).
    """
    grads, value = local(*args, **kwargs)
    if not -len(args) <= argnums < len(args):
        return grads, value  # unreachable: ``local`` raised its own error
    reduced = all_reduce(
        grads,
        op=op,
        group=group,
        bucket_cap_mb=bucket_cap_mb,
        compress=compress,
        check=check,
        caller=caller,
    )
    return reduced, value


def skip(
    tree: TensorTree,
    *,
    op: Op,
    group: Any,
    bucket_cap_mb: float,
    compress: Compress,
    check: bool,
    caller: str = "fr.distributed.grad_and_value",
) -> tuple[Any, None]:
    """``Step.skip`` as Dynamo traces it: zeros through the same buckets as the peers' step.

    The zeros have the gradients' layout (the tree's), so the layout check
    and the buckets match the peers' compiled ``step(...)``; with
    ``op="mean"`` the result is their sum divided by the world size, as the
    eager ``skip`` gives.
    """
    zeros = optree.tree_map(_zeros, tree, namespace=NAMESPACE)
    reduced = all_reduce(
        zeros,
        op=op,
        group=group,
        bucket_cap_mb=bucket_cap_mb,
        compress=compress,
        check=check,
        caller=caller,
    )
    return reduced, None


# --- traced helpers ---------------------------------------------------------------------


def _zeros(x: Any) -> Any:
    return torch.zeros_like(x) if isinstance(x, torch.Tensor) else x


def _if_floating(x: Any) -> Any:
    return x if isinstance(x, torch.Tensor) and x.is_floating_point() else None


def _unless_floating(x: Any) -> Any:
    return None if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _flatten(tree: Any) -> tuple[list[Any], Callable[[list[Any]], Any], tuple[Any, ...]]:
    """Leaves in the eager path's order, a function that rebuilds the tree, and the leaves' paths.

    A plain dict of tensors (parameters, gradients) skips optree, whose
    traced flatten costs Dynamo a call per node.
    """
    if type(tree) is dict and all(isinstance(v, torch.Tensor) for v in tree.values()):
        keys = list(tree)
        return list(tree.values()), lambda out: dict(zip(keys, out)), tuple((k,) for k in keys)
    paths, leaves, spec = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
    return leaves, lambda out: optree.tree_unflatten(spec, out), tuple(paths)


def _sigs(leaves: Sequence[Any]) -> tuple[Any, ...]:
    """Each leaf's (shape, dtype, device, layout), ``None`` for a non-tensor: trace-time constants."""
    return tuple(
        (tuple(t.shape), t.dtype, t.device, t.layout) if isinstance(t, torch.Tensor) else None
        for t in leaves
    )


def _firsts(leaves: Sequence[Any]) -> tuple[int, ...]:
    """For each leaf, the position of the first leaf that is the same object (tied weights)."""
    seen: dict[int, int] = {}
    return tuple(seen.setdefault(id(x), i) for i, x in enumerate(leaves))


def _raise_if(plan: tuple[Any, ...]) -> None:
    """Raise the plan's error, after a graph break that carries its message.

    Under ``fullgraph=True`` the break is Dynamo's error, with the message in
    it; otherwise the error is raised where the graph ends, as in eager code
    (raised in traced code, Dynamo would retrace every function it calls as
    a frame of its own, warning about each builtin on the way).
    """
    if plan[0] != "ok":
        torch._dynamo.graph_break(msg=plan[1])
        raise (TypeError if plan[0] == "TypeError" else ValueError)(plan[1])


def _pack(leaves: Sequence[Any], members: Sequence[int], comm: torch.dtype, div: int) -> Any:
    """One bucket's flat buffer: its leaves concatenated, divided, in the dtype it travels in."""
    flat = pack([leaves[i] for i in members])
    if div != 1:
        flat = flat / div  # before the sum, as the eager path and DDP do
    if flat.is_complex():
        return torch.view_as_real(flat).reshape(-1)  # collectives take the real view
    return flat.to(comm) if flat.dtype != comm else flat


def _unpack(flat: Any, leaves: Sequence[Any], members: Sequence[int], out: list[Any]) -> None:
    """Put a reduced bucket back: views of it, in each leaf's own shape and dtype."""
    first = leaves[members[0]]
    if first.is_complex():
        flat = torch.view_as_complex(flat.view(-1, 2))
    elif flat.dtype != first.dtype:
        flat = flat.to(first.dtype)
    for i, piece in zip(members, unpack(flat, layout_of([leaves[i] for i in members]))):
        out[i] = piece


def _realias(out: list[Any], leaves: Sequence[Any]) -> None:
    """Tied leaves get the one result of their first position."""
    firsts = _firsts(leaves)
    for i, f in enumerate(firsts):
        if f != i:
            out[i] = out[f]


# --- the plan, run for real while Dynamo traces -----------------------------------------


@torch.compiler.assume_constant_result
def _plan(
    caller: str,
    group: str,
    paths: tuple[Any, ...],
    sigs: tuple[Any, ...],
    firsts: tuple[int, ...],
    options: tuple[Any, ...],
    check: bool,
) -> tuple[Any, ...]:
    """``("ok", buckets, src)``, or ``(error type name, message)``: one trace's decisions.

    Runs in plain Python (Dynamo calls it on the constants it traced and
    bakes the answer into the graph). First the layout check across ranks
    (so trees that differ are named as such), then the checks of this
    rank's leaves, then the eager path's buckets: tensors in reverse order
    grouped per (device, dtype), the first bucket at most 1 MiB, the others
    at most ``bucket_cap_mb``. ``src`` is ``options``' source as a rank of
    the group (``None`` for a reduction).
    """
    op, cap_mb, compress, src = options
    pg = _resolve_group(group) if _resolve_group is not None else None
    if check:
        error = _agree(caller, group, pg, paths, sigs, firsts, options)
        if error is not None:
            return ("ValueError", error)
    unique = [i for i, s in enumerate(sigs) if s is not None and firsts[i] == i]
    shown = [path_str(p) for p in paths]
    try:
        layouts = [SimpleNamespace(layout=sigs[i][3]) for i in unique]
        check_packable(layouts, unique, shown, caller=caller)  # type: ignore[arg-type]
        if op == "mean":
            metas = [torch.empty(0, dtype=sigs[i][1], device="meta") for i in unique]
            check_mean(caller, metas, [shown[i] for i in unique])
    except TypeError as err:
        return ("TypeError", str(err))
    cap_bytes = max(1, int(cap_mb * 1024 * 1024))
    order = unique[::-1]  # the order gradients become ready, as DDP's buckets follow
    plan: list[Bucket] = []
    for (_, dtype), positions in group_by(order, lambda i: (sigs[i][2], sigs[i][1])).items():
        members = [order[p] for p in positions]
        comm = COMPRESS[compress] if compress is not None else None
        if comm is None or not dtype.is_floating_point or dtype.itemsize <= 2:
            comm = torch.uint8 if dtype == torch.bool else dtype
        numels = [math.prod(sigs[i][0]) for i in members]
        runs = buckets(numels, comm.itemsize, cap_bytes)
        if not plan:  # the plan's first bucket: DDP's smaller cap
            cut = buckets(numels, comm.itemsize, min(cap_bytes, _FIRST_BUCKET_BYTES))[0]
            rest = buckets(numels[cut.stop :], comm.itemsize, cap_bytes)
            runs = [cut] + [range(r.start + cut.stop, r.stop + cut.stop) for r in rest]
        red = "max" if dtype == torch.bool else "sum"
        plan += [(tuple(members[r] for r in run), comm, red) for run in runs]
    root = None
    if src is not None:
        root = dist.get_group_rank(pg, src) if pg is not None else src
    return ("ok", tuple(plan), root)


def _describe(
    paths: tuple[Any, ...], sigs: tuple[Any, ...], firsts: tuple[int, ...], options: tuple[Any, ...]
) -> tuple[Any, ...]:
    """A layout as plain values every rank compares: what the fingerprint hashes."""
    shown = tuple(path_str(p) for p in paths)
    sig = tuple(None if s is None else (s[0], str(s[1]), s[2].type) for s in sigs)
    return shown, sig, firsts, options


def _agree(
    caller: str,
    group: str,
    pg: Any,
    paths: tuple[Any, ...],
    sigs: tuple[Any, ...],
    firsts: tuple[int, ...],
    options: tuple[Any, ...],
) -> str | None:
    """The message naming how the layouts differ across ranks, or ``None`` when they agree.

    Through the group's store, not a collective (see the module's text).
    Each rank publishes the layout it is checking (``at/<rank>``: its
    fingerprint, description and a fresh attempt id) and marks the
    fingerprint as reached (``layout/<fingerprint>/<rank>``); a layout
    passes once every rank has reached it, at once for one agreed before.
    A rank that sees another checking a layout no rank agreed on (trees or
    options that differ) raises, and leaves the other its message under
    that attempt's ``fail/<id>``, so both raise. A rank that never reaches
    this layout (it runs an agreed one, or no call at all) makes it raise
    after the store's timeout, naming that rank's latest layout.
    """
    description = _describe(paths, sigs, firsts, options)
    digest = hashlib.blake2b(repr(description).encode(), digest_size=8).digest()
    fingerprint = int.from_bytes(digest, "little")
    if pg is None or _group_store is None:  # pragma: no cover - a torch without the lookups
        return _agree_by_collective(caller, pg, fingerprint, description)
    store = _group_store(pg)
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    attempt = f"{os.getpid()}.{next(_ATTEMPTS)}"
    store.set(f"{_KEY}/at/{rank}", pickle.dumps((fingerprint, attempt, description)))
    if (group, fingerprint) in _CHECKED:
        # Agreed before: no wait (this rank may retrace alone), but a rank already waiting on
        # a new layout at this call is told, and this one raises with it.
        _CHECKED.move_to_end((group, fingerprint))
        error = _elsewhere(store, rank, world, fingerprint, description, agreed=True)
    else:
        store.set(f"{_KEY}/layout/{fingerprint}/{rank}", b"")
        error = _wait_for(store, rank, world, fingerprint, attempt, description)
    if error is not None:
        store.set(f"{_KEY}/at/{rank}", pickle.dumps(None))  # nobody compares with a failed one
        return f"{caller}: {error} (checked when torch.compile traced this call)"
    _CHECKED[(group, fingerprint)] = None
    while len(_CHECKED) > _CHECKED_SIZE:
        _CHECKED.popitem(last=False)
    return None


def _reached(store: Any, fingerprint: int, ranks: Sequence[int]) -> bool:
    return bool(store.check([f"{_KEY}/layout/{fingerprint}/{r}" for r in ranks]))


def _wait_for(
    store: Any,
    rank: int,
    world: int,
    fingerprint: int,
    attempt: str,
    description: tuple[Any, ...],
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
        error = _elsewhere(store, rank, world, fingerprint, description)
        if error is not None:
            return error
        if time.monotonic() > deadline:
            return _late(store, rank, world, fingerprint, description, timeout)
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    return None


def _elsewhere(
    store: Any,
    rank: int,
    world: int,
    fingerprint: int,
    description: tuple[Any, ...],
    agreed: bool = False,
) -> str | None:
    """The difference with a rank checking a layout no rank agreed on, or ``None``.

    Such a rank runs another tree at this call: this one raises, and leaves
    the other its own message under its attempt's ``fail/<id>``. ``agreed``:
    this rank's layout was agreed before (its key says nothing of this call).
    """
    everyone = range(world)
    for r, (theirs, their_attempt, their_description) in _others_at(store, rank, world):
        if theirs == fingerprint or their_attempt in _FAILED or _reached(store, theirs, everyone):
            continue  # here too, failed already, or still leaving a layout every rank agreed on
        if not agreed and _reached(store, fingerprint, everyone):
            return None  # it reached this one, then moved on
        store.set(
            f"{_KEY}/fail/{their_attempt}",
            pickle.dumps(_difference(their_description, r, description, rank)),
        )
        _FAILED[their_attempt] = None
        while len(_FAILED) > _CHECKED_SIZE:
            _FAILED.popitem(last=False)
        return _difference(description, rank, their_description, r)
    return None


def _late(
    store: Any,
    rank: int,
    world: int,
    fingerprint: int,
    description: tuple[Any, ...],
    timeout: float,
) -> str:
    """Why the check timed out: who never reached this layout, and what it checked last."""
    missing = [r for r in range(world) if not _reached(store, fingerprint, [r])]
    elsewhere = [
        _difference(description, rank, entry[2], r)
        for r, entry in _others_at(store, rank, world)
        if r in missing and entry[0] != fingerprint
    ]
    return (
        f"rank(s) {missing} did not check this tree layout within the store's timeout "
        f"({timeout:.0f} s): " + (elsewhere[0] if elsewhere else "they are not at this call")
    )


def _others_at(store: Any, rank: int, world: int) -> list[tuple[int, Any]]:
    """``(rank, (fingerprint, attempt, description))`` of each other rank checking a layout now."""
    found = []
    for r in range(world):
        key = f"{_KEY}/at/{r}"
        if r != rank and store.check([key]):
            entry = pickle.loads(store.get(key))
            if entry is not None:
                found.append((r, entry))
    return found


def _agree_by_collective(  # pragma: no cover - a torch without the store lookups
    caller: str, pg: Any, fingerprint: int, description: tuple[Any, ...]
) -> str | None:
    """The same check through one all-gather, for a torch whose store cannot be reached."""
    everyone: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(everyone, (fingerprint, description), group=pg)
    rank = dist.get_rank(pg)
    for r, (theirs, their_description) in enumerate(everyone):
        if theirs != fingerprint:
            error = _difference(description, rank, their_description, r)
            return f"{caller}: {error} (checked when torch.compile traced this call)"
    return None


def _difference(mine: tuple[Any, ...], rank: int, theirs: tuple[Any, ...], other: int) -> str:
    """Words for the first difference between two layouts (``_describe``'s)."""
    paths, sig, firsts, options = mine
    paths_r, sig_r, firsts_r, options_r = theirs
    if options != options_r:
        return (
            f"the call's options differ across ranks: {options} on rank {rank}, {options_r} on "
            f"rank {other}; every rank must pass the same op, bucket_cap_mb, compress and src"
        )
    if paths != paths_r:
        k = next((k for k, (a, b) in enumerate(zip(paths, paths_r)) if a != b), None)
        if k is None:
            k = min(len(paths), len(paths_r))
        here = f"at {paths[k]}" if k < len(paths) else "none"
        there = f"at {paths_r[k]}" if k < len(paths_r) else "none"
        return (
            f"the tree's structure differs across ranks: leaf {k} is {here} on rank {rank}, "
            f"{there} on rank {other}; every rank must pass a tree of the same structure"
        )
    for path, a, b in zip(paths, sig, sig_r):
        if (a is None) != (b is None):
            what = ("a tensor", "not a tensor") if b is None else ("not a tensor", "a tensor")
            return (
                f"the tree's structure differs across ranks: the leaf at {path} is {what[0]} on "
                f"rank {rank}, {what[1]} on rank {other}; every rank must pass a tree of the "
                "same structure"
            )
    for path, a, b in zip(paths, sig, sig_r):
        if a != b:
            return (
                f"the tensor at {path} differs across ranks: shape {a[0]}, dtype {a[1]} on rank "
                f"{rank}; shape {b[0]}, dtype {b[1]} on rank {other}; every rank must pass "
                "tensors of the same shapes and dtypes"
            )
    if firsts != firsts_r:
        return (
            "tied (aliased) leaves differ across ranks: the same tensor object sits at "
            f"different positions of the tree on rank {rank} and on rank {other}"
        )
    return "the tree layout differs across ranks"  # pragma: no cover
