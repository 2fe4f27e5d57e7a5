"""The one coalescing engine: tensors -> flat buffers per (device, dtype) -> views.

Every operation that moves or reduces many tensors at once in one process
(``replicate``, ``scatter``/``gather``, ``fr.all_reduce``) goes through here, so that a tree of
400 small tensors costs a handful of copies instead of 400. Across processes,
``fr.distributed``'s buckets (``_distributed/_layout`` and ``_wire``: DDP's
bucket rule, flag words, rank-major chunks) are laid out there. Packing is
plain differentiable tensor ops (``cat``, ``to``, ``split``, ``view``,
``permute``), so it composes with autograd and ``torch.func`` without a
custom ``autograd.Function``.

A tensor lies in its buffer in its own memory order (``memory_order``: a
``channels_last`` one stays ``channels_last``, a transposed one transposed),
and its view comes back with its strides, as ``t.to(device)`` keeps them; and
every tensor starts at a multiple of 64 bytes of its buffer, as torch's
allocator aligns a tensor of its own (CPU kernels, matmul among them, round
differently on data at other offsets). ``fr.distributed``'s wire format does
the same.

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
    "ALIGN",
    "Layout",
    "broadcast_coalesced",
    "check_packable",
    "group_by",
    "layout_of",
    "memory_order",
    "move",
    "move_each",
    "pack",
    "reduce_add_coalesced",
    "unpack",
]

#: bytes every tensor's place in a flat buffer starts at a multiple of (torch's CPU allocator's)
ALIGN = 64

_NUMEL = torch.Tensor.numel
_IS_CONTIGUOUS = torch.Tensor.is_contiguous

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


Order = tuple[int, ...] | None


class Layout(NamedTuple):
    """Where and how each tensor of a packed list lies in its flat buffer.

    ``orders[i]``: tensor ``i``'s dims from outermost to innermost in memory
    (``None``: contiguous); ``pads[i]``: the elements after it that make the
    next one start 64-byte aligned (0 after the last).
    """

    shapes: tuple[torch.Size, ...]
    numels: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    orders: tuple[Order, ...]
    pads: tuple[int, ...]

    @property
    def size(self) -> int:
        """Elements of the flat buffer."""
        return sum(self.numels) + sum(self.pads)


def memory_order(t: torch.Tensor) -> Order:
    """The dims of ``t`` from outermost to innermost in memory, as ``t.to(device)`` lays them out.

    ``None`` for a contiguous tensor. The rule is torch's own (``empty_like``'s
    and ``.to()``'s, which keep a tensor's layout): dims by decreasing stride;
    of two of one stride, the larger outside; a dim of stride 0 stays where it
    is in a contiguous tensor. A dense tensor's view then has its strides (a
    dim of size 1 where its stride is the product of the sizes inside it, as
    ``channels_last`` and ``unsqueeze`` make it); a tensor that is not dense
    (a slice, an expanded tensor) is laid out dense, in the order of its
    strides, as ``.to()`` and ``clone()`` copy it.

    >>> memory_order(torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last))
    (0, 2, 3, 1)
    >>> memory_order(torch.empty(3, 4).t()), memory_order(torch.empty(3, 4)[:, :2])
    ((1, 0), None)
    >>> memory_order(torch.empty(8, 1, 3, 3).to(memory_format=torch.channels_last))
    (0, 2, 3, 1)
    """
    shape = t.shape
    if t.is_contiguous() and 1 not in shape:
        return None
    strides = t.stride()
    # torch's insertion sort (infer_dense_strides) of the dims, innermost first: each dim
    # moves inwards past those of larger stride (of equal stride: of larger size); a
    # stride of 0, or equal strides and sizes in order, decide nothing
    perm = list(range(t.dim() - 1, -1, -1))
    for i in range(1, len(perm)):
        here = i
        for inward in range(i - 1, -1, -1):
            a, b = perm[inward], perm[here]
            sa, sb = strides[a], strides[b]
            if sa == 0 or sb == 0:
                continue
            if sa < sb:
                break
            if sa > sb or shape[a] > shape[b]:
                perm[inward], perm[here] = b, a
                here = inward
    order = tuple(reversed(perm))
    return None if order == tuple(range(len(order))) else order


def layout_of(tensors: Sequence[torch.Tensor]) -> Layout:
    """The layout of ``tensors`` (all of one dtype and device) in a flat buffer.

    >>> layout_of([torch.ones(2, 3).t(), torch.ones(20)])
    Layout(shapes=(torch.Size([3, 2]), torch.Size([20])), numels=(6, 20), dtype=torch.float32, device=device(type='cpu'), orders=((1, 0), None), pads=(10, 0))
    """
    first = tensors[0]
    shapes = tuple(t.shape for t in tensors)
    numels = tuple(map(_NUMEL, tensors))
    step = ALIGN // first.dtype.itemsize
    pads = (*(-n % step for n in numels[:-1]), 0)
    if all(map(_IS_CONTIGUOUS, tensors)) and not any(1 in s for s in shapes):
        orders: tuple[Order, ...] = (None,) * len(tensors)  # memory_order's fast path, at once
    else:
        orders = tuple(map(memory_order, tensors))
    return Layout(shapes, numels, first.dtype, first.device, orders, pads)


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


def pack(tensors: Sequence[torch.Tensor], layout: Layout | None = None) -> torch.Tensor:
    """Lay ``tensors`` (one dtype, one device) out in one flat buffer, as ``layout`` says.

    ``layout`` defaults to the tensors' own (``layout_of``). Given another
    list's (a reduction's other operands), each tensor is laid out in that
    list's memory orders, so that equal places of the buffers hold equal
    elements. Padding is zeros. One tensor in its memory order is its own
    buffer: a view, no copy.

    >>> pack([torch.ones(2, 2), torch.zeros(3)]).shape  # 4 floats, 12 of padding, 3 floats
    torch.Size([19])
    >>> pack([torch.arange(6.0).view(2, 3).t()])
    tensor([0., 1., 2., 3., 4., 5.])
    """
    if layout is None:
        layout = layout_of(tensors)
    if any(layout.orders):
        flat = [_flat(t, order) for t, order in zip(tensors, layout.orders)]
    else:
        flat = [t.reshape(-1) for t in tensors]
    if len(flat) == 1:
        # cat of one tensor would copy; a view is enough for a buffer we only read.
        return flat[0]
    if any(layout.pads):
        # where the tensors lie: a reduction packs every list in the first one's layout
        zeros = torch.zeros(max(layout.pads), dtype=layout.dtype, device=tensors[0].device)
        flat = [
            piece
            for t, pad in zip(flat, layout.pads)
            for piece in ((t, zeros[:pad]) if pad else (t,))
        ]
    return torch.cat(flat)


def unpack(flat: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """Split ``flat`` back into views shaped, strided and placed as ``layout`` says.

    >>> t = torch.ones(2, 3).t()
    >>> [v.stride() for v in unpack(torch.arange(19.0), layout_of([t, torch.ones(3)]))]
    [(1, 3), (1,)]
    """
    if len(layout.numels) == 1:
        pieces: Sequence[torch.Tensor] = [flat]
    elif any(layout.pads):
        cuts = [n for place in zip(layout.numels, layout.pads) for n in place]
        pieces = flat.split(cuts)[::2]
    else:
        pieces = flat.split(layout.numels)
    if any(layout.orders):
        return [_view(p, s, order) for p, s, order in zip(pieces, layout.shapes, layout.orders)]
    return [p.view(s) for p, s in zip(pieces, layout.shapes)]


def _flat(t: torch.Tensor, order: Order) -> torch.Tensor:
    """``t``'s elements in ``order`` (a view where ``t`` is dense in it, else a copy)."""
    return (t if order is None else t.permute(order)).reshape(-1)


