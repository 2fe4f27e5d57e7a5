"""The GPT example three ways on 2 ranks, side by side: freplicate with torchopt, freplicate
with the exact AdamW, and DDP; per-step time, final losses, and how far apart they end.

    .venv/bin/python examples/gpt_compare.py --rounds 3   # then any option of gpt_train.py

It starts its own 2 gloo ranks on loopback (a file store: nothing listens on
a port) and runs every side once a round, in an order that turns from round to
round. A step's time is the slowest rank's; a run's time is the median over
its steps after the first 5; a side's figure is the median over rounds, and the
ratio to DDP the median of the rounds' ratios (BENCHMARKS.md's method).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gpt_train import Config, parse, train

SIDES = {"fr, torchopt": "--optimizer torchopt", "fr, exact": "--optimizer exact", "DDP": "--ddp"}
WARMUP = 5  # steps left out of the timing


def rank_main(rank: int, store: str, options: list[str], rounds: int, out: Any) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    names = list(SIDES)
    record: dict[str, Any] = {name: {"ms": [], "run": None} for name in names}
    for r in range(rounds):
        order = names[r % 3 :] + names[: r % 3]
        for name in order if r % 2 == 0 else order[::-1]:
            config: Config = parse([*options, *SIDES[name].split()])
            run = train(config, log=None)
            slowest = torch.tensor(run["ms"][WARMUP:], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            record[name]["ms"].append(statistics.median(slowest.tolist()))
            record[name]["run"] = run
    if rank == 0:  # as bytes: a tensor put in the queue as itself dies with this process
        buf = io.BytesIO()
        torch.save({name: (v["ms"], v["run"]) for name, v in record.items()}, buf)
        out.put(buf.getvalue())
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    ours, options = parser.parse_known_args(argv)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=rank_main, args=(r, store, options, ours.rounds, out))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        record = torch.load(io.BytesIO(out.get(timeout=3600)))
        for p in procs:
            p.join()
    ddp_ms, ddp = record["DDP"]
    print(
        f"| | ms a step (median of {ours.rounds} rounds) | / DDP | final train loss "
        "(rank 0) | eval train, val | largest parameter difference from DDP |"
    )
    print("|---|---|---|---|---|---|")
    for name, (ms, run) in record.items():
        ratio = statistics.median(a / b for a, b in zip(ms, ddp_ms))
        diff = max((run["params"][k] - p).abs().max().item() for k, p in ddp["params"].items())
        _, train_loss, val_loss = run["eval"][-1]
        print(
            f"| {name} | {statistics.median(ms):.1f} | {ratio:.2f} | {run['loss'][-1]:.4f} | "
            f"{train_loss:.4f}, {val_loss:.4f} | {diff:.1e} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
