"""Memory formats and alignment in one process: replicate, scatter, gather, all_reduce.

Every tensor leaf of a drawn tree is laid out anew at random: ``channels_last``
(4-D), ``channels_last_3d`` (5-D), its dims in a random memory order (dense,
strides permuted), every other element of a larger tensor (not dense), or as
``fr.testing.trees`` drew it (views among them). The reference is torch's own
op on each leaf: ``t.to(device)`` for a replica and a scatter's chunk,
``torch.cat`` of the parts moved for a gather, the sum for an all-reduce. A
leaf's strides are compared on its dims of size more than 1 (a dim of size 1
addresses nothing; torch's own ops differ on its stride). Results that are
views of a packed buffer (moved, or summed under autograd) start at a multiple of 64
bytes of it: on ``meta``, which holds no data, their storage offsets say so.
"""

from __future__ import annotations

from typing import Any

import optree
import torch
from _property_support import Unchanged, refill, tensor_leaves
from hypothesis import given
from hypothesis import strategies as st

import freplicate as fr
from freplicate.testing import trees
from freplicate.testing._strategies import FLOAT_DTYPES

LAYOUTS = ("as drawn", "memory order", "channels_last", "not dense")
host_and_meta = st.lists(st.sampled_from(["cpu", "meta"]), min_size=1, max_size=3)
SUMMABLE = (*FLOAT_DTYPES, torch.int64, torch.int32)


def relaid(t: torch.Tensor, how: str, order: list[int]) -> torch.Tensor:
    """``t``'s values in another layout (``order``: a permutation of its dims)."""
    if how == "memory order":
        inverse = sorted(range(t.dim()), key=order.__getitem__)
        return t.permute(order).contiguous().permute(inverse)
    if how == "channels_last" and t.dim() in (4, 5):
        fmt = torch.channels_last if t.dim() == 4 else torch.channels_last_3d
        return t.contiguous(memory_format=fmt)
    if how == "not dense":
        return torch.stack([t, t], dim=-1)[..., 0]
    return t


@st.composite
def layouts(draw: Any, tree: Any) -> list[tuple[str, list[int]]]:
    """One layout per tensor leaf position of ``tree``."""
    out = []
    for t in tensor_leaves(tree):
        how = draw(st.sampled_from(LAYOUTS))
        out.append((how, draw(st.permutations(range(t.dim())))))
    return out


def apply_layouts(tree: Any, chosen: list[tuple[str, list[int]]]) -> Any:
    """``tree`` with its tensor leaves laid out as ``chosen`` (a tied leaf stays one tensor)."""
    leaves, spec = optree.tree_flatten(tree)
    made: dict[int, torch.Tensor] = {}
    picks = iter(chosen)
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            how, order = next(picks)
            if id(leaf) not in made:
                made[id(leaf)] = relaid(leaf, how, order)
            leaf = made[id(leaf)]
        out.append(leaf)
    return optree.tree_unflatten(spec, out)


def size_one_free(t: torch.Tensor) -> tuple[int | None, ...] | None:
    """``t``'s strides but those of dims of size 1; ``None`` for an empty tensor (no layout)."""
    if t.numel() == 0:
        return None
    return tuple(s if n != 1 else None for s, n in zip(t.stride(), t.shape))


def dense(t: torch.Tensor) -> bool:
    return bool(torch.empty_like(t).stride() == t.stride() or t.numel() <= 1)


def check_like(got: torch.Tensor, t: torch.Tensor, device: str, what: str) -> None:
    """``got`` is ``t.to(device)``: values where there are some, and layout."""
    want = t.to(device)
    assert (got.device, got.dtype, got.shape) == (want.device, want.dtype, want.shape), what
    assert size_one_free(got) == size_one_free(want), what
    if dense(t):
        assert size_one_free(got) == size_one_free(t), what  # a dense input's own strides
    if got.device.type == "cpu":
        assert torch.equal(got, want), what
    if got.device != t.device:  # moved: a view of a packed buffer, 64-byte aligned in it
        assert got.storage_offset() * got.element_size() % 64 == 0, what


