"""The command line: ``python -m freplicate demo`` (and ``bench`` from a source checkout)."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

BENCHMARKS = ("bench_core", "bench_parallel", "bench_distributed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="freplicate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="functional data-parallel training beside the stateful path")
    d.add_argument("--steps", type=int, default=5)
    d.add_argument("--devices", nargs="+", default=None, help="e.g. cpu cpu, or cuda:0 cuda:1")
    b = sub.add_parser("bench", help="run the benchmarks of a source checkout (benchmarks/)")
    b.add_argument("--quick", action="store_true", help="a fast smoke run with few repeats")
    b.add_argument("names", nargs="*", default=list(BENCHMARKS))
    args = parser.parse_args(argv)

    if args.command == "demo":
        from ._demo import demo

        return 0 if demo(steps=args.steps, devices=args.devices) else 1

    root = Path(__file__).resolve().parent.parent
    if not (root / "benchmarks" / "_common.py").exists():
        print("freplicate bench: run it from a source checkout (benchmarks/ is not installed)")
        return 2
    sys.path.insert(0, str(root))
    for name in args.names:
        # imported, not run as __main__: spawned ranks must find their worker by module name
        module = importlib.import_module(f"benchmarks.{name}")
        sys.argv = [name] + (["--quick"] if args.quick else [])
        module.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
