"""Hybrid sharding (HSDP): ``apply_sharded(group=mesh)`` on 4 gloo ranks, against FSDP2's.

A 2 x 2 ``DeviceMesh`` (replicate, shard), FSDP2's convention: the model of
``tests/test_precision.py`` (three blocks as the units, rows of 7 and 1),
3 steps of ``torch.optim.AdamW`` on the shards with ``loss.backward()``,
beside ``fully_shard`` on each block and on the root over the same mesh.
Measured: every loss and every parameter the same to the bit, in float32
and with a bf16 / float32 ``MixedPrecisionPolicy`` (the reduce-scatter over
the shard group adds 2 numbers, the all-reduce over the replicas 2, as
FSDP2's; the mean's 1/4 is exact), and the pair of groups
``(replicate, shard)`` the same as the mesh. A checkpoint saved on the 2 x 2
mesh loads on 4 ranks sharding 4 ways and on the mesh again, to the bit.
In the checks' debug mode, replicas that disagree (a parameter frozen on
one replica only) raise ``ValueError`` on all 4 ranks, naming the
difference: the all-reduce over the replicas is checked like any call.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import the workers by name

pytest.importorskip("torch.distributed.fsdp")

import _hsdp_workers as workers

NAMES = [
    "hsdp_fp32",
    "hsdp_bf16",
    "hsdp_checkpoint",
    "replicas_that_freeze_differently",
    "bad_groups",
]


@pytest.fixture(scope="module")
def job() -> dict[str, list]:
    return workers.run(NAMES)


@pytest.mark.parametrize("name", ["hsdp_fp32", "hsdp_bf16"])
def test_bit_for_bit_with_fsdp2_on_a_2d_mesh(job: dict[str, list], name: str) -> None:
    for rank, got in enumerate(job[name]):
        assert isinstance(got, dict), got
        ours, theirs, pair = got["losses"]
        assert ours == theirs == pair, (rank, ours, theirs, pair)
        assert all(d == 0.0 for d in got["max_diff"].values()), got["max_diff"]
        assert got["pair_equal"]
        assert got["eval_equal"]  # under inference_mode: the module on the gathered parameters


def test_a_checkpoint_of_the_mesh_loads_on_other_shapes(job: dict[str, list]) -> None:
    for got in job["hsdp_checkpoint"]:
        assert got == {"materialized": True, "flat": True, "mesh": True, "unchanged": True}, got


def test_replicas_that_disagree_raise_everywhere(job: dict[str, list]) -> None:
    for got in job["replicas_that_freeze_differently"]:
        kind, message = got
        assert kind == "Mismatch", got  # _agree.Mismatch, a ValueError
        assert "head.weight" in message, message


def test_bad_groups_are_named(job: dict[str, list]) -> None:
    for got in job["bad_groups"]:
        assert (
            got["same_twice"][0] == "ValueError"
            and "meet in this rank alone" in got["same_twice"][1]
        )
        assert (
            got["three"][0] == "TypeError" and "(replicate_group, shard_group)" in got["three"][1]
        )
        assert got["cube"][0] == "ValueError" and "3 dims" in got["cube"][1]
        assert got["compiled"][0] == "NotImplementedError", got["compiled"]
        assert "hybrid sharding" in got["compiled"][1] and "eagerly only" in got["compiled"][1]
