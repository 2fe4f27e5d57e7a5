"""Plans: a tree layout turned once into deduplicated tensors and buckets, and their cache.

A tree's layout (structure, shapes, dtypes, aliasing and the call's options)
is turned once into a *plan*: tensors grouped per (device, dtype) with the
core engine (``_pack``), in DDP's order (reverse of the leaves, the order
gradients become ready), cut into buckets of at most ``bucket_cap_mb`` (the
first of at most 1 MiB, as DDP's). Each bucket packs into a flat buffer taken
from a small pool (``_pack.FlatPool``), is reduced there in place, and comes
back as views of it; the pool hands a buffer out again only once no view of
it is alive, so results of successive calls never alias, and a training loop
reuses two buffers instead of paying a large allocation (page faults) every
step. Sparse tensors are not bucketed: each is reduced on its own.
"""

from __future__ import annotations

import hashlib
import operator
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import optree
import torch
import torch.distributed as dist

from .._caches import register
from .._checks import check_mean
from .._pack import FlatPool, buckets, check_packable, group_by
from .._tree import LazyPaths, alias_groups, flatten_in_order, picker, rebuild, tensor_values
from .._typing import Compress, Op, TensorTree

if TYPE_CHECKING:
    from .grad import _DiffLayout

__all__ = [
    "COMPRESS",
    "FAILED",
    "FLAGS",
    "KNOWN",
    "MORE",
    "OFF",
    "ON",
    "WEIGHT",
    "Bucket",
    "FirstCollective",
    "Plan",
    "clear_plans",
    "plan_for",
    "rebuild_tree",
]

