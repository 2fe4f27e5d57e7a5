"""The GPT example's training step compiled, on 2 gloo ranks: its compile time and step time.

The example's step (``examples/gpt_train.py``: two micro-batches
accumulated, clipping, AdamW with ``torch.optim.AdamW``'s arithmetic) three
ways, each in fresh processes from a cold cache (Inductor's FX graph and
autograd caches off, an empty cache directory):

* ``torch.compile(DDP(model))``, the DDP side (``no_sync`` for the first
  micro-batch; clipping and the optimizer eager): the baseline;
* fr, the loss compiled (``fr.distributed.grad_and_value(torch.compile(loss))``):
  the same work compiled as DDP's, the buckets from the backward pass;
* fr, the whole step compiled (``torch.compile(step)``: both micro-batches'
  forward and backward, the collectives, clipping and AdamW in one graph).

A configuration's compile time is its first step's seconds minus a warm
step's (the slowest rank's); its step time the median of warm steps. The
rows give both ratios to DDP's; the target is issue 18's, on the loss
compiled (the example's ``--compile``). Dynamo's, AOT autograd's and
Inductor's shares of each compile come from ``torch._dynamo.utils.compile_times``.

Run: ``.venv/bin/python -m benchmarks.bench_example`` (minutes of compiling;
``--quick``: a one-layer model).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ._common import on_two_ranks
from ._report import Row, show

NAME = "example"
TITLE = (
    "example: the GPT example's step compiled on 2 gloo ranks (Inductor, cold caches), "
    "freplicate's beside torch.compile(DDP)"
)
TARGET = 1.5  # compile time of the example's step, fr / DDP (issue 18)
SIDES = ("ddp", "fr_loss", "fr_whole")
LABELS = {
    "ddp": "torch.compile(DDP(model))",
    "fr_loss": "fr, the loss compiled",
    "fr_whole": "fr, the whole step compiled",
}
_EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _phases() -> dict[str, float]:
    """Seconds in Dynamo's tracing, AOT autograd and Inductor, from Dynamo's own counters."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    table = dict(zip(names, values))
    keys = {
        "dynamo": "bytecode_tracing",
        "aot": "create_aot_dispatcher_function",
        "inductor": "fx_codegen_and_compile",
    }
    return {k: float(table.get(v, 0.0)) for k, v in keys.items()}


def _one(args: Any) -> dict[str, Any]:
    """One configuration on this rank: first and warm step seconds (the slowest rank's)."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="freplicate-inductor-")
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False
    sys.path.insert(0, str(_EXAMPLES))
    step = _step(args.side, args.quick)
    dist.barrier()
    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    warm = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        warm.append(time.perf_counter() - start)
    times = torch.tensor([first, statistics.median(warm)], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {"first": times[0].item(), "warm": times[1].item(), "phases": _phases()}


def _step(side: str, quick: bool) -> Any:
    """The example's step for ``side``, on fixed micro-batches (warm steps repeat one step)."""
    import gpt_train as G
    from gpt_model import GPT, GPTConfig

    import freplicate as fr

    sizes = {"n_layer": 1, "n_embd": 32} if quick else {}
    config = G.Config(optimizer="exact", **sizes)
    rank = dist.get_rank()
    data = G.Data(config, rank, dist.get_world_size())
    torch.manual_seed(config.seed)
    shape = GPTConfig(
        vocab_size=len(data.vocab),
        block_size=config.block_size,
        n_layer=config.n_layer,
        n_head=config.n_head,
        n_embd=config.n_embd,
        dropout=config.dropout,
    )
    model = GPT(shape)
    torch.manual_seed(config.seed + 1 + rank)
    micro = [data.batch() for _ in range(config.accumulate)]
    if side == "ddp":
        stateful = G.Stateful(config, model, data)
        stateful.ddp = torch.compile(stateful.ddp)

        class Fixed:
            def __init__(self) -> None:
                self.left = list(micro)

            def batch(self) -> Any:
                return self.left.pop(0)

        def ddp_step() -> Any:
            stateful.data = Fixed()  # type: ignore[assignment]
            return stateful.step()

        return ddp_step
    f = G.Functional(config, model, data)
    if side == "fr_loss":
        f.grad = fr.distributed.grad_and_value(torch.compile(f.loss))

    def fr_step(params: Any, opt: Any, micro: Any) -> Any:
        grads, losses = f.grad.accumulate(params, micro)
        grads, norm = fr.clip_grad_norm(grads, config.clip)
        return f.update(params, grads, opt), losses, norm

    run = torch.compile(fr_step) if side == "fr_whole" else fr_step
    return lambda: run(f.params, f.opt_state, list(micro))


def run(quick: bool = False, *, steps: int | None = None, pin: bool = True) -> list[Row]:
    results = {}
    for side in SIDES:
        args = argparse.Namespace(side=side, quick=quick, steps=steps or (2 if quick else 5))
        results[side] = on_two_ranks(_one, args, pin=pin, group_timeout=1800, limit=3600)
    ddp = results["ddp"]
    ddp_compile = ddp["first"] - ddp["warm"]
    rows = []
    for side in SIDES[1:]:
        got = results[side]
        compile_s = got["first"] - got["warm"]
        target = TARGET if side == "fr_loss" else None
        measure = f"compile time of the example's step: {LABELS[side]} / {LABELS['ddp']}"
        rows.append(Row(NAME, measure, "gpt", compile_s, ddp_compile, compile_s / ddp_compile, target))
        measure = f"step time, compiled: {LABELS[side]} / {LABELS['ddp']}"
        rows.append(Row(NAME, measure, "gpt", got["warm"], ddp["warm"], got["warm"] / ddp["warm"]))
    for side in SIDES:
        phases = results[side]["phases"]
        shares = ", ".join(f"{k} {v:.1f} s" for k, v in phases.items())
        print(f"{LABELS[side]}: compile {results[side]['first'] - results[side]['warm']:.1f} s ({shares})")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=TITLE)
    parser.add_argument("--quick", action="store_true", help="a one-layer model, few steps")
    parser.add_argument("--steps", type=int, default=None, help="warm steps timed")
    parser.add_argument("--no-pin", dest="pin", action="store_false")
    args = parser.parse_args(argv)
    show(TITLE, run(args.quick, steps=args.steps, pin=args.pin))


if __name__ == "__main__":
    main()
