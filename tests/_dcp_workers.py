"""Rank-side code of tests/test_dcp.py and tests/test_materialize.py: sharded checkpoints, meta starts.

The scenarios register with ``_dist_workers`` and run through its spawner
(loopback only, a file store, bounded timeouts, stragglers killed) on 2 or
3 ranks; ``main`` is the ranks' entry point, which imports this module so
that they find them. The checkpoints live in the directory named by the
environment variable ``FR_TEST_DCP`` (set by the test before it spawns), so
that a job of 2 ranks saves what one process and a job of 3 ranks load.

The oracles: for checkpoints, the uninterrupted run (ZeRO-2 and ZeRO-1
AdamW loops of docs/sharding.md), and ``torch.chunk``'s rows of the full
tensors saved; for the meta start, ``fr.distributed.shard`` of
``fr.state`` of the model built on the CPU from the same seed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from _dist_workers import _main, scenario, snapshot, spawn, unchanged
from _shard_workers import (
    adamw,
    adamw_init,
    batch,
    floats,
    integers,
    net,
    outcome,
    rows,
    tensor_map,
)
from _uneven_workers import loss_of
from torch import nn

import freplicate as fr
from freplicate._distributed._dcp import load_sharded, save_sharded
from freplicate._distributed._materialize import materialize


def main(*args: Any) -> None:
    _main(*args)


def run(names: list[str], *, world: int = 2, **kwargs: Any) -> dict[str, list[Any]]:
    return spawn(names, target=main, world=world, **kwargs)


def where(name: str) -> str:
    """The checkpoint ``name`` in the test's directory."""
    return str(Path(os.environ["FR_TEST_DCP"]) / name)


def world_and_rank() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def on_meta(tree: Any) -> Any:
    """``tree`` on the meta device, a tied tensor still one tensor."""
    made: dict[int, torch.Tensor] = {}
    return tensor_map(lambda t: made.setdefault(id(t), torch.empty_like(t, device="meta")), tree)


def rows_here(tree: Any) -> Any:
    """This rank's rows of every tensor leaf (``torch.chunk``'s), as the oracle of a load."""
    world, rank = world_and_rank()
    return tensor_map(lambda t: rows(t, rank, world).clone(), tree)


# --- every dtype and shape ------------------------------------------------------------------


def everything() -> dict[str, Any]:
    """One full tree on every rank: every dtype, padding case, a 0-dim and an empty leaf, a
    non-contiguous one, a tied pair, non-tensor leaves, and a ``fr.State``."""
    ints = integers(0)
    return {
        "floats": floats(0),  # odd, few, one, scalar, empty, hollow, f64 ... c128, tied, name, k
        "ints": ints,
        "state": fr.State(
            {"w": torch.arange(12.0).view(4, 3)},
            {"n": torch.tensor(5), "stats": torch.arange(6.0).view(3, 2)},  # whole on every rank
        ),
        "step": 11,
        "lr": 0.25,
    }


def mine_of(full: Any) -> Any:
    """What this rank holds: its rows of every tensor, buffers (``state.buffers``) whole."""
    mine = fr.distributed.shard(full)
    return {**mine, "state": fr.State(mine["state"].params, full["state"].buffers)}


def expected_of(full: Any) -> Any:
    """This rank's rows of the saved tree, buffers whole, at the current world size."""
    out = rows_here(full)
    return {**out, "state": fr.State(out["state"].params, full["state"].buffers)}


def checks(full: Any, got: Any, target: Any) -> dict[str, Any]:
    """What the tests compare of a load: the values, ties, fresh memory, layouts."""
    mine = [x for x in fr._tree.flatten(got)[0] if isinstance(x, torch.Tensor)]
    theirs = [x for x in fr._tree.flatten(full)[0] if isinstance(x, torch.Tensor)]
    return {
        "got": got,
        "expected": expected_of(full),
        "untied": got["floats"]["tied"][0] is not got["floats"]["tied"][1],
        "fresh": not {t.untyped_storage().data_ptr() for t in mine if t.numel()}
        & {t.untyped_storage().data_ptr() for t in theirs if t.numel()},
        "no_grad": not any(t.requires_grad for t in mine),
        "contiguous": all(t.is_contiguous() for t in mine),
        "target_is_meta": all(
            t.device.type == "meta"
            for t in fr._tree.flatten(target)[0]
            if isinstance(t, torch.Tensor)
        ),
    }


def load_everything(name: str = "everything") -> dict[str, Any]:
    """Load the tree saved by ``save_everything`` into meta targets of this world's layout."""
    full = everything()
    target = on_meta(mine_of(full))
    got = load_sharded(where(name), target)
    return checks(full, got, target)