@given(
    trees(max_dims=5, max_leaves=5).flatmap(lambda t: st.tuples(st.just(t), layouts(t))),
    host_and_meta,
)
def test_replicas_are_their_leaves_moved_as_to_moves_them(drawn: Any, devs: list[str]):
    tree = apply_layouts(*drawn)
    unchanged = Unchanged(tree)
    replicas = fr.replicate(tree, devs)
    unchanged.check("fr.replicate")
    for device, replica in zip(devs, replicas):
        for i, (got, t) in enumerate(zip(tensor_leaves(replica), tensor_leaves(tree))):
            check_like(got, t, device, f"replica on {device}, leaf {i}")


batched = st.integers(1, 4).flatmap(
    lambda b: trees(batch_size=b, max_dims=5, max_leaves=4).flatmap(
        lambda t: st.tuples(st.just(t), layouts(t))
    )
)


@given(batched, host_and_meta, st.data())
def test_shards_are_chunks_moved_and_gather_is_torch_cat(
    drawn: Any, devs: list[str], data: st.DataObject
):
    tree = apply_layouts(*drawn)
    unchanged = Unchanged(tree)
    shards = fr.scatter(tree, devs)
    unchanged.check("fr.scatter")
    leaves = tensor_leaves(tree)
    chunks = [t.chunk(len(devs)) for t in leaves]
    for i, shard in enumerate(shards):
        for k, got in enumerate(tensor_leaves(shard)):
            check_like(got, chunks[k][i], devs[i], f"shard {i}, leaf {k}")
    # gather: onto meta when some part lies there (meta holds nothing to copy back)
    target = (
        "meta" if "meta" in devs[: len(shards)] else data.draw(st.sampled_from(["cpu", "meta"]))
    )
    versions = [t._version for s in shards for t in tensor_leaves(s)]
    out = fr.gather(shards, target)
    assert versions == [t._version for s in shards for t in tensor_leaves(s)]
    for k, got in enumerate(tensor_leaves(out)):
        parts = [tensor_leaves(s)[k].to(target) for s in shards]
        want = torch.stack(parts) if parts[0].dim() == 0 else torch.cat(parts)
        assert got.shape == want.shape and size_one_free(got) == size_one_free(want), k
        if target == "cpu":
            assert torch.equal(got, want), k


@given(
    trees(dtypes=SUMMABLE, max_dims=5, max_leaves=5, views=False).flatmap(
        lambda t: st.tuples(st.just(t), layouts(t))
    ),
    st.integers(1, 3),
    st.sampled_from(["sum", "mean"]),
    st.booleans(),
    st.integers(0, 2**16),
)
def test_all_reduce_sums_in_tree_0s_layout(
    drawn: Any, n: int, op: str, requires_grad: bool, seed: int
):
    tree, chosen = drawn
    if op == "mean":
        tree = optree.tree_map(
            lambda x: x.float() if isinstance(x, torch.Tensor) and not x.is_floating_point() else x,
            tree,
        )
    inputs = [apply_layouts(refill(tree, seed + i), chosen) for i in range(n)]
    if requires_grad:  # the packed path (autograd), else torch's fused sums
        inputs = [
            optree.tree_map(
                lambda x: (
                    x.detach().requires_grad_()
                    if isinstance(x, torch.Tensor) and x.is_floating_point()
                    else x
                ),
                t,
            )
            for t in inputs
        ]
    unchanged = Unchanged(inputs)
    results = fr.all_reduce(inputs, op=op)
    unchanged.check("fr.all_reduce")
    columns = list(zip(*(tensor_leaves(t) for t in inputs)))
    for result in results:
        for k, (got, column) in enumerate(zip(tensor_leaves(result), columns)):
            total = sum(c.detach().to(torch.float64) for c in column)
            want = (total / n if op == "mean" else total).to(got.dtype)
            torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)
            first = column[0]
            # tree 0's leaf moved is the layout of the sum ("as .to() lays it out")
            assert size_one_free(got) == size_one_free(first.to("meta")), k
            if got.numel():
                assert got.data_ptr() % 64 == 0, k
