"""Rank-side code of tests/test_zero3.py: ZeRO-3 (``fr.distributed.apply_sharded``) on gloo ranks.

The scenarios register with ``_dist_workers`` and run through its spawner
(loopback only, a file store, bounded timeouts, stragglers killed), on 2
ranks and on 3, where most rows do not divide. The oracle of every call is
what the contract defines it as: ``fr.apply`` on the all-gathered
parameters, then ``fr.distributed.reduce_scatter`` (``op``) of the local
gradient; the stateful one is ``DistributedDataParallel`` +
``torch.optim.AdamW`` (+ ``clip_grad_norm_``). A scenario returns what it
computed beside what the oracle computed, and the test compares them.

``Recorder`` watches ``apply_sharded`` from the outside: it replaces the
``Pending`` (a started gather), ``_gather`` (a gather run at once) and
``apply`` (the primitive: the transposes) that
``freplicate._distributed._sharded`` calls with recording twins, and ``Probe`` modules and ``Mark`` functions inside each unit report
when the unit's forward and its backward run. From that: which gathers
were in flight, and which units' gathered storages were still referenced
(``torch``'s use count of the storage, above what it is once everything is
released), at each moment a unit ran. ``audited`` watches the saved
tensors ``apply_sharded`` replaces with a token (a unit's parameter, to
gather again in the backward): each must be a storage that unit's gather
gave, never an activation that took a released buffer's address. The
scenarios run as a user's code would, nothing kept alive for them.
"""

from __future__ import annotations

import copy
import gc
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from _dist_workers import _kind, _main, scenario, snapshot, spawn, unchanged
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

import freplicate as fr
from freplicate._distributed import _plans, _rules, _sharded, _wire
from freplicate._distributed._agree import DEBUG_VARIABLE
from freplicate._torch import FAST_PATHS


def main(*args: Any) -> None:
    _main(*args)


def run(names: list[str], *, world: int = 2, **kwargs: Any) -> dict[str, list[Any]]:
    return spawn(names, target=main, world=world, **kwargs)


def outcome(f: Callable[[], Any]) -> tuple[Any, ...]:
    """``("ok", result)`` or ``("raised", builtin type name, message)``."""
    try:
        return ("ok", f())
    except Exception as err:
        return ("raised", _kind(err), str(err))


# --- the models -------------------------------------------------------------------------

VOCAB, WIDTH, HIDDEN = 11, 4, 7  # rows: 11 and 7 divide neither 2 nor 3; 4 on 3 ranks: 2, 2, 0
FROZEN = "body.1.fc2.weight"
FLAT = ["embed", "body.0", "body.1", "body.2"]  # norm, scale and the tied weight: outside
NESTED = ["body", "body.0", "body.2"]  # body.1's parameters are body's own


class Probe(nn.Module):
    """Reports to the recorder, if any, that its unit's forward is running."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if RECORDER is not None:
            RECORDER.moment("forward", self.name)
            return Mark.apply(x, self.name)
        return x


class Mark(torch.autograd.Function):
    """The identity, whose backward reports that its unit's backward is running."""

    @staticmethod
    def forward(x: torch.Tensor, name: str) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        ctx.name = inputs[1]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:  # type: ignore[override]
        if RECORDER is not None:
            RECORDER.moment("backward", ctx.name)
        return g, None


class Block(nn.Module):
    """Linear, BatchNorm, then tanh, Linear and a 0-dim gain (checkpointed, with ``ckpt``)."""

    def __init__(self, name: str, ckpt: str | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, HIDDEN)
        self.bn = nn.BatchNorm1d(HIDDEN)
        self.probe = Probe(name)
        self.fc2 = nn.Linear(HIDDEN, WIDTH)
        self.gain = nn.Parameter(torch.tensor(0.75))
        self.ckpt = ckpt

    def inner(self, z: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(z)) * self.gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.probe(self.bn(self.fc1(x)))
        if self.ckpt is None:
            return x + self.inner(z)
        return x + checkpoint(self.inner, z, use_reentrant=self.ckpt == "reentrant")


class Net(nn.Module):
    """An embedding tied to the output head, blocks in a Sequential, a norm and a scale of its own.

    ``peek``: the forward also reads a unit's parameter outside the unit.
    """

    def __init__(self, ckpt: str | None = None, depth: int = 3, peek: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.body = nn.Sequential(*(Block(f"body.{i}", ckpt) for i in range(depth)))
        self.norm = nn.LayerNorm(WIDTH)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, VOCAB))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.peek = peek

    def forward(self, ids: torch.Tensor, *, fail: tuple[int, int] | None = None) -> torch.Tensor:
        x = self.body(self.embed(ids)) if fail is None else self._failing(ids, fail)
        out = self.head(self.norm(x)) * self.scale
        if self.peek:
            out = out + self.body[1].fc1.weight.sum()
        return out

    def _failing(self, ids: torch.Tensor, where: tuple[int, int]) -> torch.Tensor:
        rank, after = where
        x = self.embed(ids)
        for i, block in enumerate(self.body):
            x = block(x)
            if i == after and dist.get_rank() == rank:
                raise ValueError(f"rank {rank} raises after body.{after}")
        return x


def net(ckpt: str | None = None, *, meta: bool = False, **kwargs: Any) -> Net:
    """The same initial values on every rank (and on the meta device: the shapes alone)."""
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return Net(ckpt, **kwargs)
    return Net(ckpt, **kwargs)


def ids_of(rank: int, step: int = 0, rows: int = 6) -> torch.Tensor:
    return torch.randint(
        0, VOCAB, (rows,), generator=torch.Generator().manual_seed(rank + 7 * step)
    )


