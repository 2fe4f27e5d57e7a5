"""Data parallelism across processes: broadcast, bucketed all-reduce, a DDP-style gradient.

The functional counterpart of DistributedDataParallel and of the composable
``replicate``: instead of hooks on a module and a reducer hidden in it, three
collective functions on trees, built on ``torch.distributed`` itself (gloo on
CPU, NCCL on CUDA). A tree's layout (structure, shapes, dtypes, aliasing and
the call's options) is turned once into a *plan*: tensors grouped per
(device, dtype) with the core engine (``_pack``), in DDP's order (reverse of
the leaves, the order gradients become ready), cut into buckets of at most
``bucket_cap_mb`` (the first of at most 1 MiB, as DDP's). Each bucket packs
into a flat buffer taken from a small pool (``_pack.FlatPool``), is reduced
there in place, and comes back as views of it; the pool hands a buffer out
again only once no view of it is alive, so results of successive calls
never alias, and a training loop reuses two or three buffers instead of
paying a large allocation (page faults) every step. Every call checks the
layout across ranks, so trees that differ raise ``ValueError`` on every
rank instead of hanging, aborting or reducing garbage; on the layout the
group last agreed on, the check rides in the first bucket (three flag
elements) and costs no collective of its own (``_agree``).
"""

from __future__ import annotations

import hashlib
import operator
import pickle
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch._C._functorch import maybe_current_level

from ._grad import detached, gradients, split_output
from ._grad import grad_and_value as _local_grad_and_value
from ._leaves import PLAIN, STACK_NUMEL, Leaves
from ._pack import FlatPool, buckets, check_packable, group_by
from ._tree import (
    LazyPaths,
    describe_node,
    flatten_in_order,
    paths_of,
    picker,
    structure_difference,
    tensor_values,
)

__all__ = ["all_reduce", "broadcast", "grad_and_value", "sync_buffers"]

_OPS = ("sum", "mean")
_COMPRESS = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}
_PLAN_CACHE_SIZE = 16
# DDP's first bucket (``dist._DEFAULT_FIRST_BUCKET_BYTES``): small, so it starts early in the
# backward pass, and the layout check it carries (``_agree``) is read back soon and cheaply.
_FIRST_BUCKET_BYTES = 1024 * 1024
# The layout check's trailing elements of a plan's first bucket (see ``_agree``): [off the agreed
# layout, on it, off the second layout]. Each sums up to the world size; only "> 0" is read.
_FLAGS = 3


