"""``fr.clip_grad_norm`` is ``torch.nn.utils.clip_grad_norm_`` bit for bit, on random trees and models.

Trees of mixed floating-point and complex dtypes (groups of several dtypes, in
torch's order of groups), views of every layout, tied leaves, non-tensor and
``None`` leaves; models of every classic kind, their real gradients in
``named_parameters()`` order (keys such as ``'10.weight'`` after
``'2.weight'``), every norm type torch takes.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from _property_clip import assert_bitwise, torch_clip
from _property_support import Unchanged, split_inputs
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
