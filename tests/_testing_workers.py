"""Rank side of ``test_testing_ddp.py``: functions for ``fr.testing.RankPool``, modules to check.

Each function reads its rank from the group it runs in; the modules are
what a user would hand ``fr.testing.check_against_ddp`` that go wrong in
ways it must report (the one that goes right is ``_eval_workers.ConvNet``).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch import nn


def raise_on(rank: int, error: type[Exception]) -> int:
    """Raise ``error`` on ``rank`` before any collective; the others answer their rank."""
    if dist.get_rank() == rank:
        raise error("drawn to fail")
    return dist.get_rank()


def raise_while_the_others_wait(rank: int) -> None:
    """``rank`` raises; the others wait in a barrier it never joins."""
    if dist.get_rank() == rank:
        raise ValueError("left before the barrier")
    dist.barrier()


def die_on(rank: int) -> None:
    """``rank`` exits without a word, the others wait in a barrier."""
    if dist.get_rank() == rank:
        os._exit(3)
    dist.barrier()


def sleep(seconds: float) -> None:
    time.sleep(seconds)


def pid() -> int:
    return os.getpid()


def add_in_place(t: torch.Tensor) -> torch.Tensor:
    """Modifies its own copy of the argument: the caller's must stay as it was."""
    return t.add_(1)


class HeldWeight(nn.Module):
    """Uses its weight through a list, not the attribute: ``fr.apply`` cannot rebind it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.held = [self.lin.weight]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.held[0].T + self.lin.bias


class ScalesItsInput(nn.Module):
    """Modifies its input in place (values unchanged, but its ``_version`` moves)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.mul_(1.0))


class NoFloatOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).argmax(1)


def first_output(out: torch.Tensor) -> torch.Tensor:
    """A user's loss: the first output element."""
    return out.flatten()[0]


class ByRank(nn.Module):
    """A linear model whose output scales with the rank it runs on (1 + 1e-3 * rank): what
    ``fr.testing.check_reproducible`` must report, naming a rank of the larger world."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return self.fc(x) * (1 + 1e-3 * rank)
