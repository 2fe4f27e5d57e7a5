"""Rank-side code of tests/test_reproducible.py: one training run on W gloo ranks, and refusals.

The ranks are ``_dist_workers.spawn``'s (loopback only, a file store, bounded
timeouts, stragglers killed), one thread each. ``spawn`` passes the names as
``Scenario`` strings, whose unpickling in each rank imports this module and
so registers its scenarios. ``train`` is also what the test runs in its own
process, without a group: the one-process run the ranks must equal.
"""

from __future__ import annotations

import functools
from typing import Any

import _dist_workers
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import freplicate as fr
from benchmarks.bench_reproducible import sent_by

BATCH = 32  # the global batch: 8 grains of 4, so 8, 4 and 2 grains a rank on 1, 2 and 4 ranks
GRAIN = 4
STEPS = 4
SEED = 7


class Scenario(str):
    """A scenario's name; unpickling it imports this module (see the module's text)."""

    __slots__ = ()


def spawn(names: list[str], **kwargs: Any) -> dict[str, list[Any]]:
    return _dist_workers.spawn([Scenario(n) for n in names], **kwargs)


def scenario(f: Any) -> Any:
    return _dist_workers.scenario(f)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.25), nn.Linear(64, 64), nn.ReLU(),
        nn.Dropout(0.25), nn.Linear(64, 8),
    )  # fmt: skip


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch, the same on every rank and world size."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 16, generator=g), torch.randint(0, 8, (BATCH,), generator=g)


def adamw(
    params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], state: dict[str, Any], t: int
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """AdamW's update, out of place, elementwise (so the same bits wherever it runs)."""
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.999, 1e-8, 0.01
    m = {k: state["m"][k] * b1 + grads[k] * (1 - b1) for k in params}
    v = {k: state["v"][k] * b2 + grads[k] * grads[k] * (1 - b2) for k in params}
    new = {}
    for k, p in params.items():
        mhat = m[k] / (1 - b1**t)
        vhat = v[k] / (1 - b2**t)
        new[k] = p * (1 - lr * wd) - lr * mhat / (vhat.sqrt() + eps)
    return new, {"m": m, "v": v}


