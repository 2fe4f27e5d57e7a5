"""The GPT example's ``--grain`` ends with the same bits on 1, 2 and 4 gloo ranks.

The example's loop at ``_gpt_workers.TINY``'s size, dropout on, 5 steps of
one global batch of 8 sequences cut into grains of 2 (4, 2 and 1 grains a
rank), one thread a rank (``_dist_workers``' ranks): every rank of every
world size ends with the same parameters and AdamW state, to the bit, and
samples the same text, also with ``--zero 2`` (the rows clipped by rows) and
``--zero 3`` (the loss through ``apply_sharded``, clipped by rows). A
run stopped after 2 steps on 2 ranks and resumed on 4 ends as the straight
run does. Without ``--grain`` the 1-rank and
2-rank runs end elsewhere, which is what makes the equality a test.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import the helpers by name
import _gpt_workers as g
from _dist_workers import ok, spawn

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

# one global batch of 8 a step, in grains of 2; the exact AdamW needs no optional extra
GRAIN = "--optimizer exact --dropout 0.1 --accumulate 1 --batch-size 8 --grain 2"
# without --grain: 8 sequences a step too (each rank its own, from its own shard of the text)
PLAIN = {1: "--optimizer exact --dropout 0.1 --accumulate 1 --batch-size 8"}
PLAIN[2] = PLAIN[1].replace("--batch-size 8", "--batch-size 4")
STOP = 2
# ZeRO-2: the rows reduce-scattered by halving, clipped by rows (a low --clip: it clips)
ZERO2 = f"{GRAIN} --zero 2 --clip 0.05"
# ZeRO-3: the gathers' transposes sum the ranks' rows grain by grain (bits of their own)
ZERO3 = f"{GRAIN} --zero 3 --clip 0.05"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, list[Any]]]:
    saved = tmp_path_factory.mktemp("gpt-grain") / "two-ranks.pt"
    stopped = f"{GRAIN} --stop-after {STOP} --checkpoint {saved}"
    names = {
        2: [GRAIN, PLAIN[2], stopped, ZERO2, ZERO3],
        4: [GRAIN, f"--resume {saved}", ZERO2, ZERO3],  # after the 2 ranks' job, which wrote it
        1: [GRAIN, PLAIN[1], ZERO2, ZERO3],
    }
    jobs = {
        world: spawn(todo, target=g.main, world=world, pg_timeout=30.0, deadline=120.0)
        for world, todo in names.items()
    }
    jobs[4]["resumed"] = jobs[4].pop(f"--resume {saved}")
    jobs[2]["stopped"] = jobs[2].pop(stopped)
    return jobs


def same_bits(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The final parameters and optimizer state (the exact AdamW's leaves), to the bit."""
    if list(a["params"]) != list(b["params"]) or len(a["optimizer"]) != len(b["optimizer"]):
        return False
    params = all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    state = all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(a["optimizer"], b["optimizer"])
    )
    return params and state


def test_grain_ends_with_the_same_bits_on_1_2_and_4_ranks(runs):
    (one,) = ok(runs[1], GRAIN)
    assert len(one["loss"]) == 5 and len(one["optimizer"]) == 1 + 2 * len(one["params"])
    for world in (1, 2, 4):
        for rank, result in enumerate(ok(runs[world], GRAIN)):
            assert same_bits(result, one), f"rank {rank} of {world} differs from 1 rank"
            assert result["sample"] == one["sample"]
    # the ranks hold other rows of the global batch: their own losses differ
    rank0, rank1 = ok(runs[2], GRAIN)
    assert rank0["loss"] != rank1["loss"]


@pytest.mark.parametrize(
    ("line", "other"),
    [
        # ZeRO-2: parameters gathered, optimizer state gathered from every rank's rows, clipped
        # by rows (another run than GRAIN's: clipped at 0.05)
        pytest.param(ZERO2, GRAIN, id="zero2"),
        # ZeRO-3: the loss through apply_sharded (its own tree: the ranks' grains first)
        pytest.param(ZERO3, ZERO2, id="zero3"),
    ],
)
def test_sharded_with_grain_ends_with_the_same_bits_on_1_2_and_4_ranks(runs, line, other):
    (one,) = ok(runs[1], line)
    assert not same_bits(one, ok(runs[1], other)[0])
    for world in (1, 2, 4):
        for rank, result in enumerate(ok(runs[world], line)):
            assert same_bits(result, one), f"{line}: rank {rank} of {world} differs from 1 rank"
            assert result["sample"] == one["sample"]


def test_a_run_stopped_on_2_ranks_resumes_on_4(runs):
    (whole,) = ok(runs[1], GRAIN)
    for first, rest in zip(ok(runs[2], "stopped"), ok(runs[4], "resumed")):
        assert (first["first"], len(first["loss"])) == (0, STOP)
        assert (rest["first"], len(rest["loss"])) == (STOP, 5 - STOP)
    for rest in ok(runs[4], "resumed"):
        assert same_bits(rest, whole)


def test_without_grain_1_and_2_ranks_end_elsewhere(runs):
    (one,) = ok(runs[1], PLAIN[1])
    rank0, rank1 = ok(runs[2], PLAIN[2])
    assert same_bits(rank0, rank1)  # replicated all the same
    assert not same_bits(rank0, one)
    assert not same_bits(one, ok(runs[1], GRAIN)[0])


def test_grain_refuses_what_it_does_not_run():
    for options, named in [
        ("--grain 2 --accumulate 2", "--accumulate 2"),
        ("--grain 2 --accumulate 1 --ddp", "--ddp"),
        ("--grain 2 --accumulate 1 --compile", "--compile"),
        ("--grain 3 --accumulate 1 --batch-size 8", "power of two of grains"),
        ("--grain 4 --accumulate 1 --batch-size 12", "power of two of grains"),
    ]:
        with pytest.raises(ValueError, match="--grain") as raised:
            g.config(options)
        assert named in str(raised.value)
