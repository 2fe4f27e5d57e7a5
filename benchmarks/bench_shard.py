"""ZeRO-2 on 2 gloo ranks: fr.distributed's sharded AdamW step beside DDP's, with memory per rank.

Run ``.venv/bin/python -m benchmarks.bench_shard`` (``--quick`` for a smoke
run; ``--no-compile`` without the compiled side, whose Inductor compile takes
a minute or more per model). Two ranks on 127.0.0.1, one thread each, rank r
pinned to core r, as ``bench_distributed``; the same rounds (every side a few
steps, the sides in balanced orders, the same order on both ranks), a step's
time the slowest rank's, each side's time in a round its median step, the
figure the median over rounds of the per-round ratio. Before timing, every
side trains a few steps from the same init and must reach the parameters of
DDP + ``torch.optim.AdamW``.

Sides of the training step (AdamW, lr 1e-3, weight decay 1e-2, ``F.cross_entropy``):

- ``DDP + AdamW``: ``DistributedDataParallel`` + ``torch.optim.AdamW`` as it
  comes (on CPU its default, the single-tensor loop); every rank holds the
  whole optimizer state;
- ``DDP + ZeRO``: DDP + ``ZeroRedundancyOptimizer(AdamW)`` (ZeRO-1: every rank
  updates the parameters it owns, whole, then broadcasts them);
- ``fr ZeRO-2``: ``fr.distributed.grad_and_value(..., shard=True)`` (the
  gradients reduce-scattered from the backward pass), AdamW on this rank's
  rows only (``torch.optim.AdamW``'s arithmetic in out-of-place foreach ops:
  the same bits), ``fr.distributed.all_gather`` of the new parameters;
- ``fr ZeRO-1``: the same, but the gradients all-reduced whole
  (``fr.distributed.grad_and_value``) and this rank's rows taken
  (``fr.distributed.shard``);
- ``fr ZeRO-2 compiled``: the ZeRO-2 step under ``torch.compile(fullgraph=True)``
  (Inductor), its step count a tensor (AdamW's capturable arithmetic).

And gloo's own collectives on mid_mlp's size (40 MB): ``reduce_scatter_single``
and ``all_gather_single`` beside ``all_reduce``, the price a ZeRO step pays
on this backend (see docs/sharding.md).

Memory, per side and model, each in a fresh pair of ranks holding that side
alone (after 3 warm-up steps): the optimizer state's bytes on each rank (the
tensors of ``torch.optim``'s state, or of the functional state tree), and
the resident set: before the step, and its peak during one step (``VmHWM``,
reset just before through ``/proc/self/clear_refs``), the larger of the two
ranks'. The compiled side's memory is not measured (it would compile in
every job).
"""

from __future__ import annotations

import argparse
import copy
import gc
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import freplicate as fr

from ._common import MODELS, build, on_two_ranks, two_rank_arguments
from ._report import Row, show
from .bench_distributed import _agree, _rounds

NAME = "shard"
TITLE = (
    "shard: ZeRO-2 (AdamW) on 2 gloo ranks, fr.distributed's sharded step beside DDP + "
    "torch.optim.AdamW and DDP + ZeroRedundancyOptimizer(AdamW); a step's time is the slowest "
    "rank's"
)
LR, WD, BETAS, EPS = 1e-3, 1e-2, (0.9, 0.999), 1e-8
# The targets (issue 17), on mid_mlp: fr ZeRO-2 / each stateful side; compiled / DDP + AdamW
TARGETS = {"DDP + AdamW": 1.00, "DDP + ZeroRedundancyOptimizer": 0.80}
COMPILED = 0.90
TARGET_MODEL = "mid_mlp"

Side = Callable[[], dict[str, torch.Tensor]]


