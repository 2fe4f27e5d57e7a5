"""The process group a call runs on, and the errors that come out of its collectives.

Every public function asks ``world_size`` first: it validates ``group``, says
how many ranks take part (1 without a process group: nothing to do; 0 on a
rank outside ``group``, which, as with torch's own collectives, does nothing
and is warned), and refuses to train each rank alone when a launcher started
several processes but no process group was initialised.

Errors of the protocol are types of their own (``ProtocolError``): every rank
raises them together, so the code that announces a failure to the peers
lets them pass. ``collective`` wraps each torch.distributed call, and only
those: whatever comes out of one is torch's (a peer gone, a timeout), and is
re-raised naming the fr function.
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any, NamedTuple, TypeVar

import torch
import torch.autograd.forward_ad as forward_ad
import torch.distributed as dist

from .._checks import check_int
from .._torch import is_compiling

T = TypeVar("T")

__all__ = [
    "CommError",
    "Groups",
    "ProtocolError",
    "backend_of",
    "check_src",
    "collective",
    "comm_error",
    "comm_device",
    "forward_ad_level",
    "group_ref",
    "groups_of",
    "refuse_traced_transforms",
    "remember",
    "resolve",
    "world_size",
]

# what ``dist.new_group`` hands a rank that is not in the group
_NOT_A_MEMBER = getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", -100)


class ProtocolError(Exception):
    """An error every rank of the call raises together (a mismatch, a peer's failure, a dead peer)."""


class CommError(ProtocolError, RuntimeError):
    """A torch.distributed collective failed (a peer died, stalled, or called another one)."""


def world_size(group: Any, caller: str) -> int:
    """How many ranks ``group`` has: 1 without a process group, 0 on a rank outside it.

    Raises:
        TypeError: ``group`` is not a process group.
        RuntimeError: the environment names several processes (``WORLD_SIZE``
            > 1, as ``torchrun`` sets it) but no process group was initialised;
            or Dynamo traces the call inside a ``torch.func`` transform
            (``refuse_traced_transforms``), before anything touches the tree.
    """
    return resolve(group, caller)[0]


def resolve(group: Any, caller: str) -> tuple[int, Any, bool]:
    """``world_size``; the process group a call of more than one rank runs on: ``group``,
    or the default one for ``None`` (looked up once a call: torch's collectives, given
    ``None``, look it up at every launch); and whether Dynamo traces the call (asked once:
    the call's later steps take it as given). With one rank or fewer, ``(world, group,
    False)``; while Dynamo traces, ``group`` as it is."""
    # the common cases first, at C speed (every public call starts here): a group's size is
    # its own (``dist.get_world_size`` costs a dozen Python calls to say the same)
    default = _default_group()
    if group is None and default is not None:
        world: int = default.size()
        resolved = default
    elif default is not None and type(group) is not int and isinstance(group, _PROCESS_GROUP):
        world, resolved = group.size(), group
    else:
        world, resolved = _world_size(group, caller), group
    if world <= 1:
        return world, group, False
    if is_compiling():  # traced: the group as given (the graph names it, ``Traced``)
        refuse_traced_transforms(caller)
        return world, group, True
    return world, resolved, False


def refuse_traced_transforms(caller: str) -> None:
    """``RuntimeError`` while Dynamo traces inside a ``torch.func`` transform or forward-mode AD.

    Dynamo traces an ``autograd.Function``'s rules there without their
    collectives (measured on torch 2.13: a ``vmap``'s collective dropped on
    one rank, a ``jvp``'s tangent zero); eagerly they compose (``_rules``).
    """
    if torch._C._are_functorch_transforms_active() or forward_ad_level():
        raise RuntimeError(
            f"{caller}: under torch.compile, fr.distributed's collectives cannot run inside "
            "torch.func transforms (vmap, grad, jvp, jacrev ..., and fr.grad_and_value, which "
            "uses torch.func while compiling) or forward-mode AD: Dynamo would trace them "
            "without their rules. Run the transformed step eagerly (it composes there), "
            "differentiate with torch.autograd inside the compiled function (loss.backward() "
            "or torch.autograd.grad), or call the collectives outside the transform "
            "(fr.distributed.grad_and_value does)"
        )


def forward_ad_level() -> bool:
    """Whether a forward-mode AD level is open (``torch.autograd.forward_ad.dual_level``)."""
    return getattr(forward_ad, "_current_level", -1) >= 0


_AVAILABLE = dist.is_available()
_PROCESS_GROUP: Any = dist.ProcessGroup if _AVAILABLE else ()


def _default_group() -> Any:
    """The default process group, or ``None`` before ``init_process_group`` (or without
    torch.distributed)."""
    return dist.group.WORLD if _AVAILABLE else None


def _world_size(group: Any, caller: str) -> int:
    """``world_size`` where the group is not an initialised one: ``None`` without a process
    group, a rank outside the group, a wrong type."""
    initialised = _default_group() is not None
    if group is None:
        if initialised:
            return dist.get_world_size()
        _check_launcher(caller)
        return 1
    if group is _NOT_A_MEMBER or (isinstance(group, int) and group == _NOT_A_MEMBER):
        warnings.warn(
            f"{caller}: this rank is not in the given process group; the call does nothing "
            "and returns the tree unchanged (as torch.distributed's collectives do)",
            stacklevel=3,
        )
        return 0
    if not (_AVAILABLE and isinstance(group, _PROCESS_GROUP)):
        raise TypeError(
            f"{caller}: group must be a torch.distributed process group (e.g. from "
            "dist.new_group) or None for the default group (a DeviceMesh, or a pair of groups "
            "for hybrid sharding, is taken by apply_sharded, shard, all_gather, materialize, "
            f"save_sharded and load_sharded), got {group!r} of type {type(group).__name__}"
        )
    if not initialised:
        _check_launcher(caller)
        return 1
    return dist.get_world_size(group)


def _check_launcher(caller: str) -> None:
    size = os.environ.get("WORLD_SIZE", "1")
    if size.isdigit() and int(size) > 1:
        raise RuntimeError(
            f"{caller}: WORLD_SIZE={size} in the environment (a launcher such as torchrun "
            "started several processes) but no torch.distributed process group is "
            "initialised, so each rank would train alone; call "
            "torch.distributed.init_process_group() first (backend 'gloo' on CPU, 'nccl' on CUDA)"
        )


class Groups(NamedTuple):
    """What ``group`` names, resolved: the group rows are split over, and (hybrid sharding,
    HSDP) the group this rank's rows are replicated over."""

    shard: Any  # a process group, or None for the default one
    replicate: Any = None  # a process group, or None: no replication


def groups_of(group: Any, caller: str) -> Groups:
    """``group`` as its process groups: a group (or ``None``) as it is; a 1-D ``DeviceMesh``
    its group; a 2-D one, ``(replicate, shard)`` as FSDP2 reads it, its two; a pair of
    groups ``(replicate, shard)``, in a 2-D mesh's order, the same (checked: the two meet
    in this rank alone, and every rank of the one has a replica in the other's).

    Raises:
        TypeError: neither a process group, a ``DeviceMesh`` nor a pair of groups.
        ValueError: a mesh of more than 2 dims; a pair that does not make a 2-D grid.
    """
    if (
        group is None
        or group is _NOT_A_MEMBER
        or (isinstance(group, int) and group == _NOT_A_MEMBER)  # a rank outside: warned later
        or (dist.is_available() and isinstance(group, dist.ProcessGroup))
    ):
        return Groups(group)
    if isinstance(group, tuple):
        if len(group) != 2 or not all(
            dist.is_available() and isinstance(g, dist.ProcessGroup) for g in group
        ):
            raise TypeError(
                f"{caller}: group as a pair must be (replicate_group, shard_group), two "
                f"process groups in a 2-D DeviceMesh's order, got {group!r}"
            )
        replicate, shard = group
        _check_grid(caller, replicate, shard)
        return Groups(shard, replicate)
    if dist.is_available():
        from torch.distributed.device_mesh import DeviceMesh

        if isinstance(group, DeviceMesh):
            if group.ndim == 1:
                return Groups(group.get_group())
            if group.ndim == 2:
                return Groups(group.get_group(1), group.get_group(0))
            raise ValueError(
                f"{caller}: group: a DeviceMesh of 1 dim (shard) or 2 dims (replicate, shard), "
                f"got one of {group.ndim} dims {tuple(group.shape)}"
            )
    raise TypeError(
        f"{caller}: group must be a torch.distributed process group, a DeviceMesh, a pair "
        f"(replicate_group, shard_group) or None for the default group, got {group!r} of "
        f"type {type(group).__name__}"
    )


def _check_grid(caller: str, replicate: Any, shard: Any) -> None:
    """The pair makes a 2-D grid through this rank: the two groups share this rank alone."""
    if not dist.is_initialized():
        return
    shared = set(dist.get_process_group_ranks(replicate)) & set(dist.get_process_group_ranks(shard))
    if shared != {dist.get_rank()}:
        raise ValueError(
            f"{caller}: group=(replicate_group, shard_group) must meet in this rank alone "
            f"(rank {dist.get_rank()}), as a 2-D mesh's row and column do; they share the "
            f"ranks {sorted(shared)}"
        )


def group_ref(group: Any) -> weakref.ref[Any]:
    """A weak reference to the group, the default one for ``None``: the key of per-group
    state (``remember``), equal for the same group, looked up at C speed."""
    return weakref.ref(_default_group() if group is None else group)


def remember(table: dict[weakref.ref[Any], T], group: Any, value: T) -> T:
    """``table[group_ref(group)] = value``, the entry going with the group: a weak dictionary
    by hand, whose lookups and emptiness cost no Python call (``WeakKeyDictionary``'s do)."""
    key = _default_group() if group is None else group
    table[weakref.ref(key, lambda ref: table.pop(ref, None))] = value  # type: ignore[misc]
    return value


def check_src(caller: str, src: Any, group: Any) -> int:
    """``src`` if it is a global rank of ``group``, else an error naming the group's ranks."""
    check_int(caller, "src", src)
    if not (dist.is_available() and dist.is_initialized()):
        return src
    if group is None:
        ranks = list(range(dist.get_world_size()))
        where = "the default group"
    else:
        ranks = dist.get_process_group_ranks(group)
        where = "the given group"
    if src not in ranks:
        raise ValueError(
            f"{caller}: src={src} is not a rank of {where} (its global ranks are {ranks}); "
            "src is a global rank"
        )
    return src


def backend_of(group: Any) -> str:
    """The group's backend (``"gloo"``, ``"nccl"`` ...): what a kind's wire format is chosen by."""
    if not (dist.is_available() and dist.is_initialized()):
        return "gloo"
    return str(dist.get_backend(group))


def comm_device(group: Any) -> torch.device:
    """The device a collective's small tensors live on: the current CUDA device for NCCL."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def comm_error(caller: str, err: BaseException) -> BaseException:
    """What an error out of a torch.distributed call is raised as: ``CommError`` naming
    ``caller`` (the original its ``__cause__``) for torch's ``RuntimeError`` / ``ValueError``;
    anything else, and running out of memory, as it is. The hot paths call it from an
    ``except`` clause (no frame when nothing fails); ``collective`` around the others."""
    if isinstance(err, (RuntimeError, ValueError)) and not isinstance(
        err, torch.OutOfMemoryError
    ):
        named = CommError(
            f"{caller}: a collective failed: a peer rank may have died, stalled past "
            "the group's timeout, or called another collective than this one; every rank "
            f"must make the same fr.distributed calls in the same order "
            f"({type(err).__name__}: {str(err)[:300]})"
        )
        named.__cause__ = err
        return named
    return err


class collective:  # lower case, as the context manager function it replaced
    """Around a torch.distributed call: its errors re-raised as ``comm_error`` says."""

    __slots__ = ("caller",)

    def __init__(self, caller: str) -> None:
        self.caller = caller

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, err: BaseException | None, tb: Any) -> None:
        if err is None:
            return
        named = comm_error(self.caller, err)
        if named is not err:
            raise named
