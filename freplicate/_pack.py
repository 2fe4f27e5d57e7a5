"""The one coalescing engine: tensors -> flat buffers per (device, dtype) -> views.

Every operation that moves or reduces many tensors at once (``replicate``,
``all_reduce`` in one process, ``fr.distributed.broadcast`` / ``all_reduce``)
goes through here, so that a tree of 400 small tensors costs a handful of
copies instead of 400. Packing is plain differentiable tensor ops (``cat``,
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

from ._torch import storage_use_count, transform_level

__all__ = [
    "Layout",
    "broadcast_coalesced",
    "buckets",
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


def buckets(numels: Sequence[int], itemsize: int, cap_bytes: int) -> list[range]:
    """Split consecutive tensors into runs whose bytes stay within ``cap_bytes``.

    A tensor larger than the cap gets a bucket of its own (as DDP's buckets).

    >>> buckets([3, 3, 3, 10, 1], itemsize=4, cap_bytes=24)
    [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    """
    out: list[range] = []
    start, size = 0, 0
    for i, n in enumerate(numels):
        nbytes = n * itemsize
        if i > start and size + nbytes > cap_bytes:
            out.append(range(start, i))
            start, size = i, 0
        size += nbytes
    if numels:
        out.append(range(start, len(numels)))
    return out


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
        sums = list(torch._foreach_add(list(tensor_lists[0]), list(tensor_lists[1])))
        for lst in tensor_lists[2:]:
            torch._foreach_add_(sums, list(lst))  # our own fresh sums
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
    """Every tensor strided, on ``device``, outside autograd and any ``torch.func`` transform."""
    if transform_level() is not None:
        return False
    return all(
        t.device == device and t.layout == torch.strided and not t.requires_grad
        for lst in tensor_lists
        for t in lst
    )


# --- Flat buffers reused across calls (fr.distributed) -----------------------------------
# For fr.distributed's buckets: a collective reduces a flat buffer in
# place, and handing its views out as results is the cheapest way back to a
# tree; a fresh buffer per call costs page faults on large trees. A pool
# reuses a buffer only once no tensor outside the pool shares its storage.
# Consecutive tensors of one shape form a *run*, packed by one ``torch.stack``
# and viewed back by one ``unbind``: a few C++ calls for hundreds of tensors.


def runs_of(shapes: Sequence[torch.Size]) -> list[tuple[torch.Size, int]]:
    """``(shape, count)`` for each run of consecutive equal shapes.

    >>> runs_of([torch.Size([2]), torch.Size([2]), torch.Size([3, 1])])
    [(torch.Size([2]), 2), (torch.Size([3, 1]), 1)]
    """
    out: list[tuple[torch.Size, int]] = []
    for s in shapes:
        if out and out[-1][0] == s:
            out[-1] = (s, out[-1][1] + 1)
        else:
            out.append((s, 1))
    return out


class FlatPool:
    """Flat buffers for one list of shapes, each reused only when nothing outside the pool holds it.

    ``take()`` returns ``(flat, runs)``: ``runs`` are the pool's own views
    of ``flat``, one ``(count, *shape)`` view per run of equal shapes.
    ``pack(runs, parts)`` copies tensors in (casting to the pool's dtype),
    one part per run: its tensors, or one tensor holding them stacked;
    ``views(runs)`` makes fresh per-tensor views to hand out as results.
    Those keep their buffer *busy* until they, and every view or autograd
    record made from them, are gone; then it is *spare*, and a later
    ``take()`` hands it out again. The pool keeps at most ``keep`` buffers
    and, beyond the busy ones, at most one spare: ``take()`` lets go of any
    other (a loop that holds one result while it asks for the next
    alternates between two buffers; one that drops them all keeps one).
    ``clear()`` lets go of all of them. ``extra`` spare elements follow the
    tensors' at the end of every buffer: the caller's own (``flat[-extra:]``),
    never packed nor viewed by the pool.

    >>> pool = FlatPool([torch.Size([2]), torch.Size([2]), torch.Size([])], torch.float32, "cpu")
    >>> a, runs = pool.take()
    >>> pool.pack(runs, [[torch.ones(2), torch.zeros(2)], torch.tensor([5.0])])
    >>> result = pool.views(runs)  # handed out: a is busy
    >>> result
    [tensor([1., 1.]), tensor([0., 0.]), tensor(5.)]
    >>> pool.take()[0].data_ptr() != a.data_ptr()
    True
    >>> del result
    >>> pool.take()[0].data_ptr() == a.data_ptr()
    True
    """

    def __init__(
        self,
        shapes: Sequence[torch.Size],
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        keep: int = 3,
        extra: int = 0,
    ) -> None:
        self.runs = runs_of(shapes)
        self.numel = sum(s.numel() * k for s, k in self.runs) + extra
        self.dtype = dtype
        self.device = torch.device(device)
        self.keep = keep if storage_use_count(torch.empty(0)) is not None else 0
        # (buffer, its runs, the use count of its storage when nothing outside the pool holds it)
        self.entries: list[tuple[torch.Tensor, list[torch.Tensor], int | None]] = []

    @staticmethod
    def _uses(flat: torch.Tensor) -> int | None:
        return storage_use_count(flat)

    def take(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        spare = None
        kept = []
        for entry in self.entries:
            if self._uses(entry[0]) != entry[2]:
                kept.append(entry)  # busy: a result still views it
            elif spare is None:
                spare = entry
                kept.append(entry)
            # else a second spare buffer: let it go (one spare at most)
        if len(kept) != len(self.entries):
            self.entries = kept
        if spare is not None:
            return spare[0], spare[1]
        flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        runs, offset = [], 0
        for shape, count in self.runs:
            n = shape.numel() * count
            runs.append(flat[offset : offset + n].view(count, *shape))
            offset += n
        if len(self.entries) < self.keep:
            self.entries.append((flat, runs, self._uses(flat)))
        return flat, runs

    def clear(self) -> None:
        """Let go of every buffer (results still held keep theirs alive, as any tensor)."""
        self.entries = []

    def pack(
        self,
        runs: Sequence[torch.Tensor],
        parts: Sequence[torch.Tensor | Sequence[torch.Tensor]],
        *,
        div: int = 1,
    ) -> None:
        """Copy ``parts`` (one per run: its tensors, or them already stacked) into ``runs``' buffer.

        With ``div``, the buffer receives ``tensor / div`` (a mean's division,
        done in the same pass as the copy where a run comes in one tensor).
        """
        with torch.no_grad():
            for run, part in zip(runs, parts):
                if isinstance(part, torch.Tensor):
                    if div != 1:
                        torch.div(part, div, out=run)
                    else:
                        run.copy_(part)
                elif len(part) == 1 and div != 1:
                    torch.div(part[0], div, out=run[0])
                else:
                    torch.stack(list(part), out=run)
                    if div != 1:
                        run.div_(div)

    @staticmethod
    def views(runs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Fresh views of the buffer of ``runs``, one per tensor, in order."""
        if len(runs) == 1:
            return list(runs[0].unbind(0))
        return [v for run in runs for v in run.unbind(0)]
