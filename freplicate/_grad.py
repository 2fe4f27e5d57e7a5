"""``fr.grad_and_value``: the results of ``torch.func.grad_and_value``, at autograd's price.

The public face of ``_autodiff``, which ``fr.distributed`` shares.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._autodiff import differentiate

__all__ = ["grad_and_value"]


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
    modes. A ``use_reentrant=True`` checkpoint takes one full ``.backward()``
    over the fresh leaves, which that mode requires; the first call that
    meets one runs ``fn`` a second time (from the same random state), later
    calls of the same function look for it first. When an argument already
    carries an autograd graph, the gradients are taken with
    ``create_graph=True`` so that they stay differentiable through it, as
    torch.func's are, except below a reentrant checkpoint (which torch.func
    refuses): there the parameters' gradients come back, as DDP's
    ``loss.backward()`` gives them, not differentiable through the outer
    graph. Under ``torch.compile``, a transform, or inference mode, this is
    ``torch.func.grad_and_value`` itself.

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