def _stateful_side(model: nn.Module, x: torch.Tensor, y: torch.Tensor, kind: str) -> Any:
    """DDP + AdamW (``kind="adamw"``) or + ZeroRedundancyOptimizer(AdamW): ``(step, optimizer)``."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    own = copy.deepcopy(model)
    ddp = DistributedDataParallel(own)
    options: dict[str, Any] = {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WD}
    if kind == "adamw":
        opt: Any = torch.optim.AdamW(own.parameters(), **options)
    else:
        opt = ZeroRedundancyOptimizer(
            own.parameters(), optimizer_class=torch.optim.AdamW, **options
        )

    def step() -> dict[str, torch.Tensor]:
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        return {k: p.detach() for k, p in own.named_parameters()}

    return step, opt


def _adamw(p: Any, g: Any, m: Any, v: Any, step: Any) -> tuple[Any, ...]:
    """AdamW on lists of tensors, out of place. ``step`` an int: ``torch.optim.AdamW``'s
    single-tensor arithmetic (on CPU the foreach ops run its per-tensor kernels: the same bits);
    a float64 tensor: its capturable arithmetic, which a compiled step runs without recompiling."""
    b1, b2 = BETAS
    m = torch._foreach_lerp(m, g, 1 - b1)
    v = torch._foreach_addcmul(torch._foreach_mul(v, b2), g, g, value=1 - b2)
    decayed = torch._foreach_mul(p, 1 - LR * WD)
    if isinstance(step, int):
        step_size = LR / (1 - b1**step)
        denom = torch._foreach_add(
            torch._foreach_div(torch._foreach_sqrt(v), (1 - b2**step) ** 0.5), EPS
        )
        return torch._foreach_addcdiv(decayed, m, denom, value=-step_size), m, v
    neg = (-(LR / (1 - b1**step))).float()
    root = (1 - b2**step).sqrt().float()
    denom = torch._foreach_add(torch._foreach_div(torch._foreach_sqrt(v), root * neg), EPS / neg)
    return torch._foreach_addcdiv(decayed, m, denom), m, v


class Zero2:
    """The ZeRO-2 step of docs/sharding.md: its parameters, this rank's shards and AdamW state.

    ``zero1``: ZeRO-1 instead, the gradients all-reduced whole, then this rank's rows taken.
    """

    def __init__(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, compiled: bool, zero1: bool
    ) -> None:
        s = fr.state(model)
        self.names = list(s.params)
        self.params = {k: v.detach().clone() for k, v in s.params.items()}
        buffers = s.buffers

        def loss_fn(p: dict[str, torch.Tensor]) -> torch.Tensor:
            out, _ = fr.apply(model, fr.State(p, buffers), x)
            return F.cross_entropy(out, y)

        grad_fn = fr.distributed.grad_and_value(loss_fn, shard=not zero1)
        names = self.names

        def step(params: Any, mine: list[Any], m: list[Any], v: list[Any], t: Any) -> Any:
            grads, _ = grad_fn(params)
            if zero1:
                grads = fr.distributed.shard(grads)
            t = t + 1
            mine, m, v = _adamw(mine, [grads[k] for k in names], m, v, t)
            return fr.distributed.all_gather(dict(zip(names, mine)), params), mine, m, v, t

        # dynamic=False: the same step's code on another model would retrace with symbolic
        # sizes, which fr.distributed's traced layout check cannot take (reported)
        self.step = torch.compile(step, fullgraph=True, dynamic=False) if compiled else step
        # fresh tensors, not views of the parameters: a compiled step would guard on the alias
        self.mine = [t.clone() for t in fr.distributed.shard(self.params).values()]
        self.m = [torch.zeros_like(t) for t in self.mine]
        self.v = [torch.zeros_like(t) for t in self.mine]
        self.t: Any = torch.zeros((), dtype=torch.float64) if compiled else 0

    def __call__(self) -> dict[str, torch.Tensor]:
        self.params, self.mine, self.m, self.v, self.t = self.step(
            self.params, self.mine, self.m, self.v, self.t
        )
        return self.params

    def state_bytes(self) -> int:
        return sum(t.nbytes for t in self.m + self.v)


SIDES = (
    "DDP + AdamW",
    "DDP + ZeroRedundancyOptimizer",
    "fr ZeRO-2",
    "fr ZeRO-1",
    "fr ZeRO-2 compiled",
)
COMPILED_SIDE = SIDES[4]


def _side(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[Side, Any]:
    """The side's step, and what holds its optimizer state (for its bytes)."""
    if name == SIDES[0]:
        return _stateful_side(model, x, y, "adamw")  # type: ignore[no-any-return]
    if name == SIDES[1]:
        return _stateful_side(model, x, y, "zero")  # type: ignore[no-any-return]
    side = Zero2(model, x, y, compiled=name == COMPILED_SIDE, zero1=name == SIDES[3])
    return side, side


