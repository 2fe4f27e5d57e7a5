"""The demo's command-line options, checked up front so that a bad one is a one-line error."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from ._data import MODELS

MAX_CPU_DEVICES = 8


class DemoError(ValueError):
    """A bad option: the command line prints its message as one line and exits with status 2."""


@dataclass(frozen=True)
class Options:
    devices: tuple[str, ...]
    epochs: int = 10
    steps: int | None = None
    batch_size: int = 64
    lr: float = 3e-3
    model: str = "mlp"
    dtype: str = "float64"
    distributed: bool = True
    compile: bool = True
    out: Path = Path("demo_out")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)  # type: ignore[no-any-return]

    def describe_devices(self) -> str:
        """``3 x cpu`` for one device named several times, else the names."""
        if len(set(self.devices)) == 1 and len(self.devices) > 1:
            return f"{len(self.devices)} x {self.devices[0]}"
        return ", ".join(self.devices)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--devices",
        nargs="+",
        default=None,
        metavar="DEVICE",
        help="the replicas' devices for path (a), e.g. cpu cpu cpu or cuda:0 cuda:1 "
        "(default: every CUDA device if there are 2 or more, else cpu cpu)",
    )
    parser.add_argument(
        "--epochs", type=int, default=10, help="passes over the training set (default 10)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="at most this many steps per epoch (default: all)"
    )
    parser.add_argument("--batch-size", type=int, default=64, help="examples per step (default 64)")
    parser.add_argument(
        "--lr", type=float, default=3e-3, help="AdamW's learning rate (default 3e-3)"
    )
    parser.add_argument("--model", choices=MODELS, default="mlp", help="the network (default mlp)")
    parser.add_argument(
        "--dtype",
        choices=("float64", "float32"),
        default="float64",
        help="float64 (default): rounding stays ~1e-15, so the sides must agree to 1e-9 over "
        "the whole run; float32: to 1e-5, where a max-pooling CNN may drift apart after "
        "many steps (a near tie broken the other way)",
    )
    parser.add_argument(
        "--distributed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="path (b): 2 gloo ranks beside DistributedDataParallel (default on)",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="path (c): the fr step on one device under torch.compile beside the same step "
        "eager (default on; compiling takes 5-20 s here, and a compile that fails or runs past "
        "60 s is reported as skipped)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("demo_out"),
        metavar="DIR",
        help="where the plot goes (default demo_out)",
    )


def parse_devices(specs: list[str] | None) -> tuple[str, ...]:
    """Device names as the demo uses them (``cpu``, ``cuda:N``), or a DemoError saying what is wrong."""
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if specs is None:
        return tuple(f"cuda:{i}" for i in range(cuda)) if cuda >= 2 else ("cpu", "cpu")
    names = [s for spec in specs for s in spec.split(",") if s]
    if not names:
        raise DemoError("--devices: give at least one device, e.g. --devices cpu cpu")
    devices = []
    for name in names:
        kind, _, index = name.partition(":")
        if name.isdigit():
            kind, index = "cuda", name
        if kind == "cpu" and not index:
            devices.append("cpu")
            continue
        if kind != "cuda" or not (index.isdigit() or not index):
            raise DemoError(
                f"--devices: unknown device {name!r}; use cpu, cuda:N or a CUDA index N"
            )
        if not cuda:
            raise DemoError(
                f"--devices: {name!r} needs CUDA, which is not available here; try --devices cpu cpu"
            )
        i = int(index or torch.cuda.current_device())
        if i >= cuda:
            raise DemoError(
                f"--devices: {name!r}: this machine has {cuda} CUDA device(s), cuda:0 to cuda:{cuda - 1}"
            )
        devices.append(f"cuda:{i}")
    cpus = devices.count("cpu")
    if cpus > MAX_CPU_DEVICES:
        raise DemoError(
            f"--devices: at most {MAX_CPU_DEVICES} CPU devices (got {cpus}): every CPU replica "
            "is a thread on this machine's cores, more only measure the threads' overhead"
        )
    return tuple(devices)


def options_from(args: argparse.Namespace) -> Options:
    for name in ("epochs", "steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise DemoError(f"--{name.replace('_', '-')} must be at least 1 (got {value})")
    if args.batch_size < 2:
        raise DemoError(
            f"--batch-size must be at least 2, one example per rank (got {args.batch_size})"
        )
    if not args.lr > 0:
        raise DemoError(f"--lr must be positive (got {args.lr})")
    return Options(
        devices=parse_devices(args.devices),
        epochs=args.epochs,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        model=args.model,
        dtype=args.dtype,
        distributed=args.distributed,
        compile=args.compile,
        out=args.out,
    )
