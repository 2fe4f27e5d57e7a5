"""Gradients over fresh leaves: the autodiff behind ``fr.grad_and_value`` and ``fr.distributed``.

``torch.func.grad`` wraps every tensor of the differentiated tree and unwraps
every result, a per-tensor cost that dominates on models of hundreds of
small tensors. Outside any ``torch.func`` transform the same gradients come
from one autograd pass over fresh detached leaves (small ones of one shape
stacked into one leaf, ``_leaves``), with zeros for leaves that do not reach
the output; the caller's tensors are never touched.

Two things the fast path cannot know before ``fn`` has run are decided on
this call's own graph, by types, never by reading an error's text:

* a reentrant activation checkpoint (``use_reentrant=True``), which autograd
  differentiates only in a full ``.backward()`` (``.grad()`` raises in it,
  or skips it where no differentiated leaf lies below, which would leave its
  parameters without their gradient): every call walks its graph once for a
  checkpoint's node (``gradients_of``), and takes a full backward pass over
  its fresh leaves where it finds one;
* a stacked leaf that receives a sparse gradient: its pre-hook raises
  ``SparseInStack``; that layout is never stacked again, and ``fn`` runs
  again from the random state it started from (``Rewind``): the retry
  policy, written once (``retrying``).

Under a transform, ``torch.compile`` or inference mode,
``torch.func.grad_and_value`` itself answers.
"""

from __future__ import annotations

import functools
import itertools
import operator
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import optree
import torch
import torch.func
from torch.overrides import has_torch_function

from . import _caches
from ._leaves import UNSTACKED, Leaves, SparseInStack, leaves_for, unstack
from ._torch import (
    engine_grad,
    holds_reentrant_checkpoint,
    is_compiling,
    leaves_outside,
    transform_level,
)
from ._tree import tensor_values

__all__ = [
    "Rewind",
    "SparseInStack",
    "detached",
    "differentiate",
    "fresh_leaves",
    "gradients_of",
    "needs_full_backward",
    "retrying",
    "split_output",
]

T = TypeVar("T")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_IS_CUDA = operator.attrgetter("is_cuda")


class Rewind:
    """The random state a call of ``fn`` starts from, to run it again with the same numbers.

    The CPU generator always; each CUDA device of ``tensors`` when CUDA is
    initialised (as ``torch.utils.checkpoint`` keeps them).
    """

    __slots__ = ("cpu", "cuda")

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.cpu = torch.default_generator.get_state()  # torch.get_rng_state, less its frame
        self.cuda: list[tuple[int, torch.Tensor]] = []
        if any(map(_IS_CUDA, tensors)) and torch.cuda.is_initialized():
            devices = {t.device.index for t in tensors if t.is_cuda}
            self.cuda = [(d, torch.cuda.get_rng_state(d)) for d in sorted(i or 0 for i in devices)]

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for d, state in self.cuda:
            torch.cuda.set_rng_state(state, d)


def retrying(attempt: Callable[[], T], rewind: Rewind, tensors: Sequence[torch.Tensor]) -> T:
    """``attempt()``; after ``SparseInStack``, again from ``rewind``'s random state, unstacked.

    ``tensors``' layout is never stacked again, so a second signal cannot come.
    """
    try:
        return attempt()
    except SparseInStack:
        unstack(tensors)
        rewind.restore()
    return attempt()


def gradients_of(
    value: torch.Tensor, diff: list[torch.Tensor], caller: str
) -> tuple[tuple[torch.Tensor, ...], bool]:
    """``(d value / d diff, full)``: by ``.grad()``, or a full backward where this graph needs one.

    ``full`` says that a full ``.backward()`` ran, for a reentrant checkpoint
    in this call's graph (leaves' tensor hooks may fire more than once
    there). ``RuntimeError`` naming the count when that would also write the
    ``.grad`` of tensors ``fn`` closed over.
    """
    full = needs_full_backward(value, diff, caller)
    return gradients(value, diff, full=full), full