def _state_bytes(holder: Any) -> int:
    """The optimizer state's bytes on this rank."""
    if isinstance(holder, Zero2):
        return holder.state_bytes()
    opt = getattr(holder, "optim", holder)  # ZeroRedundancyOptimizer's local optimizer
    return sum(
        t.nbytes for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)
    )


def _times(args: argparse.Namespace) -> dict[str, Any]:
    """Every model's rounds, on this rank (both ranks run it: the sides are collective)."""
    out = {}
    sides = [s for s in SIDES if args.compile or s != COMPILED_SIDE]
    for name in args.models:
        model, x, y = build(name)
        steps = [_side(s, model, x, y)[0] for s in sides]
        # the same sides are timed after (a compiled one compiles once): where their
        # parameters are does not change a step's time
        worst = _agree({("ddp" if i == 0 else s): f for i, (s, f) in enumerate(zip(sides, steps))})
        if worst > 1e-4:
            raise AssertionError(f"{name}: the sides disagree with DDP + AdamW by {worst:.2e}")
        out[name] = (sides, _rounds(steps, args.rounds, args.steps))
        del steps
        gc.collect()
    if not args.quick:
        out["collectives"] = _collectives(args.rounds, args.steps)
    return out


def _collectives(rounds: int, steps: int) -> Any:
    """gloo's own collectives on mid_mlp's parameter count: what a ZeRO step pays for them."""
    model, _, _ = build("mid_mlp")
    n = 2 * (sum(p.numel() for p in model.parameters()) // 2)
    world = dist.get_world_size()
    full, part = torch.randn(n), torch.empty(n // world)
    out = torch.empty(n)
    return _rounds(
        [
            lambda: dist.all_reduce(full),
            lambda: dist.reduce_scatter_single(part, full),
            lambda: dist.all_gather_single(out, part),
        ],
        rounds,
        steps,
    )


def _tensor_bytes() -> int:
    """The bytes of every tensor storage the Python objects of this process reach (after a step,
    between steps: what the side keeps, pooled buffers included)."""
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.layout == torch.strided:
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        text = f.read()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M)[1])  # type: ignore[index]


def _memory(args: tuple[str, str]) -> dict[str, Any]:
    """One side alone on this pair of ranks: its state bytes, its resident set around a step."""
    from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401

    name, side_name = args  # imported first: the start is every side's, before its model
    start = _kib("VmRSS")
    model, x, y = build(name)
    step, holder = _side(side_name, model, x, y)
    for _ in range(3):
        step()
    gc.collect()
    before = _kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set starts again from the current one
    step()
    figures = {
        "tensors": _tensor_bytes(),
        "state": _state_bytes(holder),
        "start": start,
        "before": before,
        "peak": _kib("VmHWM"),
    }
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, figures)
    return {"ranks": everyone}


_DETAILS: list[str] = []


def details() -> list[str]:
    """The memory table of the last ``run``, printed after the timings by ``freplicate bench``."""
    return list(_DETAILS)


