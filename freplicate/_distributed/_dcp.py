"""Sharded checkpoints in ``torch.distributed.checkpoint``'s format: every rank writes and reads its own rows.

``save_sharded`` describes each leaf of this rank's tree to DCP as what it
is: a rank's rows of a full tensor become a ``DTensor`` placed ``Shard(0)``
(whose split is ``torch.chunk``'s, so ``shard``'s rows are described
exactly, a late rank's 0 rows included), a leaf held whole (a buffer, a
0-dim leaf, anything on one process) a plain tensor, which DCP writes
once; numbers and strings go as DCP's bytes. Nothing is gathered: each
rank writes its own rows. ``load_sharded`` asks DCP for the rows the tree
it is given holds on this rank, at this world size, and DCP reads them from
whatever pieces the saving ranks wrote: resharding from W ranks to any
other number. The keys are the tree's paths joined by dots (``params.fc1.weight``),
DCP's own convention for nested dicts, so a tree of parameters is a
``state_dict`` that torch's own ``dcp.load`` (FSDP2, a plain module) reads.

Before DCP's own collectives run, the ranks agree (one
``all_gather_object`` of what each found): a tree that does not fit, a
whole leaf or a number that differs across ranks, raises the same error on
every rank instead of hanging in DCP or writing one rank's copy silently.
``torch.distributed.checkpoint`` and ``torch.distributed.tensor`` are
imported on first use only, as ``import freplicate`` must not load them.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import functools
import io
import os
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._tree import describe, first_difference, flatten_in_order, unflatten
from .._typing import DeviceSpec, TensorTree
from ._group import comm_device, groups_of, world_size

__all__ = ["agree", "load_sharded", "save_sharded"]

_SAVE = "fr.distributed.save_sharded"
_LOAD = "fr.distributed.load_sharded"


def save_sharded(
    path: str | os.PathLike[str], tree: TensorTree, like: TensorTree, *, group: Any = None
) -> None:
    """Save this rank's ``tree`` to the directory ``path`` as one ``torch.distributed.checkpoint``.

    Collective: every rank of ``group`` calls it with the same ``path`` (a
    directory every rank can reach) and a tree of the same structure. Each
    tensor leaf of ``tree`` is either this rank's rows of ``like``'s leaf at
    the same path (``fr.distributed.shard``'s rows: parameters and optimizer
    state in ZeRO-1, 2 or 3) or that leaf whole (a buffer, a 0-dim leaf):
    its shape says which. Rows are written by the rank that holds them, as a
    ``DTensor`` placed ``Shard(0)``; no rank gathers a full tensor. A leaf
    held whole by every rank is written once, and must be equal on every
    rank (checked: a per-rank value, such as a random generator's state or a
    data position, belongs in a file of its own). Non-tensor leaves (a step
    count) are saved as DCP's bytes, once, and must also agree across ranks.
    Without a process group (or on one rank) every leaf is whole, in the
    same format: ``load_sharded`` reads either on any number of ranks.

    Args:
        path: the checkpoint's directory (created if missing; files in it are
            overwritten).
        tree: this rank's tree: shards, whole tensors, numbers and strings.
            Never modified.
        like: the full tree (as one process would hold it), of ``tree``'s
            structure; only its tensors' shapes and dtypes are read, so it may
            live on the ``meta`` device (e.g. ``fr.state`` of a meta module,
            and an optimizer's ``init`` of those parameters).
        group: the process group (default: the default group); a
            ``DeviceMesh`` or a pair ``(replicate_group, shard_group)``
            (hybrid sharding): the first replica's shard group writes, the
            other replicas (which hold the same rows) wait for it.

    Raises:
        TypeError: a bad ``path`` or ``group``.
        ValueError: ``tree`` and ``like`` differ in structure; a leaf that is
            neither this rank's rows of ``like``'s nor its whole (naming its
            path, shapes and the rank); a dtype that differs from ``like``'s;
            a meta leaf; a whole leaf or a non-tensor leaf that differs across
            ranks; two paths that join to one key. Raised on every rank.

    Examples:
        >>> import tempfile
        >>> params = {"w": torch.arange(6.0).view(3, 2), "step": 4}
        >>> directory = tempfile.mkdtemp()
        >>> fr.distributed.save_sharded(directory, fr.distributed.shard(params), params)
        >>> fr.distributed.load_sharded(directory, {"w": torch.empty(3, 2), "step": 0})["step"]
        4
    """
    directory = _check_path(_SAVE, path)
    groups = groups_of(group, _SAVE)
    if groups.replicate is not None and world_size(groups.replicate, _SAVE) > 1:
        # hybrid sharding: the first replica's shard group writes; the others hold the same
        # rows (the same gradients, the same updates) and wait for it
        if dist.get_rank(groups.replicate) != 0:
            dist.barrier(group=groups.replicate)
            return
        save_sharded(directory, tree, like, group=groups.shard)
        dist.barrier(group=groups.replicate)
        return
    group = groups.shard
    rank, world = _rank_and_world(group, _SAVE)
    if world == 0:
        return
    failed = None
    try:
        entries = _to_save(tree, like, rank, world)
        report: Any = ("ok", [e.agreed for e in entries])
    except Exception as err:  # every rank raises it, none waits in DCP for the others
        entries, report, failed = [], (type(err).__name__, str(err)), err
    sharded = _sharded_keys(agree(report, group, world, failed))
    import torch.distributed.checkpoint as dcp

    mesh = _meshes(group)
    state_dict = {e.key: e.value(e.key in sharded, mesh) for e in entries}
    with _alone() as no_dist:
        dcp.save(
            state_dict,
            storage_writer=dcp.FileSystemWriter(directory),
            process_group=group,
            no_dist=no_dist,
        )


def load_sharded(
    path: str | os.PathLike[str],
    tree: TensorTree,
    *,
    group: Any = None,
    device: DeviceSpec | None = None,
) -> TensorTree:
    """A new tree like ``tree``, its values read from the checkpoint at ``path``, on any number of ranks.

    Collective: every rank of ``group`` calls it. ``tree`` is what this rank
    holds at the current world size (its values are not read; it may live on
    the ``meta`` device): a tensor leaf of this rank's rows of the saved full
    tensor (``fr.distributed.shard`` of the full layout) is filled with
    those rows, one of the full shape with the whole tensor; non-tensor
    leaves are replaced by the saved values. DCP reads each rank's rows from
    whatever pieces the saving ranks wrote (resharding from any world size:
    a checkpoint of 2 ranks loads on 1, 2 or 3): a rank reads the saved
    pieces its rows overlap, and keeps its rows only. The checkpoint may
    hold more than ``tree`` asks for.
    Non-tensor values are unpickled with ``torch.load(weights_only=True)``.
    Every path gets a tensor of its own, read from its own key, even where
    ``tree`` holds one tensor at several paths (a tie in the layout, such as
    moments made from one ``zeros`` tree, says nothing of the saved values).

    Args:
        path: the checkpoint's directory (from ``save_sharded``, or torch's
            own ``dcp.save`` of tensors whose keys are the tree's paths
            joined by dots).
        tree: this rank's layout: shards, whole tensors, numbers and strings
            (e.g. the run's own start, or ``fr.distributed.shard`` of meta
            parameters). Never modified.
        group: the process group (default: the default group); a
            ``DeviceMesh`` or a pair ``(replicate_group, shard_group)``: each
            replica reads its rows over the shard group (any mesh shape reads
            a checkpoint of any other).
        device: where the loaded tensors go (default: each leaf's own
            device; a meta leaf's the group's: the CPU for gloo, the
            current CUDA device for NCCL).

    Returns:
        A new tree of ``tree``'s structure: fresh tensors of its leaves'
        shapes and dtypes (no autograd history), and the saved non-tensor values.

    Raises:
        TypeError: a bad ``path``, ``group`` or ``device``.
        ValueError: a path missing from the checkpoint, a tensor saved where
            ``tree`` has a number or the other way round, a dtype that
            differs, a shape that is neither the saved tensor's nor this
            rank's rows of it (naming the path, the shapes and the rank);
            ``device="meta"``. Raised on every rank.
        FileNotFoundError: no checkpoint at ``path`` (on every rank).

    Examples:
        >>> import tempfile
        >>> directory = tempfile.mkdtemp()
        >>> fr.distributed.save_sharded(directory, {"w": torch.ones(2, 2)}, {"w": torch.ones(2, 2)})
        >>> fr.distributed.load_sharded(directory, {"w": torch.empty(2, 2, device="meta")})["w"]
        tensor([[1., 1.],
                [1., 1.]])
    """
    directory = _check_path(_LOAD, path)
    target_device = None if device is None else _check_device(_LOAD, device)
    group = groups_of(group, _LOAD).shard  # hybrid sharding: each replica reads its rows
    rank, world = _rank_and_world(group, _LOAD)
    if world == 0:
        return tree
    leaves, spec = flatten_in_order(tree)
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(directory)
    failed = None
    try:
        targets = _to_load(reader, leaves, spec, rank, world)
        report: Any = ("ok", None)
    except Exception as err:  # every rank raises it, none waits in DCP for the others
        targets, report, failed = [], (type(err).__name__, str(err)), err
    agree(report, group, world, failed)
    fallback, mesh = comm_device(group), _meshes(group)
    state_dict = {t.key: t.empty(target_device, fallback, mesh) for t in targets}
    with _alone() as no_dist:
        dcp.load(
            state_dict,
            storage_reader=reader,
            planner=_load_planner()(),
            process_group=group,
            no_dist=no_dist,
        )
    return _rebuild(spec, targets, state_dict)


# --- one leaf to save, one to load ------------------------------------------------------


class _Saved:
    """A leaf of the tree to save: its key, value, and what the ranks compare (``agreed``)."""

    def __init__(self, key: str, leaf: Any, agreed: tuple[Any, ...], full: Any) -> None:
        self.key, self.leaf, self.agreed, self.full = key, leaf, agreed, full

    def value(self, sharded: bool, mesh: Callable[[str], Any]) -> Any:
        """What DCP saves: a ``Shard(0)`` DTensor of this rank's rows, a tensor, or the object."""
        if not isinstance(self.leaf, torch.Tensor):
            return self.leaf
        local = self.leaf.detach()
        return _dtensor(local, tuple(self.full), mesh) if sharded else local


