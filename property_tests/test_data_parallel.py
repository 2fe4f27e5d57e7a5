"""``fr.data_parallel`` equals DataParallel; ``fr.data_parallel_grad`` equals DDP's averaged step.

The oracle for ``data_parallel`` is ``fr.testing.check_against_stateful``
(per-replica deep copies driven through autograd as DataParallel drives its
replicas, or ``nn.DataParallel`` itself on distinct CUDA devices), over random
modules, batches (smaller than the device list included), device lists, and
inputs and outputs in every kind of container.
The oracle for ``data_parallel_grad`` is DDP's arithmetic done by hand:
``torch.func.grad_and_value`` on each shard, gradients averaged (or summed)
over the shards.
"""

from __future__ import annotations

from typing import Any

import optree
import pytest
import torch
import torch.func
from _property_support import Unchanged, examples
from hypothesis import given
from hypothesis import strategies as st

import freplicate as fr
from freplicate.testing import assert_trees_close, check_against_stateful, devices, modules
from freplicate.testing._strategies import CONTAINER_KINDS, Outputs, contain


@given(modules(dtypes=(torch.float32, torch.float64)), devices(), st.data())
def test_data_parallel_equals_the_stateful_oracle(
    pair: tuple[torch.nn.Module, Any], devs: list[str], data: st.DataObject
):
    module, inputs = pair
    check_against_stateful(module, data.draw(inputs, label="inputs"), devs)


# every kind its share of the examples (a drawn kind would leave some out of a derandomized run)
@pytest.mark.parametrize("kind", CONTAINER_KINDS)
@examples(0.25)
@given(
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 5),
    st.sampled_from([torch.float32, torch.float64]),
    devices(),
    st.integers(0, 2**16),
)
def test_data_parallel_scatters_and_gathers_every_container_as_the_stateful_oracle(
    kind: str, n: int, m: int, batch: int, dtype: torch.dtype, devs: list[str], seed: int
):
    # the "outputs" kind of fr.testing.modules(): its input and output in a dict, OrderedDict,
    # ModelOutput, NamedTuple, dataclass, list, tuple or list subclass, as nn.parallel splits
    # and joins each (a dataclass input is shared whole), types kept
    torch.manual_seed(seed)
    module = Outputs(n, m, kind).to(dtype)
    x = torch.randn(batch, n, dtype=dtype)
    check_against_stateful(module, (contain(kind, x, -0.5),), devs)


@given(modules(kinds=["batchnorm", "conv", "buffers"], training=True), devices(), st.data())
def test_data_parallel_mean_buffers_average_the_replicas(
    pair: tuple[torch.nn.Module, Any], devs: list[str], data: st.DataObject
):
    module, inputs = pair
    check_against_stateful(module, data.draw(inputs, label="inputs"), devs, buffers="mean")


def _loss_fn(module: torch.nn.Module, buffers: dict[str, torch.Tensor]) -> Any:
    """A mean-over-the-batch loss of the module's outputs, as a function of its params."""

    def loss_fn(params: dict[str, torch.Tensor], *batch: torch.Tensor) -> torch.Tensor:
        out, _ = fr.apply(module, fr.State(params, buffers), *batch)
        total = torch.zeros((), dtype=torch.float64)
        for i, leaf in enumerate(optree.tree_leaves(out)):
            g = torch.Generator().manual_seed(i)
            weight = torch.randn(leaf.shape[1:], generator=g).to(leaf.dtype)
            per_example = leaf * weight if leaf.dim() else leaf
            total = total + (per_example.tanh().double().mean() if leaf.dim() else leaf.double())
        return total

    return loss_fn


def _positional(x: Any) -> tuple[torch.Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


# data_parallel_grad takes the batch positionally
GRAD_KINDS = ["mlp", "conv", "batchnorm", "tied", "buffers", "nested", "unused", "positional"]


@given(modules(kinds=GRAD_KINDS), devices(), st.sampled_from(["mean", "sum"]), st.data())
def test_data_parallel_grad_reduces_the_per_shard_gradients(
    pair: tuple[torch.nn.Module, Any], devs: list[str], op: str, data: st.DataObject
):
    module, inputs = pair
    batch = _positional(data.draw(inputs, label="inputs"))
    s = fr.state(module)
    loss_fn = _loss_fn(module, s.buffers)
    unchanged = Unchanged(s, batch)
    grads, loss = fr.data_parallel_grad(loss_fn, devs, op=op)(s.params, *batch)  # type: ignore[arg-type]
    unchanged.check("fr.data_parallel_grad")

    shards = list(zip(*(t.chunk(len(devs)) for t in batch)))
    per_shard = [torch.func.grad_and_value(loss_fn)(s.params, *shard) for shard in shards]
    reduced = {
        k: torch.stack([g[k] for g, _ in per_shard]).sum(0) / (len(shards) if op == "mean" else 1)
        for k in s.params
    }
    assert_trees_close(grads, reduced, rtol=1e-5, atol=1e-6)
    expected_loss = torch.stack([v for _, v in per_shard]).mean()
    torch.testing.assert_close(loss, expected_loss.to(loss.dtype), rtol=1e-6, atol=1e-7)


@given(
    modules(kinds=["mlp", "tied", "unused", "positional", "nested", "conv"], training=False),
    devices(),
    st.integers(1, 3),
    st.data(),
)
def test_data_parallel_grad_with_equal_shards_is_the_full_batch_gradient(
    pair: tuple[torch.nn.Module, Any], devs: list[str], per_device: int, data: st.DataObject
):
    module, inputs = pair
    batch = _positional(data.draw(inputs, label="inputs"))
    # equal shards: a batch of per_device * len(devs) rows, whatever the drawn size
    size = per_device * len(devs)
    batch = tuple(torch.cat([t] * size)[:size] for t in batch)
    s = fr.state(module)
    loss_fn = _loss_fn(module, s.buffers)
    grads, loss = fr.data_parallel_grad(loss_fn, devs)(s.params, *batch)
    full_grads, full_loss = torch.func.grad_and_value(loss_fn)(s.params, *batch)
    assert_trees_close(grads, full_grads, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(loss, full_loss.to(loss.dtype), rtol=1e-5, atol=1e-6)
