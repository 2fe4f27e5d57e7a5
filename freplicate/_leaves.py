"""Fresh differentiable leaves for a list of tensors, small ones of a shape stacked into one.

``fr.grad_and_value`` differentiates fresh detached copies of the caller's
tensors (never the tensors themselves). On models of hundreds of small
tensors, a leaf each costs more than their arithmetic: a detached tensor, a
gradient accumulator and a captured result apiece. ``Leaves`` copies the
small contiguous tensors of one shape, dtype and device into one stacked
leaf instead; ``fn`` sees its ``unbind`` views, and the stack's gradient
holds theirs. ``fr.distributed.grad_and_value`` stacks per bucket run, so a
run's gradient fills its part of a bucket in one copy.

A stack cannot take a sparse gradient (``nn.Embedding(sparse=True)``), and
nothing tells before the backward pass that one will come: a pre-hook on
each stack's ``unbind`` node raises ``SparseInStack``, our own signal, when
one does, and the caller runs ``fn`` again without stacks (``_autodiff``).
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Sequence
from typing import Any

import torch

from . import _caches
from ._tree import picker

__all__ = [
    "PLAIN",
    "STACK_NUMEL",
    "UNSTACKED",
    "Leaves",
    "SparseInStack",
    "leaves_for",
    "stack_groups",
    "unstack",
]

_REQUIRES_GRAD_ = torch.Tensor.requires_grad_
_DETACH = torch.Tensor.detach
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_SIG = operator.attrgetter("shape", "dtype", "device")
# Tensors of at most this many elements are stacked with the others of their shape (``Leaves``):
# below it a stack's copy costs less than a leaf of their own (~2 us of autograd bookkeeping).
STACK_NUMEL = 4096
# Fewer tensors than this are never stacked: the layout lookup would cost more than it saves.
_STACK_MIN_TENSORS = 8
PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})
_LAYOUT_CACHE_SIZE = 16
_STRIDED = torch.strided


class SparseInStack(Exception):
    """A stacked leaf's view got a sparse gradient, which the stack's backward cannot take.

    Raised from the stack's own backward pre-hook, before autograd tries;
    the caller differentiates again with one leaf a tensor (``unstack``).
    """


def _refuse_sparse(grads: tuple[torch.Tensor | None, ...]) -> None:
    for g in grads:
        if g is not None and g.layout is not _STRIDED:
            raise SparseInStack


class Leaves:
    """Fresh differentiable leaves standing for a list of tensors (one layout of them).

    Differentiating hundreds of small tensors one by one costs each a detached
    leaf, a gradient accumulator and a captured result, more than their
    arithmetic. Small tensors of one shape, dtype and device are instead
    copied into one *stacked* leaf; ``fn`` sees its ``unbind`` views, and the
    stack's gradient holds theirs (autograd's ``UnbindBackward`` stacks them,
    zeros for those that do not reach the output). ``groups`` lists the
    positions behind each differentiable leaf, in order: one position is the
    tensor's own detached leaf, several a stack (of contiguous tensors only:
    ``fn`` sees the strides it would see). Gradients are unchanged to the
    bit: the same operations on the same values and strides.

    >>> ts = [torch.ones(2), torch.full((2,), 2.0), torch.ones(3)]
    >>> layout = Leaves([[0, 1], [2]])
    >>> diff, fresh = layout.make(ts)
    >>> [tuple(d.shape) for d in diff], [f.tolist() for f in fresh]
    ([(2, 2), (3,)], [[1.0, 1.0], [2.0, 2.0], [1.0, 1.0, 1.0]])
    >>> loss = (fresh[0] * 3).sum() + fresh[2].sum()
    >>> [g.tolist() for g in layout.split(torch.autograd.grad(loss, diff))]
    [[3.0, 3.0], [0.0, 0.0], [1.0, 1.0, 1.0]]
    """

    __slots__ = ("gets", "identity", "reorder", "singles", "sizes", "stacked")

    def __init__(self, groups: Sequence[Sequence[int]]) -> None:
        self.sizes = [len(g) for g in groups]
        self.stacked = any(k > 1 for k in self.sizes)  # a leaf stacks several tensors
        self.gets = [operator.itemgetter(*g) for g in groups]
        order = [i for g in groups for i in g]
        # no group (any number of tensors), or one leaf a tensor in the tensors' order
        self.identity = order == list(range(len(order))) and all(k == 1 for k in self.sizes)
        # nothing stacked, in another order (fr.distributed's buckets): the leaves in that order
        self.singles = picker(order) if all(k == 1 for k in self.sizes) else None
        inverse = [0] * len(order)
        for j, i in enumerate(order):
            inverse[i] = j
        self.reorder = picker(inverse)

    def make(
        self, tensors: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """``(diff, fresh)``: the leaves to differentiate, one tensor per position for ``fn``.

        ``None`` where a group to stack holds a tensor that is not contiguous
        (its ``fn`` would see other strides, and reductions may round
        differently) or not strided: the caller falls back to a layout
        stacking nothing.
        """
        if self.identity:
            fresh = list(map(_REQUIRES_GRAD_, map(_DETACH, tensors)))
            return fresh, fresh
        if self.singles is not None:
            diff = list(map(_REQUIRES_GRAD_, map(_DETACH, self.singles(tensors))))
            return diff, self.reorder(diff)
        diff = []
        views: list[torch.Tensor] = []
        # views of a stack track it even under no_grad: ``enable_grad`` at C speed
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(True)
        try:
            for get, k in zip(self.gets, self.sizes):
                if k == 1:
                    leaf = get(tensors).detach().requires_grad_()
                    views.append(leaf)
                else:
                    members = get(tensors)
                    try:
                        if not all(map(_IS_CONTIGUOUS, members)):
                            return None
                    except RuntimeError:  # layouts without strides (sparse CSR ...)
                        return None
                    leaf = torch.stack(members).requires_grad_()
                    unbound = leaf.unbind(0)
                    node = unbound[0].grad_fn
                    assert node is not None  # a view of a stack that requires grad
                    node.register_prehook(_refuse_sparse)
                    views += unbound
                diff.append(leaf)
        finally:
            torch._C._set_grad_enabled(grad)
        return diff, self.reorder(views)

    def split(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One gradient per position, from the gradients of the ``diff`` that ``make`` returned."""
        if self.identity:
            return list(grads)
        if self.singles is not None:
            return self.reorder(grads)
        out: list[torch.Tensor] = []
        for g, k in zip(grads, self.sizes):
            if k == 1:
                out.append(g)
            else:
                out += g.unbind(0)
        return self.reorder(out)


