"""Rank-side code of tests/test_step.py: a gradient step's contract on 2 gloo ranks, against DDP.

Failures decided by control flow (any ``BaseException`` announced, no text
read), activation checkpointing decided per call (against DDP with
``static_graph=True``, which takes reentrant checkpoints of shared weights),
accumulation in the order a ``no_sync`` loop draws its micro-batches (with
dropout), the parameters checked on a layout's first call, and the compiled
step around ``accumulate``. The ranks are ``_dist_workers.spawn``'s
(loopback only, a file store, bounded timeouts, stragglers killed).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import _dist_workers
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from torch import nn

import freplicate as fr

LR = 0.1


class Scenario(str):
    """A scenario's name; unpickling it imports this module (see ``_compile_workers``)."""

    __slots__ = ()


def spawn(names: list[str], **kwargs: Any) -> dict[str, list[Any]]:
    return _dist_workers.spawn([Scenario(n) for n in names], **kwargs)


SCENARIOS: list[str] = []


def scenario(f: Any) -> Any:
    SCENARIOS.append(f.__name__)
    return _dist_workers.scenario(f)


def outcome(f: Callable[[], Any]) -> tuple[Any, ...]:
    """``("returned", value)`` or ``("raised", builtin type name, message)``, for any BaseException."""
    try:
        return ("returned", f())
    except BaseException as err:  # KeyboardInterrupt too: that is the point
        return ("raised", _dist_workers._kind(err), str(err))


def sgd(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torch.optim.SGD's update (``param.add_(grad, alpha=-lr)``), out of place, to the bit."""
    return {k: torch.add(p, grads[k], alpha=-LR) for k, p in params.items()}


def params_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in module.named_parameters()}


class Counted:
    """Within the block, how many torch.distributed collectives this rank starts (eagerly)."""

    NAMES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather_object")

    def __enter__(self) -> Counted:
        self.count = 0
        self.saved = {n: getattr(dist, n) for n in self.NAMES}
        for n, f in self.saved.items():
            setattr(dist, n, self._counting(f))
        return self

    def _counting(self, f: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return f(*args, **kwargs)

        return counted

    def __exit__(self, *exc: Any) -> None:
        for n, f in self.saved.items():
            setattr(dist, n, f)


def _counting_hook(counter: list[int]) -> Callable[..., Any]:
    """DDP's default all-reduce of a bucket, counted (DDP's reducer calls no Python collective)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks its annotations
        counter[0] += 1
        return allreduce_hook(state, bucket)

    return hook


# --- failures by control flow -----------------------------------------------------------


class _Refuses(torch.autograd.Function):
    """Identity whose backward raises (a failure in the middle of the backward pass)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("use_reentrant=True sparse backward refused on rank 1")


@scenario
def failures(rank: int) -> dict[str, Any]:
    """Exceptions whose text once steered the protocol, and one that is not an Exception."""
    params = {"a": torch.ones(3), "b": torch.ones(2), "c": torch.ones(4)}

    def loss(p: Any, fail: str) -> Any:
        if fail == "interrupt" and rank == 1:
            raise KeyboardInterrupt
        if fail == "text" and rank == 0:
            raise RuntimeError("sparse batch rejected")  # once read as "retry without stacks"
        a = _Refuses.apply(p["a"]) if fail == "backward" and rank == 1 else p["a"]
        return a.sum() + p["b"].sum() * 2 + p["c"].sum() * 3

    def weigh(p: Any, fail: str) -> float:
        if fail == "weight" and rank == 1:
            raise SystemExit("rank 1's weight")
        return 1.0

    tiny = fr.distributed.grad_and_value(loss, bucket_cap_mb=1e-6)  # a bucket per tensor
    weighted = fr.distributed.grad_and_value(loss, weight=weigh)
    out: dict[str, Any] = {}
    tiny(params, "none")
    tiny(params, "none")  # the fast path from now on
    out["interrupt"] = outcome(lambda: tiny(params, "interrupt"))
    out["text"] = outcome(lambda: tiny(params, "text"))
    out["backward"] = outcome(lambda: tiny(params, "backward"))
    out["weight"] = outcome(lambda: weighted(params, "weight"))
    micro = [("none",), ("interrupt",), ("none",)]
    out["micro"] = outcome(lambda: tiny.accumulate(params, iter(micro), count=3))
    out["after"] = tiny(params, "none")[0]
    return out


# --- checkpointing, decided per call ----------------------------------------------------


class Checkpointed(nn.Module):
    """A block checkpointed as ``case`` says; ``unused`` never reaches the loss."""

    def __init__(self, case: str, reentrant: bool) -> None:
        super().__init__()
        self.case, self.reentrant = case, reentrant
        self.inp, self.block, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.unused = nn.Linear(2, 2)

    def ck(self, h: torch.Tensor) -> torch.Tensor:
        return cp.checkpoint(self.block, h, use_reentrant=self.reentrant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.case == "first":  # on the input itself: its requires_grad matters
            return self.head(torch.tanh(self.ck(x)) + self.inp(x))
        h = torch.tanh(self.inp(x))
        if self.case == "once":
            h = self.ck(h)
        elif self.case == "twice":
            h = self.ck(torch.tanh(self.ck(h)))
        elif self.case == "shared":  # the block's weights in a checkpoint and outside it
            h = self.ck(h) + self.block(h)
        return self.head(h)


class Switching(nn.Module):
    """A forward that changes which layers it checkpoints, and how, from step to step."""

    MODES = ("plain", "reentrant", "non_reentrant", "reentrant", "plain", "non_reentrant")

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 2)
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mode = self.MODES[self.step % len(self.MODES)]
        for i, layer in enumerate(self.layers):
            if mode != "plain" and i == 1 + self.step % 2:  # not the first: it gets a gradient
                x = cp.checkpoint(layer, x, use_reentrant=mode == "reentrant")
            else:
                x = torch.tanh(layer(x))
        return self.head(x)


def _data(rank: int, step: int, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(5, 4, generator=g)
    return (x.requires_grad_() if grad else x), torch.randint(0, 2, (5,), generator=g)


def _against_ddp(model: nn.Module, rank: int, grad: bool, static: bool, steps: int = 3) -> Any:
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model), static_graph=static)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    params = params_of(model)

    def loss(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(fr.apply(model, fr.State(p, {}), x)[0], y)

    step = fr.distributed.grad_and_value(loss)
    for i in range(steps):
        for m in (model, ddp.module):
            if isinstance(m, Switching):
                m.step = i
        x, y = _data(rank, i, grad)
        opt.zero_grad()
        F.cross_entropy(ddp(x.detach().requires_grad_(grad)), y).backward()
        opt.step()
        grads, _ = step(params, x, y)
        params = sgd(params, grads)
        if grad:
            assert x.grad is None  # nothing of the caller's written
    return params, params_of(ddp.module)


@scenario
def checkpoint_matrix(rank: int) -> dict[str, Any]:
    """Every case one after another in one process (how a cache keyed on code showed)."""
    out: dict[str, Any] = {}
    for case in ("once", "twice", "shared", "first"):
        for reentrant in (True, False):
            for grad in (False, True):
                torch.manual_seed(0)
                model = Checkpointed(case, reentrant)
                out[f"{case}-{'reentrant' if reentrant else 'plain'}-{grad}"] = _against_ddp(
                    model, rank, grad, static=True
                )
    for grad in (False, True):
        torch.manual_seed(0)
        out[f"switching-{grad}"] = _against_ddp(Switching(), rank, grad, static=False, steps=6)
    return out


# --- accumulation in the user's order ---------------------------------------------------


class Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 3)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.tanh(self.a(x))))


