"""What the reproducible mode costs: ``grad_and_value(grain=G)`` beside the default step.

Run ``.venv/bin/python -m benchmarks.bench_reproducible`` (``--quick`` for a
short run). On 2 and on 4 gloo ranks (127.0.0.1, one thread each; 4 ranks on
this machine's 2 cores share them), each rank with the benchmark model's
batch (64 samples), interleaved rounds of: the default
``fr.distributed.grad_and_value`` step, and the reproducible one with grains
of 8, 32 and 64 samples (8, 2 and 1 grains a rank); then ZeRO-2
(``shard=True``) by default and with grains of 8; then ZeRO-3 (the loss
through ``apply_sharded``, a unit per Linear, on this rank's shards:
``fr.grad_and_value`` by default, ``fr.distributed.grad_and_value(grain=8)``)
by default and with grains of 8. A step's time is the
slowest rank's, the figure the median over rounds of the per-round ratio
(``bench_distributed``'s method). Before timing, each reproducible step's
gradients must be the default's within float32's rounding (another
summation order). Besides the times, ``details`` gives the bytes a rank
sends in one reproducible step (its ``send``/``recv`` exchanges and
``all_to_all`` blocks to other ranks, counted) over a ring all-reduce's
``2 n (W - 1) / W`` (ZeRO-2 and ZeRO-3: a ring reduce-scatter's,
``n (W - 1) / W``; ZeRO-3 sends one a grain).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import freplicate as fr
from freplicate._distributed import _reproducible

from ._common import build, two_rank_arguments
from ._ranks import on_ranks
from ._report import Row, show
from .bench_distributed import _rounds

NAME = "reproducible"
TITLE = (
    "reproducible: fr.distributed.grad_and_value(grain=G) beside the default step, on 2 and 4 "
    "gloo ranks (64 samples a rank); a step's time is the slowest rank's"
)
MODEL = "mid_mlp"
GRAINS = (8, 32, 64)
WORLDS = (2, 4)
TARGET = 1.25  # issue 31: grains of 8 on mid_mlp, the step / the default's
BYTES_TARGET = 1.05
_DETAILS: list[str] = []


#: the step's kinds: the gradient all-reduced, ZeRO-2's rows, ZeRO-3's (through apply_sharded)
MODES = ("all-reduce", "ZeRO-2", "ZeRO-3")


def _steps(mode: str, grains: tuple[int | None, ...]) -> list[Callable[[], Any]]:
    """The default step (``None``) and one per grain, each on this rank's batch."""
    model, x, y = build(MODEL)
    s = fr.state(model)
    params = {k: v.detach().clone() for k, v in s.params.items()}
    units = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out, _ = fr.apply(model, fr.State(p, s.buffers), x)
        return F.cross_entropy(out, y)

    def sharded(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out, _ = fr.distributed.apply_sharded(model, fr.State(p, s.buffers), x, units=units)
        return F.cross_entropy(out, y)

    out = []
    for grain in grains:
        if mode == "ZeRO-3":
            shards = fr.distributed.shard(params)
            zero3 = (
                fr.grad_and_value(sharded)
                if grain is None
                else fr.distributed.grad_and_value(sharded, grain=grain)
            )
            out.append(lambda step=zero3, shards=shards: step(shards, x, y)[0])
            continue
        options = {} if grain is None else {"grain": grain}
        step = fr.distributed.grad_and_value(loss, shard=mode == "ZeRO-2", **options)
        out.append(lambda step=step: step(params, x, y)[0])
    return out


def sent_by(step: Callable[[], Any]) -> int:
    """Bytes this rank sends to other ranks in one call of ``step`` (the mode's exchanges and
    all-to-alls, counted; the tests count with it too)."""
    counted = [0]
    exchange, all_to_all = _reproducible.exchange, _reproducible.all_to_all

    def counting(send: torch.Tensor, *args: Any) -> None:
        counted[0] += send.numel() * send.element_size()
        exchange(send, *args)

    def to_all(send: torch.Tensor, recv: torch.Tensor, group: Any, caller: str) -> None:
        world = dist.get_world_size(group)  # its own block stays
        counted[0] += send.numel() * send.element_size() * (world - 1) // world
        all_to_all(send, recv, group, caller)

    _reproducible.exchange = counting  # type: ignore[assignment]
    _reproducible.all_to_all = to_all  # type: ignore[assignment]
    try:
        step()
    finally:
        _reproducible.exchange = exchange  # type: ignore[assignment]
        _reproducible.all_to_all = all_to_all  # type: ignore[assignment]
    return counted[0]


def _grains(mode: str) -> tuple[int, ...]:
    return GRAINS if mode == "all-reduce" else GRAINS[:1]


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    """On every rank: the rounds of each mode's sides, and the bytes sent."""
    torch.set_num_threads(1)
    world = dist.get_world_size()
    out: dict[str, Any] = {}
    for mode in MODES:
        sides = _steps(mode, (None, *_grains(mode)))
        default = sides[0]()
        for step in sides[1:]:  # another summation order: float32's rounding apart
            fr.testing.assert_trees_close(step(), default, rtol=1e-3, atol=1e-6)
        rows = mode != "all-reduce"  # the gradients are this rank's rows: n is W times theirs
        n = sum(g.numel() * g.element_size() for g in default.values()) * (world if rows else 1)
        ring = (1 if rows else 2) * n * (world - 1) // world
        out[mode] = {
            "rounds": _rounds(sides, args.rounds, args.steps),
            "sent": [sent_by(step) for step in sides[1:]],
            "ring": ring,
        }
    return out


def run(
    quick: bool = False,
    *,
    rounds: int | None = None,
    steps: int | None = None,
    pin: bool = True,
) -> list[Row]:
    """Each world size's ranks, every side on each; rank 0's rows (the bytes in ``details``)."""
    args = argparse.Namespace(rounds=rounds or (3 if quick else 10), steps=steps or 2)
    rows: list[Row] = []
    _DETAILS[:] = []
    for world in WORLDS:
        got = on_ranks(_measure, args, world, pin=pin, group_timeout=300, limit=3600)
        for mode in MODES:
            part = got[mode]
            t = part["rounds"]
            what = {"all-reduce": "", "ZeRO-2": "ZeRO-2 (shard=True) "}.get(mode, f"{mode} ")
            for i, grain in enumerate(_grains(mode), start=1):
                target = TARGET if grain == 8 and mode == "all-reduce" else None
                measure = f"{what}grain={grain} / the default step, {world} ranks"
                rows.append(Row(NAME, measure, MODEL, t.median(i), t.median(0), t.ratio(i), target))
                ratio = part["sent"][i - 1] / part["ring"]
                kind = "all-reduce" if mode == "all-reduce" else "reduce-scatter"
                status = "met" if round(ratio, 3) <= BYTES_TARGET else "missed"
                if mode == "ZeRO-3":  # one reduce-scatter a grain, by design
                    status = f"{64 // grain} grains a rank: one a grain"
                _DETAILS.append(
                    f"bytes sent by a rank, {what}grain={grain}, {world} ranks: "
                    f"{part['sent'][i - 1]:,} / a ring {kind}'s {part['ring']:,} = {ratio:.3f} "
                    f"(target <= {BYTES_TARGET:.2f}: {status})"
                )
    return rows


def details() -> list[str]:
    """The bytes on the wire of the last ``run`` (``freplicate bench`` prints them)."""
    return list(_DETAILS)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=TITLE)
    parser.add_argument("--quick", action="store_true", help="few rounds, for a smoke run")
    two_rank_arguments(parser)
    args = parser.parse_args(argv)
    show(TITLE, run(args.quick, rounds=args.rounds, steps=args.steps, pin=args.pin))
    print("\n".join(details()))


if __name__ == "__main__":
    main()
