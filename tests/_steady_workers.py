"""Rank-side code of tests/test_steady_state.py: what a warm call sends, waits on and reads.

Each scenario warms a call up (its layout's first use probes), then runs it
again with every collective launch, ``Work.wait`` and host read of a tensor
(``item``, ``tolist``, ``__bool__``, ``__float__``, ``__int__``) recorded in
order: the contract of ../shared/API.md ("What the guarantees cost, and
when") is that a warm call launches all its buckets before it waits on any,
reads nothing on the host, and sends nothing but its data. The ranks are
``_dist_workers.spawn``'s (loopback only, a file store, bounded timeouts).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import _dist_workers
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import freplicate as fr

WARM, MEASURED = 2, 3
_LAUNCHES = (
    "all_reduce",
    "all_gather_single",  # torch 2.13's names of the two below
    "reduce_scatter_single",
    "broadcast",
    "reduce_scatter_tensor",
    "all_gather_into_tensor",
    "all_gather",
    "all_gather_object",
    "reduce_scatter",
)
_READS = ("item", "tolist", "__bool__", "__float__", "__int__")


class Scenario(str):
    """A scenario's name; unpickling it imports this module (see ``_compile_workers``)."""

    __slots__ = ()


def spawn(names: list[str], **kwargs: Any) -> dict[str, list[Any]]:
    return _dist_workers.spawn([Scenario(n) for n in names], **kwargs)


SCENARIOS: list[str] = []


def scenario(f: Any) -> Any:
    SCENARIOS.append(f.__name__)
    return _dist_workers.scenario(f)


@contextlib.contextmanager
def recorded() -> Iterator[list[tuple[str, Any]]]:
    """The events of the block, in order: ``("launch", (name, elements))``, ``("wait", None)``,
    ``("read", name)``; torch.distributed's functions and the tensor methods patched meanwhile."""
    log: list[tuple[str, Any]] = []
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, wrapper: Callable[[Any], Any]) -> None:
        original = getattr(owner, name)
        saved.append((owner, name, original))
        setattr(owner, name, wrapper(original))

    def launching(name: str) -> Callable[[Any], Any]:
        def wrap(original: Any) -> Any:
            def launch(*args: Any, **kwargs: Any) -> Any:
                t = args[0] if args and isinstance(args[0], torch.Tensor) else None
                log.append(("launch", (name, None if t is None else t.numel())))
                return original(*args, **kwargs)

            return launch

        return wrap

    def waiting(original: Any) -> Any:
        def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
            log.append(("wait", None))
            return original(self, *args, **kwargs)

        return wait

    def reading(name: str) -> Callable[[Any], Any]:
        def wrap(original: Any) -> Any:
            def read(self: Any, *args: Any, **kwargs: Any) -> Any:
                log.append(("read", name))
                return original(self, *args, **kwargs)

            return read

        return wrap

    for name in _LAUNCHES:
        if hasattr(dist, name):
            patch(dist, name, launching(name))
    patch(dist.distributed_c10d.Work, "wait", waiting)
    for name in _READS:
        patch(torch.Tensor, name, reading(name))
    try:
        yield log
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def measured(call: Callable[[], Any]) -> list[list[tuple[str, Any]]]:
    """``call()`` warmed up, then the events of each measured call."""
    for _ in range(WARM):
        call()
    dist.barrier()
    out = []
    for _ in range(MEASURED):
        with recorded() as log:
            call()
        out.append(log)
    return out


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)