def _world(group: Any) -> int:
    """Size of ``group``; 1 when torch.distributed is unavailable or not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


class _Bucket:
    """One bucket of a plan: which tensors it holds, and its reusable flat buffers.

    ``results`` holds buffers in the leaves' dtype, reduced in place and
    handed out as views (reused once those views are gone); ``comm``, only
    where the bucket travels in another dtype (compression, booleans), is
    the plan's private buffer in that dtype. The plan's first bucket has
    ``extra=_FLAGS`` spare elements at the end of both: the layout check's flags.
    """

    __slots__ = (
        "clear",
        "comm",
        "comm_dtype",
        "dtype",
        "members",
        "red",
        "results",
        "run_picks",
    )

    def __init__(
        self,
        members: list[int],
        tensors: Sequence[torch.Tensor],
        comm_dtype: torch.dtype,
        *,
        extra: int,
    ) -> None:
        self.members = members
        first = tensors[0]
        self.dtype = first.dtype
        self.comm_dtype = comm_dtype
        # booleans travel as uint8 reduced with MAX: a logical or, as ``a + b`` on bools
        self.red = dist.ReduceOp.MAX if first.dtype == torch.bool else dist.ReduceOp.SUM
        shapes = [t.shape for t in tensors]
        self.results = FlatPool(shapes, first.dtype, first.device, extra=extra)
        # one part per run of the pool (``FlatPool.pack``), out of a list in the plan's tensor order
        self.run_picks = []
        start = 0
        for _, count in self.results.runs:
            self.run_picks.append(picker(members[start : start + count]))
            start += count
        self.comm = (
            FlatPool(shapes, comm_dtype, first.device, keep=1, extra=extra)
            if comm_dtype != first.dtype
            else None
        )
        # the flags of a call on the fast path (``_agree``): on the agreed layout
        self.clear = (
            torch.tensor([0, 1, 0], dtype=comm_dtype, device=first.device) if extra else None
        )


class _Plan:
    """What one tree layout needs: deduplication, buckets, and the cross-rank fingerprint."""

    def __init__(
        self,
        spec: optree.PyTreeSpec,
        leaves: Sequence[Any],
        unique: list[int],
        slot: list[int] | None,
        fn: str,
        op: str,
        cap_bytes: int,
        compress: torch.dtype | None,
        options: tuple[Any, ...],
    ) -> None:
        self.spec = spec
        self.unique = unique
        self.slot = slot
        self.lock = threading.RLock()  # fn may itself reduce a tree of this layout
        tensors = [leaves[i] for i in unique]
        paths = LazyPaths(spec, unique)
        check_packable(tensors, range(len(tensors)), paths, fn=fn)
        if op == "mean":
            for k, t in enumerate(tensors):
                if not (t.is_floating_point() or t.is_complex()):
                    raise TypeError(
                        f"{fn}: op='mean' needs floating-point or complex leaves, but the leaf at "
                        f"{paths[k]} has dtype {t.dtype}; use op='sum' or convert it"
                    )
        # DDP's order: the last parameters' gradients are ready first.
        order = list(range(len(tensors)))[::-1]
        self.buckets: list[_Bucket] = []
        groups = group_by([tensors[k] for k in order], lambda t: (t.device, t.dtype))
        for (_, dtype), positions in groups.items():
            members = [order[p] for p in positions]
            comm = dtype
            if compress is not None and dtype.is_floating_point and dtype.itemsize > 2:
                comm = compress
            elif dtype == torch.bool:
                comm = torch.uint8  # reduced with MAX: a logical or, as ``a + b`` on bools
            numels = [tensors[k].numel() for k in members]
            runs = buckets(numels, comm.itemsize, cap_bytes)
            if not self.buckets:  # the plan's first bucket: DDP's smaller cap
                cut = buckets(numels, comm.itemsize, min(cap_bytes, _FIRST_BUCKET_BYTES))[0]
                rest = buckets(numels[cut.stop :], comm.itemsize, cap_bytes)
                runs = [cut] + [range(r.start + cut.stop, r.stop + cut.stop) for r in rest]
            for run in runs:
                # equal shapes side by side: one stack packs them, one unbind views them back
                by_shape = group_by([tensors[members[r]] for r in run], lambda t: t.shape)
                ids = [members[run[p]] for same in by_shape.values() for p in same]
                extra = 0 if self.buckets else _FLAGS
                self.buckets.append(_Bucket(ids, [tensors[k] for k in ids], comm, extra=extra))
        # results come out bucket by bucket; this puts them back in the order of the tensors
        where = {k: j for j, k in enumerate(k for b in self.buckets for k in b.members)}
        inverse = [where[k] for k in range(len(tensors))]
        self.reorder = picker(inverse)
        self.bare = slot is None and len(unique) == len(leaves)  # only tensors, no aliasing
        sig = [(tuple(t.shape), str(t.dtype), t.device.type) for t in tensors]
        self.description = (str(spec), sig, slot, options)
        digest = hashlib.blake2b(repr(self.description).encode(), digest_size=8).digest()
        self.fingerprint = int.from_bytes(digest, "little") >> 1  # fits an int64
        self.diff: dict[bool, _DiffLayout] = {}  # grad_and_value's, built on first use
        # what a rank on another layout needs to mirror this plan's first collective (``_agree``)
        self.first: tuple[int, torch.dtype, torch.device, Any] | None = None
        if self.buckets:
            b0 = self.buckets[0]
            self.first = (b0.results.numel, b0.comm_dtype, b0.results.device, b0.red)

    def diff_layout(self, stack: bool) -> _DiffLayout:
        layout = self.diff.get(stack)
        if layout is None:
            layout = self.diff[stack] = _DiffLayout(self.buckets, stack)
        return layout

    def parts(self, b: int, tensors: Sequence[Any]) -> list[list[Any]]:
        """Bucket ``b``'s tensors out of ``tensors`` (one per unique tensor), one list per run."""
        return [pick(tensors) for pick in self.buckets[b].run_picks]

    def speculates(self, world: int) -> bool:
        """Whether calls may run on the fast path, the check carried by the first bucket's flags.

        A flag slot sums up to ``world``: it must not wrap round to 0 in a
        byte-sized integer bucket (bool buckets reduce with MAX: no sum).
        """
        if self.first is None:
            return False
        _, dtype, _, red = self.first
        return dtype.itemsize > 1 or red == dist.ReduceOp.MAX or world < 256

    def probe(self, group: Any) -> tuple[torch.Tensor, Any]:
        """Start this call's cross-rank check: the fingerprint and its negation, MAX-reduced."""
        t = torch.tensor([self.fingerprint, -self.fingerprint], device=_comm_device(group))
        return t, dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True)

    def verify(self, probe: tuple[torch.Tensor, Any], tree: Any, group: Any, fn: str) -> None:
        """Finish the check started by ``probe``: ``ValueError`` on every rank if layouts differ."""
        t, work = probe
        work.wait()
        if int(t[0]) == self.fingerprint and int(t[1]) == -self.fingerprint:
            return
        # Every rank saw the difference, so every rank takes this slower path together.
        self.mismatch(tree, group, fn)

    def mismatch(self, tree: Any, group: Any, fn: str) -> None:
        """Raise ``ValueError`` naming how the layouts differ; every rank calls it together."""
        try:
            skeleton: bytes | None = pickle.dumps(optree.tree_map(_leaf_desc, tree))
        except Exception:  # a node type that does not pickle: compare the spec text only
            skeleton = None
        mine = (skeleton, self.description)
        everyone: list[Any] = [None] * _world(group)
        dist.all_gather_object(everyone, mine, group=group)
        raise ValueError(f"{fn}: {_mismatch(everyone, self.spec)}")


