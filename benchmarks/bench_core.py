"""The core against the stateful module and ``torch.func``: forward, gradient, replication.

For each benchmark model (../shared/BENCHMARKS.md), three groups of sides,
each group timed in one interleaved run (every round runs every side, the
order rotated; a ratio is the median over rounds of the per-round ratio):

- forward, under ``torch.no_grad()``: ``module(x)`` (the baseline, 1.00),
  ``fr.apply(module, state, x)``, ``torch.func.functional_call``;
- gradient of ``F.cross_entropy``: the stateful step
  (``zero_grad(set_to_none=True)``, forward, ``loss.backward()``; the
  baseline), ``fr.grad_and_value`` and ``torch.func.grad_and_value`` of the
  same loss through ``fr.apply``, and ``torch.autograd.grad`` through
  ``functional_call`` (fresh leaves each call) as a reference; the target
  ratio ``fr / torch.func`` is printed from the same rounds;
- replication: four ``copy.deepcopy(module)`` (the baseline) and
  ``fr.replicate(state, ["cpu"] * 4)``.

Before timing, the sides of each group must agree (outputs, gradients and
losses, replicated values). Lower is faster. The minor page faults of each
gradient side are printed too: where a side returns fresh gradients of
several MB, glibc maps new pages for them on every call, and the kernel's
zeroing of those pages can cost more than the arithmetic.

Run: ``.venv/bin/python -m benchmarks.bench_core`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import copy
import resource
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import freplicate as fr

from ._common import MODELS, build, row, timed

TARGETS = {
    "fr.apply / module(x)": "<= 1.10 (many_small, small_mlp)",
    "fr.grad_and_value / torch.func": "<= 0.60 (many_small)",
    "fr.grad_and_value / stateful": "<= 1.15 (worst model)",
    "fr.replicate / deepcopy": "<= 0.01",
}


def round_times(
    candidates: Sequence[Callable[[], object]], *, pairs: int, warmup: int
) -> tuple[list[list[float]], list[float]]:
    """``times[r][i]``: candidate ``i``'s time in round ``r``, the order rotated each round.

    ``_common.ratios`` gives ratios to one baseline; these rounds also give the
    ratio of any two sides measured side by side. Also returns each candidate's
    minor page faults per call over the same rounds (counted outside the timing).
    """
    n = len(candidates)
    for _ in range(warmup):
        for fn in candidates:
            fn()
    times = []
    faults = [0] * n
    for r in range(pairs):
        t = [0.0] * n
        for k in range(n):
            i = (r + k) % n
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t[i] = timed(candidates[i])
            faults[i] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        times.append(t)
    return times, [f / pairs for f in faults]


def median_ratio(times: list[list[float]], i: int, j: int) -> float:
    return statistics.median(t[i] / t[j] for t in times)


def check(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"bench_core: the sides disagree: {what}")


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def forward_sides(model: nn.Module, x: torch.Tensor) -> list[Callable[[], Any]]:
    s = fr.state(model)
    flat = {**s.params, **s.buffers}
    sides = [
        lambda: model(x),
        lambda: fr.apply(model, s, x)[0],
        lambda: torch.func.functional_call(model, flat, (x,)),
    ]
    with torch.no_grad():
        ref = sides[0]()
        for name, side in zip(("fr.apply", "functional_call"), sides[1:]):
            check(torch.equal(side(), ref), f"forward: {name} != module(x)")
    return sides


def keep_last(side: Callable[[], Any]) -> Callable[[], Any]:
    """Hold a side's last result until its next call, as the stateful side holds ``.grad``.

    The stateful step frees its previous gradients (``zero_grad(set_to_none=True)``)
    and keeps the new ones in the module until its next call; a training loop
    keeps a functional step's gradients just as long. Dropping them at once
    instead would give the two sides different heap histories (and page faults).
    """
    last: list[Any] = []

    def run() -> Any:
        last.clear()
        last.append(side())
        return last[0]

    return run


def grad_sides(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[Callable[[], Any]]:
    s = fr.state(model)

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(fr.apply(model, fr.State(p, s.buffers), x)[0], y)

    fr_g = fr.grad_and_value(loss)
    func_g = torch.func.grad_and_value(loss)
    names = list(s.params)

    def stateful() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        model.zero_grad(set_to_none=True)
        value = F.cross_entropy(model(x), y)
        value.backward()
        return {k: p.grad for k, p in model.named_parameters()}, value.detach()  # type: ignore[misc]

    def autograd_fc() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        leaves = {k: v.detach().requires_grad_() for k, v in s.params.items()}
        value = F.cross_entropy(torch.func.functional_call(model, leaves, (x,)), y)
        grads = torch.autograd.grad(value, list(leaves.values()))
        return dict(zip(names, grads)), value.detach()

    sides = [
        stateful,
        keep_last(lambda: fr_g(s.params, x, y)),
        keep_last(lambda: func_g(s.params, x, y)),
        keep_last(autograd_fc),
    ]
    ref_grads, ref_value = stateful()
    ref_grads = {k: g.clone() for k, g in ref_grads.items()}
    for name, side in zip(("fr", "torch.func", "autograd+fc"), sides[1:]):
        grads, value = side()
        check(close(value, ref_value), f"gradient: {name} loss")
        for k in names:
            check(close(grads[k], ref_grads[k]), f"gradient: {name} at {k!r}")
    model.zero_grad(set_to_none=True)
    return sides


def replicate_sides(model: nn.Module) -> list[Callable[[], Any]]:
    s = fr.state(model)
    sides = [
        lambda: [copy.deepcopy(model) for _ in range(4)],
        lambda: fr.replicate(s, ["cpu"] * 4),
    ]
    copies, replicas = sides[0](), sides[1]()
    for c, r in zip(copies, replicas):
        for k, t in {**dict(c.named_parameters()), **dict(c.named_buffers())}.items():
            got = r.params.get(k, r.buffers.get(k))
            check(got is not None and torch.equal(got, t), f"replicate at {k!r}")
    return sides


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run with few rounds")
    args = parser.parse_args(argv)
    pairs, warmup = (3, 1) if args.quick else (40, 5)
    torch.set_num_threads(1)
    print(f"bench_core: torch {torch.__version__}, 1 thread, {pairs} interleaved rounds")
    print("ratios: median over rounds of each side's time / the baseline's (lower is faster)\n")

    fwd: dict[str, list[float]] = {}
    grad: dict[str, list[float]] = {}
    rep: dict[str, list[float]] = {}
    faults: dict[str, list[float]] = {}
    for name in MODELS:
        model, x, y = build(name)
        with torch.no_grad():
            sides = forward_sides(model, x)
            t, _ = round_times(sides, pairs=pairs, warmup=warmup)
        fwd[name] = [median_ratio(t, i, 0) for i in range(3)]
        sides = grad_sides(model, x, y)
        t, faults[name] = round_times(sides, pairs=pairs, warmup=warmup)
        grad[name] = [median_ratio(t, i, 0) for i in range(4)] + [median_ratio(t, 1, 2)]
        sides = replicate_sides(model)
        t, _ = round_times(sides, pairs=pairs, warmup=warmup)
        rep[name] = [median_ratio(t, 1, 0)]

    header = "".join(f"{m:>12}" for m in MODELS)
    fmt = "{:>12.3f}"
    print(f"{'forward (no_grad), vs module(x)':<44}{header}")
    for i, label in enumerate(("module(x)", "fr.apply", "torch.func.functional_call")):
        print(row("  " + label, [fwd[m][i] for m in MODELS], fmt))
    print(f"\n{'gradient of cross_entropy, vs stateful':<44}{header}")
    labels = (
        "stateful fwd+backward",
        "fr.grad_and_value",
        "torch.func.grad_and_value (via fr.apply)",
        "autograd.grad via functional_call",
        "fr.grad_and_value / torch.func (same rounds)",
    )
    for i, label in enumerate(labels):
        print(row("  " + label, [grad[m][i] for m in MODELS], fmt))
    print(f"\n{'minor page faults per call, same rounds':<44}{header}")
    for i, label in enumerate(labels[:4]):
        print(row("  " + label, [faults[m][i] for m in MODELS], "{:>12.0f}"))
    print(f"\n{'replication onto 4 x cpu, vs 4 deepcopies':<44}{header}")
    print(row("  fr.replicate(state, ['cpu'] * 4)", [rep[m][0] for m in MODELS], "{:>12.5f}"))
    print("\ntargets (issue 6):")
    for figure, target in TARGETS.items():
        print(f"  {figure:<36}{target}")


if __name__ == "__main__":
    main()
