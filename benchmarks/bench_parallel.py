"""``fr.data_parallel_grad`` against a single-device ``torch.func`` gradient step.

For each benchmark model (../shared/BENCHMARKS.md) three sides compute the
gradient and loss of ``F.cross_entropy`` on the same batch of 64:

- ``torch.func``: ``torch.func.grad_and_value`` of the loss through
  ``torch.func.functional_call`` on one device (the baseline, 1.00);
- ``fr dpg [cpu]``: ``fr.data_parallel_grad(loss, ["cpu"])``: one replica,
  what the data-parallel machinery costs on top of ``fr.grad_and_value``;
- ``fr dpg [cpu, cpu]``: two replicas of 32 examples each in two Python
  threads (``torch.set_num_threads(1)`` bounds each op to one thread, the
  replicas' ops run side by side), gradients all-reduced (mean).

Before timing, each side runs three SGD steps from the same initial
parameters and must end with the same parameters. On a machine with CUDA,
``fr.data_parallel`` is also timed against ``nn.DataParallel`` (forward and
backward on every GPU). Ratios are the median over interleaved rounds with
the order rotated (``_common.ratios``); lower is faster.

Run: ``.venv/bin/python -m benchmarks.bench_parallel`` (``--quick`` for a
smoke run).
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import freplicate as fr

from ._common import MODELS, build, ratios

Step = Callable[[dict[str, torch.Tensor], torch.Tensor, torch.Tensor], tuple[Any, Any]]


def sides(model: nn.Module) -> dict[str, Step]:
    def fr_loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(fr.apply(model, fr.State(p, {}), x)[0], y)

    def func_loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(torch.func.functional_call(model, p, (x,)), y)

    return {
        "torch.func grad_and_value": torch.func.grad_and_value(func_loss),
        "fr.data_parallel_grad [cpu]": fr.data_parallel_grad(fr_loss, ["cpu"]),
        "fr.data_parallel_grad [cpu, cpu]": fr.data_parallel_grad(fr_loss, ["cpu", "cpu"]),
    }


def sgd(
    step: Step, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, n: int
) -> Any:
    for _ in range(n):
        grads, _ = step(params, x, y)
        params = {k: p - 0.01 * grads[k] for k, p in params.items()}
    return params


def check_agree(steps: dict[str, Step], params: dict[str, torch.Tensor], x: Any, y: Any) -> None:
    results = {name: sgd(step, params, x, y, 3) for name, step in steps.items()}
    ref_name, ref = next(iter(results.items()))
    for name, got in results.items():
        for k in ref:
            if not torch.allclose(got[k], ref[k], rtol=1e-4, atol=1e-6):
                raise SystemExit(f"{name} and {ref_name} disagree at {k!r} after 3 SGD steps")


def cpu_ratios(model_name: str, pairs: int, warmup: int) -> list[float]:
    model, x, y = build(model_name)
    params = fr.state(model).params
    steps = sides(model)
    check_agree(steps, params, x, y)
    calls = [lambda s=s: s(params, x, y) for s in steps.values()]
    return ratios(calls, pairs=pairs, warmup=warmup)


def cuda_ratio(model_name: str, pairs: int, warmup: int) -> float:
    ids = list(range(torch.cuda.device_count()))
    model, x, y = build(model_name)
    model, x, y = model.cuda(), x.cuda(), y.cuda()
    dp = nn.DataParallel(copy.deepcopy(model), device_ids=ids)
    params = {k: v.clone().requires_grad_() for k, v in fr.state(model).params.items()}
    state = fr.State(params, {})

    def stateful() -> None:
        dp.zero_grad(set_to_none=True)
        F.cross_entropy(dp(x), y).backward()
        torch.cuda.synchronize()

    def functional() -> None:
        out, _ = fr.data_parallel(model, state, x, devices=[f"cuda:{i}" for i in ids])
        torch.autograd.grad(F.cross_entropy(out, y), list(params.values()))
        torch.cuda.synchronize()

    return ratios([stateful, functional], pairs=pairs, warmup=warmup)[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few rounds only (smoke run)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pairs, warmup = (3, 1) if args.quick else (30, 3)
    names = list(sides(nn.Linear(1, 1)))
    print("CPU: time of a gradient step relative to torch.func (median of per-round ratios)")
    print(f"{'model':<14}" + "".join(f"{n:>34}" for n in names))
    for model_name in MODELS:
        r = cpu_ratios(model_name, pairs, warmup)
        print(f"{model_name:<14}" + "".join(f"{v:>34.2f}" for v in r))
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        print(f"\nCUDA ({torch.cuda.get_device_name(0)} x {n}): forward + backward,")
        print("time of fr.data_parallel relative to nn.DataParallel")
        for model_name in MODELS:
            print(f"{model_name:<14}{cuda_ratio(model_name, pairs, warmup):>10.2f}")


if __name__ == "__main__":
    main()
