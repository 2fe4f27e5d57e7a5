"""The cost of fr.distributed.all_reduce around the collective, on torch's fake process group.

Run ``.venv/bin/python -m benchmarks.profile_all_reduce``. One process joins
a two-rank *fake* group (torch's testing backend: collectives return at once
and move nothing), so the time of ``fr.distributed.all_reduce`` on the
400-leaf many_small tree is all packing, planning, result making and
bookkeeping; a cProfile of the same calls shows where it goes. This is the
profile behind the 400-leaf row of docs/benchmarks.md (absolute times of
this machine, unlike the ratio benchmarks).
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import timeit

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import freplicate as fr

from ._common import build


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model, _, _ = build("many_small")
        tree = {k: v.clone() for k, v in fr.state(model).params.items()}
        flat = torch.cat([t.reshape(-1) for t in tree.values()])

        def per_call(fn: object, n: int = 2000) -> float:
            for _ in range(50):
                fn()  # type: ignore[operator]
            return statistics.median(timeit.repeat(fn, number=10, repeat=n // 10)) / 10 * 1e6  # type: ignore[arg-type]

        print("fake process group of 2 ranks: collectives do nothing (microseconds a call)")
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
        for _ in range(2000):
            fr.distributed.all_reduce(tree)
        profile.disable()
        print("\ncProfile of 2000 calls (tottime: the function's own time):")
        pstats.Stats(profile).sort_stats("tottime").print_stats(12)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