def needs_full_backward(value: torch.Tensor, diff: Sequence[torch.Tensor], caller: str) -> bool:
    """Whether ``value``'s graph holds a reentrant checkpoint (then only ``diff`` may be its leaves)."""
    if not value.requires_grad or not holds_reentrant_checkpoint(value):
        return False
    others = leaves_outside(value, diff)
    if others:
        raise RuntimeError(
            f"{caller}: fn uses torch.utils.checkpoint with use_reentrant=True, which autograd "
            "differentiates only with a full .backward(); that would also write the .grad of "
            f"{others} tensor(s) that fn uses and that require grad outside the differentiated "
            "arguments. Use use_reentrant=False (PyTorch's recommendation), or detach them."
        )
    return True


def gradients(
    value: torch.Tensor, leaves: list[torch.Tensor], *, full: bool = False
) -> tuple[torch.Tensor, ...]:
    """d value / d leaves, zeros for leaves that do not reach ``value`` (as torch.func).

    ``torch.autograd.grad``'s own engine call, without the checks it makes
    tensor by tensor in Python: ``value`` is a real scalar and ``leaves`` this
    call's own fresh tensors. Tensor subclasses and complex values go through
    ``torch.autograd.grad`` itself. With ``full``, one ``.backward()``
    accumulates into the fresh leaves' ``.grad`` (what a reentrant checkpoint
    requires), which are read and cleared.
    """
    if not (value.requires_grad and leaves):
        return tuple(torch.zeros_like(t) for t in leaves)
    if full:
        torch.autograd.backward(value)
        out = tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves)
        for t in leaves:
            t.grad = None
        return out
    if value.is_complex() or has_torch_function((value, *leaves)):
        return torch.autograd.grad(value, leaves, allow_unused=True, materialize_grads=True)
    grads = engine_grad(value, leaves)
    if not any(map(operator.is_, grads, itertools.repeat(None))):  # at C speed: all computed
        return tuple(grads)
    return tuple(g if g is not None else torch.zeros_like(t) for g, t in zip(grads, leaves))


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


def detached(value: torch.Tensor, aux: Any, has_aux: bool) -> Any:
    """What torch.func returns beside the gradients: ``value``, or ``(value, aux)``, unwrapped."""
    if not has_aux:
        return value.detach()
    return value.detach(), optree.tree_map(
        lambda x: x.detach() if isinstance(x, torch.Tensor) else x, aux
    )


# --- the differentiated trees of a call ------------------------------------------------


class Trees:
    """The differentiated arguments of a call, flattened: their leaves and how to rebuild them.

    ``nums``: which positional arguments; ``flat``: per argument, its leaves
    and a function rebuilding it from new ones; ``tensors``: every leaf, in order.
    """

    __slots__ = ("flat", "nums", "tensors")

    def __init__(self, args: Sequence[Any], nums: Sequence[int]) -> None:
        self.nums = nums
        self.flat = [_flatten(args[n]) for n in nums]
        self.tensors = list(itertools.chain.from_iterable(leaves for leaves, _ in self.flat))

    def args_with(self, args: Sequence[Any], fresh: Sequence[Any]) -> list[Any]:
        """``args`` with the differentiated trees rebuilt from ``fresh`` leaves."""
        new_args = list(args)
        start = 0
        for n, (leaves, rebuild) in zip(self.nums, self.flat):
            new_args[n] = rebuild(fresh[start : start + len(leaves)])
            start += len(leaves)
        return new_args

    def rebuild(self, grads: Sequence[Any]) -> list[Any]:
        trees = []
        start = 0
        for leaves, rebuild in self.flat:
            trees.append(rebuild(grads[start : start + len(leaves)]))
            start += len(leaves)
        return trees

    def path(self, i: int) -> str:
        """``args[n]`` and the path of leaf ``i`` (over every differentiated tree), for errors."""
        for n, (leaves, rebuild) in zip(self.nums, self.flat):
            if i < len(leaves):
                return f"args[{n}]{_path(rebuild, leaves, i)}"
            i -= len(leaves)
        return f"leaf {i}"  # pragma: no cover

    def check_tensors(self, caller: str) -> None:
        """``RuntimeError`` naming the first leaf that is not a tensor (torch.func's check)."""
        for n, (leaves, rebuild) in zip(self.nums, self.flat):
            for i, leaf in enumerate(leaves):
                if not isinstance(leaf, torch.Tensor):
                    raise RuntimeError(
                        f"{caller}: expected only tensors in args[{n}], "
                        f"got a leaf of type {type(leaf).__name__} at {_path(rebuild, leaves, i)}"
                    )

    def check_differentiable(self, caller: str) -> None:
        """``RuntimeError`` naming the first leaf that is not floating-point or complex."""
        for i, t in enumerate(self.tensors):
            if not (t.is_floating_point() or t.is_complex()):
                raise RuntimeError(
                    f"{caller}: {self.path(i)} has dtype {t.dtype}; only floating-point and "
                    "complex tensors can be differentiated (pass integer tensors in another "
                    "argument)"
                )


