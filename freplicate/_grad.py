"""``grad_and_value``: the results of ``torch.func.grad_and_value``, at autograd's price.

``torch.func.grad`` wraps every tensor of the differentiated tree in a
``GradTrackingTensor`` and unwraps every result, a per-tensor cost that
dominates on models of hundreds of small tensors. Outside any ``torch.func``
transform the same gradients come from one ``torch.autograd.grad`` call over
fresh detached leaves (the caller's tensors are never touched; small ones of
one shape stacked into one leaf, ``_leaves``), with zeros for leaves that do
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
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
import torch.func
from torch.overrides import has_torch_function

from . import _caches
from ._leaves import UNSTACKED, Leaves, leaves_for, unstack
from ._torch import engine_grad, is_compiling, transform_level
from ._tree import tensor_values

__all__ = ["differentiate", "grad_and_value"]

_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def grad_and_value(
    fn: Callable[..., Any], *, argnums: int | tuple[int, ...] = 0, has_aux: bool = False
) -> Callable[..., tuple[Any, Any]]:
    """``g(*args) -> (grads, value)`` with exactly ``torch.func.grad_and_value``'s results.

    ``grads`` has the structure of ``args[argnums]`` (a tuple of such trees
    for a tuple ``argnums``); ``value`` is ``fn``'s scalar output (with
    ``has_aux``, ``(value, aux)``). Leaves that do not reach the output get
    zero gradients. The caller's tensors are never modified.

    Outside any ``torch.func`` transform the gradients come from one
    autograd pass over fresh leaves (much cheaper than ``torch.func`` on
    models of many small tensors); activation checkpointing works in both
    modes (``use_reentrant=True`` checkpoints take one full ``.backward()``
    over the fresh leaves, which that mode requires). When an argument
    already carries an autograd graph, the gradients are taken with
    ``create_graph=True`` so that they stay differentiable through it, as
    torch.func's are. Under ``torch.compile``, a transform, or inference
    mode, this is ``torch.func.grad_and_value`` itself.

    Args:
        fn: the function to differentiate; returns a scalar tensor (with
            ``has_aux``, a ``(scalar, aux)`` pair).
        argnums: which positional argument(s) to differentiate: an int, or a
            non-empty tuple of distinct ints.
        has_aux: whether ``fn`` returns ``(value, aux)``.

    Returns:
        ``g(*args, **kwargs) -> (grads, value)``, or ``(grads, (value, aux))``.

    Raises:
        TypeError: ``fn`` is not callable, or ``argnums`` is not an int or a
            non-empty tuple of ints.
        RuntimeError: ``argnums`` repeats an argument or is out of range for the
            call; a differentiated leaf is not a floating-point or complex tensor
            (named by its path); ``fn`` does not return a scalar tensor.

    >>> import freplicate as fr
    >>> w = {"a": torch.tensor(2.0), "b": torch.tensor(5.0)}
    >>> fr.grad_and_value(lambda w, x: w["a"] * x)(w, torch.tensor(3.0))
    ({'a': tensor(3.), 'b': tensor(0.)}, tensor(6.))
    """
    return differentiate(fn, argnums=argnums, has_aux=has_aux, caller="fr.grad_and_value")


def differentiate(
    fn: Callable[..., Any],
    *,
    argnums: int | tuple[int, ...],
    has_aux: bool,
    caller: str,
) -> Callable[..., tuple[Any, Any]]:
    """``grad_and_value``, its errors naming ``caller`` (``fr.distributed.grad_and_value`` too)."""
    if not callable(fn):
        raise TypeError(f"{caller}: fn must be callable, got {type(fn).__name__}")
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
    reference = torch.func.grad_and_value(fn, argnums=argnums, has_aux=has_aux)
    nums = (argnums,) if isinstance(argnums, int) else argnums
    first_call = [True]

    def wrapper(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if is_compiling() or transform_level() is not None or torch.is_inference_mode_enabled():
            # Dynamo traces torch.func.grad without a break; under inference_mode autograd
            # records nothing, even with enable_grad, and torch.func still differentiates
            return reference(*args, **kwargs)
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
        flat = [_flatten(args[n]) for n in nums]  # each differentiated tree once
        others = [a for i, a in enumerate(args) if i not in chosen]
        rest: list[Any] = optree.tree_leaves((others, kwargs))  # type: ignore[arg-type]
        tensors = list(itertools.chain.from_iterable(leaves for leaves, _ in flat))
        only_tensors = all(issubclass(k, torch.Tensor) for k in set(map(type, tensors)))
        if not only_tensors:
            _check_leaves(flat, nums, caller)
        if any(map(_REQUIRES_GRAD, tensors)) or any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in rest
        ):
            if any(t.is_inference() for t in tensors):
                return reference(*args, **kwargs)
            return _through_graph(fn, args, kwargs, nums, flat, tensors, argnums, has_aux, caller)
        rng = torch.get_rng_state() if first_call[0] else None
        first_call[0] = False
        layout = leaves_for(tensors)
        made = _fresh(layout, tensors, flat, nums, caller)
        if made is None:  # made under inference_mode: torch.func copes
            return reference(*args, **kwargs)
        layout, diff, fresh = made
        new_args = _with(args, nums, flat, fresh)
        with torch.enable_grad():
            value, aux = split_output(fn(*new_args, **kwargs), has_aux, caller)
            full = reentrant(fn, value, diff, caller)
            try:
                grads = layout.split(gradients(value, diff, full=full))
            except RuntimeError as err:
                sparse = layout is not UNSTACKED and "sparse" in str(err)
                if not (sparse or "use_reentrant=True" in str(err)):
                    raise
                # A stacked leaf got a sparse gradient (nn.Embedding(sparse=True)), which a
                # stack's backward refuses: never stack this layout again. Or a reentrant
                # checkpoint, which autograd differentiates only in a full .backward().
                # Either way run fn again (same random numbers where known).
                del value, aux
                if rng is not None:
                    torch.set_rng_state(rng)
                if sparse:
                    unstack(tensors)
                    layout = UNSTACKED
                else:
                    _REENTRANT[_key(fn)] = full = True
                diff, fresh = layout.make(tensors)  # type: ignore[misc]
                new_args = _with(args, nums, flat, fresh)
                value, aux = split_output(fn(*new_args, **kwargs), has_aux, caller)
                grads = layout.split(gradients(value, diff, full=full))
        trees = _rebuild(flat, grads)
        result = trees[0] if isinstance(argnums, int) else tuple(trees)
        return result, detached(value, aux, has_aux)

    wrapper.__doc__ = getattr(fn, "__doc__", None)
    wrapper.__name__ = f"grad_and_value({getattr(fn, '__name__', 'fn')})"
    return wrapper


_Flat = list[tuple[list[Any], Callable[[Sequence[Any]], Any]]]


def _check_leaves(flat: _Flat, nums: Sequence[int], caller: str) -> None:
    for n, (leaves, rebuild) in zip(nums, flat):
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                raise RuntimeError(
                    f"{caller}: expected only tensors in args[{n}], "
                    f"got a leaf of type {type(leaf).__name__} at {_path(rebuild, leaves, i)}"
                )


def _path(rebuild: Callable[[Sequence[Any]], Any], leaves: list[Any], i: int) -> str:
    """The path of leaf ``i`` of a differentiated tree, for an error message."""
    marker = object()
    tree = rebuild([marker if j == i else None for j in range(len(leaves))])
    paths, found, _ = optree.tree_flatten_with_path(tree, none_is_leaf=True)
    for path, leaf in zip(paths, found):
        if leaf is marker:
            return "".join(f"[{k!r}]" for k in path) or "the root"
    return f"leaf {i}"


def _fresh(
    layout: Leaves, tensors: list[torch.Tensor], flat: _Flat, nums: Sequence[int], caller: str
) -> tuple[Leaves, list[torch.Tensor], list[torch.Tensor]] | None:
    """``(layout, diff, fresh)``; ``None`` for inference tensors; names a non-float leaf."""
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
        start = 0
        for n, (leaves, rebuild) in zip(nums, flat):
            for i, t in enumerate(leaves):
                if not (t.is_floating_point() or t.is_complex()):
                    raise RuntimeError(
                        f"{caller}: args[{n}]{_path(rebuild, leaves, i)} has dtype "
                        f"{t.dtype}; only floating-point and complex tensors can be differentiated"
                        " (pass integer tensors in another argument)"
                    ) from None
            start += len(leaves)
        raise


def _with(args: tuple[Any, ...], nums: Sequence[int], flat: _Flat, fresh: Sequence[Any]) -> list[Any]:
    """``args`` with the differentiated trees rebuilt from ``fresh`` leaves."""
    new_args = list(args)
    start = 0
    for n, (leaves, rebuild) in zip(nums, flat):
        new_args[n] = rebuild(fresh[start : start + len(leaves)])
        start += len(leaves)
    return new_args


def _rebuild(flat: _Flat, grads: Sequence[Any]) -> list[Any]:
    trees = []
    start = 0
    for leaves, rebuild in flat:
        trees.append(rebuild(grads[start : start + len(leaves)]))
        start += len(leaves)
    return trees


def _through_graph(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    nums: Sequence[int],
    flat: _Flat,
    tensors: list[torch.Tensor],
    argnums: int | tuple[int, ...],
    has_aux: bool,
    caller: str,
) -> tuple[Any, Any]:
    """Gradients that stay differentiable through the graph some input already carries.

    What ``torch.func.grad_and_value`` returns there, computed by autograd
    with ``create_graph=True`` over stand-ins of the differentiated leaves
    (views of those already in a graph, fresh leaves for the others): unlike
    torch.func, this composes with saved-tensor hooks (non-reentrant
    activation checkpointing).
    """
    carried = [t for t in tensors if t.grad_fn is not None]
    if carried:
        warnings.warn(
            f"{caller}: a differentiated tensor carries an autograd graph "
            f"(grad_fn={type(carried[0].grad_fn).__name__}); gradients are taken through it, "
            "and if parameters are updated with autograd on, that graph grows with every "
            "step. Update them under torch.no_grad() (or detach them) unless you mean to "
            "differentiate through the steps.",
            stacklevel=3,
        )
    with torch.enable_grad():
        fresh = [t.view_as(t) if t.requires_grad else t.detach().requires_grad_() for t in tensors]
        new_args = _with(args, nums, flat, fresh)
        value, aux = split_output(fn(*new_args, **kwargs), has_aux, caller)
        if value.requires_grad and reentrant(fn, value, fresh, caller):
            raise RuntimeError(
                f"{caller}: fn uses torch.utils.checkpoint with use_reentrant=True, and an "
                "argument carries an autograd graph: autograd cannot keep gradients through "
                "reentrant checkpoints differentiable. Use use_reentrant=False."
            )
        if value.requires_grad and fresh:
            grads = torch.autograd.grad(
                value, fresh, create_graph=True, allow_unused=True, materialize_grads=True
            )
        else:
            grads = tuple(torch.zeros_like(t) for t in fresh)
    trees = _rebuild(flat, grads)
    result = trees[0] if isinstance(argnums, int) else tuple(trees)
    return result, ((value, aux) if has_aux else value)


def _flatten(tree: Any) -> tuple[list[Any], Callable[[Sequence[Any]], Any]]:
    """``(leaves, rebuild)``; a plain dict of tensors is taken as it is, without optree."""
    values = tensor_values(tree)
    if values is not None:
        keys = list(tree)
        return values, lambda new: dict(zip(keys, new))
    leaves, spec = optree.tree_flatten(tree)
    return leaves, functools.partial(optree.tree_unflatten, spec)


# The steps shared with fr.distributed.grad_and_value, which runs the same fast path.


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


def gradients(
    value: torch.Tensor, leaves: list[torch.Tensor], *, full: bool = False
) -> tuple[torch.Tensor, ...]:
    """d value / d leaves, zeros for leaves that do not reach ``value`` (as torch.func).

    ``torch.autograd.grad``'s own engine call, without the argument checks
    it makes tensor by tensor in Python (tens of microseconds a call on a
    small model): ``value`` is a real scalar and ``leaves`` this call's own
    fresh tensors. Anything else (tensor subclasses, complex values, a torch
    without that entry point) goes through ``torch.autograd.grad`` itself.
    With ``full``, one ``.backward()`` accumulates into the leaves' ``.grad``
    (what a reentrant activation checkpoint requires; the leaves are the
    caller's own fresh tensors, so nothing else of the caller's is written
    unless ``fn`` closed over tensors that require grad: ``reentrant``
    refuses those).
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
    return tuple(g if g is not None else torch.zeros_like(t) for g, t in zip(grads, leaves))


