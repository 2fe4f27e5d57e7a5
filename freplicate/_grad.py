"""``grad_and_value``: the results of ``torch.func.grad_and_value``, at autograd's price.

``torch.func.grad`` wraps every tensor of the differentiated tree in a
``GradTrackingTensor`` and unwraps every result, a per-tensor cost that
dominates on models of hundreds of small tensors. Outside any ``torch.func``
transform the same gradients come from one ``torch.autograd.grad`` call over
fresh detached leaves (the caller's tensors are never touched; small ones of
one shape stacked into one leaf, ``Leaves``), with zeros for leaves that do
not reach the output. Under a transform (``vmap``, ``grad``, ``jvp`` ...),
under ``torch.inference_mode`` (where autograd records nothing), for
inference tensors, or when some input already carries an autograd graph, it
defers to ``torch.func.grad_and_value`` itself, so it composes exactly as
that does.
"""

from __future__ import annotations

import functools
import itertools
import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
import torch.func
from torch._C._functorch import maybe_current_level
from torch.overrides import has_torch_function

from ._tree import picker, tensor_values

__all__ = ["Leaves", "grad_and_value", "leaves_for"]


def grad_and_value(
    fn: Callable[..., Any], *, argnums: int | tuple[int, ...] = 0, has_aux: bool = False
) -> Callable[..., tuple[Any, Any]]:
    """``g(*args) -> (grads, value)`` with exactly ``torch.func.grad_and_value``'s results.

    ``grads`` has the structure of ``args[argnums]`` (a tuple of such trees
    for a tuple ``argnums``); ``value`` is ``fn``'s scalar output (with
    ``has_aux``, ``(value, aux)``). Leaves that do not reach the output get
    zero gradients.

    >>> w = {"a": torch.tensor(2.0), "b": torch.tensor(5.0)}
    >>> grad_and_value(lambda w, x: w["a"] * x)(w, torch.tensor(3.0))
    ({'a': tensor(3.), 'b': tensor(0.)}, tensor(6.))
    """
    if not (isinstance(argnums, int) or (isinstance(argnums, tuple) and argnums)):
        raise TypeError(
            f"fr.grad_and_value: argnums must be an int or a non-empty tuple of ints, got {argnums!r}"
        )
    reference = torch.func.grad_and_value(fn, argnums=argnums, has_aux=has_aux)

    def wrapper(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if maybe_current_level() is not None or torch.is_inference_mode_enabled():
            # under inference_mode autograd records nothing, even with enable_grad:
            # torch.func still differentiates there
            return reference(*args, **kwargs)
        nums = (argnums,) if isinstance(argnums, int) else argnums
        for n in nums:
            if not -len(args) <= n < len(args):
                raise RuntimeError(
                    f"fr.grad_and_value: argnums={argnums!r} is out of range for "
                    f"{len(args)} positional argument(s)"
                )
        flat = [_flatten(args[n]) for n in nums]  # each differentiated tree once
        chosen = {n % len(args) for n in nums}
        others = [a for i, a in enumerate(args) if i not in chosen]
        rest: list[Any] = optree.tree_leaves((others, kwargs))  # type: ignore[arg-type]
        tensors = list(itertools.chain.from_iterable(leaves for leaves, _ in flat))
        only_tensors = all(issubclass(k, torch.Tensor) for k in set(map(type, tensors)))
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in rest) or (
            any(map(_REQUIRES_GRAD, tensors))
            if only_tensors
            else any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)
        ):
            # an outer autograd graph: torch.func keeps it, so let it answer
            return reference(*args, **kwargs)
        if not only_tensors:
            for n, (leaves, _) in zip(nums, flat):
                for leaf in leaves:
                    if not isinstance(leaf, torch.Tensor):
                        raise RuntimeError(
                            f"fr.grad_and_value: expected only tensors in args[{n}], "
                            f"got a leaf of type {type(leaf).__name__}"
                        )
        layout = leaves_for(tensors)
        try:
            made = layout.make(tensors)
            if made is None:
                layout = UNSTACKED
                made = layout.make(tensors)
            assert made is not None
            diff, fresh = made
        except RuntimeError:
            # made under inference_mode (no requires_grad outside it): torch.func copes
            if any(t.is_inference() for t in tensors):
                return reference(*args, **kwargs)
            raise
        new_args = list(args)
        start = 0
        for n, (leaves, rebuild) in zip(nums, flat):
            new_args[n] = rebuild(fresh[start : start + len(leaves)])
            start += len(leaves)
        with torch.enable_grad():
            value, aux = split_output(fn(*new_args, **kwargs), has_aux, "fr.grad_and_value")
            grads = layout.split(gradients(value, diff))
        trees = []
        start = 0
        for leaves, rebuild in flat:
            trees.append(rebuild(grads[start : start + len(leaves)]))
            start += len(leaves)
        result = trees[0] if isinstance(argnums, int) else tuple(trees)
        return result, detached(value, aux, has_aux)

    wrapper.__doc__ = getattr(fn, "__doc__", None)
    wrapper.__name__ = f"grad_and_value({getattr(fn, '__name__', 'fn')})"
    return wrapper


