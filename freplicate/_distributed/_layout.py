"""Layouts: a tree's tensors cut into buckets, one pure description shared by every path.

A *layout* is what fr.distributed knows of a tree to move it: which leaves
are tensors (a tied tensor once), their shapes and dtypes, the buckets they
travel in, where each lies in its bucket, and the fingerprint that ranks
compare. It is plain data (tuples, ints, dtypes) built from the leaves'
signatures alone, so the eager path caches it and the traced path has Dynamo
bake it into the graph: one layout for ``all_reduce``, ``broadcast``,
``reduce_scatter`` and ``all_gather``, eager and compiled, and one text for
what differs between two ranks' layouts.

Buckets follow DDP's: dense tensors in the reverse of the leaves' order (the
order gradients become ready), per (device, dtype), cut as DDP cuts them
(a bucket closes once it reaches ``bucket_cap_mb``; at the default cap the
first holds 1 MiB, so that it starts early and its flag words (``_flags``)
come back soon). Within a bucket, tensors of
one shape sit side by side (a *run*: one stack packs them, one unbind views
them back).

A bucket travels as *chunks*. For a reduction (kind ``"reduce"``) there is
one: every tensor whole, then the flag words. For ``"scatter"`` and
``"gather"`` over W ranks, each tensor is cut into W chunks of rows, as
``torch.chunk`` cuts it (c = ceil(d0 / W) rows each, the last ones padded with
zeros), and the buffer holds W rank chunks, rank-major: chunk r holds rows
[r*c, (r+1)*c) of every tensor, then the flag words (FSDP2's copy-in). A
0-dim tensor is held whole by every rank: in a reduce-scatter its value
stands in every chunk; an all-gather leaves it where it is.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from .._pack import group_by
from . import _flags
from ._options import Options

__all__ = [
    "FIRST_BUCKET_BYTES",
    "Bucket",
    "First",
    "Layout",
    "Run",
    "Sig",
    "build",
    "difference",
    "valid_rows",
]

# DDP's first bucket (``dist._DEFAULT_FIRST_BUCKET_BYTES``), at its default cap
FIRST_BUCKET_BYTES = 1024 * 1024
DEFAULT_CAP_MB = 25.0

#: a tensor leaf's signature: (shape, dtype, device, layout)
Sig = tuple[tuple[int, ...], torch.dtype, torch.device, torch.layout]


class Run(NamedTuple):
    """Consecutive tensors of one shape in a bucket: where they lie in each chunk."""

    shape: tuple[int, ...]
    n: int  # how many tensors
    rows: int  # rows of each tensor in one chunk (the whole first dim for a reduction)
    start: int  # offset of the run in a chunk
    width: int  # elements of the run in one chunk

    @property
    def row(self) -> tuple[int, ...]:
        """The shape of one row (``()`` for a 0-dim tensor, whose value is one row)."""
        return self.shape[1:]


class Bucket(NamedTuple):
    """One bucket: its tensors (positions in ``Layout.sigs``) and its flat buffer's shape."""

    members: tuple[int, ...]
    runs: tuple[Run, ...]
    dtype: torch.dtype  # the tensors'
    comm: torch.dtype  # what the buffer travels in
    device: torch.device
    maximum: bool  # reduced with MAX (booleans, as uint8: a logical or) instead of SUM
    extra: int  # flag words at the end of each chunk
    chunk: int  # elements of one chunk: its runs, then the flag words
    chunks: int  # chunks in the full buffer: 1 for a reduction, W for scatter and gather
    widths: tuple[int, ...]  # a chunk cut in its runs, then the words (``split_with_sizes``)

    @property
    def data(self) -> int:
        """Elements of a chunk before its flag words."""
        return self.chunk - self.extra


class First(NamedTuple):
    """A layout's first collective: what a rank on another layout mirrors (``_agree``)."""

    kind: str
    chunk: int
    chunks: int
    comm: torch.dtype
    device: torch.device
    maximum: bool


class Layout(NamedTuple):
    """A tree's layout for one kind of call with given options (see the module's text)."""

    options: Options
    world: int  # the ranks the chunks are cut for (1 for a reduction)
    leaves: int  # how many leaves the tree has
    unique: tuple[int, ...]  # the leaf of each tensor (the first position of a tied one)
    slot: (
        tuple[int, ...] | None
    )  # per leaf, its tensor (-1: not a tensor); None: leaf i is tensor i
    sigs: tuple[Sig, ...]  # per tensor
    sparse: tuple[int, ...]  # tensors reduced one by one after the buckets (sparse COO)
    local: tuple[int, ...]  # tensors that stay as they are (0-dim ones in an all-gather)
    buckets: tuple[Bucket, ...]
    order: tuple[int, ...]  # the tensor of each result: bucket by bucket, then sparse, local
    fingerprint: int
    description: tuple[Any, ...]  # what ranks compare: paths, signatures, ties, options

    @property
    def first(self) -> First:
        b = self.buckets[0]
        return First(self.options.kind, b.chunk, b.chunks, b.comm, b.device, b.maximum)

    def speculates(self, world: int) -> bool:
        """Whether calls may take the fast path, the check in the first bucket's words.

        A word sums up to the world size: it must not wrap round in a byte-sized
        integer bucket (boolean buckets reduce with MAX: no sum).
        """
        b = self.buckets[0]
        return b.comm.itemsize > 1 or b.maximum or world < 256


