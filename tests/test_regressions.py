"""Regressions found by the property suite (property_tests/), one test per bug, smallest repro.

A bug in code this file's author does not own was first marked
``xfail(strict=True)`` until its owner fixed it (the fix then failed the
suite as an unexpected pass until the mark was removed); both below are fixed.
"""

from __future__ import annotations

import torch
from torch import nn

import freplicate as fr


class _Total(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum()


def test_data_parallel_on_one_device_returns_the_output_as_the_module_does():
    # found by property_tests/test_data_parallel.py::test_data_parallel_equals_the_stateful_oracle;
    # fr.data_parallel used to gather even on one device, turning the 0-dim output into shape (1,)
    torch.manual_seed(0)
    module, x = _Total(), torch.randn(3, 2)
    out, _ = fr.data_parallel(module, fr.state(module), x, devices=["cpu"])
    # nn.DataParallel(module, device_ids=[0]) returns module(*scatter(x)[0]): shape ()
    assert out.shape == module(x).shape == torch.Size([])


_CACHED_LAYOUT_SCRIPT = """
import os, sys, tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import freplicate as fr


def rank_main(rank, store):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=10))
    fr.distributed.all_reduce({"w": torch.ones(2)})  # one layout on both ranks: checked, cached
    tree = {"w": torch.ones(2)} if rank == 0 else {"w": torch.ones(3)}
    try:
        fr.distributed.all_reduce(tree)
        print(f"rank {rank}: reduced mismatched trees", flush=True)
    except ValueError as err:
        print(f"rank {rank}: ValueError {err}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    store = os.path.join(tempfile.mkdtemp(), "store")
    procs = [mp.get_context("spawn").Process(target=rank_main, args=(r, store)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
    print("exit codes", [p.exitcode for p in procs], flush=True)
"""


def test_distributed_mismatch_after_a_cached_layout_raises_on_every_rank(tmp_path):
    # found by property_tests/test_distributed.py, when the mismatch property ran after the
    # all_reduce property had reduced the same layout on both ranks: fr.distributed checked a
    # layout across ranks only the first time it saw it, so rank 0 (layout already checked)
    # reduced while rank 1 ran the check collective, and gloo aborted rank 0 (SIGABRT)
    # Since issue 29 a warm layout is no longer probed again outside the checks' debug mode (its
    # check rides in its buckets): ranks that part ways onto buckets of other sizes after a
    # layout's first use are what the debug mode is for, as the contract says
    import os
    import subprocess
    import sys

    script = tmp_path / "cached_layout.py"
    script.write_text(_CACHED_LAYOUT_SCRIPT)
    env = {**os.environ, "FREPLICATE_DISTRIBUTED_DEBUG": "DETAIL"}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert "rank 0: ValueError fr.distributed.all_reduce" in done.stdout, done.stdout + done.stderr
    assert "rank 1: ValueError fr.distributed.all_reduce" in done.stdout, done.stdout + done.stderr