class _DiffLayout:
    """How ``grad_and_value`` differentiates a plan's tensors, bucket by bucket.

    Its ``Leaves`` (``_leaves``) come in bucket order; with ``stack``, each
    run of small equal-shaped tensors of a bucket is one stacked leaf, whose
    gradient is that run of the bucket as it stands (one copy to pack, one
    hook to watch). ``spans[b]``: bucket ``b``'s leaves; ``segments[b]``:
    per run, 0 where it is one stacked leaf, else its number of tensors.
    """

    __slots__ = ("leaves", "segments", "spans")

    def __init__(self, buckets: Sequence[_Bucket], stack: bool) -> None:
        groups: list[list[int]] = []
        self.spans: list[range] = []
        self.segments: list[list[int]] = []
        for bucket in buckets:
            first, segments, start = len(groups), [], 0
            for shape, count in bucket.results.runs:
                ids = bucket.members[start : start + count]
                start += count
                if stack and count > 1 and shape.numel() <= STACK_NUMEL:
                    groups.append(ids)
                    segments.append(0)
                else:
                    groups += ([k] for k in ids)
                    segments.append(count)
            self.spans.append(range(first, len(groups)))
            self.segments.append(segments)
        self.leaves = Leaves(groups)

    def parts(self, b: int, grads: Sequence[torch.Tensor]) -> list[Any]:
        """``FlatPool.pack``'s parts of bucket ``b`` from its leaves' gradients, in span order."""
        parts: list[Any] = []
        i = 0
        for n in self.segments[b]:
            if n == 0:
                parts.append(grads[i])
                i += 1
            else:
                parts.append(grads[i : i + n])
                i += n
        return parts


