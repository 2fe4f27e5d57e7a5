"""``grad_and_value``: the results of ``torch.func.grad_and_value``, at autograd's price.

``torch.func.grad`` wraps every tensor of the differentiated tree in a
``GradTrackingTensor`` and unwraps every result, a per-tensor cost that
dominates on models of hundreds of small tensors. Outside any ``torch.func``
transform the same gradients come from one ``torch.autograd.grad`` call over
fresh detached leaves (the caller's tensors are never touched), with zeros
for leaves that do not reach the output. Under a transform (``vmap``,
``grad``, ``jvp`` ...), under ``torch.inference_mode`` (where autograd records
nothing), for inference tensors, or when some input already carries an
autograd graph, it defers to ``torch.func.grad_and_value`` itself, so it
composes exactly as that does.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.func
from torch._C._functorch import maybe_current_level

__all__ = ["grad_and_value"]


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
        flat = [optree.tree_flatten(args[n]) for n in nums]  # each differentiated tree once
        chosen = {n % len(args) for n in nums}
        others = [a for i, a in enumerate(args) if i not in chosen]
        rest: list[Any] = optree.tree_leaves((others, kwargs))  # type: ignore[arg-type]
        if any(
            isinstance(t, torch.Tensor) and t.requires_grad
            for t in itertools.chain(rest, *(leaves for leaves, _ in flat))
        ):
            # an outer autograd graph: torch.func keeps it, so let it answer
            return reference(*args, **kwargs)
        new_args = list(args)
        diff_leaves: list[torch.Tensor] = []
        specs = []
        for n, (leaves, spec) in zip(nums, flat):
            fresh = []
            for leaf in leaves:
                if not isinstance(leaf, torch.Tensor):
                    raise RuntimeError(
                        f"fr.grad_and_value: expected only tensors in args[{n}], "
                        f"got a leaf of type {type(leaf).__name__}"
                    )
                try:
                    fresh.append(leaf.detach().requires_grad_(True))
                except RuntimeError:
                    if leaf.is_inference():  # made under inference_mode: torch.func copes
                        return reference(*args, **kwargs)
                    raise
            diff_leaves.extend(fresh)
            specs.append((spec, len(fresh)))
            new_args[n] = optree.tree_unflatten(spec, fresh)
        with torch.enable_grad():
            value, aux = split_output(fn(*new_args, **kwargs), has_aux, "fr.grad_and_value")
            grads = gradients(value, diff_leaves)
        trees = []
        start = 0
        for spec, count in specs:
            trees.append(optree.tree_unflatten(spec, list(grads[start : start + count])))
            start += count
        result = trees[0] if isinstance(argnums, int) else tuple(trees)
        return result, detached(value, aux, has_aux)

    wrapper.__doc__ = getattr(fn, "__doc__", None)
    wrapper.__name__ = f"grad_and_value({getattr(fn, '__name__', 'fn')})"
    return wrapper


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
    """d value / d leaves, zeros for leaves that do not reach ``value`` (as torch.func)."""
    if value.requires_grad and leaves:
        return torch.autograd.grad(value, leaves, allow_unused=True, materialize_grads=True)
    return tuple(torch.zeros_like(t) for t in leaves)


def detached(value: torch.Tensor, aux: Any, has_aux: bool) -> Any:
    """What torch.func returns beside the gradients: ``value``, or ``(value, aux)``, unwrapped."""
    if not has_aux:
        return value.detach()
    return value.detach(), optree.tree_map(
        lambda x: x.detach() if isinstance(x, torch.Tensor) else x, aux
    )