def _micro_batches(data: torch.Tensor, labels: torch.Tensor, k: int) -> Iterator[tuple[Any, ...]]:
    """Each micro-batch drawn when asked, from the global RNG (a sampler's random indices)."""
    for _ in range(k):
        idx = torch.randint(0, data.shape[0], (4,))
        yield data[idx], labels[idx]


@scenario
def accumulate_in_order(rank: int) -> dict[str, Any]:
    """A no_sync loop that draws batches and dropout masks as it goes, against accumulate."""
    torch.manual_seed(0)
    model = Dropped()
    g = torch.Generator().manual_seed(rank)
    data, labels = torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    params = params_of(model)

    def loss(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(fr.apply(model, fr.State(p, {}), x)[0], y)

    step = fr.distributed.grad_and_value(loss)
    out: dict[str, Any] = {"pairs": []}
    k = 3
    for s in range(4):
        torch.manual_seed(1000 + s)  # the same random stream for both loops
        opt.zero_grad()
        for i, (x, y) in enumerate(_micro_batches(data, labels, k)):
            if i < k - 1:
                with ddp.no_sync():
                    F.cross_entropy(ddp(x), y).backward()
            else:
                F.cross_entropy(ddp(x), y).backward()
        opt.step()
        torch.manual_seed(1000 + s)
        grads, _ = step.accumulate(params, _micro_batches(data, labels, k), count=k)
        params = sgd(params, grads)
        out["pairs"].append((params, params_of(ddp.module)))
    # a list (sized): the same, its last micro-batch known from len()
    listed = list(_micro_batches(data, labels, k))
    torch.manual_seed(7)
    sized = step.accumulate(params, listed)[0]
    torch.manual_seed(7)
    out["listed"] = (sized, step.accumulate(params, iter(listed), count=k)[0])
    out["unsized"] = outcome(lambda: step.accumulate(params, _micro_batches(data, labels, 2))[0])
    out["short"] = outcome(lambda: step.accumulate(params, _micro_batches(data, labels, 2), count=3))
    return out


# --- the parameters, checked on a layout's first call -----------------------------------


@scenario
def parameters_checked(rank: int) -> dict[str, Any]:
    """Each rank its own init (no broadcast): ValueError naming the first leaf that differs."""
    torch.manual_seed(rank)  # forgetting to broadcast: every rank its own weights
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    torch.manual_seed(0)
    model[1].weight.data.fill_(0.5)  # ... the same on every rank for this one

    def loss(p: Any, x: torch.Tensor) -> torch.Tensor:
        return fr.apply(model, fr.State(p, {}), x)[0].sum()

    params = fr.state(model).params
    x = torch.ones(2, 3)
    out: dict[str, Any] = {}
    out["forgot"] = outcome(lambda: fr.distributed.grad_and_value(loss)(params, x))
    out["unchecked"] = outcome(lambda: fr.distributed.grad_and_value(loss, check=False)(params, x)[0])
    synced = fr.distributed.broadcast(params)
    out["broadcast"] = outcome(lambda: fr.distributed.grad_and_value(loss)(synced, x)[0])
    return out


# --- compiled accumulation --------------------------------------------------------------


class Four(nn.Module):
    """Three buckets at a small cap, as DDP cuts them."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


CAP = 0.0003  # ~80 floats a bucket


def _micro(rank: int, s: int, k: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 * s + rank)
    return [(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(k)]


def _ddp_accumulated(model: nn.Module, rank: int, steps: int) -> tuple[list[Any], list[int]]:
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=CAP)
    counter = [0]
    ddp.register_comm_hook(None, _counting_hook(counter))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    out, counts = [], []
    for s in range(steps):
        opt.zero_grad()
        micro = _micro(rank, s)
        before = counter[0]
        with ddp.no_sync():
            for x, y in micro[:-1]:
                F.cross_entropy(ddp(x), y).backward()
        F.cross_entropy(ddp(micro[-1][0]), micro[-1][1]).backward()
        counts.append(counter[0] - before)
        opt.step()
        out.append(params_of(ddp.module))
    return out, counts


@scenario
def compiled_accumulate(rank: int) -> dict[str, Any]:
    """A step around accumulate, compiled: one graph, no recompile in 10 steps, equal to DDP."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Four()

    def loss(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(fr.apply(model, fr.State(p, {}), x)[0], y)

    grad_fn = fr.distributed.grad_and_value(loss, bucket_cap_mb=CAP)

    def step(params: Any, micro: list[Any]) -> Any:
        grads, _ = grad_fn.accumulate(params, micro)
        return sgd(params, grads)

    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    steps = 10
    eager_params = compiled_params = params_of(model)
    got, eager, counts = [], [], []
    for s in range(steps):
        compiled_params = compiled(compiled_params, _micro(rank, s))
        with Counted() as calls:
            eager_params = step(eager_params, _micro(rank, s))
        counts.append(calls.count)
        got.append(compiled_params)
        eager.append(eager_params)
    ddp, ddp_counts = _ddp_accumulated(model, rank, steps)
    return {
        "frames": counter.frame_count,
        "compiled": got,
        "eager": eager,
        "ddp": ddp,
        "counts": counts,
        "ddp_counts": ddp_counts,
    }


@scenario
def compiled_weight_and_join(rank: int) -> dict[str, Any]:
    """weight= and join/skip under compile: the same results as eager, one graph each."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()

    def loss(p: Any, x: torch.Tensor) -> torch.Tensor:
        return (p["w"] * x).sum() / x.shape[0]

    weighted = fr.distributed.grad_and_value(loss, weight=lambda p, x: x.shape[0])
    params = {"w": torch.ones(3)}
    batches = [torch.full((2 + rank, 3), float(rank + 1)) for _ in range([3, 1][rank])]
    counter = CompileCounter()
    step = torch.compile(lambda p, x: weighted(p, x)[0], backend=counter, fullgraph=True)
    skip = torch.compile(lambda p: weighted.skip(p)[0], backend=counter, fullgraph=True)

    def run(step_fn: Any, skip_fn: Any) -> list[Any]:
        out = []
        for x in fr.distributed.join(batches):
            out.append(skip_fn(params) if x is None else step_fn(params, x))
        return out

    compiled = run(step, skip)
    eager = run(lambda p, x: weighted(p, x)[0], lambda p: weighted.skip(p)[0])
    return {"compiled": compiled, "eager": eager, "frames": counter.frame_count}


@scenario
def kept_leaves(rank: int) -> dict[str, Any]:
    """A loss that keeps the tensors it is given (the step's fresh leaves, on which the hooks that
    launch its buckets sit): differentiated again after the step, they get their own gradients,
    and the hooks, done with their call, do nothing."""
    torch.manual_seed(0)
    params = {"a": torch.randn(64, 64), "b": torch.randn(64, 64), "c": torch.randn(64)}
    kept: list[dict[str, torch.Tensor]] = []

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        kept.append(p)
        return (p["a"] @ x).sum() + 2 * (p["b"] @ x).sum() + p["c"].sum()

    step = fr.distributed.grad_and_value(loss, bucket_cap_mb=0.01)  # one bucket a tensor
    grads, _ = step(params, torch.full((64,), 1.0 + rank))
    leaves = kept[0]
    hooked = sum(bool(v._backward_hooks) for v in leaves.values())
    again = {k: torch.autograd.grad((v * 3).sum(), v)[0] for k, v in leaves.items()}
    return {"grads": grads, "hooked": hooked, "again": again}
