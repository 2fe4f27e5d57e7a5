"""float16 and bfloat16: gradients equal the stateful module's, and means never overflow.

A mean of large half-precision values is finite (``6e4`` in float16 is
finite, ``6e4 + 6e4`` is not): ``fr.all_reduce`` and ``fr.data_parallel_grad``
must not sum first and divide after in the leaf's own dtype. fr.distributed:
``test_distributed.py``.
"""

from __future__ import annotations

from typing import Any

import optree
import torch
from _property_oracle import HOWS, How, check_gradients, problem
from _property_support import Unchanged, large, to_device
from hypothesis import given
from hypothesis import strategies as st

import freplicate as fr
from freplicate.testing import devices, modules, trees

HALVES = (torch.float16, torch.bfloat16)
SEEDS = st.integers(0, 2**16)


@given(
    modules(kinds=["mlp", "tied", "nested", "positional", "conv", "buffers"], dtypes=HALVES),
    SEEDS,
    st.sampled_from(HOWS),
    st.data(),
)
def test_gradients_through_apply_equal_the_stateful_module(
    pair: tuple[torch.nn.Module, Any], seed: int, how: How, data: st.DataObject
):
    module, inputs = pair
    x = data.draw(inputs, label="inputs")
    check_gradients(problem(module, x, values_seed=seed, wrt_inputs=True), how)


def _check_mean(got: torch.Tensor, column: list[torch.Tensor]) -> None:
    """``got`` is finite and the mean of ``column`` but for the rounding of a few steps."""
    assert torch.isfinite(got).all(), f"a mean of finite {got.dtype} values overflowed: {got}"
    values = torch.stack([c.double().cpu() for c in column])
    want = values.mean(0).to(got.dtype)
    # dividing first rounds every term: a few ulps of the largest term, whatever the mean
    eps = torch.finfo(got.dtype).eps
    atol = len(column) * eps * float(values.abs().max()) if values.numel() else 0.0
    torch.testing.assert_close(got.cpu(), want, rtol=2 * eps, atol=atol)


halves = trees(dtypes=HALVES, non_tensor_leaves=False, aliased=False, views=False)


@given(halves, devices(), SEEDS)
def test_all_reduce_mean_of_large_values_is_finite(tree: Any, devs: list[str], seed: int):
    inputs = [to_device(large(tree, seed + i), d) for i, d in enumerate(devs)]
    unchanged = Unchanged(inputs)
    results = fr.all_reduce(inputs, op="mean")
    unchanged.check("fr.all_reduce")
    columns = list(zip(*(optree.tree_leaves(t) for t in inputs)))
    for result in results:
        for got, column in zip(optree.tree_leaves(result), columns):
            _check_mean(got, list(column))


@given(halves, devices(), SEEDS)
def test_data_parallel_grad_mean_of_large_gradients_is_finite(
    tree: Any, devs: list[str], seed: int
):
    # the gradient of sum(p * w * x.mean()) is w * x.mean(): with x all ones, w on every shard
    weights = large(tree, seed)
    params = optree.tree_map(torch.zeros_like, tree)

    def loss_fn(params: Any, x: torch.Tensor) -> torch.Tensor:
        terms = zip(optree.tree_leaves(params), optree.tree_leaves(weights))
        total = sum(
            ((p * w).double().sum() for p, w in terms), torch.zeros((), dtype=torch.float64)
        )
        return total * x.double().mean()

    x = torch.ones(len(devs))
    grads, loss = fr.data_parallel_grad(loss_fn, devs)(params, x)
    assert loss.item() == 0
    for got, want in zip(optree.tree_leaves(grads), optree.tree_leaves(weights)):
        _check_mean(got, [want] * len(devs))
