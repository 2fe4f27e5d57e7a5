"""Global-norm gradient clipping on trees, bit for bit as ``torch.nn.utils.clip_grad_norm_``.

torch computes the norm of every gradient, grouped by (device, dtype) in the
order its own grouping returns the groups (a hash map's order, not the
parameters'), stacks those norms on the first gradient's device and takes
their norm; then it multiplies every gradient in place by
``clamp(max_norm / (total + 1e-6), max=1)``. A float sum depends on its
order, so the last bit of the total norm (and of every later step) depends
on doing exactly that: this module follows torch's steps with its own
grouping, over the leaves in insertion order (``named_parameters()``'s, not
optree's sorted keys), and multiplies out of place.

``norm_pieces`` and ``clip_with_norm`` are the two halves; the sharded
``fr.distributed.clip_grad_norm`` puts every tensor's norm together from
the ranks' ``unrounded_norms`` (each rank's rows reduced in the precision
torch reduces a whole tensor in, not yet rounded to the tensor's dtype)
before it rounds it once, as torch does, and clips.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ._torch import foreach_mul, foreach_norm, foreach_supported, groups_by_device_and_dtype
from ._tree import flatten_in_order, paths_of, unflatten
from ._typing import T, TensorTree

__all__ = [
    "clip_grad_norm",
    "clip_with_norm",
    "dtype_groups",
    "gradient_leaves",
    "max_norm_of",
    "norm_pieces",
    "norm_type_of",
    "unrounded_norms",
]

_CALLER = "fr.clip_grad_norm"

# torch reduces a half-precision tensor in float32 (its opmath type) and rounds the norm
# to the tensor's dtype only at the end; other dtypes are reduced in their own
_ACCUMULATOR = {
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
    torch.complex32: torch.complex64,
}


def dtype_groups(tensors: list[torch.Tensor]) -> list[tuple[list[torch.Tensor], list[int]]]:
    """``tensors`` split by (device, dtype), with their positions, in torch's order of groups."""
    return groups_by_device_and_dtype(tensors)


def _foreach(tensors: list[torch.Tensor]) -> bool:
    return foreach_supported(tensors)


def gradient_leaves(
    grads: Any, caller: str, p: float | None = None
) -> tuple[list[Any], Any, list[int]]:
    """``(leaves, spec, at)``: the leaves in insertion order, and the positions of the tensors.

    Raises ``TypeError`` naming the path of a leaf that no gradient can be,
    ``ValueError`` for an empty leaf whose ``p``-norm has no value.
    """
    leaves, spec = flatten_in_order(grads)
    at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    for i in at:
        t = leaves[i]
        if t.layout != torch.strided:
            raise TypeError(
                f"{caller}: the gradient at {paths_of(spec)[i]} is a {t.layout} tensor; "
                "clip_grad_norm_ takes dense gradients only: densify it (.to_dense())"
            )
        if not (t.is_floating_point() or t.is_complex()):
            raise TypeError(
                f"{caller}: the gradient at {paths_of(spec)[i]} is {t.dtype}; gradients are "
                "floating-point or complex: leave integer tensors out of the tree"
            )
        if p is not None and (p == math.inf or p < 0) and t.numel() == 0:
            # a max, a min or a sum of negative powers over no element: torch raises too
            raise ValueError(
                f"{caller}: the gradient at {paths_of(spec)[i]} is empty, and norm_type={p} "
                "has no value on an empty tensor: leave empty tensors out of the tree or use p > 0"
            )
    return leaves, spec, at


def _stacked_norms(tensors: list[torch.Tensor], p: float) -> torch.Tensor:
    # torch's _get_total_norm up to its last vector_norm
    norms: list[torch.Tensor] = []
    for group, _ in dtype_groups(tensors):
        if _foreach(group):
            norms.extend(foreach_norm(group, p))
        else:
            norms.extend(torch.linalg.vector_norm(g, p) for g in group)
    first = tensors[0].device
    return torch.stack([n.to(first) for n in norms])