@scenario
def save_everything(rank: int) -> dict[str, Any]:
    full = everything()
    mine = mine_of(full)
    snap = snapshot(mine)
    save_sharded(where("everything"), mine, full)
    return {"unchanged": unchanged(mine, snap), "loaded": load_everything()}


@scenario
def load_everything_here(rank: int) -> dict[str, Any]:
    return load_everything()


# --- ZeRO-2 and ZeRO-1 resumed on another number of ranks -----------------------------------

RESUME_AT, STOP = 5, 10


def my_batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of step ``i``'s global batch: 2 ranks' batches of 6, put together."""
    world, rank = world_and_rank()
    x = torch.cat([batch(r, i)[0] for r in range(2)])
    y = torch.cat([batch(r, i)[1] for r in range(2)])
    return rows(x, rank, world), rows(y, rank, world)


def gradient(kind: str, params: Any, i: int) -> Any:
    """This rank's rows of step ``i``'s mean gradient. One process adds the two halves' gradients
    as 2 ranks' reduce-scatter (or all-reduce) does, each scaled by 1/2, so that it is the 2-rank
    run's bit for bit; 3 ranks take 4 rows each, and sum in another order (to rounding)."""
    world, _ = world_and_rank()
    loss_fn = loss_of(net())
    if world == 1:
        local = fr.grad_and_value(loss_fn)
        g0, g1 = (local(params, *batch(r, i))[0] for r in range(2))
        return {k: g0[k] * 0.5 + g1[k] * 0.5 for k in g0}
    if kind == "zero2":
        return fr.distributed.grad_and_value(loss_fn, shard=True)(params, *my_batch(i))[0]
    return fr.distributed.shard(fr.distributed.grad_and_value(loss_fn)(params, *my_batch(i))[0])


def train(kind: str, params: Any, mine: Any, opt: Any, start: int, stop: int) -> tuple[Any, ...]:
    """The ZeRO-2 (or ZeRO-1) AdamW loop from step ``start`` to ``stop``: the full parameters
    after each step, and the last shards and optimizer state."""
    out = []
    for i in range(start, stop):
        mine, opt = adamw(mine, gradient(kind, params, i), opt)
        params = fr.distributed.all_gather(mine, params)
        out.append(params)
    return out, mine, opt


def begin() -> tuple[Any, Any, Any]:
    params = fr.state(net()).params
    mine = fr.distributed.shard(params)
    return params, mine, adamw_init(mine)


def run_like(params: Any) -> dict[str, Any]:
    """The full layout of a run's checkpoint (one process's run): what ``save_sharded`` reads."""
    return {"mine": params, "opt": adamw_init(params)}


def save_run(kind: str, name: str) -> list[Any]:
    """Train to ``RESUME_AT``, save; the parameters after each step."""
    params, mine, opt = begin()
    out, mine, opt = train(kind, params, mine, opt, 0, RESUME_AT)
    save_sharded(where(name), {"mine": mine, "opt": opt}, run_like(params))
    return out


def resume(kind: str, name: str) -> dict[str, Any]:
    """Load a run's checkpoint into this world's layout (meta targets) and train on to ``STOP``."""
    like = fr.state(net()).params
    target = on_meta(run_like(fr.distributed.shard(like)))
    got = load_sharded(where(name), target)
    params = fr.distributed.all_gather(got["mine"], like)
    out, _, _ = train(kind, params, got["mine"], got["opt"], RESUME_AT, STOP)
    full = {
        "params": params,
        "exp_avg": fr.distributed.all_gather(got["opt"]["exp_avg"], like),
        "exp_avg_sq": fr.distributed.all_gather(got["opt"]["exp_avg_sq"], like),
        "step": got["opt"]["step"],
    }
    return {"steps": out, "loaded": full}


def saved_state(kind: str) -> dict[str, Any]:
    """The full state at ``RESUME_AT`` of an uninterrupted run (the oracle of ``resume``'s loaded)."""
    params, mine, opt = begin()
    out, mine, opt = train(kind, params, mine, opt, 0, RESUME_AT)
    return {
        "params": out[-1],
        "exp_avg": fr.distributed.all_gather(opt["exp_avg"], params),
        "exp_avg_sq": fr.distributed.all_gather(opt["exp_avg_sq"], params),
        "step": opt["step"],
    }