def _loss(model: nn.Module) -> Callable[..., Any]:
    def loss(p: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        out, _ = fr.apply(model, fr.State(p, {}), x)
        return F.cross_entropy(out, y)

    return loss


@scenario
def step_calls(rank: int) -> dict[str, Any]:
    """A gradient step (one bucket, a bucket per tensor, sharded, weighted) and its skip."""
    model = _mlp()
    params = fr.state(model).params
    x, y = _batch(rank)
    loss = _loss(model)
    out: dict[str, Any] = {}
    for name, kwargs in {
        "step": {},
        "step(bucket per tensor)": {"bucket_cap_mb": 1e-6},
        "step(shard=True)": {"shard": True},
        "step(weight=)": {"weight": lambda p, x, y: x.shape[0]},
    }.items():
        step = fr.distributed.grad_and_value(loss, **kwargs)
        out[name] = measured(lambda step=step: step(params, x, y))
    step = fr.distributed.grad_and_value(loss)
    out["step.accumulate"] = measured(lambda: step.accumulate(params, [(x, y), (x, y)]))
    return out


@scenario
def collective_calls(rank: int) -> dict[str, Any]:
    """The four collectives on a tree of 40 leaves, in several buckets."""
    tree = {f"w{i}": torch.full((3 + i % 5, 4), float(rank + i)) for i in range(40)}
    shards = fr.distributed.shard(tree)
    cap = 1e-4  # a bucket every few tensors
    return {
        "all_reduce": measured(lambda: fr.distributed.all_reduce(tree, bucket_cap_mb=cap)),
        "all_reduce(op='sum')": measured(lambda: fr.distributed.all_reduce(tree, op="sum")),
        "broadcast": measured(lambda: fr.distributed.broadcast(tree)),
        "reduce_scatter": measured(lambda: fr.distributed.reduce_scatter(tree, bucket_cap_mb=cap)),
        "all_gather": measured(lambda: fr.distributed.all_gather(shards, tree)),
    }


@scenario
def zero3_step(rank: int) -> dict[str, Any]:
    """A ZeRO-3 step (``apply_sharded`` on three units, under ``fr.grad_and_value``)."""
    model = _mlp()
    mine = fr.distributed.shard(fr.state(model).params)
    x, y = _batch(rank)

    def loss(shards: Any) -> Any:
        out, _ = fr.distributed.apply_sharded(model, fr.State(shards, {}), x, units=["0", "2", "4"])
        return F.cross_entropy(out, y)

    return {"zero3": measured(lambda: fr.grad_and_value(loss)(mine))}


@scenario
@_dist_workers.in_debug_mode
def debug_mode(rank: int) -> dict[str, Any]:
    """The same step and all_reduce with the checks' debug mode on: a probe before each call."""
    model = _mlp()
    params = fr.state(model).params
    x, y = _batch(rank)
    step = fr.distributed.grad_and_value(_loss(model))
    tree = {f"w{i}": torch.full((3, 4), float(rank + i)) for i in range(4)}
    return {
        "debug step": measured(lambda: step(params, x, y)),
        "debug all_reduce": measured(lambda: fr.distributed.all_reduce(tree)),
    }


@_dist_workers.scenario  # run on its own, on 2 and 3 ranks (not in the module's job)
def diverging_after_warm_up(rank: int) -> dict[str, Any]:
    """Two layouts warm on every rank, then rank 1 runs the other one: buckets of the same sizes
    meet, the words differ, every rank raises where the results land, naming the difference."""
    a = {"a": torch.ones(6)}
    b = {"b": torch.ones(2, 3)}
    out: dict[str, Any] = {}
    for _ in range(2):
        fr.distributed.all_reduce(a)
        fr.distributed.all_reduce(b)
    with recorded() as log:
        out["all_reduce"] = _outcome(lambda: fr.distributed.all_reduce(b if rank == 1 else a))
    out["all_reduce launches"] = _launches_of(log)
    params = {"w": torch.ones(3, 2)}
    other = {"v": torch.ones(6)}
    step = fr.distributed.grad_and_value(lambda p: sum(t.sum() for t in p.values()))
    for _ in range(2):
        step(params)
        step(other)
    out["step"] = _outcome(lambda: step(other if rank == 1 else params))
    out["after"] = fr.distributed.all_reduce({"x": torch.full((2,), float(rank))}, op="sum")
    return out


def _outcome(f: Callable[[], Any]) -> tuple[Any, ...]:
    try:
        return ("returned", f())
    except BaseException as err:
        return ("raised", _dist_workers._kind(err), str(err))


def _launches_of(log: list[tuple[str, Any]]) -> list[Any]:
    return [what for event, what in log if event == "launch"]


@_dist_workers.scenario  # run on its own (not in the module's job)
def compiled_diverging(rank: int) -> dict[str, Any]:
    """A compiled all_reduce traced (and agreed) on two layouts of one size, then rank 1 runs the
    other cached graph: no probe in the graph, the words asserted in it, every rank raises."""
    torch._dynamo.reset()
    graphs: list[list[str]] = []

    def backend(gm: Any, example_inputs: Any) -> Any:  # the graphs' collectives, then eager
        graphs.append([str(n.target) for n in gm.graph.nodes if "all_reduce" in str(n.target)])
        return gm.forward

    f = torch.compile(lambda t: fr.distributed.all_reduce(t, op="sum"), backend=backend)
    a, b = {"a": torch.ones(6)}, {"b": torch.ones(2, 3)}
    f(a)
    f(b)  # a second graph (other keys and shapes), agreed while it traced
    out: dict[str, Any] = {"graphs": graphs}
    out["diverged"] = _outcome(lambda: f(b if rank == 1 else a))
    return out
