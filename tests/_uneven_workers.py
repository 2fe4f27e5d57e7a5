"""Rank-side code of tests/test_uneven.py: uneven inputs (``join``, ``skip``, ``weight=``)
and gradient accumulation (``accumulate``), against DDP's ``Join`` and ``no_sync``.

The scenarios register with ``_dist_workers`` and run through its spawner
(2 gloo ranks on loopback, bounded timeouts, stragglers killed); ``main``
is the ranks' entry point, which imports this module so that they find them.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist_workers import (
    WORLD,
    Net,
    SparseNet,
    _kind,
    _main,
    dense,
    gather_all,
    in_debug_mode,
    scenario,
    snapshot,
    spawn,
    unchanged,
)
from torch import nn

import freplicate as fr
from freplicate._distributed import _plans as planning
from freplicate._distributed._options import Options
from freplicate._distributed._wire import ALL_REDUCE

LR = 0.1


def main(*args: Any) -> None:
    _main(*args)


def run(names: list[str], **kwargs: Any) -> dict[str, list[Any]]:
    return spawn(names, target=main, **kwargs)


def batch(rank: int, step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(rows, 8, generator=g), torch.randint(0, 4, (rows,), generator=g)


def loss_of(model: nn.Module) -> Callable[..., torch.Tensor]:
    def loss_fn(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out, _ = fr.apply(model, fr.State(p, {}), x)
        return F.cross_entropy(out, y)

    return loss_fn


def params_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in module.named_parameters()}


def sgd(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {k: p - LR * grads[k] for k, p in params.items()}


class Calls:
    """``dist.<name>`` calls on this rank while active: whether each ran inside a backward."""

    def __init__(self, name: str = "all_reduce") -> None:
        self.inside: list[bool] = []
        self.name = name
        self._orig = getattr(dist, name)

    def __enter__(self) -> Calls:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.inside.append(torch._C._current_autograd_node() is not None)
            return self._orig(*args, **kwargs)

        setattr(dist, self.name, counted)
        return self

    def __exit__(self, *exc: Any) -> None:
        setattr(dist, self.name, self._orig)

    def __len__(self) -> int:
        return len(self.inside)


# --- uneven inputs: join and skip -----------------------------------------------------------


def sgd_under_join(ddp: nn.Module, data: list[Any]) -> list[dict[str, torch.Tensor]]:
    """DDP + ``torch.optim.SGD`` over this rank's ``data`` under ``Join``: the parameters after
    each of its steps."""
    from torch.distributed.algorithms.join import Join

    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    steps = []
    with Join([ddp], divide_by_initial_world_size=True):
        for x, y in data:
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
            steps.append(params_of(ddp.module))
    return steps


@scenario
def join_against_ddp(rank: int) -> dict[str, Any]:
    """5 batches on rank 0, 3 on rank 1: fr's join/skip loop against DDP under Join, step by step;
    and the collectives the loop makes (join's bit rides in the step's own reduction)."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = Net(batchnorm=False)
    data = [batch(rank, i, 6) for i in range([5, 3][rank])]

    ddp = DistributedDataParallel(copy.deepcopy(model))
    ddp_steps = sgd_under_join(ddp, data)
    ddp_final = params_of(ddp.module)  # Join syncs the last joiner's model to every rank

    params = fr.state(model).params
    step = fr.distributed.grad_and_value(loss_of(model))
    fr_steps, marks, skipped = [], [], 0
    with Calls() as calls:
        for b in fr.distributed.join(data):
            marks.append(len(calls))
            if b is None:
                grads, value = step.skip(params)
                skipped += 1
                assert value is None
            else:
                grads, _ = step(params, *b)
            params = sgd(params, grads)
            fr_steps.append(params)
        marks.append(len(calls))
    return {
        "fr": fr_steps,
        "ddp": ddp_steps,
        "ddp_final": ddp_final,
        "skipped": skipped,
        "per_step": [b - a for a, b in itertools.pairwise(marks)],
        "start": marks[0],
    }