@scenario
def runs(rank: int) -> dict[str, Any]:
    """On 2 ranks: ZeRO-2 and ZeRO-1 uninterrupted, saved at step 5 and resumed here; the one
    process's checkpoint (``one``) resumed on 2 ranks."""
    out: dict[str, Any] = {}
    for kind in ("zero2", "zero1"):
        params, mine, opt = begin()
        out[kind] = {
            "whole": train(kind, params, mine, opt, 0, STOP)[0],
            "first": save_run(kind, kind),
            "state": saved_state(kind),
            "here": resume(kind, kind),
            "from_one": resume(kind, "one"),
        }
    return out


@scenario
def resumed(rank: int) -> dict[str, Any]:
    """On another number of ranks: both runs' checkpoints loaded, and trained on."""
    return {kind: resume(kind, kind) for kind in ("zero2", "zero1")}


# --- a ZeRO-3 state: parameters' shards, buffers whole -------------------------------------


def bn_state() -> fr.State:
    """A state with buffers that moved (BatchNorm's statistics, set: a forward's would differ in
    the last bits with the number of threads), alike on every rank."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 5))
    params, buffers = fr.state(model)
    moved = {
        "1.running_mean": torch.linspace(-1.0, 1.0, 16),
        "1.running_var": torch.linspace(0.5, 2.0, 16),
        "1.num_batches_tracked": torch.tensor(7),
    }
    assert moved.keys() == buffers.keys()
    return fr.State(params, moved)


def zero3_like(state: fr.State) -> dict[str, Any]:
    return {"state": state, "opt": adamw_init(state.params)}


def zero3_mine(state: fr.State) -> dict[str, Any]:
    mine = fr.distributed.shard(state.params)
    return {"state": fr.State(mine, state.buffers), "opt": adamw_init(mine)}


@scenario
def save_zero3(rank: int) -> Any:
    state = bn_state()
    save_sharded(where("zero3"), zero3_mine(state), zero3_like(state))
    return load_zero3()


@scenario
def load_zero3(rank: int = 0) -> dict[str, Any]:
    state = bn_state()
    got = load_sharded(where("zero3"), on_meta(zero3_mine(state)))
    return {"got": got, "expected": zero3_mine(state)}


# --- parameters only: torch's own dcp.load reads them --------------------------------------


@scenario
def save_params(rank: int) -> None:
    params = fr.state(net()).params
    save_sharded(where("params"), fr.distributed.shard(params), params)


@scenario
def load_torch_saved(rank: int) -> dict[str, Any]:
    """What torch's own ``dcp.save`` wrote (a module's state_dict, one process), as shards."""
    params = fr.state(net()).params
    got = load_sharded(where("torch"), on_meta(fr.distributed.shard(params)))
    return {"got": got, "expected": rows_here(params)}


# --- what must raise on every rank -----------------------------------------------------------


@scenario
def mistakes(rank: int) -> dict[str, Any]:
    """Trees that cannot be saved or loaded as given: the same error on every rank, no hang."""
    full = {"w": torch.arange(8.0).view(4, 2)}
    mine = fr.distributed.shard(full)
    d = where(f"mistakes-{rank}")  # never written: every case raises before DCP runs
    cases: dict[str, Callable[[], Any]] = {
        "whole_differs": lambda: save_sharded(
            d, {"b": torch.full((2,), float(rank))}, {"b": torch.ones(2)}
        ),
        "number_differs": lambda: save_sharded(d, {"step": rank}, {"step": 0}),
        "rows_and_whole": lambda: save_sharded(d, full if rank == 0 else mine, full),
        "shape_on_one": lambda: save_sharded(d, {"w": torch.ones(3 if rank else 2, 2)}, full),
        "keys_differ": lambda: save_sharded(
            d, {f"k{rank}": torch.ones(2)}, {f"k{rank}": torch.ones(2)}
        ),
        "load_shape_on_one": lambda: load_sharded(
            where("params"), {"fc3.bias": torch.ones(5 if rank else 2)}
        ),
        "load_missing_on_one": lambda: load_sharded(
            where("params"), {"fc3.bias": torch.ones(1)} if rank else {"x": torch.ones(2)}
        ),
    }
    out = {name: outcome(case) for name, case in cases.items()}
    out["after"] = outcome(lambda: fr.distributed.all_reduce({"x": torch.ones(2)}, op="sum"))
    out["written"] = os.path.exists(d)
    return out


# --- the meta start --------------------------------------------------------------------------


class Block(nn.Module):
    """Attention, a norm, a linear layer and a parameter of its own that its reset draws."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2)  # its _reset_parameters sets out_proj's bias
        self.norm = nn.LayerNorm(8)
        self.ff = nn.Linear(8, 8)
        self.gain = nn.Parameter(torch.empty(8))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gain)


