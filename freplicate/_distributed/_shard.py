"""Clipping sharded gradients: the norm of the full gradient, from every rank's shards.

``torch.nn.utils.clip_grad_norm_`` takes the norm of every gradient (a
half-precision one reduced in float32 and rounded once to its dtype),
stacks those norms and takes their norm. Here each rank holds rows of every
gradient (``fr.distributed.shard``'s split), so each tensor's norm is first
put together from its pieces: every rank computes, per tensor, what its rows
contribute (the sum of ``|x|^p``, or the largest or smallest ``|x|`` for
``p = +-inf``, or the count of non-zeros for ``p = 0``), from its rows'
norm in torch's accumulator and never rounded to the tensor's dtype; one
all-gather of those per-tensor figures (float64, a vector of as many numbers
as the tree has tensors: latency-bound, as a scalar's all-reduce is) gives
every rank everyone's, and each rank combines them per tensor, in rank order
(the same bits on every rank), rounds each tensor's norm once to its dtype
where torch rounds it, and takes torch's own last step, the norm of the
norms stacked in torch's order of groups. Rounding the pieces instead (a
bfloat16 shard's norm to 8 bits of mantissa before the sum) would move the
total by up to 8e-3 relative. Gathering per tensor rather than summing one
scalar keeps torch's structure of the total, and so works for every
``norm_type`` torch takes (a max, a min, and ``p = 0``, which counts the
tensors that have a non-zero element, have no sum of powers);
``fr.distributed.all_reduce`` has no max. A 0-dim gradient is held whole by
every rank: rank 0's counts.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from .._clip import (
    clip_with_norm,
    dtype_groups,
    gradient_leaves,
    max_norm_of,
    norm_pieces,
    norm_type_of,
    unrounded_norms,
)
from .._typing import T
from ._collectives import all_gather
from ._group import collective, comm_device, world_size

__all__ = ["clip_grad_norm"]

_CALLER = "fr.distributed.clip_grad_norm"

_REAL = {
    torch.complex32: torch.float16,
    torch.complex64: torch.float32,
    torch.complex128: torch.float64,
}


def clip_grad_norm(
    shards: T,
    max_norm: float,
    *,
    norm_type: float = 2.0,
    group: Any = None,
    reproducible: bool = False,
) -> tuple[T, torch.Tensor]:
    """Clip sharded gradients to the global norm of the full gradient, as ``clip_grad_norm_``.

    ``shards`` are this rank's rows of the gradients (from
    ``fr.distributed.grad_and_value(..., shard=True)``, the ``.grad`` or
    ``fr.grad_and_value`` of shards run through
    ``fr.distributed.apply_sharded``, or ``fr.distributed.shard`` of
    reduced ones: ``fr.clip_grad_norm`` or ``clip_grad_norm_`` of them
    would take this rank's part of the norm); the total norm is that of the
    full gradients, the one ``torch.nn.utils.clip_grad_norm_`` computes on
    every rank of DDP, and every shard is scaled by
    ``min(max_norm / (total_norm + 1e-6), 1)`` as torch scales. Each rank
    computes its rows' part of every tensor's norm; one all-gather of those
    per-tensor figures (one number per tensor leaf) gives each tensor's norm,
    combined in rank order in float64, so every rank gets the same total,
    bit for bit, and then torch's own norm of the stacked norms.

    Precision, against torch on the full gradients: each tensor's norm is
    rounded once to the tensor's dtype, where torch rounds it (a bfloat16 or
    float16 shard's rows are reduced in float32, as torch reduces a whole
    tensor, and never rounded on their own). So a bfloat16 or float16
    tensor's norm is torch's, bit for bit, unless its value lies within
    about 1e-5 of a rounding boundary of its dtype (torch's own float32 sum
    then decides the last bit: 2 totals of 6,272 random ones in the tests,
    float16 at ``p = 3``); a float32 or float64 tensor's norm is summed in
    another order and may differ in its last bits. In the tests the total
    is otherwise torch's bit for bit for trees of bfloat16 and float16
    alone, within 1e-6 relative with float32 leaves for ``p`` of 1 and
    above (2.1e-6 at ``p = 0.5``), and within 3e-15 for float64 beside half
    precision (it was up to 8e-3 off when each rank's piece was rounded to
    the tensor's dtype first); with ``p = inf``,
    ``-inf`` or ``0`` it is torch's exactly (a max, a min and a count of
    non-zeros, rounded once). A 0-dim leaf is held whole by every rank and
    counted once. Collective: every rank calls it with the shards of the
    same tree. Nothing is modified; no host read.

    With one rank, or without a process group, it is ``fr.clip_grad_norm``,
    bit for bit. A tree without tensor leaves costs no collective.

    ``reproducible=True`` makes the total norm the same bits on every world
    size (and without a group), for the rows of
    ``grad_and_value(..., grain=, shard=True)``: each row of each gradient
    contributes its own sum of ``|x|^p`` (float64; a row is whole on every
    world size), one all-gather gives every rank every row's (as many
    numbers as the gradients have rows), and each tensor's rows are combined
    in row order, then rounded and stacked as above. It is not torch's sum
    order, so not ``clip_grad_norm_``'s last bits.
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
        reproducible: the norm by rows, the same bits on any world size.

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
    limit = max_norm_of(_CALLER, max_norm)
    p = norm_type_of(_CALLER, norm_type)
    leaves, _, at = gradient_leaves(
        shards, _CALLER
    )  # every rank checks alike, before the collective
    world = world_size(group, _CALLER)
    tensors: list[torch.Tensor] = [leaves[i] for i in at]
    if reproducible:
        if not tensors:
            return shards, torch.tensor(0.0)
        with torch.no_grad():
            total = _by_rows(tensors, p, group, world)
        return clip_with_norm(shards, limit, total, caller=_CALLER), total
    if world <= 1:
        pieces = norm_pieces(shards, p, caller=_CALLER)
        with torch.no_grad():
            total = torch.linalg.vector_norm(pieces, p) if pieces.numel() else torch.tensor(0.0)
        return clip_with_norm(shards, limit, total, caller=_CALLER), total
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
        total = _total(everyone, tensors, p)
    return clip_with_norm(shards, limit, total, caller=_CALLER), total


