"""Property tests for my model under fr.distributed: it trains and evaluates as under DDP."""

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from freplicate.testing import RankPool, check_against_ddp


class MyConvNet(nn.Module):
    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Sequential(nn.Dropout(0.2), nn.Linear(8, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


@pytest.fixture(scope="module")
def ranks() -> Iterator[RankPool]:
    # two gloo ranks on this machine (loopback only), started once for every example
    with RankPool(2) as pool:
        yield pool


def images(seed: int, rows: int, side: int) -> torch.Tensor:
    return torch.randn(rows, 3, side, side, generator=torch.Generator().manual_seed(seed))


PHASES = st.lists(st.sampled_from(["step", "eval", "no_grad"]), min_size=1, max_size=4)


@settings(deadline=None)
@given(
    init=st.integers(0, 2**16),
    seeds=st.lists(st.integers(0, 2**16), min_size=2, max_size=2),  # one batch per rank
    rows=st.integers(2, 4),  # BatchNorm's training mode needs 2 rows on every rank
    side=st.integers(3, 6),
    phases=PHASES,
)
def test_my_conv_net_trains_and_evaluates_as_under_ddp(ranks, init, seeds, rows, side, phases):
    torch.manual_seed(init)
    model = MyConvNet()
    inputs = [(images(seed, rows, side),) for seed in seeds]
    check_against_ddp(model, inputs, pool=ranks, phases=phases, rtol=0, atol=0)
