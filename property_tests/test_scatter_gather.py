"""``fr.scatter`` and ``fr.gather``: cut as ``torch.chunk`` does, and gather undoes scatter.

Containers that optree keeps whole (a ``ModelOutput``, a dataclass, a list
subclass) are taken apart and joined as ``nn.parallel``'s scatter and gather
do: the reference is ``fr.testing``'s oracle, which follows their recursion.
"""

from __future__ import annotations

import re
from typing import Any

import optree
import pytest
import torch
from _property_support import Unchanged, refill, tensor_leaves, to_device
from hypothesis import given
from hypothesis import strategies as st

import freplicate as fr
from freplicate import _tree
from freplicate.testing import _oracle, assert_trees_close, devices, trees
from freplicate.testing._strategies import FLOAT_DTYPES, Items

batched = st.integers(0, 6).flatmap(lambda b: trees(batch_size=b, max_leaves=5))


@given(batched, devices())
def test_shards_are_the_chunks_of_every_leaf(tree: Any, devs: list[str]):
    unchanged = Unchanged(tree)
    shards = fr.scatter(tree, devs)
    unchanged.check("fr.scatter")
    leaves = optree.tree_leaves(tree)
    chunks = [t.chunk(len(devs)) for t in tensor_leaves(tree)]
    assert len(shards) == min((len(c) for c in chunks), default=len(devs))
    for i, shard in enumerate(shards):
        assert optree.tree_structure(shard) == optree.tree_structure(tree)
        got = optree.tree_leaves(shard)
        k = 0
        for x, a in zip(got, leaves):
            if isinstance(a, torch.Tensor):
                torch.testing.assert_close(x, chunks[k][i].to(devs[i]), rtol=0, atol=0)
                k += 1
            else:
                assert x is a, "a non-tensor leaf is shared by every shard"


@given(batched, devices())
def test_gather_undoes_scatter(tree: Any, devs: list[str]):
    shards = fr.scatter(tree, devs)
    unchanged = Unchanged(shards)
    back = fr.gather(shards, devs[0])
    unchanged.check("fr.gather")
    assert_trees_close(back, to_device(tree, devs[0]), rtol=0, atol=0)


@given(
    st.integers(1, 6).flatmap(
        lambda b: trees(batch_size=b, dtypes=FLOAT_DTYPES, non_tensor_leaves=False, aliased=False)
    ),
    devices(),
    st.integers(0, 2**16),
)
def test_scatter_then_gather_passes_gradients_through(tree: Any, devs: list[str], seed: int):
    tree = optree.tree_map(lambda t: t.detach().requires_grad_(True), tree)
    weights = refill(tree, seed, devs[0])
    out = fr.gather(fr.scatter(tree, devs), devs[0])
    loss = sum(
        (o.double() * w.double()).sum() for o, w in zip(tensor_leaves(out), tensor_leaves(weights))
    )
    if not tensor_leaves(tree):
        return
    grads = torch.autograd.grad(loss, tensor_leaves(tree))
    for g, w in zip(grads, tensor_leaves(weights)):
        torch.testing.assert_close(g, w.to(g.device), rtol=0, atol=0)


@given(trees(max_dims=0, max_leaves=5, aliased=False), devices(), st.integers(0, 2**16))
def test_gather_stacks_0_dim_leaves_and_merges_equal_non_tensors(
    tree: Any, devs: list[str], seed: int
):
    replicas = [refill(tree, seed + i, d) for i, d in enumerate(devs)]
    out = fr.gather(replicas, devs[0])
    columns = zip(*(optree.tree_leaves(r) for r in replicas))
    for x, column in zip(optree.tree_leaves(out), columns):
        if isinstance(column[0], torch.Tensor):
            expected = torch.stack([c.to(devs[0]) for c in column])
            torch.testing.assert_close(x, expected, rtol=0, atol=0)
        else:
            assert x == column[0], "non-tensor leaves equal in every tree come back once"


@given(trees(max_leaves=4), st.data())
def test_gather_of_different_structures_names_the_path(tree: Any, data: st.DataObject):
    accessors, leaves, spec = optree.tree_flatten_with_accessor(tree)
    if not leaves:
        return
    i = data.draw(st.integers(0, len(leaves) - 1))
    other = list(leaves)
    other[i] = [leaves[i], leaves[i]]  # one leaf becomes a list: the structures part there
    bent = optree.tree_unflatten(spec, other)
    with pytest.raises(ValueError, match=r"fr\.gather: .*" + re.escape(accessors[i].codify(""))):
        fr.gather([tree, bent], "cpu")


