"""The command line: freplicate demo, and freplicate bench from a source checkout."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import NoReturn

# benchmarks/bench_<name>.py
BENCHMARKS = (
    "core", "parallel", "distributed", "import", "compile", "example", "shard", "reproducible",
)  # fmt: skip
# compile, example, shard and reproducible take minutes (of compiling; shard also spawns ranks
# for memory figures, reproducible 2 and then 4 ranks): run them by name
DEFAULT = ("core", "parallel", "distributed", "import")


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
    bench = sub.add_parser(
        "bench",
        help="time freplicate beside the stateful designs (from a source checkout)",
        description="Time freplicate beside PyTorch's stateful designs and torch.func, side by "
        "side in interleaved rounds, after checking that both sides agree. Prints, per "
        "benchmark, each measure's absolute times beside its ratio and, where the project set "
        "one, its target (met or missed), and saves a plot of the ratios against their targets. "
        "Needs the benchmarks/ folder of a source checkout.",
    )
    bench.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help=f"the benchmarks to run: {', '.join(BENCHMARKS)} (default: {', '.join(DEFAULT)})",
    )
    bench.add_argument("--quick", action="store_true", help="a smoke run with few rounds")
    bench.add_argument(
        "--out",
        type=Path,
        default=Path("bench_out"),
        help="where the plot goes (default bench_out)",
    )
    return parser


def _bench(args: argparse.Namespace) -> int:
    names = [n.removeprefix("bench_") for n in args.names] or list(DEFAULT)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(
            f"freplicate bench: error: unknown benchmark {unknown[0]!r}; "
            f"choose from {', '.join(BENCHMARKS)}",
            file=sys.stderr,
        )
        return 2
    root = Path(__file__).resolve().parent.parent
    if not (root / "benchmarks" / "_report.py").exists():
        print(
            "freplicate bench: error: benchmarks/ is not installed; run it from a source checkout",
            file=sys.stderr,
        )
        return 2
    sys.path.insert(0, str(root))
    # imported, not run as __main__: spawned ranks must find their worker by module name
    report = importlib.import_module("benchmarks._report")
    print(report.machine())
    print(report.LEGEND)
    rows = []
    for name in names:
        module = importlib.import_module(f"benchmarks.bench_{name}")
        got = module.run(quick=args.quick)
        print(f"\n{module.TITLE}")
        print("\n".join(report.lines(got)), flush=True)
        if hasattr(module, "details"):  # what is no ratio of times (bench_shard's memory)
            print("\n".join(module.details()), flush=True)
        rows += got
    print()
    print("\n".join(report.summary(rows)))
    print(f"plot: {report.plot(rows, args.out / 'ratios.png')}")
    if args.quick:
        print("(--quick: a smoke run of few rounds, not a measurement)")
    return 0


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
    return _bench(args)


if __name__ == "__main__":
    sys.exit(main())
