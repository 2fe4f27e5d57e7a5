"""Sharded data parallelism on 2 gloo ranks, on drawn trees and modules.

``reduce_scatter`` is the rows of the leaf-wise sum or mean and
``all_gather`` puts every rank's rows back together (trees of every dtype,
shape, view and tie ``fr.testing.trees`` draws: 0-dim, empty, rows that do
not divide); ``grad_and_value(..., shard=True)`` gives the rows of DDP's
gradients on drawn modules; ``fr.distributed.clip_grad_norm`` of the shards
is ``clip_grad_norm_`` of the full gradients. The ranks are
the session's (conftest.py's ``rank_pool``); the checks are in
``_property_shard.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _property_ddp import WORLD, RankPool
from _property_shard import Check
from _property_support import bounded, examples
from hypothesis import given
from hypothesis import strategies as st

import freplicate as fr
from freplicate.testing import modules, trees
from freplicate.testing._strategies import FLOAT_DTYPES

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)

CAPS = st.sampled_from([25.0, 1e-5])  # one bucket, or one leaf per bucket
COMPRESS = st.sampled_from([None, "bf16", "fp16"])
# every dtype gloo reduces (no int16)
SUMMABLE = (*FLOAT_DTYPES, torch.complex64, torch.int64, torch.int32, torch.int8, torch.bool)


@pytest.fixture(scope="module")
def ranks(rank_pool: fr.testing.RankPool) -> Iterator[RankPool]:
    with bounded(rank_pool, 60.0) as pool:
        yield RankPool(pool)


def _all_ok(replies: list[tuple[str, Any]]) -> None:
    for rank, (status, value) in enumerate(replies):
        assert status == "ok", f"rank {rank}: {value}"


@examples(0.3)
@given(st.data(), st.sampled_from(["sum", "mean"]), CAPS, COMPRESS, st.integers(0, 2**16))
def test_reduce_scatter_is_the_rows_of_the_reduction(
    ranks: RankPool, data: st.DataObject, op: str, cap: float, compress: str | None, seed: int
):
    dtypes = (*FLOAT_DTYPES, torch.complex64) if op == "mean" else SUMMABLE
    tree = data.draw(trees(dtypes=dtypes, max_leaves=5, max_side=5))
    payload = {"tree": tree, "op": op, "bucket_cap_mb": cap, "compress": compress, "seed": seed}
    _all_ok(ranks.run(Check("reduce_scatter"), payload))


@examples(0.3)
@given(trees(dtypes=SUMMABLE, max_leaves=5, max_side=5), st.integers(0, 2**16))
def test_all_gather_of_shard_is_the_tree(ranks: RankPool, tree: Any, seed: int):
    _all_ok(ranks.run(Check("all_gather"), {"tree": tree, "seed": seed}))


DDP_KINDS = ["mlp", "conv", "tied", "buffers", "nested", "unused", "positional", "keywords"]


@examples(0.3)
@given(modules(kinds=DDP_KINDS), CAPS, st.data())
def test_zero2_gradients_are_the_rows_of_ddps(
    ranks: RankPool, pair: tuple[torch.nn.Module, Any], cap: float, data: st.DataObject
):
    module, inputs = pair
    per_rank = [data.draw(inputs, label=f"inputs of rank {r}") for r in range(WORLD)]
    payload = {"module": module, "inputs": per_rank, "cap": cap}
    _all_ok(ranks.run(Check("zero2_gradients"), payload))


@examples(0.3)
@given(
    trees(dtypes=(torch.float32, torch.float64), max_leaves=6, max_side=5),
    st.sampled_from([0.0, 1e-3, 0.5, 1e6]),
    st.sampled_from([2.0, 1.0, math.inf, -math.inf, 0.0, 0.5, 3.0]),
    st.integers(0, 2**16),
)
def test_clip_grad_norm_of_shards_is_clip_grad_norm_of_the_full_gradient(
    ranks: RankPool, tree: Any, max_norm: float, norm_type: float, seed: int
):
    payload = {"tree": tree, "max_norm": max_norm, "norm_type": norm_type, "seed": seed}
    _all_ok(ranks.run(Check("sharded_clip"), payload))
