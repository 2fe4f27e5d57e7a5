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
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
import torch.func
from torch.overrides import has_torch_function

from ._leaves import UNSTACKED, leaves_for
from ._torch import engine_grad, transform_level
from ._tree import tensor_values

__all__ = ["grad_and_value"]

_REQUIRES_GRAD = operator.attrgetter("requires_grad")


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
        if transform_level() is not None or torch.is_inference_mode_enabled():
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
    if value.is_complex() or has_torch_function((value, *leaves)):
        return torch.autograd.grad(value, leaves, allow_unused=True, materialize_grads=True)
    grads = engine_grad(value, leaves)
    return tuple(g if g is not None else torch.zeros_like(t) for g, t in zip(grads, leaves))


def detached(value: torch.Tensor, aux: Any, has_aux: bool) -> Any:
    """What torch.func returns beside the gradients: ``value``, or ``(value, aux)``, unwrapped."""
    if not has_aux:
        return value.detach()
    return value.detach(), optree.tree_map(
        lambda x: x.detach() if isinstance(x, torch.Tensor) else x, aux
    )
