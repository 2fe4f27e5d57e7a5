"""Rank-side code of tests/test_layout_ddp.py: memory formats and 64-byte alignment on 2 gloo ranks.

The scenarios register with ``_dist_workers`` and run through its spawner
(loopback only, a file store, bounded timeouts, stragglers killed); ``main``
is the ranks' entry point, which imports this module so that they find
them. Strides and ``data_ptr() % 64`` are read on the rank (a result that
travels back through ``torch.save`` keeps its strides, not its address)
and returned as plain data beside the tensors. The oracle is
``DistributedDataParallel`` with ``torch.optim.SGD`` / ``AdamW``: its
gradients are bucket views laid out as the parameters are (a
``channels_last`` parameter gets a ``channels_last`` gradient), and its
parameters are tensors of their own, which torch's allocator aligns to 64
bytes.
"""

from __future__ import annotations

from typing import Any

import _dist_workers
import torch
import torch.nn.functional as F
from _dist_workers import _main, snapshot, spawn, unchanged
from _shard_workers import adamw, adamw_init
from torch import nn

import freplicate as fr

LR = 0.05
STEPS = 4
CL = torch.channels_last


def main(*args: Any) -> None:
    _main(*args)


def run(names: list[str], **kwargs: Any) -> dict[str, list[Any]]:
    return spawn(names, target=main, **kwargs)


SCENARIOS: list[str] = []


def scenario(f: Any) -> Any:
    SCENARIOS.append(f.__name__)
    return _dist_workers.scenario(f)


def layout(t: torch.Tensor) -> tuple[tuple[int, ...], int | None]:
    """What the parent checks of a result: its strides, and its address modulo 64 (``None``
    for an empty tensor, which has no data)."""
    return tuple(t.stride()), (t.data_ptr() % 64 if t.numel() else None)


def layouts(tree: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], int | None]]:
    return {k: layout(v) for k, v in tree.items()}