def _flatten(tree: Any) -> tuple[list[Any], Callable[[Sequence[Any]], Any]]:
    """``(leaves, rebuild)``; a plain dict of tensors is taken as it is, without optree."""
    values = tensor_values(tree)
    if values is not None:
        keys = list(tree)
        return values, lambda new: dict(zip(keys, new))
    leaves, spec = optree.tree_flatten(tree)
    return leaves, functools.partial(optree.tree_unflatten, spec)


# The steps shared with fr.distributed.grad_and_value, which runs the same fast path.

# torch.autograd.grad's call into the engine (a private name: without it, autograd.grad itself)
_run_backward = getattr(torch.autograd.graph, "_engine_run_backward", None)
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
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

    __slots__ = ("gets", "identity", "reorder", "singles", "sizes")

    def __init__(self, groups: Sequence[Sequence[int]]) -> None:
        self.sizes = [len(g) for g in groups]
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
        with torch.enable_grad():  # views of a stack track it even under no_grad
            for get, k in zip(self.gets, self.sizes):
                if k == 1:
                    leaf = get(tensors).detach().requires_grad_()
                    views.append(leaf)
                else:
                    members = get(tensors)
                    if not _contiguous(members):
                        return None
                    leaf = torch.stack(members).requires_grad_()
                    views += leaf.unbind(0)
                diff.append(leaf)
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


def _contiguous(tensors: Sequence[torch.Tensor]) -> bool:
    try:
        return all(map(_IS_CONTIGUOUS, tensors))
    except RuntimeError:  # layouts without strides (sparse CSR ...); sparse COO says False
        return False


UNSTACKED = Leaves([])
_LAYOUTS: dict[tuple[Any, ...], Leaves] = {}
_LAYOUTS_LOCK = threading.Lock()


def stack_groups(
    sigs: Sequence[tuple[torch.Size, torch.dtype, torch.device]], positions: Sequence[int]
) -> list[list[int]]:
    """``positions`` grouped for ``Leaves``: small tensors by (shape, dtype, device), others alone."""
    groups: dict[Any, list[int]] = {}
    for i in positions:
        shape, dtype, device = sigs[i]
        key = (shape, dtype, device) if shape.numel() <= STACK_NUMEL else i
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def leaves_for(tensors: Sequence[torch.Tensor]) -> Leaves:
    """The cached ``Leaves`` of ``tensors``' layout (plain tensors only are ever stacked)."""
    if len(tensors) < _STACK_MIN_TENSORS or not set(map(type, tensors)) <= PLAIN:
        return UNSTACKED
    sigs = tuple(map(_SIG, tensors))
    layout = _LAYOUTS.get(sigs)
    if layout is None:
        groups = stack_groups(sigs, range(len(sigs)))
        layout = Leaves(groups) if len(groups) < len(sigs) else UNSTACKED  # none stacked: as given
        with _LAYOUTS_LOCK:  # fr.data_parallel_grad's replicas call this from several threads
            _LAYOUTS[sigs] = layout
            while len(_LAYOUTS) > _LAYOUT_CACHE_SIZE:
                del _LAYOUTS[next(iter(_LAYOUTS))]  # the oldest layout
    return layout


def split_output(output: Any, has_aux: bool, name: str) -> tuple[torch.Tensor, Any]:
    """``(value, aux)`` of ``fn``'s output; ``RuntimeError`` unless ``value`` is a scalar tensor."""
    if has_aux:
        if not (isinstance(output, tuple) and len(output) == 2):
            raise RuntimeError(f"{name}(f, has_aux=True): f must return a (output, aux) tuple")
        value, aux = output
    else:
        value, aux = output, None
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise RuntimeError(f"{name}: expected f(*args) to return a scalar tensor, got {shape}")
    return value, aux


def gradients(value: torch.Tensor, leaves: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """d value / d leaves, zeros for leaves that do not reach ``value`` (as torch.func).

    ``torch.autograd.grad``'s own engine call, without the argument checks
    it makes tensor by tensor in Python (tens of microseconds a call on a
    small model): ``value`` is a real scalar and ``leaves`` this call's own
    fresh tensors. Anything else (tensor subclasses, complex values, a torch
    without that entry point) goes through ``torch.autograd.grad`` itself.
    """
    if not (value.requires_grad and leaves):
        return tuple(torch.zeros_like(t) for t in leaves)
    if _run_backward is None or value.is_complex() or has_torch_function((value, *leaves)):
        return torch.autograd.grad(value, leaves, allow_unused=True, materialize_grads=True)
    grads = _run_backward(
        (value,),
        (torch.ones_like(value, memory_format=torch.preserve_format),),
        False,  # retain_graph
        False,  # create_graph
        tuple(leaves),
        True,  # allow_unused
        accumulate_grad=False,
    )
    return tuple(g if g is not None else torch.zeros_like(t) for g, t in zip(grads, leaves))


def detached(value: torch.Tensor, aux: Any, has_aux: bool) -> Any:
    """What torch.func returns beside the gradients: ``value``, or ``(value, aux)``, unwrapped."""
    if not has_aux:
        return value.detach()
    return value.detach(), optree.tree_map(
        lambda x: x.detach() if isinstance(x, torch.Tensor) else x, aux
    )
