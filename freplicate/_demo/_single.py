"""The one-process paths: ``fr.data_parallel_grad`` beside DataParallel, and the compiled fr step.

(a) The functional step replicates the parameters, scatters the batch with
``torch.chunk`` semantics, takes every replica's gradient of its shard's
mean loss and averages them (``op="mean"``), then applies AdamW as a tree
map. Its stateful twin computes the same thing the stateful way: a module
trained by ``torch.optim.AdamW`` whose gradient is the mean over the same
``torch.chunk`` shards of each shard's mean loss, taken through
``nn.DataParallel`` on distinct CUDA devices (a module that returns its own
loss, so that the replicas' losses are gathered and averaged) and,
elsewhere, through DataParallel's algorithm spelled out: a deep copy of the
module per replica, each replica's loss, one backward through their mean,
the replicas' gradients summed into the module. With uneven shards (64
examples on 3 or 5 devices) that mean of shard means is not the full-batch
gradient, and both sides compute it.

(c) ``torch.compile`` of the whole functional step on one device
(``fr.grad_and_value`` and the AdamW update), beside the same step run
eagerly, both from one init on the same batches. (One device: that is the
step the library compiles into a single graph; compiling a
``data_parallel_grad`` step recompiles at every step for now.)
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import freplicate as fr

from . import _adamw, _data
from ._adamw import Tree
from ._options import Options
from ._progress import bar, say
from ._record import Agreement, PathResult, Side, Tolerance

COMPILE_LIMIT_S = 60.0

Step = Callable[..., tuple[Tree, _adamw.AdamWState, Tree, torch.Tensor]]


def fr_step(module: nn.Module, devices: Sequence[str] | None, lr: float) -> Step:
    """``step(params, opt_state, x, y) -> (params, opt_state, grads, loss)``, all functional.

    Its gradient is ``fr.data_parallel_grad``'s over ``devices``, or with
    ``None``, ``fr.grad_and_value``'s where the parameters are.
    """

    def loss_fn(params: Tree, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out, _ = fr.apply(module, fr.State(params, {}), x)
        return F.cross_entropy(out, y)

    if devices is None:
        grad_fn = fr.grad_and_value(loss_fn)
    else:
        grad_fn = fr.data_parallel_grad(loss_fn, list(devices))

    def step(
        params: Tree, opt_state: _adamw.AdamWState, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[Tree, _adamw.AdamWState, Tree, torch.Tensor]:
        grads, loss = grad_fn(params, x, y)
        params, opt_state = _adamw.update(params, grads, opt_state, lr=lr)
        return params, opt_state, grads, loss

    return step


class _WithLoss(nn.Module):
    """A module that returns its own loss, so that nn.DataParallel averages shard losses."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(x), y)


def uses_data_parallel(devices: Sequence[str]) -> bool:
    """nn.DataParallel itself needs 2 or more distinct CUDA devices."""
    return all(d.startswith("cuda") for d in devices) and len(set(devices)) == len(devices) > 1


def stateful_step(
    module: nn.Module, opt: torch.optim.Optimizer, devices: Sequence[str]
) -> Callable[[torch.Tensor, torch.Tensor], float]:
    """The twin: one AdamW step of ``module`` on the mean of the shards' mean losses."""
    if uses_data_parallel(devices):
        dp = nn.DataParallel(_WithLoss(module), device_ids=[torch.device(d) for d in devices])

        def dp_step(x: torch.Tensor, y: torch.Tensor) -> float:
            opt.zero_grad(set_to_none=True)
            with warnings.catch_warnings():
                # "all input tensors were scalars": the replicas' losses, gathered as meant
                warnings.simplefilter("ignore", UserWarning)
                loss = dp(x, y).mean()
            loss.backward()
            opt.step()
            return float(loss.detach())

        return dp_step

    def copies_step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        xs, ys = x.chunk(len(devices)), y.chunk(len(devices))
        replicas = [copy.deepcopy(module).to(d) for d in devices[: len(xs)]]
        losses = [
            F.cross_entropy(r(a.to(d)), b.to(d)) for r, a, b, d in zip(replicas, xs, ys, devices)
        ]
        loss = torch.stack([v.to(devices[0]) for v in losses]).mean()
        loss.backward()
        for name, p in module.named_parameters():  # DataParallel's reduce-add onto device 0
            grads = [r.get_parameter(name).grad for r in replicas]
            total = grads[0].to(p.device)  # type: ignore[union-attr]
            for g in grads[1:]:
                total = total + g.to(p.device)  # type: ignore[union-attr]
            p.grad = total
        opt.step()
        return float(loss.detach())

    return copies_step