def _comm_device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _leaf_desc(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"a leaf of type {type(x).__name__}"


def _skeleton_describe(node: Any) -> str:
    """A node of a pickled skeleton: tensors are already text, the rest as ``_tree`` says."""
    return node if isinstance(node, str) else describe_node(node)


def _mismatch(everyone: list[Any], spec: optree.PyTreeSpec) -> str:
    """Text naming the first difference between rank 0's layout and another rank's."""
    _, (spec0, sig0, slot0, opts0) = everyone[0]
    for r in range(1, len(everyone)):
        skeleton, (spec_r, sig_r, slot_r, opts_r) = everyone[r]
        if opts_r != opts0:
            return (
                f"the call's options differ across ranks: {opts0} on rank 0, {opts_r} on rank {r}; "
                "every rank must pass the same op, bucket_cap_mb, compress and src"
            )
        if spec_r != spec0:
            where = None
            if everyone[0][0] is not None and skeleton is not None:
                at, mine, theirs = structure_difference(
                    pickle.loads(everyone[0][0]), pickle.loads(skeleton), _skeleton_describe
                )
                where = f"at {at}: {mine} on rank 0, {theirs} on rank {r}"
            return (
                "the tree's structure differs across ranks: "
                + (where or f"{spec0} on rank 0, {spec_r} on rank {r}")
                + "; every rank must pass a tree of the same structure"
            )
        if sig_r != sig0:
            paths = paths_of(spec)
            for k, (a, b) in enumerate(zip(sig0, sig_r)):
                if a != b:
                    return (
                        f"the tensor at {paths[k]} differs across ranks: shape {a[0]}, dtype "
                        f"{a[1]} on rank 0; shape {b[0]}, dtype {b[1]} on rank {r}; every rank "
                        "must pass tensors of the same shapes and dtypes"
                    )
        if slot_r != slot0:
            return (
                "tied (aliased) leaves differ across ranks: the same tensor object sits at "
                "different positions of the tree on rank 0 and on rank {r}"
            )
    return "the tree layout differs across ranks"  # pragma: no cover


_PLANS: dict[Any, _Plan] = {}
# Per process group: the *agreed* layout and the *second* one (or None), each as (fingerprint,
# first collective): the last two layouts every rank is known to have run together. Identical on
# every rank, as they change only after a collective verdict (see ``_agree``); kept apart from
# ``_PLANS``, whose evictions are per rank. Weakly keyed: a destroyed group's state goes with it.
_Agreed = tuple[int, tuple[int, torch.dtype, torch.device, Any]]
_AGREED: weakref.WeakKeyDictionary[Any, tuple[_Agreed, _Agreed | None]] = (
    weakref.WeakKeyDictionary()
)
_SIG = operator.attrgetter("shape", "dtype", "device")
_DICT = object()  # marks a plan key made from a plain dict's keys (``tensor_values``)
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_PLANS_LOCK = threading.Lock()


def _plan_for(
    tree: Any, fn: str, op: str, cap_mb: float, compress: str | None, src: int | None
) -> tuple[_Plan, list[Any]]:
    """The cached plan of ``tree``'s layout with these options, and the tree's leaves."""
    options = (fn, op, cap_mb, compress, src)
    slot: list[int] | None = None
    unique: list[int]
    values = tensor_values(tree)
    if values is not None and len(set(map(id, values))) == len(values):
        # the commonest tree (a dict of distinct tensors: params, gradients): keyed by its keys
        key: tuple[Any, ...] = (_DICT, tuple(tree), tuple(map(_SIG, values)), options)
        plan = _PLANS.get(key)
        if plan is not None:
            return plan, values
        leaves, spec = flatten_in_order(tree)  # the same leaves, and the spec the plan keeps
        unique = list(range(len(leaves)))
    else:
        leaves, spec = flatten_in_order(tree)  # buckets follow the order gradients become ready
        kinds = set(map(type, leaves))
        distinct = len(set(map(id, leaves))) == len(leaves)
        if all(issubclass(k, torch.Tensor) for k in kinds) and distinct:
            # a tree of distinct tensors: a key built at C speed
            key = (spec, tuple(map(_SIG, leaves)), options)
            plan = _PLANS.get(key)
            if plan is not None:
                return plan, leaves
            unique = list(range(len(leaves)))
        else:  # non-tensor leaves, or a tensor at several positions (tied weights)
            unique, slot = [], []
            seen: dict[int, int] = {}
            for i, x in enumerate(leaves):
                if isinstance(x, torch.Tensor):
                    pos = seen.setdefault(id(x), len(unique))
                    if pos == len(unique):
                        unique.append(i)
                    slot.append(pos)
                else:
                    slot.append(-1)
            key = (spec, tuple(_SIG(leaves[i]) for i in unique), tuple(slot), options)
            plan = _PLANS.get(key)
            if plan is not None:
                return plan, leaves
    if cap_mb <= 0:
        raise ValueError(f"{fn}: bucket_cap_mb must be positive, got {cap_mb}")
    plan = _Plan(
        spec,
        leaves,
        unique,
        slot,
        fn,
        op,
        max(1, int(cap_mb * 1024 * 1024)),
        _COMPRESS[compress],
        (op, cap_mb, compress, src),
    )
    with _PLANS_LOCK:
        _PLANS[key] = plan
        while len(_PLANS) > _PLAN_CACHE_SIZE:
            del _PLANS[next(iter(_PLANS))]  # the oldest layout
    return plan, leaves


def _agree(plan: _Plan, tree: Any, group: Any, world: int, fn: str) -> bool:
    """The cross-rank layout check before a call's first bucket; ``True``: the fast path.

    On the fast path (``plan`` is the group's agreed layout) nothing is sent
    here: the first bucket carries flags ``[0, 1, 0]`` and ``_Reduction``
    reads them back before the second bucket starts (or before returning).
    Any other call first *mirrors* the agreed layout's first collective (same
    size, dtype and op: zeros, then flags ``[1, 0, s]``, ``s`` 0 on the
    second layout, else 1), so ranks on the fast path and ranks here meet in
    one collective and read the same sums. A rank on the fast path sees slot
    0 set, a rank here sees slot 1 set: all of them raise through
    ``_Plan.mismatch`` together. Slot 2 still 0: every rank runs the second
    layout, checked by this very collective; it and the agreed one swap
    roles, everywhere at once (a loop alternating gradients and buffers pays
    one mirror per switch, no probe). Otherwise the full check runs
    (``probe``, ``verify``) and, passed on every rank, makes ``plan`` the
    agreed layout and the old one the second. Only the agreed layout may take
    the fast path: two ranks each on another would start first buckets of
    different sizes.
    """
    key = dist.group.WORLD if group is None else group
    state = _AGREED.get(key)
    speculates = plan.speculates(world)
    if state is not None:
        agreed, second = state
        if speculates and agreed[0] == plan.fingerprint:
            return True
        numel, dtype, device, red = agreed[1]
        mirror = torch.zeros(numel, dtype=dtype, device=device)
        on_second = speculates and second is not None and second[0] == plan.fingerprint
        mirror[-_FLAGS] = 1
        mirror[-1] = 0 if on_second else 1
        dist.all_reduce(mirror, op=red, group=group)
        if mirror[-2].item() != 0:  # someone ran the agreed layout
            plan.mismatch(tree, group, fn)
        if mirror[-1].item() == 0:  # everyone runs the second layout: the check is done
            _AGREED[key] = (second, agreed)  # type: ignore[assignment]
            return False
    plan.verify(plan.probe(group), tree, group, fn)
    if speculates:
        entry: _Agreed = (plan.fingerprint, plan.first)  # type: ignore[assignment]
        _AGREED[key] = (entry, state[0] if state is not None else None)
    return False


def _rebuild(plan: _Plan, leaves: list[Any], results: Sequence[torch.Tensor]) -> Any:
    """The tree of ``results`` (one per unique tensor), non-tensor leaves passed through."""
    if plan.bare:
        return optree.tree_unflatten(plan.spec, results)
    out = list(leaves)
    if plan.slot is None:
        for i, r in zip(plan.unique, results):
            out[i] = r
    else:
        for i, s in enumerate(plan.slot):
            if s >= 0:
                out[i] = results[s]
    return optree.tree_unflatten(plan.spec, out)


def _not_transformed(fn: str) -> None:
    if maybe_current_level() is not None:
        raise RuntimeError(
            f"{fn}: cannot run under a torch.func transform (vmap, grad, jvp ...): "
            "torch.distributed collectives have no batching or differentiation rule; call "
            "fr.grad_and_value inside the transform and fr.distributed.all_reduce outside it"
        )


def _check_args(fn: str, op: str, compress: str | None) -> None:
    if op not in _OPS:
        raise ValueError(f"{fn}: op must be 'sum' or 'mean', got {op!r}")
    if compress not in _COMPRESS:
        raise ValueError(f"{fn}: compress must be None, 'bf16' or 'fp16', got {compress!r}")


class _Reduction:
    """One call's reduction over a plan: fill buckets, launch them in order, collect results."""

    __slots__ = ("group", "launched", "op", "pending", "plan", "poisoned", "world")

    def __init__(
        self, plan: _Plan, op: str, group: Any, world: int, poisoned: Callable[[], None] | None
    ) -> None:
        self.plan = plan
        self.op = op
        self.group = group
        self.world = world
        # on the fast path of the layout check: what to do if the first bucket's flags are poisoned
        self.poisoned = poisoned
        self.launched = 0
        self.pending: list[tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, Any]] = []

    def stage(self, b: int, parts: Sequence[Any]) -> tuple[Any, ...]:
        """Pack bucket ``b`` from ``parts`` (``FlatPool.pack``'s, one per run), ready to start."""
        bucket = self.plan.buckets[b]
        res, runs = bucket.results.take()
        # a mean divides before the sum, as DDP does: one pass with the copy, no overflow in fp16
        div = self.world if self.op == "mean" else 1
        if bucket.comm is None:
            comm = res
            bucket.results.pack(runs, parts, div=div)
        else:
            comm, comm_runs = bucket.comm.take()
            bucket.comm.pack(comm_runs, parts, div=div)
        if bucket.clear is not None:
            comm[-_FLAGS:].copy_(bucket.clear)
        return runs, comm, res, bucket.red

    def start(self, staged: tuple[Any, ...]) -> None:
        if self.launched == 1 and self.poisoned is not None:
            self.confirm()  # no second bucket before every rank is known to run this layout
        runs, comm, res, red = staged
        work = dist.all_reduce(comm, op=red, group=self.group, async_op=True)
        self.pending.append((runs, comm, res, work))
        self.launched += 1

    def confirm(self) -> None:
        """Wait for the first bucket and read its flags: the fast path's layout check."""
        poisoned, self.poisoned = self.poisoned, None
        _, comm, _, work = self.pending[0]
        work.wait()
        if poisoned is not None and comm[-_FLAGS].item() != 0:
            poisoned()  # a rank mirrored the agreed layout: it runs another one

    def launch(self, b: int, parts: Sequence[Any]) -> None:
        self.start(self.stage(b, parts))

    def finish(self, build: Callable[[Sequence[torch.Tensor]], Any]) -> Any:
        """``build`` of the results (one per unique tensor of the plan), returned once all landed.

        The results are views of the buckets' result buffers; the pools
        reuse a buffer only once all of its views are gone. Views of a buffer
        still being reduced in place are valid before its values land, so
        they and ``build``'s tree are made while the buckets are in flight,
        and handed out only after the waits.
        """
        views: list[torch.Tensor] = []
        for runs, _, _, _ in self.pending:
            views += FlatPool.views(runs)
        out = build(self.plan.reorder(views))
        if self.poisoned is not None:
            self.confirm()
        for _, comm, res, work in self.pending:
            work.wait()
            if comm is not res:
                res.copy_(comm)
        return out