def unrounded_norms(tensors: list[torch.Tensor], p: float) -> list[torch.Tensor]:
    """The ``p``-norm of each tensor as torch reduces it, before it rounds it to the tensor's dtype.

    A float16 or bfloat16 tensor's norm comes in float32 (torch's accumulator:
    ``vector_norm`` of it is this value rounded once to its dtype), a
    complex32 one's in float32 too; any other dtype's is its own (real)
    dtype, as ``clip_grad_norm_`` computes it. For norms put together from
    pieces (a sharded gradient's rows on every rank), which must be combined
    first and rounded once: rounding every piece to 8 bits of mantissa
    before the sum moves a bfloat16 tensor's norm by units in its last place.

    >>> x = torch.tensor([1.0, 1.0, 1.0], dtype=torch.bfloat16)
    >>> unrounded_norms([x], 2.0)[0]  # sqrt(3), not yet rounded to bfloat16's 1.7344
    tensor(1.7321)
    >>> torch.linalg.vector_norm(x)
    tensor(1.7344, dtype=torch.bfloat16)

    Args:
        tensors: dense floating-point or complex tensors.
        p: the ``p`` of the p-norm.

    Returns:
        One 0-dim tensor per tensor, in their order, each on its tensor's device.
    """
    out: list[Any] = [None] * len(tensors)
    for group, idx in dtype_groups(tensors):
        accumulator = _ACCUMULATOR.get(group[0].dtype)
        if accumulator is not None:
            norms = [torch.linalg.vector_norm(g, p, dtype=accumulator) for g in group]
        elif _foreach(group):
            norms = foreach_norm(group, p)
        else:
            norms = [torch.linalg.vector_norm(g, p) for g in group]
        for k, n in zip(idx, norms):
            out[k] = n
    return out


def _scaled(tensors: list[torch.Tensor], limit: float, total: torch.Tensor) -> list[torch.Tensor]:
    # torch's _clip_grads_with_norm_, with _foreach_mul for _foreach_mul_ and mul for mul_
    coef = torch.clamp(limit / (total + 1e-6), max=1.0)
    out: list[Any] = [None] * len(tensors)
    for group, idx in dtype_groups(tensors):
        here = coef.to(group[0].device)
        done = foreach_mul(group, here) if _foreach(group) else [g.mul(here) for g in group]
        for k, t in zip(idx, done):
            # a 0-dim gradient promotes with the factor (float32 times a float64 norm is
            # float64); torch's in-place product computes the same and rounds it to the
            # gradient's dtype, as .to does
            out[k] = t if t.dtype == tensors[k].dtype else t.to(tensors[k].dtype)
    return out


def norm_type_of(caller: str, norm_type: Any) -> float:
    # torch takes whatever float() takes ('inf' included); a bool is a mistake
    try:
        if isinstance(norm_type, bool):
            raise TypeError
        return float(norm_type)
    except (TypeError, ValueError):
        raise TypeError(
            f"{caller}: norm_type must be a number (2.0, 1, float('inf'), ...), got {norm_type!r}"
        ) from None


def norm_pieces(
    grads: TensorTree, norm_type: float = 2.0, *, caller: str = _CALLER
) -> torch.Tensor:
    """The per-gradient norms of ``grads``, stacked as ``clip_grad_norm_`` stacks them.

    A 1-D tensor on the first gradient's device (leaves in insertion order),
    one norm per tensor leaf in torch's order, in the dtype ``torch.stack``
    promotes them to; its ``torch.linalg.vector_norm(., norm_type)`` is
    torch's total norm bit for bit. For a norm over several ranks' shards,
    all-reduce ``pieces.pow(p).sum()`` (``p`` finite) or ``pieces.max()``
    (``p = inf``) and take the ``1/p``-th power. A tree without tensor
    leaves gives an empty float32 tensor on the CPU.

    >>> norm_pieces({"w": torch.tensor([3.0, 4.0]), "b": torch.tensor([1.0])})
    tensor([5., 1.])

    Args:
        grads: a tree of gradients (non-tensor leaves and ``None`` are skipped).
        norm_type: the ``p`` of the p-norm, as for ``clip_grad_norm_``.
        caller: the public function to name in errors.

    Returns:
        The stacked norms.

    Raises:
        TypeError: a sparse or integer tensor leaf (naming its path), or a
            ``norm_type`` that is not a number.
        ValueError: an empty tensor leaf where ``norm_type`` is infinite or
            negative (naming its path).
    """
    p = norm_type_of(caller, norm_type)
    leaves, _, at = gradient_leaves(grads, caller, p)
    if not at:
        return torch.zeros(0)
    with torch.no_grad():
        return _stacked_norms([leaves[i] for i in at], p)


def clip_with_norm(
    grads: T, max_norm: float, total_norm: torch.Tensor, *, caller: str = _CALLER
) -> T:
    """``grads`` scaled as ``clip_grad_norm_`` scales them, given the total norm.

    Every tensor leaf times ``clamp(max_norm / (total_norm + 1e-6), max=1)``
    (sent to its device), computed as torch computes it, out of place (torch's
    ``clip_grads_with_norm_`` without the in-place update). No host read:
    the factor stays a tensor, so a compiled step has no break here.

    >>> clip_with_norm({"w": torch.tensor([3.0, 4.0]), "n": 7}, 1.0, torch.tensor(5.0))
    {'w': tensor([0.6000, 0.8000]), 'n': 7}

    Args:
        grads: a tree of gradients; other leaves pass through by reference.
        max_norm: the largest norm the result may have (a non-negative number).
        total_norm: the norm to scale by (a 0-dim tensor), e.g. of the full
            gradient across ranks.
        caller: the public function to name in errors.

    Returns:
        A new tree of the same structure; no input is modified.

    Raises:
        TypeError: a sparse or integer tensor leaf (naming its path), or a
            ``max_norm`` that is not a number.
        ValueError: a negative or NaN ``max_norm``.
    """
    limit = max_norm_of(caller, max_norm)
    leaves, spec, at = gradient_leaves(grads, caller)
    return _rebuilt(leaves, spec, at, limit, total_norm)


