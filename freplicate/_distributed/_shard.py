"""Clipping sharded gradients: the norm of the full gradient, from every rank's shards.

``torch.nn.utils.clip_grad_norm_`` takes the norm of every gradient, stacks
those norms and takes their norm. Here each rank holds rows of every
gradient (``fr.distributed.shard``'s split), so each tensor's norm is first
put together from its pieces: every rank computes, per tensor, what its rows
contribute (the sum of ``|x|^p``, or the largest or smallest ``|x|`` for
``p = +-inf``, or the count of non-zeros for ``p = 0``), one all-gather of
those per-tensor figures (a vector of as many numbers as the tree has
tensors: latency-bound, as a scalar's all-reduce is) gives every rank
everyone's, and each rank combines them per tensor, in rank order (the same
bits on every rank), then takes torch's own last step, the norm of the
stacked norms. Gathering per tensor rather than summing one scalar keeps
torch's structure of the total, and so works for every ``norm_type`` torch
takes (a max, a min, and ``p = 0``, which counts the tensors that have a
non-zero element, have no sum of powers); ``fr.distributed.all_reduce``
has no max. A 0-dim gradient is held whole by every rank: rank 0's counts.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from .._clip import _gradients, _max_norm, _norm_type, clip_with_norm, norm_pieces
from .._typing import T
from ._collectives import all_gather
from ._group import world_size

__all__ = ["clip_grad_norm"]

_CALLER = "fr.distributed.clip_grad_norm"

_REAL = {
    torch.complex32: torch.float16,
    torch.complex64: torch.float32,
    torch.complex128: torch.float64,
}


def clip_grad_norm(
    shards: T, max_norm: float, *, norm_type: float = 2.0, group: Any = None
) -> tuple[T, torch.Tensor]:
    """Clip sharded gradients to the global norm of the full gradient, as ``clip_grad_norm_``.

    ``shards`` are this rank's rows of the gradients (from
    ``fr.distributed.grad_and_value(..., shard=True)``, or
    ``fr.distributed.shard`` of reduced ones); the total norm is that of the
    full gradients, the one ``torch.nn.utils.clip_grad_norm_`` computes on
    every rank of DDP, and every shard is scaled by
    ``min(max_norm / (total_norm + 1e-6), 1)`` as torch scales. Each rank
    computes its rows' part of every tensor's norm; one all-gather of those
    per-tensor figures (one number per tensor leaf) gives each tensor's norm,
    combined in rank order, so every rank gets the same total, bit for bit,
    and then torch's own norm of the stacked norms. The total differs from
    torch's in the last bits only (the sums run in another order: a few
    units in the last place, 3e-7 relative at most in float32 in the tests);
    with ``p = inf``, ``-inf`` or ``0`` it is torch's exactly (a max, a min
    and a count do not round). A 0-dim leaf is held
    whole by every rank and counted once. Collective: every rank calls it
    with the shards of the same tree. Nothing is modified; no host read.

    With one rank, or without a process group, it is ``fr.clip_grad_norm``,
    bit for bit. A tree without tensor leaves costs no collective.
    Where ``clip_grad_norm_`` raises on an empty gradient (``norm_type``
    infinite or negative), a gradient with no element counts for nothing
    here: a rank cannot tell an empty shard from an empty gradient.

    >>> grads = {"w": torch.tensor([[3.0, 0.0]]), "b": torch.tensor([4.0])}
    >>> fr.distributed.clip_grad_norm(grads, 1.0)  # one rank: fr.clip_grad_norm
    ({'w': tensor([[0.6000, 0.0000]]), 'b': tensor([0.8000])}, tensor(5.))

    Args:
        shards: this rank's shards of the gradients; non-tensor leaves and
            ``None`` pass through.
        max_norm: the largest total norm the result may have (non-negative).
        norm_type: ``p`` of the p-norm: ``2.0``, ``1``, ``float("inf")`` or
            any other value torch takes.
        group: the process group (default: the default group).

    Returns:
        ``(clipped, total_norm)``: the scaled shards, a new tree, and the
        norm of the full gradient before clipping (a 0-dim tensor, the same
        on every rank; ``tensor(0.)`` without tensor leaves).

    Raises:
        TypeError: a sparse or integer tensor leaf (naming its path), or a
            ``max_norm`` or ``norm_type`` that is not a number.
        ValueError: a negative or NaN ``max_norm``; ranks whose trees have
            different numbers of tensor leaves (on every rank).
    """
    limit = _max_norm(_CALLER, max_norm)
    p = _norm_type(_CALLER, norm_type)
    leaves, _, at = _gradients(shards, _CALLER)  # every rank checks alike, before the collective
    world = world_size(group, _CALLER)
    if world <= 1:
        pieces = norm_pieces(shards, p, caller=_CALLER)
        with torch.no_grad():
            total = torch.linalg.vector_norm(pieces, p) if pieces.numel() else torch.tensor(0.0)
        return clip_with_norm(shards, limit, total, caller=_CALLER), total
    tensors: list[torch.Tensor] = [leaves[i] for i in at]
    if not tensors:
        return shards, torch.tensor(0.0)
    with torch.no_grad():
        mine = _contributions(tensors, p, dist.get_rank(group))
        try:
            everyone = all_gather(
                {"norms": mine.unsqueeze(0)},
                {"norms": mine.new_empty(world, len(tensors))},
                group=group,
            )["norms"]
        except ValueError as err:
            raise ValueError(
                f"{_CALLER}: every rank must pass the shards of the same tree ({len(tensors)} "
                f"tensor leaves here); {err}"
            ) from err
        total = torch.linalg.vector_norm(_combined(everyone, p).to(_norm_dtype(tensors)), p)
    return clip_with_norm(shards, limit, total, caller=_CALLER), total


def _neutral(p: float) -> float:
    """What rows that add nothing contribute: no element, or a 0-dim leaf off rank 0."""
    return math.inf if p == -math.inf else 0.0


def _contributions(tensors: list[torch.Tensor], p: float, rank: int) -> torch.Tensor:
    """Per tensor, in float64 on the first one's device, what this rank's rows add to its norm."""
    device = tensors[0].device
    out = torch.full((len(tensors),), _neutral(p), dtype=torch.float64, device=device)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for k, t in enumerate(tensors):
        if t.numel() and (t.dim() or rank == 0):
            groups.setdefault((t.device, t.dtype), []).append(k)
    for ks in groups.values():
        # one group of one device and dtype: torch's norms in the group's own order
        norms = norm_pieces([tensors[k] for k in ks], p, caller=_CALLER).to(device, torch.float64)
        if math.isfinite(p) and p != 0:
            norms = norms.pow(p)  # a sum of |x|^p: the p-th power of the rows' norm
        out.index_copy_(0, torch.tensor(ks, device=device), norms)
    return out


def _combined(everyone: torch.Tensor, p: float) -> torch.Tensor:
    """Every tensor's norm from all ranks' contributions (rows: ranks, in rank order)."""
    if p == math.inf:
        return everyone.amax(0)
    if p == -math.inf:
        return everyone.amin(0)
    if p == 0:
        return everyone.sum(0)  # non-zeros counted
    return everyone.sum(0).pow(1.0 / p)


def _norm_dtype(tensors: list[torch.Tensor]) -> torch.dtype:
    """The dtype ``torch.stack`` gives the tensors' norms (a complex tensor's norm is real)."""
    dtype = _REAL.get(tensors[0].dtype, tensors[0].dtype)
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, _REAL.get(t.dtype, t.dtype))
    return dtype