# Whether a function's graphs hold a reentrant activation checkpoint, by its code: a
# ``fr.grad_and_value(loss)`` made anew each step looks once, not every step.
_REENTRANT: dict[Any, bool] = {}
_REENTRANT_SIZE = 256
_caches.register(_REENTRANT.clear)


def _key(fn: Callable[..., Any]) -> Any:
    # a hint only: a wrong answer costs speed (the engine refuses, and fn runs again), not results
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "func", None), "__code__", None)
    return code if code is not None else id(fn)


def reentrant(fn: Callable[..., Any], value: torch.Tensor, leaves: Sequence[torch.Tensor], caller: str) -> bool:
    """Whether ``value``'s graph holds a reentrant checkpoint (``use_reentrant=True``).

    autograd differentiates those only in a full ``.backward()`` (``.grad()``
    with inputs raises in them, or skips them where no input lies below):
    found by one walk of the graph the first time a function's code is seen.
    A full backward writes ``.grad`` of every leaf that requires grad: refused
    when the graph holds one that is not among ``leaves``.
    """
    key = _key(fn)
    known = _REENTRANT.get(key)
    if known is not None:
        return known
    found, others = _walk(value, leaves)
    if len(_REENTRANT) >= _REENTRANT_SIZE:
        _REENTRANT.clear()
    _REENTRANT[key] = found
    if found and others:
        raise RuntimeError(
            f"{caller}: fn uses torch.utils.checkpoint with use_reentrant=True, which autograd "
            "differentiates only with a full .backward(); that would also write the .grad of "
            f"{others} tensor(s) that fn uses and that require grad outside the differentiated "
            "arguments. Use use_reentrant=False (PyTorch's recommendation), or detach them."
        )
    return found


def _walk(value: torch.Tensor, leaves: Sequence[torch.Tensor]) -> tuple[bool, int]:
    """``(a reentrant checkpoint found, leaves of the graph other than ``leaves``)``."""
    from torch.utils.checkpoint import CheckpointFunction

    ours = {id(t) for t in leaves}
    found, others = False, 0
    seen: set[int] = set()
    stack = [value.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        cls = getattr(node, "_forward_cls", None)
        if cls is not None and issubclass(cls, CheckpointFunction):
            found = True
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor) and id(variable) not in ours:
            others += 1
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return found, others


def detached(value: torch.Tensor, aux: Any, has_aux: bool) -> Any:
    """What torch.func returns beside the gradients: ``value``, or ``(value, aux)``, unwrapped."""
    if not has_aux:
        return value.detach()
    return value.detach(), optree.tree_map(
        lambda x: x.detach() if isinstance(x, torch.Tensor) else x, aux
    )
