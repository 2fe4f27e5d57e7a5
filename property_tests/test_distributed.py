"""``fr.distributed`` on 2 gloo ranks equals DDP and the leaf-wise reductions it promises.

The ranks are the session's (``fr.testing.RankPool``, conftest.py) and every
drawn example is sent to both; each rank compares ``fr.distributed`` with
``DistributedDataParallel`` (or with the reduction computed locally from
every rank's known inputs) and replies (``_property_ddp.py``). A handful of
examples per property, as each one costs a few collectives; every wait is
bounded. ``fr.testing.check_against_ddp`` runs whole loops of training
steps, evaluations and forwards under ``no_grad`` on drawn modules beside
DDP on the same ranks: the buffers synced where DDP syncs them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import optree
import pytest
import torch
from _property_ddp import (
    WORLD,
    check_all_reduce,
    check_broadcast,
    check_grad_and_value,
    check_large_half_mean,
    check_mismatch,
    check_training_module,
    on_rank,
)
from _property_support import bounded, examples
from hypothesis import given
from hypothesis import strategies as st
from test_half_precision import large

from freplicate.testing import RankPool, check_against_ddp, modules, trees
from freplicate.testing._strategies import FLOAT_DTYPES

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)


@pytest.fixture(scope="module")
def ranks(rank_pool: RankPool) -> Iterator[RankPool]:
    with bounded(rank_pool, 60.0) as pool:
        yield pool


# DDP refuses a module without parameters (BatchNorm without affine): every kind but that
DDP_KINDS = ["mlp", "conv", "tied", "buffers", "nested", "unused", "positional", "keywords"]
CAPS = st.sampled_from([25.0, 1e-4])  # one bucket, or one leaf per bucket
COMPRESS = st.sampled_from([None, "bf16", "fp16"])
# every property of fr.distributed eagerly and compiled whole (backend="eager": CI time)
MODES = st.sampled_from(["eager", "compiled"])


@examples(0.3)
@given(modules(kinds=DDP_KINDS), CAPS, COMPRESS, st.booleans(), MODES, st.data())
def test_grad_and_value_equals_ddp(
    ranks: RankPool,
    pair: tuple[torch.nn.Module, Any],
    cap: float,
    compress: str | None,
    has_aux: bool,
    mode: str,
    data: st.DataObject,
):
    module, inputs = pair
    per_rank = [data.draw(inputs, label=f"inputs of rank {r}") for r in range(WORLD)]
    payload = {
        "module": module,
        "inputs": per_rank,
        "bucket_cap_mb": cap,
        "compress": compress,
        "has_aux": has_aux,
        "mode": mode,
    }
    ranks.run(on_rank, check_grad_and_value, payload)


summable = trees(dtypes=(*FLOAT_DTYPES, torch.int64, torch.int32), max_leaves=5)


@examples(0.3)
@given(st.data(), st.sampled_from(["sum", "mean"]), CAPS, COMPRESS, MODES)
def test_all_reduce_is_the_sum_or_mean_over_ranks(
    ranks: RankPool, data: st.DataObject, op: str, cap: float, compress: str | None, mode: str
):
    tree = data.draw(trees(dtypes=FLOAT_DTYPES, max_leaves=5) if op == "mean" else summable)
    payload = {"tree": tree, "op": op, "bucket_cap_mb": cap, "compress": compress, "seed": 7}
    payload["mode"] = mode
    ranks.run(on_rank, check_all_reduce, payload)


@examples(0.2)
@given(trees(max_leaves=5), st.integers(0, WORLD - 1), st.integers(0, 2**16), MODES)
def test_broadcast_gives_every_rank_the_source_values(
    ranks: RankPool, tree: Any, src: int, seed: int, mode: str
):
    ranks.run(on_rank, check_broadcast, {"tree": tree, "src": src, "seed": seed, "mode": mode})


@examples(0.2)
@given(trees(dtypes=(torch.float32, torch.int64), max_leaves=4), st.booleans(), MODES, st.data())
def test_trees_that_differ_across_ranks_raise_on_every_rank(
    ranks: RankPool, tree: Any, reduced_before: bool, mode: str, data: st.DataObject
):
    # reduced_before: both ranks first reduce rank 0's tree, so that rank 0 meets a layout it
    # has already seen (tests/test_regressions.py has the bug this once found)
    leaves, spec = optree.tree_flatten(tree)
    at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    if not at:
        return
    i = data.draw(st.sampled_from(at), label="bent leaf")
    bent = list(leaves)
    bent[i] = torch.zeros(leaves[i].numel() + 1, dtype=leaves[i].dtype)  # another shape
    pair = [tree, optree.tree_unflatten(spec, bent)]
    payload = {"trees": pair, "reduced_before": reduced_before, "mode": mode}
    messages = ranks.run(on_rank, check_mismatch, payload)
    for message in messages:
        assert message.startswith("fr.distributed.all_reduce")


# the modules real training brings; a compiled one cannot travel to the ranks (no pickling)
def _training_module(
    ranks: RankPool, pair: tuple[torch.nn.Module, Any], data: st.DataObject, mode: str = "eager"
) -> None:
    module, inputs = pair
    per_rank = [data.draw(inputs, label=f"inputs of rank {r}") for r in range(WORLD)]
    payload = {"module": module, "inputs": per_rank, "mode": mode}
    ranks.run(on_rank, check_training_module, payload)


@examples(0.2)
@given(modules(kinds=["checkpoint"], frozen=None), st.data())
def test_grad_and_value_equals_ddp_on_checkpointed_modules(
    ranks: RankPool, pair: tuple[torch.nn.Module, Any], data: st.DataObject
):
    _training_module(ranks, pair, data)


@examples(0.2)
@given(modules(kinds=["sparse"], frozen=None), st.data())
def test_grad_and_value_equals_ddp_on_sparse_embeddings(
    ranks: RankPool, pair: tuple[torch.nn.Module, Any], data: st.DataObject
):
    _training_module(ranks, pair, data)


@examples(0.2)
@given(modules(kinds=["mlp", "conv", "tied", "nested", "unused"], frozen=True), MODES, st.data())
def test_grad_and_value_equals_ddp_on_frozen_sub_trees(
    ranks: RankPool, pair: tuple[torch.nn.Module, Any], mode: str, data: st.DataObject
):
    _training_module(ranks, pair, data, mode)


@examples(0.2)
@given(
    trees(dtypes=(torch.float16, torch.bfloat16), non_tensor_leaves=False, aliased=False),
    st.integers(0, 2**16),
)
def test_all_reduce_mean_of_large_half_values_is_finite(ranks: RankPool, tree: Any, seed: int):
    everyone = [large(tree, seed + r) for r in range(WORLD)]
    ranks.run(on_rank, check_large_half_mean, {"trees": everyone})


PHASES = st.lists(st.sampled_from(["step", "eval", "no_grad"]), min_size=1, max_size=5)


def _check_loops(
    ranks: RankPool, pair: tuple[torch.nn.Module, Any], phases: list[str], sync: bool, data: Any
) -> None:
    module, inputs = pair
    per_rank = [data.draw(inputs, label=f"inputs of rank {r}") for r in range(WORLD)]
    check_against_ddp(
        module, per_rank, pool=ranks, phases=phases, sync_buffers=sync, rtol=0, atol=0
    )


@examples(0.3)
@given(modules(kinds=DDP_KINDS), PHASES, st.booleans(), st.data())
def test_check_against_ddp_on_drawn_modules_and_phases(
    ranks: RankPool, pair: tuple[torch.nn.Module, Any], phases: list[str], sync: bool, data: Any
):
    # training steps, evaluations and forwards under no_grad in any order: fr.distributed's loop
    # gives DDP's outputs, losses, gradients, buffers and parameters to the bit
    _check_loops(ranks, pair, phases, sync, data)


@examples(0.3)
@given(modules(kinds=["conv", "buffers"], training=True), PHASES, st.data())
def test_buffers_are_synced_where_ddp_syncs_them(
    ranks: RankPool, pair: tuple[torch.nn.Module, Any], phases: list[str], data: Any
):
    # buffers that every training-mode forward updates, differently on each rank: a sync before
    # a forward DDP does not sync before (after a no_grad forward), or none where it does, differs
    _check_loops(ranks, pair, phases, True, data)
