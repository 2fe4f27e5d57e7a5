"""``fr.all_reduce``: every result tree holds the leaf-wise sum or mean, on its own tree's devices."""

from __future__ import annotations

import re
from typing import Any

import optree
import pytest
import torch
from _property_support import Unchanged, refill, tensor_leaves
from hypothesis import given
from hypothesis import strategies as st

import freplicate as fr
from freplicate.testing import devices, trees
from freplicate.testing._strategies import FLOAT_DTYPES

# integer-valued leaves: sums are exact in every dtype, and a mean rounds once
SUMMABLE = (*FLOAT_DTYPES, torch.int64, torch.int32)


def _replicas(tree: Any, devs: list[str], seed: int) -> list[Any]:
    return [refill(tree, seed + i, d) for i, d in enumerate(devs)]


def _check(results: list[Any], inputs: list[Any], op: str) -> None:
    n = len(inputs)
    every_input = {id(t) for tree in inputs for t in tensor_leaves(tree)}
    for result, given_tree in zip(results, inputs):
        assert optree.tree_structure(result) == optree.tree_structure(given_tree)
        columns = zip(*(optree.tree_leaves(t) for t in inputs))
        for x, mine, column in zip(
            optree.tree_leaves(result), optree.tree_leaves(given_tree), columns
        ):
            if not isinstance(mine, torch.Tensor):
                assert x is mine
                continue
            assert id(x) not in every_input, "a result must never be an input tensor"
            assert (x.device, x.dtype, x.shape) == (mine.device, mine.dtype, mine.shape)
            total = sum(c.to("cpu", torch.float64) for c in column)
            expected = (total / n if op == "mean" else total).to(x.dtype)
            torch.testing.assert_close(x.cpu(), expected, rtol=0, atol=0)


@given(trees(dtypes=SUMMABLE), devices(), st.integers(0, 2**16))
def test_sum_is_the_leaf_wise_sum(tree: Any, devs: list[str], seed: int):
    inputs = _replicas(tree, devs, seed)
    unchanged = Unchanged(inputs)
    results = fr.all_reduce(inputs, op="sum")
    unchanged.check("fr.all_reduce")
    _check(results, inputs, "sum")


@given(trees(dtypes=FLOAT_DTYPES), devices(), st.integers(0, 2**16))
def test_mean_is_the_leaf_wise_mean(tree: Any, devs: list[str], seed: int):
    inputs = _replicas(tree, devs, seed)
    unchanged = Unchanged(inputs)
    results = fr.all_reduce(inputs, op="mean")
    unchanged.check("fr.all_reduce")
    _check(results, inputs, "mean")


@given(trees(dtypes=(torch.float32, torch.int64, torch.bool)), devices())
def test_mean_of_an_integer_leaf_names_its_path(tree: Any, devs: list[str]):
    accessors, leaves, _ = optree.tree_flatten_with_accessor(tree)
    ints = [
        a.codify("")
        for a, t in zip(accessors, leaves)
        if isinstance(t, torch.Tensor) and not t.is_floating_point()
    ]
    if not ints:
        return
    with pytest.raises(TypeError, match=r"fr\.all_reduce: .*" + re.escape(ints[0])):
        fr.all_reduce(_replicas(tree, devs, 0), op="mean")
