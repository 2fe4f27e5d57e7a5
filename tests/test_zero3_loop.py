"""docs/sharding.md's short ZeRO-3 loop on 2 gloo ranks, against FSDP2 and DDP; clipping and advice.

One job runs every scenario (``_zero3_loop_workers.py``):

- ``loops``: the loop the ZeRO-3 section opens with (this rank's rows as
  tensors of its own, ``torch.optim.AdamW`` over them, ``loss.backward()``
  through ``apply_sharded``), 12 steps, unclipped and clipped with
  ``fr.distributed.clip_grad_norm``: bit for bit FSDP2 ``fully_shard`` +
  ``torch.optim.AdamW`` (+ ``clip_grad_norm_``) and DDP + the same, on a model
  whose rows do not divide by 2 (measured: 0 difference in every parameter);
  the model it starts from is left untouched;
- ``norms``: the shards' gradient norm through ``fr.distributed.clip_grad_norm``
  is DDP's ``clip_grad_norm_``'s, bit for bit, and so are the clipped
  gradients; ``fr.clip_grad_norm`` of the same shards gives this rank's part
  (smaller, and different on each rank: what the docs warn of);
- ``advice``: ``fr.distributed.grad_and_value`` wrapped around a loss calling
  ``apply_sharded`` raises on both ranks, and says to differentiate with
  ``fr.grad_and_value`` or ``loss.backward()`` (rows that split unevenly:
  shapes differ as a split's do; rows that divide: values differ); shapes that
  differ otherwise get no word of ZeRO-3.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import freplicate as fr

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import the workers by name
import _zero3_loop_workers as z
from _dist_workers import ok

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


@pytest.fixture(scope="module")
def job() -> dict[str, list[Any]]:
    return z.run(["loops", "norms", "advice"], world=2, pg_timeout=30.0, deadline=180.0)


def bitwise(actual: Any, expected: Any) -> None:
    fr.testing.assert_trees_close(actual, expected, rtol=0, atol=0)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_the_docs_loop_is_fsdp2_and_ddp_bit_for_bit(job, clip):
    results = ok(job, "loops")
    for c in (r[clip] for r in results):
        assert c["untouched"]
        bitwise(c["fr"], c["fsdp2"])
        bitwise(c["fr"], c["ddp"])
        start = dict(z.net().named_parameters())
        assert all(not torch.equal(c["fr"][k], p) for k, p in start.items())  # it trained
    bitwise(results[0][clip]["fr"], results[1][clip]["fr"])


def test_the_sharded_norm_is_ddps_and_the_plain_one_is_a_ranks_part(job):
    results = ok(job, "norms")
    for r in results:
        assert torch.equal(r["sharded"], r["ddp"])
        assert r["sharded"] > 0.1  # so the clipped gradients below were scaled
        bitwise(r["clipped"], r["ddp clipped"])
        assert r["local"] < r["sharded"]  # fr.clip_grad_norm on shards: this rank's rows only
    assert not torch.equal(results[0]["local"], results[1]["local"])


SHARDS = (
    "if these are this rank's shards of a ZeRO-3 model (fr.distributed.shard's rows, run through "
    "fr.distributed.apply_sharded), differentiate the loss with fr.grad_and_value or "
    "loss.backward(), not fr.distributed.grad_and_value"
)


def test_grad_and_value_around_apply_sharded_says_what_to_use(job):
    for r in ok(job, "advice"):
        kind, uneven = r[33][1:]
        assert kind == "ValueError"
        assert uneven.startswith(
            "fr.distributed.grad_and_value: the tensor at ['0.weight'] differs across ranks: "
            "shape (17, 8), dtype torch.float32 on rank 0; shape (16, 8)"
        )
        assert SHARDS in uneven
        kind, even = r[32][1:]
        assert kind == "ValueError"
        assert even.startswith(
            "fr.distributed.grad_and_value: the parameters differ across ranks at ['0.weight']"
        )
        assert "broadcast them first" in even and SHARDS in even
        kind, other = r["other"][1:]
        assert kind == "ValueError" and "shape (3,)" in other and "shape (5,)" in other
        assert "ZeRO-3" not in other