def zoo() -> nn.Module:
    """Torch's modules that draw (and one that keeps statistics), rows that pad on 2 and 3 ranks
    (11, 8, 32, 4 of them: a late rank of 3 holds no row of the conv), and a tied weight."""
    model = nn.Sequential(
        nn.Embedding(11, 8),
        Block(),
        nn.LSTM(8, 8),
        nn.BatchNorm1d(8),
        nn.Conv1d(8, 4, 3),
        nn.Linear(8, 11),
    )
    model[5].weight = model[0].weight  # tied after construction: the embedding's values
    return model


UNITS: list[list[str] | None] = [None, [""], ["1", "1.attn", "2"]]


def meta_zoo() -> nn.Module:
    with torch.device("meta"):
        return zoo()


@scenario
def meta_start(rank: int) -> dict[str, Any]:
    """``materialize`` from the meta device against the model built on the CPU from the same seed,
    sharded; and with ``seed=``, for the test to compare with one process."""
    meta = meta_zoo()
    before = {k: (id(p), p.device.type) for k, p in meta.named_parameters()}
    out: dict[str, Any] = {"by_units": []}
    for units in UNITS:
        torch.manual_seed(0)
        got = materialize(meta, units=units)
        after = torch.get_rng_state()
        torch.manual_seed(0)
        built = fr.state(zoo())
        out["by_units"].append(
            {
                "got": got,
                "expected": fr.State(rows_here(built.params), built.buffers),
                "generator": torch.equal(after, torch.get_rng_state()),
            }
        )
    torch.manual_seed(rank)  # the ranks' generators differ: seed= does not use them
    out["seeded"] = [materialize(meta, units=units, seed=5) for units in UNITS]
    out["unchanged"] = before == {k: (id(p), p.device.type) for k, p in meta.named_parameters()}
    return out


class Tracked(nn.Linear):
    """A linear layer that counts, as it resets, how many other full weights are still alive."""

    made: ClassVar[list[Any]] = []
    most: ClassVar[int] = 0

    def reset_parameters(self) -> None:
        import weakref

        super().reset_parameters()
        alive = [r for r in Tracked.made if r() is not None]
        Tracked.most = max(Tracked.most, len(alive))
        Tracked.made.append(weakref.ref(self.weight))


@scenario
def meta_memory(rank: int) -> dict[str, Any]:
    """Four units made one at a time: at each reset, no other unit's full weight is alive (the
    units' copies are dropped as they close), and every row kept has a storage of its own size;
    made as one unit, all four are alive together."""
    with torch.device("meta"):
        model = nn.Sequential(*(Tracked(64, 64) for _ in range(4)))
    out: dict[str, Any] = {}
    for units in (None, [""]):
        Tracked.made, Tracked.most = [], 0
        torch.manual_seed(0)
        got = materialize(model, units=units)
        out[str(units)] = Tracked.most
    out["own_storage"] = all(
        t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in got.params.values()
    )
    return out


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5), nn.Tanh(), nn.Linear(5, 3))


@scenario
def meta_zero2(rank: int) -> dict[str, Any]:
    """The ZeRO-2 loop started from the meta device is the loop started from the CPU model."""
    with torch.device("meta"):
        model = mlp()
    torch.manual_seed(0)
    mine = materialize(model).params
    like = {k: torch.empty_like(p, device="cpu") for k, p in fr.state(model).params.items()}
    params = fr.distributed.all_gather(mine, like)
    torch.manual_seed(0)
    cpu = mlp()
    reference = fr.state(cpu).params
    out = []
    for start in ((params, mine), (reference, fr.distributed.shard(reference))):
        p, m = start
        opt = adamw_init(m)
        step = fr.distributed.grad_and_value(loss_of(cpu), shard=True)
        steps = []
        for i in range(3):
            m, opt = adamw(m, step(p, *batch(rank, i))[0], opt)
            p = fr.distributed.all_gather(m, p)
            steps.append(p)
        out.append(steps)
    return {"from_meta": out[0], "from_cpu": out[1]}


@scenario
def meta_mistakes(rank: int) -> dict[str, Any]:
    """Ranks whose generators, units or modules differ: the same error on every rank."""
    meta = meta_zoo()
    torch.manual_seed(rank)
    out = {"generators": outcome(lambda: materialize(meta))}
    torch.manual_seed(0)
    out["units"] = outcome(lambda: materialize(meta, units=["1"] if rank else ["2"]))
    out["one_rank_wrong"] = outcome(lambda: materialize(meta, units=["x"] if rank else None))
    out["after"] = outcome(lambda: fr.distributed.all_reduce({"x": torch.ones(2)}, op="sum"))
    return out