def all_reduce(
    tree: Any,
    *,
    op: str = "mean",
    group: Any = None,
    bucket_cap_mb: float = 25.0,
    compress: str | None = None,
    check: bool = True,
) -> Any:
    """A new tree whose tensor leaves are the sum or mean of ``tree``'s over the ranks of ``group``.

    Collective: every rank calls it, in the same order, with a tree of the
    same layout. Leaves are packed per (device, dtype) into buckets of at
    most ``bucket_cap_mb`` (in the reverse order of the leaves, as DDP
    buckets gradients); every bucket is in flight at once, all are waited on
    at the end. ``compress="bf16"`` or ``"fp16"`` sends floating-point
    buckets in that dtype (divided by the world size first for ``"mean"``,
    as DDP's compression hooks) and returns leaves in their own dtype.
    ``op="mean"`` needs floating-point or complex leaves (``TypeError``
    naming the path otherwise); boolean leaves reduce with ``op="sum"`` to
    their logical or. Non-tensor leaves pass through by reference; a tensor
    at several positions is reduced once and stays one object.

    Each call checks the layout across ranks (``check=False`` skips it):
    trees that differ in structure, shape or dtype, or calls with different
    options, raise ``ValueError`` naming the difference on every rank. On
    the layout the group agreed on last, the check rides in the first
    bucket; switching back to the one before costs one small extra
    collective, a new layout two. ``tree`` is never modified, and
    never used as the reduction buffer. Without an initialised process
    group, or with one rank, ``tree`` itself is returned.

    >>> g = {"w": torch.ones(2, 2), "step": 3}
    >>> fr.distributed.all_reduce(g) is g  # no process group here: unchanged
    True
    """
    fn = "fr.distributed.all_reduce"
    _check_args(fn, op, compress)
    world = _world(group)
    if world == 1:
        return tree
    _not_transformed(fn)
    plan, leaves = _plan_for(tree, fn, op, bucket_cap_mb, compress, None)
    if not plan.unique:  # nothing to reduce; the check still catches a rank that has tensors
        if check:
            _agree(plan, tree, group, world, fn)
        return tree
    with plan.lock:
        fast = check and _agree(plan, tree, group, world, fn)
        poisoned = (lambda: plan.mismatch(tree, group, fn)) if fast else None
        red = _Reduction(plan, op, group, world, poisoned)
        tensors = leaves if plan.bare else [leaves[i] for i in plan.unique]
        staged = [red.stage(b, plan.parts(b, tensors)) for b in range(len(plan.buckets))]
        for st in staged:
            red.start(st)
        return red.finish(lambda results: _rebuild(plan, leaves, results))


