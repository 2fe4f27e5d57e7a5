"""The rank side of the distributed properties, run on ``fr.testing.RankPool``'s ranks.

``test_distributed.py`` takes the session's pool and sends each drawn
example to it: ``ranks.run(on_rank, check, payload)`` runs ``check(rank,
payload)`` on every rank, where it compares ``fr.distributed`` with
``DistributedDataParallel`` (or with the reduction computed from every
rank's known inputs); an ``AssertionError`` reports a difference, and the
pool raises it in the test naming the rank. ``RankPool`` here is the same
pool sent checks by name (``CHECKS``), as ``test_shard.py`` sends them.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.distributed as dist
from _property_support import Unchanged, dense, refill, trainable
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import freplicate as fr
from freplicate._distributed import _agree
from freplicate._distributed._agree import DEBUG_VARIABLE
from freplicate.testing import assert_trees_close

WORLD = 2


def on_rank(check: Callable[[int, Any], Any], payload: Any) -> Any:
    """``check(rank, payload)`` on this rank: what ``RankPool.run`` sends every rank."""
    return check(dist.get_rank(), payload)


class RankPool:
    """A ``fr.testing.RankPool`` of ``WORLD`` ranks, sent checks by name: ``CHECKS[name]``.

    ``run`` answers every rank's ``("ok", value)``; a check that fails on a
    rank raises, naming the rank, as the public pool does.
    """

    def __init__(self, pool: fr.testing.RankPool) -> None:
        assert pool.world_size == WORLD, pool.world_size
        self.pool = pool  # the session's (``rank_pool``): its owner closes it

    def run(self, check: str, payload: Any) -> list[tuple[str, Any]]:
        return [("ok", value) for value in self.pool.run(on_rank, CHECKS[check], payload)]


# --- the checks each rank runs; an AssertionError reports a difference


def in_mode(fn: Callable[..., Any], mode: str, *, fullgraph: bool = True) -> Callable[..., Any]:
    """``fn`` itself (``"eager"``), or compiled whole (``"compiled"``: one graph, no break).

    Dynamo's caches are emptied first: a new example must trace anew, not
    fall back to eager code once the recompile limit is reached. An error
    raised while tracing comes out as itself only without ``fullgraph``
    (with it, Dynamo reports it as its own error, the message inside).
    """
    if mode == "eager":
        return fn
    torch._dynamo.reset()
    return torch.compile(fn, backend="eager", fullgraph=fullgraph)


def _loss(out: Any) -> torch.Tensor:
    """A scalar that weighs every element of every floating-point leaf differently.

    Traceable (no generator of its own): the compiled properties trace it.
    """
    total = torch.zeros((), dtype=torch.float64)
    for i, leaf in enumerate(optree.tree_leaves(out)):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            weights = torch.sin(torch.arange(leaf.numel(), dtype=torch.float64) * 1.7 + i)
            total = total + (leaf * weights.reshape(leaf.shape).to(leaf.dtype)).sum()
    return total


def _bf16_compress_hook(state, bucket):  # type: ignore[no-untyped-def]
    # DDP's bf16_compress_hook refuses gloo (it asks for NCCL); its body is this call. No
    # annotations: DDP checks them, and this file's are strings (from __future__ import).
    return default_hooks._compress_hook(torch.bfloat16, state, bucket)


# DDP's compression hooks: what fr.distributed's compress= reproduces
_HOOKS = {"fp16": default_hooks.fp16_compress_hook, "bf16": _bf16_compress_hook}


def _call(module: torch.nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return module(**inputs)
    return module(*inputs) if isinstance(inputs, tuple) else module(inputs)


def _ddp_reference(
    module: torch.nn.Module, inputs: Any, *, compress: str | None = None, **ddp_options: Any
) -> tuple[torch.nn.Module, torch.Tensor, dict[str, torch.Tensor]]:
    """DDP's step on a copy of ``module``: the copy, the loss, and the reduced gradients.

    DDP reduces the parameters that require grad; the others have no gradient
    to compare. ``ddp_options`` default to ``find_unused_parameters=True``.
    """
    reference = copy.deepcopy(module)
    ddp = DistributedDataParallel(reference, **{"find_unused_parameters": True, **ddp_options})
    if compress is not None:
        ddp.register_comm_hook(None, _HOOKS[compress])
    ddp_loss = _loss(_call(ddp, inputs))
    if ddp_loss.requires_grad:  # not when every parameter that reaches it is frozen
        ddp_loss.backward()
    want = {
        name: q.grad if q.grad is not None else torch.zeros_like(q)
        for name, q in reference.named_parameters()
        if q.requires_grad
    }
    return reference, ddp_loss, want


def check_grad_and_value(rank: int, p: dict[str, Any]) -> None:
    """fr.distributed.grad_and_value (and all_reduce of local gradients) equal DDP's gradients.

    With ``compress``, DDP runs with the matching compression hook.
    """
    module, inputs, cap, compress = (
        p["module"],
        p["inputs"][rank],
        p["bucket_cap_mb"],
        p["compress"],
    )
    reference, ddp_loss, want = _ddp_reference(module, inputs, compress=compress)

    s = fr.state(module)
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else (_tuple(inputs), {})

    def loss_fn(params: dict[str, torch.Tensor]) -> torch.Tensor:
        out, _ = fr.apply(module, fr.State(params, s.buffers), *args, **kwargs)
        return _loss(out)

    def loss_and_buffers(params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
        out, new = fr.apply(module, fr.State(params, s.buffers), *args, **kwargs)
        return _loss(out), new.buffers

    unchanged = Unchanged(s, inputs)
    mode = p.get("mode", "eager")
    if p["has_aux"]:
        step = fr.distributed.grad_and_value(
            loss_and_buffers, bucket_cap_mb=cap, compress=compress, has_aux=True
        )
        grads, (value, aux) = in_mode(step, mode)(s.params)
        # aux is this rank's own: the buffers after its forward, as DDP's module holds them
        assert_trees_close(aux, dict(reference.named_buffers()))
    else:
        step = fr.distributed.grad_and_value(loss_fn, bucket_cap_mb=cap, compress=compress)
        grads, value = in_mode(step, mode)(s.params)
    local, _ = fr.grad_and_value(loss_fn)(s.params)
    reduce = in_mode(lambda g: fr.distributed.all_reduce(g, bucket_cap_mb=cap, compress=compress), mode)
    reduced = reduce(local)
    unchanged.check("fr.distributed.grad_and_value / all_reduce")
    torch.testing.assert_close(value, ddp_loss.detach())
    assert_trees_close({k: grads[k] for k in want}, want, rtol=1e-5, atol=1e-6)
    assert_trees_close({k: reduced[k] for k in want}, want, rtol=1e-5, atol=1e-6)


def check_training_module(rank: int, p: dict[str, Any]) -> None:
    """On modules real training brings, fr.distributed.grad_and_value equals DDP's gradients.

    Only the trainable parameters are differentiated (split by the module's
    own flags, the frozen ones closed over), as DDP reduces only those;
    sparse gradients (``sparse=True`` embeddings) are compared by value. DDP
    needs ``static_graph`` for a reentrant checkpoint (its reducer would see
    the block's parameters ready twice otherwise).
    """
    module, inputs = p["module"], p["inputs"][rank]
    reentrant = getattr(module, "how", "") in ("reentrant", "wrapper_reentrant")
    _, ddp_loss, want = _ddp_reference(
        module, inputs, find_unused_parameters=not reentrant, static_graph=reentrant
    )

    s = fr.state(module)
    train = trainable(module, s.params)
    frozen = {k: v for k, v in s.params.items() if k not in train}
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else (_tuple(inputs), {})

    def loss_fn(train: dict[str, torch.Tensor]) -> torch.Tensor:
        out, _ = fr.apply(module, fr.State({**frozen, **train}, s.buffers), *args, **kwargs)
        return _loss(out)

    unchanged = Unchanged(s, inputs)
    mode = p.get("mode", "eager")
    grads, value = in_mode(fr.distributed.grad_and_value(loss_fn), mode)(train)
    local, _ = fr.grad_and_value(loss_fn)(train)
    reduced = in_mode(fr.distributed.all_reduce, mode)(local)
    unchanged.check("fr.distributed.grad_and_value / all_reduce")
    torch.testing.assert_close(value, ddp_loss.detach())
    assert set(grads) == set(want), "gradients for other parameters than DDP reduces"
    assert_trees_close(dense(grads), dense(want), rtol=1e-5, atol=1e-6)
    assert_trees_close(dense(reduced), dense(want), rtol=1e-5, atol=1e-6)


def check_large_half_mean(rank: int, p: dict[str, Any]) -> None:
    """fr.distributed.all_reduce's mean of large float16 / bfloat16 values is finite and right."""
    everyone = p["trees"]
    out = fr.distributed.all_reduce(everyone[rank], op="mean")
    for got, *column in zip(*(optree.tree_leaves(t) for t in (out, *everyone))):
        assert torch.isfinite(got).all(), f"a mean of finite {got.dtype} values overflowed"
        values = torch.stack([c.double() for c in column])
        eps = torch.finfo(got.dtype).eps
        atol = WORLD * eps * float(values.abs().max()) if values.numel() else 0.0
        torch.testing.assert_close(got, values.mean(0).to(got.dtype), rtol=2 * eps, atol=atol)


def _tuple(x: Any) -> tuple[Any, ...]:
    return x if isinstance(x, tuple) else (x,)


def check_all_reduce(rank: int, p: dict[str, Any]) -> None:
    """fr.distributed.all_reduce equals the leaf-wise sum / mean of every rank's tree."""
    everyone = [refill(p["tree"], p["seed"] + r) for r in range(WORLD)]
    mine = everyone[rank]
    unchanged = Unchanged(mine)
    mode = p.get("mode", "eager")
    reduce = in_mode(
        lambda t: fr.distributed.all_reduce(
            t, op=p["op"], bucket_cap_mb=p["bucket_cap_mb"], compress=p["compress"]
        ),
        mode,
    )
    out = reduce(mine)
    unchanged.check("fr.distributed.all_reduce")
    inputs = {id(t) for t in optree.tree_leaves(mine) if isinstance(t, torch.Tensor)}
    columns = zip(*(optree.tree_leaves(t) for t in everyone))
    for x, column in zip(optree.tree_leaves(out), columns):
        if not isinstance(column[rank], torch.Tensor):
            # compiled, a str or number comes back as the graph's constant: equal, maybe another
            # object (Dynamo bakes it in; a short str unpickled here is not the interned one)
            assert x is column[rank] if mode == "eager" else x == column[rank]
            continue
        assert id(x) not in inputs, "a result must never be an input tensor"
        # integer-valued leaves: sums (and halves, for the mean of two) are exact, compressed too
        total = sum(c.double() for c in column)
        expected = (total / WORLD if p["op"] == "mean" else total).to(x.dtype)
        torch.testing.assert_close(x, expected, rtol=0, atol=0)


def check_broadcast(rank: int, p: dict[str, Any]) -> None:
    """fr.distributed.broadcast gives every rank rank ``src``'s values."""
    mine = refill(p["tree"], p["seed"] + rank)
    unchanged = Unchanged(mine)
    out = in_mode(lambda t: fr.distributed.broadcast(t, src=p["src"]), p.get("mode", "eager"))(mine)
    unchanged.check("fr.distributed.broadcast")
    assert_trees_close(out, refill(p["tree"], p["seed"] + p["src"]), rtol=0, atol=0)


def check_mismatch(rank: int, p: dict[str, Any]) -> str:
    """Trees that differ across ranks raise ValueError on every rank (never hang)."""
    tree = p["trees"][rank]
    mode = p.get("mode", "eager")

    def reduce(t: Any) -> Any:
        # Compiled, each call traces anew, on a group of its own (a store of its own): a layout
        # agreed before passes a trace without waiting for the others, and a rank running a
        # compiled graph checks nothing (docs/compile.md says what a mismatch then costs).
        group = dist.new_group([0, 1]) if mode == "compiled" else None
        call = in_mode(lambda t: fr.distributed.all_reduce(t, op="sum", group=group), mode, fullgraph=False)
        return call(t)

    # A layout rank 0 reduced before is not probed again outside the checks' debug mode (its
    # check rides in its buckets), and buckets of other sizes then meet in gloo, which aborts:
    # the contract's case for the debug mode. Otherwise every layout is new to both ranks (the
    # history forgotten alike), and the default mode's probe catches the difference.
    debug = os.environ.get(DEBUG_VARIABLE)
    if p["reduced_before"]:
        os.environ[DEBUG_VARIABLE] = "DETAIL"
        reduce(p["trees"][0])
    else:
        _agree._HISTORY.clear()
    try:
        reduce(tree)
    except ValueError as err:
        return str(err)
    finally:
        if debug is None:
            os.environ.pop(DEBUG_VARIABLE, None)
        else:
            os.environ[DEBUG_VARIABLE] = debug
    raise AssertionError(f"rank {rank}: fr.distributed.all_reduce reduced mismatched trees")


# checks sent by name (``RankPool``), registered by the modules that define them
CHECKS: dict[str, Callable[[int, dict[str, Any]], Any]] = {}
