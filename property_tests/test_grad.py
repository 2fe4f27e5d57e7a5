"""``fr.grad_and_value`` returns exactly ``torch.func.grad_and_value``'s trees and values.

Over random trees (aliased leaves included: both treat every position on its
own), random argnums and aux, random modules through ``fr.apply``, and under
``torch.func.vmap`` (per-example gradients), where it must still compose.
"""

from __future__ import annotations

from typing import Any

import optree
import torch
import torch.func
from _property_support import Unchanged, refill
from hypothesis import given
from hypothesis import strategies as st

import freplicate as fr
from freplicate import _leaves
from freplicate.testing import assert_trees_close, modules, trees

FLOATS = (torch.float32, torch.float64)
params_trees = trees(dtypes=FLOATS, non_tensor_leaves=False, max_leaves=5)


def _objective(weights: Any, skip: int) -> Any:
    """A smooth scalar of a tree; every ``skip``-th leaf does not reach it (zero gradient)."""

    def f(tree: Any, scale: torch.Tensor) -> torch.Tensor:
        total = scale.sum() * 0
        for i, (x, w) in enumerate(zip(optree.tree_leaves(tree), optree.tree_leaves(weights))):
            if skip and i % skip == skip - 1:
                continue
            total = total + (torch.sin(x * scale) * w).double().sum()
        return total

    return f


@given(params_trees, st.integers(0, 2**16), st.integers(0, 3), st.booleans())
def test_equals_torch_func_on_random_trees(tree: Any, seed: int, skip: int, aux: bool):
    weights = refill(tree, seed, integral=False)
    f = _objective(weights, skip)
    fn = (lambda t, s: (f(t, s), {"scaled": s * 2})) if aux else f
    scale = torch.tensor(1.5)
    unchanged = Unchanged(tree, scale)
    got = fr.grad_and_value(fn, has_aux=aux)(tree, scale)
    unchanged.check("fr.grad_and_value")
    assert_trees_close(got, torch.func.grad_and_value(fn, has_aux=aux)(tree, scale))


@given(params_trees, params_trees, st.sampled_from([0, 1, (0, 1), (1, 0)]), st.integers(0, 2**16))
def test_equals_torch_func_for_every_argnums(a: Any, b: Any, argnums: Any, seed: int):
    fa, fb = (
        _objective(refill(a, seed, integral=False), 0),
        _objective(refill(b, seed + 1, integral=False), 0),
    )

    def fn(x: Any, y: Any, scale: torch.Tensor) -> torch.Tensor:
        return fa(x, scale) + fb(y, scale)

    scale = torch.tensor(0.7)
    got = fr.grad_and_value(fn, argnums=argnums)(a, b, scale)
    assert_trees_close(got, torch.func.grad_and_value(fn, argnums=argnums)(a, b, scale))


@given(modules(dtypes=(torch.float32, torch.float64)), st.data())
def test_equals_torch_func_through_fr_apply(pair: tuple[torch.nn.Module, Any], data: st.DataObject):
    module, inputs = pair
    x = data.draw(inputs, label="inputs")
    args, kwargs = ((), x) if isinstance(x, dict) else ((x if isinstance(x, tuple) else (x,)), {})
    s = fr.state(module)

    def loss(params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
        out, new = fr.apply(module, fr.State(params, s.buffers), *args, **kwargs)
        total = sum(leaf.double().pow(2).sum() for leaf in optree.tree_leaves(out))
        return total, new.buffers

    unchanged = Unchanged(s, args, kwargs)
    got = fr.grad_and_value(loss, has_aux=True)(s.params)
    unchanged.check("fr.grad_and_value")
    assert_trees_close(got, torch.func.grad_and_value(loss, has_aux=True)(s.params))


@given(params_trees, st.integers(1, 4), st.integers(0, 2**16))
def test_composes_under_vmap(tree: Any, batch: int, seed: int):
    f = _objective(refill(tree, seed, integral=False), 2)
    scales = torch.linspace(-1.0, 1.0, batch)
    got = torch.func.vmap(fr.grad_and_value(f), in_dims=(None, 0))(tree, scales)
    want = torch.func.vmap(torch.func.grad_and_value(f), in_dims=(None, 0))(tree, scales)
    assert_trees_close(got, want)


@st.composite
def _many_small(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    """Up to 40 small tensors drawn from three shapes and two dtypes (a few too large to stack),
    some transposed views, in any order: the trees ``fr.grad_and_value`` stacks."""
    shapes = draw(
        st.lists(st.sampled_from([(), (1,), (3,), (2, 3), (4, 4)]), min_size=1, max_size=3)
    )
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    tree = {}
    for i in range(draw(st.integers(2, 40))):
        big = draw(st.integers(0, 15)) == 0
        shape = (_leaves.STACK_NUMEL + 1,) if big else draw(st.sampled_from(shapes))
        t = torch.randn(shape, generator=g, dtype=draw(st.sampled_from(FLOATS)))
        if t.dim() == 2 and draw(st.booleans()):
            t = t.t()
        tree[f"t{i}"] = t
    return tree


@given(_many_small(), st.integers(0, 3), st.booleans())
def test_stacked_small_leaves_equal_torch_func_to_the_bit(tree: Any, skip: int, no_grad: bool):
    f = _objective(refill(tree, 7, integral=False), skip)
    scale = torch.tensor(1.3)
    unchanged = Unchanged(tree, scale)
    with torch.set_grad_enabled(not no_grad):
        got = fr.grad_and_value(f)(tree, scale)
    unchanged.check("fr.grad_and_value")
    want = torch.func.grad_and_value(f)(tree, scale)
    assert_trees_close(got, want, rtol=0, atol=0)