def _flatten(tree: Any) -> tuple[list[Any], Callable[[Sequence[Any]], Any]]:
    """``(leaves, rebuild)``; a plain dict of tensors is taken as it is, without optree."""
    values = tensor_values(tree)
    if values is not None:
        keys = list(tree)
        return values, lambda new: dict(zip(keys, new))
    leaves, spec = optree.tree_flatten(tree)
    return leaves, functools.partial(optree.tree_unflatten, spec)


def _path(rebuild: Callable[[Sequence[Any]], Any], leaves: list[Any], i: int) -> str:
    """The path of leaf ``i`` of a differentiated tree, for an error message."""
    marker = object()
    tree = rebuild([marker if j == i else None for j in range(len(leaves))])
    paths, found, _ = optree.tree_flatten_with_path(tree, none_is_leaf=True)
    for path, leaf in zip(paths, found):
        if leaf is marker:
            return "".join(f"[{k!r}]" for k in path) or "the root"
    return f"leaf {i}"  # pragma: no cover


def fresh_leaves(
    layout: Leaves, tensors: Sequence[torch.Tensor], trees: Trees | None, caller: str
) -> tuple[Leaves, list[torch.Tensor], list[torch.Tensor]] | None:
    """``(layout, diff, fresh)`` for ``tensors``; ``None`` for inference tensors.

    A layout whose stack would hold a non-contiguous tensor falls back to one
    leaf a tensor. A leaf autograd cannot differentiate is named by its path
    (``trees``), decided by its dtype.
    """
    try:
        made = layout.make(tensors)
        if made is None:
            layout = UNSTACKED
            made = layout.make(tensors)
        assert made is not None
        return (layout, *made)
    except RuntimeError:
        if any(t.is_inference() for t in tensors):
            return None
        if trees is not None:
            trees.check_differentiable(caller)
        raise


# --- fr.grad_and_value ------------------------------------------------------------------


def differentiate(
    fn: Callable[..., Any],
    *,
    argnums: int | tuple[int, ...],
    has_aux: bool,
    caller: str,
) -> Callable[..., tuple[Any, Any]]:
    """``fr.grad_and_value``'s ``g``, its errors naming ``caller`` (``fr.distributed``'s too)."""
    if not callable(fn):
        raise TypeError(f"{caller}: fn must be callable, got {type(fn).__name__}")
    _check_argnums(argnums, caller)
    reference = torch.func.grad_and_value(fn, argnums=argnums, has_aux=has_aux)
    nums = (argnums,) if isinstance(argnums, int) else argnums

    def wrapper(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if is_compiling() or transform_level() is not None or torch.is_inference_mode_enabled():
            # Dynamo traces torch.func.grad without a break; under inference_mode autograd
            # records nothing, even with enable_grad, and torch.func still differentiates
            return reference(*args, **kwargs)
        trees = Trees(args, _chosen(args, nums, argnums, caller))
        if not all(issubclass(k, torch.Tensor) for k in set(map(type, trees.tensors))):
            trees.check_tensors(caller)
        others = [a for i, a in enumerate(args) if i not in trees.nums]
        rest: list[Any] = optree.tree_leaves((others, kwargs))  # type: ignore[arg-type]
        if any(map(_REQUIRES_GRAD, trees.tensors)) or any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in rest
        ):
            if any(t.is_inference() for t in trees.tensors):
                return reference(*args, **kwargs)
            grads, value = _through_graph(fn, args, kwargs, trees, has_aux, caller)
        else:
            out = _fresh(fn, args, kwargs, trees, has_aux, caller)
            if out is None:  # made under inference_mode: torch.func copes
                return reference(*args, **kwargs)
            grads, value = out
        result = grads[0] if isinstance(argnums, int) else tuple(grads)
        return result, value

    wrapper.__doc__ = getattr(fn, "__doc__", None)
    wrapper.__name__ = f"grad_and_value({getattr(fn, '__name__', 'fn')})"
    return wrapper


