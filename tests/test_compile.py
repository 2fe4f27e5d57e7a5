"""torch.compile of whole training steps: one graph, no break, the eager results.

One process: the tutorial's SGD step and an Adam step written as tree maps
(``fr.apply`` in the loss, ``fr.grad_and_value``, an out-of-place update).
Two gloo ranks (``_compile_workers.py``): the data-parallel step on
``fr.distributed.grad_and_value`` and ``sync_buffers``, and each collective
alone, against the eager calls and DistributedDataParallel. Compiling costs
seconds even for these tiny models (tens of seconds for Inductor): Inductor
compiles one step, the data-parallel one (it holds ``fr.apply`` and
``fr.grad_and_value`` too); the other checks use Dynamo's ``eager`` and
``aot_eager`` backends, which capture the same graph.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import optree
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import freplicate as fr

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import the workers by name
import _compile_workers as w

close = fr.testing.assert_trees_close
LR = 0.01
B1, B2, EPS = 0.9, 0.999, 1e-8


def problem() -> tuple[nn.Module, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    params = {k: v.clone() for k, v in fr.state(model).params.items()}
    return model, params, torch.randn(12, 8), torch.randint(0, 4, (12,))


def loss_of(model: nn.Module) -> Any:
    def loss_fn(params: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        out, _ = fr.apply(model, fr.State(params, {}), x)
        return F.cross_entropy(out, y)

    return loss_fn


def sgd_step(model: nn.Module) -> Any:
    """The tutorial's step: gradients, then an out-of-place update."""
    loss_fn = loss_of(model)

    def step(params: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        grads, loss = fr.grad_and_value(loss_fn)(params, x, y)
        return optree.tree_map(lambda p, g: p - LR * g, params, grads), loss

    return step


def adam_step(model: nn.Module) -> Any:
    """Adam as tree maps over the parameters and the two moments; ``t`` a tensor."""
    loss_fn = loss_of(model)

    def step(params: Any, m: Any, v: Any, t: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> Any:
        grads, loss = fr.grad_and_value(loss_fn)(params, x, y)
        t = t + 1
        m = optree.tree_map(lambda m, g: B1 * m + (1 - B1) * g, m, grads)
        v = optree.tree_map(lambda v, g: B2 * v + (1 - B2) * g * g, v, grads)
        c1, c2 = 1 - B1**t, 1 - B2**t
        params = optree.tree_map(
            lambda p, m, v: p - LR * (m / c1) / ((v / c2).sqrt() + EPS), params, m, v
        )
        return params, m, v, t, loss

    return step


def adam_args(params: dict[str, torch.Tensor]) -> tuple[Any, ...]:
    zeros = {k: torch.zeros_like(p) for k, p in params.items()}
    return params, zeros, dict(zeros), torch.tensor(0.0)


def test_sgd_and_adam_steps_are_one_graph_without_breaks() -> None:
    model, params, x, y = problem()
    for step, args in ((sgd_step(model), (params,)), (adam_step(model), adam_args(params))):
        torch._dynamo.reset()
        report = torch._dynamo.explain(step)(*args, x, y)
        reasons = [str(r.reason) for r in report.break_reasons]
        assert (report.graph_count, report.graph_break_count) == (1, 0), reasons


def test_sgd_step_compiles_fullgraph_to_the_eager_results() -> None:
    model, params, x, y = problem()
    torch._dynamo.reset()
    step = sgd_step(model)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got, want = params, params
    for _ in range(3):
        got, got_loss = compiled(got, x, y)
        want, want_loss = step(want, x, y)
        close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    close(got, want, rtol=1e-5, atol=1e-6)


def test_adam_step_compiles_fullgraph_to_the_eager_results() -> None:
    model, params, x, y = problem()
    torch._dynamo.reset()
    step = adam_step(model)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got, want = adam_args(params), adam_args(params)
    for _ in range(3):
        *got, got_loss = compiled(*got, x, y)
        *want, want_loss = step(*want, x, y)
    close((got, got_loss), (want, want_loss), rtol=1e-5, atol=1e-6)


# --- two gloo ranks ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def job() -> dict[str, list[Any]]:
    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    return w.spawn(w.SCENARIOS, pg_timeout=60.0, deadline=400.0)


def ok(job: dict[str, list[Any]], name: str) -> list[Any]:
    """Both ranks' results of ``name``; a scenario that raised fails the test with its traceback."""
    for rank, res in enumerate(job[name]):
        if isinstance(res, tuple) and res and res[0] == "raised":
            pytest.fail(f"{name} raised on rank {rank}:\n{res[3]}")
    return job[name]


def test_data_parallel_step_is_one_graph_without_breaks(job) -> None:
    for graphs, breaks, reasons in ok(job, "step_graphs"):
        assert (graphs, breaks) == (1, 0), reasons


def test_compiled_step_equals_eager_fr_and_ddp(job) -> None:
    for r in ok(job, "step_compiled"):
        close(r["compiled"], r["eager"], rtol=1e-5, atol=1e-6)
        close(r["compiled"], r["ddp"], rtol=1e-5, atol=1e-6)
    a, b = (r["compiled"] for r in job["step_compiled"])
    close(a.params, b.params, rtol=0, atol=0)  # the ranks stay in step


def test_a_rank_retracing_alone_stays_in_step(job) -> None:
    for r in ok(job, "rank_retraces_alone"):
        close(r["compiled"], r["eager"], rtol=1e-5, atol=1e-6)


def test_compiled_skip_meets_the_compiled_step(job) -> None:
    for compiled, eager in ok(job, "skip_compiled"):
        close(compiled, eager, rtol=0, atol=0)
        close(compiled[0], {"w": torch.arange(3.0) / 2}, rtol=0, atol=0)


def test_compiled_collectives_equal_eager_bitwise(job) -> None:
    for r in ok(job, "collectives_compiled"):
        close(r["compiled"], r["eager"], rtol=0, atol=0)
        assert r["tied"]
        assert r["unchanged"]


def test_mismatch_raises_on_every_rank_when_traced(job) -> None:
    for message, seconds in ok(job, "mismatch_compiled"):
        assert re.search(
            r"fr.distributed.all_reduce: the tensor at \['m'\] differs across ranks: shape \(\d,\)",
            message,
        ), message
        assert "checked when torch.compile traced this call" in message
        assert seconds < 30  # found by comparing layouts, not by a timeout
    for v in ok(job, "same_layout_after_mismatch"):
        torch.testing.assert_close(v, torch.ones(3))


def test_without_the_group_store_the_traced_check_takes_a_collective(job) -> None:
    for message in ok(job, "mismatch_without_the_store"):
        assert re.search(r"the tensor at \['n'\] differs across ranks: shape \(\d,\)", message), message
        assert "checked when torch.compile traced this call" in message


def test_a_compiled_data_parallel_grad_step_compiles_once() -> None:
    # id() on an input tensor (tie detection in replicate) made Dynamo guard on every
    # parameter's identity: each step's new parameters recompiled the step
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    params = fr.state(model).params
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(fr.apply(model, fr.State(p, {}), x)[0], y)

    grad = fr.data_parallel_grad(loss_fn, ["cpu", "cpu"])

    def step(p: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        g, _ = grad(p, x, y)
        return {k: v - 0.1 * g[k] for k, v in p.items()}

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, backend="aot_eager")
    eager = params
    for _ in range(3):
        params = compiled(params)
        eager = step(eager)
    assert counters["frames"]["ok"] == 1
    for k in params:
        torch.testing.assert_close(params[k], eager[k])
