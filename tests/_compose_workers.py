"""Rank-side code of tests/test_compose.py: fr.distributed under torch.func and autograd.

The scenarios register with ``_dist_workers`` and run through its spawner
(loopback only, a file store, bounded timeouts, stragglers killed) on 2
ranks, and a few on 3; ``main`` is the ranks' entry point. Two oracles:

* the single-process simulation of every rank (``_property_compose``: the
  global function of all ranks' inputs, differentiated by ``torch.func`` in
  one process with JAX's convention), for every collective and every way to
  call a ``Step`` under every transform (``matrix``);
* the single-process computation on the ranks' batches put together, and
  ``DistributedDataParallel`` where it can run the case, for the four uses
  the contract promises: an ensemble trained under ``vmap``, DP-SGD,
  second-order MAML, and Hessian-vector products.

Each scenario returns what it computed beside what the oracle computed (or
``"ok"`` / the failure's text, for the matrix's many cells): the test compares.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist_workers import _main, in_debug_mode, scenario, snapshot, spawn, unchanged
from _property_compose import (
    REAL,
    TRANSFORMS,
    Stage,
    Staged,
    inputs_of,
    oracle,
    scalar,
    tensor_map,
    tolerance,
    transformed,
)
from _shard_workers import outcome
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import freplicate as fr
from freplicate.testing import assert_trees_close


def main(*args: Any) -> None:
    _main(*args)


def run(names: list[str], *, world: int = 2, **kwargs: Any) -> dict[str, list[Any]]:
    return spawn(names, target=main, world=world, **kwargs)


# --- every collective and every step, under every transform --------------------------------

#: a tree of two dtypes, a 0-dim leaf and rows that 2 and 3 ranks do not divide evenly
TREE = {"w": torch.zeros(3, 2), "v": [torch.zeros(()), torch.zeros(5, dtype=torch.float64)]}
#: ``weight=`` on a 0-dim leaf under the rules has a bug of its own (``weighted_zero_dim``)
ROWED = {"w": torch.zeros(3, 2), "v": torch.zeros(5, dtype=torch.float64)}

SCALE = Stage("scale")  # rank-dependent values first: every rank's inputs differ
PROGRAMS: dict[str, tuple[list[Stage], Any]] = {
    "all_reduce_sum": ([SCALE, Stage("all_reduce", op="sum"), Stage("sin")], TREE),
    "all_reduce_mean": ([SCALE, Stage("all_reduce", op="mean"), Stage("sin")], TREE),
    "broadcast": ([SCALE, Stage("broadcast", src=1), Stage("sin")], TREE),
    "reduce_scatter_sum": ([SCALE, Stage("reduce_scatter", op="sum")], TREE),
    "reduce_scatter_mean": ([SCALE, Stage("reduce_scatter", op="mean")], TREE),
    "all_gather": ([SCALE, Stage("shard")], TREE),
    "step": ([SCALE, Stage("step")], TREE),
    "step_sum": ([SCALE, Stage("step", op="sum")], TREE),
    "step_shard": ([SCALE, Stage("step", shard=True)], TREE),
    "step_weight": ([SCALE, Stage("step", weighted=True)], ROWED),
    "step_weight_shard": ([SCALE, Stage("step", weighted=True, shard=True)], ROWED),
    "accumulate": ([SCALE, Stage("step", method="accumulate")], TREE),
    "accumulate_shard": ([SCALE, Stage("step", method="accumulate", shard=True)], TREE),
    "skip": ([SCALE, Stage("step", method="skip")], TREE),
    "skip_shard": ([SCALE, Stage("step", method="skip", shard=True)], TREE),
    "buckets": (
        [SCALE, Stage("all_reduce", op="sum", cap=1e-6), Stage("step", shard=True, cap=1e-6)],
        TREE,
    ),
    "compressed": ([SCALE, Stage("reduce_scatter", op="mean", compress="bf16")], TREE),
    "chain": (
        [
            SCALE,
            Stage("all_reduce", op="mean"),
            Stage("step", shard=True),
            Stage("broadcast", src=0),
            Stage("reduce_scatter", op="sum"),
        ],
        TREE,
    ),
}

#: cells with a bug of their own, each reproduced in a test marked xfail (see test_compose.py):
#: skip's zeros carry no graph and no tangent, so the skipping rank runs no transpose or tangent
#: collective; accumulate under vmap meets foreach ops, which have no batching rule
SKIP_RULED = {t for t in TRANSFORMS if t not in ("none", "vmap")}
BROKEN: dict[str, set[str]] = {
    "skip": SKIP_RULED,
    "skip_shard": SKIP_RULED,
    "accumulate": {"vmap", "vmap_grad", "grad_vmap"},
    "accumulate_shard": {"vmap", "vmap_grad", "grad_vmap"},
}


def cells(world: int) -> list[tuple[str, str]]:
    """The (program, transform) pairs the matrix runs; ``world`` 3 runs a subset."""
    programs = list(PROGRAMS)
    transforms = list(TRANSFORMS)
    if world > 2:
        programs = [
            "all_reduce_mean",
            "broadcast",
            "reduce_scatter_sum",
            "all_gather",
            "step_shard",
        ]
        transforms = ["grad", "jvp", "vmap", "hessian", "autograd2"]
    return [(p, t) for p in programs for t in transforms if t not in BROKEN.get(p, ())]


def check_cell(rank: int, world: int, program: str, transform: str) -> None:
    stages, tree = PROGRAMS[program]
    staged = Staged(stages)
    xs = inputs_of(tree, world, 3 if TRANSFORMS[transform].batched else None)
    snap = snapshot(xs[rank])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a differentiated tree that carries a graph: meant here
        got = transformed(staged, transform, rank, xs[rank])
    assert unchanged(xs[rank], snap), "an input changed"
    assert_trees_close(got, oracle(staged, transform, xs)[rank], **tolerance(tree, staged))


@scenario
def matrix(rank: int) -> dict[str, str]:
    """Every (program, transform) cell: ``"ok"`` or what differed (the oracle ran here)."""
    world = dist.get_world_size()
    out = {}
    for program, transform in cells(world):
        res = outcome(lambda p=program, t=transform: check_cell(rank, world, p, t))
        out[f"{program} / {transform}"] = "ok" if res[0] == "ok" else f"{res[1]}: {res[2]}"
    return out


# --- graphs, immutability, layouts, integer leaves ------------------------------------------


def _collectives(like: torch.Tensor) -> dict[str, Callable[[Any], Any]]:
    """Each public collective, as a function of one tree (an all-gather of its shard)."""
    return {
        "all_reduce": lambda t: fr.distributed.all_reduce(t, op="sum"),
        "broadcast": lambda t: fr.distributed.broadcast(t, src=1),
        "reduce_scatter": lambda t: fr.distributed.reduce_scatter(t, op="mean"),
        "all_gather": lambda t: fr.distributed.all_gather(t, {"x": like}),
    }


def _graph(t: torch.Tensor) -> tuple[bool, bool]:
    return t.requires_grad, t.grad_fn is not None


@scenario
def graphs(rank: int) -> dict[str, Any]:
    """Results carry a graph exactly when inputs do; no input changes; layouts stay.

    Per collective: ``(requires_grad, has grad_fn)`` of the result from an
    input that requires grad, from one that does not, and under no_grad;
    whether the input's ``_version`` and values stayed; whether the result,
    the gradient reaching a ``channels_last`` input (from a ``channels_last``
    cotangent), a ``jvp``'s tangent and a ``vmap``'s entries are
    ``channels_last``; and whether the rules' values are the plain call's
    (the collectives are linear: the tangent of ``2x`` is the call on ``2x``).
    """
    cl = torch.channels_last
    g = torch.Generator().manual_seed(rank)
    full = torch.randn(4, 3, 2, 5, generator=g).to(memory_format=cl)
    out: dict[str, Any] = {}
    for name, fn in _collectives(full).items():
        x = fr.distributed.shard(full) if name == "all_gather" else full
        x = x.contiguous(memory_format=cl)
        leaf = x.clone().requires_grad_()
        snap = snapshot({"x": leaf})
        res = fn({"x": leaf})["x"]
        ct = torch.randn(res.shape, generator=g).contiguous(memory_format=cl)
        (grad,) = torch.autograd.grad(res, leaf, ct)
        plain = fn({"x": x})["x"]
        with torch.no_grad():
            quiet = fn({"x": leaf})["x"]
        _, tangent = torch.func.jvp(lambda t, fn=fn: fn({"x": t})["x"], (x,), (x * 2,))
        batched = torch.func.vmap(lambda t, fn=fn: fn({"x": t})["x"])(torch.stack([x, -x]))
        expected = (plain, fn({"x": x * 2})["x"], plain, fn({"x": -x})["x"])
        out[name] = {
            "graph": _graph(res),
            "plain": _graph(plain),
            "no_grad": _graph(quiet),
            "unchanged": unchanged({"x": leaf}, snap),
            "channels_last": [
                t.is_contiguous(memory_format=cl)
                for t in (res, plain, grad, tangent, batched[0], batched[1])
            ],
            "values": (
                [res.detach(), tangent, batched[0], batched[1]],
                list(expected),
            ),
        }
    return out


@scenario
def integer_leaves(rank: int) -> dict[str, Any]:
    """Integer and bool leaves pass through a differentiated call: summed, no graph, no grad."""
    ints = torch.tensor([rank + 1, 10 * rank])
    flags = torch.tensor([rank == 0, False])

    def f(w: torch.Tensor) -> tuple[torch.Tensor, Any]:
        out = fr.distributed.all_reduce({"w": w * (rank + 1), "i": ints, "b": flags}, op="sum")
        return (out["w"] ** 2).sum(), out

    w = torch.tensor([1.0, 2.0], requires_grad=True)
    loss, tree = f(w)
    (by_autograd,) = torch.autograd.grad(loss, w)
    by_func, (_, func_tree) = torch.func.grad_and_value(f, has_aux=True)(w.detach())
    (_, primal_tree), (_, tangent_tree) = torch.func.jvp(f, (w.detach(),), (torch.ones(2),))
    step = fr.distributed.grad_and_value(lambda p: (p["w"] ** 2).sum() * (rank + 1))
    return {
        "tree": tree,
        "func_tree": func_tree,
        "jvp_tree": primal_tree,
        "tangent_tree": tangent_tree,
        "graphs": [_graph(tree[k]) for k in ("i", "b")],
        "grads": (by_autograd, by_func),
        "step": step({"w": w.detach()})[0],
    }


@scenario
def step_graphs(rank: int) -> dict[str, Any]:
    """A step's gradients carry a graph when its parameters or its batch do, and only then."""

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return (torch.sin(p["w"]) * x).sum()

    ways = {"plain": {}, "shard": {"shard": True}, "weight": {"weight": lambda p, x: 2.0}}
    out: dict[str, Any] = {}
    for name, options in ways.items():
        step = fr.distributed.grad_and_value(loss_fn, **options)
        w = torch.arange(4.0).view(2, 2) / 3
        x = torch.ones(2, 2) + rank
        tracked = w.clone().requires_grad_()
        snap = snapshot({"w": tracked, "x": x})
        out[name] = {
            "detached": _graph(step({"w": w}, x)[0]["w"]),
            "params": _graph(step({"w": tracked}, x)[0]["w"]),
            "batch": _graph(step({"w": w}, x.clone().requires_grad_())[0]["w"]),
            "accumulate": _graph(step.accumulate({"w": tracked}, [(x,), (x,)])[0]["w"]),
            "unchanged": unchanged({"w": tracked, "x": x}, snap),
        }
    return out


