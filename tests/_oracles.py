"""Stateful references for the data-parallel tests, written without freplicate.

``stateful_data_parallel`` is what ``nn.DataParallel`` does, on any devices
(CPU repeats included): cut the inputs and kwargs as ``nn.parallel.scatter``
does (its recursion, with ``torch.chunk``), run a ``copy.deepcopy`` of the
module per shard through plain autograd, gather the outputs as
``nn.parallel.gather`` does, backpropagate a loss, and sum every parameter's
gradient over the copies (``Broadcast``'s backward). ``nn.DataParallel``
itself cannot be the oracle on CPU: without CUDA it runs the module once,
unreplicated.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def reference_scatter(obj: Any, n: int, dim: int = 0) -> list[Any]:
    """``nn.parallel.scatter``'s recursion, with ``torch.chunk`` for its ``Scatter``."""
    if isinstance(obj, torch.Tensor):
        return list(torch.chunk(obj, n, dim))
    if _is_namedtuple(obj):
        return [type(obj)(*args) for args in zip(*(reference_scatter(x, n, dim) for x in obj))]
    if isinstance(obj, tuple) and obj:
        return list(zip(*(reference_scatter(x, n, dim) for x in obj)))
    if isinstance(obj, list) and obj:
        return [list(x) for x in zip(*(reference_scatter(x, n, dim) for x in obj))]
    if isinstance(obj, dict) and obj:
        return [
            type(obj)(kv) for kv in zip(*(reference_scatter(item, n, dim) for item in obj.items()))
        ]
    return [obj for _ in range(n)]


def reference_gather(outputs: list[Any], dim: int = 0) -> Any:
    """``nn.parallel.gather``'s recursion, with ``torch.cat`` (0-dim stacked) for ``Gather``.

    Plain non-tensor leaves follow freplicate's contract, where DataParallel fails.
    """
    out = outputs[0]
    if isinstance(out, torch.Tensor):
        if all(t.dim() == 0 for t in outputs):
            return torch.cat([t.unsqueeze(0) for t in outputs], 0)
        return torch.cat(outputs, dim)
    if out is None:
        return None
    if isinstance(out, (str, int, float, bool)):
        # nn.parallel.gather breaks here (a str becomes a map object, numbers
        # raise); the contract is: equal values once, unequal as a tuple
        return out if all(o == out for o in outputs) else tuple(outputs)
    if isinstance(out, dict):
        return type(out)((k, reference_gather([d[k] for d in outputs], dim)) for k in out)
    if _is_namedtuple(out):
        return type(out)._make(reference_gather(list(x), dim) for x in zip(*outputs))
    return type(out)(reference_gather(list(x), dim) for x in zip(*outputs))


def stateful_data_parallel(
    module: nn.Module,
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any],
    n: int,
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    dim: int = 0,
) -> tuple[Any, dict[str, torch.Tensor], dict[str, torch.Tensor], list[nn.Module]]:
    """``(output, grads, buffers, copies)`` of one DataParallel step over ``n`` replicas.

    ``grads`` maps each parameter name of ``module`` to the sum of its copies'
    gradients of ``loss_fn(output)``; ``buffers`` are replica 0's after the
    forward. ``module`` itself is not touched.
    """
    ins = reference_scatter(inputs, n, dim) if inputs else []
    kws = reference_scatter(kwargs, n, dim) if kwargs else []
    count = max(len(ins), len(kws)) if (ins or kws) else 1
    ins = ins or [() for _ in range(count)]
    kws = kws or [{} for _ in range(count)]
    copies = [copy.deepcopy(module) for _ in range(min(len(ins), len(kws)))]
    for c in copies:
        c.zero_grad(set_to_none=True)
    outs = [c(*i, **k) for c, i, k in zip(copies, ins, kws)]
    # DataParallel on one device calls the module directly: nothing is gathered
    output = outs[0] if n == 1 else reference_gather(outs, dim)
    loss_fn(output).backward()
    grads: dict[str, torch.Tensor] = {}
    for name, _ in module.named_parameters():
        per_copy = [c.get_parameter(name).grad for c in copies]
        grads[name] = sum(  # type: ignore[assignment]
            (g if g is not None else torch.zeros_like(c.get_parameter(name)))
            for g, c in zip(per_copy, copies)
        )
    buffers = {k: v.detach() for k, v in copies[0].named_buffers()}
    return output, grads, buffers, copies


def stateful_replica_grads(
    module: nn.Module,
    batch: tuple[Any, ...],
    n: int,
    loss_fn: Callable[..., torch.Tensor],
    *,
    op: str = "mean",
) -> tuple[dict[str, torch.Tensor], torch.Tensor, list[nn.Module]]:
    """``(grads, loss, copies)`` of DDP's gradient step over ``n`` replicas in one process.

    The batch is cut as ``nn.parallel.scatter`` cuts it; a ``copy.deepcopy``
    of ``module`` per shard runs ``loss_fn(copy, *shard)`` and its own
    ``backward()``, one after another in order (so each draws its random
    numbers after the previous one, from the caller's generator). ``grads``
    holds, for every parameter that requires grad, the mean (``op="mean"``,
    DDP's) or the sum of its copies' gradients; frozen parameters have none.
    ``loss`` is the mean of the copies' losses; ``copies`` hold their buffers.
    """
    shards = reference_scatter(batch, n)
    copies = [copy.deepcopy(module) for _ in shards]
    losses = []
    for c, shard in zip(copies, shards):
        c.zero_grad(set_to_none=True)
        loss = loss_fn(c, *shard)
        loss.backward()
        losses.append(loss.detach())
    grads: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        per_copy = [
            c.get_parameter(name).grad
            if c.get_parameter(name).grad is not None
            else torch.zeros_like(p)
            for c in copies
        ]
        total = torch.stack(per_copy).sum(0)
        grads[name] = total / len(copies) if op == "mean" else total
    return grads, torch.stack(losses).mean(), copies