def train(mode: str, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """``STEPS`` AdamW steps of the MLP; this rank's rows of each global batch.

    ``mode``: ``"grain"`` (reproducible), ``"default"`` (DDP's reduction, the
    dropout masks drawn from each rank's own generator, seeded alike) or
    ``"eval"`` (the default reduction, dropout off: only the summation order
    differs between world sizes) or ``"zero2"`` (reproducible, ``shard=True``:
    AdamW on this rank's rows, the parameters all-gathered after each step;
    the moments come back gathered too) or ``"zero3"`` (reproducible, the loss
    through ``apply_sharded`` with each Linear a unit: AdamW on this rank's
    shards, which only the end gathers) or ``"zero3_weighted"`` (the same,
    with ``weight=`` and ``accumulate`` over two unequal micro-batches).
    """
    net = model()
    if mode == "eval":
        net.eval()
    params = {k: v.detach().clone() for k, v in fr.state(net).params.items()}
    state = {"m": {k: torch.zeros_like(p) for k, p in params.items()}}
    state["v"] = {k: torch.zeros_like(p) for k, p in params.items()}

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out, _ = fr.apply(net, fr.State(p, {}), x)
        return F.cross_entropy(out, y)

    def sharded_loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out, _ = fr.distributed.apply_sharded(net, fr.State(p, {}), x, units=["0", "3", "6"])
        return F.cross_entropy(out, y)

    zero2 = mode in ("zero2", "zero2_clip")
    zero3 = mode.startswith("zero3")
    grained: dict[str, Any] = {}
    if mode in ("grain", "zero2", "zero2_clip", "accumulate", "zero3", "zero3_weighted"):
        grained = {"grain": GRAIN, "seed": SEED}
    if mode in ("accumulate", "zero3_weighted"):  # each grain weighted by its first 4 classes
        grained["weight"] = _counted
    fn = sharded_loss if zero3 else loss_fn
    step = fr.distributed.grad_and_value(fn, shard=zero2, **grained)
    torch.manual_seed(SEED)  # the default mode's dropout: each rank's own generator
    rows = BATCH // world
    full = params
    mine = fr.distributed.shard(params) if zero2 or zero3 else params
    state = fr.distributed.shard(state) if zero2 or zero3 else state
    if zero3:
        params = mine
    for t in range(1, STEPS + 1):
        x, y = batch(t)
        x, y = x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
        if mode in ("accumulate", "zero3_weighted"):  # two unequal micro-batches: one block
            cut = GRAIN  # one grain, then the rest
            grads, _ = step.accumulate(params, [(x[:cut], y[:cut]), (x[cut:], y[cut:])])
        else:
            grads, _ = step(params, x, y)
        if mode == "zero2_clip":  # the rows' norm by rows: the same bits on every world size
            grads, norm = fr.distributed.clip_grad_norm(grads, CLIP, reproducible=True)
            assert float(norm) > CLIP  # it clips
        mine, state = adamw(mine, grads, state, t)
        params = fr.distributed.all_gather(mine, params) if zero2 else mine
    if zero3:
        params = fr.distributed.all_gather(mine, full)
    if zero2 or zero3:
        state = {s: fr.distributed.all_gather(state[s], params) for s in ("m", "v")}
    return {"params": params, "state": state}


def _train_on_ranks(mode: str, rank: int) -> dict[str, Any]:
    return train(mode, rank, dist.get_world_size())


MODES = ("grain", "default", "eval", "zero2", "accumulate", "zero2_clip", "zero3", "zero3_weighted")
CLIP = 0.05  # below every step's norm


def _counted(p: Any, x: torch.Tensor, y: torch.Tensor) -> float:
    """A grain's weight: its samples of the first four classes (0 for some grains)."""
    return float((y < 4).sum())


for _mode in MODES:  # scenarios "train_grain", "train_default", "train_eval"
    _dist_workers.SCENARIOS[f"train_{_mode}"] = functools.partial(_train_on_ranks, _mode)


@scenario
def sent(rank: int) -> dict[str, int]:
    """The bytes this rank sends in one reproducible step (all-reduced, then ZeRO-2), counted as
    ``freplicate bench reproducible`` counts them, and a ring all-reduce's."""
    world = dist.get_world_size()
    net = model()
    params = {k: v.detach().clone() for k, v in fr.state(net).params.items()}
    n = sum(p.numel() * p.element_size() for p in params.values())

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return fr.apply(net, fr.State(p, {}), x)[0].square().mean()

    def step(shard: bool) -> Any:  # (the MLP's rows divide by 4: no padding rows)
        grad = fr.distributed.grad_and_value(loss_fn, grain=GRAIN, shard=shard)
        return lambda: grad(params, torch.randn(GRAIN, 16))

    def sharded(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        out, _ = fr.distributed.apply_sharded(net, fr.State(p, {}), x, units=["0", "3", "6"])
        return out.square().mean()

    zero3 = fr.distributed.grad_and_value(sharded, grain=GRAIN)
    shards = fr.distributed.shard(params)
    ring = n * (world - 1) // world  # a ring reduce-scatter's; an all-reduce's twice that
    return {
        "sent": sent_by(step(False)), "ring": 2 * ring,
        "sent_shard": sent_by(step(True)), "ring_shard": ring,
        "sent_zero3": sent_by(lambda: zero3(shards, torch.randn(GRAIN, 16))),
    }  # fmt: skip


@scenario
def refusals(rank: int) -> dict[str, Any]:
    """What the mode refuses, on every rank alike; ``("raised", type, text)`` or a value."""
    net = model()
    params = {k: v.detach().clone() for k, v in fr.state(net).params.items()}

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return fr.apply(net, fr.State(p, {}), x)[0].square().mean()

    def failing(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if rank == 1:
            raise KeyError("rank 1's loss")
        return loss_fn(p, x)

    shards = fr.distributed.shard(params)
    extra = torch.ones(())

    def outside(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        # one differentiated tensor the gathers never see: its gradient is this rank's alone
        out, _ = fr.distributed.apply_sharded(net, fr.State(p["net"], {}), x, units=["0", "3"])
        return out.square().mean() * p["extra"]

    def sharded_loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return fr.distributed.apply_sharded(net, fr.State(p, {}), x)[0].square().mean()

    def twice(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return sharded_loss(p, x) + sharded_loss(p, 2 * x)

    out: dict[str, Any] = {}
    three = dist.new_group([0, 1, 2])  # collective: every rank makes it
    cases = {
        "zero3_twice": lambda: fr.distributed.grad_and_value(twice, grain=4)(
            shards, torch.randn(8, 16)
        ),
        # rank 1's batch does not cut into grains: said before any grain gathers, not a hang
        "zero3_bad_batch": lambda: fr.distributed.grad_and_value(sharded_loss, grain=4)(
            shards, torch.randn(6 if rank == 1 else 8, 16)
        ),
        "zero3_outside": lambda: fr.distributed.grad_and_value(outside, grain=4)(
            {"net": shards, "extra": extra}, torch.randn(8, 16)
        ),
        "zero3_shard": lambda: fr.distributed.grad_and_value(sharded_loss, grain=4, shard=True)(
            shards, torch.randn(8, 16)
        ),
        "three_ranks": lambda: fr.distributed.grad_and_value(loss_fn, grain=4, group=three)(
            params, torch.randn(8, 16)
        ),
        "uneven": lambda: fr.distributed.grad_and_value(loss_fn, grain=4)(
            params, torch.randn(16 if rank == 0 else 8, 16)
        ),
        "failing": lambda: fr.distributed.grad_and_value(failing, grain=4)(
            params, torch.randn(8, 16)
        ),
        "unsynced": lambda: fr.distributed.grad_and_value(loss_fn, grain=4)(
            {k: v + rank for k, v in params.items()}, torch.randn(8, 16)
        ),
        "short": lambda: fr.distributed.grad_and_value(loss_fn, grain=4).accumulate(
            params, iter([(torch.randn(4, 16),)] * (1 if rank == 1 else 2)), count=2
        ),
        "after": lambda: fr.distributed.grad_and_value(loss_fn, grain=4)(params, torch.ones(8, 16))[
            0
        ],
    }
    for name, case in cases.items():
        if name == "three_ranks" and rank == 3:
            continue
        try:
            out[name] = ("returned", case())
        except BaseException as err:
            out[name] = ("raised", _dist_workers._kind(err), str(err))
    return out


def odd_tree() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Parameters of two dtypes whose flat buffers split unevenly (9 and 5 elements), a batch."""
    g = torch.Generator().manual_seed(3)
    params = {
        "a": torch.randn((), generator=g),
        "b": torch.randn(3, generator=g, dtype=torch.float64),
        "c": torch.randn(8, generator=g),
        "d": torch.randn(2, 4, generator=g, dtype=torch.float64)[:, :1].squeeze(1),
    }
    return params, torch.randn(16, 1, generator=g)


def odd_loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    s = p["a"] * x.sum() + (p["b"].sum() * x.double()).sin().sum().float()
    return s + (p["c"] * x).cos().mean() + (p["d"].sum() * x.double()).exp().mean().float()


def odd_grads(
    rank: int = 0, world: int = 1, group: Any = None, shard: bool = False
) -> dict[str, torch.Tensor]:
    params, x = odd_tree()
    rows = x.shape[0] // world
    step = fr.distributed.grad_and_value(odd_loss, grain=2, group=group, shard=shard)
    return step(params, x[rank * rows : (rank + 1) * rows])[0]  # type: ignore[no-any-return]


@scenario
def odd_sizes(rank: int) -> dict[str, Any]:
    world = dist.get_world_size()
    return {"all": odd_grads(rank, world), "rows": odd_grads(rank, world, shard=True)}


@scenario
def subgroup(rank: int) -> dict[str, torch.Tensor] | None:
    """Ranks 3 and 1 of 4, a group of two in that order: partners found by group rank."""
    pair = dist.new_group([3, 1])  # collective: every rank makes it
    if rank not in (1, 3):
        return None
    return odd_grads(dist.get_rank(pair), 2, group=pair)


def resumed(path: str, save_after: int | None) -> dict[str, Any]:
    """ZeRO-2 in the reproducible mode on a ``fr.testing.RankPool``'s ranks, through a checkpoint.

    ``save_after=t``: steps 1 to ``t`` from the start, then ``save_sharded`` of this rank's
    rows of the parameters and moments (and ``t``) to ``path``; ``None``: ``load_sharded``
    from ``path`` on this world size, ``step.grains.step`` set to the saved ``t`` (the
    dropout masks the interrupted run would have drawn), steps ``t + 1`` to ``STEPS``. The
    parameters and moments at the end, gathered.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    net = model()
    full = {k: v.detach().clone() for k, v in fr.state(net).params.items()}
    zeros = {k: torch.zeros_like(p) for k, p in full.items()}

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(fr.apply(net, fr.State(p, {}), x)[0], y)

    step = fr.distributed.grad_and_value(loss_fn, grain=GRAIN, seed=SEED, shard=True)
    like = {"params": full, "m": zeros, "v": zeros, "t": 0}
    if save_after is None:
        got = fr.distributed.load_sharded(path, fr.distributed.shard(like))
        mine, state, done = got["params"], {"m": got["m"], "v": got["v"]}, got["t"]
        params = fr.distributed.all_gather(mine, full)
        step.grains.step = done
    else:
        params, done = full, 0
        mine, state = fr.distributed.shard(full), fr.distributed.shard({"m": zeros, "v": zeros})
    rows = BATCH // world
    for t in range(done + 1, (save_after or STEPS) + 1):
        x, y = batch(t)
        grads, _ = step(
            params, x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
        )
        mine, state = adamw(mine, grads, state, t)
        params = fr.distributed.all_gather(mine, params)
    if save_after is not None:
        tree = {"params": mine, "m": state["m"], "v": state["v"], "t": save_after}
        fr.distributed.save_sharded(path, tree, like)
    gathered = {s: fr.distributed.all_gather(state[s], params) for s in ("m", "v")}
    return {"params": params, "state": gathered}


def clip_norms(rank: int = 0, world: int = 1) -> dict[str, list[torch.Tensor]]:
    """The total norm of 24 random gradients (this rank's rows) by both ways of
    ``fr.distributed.clip_grad_norm``, for p = 2, 1, 3, inf and 0."""
    g = torch.Generator().manual_seed(11)
    full = {f"t{i}": torch.randn(37 + i, 129, generator=g) * 10.0 ** (i % 5 - 2) for i in range(24)}
    full["s"] = torch.tensor(0.5)
    rows = fr.distributed.shard(full) if world > 1 else full
    out: dict[str, list[torch.Tensor]] = {"default": [], "reproducible": []}
    for p in (2.0, 1.0, 3.0, float("inf"), 0.0):
        for way in out:
            _, norm = fr.distributed.clip_grad_norm(
                rows, 1.0, norm_type=p, reproducible=way == "reproducible"
            )
            out[way].append(norm)
    return out


@scenario
def norms(rank: int) -> dict[str, list[torch.Tensor]]:
    return clip_norms(rank, dist.get_world_size())


class Odd(nn.Module):
    """Rows that split unevenly (5: 2, 2, 1 and 0 on 4 ranks), a 0-dim parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 5)
        self.b = nn.Linear(5, 8)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) * self.scale


def odd_zero3(rank: int = 0, world: int = 1) -> dict[str, torch.Tensor]:
    """One reproducible ZeRO-3 gradient of ``Odd`` (``b.bias`` frozen: gathered, never
    reduced), every rank's rows gathered whole."""
    net = Odd()
    params = {k: v.detach().clone() for k, v in fr.state(net).params.items()}
    shards = fr.distributed.shard(params)
    frozen = {"b.bias": shards.pop("b.bias")}

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out, _ = fr.distributed.apply_sharded(net, fr.State({**p, **frozen}, {}), x, units=["a"])
        return F.cross_entropy(out, y)

    x, y = batch(1)
    rows = BATCH // world
    x, y = x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
    given = [*shards.values(), *frozen.values(), x, y]  # no input written (``_version``)
    versions, before = [t._version for t in given], [t.clone() for t in given]
    step = fr.distributed.grad_and_value(loss_fn, grain=GRAIN, seed=SEED)
    grads, _ = step(shards, x, y)
    assert [t._version for t in given] == versions
    assert all(map(torch.equal, given, before))
    return fr.distributed.all_gather(grads, {k: params[k] for k in grads})


@scenario
def zero3_odd(rank: int) -> dict[str, torch.Tensor]:
    return odd_zero3(rank, dist.get_world_size())


def zero3_on_ranks(mode: str) -> dict[str, Any]:
    """``train(mode)`` on a ``fr.testing.RankPool``'s rank."""
    return train(mode, dist.get_rank(), dist.get_world_size())