def broadcast(tree: Any, *, src: int = 0, group: Any = None, check: bool = True) -> Any:
    """A new tree whose tensor leaves equal rank ``src``'s; the input is unchanged.

    The initial sync DDP does at construction (and, for buffers, at every
    forward). Collective, coalesced as ``all_reduce``, with the cross-rank
    check (here one tiny collective on every call). ``src`` is a global
    rank. On rank ``src`` the result holds the given tensors themselves
    (their values are the answer); on the others fresh tensors. Without an
    initialised process group, or with one rank, ``tree`` itself is returned.

    >>> s = fr.state(nn.Linear(2, 2))
    >>> fr.distributed.broadcast(s, src=0) is s  # no process group here: unchanged
    True
    """
    fn = "fr.distributed.broadcast"
    world = _world(group)
    if world == 1:
        return tree
    _not_transformed(fn)
    if not 0 <= src < dist.get_world_size():
        raise ValueError(
            f"{fn}: src={src} is not a rank of the default group (0..{dist.get_world_size() - 1})"
        )
    plan, leaves = _plan_for(tree, fn, "sum", 25.0, None, src)
    if not plan.unique:  # nothing to send; the check still catches a rank that has tensors
        if check:
            plan.verify(plan.probe(group), tree, group, fn)
        return tree
    root = dist.get_rank() == src
    with plan.lock:
        probe = plan.probe(group) if check else None
        staged = []
        tensors = leaves if plan.bare else [leaves[i] for i in plan.unique]
        for b, bucket in enumerate(plan.buckets):
            flat, runs = bucket.results.take()
            if root:
                bucket.results.pack(runs, plan.parts(b, tensors))
            staged.append((flat, runs))
        if probe is not None:
            plan.verify(probe, tree, group, fn)
        pending = [
            (runs, dist.broadcast(flat, src=src, group=group, async_op=True))
            for flat, runs in staged
        ]
        views: list[torch.Tensor] = []
        for runs, work in pending:
            work.wait()
            if not root:
                views += FlatPool.views(runs)
    if root:  # a new tree holding the given tensors: their values are the answer
        return optree.tree_unflatten(plan.spec, leaves)
    return _rebuild(plan, leaves, plan.reorder(views))


