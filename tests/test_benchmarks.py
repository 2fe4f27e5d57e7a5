"""``python -m freplicate bench --quick``: every benchmark runs, and its sides agree before timing.

Each benchmark checks its sides against the stateful path (same losses,
gradients, replicas, parameters after a few steps) and raises if they
differ; this smoke run keeps those checks, and the command, working. The
figures it prints are not asserted (speed is measured, never tested).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quick_bench_runs_every_benchmark() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "freplicate", "bench", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for expected in (
        "fr.apply",  # bench_core
        "fr.data_parallel_grad",  # bench_parallel
        "SGD step / DDP step",  # bench_distributed
        "fr.distributed.all_reduce (400 leaves)",
    ):
        assert expected in run.stdout, run.stdout[-3000:]


def test_all_reduce_profile_runs() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.profile_all_reduce"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "fr.distributed.all_reduce(400-leaf dict)" in run.stdout and "tottime" in run.stdout
