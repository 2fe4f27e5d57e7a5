"""``fr.GradScaler`` is ``torch.amp.GradScaler`` bit for bit, on random trees and models.

Trees of the dtypes GradScaler unscales (float32, float64, bfloat16), views
of every layout, tied leaves, non-tensor leaves, an inf or NaN planted in a
drawn leaf, scales that are powers of 2 and scales that are not. Models of
every classic kind and sparse embeddings, under float16 autocast on CPU:
their real scaled gradients unscaled both ways, SGD on both sides, for a few
steps from scales that overflow and scales that do not.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import optree
import torch
from _property_clip import assert_bitwise, bits
from _property_support import split_inputs, weighted_loss
from hypothesis import given
from hypothesis import strategies as st

import freplicate as fr
from freplicate.testing import modules, trees
from freplicate.testing._strategies import CLASSIC_KINDS

SCALES = st.sampled_from([1.0, 3.0, 0.125, 2.0**16, 2.0**24, 1e-30])
PLANTS = st.sampled_from([None, math.inf, -math.inf, math.nan])


def plant(tree: Any, value: float | None, seed: int) -> Any:
    """``tree`` with ``value`` written into one element of one tensor leaf (a copy of it)."""
    leaves, spec = optree.tree_flatten(tree)
    at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.numel()]
    if value is None or not at:
        return tree
    i = at[seed % len(at)]
    leaves[i] = t = leaves[i].clone()  # keeps the leaf's layout (a transposed view stays one)
    t[torch.unravel_index(torch.tensor(seed % t.numel()), t.shape)] = value
    return optree.tree_unflatten(spec, leaves)


def torch_unscale(tree: Any, init_scale: float) -> tuple[Any, float]:
    """GradScaler.unscale_ on parameters whose .grad are the leaves, and the scale update() leaves."""
    leaves, spec = torch.utils._pytree.tree_flatten(tree)
    params = {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            params[i] = p = torch.nn.Parameter(
                torch.zeros_like(leaf, memory_format=torch.contiguous_format)
            )
            p.grad = leaf.clone()
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    scaler.scale(torch.ones(()))  # GradScaler makes its scale on first use
    if params:
        opt = torch.optim.SGD(params.values(), lr=0.0)
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    out = [params[i].grad if i in params else leaf for i, leaf in enumerate(leaves)]
    return torch.utils._pytree.tree_unflatten(out, spec), scaler.get_scale()


@given(
    trees(dtypes=[torch.float32, torch.float64, torch.bfloat16]),
    SCALES,
    PLANTS,
    st.integers(0, 2**16),
)
def test_unscale_of_trees_as_grad_scaler(tree: Any, init_scale: float, value: Any, seed: int):
    tree = plant(tree, value, seed)
    tensors = [t for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
    before = [(t._version, bits(t).clone()) for t in tensors]  # bits: NaN equals itself
    scaler = fr.GradScaler(init_scale=init_scale)
    amp = scaler.init()
    got, found_inf = scaler.unscale(amp, tree)
    assert all(t._version == v and torch.equal(bits(t), b) for t, (v, b) in zip(tensors, before)), (
        "fr.GradScaler.unscale modified its input"
    )
    want, want_scale = torch_unscale(tree, init_scale)
    assert_bitwise(got, want)
    if any(isinstance(x, torch.Tensor) for x in optree.tree_leaves(tree)):
        assert float(scaler.update(amp, found_inf)["scale"]) == want_scale


@given(
    modules(kinds=[*CLASSIC_KINDS, "sparse"], training=True),
    st.sampled_from([2.0**8, 2.0**16, 2.0**40]),
    st.data(),
)
def test_fp16_steps_of_models_as_grad_scaler(
    pair: tuple[torch.nn.Module, Any], init_scale: float, data: st.DataObject
):
    module, inputs = pair
    model = copy.deepcopy(module)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    options = {"init_scale": init_scale, "growth_interval": 2}
    torch_scaler = torch.amp.GradScaler("cpu", **options)
    opt = torch.optim.SGD(params, lr=0.05)
    scaler = fr.GradScaler(**options)
    amp = scaler.init()
    mine = {k: p.detach().clone() for k, p in zip(names, params)}
    for step in range(3):
        args, kwargs = split_inputs(data.draw(inputs, label=f"inputs {step}"))
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = weighted_loss(model(*args, **kwargs)).float()
        torch_scaler.scale(loss).backward()
        # the scaled gradients, as the tree a functional step holds (None where unused)
        scaled = {k: None if p.grad is None else p.grad.clone() for k, p in zip(names, params)}
        torch_scaler.step(opt)
        torch_scaler.update()
        grads, found_inf = scaler.unscale(amp, scaled)
        updated = {
            k: p if grads[k] is None else p.add(grads[k], alpha=-0.05) for k, p in mine.items()
        }
        mine = scaler.step(found_inf, updated, mine)
        amp = scaler.update(amp, found_inf)
        assert float(amp["scale"]) == torch_scaler.get_scale(), step
        assert int(amp["growth_tracker"]) == torch_scaler._get_growth_tracker(), step
        assert_bitwise(mine, {k: p.detach() for k, p in zip(names, params)})