def valid_rows(rows: int, d0: int, rank: int) -> int:
    """How many of a chunk's ``rows`` hold rows of a tensor of ``d0`` rows on ``rank``.

    >>> [valid_rows(2, 5, r) for r in range(4)]
    [2, 2, 1, 0]
    """
    return max(0, min(rows, d0 - rank * rows))


def build(
    paths: Sequence[str],
    leaf_sigs: Sequence[Sig | None],
    slot: Sequence[int] | None,
    options: Options,
    world: int,
    caller: str,
    words: torch.device,
) -> Layout:
    """The layout of a tree whose leaves have these paths and signatures (``None``: not a tensor).

    ``slot[i]``: the tensor leaf ``i`` holds (``-1``: not a tensor), tied
    leaves sharing one; ``None`` when every leaf is a tensor of its own.
    ``world``: the group's size (it cuts the chunks of scatter and gather).
    ``words``: where the flag words travel when no tensor is bucketed (a
    bucket of words only: every call has one, so that its words, failure
    and retry included, always reach every rank).

    Raises:
        TypeError: a tensor that cannot travel (a layout other than strided
            or, in a reduction, sparse COO; the meta device), or an integer
            or bool tensor in a mean, named by its path.
    """
    if slot is None:
        unique: tuple[int, ...] = tuple(range(len(leaf_sigs)))
    else:
        firsts: dict[int, int] = {}
        for i, s in enumerate(slot):
            if s >= 0:
                firsts.setdefault(s, i)
        unique = tuple(firsts[s] for s in range(len(firsts)))
    sigs = tuple(_tensor_sig(leaf_sigs[i]) for i in unique)
    _check(sigs, [paths[i] for i in unique], options, caller)
    chunks = 1 if options.kind == "reduce" else world
    sparse = tuple(k for k, s in enumerate(sigs) if s[3] == torch.sparse_coo)
    local = tuple(k for k, s in enumerate(sigs) if options.kind == "gather" and not s[0])
    outside = set(sparse) | set(local)
    dense = [k for k in range(len(sigs)) if k not in outside]
    cuts = _cuts(sigs, dense[::-1], options, chunks)
    made = []
    for b, (members, comm) in enumerate(cuts):
        made.append(_bucket(sigs, members, comm, _flags.extra(b, len(cuts) - 1), chunks))
    if not made:
        device = sigs[sparse[0]][2] if sparse else words
        made.append(
            Bucket(
                (),
                (),
                torch.float32,
                torch.float32,
                device,
                False,
                _flags.FIRST,
                _flags.FIRST,
                chunks,
                (_flags.FIRST,),
            )
        )
    order = tuple(k for bucket in made for k in bucket.members) + sparse + local
    description = (
        tuple(paths),
        tuple(
            None if s is None else (tuple(s[0]), str(s[1]), s[2].type, str(s[3])) for s in leaf_sigs
        ),
        None if slot is None else tuple(slot),
        options.describe(),
    )
    digest = hashlib.blake2b(repr(description).encode(), digest_size=8).digest()
    return Layout(
        options=options,
        world=chunks,
        leaves=len(leaf_sigs),
        unique=unique,
        slot=None if slot is None else tuple(slot),
        sigs=sigs,
        sparse=sparse,
        local=local,
        buckets=tuple(made),
        order=order,
        fingerprint=int.from_bytes(digest, "little") >> 1,  # fits an int64
        description=description,
    )


def _tensor_sig(sig: Sig | None) -> Sig:
    assert sig is not None  # ``unique`` lists tensors only
    return sig


def _check(sigs: Sequence[Sig], paths: Sequence[str], options: Options, caller: str) -> None:
    for (_, dtype, device, layout), path in zip(sigs, paths):
        if layout != torch.strided and not (
            layout == torch.sparse_coo and options.kind == "reduce"
        ):
            kind = (
                "" if options.kind == "reduce" else f" (a {options.kind} takes dense tensors only)"
            )
            raise TypeError(
                f"{caller}: the tensor at {path} has layout {layout}, which cannot be packed into "
                f"a flat buffer{kind}; convert it (e.g. .to_dense()) or keep it out of the tree"
            )
        if device.type == "meta":
            raise TypeError(
                f"{caller}: the tensor at {path} is on the meta device, which holds no values to "
                "send to other processes; materialise it (e.g. .to_empty()) first"
            )
        if (
            options.op == "mean"
            and options.kind != "gather"
            and not (dtype.is_floating_point or dtype.is_complex)
        ):
            raise TypeError(
                f"{caller}: op='mean' needs floating-point or complex leaves, but the leaf at "
                f"{path} is {dtype}; use op='sum' or convert it"
            )