def _view(piece: torch.Tensor, shape: torch.Size, order: Order) -> torch.Tensor:
    """``piece`` (``_flat``'s elements) as a tensor of ``shape`` laid out in ``order``."""
    if order is None:
        return piece.view(shape)
    inverse = [0] * len(order)
    for i, d in enumerate(order):
        inverse[d] = i
    return piece.view([shape[d] for d in order]).permute(inverse)


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
    once per distinct target device, and split back into views, each with
    its tensor's strides (``memory_order``) and 64-byte aligned; repeated
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
                layout = layout_of(members)
                moved = move(pack(members, layout), device, idx, paths, caller=caller)
                for i, view in zip(idx, unpack(moved, layout)):
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

    Each list is packed per (device, dtype), in the first list's memory
    orders, every flat buffer moved once to ``device`` and summed there; the
    result is split back into views with the first list's strides.
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
        layout: Layout | None = None
        for lst in tensor_lists:
            members = [lst[i] for i in idx]
            check_packable(members, idx, paths, caller=caller)
            if layout is None:
                # every list laid out in the first one's memory orders: the sums are in them
                layout = layout_of(members)
            flat = move(pack(members, layout), device, idx, paths, caller=caller)
            total = flat if total is None else total + flat
        assert total is not None and layout is not None
        if len(tensor_lists) == 1 and total.device == first[idx[0]].device and len(idx) == 1:
            total = total.clone()  # never hand back the caller's own tensor as a "sum"
        for i, view in zip(idx, unpack(total, layout)):
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