# --- the four uses -----------------------------------------------------------------------------


def mlp(seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def data(
    rank: int, step: int, n: int = 6, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step``: every rank can rebuild every rank's."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(n, 4, generator=g, dtype=dtype), torch.randint(0, 3, (n,), generator=g)


def everyones(step: int, world: int, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's batch of the step, put together (the single process's batch)."""
    parts = [data(r, step, **kwargs) for r in range(world)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def loss_of(module: nn.Module) -> Callable[..., torch.Tensor]:
    def loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out, _ = fr.apply(module, fr.State(params, {}), x)
        return F.cross_entropy(out, y)

    return loss


def sgd(
    params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], lr: float
) -> dict[str, torch.Tensor]:
    return {k: p - lr * grads[k] for k, p in params.items()}


def ddp_grads(
    module: nn.Module, x: torch.Tensor, y: torch.Tensor, scale: float = 1.0
) -> dict[str, torch.Tensor]:
    """DDP's reduced gradients of ``scale`` times the mean cross-entropy, on a copy of ``module``."""
    ddp = DistributedDataParallel(copy.deepcopy(module))
    (F.cross_entropy(ddp(x), y) * scale).backward()
    return {k: p.grad.clone() for k, p in ddp.module.named_parameters()}


MEMBERS, STEPS, LR = 3, 3, 0.2


@scenario
def ensemble(rank: int) -> dict[str, Any]:
    """An ensemble stacked with stack_module_state, trained under vmap(step).

    Each member against its own DDP run on the same init and batches, and
    against one process on the ranks' batches put together; ``shard=True``
    under vmap (each member's rows, an SGD step on them, all-gathered back)
    against the same.
    """
    world = dist.get_world_size()
    models = [mlp(seed) for seed in range(MEMBERS)]
    stacked, _ = torch.func.stack_module_state(models)
    stacked = {k: v.detach() for k, v in stacked.items()}
    base = copy.deepcopy(models[0]).to("meta")
    loss = loss_of(base)
    step = torch.func.vmap(fr.distributed.grad_and_value(loss), in_dims=(0, None, None))
    sharded = fr.distributed.grad_and_value(loss, shard=True)

    def zero2(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        grads, value = sharded(p, x, y)  # this member's rows of DDP's gradient
        mine = sgd(fr.distributed.shard(p), grads, LR)
        return fr.distributed.all_gather(mine, p), value

    zero2_step = torch.func.vmap(zero2, in_dims=(0, None, None))
    params, params2, ddps, singles, first = stacked, stacked, [], [], None
    for m in models:
        ddp = DistributedDataParallel(copy.deepcopy(m))
        ddps.append((ddp, torch.optim.SGD(ddp.parameters(), lr=LR)))
        singles.append({k: v.detach() for k, v in m.named_parameters()})
    single_loss = loss_of(copy.deepcopy(models[0]))
    for i in range(STEPS):
        x, y = data(rank, i)
        grads, _ = step(params, x, y)
        first = grads if first is None else first
        params = sgd(params, grads, LR)
        params2, _ = zero2_step(params2, x, y)
        for ddp, opt in ddps:
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
        xs, ys = everyones(i, world)
        singles = [sgd(p, torch.func.grad(single_loss)(p, xs, ys), LR) for p in singles]
    return {
        "fr": params,
        "zero2": params2,
        "ddp": [{k: p.detach() for k, p in ddp.module.named_parameters()} for ddp, _ in ddps],
        "single": singles,
        "first_grads": first,
        "first_ddp_grads": [ddp_grads(m, *data(rank, 0)) for m in models],
    }


CLIP = 0.5


def clipped_per_sample(
    loss: Callable[..., torch.Tensor],
    params: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per-sample gradients clipped to norm ``CLIP`` and summed; the clip factors."""
    one = lambda p, x, y: loss(p, x[None], y[None])  # noqa: E731
    per_sample, _ = torch.func.vmap(fr.grad_and_value(one), in_dims=(None, 0, 0))(params, x, y)
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in per_sample.values()]).norm(dim=0)
    factor = (CLIP / (norms + 1e-6)).clamp(max=1.0)
    summed = {k: torch.einsum("n,n...->...", factor, g) for k, g in per_sample.items()}
    return summed, factor


@scenario
def dp_sgd(rank: int) -> dict[str, Any]:
    """Per-sample gradients clipped per sample, then averaged over every sample of every rank.

    Ranks of uneven batches (4 + rank examples). Two ways: the clipped sums
    reduced by a weighted ``all_reduce`` (weight: the rank's count); and a
    ``Step`` with ``weight=`` on the loss weighted by the clip factors.
    Against one process on the batches put together, and against DDP on the
    factor-weighted loss (scaled so that DDP's mean over ranks is the mean
    over examples).
    """
    world = dist.get_world_size()
    model = mlp(0)
    params = {k: v.detach() for k, v in model.named_parameters()}
    loss = loss_of(model)
    sizes = [4 + r for r in range(world)]
    x, y = data(rank, 0, n=sizes[rank])
    summed, factor = clipped_per_sample(loss, params, x, y)
    mean = {k: g / sizes[rank] for k, g in summed.items()}
    reduced = fr.distributed.all_reduce(mean, weight=sizes[rank])

    def weighted_loss(
        p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, c: torch.Tensor
    ) -> torch.Tensor:
        out, _ = fr.apply(model, fr.State(p, {}), x)
        return (c * F.cross_entropy(out, y, reduction="none")).mean()

    step = fr.distributed.grad_and_value(weighted_loss, weight=lambda p, x, y, c: x.shape[0])
    by_step, _ = step(params, x, y, factor)
    # one process: every rank's examples
    xs = [data(r, 0, n=sizes[r]) for r in range(world)]
    total = [clipped_per_sample(loss, params, *b)[0] for b in xs]
    single = {k: sum(t[k] for t in total) / sum(sizes) for k in params}
    # DDP on the factor-weighted loss: sum_i c_i l_i * W / N on each rank, averaged over ranks
    ddp = DistributedDataParallel(copy.deepcopy(model))
    out = ddp(x)
    (F.cross_entropy(out, y, reduction="none") * factor).sum().mul(world / sum(sizes)).backward()
    return {
        "all_reduce": reduced,
        "step": by_step,
        "single": single,
        "ddp": {k: p.grad for k, p in ddp.module.named_parameters()},
    }


ALPHA = 0.3


@scenario
def maml(rank: int) -> dict[str, Any]:
    """Second-order MAML whose inner step's gradient is all-reduced (a ``Step``).

    The meta-gradient by ``torch.func.grad`` (this rank's share, averaged
    over the ranks), by an outer ``fr.distributed.grad_and_value`` (which
    averages the shares itself), and by autograd (``backward`` through the
    inner step's graph-carrying gradients), against ``torch.func.grad`` in
    one process of the MAML objective on the ranks' batches put together;
    and the first-order meta-gradient, which must differ (the second-order
    term is there to be tested).
    """
    world = dist.get_world_size()
    model = mlp(1, torch.float64)
    params = {k: v.detach() for k, v in model.named_parameters()}
    loss = loss_of(model)
    inner = fr.distributed.grad_and_value(loss)
    support, query = data(rank, 0, dtype=torch.float64), data(rank, 1, dtype=torch.float64)

    def meta_loss(p: dict[str, torch.Tensor], support: Any, query: Any) -> torch.Tensor:
        grads, _ = inner(p, *support)
        return loss(sgd(p, grads, ALPHA), *query)

    share = torch.func.grad(meta_loss)(params, support, query)
    by_func = fr.distributed.all_reduce(share)
    by_step, _ = fr.distributed.grad_and_value(meta_loss)(params, support, query)
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    meta_loss(leaves, support, query).backward()
    by_autograd = fr.distributed.all_reduce({k: v.grad for k, v in leaves.items()})

    every_support = everyones(0, world, dtype=torch.float64)
    every_query = everyones(1, world, dtype=torch.float64)

    def single_meta(p: dict[str, torch.Tensor], first_order: bool = False) -> torch.Tensor:
        grads = torch.func.grad(loss)(p, *every_support)
        if first_order:
            grads = {k: g.detach() for k, g in grads.items()}
        return loss(sgd(p, grads, ALPHA), *every_query)

    return {
        "func": by_func,
        "step": by_step,
        "autograd": by_autograd,
        "share": share,
        "single": torch.func.grad(single_meta)(params),
        "first_order": torch.func.grad(lambda p: single_meta(p, first_order=True))(params),
    }


@scenario
def hvp(rank: int) -> dict[str, Any]:
    """Hessian-vector products of the mean loss over every rank's batch.

    Forward-over-reverse (``jvp`` of the step: Hv itself, and with
    ``shard=True`` this rank's rows of it), reverse-over-reverse
    (``torch.func.grad`` of <step's gradient, v>: this rank's share, averaged;
    an outer ``fr.distributed.grad_and_value`` of <local gradient, v>), and
    by autograd (``torch.autograd.grad`` through the step's graph-carrying
    gradients), against one process on the batches put together.
    """
    world = dist.get_world_size()
    model = mlp(2, torch.float64)
    params = {k: v.detach() for k, v in model.named_parameters()}
    v = {
        k: torch.sin(torch.arange(p.numel(), dtype=torch.float64)).view(p.shape)
        for k, p in params.items()
    }
    loss = loss_of(model)
    x, y = data(rank, 0, dtype=torch.float64)
    step = fr.distributed.grad_and_value(loss)
    shard_step = fr.distributed.grad_and_value(loss, shard=True)

    def dot(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((a[k] * b[k]).sum() for k in a)  # type: ignore[return-value]

    forward = torch.func.jvp(lambda p: step(p, x, y)[0], (params,), (v,))[1]
    forward_rows = torch.func.jvp(lambda p: shard_step(p, x, y)[0], (params,), (v,))[1]
    share = torch.func.grad(lambda p: dot(step(p, x, y)[0], v))(params)
    local = fr.grad_and_value(loss)
    outer, _ = fr.distributed.grad_and_value(lambda p: dot(local(p, x, y)[0], v))(params)
    leaves = {k: t.clone().requires_grad_() for k, t in params.items()}
    grads, _ = step(leaves, x, y)
    by_autograd = torch.autograd.grad(dot(grads, v), list(leaves.values()))
    xs, ys = everyones(0, world, dtype=torch.float64)
    single = torch.func.jvp(lambda p: torch.func.grad(loss)(p, xs, ys), (params,), (v,))[1]
    return {
        "forward": forward,
        "forward_rows": forward_rows,
        "reverse": fr.distributed.all_reduce(share),
        "outer": outer,
        "autograd": fr.distributed.all_reduce(dict(zip(leaves, by_autograd))),
        "single": single,
        "single_rows": fr.distributed.shard(single),
    }


# --- torch.compile -------------------------------------------------------------------------------


#: collectives only: a compiled function takes them under autograd (a Step's torch.func too)
COMPILED = Staged(
    [
        SCALE,
        Stage("all_reduce", op="sum"),
        Stage("sin"),
        Stage("broadcast", src=1),
        Stage("reduce_scatter", op="mean"),
        Stage("shard"),
    ]
)


@scenario
def compiled(rank: int) -> dict[str, Any]:
    """Compiled (``backend="eager"``) equals eager, and the single-process simulation.

    Collectives on graph-carrying inputs, then ``backward()``, against the
    simulation's gradient (and whether the same function compiles whole,
    ``fullgraph=True``: ``fullgraph``); a ``Step`` outside any transform in every way to call one
    (``shard=True``, ``weight=``, ``accumulate``, ``skip`` on the last rank),
    compiled whole against eager.
    """
    world = dist.get_world_size()
    xs = inputs_of(TREE, world, None)
    f = lambda x: scalar(COMPILED(REAL, rank, x))  # noqa: E731
    torch._dynamo.reset()
    whole = torch.compile(f, backend="eager", fullgraph=True)
    tracked = tensor_map(lambda t: t.clone().requires_grad_(), xs[rank])
    out: dict[str, Any] = {"fullgraph": outcome(lambda: whole(tracked).detach())}
    for mode in ("eager", "compiled"):
        torch._dynamo.reset()
        fn = f if mode == "eager" else torch.compile(f, backend="eager")
        x = tensor_map(lambda t: t.clone().requires_grad_(), xs[rank])
        snap = snapshot(x)
        value = fn(x)
        leaves = optree.tree_leaves(x)
        grads = torch.autograd.grad(value, leaves)
        out[mode] = (value.detach(), list(grads), unchanged(x, snap))
    out["simulated"] = optree.tree_leaves(oracle(COMPILED, "grad", xs)[rank])

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x @ p["w"].T).sum()

    plain = fr.distributed.grad_and_value(loss_fn)
    sharded = fr.distributed.grad_and_value(loss_fn, shard=True)
    weighted = fr.distributed.grad_and_value(loss_fn, weight=lambda p, x: x.shape[0])
    last = rank == world - 1

    def steps(p: dict[str, torch.Tensor], x: torch.Tensor) -> Any:
        return (
            plain(p, x),
            sharded(p, x),
            weighted(p, x),
            plain.accumulate(p, [(x,), (2 * x,)]),
            plain.skip(p, x) if last else plain(p, x),
        )

    p = {"w": torch.arange(6.0).view(3, 2) / 5}
    xb = torch.arange(4.0 + 2 * rank).view(-1, 2) + rank
    torch._dynamo.reset()
    out["steps"] = (steps(p, xb), torch.compile(steps, backend="eager", fullgraph=True)(p, xb))
    return out


REFUSED = {
    "vmap": lambda f, x: torch.func.vmap(f)(torch.stack([x, x])),
    "jvp": lambda f, x: torch.func.jvp(f, (x,), (x,)),
    "vmap_step": lambda f, x: torch.func.vmap(
        lambda p: fr.distributed.grad_and_value(lambda p: (p * p).sum())(p)[0]
    )(torch.stack([x, x])),
}


@scenario
def refusals(rank: int) -> dict[str, Any]:
    """Compiled collectives inside torch.func transforms refuse on every rank; the group lives on."""
    f = lambda t: fr.distributed.all_reduce(t * 2, op="sum").sum()  # noqa: E731
    x = torch.ones(3) + rank
    out: dict[str, Any] = {}
    for name, how in REFUSED.items():
        torch._dynamo.reset()
        out[name] = outcome(lambda how=how: torch.compile(lambda x: how(f, x), backend="eager")(x))
    out["after"] = fr.distributed.all_reduce(torch.ones(2), op="sum")
    return out


# --- bugs, each a minimal reproduction (tests marked xfail in test_compose.py) ------------------


@scenario
def weighted_zero_dim(rank: int) -> dict[str, Any]:
    """A weighted mean through the rules keeps a 0-dim leaf 0-dim (as the plain one does)."""
    s = torch.tensor(1.0 + rank, requires_grad=True)
    graph = fr.distributed.all_reduce({"s": s * 1}, weight=1.0 + rank)["s"]
    plain = fr.distributed.all_reduce({"s": s.detach()}, weight=1.0 + rank)["s"]
    step = fr.distributed.grad_and_value(lambda p: p["s"] ** 2, weight=lambda p: 1.0)
    under_vmap = torch.func.vmap(lambda s: step({"s": s})[0]["s"])(torch.ones(2))
    return {"graph": graph.shape, "plain": plain.shape, "vmap": under_vmap.shape}


@scenario
def accumulate_vmap(rank: int) -> Any:
    """``Step.accumulate`` under vmap (each member's micro-batches summed, then reduced)."""
    step = fr.distributed.grad_and_value(lambda p, x: (p * x).sum())
    micro = [(torch.ones(3) + rank,), (torch.full((3,), 2.0),)]
    return outcome(
        lambda: torch.func.vmap(lambda p: step.accumulate(p, micro)[0])(torch.ones(2, 3))
    )


@scenario
def accumulate_batch_graph(rank: int) -> dict[str, Any]:
    """``Step.accumulate`` on micro-batches that carry a graph keeps it, as ``step(...)`` does."""
    step = fr.distributed.grad_and_value(lambda p, x: (p["w"] ** 2 * x).sum())
    p = {"w": torch.tensor([1.0, 2.0])}
    x = torch.tensor([3.0, 4.0 + rank], requires_grad=True)
    called, _ = step(p, x)
    accumulated, _ = step.accumulate(p, [(x,)])
    return {"call": _graph(called["w"]), "accumulate": _graph(accumulated["w"])}


@scenario
def compiled_grad(rank: int) -> Any:
    """Compiled ``torch.func.grad`` through a collective: fr's RuntimeError (as vmap, jvp)."""
    torch._dynamo.reset()
    f = lambda t: fr.distributed.all_reduce(t * 2, op="sum").sum()  # noqa: E731
    return outcome(lambda: torch.compile(torch.func.grad(f), backend="eager")(torch.ones(3)))


def _sentinel() -> Any:
    """A call of another kind: where a peer's rule collective meets it, a mismatch, not a hang."""
    return fr.distributed.broadcast({"sentinel": torch.ones(1)}, src=0)


def _skipping_step(rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A step's gradients, skipped by the last rank (``sum(p * p * x)``, ``x`` ones + rank)."""
    world = dist.get_world_size()
    step = fr.distributed.grad_and_value(lambda p, x: (p * p * x).sum(), check=False)
    x = torch.ones(3) + rank
    return lambda p: (step.skip(p, x) if rank == world - 1 else step(p, x))[0]


@scenario
def skip_under_grad(rank: int) -> Any:
    """torch.func.grad through a step that the last rank skips: every rank runs the transpose."""
    f = _skipping_step(rank)
    grad = lambda: torch.func.grad(lambda p: (f(p) ** 2).sum())(torch.ones(3) * (rank + 1))  # noqa: E731
    return outcome(lambda: (grad(), _sentinel()))


@scenario
def skip_under_jvp(rank: int) -> Any:
    """jvp through a step that the last rank skips: every rank runs the tangent's collective."""
    f = _skipping_step(rank)
    return outcome(lambda: (torch.func.jvp(f, (torch.ones(3),), (torch.ones(3),)), _sentinel()))


@scenario
def unused_step_result(rank: int) -> Any:
    """Both ranks differentiate through a step; rank 1's loss does not use its result.

    The contract is broken (every rank must use the results): rank 0's
    transpose meets rank 1's next call, which must raise on every rank, as
    it does for an ``all_reduce`` (``unused_on_one_rank``).
    """
    step = fr.distributed.grad_and_value(lambda p: (p * p).sum())

    def loss(p: torch.Tensor) -> torch.Tensor:
        grads, _ = step(p)
        return grads.sum() if rank == 0 else grads.detach().sum() + p.sum()

    return outcome(lambda: (torch.func.grad(loss)(torch.ones(3)), _sentinel()))


@scenario
@in_debug_mode  # rank 0's first transpose meets rank 1's warm call: sizes differ, gloo would abort
def unused_on_one_rank(rank: int) -> dict[str, Any]:
    """A rank that does not use a collective's result runs no transpose: the peer's meets its next call.

    Rank 0 differentiates through an all-reduce, rank 1 does not; both then
    all-reduce a tensor of the same layout. Rank 0's transpose meets rank 1's
    next all-reduce: the contract (every rank must use the results) is
    broken, and the break raises on every rank, never reduces a cotangent
    with another call's data.
    """
    x = torch.ones(3, requires_grad=True)
    y = fr.distributed.all_reduce({"x": x * 2}, op="sum")["x"]
    out: dict[str, Any] = {}
    if rank == 0:
        out["grad"] = outcome(lambda: torch.autograd.grad(y.sum(), x)[0])
    nxt = {"x": torch.full((3,), 100.0 * (rank + 1))}
    out["next"] = outcome(lambda: fr.distributed.all_reduce(nxt, op="sum"))
    if rank == 1:
        out["sentinel"] = outcome(_sentinel)  # meets rank 0's next all-reduce: no hang
    return out


@scenario
def zero_dim_gather(rank: int) -> dict[str, Any]:
    """An all-gather keeps a 0-dim leaf as each rank's own; its transpose is the sum over ranks."""
    x = torch.tensor(1.0 + rank)
    f = lambda s: fr.distributed.all_gather({"s": s}, {"s": x})["s"]  # noqa: E731
    grad = torch.func.grad(lambda s: f(s) * (rank + 1))(x)
    value, tangent = torch.func.jvp(f, (x,), (torch.tensor(1.0 + 10 * rank),))
    return {"value": value, "grad": grad, "tangent": tangent}