def loss_of(out: torch.Tensor) -> torch.Tensor:
    """Every output element weighed differently."""
    w = torch.sin(torch.arange(out.numel(), dtype=out.dtype)).reshape(out.shape)
    return (out * w).sum()


def gathered(shards: dict[str, torch.Tensor], like: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``all_gather`` of ``shards``, whatever their order, against ``like``'s full tensors."""
    return fr.distributed.all_gather(shards, {k: like[k] for k in shards})


def clones(tree: dict[str, torch.Tensor], grad: bool = False) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().requires_grad_(grad) for k, v in tree.items()}


# --- the oracle ---------------------------------------------------------------------------


def oracle(
    model: nn.Module,
    shards: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    args: tuple[Any, ...],
    *,
    op: str = "mean",
    trainable: set[str],
    like: dict[str, torch.Tensor],
) -> dict[str, Any]:
    """``fr.apply`` on the all-gathered parameters, ``reduce_scatter`` of its gradient."""
    full = gathered({k: v.detach() for k, v in shards.items()}, like)
    full = {k: v.detach().requires_grad_(k in trainable) for k, v in full.items()}
    out, new = fr.apply(model, fr.State(full, buffers), *args)
    loss_of(out).backward()
    grads = {k: full[k].grad for k in sorted(trainable)}
    return {
        "out": out.detach(),
        "buffers": new.buffers,
        "grads": fr.distributed.reduce_scatter(grads, op=op),
    }


