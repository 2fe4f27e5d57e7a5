"""Sparse gradients: ``nn.Embedding(sparse=True)`` / ``nn.EmbeddingBag(sparse=True)``.

Their gradients are sparse COO tensors. Through ``fr.apply`` they must equal
the stateful module's; ``fr.all_reduce`` and ``fr.data_parallel_grad`` must
reduce them (sum or mean) as DDP does; ``fr.data_parallel`` must give
DataParallel's. Values are compared dense (a layout may differ: DataParallel
and DDP keep sparse gradients sparse, a dense result holds the same values).
fr.distributed against DDP: ``test_distributed.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from _property_oracle import (
    EQUAL_SHARDS,
    HOWS,
    How,
    check_data_parallel_grad,
    check_gradients,
    problem,
)
from _property_support import Unchanged, dense, examples, to_device
from hypothesis import given
from hypothesis import strategies as st

import freplicate as fr
from freplicate.testing import assert_trees_close, check_against_stateful, devices, modules

FLOATS = (torch.float32, torch.float64)
sparse = modules(kinds=["sparse"], dtypes=FLOATS, frozen=None)
SEEDS = st.integers(0, 2**16)


@given(sparse, SEEDS, st.sampled_from(HOWS), st.data())
def test_gradients_through_apply_equal_the_stateful_module(
    pair: tuple[torch.nn.Module, Any], seed: int, how: How, data: st.DataObject
):
    module, inputs = pair
    x = data.draw(inputs, label="inputs")
    check_gradients(problem(module, x, values_seed=seed, wrt_inputs=False), how)


def _sparse_gradients(module: torch.nn.Module, batches: list[torch.Tensor]) -> list[Any]:
    """Each batch's gradients on a copy of ``module``, sparse where the embedding's is."""
    trees = []
    for batch in batches:
        module.zero_grad(set_to_none=True)
        module(batch).pow(2).sum().backward()
        trees.append({k: p.grad for k, p in module.named_parameters() if p.grad is not None})
    module.zero_grad(set_to_none=True)
    return trees


@examples(0.5)
@given(sparse, devices(), st.sampled_from(["sum", "mean"]), st.data())
def test_all_reduce_of_sparse_gradients_is_the_sum_or_mean(
    pair: tuple[torch.nn.Module, Any], devs: list[str], op: str, data: st.DataObject
):
    module, inputs = pair
    batches = [data.draw(inputs, label=f"batch {i}") for i in range(len(devs))]
    trees = [to_device(t, d) for t, d in zip(_sparse_gradients(module, batches), devs)]
    unchanged = Unchanged(trees)
    results = fr.all_reduce(trees, op=op)
    unchanged.check("fr.all_reduce")
    total = {k: sum(dense(t[k]).cpu() for t in trees) for k in trees[0]}
    want = {k: v / len(trees) if op == "mean" else v for k, v in total.items()}
    for result, tree in zip(results, trees):
        assert {k: v.device for k, v in result.items()} == {k: v.device for k, v in tree.items()}
        assert_trees_close(dense({k: v.cpu() for k, v in result.items()}), want)


@examples(0.5)
@given(sparse, EQUAL_SHARDS, st.data())
def test_data_parallel_grad_equals_the_full_batch_stateful_gradient(
    pair: tuple[torch.nn.Module, Any], shards: tuple[list[str], int, int], data: st.DataObject
):
    module, inputs = pair
    check_data_parallel_grad(module, data.draw(inputs, label="inputs"), *shards)


@examples(0.5)
@given(sparse, devices(), st.data())
def test_data_parallel_equals_the_stateful_oracle(
    pair: tuple[torch.nn.Module, Any], devs: list[str], data: st.DataObject
):
    module, inputs = pair
    check_against_stateful(module, data.draw(inputs, label="inputs"), devs)
