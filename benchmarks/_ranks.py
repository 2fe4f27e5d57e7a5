"""``on_ranks``: ``_common.on_two_ranks`` for any number of gloo ranks (hybrid sharding's 4).

The same contract: ``body(args)`` on ``world`` spawned gloo ranks on 127.0.0.1, one thread
each, rank r pinned to core ``r % cores`` when ``pin`` (4 ranks on 2 cores share them: two a
core), rank 0's result; a rank that exits without an answer ends the wait at once, and after
``limit`` seconds it ends anyway, a late rank first printing its Python stack (SIGUSR1).
"""

from __future__ import annotations

import faulthandler
import os
import queue
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from freplicate.testing import init_loopback_group

T = TypeVar("T")


def on_ranks(
    body: Callable[[Any], T],
    args: Any,
    world: int,
    *,
    pin: bool,
    group_timeout: float,
    limit: float,
) -> T:
    """``body(args)`` on ``world`` spawned gloo ranks; rank 0's result (see the module's text)."""
    tmp = tempfile.mkdtemp(prefix="freplicate-bench-")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = os.path.join(tmp, "store")
    procs = [
        ctx.Process(target=_rank, args=(r, world, store, body, args, pin, group_timeout, out))
        for r in range(world)
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
                    os.kill(p.pid, signal.SIGUSR1)
                    time.sleep(0.5)
    finally:
        for p in procs:
            p.join(timeout=30 if answered else 2)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(tmp, ignore_errors=True)
    if not answered:
        raise RuntimeError(f"{world}-rank benchmark failed: {why} (see the ranks' output above)")
    return result  # type: ignore[return-value]


def _rank(
    rank: int,
    world: int,
    store: str,
    body: Callable[[Any], Any],
    args: Any,
    pin: bool,
    group_timeout: float,
    out: Any,
) -> None:
    torch.set_num_threads(1)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    if pin and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    init_loopback_group(store, rank, world, timeout=group_timeout)
    result = body(args)
    if rank == 0:
        out.put(result)
    dist.barrier()
    dist.destroy_process_group()