class _Target:
    """A tensor (or a non-tensor value) of the tree to load: its key, layout and whether sharded."""

    def __init__(self, key: str, leaf: Any, sharded: bool, full: Any) -> None:
        self.key, self.leaf, self.sharded, self.full = key, leaf, sharded, full

    def empty(
        self, device: torch.device | None, fallback: torch.device, mesh: Callable[[str], Any]
    ) -> Any:
        """The fresh tensor (a ``Shard(0)`` DTensor around it) that DCP fills, or a placeholder."""
        leaf = self.leaf
        if not isinstance(leaf, torch.Tensor):
            return leaf
        where = device or (fallback if leaf.device.type == "meta" else leaf.device)
        fresh = torch.empty(leaf.shape, dtype=leaf.dtype, device=where)
        return _dtensor(fresh, tuple(self.full), mesh) if self.sharded else fresh


def _dtensor(local: torch.Tensor, full: tuple[int, ...], mesh: Callable[[str], Any]) -> Any:
    """``local`` as this rank's ``Shard(0)`` piece of a tensor of shape ``full``."""
    from torch.distributed.tensor import DTensor, Shard

    shape = torch.Size(full)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local, mesh(local.device.type), [Shard(0)], run_check=False, shape=shape, stride=stride
    )


def _meshes(group: Any) -> Callable[[str], Any]:
    """``mesh(device_type)``: the group as a 1-D device mesh, made on first use per device type."""
    made: dict[str, Any] = {}

    def mesh(device_type: str) -> Any:
        from torch.distributed.device_mesh import DeviceMesh

        if device_type not in made:
            pg: Any = dist.group.WORLD if group is None else group
            made[device_type] = DeviceMesh.from_group(pg, device_type)
        return made[device_type]

    return mesh