def sgd(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torch.optim.SGD's CPU update (``param.add_(grad, alpha=-lr)``), out of place, to the bit."""
    return {k: torch.add(p, grads[k], alpha=-LR) for k, p in params.items()}


# --- (a) a channels_last conv net, DDP's step and the functional one ----------------------


class ConvNet(nn.Module):
    def __init__(self, channels: int = 8, features: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.down = nn.Conv2d(channels, channels, 3, stride=2, padding=1)
        self.head = nn.Linear(channels * 4 * 4, features)
        self.out = nn.Linear(features, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv(x)))
        x = F.relu(self.down(x))
        return self.out(F.relu(self.head(x.flatten(1))))


def conv_net(rank: int) -> nn.Module:
    """A different init on every rank (broadcast makes them agree), parameters channels_last."""
    torch.manual_seed(rank)
    return ConvNet().to(memory_format=CL)


def images(rank: int, step: int, n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(n, 3, 8, 8, generator=g).to(memory_format=CL)
    return x, torch.randint(0, 4, (n,), generator=g)


def ddp_conv_steps(rank: int) -> list[dict[str, Any]]:
    ddp = nn.parallel.DistributedDataParallel(conv_net(rank), bucket_cap_mb=0.001)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    steps = []
    for i in range(STEPS):
        opt.zero_grad()
        x, y = images(rank, i)
        out = ddp(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        grads = {k: p.grad.clone() for k, p in ddp.module.named_parameters()}  # strides kept
        opt.step()
        steps.append(
            {
                "out": out.detach(),
                "loss": loss.detach(),
                "grads": grads,
                "grad_layouts": {k: layout(p.grad) for k, p in ddp.module.named_parameters()},
                "params": {k: p.detach().clone() for k, p in ddp.module.named_parameters()},
                "buffers": {k: b.clone() for k, b in ddp.module.named_buffers()},
            }
        )
    return steps


def fr_conv_steps(rank: int) -> list[dict[str, Any]]:
    model = conv_net(rank)
    start = fr.state(model)
    before = snapshot(start)
    state = fr.distributed.broadcast(start)  # DDP's construction: rank 0's values
    assert unchanged(start, before)

    def loss_fn(params: Any, buffers: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        out, new = fr.apply(model, fr.State(params, buffers), x)
        return F.cross_entropy(out, y), (out, new.buffers)

    step = fr.distributed.grad_and_value(loss_fn, has_aux=True, bucket_cap_mb=0.001)
    steps = []
    params, buffers = state.params, state.buffers
    for i in range(STEPS):
        buffers = fr.distributed.sync_buffers(buffers)  # DDP's broadcast_buffers=True
        grads, (loss, (out, buffers)) = step(params, buffers, *images(rank, i))
        params = sgd(params, grads)
        steps.append(
            {
                "out": out,
                "loss": loss.detach(),
                "grads": grads,
                "grad_layouts": layouts(grads),
                "params": params,
                "buffers": buffers,
            }
        )
    return steps


@scenario
def channels_last_conv_beside_ddp(rank: int) -> dict[str, Any]:
    """Four SGD steps of the channels_last conv net: DDP's and fr.distributed's, step by step."""
    return {
        "ddp": ddp_conv_steps(rank),
        "fr": fr_conv_steps(rank),
        "start": layouts(fr.state(conv_net(rank)).params),
        "broadcast": layouts(fr.distributed.broadcast(fr.state(conv_net(rank))).params),
    }


# --- (b) every collective's results: strides kept where the kind allows, 64-byte aligned ---

DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
)


def formats(rank: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors of every memory format the tests name, of odd sizes (so that places need padding)."""
    g = torch.Generator().manual_seed(10 * rank + DTYPES.index(dtype))

    def draw(*shape: int) -> torch.Tensor:
        if dtype == torch.bool:
            return torch.rand(shape, generator=g) > 0.5
        if dtype.is_floating_point or dtype.is_complex:
            return torch.randn(shape, generator=g).to(dtype)
        return torch.randint(0, 100, shape, generator=g).to(dtype)

    return {
        "a_odd": draw(3),
        "b_channels_last": draw(5, 3, 2, 3).to(memory_format=CL),
        "c_transposed": draw(7, 5).t(),  # a Linear weight stored transposed: dim 0 innermost
        "d_channels_last_3d": draw(3, 2, 2, 3, 2).to(memory_format=torch.channels_last_3d),
        "e_depthwise": draw(4, 1, 3, 3).to(memory_format=CL),  # channels_last of 1 channel
        "f_scalar": draw(),
        "g_contiguous": draw(3, 5),
        "h_empty": draw(0, 3),
    }


def observed(results: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
    return {name: {"values": tree, "layouts": layouts(tree)} for name, tree in results.items()}


@scenario
def collectives_keep_formats(rank: int) -> dict[str, Any]:
    """``broadcast``, ``all_reduce``, ``reduce_scatter`` and ``all_gather`` of every dtype."""
    out: dict[str, Any] = {}
    for dtype in DTYPES:
        tree = formats(rank, dtype)
        before = snapshot(tree)
        results = {
            "broadcast": fr.distributed.broadcast(tree),
            "all_reduce": fr.distributed.all_reduce(tree, op="sum"),
            "reduce_scatter": fr.distributed.reduce_scatter(tree, op="sum"),
            "all_gather": fr.distributed.all_gather(fr.distributed.shard(tree), tree),
        }
        if dtype.is_floating_point or dtype.is_complex:
            results["all_reduce_mean"] = fr.distributed.all_reduce(tree)
            results["small_buckets"] = fr.distributed.all_reduce(tree, bucket_cap_mb=1e-5)
        assert unchanged(tree, before)
        out[str(dtype)] = {"inputs": tree, **observed(results)}
    return out


# --- (c) large layers: ZeRO-2 and DDP's broadcast start, beside DDP, bit for bit ----------


def large_net(rank: int) -> nn.Module:
    """A conv of 256 channels, then Linear layers of 256 -> 512 -> 256 features, and a head."""
    torch.manual_seed(rank)
    layers = [nn.Conv2d(3, 256, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    for features, out in ((256, 512), (512, 256)):
        layers += [nn.Linear(features, out), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(256, 10))


#: rows per rank at each step: a row alone takes the matrix-vector kernels, whose rounding
#: depends on where the parameters start (``unaligned_parameters_round_differently``)
ROWS = (1, 8, 1, 3)


def large_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    n = ROWS[step]
    return torch.randn(n, 3, 6, 6, generator=g), torch.randint(0, 10, (n,), generator=g)


def ddp_large(rank: int, optimizer: str) -> list[dict[str, Any]]:
    ddp = nn.parallel.DistributedDataParallel(large_net(rank))
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
    else:
        from _shard_workers import ALR, WD

        opt = torch.optim.AdamW(ddp.parameters(), lr=ALR, weight_decay=WD)
    steps = []
    for i in range(STEPS):
        opt.zero_grad()
        x, y = large_batch(rank, i)
        out = ddp(x)
        F.cross_entropy(out, y).backward()
        opt.step()
        params = {k: p.detach().clone() for k, p in ddp.module.named_parameters()}
        steps.append({"out": out.detach(), "params": params})
    return steps


def zero2_large(rank: int, optimizer: str) -> list[dict[str, Any]]:
    """docs/sharding.md's ZeRO-2 loop from a broadcast start: every step computes on parameters
    that ``all_gather`` (or, first, ``broadcast``) left in its buffers."""
    model = large_net(rank)
    params = fr.distributed.broadcast(fr.state(model).params)

    def loss_fn(params: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        out, _ = fr.apply(model, fr.State(params, {}), x)
        return F.cross_entropy(out, y), out

    step = fr.distributed.grad_and_value(loss_fn, shard=True, has_aux=True)
    mine = fr.distributed.shard(params)
    opt_state = adamw_init(mine)
    steps = []
    for i in range(STEPS):
        computed_on = layouts(params)
        grads, (_, out) = step(params, *large_batch(rank, i))
        if optimizer == "sgd":
            mine = sgd(mine, grads)
        else:
            mine, opt_state = adamw(mine, grads, opt_state)
        params = fr.distributed.all_gather(mine, params)
        steps.append({"out": out, "params": params, "computed_on": computed_on})
    return steps


@scenario
def large_layers_beside_ddp(rank: int) -> dict[str, Any]:
    """Four steps of SGD and of AdamW: DDP against ZeRO-2 on gathered parameters."""
    return {
        "ddp_sgd": ddp_large(rank, "sgd"),
        "zero2_sgd": zero2_large(rank, "sgd"),
        "ddp_adamw": ddp_large(rank, "adamw"),
        "zero2_adamw": zero2_large(rank, "adamw"),
    }


@scenario
def unaligned_parameters_round_differently(rank: int) -> list[bool]:
    """Whether this machine's kernels would tell the bitwise test of ``large_layers_beside_ddp``
    a misaligned parameter from an aligned one: each step's forward and backward on the
    parameters as views 8 and 40 bytes past a 64-byte boundary (the old wire format's
    offsets) against aligned copies. Not a test of fr: where every answer is ``False``, the
    bitwise test cannot catch a misalignment on this machine."""
    model = large_net(0)
    params = {k: p.detach() for k, p in model.named_parameters()}
    out = []
    for i in range(STEPS):
        x, y = large_batch(rank, i)
        results = []
        for offset in (0, 2, 10):  # floats: 0, 8 and 40 bytes
            placed = {}
            for k, p in params.items():
                buf = torch.empty(offset + p.numel())
                placed[k] = buf[offset:].view_as(p).copy_(p).requires_grad_()
            loss = F.cross_entropy(torch.func.functional_call(model, placed, (x,)), y)
            results.append(torch.autograd.grad(loss, list(placed.values())))
        out.append(any(not all(map(torch.equal, r, results[0])) for r in results[1:]))
    return out


@scenario
def formats_differ_across_ranks(rank: int) -> Any:
    """Rank 0's tensor channels_last, rank 1's contiguous: the memory order is part of the layout
    the ranks agree on, so every rank refuses, naming the path."""
    x = torch.randn(2, 3, 4, 5)
    tree = {"w": x.to(memory_format=CL) if rank == 0 else x}
    try:
        fr.distributed.all_reduce(tree)
    except ValueError as err:
        return str(err)
    return None