def _region(shape: tuple[int, ...], chunks: int) -> tuple[int, int]:
    """``(rows, elements)`` of one tensor of ``shape`` in one chunk."""
    if not shape:
        return 1, 1
    rows = shape[0] if chunks == 1 else -(-shape[0] // chunks)
    return rows, rows * math.prod(shape[1:])


def _comm(dtype: torch.dtype, options: Options) -> torch.dtype:
    """The dtype a bucket of ``dtype`` tensors travels in."""
    if options.comm is not None and dtype.is_floating_point and dtype.itemsize > 2:
        return options.comm
    if dtype == torch.bool:
        return torch.uint8  # reduced with MAX: a logical or, as ``a + b`` on bools
    return dtype


def _cuts(
    sigs: Sequence[Sig], order: Sequence[int], options: Options, chunks: int
) -> list[tuple[list[int], torch.dtype]]:
    """Each bucket's tensors (grouped by shape) and the dtype it travels in, in launch order.

    DDP's rule (``_compute_bucket_assignment_by_size``): per (device, dtype),
    tensors join the open bucket in ``order``, which closes once its bytes
    reach the limit (so a bucket may pass it by its last tensor); the first
    bucket of each kind has DDP's first limit (1 MiB at the default
    ``bucket_cap_mb``, else the cap); closed buckets come in the order they
    closed, then the open ones. The same number of collectives as DDP.
    """
    first = FIRST_BUCKET_BYTES if options.bucket_cap_mb == DEFAULT_CAP_MB else options.cap_bytes
    open_: dict[Any, tuple[list[int], int, int]] = {}  # per kind: members, bytes, closed so far
    closed: list[list[int]] = []
    for k in order:
        _, dtype, device, _ = sigs[k]
        members, size, nth = open_.get((device, dtype), ([], 0, 0))
        members.append(k)
        size += chunks * _region(sigs[k][0], chunks)[1] * _comm(dtype, options).itemsize
        if size >= (first if nth == 0 else options.cap_bytes):
            closed.append(members)
            members, size, nth = [], 0, nth + 1
        open_[(device, dtype)] = (members, size, nth)
    out = []
    for members in closed + [m for m, _, _ in open_.values() if m]:
        # equal shapes side by side: one stack packs them, one unbind views them back
        by_shape = group_by(members, lambda k: sigs[k][0])
        grouped = [members[p] for same in by_shape.values() for p in same]
        out.append((grouped, _comm(sigs[members[0]][1], options)))
    return out


def _bucket(
    sigs: Sequence[Sig], members: list[int], comm: torch.dtype, extra: int, chunks: int
) -> Bucket:
    runs: list[Run] = []
    start = 0
    for shape, count in _runs_of([sigs[k][0] for k in members]):
        rows, size = _region(shape, chunks)
        runs.append(Run(shape, count, rows, start, count * size))
        start += count * size
    _, dtype, device, _ = sigs[members[0]]
    return Bucket(
        members=tuple(members),
        runs=tuple(runs),
        dtype=dtype,
        comm=comm,
        device=device,
        maximum=dtype == torch.bool,
        extra=extra,
        chunk=start + extra,
        chunks=chunks,
        widths=(*(run.width for run in runs), extra),
    )


def _runs_of(shapes: Sequence[tuple[int, ...]]) -> list[tuple[tuple[int, ...], int]]:
    out: list[tuple[tuple[int, ...], int]] = []
    for s in shapes:
        if out and out[-1][0] == s:
            out[-1] = (s, out[-1][1] + 1)
        else:
            out.append((s, 1))
    return out


# --- what differs between two ranks' layouts -------------------------------------------


def difference(
    mine: tuple[str, tuple[Any, ...]], rank: int, theirs: tuple[str, tuple[Any, ...]], other: int
) -> str:
    """Words for the first difference between two ranks' ``(caller, description)``.

    The same text eager and compiled: every mismatch error names it.
    """
    caller_a, (paths_a, sigs_a, slot_a, opts_a) = mine
    caller_b, (paths_b, sigs_b, slot_b, opts_b) = theirs
    on = f"on rank {rank}"
    there = f"on rank {other}"
    if caller_a != caller_b:
        return (
            f"ranks called different functions: {caller_a} {on}, {caller_b} {there}; "
            "every rank must make the same calls in the same order"
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
    for path, a, b in zip(paths_a, sigs_a, sigs_b):
        if a is not None and a[3] != b[3]:
            return (
                f"the tensor at {path} differs across ranks: layout {a[3]} {on}, {b[3]} {there}; "
                "every rank must pass tensors of the same layouts"
            )
        if a != b:
            return (
                f"the tensor at {path} differs across ranks: shape {a[0]}, dtype {a[1]} {on}; "
                f"shape {b[0]}, dtype {b[1]} {there}; every rank must pass tensors of the same "
                "shapes and dtypes"
            )
    if slot_a != slot_b:
        return (
            "tied (aliased) leaves differ across ranks: the same tensor object sits at "
            f"different positions of the tree {on} and {there}"
        )
    return "the tree layout differs across ranks"  # pragma: no cover


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
