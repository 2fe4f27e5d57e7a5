"""The benchmark models and the measuring method shared by every benchmark.

See ../shared/BENCHMARKS.md: three models (``many_small``, ``small_mlp``,
``mid_mlp``), ``torch.set_num_threads(1)``, interleaved rounds in balanced
orders (A B, B A for two sides), the median of per-round ratios.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import queue
import resource
import shutil
import signal
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from freplicate.testing import init_loopback_group

T = TypeVar("T")

MODELS = ("many_small", "small_mlp", "mid_mlp")
# ZeRO's memory model (issue 24): 8 units (7 x Linear(1536, 1536) + ReLU, then a Linear(1536,
# 1536)), 72 MiB of float32 parameters; not in MODELS, whose benchmarks it would slow down
DEEP_MLP = "deep_mlp"


def build(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """``(model, input, target)`` for one benchmark model, seeded with 0."""
    torch.manual_seed(0)
    if name == "many_small":
        layers: list[nn.Module] = []
        for _ in range(200):
            layers += [nn.Linear(16, 16), nn.Tanh()]
        model: nn.Module = nn.Sequential(*layers)
        x, classes = torch.randn(64, 16), 16
    elif name == "small_mlp":
        model = nn.Sequential(
            nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10)
        )
        x, classes = torch.randn(64, 256), 10
    elif name == "mid_mlp":
        model = nn.Sequential(
            nn.Linear(1024, 2048),
            nn.ReLU(),
            nn.Linear(2048, 2048),
            nn.ReLU(),
            nn.Linear(2048, 2048),
            nn.ReLU(),
            nn.Linear(2048, 10),
        )
        x, classes = torch.randn(64, 1024), 10
    elif name == DEEP_MLP:
        deep: list[nn.Module] = []
        for i in range(8):
            deep += [nn.Linear(1536, 1536)] + ([nn.ReLU()] if i < 7 else [])
        model = nn.Sequential(*deep)
        x, classes = torch.randn(64, 1536), 1536
    else:
        raise ValueError(f"unknown benchmark model {name!r}; expected one of {MODELS}")
    y = torch.randint(0, classes, (x.shape[0],))
    return model, x, y


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclass
class Rounds:
    """Interleaved timings: ``times[r][i]`` is candidate ``i``'s time in round ``r``.

    ``faults[i]`` is candidate ``i``'s minor page faults per call over the
    same rounds (counted around each call, outside its timing).
    """

    times: list[list[float]]
    faults: list[float]

    def ratio(self, i: int, j: int = 0) -> float:
        """The median over rounds of candidate ``i``'s time / candidate ``j``'s in that round."""
        return statistics.median(t[i] / t[j] for t in self.times)

    def median(self, i: int) -> float:
        """Candidate ``i``'s median time, in seconds."""
        return statistics.median(t[i] for t in self.times)


def orders(n: int) -> list[list[int]]:
    """One cycle of round orders for ``n`` sides: a Williams (balanced Latin square) design.

    Over the cycle every side runs in every position equally often, and
    right after every other side equally often. A rotation (A B C, B C A,
    C A B) puts each side after the same other one in every round, and a
    side that runs right after the stateful step finds the caches and the
    allocator as that step left them (a 5% bias measured on small_mlp);
    permutations in lexicographic order put side 0 first for (n-1)! rounds.
    For two sides this is the A B, B A alternation of BENCHMARKS.md.

    >>> orders(2)
    [[0, 1], [1, 0]]
    >>> orders(4)[0], len(orders(3))
    ([0, 1, 3, 2], 6)
    """
    base = [0 if k == 0 else (k + 1) // 2 if k % 2 else n - k // 2 for k in range(n)]
    rows = [[(b + r) % n for b in base] for r in range(n)]
    return rows if n % 2 == 0 else rows + [row[::-1] for row in rows]


def balanced(
    measure: Callable[[int], float], n: int, rounds: int, warmup: int
) -> list[list[float]]:
    """``measure(i)`` of each of ``n`` sides every round, in the orders of :func:`orders`.

    Returns ``times[r][i]``, side ``i``'s figure in round ``r``.
    """
    for _ in range(warmup):
        for i in range(n):
            measure(i)
    cycle = orders(n)
    times = []
    for r in range(rounds):
        t = [0.0] * n
        for i in cycle[r % len(cycle)]:
            t[i] = measure(i)
        times.append(t)
    return times


def interleave(
    candidates: Sequence[Callable[[], object]], *, pairs: int = 30, warmup: int = 3
) -> Rounds:
    """Time every candidate once a round, in balanced orders (:func:`orders`).

    Minor page faults are counted around each call, outside its timing.
    """
    faults = [0] * len(candidates)

    def measure(i: int) -> float:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = timed(candidates[i])
        faults[i] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        return t

    for _ in range(warmup):
        for fn in candidates:
            fn()
    times = balanced(measure, len(candidates), pairs, warmup=0)
    return Rounds(times, [f / pairs for f in faults])


def two_rank_arguments(parser: argparse.ArgumentParser) -> None:
    """The command-line options every two-rank benchmark takes: rounds, steps, pinning."""
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="let the OS place the ranks (default: rank r pinned to core r)",
    )


def on_two_ranks(
    body: Callable[[Any], T], args: Any, *, pin: bool, group_timeout: float, limit: float
) -> T:
    """``body(args)`` on two spawned gloo ranks on 127.0.0.1; rank 0's result.

    Each rank runs one thread, pinned to core ``rank`` when ``pin`` (its gloo
    threads inherit it), in a process group with ``group_timeout`` seconds
    per collective. ``body`` must be a module-level function (spawn pickles
    it). A rank that exits without an answer (a failed agreement check
    raises there) ends the wait at once, and after ``limit`` seconds it ends
    anyway, a late rank first printing its Python stack (SIGUSR1); both
    ranks are always joined or killed, never left hanging.
    """
    tmp = tempfile.mkdtemp(prefix="freplicate-bench-")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = os.path.join(tmp, "store")
    procs = [
        ctx.Process(target=_rank, args=(r, store, body, args, pin, group_timeout, out))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    answered, result, why = False, None, ""
    deadline = time.monotonic() + limit
    try:
        while not answered and time.monotonic() < deadline:
            try:
                result, answered = out.get(timeout=1.0), True
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode is not None]
                if dead and out.empty():
                    why = ", ".join(f"rank {r} exited with code {c}" for r, c in dead)
                    break
        if not answered and not why:
            why = f"no answer within {limit:.0f} s"
            for p in procs:
                if p.pid and p.is_alive() and hasattr(signal, "SIGUSR1"):
                    os.kill(p.pid, signal.SIGUSR1)  # its stack, on this terminal
                    time.sleep(0.5)
    finally:
        for p in procs:
            p.join(timeout=30 if answered else 2)  # a rank that failed: no need to wait
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(tmp, ignore_errors=True)
    if not answered:
        raise RuntimeError(f"two-rank benchmark failed: {why} (see the ranks' output above)")
    return result  # type: ignore[return-value]


def _rank(
    rank: int,
    store: str,
    body: Callable[[Any], Any],
    args: Any,
    pin: bool,
    group_timeout: float,
    out: Any,
) -> None:
    torch.set_num_threads(1)
    if hasattr(signal, "SIGUSR1"):  # a late rank's stack, asked for by ``on_two_ranks``
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    if pin and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    init_loopback_group(store, rank, 2, timeout=group_timeout)
    result = body(args)
    if rank == 0:
        out.put(result)
    dist.barrier()
    dist.destroy_process_group()
