"""The GPT example three ways on 2 ranks, step by step side by side: freplicate with torchopt,
freplicate with the exact AdamW, and DDP; time a step, final losses, how far apart they end.

    .venv/bin/python examples/gpt_compare.py   # then any option of gpt_train.py (--steps 100)

It starts its own 2 gloo ranks on loopback (a file store: nothing listens on
a port) and builds the three runs in each. Their steps are interleaved
(A B C, then B C A, ..., and every other round reversed), each run with its
own random stream swapped in for its step, so that every run computes what
it computes alone (the exact run still equals DDP to the bit) while a load
that changes over time falls alike on the three. A step's time is the
slowest rank's; the ratio to DDP is the median over steps of the per-step
ratios (BENCHMARKS.md's method), the first 5 steps left out.
"""

from __future__ import annotations

import io
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gpt_train import evaluate, parse, start

SIDES = {"fr, torchopt": "--optimizer torchopt", "fr, exact": "--optimizer exact", "DDP": "--ddp"}
WARMUP = 5  # steps left out of the timing


def rank_main(rank: int, store: str, options: list[str], out: Any) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    runs, streams = {}, {}
    for name, opts in SIDES.items():
        runs[name] = start(parse([*options, *opts.split()]), lambda _: None)
        streams[name] = torch.get_rng_state()  # each run's own stream, as start seeded it
    names, steps = list(SIDES), runs["DDP"].config.steps
    ms: dict[str, list[float]] = {name: [] for name in names}
    losses: dict[str, list[float]] = {name: [] for name in names}
    for it in range(steps):
        order = names[it % 3 :] + names[: it % 3]
        for name in order if (it // 3) % 2 == 0 else order[::-1]:
            torch.set_rng_state(streams[name])
            begin = time.perf_counter()
            loss, _ = runs[name].side.step()
            ms[name].append(1e3 * (time.perf_counter() - begin))
            streams[name] = torch.get_rng_state()
            losses[name].append(loss)
    record = {}
    for name, run in runs.items():
        slowest = torch.tensor(ms[name], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        final = evaluate(run.config, run.side, run.data, rank)
        params = {k: p.detach().clone() for k, p in run.side.parameters().items()}
        record[name] = (slowest.tolist(), losses[name][-1], final, params)
    if rank == 0:  # as bytes: a tensor put in the queue as itself dies with this process
        buf = io.BytesIO()
        torch.save(record, buf)
        out.put(buf.getvalue())
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=rank_main, args=(r, store, argv, out)) for r in range(2)]
        for p in procs:
            p.start()
        record = torch.load(io.BytesIO(out.get(timeout=3600)))
        for p in procs:
            p.join()
    ddp_ms, _, _, ddp_params = record["DDP"]
    print(
        "| | ms a step (median) | / DDP (median of per-step ratios; quartiles) | last step's "
        "loss (rank 0) | final eval: train, val | largest parameter difference from DDP |"
    )
    print("|---|---|---|---|---|---|")
    for name, (ms, loss, final, params) in record.items():
        ratios = [a / b for a, b in zip(ms[WARMUP:], ddp_ms[WARMUP:])]
        q1, q2, q3 = statistics.quantiles(ratios, n=4)
        diff = max((params[k] - p).abs().max().item() for k, p in ddp_params.items())
        print(
            f"| {name} | {statistics.median(ms[WARMUP:]):.1f} | {q2:.2f} ({q1:.2f}-{q3:.2f}) | "
            f"{loss:.4f} | {final['train']:.4f}, {final['val']:.4f} | {diff:.1e} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
