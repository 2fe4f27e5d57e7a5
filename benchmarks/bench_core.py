"""The core against the stateful module and ``torch.func``: forward, gradient, replication.

For each benchmark model (../shared/BENCHMARKS.md), four groups of sides,
each group timed in one interleaved run (every round runs every side, the
orders balanced, ``_common.orders``; a ratio is the median over rounds of the per-round ratio):

- forward, under ``torch.no_grad()``: ``module(x)`` (the baseline, 1.00),
  ``fr.apply(module, state, x)``, ``torch.func.functional_call``, and
  ``module(x)`` / ``fr.apply`` each after building an unrelated module
  (``nn.CrossEntropyLoss()``, as a loss that makes its own does);
- forward recording the autograd graph (grad mode on): ``module(x)``, whose
  parameters require grad, against ``fr.apply`` of a state whose parameters
  are leaves that require grad (made once, as a training loop holds them),
  and ``functional_call`` of the same; the graph is freed with the output;
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

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import freplicate as fr

from ._common import MODELS, Rounds, build, interleave
from ._report import Row, command

NAME = "core"
TITLE = (
    "core: fr.apply, fr.grad_and_value and fr.replicate beside module(x), torch.func, "
    "a stateful step and copy.deepcopy"
)

# The targets, each on the models it was set for.
APPLY = 1.10  # fr.apply / module(x), every model, every forward row (issue 19)
GRAD_VS_FUNC = 0.60  # fr.grad_and_value / torch.func.grad_and_value, many_small (issue 6)
GRAD_VS_STATEFUL = 1.10  # fr.grad_and_value / stateful, every model (issue 19)
REPLICATE = 0.01  # fr.replicate / 4 x deepcopy


def check(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"bench_core: the sides disagree: {what}")


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def forward_sides(model: nn.Module, x: torch.Tensor) -> list[Callable[[], Any]]:
    s = fr.state(model)
    flat = {**s.params, **s.buffers}
    # the last two build an unrelated module before each call, as a loss that makes its own
    # nn.CrossEntropyLoss() does: the module's own cost is on both sides
    sides = [
        lambda: model(x),
        lambda: fr.apply(model, s, x)[0],
        lambda: torch.func.functional_call(model, flat, (x,)),
        lambda: (nn.CrossEntropyLoss(), model(x))[1],
        lambda: (nn.CrossEntropyLoss(), fr.apply(model, s, x)[0])[1],
    ]
    with torch.no_grad():
        ref = sides[0]()
        for name, side in zip(("fr.apply", "functional_call", "module(x)", "fr.apply"), sides[1:]):
            check(torch.equal(side(), ref), f"forward: {name} != module(x)")
    return sides


def graph_sides(model: nn.Module, x: torch.Tensor) -> list[Callable[[], Any]]:
    """The forward with grad mode on: each side records the autograd graph of its output."""
    s = fr.state(model)
    leaves = fr.State({k: v.detach().requires_grad_() for k, v in s.params.items()}, s.buffers)
    flat = {**leaves.params, **leaves.buffers}
    sides = [
        lambda: model(x),
        lambda: fr.apply(model, leaves, x)[0],
        lambda: torch.func.functional_call(model, flat, (x,)),
    ]
    ref = sides[0]()
    for name, side in zip(("fr.apply", "functional_call"), sides[1:]):
        out = side()
        check(out.grad_fn is not None and torch.equal(out, ref), f"graph: {name} != module(x)")
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


def _row(model: str, measure: str, t: Rounds, i: int, j: int, target: float | None = None) -> Row:
    """Side ``i`` against side ``j`` of one interleaved run; page faults where either had some."""
    faults = t.faults[i] if t.faults[i] or t.faults[j] else None
    return Row(NAME, measure, model, t.median(i), t.median(j), t.ratio(i, j), target, faults)


def run(quick: bool = False) -> list[Row]:
    """Every model's forward (no grad, recording the graph), gradient and replication rows."""
    pairs, warmup = (2, 1) if quick else (40, 5)
    torch.set_num_threads(1)
    rows: list[Row] = []
    for name in MODELS:
        model, x, y = build(name)
        with torch.no_grad():
            t = interleave(forward_sides(model, x), pairs=pairs, warmup=warmup)
        rows.append(_row(name, "fr.apply / module(x)", t, 1, 0, APPLY))
        rows.append(_row(name, "torch.func.functional_call / module(x)", t, 2, 0))
        rows.append(_row(name, "fr.apply / module(x), a module built before each", t, 4, 3, APPLY))

        with torch.enable_grad():
            t = interleave(graph_sides(model, x), pairs=pairs, warmup=warmup)
        rows.append(_row(name, "fr.apply / module(x), recording the graph", t, 1, 0, APPLY))
        measure = "torch.func.functional_call / module(x), recording the graph"
        rows.append(_row(name, measure, t, 2, 0))

        t = interleave(grad_sides(model, x, y), pairs=pairs, warmup=warmup)
        stateful = "stateful fwd+backward"
        rows.append(_row(name, f"fr.grad_and_value / {stateful}", t, 1, 0, GRAD_VS_STATEFUL))
        rows.append(_row(name, f"torch.func.grad_and_value / {stateful}", t, 2, 0))
        rows.append(_row(name, f"autograd.grad via functional_call / {stateful}", t, 3, 0))
        target = GRAD_VS_FUNC if name == "many_small" else None
        measure = "fr.grad_and_value / torch.func.grad_and_value"
        rows.append(_row(name, measure, t, 1, 2, target))

        t = interleave(replicate_sides(model), pairs=pairs, warmup=warmup)
        measure = "fr.replicate onto 4 x cpu / 4 x copy.deepcopy"
        rows.append(_row(name, measure, t, 1, 0, REPLICATE))
    return rows


def main(argv: list[str] | None = None) -> None:
    command(TITLE, run, argv)


if __name__ == "__main__":
    main()