COMPRESS: dict[Compress, torch.dtype | None] = {
    None: None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
_PLAN_CACHE_SIZE = 16
# DDP's first bucket (``dist._DEFAULT_FIRST_BUCKET_BYTES``): small, so it starts early in the
# backward pass, and the layout check it carries (``agree``) is read back soon and cheaply.
_FIRST_BUCKET_BYTES = 1024 * 1024
# How many layouts each group remembers as run by every rank (``agree``).
KNOWN = 8
# The trailing elements of a plan's first bucket, as negative indices: [off the expected layout,
# on it, failed, weight, more, then one per known layout: not on it]. Each flag sums up to the
# world size; only "> 0" is read (see ``agree``). *weight* is the rank's weight in a weighted
# mean (summed: the divisor); *more* is the rank's bit for ``fr.distributed.join`` (any rank
# has a next item). The last bucket, when it is another, ends with [failed] alone.
FLAGS = 5 + KNOWN
OFF, ON, FAILED, WEIGHT, MORE = range(-FLAGS, -FLAGS + 5)


class FirstCollective(NamedTuple):
    """A plan's first collective, which a rank on another layout mirrors (``agree``)."""

    numel: int
    dtype: torch.dtype
    device: torch.device
    op: Any  # a dist.ReduceOp


class Bucket:
    """One bucket of a plan: which tensors it holds, and its reusable flat buffers.

    ``results`` holds buffers in the leaves' dtype, reduced in place and
    handed out as views (reused once those views are gone); ``comm``, only
    where the bucket travels in another dtype (compression, booleans), is
    the plan's private buffer in that dtype. The plan's first bucket has
    ``FLAGS`` spare elements at the end of both, the layout check's flags; a
    last bucket that is not the first has one, the failed flag. ``clear``:
    those elements on a call that runs the expected layout and did not fail.
    """

    __slots__ = (
        "clear",
        "comm",
        "comm_dtype",
        "dtype",
        "extra",
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
        self.extra = extra
        self.clear: torch.Tensor | None = None
        if extra:
            self.clear = torch.zeros(extra, dtype=comm_dtype, device=first.device)
            if extra == FLAGS:
                self.clear[ON] = 1


def _extra(b: int, last: int) -> int:
    """Flag elements at the end of bucket ``b`` of ``last + 1``: the layout flags, or failed."""
    if b == 0:
        return FLAGS
    return 1 if b == last else 0


class Plan:
    """What one tree layout needs: deduplication, buckets, and the cross-rank fingerprint."""

    def __init__(
        self,
        spec: optree.PyTreeSpec,
        leaves: Sequence[Any],
        unique: list[int],
        slot: list[int] | None,
        caller: str,
        op: Op,
        cap_bytes: int,
        compress: torch.dtype | None,
        options: tuple[Any, ...],
    ) -> None:
        self.spec = spec
        self.unique = unique
        self.slot = slot
        self.lock = threading.RLock()  # a user's fn may itself reduce a tree of this layout
        tensors = [leaves[i] for i in unique]
        paths = LazyPaths(spec, unique)
        # sparse COO tensors (nn.Embedding(sparse=True)'s gradients) are reduced one by one
        self.sparse = [k for k, t in enumerate(tensors) if t.layout == torch.sparse_coo]
        dense = [k for k, t in enumerate(tensors) if t.layout != torch.sparse_coo]
        check_packable([tensors[k] for k in dense], dense, paths, caller=caller)
        for k, t in enumerate(tensors):
            if t.is_meta:
                raise TypeError(
                    f"{caller}: the tensor at {paths[k]} is on the meta device, which holds no "
                    "values to send to other processes; materialise it (e.g. .to_empty()) first"
                )
        if op == "mean":
            check_mean(caller, tensors, paths)
        # DDP's order: the last parameters' gradients are ready first.
        order = dense[::-1]
        cuts: list[tuple[list[int], torch.dtype]] = []  # each bucket's tensors, and its dtype
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
            if not cuts:  # the plan's first bucket: DDP's smaller cap
                cut = buckets(numels, comm.itemsize, min(cap_bytes, _FIRST_BUCKET_BYTES))[0]
                rest = buckets(numels[cut.stop :], comm.itemsize, cap_bytes)
                runs = [cut] + [range(r.start + cut.stop, r.stop + cut.stop) for r in rest]
            for run in runs:
                # equal shapes side by side: one stack packs them, one unbind views them back
                by_shape = group_by([tensors[members[r]] for r in run], lambda t: t.shape)
                cuts.append(([members[run[p]] for same in by_shape.values() for p in same], comm))
        last = len(cuts) - 1
        self.buckets = [
            Bucket(ids, [tensors[k] for k in ids], comm, extra=_extra(b, last))
            for b, (ids, comm) in enumerate(cuts)
        ]
        # results come out bucket by bucket, then the sparse ones; this puts them back in order
        came = [k for b in self.buckets for k in b.members] + self.sparse
        where = {k: j for j, k in enumerate(came)}
        inverse = [where[k] for k in range(len(tensors))]
        self.reorder = picker(inverse)
        self.bare = slot is None and len(unique) == len(leaves)  # only tensors, no aliasing
        sig = [(tuple(t.shape), str(t.dtype), t.device.type, str(t.layout)) for t in tensors]
        self.description = (str(spec), sig, slot, options)
        digest = hashlib.blake2b(repr(self.description).encode(), digest_size=8).digest()
        self.fingerprint = int.from_bytes(digest, "little") >> 1  # fits an int64
        self.diff: dict[bool, _DiffLayout] = {}  # grad_and_value's, built on first use
        self.first: FirstCollective | None = None
        if self.buckets:
            b0 = self.buckets[0]
            self.first = FirstCollective(b0.results.numel, b0.comm_dtype, b0.results.device, b0.red)

    def sparse_tensors(self, tensors: Sequence[Any]) -> list[torch.Tensor]:
        """The sparse tensors out of ``tensors`` (one per unique tensor), in plan order."""
        return [tensors[k] for k in self.sparse]

    def parts(self, b: int, tensors: Sequence[Any]) -> list[list[Any]]:
        """Bucket ``b``'s tensors out of ``tensors`` (one per unique tensor), one list per run."""
        return [pick(tensors) for pick in self.buckets[b].run_picks]

    def speculates(self, world: int) -> bool:
        """Whether calls may run on the fast path, the check carried by the first bucket's flags.

        A flag slot sums up to ``world``: it must not wrap round to 0 in a
        byte-sized integer bucket (bool buckets reduce with MAX: no sum).
        """
        first = self.first
        if first is None:
            return False
        return first.dtype.itemsize > 1 or first.op == dist.ReduceOp.MAX or world < 256


_PLANS: dict[Any, Plan] = {}
_SIG = operator.attrgetter("shape", "dtype", "device", "layout")
_DICT = object()  # marks a plan key made from a plain dict's keys (``tensor_values``)
_PLANS_LOCK = threading.Lock()


def plan_for(
    tree: TensorTree,
    caller: str,
    op: Op,
    cap_mb: float,
    compress: Compress,
    src: int | None,
    weighted: bool = False,
) -> tuple[Plan, list[Any]]:
    """The cached plan of ``tree``'s layout with these options, and the tree's leaves.

    Plans are shared by every public function (``caller`` names the one that
    builds it, in its errors): ``grad_and_value``'s gradients and
    ``all_reduce``'s trees of one layout have one plan, and one pool.
    ``weighted``: a weighted mean, which every rank must run alike (an option).
    """
    options = (op, cap_mb, compress, src, weighted)
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
            unique, slot = alias_groups(leaves)
            key = (spec, tuple(_SIG(leaves[i]) for i in unique), tuple(slot), options)
            plan = _PLANS.get(key)
            if plan is not None:
                return plan, leaves
    plan = Plan(
        spec,
        leaves,
        unique,
        slot,
        caller,
        op,
        max(1, int(cap_mb * 1024 * 1024)),
        COMPRESS[compress],
        options,
    )
    with _PLANS_LOCK:
        _PLANS[key] = plan
        while len(_PLANS) > _PLAN_CACHE_SIZE:
            del _PLANS[next(iter(_PLANS))]  # the oldest layout
    return plan, leaves


def clear_plans() -> None:
    """Forget every plan, and with them their pooled buffers (``fr.clear_caches``)."""
    with _PLANS_LOCK:
        for plan in _PLANS.values():
            for bucket in plan.buckets:
                bucket.results.clear()
                if bucket.comm is not None:
                    bucket.comm.clear()
        _PLANS.clear()


register(clear_plans)


def rebuild_tree(plan: Plan, leaves: list[Any], results: Sequence[torch.Tensor]) -> TensorTree:
    """The tree of ``results`` (one per unique tensor), non-tensor leaves passed through."""
    if plan.bare:
        return optree.tree_unflatten(plan.spec, results)
    assert plan.slot is not None  # a plan that is not bare has non-tensor or tied leaves
    return rebuild(plan.spec, leaves, plan.slot, results)