# --- checks ---------------------------------------------------------------------------


def _to_save(tree: Any, like: Any, rank: int, world: int) -> list[_Saved]:
    """Every leaf of ``tree``, keyed and classified (rows, whole, either, object); checked locally."""
    leaves, spec = flatten_in_order(tree)
    like_leaves, like_spec = flatten_in_order(like)
    if spec != like_spec:
        where = first_difference([like_spec, spec], [like, tree])
        raise ValueError(f"{_SAVE}: tree must have like's structure; {where} (tree 0 is like)")
    keys, paths = _keys(_SAVE, spec)
    out = []
    for key, path, leaf, full in zip(keys, paths, leaves, like_leaves):
        if not isinstance(leaf, torch.Tensor):
            agreed = (key, "a non-tensor value", "object", _portable(path, leaf))
            out.append(_Saved(key, leaf, agreed, None))
            continue
        kind = _kind_of(path, leaf, full, rank, world)
        digest = _digest(leaf) if kind != "rows" and world > 1 else None
        layout = f"a tensor of shape {tuple(full.shape)} and dtype {full.dtype}"
        out.append(_Saved(key, leaf, (key, layout, kind, digest), full.shape))
    return out


def _kind_of(path: str, leaf: torch.Tensor, full: Any, rank: int, world: int) -> str:
    """``"rows"``, ``"whole"``, or ``"either"`` (both shapes agree: 0-dim, no rows, one rank)."""
    if not isinstance(full, torch.Tensor):
        raise ValueError(
            f"{_SAVE}: the leaf at {path} is a tensor, but like holds {describe(full)} there; "
            "like must hold the full tensor of every tensor leaf"
        )
    if leaf.dtype != full.dtype:
        raise ValueError(
            f"{_SAVE}: the leaf at {path} has dtype {leaf.dtype}, like's {full.dtype}; "
            "a checkpoint keeps like's dtypes (convert the leaf first)"
        )
    if leaf.device.type == "meta":
        raise ValueError(f"{_SAVE}: the leaf at {path} is on the meta device: it has no values")
    shape, whole, rows = tuple(leaf.shape), tuple(full.shape), rows_shape(full.shape, rank, world)
    if shape == whole:
        return "either" if shape == rows else "whole"
    if shape == rows:
        return "rows"
    raise ValueError(
        f"{_SAVE}: the leaf at {path} has shape {shape} on rank {rank} of {world}, which is "
        f"neither like's {whole} nor this rank's rows of it {rows}; give each rank "
        "fr.distributed.shard's rows of like's leaf, or the leaf whole"
    )


