"""Rank side of ``test_evaluation.py``: train, evaluate, train again, freplicate beside DDP.

Run on the ranks of a ``fr.testing.RankPool``. Every rank trains a
BatchNorm conv net on its own batches twice over, the way the guides write
the loop (``fr.distributed.sync_buffers`` before each step's forward and
before an evaluation) and with ``DistributedDataParallel`` (its default
buffer sync) and ``torch.optim.SGD``; evaluates under ``torch.no_grad`` in
eval mode on its own validation batches, the validation loss averaged over
the ranks; trains again; evaluates again. Everything either side computes
comes back, for the test to compare bit for bit.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import freplicate as fr

LR = 0.1


class ConvNet(nn.Module):
    """A conv layer with BatchNorm (running statistics to sync), pooled, a linear head.

    ``dropout`` puts a dropout layer before the head (random draws to match).
    """

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3)
        self.bn = nn.BatchNorm2d(6)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.head = nn.Linear(6 * 3 * 3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, 3, 8, 8)
        features = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.head(self.drop(features.flatten(1)))


def batch(rank: int, split: str, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``i``-th batch of ``split``: each rank its own data, each split its own."""
    g = torch.Generator().manual_seed(1000 * rank + 100 * ("train", "val").index(split) + i)
    # a shift per rank, so that the ranks' BatchNorm statistics differ clearly
    return torch.randn(6, 3, 8, 8, generator=g) + rank, torch.randint(0, 4, (6,), generator=g)


def train_evaluate_train(sync_before_evaluation: bool) -> dict[str, Any]:
    """3 steps, an evaluation, 2 steps, an evaluation; both sides' numbers, phase by phase.

    ``sync_before_evaluation=False`` is the port that forgets the sync DDP
    does on the first forward after training.
    """
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = ConvNet()
    ddp = DistributedDataParallel(copy.deepcopy(model))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR, foreach=False)

    state = fr.distributed.broadcast(fr.state(model))
    params, buffers = state.params, state.buffers

    def loss_fn(params: Any, buffers: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        out, new = fr.apply(model, fr.State(params, buffers), x)
        return F.cross_entropy(out, y), new.buffers

    step = fr.distributed.grad_and_value(loss_fn, has_aux=True)
    got: dict[str, Any] = {side: {"losses": [], "outputs": [], "val": []} for side in ("fr", "ddp")}
    done = 0

    def train(steps: int) -> None:
        nonlocal params, buffers, done
        for _ in range(steps):
            x, y = batch(rank, "train", done)
            done += 1
            optimizer.zero_grad()
            theirs = F.cross_entropy(ddp(x), y)
            theirs.backward()
            optimizer.step()
            got["ddp"]["losses"].append(theirs.detach())

            buffers = fr.distributed.sync_buffers(buffers)  # as DDP, before each step's forward
            grads, (loss, buffers) = step(params, buffers, x, y)
            params = {k: p.add(grads[k], alpha=-LR) for k, p in params.items()}  # SGD's update
            got["fr"]["losses"].append(loss)

    def evaluate() -> None:
        nonlocal buffers
        model.eval()
        ddp.eval()
        with torch.no_grad():
            if sync_before_evaluation:  # DDP syncs on the first forward after training
                buffers = fr.distributed.sync_buffers(buffers)
            for side, forward in (
                ("ddp", ddp),
                ("fr", lambda x: fr.apply(model, fr.State(params, buffers), x)[0]),
            ):
                losses = []
                for i in range(2):
                    x, y = batch(rank, "val", i)
                    out = forward(x)
                    got[side]["outputs"].append(out)
                    losses.append(F.cross_entropy(out, y))
                val = torch.stack(losses).mean()
                dist.all_reduce(val)  # the validation loss over the ranks
                got[side]["val"].append(val / dist.get_world_size())
        model.train()
        ddp.train()

    train(3)
    evaluate()
    train(2)
    evaluate()
    got["fr"].update(params=params, buffers=buffers)
    got["ddp"].update(
        params={k: p.detach() for k, p in ddp.module.named_parameters()},
        buffers={k: b.detach() for k, b in ddp.module.named_buffers()},
    )
    return got
