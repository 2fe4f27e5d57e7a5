"""``fr.clip_grad_norm`` is ``torch.nn.utils.clip_grad_norm_`` bit for bit, on random trees and models.

Trees of mixed floating-point and complex dtypes (groups of several dtypes, in
torch's order of groups), views of every layout, tied leaves, non-tensor and
``None`` leaves; models of every classic kind, their real gradients in
``named_parameters()`` order (keys such as ``'10.weight'`` after
``'2.weight'``), every norm type torch takes; gradients of every dtype mix
(bfloat16 and float16 beside float32, float64 and complex64, up to 1,600
elements a leaf) on torch's foreach path and off it. And
``fr.distributed.clip_grad_norm`` of those mixes on 2 gloo ranks
(``_property_clip_ranks.py``): torch's total within ``pieced_slack`` (bit
for bit where only torch's own rounding is left), the same on every rank.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _property_clip import assert_bitwise, gradients, torch_clip
from _property_clip_ranks import Check
from _property_ddp import RankPool
from _property_support import Unchanged, bounded, examples, split_inputs
from hypothesis import given
from hypothesis import strategies as st

import freplicate as fr
from freplicate.testing import modules, trees

NORM_TYPES = st.sampled_from([2.0, 1.0, math.inf, -math.inf, 0.0, 0.5, 3.0, -1.0, "inf"])
MAX_NORMS = st.sampled_from([0.0, 1e-3, 0.5, 1.0, 4.0, 1e6, math.inf])
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
GRADIENTS = (*FLOATS, torch.complex64)


@given(trees(dtypes=GRADIENTS, max_leaves=8), MAX_NORMS, NORM_TYPES)
def test_trees_clip_as_torch(tree: Any, max_norm: float, norm_type: Any):
    unchanged = Unchanged(tree)
    try:
        want, want_norm = torch_clip(tree, max_norm, norm_type)
    except RuntimeError:  # an empty leaf has no max, min or negative-power norm
        with pytest.raises(ValueError, match=r"fr.clip_grad_norm: the gradient at .* is empty"):
            fr.clip_grad_norm(tree, max_norm, norm_type=norm_type)
        return
    got, norm = fr.clip_grad_norm(tree, max_norm, norm_type=norm_type)
    unchanged.check("fr.clip_grad_norm")
    assert_bitwise(norm, want_norm)
    assert_bitwise(got, want)


@given(modules(dtypes=FLOATS), MAX_NORMS, NORM_TYPES, st.data())
def test_model_gradients_clip_as_torch(
    pair: tuple[torch.nn.Module, Any], max_norm: float, norm_type: Any, data: st.DataObject
):
    module, inputs = pair
    args, kwargs = split_inputs(data.draw(inputs, label="inputs"))
    model = copy.deepcopy(module)
    out = model(*args, **kwargs)
    outs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
    loss = sum(o.float().square().sum() for o in outs if o.is_floating_point())
    if loss.requires_grad:  # a module without trainable parameters has no gradient at all
        loss.backward()
    # the tree a training loop holds: named_parameters() order, None where torch has no .grad
    grads = {k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()}
    got, norm = fr.clip_grad_norm(grads, max_norm, norm_type=norm_type)
    want_norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_norm, norm_type)
    want = {k: p.grad for k, p in model.named_parameters()}
    assert_bitwise(norm, want_norm)
    assert_bitwise(got, want)


BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
MIXES = st.sampled_from(
    [
        (F32, BF16),
        (F32, F16),
        (BF16,),
        (F16,),
        (BF16, F16),
        (F64, F32),
        (F64, BF16),
        (F64, F16),
        (torch.complex64, BF16),
        (BF16, F32, F16, F64),
    ]
)
# up to 40 x 40: sums long enough for float32 and bfloat16 to part, rows that do not divide
SHAPES = st.lists(st.lists(st.integers(0, 40), max_size=2).map(tuple), min_size=1, max_size=6)


@pytest.mark.filterwarnings("ignore:Casting complex values to real")  # torch's, at p = 0
@given(MIXES, SHAPES, MAX_NORMS, NORM_TYPES, st.integers(0, 2**16))
def test_dtype_mixes_clip_as_torch_on_and_off_the_foreach_path(
    dtypes: tuple[torch.dtype, ...],
    shapes: list[tuple[int, ...]],
    max_norm: float,
    norm_type: Any,
    seed: int,
):
    grads = gradients(dtypes, shapes, seed)
    try:
        want, want_norm = torch_clip(grads, max_norm, norm_type)
    except RuntimeError:  # an empty leaf has no max, min or negative-power norm
        return
    got, norm = fr.clip_grad_norm(grads, max_norm, norm_type=norm_type)
    assert_bitwise(norm, want_norm)
    assert_bitwise(got, want)
    # Parameter leaves: torch's foreach test turns them away, so both take vector_norm per leaf
    as_params = {k: torch.nn.Parameter(g, requires_grad=False) for k, g in grads.items()}
    got, norm = fr.clip_grad_norm(as_params, max_norm, norm_type=norm_type)
    assert_bitwise(norm, want_norm)
    assert_bitwise({k: v.data for k, v in got.items()}, want)


@pytest.fixture(scope="module")
def ranks(rank_pool: fr.testing.RankPool) -> Iterator[RankPool]:
    with bounded(rank_pool, 60.0) as pool:
        yield RankPool(pool)


@examples(0.3)
@given(MIXES, SHAPES, MAX_NORMS, NORM_TYPES, st.integers(0, 2**16))
def test_sharded_clip_of_dtype_mixes_is_clip_grad_norm_of_the_full_gradients(
    ranks: RankPool,
    dtypes: tuple[torch.dtype, ...],
    shapes: list[tuple[int, ...]],
    max_norm: float,
    norm_type: Any,
    seed: int,
):
    payload = {
        "dtypes": dtypes,
        "shapes": shapes,
        "max_norm": max_norm,
        "norm_type": norm_type,
        "seed": seed,
    }
    for rank, (status, value) in enumerate(
        ranks.run(Check("sharded_clip_of_dtype_mixes"), payload)
    ):
        assert status == "ok", f"rank {rank}: {value}"