def sync_buffers(buffers: Any, *, mode: str = "broadcast", src: int = 0, group: Any = None) -> Any:
    """Make buffers (BatchNorm statistics ...) agree across ranks; the explicit buffer policy.

    ``mode="broadcast"``: every rank gets rank ``src``'s buffers, what
    DistributedDataParallel does before every forward (``broadcast_buffers=True``);
    call it before each step's forward to match DDP exactly.
    ``mode="mean"``: floating-point buffers become their mean over the ranks
    (running statistics of the whole global batch, roughly); the others
    (``num_batches_tracked``) are broadcast from ``src``. The composable
    ``replicate`` never syncs buffers: not calling this matches it.

    >>> b = fr.state(nn.BatchNorm1d(3)).buffers
    >>> fr.distributed.sync_buffers(b, mode="mean") is b  # no process group here
    True
    """
    fn = "fr.distributed.sync_buffers"
    if mode == "broadcast":
        return broadcast(buffers, src=src, group=group)
    if mode != "mean":
        raise ValueError(f"{fn}: mode must be 'broadcast' or 'mean', got {mode!r}")
    if _world(group) == 1:
        return buffers
    floating = optree.tree_map(
        lambda x: x if isinstance(x, torch.Tensor) and x.is_floating_point() else None,
        buffers,
        none_is_leaf=True,
    )
    others = optree.tree_map(
        lambda x: None if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
        buffers,
        none_is_leaf=True,
    )
    means = all_reduce(floating, op="mean", group=group)
    synced = broadcast(others, src=src, group=group)
    return optree.tree_map(lambda m, s: s if m is None else m, means, synced, none_is_leaf=True)


