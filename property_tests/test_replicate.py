"""``fr.replicate``: values, structure, devices and ties kept; its gradient is the sum over replicas.

A leaf already on a target device is not copied, yet every replica gets
tensor objects of its own on that memory (issue 11, item 5): a forward that
writes ``.grad`` on its replica must never reach the caller's tensors.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

import optree
import torch
import torch.func
from _property_support import Unchanged, to_device
from hypothesis import given
from hypothesis import strategies as st

import freplicate as fr
from freplicate.testing import assert_trees_close, devices, modules, trees
from freplicate.testing._strategies import FLOAT_DTYPES


@given(trees(), devices(), st.booleans())
def test_replicas_keep_values_structure_devices_and_ties(tree: Any, devs: list[str], detach: bool):
    unchanged = Unchanged(tree)
    replicas = fr.replicate(tree, devs, detach=detach)
    unchanged.check("fr.replicate")
    assert len(replicas) == len(devs)
    leaves = optree.tree_leaves(tree)
    seen: set[int] = set()  # tensor objects handed out, to no two replicas the same
    for replica, dev in zip(replicas, devs):
        assert_trees_close(replica, to_device(tree, dev))
        got = optree.tree_leaves(replica)
        for i, (a, x) in enumerate(zip(leaves, got)):
            if not isinstance(a, torch.Tensor):
                assert x is a, "a non-tensor leaf must pass by reference"
                continue
            if a.device == torch.device(dev):
                _shares_storage(x, a)
            for j in range(i):
                # tied leaves stay one object within each replica, and only they do
                assert (got[j] is x) == (leaves[j] is a)
        objects = {id(x) for x in got if isinstance(x, torch.Tensor)}
        assert not objects & seen, "two replicas share a tensor object"
        seen |= objects


def _shares_storage(x: torch.Tensor, a: torch.Tensor) -> None:
    """``x`` is a tensor object of its own on ``a``'s memory: zero copy, yet not the caller's."""
    assert x is not a, "a replica must not hand out the caller's own tensor object"
    assert x.untyped_storage().data_ptr() == a.untyped_storage().data_ptr(), "copied"
    assert (x.storage_offset(), x.stride()) == (a.storage_offset(), a.stride())


def _with_grad(tree: Any) -> Any:
    """Fresh leaves that require grad, ties kept."""
    made: dict[int, torch.Tensor] = {}
    leaves, spec = optree.tree_flatten(tree)
    fresh = [made.setdefault(id(t), t.detach().clone().requires_grad_(True)) for t in leaves]
    return optree.tree_unflatten(spec, fresh)


def _weights(n_leaves: int, n_replicas: int, seed: int) -> list[list[int]]:
    # small integer weights: every gradient below is an exact sum in any float dtype
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, (n_replicas, n_leaves), generator=g).tolist()


@given(trees(dtypes=FLOAT_DTYPES, non_tensor_leaves=False), devices(), st.integers(0, 2**16))
def test_gradient_reaching_the_tree_is_the_sum_over_replicas(tree: Any, devs: list[str], seed: int):
    tree = _with_grad(tree)
    leaves = optree.tree_leaves(tree)
    if not leaves:
        return
    w = _weights(len(leaves), len(devs), seed)
    replicas = fr.replicate(tree, devs)
    loss = sum(
        (x.double() * w[r][i]).sum()
        for r, rep in enumerate(replicas)
        for i, x in enumerate(optree.tree_leaves(rep))
    )
    unique = list({id(t): t for t in leaves}.values())
    grads = torch.autograd.grad(loss, unique, allow_unused=True, materialize_grads=True)
    for t, g in zip(unique, grads):
        expected = torch.zeros_like(t)
        for r in range(len(devs)):
            for i, x in enumerate(leaves):
                if x is t:
                    expected += w[r][i]
        torch.testing.assert_close(g, expected, rtol=0, atol=0)


@given(
    trees(dtypes=(torch.float32, torch.float64), non_tensor_leaves=False, aliased=False),
    devices(),
    st.integers(0, 2**16),
)
def test_gradient_under_torch_func_grad_is_the_sum(tree: Any, devs: list[str], seed: int):
    leaves = optree.tree_leaves(tree)
    w = _weights(len(leaves), len(devs), seed)

    def loss(t: Any) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64)
        for r, rep in enumerate(fr.replicate(t, devs)):
            for i, x in enumerate(optree.tree_leaves(rep)):
                total = total + (x.double() * w[r][i]).sum().to("cpu")
        return total

    grads = torch.func.grad(loss)(tree)
    expected = optree.tree_unflatten(
        optree.tree_structure(tree),
        [
            torch.full_like(x, float(sum(w[r][i] for r in range(len(devs)))))
            for i, x in enumerate(leaves)
        ],
    )
    assert_trees_close(grads, expected, rtol=0, atol=0)


@given(trees(dtypes=FLOAT_DTYPES, non_tensor_leaves=False), devices())
def test_detached_replicas_carry_no_graph(tree: Any, devs: list[str]):
    tree = _with_grad(tree)
    for replica in fr.replicate(tree, devs, detach=True):
        assert all(x.grad_fn is None for x in optree.tree_leaves(replica))


@given(trees(), devices(max_size=2), st.booleans())
def test_replicas_on_the_meta_device_keep_structure_shapes_and_dtypes(
    tree: Any, devs: list[str], detach: bool
):
    *real, meta = fr.replicate(tree, [*devs, "meta"], detach=detach)
    assert optree.tree_structure(meta) == optree.tree_structure(tree)
    for x, a in zip(optree.tree_leaves(meta), optree.tree_leaves(tree)):
        if isinstance(a, torch.Tensor):
            assert (x.device.type, x.dtype, x.shape) == ("meta", a.dtype, a.shape)
        else:
            assert x is a
    for replica, dev in zip(real, devs):
        assert_trees_close(replica, to_device(tree, dev))


@given(modules(), devices())
def test_replicas_of_a_state_equal_deep_copies_of_the_module(pair: Any, devs: list[str]):
    """The State fast path (every tensor already on every target) and the general one alike."""
    module, _ = pair
    s = fr.state(module)
    unchanged = Unchanged(s)
    replicas = fr.replicate(s, devs)
    unchanged.check("fr.replicate")
    for replica, dev in zip(replicas, devs):
        assert type(replica) is fr.State
        copy = deepcopy(module).to(dev)
        assert list(replica.params) == list(s.params) and list(replica.buffers) == list(s.buffers)
        assert_trees_close(replica.params, dict(copy.named_parameters()))
        assert_trees_close(replica.buffers, dict(copy.named_buffers()))
        for k, v in s.params.items():  # storage shared where already on the device, else moved
            if v.device == torch.device(dev):
                _shares_storage(replica.params[k], v)
            assert replica.params[k].device == torch.device(dev)