def accuracy(
    module: nn.Module, params: Mapping[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
) -> float:
    with torch.no_grad():
        out, _ = fr.apply(module, fr.State({k: p.detach() for k, p in params.items()}, {}), x)
    return float((out.argmax(1).cpu() == y).float().mean())


def _since(start: float, devices: Sequence[str]) -> float:
    """Seconds since ``start``, once the work queued on CUDA devices is done."""
    if any(d.startswith("cuda") for d in devices):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def data_parallel(
    options: Options,
    data: _data.Digits,
    order: list[list[torch.Tensor]],
    tol: Tolerance,
) -> PathResult:
    """Path (a)."""
    devices = list(options.devices)
    module = _data.model(options.model, dtype=options.torch_dtype).to(devices[0])
    twin = copy.deepcopy(module)
    twin_step = stateful_step(twin, torch.optim.AdamW(twin.parameters(), lr=options.lr), devices)
    twin_params = dict(twin.named_parameters())
    step = fr_step(module, devices, options.lr)
    params = fr.state(module).params
    opt_state = _adamw.init(params)
    twin_name = "nn.DataParallel" if uses_data_parallel(devices) else "DataParallel's algorithm"
    result = PathResult(
        title=f"(a) fr.data_parallel_grad, {options.describe_devices()}",
        twin_title=twin_name,
        fr=Side("fr"),
        twin=Side("stateful"),
        agreement=Agreement(tol),
    )
    say(
        f"(a) one process: fr.data_parallel_grad on {', '.join(devices)} + AdamW as tree maps, "
        f"beside {twin_name}"
        + ("" if uses_data_parallel(devices) else " (a deep copy of the model per replica)")
        + " + torch.optim.AdamW"
    )
    x_test, y_test = data.x_test.to(devices[0]), data.y_test
    progress = bar("(a) one process", sum(map(len, order)))
    n = 0
    try:
        for epoch in order:
            for idx in epoch:
                x, y = data.x_train[idx].to(devices[0]), data.y_train[idx].to(devices[0])
                start = time.perf_counter()
                params, opt_state, grads, loss = step(params, opt_state, x, y)
                result.fr.step_s.append(_since(start, devices))
                start = time.perf_counter()
                twin_loss = twin_step(x, y)
                result.twin.step_s.append(_since(start, devices))
                value = float(loss)
                result.fr.losses.append(value)
                result.twin.losses.append(twin_loss)
                twin_grads: Tree = {k: p.grad for k, p in twin_params.items()}  # type: ignore[misc]
                miss = result.agreement.check(
                    n, value, twin_loss, grads, twin_grads, params, twin_params
                )
                if miss:
                    say(f"MISMATCH in (a) at {miss}")
                n += 1
                progress.update()
            result.fr.accuracy.append(accuracy(module, params, x_test, y_test))
            result.twin.accuracy.append(accuracy(module, twin_params, x_test, y_test))
            progress.set_postfix(acc=f"{result.fr.accuracy[-1]:.3f}")
    finally:
        progress.close()
    if len(devices) > 1 and all(d == "cpu" for d in devices):
        result.note = (
            "times: fr runs the CPU replicas in threads, as DataParallel runs its replicas; "
            "the twin runs its copies one after another. On shared cores, threads of a small "
            "model mostly hand the GIL back and forth (docs/data_parallel.md, Speed on CPU)"
        )
    return result


class _OutOfTime(Exception):
    """The compiled path ran past its time: it is reported as skipped."""


def _dynamo_counts() -> tuple[int, int]:
    """(graph breaks, graphs compiled) so far in this process, where torch counts them."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0, 0
    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


def compiled(
    options: Options, data: _data.Digits, order: list[list[torch.Tensor]], tol: Tolerance
) -> PathResult:
    """Path (c): the whole functional step under ``torch.compile``, beside it run eagerly."""
    device = options.devices[0]
    result = PathResult(
        title=f"(c) torch.compile(fr step), {device}",
        twin_title="the same step, eager",
        fr=Side("fr compiled"),
        twin=Side("fr eager"),
        agreement=Agreement(tol),
    )
    say(
        f"(c) torch.compile of the whole fr step on {device} (fr.grad_and_value and AdamW), "
        "beside the same step eager"
    )
    module = _data.model(options.model, dtype=options.torch_dtype).to(device)
    eager = fr_step(module, None, options.lr)
    params = eager_params = fr.state(module).params
    opt_state = eager_state = _adamw.init(params)
    x_test, y_test = data.x_test.to(device), data.y_test
    torch._dynamo.reset()
    breaks0, graphs0 = graphs = _dynamo_counts()
    compiling_s = 0.0
    step = torch.compile(fr_step(module, None, options.lr))
    total = sum(map(len, order))
    progress = bar("(c) compiled", total)
    started = time.perf_counter()
    n = 0
    try:
        for epoch in order:
            for idx in epoch:
                x, y = data.x_train[idx].to(device), data.y_train[idx].to(device)
                start = time.perf_counter()
                params, opt_state, grads, loss = step(params, opt_state, x, y)
                took = _since(start, [device])
                if _dynamo_counts() == graphs:
                    result.fr.step_s.append(took)
                else:  # a call that compiled a graph is not a step's time
                    graphs = _dynamo_counts()
                    compiling_s += took
                start = time.perf_counter()
                eager_params, eager_state, eager_grads, eager_loss = eager(
                    eager_params, eager_state, x, y
                )
                result.twin.step_s.append(_since(start, [device]))
                value, twin_value = float(loss), float(eager_loss)
                result.fr.losses.append(value)
                result.twin.losses.append(twin_value)
                miss = result.agreement.check(
                    n, value, twin_value, grads, eager_grads, params, eager_params
                )
                if miss:
                    say(f"MISMATCH in (c) at {miss}")
                n += 1
                progress.update()
                # checked between steps, never by interrupting one: a compile stopped midway
                # by a signal can leave torch's compiler state half-built
                if time.perf_counter() - started > COMPILE_LIMIT_S:
                    raise _OutOfTime(f"{n} of {total} steps done")
            result.fr.accuracy.append(accuracy(module, params, x_test, y_test))
            result.twin.accuracy.append(accuracy(module, eager_params, x_test, y_test))
    except _OutOfTime as exc:
        result.skipped = (
            f"skipped: compiling and training took over {COMPILE_LIMIT_S:.0f} s ({exc})"
        )
    except Exception as exc:  # compile support is still being built: report, do not crash
        first = (str(exc).strip().splitlines() or [""])[0][:120]
        result.skipped = f"skipped: {type(exc).__name__}: {first}"
    finally:
        progress.close()
        breaks, compiles = _dynamo_counts()
        torch._dynamo.reset()
    if result.skipped is None:
        result.note = (
            f"{compiles - graphs0} graph(s) compiled in {compiling_s:.1f} s, "
            f"{breaks - breaks0} graph break(s); "
            f"{time.perf_counter() - started:.0f} s in all"
        )
    return result
