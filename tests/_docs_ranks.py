"""Rank-side code of tests/test_docs.py: run pages' python blocks on 2 gloo ranks.

A page whose code is collective (``fr.distributed``) runs as written on every
rank of a group joined with ``fr.testing.init_loopback_group`` (a file store,
gloo on loopback only, every collective bounded by the group's timeout): the
group stands in for the one ``torchrun`` would give. The parent waits with a
deadline of its own and kills any rank still alive, so a test never hangs.
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from freplicate.testing import init_loopback_group

Page = tuple[str, list[tuple[str, str]]]  # (page, [(where, code), ...])


def _rank_main(
    rank: int, world: int, store: str, pages: list[Page], out: Any, timeout: float
) -> None:
    torch.set_num_threads(1)
    init_loopback_group(store, rank, world, timeout=timeout)
    results: dict[str, str | None] = {}
    for page, code in pages:
        namespace: dict[str, object] = {"__name__": f"docs:{page}"}
        try:
            for where, block in code:
                exec(compile(block, where, "exec"), namespace)
            results[page] = None
        except BaseException:
            results[page] = traceback.format_exc()
    out.put((rank, results))
    dist.destroy_process_group()


def run_on_ranks(
    pages: list[Page], *, world: int = 2, timeout: float = 30.0, deadline: float = 300.0
) -> dict[str, list[str | None]]:
    """``{page: [rank 0's traceback or None, rank 1's, ...]}``; a rank that never reports raises."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="freplicate-docs-")
    store = os.path.join(tmp, "store")
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, store, pages, out, timeout), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got: dict[int, dict[str, str | None]] = {}
    end = time.monotonic() + deadline
    try:
        while len(got) < world and time.monotonic() < end:
            try:
                rank, results = out.get(timeout=0.5)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and out.empty():
                    break
                continue
            got[rank] = results
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, end - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(tmp, ignore_errors=True)
    if len(got) < world:
        raise AssertionError(f"only ranks {sorted(got)} reported back within {deadline} s")
    return {page: [got[r][page] for r in range(world)] for page, _ in pages}