def _by_rows(tensors: list[torch.Tensor], p: float, group: Any, world: int) -> torch.Tensor:
    """The total norm from every row's contribution, gathered, combined in row order.

    A row (``t[i]``, whole on every world size) contributes the float64 sum
    of ``|x|^p`` (its max, min or non-zero count for ``p = +-inf, 0``); the
    rows of this rank are ``fr.distributed.shard``'s, so ``all_gather`` of
    the contribution vectors (``like``: one number per row of the full
    tensor) gives every rank every row's, in row order, and the same
    reduction over the same vector gives the same bits everywhere.
    """
    device = tensors[0].device
    rows = {f"{k}": _row_contributions(t, p) for k, t in enumerate(tensors) if t.dim()}
    if world > 1 and rows:
        counts = _full_rows([tensors[int(k)] for k in rows], group)
        full = {k: v.new_empty(n) for (k, v), n in zip(rows.items(), counts)}
        rows = all_gather(rows, full, group=group)
    per = []
    for k, t in enumerate(tensors):
        c = rows[f"{k}"] if t.dim() else _row_contributions(t.reshape(1, *t.shape), p)
        per.append(_combined(c.to(device).unsqueeze(1), p)[0])
    norms, dtype = torch.stack(per), _norm_dtype(tensors)
    stacked = [
        norms[idx].to(_REAL.get(g[0].dtype, g[0].dtype)).to(dtype)
        for g, idx in dtype_groups(tensors)
    ]
    return torch.linalg.vector_norm(torch.cat(stacked), p)


def _row_contributions(t: torch.Tensor, p: float) -> torch.Tensor:
    """Per row of ``t`` (dim >= 1), what it adds to ``t``'s norm, in float64."""
    x = (
        t.detach()
        .reshape(t.shape[0], -1)
        .to(torch.complex128 if t.is_complex() else torch.float64)
        .abs()
    )
    if x.shape[1] == 0:
        return torch.full((t.shape[0],), _neutral(p), dtype=torch.float64, device=t.device)
    if p == math.inf:
        return x.amax(1)
    if p == -math.inf:
        return x.amin(1)
    if p == 0:
        return (x != 0).sum(1).to(torch.float64)
    return x.pow(p).sum(1)


def _full_rows(shards: list[torch.Tensor], group: Any) -> list[int]:
    """The full tensors' rows from this rank's (``fr.distributed.shard``'s split cannot tell
    them on the last ranks): one all-reduce of every rank's row counts."""
    counts = torch.tensor([t.shape[0] for t in shards], dtype=torch.int64)
    counts = counts.to(comm_device(group))
    with collective(_CALLER):
        dist.all_reduce(counts, group=group)
    return [int(n) for n in counts.tolist()]


def _neutral(p: float) -> float:
    """What rows that add nothing contribute: no element, or a 0-dim leaf off rank 0."""
    return math.inf if p == -math.inf else 0.0


def _contributions(tensors: list[torch.Tensor], p: float, rank: int) -> torch.Tensor:
    """Per tensor, in float64 on the first one's device, what this rank's rows add to its norm.

    From the rows' norm as torch accumulates it (``unrounded_norms``): a
    bfloat16 or float16 shard's in float32, never rounded to its own dtype.
    """
    device = tensors[0].device
    out = torch.full((len(tensors),), _neutral(p), dtype=torch.float64, device=device)
    ks = [k for k, t in enumerate(tensors) if t.numel() and (t.dim() or rank == 0)]
    if ks:
        norms = unrounded_norms([tensors[k] for k in ks], p)
        mine = torch.stack([n.to(device, torch.float64) for n in norms])
        if math.isfinite(p) and p != 0:
            mine = mine.pow(p)  # a sum of |x|^p: the p-th power of the rows' norm
        out[ks] = mine
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


def _total(everyone: torch.Tensor, tensors: list[torch.Tensor], p: float) -> torch.Tensor:
    """The total norm from every rank's ``_contributions`` (rows: ranks, in rank order).

    Each tensor's norm, combined in float64, is rounded once to the tensor's
    (real) dtype, as torch's per-tensor norm is; the norms are stacked in
    torch's order of (device, dtype) groups and in the dtype ``torch.stack``
    promotes them to, and their norm is torch's last step.
    """
    norms, dtype = _combined(everyone, p), _norm_dtype(tensors)
    stacked = [
        norms[idx].to(_REAL.get(group[0].dtype, group[0].dtype)).to(dtype)
        for group, idx in dtype_groups(tensors)
    ]
    return torch.linalg.vector_norm(torch.cat(stacked), p)


def _norm_dtype(tensors: list[torch.Tensor]) -> torch.dtype:
    """The dtype ``torch.stack`` gives the tensors' norms (a complex tensor's norm is real)."""
    dtype = _REAL.get(tensors[0].dtype, tensors[0].dtype)
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, _REAL.get(t.dtype, t.dtype))
    return dtype
