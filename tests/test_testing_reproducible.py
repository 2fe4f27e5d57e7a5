"""``fr.testing.check_reproducible``: passes where the mode holds, reports where it does not.

The property over drawn modules is ``property_tests/test_reproducible.py``;
here, what a user's call gets wrong: a model whose output depends on the
rank (the assertion names the world size, the rank and the path), and bad
arguments.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import freplicate as fr

sys.path.insert(0, str(Path(__file__).parent))  # the ranks import the modules by name
import _testing_workers as tw

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


@pytest.fixture(scope="module")
def pools() -> Iterator[dict[int, fr.testing.RankPool]]:
    with fr.testing.RankPool(2, timeout=30.0, deadline=90.0) as two:
        yield {2: two}


def test_a_model_with_dropout_passes_and_a_rank_dependent_one_is_named(pools):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(16, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for shard in (False, True):
        fr.testing.check_reproducible(model, x, grain=4, world_sizes=(2,), pools=pools, shard=shard)
    # ZeRO-3: the loss through apply_sharded, a unit per Linear, the shards updated
    units = ["0", "3"]
    fr.testing.check_reproducible(model, x, grain=4, world_sizes=(2,), pools=pools, zero3=True)
    fr.testing.check_reproducible(
        model, x, grain=4, world_sizes=(2,), pools=pools, zero3=True, units=units
    )
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(
        AssertionError,
        match=r"gradients after step 0 on rank 0 of 2 differ from one process's \(grain=4\): .*fc",
    ):
        fr.testing.check_reproducible(tw.ByRank(), x, grain=4, world_sizes=(2,), pools=pools)
    with pytest.raises(AssertionError, match=r"gradients after step 0 on rank 0 of 2 .*fc"):
        fr.testing.check_reproducible(
            tw.ByRank(), x, grain=4, world_sizes=(2,), pools=pools, zero3=True
        )


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"world_sizes": (3,)}, ValueError, "world_sizes must hold powers of two"),
        ({"steps": 0}, ValueError, "steps must be an int >= 1"),
        ({"pools": {4: None}}, ValueError, r"pools\[4\] must be a fr.testing.RankPool of 4 ranks"),
        ({"shard": True, "zero3": True}, ValueError, r"shard=True \(ZeRO-2\) and zero3=True"),
        ({"units": ["0"]}, ValueError, "units= is apply_sharded's: give it with zero3=True"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        fr.testing.check_reproducible(nn.Linear(4, 2), torch.randn(8, 4), grain=4, **kwargs)
