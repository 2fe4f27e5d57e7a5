"""Rank-side code of tests/test_compile.py: fr.distributed under torch.compile on 2 gloo ranks.

The ranks are ``_dist_workers.spawn``'s (loopback only, a file store, bounded
timeouts, stragglers killed). Its ranks know only the scenarios of modules
they import: ``spawn`` here passes the names as ``Scenario`` strings, whose
unpickling in each rank imports this module, and so registers its scenarios.

The data-parallel step is the tutorial's, written with
``fr.distributed.grad_and_value`` (small buckets: several collectives in the
graph) and ``fr.distributed.sync_buffers`` before the forward (what DDP does
with ``broadcast_buffers=True``); the oracles are the same step run eagerly
and DistributedDataParallel with ``torch.optim.SGD``.
"""

from __future__ import annotations

import time
from typing import Any

import _dist_workers
import torch
import torch.nn.functional as F
from torch import nn

import freplicate as fr

LR = 0.1
CAP_MB = 0.0005  # ~130 floats: the model's gradients travel in several buckets


class Scenario(str):
    """A scenario's name; unpickling it imports this module (see the module's text)."""

    __slots__ = ()


def spawn(names: list[str], **kwargs: Any) -> dict[str, list[Any]]:
    return _dist_workers.spawn([Scenario(n) for n in names], **kwargs)


SCENARIOS: list[str] = []


def scenario(f: Any) -> Any:
    SCENARIOS.append(f.__name__)
    return _dist_workers.scenario(f)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))


