"""The command line: freplicate demo, and freplicate bench from a source checkout."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import NoReturn

BENCHMARKS = ("bench_core", "bench_parallel", "bench_distributed")


class _Parser(argparse.ArgumentParser):
    """argparse, with an error as one line (no usage block) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    from ._demo import add_arguments

    parser = _Parser(
        prog="freplicate",
        description="PyTorch module replication as pure functions: the demo and the benchmarks.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,bench}")
    demo = sub.add_parser(
        "demo",
        help="train a digits model with freplicate beside PyTorch's stateful designs",
        description="Train scikit-learn's digits with freplicate beside PyTorch's stateful "
        "designs, from the same initial weights on the same batches, checking after every step "
        "that they agree: (a) fr.data_parallel_grad beside DataParallel's algorithm, "
        "(b) fr.distributed on 2 gloo ranks beside DistributedDataParallel, (c) the fr step "
        "under torch.compile beside the eager one. Prints a table and saves a plot.",
    )
    add_arguments(demo)
    bench = sub.add_parser("bench", help="run the benchmarks of a source checkout (benchmarks/)")
    bench.add_argument("--quick", action="store_true", help="a fast smoke run with few repeats")
    bench.add_argument("names", nargs="*", default=list(BENCHMARKS))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from ._demo import DemoError
        from ._demo import main as demo

        try:
            return demo(args)
        except DemoError as exc:
            print(f"freplicate demo: error: {exc}", file=sys.stderr)
            return 2
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
