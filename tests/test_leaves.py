"""``_leaves``: fresh differentiable leaves, small tensors of a shape stacked into one."""

from __future__ import annotations

import pytest
import torch

from freplicate import _leaves


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(2, 2, generator=g),
        torch.randn(3, generator=g),
        torch.randn(2, 2, generator=g),
        torch.randn(_leaves.STACK_NUMEL + 1, generator=g),
        torch.randn(3, generator=g),
        torch.randn(2, 2, generator=g, dtype=torch.float64),
    ]


def test_groups_by_shape_dtype_and_device_small_ones_only() -> None:
    ts = _tensors()
    sigs = [(t.shape, t.dtype, t.device) for t in ts]
    assert _leaves.stack_groups(sigs) == [[0, 2], [1, 4], [3], [5]]


def test_make_and_split_round_trip_with_the_gradients_of_each_position() -> None:
    ts = _tensors()
    layout = _leaves.Leaves([[0, 2], [1, 4], [3], [5]])
    made = layout.make(ts)
    assert made is not None
    diff, fresh = made
    assert [tuple(d.shape) for d in diff] == [(2, 2, 2), (2, 3), (4097,), (2, 2)]
    assert all(torch.equal(f, t) and f.dtype == t.dtype for f, t in zip(fresh, ts))
    assert all(t.grad is None and not t.requires_grad for t in ts)  # the inputs are untouched
    weights = [float(i + 1) for i in range(len(ts))]
    loss = sum((f.double() * w).sum() for f, w in zip(fresh, weights) if w != 5.0)  # 4 unused
    grads = layout.split(torch.autograd.grad(loss, diff, allow_unused=True, materialize_grads=True))
    for t, g, w in zip(ts, grads, weights):
        assert g.shape == t.shape and g.dtype == t.dtype
        assert torch.equal(g, torch.full_like(t, 0.0 if w == 5.0 else w))


def test_unstacked_layouts_keep_their_order() -> None:
    ts = _tensors()
    layout = _leaves.Leaves([[5], [4], [3], [2], [1], [0]])  # one leaf each, reversed
    made = layout.make(ts)
    assert made is not None
    diff, fresh = made
    assert [d.shape for d in diff] == [t.shape for t in reversed(ts)]
    assert all(f is d for f, d in zip(fresh, reversed(diff)))
    grads = layout.split(list(reversed(ts)))
    assert all(g is t for g, t in zip(grads, ts))


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_tensors_that_cannot_be_stacked_as_they_are_give_none() -> None:
    ts = _tensors()
    layout = _leaves.Leaves([[0, 2], [1], [3], [4], [5]])
    assert layout.make([ts[0].t(), *ts[1:]]) is None  # f would see other strides
    csr = [torch.eye(2).to_sparse_csr(), torch.eye(2).to_sparse_csr()]
    assert _leaves.Leaves([[0, 1]]).make(csr) is None


def test_small_or_odd_trees_are_never_stacked() -> None:
    few = [torch.ones(2) for _ in range(7)]
    assert _leaves.leaves_for(few) is _leaves.UNSTACKED
    subclass = [torch.ones(2).as_subclass(type("Sub", (torch.Tensor,), {})) for _ in range(9)]
    assert _leaves.leaves_for(subclass) is _leaves.UNSTACKED
    distinct = [torch.ones(i + 1) for i in range(9)]
    assert _leaves.leaves_for(distinct) is _leaves.UNSTACKED
    many = [torch.ones(2) for _ in range(9)]
    assert _leaves.leaves_for(many).sizes == [9]
    assert _leaves.leaves_for(many) is _leaves.leaves_for([torch.zeros(2) for _ in range(9)])
