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
balanced orders (``_common.interleave``); lower is faster.

Run: ``.venv/bin/python -m benchmarks.bench_parallel`` (``--quick`` for a
smoke run).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import freplicate as fr

from ._common import MODELS, build, interleave
from ._report import Row, command

NAME = "parallel"
TITLE = (
    "parallel: fr.data_parallel_grad on 1 and 2 CPU replicas beside one torch.func gradient step"
)

Step = Callable[[dict[str, torch.Tensor], torch.Tensor, torch.Tensor], tuple[Any, Any]]


def sides(model: nn.Module) -> dict[str, Step]:
    def fr_loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(fr.apply(model, fr.State(p, {}), x)[0], y)

    def func_loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(torch.func.functional_call(model, p, (x,)), y)

    return {
        "torch.func.grad_and_value": torch.func.grad_and_value(func_loss),
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


def cpu_rows(model_name: str, pairs: int, warmup: int) -> list[Row]:
    model, x, y = build(model_name)
    params = fr.state(model).params
    steps = sides(model)
    check_agree(steps, params, x, y)
    calls = [lambda s=s: s(params, x, y) for s in steps.values()]
    t = interleave(calls, pairs=pairs, warmup=warmup)
    names = list(steps)
    return [
        Row(NAME, f"{names[i]} / {names[0]}", model_name, t.median(i), t.median(0), t.ratio(i))
        for i in (1, 2)
    ]


def cuda_row(model_name: str, pairs: int, warmup: int) -> Row:
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

    t = interleave([stateful, functional], pairs=pairs, warmup=warmup)
    measure = f"fr.data_parallel / nn.DataParallel, fwd+bwd on {len(ids)} GPUs"
    return Row(NAME, measure, model_name, t.median(1), t.median(0), t.ratio(1))


def run(quick: bool = False) -> list[Row]:
    torch.set_num_threads(1)
    pairs, warmup = (2, 1) if quick else (30, 3)
    rows = [r for name in MODELS for r in cpu_rows(name, pairs, warmup)]
    if torch.cuda.is_available():
        rows += [cuda_row(name, pairs, warmup) for name in MODELS]
    return rows


def main(argv: list[str] | None = None) -> None:
    command(TITLE, run, argv)


if __name__ == "__main__":
    main()
