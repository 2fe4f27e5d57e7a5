"""Rank-side code of tests/test_clip.py: sharded clipping of every dtype mix on gloo ranks.

The scenarios register with ``_dist_workers`` and run through its spawner
(loopback only, a file store, bounded timeouts, stragglers killed), on 2
and 3 ranks; ``main`` is the ranks' entry point. The oracle is
``clip_grad_norm_`` on the full gradients: every rank builds the same full
gradients from fixed seeds (``mix_grads``, which the parent calls too),
clips its rows with ``fr.distributed.clip_grad_norm`` and returns them
beside torch's rows; the test compares. The gradients and the comparison
are the clipping properties' (``property_tests/_property_clip.py``).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.distributed as dist
from _dist_workers import _main, scenario, snapshot, spawn, unchanged
from _property_clip import gradients
from _shard_workers import everyone, rows_of
from torch import nn

import freplicate as fr

NORMS = (2.0, 1.0, math.inf, 0.0, 3.0, -math.inf, 0.5)
MAX_NORMS = (0.05, 1e6)
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
MIXES = {
    "f32+bf16": (F32, BF16),
    "f32+f16": (F32, F16),
    "bf16": (BF16,),
    "f16": (F16,),
    "bf16+f16": (BF16, F16),
    "f64+f32": (F64, F32),
    "f64+bf16": (F64, BF16),
    "f64+f16": (F64, F16),
    "c64+bf16": (torch.complex64, BF16),
}
# two large leaves (333 elements: a bfloat16 count of non-zeros above 256 rounds), rows
# that divide neither 2 nor 3, fewer rows than ranks, a 0-dim leaf, an empty one
SHAPES = [(37, 9), (300,), (5, 3), (1, 4), (), (7, 2), (0, 3), (3, 5)]


def main(*args: Any) -> None:
    _main(*args)


def run(names: list[str], *, world: int = 2, **kwargs: Any) -> dict[str, list[Any]]:
    return spawn(names, target=main, world=world, **kwargs)


def mix_grads(mix: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """The full gradients of ``mix`` (its dtypes in turn over ``SHAPES``), the same on every rank."""
    return gradients(MIXES[mix], SHAPES, seed)


def torch_clip(grads: dict[str, torch.Tensor], max_norm: float, p: float) -> Any:
    """``clip_grad_norm_`` on parameters whose ``.grad`` are copies of ``grads``, or None where it
    raises (an empty gradient has no max, min or negative power)."""
    params = {k: nn.Parameter(torch.zeros_like(g)) for k, g in grads.items()}
    for k, q in params.items():
        q.grad = grads[k].clone()
    try:
        total = torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm, norm_type=p)
    except RuntimeError:
        return None
    return {k: q.grad for k, q in params.items()}, total


@scenario
def clip_dtype_mixes(rank: int) -> dict[Any, Any]:
    """Every dtype mix, norm type and max norm: the shards' total and clipped rows beside
    ``clip_grad_norm_``'s on the full gradients, and every rank's total."""
    world = dist.get_world_size()
    out: dict[Any, Any] = {}
    for mix in MIXES:
        full = mix_grads(mix)
        shards = fr.distributed.shard(full)
        snap = snapshot(shards)
        for p in NORMS:
            for max_norm in MAX_NORMS:
                got, total = fr.distributed.clip_grad_norm(shards, max_norm, norm_type=p)
                torch_result = torch_clip(full, max_norm, p)
                out[(mix, p, max_norm)] = {
                    "got": got,
                    "total": total,
                    "totals": everyone(total),
                    "want": None if torch_result is None else rows_of(torch_result[0], rank, world),
                    "want_total": None if torch_result is None else torch_result[1],
                }
        out[(mix, "unchanged")] = unchanged(shards, snap)
    return out


class HalfAndFull(nn.Module):
    """A bfloat16 body and a float32 head: gradients of two dtypes, as a mixed-precision model."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 33), nn.Tanh(), nn.Linear(33, 16)).bfloat16()
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x.bfloat16()).float())


@scenario
def clip_mixed_model(rank: int) -> dict[str, Any]:
    """DDP's reduced gradients of a bfloat16 + float32 model, clipped by ``clip_grad_norm_`` on
    the DDP module and by ``fr.distributed.clip_grad_norm`` on their rows; and the ZeRO-2
    shards of ``grad_and_value(shard=True)`` clipped beside them."""
    from torch.nn.parallel import DistributedDataParallel

    world = dist.get_world_size()
    torch.manual_seed(0)
    model = HalfAndFull()
    g = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
    ddp = DistributedDataParallel(copy.deepcopy(model))
    nn.functional.cross_entropy(ddp(x), y).backward()
    full = {k: q.grad.clone() for k, q in ddp.module.named_parameters()}
    out: dict[str, Any] = {"full": full}
    for p in (2.0, 1.0, math.inf):
        got, total = fr.distributed.clip_grad_norm(fr.distributed.shard(full), 0.05, norm_type=p)
        want_total = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.05, norm_type=p)
        want = {k: q.grad.clone() for k, q in ddp.module.named_parameters()}
        for k, q in ddp.module.named_parameters():  # back to the unclipped gradients
            q.grad.copy_(full[k])
        out[p] = {
            "got": got,
            "total": total,
            "want": rows_of(want, rank, world),
            "want_total": want_total,
        }

    params = fr.state(model).params

    def loss_fn(params: dict[str, torch.Tensor]) -> torch.Tensor:
        logits, _ = fr.apply(model, fr.State(params, {}), x)
        return nn.functional.cross_entropy(logits, y)

    shards, _ = fr.distributed.grad_and_value(loss_fn, shard=True)(params)
    out["zero2"] = {"shards": shards, "clipped": fr.distributed.clip_grad_norm(shards, 0.05)}
    return out
