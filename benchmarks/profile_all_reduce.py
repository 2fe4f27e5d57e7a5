"""The cost of fr.distributed.all_reduce around the collective, on a process group that does nothing.

Run ``.venv/bin/python -m benchmarks.profile_all_reduce`` (``--quick``: 200 calls a figure
and profiled, not 2000, for a smoke run). One process joins
a two-rank group of a backend written here with torch's public extension
API (``dist.ProcessGroup``, ``dist.Backend.register_backend``): collectives
return at once and move nothing, so the time of ``fr.distributed.all_reduce`` on the
400-leaf many_small tree is all packing, planning, result making and
bookkeeping; a cProfile of the same calls shows where it goes. This is the
profile behind the 400-leaf row of docs/benchmarks.md (absolute times of
this machine, unlike the ratio benchmarks).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import timeit
from typing import Any

import torch
import torch.distributed as dist

import freplicate as fr

from ._common import build


class _Done(dist.Work):
    """A collective that has already finished."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class NoOpGroup(dist.ProcessGroup):
    """A process group whose collectives move nothing: each rank keeps its own values.

    A sum lands as every rank's equal values would (its buffer times the
    world size, one pass): the words that end fr's buckets then land as a
    call whose ranks agree, and its check passes.
    """

    def getBackendName(self) -> str:
        return "noop"

    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:
        if opts is None or opts.reduceOp == dist.ReduceOp.SUM:
            for t in tensors:
                t.mul_(self.size())
        return _Done()

    def broadcast(self, tensors: Any, opts: Any = None) -> dist.Work:
        return _Done()

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        for out in outputs:
            for o in out:
                o.copy_(inputs[0])
        return _Done()


def init_noop_group(world_size: int = 2) -> None:
    """Join, as rank 0, a ``world_size``-rank group of ``NoOpGroup`` in this process alone."""
    if "noop" not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            "noop", lambda store, rank, size, timeout: NoOpGroup(rank, size), devices=["cpu"]
        )
    dist.init_process_group("noop", store=dist.HashStore(), rank=0, world_size=world_size)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="fr.distributed.all_reduce, nothing moved")
    parser.add_argument("--quick", action="store_true", help="200 calls, not 2000: a smoke run")
    calls = 200 if parser.parse_args(argv).quick else 2000
    torch.set_num_threads(1)
    init_noop_group()
    try:
        model, _, _ = build("many_small")
        tree = {k: v.clone() for k, v in fr.state(model).params.items()}
        flat = torch.cat([t.reshape(-1) for t in tree.values()])

        def per_call(fn: object, n: int = calls) -> float:
            for _ in range(50):
                fn()  # type: ignore[operator]
            return statistics.median(timeit.repeat(fn, number=10, repeat=n // 10)) / 10 * 1e6  # type: ignore[arg-type]

        print("a process group of 2 ranks whose collectives do nothing (microseconds a call)")
        print(
            f"  dist.all_reduce(flat buffer of 217 KB)         {per_call(lambda: dist.all_reduce(flat)):8.1f}"
        )
        print(
            f"  fr.distributed.all_reduce(400-leaf dict)       {per_call(lambda: fr.distributed.all_reduce(tree)):8.1f}"
        )
        print(
            "  the same, check=False                          "
            f"{per_call(lambda: fr.distributed.all_reduce(tree, check=False)):8.1f}"
        )
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(calls):
            fr.distributed.all_reduce(tree)
        profile.disable()
        print(f"\ncProfile of {calls} calls (tottime: the function's own time):")
        pstats.Stats(profile).sort_stats("tottime").print_stats(12)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