@scenario
def join_weighted(rank: int) -> dict[str, Any]:
    """Batches of 6 rows (5 of them) on rank 0, of 2 rows (3) on rank 1, weight= the rows: each
    step's gradients are the full-batch gradient over the union of that step's batches."""
    torch.manual_seed(0)
    model = Net(batchnorm=False)
    loss_fn = loss_of(model)
    counts, rows = [5, 3], [6, 2]
    params = fr.state(model).params
    step = fr.distributed.grad_and_value(loss_fn, weight=lambda p, x, y: x.shape[0])
    local = fr.grad_and_value(loss_fn)
    pairs = []
    mine = (batch(rank, i, rows[rank]) for i in range(counts[rank]))
    kept = True  # no input's values or _version change (skip's zeros, the weights' scaling)
    for i, b in enumerate(fr.distributed.join(mine)):
        snap = snapshot((params, b))
        grads, _ = step.skip(params) if b is None else step(params, *b)
        kept = kept and unchanged((params, b), snap)
        union = [batch(r, i, rows[r]) for r in range(WORLD) if i < counts[r]]
        xs, ys = (torch.cat(parts) for parts in zip(*union))
        pairs.append((grads, local(params, xs, ys)[0]))
        params = sgd(params, grads)
    everyone = gather_all(params)
    tree = {"v": torch.full((3,), rank + 1.0), "w": torch.full((2, 2), 10.0 * rank)}
    snap = snapshot(tree)
    out = {
        "pairs": pairs,
        "same": all(torch.equal(everyone[0][k], everyone[1][k]) for k in params),
        "weighted": fr.distributed.all_reduce(tree, weight=[3, 1][rank]),
        "zero_weights": fr.distributed.all_reduce(tree, weight=0),
        "mean": fr.distributed.all_reduce(tree),
    }
    out["inputs_unchanged"] = kept and unchanged(tree, snap)
    return out


@scenario
def join_without_reductions(rank: int) -> dict[str, Any]:
    """A loop whose body makes no reduction: join asks with a collective of its own each step."""
    seen = []
    with Calls() as calls:
        for item in fr.distributed.join(range(10 * rank, 10 * rank + [5, 3][rank])):
            seen.append(item)
    return {"seen": seen, "calls": len(calls)}


def failing_loop(rank: int, items: Any, forget_skip: bool) -> dict[str, Any]:
    """A join loop of a fresh ``Net``'s steps expected to fail: its steps, error, and after."""
    torch.manual_seed(0)
    model = Net(batchnorm=False)
    params, step = fr.state(model).params, fr.distributed.grad_and_value(loss_of(model))
    loop = fr.distributed.join(items)
    out: dict[str, Any] = {"steps": 0}
    try:
        for b in loop:
            if b is None and forget_skip:
                continue  # the bug: no skip
            _ = step.skip(params) if b is None else step(params, *b)
            out["steps"] += 1
    except Exception as err:
        out["error"] = (_kind(err), str(err))
    loop.close()  # type: ignore[attr-defined]
    out["after"] = fr.distributed.all_reduce({"x": torch.ones(2)}, op="sum")
    return out


@scenario
@in_debug_mode  # rank 1's join meets rank 0's warm step: sizes differ (gloo would abort)
def join_forgotten_skip(rank: int) -> dict[str, Any]:
    """Rank 1 runs out and, on None, calls nothing: every rank raises instead of waiting."""
    return failing_loop(rank, [batch(rank, i, 4) for i in range([3, 1][rank])], True)