def batch(rank: int, step: int, n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def fr_step(module: nn.Module) -> Any:
    """The functional DDP step: buffers from rank 0, gradients averaged over the ranks."""

    def loss_fn(params: Any, buffers: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        out, new = fr.apply(module, fr.State(params, buffers), x)
        return F.cross_entropy(out, y), new.buffers

    grad_fn = fr.distributed.grad_and_value(loss_fn, has_aux=True, bucket_cap_mb=CAP_MB)

    def step(state: fr.State, x: torch.Tensor, y: torch.Tensor) -> tuple[fr.State, Any]:
        buffers = fr.distributed.sync_buffers(state.buffers)
        grads, (loss, new_buffers) = grad_fn(state.params, buffers, x, y)
        params = {k: p - LR * grads[k] for k, p in state.params.items()}
        return fr.State(params, new_buffers), loss

    return step


def train(step: Any, rank: int, steps: int = 3, sizes: tuple[int, ...] = (6, 6, 6)) -> fr.State:
    state = fr.state(model())
    state = fr.State({k: v.clone() for k, v in state.params.items()}, state.buffers)
    for i in range(steps):
        state, _ = step(state, *batch(rank, i, sizes[i]))
    return state


def train_ddp(rank: int, steps: int = 3) -> fr.State:
    ddp = nn.parallel.DistributedDataParallel(model())
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for i in range(steps):
        opt.zero_grad()
        x, y = batch(rank, i)
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    return fr.State(
        {k: v.detach() for k, v in ddp.module.named_parameters()},
        {k: v.detach() for k, v in ddp.module.named_buffers()},
    )


@scenario
def step_graphs(rank: int) -> tuple[int, int, list[str]]:
    """How many graphs and breaks Dynamo makes of the whole data-parallel step."""
    torch._dynamo.reset()
    step = fr_step(model())
    report = torch._dynamo.explain(step)(fr.state(model()), *batch(rank, 0))
    return (
        report.graph_count,
        report.graph_break_count,
        [str(r.reason) for r in report.break_reasons],
    )


@scenario
def step_compiled(rank: int) -> dict[str, fr.State]:
    """Three steps compiled whole (Inductor, ``fullgraph=True``), eager, and DDP's."""
    torch._dynamo.reset()
    module = model()
    compiled = train(torch.compile(fr_step(module), fullgraph=True), rank)
    return {"compiled": compiled, "eager": train(fr_step(module), rank), "ddp": train_ddp(rank)}


@scenario
def rank_retraces_alone(rank: int) -> dict[str, fr.State]:
    """Rank 1's last batch is smaller: it retraces alone while rank 0 runs its graph."""
    torch._dynamo.reset()
    module = model()
    sizes = (6, 6, 4 if rank == 1 else 6)
    compiled = train(torch.compile(fr_step(module), backend="eager"), rank, sizes=sizes)
    return {"compiled": compiled, "eager": train(fr_step(module), rank, sizes=sizes)}


def mixed(rank: int) -> dict[str, Any]:
    tree = _dist_workers.tree_of(rank)
    tree["c"] = torch.tensor([1 + 2j, rank - 1j], dtype=torch.complex64)
    return tree


def collectives(tree: Any, floats: Any, buffers: Any) -> dict[str, Any]:
    return {
        "sum": fr.distributed.all_reduce(tree, op="sum"),
        "mean": fr.distributed.all_reduce(floats, bucket_cap_mb=1e-4),
        "bf16": fr.distributed.all_reduce(floats, compress="bf16"),
        "broadcast": fr.distributed.broadcast(tree, src=1),
        "buffers_mean": fr.distributed.sync_buffers(buffers, mode="mean"),
        "buffers_broadcast": fr.distributed.sync_buffers(buffers),
    }


@scenario
def collectives_compiled(rank: int) -> dict[str, Any]:
    """Every collective traced (``fullgraph=True``) and run, beside the eager calls."""
    torch._dynamo.reset()
    tree = mixed(rank)
    floats = {k: v for k, v in tree.items() if k in ("w", "b", "tied", "step", "c")}
    bn = nn.BatchNorm1d(3)
    bn(torch.randn(4, 3) + rank)  # running statistics that differ across ranks
    args = (tree, floats, fr.state(bn).buffers)
    snap = _dist_workers.snapshot(args)
    traced = torch.compile(collectives, fullgraph=True, backend="eager")(*args)
    out = traced["sum"]
    return {
        "compiled": traced,
        "eager": collectives(*args),
        "tied": out["tied"][0] is out["tied"][1],
        "unchanged": _dist_workers.unchanged(args, snap),  # no input's values or _version
    }


@scenario
def skip_compiled(rank: int) -> Any:
    """Rank 1 has no batch: its compiled ``skip`` meets rank 0's compiled step, as eagerly."""
    torch._dynamo.reset()
    grad_fn = fr.distributed.grad_and_value(lambda p, x: (p["w"] * x).sum())

    def step(p: Any, x: torch.Tensor) -> Any:
        return grad_fn.skip(p) if rank == 1 else grad_fn(p, x)

    params = {"w": torch.ones(3)}
    x = torch.arange(3.0)
    return torch.compile(step, fullgraph=True, backend="eager")(params, x), step(params, x)


@scenario
def mismatch_compiled(rank: int) -> Any:
    """Trees whose shapes differ across ranks: ``ValueError`` on both, when the graph is traced."""
    torch._dynamo.reset()
    start = time.monotonic()
    try:
        # a name no earlier scenario used: neither layout was agreed before (see docs/compile.md)
        torch.compile(fr.distributed.all_reduce, backend="eager")({"m": torch.ones(2 + rank)})
    except ValueError as err:
        return str(err), time.monotonic() - start
    return "no error", time.monotonic() - start


@scenario
def same_layout_after_mismatch(rank: int) -> Any:
    """After a mismatch both ranks can go on: an agreed layout passes."""
    torch._dynamo.reset()
    reduce = torch.compile(fr.distributed.all_reduce, backend="eager")
    return reduce({"v": torch.full((3,), float(rank))}, op="sum")["v"]


@scenario
def mismatch_without_the_store(rank: int) -> Any:
    """Where torch cannot hand out the group's store, the traced check takes one all-gather."""
    from freplicate._distributed import _store

    torch._dynamo.reset()
    saved = _store.group_store
    _store.group_store = lambda group: None  # type: ignore[assignment]
    try:
        torch.compile(fr.distributed.all_reduce, backend="eager")({"n": torch.ones(5 + rank)})
    except ValueError as err:
        return str(err)
    finally:
        _store.group_store = saved  # type: ignore[assignment]
    return "no error"
