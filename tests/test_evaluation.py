"""Evaluation between training steps on 2 gloo ranks: the guides' loop against DDP, to the bit.

DDP broadcasts rank 0's buffers on the first forward after a training
forward, so also on an evaluation forward under ``torch.no_grad``: rank 1
evaluates with rank 0's BatchNorm statistics. The loop of the guides
(docs/distributed.md, docs/training_loop.md) calls
``fr.distributed.sync_buffers`` before evaluating, and then gives DDP's
losses, evaluation outputs, validation numbers, parameters and buffers bit
for bit on every rank, through train -> evaluate -> train -> evaluate. A port
that leaves that call out evaluates rank 1 on its own statistics, and its
validation numbers differ. The rule in general (any sequence of steps,
evaluations and forwards under ``no_grad``, on drawn modules) is the
property ``test_check_against_ddp_on_drawn_modules_and_phases`` in
``property_tests/test_distributed.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))  # the ranks import the rank side by name
from _eval_workers import train_evaluate_train

from freplicate.testing import RankPool, assert_trees_close

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


@pytest.fixture(scope="module")
def runs(rank_pool: RankPool) -> dict[bool, list[dict[str, Any]]]:
    return {sync: rank_pool.run(train_evaluate_train, sync) for sync in (True, False)}


def test_the_guides_loop_evaluates_as_ddp_does_to_the_bit(runs: dict[bool, list[dict[str, Any]]]):
    for rank, got in enumerate(runs[True]):
        for what in ("losses", "outputs", "val", "params", "buffers"):
            try:
                assert_trees_close(got["fr"][what], got["ddp"][what], rtol=0, atol=0)
            except AssertionError as err:
                raise AssertionError(f"rank {rank}: {what}: {err}") from None
    ranks = runs[True]
    # one validation number everywhere; the ranks trained on different data
    assert_trees_close(ranks[0]["fr"]["val"], ranks[1]["fr"]["val"], rtol=0, atol=0)
    assert not torch.equal(ranks[0]["fr"]["outputs"][0], ranks[1]["fr"]["outputs"][0])
    assert_trees_close(ranks[0]["fr"]["params"], ranks[1]["fr"]["params"], rtol=0, atol=0)


def test_a_port_without_the_sync_evaluates_rank_1_on_its_own_statistics(
    runs: dict[bool, list[dict[str, Any]]],
):
    rank0, rank1 = runs[False]
    # rank 0's statistics are the ones DDP broadcasts: its evaluation is right either way
    assert_trees_close(rank0["fr"]["outputs"], rank0["ddp"]["outputs"], rtol=0, atol=0)
    for ours, theirs in zip(rank1["fr"]["outputs"], rank1["ddp"]["outputs"]):
        assert not torch.allclose(ours, theirs), "rank 1 evaluated on rank 0's statistics"
    for ours, theirs in zip(rank0["fr"]["val"], rank0["ddp"]["val"]):
        assert not torch.allclose(ours, theirs), "the validation numbers came out right"
    # training is unaffected: the step after an evaluation syncs before its forward anyway;
    # but after the last evaluation, DDP's rank 1 holds rank 0's statistics, the port its own
    assert_trees_close(rank1["fr"]["params"], rank1["ddp"]["params"], rtol=0, atol=0)
    assert not torch.equal(
        rank1["fr"]["buffers"]["bn.running_mean"],
        rank1["ddp"]["buffers"]["bn.running_mean"],
    )