def _check_argnums(argnums: Any, caller: str) -> None:
    if not (
        (isinstance(argnums, int) and not isinstance(argnums, bool))
        or (
            isinstance(argnums, tuple)
            and argnums
            and all(isinstance(n, int) and not isinstance(n, bool) for n in argnums)
        )
    ):
        raise TypeError(
            f"{caller}: argnums must be an int or a non-empty tuple of ints, got {argnums!r}"
        )
    if isinstance(argnums, tuple) and len(set(argnums)) != len(argnums):
        raise RuntimeError(f"{caller}: argnums elements must be unique, got {argnums!r}")


def _chosen(args: Sequence[Any], nums: Sequence[int], argnums: Any, caller: str) -> list[int]:
    """The differentiated positions, non-negative; ``RuntimeError`` when out of range or twice."""
    for n in nums:
        if not -len(args) <= n < len(args):
            raise RuntimeError(
                f"{caller}: argnums={argnums!r} is out of range for "
                f"{len(args)} positional argument(s)"
            )
    chosen = [n % len(args) for n in nums]
    if len(set(chosen)) != len(chosen):
        raise RuntimeError(
            f"{caller}: argnums={argnums!r} names one argument twice "
            f"for {len(args)} positional argument(s)"
        )
    return chosen


def _fresh(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    trees: Trees,
    has_aux: bool,
    caller: str,
) -> tuple[list[Any], Any] | None:
    """The fast path: one autograd pass over fresh leaves; ``None`` for inference tensors.

    Only a layout that stacks tensors can meet a sparse gradient in a stack,
    so only then is the random state kept for a second run (``retrying``).
    """
    tensors = trees.tensors

    def attempt(layout: Leaves) -> tuple[list[Any], Any] | None:
        made = fresh_leaves(layout, tensors, trees, caller)
        if made is None:
            return None
        layout, diff, fresh = made

        def run() -> tuple[list[Any], Any]:
            value, aux = split_output(fn(*trees.args_with(args, fresh), **kwargs), has_aux, caller)
            grads, _ = gradients_of(value, diff, caller)
            return trees.rebuild(layout.split(grads)), detached(value, aux, has_aux)

        if torch.is_grad_enabled():  # for speed: enable_grad only if off (docs/benchmarks.md)
            return run()
        with torch.enable_grad():
            return run()

    layout = leaves_for(tensors)
    if layout is UNSTACKED:
        return attempt(layout)
    # the retry follows unstack(tensors): their layout is UNSTACKED from then on
    layouts = iter([layout])
    return retrying(lambda: attempt(next(layouts, UNSTACKED)), Rewind(tensors), tensors)


def _through_graph(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    trees: Trees,
    has_aux: bool,
    caller: str,
) -> tuple[list[Any], Any]:
    """Gradients that stay differentiable through the graph some input already carries.

    What ``torch.func.grad_and_value`` returns there, computed by autograd
    with ``create_graph=True`` over stand-ins of the differentiated leaves
    (views of those already in a graph, fresh leaves for the others): unlike
    torch.func, this composes with saved-tensor hooks (non-reentrant
    activation checkpointing). A reentrant checkpoint in the call's graph
    (which torch.func refuses) takes a full backward pass instead, over fresh
    leaves for every argument that requires grad, as DDP's ``loss.backward()``
    differentiates: the parameters' gradients come back, but not
    differentiable through the outer graph.

    Which of the two a call needs shows only in its graph, after ``fn`` has
    run: the first guess is what the function's last call needed (``_CUT``,
    a guess only), and a wrong guess runs ``fn`` again from the same random
    state.
    """
    trees.check_differentiable(caller)
    _warn_carried(trees.tensors, caller)
    rewind = Rewind(trees.tensors)
    code = _code(fn)
    if code in _CUT:
        cut = _cut_outer_graph(fn, args, kwargs, trees, has_aux, caller, required=False)
        if cut is not None:
            return cut
        del _CUT[code]
        rewind.restore()
    kept = _keep_outer_graph(fn, args, kwargs, trees, has_aux, caller)
    if kept is not None:
        return kept
    if len(_CUT) >= _CUT_SIZE:
        _CUT.clear()
    _CUT[code] = None
    rewind.restore()
    cut = _cut_outer_graph(fn, args, kwargs, trees, has_aux, caller, required=True)
    assert cut is not None
    return cut