UNSTACKED = Leaves([])
_LAYOUTS: dict[tuple[Any, ...], Leaves] = {}
_LAYOUTS_LOCK = threading.Lock()
_caches.register(_LAYOUTS.clear)


def stack_groups(sigs: Sequence[tuple[torch.Size, torch.dtype, torch.device]]) -> list[list[int]]:
    """Positions grouped for ``Leaves``: small tensors by (shape, dtype, device), others alone."""
    groups: dict[Any, list[int]] = {}
    for i, (shape, dtype, device) in enumerate(sigs):
        key = (shape, dtype, device) if shape.numel() <= STACK_NUMEL else i
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def unstack(tensors: Sequence[torch.Tensor]) -> None:
    """Never stack ``tensors``' layout again: one of them gets a sparse gradient.

    A parameter's gradient can be sparse (``nn.Embedding(sparse=True)``),
    which a stack's backward cannot take; nothing says so before the backward.
    """
    sigs = tuple(map(_SIG, tensors))
    with _LAYOUTS_LOCK:
        _LAYOUTS[sigs] = UNSTACKED


def leaves_for(tensors: Sequence[torch.Tensor]) -> Leaves:
    """The cached ``Leaves`` of ``tensors``' layout (plain tensors only are ever stacked)."""
    if len(tensors) < _STACK_MIN_TENSORS or not set(map(type, tensors)) <= PLAIN:
        return UNSTACKED
    sigs = tuple(map(_SIG, tensors))
    layout = _LAYOUTS.get(sigs)
    if layout is None:
        groups = stack_groups(sigs)
        layout = Leaves(groups) if len(groups) < len(sigs) else UNSTACKED  # none stacked: as given
        with _LAYOUTS_LOCK:  # fr.data_parallel_grad's replicas call this from several threads
            _LAYOUTS[sigs] = layout
            while len(_LAYOUTS) > _LAYOUT_CACHE_SIZE:
                del _LAYOUTS[next(iter(_LAYOUTS))]  # the oldest layout
    return layout