def case(
    rank: int,
    *,
    units: list[str] | None,
    op: str = "mean",
    ckpt: str | None = None,
    how: str = "backward",
    training: bool = True,
    meta: bool = False,
    frozen: str = "state",
) -> dict[str, Any]:
    """One call of ``apply_sharded`` differentiated ``how``, beside the oracle.

    ``frozen``: ``"state"`` passes the frozen parameter's shard without
    grad; ``"module"`` leaves it out of the state (the module's own full
    tensor is used).
    """
    model = net(ckpt).train(training)
    module = net(ckpt, meta=True).train(training) if meta else model
    full = fr.state(model)
    like = full.params
    rows = fr.distributed.shard(full.params)
    trainable = {k: v.detach().clone().requires_grad_() for k, v in rows.items() if k != FROZEN}
    fixed = {FROZEN: rows[FROZEN].detach().clone()} if frozen == "state" else {}
    if frozen == "module":
        module.get_parameter(FROZEN).requires_grad_(False)
        model.get_parameter(FROZEN).requires_grad_(False)
    buffers = {k: v.clone() for k, v in full.buffers.items()}
    ids = ids_of(rank)
    before = snapshot((trainable, fixed, buffers, ids))

    def call(params: dict[str, torch.Tensor]) -> tuple[Any, fr.State]:
        state = fr.State({**params, **fixed}, buffers)
        return fr.distributed.apply_sharded(module, state, ids, units=units, op=op)

    if how == "backward":
        out, new = call(trainable)
        loss_of(out).backward()
        grads = {k: t.grad for k, t in trainable.items()}
    elif how == "grad_and_value":

        def loss_fn(params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
            out, new = call(params)
            return loss_of(out), (out, new)

        grads, (_, (out, new)) = fr.grad_and_value(loss_fn, has_aux=True)(trainable)
    elif how == "func":

        def func_loss(params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
            out, new = call(params)
            return loss_of(out), (out.detach(), new)

        grads, (out, new) = torch.func.grad(func_loss, has_aux=True)(clones(trainable))
    elif how == "no_grad":
        with torch.no_grad():
            out, new = call(trainable)
        grads = None
    else:
        raise ValueError(how)
    after = unchanged((trainable, fixed, buffers, ids), before)
    if frozen == "module":
        model.get_parameter(FROZEN).requires_grad_(True)
    want = oracle(
        model,
        {**trainable, **fixed} if frozen == "state" else {**trainable, FROZEN: rows[FROZEN]},
        full.buffers,
        (ids,),
        op=op,
        trainable=set(trainable),
        like=like,
    )
    return {
        "out": out.detach(),
        "buffers": new.buffers,
        "grads": None if grads is None else {k: grads[k] for k in sorted(grads)},
        "want": want,
        "unchanged": after,
        "params_given_back": list(new.params) == list({**trainable, **fixed}),
        "frozen_grad": None if how != "backward" or not fixed else fixed[FROZEN].grad,
    }


@contextmanager
def audited() -> Iterator[list[tuple[str, tuple[int, ...]]]]:
    """The saved tensors ``apply_sharded`` turned into a unit's token that are not that unit's
    gathered parameters (an activation at an address a released unit's buffer once had).

    A gathered storage is known by its ``StorageImpl``, held weakly while the
    block runs: its memory goes back to the allocator when ``apply_sharded``
    lets it go, as in any run (the next activations may take that address,
    which is what the check is for), but the ``StorageImpl`` itself is not
    freed, so no other storage takes its identity before the block ends.
    """
    track, pack = _sharded._Session._track, _sharded._Session.pack
    owner: dict[int, tuple[str, StorageWeakRef]] = {}
    wrong: list[tuple[str, tuple[int, ...]]] = []

    def tracked(self: Any, unit: str, full: Any) -> None:
        for t in full:
            storage = t.untyped_storage()
            owner[storage._cdata] = (unit, StorageWeakRef(storage))
        track(self, unit, full)

    def packed(self: Any, t: torch.Tensor) -> Any:
        saved = pack(self, t)
        if isinstance(saved, _sharded._Token):
            hit = owner.get(t.untyped_storage()._cdata)
            if hit is None or hit[0] != saved.unit:
                wrong.append((saved.unit, tuple(t.shape)))
        return saved

    _sharded._Session._track, _sharded._Session.pack = tracked, packed  # type: ignore[method-assign]
    try:
        yield wrong
    finally:
        _sharded._Session._track, _sharded._Session.pack = track, pack  # type: ignore[method-assign]


def audited_case(rank: int, **options: Any) -> tuple[tuple[Any, ...], list[Any]]:
    """``outcome`` of ``case``, and the tokens mistaken on the way (``audited``)."""
    with audited() as wrong:
        got = outcome(lambda: case(rank, **options))
    return got, wrong


CASES: dict[str, dict[str, Any]] = {
    "flat": {"units": FLAT},
    "flat sum": {"units": FLAT, "op": "sum", "how": "grad_and_value"},
    "nested": {"units": NESTED},
    "default units": {"units": None, "how": "grad_and_value"},
    "whole module": {"units": [""]},
    "non-reentrant checkpoint": {"units": FLAT, "ckpt": "non_reentrant"},
    "reentrant checkpoint": {"units": FLAT, "ckpt": "reentrant", "op": "sum"},
    "meta module": {"units": FLAT, "meta": True, "how": "grad_and_value"},
    "frozen in the module": {"units": NESTED, "frozen": "module"},
    "eval, no grad": {"units": FLAT, "training": False, "how": "no_grad"},
    "torch.func.grad": {"units": FLAT, "how": "func"},
}


@scenario
def against_the_oracle(rank: int) -> dict[str, Any]:
    return {name: audited_case(rank, **c) for name, c in CASES.items()}


@scenario
def second_order(rank: int) -> dict[str, Any]:
    """A gradient penalty: the gradient taken with create_graph, differentiated again.

    The oracle gathers through ``fr.distributed.all_gather``, whose
    transpose sums over the ranks: ``op="sum"`` here, and ``op="mean"``
    against the same with the loss divided by the world size.
    """
    model = net()
    full = fr.state(model)
    rows = fr.distributed.shard(full.params)
    ids = ids_of(rank)
    world = dist.get_world_size()

    def penalty(call: Callable[[dict[str, torch.Tensor]], Any], scale: float) -> dict[str, Any]:
        params = clones(rows, grad=True)
        loss = loss_of(call(params)) * scale
        grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
        sum(g.square().sum() for g in grads).backward()
        return {k: p.grad for k, p in params.items()}

    def sharded(op: str) -> Callable[[dict[str, torch.Tensor]], Any]:
        def call(params: dict[str, torch.Tensor]) -> Any:
            state = fr.State(params, full.buffers)
            return fr.distributed.apply_sharded(model, state, ids, units=FLAT, op=op)[0]

        return call

    def gathered(params: dict[str, torch.Tensor]) -> Any:
        whole = fr.distributed.all_gather(params, full.params)  # differentiable: the primitive
        return fr.apply(model, fr.State(whole, full.buffers), ids)[0]

    return {
        "sum": {"got": penalty(sharded("sum"), 1.0), "want": penalty(gathered, 1.0)},
        "mean": {"got": penalty(sharded("mean"), 1.0), "want": penalty(gathered, 1 / world)},
    }


# --- against DDP + torch.optim.AdamW ------------------------------------------------------

LR, WD, STEPS = 1e-2, 1e-2, 5


def adamw_init(params: dict[str, torch.Tensor]) -> dict[str, Any]:
    zeros = {k: torch.zeros_like(p) for k, p in params.items()}
    return {"step": 0, "exp_avg": zeros, "exp_avg_sq": dict(zeros)}


def adamw(params: Any, grads: Any, state: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """torch.optim.AdamW's single-tensor arithmetic, out of place (docs/sharding.md's)."""
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    step = state["step"] + 1
    step_size = LR / (1 - beta1**step)
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    new, exp_avg, exp_avg_sq = {}, {}, {}
    for k, p in params.items():
        g = grads[k]
        exp_avg[k] = torch.lerp(state["exp_avg"][k], g, 1 - beta1)
        exp_avg_sq[k] = torch.addcmul(state["exp_avg_sq"][k].mul(beta2), g, g, value=1 - beta2)
        denom = (exp_avg_sq[k].sqrt() / bias_correction2_sqrt).add(eps)
        new[k] = torch.addcdiv(p.mul(1 - LR * WD), exp_avg[k], denom, value=-step_size)
    return new, {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def ddp_run(rank: int, clip: bool) -> list[dict[str, torch.Tensor]]:
    model = net()
    model.get_parameter(FROZEN).requires_grad_(False)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD
    )
    seen = []
    for s in range(STEPS):
        optimizer.zero_grad()
        loss_of(ddp(ids_of(rank, s))).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.5)
        optimizer.step()
        seen.append({k: p.detach().clone() for k, p in model.named_parameters()})
    return seen


def zero3_run(
    rank: int, clip: bool, units: list[str] | None = FLAT
) -> list[dict[str, torch.Tensor]]:
    """ZeRO-3: grad_and_value of apply_sharded on the shards, AdamW on the shards."""
    model = net()
    full = fr.state(model)
    rows = fr.distributed.shard(full.params)
    mine = {k: v.clone() for k, v in rows.items() if k != FROZEN}
    fixed = {FROZEN: rows[FROZEN].clone()}
    buffers = full.buffers
    state = adamw_init(mine)
    seen = []

    def loss_fn(params: dict[str, torch.Tensor], ids: torch.Tensor, buffers: Any) -> Any:
        out, new = fr.distributed.apply_sharded(
            model, fr.State({**params, **fixed}, buffers), ids, units=units
        )
        return loss_of(out), new.buffers

    step = fr.grad_and_value(loss_fn, has_aux=True)
    for s in range(STEPS):
        grads, (_, buffers) = step(mine, ids_of(rank, s), buffers)
        if clip:
            grads, _ = fr.distributed.clip_grad_norm(grads, 0.5)
        mine, state = adamw(mine, grads, state)
        seen.append(gathered({**mine, **fixed}, full.params))
    return seen


@scenario
def adamw_against_ddp(rank: int) -> dict[str, Any]:
    return {
        "zero3": zero3_run(rank, clip=False),
        "zero3 nested": zero3_run(rank, clip=False, units=NESTED),
        "ddp": ddp_run(rank, clip=False),
        "zero3 clipped": zero3_run(rank, clip=True),
        "ddp clipped": ddp_run(rank, clip=True),
    }


@scenario
def gradients_against_ddp(rank: int) -> dict[str, Any]:
    """One step's gradients: this rank's rows of DDP's, for every ckpt kind."""
    out = {}
    for ckpt in (None, "non_reentrant", "reentrant"):
        model = net(ckpt)
        reference = copy.deepcopy(model)
        ddp = DistributedDataParallel(reference)
        loss_of(ddp(ids_of(rank))).backward()
        want = {k: p.grad for k, p in reference.named_parameters()}
        full = fr.state(model)
        params = clones(fr.distributed.shard(full.params), grad=True)
        got, _ = fr.distributed.apply_sharded(
            model, fr.State(params, full.buffers), ids_of(rank), units=FLAT
        )
        loss_of(got).backward()
        out[str(ckpt)] = {
            "got": {k: p.grad for k, p in params.items()},
            "want": fr.distributed.shard(want),
        }
    return out


# --- what is gathered when ----------------------------------------------------------------


class Recorder:
    """Every gather ``apply_sharded`` makes and every moment a unit runs, in order.

    ``events``: ``("start", unit)`` (a gather launched, not yet waited on),
    ``("finish", unit)``, ``("gather", unit)`` (one through the primitive,
    started and finished at once), ``("forward", unit)`` and
    ``("backward", unit)`` (a probe inside the unit). At each moment it
    notes the gathers in flight and every gathered storage's use count;
    ``alive`` reads them against the counts once all is released.
    """

    def __init__(self, plan: Any) -> None:
        self.unit_of = {f"[{n!r}]": u for u, names in plan.gathers.items() for n in names}
        self.unit_of.update({f"[{n!r}]": "outside" for n in plan.outside})
        self.events: list[tuple[str, str]] = []
        self.flight: dict[int, str] = {}
        self.storages: list[tuple[str, Any]] = []
        self.moments: list[tuple[str, str, list[str], list[int]]] = []

    def unit(self, spec: Any) -> str:
        return self.unit_of[spec.paths[0]]

    def keep(self, unit: str, results: list[torch.Tensor]) -> None:
        seen = set()
        for t in results:
            s = t.untyped_storage()
            if s._cdata not in seen:
                seen.add(s._cdata)
                self.storages.append((unit, StorageWeakRef(s)))

    def moment(self, what: str, unit: str) -> None:
        self.events.append((what, unit))
        counts = [_use_count(ref) for _, ref in self.storages]
        self.moments.append((what, unit, sorted(set(self.flight.values())), counts))

    def alive(self) -> list[tuple[str, str, list[str]]]:
        """At each moment: the units whose gather was in flight or whose storages were in use."""
        gc.collect()
        idle = [_use_count(ref) for _, ref in self.storages]
        out = []
        for what, unit, flight, counts in self.moments:
            used = {
                u for (u, _), c, i in zip(self.storages, counts, idle) if c > i and u != "outside"
            }
            out.append((what, unit, sorted(used | set(flight))))
        return out


def _use_count(ref: Any) -> int:
    if ref.expired():
        return 0
    return int(torch._C._storage_Use_Count(ref.cdata))


RECORDER: Recorder | None = None


@contextmanager
def recording(plan: Any) -> Iterator[Recorder]:
    """``apply_sharded``'s gathers recorded while the block runs (see ``Recorder``)."""
    global RECORDER
    recorder = Recorder(plan)
    pending, primitive, gather = _sharded.Pending, _sharded.apply, _sharded._gather

    class Recorded(pending):  # type: ignore[misc, valid-type]
        __slots__ = ()

        def __init__(self, spec: Any, tensors: Any) -> None:
            super().__init__(spec, tensors)
            recorder.events.append(("start", recorder.unit(spec)))
            recorder.flight[id(self)] = recorder.unit(spec)

        def finish(self) -> list[torch.Tensor]:
            out = super().finish()
            unit = recorder.flight.pop(id(self))
            recorder.events.append(("finish", unit))
            recorder.keep(unit, out)
            return out

    def applied(spec: Any, tensors: Any) -> list[torch.Tensor]:
        out = primitive(spec, tensors)
        if spec.options.kind != "all_gather":  # the transpose: a reduce-scatter
            recorder.events.append(("reduce", recorder.unit(spec)))
        else:
            recorder.events.append(("gather", recorder.unit(spec)))
            recorder.keep(recorder.unit(spec), out)
        return out

    def gathered_now(source: Any, shards: Any, *how: Any) -> list[torch.Tensor]:
        out = gather(source, shards, *how)
        if not isinstance(source, pending):  # a gather run now (a started one: ``Recorded``'s)
            recorder.events.append(("gather", recorder.unit(source)))
            recorder.keep(recorder.unit(source), out)
        return out

    _sharded.Pending, _sharded.apply, _sharded._gather = Recorded, applied, gathered_now
    RECORDER = recorder
    try:
        yield recorder
    finally:
        _sharded.Pending, _sharded.apply, _sharded._gather = pending, primitive, gather
        RECORDER = None


@contextmanager
def unpooled() -> Iterator[None]:
    """No buffer kept by ``fr.distributed``'s pools: a storage lives while something uses it."""
    saved = FAST_PATHS["storage_use_count"]
    FAST_PATHS["storage_use_count"] = False
    fr.clear_caches()
    try:
        yield
    finally:
        FAST_PATHS["storage_use_count"] = saved
        fr.clear_caches()


def watched(rank: int, units: list[str], ckpt: str | None = None, depth: int = 4) -> dict[str, Any]:
    """One call and its backward, recorded, without pools (``unpooled``)."""
    with unpooled():
        return _watched(rank, units, ckpt, depth)


def _watched(rank: int, units: list[str], ckpt: str | None, depth: int) -> dict[str, Any]:
    model = net(ckpt, depth=depth)
    full = fr.state(model)
    params = clones(fr.distributed.shard(full.params), grad=True)
    plan = _sharded.units_of(model, units)
    with recording(plan) as rec:
        out, _ = fr.distributed.apply_sharded(
            model, fr.State(params, full.buffers), ids_of(rank), units=units
        )
        loss_of(out).backward()
        del out
    grads = {k: p.grad for k, p in params.items()}
    want = oracle(
        model, params, full.buffers, (ids_of(rank),), trainable=set(params), like=full.params
    )
    return {
        "events": rec.events,
        "alive": rec.alive(),
        "grads": grads,
        "want": want["grads"],
    }


BLOCKS = ["body.0", "body.1", "body.2", "body.3"]


@scenario
def gathers_and_memory(rank: int) -> dict[str, Any]:
    return {
        "blocks": watched(rank, BLOCKS),
        "blocks, checkpointed": watched(rank, BLOCKS, ckpt="non_reentrant"),
        "flat": watched(rank, ["embed", *BLOCKS]),
        "nested": watched(rank, ["body", "body.0", "body.2"]),
    }


class Deep(nn.Module):
    """``depth`` units of Linear and tanh whose gathered buffers and activations have one size."""

    def __init__(self, depth: int, n: int = 8) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *(nn.Sequential(nn.Linear(n, n), nn.Tanh()) for _ in range(depth))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


@scenario
def many_units(rank: int) -> list[Any]:
    """30 units, 10 calls: a saved activation must never be taken for a released unit's buffer.

    A ``Linear(8, 8)``'s gathered weight and bias fill 320 bytes on 2 ranks,
    as a (10, 8) float32 activation does: once a unit's buffer is freed, the
    allocator hands its address to the activations that follow.
    """
    torch.manual_seed(0)
    depth = 30
    model = Deep(depth)
    full = fr.state(model).params
    units = [f"layers.{i}" for i in range(depth)]
    seen = []
    for trial in range(10):
        x = torch.randn(10, 8, generator=torch.Generator().manual_seed(rank + 10 * trial))

        def attempt(x: torch.Tensor = x) -> Any:
            params = clones(fr.distributed.shard(full), grad=True)
            out, _ = fr.distributed.apply_sharded(model, fr.State(params, {}), x, units=units)
            out.square().sum().backward()
            return {k: p.grad for k, p in params.items()}

        with audited() as wrong:
            got = outcome(attempt)
        reference = clones(full, grad=True)
        fr.apply(model, fr.State(reference, {}), x)[0].square().sum().backward()
        want = fr.distributed.reduce_scatter({k: p.grad for k, p in reference.items()})
        seen.append((got, want, wrong))
    return seen


@scenario
def pool_retention(rank: int) -> dict[str, Any]:
    """What ``fr.distributed``'s pools keep of apply_sharded's gathers once two steps are over.

    Units of 16 KiB (``Deep(4, 64)``), two steps of a call and its backward.
    """
    torch.manual_seed(0)
    depth, n = 4, 64
    model = Deep(depth, n)
    full = fr.state(model).params
    units = [f"layers.{i}" for i in range(depth)]
    paths = {f"[{k!r}]" for k in full}
    fr.clear_caches()
    for step in range(2):
        params = clones(fr.distributed.shard(full), grad=True)
        x = torch.randn(5, n, generator=torch.Generator().manual_seed(rank + step))
        out, _ = fr.distributed.apply_sharded(model, fr.State(params, {}), x, units=units)
        out.square().sum().backward()
        del out
    kept: dict[str, int] = {}
    seen: set[int] = set()  # a pool that layouts of one size share, once
    for key, plan in list(_plans._PLANS.items()):
        if key[0] == "rule" and set(key[1]) <= paths:
            kind = plan.layout.options.kind
            for pools in plan.pools:
                for pool in (pools.send, pools.recv, pools.res):
                    if pool is None or id(pool) in seen:
                        continue
                    seen.add(id(pool))
                    for buf, _ in pool.entries:
                        kept[kind] = kept.get(kind, 0) + buf.numel() * buf.element_size()
    return {"kept": kept, "unit": sum(t.numel() * t.element_size() for t in full.values()) // depth}


class Outside(nn.Module):
    """An untied embedding and head outside two units: the backward reads the head's weight
    (the input's gradient), never the embedding's table (its gradient needs the indices)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        self.head = nn.Linear(8, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(ids))))  # type: ignore[no-any-return]


@scenario
def nothing_outlives_its_use(rank: int) -> dict[str, Any]:
    """With the garbage collector off, as between its runs: what the forward gathered outside
    every unit and the backward does not read is let go with the forward; no session of the
    call outlives its backward (a unit's wrapped forward, in a cycle with its module copy, held
    it, and with it the last unit the backward gathered, until the collector ran: now it holds
    it weakly)."""
    torch.manual_seed(0)
    model = Outside()
    full = fr.state(model).params
    params = clones(fr.distributed.shard(full), grad=True)
    seen: dict[str, Any] = {}
    original = _sharded._Session.gather_outside

    def recorded(self: Any, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        got = list(original(self, *args, **kwargs))
        seen.update({n: StorageWeakRef(t.untyped_storage()) for n, t in got})
        return iter(got)

    def sessions() -> int:
        return sum(type(o) is _sharded._Session for o in gc.get_objects())

    gc.collect()
    gc.disable()
    before = sessions()  # other scenarios' (their results may keep a graph)
    _sharded._Session.gather_outside = recorded  # type: ignore[method-assign]
    try:
        out, _ = fr.distributed.apply_sharded(
            model, fr.State(params, {}), ids_of(rank), units=["body.0", "body.1"]
        )
        after_forward = {n: not ref.expired() for n, ref in seen.items()}  # storages alive
        loss_of(out).backward()
        del out
        left = sessions() - before
    finally:
        _sharded._Session.gather_outside = original  # type: ignore[method-assign]
        gc.enable()
    return {"after forward": after_forward, "sessions": left}


class ForwardMethods(nn.Module):
    """Units whose ``forward`` methods are checkpointed (the bound method, not the module): the
    checkpoint keeps the unit's wrapped forward alone, and recomputes through it in the
    backward pass, after the call has returned."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.a.forward, x, use_reentrant=self.reentrant)
        return checkpoint(self.b.forward, torch.tanh(h), use_reentrant=self.reentrant)  # type: ignore[no-any-return]


@scenario
def checkpointed_forward_methods(rank: int) -> dict[str, Any]:
    got = {}
    for reentrant in (False, True):
        torch.manual_seed(0)
        model = ForwardMethods(reentrant)
        full = fr.state(model)
        params = clones(fr.distributed.shard(full.params), grad=True)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
        x.requires_grad_(reentrant)  # a reentrant checkpoint needs an input that requires grad

        def attempt(model: nn.Module = model, params: Any = params, x: Any = x) -> Any:
            out, _ = fr.distributed.apply_sharded(model, fr.State(params, {}), x, units=["a", "b"])
            loss_of(out).backward()
            return {k: p.grad for k, p in params.items()}

        mine = outcome(attempt)
        want = oracle(model, params, {}, (x,), trainable=set(params), like=full.params)
        got["reentrant" if reentrant else "non-reentrant"] = (mine, want["grads"])
    return got


# --- errors ---------------------------------------------------------------------------------


@scenario
def errors(rank: int) -> dict[str, Any]:
    model = net()
    full = fr.state(model)
    rows = fr.distributed.shard(full.params)
    ids = ids_of(rank)

    def call(params: Any = rows, module: nn.Module = model, **kwargs: Any) -> Any:
        kwargs.setdefault("units", FLAT)
        return fr.distributed.apply_sharded(module, fr.State(params, full.buffers), ids, **kwargs)[
            0
        ]

    wrong = dict(rows)
    wrong["body.0.fc1.weight"] = full.params["body.0.fc1.weight"]
    grads = clones(rows, grad=True)
    out = {
        "not a submodule": outcome(lambda: call(units=["body.0", "body.9"])),
        "a string": outcome(lambda: call(units="body.0")),
        "wrong shape": outcome(lambda: call(wrong)),
        "unknown name": outcome(lambda: call({**rows, "body.0.nope": rows["scale"]})),
        "bad op": outcome(lambda: call(op="max")),
        "not a module": outcome(
            lambda: fr.distributed.apply_sharded(lambda x: x, fr.State({}, {}), ids)
        ),
        "used outside its unit": outcome(lambda: call(module=net(peek=True))),
        "used outside, backward": outcome(
            lambda: loss_of(call(grads, module=net(peek=True))).backward()
        ),
        "units differ across ranks": outcome(lambda: call(units=FLAT if rank == 0 else NESTED)),
        "a meta parameter left out": outcome(lambda: meta_left_out(rank)),
    }
    out["after"] = outcome(lambda: call().detach())
    out["want"] = fr.apply(model, fr.State(full.params, full.buffers), ids)[0]
    return out


def meta_left_out(rank: int) -> Any:
    """A module on the meta device whose state leaves out a parameter: it falls back to the
    module's own, a meta tensor, which torch's mm multiplies with a real one into uninitialised
    memory (``F.linear`` without a bias, torch 2.13: no error)."""

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 3, bias=False))

    torch.manual_seed(0)
    rows = fr.distributed.shard(fr.state(mlp()).params)
    with torch.device("meta"):
        shapes = mlp()
    state = fr.State({k: v for k, v in rows.items() if k != "2.weight"}, {})
    x = torch.ones(2, 4)
    return fr.distributed.apply_sharded(shapes, state, x, units=["0"])[0]


@scenario
def one_rank_raises(rank: int) -> dict[str, Any]:
    """Rank 1 raises inside the forward: after body.0 (body.2's gather still to come), or after
    body.1 (every gather launched); then the same call again, and a collective after it."""
    model = net()
    full = fr.state(model)
    params = clones(fr.distributed.shard(full.params), grad=True)
    ids = ids_of(rank)

    def call(**kwargs: Any) -> Any:
        state = fr.State(params, full.buffers)
        return fr.distributed.apply_sharded(model, state, ids, units=FLAT, **kwargs)[0].detach()

    out: dict[str, Any] = {"want": fr.apply(model, full, ids)[0], "full": full.params}
    for after in (0, 1):
        out[f"after body.{after}"] = {
            "raised": outcome(lambda after=after: call(fail=(1, after))),
            "again": outcome(call),
            "later": outcome(lambda: fr.distributed.all_gather(params, full.params)),
        }
    return out


@scenario
def default_units_of_a_module_list(rank: int) -> Any:
    """A model whose blocks sit in a ModuleList (the GPT example's): the default units."""

    class Listed(Net):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.ModuleList(list(self.body))  # type: ignore[assignment]

        def forward(self, ids: torch.Tensor, *, fail: Any = None) -> torch.Tensor:
            x = self.embed(ids)
            for block in self.body:
                x = block(x)
            return self.head(self.norm(x)) * self.scale

    torch.manual_seed(0)
    model = Listed()
    full = fr.state(model)
    rows = fr.distributed.shard(full.params)
    got = outcome(
        lambda: fr.distributed.apply_sharded(model, fr.State(rows, full.buffers), ids_of(rank))[0]
    )
    want = fr.apply(model, fr.State(full.params, full.buffers), ids_of(rank))[0]
    return {"got": got, "want": want}


# --- compiled --------------------------------------------------------------------------------


SMALL = ["embed", "body.0", "body.1"]  # a model of two blocks: what a compiled test can afford


def compiled_step(model: nn.Module, units: list[str] | None) -> Callable[..., Any]:
    def step(params: dict[str, torch.Tensor], buffers: Any, ids: torch.Tensor) -> Any:
        out, new = fr.distributed.apply_sharded(model, fr.State(params, buffers), ids, units=units)
        loss = loss_of(out)
        loss.backward()
        return out.detach(), new.buffers

    return step


def counting_backend(graphs: list[list[str]]) -> Callable[..., Any]:
    """Dynamo's graphs, each as the targets of its calls, in order; run as traced."""

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    return backend


@scenario
def compiled(rank: int) -> dict[str, Any]:
    """A step calling apply_sharded and loss.backward(), compiled (a counting backend), beside
    eager, three times (the later calls run the compiled code again)."""
    model = net(depth=2)
    full = fr.state(model)
    rows = fr.distributed.shard(full.params)
    graphs: list[list[str]] = []
    torch._dynamo.reset()
    step = compiled_step(model, SMALL)
    fast = torch.compile(step, backend=counting_backend(graphs))
    got, want, counts = [], [], []
    for s in range(3):
        params = clones(rows, grad=True)
        out, buffers = fast(params, full.buffers, ids_of(rank, s))
        counts.append(len(graphs))
        got.append((out, buffers, {k: p.grad for k, p in params.items()}))
        params = clones(rows, grad=True)
        out, buffers = step(params, full.buffers, ids_of(rank, s))
        want.append((out, buffers, {k: p.grad for k, p in params.items()}))
    return {"got": got, "want": want, "graphs": graphs, "counts": counts}


@scenario
def compiled_whole(rank: int) -> dict[str, Any]:
    """The forward and the loss compiled as one graph (fullgraph=True), and its gradient."""
    model = net(depth=2)
    full = fr.state(model)
    rows = fr.distributed.shard(full.params)

    def forward(params: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
        state = fr.State(params, full.buffers)
        return loss_of(fr.distributed.apply_sharded(model, state, ids, units=SMALL)[0])

    def loss_and_grads(fn: Callable[..., Any]) -> Any:
        params = clones(rows, grad=True)
        loss = fn(params, ids_of(rank))
        loss.backward()
        return loss.detach(), {k: p.grad for k, p in params.items()}

    torch._dynamo.reset()
    graphs: list[list[str]] = []
    fast = torch.compile(forward, backend=counting_backend(graphs), fullgraph=True)
    got = outcome(lambda: loss_and_grads(fast))
    return {"got": got, "want": loss_and_grads(forward), "graphs": graphs}


@scenario
def compiled_grad_and_value(rank: int) -> dict[str, Any]:
    """fr.grad_and_value (torch.func while compiling) of apply_sharded, compiled: a clear error."""
    model = net(depth=2)
    full = fr.state(model)
    rows = fr.distributed.shard(full.params)

    def loss_fn(params: dict[str, torch.Tensor]) -> torch.Tensor:
        state = fr.State(params, full.buffers)
        return loss_of(fr.distributed.apply_sharded(model, state, ids_of(rank), units=SMALL)[0])

    torch._dynamo.reset()
    fast = torch.compile(fr.grad_and_value(loss_fn), backend="eager")
    return {"outcome": outcome(lambda: fast(clones(rows)))}


# --- the last unit, kept for the backward ----------------------------------------------------


@scenario
def two_calls_one_backward(rank: int) -> dict[str, Any]:
    """Two calls, then one backward of both losses: the second call lets the first one's kept
    last unit go (one unit kept of all calls), which the backward gathers again."""
    model = net()
    full = fr.state(model)
    rows = fr.distributed.shard(full.params)

    def call(params: dict[str, torch.Tensor], s: int) -> torch.Tensor:
        state = fr.State(params, full.buffers)
        return loss_of(fr.distributed.apply_sharded(model, state, ids_of(rank, s), units=FLAT)[0])

    together = clones(rows, grad=True)
    (call(together, 0) + call(together, 1)).backward()
    apart = clones(rows, grad=True)
    call(apart, 0).backward()
    call(apart, 1).backward()
    return {
        "together": {k: p.grad for k, p in together.items()},
        "apart": {k: p.grad for k, p in apart.items()},
    }


# --- a weight tied across units ---------------------------------------------------------------


@scenario
def tied_gathered_once(rank: int) -> dict[str, Any]:
    """The tied embedding/head weight is gathered once per call, forward and backward together."""
    outside = _sharded.units_of(net(), FLAT).outside
    return {"outside": list(outside), "events": watched(rank, FLAT, depth=3)["events"]}


# --- frozen parameters: gathered, never reduce-scattered --------------------------------------

# frozen by the module's flags, split by fr.partition: a part of a unit (body.0's fc1), a whole
# unit (body.1) and a part of the parameters outside every unit (the norm, beside the scale and
# the tied embedding)
FROZEN_PARTS = ("body.0.fc1", "body.1", "norm")


@contextmanager
def counted() -> Iterator[dict[str, list[Any]]]:
    """The reduce-scatters of fr.distributed while the block runs: per call, its paths and the
    elements of its tensors (``"calls"``); per buffer a reduce-scatter's kind handed
    torch.distributed, its elements (``"wire"``: the buckets with their padding and flag words,
    and whatever the layout check sends in their format besides)."""
    seen: dict[str, list[Any]] = {"calls": [], "wire": []}
    plain = _rules.plain

    def counted_plain(spec: Any, tensors: Any) -> list[torch.Tensor]:
        if spec.options.kind == _wire.REDUCE_SCATTER.name:
            paths = [p[2:-2] for p in spec.paths]  # "['name']" -> name
            seen["calls"].append((paths, sum(t.numel() for t in tensors)))
        return plain(spec, tensors)

    kinds = [k for k in _wire.KINDS.values() if k.name.startswith(_wire.REDUCE_SCATTER.name)]
    for kind in kinds:
        start = kind.start

        def counted_start(send: Any, *args: Any, _start: Any = start) -> Any:
            seen["wire"].append(send.numel())
            return _start(send, *args)

        kind.start = counted_start  # type: ignore[method-assign, assignment]
    _rules.plain = counted_plain
    try:
        yield seen
    finally:
        _rules.plain = plain
        for kind in kinds:
            del kind.start


def frozen_step(rank: int, where: str) -> dict[str, Any]:
    """A warm ZeRO-3 step of ``fr.grad_and_value`` on the trainable shards, its reduce-scatters
    counted. ``where`` the frozen parameters are: ``"state"`` (their shards, without grad),
    ``"module"`` (left out of the state: the module's own tensors), ``"none"`` (all train)."""
    model = net()
    if where != "none":
        for name in FROZEN_PARTS:
            model.get_submodule(name).requires_grad_(False)
    full = fr.state(model)
    trainable, frozen = fr.partition(fr.distributed.shard(full.params), model)
    if where == "module":
        frozen = {}

    def loss_fn(params: dict[str, torch.Tensor], ids: torch.Tensor) -> Any:
        state = fr.State(fr.combine(params, frozen), full.buffers)
        return loss_of(fr.distributed.apply_sharded(model, state, ids, units=FLAT)[0])

    step = fr.grad_and_value(loss_fn)
    step(trainable, ids_of(rank, 0))  # cold: the layouts agreed
    with counted() as seen:
        grads, _ = step(trainable, ids_of(rank, 1))
    frozen_names = sorted(set(full.params) - set(trainable))
    sizes = {k: v.numel() for k, v in full.params.items()}
    return {"grads": grads, "frozen": frozen_names, "sizes": sizes, **seen}


@scenario
def frozen_parameters(rank: int) -> dict[str, Any]:
    out = {where: frozen_step(rank, where) for where in ("state", "module", "none")}
    model = net()
    for name in FROZEN_PARTS:
        model.get_submodule(name).requires_grad_(False)
    ddp = DistributedDataParallel(model)
    loss_of(ddp(ids_of(rank, 1))).backward()
    out["ddp"] = fr.distributed.shard(
        {k: p.grad for k, p in model.named_parameters() if p.requires_grad}
    )
    return out


@scenario
def frozen_differs_across_ranks(rank: int) -> dict[str, Any]:
    """Rank 0 freezes the norm's weight, rank 1 trains it: the backward's reduce-scatter of the
    parameters outside every unit (its last) differs across ranks; then a step that agrees.

    In the debug mode of the checks, where every call probes before data moves: in the steady
    state a layout known on one rank meets one that is new on the other, whose buckets differ
    in size, and gloo aborts (``_agree``'s text).
    """
    with debug_mode():
        return _frozen_differs_across_ranks(rank)


@contextmanager
def debug_mode() -> Iterator[None]:
    """``FREPLICATE_DISTRIBUTED_DEBUG=DETAIL`` while the block runs (every rank runs it)."""
    saved = os.environ.get(DEBUG_VARIABLE)
    os.environ[DEBUG_VARIABLE] = "DETAIL"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[DEBUG_VARIABLE]
        else:
            os.environ[DEBUG_VARIABLE] = saved


def _frozen_differs_across_ranks(rank: int) -> dict[str, Any]:
    model = net()
    full = fr.state(model)
    rows = fr.distributed.shard(full.params)

    def loss_fn(params: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor]) -> Any:
        state = fr.State(fr.combine(params, frozen), full.buffers)
        return loss_of(fr.distributed.apply_sharded(model, state, ids_of(rank), units=FLAT)[0])

    differ = {"norm.weight"} if rank == 0 else set()
    trainable = {k: v for k, v in rows.items() if k not in differ}
    frozen = {k: v for k, v in rows.items() if k in differ}
    step = fr.grad_and_value(loss_fn)
    return {
        "raised": outcome(lambda: step(trainable, frozen)),
        "after": outcome(lambda: step(rows, {})[0]),
    }
