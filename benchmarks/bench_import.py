"""What ``import freplicate`` costs on top of ``import torch, torch.distributed``.

Every rank, every ``python -m freplicate`` and every spawned test worker
pays it. Fresh interpreters, one a measure: ``import torch, torch.distributed,
freplicate`` beside ``import torch, torch.distributed``, in balanced orders
(A B, B A), the median of the per-round ratios. Nothing of the compiler
(Dynamo, Inductor, DTensor) is imported by freplicate: it loads on first use,
while tracing.

Run: ``.venv/bin/python -m benchmarks.bench_import``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from ._common import balanced
from ._report import Row, show

NAME = "import"
TITLE = "import: import torch, torch.distributed, freplicate / import torch, torch.distributed (fresh interpreters)"
TARGET = 1.10  # issue 16
CODES = ("import torch, torch.distributed", "import torch, torch.distributed, freplicate")


def _seconds(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - start


def run(quick: bool = False, *, rounds: int | None = None) -> list[Row]:
    """One row: the import's ratio (the median of per-round ratios) and both median times."""
    n = rounds or (2 if quick else 16)  # --quick: 6 fresh interpreters (1 warm-up round), not 10
    times = balanced(lambda i: _seconds(CODES[i]), 2, n, warmup=1)
    ratio = statistics.median(t[1] / t[0] for t in times)
    with_fr, torch_only = (statistics.median(t[i] for t in times) for i in (1, 0))
    measure = "import torch, torch.distributed, freplicate / import torch, torch.distributed"
    return [Row(NAME, measure, "-", with_fr, torch_only, ratio, TARGET)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=TITLE)
    parser.add_argument("--quick", action="store_true", help="few rounds, for a smoke run")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args(argv)
    show(TITLE, run(args.quick, rounds=args.rounds))


if __name__ == "__main__":
    main()