def flaky(rank: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for i in range(4):
        if rank == 1 and i == 2:
            raise KeyError("no batch 2 on rank 1")
        yield batch(rank, i, 4)


@scenario
def join_iterable_raises(rank: int) -> dict[str, Any]:
    """Rank 1's data loader raises: rank 1 gets its own error, rank 0 one naming rank 1."""
    return failing_loop(rank, flaky(rank), False)


@scenario
def join_sparse(rank: int) -> dict[str, Any]:
    """Sparse gradients (nn.Embedding(sparse=True)) with a rank out of data: its skip mirrors the
    sparse reduction; every rank holds the same gradients, the mean of those that had data."""
    torch.manual_seed(0)
    model = SparseNet()
    params = fr.state(model).params

    def loss_fn(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out, _ = fr.apply(model, fr.State(p, {}), x)
        return F.cross_entropy(out, y)

    def data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(100 * rank + i)
        return torch.randint(0, 10, (6, 3), generator=gen), torch.randint(0, 2, (6,), generator=gen)

    step = fr.distributed.grad_and_value(loss_fn)
    local = fr.grad_and_value(loss_fn)
    steps = []
    for b in fr.distributed.join([data(i) for i in range([4, 2][rank])]):
        grads, _ = step.skip(params) if b is None else step(params, *b)
        own = None if b is None else dense(local(params, *b)[0])
        steps.append((dense(grads), own, {k: v.layout for k, v in grads.items()}))
        params = sgd(params, grads)
    return {"steps": steps}


# --- gradient accumulation ------------------------------------------------------------------


def micro_of(rank: int, s: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [batch(rank, 10 * s + k, 4) for k in range(3)]


@scenario
def accumulate_against_ddp(rank: int) -> dict[str, Any]:
    """Three micro-batches a step, four steps: step.accumulate against DDP with no_sync on the
    first two; one reduction a step (its buckets, all but the last launched during the last
    micro-batch's backward pass)."""
    from torch.nn.parallel import DistributedDataParallel

    out: dict[str, Any] = {}
    for cap in (25.0, 0.001):  # one bucket; several
        torch.manual_seed(0)
        model = Net(batchnorm=False)
        ddp = DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=cap)
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
        params = fr.state(model).params
        step = fr.distributed.grad_and_value(loss_of(model), bucket_cap_mb=cap)
        plan, _ = planning.plan_of(
            params, Options(ALL_REDUCE.name, "mean", cap, None), None, 2, "fr.distributed.grad_and_value"
        )
        pairs, per_step, values = [], [], []
        for s in range(4):
            micro = micro_of(rank, s)
            opt.zero_grad()
            with ddp.no_sync():
                for x, y in micro[:-1]:
                    F.cross_entropy(ddp(x), y).backward()
            x, y = micro[-1]
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
            with Calls() as calls:
                grads, vals = step.accumulate(params, micro)
            per_step.append(calls.inside)
            values.append([float(v) for v in vals])
            params = sgd(params, grads)
            pairs.append((params, params_of(ddp.module)))
        out[cap] = {
            "pairs": pairs,
            "per_step": per_step,
            "buckets": len(plan.layout.buckets),
            "values": values,
            "first_values": [
                float(loss_of(model)(fr.state(model).params, *b)) for b in micro_of(rank, 0)
            ],
        }
    return out


@scenario
def accumulate_weighted(rank: int) -> dict[str, Any]:
    """Uneven micro-batches, weight= their rows: the exact gradient over every micro-batch of
    every rank; a rank with no micro-batch in a step joins it (an empty accumulate)."""
    torch.manual_seed(0)
    model = Net(batchnorm=False)
    loss_fn = loss_of(model)
    local = fr.grad_and_value(loss_fn)
    params = fr.state(model).params
    step = fr.distributed.grad_and_value(loss_fn, weight=lambda p, x, y: x.shape[0])
    plain = fr.distributed.grad_and_value(loss_fn)
    sizes = {0: [[4, 4, 2], [5]], 1: [[3], []]}  # per step, per rank: micro-batch rows
    pairs = []
    for s in range(2):

        def micro(r: int, s: int = s) -> list[tuple[torch.Tensor, torch.Tensor]]:
            return [batch(r, 10 * s + k, n) for k, n in enumerate(sizes[r][s])]

        grads, values = step.accumulate(params, micro(rank))
        assert len(values) == len(sizes[rank][s])
        xs, ys = (torch.cat(parts) for parts in zip(*(micro(0) + micro(1))))
        pairs.append((grads, local(params, xs, ys)[0]))
        # unweighted, DDP's meaning: the sum over micro-batches, averaged over the ranks
        summed, _ = plain.accumulate(params, micro(rank))
        mine = [local(params, *b)[0] for b in micro(rank)]
        total = {k: sum((g[k] for g in mine), torch.zeros_like(v)) for k, v in params.items()}
        pairs.append((summed, fr.distributed.all_reduce(total)))
        params = sgd(params, grads)
    return {"pairs": pairs}


@scenario
def weighted_corners(rank: int) -> dict[str, Any]:
    """Compressed buckets with accumulation and with weights; weighted sparse leaves, alone (the
    weights then travel on their own) and beside dense ones."""
    torch.manual_seed(0)
    model = Net(batchnorm=False)
    loss_fn = loss_of(model)
    local = fr.grad_and_value(loss_fn)
    params = fr.state(model).params
    micro = micro_of(rank, 7)
    inputs_snap = snapshot((params, micro))
    grads, _ = fr.distributed.grad_and_value(loss_fn, compress="bf16").accumulate(params, micro)
    kept = unchanged((params, micro), inputs_snap)
    mine = [local(params, *b)[0] for b in micro]
    total = {k: sum((g[k] for g in mine), torch.zeros_like(v)) for k, v in params.items()}
    tree = {"v": torch.full((5,), rank + 1.0), "w": torch.randn(3, 3) * (rank + 1)}
    w = [3, 1][rank]
    e = torch.sparse_coo_tensor(torch.tensor([[rank, 3]]), torch.full((2, 2), rank + 1.0), (5, 2))
    e = e.coalesce()  # coalesce() of a coalesced tensor is itself: its values are the input's
    tree_snap, e_snap = snapshot(tree), (e.values()._version, e.values().clone())
    out = {
        "accumulated_bf16": (grads, fr.distributed.all_reduce(total)),
        "weighted_bf16": (
            fr.distributed.all_reduce(tree, weight=w, compress="bf16"),
            fr.distributed.all_reduce(tree, weight=w),
        ),
        "sparse_alone": dense(fr.distributed.all_reduce({"e": e}, weight=w)),
        "sparse_mixed": dense(fr.distributed.all_reduce({"e": e, "v": tree["v"]}, weight=w)),
        "everyone": [dense(t) for t in gather_all({"e": e, "v": tree["v"]})],
    }
    out["inputs_unchanged"] = (
        kept
        and unchanged(tree, tree_snap)
        and e.values()._version == e_snap[0]
        and torch.equal(e.values(), e_snap[1])
    )
    return out


@scenario
def accumulate_raises(rank: int) -> dict[str, Any]:
    """A micro-batch fails on rank 1 before its last one (locally, no collective yet): rank 1
    gets its own error, rank 0, already in the step's reduction, one naming rank 1."""
    torch.manual_seed(0)
    model = Net(batchnorm=False)
    params = fr.state(model).params
    step = fr.distributed.grad_and_value(loss_of(model))
    step.accumulate(params, micro_of(rank, 0))  # the layout is known: the fast path
    micro: list[Any] = micro_of(rank, 1)
    if rank == 1:
        micro[1] = micro[1][0]  # a tensor, not a tuple of arguments
    out: dict[str, Any] = {}
    try:
        step.accumulate(params, micro)
    except Exception as err:
        out["error"] = (_kind(err), str(err))
    out["after"] = fr.distributed.all_reduce({"x": torch.ones(2)}, op="sum")
    return out