def _rebuilt(leaves: list[Any], spec: Any, at: list[int], limit: float, total: torch.Tensor) -> Any:
    out = list(leaves)
    if at:
        with torch.no_grad():
            for i, t in zip(at, _scaled([leaves[i] for i in at], limit, total)):
                out[i] = t
    return unflatten(spec, out)


def max_norm_of(caller: str, max_norm: Any) -> float:
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
        raise TypeError(
            f"{caller}: max_norm must be a number, got {max_norm!r} of type {type(max_norm).__name__}"
        )
    if math.isnan(max_norm) or max_norm < 0:
        # torch would scale by a negative or NaN factor and flip or poison every gradient
        raise ValueError(f"{caller}: max_norm must be a non-negative number, got {max_norm}")
    return float(max_norm)


def clip_grad_norm(grads: T, max_norm: float, *, norm_type: float = 2.0) -> tuple[T, torch.Tensor]:
    """Clip ``grads`` to a global norm: what ``torch.nn.utils.clip_grad_norm_`` leaves in ``.grad``.

    The norm of all tensor leaves together (as if concatenated into one
    vector), and every tensor leaf scaled by
    ``min(max_norm / (total_norm + 1e-6), 1)``, bit for bit as
    ``clip_grad_norm_`` on CPU over parameters whose ``.grad`` are these
    leaves in insertion order (``named_parameters()``'s order: dict keys are
    not sorted), grouped by device and dtype as torch groups them. A leaf
    that is ``None`` (no gradient) is skipped, as torch skips
    ``p.grad is None``; other non-tensor leaves pass through by reference.
    Each tensor leaf is counted and scaled at each position it stands at.
    Nothing is modified; the results carry no autograd graph (torch clips
    under ``no_grad``). No host read: compiled, it stays in one graph.

    Sharded gradients (ZeRO-2's ``fr.distributed.grad_and_value(...,
    shard=True)``, ZeRO-3's through ``fr.distributed.apply_sharded``) need
    ``fr.distributed.clip_grad_norm``: this function takes the norm of the
    tree it is given, which for a rank's shards is that rank's part of the
    norm, smaller than the full gradient's and different on every rank, so
    the ranks would scale by other factors and their shards drift apart.
    Nothing in a tensor says it holds a rank's rows, so this function
    cannot tell and does not raise: choose by what the gradients are.
    Gradients that every rank holds whole (``fr.distributed.grad_and_value``
    without ``shard``, ZeRO-1) clip here, bit for bit as DDP's
    ``clip_grad_norm_``.

    >>> import freplicate as fr
    >>> grads = {"w": torch.tensor([[3.0, 0.0]]), "b": torch.tensor([4.0]), "frozen": None}
    >>> clipped, norm = fr.clip_grad_norm(grads, 1.0)
    >>> norm, clipped
    (tensor(5.), {'w': tensor([[0.6000, 0.0000]]), 'b': tensor([0.8000]), 'frozen': None})
    >>> fr.clip_grad_norm(grads, 1.0, norm_type=float("inf"))[1]
    tensor(4.)

    Args:
        grads: a tree of gradients, e.g. from ``fr.grad_and_value`` or
            ``fr.distributed.grad_and_value``.
        max_norm: the largest total norm the result may have (non-negative).
        norm_type: ``p`` of the p-norm: ``2.0``, ``1``, ``float("inf")`` or
            any other value torch takes.

    Returns:
        ``(clipped, total_norm)``: a new tree of ``grads``' structure, and the
        total norm before clipping (a 0-dim tensor; ``tensor(0.)`` for a tree
        without tensor leaves, as torch returns for no gradients).

    Raises:
        TypeError: a sparse or integer tensor leaf (naming its path), or a
            ``max_norm`` or ``norm_type`` that is not a number.
        ValueError: a negative or NaN ``max_norm``; an empty tensor leaf where
            ``norm_type`` is infinite or negative (naming its path; torch raises too).
    """
    limit = max_norm_of(_CALLER, max_norm)
    p = norm_type_of(_CALLER, norm_type)
    leaves, spec, at = gradient_leaves(grads, _CALLER, p)
    if not at:
        return unflatten(spec, leaves), torch.tensor(0.0)
    with torch.no_grad():
        total = torch.linalg.vector_norm(_stacked_norms([leaves[i] for i in at], p), p)
    return _rebuilt(leaves, spec, at, limit, total), total
