"""Activation checkpointing: gradients through ``fr.apply`` equal the stateful module's.

A checkpointed block runs its forward again during backward. Whatever binds
a state to the module must still be bound then, or the recomputation reads
the module's own tensors: the gradients would then reach the module, not the
state. Drawn: ``torch.utils.checkpoint.checkpoint`` with ``use_reentrant``
False and True, and ``checkpoint_wrapper`` of both implementations, around
plain and tied blocks, with frozen sub-trees, with and without gradients
for the inputs; differentiated by ``fr.grad_and_value``,
``torch.autograd.grad`` and ``.backward()``, in one process and under
``fr.data_parallel`` / ``fr.data_parallel_grad`` (DDP: ``test_distributed.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _property_oracle import (
    EQUAL_SHARDS,
    HOWS,
    How,
    check_data_parallel_grad,
    check_gradients,
    problem,
)
from _property_support import examples
from hypothesis import given
from hypothesis import strategies as st

from freplicate.testing import check_against_stateful, devices, modules

# a frozen first layer leaves a reentrant checkpoint no input that requires grad: PyTorch warns
# and gives its block no gradient, and so must fr (zero gradients, on both sides)
pytestmark = pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True")

FLOATS = (torch.float32, torch.float64)
checkpointed = modules(kinds=["checkpoint"], dtypes=FLOATS, frozen=None)
SEEDS = st.integers(0, 2**16)


@given(checkpointed, SEEDS, st.booleans(), st.data())
def test_grad_and_value_through_apply_equals_the_stateful_module(
    pair: tuple[torch.nn.Module, Any], seed: int, wrt_inputs: bool, data: st.DataObject
):
    module, inputs = pair
    x = data.draw(inputs, label="inputs")
    check_gradients(problem(module, x, values_seed=seed, wrt_inputs=wrt_inputs), "grad_and_value")


@given(checkpointed, SEEDS, st.booleans(), st.sampled_from(HOWS[1:]), st.data())
def test_autograd_through_apply_equals_the_stateful_module(
    pair: tuple[torch.nn.Module, Any], seed: int, wrt_inputs: bool, how: How, data: st.DataObject
):
    module, inputs = pair
    x = data.draw(inputs, label="inputs")
    check_gradients(problem(module, x, values_seed=seed, wrt_inputs=wrt_inputs), how)


@examples(0.5)
@given(checkpointed, devices(), st.data())
def test_data_parallel_equals_the_stateful_oracle(
    pair: tuple[torch.nn.Module, Any], devs: list[str], data: st.DataObject
):
    module, inputs = pair
    check_against_stateful(module, data.draw(inputs, label="inputs"), devs)


@examples(0.5)
@given(checkpointed, EQUAL_SHARDS, st.data())
def test_data_parallel_grad_equals_the_full_batch_stateful_gradient(
    pair: tuple[torch.nn.Module, Any], shards: tuple[list[str], int, int], data: st.DataObject
):
    module, inputs = pair
    check_data_parallel_grad(module, data.draw(inputs, label="inputs"), *shards)