def _sharded_keys(reports: list[Any]) -> set[str]:
    """The keys saved as rows; ``ValueError`` where the ranks disagree (the same on every rank).

    ``reports[r]`` lists rank r's ``(key, layout, kind, value)`` per leaf.
    """
    layouts = [[s[:2] for s in r] for r in reports]
    for r, other in enumerate(layouts):
        if other != layouts[0]:
            k = next(
                k for k, (a, b) in enumerate(zip([*layouts[0], None], [*other, None])) if a != b
            )
            mine, theirs = (_entry(q[k] if k < len(q) else None) for q in (layouts[0], other))
            raise ValueError(
                f"{_SAVE}: the trees differ across ranks: rank 0 has {mine}, rank {r} {theirs}"
            )
    sharded = set()
    for k, (key, _) in enumerate(layouts[0]):
        seen = [r[k][2:] for r in reports]
        kinds = [s[0] for s in seen]
        if "rows" in kinds and "whole" in kinds:
            raise ValueError(
                f"{_SAVE}: rank {kinds.index('rows')} gives its rows of the leaf {key!r}, rank "
                f"{kinds.index('whole')} the leaf whole; every rank must give the same kind"
            )
        if "rows" in kinds:
            sharded.add(key)
        elif any(s[1] != seen[0][1] for s in seen):
            first = next(r for r, s in enumerate(seen) if s[1] != seen[0][1])
            raise ValueError(
                f"{_SAVE}: the leaf {key!r} is held whole (or is not a tensor) but differs "
                f"between rank 0 and rank {first}: it would be saved once, so it must be equal "
                "on every rank; save a per-rank value (a random state, a data position) in a "
                "file of each rank's own"
            )
    return sharded