def grad_and_value(
    fn: Callable[..., Any],
    *,
    op: str = "mean",
    group: Any = None,
    bucket_cap_mb: float = 25.0,
    has_aux: bool = False,
    argnums: int = 0,
    compress: str | None = None,
    check: bool = True,
) -> Callable[..., tuple[Any, Any]]:
    """``fr.grad_and_value`` whose gradients come back all-reduced over ``group``, as DDP's.

    ``g(*args) -> (grads, value)``: ``grads`` equals
    ``fr.distributed.all_reduce(fr.grad_and_value(fn)(*args)[0], op=op, ...)``,
    ``value`` (with ``has_aux``, ``(value, aux)``) is this rank's. Buckets are
    cut in the reverse order of the leaves of ``args[argnums]`` (the order
    their gradients become ready), and each bucket's all-reduce starts from a
    hook on this call's own fresh leaves as soon as its last gradient is
    computed, while the backward pass goes on (DDP's overlap); the remaining
    buckets start when it ends, always in the same order on every rank.
    No module is touched and no hook outlives the call. When an input
    already carries an autograd graph, it computes ``fr.grad_and_value``
    then ``all_reduce``. Collectives cannot run under a ``torch.func``
    transform: there it raises ``RuntimeError`` (as ``all_reduce`` and
    ``broadcast`` do).

    >>> w = {"a": torch.tensor(2.0)}
    >>> g = fr.distributed.grad_and_value(lambda w, x: w["a"] * x)
    >>> g(w, torch.tensor(3.0))  # no process group here: the local gradient
    ({'a': tensor(3.)}, tensor(6.))
    """
    name = "fr.distributed.grad_and_value"
    _check_args(name, op, compress)
    if not isinstance(argnums, int):
        raise TypeError(f"{name}: argnums must be an int, got {argnums!r}")
    local = _local_grad_and_value(fn, argnums=argnums, has_aux=has_aux)

    def reduce(grads: Any) -> Any:
        return all_reduce(
            grads, op=op, group=group, bucket_cap_mb=bucket_cap_mb, compress=compress, check=check
        )

    def wrapper(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        world = _world(group)
        if world == 1:
            return local(*args, **kwargs)
        _not_transformed(name)
        if not -len(args) <= argnums < len(args):
            return local(*args, **kwargs)  # let fr.grad_and_value raise its error
        n = argnums % len(args)
        tree = args[n]
        plan, leaves = _plan_for(
            tree, "fr.distributed.all_reduce", op, bucket_cap_mb, compress, None
        )
        rest: list[Any] = optree.tree_leaves((args[:n], args[n + 1 :], kwargs))  # type: ignore[arg-type]
        if (
            not plan.bare  # non-tensor or tied leaves: let fr.grad_and_value deal with them
            or any(map(_REQUIRES_GRAD, leaves))
            or any(isinstance(t, torch.Tensor) and t.requires_grad for t in rest)
        ):
            # an outer autograd graph, which torch.func keeps: its gradient, then reduce
            grads, value = local(*args, **kwargs)
            return reduce(grads), value
        with plan.lock:
            # a rank off the agreed layout mirrors it (and checks) before its forward pass
            fast = check and _agree(plan, tree, group, world, name)
            poisoned = (lambda: plan.mismatch(tree, group, name)) if fast else None
            return _overlapped(
                fn, args, kwargs, n, has_aux, plan, leaves, op, group, world, poisoned, name
            )

    wrapper.__doc__ = getattr(fn, "__doc__", None)
    wrapper.__name__ = f"distributed.grad_and_value({getattr(fn, '__name__', 'fn')})"
    return wrapper


def _overlapped(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    argnums: int,
    has_aux: bool,
    plan: _Plan,
    leaves: list[Any],
    op: str,
    group: Any,
    world: int,
    poisoned: Callable[[], None] | None,
    name: str,
) -> tuple[Any, Any]:
    """The backward pass with each bucket's all-reduce launched from gradient hooks.

    On the fast path of the layout check (``poisoned`` given), the first
    bucket's flags are read just before the second bucket starts (from a
    later hook, or once the backward pass is over), so it rarely blocks.
    """
    layout = plan.diff_layout(set(map(type, leaves)) <= PLAIN)  # plain tensors only: stacks
    made = layout.leaves.make(leaves)
    if made is None:  # a tensor to stack is not contiguous: one leaf a tensor
        layout = plan.diff_layout(False)
        made = layout.leaves.make(leaves)
    assert made is not None
    diff, fresh = made
    new_args = list(args)
    new_args[argnums] = optree.tree_unflatten(plan.spec, fresh)
    red = _Reduction(plan, op, group, world, poisoned)
    nb = len(plan.buckets)
    ready: list[list[torch.Tensor | None]] = [[None] * len(span) for span in layout.spans]
    missing = [len(span) for span in layout.spans]
    handles = []

    def launch_ready() -> None:
        # Buckets start in plan order on every rank, whatever order their gradients come in.
        while red.launched < nb and missing[red.launched] == 0:
            b = red.launched
            red.launch(b, layout.parts(b, ready[b]))  # type: ignore[arg-type]

    def hook_for(b: int, j: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            ready[b][j] = grad
            missing[b] -= 1
            if missing[b] == 0:
                launch_ready()

        return hook

    # The last bucket can only start once the backward pass is over: no hooks there.
    for b, span in enumerate(layout.spans[:-1]):
        for j, d in enumerate(span):
            handles.append(diff[d].register_hook(hook_for(b, j)))
    try:
        with torch.enable_grad():
            value, aux = split_output(fn(*new_args, **kwargs), has_aux, name)
            grads = gradients(value, diff)
    finally:
        for h in handles:
            h.remove()
    # Buckets with an unused leaf (its hook never fired) and the last one start now, in order.
    for b in range(red.launched, nb):
        span = layout.spans[b]
        red.launch(b, layout.parts(b, grads[span.start : span.stop]))
    rest = detached(value, aux, has_aux)  # while the buckets are in flight
    grads_tree = red.finish(lambda results: _rebuild(plan, leaves, results))
    return grads_tree, rest
