"""The one coalescing engine: tensors -> flat buffers per (device, dtype) -> views.

Every operation that moves or reduces many tensors at once in one process
(``replicate``, ``scatter``/``gather``, ``fr.all_reduce``) goes through here, so that a tree of
400 small tensors costs a handful of copies instead of 400. Across processes,
``fr.distributed``'s buckets (``_distributed/_layout`` and ``_copy``: DDP's
bucket rule, flag words, rank-major chunks) are laid out there, a traced
reduction's buffer concatenated by ``pack``. Packing is plain differentiable tensor ops (``cat``,
``to``, ``split``, ``view``), so it composes with autograd and ``torch.func``
without a custom ``autograd.Function``.

The engine knows nothing of trees or modules: callers flatten, pass lists of
tensors (deduplicated), and unflatten. Errors name the caller's paths through
the ``paths`` arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import NamedTuple, TypeVar

import torch

from ._torch import foreach_add, foreach_add_, is_compiling, transform_level

__all__ = [
    "Layout",
    "broadcast_coalesced",
    "check_packable",
    "group_by",
    "layout_of",
    "move",
    "move_each",
    "pack",
    "reduce_add_coalesced",
    "unpack",
]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Layout(NamedTuple):
    """Where each tensor of a packed list lies in its flat buffer."""

    shapes: tuple[torch.Size, ...]
    numels: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def layout_of(tensors: Sequence[torch.Tensor]) -> Layout:
    """The layout of ``tensors`` (all of one dtype and device) in a flat buffer."""
    first = tensors[0]
    return Layout(
        tuple(t.shape for t in tensors),
        tuple(t.numel() for t in tensors),
        first.dtype,
        first.device,
    )


def group_by(items: Iterable[V], key: Callable[[V], K]) -> dict[K, list[int]]:
    """Indices of ``items`` grouped by ``key``, groups and members in first-seen order.

    >>> group_by([torch.ones(1), torch.ones(1, dtype=torch.int64), torch.ones(2)],
    ...          lambda t: t.dtype)
    {torch.float32: [0, 2], torch.int64: [1]}
    """
    groups: dict[K, list[int]] = {}
    for i, t in enumerate(items):
        groups.setdefault(key(t), []).append(i)
    return groups


def device_dtype(t: torch.Tensor) -> tuple[torch.device, torch.dtype]:
    return t.device, t.dtype


def check_packable(
    tensors: Sequence[torch.Tensor], idx: Sequence[int], paths: Sequence[str], *, caller: str
) -> None:
    """Raise ``TypeError`` naming the path of a leaf the engine cannot pack.

    ``tensors[k]`` is the caller's leaf ``idx[k]``, whose path is ``paths[idx[k]]``
    (``paths`` may be lazy: it is read only to raise).
    """
    for t, i in zip(tensors, idx):
        if t.layout != torch.strided:
            raise TypeError(
                f"{caller}: the tensor at {paths[i]} has layout {t.layout}, which cannot be packed "
                "into a flat buffer; convert it (e.g. .to_dense()) or keep it out of the tree"
            )


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate ``tensors`` (one dtype, one device) into one flat buffer.

    >>> pack([torch.ones(2, 2), torch.zeros(3)])
    tensor([1., 1., 1., 1., 0., 0., 0.])
    """
    flat = [t.reshape(-1) for t in tensors]
    if len(flat) == 1:
        # cat of one tensor would copy; a view is enough for a buffer we only read.
        return flat[0]
    return torch.cat(flat)


def unpack(flat: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """Split ``flat`` back into views shaped as ``layout`` says.

    >>> flat = torch.arange(5.)
    >>> [v.shape for v in unpack(flat, layout_of([torch.ones(2, 1), torch.ones(3)]))]
    [torch.Size([2, 1]), torch.Size([3])]
    """
    if len(layout.numels) == 1:
        return [flat.view(layout.shapes[0])]
    return [p.view(s) for p, s in zip(flat.split(layout.numels), layout.shapes)]


def move(
    flat: torch.Tensor,
    device: torch.device,
    idx: Sequence[int],
    paths: Sequence[str],
    *,
    caller: str,
) -> torch.Tensor:
    """``flat.to(device)``; a failure is a ``TypeError`` naming the leaves packed in ``flat``.

    Running out of memory is no fault of the leaves: it is raised as it is.
    """
    try:
        return flat.to(device, non_blocking=flat.is_cuda and device.type == "cuda")
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, NotImplementedError) as err:
        shown = ", ".join(paths[i] for i in idx[:3]) + (", ..." if len(idx) > 3 else "")
        raise TypeError(
            f"{caller}: cannot move the tensor(s) at {shown} from {flat.device} to {device}: {err}"
        ) from err


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor],
    devices: Sequence[torch.device],
    *,
    paths: Sequence[str],
    caller: str,
    detach: bool = False,
) -> list[list[torch.Tensor]]:
    """Copies of ``tensors`` on every device: ``result[d][i]`` is tensor ``i`` on ``devices[d]``.

    A tensor already on a target device is returned as is (shared, no copy).
    The others are packed per (source device, dtype), each flat buffer is moved
    once per distinct target device, and split back into views; repeated
    target devices share those views. Differentiable unless ``detach``: the
    gradient reaching each input is the sum over its copies.
    """
    if detach:
        with torch.no_grad():
            return _broadcast(tensors, devices, paths, caller, detach=True)
    return _broadcast(tensors, devices, paths, caller, detach=False)