def _memory_table(memory: dict[tuple[str, str], Any]) -> list[str]:
    from freplicate._demo._table import table

    header = ["memory (per rank)", "model", "optimizer state MB", "of DDP's", "tensors MB"]
    header += ["RSS before step MB", "peak in step MB", "above start MB"]
    body = []
    for (model, side), got in memory.items():
        ranks = got["ranks"]
        ddp = memory[(model, SIDES[0])]["ranks"][0]["state"]
        states = [r["state"] for r in ranks]
        body.append(
            [
                side,
                model,
                " / ".join(f"{s / 2**20:.2f}" for s in states),
                " / ".join(f"{s / ddp:.3f}" for s in states),
                f"{max(r['tensors'] for r in ranks) / 2**20:.0f}",
                f"{max(r['before'] for r in ranks) / 1024:.0f}",
                f"{max(r['peak'] for r in ranks) / 1024:.0f}",
                f"{max(r['peak'] - r['start'] for r in ranks) / 1024:.0f}",
            ]
        )
    lines = table(header, body, "llrrrrrr")
    return [
        "",
        "optimizer state: rank 0 / rank 1; tensors: every storage the process reaches between "
        "steps (pooled buffers too); RSS: before a step, its peak during the step, and that peak "
        "above the rank's RSS before the model was built; the larger rank's",
        *lines,
    ]


def run(
    quick: bool = False,
    *,
    models: tuple[str, ...] | None = None,
    rounds: int | None = None,
    steps: int | None = None,
    pin: bool = True,
    compile: bool | None = None,
) -> list[Row]:
    """Spawn the ranks, time every side on each model, measure memory; rank 0's rows."""
    chosen = models or (("small_mlp",) if quick else MODELS)
    args = argparse.Namespace(
        models=list(chosen),
        rounds=rounds or (3 if quick else 15),
        steps=steps or (2 if quick else 3),
        compile=(not quick) if compile is None else compile,
        quick=quick,
    )
    results = on_two_ranks(_times, args, pin=pin, group_timeout=600, limit=7200)
    measured = (SIDES[0], SIDES[2]) if quick else SIDES[:4]
    memory = {
        (name, side): on_two_ranks(_memory, (name, side), pin=pin, group_timeout=120, limit=600)
        for name in chosen
        for side in measured
    }
    _DETAILS[:] = _memory_table(memory)
    rows = []
    for name in chosen:
        sides, t = results[name]
        fr_i = sides.index(SIDES[2])
        for base in (0, 1):
            target = TARGETS[SIDES[base]] if name == TARGET_MODEL else None
            rows.append(
                Row(NAME, f"AdamW step: fr ZeRO-2 / {SIDES[base]}", name,
                    t.median(fr_i), t.median(base), t.ratio(fr_i, base), target)
            )  # fmt: skip
        if COMPILED_SIDE in sides:
            c = sides.index(COMPILED_SIDE)
            target = COMPILED if name == TARGET_MODEL else None
            rows.append(
                Row(NAME, f"AdamW step: {COMPILED_SIDE} / {SIDES[0]}", name,
                    t.median(c), t.median(0), t.ratio(c, 0), target)
            )  # fmt: skip
        for i in (sides.index(SIDES[3]), 1):
            rows.append(
                Row(NAME, f"AdamW step: {SIDES[i]} / {SIDES[0]}", name,
                    t.median(i), t.median(0), t.ratio(i, 0))
            )  # fmt: skip
    t = results.get("collectives")  # not in a quick run
    if t is not None:
        for i, what in ((1, "dist.reduce_scatter_single"), (2, "dist.all_gather_single")):
            rows.append(
                Row(NAME, f"gloo, mid_mlp's 40 MB: {what} / dist.all_reduce", "mid_mlp",
                    t.median(i), t.median(0), t.ratio(i, 0))
            )  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=TITLE)
    parser.add_argument("--quick", action="store_true", help="few rounds, for a smoke run")
    parser.add_argument("--models", nargs="*", default=None, choices=MODELS)
    parser.add_argument("--no-compile", dest="compile", action="store_false", default=None)
    two_rank_arguments(parser)
    args = parser.parse_args(argv)
    models = tuple(args.models) if args.models else None
    rows = run(
        args.quick, models=models, rounds=args.rounds, steps=args.steps, pin=args.pin,
        compile=args.compile,
    )  # fmt: skip
    show(TITLE, rows)
    print("\n".join(details()))


if __name__ == "__main__":
    main()
