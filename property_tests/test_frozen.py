"""Frozen parameters (``requires_grad_(False)``): a fine-tuning loop leaves them alone.

The loop is the one ``docs/frozen_parameters.md`` teaches: ``fr.partition``
splits the parameters by the module's own ``requires_grad`` flags, only the
trainable part is differentiated and updated, ``fr.combine`` binds both. The
frozen parameters get no gradient, stay bit-identical (the very tensors
``fr.state`` gave), and the trainable ones follow the stateful loop
(``torch.optim.SGD`` on the same module). ``fr.data_parallel_grad`` over the
trainable part equals the stateful full-batch gradient. DDP:
``test_distributed.py``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from _property_oracle import EQUAL_SHARDS, check_data_parallel_grad
from _property_support import split_inputs, tolerances, trainable, weighted_loss
from hypothesis import given
from hypothesis import strategies as st

import freplicate as fr
from freplicate.testing import assert_trees_close, modules

FLOATS = (torch.float32, torch.float64)
FINE_TUNED = [
    "mlp",
    "conv",
    "batchnorm",
    "tied",
    "buffers",
    "nested",
    "unused",
    "positional",
    "keywords",
    "sparse",
]
LR = 0.1


@given(modules(kinds=FINE_TUNED, dtypes=FLOATS, frozen=True), st.integers(1, 3), st.data())
def test_fine_tuning_leaves_frozen_parameters_bit_identical(
    pair: tuple[torch.nn.Module, Any], steps: int, data: st.DataObject
):
    module, inputs = pair
    args, kwargs = split_inputs(data.draw(inputs, label="inputs"))
    s = fr.state(module)
    train, frozen = fr.partition(s.params, module)
    assert list(train) == list(trainable(module, s.params)), "split by the module's own flags"
    assert all(v is s.params[k] for k, v in (*train.items(), *frozen.items())), "no copies"

    def loss_fn(train: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> Any:
        out, new = fr.apply(module, fr.State(fr.combine(train, frozen), buffers), *args, **kwargs)
        return weighted_loss(out), new.buffers

    buffers = s.buffers
    for _ in range(steps):
        grads, (_, buffers) = fr.grad_and_value(loss_fn, has_aux=True)(train, buffers)
        assert grads.keys() == train.keys(), "a gradient for a frozen parameter"
        train = {k: p - LR * grads[k] for k, p in train.items()}
    params = fr.combine(train, frozen)

    reference = copy.deepcopy(module)
    learnt = [p for p in reference.parameters() if p.requires_grad]
    sgd = torch.optim.SGD(learnt or [torch.zeros(0, requires_grad=True)], lr=LR)
    for _ in range(steps):
        sgd.zero_grad()
        loss = weighted_loss(reference(*args, **kwargs))
        if loss.requires_grad:  # not when every parameter that reaches it is frozen
            loss.backward()
        sgd.step()

    for k in frozen:
        assert params[k] is s.params[k], f"the frozen {k!r} was replaced"
        assert torch.equal(params[k], module.get_parameter(k)), f"the frozen {k!r} changed"
        assert reference.get_parameter(k).grad is None
    tol = tolerances(next(iter(s.params.values())).dtype) if s.params else {}
    want = {k: reference.get_parameter(k).detach() for k in params}
    assert_trees_close(params, want, **tol)
    assert_trees_close(dict(buffers), {k: b for k, b in reference.named_buffers()}, **tol)


@given(
    modules(
        kinds=["mlp", "tied", "nested", "unused", "positional", "conv", "sparse"],
        dtypes=FLOATS,
        training=False,
        frozen=True,
    ),
    EQUAL_SHARDS,
    st.data(),
)
def test_data_parallel_grad_differentiates_only_the_trainable_parameters(
    pair: tuple[torch.nn.Module, Any], shards: tuple[list[str], int, int], data: st.DataObject
):
    module, inputs = pair
    check_data_parallel_grad(module, data.draw(inputs, label="inputs"), *shards)