def move_each(
    tensors: Sequence[torch.Tensor],
    targets: Sequence[torch.device],
    *,
    paths: Sequence[str],
    caller: str,
) -> list[torch.Tensor]:
    """``tensors[i]`` onto ``targets[i]``, coalesced per target device; those already there as is.

    Sparse tensors, which cannot be packed, move one by one.

    >>> t = torch.ones(2)
    >>> out = move_each([t, t], [torch.device("cpu"), torch.device("meta")], paths=["a", "b"],
    ...                 caller="f")
    >>> out[0] is t, out[1].device
    (True, device(type='meta'))
    """
    out = list(tensors)
    away = [i for i in range(len(tensors)) if tensors[i].device != targets[i]]
    if any(tensors[i].layout != torch.strided for i in away):
        for i in away:  # sparse tensors cannot be packed: each moves on its own
            if tensors[i].layout != torch.strided:
                out[i] = tensors[i].to(targets[i])
        away = [i for i in away if tensors[i].layout == torch.strided]
    for device, idx in group_by(away, targets.__getitem__).items():
        moved = _broadcast(
            [tensors[away[k]] for k in idx],
            [device],
            [paths[away[k]] for k in idx],
            caller,
            detach=False,
        )[0]
        for k, t in zip(idx, moved):
            out[away[k]] = t
    return out


def _broadcast(
    tensors: Sequence[torch.Tensor],
    devices: Sequence[torch.device],
    paths: Sequence[str],
    caller: str,
    *,
    detach: bool,
) -> list[list[torch.Tensor]]:
    def same(t: torch.Tensor) -> torch.Tensor:
        return t.detach() if detach and (t.requires_grad or t.grad_fn is not None) else t

    per_device: dict[torch.device, list[torch.Tensor]] = {}
    groups: dict[tuple[torch.device, torch.dtype], list[int]] | None = None
    for device in devices:
        if device in per_device:
            continue
        out: list[torch.Tensor | None] = [same(t) if t.device == device else None for t in tensors]
        if any(o is None for o in out):
            if groups is None:
                groups = group_by(tensors, device_dtype)
            for (src, _), idx in groups.items():
                if src == device:
                    continue
                members = [tensors[i] for i in idx]
                check_packable(members, idx, paths, caller=caller)
                moved = move(pack(members), device, idx, paths, caller=caller)
                for i, view in zip(idx, unpack(moved, layout_of(members))):
                    out[i] = view
        per_device[device] = out  # type: ignore[assignment]
    return [per_device[d] for d in devices]


def reduce_add_coalesced(
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    device: torch.device,
    *,
    paths: Sequence[str],
    caller: str,
) -> list[torch.Tensor]:
    """Leaf-wise sum of several lists of tensors (equal shapes and dtypes), on ``device``.

    Each list is packed per (device, dtype), every flat buffer moved once to
    ``device`` and summed there; the result is split back into views.
    Differentiable. When every tensor already lies on ``device`` (and no
    autograd or ``torch.func`` is involved), packing would only add copies:
    the lists are summed leaf-wise in fused ``_foreach_add`` passes instead.
    """
    if len(tensor_lists) > 1 and _all_local(tensor_lists, device):
        sums = foreach_add(tensor_lists[0], tensor_lists[1])
        for lst in tensor_lists[2:]:
            foreach_add_(sums, lst)  # our own fresh sums
        return sums
    first = tensor_lists[0]
    # group positions by dtype and by the devices they lie on in every list
    groups = group_by(
        range(len(first)),
        lambda i: (first[i].dtype, tuple(lst[i].device for lst in tensor_lists)),
    )
    result: list[torch.Tensor | None] = [None] * len(first)
    for idx in groups.values():
        total: torch.Tensor | None = None
        for lst in tensor_lists:
            members = [lst[i] for i in idx]
            check_packable(members, idx, paths, caller=caller)
            flat = move(pack(members), device, idx, paths, caller=caller)
            total = flat if total is None else total + flat
        assert total is not None
        if len(tensor_lists) == 1 and total.device == first[idx[0]].device and len(idx) == 1:
            total = total.clone()  # never hand back the caller's own tensor as a "sum"
        for i, view in zip(idx, unpack(total, layout_of([first[i] for i in idx]))):
            result[i] = view
    return result  # type: ignore[return-value]


def _all_local(tensor_lists: Sequence[Sequence[torch.Tensor]], device: torch.device) -> bool:
    """Every tensor strided, on ``device``, eager, outside autograd and any ``torch.func`` transform.

    While Dynamo traces, the packed sum below is the one path (the compiler fuses it).
    """
    if is_compiling() or transform_level() is not None:
        return False
    return all(
        t.device == device and t.layout == torch.strided and not t.requires_grad
        for lst in tensor_lists
        for t in lst
    )
