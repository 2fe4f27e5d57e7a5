"""fr.distributed against DistributedDataParallel and composable replicate, on 2 gloo ranks.

Run ``.venv/bin/python -m benchmarks.bench_distributed`` (``--quick`` for a
short run). Two ranks are spawned on 127.0.0.1, one thread each, rank r
pinned to core r (``--no-pin`` leaves placement to the OS: the ranks and
gloo's threads then migrate between the two cores, and the small-model rows
swing by up to 30% from run to run, DDP's own composable ``replicate`` too).
Every round runs every side for a few steps, the sides in balanced orders
(``_common.orders``: every side after every other equally often; the same
order on both ranks: they are collective); a step's time is
the slowest rank's (per-step times all-reduced with MAX after the round);
each side's time in a round is its median step, and the figure is the
median over rounds of the per-round ratio to the baseline (DDP, or one flat
``dist.all_reduce``). Before timing, every side trains a few steps from the
same init and must reach the same parameters as DDP.

Sides of the training step (SGD, lr 0.01, ``F.cross_entropy``):

- ``ddp``: ``DistributedDataParallel`` + ``torch.optim.SGD`` (foreach);
- ``replicate``: composable ``replicate`` + the same optimiser;
- ``fr``: ``fr.distributed.grad_and_value`` over ``fr.apply``, out-of-place
  update ``torch._foreach_add(params, grads, alpha=-lr)``; ``check=False``:
  the same without the first-use probe (on a warm layout the check's 50
  words ride in the first and last buckets either way, verified on the
  device; DDP checks shapes once, at construction);
- ``naive``: the straightforward functional step (the "before" of issue 6):
  ``fr.grad_and_value``, then one fresh flat buffer (``torch.cat``), one
  blocking ``dist.all_reduce``, split back, divided by the world size.

And an ensemble (issue 23): ``ENSEMBLE`` members of small_mlp, each with its
own initialisation, trained one SGD step each on the same batch: ``torch.vmap``
of ``fr.distributed.grad_and_value`` over the members' stacked parameters
(``torch.func.stack_module_state``: one forward, one backward, one collective
for every member's gradients, through the collectives' batching rule) beside
one DDP model per member, stepped one after the other; and the same ensemble
the other way round, ``fr.distributed.grad_and_value`` of the members' summed
``vmap``-ped losses (the step then overlaps its buckets with the backward
pass, as for one model). Every member must reach its own DDP's parameters.
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import freplicate as fr

from ._common import MODELS, Rounds, balanced, build, on_two_ranks, two_rank_arguments
from ._report import Row, show

NAME = "distributed"
TITLE = (
    "distributed: 2 gloo ranks on 127.0.0.1, a training step and a 400-leaf all_reduce, "
    "fr.distributed beside DistributedDataParallel and dist.all_reduce; "
    "a step's time is the slowest rank's"
)
LR = 0.01
# The targets (issue 6): an SGD step with fr.distributed.grad_and_value / a DDP step, per model,
# and fr.distributed.all_reduce of the 400-leaf tree / one flat dist.all_reduce.
TARGETS = {"many_small": 0.85, "small_mlp": 1.00, "mid_mlp": 1.00}
ALL_REDUCE = 1.10
# issue 23: a vmapped ensemble of 4 small_mlp members / 4 DDP runs
ENSEMBLE, ENSEMBLE_TARGET = 4, 0.5


def _fr_side(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, check: bool = True
) -> Callable[[], Any]:
    s = fr.state(model)
    names = list(s.params)
    params = [p.clone() for p in s.params.values()]
    buffers = s.buffers

    def loss_fn(p: dict[str, torch.Tensor]) -> torch.Tensor:
        out, _ = fr.apply(model, fr.State(p, buffers), x)
        return F.cross_entropy(out, y)

    grad_fn = fr.distributed.grad_and_value(loss_fn, check=check)

    def step() -> Any:
        nonlocal params
        grads, _ = grad_fn(dict(zip(names, params)))
        params = torch._foreach_add(params, list(grads.values()), alpha=-LR)
        return dict(zip(names, params))

    return step


def _naive_side(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], Any]:
    s = fr.state(model)
    names = list(s.params)
    params = [p.clone() for p in s.params.values()]
    buffers = s.buffers
    world = dist.get_world_size()

    def loss_fn(p: dict[str, torch.Tensor]) -> torch.Tensor:
        out, _ = fr.apply(model, fr.State(p, buffers), x)
        return F.cross_entropy(out, y)

    grad_fn = fr.grad_and_value(loss_fn)

    def step() -> Any:
        nonlocal params
        grads, _ = grad_fn(dict(zip(names, params)))
        g = list(grads.values())
        flat = torch.cat([t.reshape(-1) for t in g])
        dist.all_reduce(flat)
        flat /= world
        reduced = [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in g]), g)]
        params = torch._foreach_add(params, reduced, alpha=-LR)
        return dict(zip(names, params))

    return step


def _stateful_side(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, kind: str
) -> Callable[[], Any]:
    import copy

    from torch.distributed._composable import replicate
    from torch.nn.parallel import DistributedDataParallel

    own = copy.deepcopy(model)
    if kind == "ddp":
        wrapped: torch.nn.Module = DistributedDataParallel(own)
    else:
        wrapped = replicate(own)
    opt = torch.optim.SGD(own.parameters(), lr=LR, foreach=True)

    def step() -> Any:
        opt.zero_grad()
        F.cross_entropy(wrapped(x), y).backward()
        opt.step()
        return {k: p.detach() for k, p in own.named_parameters()}

    return step


def _members(name: str) -> tuple[list[torch.nn.Module], torch.Tensor, torch.Tensor]:
    """``ENSEMBLE`` models of ``name``, each initialised from its own seed, and a batch."""
    _, x, y = build(name)
    models = []
    for m in range(ENSEMBLE):
        torch.manual_seed(m)
        models.append(build(name)[0])
    return models, x, y


def _ensemble_side(
    models: list[torch.nn.Module], x: torch.Tensor, y: torch.Tensor, *, outer: bool = True
) -> Callable[[], Any]:
    """``vmap`` of ``fr.distributed.grad_and_value`` over the members' stacked parameters
    (``outer``), or ``grad_and_value`` of the members' ``vmap``-ped losses, summed."""
    params, _ = torch.func.stack_module_state(models)
    params = {k: v.detach().clone() for k, v in params.items()}
    base = models[0]

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(torch.func.functional_call(base, p, (x,)), y)

    def summed(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.vmap(loss_fn, in_dims=(0, None, None))(p, x, y).sum()

    if outer:
        step_fn = torch.vmap(fr.distributed.grad_and_value(loss_fn), in_dims=(0, None, None))
    else:
        step_fn = fr.distributed.grad_and_value(summed)

    def step() -> Any:
        nonlocal params
        grads, _ = step_fn(params, x, y)
        params = {k: p - LR * grads[k] for k, p in params.items()}
        return params

    return step


def _ddp_members(models: list[torch.nn.Module], x: torch.Tensor, y: torch.Tensor) -> Callable[[], Any]:
    """One DDP model per member, stepped one after the other; the members' parameters stacked."""
    steps = [_stateful_side(m, x, y, "ddp") for m in models]

    def step() -> Any:
        outs = [fn() for fn in steps]
        return {k: torch.stack([o[k] for o in outs]) for k in outs[0]}

    return step


def _bench_ensemble(rounds: int, steps: int) -> Rounds:
    models, x, y = _members("small_mlp")
    check = {
        "ddp": _ddp_members(models, x, y),
        "fr": _ensemble_side(models, x, y),
        "fr_inner": _ensemble_side(models, x, y, outer=False),
    }
    worst = _agree(check)
    if worst > 1e-5:
        raise AssertionError(f"ensemble: the vmapped members disagree with DDP by {worst:.2e}")
    sides = [
        _ddp_members(models, x, y),
        _ensemble_side(models, x, y),
        _ensemble_side(models, x, y, outer=False),
    ]
    return _rounds(sides, rounds, steps)


def _round_times(fn: Callable[[], Any], steps: int) -> float:
    """The median over ``steps`` of the slowest rank's step time."""
    times = torch.zeros(steps, dtype=torch.float64)
    for i in range(steps):
        start = time.perf_counter()
        fn()
        times[i] = time.perf_counter() - start
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return float(times.median())


def _rounds(sides: list[Callable[[], Any]], rounds: int, steps: int) -> Rounds:
    """Every side's time in every round (its median step, the slowest rank's), in balanced
    orders (the same on both ranks)."""
    # warm-up: plans, buffers, allocator, gloo pairs
    times = balanced(lambda i: _round_times(sides[i], steps), len(sides), rounds, warmup=2)
    return Rounds(times, [])


def _agree(sides: dict[str, Callable[[], Any]], steps: int = 3) -> float:
    """Largest parameter difference to DDP after ``steps`` steps from the same init."""
    finals = {}
    for name, fn in sides.items():
        for _ in range(steps):
            out = fn()
        finals[name] = out
    ref = finals["ddp"]
    worst = 0.0
    for params in finals.values():
        for k, v in params.items():
            worst = max(worst, float((v - ref[k]).abs().max()))
    return worst


def _faults(fn: Callable[[], Any], steps: int = 5) -> float:
    """Minor page faults per step on this rank: the price of fresh large allocations."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / steps


def _bench_step(name: str, rounds: int, steps: int, faults: int = 5) -> tuple[Rounds, list[float]]:
    model, x, y = build(name)
    # fresh sides for the agreement check (they train), then fresh ones to time
    check = {
        "ddp": _stateful_side(model, x, y, "ddp"),
        "replicate": _stateful_side(model, x, y, "replicate"),
        "fr": _fr_side(model, x, y),
        "fr_nocheck": _fr_side(model, x, y, check=False),
        "naive": _naive_side(model, x, y),
    }
    worst = _agree(check)
    if worst > 1e-4:
        raise AssertionError(f"{name}: the sides disagree with DDP by {worst:.2e}")
    del check
    sides = [
        _stateful_side(model, x, y, "ddp"),
        _stateful_side(model, x, y, "replicate"),
        _fr_side(model, x, y),
        _fr_side(model, x, y, check=False),
        _naive_side(model, x, y),
    ]
    return _rounds(sides, rounds, steps), [_faults(fn, faults) for fn in sides]


def _bench_all_reduce(rounds: int, steps: int) -> Rounds:
    model, _, _ = build("many_small")
    tree = {k: v.clone() for k, v in fr.state(model).params.items()}
    flat = torch.cat([t.reshape(-1) for t in tree.values()])
    reduced = fr.distributed.all_reduce(tree, op="sum")
    ref = flat.clone()
    dist.all_reduce(ref)
    if not torch.equal(torch.cat([reduced[k].reshape(-1) for k in tree]), ref):
        raise AssertionError("fr.distributed.all_reduce disagrees with dist.all_reduce")
    return _rounds(
        [
            lambda: dist.all_reduce(flat),
            lambda: fr.distributed.all_reduce(tree),
            lambda: fr.distributed.all_reduce(tree, check=False),
        ],
        rounds,
        steps,
    )


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every row's rounds, on this rank (both ranks run it: the sides are collective)."""
    rows: dict[str, Any] = {}
    rows["all_reduce"] = _bench_all_reduce(args.rounds * 2, args.steps * 5)
    rows["ensemble"] = _bench_ensemble(args.rounds, args.steps)
    for name in args.models:
        rows[name] = _bench_step(name, args.rounds, args.steps, args.fault_steps)
    return rows


STEP_SIDES = (
    "DDP",
    "composable replicate",
    "fr.distributed.grad_and_value",
    "fr.distributed, check=False",
    "naive fr, one flat all_reduce",
)


def run(
    quick: bool = False,
    *,
    models: tuple[str, ...] = MODELS,
    rounds: int | None = None,
    steps: int | None = None,
    pin: bool = True,
) -> list[Row]:
    """Spawn the two ranks, run every side on each, and return rank 0's rows."""
    # --quick, a smoke run: the agreement checks (3 steps a side) and every row as in a full run,
    # but each side times 4 steps (2 warm-up) and counts faults over 1, not 12 and 5 (a mid_mlp
    # step takes ~0.15 s on 2 ranks: its 5 sides' 100 steps were half of ``freplicate bench
    # --quick``'s time)
    args = argparse.Namespace(
        models=list(models),
        rounds=rounds or (2 if quick else 15),
        steps=steps or (1 if quick else 3),
        fault_steps=1 if quick else 5,
        pin=pin,
    )
    results = on_two_ranks(_measure, args, pin=pin, group_timeout=120, limit=3600)
    rows = []
    for name in args.models:
        t, faults = results[name]
        for i in range(1, len(STEP_SIDES)):
            measure = f"SGD step: {STEP_SIDES[i]} / DDP"
            target = TARGETS[name] if i == 2 else None
            rows.append(
                Row(NAME, measure, name, t.median(i), t.median(0), t.ratio(i), target, faults[i])
            )
    t = results["all_reduce"]
    flat = "one flat dist.all_reduce"
    for i, side, target in ((1, "", ALL_REDUCE), (2, ", check=False", None)):
        measure = f"fr.distributed.all_reduce (400 leaves){side} / {flat}"
        rows.append(Row(NAME, measure, "many_small", t.median(i), t.median(0), t.ratio(i), target))
    t = results["ensemble"]
    for i, how, target in (
        (1, "vmap of grad_and_value", ENSEMBLE_TARGET),
        (2, "grad_and_value of the vmapped loss", None),
    ):
        measure = f"{how} over {ENSEMBLE} stacked members / {ENSEMBLE} DDP steps"
        rows.append(Row(NAME, measure, "small_mlp", t.median(i), t.median(0), t.ratio(i), target))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=TITLE)
    parser.add_argument("--quick", action="store_true", help="few rounds, for a smoke run")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS)
    two_rank_arguments(parser)
    args = parser.parse_args(argv)
    rows = run(
        args.quick, models=tuple(args.models), rounds=args.rounds, steps=args.steps, pin=args.pin
    )
    show(TITLE, rows)


if __name__ == "__main__":
    main()