def _to_load(reader: Any, leaves: list[Any], spec: Any, rank: int, world: int) -> list[_Target]:
    """The leaves to read, each from its own key, checked against the checkpoint's metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        saved = reader.read_metadata().state_dict_metadata
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{_LOAD}: no checkpoint at {reader.path!s} (its .metadata file is missing)"
        ) from None
    keys, paths = _keys(_LOAD, spec)
    out = []
    for key, path, leaf in zip(keys, paths, leaves):
        meta = saved.get(key)
        tensor = isinstance(leaf, torch.Tensor)
        if meta is None or tensor != isinstance(meta, TensorStorageMetadata):
            had = "nothing" if meta is None else "a tensor" if not tensor else "a non-tensor value"
            raise ValueError(
                f"{_LOAD}: the checkpoint has {had} under the key {key!r}, where the tree holds "
                f"{describe(leaf)} (at {path})"
            )
        sharded = tensor and _check_loaded(path, leaf, meta, rank, world)
        out.append(_Target(key, leaf, sharded, meta.size if tensor else None))
    return out


def _check_loaded(path: str, leaf: torch.Tensor, meta: Any, rank: int, world: int) -> bool:
    """Whether ``leaf`` asks for this rank's rows (rather than the whole tensor); checked."""
    dtype, full = meta.properties.dtype, tuple(meta.size)
    if leaf.dtype != dtype:
        raise ValueError(
            f"{_LOAD}: the leaf at {path} has dtype {leaf.dtype}, the checkpoint's {dtype}; "
            "load into the saved dtype and convert after"
        )
    shape, rows = tuple(leaf.shape), rows_shape(full, rank, world)
    if shape == full:
        return False
    if shape == rows:
        return True
    raise ValueError(
        f"{_LOAD}: the leaf at {path} has shape {shape} on rank {rank} of {world}, which is "
        f"neither the checkpoint's {full} nor this rank's rows of it {rows}"
    )


def _rebuild(spec: Any, targets: list[_Target], loaded: dict[str, Any]) -> Any:
    """``tree`` with each leaf replaced by what was loaded for it."""
    from torch.distributed.tensor import DTensor

    values = [loaded[t.key] for t in targets]
    return unflatten(spec, [v.to_local() if isinstance(v, DTensor) else v for v in values])


# --- helpers -------------------------------------------------------------------------


