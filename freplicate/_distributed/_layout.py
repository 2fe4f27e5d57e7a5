"""Layouts: a tree's tensors cut into buckets, one pure description shared by every path.

A *layout* is what fr.distributed knows of a tree to move it: which leaves
are tensors (a tied tensor once), their shapes, dtypes and memory orders,
the buckets they travel in, where each lies in its bucket, and the
fingerprint that ranks compare. It is plain data (tuples, ints, dtypes)
built from the leaves' signatures alone, so the eager path caches it and the
traced path has Dynamo bake it into the graph: one layout for every kind of
collective, eager and compiled, and one text for what differs between two
ranks' layouts. How a bucket is laid out in its buffer is its kind's
(``_wire``); which tensors share a bucket is decided here.

Buckets follow DDP's: dense tensors in the reverse of the leaves' order (the
order gradients become ready), per (device, dtype), cut as DDP cuts them
(a bucket closes once it reaches ``bucket_cap_mb``; at the default cap the
first holds 1 MiB, so that it starts early in a backward pass). The kind, the options and every tensor's signature are part
of the fingerprint: calls that differ in any of them never meet in a
collective as if they were one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from .._pack import group_by
from . import _flags
from ._options import Options
from ._wire import KINDS, Bucket, Kind, Run, adds_as_bits, aligned, carrier

__all__ = [
    "FIRST_BUCKET_BYTES",
    "Layout",
    "Sig",
    "Tree",
    "build",
    "difference",
]

# DDP's first bucket (``dist._DEFAULT_FIRST_BUCKET_BYTES``), at its default cap
FIRST_BUCKET_BYTES = 1024 * 1024
DEFAULT_CAP_MB = 25.0

#: a tensor leaf's signature: (shape, dtype, device, layout, memory order (``None``: contiguous))
Sig = tuple[tuple[int, ...], torch.dtype, torch.device, torch.layout, "tuple[int, ...] | None"]


class Tree(NamedTuple):
    """What a layout is built from: a tree's leaves as paths and signatures.

    ``sigs[i]`` is ``None`` for a leaf that is not a tensor; ``slot[i]``: the
    tensor leaf ``i`` holds (``-1``: not a tensor), tied leaves sharing one,
    ``None`` when every leaf is a tensor of its own; ``whole``: per tensor,
    whether every rank holds it whole (``None``: the 0-dim ones).
    """

    paths: Sequence[str]
    sigs: Sequence[Sig | None]
    slot: Sequence[int] | None = None
    whole: Sequence[bool] | None = None


class Layout(NamedTuple):
    """A tree's layout for one kind of call with given options (see the module's text)."""

    options: Options
    wire: str  # the kind whose format and transport carry the call (``Kind.on``: per backend)
    world: int  # the chunks a bucket travels as (1 for a reduction)
    leaves: int  # how many leaves the tree has
    unique: tuple[int, ...]  # the leaf of each tensor (the first position of a tied one)
    slot: tuple[int, ...] | None  # per leaf, its tensor (-1: none); None: leaf i is tensor i
    sigs: tuple[Sig, ...]  # per tensor
    whole: tuple[bool, ...]  # per tensor: held whole by every rank
    sparse: tuple[int, ...]  # tensors reduced one by one after the buckets (sparse COO)
    local: tuple[int, ...]  # tensors that stay as they are (held whole, in an all-gather)
    buckets: tuple[Bucket, ...]
    arrival: tuple[int, ...]  # the tensor of each result: bucket by bucket, then sparse, local
    fingerprint: int
    description: tuple[Any, ...]  # what ranks compare: paths, signatures, ties, kind, options

    @property
    def kind(self) -> Kind:
        """The kind that carries the call (its wire format and transport)."""
        return KINDS[self.wire]

    def carries_check(self, world: int) -> bool:
        """Whether the check can ride in the buckets' words (``_flags``), so no probe is needed.

        A word sums up to the world size, which every bucket with words must
        hold exactly: a byte-sized integer must not wrap round, a bf16 or fp16
        word must not round (boolean buckets reduce with MAX: no sum).
        """
        return all(world <= _exact(b.comm) for b in self.buckets if b.extra and not b.maximum)


def _exact(dtype: torch.dtype) -> int:
    """The largest integer up to which every integer is exact in ``dtype``.

    >>> _exact(torch.bfloat16), _exact(torch.float16), _exact(torch.uint8)
    (256, 2048, 255)
    """
    if dtype.is_complex:
        dtype = dtype.to_real()
    if dtype.is_floating_point:
        return int(2 / torch.finfo(dtype).eps)
    return int(torch.iinfo(dtype).max)


def build(
    tree: Tree, options: Options, world: int, caller: str, words: torch.device, backend: str
) -> Layout:
    """The layout of a tree of these leaves for ``options`` over ``world`` ranks.

    ``world``: the group's size (it cuts the rowed kinds' tensors into rows);
    ``words``: where the flag words travel when no tensor is bucketed (a
    bucket of words only: every call has one, so that its words, failure
    and retry included, always reach every rank); ``backend``: the group's,
    which (with the call's bytes) chooses the kind that carries the call
    (``Kind.on``), the same on every rank.

    Raises:
        TypeError: a tensor that cannot travel (a layout other than strided
            or, in a reduction, sparse COO; the meta device; a dtype the
            backend carries in no form, or, in a reduction, one it cannot
            add: float8 on gloo), or an integer or bool tensor in a mean,
            named by its path.
    """
    unique = _unique(tree)
    public = options.collective
    nbytes = sum(_numel(s[0]) * s[1].itemsize for s in (tree.sigs[i] for i in unique) if s)
    kind = public.on(backend, nbytes)
    sigs = tuple(_tensor_sig(tree.sigs[i], kind) for i in unique)
    whole = tuple(tree.whole) if tree.whole is not None else tuple(not s[0] for s in sigs)
    _check(sigs, [tree.paths[i] for i in unique], options, caller, backend)
    chunks = kind.chunks(world)
    sparse = tuple(k for k, s in enumerate(sigs) if s[3] == torch.sparse_coo)
    local = tuple(k for k in range(len(sigs)) if kind.gathers and whole[k])
    outside = set(sparse) | set(local)
    dense = [k for k in range(len(sigs)) if k not in outside]
    cuts = _cuts(sigs, dense[::-1], options, kind, chunks, backend)
    made = [
        _bucket(sigs, whole, members, comm, _flags.extra(b, len(cuts) - 1), (chunks, world), kind)
        for b, (members, comm) in enumerate(cuts)
    ]
    if not made:
        made.append(_words_only(sigs[sparse[0]][2] if sparse else words, chunks))
    description = _description(tree, whole, options, caller)
    digest = hashlib.blake2b(repr(description).encode(), digest_size=8).digest()
    return Layout(
        options=options,
        wire=kind.name,
        world=chunks,
        leaves=len(tree.sigs),
        unique=unique,
        slot=None if tree.slot is None else tuple(tree.slot),
        sigs=sigs,
        whole=whole,
        sparse=sparse,
        local=local,
        buckets=tuple(made),
        arrival=tuple(k for bucket in made for k in bucket.members) + sparse + local,
        fingerprint=int.from_bytes(digest, "little") >> 1,  # fits an int64
        description=description,
    )


def _unique(tree: Tree) -> tuple[int, ...]:
    """The leaf of each tensor: every tensor leaf, a tied one at its first position."""
    if tree.slot is None:
        return tuple(range(len(tree.sigs)))
    firsts: dict[int, int] = {}
    for i, s in enumerate(tree.slot):
        if s >= 0:
            firsts.setdefault(s, i)
    return tuple(firsts[s] for s in range(len(firsts)))


def _tensor_sig(sig: Sig | None, kind: Kind) -> Sig:
    assert sig is not None  # ``unique`` lists tensors only
    order = kind.keeps(sig[4])
    return sig if order == sig[4] else (*sig[:4], order)  # type: ignore[return-value]


def _description(
    tree: Tree, whole: tuple[bool, ...], options: Options, caller: str
) -> tuple[Any, ...]:
    """What ranks compare (and hash): paths, signatures, ties, held-whole tensors, kind, options,
    and the function that calls (two functions of one kind and options are two calls)."""
    sigs = tuple(
        None if s is None else (tuple(s[0]), str(s[1]), s[2].type, str(s[3]), s[4])
        for s in tree.sigs
    )
    slot = None if tree.slot is None else tuple(tree.slot)
    return (tuple(tree.paths), sigs, slot, whole, options.kind, options.describe(), caller)


def _words_only(device: torch.device, chunks: int) -> Bucket:
    """A bucket of flag words only (a call without dense tensors: sparse ones, or only tensors
    an all-gather leaves where they are), cut as every bucket is: no run, no padding, the words."""
    f = _flags.FIRST
    return Bucket((), (), torch.float32, torch.float32, device, False, f, f, chunks, (0, f))


def _check(
    sigs: Sequence[Sig], paths: Sequence[str], options: Options, caller: str, backend: str
) -> None:
    kind = options.collective
    for (_, dtype, device, layout, _), path in zip(sigs, paths):
        _check_dtype(dtype, path, kind, caller, backend)
        if layout != torch.strided and not (layout == torch.sparse_coo and kind.takes_sparse):
            dense = "" if kind.takes_sparse else f" (a {kind.name} takes dense tensors only)"
            raise TypeError(
                f"{caller}: the tensor at {path} has layout {layout}, which cannot be packed into "
                f"a flat buffer{dense}; convert it (e.g. .to_dense()) or keep it out of the tree"
            )
        if device.type == "meta":
            raise TypeError(
                f"{caller}: the tensor at {path} is on the meta device, which holds no values to "
                "send to other processes; materialise it (e.g. .to_empty()) first"
            )
        if (
            options.op == "mean"
            and kind.divides
            and not (dtype.is_floating_point or dtype.is_complex)
        ):
            raise TypeError(
                f"{caller}: op='mean' needs floating-point or complex leaves, but the leaf at "
                f"{path} is {dtype}; use op='sum' or convert it"
            )


def _check_dtype(dtype: torch.dtype, path: str, kind: Kind, caller: str, backend: str) -> None:
    """A dtype the backend cannot carry raises, named with its path, before any data moves: one
    it has no same-size integer for, or one whose bytes it carries but whose sum it cannot make
    (float8 on gloo): a gather or a broadcast copies its bytes, a reduction would add them."""
    bits = carrier(dtype, backend)
    if bits is None:
        raise TypeError(
            f"{caller}: the tensor at {path} is {dtype}, which the {backend} backend cannot "
            f"carry (it has no {8 * dtype.itemsize}-bit integer to send its bytes as); convert it "
            "(e.g. .to(torch.int32)) or keep it out of the tree"
        )
    if bits != dtype and kind.adds and not adds_as_bits(dtype):
        raise TypeError(
            f"{caller}: the tensor at {path} is {dtype}, which the {backend} backend cannot add "
            f"(the {kind.name} sums it across ranks; gathers and broadcasts carry it as its bytes); "
            "keep it out of the reduction (frozen: requires_grad=False) or convert it "
            "(e.g. .float()) first"
        )


def _comm(dtype: torch.dtype, options: Options, backend: str) -> torch.dtype:
    """The dtype a bucket of ``dtype`` tensors travels in (``carrier``: its bytes, as a same-size
    integer, where the backend cannot carry it)."""
    if options.comm is not None and dtype.is_floating_point and dtype.itemsize > 2:
        return options.comm
    if dtype == torch.bool:
        return torch.uint8  # reduced with MAX: a logical or, as ``a + b`` on bools
    return carrier(dtype, backend) or dtype


def _cuts(
    sigs: Sequence[Sig],
    order: Sequence[int],
    options: Options,
    kind: Kind,
    chunks: int,
    backend: str,
) -> list[tuple[list[int], torch.dtype]]:
    """Each bucket's tensors (grouped by shape) and the dtype it travels in, in launch order.

    DDP's rule (``_compute_bucket_assignment_by_size``): per (device, dtype),
    tensors join the open bucket in ``order``, which closes once its bytes
    reach the limit (so a bucket may pass it by its last tensor); in a
    gradient step (``options.overlap``) the first bucket of each kind has
    DDP's first limit (1 MiB at the default ``bucket_cap_mb``, else the cap),
    so that it starts early in the backward pass; closed buckets come in the
    order they closed, then the open ones. The same number of collectives as
    DDP; a ready tree's call, as few as the cap allows.
    """
    overlapped = options.overlap and options.bucket_cap_mb == DEFAULT_CAP_MB
    first = FIRST_BUCKET_BYTES if overlapped else options.cap_bytes
    open_: dict[Any, tuple[list[int], int, int]] = {}  # per kind: members, bytes, closed so far
    closed: list[list[int]] = []
    for k in order:
        shape, dtype, device, _, _ = sigs[k]
        members, size, nth = open_.get((device, dtype), ([], 0, 0))
        members.append(k)
        cell = kind.cell(shape, not shape, chunks)
        size += chunks * _numel(cell) * _comm(dtype, options, backend).itemsize
        if size >= (first if nth == 0 else options.cap_bytes):
            closed.append(members)
            members, size, nth = [], 0, nth + 1
        open_[(device, dtype)] = (members, size, nth)
    out = []
    for members in closed + [m for m, _, _ in open_.values() if m]:
        # equal shapes side by side: one stack packs them, one unbind views them back
        by_shape = group_by(members, lambda k: (sigs[k][0], sigs[k][4]))
        grouped = [members[p] for same in by_shape.values() for p in same]
        out.append((grouped, _comm(sigs[members[0]][1], options, backend)))
    return out


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _bucket(
    sigs: Sequence[Sig],
    whole: Sequence[bool],
    members: list[int],
    comm: torch.dtype,
    extra: int,
    cut: tuple[int, int],
    kind: Kind,
) -> Bucket:
    """A bucket of ``members``; ``cut``: the chunks it travels as, and the ranks its rows are for."""
    chunks, world = cut
    _, dtype, device, _, _ = sigs[members[0]]
    runs: list[Run] = []
    start = 0
    for (shape, order, held), count in _runs_of(
        [(sigs[k][0], sigs[k][4], whole[k]) for k in members]
    ):
        run = kind.run(shape, order, held, count, start, chunks, (dtype, comm))
        runs.append(run)
        start += run.width
    # several chunks: each starts aligned too (the words end a chunk; padding goes before them)
    pad = aligned(start + extra, dtype, comm) - start - extra if chunks > 1 else 0
    return Bucket(
        members=tuple(members),
        runs=tuple(runs),
        dtype=dtype,
        comm=comm,
        device=device,
        maximum=dtype == torch.bool,
        extra=extra,
        chunk=start + pad + extra,
        chunks=chunks,
        widths=(*(run.width for run in runs), pad, extra),
        gathered=kind.gathered(runs, chunks, dtype),
        ranks=world,
    )


def _runs_of(keys: Sequence[Any]) -> list[tuple[Any, int]]:
    out: list[tuple[Any, int]] = []
    for key in keys:
        if out and out[-1][0] == key:
            out[-1] = (key, out[-1][1] + 1)
        else:
            out.append((key, 1))
    return out


# --- what differs between two ranks' layouts -------------------------------------------


def difference(
    mine: tuple[str, tuple[Any, ...]], rank: int, theirs: tuple[str, tuple[Any, ...]], other: int
) -> str:
    """Words for the first difference between two ranks' ``(caller, description)``.

    The same text eager and compiled: every mismatch error names it.
    """
    caller_a, (paths_a, sigs_a, slot_a, whole_a, kind_a, opts_a, _) = mine
    caller_b, (paths_b, sigs_b, slot_b, whole_b, kind_b, opts_b, _) = theirs
    on = f"on rank {rank}"
    there = f"on rank {other}"
    if caller_a != caller_b:
        return (
            f"ranks called different functions: {caller_a} {on}, {caller_b} {there}; "
            "every rank must make the same calls in the same order"
        )
    if kind_a != kind_b:
        return (
            f"ranks called different collectives: {kind_a} {on}, {kind_b} {there} (e.g. "
            "shard=True on one rank only); every rank must make the same calls in the same order"
        )
    if opts_a != opts_b:
        return (
            f"the call's options differ across ranks: {opts_a} {on}, {opts_b} {there}; every rank "
            "must pass the same op, bucket_cap_mb, compress and src, and a weight on every rank "
            "or on none"
        )
    structure = _structure(paths_a, sigs_a, on, paths_b, sigs_b, there)
    if structure is not None:
        return f"the tree's structure differs across ranks: {structure}; every rank must pass a tree of the same structure"
    tensors = _tensors(paths_a, sigs_a, on, sigs_b, there)
    if tensors is not None:
        return f"the tensor at {tensors}"
    if slot_a != slot_b:
        return (
            "tied (aliased) leaves differ across ranks: the same tensor object sits at "
            f"different positions of the tree {on} and {there}"
        )
    if whole_a != whole_b:
        return f"the tensors held whole by every rank differ across ranks: {whole_a} {on}, {whole_b} {there}"
    return "the tree layout differs across ranks"  # pragma: no cover


def _tensors(
    paths: Sequence[str], sigs_a: Sequence[Any], on: str, sigs_b: Sequence[Any], there: str
) -> str | None:
    """The first tensor whose signature differs, and how (after the structure agreed)."""
    for path, a, b in zip(paths, sigs_a, sigs_b):
        if a is None or a == b:
            continue
        if a[3] != b[3]:
            return (
                f"{path} differs across ranks: layout {a[3]} {on}, {b[3]} {there}; every rank "
                "must pass tensors of the same layouts"
            )
        if a[:3] == b[:3]:
            return (
                f"{path} differs across ranks in memory format: dims in memory order {a[4]} {on}, "
                f"{b[4]} {there} (None: contiguous); every rank must pass tensors of the same "
                "memory format (e.g. channels_last on every rank)"
            )
        return (
            f"{path} differs across ranks: shape {a[0]}, dtype {a[1]} {on}; shape {b[0]}, dtype "
            f"{b[1]} {there}; every rank must pass tensors of the same shapes and dtypes"
        )
    return None


def _structure(
    paths_a: Sequence[str],
    sigs_a: Sequence[Any],
    on: str,
    paths_b: Sequence[str],
    sigs_b: Sequence[Any],
    there: str,
) -> str | None:
    """Where two trees' leaves part, from their paths (and which leaves are tensors)."""
    for k in range(max(len(paths_a), len(paths_b))):
        a = paths_a[k] if k < len(paths_a) else None
        b = paths_b[k] if k < len(paths_b) else None
        if a is None:
            return f"a leaf at {b} {there}, none there {on} (its tree ends after {k} leaves)"
        if b is None:
            return f"a leaf at {a} {on}, none there {there} (its tree ends after {k} leaves)"
        if a != b:
            return f"leaf {k} is at {a} {on}, at {b} {there}"
        if (sigs_a[k] is None) != (sigs_b[k] is None):
            what = (
                ("a tensor", "not a tensor") if sigs_b[k] is None else ("not a tensor", "a tensor")
            )
            return f"the leaf at {a} is {what[0]} {on}, {what[1]} {there}"
    return None