# Functions (by code) whose last call through an outer graph met a reentrant checkpoint: their
# next call tries the full backward first. A guess: every call checks it on its own graph.
_CUT: dict[Any, None] = {}
_CUT_SIZE = 256
_caches.register(_CUT.clear)


def _code(fn: Callable[..., Any]) -> Any:
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "func", None), "__code__", None)
    return code if code is not None else id(fn)


def _warn_carried(tensors: Sequence[torch.Tensor], caller: str) -> None:
    carried = [t for t in tensors if t.grad_fn is not None]
    if carried:
        warnings.warn(
            f"{caller}: a differentiated tensor carries an autograd graph "
            f"(grad_fn={type(carried[0].grad_fn).__name__}); gradients are taken through it, "
            "and if parameters are updated with autograd on, that graph grows with every "
            "step. Update them under torch.no_grad() (or detach them) unless you mean to "
            "differentiate through the steps.",
            stacklevel=4,
        )


def _keep_outer_graph(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    trees: Trees,
    has_aux: bool,
    caller: str,
) -> tuple[list[Any], Any] | None:
    """torch.func's answer (``create_graph=True``); ``None`` if the graph holds a reentrant checkpoint."""
    tensors = trees.tensors
    with torch.enable_grad():
        fresh = [t.view_as(t) if t.requires_grad else t.detach().requires_grad_() for t in tensors]
        value, aux = split_output(fn(*trees.args_with(args, fresh), **kwargs), has_aux, caller)
        if not (value.requires_grad and fresh):
            grads: Sequence[torch.Tensor] = [torch.zeros_like(t) for t in fresh]
        elif holds_reentrant_checkpoint(value):
            return None
        else:
            grads = torch.autograd.grad(
                value, fresh, create_graph=True, allow_unused=True, materialize_grads=True
            )
    return trees.rebuild(grads), ((value, aux) if has_aux else value)


def _cut_outer_graph(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    trees: Trees,
    has_aux: bool,
    caller: str,
    *,
    required: bool,
) -> tuple[list[Any], Any] | None:
    """A reentrant checkpoint below an outer graph: a full backward over fresh leaves only.

    Every tensor argument that requires grad is replaced by a fresh leaf of
    its values, so the backward pass stops there and writes nothing of the
    caller's. ``None`` when this call's graph holds no reentrant checkpoint
    after all (unless ``required``): the caller keeps the outer graph then.
    """

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.requires_grad:
            return x.detach().requires_grad_()
        return x

    cut_args = tuple(optree.tree_map(leaf, a) for a in args)
    cut_kwargs: dict[str, Any] = optree.tree_map(leaf, kwargs)  # type: ignore[arg-type, assignment]
    every: list[Any] = optree.tree_leaves((cut_args, cut_kwargs))  # type: ignore[arg-type]
    inputs = [t for t in every if isinstance(t, torch.Tensor)]
    with torch.enable_grad():
        fresh = [t.detach().requires_grad_() for t in trees.tensors]
        new_args = trees.args_with(cut_args, fresh)
        value, aux = split_output(fn(*new_args, **cut_kwargs), has_aux, caller)
        ours = fresh + [t for t in inputs if t.requires_grad]
        full = needs_full_backward(value, ours, caller)
        if not (full or required):
            return None
        grads = gradients(value, fresh, full=full)
        for t in inputs:
            t.grad = None  # the stand-ins' own: nothing of the caller's is written
    return trees.rebuild(grads), detached(value, aux, has_aux)