def rows_shape(full: Sequence[int], rank: int, world: int) -> tuple[int, ...]:
    """The shape of ``rank``'s rows of a tensor of shape ``full`` (``torch.chunk``'s split).

    >>> rows_shape((5, 3), 1, 2), rows_shape((1, 2), 1, 2), rows_shape((), 1, 2)
    ((2, 3), (0, 2), ())
    """
    if len(full) == 0:
        return ()
    c = -(-full[0] // world)
    return (max(0, min(c, full[0] - rank * c)), *full[1:])


def _entry(entry: tuple[str, str] | None) -> str:
    return "no more leaves" if entry is None else f"{entry[1]} under the key {entry[0]!r}"


def _keys(caller: str, spec: Any) -> tuple[list[str], list[str]]:
    """Each leaf's DCP key (its path's entries joined by dots) and its path, for messages."""
    keys: list[str] = []
    paths: list[str] = []
    first: dict[str, str] = {}
    for accessor in spec.accessors():
        parts = [
            str(getattr(e, "field", None) or getattr(e, "name", None) or e.entry) for e in accessor
        ]
        key, path = ".".join(parts), accessor.codify("") or "<root>"
        if key in first:
            raise ValueError(
                f"{caller}: the paths {first[key]} and {path} both make the checkpoint key "
                f"{key!r}; rename one"
            )
        first[key] = path
        keys.append(key)
        paths.append(path)
    return keys, paths


def _digest(t: torch.Tensor) -> tuple[int, int]:
    """A checksum of ``t``'s bytes (its values, bit for bit) and their count."""
    data = t.detach().cpu().contiguous()
    size = data.numel() * data.element_size()
    if size == 0:
        return 0, 0
    return zlib.crc32((ctypes.c_char * size).from_address(data.data_ptr())), size


def _portable(path: str, value: Any) -> bytes:
    """``value`` as ``torch.save`` writes it, checked to load back with ``weights_only=True``."""
    buf = io.BytesIO()
    torch.save(value, buf)
    try:
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as err:
        raise ValueError(
            f"{_SAVE}: the leaf at {path} ({describe(value)}) would not load back with "
            f"torch.load(weights_only=True): {type(err).__name__}; keep non-tensor leaves to "
            "numbers, strings and the like"
        ) from None
    return buf.getvalue()


def agree(
    report: tuple[Any, Any], group: Any, world: int, error: Exception | None = None
) -> list[Any]:
    """Every rank's ``report`` payload, in rank order: ``("ok", payload)`` or ``(error type, message)``.

    One ``all_gather_object``; if any rank's report is an error, every rank
    raises the first failing rank's: that rank its own ``error``, the others
    one of its builtin type (else ``RuntimeError``) and message, so that no
    rank goes on into a collective the others have left.
    """
    reports: list[Any] = [report]
    rank = 0
    if world > 1:
        reports, rank = [None] * world, dist.get_rank(group)
        dist.all_gather_object(reports, report, group=group)
    for r, (kind, message) in enumerate(reports):
        if kind == "ok":
            continue
        if r == rank and error is not None:
            raise error
        raised = getattr(builtins, kind, None)
        if not (isinstance(raised, type) and issubclass(raised, Exception)):
            raised = RuntimeError
        raise raised(message)
    return [r[1] for r in reports]


def _rank_and_world(group: Any, caller: str) -> tuple[int, int]:
    world = world_size(group, caller)
    return (dist.get_rank(group) if world > 1 else 0), world


@contextlib.contextmanager
def _alone() -> Iterator[bool]:
    """Whether DCP runs without a process group; if so, without its warning that it assumes so."""
    if dist.is_available() and dist.is_initialized():
        yield False
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield True


def _check_path(caller: str, path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"{caller}: path must be a directory's path (str or os.PathLike), got {describe(path)}"
        )
    return os.fspath(path)


def _check_device(caller: str, device: Any) -> torch.device:
    try:
        where = torch.device(device)
    except (TypeError, RuntimeError):
        raise TypeError(f"{caller}: device must be a device spec, got {describe(device)}") from None
    if where.type == "meta":
        raise ValueError(f"{caller}: device must hold values, got 'meta'")
    return where


@functools.cache
def _load_planner() -> type:
    """DCP's default load planner, unpickling non-tensor values with ``weights_only=True``."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class Planner(DefaultLoadPlanner):
        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            self.original_state_dict[read_item.dest_index.fqn] = torch.load(
                value, weights_only=True
            )

    return Planner