@given(
    st.integers(0, 5).flatmap(lambda b: trees(batch_size=b, max_leaves=4)),
    devices(),
    st.sampled_from([1, -1]),
)
def test_scatter_and_gather_along_another_dim(tree: Any, devs: list[str], dim: int):
    def batch_at_dim(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        return x.unsqueeze(0) if dim == 1 else x.movedim(0, -1)

    tree = optree.tree_map(batch_at_dim, tree)
    shards = fr.scatter(tree, devs, dim=dim)
    chunks = [t.chunk(len(devs), dim) for t in tensor_leaves(tree)]
    assert len(shards) == min((len(c) for c in chunks), default=len(devs))
    for i, shard in enumerate(shards):
        for x, c in zip(tensor_leaves(shard), chunks):
            torch.testing.assert_close(x, c[i].to(devs[i]), rtol=0, atol=0)
    assert_trees_close(
        fr.gather(shards, devs[0], dim=dim), to_device(tree, devs[0]), rtol=0, atol=0
    )


@given(trees(max_leaves=5), devices())
def test_gather_returns_unequal_non_tensor_leaves_as_a_tuple(tree: Any, devs: list[str]):
    def per_tree(i: int) -> Any:
        return optree.tree_map(
            lambda x: x if isinstance(x, torch.Tensor) else f"{x!r} in {i}", tree
        )

    # 0-dim and higher leaves alike: the same tensors in every tree
    replicas = [to_device(per_tree(i), d) for i, d in enumerate(devs)]
    out = fr.gather(replicas, devs[0])
    # flatten the result up to the trees' leaves: a tuple there is one leaf of the result
    at_leaves = optree.tree_structure(replicas[0]).flatten_up_to(out)
    for x, column in zip(at_leaves, zip(*map(optree.tree_leaves, replicas))):
        if not isinstance(column[0], torch.Tensor):
            expected = column[0] if len(devs) == 1 else column
            assert x == expected


@given(trees(max_leaves=5), devices())
def test_leaves_of_different_lengths_give_the_fewest_chunks(tree: Any, devs: list[str]):
    # every tensor leaf at least 1-D (0-dim ones cannot be split), lengths drawn independently
    tree = optree.tree_map(lambda x: x.reshape(1) if _is_0_dim(x) else x, tree)
    shards = fr.scatter(tree, devs)
    chunks = [t.chunk(len(devs)) for t in tensor_leaves(tree)]
    assert len(shards) == min((len(c) for c in chunks), default=len(devs))
    for i, shard in enumerate(shards):
        for x, c in zip(tensor_leaves(shard), chunks):
            torch.testing.assert_close(x, c[i].to(devs[i]), rtol=0, atol=0)


def _is_0_dim(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 0


# --- containers optree keeps whole: a ModelOutput, a dataclass, a list subclass

with_containers = st.integers(0, 6).flatmap(
    lambda b: trees(batch_size=b, max_leaves=5, containers=True)
)


def _as_scattered(tree: Any) -> Any:
    """``tree`` opened (``_oracle._opened``), each list subclass as the plain list that
    ``nn.parallel.scatter`` makes of it (``fr.scatter`` keeps the type)."""

    def items(x: Any) -> bool:
        return isinstance(x, _oracle.Container) and x.type is Items

    def plain(x: Any) -> Any:
        return optree.tree_map(lambda y: plain(y.contents) if items(y) else y, x, is_leaf=items)

    return plain(_oracle._opened(tree))


@given(with_containers, devices())
def test_scatter_takes_containers_apart_as_nn_parallel_scatter(tree: Any, devs: list[str]):
    unchanged = Unchanged(_tree.flatten_containers(tree)[0])
    shards = fr.scatter(tree, devs)
    unchanged.check("fr.scatter")
    expected = _oracle._scatter(tree, [torch.device(d) for d in devs])
    assert len(shards) == len(expected)
    leaves, spec = _tree.flatten_containers(tree, dataclasses=False)
    for shard, theirs in zip(shards, expected):
        assert_trees_close(_as_scattered(shard), _as_scattered(theirs), rtol=0, atol=0)
        # every container keeps its type; dataclasses and non-tensor leaves are shared
        mine, shard_spec = _tree.flatten_containers(shard, dataclasses=False)
        assert shard_spec == spec
        assert all(m is x for m, x in zip(mine, leaves) if not isinstance(x, torch.Tensor))


@given(trees(max_leaves=5, containers=True), devices(), st.integers(0, 2**16))
def test_gather_joins_containers_as_nn_parallel_gather_keeping_their_types(
    tree: Any, devs: list[str], seed: int
):
    replicas = [
        _tree.unflatten(spec, refill(leaves, seed + i, d))
        for i, d in enumerate(devs)
        for leaves, spec in [_tree.flatten_containers(tree)]
    ]
    unchanged = Unchanged([_tree.flatten_containers(r)[0] for r in replicas])
    out = fr.gather(replicas, devs[0])
    unchanged.check("fr.gather")
    # nn.parallel.gather's recursion, with fr.gather's rule where it raises (dataclasses, other leaves)
    expected = _oracle._gather(replicas, torch.device(devs[0]))
    assert_trees_close(_oracle._opened(out), _oracle._opened(expected), rtol=0, atol=0)
