"""Before and after: an earlier freplicate's fr.distributed beside this one, interleaved on 2 ranks.

Not a ratio against PyTorch (that is ``bench_distributed``): the figure is
new / old on the same ranks, the same tensors and the same process group,
in balanced orders, so that the machine's drift between two separate runs
of ``bench_distributed`` does not enter it. The earlier package is imported
under another name from a folder given on the command line:

    git worktree add /tmp/fr_old 8b74e40
    mkdir -p /tmp/fr_pkg && cp -r /tmp/fr_old/freplicate /tmp/fr_pkg/freplicate_old
    .venv/bin/python -m benchmarks.ab_distributed --old /tmp/fr_pkg --rounds 20

Rows: ``fr.distributed.all_reduce`` of the 400-leaf many_small tree, and a
full SGD step through ``fr.distributed.grad_and_value`` on each model. Both
packages register ``fr.State`` with ``torch.serialization`` under their own
names, which is harmless here (nothing is saved).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from ._common import balanced, build, on_two_ranks
from .bench_distributed import _round_times


def _packages(old: str) -> tuple[ModuleType, ModuleType]:
    sys.path.insert(0, old)
    return importlib.import_module("freplicate_old"), importlib.import_module("freplicate")


def _sgd_step(fr: Any, name: str) -> Callable[[], None]:
    model, x, y = build(name)
    buffers = fr.state(model).buffers

    def loss_fn(p: dict[str, torch.Tensor]) -> torch.Tensor:
        out, _ = fr.apply(model, fr.State(p, buffers), x)
        return F.cross_entropy(out, y)

    step = fr.distributed.grad_and_value(loss_fn)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def run() -> None:
        nonlocal params
        grads, _ = step(params)
        new = torch._foreach_add(list(params.values()), list(grads.values()), alpha=-0.01)
        params = dict(zip(params, new))

    return run


def _measure(sides: list[Callable[[], None]], steps: int) -> Callable[[int], float]:
    return lambda i: _round_times(sides[i], steps)


def _body(args: argparse.Namespace) -> dict[str, list[list[float]]]:
    old, new = _packages(args.old)
    out = {}
    model, _, _ = build("many_small")
    tree = {k: v.clone() for k, v in new.state(model).params.items()}
    reduce = [lambda: old.distributed.all_reduce(tree), lambda: new.distributed.all_reduce(tree)]
    out["all_reduce (400 leaves)"] = balanced(_measure(reduce, 50), 2, args.rounds * 2, warmup=2)
    for name in args.models:
        sides = [_sgd_step(old, name), _sgd_step(new, name)]
        out[f"SGD step, {name}"] = balanced(_measure(sides, args.steps), 2, args.rounds, warmup=2)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="a folder holding the package freplicate_old")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--models", nargs="*", default=["many_small", "small_mlp", "mid_mlp"])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = on_two_ranks(_body, args, pin=True, group_timeout=300, limit=3600)
    print(f"{'row':28s} {'old ms':>9s} {'new ms':>9s} {'new/old':>8s}")
    for row, times in results.items():
        before = statistics.median(t[0] for t in times) * 1e3
        after = statistics.median(t[1] for t in times) * 1e3
        ratio = statistics.median(t[1] / t[0] for t in times)
        print(f"{row:28s} {before:9.3f} {after:9.3f} {ratio:8.3f}")


if __name__ == "__main__":
    main()
